/*
 * lora.h - the public header of adapters/: PEFT LoRA adapters on a
 * quantized model.
 *
 * It offers four things, each in its own file:
 *   - loading (peft.c; pattern.c, internal, compiles PEFT's Python
 *     regular expressions as POSIX ones): a PEFT adapter folder
 *     (adapter_config.json and adapter_model.safetensors) checked against
 *     a loaded model and turned into an eng_lora, the engine's view of an
 *     adapter (engine/model/model.h): per layer and projection, A, B and
 *     the module's scale. Tensors are borrowed from the mapped file where their layout allows;
 *   - the merge and its dispatch (merge.c): given a target weight, the
 *     merge for its quant kind, or "unsupported" naming the kind. A merge
 *     dequantizes the pristine weight, adds each scale * B @ A, checks the
 *     result is finite and requantizes into the weight's own kind and block
 *     layout (or a wider kind when asked), and reports what the
 *     requantization cost. Unmerging and unmerged application are the same
 *     for every kind and are not dispatched: an unmerge serves the pristine
 *     weight, and the engine applies an unmerged adapter itself
 *     (eng_lora_apply, engine/runtime/runtime.h);
 *   - the registry (registry.c): the adapters loaded on an engine, by name,
 *     with a memory budget; merge and unmerge build a new weight version
 *     beside the serving one and publish it between two engine steps;
 *   - the journal (state.c): the registry's state (loaded adapters, the
 *     merged configuration) in a JSON file written atomically after each
 *     change and replayed at start, and the check that an adapter folder
 *     lies inside the adapter directory.
 *
 * Unmerged application is exact (the quantized base plus the adapter in
 * f32, what QLoRA trained), or, as serve keeps adapters by default, A and B
 * rounded to bf16 at load and multiplied in f32 (lora_dtype); merging is
 * fast and approximate, and every merge says how approximate
 * (delta_retained, relative_error).
 *
 * It owns the adapters it loads (refcounted eng_lora) and the registry's
 * table; it touches the engine only through engine/model/model.h (publishing weight
 * versions, eng_engine_prepare) and the model only to read it.
 *
 * Errors: QL_OK or a negative QL_E* code (base/ql_base.h), with a sentence naming
 * the adapter, the file, the module and the value in msg. QL_ENOTFOUND:
 * no such adapter; QL_ECONFLICT: not now (unloading a merged adapter);
 * QL_ENONFINITE: a merge produced NaN or Inf (nothing changed).
 */
#ifndef QL_LORA_H
#define QL_LORA_H

#include "model.h"
#include "scheduler.h"

/* --- loading (adapters/peft.c) ------------------------------------------- */

/* What an adapter's config says, for listings. */
typedef struct lora_meta {
    int32_t r;       /* the config's r (modules may differ by rank_pattern) */
    float alpha;     /* lora_alpha */
    bool use_rslora; /* scale = alpha / sqrt(r) */
    char base_model[256];
    char targets[256]; /* the projections targeted, "q_proj,k_proj,..." */
    int32_t n_modules; /* modules loaded (layers x projections) */
    /* a compatibility warning (the base model's name differs from the
     * loaded model's), empty when none */
    char warning[512];
} lora_meta;

/*
 * What lora_load_as stores an adapter's A and B in (--adapter-dtype).
 * Products always accumulate in f32.
 */
typedef enum lora_dtype {
    /* never rounded: each tensor as the file stores it (f32, f16 or bf16,
     * all exact in f32), what the PEFT agreement tests pin */
    LORA_DTYPE_F32 = QL_ADAPTER_DTYPE_F32,
    /* f32 and f16 tensors rounded to bf16 (nearest even) at load, a bf16
     * one kept as is: half an f32 adapter's bytes read per step, and the
     * per-row bf16 products (qt_lora_down, qt_lora_up) the engine spreads
     * over its pool. serve's and generate's default. */
    LORA_DTYPE_BF16 = QL_ADAPTER_DTYPE_BF16,
} lora_dtype;

/* The dtype named "f32" or "bf16" (base's ql_adapter_dtype_names, whose
 * values lora_dtype takes), or -1. */
int lora_dtype_from_name(const char *name);

/*
 * Load the PEFT LoRA adapter in folder dir for model m, under `name` (NULL:
 * the folder's base name). Everything is checked before *out is set:
 * target modules exist in the model, every A is [r, in_features] and every
 * B [out_features, r] for its module, all values finite, no unsupported
 * feature (use_dora, a trained bias, modules_to_save, embedding or conv
 * targets: refused by the field's name). On a llama GGUF model the rows of
 * q_proj / k_proj B are permuted as llama.cpp's converter permuted the
 * weights. The folder's own chat template, when it has one
 * (chat_template.jinja or tokenizer_config.json's "chat_template", read as
 * for a model: eng_chat_templates_at, no link followed), goes into
 * (*out)->chat_template and chat_template_tool_use. *out has one reference
 * (eng_lora_unref frees it); meta (may be NULL) receives what the config
 * said.
 */
int lora_load(eng_lora **out, lora_meta *meta, const char *dir, const char *name,
              const eng_model *m, char *msg, size_t msg_len);
/* The same, storing A and B as dtype says (lora_load: LORA_DTYPE_F32). A
 * converted adapter owns its tensors and lets go of the file's copy. */
int lora_load_as(eng_lora **out, lora_meta *meta, const char *dir, const char *name,
                 const eng_model *m, lora_dtype dtype, char *msg, size_t msg_len);
/*
 * The same for a folder that must lie inside root (the adapter directory):
 * dir, relative to root or absolute inside it, is opened by lora_open_dir
 * (no "..", no symlink). root NULL: dir is opened as named (the caller's
 * own path: the CLI's), symlinks in it followed.
 *
 * Either way the folder is opened once, and every file read from it
 * (adapter_config.json, adapter_model.safetensors, chat_template.jinja,
 * additional_chat_templates/tool_use.jinja, tokenizer_config.json) is
 * opened beneath that descriptor with no symlink followed, even one whose
 * target stays inside, and must be a regular file (mf_open_in): a link is
 * refused with QL_EINVAL naming the file, and nothing is loaded. Each name
 * is looked up once, by the open its bytes are read from, so nothing can
 * be swapped between a check and a use.
 */
int lora_load_in(eng_lora **out, lora_meta *meta, const char *root, const char *dir,
                 const char *name, const eng_model *m, lora_dtype dtype, char *msg, size_t msg_len);

/* --- the dispatch by quant kind (adapters/merge.c) ----------------------- */

/* One adapter's part in a merge into one module. */
typedef struct lora_part {
    const char *adapter;           /* its name, for errors */
    const eng_lora_module *module; /* A, B and the module scale */
    float scale;                   /* the user's scale (times module->scale) */
} lora_part;

/* What requantization cost in one module (or, summed, in a whole merge):
 * the engine's eng_merge_cost (engine/model/model.h), one type for the CPU
 * merge here and a device merge alike. */
typedef eng_merge_cost lora_cost;

/* Sum b's sums into a (merged if either is) and recompute the ratios. */
void lora_cost_add(lora_cost *a, const lora_cost *b);

typedef struct lora_merge_opts {
    bool safe_merge; /* check every merged value is finite (the default) */
    /* the kind merged modules are stored in: QT_KIND_COUNT for the
     * weight's own kind and layout, or QT_AFFINE (int8, per channel) or
     * QT_BF16 */
    qt_kind into;
} lora_merge_opts;

/* The kind lora_merge_opts.into holds for a choice of --into or "into"
 * (base's ql_into_names holds the words): QT_KIND_COUNT for QL_INTO_OWN,
 * QT_AFFINE for QL_INTO_INT8, QT_BF16 for QL_INTO_BF16; and the choice a
 * kind is (QL_INTO_OWN for any other kind). The one map between the two. */
qt_kind lora_into_kind(ql_into into);
ql_into lora_into_of(qt_kind kind);

/* The row of the dispatch table for one quant kind. */
typedef struct lora_ops {
    const char *kind; /* the weight kind's name */
    /*
     * merged = Q(dequant(pristine) + sum of parts' scale * B @ A), in the
     * pristine weight's kind, block size and double-quant setting (or
     * o->into). On a non-finite value (safe merge) nothing is produced and
     * msg names the adapter, `module` and the first bad index. cost
     * receives the module's figures. The pristine weight is only read; the
     * merged tensor is the caller's (qt_free).
     */
    int (*merge)(const qtensor *pristine, const lora_part *parts, size_t n_parts,
                 const lora_merge_opts *o, const char *module, qtensor *merged, lora_cost *cost,
                 char *msg, size_t msg_len);
} lora_ops;

/* The row for weight w's kind (static: never freed), or QL_EUNSUPPORTED
 * naming the kind. */
int lora_dispatch(const qtensor *w, const lora_ops **ops, char *msg, size_t msg_len);

/* --- the registry (adapters/registry.c) ---------------------------------- */

typedef struct lora_registry lora_registry;

typedef struct lora_registry_opts {
    /* bytes adapters may hold; loading past it evicts unmerged adapters no
     * request has used for longest; 0: no limit */
    size_t budget_bytes;
    int threads;      /* merge threads; 0: the machine's cores */
    lora_dtype dtype; /* what adapters are stored in (zero: f32, never rounded) */
    /* the journal (state.c's format): rewritten atomically after every
     * change (load, unload, merge, unmerge, eviction) and replayed by
     * lora_registry_restore. Copied; NULL: no journal. */
    const char *state_file;
    /* the adapter directory: each load opens its folder beneath it
     * (lora_load_in, no symlink followed), whatever the path was checked
     * against before. Borrowed: it outlives the registry. NULL: folders are
     * opened as named (the CLI's). */
    const char *adapter_root;
} lora_registry_opts;

/* What a listing shows of one adapter. */
typedef struct lora_info {
    char name[128];
    char path[512];
    lora_meta meta;
    float scale; /* what requests naming it without a scale get */
    size_t bytes;
    bool merged;
    float merged_scale;
    uint64_t requests;         /* sequences that asked for it */
    int64_t last_used;         /* when the last of them was admitted (Unix seconds; 0: never) */
    lora_cost last_merge;      /* the cost of its last merge (zero: never merged) */
    double last_merge_seconds; /* and how long it took */
} lora_info;

/* A merge's or unmerge's report. modules is owned (lora_report_free). */
typedef struct lora_report {
    char adapter[128];
    float scale;
    qt_kind into; /* QT_KIND_COUNT: each weight's own kind */
    size_t n_modules;
    struct lora_module_cost {
        int32_t layer;
        eng_proj proj;
        qt_kind kind; /* what the merged module is stored in */
        lora_cost cost;
    } * modules;
    lora_cost overall;
    double seconds;
    uint64_t version; /* the weight version published */
    uint64_t digest;  /* eng_weights_digest of it */
} lora_report;
void lora_report_free(lora_report *r);

/* The registry of engine e over model m (both borrowed; they outlive it).
 * Hashes the serving weights once (eng_weights_digest), so that
 * lora_registry_state never has to: call it off the event loop. */
int lora_registry_new(lora_registry **out, eng_engine *e, const eng_model *m,
                      const lora_registry_opts *o, char *msg, size_t msg_len);
/* Unmerges nothing; drops the registry's references. */
void lora_registry_free(lora_registry *r);
/* What an adapter may be named: 1 to 127 letters, digits, '-', '_' and
 * '.', so that a name is a folder name and a metrics label as it stands.
 * The one check, made by the admin API and lazy loading before they load
 * (server/) and by lora_registry_restore on every name the journal holds. */
bool lora_name_valid(const char *name);
/* The largest |scale| an adapter is loaded or merged at: what the admin
 * API accepts, and what the journal's replay accepts (a journal is no
 * more trusted than a client). Scales past a few units already swamp the
 * base weights; 100 leaves room for adapters trained with a tiny alpha. */
#define LORA_SCALE_MAX 100.0

/* Load dir under name (unique), with the scale requests get when they name
 * the adapter without one. meta may be NULL. */
int lora_registry_load(lora_registry *r, const char *name, const char *dir, float scale,
                       lora_meta *meta, char *msg, size_t msg_len);
/* Drop name; QL_ECONFLICT while it is merged. Sequences using it finish. */
int lora_registry_unload(lora_registry *r, const char *name, char *msg, size_t msg_len);
/*
 * The adapter `name` for a request, as lora_registry_want, loading it first
 * when it is not loaded and root (the adapter folder) has a folder of that
 * name (lora_resolve_dir's checks: no "..", no symlink), at scale 1,
 * under the memory budget (least recently used unmerged adapters are
 * evicted for it). Callers asking for one name at once wait for one load.
 * Blocks for the load: call it off the event loop. QL_ENOTFOUND when there
 * is no such folder; a load's own error otherwise.
 */
int lora_registry_acquire(lora_registry *r, const char *name, const char *root, eng_lora_term *out,
                          char *msg, size_t msg_len);
/* A reference to name for a request (marks it used now); QL_ENOTFOUND. */
int lora_registry_get(lora_registry *r, const char *name, eng_lora **out, char *msg,
                      size_t msg_len);
/* The same with the adapter's default scale, as a request wants it. */
int lora_registry_want(lora_registry *r, const char *name, eng_lora_term *out, char *msg,
                       size_t msg_len);
/* Every adapter, in load order; *out allocated (free()). */
int lora_registry_list(lora_registry *r, lora_info **out, size_t *n);
/*
 * Merge name at scale (replacing its scale if merged already) together
 * with what is merged, recomputed from the pristine weights, published as
 * a new version. On any failure nothing changes. rep may be NULL.
 */
int lora_registry_merge(lora_registry *r, const char *name, float scale, const lora_merge_opts *o,
                        lora_report *rep, char *msg, size_t msg_len);
/* Take name out of the merged configuration (the rest stays merged). */
int lora_registry_unmerge(lora_registry *r, const char *name, lora_report *rep, char *msg,
                          size_t msg_len);

/* The serving state: what is merged and the weights' digest. */
typedef struct lora_state {
    uint64_t version;
    uint64_t digest;
    size_t n_merged;
    struct {
        char name[128];
        float scale;
    } merged[ENG_MAX_MERGED]; /* the first ENG_MAX_MERGED */
    uint64_t merges, unmerges;
    size_t bytes; /* all loaded adapters */
    size_t n_loaded;
    char state_file[512]; /* the journal's path; empty: no journal */
    /* why the last journal write failed (the change itself stood; the
     * next change writes again); empty while the journal is current */
    char state_file_error[512];
} lora_state;
/* Only reads: the digest of every version was computed where the version
 * was made (lora_registry_new, a merge or unmerge), so this is quick
 * enough for the event loop. */
void lora_registry_state(lora_registry *r, lora_state *out);

/* --- the journal: state that survives a restart (adapters/state.c) ------- */

/*
 * The state file is a small JSON document, written with cJSON:
 *
 *   {"version": 1,
 *    "adapters": [{"name": "a", "path": "/srv/adapters/a", "scale": 1}, ...],
 *    "merged": [{"name": "a", "scale": 0.5, "into": null, "safe_merge": true}, ...]}
 *
 * adapters in load order, with the resolved folder and the default scale;
 * merged in the order of the merged configuration, each with its scale,
 * the kind merged modules are stored in ("into": null for the weight's
 * own kind, "int8" or "bf16": the configuration's, the same for every
 * entry) and the safe_merge it was merged with. Scales are written with
 * enough digits to read back the same float, so a replayed merge gives
 * the same weights, bit for bit.
 */
#define LORA_JOURNAL_VERSION 1

typedef struct lora_journal_adapter {
    char name[128];
    char path[512];
    float scale;
} lora_journal_adapter;

typedef struct lora_journal_merge {
    char name[128];
    float scale;
    qt_kind into; /* QT_KIND_COUNT: the weight's own kind; QT_AFFINE (int8); QT_BF16 */
    bool safe_merge;
} lora_journal_merge;

typedef struct lora_journal {
    lora_journal_adapter *adapters; /* owned (lora_journal_free) */
    size_t n_adapters;
    lora_journal_merge merged[ENG_MAX_MERGED];
    size_t n_merged;
} lora_journal;

/*
 * Write j to path atomically: a temporary file beside it, fsync, rename
 * over path, fsync of the folder; a reader sees the old journal or the new
 * one, never a part. QL_EIO naming the file and the call that failed
 * (nothing at path changed then).
 */
int lora_journal_write(const char *path, const lora_journal *j, char *msg, size_t msg_len);
/*
 * Read the journal at path into *out (lora_journal_free it). QL_ENOTFOUND
 * when there is no such file (a first start), QL_EIO when it cannot be
 * read, QL_EFORMAT naming the file and the field when it is not a journal
 * this version reads; on any error *out is empty.
 */
int lora_journal_read(const char *path, lora_journal *out, char *msg, size_t msg_len);
void lora_journal_free(lora_journal *j);

/*
 * Open an adapter folder the way clients may name one: path relative to
 * root, or absolute and inside root's real path; no ".." component; and
 * no component below root a symlink, even one leading back inside (root
 * itself is the operator's and may be one). The folder is opened beneath
 * root with no symlink followed (mf_open_in: openat2 RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS, else O_NOFOLLOW a component at a time), so what is
 * checked is what is opened. *fd (O_DIRECTORY) is the caller's to close;
 * real (may be NULL) receives its path, root's real path joined with path's
 * components. QL_EINVAL: outside root, "..", or a symlink (msg names it);
 * QL_ENOTFOUND: path is not there; QL_EIO: root itself cannot be opened.
 * msg names the path. Any thread may call it (the admin routes do, and so
 * does the replay).
 */
int lora_open_dir(const char *root, const char *path, int *fd, char *real, size_t real_len,
                  char *msg, size_t msg_len);
/* lora_open_dir's checks without keeping the folder open: its path into
 * out. What the admin API and the journal record; loading opens it again
 * beneath root (lora_load_in), so this answer is never trusted alone. */
int lora_resolve_dir(const char *root, const char *path, char *out, size_t out_len, char *msg,
                     size_t msg_len);
/* The names of root's folders that lora_resolve_dir accepts and that hold
 * an adapter_config.json, a regular file (hidden ones left out), in directory order, into
 * *names (n strings; each and the array the caller's to free()). Reads the
 * file system: off the event loop. */
int lora_list_dir(const char *root, char ***names, size_t *n, char *msg, size_t msg_len);

/* Why one adapter or merge of the journal did not come back. */
typedef struct lora_restore_error {
    char name[128]; /* the adapter; empty: the state file itself */
    char path[512]; /* its folder (or the state file) */
    char error[1024];
} lora_restore_error;

/*
 * Replay the state file (opts.state_file; nothing without one or when it
 * does not exist yet): load each adapter from its path, which must still
 * resolve inside root (lora_resolve_dir; root NULL: adapter loading is off
 * and every adapter is refused), then redo the merges in their order. What
 * does not come back is recorded (lora_registry_restore_errors) and the
 * rest proceeds: a name lora_name_valid refuses or a scale past
 * LORA_SCALE_MAX (checked as the admin API checks them), an adapter that
 * no longer loads, a merge whose adapter did not come back or that fails.
 * A state file that does not parse is renamed to FILE.bad (so the next
 * change does not overwrite it) and recorded. The journal is not written
 * during the replay; the next change rewrites it from what is loaded then.
 * Call it once, after lora_registry_new and before anything else uses the
 * registry. Returns how many problems were recorded.
 */
size_t lora_registry_restore(lora_registry *r, const char *root);
/* What the replay could not bring back, in order; *out allocated (free()),
 * NULL with *n 0 when nothing. */
int lora_registry_restore_errors(lora_registry *r, lora_restore_error **out, size_t *n);

#endif

/*
 * lora.h - the public header of adapters/: PEFT LoRA adapters on a
 * quantized model.
 *
 * It offers three things, each in its own file:
 *   - loading (peft.c): a PEFT adapter folder (adapter_config.json and
 *     adapter_model.safetensors) checked against a loaded model and turned
 *     into an eng_lora, the engine's view of an adapter (engine/model/model.h): per
 *     layer and projection, A, B and the module's scale. Tensors are
 *     borrowed from the mapped file where their layout allows;
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
 *     beside the serving one and publish it between two engine steps.
 *
 * Unmerged application is exact (the quantized base plus the adapter in
 * f32, what QLoRA trained); merging is fast and approximate, and every
 * merge says how approximate (delta_retained, relative_error).
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

#include "engine.h"

#include <regex.h>

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
 * Load the PEFT LoRA adapter in folder dir for model m, under `name` (NULL:
 * the folder's base name). Everything is checked before *out is set:
 * target modules exist in the model, every A is [r, in_features] and every
 * B [out_features, r] for its module, all values finite, no unsupported
 * feature (use_dora, a trained bias, modules_to_save, embedding or conv
 * targets: refused by the field's name). On a llama GGUF model the rows of
 * q_proj / k_proj B are permuted as llama.cpp's converter permuted the
 * weights. The folder's own chat template, when it has one
 * (chat_template.jinja or tokenizer_config.json's "chat_template", read as
 * for a model: eng_chat_templates_from_folder), goes into
 * (*out)->chat_template and chat_template_tool_use. *out has one reference
 * (eng_lora_unref frees it); meta (may be NULL) receives what the config
 * said.
 */
int lora_load(eng_lora **out, lora_meta *meta, const char *dir, const char *name,
              const eng_model *m, char *msg, size_t msg_len);

/*
 * Compile prefix + pattern + suffix as a POSIX extended regex (REG_NOSUB):
 * pattern is in Python's syntax (PEFT's target_modules, rank_pattern),
 * translated (\d, escaped characters in brackets, (?:...)); -1 with why set
 * for a construct POSIX cannot express or counted repeats regcomp would
 * expand without bound. Also what tests/test_deploy.c checks Kubernetes
 * schema patterns with (Go RE2: the same syntax for what those use). *re is
 * the caller's (regfree) on success only.
 */
int lora_pattern_compile(regex_t *re, const char *prefix, const char *pattern, const char *suffix,
                         char *why, size_t why_len);

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
    int threads; /* merge threads; 0: the machine's cores */
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

/* The registry of engine e over model m (both borrowed; they outlive it). */
int lora_registry_new(lora_registry **out, eng_engine *e, const eng_model *m,
                      const lora_registry_opts *o, char *msg, size_t msg_len);
/* Unmerges nothing; drops the registry's references. */
void lora_registry_free(lora_registry *r);
/* Load dir under name (unique), with the scale requests get when they name
 * the adapter without one. meta may be NULL. */
int lora_registry_load(lora_registry *r, const char *name, const char *dir, float scale,
                       lora_meta *meta, char *msg, size_t msg_len);
/* Drop name; QL_ECONFLICT while it is merged. Sequences using it finish. */
int lora_registry_unload(lora_registry *r, const char *name, char *msg, size_t msg_len);
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
} lora_state;
void lora_registry_state(lora_registry *r, lora_state *out);

#endif

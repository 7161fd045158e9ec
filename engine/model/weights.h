/*
 * weights.h - the second half of engine/model/'s public header, included by
 * model.h (include model.h): the projections of a decoder layer an adapter
 * may target (a mixture of experts' included), adapters as the engine sees
 * them (eng_lora: low-rank deltas per projection) and weight versions
 * (eng_weights: which tensor each projection serves with, and what is
 * merged into it), refcounted so a merge never changes a running answer.
 * Split from model.h for length alone (it is read only after model.h,
 * which includes it at its end); weights.c implements it.
 */
#ifndef QL_MODEL_WEIGHTS_H
#define QL_MODEL_WEIGHTS_H

/* --- adapters as the engine sees them: low-rank deltas and weight versions
 *     (weights.c) ------------------------------------------------------------- */

/* The projections of a decoder layer an adapter may target, in PEFT's
 * module names. */
typedef enum eng_proj {
    ENG_PROJ_Q,
    ENG_PROJ_K,
    ENG_PROJ_V,
    ENG_PROJ_O,
    ENG_PROJ_GATE,
    ENG_PROJ_UP,
    ENG_PROJ_DOWN,
    ENG_N_PROJ, /* the seven every decoder layer has */
    /* Gemma 4's per-layer input gate and projection (eng_gemma4_layer),
     * modules of the layer itself, in the tables of a model with
     * per-layer inputs or experts (empty tensors where it has none) */
    ENG_PROJ_PLE_GATE = ENG_N_PROJ,
    ENG_PROJ_PLE_PROJ,
    ENG_PROJ_FIRST_EXPERT /* where a mixture's experts begin */
} eng_proj;

/*
 * A mixture-of-experts model has more projections per layer: after the
 * ENG_N_PROJ above and the two per-layer input slots, each routed expert's
 * gate, up and down, expert e's part (ENG_PROJ_GATE, _UP or _DOWN) at
 * eng_expert_proj(e, part). Every table indexed by (layer, projection)
 * (adapters' modules, weight versions) has eng_n_proj(config) entries per
 * layer: a dense model's ENG_N_PROJ, one with Gemma 4's per-layer inputs
 * ENG_PROJ_FIRST_EXPERT. In a layer that is not a mixture (or a dense
 * model) the expert projections are empty tensors (rows 0), as the
 * per-layer input ones of a model without them.
 */
static inline eng_proj eng_expert_proj(int32_t e, eng_proj part)
{
    return (eng_proj)(ENG_PROJ_FIRST_EXPERT + 3 * e + (part - ENG_PROJ_GATE));
}
static inline int32_t eng_n_proj(const eng_config *c)
{
    if (c->n_experts > 0)
        return ENG_PROJ_FIRST_EXPERT + 3 * c->n_experts;
    return c->g4.ple_dim > 0 ? ENG_PROJ_FIRST_EXPERT : ENG_N_PROJ;
}
/* The projections of a layer's own in c's tables (the experts' after). */
static inline int32_t eng_n_layer_proj(const eng_config *c)
{
    return eng_n_proj(c) > ENG_N_PROJ ? ENG_PROJ_FIRST_EXPERT : ENG_N_PROJ;
}
/* The expert projection p belongs to, or -1 for a layer's own; *part
 * (when not NULL) gets its ENG_PROJ_GATE, _UP or _DOWN (a layer's own: p). */
static inline int32_t eng_proj_expert(eng_proj p, eng_proj *part)
{
    if ((int)p < ENG_PROJ_FIRST_EXPERT) {
        if (part)
            *part = p;
        return -1;
    }
    if (part)
        *part = (eng_proj)(ENG_PROJ_GATE + ((int)p - ENG_PROJ_FIRST_EXPERT) % 3);
    return ((int)p - ENG_PROJ_FIRST_EXPERT) / 3;
}

/* "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
 * "down_proj", "per_layer_input_gate", "per_layer_projection" (an
 * expert's part by its own name) */
const char *eng_proj_name(eng_proj p);
/* The parent module in a Hugging Face model: "self_attn", "mlp", "" (the
 * layer itself: Gemma 4's per-layer input modules) or, for an expert's
 * part, "mlp.experts". */
const char *eng_proj_parent(eng_proj p);
/* The module path under a layer, "self_attn.q_proj", "per_layer_projection"
 * or "mlp.experts.3.gate_proj", into buf; returns buf. */
const char *eng_proj_path(eng_proj p, char *buf, size_t len);
/* The model's own (pristine) weight of layer l's projection p (an empty
 * tensor for an expert's in a layer without experts). */
const qtensor *eng_model_proj(const eng_model *m, int32_t layer, eng_proj p);

/* The most adapters one weight version merges (the registry refuses a
 * seventeenth; listings and the CUDA backend size their tables by it). */
#define ENG_MAX_MERGED 16

/* One module of a LoRA adapter: y += scale * (x @ A^T) @ B^T. */
typedef struct eng_lora_module {
    qtensor a;   /* [rank, in_features], F32, F16 or BF16; rows == 0: not targeted */
    qtensor b;   /* [out_features, rank], rows already in the model's layout (a
                    llama GGUF's permuted q/k rows) */
    float scale; /* lora_alpha / r, or / sqrt(r) with rslora, per module */
} eng_lora_module;

/*
 * A loaded adapter, immutable once built and shared by reference: the
 * registry, every weight version that has it merged and every sequence
 * that applies it hold one reference each. Whoever builds it sets refs to
 * 1 and destroy (called once, by the last eng_lora_unref, on any thread).
 */
typedef struct eng_lora {
    char name[128];
    int32_t n_layers;
    int32_t n_proj;           /* per layer: eng_n_proj of the model's config */
    eng_lora_module *modules; /* [n_layers * n_proj] */
    size_t bytes;             /* memory it holds (tensors mapped or copied) */
    int refs;                 /* atomic */
    uint64_t requests;        /* atomic: sequences admitted that asked for it */
    int64_t last_used;        /* atomic: when the last was admitted (Unix s; 0: never) */
    uint64_t uid;             /* atomic: 0 until eng_lora_uid names it */
    /* the adapter folder's own chat templates (PEFT saves the tokenizer
     * beside the adapter when training changed it), used for requests to
     * the adapter instead of the model's; NULL when the folder has none.
     * Owned: whoever builds the adapter frees them in destroy. */
    char *chat_template;
    char *chat_template_tool_use;
    void (*destroy)(struct eng_lora *l);
} eng_lora;

void eng_lora_ref(eng_lora *l);
void eng_lora_unref(eng_lora *l);
/* A number no other adapter of this process has had or will have (a
 * freed adapter's memory may hold the next one: its address is no name). */
uint64_t eng_lora_uid(eng_lora *l);
/* Layer l's module p, or NULL when the adapter does not target it. */
const eng_lora_module *eng_lora_module_at(const eng_lora *lora, int32_t layer, eng_proj p);

/* An adapter with the user's scale (which multiplies the module scale). */
typedef struct eng_lora_term {
    eng_lora *lora;
    float scale;
} eng_lora_term;

/*
 * A version of the serving weights: for every layer's projection, the
 * tensor it computes with (the model's pristine one, or a merged one the
 * version owns), and the adapter configuration merged into them. Immutable
 * once published, shared by reference: the engine holds the current one
 * and every sequence holds the one it started on, so a merge never changes
 * a running answer. Freed (merged tensors included) by the last unref.
 */
typedef struct eng_weights {
    uint64_t version;
    const eng_model *m;
    int32_t n_proj;        /* per layer: eng_n_proj(&m->cfg) */
    const qtensor **proj;  /* [n_layers * n_proj] */
    qtensor *owned;        /* [n_layers * n_proj]: merged tensors (rows == 0: none) */
    eng_lora_term *merged; /* the merged configuration (a reference on each) */
    size_t n_merged;
    int refs; /* atomic */
} eng_weights;

/* A version serving the model's pristine weights with nothing merged
 * (refs 1). */
int eng_weights_new(eng_weights **out, const eng_model *m, uint64_t version, char *msg,
                    size_t msg_len);
/* Serve layer l's projection p with *t: the version takes t over (t is
 * zeroed). Only before the version is published. */
void eng_weights_set(eng_weights *w, int32_t layer, eng_proj p, qtensor *t);
/* Record the merged configuration (references are taken). */
int eng_weights_set_merged(eng_weights *w, const eng_lora_term *terms, size_t n, char *msg,
                           size_t msg_len);
const qtensor *eng_weights_proj(const eng_weights *w, int32_t layer, eng_proj p);
void eng_weights_ref(eng_weights *w);
void eng_weights_unref(eng_weights *w);
/*
 * A 64-bit digest of every weight byte a version serves: embeddings,
 * norms, lm_head and each projection (codes and quant state), in a fixed
 * order. Equal digests mean the same bits (up to a 2^-64 accident).
 * w NULL: the model's own weights.
 */
uint64_t eng_weights_digest(const eng_model *m, const eng_weights *w);

/*
 * The signed difference between a wanted configuration and a merged one:
 * for each wanted adapter, its scale minus the merged scale (dropped when
 * zero); for each merged adapter not wanted, minus its merged scale. *out
 * is allocated (free()); references are NOT taken.
 */
int eng_lora_difference(const eng_lora_term *want, size_t n_want, const eng_lora_term *merged,
                        size_t n_merged, eng_lora_term **out, size_t *n_out);

/* What requantizing cost one module of a merge, or a whole merge summed by
 * adapters' lora_cost_add (adapters/lora.h calls this type lora_cost):
 * dot = <Q - W, d>, delta_sq = |d|^2, err_sq = |Q - (W + d)|^2. */
typedef struct eng_merge_cost {
    double dot, delta_sq, err_sq;
    bool merged; /* false: the module had nothing merged into it */
    /* From the sums, by whoever sums them (adapters/merge.c, with its
     * zero-delta rule): dot / delta_sq (1 when the adapter survived whole,
     * 0 when it rounded away) and sqrt(err_sq / delta_sq). */
    double delta_retained, relative_error;
} eng_merge_cost;

#endif

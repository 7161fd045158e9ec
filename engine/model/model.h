/*
 * model.h - the public header of engine/model/: what a model is, loaded.
 *
 * It offers:
 *   - eng_config, eng_layer, eng_model: a model's immutable config and
 *     weights (no run state), loaded from a Hugging Face folder, a
 *     bitsandbytes 4-bit folder or a GGUF file (eng_model_load), quantized
 *     on load when asked;
 *   - the layer table: each decoder layer's projections by PEFT module name
 *     (eng_proj);
 *   - adapters as the engine sees them (eng_lora: low-rank deltas) and
 *     weight versions (eng_weights: which tensor each projection serves
 *     with, and what is merged into it), refcounted so a merge never changes
 *     a running answer.
 *
 * A model owns its tensors, its tokenizer and the mapped files its borrowed
 * tensors point into; eng_model_free releases all of it. It touches
 * modelfile/, tokenizer/ and kernels/, nothing at run time.
 */
#ifndef QL_MODEL_H
#define QL_MODEL_H

#include "gemma4.h"
#include "hybrid.h"
#include "modelfile.h"
#include "mtp.h"
#include "tokenizer.h"

#include <stddef.h>

/* --- models (model.c; the loaders in load_hf.c, load_gguf.c) --------------- */

typedef enum eng_arch {
    ENG_ARCH_LLAMA,
    ENG_ARCH_MISTRAL,
    ENG_ARCH_QWEN2,
    ENG_ARCH_QWEN3,
    /* Phi-3 / 3.5 (Phi3ForCausalLM, GGUF phi3): fused qkv_proj and
     * gate_up_proj, split by rows at load into wq/wk/wv and w_gate/w_up
     * (layers.c), and longrope */
    ENG_ARCH_PHI3,
    ENG_ARCH_GEMMA2,
    ENG_ARCH_GEMMA3,
    /* mixtures of experts (eng_config's n_experts): Qwen2-MoE (a shared
     * expert beside the routed ones), Qwen3-MoE, Mixtral */
    ENG_ARCH_QWEN2_MOE,
    ENG_ARCH_QWEN3_MOE,
    ENG_ARCH_MIXTRAL,
    /* GPT-OSS (GptOssForCausalLM, GGUF gpt-oss): a mixture whose router has
     * a bias and weighs the top-k logits by their own softmax, experts with
     * biases and a clamped SwiGLU, attention sinks, biases on q/k/v/o,
     * alternating sliding and full layers, YaRN */
    ENG_ARCH_GPT_OSS,
    /* SmolLM3 (SmolLM3ForCausalLM, GGUF smollm3): a Llama whose layers in
     * eng_config's nope_layers attend without rotary embeddings */
    ENG_ARCH_SMOLLM3,
    /* OLMo 3 (Olmo3ForCausalLM; GGUF olmo2, which llama.cpp's converter
     * writes for it): norms after attention and the MLP only (eng_config's
     * post_norms), q/k norms over the whole projection (qk_norm_whole),
     * sliding and full layers, YaRN on the full ones only */
    ENG_ARCH_OLMO3,
    /* Ministral 3 (Ministral3ForCausalLM, GGUF mistral3): a Mistral with
     * YaRN and Llama 4's position-dependent query scaling (eng_config's
     * attn_temp_beta) */
    ENG_ARCH_MINISTRAL3,
    ENG_ARCH_GEMMA4,  /* Gemma 4's text model, without the options load_hf.c refuses */
    ENG_ARCH_QWEN3_5, /* Qwen3.5: Gated DeltaNet layers (hybrid.h) and gated full attention */
} eng_arch;

/* How a mixture-of-experts router turns its logits into the chosen
 * experts' weights. */
typedef enum eng_router {
    /* softmax over every expert, the k most probable kept, their
     * probabilities renormalized to sum 1 when norm_topk_prob (Qwen2-MoE,
     * Qwen3-MoE; Mixtral always) */
    ENG_ROUTER_SOFTMAX_TOPK,
    /* the k largest logits (plus the router's bias), then a softmax over
     * those k alone (GPT-OSS's GptOssTopKRouter) */
    ENG_ROUTER_TOPK_SOFTMAX,
} eng_router;

/* The most layers a MoE model (dense_layers) or one with NoPE layers may have. */
#define ENG_MAX_MOE_LAYERS  1024
#define ENG_MAX_NOPE_LAYERS 1024

/* The gated unit of the MLP: silu(gate) * up (SwiGLU), Gemma's
 * gelu_pytorch_tanh(gate) * up (GeGLU), or GPT-OSS's clamped SwiGLU: gate
 * clamped above at swiglu_limit, up to [-limit, limit], then (up + 1) *
 * gate * sigmoid(swiglu_alpha * gate) (om_swiglu_oai). */
typedef enum eng_ffn_act { ENG_FFN_SILU, ENG_FFN_GELU_TANH, ENG_FFN_SWIGLU_OAI } eng_ffn_act;

#define ENG_MAX_EOG               7   /* the most tokens besides eos_token_id that end an answer */
#define ENG_MAX_ROPE_FREQ_FACTORS 256 /* rotary pairs with frequency factors (head dim 512) */

typedef enum eng_rope_scaling {
    ENG_ROPE_NONE,
    ENG_ROPE_LINEAR, /* positions divided by factor */
    ENG_ROPE_LLAMA3, /* Llama 3.1's frequency-dependent scaling */
    /* Phi-3's longrope ("su"): two sets of per-pair factors, short
     * (rope_freq_factors) and long (rope_long_freq_factors), one chosen per
     * sequence (eng_rope_long_for), and cos/sin times rope_attn_factor */
    ENG_ROPE_LONGROPE,
    /* YaRN (GPT-OSS): each frequency blended between itself and itself /
     * factor by a ramp over the pairs between the beta_fast and beta_slow
     * correction dims, cos/sin times rope_attn_factor (eng_config) */
    ENG_ROPE_YARN,
    ENG_ROPE_PROPORTIONAL, /* Gemma 4's full layers (step.c's eng_rope_inv_freq) */
} eng_rope_scaling;

/* What a model is, from config.json or GGUF metadata. */
typedef struct eng_config {
    eng_arch arch;
    int32_t vocab_size;
    int32_t hidden_size;
    int32_t intermediate_size;
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads; /* grouped-query attention: n_heads % n_kv_heads == 0 */
    int32_t head_dim;
    int32_t max_position_embeddings;
    float rope_theta;
    eng_rope_scaling rope_scaling;
    float rope_factor;
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3 */
    int32_t rope_original_max_position;                /* llama3, longrope */
    /* longrope: what multiplies every cos and sin (transformers'
     * attention_scaling, a GGUF's rope.scaling.attn_factor), and the long
     * factor set (n_rope_freq_factors of them; rope_freq_factors holds the
     * short one). Each sequence rotates all its positions with one set,
     * chosen at admission by eng_rope_long_for. */
    float rope_attn_factor;
    float rope_long_freq_factors[ENG_MAX_ROPE_FREQ_FACTORS];
    /* YaRN: the correction range's rotations (transformers' beta_fast,
     * beta_slow) and whether its ends are rounded out to whole dims
     * (transformers' truncate; ggml always rounds); rope_factor,
     * rope_original_max_position and rope_attn_factor (0.1 ln(factor) + 1
     * unless the config gives attention_factor) as above */
    float rope_yarn_beta_fast, rope_yarn_beta_slow;
    bool rope_yarn_truncate;
    /* llama.cpp's per-pair frequency factors (a GGUF's rope_freqs.weight,
     * which its converter computes from Llama 3.x's rope_scaling): the
     * frequency of pair i is divided by rope_freq_factors[i], before any
     * scaling above, as ggml_rope_ext's freq_factors; n_rope_freq_factors is
     * rotary dims / 2 when the model has them, 0 when not */
    int32_t n_rope_freq_factors;
    float rope_freq_factors[ENG_MAX_ROPE_FREQ_FACTORS];
    /* the leading dims of each head that rotate (transformers'
     * partial_rotary_factor times head_dim, Phi-4-mini's 0.75; a GGUF's
     * rope.dimension_count); 0: the whole head. The rest pass through. */
    int32_t rope_dim;
    /* layers that apply no rotary embedding to q and k (SmolLM3's NoPE
     * layers: config.json's no_rope_layers holds 0 for them; a GGUF,
     * which does not say, every fourth as llama.cpp builds it): bit l of
     * word l / 64; all zero for every other model */
    uint64_t nope_layers[ENG_MAX_NOPE_LAYERS / 64];
    /* rotary pairs: false = (i, i + head_dim/2) as Hugging Face computes
     * them; true = (2i, 2i + 1), the layout llama.cpp's converter leaves in
     * a llama GGUF after permuting the q/k rows */
    bool rope_interleaved;
    float rms_norm_eps;
    bool tie_word_embeddings;
    bool attention_bias; /* Qwen2: q, k, v projections have biases */
    bool o_bias;         /* GPT-OSS: the output projection has one too */
    /* GPT-OSS: one learned logit per head in the attention softmax's
     * denominator (eng_layer's sinks), which takes no value */
    bool attn_sinks;
    /* Qwen3: an RMSNorm over each head of q and of k (head_dim weights,
     * one per layer for each), after the projections and before RoPE */
    bool qk_norm;
    /* OLMo 3: those norms are over the whole projection instead (n_heads *
     * head_dim weights for q, n_kv_heads * head_dim for k) */
    bool qk_norm_whole;
    /* OLMo 3: no norm before attention or the MLP; a norm after each
     * (post_attn_norm, post_ffn_norm) on the block's output before the
     * residual add */
    bool post_norms;
    /* Llama 4's attention temperature (Ministral 3's llama_4_scaling_beta,
     * a GGUF's attention.temperature_scale): each query at position p,
     * after RoPE, times 1 + attn_temp_beta ln(1 + floor(p /
     * attn_temp_floor)), attn_temp_floor being the YaRN original context;
     * beta 0: none */
    float attn_temp_beta;
    int32_t attn_temp_floor;
    /* Gemma 4: the pairs ENG_ROPE_PROPORTIONAL turns; v through a weightless
     * RMSNorm per head; each layer's output times its eng_layer.layer_scalar */
    int32_t rope_prop_pairs;
    bool v_norm, layer_scalar;
    int32_t kv_shared_layers;           /* Gemma 4: the last this many reuse keys and values */
    eng_gemma4_config g4;               /* Gemma 4's other options (gemma4.h) */
    int32_t sliding_window;             /* Mistral; 0 when none */
    int32_t bos_token_id, eos_token_id; /* -1 when the config names none */
    /* further tokens that end an answer as eos does (config.json's and
     * generation_config.json's eos_token_id lists: Qwen3's <|endoftext|>,
     * GPT-OSS's <|call|>; a GGUF's eot / eom), eos_token_id not among them */
    int32_t eog_token_ids[ENG_MAX_EOG];
    int32_t n_eog;
    /* --- Gemma 2 and 3 (zero, false and SwiGLU for every other model) --- */
    /* every RMSNorm (the q/k norms too) scales by (norm_offset + w): 1 for
     * a Gemma folder (its RMSNorm is x * (1 + w)), 0 for a Gemma GGUF,
     * whose converter stored w + 1 */
    float norm_offset;
    /* Gemma's sandwich: a norm after attention and after the MLP, each
     * applied to the block's output before the residual add, and the MLP's
     * own input norm (ffn_norm) */
    bool sandwich_norms;
    eng_ffn_act ffn_act;
    float embed_scale;   /* embeddings times this (sqrt(hidden)); 0: not scaled */
    float attn_scale;    /* q.k times this (query_pre_attn_scalar^-1/2); 0: 1/sqrt(head_dim) */
    float attn_softcap;  /* scores become tanh(s / cap) * cap; 0: none */
    float final_softcap; /* the same on the logits; 0: none */
    /* which layers slide (sliding_window > 0): 0 every layer (Mistral); n:
     * layer l when l % n < n - 1 (Gemma 2: n 2, layers 0, 2, ...; Gemma 3:
     * n 6, all but every sixth) */
    int32_t sliding_pattern;
    /* Gemma 3: the sliding layers rotate with this base and no scaling (the
     * full layers with rope_theta and rope_scaling); 0: as the full ones */
    float rope_local_theta;
    /* GPT-OSS's clamped SwiGLU (ENG_FFN_SWIGLU_OAI): alpha and limit (0:
     * no clamp) */
    float swiglu_alpha, swiglu_limit;
    /* --- mixtures of experts (all zero for a dense model) --- */
    int32_t n_experts;        /* routed experts per MoE layer; 0: a dense model */
    int32_t n_experts_used;   /* chosen per token (top-k) */
    int32_t expert_ff;        /* each routed expert's intermediate size */
    int32_t shared_expert_ff; /* Qwen2-MoE's shared expert's; 0: none */
    bool norm_topk_prob;      /* the chosen experts' weights renormalized to sum 1 */
    eng_router router;
    bool router_bias; /* GPT-OSS: the router and each expert's gate, up and down have biases */
    /* a MoE model's plain-MLP layers (mlp_only_layers...): bit l of word l / 64 */
    uint64_t dense_layers[ENG_MAX_MOE_LAYERS / 64];
    eng_linear_cfg linear; /* Qwen3.5's linear-attention layers (hybrid.h) */
} eng_config;

/* Whether layer l is a mixture of experts (n_experts, dense_layers). */
static inline bool eng_layer_is_moe(const eng_config *c, int32_t l)
{
    if (c->n_experts <= 0 || l < 0 || l >= ENG_MAX_MOE_LAYERS)
        return false;
    return !(c->dense_layers[l / 64] >> (l % 64) & 1);
}

/* Whether layer l attends through the window (sliding_window, _pattern). */
static inline bool eng_layer_slides(const eng_config *c, int32_t l)
{
    return c->sliding_window > 0 &&
           (c->sliding_pattern <= 0 || l % c->sliding_pattern < c->sliding_pattern - 1);
}

/* Layer l's q (k: k) norm's width: a head's, or the projection's (OLMo 3). */
static inline int64_t eng_qk_norm_width(const eng_config *c, bool k)
{
    int64_t heads = c->qk_norm_whole ? (k ? c->n_kv_heads : c->n_heads) : 1;
    return heads * c->head_dim;
}

/* Whether a sequence that may reach `reserved` positions (its prompt plus
 * the tokens it may generate) rotates with longrope's long factors: when
 * it may pass original_max_position_embeddings, as transformers switches
 * (on the current length there). False for every other rope. */
static inline bool eng_rope_long_for(const eng_config *c, int64_t reserved)
{
    return c->rope_scaling == ENG_ROPE_LONGROPE && reserved > c->rope_original_max_position;
}

/* Whether layer l rotates q and k (eng_config's nope_layers). */
static inline bool eng_layer_rotates(const eng_config *c, int32_t l)
{
    if (l < 0 || l >= ENG_MAX_NOPE_LAYERS)
        return true;
    return !(c->nope_layers[l / 64] >> (l % 64) & 1);
}

/* One decoder layer's weights. Norms and biases are dense [1, n]; a bias
 * that does not exist has rows == 0. */
typedef struct eng_layer {
    qtensor attn_norm, ffn_norm;
    qtensor wq, wk, wv, wo;
    qtensor bq, bk, bv;
    qtensor bo;             /* GPT-OSS's output projection bias [1, hidden] */
    qtensor sinks;          /* GPT-OSS's attention sinks [1, n_heads] */
    qtensor q_norm, k_norm; /* Qwen3's per-head norms [1, head_dim] */
    qtensor w_gate, w_up, w_down;
    qtensor post_attn_norm, post_ffn_norm; /* Gemma's sandwich norms [1, hidden] */
    /* a mixture-of-experts layer (eng_layer_is_moe): the router [n_experts,
     * hidden], dense; the routed experts' gate, up and down, expert e's at
     * [3e], [3e + 1], [3e + 2] ([expert_ff, hidden] twice, [hidden,
     * expert_ff]; eng_expert_proj names them as projections); Qwen2-MoE's
     * shared expert is w_gate, w_up, w_down (of shared_expert_ff), scaled by
     * sigmoid(shared_gate . h), shared_gate [1, hidden]. NULL / rows 0 in a
     * dense layer. */
    qtensor router;
    qtensor *experts; /* [3 * n_experts], owned */
    qtensor shared_gate;
    /* GPT-OSS (router_bias): the router's [1, n_experts], and the experts'
     * gate, up and down biases [n_experts, expert_ff] twice and
     * [n_experts, hidden], dense */
    qtensor router_b, expert_b[3];
    qtensor layer_scalar; /* Gemma 4's [1, 1] (eng_config's layer_scalar); rows 0: none */
    eng_gemma4_layer g4;  /* Gemma 4's per-layer input weights (gemma4.h) */
    eng_linear_layer lin; /* a linear-attention layer's own tensors (hybrid.h) */
} eng_layer;

/*
 * A model in memory: immutable config and weights (no run state), the
 * tokenizer, and the mapped files that borrowed tensors point into. Owned
 * by whoever called eng_model_load; eng_model_free releases everything.
 */
typedef struct eng_model {
    eng_config cfg;
    qtensor embed; /* [vocab, hidden] */
    eng_layer *layers;
    qtensor norm;
    qtensor lm_head;     /* rows == 0 when tied to embed */
    eng_gemma4_model g4; /* Gemma 4's per-layer input embeddings (gemma4.h) */
    eng_mtp mtp;         /* the checkpoint's MTP layers, for drafting (mtp.h) */
    tok_tokenizer *tok;
    char format[32]; /* "safetensors", "bitsandbytes-4bit", "gguf" */
    char quant[32];  /* what the linear layers hold: "nf4", "q4_1", "bf16", ... */
    /* what the model calls itself: config.json's _name_or_path or the
     * folder's name; a GGUF's general.name or the file's name */
    char name[256];
    st_file *shards; /* safetensors files kept mapped */
    size_t n_shards;
    gguf_file *gguf; /* or the GGUF file kept mapped */
    /* the chat template's Jinja source (the default, and the one for
     * requests with tools), owned, NULL when none: from --chat-template, else
     * the folder's chat_template.jinja or tokenizer_config.json, else the
     * GGUF's tokenizer.chat_template[.tool_use] (chat_template.c) */
    char *chat_template;
    char *chat_template_tool_use;
} eng_model;

typedef struct eng_load_opts {
    const char *path; /* a Hugging Face folder or a .gguf file */
    /* quantize on load: "none" (default), "nf4", "nf4-dq", "fp4", "int4",
     * "int8"; weights that are already quantized are never quantized again */
    const char *quant;
    int32_t blocksize;     /* nf4/fp4 absmax block, default 64 */
    int32_t group_size;    /* int4/int8 group, default 128 for int4, per channel for int8 */
    bool quantize_lm_head; /* lm_head stays dense unless asked */
    /* the float dtype of dense parameters: "f32", "bf16", "f16", or NULL to
     * keep the file's; quant state keeps its own dtype either way */
    const char *dtype;
    /* a file whose text replaces the model's chat templates (both: the
     * tool_use one too), or NULL to keep the model's */
    const char *chat_template;
} eng_load_opts;

/*
 * Load a model: config, weights (mapped, borrowed where the file's layout is
 * the kind's layout; quantized on load when asked), tokenizer. Every tensor
 * is checked against the config's shapes; an architecture or tensor kind we
 * do not run is refused by name. On error *m holds nothing.
 */
int eng_model_load(eng_model *m, const eng_load_opts *o, char *msg, size_t msg_len);
void eng_model_free(eng_model *m);
/*
 * A model's tokenizer alone, without its weights: a Hugging Face folder's
 * tokenizer.json (+ tokenizer_config.json), or a GGUF file's
 * tokenizer.ggml.* metadata (a vocabulary-only GGUF, with no tensors,
 * included). The same tokenizer eng_model_load gives the model. *out is the
 * caller's (tok_free); NULL on error.
 */
int eng_tokenizer_load(tok_tokenizer **out, const char *path, char *msg, size_t msg_len);
/* Call fn on every tensor the model holds (embeddings, norms, lm_head
 * when untied, each layer's weights and biases when present). */
void eng_model_each_tensor(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx);
/* Bytes of weights the model holds (codes and quant state). */
size_t eng_model_weight_bytes(const eng_model *m);
const char *eng_arch_name(eng_arch a);

/* --- chat template sources (chat_template.c) ------------------------------- */

/* The largest chat template taken (real ones are under 32 KiB). */
#define ENG_CHAT_TEMPLATE_MAX_BYTES ((size_t)1 << 20)

/* A template file's whole text into *out (the caller frees): refused when
 * missing, larger than ENG_CHAT_TEMPLATE_MAX_BYTES, holding a NUL byte or
 * not UTF-8, naming the file. */
int eng_chat_template_read_file(const char *path, char **out, char *msg, size_t msg_len);
/* A Hugging Face folder's templates (a model's or an adapter's), as
 * transformers finds them: chat_template.jinja (and
 * additional_chat_templates/tool_use.jinja) when there, else
 * tokenizer_config.json's "chat_template" (a string, or a list of named
 * templates: "default" into *tmpl, "tool_use" into *tool_use). Either is
 * NULL when the folder has none; both are the caller's (free()). On error
 * both are NULL. */
int eng_chat_templates_from_folder(const char *dir, char **tmpl, char **tool_use, char *msg,
                                   size_t msg_len);
/* The same for the open folder dirfd (dir naming it in messages); with
 * no_links (an adapter's folder) no file is read through a symlink
 * (mf_open_in's MF_NO_LINKS): one is refused, naming it. */
int eng_chat_templates_at(int dirfd, const char *dir, bool no_links, char **tmpl, char **tool_use,
                          char *msg, size_t msg_len);

/* adapters as the engine sees them (low-rank deltas, weight versions, the
 * projections they apply to) are the other half of this header */
#include "weights.h"

#endif

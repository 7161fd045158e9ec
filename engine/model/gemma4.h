/*
 * gemma4.h - Gemma 4's own parts of a model, beside model.h (which
 * includes it before eng_config; include model.h): its config fields, the
 * per-layer input embeddings' model-wide and per-layer weights, and the
 * per-layer shapes they imply. load_hf.c and gemma4.c read them from a
 * Hugging Face folder (transformers 5's Gemma4TextConfig and
 * modeling_gemma4.py); the walk (engine/runtime/walk.c) and the float64
 * reference (tests/ref_forward.h) run them. Split from model.h, which is
 * at its length limit.
 */
#ifndef QL_MODEL_GEMMA4_H
#define QL_MODEL_GEMMA4_H

#include <stdbool.h>
#include <stdint.h>

#include "modelfile.h"

struct eng_config;

/* What config.json's Gemma 4 options ask (all zero for every other model). */
typedef struct eng_gemma4_config {
    /* per-layer input embeddings (hidden_size_per_layer_input; 0: none):
     * every token gets ple_dim values per layer, (norm(x0 @ P^T / sqrt(hidden))
     * + E[token] * ple_embed_scale) / sqrt(2), x0 the scaled embeddings, P
     * per_layer_model_projection, E embed_tokens_per_layer; after its MLP
     * each layer adds norm(per_layer_projection(gelu_tanh(
     * per_layer_input_gate(x)) * its slice)) to the residual */
    int32_t ple_dim;
    int32_t ple_vocab;     /* vocab_size_per_layer_input: E's rows */
    float ple_embed_scale; /* sqrt(ple_dim) as E's dtype holds it (as the main embeddings) */
    /* attention_k_eq_v: the full layers have no v_proj; their values are
     * k_proj's output (before k's norm and RoPE) through the weightless v
     * norm, and their kv heads are num_global_key_value_heads
     * (full_kv_heads) */
    bool k_eq_v;
    /* use_double_wide_mlp: the kv-shared layers' MLP is twice
     * intermediate_size wide */
    bool double_wide;
    /* enable_moe_block: every layer runs a mixture of experts beside its
     * MLP (eng_config's n_experts, n_experts_used, expert_ff): the MLP's
     * output through post_feedforward_layernorm_1, plus the experts'
     * (pre_feedforward_layernorm_2 of the residual in, routed by
     * softmax(proj(norm(residual) * scale / sqrt(hidden))), top-k
     * renormalized, times per_expert_scale) through
     * post_feedforward_layernorm_2, both through post_feedforward_layernorm */
    bool moe_block;
    /* the full-attention layers' head size and kv heads: global_head_dim,
     * and num_global_key_value_heads where attention_k_eq_v lets it apply
     * (Gemma4TextConfig's per_layer_config for each full layer); 0 where
     * they are head_dim and num_key_value_heads (every model but Gemma 4).
     * Released checkpoints have 512 against the sliding layers' 256. */
    int32_t full_head_dim, full_kv_heads;
    /* the text model of a Gemma4ForConditionalGeneration folder: its
     * text_config, its tensors under model.language_model. (the vision
     * and audio towers are not read) */
    bool language_model;
} eng_gemma4_config;

/* A layer's per-layer-input weights (rows 0 when the model has none). */
typedef struct eng_gemma4_layer {
    qtensor ple_gate; /* per_layer_input_gate [ple_dim, hidden] (an adapter target) */
    qtensor ple_proj; /* per_layer_projection [hidden, ple_dim] (an adapter target) */
    qtensor ple_norm; /* post_per_layer_input_norm [1, hidden] */
    /* the MoE block's (moe_block; the router's proj is eng_layer.router,
     * the experts eng_layer.experts): router.scale [1, hidden],
     * router.per_expert_scale [1, experts], post_feedforward_layernorm_1,
     * pre_feedforward_layernorm_2, post_feedforward_layernorm_2 [1, hidden] */
    qtensor router_scale, expert_scale;
    qtensor mlp_post_norm, moe_pre_norm, moe_post_norm;
} eng_gemma4_layer;

/* The model-wide ones (rows 0 when none). */
typedef struct eng_gemma4_model {
    qtensor ple_embed; /* embed_tokens_per_layer [ple_vocab, n_layers * ple_dim] */
    qtensor ple_proj;  /* per_layer_model_projection [n_layers * ple_dim, hidden] */
    qtensor ple_norm;  /* per_layer_projection_norm [1, ple_dim] */
} eng_gemma4_model;

/* The layer whose cache layer l attends over: l, or for one of
 * kv_shared_layers the last earlier unshared layer of its type (layers.c). */
int32_t eng_layer_kv_source(const struct eng_config *c, int32_t l);
/* Layer l's MLP width: intermediate_size, twice that on a kv-shared layer
 * of a double_wide model (gemma4.c). */
int64_t eng_layer_ff(const struct eng_config *c, int32_t l);
/* Whether layer l takes its values from k_proj (k_eq_v on a full layer). */
bool eng_layer_k_is_v(const struct eng_config *c, int32_t l);
/* Layer l's head size and kv heads: head_dim and n_kv_heads, or on a full
 * layer of Gemma 4 its full_head_dim and full_kv_heads (gemma4.c). */
int32_t eng_layer_head_dim(const struct eng_config *c, int32_t l);
int32_t eng_layer_kv_heads(const struct eng_config *c, int32_t l);
/* The largest head size and kv row (kv heads x head size) of any layer:
 * what a buffer sized for every layer needs. */
int32_t eng_max_head_dim(const struct eng_config *c);
int64_t eng_max_kv_dim(const struct eng_config *c);
/* Whether some layer's head size or kv heads differ from head_dim and
 * n_kv_heads (what a backend that runs one shape refuses). */
bool eng_heads_vary(const struct eng_config *c);
/* The head size of the layers that rotate with the main table (RoPE's
 * rope_theta one): Gemma 4's full layers' full_head_dim, else head_dim. */
int32_t eng_rope_head_dim(const struct eng_config *c);

#endif

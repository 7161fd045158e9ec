/*
 * hybrid.h - a hybrid model's linear-attention layers as engine/model/
 * holds them: which layers are Gated DeltaNet (Qwen3.5's linear_attention
 * layer type), their shapes (eng_linear_cfg, a part of eng_config) and
 * their own tensors (eng_linear_layer, a part of eng_layer). Included by
 * model.h (include model.h); split from it for length alone. The
 * projections of such a layer are eng_layer's: in_proj_qkv in wq,
 * in_proj_z in wk and out_proj in wo (an adapter names them by their own
 * module names, adapters/peft.c).
 *
 * The arithmetic (transformers 5's Qwen3_5GatedDeltaNet): a causal
 * depthwise conv1d (conv_kernel taps, no bias) then silu over the mixed
 * q | k | v row; q and k split into heads and L2-normalized (eps 1e-6
 * inside the root), q times k_head_dim^-1/2; beta = sigmoid(b), g =
 * -exp(A_log) softplus(a + dt_bias); per value head the state S (k x v)
 * decays by exp(g), takes the delta rule S += k (beta (v - S^T k))^T and
 * answers S^T q; each head's answer through an RMSNorm with a plain weight
 * times silu(z). A value head h reads key head h / (n_v_heads /
 * n_k_heads).
 */
#ifndef QL_MODEL_HYBRID_H
#define QL_MODEL_HYBRID_H

#include <stdbool.h>
#include <stdint.h>

#include "modelfile.h"

/* The most layers a hybrid model may have (eng_linear_cfg.layers). */
#define ENG_MAX_LINEAR_LAYERS 1024

typedef struct eng_linear_cfg {
    /* bit l of word l / 64: layer l is linear attention; all zero for a
     * model with none */
    uint64_t layers[ENG_MAX_LINEAR_LAYERS / 64];
    int32_t n_layers; /* how many bits are set */
    int32_t n_k_heads, n_v_heads, k_head_dim, v_head_dim;
    int32_t conv_kernel; /* linear_conv_kernel_dim */
    /* Qwen3.5's full attention layers: q_proj gives each head's query
     * then its gate (2 head_dim rows a head), the attention's output times
     * sigmoid(gate) before o_proj */
    bool attn_output_gate;
    /* a GGUF (llama.cpp's converter): value heads in tiled order, value
     * head h reading key head h % n_k_heads (not h / (n_v / n_k)), and the
     * A tensor holding -exp(A_log) */
    bool v_tiled, a_neg_exp;
    /* mtp_num_hidden_layers (a GGUF's nextn_predict_layers): the MTP
     * layers the config declares (mtp.h; loaded only where the checkpoint
     * has their tensors) */
    int32_t mtp_layers;
} eng_linear_cfg;

/* The key head value head h reads. */
static inline int32_t eng_linear_key_head(const eng_linear_cfg *lc, int32_t h)
{
    return lc->v_tiled ? h % lc->n_k_heads : h / (lc->n_v_heads / lc->n_k_heads);
}

/* A linear-attention layer's tensors besides its projections: in_proj_b
 * and in_proj_a [n_v_heads, hidden] (dense), the conv's taps [conv_dim,
 * conv_kernel], A_log and dt_bias [n_v_heads], the gated norm's weight
 * [v_head_dim]. rows 0 in a full-attention layer. */
typedef struct eng_linear_layer {
    qtensor in_b, in_a, conv, a_log, dt_bias, norm;
} eng_linear_layer;

/* Whether layer l is linear attention. */
static inline bool eng_linear_is(const eng_linear_cfg *lc, int32_t l)
{
    if (l < 0 || l >= ENG_MAX_LINEAR_LAYERS)
        return false;
    return lc->layers[l / 64] >> (l % 64) & 1;
}

/* The conv's channels: q, k and v side by side. */
static inline int64_t eng_linear_conv_dim(const eng_linear_cfg *lc)
{
    return 2 * (int64_t)lc->n_k_heads * lc->k_head_dim + (int64_t)lc->n_v_heads * lc->v_head_dim;
}

/* Floats one linear layer keeps per sequence: the conv's last
 * conv_kernel - 1 inputs, then every value head's k x v state. */
static inline int64_t eng_linear_layer_state(const eng_linear_cfg *lc)
{
    return (int64_t)(lc->conv_kernel - 1) * eng_linear_conv_dim(lc) +
           (int64_t)lc->n_v_heads * lc->k_head_dim * lc->v_head_dim;
}

/* Floats a sequence's recurrent state holds: every linear layer's. */
static inline int64_t eng_linear_seq_state(const eng_linear_cfg *lc)
{
    return (int64_t)lc->n_layers * eng_linear_layer_state(lc);
}

/* Why a model with linear layers has no prefix cache (nor next-turn
 * cache), for the log and /info; NULL for a model without them. */
static inline const char *eng_linear_prefix_off(const eng_linear_cfg *lc)
{
    return lc->n_layers > 0 ? "the model has linear-attention layers, whose recurrent state is "
                              "not kept at cached block boundaries"
                            : NULL;
}

#endif

/*
 * layers.c - the decoder-layer table: every tensor of a layer, by its
 * Hugging Face name and its GGUF name, its shape in config terms and the
 * eng_layer field it goes to. Both loaders read a layer through this one
 * table, and the whole-model walks (each tensor, free) go over it, so a
 * part added here is loaded, counted and freed everywhere.
 *
 * It owns nothing; it touches the model's layers and calls the loader it
 * is given for each tensor.
 */
#include "internal/model_internal.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    DIM_NONE,
    DIM_HIDDEN,
    DIM_Q,
    DIM_KV,
    DIM_FF,
    DIM_HEAD,
    DIM_HEADS,
    DIM_ONE,
    DIM_PLE, /* Gemma 4's hidden_size_per_layer_input */
    DIM_EXPERTS,
    /* Qwen3.5: q_proj's query and gate rows (2 * DIM_Q); a linear layer's
     * conv channels (q | k | v), values, value heads, one value head's
     * dims, conv taps (hybrid.h) */
    DIM_Q_GATED,
    DIM_LIN_QKV,
    DIM_LIN_V,
    DIM_LIN_HEADS,
    DIM_LIN_HEAD,
    DIM_LIN_TAPS
} layer_dim;

/* When a part is present: always, with attention_bias, with qk_norm,
 * unless the layer is fused (Phi-3: q/k/v and gate/up come from one tensor
 * each, fused_parts below); with or without Gemma's sandwich norms (whose
 * Hugging Face names reuse post_attention_layernorm for the norm after
 * attention, so the MLP's input norm has two rows); GPT-OSS's output bias
 * and sinks, and its MLP's input norm, which llama.cpp's converter names
 * post_attention_norm (a third row for it); OLMo 3's norms after attention
 * and the MLP (the sandwich's, without its input norms) and its q/k norms
 * over the whole projection. */
typedef enum {
    ALWAYS,
    UNLESS_POST_NORMS,
    WITH_BIAS,
    WITH_QK_NORM,
    WITH_QK_NORM_WHOLE,
    WITH_POST_NORMS,
    UNLESS_FUSED,
    WITHOUT_SANDWICH,
    WITH_SANDWICH,
    WITH_O_BIAS,
    WITH_SINKS,
    GPT_OSS_FFN_NORM,
    WITH_LAYER_SCALAR,
    WITH_PER_LAYER_INPUT,
    WITH_MOE_BLOCK,
    WITH_OUTPUT_GATE, /* Qwen3.5's full layers: q_proj holds the gate too */
    LINEAR_LAYER      /* Qwen3.5's Gated DeltaNet layers (their linear_attn.*) */
} layer_when;

/* Each tensor of a layer: its Hugging Face and GGUF names, its shape in
 * config terms (cols DIM_NONE: a vector), and where it goes. */
static const struct layer_part {
    const char *hf, *gguf;
    layer_dim rows, cols;
    tensor_role role;
    size_t field; /* offsetof(eng_layer, ...) */
    layer_when when;
} layer_parts[] = {
    {"input_layernorm.weight", "attn_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, attn_norm), UNLESS_POST_NORMS},
    {"post_attention_layernorm.weight", "ffn_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, ffn_norm), WITHOUT_SANDWICH},
    {"post_attention_layernorm.weight", "post_attention_norm.weight", DIM_HIDDEN, DIM_NONE,
     ROLE_DENSE, offsetof(eng_layer, post_attn_norm), WITH_POST_NORMS},
    {"post_attention_layernorm.weight", "post_attention_norm.weight", DIM_HIDDEN, DIM_NONE,
     ROLE_DENSE, offsetof(eng_layer, ffn_norm), GPT_OSS_FFN_NORM},
    {"pre_feedforward_layernorm.weight", "ffn_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, ffn_norm), WITH_SANDWICH},
    {"post_feedforward_layernorm.weight", "post_ffw_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, post_ffn_norm), WITH_POST_NORMS},
    {"self_attn.q_proj.weight", "attn_q.weight", DIM_Q, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wq), UNLESS_FUSED},
    {"self_attn.k_proj.weight", "attn_k.weight", DIM_KV, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wk), UNLESS_FUSED},
    {"self_attn.v_proj.weight", "attn_v.weight", DIM_KV, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wv), UNLESS_FUSED},
    {"self_attn.o_proj.weight", "attn_output.weight", DIM_HIDDEN, DIM_Q, ROLE_LINEAR,
     offsetof(eng_layer, wo), ALWAYS},
    {"mlp.gate_proj.weight", "ffn_gate.weight", DIM_FF, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, w_gate), UNLESS_FUSED},
    {"mlp.up_proj.weight", "ffn_up.weight", DIM_FF, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, w_up), UNLESS_FUSED},
    {"mlp.down_proj.weight", "ffn_down.weight", DIM_HIDDEN, DIM_FF, ROLE_LINEAR,
     offsetof(eng_layer, w_down), ALWAYS},
    {"self_attn.q_norm.weight", "attn_q_norm.weight", DIM_HEAD, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, q_norm), WITH_QK_NORM},
    {"self_attn.k_norm.weight", "attn_k_norm.weight", DIM_HEAD, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, k_norm), WITH_QK_NORM},
    {"self_attn.q_norm.weight", "attn_q_norm.weight", DIM_Q, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, q_norm), WITH_QK_NORM_WHOLE},
    {"self_attn.k_norm.weight", "attn_k_norm.weight", DIM_KV, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, k_norm), WITH_QK_NORM_WHOLE},
    {"self_attn.q_proj.bias", "attn_q.bias", DIM_Q, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bq),
     WITH_BIAS},
    {"self_attn.k_proj.bias", "attn_k.bias", DIM_KV, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bk),
     WITH_BIAS},
    {"self_attn.v_proj.bias", "attn_v.bias", DIM_KV, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bv),
     WITH_BIAS},
    {"self_attn.o_proj.bias", "attn_output.bias", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, bo), WITH_O_BIAS},
    {"self_attn.sinks", "attn_sinks.weight", DIM_HEADS, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, sinks), WITH_SINKS},
    {"layer_scalar", "layer_output_scale.weight", DIM_ONE, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, layer_scalar), WITH_LAYER_SCALAR},
    {"per_layer_input_gate.weight", "inp_gate.weight", DIM_PLE, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, g4.ple_gate), WITH_PER_LAYER_INPUT},
    {"per_layer_projection.weight", "proj.weight", DIM_HIDDEN, DIM_PLE, ROLE_LINEAR,
     offsetof(eng_layer, g4.ple_proj), WITH_PER_LAYER_INPUT},
    {"post_per_layer_input_norm.weight", "post_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, g4.ple_norm), WITH_PER_LAYER_INPUT},
    {"router.scale", "ffn_gate_inp.scale", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, g4.router_scale), WITH_MOE_BLOCK},
    {"router.per_expert_scale", "ffn_down_exps.scale", DIM_EXPERTS, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, g4.expert_scale), WITH_MOE_BLOCK},
    {"post_feedforward_layernorm_1.weight", "post_ffw_norm_1.weight", DIM_HIDDEN, DIM_NONE,
     ROLE_DENSE, offsetof(eng_layer, g4.mlp_post_norm), WITH_MOE_BLOCK},
    {"pre_feedforward_layernorm_2.weight", "pre_ffw_norm_2.weight", DIM_HIDDEN, DIM_NONE,
     ROLE_DENSE, offsetof(eng_layer, g4.moe_pre_norm), WITH_MOE_BLOCK},
    {"post_feedforward_layernorm_2.weight", "post_ffw_norm_2.weight", DIM_HIDDEN, DIM_NONE,
     ROLE_DENSE, offsetof(eng_layer, g4.moe_post_norm), WITH_MOE_BLOCK},
    {"self_attn.q_proj.weight", "attn_q.weight", DIM_Q_GATED, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wq), WITH_OUTPUT_GATE},
    /* a linear layer's projections go where attention's would (hybrid.h) */
    {"linear_attn.in_proj_qkv.weight", "attn_qkv.weight", DIM_LIN_QKV, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wq), LINEAR_LAYER},
    {"linear_attn.in_proj_z.weight", "attn_gate.weight", DIM_LIN_V, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wk), LINEAR_LAYER},
    {"linear_attn.out_proj.weight", "ssm_out.weight", DIM_HIDDEN, DIM_LIN_V, ROLE_LINEAR,
     offsetof(eng_layer, wo), LINEAR_LAYER},
    {"linear_attn.in_proj_b.weight", "ssm_beta.weight", DIM_LIN_HEADS, DIM_HIDDEN, ROLE_DENSE,
     offsetof(eng_layer, lin.in_b), LINEAR_LAYER},
    {"linear_attn.in_proj_a.weight", "ssm_alpha.weight", DIM_LIN_HEADS, DIM_HIDDEN, ROLE_DENSE,
     offsetof(eng_layer, lin.in_a), LINEAR_LAYER},
    /* [conv_dim, 1, taps], read as the rows of its first two dims */
    {"linear_attn.conv1d.weight", "ssm_conv1d.weight", DIM_LIN_QKV, DIM_LIN_TAPS, ROLE_FUSED,
     offsetof(eng_layer, lin.conv), LINEAR_LAYER},
    {"linear_attn.A_log", "ssm_a", DIM_LIN_HEADS, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, lin.a_log), LINEAR_LAYER},
    {"linear_attn.dt_bias", "ssm_dt.bias", DIM_LIN_HEADS, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, lin.dt_bias), LINEAR_LAYER},
    {"linear_attn.norm.weight", "ssm_norm.weight", DIM_LIN_HEAD, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, lin.norm), LINEAR_LAYER},
};

#define N_LAYER_PARTS (sizeof layer_parts / sizeof *layer_parts)

/* Phi-3's fused projections, by their Hugging Face and GGUF names (llama.cpp's
 * converter keeps them fused: attn_qkv, and gate_up as ffn_up of twice the
 * rows), and the parts their rows split into, in order: q, k, v as
 * transformers slices qkv_proj's output; gate, then up, as its chunk(2). */
static const struct fused_part {
    const char *hf, *gguf;
    int n;
    layer_dim rows[3];
    size_t field[3];
} fused_parts[] = {
    {"self_attn.qkv_proj.weight",
     "attn_qkv.weight",
     3,
     {DIM_Q, DIM_KV, DIM_KV},
     {offsetof(eng_layer, wq), offsetof(eng_layer, wk), offsetof(eng_layer, wv)}},
    {"mlp.gate_up_proj.weight",
     "ffn_up.weight",
     2,
     {DIM_FF, DIM_FF},
     {offsetof(eng_layer, w_gate), offsetof(eng_layer, w_up)}},
};

/* Layer l's fused weights loaded whole and split into their parts. */
static int load_fused(model_loader *L, model_tensor_loader load, bool gguf, int32_t l,
                      const int64_t *dims, char *msg, size_t msg_len)
{
    int rc = QL_OK;
    for (size_t f = 0; f < sizeof fused_parts / sizeof *fused_parts && rc == QL_OK; f++) {
        const struct fused_part *fp = &fused_parts[f];
        char name[256];
        if (gguf)
            snprintf(name, sizeof name, "blk.%d.%s", l, fp->gguf);
        else
            snprintf(name, sizeof name, "model.layers.%d.%s", l, fp->hf);
        int64_t rows = 0;
        for (int k = 0; k < fp->n; k++)
            rows += dims[fp->rows[k]];
        qtensor fused = {0};
        rc = load(L, name, rows, dims[DIM_HIDDEN], ROLE_FUSED, &fused, msg, msg_len);
        for (int k = 0, r0 = 0; k < fp->n && rc == QL_OK; r0 += (int)dims[fp->rows[k]], k++)
            rc = model_split_rows(L, name, &fused, r0, dims[fp->rows[k]],
                                  (qtensor *)((char *)&L->m->layers[l] + fp->field[k]), msg,
                                  msg_len);
        qt_free(&fused);
    }
    return rc;
}

/* eng_layer_kv_source (model.h): Gemma 4's kv-shared layers' sources. */
int32_t eng_layer_kv_source(const eng_config *c, int32_t l)
{
    int32_t first = c->n_layers - c->kv_shared_layers;
    if (c->kv_shared_layers <= 0 || l < first)
        return l;
    for (int32_t s = first - 1; s >= 0; s--)
        if (eng_layer_slides(c, s) == eng_layer_slides(c, l))
            return s;
    return l; /* the loader refuses a type no unshared layer has */
}

/* Whether layer l of a model of config c has the part (the walks skip the
 * others, so a field two rows name is visited once). A mixture-of-experts
 * layer has no plain MLP: experts.c loads its experts, and Qwen2-MoE's
 * shared expert into the MLP's fields. */
static bool part_applies(const eng_config *c, int32_t l, const struct layer_part *part)
{
    bool mlp = part->field == offsetof(eng_layer, w_gate) ||
               part->field == offsetof(eng_layer, w_up) ||
               part->field == offsetof(eng_layer, w_down);
    if (mlp && eng_layer_is_moe(c, l) && !c->g4.moe_block) /* Gemma 4's MLP stays beside */
        return false;
    /* Gemma 4's kv-shared layers have no k or v of their own */
    bool kv = part->field == offsetof(eng_layer, wk) || part->field == offsetof(eng_layer, wv) ||
              part->field == offsetof(eng_layer, k_norm) ||
              part->field == offsetof(eng_layer, bk) || part->field == offsetof(eng_layer, bv);
    if (kv && eng_layer_kv_source(c, l) != l)
        return false;
    /* nor v on a full layer of an attention_k_eq_v model */
    if (part->field == offsetof(eng_layer, wv) && eng_layer_k_is_v(c, l))
        return false;
    /* Qwen3.5: a linear layer has no self_attn.*, a full one no
     * linear_attn.*, and a gated q_proj replaces the plain one */
    bool linear = eng_linear_is(&c->linear, l);
    if (linear ? strncmp(part->hf, "self_attn.", 10) == 0 : part->when == LINEAR_LAYER)
        return false;
    if (part->rows == DIM_Q && part->field == offsetof(eng_layer, wq) && c->linear.attn_output_gate)
        return false;
    switch (part->when) {
    case ALWAYS: return true;
    case UNLESS_POST_NORMS: return !c->post_norms;
    case WITH_BIAS: return c->attention_bias;
    case WITH_QK_NORM: return c->qk_norm && !c->qk_norm_whole;
    case WITH_QK_NORM_WHOLE: return c->qk_norm && c->qk_norm_whole;
    case UNLESS_FUSED: return true; /* loaded whole, or split from the fused tensor */
    case WITHOUT_SANDWICH:
        return !c->sandwich_norms && !c->post_norms && c->arch != ENG_ARCH_GPT_OSS &&
               c->arch != ENG_ARCH_QWEN3_5;
    case WITH_SANDWICH: return c->sandwich_norms;
    case WITH_POST_NORMS: return c->sandwich_norms || c->post_norms;
    case WITH_O_BIAS: return c->o_bias;
    case WITH_SINKS: return c->attn_sinks;
    case GPT_OSS_FFN_NORM: return c->arch == ENG_ARCH_GPT_OSS || c->arch == ENG_ARCH_QWEN3_5;
    case WITH_LAYER_SCALAR: return c->layer_scalar;
    case WITH_PER_LAYER_INPUT: return c->g4.ple_dim > 0;
    case WITH_MOE_BLOCK: return c->g4.moe_block;
    case WITH_OUTPUT_GATE: return c->linear.attn_output_gate;
    case LINEAR_LAYER: return true; /* on linear layers, as above */
    }
    return false;
}

/* Layer l's part p, through the table's offsets. */
static qtensor *layer_part(const eng_model *m, int32_t l, size_t p)
{
    return (qtensor *)((char *)&m->layers[l] + layer_parts[p].field);
}

/* Layer l's sizes into dims (indexed by the parts' DIM_*). */
static void layer_dims(const eng_config *c, int32_t l, int64_t *dims)
{
    int64_t d[] = {
        [DIM_NONE] = 0,
        [DIM_HIDDEN] = c->hidden_size,
        [DIM_Q] = (int64_t)c->n_heads * c->head_dim,
        [DIM_KV] = (int64_t)c->n_kv_heads * c->head_dim,
        [DIM_FF] = eng_layer_ff(c, l),         /* Gemma 4's kv-shared layers may be twice as wide */
        [DIM_HEAD] = eng_layer_head_dim(c, l), /* Gemma 4's full layers: their own head size */
        [DIM_HEADS] = c->n_heads,
        [DIM_ONE] = 1,
        [DIM_PLE] = c->g4.ple_dim,
        [DIM_EXPERTS] = c->n_experts,
        [DIM_Q_GATED] = 2 * (int64_t)c->n_heads * c->head_dim,
        [DIM_LIN_QKV] = eng_linear_conv_dim(&c->linear),
        [DIM_LIN_V] = (int64_t)c->linear.n_v_heads * c->linear.v_head_dim,
        [DIM_LIN_HEADS] = c->linear.n_v_heads,
        [DIM_LIN_HEAD] = c->linear.v_head_dim,
        [DIM_LIN_TAPS] = c->linear.conv_kernel,
    };
    d[DIM_Q] = (int64_t)c->n_heads * d[DIM_HEAD];
    d[DIM_KV] = (int64_t)eng_layer_kv_heads(c, l) * d[DIM_HEAD];
    memcpy(dims, d, sizeof d);
}

/* The parts of a layer that config c gives as layer l into dst, each named
 * prefix then its GGUF name (prefix blk.N.) or its Hugging Face one. */
static int load_parts(model_loader *L, model_tensor_loader load, bool gguf, int32_t l,
                      const char *prefix, eng_layer *dst, bool fused, char *msg, size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    int64_t dims[DIM_LIN_TAPS + 1];
    layer_dims(c, l, dims);
    int rc = QL_OK;
    for (size_t p = 0; p < N_LAYER_PARTS && rc == QL_OK; p++) {
        const struct layer_part *part = &layer_parts[p];
        if (!part_applies(c, l, part) || (part->when == UNLESS_FUSED && fused))
            continue;
        char name[256];
        snprintf(name, sizeof name, "%s%s", prefix, gguf ? part->gguf : part->hf);
        rc = load(L, name, dims[part->rows], dims[part->cols], part->role,
                  (qtensor *)((char *)dst + part->field), msg, msg_len);
    }
    return rc;
}

int model_layers_load(model_loader *L, model_tensor_loader load, bool gguf, char *msg,
                      size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    bool fused = c->arch == ENG_ARCH_PHI3;
    int rc = QL_OK;
    for (int32_t l = 0; l < c->n_layers && rc == QL_OK; l++) {
        if (fused) {
            int64_t dims[DIM_LIN_TAPS + 1];
            layer_dims(c, l, dims);
            rc = load_fused(L, load, gguf, l, dims, msg, msg_len);
        }
        if (rc == QL_OK && eng_layer_is_moe(c, l))
            rc = model_experts_load(L, load, gguf, l, msg, msg_len);
        char prefix[64];
        snprintf(prefix, sizeof prefix, gguf ? "blk.%d." : "model.layers.%d.", l);
        if (rc == QL_OK)
            rc = load_parts(L, load, gguf, l, prefix, &L->m->layers[l], fused, msg, msg_len);
    }
    return rc;
}

int model_layer_load_full(model_loader *L, model_tensor_loader load, const char *hf_prefix,
                          eng_layer *dst, char *msg, size_t msg_len)
{
    /* the index past the decoder's: no linear bit, so the full layer's parts */
    return load_parts(L, load, false, L->m->cfg.n_layers, hf_prefix, dst, false, msg, msg_len);
}

int model_layer_load_full_gguf(model_loader *L, model_tensor_loader load, int32_t block,
                               eng_layer *dst, char *msg, size_t msg_len)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "blk.%d.", block);
    return load_parts(L, load, true, L->m->cfg.n_layers, prefix, dst, false, msg, msg_len);
}

void model_layer_each(const eng_config *c, const eng_layer *ly,
                      void (*fn)(const qtensor *t, void *ctx), void *ctx)
{
    for (size_t p = 0; p < N_LAYER_PARTS; p++) {
        const qtensor *t = (const qtensor *)((const char *)ly + layer_parts[p].field);
        if (part_applies(c, c->n_layers, &layer_parts[p]) && t->rows)
            fn(t, ctx);
    }
}

void model_layer_free(eng_layer *ly)
{
    for (size_t p = 0; p < N_LAYER_PARTS; p++)
        qt_free((qtensor *)((char *)ly + layer_parts[p].field));
}

void model_layers_each(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx)
{
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++) {
        for (size_t p = 0; p < N_LAYER_PARTS; p++)
            if (part_applies(&m->cfg, l, &layer_parts[p]) && layer_part(m, l, p)->rows)
                fn(layer_part(m, l, p), ctx);
        model_experts_each(m, l, fn, ctx);
    }
}

void model_layers_free(eng_model *m)
{
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++) {
        for (size_t p = 0; p < N_LAYER_PARTS; p++)
            qt_free(layer_part(m, l, p)); /* zeroes it: a field two rows name is freed once */
        model_experts_free(m, l);
    }
}

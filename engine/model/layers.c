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

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

typedef enum { DIM_NONE, DIM_HIDDEN, DIM_Q, DIM_KV, DIM_FF, DIM_HEAD } layer_dim;

/* When a part is present: always, with attention_bias, with qk_norm,
 * unless the layer is fused (Phi-3: q/k/v and gate/up come from one tensor
 * each, fused_parts below). */
typedef enum { ALWAYS, WITH_BIAS, WITH_QK_NORM, UNLESS_FUSED } layer_when;

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
     offsetof(eng_layer, attn_norm), ALWAYS},
    {"post_attention_layernorm.weight", "ffn_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, ffn_norm), ALWAYS},
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
    {"self_attn.q_proj.bias", "attn_q.bias", DIM_Q, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bq),
     WITH_BIAS},
    {"self_attn.k_proj.bias", "attn_k.bias", DIM_KV, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bk),
     WITH_BIAS},
    {"self_attn.v_proj.bias", "attn_v.bias", DIM_KV, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bv),
     WITH_BIAS},
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

/*
 * Rows [r0, r0 + n) of a bitsandbytes 4-bit fused weight (a Phi-3 saved
 * with load_in_4bit): its blocks run over the flattened rows, so the part
 * starts on a block boundary or is refused by name. The part copies its
 * codes and takes each block's absmax as the fused tensor dequantizes it
 * (double quantization undone, so the part is single-quantized with the
 * same values, bit for bit).
 */
static int split_bnb4_rows(const char *name, const qtensor *fused, int64_t r0, int64_t n,
                           qtensor *out, char *msg, size_t msg_len)
{
    int64_t e0 = r0 * fused->cols, count = n * fused->cols, bs = fused->blocksize;
    if (e0 % bs != 0 || e0 % 2 != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s': its part at row %lld does not start on a %lld-element "
                       "block, so it cannot be split",
                       name, (long long)r0, (long long)bs);
    int64_t nb = (count + bs - 1) / bs;
    float *absmax = malloc((size_t)nb * sizeof *absmax);
    if (!absmax)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    for (int64_t b = 0; b < nb; b++)
        absmax[b] = qt_block_absmax(fused, e0 / bs + b);
    qt_bnb4_parts parts = {.kind = fused->kind,
                           .rows = n,
                           .cols = fused->cols,
                           .blocksize = fused->blocksize,
                           .codes = fused->data + e0 / 2,
                           .codes_bytes = (size_t)((count + 1) / 2),
                           .codebook = fused->codebook,
                           .n_blocks = nb,
                           .absmax = absmax};
    char why[256];
    int rc = qt_from_bnb4(out, &parts, why, sizeof why);
    free(absmax);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "tensor '%s': %s", name, why);
    return QL_OK;
}

/*
 * Rows [r0, r0 + n) of a fused weight as a tensor of their own, each part
 * then finished (quantized on load, --dtype) as a linear of its own, so it
 * is what a separate q/k/v or gate/up would have been. Dense and GGUF-block
 * kinds store rows whole and back to back, so a part is a view (borrowed,
 * when the fused tensor is borrowed from the mapping; else a copy).
 * bitsandbytes 4-bit parts are copies (split_bnb4_rows).
 */
static int split_rows(const model_loader *L, const char *name, const qtensor *fused, int64_t r0,
                      int64_t n, qtensor *out, char *msg, size_t msg_len)
{
    const qt_traits *tr = &qt_traits_table[fused->kind];
    if (fused->kind == QT_NF4 || fused->kind == QT_FP4) {
        int rc = split_bnb4_rows(name, fused, r0, n, out, msg, msg_len);
        return rc == QL_OK ? model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len) : rc;
    }
    if (!tr->is_dense && !tr->is_gguf)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s' is %s; qlserve splits fused projections of dense, GGUF "
                       "block and bitsandbytes 4-bit kinds",
                       name, tr->name);
    size_t row_bytes = fused->data_bytes / (size_t)fused->rows;
    qtensor view = *fused;
    view.rows = n;
    view.data = fused->data + (size_t)r0 * row_bytes;
    view.data_bytes = (size_t)n * row_bytes;
    view.data_borrowed = true;
    int rc = QL_OK;
    if (fused->data_borrowed)
        *out = view;
    else if ((rc = qt_clone(out, &view)) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    return model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len);
}

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
            rc = split_rows(L, name, &fused, r0, dims[fp->rows[k]],
                            (qtensor *)((char *)&L->m->layers[l] + fp->field[k]), msg, msg_len);
        qt_free(&fused);
    }
    return rc;
}

/* Layer l's part p, through the table's offsets. */
static qtensor *layer_part(const eng_model *m, int32_t l, size_t p)
{
    return (qtensor *)((char *)&m->layers[l] + layer_parts[p].field);
}

int model_layers_load(model_loader *L, model_tensor_loader load, bool gguf, char *msg,
                      size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    const int64_t dims[] = {
        [DIM_NONE] = 0,
        [DIM_HIDDEN] = c->hidden_size,
        [DIM_Q] = (int64_t)c->n_heads * c->head_dim,
        [DIM_KV] = (int64_t)c->n_kv_heads * c->head_dim,
        [DIM_FF] = c->intermediate_size,
        [DIM_HEAD] = c->head_dim,
    };
    bool fused = c->arch == ENG_ARCH_PHI3;
    int rc = QL_OK;
    for (int32_t l = 0; l < c->n_layers && rc == QL_OK; l++) {
        if (fused)
            rc = load_fused(L, load, gguf, l, dims, msg, msg_len);
        for (size_t p = 0; p < N_LAYER_PARTS && rc == QL_OK; p++) {
            const struct layer_part *part = &layer_parts[p];
            if ((part->when == WITH_BIAS && !c->attention_bias) ||
                (part->when == WITH_QK_NORM && !c->qk_norm) ||
                (part->when == UNLESS_FUSED && fused))
                continue;
            char name[256];
            if (gguf)
                snprintf(name, sizeof name, "blk.%d.%s", l, part->gguf);
            else
                snprintf(name, sizeof name, "model.layers.%d.%s", l, part->hf);
            rc = load(L, name, dims[part->rows], dims[part->cols], part->role,
                      layer_part(L->m, l, p), msg, msg_len);
        }
    }
    return rc;
}

void model_layers_each(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx)
{
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++)
        for (size_t p = 0; p < N_LAYER_PARTS; p++)
            if (layer_part(m, l, p)->rows)
                fn(layer_part(m, l, p), ctx);
}

void model_layers_free(eng_model *m)
{
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++)
        for (size_t p = 0; p < N_LAYER_PARTS; p++)
            qt_free(layer_part(m, l, p));
}

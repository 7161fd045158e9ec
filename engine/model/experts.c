/*
 * experts.c - mixtures of experts as the loader sees them: the config
 * fields (Hugging Face and GGUF) and each MoE layer's router, routed
 * experts and Qwen2-MoE's shared expert, read from the layouts checkpoints
 * hold them in:
 *
 *   - per expert, one 2-D weight each: Qwen's mlp.experts.E.gate_proj /
 *     up_proj / down_proj, Mixtral's block_sparse_moe.experts.E.w1 (gate) /
 *     w3 (up) / w2 (down);
 *   - fused 3-D, transformers 5's in-memory layout: mlp.experts.gate_up_proj
 *     [experts, 2 * ff, hidden] (each expert's gate rows, then its up rows)
 *     and mlp.experts.down_proj [experts, hidden, ff];
 *   - a GGUF's blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps (llama.cpp's
 *     converter: ne [hidden, ff, experts] and [ff, hidden, experts], so
 *     expert e is a run of rows), with ffn_gate_inp the router and
 *     ffn_*_shexp, ffn_gate_inp_shexp the shared expert;
 *   - GPT-OSS's folder: mlp.experts.gate_up_proj [experts, hidden, 2 * ff]
 *     TRANSPOSED (y = x @ W[e]) with gate and up INTERLEAVED (gate the
 *     even columns, up the odd ones), down_proj [experts, ff, hidden]
 *     transposed, each expert copied into [out, in] tensors of its own
 *     (model_split_transposed); the biases gate_up_proj_bias [experts, 2 *
 *     ff] (interleaved the same way) and down_proj_bias, and the router's
 *     mlp.router.weight and .bias. Its GGUF is the converter's
 *     de-interleaved ffn_*_exps above, with ffn_*_exps.bias and
 *     ffn_gate_inp.bias. Its Hub checkpoints (quantization_config mxfp4)
 *     hold the experts as MXFP4 gate_up_proj_blocks [experts, 2 * ff,
 *     hidden / 32, 16] and _scales [experts, 2 * ff, hidden / 32] (NOT
 *     transposed: rows are outputs, gate and up interleaved by rows),
 *     down_proj_blocks / _scales [experts, hidden, ff / 32, ...]: each
 *     expert's rows become a QT_MXFP4 tensor (qt_from_mxfp4_hf), gate and
 *     up gathered from the even and odd rows.
 *
 * A 3-D tensor is read whole (borrowed from the mapping) and each expert's
 * slab becomes a tensor of its own (model_split_rows: a view where the
 * kind stores rows back to back), then finished as any linear: --quant
 * quantizes experts as it quantizes the other projections; the router stays
 * dense. It owns nothing: what it loads goes into the model's layers,
 * which eng_model_free releases (model_experts_free).
 */
#include "internal/model_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The most experts a layer may have, and chosen per token (the forward
 * pass sizes its per-row choices by it). */
#define MAX_EXPERTS      1024
#define MAX_EXPERTS_USED 64

/* --- config ------------------------------------------------------------------- */

void model_moe_set_dense(eng_config *c, int32_t l)
{
    c->dense_layers[l / 64] |= (uint64_t)1 << (l % 64);
}

int model_moe_check(const char *path, eng_config *c, char *msg, size_t msg_len)
{
    if (c->n_experts < 1 || c->n_experts > MAX_EXPERTS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: %d experts; qlserve runs mixtures of 1 to %d", path, c->n_experts,
                       MAX_EXPERTS);
    if (c->n_experts_used < 1 || c->n_experts_used > c->n_experts ||
        c->n_experts_used > MAX_EXPERTS_USED)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %d experts per token of %d; it must be 1 to min(experts, %d)", path,
                       c->n_experts_used, c->n_experts, MAX_EXPERTS_USED);
    if (c->expert_ff < 1)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: the experts' intermediate size is %d", path,
                       c->expert_ff);
    if (c->n_layers > ENG_MAX_MOE_LAYERS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: %d layers; qlserve runs mixtures of at most %d", path, c->n_layers,
                       ENG_MAX_MOE_LAYERS);
    bool gpt_oss = c->arch == ENG_ARCH_GPT_OSS;
    c->router = gpt_oss ? ENG_ROUTER_TOPK_SOFTMAX : ENG_ROUTER_SOFTMAX_TOPK;
    c->router_bias = gpt_oss;
    return QL_OK;
}

/* Qwen's dense layers: mlp_only_layers (a list of layer numbers) and
 * decoder_sparse_step (layer l is a mixture when (l + 1) % step == 0). */
static int hf_dense_layers(const char *path, const cJSON *j, eng_config *c, char *msg,
                           size_t msg_len)
{
    int32_t step = 1;
    int rc =
        model_json_int32(path, j, "decoder_sparse_step", 1, false, 1, 1 << 20, &step, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    for (int32_t l = 0; l < c->n_layers; l++)
        if ((l + 1) % step != 0)
            model_moe_set_dense(c, l);
    const cJSON *only = cJSON_GetObjectItemCaseSensitive(j, "mlp_only_layers");
    if (!only || cJSON_IsNull(only))
        return QL_OK;
    if (!cJSON_IsArray(only))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"mlp_only_layers\" is not a list", path);
    const cJSON *e;
    cJSON_ArrayForEach (e, only) {
        double v;
        if (!mf_json_number(e, &v) || v < 0 || v >= c->n_layers || v != (double)(int32_t)v)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: mlp_only_layers holds %s, not a layer number below %d", path,
                           cJSON_IsNumber(e) ? "a number out of range" : "something else",
                           c->n_layers);
        model_moe_set_dense(c, (int32_t)v);
    }
    return QL_OK;
}

int model_moe_config_hf(const char *path, const cJSON *j, eng_config *c, char *msg, size_t msg_len)
{
    /* Mixtral and GPT-OSS: every layer a mixture of intermediate_size
     * experts, the chosen weights summing to 1 */
    bool mixtral = c->arch == ENG_ARCH_MIXTRAL || c->arch == ENG_ARCH_GPT_OSS;
    /* Qwen's configs say num_experts, and transformers 5 saves them as
     * num_local_experts (Mixtral's name) */
    const char *count_key = !mixtral && cJSON_GetObjectItemCaseSensitive(j, "num_experts")
                                ? "num_experts"
                                : "num_local_experts";
    int rc =
        model_json_int32(path, j, count_key, 0, true, 1, MAX_EXPERTS, &c->n_experts, msg, msg_len);
    if (rc == QL_OK)
        rc = model_json_int32(path, j, "num_experts_per_tok", 2, false, 1, MAX_EXPERTS_USED,
                              &c->n_experts_used, msg, msg_len);
    if (rc == QL_OK && mixtral)
        c->expert_ff = c->intermediate_size;
    else if (rc == QL_OK)
        rc = model_json_int32(path, j, "moe_intermediate_size", 0, true, 1, 1 << 22, &c->expert_ff,
                              msg, msg_len);
    if (rc == QL_OK && c->arch == ENG_ARCH_QWEN2_MOE)
        rc = model_json_int32(path, j, "shared_expert_intermediate_size", 0, true, 1, 1 << 22,
                              &c->shared_expert_ff, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    /* Mixtral always renormalizes the chosen probabilities; Qwen's
     * configs say (transformers' default: false) */
    c->norm_topk_prob = mixtral || mf_json_bool(j, "norm_topk_prob", false);
    if (!mixtral && (rc = hf_dense_layers(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    return model_moe_check(path, c, msg, msg_len);
}

/* --- tensors ------------------------------------------------------------------- */

/* How one checkpoint names a layer's mixture: the router, each expert's
 * gate / up / down ("%d" the expert), the shared expert's and its gate
 * (NULL: none in this form). */
typedef struct moe_names {
    const char *router;
    const char *expert[3];
    const char *shared[3], *shared_gate;
} moe_names;

static const moe_names qwen_names = {
    "mlp.gate.weight",
    {"mlp.experts.%d.gate_proj.weight", "mlp.experts.%d.up_proj.weight",
     "mlp.experts.%d.down_proj.weight"},
    {"mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
     "mlp.shared_expert.down_proj.weight"},
    "mlp.shared_expert_gate.weight",
};

static const moe_names mixtral_names = {
    "block_sparse_moe.gate.weight",
    {"block_sparse_moe.experts.%d.w1.weight", "block_sparse_moe.experts.%d.w3.weight",
     "block_sparse_moe.experts.%d.w2.weight"},
    {NULL, NULL, NULL},
    NULL,
};

static const moe_names gpt_oss_names = {
    "mlp.router.weight",
    {NULL, NULL, NULL},
    {NULL, NULL, NULL},
    NULL,
};

/* Gemma 4's MoE block: router.proj, experts fused under experts. (not mlp.) */
static const moe_names gemma4_names = {
    "router.proj.weight",
    {NULL, NULL, NULL},
    {NULL, NULL, NULL},
    NULL,
};

static const moe_names gguf_names = {
    "ffn_gate_inp.weight",
    {NULL, NULL, NULL},
    {"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"},
    "ffn_gate_inp_shexp.weight",
};

/* Expert e's part k (0 gate, 1 up, 2 down) in layer l. */
static qtensor *expert_part(eng_model *m, int32_t l, int32_t e, int k)
{
    return &m->layers[l].experts[3 * e + k];
}

/* A layer tensor's full name: blk.N.x (GGUF) or model.layers.N.x. */
static void full_name(char *out, size_t n, bool gguf, int32_t l, const char *part)
{
    if (gguf)
        snprintf(out, n, "blk.%d.%s", l, part);
    else
        snprintf(out, n, "model.layers.%d.%s", l, part);
}

/* Every expert's part k from one 3-D tensor `name` whose experts are runs
 * of `rows` rows of `cols`. */
static int load_stacked(model_loader *L, model_tensor_loader load, const char *name, int32_t l,
                        int k, int64_t rows, int64_t cols, int64_t stride, int64_t first, char *msg,
                        size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    qtensor all = {0};
    int rc = load(L, name, stride * c->n_experts, cols, ROLE_FUSED, &all, msg, msg_len);
    for (int32_t e = 0; e < c->n_experts && rc == QL_OK; e++)
        rc = model_split_rows(L, name, &all, e * stride + first, rows, expert_part(L->m, l, e, k),
                              msg, msg_len);
    qt_free(&all);
    return rc;
}

/* Layer l's experts from 3-D tensors: a GGUF's ffn_{gate,up,down}_exps, or
 * transformers 5's fused gate_up_proj and down_proj. */
static int load_fused_experts(model_loader *L, model_tensor_loader load, bool gguf, int32_t l,
                              char *msg, size_t msg_len)
{
    /* Gemma 4's are the layer's experts.*, not mlp.experts.* */
    const char *gu = L->m->cfg.g4.moe_block ? "experts.gate_up_proj" : "mlp.experts.gate_up_proj";
    const char *down = L->m->cfg.g4.moe_block ? "experts.down_proj" : "mlp.experts.down_proj";
    const eng_config *c = &L->m->cfg;
    int64_t H = c->hidden_size, F = c->expert_ff;
    char name[256];
    int rc;
    if (gguf) {
        static const char *parts[3] = {"ffn_gate_exps.weight", "ffn_up_exps.weight",
                                       "ffn_down_exps.weight"};
        rc = QL_OK;
        for (int k = 0; k < 3 && rc == QL_OK; k++) {
            full_name(name, sizeof name, true, l, parts[k]);
            rc = k < 2 ? load_stacked(L, load, name, l, k, F, H, F, 0, msg, msg_len)
                       : load_stacked(L, load, name, l, k, H, F, H, 0, msg, msg_len);
        }
        return rc;
    }
    full_name(name, sizeof name, false, l, gu);
    rc = load_stacked(L, load, name, l, 0, F, H, 2 * F, 0, msg, msg_len);
    if (rc == QL_OK)
        rc = load_stacked(L, load, name, l, 1, F, H, 2 * F, F, msg, msg_len);
    full_name(name, sizeof name, false, l, down);
    if (rc == QL_OK)
        rc = load_stacked(L, load, name, l, 2, H, F, H, 0, msg, msg_len);
    return rc;
}

/* GPT-OSS's folder: every expert's gate, up and down copied out of the
 * transposed gate_up_proj (gate the even columns, up the odd) and
 * down_proj. */
static int load_transposed_experts(model_loader *L, model_tensor_loader load, int32_t l, char *msg,
                                   size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    int64_t H = c->hidden_size, F = c->expert_ff;
    char name[256];
    qtensor all = {0};
    full_name(name, sizeof name, false, l, "mlp.experts.gate_up_proj");
    int rc = load(L, name, c->n_experts * H, 2 * F, ROLE_FUSED, &all, msg, msg_len);
    if (rc == QL_ENOTFOUND)
        return ql_fail(msg, msg_len, rc,
                       "%s: tensor '%s' is missing (MXFP4 *_blocks and *_scales are read when "
                       "config.json's quantization_config says mxfp4)",
                       L->dir, name);
    for (int32_t e = 0; e < c->n_experts && rc == QL_OK; e++)
        for (int k = 0; k < 2 && rc == QL_OK; k++)
            rc = model_split_transposed(L, name, &all, e, H, k, 2, F, expert_part(L->m, l, e, k),
                                        msg, msg_len);
    qt_free(&all);
    full_name(name, sizeof name, false, l, "mlp.experts.down_proj");
    if (rc == QL_OK)
        rc = load(L, name, c->n_experts * F, H, ROLE_FUSED, &all, msg, msg_len);
    for (int32_t e = 0; e < c->n_experts && rc == QL_OK; e++)
        rc = model_split_transposed(L, name, &all, e, F, 0, 1, H, expert_part(L->m, l, e, 2), msg,
                                    msg_len);
    qt_free(&all);
    return rc;
}

/* A uint8 tensor of the folder's shards, [shape[0], ..., shape[ndim - 1]],
 * borrowed from the mapping. */
static int hf_bytes(const model_loader *L, const char *name, int ndim, const int64_t *shape,
                    const uint8_t **out, char *msg, size_t msg_len)
{
    const st_tensor *t = NULL;
    for (size_t i = 0; i < L->m->n_shards && !t; i++)
        t = st_find(&L->m->shards[i], name);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor '%s' is missing", L->dir, name);
    bool same = t->dtype == ST_U8 && t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++)
        same = t->shape[d] == shape[d];
    if (!same)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' is %s of %d dims; GPT-OSS's MXFP4 experts are uint8 [%lld, "
                       "%lld, %lld%s]",
                       L->dir, name, st_dtype_name(t->dtype), t->ndim, (long long)shape[0],
                       (long long)shape[1], (long long)shape[2], ndim == 4 ? ", 16" : "");
    *out = t->data;
    return QL_OK;
}

/* Expert e's rows first, first + step, ... (n of them) of an MXFP4 pair
 * [experts, rows, cols / 32, 16] / [experts, rows, cols / 32] as a QT_MXFP4
 * tensor [n, cols], finished as a linear. */
static int mxfp4_rows(const model_loader *L, const char *name, const uint8_t *blocks,
                      const uint8_t *scales, int64_t e, int64_t rows, int64_t cols, int64_t first,
                      int64_t step, int64_t n, qtensor *out, char *msg, size_t msg_len)
{
    size_t rb = (size_t)cols / 2, rs = (size_t)cols / 32;
    uint8_t *b = malloc((size_t)n * rb), *s = malloc((size_t)n * rs);
    int rc = b && s ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", name);
    for (int64_t i = 0; i < n && rc == QL_OK; i++) {
        size_t r = (size_t)(e * rows + first + step * i);
        memcpy(b + (size_t)i * rb, blocks + r * rb, rb);
        memcpy(s + (size_t)i * rs, scales + r * rs, rs);
    }
    if (rc == QL_OK)
        rc = qt_from_mxfp4_hf(out, b, s, n, cols, msg, msg_len);
    free(b);
    free(s);
    return rc == QL_OK ? model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len) : rc;
}

/* GPT-OSS's Hub form: every expert's gate (even rows of gate_up_proj), up
 * (odd rows) and down from the MXFP4 _blocks / _scales pairs. */
static int load_mxfp4_experts(model_loader *L, int32_t l, char *msg, size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    int64_t E = c->n_experts, H = c->hidden_size, F = c->expert_ff;
    if (H % 32 || F % 32)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: hidden %lld and expert width %lld must be multiples of MXFP4's block "
                       "of 32",
                       L->dir, (long long)H, (long long)F);
    int rc = QL_OK;
    for (int k = 0; k < 2 && rc == QL_OK; k++) {
        int64_t rows = k == 0 ? 2 * F : H, cols = k == 0 ? H : F;
        const int64_t shape[4] = {E, rows, cols / 32, 16};
        char name[256], bname[300], sname[300];
        full_name(name, sizeof name, false, l,
                  k == 0 ? "mlp.experts.gate_up_proj" : "mlp.experts.down_proj");
        snprintf(bname, sizeof bname, "%s_blocks", name);
        snprintf(sname, sizeof sname, "%s_scales", name);
        const uint8_t *blocks = NULL, *scales = NULL;
        rc = hf_bytes(L, bname, 4, shape, &blocks, msg, msg_len);
        if (rc == QL_OK)
            rc = hf_bytes(L, sname, 3, shape, &scales, msg, msg_len);
        for (int64_t e = 0; e < E && rc == QL_OK; e++) {
            if (k == 0) {
                rc = mxfp4_rows(L, bname, blocks, scales, e, rows, cols, 0, 2, F,
                                expert_part(L->m, l, (int32_t)e, 0), msg, msg_len);
                if (rc == QL_OK)
                    rc = mxfp4_rows(L, bname, blocks, scales, e, rows, cols, 1, 2, F,
                                    expert_part(L->m, l, (int32_t)e, 1), msg, msg_len);
            } else {
                rc = mxfp4_rows(L, bname, blocks, scales, e, rows, cols, 0, 1, H,
                                expert_part(L->m, l, (int32_t)e, 2), msg, msg_len);
            }
        }
    }
    return rc;
}

/* A folder's gate_up_proj_bias [experts, 2 * ff], gate and up interleaved,
 * as two f32 [experts, ff] biases (then --dtype as any dense parameter). */
static int split_gate_up_bias(model_loader *L, const char *name, const qtensor *gu, qtensor *gate,
                              qtensor *up, char *msg, size_t msg_len)
{
    int64_t E = gu->rows, F = gu->cols / 2;
    float *all = malloc((size_t)(E * 2 * F) * sizeof *all),
          *part = malloc((size_t)(E * F) * sizeof *part);
    int rc = all && part ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", name);
    if (rc == QL_OK)
        qt_dequantize_rows(gu, 0, E, all);
    for (int k = 0; k < 2 && rc == QL_OK; k++) {
        for (int64_t i = 0; i < E * F; i++)
            part[i] = all[2 * i + k];
        rc = qt_from_dense(k == 0 ? gate : up, QT_F32, part, E, F, msg, msg_len);
        if (rc == QL_OK)
            rc = model_finish_weight(L, name, ROLE_DENSE, k == 0 ? gate : up, msg, msg_len);
    }
    free(all);
    free(part);
    return rc;
}

/* GPT-OSS's biases: the router's, and each expert's gate, up and down (a
 * GGUF's ffn_gate_inp.bias and ffn_{gate,up,down}_exps.bias [experts, ff or
 * hidden]; a folder's mlp.router.bias, gate_up_proj_bias interleaved as
 * its weight, down_proj_bias). */
static int load_expert_biases(model_loader *L, model_tensor_loader load, bool gguf, int32_t l,
                              char *msg, size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    eng_layer *ly = &L->m->layers[l];
    int64_t E = c->n_experts, H = c->hidden_size, F = c->expert_ff;
    char name[256];
    full_name(name, sizeof name, gguf, l, gguf ? "ffn_gate_inp.bias" : "mlp.router.bias");
    int rc = load(L, name, E, 0, ROLE_DENSE, &ly->router_b, msg, msg_len);
    if (gguf) {
        static const char *parts[3] = {"ffn_gate_exps.bias", "ffn_up_exps.bias",
                                       "ffn_down_exps.bias"};
        for (int k = 0; k < 3 && rc == QL_OK; k++) {
            full_name(name, sizeof name, true, l, parts[k]);
            rc = load(L, name, E, k < 2 ? F : H, ROLE_DENSE, &ly->expert_b[k], msg, msg_len);
        }
        return rc;
    }
    qtensor gu = {0};
    full_name(name, sizeof name, false, l, "mlp.experts.gate_up_proj_bias");
    if (rc == QL_OK)
        rc = load(L, name, E, 2 * F, ROLE_DENSE, &gu, msg, msg_len);
    if (rc == QL_OK)
        rc = split_gate_up_bias(L, name, &gu, &ly->expert_b[0], &ly->expert_b[1], msg, msg_len);
    qt_free(&gu);
    full_name(name, sizeof name, false, l, "mlp.experts.down_proj_bias");
    if (rc == QL_OK)
        rc = load(L, name, E, H, ROLE_DENSE, &ly->expert_b[2], msg, msg_len);
    return rc;
}

/* Layer l's experts one weight each (names' expert patterns). */
static int load_each_expert(model_loader *L, model_tensor_loader load, const moe_names *names,
                            int32_t l, char *msg, size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    int64_t H = c->hidden_size, F = c->expert_ff;
    int rc = QL_OK;
    for (int32_t e = 0; e < c->n_experts && rc == QL_OK; e++)
        for (int k = 0; k < 3 && rc == QL_OK; k++) {
            char part[160], name[256];
            snprintf(part, sizeof part, names->expert[k], e);
            full_name(name, sizeof name, false, l, part);
            rc = load(L, name, k < 2 ? F : H, k < 2 ? H : F, ROLE_LINEAR,
                      expert_part(L->m, l, e, k), msg, msg_len);
        }
    return rc;
}

/* Qwen2-MoE's shared expert into the layer's MLP fields, and its gate. */
static int load_shared(model_loader *L, model_tensor_loader load, bool gguf, const moe_names *names,
                       int32_t l, char *msg, size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    eng_layer *ly = &L->m->layers[l];
    int64_t H = c->hidden_size, F = c->shared_expert_ff;
    qtensor *dst[3] = {&ly->w_gate, &ly->w_up, &ly->w_down};
    char name[256];
    int rc = QL_OK;
    for (int k = 0; k < 3 && rc == QL_OK; k++) {
        full_name(name, sizeof name, gguf, l, names->shared[k]);
        rc = load(L, name, k < 2 ? F : H, k < 2 ? H : F, ROLE_LINEAR, dst[k], msg, msg_len);
    }
    full_name(name, sizeof name, gguf, l, names->shared_gate);
    /* [1, hidden]: a vector in a GGUF, a one-row matrix in a folder */
    if (rc == QL_OK)
        rc = load(L, name, gguf ? H : 1, gguf ? 0 : H, ROLE_DENSE, &ly->shared_gate, msg, msg_len);
    return rc;
}

int model_experts_load(model_loader *L, model_tensor_loader load, bool gguf, int32_t l, char *msg,
                       size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    eng_layer *ly = &L->m->layers[l];
    ly->experts = calloc(3 * (size_t)c->n_experts, sizeof *ly->experts);
    if (!ly->experts)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for %d experts", c->n_experts);
    const moe_names *names = gguf                          ? &gguf_names
                             : c->arch == ENG_ARCH_MIXTRAL ? &mixtral_names
                             : c->arch == ENG_ARCH_GPT_OSS ? &gpt_oss_names
                             : c->g4.moe_block             ? &gemma4_names
                                                           : &qwen_names;
    char name[256];
    full_name(name, sizeof name, gguf, l, names->router);
    int rc = load(L, name, c->n_experts, c->hidden_size, ROLE_DENSE, &ly->router, msg, msg_len);
    if (rc == QL_ENOTFOUND && names == &mixtral_names) {
        /* a Mixtral saved under transformers 5's names */
        names = &qwen_names;
        full_name(name, sizeof name, false, l, names->router);
        rc = load(L, name, c->n_experts, c->hidden_size, ROLE_DENSE, &ly->router, msg, msg_len);
    }
    if (rc == QL_OK && c->router_bias)
        rc = load_expert_biases(L, load, gguf, l, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (names == &gpt_oss_names)
        return L->mxfp4_experts ? load_mxfp4_experts(L, l, msg, msg_len)
                                : load_transposed_experts(L, load, l, msg, msg_len);
    if (names == &gemma4_names)
        return load_fused_experts(L, load, false, l, msg, msg_len);
    if (gguf) {
        rc = load_fused_experts(L, load, true, l, msg, msg_len);
        return rc == QL_OK && c->shared_expert_ff > 0
                   ? load_shared(L, load, true, names, l, msg, msg_len)
                   : rc;
    }
    /* one weight per expert, as checkpoints hold them; else fused */
    rc = load_each_expert(L, load, names, l, msg, msg_len);
    if (rc == QL_ENOTFOUND && !expert_part(L->m, l, 0, 0)->rows) {
        rc = load_fused_experts(L, load, false, l, msg, msg_len);
        if (rc == QL_ENOTFOUND && (L->gptq_checkpoint || L->ct))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: layer %d: fused 3-D experts in a %s checkpoint are not supported "
                           "(one weight per expert, mlp.experts.N.gate_proj, is)",
                           L->dir, l,
                           L->awq               ? "awq"
                           : L->gptq_checkpoint ? "gptq"
                                                : model_ct_format(L));
    }
    if (rc == QL_OK && c->shared_expert_ff > 0)
        rc = load_shared(L, load, false, names, l, msg, msg_len);
    return rc;
}

void model_experts_each(const eng_model *m, int32_t l, void (*fn)(const qtensor *t, void *ctx),
                        void *ctx)
{
    const eng_layer *ly = &m->layers[l];
    if (ly->router.rows)
        fn(&ly->router, ctx);
    for (int32_t i = 0; ly->experts && i < 3 * m->cfg.n_experts; i++)
        if (ly->experts[i].rows)
            fn(&ly->experts[i], ctx);
    if (ly->shared_gate.rows)
        fn(&ly->shared_gate, ctx);
    if (ly->router_b.rows)
        fn(&ly->router_b, ctx);
    for (int k = 0; k < 3; k++)
        if (ly->expert_b[k].rows)
            fn(&ly->expert_b[k], ctx);
    /* the shared expert is the layer's MLP fields, walked with them */
    if (eng_layer_is_moe(&m->cfg, l) && !m->cfg.g4.moe_block && ly->w_gate.rows)
        for (int k = 0; k < 3; k++)
            fn(k == 0 ? &ly->w_gate : k == 1 ? &ly->w_up : &ly->w_down, ctx);
}

void model_experts_free(eng_model *m, int32_t l)
{
    eng_layer *ly = &m->layers[l];
    qt_free(&ly->router);
    qt_free(&ly->shared_gate);
    qt_free(&ly->router_b);
    for (int k = 0; k < 3; k++)
        qt_free(&ly->expert_b[k]);
    for (int32_t i = 0; ly->experts && i < 3 * m->cfg.n_experts; i++)
        qt_free(&ly->experts[i]);
    free(ly->experts);
    ly->experts = NULL;
}

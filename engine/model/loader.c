/*
 * loader.c - what the Hugging Face and the GGUF loaders do alike: read
 * --quant and --dtype once, and give each weight they load its last step
 * (quantize on load, or the dense dtype asked for); the shape-mismatch
 * message; the name a loaded model goes by.
 *
 * Quantizing on load replaces a dense (or GGUF-block) weight by a new
 * qtensor, and never touches one that is already NF4/FP4/AFFINE: whatever
 * --quant says, a quantized checkpoint is read as it is. It owns nothing
 * past the call; it touches the loader's model and kernels' quantizers.
 */
#include "internal/model_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --quant's words, one row each, and what each quantizes to (torchao's
 * int4/int8 weight-only defaults for the affine ones); a 0 blocksize or
 * group size takes the option's value, else the row's default. */
static const struct quant_word {
    const char *word;
    qt_quant_params p;
    int32_t default_block; /* blocksize (NF4/FP4) or group size (affine) when the option gives 0 */
} quant_words[] = {
    {"nf4", {.kind = QT_NF4}, 64},
    {"nf4-dq", {.kind = QT_NF4, .double_quant = true}, 64},
    {"fp4", {.kind = QT_FP4}, 64},
    {"int4", {.kind = QT_AFFINE, .bits = 4, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f}, 128},
    {"int8", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, 0}, /* 0: per channel */
};

/* Read --quant (a row of quant_words, or "none") and --dtype once. */
int model_parse_opts(model_loader *L, char *msg, size_t msg_len)
{
    const eng_load_opts *o = L->o;
    const char *q = o->quant ? o->quant : "none";
    memset(&L->qp, 0, sizeof L->qp);
    L->quantize = strcmp(q, "none") != 0;
    const struct quant_word *w = NULL;
    for (size_t i = 0; L->quantize && !w && i < sizeof quant_words / sizeof *quant_words; i++)
        if (strcmp(q, quant_words[i].word) == 0)
            w = &quant_words[i];
    if (L->quantize && !w)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--quant %s: one of none, nf4, nf4-dq, fp4, int4, int8", q);
    if (w) {
        L->qp = w->p;
        int32_t given = w->p.kind == QT_AFFINE ? o->group_size : o->blocksize;
        int32_t size = given ? given : w->default_block;
        if (w->p.kind == QT_AFFINE)
            L->qp.group_size = size;
        else
            L->qp.blocksize = size;
    }
    L->dtype = QT_KIND_COUNT;
    if (o->dtype) {
        int k = qt_kind_from_name(o->dtype);
        if (k != QT_F32 && k != QT_F16 && k != QT_BF16)
            return ql_fail(msg, msg_len, QL_EINVAL, "--dtype %s: one of f32, bf16, f16", o->dtype);
        L->dtype = (qt_kind)k;
    }
    return QL_OK;
}

/* Replace a dense or GGUF-block weight by its quantization as L->qp; a
 * weight already NF4/FP4/AFFINE, or a checkpoint's FP8 (a fused expert's
 * part), is kept as it is. */
static int quantize_weight(const model_loader *L, const char *name, qtensor *t, char *msg,
                           size_t msg_len)
{
    if (t->kind == QT_NF4 || t->kind == QT_FP4 || t->kind == QT_AFFINE || t->kind == QT_FP8)
        return QL_OK;
    size_t n = (size_t)(t->rows * t->cols);
    float *w = malloc(n * sizeof *w);
    if (!w)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    qt_dequantize_rows(t, 0, t->rows, w);
    qtensor q;
    char why[256];
    int rc = qt_quantize(&q, w, t->rows, t->cols, &L->qp, why, sizeof why);
    free(w);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s': cannot quantize to %s: %s",
                       L->o->path, name, L->o->quant, why);
    qt_free(t);
    *t = q;
    return QL_OK;
}

/* Give a dense tensor the dtype asked for with --dtype. Quantized tensors
 * are left alone: their quant state is the quantizer's. */
static int apply_dtype(const model_loader *L, const char *name, qtensor *t, char *msg,
                       size_t msg_len)
{
    if (L->dtype == QT_KIND_COUNT || !qt_traits_table[t->kind].is_dense || t->rows == 0)
        return QL_OK;
    char why[256];
    if (qt_cast_dense(t, L->dtype, why, sizeof why) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': %s", name, why);
    return QL_OK;
}

int model_finish_weight(const model_loader *L, const char *name, tensor_role role, qtensor *t,
                        char *msg, size_t msg_len)
{
    if (role == ROLE_FUSED)
        return QL_OK; /* its parts are finished once split (layers.c) */
    bool quantize =
        L->quantize && (role == ROLE_LINEAR || (role == ROLE_LM_HEAD && L->o->quantize_lm_head));
    int rc = quantize ? quantize_weight(L, name, t, msg, msg_len)
                      : apply_dtype(L, name, t, msg, msg_len);
    if (rc != QL_OK)
        qt_free(t);
    return rc;
}

int model_shape_mismatch(const char *file, const char *name, int64_t rows, int64_t cols,
                         int64_t want_rows, int64_t want_cols, char *msg, size_t msg_len)
{
    return ql_fail(msg, msg_len, QL_EFORMAT,
                   "%s: tensor '%s' is [%" PRId64 ", %" PRId64 "]; the config needs [%" PRId64
                   ", %" PRId64 "]",
                   file, name, rows, cols, want_rows, want_cols);
}

void model_set_name(eng_model *m, const char *own, size_t own_len, const char *path)
{
    if (own && own_len) {
        snprintf(m->name, sizeof m->name, "%.*s", (int)(own_len < 255 ? own_len : 255), own);
        return;
    }
    mf_path_base(path, m->name, sizeof m->name);
}

int model_json_int32(const char *path, const cJSON *j, const char *key, int64_t def, bool required,
                     int64_t lo, int64_t hi, int32_t *out, char *msg, size_t msg_len)
{
    int64_t v;
    int rc = mf_json_int_field(path, j, key, def, required, lo, hi, &v, msg, msg_len);
    if (rc == QL_OK)
        *out = (int32_t)v;
    return rc;
}

const st_tensor *model_find_st(const model_loader *L, const char *name, const st_file **file)
{
    for (size_t i = 0; i < L->m->n_shards; i++) {
        const st_tensor *t = st_find(&L->m->shards[i], name);
        if (t) {
            *file = &L->m->shards[i];
            return t;
        }
    }
    return NULL;
}

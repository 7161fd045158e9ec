/*
 * qtensor.c - the leaf of kernels/: what every kind uses and nothing
 * kind-specific. It offers a qtensor's lifecycle (qt_wrap_copy, qt_clone,
 * qt_free, qt_nbytes), the kinds' names and geometry (qt_kind_name,
 * qt_kind_from_name, from qt_kind_geometry_table, which holds no function
 * pointers), the shape check every constructor makes, and the public
 * f16/bf16 conversions.
 *
 * It owns the geometry table and nothing mutable; it calls no other file
 * of kernels/ (every other file may call down into it), and touches only
 * base/ and kernels/math/qt_math.h.
 */
#include "kernels_internal.h"
#include "qt_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const qt_kind_geometry qt_kind_geometry_table[QT_KIND_COUNT] = {
    [QT_F32] = {QT_GEOMETRY_F32},       [QT_F16] = {QT_GEOMETRY_F16},
    [QT_BF16] = {QT_GEOMETRY_BF16},     [QT_NF4] = {QT_GEOMETRY_NF4},
    [QT_FP4] = {QT_GEOMETRY_FP4},       [QT_AFFINE] = {QT_GEOMETRY_AFFINE},
    [QT_Q4_0] = {QT_GEOMETRY_Q4_0},     [QT_Q4_1] = {QT_GEOMETRY_Q4_1},
    [QT_Q8_0] = {QT_GEOMETRY_Q8_0},     [QT_Q5_0] = {QT_GEOMETRY_Q5_0},
    [QT_Q5_1] = {QT_GEOMETRY_Q5_1},     [QT_Q4_K] = {QT_GEOMETRY_Q4_K},
    [QT_Q5_K] = {QT_GEOMETRY_Q5_K},     [QT_Q6_K] = {QT_GEOMETRY_Q6_K},
    [QT_Q2_K] = {QT_GEOMETRY_Q2_K},     [QT_Q3_K] = {QT_GEOMETRY_Q3_K},
    [QT_IQ4_NL] = {QT_GEOMETRY_IQ4_NL}, [QT_IQ4_XS] = {QT_GEOMETRY_IQ4_XS},
    [QT_MXFP4] = {QT_GEOMETRY_MXFP4},   [QT_FP8] = {QT_GEOMETRY_FP8},
    [QT_GPTQ] = {QT_GEOMETRY_GPTQ},     [QT_AWQ] = {QT_GEOMETRY_AWQ},
    [QT_CT_INT] = {QT_GEOMETRY_CT_INT},
};

const char *qt_scale_dtype_name(qt_scale_dtype d)
{
    return d == QT_SCALE_E8M0   ? "e8m0"
           : d == QT_SCALE_BF16 ? "bf16"
           : d == QT_SCALE_F16  ? "f16"
                                : "f32";
}

size_t qt_scale_dtype_size(qt_scale_dtype d)
{
    return d == QT_SCALE_E8M0 ? 1 : d == QT_SCALE_BF16 || d == QT_SCALE_F16 ? 2 : sizeof(float);
}

float qt_scale_at(const void *scales, qt_scale_dtype d, int64_t i)
{
    const uint8_t *p = (const uint8_t *)scales;
    if (d == QT_SCALE_E8M0)
        return qm_e8m0_to_f32(p[i]);
    if (d == QT_SCALE_BF16 || d == QT_SCALE_F16) {
        uint16_t h;
        memcpy(&h, p + i * 2, sizeof h);
        return d == QT_SCALE_BF16 ? qt_bf16_to_f32(h) : qt_f16_to_f32(h);
    }
    float f;
    memcpy(&f, p + i * 4, sizeof f);
    return f;
}

float qt_scale_put(void *scales, qt_scale_dtype d, int64_t i, float v)
{
    uint8_t *p = (uint8_t *)scales;
    if (d == QT_SCALE_BF16 || d == QT_SCALE_F16) {
        uint16_t h = d == QT_SCALE_BF16 ? qt_f32_to_bf16(v) : qt_f32_to_f16(v);
        memcpy(p + i * 2, &h, sizeof h);
    } else { /* f32 (an E8M0 scale is chosen by its quantizer as a byte) */
        memcpy(p + i * 4, &v, sizeof v);
    }
    return qt_scale_at(scales, d, i);
}

int qt_check_block_scales(const char *kind, int64_t rows, int64_t cols, int32_t block_rows,
                          int32_t block_cols, int64_t scale_rows, int64_t scale_cols,
                          const void *scales, qt_scale_dtype d, char *msg, size_t msg_len)
{
    int rc = qt_check_shape(rows, cols, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if ((unsigned)d > QT_SCALE_F16)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s scale dtype %d is not f32, e8m0, bf16 or f16",
                       kind, (int)d);
    if (block_rows < 1 || block_cols < 1)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s block %d x %d is not positive", kind,
                       block_rows, block_cols);
    int64_t want_r = (rows + block_rows - 1) / block_rows;
    int64_t want_c = (cols + block_cols - 1) / block_cols;
    if (scale_rows != want_r || scale_cols != want_c)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s scale grid [%lld, %lld] does not fit a [%lld, %lld] weight in blocks "
                       "of %d x %d (want [%lld, %lld])",
                       kind, (long long)scale_rows, (long long)scale_cols, (long long)rows,
                       (long long)cols, block_rows, block_cols, (long long)want_r,
                       (long long)want_c);
    for (int64_t i = 0; i < want_r * want_c; i++) {
        float v = qt_scale_at(scales, d, i);
        if (!(v > 0.0f) || !isfinite(v))
            return ql_fail(msg, msg_len, QL_ENONFINITE,
                           "%s block scale %lld (block row %lld, col %lld) is not a finite "
                           "positive number",
                           kind, (long long)i, (long long)(i / want_c), (long long)(i % want_c));
    }
    return QL_OK;
}

int qt_wrap_codes(qtensor *out, qt_kind kind, int64_t rows, int64_t cols, const void *codes,
                  size_t bytes, bool borrow, char *msg, size_t msg_len)
{
    if (!borrow)
        return qt_wrap_copy(out, kind, rows, cols, codes, bytes, msg, msg_len);
    out->data = (uint8_t *)(uintptr_t)codes;
    out->data_borrowed = true;
    out->data_bytes = bytes;
    out->kind = kind;
    out->rows = rows;
    out->cols = cols;
    return QL_OK;
}

void qt_round_to_scale_dtype(float *v, int64_t n, qt_scale_dtype d)
{
    /* kernels/math's inline forms: the public ones' bits, without a call each */
    if (d == QT_SCALE_BF16)
        for (int64_t i = 0; i < n; i++)
            v[i] = qm_bf16_to_f32(qm_f32_to_bf16(v[i]));
    else if (d == QT_SCALE_F16)
        for (int64_t i = 0; i < n; i++)
            v[i] = qm_f16_to_f32(qm_f32_to_f16(v[i]));
}

/* Bytes of an FP8 tensor's block scales (0 for any other kind). */
static size_t block_scale_bytes(const qtensor *t)
{
    return t->block_scales
               ? (size_t)(t->scale_rows * t->scale_cols) * qt_scale_dtype_size(t->scale_dtype)
               : 0;
}

/* Bytes of a GPTQ or AWQ tensor's zeros, scales and g_idx (0 for any other kind). */
static size_t gptq_state_bytes(const qtensor *t)
{
    if ((t->kind != QT_GPTQ && t->kind != QT_AWQ) || !t->gptq_scales)
        return 0;
    return (size_t)(t->gptq_groups * t->rows) * ((size_t)t->bits / 8 + 2) + (size_t)t->cols * 4;
}

int qt_kind_from_name(const char *name)
{
    if (!name)
        return -1;
    for (int k = 0; k < QT_KIND_COUNT; k++)
        if (strcmp(qt_kind_geometry_table[k].name, name) == 0)
            return k;
    return -1;
}

const char *qt_kind_name(qt_kind kind)
{
    if ((unsigned)kind >= QT_KIND_COUNT)
        return "unknown";
    return qt_kind_geometry_table[kind].name;
}

float qt_f16_to_f32(uint16_t h)
{
    return qm_f16_to_f32(h);
}
uint16_t qt_f32_to_f16(float f)
{
    return qm_f32_to_f16(f);
}
float qt_bf16_to_f32(uint16_t b)
{
    return qm_bf16_to_f32(b);
}
uint16_t qt_f32_to_bf16(float f)
{
    return qm_f32_to_bf16(f);
}

void qt_nan_rows(const qtensor *t, int64_t batch, float *y, int64_t row0, int64_t row1)
{
    for (int64_t b = 0; b < batch; b++)
        for (int64_t r = row0; r < row1; r++)
            y[b * t->rows + r] = NAN;
}

int qt_check_shape(int64_t rows, int64_t cols, char *msg, size_t msg_len)
{
    if (rows <= 0 || cols <= 0 || rows > INT64_MAX / cols)
        return ql_fail(msg, msg_len, QL_EINVAL, "shape [%lld, %lld] is not valid", (long long)rows,
                       (long long)cols);
    return QL_OK;
}

int qt_wrap_copy(qtensor *out, qt_kind kind, int64_t rows, int64_t cols, const void *src,
                 size_t bytes, char *msg, size_t msg_len)
{
    out->data = malloc(bytes ? bytes : 1);
    if (!out->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes", bytes);
    memcpy(out->data, src, bytes);
    out->kind = kind;
    out->rows = rows;
    out->cols = cols;
    out->data_bytes = bytes;
    return QL_OK;
}

void qt_free(qtensor *t)
{
    if (!t)
        return;
    if (!t->data_borrowed)
        free(t->data);
    free(t->absmax);
    free(t->absmax_codes);
    free(t->nested_absmax);
    free(t->scales);
    free(t->zeros);
    free(t->block_scales);
    free(t->gptq_qzeros);
    free(t->gptq_scales);
    free(t->gptq_g_idx);
    free(t->block_zeros);
    memset(t, 0, sizeof *t);
}

static int dup_array(void **dst, const void *src, size_t bytes)
{
    *dst = NULL;
    if (!src)
        return QL_OK;
    *dst = malloc(bytes ? bytes : 1);
    if (!*dst)
        return QL_ENOMEM;
    memcpy(*dst, src, bytes);
    return QL_OK;
}

int qt_clone(qtensor *out, const qtensor *src)
{
    *out = *src;
    out->data = NULL;
    out->data_borrowed = false;
    out->absmax = NULL;
    out->absmax_codes = NULL;
    out->nested_absmax = NULL;
    out->scales = NULL;
    out->zeros = NULL;
    out->block_scales = NULL;
    out->gptq_qzeros = NULL;
    out->gptq_scales = NULL;
    out->gptq_g_idx = NULL;
    out->block_zeros = NULL;
    size_t nq = (size_t)(src->rows * src->groups_per_row) * sizeof(float);
    int rc = dup_array((void **)&out->data, src->data, src->data_bytes);
    if (rc == QL_OK)
        rc = dup_array((void **)&out->absmax, src->absmax, (size_t)src->n_blocks * sizeof(float));
    if (rc == QL_OK)
        rc = dup_array((void **)&out->absmax_codes, src->absmax_codes, (size_t)src->n_blocks);
    if (rc == QL_OK)
        rc = dup_array((void **)&out->nested_absmax, src->nested_absmax,
                       (size_t)src->n_nested_blocks * sizeof(float));
    if (rc == QL_OK)
        rc = dup_array((void **)&out->scales, src->scales, nq);
    if (rc == QL_OK)
        rc = dup_array((void **)&out->zeros, src->zeros, nq);
    if (rc == QL_OK)
        rc = dup_array(&out->block_scales, src->block_scales, block_scale_bytes(src));
    size_t gz = (size_t)(src->gptq_groups * src->rows * src->bits / 8);
    if (rc == QL_OK && src->gptq_qzeros)
        rc = dup_array((void **)&out->gptq_qzeros, src->gptq_qzeros, gz);
    if (rc == QL_OK && src->gptq_scales)
        rc = dup_array((void **)&out->gptq_scales, src->gptq_scales,
                       (size_t)(src->gptq_groups * src->rows) * 2);
    if (rc == QL_OK && src->gptq_g_idx)
        rc = dup_array((void **)&out->gptq_g_idx, src->gptq_g_idx, (size_t)src->cols * 4);
    if (rc == QL_OK && src->block_zeros)
        rc = dup_array((void **)&out->block_zeros, src->block_zeros,
                       (size_t)(src->scale_rows * src->scale_cols));
    if (rc != QL_OK)
        qt_free(out);
    return rc;
}

size_t qt_nbytes(const qtensor *t)
{
    size_t n = t->data_bytes;
    if (t->absmax)
        n += (size_t)t->n_blocks * sizeof(float);
    if (t->absmax_codes)
        n += (size_t)t->n_blocks + (size_t)t->n_nested_blocks * sizeof(float);
    if (t->scales)
        n += 2 * (size_t)(t->rows * t->groups_per_row) * sizeof(float);
    if (t->block_zeros)
        n += (size_t)(t->scale_rows * t->scale_cols);
    return n + block_scale_bytes(t) + gptq_state_bytes(t);
}

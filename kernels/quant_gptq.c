/*
 * quant_gptq.c - GPTQ (quant_method "gptq", the layout optimum, auto-gptq
 * and gptqmodel write): integer codes of `bits` (4 or 8) packed
 * 32 / bits to a little-endian int32 word along the INPUT dim (qweight
 * [in * bits / 32, out], code k of a word in bits [k * bits, (k + 1) *
 * bits)), zero points packed the same way along the OUTPUT dim (qzeros
 * [groups, out * bits / 32]), f16 scales [groups, out], and g_idx, the
 * group of each input channel (act-order permutes it; without act-order
 * it is c / group_size).
 *
 *   dequantize:  w[r][c] = f32(scales[g][r]) * (q[c][r] - z[g][r]),  g = g_idx[c]
 *   z = stored zero + 1 (the v1 convention, auto-gptq's `zeros + 1`), or
 *   the stored zero itself (checkpoint_format "gptq_v2")
 * computed in f32: the product of an f16 scale and an integer of at most
 * 9 bits is exact there (torch kernels that multiply in f16 round it once
 * more; the f32 value is the one both round from).
 *
 * AWQ (quant_method "awq", version GEMM, AutoAWQ's layout) is the same
 * arithmetic on another packing: qweight [in, out * bits / 32] and qzeros
 * [groups, out * bits / 32] packed along the OUTPUT dim, the code of
 * output column 8j + m in nibble AWQ_NIBBLE[m] of word j (AutoAWQ packs in
 * the order 0 2 4 6 1 3 5 7), the zero stored as it is, group c /
 * group_size.
 *
 * It offers the GPTQ and AWQ rows' scalar dequantization, scalar product
 * (one fused multiply-add chain per output, the order the AVX2 and
 * AVX-512 entries repeat) and quantizer (which only requantizes into a
 * loaded tensor's layout, for merges), qt_gptq_row_groups (a row's group
 * scales and zeros, for the SIMD entries) and qt_from_gptq (a
 * checkpoint's parts, qweight read in place). It owns no state; it calls
 * qtensor.c.
 */
#include "kernels_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The most groups a tensor may have (qt_from_gptq refuses more): a row's
 * scales and zeros are widened into stack arrays of this size. Real
 * checkpoints have in / group_size, a few hundred at most. */
#define GPTQ_MAX_GROUPS 4096

/* word i of a packed array stored at any alignment */
static uint32_t word_at(const uint8_t *p, int64_t i)
{
    uint32_t w;
    memcpy(&w, p + (size_t)i * 4, sizeof w);
    return w;
}

/* The nibble of an AWQ word holding output column 8j + m
 * (AutoAWQ's reverse order of its packing order 0 2 4 6 1 3 5 7). */
static const int AWQ_NIBBLE[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* The shift of row r's code in its word along the output dim (qzeros;
 * AWQ's qweight too): GPTQ packs in order, AWQ in its own. */
static int out_dim_shift(const qtensor *t, int64_t r)
{
    return t->kind == QT_AWQ ? AWQ_NIBBLE[r % 8] * 4 : (int)(r % (32 / t->bits)) * t->bits;
}

void qt_gptq_row_groups(const qtensor *t, int64_t r, float *s, int32_t *z, int64_t stride)
{
    const int64_t zcols = (t->rows * t->bits + 31) / 32, zword = r / (32 / t->bits);
    const int zshift = out_dim_shift(t, r);
    const uint32_t mask = (1u << t->bits) - 1u;
    for (int64_t g = 0; g < t->gptq_groups; g++) {
        s[g * stride] = qt_f16_to_f32(t->gptq_scales[g * t->rows + r]);
        z[g * stride] =
            (int32_t)((t->gptq_qzeros[g * zcols + zword] >> zshift) & mask) + t->gptq_zero_offset;
    }
}

void qt_gptq_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    const int32_t bits = t->bits, per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    float s[GPTQ_MAX_GROUPS]; /* 32 KB of stack at the most */
    int32_t z[GPTQ_MAX_GROUPS];
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t r = row0 + i;
        qt_gptq_row_groups(t, r, s, z, 1);
        float *o = out + i * t->cols;
        for (int64_t w0 = 0; w0 < t->cols / per; w0++) {
            uint32_t w = word_at(t->data, w0 * t->rows + r);
            for (int k = 0; k < per; k++, w >>= bits) {
                const int64_t c = w0 * per + k, g = t->gptq_g_idx[c];
                o[c] = s[g] * (float)((int32_t)(w & mask) - z[g]);
            }
        }
    }
}

void qt_awq_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    const int64_t words = t->rows / 8;
    float s[GPTQ_MAX_GROUPS]; /* 32 KB of stack at the most */
    int32_t z[GPTQ_MAX_GROUPS];
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t r = row0 + i;
        const int shift = AWQ_NIBBLE[r % 8] * 4;
        qt_gptq_row_groups(t, r, s, z, 1);
        float *o = out + i * t->cols;
        for (int64_t c = 0; c < t->cols; c++) {
            const int64_t g = t->gptq_g_idx[c];
            const int32_t q = (int32_t)((word_at(t->data, c * words + r / 8) >> shift) & 15u);
            o[c] = s[g] * (float)(q - z[g]);
        }
    }
}

/* The product's scalar reference, one order of operations the SIMD entries
 * (internal/matmul_gptq.inc) repeat lane by lane: each output y[b][r] is
 * one chain of fused multiply-adds over the columns in order, acc =
 * fma(x[b][c], w[r][c], acc) from acc = 0, with w the row's scalar
 * dequantization (exact in f32, see the top). A sum over the columns
 * split into lanes would need the lanes' order in scalar code too; one
 * chain per output lets a vector carry eight (or sixteen) outputs' chains
 * at once, so every path gives these bits, and a row of x gets them
 * whatever the batch around it. */
static void matmul_chains(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1,
                          void (*dequantize)(const qtensor *, int64_t, int64_t, float *))
{
    float *w = malloc((size_t)t->cols * sizeof *w);
    if (!w) {
        qt_nan_rows(t, batch, y, row0, row1);
        return;
    }
    for (int64_t r = row0; r < row1; r++) {
        dequantize(t, r, 1, w);
        for (int64_t b = 0; b < batch; b++) {
            const float *xb = x + b * t->cols;
            float acc = 0.0f;
            for (int64_t c = 0; c < t->cols; c++)
                acc = fmaf(xb[c], w[c], acc);
            y[b * t->rows + r] = acc;
        }
    }
    free(w);
}

void qt_gptq_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1)
{
    matmul_chains(t, x, batch, y, row0, row1, qt_gptq_dequantize_rows);
}

void qt_awq_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                       int64_t row1)
{
    matmul_chains(t, x, batch, y, row0, row1, qt_awq_dequantize_rows);
}

/* Row r of src into t's codes, scales and zeros (t's arrays zeroed, its
 * layout set): per group (the channels g_idx puts in it), asymmetric
 * round to nearest as GPTQ's and AWQ's quantizers fit a group: the range
 * [min(w, 0), max(w, 0)], scale range / maxq rounded to f16 (at least
 * 1e-5), zero round(-min / scale) clamped to [offset, maxq] (v1 stores
 * zero - 1, so it is at least 1), code round(w / scale) + zero in [0, maxq]. */
static void requantize_row(qtensor *t, const float *src, int64_t r)
{
    const int32_t bits = t->bits, per = 32 / bits, maxq = (1 << bits) - 1;
    const int64_t zcols = (t->rows * bits + 31) / 32;
    float lo[GPTQ_MAX_GROUPS], hi[GPTQ_MAX_GROUPS], s[GPTQ_MAX_GROUPS];
    int32_t z[GPTQ_MAX_GROUPS];
    for (int64_t g = 0; g < t->gptq_groups; g++)
        lo[g] = hi[g] = 0.0f;
    for (int64_t c = 0; c < t->cols; c++) {
        int32_t g = t->gptq_g_idx[c];
        lo[g] = src[c] < lo[g] ? src[c] : lo[g];
        hi[g] = src[c] > hi[g] ? src[c] : hi[g];
    }
    const int zs = out_dim_shift(t, r);
    for (int64_t g = 0; g < t->gptq_groups; g++) {
        float sc = (hi[g] - lo[g]) / (float)maxq;
        uint16_t h = qt_f32_to_f16(sc > 1e-5f ? sc : 1e-5f);
        s[g] = qt_f16_to_f32(h);
        float zf = rintf(-lo[g] / s[g]);
        z[g] = zf < (float)t->gptq_zero_offset ? t->gptq_zero_offset
               : zf > (float)maxq              ? maxq
                                               : (int32_t)zf;
        t->gptq_scales[g * t->rows + r] = h;
        t->gptq_qzeros[g * zcols + r / per] |= (uint32_t)(z[g] - t->gptq_zero_offset) << zs;
    }
    uint32_t *words = (uint32_t *)(void *)t->data;
    for (int64_t c = 0; c < t->cols; c++) {
        int32_t g = t->gptq_g_idx[c];
        float q = rintf(src[c] / s[g]) + (float)z[g];
        uint32_t code = q < 0.0f ? 0u : q > (float)maxq ? (uint32_t)maxq : (uint32_t)q;
        if (t->kind == QT_AWQ)
            words[c * (t->rows / 8) + r / 8] |= code << zs;
        else
            words[(c / per) * t->rows + r] |= code << ((int)(c % per) * bits);
    }
}

int qt_gptq_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len)
{
    const qtensor *L = p->layout;
    if (!L || L->kind != t->kind || L->rows != rows || L->cols != cols)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s is read from checkpoints; qlserve quantizes to it only into the "
                       "layout of a loaded [%lld, %lld] %s tensor (a merge)",
                       qt_kind_name(t->kind), (long long)rows, (long long)cols,
                       qt_kind_name(t->kind));
    size_t nbytes = (size_t)(rows * cols * L->bits / 8);
    size_t zbytes = (size_t)(L->gptq_groups * rows * L->bits / 8);
    t->data = calloc(1, nbytes);
    t->data_bytes = nbytes;
    t->gptq_qzeros = calloc(1, zbytes);
    t->gptq_scales = calloc((size_t)(L->gptq_groups * rows), 2);
    t->gptq_g_idx = malloc((size_t)cols * 4);
    if (!t->data || !t->gptq_qzeros || !t->gptq_scales || !t->gptq_g_idx)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes of %s codes", nbytes,
                       qt_kind_name(t->kind));
    memcpy(t->gptq_g_idx, L->gptq_g_idx, (size_t)cols * 4);
    t->bits = L->bits;
    t->group_size = L->group_size;
    t->gptq_groups = L->gptq_groups;
    t->gptq_zero_offset = L->gptq_zero_offset;
    for (int64_t r = 0; r < rows; r++)
        requantize_row(t, src + r * cols, r);
    return QL_OK;
}

/* Check the parts' shapes and the g_idx values; QL_OK or msg says which. */
static int check_gptq_parts(const qt_gptq_parts *p, char *msg, size_t msg_len)
{
    int rc = qt_check_shape(p->rows, p->cols, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (p->bits != 4 && (p->bits != 8 || p->awq))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "gptq bits %d is not supported (4 and 8 are)",
                       p->bits);
    int per = 32 / p->bits;
    if (p->cols % per != 0 || p->rows % per != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "gptq weight [%lld, %lld] does not pack %d codes to a word on both dims",
                       (long long)p->rows, (long long)p->cols, per);
    if (p->group_size != -1 && p->group_size < 1)
        return ql_fail(msg, msg_len, QL_EINVAL, "gptq group_size %d is not positive or -1",
                       p->group_size);
    int64_t want = p->group_size == -1 ? 1 : (p->cols + p->group_size - 1) / p->group_size;
    if (p->groups != want && (p->g_idx == NULL || p->groups < 1))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "gptq has %lld groups; a [%lld, %lld] weight in groups of %d has %lld",
                       (long long)p->groups, (long long)p->rows, (long long)p->cols, p->group_size,
                       (long long)want);
    if (p->groups > GPTQ_MAX_GROUPS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s has %lld groups; at most %d are supported", p->awq ? "awq" : "gptq",
                       (long long)p->groups, GPTQ_MAX_GROUPS);
    for (int64_t c = 0; p->g_idx && c < p->cols; c++) {
        int32_t g;
        memcpy(&g, p->g_idx + c * 4, sizeof g);
        if (g < 0 || g >= p->groups)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "gptq g_idx[%lld] = %d is outside the %lld groups", (long long)c, g,
                           (long long)p->groups);
    }
    return QL_OK;
}

/* malloc n bytes and copy src (NULL src: leave for the caller to fill). */
static void *dup_bytes(const void *src, size_t n)
{
    void *d = malloc(n ? n : 1);
    if (d && src)
        memcpy(d, src, n);
    return d;
}

int qt_from_gptq(qtensor *out, const qt_gptq_parts *p, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    int rc = check_gptq_parts(p, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (p->awq && p->g_idx)
        return ql_fail(msg, msg_len, QL_EINVAL, "awq has no g_idx");
    size_t nbytes = (size_t)(p->rows * p->cols * p->bits / 8);
    qt_kind kind = p->awq ? QT_AWQ : QT_GPTQ;
    if (p->borrow_codes) {
        out->data = (uint8_t *)(uintptr_t)p->qweight;
        out->data_borrowed = true;
        out->data_bytes = nbytes;
        out->kind = kind;
        out->rows = p->rows;
        out->cols = p->cols;
    } else if ((rc = qt_wrap_copy(out, kind, p->rows, p->cols, p->qweight, nbytes, msg, msg_len)) !=
               QL_OK) {
        return rc;
    }
    size_t zbytes = (size_t)(p->groups * p->rows * p->bits / 8);
    out->gptq_qzeros = dup_bytes(p->qzeros, zbytes);
    out->gptq_scales = dup_bytes(p->scales, (size_t)(p->groups * p->rows) * 2);
    out->gptq_g_idx = dup_bytes(p->g_idx, (size_t)p->cols * 4);
    if (!out->gptq_qzeros || !out->gptq_scales || !out->gptq_g_idx) {
        qt_free(out);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate gptq quant state");
    }
    for (int64_t c = 0; !p->g_idx && c < p->cols; c++)
        out->gptq_g_idx[c] = p->group_size == -1 ? 0 : (int32_t)(c / p->group_size);
    out->bits = p->bits;
    out->group_size = p->group_size == -1 ? (int32_t)p->cols : p->group_size;
    out->gptq_groups = p->groups;
    out->gptq_zero_offset = p->v2 || p->awq ? 0 : 1;
    return QL_OK;
}

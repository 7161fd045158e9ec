/*
 * quant_fp8.c - FP8, transformers' finegrained FP8 (quant_method "fp8"):
 * one E4M3FN code per element and a `weight_scale_inv` per block of
 * block_rows x block_cols (weight_block_size), kept in the dtype the
 * checkpoint stored: f32 (scale_fmt "float") or one UE8M0 byte
 * (scale_fmt "ue8m0").
 *
 *   dequantize (Fp8Dequantize._dequantize_one):  w = f32(code) * f32(scale)
 *   quantize (Fp8Quantize._quantize_one), per block:
 *       amax = max |w|;  s = (1 / amax) * 448 (1 where amax is 0);  inv = 1 / s
 *       ue8m0: inv = 2^ceil(log2 inv) (a byte), s = 1 / inv
 *       code = e4m3(clamp(w * s, -448, 448)), rounded to nearest even
 * every step one f32 operation, in that order. The grid is ceil(rows /
 * block_rows) x ceil(cols / block_cols), as DeepSeek's checkpoints store a
 * shape the block does not divide; transformers' own quantizer only writes
 * whole blocks, which is the same grid then.
 *
 * A 16-bit scale (bf16 or f16: compressed-tensors' float-quantized
 * checkpoints store the model's dtype) rounds each product to that dtype,
 * as compressed-tensors' dequantize computes x_q.to(scale.dtype) * scale;
 * merges requantize such blocks by its rule (scale = amax / 448 in the
 * scale's dtype, code = e4m3(w / scale)).
 *
 * It offers the FP8 row's quantizer, scalar dequantization and scalar
 * product (its sums in the lane order of the SIMD entries; traits.c
 * points at them) and qt_from_fp8 (a checkpoint's parts, codes read in
 * place). It owns no state; it calls qtensor.c and touches kernels/math/
 * (qt_math.h: the per-element arithmetic the CUDA side can share).
 */
#include "kernels_internal.h"
#include "qt_math.h"
#include "qt_q8act_math.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define FP8_E4M3_MAX 448.0f /* torch.finfo(torch.float8_e4m3fn).max */

/* Every E4M3 byte's f32 value (qm_e4m3_to_f32), made once: a row then
 * reads its codes through the table, its block scales once per block. */
static float e4m3_table[256];
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;

static void e4m3_table_init(void)
{
    for (int b = 0; b < 256; b++)
        e4m3_table[b] = qm_e4m3_to_f32((uint8_t)b);
}

const float *qt_fp8_e4m3_table(void)
{
    pthread_once(&e4m3_once, e4m3_table_init);
    return e4m3_table;
}

float qt_fp8_block_scale(const qtensor *t, int64_t s)
{
    return qt_scale_at(t->block_scales, t->scale_dtype, s);
}

/* n codes of one block times its scale through the table, the scalar way. */
static void dequantize_block(const float *table, const uint8_t *codes, float scale, int64_t n,
                             float *out)
{
    for (int64_t c = 0; c < n; c++)
        out[c] = table[codes[c]] * scale;
}

void qt_fp8_dequantize_rows_with(const qtensor *t, int64_t row0, int64_t nrows, float *out,
                                 qt_fp8_block_decoder decode)
{
    const float *table = qt_fp8_e4m3_table();
    for (int64_t r = row0; r < row0 + nrows; r++) {
        const uint8_t *codes = t->data + r * t->cols;
        float *o = out + (r - row0) * t->cols;
        const int64_t srow = (r / t->block_rows) * t->scale_cols;
        for (int64_t c0 = 0, bc = 0; c0 < t->cols; c0 += t->block_cols, bc++) {
            const int64_t c1 = c0 + t->block_cols < t->cols ? c0 + t->block_cols : t->cols;
            decode(table, codes + c0, qt_fp8_block_scale(t, srow + bc), c1 - c0, o + c0);
        }
        qt_round_to_scale_dtype(o, t->cols, t->scale_dtype); /* 16-bit scales only */
    }
}

/* The same arithmetic as qm_fp8_element (the per-element form a device
 * thread uses; tests/test_fp8.c holds the two to the same bits): one f32
 * multiply of the code's value by its block's scale. */
void qt_fp8_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    qt_fp8_dequantize_rows_with(t, row0, nrows, out, dequantize_block);
}

/* sum_c w[c] * x[c] in the order the SIMD entries sum (matmul_fp8_avx2.c,
 * matmul_fp8_avx512.c), so that every path gives these bits: 32 lanes,
 * lane l a fused multiply-add chain over the columns c = l (mod 32) of the
 * whole runs of 32, the lanes of a last run of 8 onto lanes 0 .. 7; then
 * lane l of the eight as (l + (l + 8)) + ((l + 16) + (l + 24)), the eight
 * as qm_q8_lanes_sum (qt_hsum8's order), and the last columns added one
 * product at a time. */
static float dot_lanes(const float *w, const float *x, int64_t n)
{
    float a[32] = {0}, eight[8];
    int64_t c = 0;
    for (; c + 32 <= n; c += 32)
        for (int l = 0; l < 32; l++)
            a[l] = fmaf(w[c + l], x[c + l], a[l]);
    for (; c + 8 <= n; c += 8)
        for (int l = 0; l < 8; l++)
            a[l] = fmaf(w[c + l], x[c + l], a[l]);
    for (int l = 0; l < 8; l++)
        eight[l] = (a[l] + a[l + 8]) + (a[l + 16] + a[l + 24]);
    float sum = qm_q8_lanes_sum(eight);
    for (; c < n; c++)
        sum += w[c] * x[c];
    return sum;
}

void qt_lanes_matmul_with(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1, qt_rows_fn rows, qt_fp8_row_dots dots, int most)
{
    float *w = malloc((size_t)t->cols * sizeof *w);
    if (!w) {
        qt_nan_rows(t, batch, y, row0, row1);
        return;
    }
    for (int64_t r = row0; r < row1; r++) {
        rows(t, r, 1, w);
        for (int64_t b = 0; b < batch; b += most) {
            const int nb = batch - b < most ? (int)(batch - b) : most;
            float part[QT_FP8_MOST_ROWS];
            dots(w, x + b * t->cols, t->cols, nb, part);
            for (int i = 0; i < nb; i++)
                y[(b + i) * t->rows + r] = part[i];
        }
    }
    free(w);
}

void qt_lanes_dots_ref(const float *w, const float *x, int64_t cols, int nb, float *out)
{
    for (int b = 0; b < nb; b++)
        out[b] = dot_lanes(w, x + b * cols, cols);
}

void qt_fp8_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                       int64_t row1)
{
    qt_lanes_matmul_with(t, x, batch, y, row0, row1, qt_fp8_dequantize_rows, qt_lanes_dots_ref, 1);
}

/* |v| <= 448 and finite to an E4M3FN byte, round to nearest even, as
 * torch's float -> float8_e4m3fn (c10's fp8e4m3fn_from_fp32_value). */
static uint8_t e4m3_from_f32(float v)
{
    uint32_t bits = qm_f32_bits(v);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    float a = fabsf(v);
    if (a < 0.015625f) { /* below 2^-6: subnormal steps of 2^-9, exact scaling */
        float q = nearbyintf(a * 512.0f);
        return (uint8_t)(sign | (uint8_t)q); /* q == 8 is 2^-6, the first normal */
    }
    uint32_t ab = bits & 0x7FFFFFFFu;
    int32_t exp = (int32_t)(ab >> 23) - 127 + 7;
    uint32_t keep = (ab >> 20) & 0x7u, rem = ab & 0xFFFFFu;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u)))
        keep++;
    if (keep == 8u) {
        keep = 0;
        exp++;
    }
    return (uint8_t)(sign | (uint8_t)(exp << 3) | (uint8_t)keep);
}

/* 2^ceil(log2 x) for a positive normal or subnormal f32 x, exactly (torch
 * computes it through log2 in f32, exact at the powers of two where the
 * two could part). Returns the UE8M0 byte; *value its f32. */
static uint8_t e8m0_ceil(float x, float *value)
{
    uint32_t b = qm_f32_bits(x);
    int32_t e = (int32_t)(b >> 23);
    if (e == 0) { /* subnormal: clamped to FLT_MIN by transformers first */
        e = 1;
    } else if ((b & 0x7FFFFFu) != 0) {
        e++;
    }
    *value = qm_e8m0_to_f32((uint8_t)e);
    return (uint8_t)e;
}

/* The codes of rows [r0, r1) x cols [c0, c1) of src divided by the scale d
 * (compressed-tensors' quantize: w / d clamped to +-448, then E4M3). */
static void quantize_block_codes(qtensor *t, const float *src, int64_t r0, int64_t r1, int64_t c0,
                                 int64_t c1, float d)
{
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t c = c0; c < c1; c++) {
            float v = src[r * t->cols + c] / d;
            v = v < -FP8_E4M3_MAX ? -FP8_E4M3_MAX : v > FP8_E4M3_MAX ? FP8_E4M3_MAX : v;
            t->data[r * t->cols + c] = e4m3_from_f32(v);
        }
    }
}

/* Quantize block (br, bc) of src into t's codes and scale slot. */
static void quantize_block(qtensor *t, const float *src, int64_t br, int64_t bc)
{
    int64_t r0 = br * t->block_rows, c0 = bc * t->block_cols;
    int64_t r1 = r0 + t->block_rows < t->rows ? r0 + t->block_rows : t->rows;
    int64_t c1 = c0 + t->block_cols < t->cols ? c0 + t->block_cols : t->cols;
    float amax = 0.0f;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++)
            amax = fabsf(src[r * t->cols + c]) > amax ? fabsf(src[r * t->cols + c]) : amax;
    /* torch's `448.0 / max_abs` (a Python float over a tensor) is
     * Tensor.__rtruediv__: reciprocal, then a multiply, which differs from
     * one division by an ulp for some maxima (then so do the scale and the
     * codes) */
    float s = amax > 0.0f ? (1.0f / amax) * FP8_E4M3_MAX : 1.0f;
    float inv = 1.0f / s;
    int64_t slot = br * t->scale_cols + bc;
    if (t->scale_dtype == QT_SCALE_BF16 || t->scale_dtype == QT_SCALE_F16) {
        /* compressed-tensors' rule: amax / 448 in the scale's dtype (its
         * epsilon for an all-zero block), codes w / scale */
        float d = qt_scale_put(t->block_scales, t->scale_dtype, slot, amax / FP8_E4M3_MAX);
        if (d == 0.0f)
            d = qt_scale_put(t->block_scales, t->scale_dtype, slot,
                             t->scale_dtype == QT_SCALE_BF16 ? 0.0078125f : 0.0009765625f);
        quantize_block_codes(t, src, r0, r1, c0, c1, d);
        return;
    }
    if (t->scale_dtype == QT_SCALE_E8M0) {
        float p2;
        ((uint8_t *)t->block_scales)[slot] = e8m0_ceil(inv, &p2);
        s = 1.0f / p2;
    } else {
        ((float *)t->block_scales)[slot] = inv;
    }
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t c = c0; c < c1; c++) {
            float v = src[r * t->cols + c] * s;
            v = v < -FP8_E4M3_MAX ? -FP8_E4M3_MAX : v > FP8_E4M3_MAX ? FP8_E4M3_MAX : v;
            t->data[r * t->cols + c] = e4m3_from_f32(v);
        }
    }
}

int qt_fp8_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                    const qt_quant_params *p, char *msg, size_t msg_len)
{
    t->block_rows = p->block_rows ? p->block_rows : 128;
    t->block_cols = p->block_cols ? p->block_cols : 128;
    if (t->block_rows < 1 || t->block_cols < 1)
        return ql_fail(msg, msg_len, QL_EINVAL, "fp8 block %d x %d is not positive", t->block_rows,
                       t->block_cols);
    if ((unsigned)p->scale_dtype > QT_SCALE_F16)
        return ql_fail(msg, msg_len, QL_EINVAL, "fp8 scale dtype %d is not f32, e8m0, bf16 or f16",
                       (int)p->scale_dtype);
    t->scale_dtype = p->scale_dtype;
    t->scale_rows = (rows + t->block_rows - 1) / t->block_rows;
    t->scale_cols = (cols + t->block_cols - 1) / t->block_cols;
    t->row_stride = (size_t)cols;
    t->data_bytes = (size_t)(rows * cols);
    t->data = malloc(t->data_bytes);
    t->block_scales =
        malloc((size_t)(t->scale_rows * t->scale_cols) * qt_scale_dtype_size(t->scale_dtype));
    if (!t->data || !t->block_scales)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes of fp8 codes",
                       t->data_bytes);
    for (int64_t br = 0; br < t->scale_rows; br++)
        for (int64_t bc = 0; bc < t->scale_cols; bc++)
            quantize_block(t, src, br, bc);
    return QL_OK;
}

int qt_from_fp8(qtensor *out, const qt_fp8_parts *p, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    int rc =
        qt_check_block_scales("fp8", p->rows, p->cols, p->block_rows, p->block_cols, p->scale_rows,
                              p->scale_cols, p->scales, p->scale_dtype, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int64_t want_r = p->scale_rows, want_c = p->scale_cols;
    size_t nbytes = (size_t)(p->rows * p->cols);
    size_t sbytes = (size_t)(want_r * want_c) * qt_scale_dtype_size(p->scale_dtype);
    rc = qt_wrap_codes(out, QT_FP8, p->rows, p->cols, p->codes, nbytes, p->borrow_codes, msg,
                       msg_len);
    if (rc != QL_OK)
        return rc;
    out->block_scales = malloc(sbytes);
    if (!out->block_scales) {
        qt_free(out);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes of fp8 scales", sbytes);
    }
    memcpy(out->block_scales, p->scales, sbytes);
    out->row_stride = (size_t)p->cols;
    out->block_rows = p->block_rows;
    out->block_cols = p->block_cols;
    out->scale_rows = want_r;
    out->scale_cols = want_c;
    out->scale_dtype = p->scale_dtype;
    return QL_OK;
}

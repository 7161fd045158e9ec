/*
 * attend_ref.c - qt_attend_ref, the scalar attention inner loop over one
 * run of a paged cache, and qt_kv_store_ref/qt_kv_load_ref, the scalar
 * conversions of the cache's rows (f32, f16, q8_0): the arithmetic every
 * fast path (qt_attend_avx2, qt_kv_*_avx2) is tested against, and what the
 * entry points take on a CPU without AVX2 or for a shape the fast path does
 * not cover.
 *
 * It owns no state and calls no other file of kernels/; it touches only
 * kernels/math/ (the running softmax, om_online, shared with the forward
 * pass and CUDA; the f16 conversions and the Q8_0 block quantizer that the
 * GGUF weights use too).
 */
#include "kernels_internal.h"
#include "ops_math.h"
#include "qt_math.h"
#include "qt_quant_math.h"

#include <string.h>

size_t qt_kv_row_bytes(qt_kind kind, int64_t n)
{
    if (n <= 0)
        return 0;
    switch (kind) {
    case QT_F32: return (size_t)n * sizeof(float);
    case QT_F16: return (size_t)n * sizeof(uint16_t);
    case QT_Q8_0: return n % QM_GGUF_QK == 0 ? (size_t)(n / QM_GGUF_QK) * QM_Q8_0_BYTES : 0;
    default: return 0;
    }
}

void qt_kv_store_ref(qt_kind kind, const float *x, int64_t n, void *row)
{
    if (kind == QT_F32) {
        memcpy(row, x, (size_t)n * sizeof(float));
    } else if (kind == QT_F16) {
        uint16_t *h = row;
        for (int64_t i = 0; i < n; i++)
            h[i] = qm_f32_to_f16(x[i]);
    } else if (kind == QT_Q8_0) {
        /* llama.cpp's quantize_row_q8_0_ref, block by block */
        uint8_t *blk = row;
        for (int64_t b = 0; b < n / QM_GGUF_QK; b++, blk += QM_Q8_0_BYTES) {
            uint16_t d;
            qq_q8_0_block(x + b * QM_GGUF_QK, &d, blk + 2);
            blk[0] = (uint8_t)(d & 0xff);
            blk[1] = (uint8_t)(d >> 8);
        }
    }
}

void qt_kv_load_ref(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out)
{
    if (kind == QT_F32) {
        memcpy(out, (const float *)row + e0, (size_t)n * sizeof(float));
    } else if (kind == QT_F16) {
        const uint16_t *h = (const uint16_t *)row + e0;
        for (int64_t i = 0; i < n; i++)
            out[i] = qm_f16_to_f32(h[i]);
    } else if (kind == QT_Q8_0) {
        const uint8_t *base = row;
        for (int64_t i = 0; i < n; i++) {
            int64_t e = e0 + i;
            out[i] =
                qm_q8_0_block_value(base + (e / QM_GGUF_QK) * QM_Q8_0_BYTES, (int)(e % QM_GGUF_QK));
        }
    }
}

void qt_kv_load_rows_ref(qt_kind kind, const void *rows, size_t row_bytes, int64_t n_rows,
                         int64_t e0, int64_t n, float *out)
{
    for (int64_t r = 0; r < n_rows; r++)
        qt_kv_load_ref(kind, (const uint8_t *)rows + (size_t)r * row_bytes, e0, n, out + r * n);
}

void qt_attend_ref(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                   int32_t d, float scale, float *max, float *sum, float *acc)
{
    om_online sm = {*max, *sum};
    for (int32_t i = 0; i < n; i++, k += stride, v += stride) {
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        int32_t t = 0;
        for (; t + 4 <= d; t += 4) {
            a0 += q[t] * k[t];
            a1 += q[t + 1] * k[t + 1];
            a2 += q[t + 2] * k[t + 2];
            a3 += q[t + 3] * k[t + 3];
        }
        for (; t < d; t++)
            a0 += q[t] * k[t];
        float score = ((a0 + a1) + (a2 + a3)) * scale, f;
        if (om_online_raise(&sm, score, &f)) /* rescale what was summed under the old max */
            for (int32_t u = 0; u < d; u++)
                acc[u] *= f;
        float w = om_online_weight(&sm, score);
        for (int32_t u = 0; u < d; u++)
            acc[u] = om_online_acc(acc[u], w, v[u]);
    }
    *max = sm.max;
    *sum = sm.sum;
}

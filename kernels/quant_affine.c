/*
 * quant_affine.c - AFFINE, the integer grid of torchao's
 * AffineQuantizedTensor: per group of `group_size` elements along a row, a
 * scale and a zero point.
 *
 *   integer zero domain:  q = clamp(round(w * (1 / scale)) + zero, qmin, qmax)
 *                         w = (q - zero) * scale
 *   float zero domain:    q = clamp(round((w - (zero - scale * mid)) / scale), qmin, qmax)
 *                         w = (q - mid) * scale + zero,  mid = (qmin + qmax + 1) / 2
 *
 * with torchao's choice of parameters (quant_primitives._choose_qparams_affine):
 *   symmetric:   scale = max(-min(w, 0), max(w, 0)) / ((qmax - qmin) / 2),
 *                zero = (qmax + qmin + 1) / 2 (0 for the signed ranges used here)
 *   asymmetric, integer zero (preserve_zero): scale = (max(w, 0) - min(w, 0)) /
 *                (qmax - qmin), zero = clamp(qmin - round(min(w, 0) / scale))
 *   asymmetric, float zero (int4 weight-only, "tinygemm"): scale =
 *                (max w - min w) / (qmax - qmin), zero = min w + scale * mid
 * every scale clamped below at eps. Rounding is half to even, as torch.round.
 * Symmetric uses the signed range [-2^(b-1), 2^(b-1) - 1], asymmetric the
 * unsigned range [0, 2^b - 1], unless the caller names another range.
 *
 * Storage is ours: codes stored unsigned (q - qmin), one byte each for 8
 * bits, two per byte for 4 bits (even element in the high nibble, each row
 * starting on a byte); scales and zeros as f32 per (row, group).
 *
 * It offers the AFFINE row's quantizer and scalar dequantization (the
 * traits table in traits.c points at them). It owns no state; it calls no
 * other file of kernels/ and touches kernels/math/ (qt_math.h,
 * qt_quant_math.h).
 */
#include "kernels_internal.h"
#include "qt_math.h"
#include "qt_quant_math.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

/* Choose scale and zero for one group, as torchao does (the arithmetic is
 * qt_quant_math.h's, shared with the CUDA merge). */
static void choose_qparams(const float *w, int64_t n, const qtensor *t, bool symmetric, float eps,
                           float *scale, float *zero)
{
    float mn = w[0], mx = w[0];
    for (int64_t i = 1; i < n; i++) {
        mn = qq_minf(mn, w[i]);
        mx = qq_maxf(mx, w[i]);
    }
    qq_affine_qparams(mn, mx, t->qmin, t->qmax, symmetric, t->zero_domain == QT_ZERO_FLOAT, eps,
                      scale, zero);
}

static inline void put_code(const qtensor *t, int64_t r, int64_t c, unsigned u)
{
    uint8_t *row = t->data + r * t->row_stride;
    if (t->bits == 8)
        row[c] = (uint8_t)u;
    else if (c & 1)
        row[c >> 1] |= (uint8_t)u;
    else
        row[c >> 1] |= (uint8_t)(u << 4);
}

int qt_affine_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len)
{
    if (p->bits != 4 && p->bits != 8)
        return ql_fail(msg, msg_len, QL_EINVAL, "affine bits %d: only 4 and 8", p->bits);
    int64_t gs = p->group_size ? p->group_size : cols;
    if (gs <= 0 || cols % gs != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "affine group size %lld does not divide the %lld columns", (long long)gs,
                       (long long)cols);
    t->bits = p->bits;
    t->group_size = (int32_t)gs;
    t->groups_per_row = cols / gs;
    t->zero_domain = p->symmetric ? QT_ZERO_INT : p->zero_domain;
    t->qmin = p->symmetric ? -(1 << (p->bits - 1)) : 0;
    t->qmax = p->symmetric ? (1 << (p->bits - 1)) - 1 : (1 << p->bits) - 1;
    if (p->qmin || p->qmax) {
        if (p->qmin >= p->qmax || p->qmax - p->qmin > (1 << p->bits) - 1)
            return ql_fail(msg, msg_len, QL_EINVAL, "affine range [%d, %d] does not fit %d bits",
                           p->qmin, p->qmax, p->bits);
        t->qmin = p->qmin;
        t->qmax = p->qmax;
    }
    t->row_stride = p->bits == 8 ? (size_t)cols : (size_t)(cols + 1) / 2;
    t->data_bytes = t->row_stride * (size_t)rows;
    size_t ng = (size_t)(rows * t->groups_per_row);
    t->data = calloc(t->data_bytes, 1);
    t->scales = malloc(ng * sizeof(float));
    t->zeros = malloc(ng * sizeof(float));
    if (!t->data || !t->scales || !t->zeros)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes of codes",
                       t->data_bytes);
    float eps = p->eps > 0.0f ? p->eps : FLT_EPSILON;
    float mid = qm_affine_mid(t->qmin, t->qmax);
    bool float_zero = t->zero_domain == QT_ZERO_FLOAT;

    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < t->groups_per_row; g++) {
            const float *w = src + r * cols + g * gs;
            float scale, zero;
            choose_qparams(w, gs, t, p->symmetric, eps, &scale, &zero);
            t->scales[r * t->groups_per_row + g] = scale;
            t->zeros[r * t->groups_per_row + g] = zero;
            qq_affine_group grp = qq_affine_group_of(scale, zero, mid);
            for (int64_t i = 0; i < gs; i++) {
                put_code(t, r, g * gs + i,
                         qq_affine_code(w[i], &grp, t->qmin, t->qmax, float_zero));
            }
        }
    }
    return QL_OK;
}

/* The arithmetic is qt_math.h's (qm_affine_*), the same the CUDA kernel runs. */
void qt_affine_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    float mid = qm_affine_mid(t->qmin, t->qmax);
    bool float_zero = t->zero_domain == QT_ZERO_FLOAT;
    for (int64_t r = row0; r < row0 + nrows; r++) {
        const uint8_t *row = t->data + r * t->row_stride;
        float *o = out + (r - row0) * t->cols;
        for (int64_t c = 0; c < t->cols; c++) {
            int64_t g = r * t->groups_per_row + c / t->group_size;
            o[c] = qm_affine_value(qm_affine_code(row, t->bits, c), t->qmin, float_zero, mid,
                                   t->scales[g], t->zeros[g]);
        }
    }
}

/*
 * qt_q8act_math.h - the arithmetic of the 8-bit activation path (qlserve
 * serve --activations q8): a row of activations quantized per block (256
 * for the k-quants, 32 for the kinds of blocks of 32) to int8 with one f32
 * scale, and the integer dot products of the weights against it, as
 * llama.cpp computes them (its q8_K and q8_0 activations and
 * ggml_vec_dot_q4_K_q8_K, _q6_K_q8_K, _q4_0_q8_0 ...), in our own order.
 *
 * One block of 256 activations x (32 for the kinds of blocks of 32: Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) becomes
 *   d = amax / 127, q[i] = nearest(x[i] * (127 / amax)) in [-127, 127]
 *   (ties to even, the FPU's mode), and bsum[k] = the sum of q over
 *   elements 16k .. 16k + 15;
 * an all-zero block has d = 0 and q = 0; a block holding a NaN or an
 * infinity has d = NaN (so the products it enters are NaN, as the f32 path
 * would make them) and q = 0.
 *
 * The dot of one weight block against it is exact integer arithmetic in
 * eight lanes, then one fused multiply-add per lane per block (below), so
 * every path that computes the same integers in the same lanes (the scalar
 * entries in quant_q8act.c, the AVX2 and VNNI ones of matmul_q8.inc) gives
 * the same bits. Header-only; the CPU's files use
 * it (the CUDA backend keeps f32 activations).
 */
#ifndef QL_QT_Q8ACT_MATH_H
#define QL_QT_Q8ACT_MATH_H

#include <math.h>
#include <stdint.h>

#include "qt_math.h"

#define QM_Q8_BLOCK    256 /* activations per scale for the k-quants */
#define QM_Q8_BLOCK_32 32  /* for the kinds of blocks of 32 */

/* Quantize n (256 or 32) activations x into q (int8), its n / 16 sums
 * bsum, the scale *d and *dsum = d times the sum of q (the minimum's
 * factor in Q4_1 and Q5_1 products). */
static inline void qm_q8_quantize_block(const float *x, int n, int8_t *q, int16_t *bsum, float *d,
                                        float *dsum)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
        if (a != a)
            amax = a;
    }
    if (!(amax <= 3.4028235e38f) || amax == 0.0f) { /* NaN, infinity, or all zero */
        for (int i = 0; i < n; i++)
            q[i] = 0;
        for (int k = 0; k < n / 16; k++)
            bsum[k] = 0;
        *d = amax == 0.0f ? 0.0f : NAN;
        *dsum = *d * 0.0f;
        return;
    }
    float id = 127.0f / amax;
    *d = amax / 127.0f;
    for (int k = 0; k < n / 16; k++) {
        int s = 0;
        for (int i = 16 * k; i < 16 * k + 16; i++) {
            long v = lrintf(x[i] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[i] = (int8_t)v;
            s += (int)v;
        }
        bsum[k] = (int16_t)s;
    }
    int total = 0;
    for (int k = 0; k < n / 16; k++)
        total += bsum[k];
    *dsum = *d * (float)total;
}

/* The eight 6-bit scales and minimums of a Q4_K/Q5_K block from its 12
 * packed bytes (qm_k4_scale_min's, four at a time in 32-bit words). */
static inline void qm_q8_k4_scales(const uint8_t *packed, uint8_t sc[8], uint8_t mn[8])
{
    uint32_t u0 = (uint32_t)packed[0] | (uint32_t)packed[1] << 8 | (uint32_t)packed[2] << 16 |
                  (uint32_t)packed[3] << 24;
    uint32_t u1 = (uint32_t)packed[4] | (uint32_t)packed[5] << 8 | (uint32_t)packed[6] << 16 |
                  (uint32_t)packed[7] << 24;
    uint32_t u2 = (uint32_t)packed[8] | (uint32_t)packed[9] << 8 | (uint32_t)packed[10] << 16 |
                  (uint32_t)packed[11] << 24;
    uint32_t s_lo = u0 & 0x3f3f3f3fu, m_lo = u1 & 0x3f3f3f3fu;
    uint32_t s_hi = (u2 & 0x0f0f0f0fu) | ((u0 >> 6) & 0x03030303u) << 4;
    uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 6) & 0x03030303u) << 4;
    for (int j = 0; j < 4; j++) {
        sc[j] = (uint8_t)(s_lo >> 8 * j);
        mn[j] = (uint8_t)(m_lo >> 8 * j);
        sc[j + 4] = (uint8_t)(s_hi >> 8 * j);
        mn[j + 4] = (uint8_t)(m_hi >> 8 * j);
    }
}

/*
 * A row's sum across blocks is kept in eight f32 lanes, as the vector code
 * keeps it. Per block of 256, lane n gets an int32 that the vector code
 * makes in lane n of its registers:
 *   Q4_K, Q5_K  isum[n] = sum over the 8 sub-blocks j of sc[j] times the
 *               codes times q over elements 32 j + 4n .. 32 j + 4n + 3;
 *               msum[n] = mn[n] * (bsum[2n] + bsum[2n + 1]);
 *               lanes[n] += dx * (d * isum[n] - dmin * msum[n])
 *               (qm_q8_k4_lanes);
 *   Q6_K        v[n] = sum over the halves h and groups g (0..3) of
 *               sc[8h + 2g + n / 4] times (unsigned code) times q over
 *               elements 128 h + 32 g + 4n .. + 3, minus 32 * (sc[2n] *
 *               bsum[2n] + sc[2n + 1] * bsum[2n + 1]);
 *               lanes[n] += (dx * d) * v[n];
 * each += a fused multiply-add (fmaf; the vector code's vfmadd / vfnmadd),
 * and the row's result qm_q8_lanes_sum(lanes).
 */
static inline void qm_q8_lanes_fma(float lanes[8], float a, const int32_t v[8])
{
    for (int n = 0; n < 8; n++)
        lanes[n] = fmaf(a, (float)v[n], lanes[n]);
}

/* Q4_K, Q5_K: lanes[n] = fma(dx, fma(-dmin, msum[n], d * isum[n]), lanes[n]). */
static inline void qm_q8_k4_lanes(float lanes[8], float dx, float d, float dmin,
                                  const int32_t isum[8], const int32_t msum[8])
{
    for (int n = 0; n < 8; n++)
        lanes[n] = fmaf(dx, fmaf(-dmin, (float)msum[n], d * (float)isum[n]), lanes[n]);
}

static inline float qm_q8_lanes_sum(const float l[8])
{
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#endif

/*
 * qt_kquant_ref.h - the k-quants' and IQ4's reference quantizers: one
 * super-block of 256 floats into llama.cpp's Q2_K ... Q6_K or IQ4_XS
 * bytes, or one block of 32 into IQ4_NL's, the same bytes ggml's
 * quantize_row_q2_K_ref ... _q6_K_ref, _iq4_nl_ref and _iq4_xs_ref write
 * for the same input. Internal to kernels/ (quant_kquant.c is its CPU user); header-only
 * and QL_HD like qt_quant_math.h, so a device requantization can include it.
 *
 * What ggml does, in our words:
 *   Q4_K, Q5_K  eight sub-blocks of 32; each gets a scale and a minimum
 *               from a weighted least-squares search over 21 (Q4_K) or 16
 *               (Q5_K) candidate scalings (qk_fit_scale_min, ggml's
 *               make_qkx2_quants, weights av|x| + |x_i|); the eight scales
 *               and minima are then coded in 6 bits against the largest
 *               (f16 d and dmin), and the codes recomputed from the coded
 *               scales.
 *   Q6_K        sixteen sub-blocks of 16; each a signed symmetric fit over
 *               19 candidate scalings weighted by x^2 (qk_fit_symmetric,
 *               ggml's make_qx_quants with rmse_type 1), the scales coded in
 *               signed 8 bits against the one of largest magnitude.
 *   Q2_K, Q3_K  see qk_q2_k_block and qk_q3_k_block.
 *   IQ4_NL      one block of 32 fitted by weighted least squares (weights
 *   IQ4_XS      x^2) onto sixteen fixed non-linear levels; IQ4_XS tries 15
 *               more scalings per sub-block and codes the eight sub-block
 *               scales in 6 bits (see qk_iq4_fit).
 *
 * Bit equality rests on three things (tests/test_kquant_quantize.c pins it
 * against llama.cpp's own C, compiled by tests/fixtures/
 * make_kquant_ref_vectors.py):
 *   - one float operation per statement, in ggml's order (a*b*c is (a*b)*c,
 *     integers converted to float where ggml's expression converts them),
 *     and no contraction: the project builds with -ffp-contract=off and a
 *     CUDA user must build with --fmad=false. A fused multiply-add inside
 *     qk_nearest_int (iscale * x + 1.5 * 2^23) changes which integer a tie
 *     goes to; llama.cpp's own builds contract by default on FMA targets,
 *     so their bytes may differ from these (and from their own scalar
 *     build) on rare inputs: the generator counts how often.
 *   - qk_nearest_int is ggml's rounding: add 1.5 * 2^23 so the integer
 *     lands in the low mantissa bits (round to nearest even, the FPU's
 *     mode), then read them. ggml asserts |x| <= 2^22 - 1 in debug builds
 *     only; outside that, both give the same garbage, bit for bit.
 *   - the f16 conversions are qt_math.h's (round to nearest even), which
 *     is what ggml's GGML_FP32_TO_FP16 computes.
 */
#ifndef QL_QT_KQUANT_REF_H
#define QL_QT_KQUANT_REF_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qt_math.h"
#include "qt_quant_math.h"

/* ggml's GROUP_MAX_EPS: a (sub-)block whose largest |x| is below this is
 * all zero. */
#define QK_GROUP_MAX_EPS 1e-15f

/* Round to the nearest integer, ties to even, by the 1.5 * 2^23 trick. */
QL_HD int qk_nearest_int(float v)
{
    float shifted = v + 12582912.f;
    uint32_t bits = qm_f32_bits(shifted);
    return (int)(bits & 0x007fffffu) - 0x00400000;
}

QL_HD int qk_clamp(int v, int lo, int hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/*
 * The asymmetric fit of ggml's make_qkx2_quants: codes
 * L[i] in [0, nmax] with x ~ scale * L + min, min <= 0. First the plain
 * max - min scaling, then nstep + 1 candidates (rmin + rdelta * is + nmax)
 * / (max - min), each solved by weighted least squares and kept when its
 * weighted error (squared, or absolute when use_mad: Q2_K) is smaller.
 * Returns the scale, *neg_min = -min. n <= 32; laux is scratch of n.
 */
QL_HD float qk_fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L,
                             float *neg_min, uint8_t *laux, float rmin, float rdelta, int nstep,
                             bool use_mad)
{
    float mn = x[0], mx = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < mn)
            mn = x[i];
        if (x[i] > mx)
            mx = x[i];
        sum_w += w[i];
        float wx = w[i] * x[i];
        sum_x += wx;
    }
    if (mn > 0)
        mn = 0;
    if (mx == mn) {
        for (int i = 0; i < n; i++)
            L[i] = 0;
        *neg_min = -mn;
        return 0.f;
    }
    float iscale = (float)nmax / (mx - mn);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        float shifted = x[i] - mn;
        float scaled = iscale * shifted;
        L[i] = (uint8_t)qk_clamp(qk_nearest_int(scaled), 0, nmax);
        float back = scale * (float)L[i];
        float diff = back + mn;
        diff = diff - x[i];
        float sq = use_mad ? fabsf(diff) : diff * diff;
        float werr = w[i] * sq;
        best_error += werr;
    }
    if (nstep < 1) {
        *neg_min = -mn;
        return scale;
    }
    for (int is = 0; is <= nstep; is++) {
        float step = rdelta * (float)is;
        float num = rmin + step;
        num = num + (float)nmax;
        /* mn is the best candidate's minimum so far, as in ggml: each
         * candidate's range and offset start from the last improvement */
        float range = mx - mn;
        iscale = num / range;
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            float shifted = x[i] - mn;
            float scaled = iscale * shifted;
            int l = qk_clamp(qk_nearest_int(scaled), 0, nmax);
            laux[i] = (uint8_t)l;
            float wl = w[i] * (float)l;
            sum_l += wl;
            float wll = wl * (float)l;
            sum_l2 += wll;
            float wlx = wl * x[i];
            sum_xl += wlx;
        }
        float a = sum_w * sum_l2;
        float b = sum_l * sum_l;
        float D = a - b;
        if (D > 0) {
            float s1 = sum_w * sum_xl;
            float s2 = sum_x * sum_l;
            float this_scale = (s1 - s2) / D;
            float m1 = sum_l2 * sum_x;
            float m2 = sum_l * sum_xl;
            float this_min = (m1 - m2) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) {
                float back = this_scale * (float)laux[i];
                float diff = back + this_min;
                diff = diff - x[i];
                float sq = use_mad ? fabsf(diff) : diff * diff;
                float werr = w[i] * sq;
                cur_error += werr;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; i++)
                    L[i] = laux[i];
                best_error = cur_error;
                scale = this_scale;
                mn = this_min;
            }
        }
    }
    *neg_min = -mn;
    return scale;
}

/* The sums of one symmetric candidate: codes clamp(round(iscale * x), -nmax,
 * nmax - 1), weights x^2, sum w x l and sum w l^2 in ggml's order. */
QL_HD void qk_symmetric_sums(int n, int nmax, const float *x, float iscale, float *sumlx,
                             float *suml2)
{
    float slx = 0, sl2 = 0;
    for (int i = 0; i < n; i++) {
        float scaled = iscale * x[i];
        int l = qk_clamp(qk_nearest_int(scaled), -nmax, nmax - 1);
        float w = x[i] * x[i];
        float wx = w * x[i];
        float wxl = wx * (float)l;
        slx += wxl;
        float wl = w * (float)l;
        float wll = wl * (float)l;
        sl2 += wll;
    }
    *sumlx = slx;
    *suml2 = sl2;
}

QL_HD void qk_symmetric_codes(int n, int nmax, const float *x, float iscale, int8_t *L)
{
    for (int i = 0; i < n; i++) {
        float scaled = iscale * x[i];
        L[i] = (int8_t)(nmax + qk_clamp(qk_nearest_int(scaled), -nmax, nmax - 1));
    }
}

/*
 * The symmetric fit of ggml's make_qx_quants with rmse_type 1 and no
 * importance weights: codes L[i] = l + nmax, l in [-nmax, nmax - 1], x ~
 * scale * l; the scaling -nmax / max (max the element of largest |x|, the
 * first on a tie), then -(nmax + 0.1 * is) / max for is in -9..9, kept
 * when sum(w x l)^2 / sum(w l^2) grows. Returns the scale (0 and all codes
 * 0 for an all-zero block).
 */
QL_HD float qk_fit_symmetric(int n, int nmax, const float *x, int8_t *L)
{
    float mx = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            mx = x[i];
        }
    }
    if (amax < QK_GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++)
            L[i] = 0;
        return 0.f;
    }
    float iscale = (float)-nmax / mx;
    float sumlx, suml2;
    qk_symmetric_sums(n, nmax, x, iscale, &sumlx, &suml2);
    qk_symmetric_codes(n, nmax, x, iscale, L);
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0)
            continue;
        float step = 0.1f * (float)is;
        float num = (float)nmax + step;
        iscale = -num / mx;
        qk_symmetric_sums(n, nmax, x, iscale, &sumlx, &suml2);
        float gain = sumlx * sumlx;
        float bound = best * suml2;
        if (suml2 > 0 && gain > bound) {
            qk_symmetric_codes(n, nmax, x, iscale, L);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

QL_HD void qk_put_f16(uint8_t *p, uint16_t h)
{
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/*
 * The shared half of Q4_K and Q5_K: fit the eight sub-blocks, code their
 * scales and minima in 6 bits into blk[0..15] (f16 d, f16 dmin, scales[12]
 * as get_scale_min_k4 reads them), and leave in L[256] each element's code
 * in [0, nmax] recomputed from the coded scales (or the fit's code where a
 * coded scale is 0). nstep and rmin are Q4_K's 20, -1 or Q5_K's 15, -0.5.
 */
QL_HD void qk_k4_scales_and_codes(const float *x, int nmax, float rmin, int nstep, uint8_t *blk,
                                  uint8_t *L)
{
    float scales[8], mins[8], weights[32];
    uint8_t laux[32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) {
            float sq = xs[l] * xs[l];
            sum_x2 += sq;
        }
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++)
            weights[l] = av_x + fabsf(xs[l]);
        scales[j] = qk_fit_scale_min(32, nmax, xs, weights, L + 32 * j, &mins[j], laux, rmin, 0.1f,
                                     nstep, false);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *sc = blk + 4;
    for (int j = 0; j < 8; j++) {
        float vs = inv_scale * scales[j];
        float vm = inv_min * mins[j];
        uint8_t ls = (uint8_t)qk_nearest_int(vs);
        uint8_t lm = (uint8_t)qk_nearest_int(vm);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    qk_put_f16(blk, qm_f32_to_f16(max_scale / 63.f));
    qk_put_f16(blk + 2, qm_f32_to_f16(max_min / 63.f));
    for (int j = 0; j < 8; j++) {
        int s, m;
        qm_k4_scale_min(j, sc, &s, &m);
        float d = qm_f16_le(blk) * (float)s;
        if (d == 0)
            continue;
        float dm = qm_f16_le(blk + 2) * (float)m;
        for (int i = 0; i < 32; i++) {
            float shifted = x[32 * j + i] + dm;
            float v = shifted / d;
            L[32 * j + i] = (uint8_t)qk_clamp(qk_nearest_int(v), 0, nmax);
        }
    }
}

/* One Q4_K super-block (144 bytes) from 256 floats. */
QL_HD void qk_q4_k_block(const float *x, uint8_t *blk)
{
    uint8_t L[QM_QK_K];
    memset(blk, 0, QM_Q4_K_BYTES);
    qk_k4_scales_and_codes(x, 15, -1.f, 20, blk, L);
    uint8_t *q = blk + 16;
    for (int j = 0; j < QM_QK_K; j += 64) {
        for (int l = 0; l < 32; l++)
            q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
}

/* One Q5_K super-block (176 bytes): Q4_K's nibbles plus the fifth bits in
 * qh, bit 2 * (j / 64) + (j % 64 >= 32) of qh[j % 32]. */
QL_HD void qk_q5_k_block(const float *x, uint8_t *blk)
{
    uint8_t L[QM_QK_K];
    memset(blk, 0, QM_Q5_K_BYTES);
    qk_k4_scales_and_codes(x, 31, -0.5f, 15, blk, L);
    uint8_t *qh = blk + 16, *ql = blk + 48;
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QM_QK_K; n += 64) {
        for (int j = 0; j < 32; j++) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] |= m1;
            }
            if (l2 > 15) {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
        m1 = (uint8_t)(m1 << 2);
        m2 = (uint8_t)(m2 << 2);
        ql += 32;
    }
}

/* One Q6_K super-block (210 bytes: ql[128], qh[64], int8 scales[16], f16
 * d). A super-block whose sub-block scales are all below QK_GROUP_MAX_EPS
 * is all zero bytes, as ggml writes it. */
QL_HD void qk_q6_k_block(const float *x, uint8_t *blk)
{
    int8_t L[QM_QK_K];
    float scales[16];
    float max_scale = 0, max_abs_scale = 0;
    memset(blk, 0, QM_Q6_K_BYTES);
    for (int ib = 0; ib < 16; ib++) {
        float scale = qk_fit_symmetric(16, 32, x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
        float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    if (max_abs_scale < QK_GROUP_MAX_EPS)
        return;
    uint8_t *ql = blk, *qh = blk + 128, *sc = blk + 192;
    float iscale = -128.f / max_scale;
    qk_put_f16(blk + 208, qm_f32_to_f16(1 / iscale));
    for (int ib = 0; ib < 16; ib++) {
        float v = iscale * scales[ib];
        int q = qk_nearest_int(v);
        sc[ib] = (uint8_t)(int8_t)(q < 127 ? q : 127);
    }
    float d_all = qm_f16_le(blk + 208);
    for (int j = 0; j < 16; j++) {
        float d = d_all * (float)(int8_t)sc[j];
        if (d == 0)
            continue;
        for (int i = 0; i < 16; i++) {
            float v = x[16 * j + i] / d;
            L[16 * j + i] = (int8_t)(qk_clamp(qk_nearest_int(v), -32, 31) + 32);
        }
    }
    for (int j = 0; j < QM_QK_K; j += 128) {
        for (int l = 0; l < 32; l++) {
            uint8_t q1 = (uint8_t)(L[j + l] & 0xF);
            uint8_t q2 = (uint8_t)(L[j + l + 32] & 0xF);
            uint8_t q3 = (uint8_t)(L[j + l + 64] & 0xF);
            uint8_t q4 = (uint8_t)(L[j + l + 96] & 0xF);
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                              ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* ---- Q2_K and Q3_K ---------------------------------------------------------- */

/*
 * block_q2_K { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }, 84 bytes:
 * sixteen sub-blocks of 16, each a 4-bit scale (low nibble) and 4-bit
 * minimum (high nibble) against d and dmin, 2-bit codes, four per byte
 * (element 32 * s + l of each 128 in bits 2s of qs[32 * (j / 128) + l]).
 * The fit is qk_fit_scale_min with weights |x|, absolute error, nmax 3.
 */
#define QK_Q2_K_BYTES 84
#define QK_Q3_K_BYTES 110

QL_HD void qk_q2_k_block(const float *x, uint8_t *blk)
{
    uint8_t L[QM_QK_K], laux[16];
    float weights[16], mins[16], scales[16];
    float max_scale = 0, max_min = 0;
    memset(blk, 0, QK_Q2_K_BYTES);
    uint8_t *sc = blk, *qs = blk + 16;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 16; l++)
            weights[l] = fabsf(x[16 * j + l]);
        scales[j] = qk_fit_scale_min(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], laux, -0.5f,
                                     0.1f, 15, true);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    if (max_scale > 0) {
        float iscale = 15.f / max_scale;
        for (int j = 0; j < 16; j++) {
            float v = iscale * scales[j];
            sc[j] = (uint8_t)qk_nearest_int(v);
        }
        qk_put_f16(blk + 80, qm_f32_to_f16(max_scale / 15.f));
    }
    if (max_min > 0) {
        float iscale = 15.f / max_min;
        for (int j = 0; j < 16; j++) {
            float v = iscale * mins[j];
            sc[j] |= (uint8_t)(qk_nearest_int(v) << 4);
        }
        qk_put_f16(blk + 82, qm_f32_to_f16(max_min / 15.f));
    }
    for (int j = 0; j < 16; j++) {
        float d = qm_f16_le(blk + 80) * (float)(sc[j] & 0xF);
        if (d == 0)
            continue;
        float dm = qm_f16_le(blk + 82) * (float)(sc[j] >> 4);
        for (int i = 0; i < 16; i++) {
            float shifted = x[16 * j + i] + dm;
            float v = shifted / d;
            L[16 * j + i] = (uint8_t)qk_clamp(qk_nearest_int(v), 0, 3);
        }
    }
    for (int j = 0; j < QM_QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/*
 * ggml's make_q3_quants with do_rmse: the symmetric codes l in [-nmax,
 * nmax - 1] of -nmax / max, then up to five sweeps that move one code at a
 * time to x * sum(w l^2) / sum(w x l) (the others' sums) when that raises
 * sum(w x l)^2 / sum(w l^2), weights x^2. L[i] = l + nmax; returns the
 * scale (0 and codes 0 for an all-zero sub-block).
 */
QL_HD float qk_fit_q3(int n, int nmax, const float *x, int8_t *L)
{
    float mx = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            mx = x[i];
        }
    }
    if (amax < QK_GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++)
            L[i] = 0;
        return 0.f;
    }
    float iscale = (float)-nmax / mx;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        float scaled = iscale * x[i];
        int l = qk_clamp(qk_nearest_int(scaled), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        float wx = w * x[i];
        sumlx += wx * (float)l;
        float wl = w * (float)l;
        suml2 += wl * (float)l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i];
            float wx = w * x[i];
            float slx = sumlx - wx * (float)L[i];
            if (!(slx > 0))
                continue;
            float wl = w * (float)L[i];
            float sl2 = suml2 - wl * (float)L[i];
            float num = x[i] * sl2;
            int new_l = qk_clamp(qk_nearest_int(num / slx), -nmax, nmax - 1);
            if (new_l == L[i])
                continue;
            slx += wx * (float)new_l;
            float wn = w * (float)new_l;
            sl2 += wn * (float)new_l;
            float lhs = slx * slx;
            lhs = lhs * suml2;
            float rhs = sumlx * sumlx;
            rhs = rhs * sl2;
            if (sl2 > 0 && lhs > rhs) {
                L[i] = (int8_t)new_l;
                sumlx = slx;
                suml2 = sl2;
                n_changed++;
            }
        }
        if (!n_changed)
            break;
    }
    for (int i = 0; i < n; i++)
        L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/*
 * block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }, 110
 * bytes: sixteen sub-blocks of 16 with signed 6-bit scales (low nibbles in
 * scales[0..7], two high bits each in scales[8..11]), 3-bit codes as Q2_K's
 * two low bits plus a high bit in hmask (bit j / 32 of hmask[j % 32]).
 */
QL_HD void qk_q3_k_block(const float *x, uint8_t *blk)
{
    int8_t L[QM_QK_K];
    float scales[16];
    float max_scale = 0, amax = 0;
    memset(blk, 0, QK_Q3_K_BYTES);
    uint8_t *hmask = blk, *qs = blk + 32, *sc = blk + 96;
    for (int j = 0; j < 16; j++) {
        scales[j] = qk_fit_q3(16, 4, x + 16 * j, L + 16 * j);
        float scale = fabsf(scales[j]);
        if (scale > amax) {
            amax = scale;
            max_scale = scales[j];
        }
    }
    if (max_scale != 0) {
        float iscale = -32.f / max_scale;
        for (int j = 0; j < 16; j++) {
            float v = iscale * scales[j];
            int8_t l = (int8_t)qk_nearest_int(v);
            l = (int8_t)(qk_clamp(l, -32, 31) + 32);
            if (j < 8)
                sc[j] = (uint8_t)(l & 0xF);
            else
                sc[j - 8] |= (uint8_t)((l & 0xF) << 4);
            l = (int8_t)(l >> 4);
            sc[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
        }
        qk_put_f16(blk + 108, qm_f32_to_f16(1 / iscale));
    }
    float d_all = qm_f16_le(blk + 108);
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
        int s = (lo | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        float d = d_all * (float)(int8_t)s;
        if (d == 0)
            continue;
        for (int i = 0; i < 16; i++) {
            float v = x[16 * j + i] / d;
            L[16 * j + i] = (int8_t)(qk_clamp(qk_nearest_int(v), -4, 3) + 4);
        }
    }
    int m = 0;
    uint8_t hm = 1;
    for (int j = 0; j < QM_QK_K; j++) {
        if (L[j] > 3) {
            hmask[m] |= hm;
            L[j] = (int8_t)(L[j] - 4);
        }
        if (++m == QM_QK_K / 8) {
            m = 0;
            hm = (uint8_t)(hm << 1);
        }
    }
    for (int j = 0; j < QM_QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/* ---- IQ4_NL and IQ4_XS ----------------------------------------------------
 * ggml's quantize_row_iq4_nl_impl without an importance matrix (weights
 * x^2), as its quantize_row_iq4_nl_ref (ntry -1: one fit per block of 32)
 * and quantize_row_iq4_xs_ref (ntry 7: fifteen more scalings per
 * sub-block, then the eight sub-block scales coded in 6 bits against the
 * largest) call it. The codes index qt_quant_math.h's sixteen IQ4 levels.
 */

/* ggml's best_index_int8 over the IQ4 levels: the index of the level
 * nearest v, found by bisection; a tie between two levels goes to the upper
 * one, and a NaN to 15, as in ggml. */
QL_HD int qk_iq4_nearest_level(float v)
{
    if (v <= (float)qm_iq4nl_level(0))
        return 0;
    if (v >= (float)qm_iq4nl_level(15))
        return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (v < (float)qm_iq4nl_level(mid))
            hi = mid;
        else
            lo = mid;
    }
    float below = v - (float)qm_iq4nl_level(hi - 1);
    float above = (float)qm_iq4nl_level(hi) - v;
    return below < above ? hi - 1 : hi;
}

/* The weighted sums of one candidate scaling: codes nearest id * x, and
 * sum w q x, sum w q^2 over them (w = x^2). Codes into L unless L is NULL. */
QL_HD void qk_iq4_sums(const float *xb, const float *w, float id, uint8_t *L, float *sumqx,
                       float *sumq2)
{
    float sqx = 0, sq2 = 0;
    for (int j = 0; j < 32; j++) {
        float al = id * xb[j];
        int l = qk_iq4_nearest_level(al);
        if (L)
            L[j] = (uint8_t)l;
        float q = (float)qm_iq4nl_level(l);
        float wq = w[j] * q;
        float t = wq * xb[j];
        sqx += t;
        float t2 = wq * q;
        sq2 += t2;
    }
    *sumqx = sqx;
    *sumq2 = sq2;
}

/*
 * The scale of one sub-block of 32 and its codes in L[32]: first the
 * scaling that puts the signed value of largest magnitude (max) on level 0
 * (-127; with ntry > 0 on its mirror), solved by weighted least squares;
 * then, for itry in -ntry..ntry, the scaling (itry - 127) / max, kept when
 * it fits better (sumqx^2 / sumq2 larger); those leave L as the first fit.
 * A sub-block whose largest |x| is below QK_GROUP_MAX_EPS gets scale 0 and
 * codes 8 (the level nearest 0): ggml leaves those codes as whatever its
 * scratch held (the previous block's in quantize_row_iq4_nl_ref, undefined
 * for the first), which dequantize to 0 all the same.
 */
QL_HD float qk_iq4_fit(const float *xb, int ntry, uint8_t *L)
{
    float w[32];
    for (int j = 0; j < 32; j++)
        w[j] = xb[j] * xb[j];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        float ax = fabsf(xb[j]);
        if (ax > amax) {
            amax = ax;
            max = xb[j];
        }
    }
    if (amax < QK_GROUP_MAX_EPS) {
        for (int j = 0; j < 32; j++)
            L[j] = (uint8_t)qk_iq4_nearest_level(0.f);
        return 0.f;
    }
    float level0 = (float)qm_iq4nl_level(0);
    float d = ntry > 0 ? -max / level0 : max / level0;
    float id = 1 / d;
    float sumqx, sumq2;
    qk_iq4_sums(xb, w, id, L, &sumqx, &sumq2);
    d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
    float best = d * sumqx;
    for (int itry = -ntry; itry <= ntry; itry++) {
        id = (float)(itry + qm_iq4nl_level(0)) / max;
        qk_iq4_sums(xb, w, id, NULL, &sumqx, &sumq2);
        float fit = sumqx * sumqx;
        float bar = best * sumq2;
        if (sumq2 > 0 && fit > bar) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

/* One IQ4_NL block (18 bytes: f16 d, 16 bytes of nibbles, element j low
 * and j + 16 high) from 32 floats, as quantize_row_iq4_nl_ref. */
QL_HD void qk_iq4_nl_block(const float *x, uint8_t *blk)
{
    uint8_t L[QM_IQ4_NL_QK];
    float d = qk_iq4_fit(x, -1, L);
    qk_put_f16(blk, qm_f32_to_f16(d));
    for (int j = 0; j < 16; j++)
        blk[2 + j] = (uint8_t)(L[j] | (L[j + 16] << 4));
}

/* One IQ4_XS super-block (136 bytes: f16 d, u16 scales_h, scales_l[4],
 * qs[128]) from 256 floats, as quantize_row_iq4_xs_ref: each sub-block's
 * fit, d = -(the fitted scale of largest magnitude) / 32, each sub-block's
 * scale coded as a 6-bit l in -32..31 (stored l + 32: low nibble in
 * scales_l, high 2 bits in scales_h) and its codes recomputed against the
 * coded d * l (all 8 where that is 0). d stays f32 in that arithmetic; only
 * the stored copy is f16. */
QL_HD void qk_iq4_xs_block(const float *x, uint8_t *blk)
{
    uint8_t L[QM_QK_K];
    float scales[8];
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < 8; ib++) {
        scales[ib] = qk_iq4_fit(x + 32 * ib, 7, L + 32 * ib);
        float abs_d = fabsf(scales[ib]);
        if (abs_d > amax_scale) {
            amax_scale = abs_d;
            max_scale = scales[ib];
        }
    }
    float d = -max_scale / 32;
    qk_put_f16(blk, qm_f32_to_f16(d));
    float id = d != 0 ? 1 / d : 0.f;
    unsigned scales_h = 0;
    memset(blk + 4, 0, 4);
    for (int ib = 0; ib < 8; ib++) {
        float s = id * scales[ib];
        int l = qk_clamp(qk_nearest_int(s), -32, 31);
        float dl = d * (float)l;
        float idl = dl != 0 ? 1 / dl : 0.f;
        for (int j = 0; j < 32; j++) {
            float v = idl * x[32 * ib + j];
            L[32 * ib + j] = (uint8_t)qk_iq4_nearest_level(v);
        }
        l += 32;
        blk[4 + ib / 2] |= (uint8_t)((l & 0xf) << (4 * (ib % 2)));
        scales_h |= (unsigned)(l >> 4) << (2 * ib);
    }
    blk[2] = (uint8_t)(scales_h & 0xff);
    blk[3] = (uint8_t)(scales_h >> 8);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 16; j++)
            blk[8 + 16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
}

#endif

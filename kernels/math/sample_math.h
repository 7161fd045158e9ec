/*
 * sample_math.h - the arithmetic of a temperature draw (no top-k, no top-p,
 * no penalty), shared by the CPU sampler (engine/scheduler/sampler.c) and the CUDA
 * backend's sampling kernel (kernels/cuda/qt_cuda_sample.cu), so that a
 * seeded request gets the same tokens on either.
 *
 * The draw, as engine/scheduler/sampler.c documents it: the largest logit m (NaN
 * ignored), weights w[i] = e^((l[i] - m) / T) computed as exp_minus((m -
 * l[i]) * (1 / T)) with our own exp (Cephes' polynomial in plain f32
 * operations), the total as the sum in id order of block sums (blocks of
 * 256, four double lanes each), and the token where u * total falls,
 * walking the blocks then the block's weights. Every step is IEEE
 * arithmetic in a fixed order (the CPU compiles without contraction, the
 * CUDA library with --fmad=false), so both give the same bits; a GPU sums
 * the blocks in parallel and walks them in one thread.
 *
 * QL_HD as in qt_math.h: plain C on the CPU, __host__ __device__ under nvcc.
 */
#ifndef QL_SAMPLE_MATH_H
#define QL_SAMPLE_MATH_H

#include <stdint.h>

#include "qt_math.h"

/* Weights per block of the total; the CPU sampler sums its arrays so too. */
#define QM_SAMPLE_BLOCK   256
#define QM_EXP_LIMIT_BITS 0x42ae0000u /* 87.0f: e^-87 is the last normal float */
#define QM_F32_INF_BITS   0x7f800000u

/*
 * e^-y for y >= 0 (NaN and y >= 87 give 0), with Cephes' expf polynomial
 * (relative error under 1e-7, measured against exp in double over [0, 87]).
 * Our own rather than libm's expf: it vectorises, and being plain IEEE
 * arithmetic (no contraction) it gives the same bits on every machine.
 */
QL_HD float qm_exp_minus(float y)
{
    uint32_t b = qm_f32_bits(y);
    uint32_t inside = 0u - (uint32_t)(b < QM_EXP_LIMIT_BITS);
    float x = -qm_bits_f32((b & inside) | (QM_EXP_LIMIT_BITS & ~inside));
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * 0.693359375f;                                   /* ln 2 in two parts */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    float scale = qm_bits_f32((uint32_t)((int32_t)n + 127) << 23); /* 2^n, n in [-126, 0] */
    return qm_bits_f32(qm_f32_bits(p * scale) & inside);
}

/* The weight of one logit under maximum m and 1 / T = inv_t. A NaN logit
 * weighs nothing (the sampler made it -inf); when m is +inf the +inf
 * logits share everything equally (the sampler's limit of the softmax). */
QL_HD float qm_sample_weight(float logit, float m, float inv_t)
{
    uint32_t b = qm_f32_bits(logit);
    if ((b & 0x7fffffffu) > QM_F32_INF_BITS)
        return 0.0f;
    if (qm_f32_bits(m) == QM_F32_INF_BITS)
        return b == QM_F32_INF_BITS ? qm_exp_minus(0.0f) : 0.0f;
    return qm_exp_minus((m - logit) * inv_t);
}

/* The sum of weights [lo, hi) (one block), four double lanes, as the CPU
 * sampler's block_sum. */
QL_HD double qm_sample_block_sum(const float *logits, int64_t lo, int64_t hi, float m, float inv_t)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4) {
        s0 += qm_sample_weight(logits[i], m, inv_t);
        s1 += qm_sample_weight(logits[i + 1], m, inv_t);
        s2 += qm_sample_weight(logits[i + 2], m, inv_t);
        s3 += qm_sample_weight(logits[i + 3], m, inv_t);
    }
    for (; i < hi; i++)
        s0 += qm_sample_weight(logits[i], m, inv_t);
    return (s0 + s1) + (s2 + s3);
}

/*
 * The token where u * total falls, given the block sums (sums[b] for block
 * b of QM_SAMPLE_BLOCK weights): the sampler's draw. Rounding that puts
 * u * total at or past the end takes the last token with weight, within
 * the block or overall; no weight at all gives 0.
 */
QL_HD int32_t qm_sample_pick(const float *logits, int64_t vocab, float m, float inv_t, double u,
                             const double *sums)
{
    int64_t n_blocks = (vocab + QM_SAMPLE_BLOCK - 1) / QM_SAMPLE_BLOCK;
    double total = 0;
    for (int64_t b = 0; b < n_blocks; b++)
        total += sums[b];
    double target = u * total, cum = 0;
    int64_t pick = vocab;
    for (int64_t b = 0; b < n_blocks && pick == vocab; b++) {
        int64_t lo = b * QM_SAMPLE_BLOCK;
        int64_t hi = lo + QM_SAMPLE_BLOCK < vocab ? lo + QM_SAMPLE_BLOCK : vocab;
        if (cum + sums[b] <= target) {
            cum += sums[b];
            continue;
        }
        for (int64_t i = lo; i < hi && pick == vocab; i++) {
            cum += qm_sample_weight(logits[i], m, inv_t);
            if (cum > target)
                pick = i;
        }
        for (int64_t i = hi; i-- > lo && pick == vocab;)
            if (qm_sample_weight(logits[i], m, inv_t) > 0)
                pick = i;
    }
    for (int64_t i = vocab; i-- > 0 && pick == vocab;)
        if (qm_sample_weight(logits[i], m, inv_t) > 0)
            pick = i;
    return pick == vocab ? 0 : (int32_t)pick;
}

/* A float's place in the sampler's order: larger keys for larger floats,
 * -0 below +0, every NaN 0 (below everything). */
QL_HD uint32_t qm_order_key(float f)
{
    uint32_t b = qm_f32_bits(f);
    uint32_t negative = 0u - (b >> 31);
    uint32_t key = b ^ (negative | 0x80000000u);
    uint32_t is_nan = 0u - (uint32_t)((b & 0x7fffffffu) > QM_F32_INF_BITS);
    return key & ~is_nan;
}

/* The float of a key (the largest logit, from the largest key). */
QL_HD float qm_key_float(uint32_t key)
{
    return qm_bits_f32(key & 0x80000000u ? key ^ 0x80000000u : ~key);
}

/* The first id in [0, vocab) whose logit equals v (== , so -0 == +0); v
 * is one of them. */
QL_HD int64_t qm_first_equal(const float *logits, int64_t vocab, float v)
{
    for (int64_t i = 0; i < vocab; i++)
        if (logits[i] == v)
            return i;
    return 0;
}

/*
 * The whole draw in one thread, as the CUDA kernel computes it in parallel:
 * the largest logit by qm_order_key (all NaN gives token 0), m the first
 * logit equal to it (so -0 when that one is -0, as the sampler takes it;
 * an m of -inf gives that id), the block sums into sums (one per block
 * of QM_SAMPLE_BLOCK), and the pick. The CPU sampler gives the same token
 * for the same logits, temperature and uniform u (tests/test_sampler.c).
 */
QL_HD int32_t qm_sample_token(const float *logits, int64_t vocab, float inv_t, double u,
                              double *sums)
{
    uint32_t best_key = 0;
    for (int64_t i = 0; i < vocab; i++) {
        uint32_t key = qm_order_key(logits[i]);
        best_key = key > best_key ? key : best_key;
    }
    if (best_key == 0)
        return 0;
    int64_t best = qm_first_equal(logits, vocab, qm_key_float(best_key));
    float m = logits[best]; /* as the sampler: -0 when the first largest is -0 */
    if (qm_f32_bits(m) == (QM_F32_INF_BITS | 0x80000000u))
        return (int32_t)best;
    for (int64_t lo = 0, b = 0; lo < vocab; lo += QM_SAMPLE_BLOCK, b++)
        sums[b] = qm_sample_block_sum(
            logits, lo, lo + QM_SAMPLE_BLOCK < vocab ? lo + QM_SAMPLE_BLOCK : vocab, m, inv_t);
    return qm_sample_pick(logits, vocab, m, inv_t, u, sums);
}

#endif

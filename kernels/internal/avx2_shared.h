/*
 * avx2_shared.h - the pieces the AVX2 files of kernels/ share
 * (matmul_avx2.c's products and matmul_q8.inc's 8-bit ones): the one
 * horizontal sum of eight f32 lanes, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
 * (l3 + l7)), the order qt_q8act_math.h's qm_q8_lanes_sum writes in scalar
 * C; binary16 scales by F16C; the weight stream's prefetch; and how many
 * rows of x a product's pass takes. Only for files compiled with AVX2
 * enabled.
 */
#ifndef QL_AVX2_SHARED_H
#define QL_AVX2_SHARED_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* The little-endian binary16 at p as f32, by the F16C instruction: one
 * instruction where qm_f16_le is a dozen with a branch, and the same value
 * for every number, subnormals included (the conversion is exact); a
 * signalling NaN comes back quiet. */
static inline __attribute__((always_inline)) float qt_f16_le_avx2(const uint8_t *p)
{
    return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
}

/* How far ahead of the block in hand a product prefetches its weights. A
 * mixture-of-experts step reads each chosen expert's rows once, straight
 * from memory; prefetching one line per block 1 KiB ahead left the Q6_K
 * down products a third slower than from cache (its blocks span four
 * lines), every line of the block 4 KiB ahead brings them within 15%
 * (Qwen3-30B-A3B's expert shapes, 95 of 128 experts, two rows each). */
#define QT_PREFETCH_AHEAD 4096

/* Prefetch the bb bytes lying QT_PREFETCH_AHEAD past the block at blk, one
 * line at a time (bb is a constant in every caller, so the loop unrolls). */
static inline __attribute__((always_inline)) void qt_prefetch_block(const uint8_t *blk, size_t bb)
{
    for (size_t at = 0; at < bb; at += 64)
        _mm_prefetch((const char *)blk + QT_PREFETCH_AHEAD + at, _MM_HINT_T0);
}

static inline float qt_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows of x a product takes per pass: most, halved (down to 4) while a
 * pass's rows of x_row_bytes each would pass limit, so that they stay in L1
 * beside the weight stream (each is read once per weight row). A row's
 * arithmetic does not depend on it. */
static inline int64_t qt_rows_per_pass(int64_t most, int64_t x_row_bytes, int64_t limit)
{
    int64_t rows = most;
    while (rows > 4 && rows * x_row_bytes > limit)
        rows /= 2;
    return rows;
}

#endif

/*
 * hsum_avx2.h - the one horizontal sum of eight f32 lanes the AVX2 files
 * of kernels/ share (matmul_avx2.c's products and matmul_q8.inc's 8-bit
 * ones): ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), the order
 * qt_q8act_math.h's qm_q8_lanes_sum writes in scalar C. Only for files
 * compiled with AVX2 enabled.
 */
#ifndef QL_HSUM_AVX2_H
#define QL_HSUM_AVX2_H

#include <immintrin.h>

static inline float qt_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif

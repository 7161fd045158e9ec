/*
 * matmul_gptq_avx2.c - GPTQ's and AWQ's AVX2+FMA products (entries
 * qt_matmul_gptq_avx2, qt_matmul_awq_avx2; the body is
 * internal/matmul_gptq.inc, which matmul_gptq_avx512.c compiles again for
 * 16 outputs to a vector): eight outputs to a __m256, each lane its
 * output's fused multiply-add chain in column order, so the scalar
 * reference's bits (qt_gptq_matmul_ref). Built with -mavx2 -mfma -mf16c;
 * traits.c calls it only when the CPU has those. It owns no state; it
 * calls quant_gptq.c (a row's groups, the scalar reference for rows no
 * vector covers).
 */
#include "kernels_internal.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE  static inline __attribute__((always_inline))
#define GW             8 /* outputs to a vector */
#define GT_XB          4 /* rows of x per pass: 8 chains + 2 weights + x fit 16 registers */
#define GT_ENTRY(name) name##_avx2
#define GV             __m256
#define GVI            __m256i
#define gv_zero        _mm256_setzero_ps
#define gv_load        _mm256_loadu_ps
#define gv_store       _mm256_storeu_ps
#define gv_set1        _mm256_set1_ps
#define gv_fma         _mm256_fmadd_ps
#define gv_sub         _mm256_sub_ps
#define gv_mul         _mm256_mul_ps
#define gvi_load(p)    _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define gvi_set1       _mm256_set1_epi32
#define gvi_and        _mm256_and_si256
#define gvi_srli       _mm256_srli_epi32
#define gvi_cvt        _mm256_cvtepi32_ps

#define gvi_add          _mm256_add_epi32
#define gvi_srlv         _mm256_srlv_epi32
#define gvi_gather(p, i) _mm256_i32gather_epi32(p, i, 4)
#define gv_f16(p)        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
/* Outputs 8j .. 8j + 7's codes of one input column from their AWQ word at
 * p: output 8j + m sits in nibble (0 4 1 5 2 6 3 7)[m]. */
static inline GVI awq_codes(const uint8_t *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return _mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                             _mm256_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28));
}

#include "matmul_gptq.inc"

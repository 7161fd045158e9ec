/*
 * matmul_gptq_avx512.c - GPTQ's and AWQ's AVX-512 products (entries
 * qt_matmul_gptq_avx512, qt_matmul_awq_avx512): internal/matmul_gptq.inc
 * with sixteen outputs to a __m512 and eight rows of x per pass (32
 * registers). Each lane runs the same fused multiply-add chain as
 * matmul_gptq_avx2.c's and the scalar reference, so the same bits; twice
 * the lanes per instruction. Built with -mavx512f -mavx512vl; traits.c
 * calls it only where CPUID reports AVX-512 F and VL and the OS saves
 * their state.
 */
#include "kernels_internal.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE  static inline __attribute__((always_inline))
#define GW             16 /* outputs to a vector */
#define GT_XB          8  /* rows of x per pass: 16 chains + 2 weights + x fit 32 registers */
#define GT_ENTRY(name) name##_avx512
#define GV             __m512
#define GVI            __m512i
#define gv_zero        _mm512_setzero_ps
#define gv_load        _mm512_loadu_ps
#define gv_store       _mm512_storeu_ps
#define gv_set1        _mm512_set1_ps
#define gv_fma         _mm512_fmadd_ps
#define gv_sub         _mm512_sub_ps
#define gv_mul         _mm512_mul_ps
#define gvi_load(p)    _mm512_loadu_si512((const void *)(p))
#define gvi_set1       _mm512_set1_epi32
#define gvi_and        _mm512_and_si512
#define gvi_srli       _mm512_srli_epi32
#define gvi_cvt        _mm512_cvtepi32_ps

#define gvi_add          _mm512_add_epi32
#define gvi_srlv         _mm512_srlv_epi32
#define gvi_gather(p, i) _mm512_i32gather_epi32(i, p, 4)
#define gv_f16(p)        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
/* Outputs 8j .. 8j + 15's codes of one input column from their two AWQ
 * words at p: output 8j + m sits in nibble (0 4 1 5 2 6 3 7)[m % 8] of
 * word m / 8. */
static inline GVI awq_codes(const uint8_t *p)
{
    uint32_t w[2];
    memcpy(w, p, sizeof w);
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32((int)w[0])),
                                      _mm256_set1_epi32((int)w[1]), 1);
    return _mm512_srlv_epi32(
        both, _mm512_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28, 0, 16, 4, 20, 8, 24, 12, 28));
}

#include "matmul_gptq.inc"

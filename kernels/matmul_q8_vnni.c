/*
 * matmul_q8_vnni.c - the 8-bit activation products (matmul_q8.inc) for
 * CPUs with AVX-512 VNNI and VL, on 256-bit vectors: a K-quant
 * sub-block's pair sums times its scale added by one vpdpwssd where the
 * AVX2 form takes vpmaddwd and vpaddd, and a block of 32's four-term sums
 * by one vpdpbusd where it takes vpmaddubsw and vpmaddwd; 8 rows of x per
 * pass in AVX-512's 32 registers, and for the kinds of blocks of 32 two
 * weight rows per pass sharing each load of x. The same integers, so the scalar
 * entries' bits (test_q8act). Entry points qt_matmul_q8_<kind>_vnni; traits.c
 * takes them when CPUID reports AVX512_VNNI and AVX512VL and the OS saves
 * the AVX-512 state. It owns no state. Compiled with -mavx2 -mfma -mf16c
 * -mavx512f -mavx512vl -mavx512vnni.
 */
#include "avx2_shared.h"
#include "kernels_internal.h"
#include "qt_q8act_math.h"
#include "qt_quant_math.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE               static inline __attribute__((always_inline))
#define XCHUNK                      8 /* AVX-512 has 32 vector registers */
#define Q8_MADD(acc, pairs, scales) _mm256_dpwssd_epi32(acc, pairs, scales)
#define Q8_DOT4(u8, s8)             _mm256_dpbusd_epi32(_mm256_setzero_si256(), u8, s8)
#define Q8_ENTRY(name)              name##_vnni
#define Q8_PAIRS                    1 /* two weight rows per pass (matmul_q8.inc) */

#include "matmul_q8.inc"

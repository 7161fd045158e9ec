/*
 * matmul_q8_avx2.c - the 8-bit activation path on AVX2: activation rows
 * quantized to int8 blocks of 256 or 32 (qt_acts_quantize_avx2) and the
 * products against them (qt_matmul_q8_<kind>_avx2: Q4_K, Q5_K, Q6_K and
 * the kinds of blocks of 32), the scalar entries' bits (quant_q8act.c):
 * the same integers (unsigned codes times signed activations by
 * vpmaddubsw, times the sub-block's scale by vpmaddwd, all exact in int32)
 * in the same lanes, then qt_q8act_math.h's float lanes per block.
 *
 * The products' bodies are kernels/internal/matmul_q8.inc, compiled here
 * with vpmaddwd + vpaddd and in matmul_q8_vnni.c with vpdpwssd. It owns
 * no state; it touches kernels/math/. Compiled with -mavx2 -mfma -mf16c;
 * traits.c calls it only when the CPU reports those features.
 */
#include "avx2_shared.h"
#include "kernels_internal.h"
#include "qt_q8act_math.h"
#include "qt_quant_math.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE               static inline __attribute__((always_inline))
#define XCHUNK                      4
#define Q8_MADD(acc, pairs, scales) _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales))
#define Q8_DOT4(u8, s8)             _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1))
#define Q8_ENTRY(name)              name##_avx2
#define Q8_PAIRS                    0 /* 16 registers: one weight row per pass */

/* --- quantizing the activations -------------------------------------------------- */

static inline int32_t hsum_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One block of n (256 or 32): qm_q8_quantize_block's values (the same amax, the same
 * product x * id rounded to nearest even by vcvtps2dq). */
static void quantize_block(const float *x, int n, int8_t *q, int16_t *bsum, float *d, float *dsum)
{
    __m256 sign = _mm256_set1_ps(-0.0f), amax8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v));
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float amax = _mm_cvtss_f32(m);
    if (_mm256_movemask_ps(nan8) || !(amax <= 3.4028235e38f) || amax == 0.0f) {
        /* the rare cases, as the reference writes them */
        qm_q8_quantize_block(x, n, q, bsum, d, dsum);
        return;
    }
    __m256 id = _mm256_set1_ps(127.0f / amax);
    *d = amax / 127.0f;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * g), id));
        bsum[i / 16] = (int16_t)hsum_i32(_mm256_add_epi32(v[0], v[1]));
        bsum[i / 16 + 1] = (int16_t)hsum_i32(_mm256_add_epi32(v[2], v[3]));
        __m256i p =
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
    int total = 0;
    for (int k = 0; k < n / 16; k++)
        total += bsum[k];
    *dsum = *d * (float)total;
}

void qt_acts_quantize_avx2(qt_acts *a)
{
    int64_t nblk = a->batch * a->cols / a->block;
    for (int64_t k = 0; k < nblk; k++)
        quantize_block(a->x + k * a->block, (int)a->block, a->q + k * a->block,
                       a->bsum + k * a->block / 16, a->d + k, a->dsum + k);
}

#include "matmul_q8.inc"

/*
 * quant_avx2.c - the AVX2 quantizers of the traits table (its quantize_avx2
 * entries): the same bytes as the kind's scalar quantizer, eight elements
 * at a time. A LoRA merge requantizes every merged weight (adapters/
 * merge.c), and the scalar bucket search was most of a merge's time.
 *
 * NF4 and FP4 (qt_bnb4_quantize_avx2): only the full blocks are coded here
 * (code_full_block), through quant_bnb4.c's driver, which keeps the short
 * last block, the odd element's pad and double quant. Why the bytes are
 * the scalar ones:
 *   - absmax is a maximum of |x| (sign bit cleared), exact in any order,
 *     and the comparison keeps the larger value as qq_maxf does; the inputs
 *     are finite (qt_quantize refuses NaN and Inf first);
 *   - each element is multiplied by the same f32 reciprocal and clamped to
 *     [-1, 1] with max/min, which for finite values is qq_clampf;
 *   - the bucket is the count of the 15 midpoints strictly below the
 *     scaled value (qq_bucket counts the same comparisons), mapped through
 *     the sort order with a byte shuffle;
 *   - the even element goes to the high nibble.
 *
 * It owns no state; it calls down into quant_bnb4.c (qt_bnb4_quantize_with)
 * and touches kernels/math/ (qt_quant_math.h's qq_buckets and recip).
 *
 * This file is compiled with -mavx2 -mfma -mf16c and only reached when the
 * CPU reports those features (traits.c).
 */
#include "kernels_internal.h"
#include "qt_quant_math.h"

#include <immintrin.h>

/* The bucket of 8 scaled values: how many midpoints are strictly below. */
static inline __m256i bucket8(const __m256 bounds[15], __m256 s)
{
    __m256i count = _mm256_setzero_si256();
    for (int j = 0; j < 15; j++) /* a true compare is -1: subtract it */
        count =
            _mm256_sub_epi32(count, _mm256_castps_si256(_mm256_cmp_ps(bounds[j], s, _CMP_LT_OQ)));
    return count;
}

/* 8 int32 values in 0..255 as 8 bytes, in order. */
static inline uint64_t narrow8(__m256i v)
{
    const __m256i pick =
        _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_shuffle_epi8(v, pick);
    uint64_t lo = (uint32_t)_mm256_cvtsi256_si32(b);
    uint64_t hi = (uint32_t)_mm256_extract_epi32(b, 4);
    return lo | hi << 32;
}

static float code_full_block(const struct qq_buckets *cb, const float *x, int64_t bs,
                             uint8_t *codes)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 am8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < bs; i += 8)
        am8 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), am8);
    float lanes[8];
    _mm256_storeu_ps(lanes, am8);
    float am = 0.0f;
    for (int i = 0; i < 8; i++)
        am = qq_maxf(am, lanes[i]);

    __m256 bounds[15];
    for (int j = 0; j < 15; j++)
        bounds[j] = _mm256_set1_ps(cb->bounds[j]);
    const __m128i order = _mm_loadu_si128((const __m128i *)cb->order);
    const __m256 recip = _mm256_set1_ps(qq_bnb4_recip(am));
    const __m256 lo = _mm256_set1_ps(-1.0f), hi = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < bs; i += 16) {
        /* 16 elements: their buckets, then the even ones' codes shifted
         * into the high nibble of each byte */
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        a = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(a, recip)));
        b = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(b, recip)));
        __m256i ba = bucket8(bounds, a), bb = bucket8(bounds, b);
        /* 16 buckets as bytes, in element order, then through the sort order */
        __m128i bytes = _mm_set_epi64x((long long)narrow8(bb), (long long)narrow8(ba));
        __m128i code = _mm_shuffle_epi8(order, bytes);
        /* byte k of the result: code[2k] << 4 | code[2k + 1] */
        __m128i pairs = _mm_maddubs_epi16(code, _mm_set1_epi16(0x0110));
        __m128i packed = _mm_packus_epi16(pairs, pairs);
        _mm_storel_epi64((__m128i *)(codes + i / 2), packed);
    }
    return am;
}

int qt_bnb4_quantize_avx2(qtensor *t, const float *src, int64_t rows, int64_t cols,
                          const qt_quant_params *p, char *msg, size_t msg_len)
{
    return qt_bnb4_quantize_with(t, src, rows, cols, p, code_full_block, msg, msg_len);
}

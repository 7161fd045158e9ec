/*
 * matmul_q8_avx2.c - the 8-bit activation path on AVX2: activation rows
 * quantized to int8 blocks of 256 (qt_acts_quantize_avx2) and the Q4_K,
 * Q5_K and Q6_K products against them (qt_matmul_q8_<kind>_avx2), the
 * scalar entries' bits (quant_q8act.c): the same integers (pairs of
 * unsigned codes times signed activations by vpmaddubsw, times the
 * sub-block's scale by vpmaddwd, all exact in int32), then
 * qt_q8act_math.h's float tail per block of 256, per row of x.
 *
 * Shape: for a chunk of up to 4 rows of x, walk W one row at a time; a
 * block's codes are unpacked and its scales spread once, then used for
 * every row of the chunk, each row with its own accumulators (so a row's
 * bits never depend on its neighbours). It owns no state; it touches
 * kernels/math/. Compiled with -mavx2 -mfma -mf16c; traits.c calls it only
 * when the CPU reports those features.
 */
#include "kernels_internal.h"
#include "qt_q8act_math.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define XCHUNK        4

/* --- quantizing the activations -------------------------------------------------- */

static inline int32_t hsum_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One block of 256: qm_q8_quantize_block's values (the same amax, the same
 * product x * id rounded to nearest even by vcvtps2dq). */
static void quantize_block(const float *x, int8_t *q, int16_t *bsum, float *d)
{
    __m256 sign = _mm256_set1_ps(-0.0f), amax8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
    for (int i = 0; i < QM_Q8_BLOCK; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v));
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float amax = _mm_cvtss_f32(m);
    if (_mm256_movemask_ps(nan8) || !(amax <= 3.4028235e38f) || amax == 0.0f) {
        qm_q8_quantize_block(x, q, bsum, d); /* the rare cases, as the reference writes them */
        return;
    }
    __m256 id = _mm256_set1_ps(127.0f / amax);
    *d = amax / 127.0f;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < QM_Q8_BLOCK; i += 32) {
        __m256i v[4];
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * g), id));
        bsum[i / 16] = (int16_t)hsum_i32(_mm256_add_epi32(v[0], v[1]));
        bsum[i / 16 + 1] = (int16_t)hsum_i32(_mm256_add_epi32(v[2], v[3]));
        __m256i p =
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
}

void qt_acts_quantize_avx2(qt_acts *a)
{
    int64_t nblk = a->batch * a->cols / QM_Q8_BLOCK;
    for (int64_t k = 0; k < nblk; k++)
        quantize_block(a->x + k * QM_Q8_BLOCK, a->q + k * QM_Q8_BLOCK, a->bsum + k * 16, a->d + k);
}

/* --- the products ------------------------------------------------------------------ */

/* A shuffle that spreads int16 lane `lo` of a 128-bit half over the low
 * half of the result and lane `hi` over the high half. */
ALWAYS_INLINE __m256i spread16(int lo, int hi)
{
    return _mm256_setr_epi8((char)(2 * lo), (char)(2 * lo + 1), (char)(2 * lo), (char)(2 * lo + 1),
                            (char)(2 * lo), (char)(2 * lo + 1), (char)(2 * lo), (char)(2 * lo + 1),
                            (char)(2 * lo), (char)(2 * lo + 1), (char)(2 * lo), (char)(2 * lo + 1),
                            (char)(2 * lo), (char)(2 * lo + 1), (char)(2 * lo), (char)(2 * lo + 1),
                            (char)(2 * hi), (char)(2 * hi + 1), (char)(2 * hi), (char)(2 * hi + 1),
                            (char)(2 * hi), (char)(2 * hi + 1), (char)(2 * hi), (char)(2 * hi + 1),
                            (char)(2 * hi), (char)(2 * hi + 1), (char)(2 * hi), (char)(2 * hi + 1),
                            (char)(2 * hi), (char)(2 * hi + 1), (char)(2 * hi), (char)(2 * hi + 1));
}

/* The sums of the lanes of a and of b (one reduction for both). */
ALWAYS_INLINE void hsum2_i32(__m256i a, __m256i b, int32_t *sa, int32_t *sb)
{
    __m256i h = _mm256_hadd_epi32(a, b); /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s = _mm_hadd_epi32(s, s); /* a b a b */
    *sa = _mm_cvtsi128_si32(s);
    *sb = _mm_extract_epi32(s, 1);
}

/* The eight scales and the eight minimums of a Q4_K/Q5_K block as int16
 * lanes (qm_q8_k4_scales' values, in 64-bit words). */
ALWAYS_INLINE void k4_scales(const uint8_t *packed, __m128i *sc16, __m128i *mn16)
{
    uint32_t u[3];
    memcpy(u, packed, 12);
    uint32_t s_hi = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4;
    uint64_t sc = (uint64_t)(u[0] & 0x3f3f3f3fu) | (uint64_t)s_hi << 32;
    uint64_t mn = (uint64_t)(u[1] & 0x3f3f3f3fu) | (uint64_t)m_hi << 32;
    *sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc));
    *mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
}

/* Q4_K and Q5_K (five): weight row r against rows b0 .. b0 + nb of x. */
ALWAYS_INLINE void k4_row(const qtensor *t, const qt_acts *x, int64_t b0, int nb, float *y,
                          int64_t r, bool five)
{
    size_t bb = five ? QM_Q5_K_BYTES : QM_Q4_K_BYTES;
    int64_t cols = t->cols, nblk = cols / QM_QK_K;
    const uint8_t *blk = t->data + r * nblk * (int64_t)bb;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    float total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = 0.0f;
    for (int64_t k = 0; k < nblk; k++, blk += bb) {
        _mm_prefetch((const char *)blk + 1024, _MM_HINT_T0);
        __m128i sc16, mn16;
        k4_scales(blk + 4, &sc16, &mn16);
        __m256i scv = _mm256_broadcastsi128_si256(sc16);
        /* each minimum twice, against the two sums of 16 of its sub-block */
        __m256i mnd =
            _mm256_setr_m128i(_mm_unpacklo_epi16(mn16, mn16), _mm_unpackhi_epi16(mn16, mn16));
        const uint8_t *qs = blk + (five ? 48 : 16);
        __m256i qh =
            five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256i acc[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_si256();
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
        { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(raw, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (five) {
                lo = _mm256_or_si256(
                    lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
                hi = _mm256_or_si256(
                    hi,
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
            }
            __m256i s_lo = _mm256_shuffle_epi8(scv, spread16(2 * p, 2 * p));
            __m256i s_hi = _mm256_shuffle_epi8(scv, spread16(2 * p + 1, 2 * p + 1));
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
            {
                const int8_t *xq = x->q + (b0 + b) * cols + k * QM_QK_K + 64 * p;
                __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
                __m256i ph =
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32)));
                acc[b] = _mm256_add_epi32(acc[b], _mm256_add_epi32(_mm256_madd_epi16(pl, s_lo),
                                                                   _mm256_madd_epi16(ph, s_hi)));
            }
        }
        float d = qm_f16_le(blk), dmin = qm_f16_le(blk + 2);
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
        {
            int64_t at = (b0 + b) * cols + k * QM_QK_K;
            __m256i bs = _mm256_loadu_si256((const __m256i *)(x->bsum + at / 16));
            int32_t isum, msum;
            hsum2_i32(acc[b], _mm256_madd_epi16(bs, mnd), &isum, &msum);
            total[b] = qm_q8_k4_tail(total[b], x->d[at / QM_QK_K], d, dmin, isum, msum);
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[(b0 + b) * t->rows + r] = total[b];
}

/* Q6_K: weight row r against rows b0 .. b0 + nb of x. The codes are
 * unsigned (0..63) for vpmaddubsw; 32 times each sub-block's scale times
 * its sum of q, subtracted once per block, makes them the signed code - 32
 * (the same integer). */
ALWAYS_INLINE void q6_row(const qtensor *t, const qt_acts *x, int64_t b0, int nb, float *y,
                          int64_t r)
{
    int64_t cols = t->cols, nblk = cols / QM_QK_K;
    const uint8_t *blk = t->data + r * nblk * (int64_t)QM_Q6_K_BYTES;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3);
    float total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = 0.0f;
    for (int64_t k = 0; k < nblk; k++, blk += QM_Q6_K_BYTES) {
        _mm_prefetch((const char *)blk + 1024, _MM_HINT_T0);
        __m256i acc[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half;
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)ql);
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
            __m256i scv = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * half))));
            __m256i c[4];
            c[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            c[1] = _mm256_or_si256(
                _mm256_and_si256(ql1, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            c[2] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            c[3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            _Pragma("GCC unroll 4") for (int kk = 0; kk < 4; kk++)
            { /* elements 128 half + 32 kk ..: sub-blocks 8 half + 2 kk and + 1 */
                __m256i s = _mm256_shuffle_epi8(scv, spread16(2 * kk, 2 * kk + 1));
                _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
                {
                    __m256i xv =
                        _mm256_loadu_si256((const __m256i *)(x->q + (b0 + b) * cols + k * QM_QK_K +
                                                             128 * half + 32 * kk));
                    acc[b] = _mm256_add_epi32(
                        acc[b], _mm256_madd_epi16(_mm256_maddubs_epi16(c[kk], xv), s));
                }
            }
        }
        float d = qm_f16_le(blk + 208);
        /* the codes' offset: 32 times each sub-block's scale times its sum of q */
        __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
        {
            int64_t at = (b0 + b) * cols + k * QM_QK_K;
            __m256i bs = _mm256_loadu_si256((const __m256i *)(x->bsum + at / 16));
            int32_t isum, off;
            hsum2_i32(acc[b], _mm256_madd_epi16(bs, sc), &isum, &off);
            total[b] = qm_q8_q6_tail(total[b], x->d[at / QM_QK_K], d, isum - 32 * off);
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[(b0 + b) * t->rows + r] = total[b];
}

typedef void (*q8_row_fn)(const qtensor *t, const qt_acts *x, int64_t b0, int nb, float *y,
                          int64_t r);

ALWAYS_INLINE void row_q4_k(const qtensor *t, const qt_acts *x, int64_t b0, int nb, float *y,
                            int64_t r)
{
    k4_row(t, x, b0, nb, y, r, false);
}
ALWAYS_INLINE void row_q5_k(const qtensor *t, const qt_acts *x, int64_t b0, int nb, float *y,
                            int64_t r)
{
    k4_row(t, x, b0, nb, y, r, true);
}

/* Rows [row0, row1) of W against every row of x, in chunks of XCHUNK rows
 * of x; row and nb are constants in each expansion. */
ALWAYS_INLINE void q8_chunks(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                             int64_t row1, q8_row_fn row)
{
    for (int64_t b0 = 0; b0 < x->batch; b0 += XCHUNK) {
        int nb = (int)(x->batch - b0 < XCHUNK ? x->batch - b0 : XCHUNK);
        switch (nb) {
        case 1:
            for (int64_t r = row0; r < row1; r++)
                row(t, x, b0, 1, y, r);
            break;
        case 2:
            for (int64_t r = row0; r < row1; r++)
                row(t, x, b0, 2, y, r);
            break;
        case 3:
            for (int64_t r = row0; r < row1; r++)
                row(t, x, b0, 3, y, r);
            break;
        default:
            for (int64_t r = row0; r < row1; r++)
                row(t, x, b0, 4, y, r);
            break;
        }
    }
}

void qt_matmul_q8_q4_k_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1)
{
    q8_chunks(t, x, y, row0, row1, row_q4_k);
}

void qt_matmul_q8_q5_k_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1)
{
    q8_chunks(t, x, y, row0, row1, row_q5_k);
}

void qt_matmul_q8_q6_k_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1)
{
    q8_chunks(t, x, y, row0, row1, q6_row);
}

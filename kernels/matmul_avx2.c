/*
 * matmul_avx2.c - the AVX2+FMA entry points of the traits table: for each
 * kind with a fast path, its matrix kernel y = x @ W^T (qt_matmul_<kind>_avx2)
 * and its row dequantization (qt_dequantize_rows_<kind>_avx2), plus
 * qt_attend's AVX2 path. It owns no state; it reads qtensors and writes the
 * caller's output.
 *
 * Shape of the kernel: for a chunk of up to 4 rows of x, walk W one row at a
 * time; decode that row with AVX2 (codebook lookups by permutevar, nibble
 * unpacking, f16 conversion) into registers or an L1 tile, and FMA it
 * against each row of x in the chunk, so each weight byte is read and
 * decoded once per 4 rows of x. Each row of x goes through the same
 * operations whatever the batch (see rows_tiled), so batching never
 * changes a result. The decoded values are bit-identical to the kind's scalar
 * dequantization (same operations in the same order; the build turns off
 * FP contraction); only the order of the dot-product sums differs from the
 * reference, which the tests bound.
 *
 * Which kernel a kind gets is decided once, by its row of the traits table
 * (traits.c); nothing here switches on the kind. Each entry point hands a
 * shared always-inlined driver (matmul_chunks) its kind's row function and
 * tile decoder as constants, so every kind still gets its own loop with no
 * choice left inside.
 *
 * It calls down only: into qtensor.c (the kinds' geometry), quant_bnb4.c
 * (qt_block_absmax) and attend_ref.c (qt_attend_ref, for head dimensions
 * the fast loop does not cover); never back into the table. It touches
 * kernels/math/ (qt_math.h, qt_quant_math.h's dequantizing section for
 * Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4, ops_math.h).
 *
 * This file is compiled with -mavx2 -mfma -mf16c and only reached when the
 * CPU reports those features (traits.c).
 */
#include "avx2_shared.h"
#include "kernels_internal.h"
#include "ops_math.h"
#include "qt_math.h"
#include "qt_quant_math.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define TILE 512 /* columns decoded at a time: 2 KiB of f32, stays in L1 */

/* 16 packed 4-bit codes (8 bytes, even element in the high nibble) as two
 * vectors of 8 int32 codes, in element order. */
static inline void unpack16_hi_first(const uint8_t *p, __m256i *c0, __m256i *c1)
{
    __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i inter = _mm_unpacklo_epi8(hi, lo);
    *c0 = _mm256_cvtepu8_epi32(inter);
    *c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(inter, 8));
}

/* table[code] for 8 codes in 0..15, the table split into two halves of 8. */
static inline __m256 lookup16(__m256 lo_half, __m256 hi_half, __m256i codes)
{
    __m256 a = _mm256_permutevar8x32_ps(lo_half, codes);
    __m256 b = _mm256_permutevar8x32_ps(hi_half, codes);
    __m256 use_hi = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));
    return _mm256_blendv_ps(a, b, use_hi);
}

/* x[0..16) as its 8 even elements and its 8 odd ones. */
static inline void bnb4_split16(const float *x, __m256 *even, __m256 *odd)
{
    __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    /* per 128-bit lane: a0 a2 b0 b2 | a4 a6 b4 b6, then 64-bit pairs reordered */
    __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* x's rows as rows_bnb4_split reads them: each group of 16 as its even
 * elements then its odd ones. */
static void bnb4_split(const float *x, int64_t cols, int nb, float *xd)
{
    for (int64_t i = 0; i < (int64_t)nb * cols; i += 16) {
        __m256 even, odd;
        bnb4_split16(x + i, &even, &odd);
        _mm256_store_ps(xd + i, even);
        _mm256_store_ps(xd + i + 8, odd);
    }
}

/* Elements [e, e + n) of a bitsandbytes 4-bit tensor, flat indices. */
static void decode_bnb4(const qtensor *t, int64_t e, int64_t n, float *out)
{
    __m256 cb_lo = _mm256_loadu_ps(t->codebook);
    __m256 cb_hi = _mm256_loadu_ps(t->codebook + 8);
    int64_t end = e + n, bs = t->blocksize;
    while (e < end) {
        int64_t blk = e / bs;
        int64_t span_end = (blk + 1) * bs < end ? (blk + 1) * bs : end;
        float am = qt_block_absmax(t, blk);
        __m256 vam = _mm256_set1_ps(am);
        if (e & 1) { /* odd start: its byte's low nibble alone */
            *out++ = qm_4bit_value(t->codebook, qm_nibble(t->data, e), am);
            e++;
        }
        for (; e + 16 <= span_end; e += 16, out += 16) {
            __m256i c0, c1;
            unpack16_hi_first(t->data + (e >> 1), &c0, &c1);
            _mm256_storeu_ps(out, _mm256_mul_ps(lookup16(cb_lo, cb_hi, c0), vam));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(lookup16(cb_lo, cb_hi, c1), vam));
        }
        for (; e < span_end; e++)
            *out++ = qm_4bit_value(t->codebook, qm_nibble(t->data, e), am);
    }
}

/* Columns [c, c + n) of row r of an AFFINE tensor. */
static void decode_affine(const qtensor *t, int64_t r, int64_t c, int64_t n, float *out)
{
    const uint8_t *row = t->data + r * t->row_stride;
    int64_t end = c + n, gs = t->group_size;
    float mid = (float)(t->qmax + t->qmin + 1) / 2.0f;
    bool int_zero = t->zero_domain == QT_ZERO_INT;
    while (c < end) {
        int64_t g = c / gs;
        int64_t span_end = (g + 1) * gs < end ? (g + 1) * gs : end;
        float scale = t->scales[r * t->groups_per_row + g];
        float zero = t->zeros[r * t->groups_per_row + g];
        /* integer domain: (u + qmin - zero) exactly in int32, then * scale;
         * float domain: ((u + qmin) - mid) * scale + zero */
        int offset = int_zero ? t->qmin - (int)zero : t->qmin;
        __m256i voff = _mm256_set1_epi32(offset);
        __m256 vscale = _mm256_set1_ps(scale), vmid = _mm256_set1_ps(mid),
               vzero = _mm256_set1_ps(zero);
#define AFFINE_STORE(codes, dst)                                                                   \
    do {                                                                                           \
        __m256 q = _mm256_cvtepi32_ps(_mm256_add_epi32((codes), voff));                            \
        __m256 w = int_zero ? _mm256_mul_ps(q, vscale)                                             \
                            : _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, vmid), vscale), vzero); \
        _mm256_storeu_ps((dst), w);                                                                \
    } while (0)
        if (t->bits == 8) {
            for (; c + 8 <= span_end; c += 8, out += 8) {
                __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + c)));
                AFFINE_STORE(codes, out);
            }
        } else {
            if ((c & 1) && c < span_end) {
                int q = (int)qm_nibble(row, c) + offset;
                *out++ = int_zero ? (float)q * scale : ((float)q - mid) * scale + zero;
                c++;
            }
            for (; c + 16 <= span_end; c += 16, out += 16) {
                __m256i c0, c1;
                unpack16_hi_first(row + (c >> 1), &c0, &c1);
                AFFINE_STORE(c0, out);
                AFFINE_STORE(c1, out + 8);
            }
        }
#undef AFFINE_STORE
        for (; c < span_end; c++) {
            unsigned u = t->bits == 8 ? row[c] : qm_nibble(row, c);
            int q = (int)u + offset;
            *out++ = int_zero ? (float)q * scale : ((float)q - mid) * scale + zero;
        }
    }
}

/* A GGUF block's f16 at p in every lane, by the F16C instruction (exact,
 * as qm_f16_to_f32). */
ALWAYS_INLINE __m256 gguf_f16x8(const uint8_t *p)
{
    int16_t h;
    memcpy(&h, p, sizeof h); /* little-endian, as the file */
    return _mm256_cvtph_ps(_mm_set1_epi16(h));
}

/* The 32 codes of a 4- or 5-bit GGUF block (qs: byte j holds element j
 * low, element j + 16 high; qh, for Q5_0/Q5_1, bit j the fifth bit of
 * element j, or NULL) plus bias, as f32 in element order. Each 8 bytes
 * widen straight from memory to 8 lanes, which hold both their low
 * nibbles (masked) and their high ones (shifted). */
ALWAYS_INLINE void gguf_nibbles(const uint8_t *qs, const uint8_t *qh, int bias, __m256 q[4])
{
    __m256i mask = _mm256_set1_epi32(0x0f);
    __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    __m256i c[4] = {_mm256_and_si256(v0, mask), _mm256_and_si256(v1, mask),
                    _mm256_srli_epi32(v0, 4), _mm256_srli_epi32(v1, 4)};
    if (qh) { /* lane i of group j takes bit 8j + i of qh, as bit 4 */
        uint32_t h;
        memcpy(&h, qh, sizeof h); /* little-endian, as the file */
        __m256i vh = _mm256_set1_epi32((int)h), one = _mm256_set1_epi32(1);
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int j = 0; j < 4; j++) {
            __m256i bit = _mm256_and_si256(
                _mm256_srlv_epi32(vh, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * j))), one);
            c[j] = _mm256_or_si256(c[j], _mm256_slli_epi32(bit, 4));
        }
    }
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(bias ? _mm256_add_epi32(c[j], _mm256_set1_epi32(bias)) : c[j]);
}

/* The 32 levels of an IQ4_NL block, IQ4_XS sub-block or MXFP4 block (16
 * bytes of qs, byte j holding element j low and j + 16 high) as f32 in
 * element order: each nibble looks its level up in the kind's 16-byte
 * table (levels) by pshufb, then the int8 levels widen. */
static const int8_t iq4nl_levels[16] = QM_IQ4NL_LEVELS_INIT;
static const int8_t mxfp4_levels[16] = QM_MXFP4_LEVELS_INIT;
ALWAYS_INLINE void levels32(const int8_t *levels, const uint8_t *qs, __m256 q[4])
{
    __m128i table = _mm_loadu_si128((const __m128i *)levels);
    __m128i bytes = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, mask));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* Whether a GGUF kind of blocks of 32 stores a minimum (w = q * d + m). */
ALWAYS_INLINE bool gguf_has_min(qt_kind kind)
{
    return kind == QT_Q4_1 || kind == QT_Q5_1;
}

/* GGUF block blk of kind (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, MXFP4):
 * its 32 integer codes (IQ4_NL, MXFP4: levels) as f32 in element order
 * (q), its scale d (MXFP4: 2^(e - 128) from its E8M0 byte, not an f16)
 * and, for Q4_1 and Q5_1, its minimum m, each in every lane. */
ALWAYS_INLINE void gguf_block(const uint8_t *blk, qt_kind kind, __m256 q[4], __m256 *d, __m256 *m)
{
    if (kind == QT_MXFP4) {
        *d = _mm256_set1_ps(qm_e8m0_half(blk[0]));
        levels32(mxfp4_levels, blk + 1, q);
        *m = _mm256_setzero_ps();
        return;
    }
    *d = gguf_f16x8(blk);
    if (kind == QT_Q8_0)
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * j))));
    else if (kind == QT_Q5_0)
        gguf_nibbles(blk + 6, blk + 2, -16, q);
    else if (kind == QT_Q5_1)
        gguf_nibbles(blk + 8, blk + 4, 0, q);
    else if (kind == QT_IQ4_NL)
        levels32(iq4nl_levels, blk + 2, q);
    else
        gguf_nibbles(blk + (kind == QT_Q4_1 ? 4 : 2), NULL, kind == QT_Q4_1 ? 0 : -8, q);
    *m = gguf_has_min(kind) ? gguf_f16x8(blk + 2) : _mm256_setzero_ps();
}

/* Blocks [b, b + nb) of GGUF kind `kind` (the tensor's, as a constant),
 * 32 elements each. */
ALWAYS_INLINE void decode_gguf(const qtensor *t, int64_t b, int64_t nb, float *out, qt_kind kind)
{
    size_t bb = qt_kind_geometry_table[kind].block_bytes;
    for (int64_t i = 0; i < nb; i++, out += 32) {
        __m256 q[4], d, m;
        gguf_block(t->data + (b + i) * bb, kind, q, &d, &m);
        for (int j = 0; j < 4; j++) {
            __m256 w = _mm256_mul_ps(q[j], d);
            if (gguf_has_min(kind)) /* only these add: + 0 would turn -0 into +0 */
                w = _mm256_add_ps(w, m);
            _mm256_storeu_ps(out + 8 * j, w);
        }
    }
}

/* 8 bytes at p widened to 8 int32 lanes. */
ALWAYS_INLINE __m256i widen8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* w = d1 * code - m1 for 8 codes, the scalar qm_k4_value's two steps. */
ALWAYS_INLINE void store_k4(float *out, __m256i code, float d1, float m1)
{
    __m256 scaled = _mm256_mul_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(code));
    _mm256_storeu_ps(out, _mm256_sub_ps(scaled, _mm256_set1_ps(m1)));
}

/* One Q4_K (qh NULL) or Q5_K super-block of 256 into out: per 64
 * elements, 32 bytes of qs whose low nibbles are the first sub-block of 32
 * and whose high nibbles the second; Q5_K's fifth bits are bits 2c and
 * 2c + 1 of qh[0..32) for the c-th 64. */
ALWAYS_INLINE void decode_k4_block(const uint8_t *blk, bool five, float *out)
{
    const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
    __m256i mask = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    float d = qt_f16_le_avx2(blk), dmin = qt_f16_le_avx2(blk + 2);
    for (int c = 0; c < 4; c++, qs += 32, out += 64) {
        /* d * sc and dmin * m, as qm_k4_sub_scales rounds them */
        int sc0, mn0, sc1, mn1;
        qm_k4_scale_min(2 * c, blk + 4, &sc0, &mn0);
        qm_k4_scale_min(2 * c + 1, blk + 4, &sc1, &mn1);
        float d1 = d * (float)sc0, m1 = dmin * (float)mn0;
        float d2 = d * (float)sc1, m2 = dmin * (float)mn1;
        for (int g = 0; g < 4; g++) {
            __m256i v = widen8(qs + 8 * g);
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi32(v, 4);
            if (five) {
                __m256i h = widen8(qh + 8 * g);
                __m256i b0 = _mm256_and_si256(_mm256_srli_epi32(h, 2 * c), one);
                __m256i b1 = _mm256_and_si256(_mm256_srli_epi32(h, 2 * c + 1), one);
                lo = _mm256_add_epi32(lo, _mm256_slli_epi32(b0, 4));
                hi = _mm256_add_epi32(hi, _mm256_slli_epi32(b1, 4));
            }
            store_k4(out + 8 * g, lo, d1, m1);
            store_k4(out + 32 + 8 * g, hi, d2, m2);
        }
    }
}

/* One Q6_K super-block of 256 into out: in each half of 128 (ql 64 bytes,
 * qh 32), the k-th 32 take the low nibbles of ql[0..32) (k 0), of
 * ql[32..64) (k 1), their high nibbles (k 2, 3), with bits 2k, 2k + 1 of
 * qh as the top two; w = (d * sc) * (q - 32). */
ALWAYS_INLINE void decode_q6_k_block(const uint8_t *blk, float *out)
{
    __m256i mask = _mm256_set1_epi32(0x0f), three = _mm256_set1_epi32(3),
            bias = _mm256_set1_epi32(32);
    /* d * sc of the 16 sub-blocks, each as qm_q6_k_sub_scale rounds it,
     * with d converted once */
    float d = qt_f16_le_avx2(blk + 208), scale[16];
    for (int s = 0; s < 16; s++)
        scale[s] = d * (float)(int8_t)blk[192 + s];
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
        for (int k = 0; k < 4; k++)
            for (int g = 0; g < 4; g++) {
                __m256i v = widen8(ql + (k & 1 ? 32 : 0) + 8 * g);
                __m256i lo = k < 2 ? _mm256_and_si256(v, mask) : _mm256_srli_epi32(v, 4);
                __m256i h = _mm256_and_si256(_mm256_srli_epi32(widen8(qh + 8 * g), 2 * k), three);
                __m256i code = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(h, 4)), bias);
                float sc = scale[8 * half + 2 * k + g / 2];
                _mm256_storeu_ps(out + 128 * half + 32 * k + 8 * g,
                                 _mm256_mul_ps(_mm256_set1_ps(sc), _mm256_cvtepi32_ps(code)));
            }
    }
}

/* 8 2-bit fields (bits shift, shift + 1 of the 8 bytes at p) as int32. */
ALWAYS_INLINE __m256i crumbs8(const uint8_t *p, int shift)
{
    return _mm256_and_si256(_mm256_srli_epi32(widen8(p), shift), _mm256_set1_epi32(3));
}

/* One Q2_K super-block of 256 into out: in each half of 128 (32 bytes of
 * qs), the k-th 32 are bits 2k, 2k + 1 of each byte; sub-block s of 16
 * has d1 = d * sc, m1 = dmin * m (qm_q2_k_sub_scales), w = d1 * q - m1. */
ALWAYS_INLINE void decode_q2_k_block(const uint8_t *blk, float *out)
{
    float d = qt_f16_le_avx2(blk + 80), dmin = qt_f16_le_avx2(blk + 82);
    for (int half = 0; half < 2; half++)
        for (int k = 0; k < 4; k++)
            for (int g = 0; g < 4; g++) {
                int sc = blk[8 * half + 2 * k + g / 2];
                store_k4(out + 128 * half + 32 * k + 8 * g,
                         crumbs8(blk + 16 + 32 * half + 8 * g, 2 * k), d * (float)(sc & 0xF),
                         dmin * (float)(sc >> 4));
            }
}

/* 8 signed Q3_K codes: the 2-bit fields (bits 2k, 2k + 1 of qs), minus 4
 * where bit `hbit` of hmask is clear. */
ALWAYS_INLINE __m256i q3_k_codes8(const uint8_t *qs, const uint8_t *hmask, int k, int hbit)
{
    __m256i h = _mm256_and_si256(_mm256_srli_epi32(widen8(hmask), hbit), _mm256_set1_epi32(1));
    return _mm256_sub_epi32(_mm256_or_si256(crumbs8(qs, 2 * k), _mm256_slli_epi32(h, 2)),
                            _mm256_set1_epi32(4));
}

/* The 16 sub-block scales d * sc of a Q3_K block, as qm_q3_k_sub_scale
 * rounds them, d converted once. */
ALWAYS_INLINE void q3_k_scales(const uint8_t *blk, float scale[16])
{
    float d = qt_f16_le_avx2(blk + 108);
    for (int s = 0; s < 16; s++)
        scale[s] = d * (float)qm_q3_k_scale(blk, s);
}

/* One Q3_K super-block of 256 into out: element 128 h + 32 k + l takes
 * q3_k_codes8's code from qs[32 h + l] and bit 4h + k of hmask[l];
 * w = (d * sc) * q. */
ALWAYS_INLINE void decode_q3_k_block(const uint8_t *blk, float *out)
{
    float scale[16];
    q3_k_scales(blk, scale);
    for (int half = 0; half < 2; half++)
        for (int k = 0; k < 4; k++)
            for (int g = 0; g < 4; g++) {
                __m256i code =
                    q3_k_codes8(blk + 32 + 32 * half + 8 * g, blk + 8 * g, k, 4 * half + k);
                float sc = scale[8 * half + 2 * k + g / 2];
                _mm256_storeu_ps(out + 128 * half + 32 * k + 8 * g,
                                 _mm256_mul_ps(_mm256_set1_ps(sc), _mm256_cvtepi32_ps(code)));
            }
}

/* One IQ4_XS super-block of 256 into out: sub-block s of 32 is the levels
 * of qs[16 s ..] times d * sc (qm_iq4_xs_sub_scale). */
ALWAYS_INLINE void decode_iq4_xs_block(const uint8_t *blk, float *out)
{
    float d = qt_f16_le_avx2(blk);
    for (int s = 0; s < 8; s++, out += 32) {
        __m256 q[4], dl = _mm256_set1_ps(d * (float)qm_iq4_xs_scale(blk, s));
        levels32(iq4nl_levels, blk + 8 + 16 * s, q);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(dl, q[j]));
    }
}

/* Super-blocks [b, b + nb) of k-quant (or IQ4_XS) kind `kind` (a
 * constant), 256 elements each. */
ALWAYS_INLINE void decode_kquant(const qtensor *t, int64_t b, int64_t nb, float *out, qt_kind kind)
{
    size_t bb = qt_kind_geometry_table[kind].block_bytes;
    for (int64_t i = 0; i < nb; i++, out += 256) {
        const uint8_t *blk = t->data + (b + i) * bb;
        if (kind == QT_Q6_K)
            decode_q6_k_block(blk, out);
        else if (kind == QT_Q2_K)
            decode_q2_k_block(blk, out);
        else if (kind == QT_Q3_K)
            decode_q3_k_block(blk, out);
        else if (kind == QT_IQ4_XS)
            decode_iq4_xs_block(blk, out);
        else
            decode_k4_block(blk, kind == QT_Q5_K, out);
    }
}

/*
 * The tile decoders, one per kind: columns [c, c + n) of row r as f32, a
 * pointer into the tensor for F32, else decoded into tile. rows_tiled and
 * dequantize_tiles take one as a constant.
 */
typedef const float *(*tile_decoder)(const qtensor *t, int64_t r, int64_t c, int64_t n,
                                     float *tile);

static const float *tile_f32(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)
{
    (void)n;
    (void)tile;
    return (const float *)t->data + r * t->cols + c;
}

static const float *tile_f16(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)
{
    const uint16_t *h = (const uint16_t *)t->data + r * t->cols + c;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(tile + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        tile[i] = qm_f16_to_f32(h[i]);
    return tile;
}

static const float *tile_bf16(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)
{
    const uint16_t *h = (const uint16_t *)t->data + r * t->cols + c;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        _mm256_storeu_ps(tile + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; i++)
        tile[i] = qm_bf16_to_f32(h[i]);
    return tile;
}

static const float *tile_bnb4(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)
{
    decode_bnb4(t, r * t->cols + c, n, tile);
    return tile;
}

static const float *tile_affine(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)
{
    decode_affine(t, r, c, n, tile);
    return tile;
}

/* GGUF tiles start on multiples of TILE (or of the row) and rows are whole
 * blocks, so a tile is whole blocks too. */
#define GGUF_TILE(name, kind)                                                                      \
    static const float *name(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)       \
    {                                                                                              \
        decode_gguf(t, (r * t->cols + c) / 32, n / 32, tile, kind);                                \
        return tile;                                                                               \
    }
GGUF_TILE(tile_q4_0, QT_Q4_0)
GGUF_TILE(tile_q4_1, QT_Q4_1)
GGUF_TILE(tile_q8_0, QT_Q8_0)
GGUF_TILE(tile_q5_0, QT_Q5_0)
GGUF_TILE(tile_q5_1, QT_Q5_1)
GGUF_TILE(tile_iq4_nl, QT_IQ4_NL)
GGUF_TILE(tile_mxfp4, QT_MXFP4)

/* k-quant tiles: TILE is a multiple of 256 and rows are whole
 * super-blocks, so a tile is whole super-blocks too. */
#define KQUANT_TILE(name, kind)                                                                    \
    static const float *name(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)       \
    {                                                                                              \
        decode_kquant(t, (r * t->cols + c) / 256, n / 256, tile, kind);                            \
        return tile;                                                                               \
    }
KQUANT_TILE(tile_q4_k, QT_Q4_K)
KQUANT_TILE(tile_q5_k, QT_Q5_K)
KQUANT_TILE(tile_q6_k, QT_Q6_K)
KQUANT_TILE(tile_q2_k, QT_Q2_K)
KQUANT_TILE(tile_q3_k, QT_Q3_K)
KQUANT_TILE(tile_iq4_xs, QT_IQ4_XS)

/*
 * The matrix kernels proper. Every row of x goes through the same
 * arithmetic whatever else is in the batch: the same accumulators, the
 * same order, the same place where a block's scale multiplies its partial
 * sum. So a sequence gets bit-identical logits alone or batched, which the
 * engine relies on (a merge never changes a running answer; greedy tokens
 * do not depend on the neighbours). The batch only shares the decoding.
 * The row functions are always inlined into a switch on the batch size so
 * that every accumulator lives in a register.
 */
#define XCHUNK     4 /* rows of x per pass: 2 accumulators each + temporaries fit 16 ymm */
#define TILE_BYTES (128 * 1024) /* weight rows per tile (matmul_chunks) */

/* acc (two chains, alternating 8-wide groups) += w[0..n16) . x_b[0..n16),
 * n16 a multiple of 16. */
ALWAYS_INLINE void dot16(const float *w, const float *const *xs, int nb, int64_t n16, __m256 *a0,
                         __m256 *a1)
{
    for (int64_t i = 0; i < n16; i += 16) {
        __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
        {
            a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[b] + i), a0[b]);
            a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[b] + i + 8), a1[b]);
        }
    }
}

/* Dense and AFFINE rows: decode a tile to f32 (decode, a constant), then
 * dot. */
ALWAYS_INLINE void rows_tiled(const qtensor *t, const float *x, int nb, float *y, int64_t r,
                              tile_decoder decode)
{
    _Alignas(32) float tile[TILE];
    int64_t cols = t->cols;
    __m256 a0[XCHUNK], a1[XCHUNK];
    float tail[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
    {
        a0[b] = a1[b] = _mm256_setzero_ps();
        tail[b] = 0.0f;
    }
    for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
        int64_t n = cols - c0 < TILE ? cols - c0 : TILE;
        const float *w = decode(t, r, c0, n, tile);
        const float *xs[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) xs[b] = x + b * cols + c0;
        int64_t n16 = n & ~(int64_t)15;
        dot16(w, xs, nb, n16, a0, a1);
        for (int64_t i = n16; i < n; i++)
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) tail[b] += w[i] * xs[b][i];
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] =
        qt_hsum8(_mm256_add_ps(a0[b], a1[b])) + tail[b];
}

/* NF4/FP4 rows: codebook values decoded in registers, each block's partial
 * sum scaled once by its absmax. */
ALWAYS_INLINE void rows_bnb4(const qtensor *t, const float *x, int nb, float *y, int64_t r)
{
    __m256 cb_lo = _mm256_loadu_ps(t->codebook);
    __m256 cb_hi = _mm256_loadu_ps(t->codebook + 8);
    int64_t e0 = r * t->cols, e = e0, end = e0 + t->cols, bs = t->blocksize;
    __m256 total[XCHUNK];
    float tail[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
    {
        total[b] = _mm256_setzero_ps();
        tail[b] = 0.0f;
    }
    while (e < end) {
        int64_t blk = e / bs;
        int64_t span_end = (blk + 1) * bs < end ? (blk + 1) * bs : end;
        float am = qt_block_absmax(t, blk);
        if (e & 1) { /* odd start: its byte's low nibble alone */
            float w = qm_4bit_value(t->codebook, qm_nibble(t->data, e), am);
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) tail[b] +=
                w * x[b * t->cols + (e - e0)];
            e++;
        }
        __m256 a0[XCHUNK], a1[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) a0[b] = a1[b] = _mm256_setzero_ps();
        for (; e + 16 <= span_end; e += 16) {
            __m256i c0, c1;
            unpack16_hi_first(t->data + (e >> 1), &c0, &c1);
            __m256 w0 = lookup16(cb_lo, cb_hi, c0), w1 = lookup16(cb_lo, cb_hi, c1);
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
            {
                const float *xb = x + b * t->cols + (e - e0);
                a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), a0[b]);
                a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), a1[b]);
            }
        }
        __m256 vam = _mm256_set1_ps(am);
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] =
            _mm256_fmadd_ps(_mm256_add_ps(a0[b], a1[b]), vam, total[b]);
        for (; e < span_end; e++) {
            float w = qm_4bit_value(t->codebook, qm_nibble(t->data, e), am);
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) tail[b] +=
                w * x[b * t->cols + (e - e0)];
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] =
        qt_hsum8(total[b]) + tail[b];
}

/* NF4/FP4 rows whose blocks hold whole groups of 16 (cols and blocksize
 * multiples of 16; every real model). Each 8 code bytes widen straight
 * from memory to 8 lanes holding the even element's code (high nibble)
 * and the odd one's (low nibble), so x is taken split the same way: xd
 * holds each group of 16 as its 8 even elements then its 8 odd ones
 * (bnb4_split), or NULL to split inline (the same values). */
ALWAYS_INLINE void rows_bnb4_split(const qtensor *t, const float *x, const float *xd, int nb,
                                   float *y, int64_t r)
{
    __m256 cb_lo = _mm256_loadu_ps(t->codebook);
    __m256 cb_hi = _mm256_loadu_ps(t->codebook + 8);
    __m256i mask = _mm256_set1_epi32(0x0f);
    int64_t cols = t->cols, bs = t->blocksize, e0 = r * cols;
    __m256 total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    for (int64_t e = e0; e < e0 + cols;) {
        int64_t blk = e / bs, span_end = (blk + 1) * bs < e0 + cols ? (blk + 1) * bs : e0 + cols;
        float am = t->nested ? qm_nested_absmax(t->absmax_codes, t->nested_code, t->nested_absmax,
                                                t->nested_blocksize, t->nested_offset, blk)
                             : t->absmax[blk];
        __m256 a0[XCHUNK], a1[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) a0[b] = a1[b] = _mm256_setzero_ps();
        for (; e < span_end; e += 16) { /* a block's part of the row: whole groups */
            const uint8_t *p = t->data + (e >> 1);
            _mm_prefetch((const char *)p + 512, _MM_HINT_T0);
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
            __m256 w_even = lookup16(cb_lo, cb_hi, _mm256_srli_epi32(v, 4));
            __m256 w_odd = lookup16(cb_lo, cb_hi, _mm256_and_si256(v, mask));
            int64_t c = e - e0;
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
            {
                __m256 x_even, x_odd;
                if (xd) {
                    x_even = _mm256_load_ps(xd + b * cols + c);
                    x_odd = _mm256_load_ps(xd + b * cols + c + 8);
                } else {
                    bnb4_split16(x + b * cols + c, &x_even, &x_odd);
                }
                a0[b] = _mm256_fmadd_ps(w_even, x_even, a0[b]);
                a1[b] = _mm256_fmadd_ps(w_odd, x_odd, a1[b]);
            }
        }
        __m256 vam = _mm256_set1_ps(am);
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] =
            _mm256_fmadd_ps(_mm256_add_ps(a0[b], a1[b]), vam, total[b]);
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] = qt_hsum8(total[b]);
}

/* A Q4_1 block's sum of x, 8 lanes: its four groups of 8 as
 * (x0 + x1) + (x2 + x3). block_sums and rows_gguf both make it here. */
ALWAYS_INLINE __m256 sum4(__m256 x0, __m256 x1, __m256 x2, __m256 x3)
{
    return _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
}

/* GGUF rows: per block of 32 the integer codes times x, scaled once by d
 * (and Q4_1's minimum times the sum of x, in its own accumulator so that
 * each block adds one link, not two, to either chain of dependent adds). */
ALWAYS_INLINE void rows_gguf(const qtensor *t, const float *x, const float *xsum, int nb, float *y,
                             int64_t r, qt_kind kind)
{
    size_t bb = qt_kind_geometry_table[kind].block_bytes;
    int64_t n_blocks = t->cols / 32;
    const uint8_t *blk = t->data + r * n_blocks * (int64_t)bb;
    bool q41 = gguf_has_min(kind);
    __m256 total[XCHUNK], mtotal[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = mtotal[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_blocks; k++, blk += bb) {
        /* a kilobyte ahead: measured 5-10% faster decode on a model larger than L3 */
        _mm_prefetch((const char *)blk + 1024, _MM_HINT_T0);
        __m256 w[4], d, m;
        gguf_block(blk, kind, w, &d, &m);
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
        {
            const float *xb = x + b * t->cols + k * 32;
            __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            /* two short chains rather than one of four */
            __m256 acc = _mm256_add_ps(_mm256_fmadd_ps(w[1], x1, _mm256_mul_ps(w[0], x0)),
                                       _mm256_fmadd_ps(w[3], x3, _mm256_mul_ps(w[2], x2)));
            total[b] = _mm256_fmadd_ps(acc, d, total[b]);
            if (q41) /* Q4_1, Q5_1: w = q * d + m, the minimum times the sum of x */
                mtotal[b] = _mm256_fmadd_ps(xsum ? _mm256_load_ps(xsum + (b * n_blocks + k) * 8)
                                                 : sum4(x0, x1, x2, x3),
                                            m, mtotal[b]);
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] =
        q41 ? qt_hsum8(_mm256_add_ps(total[b], mtotal[b])) : qt_hsum8(total[b]);
}

/* acc[b] += the 8 codes (f32) q times x_b[0..8), for nb rows of x. */
ALWAYS_INLINE void dot8(__m256 q, const float *const *xs, int64_t at, int nb, __m256 *acc)
{
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] =
        _mm256_fmadd_ps(q, _mm256_loadu_ps(xs[b] + at), acc[b]);
}

/*
 * Q4_K and Q5_K rows, fused: per sub-block of 32, the integer codes times
 * x in one chain, then d1 times that minus m1 times the sub-block's sum of
 * x, into one accumulator per row of x (w = d1 * q - m1; one accumulator
 * keeps 4 rows of x in registers). Only the order of the sums differs
 * from dequantize-then-dot.
 */
ALWAYS_INLINE void rows_k4(const qtensor *t, const float *x, int nb, float *y, int64_t r, bool five)
{
    size_t bb = five ? QM_Q5_K_BYTES : QM_Q4_K_BYTES;
    int64_t n_blocks = t->cols / 256;
    const uint8_t *blk = t->data + r * n_blocks * (int64_t)bb;
    __m256i mask = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    __m256 total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_blocks; k++, blk += bb) {
        qt_prefetch_block(blk, bb);
        float d = qt_f16_le_avx2(blk), dmin = qt_f16_le_avx2(blk + 2);
        const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        const float *xs[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) xs[b] = x + b * t->cols + k * 256;
        for (int s = 0; s < 8; s++) { /* sub-block s: qs[32 * (s / 2) ..], low or high nibbles */
            int sc, mn;
            qm_k4_scale_min(s, blk + 4, &sc, &mn);
            const uint8_t *q = qs + 32 * (s / 2);
            int shift = (s & 1) * 4;
            __m256 acc[XCHUNK], acc2[XCHUNK]; /* two chains: even and odd groups of 8 */
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] = acc2[b] =
                _mm256_setzero_ps();
            for (int g = 0; g < 4; g++) {
                __m256i c = _mm256_and_si256(_mm256_srli_epi32(widen8(q + 8 * g), shift), mask);
                if (five) /* bit s of qh[l] */
                    c = _mm256_add_epi32(
                        c, _mm256_slli_epi32(
                               _mm256_and_si256(_mm256_srli_epi32(widen8(qh + 8 * g), s), one), 4));
                dot8(_mm256_cvtepi32_ps(c), xs, 32 * s + 8 * g, nb, g & 1 ? acc2 : acc);
            }
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] =
                _mm256_add_ps(acc[b], acc2[b]);
            __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)mn);
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
            {
                const float *xb = xs[b] + 32 * s;
                __m256 sx = sum4(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8),
                                 _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24));
                total[b] = _mm256_fnmadd_ps(sx, m1, _mm256_fmadd_ps(acc[b], d1, total[b]));
            }
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] = qt_hsum8(total[b]);
}

/* Q6_K rows, fused: per sub-block of 16, the signed codes times x, then
 * times that sub-block's d * sc. */
ALWAYS_INLINE void rows_q6_k(const qtensor *t, const float *x, int nb, float *y, int64_t r)
{
    int64_t n_blocks = t->cols / 256;
    const uint8_t *blk = t->data + r * n_blocks * (int64_t)QM_Q6_K_BYTES;
    __m256i mask = _mm256_set1_epi32(0x0f), three = _mm256_set1_epi32(3),
            bias = _mm256_set1_epi32(32);
    __m256 total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_blocks; k++, blk += QM_Q6_K_BYTES) {
        qt_prefetch_block(blk, QM_Q6_K_BYTES);
        float d = qt_f16_le_avx2(blk + 208);
        const float *xs[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) xs[b] = x + b * t->cols + k * 256;
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            for (int kk = 0; kk < 4; kk++)
                for (int g2 = 0; g2 < 2; g2++) { /* one sub-block of 16: two groups of 8 */
                    __m256 acc[XCHUNK];
                    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] =
                        _mm256_setzero_ps();
                    for (int g = 2 * g2; g < 2 * g2 + 2; g++) {
                        __m256i v = widen8(ql + (kk & 1 ? 32 : 0) + 8 * g);
                        __m256i lo = kk < 2 ? _mm256_and_si256(v, mask) : _mm256_srli_epi32(v, 4);
                        __m256i h =
                            _mm256_and_si256(_mm256_srli_epi32(widen8(qh + 8 * g), 2 * kk), three);
                        __m256i code =
                            _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(h, 4)), bias);
                        dot8(_mm256_cvtepi32_ps(code), xs, 128 * half + 32 * kk + 8 * g, nb, acc);
                    }
                    __m256 sc =
                        _mm256_set1_ps(d * (float)(int8_t)blk[192 + 8 * half + 2 * kk + g2]);
                    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] =
                        _mm256_fmadd_ps(acc[b], sc, total[b]);
                }
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] = qt_hsum8(total[b]);
}

/* Q2_K rows, fused: per sub-block of 16, the 2-bit codes times x, then d1
 * times that minus m1 times the sub-block's sum of x (w = d1 * q - m1). */
ALWAYS_INLINE void rows_q2_k(const qtensor *t, const float *x, int nb, float *y, int64_t r)
{
    int64_t n_blocks = t->cols / 256;
    const uint8_t *blk = t->data + r * n_blocks * (int64_t)QM_Q2_K_BYTES;
    __m256 total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_blocks; k++, blk += QM_Q2_K_BYTES) {
        qt_prefetch_block(blk, QM_Q2_K_BYTES);
        float d = qt_f16_le_avx2(blk + 80), dmin = qt_f16_le_avx2(blk + 82);
        const float *xs[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) xs[b] = x + b * t->cols + k * 256;
        for (int s = 0; s < 16; s++) { /* elements 16 s ..: half s / 8, field (s % 8) / 2 */
            const uint8_t *q = blk + 16 + 32 * (s / 8) + 16 * (s % 2);
            int shift = 2 * ((s % 8) / 2), at = 16 * s;
            __m256 acc[XCHUNK];
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
            dot8(_mm256_cvtepi32_ps(crumbs8(q, shift)), xs, at, nb, acc);
            dot8(_mm256_cvtepi32_ps(crumbs8(q + 8, shift)), xs, at + 8, nb, acc);
            int sc = blk[s];
            __m256 d1 = _mm256_set1_ps(d * (float)(sc & 0xF));
            __m256 m1 = _mm256_set1_ps(dmin * (float)(sc >> 4));
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++)
            {
                __m256 sx =
                    _mm256_add_ps(_mm256_loadu_ps(xs[b] + at), _mm256_loadu_ps(xs[b] + at + 8));
                total[b] = _mm256_fnmadd_ps(sx, m1, _mm256_fmadd_ps(acc[b], d1, total[b]));
            }
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] = qt_hsum8(total[b]);
}

/* Q3_K rows, fused: per sub-block of 16, the signed codes times x, then
 * times that sub-block's d * sc. */
ALWAYS_INLINE void rows_q3_k(const qtensor *t, const float *x, int nb, float *y, int64_t r)
{
    int64_t n_blocks = t->cols / 256;
    const uint8_t *blk = t->data + r * n_blocks * (int64_t)QM_Q3_K_BYTES;
    __m256 total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_blocks; k++, blk += QM_Q3_K_BYTES) {
        qt_prefetch_block(blk, QM_Q3_K_BYTES);
        float scale[16];
        q3_k_scales(blk, scale);
        const float *xs[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) xs[b] = x + b * t->cols + k * 256;
        for (int s = 0; s < 16; s++) {
            int half = s / 8, kk = (s % 8) / 2, l = 16 * (s % 2), at = 16 * s;
            const uint8_t *qs = blk + 32 + 32 * half + l, *hm = blk + l;
            __m256 acc[XCHUNK];
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
            dot8(_mm256_cvtepi32_ps(q3_k_codes8(qs, hm, kk, 4 * half + kk)), xs, at, nb, acc);
            dot8(_mm256_cvtepi32_ps(q3_k_codes8(qs + 8, hm + 8, kk, 4 * half + kk)), xs, at + 8, nb,
                 acc);
            __m256 sc = _mm256_set1_ps(scale[s]);
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] =
                _mm256_fmadd_ps(acc[b], sc, total[b]);
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] = qt_hsum8(total[b]);
}

/* IQ4_XS rows, fused: per sub-block of 32, the levels times x in two
 * chains, then times that sub-block's d * sc. */
ALWAYS_INLINE void rows_iq4_xs(const qtensor *t, const float *x, int nb, float *y, int64_t r)
{
    int64_t n_blocks = t->cols / 256;
    const uint8_t *blk = t->data + r * n_blocks * (int64_t)QM_IQ4_XS_BYTES;
    __m256 total[XCHUNK];
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_blocks; k++, blk += QM_IQ4_XS_BYTES) {
        qt_prefetch_block(blk, QM_IQ4_XS_BYTES);
        float d = qt_f16_le_avx2(blk);
        const float *xs[XCHUNK];
        _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) xs[b] = x + b * t->cols + k * 256;
        for (int s = 0; s < 8; s++) {
            __m256 q[4], acc[XCHUNK], acc2[XCHUNK];
            levels32(iq4nl_levels, blk + 8 + 16 * s, q);
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) acc[b] = acc2[b] =
                _mm256_setzero_ps();
            for (int g = 0; g < 4; g++)
                dot8(q[g], xs, 32 * s + 8 * g, nb, g & 1 ? acc2 : acc);
            __m256 dl = _mm256_set1_ps(d * (float)qm_iq4_xs_scale(blk, s));
            _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) total[b] =
                _mm256_fmadd_ps(_mm256_add_ps(acc[b], acc2[b]), dl, total[b]);
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < nb; b++) y[b * t->rows + r] = qt_hsum8(total[b]);
}

/* Whether rows_bnb4_split applies: blocks of whole groups of 16. */
static bool bnb4_whole_groups(const qtensor *t)
{
    return t->cols % 16 == 0 && t->blocksize % 16 == 0;
}

/* Q4_1's sums of x per block, 8 lanes each ((x0 + x1) + (x2 + x3) of the
 * block's four groups of 8, as rows_gguf would make them), for nb rows of
 * x: computed once per call, not once per weight row. */
static void block_sums(const float *x, int64_t cols, int nb, float *xsum)
{
    for (int b = 0; b < nb; b++)
        for (int64_t k = 0; k < cols / 32; k++) {
            const float *xb = x + b * cols + k * 32;
            _mm256_store_ps(xsum + (b * (cols / 32) + k) * 8,
                            sum4(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8),
                                 _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        }
}

/*
 * One row r of W against nb rows of x, one function per kind: what
 * matmul_chunks calls for every weight row. scratch is what the kind's
 * x_prep made of this chunk of x (NULL: none, or no memory, and the row
 * makes the same values inline).
 */
typedef void (*row_kernel)(const qtensor *t, const float *x, const float *scratch, int nb, float *y,
                           int64_t r);

ALWAYS_INLINE void row_f32(const qtensor *t, const float *x, const float *scratch, int nb, float *y,
                           int64_t r)
{
    (void)scratch;
    rows_tiled(t, x, nb, y, r, tile_f32);
}
ALWAYS_INLINE void row_f16(const qtensor *t, const float *x, const float *scratch, int nb, float *y,
                           int64_t r)
{
    (void)scratch;
    rows_tiled(t, x, nb, y, r, tile_f16);
}
ALWAYS_INLINE void row_bf16(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_tiled(t, x, nb, y, r, tile_bf16);
}
ALWAYS_INLINE void row_affine(const qtensor *t, const float *x, const float *scratch, int nb,
                              float *y, int64_t r)
{
    (void)scratch;
    rows_tiled(t, x, nb, y, r, tile_affine);
}
ALWAYS_INLINE void row_bnb4(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_bnb4(t, x, nb, y, r);
}
ALWAYS_INLINE void row_bnb4_split(const qtensor *t, const float *x, const float *scratch, int nb,
                                  float *y, int64_t r)
{
    rows_bnb4_split(t, x, scratch, nb, y, r);
}
ALWAYS_INLINE void row_q4_0(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_Q4_0);
}
ALWAYS_INLINE void row_q4_1(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_Q4_1);
}
ALWAYS_INLINE void row_q8_0(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_Q8_0);
}
ALWAYS_INLINE void row_q5_0(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_Q5_0);
}
ALWAYS_INLINE void row_q5_1(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_Q5_1);
}
/* The k-quants: the fused rows above, sub-block by sub-block. */
ALWAYS_INLINE void row_q4_k(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_k4(t, x, nb, y, r, false);
}
ALWAYS_INLINE void row_q5_k(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_k4(t, x, nb, y, r, true);
}
ALWAYS_INLINE void row_q6_k(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_q6_k(t, x, nb, y, r);
}
ALWAYS_INLINE void row_q2_k(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_q2_k(t, x, nb, y, r);
}
ALWAYS_INLINE void row_q3_k(const qtensor *t, const float *x, const float *scratch, int nb,
                            float *y, int64_t r)
{
    (void)scratch;
    rows_q3_k(t, x, nb, y, r);
}
/* IQ4_NL: the blocks of 32 of rows_gguf, with levels for codes. */
ALWAYS_INLINE void row_iq4_nl(const qtensor *t, const float *x, const float *scratch, int nb,
                              float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_IQ4_NL);
}
/* MXFP4: the blocks of 32 of rows_gguf, with FP4 levels and E8M0 scales. */
ALWAYS_INLINE void row_mxfp4(const qtensor *t, const float *x, const float *scratch, int nb,
                             float *y, int64_t r)
{
    rows_gguf(t, x, scratch, nb, y, r, QT_MXFP4);
}
ALWAYS_INLINE void row_iq4_xs(const qtensor *t, const float *x, const float *scratch, int nb,
                              float *y, int64_t r)
{
    (void)scratch;
    rows_iq4_xs(t, x, nb, y, r);
}

/* What a kind derives from each chunk of nb rows of x before its rows run
 * (bnb4_split, block_sums), into XCHUNK * cols floats; NULL: nothing. */
typedef void (*x_prep)(const float *x, int64_t cols, int nb, float *scratch);

/* Rows [row0, row1) for nb rows of x (a constant in each call below). */
ALWAYS_INLINE void rows_range(const qtensor *t, const float *x, const float *scratch, int nb,
                              float *y, int64_t row0, int64_t row1, row_kernel row)
{
    for (int64_t r = row0; r < row1; r++)
        row(t, x, scratch, nb, y, r);
}

/* The matrix kernel of one kind: x in chunks of XCHUNK rows, each chunk
 * prepared by prep, then every weight row through row. prep and row are
 * constants in every caller, so each entry point is its own loop. */
ALWAYS_INLINE void matmul_chunks(const qtensor *t, const float *x, int64_t batch, float *y,
                                 int64_t row0, int64_t row1, x_prep prep, row_kernel row)
{
    /* per-call scratch derived from x; without it (no memory) the rows
     * make the same values inline */
    float *scratch = NULL;
    if (prep)
        scratch = aligned_alloc(32, (size_t)XCHUNK * (size_t)t->cols * sizeof(float) + 32);
    /* weight rows in tiles of about 128 KiB, each tile against every chunk
     * of x while it is in L2: a large product (the output head) is read
     * from memory once per call, not once per chunk of x */
    size_t row_bytes = qt_nbytes(t) / (size_t)t->rows + 1;
    int64_t tile = row_bytes < TILE_BYTES ? (int64_t)(TILE_BYTES / row_bytes) : 1;
    for (int64_t t0 = row0; t0 < row1; t0 += tile) {
        int64_t t1 = t0 + tile < row1 ? t0 + tile : row1;
        for (int64_t b0 = 0; b0 < batch; b0 += XCHUNK) {
            int nb = (int)(batch - b0 < XCHUNK ? batch - b0 : XCHUNK);
            const float *xc = x + b0 * t->cols;
            float *yc = y + b0 * t->rows;
            if (scratch)
                prep(xc, t->cols, nb, scratch);
            /* a constant nb in each call lets every accumulator be a register */
            switch (nb) {
            case 1: rows_range(t, xc, scratch, 1, yc, t0, t1, row); break;
            case 2: rows_range(t, xc, scratch, 2, yc, t0, t1, row); break;
            case 3: rows_range(t, xc, scratch, 3, yc, t0, t1, row); break;
            default: rows_range(t, xc, scratch, 4, yc, t0, t1, row); break;
            }
        }
    }
    free(scratch);
}

/* --- the entry points the traits table holds ---------------------------- */

#define MATMUL_ARGS                                                                                \
    const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0, int64_t row1

void qt_matmul_f32_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_f32);
}
void qt_matmul_f16_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_f16);
}
void qt_matmul_bf16_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_bf16);
}
/* NF4 and FP4 differ only in the codebook the tensor carries. */
void qt_matmul_bnb4_avx2(MATMUL_ARGS)
{
    if (bnb4_whole_groups(t))
        matmul_chunks(t, x, batch, y, row0, row1, bnb4_split, row_bnb4_split);
    else
        matmul_chunks(t, x, batch, y, row0, row1, NULL, row_bnb4);
}
void qt_matmul_affine_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_affine);
}
void qt_matmul_q4_0_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q4_0);
}
void qt_matmul_q4_1_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, block_sums, row_q4_1);
}
void qt_matmul_q8_0_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q8_0);
}
void qt_matmul_q5_0_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q5_0);
}
void qt_matmul_q5_1_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, block_sums, row_q5_1);
}
void qt_matmul_q4_k_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q4_k);
}
void qt_matmul_q5_k_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q5_k);
}
void qt_matmul_q6_k_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q6_k);
}
void qt_matmul_q2_k_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q2_k);
}
void qt_matmul_q3_k_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_q3_k);
}
void qt_matmul_iq4_nl_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_iq4_nl);
}
void qt_matmul_iq4_xs_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_iq4_xs);
}
void qt_matmul_mxfp4_avx2(MATMUL_ARGS)
{
    matmul_chunks(t, x, batch, y, row0, row1, NULL, row_mxfp4);
}

/* Whole rows through a kind's tile decoder (a constant), which writes
 * into dst for every kind that has a fast dequantization (F32 has none: its
 * scalar path is a memcpy). */
ALWAYS_INLINE void dequantize_tiles(const qtensor *t, int64_t row0, int64_t nrows, float *out,
                                    tile_decoder decode)
{
    for (int64_t r = row0; r < row0 + nrows; r++)
        decode(t, r, 0, t->cols, out + (r - row0) * t->cols);
}

#define DEQUANT_ARGS const qtensor *t, int64_t row0, int64_t nrows, float *out

void qt_dequantize_rows_f16_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_f16);
}
void qt_dequantize_rows_bf16_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_bf16);
}
void qt_dequantize_rows_bnb4_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_bnb4);
}
void qt_dequantize_rows_affine_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_affine);
}
void qt_dequantize_rows_q4_0_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q4_0);
}
void qt_dequantize_rows_q4_1_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q4_1);
}
void qt_dequantize_rows_q8_0_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q8_0);
}
void qt_dequantize_rows_q5_0_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q5_0);
}
void qt_dequantize_rows_q5_1_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q5_1);
}
void qt_dequantize_rows_q4_k_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q4_k);
}
void qt_dequantize_rows_q5_k_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q5_k);
}
void qt_dequantize_rows_q6_k_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q6_k);
}
void qt_dequantize_rows_q2_k_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q2_k);
}
void qt_dequantize_rows_q3_k_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_q3_k);
}
void qt_dequantize_rows_iq4_nl_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_iq4_nl);
}
void qt_dequantize_rows_iq4_xs_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_iq4_xs);
}
void qt_dequantize_rows_mxfp4_avx2(DEQUANT_ARGS)
{
    dequantize_tiles(t, row0, nrows, out, tile_mxfp4);
}

/* Positions of a run taken together by qt_attend_avx2. */
#define ATTEND_BLOCK 8

/* q . k * scale over d (a multiple of 16) in two 8-lane chains. */
ALWAYS_INLINE float attend_score(const float *q, const float *k, int32_t d, float scale)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int32_t t = 0; t < d; t += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + t), _mm256_loadu_ps(k + t), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + t + 8), _mm256_loadu_ps(k + t + 8), s1);
    }
    return qt_hsum8(_mm256_add_ps(s0, s1)) * scale;
}

/* Attention over a run of cached positions, ATTEND_BLOCK at a time: their
 * scores first, the running max raised once to the block's largest (a NaN
 * never raises it), their weights, then each 8 elements of the accumulator
 * loaded once for the block's weighted values (fused multiply-adds) rather
 * than once per position. The same softmax as qt_attend_ref's up to
 * rounding: the weights are taken under the block's max, not the max so
 * far (test_matmul's float64 comparison holds both). */
void qt_attend_avx2(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                    int32_t d, float scale, float *max, float *sum, float *acc)
{
    if (d % 16 != 0) {
        qt_attend_ref(q, k, v, stride, n, d, scale, max, sum, acc);
        return;
    }
    om_online sm = {*max, *sum};
    for (int32_t i0 = 0; i0 < n; i0 += ATTEND_BLOCK) {
        int32_t m = n - i0 < ATTEND_BLOCK ? n - i0 : ATTEND_BLOCK;
        const float *kb = k + i0 * stride, *vb = v + i0 * stride;
        float w[ATTEND_BLOCK], top = sm.max, f;
        for (int32_t j = 0; j < m; j++) {
            w[j] = attend_score(q, kb + j * stride, d, scale);
            top = w[j] > top ? w[j] : top;
        }
        if (om_online_raise(&sm, top, &f)) { /* rescale what was summed under the old max */
            __m256 vf = _mm256_set1_ps(f);
            for (int32_t u = 0; u < d; u += 8)
                _mm256_storeu_ps(acc + u, _mm256_mul_ps(_mm256_loadu_ps(acc + u), vf));
        }
        for (int32_t j = 0; j < m; j++)
            w[j] = om_online_weight(&sm, w[j]);
        for (int32_t u = 0; u < d; u += 8) {
            __m256 a = _mm256_loadu_ps(acc + u);
            for (int32_t j = 0; j < m; j++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(vb + j * stride + u), a);
            _mm256_storeu_ps(acc + u, a);
        }
    }
    *max = sm.max;
    *sum = sm.sum;
}

/* --- the LoRA products on bf16 (qtensor.h: the _ref's bits) ----------------- */

/* Eight bf16 values widened to f32: the 16 bits are the top of the f32. */
static inline __m256 bf16x8(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* Lane j of the result: v[j]'s lanes summed ((l0 + l1) + (l2 + l3)) +
 * ((l4 + l5) + (l6 + l7)), as lora_dot_ref sums them. hadd pairs
 * neighbours within each 128-bit half, so two rounds leave each vector's
 * low-half and high-half sums, added last. */
static inline __m256 lora_lanes_sum8(const __m256 v[8])
{
    __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                         _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* The lane sums of rows w + row[j] * n (j < 8) dotted with x[0..n): the
 * whole groups of eight, then the tail zero-padded as lora_dot_ref pads it. */
static inline __m256 lora_dot8(const uint16_t *w, const int64_t row[8], const float *x, int64_t n)
{
    __m256 acc[8];
    for (int j = 0; j < 8; j++)
        acc[j] = _mm256_setzero_ps();
    int64_t whole = n / 8 * 8;
    for (int64_t i = 0; i < whole; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(bf16x8(w + row[j] * n + i), xv));
    }
    if (whole < n) {
        float xt[8] = {0};
        memcpy(xt, x + whole, (size_t)(n - whole) * sizeof *xt);
        __m256 xv = _mm256_loadu_ps(xt);
        for (int j = 0; j < 8; j++) {
            uint16_t wt[8] = {0};
            memcpy(wt, w + row[j] * n + whole, (size_t)(n - whole) * sizeof *wt);
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(bf16x8(wt), xv));
        }
    }
    return lora_lanes_sum8(acc);
}

/* Rows first..first + 7, the missing ones past last standing in as `first`
 * (computed, never stored). */
static inline void lora_rows8(int64_t first, int64_t last, int64_t row[8])
{
    for (int j = 0; j < 8; j++)
        row[j] = first + j < last ? first + j : first;
}

void qt_lora_down_avx2(const qtensor *a, const float *x, float s, float *t, int64_t r0, int64_t r1)
{
    const uint16_t *w = (const uint16_t *)a->data;
    for (int64_t r = r0; r < r1; r += 8) {
        int64_t row[8];
        lora_rows8(r, r1, row);
        float out[8];
        _mm256_storeu_ps(out, _mm256_mul_ps(lora_dot8(w, row, x, a->cols), _mm256_set1_ps(s)));
        memcpy(t + r, out, (size_t)(r1 - r < 8 ? r1 - r : 8) * sizeof *out);
    }
}

void qt_lora_up_avx2(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1)
{
    const uint16_t *w = (const uint16_t *)b->data;
    for (int64_t o = o0; o < o1; o += 8) {
        int64_t row[8];
        lora_rows8(o, o1, row);
        __m256 sum = lora_dot8(w, row, t, b->cols);
        if (o1 - o >= 8) {
            _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), sum));
        } else {
            float part[8];
            _mm256_storeu_ps(part, sum);
            for (int64_t j = 0; j < o1 - o; j++)
                y[o + j] = y[o + j] + part[j];
        }
    }
}

/* A KV row into f16 with F16C, rounding to nearest even as qm_f32_to_f16
 * does (NaN quieted the same way); Q8_0 and F32 rows as the reference. */
void qt_kv_store_avx2(qt_kind kind, const float *x, int64_t n, void *row)
{
    if (kind != QT_F16) {
        qt_kv_store_ref(kind, x, n, row);
        return;
    }
    uint16_t *h = row;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(
            (__m128i *)(h + i),
            _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        h[i] = qm_f32_to_f16(x[i]);
}

/* A KV row's elements back to f32: f16 with F16C (exact, as the scalar
 * form); Q8_0 eight codes at a time, each q * d as one multiply, as
 * qm_q8_0_value. */
void qt_kv_load_avx2(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out)
{
    if (kind == QT_F16) {
        const uint16_t *h = (const uint16_t *)row + e0;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        for (; i < n; i++)
            out[i] = qm_f16_to_f32(h[i]);
        return;
    }
    if (kind != QT_Q8_0 || e0 % 8 != 0 || n % 8 != 0) {
        qt_kv_load_ref(kind, row, e0, n, out);
        return;
    }
    const uint8_t *base = row;
    for (int64_t i = 0; i < n; i += 8) {
        int64_t e = e0 + i;
        const uint8_t *blk = base + (e / QM_GGUF_QK) * QM_Q8_0_BYTES;
        __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + e % QM_GGUF_QK));
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_set1_ps(qt_f16_le_avx2(blk))));
    }
}

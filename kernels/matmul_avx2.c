/*
 * matmul_avx2.c - the AVX2+FMA entry points of the traits table: for each
 * kind with a fast path, its matrix kernel y = x @ W^T (qt_matmul_<kind>_avx2,
 * the bodies in internal/matmul_f32.inc, which matmul_avx512.c compiles
 * again for eight rows of x per pass) and its row dequantization
 * (qt_dequantize_rows_<kind>_avx2), plus qt_attend's AVX2 path, the LoRA
 * products and the KV cache's conversions. It owns no state; it reads
 * qtensors and writes the caller's output.
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

#define ALWAYS_INLINE   static inline __attribute__((always_inline))
#define XCHUNK          4 /* rows of x per pass: 2 accumulators each + temporaries fit 16 ymm */
#define F32_ENTRY(name) name##_avx2

#include "matmul_f32.inc"

/* --- row dequantization -------------------------------------------------- */

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

/* The dequantizing tiles (the products decode in registers): NF4/FP4's, */
static const float *tile_bnb4(const qtensor *t, int64_t r, int64_t c, int64_t n, float *tile)
{
    decode_bnb4(t, r * t->cols + c, n, tile);
    return tile;
}

/* the GGUF kinds' (the products decode in
 * registers). GGUF tiles start on multiples of TILE (or of the row) and rows are whole
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

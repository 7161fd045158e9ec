/*
 * matmul_avx2.c - the AVX2+FMA entry points of the traits table: for each
 * kind with a fast path, its matrix kernel y = x @ W^T (qt_matmul_<kind>_avx2,
 * the bodies in internal/matmul_f32.inc, which matmul_avx512.c compiles
 * again for eight rows of x per pass) and its row dequantization
 * (qt_dequantize_rows_<kind>_avx2), plus qt_attend's AVX2 path, the LoRA
 * products and the KV cache's conversions (internal/rows_vec.inc, which
 * matmul_avx512.c compiles again at sixteen lanes). It owns no state; it reads
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

/* qt_attend's AVX2 path, the LoRA products and the KV cache's conversions,
 * eight lanes a vector; shapes they do not cover take the _ref forms. */
#define ROWS_LANES          8
#define ROWS_ENTRY(name)    name##_avx2
#define ROWS_NARROWER(name) name##_ref

#include "rows_vec.inc"

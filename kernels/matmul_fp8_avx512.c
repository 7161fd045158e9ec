/*
 * matmul_fp8_avx512.c - FP8's AVX-512 product (qt_matmul_fp8_avx512; built
 * with -mavx512f -mavx512vl, called by traits.c only where CPUID reports
 * AVX-512 F and VL and the OS saves their state): each weight row
 * dequantized once, sixteen codes at a time (each the E4M3 table's value
 * made by a shift and an exact multiply) times the block's scale (the
 * scalar dequantization's bits), then
 * dotted with the rows of x, up to eight sharing each load of w, in the
 * same 32 lanes as the AVX2 entry and the scalar reference (two __m512
 * accumulators per row hold the AVX2 entry's four __m256 ones, lane for
 * lane), the same reduction: the scalar reference's bits. At batch 2 and
 * up the rows go two at a time (pair_dots: four rows of x per pass, each
 * load of x feeding both weight rows, each output dots' operations), the
 * odd last row alone. It owns no state; it calls quant_fp8.c (the table,
 * the walk over blocks).
 */
#include "avx2_shared.h"
#include "kernels_internal.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#define FP8_XB                                                                                     \
    QT_FP8_MOST_ROWS /* rows of x per pass: 16 accumulators + 2 weights fit 32 registers */

/* Sixteen E4M3FN codes as f32, as matmul_fp8_avx2.c's e4m3_values: the
 * seven low bits at the top of an f32's exponent and mantissa times 2^120
 * (exact), the sign ORed in, the NaN codes as the table has them. */
static inline __m512 e4m3_values(__m512i codes)
{
    const __m512i low7 = _mm512_set1_epi32(0x7f);
    __m512i mag = _mm512_and_si512(codes, low7);
    __m512i sign = _mm512_slli_epi32(_mm512_andnot_si512(low7, codes), 24);
    __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_slli_epi32(mag, 20))),
                             _mm512_set1_ps(0x1p120f));
    __m512 nan = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7FF00000)));
    return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, low7), v, nan);
}

/* n codes of one block times its scale, sixteen at a time. */
static void dequantize_block_avx512(const float *table, const uint8_t *codes, float scale,
                                    int64_t n, float *out)
{
    const __m512 s = _mm512_set1_ps(scale);
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + c)));
        _mm512_storeu_ps(out + c, _mm512_mul_ps(e4m3_values(q), s));
    }
    for (; c < n; c++)
        out[c] = table[codes[c]] * scale;
}

/* One output from its 32 lanes after the runs of 32 (lanes 0 .. 15 in lo,
 * 16 .. 31 in hi; c the first column after them): a last run of 8 onto
 * lanes 0 .. 7, then (0-7 + 8-15) + (16-23 + 24-31), qt_hsum8, the tail.
 * dots and pair_dots both end here, so one output's operations are the
 * same whichever walked it. */
static inline __attribute__((always_inline)) float
lanes_end(__m512 lo, __m512 hi, const float *w, const float *x, int64_t c, int64_t cols)
{
    __m256 a0 = _mm512_castps512_ps256(lo);
    __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lo), 1));
    __m256 a2 = _mm512_castps512_ps256(hi);
    __m256 a3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hi), 1));
    int64_t k = c;
    for (; k + 8 <= cols; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float sum = qt_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < cols; k++)
        sum += w[k] * x[k];
    return sum;
}

/* nb rows of x (`cols` apart, nb a constant) dotted with the weight row w:
 * lanes 0 .. 15 of each run of 32 in lo, 16 .. 31 in hi, then lanes_end. */
static inline __attribute__((always_inline)) void dots(const float *w, const float *x, int64_t cols,
                                                       int nb, float *out)
{
    __m512 lo[FP8_XB], hi[FP8_XB];
    for (int b = 0; b < nb; b++)
        lo[b] = hi[b] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512 wl = _mm512_loadu_ps(w + c), wh = _mm512_loadu_ps(w + c + 16);
        for (int b = 0; b < nb; b++) {
            lo[b] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(x + b * cols + c), lo[b]);
            hi[b] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(x + b * cols + c + 16), hi[b]);
        }
    }
    for (int b = 0; b < nb; b++)
        out[b] = lanes_end(lo[b], hi[b], w, x + b * cols, c, cols);
}

/* dots for nb (1 .. FP8_XB) rows, each count its own loop. */
static void dots_n(const float *w, const float *x, int64_t cols, int nb, float *out)
{
    switch (nb) {
    case 1: dots(w, x, cols, 1, out); break;
    case 2: dots(w, x, cols, 2, out); break;
    case 3: dots(w, x, cols, 3, out); break;
    case 4: dots(w, x, cols, 4, out); break;
    case 5: dots(w, x, cols, 5, out); break;
    case 6: dots(w, x, cols, 6, out); break;
    case 7: dots(w, x, cols, 7, out); break;
    default: dots(w, x, cols, 8, out); break;
    }
}

/* rows of t dequantized sixteen codes at a time */
static void dequantize_rows_avx512(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    qt_fp8_dequantize_rows_with(t, row0, nrows, out, dequantize_block_avx512);
}

/* Rows of x per pass of pair_dots: 2 weight rows x 4 x (lo, hi) is 16
 * accumulators, beside the 4 weight vectors and 2 of x. */
#define FP8_PAIR_XB 4

/* nb rows of x (nb a constant, 1 .. FP8_PAIR_XB) dotted with the weight
 * rows w0 and w1 (out0, out1): each load of x feeds both rows, each
 * output dots' lanes and lanes_end, so dots' bits. */
static inline __attribute__((always_inline)) void pair_dots(const float *w0, const float *w1,
                                                            const float *x, int64_t cols, int nb,
                                                            float *out0, float *out1)
{
    __m512 lo0[FP8_PAIR_XB], hi0[FP8_PAIR_XB], lo1[FP8_PAIR_XB], hi1[FP8_PAIR_XB];
    for (int b = 0; b < nb; b++)
        lo0[b] = hi0[b] = lo1[b] = hi1[b] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512 wl0 = _mm512_loadu_ps(w0 + c), wh0 = _mm512_loadu_ps(w0 + c + 16);
        __m512 wl1 = _mm512_loadu_ps(w1 + c), wh1 = _mm512_loadu_ps(w1 + c + 16);
        for (int b = 0; b < nb; b++) {
            __m512 xl = _mm512_loadu_ps(x + b * cols + c),
                   xh = _mm512_loadu_ps(x + b * cols + c + 16);
            /* x in registers: GCC would fold each load into both rows' FMAs */
            __asm__("" : "+v"(xl), "+v"(xh));
            lo0[b] = _mm512_fmadd_ps(wl0, xl, lo0[b]);
            hi0[b] = _mm512_fmadd_ps(wh0, xh, hi0[b]);
            lo1[b] = _mm512_fmadd_ps(wl1, xl, lo1[b]);
            hi1[b] = _mm512_fmadd_ps(wh1, xh, hi1[b]);
        }
    }
    for (int b = 0; b < nb; b++) {
        out0[b] = lanes_end(lo0[b], hi0[b], w0, x + b * cols, c, cols);
        out1[b] = lanes_end(lo1[b], hi1[b], w1, x + b * cols, c, cols);
    }
}

/* Weight rows r, r + 1 (dequantized into w, `cols` apart) against every
 * row of x, FP8_PAIR_XB rows of x at a time, each count its own loop. */
static void pair_rows(const qtensor *t, const float *w, const float *x, int64_t batch, float *y,
                      int64_t r)
{
    const int64_t cols = t->cols;
    for (int64_t b = 0; b < batch; b += FP8_PAIR_XB) {
        const int nb = batch - b < FP8_PAIR_XB ? (int)(batch - b) : FP8_PAIR_XB;
        float p0[FP8_PAIR_XB], p1[FP8_PAIR_XB];
        const float *xb = x + b * cols;
        switch (nb) {
        case 1: pair_dots(w, w + cols, xb, cols, 1, p0, p1); break;
        case 2: pair_dots(w, w + cols, xb, cols, 2, p0, p1); break;
        case 3: pair_dots(w, w + cols, xb, cols, 3, p0, p1); break;
        default: pair_dots(w, w + cols, xb, cols, 4, p0, p1); break;
        }
        for (int i = 0; i < nb; i++) {
            y[(b + i) * t->rows + r] = p0[i];
            y[(b + i) * t->rows + r + 1] = p1[i];
        }
    }
}

/* Batch 2 and up: two weight rows per pass, each dequantized once and
 * every load of x shared by both (halving x's traffic from L2 at batch
 * 32); the odd last row, and batch 1, one row at a time as before. */
void qt_matmul_fp8_avx512(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1)
{
    int64_t r = row0;
    float *w = batch > 1 && row1 - row0 > 1 ? malloc(2 * (size_t)t->cols * sizeof *w) : NULL;
    if (w) {
        for (; r + 1 < row1; r += 2) {
            dequantize_rows_avx512(t, r, 2, w);
            pair_rows(t, w, x, batch, y, r);
        }
        free(w);
    }
    if (r < row1)
        qt_lanes_matmul_with(t, x, batch, y, r, row1, dequantize_rows_avx512, dots_n, FP8_XB);
}

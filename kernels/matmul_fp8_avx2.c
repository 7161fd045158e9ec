/*
 * matmul_fp8_avx2.c - FP8's AVX2+FMA entries of the traits table (built with
 * -mavx2 -mfma -mf16c; traits.c calls them only when the CPU has those):
 *   qt_dequantize_rows_fp8_avx2: eight codes at a time through the E4M3
 *     table (a gather), times the block's scale, one f32 multiply each: the
 *     scalar dequantization's bits;
 *   qt_matmul_fp8_avx2: each weight row dequantized once (as above), then
 *     dotted with every row of x in 32 f32 lanes (fused multiply-adds),
 *     summed lane by lane: the scalar product's value within f32 rounding,
 *     and the same bits for a row of x whatever the batch around it.
 *   qt_matmul_ct_int_avx2: the same product over compressed-tensors'
 *     integer rows (quant_ct.c's dequantization, then the same dot).
 * Its own file, beside matmul_avx2.c (the dense and GGUF kinds' shared
 * bodies), because FP8 shares none of their blocks. It owns no state; it
 * calls quant_fp8.c (the table) and quant_ct.c, and touches kernels/math/
 * through them.
 */
#include "avx2_shared.h"
#include "kernels_internal.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

/* n codes of one block times its scale, eight at a time. */
static void dequantize_block_avx2(const float *table, const uint8_t *codes, float scale, int64_t n,
                                  float *out)
{
    const __m256 s = _mm256_set1_ps(scale);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + c)));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_i32gather_ps(table, idx, 4), s));
    }
    for (; c < n; c++)
        out[c] = table[codes[c]] * scale;
}

void qt_dequantize_rows_fp8_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    qt_fp8_dequantize_rows_with(t, row0, nrows, out, dequantize_block_avx2);
}

/* sum_c w[c] * x[c] in 32 lanes, then the lanes, then the tail. */
static float dot_avx2(const float *w, const float *x, int64_t n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 16), _mm256_loadu_ps(x + c + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 24), _mm256_loadu_ps(x + c + 24), a3);
    }
    for (; c + 8 <= n; c += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
    float sum = qt_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; c < n; c++)
        sum += w[c] * x[c];
    return sum;
}

/* Each weight row of t dequantized once by dequantize_row, then dotted
 * with every row of x (dot_avx2). */
static void matmul_rows_avx2(const qtensor *t, const float *x, int64_t batch, float *y,
                             int64_t row0, int64_t row1,
                             void (*dequantize_row)(const qtensor *, int64_t, int64_t, float *))
{
    float *w = malloc((size_t)t->cols * sizeof *w);
    if (!w) { /* as the scalar reference: NaN where a caller checks */
        for (int64_t b = 0; b < batch; b++)
            for (int64_t r = row0; r < row1; r++)
                y[b * t->rows + r] = NAN;
        return;
    }
    for (int64_t r = row0; r < row1; r++) {
        dequantize_row(t, r, 1, w);
        for (int64_t b = 0; b < batch; b++)
            y[b * t->rows + r] = dot_avx2(w, x + b * t->cols, t->cols);
    }
    free(w);
}

void qt_matmul_fp8_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1)
{
    matmul_rows_avx2(t, x, batch, y, row0, row1, qt_dequantize_rows_fp8_avx2);
}

/* CT_INT's rows come from its scalar dequantization (integer codes, one
 * multiply each, rounded to the scale's dtype): the same bits, then the
 * same dot as FP8's. */
void qt_matmul_ct_int_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1)
{
    matmul_rows_avx2(t, x, batch, y, row0, row1, qt_ct_int_dequantize_rows);
}

/*
 * matmul_fp8_avx2.c - FP8's AVX2+FMA entries of the traits table (built with
 * -mavx2 -mfma -mf16c; traits.c calls them only when the CPU has those):
 *   qt_dequantize_rows_fp8_avx2: eight codes at a time, each the E4M3
 *     table's value (made by a shift and one exact multiply, see
 *     e4m3_values), times the block's scale, one f32 multiply each: the
 *     scalar dequantization's bits;
 *   qt_matmul_fp8_avx2: each weight row dequantized once (as above), then
 *     dotted with the rows of x, two at a time, in 32 f32 lanes each
 *     (fused multiply-adds), summed lane by lane in the scalar reference's
 *     order (qt_fp8_matmul_ref): its bits, whatever the batch around a row.
 *   qt_matmul_ct_int_avx2: the same product over compressed-tensors'
 *     integer rows (quant_ct.c's dequantization, then the same dots).
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

/* Eight E4M3FN codes (in the low bytes of 32-bit lanes) as f32, the
 * table's values (qm_e4m3_to_f32) without a gather: the code's seven low
 * bits shifted to the top of an f32's exponent and mantissa read as an f32
 * whose exponent is 120 too small (a subnormal one for E4M3's subnormals,
 * 2^-129 a step), so one multiply by 2^120 makes the value exactly, sign
 * and all; the NaN codes (S.1111.111) as the table has them, mantissa
 * kept. A gather is the slow part of a row on CPUs that split it into
 * loads (4096 x 4096 at batch 1, one EPYC core: 10 -> 4 ms). */
static inline __m256 e4m3_values(__m256i codes)
{
    const __m256i low7 = _mm256_set1_epi32(0x7f);
    __m256i mag = _mm256_and_si256(codes, low7);
    __m256i sign = _mm256_slli_epi32(_mm256_andnot_si256(low7, codes), 24);
    __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_slli_epi32(mag, 20))),
                             _mm256_set1_ps(0x1p120f));
    __m256 nan = _mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_set1_epi32(0x7FF00000)));
    return _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, low7)));
}

/* n codes of one block times its scale, eight at a time. */
static void dequantize_block_avx2(const float *table, const uint8_t *codes, float scale, int64_t n,
                                  float *out)
{
    const __m256 s = _mm256_set1_ps(scale);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + c)));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(e4m3_values(q), s));
    }
    for (; c < n; c++)
        out[c] = table[codes[c]] * scale;
}

void qt_dequantize_rows_fp8_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    qt_fp8_dequantize_rows_with(t, row0, nrows, out, dequantize_block_avx2);
}

/* nb rows of x (`cols` apart) dotted with one weight row w in 32 lanes
 * each (four accumulators), then the lanes, then the tail: the scalar
 * reference's order (qt_fp8_matmul_ref). Two rows share each load of w
 * (nb a constant, 1 or 2: eight accumulators fit 16 registers). */
static inline __attribute__((always_inline)) void dots(const float *w, const float *x, int64_t cols,
                                                       int nb, float *out)
{
    __m256 a[2][4];
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < 4; j++)
            a[b][j] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32)
        for (int j = 0; j < 4; j++) {
            __m256 wj = _mm256_loadu_ps(w + c + 8 * j);
            for (int b = 0; b < nb; b++)
                a[b][j] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + b * cols + c + 8 * j), a[b][j]);
        }
    for (; c + 8 <= cols; c += 8)
        for (int b = 0; b < nb; b++)
            a[b][0] =
                _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + b * cols + c), a[b][0]);
    for (int b = 0; b < nb; b++) {
        float sum = qt_hsum8(
            _mm256_add_ps(_mm256_add_ps(a[b][0], a[b][1]), _mm256_add_ps(a[b][2], a[b][3])));
        for (int64_t k = c; k < cols; k++)
            sum += w[k] * x[b * cols + k];
        out[b] = sum;
    }
}

/* dots for nb (1 or 2) rows, each count its own loop. */
static void dots_n(const float *w, const float *x, int64_t cols, int nb, float *out)
{
    if (nb == 2)
        dots(w, x, cols, 2, out);
    else
        dots(w, x, cols, 1, out);
}

void qt_matmul_fp8_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1)
{
    qt_lanes_matmul_with(t, x, batch, y, row0, row1, qt_dequantize_rows_fp8_avx2, dots_n, 2);
}

/* CT_INT's rows come from its scalar dequantization (integer codes, one
 * multiply each, rounded to the scale's dtype): the same bits, then the
 * same dot as FP8's. */
void qt_matmul_ct_int_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1)
{
    qt_lanes_matmul_with(t, x, batch, y, row0, row1, qt_ct_int_dequantize_rows, dots_n, 2);
}

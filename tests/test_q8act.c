/*
 * test_q8act.c - the 8-bit activation path (qt_set_activations(QL_ACTIVATIONS_Q8)):
 * for Q4_K, Q5_K, Q6_K (activations in blocks of 256) and Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, IQ4_NL, MXFP4 (blocks of 32), the AVX2 and AVX-512 VNNI
 * products (each this CPU has) equal the scalar one bit for bit (batches
 * 1 .. 9, any row range), a row's bits do not depend on its batch, and
 * both equal a float64 computation of the same quantities (the dequantized
 * weights times the quantized activations, d * q) within 2e-6 of the
 * magnitude sum: the integer path computes what it says, and the only
 * departure from the f32 path is the activations' own rounding, at most
 * sum_c |w_c| * d / 2 (d the block's step) plus the f32 path's own 1e-5
 * of the magnitude sum (the README states the distance from the float64
 * logits of a real model). A NaN in a row of x makes that row's outputs
 * NaN and no other; a kind without the path (IQ4_XS, F16) keeps the f32
 * product.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"
#include "test_kquant.h"
#include "test_util.h"

static const qt_kind kinds[] = {QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_Q8_0,   QT_Q4_0,
                                QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_IQ4_NL, QT_MXFP4};

/* rows x cols of kind: random blocks for the kinds read in place
 * (test_kquant.h), else N(0, 0.02) weights through qt_quantize. */
static void random_weight(qtensor *t, qt_kind kind, int64_t rows, int64_t cols, uint64_t *rng)
{
    if (test_kquant_is_read_only(kind)) {
        test_random_kquant(t, kind, rows, cols, rng);
        return;
    }
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    cr_assert(w);
    for (int64_t i = 0; i < rows * cols; i++)
        w[i] = 0.02f * test_normal(rng);
    char msg[256];
    cr_assert_eq(qt_quantize(t, w, rows, cols, &(qt_quant_params){.kind = kind}, msg, sizeof msg),
                 QL_OK, "%s: %s", qt_kind_name(kind), msg);
    free(w);
}

static float *random_x(int64_t n, uint64_t *rng)
{
    float *x = malloc((size_t)n * sizeof *x);
    cr_assert(x);
    for (int64_t i = 0; i < n; i++)
        x[i] = test_normal(rng) * (i % 97 == 0 ? 8.0f : 1.0f); /* a few outliers, as a model has */
    return x;
}

/* y64[b][r] = sum_c w[r][c] * xq[b][c] in float64, xq the 8-bit values as
 * the path makes them (d = amax / 127, q = nearest(x * 127 / amax));
 * mag[b][r] = sum_c |w x|; and step[b][r] = sum_c |w| * d / 2, the most
 * the rounding of x can move the sum. */
static void reference(const qtensor *t, const float *x, int64_t batch, double *y64, double *mag,
                      double *step)
{
    int64_t rows = t->rows, cols = t->cols;
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    double *xq = malloc((size_t)cols * sizeof *xq), *half = malloc((size_t)cols * sizeof *half);
    cr_assert(w && xq && half);
    qt_dequantize_rows_ref(t, 0, rows, w);
    for (int64_t b = 0; b < batch; b++) {
        const float *xb = x + b * cols;
        int64_t block = qt_traits_table[t->kind].block_size; /* 256 or 32 */
        for (int64_t k = 0; k < cols; k += block) {
            float amax = 0.0f;
            for (int64_t i = 0; i < block; i++)
                amax = fmaxf(amax, fabsf(xb[k + i]));
            float id = 127.0f / amax, d = amax / 127.0f;
            for (int64_t i = 0; i < block; i++) {
                xq[k + i] = (double)d * (double)lrintf(xb[k + i] * id);
                half[k + i] = (double)d / 2.0;
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            double s = 0.0, m = 0.0, e = 0.0;
            for (int64_t c = 0; c < cols; c++) {
                s += (double)w[r * cols + c] * xq[c];
                m += fabs((double)w[r * cols + c] * xb[c]);
                e += fabs((double)w[r * cols + c]) * half[c];
            }
            y64[b * rows + r] = s;
            mag[b * rows + r] = m;
            step[b * rows + r] = e;
        }
    }
    free(w);
    free(xq);
    free(half);
}

/* y = x @ W^T for rows 0 .. batch of x through the scalar entry (into ref)
 * and through each fast form this CPU has, AVX-512 VNNI where present and
 * AVX2, in two ranges split at split as the pool splits (into fast): the
 * same bits, output by output. */
static void fast_forms_give_the_scalar_bits(const qtensor *t, const float *x, int64_t batch,
                                            int64_t split, float *fast, float *ref)
{
    int64_t rows = t->rows;
    cr_assert(qt_matmul_q8_ref(t, x, batch, ref, 0, rows));
    for (int no_vnni = 1; no_vnni >= 0; no_vnni--) {
        qt_set_no_vnni(no_vnni);
        qt_set_activations(QL_ACTIVATIONS_Q8);
        qt_matmul(t, x, batch, fast, 0, split);
        qt_matmul(t, x, batch, fast, split, rows);
        qt_set_activations(QL_ACTIVATIONS_F32);
        for (int64_t i = 0; i < batch * rows; i++)
            cr_assert_eq(memcmp(&fast[i], &ref[i], sizeof(float)), 0,
                         "%s %lld x %lld batch %lld output %lld (row %lld): %s %.9g, scalar %.9g",
                         qt_kind_name(t->kind), (long long)rows, (long long)t->cols,
                         (long long)batch, (long long)i, (long long)(i % rows), qt_q8_path(),
                         fast[i], ref[i]);
    }
}

Test(q8act, avx2_equals_scalar_and_float64_for_every_kind_and_batch)
{
    if (strcmp(qt_cpu_path(), "avx2") != 0)
        cr_skip_test("this CPU has no AVX2: the fast path cannot run here");
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    /* a wide shape too: rows of x past 16 KiB ride in chunks of four, not eight */
    static const struct {
        int64_t rows, cols, split;
    } shapes[] = {{37, 768, 20}, {5, 4608, 2}};
    for (size_t si = 0; si < 2; si++)
        for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
            int64_t rows = shapes[si].rows, cols = shapes[si].cols, split = shapes[si].split;
            qtensor t;
            random_weight(&t, kinds[ki], rows, cols, &rng);
            for (int64_t batch = 1; batch <= 9; batch += (batch < 5 ? 1 : 4)) {
                float *x = random_x(batch * cols, &rng);
                size_t n = (size_t)(batch * rows);
                float *fast = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float)),
                      *f32 = malloc(n * sizeof(float));
                double *y64 = malloc(n * sizeof(double)), *mag = malloc(n * sizeof(double)),
                       *step = malloc(n * sizeof(double));
                cr_assert(fast && ref && f32 && y64 && mag && step);
                fast_forms_give_the_scalar_bits(&t, x, batch, split, fast, ref);
                qt_matmul(&t, x, batch, f32, 0, rows);
                reference(&t, x, batch, y64, mag, step);
                for (size_t i = 0; i < n; i++) {
                    cr_assert_eq(memcmp(&fast[i], &ref[i], sizeof(float)), 0,
                                 "%s batch %lld output %zu: AVX2 %.9g, scalar %.9g",
                                 qt_kind_name(kinds[ki]), (long long)batch, i, fast[i], ref[i]);
                    cr_assert_leq(fabs(ref[i] - y64[i]), 2e-6 * mag[i] + 1e-30,
                                  "%s batch %lld output %zu: %.9g, float64 %.9g (magnitude %.3g)",
                                  qt_kind_name(kinds[ki]), (long long)batch, i, ref[i], y64[i],
                                  mag[i]);
                    cr_assert_leq(fabs(ref[i] - f32[i]), step[i] + 1e-5 * mag[i],
                                  "%s output %zu: 8-bit %.6g, f32 %.6g (rounding bound %.3g)",
                                  qt_kind_name(kinds[ki]), i, ref[i], f32[i], step[i]);
                }
                free(x);
                free(fast);
                free(ref);
                free(f32);
                free(y64);
                free(mag);
                free(step);
            }
            qt_free(&t);
        }
}

/* The AVX-512 VNNI set walks two weight rows per pass (batch 2 and up),
 * the odd row of a range alone: every batch 1 .. 33 (chunks of 8 and their
 * remainders, and of 4 at 4608 columns), odd row counts and ranges that
 * start on an odd row, each fast form this CPU has against the scalar
 * entry's bits. */
Test(q8act, two_row_tiles_give_the_scalar_bits_at_every_batch)
{
    if (strcmp(qt_cpu_path(), "avx2") != 0)
        cr_skip_test("this CPU has no AVX2: the fast path cannot run here");
    uint64_t rng = 0x2545f4914f6cdd1dull;
    const int64_t rows[2] = {37, 7}, cols[2] = {768, 4608}, split[2] = {19, 3};
    float *fast = malloc(33 * 37 * sizeof(float)), *ref = malloc(33 * 37 * sizeof(float));
    cr_assert(fast && ref);
    for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++)
        for (int s = 0; s < 2; s++) {
            qtensor t;
            random_weight(&t, kinds[ki], rows[s], cols[s], &rng);
            float *x = random_x(33 * cols[s], &rng);
            for (int64_t batch = 1; batch <= 33; batch++)
                fast_forms_give_the_scalar_bits(&t, x, batch, split[s], fast, ref);
            free(x);
            qt_free(&t);
        }
    free(fast);
    free(ref);
}

Test(q8act, a_row_gives_the_same_bits_alone_or_batched)
{
    uint64_t rng = 7;
    int64_t rows = 19, cols = 512, batch = 6;
    for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
        qtensor t;
        random_weight(&t, kinds[ki], rows, cols, &rng);
        float *x = random_x(batch * cols, &rng);
        float all[6 * 19], one[19];
        qt_set_activations(QL_ACTIVATIONS_Q8);
        qt_matmul(&t, x, batch, all, 0, rows);
        for (int64_t b = 0; b < batch; b++) {
            qt_matmul(&t, x + b * cols, 1, one, 0, rows);
            cr_assert_eq(memcmp(one, all + b * rows, sizeof one), 0, "%s row %lld",
                         qt_kind_name(kinds[ki]), (long long)b);
        }
        qt_set_activations(QL_ACTIVATIONS_F32);
        free(x);
        qt_free(&t);
    }
}

Test(q8act, a_nan_stays_in_its_row_and_zeros_give_zero)
{
    uint64_t rng = 11;
    int64_t rows = 5, cols = 512;
    for (int scalar = 0; scalar < 2; scalar++)
        for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
            qtensor t;
            random_weight(&t, kinds[ki], rows, cols, &rng);
            float *x = random_x(3 * cols, &rng), y[3 * 5];
            x[cols + 300] = NAN;                                   /* row 1, second block */
            memset(x + 2 * cols, 0, (size_t)cols * sizeof(float)); /* row 2: zeros */
            qt_set_force_scalar(scalar);
            qt_set_activations(QL_ACTIVATIONS_Q8);
            qt_matmul(&t, x, 3, y, 0, rows);
            qt_set_activations(QL_ACTIVATIONS_F32);
            qt_set_force_scalar(false);
            for (int64_t r = 0; r < rows; r++) {
                cr_assert(isfinite(y[r]), "%s row 0 output %lld", qt_kind_name(kinds[ki]),
                          (long long)r);
                cr_assert(isnan(y[rows + r]), "%s row 1 output %lld is %g, not NaN",
                          qt_kind_name(kinds[ki]), (long long)r, y[rows + r]);
                cr_assert_eq(y[2 * rows + r], 0.0f);
            }
            free(x);
            qt_free(&t);
        }
}

Test(q8act, kinds_without_the_path_keep_f32)
{
    uint64_t rng = 3;
    /* IQ4_XS and F16 have no 8-bit product: the setting changes nothing */
    const qt_kind none[] = {QT_IQ4_XS, QT_F16};
    int64_t rows = 4, cols = 256;
    float *x = random_x(2 * cols, &rng);
    for (int i = 0; i < 2; i++) {
        qtensor t;
        if (none[i] == QT_F16) {
            float *w = random_x(rows * cols, &rng);
            char msg[256];
            cr_assert_eq(
                qt_quantize(&t, w, rows, cols, &(qt_quant_params){.kind = QT_F16}, msg, sizeof msg),
                QL_OK, "%s", msg);
            free(w);
        } else {
            test_random_kquant(&t, none[i], rows, cols, &rng);
        }
        float a[8], b[8];
        qt_matmul(&t, x, 2, a, 0, rows);
        qt_set_activations(QL_ACTIVATIONS_Q8);
        qt_matmul(&t, x, 2, b, 0, rows);
        cr_assert_not(qt_matmul_q8_ref(&t, x, 2, b, 0, 0));
        qt_set_activations(QL_ACTIVATIONS_F32);
        cr_assert_eq(memcmp(a, b, sizeof a), 0, "%s", qt_kind_name(none[i]));
        qt_free(&t);
    }
    cr_assert_str_eq(ql_name_of(&ql_activations_names, QL_ACTIVATIONS_Q8), "q8");
    cr_assert_eq(ql_name_parse(&ql_activations_names, "f32"), QL_ACTIVATIONS_F32);
    cr_assert_eq(ql_name_parse(&ql_activations_names, "int8"), -1);
    free(x);
}

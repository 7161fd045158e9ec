/*
 * test_kquant_quantize.c - quantizing into Q4_K, Q5_K and Q6_K writes
 * llama.cpp's bytes: tests/fixtures/kquant_ref_vectors.h holds the bytes
 * llama.cpp's own quantize_row_q4_K_ref / _q5_K_ref / _q6_K_ref wrote
 * (ggml-quants.c compiled by make_kquant_ref_vectors.py, without
 * contraction) for inputs meant to reach every branch: zero, constant,
 * outlier, negative-only, tiny, mixed-scale, tie and random blocks.
 * All five k-quants (Q2_K ... Q6_K) through qt_quantize, and through
 * kernels/math/qt_kquant_ref.h's block functions.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qt_kquant_ref.h"
#include "qtensor.h"

#include "fixtures/kquant_ref_vectors.h"

#define N_CASES (sizeof kqr_cases / sizeof *kqr_cases)

static const qt_kind kinds[] = {QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_Q2_K, QT_Q3_K};
#define N_KINDS (sizeof kinds / sizeof *kinds)

static const unsigned char *expected_bytes(const kqr_case *c, qt_kind kind)
{
    switch (kind) {
    case QT_Q2_K: return c->q2_k;
    case QT_Q3_K: return c->q3_k;
    case QT_Q4_K: return c->q4_k;
    case QT_Q5_K: return c->q5_k;
    default: return c->q6_k;
    }
}

Test(kquant_quantize, writes_llama_cpp_reference_bytes_for_every_case)
{
    int checked = 0;
    for (size_t c = 0; c < N_CASES; c++) {
        const kqr_case *k = &kqr_cases[c];
        for (size_t i = 0; i < N_KINDS; i++) {
            qt_quant_params p = {.kind = kinds[i]};
            qtensor t;
            char msg[256] = "";
            cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK,
                         "%s %s: %s", k->name, qt_kind_name(kinds[i]), msg);
            size_t bb = qt_traits_table[kinds[i]].block_bytes;
            size_t want_len = (size_t)(k->rows * k->cols / 256) * bb;
            cr_assert_eq(t.data_bytes, want_len, "%s %s", k->name, qt_kind_name(kinds[i]));
            const unsigned char *want = expected_bytes(k, kinds[i]);
            for (size_t b = 0; b < want_len; b++)
                cr_assert_eq(t.data[b], want[b],
                             "%s %s: byte %zu (block %zu, offset %zu) is 0x%02x, llama.cpp "
                             "wrote 0x%02x",
                             k->name, qt_kind_name(kinds[i]), b, b / bb, b % bb, t.data[b],
                             want[b]);
            qt_free(&t);
            checked++;
        }
    }
    cr_assert_eq(checked, (int)(N_KINDS * N_CASES));
    cr_assert_geq(N_CASES, 13, "every input the generator writes");
}

/* Every super-block of every case through the header's block functions,
 * all five k-quants: what a device requantization would call. */
Test(kquant_quantize, block_functions_write_llama_cpp_bytes_for_all_five_kquants)
{
    const struct {
        const char *name;
        size_t bytes;
        void (*block)(const float *x, uint8_t *blk);
    } ks[] = {
        {"q2_k", QK_Q2_K_BYTES, qk_q2_k_block}, {"q3_k", QK_Q3_K_BYTES, qk_q3_k_block},
        {"q4_k", QM_Q4_K_BYTES, qk_q4_k_block}, {"q5_k", QM_Q5_K_BYTES, qk_q5_k_block},
        {"q6_k", QM_Q6_K_BYTES, qk_q6_k_block},
    };
    int blocks = 0;
    for (size_t c = 0; c < N_CASES; c++) {
        const kqr_case *k = &kqr_cases[c];
        const unsigned char *want[] = {k->q2_k, k->q3_k, k->q4_k, k->q5_k, k->q6_k};
        for (size_t i = 0; i < 5; i++) {
            for (int64_t b = 0; b < k->rows * k->cols / 256; b++) {
                uint8_t got[256];
                memset(got, 0xa5, sizeof got);
                ks[i].block(k->input + b * 256, got);
                const unsigned char *w = want[i] + (size_t)b * ks[i].bytes;
                for (size_t j = 0; j < ks[i].bytes; j++)
                    cr_assert_eq(got[j], w[j],
                                 "%s %s block %lld: byte %zu is 0x%02x, llama.cpp wrote 0x%02x",
                                 k->name, ks[i].name, (long long)b, j, got[j], w[j]);
                blocks++;
            }
        }
    }
    cr_assert_gt(blocks, 5 * 2 * 12);
}

/* The quantized tensor reads back through the existing dequantization
 * close to its input: relative RMS error within what 4, 5, 6, 2 and 3 bits
 * give on normal data (measured 0.070, 0.035, 0.018, 0.30, 0.15; bounds with
 * margin). */
Test(kquant_quantize, round_trip_error_fits_the_bits)
{
    const kqr_case *k = NULL;
    for (size_t c = 0; c < N_CASES; c++)
        if (strcmp(kqr_cases[c].name, "normal_8_rows") == 0)
            k = &kqr_cases[c];
    cr_assert_not_null(k);
    const double bound[] = {0.09, 0.045, 0.025, 0.36, 0.19};
    int64_t n = k->rows * k->cols;
    float *back = malloc((size_t)n * sizeof *back);
    for (size_t i = 0; i < N_KINDS; i++) {
        qt_quant_params p = {.kind = kinds[i]};
        qtensor t;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK);
        qt_dequantize_rows_ref(&t, 0, k->rows, back);
        double err = 0, ref = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = (double)back[j] - (double)k->input[j];
            err += d * d;
            ref += (double)k->input[j] * (double)k->input[j];
        }
        double rel = sqrt(err / ref);
        cr_log_info("%s relative rms error %.4f", qt_kind_name(kinds[i]), rel);
        cr_assert_lt(rel, bound[i], "%s: relative error %g", qt_kind_name(kinds[i]), rel);
        cr_assert_gt(rel, bound[i] / 20, "%s: relative error %g is implausibly small",
                     qt_kind_name(kinds[i]), rel);
        qt_free(&t);
    }
    free(back);
}

Test(kquant_quantize, columns_not_a_multiple_of_256_are_refused_by_name)
{
    float w[2 * 288];
    for (int i = 0; i < 2 * 288; i++)
        w[i] = 0.01f * (float)(i % 17);
    for (size_t i = 0; i < N_KINDS; i++) {
        qt_quant_params p = {.kind = kinds[i]};
        qtensor t;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&t, w, 2, 288, &p, msg, sizeof msg), QL_EINVAL);
        cr_assert(strstr(msg, "288") && strstr(msg, qt_kind_name(kinds[i])) && strstr(msg, "256"),
                  "%s", msg);
        cr_assert_null(t.data);
    }
}

Test(kquant_quantize, non_finite_input_is_refused_with_its_index)
{
    float w[256] = {0};
    w[200] = NAN;
    qt_quant_params p = {.kind = QT_Q5_K};
    qtensor t;
    char msg[256] = "";
    cr_assert_eq(qt_quantize(&t, w, 1, 256, &p, msg, sizeof msg), QL_ENONFINITE);
    cr_assert(strstr(msg, "200"), "%s", msg);
}

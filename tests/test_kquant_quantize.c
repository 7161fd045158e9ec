/*
 * test_kquant_quantize.c - quantizing into the k-quants and IQ4_NL, IQ4_XS
 * writes llama.cpp's bytes: tests/fixtures/kquant_ref_vectors.h holds the
 * bytes llama.cpp's own quantize_row_q2_K_ref ... _q6_K_ref, _iq4_nl_ref
 * and _iq4_xs_ref wrote (ggml-quants.c compiled by
 * make_kquant_ref_vectors.py, without contraction) for inputs meant to
 * reach every branch: zero, constant, outlier, negative-only, tiny,
 * mixed-scale, tie and random blocks. All seven kinds through qt_quantize,
 * and through kernels/math/qt_kquant_ref.h's block functions.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qt_kquant_ref.h"
#include "qtensor.h"
#include "test_util.h"

#include "fixtures/kquant_ref_vectors.h"

#define N_CASES (sizeof kqr_cases / sizeof *kqr_cases)

static const qt_kind kinds[] = {QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_Q2_K, QT_Q3_K, QT_IQ4_NL, QT_IQ4_XS};
#define N_KINDS (sizeof kinds / sizeof *kinds)

static const unsigned char *expected_bytes(const kqr_case *c, qt_kind kind)
{
    switch (kind) {
    case QT_Q2_K: return c->q2_k;
    case QT_Q3_K: return c->q3_k;
    case QT_Q4_K: return c->q4_k;
    case QT_Q5_K: return c->q5_k;
    case QT_Q6_K: return c->q6_k;
    case QT_IQ4_NL: return c->iq4_nl;
    default: return c->iq4_xs;
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
            size_t want_len =
                (size_t)(k->rows * k->cols / qt_traits_table[kinds[i]].block_size) * bb;
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

/* Every block of every case through the header's block functions, all
 * seven kinds: what a device requantization would call. */
Test(kquant_quantize, block_functions_write_llama_cpp_bytes_for_all_seven_kinds)
{
    const struct {
        const char *name;
        size_t bytes;
        int64_t elems;
        void (*block)(const float *x, uint8_t *blk);
    } ks[] = {
        {"q2_k", QK_Q2_K_BYTES, 256, qk_q2_k_block},
        {"q3_k", QK_Q3_K_BYTES, 256, qk_q3_k_block},
        {"q4_k", QM_Q4_K_BYTES, 256, qk_q4_k_block},
        {"q5_k", QM_Q5_K_BYTES, 256, qk_q5_k_block},
        {"q6_k", QM_Q6_K_BYTES, 256, qk_q6_k_block},
        {"iq4_nl", QM_IQ4_NL_BYTES, QM_IQ4_NL_QK, qk_iq4_nl_block},
        {"iq4_xs", QM_IQ4_XS_BYTES, 256, qk_iq4_xs_block},
    };
    int blocks = 0;
    for (size_t c = 0; c < N_CASES; c++) {
        const kqr_case *k = &kqr_cases[c];
        const unsigned char *want[] = {k->q2_k, k->q3_k,   k->q4_k,  k->q5_k,
                                       k->q6_k, k->iq4_nl, k->iq4_xs};
        for (size_t i = 0; i < 7; i++) {
            for (int64_t b = 0; b < k->rows * k->cols / ks[i].elems; b++) {
                uint8_t got[256];
                memset(got, 0xa5, sizeof got);
                ks[i].block(k->input + b * ks[i].elems, got);
                const unsigned char *w = want[i] + (size_t)b * ks[i].bytes;
                for (size_t j = 0; j < ks[i].bytes; j++)
                    cr_assert_eq(got[j], w[j],
                                 "%s %s block %lld: byte %zu is 0x%02x, llama.cpp wrote 0x%02x",
                                 k->name, ks[i].name, (long long)b, j, got[j], w[j]);
                blocks++;
            }
        }
    }
    cr_assert_gt(blocks, 6 * 2 * 12 + 8 * 2 * 12);
}

/* The quantized tensor reads back through the existing dequantization
 * close to its input: relative RMS error within what 4, 5, 6, 2 and 3 bits
 * and IQ4's 4-bit levels give on normal data (measured 0.070, 0.035, 0.018,
 * 0.30, 0.15, IQ4_NL 0.079, IQ4_XS 0.076; bounds with margin). */
Test(kquant_quantize, round_trip_error_fits_the_bits)
{
    const kqr_case *k = NULL;
    for (size_t c = 0; c < N_CASES; c++)
        if (strcmp(kqr_cases[c].name, "normal_8_rows") == 0)
            k = &kqr_cases[c];
    cr_assert_not_null(k);
    const double bound[] = {0.09, 0.045, 0.025, 0.36, 0.19, 0.10, 0.10};
    int64_t n = k->rows * k->cols;
    float *back = malloc((size_t)n * sizeof *back);
    for (size_t i = 0; i < N_KINDS; i++) {
        qt_quant_params p = {.kind = kinds[i]};
        qtensor t;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK);
        qt_dequantize_rows_ref(&t, 0, k->rows, back);
        test_diff d = test_diff_f32(back, k->input, (size_t)n);
        double rel = test_diff_l2(&d);
        cr_log_info("%s relative rms error %.4f", qt_kind_name(kinds[i]), rel);
        cr_assert_lt(rel, bound[i], "%s: relative error %g", qt_kind_name(kinds[i]), rel);
        cr_assert_gt(rel, bound[i] / 20, "%s: relative error %g is implausibly small",
                     qt_kind_name(kinds[i]), rel);
        qt_free(&t);
    }
    free(back);
}

/* Columns must be whole blocks: 288 (256 + 32) for the super-block kinds,
 * 48 (32 + 16) for IQ4_NL's blocks of 32, which take 288. */
Test(kquant_quantize, columns_not_whole_blocks_are_refused_by_name)
{
    float w[2 * 288];
    for (int i = 0; i < 2 * 288; i++)
        w[i] = 0.01f * (float)(i % 17);
    for (size_t i = 0; i < N_KINDS; i++) {
        int64_t block = qt_traits_table[kinds[i]].block_size;
        int64_t cols = block == 256 ? 288 : 48;
        char want_cols[32], want_block[48];
        snprintf(want_cols, sizeof want_cols, "%lld", (long long)cols);
        snprintf(want_block, sizeof want_block, "block of %lld", (long long)block);
        qt_quant_params p = {.kind = kinds[i]};
        qtensor t;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&t, w, 2, cols, &p, msg, sizeof msg), QL_EINVAL);
        cr_assert(strstr(msg, want_cols) && strstr(msg, qt_kind_name(kinds[i])) &&
                      strstr(msg, want_block),
                  "%s", msg);
        cr_assert_null(t.data);
    }
    qt_quant_params nl = {.kind = QT_IQ4_NL};
    qtensor t;
    char msg[256] = "";
    cr_assert_eq(qt_quantize(&t, w, 2, 288, &nl, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(t.data_bytes, (size_t)(2 * 9 * QM_IQ4_NL_BYTES));
    qt_free(&t);
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

/*
 * test_affine.c - AFFINE against torchao's quant primitives.
 *
 * tests/fixtures/affine_vectors.h holds what torchao 0.18 computed
 * (choose_qparams_affine, quantize_affine, dequantize_affine and the
 * float-zero-point "tinygemm" variants) for the configurations its int8 and
 * int4 weight-only quantization use, and the integer-domain variants: the
 * integers, scales and zero points must be the same bits, and so must the
 * dequantized weights.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"
#include "test_util.h"

#include "fixtures/affine_vectors.h"

/* Code of element (r, c) as an integer in [qmin, qmax], from our storage. */
static int code_at(const qtensor *t, long r, long c)
{
    const uint8_t *row = t->data + r * (long)t->row_stride;
    unsigned u = t->bits == 8 ? row[c] : (c & 1) ? (row[c / 2] & 0x0f) : (row[c / 2] >> 4);
    return (int)u + t->qmin;
}

Test(affine, quantize_matches_torchao_bit_for_bit)
{
    for (size_t i = 0; i < sizeof affv_cases / sizeof *affv_cases; i++) {
        const affv_case *k = &affv_cases[i];
        qt_quant_params p = {
            .kind = QT_AFFINE,
            .bits = k->bits,
            .group_size = k->group_size == k->cols ? 0 : k->group_size,
            .symmetric = k->symmetric != 0,
            .zero_domain = k->zero_float_domain ? QT_ZERO_FLOAT : QT_ZERO_INT,
            .qmin = k->qmin,
            .qmax = k->qmax,
            .eps = k->eps,
        };
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        cr_assert_eq(t.qmin, k->qmin, "%s", k->name);
        cr_assert_eq(t.qmax, k->qmax, "%s", k->name);
        long groups = k->rows * (k->cols / k->group_size);
        cr_assert_eq(t.rows * t.groups_per_row, groups, "%s: groups", k->name);
        for (long g = 0; g < groups; g++) {
            cr_assert(same_bits(t.scales[g], k->scales[g]), "%s: scale %ld: %a vs %a", k->name, g,
                      (double)t.scales[g], (double)k->scales[g]);
            cr_assert(
                same_bits(t.zeros[g], k->zeros[g]) || (t.zeros[g] == 0.0f && k->zeros[g] == 0.0f),
                "%s: zero %ld: %a vs %a", k->name, g, (double)t.zeros[g], (double)k->zeros[g]);
        }
        for (long r = 0; r < k->rows; r++)
            for (long c = 0; c < k->cols; c++)
                cr_assert_eq(code_at(&t, r, c), k->q[r * k->cols + c], "%s: q[%ld][%ld]", k->name,
                             r, c);
        float *ref = malloc((size_t)(k->rows * k->cols) * sizeof *ref);
        float *fast = malloc((size_t)(k->rows * k->cols) * sizeof *fast);
        qt_dequantize_rows_ref(&t, 0, k->rows, ref);
        qt_dequantize_rows(&t, 0, k->rows, fast);
        for (long e = 0; e < k->rows * k->cols; e++) {
            cr_assert(same_bits(ref[e], k->dequant[e]) || (ref[e] == 0.0f && k->dequant[e] == 0.0f),
                      "%s: value %ld: %a vs %a", k->name, e, (double)ref[e], (double)k->dequant[e]);
            cr_assert(same_bits(fast[e], ref[e]), "%s: fast value %ld", k->name, e);
        }
        free(ref);
        free(fast);
        qt_free(&t);
    }
}

Test(affine, ranges_that_do_not_fit_the_bits_are_refused)
{
    float w[64] = {0};
    qtensor t;
    char msg[256];
    qt_quant_params p = {.kind = QT_AFFINE, .bits = 4, .qmin = -8, .qmax = 8};
    cr_assert_eq(qt_quantize(&t, w, 1, 64, &p, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "[-8, 8]"), "%s", msg);
}

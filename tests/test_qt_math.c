/*
 * test_qt_math.c - the per-element arithmetic of kernels/qt_math.h, the
 * functions the CUDA kernels run, against the CPU scalar reference.
 *
 * Why shaped so: there is no GPU in CI, so what can be pinned here is that
 * a GPU thread's view of the tensor (its raw arrays and one element index,
 * nothing else) gives the same bits as qt_dequantize_rows_ref, which is
 * itself pinned against bitsandbytes, torchao and gguf-py by test_bnb4,
 * test_affine and test_gguf. element_as_a_gpu_thread below calls qt_math.h
 * alone, element by element, for every quantized kind; a device kernel that
 * computes the same indexes and calls the same functions (built with
 * --fmad=false) can differ from the CPU only in its indexing or packing,
 * which tests/gpu/test_cuda_dequant.c checks on a GPU.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "qt_math.h"
#include "qtensor.h"
#include "test_util.h"

#include "fixtures/gguf_vectors.h"

/*
 * Element e (row-major) of t, computed the way a device thread does: from
 * t's raw arrays and e alone, through qt_math.h. Dense kinds are not asked
 * for here (their conversions are qt_math.h's already, pinned by
 * test_dense).
 */
static float element_as_a_gpu_thread(const qtensor *t, int64_t e)
{
    switch (t->kind) {
    case QT_NF4:
    case QT_FP4: {
        int64_t b = e / t->blocksize;
        float absmax = t->nested
                           ? qm_nested_absmax(t->absmax_codes, t->nested_code, t->nested_absmax,
                                              t->nested_blocksize, t->nested_offset, b)
                           : t->absmax[b];
        return qm_4bit_element(t->data, t->codebook, absmax, e);
    }
    case QT_AFFINE:
        return qm_affine_element(t->data, t->row_stride, t->bits, t->qmin,
                                 t->zero_domain == QT_ZERO_FLOAT, qm_affine_mid(t->qmin, t->qmax),
                                 t->group_size, t->groups_per_row, t->scales, t->zeros, e / t->cols,
                                 e % t->cols);
    case QT_Q4_0: return qm_q4_0_element(t->data, e);
    case QT_Q4_1: return qm_q4_1_element(t->data, e);
    case QT_Q8_0: return qm_q8_0_element(t->data, e);
    default: cr_assert_fail("kind %s has no element function", qt_kind_name(t->kind));
    }
    return 0.0f;
}

/* Every element of t through qt_math.h equals qt_dequantize_rows_ref, bit
 * for bit; also rows [1, rows) read on their own, as a row-split caller
 * does. */
static void assert_elements_match_reference(const qtensor *t, const char *what)
{
    const int64_t n = t->rows * t->cols;
    float *ref = malloc((size_t)n * sizeof *ref);
    cr_assert(ref != NULL);
    qt_dequantize_rows_ref(t, 0, t->rows, ref);
    for (int64_t e = 0; e < n; e++) {
        float got = element_as_a_gpu_thread(t, e);
        cr_assert(same_bits(got, ref[e]),
                  "%s: element %lld (row %lld, col %lld): qt_math %a, ref %a", what, (long long)e,
                  (long long)(e / t->cols), (long long)(e % t->cols), (double)got, (double)ref[e]);
    }
    if (t->rows > 1) {
        qt_dequantize_rows_ref(t, 1, t->rows - 1, ref);
        for (int64_t e = t->cols; e < n; e++)
            cr_assert(same_bits(element_as_a_gpu_thread(t, e), ref[e - t->cols]),
                      "%s: element %lld from row 1 on", what, (long long)e);
    }
    free(ref);
}

/*
 * Weights shaped to reach the corners of every format: normal values with a
 * per-row scale from 1e-6 (GGUF halves become subnormal) to 10, a few
 * outliers, exact zeros, one all-zero row (zero scales and absmax) and one
 * all-positive row (asymmetric minimum above zero).
 */
static float *random_weights(int64_t rows, int64_t cols, uint64_t seed)
{
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    cr_assert(w != NULL);
    uint64_t s = seed;
    static const float row_scales[] = {0.02f, 1e-6f, 10.0f, 0.5f, 3e-5f};
    for (int64_t r = 0; r < rows; r++) {
        float scale = row_scales[r % 5];
        for (int64_t c = 0; c < cols; c++) {
            float v = test_normal(&s) * scale;
            if (test_uniform(&s) < 0.01)
                v = 0.0f;
            else if (test_uniform(&s) < 0.002)
                v *= 50.0f;
            if (r == 2 % rows)
                v = fabsf(v) + scale;
            if (r == rows - 1 && rows > 3)
                v = 0.0f;
            w[r * cols + c] = v;
        }
    }
    return w;
}

static void quantize_and_check(const qt_quant_params *p, int64_t rows, int64_t cols, uint64_t seed,
                               const char *what)
{
    float *w = random_weights(rows, cols, seed);
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_quantize(&t, w, rows, cols, p, msg, sizeof msg), QT_OK, "%s: %s", what, msg);
    free(w);
    char name[160];
    snprintf(name, sizeof name, "%s %lldx%lld", what, (long long)rows, (long long)cols);
    assert_elements_match_reference(&t, name);
    qt_free(&t);
}

Test(qt_math, nf4_and_fp4_elements_match_the_reference_bit_for_bit)
{
    const qt_kind kinds[] = {QT_NF4, QT_FP4};
    const struct {
        int32_t blocksize;
        int64_t rows, cols;
    } shapes[] = {{64, 16, 128}, {32, 37, 45}, {4096, 7, 1000}, {64, 1, 1}};
    uint64_t seed = 11;
    for (int k = 0; k < 2; k++)
        for (int dq = 0; dq < 2; dq++)
            for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
                qt_quant_params p = {
                    .kind = kinds[k], .blocksize = shapes[s].blocksize, .double_quant = dq};
                char what[64];
                snprintf(what, sizeof what, "%s%s bs%d", qt_kind_name(kinds[k]), dq ? "-dq" : "",
                         (int)shapes[s].blocksize);
                quantize_and_check(&p, shapes[s].rows, shapes[s].cols, seed++, what);
            }
}

/* Double quantization over more than one nested block of 256 absmax. */
Test(qt_math, nf4_double_quant_across_nested_blocks_matches_the_reference)
{
    qt_quant_params p = {.kind = QT_NF4, .blocksize = 64, .double_quant = true};
    quantize_and_check(&p, 64, 1024, 7, "nf4-dq 1024 blocks");
}

Test(qt_math, affine_elements_match_the_reference_bit_for_bit)
{
    const struct {
        const char *what;
        qt_quant_params p;
        int64_t rows, cols;
    } cases[] = {
        /* torchao int4 weight-only ("tinygemm"): float zero, groups, eps 1e-6 */
        {"int4 float zero g32",
         {.kind = QT_AFFINE,
          .bits = 4,
          .group_size = 32,
          .zero_domain = QT_ZERO_FLOAT,
          .eps = 1e-6f},
         12,
         128},
        /* odd columns: each row starts on a byte, the last nibble half used */
        {"int4 float zero g11 odd cols",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 11, .zero_domain = QT_ZERO_FLOAT},
         9,
         33},
        {"int4 int zero g32",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .zero_domain = QT_ZERO_INT},
         12,
         128},
        {"int4 int zero g11 odd cols",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 11, .zero_domain = QT_ZERO_INT},
         9,
         33},
        {"int4 symmetric g16",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 16, .symmetric = true},
         8,
         64},
        /* torchao int8 weight-only: symmetric, one group per row */
        {"int8 per channel", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, 12, 100},
        /* int8 asymmetric on the signed range, as torchao's int8 asymmetric */
        {"int8 per channel asym signed range",
         {.kind = QT_AFFINE, .bits = 8, .zero_domain = QT_ZERO_INT, .qmin = -128, .qmax = 127},
         12,
         100},
        {"int8 float zero g25",
         {.kind = QT_AFFINE, .bits = 8, .group_size = 25, .zero_domain = QT_ZERO_FLOAT},
         6,
         75},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        quantize_and_check(&cases[i].p, cases[i].rows, cases[i].cols, 100 + i, cases[i].what);
}

Test(qt_math, gguf_elements_match_the_reference_bit_for_bit)
{
    const qt_kind kinds[] = {QT_Q4_0, QT_Q4_1, QT_Q8_0};
    for (int k = 0; k < 3; k++) {
        qt_quant_params p = {.kind = kinds[k]};
        quantize_and_check(&p, 10, 96, 200 + (uint64_t)k, qt_kind_name(kinds[k]));
        quantize_and_check(&p, 1, 32, 210 + (uint64_t)k, qt_kind_name(kinds[k]));
    }
}

/* llama.cpp's own blocks (made by gguf-py): the element functions give the
 * fixture's dequantization exactly, without going through qtensor code. */
Test(qt_math, gguf_elements_of_gguf_py_blocks_equal_gguf_py)
{
    for (size_t i = 0; i < GGUFV_N_CASES; i++) {
        const ggufv_case *k = &ggufv_cases[i];
        for (long e = 0; e < k->rows * k->cols; e++) {
            float got = !strcmp(k->type, "q4_0")   ? qm_q4_0_element(k->blocks, e)
                        : !strcmp(k->type, "q4_1") ? qm_q4_1_element(k->blocks, e)
                                                   : qm_q8_0_element(k->blocks, e);
            cr_assert(same_bits(got, k->dequant[e]), "%s: element %ld: %a vs %a", k->name, e,
                      (double)got, (double)k->dequant[e]);
        }
    }
}

/* The block sizes qt_math.h indexes with are the traits table's. */
Test(qt_math, gguf_block_bytes_agree_with_the_traits_table)
{
    cr_assert_eq(qt_traits_table[QT_Q4_0].block_bytes, (size_t)QM_Q4_0_BYTES);
    cr_assert_eq(qt_traits_table[QT_Q4_1].block_bytes, (size_t)QM_Q4_1_BYTES);
    cr_assert_eq(qt_traits_table[QT_Q8_0].block_bytes, (size_t)QM_Q8_0_BYTES);
    for (qt_kind k = QT_Q4_0; k <= QT_Q8_0; k++)
        cr_assert_eq(qt_traits_table[k].block_size, QM_GGUF_QK);
}

/* The float-domain mid is torchao's (qmin + qmax + 1) / 2, unrounded. */
Test(qt_math, affine_steps_follow_torchao_formulas)
{
    cr_assert(same_bits(qm_affine_mid(0, 15), 8.0f));
    cr_assert(same_bits(qm_affine_mid(-8, 7), 0.0f));
    cr_assert(same_bits(qm_affine_mid(0, 254), 127.5f));
    /* integer domain: (q - zero) * scale, q = code + qmin */
    cr_assert(
        same_bits(qm_affine_value(3, -8, false, 0.0f, 0.5f, 2.0f), (float)(3 - 8 - 2) * 0.5f));
    /* float domain: ((q - mid) * scale) + zero, two roundings */
    float scale = 0.1f, zero = 0.3f;
    float want = (float)(5 - 8) * scale;
    want = want + zero;
    cr_assert(same_bits(qm_affine_value(5, 0, true, 8.0f, scale, zero), want));
}

/*
 * test_qt_math.c - the per-element arithmetic of kernels/math/qt_math.h, the
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
    cr_assert_eq(qt_quantize(&t, w, rows, cols, p, msg, sizeof msg), QL_OK, "%s: %s", what, msg);
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

/* ---- the GGUF split layout and 16-byte chunks (the CUDA matvec's view) ---- */

/* A GGUF tensor's blocks split as qt_cuda_gguf_upload splits them. */
typedef struct split_gguf {
    int block_bytes, qs_bytes;
    int64_t n_blocks;
    uint8_t *qs;
    uint16_t *d, *m;
} split_gguf;

static split_gguf split_blocks(const qtensor *t)
{
    split_gguf s;
    s.block_bytes = (int)qt_traits_table[t->kind].block_bytes;
    s.qs_bytes = qm_gguf_qs_bytes(s.block_bytes);
    s.n_blocks = t->rows * t->cols / QM_GGUF_QK;
    s.qs = malloc((size_t)(s.n_blocks * s.qs_bytes));
    s.d = malloc((size_t)s.n_blocks * sizeof *s.d);
    s.m = malloc((size_t)s.n_blocks * sizeof *s.m);
    cr_assert(s.qs && s.d && s.m);
    for (int64_t b = 0; b < s.n_blocks; b++)
        qm_gguf_split_block(t->data + b * s.block_bytes, s.block_bytes, s.qs + b * s.qs_bytes,
                            &s.d[b], &s.m[b]);
    return s;
}

static void free_split(split_gguf *s)
{
    free(s->qs);
    free(s->d);
    free(s->m);
}

/* Values per 16-byte chunk of t's codes. */
static int chunk_elements(const qtensor *t)
{
    switch (t->kind) {
    case QT_F32: return 4;
    case QT_F16:
    case QT_BF16: return 8;
    case QT_AFFINE: return t->bits == 8 ? 16 : 32;
    case QT_Q8_0: return 16;
    default: return 32;
    }
}

/*
 * Value j of chunk k of row r, the way a lane of the fused matvec computes
 * it: the chunk's 16 bytes found from (r, k) alone, the chunk's one scale
 * looked up once, then qt_math.h's chunk function. GGUF kinds read the
 * split layout s.
 */
static float chunk_value_as_a_matvec_lane(const qtensor *t, const split_gguf *s, int64_t r,
                                          int64_t k, int j)
{
    const int n = chunk_elements(t);
    const int64_t c0 = k * n;
    switch (t->kind) {
    case QT_F32:
    case QT_F16:
    case QT_BF16: {
        size_t elem = t->kind == QT_F32 ? 4 : 2;
        const uint8_t *chunk = t->data + (size_t)(r * t->cols + c0) * elem;
        return t->kind == QT_F32   ? qm_f32_chunk_value(chunk, j)
               : t->kind == QT_F16 ? qm_f16_chunk_value(chunk, j)
                                   : qm_bf16_chunk_value(chunk, j);
    }
    case QT_NF4:
    case QT_FP4: {
        int64_t e0 = r * t->cols + c0;
        int64_t b = e0 / t->blocksize;
        float absmax = t->nested
                           ? qm_nested_absmax(t->absmax_codes, t->nested_code, t->nested_absmax,
                                              t->nested_blocksize, t->nested_offset, b)
                           : t->absmax[b];
        return qm_4bit_chunk_value(t->data + e0 / 2, j, t->codebook, absmax);
    }
    case QT_AFFINE: {
        int64_t g = r * t->groups_per_row + c0 / t->group_size;
        const uint8_t *chunk = t->data + r * t->row_stride + k * QM_CHUNK_BYTES;
        return qm_affine_chunk_value(chunk, j, t->bits, t->qmin, t->zero_domain == QT_ZERO_FLOAT,
                                     qm_affine_mid(t->qmin, t->qmax), t->scales[g], t->zeros[g]);
    }
    case QT_Q4_0:
    case QT_Q4_1: {
        int64_t b = r * (t->cols / QM_GGUF_QK) + k;
        const uint8_t *qs = s->qs + b * QM_Q4_QS_BYTES;
        float d = qm_f16_to_f32(s->d[b]);
        return t->kind == QT_Q4_0 ? qm_q4_0_chunk_value(qs, j, d)
                                  : qm_q4_1_chunk_value(qs, j, d, qm_f16_to_f32(s->m[b]));
    }
    case QT_Q8_0: {
        int64_t b = r * (t->cols / QM_GGUF_QK) + k / 2;
        const uint8_t *qs = s->qs + b * QM_Q8_QS_BYTES + (k % 2) * QM_CHUNK_BYTES;
        return qm_q8_0_chunk_value(qs, j, qm_f16_to_f32(s->d[b]));
    }
    default: cr_assert_fail("kind %s has no chunk function", qt_kind_name(t->kind));
    }
    return 0.0f;
}

static void chunks_match_reference(const qt_quant_params *p, int64_t rows, int64_t cols,
                                   uint64_t seed, const char *what)
{
    float *w = random_weights(rows, cols, seed);
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_quantize(&t, w, rows, cols, p, msg, sizeof msg), QL_OK, "%s: %s", what, msg);
    free(w);
    split_gguf s = {0};
    if (qt_traits_table[t.kind].is_gguf)
        s = split_blocks(&t);
    float *ref = malloc((size_t)(rows * cols) * sizeof *ref);
    cr_assert(ref != NULL);
    qt_dequantize_rows_ref(&t, 0, rows, ref);
    const int n = chunk_elements(&t);
    cr_assert_eq(cols % n, 0, "%s: %lld columns do not split into chunks of %d", what,
                 (long long)cols, n);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols / n; k++)
            for (int j = 0; j < n; j++) {
                float got = chunk_value_as_a_matvec_lane(&t, &s, r, k, j);
                float want = ref[r * cols + k * n + j];
                cr_assert(same_bits(got, want), "%s: row %lld chunk %lld value %d: %a vs ref %a",
                          what, (long long)r, (long long)k, j, (double)got, (double)want);
            }
    free(ref);
    free_split(&s);
    qt_free(&t);
}

Test(qt_math, chunk_values_match_the_reference_for_every_kind_and_layout)
{
    const struct {
        const char *what;
        qt_quant_params p;
    } cases[] = {
        {"f32", {.kind = QT_F32}},
        {"f16", {.kind = QT_F16}},
        {"bf16", {.kind = QT_BF16}},
        {"nf4 bs32", {.kind = QT_NF4, .blocksize = 32}},
        {"nf4 bs64", {.kind = QT_NF4, .blocksize = 64}},
        {"nf4-dq bs64", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}},
        {"fp4 bs128", {.kind = QT_FP4, .blocksize = 128}},
        {"fp4-dq bs4096", {.kind = QT_FP4, .blocksize = 4096, .double_quant = true}},
        {"int4 float zero g32",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .zero_domain = QT_ZERO_FLOAT}},
        {"int4 int zero g64",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 64, .zero_domain = QT_ZERO_INT}},
        {"int4 symmetric g128", {.kind = QT_AFFINE, .bits = 4, .group_size = 128, .symmetric = 1}},
        {"int8 per channel", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}},
        {"int8 asym signed range g32",
         {.kind = QT_AFFINE,
          .bits = 8,
          .group_size = 32,
          .zero_domain = QT_ZERO_INT,
          .qmin = -128,
          .qmax = 127}},
        {"int8 float zero g16",
         {.kind = QT_AFFINE, .bits = 8, .group_size = 16, .zero_domain = QT_ZERO_FLOAT}},
        {"q4_0", {.kind = QT_Q4_0}},
        {"q4_1", {.kind = QT_Q4_1}},
        {"q8_0", {.kind = QT_Q8_0}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        chunks_match_reference(&cases[i].p, 7, 256, 300 + i, cases[i].what);
        chunks_match_reference(&cases[i].p, 3, 4096, 400 + i, cases[i].what);
    }
}

Test(qt_math, gguf_split_elements_match_the_reference_and_join_back_to_the_blocks)
{
    const qt_kind kinds[] = {QT_Q4_0, QT_Q4_1, QT_Q8_0};
    for (int k = 0; k < 3; k++) {
        qt_quant_params p = {.kind = kinds[k]};
        float *w = random_weights(11, 96, 500 + (uint64_t)k);
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, w, 11, 96, &p, msg, sizeof msg), QL_OK, "%s", msg);
        free(w);
        split_gguf s = split_blocks(&t);
        float *ref = malloc(11 * 96 * sizeof *ref);
        cr_assert(ref != NULL);
        qt_dequantize_rows_ref(&t, 0, 11, ref);
        for (int64_t e = 0; e < 11 * 96; e++) {
            float got = kinds[k] == QT_Q4_0   ? qm_q4_0_split_element(s.qs, s.d, e)
                        : kinds[k] == QT_Q4_1 ? qm_q4_1_split_element(s.qs, s.d, s.m, e)
                                              : qm_q8_0_split_element(s.qs, s.d, e);
            cr_assert(same_bits(got, ref[e]), "%s: element %lld: %a vs ref %a",
                      qt_kind_name(kinds[k]), (long long)e, (double)got, (double)ref[e]);
        }
        uint8_t *joined = malloc(t.data_bytes);
        cr_assert(joined != NULL);
        memset(joined, 0xa5, t.data_bytes);
        for (int64_t b = 0; b < s.n_blocks; b++)
            qm_gguf_join_block(joined + b * s.block_bytes, s.block_bytes, s.qs + b * s.qs_bytes,
                               s.d[b], kinds[k] == QT_Q4_1 ? s.m[b] : 0);
        cr_assert(memcmp(joined, t.data, t.data_bytes) == 0, "%s: split then join changed bytes",
                  qt_kind_name(kinds[k]));
        free(joined);
        free(ref);
        free_split(&s);
        qt_free(&t);
    }
}

/* gguf-py's own blocks through the split layout give gguf-py's floats. */
Test(qt_math, gguf_split_elements_of_gguf_py_blocks_equal_gguf_py)
{
    for (size_t i = 0; i < GGUFV_N_CASES; i++) {
        const ggufv_case *k = &ggufv_cases[i];
        const int bb = !strcmp(k->type, "q4_0")   ? QM_Q4_0_BYTES
                       : !strcmp(k->type, "q4_1") ? QM_Q4_1_BYTES
                                                  : QM_Q8_0_BYTES;
        const int qsb = qm_gguf_qs_bytes(bb);
        const long nb = k->rows * k->cols / QM_GGUF_QK;
        uint8_t *qs = malloc((size_t)(nb * qsb));
        uint16_t *d = malloc((size_t)nb * sizeof *d), *m = malloc((size_t)nb * sizeof *m);
        cr_assert(qs && d && m);
        for (long b = 0; b < nb; b++)
            qm_gguf_split_block(k->blocks + b * bb, bb, qs + b * qsb, &d[b], &m[b]);
        for (long e = 0; e < k->rows * k->cols; e++) {
            float got = bb == QM_Q4_0_BYTES   ? qm_q4_0_split_element(qs, d, e)
                        : bb == QM_Q4_1_BYTES ? qm_q4_1_split_element(qs, d, m, e)
                                              : qm_q8_0_split_element(qs, d, e);
            cr_assert(same_bits(got, k->dequant[e]), "%s: element %ld: %a vs %a", k->name, e,
                      (double)got, (double)k->dequant[e]);
        }
        free(qs);
        free(d);
        free(m);
    }
}

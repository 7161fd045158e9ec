/*
 * test_gguf.c - Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS and MXFP4 against llama.cpp's byte layout.
 *
 * tests/fixtures/gguf_vectors.h holds blocks made by gguf-py's quantizers
 * (which mirror ggml's reference quantizers) with their dequantization:
 * zero and constant blocks, a block whose largest magnitude is negative,
 * rounding ties, random values. Reading the blocks in place must give the
 * same floats bit for bit, and quantizing the inputs the same bytes.
 * tests/fixtures/gguf_kquant_vectors.h does the same for Q5_0 and Q5_1
 * (gguf-py's quantizer and dequantizer) and for the k-quants and IQ4_NL,
 * IQ4_XS (blocks drawn by the script, gguf-py's dequantization); the
 * script checks gguf-py against a transliteration of llama.cpp's
 * ggml-quants.c first, and check_gguf_kquant_llama_cpp.py checks the
 * header against llama.cpp's C itself.
 * tests/fixtures/mxfp4_vectors.h holds MXFP4 blocks with gguf-py's
 * dequantization (equal to llama.cpp's C), inputs with the bytes llama.cpp's
 * quantize_row_mxfp4_ref wrote, and GPT-OSS's Hugging Face blocks/scales
 * pairs with transformers' dequantization of them.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"
#include "test_util.h"

#include "fixtures/gguf_kquant_vectors.h"
#include "fixtures/gguf_vectors.h"
#include "fixtures/mxfp4_vectors.h"

static qt_kind kind_of(const char *type)
{
    int k = qt_kind_from_name(type);
    cr_assert(k == QT_Q4_0 || k == QT_Q4_1 || k == QT_Q8_0, "type %s", type);
    return (qt_kind)k;
}

/* blocks (bytes of a rows x cols tensor of kind) read in place: the scalar
 * dequantization gives want bit for bit, and the fast one the scalar's. */
static void check_dequantize(const char *name, qt_kind kind, const uint8_t *blocks, size_t bytes,
                             int64_t rows, int64_t cols, const float *want)
{
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_gguf_blocks(&t, kind, blocks, bytes, rows, cols, msg, sizeof msg), QL_OK,
                 "%s: %s", name, msg);
    long n = rows * cols;
    float *ref = malloc((size_t)n * sizeof *ref), *fast = malloc((size_t)n * sizeof *fast);
    qt_dequantize_rows_ref(&t, 0, rows, ref);
    qt_dequantize_rows(&t, 0, rows, fast);
    for (long i = 0; i < n; i++) {
        cr_assert(same_bits(ref[i], want[i]), "%s: value %ld (block %ld): %a vs %a", name, i,
                  i / 32, (double)ref[i], (double)want[i]);
        cr_assert(same_bits(fast[i], ref[i]), "%s: fast value %ld: %a vs %a", name, i,
                  (double)fast[i], (double)ref[i]);
    }
    free(ref);
    free(fast);
    qt_free(&t);
}

Test(gguf, blocks_read_in_place_dequantize_bit_for_bit)
{
    for (size_t c = 0; c < sizeof ggufv_cases / sizeof *ggufv_cases; c++) {
        const ggufv_case *k = &ggufv_cases[c];
        check_dequantize(k->name, kind_of(k->type), k->blocks, (size_t)k->blocks_len, k->rows,
                         k->cols, k->dequant);
    }
}

Test(gguf, quantize_writes_llama_cpp_blocks)
{
    for (size_t c = 0; c < sizeof ggufv_cases / sizeof *ggufv_cases; c++) {
        const ggufv_case *k = &ggufv_cases[c];
        qt_quant_params p = {.kind = kind_of(k->type)};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        cr_assert_eq((long)t.data_bytes, k->blocks_len, "%s: size", k->name);
        for (long i = 0; i < k->blocks_len; i++)
            cr_assert_eq(t.data[i], k->blocks[i], "%s: byte %ld (block %ld): %02x vs %02x", k->name,
                         i, i / (long)qt_traits_table[t.kind].block_bytes, t.data[i], k->blocks[i]);
        qt_free(&t);
    }
}

Test(gguf, wrong_sizes_and_kinds_are_refused)
{
    uint8_t blocks[36] = {0};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q4_0, blocks, 36, 1, 64, msg, sizeof msg), QL_OK);
    qt_free(&t);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q4_0, blocks, 35, 1, 64, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "35 bytes") && strstr(msg, "expected 36"), "%s", msg);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q4_0, blocks, 36, 1, 48, msg, sizeof msg), QL_EINVAL);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_NF4, blocks, 36, 1, 64, msg, sizeof msg),
                 QL_EUNSUPPORTED);
    cr_assert(strstr(msg, "nf4"), "%s", msg);
}

/* --- Q5_0, Q5_1 and the k-quants ---------------------------------------- */

static qt_kind new_kind_of(const char *type)
{
    int k = qt_kind_from_name(type);
    cr_assert(k == QT_Q5_0 || k == QT_Q5_1 || k == QT_Q4_K || k == QT_Q5_K || k == QT_Q6_K ||
                  k == QT_Q2_K || k == QT_Q3_K || k == QT_IQ4_NL || k == QT_IQ4_XS,
              "type %s", type);
    return (qt_kind)k;
}

Test(gguf, q5_and_kquant_blocks_dequantize_as_gguf_py_bit_for_bit)
{
    size_t n_cases = sizeof gkqv_cases / sizeof *gkqv_cases;
    bool seen[QT_KIND_COUNT] = {false};
    for (size_t c = 0; c < n_cases; c++) {
        const gkqv_case *k = &gkqv_cases[c];
        qt_kind kind = new_kind_of(k->type);
        seen[kind] = true;
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_from_gguf_blocks(&t, kind, k->blocks, (size_t)k->blocks_len, k->rows,
                                         k->cols, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        long n = k->rows * k->cols;
        float *ref = malloc((size_t)n * sizeof *ref), *fast = malloc((size_t)n * sizeof *fast);
        qt_dequantize_rows_ref(&t, 0, k->rows, ref);
        qt_dequantize_rows(&t, 0, k->rows, fast);
        for (long i = 0; i < n; i++) {
            cr_assert(same_bits(ref[i], k->dequant[i]), "%s: value %ld: %a vs %a", k->name, i,
                      (double)ref[i], (double)k->dequant[i]);
            cr_assert(same_bits(fast[i], ref[i]), "%s: fast value %ld: %a vs %a", k->name, i,
                      (double)fast[i], (double)ref[i]);
        }
        /* the last row alone, as an embedding lookup reads it */
        qt_dequantize_rows(&t, k->rows - 1, 1, fast);
        cr_assert_eq(memcmp(fast, ref + (k->rows - 1) * k->cols, (size_t)k->cols * 4), 0,
                     "%s: last row alone", k->name);
        free(ref);
        free(fast);
        qt_free(&t);
    }
    const qt_kind kinds[] = {QT_Q5_0, QT_Q5_1, QT_Q4_K,   QT_Q5_K,  QT_Q6_K,
                             QT_Q2_K, QT_Q3_K, QT_IQ4_NL, QT_IQ4_XS};
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++)
        cr_assert(seen[kinds[i]], "no vectors for %s", qt_kind_name(kinds[i]));
}

Test(gguf, q5_quantize_writes_llama_cpp_blocks)
{
    int n_quantized = 0;
    for (size_t c = 0; c < sizeof gkqv_cases / sizeof *gkqv_cases; c++) {
        const gkqv_case *k = &gkqv_cases[c];
        if (!k->input)
            continue;
        qt_quant_params p = {.kind = new_kind_of(k->type)};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        cr_assert_eq((long)t.data_bytes, k->blocks_len, "%s: size", k->name);
        for (long i = 0; i < k->blocks_len; i++)
            cr_assert_eq(t.data[i], k->blocks[i], "%s: byte %ld (block %ld): %02x vs %02x", k->name,
                         i, i / (long)qt_traits_table[t.kind].block_bytes, t.data[i], k->blocks[i]);
        qt_free(&t);
        n_quantized++;
    }
    cr_assert_eq(n_quantized, 4, "q5_0 and q5_1, two cases each");
}

/* What qt_quantize writes for IQ4_NL and IQ4_XS (llama.cpp's reference
 * quantizers, pinned byte for byte in test_kquant_quantize.c) is a GGUF
 * tensor as a file holds it: the same bytes load through
 * qt_from_gguf_blocks and dequantize to the same values. */
Test(gguf, iq4_quantized_bytes_load_as_gguf_blocks)
{
    float w[2 * 256];
    for (int i = 0; i < 2 * 256; i++)
        w[i] = 0.01f * (float)(i % 17) - 0.07f;
    const qt_kind kinds[] = {QT_IQ4_NL, QT_IQ4_XS};
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
        qt_quant_params p = {.kind = kinds[i]};
        qtensor t, f;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&t, w, 2, 256, &p, msg, sizeof msg), QL_OK, "%s", msg);
        cr_assert_eq(
            qt_from_gguf_blocks(&f, kinds[i], t.data, t.data_bytes, 2, 256, msg, sizeof msg), QL_OK,
            "%s", msg);
        float a[2 * 256], b[2 * 256];
        qt_dequantize_rows_ref(&t, 0, 2, a);
        qt_dequantize_rows_ref(&f, 0, 2, b);
        cr_assert_eq(memcmp(a, b, sizeof a), 0, "%s", qt_kind_name(kinds[i]));
        test_diff d = test_diff_f32(a, w, 2 * 256);
        double err = test_diff_abs(&d);
        cr_assert_lt(err, 0.02, "%s: largest error %g on values within 0.1", qt_kind_name(kinds[i]),
                     err);
        qt_free(&t);
        qt_free(&f);
    }
}

Test(gguf, kquant_blocks_need_whole_super_blocks)
{
    uint8_t blocks[2 * 210] = {0};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q6_K, blocks, 420, 2, 256, msg, sizeof msg), QL_OK);
    qt_free(&t);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q6_K, blocks, 420, 4, 128, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "q6_k block of 256"), "%s", msg);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q4_K, blocks, 420, 2, 256, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "420 bytes") && strstr(msg, "expected 288"), "%s", msg);
}

Test(gguf, later_kinds_have_llama_cpp_names_and_geometry)
{
    const struct {
        const char *name;
        qt_kind kind;
        int32_t block_size;
        size_t block_bytes;
    } want[] = {{"q2_k", QT_Q2_K, 256, 84},
                {"q3_k", QT_Q3_K, 256, 110},
                {"iq4_nl", QT_IQ4_NL, 32, 18},
                {"iq4_xs", QT_IQ4_XS, 256, 136},
                {"mxfp4", QT_MXFP4, 32, 17}};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        cr_assert_eq(qt_kind_from_name(want[i].name), (int)want[i].kind, "%s", want[i].name);
        cr_assert_str_eq(qt_kind_name(want[i].kind), want[i].name);
        const qt_traits *tr = &qt_traits_table[want[i].kind];
        cr_assert(tr->is_gguf && !tr->is_dense, "%s", want[i].name);
        cr_assert_eq(tr->block_size, want[i].block_size, "%s", want[i].name);
        cr_assert_eq(tr->block_bytes, want[i].block_bytes, "%s", want[i].name);
        cr_assert(tr->matmul_avx2 && tr->dequantize_rows_avx2, "%s has no AVX2 path", want[i].name);
    }
}

/* IQ4_NL's blocks of 32 take the 576-column rows that 256-blocks cannot
 * (why llama-quantize falls back to it); IQ4_XS's super-blocks refuse them. */
Test(gguf, iq4_nl_takes_rows_of_576_and_iq4_xs_refuses_them)
{
    static uint8_t blocks[2 * 18 * 18];
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_IQ4_NL, blocks, sizeof blocks, 2, 576, msg, sizeof msg),
                 QL_OK, "%s", msg);
    cr_assert_eq(t.row_stride, 18 * 18);
    qt_free(&t);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_IQ4_XS, blocks, sizeof blocks, 2, 576, msg, sizeof msg),
                 QL_EINVAL);
    cr_assert(strstr(msg, "iq4_xs block of 256"), "%s", msg);
    cr_assert_eq(qt_from_gguf_blocks(&t, QT_Q3_K, blocks, 219, 1, 512, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "219 bytes") && strstr(msg, "expected 220"), "%s", msg);
}

/* --- MXFP4 ---------------------------------------------------------------- */

/* Every E8M0 scale byte (0 and 1 subnormal, 255 overflowing to infinity
 * with the largest levels) with every code: the scalar and the AVX2
 * dequantization give gguf-py's (and llama.cpp's) bits. */
Test(gguf, mxfp4_blocks_dequantize_as_gguf_py_bit_for_bit)
{
    size_t n_cases = sizeof mxv_deq_cases / sizeof *mxv_deq_cases;
    for (size_t c = 0; c < n_cases; c++) {
        const mxv_deq_case *k = &mxv_deq_cases[c];
        check_dequantize(k->name, QT_MXFP4, k->blocks, (size_t)(k->rows * k->cols / 32 * 17),
                         k->rows, k->cols, k->values);
    }
    cr_assert_geq(n_cases, 2);
}

/* qt_quantize into MXFP4 writes quantize_row_mxfp4_ref's bytes: zeros of
 * both signs, ties between levels, a block's largest |x| just below a
 * power of two (where log2f rounds up), subnormal blocks (the scale byte
 * wraps below 0), values near FLT_MAX. */
Test(gguf, mxfp4_quantize_writes_llama_cpp_bytes)
{
    size_t n_cases = sizeof mxv_q_cases / sizeof *mxv_q_cases;
    for (size_t c = 0; c < n_cases; c++) {
        const mxv_q_case *k = &mxv_q_cases[c];
        qt_quant_params p = {.kind = QT_MXFP4};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        size_t want = (size_t)(k->rows * k->cols / 32 * 17);
        cr_assert_eq(t.data_bytes, want, "%s: size", k->name);
        for (size_t i = 0; i < want; i++)
            cr_assert_eq(t.data[i], k->bytes[i],
                         "%s: byte %zu (block %zu, offset %zu) is 0x%02x, llama.cpp wrote 0x%02x",
                         k->name, i, i / 17, i % 17, t.data[i], k->bytes[i]);
        qt_free(&t);
    }
    cr_assert_geq(n_cases, 13, "every input the generator writes");
}

/* A GPT-OSS checkpoint's blocks/scales pair, one expert's slab at a time,
 * becomes ggml's blocks that dequantize to transformers' values (equal as
 * numbers: transformers' code 8 is -0.0, ggml's +0.0). */
Test(gguf, mxfp4_hf_pair_dequantizes_as_transformers)
{
    int experts = 0;
    for (size_t c = 0; c < sizeof mxv_hf_cases / sizeof *mxv_hf_cases; c++) {
        const mxv_hf_case *k = &mxv_hf_cases[c];
        int64_t n = k->rows * k->cols;
        for (int64_t e = 0; e < k->experts; e++, experts++) {
            qtensor t;
            char msg[256];
            cr_assert_eq(qt_from_mxfp4_hf(&t, k->blocks + e * n / 2, k->scales + e * n / 32,
                                          k->rows, k->cols, msg, sizeof msg),
                         QL_OK, "%s: %s", k->name, msg);
            cr_assert(t.kind == QT_MXFP4 && t.rows == k->rows && t.cols == k->cols &&
                      t.row_stride == (size_t)(k->cols / 32 * 17) && !t.data_borrowed);
            float *got = malloc((size_t)n * sizeof *got);
            qt_dequantize_rows(&t, 0, k->rows, got);
            const float *want = k->values + e * n;
            for (int64_t i = 0; i < n; i++)
                cr_assert(got[i] == want[i], "%s expert %lld: value %lld (row %lld): %a vs %a",
                          k->name, (long long)e, (long long)i, (long long)(i / k->cols),
                          (double)got[i], (double)want[i]);
            free(got);
            qt_free(&t);
        }
    }
    cr_assert_geq(experts, 3);
}

Test(gguf, mxfp4_hf_pair_needs_whole_blocks)
{
    uint8_t blocks[64] = {0}, scales[4] = {0};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_mxfp4_hf(&t, blocks, scales, 2, 48, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "[2, 48]") && strstr(msg, "block of 32"), "%s", msg);
    cr_assert_null(t.data);
    cr_assert_eq(qt_from_mxfp4_hf(&t, NULL, scales, 2, 64, msg, sizeof msg), QL_EINVAL);
    cr_assert_eq(qt_from_mxfp4_hf(&t, blocks, scales, 0, 64, msg, sizeof msg), QL_EINVAL);
}

/* Requantizing MXFP4's own values (what a merge with a zero delta does)
 * gives the same values back. */
Test(gguf, mxfp4_requantize_keeps_values)
{
    const mxv_q_case *k = &mxv_q_cases[3]; /* normal */
    cr_assert_str_eq(k->name, "normal");
    qt_quant_params p = {.kind = QT_MXFP4};
    qtensor t, again;
    char msg[256];
    cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK, "%s",
                 msg);
    long n = k->rows * k->cols;
    float *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
    qt_dequantize_rows(&t, 0, k->rows, a);
    cr_assert_eq(qt_quantize(&again, a, k->rows, k->cols, &p, msg, sizeof msg), QL_OK, "%s", msg);
    qt_dequantize_rows(&again, 0, k->rows, b);
    for (long i = 0; i < n; i++)
        cr_assert(a[i] == b[i], "value %ld: %a vs %a", i, (double)a[i], (double)b[i]);
    free(a);
    free(b);
    qt_free(&t);
    qt_free(&again);
}

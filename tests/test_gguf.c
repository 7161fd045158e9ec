/*
 * test_gguf.c - Q4_0, Q4_1 and Q8_0 against llama.cpp's byte layout.
 *
 * tests/fixtures/gguf_vectors.h holds blocks made by gguf-py's quantizers
 * (which mirror ggml's reference quantizers) with their dequantization:
 * zero and constant blocks, a block whose largest magnitude is negative,
 * rounding ties, random values. Reading the blocks in place must give the
 * same floats bit for bit, and quantizing the inputs the same bytes.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"
#include "test_util.h"

#include "fixtures/gguf_vectors.h"

static qt_kind kind_of(const char *type)
{
    int k = qt_kind_from_name(type);
    cr_assert(k == QT_Q4_0 || k == QT_Q4_1 || k == QT_Q8_0, "type %s", type);
    return (qt_kind)k;
}

Test(gguf, blocks_read_in_place_dequantize_bit_for_bit)
{
    for (size_t c = 0; c < sizeof ggufv_cases / sizeof *ggufv_cases; c++) {
        const ggufv_case *k = &ggufv_cases[c];
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_from_gguf_blocks(&t, kind_of(k->type), k->blocks, (size_t)k->blocks_len,
                                         k->rows, k->cols, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        long n = k->rows * k->cols;
        float *ref = malloc((size_t)n * sizeof *ref), *fast = malloc((size_t)n * sizeof *fast);
        qt_dequantize_rows_ref(&t, 0, k->rows, ref);
        qt_dequantize_rows(&t, 0, k->rows, fast);
        for (long i = 0; i < n; i++) {
            cr_assert(same_bits(ref[i], k->dequant[i]), "%s: value %ld: %a vs %a", k->name, i,
                      (double)ref[i], (double)k->dequant[i]);
            cr_assert(same_bits(fast[i], ref[i]), "%s: fast value %ld", k->name, i);
        }
        free(ref);
        free(fast);
        qt_free(&t);
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

/*
 * fuzz_gguf.c - libFuzzer target for the GGUF reader: header, metadata
 * (every value type, string and numeric arrays), tensor infos and the data
 * section. Whatever the bytes, gguf_open must refuse or accept without
 * reading outside the file; in an accepted file every string and array
 * must lie inside the mapping (touched here so AddressSanitizer sees it),
 * and every tensor that converts to a qtensor must dequantize within its
 * bytes.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seed tests/fixtures/tiny_ref.gguf.
 */
#include "fuzz_input.h"
#include "modelfile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Read every byte of s, so a string outside the mapping faults here. */
static unsigned touch(gguf_str s)
{
    unsigned sum = 0;
    for (uint64_t i = 0; i < s.len; i++)
        sum += (unsigned char)s.ptr[i];
    return sum;
}

static size_t elem_size(gguf_type t)
{
    switch (t) {
    case GGUF_UINT8:
    case GGUF_INT8:
    case GGUF_BOOL: return 1;
    case GGUF_UINT16:
    case GGUF_INT16: return 2;
    case GGUF_UINT32:
    case GGUF_INT32:
    case GGUF_FLOAT32: return 4;
    default: return 8;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_input_file(data, size, "gguf");
    if (!path)
        return 0;

    gguf_file g;
    char msg[512];
    if (gguf_open(&g, path, msg, sizeof msg) != QL_OK)
        return 0;
    volatile unsigned sink = 0;
    for (uint64_t i = 0; i < g.n_kv; i++) {
        const gguf_kv *kv = &g.kvs[i];
        sink += (unsigned)strlen(kv->key);
        if (kv->type == GGUF_STRING) {
            sink += touch(kv->str);
        } else if (kv->type == GGUF_ARRAY && kv->elem == GGUF_STRING) {
            for (uint64_t j = 0; j < kv->n; j++)
                sink += touch(kv->strs[j]);
        } else if (kv->type == GGUF_ARRAY && kv->n > 0) {
            size_t bytes = (size_t)kv->n * elem_size(kv->elem);
            sink += kv->data[0] + kv->data[bytes - 1];
        }
        if (gguf_find_kv(&g, kv->key) == NULL)
            abort(); /* every key read must be found again */
    }
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const gguf_tensor *t = &g.tensors[i];
        if (gguf_find_tensor(&g, t->name) != t)
            abort(); /* names are unique */
        sink += (unsigned)strlen(gguf_ggml_type_name(t->ggml_type));
        if (t->nbytes)
            sink += t->data[0] + t->data[t->nbytes - 1];
        qtensor q;
        if (gguf_tensor_qtensor(&g, t, &q, msg, sizeof msg) != QL_OK)
            continue;
        if (!q.data_borrowed || q.data != t->data || q.data_bytes != t->nbytes)
            abort(); /* read in place, never copied */
        /* bounded work per input: dequantize the first and the last rows */
        int64_t rows = q.rows < 4 ? q.rows : 4;
        if (q.cols <= (1 << 20)) {
            float *out = malloc((size_t)(rows * q.cols) * sizeof *out);
            if (out) {
                qt_dequantize_rows(&q, 0, rows, out);
                qt_dequantize_rows(&q, q.rows - 1, 1, out);
            }
            free(out);
        }
        qt_free(&q);
    }
    (void)sink;
    gguf_close(&g);
    return 0;
}

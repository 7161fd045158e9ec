/*
 * gguf_quant.c - what `qlserve quantize` does to one weight for a GGUF
 * --kind, shared by the GGUF input (quantize.c) and the Hugging Face folder
 * input (quantize_hf.c): which tensors llama-quantize quantizes and to what
 * (cli_gguf_plan, with its fallbacks), the GGML type numbers
 * (cli_ggml_type_of), and the bounded, chunked quantize-and-write of a
 * tensor's rows (cli_gguf_write_rows). It owns one chunk's buffers for the
 * length of a call and touches only the writer it is given.
 */
#include "cli.h"
#include "modelfile.h"
#include "qtensor.h"

#include <stdlib.h>
#include <string.h>

/* The GGML type number of the kinds a quantized GGUF tensor may get. */
uint32_t cli_ggml_type_of(qt_kind k)
{
    switch (k) {
    case QT_F32: return GGML_TYPE_F32;
    case QT_F16: return GGML_TYPE_F16;
    case QT_Q4_0: return GGML_TYPE_Q4_0;
    case QT_Q2_K: return GGML_TYPE_Q2_K;
    case QT_Q3_K: return GGML_TYPE_Q3_K;
    case QT_Q5_0: return GGML_TYPE_Q5_0;
    case QT_Q5_1: return GGML_TYPE_Q5_1;
    case QT_Q8_0: return GGML_TYPE_Q8_0;
    case QT_Q4_K: return GGML_TYPE_Q4_K;
    case QT_Q5_K: return GGML_TYPE_Q5_K;
    case QT_MXFP4: return GGML_TYPE_MXFP4;
    default: return GGML_TYPE_Q6_K;
    }
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), m = strlen(tail);
    return n >= m && strcmp(s + n - m, tail) == 0;
}

/* Whether llama-quantize would quantize this tensor (quantize.c says which). */
static bool gguf_quantizes(const gguf_tensor *t)
{
    return t->n_dims >= 2 && ends_with(t->name, "weight") && !strstr(t->name, "_norm.weight") &&
           !strstr(t->name, "ffn_gate_inp.weight") && strcmp(t->name, "position_embd.weight") &&
           strcmp(t->name, "token_types.weight") && !strstr(t->name, "ssm_conv1d");
}

/* What tensor t becomes: its kind (QT_KIND_COUNT: copied unchanged). */
qt_kind cli_gguf_plan(const cli_gguf_target *g, const gguf_tensor *t, bool *fell_back)
{
    *fell_back = false;
    if (!gguf_quantizes(t))
        return QT_KIND_COUNT;
    if (t->ne[0] % qt_traits_table[g->kind].block_size == 0)
        return g->kind;
    *fell_back = true;
    if (t->ne[0] % qt_traits_table[g->fallback].block_size == 0)
        return g->fallback;
    return QT_F16;
}

int cli_gguf_write_rows(const qtensor *src, const int64_t *row_of, qt_kind kind, const char *what,
                        gguf_out *o, char *msg, size_t msg_len)
{
    int64_t cols = src->cols, chunk = ((int64_t)1 << 20) / cols + 1;
    float *v = malloc((size_t)(chunk * cols) * sizeof *v);
    if (!v)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", what);
    qt_quant_params p = {.kind = kind};
    char why[512];
    int rc = QL_OK;
    for (int64_t r = 0; r < src->rows && rc == QL_OK; r += chunk) {
        int64_t n = src->rows - r < chunk ? src->rows - r : chunk;
        if (row_of)
            for (int64_t k = 0; k < n; k++)
                qt_dequantize_rows(src, row_of[r + k], 1, v + k * cols);
        else
            qt_dequantize_rows(src, r, n, v);
        if (kind == QT_F32) { /* little-endian f32 is the host's floats */
            rc = gguf_out_write(o, v, (size_t)(n * cols) * sizeof *v, msg, msg_len);
            continue;
        }
        qtensor q;
        rc = qt_quantize(&q, v, n, cols, &p, why, sizeof why);
        if (rc != QL_OK) {
            rc = ql_fail(msg, msg_len, rc, "%s, rows from %lld: %s", what, (long long)r, why);
            break;
        }
        rc = gguf_out_write(o, q.data, q.data_bytes, msg, msg_len);
        qt_free(&q);
    }
    free(v);
    return rc;
}

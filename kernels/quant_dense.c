/*
 * quant_dense.c - F32, F16 and BF16 through the same traits table as the
 * quantized kinds, so a dense lm_head or an unquantized model runs the same
 * code paths. "Quantizing" to a dense kind is a round-to-nearest-even
 * conversion; there is no quant state.
 */
#include "kernels_internal.h"
#include "qt_math.h"

#include <stdlib.h>
#include <string.h>

size_t qt_dense_elem_bytes(qt_kind kind)
{
    return kind == QT_F32 ? 4 : 2;
}

int qt_dense_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                      const qt_quant_params *p, char *msg, size_t msg_len)
{
    (void)p;
    int64_t n = rows * cols;
    size_t bytes = (size_t)n * qt_dense_elem_bytes(t->kind);
    t->data = malloc(bytes);
    if (!t->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes", bytes);
    t->data_bytes = bytes;
    if (t->kind == QT_F32) {
        memcpy(t->data, src, bytes);
    } else if (t->kind == QT_F16) {
        uint16_t *d = (uint16_t *)t->data;
        for (int64_t i = 0; i < n; i++)
            d[i] = qm_f32_to_f16(src[i]);
    } else {
        uint16_t *d = (uint16_t *)t->data;
        for (int64_t i = 0; i < n; i++)
            d[i] = qm_f32_to_bf16(src[i]);
    }
    return QL_OK;
}

void qt_dense_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    int64_t start = row0 * t->cols, n = nrows * t->cols;
    if (t->kind == QT_F32) {
        memcpy(out, (const float *)t->data + start, (size_t)n * sizeof(float));
    } else if (t->kind == QT_F16) {
        const uint16_t *d = (const uint16_t *)t->data + start;
        for (int64_t i = 0; i < n; i++)
            out[i] = qm_f16_to_f32(d[i]);
    } else {
        const uint16_t *d = (const uint16_t *)t->data + start;
        for (int64_t i = 0; i < n; i++)
            out[i] = qm_bf16_to_f32(d[i]);
    }
}

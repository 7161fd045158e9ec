/*
 * quant_dense.c - F32, F16 and BF16 through the same traits table as the
 * quantized kinds, so a dense lm_head or an unquantized model runs the same
 * code paths. "Quantizing" to a dense kind is a round-to-nearest-even
 * conversion; there is no quant state.
 *
 * It offers the dense rows' quantizer and scalar dequantization (the traits
 * table in traits.c points at them), qt_from_dense (wrap existing values)
 * and qt_cast_dense (change the dtype in place, refused for every
 * quantized kind). It owns no state; it calls down into qtensor.c only
 * (geometry, names, shape check, qt_wrap_copy) and touches kernels/math/qt_math.h.
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

/* --- dense values in, dense dtype changes -------------------------------- */

int qt_from_dense(qtensor *out, qt_kind kind, const void *src, int64_t rows, int64_t cols,
                  char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if ((unsigned)kind >= QT_KIND_COUNT || !qt_kind_geometry_table[kind].is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "kind %s is not a dense kind",
                       qt_kind_name(kind));
    int rc = qt_check_shape(rows, cols, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    size_t bytes = (size_t)(rows * cols) * qt_dense_elem_bytes(kind);
    return qt_wrap_copy(out, kind, rows, cols, src, bytes, msg, msg_len);
}

int qt_cast_dense(qtensor *t, qt_kind to, char *msg, size_t msg_len)
{
    if ((unsigned)t->kind >= QT_KIND_COUNT || !qt_kind_geometry_table[t->kind].is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "a %s tensor keeps its quantizer's dtypes; only dense kinds are cast",
                       qt_kind_name(t->kind));
    if ((unsigned)to >= QT_KIND_COUNT || !qt_kind_geometry_table[to].is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "cannot cast to %s: not a dense kind",
                       qt_kind_name(to));
    if (to == t->kind)
        return QL_OK;
    int64_t n = t->rows * t->cols;
    size_t bytes = (size_t)n * qt_dense_elem_bytes(to);
    uint8_t *data = malloc(bytes);
    float *row = malloc((size_t)t->cols * sizeof *row);
    if (!data || !row) {
        free(data);
        free(row);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes", bytes);
    }
    for (int64_t r = 0; r < t->rows; r++) {
        qt_dense_dequantize_rows(t, r, 1, row);
        for (int64_t c = 0; c < t->cols; c++) {
            int64_t i = r * t->cols + c;
            if (to == QT_F32)
                ((float *)data)[i] = row[c];
            else if (to == QT_F16)
                ((uint16_t *)data)[i] = qm_f32_to_f16(row[c]);
            else
                ((uint16_t *)data)[i] = qm_f32_to_bf16(row[c]);
        }
    }
    free(row);
    if (!t->data_borrowed)
        free(t->data);
    t->data = data;
    t->data_borrowed = false;
    t->data_bytes = bytes;
    t->kind = to;
    return QL_OK;
}

/* --- the LoRA products on bf16 (qtensor.h's contract) --------------------- */

/* w[0..n) . x[0..n) as the eight-lane sum qtensor.h describes. */
static float lora_dot_ref(const uint16_t *w, const float *x, int64_t n)
{
    float lane[8] = {0};
    for (int64_t i = 0; i < (n + 7) / 8 * 8; i++) {
        float p = i < n ? qm_bf16_to_f32(w[i]) * x[i] : 0.0f;
        lane[i % 8] = lane[i % 8] + p;
    }
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
           ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

void qt_lora_down_ref(const qtensor *a, const float *x, float s, float *t, int64_t r0, int64_t r1)
{
    const uint16_t *w = (const uint16_t *)a->data;
    for (int64_t r = r0; r < r1; r++)
        t[r] = lora_dot_ref(w + r * a->cols, x, a->cols) * s;
}

void qt_lora_up_ref(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1)
{
    const uint16_t *w = (const uint16_t *)b->data;
    for (int64_t o = o0; o < o1; o++)
        y[o] = y[o] + lora_dot_ref(w + o * b->cols, t, b->cols);
}

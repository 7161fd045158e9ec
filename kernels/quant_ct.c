/*
 * quant_ct.c - CT_INT, compressed-tensors' integer weights (what
 * llm-compressor writes, quant_method "compressed-tensors"):
 *
 *   pack-quantized   weight_packed int32 [rows, ceil(cols * bits / 32)]:
 *                    code c of a row at bits [c * bits, (c + 1) * bits) of
 *                    the row's little-endian words, stored unsigned as
 *                    q + 2^(bits - 1) (pack_to_int32); zero points, when
 *                    asymmetric, packed the same way along the output dim
 *                    ([ceil(scale_rows * bits / 32), scale_cols]);
 *   naive-quantized  weight int8 [rows, cols], q as it is; zero points int8.
 *
 * One scale per block of block_rows x block_cols over a ceil(rows /
 * block_rows) x ceil(cols / block_cols) grid (strategy group: 1 x group;
 * channel: 1 x cols; tensor: rows x cols; block: its block_structure), in
 * the dtype the checkpoint stored (f32, bf16 or f16), never widened in
 * memory.
 *
 *   dequantize (compressed-tensors' _dequantize, in the scale's dtype):
 *       w = (q - z) * s  =  round_dtype(f32(q - z) * f32(s))
 *   q - z is at most 255 in magnitude, exact in every scale dtype, and the
 *   f32 product of it and a 16-bit scale is exact, so one rounding to the
 *   scale's dtype gives torch's bits.
 *   requantize (a merge; calculate_qparams' min-max rule), per block:
 *       lo = min(w, 0), hi = max(w, 0), qmin = -2^(bits-1), qmax = 2^(bits-1) - 1
 *       symmetric:  s = max(-lo, hi) / ((qmax - qmin) / 2), z = 0
 *       otherwise:  s = (hi - lo) / (qmax - qmin), z = rint(clamp(qmin - lo / s))
 *       then s stored in the scale's dtype (its epsilon where it is 0; z was
 *       taken from s before that rounding, as calculate_qparams does)
 *       q = rint(clamp(w / s + z, qmin, qmax)) with the stored s
 *   the codes, scales and zeros compressed-tensors' calculate_qparams and
 *   compress() give for f32 weights and that scale_dtype, byte for byte
 *   (tests/test_ctensors.c).
 *
 * It offers the CT_INT row's scalar dequantization and quantizer (which
 * only requantizes into a loaded tensor's layout) and qt_from_ct_int (a
 * checkpoint's parts, codes read in place). It owns no state; it calls
 * qtensor.c.
 */
#include "kernels_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Codes [c0, c1) of row r as (q - z) * s into o[c0..c1), one loop per
 * encoding: naive int8, packed bytes (q + 128), packed nibbles (q + 8, the
 * low nibble first: little-endian words). */
static void decode_block(const qtensor *t, int64_t r, int64_t c0, int64_t c1, float s, int32_t z,
                         float *o)
{
    const uint8_t *row = t->data + (size_t)r * t->row_stride;
    if (t->ct_signed_codes) {
        for (int64_t c = c0; c < c1; c++)
            o[c] = (float)((int32_t)(int8_t)row[c] - z) * s;
    } else if (t->bits == 8) {
        for (int64_t c = c0; c < c1; c++)
            o[c] = (float)((int32_t)row[c] - 128 - z) * s;
    } else {
        for (int64_t c = c0; c < c1; c++)
            o[c] = (float)((int32_t)((row[c / 2] >> ((c & 1) * 4)) & 15u) - 8 - z) * s;
    }
}

void qt_ct_int_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    for (int64_t r = row0; r < row0 + nrows; r++) {
        float *o = out + (r - row0) * t->cols;
        const int64_t srow = (r / t->block_rows) * t->scale_cols;
        for (int64_t c0 = 0, bc = 0; c0 < t->cols; c0 += t->block_cols, bc++) {
            const int64_t c1 = c0 + t->block_cols < t->cols ? c0 + t->block_cols : t->cols;
            const float s = qt_scale_at(t->block_scales, t->scale_dtype, srow + bc);
            const int32_t z = t->block_zeros ? t->block_zeros[srow + bc] : 0;
            decode_block(t, r, c0, c1, s, z, o);
        }
        qt_round_to_scale_dtype(o, t->cols, t->scale_dtype);
    }
}

void qt_ct_int_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1)
{
    qt_lanes_matmul_with(t, x, batch, y, row0, row1, qt_ct_int_dequantize_rows, qt_lanes_dots_ref,
                         1);
}

/* Store q (in [qmin, qmax]) as code c of row r in t's encoding. */
static void put_code(qtensor *t, int64_t r, int64_t c, int32_t q)
{
    uint8_t *row = t->data + (size_t)r * t->row_stride;
    if (t->ct_signed_codes)
        row[c] = (uint8_t)(int8_t)q;
    else if (t->bits == 8)
        row[c] = (uint8_t)(q + 128);
    else
        row[c / 2] = (uint8_t)(row[c / 2] | (uint8_t)((uint32_t)(q + 8) << ((c & 1) * 4)));
}

static float clampf(float v, float lo, float hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* Requantize block (br, bc) of src into t by the min-max rule above. */
static void requantize_block(qtensor *t, const float *src, int64_t br, int64_t bc)
{
    const int64_t r0 = br * t->block_rows, c0 = bc * t->block_cols;
    const int64_t r1 = r0 + t->block_rows < t->rows ? r0 + t->block_rows : t->rows;
    const int64_t c1 = c0 + t->block_cols < t->cols ? c0 + t->block_cols : t->cols;
    const float qmin = -(float)(1 << (t->bits - 1)), qmax = (float)((1 << (t->bits - 1)) - 1);
    float lo = 0.0f, hi = 0.0f;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++) {
            float v = src[r * t->cols + c];
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
    const int64_t slot = br * t->scale_cols + bc;
    const float raw =
        t->block_zeros ? (hi - lo) / (qmax - qmin) : (-lo > hi ? -lo : hi) / ((qmax - qmin) / 2.0f);
    float s = qt_scale_put(t->block_scales, t->scale_dtype, slot, raw);
    if (s == 0.0f) /* torch.finfo(dtype).eps, as calculate_qparams */
        s = qt_scale_put(t->block_scales, t->scale_dtype, slot,
                         t->scale_dtype == QT_SCALE_BF16  ? 0.0078125f
                         : t->scale_dtype == QT_SCALE_F16 ? 0.0009765625f
                                                          : 1.1920929e-07f);
    float z = 0.0f;
    if (t->block_zeros) { /* from the scale before its rounding, as calculate_qparams */
        z = raw > 0.0f ? rintf(clampf(qmin - lo / raw, qmin, qmax)) : 0.0f;
        t->block_zeros[slot] = (int8_t)z;
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++)
            put_code(t, r, c, (int32_t)rintf(clampf(src[r * t->cols + c] / s + z, qmin, qmax)));
}

int qt_ct_int_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len)
{
    const qtensor *L = p->layout;
    if (!L || L->kind != QT_CT_INT || L->rows != rows || L->cols != cols)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "ct_int is read from compressed-tensors checkpoints; qlserve quantizes to "
                       "it only into the layout of a loaded [%lld, %lld] ct_int tensor (a merge)",
                       (long long)rows, (long long)cols);
    size_t nbytes = (size_t)rows * L->row_stride, nscales = (size_t)(L->scale_rows * L->scale_cols);
    t->data = calloc(1, nbytes);
    t->data_bytes = nbytes;
    t->block_scales = malloc(nscales * qt_scale_dtype_size(L->scale_dtype));
    t->block_zeros = L->block_zeros ? calloc(1, nscales) : NULL;
    if (!t->data || !t->block_scales || (L->block_zeros && !t->block_zeros))
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes of ct_int codes",
                       nbytes);
    t->bits = L->bits;
    t->row_stride = L->row_stride;
    t->ct_signed_codes = L->ct_signed_codes;
    t->block_rows = L->block_rows;
    t->block_cols = L->block_cols;
    t->scale_rows = L->scale_rows;
    t->scale_cols = L->scale_cols;
    t->scale_dtype = L->scale_dtype;
    for (int64_t br = 0; br < t->scale_rows; br++)
        for (int64_t bc = 0; bc < t->scale_cols; bc++)
            requantize_block(t, src, br, bc);
    return QL_OK;
}

/* Check the parts against one another; QL_OK or msg says which. */
static int check_ct_parts(const qt_ct_int_parts *p, char *msg, size_t msg_len)
{
    int rc = qt_check_shape(p->rows, p->cols, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (p->packed ? p->bits != 4 && p->bits != 8 : p->bits != 8)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "ct_int %s with %d bits is not supported (pack-quantized 4 and 8, "
                       "naive-quantized 8 are)",
                       p->packed ? "pack-quantized" : "naive-quantized", p->bits);
    if (p->scale_dtype != QT_SCALE_F32 && p->scale_dtype != QT_SCALE_BF16 &&
        p->scale_dtype != QT_SCALE_F16)
        return ql_fail(msg, msg_len, QL_EINVAL, "ct_int scale dtype %s is not f32, bf16 or f16",
                       qt_scale_dtype_name(p->scale_dtype));
    return qt_check_block_scales("ct_int", p->rows, p->cols, p->block_rows, p->block_cols,
                                 p->scale_rows, p->scale_cols, p->scales, p->scale_dtype, msg,
                                 msg_len);
}

/* The zero point of block (br, bc) from the parts, as a signed int8. */
static int8_t zero_of(const qt_ct_int_parts *p, int64_t br, int64_t bc)
{
    if (!p->zeros_packed)
        return (int8_t)p->zeros[br * p->scale_cols + bc];
    /* pack_to_int32 along dim 0: word (br * bits / 32, bc), little-endian,
     * so the code is at bit (br * bits) % 32 of it; 4 and 8 bits never
     * straddle a word */
    int64_t word = (br * p->bits) / 32;
    int shift = (int)((br * p->bits) % 32);
    uint32_t w;
    memcpy(&w, p->zeros + (size_t)(word * p->scale_cols + bc) * 4, sizeof w);
    return (int8_t)((int32_t)((w >> shift) & ((1u << p->bits) - 1u)) - (1 << (p->bits - 1)));
}

int qt_from_ct_int(qtensor *out, const qt_ct_int_parts *p, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    int rc = check_ct_parts(p, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    size_t stride = p->packed ? (size_t)((p->cols * p->bits + 31) / 32) * 4 : (size_t)p->cols;
    size_t nbytes = stride * (size_t)p->rows;
    rc = qt_wrap_codes(out, QT_CT_INT, p->rows, p->cols, p->codes, nbytes, p->borrow_codes, msg,
                       msg_len);
    if (rc != QL_OK)
        return rc;
    size_t n = (size_t)(p->scale_rows * p->scale_cols);
    out->block_scales = malloc(n * qt_scale_dtype_size(p->scale_dtype));
    out->block_zeros = p->zeros ? malloc(n) : NULL;
    if (!out->block_scales || (p->zeros && !out->block_zeros)) {
        qt_free(out);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate ct_int scales");
    }
    memcpy(out->block_scales, p->scales, n * qt_scale_dtype_size(p->scale_dtype));
    for (int64_t br = 0; p->zeros && br < p->scale_rows; br++)
        for (int64_t bc = 0; bc < p->scale_cols; bc++)
            out->block_zeros[br * p->scale_cols + bc] = zero_of(p, br, bc);
    out->bits = p->bits;
    out->row_stride = stride;
    out->ct_signed_codes = !p->packed;
    out->block_rows = p->block_rows;
    out->block_cols = p->block_cols;
    out->scale_rows = p->scale_rows;
    out->scale_cols = p->scale_cols;
    out->scale_dtype = p->scale_dtype;
    return QL_OK;
}

/*
 * quant_gguf.c - llama.cpp's Q4_0, Q4_1 and Q8_0 blocks, byte for byte, so a
 * GGUF tensor is used in place: each block of 32 is an affine group whose
 * scale (and minimum) are stored as IEEE halves beside the codes.
 *
 *   block_q4_0 { f16 d; u8 qs[16]; }        w = (nibble - 8) * d
 *   block_q4_1 { f16 d; f16 m; u8 qs[16]; } w = nibble * d + m
 *   block_q8_0 { f16 d; i8 qs[32]; }        w = q * d
 *
 * In the 4-bit blocks byte j holds element j in its low nibble and element
 * j + 16 in its high nibble (unlike bitsandbytes' adjacent pairs).
 * Quantizing follows ggml's reference quantizers (quantize_row_*_ref): the
 * reciprocal of the f32 scale, truncation after adding 8.5 or 0.5 for the
 * 4-bit kinds, roundf (half away from zero) for Q8_0; the arithmetic is
 * qt_quant_math.h's (qq_q4_0_block, ...), which the CUDA merge runs too.
 *
 * It offers the GGUF rows' quantizer and scalar dequantization (the traits
 * table in traits.c points at them), qt_gguf_block_bytes and
 * qt_from_gguf_blocks (wrap a GGUF file's block bytes). It owns no state;
 * it calls down into qtensor.c only (geometry, names, qt_wrap_copy) and
 * touches kernels/math/ (qt_math.h, qt_quant_math.h).
 */
#include "kernels_internal.h"
#include "qt_math.h"
#include "qt_quant_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define QK QM_GGUF_QK

size_t qt_gguf_block_bytes(qt_kind kind)
{
    return qt_kind_geometry_table[kind].block_bytes;
}

/* One block through qt_quant_math.h (shared with the CUDA merge), written
 * in ggml's byte layout: the f16 d (and Q4_1's m) little-endian, then qs. */
static void put_f16(uint8_t *p, uint16_t h)
{
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

static void quantize_block(qt_kind kind, const float *x, uint8_t *blk)
{
    uint16_t d, m;
    if (kind == QT_Q4_0) {
        qq_q4_0_block(x, &d, blk + 2);
    } else if (kind == QT_Q4_1) {
        qq_q4_1_block(x, &d, &m, blk + 4);
        put_f16(blk + 2, m);
    } else {
        qq_q8_0_block(x, &d, blk + 2);
    }
    put_f16(blk, d);
}

int qt_gguf_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len)
{
    (void)p;
    if (cols % QK != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%lld columns is not a multiple of the %s block of %d", (long long)cols,
                       qt_kind_name(t->kind), QK);
    size_t bb = qt_gguf_block_bytes(t->kind);
    int64_t nblocks = rows * cols / QK;
    t->data_bytes = (size_t)nblocks * bb;
    t->row_stride = (size_t)(cols / QK) * bb;
    t->data = malloc(t->data_bytes);
    if (!t->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes", t->data_bytes);
    for (int64_t b = 0; b < nblocks; b++)
        quantize_block(t->kind, src + b * QK, t->data + b * bb);
    return QL_OK;
}

/* The arithmetic is qt_math.h's (qm_q4_0_value, ...), the same the CUDA
 * kernel runs; the block's halves are read once per block. */
void qt_gguf_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    size_t bb = qt_gguf_block_bytes(t->kind);
    int64_t b0 = row0 * t->cols / QK, nb = nrows * t->cols / QK;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = t->data + (b0 + b) * bb;
        float *o = out + b * QK;
        float d = qm_f16_le(blk);
        if (t->kind == QT_Q4_0) {
            for (int j = 0; j < QK; j++)
                o[j] = qm_q4_0_value(qm_gguf_nibble(blk + 2, j), d);
        } else if (t->kind == QT_Q4_1) {
            float m = qm_f16_le(blk + 2);
            for (int j = 0; j < QK; j++)
                o[j] = qm_q4_1_value(qm_gguf_nibble(blk + 4, j), d, m);
        } else {
            for (int j = 0; j < QK; j++)
                o[j] = qm_q8_0_value((int8_t)blk[2 + j], d);
        }
    }
}

int qt_from_gguf_blocks(qtensor *out, qt_kind kind, const void *blocks, size_t bytes, int64_t rows,
                        int64_t cols, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if ((unsigned)kind >= QT_KIND_COUNT || !qt_kind_geometry_table[kind].is_gguf)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s is not a GGUF block kind",
                       qt_kind_name(kind));
    if (rows <= 0 || cols <= 0 || cols % QK != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "shape [%lld, %lld]: columns must be a positive multiple of %d",
                       (long long)rows, (long long)cols, QK);
    size_t bb = qt_gguf_block_bytes(kind);
    size_t want = (size_t)(rows * cols / QK) * bb;
    if (bytes != want)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%zu bytes of %s blocks for shape [%lld, %lld]; expected %zu", bytes,
                       qt_kind_name(kind), (long long)rows, (long long)cols, want);
    int rc = qt_wrap_copy(out, kind, rows, cols, blocks, bytes, msg, msg_len);
    out->row_stride = (size_t)(cols / QK) * bb;
    return rc;
}

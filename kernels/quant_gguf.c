/*
 * quant_gguf.c - llama.cpp's GGUF blocks, byte for byte, so a GGUF tensor
 * is used in place: Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 (blocks of 32, each an
 * affine group whose scale and minimum are IEEE halves beside the codes),
 * the k-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (super-blocks of 256 whose
 * sub-blocks carry their own 4-, 6- or 8-bit scales), the non-linear
 * IQ4_NL (blocks of 32) and IQ4_XS (super-blocks of 256), whose nibbles
 * index 16 fixed levels, and MXFP4 (blocks of 32 FP4 E2M1 codes under one
 * power-of-two E8M0 scale).
 *
 *   block_q4_0 { f16 d; u8 qs[16]; }                 w = (nibble - 8) * d
 *   block_q4_1 { f16 d; f16 m; u8 qs[16]; }          w = nibble * d + m
 *   block_q8_0 { f16 d; i8 qs[32]; }                 w = q * d
 *   block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }       w = (code - 16) * d
 *   block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16]; } w = code * d + m
 *   block_q4_K, block_q5_K, block_q6_K: see qt_math.h
 *   block_q2_K, block_q3_K, block_iq4_nl, block_iq4_xs: see qt_quant_math.h
 *   block_mxfp4 { u8 e; u8 qs[16]; }                w = level * 2^(e - 128)
 *
 * In the blocks of 32, byte j of qs holds element j in its low nibble and
 * element j + 16 in its high nibble (unlike bitsandbytes' adjacent pairs);
 * Q5's fifth bit of element j is bit j of qh. Dequantizing is exactly
 * ggml's dequantize_row_* (qt_math.h's qm_*_block_value: the same f32
 * operations in the same order). Quantizing follows ggml's reference
 * quantizers (quantize_row_*_ref): the reciprocal of the f32 scale,
 * truncation after adding 8.5, 16.5 or 0.5, roundf (half away from zero)
 * for Q8_0; MXFP4's power-of-two scale from the block's largest |x| and
 * the nearest level (quantize_row_mxfp4_ref); the arithmetic is
 * qt_quant_math.h's (qq_q4_0_block, ..., qq_mxfp4_block), which the CUDA
 * merge runs too. The k-quants' reference quantizers (an
 * iterative search per sub-block) are quant_kquant.c's; IQ4's are not
 * here yet: quantizing into IQ4_NL or IQ4_XS is refused by name.
 *
 * It offers the GGUF rows' quantizer and scalar dequantization (the traits
 * table in traits.c points at them), qt_gguf_block_bytes,
 * qt_from_gguf_blocks (wrap a GGUF file's block bytes) and
 * qt_from_mxfp4_hf (a Hugging Face MXFP4 pair into ggml's blocks). It owns no state;
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

/* Elements per block of a GGUF kind: 32, or 256 for the k-quants. */
static int64_t block_elems(qt_kind kind)
{
    return qt_kind_geometry_table[kind].block_size;
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
    if (kind == QT_MXFP4) { /* a scale byte, no f16 */
        qq_mxfp4_block(x, blk);
        return;
    }
    if (kind == QT_Q4_0) {
        qq_q4_0_block(x, &d, blk + 2);
    } else if (kind == QT_Q4_1) {
        qq_q4_1_block(x, &d, &m, blk + 4);
        put_f16(blk + 2, m);
    } else if (kind == QT_Q5_0) {
        qq_q5_0_block(x, &d, blk + 2, blk + 6);
    } else if (kind == QT_Q5_1) {
        qq_q5_1_block(x, &d, &m, blk + 4, blk + 8);
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

/* One super-block of 256 (a k-quant or IQ4_XS) into o, element by
 * element through qt_math.h and qt_quant_math.h (the sub-block scales
 * recomputed per element give the same f32 values as ggml's
 * once-per-sub-block ones). */
static void dequantize_kquant_block(qt_kind kind, const uint8_t *blk, float *o)
{
    for (int j = 0; j < QM_QK_K; j++) {
        switch (kind) {
        case QT_Q2_K: o[j] = qm_q2_k_block_value(blk, j); break;
        case QT_Q3_K: o[j] = qm_q3_k_block_value(blk, j); break;
        case QT_Q4_K: o[j] = qm_q4_k_block_value(blk, j); break;
        case QT_Q5_K: o[j] = qm_q5_k_block_value(blk, j); break;
        case QT_IQ4_XS: o[j] = qm_iq4_xs_block_value(blk, j); break;
        default: o[j] = qm_q6_k_block_value(blk, j); break;
        }
    }
}

/* The arithmetic is qt_math.h's (qm_q4_0_value, ...), the same the CUDA
 * kernel runs; the block's halves are read once per block. */
void qt_gguf_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    size_t bb = qt_gguf_block_bytes(t->kind);
    int64_t be = block_elems(t->kind);
    int64_t b0 = row0 * t->cols / be, nb = nrows * t->cols / be;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = t->data + (b0 + b) * bb;
        float *o = out + b * be;
        float d = qm_f16_le(blk);
        if (t->kind == QT_Q4_0) {
            for (int j = 0; j < QK; j++)
                o[j] = qm_q4_0_value(qm_gguf_nibble(blk + 2, j), d);
        } else if (t->kind == QT_Q4_1) {
            float m = qm_f16_le(blk + 2);
            for (int j = 0; j < QK; j++)
                o[j] = qm_q4_1_value(qm_gguf_nibble(blk + 4, j), d, m);
        } else if (t->kind == QT_Q8_0) {
            for (int j = 0; j < QK; j++)
                o[j] = qm_q8_0_value((int8_t)blk[2 + j], d);
        } else if (t->kind == QT_Q5_0) {
            for (int j = 0; j < QK; j++)
                o[j] = qm_q5_0_value(qm_q5_code(blk + 2, blk + 6, j), d);
        } else if (t->kind == QT_Q5_1) {
            float m = qm_f16_le(blk + 2);
            for (int j = 0; j < QK; j++)
                o[j] = qm_q5_1_value(qm_q5_code(blk + 4, blk + 8, j), d, m);
        } else if (t->kind == QT_IQ4_NL) {
            for (int j = 0; j < QK; j++)
                o[j] = qm_iq4_value(qm_gguf_nibble(blk + 2, j), d);
        } else if (t->kind == QT_MXFP4) {
            float e = qm_e8m0_half(blk[0]); /* its scale is no f16: d unused */
            for (int j = 0; j < QK; j++)
                o[j] = qm_mxfp4_value(qm_gguf_nibble(blk + 1, j), e);
        } else {
            dequantize_kquant_block(t->kind, blk, o);
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
    int64_t be = block_elems(kind);
    if (rows <= 0 || cols <= 0 || cols % be != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "shape [%lld, %lld]: columns must be a positive multiple of the %s block "
                       "of %lld",
                       (long long)rows, (long long)cols, qt_kind_name(kind), (long long)be);
    size_t bb = qt_gguf_block_bytes(kind);
    size_t want = (size_t)(rows * cols / be) * bb;
    if (bytes != want)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%zu bytes of %s blocks for shape [%lld, %lld]; expected %zu", bytes,
                       qt_kind_name(kind), (long long)rows, (long long)cols, want);
    int rc = qt_wrap_copy(out, kind, rows, cols, blocks, bytes, msg, msg_len);
    out->row_stride = (size_t)(cols / be) * bb;
    return rc;
}

/* Nibble i (0..31) of a Hugging Face MXFP4 block of 16 bytes: element 2j
 * in the low half of byte j, 2j + 1 in the high half. */
static unsigned hf_nibble(const uint8_t *b, int i)
{
    return (unsigned)(b[i / 2] >> (4 * (i % 2))) & 0x0fu;
}

int qt_from_mxfp4_hf(qtensor *out, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                     int64_t cols, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if (!blocks || !scales)
        return ql_fail(msg, msg_len, QL_EINVAL, "an MXFP4 pair needs both its blocks and scales");
    int rc = qt_check_shape(rows, cols, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (cols % QK != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "MXFP4 shape [%lld, %lld]: columns must be a multiple of the block of %d",
                       (long long)rows, (long long)cols, QK);
    size_t bb = qt_gguf_block_bytes(QT_MXFP4);
    int64_t nblocks = rows * (cols / QK);
    out->kind = QT_MXFP4;
    out->rows = rows;
    out->cols = cols;
    out->data_bytes = (size_t)nblocks * bb;
    out->row_stride = (size_t)(cols / QK) * bb;
    out->data = malloc(out->data_bytes);
    if (!out->data) {
        size_t want = out->data_bytes;
        memset(out, 0, sizeof *out);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes for MXFP4 [%lld, %lld]",
                       want, (long long)rows, (long long)cols);
    }
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *src = blocks + b * (QK / 2);
        uint8_t *blk = out->data + (size_t)b * bb;
        blk[0] = scales[b];
        for (int j = 0; j < QK / 2; j++)
            blk[1 + j] = (uint8_t)(hf_nibble(src, j) | hf_nibble(src, j + QK / 2) << 4);
    }
    return QL_OK;
}

/*
 * quant_kquant.c - quantizing into the k-quants Q2_K, Q3_K, Q4_K, Q5_K and
 * Q6_K and the non-linear IQ4_NL and IQ4_XS: each row's blocks (256
 * elements; IQ4_NL's 32) through qt_kquant_ref.h, whose bytes are
 * llama.cpp's quantize_row_q2_K_ref ... _q6_K_ref, _iq4_nl_ref and
 * _iq4_xs_ref for the same floats (tests/test_kquant_quantize.c pins them
 * against llama.cpp's C).
 * Reading these kinds (dequantization, the matrix kernels) stays in
 * quant_gguf.c and matmul_avx2.c.
 *
 * It offers qt_kquant_quantize, the quantizer of those seven rows of the
 * traits table. It owns no state; it calls down into quant_gguf.c
 * (qt_gguf_block_bytes) and touches kernels/math/.
 */
#include "kernels_internal.h"
#include "qt_kquant_ref.h"

#include <stdlib.h>

int qt_kquant_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len)
{
    (void)p;
    if (t->kind != QT_Q2_K && t->kind != QT_Q3_K && t->kind != QT_Q4_K && t->kind != QT_Q5_K &&
        t->kind != QT_Q6_K && t->kind != QT_IQ4_NL && t->kind != QT_IQ4_XS)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s has no llama.cpp reference quantizer here",
                       qt_kind_name(t->kind));
    int64_t block = qt_kind_geometry_table[t->kind].block_size;
    if (cols % block != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%lld columns is not a multiple of the %s block of %lld "
                       "(llama-quantize falls back to another kind for such a tensor)",
                       (long long)cols, qt_kind_name(t->kind), (long long)block);
    size_t bb = qt_gguf_block_bytes(t->kind);
    int64_t nblocks = rows * (cols / block);
    t->data_bytes = (size_t)nblocks * bb;
    t->row_stride = (size_t)(cols / block) * bb;
    t->data = malloc(t->data_bytes);
    if (!t->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes for %s", t->data_bytes,
                       qt_kind_name(t->kind));
    for (int64_t b = 0; b < nblocks; b++) {
        const float *x = src + b * block;
        uint8_t *blk = t->data + (size_t)b * bb;
        switch (t->kind) {
        case QT_Q2_K: qk_q2_k_block(x, blk); break;
        case QT_Q3_K: qk_q3_k_block(x, blk); break;
        case QT_Q4_K: qk_q4_k_block(x, blk); break;
        case QT_Q5_K: qk_q5_k_block(x, blk); break;
        case QT_Q6_K: qk_q6_k_block(x, blk); break;
        case QT_IQ4_NL: qk_iq4_nl_block(x, blk); break;
        default: qk_iq4_xs_block(x, blk); break;
        }
    }
    return QL_OK;
}

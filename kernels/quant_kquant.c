/*
 * quant_kquant.c - quantizing into the k-quants Q2_K, Q3_K, Q4_K, Q5_K and
 * Q6_K: each row's super-blocks of 256 through qt_kquant_ref.h, whose
 * bytes are llama.cpp's quantize_row_q2_K_ref ... _q6_K_ref for the same
 * floats (tests/test_kquant_quantize.c pins them against llama.cpp's C).
 * Reading these kinds (dequantization, the matrix kernels) stays in
 * quant_gguf.c and matmul_avx2.c.
 *
 * It offers qt_kquant_quantize, the quantizer of the three rows of the
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
        t->kind != QT_Q6_K)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s is not a k-quant", qt_kind_name(t->kind));
    if (cols % QM_QK_K != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%lld columns is not a multiple of the %s super-block of %d "
                       "(llama-quantize falls back to another kind for such a tensor)",
                       (long long)cols, qt_kind_name(t->kind), QM_QK_K);
    size_t bb = qt_gguf_block_bytes(t->kind);
    int64_t nblocks = rows * (cols / QM_QK_K);
    t->data_bytes = (size_t)nblocks * bb;
    t->row_stride = (size_t)(cols / QM_QK_K) * bb;
    t->data = malloc(t->data_bytes);
    if (!t->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes for %s", t->data_bytes,
                       qt_kind_name(t->kind));
    for (int64_t b = 0; b < nblocks; b++) {
        const float *x = src + b * QM_QK_K;
        uint8_t *blk = t->data + (size_t)b * bb;
        switch (t->kind) {
        case QT_Q2_K: qk_q2_k_block(x, blk); break;
        case QT_Q3_K: qk_q3_k_block(x, blk); break;
        case QT_Q4_K: qk_q4_k_block(x, blk); break;
        case QT_Q5_K: qk_q5_k_block(x, blk); break;
        default: qk_q6_k_block(x, blk); break;
        }
    }
    return QL_OK;
}

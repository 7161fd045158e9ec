/*
 * qt_cuda_blocks.h - the device half of qt_cuda_kinds.c's rows: for each
 * GGUF kind, its block geometry and its per-block functions as a kernel
 * compiled for that kind reads them, qt_cuda_block<K>. The dequantize, the
 * gather and the merge's requantize are templates over K, and the table's
 * row for K names their K instantiation, so the device never chooses by the
 * kind at run time.
 *
 * Why shaped so:
 *   - A kernel cannot read the host table, and an instantiation per kind is
 *     what the kernels were before (dequantize_gguf_whole_kernel<kKind>);
 *     each function here is the very qt_math.h / qt_quant_math.h /
 *     qt_kquant_ref.h call the kernels made, so the arithmetic is unchanged
 *     and stays the CPU's bit for bit.
 *   - The split kinds (Q4_0, Q4_1, Q8_0: qs / d / m arrays, qt_cuda.h) read
 *     an element by its index and quantize a block of 32 into qs, d, m; the
 *     whole kinds (the rest) read element j of one ggml block and quantize
 *     a block in place.
 *
 * C++ only; only the .cu files of kernels/cuda include it.
 */
#ifndef QT_CUDA_BLOCKS_H
#define QT_CUDA_BLOCKS_H

#include <cstdint>

#include "qt_kquant_ref.h"
#include "qt_math.h"
#include "qt_quant_math.h"
#include "qtensor.h"

template <qt_kind K> struct qt_cuda_block;

/* ---- kept split: qs, d, m ------------------------------------------------ */

/* A split kind: qs bytes per block, whether it has m, element e (ELEMENT,
 * of qs, d, m, e) and the block quantizer (QUANTIZE, of x, d, m, qs). */
#define QT_CUDA_SPLIT_BLOCK(KIND, QS_BYTES, HAS_M, ELEMENT, QUANTIZE)                              \
    template <> struct qt_cuda_block<KIND> {                                                       \
        static constexpr int64_t kElems = QM_GGUF_QK;                                              \
        static constexpr int kQsBytes = QS_BYTES;                                                  \
        static constexpr bool kHasM = HAS_M;                                                       \
        static __host__ __device__ float element(const uint8_t *qs, const uint16_t *d,             \
                                                 const uint16_t *m, int64_t e)                     \
        {                                                                                          \
            (void)m;                                                                               \
            return ELEMENT;                                                                        \
        }                                                                                          \
        static __host__ __device__ void quantize(const float *x, uint16_t *d, uint16_t *m,         \
                                                 uint8_t *qs)                                      \
        {                                                                                          \
            (void)m;                                                                               \
            QUANTIZE;                                                                              \
        }                                                                                          \
    };

QT_CUDA_SPLIT_BLOCK(QT_Q4_0, QM_Q4_QS_BYTES, false, qm_q4_0_split_element(qs, d, e),
                    qq_q4_0_block(x, d, qs))
QT_CUDA_SPLIT_BLOCK(QT_Q4_1, QM_Q4_QS_BYTES, true, qm_q4_1_split_element(qs, d, m, e),
                    qq_q4_1_block(x, d, m, qs))
QT_CUDA_SPLIT_BLOCK(QT_Q8_0, QM_Q8_QS_BYTES, false, qm_q8_0_split_element(qs, d, e),
                    qq_q8_0_block(x, d, qs))

#undef QT_CUDA_SPLIT_BLOCK

/* ---- kept whole: ggml's blocks ------------------------------------------- */

/* A whole-block kind: elements and bytes per block, element j of a block,
 * and the block quantizer (the CPU's). */
#define QT_CUDA_WHOLE_BLOCK(KIND, ELEMS, BYTES, VALUE, QUANTIZE)                                   \
    template <> struct qt_cuda_block<KIND> {                                                       \
        static constexpr int64_t kElems = ELEMS;                                                   \
        static constexpr int64_t kBytes = BYTES;                                                   \
        static __host__ __device__ float value(const uint8_t *blk, int j)                          \
        {                                                                                          \
            return VALUE(blk, j);                                                                  \
        }                                                                                          \
        static __host__ __device__ void quantize(const float *x, uint8_t *blk)                     \
        {                                                                                          \
            QUANTIZE(x, blk);                                                                      \
        }                                                                                          \
    };

/* Q5_0 and Q5_1 write their f16 d (and m) around qq_q5_*_block's codes,
 * little endian, where ggml has them. */
__host__ __device__ inline void qt_cuda_q5_0_block(const float *x, uint8_t *blk)
{
    uint16_t db;
    qq_q5_0_block(x, &db, blk + 2, blk + 6);
    blk[0] = (uint8_t)(db & 0xffu);
    blk[1] = (uint8_t)(db >> 8);
}

__host__ __device__ inline void qt_cuda_q5_1_block(const float *x, uint8_t *blk)
{
    uint16_t db, mb = 0;
    qq_q5_1_block(x, &db, &mb, blk + 4, blk + 8);
    blk[2] = (uint8_t)(mb & 0xffu);
    blk[3] = (uint8_t)(mb >> 8);
    blk[0] = (uint8_t)(db & 0xffu);
    blk[1] = (uint8_t)(db >> 8);
}

QT_CUDA_WHOLE_BLOCK(QT_Q5_0, QM_GGUF_QK, QM_Q5_0_BYTES, qm_q5_0_block_value, qt_cuda_q5_0_block)
QT_CUDA_WHOLE_BLOCK(QT_Q5_1, QM_GGUF_QK, QM_Q5_1_BYTES, qm_q5_1_block_value, qt_cuda_q5_1_block)
QT_CUDA_WHOLE_BLOCK(QT_Q4_K, QM_QK_K, QM_Q4_K_BYTES, qm_q4_k_block_value, qk_q4_k_block)
QT_CUDA_WHOLE_BLOCK(QT_Q5_K, QM_QK_K, QM_Q5_K_BYTES, qm_q5_k_block_value, qk_q5_k_block)
QT_CUDA_WHOLE_BLOCK(QT_Q6_K, QM_QK_K, QM_Q6_K_BYTES, qm_q6_k_block_value, qk_q6_k_block)
QT_CUDA_WHOLE_BLOCK(QT_Q2_K, QM_QK_K, QM_Q2_K_BYTES, qm_q2_k_block_value, qk_q2_k_block)
QT_CUDA_WHOLE_BLOCK(QT_Q3_K, QM_QK_K, QM_Q3_K_BYTES, qm_q3_k_block_value, qk_q3_k_block)
QT_CUDA_WHOLE_BLOCK(QT_IQ4_NL, QM_GGUF_QK, QM_IQ4_NL_BYTES, qm_iq4_nl_block_value, qk_iq4_nl_block)
QT_CUDA_WHOLE_BLOCK(QT_IQ4_XS, QM_QK_K, QM_IQ4_XS_BYTES, qm_iq4_xs_block_value, qk_iq4_xs_block)
QT_CUDA_WHOLE_BLOCK(QT_MXFP4, QM_MXFP4_QK, QM_MXFP4_BYTES, qm_mxfp4_block_value, qq_mxfp4_block)

#undef QT_CUDA_WHOLE_BLOCK

/* Element e of a row-major tensor of whole blocks of kind K. */
template <qt_kind K>
__host__ __device__ __forceinline__ float qt_cuda_whole_element(const uint8_t *blocks, int64_t e)
{
    using B = qt_cuda_block<K>;
    return B::value(blocks + (e / B::kElems) * B::kBytes, (int)(e % B::kElems));
}

#endif /* QT_CUDA_BLOCKS_H */

/*
 * qt_cuda_quantfmt.h - the per-element arithmetic of the checkpoint formats
 * FP8, GPTQ and AWQ on the device: element (r, c) of a qt_cuda_fp8_view or
 * qt_cuda_gptq_view (qt_cuda.h), which the dequantize, the row gather and
 * the generic matvec of these kinds all read.
 *
 * Why shaped so:
 *   - The arithmetic is the CPU rows' (kernels/quant_fp8.c,
 *     kernels/quant_gptq.c) in the same f32 operations, so a device weight
 *     is the CPU's bit for bit (tests/gpu/test_cuda_quantfmt.c requires it):
 *     FP8 is qt_math.h's qm_fp8_element (code * scale, the scale read in its
 *     stored width); GPTQ and AWQ are f32(scale) * (float)(q - z), an f16
 *     widened exactly and an integer of at most 9 bits, so the product is
 *     exact in f32 whatever the order.
 *   - One element from nothing but the view: the kernels that use it take
 *     any shape and any act-order g_idx; none caches a row's groups.
 *
 * C++ only; only the .cu files of kernels/cuda include it.
 */
#ifndef QT_CUDA_QUANTFMT_H
#define QT_CUDA_QUANTFMT_H

#include <cstdint>

#include "qt_cuda.h"
#include "qt_math.h"

/* Element (r, c) of an FP8 tensor. */
__host__ __device__ __forceinline__ float qt_cuda_fp8_at(const qt_cuda_fp8_view &v, int64_t r,
                                                         int64_t c)
{
    return qm_fp8_element(v.codes, v.scales, v.e8m0, v.cols, v.block_rows, v.block_cols,
                          v.scale_cols, r, c);
}

/* The bit offset of output row r's code in its word along the output dim
 * (qzeros; AWQ's qweight too): GPTQ packs in order; AWQ packs columns
 * 8j + [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..7, so column 8j + m sits in
 * nibble (m % 2) * 4 + m / 2. */
__host__ __device__ __forceinline__ int qt_cuda_out_dim_shift(const qt_cuda_gptq_view &v, int64_t r)
{
    if (v.awq) {
        const int m = (int)(r % 8);
        return ((m % 2) * 4 + m / 2) * 4;
    }
    return (int)(r % (32 / v.bits)) * v.bits;
}

/* Row r's scale (widened) and zero (with the v1 offset) in group g. */
__host__ __device__ __forceinline__ void qt_cuda_gptq_group(const qt_cuda_gptq_view &v, int64_t r,
                                                            int64_t g, float *s, int32_t *z)
{
    const int32_t bits = v.bits;
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t zcols = (v.rows * bits + 31) / 32;
    const int zshift = qt_cuda_out_dim_shift(v, r);
    *z = (int32_t)((v.qzeros[g * zcols + r / (32 / bits)] >> zshift) & mask) + v.zero_offset;
    *s = qm_f16_to_f32(v.scales[g * v.rows + r]);
}

/* A weight from its code, its group's scale and zero: the CPU's one f32
 * multiply. */
__host__ __device__ __forceinline__ float qt_cuda_gptq_value(uint32_t q, float s, int32_t z)
{
    return s * (float)((int32_t)q - z);
}

/* Element (r, c) of a GPTQ or AWQ tensor: f32(scale[g][r]) * (q - z[g][r]),
 * g = g_idx[c]. */
__host__ __device__ __forceinline__ float qt_cuda_gptq_at(const qt_cuda_gptq_view &v, int64_t r,
                                                          int64_t c)
{
    const int32_t bits = v.bits, per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    float s;
    int32_t z;
    qt_cuda_gptq_group(v, r, v.g_idx[c], &s, &z);
    uint32_t q;
    if (v.awq)
        q = (v.qweight[c * (v.rows / 8) + r / 8] >> qt_cuda_out_dim_shift(v, r)) & mask;
    else
        q = (v.qweight[(c / per) * v.rows + r] >> ((int)(c % per) * bits)) & mask;
    return qt_cuda_gptq_value(q, s, z);
}

#endif /* QT_CUDA_QUANTFMT_H */

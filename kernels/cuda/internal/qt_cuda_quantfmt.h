/*
 * qt_cuda_quantfmt.h - the per-element arithmetic of the checkpoint formats
 * FP8, CT_INT, GPTQ and AWQ on the device: element (r, c) of a qt_cuda_fp8_view or
 * qt_cuda_gptq_view (qt_cuda.h), which the dequantize, the row gather and
 * the generic matvec of these kinds all read.
 *
 * Why shaped so:
 *   - The arithmetic is the CPU rows' (kernels/quant_fp8.c,
 *     kernels/quant_gptq.c) in the same f32 operations, so a device weight
 *     is the CPU's bit for bit (tests/gpu/test_cuda_quantfmt.c requires it):
 *     FP8 is qt_math.h's qm_fp8_element (code * scale, the scale read in its
 *     stored width); CT_INT (kernels/quant_ct.c) is f32(q - z) * f32(scale);
 *     with a bf16/f16 scale both round the product to that dtype
 *     (qt_round_to_scale_dtype); GPTQ and AWQ are f32(scale) * (float)(q - z), an f16
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

/* Block scale i of v, widened exactly from its stored dtype. */
__host__ __device__ __forceinline__ float qt_cuda_block_scale(const qt_cuda_fp8_view &v, int64_t i)
{
    if (v.scale_dtype == QT_SCALE_E8M0)
        return qm_e8m0_to_f32(static_cast<const uint8_t *>(v.scales)[i]);
    if (v.scale_dtype == QT_SCALE_BF16)
        return qm_bf16_to_f32(static_cast<const uint16_t *>(v.scales)[i]);
    if (v.scale_dtype == QT_SCALE_F16)
        return qm_f16_to_f32(static_cast<const uint16_t *>(v.scales)[i]);
    return static_cast<const float *>(v.scales)[i];
}

/* An f32 product rounded to a 16-bit scale's dtype (qtensor.c's
 * qt_round_to_scale_dtype): f32 and UE8M0 scales leave it as it is. */
__host__ __device__ __forceinline__ float qt_cuda_round_to_scale(const qt_cuda_fp8_view &v, float x)
{
    if (v.scale_dtype == QT_SCALE_BF16)
        return qm_bf16_to_f32(qm_f32_to_bf16(x));
    if (v.scale_dtype == QT_SCALE_F16)
        return qm_f16_to_f32(qm_f32_to_f16(x));
    return x;
}

/* CT_INT's q of element (r, c), signed: int8 as stored, or the packed
 * unsigned code less 2^(bits - 1) (quant_ct.c's decode_block). */
__host__ __device__ __forceinline__ int32_t qt_cuda_ct_code(const qt_cuda_fp8_view &v, int64_t r,
                                                            int64_t c)
{
    const uint8_t *row = v.codes + r * v.row_stride;
    if (v.signed_codes)
        return (int32_t)(int8_t)row[c];
    if (v.bits == 8)
        return (int32_t)row[c] - 128;
    return (int32_t)((row[c / 2] >> ((c & 1) * 4)) & 15u) - 8;
}

/* Element (r, c) of an FP8 or CT_INT tensor: FP8 is code * scale
 * (qm_fp8_element's multiply), CT_INT f32(q - z) * scale (quant_ct.c), both
 * rounded to a 16-bit scale's dtype as the CPU's row walk does. */
__host__ __device__ __forceinline__ float qt_cuda_fp8_at(const qt_cuda_fp8_view &v, int64_t r,
                                                         int64_t c)
{
    if (!v.ct_int && (v.scale_dtype == QT_SCALE_F32 || v.scale_dtype == QT_SCALE_E8M0))
        return qm_fp8_element(v.codes, v.scales, v.e8m0, v.cols, v.block_rows, v.block_cols,
                              v.scale_cols, r, c);
    const int64_t b = (r / v.block_rows) * v.scale_cols + c / v.block_cols;
    const float s = qt_cuda_block_scale(v, b);
    float q;
    if (v.ct_int)
        q = (float)(qt_cuda_ct_code(v, r, c) - (v.zeros ? (int32_t)v.zeros[b] : 0));
    else
        q = qm_e4m3_to_f32(v.codes[r * v.cols + c]);
    return qt_cuda_round_to_scale(v, q * s);
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

/*
 * qt_math.h - per-element and per-block arithmetic shared by the CPU kernels
 * and the CUDA kernels (kernels/cuda/). Internal to kernels/.
 *
 * Every function here is QL_HD: compiled as plain C for the CPU and as
 * __host__ __device__ under nvcc, so the CPU tests exercise the very
 * arithmetic the GPU runs. Keep them branch-light and free of libc calls
 * other than the float intrinsics both sides have.
 */
#ifndef QL_QT_MATH_H
#define QL_QT_MATH_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define QL_HD __host__ __device__ __forceinline__
#else
#define QL_HD static inline
#endif

/* Bit casts that both compilers turn into a register move. */
QL_HD uint32_t qm_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

QL_HD float qm_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 is the top half of an f32. */
QL_HD float qm_bf16_to_f32(uint16_t b)
{
    return qm_bits_f32((uint32_t)b << 16);
}

/* Round to nearest even, as torch and bitsandbytes do; NaN stays a quiet NaN. */
QL_HD uint16_t qm_f32_to_bf16(float f)
{
    uint32_t u = qm_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE binary16 to f32, subnormals included. */
QL_HD float qm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) /* Inf or NaN */
        return qm_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return qm_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* f32 to IEEE binary16, round to nearest even, overflow to Inf. */
QL_HD uint16_t qm_f32_to_f16(float f)
{
    uint32_t u = qm_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) /* NaN: keep it quiet */
        return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
    if (abs >= 0x477ff000u) /* rounds to >= 65520: Inf */
        return (uint16_t)(sign | 0x7c00u);
    if (abs < 0x38800000u) {
        /* result is subnormal or zero: round abs / 2^-24 to an integer */
        if (abs < 0x33000000u) /* below half the smallest subnormal */
            return (uint16_t)sign;
        uint32_t exp = abs >> 23;
        uint32_t man = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - exp; /* 14..24: value = man * 2^(exp-150) */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias the exponent, round the 13 dropped mantissa bits */
    uint32_t r = abs - 0x38000000u; /* exponent 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* One 4-bit code of a bitsandbytes-packed byte stream: element e lives in
 * byte e / 2, the even element in the high nibble. */
QL_HD unsigned qm_nibble(const uint8_t *codes, int64_t e)
{
    uint8_t byte = codes[e >> 1];
    return (e & 1) ? (byte & 0x0fu) : (byte >> 4);
}

/* absmax of block b under double quantization, as bitsandbytes'
 * dequantize_4bit computes it: the 8-bit code times its block's scale, in
 * f32, then the offset added in a second f32 operation. */
QL_HD float qm_nested_absmax(const uint8_t *absmax_codes, const float *nested_code,
                             const float *nested_absmax, int32_t nested_blocksize, float offset,
                             int64_t b)
{
    float a = nested_code[absmax_codes[b]] * nested_absmax[b / nested_blocksize];
    return a + offset;
}

/* One element of a 4-bit blockwise tensor: code value times its absmax. */
QL_HD float qm_4bit_value(const float *codebook, unsigned code, float absmax)
{
    return codebook[code] * absmax;
}

#endif

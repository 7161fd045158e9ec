/*
 * qt_quant_math.h - the quantizing arithmetic shared by the CPU quantizers
 * (quant_bnb4.c, quant_affine.c, quant_gguf.c) and the CUDA merge
 * (kernels/cuda/qt_cuda_lora.cu). Internal to kernels/. The dequantizing
 * half is qt_math.h; this is its inverse.
 *
 * Every QL_HD function is compiled as plain C for the CPU and as
 * __host__ __device__ under nvcc, so a GPU requantization that calls them
 * with the same inputs writes the CPU's bytes, which test_bnb4, test_affine
 * and test_gguf pin against bitsandbytes, torchao and gguf-py; and
 * tests/test_quant_math.c pins these functions themselves. The rules of
 * qt_math.h hold: one float operation per statement in the origins' order,
 * no fused multiply-add on either side (-ffp-contract=off, --fmad=false),
 * no libc beyond the float functions both sides have and define alike
 * (fabsf, nearbyintf, roundf, the IEEE division).
 *
 * Two choices that make the bits independent of the C library and of the
 * processor, where they could otherwise differ:
 *   - qq_minf / qq_maxf are comparisons that keep the first operand on a
 *     tie, which is what glibc's fminf/fmaxf do for finite arguments (so
 *     the CPU's bits did not change when they replaced them); the CUDA
 *     fminf would pick -0.0 over +0.0, which only ever shows in a Q4_1
 *     block's stored minimum, but shows there;
 *   - qq_trunc_i8 is gcc's x86-64 (int8_t) conversion of a float
 *     (cvttss2si, then the low byte), spelled out, so a value out of the
 *     int32 range (an infinite reciprocal of a tiny block scale) gives the
 *     same code on the device, whose own conversion saturates.
 *
 * Per-block functions leave the reduction (absmax, min, max) to the caller
 * where the order cannot change the result (an exact maximum of |x|, or a
 * minimum whose zero's sign never reaches a stored value: see
 * qq_affine_qparams), so a GPU warp may reduce in any order; where it can
 * (GGUF's first-of-equal maximum, Q4_1's stored minimum) the function
 * takes the whole block and scans it in the CPU's order.
 *
 * The double quantization of NF4/FP4 absmax (bitsandbytes
 * compress_statistics) runs on the CPU only, also for the CUDA merge: its
 * f32 mean follows torch's cascade summation order and its codes a 64 Ki
 * lookup table; both are static inline host functions at the end.
 *
 * One dequantizing section lives here too, for the GGUF types added after
 * the k-quants of qt_math.h: Q2_K, Q3_K, IQ4_NL and IQ4_XS (block layouts,
 * codes, sub-block scales and element values, QL_HD under the same rules).
 * quant_gguf.c, matmul_avx2.c and the CUDA kernels read them from here;
 * tests/test_gguf.c pins them against gguf-py and, through
 * check_gguf_kquant_llama_cpp.py, llama.cpp's own dequantize_row_*.
 */
#ifndef QL_QT_QUANT_MATH_H
#define QL_QT_QUANT_MATH_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qt_math.h"

/* ---- comparisons ----------------------------------------------------------- */

/* min and max of finite floats, the first operand on a tie (see above). */
QL_HD float qq_minf(float a, float b)
{
    return b < a ? b : a;
}

QL_HD float qq_maxf(float a, float b)
{
    return b > a ? b : a;
}

/* v clamped to [lo, hi]; v itself when inside. */
QL_HD float qq_clampf(float v, float lo, float hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/* gcc's x86-64 (int)(int8_t)v: truncate to int32 (cvttss2si, whose answer
 * for NaN and out-of-range values is INT32_MIN), keep the low byte, read it
 * signed. */
QL_HD int qq_trunc_i8(float v)
{
    int32_t i = (v >= -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
    int byte = (int)((uint32_t)i & 0xffu);
    return byte >= 128 ? byte - 256 : byte;
}

/* ---- NF4, FP4 (bitsandbytes quantize_4bit) --------------------------------- */

/* The NF4 and FP4 codebooks as bitsandbytes' get_4bit_type stores them;
 * initialisers for kernels/quant_bnb4.c's qt_nf4_code / qt_fp4_code and for
 * the CUDA merge's check that a weight uses them. NF4: quantiles of N(0, 1)
 * (QLoRA, Dettmers et al. 2023, appendix E). FP4: a 1-2-1 sign/exponent/
 * mantissa float with bias 2, in bit-pattern order, divided by its largest
 * value 12; entry 8 is +0.0 as get_4bit_type writes it. */
#define QQ_NF4_CODE_INIT                                                                           \
    {                                                                                              \
        -0x1p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f, -0x1.23449ap-2f,                \
            -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0x0p+0f, 0x1.45f5fep-4f, 0x1.4995c6p-3f,             \
            0x1.f809bap-3f, 0x1.5a0674p-2f, 0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f,         \
            0x1p+0f,                                                                               \
    }
#define QQ_FP4_CODE_INIT                                                                           \
    {                                                                                              \
        0.0f, 0.0625f / 12.0f, 8.0f / 12.0f, 12.0f / 12.0f, 4.0f / 12.0f, 6.0f / 12.0f,            \
            2.0f / 12.0f, 3.0f / 12.0f, 0.0f, -0.0625f / 12.0f, -8.0f / 12.0f, -12.0f / 12.0f,     \
            -4.0f / 12.0f, -6.0f / 12.0f, -2.0f / 12.0f, -3.0f / 12.0f,                            \
    }

/* Below this absmax bitsandbytes clamps before scaling (a subnormal f32;
 * both sides keep subnormals: no -ffast-math, no --ftz). */
#define QQ_BNB_ABSMAX_FLOOR 1e-38f

/* The sorted view of a 4-bit codebook that bucketing needs. */
typedef struct qq_buckets {
    float bounds[15];  /* f32 midpoints of adjacent sorted codes, ascending */
    uint8_t order[16]; /* sorted position -> code */
} qq_buckets;

/* Sort the 16 codes (stable insertion sort, so FP4's +0 and -0 keep their
 * table order, as torch.argsort did) and take the f32 midpoints. */
QL_HD void qq_build_buckets(const float *code, qq_buckets *cb)
{
    for (int i = 0; i < 16; i++)
        cb->order[i] = (uint8_t)i;
    for (int i = 1; i < 16; i++) {
        uint8_t o = cb->order[i];
        int j = i - 1;
        while (j >= 0 && code[cb->order[j]] > code[o]) {
            cb->order[j + 1] = cb->order[j];
            j--;
        }
        cb->order[j + 1] = o;
    }
    for (int i = 0; i < 15; i++)
        cb->bounds[i] = (code[cb->order[i]] + code[cb->order[i + 1]]) / 2.0f;
}

/* torch.bucketize(s, bounds, right=False): the number of bounds strictly
 * below s (a value on a midpoint goes to the lower code), mapped back to
 * the code. Counting equals the first-bound-not-below search because the
 * midpoints of sorted codes are sorted (f32 addition and halving are
 * monotone); counting has no data-dependent loop for a GPU thread. */
QL_HD unsigned qq_bucket(const qq_buckets *cb, float s)
{
    unsigned i = 0;
    for (int j = 0; j < 15; j++)
        i += cb->bounds[j] < s ? 1u : 0u;
    return cb->order[i];
}

/* The scaled value clamped to [-1, 1], as bitsandbytes does before bucketing. */
QL_HD float qq_clamp_unit(float s)
{
    return qq_clampf(s, -1.0f, 1.0f);
}

/* A full block multiplies by the f32 reciprocal of its absmax, clamped
 * below at the floor; it stores the unclamped absmax. */
QL_HD float qq_bnb4_recip(float absmax)
{
    return 1.0f / qq_maxf(absmax, QQ_BNB_ABSMAX_FLOOR);
}

QL_HD unsigned qq_bnb4_code_full(const qq_buckets *cb, float x, float recip)
{
    return qq_bucket(cb, qq_clamp_unit(x * recip));
}

/* The short last block clamps its absmax, stores the clamped value and
 * divides by it. */
QL_HD float qq_bnb4_short_absmax(float absmax)
{
    return qq_maxf(absmax, QQ_BNB_ABSMAX_FLOOR);
}

QL_HD unsigned qq_bnb4_code_short(const qq_buckets *cb, float x, float short_absmax)
{
    return qq_bucket(cb, qq_clamp_unit(x / short_absmax));
}

/* ---- AFFINE (torchao _choose_qparams_affine, quantize_affine) -------------- */

/*
 * Scale and zero of one group from its minimum and maximum, as torchao:
 *   symmetric:   scale = max(-min(mn, 0), max(mx, 0)) / ((qmax - qmin) / 2),
 *                zero = floor((qmax + qmin + 1) / 2)
 *   integer zero domain: scale = (max(mx, 0) - min(mn, 0)) / (qmax - qmin),
 *                zero = clamp(qmin - round(min(mn, 0) / scale), qmin, qmax)
 *   float zero domain: scale = (mx - mn) / (qmax - qmin),
 *                zero = mn + scale * mid
 * every scale clamped below at eps. The sign of a zero mn or mx never
 * reaches scale or zero (a zero range is clamped to eps, qmin - (+-0) is
 * qmin or +0, mn + a positive product is the product), so mn and mx may
 * come from a reduction in any order.
 */
QL_HD void qq_affine_qparams(float mn, float mx, int32_t qmin, int32_t qmax, bool symmetric,
                             bool float_zero, float eps, float *scale, float *zero)
{
    float range = (float)(qmax - qmin);
    if (symmetric) {
        float amax = qq_maxf(-qq_minf(mn, 0.0f), qq_maxf(mx, 0.0f));
        *scale = qq_maxf(amax / (range / 2.0f), eps);
        *zero = floorf((float)(qmax + qmin + 1) / 2.0f);
    } else if (!float_zero) {
        float mn0 = qq_minf(mn, 0.0f), mx0 = qq_maxf(mx, 0.0f);
        *scale = qq_maxf((mx0 - mn0) / range, eps);
        *zero = qq_clampf((float)qmin - nearbyintf(mn0 / *scale), (float)qmin, (float)qmax);
    } else {
        float mid = qm_affine_mid(qmin, qmax);
        *scale = qq_maxf((mx - mn) / range, eps);
        float shift = *scale * mid;
        *zero = mn + shift;
    }
}

/* What a group's codes are computed with, from its scale and zero: the
 * integer domain multiplies by the f32 reciprocal of the scale; the float
 * domain subtracts the group's minimum zero - scale * mid and divides. */
typedef struct qq_affine_group {
    float recip;   /* 1 / scale */
    float min_val; /* zero - scale * mid */
    float scale, zero;
} qq_affine_group;

QL_HD qq_affine_group qq_affine_group_of(float scale, float zero, float mid)
{
    qq_affine_group g;
    g.recip = 1.0f / scale;
    float shift = scale * mid;
    g.min_val = zero - shift;
    g.scale = scale;
    g.zero = zero;
    return g;
}

/* The stored (unsigned, q - qmin) code of w, torch.round being half to
 * even (nearbyintf under the default rounding mode on both sides):
 *   integer zero: q = clamp(round(w * (1 / scale)) + zero, qmin, qmax)
 *   float zero:   q = clamp(round((w - min_val) / scale), qmin, qmax) */
QL_HD unsigned qq_affine_code(float w, const qq_affine_group *g, int32_t qmin, int32_t qmax,
                              bool float_zero)
{
    float q;
    if (!float_zero) {
        float scaled = w * g->recip;
        q = nearbyintf(scaled) + g->zero;
    } else {
        float shifted = w - g->min_val;
        q = nearbyintf(shifted / g->scale);
    }
    q = qq_clampf(q, (float)qmin, (float)qmax);
    return (unsigned)((int)q - qmin);
}

/* ---- GGUF Q4_0, Q4_1, Q8_0 (ggml quantize_row_*_ref) ----------------------- */

/*
 * One block of 32 values x to its f16 scale d (bits), and for Q4_1 its f16
 * minimum m, and its codes qs laid out as ggml's (4-bit: byte j holds
 * element j low and element j + 16 high; Q8_0: one signed byte each):
 *   Q4_0  d = (the value of largest magnitude, the first of equals) / -8,
 *         q = min(15, trunc(x / d + 8.5))
 *   Q4_1  d = (max - min) / 15, m = min, q = min(15, trunc((x - m) / d + 0.5))
 *   Q8_0  d = max |x| / 127, q = round(x / d) half away from zero
 * each "/ d" a multiply by the f32 reciprocal (0 when d is 0), each trunc
 * qq_trunc_i8.
 */
QL_HD void qq_q4_0_block(const float *x, uint16_t *d_bits, uint8_t *qs)
{
    float amax = 0.0f, signed_max = 0.0f;
    for (int j = 0; j < QM_GGUF_QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            signed_max = x[j];
        }
    }
    float d = signed_max / -8.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_bits = qm_f32_to_f16(d);
    for (int j = 0; j < QM_GGUF_QK / 2; j++) {
        float v0 = x[j] * id, v1 = x[j + QM_GGUF_QK / 2] * id;
        int q0 = qq_trunc_i8(v0 + 8.5f);
        int q1 = qq_trunc_i8(v1 + 8.5f);
        q0 = q0 < 15 ? q0 : 15;
        q1 = q1 < 15 ? q1 : 15;
        qs[j] = (uint8_t)((unsigned)q0 | ((unsigned)q1 << 4));
    }
}

QL_HD void qq_q4_1_block(const float *x, uint16_t *d_bits, uint16_t *m_bits, uint8_t *qs)
{
    float mn = x[0], mx = x[0];
    for (int j = 1; j < QM_GGUF_QK; j++) {
        mn = qq_minf(mn, x[j]);
        mx = qq_maxf(mx, x[j]);
    }
    float d = (mx - mn) / 15.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_bits = qm_f32_to_f16(d);
    *m_bits = qm_f32_to_f16(mn);
    for (int j = 0; j < QM_GGUF_QK / 2; j++) {
        float s0 = x[j] - mn, s1 = x[j + QM_GGUF_QK / 2] - mn;
        float v0 = s0 * id, v1 = s1 * id;
        int q0 = qq_trunc_i8(v0 + 0.5f);
        int q1 = qq_trunc_i8(v1 + 0.5f);
        q0 = q0 < 15 ? q0 : 15;
        q1 = q1 < 15 ? q1 : 15;
        qs[j] = (uint8_t)((unsigned)q0 | ((unsigned)q1 << 4));
    }
}

QL_HD void qq_q8_0_block(const float *x, uint16_t *d_bits, uint8_t *qs)
{
    float amax = 0.0f;
    for (int j = 0; j < QM_GGUF_QK; j++)
        amax = qq_maxf(amax, fabsf(x[j]));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_bits = qm_f32_to_f16(d);
    for (int j = 0; j < QM_GGUF_QK; j++) {
        float v = x[j] * id;
        qs[j] = (uint8_t)((unsigned)qq_trunc_i8(roundf(v)) & 0xffu);
    }
}

/*
 * GGUF Q5_0 and Q5_1 (ggml quantize_row_q5_0_ref, quantize_row_q5_1_ref):
 * Q4_0's and Q4_1's arithmetic with 32 levels,
 *   Q5_0  d = (the first value of largest magnitude) / -16,
 *         q = min(31, trunc(x / d + 16.5))
 *   Q5_1  d = (max - min) / 31, m = min, q = trunc((x - m) / d + 0.5)
 *         (ggml clamps Q5_1 nowhere; its (uint8_t) keeps the low byte)
 * the low four bits as Q4_0's nibbles, bit 4 of element j into bit j of
 * the little-endian uint32 qh.
 */
QL_HD void qq_q5_pack(const int *q, uint8_t *qh, uint8_t *qs)
{
    uint32_t h = 0;
    for (int j = 0; j < QM_GGUF_QK / 2; j++) {
        unsigned q0 = (unsigned)q[j] & 0xffu, q1 = (unsigned)q[j + QM_GGUF_QK / 2] & 0xffu;
        qs[j] = (uint8_t)((q0 & 0x0fu) | ((q1 & 0x0fu) << 4));
        h |= ((q0 & 0x10u) >> 4) << j;
        h |= ((q1 & 0x10u) >> 4) << (j + QM_GGUF_QK / 2);
    }
    for (int i = 0; i < 4; i++)
        qh[i] = (uint8_t)(h >> (8 * i));
}

QL_HD void qq_q5_0_block(const float *x, uint16_t *d_bits, uint8_t *qh, uint8_t *qs)
{
    float amax = 0.0f, signed_max = 0.0f;
    for (int j = 0; j < QM_GGUF_QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            signed_max = x[j];
        }
    }
    float d = signed_max / -16.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_bits = qm_f32_to_f16(d);
    int q[QM_GGUF_QK];
    for (int j = 0; j < QM_GGUF_QK; j++) {
        float v = x[j] * id;
        int c = qq_trunc_i8(v + 16.5f);
        q[j] = c < 31 ? c : 31;
    }
    qq_q5_pack(q, qh, qs);
}

QL_HD void qq_q5_1_block(const float *x, uint16_t *d_bits, uint16_t *m_bits, uint8_t *qh,
                         uint8_t *qs)
{
    float mn = x[0], mx = x[0];
    for (int j = 1; j < QM_GGUF_QK; j++) {
        mn = qq_minf(mn, x[j]);
        mx = qq_maxf(mx, x[j]);
    }
    float d = (mx - mn) / 31.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_bits = qm_f32_to_f16(d);
    *m_bits = qm_f32_to_f16(mn);
    int q[QM_GGUF_QK];
    for (int j = 0; j < QM_GGUF_QK; j++) {
        float s = x[j] - mn;
        float v = s * id;
        q[j] = qq_trunc_i8(v + 0.5f);
    }
    qq_q5_pack(q, qh, qs);
}

/* ---- dequantizing GGUF Q2_K, Q3_K, IQ4_NL, IQ4_XS (llama.cpp) ---------------
 *
 * Layouts (ggml-common.h; QK_K = 256, all fields little-endian):
 *   block_q2_K   { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }        84 bytes
 *   block_q3_K   { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }    110 bytes
 *   block_iq4_nl { f16 d; u8 qs[16]; }                      (32 elems) 18 bytes
 *   block_iq4_xs { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]; } 136 bytes
 *
 * Q2_K: sixteen sub-blocks of 16; scales[s] holds sub-block s's 4-bit
 * scale (low nibble) and 4-bit minimum (high nibble). In each half of 128
 * (32 bytes of qs), element 32 * k + l (k 0..3, l 0..31) is bits 2k, 2k + 1
 * of qs[l]. w = (d * sc) * q - (dmin * m): as dequantize_row_q2_K, d1 =
 * d * sc and m1 = dmin * m once per sub-block, then qm_k4_value's multiply
 * and subtraction.
 * Q3_K: sixteen sub-blocks of 16 with 6-bit scales (stored minus 32) packed
 * in scales[12]: the low four bits of scale s in the low (s < 8) or high
 * (s >= 8) nibble of scales[s % 8], its top two bits in bits
 * 2 * (s / 4), + 1 of scales[8 + s % 4]. Element 32 * k + l of half h
 * takes bits 2k, 2k + 1 of qs[32 * h + l] and subtracts 4 unless bit
 * 4 * h + k of hmask[l] is set: a signed code in -4..3. w = (d * sc) * q,
 * d * sc rounded first (dequantize_row_q3_K's dl).
 * IQ4_NL: blocks of 32 laid out as Q4_0's (byte j: element j low, j + 16
 * high), each nibble an index into the 16 non-linear levels below; w =
 * d * level.
 * IQ4_XS: eight sub-blocks of 32, each IQ4_NL's nibble layout over its 16
 * bytes of qs, with a 6-bit scale (stored minus 32): low four bits in
 * nibble s % 2 of scales_l[s / 2], top two in bits 2s, 2s + 1 of
 * scales_h. w = (d * sc) * level, d * sc rounded first.
 */
#define QM_Q2_K_BYTES   84
#define QM_Q3_K_BYTES   110
#define QM_IQ4_NL_QK    32
#define QM_IQ4_NL_BYTES 18
#define QM_IQ4_XS_BYTES 136

/* llama.cpp's kvalues_iq4nl: the 16 levels of IQ4_NL and IQ4_XS, an
 * initializer for a device-side constant table; qm_iq4nl_level is the same
 * table as a function. */
#define QM_IQ4NL_LEVELS_INIT                                                                       \
    {                                                                                              \
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113                   \
    }

QL_HD int qm_iq4nl_level(int code)
{
    const int8_t levels[16] = QM_IQ4NL_LEVELS_INIT;
    return levels[code & 15];
}

/* Q2_K: the 2-bit code (0..3) of element j (0..255). */
QL_HD int qm_q2_k_code(const uint8_t *blk, int j)
{
    int half = j / 128, k = (j % 128) / 32, l = j % 32;
    return (blk[16 + 32 * half + l] >> (2 * k)) & 3;
}

/* Q2_K sub-block s (0..15): d1 = d * sc and m1 = dmin * m, in f32. */
QL_HD void qm_q2_k_sub_scales(const uint8_t *blk, int s, float *d1, float *m1)
{
    int sc = blk[s];
    *d1 = qm_f16_le(blk + 80) * (float)(sc & 0xF);
    *m1 = qm_f16_le(blk + 82) * (float)(sc >> 4);
}

QL_HD float qm_q2_k_block_value(const uint8_t *blk, int j)
{
    float d1, m1;
    qm_q2_k_sub_scales(blk, j / 16, &d1, &m1);
    return qm_k4_value(qm_q2_k_code(blk, j), d1, m1);
}

/* Q3_K: the 6-bit scale of sub-block s (0..15), minus 32 (-32..31). */
QL_HD int qm_q3_k_scale(const uint8_t *blk, int s)
{
    const uint8_t *sc = blk + 96;
    int lo = s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4;
    int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* Q3_K: the signed code (-4..3) of element j (0..255). */
QL_HD int qm_q3_k_code(const uint8_t *blk, int j)
{
    int half = j / 128, k = (j % 128) / 32, l = j % 32;
    int low = (blk[32 + 32 * half + l] >> (2 * k)) & 3;
    int high = (blk[l] >> (4 * half + k)) & 1;
    return low - (high ? 0 : 4);
}

/* Q3_K sub-block s: d * scale in f32. */
QL_HD float qm_q3_k_sub_scale(const uint8_t *blk, int s)
{
    return qm_f16_le(blk + 108) * (float)qm_q3_k_scale(blk, s);
}

QL_HD float qm_q3_k_block_value(const uint8_t *blk, int j)
{
    return qm_q3_k_sub_scale(blk, j / 16) * (float)qm_q3_k_code(blk, j);
}

/* IQ4_NL and IQ4_XS: w = d * level, one f32 multiply (d the block's, or
 * IQ4_XS's sub-block scale). */
QL_HD float qm_iq4_value(int code, float d)
{
    return d * (float)qm_iq4nl_level(code);
}

/* IQ4_NL: element j (0..31) of one block of 32. */
QL_HD float qm_iq4_nl_block_value(const uint8_t *blk, int j)
{
    return qm_iq4_value(qm_gguf_nibble(blk + 2, j), qm_f16_le(blk));
}

/* IQ4_XS: the 6-bit scale of sub-block s (0..7), minus 32 (-32..31). */
QL_HD int qm_iq4_xs_scale(const uint8_t *blk, int s)
{
    int lo = (blk[4 + s / 2] >> (4 * (s % 2))) & 0xF;
    int hi = (((int)blk[2] | ((int)blk[3] << 8)) >> (2 * s)) & 3;
    return (lo | (hi << 4)) - 32;
}

/* IQ4_XS sub-block s: d * scale in f32. */
QL_HD float qm_iq4_xs_sub_scale(const uint8_t *blk, int s)
{
    return qm_f16_le(blk) * (float)qm_iq4_xs_scale(blk, s);
}

/* IQ4_XS: the 4-bit level index (0..15) of element j (0..255). */
QL_HD int qm_iq4_xs_code(const uint8_t *blk, int j)
{
    return qm_gguf_nibble(blk + 8 + 16 * (j / 32), j % 32);
}

QL_HD float qm_iq4_xs_block_value(const uint8_t *blk, int j)
{
    return qm_iq4_value(qm_iq4_xs_code(blk, j), qm_iq4_xs_sub_scale(blk, j / 32));
}

/* Element e of a row-major tensor of these blocks (cols a multiple of the
 * block, so element e is element e % block of block e / block). */
QL_HD float qm_q2_k_element(const uint8_t *blocks, int64_t e)
{
    return qm_q2_k_block_value(blocks + (e / QM_QK_K) * QM_Q2_K_BYTES, (int)(e % QM_QK_K));
}

QL_HD float qm_q3_k_element(const uint8_t *blocks, int64_t e)
{
    return qm_q3_k_block_value(blocks + (e / QM_QK_K) * QM_Q3_K_BYTES, (int)(e % QM_QK_K));
}

QL_HD float qm_iq4_nl_element(const uint8_t *blocks, int64_t e)
{
    return qm_iq4_nl_block_value(blocks + (e / QM_IQ4_NL_QK) * QM_IQ4_NL_BYTES,
                                 (int)(e % QM_IQ4_NL_QK));
}

QL_HD float qm_iq4_xs_element(const uint8_t *blocks, int64_t e)
{
    return qm_iq4_xs_block_value(blocks + (e / QM_QK_K) * QM_IQ4_XS_BYTES, (int)(e % QM_QK_K));
}

/* ---- MXFP4 (llama.cpp's block_mxfp4, OCP microscaling FP4) --------------------
 *
 * Layout (ggml-common.h): block_mxfp4 { u8 e; u8 qs[16]; }, 17 bytes per 32
 * elements. e is an E8M0 scale (a bare biased exponent, no sign, no
 * mantissa); byte j of qs holds element j in its low nibble and element
 * j + 16 in its high one (Q4_0's order); each nibble is an FP4 E2M1 value
 * (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
 * negatives). ggml stores the levels doubled (kvalues_mxfp4, integers) and
 * halves the scale instead: w = level * 2^(e - 128), one f32 multiply of
 * exact operands (ggml_e8m0_to_fp32_half builds 2^(e - 128) from bits, a
 * subnormal for e 0 and 1). dequantize_row_mxfp4 and gguf-py's MXFP4 both
 * compute exactly that; so does qm_mxfp4_block_value.
 *
 * Quantizing, as quantize_row_mxfp4_ref: amax = max |x|; e = floorf(log2f(
 * amax)) - 2 + 127 converted to uint8_t (0 when amax is 0); then each element
 * takes the first of the 16 levels whose level * d is nearest (d the
 * dequantizing scale of e). Two steps are spelled out here so the bytes do
 * not depend on a C library or a processor:
 *   - floorf(log2f(amax)) is the exponent of amax, plus one where glibc's
 *     log2f (correctly rounded on every input there, as an exhaustive run
 *     over all positive floats showed) rounds the log of a value just below
 *     a power of two up to that power's exponent: qq_mxfp4_floor_log2 counts
 *     the values that round up instead of calling log2f, which the device
 *     computes with other errors;
 *   - the conversion to uint8_t of a negative exponent (amax below 2^-125)
 *     is gcc's x86-64 one: cvttss2si, then the low byte (so -1 gives 255);
 *     the codes of such a block are all 0, whatever e says.
 */
#define QM_MXFP4_QK    32
#define QM_MXFP4_BYTES 17

/* kvalues_mxfp4: the E2M1 levels doubled, in code order (code 8 is -0, as 0). */
#define QM_MXFP4_LEVELS_INIT                                                                       \
    {                                                                                              \
        0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12                                    \
    }

QL_HD int qm_mxfp4_level(int code)
{
    const int8_t levels[16] = QM_MXFP4_LEVELS_INIT;
    return levels[code & 15];
}

/* ggml_e8m0_to_fp32_half: 2^(e - 128) as f32 bits (e < 2: subnormal). */
QL_HD float qm_e8m0_half(uint8_t e)
{
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return qm_bits_f32(bits);
}

/* w = level * d, one f32 multiply (as dequantize_row_mxfp4's x0 * d). */
QL_HD float qm_mxfp4_value(int code, float d)
{
    return (float)qm_mxfp4_level(code) * d;
}

/* Element j (0..31) of one block. */
QL_HD float qm_mxfp4_block_value(const uint8_t *blk, int j)
{
    return qm_mxfp4_value(qm_gguf_nibble(blk + 1, j), qm_e8m0_half(blk[0]));
}

QL_HD float qm_mxfp4_element(const uint8_t *blocks, int64_t e)
{
    return qm_mxfp4_block_value(blocks + (e / QM_MXFP4_QK) * QM_MXFP4_BYTES,
                                (int)(e % QM_MXFP4_QK));
}

/* The index of the highest set bit of v; -1 for 0. */
QL_HD int qq_top_bit(uint32_t v)
{
    int n = -1;
    while (v) {
        v >>= 1;
        n++;
    }
    return n;
}

/*
 * floorf(log2f(a)) for a finite a > 0, as glibc computes it. a = 2^E * m
 * with m in [1, 2) (a subnormal: mantissa bits man in [2^p, 2^(p+1)),
 * E = p - 149). log2f(a) is E + 1 - delta, delta about r / ln 2 for r the
 * distance of a below 2^(E+1) relative to 2^(E+1); it rounds to E + 1 when
 * delta is under half the float spacing beside E + 1, 2^(k - 24) (k: the
 * top bit of E when E + 1 > 0, of -(E + 1) otherwise). With a's own spacing
 * 2^-24 of 2^(E+1) (2^-(p+1) for a subnormal), that is the `dist` steps
 * below 2^(E+1) with dist <= floor(ln 2 * 2^s), s = k (k + p + 1 - 24 for
 * a subnormal). tests/test_quant_math.c checks it against log2f around
 * every power of two.
 */
QL_HD int qq_mxfp4_floor_log2(float a)
{
    /* floor(ln 2 * 2^s) for s = 0..6 */
    const int ln2_steps[7] = {0, 1, 2, 5, 11, 22, 44};
    uint32_t u = qm_f32_bits(a);
    uint32_t ex = u >> 23, man = u & 0x7fffffu;
    int e, s;
    uint32_t dist;
    if (ex != 0) {
        e = (int)ex - 127;
        dist = 0x800000u - man;
        int v = e + 1;
        s = v > 0 ? (v > 1 ? qq_top_bit((uint32_t)(v - 1)) : -1)
                  : (v < 0 ? qq_top_bit((uint32_t)-v) : -1);
    } else {
        int p = qq_top_bit(man);
        e = p - 149;
        dist = (2u << p) - man;
        s = qq_top_bit((uint32_t) - (e + 1)) + p + 1 - 24;
    }
    int steps = s < 0 ? 0 : ln2_steps[s];
    return e + ((int64_t)dist <= steps ? 1 : 0);
}

/* ggml's E8M0 byte for a block whose largest |x| is amax (see above). */
QL_HD uint8_t qq_mxfp4_scale(float amax)
{
    if (!(amax > 0.0f))
        return 0;
    int32_t e = qq_mxfp4_floor_log2(amax) - 2 + 127;
    return (uint8_t)((uint32_t)e & 0xffu);
}

/* The first code whose level * d is nearest x (best_index_mxfp4). */
QL_HD int qq_mxfp4_code(float x, float d)
{
    int best = 0;
    float best_err = fabsf((float)qm_mxfp4_level(0) * d - x);
    for (int i = 1; i < 16; i++) {
        float err = fabsf((float)qm_mxfp4_level(i) * d - x);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

/* One block of 32 values x into ggml's 17 bytes (quantize_row_mxfp4_ref). */
QL_HD void qq_mxfp4_block(const float *x, uint8_t *blk)
{
    float amax = 0.0f;
    for (int j = 0; j < QM_MXFP4_QK; j++)
        if (amax < fabsf(x[j]))
            amax = fabsf(x[j]);
    uint8_t e = qq_mxfp4_scale(amax);
    float d = qm_e8m0_half(e);
    blk[0] = e;
    for (int j = 0; j < QM_MXFP4_QK / 2; j++) {
        int q0 = qq_mxfp4_code(x[j], d);
        int q1 = qq_mxfp4_code(x[j + QM_MXFP4_QK / 2], d);
        blk[1 + j] = (uint8_t)((unsigned)q0 | ((unsigned)q1 << 4));
    }
}

/* ---- NF4/FP4 double quantization: CPU only ---------------------------------
 *
 * bitsandbytes' compress_statistics: offset = mean(absmax) as torch
 * computes it in f32, then absmax - offset quantized in blocks of 256 with
 * the signed dynamic 8-bit map, as the native CPU library rounds it. Plain
 * static inline (host-only under nvcc): the CUDA merge brings a tensor's
 * absmax back to the host and runs exactly this.
 */

/* Elements per nested block, as bitsandbytes. */
#define QQ_NESTED_BLOCKSIZE 256

/*
 * torch's f32 sum of a contiguous vector on an AVX2 (or default) CPU build,
 * one thread, whose order decides the last bit of the nested offset
 * (tests/fixtures/make_bnb_vectors.py, finding c).
 *
 * qq_cascade_rows is torch's multi_row_sum: m rows of `cols` lanes (row i,
 * lane c at x[i * stride + c * col_stride]) summed into four levels of
 * accumulators, each level folded into the next every 2^power rows.
 */
static inline void qq_cascade_rows(const float *x, int64_t stride, int64_t m, int64_t cols,
                                   int64_t col_stride, float *out_cols)
{
    enum { LEVELS = 4 };
    int64_t clog = 1; /* ceil(log2(m)), at least 1 */
    while (m > 2 && ((int64_t)1 << clog) < m)
        clog++;
    int64_t power = clog / LEVELS > 4 ? clog / LEVELS : 4;
    int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][4] = {{0}};
    int64_t i = 0;
    while (i + step <= m) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t c = 0; c < cols; c++)
                acc[0][c] += x[i * stride + c * col_stride];
        for (int l = 1; l < LEVELS; l++) {
            for (int64_t c = 0; c < cols; c++) {
                acc[l][c] += acc[l - 1][c];
                acc[l - 1][c] = 0.0f;
            }
            if ((i & (mask << (l * power))) != 0)
                break;
        }
    }
    for (; i < m; i++)
        for (int64_t c = 0; c < cols; c++)
            acc[0][c] += x[i * stride + c * col_stride];
    for (int l = 1; l < LEVELS; l++)
        for (int64_t c = 0; c < cols; c++)
            acc[0][c] += acc[l][c];
    for (int64_t c = 0; c < cols; c++)
        out_cols[c] = acc[0][c];
}

/* torch's row_sum: the m items as rows of 4, leftovers into the first
 * partial, then the partials in order. */
static inline float qq_torch_row_sum(const float *x, int64_t stride, int64_t m)
{
    float part[4];
    int64_t m4 = m / 4;
    qq_cascade_rows(x, 4 * stride, m4, 4, stride, part);
    for (int64_t i = 4 * m4; i < m; i++)
        part[0] += x[i * stride];
    return ((part[0] + part[1]) + part[2]) + part[3];
}

static inline float qq_torch_f32_sum(const float *x, int64_t n)
{
    enum { W = 8 }; /* floats per AVX2 vector */
    if (n < W)
        return qq_torch_row_sum(x, 1, n);
    int64_t nv = n / W;
    /* each of the 8 lanes runs row_sum over its own stream of nv values */
    float lanes[W];
    for (int l = 0; l < W; l++)
        lanes[l] = qq_torch_row_sum(x + l, W, nv);
    float acc = 0.0f;
    for (int64_t k = nv * W; k < n; k++)
        acc += x[k];
    for (int l = 0; l < W; l++)
        acc += lanes[l];
    return acc;
}

/*
 * The 8-bit blockwise quantization bitsandbytes' native CPU library applies
 * to nested absmax (cquantize_blockwise_cpu_fp32). It is not an exact
 * nearest-code search: the code comes from a 65536-entry table indexed by
 * the scaled value, built from the f32 midpoints of the map. Established
 * against the library over ~8.3 million values, see
 * tests/fixtures/make_bnb_vectors.py (finding b):
 *   lut[j]  = number of midpoints below (2j / 65535 - 1), each step in f32
 *   v       = clamp(x * (1 / absmax), -1, 1)
 *   j       = (int)fma((v + 1) * 0.5, 65535, 0.5)   (one fused step, truncated)
 * An all-zero block stores absmax 0 and codes 0.
 */
#define QQ_DYNAMIC_LUT_SIZE 65536

static inline void qq_build_dynamic_lut(const float *map, uint8_t *lut)
{
    float mid[255];
    for (int i = 0; i < 255; i++)
        mid[i] = 0.5f * (map[i] + map[i + 1]);
    int k = 0;
    for (int j = 0; j < QQ_DYNAMIC_LUT_SIZE; j++) {
        float v = (float)(2 * j) / 65535.0f - 1.0f;
        while (k < 255 && mid[k] < v)
            k++;
        lut[j] = (uint8_t)k;
    }
}

static inline void qq_quantize_dynamic_blocks(const float *x, int64_t n, int64_t bs,
                                              const uint8_t *lut, uint8_t *out, float *absmax)
{
    for (int64_t b0 = 0, blk = 0; b0 < n; b0 += bs, blk++) {
        int64_t end = b0 + bs < n ? b0 + bs : n;
        float am = 0.0f;
        for (int64_t i = b0; i < end; i++)
            am = qq_maxf(am, fabsf(x[i]));
        absmax[blk] = am;
        if (am == 0.0f) {
            memset(out + b0, 0, (size_t)(end - b0));
            continue;
        }
        float inv = 1.0f / am;
        for (int64_t i = b0; i < end; i++) {
            float v = qq_clamp_unit(x[i] * inv);
            float t = (v + 1.0f) * 0.5f;
            int j = (int)fmaf(t, 65535.0f, 0.5f) & 0xffff;
            out[i] = lut[j];
        }
    }
}

/*
 * Double-quantize the n_blocks absmax values with the nested map `map`
 * (bitsandbytes' signed dynamic map): *offset = torch's f32 mean, codes
 * (n_blocks) and nested_absmax (ceil(n_blocks / 256)) of absmax - offset.
 * The caller lends lut (QQ_DYNAMIC_LUT_SIZE bytes) and centered (n_blocks
 * floats) as scratch. Beyond 32768 blocks a multithreaded torch splits its
 * sum by thread count, so bit-equality with bitsandbytes holds for its
 * one-thread result.
 */
static inline void qq_bnb4_double_quantize(const float *absmax, int64_t n_blocks, const float *map,
                                           uint8_t *codes, float *nested_absmax, float *offset,
                                           uint8_t *lut, float *centered)
{
    *offset = qq_torch_f32_sum(absmax, n_blocks) / (float)n_blocks;
    for (int64_t b = 0; b < n_blocks; b++)
        centered[b] = absmax[b] - *offset;
    qq_build_dynamic_lut(map, lut);
    qq_quantize_dynamic_blocks(centered, n_blocks, QQ_NESTED_BLOCKSIZE, lut, codes, nested_absmax);
}

#endif

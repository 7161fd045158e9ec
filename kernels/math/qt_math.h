/*
 * qt_math.h - per-element and per-block arithmetic shared by the CPU kernels
 * and the CUDA kernels (kernels/cuda/). Internal to kernels/.
 *
 * Every function here is QL_HD: compiled as plain C for the CPU and as
 * __host__ __device__ under nvcc, so the CPU tests exercise the very
 * arithmetic the GPU runs. Keep them branch-light and free of libc calls
 * other than the float intrinsics both sides have.
 *
 * Each kind has its per-element (or per-block) step and, where a GPU thread
 * needs one, a whole-element function that takes the tensor's raw arrays
 * and an element index: tests/test_qt_math.c runs those against
 * qt_dequantize_rows_ref for every kind. The float operations are written
 * one per statement in the order the formats' origins use; the project
 * compiles with -ffp-contract=off and the CUDA library with --fmad=false,
 * so no multiply and add are fused on either side.
 */
#ifndef QL_QT_MATH_H
#define QL_QT_MATH_H

#include <stdbool.h>
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

/* ---- NF4, FP4 (bitsandbytes) ------------------------------------------ */

/* Element e of a bitsandbytes 4-bit tensor, given its packed codes, its
 * codebook, its blocksize and the absmax of block e / blocksize (as
 * qm_nested_absmax or the plain absmax array gives it). */
QL_HD float qm_4bit_element(const uint8_t *codes, const float *codebook, float absmax, int64_t e)
{
    return qm_4bit_value(codebook, qm_nibble(codes, e), absmax);
}

/* ---- AFFINE (torchao) ---------------------------------------------------- */

/* The stored (unsigned, q - qmin) code of column c of one AFFINE row: a
 * byte for 8 bits, a nibble for 4 (even column in the high nibble, each row
 * starting on a byte). */
QL_HD unsigned qm_affine_code(const uint8_t *row, int32_t bits, int64_t c)
{
    return bits == 8 ? row[c] : qm_nibble(row, c);
}

/* The float zero domain's mid code, (qmin + qmax + 1) / 2 in f32, as torchao's
 * dequantize_affine with ZeroPointDomain.FLOAT (not rounded: 8 for [0, 15]). */
QL_HD float qm_affine_mid(int32_t qmin, int32_t qmax)
{
    return (float)(qmax + qmin + 1) / 2.0f;
}

/* Integer zero domain: w = (q - zero) * scale, the subtraction in integers
 * (zero is integer valued) and one f32 multiply. */
QL_HD float qm_affine_value_int(int q, float zero, float scale)
{
    return (float)(q - (int)zero) * scale;
}

/* Float zero domain: w = (q - mid) * scale + zero, three f32 operations in
 * this order. */
QL_HD float qm_affine_value_float(int q, float mid, float scale, float zero)
{
    float centred = (float)q - mid;
    float scaled = centred * scale;
    return scaled + zero;
}

/* One element from its stored code and its group's scale and zero. mid is
 * qm_affine_mid(qmin, qmax) (used in the float domain only). */
QL_HD float qm_affine_value(unsigned code, int32_t qmin, bool float_zero, float mid, float scale,
                            float zero)
{
    int q = (int)code + qmin;
    return float_zero ? qm_affine_value_float(q, mid, scale, zero)
                      : qm_affine_value_int(q, zero, scale);
}

/* Element (r, c) of an AFFINE tensor from its raw arrays: codes of
 * row_stride bytes per row, scales and zeros per (row, group). */
QL_HD float qm_affine_element(const uint8_t *codes, uint64_t row_stride, int32_t bits, int32_t qmin,
                              bool float_zero, float mid, int32_t group_size,
                              int64_t groups_per_row, const float *scales, const float *zeros,
                              int64_t r, int64_t c)
{
    int64_t g = r * groups_per_row + c / group_size;
    unsigned code = qm_affine_code(codes + (uint64_t)r * row_stride, bits, c);
    return qm_affine_value(code, qmin, float_zero, mid, scales[g], zeros[g]);
}

/* ---- GGUF Q4_0, Q4_1, Q8_0 (llama.cpp) ----------------------------------- */

/* Elements per block and bytes per block, as ggml's block_q4_0 { f16 d;
 * u8 qs[16]; }, block_q4_1 { f16 d, m; u8 qs[16]; }, block_q8_0 { f16 d;
 * i8 qs[32]; }. */
#define QM_GGUF_QK    32
#define QM_Q4_0_BYTES 18
#define QM_Q4_1_BYTES 20
#define QM_Q8_0_BYTES 34

/* A little-endian IEEE half at p, as f32. */
QL_HD float qm_f16_le(const uint8_t *p)
{
    return qm_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

/* Nibble j (0..31) of a 4-bit GGUF block's qs: byte j holds element j in
 * its low nibble and element j + 16 in its high nibble. */
QL_HD int qm_gguf_nibble(const uint8_t *qs, int j)
{
    return j < QM_GGUF_QK / 2 ? qs[j] & 0x0f : qs[j - QM_GGUF_QK / 2] >> 4;
}

/* Q4_0: w = (nibble - 8) * d, the subtraction in integers. */
QL_HD float qm_q4_0_value(int nibble, float d)
{
    return (float)(nibble - 8) * d;
}

/* Q4_1: w = nibble * d + m, two f32 operations in this order. */
QL_HD float qm_q4_1_value(int nibble, float d, float m)
{
    float scaled = (float)nibble * d;
    return scaled + m;
}

/* Q8_0: w = q * d, q signed. */
QL_HD float qm_q8_0_value(int8_t q, float d)
{
    return (float)q * d;
}

/* Element j of one block (blk points at its first byte, the f16 d). */
QL_HD float qm_q4_0_block_value(const uint8_t *blk, int j)
{
    return qm_q4_0_value(qm_gguf_nibble(blk + 2, j), qm_f16_le(blk));
}

QL_HD float qm_q4_1_block_value(const uint8_t *blk, int j)
{
    return qm_q4_1_value(qm_gguf_nibble(blk + 4, j), qm_f16_le(blk), qm_f16_le(blk + 2));
}

QL_HD float qm_q8_0_block_value(const uint8_t *blk, int j)
{
    return qm_q8_0_value((int8_t)blk[2 + j], qm_f16_le(blk));
}

/* Element e of a row-major GGUF tensor (blocks back to back, cols a
 * multiple of 32, so element e is element e % 32 of block e / 32). */
QL_HD float qm_q4_0_element(const uint8_t *blocks, int64_t e)
{
    return qm_q4_0_block_value(blocks + (e / QM_GGUF_QK) * QM_Q4_0_BYTES, (int)(e % QM_GGUF_QK));
}

QL_HD float qm_q4_1_element(const uint8_t *blocks, int64_t e)
{
    return qm_q4_1_block_value(blocks + (e / QM_GGUF_QK) * QM_Q4_1_BYTES, (int)(e % QM_GGUF_QK));
}

QL_HD float qm_q8_0_element(const uint8_t *blocks, int64_t e)
{
    return qm_q8_0_block_value(blocks + (e / QM_GGUF_QK) * QM_Q8_0_BYTES, (int)(e % QM_GGUF_QK));
}

/* ---- GGUF Q5_0, Q5_1 (llama.cpp) ----------------------------------------- */

/* block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }, block_q5_1 { f16 d, m;
 * u8 qh[4]; u8 qs[16]; }: the low four bits of each code as Q4_0's
 * nibbles, the fifth bit of element j in bit j of the little-endian
 * uint32 qh (ggml-common.h). */
#define QM_Q5_0_BYTES 22
#define QM_Q5_1_BYTES 24

/* The 5-bit code j (0..31) from qh (4 bytes) and qs (16 bytes), as
 * dequantize_row_q5_0 builds it: nibble | ((qh >> j) & 1) << 4. */
QL_HD int qm_q5_code(const uint8_t *qh, const uint8_t *qs, int j)
{
    uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) |
                 ((uint32_t)qh[3] << 24);
    return qm_gguf_nibble(qs, j) | (int)(((h >> j) & 1u) << 4);
}

/* Q5_0: w = (code - 16) * d, the subtraction in integers. */
QL_HD float qm_q5_0_value(int code, float d)
{
    return (float)(code - 16) * d;
}

/* Q5_1: w = code * d + m, two f32 operations in this order. */
QL_HD float qm_q5_1_value(int code, float d, float m)
{
    float scaled = (float)code * d;
    return scaled + m;
}

QL_HD float qm_q5_0_block_value(const uint8_t *blk, int j)
{
    return qm_q5_0_value(qm_q5_code(blk + 2, blk + 6, j), qm_f16_le(blk));
}

QL_HD float qm_q5_1_block_value(const uint8_t *blk, int j)
{
    return qm_q5_1_value(qm_q5_code(blk + 4, blk + 8, j), qm_f16_le(blk), qm_f16_le(blk + 2));
}

/* ---- GGUF k-quants Q4_K, Q5_K, Q6_K (llama.cpp, QK_K = 256) --------------- */

/*
 * Super-blocks of 256 elements (ggml-common.h):
 *   block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }             144 bytes
 *   block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; } 176 bytes
 *   block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }           210 bytes
 * Q4_K/Q5_K: eight sub-blocks of 32, each with a 6-bit scale and a 6-bit
 * minimum packed into scales[12] (get_scale_min_k4); w = (d * sc) * q -
 * (dmin * m), as dequantize_row_q4_K: d1 = d * sc and m1 = dmin * m once
 * per sub-block, then one multiply and one subtraction per element.
 * Q6_K: sixteen sub-blocks of 16 with a signed 8-bit scale; w = (d * sc)
 * * (q - 32), the product d * sc rounded first, as dequantize_row_q6_K's
 * left-to-right d * sc[is] * q.
 */
#define QM_QK_K       256
#define QM_Q4_K_BYTES 144
#define QM_Q5_K_BYTES 176
#define QM_Q6_K_BYTES 210

/* Scale and minimum of sub-block j (0..7) of a Q4_K/Q5_K block, from its
 * 12 packed bytes q (ggml's get_scale_min_k4). */
QL_HD void qm_k4_scale_min(int j, const uint8_t *q, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* Sub-block s (0..7) of a Q4_K or Q5_K block: its d1 = d * sc and m1 =
 * dmin * m, in f32, as dequantize_row_q4_K computes them. */
QL_HD void qm_k4_sub_scales(const uint8_t *blk, int s, float *d1, float *m1)
{
    int sc, m;
    qm_k4_scale_min(s, blk + 4, &sc, &m);
    *d1 = qm_f16_le(blk) * (float)sc;
    *m1 = qm_f16_le(blk + 2) * (float)m;
}

/* The unsigned code of element j (0..255) of a Q4_K block: the 32 bytes
 * qs[32 * (j / 64) ..] hold elements j % 64 < 32 low, the next 32 high. */
QL_HD int qm_q4_k_code(const uint8_t *blk, int j)
{
    const uint8_t *qs = blk + 16 + 32 * (j / 64);
    int l = j % 64;
    return l < 32 ? qs[l] & 0xF : qs[l - 32] >> 4;
}

/* Q5_K: Q4_K's nibble plus a fifth bit, bit 2 * (j / 64) + (j % 64 >= 32)
 * of qh[j % 32]. */
QL_HD int qm_q5_k_code(const uint8_t *blk, int j)
{
    const uint8_t *qh = blk + 16, *qs = blk + 48 + 32 * (j / 64);
    int l = j % 64, bit = 2 * (j / 64) + (l >= 32 ? 1 : 0);
    int lo = l < 32 ? qs[l] & 0xF : qs[l - 32] >> 4;
    return lo + (((qh[j % 32] >> bit) & 1) ? 16 : 0);
}

/* w = d1 * q - m1, two f32 operations in this order. */
QL_HD float qm_k4_value(int code, float d1, float m1)
{
    float scaled = d1 * (float)code;
    return scaled - m1;
}

QL_HD float qm_q4_k_block_value(const uint8_t *blk, int j)
{
    float d1, m1;
    qm_k4_sub_scales(blk, j / 32, &d1, &m1);
    return qm_k4_value(qm_q4_k_code(blk, j), d1, m1);
}

QL_HD float qm_q5_k_block_value(const uint8_t *blk, int j)
{
    float d1, m1;
    qm_k4_sub_scales(blk, j / 32, &d1, &m1);
    return qm_k4_value(qm_q5_k_code(blk, j), d1, m1);
}

/* The signed code (q - 32, in -32..31) of element j of a Q6_K block: in
 * each half of 128 (ql 64 bytes, qh 32), element 32 * k + l (k 0..3, l
 * 0..31) takes the low nibble of ql[l] (k 0), of ql[l + 32] (k 1), the
 * high nibble of ql[l] (k 2), of ql[l + 32] (k 3), and bits 2k, 2k + 1 of
 * qh[l] as its top two bits. */
QL_HD int qm_q6_k_code(const uint8_t *blk, int j)
{
    int half = j / 128, k = (j % 128) / 32, l = j % 32;
    const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
    int lo = (k & 1) ? ql[l + 32] : ql[l];
    lo = k < 2 ? lo & 0xF : lo >> 4;
    return (lo | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
}

/* Sub-block s (0..15) of a Q6_K block: d * sc[s] in f32. */
QL_HD float qm_q6_k_sub_scale(const uint8_t *blk, int s)
{
    return qm_f16_le(blk + 208) * (float)(int8_t)blk[192 + s];
}

QL_HD float qm_q6_k_block_value(const uint8_t *blk, int j)
{
    return qm_q6_k_sub_scale(blk, j / 16) * (float)qm_q6_k_code(blk, j);
}

/*
 * The split layout the CUDA backend keeps GGUF tensors in (qt_cuda.h's
 * qt_cuda_gguf_view): each block's qs bytes back to back (16 per block for
 * Q4_0 and Q4_1, 32 for Q8_0, exactly as in ggml), its f16 d in an array of
 * its own, and Q4_1's f16 m in a third. The codes of every block then start
 * on a 16-byte boundary, which 16-byte loads need; the bits are ggml's.
 */
#define QM_Q4_QS_BYTES 16
#define QM_Q8_QS_BYTES 32

/* The qs bytes per block of the split layout for a block of block_bytes
 * (QM_Q4_0_BYTES, QM_Q4_1_BYTES or QM_Q8_0_BYTES). */
QL_HD int qm_gguf_qs_bytes(int block_bytes)
{
    return block_bytes == QM_Q8_0_BYTES ? QM_Q8_QS_BYTES : QM_Q4_QS_BYTES;
}

/* One ggml block (block_bytes long) into its split parts; m is written for
 * Q4_1 only (and may be NULL otherwise). */
QL_HD void qm_gguf_split_block(const uint8_t *blk, int block_bytes, uint8_t *qs, uint16_t *d,
                               uint16_t *m)
{
    int head = 2;
    *d = (uint16_t)(blk[0] | (blk[1] << 8));
    if (block_bytes == QM_Q4_1_BYTES) {
        *m = (uint16_t)(blk[2] | (blk[3] << 8));
        head = 4;
    }
    memcpy(qs, blk + head, (size_t)(block_bytes - head));
}

/* The inverse: the ggml block from its split parts (m used for Q4_1 only). */
QL_HD void qm_gguf_join_block(uint8_t *blk, int block_bytes, const uint8_t *qs, uint16_t d,
                              uint16_t m)
{
    int head = 2;
    blk[0] = (uint8_t)(d & 0xffu);
    blk[1] = (uint8_t)(d >> 8);
    if (block_bytes == QM_Q4_1_BYTES) {
        blk[2] = (uint8_t)(m & 0xffu);
        blk[3] = (uint8_t)(m >> 8);
        head = 4;
    }
    memcpy(blk + head, qs, (size_t)(block_bytes - head));
}

/* ---- 16-byte chunks: what one GPU thread loads at a time ------------------- */

/*
 * The fused CUDA matrix-vector kernels load 16 bytes of codes at a time (one
 * chunk) and take every value of the chunk from those registers: 32 values
 * of 4-bit codes, 16 of 8-bit codes, 8 of f16/bf16, 4 of f32. A chunk is
 * taken only where all its values share one scale (an absmax block, an
 * AFFINE group or a GGUF block); value j of the chunk is then the function
 * below with j and that one scale. tests/test_qt_math.c walks every
 * tensor chunk by chunk through these and requires the reference's bits.
 */
#define QM_CHUNK_BYTES 16

/* bitsandbytes 4-bit codes: value j (0..31), the even one in the high nibble. */
QL_HD float qm_4bit_chunk_value(const uint8_t *chunk, int j, const float *codebook, float absmax)
{
    return qm_4bit_element(chunk, codebook, absmax, j);
}

/* AFFINE codes of one group: value j (0..31 for 4 bits, 0..15 for 8). The
 * chunk starts on an even column, so the nibble order is the row's. */
QL_HD float qm_affine_chunk_value(const uint8_t *chunk, int j, int32_t bits, int32_t qmin,
                                  bool float_zero, float mid, float scale, float zero)
{
    return qm_affine_value(qm_affine_code(chunk, bits, j), qmin, float_zero, mid, scale, zero);
}

/* GGUF split layout: value j (0..31) of a Q4_0 / Q4_1 block from its 16
 * qs bytes, value j (0..15) of half a Q8_0 block from 16 of its 32 qs. */
QL_HD float qm_q4_0_chunk_value(const uint8_t *qs, int j, float d)
{
    return qm_q4_0_value(qm_gguf_nibble(qs, j), d);
}

QL_HD float qm_q4_1_chunk_value(const uint8_t *qs, int j, float d, float m)
{
    return qm_q4_1_value(qm_gguf_nibble(qs, j), d, m);
}

QL_HD float qm_q8_0_chunk_value(const uint8_t *qs, int j, float d)
{
    return qm_q8_0_value((int8_t)qs[j], d);
}

/* Dense little-endian values: j in 0..7 for f16 and bf16, 0..3 for f32. */
QL_HD float qm_f16_chunk_value(const uint8_t *chunk, int j)
{
    return qm_f16_le(chunk + 2 * j);
}

QL_HD float qm_bf16_chunk_value(const uint8_t *chunk, int j)
{
    return qm_bf16_to_f32((uint16_t)(chunk[2 * j] | (chunk[2 * j + 1] << 8)));
}

QL_HD float qm_f32_chunk_value(const uint8_t *chunk, int j)
{
    const uint8_t *p = chunk + 4 * j;
    return qm_bits_f32((uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                       ((uint32_t)p[3] << 24));
}

/* Element e of a row-major GGUF tensor in the split layout: element e % 32
 * of block e / 32. m is Q4_1's. */
QL_HD float qm_q4_0_split_element(const uint8_t *qs, const uint16_t *d, int64_t e)
{
    int64_t b = e / QM_GGUF_QK;
    return qm_q4_0_chunk_value(qs + b * QM_Q4_QS_BYTES, (int)(e % QM_GGUF_QK), qm_f16_to_f32(d[b]));
}

QL_HD float qm_q4_1_split_element(const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                                  int64_t e)
{
    int64_t b = e / QM_GGUF_QK;
    return qm_q4_1_chunk_value(qs + b * QM_Q4_QS_BYTES, (int)(e % QM_GGUF_QK), qm_f16_to_f32(d[b]),
                               qm_f16_to_f32(m[b]));
}

QL_HD float qm_q8_0_split_element(const uint8_t *qs, const uint16_t *d, int64_t e)
{
    int64_t b = e / QM_GGUF_QK;
    return qm_q8_0_chunk_value(qs + b * QM_Q8_QS_BYTES, (int)(e % QM_GGUF_QK), qm_f16_to_f32(d[b]));
}

/* --- FP8 E4M3 with a block-scale grid (transformers' finegrained FP8) ----
 * An E4M3FN byte (OCP FP8: sign, 4 exponent bits biased by 7, 3 mantissa
 * bits, no infinities, S.1111.111 NaN) widened to f32 exactly, as torch's
 * .to(torch.float32); a UE8M0 scale byte (torch.float8_e8m0fnu: 2^(e - 127),
 * 0xFF NaN, 0x00 the f32 subnormal 2^-127) widened exactly too. The value
 * is one f32 multiply, code * scale, the order of transformers'
 * Fp8Dequantize._dequantize_one (q * s in float32). */
QL_HD float qm_e4m3_to_f32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xFu, man = b & 0x7u;
    if (exp == 0xFu && man == 0x7u) /* NaN, its mantissa kept as torch keeps it */
        return qm_bits_f32(sign | 0x7F800000u | (man << 20));
    if (exp == 0) {                          /* subnormal: man / 8 * 2^-6, exact in f32 */
        float v = (float)man * 0.001953125f; /* 2^-9 */
        return sign ? -v : v;
    }
    return qm_bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

QL_HD float qm_e8m0_to_f32(uint8_t e)
{
    if (e == 0xFFu)
        return qm_bits_f32(0x7FC00000u);
    return qm_bits_f32(e == 0 ? 0x00400000u : (uint32_t)e << 23);
}

/* Element (r, c) of an FP8 tensor: codes row-major, scales one per
 * block_rows x block_cols block over a grid of scale_cols columns, f32 or
 * UE8M0 bytes (e8m0). */
QL_HD float qm_fp8_element(const uint8_t *codes, const void *scales, bool e8m0, int64_t cols,
                           int32_t block_rows, int32_t block_cols, int64_t scale_cols, int64_t r,
                           int64_t c)
{
    int64_t s = (r / block_rows) * scale_cols + c / block_cols;
    float scale = e8m0 ? qm_e8m0_to_f32(((const uint8_t *)scales)[s]) : ((const float *)scales)[s];
    float q = qm_e4m3_to_f32(codes[r * cols + c]);
    return q * scale;
}

#endif

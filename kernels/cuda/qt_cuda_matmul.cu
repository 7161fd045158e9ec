/*
 * qt_cuda_matmul.cu - y = x @ W^T on the device for every kind of
 * qtensor.h: fused dequantize-and-multiply kernels for decode-sized
 * batches (1..8 rows of x: a warp per few rows of W; 9..32: the tile
 * kernel), and dequantize-to-scratch plus one cuBLASLt matmul for larger
 * ones (prefill). Contracts in qt_cuda_ops.h.
 *
 * Why shaped so:
 *   - Decode is memory bound: every weight byte is read once per step, so
 *     the fused kernel reads each byte once for all `batch` rows of x and
 *     never writes a dequantized weight. Each warp takes 4 (or 2)
 *     rows of W; each lane walks the rows' codes in 16-byte chunks (one
 *     uint4 load through the read-only path per row), 32 lanes side by
 *     side, so a warp reads 512 contiguous bytes of a row per step. A chunk
 *     holds 32 values of 4-bit codes, 16 of 8-bit, 8 of f16/bf16, 4 of f32,
 *     and all of them share one scale (absmax block, AFFINE group, GGUF
 *     block) when cols % 32 == 0, since bitsandbytes blocksizes are powers
 *     of two >= 32, GGUF blocks are 32, and AFFINE groups are required to
 *     be multiples of the chunk. The values are computed in registers by
 *     qt_math.h's chunk functions (the CPU tests pin them against the
 *     reference) and multiplied with x, read as float4 through L1 (x is at
 *     most 8 x cols floats and shared by every warp of the SM); the four
 *     rows of a warp reuse each x load, which quarters the L1 traffic that
 *     otherwise limits 4-bit kinds
 *     (2 rows per warp above batch 4, to keep the registers in bounds). Each lane keeps batch x 4
 * f32 partial sums (batch is a template parameter, so they are registers), the warp reduces them
 * with shuffles, and one lane writes each (b, row).
 *   - The GGUF kinds kept in whole ggml blocks (Q5_0, Q5_1, Q2_K ... Q6_K,
 *     IQ4_NL, IQ4_XS, MXFP4) take the piece kernel: the same warp shape, lanes across
 *     pieces of 32 values that share their scales, read a byte at a time
 *     (see matvec_piece_kernel). A first version, correct rather than
 *     shaped for bandwidth.
 *   - Anything else (cols not a multiple of 32, an AFFINE group that splits
 *     a chunk, x not 16-byte aligned) takes the generic kernel: a warp per
 *     row, a lane per column, qt_math.h's whole-element functions. Slower,
 *     always correct.
 *   - Decode steps of 9..32 rows (a batch of sequences) take the tile
 *     kernel (matvec_tile_kernel): still one read of each weight byte per
 *     step, decoded once into registers by the same chunk and piece
 *     functions and applied to all the step's rows, x staged in shared
 *     memory, B partial sums per lane. GPTQ/AWQ and the layouts the generic
 *     kernel takes run such a step in launches of 8 rows instead.
 *   - The cut-over to cuBLASLt is batch > 32 (QT_CUDA_MATVEC_MAX_BATCH), by
 *     arithmetic, to be confirmed by bench_cuda's batch 16, 32 and 64 rows:
 *     the tile kernel's cost grows with the batch (B fused multiply-adds
 *     per weight value on the CUDA cores: a 4096 x 4096 weight at B = 32 is
 *     1.07 GFLOP, ~16 us at an H100's 67 TFLOP/s of f32), the GEMM path's
 *     hardly does (it writes and reads back a dequantized copy, 4 or 2
 *     bytes a value against NF4's ~0.53: ~40 us in f32, ~20 us in bf16 at
 *     3.35 TB/s). At 32 the tile kernel still beats the default f32 GEMM
 *     and about ties the bf16 one; above, the GEMM wins more each row.
 *   - Prefill batches are compute bound: the weight is dequantized once
 *     into a scratch (f32, or bf16 for tensor cores) with qt_cuda.h's
 *     kernels and multiplied by cuBLASLt in f32 accumulation. The F32 mode
 *     asks for CUBLAS_COMPUTE_32F, never the TF32 fast mode, so it stays
 *     within f32 rounding of the CPU reference.
 *   - The kind's row (qt_cuda_kinds.c) picks the kernels: its matvec entry
 *     is this file's launch_matvec<K> for its decoding, its dequantize the
 *     GEMM's route to the scratch; weights_for reads the layout from it.
 *   - Everything is enqueued on the caller's stream; launch errors and
 *     cuBLASLt statuses are checked and named in msg.
 */
#include "qt_cuda_ops.h"

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "qt_cuda_blocks.h"
#include "qt_cuda_internal.h"
#include "qt_cuda_kinds.h"
#include "qt_cuda_quantfmt.h"
#include "qt_math.h"

/*
 * A weight as the matvec kernels read it: everything any kind needs, by
 * value as a __grid_constant__ kernel argument (about 1.2 KB, inside the
 * 4 KB every architecture allows). Fields that do not apply are zero.
 * Named outside the file's namespace because the table's matvec entries
 * (qt_cuda_kinds.h) take it.
 */
struct qt_cuda_mv_weights {
    int64_t rows, cols;
    const uint8_t *codes; /* dense values, 4-bit codes, AFFINE codes or GGUF qs */
    uint64_t row_bytes;   /* bytes of codes per row (fused kernel) */
    /* NF4, FP4 */
    const float *absmax;
    const uint8_t *absmax_codes;
    const float *nested_absmax;
    int32_t blocksize, nested_blocksize;
    float nested_offset;
    bool nested;
    /* AFFINE */
    const float *scales, *zeros;
    int32_t bits, group_size, qmin;
    int64_t groups_per_row;
    uint64_t row_stride;
    bool float_zero;
    float mid;
    /* GGUF */
    const uint16_t *d, *m;
    /* the checkpoint formats, read through qt_cuda_quantfmt.h */
    qt_cuda_fp8_view fp8;   /* FP8 */
    qt_cuda_gptq_view gptq; /* GPTQ, AWQ */
    /* NF4, FP4 tables, copied to shared memory by each block */
    float codebook[16];
    float nested_code[256];
};

namespace
{

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * 32;
/* Rows of W per warp: 4 share each x load; above 4 rows of x, 2, so that
 * batch x rows accumulators and the x registers stay under ~128 registers
 * (4 x 8 measured up to 255 on sm_90, halving occupancy). */
__host__ __device__ constexpr int rows_per_warp(int batch)
{
    return batch > 4 ? 2 : 4;
}
/* Rows of x the warp-per-rows kernels (fused, piece, GPTQ, generic) take
 * in one launch; a larger batch goes to the tile kernel, or (GPTQ, the
 * generic kernel) to launches of kPassBatch rows each. */
constexpr int kPassBatch = 8;
constexpr int kMaxBatch = QT_CUDA_MATVEC_MAX_BATCH;
/* cuBLASLt's workspace: enough for split-K and stream-K algorithms on
 * Hopper (NVIDIA recommends 32 MiB for sm_90). */
constexpr size_t kWorkspaceBytes = (size_t)32 << 20;

#ifdef __CUDA_ARCH__
#define QL_UNROLL _Pragma("unroll")
#else
#define QL_UNROLL
#endif

/* ---- cuBLASLt status codes (CUDA's are in qt_cuda_internal.h) ------------ */

int code_for_lt_status(cublasStatus_t st)
{
    switch (st) {
    case CUBLAS_STATUS_SUCCESS: return QL_OK;
    case CUBLAS_STATUS_ALLOC_FAILED: return QL_ENOMEM;
    case CUBLAS_STATUS_INVALID_VALUE: return QL_EINVAL;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_INITIALIZED: return QL_EUNSUPPORTED;
    default: return QL_EDEVICE;
    }
}

int lt_failed(cublasStatus_t st, char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* "<call> failed: status <n> (<name>: <sentence>)". */
int lt_failed(cublasStatus_t st, char *msg, size_t msg_len, const char *fmt, ...)
{
    char what[240];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    say(msg, msg_len, "%s failed: status %d (%s: %s)", what, (int)st, cublasLtGetStatusName(st),
        cublasLtGetStatusString(st));
    return code_for_lt_status(st);
}

/* ---- the weights as the kernels see them --------------------------------- */

/* Which decoding a kernel is compiled for. */
enum mv_kind {
    kF32,
    kF16,
    kBF16,
    k4bit,       /* NF4, FP4 with f32 absmax */
    k4bitNested, /* NF4, FP4 with double-quantized absmax */
    kAffine4,
    kAffine8,
    kQ4_0,
    kQ4_1,
    kQ8_0,
    kFP8,  /* 16 codes a chunk when block_cols % 16 == 0, one block scale */
    kGPTQ, /* GPTQ and AWQ: matvec_gptq_kernel, a thread per row */
    /* GGUF kinds kept in whole ggml blocks: the piece kernel */
    kQ5_0,
    kQ5_1,
    kQ4_K,
    kQ5_K,
    kQ6_K,
    kQ2_K,
    kQ3_K,
    kIQ4_NL,
    kIQ4_XS,
    kMXFP4,
};

/* The qtensor kind of a whole-block decoding. */
__host__ __device__ constexpr qt_kind whole_kind(mv_kind k)
{
    return k == kQ5_0     ? QT_Q5_0
           : k == kQ5_1   ? QT_Q5_1
           : k == kQ4_K   ? QT_Q4_K
           : k == kQ5_K   ? QT_Q5_K
           : k == kQ2_K   ? QT_Q2_K
           : k == kQ3_K   ? QT_Q3_K
           : k == kIQ4_NL ? QT_IQ4_NL
           : k == kIQ4_XS ? QT_IQ4_XS
           : k == kMXFP4  ? QT_MXFP4
                          : QT_Q6_K;
}

__host__ __device__ constexpr bool is_whole(mv_kind k)
{
    return k >= kQ5_0;
}

/* Values per 16-byte chunk. */
template <mv_kind K> struct chunk_traits {
    static constexpr int kElems = K == kF32                                    ? 4
                                  : (K == kF16 || K == kBF16)                  ? 8
                                  : (K == kAffine8 || K == kQ8_0 || K == kFP8) ? 16
                                                                               : 32;
};

using mv_weights = qt_cuda_mv_weights;

/* Read-only 16-byte load of a chunk into bytes (registers after SROA). */
__device__ __forceinline__ void load_chunk(uint8_t (&bytes)[16], const uint8_t *p)
{
    const uint4 q = __ldg(reinterpret_cast<const uint4 *>(p));
    memcpy(bytes, &q, sizeof bytes);
}

/* The one scale (and zero / min) of chunk k of row r. */
template <mv_kind K>
__device__ __forceinline__ void chunk_scale(const mv_weights &w, const float *nested_code,
                                            int64_t r, int64_t k, float &s0, float &s1)
{
    constexpr int E = chunk_traits<K>::kElems;
    s0 = 0.0f;
    s1 = 0.0f;
    if (K == k4bit || K == k4bitNested) {
        const int64_t b = (r * w.cols + k * E) / w.blocksize;
        s0 = K == k4bitNested ? qm_nested_absmax(w.absmax_codes, nested_code, w.nested_absmax,
                                                 w.nested_blocksize, w.nested_offset, b)
                              : __ldg(w.absmax + b);
    } else if (K == kAffine4 || K == kAffine8) {
        const int64_t g = r * w.groups_per_row + (k * E) / w.group_size;
        s0 = __ldg(w.scales + g);
        s1 = __ldg(w.zeros + g);
    } else if (K == kQ4_0 || K == kQ4_1) {
        const int64_t b = r * (w.cols / QM_GGUF_QK) + k;
        s0 = qm_f16_to_f32(__ldg(w.d + b));
        if (K == kQ4_1)
            s1 = qm_f16_to_f32(__ldg(w.m + b));
    } else if (K == kQ8_0) {
        const int64_t b = r * (w.cols / QM_GGUF_QK) + k / 2;
        s0 = qm_f16_to_f32(__ldg(w.d + b));
    } else if (K == kFP8) {
        const qt_cuda_fp8_view &v = w.fp8;
        const int64_t b = (r / v.block_rows) * v.scale_cols + (k * E) / v.block_cols;
        s0 = v.e8m0 ? qm_e8m0_to_f32(static_cast<const uint8_t *>(v.scales)[b])
                    : static_cast<const float *>(v.scales)[b];
    }
}

/* Value j of a chunk whose scale chunk_scale gave. */
template <mv_kind K>
__device__ __forceinline__ float chunk_value(const mv_weights &w, const float *codebook,
                                             const uint8_t (&bytes)[16], int j, float s0, float s1)
{
    if (K == kF32)
        return qm_f32_chunk_value(bytes, j);
    if (K == kF16)
        return qm_f16_chunk_value(bytes, j);
    if (K == kBF16)
        return qm_bf16_chunk_value(bytes, j);
    if (K == k4bit || K == k4bitNested)
        return qm_4bit_chunk_value(bytes, j, codebook, s0);
    if (K == kAffine4 || K == kAffine8)
        return qm_affine_chunk_value(bytes, j, K == kAffine4 ? 4 : 8, w.qmin, w.float_zero, w.mid,
                                     s0, s1);
    if (K == kQ4_0)
        return qm_q4_0_chunk_value(bytes, j, s0);
    if (K == kQ4_1)
        return qm_q4_1_chunk_value(bytes, j, s0, s1);
    if (K == kFP8) /* qm_fp8_element's one multiply */
        return qm_e4m3_to_f32(bytes[j]) * s0;
    return qm_q8_0_chunk_value(bytes, j, s0);
}

/* Element (r, c) for the generic kernel, through the whole-element
 * functions. */
template <mv_kind K>
__device__ __forceinline__ float element(const mv_weights &w, const float *codebook,
                                         const float *nested_code, int64_t r, int64_t c)
{
    const int64_t e = r * w.cols + c;
    if (K == kF32)
        return reinterpret_cast<const float *>(w.codes)[e];
    if (K == kF16)
        return qm_f16_to_f32(reinterpret_cast<const uint16_t *>(w.codes)[e]);
    if (K == kBF16)
        return qm_bf16_to_f32(reinterpret_cast<const uint16_t *>(w.codes)[e]);
    if (K == k4bit || K == k4bitNested) {
        const int64_t b = e / w.blocksize;
        const float absmax = K == k4bitNested
                                 ? qm_nested_absmax(w.absmax_codes, nested_code, w.nested_absmax,
                                                    w.nested_blocksize, w.nested_offset, b)
                                 : w.absmax[b];
        return qm_4bit_element(w.codes, codebook, absmax, e);
    }
    if (K == kAffine4 || K == kAffine8)
        return qm_affine_element(w.codes, w.row_stride, w.bits, w.qmin, w.float_zero, w.mid,
                                 w.group_size, w.groups_per_row, w.scales, w.zeros, r, c);
    if (K == kQ4_0)
        return qm_q4_0_split_element(w.codes, w.d, e);
    if (K == kQ4_1)
        return qm_q4_1_split_element(w.codes, w.d, w.m, e);
    if (K == kFP8)
        return qt_cuda_fp8_at(w.fp8, r, c);
    if (K == kGPTQ)
        return qt_cuda_gptq_at(w.gptq, r, c);
    if (is_whole(K))
        return qt_cuda_whole_element<whole_kind(K)>(w.codes, e);
    return qm_q8_0_split_element(w.codes, w.d, e);
}

/* The 4-bit tables into shared memory; every thread of the block must call
 * it (it synchronises). */
template <mv_kind K>
__device__ __forceinline__ void load_tables(const mv_weights &w, float *codebook,
                                            float *nested_code)
{
    if (K == k4bit || K == k4bitNested) {
        for (int i = threadIdx.x; i < 16; i += blockDim.x)
            codebook[i] = w.codebook[i];
        if (K == k4bitNested)
            for (int i = threadIdx.x; i < 256; i += blockDim.x)
                nested_code[i] = w.nested_code[i];
        __syncthreads();
    }
}

__device__ __forceinline__ float warp_sum(float v)
{
    QL_UNROLL
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/*
 * The fused kernel: a warp per rows_per_warp(B) rows, lanes across 16-byte
 * chunks. Requires cols % 32 == 0, codes and x 16-byte aligned, and (for
 * AFFINE) groups that are whole chunks; qt_cuda_matvec checks.
 */
template <mv_kind K, int B>
__global__ void __launch_bounds__(kThreads)
    matvec_fused_kernel(const __grid_constant__ mv_weights w, const float *__restrict__ x,
                        float *__restrict__ y)
{
    constexpr int E = chunk_traits<K>::kElems;
    constexpr int R = rows_per_warp(B);
    __shared__ float codebook[16];
    __shared__ float nested_code[K == k4bitNested ? 256 : 1];
    load_tables<K>(w, codebook, nested_code);

    const int lane = (int)(threadIdx.x & 31u);
    const int64_t row0 = ((int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5)) * R;
    if (row0 >= w.rows)
        return; /* whole warp: no shuffle below misses a lane */
    /* Rows past the end repeat the last one (read, never written), so the
     * loop below has no divergence. */
    int64_t row[R];
    QL_UNROLL
    for (int i = 0; i < R; i++)
        row[i] = row0 + i < w.rows ? row0 + i : w.rows - 1;

    const int64_t cols = w.cols;
    const int64_t n_chunks = cols / E;
    float acc[B][R];
    QL_UNROLL
    for (int b = 0; b < B; b++)
        QL_UNROLL
    for (int i = 0; i < R; i++)
        acc[b][i] = 0.0f;

    for (int64_t k = lane; k < n_chunks; k += 32) {
        uint8_t bytes[R][16];
        float s0[R], s1[R];
        QL_UNROLL
        for (int i = 0; i < R; i++) {
            load_chunk(bytes[i], w.codes + (uint64_t)row[i] * w.row_bytes + (uint64_t)k * 16u);
            chunk_scale<K>(w, nested_code, row[i], k, s0[i], s1[i]);
        }
        const float4 *xk = reinterpret_cast<const float4 *>(x + k * E);
        QL_UNROLL
        for (int g = 0; g < E / 4; g++) {
            float4 xv[B];
            QL_UNROLL
            for (int b = 0; b < B; b++)
                xv[b] = __ldg(xk + (b * cols) / 4 + g);
            QL_UNROLL
            for (int i = 0; i < R; i++) {
                const float w0 = chunk_value<K>(w, codebook, bytes[i], 4 * g + 0, s0[i], s1[i]);
                const float w1 = chunk_value<K>(w, codebook, bytes[i], 4 * g + 1, s0[i], s1[i]);
                const float w2 = chunk_value<K>(w, codebook, bytes[i], 4 * g + 2, s0[i], s1[i]);
                const float w3 = chunk_value<K>(w, codebook, bytes[i], 4 * g + 3, s0[i], s1[i]);
                QL_UNROLL
                for (int b = 0; b < B; b++) {
                    acc[b][i] += xv[b].x * w0;
                    acc[b][i] += xv[b].y * w1;
                    acc[b][i] += xv[b].z * w2;
                    acc[b][i] += xv[b].w * w3;
                }
            }
        }
    }

    QL_UNROLL
    for (int b = 0; b < B; b++)
        QL_UNROLL
    for (int i = 0; i < R; i++)
        acc[b][i] = warp_sum(acc[b][i]);
    /* Every lane holds every sum; lane b * R + i writes (b, row0 + i). */
    QL_UNROLL
    for (int b = 0; b < B; b++)
        QL_UNROLL
    for (int i = 0; i < R; i++)
        if (lane == b * R + i && row0 + i < w.rows)
            y[(int64_t)b * w.rows + row0 + i] = acc[b][i];
}

/*
 * The kinds kept in whole ggml blocks (Q5_0, Q5_1, the k-quants, IQ4_NL,
 * IQ4_XS) go by pieces of 32 values of one row that share their scales: a
 * Q5_0/Q5_1/IQ4_NL/MXFP4 block, a Q4_K/Q5_K sub-block (its d * sc and dmin * m)
 * or IQ4_XS sub-block (d * sc), two Q6_K/Q3_K sub-blocks of 16 (d * sc
 * each), two Q2_K sub-blocks of 16 (d * sc and dmin * m each). A piece's scales are computed once,
 * its values by the same qt_math.h functions, in the same operations, as the CPU's
 * qm_*_block_value, so every weight is the CPU's bit for bit.
 */
struct piece {
    const uint8_t *blk; /* the ggml block the piece lies in */
    int j0;             /* its first element within the block */
    float s0, s1;       /* Q5_0/Q5_1 d and m; Q4_K/Q5_K d1, m1; Q6_K/Q3_K both scales;
                           Q2_K d1, m1 of the first sub-block; IQ4_NL/IQ4_XS d;
                           MXFP4 2^(e - 128) */
    float s2, s3;       /* Q2_K d1, m1 of the second sub-block */
};

template <mv_kind K>
__device__ __forceinline__ piece piece_of(const mv_weights &w, int64_t r, int64_t k)
{
    using block = qt_cuda_block<whole_kind(K)>;
    const int64_t per_block = block::kElems / 32; /* pieces per block */
    piece p;
    p.blk =
        w.codes + (uint64_t)r * w.row_bytes + (uint64_t)(k / per_block) * (uint64_t)block::kBytes;
    p.j0 = (int)(k % per_block) * 32;
    p.s1 = 0.0f;
    p.s2 = 0.0f;
    p.s3 = 0.0f;
    if (K == kQ5_0 || K == kIQ4_NL) {
        p.s0 = qm_f16_le(p.blk);
    } else if (K == kQ5_1) {
        p.s0 = qm_f16_le(p.blk);
        p.s1 = qm_f16_le(p.blk + 2);
    } else if (K == kQ4_K || K == kQ5_K) {
        qm_k4_sub_scales(p.blk, p.j0 / 32, &p.s0, &p.s1);
    } else if (K == kQ2_K) {
        qm_q2_k_sub_scales(p.blk, p.j0 / 16, &p.s0, &p.s1);
        qm_q2_k_sub_scales(p.blk, p.j0 / 16 + 1, &p.s2, &p.s3);
    } else if (K == kQ3_K) {
        p.s0 = qm_q3_k_sub_scale(p.blk, p.j0 / 16);
        p.s1 = qm_q3_k_sub_scale(p.blk, p.j0 / 16 + 1);
    } else if (K == kIQ4_XS) {
        p.s0 = qm_iq4_xs_sub_scale(p.blk, p.j0 / 32);
    } else if (K == kMXFP4) {
        p.s0 = qm_e8m0_half(p.blk[0]);
    } else {
        p.s0 = qm_q6_k_sub_scale(p.blk, p.j0 / 16);
        p.s1 = qm_q6_k_sub_scale(p.blk, p.j0 / 16 + 1);
    }
    return p;
}

/* Value i (0..31) of a piece. */
template <mv_kind K> __device__ __forceinline__ float piece_value(const piece &p, int i)
{
    const int j = p.j0 + i;
    if (K == kQ5_0)
        return qm_q5_0_value(qm_q5_code(p.blk + 2, p.blk + 6, j), p.s0);
    if (K == kQ5_1)
        return qm_q5_1_value(qm_q5_code(p.blk + 4, p.blk + 8, j), p.s0, p.s1);
    if (K == kQ4_K)
        return qm_k4_value(qm_q4_k_code(p.blk, j), p.s0, p.s1);
    if (K == kQ5_K)
        return qm_k4_value(qm_q5_k_code(p.blk, j), p.s0, p.s1);
    if (K == kQ2_K)
        return i < 16 ? qm_k4_value(qm_q2_k_code(p.blk, j), p.s0, p.s1)
                      : qm_k4_value(qm_q2_k_code(p.blk, j), p.s2, p.s3);
    if (K == kQ3_K)
        return (i < 16 ? p.s0 : p.s1) * (float)qm_q3_k_code(p.blk, j);
    if (K == kIQ4_NL)
        return qm_iq4_value(qm_gguf_nibble(p.blk + 2, j), p.s0);
    if (K == kIQ4_XS)
        return qm_iq4_value(qm_iq4_xs_code(p.blk, j), p.s0);
    if (K == kMXFP4)
        return qm_mxfp4_value(qm_gguf_nibble(p.blk + 1, j), p.s0);
    return (i < 16 ? p.s0 : p.s1) * (float)qm_q6_k_code(p.blk, j);
}

/*
 * The piece kernel: the fused kernel's shape (a warp per rows_per_warp(B)
 * rows, batch B in registers, shuffle reduction) with lanes across pieces
 * of 32 values instead of 16-byte chunks. The blocks are read a byte at a
 * time (22, 24 and 210 bytes do not keep 16-byte alignment), x as floats,
 * so it needs only cols a multiple of the block.
 */
template <mv_kind K, int B>
__global__ void __launch_bounds__(kThreads)
    matvec_piece_kernel(const __grid_constant__ mv_weights w, const float *__restrict__ x,
                        float *__restrict__ y)
{
    constexpr int R = rows_per_warp(B);
    const int lane = (int)(threadIdx.x & 31u);
    const int64_t row0 = ((int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5)) * R;
    if (row0 >= w.rows)
        return; /* whole warp */
    int64_t row[R];
    QL_UNROLL
    for (int i = 0; i < R; i++)
        row[i] = row0 + i < w.rows ? row0 + i : w.rows - 1;

    const int64_t cols = w.cols;
    const int64_t n_pieces = cols / 32;
    float acc[B][R];
    QL_UNROLL
    for (int b = 0; b < B; b++)
        QL_UNROLL
    for (int i = 0; i < R; i++)
        acc[b][i] = 0.0f;

    for (int64_t k = lane; k < n_pieces; k += 32) {
        piece p[R];
        QL_UNROLL
        for (int i = 0; i < R; i++)
            p[i] = piece_of<K>(w, row[i], k);
        const float *xk = x + k * 32;
        for (int e = 0; e < 32; e++) {
            float xv[B];
            QL_UNROLL
            for (int b = 0; b < B; b++)
                xv[b] = __ldg(xk + b * cols + e);
            QL_UNROLL
            for (int i = 0; i < R; i++) {
                const float v = piece_value<K>(p[i], e);
                QL_UNROLL
                for (int b = 0; b < B; b++)
                    acc[b][i] += xv[b] * v;
            }
        }
    }

    QL_UNROLL
    for (int b = 0; b < B; b++)
        QL_UNROLL
    for (int i = 0; i < R; i++)
        acc[b][i] = warp_sum(acc[b][i]);
    QL_UNROLL
    for (int b = 0; b < B; b++)
        QL_UNROLL
    for (int i = 0; i < R; i++)
        if (lane == b * R + i && row0 + i < w.rows)
            y[(int64_t)b * w.rows + row0 + i] = acc[b][i];
}

/*
 * GPTQ and AWQ pack their codes across rows (a GPTQ word holds 32 / bits
 * input channels of one row, the words of consecutive rows side by side; an
 * AWQ word holds 8 consecutive rows), so here a thread takes one row, a
 * warp 32 consecutive rows (its words, scales and zeros are adjacent), and
 * the block's kGptqSlices warps split the input channels into that many
 * ranges of whole words, whose partial sums are added in slice order through
 * shared memory. A GPTQ word is read once for its 32 / bits channels and a
 * group's scale and zero once per run of channels in it; each weight is
 * qt_cuda_gptq_value's, the CPU's value.
 */
constexpr int kGptqSlices = 8;

template <int B>
__global__ void __launch_bounds__(32 * kGptqSlices)
    matvec_gptq_kernel(const __grid_constant__ mv_weights w, const float *__restrict__ x,
                       float *__restrict__ y)
{
    __shared__ float part[kGptqSlices][B][32];
    const int lane = (int)(threadIdx.x & 31u), slice = (int)(threadIdx.x >> 5);
    const int64_t r = (int64_t)blockIdx.x * 32 + lane;
    /* slices of whole words (32 / bits divides 8) */
    const int64_t cols = w.cols, span = (cols + 8 * kGptqSlices - 1) / (8 * kGptqSlices) * 8;
    const int64_t c0 = slice * span, c1 = c0 + span < cols ? c0 + span : cols;
    float acc[B];
    QL_UNROLL
    for (int b = 0; b < B; b++)
        acc[b] = 0.0f;
    const qt_cuda_gptq_view &g = w.gptq;
    const int bits = g.bits, per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    const int awq_shift = g.awq ? qt_cuda_out_dim_shift(g, r) : 0;
    int64_t group = -1; /* the group whose scale and zero s, z hold */
    float sc = 0.0f;
    int32_t z = 0;
    for (int64_t c = c0; r < w.rows && c < c1;) {
        /* one packed word: per channels of row r (GPTQ), or one (AWQ) */
        const uint32_t word = g.awq ? __ldg(g.qweight + c * (g.rows / 8) + r / 8)
                                    : __ldg(g.qweight + (c / per) * g.rows + r);
        const int n_codes = g.awq ? 1 : per;
        for (int k = 0; k < n_codes && c < c1; k++, c++) {
            const int64_t gc = __ldg(g.g_idx + c);
            if (gc != group) { /* act-order changes groups anywhere */
                qt_cuda_gptq_group(g, r, gc, &sc, &z);
                group = gc;
            }
            const uint32_t q = (word >> (g.awq ? awq_shift : k * bits)) & mask;
            const float v = qt_cuda_gptq_value(q, sc, z);
            QL_UNROLL
            for (int b = 0; b < B; b++)
                acc[b] += __ldg(x + b * cols + c) * v;
        }
    }
    QL_UNROLL
    for (int b = 0; b < B; b++)
        part[slice][b][lane] = acc[b];
    __syncthreads();
    if (slice == 0 && r < w.rows) {
        QL_UNROLL
        for (int b = 0; b < B; b++) {
            float sum = part[0][b][lane];
            for (int k = 1; k < kGptqSlices; k++)
                sum += part[k][b][lane];
            y[(int64_t)b * w.rows + r] = sum;
        }
    }
}

/*
 * The tile kernel, for decode steps of more than kPassBatch rows (9..32):
 * a product with a few dozen rows of x is still one weight read, but it
 * does B multiply-adds per weight value, so here the arithmetic and the
 * reads of x are what the shape must keep cheap, not the weight bytes.
 *
 *   - A block of kTileWarps warps owns 32 rows of W, one row per lane, for
 *     all B rows of x: each lane keeps B partial sums (registers) for its
 *     row, so each weight value, decoded once, feeds B multiply-adds.
 *   - x goes through shared memory, kTileCols columns of all B rows at a
 *     time, staged by the whole block with 16-byte loads (rows of x past
 *     `batch`, and columns past the end, staged as zeros). The warps split
 *     the staged columns by units (a 16-byte chunk of the fused kernel, or
 *     a piece of 32 values of the whole GGUF blocks): warp v takes units v,
 *     v + kTileWarps, ..., so at any moment the 32 lanes of a warp are at
 *     the same columns of 32 rows, and every read of x from shared memory
 *     is one address for the whole warp (a broadcast, no bank conflicts).
 *     A lane reads its row's unit and scales with the same functions as the
 *     fused and piece kernels (the CPU's values, bit for bit); the warps of
 *     a block together read each row's consecutive units.
 *   - The sums are multiply-adds with one rounding (fmaf; --fmad=false
 *     only stops nvcc from contracting a separate multiply and add), as
 *     B x 32 of them per 32 weight values cost more than the weight read.
 *   - At the end the warps' partial sums go through shared memory (the x
 *     tile's space) and are added in warp order, so a result does not
 *     depend on scheduling, and written 32 consecutive rows at a time.
 *
 * Sizes on sm_90 (H100): 256 threads a block; shared memory B x kTileCols
 * x 4 bytes (16, 24 or 32 KiB) plus the 4-bit tables (1 KiB), under the
 * 48 KiB of static shared memory; B is 16, 24 or 32 (tile_batch: the batch
 * rounded up, the rows past it staged as zeros and never written). ptxas
 * -v (CUDA 13.0, sm_90, the 63 instantiations): 64 to 170 registers (at
 * most 255 for 256 threads; 2 or 3 blocks an SM at <= 128), no spills.
 * ptxas moves the counts between builds on small changes (a version without
 * the early read of the first unit spilled 8 to 48 bytes in 4 of them), so
 * check again after editing; capping the registers at 128
 * (__launch_bounds__(256, 2)) spilled 8 to 144 bytes in 25 of them. The
 * 16-byte stack frame of the IQ4_NL, IQ4_XS and MXFP4 ones (and of their
 * piece kernels) is qt_math.h's 16-entry value table, indexed by a code.
 */
constexpr int kTileWarps = 8;
constexpr int kTileThreads = kTileWarps * 32;
constexpr int kTileRows = 32; /* one per lane */
constexpr int kTileCols = 256;
constexpr int kTileQuads = kTileCols / 4; /* float4s of one row of the x tile */

__host__ __device__ constexpr int tile_batch(int batch)
{
    return batch <= 16 ? 16 : batch <= 24 ? 24 : 32;
}

/* Values in one unit of kind K: a chunk of 16 bytes, or a piece of 32. */
template <mv_kind K> struct unit_traits {
    static constexpr int kElems = is_whole(K) ? 32 : chunk_traits<K>::kElems;
};

/* One unit of one row, loaded: its bytes and scales (a chunk), or its
 * block and scales (a piece); value(j) is its value j. */
template <mv_kind K, bool kWhole = is_whole(K)> struct tile_unit {
    uint8_t bytes[16];
    float s0, s1;
    __device__ __forceinline__ void load(const mv_weights &w, const float *nested_code, int64_t r,
                                         int64_t k)
    {
        load_chunk(bytes, w.codes + (uint64_t)r * w.row_bytes + (uint64_t)k * 16u);
        chunk_scale<K>(w, nested_code, r, k, s0, s1);
    }
    __device__ __forceinline__ float value(const mv_weights &w, const float *codebook, int j) const
    {
        return chunk_value<K>(w, codebook, bytes, j, s0, s1);
    }
};

template <mv_kind K> struct tile_unit<K, true> {
    piece p;
    __device__ __forceinline__ void load(const mv_weights &w, const float *, int64_t r, int64_t k)
    {
        p = piece_of<K>(w, r, k);
    }
    __device__ __forceinline__ float value(const mv_weights &, const float *, int j) const
    {
        return piece_value<K>(p, j);
    }
};

/* Requires what the fused kernel does (the piece kernel's for the whole
 * blocks) and x 16-byte aligned; 1 <= batch <= B. */
template <mv_kind K, int B>
__global__ void __launch_bounds__(kTileThreads)
    matvec_tile_kernel(const __grid_constant__ mv_weights w, const float *__restrict__ x, int batch,
                       float *__restrict__ y)
{
    constexpr int E = unit_traits<K>::kElems;
    constexpr int kUnitsPerTile = kTileCols / E;
    static_assert(kUnitsPerTile % kTileWarps == 0, "every warp takes as many units of a tile");
    __shared__ float codebook[16];
    __shared__ float nested_code[K == k4bitNested ? 256 : 1];
    /* the x tile [B][kTileQuads]; at the end the partial sums [warp][B][lane] */
    __shared__ float4 xs[B * kTileQuads];
    load_tables<K>(w, codebook, nested_code);

    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    const int64_t row0 = (int64_t)blockIdx.x * kTileRows;
    /* a lane past the last row repeats it (read, never written) */
    const int64_t row = row0 + lane < w.rows ? row0 + lane : w.rows - 1;
    const int64_t cols = w.cols, n_units = cols / E;
    float acc[B];
    QL_UNROLL
    for (int b = 0; b < B; b++)
        acc[b] = 0.0f;

    /* The staging: thread t moves float4 t % kTileQuads of rows t / kTileQuads
     * + j * kStageRows of the x tile, j < B / kStageRows. */
    constexpr int kStageRows = kTileThreads / kTileQuads;
    static_assert(B % kStageRows == 0, "the staging covers the x tile");
    const int stage_b = (int)threadIdx.x / kTileQuads, stage_q = (int)threadIdx.x % kTileQuads;
    const float *stage_x = x + (int64_t)stage_b * cols + 4 * stage_q;
    for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
        /* the warp's first unit of the tile, read before the barrier so that
         * its latency overlaps the staging's (all of the warp's units of the
         * tile for 4-bit codes and the whole blocks) */
        const int64_t k0 = c0 / E + warp;
        tile_unit<K> first{};
        if (k0 < n_units)
            first.load(w, nested_code, row, k0);
        const bool in_cols = c0 + 4 * stage_q < cols;
        QL_UNROLL
        for (int j = 0; j < B / kStageRows; j++) {
            const int b = stage_b + j * kStageRows;
            xs[b * kTileQuads + stage_q] = b < batch && in_cols
                                               ? __ldg(reinterpret_cast<const float4 *>(
                                                     stage_x + (int64_t)j * kStageRows * cols + c0))
                                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        __syncthreads();
        QL_UNROLL
        for (int t = 0; t < kUnitsPerTile / kTileWarps; t++) {
            const int u = warp + t * kTileWarps;
            const int64_t k = c0 / E + u;
            if (k >= n_units) /* the whole warp: the last tile's end */
                break;
            tile_unit<K> unit = first;
            if (t > 0)
                unit.load(w, nested_code, row, k);
            const float4 *xu = xs + u * (E / 4);
            QL_UNROLL
            for (int g = 0; g < E / 4; g++) {
                const float w0 = unit.value(w, codebook, 4 * g + 0);
                const float w1 = unit.value(w, codebook, 4 * g + 1);
                const float w2 = unit.value(w, codebook, 4 * g + 2);
                const float w3 = unit.value(w, codebook, 4 * g + 3);
                QL_UNROLL
                for (int b = 0; b < B; b++) {
                    const float4 xv = xu[b * kTileQuads + g];
                    acc[b] = fmaf(xv.x, w0, acc[b]);
                    acc[b] = fmaf(xv.y, w1, acc[b]);
                    acc[b] = fmaf(xv.z, w2, acc[b]);
                    acc[b] = fmaf(xv.w, w3, acc[b]);
                }
            }
        }
        __syncthreads();
    }

    float *part = reinterpret_cast<float *>(xs); /* B * kTileCols = kTileWarps * B * 32 floats */
    QL_UNROLL
    for (int b = 0; b < B; b++)
        part[(warp * B + b) * 32 + lane] = acc[b];
    __syncthreads();
    for (int o = (int)threadIdx.x; o < B * 32; o += kTileThreads) {
        const int b = o / 32, l = o % 32;
        float sum = part[b * 32 + l];
        for (int v = 1; v < kTileWarps; v++)
            sum += part[(v * B + b) * 32 + l];
        if (b < batch && row0 + l < w.rows)
            y[(int64_t)b * w.rows + row0 + l] = sum;
    }
}

/* The fused kernel of kind K, or the piece kernel for whole-block kinds. */
template <mv_kind K, int B>
void launch_fused(const mv_weights &w, const float *x, float *y, unsigned grid, cudaStream_t s)
{
    if constexpr (is_whole(K))
        matvec_piece_kernel<K, B><<<grid, kThreads, 0, s>>>(w, x, y);
    else
        matvec_fused_kernel<K, B><<<grid, kThreads, 0, s>>>(w, x, y);
}

/* The generic kernel: a warp per row, a lane per column, any shape. */
template <mv_kind K>
__global__ void __launch_bounds__(kThreads)
    matvec_generic_kernel(const __grid_constant__ mv_weights w, const float *__restrict__ x,
                          int batch, float *__restrict__ y)
{
    __shared__ float codebook[16];
    __shared__ float nested_code[K == k4bitNested ? 256 : 1];
    load_tables<K>(w, codebook, nested_code);

    const int lane = (int)(threadIdx.x & 31u);
    const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    if (r >= w.rows)
        return;
    float acc[kPassBatch];
    QL_UNROLL
    for (int b = 0; b < kPassBatch; b++)
        acc[b] = 0.0f;
    for (int64_t c = lane; c < w.cols; c += 32) {
        const float v = element<K>(w, codebook, nested_code, r, c);
        QL_UNROLL
        for (int b = 0; b < kPassBatch; b++)
            if (b < batch)
                acc[b] += x[(int64_t)b * w.cols + c] * v;
    }
    QL_UNROLL
    for (int b = 0; b < kPassBatch; b++) {
        const float s = warp_sum(acc[b]);
        if (lane == b && b < batch)
            y[(int64_t)b * w.rows + r] = s;
    }
}

/* One launch for batch <= kPassBatch rows: the generic kernel, or the
 * fused (piece, GPTQ) kernel compiled for the batch. */
template <mv_kind K>
void launch_pass(const mv_weights &w, bool fused, const float *x, int batch, float *y,
                 cudaStream_t s)
{
    if (!fused) {
        const unsigned grid = (unsigned)ceil_div(w.rows, kWarpsPerBlock);
        matvec_generic_kernel<K><<<grid, kThreads, 0, s>>>(w, x, batch, y);
    } else if constexpr (K == kGPTQ) {
        const unsigned grid = (unsigned)ceil_div(w.rows, 32);
        constexpr int T = 32 * kGptqSlices;
        switch (batch) {
        case 1: matvec_gptq_kernel<1><<<grid, T, 0, s>>>(w, x, y); break;
        case 2: matvec_gptq_kernel<2><<<grid, T, 0, s>>>(w, x, y); break;
        case 3: matvec_gptq_kernel<3><<<grid, T, 0, s>>>(w, x, y); break;
        case 4: matvec_gptq_kernel<4><<<grid, T, 0, s>>>(w, x, y); break;
        case 5: matvec_gptq_kernel<5><<<grid, T, 0, s>>>(w, x, y); break;
        case 6: matvec_gptq_kernel<6><<<grid, T, 0, s>>>(w, x, y); break;
        case 7: matvec_gptq_kernel<7><<<grid, T, 0, s>>>(w, x, y); break;
        default: matvec_gptq_kernel<8><<<grid, T, 0, s>>>(w, x, y); break;
        }
    } else {
        const unsigned grid = (unsigned)ceil_div(w.rows, kWarpsPerBlock * rows_per_warp(batch));
        switch (batch) {
        case 1: launch_fused<K, 1>(w, x, y, grid, s); break;
        case 2: launch_fused<K, 2>(w, x, y, grid, s); break;
        case 3: launch_fused<K, 3>(w, x, y, grid, s); break;
        case 4: launch_fused<K, 4>(w, x, y, grid, s); break;
        case 5: launch_fused<K, 5>(w, x, y, grid, s); break;
        case 6: launch_fused<K, 6>(w, x, y, grid, s); break;
        case 7: launch_fused<K, 7>(w, x, y, grid, s); break;
        default: launch_fused<K, 8>(w, x, y, grid, s); break;
        }
    }
}

/*
 * y = x @ W^T for 1..kMaxBatch rows of x: up to kPassBatch rows in one
 * launch; more through the tile kernel where the fused conditions hold,
 * else (GPTQ, the generic kernel) in launches of kPassBatch rows, each a
 * read of the weight, still less traffic than a dequantized copy.
 */
template <mv_kind K>
cudaError_t launch_matvec(const mv_weights &w, bool fused, const float *x, int batch, float *y,
                          cudaStream_t s)
{
    if (batch <= kPassBatch) {
        launch_pass<K>(w, fused, x, batch, y, s);
        return cudaGetLastError();
    }
    if constexpr (K != kGPTQ) {
        if (fused) {
            const unsigned grid = (unsigned)ceil_div(w.rows, kTileRows);
            switch (tile_batch(batch)) {
            case 16: matvec_tile_kernel<K, 16><<<grid, kTileThreads, 0, s>>>(w, x, batch, y); break;
            case 24: matvec_tile_kernel<K, 24><<<grid, kTileThreads, 0, s>>>(w, x, batch, y); break;
            default: matvec_tile_kernel<K, 32><<<grid, kTileThreads, 0, s>>>(w, x, batch, y); break;
            }
            return cudaGetLastError();
        }
    }
    for (int b0 = 0; b0 < batch; b0 += kPassBatch) {
        const int n = batch - b0 < kPassBatch ? batch - b0 : kPassBatch;
        launch_pass<K>(w, fused, x + (int64_t)b0 * w.cols, n, y + (int64_t)b0 * w.rows, s);
        const cudaError_t st = cudaGetLastError();
        if (st != cudaSuccess)
            return st;
    }
    return cudaSuccess;
}

/* The sentence when t's view does not describe its shape (row: t's kind). */
int view_mismatch(const qt_cuda_kind_ops &row, const qt_cuda_tensor &t, const char *where,
                  char *msg, size_t msg_len)
{
    switch (row.layout) {
    case QT_CUDA_LAYOUT_BNB4: {
        const qt_cuda_4bit_view &v = t.q4;
        say(msg, msg_len,
            "%s: %s view of %lld elements, blocksize %d, %lld blocks (nested %d, %lld) does "
            "not describe a %lld x %lld tensor",
            where, kind_name(t.kind), (long long)v.n_elements, (int)v.blocksize,
            (long long)v.n_blocks, (int)v.nested_blocksize, (long long)v.n_nested_blocks,
            (long long)t.rows, (long long)t.cols);
        break;
    }
    case QT_CUDA_LAYOUT_AFFINE: {
        const qt_cuda_affine_view &v = t.affine;
        say(msg, msg_len,
            "%s: affine view (%lld x %lld, int%d, range [%d, %d], group %d, %lld groups per "
            "row, row stride %llu) does not describe a %lld x %lld tensor",
            where, (long long)v.rows, (long long)v.cols, (int)v.bits, (int)v.qmin, (int)v.qmax,
            (int)v.group_size, (long long)v.groups_per_row, (unsigned long long)v.row_stride,
            (long long)t.rows, (long long)t.cols);
        break;
    }
    case QT_CUDA_LAYOUT_GGUF_SPLIT:
    case QT_CUDA_LAYOUT_GGUF_WHOLE: {
        const qt_cuda_gguf_view &v = t.gguf;
        char blocks[64] = ""; /* the piece kernel's condition, for whole blocks */
        if (row.layout == QT_CUDA_LAYOUT_GGUF_WHOLE)
            snprintf(blocks, sizeof blocks, " (columns in blocks of %lld)",
                     (long long)row.block_size);
        say(msg, msg_len,
            "%s: %s view of %lld elements in %lld blocks does not describe a %s %lld x %lld "
            "tensor%s",
            where, kind_name(v.kind), (long long)v.n_elements, (long long)v.n_blocks,
            kind_name(t.kind), (long long)t.rows, (long long)t.cols, blocks);
        break;
    }
    case QT_CUDA_LAYOUT_FP8: {
        const qt_cuda_fp8_view &v = t.fp8;
        say(msg, msg_len,
            "%s: fp8/ct_int view (%lld x %lld, blocks %d x %d, scale grid [%lld, %lld]) does not "
            "describe a %lld x %lld tensor",
            where, (long long)v.rows, (long long)v.cols, (int)v.block_rows, (int)v.block_cols,
            (long long)v.scale_rows, (long long)v.scale_cols, (long long)t.rows, (long long)t.cols);
        break;
    }
    case QT_CUDA_LAYOUT_GPTQ: {
        const qt_cuda_gptq_view &v = t.gptq;
        say(msg, msg_len,
            "%s: %s view (%lld x %lld, int%d, %lld groups) does not describe a %s %lld x %lld "
            "tensor",
            where, kind_name(v.kind), (long long)v.rows, (long long)v.cols, (int)v.bits,
            (long long)v.groups, kind_name(t.kind), (long long)t.rows, (long long)t.cols);
        break;
    }
    case QT_CUDA_LAYOUT_NONE:
    case QT_CUDA_LAYOUT_DENSE: break;
    }
    return QL_EINVAL;
}

/* The NF4/FP4 view of t into w; false when it does not describe t. */
bool fill_bnb4(const qt_cuda_tensor &t, mv_weights *w, const char **missing)
{
    const qt_cuda_4bit_view &v = t.q4;
    const int64_t n = t.rows * t.cols;
    if (v.n_elements != n || v.blocksize <= 0 || v.blocksize % 32 != 0 ||
        v.n_blocks < ceil_div(n, v.blocksize) ||
        (v.nested &&
         (v.nested_blocksize <= 0 || v.n_nested_blocks < ceil_div(v.n_blocks, v.nested_blocksize))))
        return false;
    w->codes = v.codes;
    w->row_bytes = (uint64_t)t.cols / 2u;
    w->absmax = v.absmax;
    w->absmax_codes = v.absmax_codes;
    w->nested_absmax = v.nested_absmax;
    w->blocksize = v.blocksize;
    w->nested_blocksize = v.nested_blocksize;
    w->nested_offset = v.nested_offset;
    w->nested = v.nested;
    memcpy(w->codebook, v.codebook, sizeof w->codebook);
    memcpy(w->nested_code, v.nested_code, sizeof w->nested_code);
    if (!v.codes || (v.nested ? !v.absmax_codes || !v.nested_absmax : !v.absmax))
        *missing = "codes or absmax";
    return true;
}

/* The AFFINE view of t into w; false when it does not describe t. */
bool fill_affine(const qt_cuda_tensor &t, mv_weights *w, const char **missing)
{
    const qt_cuda_affine_view &v = t.affine;
    const uint64_t need = v.bits == 8 ? (uint64_t)t.cols : (uint64_t)(t.cols + 1) / 2;
    if (v.rows != t.rows || v.cols != t.cols || (v.bits != 4 && v.bits != 8) || v.qmin >= v.qmax ||
        v.group_size <= 0 || t.cols % v.group_size != 0 ||
        v.groups_per_row != t.cols / v.group_size || v.row_stride < need)
        return false;
    w->codes = v.codes;
    w->row_bytes = v.row_stride;
    w->row_stride = v.row_stride;
    w->scales = v.scales;
    w->zeros = v.zeros;
    w->bits = v.bits;
    w->group_size = v.group_size;
    w->groups_per_row = v.groups_per_row;
    w->qmin = v.qmin;
    w->float_zero = v.float_zero;
    w->mid = qm_affine_mid(v.qmin, v.qmax);
    if (!v.codes || !v.scales || !v.zeros)
        *missing = "codes, scales or zeros";
    return true;
}

/* A GGUF view of t into w (row: t's kind); false when it does not
 * describe t. */
bool fill_gguf(const qt_cuda_kind_ops &row, const qt_cuda_tensor &t, mv_weights *w,
               const char **missing)
{
    const qt_cuda_gguf_view &v = t.gguf;
    const int64_t n = t.rows * t.cols, per = row.block_size;
    /* split blocks may run across rows (the generic kernel takes them);
     * the piece kernel needs whole blocks per row */
    const int64_t whole_of = row.layout == QT_CUDA_LAYOUT_GGUF_SPLIT ? n : t.cols;
    if (v.kind != t.kind || v.n_elements != n || whole_of % per != 0 || v.n_blocks != n / per)
        return false;
    w->codes = v.qs;
    if (row.layout == QT_CUDA_LAYOUT_GGUF_SPLIT) {
        w->row_bytes = (uint64_t)(t.cols / per) * (uint64_t)qm_gguf_qs_bytes((int)row.block_bytes);
        w->d = v.d;
        w->m = v.m;
        if (!v.qs || !v.d || (row.has_m && !v.m))
            *missing = "qs, d or m";
    } else {
        w->row_bytes = (uint64_t)(t.cols / per) * (uint64_t)row.block_bytes;
        if (!v.qs)
            *missing = "blocks";
    }
    return true;
}

/* The FP8 view of t into w; false when it does not describe t. */
bool fill_fp8(const qt_cuda_tensor &t, mv_weights *w, const char **missing)
{
    const qt_cuda_fp8_view &v = t.fp8;
    if (v.rows != t.rows || v.cols != t.cols || v.block_rows < 1 || v.block_cols < 1 ||
        v.scale_rows != ceil_div(t.rows, v.block_rows) ||
        v.scale_cols != ceil_div(t.cols, v.block_cols))
        return false;
    w->fp8 = v;
    w->codes = v.codes;
    w->row_bytes = v.ct_int ? (uint64_t)v.row_stride : (uint64_t)t.cols;
    if (!v.codes || !v.scales)
        *missing = "codes or block scales";
    return true;
}

/* The GPTQ/AWQ view of t into w; false when it does not describe t. */
bool fill_gptq(const qt_cuda_tensor &t, mv_weights *w, const char **missing)
{
    const qt_cuda_gptq_view &v = t.gptq;
    const int per = v.bits == 4 || v.bits == 8 ? 32 / v.bits : 0;
    if (v.kind != t.kind || v.rows != t.rows || v.cols != t.cols || per == 0 ||
        (v.awq && v.bits != 4) || t.rows % per != 0 || t.cols % per != 0 || v.groups < 1)
        return false;
    w->gptq = v;
    if (!v.qweight || !v.qzeros || !v.scales || !v.g_idx)
        *missing = "qweight, qzeros, scales or g_idx";
    return true;
}

/*
 * Check w's layout and fill the kernels' view of it (row: t's kind, NULL
 * for none): *fusable whether the weight side of the fused kernel's
 * conditions holds (cols % 32 == 0, 16-byte aligned codes, AFFINE groups of
 * whole chunks; the piece kernel of the whole GGUF blocks needs only
 * columns). `where` names the caller in messages.
 */
int weights_for(const qt_cuda_kind_ops *row, const qt_cuda_tensor &t, const char *where,
                mv_weights *w, bool *fusable, char *msg, size_t msg_len)
{
    memset(w, 0, sizeof *w);
    w->rows = t.rows;
    w->cols = t.cols;
    const int64_t n = t.rows * t.cols;
    const char *missing = nullptr;
    bool described = true;
    switch (row ? row->layout : QT_CUDA_LAYOUT_NONE) {
    case QT_CUDA_LAYOUT_NONE:
        say(msg, msg_len, "%s: kind %d is not a kind the CUDA matrix kernels know", where,
            (int)t.kind);
        return QL_EUNSUPPORTED;
    case QT_CUDA_LAYOUT_DENSE:
        w->codes = static_cast<const uint8_t *>(t.dense);
        w->row_bytes = (uint64_t)t.cols * (uint64_t)row->block_bytes;
        if (!t.dense)
            missing = "dense values";
        break;
    case QT_CUDA_LAYOUT_BNB4: described = fill_bnb4(t, w, &missing); break;
    case QT_CUDA_LAYOUT_AFFINE: described = fill_affine(t, w, &missing); break;
    case QT_CUDA_LAYOUT_GGUF_SPLIT:
    case QT_CUDA_LAYOUT_GGUF_WHOLE: described = fill_gguf(*row, t, w, &missing); break;
    case QT_CUDA_LAYOUT_FP8: described = fill_fp8(t, w, &missing); break;
    case QT_CUDA_LAYOUT_GPTQ: described = fill_gptq(t, w, &missing); break;
    }
    if (!described)
        return view_mismatch(*row, t, where, msg, msg_len);
    if (missing && n > 0) {
        say(msg, msg_len, "%s: the %s tensor %lld x %lld has no %s on the device", where,
            kind_name(t.kind), (long long)t.rows, (long long)t.cols, missing);
        return QL_EINVAL;
    }
    *fusable = t.cols % 32 == 0 && t.cols > 0 && aligned(w->codes, 16) && w->row_bytes % 16 == 0;
    if (row->layout == QT_CUDA_LAYOUT_GGUF_WHOLE)
        *fusable = t.cols > 0; /* the piece kernel reads bytes and floats */
    if (row->layout == QT_CUDA_LAYOUT_AFFINE) {
        const int per_chunk = w->bits == 8 ? 16 : 32;
        *fusable = *fusable && w->group_size % per_chunk == 0;
    }
    if (row->layout == QT_CUDA_LAYOUT_FP8) /* a chunk of 16 codes under one block scale */
        *fusable = *fusable && w->fp8.block_cols % 16 == 0 && !w->fp8.ct_int &&
                   (w->fp8.scale_dtype == QT_SCALE_F32 || w->fp8.scale_dtype == QT_SCALE_E8M0);
    if (row->layout == QT_CUDA_LAYOUT_GPTQ) /* matvec_gptq_kernel: any shape */
        *fusable = t.cols > 0;
    return QL_OK;
}

/* ---- conversions for the cuBLASLt path ----------------------------------- */

__device__ __forceinline__ void put(float *out, int64_t i, float v)
{
    out[i] = v;
}

__device__ __forceinline__ void put(uint16_t *out, int64_t i, float v)
{
    out[i] = qm_f32_to_bf16(v);
}

/* out[i] = in[i] converted: f32, f16 or bf16 in (as qt_math.h reads
 * them), f32 or bf16 (round to nearest even) out. */
template <qt_kind kIn, typename OutT>
__global__ void __launch_bounds__(256)
    convert_kernel(const void *__restrict__ in, OutT *__restrict__ out, int64_t n)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        if (kIn == QT_F32)
            v = static_cast<const float *>(in)[i];
        else if (kIn == QT_F16)
            v = qm_f16_to_f32(static_cast<const uint16_t *>(in)[i]);
        else
            v = qm_bf16_to_f32(static_cast<const uint16_t *>(in)[i]);
        put(out, i, v);
    }
}

template <qt_kind kIn, typename OutT>
cudaError_t launch_convert(const void *in, OutT *out, int64_t n, cudaStream_t s)
{
    convert_kernel<kIn, OutT><<<grid_for(n, 256), 256, 0, s>>>(in, out, n);
    return cudaGetLastError();
}

/* A dense kind's dequantize operation (its row's): its values converted to
 * f32 or bf16, the cuBLASLt operand and the merge's W. */
template <qt_kind kIn>
int dequantize_dense(const qt_cuda_tensor *t, void *out, qt_cuda_out_dtype out_dtype, void *stream,
                     char *msg, size_t msg_len)
{
    const bool bf16 = out_dtype == QT_CUDA_OUT_BF16;
    const int64_t n = t->rows * t->cols;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t st = bf16 ? launch_convert<kIn>(t->dense, static_cast<uint16_t *>(out), n, s)
                          : launch_convert<kIn>(t->dense, static_cast<float *>(out), n, s);
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "launching the %s to %s weight conversion",
                           kind_name(t->kind), bf16 ? "bf16" : "f32");
    return QL_OK;
}

/* The NF4/FP4 and AFFINE matvecs: the decoding their view asks for. */
cudaError_t launch_matvec_bnb4(const mv_weights &w, bool fused, const float *x, int batch, float *y,
                               cudaStream_t s)
{
    return w.nested ? launch_matvec<k4bitNested>(w, fused, x, batch, y, s)
                    : launch_matvec<k4bit>(w, fused, x, batch, y, s);
}

cudaError_t launch_matvec_affine(const mv_weights &w, bool fused, const float *x, int batch,
                                 float *y, cudaStream_t s)
{
    return w.bits == 8 ? launch_matvec<kAffine8>(w, fused, x, batch, y, s)
                       : launch_matvec<kAffine4>(w, fused, x, batch, y, s);
}

/* ---- cuBLASLt plans ------------------------------------------------------ */

/* The largest power of two (up to 256) that divides the address: what the
 * heuristic must be told, since it assumes 256-byte alignment by default. */
uint32_t alignment_of(const void *p)
{
    uint32_t a = 256;
    while (a > 1 && ((uintptr_t)p & (a - 1)) != 0)
        a >>= 1;
    return a;
}

/* One matmul shape with its descriptors and the heuristic's algorithm. */
struct lt_plan {
    bool used;
    int64_t m, n, k;
    uint32_t align_a, align_b, align_c;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};

constexpr int kPlanCache = 16;

void destroy_plan(lt_plan *p)
{
    if (p->op)
        cublasLtMatmulDescDestroy(p->op);
    if (p->a)
        cublasLtMatrixLayoutDestroy(p->a);
    if (p->b)
        cublasLtMatrixLayoutDestroy(p->b);
    if (p->c)
        cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

} // namespace

struct qt_cuda_blas {
    cublasLtHandle_t lt;
    qt_cuda_gemm_type type;
    int64_t max_weight_elements, max_rows, max_cols;
    void *workspace;
    void *w_scratch; /* max_weight_elements of f32 (F32 mode) or bf16 */
    void *x_scratch; /* BF16 mode: max_rows * max_cols bf16 */
    lt_plan plans[kPlanCache];
    int next_plan;
};

namespace
{

/*
 * The plan for y[batch][rows] = x[batch][cols] @ W^T, built on first use.
 *
 * cuBLASLt is column-major. A row-major matrix M[r][c] is, read
 * column-major, the c x r matrix M^T with leading dimension c. So the
 * row-major W[rows][cols] is the column-major cols x rows matrix W^T
 * (ld = cols), x[batch][cols] is x^T (cols x batch, ld = cols), and
 * y[batch][rows] is y^T (rows x batch, ld = rows). We want y = x W^T, i.e.
 * y^T = W x^T: D (m = rows, n = batch) = op(A) B with A the stored W^T
 * (cols x rows) and op = transpose, giving W (rows x cols), and B the stored
 * x^T (cols x batch) untransposed; k = cols. This "TN" form is the one
 * cuBLASLt's tensor-core kernels prefer.
 */
int get_plan(qt_cuda_blas *bl, int64_t m, int64_t n, int64_t k, const void *a_ptr,
             const void *b_ptr, const void *c_ptr, lt_plan **out, char *msg, size_t msg_len)
{
    const uint32_t aa = alignment_of(a_ptr), ab = alignment_of(b_ptr), ac = alignment_of(c_ptr);
    for (int i = 0; i < kPlanCache; i++) {
        lt_plan *p = &bl->plans[i];
        if (p->used && p->m == m && p->n == n && p->k == k && p->align_a == aa &&
            p->align_b == ab && p->align_c == ac) {
            *out = p;
            return QL_OK;
        }
    }
    lt_plan *p = &bl->plans[bl->next_plan];
    bl->next_plan = (bl->next_plan + 1) % kPlanCache;
    destroy_plan(p);

    const cudaDataType ab_type = bl->type == QT_CUDA_GEMM_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    cublasStatus_t st = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (st != CUBLAS_STATUS_SUCCESS) {
        p->op = nullptr;
        return lt_failed(st, msg, msg_len, "cublasLtMatmulDescCreate");
    }
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                        sizeof trans_a);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                            sizeof trans_b);
    if (st != CUBLAS_STATUS_SUCCESS) {
        int rc = lt_failed(st, msg, msg_len, "cublasLtMatmulDescSetAttribute(TRANSA/TRANSB)");
        destroy_plan(p);
        return rc;
    }
    st = cublasLtMatrixLayoutCreate(&p->a, ab_type, (uint64_t)k, (uint64_t)m, k);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&p->b, ab_type, (uint64_t)k, (uint64_t)n, k);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, (uint64_t)m, (uint64_t)n, m);
    if (st != CUBLAS_STATUS_SUCCESS) {
        int rc = lt_failed(st, msg, msg_len, "cublasLtMatrixLayoutCreate(m %lld, n %lld, k %lld)",
                           (long long)m, (long long)n, (long long)k);
        destroy_plan(p);
        return rc;
    }

    cublasLtMatmulPreference_t pref = nullptr;
    st = cublasLtMatmulPreferenceCreate(&pref);
    if (st != CUBLAS_STATUS_SUCCESS) {
        int rc = lt_failed(st, msg, msg_len, "cublasLtMatmulPreferenceCreate");
        destroy_plan(p);
        return rc;
    }
    const uint64_t ws = kWorkspaceBytes;
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                              sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                  &aa, sizeof aa);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                  &ab, sizeof ab);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                  &ac, sizeof ac);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                  &ac, sizeof ac);
    if (st != CUBLAS_STATUS_SUCCESS) {
        int rc = lt_failed(st, msg, msg_len, "cublasLtMatmulPreferenceSetAttribute");
        cublasLtMatmulPreferenceDestroy(pref);
        destroy_plan(p);
        return rc;
    }
    cublasLtMatmulHeuristicResult_t result;
    memset(&result, 0, sizeof result);
    int found = 0;
    st = cublasLtMatmulAlgoGetHeuristic(bl->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &result,
                                        &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) {
        int rc = lt_failed(st, msg, msg_len,
                           "cublasLtMatmulAlgoGetHeuristic(%s, m %lld, n %lld, k %lld)",
                           bl->type == QT_CUDA_GEMM_BF16 ? "bf16" : "f32", (long long)m,
                           (long long)n, (long long)k);
        destroy_plan(p);
        return rc;
    }
    if (found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
        say(msg, msg_len,
            "cublasLtMatmulAlgoGetHeuristic found no algorithm for a %s matmul m %lld, n %lld, "
            "k %lld (alignments A %u, B %u, C %u bytes; state %d)",
            bl->type == QT_CUDA_GEMM_BF16 ? "bf16" : "f32", (long long)m, (long long)n,
            (long long)k, aa, ab, ac, (int)result.state);
        destroy_plan(p);
        return QL_EUNSUPPORTED;
    }
    p->algo = result.algo;
    p->used = true;
    p->m = m;
    p->n = n;
    p->k = k;
    p->align_a = aa;
    p->align_b = ab;
    p->align_c = ac;
    *out = p;
    return QL_OK;
}

/* bytes = count * size, or false when it overflows. */
bool checked_bytes(int64_t count, size_t size, size_t *bytes)
{
    if (count < 0 || (count > 0 && (uint64_t)count > SIZE_MAX / size))
        return false;
    *bytes = (size_t)count * size;
    return true;
}

} // namespace

/* ---- the rows' operations (qt_cuda_kinds.c) ------------------------------ */

#define DENSE_DEQUANTIZE(k, KIND)                                                                  \
    extern "C" int qt_cuda_dequantize_as_##k(const qt_cuda_kind_ops *, const qt_cuda_tensor *t,    \
                                             void *out, qt_cuda_out_dtype out_dtype, void *stream, \
                                             char *msg, size_t msg_len)                            \
    {                                                                                              \
        return dequantize_dense<KIND>(t, out, out_dtype, stream, msg, msg_len);                    \
    }
DENSE_DEQUANTIZE(f32, QT_F32)
DENSE_DEQUANTIZE(f16, QT_F16)
DENSE_DEQUANTIZE(bf16, QT_BF16)
#undef DENSE_DEQUANTIZE

#define MATVEC(k, LAUNCH)                                                                          \
    extern "C" int qt_cuda_matvec_as_##k(const qt_cuda_mv_weights *w, bool fused, const float *x,  \
                                         int batch, float *y, void *stream)                        \
    {                                                                                              \
        return LAUNCH(*w, fused, x, batch, y, static_cast<cudaStream_t>(stream));                  \
    }
MATVEC(f32, launch_matvec<kF32>)
MATVEC(f16, launch_matvec<kF16>)
MATVEC(bf16, launch_matvec<kBF16>)
MATVEC(bnb4, launch_matvec_bnb4)
MATVEC(affine, launch_matvec_affine)
MATVEC(fp8, launch_matvec<kFP8>)
MATVEC(gptq, launch_matvec<kGPTQ>)
#define GGUF_MATVEC(name, NAME, whole) MATVEC(name, launch_matvec<k##NAME>)
QT_CUDA_GGUF_KINDS(GGUF_MATVEC)
#undef GGUF_MATVEC
#undef MATVEC

/* ---- the entry points' implementations ------------------------------------ */

extern "C" int qt_cuda_matvec_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *w,
                                   const float *x, int64_t batch, float *y, void *stream, char *msg,
                                   size_t msg_len)
{
    static const char where[] = "qt_cuda_matvec";
    if (!w) {
        say(msg, msg_len, "%s: the weight is NULL", where);
        return QL_EINVAL;
    }
    if (batch < 0 || batch > kMaxBatch) {
        say(msg, msg_len, "%s: batch %lld is outside [0, %d]", where, (long long)batch, kMaxBatch);
        return QL_EINVAL;
    }
    if (w->rows < 0 || w->cols < 0 || (w->rows > 0 && w->cols > INT64_MAX / w->rows)) {
        say(msg, msg_len, "%s: shape %lld x %lld is not valid", where, (long long)w->rows,
            (long long)w->cols);
        return QL_EINVAL;
    }
    if (batch == 0 || w->rows == 0)
        return QL_OK;
    if (!x || !y) {
        say(msg, msg_len, "%s: a NULL device pointer (x %p, y %p)", where, (const void *)x,
            (void *)y);
        return QL_EINVAL;
    }
    mv_weights mw;
    bool fusable = false;
    int rc = weights_for(row, *w, where, &mw, &fusable, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const bool fused = fusable && aligned(x, 16);
    (void)cudaGetLastError(); /* the launch is checked with cudaGetLastError */
    const cudaError_t st =
        static_cast<cudaError_t>(row->matvec(&mw, fused, x, (int)batch, y, stream));
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "launching the %s %s matvec (%lld x %lld, batch %lld)",
                           fused ? "fused" : "generic", kind_name(w->kind), (long long)w->rows,
                           (long long)w->cols, (long long)batch);
    return QL_OK;
}

extern "C" void qt_cuda_blas_free(qt_cuda_blas *b)
{
    if (!b)
        return;
    for (int i = 0; i < kPlanCache; i++)
        destroy_plan(&b->plans[i]);
    if (b->workspace)
        cudaFree(b->workspace);
    if (b->w_scratch)
        cudaFree(b->w_scratch);
    if (b->x_scratch)
        cudaFree(b->x_scratch);
    if (b->lt)
        cublasLtDestroy(b->lt);
    (void)cudaGetLastError(); /* a failed free has nowhere to be reported */
    free(b);
}

extern "C" int qt_cuda_blas_new(qt_cuda_blas **out, int64_t max_weight_elements, int64_t max_rows,
                                int64_t max_cols, qt_cuda_gemm_type type, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_blas_new";
    if (!out) {
        say(msg, msg_len, "%s: out is NULL", where);
        return QL_EINVAL;
    }
    *out = nullptr;
    if (type != QT_CUDA_GEMM_F32 && type != QT_CUDA_GEMM_BF16) {
        say(msg, msg_len, "%s: gemm type %d is neither f32 nor bf16", where, (int)type);
        return QL_EINVAL;
    }
    if (max_weight_elements < 0 || max_rows < 0 || max_cols < 0) {
        say(msg, msg_len, "%s: negative limits (weight %lld, rows %lld, cols %lld)", where,
            (long long)max_weight_elements, (long long)max_rows, (long long)max_cols);
        return QL_EINVAL;
    }
    const size_t w_size = type == QT_CUDA_GEMM_BF16 ? 2 : 4;
    const char *type_name = type == QT_CUDA_GEMM_BF16 ? "bf16" : "f32";
    size_t w_bytes = 0, x_bytes = 0;
    const bool x_fits = max_rows == 0 || max_cols <= INT64_MAX / max_rows;
    if (!checked_bytes(max_weight_elements, w_size, &w_bytes) || !x_fits ||
        !checked_bytes(type == QT_CUDA_GEMM_BF16 ? max_rows * max_cols : 0, 2, &x_bytes)) {
        say(msg, msg_len,
            "%s: not enough device memory: a %s scratch for %lld weight elements and %lld x %lld "
            "activations does not fit in an address space",
            where, type_name, (long long)max_weight_elements, (long long)max_rows,
            (long long)max_cols);
        return QL_ENOMEM;
    }

    qt_cuda_blas *b = static_cast<qt_cuda_blas *>(calloc(1, sizeof *b));
    if (!b) {
        say(msg, msg_len, "%s: cannot allocate %zu host bytes", where, sizeof *b);
        return QL_ENOMEM;
    }
    b->type = type;
    b->max_weight_elements = max_weight_elements;
    b->max_rows = max_rows;
    b->max_cols = max_cols;
    int rc = QL_OK;
    cublasStatus_t lst = cublasLtCreate(&b->lt);
    if (lst != CUBLAS_STATUS_SUCCESS) {
        b->lt = nullptr;
        rc = lt_failed(lst, msg, msg_len, "cublasLtCreate");
    }
    /* Each allocation names what it was for and how big, so an operator
     * sees which limit to lower. */
    struct {
        void **p;
        size_t bytes;
        const char *what;
    } allocs[3] = {
        {&b->workspace, kWorkspaceBytes, "cuBLASLt workspace"},
        {&b->w_scratch, w_bytes, "dequantized weight scratch"},
        {&b->x_scratch, x_bytes, "bf16 activation scratch"},
    };
    for (int i = 0; i < 3 && rc == QL_OK; i++) {
        if (allocs[i].bytes == 0)
            continue;
        cudaError_t st = cudaMalloc(allocs[i].p, allocs[i].bytes);
        if (st != cudaSuccess) {
            *allocs[i].p = nullptr;
            char inner[200];
            cuda_failed(st, inner, sizeof inner, "cudaMalloc(%zu bytes)", allocs[i].bytes);
            rc = code_for_cuda_status(st);
            say(msg, msg_len,
                "%s: %s the %s %s of %zu bytes (%lld weight elements, %lld x %lld activations): "
                "%s",
                where, rc == QL_ENOMEM ? "not enough device memory for" : "cannot allocate",
                type_name, allocs[i].what, allocs[i].bytes, (long long)max_weight_elements,
                (long long)max_rows, (long long)max_cols, inner);
        }
    }
    if (rc != QL_OK) {
        qt_cuda_blas_free(b);
        return rc;
    }
    *out = b;
    return QL_OK;
}

extern "C" int qt_cuda_gemm_with(const qt_cuda_kind_ops *row, qt_cuda_blas *b,
                                 const qt_cuda_tensor *w, const float *x, int64_t batch, float *y,
                                 void *stream, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_gemm";
    if (!b || !w) {
        say(msg, msg_len, "%s: %s is NULL", where, !b ? "the blas state" : "the weight");
        return QL_EINVAL;
    }
    if ((unsigned)w->kind >= QT_KIND_COUNT || w->rows < 0 || w->cols < 0 ||
        (w->rows > 0 && w->cols > INT64_MAX / w->rows) || batch < 0) {
        say(msg, msg_len, "%s: kind %d, shape %lld x %lld, batch %lld is not valid", where,
            (int)w->kind, (long long)w->rows, (long long)w->cols, (long long)batch);
        return QL_EINVAL;
    }
    if (batch == 0 || w->rows == 0)
        return QL_OK;
    if (!x || !y) {
        say(msg, msg_len, "%s: a NULL device pointer (x %p, y %p)", where, (const void *)x,
            (void *)y);
        return QL_EINVAL;
    }
    const bool bf16 = b->type == QT_CUDA_GEMM_BF16;
    const int64_t n_w = w->rows * w->cols;
    /* The weight goes through the scratch unless it already is what the
     * matmul reads. */
    const bool weight_as_is = w->kind == (bf16 ? QT_BF16 : QT_F32);
    if (batch > b->max_rows || w->cols > b->max_cols ||
        (!weight_as_is && n_w > b->max_weight_elements)) {
        say(msg, msg_len,
            "%s: a %s %lld x %lld weight with batch %lld exceeds the limits given at "
            "qt_cuda_blas_new (%lld weight elements, %lld x %lld activations)",
            where, kind_name(w->kind), (long long)w->rows, (long long)w->cols, (long long)batch,
            (long long)b->max_weight_elements, (long long)b->max_rows, (long long)b->max_cols);
        return QL_EINVAL;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (w->cols == 0) {
        /* An empty sum: y = 0 (cuBLASLt refuses k = 0). */
        cudaError_t st = cudaMemsetAsync(y, 0, (size_t)(batch * w->rows) * sizeof(float), s);
        if (st != cudaSuccess)
            return cuda_failed(st, msg, msg_len, "cudaMemsetAsync(y, %lld floats)",
                               (long long)(batch * w->rows));
        return QL_OK;
    }

    /* The weight, as the matmul's A. */
    mv_weights mw;
    bool fusable = false;
    int rc = weights_for(row, *w, where, &mw, &fusable, msg, msg_len); /* checks the view */
    if (rc != QL_OK)
        return rc;
    /* The kind's route to cuBLASLt: the weight as it is, or its row's
     * dequantize into the scratch. */
    const qt_cuda_out_dtype out_dtype = bf16 ? QT_CUDA_OUT_BF16 : QT_CUDA_OUT_F32;
    const void *a_ptr = weight_as_is ? w->dense : b->w_scratch;
    (void)cudaGetLastError(); /* launches are checked with cudaGetLastError */
    if (!weight_as_is)
        rc = row->dequantize(row, w, b->w_scratch, out_dtype, stream, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    /* The activations, as B. */
    const void *b_ptr = x;
    if (bf16) {
        cudaError_t st =
            launch_convert<QT_F32>(x, static_cast<uint16_t *>(b->x_scratch), batch * w->cols, s);
        if (st != cudaSuccess)
            return cuda_failed(st, msg, msg_len, "launching the f32 to bf16 conversion of x");
        b_ptr = b->x_scratch;
    }

    lt_plan *plan = nullptr;
    rc = get_plan(b, w->rows, batch, w->cols, a_ptr, b_ptr, y, &plan, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t st =
        cublasLtMatmul(b->lt, plan->op, &alpha, a_ptr, plan->a, b_ptr, plan->b, &beta, y, plan->c,
                       y, plan->c, &plan->algo, b->workspace, kWorkspaceBytes, s);
    if (st != CUBLAS_STATUS_SUCCESS)
        return lt_failed(st, msg, msg_len, "cublasLtMatmul(%s, %s %lld x %lld, batch %lld)",
                         bf16 ? "bf16" : "f32", kind_name(w->kind), (long long)w->rows,
                         (long long)w->cols, (long long)batch);
    return QL_OK;
}

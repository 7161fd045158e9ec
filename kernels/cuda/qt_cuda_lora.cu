/*
 * qt_cuda_lora.cu - LoRA on the device: the grouped low-rank products of
 * unmerged adapters (qt_cuda_sgmv, Punica's SGMV shape) and the merge of
 * adapters into a weight (qt_cuda_merge), as declared in qt_cuda_ops.h.
 *
 * SGMV, two launches for all segments:
 *   - shrink: a block per (segment, slice of its rows), 8 warps; a warp
 *     takes ranks j, j + 8, ... and sums x[row][c] * A[j][c] over c with its
 *     32 lanes (four running sums each, so four loads are in flight), then
 *     folds the lanes with a fixed shuffle tree; lane 0 writes
 *     t[row][j] = sum * scale in f32, as eng_lora_apply rounds the down
 *     product and scales it before the up product;
 *   - expand: a block per (256 outputs, slice of rows, segment); the row's
 *     t goes to shared memory and each thread sums t[j] * B[o][j], j
 *     ascending, in f32, then adds the sum to y once (y += u, as the CPU).
 *   Every sum of a row is computed by the same threads in the same order
 *   whatever the other rows and segments are: no atomics, no split-K, so a
 *   row's bits do not depend on the batch it came in.
 *
 * Merge, the CPU merge of adapters/merge.c step for step so the merged
 * tensor is byte-identical to it:
 *   1. W = dequantize(pristine) to f32, by the dequantize kernels of
 *      qt_cuda.cu (bit-identical to qt_dequantize_rows, pinned by
 *      test_cuda_dequant) or, for dense kinds, qt_math.h's conversions: the
 *      row's dequantize (qt_cuda_kinds.c), as every per-kind step here;
 *   2. d and W + d: a thread per element sums each term in double, k
 *      ascending, then the terms in order (s * acc added to a running total
 *      that starts at 0.0), rounds once to f32 and adds W in f32: the very
 *      operations of merge.c's delta_row, built with --fmad=false so no
 *      multiply and add are fused (the host side has -ffp-contract=off).
 *      The first non-finite W + d in row-major order is an atomicMin of its
 *      index, the same element the CPU's row-by-row scan stops at;
 *   3. requantize W + d with kernels/qt_quant_math.h, the functions the CPU
 *      quantizers call: NF4/FP4 a warp per absmax block (the maximum of |x|
 *      is exact in any order), AFFINE a warp per group for scale and zero
 *      (min and max in any order: see qq_affine_qparams for why the sign
 *      of a zero never matters) then a thread per code byte, GGUF a thread
 *      per block of 32 scanning it in the CPU's order (Q4_0's first-of-equal
 *      maximum and Q4_1's stored minimum depend on it; Q5_0 and Q5_1 alike,
 *      into their whole ggml blocks; the k-quants and IQ4_NL, IQ4_XS a
 *      thread per block through qt_kquant_ref.h, the CPU's reference
 *      quantizers), dense a thread per element.
 * Double quantization of NF4/FP4 absmax runs on the host with the CPU's own code (torch's
 * cascade-summed mean, the 64 Ki LUT): the absmax array (n / blocksize floats) makes the round
 * trip;
 *   4. the cost: Q = dequantize(out), then dot, |d|^2, |Q - (W + d)|^2 in
 *      double: per thread over a fixed grid-stride, per block a fixed tree,
 *      the blocks' partials summed on the host in order. The same on every
 *      run, but not the CPU's sequential order, so equal to its figures to
 *      ~1e-12 relative rather than bit for bit (the only place the device
 *      merge is not bit-identical to the CPU's; the merged tensor is).
 *
 * Errors: every CUDA status is checked and becomes a QT_E* code with a
 * sentence naming the call; whatever a call allocated is freed on the way
 * out, and a failed merge leaves *out zeroed.
 */
#include "qt_cuda_ops.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

#include "qt_cuda_blocks.h"
#include "qt_cuda_internal.h"
#include "qt_cuda_kinds.h"
#include "qt_kquant_ref.h"
#include "qt_math.h"
#include "qt_quant_math.h"

namespace
{

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
/* The cost sums' fixed grid (blocks), so their order never changes. */
constexpr int kCostBlocks = 1024;
/* The largest rank the kernels take (qt_cuda_ops.h). */
constexpr int32_t kMaxRank = 256;

/* bitsandbytes' nested map, to check a weight uses it, as its codebook
 * (the row's, qt_cuda_kinds.c) (merge.c's bnb4_params: requantizing would
 * otherwise change its layout). */
const float kDynamicMap[256] = {
#include "dynamic_map.inc"
};

/* ---- element access ---------------------------------------------------- */

/* Element i of a dense F32/F16/BF16 array, as f32 (qt_math.h's conversions,
 * those of qt_dequantize_rows). */
__device__ __forceinline__ float dense_at(const void *p, qt_kind kind, int64_t i)
{
    if (kind == QT_F32)
        return static_cast<const float *>(p)[i];
    uint16_t h = static_cast<const uint16_t *>(p)[i];
    return kind == QT_F16 ? qm_f16_to_f32(h) : qm_bf16_to_f32(h);
}

/* ---- SGMV --------------------------------------------------------------- */

__device__ __forceinline__ bool segment_ok(const qt_cuda_lora_segment &s, int32_t max_rank,
                                           int64_t total_rows)
{
    return s.rank >= 1 && s.rank <= max_rank && is_dense(s.a_kind) && is_dense(s.b_kind) && s.a &&
           s.b && s.row0 >= 0 && s.rows >= 0 && s.row0 + s.rows <= total_rows;
}

/* t[row][j] = (x[row] . A[j]) * scale; grid (row slices, segments). */
__global__ void sgmv_shrink(const float *__restrict__ x, int64_t in,
                            const qt_cuda_lora_segment *__restrict__ segs, int32_t max_rank,
                            int64_t total_rows, float *__restrict__ t)
{
    const qt_cuda_lora_segment s = segs[blockIdx.y];
    if (!segment_ok(s, max_rank, total_rows))
        return; /* sgmv_expand writes NaN into its rows */
    const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
    for (int64_t i = blockIdx.x; i < s.rows; i += gridDim.x) {
        const int64_t row = s.row0 + i;
        const float *xr = x + row * in;
        for (int32_t j = warp; j < s.rank; j += kWarps) {
            const int64_t a0 = (int64_t)j * in;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int64_t c = lane;
            for (; c + 96 < in; c += 128) {
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    float p = xr[c + 32 * u] * dense_at(s.a, s.a_kind, a0 + c + 32 * u);
                    acc[u] += p;
                }
            }
#pragma unroll
            for (int u = 0; u < 3; u++) {
                if (c + 32 * u < in) {
                    float p = xr[c + 32 * u] * dense_at(s.a, s.a_kind, a0 + c + 32 * u);
                    acc[u] += p;
                }
            }
            float sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                sum += __shfl_xor_sync(kFullMask, sum, off);
            if (lane == 0)
                t[row * max_rank + j] = sum * s.scale;
        }
    }
}

/* y[row][o] += sum_j t[row][j] * B[o][j]; grid (output tiles, row slices,
 * segments). */
__global__ void sgmv_expand(float *__restrict__ y, int64_t out,
                            const qt_cuda_lora_segment *__restrict__ segs, int32_t max_rank,
                            int64_t total_rows, const float *__restrict__ t)
{
    __shared__ float ts[kMaxRank];
    const qt_cuda_lora_segment s = segs[blockIdx.z];
    const bool ok = segment_ok(s, max_rank, total_rows);
    const int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    /* a bad segment's rows that exist get NaN (only rows inside y) */
    const int64_t rows =
        ok ? s.rows
           : (s.row0 >= 0 && s.rows > 0
                  ? (s.row0 < total_rows
                         ? (s.rows < total_rows - s.row0 ? s.rows : total_rows - s.row0)
                         : 0)
                  : 0);
    for (int64_t i = blockIdx.y; i < rows; i += gridDim.y) {
        const int64_t row = s.row0 + i;
        if (!ok) {
            if (o < out)
                y[row * out + o] = NAN;
            continue;
        }
        __syncthreads(); /* the previous row's readers are done with ts */
        for (int32_t j = threadIdx.x; j < s.rank; j += blockDim.x)
            ts[j] = t[row * max_rank + j];
        __syncthreads();
        if (o < out) {
            const int64_t b0 = o * s.rank;
            float u = 0.0f;
            for (int32_t j = 0; j < s.rank; j++) {
                float p = ts[j] * dense_at(s.b, s.b_kind, b0 + j);
                u += p;
            }
            y[row * out + o] += u;
        }
    }
}

/* ---- merge: the delta ---------------------------------------------------- */

/* A term as the kernels read it: s formed in double on the host. */
struct dev_term {
    const void *a, *b;
    qt_kind a_kind, b_kind;
    int32_t rank;
    double s;
};

/* d = (float)(sum over terms of s * sum_k B[r][k] * A[k][c]), x = w + d,
 * merge.c's delta_row per element; grid (rows, column tiles). */
__global__ void merge_delta(const float *__restrict__ w, float *__restrict__ d,
                            float *__restrict__ x, int64_t cols, const dev_term *__restrict__ terms,
                            int32_t n_terms, unsigned long long *first_bad)
{
    const int64_t r = blockIdx.x;
    const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= cols)
        return;
    double total = 0.0;
    for (int32_t i = 0; i < n_terms; i++) {
        const dev_term tm = terms[i];
        const int64_t b0 = r * tm.rank;
        double acc = 0.0;
        for (int32_t k = 0; k < tm.rank; k++) {
            double bk = (double)dense_at(tm.b, tm.b_kind, b0 + k);
            double ak = (double)dense_at(tm.a, tm.a_kind, (int64_t)k * cols + c);
            double p = bk * ak;
            acc += p;
        }
        double part = tm.s * acc;
        total += part;
    }
    const int64_t e = r * cols + c;
    const float dv = (float)total;
    const float xv = w[e] + dv;
    d[e] = dv;
    x[e] = xv;
    if (!isfinite(xv))
        atomicMin(first_bad, (unsigned long long)e);
}

/* Which term first made element e non-finite, adding the terms to W in
 * order (merge.c's blame): its index, the last term when only their sum
 * is, -1 when W itself is not finite. One thread. */
__global__ void merge_blame(const float *w, int64_t e, int64_t cols, const dev_term *terms,
                            int32_t n_terms, int *who)
{
    const int64_t r = e / cols, c = e % cols;
    const float wv = w[e];
    if (!isfinite(wv)) {
        *who = -1;
        return;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n_terms; i++) {
        const dev_term tm = terms[i];
        double ba = 0.0;
        for (int32_t k = 0; k < tm.rank; k++) {
            double p = (double)dense_at(tm.b, tm.b_kind, r * tm.rank + k) *
                       (double)dense_at(tm.a, tm.a_kind, (int64_t)k * cols + c);
            ba += p;
        }
        double part = tm.s * ba;
        sum += part;
        if (!isfinite(wv + (float)sum)) {
            *who = i;
            return;
        }
    }
    *who = n_terms - 1;
}

/* ---- merge: dense in and out --------------------------------------------- */

/* W of a dense weight is its row's dequantize (qt_cuda_matmul.cu's
 * conversion, qt_math.h's as dense_at). */

/* qt_dense_quantize: f32 as is, f16 and bf16 rounded to nearest even. */
template <qt_kind kind>
__global__ void f32_to_dense(const float *__restrict__ x, int64_t n, void *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (kind == QT_F32)
            static_cast<float *>(dst)[i] = x[i];
        else if (kind == QT_F16)
            static_cast<uint16_t *>(dst)[i] = qm_f32_to_f16(x[i]);
        else
            static_cast<uint16_t *>(dst)[i] = qm_f32_to_bf16(x[i]);
    }
}

/* ---- merge: NF4 / FP4 ---------------------------------------------------- */

/* A warp per absmax block of qt_bnb4_quantize: the block's max |x| (a
 * shuffle tree; a maximum is exact in any order), the stored absmax (the
 * short last block clamps it), then a lane per code byte, the even element
 * in the high nibble, an odd total padded with the code of 0.0. */
__global__ void bnb4_quantize(const float *__restrict__ x, int64_t n, int32_t bs, int64_t n_blocks,
                              qq_buckets cb, uint8_t *__restrict__ codes,
                              float *__restrict__ absmax)
{
    __shared__ qq_buckets scb;
    if (threadIdx.x == 0)
        scb = cb;
    __syncthreads();
    const int lane = (int)(threadIdx.x % 32);
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    for (int64_t b = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; b < n_blocks; b += stride) {
        const int64_t b0 = b * bs;
        const int64_t end = b0 + bs < n ? b0 + bs : n;
        float am = 0.0f;
        for (int64_t e = b0 + lane; e < end; e += 32)
            am = qq_maxf(am, fabsf(x[e]));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            am = qq_maxf(am, __shfl_xor_sync(kFullMask, am, off));
        const bool full = end - b0 == bs;
        const float stored = full ? am : qq_bnb4_short_absmax(am);
        const float recip = qq_bnb4_recip(am);
        if (lane == 0)
            absmax[b] = stored;
        const int64_t n_bytes = (end - b0 + 1) / 2;
        for (int64_t i = lane; i < n_bytes; i += 32) {
            const int64_t e = b0 + 2 * i;
            unsigned hi = full ? qq_bnb4_code_full(&scb, x[e], recip)
                               : qq_bnb4_code_short(&scb, x[e], stored);
            unsigned lo;
            if (e + 1 < end)
                lo = full ? qq_bnb4_code_full(&scb, x[e + 1], recip)
                          : qq_bnb4_code_short(&scb, x[e + 1], stored);
            else
                lo = qq_bucket(&scb, 0.0f);
            codes[b0 / 2 + i] = (uint8_t)((hi << 4) | lo);
        }
    }
}

/* ---- merge: AFFINE --------------------------------------------------------- */

/* Raise *flag when a zero point is not the middle code (merge.c's
 * affine_params: then the weight was quantized asymmetrically). */
__global__ void affine_find_asymmetric(const float *__restrict__ zeros, int64_t n, float middle,
                                       int *flag)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        if (zeros[i] != middle)
            atomicOr(flag, 1);
}

/* A warp per group: its min and max, then qq_affine_qparams. Symmetric when
 * the domain is integer and no zero point was off the middle. */
__global__ void affine_qparams(const float *__restrict__ x, int64_t n_groups, int64_t cols,
                               int32_t gs, int64_t gpr, int32_t qmin, int32_t qmax, bool float_zero,
                               float eps, const int *asymmetric, float *__restrict__ scales,
                               float *__restrict__ zeros)
{
    const bool symmetric = !float_zero && *asymmetric == 0;
    const int lane = (int)(threadIdx.x % 32);
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    for (int64_t g = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; g < n_groups; g += stride) {
        const float *w = x + (g / gpr) * cols + (g % gpr) * gs;
        float mn = w[0], mx = w[0];
        for (int64_t i = lane; i < gs; i += 32) {
            mn = qq_minf(mn, w[i]);
            mx = qq_maxf(mx, w[i]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            mn = qq_minf(mn, __shfl_xor_sync(kFullMask, mn, off));
            mx = qq_maxf(mx, __shfl_xor_sync(kFullMask, mx, off));
        }
        if (lane == 0) {
            float scale, zero;
            qq_affine_qparams(mn, mx, qmin, qmax, symmetric, float_zero, eps, &scale, &zero);
            scales[g] = scale;
            zeros[g] = zero;
        }
    }
}

__device__ __forceinline__ unsigned affine_code_at(const float *x, int64_t r, int64_t c,
                                                   int64_t cols, int32_t gs, int64_t gpr,
                                                   int32_t qmin, int32_t qmax, bool float_zero,
                                                   float mid, const float *scales,
                                                   const float *zeros)
{
    const int64_t g = r * gpr + c / gs;
    const qq_affine_group grp = qq_affine_group_of(scales[g], zeros[g], mid);
    return qq_affine_code(x[r * cols + c], &grp, qmin, qmax, float_zero);
}

/* A thread per code byte: one code for 8 bits, two for 4 (even column
 * high, a row's odd last column padded with 0, as the CPU's calloc). */
__global__ void affine_codes(const float *__restrict__ x, int64_t rows, int64_t cols, int32_t bits,
                             uint64_t row_stride, int32_t gs, int64_t gpr, int32_t qmin,
                             int32_t qmax, bool float_zero, float mid,
                             const float *__restrict__ scales, const float *__restrict__ zeros,
                             uint8_t *__restrict__ codes)
{
    const int64_t n = rows * (int64_t)row_stride;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / (int64_t)row_stride, k = i % (int64_t)row_stride;
        if (bits == 8) {
            codes[i] = (uint8_t)affine_code_at(x, r, k, cols, gs, gpr, qmin, qmax, float_zero, mid,
                                               scales, zeros);
            continue;
        }
        const int64_t c = 2 * k;
        unsigned hi =
            affine_code_at(x, r, c, cols, gs, gpr, qmin, qmax, float_zero, mid, scales, zeros);
        unsigned lo = c + 1 < cols ? affine_code_at(x, r, c + 1, cols, gs, gpr, qmin, qmax,
                                                    float_zero, mid, scales, zeros)
                                   : 0u;
        codes[i] = (uint8_t)((hi << 4) | lo);
    }
}

/* ---- merge: GGUF ------------------------------------------------------------- */

/* A thread per block of 32, scanned in the CPU's order; qs written as 16-byte
 * stores when aligned (the split layout's codes are). */
template <qt_kind kind>
__global__ void gguf_quantize(const float *__restrict__ x, int64_t n_blocks, bool aligned,
                              uint8_t *__restrict__ qs, uint16_t *__restrict__ d,
                              uint16_t *__restrict__ m)
{
    using block = qt_cuda_block<kind>;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks;
         b += (int64_t)gridDim.x * blockDim.x) {
        const float *xb = x + b * QM_GGUF_QK;
        uint4 q[2];
        uint8_t *qb = reinterpret_cast<uint8_t *>(q);
        uint16_t db, mb = 0;
        const int n_qs = block::kQsBytes;
        block::quantize(xb, &db, &mb, qb);
        uint8_t *dst = qs + b * n_qs;
        if (aligned) {
            reinterpret_cast<uint4 *>(dst)[0] = q[0];
            if (n_qs == 32)
                reinterpret_cast<uint4 *>(dst)[1] = q[1];
        } else {
            for (int j = 0; j < n_qs; j++)
                dst[j] = qb[j];
        }
        d[b] = db;
        if (block::kHasM)
            m[b] = mb;
    }
}

/* Q5_0, Q5_1, the k-quants and IQ4_NL, IQ4_XS, kept in whole ggml blocks:
 * a thread per block, each block's bytes written where ggml has them, by
 * the CPU's own quantizers (qq_q5_0_block / qq_q5_1_block; the others'
 * qk_*_block, llama.cpp's quantize_row_*_ref, which search each block's
 * scales: slow per thread, and a merge's only cost here). */
template <qt_kind kind>
__global__ void gguf_whole_quantize(const float *__restrict__ x, int64_t n_blocks,
                                    uint8_t *__restrict__ blocks)
{
    using block = qt_cuda_block<kind>;
    const int64_t bb = block::kBytes, per = block::kElems;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks;
         b += (int64_t)gridDim.x * blockDim.x)
        block::quantize(x + b * per, blocks + b * bb);
}

/* ---- merge: the cost ----------------------------------------------------------- */

/* Per block: dot, |d|^2 and |Q - (W + d)|^2 in double over a fixed
 * grid-stride, folded by a fixed tree; partials[3 * block + 0..2]. */
__global__ void merge_cost(const float *__restrict__ q, const float *__restrict__ w,
                           const float *__restrict__ d, int64_t n, double *__restrict__ partials)
{
    __shared__ double sh[3][kThreads];
    double dot = 0.0, dsq = 0.0, esq = 0.0;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const double qv = q[e], wv = w[e], dv = d[e];
        const double exact = wv + dv;
        const double err = qv - exact;
        const double moved = qv - wv;
        double p = moved * dv;
        dot += p;
        p = dv * dv;
        dsq += p;
        p = err * err;
        esq += p;
    }
    sh[0][threadIdx.x] = dot;
    sh[1][threadIdx.x] = dsq;
    sh[2][threadIdx.x] = esq;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half)
            for (int k = 0; k < 3; k++)
                sh[k][threadIdx.x] += sh[k][threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        for (int k = 0; k < 3; k++)
            partials[3 * blockIdx.x + k] = sh[k][0];
}

/* ---- merge: the host side ----------------------------------------------------- */

} // namespace

/* Everything one merge holds, freed by job_free whatever happened. Named
 * outside the file's namespace because the table's requantize entries
 * (qt_cuda_kinds.h) take it. */
struct qt_cuda_merge_job {
    const qt_cuda_kind_ops *row; /* the pristine's kind's (the output's too) */
    const qt_cuda_tensor *pristine;
    qt_cuda_tensor *out;
    bool out_allocated;
    int64_t rows, cols, n;
    cudaStream_t stream;
    char *msg;
    size_t msg_len;
    /* device */
    float *w, *d, *x;
    dev_term *terms;
    unsigned long long *first_bad;
    int *flag;     /* [0] affine asymmetric, [1] blamed term */
    float *absmax; /* NF4/FP4 double quant: the block absmax before nesting */
    double *partials;
    /* host */
    dev_term *h_terms;
    float *h_absmax, *h_nested_absmax, *h_centered;
    uint8_t *h_codes, *h_lut;
};

namespace
{

using merge_job = qt_cuda_merge_job;

int job_alloc(merge_job &j, void **p, size_t bytes, const char *what)
{
    cudaError_t st = cudaMalloc(p, bytes ? bytes : 1);
    if (st != cudaSuccess) {
        *p = nullptr;
        return cuda_failed(st, j.msg, j.msg_len, "qt_cuda_merge: cudaMalloc of %zu bytes for %s",
                           bytes, what);
    }
    return QL_OK;
}

/* The last launch's status. */
int launched(merge_job &j, const char *what)
{
    cudaError_t st = cudaGetLastError();
    if (st != cudaSuccess)
        return cuda_failed(st, j.msg, j.msg_len, "qt_cuda_merge: launching %s (%s %lld x %lld)",
                           what, kind_name(j.pristine->kind), (long long)j.rows, (long long)j.cols);
    return QL_OK;
}

int job_sync(merge_job &j, const char *after)
{
    cudaError_t st = cudaStreamSynchronize(j.stream);
    if (st != cudaSuccess)
        return cuda_failed(st, j.msg, j.msg_len,
                           "qt_cuda_merge: cudaStreamSynchronize after %s (%s %lld x %lld)", after,
                           kind_name(j.pristine->kind), (long long)j.rows, (long long)j.cols);
    return QL_OK;
}

int job_copy(merge_job &j, void *dst, const void *src, size_t bytes, cudaMemcpyKind dir,
             const char *what)
{
    cudaError_t st = cudaMemcpyAsync(dst, src, bytes, dir, j.stream);
    if (st != cudaSuccess)
        return cuda_failed(st, j.msg, j.msg_len, "qt_cuda_merge: cudaMemcpyAsync of %s (%zu bytes)",
                           what, bytes);
    return QL_OK;
}

void job_free(merge_job &j)
{
    void *dev[] = {j.w, j.d, j.x, j.terms, j.first_bad, j.flag, j.absmax, j.partials};
    for (void *p : dev)
        if (p)
            (void)cudaFree(p);
    free(j.h_terms);
    free(j.h_absmax);
    free(j.h_nested_absmax);
    free(j.h_centered);
    free(j.h_codes);
    free(j.h_lut);
}

/* merge.c's parameter checks, on the device tensor's views: what the CPU
 * refuses, the device refuses with the same code. */
int check_pristine(const qt_cuda_kind_ops *row, const qt_cuda_tensor *p, char *msg, size_t msg_len)
{
    const int64_t n = p->rows * p->cols;
    switch (row && row->requantize ? row->layout : QT_CUDA_LAYOUT_NONE) {
    case QT_CUDA_LAYOUT_DENSE:
        if (!p->dense) {
            say(msg, msg_len, "qt_cuda_merge: the %s weight has no device data",
                kind_name(p->kind));
            return QL_EINVAL;
        }
        return QL_OK;
    case QT_CUDA_LAYOUT_BNB4: {
        const qt_cuda_4bit_view &v = p->q4;
        const float *code = row->codebook;
        if (memcmp(v.codebook, code, sizeof v.codebook) != 0) {
            say(msg, msg_len,
                "qt_cuda_merge: this %s weight's quant_map is not bitsandbytes' %s codebook; "
                "requantizing would change it",
                kind_name(p->kind), kind_name(p->kind));
            return QL_EUNSUPPORTED;
        }
        if (v.nested && (v.nested_blocksize != QQ_NESTED_BLOCKSIZE ||
                         memcmp(v.nested_code, kDynamicMap, sizeof v.nested_code) != 0)) {
            say(msg, msg_len,
                "qt_cuda_merge: this %s weight's nested absmax is not in bitsandbytes' layout "
                "(the signed dynamic map in blocks of 256, here %d); requantizing would change "
                "it",
                kind_name(p->kind), (int)v.nested_blocksize);
            return QL_EUNSUPPORTED;
        }
        if (v.kind != p->kind || v.blocksize < 32 || v.blocksize > 4096 ||
            (v.blocksize & (v.blocksize - 1)) || v.n_elements != n ||
            v.n_blocks != ceil_div(n, v.blocksize) || !v.codes ||
            (v.nested ? !v.absmax_codes || !v.nested_absmax : !v.absmax)) {
            say(msg, msg_len,
                "qt_cuda_merge: the %s weight's view does not fit its shape [%lld, %lld] "
                "(blocksize %d, %lld elements, %lld blocks) or lacks device arrays",
                kind_name(p->kind), (long long)p->rows, (long long)p->cols, (int)v.blocksize,
                (long long)v.n_elements, (long long)v.n_blocks);
            return QL_EINVAL;
        }
        return QL_OK;
    }
    case QT_CUDA_LAYOUT_AFFINE: {
        const qt_cuda_affine_view &v = p->affine;
        const uint64_t stride = v.bits == 8 ? (uint64_t)p->cols : (uint64_t)(p->cols + 1) / 2;
        if ((v.bits != 4 && v.bits != 8) || v.group_size <= 0 || p->cols % v.group_size != 0 ||
            v.groups_per_row != p->cols / v.group_size || v.rows != p->rows || v.cols != p->cols ||
            v.row_stride != stride || v.qmin >= v.qmax || v.qmax - v.qmin > (1 << v.bits) - 1 ||
            !v.codes || !v.scales || !v.zeros) {
            say(msg, msg_len,
                "qt_cuda_merge: the affine weight's view (%d bits, group %d, range [%d, %d]) "
                "does not fit its shape [%lld, %lld] or lacks device arrays",
                (int)v.bits, (int)v.group_size, (int)v.qmin, (int)v.qmax, (long long)p->rows,
                (long long)p->cols);
            return QL_EINVAL;
        }
        return QL_OK;
    }
    case QT_CUDA_LAYOUT_GGUF_SPLIT:
    case QT_CUDA_LAYOUT_GGUF_WHOLE: {
        const qt_cuda_gguf_view &v = p->gguf;
        const int64_t per = row->block_size;
        if (p->cols % per != 0 || v.n_blocks != n / per || !v.qs ||
            (row->layout == QT_CUDA_LAYOUT_GGUF_SPLIT && !v.d) || (row->has_m && !v.m)) {
            say(msg, msg_len,
                "qt_cuda_merge: the %s weight [%lld, %lld] needs columns in blocks of %lld and "
                "%lld blocks of qs, d%s on the device",
                kind_name(p->kind), (long long)p->rows, (long long)p->cols, (long long)per,
                (long long)(n / per), row->has_m ? " and m" : "");
            return QL_EINVAL;
        }
        return QL_OK;
    }
    case QT_CUDA_LAYOUT_FP8:  /* merged on the CPU (quant_fp8.c, quant_ct.c), uploaded */
    case QT_CUDA_LAYOUT_GPTQ: /* merged on the CPU (quant_gptq.c), likewise */
    case QT_CUDA_LAYOUT_NONE: break;
    }
    say(msg, msg_len, "qt_cuda_merge: quant kind %s has no LoRA merge on the device",
        kind_name(p->kind));
    return QL_EUNSUPPORTED;
}

/* t (pristine or merged, of the job's kind) dequantized to f32 into dst
 * by the row's dequantize. */
int dequantize_to(merge_job &j, const qt_cuda_tensor *t, float *dst)
{
    return j.row->dequantize(j.row, t, dst, QT_CUDA_OUT_F32, j.stream, j.msg, j.msg_len);
}

/* The nested absmax of the merged NF4/FP4 tensor: the block absmax to the
 * host, the CPU's double quantization, its codes and scales back. */
int bnb4_nest(merge_job &j, qt_cuda_4bit_view &o)
{
    const int64_t nb = o.n_blocks;
    const int64_t nn = ceil_div(nb, QQ_NESTED_BLOCKSIZE);
    if (o.n_nested_blocks != nn || !o.absmax_codes || !o.nested_absmax) {
        say(j.msg, j.msg_len,
            "qt_cuda_merge: the merged tensor has %lld nested blocks (%s arrays) where %lld "
            "blocks need %lld",
            (long long)o.n_nested_blocks, o.absmax_codes && o.nested_absmax ? "with" : "without",
            (long long)nb, (long long)nn);
        return QL_EINVAL;
    }
    j.h_absmax = static_cast<float *>(malloc((size_t)nb * sizeof(float)));
    j.h_centered = static_cast<float *>(malloc((size_t)nb * sizeof(float)));
    j.h_nested_absmax = static_cast<float *>(malloc((size_t)nn * sizeof(float)));
    j.h_codes = static_cast<uint8_t *>(malloc((size_t)nb));
    j.h_lut = static_cast<uint8_t *>(malloc(QQ_DYNAMIC_LUT_SIZE));
    if (!j.h_absmax || !j.h_centered || !j.h_nested_absmax || !j.h_codes || !j.h_lut) {
        say(j.msg, j.msg_len,
            "qt_cuda_merge: cannot allocate host memory to double-quantize %lld absmax values",
            (long long)nb);
        return QL_ENOMEM;
    }
    int rc = job_copy(j, j.h_absmax, j.absmax, (size_t)nb * sizeof(float), cudaMemcpyDeviceToHost,
                      "the block absmax to the host");
    if (rc == QL_OK)
        rc = job_sync(j, "copying the block absmax to the host");
    if (rc != QL_OK)
        return rc;
    float offset = 0.0f;
    qq_bnb4_double_quantize(j.h_absmax, nb, kDynamicMap, j.h_codes, j.h_nested_absmax, &offset,
                            j.h_lut, j.h_centered);
    rc = job_copy(j, const_cast<uint8_t *>(o.absmax_codes), j.h_codes, (size_t)nb,
                  cudaMemcpyHostToDevice, "the nested absmax codes");
    if (rc == QL_OK)
        rc = job_copy(j, const_cast<float *>(o.nested_absmax), j.h_nested_absmax,
                      (size_t)nn * sizeof(float), cudaMemcpyHostToDevice, "the nested absmax");
    /* the host buffers must outlive the copies: job_free runs after the
     * final synchronisation */
    o.nested_offset = offset;
    o.nested_blocksize = QQ_NESTED_BLOCKSIZE;
    memcpy(o.nested_code, kDynamicMap, sizeof o.nested_code);
    return rc;
}

int requantize_bnb4(merge_job &j)
{
    qt_cuda_4bit_view &o = j.out->q4;
    const qt_cuda_4bit_view &p = j.pristine->q4;
    if (o.kind != p.kind || o.blocksize != p.blocksize || o.n_blocks != p.n_blocks ||
        o.nested != p.nested || !o.codes || (!o.nested && !o.absmax)) {
        say(j.msg, j.msg_len,
            "qt_cuda_merge: qt_cuda_tensor_alloc_like gave a %s tensor (blocksize %d, %lld "
            "blocks, nested %d) unlike the pristine one (blocksize %d, %lld blocks, nested %d)",
            kind_name(o.kind), (int)o.blocksize, (long long)o.n_blocks, (int)o.nested,
            (int)p.blocksize, (long long)p.n_blocks, (int)p.nested);
        return QL_EINVAL;
    }
    memcpy(o.codebook, j.row->codebook, sizeof o.codebook);
    qq_buckets cb;
    qq_build_buckets(o.codebook, &cb);
    float *absmax = const_cast<float *>(o.absmax);
    if (o.nested) {
        int rc = job_alloc(j, reinterpret_cast<void **>(&j.absmax),
                           (size_t)o.n_blocks * sizeof(float), "the block absmax");
        if (rc != QL_OK)
            return rc;
        absmax = j.absmax;
    }
    bnb4_quantize<<<grid_for(o.n_blocks, kWarps), kThreads, 0, j.stream>>>(
        j.x, j.n, o.blocksize, o.n_blocks, cb, const_cast<uint8_t *>(o.codes), absmax);
    int rc = launched(j, "the 4-bit quantize kernel");
    if (rc == QL_OK && o.nested)
        rc = bnb4_nest(j, o);
    return rc;
}

int requantize_affine(merge_job &j)
{
    qt_cuda_affine_view &o = j.out->affine;
    const qt_cuda_affine_view &p = j.pristine->affine;
    if (o.bits != p.bits || o.group_size != p.group_size || o.groups_per_row != p.groups_per_row ||
        o.qmin != p.qmin || o.qmax != p.qmax || o.float_zero != p.float_zero ||
        o.row_stride != p.row_stride || !o.codes || !o.scales || !o.zeros) {
        say(j.msg, j.msg_len,
            "qt_cuda_merge: qt_cuda_tensor_alloc_like gave an affine tensor (%d bits, group %d, "
            "[%d, %d]) unlike the pristine one (%d bits, group %d, [%d, %d])",
            (int)o.bits, (int)o.group_size, (int)o.qmin, (int)o.qmax, (int)p.bits,
            (int)p.group_size, (int)p.qmin, (int)p.qmax);
        return QL_EINVAL;
    }
    const int64_t n_groups = j.rows * p.groups_per_row;
    /* merge.c's affine_params: symmetric iff the integer domain and every
     * zero point at the middle code; eps 1e-6 for the float domain (torchao
     * int4 weight-only), FLT_EPSILON otherwise */
    const float middle = floorf((float)(p.qmax + p.qmin + 1) / 2.0f);
    const float eps = p.float_zero ? 1e-6f : 1.1920928955078125e-07f;
    cudaError_t st = cudaMemsetAsync(j.flag, 0, 2 * sizeof(int), j.stream);
    if (st != cudaSuccess)
        return cuda_failed(st, j.msg, j.msg_len, "qt_cuda_merge: cudaMemsetAsync of a flag");
    if (!p.float_zero) {
        affine_find_asymmetric<<<grid_for(n_groups, kThreads), kThreads, 0, j.stream>>>(
            p.zeros, n_groups, middle, j.flag);
        int rc = launched(j, "the affine symmetry check");
        if (rc != QL_OK)
            return rc;
    }
    float *scales = const_cast<float *>(o.scales), *zeros = const_cast<float *>(o.zeros);
    affine_qparams<<<grid_for(n_groups, kWarps), kThreads, 0, j.stream>>>(
        j.x, n_groups, j.cols, p.group_size, p.groups_per_row, p.qmin, p.qmax, p.float_zero, eps,
        j.flag, scales, zeros);
    int rc = launched(j, "the affine scale and zero kernel");
    if (rc != QL_OK)
        return rc;
    const float mid = qm_affine_mid(p.qmin, p.qmax);
    affine_codes<<<grid_for(j.rows * (int64_t)p.row_stride, kThreads), kThreads, 0, j.stream>>>(
        j.x, j.rows, j.cols, p.bits, p.row_stride, p.group_size, p.groups_per_row, p.qmin, p.qmax,
        p.float_zero, mid, scales, zeros, const_cast<uint8_t *>(o.codes));
    return launched(j, "the affine code kernel");
}

/* W + d into the GGUF kind kKind's blocks: split into qs / d / m, or
 * whole ggml blocks (kWhole), as its row says. */
template <qt_kind kKind, bool kWhole> int requantize_gguf(merge_job &j)
{
    qt_cuda_gguf_view &o = j.out->gguf;
    const int64_t nb = j.n / j.row->block_size;
    if (o.kind != j.pristine->kind || o.n_blocks != nb || !o.qs || (!kWhole && !o.d) ||
        (j.row->has_m && !o.m)) {
        say(j.msg, j.msg_len,
            "qt_cuda_merge: qt_cuda_tensor_alloc_like gave a %s tensor of %lld blocks unlike the "
            "pristine %s of %lld",
            kind_name(o.kind), (long long)o.n_blocks, kind_name(j.pristine->kind), (long long)nb);
        return QL_EINVAL;
    }
    if constexpr (kWhole) {
        gguf_whole_quantize<kKind><<<grid_for(nb, kThreads), kThreads, 0, j.stream>>>(
            j.x, nb, const_cast<uint8_t *>(o.qs));
    } else {
        const bool aligned = (reinterpret_cast<uintptr_t>(o.qs) & 15u) == 0;
        gguf_quantize<kKind><<<grid_for(nb, kThreads), kThreads, 0, j.stream>>>(
            j.x, nb, aligned, const_cast<uint8_t *>(o.qs), const_cast<uint16_t *>(o.d),
            const_cast<uint16_t *>(o.m));
    }
    return launched(j, "the GGUF quantize kernel");
}

/* W + d into the dense kind kKind. */
template <qt_kind kKind> int requantize_dense(merge_job &j)
{
    if (!j.out->dense) {
        say(j.msg, j.msg_len, "qt_cuda_merge: qt_cuda_tensor_alloc_like gave no dense data");
        return QL_EINVAL;
    }
    f32_to_dense<kKind><<<grid_for(j.n, kThreads), kThreads, 0, j.stream>>>(j.x, j.n, j.out->dense);
    return launched(j, "the f32-to-dense kernel");
}

/* The terms on the device, s formed in double as merge.c's load_part. */
int upload_terms(merge_job &j, const qt_cuda_lora_term *terms, int32_t n_terms)
{
    for (int32_t i = 0; i < n_terms; i++) {
        const qt_cuda_lora_term &t = terms[i];
        if (!t.a || !t.b || !is_dense(t.a_kind) || !is_dense(t.b_kind) || t.rank < 1) {
            say(j.msg, j.msg_len,
                "qt_cuda_merge: term %d: A (%s, %p) and B (%s, %p) must be dense f32/f16/bf16 "
                "device arrays and the rank (%d) positive",
                (int)i, kind_name(t.a_kind), t.a, kind_name(t.b_kind), t.b, (int)t.rank);
            return QL_EINVAL;
        }
    }
    const size_t count = n_terms > 0 ? (size_t)n_terms : 1;
    dev_term *h = static_cast<dev_term *>(malloc(count * sizeof *h));
    j.h_terms = h; /* freed by job_free, after the copy has run */
    if (!h) {
        say(j.msg, j.msg_len, "qt_cuda_merge: cannot allocate %d terms on the host", (int)n_terms);
        return QL_ENOMEM;
    }
    for (int32_t i = 0; i < n_terms; i++) {
        h[i].a = terms[i].a;
        h[i].b = terms[i].b;
        h[i].a_kind = terms[i].a_kind;
        h[i].b_kind = terms[i].b_kind;
        h[i].rank = terms[i].rank;
        h[i].s = (double)terms[i].scale * (double)terms[i].module_scale;
    }
    int rc =
        job_alloc(j, reinterpret_cast<void **>(&j.terms), count * sizeof(dev_term), "the terms");
    if (rc == QL_OK && n_terms > 0)
        rc = job_copy(j, j.terms, h, (size_t)n_terms * sizeof(dev_term), cudaMemcpyHostToDevice,
                      "the terms");
    return rc;
}

/* The first non-finite W + d, if any: QL_ENONFINITE naming it and its term. */
int check_finite(merge_job &j, int32_t n_terms)
{
    unsigned long long bad = 0;
    int rc = job_copy(j, &bad, j.first_bad, sizeof bad, cudaMemcpyDeviceToHost, "the finite check");
    if (rc == QL_OK)
        rc = job_sync(j, "the delta kernel");
    if (rc != QL_OK || bad == ~0ull)
        return rc;
    const int64_t e = (int64_t)bad, r = e / j.cols, c = e % j.cols;
    merge_blame<<<1, 1, 0, j.stream>>>(j.w, e, j.cols, j.terms, n_terms, j.flag + 1);
    rc = launched(j, "the blame kernel");
    int who = 0;
    float vals[2] = {0.0f, 0.0f};
    if (rc == QL_OK)
        rc = job_copy(j, &who, j.flag + 1, sizeof who, cudaMemcpyDeviceToHost, "the blamed term");
    if (rc == QL_OK)
        rc = job_copy(j, &vals[0], j.w + e, sizeof(float), cudaMemcpyDeviceToHost, "W");
    if (rc == QL_OK)
        rc = job_copy(j, &vals[1], j.x + e, sizeof(float), cudaMemcpyDeviceToHost, "W + d");
    if (rc == QL_OK)
        rc = job_sync(j, "the blame kernel");
    if (rc != QL_OK)
        return rc;
    if (who < 0)
        say(j.msg, j.msg_len,
            "qt_cuda_merge: the pristine weight at (row %lld, col %lld) is %g, not finite; "
            "nothing was merged",
            (long long)r, (long long)c, (double)vals[0]);
    else
        say(j.msg, j.msg_len,
            "qt_cuda_merge: term %d: the merged value at (row %lld, col %lld) is %g, not "
            "finite; nothing was merged",
            who, (long long)r, (long long)c, (double)vals[1]);
    return QL_ENONFINITE;
}

/* merge.c's cost_ratios. */
void report_ratios(qt_cuda_merge_report *rep)
{
    if (rep->delta_sq > 0.0) {
        rep->delta_retained = rep->dot / rep->delta_sq;
        rep->relative_error = sqrt(rep->err_sq / rep->delta_sq);
    } else {
        rep->delta_retained = 1.0;
        rep->relative_error = rep->err_sq == 0.0 ? 0.0 : INFINITY;
    }
}

int compute_cost(merge_job &j, qt_cuda_merge_report *rep)
{
    int rc = dequantize_to(j, j.out, j.x);
    if (rc != QL_OK)
        return rc;
    merge_cost<<<kCostBlocks, kThreads, 0, j.stream>>>(j.x, j.w, j.d, j.n, j.partials);
    rc = launched(j, "the cost kernel");
    double h[3 * kCostBlocks];
    if (rc == QL_OK)
        rc = job_copy(j, h, j.partials, sizeof h, cudaMemcpyDeviceToHost, "the cost partials");
    if (rc == QL_OK)
        rc = job_sync(j, "the cost kernel");
    if (rc != QL_OK)
        return rc;
    double dot = 0.0, dsq = 0.0, esq = 0.0;
    for (int b = 0; b < kCostBlocks; b++) {
        dot += h[3 * b];
        dsq += h[3 * b + 1];
        esq += h[3 * b + 2];
    }
    rep->dot = dot;
    rep->delta_sq = dsq;
    rep->err_sq = esq;
    report_ratios(rep);
    return QL_OK;
}

int run_merge(merge_job &j, const qt_cuda_lora_term *terms, int32_t n_terms,
              qt_cuda_merge_report *report)
{
    int rc = upload_terms(j, terms, n_terms);
    const size_t fbytes = (size_t)j.n * sizeof(float);
    if (rc == QL_OK)
        rc = job_alloc(j, reinterpret_cast<void **>(&j.w), fbytes, "W");
    if (rc == QL_OK)
        rc = job_alloc(j, reinterpret_cast<void **>(&j.d), fbytes, "the delta");
    if (rc == QL_OK)
        rc = job_alloc(j, reinterpret_cast<void **>(&j.x), fbytes, "W + delta");
    if (rc == QL_OK)
        rc = job_alloc(j, reinterpret_cast<void **>(&j.first_bad), sizeof(unsigned long long),
                       "the finite check");
    if (rc == QL_OK)
        rc = job_alloc(j, reinterpret_cast<void **>(&j.flag), 2 * sizeof(int), "two flags");
    if (rc == QL_OK && report)
        rc = job_alloc(j, reinterpret_cast<void **>(&j.partials), 3 * kCostBlocks * sizeof(double),
                       "the cost partials");
    if (rc != QL_OK)
        return rc;

    /* W, then d and W + d with the finite check */
    (void)cudaGetLastError();
    rc = dequantize_to(j, j.pristine, j.w);
    if (rc != QL_OK)
        return rc;
    cudaError_t st = cudaMemsetAsync(j.first_bad, 0xff, sizeof(unsigned long long), j.stream);
    if (st != cudaSuccess)
        return cuda_failed(st, j.msg, j.msg_len,
                           "qt_cuda_merge: cudaMemsetAsync of the finite check");
    const dim3 grid((unsigned)j.rows, (unsigned)ceil_div(j.cols, kThreads));
    merge_delta<<<grid, kThreads, 0, j.stream>>>(j.w, j.d, j.x, j.cols, j.terms, n_terms,
                                                 j.first_bad);
    rc = launched(j, "the delta kernel");
    if (rc == QL_OK)
        rc = check_finite(j, n_terms);
    if (rc != QL_OK)
        return rc;

    /* Q(W + d) into a tensor like the pristine one */
    rc = qt_cuda_tensor_alloc_like_with(j.row, j.pristine, j.out, j.msg, j.msg_len);
    if (rc != QL_OK)
        return rc;
    j.out_allocated = true;
    if (j.out->kind != j.pristine->kind || j.out->rows != j.rows || j.out->cols != j.cols) {
        say(j.msg, j.msg_len,
            "qt_cuda_merge: qt_cuda_tensor_alloc_like gave a %s [%lld, %lld] for a %s [%lld, "
            "%lld]",
            kind_name(j.out->kind), (long long)j.out->rows, (long long)j.out->cols,
            kind_name(j.pristine->kind), (long long)j.rows, (long long)j.cols);
        return QL_EINVAL;
    }
    rc = j.row->requantize(&j);
    if (rc != QL_OK)
        return rc;

    if (report)
        return compute_cost(j, report);
    return job_sync(j, "requantizing");
}

} // namespace

/* ---- the rows' requantize (qt_cuda_kinds.c) ------------------------------------ */

#define REQUANTIZE(k, CALL)                                                                        \
    extern "C" int qt_cuda_requantize_as_##k(qt_cuda_merge_job *j)                                 \
    {                                                                                              \
        return CALL(*j);                                                                           \
    }
REQUANTIZE(f32, requantize_dense<QT_F32>)
REQUANTIZE(f16, requantize_dense<QT_F16>)
REQUANTIZE(bf16, requantize_dense<QT_BF16>)
REQUANTIZE(bnb4, requantize_bnb4)
REQUANTIZE(affine, requantize_affine)
#define GGUF_REQUANTIZE(name, NAME, whole) REQUANTIZE(name, (requantize_gguf<QT_##NAME, whole>))
QT_CUDA_GGUF_KINDS(GGUF_REQUANTIZE)
#undef GGUF_REQUANTIZE
#undef REQUANTIZE

/* ---- the public functions -------------------------------------------------- */

extern "C" int qt_cuda_sgmv(const float *x, int64_t in, float *y, int64_t out,
                            const qt_cuda_lora_segment *segs, int32_t n_segs, int32_t max_rank,
                            int64_t total_rows, float *t, void *stream, char *msg, size_t msg_len)
{
    if (n_segs == 0)
        return QL_OK;
    if (n_segs < 0 || n_segs > 65535 || !segs || !x || !y || !t || in <= 0 || out <= 0 ||
        max_rank < 1 || max_rank > kMaxRank || total_rows <= 0) {
        say(msg, msg_len,
            "qt_cuda_sgmv: bad arguments (x %p, y %p, t %p, segs %p, n_segs %d (1..65535), in "
            "%lld, out %lld, max_rank %d (1..%d), total_rows %lld)",
            (const void *)x, (const void *)y, (const void *)t, (const void *)segs, (int)n_segs,
            (long long)in, (long long)out, (int)max_rank, (int)kMaxRank, (long long)total_rows);
        return QL_EINVAL;
    }
    if (ceil_div(out, kThreads) > 0x7fffffff) {
        say(msg, msg_len, "qt_cuda_sgmv: %lld outputs are more than one launch covers",
            (long long)out);
        return QL_EINVAL;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();
    /* a segment's rows are spread over `slices` blocks (each takes every
     * slices-th row): as many as an average segment has rows, at most 512
     * (shrink: a block per row) or 64 (expand: a block per 256 outputs
     * already), so decode steps of many small segments launch few idle
     * blocks and a long prefill segment still fills the device */
    const int64_t per_seg = ceil_div(total_rows, n_segs);
    const unsigned row_slices_in = (unsigned)(per_seg < 512 ? per_seg : 512);
    const unsigned row_slices_out = (unsigned)(per_seg < 64 ? per_seg : 64);
    sgmv_shrink<<<dim3(row_slices_in, (unsigned)n_segs), kThreads, 0, s>>>(x, in, segs, max_rank,
                                                                           total_rows, t);
    cudaError_t st = cudaGetLastError();
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len,
                           "qt_cuda_sgmv: launching the shrink kernel (%d segments)", (int)n_segs);
    sgmv_expand<<<dim3((unsigned)ceil_div(out, kThreads), row_slices_out, (unsigned)n_segs),
                  kThreads, 0, s>>>(y, out, segs, max_rank, total_rows, t);
    st = cudaGetLastError();
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len,
                           "qt_cuda_sgmv: launching the expand kernel (%d segments)", (int)n_segs);
    return QL_OK;
}

extern "C" int qt_cuda_merge_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *pristine,
                                  const qt_cuda_lora_term *terms, int32_t n_terms,
                                  qt_cuda_tensor *out, qt_cuda_merge_report *report, void *stream,
                                  char *msg, size_t msg_len)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (report)
        memset(report, 0, sizeof *report);
    if (!pristine || !out || n_terms < 0 || (n_terms > 0 && !terms)) {
        say(msg, msg_len,
            "qt_cuda_merge: needs a pristine tensor (%p), an output (%p) and %d terms (%p)",
            (const void *)pristine, (void *)out, (int)n_terms, (const void *)terms);
        return QL_EINVAL;
    }
    const int64_t rows = pristine->rows, cols = pristine->cols;
    if (rows <= 0 || cols <= 0 || rows > 0x7fffffff || ceil_div(cols, kThreads) > 65535 ||
        rows > INT64_MAX / cols) {
        say(msg, msg_len, "qt_cuda_merge: the weight's shape [%lld, %lld] is empty or too large",
            (long long)rows, (long long)cols);
        return QL_EINVAL;
    }
    int rc = check_pristine(row, pristine, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    merge_job j;
    memset(&j, 0, sizeof j);
    j.row = row;
    j.pristine = pristine;
    j.out = out;
    j.rows = rows;
    j.cols = cols;
    j.n = rows * cols;
    j.stream = static_cast<cudaStream_t>(stream);
    j.msg = msg;
    j.msg_len = msg_len;
    rc = run_merge(j, terms, n_terms, report);
    if (rc != QL_OK) {
        /* nothing of a failed merge stays: wait for what is in flight
         * (host buffers, scratch), then free it and the output */
        (void)cudaStreamSynchronize(j.stream);
        (void)cudaGetLastError();
        if (j.out_allocated)
            (void)qt_cuda_tensor_release(out, nullptr, 0); /* msg keeps the first failure */
        memset(out, 0, sizeof *out);
        if (report)
            memset(report, 0, sizeof *report);
    }
    job_free(j);
    return rc;
}

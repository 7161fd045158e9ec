/*
 * qt_cuda_ops.cu - the row and pointwise operations of a decoder layer
 * (RMSNorm, RoPE, SwiGLU, residual and bias adds), the paged KV cache
 * writes, attention over the block tables, and the greedy token choice, on
 * the device. Contracts in qt_cuda_ops.h.
 *
 * Why shaped so:
 *   - The per-element arithmetic is kernels/math/ops_math.h's, the very functions
 *     engine/runtime/forward.c runs on the CPU, built with --fmad=false. RoPE, the
 *     adds, the RMSNorm apply step and argmax give the CPU's bits for the
 *     same inputs; RMSNorm's f64 sum of squares, silu's expf and attention's
 *     sums run in another order or with CUDA's expf, so they agree with the
 *     CPU within a rounding tolerance (tests/gpu/test_cuda_ops.c states it).
 *   - RMSNorm and argmax: one block per row, a fixed reduction tree
 *     (warp shuffles, then one warp over the warps' results), so a row's
 *     result never depends on the other rows or on timing.
 *   - Attention is memory bound (every K and V row of the context is read
 *     once per token), so it is shaped for bytes in flight:
 *       * one block per (row, kv head, split): the block takes all the
 *         query heads that share the kv head (GQA's group, up to the
 *         registers' limit), so each K and V row is read once for the group;
 *       * inside the block every warp takes tiles of U consecutive
 *         positions, loads their K and V rows together (float4 loads, the
 *         lanes split head_dim), reduces the U x heads dot products with
 *         interleaved xor shuffles (every lane ends with the same bits, so
 *         the online-softmax branches are warp-uniform), and keeps its own
 *         online-softmax state per head (ops_math.h's om_online_*); the
 *         warps' states then merge in shared memory in warp order;
 *       * when rows x kv heads would leave most SMs idle (decode of a few
 *         sequences), the positions of each row are split over up to 32
 *         blocks as in FlashDecoding (Dao et al. 2023): each writes its
 *         partial state (max, sum, unnormalised values) to a scratch from a
 *         stream-ordered memory pool of our own (release threshold
 *         unlimited, so the scratch is recycled, not re-mapped, each step),
 *         and a second kernel merges the splits in split order. Where the
 *         device has no memory pools, or the scratch cannot be had, the
 *         positions are not split: slower, never wrong.
 *     Prefill chunks use the same kernel: one launch per layer covers every
 *     row, each row causal up to its own position (its own sliding window).
 *     A tiled prefill kernel sharing K/V tiles across a chunk's rows (flash
 *     attention proper) is future work; rows of a chunk that run at once
 *     share those tiles through L2.
 *   - Never aborts: every argument is checked before anything is enqueued,
 *     every launch is checked with cudaGetLastError, and a failure becomes a
 *     QT_E* code with a sentence naming the call.
 */
#include "qt_cuda_ops.h"

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>

#include <cuda_runtime.h>

#include "ops_math.h"
#include "qt_cuda_internal.h"

namespace
{

constexpr int kThreads = 256;       /* pointwise kernels */
constexpr int kRowThreads = 256;    /* RMSNorm: one block per row */
constexpr int kArgmaxThreads = 512; /* a 150k vocabulary is ~300 logits a thread */
constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kMaxSplits = 32;
constexpr int kMaxHeadDim = 512; /* Gemma 4's full layers (global_head_dim) */
constexpr unsigned kFullMask = 0xffffffffu;

cudaStream_t as_stream(void *stream)
{
    return static_cast<cudaStream_t>(stream);
}

/* ---- reductions ---------------------------------------------------------------- */

/* The sum of v over the block (blockDim.x a multiple of 32, at most 1024),
 * the same bits in every thread: xor shuffles in each warp, then warp 0
 * over the warps' sums. */
__device__ double block_sum(double v, double *shared32)
{
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(kFullMask, v, off);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    if (lane == 0)
        shared32[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? shared32[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1)
            v += __shfl_xor_sync(kFullMask, v, off);
        if (lane == 0)
            shared32[32] = v;
    }
    __syncthreads();
    return shared32[32];
}

/* ---- pointwise and row kernels ------------------------------------------------- */

__global__ void rmsnorm_kernel(float *out, const float *x, const float *weight, int64_t n,
                               float eps)
{
    __shared__ double partial[33];
    const float *xr = x + (int64_t)blockIdx.x * n;
    float *o = out + (int64_t)blockIdx.x * n;
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        ss = om_sumsq_add(ss, xr[i]);
    ss = block_sum(ss, partial);
    float scale = om_rmsnorm_scale(ss, n, eps);
    /* every read of x above is before the block_sum barrier, so out may be x */
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        o[i] = om_rmsnorm_apply(xr[i], scale, weight[i]);
}

/* half: the rotated pairs of a head (rotary dims / 2; the rest of the
 * head passes through, partial rotary) and the tables' width. */
__global__ void rope_kernel(float *vec, const float *cos_tab, const float *sin_tab, int64_t rows,
                            int32_t n_heads, int32_t head_dim, int32_t half, bool interleaved)
{
    int64_t total = rows * n_heads * half;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int32_t i = (int32_t)(idx % half);
        int64_t row_head = idx / half;
        int64_t r = row_head / n_heads;
        float *v = vec + row_head * head_dim;
        int32_t a, b;
        om_rope_pair(i, half, interleaved, &a, &b);
        om_rope_rotate(&v[a], &v[b], cos_tab[r * half + i], sin_tab[r * half + i]);
    }
}

/* Qwen3.5's gated q_proj: each row's 2 d values, a head's query then its
 * gate, into q and gate. */
__global__ void split_gate_kernel(const float *src, float *q, float *gate, int64_t n, int32_t d)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * d;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t row = i / d, col = i % d;
        q[i] = src[2 * row * d + col];
        gate[i] = src[(2 * row + 1) * d + col];
    }
}

__global__ void gate_sigmoid_kernel(float *x, const float *gate, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= om_sigmoid(gate[i]);
}

__global__ void swiglu_kernel(float *gate, const float *up, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        gate[i] = om_swiglu(gate[i], up[i]);
}

__global__ void swiglu_oai_kernel(float *gate, const float *up, int64_t n, float alpha, float limit)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        gate[i] = om_swiglu_oai(gate[i], up[i], alpha, limit);
}

__global__ void geglu_kernel(float *gate, const float *up, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        gate[i] = om_geglu(gate[i], up[i]);
}

/* A layer's slice of each row's per-layer inputs (Gemma 4): gate is rows
 * x n, up rows of up_stride whose first n values pair with gate's. */
__global__ void geglu_strided_kernel(float *gate, const float *up, int64_t rows, int64_t n,
                                     int64_t up_stride)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * n;
         i += (int64_t)gridDim.x * blockDim.x)
        gate[i] = om_geglu(gate[i], up[(i / n) * up_stride + i % n]);
}

__global__ void scale_kernel(float *x, float s, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

__global__ void softcap_kernel(float *x, float cap, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = om_softcap(x[i], cap);
}

__global__ void add_kernel(float *x, const float *t, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] += t[i];
}

__global__ void add_bias_kernel(float *y, const float *bias, int64_t rows, int64_t n)
{
    int64_t total = rows * n;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] += bias[i % n];
}

__global__ void gather_f32_kernel(float *dst, const float *src, const int32_t *idx, int32_t div,
                                  int64_t rows, int64_t n)
{
    int64_t total = rows * n;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n;
        dst[i] = src[(int64_t)(idx[r] / div) * n + i % n];
    }
}

/* One thread per element of dst's touched rows: rows never repeat in idx,
 * so no two threads add into one element. */
__global__ void scatter_add_weighted_kernel(float *dst, const float *src, const int32_t *idx,
                                            int32_t div, const float *w, int64_t rows, int64_t n)
{
    int64_t total = rows * n;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n, to = idx ? (int64_t)(idx[r] / div) : r;
        dst[to * n + i % n] = om_weighted_add(dst[to * n + i % n], w[r], src[i]);
    }
}

/* ---- the paged cache ---------------------------------------------------------- */

/* Where K (v = 0) or V (v = 1) of layer l at position pos of the sequence
 * whose table is `table` starts: engine/kv_cache_internal.h's kv_at. */
__device__ __forceinline__ size_t kv_offset(const qt_cuda_kv &kv, const int32_t *table,
                                            int32_t layer, int v, int32_t pos)
{
    int32_t b = table[pos / kv.block_tokens], slot = pos % kv.block_tokens;
    return (size_t)b * kv.block_floats +
           ((size_t)layer * 2 + (size_t)v) * (size_t)kv.block_tokens * (size_t)kv.kv_dim +
           (size_t)slot * (size_t)kv.kv_dim;
}

__global__ void kv_write_kernel(qt_cuda_kv kv, int32_t layer, qt_cuda_step_rows sr, const float *k,
                                const float *v)
{
    int64_t total = sr.rows * kv.kv_dim;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = idx / kv.kv_dim, e = idx % kv.kv_dim;
        const int32_t *table = sr.block_tables + sr.bt_offset[sr.row_seq[r]];
        size_t at = kv_offset(kv, table, layer, 0, sr.row_pos[r]) + (size_t)e;
        kv.arena[at] = k[idx];
        kv.arena[at + (size_t)kv.block_tokens * (size_t)kv.kv_dim] = v[idx];
    }
}

/* ---- attention ----------------------------------------------------------------- */

struct attn_args {
    qt_cuda_kv kv;
    int32_t layer;
    qt_cuda_step_rows sr;
    const float *q;
    float *out;     /* the result, when n_splits is 1 */
    float *partial; /* [rows][n_heads][n_splits][2 + head_dim], when above 1 */
    int32_t n_heads, head_dim, group, window;
    int32_t n_chunks; /* blocks per kv head: ceil(group / HB) */
    int32_t n_splits;
    float scale;
    float softcap;      /* > 0: scores soft-capped (Gemma 2) */
    const float *sinks; /* [n_heads] or NULL: one more denominator term per head (GPT-OSS) */
};

/* VW consecutive floats from p (aligned to VW floats) into dst. */
template <int VW> __device__ __forceinline__ void load_vec(const float *p, float *dst)
{
    if constexpr (VW == 4) {
        float4 t = __ldg(reinterpret_cast<const float4 *>(p));
        dst[0] = t.x;
        dst[1] = t.y;
        dst[2] = t.z;
        dst[3] = t.w;
    } else if constexpr (VW == 2) {
        float2 t = __ldg(reinterpret_cast<const float2 *>(p));
        dst[0] = t.x;
        dst[1] = t.y;
    } else {
        dst[0] = __ldg(p);
    }
}

/*
 * One block per (row, kv head x head chunk, split). Lane `lane` of a warp
 * holds elements (c * 32 + lane) * VW + j, c < C, j < VW, of every vector
 * (those at or past head_dim are zero and never stored). HB query heads of
 * the kv head's group per block (the last chunk may have fewer: nh).
 */
template <int VW, int C, int HB>
__global__ void __launch_bounds__(kAttnThreads) attention_kernel(attn_args a)
{
    constexpr int EPL = VW * C;         /* elements per lane */
    constexpr int U = EPL >= 8 ? 2 : 4; /* positions per warp per step */
    extern __shared__ float smem[];

    const int64_t r = blockIdx.x;
    const int32_t d = a.head_dim;
    const int32_t kvh = (int32_t)blockIdx.y / a.n_chunks;
    const int32_t h0 = kvh * a.group + ((int32_t)blockIdx.y % a.n_chunks) * HB;
    const int32_t group_end = (kvh + 1) * a.group;
    const int32_t nh = group_end - h0 < HB ? group_end - h0 : HB;
    const int32_t split = (int32_t)blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;

    const int32_t pos = a.sr.row_pos[r];
    const int32_t *table = a.sr.block_tables + a.sr.bt_offset[a.sr.row_seq[r]];
    const int32_t first = om_attention_first(pos, a.window);
    /* this split's positions [lo, hi] */
    const int32_t n_pos = pos - first + 1;
    const int32_t per = (n_pos + a.n_splits - 1) / a.n_splits;
    const int32_t lo = first + split * per;
    const int32_t hi = lo + per - 1 < pos ? lo + per - 1 : pos;

    float q[HB][EPL], acc[HB][EPL];
    om_online st[HB];
#pragma unroll
    for (int h = 0; h < HB; h++) {
        st[h] = om_online_start();
#pragma unroll
        for (int c = 0; c < C; c++) {
            int32_t e0 = (c * 32 + lane) * VW;
#pragma unroll
            for (int j = 0; j < VW; j++) {
                q[h][c * VW + j] = 0.0f;
                acc[h][c * VW + j] = 0.0f;
            }
            if (h < nh && e0 < d)
                load_vec<VW>(a.q + (r * a.n_heads + h0 + h) * d + e0, &q[h][c * VW]);
        }
    }

    const size_t head_off = (size_t)kvh * (size_t)d;
    const size_t v_off = (size_t)a.kv.block_tokens * (size_t)a.kv.kv_dim;
    for (int32_t p0 = lo + warp * U; p0 <= hi; p0 += n_warps * U) {
        float kr[U][EPL], vr[U][EPL];
        /* K and V rows of the tile, all loads issued before any use */
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int e = 0; e < EPL; e++) {
                kr[u][e] = 0.0f;
                vr[u][e] = 0.0f;
            }
            if (p0 + u <= hi) {
                const float *base =
                    a.kv.arena + kv_offset(a.kv, table, a.layer, 0, p0 + u) + head_off;
#pragma unroll
                for (int c = 0; c < C; c++) {
                    int32_t e0 = (c * 32 + lane) * VW;
                    if (e0 < d) {
                        load_vec<VW>(base + e0, &kr[u][c * VW]);
                        load_vec<VW>(base + v_off + e0, &vr[u][c * VW]);
                    }
                }
            }
        }
        /* the U x HB dot products, reduced across the warp together */
        float dot[HB][U];
#pragma unroll
        for (int h = 0; h < HB; h++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; e++)
                    s += q[h][e] * kr[u][e];
                dot[h][u] = s;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int h = 0; h < HB; h++) {
#pragma unroll
                for (int u = 0; u < U; u++)
                    dot[h][u] += __shfl_xor_sync(kFullMask, dot[h][u], off);
            }
        }
        /* the online softmax, position by position (warp-uniform branches:
         * every lane holds the same score bits) */
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (p0 + u > hi)
                break;
#pragma unroll
            for (int h = 0; h < HB; h++) {
                if (h >= nh)
                    break;
                float score = dot[h][u] * a.scale;
                if (a.softcap > 0.0f)
                    score = om_softcap(score, a.softcap);
                float f;
                if (om_online_raise(&st[h], score, &f)) {
#pragma unroll
                    for (int e = 0; e < EPL; e++)
                        acc[h][e] *= f;
                }
                float w = om_online_weight(&st[h], score);
#pragma unroll
                for (int e = 0; e < EPL; e++)
                    acc[h][e] = om_online_acc(acc[h][e], w, vr[u][e]);
            }
        }
    }

    /* the warps' states into shared memory: [n_warps][HB] (max, sum), then
     * [n_warps][HB][d] accumulators */
    float *stats = smem;
    float *accs = smem + 2 * n_warps * HB;
#pragma unroll
    for (int h = 0; h < HB; h++) {
        if (h >= nh)
            break;
        if (lane == 0) {
            stats[2 * (warp * HB + h)] = st[h].max;
            stats[2 * (warp * HB + h) + 1] = st[h].sum;
        }
#pragma unroll
        for (int c = 0; c < C; c++) {
            int32_t e0 = (c * 32 + lane) * VW;
            if (e0 < d) {
#pragma unroll
                for (int j = 0; j < VW; j++)
                    accs[(size_t)(warp * HB + h) * d + e0 + j] = acc[h][c * VW + j];
            }
        }
    }
    __syncthreads();

    /* merge them in warp order, one output element per thread */
    for (int32_t idx = threadIdx.x; idx < nh * d; idx += blockDim.x) {
        int32_t h = idx / d, e = idx % d;
        om_online m = {stats[2 * h], stats[2 * h + 1]};
        float av = accs[(size_t)h * d + e];
        for (int w = 1; w < n_warps; w++) {
            om_online b = {stats[2 * (w * HB + h)], stats[2 * (w * HB + h) + 1]};
            float fa, fb;
            om_online_merge(&m, b, &fa, &fb);
            av = om_online_merge_acc(av, fa, accs[(size_t)(w * HB + h) * d + e], fb);
        }
        int64_t row_head = r * a.n_heads + h0 + h;
        if (a.n_splits == 1) {
            if (a.sinks)
                av *= om_online_sink(&m, a.sinks[h0 + h]);
            a.out[row_head * d + e] = om_online_out(av, m.sum);
        } else {
            float *part = a.partial + ((size_t)row_head * a.n_splits + split) * (size_t)(d + 2);
            part[2 + e] = av;
            if (e == 0) {
                part[0] = m.max;
                part[1] = m.sum;
            }
        }
    }
}

/* The splits of each (row, head) merged in split order: one block per (row,
 * head), one thread per element. */
__global__ void attention_merge_kernel(const float *partial, float *out, int32_t head_dim,
                                       int32_t n_splits, int32_t n_heads, const float *sinks)
{
    const int32_t d = head_dim;
    const float *base = partial + (size_t)blockIdx.x * n_splits * (size_t)(d + 2);
    for (int32_t e = threadIdx.x; e < d; e += blockDim.x) {
        om_online m = {base[0], base[1]};
        float av = base[2 + e];
        for (int32_t s = 1; s < n_splits; s++) {
            const float *p = base + (size_t)s * (d + 2);
            om_online b = {p[0], p[1]};
            float fa, fb;
            om_online_merge(&m, b, &fa, &fb);
            av = om_online_merge_acc(av, fa, p[2 + e], fb);
        }
        if (sinks)
            av *= om_online_sink(&m, sinks[blockIdx.x % n_heads]);
        out[(size_t)blockIdx.x * d + e] = om_online_out(av, m.sum);
    }
}

/* ---- greedy token choice --------------------------------------------------------- */

struct best_logit {
    float v;
    int32_t id;
};

__device__ __forceinline__ void consider(best_logit &b, float v, int32_t id)
{
    if (om_greedy_better(v, id, b.v, b.id)) {
        b.v = v;
        b.id = id;
    }
}

__device__ __forceinline__ void consider_lanes(best_logit &b)
{
    for (int off = 16; off > 0; off >>= 1) {
        float v = __shfl_xor_sync(kFullMask, b.v, off);
        int32_t id = __shfl_xor_sync(kFullMask, b.id, off);
        consider(b, v, id);
    }
}

__global__ void argmax_kernel(const float *logits, int64_t vocab, int32_t *tokens)
{
    __shared__ best_logit warps[32];
    const float *row = logits + (int64_t)blockIdx.x * vocab;
    /* (NaN, INT32_MAX) loses to every entry */
    best_logit b = {__int_as_float(0x7fc00000), INT32_MAX};
    int64_t i = threadIdx.x;
    if (vocab % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
        const float4 *row4 = reinterpret_cast<const float4 *>(row);
        for (; i < vocab / 4; i += blockDim.x) {
            float4 t = row4[i];
            int32_t id = (int32_t)(4 * i);
            consider(b, t.x, id);
            consider(b, t.y, id + 1);
            consider(b, t.z, id + 2);
            consider(b, t.w, id + 3);
        }
    } else {
        for (; i < vocab; i += blockDim.x)
            consider(b, row[i], (int32_t)i);
    }
    consider_lanes(b);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    if (lane == 0)
        warps[warp] = b;
    __syncthreads();
    if (warp == 0) {
        best_logit w =
            lane < n_warps ? warps[lane] : best_logit{__int_as_float(0x7fc00000), INT32_MAX};
        consider_lanes(w);
        if (lane == 0)
            tokens[blockIdx.x] = w.id;
    }
}

/* ---- attention launch ---------------------------------------------------------- */

/* A stream-ordered pool per device for the split scratch: its release
 * threshold is unlimited, so the few hundred KB a step needs stay mapped
 * and are recycled (the default pool would give them back to the driver at
 * every synchronisation). Created on first use, kept for the process. */
constexpr int kMaxDevices = 64;

struct device_state {
    std::once_flag once;
    int sms = 0;
    cudaMemPool_t pool = nullptr;
};

device_state g_devices[kMaxDevices];

void init_device(device_state *ds, int dev)
{
    int sms = 0, pools = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        sms = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev) != cudaSuccess)
        pools = 0;
    ds->sms = sms;
    if (pools) {
        cudaMemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = cudaMemAllocationTypePinned;
        props.handleTypes = cudaMemHandleTypeNone;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = dev;
        cudaMemPool_t pool = nullptr;
        if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
            uint64_t keep = UINT64_MAX;
            if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) ==
                cudaSuccess)
                ds->pool = pool;
            else
                (void)cudaMemPoolDestroy(pool);
        }
    }
    /* a failed query above is not this call's error to report */
    (void)cudaGetLastError();
}

/* The current device's state, or NULL (and msg) when there is none. */
int current_device(device_state **out, char *msg, size_t msg_len)
{
    int dev = 0;
    cudaError_t st = cudaGetDevice(&dev);
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "qt_cuda_attention: cudaGetDevice");
    if (dev < 0 || dev >= kMaxDevices)
        return invalid(msg, msg_len, "qt_cuda_attention: device %d is past the %d supported", dev,
                       kMaxDevices);
    device_state *ds = &g_devices[dev];
    std::call_once(ds->once, init_device, ds, dev);
    *out = ds;
    return QL_OK;
}

/* The widest loads the layout allows and the lanes' share of head_dim. */
struct attn_shape {
    int vw, c;
};

attn_shape pick_shape(const qt_cuda_kv *kv, const float *q, const float *out, int32_t d)
{
    bool a4 = d % 4 == 0 && kv->kv_dim % 4 == 0 && kv->block_floats % 4 == 0 &&
              aligned(kv->arena, 16) && aligned(q, 16) && aligned(out, 16);
    bool a2 = d % 2 == 0 && kv->kv_dim % 2 == 0 && kv->block_floats % 2 == 0 &&
              aligned(kv->arena, 8) && aligned(q, 8) && aligned(out, 8);
    if (a2 && d <= 64)
        return {2, 1};
    if (a4 && d <= 128)
        return {4, 1};
    if (a4 && d <= 256)
        return {4, 2};
    if (a4) /* Gemma 4's full layers, up to 512: four float4 a lane */
        return {4, 4};
    return d <= 256 ? attn_shape{1, 8} : attn_shape{1, 16};
}

template <int VW, int C, int HB>
void launch_attention_hb(const attn_args &a, dim3 grid, size_t smem, cudaStream_t s)
{
    attention_kernel<VW, C, HB><<<grid, kAttnThreads, smem, s>>>(a);
}

template <int VW, int C>
void launch_attention_vc(const attn_args &a, int hb, dim3 grid, cudaStream_t s)
{
    size_t smem = (size_t)kAttnWarps * (size_t)hb * (size_t)(2 + a.head_dim) * sizeof(float);
    switch (hb) {
    case 1: launch_attention_hb<VW, C, 1>(a, grid, smem, s); break;
    case 2: launch_attention_hb<VW, C, 2>(a, grid, smem, s); break;
    case 4:
        if constexpr (VW * C <= 8) /* hb_cap: 32 accumulators a lane */
            launch_attention_hb<VW, C, 4>(a, grid, smem, s);
        break;
    default:
        if constexpr (VW * C <= 4)
            launch_attention_hb<VW, C, 8>(a, grid, smem, s);
        break;
    }
}

} // namespace

/* ---- the API -------------------------------------------------------------------- */

extern "C" int qt_cuda_rmsnorm(float *out, const float *x, const float *weight, int64_t rows,
                               int64_t n, float eps, void *stream, char *msg, size_t msg_len)
{
    if (rows < 0 || n < 0 || rows > INT32_MAX)
        return invalid(msg, msg_len, "qt_cuda_rmsnorm: %lld rows of %lld is not a valid shape",
                       (long long)rows, (long long)n);
    if (rows == 0 || n == 0)
        return QL_OK;
    if (!out || !x || !weight)
        return invalid(msg, msg_len, "qt_cuda_rmsnorm: out, x or weight is NULL");
    rmsnorm_kernel<<<(unsigned)rows, kRowThreads, 0, as_stream(stream)>>>(out, x, weight, n, eps);
    return launched(msg, msg_len, "qt_cuda_rmsnorm kernel");
}

extern "C" int qt_cuda_rope(float *vec, const float *cos_tab, const float *sin_tab, int64_t rows,
                            int32_t n_heads, int32_t head_dim, bool interleaved, void *stream,
                            char *msg, size_t msg_len)
{
    return qt_cuda_rope_partial(vec, cos_tab, sin_tab, rows, n_heads, head_dim, head_dim,
                                interleaved, stream, msg, msg_len);
}

extern "C" int qt_cuda_rope_partial(float *vec, const float *cos_tab, const float *sin_tab,
                                    int64_t rows, int32_t n_heads, int32_t head_dim,
                                    int32_t rot_dims, bool interleaved, void *stream, char *msg,
                                    size_t msg_len)
{
    if (rows < 0 || n_heads < 0 || head_dim < 0 || rot_dims < 0 || rot_dims % 2 != 0 ||
        rot_dims > head_dim)
        return invalid(msg, msg_len,
                       "qt_cuda_rope: %lld rows of %d heads of %d, %d rotated (rotated dims "
                       "even and within the head)",
                       (long long)rows, n_heads, head_dim, rot_dims);
    if (rows == 0 || n_heads == 0 || rot_dims == 0)
        return QL_OK;
    if (!vec || !cos_tab || !sin_tab)
        return invalid(msg, msg_len, "qt_cuda_rope: vec, cos_tab or sin_tab is NULL");
    int64_t pairs = rows * n_heads * (rot_dims / 2);
    rope_kernel<<<grid_for(pairs, kThreads), kThreads, 0, as_stream(stream)>>>(
        vec, cos_tab, sin_tab, rows, n_heads, head_dim, rot_dims / 2, interleaved);
    return launched(msg, msg_len, "qt_cuda_rope kernel");
}

/* The checks of a pointwise entry over n floats: QL_OK with *run false
 * when there is nothing to do. */
static int pointwise_check(const char *name, int64_t n, bool buffers, bool *run, char *msg,
                           size_t msg_len)
{
    *run = false;
    if (n < 0)
        return invalid(msg, msg_len, "%s: n %lld is negative", name, (long long)n);
    if (n == 0)
        return QL_OK;
    if (!buffers)
        return invalid(msg, msg_len, "%s: a buffer is NULL", name);
    *run = true;
    return QL_OK;
}

extern "C" int qt_cuda_split_gate(const float *src, float *q, float *gate, int64_t n, int32_t d,
                                  void *stream, char *msg, size_t msg_len)
{
    bool run;
    int rc = pointwise_check("qt_cuda_split_gate", d < 0 ? -1 : n * d, src && q && gate, &run, msg,
                             msg_len);
    if (rc != QL_OK || !run)
        return rc;
    split_gate_kernel<<<grid_for(n * d, kThreads), kThreads, 0, as_stream(stream)>>>(src, q, gate,
                                                                                     n, d);
    return launched(msg, msg_len, "qt_cuda_split_gate kernel");
}

extern "C" int qt_cuda_gate_sigmoid(float *x, const float *gate, int64_t n, void *stream, char *msg,
                                    size_t msg_len)
{
    bool run;
    int rc = pointwise_check("qt_cuda_gate_sigmoid", n, x && gate, &run, msg, msg_len);
    if (rc != QL_OK || !run)
        return rc;
    gate_sigmoid_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(x, gate, n);
    return launched(msg, msg_len, "qt_cuda_gate_sigmoid kernel");
}

extern "C" int qt_cuda_geglu(float *gate, const float *up, int64_t n, void *stream, char *msg,
                             size_t msg_len)
{
    bool run;
    int rc = pointwise_check("qt_cuda_geglu", n, gate && up, &run, msg, msg_len);
    if (rc != QL_OK || !run)
        return rc;
    geglu_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(gate, up, n);
    return launched(msg, msg_len, "qt_cuda_geglu kernel");
}

extern "C" int qt_cuda_geglu_strided(float *gate, const float *up, int64_t rows, int64_t n,
                                     int64_t up_stride, void *stream, char *msg, size_t msg_len)
{
    bool run;
    if (n < 0 || up_stride < n)
        return invalid(msg, msg_len, "qt_cuda_geglu_strided: %lld values a row, stride %lld",
                       (long long)n, (long long)up_stride);
    int rc = pointwise_check("qt_cuda_geglu_strided", rows * n, gate && up, &run, msg, msg_len);
    if (rc != QL_OK || !run)
        return rc;
    geglu_strided_kernel<<<grid_for(rows * n, kThreads), kThreads, 0, as_stream(stream)>>>(
        gate, up, rows, n, up_stride);
    return launched(msg, msg_len, "qt_cuda_geglu_strided kernel");
}

extern "C" int qt_cuda_scale(float *x, float s, int64_t n, void *stream, char *msg, size_t msg_len)
{
    bool run;
    int rc = pointwise_check("qt_cuda_scale", n, x != nullptr, &run, msg, msg_len);
    if (rc != QL_OK || !run)
        return rc;
    scale_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(x, s, n);
    return launched(msg, msg_len, "qt_cuda_scale kernel");
}

extern "C" int qt_cuda_softcap(float *x, float cap, int64_t n, void *stream, char *msg,
                               size_t msg_len)
{
    if (!(cap > 0.0f))
        return invalid(msg, msg_len, "qt_cuda_softcap: cap %g is not positive", (double)cap);
    bool run;
    int rc = pointwise_check("qt_cuda_softcap", n, x != nullptr, &run, msg, msg_len);
    if (rc != QL_OK || !run)
        return rc;
    softcap_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(x, cap, n);
    return launched(msg, msg_len, "qt_cuda_softcap kernel");
}

extern "C" int qt_cuda_swiglu(float *gate, const float *up, int64_t n, void *stream, char *msg,
                              size_t msg_len)
{
    if (n < 0)
        return invalid(msg, msg_len, "qt_cuda_swiglu: n %lld is negative", (long long)n);
    if (n == 0)
        return QL_OK;
    if (!gate || !up)
        return invalid(msg, msg_len, "qt_cuda_swiglu: gate or up is NULL");
    swiglu_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(gate, up, n);
    return launched(msg, msg_len, "qt_cuda_swiglu kernel");
}

extern "C" int qt_cuda_swiglu_oai(float *gate, const float *up, int64_t n, float alpha, float limit,
                                  void *stream, char *msg, size_t msg_len)
{
    bool run;
    int rc = pointwise_check("qt_cuda_swiglu_oai", n, gate && up, &run, msg, msg_len);
    if (rc != QL_OK || !run)
        return rc;
    swiglu_oai_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(gate, up, n, alpha,
                                                                                 limit);
    return launched(msg, msg_len, "qt_cuda_swiglu_oai kernel");
}

extern "C" int qt_cuda_add(float *x, const float *t, int64_t n, void *stream, char *msg,
                           size_t msg_len)
{
    if (n < 0)
        return invalid(msg, msg_len, "qt_cuda_add: n %lld is negative", (long long)n);
    if (n == 0)
        return QL_OK;
    if (!x || !t)
        return invalid(msg, msg_len, "qt_cuda_add: x or t is NULL");
    add_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(x, t, n);
    return launched(msg, msg_len, "qt_cuda_add kernel");
}

extern "C" int qt_cuda_add_bias(float *y, const float *bias, int64_t rows, int64_t n, void *stream,
                                char *msg, size_t msg_len)
{
    if (rows < 0 || n < 0)
        return invalid(msg, msg_len, "qt_cuda_add_bias: %lld rows of %lld is not a valid shape",
                       (long long)rows, (long long)n);
    if (rows == 0 || n == 0)
        return QL_OK;
    if (!y || !bias)
        return invalid(msg, msg_len, "qt_cuda_add_bias: y or bias is NULL");
    add_bias_kernel<<<grid_for(rows * n, kThreads), kThreads, 0, as_stream(stream)>>>(y, bias, rows,
                                                                                      n);
    return launched(msg, msg_len, "qt_cuda_add_bias kernel");
}

extern "C" int qt_cuda_gather_f32(float *dst, const float *src, const int32_t *idx, int32_t div,
                                  int64_t rows, int64_t n, void *stream, char *msg, size_t msg_len)
{
    if (rows < 0 || n < 0 || div < 1)
        return invalid(msg, msg_len, "qt_cuda_gather_f32: %lld rows of %lld, divisor %d",
                       (long long)rows, (long long)n, div);
    if (rows == 0 || n == 0)
        return QL_OK;
    if (!dst || !src || !idx)
        return invalid(msg, msg_len, "qt_cuda_gather_f32: dst, src or idx is NULL");
    gather_f32_kernel<<<grid_for(rows * n, kThreads), kThreads, 0, as_stream(stream)>>>(
        dst, src, idx, div, rows, n);
    return launched(msg, msg_len, "qt_cuda_gather_f32 kernel");
}

extern "C" int qt_cuda_scatter_add_weighted(float *dst, const float *src, const int32_t *idx,
                                            int32_t div, const float *w, int64_t rows, int64_t n,
                                            void *stream, char *msg, size_t msg_len)
{
    if (rows < 0 || n < 0 || div < 1)
        return invalid(msg, msg_len, "qt_cuda_scatter_add_weighted: %lld rows of %lld, divisor %d",
                       (long long)rows, (long long)n, div);
    if (rows == 0 || n == 0)
        return QL_OK;
    if (!dst || !src || !w)
        return invalid(msg, msg_len, "qt_cuda_scatter_add_weighted: dst, src or w is NULL");
    scatter_add_weighted_kernel<<<grid_for(rows * n, kThreads), kThreads, 0, as_stream(stream)>>>(
        dst, src, idx, div, w, rows, n);
    return launched(msg, msg_len, "qt_cuda_scatter_add_weighted kernel");
}

/* The cache and step-rows arguments both kernels over the cache need. */
static int check_cache(const char *fn, const qt_cuda_kv *kv, int32_t layer,
                       const qt_cuda_step_rows *sr, char *msg, size_t msg_len)
{
    if (!kv || !sr)
        return invalid(msg, msg_len, "%s: kv or step rows is NULL", fn);
    if (sr->rows < 0 || sr->rows > INT32_MAX)
        return invalid(msg, msg_len, "%s: %lld rows", fn, (long long)sr->rows);
    if (sr->rows == 0)
        return QL_OK;
    if (!kv->arena || !sr->row_seq || !sr->row_pos || !sr->bt_offset || !sr->block_tables)
        return invalid(msg, msg_len, "%s: the arena or a step-rows array is NULL", fn);
    if (kv->block_tokens <= 0 || kv->n_layers <= 0 || kv->kv_dim <= 0)
        return invalid(msg, msg_len, "%s: cache of %d-token blocks, %d layers, kv_dim %lld", fn,
                       kv->block_tokens, kv->n_layers, (long long)kv->kv_dim);
    if (layer < 0 || layer >= kv->n_layers)
        return invalid(msg, msg_len, "%s: layer %d is outside the cache's %d", fn, layer,
                       kv->n_layers);
    size_t need = (size_t)kv->n_layers * 2 * (size_t)kv->block_tokens * (size_t)kv->kv_dim;
    if (kv->block_floats < need)
        return invalid(msg, msg_len, "%s: block_floats %zu is less than the %zu a block holds", fn,
                       kv->block_floats, need);
    return QL_OK;
}

extern "C" int qt_cuda_kv_write(const qt_cuda_kv *kv, int32_t layer, const qt_cuda_step_rows *sr,
                                const float *k, const float *v, void *stream, char *msg,
                                size_t msg_len)
{
    int rc = check_cache("qt_cuda_kv_write", kv, layer, sr, msg, msg_len);
    if (rc != QL_OK || sr->rows == 0)
        return rc;
    if (!k || !v)
        return invalid(msg, msg_len, "qt_cuda_kv_write: k or v is NULL");
    int64_t total = sr->rows * kv->kv_dim;
    kv_write_kernel<<<grid_for(total, kThreads), kThreads, 0, as_stream(stream)>>>(*kv, layer, *sr,
                                                                                   k, v);
    return launched(msg, msg_len, "qt_cuda_kv_write kernel");
}

extern "C" int qt_cuda_attention(const qt_cuda_kv *kv, int32_t layer, const qt_cuda_step_rows *sr,
                                 const float *q, float *out, int32_t n_heads, int32_t n_kv_heads,
                                 int32_t head_dim, int32_t sliding_window, void *stream, char *msg,
                                 size_t msg_len)
{
    return qt_cuda_attention_ex(kv, layer, sr, q, out, n_heads, n_kv_heads, head_dim,
                                sliding_window, om_attention_scale(head_dim), 0.0f, nullptr, stream,
                                msg, msg_len);
}

extern "C" int qt_cuda_attention_ex(const qt_cuda_kv *kv, int32_t layer,
                                    const qt_cuda_step_rows *sr, const float *q, float *out,
                                    int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                    int32_t sliding_window, float scale, float softcap,
                                    const float *sinks, void *stream, char *msg, size_t msg_len)
{
    int rc = check_cache("qt_cuda_attention", kv, layer, sr, msg, msg_len);
    if (rc != QL_OK || sr->rows == 0)
        return rc;
    if (!q || !out)
        return invalid(msg, msg_len, "qt_cuda_attention: q or out is NULL");
    if (head_dim <= 0 || head_dim > kMaxHeadDim)
        return invalid(msg, msg_len, "qt_cuda_attention: head_dim %d is outside [1, %d]", head_dim,
                       kMaxHeadDim);
    if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
        return invalid(msg, msg_len,
                       "qt_cuda_attention: %d heads do not split into groups over %d kv heads",
                       n_heads, n_kv_heads);
    if ((int64_t)n_kv_heads * head_dim != kv->kv_dim)
        return invalid(msg, msg_len,
                       "qt_cuda_attention: %d kv heads of %d is not the cache's kv_dim %lld",
                       n_kv_heads, head_dim, (long long)kv->kv_dim);
    if (sliding_window < 0)
        return invalid(msg, msg_len, "qt_cuda_attention: sliding window %d is negative",
                       sliding_window);
    device_state *ds = nullptr;
    rc = current_device(&ds, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    attn_shape shape = pick_shape(kv, q, out, head_dim);
    int epl = shape.vw * shape.c;
    int32_t group = n_heads / n_kv_heads;
    /* heads per block: the group, rounded up to a power of two, within 32
     * accumulator registers a lane */
    int hb_cap = 32 / epl < 8 ? 32 / epl : 8;
    int hb = 1;
    while (hb < group && hb < hb_cap)
        hb *= 2;
    int32_t n_chunks = (group + hb - 1) / hb;
    int64_t y_blocks = (int64_t)n_kv_heads * n_chunks;
    if (y_blocks > 65535)
        return invalid(msg, msg_len, "qt_cuda_attention: %d kv heads x %d head chunks is too many",
                       n_kv_heads, n_chunks);

    /* split the positions when the blocks would not fill two waves of SMs */
    int64_t blocks = sr->rows * y_blocks;
    int32_t n_splits = 1;
    if (ds->pool && ds->sms > 0 && blocks < 2 * (int64_t)ds->sms) {
        int64_t want = (2 * (int64_t)ds->sms + blocks - 1) / blocks;
        n_splits = (int32_t)(want < kMaxSplits ? want : kMaxSplits);
    }

    cudaStream_t s = as_stream(stream);
    attn_args a;
    a.kv = *kv;
    a.layer = layer;
    a.sr = *sr;
    a.q = q;
    a.out = out;
    a.partial = nullptr;
    a.n_heads = n_heads;
    a.head_dim = head_dim;
    a.group = group;
    a.window = sliding_window;
    a.n_chunks = n_chunks;
    a.n_splits = 1;
    a.scale = scale;
    a.softcap = softcap;
    a.sinks = sinks;

    size_t partial_bytes = 0;
    if (n_splits > 1) {
        partial_bytes = (size_t)sr->rows * (size_t)n_heads * (size_t)n_splits *
                        (size_t)(head_dim + 2) * sizeof(float);
        void *p = nullptr;
        if (cudaMallocFromPoolAsync(&p, partial_bytes, ds->pool, s) == cudaSuccess) {
            a.partial = static_cast<float *>(p);
            a.n_splits = n_splits;
        } else {
            (void)cudaGetLastError(); /* no scratch: one block per row and head chunk */
        }
    }

    dim3 grid((unsigned)sr->rows, (unsigned)y_blocks, (unsigned)a.n_splits);
    if (shape.vw == 4 && shape.c == 1)
        launch_attention_vc<4, 1>(a, hb, grid, s);
    else if (shape.vw == 4 && shape.c == 2)
        launch_attention_vc<4, 2>(a, hb, grid, s);
    else if (shape.vw == 4)
        launch_attention_vc<4, 4>(a, hb, grid, s);
    else if (shape.vw == 2)
        launch_attention_vc<2, 1>(a, hb, grid, s);
    else if (shape.c == 8)
        launch_attention_vc<1, 8>(a, hb, grid, s);
    else
        launch_attention_vc<1, 16>(a, hb, grid, s);
    rc = launched(msg, msg_len, "qt_cuda_attention kernel");
    if (rc == QL_OK && a.n_splits > 1) {
        int threads = (head_dim + 31) / 32 * 32;
        attention_merge_kernel<<<(unsigned)(sr->rows * n_heads), threads, 0, s>>>(
            a.partial, out, head_dim, a.n_splits, n_heads, sinks);
        rc = launched(msg, msg_len, "qt_cuda_attention merge kernel");
    }
    if (a.partial) {
        cudaError_t st = cudaFreeAsync(a.partial, s);
        if (st != cudaSuccess && rc == QL_OK)
            rc = cuda_failed(st, msg, msg_len, "qt_cuda_attention: cudaFreeAsync(%zu bytes)",
                             partial_bytes);
    }
    return rc;
}

extern "C" int qt_cuda_argmax(const float *logits, int64_t rows, int64_t vocab, int32_t *tokens,
                              void *stream, char *msg, size_t msg_len)
{
    if (rows < 0 || rows > INT32_MAX || vocab <= 0 || vocab > INT32_MAX)
        return invalid(msg, msg_len, "qt_cuda_argmax: %lld rows of %lld logits", (long long)rows,
                       (long long)vocab);
    if (rows == 0)
        return QL_OK;
    if (!logits || !tokens)
        return invalid(msg, msg_len, "qt_cuda_argmax: logits or tokens is NULL");
    argmax_kernel<<<(unsigned)rows, kArgmaxThreads, 0, as_stream(stream)>>>(logits, vocab, tokens);
    return launched(msg, msg_len, "qt_cuda_argmax kernel");
}

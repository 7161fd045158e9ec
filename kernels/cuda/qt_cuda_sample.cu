/*
 * qt_cuda_sample.cu - the temperature draw of qt_cuda_sample.h: one block
 * per row finds the largest logit (the sampler's order: NaN below
 * everything, -0 below +0) and the first id holding it, sums the weights
 * of each block of QM_SAMPLE_BLOCK ids in parallel (each sum in the CPU's
 * order), and one thread walks the sums to the token, all with
 * sample_math.h's functions: the CPU sampler's bits, so the same seed
 * gives the same tokens on either backend.
 */
#include <cuda_runtime.h>

#include "qt_cuda_internal.h"
#include "qt_cuda_sample.h"
#include "qtensor.h"
#include "sample_math.h"

namespace
{

constexpr int kThreads = 256;
constexpr size_t kMaxSharedBytes = 48 * 1024; /* without opting in to more */

__global__ void __launch_bounds__(kThreads)
    sample_rows(const float *logits, int64_t vocab, const float *inv_temperature, const double *u,
                int32_t *tokens)
{
    extern __shared__ double sums[];
    __shared__ uint32_t keys[kThreads];
    __shared__ int64_t firsts[kThreads];
    int64_t r = blockIdx.x;
    int tid = threadIdx.x;
    float inv_t = inv_temperature[r];
    if (!(inv_t > 0.0f))
        return; /* a greedy row: the argmax is there already */
    const float *row = logits + r * vocab;

    // the largest key
    uint32_t key = 0;
    for (int64_t i = tid; i < vocab; i += kThreads) {
        uint32_t k = qm_order_key(row[i]);
        key = k > key ? k : key;
    }
    keys[tid] = key;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
        if (tid < half && keys[tid + half] > keys[tid])
            keys[tid] = keys[tid + half];
        __syncthreads();
    }
    uint32_t best_key = keys[0];
    if (best_key == 0) { /* every logit NaN */
        if (tid == 0)
            tokens[r] = 0;
        return;
    }

    // the first id equal to it
    float v = qm_key_float(best_key);
    int64_t first = vocab;
    for (int64_t i = tid; i < vocab; i += kThreads)
        if (row[i] == v) {
            first = i;
            break;
        }
    firsts[tid] = first;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
        if (tid < half && firsts[tid + half] < firsts[tid])
            firsts[tid] = firsts[tid + half];
        __syncthreads();
    }
    int64_t best = firsts[0];
    float m = row[best];
    if (qm_f32_bits(m) == (QM_F32_INF_BITS | 0x80000000u)) {
        if (tid == 0)
            tokens[r] = (int32_t)best;
        return;
    }

    // the block sums, then the walk
    int64_t n_blocks = (vocab + QM_SAMPLE_BLOCK - 1) / QM_SAMPLE_BLOCK;
    for (int64_t b = tid; b < n_blocks; b += kThreads) {
        int64_t lo = b * QM_SAMPLE_BLOCK;
        int64_t hi = lo + QM_SAMPLE_BLOCK < vocab ? lo + QM_SAMPLE_BLOCK : vocab;
        sums[b] = qm_sample_block_sum(row, lo, hi, m, inv_t);
    }
    __syncthreads();
    if (tid == 0)
        tokens[r] = qm_sample_pick(row, vocab, m, inv_t, u[r], sums);
}

} // namespace

extern "C" int qt_cuda_sample(const float *logits, int64_t rows, int64_t vocab,
                              const float *inv_temperature, const double *u, int32_t *tokens,
                              void *stream, char *msg, size_t msg_len)
{
    if (rows < 0 || vocab < 1 || (rows > 0 && (!logits || !inv_temperature || !u || !tokens))) {
        say(msg, msg_len, "qt_cuda_sample: %lld rows of %lld logits", (long long)rows,
            (long long)vocab);
        return QL_EINVAL;
    }
    size_t shared = (size_t)ceil_div(vocab, QM_SAMPLE_BLOCK) * sizeof(double);
    if (shared > kMaxSharedBytes) {
        say(msg, msg_len,
            "qt_cuda_sample: a vocabulary of %lld is past the %zu block sums one block holds",
            (long long)vocab, kMaxSharedBytes / sizeof(double));
        return QL_EINVAL;
    }
    if (rows == 0)
        return QL_OK;
    if (rows > 0x7fffffff) {
        say(msg, msg_len, "qt_cuda_sample: %lld rows", (long long)rows);
        return QL_EINVAL;
    }
    sample_rows<<<(unsigned)rows, kThreads, shared, static_cast<cudaStream_t>(stream)>>>(
        logits, vocab, inv_temperature, u, tokens);
    cudaError_t st = cudaGetLastError();
    if (st != cudaSuccess) {
        say(msg, msg_len, "qt_cuda_sample: launching the draw of %lld rows: %s (%s)",
            (long long)rows, cudaGetErrorString(st), cudaGetErrorName(st));
        return code_for_cuda_status(st);
    }
    return QL_OK;
}

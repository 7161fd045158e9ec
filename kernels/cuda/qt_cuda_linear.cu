/*
 * qt_cuda_linear.cu - Qwen3.5's hybrid layers on the device (qt_cuda_ops.h's
 * Gated DeltaNet section; the arithmetic is engine/model/hybrid.h's): the
 * gates beta and decay, the causal depthwise conv1d carried on from each
 * sequence's window, the L2-normalized q and k, the gated delta rule over
 * each (sequence, value head)'s k x v state, the gated RMSNorm. (The
 * full layers' output gate is pointwise: qt_cuda_ops.cu.)
 *
 * Why shaped so: the CPU backend (engine/runtime/linear_cpu.c) is the
 * reference, and every value here is computed in its order of float
 * operations so the two differ only where expf and log1pf do (libm's on
 * the host, CUDA's within 2 ulp on a device; the emulator runs libm's, so
 * there the whole layer is the CPU's bits):
 *   - the conv: one thread per (sequence, channel), its sequence's tokens
 *     in order through ops_math.h's om_conv_step, as conv_channels;
 *   - q and k: one thread per (row, key head, q or k) through
 *     om_l2norm_row, as the CPU's loop over rows;
 *   - the delta rule: one block per (sequence, value head), thread e owning
 *     column e of the state; every column's chain of products and sums in
 *     the key dims' order is qt_delta_rule_ref's (kernels/delta_rule.c), and
 *     the norm's sum of squares is taken by each thread over the head's
 *     outputs in order, as delta_heads. Tokens of a sequence run in order
 *     inside the block, so a prompt in chunks gives the bits of one token at
 *     a time, as on the CPU.
 * The sequential loops are short (a step's tokens, the conv's taps, a
 * head's dims); the parallelism is channels and heads, thousands of each
 * in a real model.
 */
#include <cstdint>

#include <cuda_runtime.h>

#include "ops_math.h"
#include "qt_cuda_internal.h"
#include "qt_cuda_ops.h"

namespace
{

constexpr int kThreads = 256;
/* the loader's bounds (engine/model/qwen35.c), which linear_cpu.c's
 * buffers assume too: a thread's conv window, a block's head outputs */
constexpr int kMaxTaps = 16;
constexpr int kMaxValueDim = 512;

/* beta = sigmoid(b), decay = -exp(A_log) softplus(a + dt_bias), in place,
 * for every (row, value head). */
__global__ void gates_kernel(float *beta, float *decay, const float *neg_a, const float *dt_bias,
                             int64_t n, int32_t n_v_heads)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int32_t h = (int32_t)(i % n_v_heads);
        beta[i] = om_sigmoid(beta[i]);
        decay[i] = om_delta_log_decay(neg_a[h], decay[i], dt_bias[h]);
    }
}

/* The causal conv and silu for (sequence, channel) pairs: the last K - 1
 * inputs come from (and go back to) the sequence's window, oldest first. */
__global__ void conv_kernel(qt_cuda_delta_layer ly, qt_cuda_delta_seqs sq, float *qkv, int64_t C)
{
    int32_t K = ly.conv_kernel;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < sq.n_seqs * C;
         i += (int64_t)gridDim.x * blockDim.x) {
        int32_t s = (int32_t)(i / C);
        int64_t ch = i % C;
        float *win = ly.states + (int64_t)sq.slot[s] * ly.state_floats + ly.layer_off;
        const float *w = ly.conv + ch * K;
        float hist[kMaxTaps];
        for (int32_t j = 0; j < K - 1; j++)
            hist[j] = win[(int64_t)j * C + ch];
        for (int32_t r = sq.first[s]; r < sq.first[s + 1]; r++) {
            float *x = qkv + (int64_t)r * C + ch;
            *x = om_conv_step(hist, w, K, *x);
        }
        for (int32_t j = 0; j < K - 1; j++)
            win[(int64_t)j * C + ch] = hist[j];
    }
}

/* Each row's q (times q_factor) and k heads L2-normalized in place: item
 * (row, part, key head), part 0 q and 1 k. */
__global__ void l2norm_kernel(float *qkv, int64_t rows, int64_t C, int32_t n_k_heads, int32_t dk,
                              float q_factor)
{
    int64_t per_row = 2 * (int64_t)n_k_heads;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * per_row;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / per_row, head = i % per_row; /* q's heads, then k's */
        om_l2norm_row(qkv + r * C + head * dk, dk, head < n_k_heads ? q_factor : 1.0f);
    }
}

/* Block (sequence, value head), blockDim.x = v_head_dim: the head's state
 * carried over the sequence's rows, each output through the gated norm. */
__global__ void delta_kernel(qt_cuda_delta_layer ly, qt_cuda_delta_seqs sq, const float *beta,
                             const float *decay, const float *qkv, const float *z, float *out)
{
    __shared__ float answer[kMaxValueDim];
    int32_t NV = ly.n_v_heads, dk = ly.k_head_dim, dv = ly.v_head_dim, e = threadIdx.x;
    int32_t s = blockIdx.x / NV, h = blockIdx.x % NV;
    int32_t kh = ly.v_tiled ? h % ly.n_k_heads : h / (NV / ly.n_k_heads);
    int64_t KD = (int64_t)ly.n_k_heads * dk, VD = (int64_t)NV * dv;
    int64_t C = 2 * KD + VD;
    float *S = ly.states + (int64_t)sq.slot[s] * ly.state_floats + ly.layer_off +
               (int64_t)(ly.conv_kernel - 1) * C + (int64_t)h * dk * dv + e;
    for (int32_t r = sq.first[s]; r < sq.first[s + 1]; r++) {
        const float *q = qkv + (int64_t)r * C + (int64_t)kh * dk, *k = q + KD;
        float v = qkv[(int64_t)r * C + 2 * KD + (int64_t)h * dv + e];
        float g = expf(decay[(int64_t)r * NV + h]), b = beta[(int64_t)r * NV + h];
        // decay, then what the state predicts for k (qt_delta_rule_ref's order)
        float mem = 0.0f;
        for (int32_t a = 0; a < dk; a++) {
            S[(int64_t)a * dv] *= g;
            mem += S[(int64_t)a * dv] * k[a];
        }
        // the correction into the state, the answer to q
        mem = (v - mem) * b;
        float o = 0.0f;
        for (int32_t a = 0; a < dk; a++) {
            S[(int64_t)a * dv] += k[a] * mem;
            o += S[(int64_t)a * dv] * q[a];
        }
        // the gated RMSNorm: the head's sum of squares in order, as the CPU
        answer[e] = o;
        __syncthreads();
        double ss = 0.0;
        for (int32_t j = 0; j < dv; j++)
            ss = om_sumsq_add(ss, answer[j]);
        float sc = om_rmsnorm_scale(ss, dv, ly.eps);
        int64_t at = (int64_t)r * VD + (int64_t)h * dv + e;
        out[at] = om_rmsnorm_apply(o, sc, ly.norm[e]) * om_silu(z[at]);
        __syncthreads(); /* answer is the next token's */
    }
}

/* The shape checks of qt_cuda_delta_net: QL_OK or QL_EINVAL naming the
 * field. */
int check_delta(const qt_cuda_delta_layer *ly, const qt_cuda_delta_seqs *sq, char *msg,
                size_t msg_len)
{
    if (ly->n_k_heads < 1 || ly->n_v_heads < 1 || ly->n_v_heads % ly->n_k_heads != 0)
        return invalid(msg, msg_len,
                       "qt_cuda_delta_net: %d value heads over %d key heads (a multiple, both "
                       "at least 1)",
                       ly->n_v_heads, ly->n_k_heads);
    if (ly->k_head_dim < 1 || ly->v_head_dim < 1 || ly->v_head_dim > kMaxValueDim)
        return invalid(msg, msg_len, "qt_cuda_delta_net: head dims k %d, v %d (v from 1 to %d)",
                       ly->k_head_dim, ly->v_head_dim, kMaxValueDim);
    if (ly->conv_kernel < 1 || ly->conv_kernel > kMaxTaps)
        return invalid(msg, msg_len, "qt_cuda_delta_net: conv_kernel %d (1 to %d)", ly->conv_kernel,
                       kMaxTaps);
    if (sq->n_seqs < 0 || sq->rows < 0)
        return invalid(msg, msg_len, "qt_cuda_delta_net: %d sequences, %lld rows", sq->n_seqs,
                       (long long)sq->rows);
    if (!ly->conv || !ly->neg_a || !ly->dt_bias || !ly->norm || !ly->states || !sq->first ||
        !sq->slot)
        return invalid(msg, msg_len, "qt_cuda_delta_net: a layer or sequence array is NULL");
    return QL_OK;
}

} // namespace

/* ---- the API -------------------------------------------------------------------- */

extern "C" int qt_cuda_delta_net(const qt_cuda_delta_layer *ly, const qt_cuda_delta_seqs *sq,
                                 float *beta, float *decay, float *qkv, const float *z, float *out,
                                 void *stream, char *msg, size_t msg_len)
{
    int rc = check_delta(ly, sq, msg, msg_len);
    if (rc != QL_OK || sq->rows == 0 || sq->n_seqs == 0)
        return rc;
    if (!beta || !decay || !qkv || !z || !out)
        return invalid(msg, msg_len, "qt_cuda_delta_net: an activation is NULL");
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    int64_t T = sq->rows, NV = ly->n_v_heads, KD = (int64_t)ly->n_k_heads * ly->k_head_dim;
    int64_t C = 2 * KD + NV * ly->v_head_dim;
    // beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    gates_kernel<<<grid_for(T * NV, kThreads), kThreads, 0, st>>>(
        beta, decay, ly->neg_a, ly->dt_bias, T * NV, ly->n_v_heads);
    if ((rc = launched(msg, msg_len, "qt_cuda_delta_net's gates kernel")) != QL_OK)
        return rc;
    // the causal conv and silu over each sequence's channels
    conv_kernel<<<grid_for(sq->n_seqs * C, kThreads), kThreads, 0, st>>>(*ly, *sq, qkv, C);
    if ((rc = launched(msg, msg_len, "qt_cuda_delta_net's conv kernel")) != QL_OK)
        return rc;
    // q and k l2-normed per key head, q times k_head_dim^-1/2 (sqrtf is exact on both sides)
    float q_factor = 1.0f / sqrtf((float)ly->k_head_dim);
    l2norm_kernel<<<grid_for(T * 2 * ly->n_k_heads, kThreads), kThreads, 0, st>>>(
        qkv, T, C, ly->n_k_heads, ly->k_head_dim, q_factor);
    if ((rc = launched(msg, msg_len, "qt_cuda_delta_net's l2norm kernel")) != QL_OK)
        return rc;
    // the delta rule and the gated norm, (sequence, value head) by block
    delta_kernel<<<(unsigned)(sq->n_seqs * NV), ly->v_head_dim, 0, st>>>(*ly, *sq, beta, decay, qkv,
                                                                         z, out);
    return launched(msg, msg_len, "qt_cuda_delta_net's delta rule kernel");
}

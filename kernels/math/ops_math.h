/*
 * ops_math.h - the per-element and per-row arithmetic of a decoder layer's
 * operations (RMSNorm, RoPE, SwiGLU and GeGLU, soft-capping, attention's online softmax, the greedy
 * token choice), shared by the CPU forward pass (engine/runtime/forward.c) and the
 * CUDA kernels (kernels/cuda/qt_cuda_ops.cu). Internal to kernels/ and
 * engine/.
 *
 * Every function is QL_HD, as in qt_math.h: plain C for the CPU and
 * __host__ __device__ under nvcc, so tests/test_ops_math.c pins the very
 * arithmetic both backends run. Each float operation is written once, in
 * the order forward.c has always done it (its results are pinned bit for
 * bit by tests/test_forward.c): the project compiles with
 * -ffp-contract=off and the CUDA library with --fmad=false, so no multiply
 * and add are fused on either side.
 *
 * What is the same on both sides and what is not:
 *   - RoPE, the residual and bias adds, the RMSNorm apply step and the
 *     greedy rule are plain IEEE operations: the same inputs give the same
 *     bits on the CPU and the GPU.
 *   - expf (silu, the softmax weights) is libm's on the CPU and CUDA's on
 *     the GPU (within 2 ulp, CUDA C Programming Guide, "Mathematical
 *     Functions"); sums over a row (RMSNorm's sum of squares, attention's
 *     dot products and softmax) run in another order on the GPU. Those
 *     results agree within a rounding tolerance, not bit for bit.
 */
#ifndef QL_OPS_MATH_H
#define QL_OPS_MATH_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifndef QL_HD
#ifdef __CUDACC__
#define QL_HD __host__ __device__ __forceinline__
#else
#define QL_HD static inline
#endif
#endif

/* ---- RMSNorm ----------------------------------------------------------------
 * out[i] = x[i] * scale * weight[i], scale = 1 / sqrt(mean(x^2) + eps), the
 * sum of squares in f64 (a 4096-wide f32 sum loses ~12 bits otherwise). */

/* One element into the f64 sum of squares. */
QL_HD double om_sumsq_add(double ss, float x)
{
    return ss + (double)x * (double)x;
}

/* The row's scale from its sum of squares over n elements, rounded once. */
QL_HD float om_rmsnorm_scale(double ss, int64_t n, float eps)
{
    return (float)(1.0 / sqrt(ss / (double)n + (double)eps));
}

/* One output element: (x * scale) * weight, in that order. */
QL_HD float om_rmsnorm_apply(float x, float scale, float weight)
{
    return x * scale * weight;
}

/* ---- RoPE --------------------------------------------------------------------
 * Pair i of a head of head_dim = 2 * half rotates elements (a, b): (i, i +
 * half) in Hugging Face's rotate_half layout, (2i, 2i + 1) when interleaved
 * (a llama GGUF's permuted rows), by the angle whose cos/sin the caller
 * tabulated for the row's position. */

QL_HD void om_rope_pair(int32_t i, int32_t half, bool interleaved, int32_t *a, int32_t *b)
{
    *a = interleaved ? 2 * i : i;
    *b = interleaved ? 2 * i + 1 : i + half;
}

/* (x0, x1) <- (x0 cos - x1 sin, x0 sin + x1 cos). */
QL_HD void om_rope_rotate(float *x0, float *x1, float cos_a, float sin_a)
{
    float a = *x0, b = *x1;
    *x0 = a * cos_a - b * sin_a;
    *x1 = a * sin_a + b * cos_a;
}

/* ---- SwiGLU ------------------------------------------------------------------ */

/* silu(x) = x * sigmoid(x), as x / (1 + e^-x): 0 at 0, x for large x, -0
 * for very negative x (e^-x overflows to inf). */
QL_HD float om_silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* The gated unit: silu(gate) * up. */
QL_HD float om_swiglu(float gate, float up)
{
    return om_silu(gate) * up;
}

/* ---- GeGLU (Gemma) ----------------------------------------------------------
 * gelu_pytorch_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))),
 * in PyTorch's order of operations for f32 (aten's GeluType::Tanh:
 * x^3 first, kappa times it, plus x, beta times that). tanhf is libm's on
 * the CPU and CUDA's on the GPU (within 2 ulp), as expf above. */

QL_HD float om_gelu_tanh(float x)
{
    const float beta = 0.7978845608028654f; /* sqrt(2 / pi) */
    const float kappa = 0.044715f;
    float cube = x * x * x;
    float inner = beta * (x + kappa * cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

/* The gated unit: gelu_tanh(gate) * up. */
QL_HD float om_geglu(float gate, float up)
{
    return om_gelu_tanh(gate) * up;
}

/* ---- GPT-OSS's clamped SwiGLU -------------------------------------------------
 * transformers' GptOssExperts._apply_gate (and llama.cpp's swiglu_oai): the
 * gate clamped above at limit, up clamped to [-limit, limit] (limit 0: no
 * clamp), then (up + 1) * gate * sigmoid(alpha * gate), in that order. */

QL_HD float om_swiglu_oai(float gate, float up, float alpha, float limit)
{
    if (limit > 0.0f) {
        gate = gate > limit ? limit : gate;
        up = up > limit ? limit : up < -limit ? -limit : up;
    }
    float glu = gate / (1.0f + expf(-alpha * gate));
    return (up + 1.0f) * glu;
}

/* ---- soft-capping (Gemma 2's attention scores and logits) --------------------
 * tanh(x / cap) * cap: x for |x| << cap, never past +-cap. */
QL_HD float om_softcap(float x, float cap)
{
    return tanhf(x / cap) * cap;
}

/* ---- attention ---------------------------------------------------------------
 * Scores q . k * scale, softmax over the row's positions, weights times V.
 * The softmax is online (Milakov & Gimelshein 2018, "Online normalizer
 * calculation for softmax"): a running max and sum, with what was summed
 * rescaled whenever the max rises, so K and V are read once. Partial
 * states over disjoint position sets merge exactly as a split softmax
 * (FlashDecoding): rescale both to the larger max and add. */

/* 1 / sqrt(head_dim), in f32. */
QL_HD float om_attention_scale(int32_t head_dim)
{
    return 1.0f / sqrtf((float)head_dim);
}

/* The first position a row at `pos` attends to: Mistral's sliding window
 * keeps the last `window` positions, this one included (as transformers
 * masks them); window 0 is off. */
QL_HD int32_t om_attention_first(int32_t pos, int32_t window)
{
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* A running softmax: the largest score so far and the sum of e^(score -
 * max). The accumulator of weighted values lives with the caller. */
typedef struct om_online {
    float max, sum;
} om_online;

QL_HD om_online om_online_start(void)
{
    om_online s = {-INFINITY, 0.0f};
    return s;
}

/* When score is above the running max: rescale the sum to it, make it the
 * max, and return true with *factor = e^(old max - score), by which the
 * caller multiplies its accumulator. Otherwise false and *factor is not
 * written (nothing to rescale). A NaN score never raises the max. */
QL_HD bool om_online_raise(om_online *s, float score, float *factor)
{
    if (!(score > s->max))
        return false;
    float f = expf(s->max - score);
    s->sum *= f;
    s->max = score;
    *factor = f;
    return true;
}

/* The weight of a score under the running max (call om_online_raise
 * first), added to the sum. */
QL_HD float om_online_weight(om_online *s, float score)
{
    float w = expf(score - s->max);
    s->sum += w;
    return w;
}

/* One accumulator element plus a weighted value. */
QL_HD float om_online_acc(float acc, float w, float v)
{
    return acc + w * v;
}

/* Merge state b into a: both rescaled to the larger max. Returns through
 * fa, fb the factors the accumulators combine with (om_online_merge_acc).
 * An empty state (max -inf, sum 0) gets factor 0; two empty states stay
 * empty (fa 1, fb 0, never e^(-inf + inf)). */
QL_HD void om_online_merge(om_online *a, om_online b, float *fa, float *fb)
{
    float m = a->max > b.max ? a->max : b.max;
    if (m == -INFINITY) {
        *fa = 1.0f;
        *fb = 0.0f;
        return;
    }
    *fa = expf(a->max - m);
    *fb = expf(b.max - m);
    a->sum = a->sum * *fa + b.sum * *fb;
    a->max = m;
}

QL_HD float om_online_merge_acc(float acc_a, float fa, float acc_b, float fb)
{
    return acc_a * fa + acc_b * fb;
}

/* An attention sink (GPT-OSS): one more term e^sink of the denominator,
 * with no value. Returns the factor the accumulator is multiplied by (1
 * when the sink does not raise the max, an exact no-op). */
QL_HD float om_online_sink(om_online *s, float sink)
{
    float f = 1.0f;
    om_online_raise(s, sink, &f);
    om_online_weight(s, sink);
    return f;
}

/* An output element: the accumulator over the sum. */
QL_HD float om_online_out(float acc, float sum)
{
    return acc / sum;
}

/* ---- greedy token choice -------------------------------------------------------
 * engine/scheduler/sampler.c's greedy rule (argmax_ignoring_nan and eng_sample): the
 * largest logit, the lowest id on ties (as torch.argmax; -0 ties +0); NaN
 * ranks below every number, -inf included, so when nothing is above -inf
 * the choice is the lowest id that is not NaN, and 0 when all are NaN.
 * This is a total order on (logit, id), so any reduction tree over it gives
 * the same token as the sampler's left-to-right scan. */

/* Whether (a, ia) is chosen over (b, ib), ia != ib. */
QL_HD bool om_greedy_better(float a, int32_t ia, float b, int32_t ib)
{
    bool a_nan = a != a, b_nan = b != b;
    if (a_nan || b_nan)
        return a_nan == b_nan ? ia < ib : b_nan;
    if (a != b)
        return a > b;
    return ia < ib;
}

/* The greedy token of logits[0, n), n >= 1, by a left-to-right scan. */
QL_HD int32_t om_greedy_argmax(const float *logits, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (om_greedy_better(logits[i], i, logits[best], best))
            best = i;
    return best;
}

/* ---- mixtures of experts ------------------------------------------------------
 * The router's choice for one row and the weighted sum of the chosen
 * experts' outputs, as engine/runtime/experts_cpu.c computes them
 * (transformers' float32 order). The CUDA backend routes on the host with
 * these, so both backends pick the same experts with the same weights from
 * the same logits. */

/* pick[k] for k < K: the K largest of p[E], largest first, the lower
 * index first among equals (both routers' top-k). */
QL_HD void om_moe_top_k(const float *p, int32_t E, int32_t K, int32_t *pick)
{
    for (int32_t k = 0; k < K; k++) {
        int32_t best = -1;
        for (int32_t e = 0; e < E; e++) {
            bool taken = false;
            for (int32_t j = 0; j < k; j++)
                taken |= pick[j] == e;
            if (!taken && (best < 0 || p[e] > p[best]))
                best = e;
        }
        pick[k] = best;
    }
}

/* Row choice from router logits p[E] (overwritten with the softmax
 * probabilities): the k most probable experts (the lower index first among
 * equals) into pick[k], their probabilities into weight[k], renormalized to
 * sum 1 when renorm (norm_topk_prob). */
QL_HD void om_moe_route(float *p, int32_t E, int32_t K, bool renorm, int32_t *pick, float *weight)
{
    float top = p[0];
    for (int32_t e = 1; e < E; e++)
        top = p[e] > top ? p[e] : top;
    double sum = 0.0;
    for (int32_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - top);
        sum += p[e];
    }
    for (int32_t e = 0; e < E; e++)
        p[e] = (float)(p[e] / sum);
    om_moe_top_k(p, E, K, pick);
    double chosen = 0.0;
    for (int32_t k = 0; k < K; k++) {
        weight[k] = p[pick[k]];
        chosen += p[pick[k]];
    }
    for (int32_t k = 0; renorm && k < K; k++)
        weight[k] = (float)(weight[k] / chosen);
}

/* GPT-OSS's choice (ENG_ROUTER_TOPK_SOFTMAX) from its router logits p[E]
 * (bias added in place; bias NULL: none): the K largest (the lower index
 * first among equals), weighed by a softmax over those K alone, in double,
 * rounded once. K is at most 64 (the loader's bound). */
QL_HD void om_moe_route_topk_softmax(float *p, const float *bias, int32_t E, int32_t K,
                                     int32_t *pick, float *weight)
{
    for (int32_t e = 0; bias && e < E; e++)
        p[e] += bias[e];
    om_moe_top_k(p, E, K, pick);
    double sum = 0.0, w[64];
    for (int32_t k = 0; k < K; k++) {
        w[k] = exp((double)p[pick[k]] - (double)p[pick[0]]);
        sum += w[k];
    }
    for (int32_t k = 0; k < K; k++)
        weight[k] = (float)(w[k] / sum);
}

/* Qwen2-MoE's shared expert's gate from its logit: sigmoid(s). */
QL_HD float om_moe_shared_gate(float s)
{
    return 1.0f / (1.0f + expf(-s));
}

/* One element of a row's weighted sum: acc + w * y, the product rounded
 * first (no fused multiply-add on either side). */
QL_HD float om_weighted_add(float acc, float w, float y)
{
    return acc + w * y;
}

/* ---- Gated DeltaNet (Qwen3.5's linear attention, engine/model/hybrid.h) ------
 * The per-element steps around the delta rule, as transformers 5 computes
 * them in f32; linear_cpu.c and kernels/cuda/qt_cuda_linear.cu both call
 * these, so the two backends differ only where expf and log1pf do. */

/* sigmoid(x) as 1 / (1 + e^-x): the delta rule's beta, the full layers'
 * output gate. */
QL_HD float om_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* softplus as torch computes it (threshold 20: x itself above). */
QL_HD float om_softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* A value head's log decay g from in_proj_a's output a: -exp(A_log)
 * (neg_a, kept negated) times softplus(a + dt_bias). */
QL_HD float om_delta_log_decay(float neg_a, float a, float dt_bias)
{
    return neg_a * om_softplus(a + dt_bias);
}

/* The factor of an L2 normalization from the f64 sum of squares
 * (om_sumsq_add): 1 / sqrt(ss + 1e-6) (FLA's l2norm, as transformers, the
 * epsilon inside the root), rounded once, times f (q's k_head_dim^-1/2). */
QL_HD float om_l2norm_factor(double ss, float f)
{
    return (float)(1.0 / sqrt(ss + 1e-6)) * f;
}

/* v[0, n) L2-normalized in place, then times f; the sum in element order. */
QL_HD void om_l2norm_row(float *v, int32_t n, float f)
{
    double ss = 0.0;
    for (int32_t i = 0; i < n; i++)
        ss = om_sumsq_add(ss, v[i]);
    float g = om_l2norm_factor(ss, f);
    for (int32_t i = 0; i < n; i++)
        v[i] *= g;
}

/* One input of a channel through the causal depthwise conv: the taps w
 * times the window hist (the last taps - 1 inputs, oldest first) and the
 * new input, summed in that order, then silu; hist shifts to take the
 * input. */
QL_HD float om_conv_step(float *hist, const float *w, int32_t taps, float in)
{
    float acc = 0.0f;
    for (int32_t j = 0; j < taps - 1; j++)
        acc += w[j] * hist[j];
    acc += w[taps - 1] * in;
    for (int32_t j = 0; j + 1 < taps - 1; j++)
        hist[j] = hist[j + 1];
    if (taps > 1)
        hist[taps - 2] = in;
    return om_silu(acc);
}

#endif

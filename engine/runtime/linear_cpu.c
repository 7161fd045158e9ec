/*
 * linear_cpu.c - the CPU backend's Gated DeltaNet (Qwen3.5's linear
 * attention, engine/model/hybrid.h) and the full layers' output gate: the
 * walk's delta_net, split_gate and gate_sigmoid operations over host
 * memory, and their scratch (eng_linear_state).
 *
 * A step's rows are its sequences' tokens in order. The conv and the
 * delta rule carry each sequence on from its recurrent state (the cache's
 * pool, kv_cache_internal.h's kv_state) token by token, so a prompt fed in
 * chunks of any size gives the bits one token at a time gives: no chunked
 * form of the rule is used (transformers' chunked and recurrent forms
 * differ in their rounding only). The work is split over the pool by
 * conv channel, then by (sequence, value head), each head's token step
 * being kernels/'s qt_delta_rule (AVX2 where the CPU has it, the scalar
 * reference's bits); every sum is the same whatever the batch.
 *
 * A sequence verifying drafts (eng_step_seq.row_states) also leaves its
 * state after each row but the last in the cache's row states, so that
 * eng_kv_rollback can take it back to the state after its last accepted
 * row; the copies change no arithmetic.
 *
 * It owns the scratch and the dense copies of each linear layer's small
 * tensors; it reads and writes the recurrent states of the step's
 * sequences and their row states, nothing else of the cache.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal/forward_internal.h"
#include "internal/kv_cache_internal.h"
#include "ops_math.h"

struct eng_linear_state {
    float *mix, *out_gate; /* the walk's (eng_walk_backend) */
    float *beta, *decay;   /* [max_tokens][n_v_heads]: sigmoid(b), -exp(A_log) softplus(a + dt) */
    /* per linear layer (index[l] of them), f32: the conv's taps [conv_dim
     * x taps], -exp(A_log) and dt_bias [n_v_heads], the norm's [v_head_dim] */
    float *conv, *neg_a, *dt_bias, *norm;
    int32_t *index; /* [n_layers]: layer l's place among the linear ones, or -1 */
};

void eng_linear_state_free(eng_linear_state *s)
{
    if (!s)
        return;
    float *bufs[] = {s->mix,  s->out_gate, s->beta,    s->decay,
                     s->conv, s->neg_a,    s->dt_bias, s->norm};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        free(bufs[i]);
    free(s->index);
    free(s);
}

int eng_linear_state_new(eng_forward_state *st, const eng_model *m)
{
    const eng_config *c = &m->cfg;
    const eng_linear_cfg *lc = &c->linear;
    if (!lc->attn_output_gate && lc->n_layers == 0)
        return QL_OK;
    eng_linear_state *s = calloc(1, sizeof *s);
    if (!s)
        return QL_ENOMEM;
    st->lin = s;
    size_t T = (size_t)st->max_tokens, Q = (size_t)c->n_heads * (size_t)c->head_dim;
    size_t C = (size_t)eng_linear_conv_dim(lc), V = (size_t)lc->n_v_heads * (size_t)lc->v_head_dim;
    size_t NV = (size_t)lc->n_v_heads, L = (size_t)lc->n_layers, K = (size_t)lc->conv_kernel;
    size_t mix = C > 2 * Q ? C : 2 * Q, gate = V > Q ? V : Q;
    s->mix = malloc(T * mix * sizeof(float));
    s->out_gate = malloc(T * gate * sizeof(float));
    s->beta = malloc((T * NV + 1) * sizeof(float));
    s->decay = malloc((T * NV + 1) * sizeof(float));
    s->conv = malloc((L * C * K + 1) * sizeof(float));
    s->neg_a = malloc((L * NV + 1) * sizeof(float));
    s->dt_bias = malloc((L * NV + 1) * sizeof(float));
    s->norm = malloc((L * (size_t)lc->v_head_dim + 1) * sizeof(float));
    s->index = malloc((size_t)c->n_layers * sizeof(int32_t));
    if (!s->mix || !s->out_gate || !s->beta || !s->decay || !s->conv || !s->neg_a || !s->dt_bias ||
        !s->norm || !s->index)
        return QL_ENOMEM;
    for (int32_t l = 0, i = 0; l < c->n_layers; l++) {
        s->index[l] = eng_linear_is(lc, l) ? i++ : -1;
        if (s->index[l] < 0)
            continue;
        const eng_linear_layer *ly = &m->layers[l].lin;
        size_t k = (size_t)s->index[l];
        qt_dequantize_rows(&ly->conv, 0, ly->conv.rows, s->conv + k * C * K);
        qt_dequantize_rows(&ly->a_log, 0, 1, s->neg_a + k * NV);
        for (size_t h = 0; h < NV && !lc->a_neg_exp; h++) /* a GGUF's is -exp(A_log) already */
            s->neg_a[k * NV + h] = -expf(s->neg_a[k * NV + h]);
        qt_dequantize_rows(&ly->dt_bias, 0, 1, s->dt_bias + k * NV);
        qt_dequantize_rows(&ly->norm, 0, 1, s->norm + k * (size_t)lc->v_head_dim);
    }
    return QL_OK;
}

float *eng_linear_mix(const eng_linear_state *s)
{
    return s ? s->mix : NULL;
}

float *eng_linear_out_gate(const eng_linear_state *s)
{
    return s ? s->out_gate : NULL;
}

/* --- the output gate ------------------------------------------------------------ */

int eng_cpu_split_gate(void *be, const float *src, float *q, float *gate, int64_t n, int32_t d,
                       char *msg, size_t msg_len)
{
    (void)be, (void)msg, (void)msg_len;
    for (int64_t i = 0; i < n; i++) {
        memcpy(q + i * d, src + 2 * i * d, (size_t)d * sizeof(float));
        memcpy(gate + i * d, src + (2 * i + 1) * d, (size_t)d * sizeof(float));
    }
    return QL_OK;
}

int eng_cpu_gate_sigmoid(void *be, float *x, const float *gate, int64_t n, char *msg,
                         size_t msg_len)
{
    (void)be, (void)msg, (void)msg_len;
    for (int64_t i = 0; i < n; i++)
        x[i] *= om_sigmoid(gate[i]);
    return QL_OK;
}

/* --- the Gated DeltaNet ---------------------------------------------------------- */

typedef struct delta_job {
    const cpu_step *cs;
    const eng_linear_cfg *lc;
    const eng_linear_state *ls;
    int32_t layer;     /* its place among the linear layers */
    int64_t layer_off; /* its part of a sequence's state, in floats */
    float *qkv;
    const float *z;
    float *out;
    float eps;
} delta_job;

/* Where step sequence s keeps this layer's state after its row t, for a
 * rollback past the rows that follow (eng_step_seq.row_states): NULL when
 * it keeps none, and for its last row, whose state is the sequence's own. */
static float *row_state(const delta_job *j, int32_t s, int32_t t)
{
    const eng_step_seq *q = &j->cs->seqs[s];
    if (q->row_states <= 0 || t >= q->n_tokens - 1)
        return NULL;
    return kv_row_state(j->cs->kv, q->row_states - 1, t) + j->layer_off;
}

/* Channels [c0, c1) of the causal conv for every sequence of the step:
 * out[t] = silu(sum_j w[j] x[t - (taps - 1) + j]), the inputs before the
 * step's first row read from (and the last taps - 1 written back to) the
 * sequence's state; qkv is overwritten by the conv's output. */
static void conv_channels(void *ctx, int64_t c0, int64_t c1)
{
    const delta_job *j = ctx;
    const cpu_step *cs = j->cs;
    int64_t C = eng_linear_conv_dim(j->lc);
    int32_t K = j->lc->conv_kernel;
    const float *taps = j->ls->conv + (size_t)j->layer * (size_t)C * (size_t)K;
    for (int32_t s = 0, r0 = 0; s < cs->n_seqs; r0 += cs->seqs[s].n_tokens, s++) {
        float *win = kv_state(cs->kv, cs->seqs[s].kv) + j->layer_off; /* [taps - 1][C] */
        for (int64_t ch = c0; ch < c1; ch++) {
            const float *w = taps + ch * K;
            float hist[16]; /* the last K - 1 inputs, oldest first */
            for (int32_t i = 0; i < K - 1; i++)
                hist[i] = win[(int64_t)i * C + ch];
            for (int32_t t = 0; t < cs->seqs[s].n_tokens; t++) {
                float *x = j->qkv + (int64_t)(r0 + t) * C + ch;
                *x = om_conv_step(hist, w, K, *x);
                float *kept = row_state(j, s, t);
                for (int32_t i = 0; kept && i < K - 1; i++)
                    kept[(int64_t)i * C + ch] = hist[i];
            }
            for (int32_t i = 0; i < K - 1; i++)
                win[(int64_t)i * C + ch] = hist[i];
        }
    }
}

/* Items [i0, i1) of (sequence, value head): the head's state S (k x v)
 * carried over the sequence's rows: S *= exp(g); S += k (beta (v - S^T
 * k))^T; o = S^T q; then o's RMSNorm times the norm's weight times
 * silu(z). */
static void delta_heads(void *ctx, int64_t i0, int64_t i1)
{
    const delta_job *j = ctx;
    const cpu_step *cs = j->cs;
    const eng_linear_cfg *lc = j->lc;
    int32_t NV = lc->n_v_heads, dk = lc->k_head_dim, dv = lc->v_head_dim;
    int64_t C = eng_linear_conv_dim(lc), KD = (int64_t)lc->n_k_heads * dk, VD = (int64_t)NV * dv;
    const float *norm_w = j->ls->norm + (size_t)j->layer * (size_t)dv;
    float mem[512];
    for (int64_t i = i0; i < i1; i++) {
        int32_t s = (int32_t)(i / NV), h = (int32_t)(i % NV), kh = eng_linear_key_head(lc, h);
        int32_t r0 = 0;
        for (int32_t u = 0; u < s; u++)
            r0 += cs->seqs[u].n_tokens;
        float *S = kv_state(cs->kv, cs->seqs[s].kv) + j->layer_off +
                   (int64_t)(lc->conv_kernel - 1) * C + (int64_t)h * dk * dv;
        for (int32_t t = 0; t < cs->seqs[s].n_tokens; t++) {
            int64_t r = r0 + t;
            const float *q = j->qkv + r * C + (int64_t)kh * dk, *k = q + KD,
                        *v = j->qkv + r * C + 2 * KD + (int64_t)h * dv;
            float g = expf(j->ls->decay[r * NV + h]), beta = j->ls->beta[r * NV + h];
            // decay, the delta rule's correction into the state, the answer to q
            float *o = j->out + r * VD + (int64_t)h * dv;
            qt_delta_rule(S, dk, dv, q, k, v, g, beta, o, mem);
            float *kept = row_state(j, s, t);
            if (kept) /* the head's state after this row, where a rollback finds it */
                memcpy(kept + (int64_t)(lc->conv_kernel - 1) * C + (int64_t)h * dk * dv, S,
                       (size_t)dk * (size_t)dv * sizeof(float));
            // the gated RMSNorm: normed, times its weight, times silu(z)
            double ss = 0.0;
            for (int32_t e = 0; e < dv; e++)
                ss = om_sumsq_add(ss, o[e]);
            float sc = om_rmsnorm_scale(ss, dv, j->eps);
            const float *z = j->z + r * VD + (int64_t)h * dv;
            for (int32_t e = 0; e < dv; e++)
                o[e] = om_rmsnorm_apply(o[e], sc, norm_w[e]) * om_silu(z[e]);
        }
    }
}

int eng_cpu_delta_net(void *be, int32_t l, const float *x, float *qkv, const float *z, float *out,
                      char *msg, size_t msg_len)
{
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    const eng_model *m = cs->m;
    const eng_linear_cfg *lc = &m->cfg.linear;
    eng_linear_state *ls = cs->st->lin;
    int32_t li = ls->index[l], NV = lc->n_v_heads, dk = lc->k_head_dim;
    int64_t T = cs->rows, C = eng_linear_conv_dim(lc), KD = (int64_t)lc->n_k_heads * dk;
    // beta = sigmoid(in_proj_b x), g = -exp(A_log) softplus(in_proj_a x + dt_bias)
    eng_cpu_matmul(cs->pool, &m->layers[l].lin.in_b, x, T, ls->beta);
    eng_cpu_matmul(cs->pool, &m->layers[l].lin.in_a, x, T, ls->decay);
    for (int64_t r = 0; r < T; r++)
        for (int32_t h = 0; h < NV; h++) {
            float *b = &ls->beta[r * NV + h], *a = &ls->decay[r * NV + h];
            *b = om_sigmoid(*b);
            *a = om_delta_log_decay(ls->neg_a[(size_t)li * NV + h], *a,
                                    ls->dt_bias[(size_t)li * NV + h]);
        }
    delta_job j = {
        cs, lc, ls, li, (int64_t)li * eng_linear_layer_state(lc), qkv, z, out, m->cfg.rms_norm_eps};
    // the causal conv and silu, channel by channel
    eng_pool_run(cs->pool, conv_channels, &j, C, 64);
    // q and k l2-normed per key head, q times k_head_dim^-1/2
    float qs = 1.0f / sqrtf((float)dk);
    for (int64_t r = 0; r < T; r++)
        for (int32_t kh = 0; kh < lc->n_k_heads; kh++) {
            om_l2norm_row(qkv + r * C + (int64_t)kh * dk, dk, qs);
            om_l2norm_row(qkv + r * C + KD + (int64_t)kh * dk, dk, 1.0f);
        }
    // the delta rule, (sequence, value head) by (sequence, value head)
    eng_pool_run(cs->pool, delta_heads, &j, (int64_t)cs->n_seqs * NV, 1);
    return QL_OK;
}

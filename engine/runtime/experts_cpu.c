/*
 * experts_cpu.c - the CPU's mixture-of-experts step (eng_walk_ops.moe):
 * route each of the step's rows to its top-k experts, then run each chosen
 * expert once for all the rows routed to it, so its weights are read once
 * per step however many tokens chose it (the CPU's win at batch > 1), and
 * an expert no row chose is never touched.
 *
 * Shape: router logits (a dense product), each row's choice and weights,
 * a counting sort of (row, choice) pairs by expert; then per chosen
 * expert the rows are gathered, and its gate, up and down go through
 * forward.c's eng_cpu_project as "sequences" of the gathered rows (each
 * run of one sequence's rows keeps that sequence's weight version and
 * adapters, so a merged or unmerged adapter on an expert applies only to
 * the tokens routed to it); each row adds its expert's output times its
 * weight, experts in ascending order, so a row's bits never depend on
 * which other rows share the step.
 *
 * It owns the mixture's scratch (eng_moe_state), sized once for the
 * largest step; it reads the model's routers and experts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal/forward_internal.h"
#include "ops_math.h"

struct eng_moe_state {
    int32_t E, K;        /* experts, chosen per row */
    float *logits;       /* [T][E] router logits, then probabilities */
    int32_t *pick;       /* [T][K] each row's experts */
    float *weight;       /* [T][K] and their weights */
    int32_t *count;      /* [E + 1]: rows per expert, then where each starts */
    int32_t *order;      /* [T * K]: (row * K + k) grouped by expert */
    float *xg, *yg;      /* [T][hidden]: the gathered rows, an expert's output */
    float *gg, *ug;      /* [T][widest expert]: gate and up */
    float *sg;           /* [T]: the shared expert's gate */
    eng_step_seq *seqs;  /* [T]: the gathered rows as runs of their sequences */
    uint64_t ran, bytes; /* the last step's figures */
};

void eng_moe_state_free(eng_moe_state *s)
{
    if (!s)
        return;
    free(s->logits);
    free(s->pick);
    free(s->weight);
    free(s->count);
    free(s->order);
    free(s->xg);
    free(s->yg);
    free(s->gg);
    free(s->ug);
    free(s->sg);
    free(s->seqs);
    free(s);
}

int eng_moe_state_new(eng_forward_state *st, const eng_model *m)
{
    const eng_config *c = &m->cfg;
    st->moe = NULL;
    if (c->n_experts <= 0)
        return QL_OK;
    eng_moe_state *s = calloc(1, sizeof *s);
    if (!s)
        return QL_ENOMEM;
    size_t T = (size_t)st->max_tokens, E = (size_t)c->n_experts, K = (size_t)c->n_experts_used,
           H = (size_t)c->hidden_size;
    size_t F = (size_t)(c->expert_ff > c->shared_expert_ff ? c->expert_ff : c->shared_expert_ff);
    s->E = c->n_experts;
    s->K = c->n_experts_used;
    s->logits = malloc(T * E * sizeof *s->logits);
    s->pick = malloc(T * K * sizeof *s->pick);
    s->weight = malloc(T * K * sizeof *s->weight);
    s->count = malloc((E + 1) * sizeof *s->count);
    s->order = malloc(T * K * sizeof *s->order);
    s->xg = malloc(T * H * sizeof *s->xg);
    s->yg = malloc(T * H * sizeof *s->yg);
    s->gg = malloc(T * F * sizeof *s->gg);
    s->ug = malloc(T * F * sizeof *s->ug);
    s->sg = malloc(T * sizeof *s->sg);
    s->seqs = malloc(T * sizeof *s->seqs);
    st->moe = s;
    if (!s->logits || !s->pick || !s->weight || !s->count || !s->order || !s->xg || !s->yg ||
        !s->gg || !s->ug || !s->sg || !s->seqs)
        return QL_ENOMEM; /* the caller frees st, and st->moe with it */
    return QL_OK;
}

void eng_forward_moe_step(const eng_forward_state *st, uint64_t *experts, uint64_t *bytes)
{
    *experts = st->moe ? st->moe->ran : 0;
    *bytes = st->moe ? st->moe->bytes : 0;
}

/*
 * Row r's choice from its router logits p[E] (overwritten with the
 * probabilities): softmax over every expert, the k most probable (the
 * lower index first among equals), their probabilities renormalized to
 * sum 1 when the model says so. As transformers, in float32.
 */
static void route_row(const eng_config *c, float *p, int32_t *pick, float *weight)
{
    int32_t E = c->n_experts, K = c->n_experts_used;
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
    double chosen = 0.0;
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
        weight[k] = p[best];
        chosen += p[best];
    }
    for (int32_t k = 0; c->norm_topk_prob && k < K; k++)
        weight[k] = (float)(weight[k] / chosen);
}

/* Every (row, choice) pair grouped by expert into s->order, s->count[e]
 * the start of expert e's run (count[E] the end), rows ascending in a run. */
static void group_by_expert(eng_moe_state *s, int64_t rows)
{
    memset(s->count, 0, (size_t)(s->E + 1) * sizeof *s->count);
    for (int64_t i = 0; i < rows * s->K; i++)
        s->count[s->pick[i] + 1]++;
    for (int32_t e = 0; e < s->E; e++)
        s->count[e + 1] += s->count[e];
    // each pair to the next free place of its expert's run (fill: the
    // loader holds a layer to 1024 experts)
    int32_t fill[1024];
    memcpy(fill, s->count, (size_t)s->E * sizeof *fill);
    for (int64_t i = 0; i < rows * s->K; i++)
        s->order[fill[s->pick[i]]++] = (int32_t)i;
}

/* The n gathered rows of one expert (order[0, n): row * K + k) as runs of
 * their sequences into s->seqs; returns how many runs. */
static int32_t gathered_seqs(const cpu_step *cs, eng_moe_state *s, const int32_t *order, int32_t n)
{
    int32_t runs = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t seq = cs->st->row_seq[order[i] / s->K];
        if (runs > 0 && cs->st->row_seq[order[i - 1] / s->K] == seq) {
            s->seqs[runs - 1].n_tokens++;
            continue;
        }
        s->seqs[runs] = cs->seqs[seq];
        s->seqs[runs].n_tokens = 1;
        runs++;
    }
    return runs;
}

/* The GLU of projections gate, up, down of layer l over the n rows in xg
 * (as the runs of sequences seqs), into yg. */
static void glu_rows(const cpu_step *cs, eng_moe_state *s, int32_t l, const eng_step_seq *seqs,
                     int32_t runs, int64_t n, eng_proj gate, eng_proj up, eng_proj down,
                     const float *x, float *y)
{
    const eng_model *m = cs->m;
    int64_t F = eng_model_proj(m, l, gate)->rows;
    eng_cpu_project(cs->st, cs->pool, m, seqs, runs, l, gate, x, s->gg);
    eng_cpu_project(cs->st, cs->pool, m, seqs, runs, l, up, x, s->ug);
    for (int64_t i = 0; i < n * F; i++)
        s->gg[i] = m->cfg.ffn_act == ENG_FFN_GELU_TANH ? om_geglu(s->gg[i], s->ug[i])
                                                       : om_swiglu(s->gg[i], s->ug[i]);
    eng_cpu_project(cs->st, cs->pool, m, seqs, runs, l, down, s->gg, y);
}

/* Qwen2-MoE's shared expert over every row, gated by sigmoid(g . x),
 * added into out. */
static void shared_expert(const cpu_step *cs, eng_moe_state *s, int32_t l, const float *x,
                          float *out)
{
    const eng_model *m = cs->m;
    int64_t T = cs->rows, H = m->cfg.hidden_size;
    eng_cpu_matmul(cs->pool, &m->layers[l].shared_gate, x, T, s->sg);
    glu_rows(cs, s, l, cs->seqs, cs->n_seqs, T, ENG_PROJ_GATE, ENG_PROJ_UP, ENG_PROJ_DOWN, x,
             s->yg);
    for (int64_t r = 0; r < T; r++) {
        float g = 1.0f / (1.0f + expf(-s->sg[r]));
        for (int64_t i = 0; i < H; i++)
            out[r * H + i] += g * s->yg[r * H + i];
    }
}

int eng_cpu_moe(void *be, int32_t l, const float *x, float *out, char *msg, size_t msg_len)
{
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    const eng_model *m = cs->m;
    const eng_config *c = &m->cfg;
    eng_moe_state *s = cs->st->moe;
    int64_t T = cs->rows, H = c->hidden_size;
    if (l == 0)
        s->ran = s->bytes = 0;
    // router: logits = x @ router^T, each row's top-k and their weights
    eng_cpu_matmul(cs->pool, &m->layers[l].router, x, T, s->logits);
    for (int64_t r = 0; r < T; r++)
        route_row(c, s->logits + r * s->E, s->pick + r * s->K, s->weight + r * s->K);
    group_by_expert(s, T);
    memset(out, 0, (size_t)(T * H) * sizeof *out);
    // each chosen expert once, over the rows routed to it
    for (int32_t e = 0; e < s->E; e++) {
        const int32_t *order = s->order + s->count[e];
        int32_t n = s->count[e + 1] - s->count[e];
        if (n == 0)
            continue;
        for (int32_t i = 0; i < n; i++)
            memcpy(s->xg + (size_t)i * (size_t)H, x + (size_t)(order[i] / s->K) * (size_t)H,
                   (size_t)H * sizeof *x);
        int32_t runs = gathered_seqs(cs, s, order, n);
        glu_rows(cs, s, l, s->seqs, runs, n, eng_expert_proj(e, ENG_PROJ_GATE),
                 eng_expert_proj(e, ENG_PROJ_UP), eng_expert_proj(e, ENG_PROJ_DOWN), s->xg, s->yg);
        for (int32_t i = 0; i < n; i++) {
            float w = s->weight[order[i]];
            float *o = out + (size_t)(order[i] / s->K) * (size_t)H;
            const float *y = s->yg + (size_t)i * (size_t)H;
            for (int64_t j = 0; j < H; j++)
                o[j] += w * y[j];
        }
        s->ran++;
        for (int k = 0; k < 3; k++)
            s->bytes += qt_nbytes(&m->layers[l].experts[3 * e + k]);
    }
    if (m->layers[l].shared_gate.rows)
        shared_expert(cs, s, l, x, out);
    return QL_OK;
}

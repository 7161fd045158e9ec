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
 * which other rows share the step. GPT-OSS's router adds its bias and
 * weighs the top-k logits by their own softmax, its experts add their
 * biases around a clamped SwiGLU (om_swiglu_oai).
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
    int32_t E, K;   /* experts, chosen per row */
    float *logits;  /* [T][E] router logits, then probabilities */
    int32_t *pick;  /* [T][K] each row's experts */
    float *weight;  /* [T][K] and their weights */
    int32_t *count; /* [E + 1]: rows per expert, then where each starts */
    int32_t *order; /* [T * K]: (row * K + k) grouped by expert */
    /* every (row, choice) pair's row in s->order's order, and its expert's
     * output ([T * K][hidden]); gate and up ([T * K][widest expert]) */
    float *xg, *yg;
    float *gg, *ug;
    /* the chosen experts that run with the model's own weights and no
     * adapter in this step (run_plain) */
    int32_t *plain; /* [E] */
    float *sg;      /* [T]: the shared expert's gate */
    /* GPT-OSS's biases as f32 (NULL without router_bias): the routers'
     * [L][E], and per layer and expert its gate, up and down biases
     * [L][E][2 * ff + hidden] */
    float *router_b, *expert_b;
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
    free(s->plain);
    free(s->router_b);
    free(s->expert_b);
    free(s);
}

/* GPT-OSS's router and expert biases, dequantized once into s. */
static int expert_biases_new(eng_moe_state *s, const eng_model *m)
{
    const eng_config *c = &m->cfg;
    size_t L = (size_t)c->n_layers, E = (size_t)c->n_experts, F = (size_t)c->expert_ff,
           H = (size_t)c->hidden_size, W = 2 * F + H;
    s->router_b = calloc(L * E, sizeof *s->router_b);
    s->expert_b = calloc(L * E * W, sizeof *s->expert_b);
    if (!s->router_b || !s->expert_b)
        return QL_ENOMEM;
    float *part = malloc(E * (F > H ? F : H) * sizeof *part); /* one bias, every expert's */
    if (!part)
        return QL_ENOMEM;
    for (size_t l = 0; l < L; l++) {
        const eng_layer *ly = &m->layers[l];
        if (!eng_layer_is_moe(c, (int32_t)l))
            continue;
        qt_dequantize_rows(&ly->router_b, 0, 1, s->router_b + l * E);
        for (int k = 0; k < 3; k++) {
            size_t n = k < 2 ? F : H, at = k == 0 ? 0 : k == 1 ? F : 2 * F;
            qt_dequantize_rows(&ly->expert_b[k], 0, (int64_t)E, part);
            for (size_t e = 0; e < E; e++)
                memcpy(s->expert_b + (l * E + e) * W + at, part + e * n, n * sizeof *part);
        }
    }
    free(part);
    return QL_OK;
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
    /* the shared expert uses T rows of them, the routed ones T * K */
    size_t P = T * (K > 1 ? K : 1);
    s->xg = malloc(P * H * sizeof *s->xg);
    s->yg = malloc(P * H * sizeof *s->yg);
    s->gg = malloc(P * F * sizeof *s->gg);
    s->ug = malloc(P * F * sizeof *s->ug);
    s->sg = malloc(T * sizeof *s->sg);
    s->seqs = malloc(T * sizeof *s->seqs);
    s->plain = malloc(E * sizeof *s->plain);
    st->moe = s;
    if (!s->logits || !s->pick || !s->weight || !s->count || !s->order || !s->xg || !s->yg ||
        !s->gg || !s->ug || !s->sg || !s->seqs || !s->plain)
        return QL_ENOMEM; /* the caller frees st, and st->moe with it */
    return c->router_bias ? expert_biases_new(s, m) : QL_OK;
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
 * sum 1 when the model says so. As transformers, in float32; ops_math.h's
 * om_moe_route, which the CUDA backend routes with too.
 */
static void route_row(const eng_config *c, float *p, int32_t *pick, float *weight)
{
    om_moe_route(p, c->n_experts, c->n_experts_used, c->norm_topk_prob, pick, weight);
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

/* gate[i] = act(gate[i]) * up[i] for i < n (GPT-OSS's clamped SwiGLU). */
static void glu(const eng_config *c, float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        gate[i] = c->ffn_act == ENG_FFN_SWIGLU_OAI
                      ? om_swiglu_oai(gate[i], up[i], c->swiglu_alpha, c->swiglu_limit)
                  : c->ffn_act == ENG_FFN_GELU_TANH ? om_geglu(gate[i], up[i])
                                                    : om_swiglu(gate[i], up[i]);
}

/* y[r] += bias per row of n (bias NULL: nothing). */
static void add_rows(float *y, const float *bias, int64_t rows, int64_t n)
{
    for (int64_t r = 0; bias && r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] += bias[i];
}

/* Expert e of layer l's gate, up and down biases side by side (GPT-OSS),
 * or NULL. */
static const float *expert_bias(const eng_moe_state *s, const eng_config *c, int32_t l, int32_t e)
{
    size_t W = 2 * (size_t)c->expert_ff + (size_t)c->hidden_size;
    return s->expert_b ? s->expert_b + ((size_t)l * (size_t)s->E + (size_t)e) * W : NULL;
}

/* The GLU of projections gate, up, down of layer l over the n rows at x
 * (as the runs of sequences seqs), into y; g and u are the gate's and the
 * up's rows; bias (NULL: none) the expert's gate, up and down biases. */
static void glu_rows(const cpu_step *cs, int32_t l, const eng_step_seq *seqs, int32_t runs,
                     int64_t n, eng_proj gate, eng_proj up, eng_proj down, const float *bias,
                     const float *x, float *g, float *u, float *y)
{
    const eng_model *m = cs->m;
    int64_t F = eng_model_proj(m, l, gate)->rows, H = m->cfg.hidden_size;
    eng_cpu_project(cs->st, cs->pool, m, seqs, runs, l, gate, x, g);
    eng_cpu_project(cs->st, cs->pool, m, seqs, runs, l, up, x, u);
    add_rows(g, bias, n, F);
    add_rows(u, bias ? bias + F : NULL, n, F);
    glu(&m->cfg, g, u, n * F);
    eng_cpu_project(cs->st, cs->pool, m, seqs, runs, l, down, g, y);
    add_rows(y, bias ? bias + 2 * F : NULL, n, H);
}

/* Whether expert e of layer l runs with the model's own weights and no
 * adapter for every sequence of the step (so run_plain may batch it with
 * the others). */
static bool expert_plain(const cpu_step *cs, int32_t l, int32_t e)
{
    for (int k = 0; k < 3; k++) {
        eng_proj p = eng_expert_proj(e, (eng_proj)(ENG_PROJ_GATE + k));
        const qtensor *own = eng_model_proj(cs->m, l, p);
        for (int32_t s = 0; s < cs->n_seqs; s++) {
            const eng_step_seq *q = &cs->seqs[s];
            if (q->weights && eng_weights_proj(q->weights, l, p) != own)
                return false;
            for (int32_t t = 0; t < q->n_delta; t++)
                if (eng_lora_module_at(q->delta[t].lora, l, p))
                    return false;
        }
    }
    return true;
}

/* One pool job over the plain experts' products: items of 16 output rows
 * of an expert's gate and up (down: of its down), every expert the same
 * number of items (per_expert), so item it is expert it / per_expert's;
 * expert i's gathered rows begin at the pair count[plain[i]]. */
typedef struct plain_job {
    const eng_model *m;
    const eng_moe_state *s;
    int32_t l, n;
    bool down;
    int64_t per_expert;
    qt_acts x; /* every plain expert's gathered rows (gate and up: xg; down: gg), prepared once */
} plain_job;

#define PLAIN_ROWS 16

static void plain_items(void *ctx, int64_t i0, int64_t i1)
{
    const plain_job *j = ctx;
    const eng_moe_state *s = j->s;
    int64_t H = j->m->cfg.hidden_size, F = j->m->cfg.expert_ff;
    int64_t per = (F + PLAIN_ROWS - 1) / PLAIN_ROWS; /* gate (and up) items per expert */
    for (int64_t it = i0; it < i1; it++) {
        int32_t e = s->plain[it / j->per_expert];
        int64_t local = it % j->per_expert, first = s->count[e], rows = s->count[e + 1] - first;
        if (j->down) {
            int64_t r0 = local * PLAIN_ROWS, r1 = r0 + PLAIN_ROWS < H ? r0 + PLAIN_ROWS : H;
            const qtensor *w = eng_model_proj(j->m, j->l, eng_expert_proj(e, ENG_PROJ_DOWN));
            qt_acts x = qt_acts_rows(&j->x, first, rows);
            qt_matmul_acts(w, &x, s->yg + first * H, r0, r1);
            continue;
        }
        bool up = local >= per;
        int64_t r0 = (local % per) * PLAIN_ROWS, r1 = r0 + PLAIN_ROWS < F ? r0 + PLAIN_ROWS : F;
        const qtensor *w =
            eng_model_proj(j->m, j->l, eng_expert_proj(e, up ? ENG_PROJ_UP : ENG_PROJ_GATE));
        qt_acts x = qt_acts_rows(&j->x, first, rows);
        qt_matmul_acts(w, &x, (up ? s->ug : s->gg) + first * F, r0, r1);
    }
}

/*
 * The n plain experts of s->plain over their gathered rows, as two pool
 * jobs for all of them (gate and up; then down) rather than three per
 * expert: at batch 1 a layer's eight experts are small products each, and
 * a job per product would cost more in hand-overs than in arithmetic.
 */
static void run_plain(const cpu_step *cs, eng_moe_state *s, int32_t l, int32_t n)
{
    const eng_model *m = cs->m;
    int64_t H = m->cfg.hidden_size, F = m->cfg.expert_ff;
    plain_job j = {m, s, l, n, false, 2 * ((F + PLAIN_ROWS - 1) / PLAIN_ROWS), {0}};
    // x prepared once for every expert's rows (the experts of a layer share a kind)
    qt_acts_prepare(&j.x, eng_model_proj(m, l, eng_expert_proj(s->plain[0], ENG_PROJ_GATE)), s->xg,
                    s->count[s->E]);
    eng_pool_run(cs->pool, plain_items, &j, n * j.per_expert, 1);
    qt_acts_release(&j.x);
    for (int32_t i = 0; i < n; i++) {
        int32_t e = s->plain[i];
        int64_t first = s->count[e], rows = s->count[e + 1] - first;
        const float *bias = expert_bias(s, &m->cfg, l, e);
        add_rows(s->gg + first * F, bias, rows, F);
        add_rows(s->ug + first * F, bias ? bias + F : NULL, rows, F);
        glu(&m->cfg, s->gg + first * F, s->ug + first * F, rows * F);
    }
    j.down = true;
    j.per_expert = (H + PLAIN_ROWS - 1) / PLAIN_ROWS;
    qt_acts_prepare(&j.x, eng_model_proj(m, l, eng_expert_proj(s->plain[0], ENG_PROJ_DOWN)), s->gg,
                    s->count[s->E]);
    eng_pool_run(cs->pool, plain_items, &j, n * j.per_expert, 1);
    qt_acts_release(&j.x);
    for (int32_t i = 0; i < n; i++) {
        int32_t e = s->plain[i];
        int64_t first = s->count[e], rows = s->count[e + 1] - first;
        const float *bias = expert_bias(s, &m->cfg, l, e);
        add_rows(s->yg + first * H, bias ? bias + 2 * F : NULL, rows, H);
    }
}

/* Qwen2-MoE's shared expert over every row, gated by sigmoid(g . x),
 * added into out. */
static void shared_expert(const cpu_step *cs, eng_moe_state *s, int32_t l, const float *x,
                          float *out)
{
    const eng_model *m = cs->m;
    int64_t T = cs->rows, H = m->cfg.hidden_size;
    eng_cpu_matmul(cs->pool, &m->layers[l].shared_gate, x, T, s->sg);
    glu_rows(cs, l, cs->seqs, cs->n_seqs, T, ENG_PROJ_GATE, ENG_PROJ_UP, ENG_PROJ_DOWN, NULL, x,
             s->gg, s->ug, s->yg);
    for (int64_t r = 0; r < T; r++) {
        float g = om_moe_shared_gate(s->sg[r]);
        for (int64_t i = 0; i < H; i++)
            out[r * H + i] += g * s->yg[r * H + i];
    }
}

/* Gemma 4's router: every chosen weight times its expert's
 * per_expert_scale (after the top-k renormalization, as transformers). */
static void scale_by_expert(eng_moe_state *s, const qtensor *scale, int64_t rows)
{
    float per[1024]; /* the loader holds a layer to 1024 experts */
    qt_dequantize_rows(scale, 0, 1, per);
    for (int64_t i = 0; i < rows * s->K; i++)
        s->weight[i] *= per[s->pick[i]];
}

int eng_cpu_moe(void *be, int32_t l, const float *x, const float *router_x, float *out, char *msg,
                size_t msg_len)
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
    eng_cpu_matmul(cs->pool, &m->layers[l].router, router_x ? router_x : x, T, s->logits);
    const float *router_b = s->router_b ? s->router_b + (size_t)l * (size_t)s->E : NULL;
    for (int64_t r = 0; r < T; r++) {
        if (c->router == ENG_ROUTER_TOPK_SOFTMAX)
            om_moe_route_topk_softmax(s->logits + r * s->E, router_b, s->E, s->K,
                                      s->pick + r * s->K, s->weight + r * s->K);
        else
            route_row(c, s->logits + r * s->E, s->pick + r * s->K, s->weight + r * s->K);
    }
    // Gemma 4: each chosen expert's weight times its per_expert_scale
    if (m->layers[l].g4.expert_scale.rows)
        scale_by_expert(s, &m->layers[l].g4.expert_scale, T);
    group_by_expert(s, T);
    // every (row, choice) pair's row, grouped by expert
    for (int64_t i = 0; i < T * s->K; i++)
        memcpy(s->xg + i * H, x + (int64_t)(s->order[i] / s->K) * H, (size_t)H * sizeof *x);
    // each chosen expert once, over the rows routed to it: those on the
    // model's weights without adapters batched together, the others each
    // through the projections with their sequences' versions and adapters
    int32_t n_plain = 0;
    int64_t F = c->expert_ff;
    for (int32_t e = 0; e < s->E; e++) {
        int32_t first = s->count[e], n = s->count[e + 1] - first;
        if (n == 0)
            continue;
        s->ran++;
        for (int k = 0; k < 3; k++)
            s->bytes += qt_nbytes(&m->layers[l].experts[3 * e + k]);
        if (expert_plain(cs, l, e)) {
            s->plain[n_plain++] = e;
            continue;
        }
        int32_t runs = gathered_seqs(cs, s, s->order + first, n);
        glu_rows(cs, l, s->seqs, runs, n, eng_expert_proj(e, ENG_PROJ_GATE),
                 eng_expert_proj(e, ENG_PROJ_UP), eng_expert_proj(e, ENG_PROJ_DOWN),
                 expert_bias(s, c, l, e), s->xg + first * H, s->gg + first * F, s->ug + first * F,
                 s->yg + first * H);
    }
    if (n_plain > 0)
        run_plain(cs, s, l, n_plain);
    // each row's experts summed with their weights, in ascending expert order
    memset(out, 0, (size_t)(T * H) * sizeof *out);
    for (int64_t i = 0; i < T * s->K; i++) {
        float w = s->weight[s->order[i]], *o = out + (int64_t)(s->order[i] / s->K) * H;
        const float *y = s->yg + i * H;
        for (int64_t k = 0; k < H; k++)
            o[k] = om_weighted_add(o[k], w, y[k]);
    }
    if (m->layers[l].shared_gate.rows)
        shared_expert(cs, s, l, x, out);
    return QL_OK;
}

/*
 * forward.c - the decoder forward pass on quantized weights, batched: one
 * step takes every running sequence's new tokens (a prefill chunk, or one
 * decode token) as the rows of one activation matrix, so each weight
 * matrix is read once per step for all of them. Attention reads the paged
 * KV cache directly through each sequence's block table.
 *
 * The pass is one walk over the layers (llama2.c's run.c is the model);
 * the matrix products go through the quant-kind traits table (qt_matmul),
 * split by rows of the weight over the worker pool. Activations are f32.
 * Immutable weights (eng_model), mutable per-step scratch
 * (eng_forward_state) and the KV cache are three separate things.
 *
 * It offers eng_forward_state_*, eng_forward and eng_lora_apply
 * (runtime.h); it owns the per-step scratch; it touches the model's host
 * tensors (read only), the host KV arena through kv_cache_internal.h, the
 * worker pool and kernels/ (qt_matmul, qt_attend, qt_kv_store and
 * qt_kv_load for a cache in f16 or q8_0, ops_math.h), and takes
 * the rotary tables and the step's refusals from step.c (and the refusal
 * of writes into shared KV blocks from kv_cache.c).
 *
 * Why backend_cuda.c has a second copy of this walk and of project():
 * there every buffer is device memory, every operation is a kernel enqueued
 * on a stream that can fail (so each step returns a code, where here none
 * can fail), the adapters' SGMV segments are laid out once per step for all
 * layers instead of gathered per projection, and K and V are written by
 * their own kernel. One walk over a table of operations would put an
 * indirect call and an error check on every CPU step and make neither walk
 * read top to bottom; the arithmetic is shared instead (ops_math.h, and the
 * rotation and refusals of step.c). What keeps the two in step:
 * tests/gpu/test_cuda_engine runs the same step lists on both backends and
 * compares logits, greedy tokens and merged digests; a change to one walk
 * (a new step, a new projection, a bias) must be made in both.
 */
#include "runtime.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal/kv_cache_internal.h"
#include "internal/step_internal.h"
#include "ops_math.h"

struct eng_forward_state {
    int32_t max_tokens;
    /* activations, max_tokens rows each */
    float *x, *h, *q, *k, *v, *att, *gate, *up, *tmp;
    float *last;                /* the last token's hidden state per sequence */
    int32_t *row_seq;           /* which step sequence each row belongs to */
    int32_t *row_pos;           /* its position */
    float *rope_cos, *rope_sin; /* [max_tokens][head_dim / 2] */
    double *inv_freq;           /* [head_dim / 2], scaling applied */
    /* dense f32 copies of the small parameters, per layer */
    float *norms;      /* [n_layers][2][hidden]: attn, ffn */
    float *final_norm; /* [hidden] */
    float *biases;     /* [n_layers][q + 2 kv] when attention_bias */
    float *qk_norms;   /* [n_layers][2][head_dim] when qk_norm (Qwen3) */
    /* Gemma: the sandwich norms [n_layers][2][hidden] (after attention,
     * after the MLP), and the sliding layers' own rotation */
    float *post_norms;
    float *rope_cos_local, *rope_sin_local; /* [max_tokens][head_dim / 2] */
    double *inv_freq_local;                 /* [head_dim / 2] */
    /* unmerged adapters: rows gathered by adapter (grown on first use) */
    float *lora_x, *lora_y, *lora_u; /* [max_tokens][widest projection] */
    float *lora_t;                   /* [max_tokens][lora_rank] */
    int64_t lora_rank;               /* the rank lora_t holds */
    int64_t wide;                    /* the widest projection side */
    int64_t *seq_row;                /* [max_tokens]: each step sequence's first row */
    int32_t *seq_group;              /* [max_tokens]: its adapter group, or -1 */
    struct lora_row *lora_rows;      /* [max_tokens]: one term's rows on bf16 modules */
};

/* --- setup ------------------------------------------------------------------ */

/* A dense [1, n] parameter as f32. */
static void dense_row(const qtensor *t, float *out)
{
    qt_dequantize_rows(t, 0, 1, out);
}

/* A norm's weights as the pass multiplies by them: offset + w (Gemma's
 * folders keep w with the 1 left out; eng_config.norm_offset). */
static void norm_row(const qtensor *t, float offset, float *out)
{
    qt_dequantize_rows(t, 0, 1, out);
    for (int64_t i = 0; offset != 0.0f && i < t->cols; i++)
        out[i] = offset + out[i];
}

/* Gemma's extra state: the sandwich norms and the sliding layers' rotary
 * frequencies (each NULL when the model has none). */
static int gemma_state_new(eng_forward_state *st, const eng_model *m)
{
    const eng_config *c = &m->cfg;
    size_t T = (size_t)st->max_tokens, H = (size_t)c->hidden_size, half = (size_t)c->head_dim / 2;
    if (c->sandwich_norms) {
        st->post_norms = malloc((size_t)c->n_layers * 2 * H * sizeof(float));
        if (!st->post_norms)
            return QL_ENOMEM;
        for (size_t l = 0; l < (size_t)c->n_layers; l++) {
            norm_row(&m->layers[l].post_attn_norm, c->norm_offset, st->post_norms + 2 * l * H);
            norm_row(&m->layers[l].post_ffn_norm, c->norm_offset, st->post_norms + (2 * l + 1) * H);
        }
    }
    if (c->rope_local_theta > 0.0f) {
        st->rope_cos_local = malloc(T * half * sizeof(float));
        st->rope_sin_local = malloc(T * half * sizeof(float));
        st->inv_freq_local = malloc(half * sizeof(double));
        if (!st->rope_cos_local || !st->rope_sin_local || !st->inv_freq_local)
            return QL_ENOMEM;
        eng_rope_inv_freq_local(c, st->inv_freq_local);
    }
    return QL_OK;
}

void eng_forward_state_free(eng_forward_state *st)
{
    if (!st)
        return;
    float *bufs[] = {st->x,
                     st->h,
                     st->q,
                     st->k,
                     st->v,
                     st->att,
                     st->gate,
                     st->up,
                     st->tmp,
                     st->last,
                     st->rope_cos,
                     st->rope_sin,
                     st->norms,
                     st->final_norm,
                     st->biases,
                     st->qk_norms,
                     st->post_norms,
                     st->rope_cos_local,
                     st->rope_sin_local};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        free(bufs[i]);
    free(st->lora_x);
    free(st->lora_y);
    free(st->lora_u);
    free(st->lora_t);
    free(st->lora_rows);
    free(st->seq_row);
    free(st->seq_group);
    free(st->row_seq);
    free(st->row_pos);
    free(st->inv_freq);
    free(st->inv_freq_local);
    free(st);
}

int eng_forward_state_new(eng_forward_state **out, const eng_model *m, int32_t max_tokens,
                          char *msg, size_t msg_len)
{
    *out = NULL;
    const eng_config *c = &m->cfg;
    if (max_tokens <= 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "max tokens per step %d must be positive",
                       max_tokens);
    if (c->head_dim > 512)
        return ql_fail(msg, msg_len, QL_EINVAL, "head_dim %d: attention supports up to 512",
                       c->head_dim);
    eng_forward_state *st = calloc(1, sizeof *st);
    if (!st)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    size_t T = (size_t)max_tokens, H = (size_t)c->hidden_size,
           Q = (size_t)c->n_heads * (size_t)c->head_dim,
           KV = (size_t)c->n_kv_heads * (size_t)c->head_dim, F = (size_t)c->intermediate_size,
           half = (size_t)c->head_dim / 2, L = (size_t)c->n_layers;
    size_t wide = F > Q ? F : Q;
    wide = wide > H ? wide : H;
    st->max_tokens = max_tokens;
    st->wide = (int64_t)wide;
    st->x = malloc(T * H * sizeof(float));
    st->h = malloc(T * H * sizeof(float));
    st->q = malloc(T * Q * sizeof(float));
    st->k = malloc(T * KV * sizeof(float));
    st->v = malloc(T * KV * sizeof(float));
    st->att = malloc(T * Q * sizeof(float));
    st->gate = malloc(T * F * sizeof(float));
    st->up = malloc(T * F * sizeof(float));
    st->tmp = malloc(T * wide * sizeof(float));
    st->last = malloc(T * H * sizeof(float));
    st->row_seq = malloc(T * sizeof(int32_t));
    st->row_pos = malloc(T * sizeof(int32_t));
    st->seq_row = malloc(T * sizeof(int64_t));
    st->seq_group = malloc(T * sizeof(int32_t));
    st->rope_cos = malloc(T * half * sizeof(float));
    st->rope_sin = malloc(T * half * sizeof(float));
    st->inv_freq = malloc(half * sizeof(double));
    st->norms = malloc(L * 2 * H * sizeof(float));
    st->final_norm = malloc(H * sizeof(float));
    st->biases = c->attention_bias ? malloc(L * (Q + 2 * KV) * sizeof(float)) : NULL;
    st->qk_norms = c->qk_norm ? malloc(L * 2 * half * 2 * sizeof(float)) : NULL;
    if (!st->x || !st->h || !st->q || !st->k || !st->v || !st->att || !st->gate || !st->up ||
        !st->tmp || !st->last || !st->row_seq || !st->row_pos || !st->seq_row || !st->seq_group ||
        !st->rope_cos || !st->rope_sin || !st->inv_freq || !st->norms || !st->final_norm ||
        (c->attention_bias && !st->biases) || (c->qk_norm && !st->qk_norms) ||
        gemma_state_new(st, m) != QL_OK) {
        eng_forward_state_free(st);
        return ql_fail(msg, msg_len, QL_ENOMEM,
                       "cannot allocate activations for %d tokens per step", max_tokens);
    }
    eng_rope_inv_freq(c, st->inv_freq);
    for (size_t l = 0; l < L; l++) {
        norm_row(&m->layers[l].attn_norm, c->norm_offset, st->norms + (2 * l) * H);
        norm_row(&m->layers[l].ffn_norm, c->norm_offset, st->norms + (2 * l + 1) * H);
        if (c->attention_bias) {
            float *b = st->biases + l * (Q + 2 * KV);
            dense_row(&m->layers[l].bq, b);
            dense_row(&m->layers[l].bk, b + Q);
            dense_row(&m->layers[l].bv, b + Q + KV);
        }
        if (c->qk_norm) {
            norm_row(&m->layers[l].q_norm, c->norm_offset, st->qk_norms + l * 4 * half);
            norm_row(&m->layers[l].k_norm, c->norm_offset, st->qk_norms + l * 4 * half + 2 * half);
        }
    }
    norm_row(&m->norm, c->norm_offset, st->final_norm);
    *out = st;
    return QL_OK;
}

/* --- the pieces -------------------------------------------------------------- */

/* out = x / rms(x) * weight, row by row (ops_math.h's arithmetic, which the
 * CUDA kernel runs too). */
static void rmsnorm(float *out, const float *x, const float *weight, int64_t rows, int64_t n,
                    float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++)
            ss = om_sumsq_add(ss, xr[i]);
        float scale = om_rmsnorm_scale(ss, n, eps);
        for (int64_t i = 0; i < n; i++)
            out[r * n + i] = om_rmsnorm_apply(xr[i], scale, weight[i]);
    }
}

typedef struct matmul_job {
    const qtensor *w;
    const float *x;
    int64_t batch;
    float *y;
} matmul_job;

static void matmul_rows(void *ctx, int64_t r0, int64_t r1)
{
    const matmul_job *j = ctx;
    qt_matmul(j->w, j->x, j->batch, j->y, r0, r1);
}

/* y[batch][w.rows] = x[batch][w.cols] @ w^T over the pool. */
static void matmul(eng_pool *pool, const qtensor *w, const float *x, int64_t batch, float *y)
{
    matmul_job j = {w, x, batch, y};
    eng_pool_run(pool, matmul_rows, &j, w->rows, 16);
}

/* --- adapters, unmerged ------------------------------------------------------- */

void eng_lora_apply(eng_pool *pool, const eng_lora_module *mod, float scale, const float *x,
                    int64_t batch, float *y, float *t, float *u)
{
    float s = scale * mod->scale;
    int64_t rank = mod->a.rows, out = mod->b.rows;
    // down: t = (x @ A^T) * s, on this thread: A has only `rank` rows, fewer
    // than one pool chunk, so handing it to the pool would only add a wake-up
    qt_matmul(&mod->a, x, batch, t, 0, rank);
    for (int64_t i = 0; i < batch * rank; i++)
        t[i] *= s;
    // up: y += t @ B^T; a few rows are cheaper here than a pool wake-up
    // (batch 1 at rank 16 is ~25k multiply-adds, microseconds)
    if (batch * out * rank <= (int64_t)1 << 18)
        qt_matmul(&mod->b, t, batch, u, 0, out);
    else
        matmul(pool, &mod->b, t, batch, u);
    for (int64_t i = 0; i < batch * out; i++)
        y[i] += u[i];
}

/*
 * Unmerged modules stored in bf16 (what lora_load_as makes of an adapter
 * for serve) take a path of their own: no gathering, since each row is
 * multiplied by its own module's A and B where it lies (qt_lora_down,
 * qt_lora_up: one row at a time, so its bits never depend on its
 * neighbours). The down products of every such row come first (on this
 * thread for a decode step, over the pool for a prefill chunk); the up
 * products ride in the base product's own pool job, each chunk of output
 * features adding its rows' B t while those y values are still in cache,
 * so they cost neither a pass over y nor a job of their own. At batch 8
 * with 8 distinct adapters each row reads its own A and B (a rank-16
 * adapter on the default model is 9.8 MB of bf16 per step), so this is
 * mostly a read of memory.
 */
typedef struct lora_row {
    const eng_lora_module *mod;
    float s;     /* the term's scale times the module's */
    int64_t row; /* its row of x and y */
} lora_row;

/* Rows [0, n) of a list of lora_row, their t at t + i * t_stride. */
typedef struct lora_rows {
    const lora_row *rows;
    int64_t n;
    float *t;
    int64_t t_stride;
} lora_rows;

typedef struct lora_down_job {
    lora_rows r;
    int64_t blocks; /* rank blocks of eight per row (the widest rank's) */
    const float *x;
    int64_t in;
} lora_down_job;

/* Items [i0, i1): item i is rank block i % blocks of row i / blocks. */
static void lora_down_items(void *ctx, int64_t i0, int64_t i1)
{
    const lora_down_job *j = ctx;
    for (int64_t i = i0; i < i1; i++) {
        const lora_row *lr = &j->r.rows[i / j->blocks];
        int64_t r0 = (i % j->blocks) * 8, rank = lr->mod->a.rows;
        if (r0 < rank)
            qt_lora_down(&lr->mod->a, j->x + lr->row * j->in, lr->s,
                         j->r.t + (i / j->blocks) * j->r.t_stride, r0,
                         r0 + 8 < rank ? r0 + 8 : rank);
    }
}

/*
 * Adapter products of up to this many multiply-adds run on the calling
 * thread: a decode step's down products (batch 8, rank 16, 1536 inputs:
 * 0.2M) take about as long as the pool's handing over of a job, and on a
 * machine whose cores are shared a job costs more, since it waits for its
 * slowest thread (bench_adapters at 2 threads on 2 busy cores: 8 distinct
 * adapters went from 0.87 to 0.75 of base when every module's down
 * products became a pool job). A prefill chunk's are pooled.
 */
#define LORA_INLINE_MACS ((int64_t)1 << 20)

/* t of every row: s * A x. */
static void lora_down(eng_pool *pool, const lora_rows *r, const float *x, int64_t in)
{
    lora_down_job j = {*r, (r->t_stride + 7) / 8, x, in};
    if (r->n * r->t_stride * in <= LORA_INLINE_MACS)
        lora_down_items(&j, 0, r->n * j.blocks);
    else
        eng_pool_run(pool, lora_down_items, &j, r->n * j.blocks, 1);
}

/* y[row][o0, o1) += B t for every row (y: rows of `out` floats). */
static void lora_up(const lora_rows *r, float *y, int64_t out, int64_t o0, int64_t o1)
{
    for (int64_t i = 0; i < r->n; i++)
        qt_lora_up(&r->rows[i].mod->b, r->t + i * r->t_stride, y + r->rows[i].row * out, o0, o1);
}

static bool lora_is_bf16(const eng_lora_module *mod)
{
    return mod->a.kind == QT_BF16 && mod->b.kind == QT_BF16;
}

/* The base product of rows [r0, r0 + batch), and the up products of the
 * bf16 rows among them, chunk by chunk of output features. */
typedef struct matmul_lora_job {
    matmul_job base; /* its x and y start at the run's first row */
    lora_rows lora;  /* rows of the whole step's y */
    float *y;        /* the whole step's */
    int64_t out;
} matmul_lora_job;

static void matmul_lora_rows(void *ctx, int64_t o0, int64_t o1)
{
    const matmul_lora_job *j = ctx;
    qt_matmul(j->base.w, j->base.x, j->base.batch, j->base.y, o0, o1);
    lora_up(&j->lora, j->y, j->out, o0, o1);
}

typedef struct lora_up_job {
    lora_rows r;
    float *y;
    int64_t out;
} lora_up_job;

/* Output blocks [b0, b1) of eight. */
static void lora_up_blocks(void *ctx, int64_t b0, int64_t b1)
{
    const lora_up_job *j = ctx;
    lora_up(&j->r, j->y, j->out, b0 * 8, b1 * 8 < j->out ? b1 * 8 : j->out);
}

/* Both products for rows that did not ride in the base product. */
static void lora_apply_rows(eng_pool *pool, const lora_rows *r, const float *x, float *y,
                            int64_t in, int64_t out)
{
    lora_down(pool, r, x, in);
    if (r->n * r->t_stride * out <= LORA_INLINE_MACS) {
        lora_up(r, y, out, 0, out);
        return;
    }
    lora_up_job j = {*r, y, out};
    // chunks of 64 outputs, so that a step of a few rows still splits
    eng_pool_run(pool, lora_up_blocks, &j, (out + 7) / 8, 8);
}

/* The module sequence s's up product rides in the base product with: its
 * only term's, when that is stored in bf16; else NULL. */
static const eng_lora_module *fused_module(const eng_step_seq *s, int32_t l, eng_proj p)
{
    const eng_lora_module *mod =
        s->n_delta == 1 ? eng_lora_module_at(s->delta[0].lora, l, p) : NULL;
    return mod && lora_is_bf16(mod) ? mod : NULL;
}

/* The tensor sequence s computes layer l's projection p with. */
static const qtensor *seq_proj(const eng_step_seq *s, const eng_model *m, int32_t l, eng_proj p)
{
    return s->weights ? eng_weights_proj(s->weights, l, p) : eng_model_proj(m, l, p);
}

/* Room for the gathered rows of adapters up to `rank`. */
static int lora_scratch(eng_forward_state *st, int64_t rank)
{
    size_t big = (size_t)st->max_tokens * (size_t)st->wide * sizeof(float);
    if (!st->lora_x) {
        st->lora_x = malloc(big);
        st->lora_y = malloc(big);
        st->lora_u = malloc(big);
        if (!st->lora_x || !st->lora_y || !st->lora_u)
            return QL_ENOMEM;
    }
    if (!st->lora_rows) {
        st->lora_rows = malloc((size_t)st->max_tokens * sizeof *st->lora_rows);
        if (!st->lora_rows)
            return QL_ENOMEM;
    }
    if (rank > st->lora_rank) {
        float *t = realloc(st->lora_t, (size_t)st->max_tokens * (size_t)rank * sizeof(float));
        if (!t)
            return QL_ENOMEM;
        st->lora_t = t;
        st->lora_rank = rank;
    }
    return QL_OK;
}

/*
 * y[T][out] = x[T][in] @ W^T for layer l's projection p, every sequence on
 * its own weight version (runs of neighbours that share a tensor go in one
 * product), then each sequence's unmerged adapters added in its own order:
 * for the k-th term of every sequence, the rows of all sequences applying
 * the same module at the same scale are gathered and get one low-rank
 * product (SGMV, as Punica and S-LoRA batch adapters). Row arithmetic never
 * depends on the grouping, so a sequence gets the same bits alone.
 * backend_cuda.c's project() is this on the device (see the file comment
 * for why there are two).
 */
static void project(eng_forward_state *st, eng_pool *pool, const eng_model *m,
                    const eng_step_seq *seqs, int32_t n_seqs, int32_t l, eng_proj p, const float *x,
                    float *y)
{
    const qtensor *base = eng_model_proj(m, l, p);
    int64_t in = base->cols, out = base->rows;
    // each sequence's rows; the rows whose one term is a bf16 module get
    // their down products now and their up products inside the base product
    int32_t max_terms = 0;
    int64_t n_fused = 0, total = 0;
    for (int32_t s = 0; s < n_seqs; total += seqs[s].n_tokens, s++) {
        st->seq_row[s] = total;
        max_terms = seqs[s].n_delta > max_terms ? seqs[s].n_delta : max_terms;
        const eng_lora_module *mod = fused_module(&seqs[s], l, p);
        for (int32_t t = 0; mod && t < seqs[s].n_tokens; t++)
            st->lora_rows[n_fused++] =
                (lora_row){mod, seqs[s].delta[0].scale * mod->scale, total + t};
    }
    if (n_fused > 0) {
        lora_rows all = {st->lora_rows, n_fused, st->lora_t, st->lora_rank};
        lora_down(pool, &all, x, in);
    }
    // the base product, one run of neighbours sharing a tensor at a time
    for (int32_t s = 0, e, i = 0; s < n_seqs; s = e) {
        const qtensor *w = seq_proj(&seqs[s], m, l, p);
        for (e = s; e < n_seqs && seq_proj(&seqs[e], m, l, p) == w; e++)
            ;
        int64_t r0 = st->seq_row[s], r1 = e < n_seqs ? st->seq_row[e] : total;
        int32_t i1 = i;
        while (i1 < n_fused && st->lora_rows[i1].row < r1)
            i1++;
        matmul_lora_job j = {
            {w, x + r0 * in, r1 - r0, y + r0 * out},
            {st->lora_rows + i, i1 - i, st->lora_t + i * st->lora_rank, st->lora_rank},
            y,
            out};
        eng_pool_run(pool, matmul_lora_rows, &j, w->rows, 16);
        i = i1;
    }
    // every other term, in each sequence's order
    for (int32_t k = 0; k < max_terms; k++) {
        // the rows on bf16 modules, each with its own (no gathering)
        int64_t n_fast = 0;
        for (int32_t s = 0; s < n_seqs; s++) {
            st->seq_group[s] = -1;
            if (fused_module(&seqs[s], l, p)) {
                st->seq_group[s] = s; /* added with the base product */
                continue;
            }
            const eng_lora_module *mod =
                seqs[s].n_delta > k ? eng_lora_module_at(seqs[s].delta[k].lora, l, p) : NULL;
            if (!mod || !lora_is_bf16(mod))
                continue;
            st->seq_group[s] = s;
            for (int32_t t = 0; t < seqs[s].n_tokens; t++)
                st->lora_rows[n_fast++] =
                    (lora_row){mod, seqs[s].delta[k].scale * mod->scale, st->seq_row[s] + t};
        }
        if (n_fast > 0) {
            lora_rows rows = {st->lora_rows, n_fast, st->lora_t, st->lora_rank};
            lora_apply_rows(pool, &rows, x, y, in, out);
        }
        // the rest (f32 and f16 modules): rows gathered by module and scale
        for (int32_t s = 0; s < n_seqs; s++) {
            if (st->seq_group[s] >= 0 || seqs[s].n_delta <= k)
                continue;
            const eng_lora_term *term = &seqs[s].delta[k];
            const eng_lora_module *mod = eng_lora_module_at(term->lora, l, p);
            if (!mod)
                continue; /* the adapter does not target this projection */
            // gather the rows of every sequence applying this module at this scale
            int64_t g = 0;
            for (int32_t e = s; e < n_seqs; e++) {
                if (st->seq_group[e] >= 0 || seqs[e].n_delta <= k ||
                    eng_lora_module_at(seqs[e].delta[k].lora, l, p) != mod ||
                    seqs[e].delta[k].scale != term->scale)
                    continue;
                st->seq_group[e] = s;
                size_t n = (size_t)seqs[e].n_tokens;
                memcpy(st->lora_x + g * in, x + st->seq_row[e] * in,
                       n * (size_t)in * sizeof(float));
                memcpy(st->lora_y + g * out, y + st->seq_row[e] * out,
                       n * (size_t)out * sizeof(float));
                g += (int64_t)n;
            }
            eng_lora_apply(pool, mod, term->scale, st->lora_x, g, st->lora_y, st->lora_t,
                           st->lora_u);
            // and scatter the sums back
            g = 0;
            for (int32_t e = s; e < n_seqs; e++) {
                if (st->seq_group[e] != s)
                    continue;
                size_t n = (size_t)seqs[e].n_tokens;
                memcpy(y + st->seq_row[e] * out, st->lora_y + g * out,
                       n * (size_t)out * sizeof(float));
                g += (int64_t)n;
            }
        }
    }
}

/* Rotate pairs of q (n_heads) and k (n_kv heads) of each row by its
 * position (cos_tab, sin_tab: [rows][rotary dims / 2]): pairs (i, i + d/2)
 * as Hugging Face, or (2i, 2i + 1) as a llama GGUF stores its permuted
 * rows; with partial rotary (Phi-4-mini) only the leading rot dims, pairs
 * (i, i + rot/2), the rest passing through as transformers'
 * apply_rotary_pos_emb and ggml's neox rope leave them. */
static void rope(const eng_config *c, const float *cos_tab, const float *sin_tab, float *vec,
                 int32_t n_heads, int64_t rows)
{
    int32_t d = c->head_dim, half = eng_rope_dims(c) / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *cs = cos_tab + r * half, *sn = sin_tab + r * half;
        for (int32_t hd = 0; hd < n_heads; hd++) {
            float *v = vec + (r * n_heads + hd) * d;
            for (int32_t i = 0; i < half; i++) {
                int32_t a, b;
                om_rope_pair(i, half, c->rope_interleaved, &a, &b);
                om_rope_rotate(&v[a], &v[b], cs[i], sn[i]);
            }
        }
    }
}

typedef struct attn_job {
    const eng_config *c;
    const eng_kv_cache *kv;
    const eng_step_seq *seqs;
    const eng_forward_state *st;
    int32_t layer;
} attn_job;

/* One run of n cached positions for a soft-capped layer (Gemma 2): each
 * score q.k * scale capped (om_softcap) before the online softmax, so not
 * qt_attend's fused loop. */
static void attend_softcap(const float *q, const float *k, const float *v, int64_t stride,
                           int32_t n, int32_t d, float scale, float cap, om_online *sm, float *acc)
{
    for (int32_t p = 0; p < n; p++) {
        const float *kp = k + (int64_t)p * stride, *vp = v + (int64_t)p * stride;
        float dot = 0.0f;
        for (int32_t t = 0; t < d; t++)
            dot += q[t] * kp[t];
        float score = om_softcap(dot * scale, cap), factor;
        if (om_online_raise(sm, score, &factor))
            for (int32_t t = 0; t < d; t++)
                acc[t] *= factor;
        float w = om_online_weight(sm, score);
        for (int32_t t = 0; t < d; t++)
            acc[t] = om_online_acc(acc[t], w, vp[t]);
    }
}

/* Positions of a run converted at a time for a cache not stored in f32. */
#define KV_LOAD_CHUNK 8

/* One run of n cached positions (their rows lie row_bytes apart from k
 * and v) for query q: straight from the arena when it holds f32, the
 * arithmetic as it always was; else each chunk of positions' head slice
 * [e0, e0 + d) converted to f32 first (qt_kv_load) and the same loop run
 * over the converted values, so the dot products and the weighted sum stay
 * f32 sums. */
static void attend_run(const eng_kv_cache *kv, const eng_config *c, const float *q,
                       const unsigned char *k, const unsigned char *v, int64_t e0, int32_t n,
                       int32_t d, float scale, om_online *sm, float *acc)
{
    if (kv->dtype == QT_F32) {
        const float *kf = (const float *)k + e0, *vf = (const float *)v + e0;
        if (c->attn_softcap > 0.0f)
            attend_softcap(q, kf, vf, kv->kv_dim, n, d, scale, c->attn_softcap, sm, acc);
        else
            qt_attend(q, kf, vf, kv->kv_dim, n, d, scale, &sm->max, &sm->sum, acc);
        return;
    }
    float kb[KV_LOAD_CHUNK * 512], vb[KV_LOAD_CHUNK * 512];
    for (int32_t p = 0, m; p < n; p += m) {
        m = n - p < KV_LOAD_CHUNK ? n - p : KV_LOAD_CHUNK;
        for (int32_t i = 0; i < m; i++) {
            size_t off = (size_t)(p + i) * kv->row_bytes;
            qt_kv_load(kv->dtype, k + off, e0, d, kb + (size_t)i * (size_t)d);
            qt_kv_load(kv->dtype, v + off, e0, d, vb + (size_t)i * (size_t)d);
        }
        if (c->attn_softcap > 0.0f)
            attend_softcap(q, kb, vb, d, m, d, scale, c->attn_softcap, sm, acc);
        else
            qt_attend(q, kb, vb, d, m, d, scale, &sm->max, &sm->sum, acc);
    }
}

/* Attention for (row, head) pairs [i0, i1): online softmax over positions
 * 0..pos of the row's sequence (or, on a sliding layer, the window's last
 * positions), reading K and V from its blocks. */
static void attention_rows(void *ctx, int64_t i0, int64_t i1)
{
    const attn_job *j = ctx;
    const eng_config *c = j->c;
    int32_t d = c->head_dim, group = c->n_heads / c->n_kv_heads;
    float scale = c->attn_scale > 0.0f ? c->attn_scale : om_attention_scale(d);
    int32_t window = eng_layer_slides(c, j->layer) ? c->sliding_window : 0;
    int32_t bt = j->kv->block_tokens;
    float acc[512];
    for (int64_t i = i0; i < i1; i++) {
        int64_t r = i / c->n_heads;
        int32_t hd = (int32_t)(i % c->n_heads), kvh = hd / group;
        const eng_step_seq *s = &j->seqs[j->st->row_seq[r]];
        int32_t pos = j->st->row_pos[r];
        const float *q = j->st->q + (r * c->n_heads + hd) * d;
        om_online sm = om_online_start();
        for (int32_t t = 0; t < d; t++)
            acc[t] = 0.0f;
        /* the sliding window: the last `window` positions, this one included */
        int32_t first = om_attention_first(pos, window);
        /* one call per KV block's run of positions: they lie a row apart */
        for (int32_t p = first, run; p <= pos; p += run) {
            int32_t block_end = (p / bt + 1) * bt;
            run = (block_end <= pos ? block_end : pos + 1) - p;
            const unsigned char *k = kv_row(j->kv, s->kv->blocks, j->layer, 0, p);
            const unsigned char *v = kv_row(j->kv, s->kv->blocks, j->layer, 1, p);
            attend_run(j->kv, c, q, k, v, (int64_t)kvh * d, run, d, scale, &sm, acc);
        }
        float *out = j->st->att + (r * c->n_heads + hd) * d;
        for (int32_t u = 0; u < d; u++)
            out[u] = om_online_out(acc[u], sm.sum);
    }
}

/* A block's output into the residual stream: x += out, through Gemma's
 * post-norm first when the model has one (post: its weights, or NULL). */
static void residual_add(const eng_config *c, float *x, float *out, const float *post, int64_t T)
{
    int64_t H = c->hidden_size;
    if (post)
        rmsnorm(out, out, post, T, H, c->rms_norm_eps);
    for (int64_t i = 0; i < T * H; i++)
        x[i] += out[i];
}

/* The classifier's output for n rows of normed hidden states, soft-capped
 * when the model caps its logits (Gemma 2). */
static void classify(eng_pool *pool, const eng_model *m, const float *h, int64_t n, float *logits)
{
    const qtensor *head = m->lm_head.rows ? &m->lm_head : &m->embed;
    matmul(pool, head, h, n, logits);
    float cap = m->cfg.final_softcap;
    for (int64_t i = 0; cap > 0.0f && i < n * m->cfg.vocab_size; i++)
        logits[i] = om_softcap(logits[i], cap);
}

/* --- the step ---------------------------------------------------------------- */

int eng_forward(eng_forward_state *st, const eng_model *m, eng_kv_cache *kv, eng_pool *pool,
                const eng_step_seq *seqs, int32_t n_seqs, float *logits, char *msg, size_t msg_len)
{
    const eng_config *c = &m->cfg;
    int64_t T = 0, max_rank = 0;
    int rc = eng_step_check(m, kv, seqs, n_seqs, st->max_tokens, &T, &max_rank, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if ((rc = eng_kv_check_writes(kv, seqs, n_seqs, msg, msg_len)) != QL_OK)
        return rc;
    if (max_rank > 0 && lora_scratch(st, max_rank) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate adapter scratch for rank %lld",
                       (long long)max_rank);
    int64_t H = c->hidden_size, Q = (int64_t)c->n_heads * c->head_dim,
            KV = (int64_t)c->n_kv_heads * c->head_dim, F = c->intermediate_size;
    int32_t half = c->head_dim / 2, rot_half = eng_rope_dims(c) / 2;

    /* token embeddings, and each row's sequence, position and rotation */
    for (int32_t s = 0, r = 0; s < n_seqs; s++) {
        for (int32_t t = 0; t < seqs[s].n_tokens; t++, r++) {
            qt_dequantize_rows(&m->embed, seqs[s].tokens[t], 1, st->x + r * H);
            for (int64_t i = 0; c->embed_scale > 0.0f && i < H; i++)
                st->x[r * H + i] *= c->embed_scale; /* Gemma: times sqrt(hidden) */
            st->row_seq[r] = s;
            st->row_pos[r] = seqs[s].pos + t;
            eng_rope_row(st->inv_freq, rot_half, st->row_pos[r], eng_rope_attention_factor(c),
                         st->rope_cos + r * rot_half, st->rope_sin + r * rot_half);
            if (st->inv_freq_local)
                eng_rope_row(st->inv_freq_local, rot_half, st->row_pos[r], 1.0,
                             st->rope_cos_local + r * rot_half, st->rope_sin_local + r * rot_half);
        }
    }

    for (int32_t l = 0; l < c->n_layers; l++) {
        // attention rmsnorm
        rmsnorm(st->h, st->x, st->norms + (2 * l) * H, T, H, c->rms_norm_eps);
        // qkv matmuls (and Qwen2's biases)
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_Q, st->h, st->q);
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_K, st->h, st->k);
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_V, st->h, st->v);
        if (c->attention_bias) {
            const float *b = st->biases + (size_t)l * (size_t)(Q + 2 * KV);
            for (int64_t r = 0; r < T; r++) {
                for (int64_t i = 0; i < Q; i++)
                    st->q[r * Q + i] += b[i];
                for (int64_t i = 0; i < KV; i++) {
                    st->k[r * KV + i] += b[Q + i];
                    st->v[r * KV + i] += b[Q + KV + i];
                }
            }
        }
        // Qwen3: each head of q and k through its RMSNorm (a head is a row)
        if (c->qk_norm) {
            const float *qn = st->qk_norms + (size_t)l * 4 * (size_t)half;
            rmsnorm(st->q, st->q, qn, T * c->n_heads, c->head_dim, c->rms_norm_eps);
            rmsnorm(st->k, st->k, qn + 2 * half, T * c->n_kv_heads, c->head_dim, c->rms_norm_eps);
        }
        // RoPE (Gemma 3's sliding layers with their own base)
        bool local = st->inv_freq_local && eng_layer_slides(c, l);
        const float *cs = local ? st->rope_cos_local : st->rope_cos;
        const float *sn = local ? st->rope_sin_local : st->rope_sin;
        rope(c, cs, sn, st->q, c->n_heads, T);
        rope(c, cs, sn, st->k, c->n_kv_heads, T);
        // K and V into the cache, all rows first so a prefill chunk sees itself
        for (int64_t r = 0; r < T; r++) {
            const eng_step_seq *s = &seqs[st->row_seq[r]];
            qt_kv_store(kv->dtype, st->k + r * KV, KV,
                        kv_row(kv, s->kv->blocks, l, 0, st->row_pos[r]));
            qt_kv_store(kv->dtype, st->v + r * KV, KV,
                        kv_row(kv, s->kv->blocks, l, 1, st->row_pos[r]));
        }
        // grouped-query attention, causal, over the paged cache
        attn_job aj = {c, kv, seqs, st, l};
        eng_pool_run(pool, attention_rows, &aj, T * c->n_heads, 1);
        // output projection, Gemma's post-attention norm, and residual
        const float *post = st->post_norms ? st->post_norms + (size_t)(2 * l) * (size_t)H : NULL;
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_O, st->att, st->tmp);
        residual_add(c, st->x, st->tmp, post, T);
        // ffn rmsnorm
        rmsnorm(st->h, st->x, st->norms + (2 * l + 1) * H, T, H, c->rms_norm_eps);
        // SwiGLU: down(silu(gate(h)) * up(h)) (Gemma's GeGLU: gelu_tanh for
        // silu), its post-norm, and residual
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_GATE, st->h, st->gate);
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_UP, st->h, st->up);
        for (int64_t i = 0; i < T * F; i++)
            st->gate[i] = c->ffn_act == ENG_FFN_GELU_TANH ? om_geglu(st->gate[i], st->up[i])
                                                          : om_swiglu(st->gate[i], st->up[i]);
        project(st, pool, m, seqs, n_seqs, l, ENG_PROJ_DOWN, st->gate, st->tmp);
        residual_add(c, st->x, st->tmp, post ? post + H : NULL, T);
    }

    // final rmsnorm of each sequence's last token, and the classifier
    for (int32_t s = 0, r = 0; s < n_seqs; s++) {
        r += seqs[s].n_tokens;
        memcpy(st->tmp + s * H, st->x + (r - 1) * H, (size_t)H * sizeof(float));
    }
    rmsnorm(st->last, st->tmp, st->final_norm, n_seqs, H, c->rms_norm_eps);
    classify(pool, m, st->last, n_seqs, logits);
    // and of every new token where a sequence asks (a prompt's logprobs):
    // each row's arithmetic is the batch's, so its last row is the above
    for (int32_t s = 0, r = 0; s < n_seqs; r += seqs[s].n_tokens, s++) {
        if (!seqs[s].all_logits)
            continue;
        rmsnorm(st->h, st->x + (int64_t)r * H, st->final_norm, seqs[s].n_tokens, H,
                c->rms_norm_eps);
        classify(pool, m, st->h, seqs[s].n_tokens, seqs[s].all_logits);
    }

    for (int32_t s = 0; s < n_seqs; s++) {
        int32_t end = seqs[s].pos + seqs[s].n_tokens;
        if (end > seqs[s].kv->n_tokens)
            seqs[s].kv->n_tokens = end;
    }
    return QL_OK;
}

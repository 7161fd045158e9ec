/*
 * project_cpu.c - the CPU backend's matrix products: a weight times the
 * step's rows over the worker pool (eng_cpu_matmul), and a projection of a
 * layer with each sequence's weight version and unmerged adapters
 * (eng_cpu_project, eng_lora_apply). forward.c's operations and
 * experts_cpu.c's experts both compute through it, so an adapter applies
 * to an expert as to any projection.
 *
 * It owns nothing; it uses the step's scratch (eng_forward_state's
 * adapter buffers, grown by forward.c) and reads the model's tensors and
 * the adapters' modules.
 */
#include <stdlib.h>
#include <string.h>

#include "internal/forward_internal.h"

/* --- products ------------------------------------------------------------------ */

/* x is prepared once per product (qt_acts_prepare: under --activations q8
 * its 8-bit form), then shared by every chunk of rows on every thread. */
typedef struct matmul_job {
    const qtensor *w;
    qt_acts x;
    float *y;
} matmul_job;

static void matmul_rows(void *ctx, int64_t r0, int64_t r1)
{
    const matmul_job *j = ctx;
    qt_matmul_acts(j->w, &j->x, j->y, r0, r1);
}

/* y[batch][w.rows] = x[batch][w.cols] @ w^T over the pool. */
void eng_cpu_matmul(eng_pool *pool, const qtensor *w, const float *x, int64_t batch, float *y)
{
    matmul_job j = {w, {0}, y};
    qt_acts_prepare(&j.x, w, x, batch);
    eng_pool_run(pool, matmul_rows, &j, w->rows, 16);
    qt_acts_release(&j.x);
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
        eng_cpu_matmul(pool, &mod->b, t, batch, u);
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
    int64_t pass;   /* rank rows a block: qt_lora_rows_per_pass's */
    int64_t blocks; /* rank blocks per row (the widest rank's) */
    const float *x;
    int64_t in;
} lora_down_job;

/* Items [i0, i1): item i is rank block i % blocks of row i / blocks. */
static void lora_down_items(void *ctx, int64_t i0, int64_t i1)
{
    const lora_down_job *j = ctx;
    for (int64_t i = i0; i < i1; i++) {
        const lora_row *lr = &j->r.rows[i / j->blocks];
        int64_t r0 = (i % j->blocks) * j->pass, rank = lr->mod->a.rows;
        if (r0 < rank)
            qt_lora_down(&lr->mod->a, j->x + lr->row * j->in, lr->s,
                         j->r.t + (i / j->blocks) * j->r.t_stride, r0,
                         r0 + j->pass < rank ? r0 + j->pass : rank);
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
    int64_t pass = qt_lora_rows_per_pass();
    lora_down_job j = {*r, pass, (r->t_stride + pass - 1) / pass, x, in};
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
    qt_matmul_acts(j->base.w, &j->base.x, j->base.y, o0, o1);
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
int eng_cpu_lora_scratch(eng_forward_state *st, int64_t rank)
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
 * backend_cuda.c's cuda_project() is the same sum on the device.
 */
void eng_cpu_project(eng_forward_state *st, eng_pool *pool, const eng_model *m,
                     const eng_step_seq *seqs, int32_t n_seqs, int32_t l, eng_proj p,
                     const float *x, float *y)
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
            {w, {0}, y + r0 * out},
            {st->lora_rows + i, i1 - i, st->lora_t + i * st->lora_rank, st->lora_rank},
            y,
            out};
        qt_acts_prepare(&j.base.x, w, x + r0 * in, r1 - r0);
        eng_pool_run(pool, matmul_lora_rows, &j, w->rows, 16);
        qt_acts_release(&j.base.x);
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

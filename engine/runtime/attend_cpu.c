/*
 * attend_cpu.c - the CPU's attention step (eng_walk_ops.attend): each
 * query row's online softmax over its sequence's cached positions, read
 * from the paged KV cache through the sequence's block table.
 *
 * Why shaped so: a cache in f16 or q8_0 must be converted to f32 before
 * qt_attend reads it, and that conversion is the price of the smaller
 * cache. One KV head's rows serve every query head of its group and, in a
 * prefill chunk, every row of the sequence, so the work is split into
 * items of (a tile of one sequence's rows, a KV head, up to ATTN_HEADS of
 * its query heads): an item converts each KV block's run of its head once
 * and runs all its rows and heads over it. Each (row, head) still sees the
 * same calls in the same order as when it was attended alone (qt_attend or
 * the soft-capped loop once per KV block's run, from its first position to
 * its own), so the answer does not depend on which rows or heads share an
 * item: test_kv_dtype pins it against a per-head reference. The scratch
 * (the converted run, the tile's accumulators) is per pool thread, sized
 * from the block size and the head size, not the context, and allocated
 * on the first step (eng_attn_scratch).
 *
 * It offers eng_cpu_attend and eng_attn_scratch_free (forward_internal.h);
 * it reads the KV arena through kv_cache_internal.h and the step's rows
 * from eng_forward_state, and calls kernels/ (qt_attend, qt_kv_load) and
 * ops_math.h's running softmax.
 */
#include "runtime.h"

#include <stdlib.h>

#include "internal/forward_internal.h"
#include "internal/kv_cache_internal.h"
#include "ops_math.h"

/* Query heads of one KV head in an item (a group of more is taken in
 * parts of this many, so that a decode step of one row still gives the
 * pool several items). */
#define ATTN_HEADS 4

/* Rows of one sequence in an item at most: a prefill chunk's rows share
 * one conversion of the positions they read. Fewer when the step has too
 * few items to keep the pool busy (attn_tile_rows). */
#define ATTN_ROWS 16

/* A tile: rows [row, row + n) of the step, all of one sequence. */
typedef struct attn_tile {
    int32_t row, n;
} attn_tile;

struct eng_attn_scratch {
    int threads;       /* pool threads it holds room for */
    size_t run_floats; /* per thread: a KV block's run of K, then of V (block x head_dim) */
    size_t acc_floats; /* per thread: ATTN_ROWS x ATTN_HEADS accumulators of head_dim */
    float *buf;        /* [threads][run_floats + acc_floats] */
    om_online *sm;     /* [threads][ATTN_ROWS x ATTN_HEADS] */
    attn_tile *tiles;  /* [max_tokens]: the step's tiles */
};

void eng_attn_scratch_free(eng_attn_scratch *s)
{
    if (!s)
        return;
    free(s->buf);
    free(s->sm);
    free(s->tiles);
    free(s);
}

/* st->attn with room for `threads` threads over blocks of bt positions:
 * kept when it has that already (so allocated once for a server's
 * life), else made anew. QL_ENOMEM (st->attn NULL) when out of memory. */
static int attn_scratch(eng_forward_state *st, const eng_config *c, int threads, int32_t bt)
{
    size_t d = (size_t)eng_max_head_dim(c), run = 2 * (size_t)bt * d,
           acc = (size_t)ATTN_ROWS * ATTN_HEADS * d;
    eng_attn_scratch *s = st->attn;
    if (s && s->threads >= threads && s->run_floats >= run && s->acc_floats >= acc)
        return QL_OK;
    eng_attn_scratch_free(s);
    st->attn = s = calloc(1, sizeof *s);
    if (!s)
        return QL_ENOMEM;
    s->threads = threads;
    s->run_floats = run;
    s->acc_floats = acc;
    s->buf = malloc((size_t)threads * (run + acc) * sizeof(float));
    s->sm = malloc((size_t)threads * ATTN_ROWS * ATTN_HEADS * sizeof *s->sm);
    s->tiles = malloc((size_t)st->max_tokens * sizeof *s->tiles);
    if (!s->buf || !s->sm || !s->tiles) {
        eng_attn_scratch_free(s);
        st->attn = NULL;
        return QL_ENOMEM;
    }
    return QL_OK;
}

typedef struct attn_job {
    const eng_config *c;
    const eng_kv_cache *kv;
    const eng_step_seq *seqs;
    const eng_forward_state *st;
    const attn_tile *tiles;
    int32_t layer, window, parts;
    float scale, softcap;
    const float *sinks; /* [n_heads], or NULL */
    const float *q;
    float *out;
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

/* n f32 positions (k and v stride apart) for the ng query heads at q, d
 * apart, each into its own sm[h] and acc + h * d; soft-capped or not. */
static void attend_heads(const float *q, int32_t ng, const float *k, const float *v, int64_t stride,
                         int32_t n, int32_t d, float scale, float cap, om_online *sm, float *acc)
{
    for (int32_t h = 0; h < ng; h++) {
        if (cap > 0.0f)
            attend_softcap(q + h * d, k, v, stride, n, d, scale, cap, &sm[h], acc + h * d);
        else
            qt_attend(q + h * d, k, v, stride, n, d, scale, &sm[h].max, &sm[h].sum, acc + h * d);
    }
}

/* Where an item's tile reads one KV block's run of n positions from p:
 * the f32 arena itself (rows layer_row bytes apart), or the head slice
 * [e0, e0 + d) of each position converted once into run (K, then V at
 * run + n * d; stride d). */
static int64_t kv_run_f32(const eng_kv_cache *kv, int32_t l, const unsigned char *k,
                          const unsigned char *v, int64_t e0, int32_t n, int32_t d, float *run,
                          const float **kf, const float **vf)
{
    if (kv->dtype == QT_F32) {
        *kf = (const float *)k + e0;
        *vf = (const float *)v + e0;
        return kv->layer_dim[l];
    }
    float *kb = run, *vb = run + (size_t)n * (size_t)d;
    qt_kv_load_rows(kv->dtype, k, kv->layer_row[l], n, e0, d, kb);
    qt_kv_load_rows(kv->dtype, v, kv->layer_row[l], n, e0, d, vb);
    *kf = kb;
    *vf = vb;
    return d;
}

/* Attention for items [i0, i1) on pool thread `worker`, an item being (a
 * tile of one sequence's rows, a KV head, a part of its group of query
 * heads): online softmax of each row and head over positions 0..pos of
 * the sequence (on a sliding layer, the window's last positions), one KV
 * block's run at a time, the run converted once for the whole item. */
static void attention_items(void *ctx, int worker, int64_t i0, int64_t i1)
{
    const attn_job *j = ctx;
    const eng_config *c = j->c;
    const eng_attn_scratch *sc = j->st->attn;
    int32_t d = eng_layer_head_dim(c, j->layer), n_kv = eng_layer_kv_heads(c, j->layer);
    int32_t group = c->n_heads / n_kv, per_tile = n_kv * j->parts, bt = j->kv->block_tokens;
    const int32_t *row_pos = j->st->row_pos;
    float *run = sc->buf + (size_t)worker * (sc->run_floats + sc->acc_floats);
    float *acc = run + sc->run_floats;
    om_online *sm = sc->sm + (size_t)worker * ATTN_ROWS * ATTN_HEADS;
    for (int64_t i = i0; i < i1; i++) {
        attn_tile t = j->tiles[i / per_tile];
        int32_t kvh = (int32_t)(i % per_tile) / j->parts, part = (int32_t)(i % per_tile) % j->parts;
        int32_t hd0 = kvh * group + part * ATTN_HEADS;
        int32_t ng =
            group - part * ATTN_HEADS < ATTN_HEADS ? group - part * ATTN_HEADS : ATTN_HEADS;
        const eng_step_seq *s = &j->seqs[j->st->row_seq[t.row]];
        for (int32_t h = 0; h < t.n * ng; h++)
            sm[h] = om_online_start();
        for (int32_t u = 0; u < t.n * ng * d; u++)
            acc[u] = 0.0f;
        /* the tile's positions: from its first row's first (the sliding
         * window's last `window`, this one included) to its last row's */
        int32_t lo = om_attention_first(row_pos[t.row], j->window), hi = row_pos[t.row + t.n - 1];
        /* one KV block's run at a time: its positions lie a row apart */
        for (int32_t p = lo, n; p <= hi; p += n) {
            int32_t block_end = (p / bt + 1) * bt;
            n = (block_end <= hi ? block_end : hi + 1) - p;
            const float *kf, *vf;
            int64_t stride =
                kv_run_f32(j->kv, j->layer, kv_row(j->kv, s->kv->blocks, j->layer, 0, p),
                           kv_row(j->kv, s->kv->blocks, j->layer, 1, p), (int64_t)kvh * d, n, d,
                           run, &kf, &vf);
            for (int32_t r = 0; r < t.n; r++) { /* the part of the run row r reads */
                int32_t pos = row_pos[t.row + r], first = om_attention_first(pos, j->window);
                int32_t a = first > p ? first : p, b = pos + 1 < p + n ? pos + 1 : p + n;
                if (a < b)
                    attend_heads(j->q + ((int64_t)(t.row + r) * c->n_heads + hd0) * d, ng,
                                 kf + (a - p) * stride, vf + (a - p) * stride, stride, b - a, d,
                                 j->scale, j->softcap, sm + r * ng, acc + (size_t)r * ng * d);
            }
        }
        for (int32_t r = 0; r < t.n; r++)
            for (int32_t h = 0; h < ng; h++) {
                om_online *m = &sm[r * ng + h];
                float *a = acc + ((size_t)r * ng + h) * d;
                /* the head's sink: one more term of the denominator, with no value */
                float factor = j->sinks ? om_online_sink(m, j->sinks[hd0 + h]) : 1.0f;
                for (int32_t u = 0; factor != 1.0f && u < d; u++)
                    a[u] *= factor;
                float *out = j->out + ((int64_t)(t.row + r) * c->n_heads + hd0 + h) * d;
                for (int32_t u = 0; u < d; u++)
                    out[u] = om_online_out(a[u], m->sum);
            }
    }
}

/* Rows per tile: as many as still leave about four items per pool thread
 * (fewer for a short prefill on many threads, so the pool stays busy),
 * from 1 to ATTN_ROWS; the answer is the same whatever the tiles. */
static int32_t attn_tile_rows(int64_t rows, int32_t items_per_row, int threads)
{
    int64_t r = rows * items_per_row / (4 * (int64_t)threads);
    return r < 1 ? 1 : r > ATTN_ROWS ? ATTN_ROWS : (int32_t)r;
}

int eng_cpu_attend(void *be, int32_t l, const float *q, float *out, int32_t window, float scale,
                   float softcap, const float *sinks, char *msg, size_t msg_len)
{
    const cpu_step *cs = be;
    const eng_config *c = &cs->m->cfg;
    eng_forward_state *st = cs->st;
    int threads = cs->pool ? eng_pool_threads(cs->pool) : 1;
    if (attn_scratch(st, c, threads, cs->kv->block_tokens) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate attention scratch for %d threads",
                       threads);
    int32_t n_kv = eng_layer_kv_heads(c, l),
            parts = (c->n_heads / n_kv + ATTN_HEADS - 1) / ATTN_HEADS;
    int32_t per_tile = n_kv * parts, tile_rows = attn_tile_rows(cs->rows, per_tile, threads);
    /* each sequence's rows (consecutive in the step) cut into tiles */
    int64_t n_tiles = 0;
    for (int32_t s = 0, r = 0; s < cs->n_seqs; r += cs->seqs[s++].n_tokens)
        for (int32_t t = 0; t < cs->seqs[s].n_tokens; t += tile_rows) {
            int32_t left = cs->seqs[s].n_tokens - t;
            st->attn->tiles[n_tiles++] = (attn_tile){r + t, left < tile_rows ? left : tile_rows};
        }
    attn_job aj = {c,       cs->kv, cs->seqs, st, st->attn->tiles, l, window, parts, scale,
                   softcap, sinks,  q,        out};
    eng_pool_run_workers(cs->pool, attention_items, &aj, n_tiles * per_tile, 1);
    return QL_OK;
}

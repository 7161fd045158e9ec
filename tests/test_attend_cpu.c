/*
 * test_attend_cpu.c - the CPU's attention step (attend_cpu.c,
 * eng_cpu_attend) gives each query head the bits it got when it was
 * attended alone: a reference written here takes one (row, head) at a
 * time, converts its KV head's rows of each KV block's run (qt_kv_load)
 * and runs qt_attend (or the soft-capped loop) over them, as the step did
 * before a KV head's rows were converted once for its whole group and a
 * prefill chunk's rows. Compared bit for bit:
 *   - over an f32, an f16 and a q8_0 cache;
 *   - for a group of three query heads per KV head (SmolLM2-135M's 9 over
 *     3) and a group of five (taken in two parts);
 *   - for a step holding a prefill chunk after a cached prefix, a decode
 *     row and a short prompt, so tiles of rows and partial KV blocks meet;
 *   - with all positions, a sliding window whose first position is not a
 *     block's, a soft cap, and attention sinks;
 *   - on one thread and on a pool of three (each with its own scratch).
 * And eng_pool_run_workers, which that scratch rests on: every index run
 * once, each chunk told a worker number below the pool's threads, no
 * number running two chunks at once.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "forward_internal.h"
#include "kv_cache_internal.h"
#include "ops_math.h"
#include "runtime.h"

TestSuite(attend_cpu, .timeout = 120);

enum { BLOCK = 16, MAX_ROWS = 64, N_SEQS = 3 };

/* The step: sequence 0 a prefill chunk of 37 rows after 21 cached
 * positions, sequence 1 one decode row at position 40, sequence 2 a
 * prompt of 5 rows. */
static const int32_t seq_pos[N_SEQS] = {21, 40, 0}, seq_rows[N_SEQS] = {37, 1, 5};

static uint64_t rng = 0x9e3779b97f4a7c15u;

/* A value in [-2, 2) from a fixed sequence (xorshift64*). */
static float next_value(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (float)((rng * 0x2545f4914f6cdd1du) >> 40) / (float)(1 << 22) - 2.0f;
}

static bool same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* One (row, head) alone: its KV head's slice of each position from first
 * to pos, a KV block's run at a time, converted and attended as the step
 * did per head; out[d] the head's output. */
static void reference_head(const eng_kv_cache *kv, const int32_t *blocks, const float *q,
                           int32_t kvh, int32_t d, int32_t pos, int32_t window, float scale,
                           float cap, const float *sink, float *out)
{
    om_online sm = om_online_start();
    float acc[512] = {0}, kb[BLOCK * 512], vb[BLOCK * 512];
    for (int32_t p = om_attention_first(pos, window), n; p <= pos; p += n) {
        int32_t end = (p / BLOCK + 1) * BLOCK;
        n = (end <= pos ? end : pos + 1) - p;
        for (int32_t i = 0; i < n; i++) {
            qt_kv_load(kv->dtype, kv_row(kv, blocks, 0, 0, p + i), (int64_t)kvh * d, d, kb + i * d);
            qt_kv_load(kv->dtype, kv_row(kv, blocks, 0, 1, p + i), (int64_t)kvh * d, d, vb + i * d);
        }
        if (cap <= 0.0f) {
            qt_attend(q, kb, vb, d, n, d, scale, &sm.max, &sm.sum, acc);
            continue;
        }
        for (int32_t i = 0; i < n; i++) { /* Gemma 2's capped score, position by position */
            float dot = 0.0f, f;
            for (int32_t t = 0; t < d; t++)
                dot += q[t] * kb[i * d + t];
            float score = om_softcap(dot * scale, cap);
            if (om_online_raise(&sm, score, &f))
                for (int32_t t = 0; t < d; t++)
                    acc[t] *= f;
            float w = om_online_weight(&sm, score);
            for (int32_t t = 0; t < d; t++)
                acc[t] = om_online_acc(acc[t], w, vb[i * d + t]);
        }
    }
    float f = sink ? om_online_sink(&sm, *sink) : 1.0f;
    for (int32_t t = 0; f != 1.0f && t < d; t++)
        acc[t] *= f;
    for (int32_t t = 0; t < d; t++)
        out[t] = om_online_out(acc[t], sm.sum);
}

typedef struct attn_case {
    int32_t window;
    float cap;
    bool sinks;
} attn_case;

/* eng_cpu_attend over cache dtype for a model of n_heads over n_kv heads
 * of d equals reference_head for every row and head, in every case and on
 * pools of 1 and 3 threads. */
static void check_shape(qt_kind dtype, int32_t n_heads, int32_t n_kv, int32_t d)
{
    char msg[256];
    eng_model *m = calloc(1, sizeof *m);
    m->cfg = (eng_config){.n_layers = 1, .n_heads = n_heads, .n_kv_heads = n_kv, .head_dim = d};
    eng_kv_cache *kv = NULL;
    cr_assert_eq(eng_kv_new_dtype(&kv, &m->cfg, (size_t)8 << 20, BLOCK, dtype, msg, sizeof msg),
                 QL_OK, "%s", msg);
    /* each sequence's cache, every position it reads filled */
    eng_seq_kv skv[N_SEQS] = {{0}};
    eng_step_seq seqs[N_SEQS];
    float row[1024];
    int64_t rows = 0;
    for (int s = 0; s < N_SEQS; s++) {
        int32_t len = seq_pos[s] + seq_rows[s];
        cr_assert_eq(eng_kv_reserve(kv, &skv[s], len), QL_OK);
        for (int32_t p = 0; p < len; p++)
            for (int v = 0; v < 2; v++) {
                for (int32_t i = 0; i < n_kv * d; i++)
                    row[i] = next_value();
                qt_kv_store(dtype, row, n_kv * d, kv_row(kv, skv[s].blocks, 0, v, p));
            }
        seqs[s] = (eng_step_seq){.kv = &skv[s], .n_tokens = seq_rows[s], .pos = seq_pos[s]};
        rows += seq_rows[s];
    }
    eng_forward_state st = {.max_tokens = MAX_ROWS};
    int32_t row_seq[MAX_ROWS], row_pos[MAX_ROWS];
    for (int32_t s = 0, r = 0; s < N_SEQS; s++)
        for (int32_t t = 0; t < seq_rows[s]; t++, r++) {
            row_seq[r] = s;
            row_pos[r] = seq_pos[s] + t;
        }
    st.row_seq = row_seq;
    st.row_pos = row_pos;
    size_t width = (size_t)n_heads * (size_t)d;
    float *q = malloc((size_t)rows * width * sizeof *q),
          *out = malloc((size_t)rows * width * sizeof *out),
          *want = malloc((size_t)d * sizeof *want), sinks[16];
    for (size_t i = 0; i < (size_t)rows * width; i++)
        q[i] = next_value();
    for (int h = 0; h < n_heads; h++)
        sinks[h] = next_value();
    const attn_case cases[] = {
        {0, 0.0f, false}, {13, 0.0f, false}, {0, 30.0f, false}, {0, 0.0f, true}, {21, 5.0f, true}};
    float scale = 1.0f / sqrtf((float)d);
    for (int threads = 1; threads <= 3; threads += 2) {
        eng_pool *pool = NULL;
        cr_assert_eq(eng_pool_new(&pool, threads, msg, sizeof msg), QL_OK, "%s", msg);
        cpu_step cs = {&st, m, kv, pool, seqs, N_SEQS, rows};
        for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
            const attn_case *ac = &cases[k];
            memset(out, 0xff, (size_t)rows * width * sizeof *out);
            cr_assert_eq(eng_cpu_attend(&cs, 0, q, out, ac->window, scale, ac->cap,
                                        ac->sinks ? sinks : NULL, msg, sizeof msg),
                         QL_OK, "%s", msg);
            for (int64_t r = 0; r < rows; r++)
                for (int32_t h = 0; h < n_heads; h++) {
                    const float *qh = q + (size_t)r * width + (size_t)h * d;
                    reference_head(kv, skv[row_seq[r]].blocks, qh, h / (n_heads / n_kv), d,
                                   row_pos[r], ac->window, scale, ac->cap,
                                   ac->sinks ? &sinks[h] : NULL, want);
                    const float *got = out + (size_t)r * width + (size_t)h * d;
                    for (int32_t t = 0; t < d; t++)
                        cr_assert(same_bits(got[t], want[t]),
                                  "%s, %d heads over %d, %d threads, window %d, cap %g, sinks "
                                  "%d: row %lld (position %d) head %d element %d: %a, per head %a",
                                  qt_kind_name(dtype), n_heads, n_kv, threads, ac->window,
                                  (double)ac->cap, ac->sinks, (long long)r, row_pos[r], h, t,
                                  (double)got[t], (double)want[t]);
                }
        }
        eng_pool_free(pool);
    }
    eng_attn_scratch_free(st.attn);
    for (int s = 0; s < N_SEQS; s++)
        eng_kv_release(kv, &skv[s]);
    eng_kv_free(kv);
    free(q);
    free(out);
    free(want);
    free(m);
}

Test(attend_cpu, smollm2_groups_of_three_give_the_per_head_bits)
{
    check_shape(QT_F16, 9, 3, 64);
    check_shape(QT_Q8_0, 9, 3, 64);
    check_shape(QT_F32, 9, 3, 64);
}

Test(attend_cpu, groups_of_five_in_two_parts_give_the_per_head_bits)
{
    check_shape(QT_F16, 10, 2, 32);
    check_shape(QT_Q8_0, 10, 2, 32);
    check_shape(QT_F32, 10, 2, 32);
}

/* A head size that is not a multiple of 16 (qt_attend's narrower path). */
Test(attend_cpu, a_head_of_24_gives_the_per_head_bits)
{
    check_shape(QT_F16, 6, 2, 24);
    check_shape(QT_F32, 6, 2, 24);
}

typedef struct workers_ctx {
    atomic_int hits[1000];
    atomic_int busy[4]; /* chunks running per worker number */
    atomic_int bad;     /* a number out of range, or one running two chunks */
    int threads;
} workers_ctx;

static void mark_chunk(void *ctx, int worker, int64_t begin, int64_t end)
{
    workers_ctx *c = ctx;
    if (worker < 0 || worker >= c->threads) {
        atomic_fetch_add(&c->bad, 1);
        return;
    }
    if (atomic_fetch_add(&c->busy[worker], 1) != 0)
        atomic_fetch_add(&c->bad, 1);
    for (int64_t i = begin; i < end; i++) {
        atomic_fetch_add(&c->hits[i], 1);
        for (volatile int spin = 0; spin < 200; spin++) /* give the others time to overlap */
            ;
    }
    atomic_fetch_sub(&c->busy[worker], 1);
}

Test(attend_cpu, pool_workers_are_numbered_and_never_shared)
{
    for (int threads = 1; threads <= 4; threads++) {
        eng_pool *pool = NULL;
        char msg[256];
        cr_assert_eq(eng_pool_new(&pool, threads, msg, sizeof msg), QL_OK, "%s", msg);
        workers_ctx *c = calloc(1, sizeof *c);
        c->threads = threads;
        for (int rep = 0; rep < 20; rep++) {
            for (int i = 0; i < 1000; i++)
                atomic_store(&c->hits[i], 0);
            eng_pool_run_workers(pool, mark_chunk, c, 1000, 1);
            for (int i = 0; i < 1000; i++)
                cr_assert_eq(atomic_load(&c->hits[i]), 1, "%d threads: index %d run %d times",
                             threads, i, atomic_load(&c->hits[i]));
        }
        cr_assert_eq(atomic_load(&c->bad), 0,
                     "%d threads: a worker number out of range or running two chunks", threads);
        free(c);
        eng_pool_free(pool);
    }
    workers_ctx *c = calloc(1, sizeof *c);
    c->threads = 1;
    eng_pool_run_workers(NULL, mark_chunk, c, 10, 1); /* no pool: the caller, number 0 */
    cr_assert_eq(atomic_load(&c->bad), 0);
    cr_assert_eq(atomic_load(&c->hits[9]), 1);
    free(c);
}

/*
 * bench_cuda.c - the CUDA backend on a Llama-2-7B-shaped model in NF4:
 * decode tokens/s at batch 1, 8, 16, 32 and 64 against the memory-bandwidth
 * floor (8 is the warp-per-rows matvec's largest batch, 16 and 32 the tile
 * kernel's, 64 the cuBLASLt path's),
 * the time of merging a rank-16 adapter into every projection, and decode
 * throughput with 8 distinct unmerged adapters against none.
 *
 * The model is made here, in host memory, with no file: every projection
 * an NF4 qtensor (blocksize 64, absmax not nested) whose codes are random
 * bytes and whose absmax are random positive floats (no quantization pass:
 * a 7B model would take minutes to quantize and the kernels read any bits
 * alike), embeddings and lm_head bf16, norms f32 ones. The random fill is
 * xorshift64* over 64-bit words on all cores: ~3.7 GB in about a second.
 *
 * What is measured, and how:
 *   - bandwidth: a 4 GiB device-to-device cudaMemcpy, (read + written
 *     bytes) / time between CUDA events, the median of 5 after one warm-up;
 *   - the floor: a decode step reads every projection's codes and absmax
 *     and the lm_head once (the embedding rows are negligible), so no step
 *     can be faster than weight_bytes / bandwidth; batch 1's tokens/s is
 *     reported as a fraction of 1 / that time, and every batch's step time
 *     as a multiple of it;
 *   - decode: B sequences each prefilled with 128 random tokens (steps of
 *     at most max_tokens rows), one untimed decode step, then 32 decode
 *     steps timed by the wall clock around eng_backend_forward (which
 *     synchronises): tokens/s = B * steps / seconds. Greedy, so only the
 *     chosen tokens come back;
 *   - adapters: batch 64 as above, every 8 sequences applying one of 8
 *     distinct rank-16 adapters unmerged (all 7 projections of all layers,
 *     bf16 A and B), against the same 64 sequences with none; the first
 *     step with adapters (which uploads them) is not timed;
 *   - merge: adapter 0 merged into each of the 224 projections with
 *     qt_cuda_merge (dequantize, add B @ A, requantize to NF4), each
 *     projection uploaded before and the result freed after, untimed; the
 *     merge call itself is timed (it synchronises). One warm-up merge first.
 *
 * Prints one JSON object (inputs, device, figures) on stdout and `timing `
 * lines for humans on stderr. Exit: 0 done, 1 a step failed, 77 no usable
 * CUDA device.
 *
 * Options: --layers N (default 32), --steps N (32), --prefill N (128),
 * --no-merge, --no-adapters; --cpu-smoke runs the same walk on the CPU
 * backend with a small model (for checking this file on a machine without
 * a GPU; no bandwidth, no merge).
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "qt_cuda_ops.h"
#include "qtensor.h"
#include "runtime.h"

#define MAX_BATCHES   5
#define ADAPTER_RANK  16
#define N_ADAPTERS    8
#define PREFILL_SEQS  32 /* 32 x 128 prompt tokens: one step of 4096 rows */
#define BW_COPY_BYTES ((size_t)4 << 30)
#define BW_REPS       5

typedef struct bench_opts {
    int32_t layers, steps, prefill;
    bool merge, adapters, cpu_smoke;
} bench_opts;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n values (sorted in place). */
static double median(double *v, size_t n)
{
    if (n == 0)
        return 0.0;
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* --- random fill on all cores ------------------------------------------------- */

typedef enum fill_kind {
    FILL_BYTES, /* n bytes of random bits */
    FILL_F32,   /* n floats uniform in [lo, hi) */
    FILL_BF16,  /* n bf16 uniform in [lo, hi) (truncated from f32: random data) */
} fill_kind;

typedef struct fill_slice {
    fill_kind kind;
    void *p;
    size_t begin, end; /* elements (bytes for FILL_BYTES) */
    float lo, hi;
    uint64_t seed;
} fill_slice;

/* splitmix64, to seed each slice's own stream */
static uint64_t splitmix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* xorshift64* (Vigna): fast, and plenty random for weights nobody reads */
static inline uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dull;
}

static inline float unit(uint64_t r)
{
    return (float)(r >> 40) * (1.0f / 16777216.0f); /* [0, 1), 24 bits */
}

static void *fill_run(void *arg)
{
    fill_slice *s = arg;
    uint64_t st = splitmix(s->seed) | 1;
    switch (s->kind) {
    case FILL_BYTES: {
        uint8_t *p = s->p;
        size_t i = s->begin;
        for (; i + 8 <= s->end; i += 8) {
            uint64_t r = xorshift(&st);
            memcpy(p + i, &r, 8);
        }
        for (; i < s->end; i++)
            p[i] = (uint8_t)xorshift(&st);
        break;
    }
    case FILL_F32: {
        float *p = s->p;
        for (size_t i = s->begin; i < s->end; i++)
            p[i] = s->lo + (s->hi - s->lo) * unit(xorshift(&st));
        break;
    }
    case FILL_BF16: {
        uint16_t *p = s->p;
        for (size_t i = s->begin; i < s->end; i++) {
            float v = s->lo + (s->hi - s->lo) * unit(xorshift(&st));
            uint32_t bits;
            memcpy(&bits, &v, sizeof bits);
            p[i] = (uint16_t)(bits >> 16);
        }
        break;
    }
    }
    return NULL;
}

static int n_fill_threads(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 64 ? 64 : (int)n;
}

/* Fill p (n elements of kind) from seed, split over the cores. Slices start
 * on multiples of 64 elements, so the result depends on the thread count
 * only through the slice boundaries (nobody compares the values). */
static void fill(fill_kind kind, void *p, size_t n, float lo, float hi, uint64_t seed)
{
    enum { MAX_T = 64 };
    int nt = n_fill_threads();
    if (n < ((size_t)1 << 20))
        nt = 1;
    pthread_t th[MAX_T];
    fill_slice sl[MAX_T];
    size_t per = ((n + (size_t)nt - 1) / (size_t)nt + 63) / 64 * 64;
    int started = 0;
    for (int t = 0; t < nt; t++) {
        size_t b = (size_t)t * per, e = b + per < n ? b + per : n;
        if (b >= n)
            break;
        sl[t] = (fill_slice){kind, p, b, e, lo, hi, seed * 1000003u + (uint64_t)t};
        if (pthread_create(&th[t], NULL, fill_run, &sl[t]) != 0) {
            fill_run(&sl[t]); /* no thread: do it here */
            th[t] = 0;
            sl[t].p = NULL;
        }
        started = t + 1;
    }
    for (int t = 0; t < started; t++)
        if (sl[t].p)
            pthread_join(th[t], NULL);
}

/* --- the model ------------------------------------------------------------------ */

static eng_config bench_config(const bench_opts *o)
{
    eng_config c = {
        .arch = ENG_ARCH_LLAMA,
        .vocab_size = 32000,
        .hidden_size = 4096,
        .intermediate_size = 11008,
        .n_layers = o->layers,
        .n_heads = 32,
        .n_kv_heads = 32,
        .head_dim = 128,
        .max_position_embeddings = 4096,
        .rope_theta = 10000.0f,
        .rope_scaling = ENG_ROPE_NONE,
        .rope_factor = 1.0f,
        .rms_norm_eps = 1e-5f,
        .bos_token_id = 1,
        .eos_token_id = 2,
    };
    if (o->cpu_smoke) {
        /* small enough for a CPU in seconds, same code paths */
        c.vocab_size = 1000;
        c.hidden_size = 256;
        c.intermediate_size = 688;
        c.n_heads = 4;
        c.n_kv_heads = 4;
        c.head_dim = 64;
    }
    return c;
}

/* An NF4 tensor [rows, cols] with random codes and absmax in [0.01, 0.06)
 * (a 7B model's absmax per 64 weights lies about there). */
static int random_nf4(qtensor *t, int64_t rows, int64_t cols, uint64_t seed)
{
    memset(t, 0, sizeof *t);
    int64_t n = rows * cols;
    t->kind = QT_NF4;
    t->rows = rows;
    t->cols = cols;
    t->blocksize = 64;
    t->n_blocks = (n + 63) / 64;
    t->data_bytes = (size_t)((n + 1) / 2);
    t->data = malloc(t->data_bytes);
    t->absmax = malloc((size_t)t->n_blocks * sizeof(float));
    memcpy(t->codebook, qt_nf4_code, sizeof t->codebook);
    if (!t->data || !t->absmax) {
        qt_free(t);
        return QL_ENOMEM;
    }
    fill(FILL_BYTES, t->data, t->data_bytes, 0, 0, seed);
    fill(FILL_F32, t->absmax, (size_t)t->n_blocks, 0.01f, 0.06f, seed + 1);
    return QL_OK;
}

/* A dense tensor [rows, cols] of kind BF16 (random in [-a, a)) or F32
 * (every value `a`). */
static int dense(qtensor *t, qt_kind kind, int64_t rows, int64_t cols, float a, uint64_t seed)
{
    memset(t, 0, sizeof *t);
    size_t n = (size_t)(rows * cols), es = kind == QT_F32 ? 4 : 2;
    t->kind = kind;
    t->rows = rows;
    t->cols = cols;
    t->data_bytes = n * es;
    t->data = malloc(t->data_bytes);
    if (!t->data)
        return QL_ENOMEM;
    if (kind == QT_F32) {
        float *f = (float *)t->data;
        for (size_t i = 0; i < n; i++)
            f[i] = a;
    } else {
        fill(FILL_BF16, t->data, n, -a, a, seed);
    }
    return QL_OK;
}

static void model_free(eng_model *m)
{
    qt_free(&m->embed);
    qt_free(&m->norm);
    qt_free(&m->lm_head);
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++) {
        eng_layer *L = &m->layers[l];
        qtensor *all[] = {&L->attn_norm, &L->ffn_norm, &L->wq,   &L->wk,    &L->wv,
                          &L->wo,        &L->w_gate,   &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            qt_free(all[i]);
    }
    free(m->layers);
    memset(m, 0, sizeof *m);
}

static int model_make(eng_model *m, const eng_config *c)
{
    memset(m, 0, sizeof *m);
    m->cfg = *c;
    snprintf(m->format, sizeof m->format, "in-memory");
    snprintf(m->quant, sizeof m->quant, "nf4");
    snprintf(m->name, sizeof m->name, "llama-2-7b-shaped-random-nf4");
    int64_t H = c->hidden_size, F = c->intermediate_size, V = c->vocab_size,
            Q = (int64_t)c->n_heads * c->head_dim, KV = (int64_t)c->n_kv_heads * c->head_dim;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers)
        return QL_ENOMEM;
    int rc = dense(&m->embed, QT_BF16, V, H, 0.02f, 11);
    if (rc == QL_OK)
        rc = dense(&m->lm_head, QT_BF16, V, H, 0.02f, 12);
    if (rc == QL_OK)
        rc = dense(&m->norm, QT_F32, 1, H, 1.0f, 0);
    for (int32_t l = 0; rc == QL_OK && l < c->n_layers; l++) {
        eng_layer *L = &m->layers[l];
        uint64_t s = 100 + (uint64_t)l * 16;
        rc = dense(&L->attn_norm, QT_F32, 1, H, 1.0f, 0);
        if (rc == QL_OK)
            rc = dense(&L->ffn_norm, QT_F32, 1, H, 1.0f, 0);
        if (rc == QL_OK)
            rc = random_nf4(&L->wq, Q, H, s + 0);
        if (rc == QL_OK)
            rc = random_nf4(&L->wk, KV, H, s + 2);
        if (rc == QL_OK)
            rc = random_nf4(&L->wv, KV, H, s + 4);
        if (rc == QL_OK)
            rc = random_nf4(&L->wo, H, Q, s + 6);
        if (rc == QL_OK)
            rc = random_nf4(&L->w_gate, F, H, s + 8);
        if (rc == QL_OK)
            rc = random_nf4(&L->w_up, F, H, s + 10);
        if (rc == QL_OK)
            rc = random_nf4(&L->w_down, H, F, s + 12);
    }
    if (rc != QL_OK)
        model_free(m);
    return rc;
}

/* Bytes a decode step must read: every projection's codes and absmax and
 * the lm_head (tied: the embeddings). */
static size_t step_weight_bytes(const eng_model *m)
{
    size_t n = qt_nbytes(m->lm_head.rows ? &m->lm_head : &m->embed);
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int p = 0; p < ENG_N_PROJ; p++)
            n += qt_nbytes(eng_model_proj(m, l, (eng_proj)p));
    return n;
}

/* --- adapters ------------------------------------------------------------------- */

/* Every adapter's A and B borrow windows of one pool of random bf16, each
 * adapter and module at its own offset: distinct values, no copies. */
typedef struct lora_pool {
    uint16_t *v;
    size_t n;
} lora_pool;

static void bench_lora_destroy(eng_lora *l)
{
    free(l->modules); /* the tensors borrow the pool: nothing else to free */
    free(l);
}

static void proj_shape(const eng_config *c, eng_proj p, int64_t *out, int64_t *in)
{
    int64_t H = c->hidden_size, F = c->intermediate_size, Q = (int64_t)c->n_heads * c->head_dim,
            KV = (int64_t)c->n_kv_heads * c->head_dim;
    switch (p) {
    case ENG_PROJ_Q: *out = Q, *in = H; break;
    case ENG_PROJ_K:
    case ENG_PROJ_V: *out = KV, *in = H; break;
    case ENG_PROJ_O: *out = H, *in = Q; break;
    case ENG_PROJ_GATE:
    case ENG_PROJ_UP: *out = F, *in = H; break;
    default: *out = H, *in = F; break;
    }
}

/* bf16 elements one adapter holds over all layers and projections. */
static size_t lora_elements(const eng_config *c)
{
    size_t n = 0;
    for (int p = 0; p < ENG_N_PROJ; p++) {
        int64_t out, in;
        proj_shape(c, (eng_proj)p, &out, &in);
        n += (size_t)ADAPTER_RANK * (size_t)(out + in);
    }
    return n * (size_t)c->n_layers;
}

static qtensor borrowed_bf16(const lora_pool *pool, size_t *at, int64_t rows, int64_t cols)
{
    size_t n = (size_t)(rows * cols);
    if (*at + n > pool->n)
        *at = 0;
    qtensor t = {.kind = QT_BF16,
                 .rows = rows,
                 .cols = cols,
                 .data = (uint8_t *)(pool->v + *at),
                 .data_bytes = n * 2,
                 .data_borrowed = true};
    *at += n;
    return t;
}

/* Adapter k: rank 16 on all 7 projections of every layer, scale 2
 * (alpha 32 / r 16), refs 1. */
static eng_lora *lora_make(const eng_config *c, const lora_pool *pool, int k)
{
    eng_lora *l = calloc(1, sizeof *l);
    size_t nm = (size_t)c->n_layers * ENG_N_PROJ;
    if (!l || !(l->modules = calloc(nm, sizeof *l->modules))) {
        free(l);
        return NULL;
    }
    snprintf(l->name, sizeof l->name, "bench-adapter-%d", k);
    l->n_layers = c->n_layers;
    l->n_proj = ENG_N_PROJ;
    l->refs = 1;
    l->destroy = bench_lora_destroy;
    /* adapter k starts k * 1M + 12345 * k elements in: its own values */
    size_t at = ((size_t)k * ((size_t)1 << 20) + 12345u * (size_t)k) % pool->n;
    for (int32_t layer = 0; layer < c->n_layers; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++) {
            int64_t out, in;
            proj_shape(c, (eng_proj)p, &out, &in);
            eng_lora_module *mod = &l->modules[(size_t)layer * ENG_N_PROJ + p];
            mod->a = borrowed_bf16(pool, &at, ADAPTER_RANK, in);
            mod->b = borrowed_bf16(pool, &at, out, ADAPTER_RANK);
            mod->scale = 2.0f;
            l->bytes += mod->a.data_bytes + mod->b.data_bytes;
        }
    return l;
}

/* --- decode --------------------------------------------------------------------- */

typedef struct batch_run {
    int32_t n;           /* sequences */
    eng_seq_kv *kv;      /* [n] */
    int32_t *next;       /* [n]: each sequence's next input token */
    int32_t *pos;        /* [n] */
    eng_step_seq *seqs;  /* [n] */
    int32_t *tokens_out; /* [n] */
    float *logits;       /* [n * vocab] */
} batch_run;

static void batch_free(eng_backend *b, batch_run *r)
{
    for (int32_t i = 0; r->kv && i < r->n; i++)
        eng_kv_release(eng_backend_kv(b), &r->kv[i]);
    free(r->kv);
    free(r->next);
    free(r->pos);
    free(r->seqs);
    free(r->tokens_out);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

/* n sequences with room for `positions` each, prefilled with `prefill`
 * random tokens in steps of at most max_tokens rows. *prefill_s gets the
 * time. */
static int batch_start(eng_backend *b, const eng_config *c, batch_run *r, int32_t n,
                       int32_t positions, int32_t prefill, int32_t max_tokens, double *prefill_s,
                       char *msg, size_t msg_len)
{
    memset(r, 0, sizeof *r);
    r->n = n;
    r->kv = calloc((size_t)n, sizeof *r->kv);
    r->next = calloc((size_t)n, sizeof *r->next);
    r->pos = calloc((size_t)n, sizeof *r->pos);
    r->seqs = calloc((size_t)n, sizeof *r->seqs);
    r->tokens_out = calloc((size_t)n, sizeof *r->tokens_out);
    r->logits = malloc((size_t)n * (size_t)c->vocab_size * sizeof(float));
    int32_t *prompt = malloc((size_t)n * (size_t)prefill * sizeof *prompt);
    if (!r->kv || !r->next || !r->pos || !r->seqs || !r->tokens_out || !r->logits || !prompt) {
        free(prompt);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for batch %d", n);
    }
    uint64_t st = splitmix((uint64_t)n) | 1;
    for (size_t i = 0; i < (size_t)n * (size_t)prefill; i++)
        prompt[i] = (int32_t)(xorshift(&st) % (uint64_t)c->vocab_size);
    for (int32_t i = 0; i < n; i++) {
        int rc = eng_kv_reserve(eng_backend_kv(b), &r->kv[i], positions);
        if (rc != QL_OK) {
            free(prompt);
            return ql_fail(msg, msg_len, rc,
                           "KV cache: no room for sequence %d of %d at %d positions", i, n,
                           positions);
        }
    }
    double t0 = now_s();
    int32_t per_step = max_tokens / prefill;
    if (per_step < 1)
        per_step = 1;
    for (int32_t s0 = 0; s0 < n; s0 += per_step) {
        int32_t k = n - s0 < per_step ? n - s0 : per_step;
        for (int32_t i = 0; i < k; i++)
            r->seqs[i] = (eng_step_seq){.kv = &r->kv[s0 + i],
                                        .tokens = prompt + (size_t)(s0 + i) * (size_t)prefill,
                                        .n_tokens = prefill,
                                        .pos = 0,
                                        .greedy = true};
        int rc = eng_backend_forward(b, r->seqs, k, r->logits, r->tokens_out, msg, msg_len);
        if (rc != QL_OK) {
            free(prompt);
            return rc;
        }
        for (int32_t i = 0; i < k; i++) {
            r->next[s0 + i] = r->tokens_out[i] >= 0 ? r->tokens_out[i] : 0;
            r->pos[s0 + i] = prefill;
        }
    }
    *prefill_s = now_s() - t0;
    free(prompt);
    return QL_OK;
}

/*
 * `steps` decode steps of the whole batch, each timed (step_s[steps]);
 * delta[i / per_term] is sequence i's adapter when delta is not NULL.
 */
static int batch_decode(eng_backend *b, batch_run *r, int32_t steps, const eng_lora_term *delta,
                        int32_t per_term, double *step_s, char *msg, size_t msg_len)
{
    for (int32_t s = 0; s < steps; s++) {
        for (int32_t i = 0; i < r->n; i++)
            r->seqs[i] = (eng_step_seq){.kv = &r->kv[i],
                                        .tokens = &r->next[i],
                                        .n_tokens = 1,
                                        .pos = r->pos[i],
                                        .delta = delta ? &delta[i / per_term] : NULL,
                                        .n_delta = delta ? 1 : 0,
                                        .greedy = true};
        double t0 = now_s();
        int rc = eng_backend_forward(b, r->seqs, r->n, r->logits, r->tokens_out, msg, msg_len);
        double t1 = now_s();
        if (rc != QL_OK)
            return rc;
        if (step_s)
            step_s[s] = t1 - t0;
        for (int32_t i = 0; i < r->n; i++) {
            r->next[i] = r->tokens_out[i] >= 0 ? r->tokens_out[i] : 0;
            r->pos[i]++;
        }
    }
    return QL_OK;
}

static double sum(const double *v, int32_t n)
{
    double s = 0;
    for (int32_t i = 0; i < n; i++)
        s += v[i];
    return s;
}

/* --- the device alone: bandwidth and merge ---------------------------------------- */

#define CUDA_OK(call, what)                                                                        \
    do {                                                                                           \
        cudaError_t st_ = (call);                                                                  \
        if (st_ != cudaSuccess) {                                                                  \
            rc = ql_fail(msg, msg_len, QL_EDEVICE, "%s: %s", what, cudaGetErrorString(st_));       \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

/* Device-to-device copy bandwidth: (read + written bytes) / time, BW_REPS
 * samples after a warm-up, into samples[] (GB/s). */
static int copy_bandwidth(double *samples, char *msg, size_t msg_len)
{
    int rc = QL_OK;
    void *src = NULL, *dst = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    CUDA_OK(cudaMalloc(&src, BW_COPY_BYTES), "cudaMalloc (bandwidth source, 4 GiB)");
    CUDA_OK(cudaMalloc(&dst, BW_COPY_BYTES), "cudaMalloc (bandwidth destination, 4 GiB)");
    CUDA_OK(cudaMemset(src, 0x5a, BW_COPY_BYTES), "cudaMemset");
    CUDA_OK(cudaEventCreate(&e0), "cudaEventCreate");
    CUDA_OK(cudaEventCreate(&e1), "cudaEventCreate");
    CUDA_OK(cudaMemcpy(dst, src, BW_COPY_BYTES, cudaMemcpyDeviceToDevice), "warm-up copy");
    for (int i = 0; i < BW_REPS; i++) {
        float ms = 0;
        CUDA_OK(cudaEventRecord(e0, 0), "cudaEventRecord");
        CUDA_OK(cudaMemcpyAsync(dst, src, BW_COPY_BYTES, cudaMemcpyDeviceToDevice, 0),
                "device-to-device copy");
        CUDA_OK(cudaEventRecord(e1, 0), "cudaEventRecord");
        CUDA_OK(cudaEventSynchronize(e1), "cudaEventSynchronize");
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
        samples[i] = 2.0 * (double)BW_COPY_BYTES / ((double)ms * 1e-3) / 1e9;
    }
done:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(src);
    cudaFree(dst);
    return rc;
}

typedef struct merge_result {
    int32_t n;
    double total_s, median_ms, max_ms;
    double proj_median_ms[ENG_N_PROJ];
} merge_result;

/* Merge adapter l's module into layer `layer`'s projection p on the
 * device; *secs gets the time of qt_cuda_merge alone. */
static int merge_one(const eng_model *m, const eng_lora *lora, int32_t layer, eng_proj p,
                     double *secs, char *msg, size_t msg_len)
{
    char why[256];
    qt_cuda_tensor w = {0}, a = {0}, bm = {0}, out = {0};
    const eng_lora_module *mod = eng_lora_module_at(lora, layer, p);
    int qrc = qt_cuda_tensor_upload(eng_model_proj(m, layer, p), &w, why, sizeof why);
    if (qrc == QL_OK)
        qrc = qt_cuda_tensor_upload(&mod->a, &a, why, sizeof why);
    if (qrc == QL_OK)
        qrc = qt_cuda_tensor_upload(&mod->b, &bm, why, sizeof why);
    if (qrc == QL_OK) {
        qt_cuda_lora_term term = {.a = a.dense,
                                  .b = bm.dense,
                                  .a_kind = mod->a.kind,
                                  .b_kind = mod->b.kind,
                                  .rank = (int32_t)mod->a.rows,
                                  .scale = 1.0f,
                                  .module_scale = mod->scale};
        double t0 = now_s();
        qrc = qt_cuda_merge(&w, &term, 1, &out, NULL, NULL, why, sizeof why);
        *secs = now_s() - t0;
    }
    qt_cuda_tensor_release(&out, NULL, 0);
    qt_cuda_tensor_release(&bm, NULL, 0);
    qt_cuda_tensor_release(&a, NULL, 0);
    qt_cuda_tensor_release(&w, NULL, 0);
    if (qrc != QL_OK)
        return ql_fail(msg, msg_len, QL_EDEVICE, "merge into layer %d %s: %s", layer,
                       eng_proj_name(p), why);
    return QL_OK;
}

static int merge_all(const eng_model *m, const eng_lora *lora, merge_result *res, char *msg,
                     size_t msg_len)
{
    int32_t L = m->cfg.n_layers, n = L * ENG_N_PROJ;
    double *all = malloc((size_t)n * sizeof *all), *per = malloc((size_t)L * sizeof *per);
    if (!all || !per) {
        free(all);
        free(per);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    double warm;
    int rc = merge_one(m, lora, 0, ENG_PROJ_Q, &warm, msg, msg_len);
    memset(res, 0, sizeof *res);
    for (int32_t i = 0; rc == QL_OK && i < n; i++) {
        rc = merge_one(m, lora, i / ENG_N_PROJ, (eng_proj)(i % ENG_N_PROJ), &all[i], msg, msg_len);
        res->total_s += all[i];
        if (all[i] * 1e3 > res->max_ms)
            res->max_ms = all[i] * 1e3;
    }
    for (int p = 0; rc == QL_OK && p < ENG_N_PROJ; p++) {
        for (int32_t l = 0; l < L; l++)
            per[l] = all[(size_t)l * ENG_N_PROJ + (size_t)p];
        res->proj_median_ms[p] = median(per, (size_t)L) * 1e3;
    }
    if (rc == QL_OK) {
        res->n = n;
        res->median_ms = median(all, (size_t)n) * 1e3;
    }
    free(all);
    free(per);
    return rc;
}

/* s made safe inside a JSON string, in place: quotes and backslashes become
 * ', control characters spaces. */
static char *json_safe(char *s)
{
    for (char *c = s; *c; c++)
        if (*c == '"' || *c == '\\')
            *c = '\'';
        else if ((unsigned char)*c < 0x20)
            *c = ' ';
    return s;
}

/* --- main ----------------------------------------------------------------------- */

static int parse(int argc, char **argv, bench_opts *o)
{
    *o = (bench_opts){.layers = 32, .steps = 32, .prefill = 128, .merge = true, .adapters = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int32_t *num = NULL;
        if (strcmp(a, "--layers") == 0)
            num = &o->layers;
        else if (strcmp(a, "--steps") == 0)
            num = &o->steps;
        else if (strcmp(a, "--prefill") == 0)
            num = &o->prefill;
        else if (strcmp(a, "--no-merge") == 0)
            o->merge = false;
        else if (strcmp(a, "--no-adapters") == 0)
            o->adapters = false;
        else if (strcmp(a, "--cpu-smoke") == 0)
            o->cpu_smoke = true;
        else {
            fprintf(stderr, "bench_cuda: unknown argument %s\n", a);
            return -1;
        }
        if (num) {
            if (i + 1 >= argc || (*num = atoi(argv[++i])) < 1) {
                fprintf(stderr, "bench_cuda: %s needs a positive number\n", a);
                return -1;
            }
        }
    }
    if (o->cpu_smoke) {
        o->layers = o->layers < 2 ? o->layers : 2;
        o->steps = o->steps < 4 ? o->steps : 4;
        o->prefill = o->prefill < 16 ? o->prefill : 16;
        o->merge = false;
    }
    return 0;
}

int main(int argc, char **argv)
{
    bench_opts o;
    if (parse(argc, argv, &o) != 0)
        return 1;
    double wall0 = now_s();
    char msg[512] = "", describe[512] = "", backend[256] = "";
    /* what the backend's large-batch products multiply in (backend_cuda.c) */
    const char *gemm = getenv("QLSERVE_CUDA_GEMM");
    char gemm_s[16];
    snprintf(gemm_s, sizeof gemm_s, "%s", gemm && *gemm ? gemm : "f32");
    const char *stage = "start";
    int rc = QL_OK;

    /* the device, or exit 77 */
    char device[256] = "cpu";
    if (!o.cpu_smoke) {
        int count = 0;
        if (qt_cuda_device_count(&count, msg, sizeof msg) != QL_OK || count < 1) {
            printf("{\"bench\": \"bench_cuda\", \"skipped\": \"no usable CUDA device: %s\"}\n",
                   msg);
            fprintf(stderr, "bench_cuda: no usable CUDA device (%s)\n", msg);
            return 77;
        }
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
            snprintf(device, sizeof device, "%.200s (sm_%d%d, %.1f GiB)", prop.name, prop.major,
                     prop.minor, (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
        qt_cuda_describe(describe, sizeof describe);
    }

    eng_config cfg = bench_config(&o);
    static const int32_t batches_gpu[MAX_BATCHES] = {1, 8, 16, 32, 64};
    static const int32_t batches_cpu[MAX_BATCHES] = {1, 2, 4, 8, 16};
    const int32_t *batches = o.cpu_smoke ? batches_cpu : batches_gpu;
    const int32_t max_batch = batches[MAX_BATCHES - 1];
    /* prefill, then per run one untimed step and `steps` timed: one run per
     * batch, two more (adapters, none) on the largest; the arena holds 512
     * positions per sequence, as many as 64 sequences of 512 */
    int32_t positions = o.prefill + 3 * (o.steps + 1);
    int32_t arena_positions = positions > 512 ? positions : 512;
    int32_t max_tokens = o.cpu_smoke ? 256 : 4096;
    size_t pos_bytes =
        (size_t)cfg.n_layers * 2 * (size_t)cfg.n_kv_heads * (size_t)cfg.head_dim * sizeof(float);
    size_t kv_bytes = (size_t)max_batch * (size_t)arena_positions * pos_bytes;

    eng_model m = {0};
    eng_backend *b = NULL;
    eng_lora *loras[N_ADAPTERS] = {0};
    lora_pool pool = {0};
    batch_run big = {0};
    double bw[BW_REPS] = {0}, bw_median = 0;
    double make_s = 0, new_s = 0, floor_s = 0;
    size_t wbytes = 0;
    struct {
        int32_t batch;
        double prefill_s, seconds, tps, step_ms_median;
    } dec[MAX_BATCHES] = {{0}};
    double ad_tps = 0, none_tps = 0, ad_first_s = 0, ad_med_ms = 0, none_med_ms = 0;
    merge_result mr = {0};
    double pf_s[2] = {0, 0}; /* best prefill seconds with f32, bf16 products */
    double *step_s = calloc((size_t)o.steps, sizeof *step_s);
    if (!step_s)
        return 1;

    /* bandwidth first, while the device is empty */
    if (!o.cpu_smoke) {
        stage = "bandwidth";
        rc = copy_bandwidth(bw, msg, sizeof msg);
        if (rc != QL_OK)
            goto out;
        double tmp[BW_REPS];
        memcpy(tmp, bw, sizeof tmp);
        bw_median = median(tmp, BW_REPS);
        fprintf(stderr, "timing bandwidth d2d copy %.0f GB/s (median of %d, 4 GiB)\n", bw_median,
                BW_REPS);
    }

    stage = "making the model";
    double t0 = now_s();
    if ((rc = model_make(&m, &cfg)) != QL_OK) {
        snprintf(msg, sizeof msg, "out of host memory making the model");
        rc = QL_ENOMEM;
        goto out;
    }
    make_s = now_s() - t0;
    wbytes = step_weight_bytes(&m);
    if (bw_median > 0)
        floor_s = (double)wbytes / (bw_median * 1e9);
    fprintf(stderr, "timing make_model %.2f s (%.2f GB read per decode step)\n", make_s,
            (double)wbytes / 1e9);

    stage = "making the backend";
    eng_backend_opts bo = {.device = o.cpu_smoke ? ENG_DEVICE_CPU : ENG_DEVICE_CUDA,
                           .max_tokens = max_tokens,
                           .max_seqs = max_batch,
                           .kv_bytes = kv_bytes,
                           .block_tokens = 16};
    t0 = now_s();
    if ((rc = eng_backend_new(&b, &m, &bo, msg, sizeof msg)) != QL_OK)
        goto out;
    new_s = now_s() - t0;
    snprintf(backend, sizeof backend, "%s", eng_backend_describe(b));
    fprintf(stderr, "timing backend_new %.2f s: %s\n", new_s, backend);

    /* decode at each batch size; the largest batch stays for the adapters */
    for (int k = 0; k < MAX_BATCHES; k++) {
        batch_run r;
        int32_t B = batches[k];
        static char what[64];
        snprintf(what, sizeof what, "decode at batch %d", B);
        stage = what;
        rc = batch_start(b, &cfg, &r, B, positions, o.prefill, max_tokens, &dec[k].prefill_s, msg,
                         sizeof msg);
        if (rc == QL_OK)
            rc = batch_decode(b, &r, 1, NULL, 1, NULL, msg, sizeof msg);
        if (rc == QL_OK)
            rc = batch_decode(b, &r, o.steps, NULL, 1, step_s, msg, sizeof msg);
        if (rc != QL_OK) {
            batch_free(b, &r);
            goto out;
        }
        dec[k].batch = B;
        dec[k].seconds = sum(step_s, o.steps);
        dec[k].tps = (double)B * o.steps / dec[k].seconds;
        dec[k].step_ms_median = median(step_s, (size_t)o.steps) * 1e3;
        fprintf(stderr,
                "timing decode batch %d: %.1f tok/s, step %.2f ms (median), floor %.2f ms; "
                "prefill %d x %d in %.2f s\n",
                B, dec[k].tps, dec[k].step_ms_median, floor_s * 1e3, B, o.prefill,
                dec[k].prefill_s);
        if (k == MAX_BATCHES - 1)
            big = r;
        else
            batch_free(b, &r);
    }

    /* 8 adapters, every 8 sequences one, against none, on the largest batch */
    if (o.adapters) {
        stage = "adapters";
        pool.n = lora_elements(&cfg) + ((size_t)N_ADAPTERS << 20) + 12345u * N_ADAPTERS;
        pool.v = malloc(pool.n * sizeof *pool.v);
        if (!pool.v) {
            rc = ql_fail(msg, sizeof msg, QL_ENOMEM, "out of memory for the adapters");
            goto out;
        }
        fill(FILL_BF16, pool.v, pool.n, -0.02f, 0.02f, 77);
        eng_lora_term terms[N_ADAPTERS];
        for (int k = 0; k < N_ADAPTERS; k++) {
            if (!(loras[k] = lora_make(&cfg, &pool, k))) {
                rc = ql_fail(msg, sizeof msg, QL_ENOMEM, "out of memory for the adapters");
                goto out;
            }
            terms[k] = (eng_lora_term){.lora = loras[k], .scale = 1.0f};
        }
        int32_t per = big.n / N_ADAPTERS > 0 ? big.n / N_ADAPTERS : 1;
        double first[1];
        rc = batch_decode(b, &big, 1, terms, per, first, msg, sizeof msg);
        if (rc == QL_OK) {
            ad_first_s = first[0];
            rc = batch_decode(b, &big, o.steps, terms, per, step_s, msg, sizeof msg);
        }
        if (rc != QL_OK)
            goto out;
        ad_tps = (double)big.n * o.steps / sum(step_s, o.steps);
        ad_med_ms = median(step_s, (size_t)o.steps) * 1e3;
        rc = batch_decode(b, &big, 1, NULL, 1, NULL, msg, sizeof msg);
        if (rc == QL_OK)
            rc = batch_decode(b, &big, o.steps, NULL, 1, step_s, msg, sizeof msg);
        if (rc != QL_OK)
            goto out;
        none_tps = (double)big.n * o.steps / sum(step_s, o.steps);
        none_med_ms = median(step_s, (size_t)o.steps) * 1e3;
        fprintf(stderr,
                "timing adapters batch %d: %d distinct rank-%d adapters %.1f tok/s, none %.1f "
                "tok/s (x%.3f); first step with them (upload) %.2f s\n",
                big.n, N_ADAPTERS, ADAPTER_RANK, ad_tps, none_tps, ad_tps / none_tps, ad_first_s);
    }
    batch_free(b, &big);
    eng_backend_free(b);
    b = NULL;

    /* prefill of 32 x prefill tokens in one step, the weights' products in
     * f32 (the default: the closest to the CPU) and in bf16 on the tensor
     * cores (QLSERVE_CUDA_GEMM=bf16): one backend each, a warm-up step
     * (cuBLASLt's plans), then two timed */
    if (!o.cpu_smoke) {
        const char *types[2] = {"f32", "bf16"};
        for (int g = 0; g < 2; g++) {
            static char what[64];
            snprintf(what, sizeof what, "prefill with %s products", types[g]);
            stage = what;
            setenv("QLSERVE_CUDA_GEMM", types[g], 1);
            eng_backend_opts po = bo;
            po.max_seqs = PREFILL_SEQS;
            po.kv_bytes = (size_t)PREFILL_SEQS * (size_t)(o.prefill + 16) * pos_bytes;
            rc = eng_backend_new(&b, &m, &po, msg, sizeof msg);
            for (int rep = 0; rc == QL_OK && rep < 3; rep++) {
                batch_run r;
                double s_taken = 0;
                rc = batch_start(b, &cfg, &r, PREFILL_SEQS, o.prefill, o.prefill, max_tokens,
                                 &s_taken, msg, sizeof msg);
                batch_free(b, &r);
                if (rep > 0 && (pf_s[g] == 0 || s_taken < pf_s[g]))
                    pf_s[g] = s_taken;
            }
            eng_backend_free(b);
            b = NULL;
            if (rc != QL_OK)
                goto out;
            fprintf(stderr, "timing prefill %s: %d x %d tokens in %.3f s: %.0f tok/s\n", types[g],
                    PREFILL_SEQS, o.prefill, pf_s[g], PREFILL_SEQS * (double)o.prefill / pf_s[g]);
        }
        if (gemm && *gemm)
            setenv("QLSERVE_CUDA_GEMM", gemm_s, 1);
        else
            unsetenv("QLSERVE_CUDA_GEMM");
    }

    /* merge adapter 0 into every projection, on the device */
    if (o.merge && o.adapters) {
        stage = "merge";
        rc = merge_all(&m, loras[0], &mr, msg, sizeof msg);
        if (rc != QL_OK)
            goto out;
        fprintf(stderr,
                "timing merge rank-%d into %d projections: %.2f s in all, %.2f ms median, "
                "%.2f ms max\n",
                ADAPTER_RANK, mr.n, mr.total_s, mr.median_ms, mr.max_ms);
    }

out:
    if (b) {
        batch_free(b, &big);
        eng_backend_free(b);
    }
    for (int k = 0; k < N_ADAPTERS; k++)
        if (loras[k])
            eng_lora_unref(loras[k]);
    free(pool.v);

    /* the JSON document */
    printf("{\n  \"bench\": \"bench_cuda\",\n");
    printf("  \"device\": \"%s\",\n", json_safe(device));
    printf("  \"cuda\": \"%s\",\n", json_safe(describe));
    printf("  \"backend\": \"%s\",\n", json_safe(backend));
    printf("  \"inputs\": {\"model\": \"llama-2-7b shape, random weights\", \"hidden\": %d, "
           "\"intermediate\": %d, \"layers\": %d, \"heads\": %d, \"kv_heads\": %d, "
           "\"head_dim\": %d, \"vocab\": %d, \"kind\": \"nf4\", \"blocksize\": 64, "
           "\"nested\": false, \"lm_head\": \"bf16\", \"prefill_tokens\": %d, "
           "\"decode_steps\": %d, \"batches\": [",
           cfg.hidden_size, cfg.intermediate_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
           cfg.head_dim, cfg.vocab_size, o.prefill, o.steps);
    for (int k = 0; k < MAX_BATCHES; k++)
        printf("%s%d", k ? ", " : "", batches[k]);
    printf("], \"adapter_rank\": %d, \"adapters\": %d, \"max_tokens\": %d, \"kv_bytes\": %zu, "
           "\"gemm\": \"%s\", \"cpu_smoke\": %s},\n",
           ADAPTER_RANK, N_ADAPTERS, max_tokens, kv_bytes, json_safe(gemm_s),
           o.cpu_smoke ? "true" : "false");
    printf("  \"setup\": {\"make_model_s\": %.3f, \"backend_new_s\": %.3f},\n", make_s, new_s);
    printf("  \"bandwidth\": {\"d2d_copy_bytes\": %zu, \"gb_per_s_median\": %.1f, "
           "\"gb_per_s\": [%.1f, %.1f, %.1f, %.1f, %.1f]},\n",
           BW_COPY_BYTES, bw_median, bw[0], bw[1], bw[2], bw[3], bw[4]);
    printf("  \"floor\": {\"weight_bytes_per_step\": %zu, \"step_ms\": %.3f, "
           "\"tokens_per_s_batch1\": %.1f},\n",
           wbytes, floor_s * 1e3, floor_s > 0 ? 1.0 / floor_s : 0.0);
    printf("  \"decode\": [");
    for (int k = 0; k < MAX_BATCHES; k++) {
        double step_ms = dec[k].step_ms_median;
        printf("%s\n    {\"batch\": %d, \"tokens_per_s\": %.1f, \"seconds\": %.4f, "
               "\"step_ms_median\": %.3f, \"step_vs_floor\": %.2f, \"of_floor\": %.3f, "
               "\"prefill_s\": %.3f}",
               k ? "," : "", dec[k].batch, dec[k].tps, dec[k].seconds, step_ms,
               floor_s > 0 ? step_ms / (floor_s * 1e3) : 0.0,
               step_ms > 0 ? floor_s * 1e3 / step_ms : 0.0, dec[k].prefill_s);
    }
    printf("\n  ],\n");
    printf("  \"batch1_of_floor\": %.3f,\n",
           floor_s > 0 && dec[0].tps > 0 ? dec[0].tps * floor_s : 0.0);
    printf("  \"adapters\": {\"batch\": %d, \"distinct\": %d, \"tokens_per_s_adapters\": %.1f, "
           "\"tokens_per_s_none\": %.1f, \"ratio\": %.3f, \"step_ms_median_adapters\": %.3f, "
           "\"step_ms_median_none\": %.3f, \"first_step_s\": %.3f},\n",
           max_batch, N_ADAPTERS, ad_tps, none_tps, none_tps > 0 ? ad_tps / none_tps : 0.0,
           ad_med_ms, none_med_ms, ad_first_s);
    printf("  \"prefill\": {\"sequences\": %d, \"tokens_each\": %d, \"f32_s\": %.4f, "
           "\"bf16_s\": %.4f, \"f32_tokens_per_s\": %.0f, \"bf16_tokens_per_s\": %.0f, "
           "\"bf16_speedup\": %.2f},\n",
           PREFILL_SEQS, o.prefill, pf_s[0], pf_s[1],
           pf_s[0] > 0 ? PREFILL_SEQS * (double)o.prefill / pf_s[0] : 0.0,
           pf_s[1] > 0 ? PREFILL_SEQS * (double)o.prefill / pf_s[1] : 0.0,
           pf_s[0] > 0 && pf_s[1] > 0 ? pf_s[0] / pf_s[1] : 0.0);
    printf("  \"merge\": {\"projections\": %d, \"seconds_total\": %.3f, \"ms_median\": %.3f, "
           "\"ms_max\": %.3f, \"ms_median_per_proj\": {",
           mr.n, mr.total_s, mr.median_ms, mr.max_ms);
    for (int p = 0; p < ENG_N_PROJ; p++)
        printf("%s\"%s\": %.3f", p ? ", " : "", eng_proj_name((eng_proj)p), mr.proj_median_ms[p]);
    printf("}},\n");
    printf("  \"wall_s\": %.2f,\n", now_s() - wall0);
    if (rc != QL_OK) {
        printf("  \"error\": \"%s: %s\",\n", stage, json_safe(msg));
        fprintf(stderr, "bench_cuda: %s: %s\n", stage, msg);
    }
    printf("  \"ok\": %s\n}\n", rc == QL_OK ? "true" : "false");
    model_free(&m);
    free(step_s);
    return rc == QL_OK ? 0 : 1;
}

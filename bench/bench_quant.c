/*
 * bench_quant.c - throughput of the quantization core on this CPU, as JSON.
 *
 * For each kind, on one 4096 x 4096 weight (N(0, 0.02), as an LLM's linear
 * layers are): dequantization throughput, and GFLOP/s of y = x @ W^T at
 * batch 1, 8 and 32 through qt_matmul (the fast path this CPU takes; at
 * 32 also AVX2's, b32_avx2_gflops, beside AVX-512's where the CPU has it),
 * the same with 8-bit activations (q8_b1_gflops, q8_b8_gflops: --activations
 * q8, where the kind has that path) and through the scalar reference. The peer, measured in the
 * same run on the same weight: a plain f32 y = x @ W^T (the textbook triple loop, compiled with the
 * project's flags), and our F32 kind. Single thread throughout: the worker pool is the engine's;
 * these are per-core figures.
 *
 * The k-quants (q2_k ... q6_k) and iq4_nl, iq4_xs cannot be quantized into
 * yet: their weight is random blocks of the same size (random codes and
 * sub-block scales, small f16 d and dmin), which a matrix kernel reads
 * exactly as it reads a GGUF file's; all but iq4_nl (blocks of 32) need
 * --cols a multiple of 256. GPTQ and AWQ are read from checkpoints only:
 * their weight is a random checkpoint's parts in groups of 128 (random
 * codes and zeros, f16 scales keeping |w| about 0.02; act-order a random
 * g_idx), which the products read as a loaded checkpoint's. FP8 is
 * quantized from the weight in blocks of 128 x 128, both scale widths.
 *
 * Every GFLOP/s figure comes with its fraction of the machine's FMA roof,
 * measured in the same run (fma_roof). --shapes default-model measures the
 * default model's projections instead of one square weight.
 *
 * Usage: bench_quant [--rows N] [--cols N] [--min-seconds S] [--kinds LABEL,LABEL...]
 *                    [--clock wall|cpu] [--shapes default-model]
 * (--kinds: only the kinds whose label is listed, all by default, with
 * --shapes q4_1,q8_0,q4_k; --clock cpu: each call timed by the thread's
 * CPU time, for a shared machine; --cols a multiple of 32, and of a kind's
 * block, else the kind is skipped by name) Each figure is the best of
 * repeated runs lasting at least --min-seconds.
 */
#include "qtensor.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* What a call is timed by: wall time (the default), or with --clock cpu
 * this thread's CPU time, which on a machine shared with other work leaves
 * out the time the thread waited for a core (not the caches the others
 * share). The repetition budget (--min-seconds) is wall time either way. */
static clockid_t call_clock = CLOCK_MONOTONIC;

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double now(void)
{
    return clock_s(CLOCK_MONOTONIC);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void)
{
    /* xorshift64*: reproducible inputs across runs and machines */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) * 0x1.0p-53;
}

static float normal(float sd)
{
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300)
        u1 = 1e-300;
    return (float)(sd * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/*
 * The machine's FMA roof, measured in the same run: one thread running
 * ROOF_CHAINS independent chains of fused multiply-adds (more than an FMA's
 * latency times the FMA pipes, on the x86 cores we know: 4 cycles times 2),
 * 256-bit vectors (what matmul_f32.inc's products compute in) and 512-bit
 * ones, best of ROOF_REPEATS. Each FMA counts 2 flops a lane, as the
 * products' 2 * rows * cols does.
 */
#define ROOF_CHAINS  12 /* 12 accumulators + 2 constants fit AVX2's 16 registers */
#define ROOF_ITERS   (1 << 20)
#define ROOF_REPEATS 9

__attribute__((target("avx2,fma"))) static float fma_chains256(int64_t iters)
{
    __m256 acc[ROOF_CHAINS], mul = _mm256_set1_ps(0.9999999f), add = _mm256_set1_ps(1e-7f);
    for (int j = 0; j < ROOF_CHAINS; j++)
        acc[j] = _mm256_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++)
        _Pragma("GCC unroll 12") for (int j = 0; j < ROOF_CHAINS; j++) acc[j] =
            _mm256_fmadd_ps(acc[j], mul, add);
    float out[8], sum = 0.0f;
    for (int j = 0; j < ROOF_CHAINS; j++) {
        _mm256_storeu_ps(out, acc[j]);
        sum += out[0];
    }
    return sum; /* keeps the chains live */
}

__attribute__((target("avx512f"))) static float fma_chains512(int64_t iters)
{
    __m512 acc[ROOF_CHAINS], mul = _mm512_set1_ps(0.9999999f), add = _mm512_set1_ps(1e-7f);
    for (int j = 0; j < ROOF_CHAINS; j++)
        acc[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++)
        _Pragma("GCC unroll 12") for (int j = 0; j < ROOF_CHAINS; j++) acc[j] =
            _mm512_fmadd_ps(acc[j], mul, add);
    float out[16], sum = 0.0f;
    for (int j = 0; j < ROOF_CHAINS; j++) {
        _mm512_storeu_ps(out, acc[j]);
        sum += out[0];
    }
    return sum;
}

/* GFLOP/s of one thread's FMA chains at `lanes` f32 lanes (8 or 16), the
 * best of ROOF_REPEATS runs; 0 where the CPU lacks the instructions. */
static double fma_roof(int lanes)
{
    __builtin_cpu_init();
    if (lanes == 8 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return 0.0;
    if (lanes == 16 && !__builtin_cpu_supports("avx512f"))
        return 0.0;
    double best = 1e30;
    volatile float sink = 0.0f;
    for (int k = 0; k < ROOF_REPEATS; k++) {
        double t0 = clock_s(call_clock);
        sink += lanes == 8 ? fma_chains256(ROOF_ITERS) : fma_chains512(ROOF_ITERS);
        double dt = clock_s(call_clock) - t0;
        best = dt < best ? dt : best;
    }
    (void)sink;
    return 2.0 * lanes * ROOF_CHAINS * (double)ROOF_ITERS / best / 1e9;
}

typedef struct bench_ctx {
    const qtensor *w;
    const float *x;
    float *y;
    float *buf;
    int64_t batch;
    const float *dense; /* for the naive peer */
    int64_t rows, cols;
} bench_ctx;

typedef void (*bench_fn)(bench_ctx *c);

/* Best seconds per call over repeated calls lasting at least min_s. */
static double best_time(bench_fn fn, bench_ctx *c, double min_s)
{
    double best = 1e30, start = now();
    int runs = 0;
    do {
        double t0 = clock_s(call_clock);
        fn(c);
        double dt = clock_s(call_clock) - t0;
        best = dt < best ? dt : best;
        runs++;
    } while (now() - start < min_s || runs < 3);
    return best;
}

static void run_dequant(bench_ctx *c)
{
    for (int64_t r = 0; r < c->w->rows; r += 64) {
        int64_t n = c->w->rows - r < 64 ? c->w->rows - r : 64;
        qt_dequantize_rows(c->w, r, n, c->buf);
    }
}

static void run_matmul(bench_ctx *c)
{
    qt_matmul(c->w, c->x, c->batch, c->y, 0, c->w->rows);
}

static void run_matmul_ref(bench_ctx *c)
{
    qt_matmul_ref(c->w, c->x, c->batch, c->y, 0, c->w->rows);
}

static void run_naive_f32(bench_ctx *c)
{
    int64_t rows = c->rows, cols = c->cols;
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < cols; k++)
                acc += c->x[b * cols + k] * c->dense[r * cols + k];
            c->y[b * rows + r] = acc;
        }
}

typedef struct kind_case {
    const char *label;
    qt_quant_params p;
    bool kquant;       /* random super-blocks instead of qt_quantize */
    int32_t gptq_bits; /* > 0: a random GPTQ/AWQ checkpoint's parts (qt_from_gptq) */
    bool awq, act_order;
} kind_case;

/* Where a read-in-place kind keeps its f16 d and dmin (-1: none), and the
 * size of d that keeps |w| about 0.02 (Q6_K's and IQ4_XS's sub-block scale
 * times code reaches ~4000, the others' ~50 to ~250). */
static void kquant_layout(qt_kind kind, int *d_at, int *dmin_at, float *dscale)
{
    *d_at = 0;
    *dmin_at = -1;
    *dscale = 1e-4f;
    switch (kind) {
    case QT_Q4_K:
    case QT_Q5_K: *dmin_at = 2; break;
    case QT_Q6_K:
        *d_at = 208;
        *dscale = 2e-5f;
        break;
    case QT_Q2_K: *d_at = 80, *dmin_at = 82; break;
    case QT_Q3_K: *d_at = 108; break;
    case QT_IQ4_XS: *dscale = 2e-5f; break;
    default: break; /* IQ4_NL: d first */
    }
}

/* A rows x cols weight of a read-in-place kind, random blocks: random
 * bytes, each block's f16 d (and dmin) a small normal value (|w| about
 * 0.02). */
static int random_kquant(qtensor *q, qt_kind kind, int64_t rows, int64_t cols, char *msg,
                         size_t msg_len)
{
    size_t bb = qt_traits_table[kind].block_bytes;
    size_t nb = (size_t)(rows * cols / qt_traits_table[kind].block_size);
    int d_at, dmin_at;
    float dscale;
    kquant_layout(kind, &d_at, &dmin_at, &dscale);
    uint8_t *b = malloc(nb * bb);
    if (!b)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (size_t i = 0; i < nb * bb; i++)
        b[i] = (uint8_t)(uniform() * 256.0);
    for (size_t i = 0; i < nb; i++) {
        uint8_t *blk = b + i * bb;
        uint16_t d = qt_f32_to_f16(normal(dscale));
        uint16_t dmin = qt_f32_to_f16(fabsf(normal(1e-4f)));
        memcpy(blk + d_at, &d, 2); /* little-endian, as the file */
        if (dmin_at >= 0)
            memcpy(blk + dmin_at, &dmin, 2);
    }
    int rc = qt_from_gguf_blocks(q, kind, b, nb * bb, rows, cols, msg, msg_len);
    free(b);
    return rc;
}

/* A rows x cols GPTQ (or AWQ) weight in groups of 128 read from random
 * parts, as a checkpoint's: random codes and zeros, f16 scales about 0.002
 * (|w| about 0.02), act-order g_idx a random permutation's groups. The
 * parts live as long as the tensor (*parts, freed by the caller after
 * qt_free). */
static int random_gptq(qtensor *q, const kind_case *kc, int64_t rows, int64_t cols, void **parts,
                       char *msg, size_t msg_len)
{
    int64_t groups = cols / 128;
    size_t qb = (size_t)(rows * cols * kc->gptq_bits / 8), zb = (size_t)(groups * rows) * 4;
    size_t sb = (size_t)(groups * rows) * 2, gb = (size_t)cols * 4;
    uint8_t *m = malloc(qb + zb + sb + gb);
    if (!m)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (size_t i = 0; i < qb + zb; i++)
        m[i] = (uint8_t)(uniform() * 256.0);
    for (int64_t i = 0; i < groups * rows; i++) {
        uint16_t h = qt_f32_to_f16(0.001f + 0.002f * (float)uniform());
        memcpy(m + qb + zb + i * 2, &h, 2);
    }
    int32_t *g = (int32_t *)(void *)(m + qb + zb + sb);
    for (int64_t c = 0; c < cols; c++)
        g[c] = (int32_t)c;
    for (int64_t c = cols - 1; c > 0; c--) {
        int64_t j = (int64_t)(uniform() * (double)(c + 1));
        int32_t t = g[c];
        g[c] = g[j];
        g[j] = t;
    }
    for (int64_t c = 0; c < cols; c++)
        g[c] /= 128;
    qt_gptq_parts p = {.rows = rows,
                       .cols = cols,
                       .bits = kc->gptq_bits,
                       .group_size = 128,
                       .awq = kc->awq,
                       .qweight = m,
                       .borrow_codes = true,
                       .qzeros = m + qb,
                       .scales = m + qb + zb,
                       .g_idx = kc->act_order ? m + qb + zb + sb : NULL,
                       .groups = groups};
    int rc = qt_from_gptq(q, &p, msg, msg_len);
    if (rc != QL_OK)
        free(m);
    else
        *parts = m;
    return rc;
}

/* Whether label is one of the comma-separated labels in list. */
static bool listed(const char *list, const char *label)
{
    size_t n = strlen(label);
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ",");
        if (len == n && strncmp(p, label, n) == 0)
            return true;
        p += len + (p[len] == ',');
    }
    return false;
}

static void cpu_model(char *buf, size_t len)
{
    snprintf(buf, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *v = strchr(line, ':');
            if (v) {
                v += 2;
                v[strcspn(v, "\n")] = 0;
                for (char *q = v; *q; q++)
                    if (*q == '"' || *q == '\\')
                        *q = ' ';
                snprintf(buf, len, "%s", v);
            }
            break;
        }
    }
    fclose(f);
}

/* The kinds bench_quant knows, by label. */
static const kind_case cases[] = {
    {"f32", {.kind = QT_F32}, .kquant = false},
    {"f16", {.kind = QT_F16}, .kquant = false},
    {"bf16", {.kind = QT_BF16}, .kquant = false},
    {"nf4", {.kind = QT_NF4, .blocksize = 64}, .kquant = false},
    {"nf4-dq", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}, .kquant = false},
    {"fp4", {.kind = QT_FP4, .blocksize = 64}, .kquant = false},
    {"int4-g128",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 128, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f},
     .kquant = false},
    {"int8-channel", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, .kquant = false},
    {"q4_0", {.kind = QT_Q4_0}, .kquant = false},
    {"q4_1", {.kind = QT_Q4_1}, .kquant = false},
    {"q8_0", {.kind = QT_Q8_0}, .kquant = false},
    {"q5_0", {.kind = QT_Q5_0}, .kquant = false},
    {"q5_1", {.kind = QT_Q5_1}, .kquant = false},
    {"q4_k", {.kind = QT_Q4_K}, .kquant = true},
    {"q5_k", {.kind = QT_Q5_K}, .kquant = true},
    {"q6_k", {.kind = QT_Q6_K}, .kquant = true},
    {"q2_k", {.kind = QT_Q2_K}, .kquant = true},
    {"q3_k", {.kind = QT_Q3_K}, .kquant = true},
    {"iq4_nl", {.kind = QT_IQ4_NL}, .kquant = true},
    {"iq4_xs", {.kind = QT_IQ4_XS}, .kquant = true},
    {"fp8-b128", {.kind = QT_FP8, .block_rows = 128, .block_cols = 128}, .kquant = false},
    {"fp8-b128-ue8m0",
     {.kind = QT_FP8, .block_rows = 128, .block_cols = 128, .scale_dtype = QT_SCALE_E8M0},
     .kquant = false},
    {"gptq-4bit-g128", {.kind = QT_GPTQ}, .gptq_bits = 4},
    {"gptq-4bit-g128-act-order", {.kind = QT_GPTQ}, .gptq_bits = 4, .act_order = true},
    {"gptq-8bit-g128", {.kind = QT_GPTQ}, .gptq_bits = 8},
    {"awq-4bit-g128", {.kind = QT_AWQ}, .gptq_bits = 4, .awq = true},
};
#define N_CASES (sizeof cases / sizeof *cases)

/* The default model's projections (SmolLM2-135M: hidden 576, intermediate
 * 1536, 9 query heads and 3 KV heads of 64, 30 layers, vocabulary 49152,
 * the output head tied to the embedding), as rows x cols of W, and how many
 * of each a decode step runs. */
typedef struct model_shape {
    const char *name;
    int64_t rows, cols, per_step;
} model_shape;

static const model_shape default_model_shapes[] = {
    {"q,o", 576, 576, 60},   {"k,v", 192, 576, 60},      {"gate,up", 1536, 576, 60},
    {"down", 576, 1536, 30}, {"lm_head", 49152, 576, 1},
};
#define N_SHAPES (sizeof default_model_shapes / sizeof *default_model_shapes)

/* The run's settings and the buffers every kind reuses. */
typedef struct bench_run {
    int64_t rows, cols;
    double min_s;
    const char *only; /* --kinds, or NULL */
    double roof;      /* the larger FMA roof, GFLOP/s */
    float *w, *x, *y, *buf;
} bench_run;

/* Whether a kind's blocks or groups tile rows of cols (the k-quants and
 * IQ4_XS 256, the blocks-of-32 kinds 32, GPTQ/AWQ's groups and FP8's
 * blocks 128). */
static bool kind_fits(const kind_case *kc, int64_t cols)
{
    if (kc->gptq_bits || kc->p.kind == QT_FP8)
        return cols % 128 == 0;
    int32_t bs = qt_traits_table[kc->p.kind].block_size;
    return bs <= 1 || cols % bs == 0;
}

/* kc's rows x cols weight from run->w (or random blocks, or a random
 * checkpoint's parts, kept in *parts for the caller to free after qt_free). */
static int make_weight(const bench_run *run, const kind_case *kc, int64_t rows, int64_t cols,
                       qtensor *q, void **parts)
{
    char msg[256];
    *parts = NULL;
    int rc = kc->kquant      ? random_kquant(q, kc->p.kind, rows, cols, msg, sizeof msg)
             : kc->gptq_bits ? random_gptq(q, kc, rows, cols, parts, msg, sizeof msg)
                             : qt_quantize(q, run->w, rows, cols, &kc->p, msg, sizeof msg);
    if (rc != QL_OK)
        fprintf(stderr, "bench_quant: %s: %s\n", kc->label, msg);
    return rc;
}

/* One kind on the run's weight: its row of the kinds table. */
static int measure_kind(const bench_run *run, const kind_case *kc, bench_ctx *c, double naive1,
                        double naive8, bool first)
{
    qtensor q;
    void *parts;
    if (make_weight(run, kc, run->rows, run->cols, &q, &parts) != QL_OK)
        return 1;
    double min_s = run->min_s, flops1 = 2.0 * (double)run->rows * (double)run->cols;
    c->w = &q;
    double dq = best_time(run_dequant, c, min_s);
    c->batch = 1;
    double m1 = best_time(run_matmul, c, min_s);
    double r1 = best_time(run_matmul_ref, c, 0.0);
    c->batch = 8;
    double m8 = best_time(run_matmul, c, min_s);
    /* batch 32 on the kernel set this CPU takes, and on AVX2's (the same
     * where the CPU has no AVX-512) */
    c->batch = 32;
    double m32 = best_time(run_matmul, c, min_s);
    qt_set_no_avx512(true);
    double m32_avx2 = best_time(run_matmul, c, min_s);
    qt_set_no_avx512(false);
    /* the same products with 8-bit activations (--activations q8), where
     * the kind has them (else the f32 figures again) */
    qt_set_activations(QL_ACTIVATIONS_Q8);
    c->batch = 1;
    double q1 = best_time(run_matmul, c, min_s);
    c->batch = 8;
    double q8 = best_time(run_matmul, c, min_s);
    qt_set_activations(QL_ACTIVATIONS_F32);
    double bytes = (double)qt_nbytes(&q), n = (double)(run->rows * run->cols);
    double g1 = flops1 / m1 / 1e9, g8 = 8 * flops1 / m8 / 1e9, g32 = 32 * flops1 / m32 / 1e9;
    double g32_avx2 = 32 * flops1 / m32_avx2 / 1e9;
    printf("%s    {\"kind\": \"%s\", \"bytes\": %.0f, \"bits_per_weight\": %.3f, "
           "\"dequant_gbps_in\": %.2f, \"dequant_gbps_out\": %.2f, "
           "\"b1_gflops\": %.2f, \"b8_gflops\": %.2f, \"b32_gflops\": %.2f, "
           "\"b32_avx2_gflops\": %.2f, \"b1_roof_frac\": %.3f, \"b8_roof_frac\": %.3f, "
           "\"b32_roof_frac\": %.3f, \"b32_avx2_roof_frac\": %.3f, \"b1_ref_gflops\": %.2f, "
           "\"b1_vs_peer\": %.2f, \"b8_vs_peer\": %.2f, \"q8_b1_gflops\": %.2f, "
           "\"q8_b8_gflops\": %.2f, \"q8_b1_roof_frac\": %.3f, \"q8_b8_roof_frac\": %.3f}",
           first ? "" : ",\n", kc->label, bytes, 8.0 * bytes / n, bytes / dq / 1e9,
           4.0 * n / dq / 1e9, g1, g8, g32, g32_avx2, g1 / run->roof, g8 / run->roof,
           g32 / run->roof, g32_avx2 / run->roof, flops1 / r1 / 1e9, naive1 / m1, naive8 / m8,
           flops1 / q1 / 1e9, 8 * flops1 / q8 / 1e9, flops1 / q1 / 1e9 / run->roof,
           8 * flops1 / q8 / 1e9 / run->roof);
    qt_free(&q);
    free(parts);
    return 0;
}

/* The kinds table: every listed kind on the --rows x --cols weight. */
static int run_kinds(const bench_run *run)
{
    bench_ctx c = {.x = run->x,
                   .y = run->y,
                   .buf = run->buf,
                   .dense = run->w,
                   .rows = run->rows,
                   .cols = run->cols};
    double flops1 = 2.0 * (double)run->rows * (double)run->cols;
    c.batch = 1;
    double naive1 = best_time(run_naive_f32, &c, run->min_s);
    c.batch = 8;
    double naive8 = best_time(run_naive_f32, &c, run->min_s);
    printf("  \"peer\": {\"name\": \"plain f32 y = x @ W^T (triple loop)\", "
           "\"b1_gflops\": %.2f, \"b8_gflops\": %.2f},\n",
           flops1 / naive1 / 1e9, 8 * flops1 / naive8 / 1e9);
    printf("  \"kinds\": [\n");
    int n_printed = 0;
    for (size_t k = 0; k < N_CASES; k++) {
        if (run->only && !listed(run->only, cases[k].label))
            continue;
        if (!kind_fits(&cases[k], run->cols)) {
            fprintf(stderr, "bench_quant: %s skipped: its blocks do not tile --cols %lld\n",
                    cases[k].label, (long long)run->cols);
            continue;
        }
        if (measure_kind(run, &cases[k], &c, naive1, naive8, n_printed == 0) != 0)
            return 1;
        n_printed++;
    }
    printf("\n  ]\n");
    return 0;
}

/* One kind over the default model's projections: GFLOP/s per shape at
 * batch 1, 8 and 32 on the kernel set this CPU takes, and a decode step's
 * total (every projection as often as a step runs it, the flops over the
 * time) over the shapes the kind's blocks tile. */
static int measure_shapes(const bench_run *run, const kind_case *kc, bool first)
{
    static const int batches[3] = {1, 8, 32};
    double step_flops[3] = {0}, step_s[3] = {0};
    printf("%s    {\"kind\": \"%s\", \"shapes\": [", first ? "" : ",\n", kc->label);
    int n_printed = 0;
    for (size_t s = 0; s < N_SHAPES; s++) {
        const model_shape *sh = &default_model_shapes[s];
        if (!kind_fits(kc, sh->cols)) {
            fprintf(stderr, "bench_quant: %s %s skipped: its blocks do not tile %lld columns\n",
                    kc->label, sh->name, (long long)sh->cols);
            continue;
        }
        qtensor q;
        void *parts;
        if (make_weight(run, kc, sh->rows, sh->cols, &q, &parts) != QL_OK)
            return 1;
        bench_ctx c = {.w = &q, .x = run->x, .y = run->y, .rows = sh->rows, .cols = sh->cols};
        printf("%s\n      {\"shape\": \"%s\", \"rows\": %lld, \"cols\": %lld, \"per_step\": %lld",
               n_printed++ ? "," : "", sh->name, (long long)sh->rows, (long long)sh->cols,
               (long long)sh->per_step);
        for (int b = 0; b < 3; b++) {
            c.batch = batches[b];
            double t = best_time(run_matmul, &c, run->min_s);
            double flops = 2.0 * (double)(sh->rows * sh->cols) * batches[b];
            step_flops[b] += flops * (double)sh->per_step;
            step_s[b] += t * (double)sh->per_step;
            printf(", \"b%d_gflops\": %.2f, \"b%d_roof_frac\": %.3f", batches[b], flops / t / 1e9,
                   batches[b], flops / t / 1e9 / run->roof);
        }
        printf("}");
        qt_free(&q);
        free(parts);
    }
    printf("\n    ], \"step\"");
    for (int b = 0; b < 3; b++) {
        double g = step_s[b] > 0 ? step_flops[b] / step_s[b] / 1e9 : 0.0;
        printf("%s \"b%d_gflops\": %.2f, \"b%d_roof_frac\": %.3f", b ? "," : ": {", batches[b], g,
               batches[b], g / run->roof);
    }
    printf("}}");
    return 0;
}

/* --shapes default-model: the listed kinds (Q4_1, Q8_0 and Q4_K unless
 * --kinds names others) over the default model's projections. */
static int run_shapes(const bench_run *run)
{
    const char *only = run->only ? run->only : "q4_1,q8_0,q4_k";
    printf("  \"shapes\": \"default-model\",\n  \"kinds\": [\n");
    int n_printed = 0;
    for (size_t k = 0; k < N_CASES; k++) {
        if (!listed(only, cases[k].label))
            continue;
        if (measure_shapes(run, &cases[k], n_printed == 0) != 0)
            return 1;
        n_printed++;
    }
    printf("\n  ]\n");
    return 0;
}

int main(int argc, char **argv)
{
    bench_run run = {.rows = 4096, .cols = 4096, .min_s = 0.3};
    bool shapes = false;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--rows") == 0)
            run.rows = atoll(argv[i + 1]);
        else if (strcmp(argv[i], "--cols") == 0)
            run.cols = atoll(argv[i + 1]);
        else if (strcmp(argv[i], "--min-seconds") == 0)
            run.min_s = atof(argv[i + 1]);
        else if (strcmp(argv[i], "--kinds") == 0)
            run.only = argv[i + 1];
        else if (strcmp(argv[i], "--clock") == 0 && strcmp(argv[i + 1], "cpu") == 0)
            call_clock = CLOCK_THREAD_CPUTIME_ID;
        else if (strcmp(argv[i], "--shapes") == 0) {
            if (strcmp(argv[i + 1], "default-model") != 0) {
                fprintf(stderr, "bench_quant: --shapes %s: only default-model is known\n",
                        argv[i + 1]);
                return 2;
            }
            shapes = true;
        }
    }
    if (run.rows <= 0 || run.cols <= 0 || run.cols % 32 != 0) {
        fprintf(stderr, "bench_quant: --rows must be positive, --cols a positive multiple of 32\n");
        return 2;
    }
    /* the largest weight and x either mode needs */
    int64_t w_elems = shapes ? 49152 * 576 : run.rows * run.cols;
    int64_t x_cols = shapes ? 1536 : run.cols, y_rows = shapes ? 49152 : run.rows;
    run.w = malloc((size_t)w_elems * sizeof(float));
    run.x = malloc((size_t)(32 * x_cols) * sizeof(float));
    run.y = malloc((size_t)(32 * y_rows) * sizeof(float));
    run.buf = malloc((size_t)(64 * x_cols) * sizeof(float));
    if (!run.w || !run.x || !run.y || !run.buf) {
        fprintf(stderr, "bench_quant: out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < w_elems; i++)
        run.w[i] = normal(0.02f);
    for (int64_t i = 0; i < 32 * x_cols; i++)
        run.x[i] = normal(1.0f);

    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    time_t t = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
    double roof256 = fma_roof(8), roof512 = fma_roof(16);
    run.roof = roof512 > roof256 ? roof512 : roof256;
    printf("{\n  \"benchmark\": \"quant\",\n  \"date\": \"%s\",\n", date);
    printf("  \"machine\": {\"cpu\": \"%s\", \"kernel_path\": \"%s\", \"f32_kernels\": \"%s\", "
           "\"q8_kernels\": \"%s\", \"threads\": 1, \"compiler\": \"%s\"},\n",
           cpu, qt_cpu_path(), qt_f32_path(), qt_q8_path(), __VERSION__);
    printf("  \"roof\": {\"fma256_gflops\": %.2f, \"fma512_gflops\": %.2f, \"gflops\": %.2f, "
           "\"what\": \"one thread, %d independent FMA chains, best of %d; every *_roof_frac "
           "is a figure over gflops\"},\n",
           roof256, roof512, run.roof, ROOF_CHAINS, ROOF_REPEATS);
    printf("  \"inputs\": {\"rows\": %lld, \"cols\": %lld, \"weight\": \"N(0, 0.02)\", "
           "\"min_seconds\": %.2f, \"clock\": \"%s\"},\n",
           (long long)run.rows, (long long)run.cols, run.min_s,
           call_clock == CLOCK_MONOTONIC ? "wall" : "thread cpu");
    int rc = shapes ? run_shapes(&run) : run_kinds(&run);
    printf("}\n");
    free(run.w);
    free(run.x);
    free(run.y);
    free(run.buf);
    return rc;
}

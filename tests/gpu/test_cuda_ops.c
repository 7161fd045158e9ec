/*
 * test_cuda_ops.c - the layer kernels of kernels/cuda/qt_cuda_ops.cu
 * (RMSNorm, RoPE, SwiGLU, add, bias, a mixture of experts' row gather and
 * weighted add, KV writes, paged attention, argmax)
 * against CPU references, on a real GPU.
 *
 * Why shaped so: this runs only where there is a GPU (tests/gpu/run.sh), so
 * it is a plain C program that prints one line per case (`PASS name` or
 * `FAIL name: detail`) and a few `timing attention ...` lines. Every output
 * buffer is poisoned with 0xFF bytes (a NaN) before the kernel runs, so an
 * element a kernel forgets to write cannot pass. The references are
 * kernels/math/ops_math.h (the CPU forward pass's own arithmetic) where the
 * result must be bit-identical, and straightforward f64 loops where the
 * GPU sums in another order (the bound is stated at each comparison).
 * Attention runs on a paged cache with shuffled block numbers, sequences of
 * 1, 17, 300 and 2000 positions, several GQA shapes and head sizes (every
 * load width and heads-per-block the kernel picks), sliding windows on and
 * off, a decode step (few rows: the split-positions path) and a prefill
 * step (many rows: one block per row and kv head).
 *
 * Exit status: 0 all passed; 1 a case failed; 77 no usable CUDA device.
 */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/qt_cuda.h"
#include "cuda/qt_cuda_ops.h"
#include "gpu_test_util.h"
#include "ops_math.h"
#include "qtensor.h"
#include "scheduler.h"

#define MSG_LEN 512

static int failures;
static cudaStream_t stream;

/* ---- reporting ------------------------------------------------------------------ */

static void pass(const char *name)
{
    printf("PASS %s\n", name);
    fflush(stdout);
}

static void fail(const char *name, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL %s: ", name);
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    failures++;
}

/* A CUDA runtime call that must succeed; false (and a FAIL line) if not. */
static bool cuda_ok(const char *name, cudaError_t st, const char *what)
{
    if (st == cudaSuccess)
        return true;
    fail(name, "%s: %s (%s)", what, cudaGetErrorString(st), cudaGetErrorName(st));
    return false;
}

/* A qt_cuda_* call that must succeed, then the stream synchronised so a
 * fault during the run is caught here. */
static bool op_ok(const char *name, int rc, const char *msg)
{
    if (rc != QL_OK) {
        fail(name, "returned %d: %s", rc, msg);
        return false;
    }
    return cuda_ok(name, cudaStreamSynchronize(stream), "cudaStreamSynchronize after the kernel");
}

/* ---- inputs ------------------------------------------------------------------------ */

static float uniform_in(double lo, double hi)
{
    return (float)(lo + (hi - lo) * rng_uniform());
}

static float *host_random(size_t n, double lo, double hi)
{
    float *p = malloc(n * sizeof *p);
    if (p)
        for (size_t i = 0; i < n; i++)
            p[i] = uniform_in(lo, hi);
    return p;
}

/* Device copy of host data (NULL and a FAIL line on failure). */
static void *dev_copy(const char *name, const void *h, size_t bytes)
{
    void *d = NULL;
    if (!cuda_ok(name, cudaMalloc(&d, bytes ? bytes : 1), "cudaMalloc"))
        return NULL;
    if (h && !cuda_ok(name, cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy up")) {
        cudaFree(d);
        return NULL;
    }
    return d;
}

/* Device buffer filled with 0xFF bytes: every float a NaN. */
static void *dev_poisoned(const char *name, size_t bytes)
{
    void *d = dev_copy(name, NULL, bytes);
    if (d && !cuda_ok(name, cudaMemset(d, 0xff, bytes), "cudaMemset poison")) {
        cudaFree(d);
        return NULL;
    }
    return d;
}

static bool download(const char *name, void *h, const void *d, size_t bytes)
{
    return cuda_ok(name, cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy down");
}

/* ---- comparisons ---------------------------------------------------------------------- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Every element bit for bit. */
static bool same_bits(const char *name, const float *got, const float *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (f32_bits(got[i]) != f32_bits(want[i])) {
            fail(name, "element %zu: got %.9g (0x%08x), want %.9g (0x%08x)", i, got[i],
                 f32_bits(got[i]), want[i], f32_bits(want[i]));
            return false;
        }
    return true;
}

/* |got - want| <= rel * |want| + abs for every element (NaN fails). */
static bool close_to(const char *name, const float *got, const double *want, size_t n, double rel,
                     double abs_tol)
{
    double worst = 0.0;
    size_t worst_i = 0, bad = 0, first_bad = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        double tol = rel * fabs(want[i]) + abs_tol;
        if (!(err <= tol)) {
            if (bad++ == 0)
                first_bad = i;
        }
        if (!(err <= worst)) {
            worst = err;
            worst_i = i;
        }
    }
    if (bad) {
        fail(name,
             "%zu of %zu elements off; first %zu: got %.9g, want %.9g; worst %zu: got %.9g, "
             "want %.9g (bound %g relative + %g)",
             bad, n, first_bad, got[first_bad], want[first_bad], worst_i, got[worst_i],
             want[worst_i], rel, abs_tol);
        return false;
    }
    return true;
}

/* ---- RMSNorm ----------------------------------------------------------------------------- */

static void test_rmsnorm(int64_t rows, int64_t n, bool in_place)
{
    char name[128], msg[MSG_LEN] = "";
    snprintf(name, sizeof name, "rmsnorm_%lldx%lld%s", (long long)rows, (long long)n,
             in_place ? "_in_place" : "");
    size_t total = (size_t)(rows * n);
    float *x = host_random(total, -3, 3), *w = host_random((size_t)n, 0.5, 1.5);
    float *got = malloc(total * sizeof *got);
    double *want = malloc(total * sizeof *want);
    float *dx = NULL, *dw = NULL, *dout = NULL;
    if (!x || !w || !got || !want) {
        fail(name, "out of host memory");
        goto done;
    }
    for (int64_t r = 0; r < rows; r++) {
        x[r * n + r % n] = 40.0f; /* an outlier per row */
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++)
            ss = om_sumsq_add(ss, x[r * n + i]);
        float scale = om_rmsnorm_scale(ss, n, 1e-5f);
        for (int64_t i = 0; i < n; i++)
            want[r * n + i] = om_rmsnorm_apply(x[r * n + i], scale, w[i]);
    }
    dx = dev_copy(name, x, total * sizeof *x);
    dw = dev_copy(name, w, (size_t)n * sizeof *w);
    dout = in_place ? dx : dev_poisoned(name, total * sizeof *x);
    if (!dx || !dw || !dout)
        goto done;
    if (!op_ok(name, qt_cuda_rmsnorm(dout, dx, dw, rows, n, 1e-5f, stream, msg, sizeof msg), msg))
        goto done;
    if (!download(name, got, dout, total * sizeof *got))
        goto done;
    /* The f64 sum of squares runs in another order on the GPU (relative
     * error ~1e-16), so the f32 scale may round 1 ulp apart; the product
     * then differs by at most ~2 ulp: 3e-7 relative. */
    if (close_to(name, got, want, total, 3e-7, 1e-30))
        pass(name);
done:
    if (dout && dout != dx)
        cudaFree(dout);
    cudaFree(dx);
    cudaFree(dw);
    free(x);
    free(w);
    free(got);
    free(want);
}

/* ---- RoPE -------------------------------------------------------------------------------- */

static void test_rope(int64_t rows, int32_t n_heads, int32_t head_dim, bool interleaved)
{
    char name[128], msg[MSG_LEN] = "";
    snprintf(name, sizeof name, "rope_%lld_rows_%dx%d_%s", (long long)rows, n_heads, head_dim,
             interleaved ? "interleaved" : "rotate_half");
    int32_t half = head_dim / 2;
    size_t total = (size_t)rows * (size_t)n_heads * (size_t)head_dim;
    size_t tab = (size_t)rows * (size_t)half;
    float *v = host_random(total, -2, 2), *want = malloc(total * sizeof *want);
    float *cs = malloc(tab * sizeof *cs), *sn = malloc(tab * sizeof *sn);
    float *got = malloc(total * sizeof *got);
    float *dv = NULL, *dcs = NULL, *dsn = NULL;
    if (!v || !want || !cs || !sn || !got) {
        fail(name, "out of host memory");
        goto done;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int32_t i = 0; i < half; i++) {
            double angle = (double)(r * 37 + 5) * pow(10000.0, -2.0 * i / head_dim);
            cs[r * half + i] = (float)cos(angle);
            sn[r * half + i] = (float)sin(angle);
        }
    /* the CPU forward pass's own loop */
    memcpy(want, v, total * sizeof *v);
    for (int64_t r = 0; r < rows; r++)
        for (int32_t h = 0; h < n_heads; h++) {
            float *x = want + ((size_t)r * (size_t)n_heads + (size_t)h) * (size_t)head_dim;
            for (int32_t i = 0; i < half; i++) {
                int32_t a, b;
                om_rope_pair(i, half, interleaved, &a, &b);
                om_rope_rotate(&x[a], &x[b], cs[r * half + i], sn[r * half + i]);
            }
        }
    dv = dev_copy(name, v, total * sizeof *v);
    dcs = dev_copy(name, cs, tab * sizeof *cs);
    dsn = dev_copy(name, sn, tab * sizeof *sn);
    if (!dv || !dcs || !dsn)
        goto done;
    if (!op_ok(name,
               qt_cuda_rope(dv, dcs, dsn, rows, n_heads, head_dim, interleaved, stream, msg,
                            sizeof msg),
               msg))
        goto done;
    if (!download(name, got, dv, total * sizeof *got))
        goto done;
    /* two products and an add per element, no FMA on either side: the bits */
    if (same_bits(name, got, want, total))
        pass(name);
done:
    cudaFree(dv);
    cudaFree(dcs);
    cudaFree(dsn);
    free(v);
    free(want);
    free(cs);
    free(sn);
    free(got);
}

/* ---- SwiGLU, add, bias ------------------------------------------------------------------- */

/* GPT-OSS's clamped SwiGLU on the device against ops_math.h's
 * om_swiglu_oai on the host: gate and up in [-12, 12] so both clamps at 7
 * bite; one expf, as swiglu: 1e-6 relative. */
static void test_swiglu_oai(void)
{
    const char *name = "swiglu_oai";
    char msg[MSG_LEN] = "";
    const int64_t n = 4099;
    float *g = host_random((size_t)n, -12, 12), *u = host_random((size_t)n, -12, 12);
    float *got = malloc((size_t)n * sizeof *got), *dg = NULL, *du = NULL;
    double *want = malloc((size_t)n * sizeof *want);
    if (!g || !u || !got || !want) {
        fail(name, "out of host memory");
        goto done;
    }
    dg = dev_copy(name, g, (size_t)n * sizeof *g);
    du = dev_copy(name, u, (size_t)n * sizeof *u);
    if (!dg || !du ||
        !op_ok(name, qt_cuda_swiglu_oai(dg, du, n, 1.702f, 7.0f, stream, msg, sizeof msg), msg) ||
        !download(name, got, dg, (size_t)n * sizeof *got))
        goto done;
    for (int64_t i = 0; i < n; i++)
        want[i] = om_swiglu_oai(g[i], u[i], 1.702f, 7.0f);
    if (close_to(name, got, want, (size_t)n, 1e-6, 1e-37))
        pass(name);
done:
    cudaFree(dg);
    cudaFree(du);
    free(g);
    free(u);
    free(got);
    free(want);
}

static void test_pointwise(void)
{
    const char *name = "swiglu_add_add_bias";
    char msg[MSG_LEN] = "";
    const int64_t rows = 7, n = 14337, total = rows * n; /* odd, not a multiple of the block */
    float *g = host_random((size_t)total, -12, 12), *u = host_random((size_t)total, -3, 3);
    float *bias = host_random((size_t)n, -1, 1), *got = malloc((size_t)total * sizeof *got);
    double *want = malloc((size_t)total * sizeof *want);
    float *want_f = malloc((size_t)total * sizeof *want_f);
    float *dg = NULL, *du = NULL, *db = NULL;
    if (!g || !u || !bias || !got || !want || !want_f) {
        fail(name, "out of host memory");
        goto done;
    }
    g[0] = 0.0f;
    g[1] = -100.0f; /* silu -> -0 */
    g[2] = 90.0f;
    dg = dev_copy(name, g, (size_t)total * sizeof *g);
    du = dev_copy(name, u, (size_t)total * sizeof *u);
    db = dev_copy(name, bias, (size_t)n * sizeof *bias);
    if (!dg || !du || !db)
        goto done;

    /* swiglu: silu(g) * u with CUDA's expf (within 2 ulp) against the
     * CPU's: one add, one divide, one product after it: 1e-6 relative */
    if (!op_ok(name, qt_cuda_swiglu(dg, du, total, stream, msg, sizeof msg), msg) ||
        !download(name, got, dg, (size_t)total * sizeof *got))
        goto done;
    for (int64_t i = 0; i < total; i++)
        want[i] = om_swiglu(g[i], u[i]);
    if (!close_to("swiglu", got, want, (size_t)total, 1e-6, 1e-37))
        goto done;
    if (got[0] != 0.0f || got[2] != om_swiglu(90.0f, u[2])) {
        fail("swiglu", "silu(0) or silu(90) is off: %g, %g", got[0], got[2]);
        goto done;
    }
    pass("swiglu");

    /* add: x += t, exact; from the swiglu output already on the device */
    for (int64_t i = 0; i < total; i++)
        want_f[i] = got[i] + u[i];
    if (!op_ok(name, qt_cuda_add(dg, du, total, stream, msg, sizeof msg), msg) ||
        !download(name, got, dg, (size_t)total * sizeof *got))
        goto done;
    if (!same_bits("add", got, want_f, (size_t)total))
        goto done;
    pass("add");

    /* add_bias: y[r][i] += bias[i], exact */
    for (int64_t i = 0; i < total; i++)
        want_f[i] = got[i] + bias[i % n];
    if (!op_ok(name, qt_cuda_add_bias(dg, db, rows, n, stream, msg, sizeof msg), msg) ||
        !download(name, got, dg, (size_t)total * sizeof *got))
        goto done;
    if (same_bits("add_bias", got, want_f, (size_t)total))
        pass("add_bias");
done:
    cudaFree(dg);
    cudaFree(du);
    cudaFree(db);
    free(g);
    free(u);
    free(bias);
    free(got);
    free(want);
    free(want_f);
}

/* ---- a mixture of experts' row gather and weighted add ------------------------------------ */

/* 11 rows of 70, top-2 (pairs row * 2 + k): an expert's 5 pairs gathered,
 * then its output added into 11 rows with the pairs' weights, and a second
 * expert's added after it; the result has the host's bits (om_weighted_add
 * in the same order), rows no pair names untouched. idx NULL adds row r
 * into row r (the shared expert). */
static void test_expert_rows(void)
{
    const char *name = "expert_rows_gather_and_weighted_add";
    enum { T = 11, N = 70, K = 2, P = 5 };
    const int32_t pairs[2][P] = {{0, 3, 9, 14, 21}, {1, 4, 8, 15, 20}};
    char msg[MSG_LEN];
    float *x = host_random((size_t)T * N, -1.0, 1.0), *acc = host_random((size_t)T * N, -1.0, 1.0);
    float *y = host_random((size_t)P * N, -1.0, 1.0), *w = host_random(T, 0.0, 1.0);
    float *got = malloc((size_t)T * N * sizeof *got), *want = malloc((size_t)T * N * sizeof *want);
    float *dx = dev_copy(name, x, (size_t)T * N * sizeof *x);
    float *dacc = dev_copy(name, acc, (size_t)T * N * sizeof *acc);
    float *dy = dev_copy(name, y, (size_t)P * N * sizeof *y);
    float *dw = dev_copy(name, w, T * sizeof *w);
    int32_t *didx = dev_copy(name, pairs, sizeof pairs);
    float *dg = dev_poisoned(name, (size_t)P * N * sizeof(float));
    if (!got || !want || !dx || !dacc || !dy || !dw || !didx || !dg)
        goto done;
    /* gather: row p of dg = row pairs[0][p] / K of x, exact */
    if (!op_ok(name, qt_cuda_gather_f32(dg, dx, didx, K, P, N, stream, msg, sizeof msg), msg) ||
        !download(name, got, dg, (size_t)P * N * sizeof *got))
        goto done;
    for (int p = 0; p < P; p++)
        memcpy(want + (size_t)p * N, x + (size_t)(pairs[0][p] / K) * N, N * sizeof *want);
    if (!same_bits("expert_rows_gather", got, want, (size_t)P * N))
        goto done;
    /* weighted adds: expert 0 then expert 1 (same outputs y), then every row */
    memcpy(want, acc, (size_t)T * N * sizeof *want);
    for (int e = 0; e < 2; e++)
        for (int p = 0; p < P; p++)
            for (int i = 0; i < N; i++) {
                float *o = &want[(size_t)(pairs[e][p] / K) * N + i];
                *o = om_weighted_add(*o, w[p], y[(size_t)p * N + i]);
            }
    for (int e = 0; e < 2; e++)
        if (!op_ok(name,
                   qt_cuda_scatter_add_weighted(dacc, dy, didx + e * P, K, dw, P, N, stream, msg,
                                                sizeof msg),
                   msg))
            goto done;
    if (!download(name, got, dacc, (size_t)T * N * sizeof *got) ||
        !same_bits("expert_rows_weighted_add", got, want, (size_t)T * N))
        goto done;
    for (int64_t i = 0; i < (int64_t)T * N; i++)
        want[i] = om_weighted_add(want[i], w[i / N], x[i]);
    if (!op_ok(name,
               qt_cuda_scatter_add_weighted(dacc, dx, NULL, 1, dw, T, N, stream, msg, sizeof msg),
               msg) ||
        !download(name, got, dacc, (size_t)T * N * sizeof *got))
        goto done;
    if (same_bits("expert_rows_shared_add", got, want, (size_t)T * N))
        pass(name);
done:
    cudaFree(dx);
    cudaFree(dacc);
    cudaFree(dy);
    cudaFree(dw);
    cudaFree(didx);
    cudaFree(dg);
    free(x);
    free(acc);
    free(y);
    free(w);
    free(got);
    free(want);
}

/* ---- the paged cache ------------------------------------------------------------------------ */

enum { N_SEQS = 4, BLOCK_TOKENS = 16, N_LAYERS = 2, LAYER = 1 };
static const int32_t seq_len[N_SEQS] = {1, 17, 300, 2000};

/* A host cache laid out as qt_cuda_kv and engine/kv_cache_internal.h say,
 * with every sequence's blocks at shuffled block numbers. */
typedef struct host_cache {
    float *arena;
    size_t block_floats, n_floats;
    int64_t kv_dim;
    int32_t n_blocks;
    int32_t bt_offset[N_SEQS];
    int32_t *tables; /* back to back */
    int32_t n_table;
} host_cache;

static void cache_free(host_cache *c)
{
    free(c->arena);
    free(c->tables);
    memset(c, 0, sizeof *c);
}

static bool cache_new(host_cache *c, int64_t kv_dim)
{
    memset(c, 0, sizeof *c);
    c->kv_dim = kv_dim;
    /* 8 floats of padding per block: block_floats is the stride, not the
     * size of its contents (and stays a multiple of 4) */
    c->block_floats = (size_t)N_LAYERS * 2 * BLOCK_TOKENS * (size_t)kv_dim + 8;
    for (int s = 0; s < N_SEQS; s++) {
        c->bt_offset[s] = c->n_table;
        c->n_table += (seq_len[s] + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
    }
    c->n_blocks = c->n_table + 7; /* some blocks belong to no sequence */
    c->n_floats = (size_t)c->n_blocks * c->block_floats;
    c->arena = malloc(c->n_floats * sizeof *c->arena);
    int32_t *perm = malloc((size_t)c->n_blocks * sizeof *perm);
    c->tables = malloc((size_t)c->n_table * sizeof *c->tables);
    if (!c->arena || !perm || !c->tables) {
        free(perm);
        cache_free(c);
        return false;
    }
    for (size_t i = 0; i < c->n_floats; i++)
        c->arena[i] = uniform_in(-1, 1);
    for (int32_t i = 0; i < c->n_blocks; i++)
        perm[i] = i;
    for (int32_t i = c->n_blocks - 1; i > 0; i--) {
        int32_t j = (int32_t)(rng_uniform() * (i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    memcpy(c->tables, perm, (size_t)c->n_table * sizeof *perm);
    free(perm);
    return true;
}

static size_t cache_at(const host_cache *c, int32_t seq, int32_t layer, int v, int32_t pos)
{
    int32_t b = c->tables[c->bt_offset[seq] + pos / BLOCK_TOKENS], slot = pos % BLOCK_TOKENS;
    return (size_t)b * c->block_floats +
           ((size_t)layer * 2 + (size_t)v) * BLOCK_TOKENS * (size_t)c->kv_dim +
           (size_t)slot * (size_t)c->kv_dim;
}

/* The device side of a host cache and a step's rows. */
typedef struct dev_step {
    qt_cuda_kv kv;
    qt_cuda_step_rows sr;
    int32_t *row_seq, *row_pos, *bt_offset, *tables;
} dev_step;

static void dev_step_free(dev_step *d)
{
    cudaFree(d->kv.arena);
    cudaFree(d->row_seq);
    cudaFree(d->row_pos);
    cudaFree(d->bt_offset);
    cudaFree(d->tables);
    memset(d, 0, sizeof *d);
}

/* arena_poison: upload a NaN arena instead of c->arena. */
static bool dev_step_new(const char *name, dev_step *d, const host_cache *c, const int32_t *row_seq,
                         const int32_t *row_pos, int64_t rows, bool arena_poison)
{
    memset(d, 0, sizeof *d);
    d->kv.arena = arena_poison ? dev_poisoned(name, c->n_floats * sizeof(float))
                               : dev_copy(name, c->arena, c->n_floats * sizeof(float));
    d->row_seq = dev_copy(name, row_seq, (size_t)rows * sizeof *row_seq);
    d->row_pos = dev_copy(name, row_pos, (size_t)rows * sizeof *row_pos);
    d->bt_offset = dev_copy(name, c->bt_offset, sizeof c->bt_offset);
    d->tables = dev_copy(name, c->tables, (size_t)c->n_table * sizeof *c->tables);
    if (!d->kv.arena || !d->row_seq || !d->row_pos || !d->bt_offset || !d->tables) {
        dev_step_free(d);
        return false;
    }
    d->kv.block_tokens = BLOCK_TOKENS;
    d->kv.n_layers = N_LAYERS;
    d->kv.kv_dim = c->kv_dim;
    d->kv.block_floats = c->block_floats;
    d->sr.rows = rows;
    d->sr.row_seq = d->row_seq;
    d->sr.row_pos = d->row_pos;
    d->sr.bt_offset = d->bt_offset;
    d->sr.block_tables = d->tables;
    return true;
}

static void test_kv_write(void)
{
    const char *name = "kv_write";
    char msg[MSG_LEN] = "";
    const int64_t kv_dim = 3 * 64;
    /* a prefill run of sequence 2 that crosses blocks, and single rows of
     * the others, at their last position */
    int32_t row_seq[24], row_pos[24];
    int64_t rows = 0;
    for (int32_t p = 10; p < 30; p++, rows++) {
        row_seq[rows] = 2;
        row_pos[rows] = p;
    }
    for (int32_t s = 0; s < N_SEQS; s++, rows++) {
        row_seq[rows] = s;
        row_pos[rows] = seq_len[s] - 1;
    }
    host_cache c;
    dev_step d;
    memset(&d, 0, sizeof d);
    float *k = host_random((size_t)(rows * kv_dim), -1, 1);
    float *v = host_random((size_t)(rows * kv_dim), -1, 1);
    float *dk = NULL, *dv = NULL, *got = NULL;
    if (!cache_new(&c, kv_dim)) {
        fail(name, "out of host memory");
        free(k);
        free(v);
        return;
    }
    got = malloc(c.n_floats * sizeof *got);
    if (!k || !v || !got) {
        fail(name, "out of host memory");
        goto done;
    }
    if (!dev_step_new(name, &d, &c, row_seq, row_pos, rows, true))
        goto done;
    dk = dev_copy(name, k, (size_t)(rows * kv_dim) * sizeof *k);
    dv = dev_copy(name, v, (size_t)(rows * kv_dim) * sizeof *v);
    if (!dk || !dv)
        goto done;
    if (!op_ok(name, qt_cuda_kv_write(&d.kv, LAYER, &d.sr, dk, dv, stream, msg, sizeof msg), msg))
        goto done;
    if (!download(name, got, d.kv.arena, c.n_floats * sizeof *got))
        goto done;
    /* the expected arena: all NaN bits but the written slots */
    uint32_t nan_bits = 0xffffffffu;
    for (size_t i = 0; i < c.n_floats; i++)
        memcpy(&c.arena[i], &nan_bits, sizeof nan_bits);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(c.arena + cache_at(&c, row_seq[r], LAYER, 0, row_pos[r]), k + r * kv_dim,
               (size_t)kv_dim * sizeof *k);
        memcpy(c.arena + cache_at(&c, row_seq[r], LAYER, 1, row_pos[r]), v + r * kv_dim,
               (size_t)kv_dim * sizeof *v);
    }
    if (same_bits(name, got, c.arena, c.n_floats))
        pass(name);
done:
    dev_step_free(&d);
    cudaFree(dk);
    cudaFree(dv);
    cache_free(&c);
    free(k);
    free(v);
    free(got);
}

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct attn_case {
    const char *label;
    int32_t n_heads, n_kv_heads, head_dim, window;
    float q_gain;      /* q in [-q_gain, q_gain]: larger is a sharper softmax */
    int32_t tail_2000; /* prefill rows at the end of the 2000-position sequence */
    bool sinks;        /* a sink logit per head (GPT-OSS), in [-1, 3] */
} attn_case;

/* out[r][h][e] = softmax(q . K / sqrt(d)) . V in f64, straight from the
 * definition (one pass for the max, one for the weights); with sinks (NULL:
 * none) head h's denominator has one more term e^sinks[h], with no value. */
static void ref_attention(const host_cache *c, const attn_case *ac, const float *q,
                          const float *sinks, const int32_t *row_seq, const int32_t *row_pos,
                          int64_t rows, double *out)
{
    int32_t d = ac->head_dim, group = ac->n_heads / ac->n_kv_heads;
    double scale = om_attention_scale(d);
    double *score = malloc(2048 * sizeof *score);
    if (!score)
        return;
    for (int64_t r = 0; r < rows; r++) {
        int32_t pos = row_pos[r], seq = row_seq[r];
        int32_t first = ac->window > 0 && pos - ac->window + 1 > 0 ? pos - ac->window + 1 : 0;
        for (int32_t h = 0; h < ac->n_heads; h++) {
            const float *qh = q + ((size_t)r * (size_t)ac->n_heads + (size_t)h) * (size_t)d;
            size_t head = (size_t)(h / group) * (size_t)d;
            double mx = -INFINITY, sum = 0.0;
            for (int32_t p = first; p <= pos; p++) {
                const float *k = c->arena + cache_at(c, seq, LAYER, 0, p) + head;
                double s = 0.0;
                for (int32_t e = 0; e < d; e++)
                    s += (double)qh[e] * (double)k[e];
                score[p - first] = s * scale;
                mx = score[p - first] > mx ? score[p - first] : mx;
            }
            mx = sinks && sinks[h] > mx ? sinks[h] : mx;
            sum = sinks ? exp((double)sinks[h] - mx) : 0.0;
            double *o = out + ((size_t)r * (size_t)ac->n_heads + (size_t)h) * (size_t)d;
            for (int32_t e = 0; e < d; e++)
                o[e] = 0.0;
            for (int32_t p = first; p <= pos; p++) {
                const float *v = c->arena + cache_at(c, seq, LAYER, 1, p) + head;
                double w = exp(score[p - first] - mx);
                sum += w;
                for (int32_t e = 0; e < d; e++)
                    o[e] += w * (double)v[e];
            }
            for (int32_t e = 0; e < d; e++)
                o[e] /= sum;
        }
    }
    free(score);
}

/* One step (decode or prefill) of one shape. */
static void attention_step(const char *name, const host_cache *c, const attn_case *ac,
                           const int32_t *row_seq, const int32_t *row_pos, int64_t rows)
{
    char msg[MSG_LEN] = "";
    size_t n = (size_t)rows * (size_t)ac->n_heads * (size_t)ac->head_dim;
    float *q = host_random(n, -ac->q_gain, ac->q_gain), *got = malloc(n * sizeof *got);
    float *sinks = ac->sinks ? host_random((size_t)ac->n_heads, -1.0, 3.0) : NULL;
    double *want = malloc(n * sizeof *want);
    float *dq = NULL, *dout = NULL, *dsinks = NULL;
    dev_step d;
    memset(&d, 0, sizeof d);
    if (!q || !got || !want || (ac->sinks && !sinks)) {
        fail(name, "out of host memory");
        goto done;
    }
    if (!dev_step_new(name, &d, c, row_seq, row_pos, rows, false))
        goto done;
    dq = dev_copy(name, q, n * sizeof *q);
    dout = dev_poisoned(name, n * sizeof *dout);
    if (sinks)
        dsinks = dev_copy(name, sinks, (size_t)ac->n_heads * sizeof *sinks);
    if (!dq || !dout || (sinks && !dsinks))
        goto done;
    if (!op_ok(name,
               qt_cuda_attention_ex(&d.kv, LAYER, &d.sr, dq, dout, ac->n_heads, ac->n_kv_heads,
                                    ac->head_dim, ac->window, om_attention_scale(ac->head_dim),
                                    0.0f, dsinks, stream, msg, sizeof msg),
               msg))
        goto done;
    if (!download(name, got, dout, n * sizeof *got))
        goto done;
    ref_attention(c, ac, q, sinks, row_seq, row_pos, rows, want);
    /* Bound: each score is an f32 dot product of head_dim terms (relative
     * error ~d * 2^-24 of sum |q k| * scale, under 1e-5 absolute here), an
     * f32 expf (2 ulp) and f32 sums over up to 2000 positions in another
     * order than f64's; the outputs are averages of values in [-1, 1]. So
     * 1e-4 absolute, while a missing, extra or misplaced position moves an
     * output by ~|v| / positions (5e-4 at 2000 positions, far more at 17 or
     * 300), and a wrong head or block by O(0.1). */
    if (close_to(name, got, want, n, 0.0, 1e-4))
        pass(name);
done:
    dev_step_free(&d);
    cudaFree(dq);
    cudaFree(dout);
    cudaFree(dsinks);
    free(sinks);
    free(q);
    free(got);
    free(want);
}

static void test_attention(const attn_case *ac)
{
    char name[160];
    host_cache c;
    int64_t kv_dim = (int64_t)ac->n_kv_heads * ac->head_dim;
    if (!cache_new(&c, kv_dim)) {
        fail(ac->label, "out of host memory");
        return;
    }
    /* decode: one row per sequence at its last position */
    int32_t row_seq[2048], row_pos[2048];
    for (int32_t s = 0; s < N_SEQS; s++) {
        row_seq[s] = s;
        row_pos[s] = seq_len[s] - 1;
    }
    snprintf(name, sizeof name, "attention_decode_%s", ac->label);
    attention_step(name, &c, ac, row_seq, row_pos, N_SEQS);

    /* prefill: sequence 0's only row, sequence 1 whole (a prompt from
     * position 0), sequence 2's last 10 rows, and the last tail_2000 rows
     * of sequence 3, each row causal up to its own position */
    int64_t rows = 0;
    row_seq[rows] = 0;
    row_pos[rows++] = 0;
    for (int32_t p = 0; p < seq_len[1]; p++, rows++) {
        row_seq[rows] = 1;
        row_pos[rows] = p;
    }
    for (int32_t p = seq_len[2] - 10; p < seq_len[2]; p++, rows++) {
        row_seq[rows] = 2;
        row_pos[rows] = p;
    }
    for (int32_t p = seq_len[3] - ac->tail_2000; p < seq_len[3]; p++, rows++) {
        row_seq[rows] = 3;
        row_pos[rows] = p;
    }
    snprintf(name, sizeof name, "attention_prefill_%s", ac->label);
    attention_step(name, &c, ac, row_seq, row_pos, rows);
    cache_free(&c);
}

static void test_attention_arguments(void)
{
    const char *name = "attention_rejects_bad_arguments";
    char msg[MSG_LEN];
    float dummy_f[4];
    int32_t dummy_i[4];
    qt_cuda_kv kv = {.arena = dummy_f,
                     .block_tokens = 16,
                     .n_layers = 2,
                     .kv_dim = 128,
                     .block_floats = 2 * 2 * 16 * 128};
    qt_cuda_step_rows sr = {.rows = 1,
                            .row_seq = dummy_i,
                            .row_pos = dummy_i,
                            .bt_offset = dummy_i,
                            .block_tables = dummy_i};
    struct {
        const char *why;
        int32_t layer, n_heads, n_kv_heads, head_dim, window;
        size_t block_floats;
    } bad[] = {
        {"head_dim 1024", 0, 1, 1, 1024, 0, 2 * 2 * 16 * 128},
        {"heads not a multiple of kv heads", 0, 5, 2, 64, 0, 2 * 2 * 16 * 128},
        {"kv_dim mismatch", 0, 4, 2, 32, 0, 2 * 2 * 16 * 128},
        {"layer out of range", 2, 2, 2, 64, 0, 2 * 2 * 16 * 128},
        {"negative window", 0, 2, 2, 64, -1, 2 * 2 * 16 * 128},
        {"block_floats too small", 0, 2, 2, 64, 0, 2 * 2 * 16 * 128 - 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        msg[0] = 0;
        kv.block_floats = bad[i].block_floats;
        int rc = qt_cuda_attention(&kv, bad[i].layer, &sr, dummy_f, dummy_f, bad[i].n_heads,
                                   bad[i].n_kv_heads, bad[i].head_dim, bad[i].window, stream, msg,
                                   sizeof msg);
        if (rc != QL_EINVAL || !msg[0]) {
            fail(name, "%s: rc %d, message '%s'", bad[i].why, rc, msg);
            return;
        }
    }
    /* no rows: nothing to do, nothing touched */
    kv.block_floats = 2 * 2 * 16 * 128;
    sr.rows = 0;
    int rc = qt_cuda_attention(&kv, 0, &sr, NULL, NULL, 2, 2, 64, 0, stream, msg, sizeof msg);
    if (rc != QL_OK) {
        fail(name, "zero rows: rc %d: %s", rc, msg);
        return;
    }
    pass(name);
}

/* ---- argmax
 * -------------------------------------------------------------------------------------- */

/* The CPU sampler's greedy choice on a copy. */
static int32_t sampler_greedy(const float *logits, int32_t n)
{
    float *copy = malloc((size_t)n * sizeof *copy);
    if (!copy)
        return -2;
    memcpy(copy, logits, (size_t)n * sizeof *copy);
    eng_sampling p;
    memset(&p, 0, sizeof p);
    eng_sampler s;
    int32_t t = -2;
    if (eng_sampler_init(&s, &p, NULL, 0) == QL_OK) {
        t = eng_sample(&s, copy, n, NULL);
        eng_sampler_free(&s);
    }
    free(copy);
    return t;
}

/* offset: floats the rows start past a 256-byte aligned allocation (1: the
 * kernel's unaligned path even when vocab is a multiple of 4). */
static void test_argmax(int64_t vocab, int offset)
{
    char name[128], msg[MSG_LEN] = "";
    snprintf(name, sizeof name, "argmax_vocab_%lld%s", (long long)vocab,
             offset ? "_unaligned" : "");
    enum { ROWS = 9 };
    size_t total = (size_t)(ROWS * vocab);
    float *l = host_random(total, -10, 10);
    int32_t want[ROWS], got[ROWS];
    float *dl = NULL;
    int32_t *dt = NULL;
    if (!l) {
        fail(name, "out of host memory");
        return;
    }
    float nan = nanf(""), inf = INFINITY;
    int64_t V = vocab;
    /* row 1: a tie for the max, the lower id wins */
    l[1 * V + (V - 1)] = 50.0f;
    l[1 * V + V / 3] = 50.0f;
    /* row 2: every entry NaN -> 0 */
    for (int64_t i = 0; i < V; i++)
        l[2 * V + i] = nan;
    /* row 3: NaN but two -inf -> the first -inf */
    for (int64_t i = 0; i < V; i++)
        l[3 * V + i] = nan;
    l[3 * V + V - 1] = -inf;
    l[3 * V + V / 2] = -inf;
    /* row 4: -0 and +0 tie as the max */
    for (int64_t i = 0; i < V; i++)
        l[4 * V + i] = -1.0f - (float)(i % 7);
    l[4 * V + V - 1] = 0.0f;
    l[4 * V + V / 4] = -0.0f;
    /* row 5: +inf twice */
    l[5 * V + V - 1] = inf;
    l[5 * V + V / 5] = inf;
    /* row 6: NaN scattered (one at id 0), the max at the last id */
    for (int64_t i = 0; i < V; i += 3)
        l[6 * V + i] = nan;
    l[6 * V + V - 1] = 99.0f;
    /* row 7: all equal -> 0 */
    for (int64_t i = 0; i < V; i++)
        l[7 * V + i] = 1.5f;
    /* row 8 (and 0): random */
    for (int r = 0; r < ROWS; r++) {
        want[r] = om_greedy_argmax(l + r * V, (int32_t)V);
        int32_t s = sampler_greedy(l + r * V, (int32_t)V);
        if (s != want[r]) {
            fail(name, "row %d: ops_math says %d, the sampler %d (the test is wrong)", r, want[r],
                 s);
            free(l);
            return;
        }
    }
    dl = dev_copy(name, NULL, (total + 4) * sizeof *dl);
    dt = dev_poisoned(name, sizeof got);
    if (!dl || !dt)
        goto done;
    if (!cuda_ok(name, cudaMemcpy(dl + offset, l, total * sizeof *l, cudaMemcpyHostToDevice),
                 "cudaMemcpy up"))
        goto done;
    if (!op_ok(name, qt_cuda_argmax(dl + offset, ROWS, vocab, dt, stream, msg, sizeof msg), msg))
        goto done;
    if (!download(name, got, dt, sizeof got))
        goto done;
    for (int r = 0; r < ROWS; r++)
        if (got[r] != want[r]) {
            fail(name, "row %d: token %d, want %d", r, got[r], want[r]);
            goto done;
        }
    pass(name);
done:
    cudaFree(dl);
    cudaFree(dt);
    free(l);
}

/* ---- timing
 * ---------------------------------------------------------------------------------------- */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Decode at batch 1, 8, 64 with 2048 positions, 32 heads of 128 over 8 kv
 * heads (a Llama-3-8B layer), and a 512-row prefill chunk; the cache is
 * filled with one byte pattern (a small finite float): what is timed is
 * the reading. */
static void time_attention(void)
{
    const char *name = "timing_attention";
    char msg[MSG_LEN] = "";
    enum { MAX_B = 64, CTX = 2048, HEADS = 32, KV_HEADS = 8, D = 128, PREFILL = 512, REPS = 25 };
    const int64_t kv_dim = KV_HEADS * D;
    const int32_t per_seq = CTX / BLOCK_TOKENS;
    qt_cuda_kv kv = {.arena = NULL,
                     .block_tokens = BLOCK_TOKENS,
                     .n_layers = 1,
                     .kv_dim = kv_dim,
                     .block_floats = 2 * BLOCK_TOKENS * (size_t)kv_dim};
    size_t arena_bytes = (size_t)MAX_B * per_seq * kv.block_floats * sizeof(float);
    int32_t *tables = malloc((size_t)MAX_B * per_seq * sizeof *tables);
    int32_t bt_offset[MAX_B], row_seq[PREFILL], row_pos[PREFILL];
    float *dq = NULL, *dout = NULL;
    int32_t *d_tables = NULL, *d_off = NULL, *d_seq = NULL, *d_pos = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    if (!tables) {
        fail(name, "out of host memory");
        return;
    }
    for (int32_t i = 0; i < MAX_B * per_seq; i++)
        tables[i] = i;
    for (int32_t s = 0; s < MAX_B; s++)
        bt_offset[s] = s * per_seq;
    kv.arena = dev_copy(name, NULL, arena_bytes);
    dq = dev_copy(name, NULL, (size_t)PREFILL * HEADS * D * sizeof(float));
    dout = dev_copy(name, NULL, (size_t)PREFILL * HEADS * D * sizeof(float));
    d_tables = dev_copy(name, tables, (size_t)MAX_B * per_seq * sizeof *tables);
    d_off = dev_copy(name, bt_offset, sizeof bt_offset);
    d_seq = dev_copy(name, NULL, sizeof row_seq);
    d_pos = dev_copy(name, NULL, sizeof row_pos);
    if (!kv.arena || !dq || !dout || !d_tables || !d_off || !d_seq || !d_pos)
        goto done;
    if (!cuda_ok(name, cudaMemset(kv.arena, 0x3c, arena_bytes), "cudaMemset arena") ||
        !cuda_ok(name, cudaMemset(dq, 0x3c, (size_t)PREFILL * HEADS * D * sizeof(float)),
                 "cudaMemset q") ||
        !cuda_ok(name, cudaEventCreate(&e0), "cudaEventCreate") ||
        !cuda_ok(name, cudaEventCreate(&e1), "cudaEventCreate"))
        goto done;
    for (int mode = 0; mode < 4; mode++) {
        static const int batches[3] = {1, 8, 64};
        bool prefill = mode == 3;
        int64_t rows = prefill ? PREFILL : batches[mode];
        for (int64_t r = 0; r < rows; r++) {
            row_seq[r] = prefill ? 0 : (int32_t)r;
            row_pos[r] = prefill ? CTX - PREFILL + (int32_t)r : CTX - 1;
        }
        if (!cuda_ok(
                name,
                cudaMemcpy(d_seq, row_seq, (size_t)rows * sizeof *row_seq, cudaMemcpyHostToDevice),
                "cudaMemcpy rows") ||
            !cuda_ok(
                name,
                cudaMemcpy(d_pos, row_pos, (size_t)rows * sizeof *row_pos, cudaMemcpyHostToDevice),
                "cudaMemcpy rows"))
            goto done;
        qt_cuda_step_rows sr = {.rows = rows,
                                .row_seq = d_seq,
                                .row_pos = d_pos,
                                .bt_offset = d_off,
                                .block_tables = d_tables};
        float ms[REPS];
        for (int i = -3; i < REPS; i++) {
            if (!cuda_ok(name, cudaEventRecord(e0, stream), "cudaEventRecord"))
                goto done;
            int rc = qt_cuda_attention(&kv, 0, &sr, dq, dout, HEADS, KV_HEADS, D, 0, stream, msg,
                                       sizeof msg);
            if (rc != QL_OK) {
                fail(name, "qt_cuda_attention: %s", msg);
                goto done;
            }
            if (!cuda_ok(name, cudaEventRecord(e1, stream), "cudaEventRecord") ||
                !cuda_ok(name, cudaEventSynchronize(e1), "cudaEventSynchronize"))
                goto done;
            float t = 0;
            if (!cuda_ok(name, cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime"))
                goto done;
            if (i >= 0)
                ms[i] = t;
        }
        qsort(ms, REPS, sizeof *ms, cmp_float);
        double med = ms[REPS / 2];
        /* bytes of K and V read once per kv head (prefill: the causal half
         * of the chunk's context per row, L2 serving the repeats) */
        double bytes =
            prefill ? (double)(CTX - PREFILL) * 2 * kv_dim * 4 + (double)PREFILL * 2 * kv_dim * 4
                    : (double)rows * CTX * 2 * kv_dim * 4;
        printf("timing attention %s rows=%lld ctx=%d heads=%d/%d d=%d: median %.1f us, "
               "%.0f GB/s of K+V\n",
               prefill ? "prefill" : "decode", (long long)rows, CTX, HEADS, KV_HEADS, D,
               med * 1000.0, bytes / (med * 1e-3) / 1e9);
        fflush(stdout);
    }
done:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(kv.arena);
    cudaFree(dq);
    cudaFree(dout);
    cudaFree(d_tables);
    cudaFree(d_off);
    cudaFree(d_seq);
    cudaFree(d_pos);
    free(tables);
}

/* ---- main
 * ------------------------------------------------------------------------------------------ */

int main(void)
{
    char line[1024], msg[MSG_LEN] = "";
    qt_cuda_describe(line, sizeof line);
    printf("%s\n", line);
    int count = 0;
    if (qt_cuda_device_count(&count, msg, sizeof msg) != QL_OK || count < 1) {
        printf("SKIP: no usable CUDA device: %s\n", msg);
        return 77;
    }
    if (!cuda_ok("setup", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreate"))
        return 1;

    test_rmsnorm(5, 4096, false);
    test_rmsnorm(3, 1000, true);
    test_rmsnorm(1, 1, false);
    test_rope(7, 9, 64, false);
    test_rope(7, 9, 64, true);
    test_rope(3, 4, 128, false);
    test_rope(3, 4, 128, true);
    test_pointwise();
    test_expert_rows();
    test_swiglu_oai();
    test_kv_write();

    /* every load width and heads-per-block the kernel picks:
     *   9/3 of 64 (SmolLM2): float2 loads, 4 heads a block (3 used);
     *   32/8 of 128 (Llama 3 8B): float4, 4 heads a block;
     *   16/2 of 128: a group of 8 in one block;
     *   4/4 of 256: two float4 a lane, one head a block;
     *   10/2 of 80: float4 with idle lanes, 8 heads a block (5 used);
     *   3/1 of 62: float2 with an idle lane;
     *   2/1 of 63: odd, the scalar path (8 floats a lane, masked) */
    const attn_case cases[] = {
        {"9x3x64", 9, 3, 64, 0, 1.0f, 128, false},
        {"9x3x64_window17", 9, 3, 64, 17, 1.0f, 64, false},
        {"9x3x64_sharp", 9, 3, 64, 0, 3.0f, 32, false},
        {"32x8x128", 32, 8, 128, 0, 1.0f, 128, false},
        {"32x8x128_window100", 32, 8, 128, 100, 1.0f, 32, false},
        {"16x2x128_sharp", 16, 2, 128, 0, 2.5f, 16, false},
        {"4x4x256", 4, 4, 256, 0, 1.0f, 16, false},
        {"4x4x256_window300", 4, 4, 256, 300, 1.0f, 16, false},
        {"10x2x80", 10, 2, 80, 0, 1.0f, 16, false},
        {"3x1x62", 3, 1, 62, 0, 1.0f, 16, false},
        {"2x1x63", 2, 1, 63, 0, 1.0f, 16, false},
        /* GPT-OSS's sinks: decode (positions split, the sink added at the
         * merge), prefill with and without a window, and 32x8x128's prefill
         * (enough blocks that nothing splits: the sink added in the kernel) */
        {"9x3x64_sinks", 9, 3, 64, 0, 1.0f, 32, true},
        {"32x8x128_sinks", 32, 8, 128, 0, 1.0f, 128, true},
        {"8x2x64_window17_sinks", 8, 2, 64, 17, 1.0f, 16, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        test_attention(&cases[i]);
    test_attention_arguments();

    test_argmax(151936, 0);
    test_argmax(1001, 0);
    test_argmax(1000, 1);
    test_argmax(4, 0);
    test_argmax(1, 0);

    if (!emulated())
        time_attention();

    cudaStreamDestroy(stream);
    printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}

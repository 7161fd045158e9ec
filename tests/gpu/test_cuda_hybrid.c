/*
 * test_cuda_hybrid.c - Qwen3.5's hybrid layers on the CUDA backend: the
 * tiny Qwen3.5 fixture (tests/fixtures/qwen35_tiny, four Gated DeltaNet
 * layers and two gated full-attention ones with partial rotary; made by
 * tests/fixtures/make_qwen35_reference.py) stepped through the device, and
 *   - its logits at every position within QWEN35_TOL of transformers'
 *     float64 ones (the bound tests/test_qwen35.c holds the CPU to), and
 *     within HYBRID_CPU_TOL of the CPU backend's;
 *   - a prompt fed in chunks of 1 to 7 tokens bit for bit equal to one token
 *     at a time (the conv and the delta rule run each sequence's tokens in
 *     order on the device too), and the 12 greedy ids after it;
 *   - a fork's state copied on the device: after the fork the parent steps
 *     with another token while the child goes on with the prompt and
 *     still gets the reference logits; a sequence admitted into a slot an
 *     ended one used starts from a zeroed state;
 *   - Qwen3.5-MoE's tiny fixture, and llama.cpp's GGUF of the dense one
 *     (value heads tiled, A as -exp(A_log)), within the same bound of
 *     their references;
 *   - partial rotary on its own (a Phi-4-mini-shaped fixture) stepping as
 *     on the CPU backend;
 *   - qt_cuda_delta_net alone against the CPU's reference arithmetic
 *     (kernels' qt_delta_rule_ref and ops_math.h), bit for bit, on a
 *     shape with several sequences, GQA-style key heads and both head
 *     orders.
 * Under the emulator (tests/gpu/emu/run.sh) expf and log1pf are libm's, as
 * on the CPU; on a device they are CUDA's (within 2 ulp), so the delta
 * rule's op check there holds to HYBRID_OP_TOL instead of bit equality.
 *
 * Plain C, no Criterion (the GPU machine has only CUDA and cJSON): prints
 * `PASS name` or `FAIL name: detail` per check; exit 0 when all passed, 1
 * when one failed, 77 when there is no usable device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures/qwen35_reference.h"
#include "gpu_model_util.h"
#include "model.h"
#include "ops_math.h"
#include "qt_cuda.h"
#include "qt_cuda_ops.h"
#include "runtime.h"

#include <cuda_runtime_api.h>

/* tests/test_qwen35.c's bound against transformers' float64 logits */
#define QWEN35_TOL 5e-5
/* the CPU backend against this one: both f32, the products summed in
 * different orders, and on a device CUDA's expf in the gates and the
 * decay; 1.05e-5 measured under the emulator (the line the test prints),
 * the bound the CPU itself is held to against transformers */
#define HYBRID_CPU_TOL 5e-5
/* qt_cuda_delta_net against the reference on a device, where expf is
 * CUDA's: a few ulp of values of order 1 */
#define HYBRID_OP_TOL 1e-5

/* gpu_worst_abs against a float64 reference of n_rows rows of V. */
static double worst_ref(const float *a, const double (*ref)[QWEN35_VOCAB], int n_rows)
{
    double w = 0.0;
    for (int r = 0; r < n_rows; r++)
        for (int i = 0; i < QWEN35_VOCAB; i++) {
            double d = fabs((double)a[r * QWEN35_VOCAB + i] - ref[r][i]);
            if (!(d <= w))
                w = isnan(d) ? INFINITY : d;
        }
    return w;
}

static int backend(eng_backend **b, const eng_model *m, eng_device d)
{
    eng_backend_opts o = {.device = d,
                          .threads = 1,
                          .max_tokens = QWEN35_N_TOKENS,
                          .max_seqs = 3,
                          .kv_bytes = (size_t)4 << 20};
    return gpu_backend(b, m, &o);
}

/* One step of sequence s: n tokens from pos, every row's logits into
 * rows ([n][vocab]). */
static int step(eng_backend *b, eng_seq_kv *s, const int32_t *tokens, int32_t n, int32_t pos,
                float *rows)
{
    char msg[1024];
    float *last = malloc(QWEN35_VOCAB * sizeof(float));
    eng_step_seq q = {
        .kv = s, .tokens = tokens, .n_tokens = n, .pos = pos, .all_logits = n > 1 ? rows : NULL};
    int rc = eng_backend_forward(b, &q, 1, n > 1 ? last : rows, NULL, msg, sizeof msg);
    if (rc != QL_OK)
        printf("step at %d (%d tokens): %s\n", pos, n, msg);
    free(last);
    return rc;
}

/* The prompt through b in chunks (sizes cycling through chunks[], n of
 * them), every position's logits into all ([QWEN35_N_TOKENS][vocab]). */
static int run_chunks(eng_backend *b, const int32_t *chunks, int n, float *all)
{
    eng_kv_cache *kv = eng_backend_kv(b);
    eng_seq_kv s = {0};
    if (eng_kv_reserve(kv, &s, QWEN35_N_TOKENS + QWEN35_N_GREEDY) != QL_OK)
        return QL_ENOMEM;
    int rc = QL_OK;
    for (int32_t pos = 0, i = 0; rc == QL_OK && pos < QWEN35_N_TOKENS; i++) {
        int32_t len = chunks[i % n];
        if (len > QWEN35_N_TOKENS - pos)
            len = QWEN35_N_TOKENS - pos;
        rc = step(b, &s, QWEN35_TOKENS + pos, len, pos, all + (size_t)pos * QWEN35_VOCAB);
        pos += len;
    }
    eng_kv_release(kv, &s);
    return rc;
}

static int argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* --- the whole model ------------------------------------------------------------ */

static void logits_match_the_reference_and_the_cpu(const eng_model *m, eng_backend *gpu,
                                                   eng_backend *cpu)
{
    size_t n = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    float *g = malloc(n * sizeof(float)), *c = malloc(n * sizeof(float));
    int32_t whole[] = {QWEN35_N_TOKENS};
    bool ran = run_chunks(gpu, whole, 1, g) == QL_OK && run_chunks(cpu, whole, 1, c) == QL_OK;
    double to_ref = ran ? worst_ref(g, QWEN35_LOGITS, QWEN35_N_TOKENS) : INFINITY;
    double to_cpu = ran ? gpu_worst_abs(g, c, n) : INFINITY;
    printf("qwen35 tiny, one prefill: %.3g from transformers' float64, %.3g from the CPU backend\n",
           to_ref, to_cpu);
    gpu_report(to_ref <= QWEN35_TOL, "qwen35_logits_within_tol_of_transformers", "%.3g > %g",
               to_ref, QWEN35_TOL);
    gpu_report(to_cpu <= HYBRID_CPU_TOL, "qwen35_logits_within_tol_of_the_cpu_backend", "%.3g > %g",
               to_cpu, HYBRID_CPU_TOL);
    (void)m;
    free(g);
    free(c);
}

static void chunks_equal_one_token_at_a_time(eng_backend *gpu)
{
    size_t n = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    float *one = malloc(n * sizeof(float)), *chunked = malloc(n * sizeof(float));
    int32_t ones[] = {1}, sizes[] = {1, 2, 3, 5, 7};
    bool ran =
        run_chunks(gpu, ones, 1, one) == QL_OK && run_chunks(gpu, sizes, 5, chunked) == QL_OK;
    bool same = ran && memcmp(one, chunked, n * sizeof(float)) == 0;
    gpu_report(same, "qwen35_chunks_bit_equal_to_one_token_a_step", "%s, worst %.3g",
               ran ? "differ" : "a step failed", ran ? gpu_worst_abs(one, chunked, n) : INFINITY);
    free(one);
    free(chunked);
}

static void greedy_ids_after_the_prompt(eng_backend *gpu)
{
    eng_kv_cache *kv = eng_backend_kv(gpu);
    eng_seq_kv s = {0};
    float *rows = malloc((size_t)QWEN35_N_TOKENS * QWEN35_VOCAB * sizeof(float));
    int rc = eng_kv_reserve(kv, &s, QWEN35_N_TOKENS + QWEN35_N_GREEDY);
    if (rc == QL_OK)
        rc = step(gpu, &s, QWEN35_TOKENS, QWEN35_N_TOKENS, 0, rows);
    int got[QWEN35_N_GREEDY], bad = -1;
    int32_t next = argmax(rows + (size_t)(QWEN35_N_TOKENS - 1) * QWEN35_VOCAB, QWEN35_VOCAB);
    for (int i = 0; rc == QL_OK && i < QWEN35_N_GREEDY; i++) {
        got[i] = next;
        if (got[i] != QWEN35_GREEDY[i] && bad < 0)
            bad = i;
        rc = step(gpu, &s, &next, 1, QWEN35_N_TOKENS + i, rows);
        next = argmax(rows, QWEN35_VOCAB);
    }
    gpu_report(rc == QL_OK && bad < 0, "qwen35_greedy_ids_after_the_prompt",
               "rc %d, id %d: %d, not %d", rc, bad, bad >= 0 ? got[bad] : -1,
               bad >= 0 ? QWEN35_GREEDY[bad] : -1);
    eng_kv_release(kv, &s);
    free(rows);
}

/* Sequence s's next write at pos: a block it shares copied on write first
 * (eng_backend_copy_blocks, in the device arena). */
static int prepare(eng_backend *b, eng_seq_kv *s, int32_t pos)
{
    char msg[512];
    eng_kv_copy copies[4];
    int32_t n = 0;
    int rc = eng_kv_prepare_write(eng_backend_kv(b), s, pos, 1, copies, 4, &n);
    if (rc == QL_OK)
        rc = eng_backend_copy_blocks(b, copies, n, msg, sizeof msg);
    return rc;
}

/*
 * Parent p takes the first 12 prompt tokens; child c forks from it (its
 * state copied on the device); both take the 13th in one step (the same
 * bits), then p takes another token than the prompt's each step (its
 * state moves on) while c takes the prompt's rest: c's logits must be the
 * reference's. After both end, a fresh sequence in a used slot runs the
 * prompt from a zeroed state.
 */
static void fork_copies_the_state(eng_backend *gpu)
{
    eng_kv_cache *kv = eng_backend_kv(gpu);
    const int32_t split = 12, other = 5, V = QWEN35_VOCAB;
    char msg[1024] = "";
    float *rows = malloc((size_t)QWEN35_N_TOKENS * V * sizeof(float));
    float *child = malloc((size_t)QWEN35_N_TOKENS * V * sizeof(float));
    eng_seq_kv p = {0}, c = {0};
    int rc = eng_kv_reserve(kv, &p, QWEN35_N_TOKENS);
    /* the fork's blocks, and one for p's own copy of the shared last block */
    if (rc == QL_OK)
        rc = eng_kv_hold(kv, &p, eng_kv_fork_blocks(kv, split, QWEN35_N_TOKENS) + 1);
    if (rc == QL_OK)
        rc = step(gpu, &p, QWEN35_TOKENS, split, 0, rows);
    if (rc == QL_OK)
        rc = eng_kv_fork(kv, &c, &p, QWEN35_N_TOKENS);
    for (int32_t t = split; rc == QL_OK && t < QWEN35_N_TOKENS; t++) {
        rc = prepare(gpu, &p, t);
        if (rc == QL_OK)
            rc = prepare(gpu, &c, t);
        eng_step_seq both[2] = {
            {.kv = &p, .tokens = t == split ? QWEN35_TOKENS + t : &other, .n_tokens = 1, .pos = t},
            {.kv = &c, .tokens = QWEN35_TOKENS + t, .n_tokens = 1, .pos = t}};
        if (rc == QL_OK)
            rc = eng_backend_forward(gpu, both, 2, rows, NULL, msg, sizeof msg);
        if (rc == QL_OK && t == split)
            gpu_report(memcmp(rows, rows + V, (size_t)V * sizeof(float)) == 0,
                       "qwen35_fork_steps_as_its_parent", "worst %.3g",
                       gpu_worst_abs(rows, rows + V, V));
        memcpy(child + (size_t)(t - split) * V, rows + V, (size_t)V * sizeof(float));
    }
    double w =
        rc == QL_OK ? worst_ref(child, QWEN35_LOGITS + split, QWEN35_N_TOKENS - split) : INFINITY;
    gpu_report(w <= QWEN35_TOL, "qwen35_fork_copies_the_state_on_the_device",
               "rc %d (%s), worst %.3g", rc, msg, w);
    eng_kv_release(kv, &p);
    eng_kv_release(kv, &c);

    /* the freed slots hold the states above: a new sequence must not see them */
    eng_seq_kv f = {0};
    rc = eng_kv_reserve(kv, &f, QWEN35_N_TOKENS);
    if (rc == QL_OK)
        rc = step(gpu, &f, QWEN35_TOKENS, QWEN35_N_TOKENS, 0, rows);
    w = rc == QL_OK ? worst_ref(rows, QWEN35_LOGITS, QWEN35_N_TOKENS) : INFINITY;
    gpu_report(w <= QWEN35_TOL, "qwen35_admission_zeroes_a_used_state", "rc %d, worst %.3g", rc, w);
    eng_kv_release(kv, &f);
    free(rows);
    free(child);
}

/* tests/fixtures/<fixture> (a folder, or a GGUF file) on the CUDA backend,
 * its prompt in chunks of 5: the worst logit error against ref. */
static double fixture_worst(const char *fixture, const double (*ref)[QWEN35_VOCAB])
{
    eng_model m = {0};
    eng_backend *gpu = NULL;
    size_t n = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    float *g = malloc(n * sizeof(float));
    int32_t fives[] = {5};
    double w = INFINITY;
    int rc;
    if (strstr(fixture, ".gguf")) {
        char path[512], msg[512];
        snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, fixture);
        eng_load_opts lo = {.path = path};
        if ((rc = eng_model_load(&m, &lo, msg, sizeof msg)) != QL_OK)
            printf("loading %s: %s\n", fixture, msg);
    } else {
        rc = gpu_load(&m, fixture);
    }
    if (rc == QL_OK) {
        if (backend(&gpu, &m, ENG_DEVICE_CUDA) == QL_OK && run_chunks(gpu, fives, 1, g) == QL_OK)
            w = worst_ref(g, ref, QWEN35_N_TOKENS);
        eng_backend_free(gpu);
        eng_model_free(&m);
    }
    free(g);
    return w;
}

/* Qwen3.5-MoE's tiny fixture, and llama.cpp's conversion of the dense one
 * (value heads tiled, A stored as -exp(A_log), norms as 1 + w), against
 * their float64 references. */
static void other_fixtures_match_their_references(void)
{
    double w = fixture_worst("qwen35_moe_tiny", QWEN35_MOE_LOGITS);
    gpu_report(w <= QWEN35_TOL, "qwen35_moe_logits_within_tol_of_transformers", "%.3g > %g", w,
               QWEN35_TOL);
    w = fixture_worst("qwen35_tiny.gguf", QWEN35_LOGITS);
    gpu_report(w <= QWEN35_TOL, "qwen35_gguf_tiled_heads_within_tol_of_transformers", "%.3g > %g",
               w, QWEN35_TOL);
}

/*
 * Partial rotary alone (Phi-4-mini's shape: tests/fixtures/
 * phi3_partial_tiny.gguf turns 12 of its 16 dims, llama.cpp's converter):
 * a prefill of 8 then 4 decodes on both backends, each step's logits
 * within 1e-3 of the largest (test_cuda_engine's bound for two f32
 * summation orders).
 */
static void partial_rotary_steps_as_on_the_cpu(void)
{
    const char *name = "partial_rotary_steps_as_on_the_cpu_phi3";
    char path[512];
    snprintf(path, sizeof path, "%s/phi3_partial_tiny.gguf", QL_FIXTURES);
    eng_model m = {0};
    eng_load_opts lo = {.path = path};
    char msg[1024] = "";
    if (eng_model_load(&m, &lo, msg, sizeof msg) != QL_OK) {
        gpu_report(false, name, "%s", msg);
        return;
    }
    eng_backend *be[2] = {NULL, NULL};
    size_t V = (size_t)m.cfg.vocab_size;
    float *logits[2] = {malloc(V * sizeof(float)), malloc(V * sizeof(float))};
    eng_seq_kv kv[2] = {{0}, {0}};
    int32_t tokens[12];
    for (int i = 0; i < 12; i++)
        tokens[i] = (int32_t)((7 + 31 * i) % (int)V);
    double worst = 0.0, scale = 0.0;
    int rc = backend(&be[0], &m, ENG_DEVICE_CPU);
    if (rc == QL_OK)
        rc = backend(&be[1], &m, ENG_DEVICE_CUDA);
    for (int b = 0; rc == QL_OK && b < 2; b++)
        rc = eng_kv_reserve(eng_backend_kv(be[b]), &kv[b], 12);
    for (int32_t pos = 0; rc == QL_OK && pos < 12;) {
        int32_t n = pos == 0 ? 8 : 1;
        for (int b = 0; rc == QL_OK && b < 2; b++) {
            eng_step_seq q = {.kv = &kv[b], .tokens = tokens + pos, .n_tokens = n, .pos = pos};
            rc = eng_backend_forward(be[b], &q, 1, logits[b], NULL, msg, sizeof msg);
        }
        for (size_t i = 0; rc == QL_OK && i < V; i++)
            scale = fmax(scale, fabs((double)logits[0][i]));
        double w = rc == QL_OK ? gpu_worst_abs(logits[0], logits[1], V) : INFINITY;
        worst = w > worst || isnan(w) ? w : worst;
        pos += n;
    }
    printf("phi3 partial rotary, 12 steps' logits: %.3g from the CPU backend's (largest %.3g)\n",
           worst, scale);
    gpu_report(rc == QL_OK && worst <= 1e-3 * scale, name, "rc %d (%s), worst %.3g of %.3g", rc,
               msg, worst, scale);
    for (int b = 0; b < 2; b++) {
        if (be[b])
            eng_kv_release(eng_backend_kv(be[b]), &kv[b]);
        eng_backend_free(be[b]);
        free(logits[b]);
    }
    eng_model_free(&m);
}

/* --- qt_cuda_delta_net alone -------------------------------------------------------- */

/* The layer of op_case: 2 key heads, 4 value heads (2 per key head), k 8,
 * v 6 (not a warp), 3 taps; 3 sequences of 1, 4 and 2 rows in slots 2, 0
 * and 1 of a pool of 3. */
enum { OP_NK = 2, OP_NV = 4, OP_DK = 8, OP_DV = 6, OP_TAPS = 3, OP_SEQS = 3, OP_ROWS = 7 };
enum { OP_C = 2 * OP_NK * OP_DK + OP_NV * OP_DV, OP_VD = OP_NV * OP_DV };
enum { OP_STATE = (OP_TAPS - 1) * OP_C + OP_NV * OP_DK * OP_DV };
static const int32_t op_first[OP_SEQS + 1] = {0, 1, 5, 7}, op_slot[OP_SEQS] = {2, 0, 1};

typedef struct op_data {
    float conv[OP_C * OP_TAPS], neg_a[OP_NV], dt[OP_NV], norm[OP_DV];
    float beta[OP_ROWS * OP_NV], decay[OP_ROWS * OP_NV], qkv[OP_ROWS * OP_C], z[OP_ROWS * OP_VD];
    float out[OP_ROWS * OP_VD], states[OP_SEQS * OP_STATE];
} op_data;

static void fill(float *v, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++)
        v[i] = (float)(rng_normal() * scale);
}

/* The CPU's arithmetic on the host (linear_cpu.c's order, by its parts). */
static void op_reference(op_data *d, bool tiled)
{
    for (int i = 0; i < OP_ROWS * OP_NV; i++) {
        d->beta[i] = om_sigmoid(d->beta[i]);
        d->decay[i] = om_delta_log_decay(d->neg_a[i % OP_NV], d->decay[i], d->dt[i % OP_NV]);
    }
    for (int s = 0; s < OP_SEQS; s++)
        for (int ch = 0; ch < OP_C; ch++) {
            float *win = d->states + op_slot[s] * OP_STATE, *w = d->conv + ch * OP_TAPS;
            float hist[OP_TAPS - 1] = {win[ch], win[OP_C + ch]};
            for (int r = op_first[s]; r < op_first[s + 1]; r++) {
                float in = d->qkv[r * OP_C + ch], acc = 0.0f;
                acc += w[0] * hist[0];
                acc += w[1] * hist[1];
                acc += w[2] * in;
                hist[0] = hist[1];
                hist[1] = in;
                d->qkv[r * OP_C + ch] = om_silu(acc);
            }
            win[ch] = hist[0];
            win[OP_C + ch] = hist[1];
        }
    for (int r = 0; r < OP_ROWS; r++)
        for (int h = 0; h < 2 * OP_NK; h++) {
            float *v = d->qkv + r * OP_C + h * OP_DK;
            double ss = 0.0;
            for (int e = 0; e < OP_DK; e++)
                ss = om_sumsq_add(ss, v[e]);
            float f = om_l2norm_factor(ss, h < OP_NK ? 1.0f / sqrtf((float)OP_DK) : 1.0f);
            for (int e = 0; e < OP_DK; e++)
                v[e] *= f;
        }
    float mem[OP_DV];
    for (int s = 0; s < OP_SEQS; s++)
        for (int h = 0; h < OP_NV; h++) {
            int kh = tiled ? h % OP_NK : h / (OP_NV / OP_NK);
            float *S = d->states + op_slot[s] * OP_STATE + (OP_TAPS - 1) * OP_C + h * OP_DK * OP_DV;
            for (int r = op_first[s]; r < op_first[s + 1]; r++) {
                const float *q = d->qkv + r * OP_C + kh * OP_DK, *k = q + OP_NK * OP_DK;
                const float *v = d->qkv + r * OP_C + 2 * OP_NK * OP_DK + h * OP_DV;
                float *o = d->out + r * OP_VD + h * OP_DV;
                qt_delta_rule_ref(S, OP_DK, OP_DV, q, k, v, expf(d->decay[r * OP_NV + h]),
                                  d->beta[r * OP_NV + h], o, mem);
                double ss = 0.0;
                for (int e = 0; e < OP_DV; e++)
                    ss = om_sumsq_add(ss, o[e]);
                float sc = om_rmsnorm_scale(ss, OP_DV, 1e-6f);
                for (int e = 0; e < OP_DV; e++)
                    o[e] = om_rmsnorm_apply(o[e], sc, d->norm[e]) *
                           om_silu(d->z[r * OP_VD + h * OP_DV + e]);
            }
        }
}

/* Device copies of the arrays named, host to device (to_dev) or back. */
static bool op_copy(op_data *host, op_data *dev, bool to_dev)
{
    size_t n = sizeof *host;
    return cudaMemcpy(to_dev ? (void *)dev : (void *)host, to_dev ? (void *)host : (void *)dev, n,
                      to_dev ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost) == cudaSuccess;
}

static void delta_net_matches_the_reference(bool tiled)
{
    rng_seed(tiled ? 35 : 53);
    op_data *in = malloc(sizeof *in), *want = malloc(sizeof *want), *got = malloc(sizeof *got);
    fill((float *)in, sizeof *in / sizeof(float), 0.7);
    for (int h = 0; h < OP_NV; h++) /* -exp(A_log): a decay below 1 */
        in->neg_a[h] = -fabsf(in->neg_a[h]);
    memcpy(want, in, sizeof *in);
    op_reference(want, tiled);

    op_data *dev = NULL;
    int32_t *d_first = NULL, *d_slot = NULL;
    char why[256] = "";
    bool ok = cudaMalloc((void **)&dev, sizeof *dev) == cudaSuccess &&
              cudaMalloc((void **)&d_first, sizeof op_first) == cudaSuccess &&
              cudaMalloc((void **)&d_slot, sizeof op_slot) == cudaSuccess &&
              op_copy(in, dev, true) &&
              cudaMemcpy(d_first, op_first, sizeof op_first, cudaMemcpyHostToDevice) == 0 &&
              cudaMemcpy(d_slot, op_slot, sizeof op_slot, cudaMemcpyHostToDevice) == 0;
    qt_cuda_delta_layer ly = {.n_k_heads = OP_NK,
                              .n_v_heads = OP_NV,
                              .k_head_dim = OP_DK,
                              .v_head_dim = OP_DV,
                              .conv_kernel = OP_TAPS,
                              .v_tiled = tiled,
                              .eps = 1e-6f,
                              .conv = dev->conv,
                              .neg_a = dev->neg_a,
                              .dt_bias = dev->dt,
                              .norm = dev->norm,
                              .states = dev->states,
                              .state_floats = OP_STATE};
    qt_cuda_delta_seqs sq = {OP_SEQS, OP_ROWS, d_first, d_slot};
    ok = ok && qt_cuda_delta_net(&ly, &sq, dev->beta, dev->decay, dev->qkv, dev->z, dev->out, NULL,
                                 why, sizeof why) == QL_OK;
    ok = ok && cudaDeviceSynchronize() == cudaSuccess && op_copy(got, dev, false);
    double w_out = ok ? gpu_worst_abs(got->out, want->out, OP_ROWS * OP_VD) : INFINITY;
    double w_state = ok ? gpu_worst_abs(got->states, want->states, OP_SEQS * OP_STATE) : INFINITY;
    bool same = ok && memcmp(got->out, want->out, sizeof got->out) == 0 &&
                memcmp(got->states, want->states, sizeof got->states) == 0;
    const char *name = tiled ? "delta_net_tiled_heads_match_the_cpu_reference"
                             : "delta_net_grouped_heads_match_the_cpu_reference";
    if (emulated())
        gpu_report(same, name, "%s; outputs %.3g, states %.3g from the reference", why, w_out,
                   w_state);
    else
        gpu_report(w_out <= HYBRID_OP_TOL && w_state <= HYBRID_OP_TOL, name,
                   "%s; outputs %.3g, states %.3g > %g", why, w_out, w_state, HYBRID_OP_TOL);
    cudaFree(dev);
    cudaFree(d_first);
    cudaFree(d_slot);
    free(in);
    free(want);
    free(got);
}

int main(void)
{
    int n = 0;
    if (qt_cuda_device_count(&n, NULL, 0) != QL_OK || n < 1) {
        printf("SKIP no usable CUDA device\n");
        return 77;
    }
    delta_net_matches_the_reference(false);
    delta_net_matches_the_reference(true);

    eng_model m = {0};
    eng_backend *gpu = NULL, *cpu = NULL;
    if (gpu_load(&m, "qwen35_tiny") != QL_OK || backend(&gpu, &m, ENG_DEVICE_CUDA) != QL_OK ||
        backend(&cpu, &m, ENG_DEVICE_CPU) != QL_OK) {
        gpu_report(false, "qwen35_runs_on_the_cuda_backend", "see above");
    } else {
        logits_match_the_reference_and_the_cpu(&m, gpu, cpu);
        chunks_equal_one_token_at_a_time(gpu);
        greedy_ids_after_the_prompt(gpu);
        fork_copies_the_state(gpu);
    }
    eng_backend_free(gpu);
    eng_backend_free(cpu);
    eng_model_free(&m);
    other_fixtures_match_their_references();
    partial_rotary_steps_as_on_the_cpu();

    return gpu_summary();
}

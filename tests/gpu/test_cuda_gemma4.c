/*
 * test_cuda_gemma4.c - Gemma 4's options on the CUDA backend: the tiny
 * fixtures shaped like the released checkpoints (tests/fixtures/gemma4_*,
 * made by make_gemma4_shapes_reference.py and make_gemma4_dims_reference.py)
 * stepped through the device, each
 *   - a prompt of 16 as a prefill of 9, then one token a step over KV
 *     blocks of 4: every position's logits within GEMMA4_TOL (worst
 *     relative L2 of a row) of transformers' float64 ones, the bound
 *     tests/test_gemma4.c holds the CPU to, and within GEMMA4_CPU_TOL of
 *     the CPU backend's;
 *   - the 12 greedy ids after the shapes' 5-token prompt equal to
 *     transformers';
 * and PEFT's adapter on gemma4_ple_tiny (the per-layer input gate and
 * projection beside the seven) unmerged and merged on the device against
 * PEFT's float64 logits.
 * The fixtures between them carry what the device once refused: keys as
 * values (gemma4_keqv_tiny), per-layer input embeddings with kv-shared
 * layers' double-wide MLP (gemma4_ple_tiny, gemma4_cg_tiny), the MoE block
 * with its router's input of its own and per_expert_scale
 * (gemma4_moe_tiny), and full layers with their own head size and kv
 * heads in the KV cache (gemma4_dims_tiny, gemma4_dims_keqv_tiny).
 * The released checkpoints' full layers have heads of 512, past the
 * fixtures' 32: qt_cuda_attention_ex alone on heads of 512 (four float4 a
 * lane) and 510 (the scalar path) against a float64 reference over a paged
 * cache, a prefill and a decode row.
 *
 * Plain C, no Criterion (the GPU machine has only CUDA and cJSON): prints
 * `PASS name` or `FAIL name: detail` per check; exit 0 when all passed, 1
 * when one failed, 77 when there is no usable device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures/gemma4_dims_reference.h"
#include "fixtures/gemma4_reference.h"
#include "fixtures/gemma4_shapes_reference.h"
#include "gpu_model_util.h"
#include "lora.h"
#include "model.h"
#include "qt_cuda.h"
#include "qt_cuda_ops.h"
#include "runtime.h"
#include "test_util.h"

#include <cuda_runtime_api.h>

/* tests/test_gemma4.c's bound against transformers' float64 logits
 * (worst relative L2 of a row) */
#define GEMMA4_TOL 1e-5
/* the CPU backend against this one: both f32, the products summed in
 * other orders (the line each check prints says what was measured) */
#define GEMMA4_CPU_TOL 5e-5

#define V GEMMA4_VOCAB
#define N GEMMA4_N_TOKENS

/* Blocks of 4 positions, so the prompt crosses several. */
static int backend(eng_backend **b, const eng_model *m, eng_device d)
{
    eng_backend_opts o = {.device = d,
                          .threads = 1,
                          .max_tokens = N,
                          .max_seqs = 2,
                          .kv_bytes = (size_t)1 << 20,
                          .block_tokens = 4};
    return gpu_backend(b, m, &o);
}

/* How a sequence computes: a weight version (NULL: the model's) and an
 * unmerged adapter term (NULL: none). */
typedef struct with {
    const eng_weights *w;
    const eng_lora_term *term;
} with;

/* One step of sequence s: n tokens from pos, computed as wi says (NULL:
 * plainly); every row's logits into rows ([n][V]) when n > 1, else the
 * one row. */
static int step_with(eng_backend *b, eng_seq_kv *s, const int32_t *tokens, int32_t n, int32_t pos,
                     const with *wi, float *rows)
{
    char msg[1024];
    float *last = malloc(V * sizeof(float));
    eng_step_seq q = {.kv = s,
                      .tokens = tokens,
                      .n_tokens = n,
                      .pos = pos,
                      .all_logits = n > 1 ? rows : NULL,
                      .weights = wi ? wi->w : NULL,
                      .delta = wi ? wi->term : NULL,
                      .n_delta = wi && wi->term ? 1 : 0};
    int rc = eng_backend_forward(b, &q, 1, n > 1 ? last : rows, NULL, msg, sizeof msg);
    if (rc != QL_OK)
        printf("step at %d (%d tokens): %s\n", pos, n, msg);
    free(last);
    return rc;
}

static int step(eng_backend *b, eng_seq_kv *s, const int32_t *tokens, int32_t n, int32_t pos,
                float *rows)
{
    return step_with(b, s, tokens, n, pos, NULL, rows);
}

/* GEMMA4_TOKENS through b: a prefill of 9, then one a step, computed as
 * wi says (NULL: plainly); every position's logits into all ([N][V]). */
static int run_prompt_with(eng_backend *b, const with *wi, float *all)
{
    int32_t ids[N];
    for (int i = 0; i < N; i++)
        ids[i] = GEMMA4_TOKENS[i];
    eng_kv_cache *kv = eng_backend_kv(b);
    eng_seq_kv s = {0};
    if (eng_kv_reserve(kv, &s, N) != QL_OK)
        return QL_ENOMEM;
    int rc = step_with(b, &s, ids, 9, 0, wi, all);
    for (int32_t pos = 9; rc == QL_OK && pos < N; pos++)
        rc = step_with(b, &s, ids + pos, 1, pos, wi, all + (size_t)pos * V);
    eng_kv_release(kv, &s);
    return rc;
}

static int run_prompt(eng_backend *b, float *all)
{
    return run_prompt_with(b, NULL, all);
}

static int argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* The shapes' prompt prefilled, then 12 greedy steps on b; the first id
 * that differs from want (-1: none), or -2 when a step failed. */
static int greedy_mismatch(eng_backend *b, const int *want)
{
    int32_t ids[GEMMA4_SHAPES_N_PROMPT + GEMMA4_SHAPES_N_GREEDY];
    for (int i = 0; i < GEMMA4_SHAPES_N_PROMPT; i++)
        ids[i] = GEMMA4_SHAPES_PROMPT[i];
    eng_kv_cache *kv = eng_backend_kv(b);
    eng_seq_kv s = {0};
    float *rows = malloc((size_t)GEMMA4_SHAPES_N_PROMPT * V * sizeof(float));
    int bad = -2;
    if (eng_kv_reserve(kv, &s, GEMMA4_SHAPES_N_PROMPT + GEMMA4_SHAPES_N_GREEDY) == QL_OK &&
        step(b, &s, ids, GEMMA4_SHAPES_N_PROMPT, 0, rows) == QL_OK) {
        const float *last = rows + (size_t)(GEMMA4_SHAPES_N_PROMPT - 1) * V;
        bad = -1;
        for (int g = 0; g < GEMMA4_SHAPES_N_GREEDY; g++) {
            int32_t pos = GEMMA4_SHAPES_N_PROMPT + g;
            ids[pos] = argmax(last, V);
            if (ids[pos] != want[g]) {
                bad = g;
                break;
            }
            if (g + 1 < GEMMA4_SHAPES_N_GREEDY) {
                if (step(b, &s, ids + pos, 1, pos, rows) != QL_OK) {
                    bad = -2;
                    break;
                }
                last = rows;
            }
        }
    }
    eng_kv_release(kv, &s);
    free(rows);
    return bad;
}

/* One fixture: its logits on the device against the float64 reference
 * and the CPU backend, its greedy ids. */
static void fixture(const char *folder, const double *ref, const int *greedy)
{
    char name[128];
    eng_model m = {0};
    eng_backend *gpu = NULL, *cpu = NULL;
    snprintf(name, sizeof name, "%s_runs_on_the_cuda_backend", folder);
    if (gpu_load(&m, folder) != QL_OK || backend(&gpu, &m, ENG_DEVICE_CUDA) != QL_OK ||
        backend(&cpu, &m, ENG_DEVICE_CPU) != QL_OK) {
        gpu_report(false, name, "see above");
        goto done;
    }
    float *g = malloc((size_t)N * V * sizeof(float)), *c = malloc((size_t)N * V * sizeof(float));
    bool ran = run_prompt(gpu, g) == QL_OK && run_prompt(cpu, c) == QL_OK;
    double to_ref = ran ? test_worst_row_l2(g, ref, N, V) : INFINITY,
           to_cpu = ran ? gpu_worst_abs(g, c, (size_t)N * V) : INFINITY,
           cpu_ref = ran ? test_worst_row_l2(c, ref, N, V) : INFINITY;
    printf("%s: relative L2 %.3g from transformers (CPU %.3g), %.3g from the CPU backend\n", folder,
           to_ref, cpu_ref, to_cpu);
    snprintf(name, sizeof name, "%s_logits_within_tol_of_transformers", folder);
    gpu_report(to_ref <= GEMMA4_TOL, name, "%.3g > %g", to_ref, GEMMA4_TOL);
    snprintf(name, sizeof name, "%s_logits_within_tol_of_the_cpu_backend", folder);
    gpu_report(to_cpu <= GEMMA4_CPU_TOL, name, "%.3g > %g", to_cpu, GEMMA4_CPU_TOL);
    free(g);
    free(c);
    if (greedy) {
        int bad = greedy_mismatch(gpu, greedy);
        snprintf(name, sizeof name, "%s_greedy_ids_after_the_prompt", folder);
        gpu_report(bad == -1, name, "%s %d", bad == -2 ? "a step failed at" : "id differs at", bad);
    }
done:
    eng_backend_free(gpu);
    eng_backend_free(cpu);
    eng_model_free(&m);
}

/* PEFT's adapter on the seven and each layer's per_layer_input_gate and
 * per_layer_projection (peft/gemma4_ple) on the device, within 5e-5 of
 * PEFT's float64 logits (test_gemma4.c's bound for the CPU; transformers'
 * float32 RMSNorm is 1.4e-5 of it): unmerged, and merged (a version that
 * records the merge alone: the device merges from its pristine weights,
 * never reading a host copy). */
#define GEMMA4_LORA_TOL 5e-5

/* The worst |got - want| over every position; infinity for a NaN. */
static double worst_abs(const float *got, const double *want)
{
    double w = 0.0;
    for (size_t i = 0; i < (size_t)N * V; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= w))
            w = isnan(e) ? INFINITY : e;
    }
    return w;
}

static void peft_adapter_on_the_per_layer_projections(void)
{
    char path[512], msg[1024];
    eng_model m = {0};
    eng_backend *gpu = NULL;
    eng_lora *l = NULL;
    eng_weights *merged = NULL;
    float *g = malloc((size_t)N * V * sizeof(float));
    int rc = gpu_load(&m, "gemma4_ple_tiny");
    snprintf(path, sizeof path, "%s/peft/gemma4_ple", QL_FIXTURES);
    if (rc == QL_OK && (rc = lora_load(&l, NULL, path, "gemma4_ple", &m, msg, sizeof msg)))
        printf("loading the adapter: %s\n", msg);
    eng_lora_term term = {l, 1.0f};
    if (rc == QL_OK && (rc = eng_weights_new(&merged, &m, 1, msg, sizeof msg)) == QL_OK)
        rc = eng_weights_set_merged(merged, &term, 1, msg, sizeof msg);
    if (rc == QL_OK)
        rc = backend(&gpu, &m, ENG_DEVICE_CUDA);
    struct {
        const char *name;
        with wi;
        const double *want;
    } runs[] = {
        {"gemma4_ple_tiny_peft_adapter_unmerged_within_tol_of_peft",
         {NULL, &term},
         &GEMMA4_PLE_LORA_LOGITS[0][0]},
        {"gemma4_ple_tiny_peft_adapter_merged_within_tol_of_peft",
         {merged, NULL},
         &GEMMA4_PLE_MERGED_LOGITS[0][0]},
    };
    for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
        int run = rc == QL_OK ? run_prompt_with(gpu, &runs[i].wi, g) : rc;
        double w = run == QL_OK ? worst_abs(g, runs[i].want) : INFINITY;
        printf("%s: worst logit error %.3g\n", runs[i].name, w);
        gpu_report(run == QL_OK && w <= GEMMA4_LORA_TOL, runs[i].name, "rc %d, worst %.3g > %g",
                   run, w, GEMMA4_LORA_TOL);
    }
    free(g);
    eng_backend_free(gpu);
    if (merged)
        eng_weights_unref(merged);
    if (l)
        eng_lora_unref(l);
    eng_model_free(&m);
}

/* --- attention on heads past 256 ---------------------------------------------- */

/* one sequence of ATT_POS positions in blocks of 4 taken out of order */
#define ATT_POS    11
#define ATT_BT     4
#define ATT_BLOCKS 3
/* test_cuda_ops.c's bound for the kernel on values in [-1, 1] */
#define ATT_TOL 1e-4

/* Rows at positions pos[0..rows) of the cache (h_arena, blocks through
 * table) attended by q, in float64: out[r][h] = softmax(q . k * scale) . v. */
static void att_reference(const float *arena, const int32_t *table, size_t block_floats,
                          const float *q, const int32_t *pos, int rows, int heads, int kv_heads,
                          int d, float scale, double *out)
{
    size_t kv_dim = (size_t)kv_heads * (size_t)d;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const float *qh = q + ((size_t)r * (size_t)heads + (size_t)h) * (size_t)d;
            size_t head = (size_t)(h / (heads / kv_heads)) * (size_t)d;
            double score[ATT_POS], max = -INFINITY, sum = 0.0;
            for (int p = 0; p <= pos[r]; p++) {
                const float *k = arena + (size_t)table[p / ATT_BT] * block_floats +
                                 (size_t)(p % ATT_BT) * kv_dim + head;
                double dot = 0.0;
                for (int e = 0; e < d; e++)
                    dot += (double)qh[e] * (double)k[e];
                score[p] = dot * scale;
                max = score[p] > max ? score[p] : max;
            }
            double *o = out + ((size_t)r * (size_t)heads + (size_t)h) * (size_t)d;
            memset(o, 0, (size_t)d * sizeof *o);
            for (int p = 0; p <= pos[r]; p++) {
                const float *v = arena + (size_t)table[p / ATT_BT] * block_floats +
                                 ((size_t)ATT_BT + (size_t)(p % ATT_BT)) * kv_dim + head;
                double w = exp(score[p] - max);
                sum += w;
                for (int e = 0; e < d; e++)
                    o[e] += w * (double)v[e];
            }
            for (int e = 0; e < d; e++)
                o[e] /= sum;
        }
}

/* Host to device copies of n bytes each, into fresh allocations. */
static bool to_device(void **dev, const void *host, size_t n)
{
    return cudaMalloc(dev, n) == cudaSuccess &&
           cudaMemcpy(*dev, host, n, cudaMemcpyHostToDevice) == cudaSuccess;
}

/* qt_cuda_attention_ex with heads of d (4 query heads over 2 kv heads)
 * over one sequence's paged cache: a prefill of the last 5 positions and
 * a decode of the last, against att_reference. */
static void attention_wide_heads(int d)
{
    char name[96], msg[256] = "";
    snprintf(name, sizeof name, "attention_heads_of_%d_match_the_reference", d);
    const int heads = 4, kv_heads = 2, rows = 5;
    size_t kv_dim = (size_t)kv_heads * (size_t)d, block_floats = 2 * ATT_BT * kv_dim,
           arena_n = ATT_BLOCKS * block_floats, q_n = (size_t)rows * (size_t)heads * (size_t)d;
    const int32_t table[ATT_BLOCKS] = {2, 0, 1}, row_seq[5] = {0, 0, 0, 0, 0},
                  row_pos[5] = {6, 7, 8, 9, 10}, bt_offset[1] = {0};
    float *arena = malloc(arena_n * sizeof(float)), *q = malloc(q_n * sizeof(float)),
          *got = malloc(q_n * sizeof(float));
    double *want = malloc(q_n * sizeof(double));
    rng_seed(0x6e6d6134u + (uint64_t)d);
    for (size_t i = 0; i < arena_n; i++)
        arena[i] = (float)(2.0 * rng_uniform() - 1.0);
    for (size_t i = 0; i < q_n; i++)
        q[i] = (float)(2.0 * rng_uniform() - 1.0);
    float scale = 1.0f / sqrtf((float)d);
    att_reference(arena, table, block_floats, q, row_pos, rows, heads, kv_heads, d, scale, want);
    void *d_arena = NULL, *d_q = NULL, *d_out = NULL, *d_table = NULL, *d_seq = NULL, *d_pos = NULL,
         *d_bt = NULL;
    bool ok =
        to_device(&d_arena, arena, arena_n * sizeof(float)) &&
        to_device(&d_q, q, q_n * sizeof(float)) &&
        cudaMalloc(&d_out, q_n * sizeof(float)) == cudaSuccess &&
        to_device(&d_table, table, sizeof table) && to_device(&d_seq, row_seq, sizeof row_seq) &&
        to_device(&d_pos, row_pos, sizeof row_pos) && to_device(&d_bt, bt_offset, sizeof bt_offset);
    qt_cuda_kv kv = {.arena = d_arena,
                     .block_tokens = ATT_BT,
                     .n_layers = 1,
                     .kv_dim = (int64_t)kv_dim,
                     .block_floats = block_floats};
    double worst = INFINITY;
    /* the prefill's rows, then the last one alone (a decode) */
    for (int pass = 0; ok && pass < 2; pass++) {
        int first = pass == 0 ? 0 : rows - 1, n = rows - first;
        size_t off = (size_t)first * (size_t)heads * (size_t)d;
        qt_cuda_step_rows sr = {n, d_seq, (const int32_t *)d_pos + first, d_bt, d_table};
        ok = qt_cuda_attention_ex(&kv, 0, &sr, (const float *)d_q + off, d_out, heads, kv_heads, d,
                                  0, scale, 0.0f, NULL, NULL, msg, sizeof msg) == QL_OK &&
             cudaMemcpy(got, d_out, (size_t)n * (size_t)heads * (size_t)d * sizeof(float),
                        cudaMemcpyDeviceToHost) == cudaSuccess;
        double w = 0.0;
        for (size_t i = 0; ok && i < (size_t)n * (size_t)heads * (size_t)d; i++) {
            double e = fabs((double)got[i] - want[off + i]);
            if (!(e <= w))
                w = isnan(e) ? INFINITY : e;
        }
        worst = pass == 0 || w > worst ? w : worst;
    }
    gpu_report(ok && worst <= ATT_TOL, name, "%s; worst %.3g > %g", ok ? "ran" : msg, worst,
               ATT_TOL);
    void *dev[] = {d_arena, d_q, d_out, d_table, d_seq, d_pos, d_bt};
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
        cudaFree(dev[i]);
    free(arena);
    free(q);
    free(got);
    free(want);
}

int main(void)
{
    int n = 0;
    if (qt_cuda_device_count(&n, NULL, 0) != QL_OK || n < 1) {
        printf("SKIP no usable CUDA device\n");
        return 77;
    }
    /* keys as values on the full layers */
    fixture("gemma4_keqv_tiny", &GEMMA4_KEQV_LOGITS[0][0], GEMMA4_KEQV_GREEDY);
    /* per-layer inputs, kv-shared layers with the double-wide MLP */
    fixture("gemma4_ple_tiny", &GEMMA4_PLE_LOGITS[0][0], GEMMA4_PLE_GREEDY);
    fixture("gemma4_cg_tiny", &GEMMA4_CG_LOGITS[0][0], GEMMA4_CG_GREEDY);
    /* the MoE block beside the MLP (and keys as values) */
    fixture("gemma4_moe_tiny", &GEMMA4_MOE_LOGITS[0][0], GEMMA4_MOE_GREEDY);
    /* full layers with their own head size (and kv heads) */
    fixture("gemma4_dims_tiny", &GEMMA4_DIMS_LOGITS[0][0], GEMMA4_DIMS_GREEDY);
    fixture("gemma4_dims_keqv_tiny", &GEMMA4_DIMS_KEQV_LOGITS[0][0], GEMMA4_DIMS_KEQV_GREEDY);
    /* an adapter on the per-layer input gate and projection */
    peft_adapter_on_the_per_layer_projections();
    /* the released checkpoints' full heads */
    attention_wide_heads(512);
    attention_wide_heads(510);
    return gpu_summary();
}

/*
 * bench_adapters.c - what hot LoRA adapters cost on a real model, as JSON.
 *
 * The adapter: rank 16, lora_alpha 32, on all seven attention and MLP
 * projections of every layer, written as a PEFT folder (bf16, as PEFT
 * saves a bf16 fine-tune). A is drawn like PEFT's Kaiming-uniform init, B
 * so that each module's delta scale * B @ A has a Frobenius norm of
 * --delta-ratio (default 0.02) times its weight's: trained LoRA deltas are
 * small against the weight, and how small decides what a 4-bit merge keeps,
 * so the merge report is also swept over 0.005, 0.02 and 0.05.
 *
 * Figures:
 *   - load: lora_load from a warm page cache until a request can use the
 *     adapter (median of 5), and how many of its bytes were copied rather
 *     than borrowed from the mapping;
 *   - merge and unmerge through the registry (a new weight version built
 *     and published), per quant kind: the model's own kind (the default
 *     model's Q4_1) and the same weights requantized in memory to nf4,
 *     int4 (group 64: 576 columns are no multiple of 128) and int8 (per
 *     channel), with the merge report;
 *   - decode tokens/s at batch 1 with one unmerged adapter and at batch 8
 *     with 0, 1, 4 and 8 distinct unmerged adapters, as a ratio to the same
 *     batch with none measured in the same round (eng_forward, greedy,
 *     --new-tokens steps; the median over --rounds rounds, and the range),
 *     and batch 8 with the 8 adapters widened to f32 (as an f32 PEFT file
 *     loads with --adapter-dtype f32: the gathered route); per run also the
 *     calling thread's CPU time per step (at --threads 1 the whole step's
 *     work, which other processes on a shared machine do not inflate);
 *   - where that time goes: one step's adapter work at batch 8 with 8
 *     distinct adapters on one thread, stage by stage, for the gathered
 *     route (f32 and f16 modules) and the bf16 row route (product_costs);
 *   - drift: PEFT's way (merge into the quantized weight, later subtract
 *     and requantize) against ours (recompute from the pristine weight)
 *     after 1, 10 and 100 merge/unmerge cycles, on the seven projections of
 *     layer 0: relative L2 distance from the pristine weights and bytes
 *     differing. Ours restores the pristine tensor, so both are zero.
 *
 * With --merge-nf4 N it measures only the NF4 merge (the figure issue 18
 * compares with PEFT + bitsandbytes, bench/merge_vs_peft.sh): the weights
 * requantized to NF4 (blocksize 64, no double quant: bitsandbytes'
 * defaults), adapter a0 merged and unmerged N times through the registry,
 * and the best and every time, as "merge_nf4_seconds". --adapter-dir DIR
 * writes that adapter to DIR and keeps it, so that the peer merges the
 * same one.
 *
 * Usage: bench_adapters --model PATH [--threads N] [--new-tokens N]
 *                       [--delta-ratio R] [--dir TMPDIR]
 *                       [--merge-nf4 N [--adapter-dir DIR]]
 */
#include "lora.h"
#include "peft_writer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define RANK  16
#define ALPHA 32.0f

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The calling thread's CPU time: at --threads 1 a step's whole work, and
 * what a busy shared machine's other processes do not add to. */
static double thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU seconds of this process, all threads: under a loaded machine a
 * steadier figure than the wall clock. */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "bench_adapters: %s: %s\n", what, msg);
    exit(1);
}

static double median(const double *v, int n)
{
    double s[64];
    memcpy(s, v, (size_t)n * sizeof *s);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && s[j] < s[j - 1]; j--) {
            double t = s[j];
            s[j] = s[j - 1];
            s[j - 1] = t;
        }
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

static double min_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = fmin(m, v[i]);
    return m;
}

static double max_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = fmax(m, v[i]);
    return m;
}

/* --- requantizing the default model's weights in memory -------------------- */

/* Replace every projection of m with its dequantized values quantized as
 * p: the same model at another kind, for kinds its file does not hold. */
static void requantize_model(eng_model *m, const qt_quant_params *p)
{
    char msg[512];
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        for (int k = 0; k < ENG_N_PROJ; k++) {
            qtensor *w = (qtensor *)eng_model_proj(m, l, (eng_proj)k);
            float *v = malloc((size_t)(w->rows * w->cols) * sizeof *v);
            qt_dequantize_rows(w, 0, w->rows, v);
            qtensor q;
            if (qt_quantize(&q, v, w->rows, w->cols, p, msg, sizeof msg))
                die("requantize", msg);
            qt_free(w);
            *w = q;
            free(v);
        }
    }
}

/* --- decode throughput ------------------------------------------------------- */

/* Decode tokens/s of `batch` sequences, sequence i applying adapters[i %
 * n_adapters] unmerged (n_adapters 0: none). */
static double decode_rate(const eng_model *m, eng_pool *pool, eng_lora **adapters, int n_adapters,
                          int batch, int new_tokens, double *cpu_ms_per_step)
{
    char msg[512];
    const int P = 32;
    eng_kv_cache *kv;
    eng_forward_state *st;
    if (eng_kv_new(&kv, &m->cfg, (size_t)256 << 20, 16, msg, sizeof msg) ||
        eng_forward_state_new(&st, m, P * batch, msg, sizeof msg))
        die("decode", msg);
    int32_t vocab = m->cfg.vocab_size;
    float *logits = malloc((size_t)batch * (size_t)vocab * sizeof *logits);
    int32_t prompt[32], next[8];
    for (int i = 0; i < P; i++)
        prompt[i] = 200 + (i * 37) % (vocab - 400);
    eng_seq_kv seqs[8] = {0};
    eng_step_seq step[8];
    eng_lora_term terms[8];
    for (int b = 0; b < batch; b++) {
        terms[b] = (eng_lora_term){n_adapters ? adapters[b % n_adapters] : NULL, 1.0f};
        eng_kv_reserve(kv, &seqs[b], P + new_tokens + 1);
        step[b] = (eng_step_seq){.kv = &seqs[b],
                                 .tokens = prompt,
                                 .n_tokens = P,
                                 .pos = 0,
                                 .weights = NULL,
                                 .delta = n_adapters ? &terms[b] : NULL,
                                 .n_delta = n_adapters ? 1 : 0};
    }
    if (eng_forward(st, m, kv, pool, step, batch, logits, msg, sizeof msg))
        die("prefill", msg);
    for (int b = 0; b < batch; b++)
        next[b] = 100 + b;
    double t0 = now(), c0 = thread_cpu();
    for (int k = 0; k < new_tokens; k++) {
        for (int b = 0; b < batch; b++)
            step[b] = (eng_step_seq){.kv = &seqs[b],
                                     .tokens = &next[b],
                                     .n_tokens = 1,
                                     .pos = P + k,
                                     .weights = NULL,
                                     .delta = n_adapters ? &terms[b] : NULL,
                                     .n_delta = n_adapters ? 1 : 0};
        if (eng_forward(st, m, kv, pool, step, batch, logits, msg, sizeof msg))
            die("decode", msg);
        for (int b = 0; b < batch; b++) {
            int32_t best = 0;
            for (int32_t i = 1; i < vocab; i++)
                if (logits[(size_t)b * vocab + i] > logits[(size_t)b * vocab + best])
                    best = i;
            next[b] = best;
        }
    }
    double rate = batch * new_tokens / (now() - t0);
    *cpu_ms_per_step = 1e3 * (thread_cpu() - c0) / new_tokens;
    for (int b = 0; b < batch; b++)
        eng_kv_release(kv, &seqs[b]);
    free(logits);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    return rate;
}

/* --- where a step's adapter time goes ----------------------------------------- */

/*
 * One decode step's unmerged-adapter work at batch 8 with 8 distinct
 * adapters (one row each), on one thread, best of `reps`, in ms per step,
 * stage by stage: the gathered route (what every module took before bf16
 * rows, and f32 and f16 modules still take: copy the row's x and y out,
 * t = s * A x and u = B t through qt_matmul, y += u, copy y back) and the
 * bf16 row route (qt_lora_down, qt_lora_up adding into y in place). The
 * adapters must be stored in bf16 for the second.
 */
static void product_costs(const eng_model *m, eng_lora **ad, int reps, FILE *out)
{
    enum { GATHER, A_PRODUCT, B_PRODUCT, ADD_INTO_Y, SCATTER, DOWN, UP, N_STAGES };
    static const char *const names[N_STAGES] = {"gather",  "a_product", "b_product", "add_into_y",
                                                "scatter", "bf16_down", "bf16_up"};
    size_t wide = (size_t)(m->cfg.intermediate_size > m->cfg.hidden_size ? m->cfg.intermediate_size
                                                                         : m->cfg.hidden_size);
    wide = wide > (size_t)m->cfg.n_heads * (size_t)m->cfg.head_dim
               ? wide
               : (size_t)m->cfg.n_heads * (size_t)m->cfg.head_dim;
    float *x = calloc(8 * wide, sizeof *x), *y = calloc(8 * wide, sizeof *y);
    float *gx = malloc(wide * sizeof *gx), *gy = malloc(wide * sizeof *gy);
    float *u = malloc(wide * sizeof *u), *t = malloc(256 * sizeof *t);
    if (!x || !y || !gx || !gy || !u || !t)
        die("product costs", "out of memory");
    for (size_t i = 0; i < 8 * wide; i++)
        x[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    double best[N_STAGES];
    for (int k = 0; k < N_STAGES; k++)
        best[k] = INFINITY;
    for (int rep = 0; rep < reps; rep++) {
        double sum[N_STAGES] = {0};
        for (int32_t l = 0; l < m->cfg.n_layers; l++)
            for (int p = 0; p < ENG_N_PROJ; p++)
                for (int i = 0; i < 8; i++) {
                    const eng_lora_module *mod = eng_lora_module_at(ad[i], l, (eng_proj)p);
                    if (!mod || mod->a.kind != QT_BF16 || mod->a.rows > 256)
                        continue;
                    int64_t in = mod->a.cols, o = mod->b.rows, rank = mod->a.rows;
                    const float *xr = x + (size_t)i * wide;
                    float *yr = y + (size_t)i * wide;
                    double t0 = now();
                    memcpy(gx, xr, (size_t)in * sizeof *gx);
                    memcpy(gy, yr, (size_t)o * sizeof *gy);
                    double t1 = now();
                    qt_matmul(&mod->a, gx, 1, t, 0, rank);
                    for (int64_t r = 0; r < rank; r++)
                        t[r] *= mod->scale;
                    double t2 = now();
                    qt_matmul(&mod->b, t, 1, u, 0, o);
                    double t3 = now();
                    for (int64_t j = 0; j < o; j++)
                        gy[j] += u[j];
                    double t4 = now();
                    memcpy(yr, gy, (size_t)o * sizeof *gy);
                    double t5 = now();
                    qt_lora_down(&mod->a, xr, mod->scale, t, 0, rank);
                    double t6 = now();
                    qt_lora_up(&mod->b, t, yr, 0, o);
                    double t7 = now();
                    double stage[N_STAGES] = {t1 - t0, t2 - t1, t3 - t2, t4 - t3,
                                              t5 - t4, t6 - t5, t7 - t6};
                    for (int k = 0; k < N_STAGES; k++)
                        sum[k] += stage[k];
                }
        for (int k = 0; k < N_STAGES; k++)
            best[k] = fmin(best[k], sum[k]);
    }
    fprintf(out, "  \"one_thread_ms_per_step_b8_8_adapters\": {\"reps\": %d", reps);
    for (int k = 0; k < N_STAGES; k++)
        fprintf(out, ", \"%s\": %.3f", names[k], 1e3 * best[k]);
    fprintf(out, "},\n");
    free(x);
    free(y);
    free(gx);
    free(gy);
    free(u);
    free(t);
}

/* --- drift: PEFT's subtract-and-requantize against ours ---------------------- */

typedef struct drift {
    double rel_l2; /* |dequant(W_n) - dequant(W_0)| / |dequant(W_0)| */
    size_t bytes_changed;
} drift;

/* After `cycles` merge/unmerge cycles done PEFT's way on layer 0's seven
 * projections of m with adapter lora. */
static drift peft_drift(const eng_model *m, const eng_lora *lora, int cycles)
{
    char msg[512];
    double num = 0, den = 0;
    size_t changed = 0;
    for (int p = 0; p < ENG_N_PROJ; p++) {
        const qtensor *w0 = eng_model_proj(m, 0, (eng_proj)p);
        const eng_lora_module *mod = eng_lora_module_at(lora, 0, (eng_proj)p);
        const lora_ops *ops;
        if (lora_dispatch(w0, &ops, msg, sizeof msg))
            die("dispatch", msg);
        lora_merge_opts o = {.safe_merge = true, .into = QT_KIND_COUNT};
        qtensor cur;
        if (qt_clone(&cur, w0))
            die("clone", "out of memory");
        for (int c = 0; c < cycles; c++) {
            /* merge: W <- Q(W + d); unmerge: W <- Q(W - d), always from the
             * current quantized weight, as PEFT's unmerge does */
            for (int sign = 1; sign >= -1; sign -= 2) {
                lora_part part = {"bench", mod, (float)sign};
                qtensor next;
                lora_cost cost;
                if (ops->merge(&cur, &part, 1, &o, "layer 0", &next, &cost, msg, sizeof msg))
                    die("merge", msg);
                qt_free(&cur);
                cur = next;
            }
        }
        size_t n = (size_t)(w0->rows * w0->cols);
        float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
        qt_dequantize_rows(w0, 0, w0->rows, a);
        qt_dequantize_rows(&cur, 0, cur.rows, b);
        for (size_t i = 0; i < n; i++) {
            num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
            den += (double)a[i] * a[i];
        }
        for (size_t i = 0; i < cur.data_bytes && i < w0->data_bytes; i++)
            changed += cur.data[i] != w0->data[i];
        free(a);
        free(b);
        qt_free(&cur);
    }
    return (drift){sqrt(num / den), changed};
}

/* --- one kind ----------------------------------------------------------------- */

/* An engine and a registry over m with adapter_dir loaded as "a" (dies
 * on an error). */
static void open_registry(const eng_model *m, const char *adapter_dir, int threads, eng_engine **e,
                          lora_registry **reg)
{
    char msg[1024];
    eng_engine_opts eo = {.threads = threads, .kv_bytes = (size_t)64 << 20};
    lora_registry_opts ro = {.threads = threads};
    if (eng_engine_start(e, m, &eo, msg, sizeof msg) ||
        lora_registry_new(reg, *e, m, &ro, msg, sizeof msg))
        die("engine", msg);
    if (lora_registry_load(*reg, "a", adapter_dir, 1.0f, NULL, msg, sizeof msg))
        die("load", msg);
}

static void merge_figures(const eng_model *m, const char *label, const char *adapter_dir,
                          int threads, FILE *out)
{
    char msg[1024];
    eng_engine *e;
    lora_registry *reg;
    open_registry(m, adapter_dir, threads, &e, &reg);
    uint64_t before = eng_weights_digest(m, NULL);
    lora_merge_opts mo = {.safe_merge = true, .into = QT_KIND_COUNT};
    lora_report rep, un;
    if (lora_registry_merge(reg, "a", 1.0f, &mo, &rep, msg, sizeof msg))
        die("merge", msg);
    if (lora_registry_unmerge(reg, "a", &un, msg, sizeof msg))
        die("unmerge", msg);
    fprintf(out,
            "    {\"kind\": \"%s\", \"merge_s\": %.4f, \"unmerge_s\": %.4f, \"modules\": %zu, "
            "\"delta_retained\": %.4f, \"relative_error\": %.4f, "
            "\"digest_restored\": %s",
            label, rep.seconds, un.seconds, rep.n_modules, rep.overall.delta_retained,
            rep.overall.relative_error, un.digest == before ? "true" : "false");
    /* the merge into wider kinds, for the 4-bit ones */
    qt_kind wider[2] = {QT_AFFINE, QT_BF16};
    for (int i = 0; i < 2; i++) {
        lora_report w;
        lora_merge_opts wo = {.safe_merge = true, .into = wider[i]};
        if (lora_registry_merge(reg, "a", 1.0f, &wo, &w, msg, sizeof msg))
            die("merge into", msg);
        fprintf(out, ", \"into_%s\": {\"delta_retained\": %.4f, \"relative_error\": %.4f}",
                i == 0 ? "int8" : "bf16", w.overall.delta_retained, w.overall.relative_error);
        lora_report_free(&w);
        if (lora_registry_unmerge(reg, "a", NULL, msg, sizeof msg))
            die("unmerge", msg);
    }
    eng_lora *lora;
    if (lora_registry_get(reg, "a", &lora, msg, sizeof msg))
        die("get", msg);
    drift d1 = peft_drift(m, lora, 1), d10 = peft_drift(m, lora, 10),
          d100 = peft_drift(m, lora, 100);
    fprintf(out,
            ", \"drift_peft_way\": {\"1\": [%.3g, %zu], \"10\": [%.3g, %zu], \"100\": [%.3g, "
            "%zu]}, \"drift_ours\": {\"100\": [0, 0]}}",
            d1.rel_l2, d1.bytes_changed, d10.rel_l2, d10.bytes_changed, d100.rel_l2,
            d100.bytes_changed);
    eng_lora_unref(lora);
    lora_report_free(&rep);
    lora_report_free(&un);
    eng_engine_stop(e);
    lora_registry_free(reg);
}

/* --- the NF4 merge alone ------------------------------------------------------ */

/* Merge and unmerge adapter_dir into m (already NF4) `repeat` times through
 * a registry with `threads` merge threads; print the times as JSON. */
static void merge_nf4_only(const eng_model *m, const char *model, const char *adapter_dir,
                           int threads, int repeat, FILE *out)
{
    char msg[1024];
    eng_engine *e;
    lora_registry *reg;
    open_registry(m, adapter_dir, threads, &e, &reg);
    uint64_t before = eng_weights_digest(m, NULL);
    double merge_s[64], merge_cpu[64], unmerge_s[64];
    bool restored = true;
    size_t modules = 0;
    uint64_t merged_digest = 0;
    lora_cost overall = {0};
    for (int i = 0; i < repeat; i++) {
        lora_merge_opts mo = {.safe_merge = true, .into = QT_KIND_COUNT};
        lora_report rep, un;
        double c0 = cpu_now();
        if (lora_registry_merge(reg, "a", 1.0f, &mo, &rep, msg, sizeof msg))
            die("merge", msg);
        merge_cpu[i] = cpu_now() - c0;
        if (lora_registry_unmerge(reg, "a", &un, msg, sizeof msg))
            die("unmerge", msg);
        merge_s[i] = rep.seconds;
        unmerge_s[i] = un.seconds;
        restored = restored && un.digest == before;
        modules = rep.n_modules;
        merged_digest = rep.digest;
        overall = rep.overall;
        lora_report_free(&rep);
        lora_report_free(&un);
    }
    fprintf(out,
            "{\n  \"bench\": \"adapters_merge_nf4\",\n  \"model\": \"%s\",\n  \"adapter\": "
            "\"%s\",\n  \"rank\": %d,\n  \"merge_threads\": %d,\n  \"cpu_path\": \"%s\",\n"
            "  \"modules\": %zu,\n  \"repeat\": %d,\n  \"merge_nf4_seconds\": %.4f,\n"
            "  \"merge_nf4_median_seconds\": %.4f,\n  \"merge_nf4_all\": [",
            model, adapter_dir, RANK, threads, qt_cpu_path(), modules, repeat,
            min_of(merge_s, repeat), median(merge_s, repeat));
    for (int i = 0; i < repeat; i++)
        fprintf(out, "%s%.4f", i ? ", " : "", merge_s[i]);
    fprintf(out,
            "],\n  \"merge_nf4_cpu_seconds\": %.4f,\n  \"unmerge_seconds\": %.4f,\n"
            "  \"merged_digest\": \"%016llx\",\n  \"digest_restored\": %s,\n"
            "  \"delta_retained\": %.4f,\n  \"relative_error\": %.4f\n}\n",
            min_of(merge_cpu, repeat), min_of(unmerge_s, repeat), (unsigned long long)merged_digest,
            restored ? "true" : "false", overall.delta_retained, overall.relative_error);
    eng_engine_stop(e);
    lora_registry_free(reg);
}

int main(int argc, char **argv)
{
    const char *model = NULL, *tmp = "/tmp";
    int threads = 0, new_tokens = 32, rounds = 5;
    bool decode_only = false;
    lora_dtype dtype = LORA_DTYPE_BF16; /* serve's default */
    int merge_nf4 = 0;
    const char *adapter_dir = NULL;
    double ratio = 0.02;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc)
            model = argv[++i];
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--new-tokens") == 0 && i + 1 < argc)
            new_tokens = atoi(argv[++i]);
        else if (strcmp(argv[i], "--delta-ratio") == 0 && i + 1 < argc)
            ratio = atof(argv[++i]);
        else if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc)
            tmp = argv[++i];
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (strcmp(argv[i], "--decode-only") == 0)
            decode_only = true;
        else if (strcmp(argv[i], "--adapter-dtype") == 0 && i + 1 < argc &&
                 lora_dtype_from_name(argv[i + 1]) >= 0)
            dtype = (lora_dtype)lora_dtype_from_name(argv[++i]);
        else if (strcmp(argv[i], "--merge-nf4") == 0 && i + 1 < argc)
            merge_nf4 = atoi(argv[++i]);
        else if (strcmp(argv[i], "--adapter-dir") == 0 && i + 1 < argc)
            adapter_dir = argv[++i];
        else {
            fprintf(stderr, "usage: bench_adapters --model PATH [--threads N] [--new-tokens N] "
                            "[--delta-ratio R] [--dir TMPDIR] [--rounds N] [--decode-only] "
                            "[--adapter-dtype bf16|f32] [--merge-nf4 N [--adapter-dir DIR]]\n");
            return 2;
        }
    }
    if (rounds < 1 || rounds > 64)
        rounds = 5;
    if (merge_nf4 < 0 || merge_nf4 > 64) {
        fprintf(stderr, "bench_adapters: --merge-nf4 takes 1 to 64 repeats, not %d\n", merge_nf4);
        return 2;
    }
    if (!model) {
        fprintf(stderr, "bench_adapters: --model is required\n");
        return 2;
    }
    char msg[1024];
    eng_model m;
    eng_load_opts lo = {.path = model};
    if (eng_model_load(&m, &lo, msg, sizeof msg))
        die(model, msg);
    if (merge_nf4) {
        char dir[800];
        snprintf(dir, sizeof dir, "%s/qlserve-bench-merge-%d", tmp, (int)getpid());
        const char *d = adapter_dir ? adapter_dir : dir;
        if (peft_write_random(&m, d, RANK, ALPHA, ratio, 1000, msg, sizeof msg))
            die(d, msg);
        qt_quant_params nf4 = {.kind = QT_NF4, .blocksize = 64};
        requantize_model(&m, &nf4);
        merge_nf4_only(&m, model, d, threads > 0 ? threads : 1, merge_nf4, stdout);
        eng_model_free(&m);
        if (!adapter_dir) {
            char cmd[900];
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
            if (system(cmd) != 0)
                fprintf(stderr, "bench_adapters: could not remove %s\n", dir);
        }
        return 0;
    }
    char base[700], dirs[8][800];
    snprintf(base, sizeof base, "%s/qlserve-bench-adapters-%d", tmp, (int)getpid());
    mkdir(base, 0755);
    for (int i = 0; i < 8; i++) {
        snprintf(dirs[i], sizeof dirs[i], "%s/a%d", base, i);
        if (peft_write_random(&m, dirs[i], RANK, ALPHA, ratio, 1000 + (uint64_t)i, msg, sizeof msg))
            die(dirs[i], msg);
    }
    eng_pool *pool;
    if (eng_pool_new(&pool, threads, msg, sizeof msg))
        die("pool", msg);
    FILE *out = stdout;
    fprintf(out, "{\n  \"bench\": \"adapters\",\n  \"model\": \"%s\",\n  \"kind\": \"%s\",\n",
            model, m.quant);
    fprintf(out, "  \"threads\": %d,\n  \"cpu_path\": \"%s\",\n  \"rank\": %d,\n",
            eng_pool_threads(pool), qt_cpu_path(), RANK);
    fprintf(out, "  \"delta_ratio\": %g,\n", ratio);

    // load: warm the page cache once, then time five loads
    eng_lora *lora = NULL;
    lora_meta meta;
    if (lora_load(&lora, &meta, dirs[0], "a0", &m, msg, sizeof msg))
        die("load", msg);
    size_t file_bytes = lora->bytes;
    eng_lora_unref(lora);
    double times[5];
    for (int i = 0; i < 5; i++) {
        double t0 = now();
        if (lora_load(&lora, &meta, dirs[0], "a0", &m, msg, sizeof msg))
            die("load", msg);
        times[i] = now() - t0;
        eng_lora_unref(lora);
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (times[j] < times[i]) {
                double t = times[i];
                times[i] = times[j];
                times[j] = t;
            }
    fprintf(out,
            "  \"load\": {\"median_ms\": %.2f, \"modules\": %d, \"bytes\": %zu, "
            "\"model_weight_bytes\": %zu},\n",
            1e3 * times[2], meta.n_modules, file_bytes, eng_model_weight_bytes(&m));

    // decode with unmerged adapters
    eng_lora *ad[8];
    for (int i = 0; i < 8; i++) {
        char name[16];
        snprintf(name, sizeof name, "a%d", i);
        if (lora_load_as(&ad[i], NULL, dirs[i], name, &m, dtype, msg, sizeof msg))
            die("load", msg);
    }
    /* the same adapters widened to f32, as an f32 PEFT file loads with
     * --adapter-dtype f32: the gathered route (qt_matmul on A and B) */
    eng_lora *ad32[8];
    for (int i = 0; i < 8; i++) {
        if (lora_load_as(&ad32[i], NULL, dirs[i], "f32", &m, LORA_DTYPE_F32, msg, sizeof msg))
            die("load", msg);
        for (size_t k = 0; k < (size_t)m.cfg.n_layers * ENG_N_PROJ; k++)
            if (ad32[i]->modules[k].a.rows &&
                (qt_cast_dense(&ad32[i]->modules[k].a, QT_F32, msg, sizeof msg) ||
                 qt_cast_dense(&ad32[i]->modules[k].b, QT_F32, msg, sizeof msg)))
                die("widen to f32", msg);
    }
    /* what a step reads: the model's weights once, and A and B of every
     * module of each distinct adapter once */
    size_t adapter_tensor_bytes = 0;
    for (int32_t l = 0; l < m.cfg.n_layers; l++)
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const eng_lora_module *mod = eng_lora_module_at(ad[0], l, (eng_proj)p);
            if (mod)
                adapter_tensor_bytes += mod->a.data_bytes + mod->b.data_bytes;
        }
    if (dtype == LORA_DTYPE_BF16)
        product_costs(&m, ad, 10, out);
    /* per round, every configuration once, interleaved, and its rate as a
     * ratio to the same batch with no adapter measured in that round (a
     * noisy neighbour slows a round's runs alike); the medians over rounds */
    enum { B1_NONE, B1_ONE, B8_NONE, B8_ONE, B8_FOUR, B8_EIGHT, B8_EIGHT_F32, N_RUNS };
    static const int run_batch[N_RUNS] = {1, 1, 8, 8, 8, 8, 8},
                     run_adapters[N_RUNS] = {0, 1, 0, 1, 4, 8, 8};
    double rate[N_RUNS][64], rel[N_RUNS][64], cpu[N_RUNS][64];
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < N_RUNS; k++)
            rate[k][r] = decode_rate(&m, pool, k == B8_EIGHT_F32 ? ad32 : ad, run_adapters[k],
                                     run_batch[k], new_tokens, &cpu[k][r]);
        for (int k = 0; k < N_RUNS; k++)
            rel[k][r] = rate[k][r] / rate[run_batch[k] == 1 ? B1_NONE : B8_NONE][r];
    }
    fprintf(out,
            "  \"decode\": {\"new_tokens\": %d, \"rounds\": %d, \"adapter_dtype\": \"%s\", "
            "\"adapter_tensor_bytes\": %zu, \"model_weight_bytes\": %zu, \"runs\": [\n",
            new_tokens, rounds, dtype == LORA_DTYPE_BF16 ? "bf16" : "f32", adapter_tensor_bytes,
            eng_model_weight_bytes(&m));
    for (int k = 0; k < N_RUNS; k++)
        fprintf(out,
                "    {\"batch\": %d, \"distinct_adapters\": %d, \"stored\": \"%s\", "
                "\"median_tok_s\": %.1f, \"best_cpu_ms_per_step\": %.2f, "
                "\"median_ms_per_step\": %.2f, \"best_ms_per_step\": %.2f, "
                "\"adapter_bytes_per_step\": %zu, "
                "\"median_ratio_to_none\": %.3f, \"min_ratio\": %.3f, \"max_ratio\": %.3f}%s\n",
                run_batch[k], run_adapters[k],
                !run_adapters[k]    ? ""
                : k == B8_EIGHT_F32 ? "f32"
                                    : "bf16",
                median(rate[k], rounds), min_of(cpu[k], rounds),
                1e3 * run_batch[k] / median(rate[k], rounds),
                1e3 * run_batch[k] / max_of(rate[k], rounds),
                (size_t)run_adapters[k] * adapter_tensor_bytes * (k == B8_EIGHT_F32 ? 2 : 1),
                median(rel[k], rounds), min_of(rel[k], rounds), max_of(rel[k], rounds),
                k + 1 < N_RUNS ? "," : "");
    fprintf(out, "  ]},\n");
    for (int i = 0; i < 8; i++) {
        eng_lora_unref(ad[i]);
        eng_lora_unref(ad32[i]);
    }

    if (decode_only) {
        fprintf(out, "  \"merge\": null\n}\n");
        eng_pool_free(pool);
        eng_model_free(&m);
        return 0;
    }

    // merge, unmerge and drift per kind
    fprintf(out, "  \"merge\": [\n");
    merge_figures(&m, m.quant, dirs[0], threads, out);
    struct {
        const char *label;
        qt_quant_params p;
    } kinds[3] = {
        {"nf4", {.kind = QT_NF4, .blocksize = 64}},
        {"int4",
         {.kind = QT_AFFINE,
          .bits = 4,
          .group_size = 64,
          .zero_domain = QT_ZERO_FLOAT,
          .eps = 1e-6f}},
        {"int8", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}},
    };
    for (int k = 0; k < 3; k++) {
        eng_model mk;
        if (eng_model_load(&mk, &lo, msg, sizeof msg))
            die(model, msg);
        requantize_model(&mk, &kinds[k].p);
        fprintf(out, ",\n");
        merge_figures(&mk, kinds[k].label, dirs[0], threads, out);
        eng_model_free(&mk);
    }
    fprintf(out, "\n  ],\n");

    // how the merge report moves with the delta's size (the model's own kind and nf4)
    fprintf(out, "  \"retained_by_delta_ratio\": {");
    double ratios[3] = {0.005, 0.02, 0.05};
    for (int r = 0; r < 3; r++) {
        char d[900];
        snprintf(d, sizeof d, "%s/sweep%d", base, r);
        if (peft_write_random(&m, d, RANK, ALPHA, ratios[r], 77, msg, sizeof msg))
            die(d, msg);
        eng_lora *l;
        if (lora_load(&l, NULL, d, "sweep", &m, msg, sizeof msg))
            die("load", msg);
        lora_cost total = {0};
        for (int32_t layer = 0; layer < m.cfg.n_layers; layer++)
            for (int p = 0; p < ENG_N_PROJ; p++) {
                const qtensor *w = eng_model_proj(&m, layer, (eng_proj)p);
                const lora_ops *ops;
                lora_merge_opts o = {.safe_merge = true, .into = QT_KIND_COUNT};
                lora_part part = {"sweep", eng_lora_module_at(l, layer, (eng_proj)p), 1.0f};
                qtensor merged;
                lora_cost c;
                if (lora_dispatch(w, &ops, msg, sizeof msg) ||
                    ops->merge(w, &part, 1, &o, "sweep", &merged, &c, msg, sizeof msg))
                    die("sweep", msg);
                lora_cost_add(&total, &c);
                qt_free(&merged);
            }
        fprintf(out, "%s\"%g\": {\"delta_retained\": %.4f, \"relative_error\": %.4f}",
                r ? ", " : "", ratios[r], total.delta_retained, total.relative_error);
        eng_lora_unref(l);
    }
    fprintf(out, "}\n}\n");
    eng_pool_free(pool);
    eng_model_free(&m);
    char cmd[800];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_adapters: could not remove %s\n", base);
    return 0;
}

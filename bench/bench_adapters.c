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
 *     batch with none (eng_forward, greedy, --new-tokens steps);
 *   - drift: PEFT's way (merge into the quantized weight, later subtract
 *     and requantize) against ours (recompute from the pristine weight)
 *     after 1, 10 and 100 merge/unmerge cycles, on the seven projections of
 *     layer 0: relative L2 distance from the pristine weights and bytes
 *     differing. Ours restores the pristine tensor, so both are zero.
 *
 * Usage: bench_adapters --model PATH [--threads N] [--new-tokens N]
 *                       [--delta-ratio R] [--dir TMPDIR]
 */
#include "lora.h"

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

static uint64_t rng_next(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float uniform(uint64_t *s)
{
    return (float)((double)(rng_next(s) >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}

static double frob(const float *v, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)v[i] * v[i];
    return sqrt(s);
}

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "bench_adapters: %s: %s\n", what, msg);
    exit(1);
}

/* --- the adapter folder ---------------------------------------------------- */

/* Write a PEFT folder for m whose deltas are `ratio` of each weight. */
static void write_adapter(const eng_model *m, const char *dir, double ratio, uint64_t seed)
{
    char path[1024], msg[512];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        die(path, "cannot write");
    fprintf(f,
            "{\"peft_type\": \"LORA\", \"r\": %d, \"lora_alpha\": %g, \"lora_dropout\": 0.0,\n"
            " \"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", "
            "\"gate_proj\", \"up_proj\", \"down_proj\"],\n"
            " \"bias\": \"none\", \"use_rslora\": false, \"fan_in_fan_out\": false,\n"
            " \"base_model_name_or_path\": \"%s\", \"task_type\": \"CAUSAL_LM\"}\n",
            RANK, (double)ALPHA, m->name);
    fclose(f);
    st_writer *w = st_writer_new();
    uint64_t rng = seed;
    float scale = ALPHA / RANK;
    void **keep = calloc((size_t)m->cfg.n_layers * ENG_N_PROJ * 2, sizeof *keep);
    size_t n_keep = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const qtensor *wt = eng_model_proj(m, l, (eng_proj)p);
            int64_t in = wt->cols, out = wt->rows;
            float *A = malloc((size_t)(RANK * in) * sizeof *A);
            float *B = malloc((size_t)(out * RANK) * sizeof *B);
            float *W = malloc((size_t)(out * in) * sizeof *W);
            /* Kaiming-uniform(a = sqrt(5)) as nn.Linear and PEFT: bound 1/sqrt(in) */
            double bound = 1.0 / sqrt((double)in);
            for (int64_t i = 0; i < RANK * in; i++)
                A[i] = (float)(bound * uniform(&rng));
            for (int64_t i = 0; i < out * RANK; i++)
                B[i] = uniform(&rng);
            /* the delta's norm, then B rescaled so it is ratio * |W| */
            qt_dequantize_rows(wt, 0, out, W);
            double wn = frob(W, (size_t)(out * in)), dn2 = 0;
            for (int64_t r = 0; r < out; r++) {
                for (int64_t c = 0; c < in; c++) {
                    double d = 0;
                    for (int k = 0; k < RANK; k++)
                        d += (double)B[r * RANK + k] * A[k * in + c];
                    dn2 += d * d * scale * scale;
                }
            }
            double k = ratio * wn / sqrt(dn2);
            uint16_t *a16 = malloc((size_t)(RANK * in) * 2),
                     *b16 = malloc((size_t)(out * RANK) * 2);
            for (int64_t i = 0; i < RANK * in; i++)
                a16[i] = qt_f32_to_bf16(A[i]);
            for (int64_t i = 0; i < out * RANK; i++)
                b16[i] = qt_f32_to_bf16((float)(B[i] * k));
            char name[256];
            int64_t sa[2] = {RANK, in}, sb[2] = {out, RANK};
            snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.%s.lora_A.weight", l,
                     eng_proj_parent((eng_proj)p), eng_proj_name((eng_proj)p));
            if (st_writer_add(w, name, ST_BF16, 2, sa, a16, (size_t)(RANK * in) * 2, false, msg,
                              sizeof msg))
                die(name, msg);
            snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.%s.lora_B.weight", l,
                     eng_proj_parent((eng_proj)p), eng_proj_name((eng_proj)p));
            if (st_writer_add(w, name, ST_BF16, 2, sb, b16, (size_t)(out * RANK) * 2, false, msg,
                              sizeof msg))
                die(name, msg);
            keep[n_keep++] = a16;
            keep[n_keep++] = b16;
            free(A);
            free(B);
            free(W);
        }
    }
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    if (st_writer_write(w, path, msg, sizeof msg))
        die(path, msg);
    st_writer_free(w);
    for (size_t i = 0; i < n_keep; i++)
        free(keep[i]);
    free(keep);
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
                          int batch, int new_tokens)
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
        step[b] = (eng_step_seq){
            &seqs[b], prompt, P, 0, NULL, n_adapters ? &terms[b] : NULL, n_adapters ? 1 : 0};
    }
    if (eng_forward(st, m, kv, pool, step, batch, logits, msg, sizeof msg))
        die("prefill", msg);
    for (int b = 0; b < batch; b++)
        next[b] = 100 + b;
    double t0 = now();
    for (int k = 0; k < new_tokens; k++) {
        for (int b = 0; b < batch; b++)
            step[b] = (eng_step_seq){
                &seqs[b],          &next[b], 1, P + k, NULL, n_adapters ? &terms[b] : NULL,
                n_adapters ? 1 : 0};
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
    for (int b = 0; b < batch; b++)
        eng_kv_release(kv, &seqs[b]);
    free(logits);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    return rate;
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

static void merge_figures(const eng_model *m, const char *label, const char *adapter_dir,
                          int threads, FILE *out)
{
    char msg[1024];
    eng_engine *e;
    lora_registry *reg;
    eng_engine_opts eo = {.threads = threads, .kv_bytes = (size_t)64 << 20};
    lora_registry_opts ro = {.threads = threads};
    if (eng_engine_start(&e, m, &eo, msg, sizeof msg) ||
        lora_registry_new(&reg, e, m, &ro, msg, sizeof msg))
        die("engine", msg);
    if (lora_registry_load(reg, "a", adapter_dir, NULL, msg, sizeof msg))
        die("load", msg);
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

int main(int argc, char **argv)
{
    const char *model = NULL, *tmp = "/tmp";
    int threads = 0, new_tokens = 32;
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
        else {
            fprintf(stderr, "usage: bench_adapters --model PATH [--threads N] [--new-tokens N] "
                            "[--delta-ratio R] [--dir TMPDIR]\n");
            return 2;
        }
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
    char base[700], dirs[8][800];
    snprintf(base, sizeof base, "%s/qlserve-bench-adapters-%d", tmp, (int)getpid());
    mkdir(base, 0755);
    for (int i = 0; i < 8; i++) {
        snprintf(dirs[i], sizeof dirs[i], "%s/a%d", base, i);
        write_adapter(&m, dirs[i], ratio, 1000 + (uint64_t)i);
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
        if (lora_load(&ad[i], NULL, dirs[i], name, &m, msg, sizeof msg))
            die("load", msg);
    }
    /* the best of three rounds, the configurations interleaved within each
     * round, so a noisy neighbour slows them alike */
    double b1_none = 0, b1_one = 0, b8[4] = {0};
    int counts[4] = {0, 1, 4, 8};
    for (int round = 0; round < 3; round++) {
        b1_none = fmax(b1_none, decode_rate(&m, pool, ad, 0, 1, new_tokens));
        b1_one = fmax(b1_one, decode_rate(&m, pool, ad, 1, 1, new_tokens));
        for (int i = 0; i < 4; i++)
            b8[i] = fmax(b8[i], decode_rate(&m, pool, ad, counts[i], 8, new_tokens));
    }
    fprintf(out,
            "  \"decode\": {\"new_tokens\": %d, \"batch1\": {\"none_tok_s\": %.1f, "
            "\"one_adapter_tok_s\": %.1f, \"ratio\": %.3f},\n",
            new_tokens, b1_none, b1_one, b1_one / b1_none);
    fprintf(out, "    \"batch8\": {\"none_tok_s\": %.1f", b8[0]);
    for (int i = 1; i < 4; i++)
        fprintf(out, ", \"%d_adapters_tok_s\": %.1f, \"%d_adapters_ratio\": %.3f", counts[i], b8[i],
                counts[i], b8[i] / b8[0]);
    fprintf(out, "}},\n");
    for (int i = 0; i < 8; i++)
        eng_lora_unref(ad[i]);

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
        write_adapter(&m, d, ratios[r], 77);
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

/*
 * bench_decode.c - prefill and decode throughput of the forward pass on a
 * real model, as JSON.
 *
 * For batch B in {1, 8, 32}: B sequences of a fixed synthetic prompt of P
 * tokens, rotated by 7 tokens per sequence so no two are equal (as the
 * peer's; a mixture of experts then routes each its own way), are prefilled (one step per sequence,
 * as llama.cpp's llama-bench times a prompt), then decoded together for N steps, one token per
 * sequence per step: prefill tokens/s = B * P / time, decode tokens/s =
 * B * N / time. Greedy tokens are fed back, so the work is a real decode.
 * Run per weight kind: as stored, and requantized on load (--quant).
 * As the peer (bench/peer_llamacpp.py): an untimed warm-up first, then
 * each figure is the best of --rounds (default 3) rounds for batch 1 and
 * of --repeats (default 1) for larger batches, each round from an empty
 * cache.
 * The KV cache holds --kv-dtype (default f16, as `qlserve serve` keeps it on
 * the CPU and llama-bench keeps its own; before 2026-12-07 the default was
 * f32). Peak resident memory comes
 * from getrusage. For a mixture of experts each batch's figures add the
 * experts' work per step (eng_forward_moe_step: experts run, summed over
 * the layers, each chosen expert once per layer however many rows it took,
 * and the bytes of their weights read), as means over the last round's
 * prefill steps and decode steps. bench/run_decode.py runs this
 * and llama.cpp (llama-cpp-python) on the same model in the same run and
 * prints the ratios.
 *
 * Usage: bench_decode --model PATH [--quant KIND]... [--threads N]
 *                     [--prompt-tokens P] [--new-tokens N] [--batches 1,8,32]
 *                     [--repeats R] [--rounds R1] [--kv-dtype f32|f16|q8_0]
 *                     [--clock wall|cpu] [--stages]
 *
 * --stages: after each batch's timed rounds, one more round with the
 * forward pass's stage clock on (stages.h): per prefill step and per decode
 * step, the step's wall time and each stage's (matmul, lm_head, attention,
 * elementwise, kv_write, embed; "rest" the remainder), and the GFLOP/s of
 * the dense projections (2 x their weights per token) and of the lm_head
 * (2 x vocab x hidden per row it scores). Not with --clock cpu.
 */
#include "model.h"
#include "runtime.h"
#include "stages.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

/* The clock the figures use (--clock): wall time, or the process's CPU
 * time, which on a machine shared with other work counts only what this
 * process ran; with --threads 1 that is the step's work, while with more
 * it also counts the pool's workers spinning between jobs. */
static clockid_t bench_clock = CLOCK_MONOTONIC;

static double now(void)
{
    struct timespec ts;
    clock_gettime(bench_clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int32_t argmax(const float *v, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* A mixture of experts' work in one round (eng_forward_moe_step after each step, summed over
 * the steps): experts run (each chosen expert counted once per layer per step, however many
 * rows it took) and bytes of their weights read, in the prefill steps and the decode steps. */
typedef struct moe_work {
    uint64_t prefill_experts, prefill_bytes, decode_experts, decode_bytes;
} moe_work;

typedef struct run_result {
    int batch;
    double prefill_tok_s, decode_tok_s;
    moe_work moe;
    /* --stages: the extra round's stage times and wall seconds, prefill then decode */
    eng_stage_times stages[2];
    double stage_s[2];
} run_result;

static bool want_stages;

/* One timed round from an empty cache: B sequences, sequence b's P-token
 * prompt at prompts + b * P (B = 1 reads only the first P), prefilled one step each, then N decode
 * steps of all B together; the seconds of each part, and the experts' work (zero for a dense
 * model). */
static int run_round(const eng_model *m, eng_kv_cache *kv, eng_pool *pool, eng_forward_state *st,
                     eng_seq_kv *seqs, eng_step_seq *step, int32_t *next, float *logits,
                     const int32_t *prompts, int32_t P, int32_t N, int B, double *prefill_s,
                     double *decode_s, moe_work *moe, eng_stage_times *stages)
{
    char msg[1024];
    int32_t vocab = m->cfg.vocab_size;
    double prefill = 0.0;
    uint64_t ran, bytes;
    *moe = (moe_work){0};
    eng_forward_time_stages(st, stages); /* the prefill steps' (NULL: untimed) */
    for (int b = 0; b < B; b++) {
        eng_kv_reserve(kv, &seqs[b], P + N);
        eng_step_seq one = {
            .kv = &seqs[b], .tokens = prompts + (size_t)b * (size_t)P, .n_tokens = P, .pos = 0};
        double t = now();
        if (eng_forward(st, m, kv, pool, &one, 1, logits, msg, sizeof msg)) {
            fprintf(stderr, "bench_decode: %s\n", msg);
            return 1;
        }
        prefill += now() - t;
        eng_forward_moe_step(st, &ran, &bytes);
        moe->prefill_experts += ran;
        moe->prefill_bytes += bytes;
        next[b] = argmax(logits, vocab);
    }
    eng_forward_time_stages(st, stages ? &stages[1] : NULL);
    double t = now();
    for (int32_t k = 0; k < N; k++) {
        for (int b = 0; b < B; b++)
            step[b] =
                (eng_step_seq){.kv = &seqs[b], .tokens = &next[b], .n_tokens = 1, .pos = P + k};
        if (eng_forward(st, m, kv, pool, step, B, logits, msg, sizeof msg)) {
            fprintf(stderr, "bench_decode: %s\n", msg);
            return 1;
        }
        eng_forward_moe_step(st, &ran, &bytes); /* two loads, so timed with the step */
        moe->decode_experts += ran;
        moe->decode_bytes += bytes;
        for (int b = 0; b < B; b++)
            next[b] = argmax(logits + (size_t)b * (size_t)vocab, vocab);
    }
    *decode_s = now() - t;
    *prefill_s = prefill;
    eng_forward_time_stages(st, NULL);
    for (int b = 0; b < B; b++)
        eng_kv_release(kv, &seqs[b]);
    return 0;
}

/* The number of mixture-of-experts layers of c (0: a dense model). */
static int32_t moe_layers(const eng_config *c)
{
    int32_t n = 0;
    for (int32_t l = 0; l < c->n_layers; l++)
        n += eng_layer_is_moe(c, l) ? 1 : 0;
    return n;
}

/* One batch's figures as a JSON object; for a mixture of experts also its work per step, the
 * means over the round's steps of the sums over its layers (a prefill step is one sequence's
 * P tokens, a decode step one token of each of the B sequences). */
static void print_result(FILE *out, const run_result *r, int32_t moe_l, int32_t N, bool first)
{
    fprintf(out, "%s{\"batch\": %d, \"prefill_tok_s\": %.1f, \"decode_tok_s\": %.1f",
            first ? "" : ", ", r->batch, r->prefill_tok_s, r->decode_tok_s);
    if (moe_l > 0) {
        double dx = (double)r->moe.decode_experts / N,
               px = (double)r->moe.prefill_experts / r->batch;
        fprintf(out,
                ", \"experts_per_decode_step\": %.1f, \"experts_per_layer_decode_step\": %.1f, "
                "\"expert_bytes_per_decode_step\": %.0f, \"experts_per_prefill_step\": %.1f, "
                "\"expert_bytes_per_prefill_step\": %.0f",
                dx, dx / moe_l, (double)r->moe.decode_bytes / N, px,
                (double)r->moe.prefill_bytes / r->batch);
    }
}

/* The weights of the layers' dense projections (2 x this many FLOPs a
 * token); 0 for a model with experts or linear-attention layers, whose
 * work per token this does not count. */
static double dense_projection_weights(const eng_model *m)
{
    double w = 0.0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        const eng_layer *ly = &m->layers[l];
        if (eng_layer_is_moe(&m->cfg, l) || eng_linear_is(&m->cfg.linear, l))
            return 0.0;
        const qtensor *t[] = {&ly->wq,     &ly->wk,   &ly->wv,    &ly->wo,
                              &ly->w_gate, &ly->w_up, &ly->w_down};
        for (size_t i = 0; i < sizeof t / sizeof *t; i++)
            w += (double)t[i]->rows * (double)t[i]->cols;
    }
    return w;
}

/* --stages: the extra round's stage times per step, as "stages" of the
 * batch's object, and the projections' and the lm_head's GFLOP/s. */
static void print_stages(FILE *out, const eng_model *m, const run_result *r, int32_t P, int32_t N)
{
    static const char *const part[2] = {"prefill", "decode"};
    double steps[2] = {r->batch, N}, tokens[2] = {(double)P, (double)r->batch},
           scored[2] = {1.0, (double)r->batch};
    double proj = dense_projection_weights(m),
           head = (double)m->cfg.vocab_size * (double)m->cfg.hidden_size;
    fprintf(out, ", \"stages\": {");
    for (int k = 0; k < 2; k++) {
        const eng_stage_times *t = &r->stages[k];
        double step_ms = 1e3 * r->stage_s[k] / steps[k], timed = 0.0;
        fprintf(out, "%s\"%s\": {\"step_ms\": %.3f", k ? ", " : "", part[k], step_ms);
        for (int s = 0; s < ENG_STAGE_COUNT; s++) {
            double ms = 1e-6 * (double)t->ns[s] / steps[k];
            timed += ms;
            fprintf(out, ", \"%s_ms\": %.3f", eng_stage_names[s], ms);
        }
        fprintf(out, ", \"rest_ms\": %.3f", step_ms - timed);
        double mm_s = 1e-9 * (double)t->ns[ENG_STAGE_MATMUL] / steps[k],
               head_s = 1e-9 * (double)t->ns[ENG_STAGE_LM_HEAD] / steps[k];
        if (proj > 0.0 && mm_s > 0.0)
            fprintf(out, ", \"matmul_gflops\": %.1f", 2.0 * proj * tokens[k] / mm_s * 1e-9);
        if (head_s > 0.0)
            fprintf(out, ", \"lm_head_gflops\": %.1f", 2.0 * head * scored[k] / head_s * 1e-9);
        fputc('}', out);
    }
    fputc('}', out);
}

static int bench_kind(const char *model, const char *quant, qt_kind kv_dtype, int threads,
                      int32_t P, int32_t N, int repeats, int rounds1, const int *batches,
                      int n_batches, FILE *out, bool last)
{
    char msg[1024];
    eng_model m;
    eng_load_opts o = {.path = model, .quant = quant};
    double t0 = now();
    if (eng_model_load(&m, &o, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "bench_decode: %s\n", msg);
        return 1;
    }
    double load_s = now() - t0;
    int maxb = 1;
    for (int i = 0; i < n_batches; i++)
        maxb = batches[i] > maxb ? batches[i] : maxb;
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    size_t kv_bytes = (size_t)maxb * (size_t)(P + N + 16) * eng_kv_token_bytes(&m.cfg, kv_dtype);
    /* a hybrid model: a recurrent state per sequence of the largest batch,
     * out of the same bytes (hybrid.h) */
    kv_bytes += (size_t)maxb * (size_t)eng_linear_seq_state(&m.cfg.linear) * sizeof(float);
    if (eng_pool_new(&pool, threads, msg, sizeof msg) ||
        eng_kv_new_states(&kv, &m.cfg, kv_bytes + (64u << 20), 16, kv_dtype, maxb, msg,
                          sizeof msg) ||
        eng_forward_state_new(&st, &m, P > maxb ? P : maxb, msg, sizeof msg)) {
        fprintf(stderr, "bench_decode: %s\n", msg);
        return 1;
    }
    int32_t vocab = m.cfg.vocab_size;
    float *logits = malloc((size_t)maxb * (size_t)vocab * sizeof(float));
    int32_t *prompt = malloc((size_t)maxb * (size_t)P * sizeof(int32_t));
    /* a fixed, plausible prompt: ordinary token ids cycling; sequence b's rotated by 7 * b */
    for (int b = 0; b < maxb; b++)
        for (int32_t i = 0; i < P; i++)
            prompt[(size_t)b * (size_t)P + (size_t)i] = 200 + ((i + 7 * b) * 37) % (vocab - 400);
    eng_seq_kv *seqs = calloc((size_t)maxb, sizeof *seqs);
    eng_step_seq *step = calloc((size_t)maxb, sizeof *step);
    int32_t *next = calloc((size_t)maxb, sizeof *next);
    run_result res[8];

    /* warm-up, untimed: a short prefill and a few steps, as the peer does */
    double ignore_p, ignore_d;
    moe_work moe;
    if (run_round(&m, kv, pool, st, seqs, step, next, logits, prompt, P < 8 ? P : 8, 4, 1,
                  &ignore_p, &ignore_d, &moe, NULL))
        return 1;
    for (int bi = 0; bi < n_batches; bi++) {
        int B = batches[bi];
        double best_p = 0.0, best_d = 0.0;
        /* the best of several rounds, as the peer reports: batch 1 is short */
        for (int k = 0, rounds = B == 1 ? rounds1 : repeats; k < rounds; k++) {
            double p, d;
            if (run_round(&m, kv, pool, st, seqs, step, next, logits, prompt, P, N, B, &p, &d, &moe,
                          NULL))
                return 1;
            best_p = k == 0 || p < best_p ? p : best_p;
            best_d = k == 0 || d < best_d ? d : best_d;
        }
        res[bi] = (run_result){.batch = B,
                               .prefill_tok_s = (double)B * P / best_p,
                               .decode_tok_s = (double)B * N / best_d,
                               .moe = moe};
        if (want_stages &&
            run_round(&m, kv, pool, st, seqs, step, next, logits, prompt, P, N, B,
                      &res[bi].stage_s[0], &res[bi].stage_s[1], &moe, res[bi].stages))
            return 1;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(out,
            "    {\"weights\": \"%s\", \"quant\": \"%s\", \"kv_dtype\": \"%s\", \"bytes\": %zu, "
            "\"load_s\": %.3f, \"peak_rss_mb\": %.1f, ",
            m.quant, quant ? quant : "none", qt_kind_name(kv_dtype), eng_model_weight_bytes(&m),
            load_s, (double)ru.ru_maxrss / 1024.0);
    int32_t moe_l = moe_layers(&m.cfg);
    if (moe_l > 0)
        fprintf(out, "\"moe\": {\"layers\": %d, \"experts\": %d, \"experts_used\": %d}, ", moe_l,
                m.cfg.n_experts, m.cfg.n_experts_used);
    fprintf(out, "\"results\": [");
    for (int bi = 0; bi < n_batches; bi++) {
        print_result(out, &res[bi], moe_l, N, bi == 0);
        if (want_stages)
            print_stages(out, &m, &res[bi], P, N);
        fputc('}', out);
    }
    fprintf(out, "]}%s\n", last ? "" : ",");
    free(logits);
    free(prompt);
    free(seqs);
    free(step);
    free(next);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    eng_model_free(&m);
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = NULL;
    const char *quants[8];
    int n_quants = 0, threads = 0, n_batches = 0, batches[8];
    int32_t P = 128, N = 32;
    int repeats = 1, rounds1 = 3;
    const char *kv_name = "f16", *act_name = "f32", *clock_name = "wall";
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--stages")) { /* a flag: out of the pairs below */
            want_stages = true;
            memmove(&argv[i], &argv[i + 1], (size_t)(argc - i) * sizeof *argv);
            argc--;
            break;
        }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model"))
            model = argv[i + 1];
        else if (!strcmp(argv[i], "--quant") && n_quants < 8)
            quants[n_quants++] = argv[i + 1];
        else if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--prompt-tokens"))
            P = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--new-tokens"))
            N = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--repeats"))
            repeats = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds"))
            rounds1 = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv-dtype"))
            kv_name = argv[i + 1];
        else if (!strcmp(argv[i], "--activations"))
            act_name = argv[i + 1];
        else if (!strcmp(argv[i], "--clock"))
            clock_name = argv[i + 1];
        else if (!strcmp(argv[i], "--batches"))
            for (char *s = argv[i + 1]; *s && n_batches < 8;
                 s = strchr(s, ',') ? strchr(s, ',') + 1 : "")
                batches[n_batches++] = atoi(s);
    }
    char msg[256];
    qt_kind kv_dtype = QT_F16;
    if (eng_kv_dtype_parse(kv_name, &kv_dtype, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "bench_decode: --kv-dtype: %s\n", msg);
        return 2;
    }
    int act = ql_name_parse(&ql_activations_names, act_name);
    if (act < 0) {
        fprintf(stderr, "bench_decode: --activations: \"%s\" is not f32 or q8\n", act_name);
        return 2;
    }
    qt_set_activations((ql_activations)act);
    if (strcmp(clock_name, "wall") && strcmp(clock_name, "cpu")) {
        fprintf(stderr, "bench_decode: --clock: \"%s\" is not wall or cpu\n", clock_name);
        return 2;
    }
    bench_clock = strcmp(clock_name, "cpu") ? CLOCK_MONOTONIC : CLOCK_PROCESS_CPUTIME_ID;
    if (want_stages && bench_clock != CLOCK_MONOTONIC) {
        fprintf(stderr, "bench_decode: --stages times wall clock; not with --clock cpu\n");
        return 2;
    }
    if (!model || P < 1 || N < 1 || repeats < 1 || rounds1 < 1) {
        fprintf(stderr, "usage: bench_decode --model PATH [--quant KIND]... [--threads N] "
                        "[--prompt-tokens P] [--new-tokens N] [--batches 1,8,32] "
                        "[--repeats R] [--rounds R1] [--kv-dtype f32|f16|q8_0] "
                        "[--activations f32|q8] [--clock wall|cpu] [--stages]\n");
        return 2;
    }
    if (n_batches == 0) {
        batches[0] = 1, batches[1] = 8, batches[2] = 32;
        n_batches = 3;
    }
    if (n_quants == 0)
        quants[n_quants++] = "none";
    eng_pool *probe;
    eng_pool_new(&probe, threads, msg, sizeof msg);
    int nthreads = eng_pool_threads(probe);
    eng_pool_free(probe);
    time_t t = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
    printf("{\n  \"benchmark\": \"decode\",\n  \"engine\": \"qlserve\",\n  \"date\": \"%s\",\n"
           "  \"model\": \"%s\",\n  \"threads\": %d,\n  \"kernel_path\": \"%s\",\n"
           "  \"f32_kernels\": \"%s\",\n  \"q8_kernels\": \"%s\",\n  \"activations\": \"%s\",\n"
           "  \"clock\": \"%s\",\n  \"batch1_rounds\": %d,\n  \"prompt_tokens\": %d,\n"
           "  \"new_tokens\": %d,\n  \"kinds\": [\n",
           date, model, nthreads, qt_cpu_path(), qt_f32_path(), qt_q8_path(),
           ql_name_of(&ql_activations_names, qt_get_activations()), clock_name, rounds1, P, N);
    for (int q = 0; q < n_quants; q++)
        if (bench_kind(model, quants[q], kv_dtype, nthreads, P, N, repeats, rounds1, batches,
                       n_batches, stdout, q + 1 == n_quants))
            return 1;
    printf("  ]\n}\n");
    return 0;
}

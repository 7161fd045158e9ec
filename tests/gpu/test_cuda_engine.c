/*
 * test_cuda_engine.c - the CUDA backend against the CPU backend, whole
 * steps at a time: the same step lists go to both (prefill chunks, decodes,
 * several sequences, unmerged adapters, a merged weight version), and
 *   - the logits agree within a relative bound (the CPU backend is the
 *     reference; both compute in f32 with different summation orders, so
 *     the bound is 1e-3 of the largest logit, about a hundred times the
 *     differences f32 reordering makes at these widths);
 *   - the greedy tokens are equal wherever the CPU's best logit leads the
 *     runner-up by more than that bound (closer calls are counted and
 *     printed, not failed: no two summation orders can promise them);
 *   - a merge on the device gives the CPU merge's bytes (the digests of
 *     what each backend serves are equal), and after the unmerge the
 *     device serves the pristine bytes again.
 *   - forks sharing a prompt's KV blocks decode as on the CPU, each
 *     copy on write made by eng_backend_copy_blocks in the device arena;
 *   - a sequence asking for every row's logits (all_logits) gets the
 *     CPU's rows, more of them than the device's logits buffer holds,
 *     and its token is never chosen on the device;
 *   - a model with rope frequency factors (a Llama 3.x GGUF's
 *     rope_freqs.weight) steps as on the CPU, and so does Phi-3's longrope
 *     (the same factors plus the attention factor on cos and sin), on a
 *     random model and on the converter's q8_0 file of the tiny Phi-3 with
 *     its PEFT adapter on the fused modules (read from tests/fixtures).
 * The models are built in memory (random weights quantized with
 * qt_quantize into each kind), so nothing is read from disk but the tiny
 * Phi-3 fixture above; with
 * QL_DEFAULT_MODEL set to the default model's GGUF, its greedy
 * continuations of a few prompts must be equal on both backends too, and
 * a JSON Schema's constrained answers on the device (the masked rows come
 * back to the host) must be whole sentences of its grammar, the greedy one
 * the CPU engine's.
 *
 * Plain C, no Criterion (the GPU machine has only CUDA and cJSON): prints
 * `PASS name` or `FAIL name: detail` per check; exit 0 when all passed, 1
 * when one failed, 77 when there is no usable device.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "gpu_model_util.h"
#include "grammar.h"
#include "lora.h"
#include "model.h"
#include "peft_writer.h"
#include "qt_cuda.h"
#include "qt_cuda_ops.h"
#include "qt_cuda_sample.h"
#include "runtime.h"
#include "sample_math.h"
#include "scheduler.h"
#include "tokenizer.h"

#include <cuda_runtime_api.h>

static int passed, failed;

static void report(bool ok, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void report(bool ok, const char *name, const char *fmt, ...)
{
    if (ok) {
        passed++;
        printf("PASS %s\n", name);
        return;
    }
    failed++;
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    printf("FAIL %s: %s\n", name, detail);
}

/* --- random models ------------------------------------------------------------ */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1.0p-53;
}

/* Roughly normal (the sum of four uniforms), scaled. */
static void fill(float *v, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)((uniform() + uniform() + uniform() + uniform() - 2.0) * scale);
}

typedef struct model_case {
    const char *name;
    qt_quant_params params; /* the projections' kind */
    eng_arch arch;
    bool bias, tie, interleaved;
    int32_t window;
} model_case;

static int dense(qtensor *t, int64_t rows, int64_t cols, float scale, float offset)
{
    float *v = malloc((size_t)(rows * cols) * sizeof(float));
    fill(v, rows * cols, scale);
    for (int64_t i = 0; i < rows * cols; i++)
        v[i] += offset;
    int rc = qt_from_dense(t, QT_F32, v, rows, cols, NULL, 0);
    free(v);
    return rc;
}

/* A projection of kind p: random weights quantized, or random super-blocks
 * for a k-quant (gpu_make_weight). */
static int quantized(qtensor *t, int64_t rows, int64_t cols, const qt_quant_params *p)
{
    float *v = malloc((size_t)(rows * cols) * sizeof(float));
    fill(v, rows * cols, 0.08f);
    char msg[256];
    int rc = gpu_make_weight(t, v, rows, cols, p, msg, sizeof msg);
    if (rc != QL_OK)
        printf("quantize %lldx%lld: %s\n", (long long)rows, (long long)cols, msg);
    free(v);
    return rc;
}

/* A tiny decoder of random weights: 3 layers, hidden 128, 4 heads of 32
 * (2 kv heads), ffn 192, vocab 320; every width a multiple of 32 so every
 * kind applies. The kinds read in place (super-blocks of 256) take hidden
 * 256, 4 heads of 64, ffn 256 and one layer (the emulated GPU tests' time
 * budget); a Q4_K model has its V and down projections in Q6_K, as
 * llama.cpp's Q4_K_M mix does, and a Q3_K model its V in IQ4_NL and its
 * down in IQ4_XS (three read-in-place kinds in one model). */
static int make_model(eng_model *m, const model_case *mc)
{
    memset(m, 0, sizeof *m);
    eng_config *c = &m->cfg;
    const bool kq = gpu_read_in_place(mc->params.kind); /* blocks of 256 (IQ4_NL's 32 fit too) */
    *c = (eng_config){.arch = mc->arch,
                      .vocab_size = 320,
                      .hidden_size = kq ? 256 : 128,
                      .intermediate_size = kq ? 256 : 192,
                      .n_layers = kq ? 1 : 3,
                      .n_heads = 4,
                      .n_kv_heads = 2,
                      .head_dim = kq ? 64 : 32,
                      .max_position_embeddings = 512,
                      .rope_theta = 10000.0f,
                      .rope_interleaved = mc->interleaved,
                      .rms_norm_eps = 1e-5f,
                      .tie_word_embeddings = mc->tie,
                      .attention_bias = mc->bias,
                      .sliding_window = mc->window,
                      .bos_token_id = -1,
                      .eos_token_id = 1}; /* the engine takes EOS from here (no tokenizer) */
    int64_t H = c->hidden_size, F = c->intermediate_size, Q = c->n_heads * c->head_dim,
            KV = c->n_kv_heads * c->head_dim;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    qt_quant_params mix_v = mc->params, mix_down = mc->params;
    if (mc->params.kind == QT_Q4_K) {
        mix_v.kind = QT_Q6_K;
        mix_down.kind = QT_Q6_K;
    } else if (mc->params.kind == QT_Q3_K) {
        mix_v.kind = QT_IQ4_NL;
        mix_down.kind = QT_IQ4_XS;
    }
    int rc = dense(&m->embed, c->vocab_size, H, 0.5f, 0.0f);
    rc = rc ? rc : dense(&m->norm, 1, H, 0.1f, 1.0f);
    if (!mc->tie)
        rc = rc ? rc : dense(&m->lm_head, c->vocab_size, H, 0.1f, 0.0f);
    for (int32_t l = 0; rc == QL_OK && l < c->n_layers; l++) {
        eng_layer *L = &m->layers[l];
        rc = dense(&L->attn_norm, 1, H, 0.1f, 1.0f);
        rc = rc ? rc : dense(&L->ffn_norm, 1, H, 0.1f, 1.0f);
        rc = rc ? rc : quantized(&L->wq, Q, H, &mc->params);
        rc = rc ? rc : quantized(&L->wk, KV, H, &mc->params);
        rc = rc ? rc : quantized(&L->wv, KV, H, &mix_v);
        rc = rc ? rc : quantized(&L->wo, H, Q, &mc->params);
        rc = rc ? rc : quantized(&L->w_gate, F, H, &mc->params);
        rc = rc ? rc : quantized(&L->w_up, F, H, &mc->params);
        rc = rc ? rc : quantized(&L->w_down, H, F, &mix_down);
        if (mc->bias) {
            rc = rc ? rc : dense(&L->bq, 1, Q, 0.1f, 0.0f);
            rc = rc ? rc : dense(&L->bk, 1, KV, 0.1f, 0.0f);
            rc = rc ? rc : dense(&L->bv, 1, KV, 0.1f, 0.0f);
        }
    }
    snprintf(m->name, sizeof m->name, "random %s", mc->name);
    return rc;
}

/* --- an adapter in memory ------------------------------------------------------- */

static void free_lora(eng_lora *l)
{
    for (size_t i = 0; i < (size_t)l->n_layers * ENG_N_PROJ; i++) {
        qt_free(&l->modules[i].a);
        qt_free(&l->modules[i].b);
    }
    free(l->modules);
    free(l);
}

/* Rank r on every projection, A and B of kind `kind` (F32, F16 or BF16). */
static eng_lora *make_lora(const eng_model *m, const char *name, int32_t r, qt_kind kind)
{
    eng_lora *l = calloc(1, sizeof *l);
    snprintf(l->name, sizeof l->name, "%s", name);
    l->n_layers = m->cfg.n_layers;
    l->n_proj = ENG_N_PROJ;
    l->modules = calloc((size_t)l->n_layers * ENG_N_PROJ, sizeof *l->modules);
    l->refs = 1;
    l->destroy = free_lora;
    for (int32_t layer = 0; layer < l->n_layers; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const qtensor *w = eng_model_proj(m, layer, (eng_proj)p);
            eng_lora_module *mod = &l->modules[(size_t)layer * ENG_N_PROJ + p];
            float *a = malloc((size_t)(r * w->cols) * sizeof(float));
            float *b = malloc((size_t)(w->rows * r) * sizeof(float));
            fill(a, r * w->cols, 0.1f);
            fill(b, w->rows * r, 0.1f);
            qt_from_dense(&mod->a, QT_F32, a, r, w->cols, NULL, 0);
            qt_from_dense(&mod->b, QT_F32, b, w->rows, r, NULL, 0);
            if (kind != QT_F32) {
                qt_cast_dense(&mod->a, kind, NULL, 0);
                qt_cast_dense(&mod->b, kind, NULL, 0);
            }
            mod->scale = 16.0f / (float)r;
            free(a);
            free(b);
        }
    return l;
}

/* A version with `lora` merged at `scale` by the CPU merge (adapters/merge.c),
 * stored into `into` (QT_KIND_COUNT: each weight's own kind). */
static eng_weights *merged_version(const eng_model *m, eng_lora *lora, float scale, qt_kind into)
{
    eng_weights *w = NULL;
    char msg[256];
    if (eng_weights_new(&w, m, 1, msg, sizeof msg) != QL_OK)
        return NULL;
    lora_merge_opts o = {.safe_merge = true, .into = into};
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int p = 0; p < eng_n_proj(&m->cfg); p++) {
            const qtensor *pristine = eng_model_proj(m, l, (eng_proj)p);
            if (pristine->rows == 0 || !eng_lora_module_at(lora, l, (eng_proj)p))
                continue; /* an expert's slot in a dense layer; or untouched: pristine */
            const lora_ops *ops;
            lora_part part = {lora->name, eng_lora_module_at(lora, l, (eng_proj)p), scale};
            qtensor merged;
            lora_cost cost;
            if (lora_dispatch(pristine, &ops, msg, sizeof msg) != QL_OK ||
                ops->merge(pristine, &part, 1, &o, "module", &merged, &cost, msg, sizeof msg)) {
                printf("cpu merge: %s\n", msg);
                eng_weights_unref(w);
                return NULL;
            }
            eng_weights_set(w, l, (eng_proj)p, &merged);
        }
    eng_lora_term term = {lora, scale};
    eng_weights_set_merged(w, &term, 1, msg, sizeof msg);
    return w;
}

/* --- running both backends side by side ---------------------------------------- */

enum { N_SEQS = 3 };

typedef struct side {
    eng_backend *b;
    eng_seq_kv kv[N_SEQS];
    float *logits;
    int32_t tokens[N_SEQS];
} side;

static int side_new(side *s, const eng_model *m, eng_device d, char *msg, size_t msg_len)
{
    memset(s, 0, sizeof *s);
    eng_backend_opts o = {.device = d,
                          .threads = 0,
                          .max_tokens = 128,
                          .max_seqs = N_SEQS,
                          .kv_bytes = (size_t)16 << 20,
                          .block_tokens = 16};
    int rc = eng_backend_new(&s->b, m, &o, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    s->logits = calloc((size_t)N_SEQS * (size_t)m->cfg.vocab_size, sizeof(float));
    for (int i = 0; i < N_SEQS; i++)
        if (eng_kv_reserve(eng_backend_kv(s->b), &s->kv[i], 256) != QL_OK)
            return ql_fail(msg, msg_len, QL_ENOMEM, "KV reserve");
    return QL_OK;
}

static void side_free(side *s)
{
    for (int i = 0; s->b && i < N_SEQS; i++)
        eng_kv_release(eng_backend_kv(s->b), &s->kv[i]);
    eng_backend_free(s->b);
    free(s->logits);
}

/* What one sequence does in a step. */
typedef struct seq_step {
    const int32_t *tokens;
    int32_t n, pos;
    bool greedy;
} seq_step;

/* The argmax (lowest id on ties) and its lead over the runner-up. */
static int32_t best_of(const float *v, int32_t n, float *lead)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    float second = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (i != best && v[i] > second)
            second = v[i];
    *lead = v[best] - second;
    return best;
}

typedef struct compare {
    double worst; /* max |cuda - cpu| / max(1, max |cpu|) over compared rows */
    int tokens, mismatched, close_calls;
} compare;

/*
 * One step on both sides; compares what the CUDA side returned with the
 * CPU's logits. chosen[s] gets the CPU's greedy token (what both feed
 * next).
 */
static int both_step(side *cpu, side *gpu, const eng_model *m, const seq_step *ss, int32_t n,
                     const eng_weights *w, const eng_lora_term *const *delta,
                     const int32_t *n_delta, int32_t *chosen, compare *cmp, char *msg,
                     size_t msg_len)
{
    int32_t V = m->cfg.vocab_size;
    side *sides[2] = {cpu, gpu};
    for (int k = 0; k < 2; k++) {
        eng_step_seq steps[N_SEQS];
        for (int32_t s = 0; s < n; s++)
            steps[s] = (eng_step_seq){.kv = &sides[k]->kv[s],
                                      .tokens = ss[s].tokens,
                                      .n_tokens = ss[s].n,
                                      .pos = ss[s].pos,
                                      .weights = w,
                                      .delta = delta ? delta[s] : NULL,
                                      .n_delta = n_delta ? n_delta[s] : 0,
                                      .greedy = ss[s].greedy,
                                      /* longrope: B (40 tokens) on the long set */
                                      .rope_long = s == 1};
        int rc = eng_backend_forward(sides[k]->b, steps, n, sides[k]->logits, sides[k]->tokens, msg,
                                     msg_len);
        if (rc != QL_OK)
            return rc;
    }
    for (int32_t s = 0; s < n; s++) {
        const float *ref = cpu->logits + (size_t)s * V;
        float lead;
        chosen[s] = best_of(ref, V, &lead);
        double scale = 1.0;
        for (int32_t i = 0; i < V; i++)
            scale = fabs(ref[i]) > scale ? fabs(ref[i]) : scale;
        int32_t got;
        if (ss[s].greedy && gpu->tokens[s] >= 0) {
            got = gpu->tokens[s];
        } else {
            const float *v = gpu->logits + (size_t)s * V;
            float unused;
            got = best_of(v, V, &unused);
            for (int32_t i = 0; i < V; i++) {
                double d = fabs((double)v[i] - (double)ref[i]) / scale;
                if (!(d <= cmp->worst))
                    cmp->worst = isnan(d) ? INFINITY : d;
            }
        }
        cmp->tokens++;
        if (got != chosen[s]) {
            if (lead > 1e-3 * scale)
                cmp->mismatched++;
            else
                cmp->close_calls++;
        }
    }
    return QL_OK;
}

/*
 * The scenario: three sequences; step 1 prefills A (13 tokens), the first
 * 24 of B and C (1 token); step 2 the rest of B (16) and decodes A and C;
 * then 14 decode steps of all three. A and C take their tokens from the
 * device's greedy choice, B from its logits.
 */
static void scenario(const char *name, const eng_model *m, const eng_weights *w,
                     const eng_lora_term *const *delta, const int32_t *n_delta)
{
    char msg[512];
    side cpu, gpu;
    compare cmp = {0};
    int rc = side_new(&cpu, m, ENG_DEVICE_CPU, msg, sizeof msg);
    if (rc == QL_OK)
        rc = side_new(&gpu, m, ENG_DEVICE_CUDA, msg, sizeof msg);
    int32_t prompt[N_SEQS][40], next[N_SEQS] = {0}, chosen[N_SEQS], len[N_SEQS] = {13, 40, 1};
    for (int s = 0; s < N_SEQS; s++)
        for (int i = 0; i < 40; i++)
            prompt[s][i] = (int32_t)(uniform() * m->cfg.vocab_size);
    if (rc == QL_OK) {
        seq_step s1[N_SEQS] = {
            {prompt[0], 13, 0, true}, {prompt[1], 24, 0, false}, {prompt[2], 1, 0, true}};
        rc = both_step(&cpu, &gpu, m, s1, N_SEQS, w, delta, n_delta, chosen, &cmp, msg, sizeof msg);
        next[0] = chosen[0];
        next[2] = chosen[2];
    }
    if (rc == QL_OK) {
        seq_step s2[N_SEQS] = {
            {&next[0], 1, 13, true}, {prompt[1] + 24, 16, 24, false}, {&next[2], 1, 1, true}};
        rc = both_step(&cpu, &gpu, m, s2, N_SEQS, w, delta, n_delta, chosen, &cmp, msg, sizeof msg);
        len[0] = 14;
        len[2] = 2;
        memcpy(next, chosen, sizeof next);
    }
    for (int step = 0; rc == QL_OK && step < 14; step++) {
        int32_t was[N_SEQS];
        memcpy(was, next, sizeof was);
        seq_step sd[N_SEQS];
        for (int s = 0; s < N_SEQS; s++)
            sd[s] = (seq_step){&was[s], 1, len[s], s != 1};
        rc = both_step(&cpu, &gpu, m, sd, N_SEQS, w, delta, n_delta, chosen, &cmp, msg, sizeof msg);
        for (int s = 0; s < N_SEQS; s++)
            len[s]++;
        memcpy(next, chosen, sizeof next);
    }
    if (rc != QL_OK)
        report(false, name, "%s", msg);
    else
        report(cmp.worst <= 1e-3 && cmp.mismatched == 0, name,
               "worst relative logit difference %.3g (bound 1e-3), %d of %d greedy tokens "
               "differ where the CPU's lead was clear",
               cmp.worst, cmp.mismatched, cmp.tokens);
    if (rc == QL_OK)
        printf("  %s: worst relative logit difference %.3g, %d tokens, %d close calls\n", name,
               cmp.worst, cmp.tokens, cmp.close_calls);
    side_free(&cpu);
    side_free(&gpu);
}

/* --- shared prompts: copy on write, every row's logits ------------------------------ */

/* max |got - want| / max(1, max |want|) over n logits, into *worst. */
static void worst_of(const float *got, const float *want, int64_t n, double *worst)
{
    double scale = 1.0;
    for (int64_t i = 0; i < n; i++)
        scale = fabs(want[i]) > scale ? fabs(want[i]) : scale;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]) / scale;
        if (!(d <= *worst))
            *worst = isnan(d) ? INFINITY : d;
    }
}

enum { FORK_PROMPT = 21, FORK_STEPS = 14, FORK_TOTAL = FORK_PROMPT + FORK_STEPS };

/* Fill the next 8 free blocks with the K and V of other tokens and give
 * them back (released blocks are handed out again first): a copy on write
 * left undone then reads wrong values, not zeros. */
static int pollute_blocks(eng_backend *b, const eng_model *m, float *logits, char *msg,
                          size_t msg_len)
{
    enum { JUNK = 128 };
    int32_t junk[JUNK];
    for (int i = 0; i < JUNK; i++)
        junk[i] = (int32_t)((i * 37 + 11) % m->cfg.vocab_size);
    eng_seq_kv j = {0};
    int rc = eng_kv_reserve(eng_backend_kv(b), &j, JUNK);
    eng_step_seq s = {.kv = &j, .tokens = junk, .n_tokens = JUNK, .pos = 0};
    if (rc == QL_OK)
        rc = eng_backend_forward(b, &s, 1, logits, NULL, msg, msg_len);
    eng_kv_release(eng_backend_kv(b), &j);
    return rc;
}

/* One side's run of the fork scenario: a source prefills the prompt, two
 * forks share its blocks, the three decode their own tokens with the
 * copies on write made by eng_backend_copy_blocks (or, skip_copies, left
 * undone: what the check must be able to see); out gets every decode
 * step's logits, [3][FORK_STEPS][vocab]. */
static int fork_run(eng_backend *b, const eng_model *m, int32_t (*tok)[FORK_TOTAL], float *out,
                    int32_t *copied, bool skip_copies, char *msg, size_t msg_len)
{
    int32_t V = m->cfg.vocab_size;
    eng_kv_cache *kv = eng_backend_kv(b);
    eng_seq_kv seq[3] = {{0}, {0}, {0}};
    float *logits = malloc((size_t)3 * (size_t)V * sizeof(float));
    int rc = pollute_blocks(b, m, logits, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_kv_reserve(kv, &seq[0], FORK_TOTAL);
    eng_step_seq s = {.kv = &seq[0], .tokens = tok[0], .n_tokens = FORK_PROMPT, .pos = 0};
    if (rc == QL_OK)
        rc = eng_backend_forward(b, &s, 1, logits, NULL, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_kv_hold(kv, &seq[0], 2 * eng_kv_fork_blocks(kv, FORK_PROMPT, FORK_TOTAL) + 1);
    for (int f = 1; f < 3 && rc == QL_OK; f++)
        rc = eng_kv_fork(kv, &seq[f], &seq[0], FORK_TOTAL);
    if (rc == QL_OK) {
        /* a write into the shared block without its copy is refused */
        eng_step_seq bad = {
            .kv = &seq[1], .tokens = tok[1] + FORK_PROMPT, .n_tokens = 1, .pos = FORK_PROMPT};
        char why[256] = "";
        int refused = eng_backend_forward(b, &bad, 1, logits, NULL, why, sizeof why);
        if (refused != QL_EINVAL || !strstr(why, "shared"))
            rc = ql_fail(msg, msg_len, QL_EINVAL,
                         "a write into a shared block was not refused: %d \"%s\"", refused, why);
    }
    *copied = 0;
    for (int d = 0; d < FORK_STEPS && rc == QL_OK; d++) {
        eng_kv_copy copies[8];
        int32_t n_copies = 0;
        eng_step_seq step[3];
        for (int f = 0; f < 3 && rc == QL_OK; f++) {
            rc = eng_kv_prepare_write(kv, &seq[f], FORK_PROMPT + d, 1, copies, 8, &n_copies);
            step[f] = (eng_step_seq){.kv = &seq[f],
                                     .tokens = tok[f] + FORK_PROMPT + d,
                                     .n_tokens = 1,
                                     .pos = FORK_PROMPT + d};
        }
        if (rc == QL_OK && !skip_copies)
            rc = eng_backend_copy_blocks(b, copies, n_copies, msg, msg_len);
        *copied += n_copies;
        if (rc == QL_OK)
            rc = eng_backend_forward(b, step, 3, logits, NULL, msg, msg_len);
        for (int f = 0; f < 3 && rc == QL_OK; f++)
            memcpy(out + ((size_t)f * FORK_STEPS + (size_t)d) * (size_t)V, logits + (size_t)f * V,
                   (size_t)V * sizeof(float));
    }
    if (rc != QL_OK && !msg[0])
        ql_fail(msg, msg_len, rc, "KV bookkeeping of the forks: %s", ql_strerror(rc));
    for (int f = 0; f < 3; f++)
        eng_kv_release(kv, &seq[f]);
    free(logits);
    return rc;
}

/* Forks decoding over shared, copied-on-write blocks: the device's logits
 * are the CPU's (each side copies in its own cache). */
static void forks_copy_on_write(void)
{
    const char *name = "forks_with_copy_on_write_match_cpu";
    model_case mc = {"q4_0", {.kind = QT_Q4_0}, ENG_ARCH_LLAMA, false, false, true, 0};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, name, "could not build the model");
        return;
    }
    int32_t V = m.cfg.vocab_size, tok[3][FORK_TOTAL];
    for (int i = 0; i < FORK_TOTAL; i++) {
        tok[0][i] = (int32_t)(uniform() * V);
        for (int f = 1; f < 3; f++)
            tok[f][i] = i < FORK_PROMPT ? tok[0][i] : (int32_t)(uniform() * V);
    }
    /* the CPU, the device, and the CPU without its copies */
    size_t each = (size_t)3 * FORK_STEPS * (size_t)V;
    float *out[3] = {NULL, NULL, NULL};
    int32_t copied[3] = {0, 0, 0};
    char msg[512] = "";
    int rc = QL_OK;
    for (int k = 0; k < 3 && rc == QL_OK; k++) {
        side sd;
        out[k] = malloc(each * sizeof(float));
        rc = side_new(&sd, &m, k == 1 ? ENG_DEVICE_CUDA : ENG_DEVICE_CPU, msg, sizeof msg);
        if (rc == QL_OK)
            rc = fork_run(sd.b, &m, tok, out[k], &copied[k], k == 2, msg, sizeof msg);
        side_free(&sd);
    }
    double worst = 0.0, missed = 0.0;
    for (size_t r = 0; rc == QL_OK && r < (size_t)3 * FORK_STEPS; r++) {
        worst_of(out[1] + r * (size_t)V, out[0] + r * (size_t)V, V, &worst);
        worst_of(out[2] + r * (size_t)V, out[0] + r * (size_t)V, V, &missed);
    }
    if (rc != QL_OK)
        report(false, name, "%s", msg);
    else
        report(worst <= 1e-3 && missed > 1e-2 && copied[0] == 2 && copied[1] == 2, name,
               "worst relative logit difference %.3g (bound 1e-3; undone copies make %.3g, "
               "must be above 1e-2); blocks copied cpu %d cuda %d (2 expected)",
               worst, missed, copied[0], copied[1]);
    if (rc == QL_OK)
        printf("  %s: worst relative logit difference %.3g; with the copies undone %.3g\n", name,
               worst, missed);
    for (int k = 0; k < 3; k++)
        free(out[k]);
    eng_model_free(&m);
}

/*
 * One step of three sequences: A a 40-token prefill asking for every row
 * (more rows than the device's logits buffer holds), B a greedy prefill,
 * C a greedy prefill asking for every row too (so not chosen on the
 * device). Every row is the CPU's within the bound, the last row is the
 * step's row bit for bit, C's token is left to the host.
 */
static void every_row_logits(void)
{
    const char *name = "all_logits_match_cpu";
    model_case mc = {"nf4", {.kind = QT_NF4, .blocksize = 64}, ENG_ARCH_LLAMA, 0, 1, 0, 0};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, name, "could not build the model");
        return;
    }
    enum { NA = 40, NB = 5, NC = 7 };
    int32_t V = m.cfg.vocab_size, ta[NA], tb[NB], tc[NC];
    for (int i = 0; i < NA; i++)
        ta[i] = (int32_t)(uniform() * V);
    for (int i = 0; i < NB; i++)
        tb[i] = (int32_t)(uniform() * V);
    for (int i = 0; i < NC; i++)
        tc[i] = (int32_t)(uniform() * V);
    float *rows[2][2], *logits[2];
    int32_t tokens[2][N_SEQS];
    char msg[512] = "";
    int rc = QL_OK;
    bool last_rows_equal = true;
    for (int k = 0; k < 2; k++) {
        rows[k][0] = malloc((size_t)NA * (size_t)V * sizeof(float));
        rows[k][1] = malloc((size_t)NC * (size_t)V * sizeof(float));
        logits[k] = malloc((size_t)N_SEQS * (size_t)V * sizeof(float));
    }
    for (int k = 0; k < 2 && rc == QL_OK; k++) {
        side sd;
        rc = side_new(&sd, &m, k ? ENG_DEVICE_CUDA : ENG_DEVICE_CPU, msg, sizeof msg);
        eng_step_seq st[N_SEQS] = {
            {.kv = &sd.kv[0], .tokens = ta, .n_tokens = NA, .all_logits = rows[k][0]},
            {.kv = &sd.kv[1], .tokens = tb, .n_tokens = NB, .greedy = true},
            {.kv = &sd.kv[2],
             .tokens = tc,
             .n_tokens = NC,
             .greedy = true,
             .all_logits = rows[k][1]},
        };
        if (rc == QL_OK)
            rc = eng_backend_forward(sd.b, st, N_SEQS, logits[k], tokens[k], msg, sizeof msg);
        for (int j = 0; rc == QL_OK && j < 2; j++) {
            int32_t n = j ? NC : NA, row = j ? 2 : 0;
            last_rows_equal &= memcmp(rows[k][j] + (size_t)(n - 1) * V, logits[k] + (size_t)row * V,
                                      (size_t)V * sizeof(float)) == 0;
        }
        side_free(&sd);
    }
    double worst = 0.0;
    if (rc == QL_OK) {
        worst_of(rows[1][0], rows[0][0], (int64_t)NA * V, &worst);
        worst_of(rows[1][1], rows[0][1], (int64_t)NC * V, &worst);
    }
    float lead = 0.0f;
    int32_t cpu_b = rc == QL_OK ? best_of(logits[0] + V, V, &lead) : -1;
    if (rc != QL_OK)
        report(false, name, "%s", msg);
    else
        report(worst <= 1e-3 && last_rows_equal && tokens[1][2] == -1 && tokens[1][0] == -1 &&
                   (tokens[1][1] == cpu_b || lead <= 1e-3),
               name,
               "worst relative logit difference %.3g (bound 1e-3); last rows equal the step's %d; "
               "device tokens %d %d %d (want -1, %d, -1)",
               worst, last_rows_equal, tokens[1][0], tokens[1][1], tokens[1][2], cpu_b);
    for (int k = 0; k < 2; k++) {
        free(rows[k][0]);
        free(rows[k][1]);
        free(logits[k]);
    }
    eng_model_free(&m);
}

/* --- the checks ---------------------------------------------------------------------- */

static void kinds(void)
{
    const model_case cases[] = {
        {"f32", {.kind = QT_F32}, ENG_ARCH_LLAMA, false, false, false, 0},
        {"bf16", {.kind = QT_BF16}, ENG_ARCH_LLAMA, false, true, false, 0},
        {"nf4", {.kind = QT_NF4, .blocksize = 64}, ENG_ARCH_LLAMA, false, false, false, 0},
        {"nf4-dq",
         {.kind = QT_NF4, .blocksize = 64, .double_quant = true},
         ENG_ARCH_LLAMA,
         false,
         false,
         true,
         0},
        {"fp4", {.kind = QT_FP4, .blocksize = 128}, ENG_ARCH_LLAMA, false, false, false, 0},
        {"int4-g32",
         {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .eps = 1e-6f},
         ENG_ARCH_QWEN2,
         true,
         false,
         false,
         0},
        {"int8",
         {.kind = QT_AFFINE, .bits = 8, .symmetric = true},
         ENG_ARCH_LLAMA,
         false,
         false,
         false,
         0},
        {"q4_0", {.kind = QT_Q4_0}, ENG_ARCH_LLAMA, false, false, true, 0},
        {"q4_1", {.kind = QT_Q4_1}, ENG_ARCH_MISTRAL, false, true, true, 8},
        {"q8_0", {.kind = QT_Q8_0}, ENG_ARCH_LLAMA, false, false, false, 0},
        {"q5_0", {.kind = QT_Q5_0}, ENG_ARCH_LLAMA, false, false, false, 0},
        {"q5_1", {.kind = QT_Q5_1}, ENG_ARCH_QWEN2, true, false, false, 0},
        {"q4_k_m", {.kind = QT_Q4_K}, ENG_ARCH_LLAMA, false, false, true, 0},
        {"q3_k-iq4_nl-iq4_xs", {.kind = QT_Q3_K}, ENG_ARCH_QWEN2, true, false, false, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        eng_model m;
        char name[96];
        snprintf(name, sizeof name, "steps_match_cpu_%s", cases[i].name);
        if (make_model(&m, &cases[i]) != QL_OK) {
            report(false, name, "could not build the model");
            continue;
        }
        scenario(name, &m, NULL, NULL, NULL);
        eng_model_free(&m);
    }
}

/* Qwen3: the per-head q/k norms (weights far from 1, so they show) on
 * the device equal the CPU's. */
static void qwen3_norms(void)
{
    model_case mc = {"qwen3-q8_0", {.kind = QT_Q8_0}, ENG_ARCH_QWEN3, false, false, false, 0};
    eng_model m;
    int rc = make_model(&m, &mc);
    m.cfg.qk_norm = true;
    for (int32_t l = 0; rc == QL_OK && l < m.cfg.n_layers; l++) {
        rc = dense(&m.layers[l].q_norm, 1, m.cfg.head_dim, 0.3f, 1.0f);
        rc = rc ? rc : dense(&m.layers[l].k_norm, 1, m.cfg.head_dim, 0.3f, 1.0f);
    }
    if (rc != QL_OK)
        report(false, "steps_match_cpu_qwen3_qk_norms", "could not build the model");
    else
        scenario("steps_match_cpu_qwen3_qk_norms", &m, NULL, NULL, NULL);
    eng_model_free(&m);
}

/* Gemma 2 and 3 on the device as on the CPU: GeGLU, the sandwich norms,
 * (1 + w) norms, the embedding scale, query_pre_attn_scalar's scale, a
 * sliding window shorter than the scenario's prompts on alternating layers
 * (Gemma 2's soft-capped scores and logits; Gemma 3's per-head q/k norms
 * and the sliding layers' own rotary base, linear scaling on the full
 * one). The model's fields are set here; model_case stays as it is. */
static void gemma_layout(bool gemma3)
{
    model_case mc = {gemma3 ? "gemma3-q8_0" : "gemma2-q8_0",
                     {.kind = QT_Q8_0},
                     gemma3 ? ENG_ARCH_GEMMA3 : ENG_ARCH_GEMMA2,
                     false,
                     true,
                     false,
                     0};
    eng_model m;
    int rc = make_model(&m, &mc);
    eng_config *c = &m.cfg;
    c->sandwich_norms = true;
    c->ffn_act = ENG_FFN_GELU_TANH;
    c->norm_offset = 1.0f;
    c->embed_scale = sqrtf((float)c->hidden_size);
    c->attn_scale = 1.0f / sqrtf(24.0f);
    c->sliding_window = 7;
    c->sliding_pattern = 2; /* layers 0 and 2 slide */
    c->qk_norm = gemma3;
    if (gemma3) {
        c->rope_local_theta = 100.0f;
        c->rope_scaling = ENG_ROPE_LINEAR;
        c->rope_factor = 2.0f;
    } else {
        c->attn_softcap = 3.0f;
        c->final_softcap = 5.0f;
    }
    for (int32_t l = 0; rc == QL_OK && l < c->n_layers; l++) {
        eng_layer *L = &m.layers[l];
        /* norms stored as w, used as 1 + w: far from 0 on both sides */
        qt_free(&L->attn_norm);
        qt_free(&L->ffn_norm);
        rc = dense(&L->attn_norm, 1, c->hidden_size, 0.3f, 0.0f);
        rc = rc ? rc : dense(&L->ffn_norm, 1, c->hidden_size, 0.3f, 0.0f);
        rc = rc ? rc : dense(&L->post_attn_norm, 1, c->hidden_size, 0.3f, 0.0f);
        rc = rc ? rc : dense(&L->post_ffn_norm, 1, c->hidden_size, 0.3f, 0.0f);
        if (gemma3) {
            rc = rc ? rc : dense(&L->q_norm, 1, c->head_dim, 0.3f, 0.0f);
            rc = rc ? rc : dense(&L->k_norm, 1, c->head_dim, 0.3f, 0.0f);
        }
    }
    const char *name = gemma3 ? "steps_match_cpu_gemma3_layout" : "steps_match_cpu_gemma2_layout";
    if (rc != QL_OK)
        report(false, name, "could not build the model");
    else
        scenario(name, &m, NULL, NULL, NULL);
    eng_model_free(&m);
}

/* A Llama 3.x GGUF's rope_freqs.weight (llama.cpp's per-pair frequency
 * factors, in eng_config): the device rotates with the CPU's divided
 * frequencies, over positions up to 54. */
static void rope_freq_factors(void)
{
    model_case mc = {"q8_0", {.kind = QT_Q8_0}, ENG_ARCH_LLAMA, false, false, true, 0};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, "steps_match_cpu_rope_freq_factors", "could not build the model");
        return;
    }
    m.cfg.n_rope_freq_factors = m.cfg.head_dim / 2;
    for (int32_t i = 0; i < m.cfg.n_rope_freq_factors; i++)
        m.cfg.rope_freq_factors[i] = i % 3 == 0 ? 1.0f : 0.5f + 0.75f * (float)i;
    scenario("steps_match_cpu_rope_freq_factors", &m, NULL, NULL, NULL);
    eng_model_free(&m);
}

/* Phi-3's longrope (a short and a long factor set, cos and sin times the
 * attention factor) with a sliding window of 8, on a random model: the
 * device's rotation tables are the CPU's, for the scenario's sequence B
 * on the long set (both_step) beside A and C on the short one. */
static void phi3_longrope(void)
{
    model_case mc = {"phi3-q8_0", {.kind = QT_Q8_0}, ENG_ARCH_PHI3, false, false, false, 8};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, "steps_match_cpu_phi3_longrope", "could not build the model");
        return;
    }
    m.cfg.rope_scaling = ENG_ROPE_LONGROPE;
    m.cfg.rope_original_max_position = 16;
    m.cfg.rope_attn_factor = 1.2247449f; /* sqrt(1 + ln 4 / ln 16) */
    m.cfg.n_rope_freq_factors = m.cfg.head_dim / 2;
    for (int32_t i = 0; i < m.cfg.n_rope_freq_factors; i++) {
        m.cfg.rope_freq_factors[i] = 1.0f + 0.05f * (float)i;
        m.cfg.rope_long_freq_factors[i] = 1.0f + 0.4f * (float)i;
    }
    scenario("steps_match_cpu_phi3_longrope", &m, NULL, NULL, NULL);
    eng_model_free(&m);
}

/* The model file and the PEFT adapter folder under tests/fixtures into *m
 * and *lora; false (a FAIL line named name, nothing held) when either does
 * not load. */
static bool load_fixture_with_adapter(const char *name, const char *model, const char *adapter,
                                      eng_model *m, eng_lora **lora)
{
    char path[512], msg[512];
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, model);
    eng_load_opts lo = {.path = path};
    if (eng_model_load(m, &lo, msg, sizeof msg) != QL_OK) {
        report(false, name, "%s", msg);
        return false;
    }
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, adapter);
    *lora = NULL;
    if (lora_load(lora, NULL, path, adapter, m, msg, sizeof msg) != QL_OK) {
        report(false, name, "%s", msg);
        eng_model_free(m);
        return false;
    }
    return true;
}

/* The scenario with lora unmerged for A (scale 1) and B (0.5), none for C. */
static void scenario_unmerged(const char *name, const eng_model *m, eng_lora *lora)
{
    eng_lora_term a[1] = {{lora, 1.0f}}, b[1] = {{lora, 0.5f}};
    const eng_lora_term *delta[N_SEQS] = {a, b, NULL};
    int32_t n_delta[N_SEQS] = {1, 1, 0};
    scenario(name, m, NULL, delta, n_delta);
}

/* The tiny Phi-3 as llama.cpp's converter wrote it in q8_0
 * (tests/fixtures/phi3_tiny_q8_0.gguf: its q/k/v and gate/up are views
 * into the fused tensors of the mapping), with its PEFT adapter on the
 * fused modules unmerged for A and B: the device steps as the CPU. */
static void phi3_gguf(void)
{
    const char *name = "steps_match_cpu_phi3_gguf_with_fused_adapter";
    eng_model m;
    eng_lora *lora;
    if (!load_fixture_with_adapter(name, "phi3_tiny_q8_0.gguf", "phi3_lora", &m, &lora))
        return;
    scenario_unmerged(name, &m, lora);
    eng_lora_unref(lora);
    eng_model_free(&m);
}

/* --- mixtures of experts ---------------------------------------------------------- */

static void merge_round_trip(const eng_model *m, eng_weights *w, const char *kind);

/* A tiny MoE fixture (tests/fixtures/<file>: llama.cpp's conversions of
 * the tiny Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral; the tiny
 * GPT-OSS with its attention sinks, output bias, biased router and
 * experts, clamped SwiGLU and YaRN, in f32 and with MXFP4 experts) steps on
 * the device as on the CPU: the device routes with the CPU's arithmetic
 * from its own router logits, so the logits agree within the scenario's
 * bound and the greedy tokens are equal. The step's figures (experts run,
 * bytes read) are the CPU's for the same step. */
/* tests/fixtures/<file> into *m, or false with a failure reported under
 * name. */
static bool load_fixture(const char *file, const char *name, eng_model *m)
{
    char path[512], msg[512];
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, file);
    eng_load_opts lo = {.path = path};
    if (eng_model_load(m, &lo, msg, sizeof msg) == QL_OK)
        return true;
    report(false, name, "%s", msg);
    return false;
}

/* The 2025 families' converter GGUFs on the device as on the CPU: SmolLM3's
 * NoPE layers, OLMo 3's layers without input norms, whole-projection q/k
 * norms and sliding layers with their own rotation beside YaRN'd full
 * ones, Ministral 3's query temperature (its period of 4 positions is
 * crossed again and again by the scenario's 40); Gemma 4's folders (no
 * GGUF exists): its weightless v norm, layer_scalar and proportional
 * rotation, and layers that attend over an earlier layer's cache. */
static void family_fixture(const char *file)
{
    char name[128];
    snprintf(name, sizeof name, "steps_match_cpu_%s", file);
    eng_model m;
    if (!load_fixture(file, name, &m))
        return;
    scenario(name, &m, NULL, NULL, NULL);
    eng_model_free(&m);
}

/* A fixture folder (config.json and model.safetensors, as transformers
 * saved them) beside a two-token byte-level tokenizer.json, in a scratch
 * folder (gpu_fixture_folder), through family_fixture's scenario (the
 * steps feed ids). */
static void family_folder(const char *folder)
{
    char name[128], msg[512];
    eng_model m;
    snprintf(name, sizeof name, "steps_match_cpu_%s", folder);
    if (gpu_fixture_load(&m, folder, msg, sizeof msg) == QL_OK) {
        scenario(name, &m, NULL, NULL, NULL);
        eng_model_free(&m);
    } else {
        report(false, name, "%s", msg);
    }
}

static void moe_fixture(const char *file)
{
    char name[128], msg[512];
    snprintf(name, sizeof name, "steps_match_cpu_moe_%s", file);
    eng_model m;
    if (!load_fixture(file, name, &m))
        return;
    scenario(name, &m, NULL, NULL, NULL);
    /* one prompt of 9 tokens on each backend: the same figures */
    side cpu, gpu;
    int rc = side_new(&cpu, &m, ENG_DEVICE_CPU, msg, sizeof msg);
    if (rc == QL_OK)
        rc = side_new(&gpu, &m, ENG_DEVICE_CUDA, msg, sizeof msg);
    uint64_t ran[2] = {0}, bytes[2] = {0};
    int32_t prompt[9];
    for (int i = 0; i < 9; i++)
        prompt[i] = (int32_t)(uniform() * m.cfg.vocab_size);
    side *sides[2] = {&cpu, &gpu};
    for (int k = 0; rc == QL_OK && k < 2; k++) {
        eng_step_seq one = {.kv = &sides[k]->kv[0], .tokens = prompt, .n_tokens = 9, .pos = 0};
        rc = eng_backend_forward(sides[k]->b, &one, 1, sides[k]->logits, NULL, msg, sizeof msg);
        eng_backend_moe_step(sides[k]->b, &ran[k], &bytes[k]);
    }
    snprintf(name, sizeof name, "moe_step_figures_equal_cpu_%s", file);
    if (rc == QL_OK)
        report(ran[0] == ran[1] && bytes[0] == bytes[1] && ran[1] > 0, name,
               "cpu: %llu experts, %llu bytes; cuda: %llu experts, %llu bytes",
               (unsigned long long)ran[0], (unsigned long long)bytes[0], (unsigned long long)ran[1],
               (unsigned long long)bytes[1]);
    else
        report(false, name, "%s", msg);
    side_free(&cpu);
    side_free(&gpu);
    eng_model_free(&m);
}

/* The tiny Qwen3-MoE (llama.cpp's f32 conversion) with every expert
 * requantized to MXFP4 (GPT-OSS's expert kind; hidden 64 and expert width
 * 32 are whole blocks): the device's MXFP4 products over gathered rows
 * step as the CPU's. */
static void moe_mxfp4_experts(void)
{
    const char *name = "steps_match_cpu_moe_mxfp4_experts";
    eng_model m;
    char msg[512];
    eng_load_opts lo = {.path = QL_FIXTURES "/qwen3moe_tiny.gguf"};
    int rc = eng_model_load(&m, &lo, msg, sizeof msg);
    if (rc != QL_OK) {
        report(false, name, "%s", msg);
        return;
    }
    qt_quant_params p = {.kind = QT_MXFP4};
    for (int32_t l = 0; rc == QL_OK && l < m.cfg.n_layers; l++)
        for (int32_t i = 0; rc == QL_OK && m.layers[l].experts && i < 3 * m.cfg.n_experts; i++) {
            qtensor *t = &m.layers[l].experts[i], q;
            float *v = malloc((size_t)(t->rows * t->cols) * sizeof(float));
            qt_dequantize_rows(t, 0, t->rows, v);
            rc = qt_quantize(&q, v, t->rows, t->cols, &p, msg, sizeof msg);
            free(v);
            if (rc == QL_OK) {
                qt_free(t);
                *t = q;
            }
        }
    if (rc == QL_OK)
        scenario(name, &m, NULL, NULL, NULL);
    else
        report(false, name, "quantizing the experts to mxfp4: %s", msg);
    eng_model_free(&m);
}

/* PEFT's adapter on the tiny Qwen3-MoE's attention and fused experts
 * (tests/fixtures/peft/qwen3moe_experts) on llama.cpp's f32 conversion:
 * unmerged (A at 1, B at 0.5, C none) the device steps as the CPU; merged
 * on the device it serves the CPU merge's bytes (digests equal), steps as
 * the CPU, and serves the pristine bytes after the unmerge. Mixtral's
 * per-expert adapter (target_modules naming experts.N.w1 ...) unmerged. */
static void moe_adapters(void)
{
    const char *name = "unmerged_expert_adapter_matches_cpu_qwen3moe";
    eng_model m;
    eng_lora *lora;
    if (load_fixture_with_adapter(name, "qwen3moe_tiny.gguf", "peft/qwen3moe_experts", &m, &lora)) {
        scenario_unmerged(name, &m, lora);
        merge_round_trip(&m, merged_version(&m, lora, 1.0f, QT_KIND_COUNT),
                         "expert-adapter-qwen3moe");
        eng_lora_unref(lora);
        eng_model_free(&m);
    }
    name = "unmerged_expert_adapter_matches_cpu_mixtral";
    if (load_fixture_with_adapter(name, "mixtral_tiny.gguf", "peft/mixtral_experts", &m, &lora)) {
        scenario_unmerged(name, &m, lora);
        eng_lora_unref(lora);
        eng_model_free(&m);
    }
    /* GPT-OSS's adapter on its transposed, interleaved experts (PEFT's
     * target_parameters), around the experts' biases */
    name = "unmerged_expert_adapter_matches_cpu_gptoss";
    if (load_fixture_with_adapter(name, "gptoss_tiny.gguf", "peft/gptoss_experts", &m, &lora)) {
        scenario_unmerged(name, &m, lora);
        eng_lora_unref(lora);
        eng_model_free(&m);
    }
}

/* Unmerged adapters: A applies one at scale 1, B the other at 0.5 then the
 * first at -0.25 (two terms), C none. */
static void unmerged(void)
{
    model_case mc = {"nf4", {.kind = QT_NF4, .blocksize = 64}, ENG_ARCH_LLAMA, 0, 0, 0, 0};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, "unmerged_adapters_match_cpu", "could not build the model");
        return;
    }
    eng_lora *one = make_lora(&m, "one", 8, QT_BF16), *two = make_lora(&m, "two", 16, QT_F32);
    eng_lora_term a[1] = {{one, 1.0f}}, b[2] = {{two, 0.5f}, {one, -0.25f}};
    const eng_lora_term *delta[N_SEQS] = {a, b, NULL};
    int32_t n_delta[N_SEQS] = {1, 2, 0};
    scenario("unmerged_adapters_match_cpu", &m, NULL, delta, n_delta);
    eng_lora_unref(one);
    eng_lora_unref(two);
    eng_model_free(&m);
}

/* Unmerged adapters (SGMV) over a Q4_K_M model: one sequence with two
 * terms, one with one, one with none. */
static void unmerged_kquant(void)
{
    model_case mc = {"q4_k_m", {.kind = QT_Q4_K}, ENG_ARCH_LLAMA, 0, 0, 0, 0};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, "unmerged_adapters_match_cpu_q4_k_m", "could not build the model");
        return;
    }
    eng_lora *one = make_lora(&m, "one", 8, QT_BF16), *two = make_lora(&m, "two", 16, QT_F32);
    eng_lora_term a[2] = {{one, 1.0f}, {two, -0.5f}}, b[1] = {{two, 0.5f}};
    const eng_lora_term *delta[N_SEQS] = {a, NULL, b};
    int32_t n_delta[N_SEQS] = {2, 0, 1};
    scenario("unmerged_adapters_match_cpu_q4_k_m", &m, NULL, delta, n_delta);
    eng_lora_unref(one);
    eng_lora_unref(two);
    eng_model_free(&m);
}

/* Version w (the CPU merge; NULL: it failed), which this takes over, on
 * the device: the device's digests of the pristine and the merged weights
 * are the host's, the merged version steps as on the CPU, and after the
 * unmerge (the version's last reference dropped, a step to prune it) the
 * device serves the pristine bytes again. kind names the checks. */
static void merge_round_trip(const eng_model *m, eng_weights *w, const char *kind)
{
    char name[96], msg[512];
    side gpu;
    int rc = w ? side_new(&gpu, m, ENG_DEVICE_CUDA, msg, sizeof msg)
               : ql_fail(msg, sizeof msg, QL_EINVAL, "the CPU merge failed");
    uint64_t pristine = eng_weights_digest(m, NULL), dev_before = 0, dev_merged = 0, dev_after = 0;
    if (rc == QL_OK)
        rc = eng_backend_digest(gpu.b, NULL, &dev_before, msg, sizeof msg);
    if (rc == QL_OK)
        rc = eng_backend_digest(gpu.b, w, &dev_merged, msg, sizeof msg);
    snprintf(name, sizeof name, "device_merge_bytes_equal_cpu_merge_%s", kind);
    if (rc == QL_OK)
        report(dev_before == pristine && dev_merged == eng_weights_digest(m, w), name,
               "device digests pristine %016llx merged %016llx; host %016llx / %016llx",
               (unsigned long long)dev_before, (unsigned long long)dev_merged,
               (unsigned long long)pristine, (unsigned long long)eng_weights_digest(m, w));
    else
        report(false, name, "%s", msg);
    if (rc == QL_OK) {
        snprintf(name, sizeof name, "merged_version_steps_match_cpu_%s", kind);
        scenario(name, m, w, NULL, NULL);
        /* unmerge: the version goes; a step lets the backend drop its copy */
        eng_weights_unref(w);
        w = NULL;
        int32_t tok = 1;
        eng_step_seq one = {.kv = &gpu.kv[0], .tokens = &tok, .n_tokens = 1, .pos = 0};
        rc = eng_backend_forward(gpu.b, &one, 1, gpu.logits, NULL, msg, sizeof msg);
        if (rc == QL_OK)
            rc = eng_backend_digest(gpu.b, NULL, &dev_after, msg, sizeof msg);
        snprintf(name, sizeof name, "device_unmerge_restores_pristine_bytes_%s", kind);
        report(rc == QL_OK && dev_after == pristine, name, "digest %016llx, pristine %016llx%s%s",
               (unsigned long long)dev_after, (unsigned long long)pristine, rc == QL_OK ? "" : ": ",
               rc == QL_OK ? "" : msg);
        side_free(&gpu);
    }
    if (w)
        eng_weights_unref(w);
}

/* Merge on the device: the bytes of the CPU merge, the same steps, and the
 * pristine bytes back after the unmerge. `into` as merged_version's: a
 * merge stored into int8 (QT_AFFINE) or bf16 is the host's copy, served as
 * it is (the k-quants' only merge). */
static void merged(qt_quant_params params, const char *kind, qt_kind into)
{
    model_case mc = {kind, params, ENG_ARCH_LLAMA, false, false, false, 0};
    eng_model m;
    if (make_model(&m, &mc) != QL_OK) {
        report(false, kind, "could not build the model");
        return;
    }
    eng_lora *lora = make_lora(&m, "merged", 16, QT_BF16);
    merge_round_trip(&m, merged_version(&m, lora, 0.75f, into), kind);
    eng_lora_unref(lora);
    eng_model_free(&m);
}

/* The registry on a CUDA engine merges on the device only (no host copy):
 * its report and digest equal those of the same merge on a CPU engine, and
 * the unmerge serves the pristine bytes again. */
static void registry_merges_on_device(void)
{
    const char *name = "registry_merge_on_device_equals_cpu";
    model_case mc = {"nf4-dq",
                     {.kind = QT_NF4, .blocksize = 64, .double_quant = true},
                     ENG_ARCH_LLAMA,
                     false,
                     false,
                     false,
                     0};
    eng_model m;
    char msg[512], dir[] = "/tmp/qlserve-gpu-adapter-XXXXXX";
    if (make_model(&m, &mc) != QL_OK || !mkdtemp(dir) ||
        peft_write_random(&m, dir, 16, 32.0f, 0.02, 11, msg, sizeof msg) != QL_OK) {
        report(false, name, "could not build the model or write the adapter");
        eng_model_free(&m);
        return;
    }
    lora_report rep[2][2];
    memset(rep, 0, sizeof rep);
    bool on_device[2] = {false, false};
    int rc = QL_OK;
    for (int k = 0; k < 2 && rc == QL_OK; k++) {
        eng_engine_opts eo = {.device = k ? ENG_DEVICE_CUDA : ENG_DEVICE_CPU,
                              .kv_bytes = (size_t)8 << 20};
        eng_engine *e = NULL;
        lora_registry *reg = NULL;
        lora_registry_opts ro = {.threads = 2};
        lora_merge_opts mo = {.safe_merge = true, .into = QT_KIND_COUNT};
        lora_meta meta;
        rc = eng_engine_start(&e, &m, &eo, msg, sizeof msg);
        if (rc == QL_OK)
            rc = lora_registry_new(&reg, e, &m, &ro, msg, sizeof msg);
        if (rc == QL_OK)
            rc = lora_registry_load(reg, "a", dir, 1.0f, &meta, msg, sizeof msg);
        if (rc == QL_OK) {
            on_device[k] = eng_engine_merges_on_device(e);
            rc = lora_registry_merge(reg, "a", 0.75f, &mo, &rep[k][0], msg, sizeof msg);
        }
        if (rc == QL_OK)
            rc = lora_registry_unmerge(reg, "a", &rep[k][1], msg, sizeof msg);
        lora_registry_free(reg);
        if (e)
            eng_engine_stop(e);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        printf("  could not remove %s\n", dir);
    if (rc != QL_OK) {
        report(false, name, "%s", msg);
    } else {
        double a = rep[0][0].overall.delta_retained, b = rep[1][0].overall.delta_retained;
        uint64_t pristine = eng_weights_digest(&m, NULL);
        report(!on_device[0] && on_device[1] && rep[0][0].digest == rep[1][0].digest &&
                   fabs(a - b) <= 1e-9 * fabs(a) && rep[1][1].digest == pristine &&
                   rep[0][0].n_modules == rep[1][0].n_modules,
               name,
               "on device %d/%d; merged digest cpu %016llx cuda %016llx; delta_retained cpu "
               "%.12g cuda %.12g; unmerged digest cuda %016llx, pristine %016llx; modules %zu/%zu",
               on_device[0], on_device[1], (unsigned long long)rep[0][0].digest,
               (unsigned long long)rep[1][0].digest, a, b, (unsigned long long)rep[1][1].digest,
               (unsigned long long)pristine, rep[0][0].n_modules, rep[1][0].n_modules);
        printf("  merge seconds: cpu %.3f, cuda %.3f\n", rep[0][0].seconds, rep[1][0].seconds);
    }
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 2; i++)
            lora_report_free(&rep[k][i]);
    eng_model_free(&m);
}

/* The draw kernel against sample_math.h's one-thread draw (what the CPU
 * sampler computes), token for token, greedy rows left to argmax. */
static void device_draws(void)
{
    const char *name = "device_draw_equals_the_cpu_sampler";
    enum { ROWS = 12, VOCAB = 49157 };
    float *logits = malloc((size_t)ROWS * VOCAB * sizeof(float)), inv_t[ROWS];
    double u[ROWS], sums[VOCAB / QM_SAMPLE_BLOCK + 1];
    int32_t want[ROWS], got[ROWS];
    for (int r = 0; r < ROWS; r++) {
        float *row = logits + (size_t)r * VOCAB;
        fill(row, VOCAB, 3.0f);
        if (r == 1)
            for (int i = 0; i < VOCAB; i += 7)
                row[i] = i % 2 ? NAN : -INFINITY;
        if (r == 2)
            row[5] = row[VOCAB - 1] = INFINITY;
        if (r == 3)
            for (int i = 0; i < VOCAB; i++)
                row[i] = i == 0 ? -0.0f : 0.0f;
        if (r == 4)
            for (int i = 0; i < VOCAB; i++)
                row[i] = NAN;
        inv_t[r] = r == 5 ? 0.0f : 1.0f / (0.1f + 0.2f * (float)r);
        u[r] = uniform();
        want[r] = r == 5 ? -7 : qm_sample_token(row, VOCAB, inv_t[r], u[r], sums);
    }
    float *d_logits = NULL, *d_inv = NULL;
    double *d_u = NULL;
    int32_t *d_tok = NULL;
    char msg[256] = "";
    bool ok = cudaMalloc((void **)&d_logits, sizeof(float) * ROWS * VOCAB) == cudaSuccess &&
              cudaMalloc((void **)&d_inv, sizeof inv_t) == cudaSuccess &&
              cudaMalloc((void **)&d_u, sizeof u) == cudaSuccess &&
              cudaMalloc((void **)&d_tok, sizeof got) == cudaSuccess;
    int32_t sentinel[ROWS];
    for (int r = 0; r < ROWS; r++)
        sentinel[r] = -7;
    ok = ok &&
         cudaMemcpy(d_logits, logits, sizeof(float) * ROWS * VOCAB, cudaMemcpyHostToDevice) ==
             cudaSuccess &&
         cudaMemcpy(d_inv, inv_t, sizeof inv_t, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(d_u, u, sizeof u, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(d_tok, sentinel, sizeof sentinel, cudaMemcpyHostToDevice) == cudaSuccess;
    int rc = ok ? qt_cuda_sample(d_logits, ROWS, VOCAB, d_inv, d_u, d_tok, NULL, msg, sizeof msg)
                : QL_EDEVICE;
    ok = rc == QL_OK && cudaMemcpy(got, d_tok, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess;
    int bad = -1;
    for (int r = 0; ok && r < ROWS && bad < 0; r++)
        if (got[r] != want[r])
            bad = r;
    report(ok && bad < 0, name, "%s; first row that differs %d: device %d, cpu %d", msg, bad,
           bad >= 0 ? got[bad] : 0, bad >= 0 ? want[bad] : 0);
    cudaFree(d_logits);
    cudaFree(d_inv);
    cudaFree(d_u);
    cudaFree(d_tok);
    free(logits);
}

/* Out of device memory at creation: a clear error, no crash, nothing kept. */
static void out_of_memory(void)
{
    model_case mc = {"q4_1", {.kind = QT_Q4_1}, ENG_ARCH_LLAMA, 0, 0, 0, 0};
    eng_model m;
    char msg[512] = "";
    if (make_model(&m, &mc) != QL_OK) {
        report(false, "out_of_device_memory_is_an_error", "could not build the model");
        return;
    }
    eng_backend_opts o = {.device = ENG_DEVICE_CUDA,
                          .max_tokens = 64,
                          .max_seqs = 4,
                          .kv_bytes = (size_t)1 << 50, /* a petabyte of KV cache */
                          .block_tokens = 16};
    eng_backend *b = NULL;
    int rc = eng_backend_new(&b, &m, &o, msg, sizeof msg);
    report(rc == QL_ENOMEM && !b && strstr(msg, "KV") != NULL, "out_of_device_memory_is_an_error",
           "rc %d, message \"%s\"", rc, msg);
    eng_backend_free(b);
    eng_model_free(&m);
}

/* The default model: greedy continuations equal on both backends. */
static void default_model(const char *path)
{
    eng_model m;
    char msg[512];
    eng_load_opts lo = {.path = path};
    if (eng_model_load(&m, &lo, msg, sizeof msg) != QL_OK) {
        report(false, "default_model_greedy_tokens_equal", "%s", msg);
        return;
    }
    const char *prompts[N_SEQS] = {"The capital of France is",
                                   "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci",
                                   "Once upon a time, in a small village by the sea,"};
    enum { NEW = 48 };
    int32_t out[2][N_SEQS][NEW];
    int rc = QL_OK;
    for (int k = 0; k < 2 && rc == QL_OK; k++) {
        side sd;
        rc = side_new(&sd, &m, k ? ENG_DEVICE_CUDA : ENG_DEVICE_CPU, msg, sizeof msg);
        int32_t *ids[N_SEQS] = {0}, pos[N_SEQS], last[N_SEQS];
        size_t n_ids[N_SEQS] = {0};
        for (int s = 0; s < N_SEQS && rc == QL_OK; s++)
            rc = tok_encode(m.tok, prompts[s], strlen(prompts[s]), true, false, &ids[s], &n_ids[s],
                            msg, sizeof msg);
        /* the prompts together, then NEW greedy steps of all three */
        for (int t = 0; t <= NEW && rc == QL_OK; t++) {
            eng_step_seq steps[N_SEQS];
            for (int s = 0; s < N_SEQS; s++) {
                if (t == 0)
                    steps[s] = (eng_step_seq){.kv = &sd.kv[s],
                                              .tokens = ids[s],
                                              .n_tokens = (int32_t)n_ids[s],
                                              .pos = 0,
                                              .greedy = true};
                else
                    steps[s] = (eng_step_seq){.kv = &sd.kv[s],
                                              .tokens = &last[s],
                                              .n_tokens = 1,
                                              .pos = pos[s],
                                              .greedy = true};
            }
            rc = eng_backend_forward(sd.b, steps, N_SEQS, sd.logits, sd.tokens, msg, sizeof msg);
            for (int s = 0; s < N_SEQS && rc == QL_OK && t < NEW; s++) {
                float lead;
                int32_t tok = sd.tokens[s] >= 0 ? sd.tokens[s]
                                                : best_of(sd.logits + (size_t)s * m.cfg.vocab_size,
                                                          m.cfg.vocab_size, &lead);
                pos[s] = t == 0 ? (int32_t)n_ids[s] : pos[s] + 1;
                last[s] = tok;
                out[k][s][t] = tok;
            }
        }
        for (int s = 0; s < N_SEQS; s++)
            free(ids[s]);
        side_free(&sd);
    }
    int first_diff = -1, diff_seq = -1;
    for (int s = 0; s < N_SEQS && rc == QL_OK && first_diff < 0; s++)
        for (int t = 0; t < NEW; t++)
            if (out[0][s][t] != out[1][s][t]) {
                first_diff = t;
                diff_seq = s;
                break;
            }
    if (rc == QL_OK && first_diff < 0) {
        char *text = NULL;
        size_t len = 0;
        if (tok_decode(m.tok, out[1][0], NEW, true, &text, &len, msg, sizeof msg) == QL_OK)
            printf("  default model, cuda: \"%s\" ->%.*s\n", prompts[0], (int)len, text);
        free(text);
    }
    if (rc != QL_OK)
        report(false, "default_model_greedy_tokens_equal", "%s", msg);
    else
        report(first_diff < 0, "default_model_greedy_tokens_equal",
               "prompt %d: first difference at generated token %d", diff_seq, first_diff);
    eng_model_free(&m);
}

/* --- constrained decoding on the device ------------------------------------------ */

typedef struct answer {
    gpu_pending pending; /* first: the engine's user */
    char text[2048];
    size_t len;
    eng_finish why;
} answer;

static void answer_token(void *user, const eng_token_event *ev)
{
    answer *a = user;
    if (a->len + ev->len < sizeof a->text) {
        memcpy(a->text + a->len, ev->text, ev->len);
        a->len += ev->len;
    }
}

static void answer_done(void *user, eng_finish why, const eng_usage *u)
{
    (void)u;
    answer *a = user;
    a->why = why;
    gpu_pending_done(&a->pending);
}

/* n (at most 8) requests under g on an engine of device d, together: answers in a. */
static int constrained_run(const eng_model *m, eng_device d, gr_grammar *g, answer *a, int n,
                           char *msg, size_t msg_len)
{
    eng_engine_opts eo = {.device = d, .kv_bytes = (size_t)64 << 20, .max_running = n};
    eng_engine *e = NULL;
    int rc = eng_engine_start(&e, m, &eo, msg, msg_len);
    static const char prompt[] = "A user record as JSON:";
    eng_request r[8];
    gpu_pending *pending[8];
    for (int i = 0; i < n; i++) {
        a[i] = (answer){0};
        r[i] = (eng_request){.prompt = prompt,
                             .prompt_len = strlen(prompt),
                             .max_new_tokens = 200,
                             .grammar = g,
                             .sampling = {.temperature = i ? 0.8f : 0.0f, .seed = (uint64_t)i},
                             .on_token = answer_token,
                             .on_done = answer_done};
        pending[i] = &a[i].pending;
    }
    if (rc == QL_OK)
        rc = gpu_submit_wait(e, r, pending, n, msg, msg_len);
    if (e)
        eng_engine_stop(e);
    return rc;
}

/* A JSON Schema's answers on the device (one greedy, seven sampled, all
 * together): each is a whole sentence of the grammar, and the greedy one
 * is the CPU engine's (the masked rows come back to the host). */
static void default_model_constrained(const eng_model *m)
{
    const char *name = "default_model_constrained_answers_parse";
    static const char schema[] =
        "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"maxLength\": "
        "30}, \"age\": {\"type\": \"integer\"}, \"tags\": {\"type\": \"array\", \"items\": "
        "{\"enum\": [\"a\", \"b\"]}, \"maxItems\": 3}}, \"required\": [\"name\", \"age\"], "
        "\"additionalProperties\": false}";
    enum { N = 8 };
    char msg[512] = "";
    gr_grammar *g = NULL;
    answer gpu[N], cpu[1];
    int rc = gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg);
    if (rc == QL_OK)
        rc = constrained_run(m, ENG_DEVICE_CUDA, g, gpu, N, msg, sizeof msg);
    if (rc == QL_OK)
        rc = constrained_run(m, ENG_DEVICE_CPU, g, cpu, 1, msg, sizeof msg);
    int bad = -1;
    for (int i = 0; rc == QL_OK && i < N && bad < 0; i++)
        if (gpu[i].why != ENG_FINISH_EOS || !gr_grammar_accepts(g, gpu[i].text, gpu[i].len))
            bad = i;
    bool same = rc == QL_OK && gpu[0].len == cpu[0].len &&
                memcmp(gpu[0].text, cpu[0].text, cpu[0].len) == 0;
    report(rc == QL_OK && bad < 0 && same, name,
           "%s; answer %d is not a whole sentence (%s): '%.*s'; greedy cuda '%.*s' cpu '%.*s'", msg,
           bad, bad >= 0 ? eng_finish_name(gpu[bad].why) : "-", bad >= 0 ? (int)gpu[bad].len : 0,
           bad >= 0 ? gpu[bad].text : "", rc == QL_OK ? (int)gpu[0].len : 0, gpu[0].text,
           rc == QL_OK ? (int)cpu[0].len : 0, cpu[0].text);
    gr_grammar_unref(g);
}

int main(void)
{
    int n = 0;
    char msg[256];
    if (qt_cuda_device_count(&n, msg, sizeof msg) != QL_OK || n < 1) {
        printf("SKIP test_cuda_engine: no CUDA device (%s)\n", msg);
        return 77;
    }
    moe_fixture("qwen3moe_tiny.gguf");
    moe_fixture("qwen2moe_tiny.gguf");
    moe_fixture("mixtral_tiny.gguf");
    moe_fixture("qwen3moe_tiny_q4_k_m.gguf");
    moe_fixture("gptoss_tiny.gguf");
    moe_fixture("gptoss_tiny_mxfp4.gguf");
    family_fixture("smollm3_tiny.gguf");
    family_fixture("olmo3_tiny.gguf");
    family_fixture("ministral3_tiny.gguf");
    family_folder("gemma4_tiny");
    family_folder("gemma4_kv_shared_tiny");
    moe_mxfp4_experts();
    moe_adapters();
    kinds();
    qwen3_norms();
    gemma_layout(false);
    gemma_layout(true);
    rope_freq_factors();
    phi3_longrope();
    phi3_gguf();
    unmerged();
    merged((qt_quant_params){.kind = QT_NF4, .blocksize = 64, .double_quant = true}, "nf4-dq",
           QT_KIND_COUNT);
    merged((qt_quant_params){.kind = QT_Q4_1}, "q4_1", QT_KIND_COUNT);
    merged((qt_quant_params){.kind = QT_AFFINE, .bits = 4, .group_size = 32, .eps = 1e-6f},
           "int4-g32", QT_KIND_COUNT);
    merged((qt_quant_params){.kind = QT_Q5_0}, "q5_0", QT_KIND_COUNT);
    merged((qt_quant_params){.kind = QT_Q4_K}, "q4_k_m-into-int8", QT_AFFINE);
    merged((qt_quant_params){.kind = QT_Q5_K}, "q5_k-into-bf16", QT_BF16);
    unmerged_kquant();
    registry_merges_on_device();
    forks_copy_on_write();
    every_row_logits();
    device_draws();
    out_of_memory();
    const char *path = getenv("QL_DEFAULT_MODEL");
    if (path && *path) {
        default_model(path);
        eng_model dm;
        eng_load_opts lo = {.path = path};
        if (eng_model_load(&dm, &lo, msg, sizeof msg) == QL_OK) {
            default_model_constrained(&dm);
            eng_model_free(&dm);
        } else
            report(false, "default_model_constrained_answers_parse", "%s", msg);
    } else
        printf("SKIP default_model_greedy_tokens_equal: QL_DEFAULT_MODEL is not set\n");
    printf("test_cuda_engine: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

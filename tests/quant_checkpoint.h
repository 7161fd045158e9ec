/*
 * quant_checkpoint.h - what the tests of quantized checkpoint formats
 * (test_fp8.c, test_gptq.c) check the same way: an FNV-1a 64 digest of a
 * dequantized weight, the loaded projection a transformers name is, the
 * logits and greedy ids of a loaded fixture against the float64 forward,
 * every position of a prompt against a float64 pass (qcp_against_pass),
 * a fixture whose config.json is edited and must then be refused, and a
 * PEFT adapter on the fixture, unmerged against the float64 forward and
 * merged against W + delta.
 *
 *   uint64_t h = qcp_fnv1a64(floats, bytes);
 *   const qtensor *w = qcp_projection(&m, "model.layers.1.mlp.up_proj.weight");
 *   qcp_logits_and_greedy(&m, "fp8_tiny_float", &(qcp_reference){...});
 *   qcp_refused(dir, "\"bits\": 4", "\"bits\": 3", "bits must be");
 */
#ifndef QL_QUANT_CHECKPOINT_H
#define QL_QUANT_CHECKPOINT_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "ref_forward.h"
#include "run_prompt.h"
#include "test_util.h"

static inline uint64_t qcp_fnv1a64(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001B3ull;
    }
    return h;
}

/* The loaded projection a transformers name ("model.layers.1.mlp.up_proj.weight") is. */
static inline const qtensor *qcp_projection(const eng_model *m, const char *name)
{
    int layer = -1, used = 0;
    char proj[32] = "";
    cr_assert(sscanf(name, "model.layers.%d.%n", &layer, &used) == 1 && layer >= 0 &&
                  layer < m->cfg.n_layers,
              "%s", name);
    const char *dot = strchr(name + used, '.');
    cr_assert(dot && sscanf(dot + 1, "%31[a-z_]", proj) == 1, "%s", name);
    static const char *names[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                  "gate_proj", "up_proj", "down_proj"};
    for (int p = 0; p < ENG_N_PROJ; p++)
        if (strcmp(proj, names[p]) == 0)
            return eng_model_proj(m, layer, (eng_proj)p);
    cr_assert_fail("%s is no projection", name);
    return NULL;
}

/* A fixture's float64 references: logits at every position of tokens,
 * and the greedy continuation of prompt. */
typedef struct qcp_reference {
    const int *tokens;
    int n_tokens;
    const double *logits; /* n_tokens * vocab */
    int vocab;
    const int *prompt;
    int n_prompt;
    const int *greedy;
    int n_greedy;
} qcp_reference;

/* The loaded model's logits within 1e-5 (worst relative L2 of a row) of
 * the float64 ones, and its greedy ids (each step the whole sequence
 * again, the argmax of its last row) equal to the float64 ones. */
static inline void qcp_logits_and_greedy(eng_model *m, const char *what, const qcp_reference *r)
{
    int32_t *toks = malloc((size_t)(r->n_tokens + r->n_prompt + r->n_greedy) * sizeof *toks);
    for (int i = 0; i < r->n_tokens; i++)
        toks[i] = r->tokens[i];
    float *logits = run_prompt(m, &(prompt_run){.tokens = toks, .n_tokens = r->n_tokens});
    double err = test_worst_row_l2(logits, r->logits, r->n_tokens, r->vocab);
    cr_assert(err <= 1e-5, "%s: worst relative L2 %g vs float64 transformers", what, err);
    free(logits);
    int n = r->n_prompt;
    for (int i = 0; i < n; i++)
        toks[i] = r->prompt[i];
    for (int g = 0; g < r->n_greedy; g++) {
        float *l = run_prompt(m, &(prompt_run){.tokens = toks, .n_tokens = n});
        const float *last = l + (size_t)(n - 1) * (size_t)r->vocab;
        int best = 0;
        for (int v = 1; v < r->vocab; v++)
            best = last[v] > last[best] ? v : best;
        free(l);
        cr_assert_eq(best, r->greedy[g], "%s: greedy step %d: %d, float64 %d", what, g, best,
                     r->greedy[g]);
        toks[n++] = best;
    }
    free(toks);
}

/* The fixture copied into dir with its config.json's `from` replaced by
 * `to`: loading must fail with a message holding `want`. */
static inline void qcp_refused(const char *dir, const char *from, const char *to, const char *want)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len = 0;
    char *text = test_read_file(path, &len);
    char *at = strstr(text, from);
    cr_assert(at, "config.json has no %s", from);
    char *edited = malloc(len + strlen(to) + 1);
    size_t head = (size_t)(at - text);
    memcpy(edited, text, head);
    strcpy(edited + head, to);
    strcat(edited, at + strlen(from));
    test_write_text(path, edited);
    eng_model m;
    eng_load_opts o = {.path = dir};
    cr_assert_neq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s loaded", to);
    cr_assert(strstr(msg, want), "%s: %s", to, msg);
    free(text);
    free(edited);
}

/* A PEFT adapter (lora_fixture.h's default: every projection, r 8) written
 * into dir/adapter for the loaded fixture m and loaded; *R is the float64
 * model with it added. Applied unmerged, m's logits over tokens must be
 * within FWD_REL_TOL of R's forward, and the adapter must move them. The
 * caller releases the adapter (eng_lora_unref) and R (ref_free). */
static inline eng_lora *qcp_unmerged_adapter(eng_model *m, const char *dir, const char *what,
                                             const int *tokens, int n_tokens, int vocab,
                                             ref_model *R)
{
    char adir[600], msg[1024];
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    lora_fix_spec spec = lora_fix_default();
    lora_fix_write(adir, &m->cfg, &spec);
    eng_lora *lora = NULL;
    cr_assert_eq(lora_load(&lora, NULL, adir, "a", m, msg, sizeof msg), 0, "%s", msg);
    ref_load(R, m);
    ref_add_lora(R, lora, 1.0);
    double *ref = malloc((size_t)n_tokens * (size_t)vocab * sizeof *ref);
    int32_t *toks = malloc((size_t)n_tokens * sizeof *toks);
    for (int i = 0; i < n_tokens; i++)
        toks[i] = tokens[i];
    ref_forward(R, toks, n_tokens, ref);
    eng_lora_term term = {lora, 1.0f};
    float *unmerged = run_prompt(
        m, &(prompt_run){.tokens = toks, .n_tokens = n_tokens, .delta = &term, .n_delta = 1});
    float *base = run_prompt(m, &(prompt_run){.tokens = toks, .n_tokens = n_tokens});
    double err = test_worst_row_l2(unmerged, ref, n_tokens, vocab);
    double moved = test_worst_row_l2(base, ref, n_tokens, vocab);
    cr_assert(err <= FWD_REL_TOL, "%s: unmerged adapter off the float64 forward by %g", what, err);
    cr_assert(moved > 100 * FWD_REL_TOL, "%s: the adapter moves the logits by %g only", what,
              moved);
    free(unmerged);
    free(base);
    free(toks);
    free(ref);
    return lora;
}

/* Every position of tokens on version w (NULL: the model's; terms
 * unmerged), the first `prefill` in one step and the rest one at a time,
 * against the float64 pass R, each row within FWD_REL_TOL. */
static inline void qcp_against_pass(const eng_model *m, const ref_model *R, const eng_weights *w,
                                    const eng_lora_term *terms, int n_terms, const int32_t *tokens,
                                    int n, int prefill, const char *label)
{
    size_t V = (size_t)m->cfg.vocab_size;
    double *want = malloc((size_t)n * V * sizeof *want);
    cr_assert(want);
    ref_forward(R, tokens, n, want);
    prompt_run r = {.tokens = tokens,
                    .n_tokens = n,
                    .prefill = prefill,
                    .weights = w,
                    .delta = terms,
                    .n_delta = n_terms};
    float *all = run_prompt(m, &r);
    for (int t = 0; t < n; t++)
        assert_logits_close(all + (size_t)t * V, want + (size_t)t * V, (int64_t)V, label, "logits",
                            t);
    free(all);
    free(want);
}

/* Each merged projection of v (all of kind) against the exact W + delta
 * of R: the worst, over projections, of |merged - (W + delta)| / |delta|
 * (the L2 norms). */
static inline double qcp_merged_error(const eng_weights *v, const eng_model *m, const ref_model *R,
                                      qt_kind kind)
{
    double worst = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const qtensor *q = eng_weights_proj(v, l, (eng_proj)p);
            cr_assert_eq(q->kind, kind, "%s", qt_kind_name(q->kind));
            size_t n = (size_t)(q->rows * q->cols);
            float *got = malloc(n * sizeof *got);
            qt_dequantize_rows(q, 0, q->rows, got);
            const float *pw = ref_proj(&R->layers[l], (eng_proj)p);
            const double *delta = R->layers[l].delta[p];
            test_diff merged = {0}, dropped = {0};
            for (size_t i = 0; i < n; i++) {
                test_diff_add(&merged, got[i], (double)pw[i] + delta[i]);
                test_diff_add(&dropped, pw[i], (double)pw[i] + delta[i]);
            }
            double ratio = test_diff_abs(&merged) / test_diff_abs(&dropped);
            worst = ratio <= worst ? worst : ratio; /* NaN is kept */
            free(got);
        }
    }
    return worst;
}

#endif

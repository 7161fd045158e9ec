/*
 * run_prompt.h - every position's logits of a prompt through the CPU
 * forward pass (eng_forward), the one way the tests that compare a model's
 * logits with a reference run a model: a fresh pool, KV cache and forward
 * state per call, the prompt's first `prefill` tokens in one step and the
 * rest one a step (so a test can see the prefill path, the decode path, or
 * both), on a weight version and with unmerged adapters when asked.
 *
 *   prompt_run r = {.tokens = ids, .n_tokens = n};          one prefill
 *   float *all = run_prompt(&m, &r);                         [n][vocab], freed by the caller
 *   r.prefill = 1;                                           one token a step
 *   r.reserve = 64;                                          reserve more (longrope's set)
 *   r.kv_dtype = QT_Q8_0;                                    the cache in q8_0
 *
 * The comparison is test_util.h's (test_max_abs_err, test_diff).
 */
#ifndef QL_RUN_PROMPT_H
#define QL_RUN_PROMPT_H

#include <criterion/criterion.h>
#include <stdlib.h>

#include "model.h"
#include "runtime.h"

typedef struct prompt_run {
    const int32_t *tokens; /* borrowed for the call */
    int n_tokens;
    int prefill;                /* tokens in the first step, the rest one a step; 0: all in one */
    int32_t block_tokens;       /* the KV cache's block size; 0: 16 */
    const eng_weights *weights; /* the version to run (NULL: the model's own weights) */
    const eng_lora_term *delta; /* adapters applied unmerged (n_delta of them; borrowed) */
    int32_t n_delta;
    /* KV positions the sequence reserves (0: n_tokens); longrope's factor
     * set follows it as the engine's admission chooses (eng_rope_long_for) */
    int32_t reserve;
    qt_kind kv_dtype; /* what the KV cache stores (0: QT_F32) */
} prompt_run;

/* Every position's logits of r's tokens through m, [n_tokens][vocab]
 * (malloc'd; the caller frees). Asserts that every step runs. */
static inline float *run_prompt(const eng_model *m, const prompt_run *r)
{
    char msg[1024];
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    const int n = r->n_tokens, prefill = r->prefill > 0 && r->prefill < n ? r->prefill : n;
    const size_t vocab = (size_t)m->cfg.vocab_size;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new_dtype(&kv, &m->cfg, (size_t)8 << 20,
                                  r->block_tokens ? r->block_tokens : 16, r->kv_dtype, msg,
                                  sizeof msg),
                 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, m, prefill, msg, sizeof msg), 0, "%s", msg);
    eng_seq_kv skv = {0};
    const int32_t reserve = r->reserve > n ? r->reserve : n;
    const bool rope_long = eng_rope_long_for(&m->cfg, reserve);
    cr_assert_eq(eng_kv_reserve(kv, &skv, reserve), 0);
    float *all = malloc((size_t)n * vocab * sizeof(float));
    float *last = malloc(vocab * sizeof(float));
    cr_assert(all && last);
    eng_step_seq s = {.kv = &skv,
                      .tokens = r->tokens,
                      .n_tokens = prefill,
                      .all_logits = all,
                      .weights = r->weights,
                      .delta = r->delta,
                      .n_delta = r->n_delta,
                      .rope_long = rope_long};
    cr_assert_eq(eng_forward(st, m, kv, pool, &s, 1, last, msg, sizeof msg), 0, "%s", msg);
    for (int t = prefill; t < n; t++) {
        s = (eng_step_seq){.kv = &skv,
                           .tokens = r->tokens + t,
                           .n_tokens = 1,
                           .pos = t,
                           .weights = r->weights,
                           .delta = r->delta,
                           .n_delta = r->n_delta,
                           .rope_long = rope_long};
        cr_assert_eq(eng_forward(st, m, kv, pool, &s, 1, all + (size_t)t * vocab, msg, sizeof msg),
                     0, "position %d: %s", t, msg);
    }
    free(last);
    eng_kv_release(kv, &skv);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    return all;
}

#endif

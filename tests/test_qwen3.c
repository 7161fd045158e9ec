/*
 * test_qwen3.c - Qwen3 (per-head q/k RMSNorm, an explicit head_dim) against
 * transformers itself: the tiny random Qwen3ForCausalLM that
 * tests/fixtures/make_qwen3_reference.py made with transformers (head_dim
 * 24 where hidden / heads is 16, grouped kv heads, norms with weights far
 * from 1), loaded from its safetensors folder, gives at every position of
 * a 16-token prompt the logits transformers computes in float64, within
 * 1e-5 (our pass is float32; the logits are O(1); measured 7e-7). The same folder's
 * config with the q/k norms dropped (a Qwen2 without biases) must not
 * match, so the test sees the norms. (The CUDA backend's q/k norms are
 * checked against this CPU pass by tests/gpu/test_cuda_engine.c.) The same
 * model converted by llama.cpp's own convert_hf_to_gguf.py
 * (tests/fixtures/qwen3_tiny.gguf, make_qwen3_gguf.py: attn_q_norm /
 * attn_k_norm, q/k rows left unpermuted, no rope.dimension_count, the
 * explicit head_dim as attention.key_length) gives the same logits.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fixtures/qwen3_reference.h"
#include "model.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

#ifndef QL_SOURCE_DIR
#error "QL_SOURCE_DIR must name the source tree"
#endif

#define copy_file(from, to) cr_assert(test_copy_file(from, to), "cannot copy %s to %s", from, to)

/* The fixture folder with a tokenizer (the tiny byte-level one: the test
 * feeds ids, so any 260-token vocabulary does) in dir. */
static void make_folder(const char *dir)
{
    char from[1024], to[1024];
    const char *files[] = {"config.json", "model.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/tests/fixtures/qwen3_tiny/%s", QL_SOURCE_DIR, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        copy_file(from, to);
    }
    snprintf(to, sizeof to, "%s/tokenizer.json", dir);
    tiny_write_tokenizer_json(to);
}

/* Every position's logits of the fixture's tokens, in one prefill. */
static float *run_prompt(eng_model *m)
{
    char msg[1024];
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&kv, &m->cfg, 4 << 20, 16, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, m, 64, msg, sizeof msg), 0, "%s", msg);
    int32_t ids[QWEN3_N_TOKENS];
    for (int i = 0; i < QWEN3_N_TOKENS; i++)
        ids[i] = QWEN3_TOKENS[i];
    eng_seq_kv skv = {0};
    cr_assert_eq(eng_kv_reserve(kv, &skv, QWEN3_N_TOKENS), 0);
    float *all = malloc((size_t)QWEN3_N_TOKENS * QWEN3_VOCAB * sizeof(float));
    float *last = malloc(QWEN3_VOCAB * sizeof(float));
    eng_step_seq s = {.kv = &skv, .tokens = ids, .n_tokens = QWEN3_N_TOKENS, .all_logits = all};
    cr_assert_eq(eng_forward(st, m, kv, pool, &s, 1, last, msg, sizeof msg), 0, "%s", msg);
    free(last);
    eng_kv_release(kv, &skv);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    return all;
}

/* The largest |ours - transformers'| over every position and token
 * (test_diff: +inf when any logit is NaN or infinite). */
static double worst_error(const float *all)
{
    test_diff d = test_diff_f64(all, &QWEN3_LOGITS[0][0], (size_t)QWEN3_N_TOKENS * QWEN3_VOCAB);
    return test_diff_abs(&d);
}

Test(qwen3, logits_equal_transformers_float64_at_every_position)
{
    char dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    make_folder(dir);
    eng_model m;
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.arch, ENG_ARCH_QWEN3);
    cr_assert(m.cfg.qk_norm);
    cr_assert_eq(m.cfg.head_dim, 24);
    cr_assert_str_eq(eng_arch_name(m.cfg.arch), "qwen3");
    float *all = run_prompt(&m);
    double worst = worst_error(all);
    cr_assert_lt(worst, 1e-5, "worst logit error %g", worst);
    cr_log_info("worst logit error %g", worst);
    free(all);

    /* without the norms the answer is another: the test sees them */
    m.cfg.qk_norm = false;
    all = run_prompt(&m);
    cr_assert_gt(worst_error(all), 1e-2, "dropping the q/k norms changed nothing");
    free(all);
    m.cfg.qk_norm = true;

    eng_model_free(&m);
    test_rmtree(dir);
}

Test(qwen3, converted_gguf_logits_equal_transformers_float64)
{
    char msg[1024];
    eng_model m;
    eng_load_opts o = {.path = QL_SOURCE_DIR "/tests/fixtures/qwen3_tiny.gguf"};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.arch, ENG_ARCH_QWEN3);
    cr_assert(m.cfg.qk_norm);
    cr_assert_not(m.cfg.rope_interleaved, "qwen3 rows are not permuted by the converter");
    cr_assert_eq(m.cfg.head_dim, 24);
    cr_assert_eq(m.layers[1].q_norm.cols, 24);
    float *all = run_prompt(&m);
    double worst = worst_error(all);
    cr_log_info("qwen3 gguf: worst logit error %g", worst);
    cr_assert_lt(worst, 1e-5, "worst logit error %g", worst);
    free(all);
    eng_model_free(&m);
}

/*
 * test_gemma.c - Gemma 2 and Gemma 3 (text) beyond their logits: the tiny
 * random Gemma2ForCausalLM and Gemma3ForCausalLM that
 * tests/fixtures/make_gemma_reference.py made with transformers, from
 * their folders and their llama.cpp GGUF conversions, equal transformers'
 * float64 logits with each feature seen (sliding window, soft-caps, the
 * (1 + w) offset, Gemma 3's local rotary base) as rows of
 * test_architectures.c. Here: the float64 reference pass (ref_forward.h)
 * equals transformers on them; a PEFT adapter on q_proj and v_proj,
 * unmerged and merged, matches that reference; configs we cannot run are
 * refused by field.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures/gemma_reference.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "ref_forward.h"
#include "run_prompt.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

#ifndef QL_SOURCE_DIR
#error "QL_SOURCE_DIR must name the source tree"
#endif

static void load(eng_model *m, const char *path)
{
    char msg[1024];
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s: %s", path, msg);
}

static void load_folder(eng_model *m, const char *name, char *dir, size_t dir_len)
{
    test_tmpdir(dir, dir_len);
    tiny_fixture_folder(name, dir);
    load(m, dir);
}

static void load_gguf(eng_model *m, const char *name)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/%s", QL_SOURCE_DIR, name);
    load(m, path);
}

/* Every position's logits of the fixture's tokens: a prefill of the first
 * 11, then one token a step (so the decode path and the window's edge
 * over the cache's blocks of 4 are both seen), with adapters `delta` on
 * version w. */
static float *run_prompt_with(eng_model *m, const eng_weights *w, const eng_lora_term *delta,
                              int32_t n_delta)
{
    prompt_run r = {.tokens = GEMMA_TOKENS,
                    .n_tokens = GEMMA_N_TOKENS,
                    .prefill = 11,
                    .block_tokens = 4,
                    .weights = w,
                    .delta = delta,
                    .n_delta = n_delta};
    return run_prompt(m, &r);
}

/* The float64 reference on the folder's weights is transformers' model
 * too (so the adapter test below compares with the right thing). Not to
 * 1e-12: transformers' Gemma RMSNorm casts to float32 (x.float()) even in
 * a float64 model, which alone moves its logits by ~1e-6 here (measured
 * 1.1e-6 for Gemma 2); 5e-6 is well below any feature's effect (> 1e-3). */
static void ref_matches_transformers(const eng_model *m, const double (*want)[GEMMA_VOCAB])
{
    ref_model R;
    ref_load(&R, m);
    int32_t ids[GEMMA_N_TOKENS];
    for (int i = 0; i < GEMMA_N_TOKENS; i++)
        ids[i] = GEMMA_TOKENS[i];
    double *ref = malloc((size_t)GEMMA_N_TOKENS * GEMMA_VOCAB * sizeof *ref);
    ref_forward(&R, ids, GEMMA_N_TOKENS, ref);
    test_diff d = {0};
    for (int t = 0; t < GEMMA_N_TOKENS; t++)
        for (int v = 0; v < GEMMA_VOCAB; v++)
            test_diff_add(&d, ref[(size_t)t * GEMMA_VOCAB + v], want[t][v]);
    double worst = test_diff_abs(&d);
    cr_log_info("float64 reference vs transformers: %g", worst);
    cr_assert_lt(worst, 5e-6, "float64 reference vs transformers: %g", worst);
    free(ref);
    ref_free(&R);
}

Test(gemma, reference_pass_equals_transformers)
{
    char dir[512];
    eng_model m;
    load_folder(&m, "gemma2_tiny", dir, sizeof dir);
    ref_matches_transformers(&m, GEMMA2_LOGITS);
    eng_model_free(&m);
    test_rmtree(dir);
    load_folder(&m, "gemma3_tiny", dir, sizeof dir);
    ref_matches_transformers(&m, GEMMA3_LOGITS);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* Every position of one run against the float64 reference R. */
static void assert_matches_ref(const float *all, const ref_model *R, const char *label)
{
    int32_t ids[GEMMA_N_TOKENS];
    for (int i = 0; i < GEMMA_N_TOKENS; i++)
        ids[i] = GEMMA_TOKENS[i];
    double *ref = malloc((size_t)GEMMA_N_TOKENS * GEMMA_VOCAB * sizeof *ref);
    ref_forward(R, ids, GEMMA_N_TOKENS, ref);
    for (int t = 0; t < GEMMA_N_TOKENS; t++)
        assert_logits_close(all + (size_t)t * GEMMA_VOCAB, ref + (size_t)t * GEMMA_VOCAB,
                            GEMMA_VOCAB, label, "position", t);
    free(ref);
}

static void adapter_on(const char *fixture, bool gguf)
{
    char dir[512], adir[600], msg[1024];
    eng_model m;
    if (gguf) {
        dir[0] = 0;
        load_gguf(&m, fixture);
    } else {
        load_folder(&m, fixture, dir, sizeof dir);
    }
    char tmp[400];
    test_tmpdir(tmp, sizeof tmp);
    snprintf(adir, sizeof adir, "%s/adapter", tmp);
    lora_fix_spec s = lora_fix_default();
    s.projs = (1u << ENG_PROJ_Q) | (1u << ENG_PROJ_V);
    lora_fix_write(adir, &m.cfg, &s);
    eng_lora *lora = NULL;
    cr_assert_eq(lora_load(&lora, NULL, adir, "qv", &m, msg, sizeof msg), 0, "%s", msg);
    cr_assert(eng_lora_module_at(lora, 0, ENG_PROJ_Q) && eng_lora_module_at(lora, 0, ENG_PROJ_V));
    cr_assert_null(eng_lora_module_at(lora, 0, ENG_PROJ_K));

    ref_model R;
    ref_load(&R, &m);
    ref_add_lora(&R, lora, 1.0);
    // unmerged
    eng_lora_term term = {lora, 1.0f};
    float *all = run_prompt_with(&m, NULL, &term, 1);
    assert_matches_ref(all, &R, "unmerged q/v adapter");
    // the adapter did something: the base model is far from R
    float *base = run_prompt_with(&m, NULL, NULL, 0);
    test_diff d = test_diff_f32(all, base, (size_t)GEMMA_N_TOKENS * GEMMA_VOCAB);
    double moved = test_diff_abs(&d);
    cr_assert_gt(moved, 1e-2, "the adapter moved the logits by only %g", moved);
    free(base);
    free(all);
    // merged (f32: the merge is W + BA rounded once)
    eng_weights *v = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    all = run_prompt_with(&m, v, NULL, 0);
    assert_matches_ref(all, &R, "merged q/v adapter");
    free(all);
    eng_weights_unref(v);
    ref_free(&R);
    eng_lora_unref(lora);
    eng_model_free(&m);
    test_rmtree(tmp);
    if (dir[0])
        test_rmtree(dir);
}

Test(gemma, gemma2_qv_adapter_unmerged_and_merged_match_reference)
{
    adapter_on("gemma2_tiny", false);
}

Test(gemma, gemma3_gguf_qv_adapter_unmerged_and_merged_match_reference)
{
    adapter_on("gemma3_tiny.gguf", true);
}

Test(gemma, unsupported_gemma_configs_are_refused_by_field)
{
    char dir[512], msg[1024], path[1024];
    const struct {
        const char *from, *to, *field;
    } cases[] = {
        {"\"hidden_activation\": \"gelu_pytorch_tanh\"", "\"hidden_activation\": \"relu\"",
         "hidden_activation"},
        {"\"use_bidirectional_attention\": false", "\"use_bidirectional_attention\": true",
         "use_bidirectional_attention"},
        {"\"full_attention\"\n  ]", "\"sliding_attention\"\n  ], \"x\": [\"full_attention\"]",
         NULL},
        {"\"rope_theta\": 100.0,\n      \"rope_type\": \"default\"",
         "\"rope_theta\": 100.0,\n      \"rope_type\": \"yarn\"", "sliding_attention.rope_type"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        test_tmpdir(dir, sizeof dir);
        tiny_fixture_folder("gemma3_tiny", dir);
        snprintf(path, sizeof path, "%s/config.json", dir);
        char *text = test_read_file(path, NULL);
        cr_assert(text, "cannot read %s", path);
        cr_assert(text && strstr(text, cases[i].from), "case %zu: fixture text not found", i);
        char *at = strstr(text, cases[i].from);
        FILE *f = fopen(path, "wb");
        fwrite(text, 1, (size_t)(at - text), f);
        fputs(cases[i].to, f);
        fputs(at + strlen(cases[i].from), f);
        fclose(f);
        free(text);
        eng_model m;
        eng_load_opts o = {.path = dir};
        int rc = eng_model_load(&m, &o, msg, sizeof msg);
        if (cases[i].field) {
            cr_assert_neq(rc, 0, "case %zu loaded", i);
            cr_assert(strstr(msg, cases[i].field), "case %zu: \"%s\" does not name %s", i, msg,
                      cases[i].field);
        } else {
            /* every layer sliding: loads, and no layer is full */
            cr_assert_eq(rc, 0, "case %zu: %s", i, msg);
            for (int l = 0; l < m.cfg.n_layers; l++)
                cr_assert(eng_layer_slides(&m.cfg, l));
            eng_model_free(&m);
        }
        test_rmtree(dir);
    }
}

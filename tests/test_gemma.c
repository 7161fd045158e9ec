/*
 * test_gemma.c - Gemma 2 and Gemma 3 (text) against transformers itself:
 * the tiny random Gemma2ForCausalLM and Gemma3ForCausalLM that
 * tests/fixtures/make_gemma_reference.py made with transformers, loaded
 * from their safetensors folders, give at every position of an 18-token
 * prompt (longer than their sliding window of 5) the logits transformers
 * computes in float64, within 1e-5 (our pass is float32; the logits are
 * O(1)). The same models converted to GGUF by llama.cpp's
 * convert_hf_to_gguf.py (norms stored as 1 + w, its tensor names) give the
 * same logits. Each feature is seen: dropping the sliding window, the
 * soft-caps, the (1 + w) offset or Gemma 3's local rotary base moves the
 * logits far past the tolerance. A PEFT adapter on q_proj and v_proj,
 * unmerged and merged, matches the float64 reference (ref_forward.h, itself
 * checked against transformers here).
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
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

#ifndef QL_SOURCE_DIR
#error "QL_SOURCE_DIR must name the source tree"
#endif

#define copy_file(from, to) cr_assert(test_copy_file(from, to), "cannot copy %s to %s", from, to)

/* Fixture folder `name` with a tokenizer (the tiny byte-level one: the
 * test feeds ids, so any 260-token vocabulary does) in dir. */
static void make_folder(const char *name, const char *dir)
{
    char from[1024], to[1024];
    const char *files[] = {"config.json", "model.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/tests/fixtures/%s/%s", QL_SOURCE_DIR, name, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        copy_file(from, to);
    }
    snprintf(to, sizeof to, "%s/tokenizer.json", dir);
    tiny_write_tokenizer_json(to);
}

/* A small file's whole text (the caller frees). */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

static void load(eng_model *m, const char *path)
{
    char msg[1024];
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s: %s", path, msg);
}

static void load_folder(eng_model *m, const char *name, char *dir, size_t dir_len)
{
    test_tmpdir(dir, dir_len);
    make_folder(name, dir);
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
 * over the cache are both seen), with adapters `delta` on version w. */
static float *run_prompt_with(eng_model *m, const eng_weights *w, const eng_lora_term *delta,
                              int32_t n_delta)
{
    char msg[1024];
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&kv, &m->cfg, 4 << 20, 4, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, m, 64, msg, sizeof msg), 0, "%s", msg);
    int32_t ids[GEMMA_N_TOKENS];
    for (int i = 0; i < GEMMA_N_TOKENS; i++)
        ids[i] = GEMMA_TOKENS[i];
    eng_seq_kv skv = {0};
    cr_assert_eq(eng_kv_reserve(kv, &skv, GEMMA_N_TOKENS), 0);
    float *all = malloc((size_t)GEMMA_N_TOKENS * GEMMA_VOCAB * sizeof(float));
    float *last = malloc(GEMMA_VOCAB * sizeof(float));
    const int prefill = 11;
    eng_step_seq s = {.kv = &skv,
                      .tokens = ids,
                      .n_tokens = prefill,
                      .all_logits = all,
                      .weights = w,
                      .delta = delta,
                      .n_delta = n_delta};
    cr_assert_eq(eng_forward(st, m, kv, pool, &s, 1, last, msg, sizeof msg), 0, "%s", msg);
    for (int t = prefill; t < GEMMA_N_TOKENS; t++) {
        s = (eng_step_seq){.kv = &skv,
                           .tokens = ids + t,
                           .n_tokens = 1,
                           .pos = t,
                           .weights = w,
                           .delta = delta,
                           .n_delta = n_delta};
        cr_assert_eq(
            eng_forward(st, m, kv, pool, &s, 1, all + (size_t)t * GEMMA_VOCAB, msg, sizeof msg), 0,
            "%s", msg);
    }
    free(last);
    eng_kv_release(kv, &skv);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    return all;
}

static float *run_prompt(eng_model *m)
{
    return run_prompt_with(m, NULL, NULL, 0);
}

/* The largest |ours - theirs| over every position and token (test_diff:
 * +inf when any logit is NaN or infinite). */
static double worst_error(const float *all, const double (*want)[GEMMA_VOCAB])
{
    test_diff d = test_diff_f64(all, &want[0][0], (size_t)GEMMA_N_TOKENS * GEMMA_VOCAB);
    return test_diff_abs(&d);
}

/* The model's logits against transformers', then with one feature turned
 * off (flip, unflip) to show the test sees it. */
static void check_against(eng_model *m, const double (*want)[GEMMA_VOCAB], const char *label)
{
    float *all = run_prompt(m);
    double worst = worst_error(all, want);
    cr_log_info("%s: worst logit error %g", label, worst);
    cr_assert_lt(worst, 1e-5, "%s: worst logit error %g", label, worst);
    free(all);
}

static void check_feature_matters(eng_model *m, const double (*want)[GEMMA_VOCAB], const char *what)
{
    float *all = run_prompt(m);
    double worst = worst_error(all, want);
    cr_assert_gt(worst, 1e-3, "turning off %s changed nothing (%g)", what, worst);
    free(all);
}

Test(gemma, gemma2_folder_logits_equal_transformers_float64)
{
    char dir[512];
    eng_model m;
    load_folder(&m, "gemma2_tiny", dir, sizeof dir);
    const eng_config *c = &m.cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA2);
    cr_assert_str_eq(eng_arch_name(c->arch), "gemma2");
    cr_assert(c->tie_word_embeddings && c->sandwich_norms && !c->qk_norm);
    cr_assert_eq(c->ffn_act, ENG_FFN_GELU_TANH);
    cr_assert_float_eq(c->norm_offset, 1.0f, 0);
    cr_assert_float_eq(c->attn_softcap, 2.0f, 0);
    cr_assert_float_eq(c->final_softcap, 3.0f, 0);
    cr_assert_float_eq(c->embed_scale, sqrtf(32.0f), 0);
    cr_assert_eq(c->sliding_window, 5);
    cr_assert(eng_layer_slides(c, 0) && !eng_layer_slides(c, 1), "layer 0 slides, layer 1 not");
    check_against(&m, GEMMA2_LOGITS, "gemma2 folder");

    m.cfg.sliding_window = 0;
    check_feature_matters(&m, GEMMA2_LOGITS, "the sliding window");
    m.cfg.sliding_window = 5;
    m.cfg.attn_softcap = 0;
    check_feature_matters(&m, GEMMA2_LOGITS, "the attention soft-cap");
    m.cfg.attn_softcap = 2.0f;
    m.cfg.final_softcap = 0;
    check_feature_matters(&m, GEMMA2_LOGITS, "the final soft-cap");
    m.cfg.final_softcap = 3.0f;
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(gemma, gemma3_folder_logits_equal_transformers_float64)
{
    char dir[512];
    eng_model m;
    load_folder(&m, "gemma3_tiny", dir, sizeof dir);
    const eng_config *c = &m.cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA3);
    cr_assert_str_eq(eng_arch_name(c->arch), "gemma3");
    cr_assert(c->qk_norm && c->sandwich_norms && c->tie_word_embeddings);
    cr_assert_float_eq(c->attn_softcap, 0.0f, 0);
    cr_assert_float_eq(c->final_softcap, 0.0f, 0);
    cr_assert_float_eq(c->attn_scale, (float)(1.0 / sqrt(20.0)), 0);
    cr_assert_float_eq(c->rope_local_theta, 100.0f, 0);
    cr_assert_float_eq(c->rope_theta, 10000.0f, 0);
    cr_assert_eq(c->rope_scaling, ENG_ROPE_LINEAR);
    cr_assert_float_eq(c->rope_factor, 2.0f, 0);
    cr_assert_eq(c->sliding_pattern, 6);
    for (int l = 0; l < 6; l++)
        cr_assert_eq(eng_layer_slides(c, l), l < 5, "layer %d", l);
    check_against(&m, GEMMA3_LOGITS, "gemma3 folder");

    m.cfg.rope_local_theta = 0;
    check_feature_matters(&m, GEMMA3_LOGITS, "the local rotary base");
    m.cfg.rope_local_theta = 100.0f;
    m.cfg.norm_offset = 0;
    check_feature_matters(&m, GEMMA3_LOGITS, "the (1 + w) norm offset");
    m.cfg.norm_offset = 1.0f;
    m.cfg.sliding_window = 0;
    check_feature_matters(&m, GEMMA3_LOGITS, "the sliding window");
    m.cfg.sliding_window = 5;
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(gemma, gemma2_gguf_from_llama_cpp_converter_equals_transformers)
{
    eng_model m;
    load_gguf(&m, "gemma2_tiny.gguf");
    const eng_config *c = &m.cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA2);
    cr_assert_str_eq(m.format, "gguf");
    cr_assert_float_eq(c->norm_offset, 0.0f, 0); /* the converter stored 1 + w */
    cr_assert(!c->rope_interleaved && c->tie_word_embeddings && c->sandwich_norms);
    cr_assert_float_eq(c->attn_softcap, 2.0f, 0);
    cr_assert_float_eq(c->final_softcap, 3.0f, 0);
    cr_assert_eq(c->sliding_window, 5);
    cr_assert_eq(c->sliding_pattern, 2);
    check_against(&m, GEMMA2_LOGITS, "gemma2 gguf");
    eng_model_free(&m);
}

Test(gemma, gemma3_gguf_from_llama_cpp_converter_equals_transformers)
{
    eng_model m;
    load_gguf(&m, "gemma3_tiny.gguf");
    const eng_config *c = &m.cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA3);
    cr_assert(c->qk_norm && !c->rope_interleaved);
    cr_assert_float_eq(c->norm_offset, 0.0f, 0);
    cr_assert_float_eq(c->rope_local_theta, 100.0f, 0);
    cr_assert_eq(c->rope_scaling, ENG_ROPE_LINEAR);
    cr_assert_eq(c->sliding_pattern, 6);
    /* llama.cpp does not store query_pre_attn_scalar: it scales by
     * 1/sqrt(head_dim) (all but the 27B), and so do we */
    cr_assert_float_eq(c->attn_scale, 1.0f / sqrtf(16.0f), 0);
    /* with the fixture's own scalar (20), the rest of the file is
     * transformers' model */
    m.cfg.attn_scale = (float)(1.0 / sqrt(20.0));
    check_against(&m, GEMMA3_LOGITS, "gemma3 gguf");
    eng_model_free(&m);
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

/* A version with the adapter merged into every projection it targets, as
 * the registry builds it (test_lora_engine.c's merged_version, f32). */
static eng_weights *merged_version(const eng_model *m, eng_lora *lora)
{
    char msg[512];
    eng_weights *v = NULL;
    cr_assert_eq(eng_weights_new(&v, m, 1, msg, sizeof msg), 0, "%s", msg);
    lora_merge_opts o = {.safe_merge = true, .into = QT_KIND_COUNT};
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const eng_lora_module *mod = eng_lora_module_at(lora, l, (eng_proj)p);
            if (!mod)
                continue;
            lora_part part = {lora->name, mod, 1.0f};
            const qtensor *w = eng_model_proj(m, l, (eng_proj)p);
            const lora_ops *ops = NULL;
            cr_assert_eq(lora_dispatch(w, &ops, msg, sizeof msg), 0, "%s", msg);
            qtensor merged;
            lora_cost cost;
            cr_assert_eq(ops->merge(w, &part, 1, &o, "module", &merged, &cost, msg, sizeof msg), 0,
                         "%s", msg);
            eng_weights_set(v, l, (eng_proj)p, &merged);
        }
    }
    eng_lora_term t = {lora, 1.0f};
    cr_assert_eq(eng_weights_set_merged(v, &t, 1, msg, sizeof msg), 0);
    return v;
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
    float *base = run_prompt(&m);
    test_diff d = test_diff_f32(all, base, (size_t)GEMMA_N_TOKENS * GEMMA_VOCAB);
    double moved = test_diff_abs(&d);
    cr_assert_gt(moved, 1e-2, "the adapter moved the logits by only %g", moved);
    free(base);
    free(all);
    // merged (f32: the merge is W + BA rounded once)
    eng_weights *v = merged_version(&m, lora);
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
        make_folder("gemma3_tiny", dir);
        snprintf(path, sizeof path, "%s/config.json", dir);
        char *text = slurp(path);
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

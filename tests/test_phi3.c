/*
 * test_phi3.c - Phi-3 (Phi3ForCausalLM, GGUF phi3) against transformers and
 * PEFT themselves: the tiny random Phi-3 that
 * tests/fixtures/make_phi3_reference.py made with transformers (fused
 * qkv_proj and gate_up_proj, grouped kv heads, longrope with distinct short
 * and long factors, original context 16 of 64, a sliding window of 20),
 * loaded from its safetensors folder and from llama.cpp's convert_hf_to_gguf.py
 * conversions of it (f32, and q8_0, whose fused rows are split in place),
 * and a PEFT adapter on its fused modules.
 *
 * What is pinned (the folder's, the f32 GGUF's and the partial-rotary
 * model's logits against transformers' float64 ones, and the features
 * those tests must see, are rows of test_architectures.c):
 *   - the factor set per sequence (eng_rope_long_for): a sequence that
 *     reserves at most the original 16 positions rotates with short_factor
 *     and equals transformers' logits of its prompt (PHI3_SHORT_LOGITS);
 *     one that reserves more (a 10-token prompt that may grow to 17)
 *     rotates every position with long_factor, the first rows of
 *     transformers' 32-token logits; on the folder and the GGUF, and
 *     through the engine, whose prefix cache never hands one set's blocks
 *     to a sequence of the other; a context of 16 never takes the long
 *     set;
 *   - the q8_0 GGUF's q/k/v and gate/up are views into the mapped fused
 *     tensors and give the float64 reference pass's logits
 *     (tests/ref_forward.h) over the same dequantized weights;
 *   - a bitsandbytes 4-bit folder (`qlserve quantize` of the fixture: the
 *     fused tensors quantized whole) splits on block boundaries: single
 *     quantized, each part equals quantizing it alone; double quantized,
 *     each part's values are its rows of the stored fused tensor;
 *   - partial_rotary_factor 0.75 (Phi-4-mini's: the leading 12 of 16 dims
 *     rotate) from a folder and its GGUF: the float64 reference pass
 *     rotates the same dims;
 *   - the PEFT adapter (r 4 on qkv_proj, o_proj, gate_up_proj, down_proj)
 *     unmerged and merged gives PEFT's float64 logits within 1e-5, on the
 *     folder and on the GGUF.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "fixtures/phi3_reference.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "modelfile.h"
#include "ref_forward.h"
#include "run_prompt.h"
#include "runtime.h"
#include "scheduler.h"
#include "test_util.h"
#include "tiny_model.h"

#ifndef QL_SOURCE_DIR
#error "QL_SOURCE_DIR must name the source tree"
#endif

#define FIXTURE(name) QL_SOURCE_DIR "/tests/fixtures/" name

static char dir[512];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(phi3, .init = setup, .fini = teardown, .timeout = 120);

/* The fixture folder in dir with a tokenizer (the tiny byte-level one: the
 * test feeds ids) and config.json as given (NULL: the fixture's). */
static void make_folder(const char *config)
{
    char to[1024];
    snprintf(to, sizeof to, "%s/model.safetensors", dir);
    copy_file(FIXTURE("phi3_tiny/model.safetensors"), to);
    snprintf(to, sizeof to, "%s/config.json", dir);
    if (config)
        test_write_text(to, config);
    else
        copy_file(FIXTURE("phi3_tiny/config.json"), to);
    snprintf(to, sizeof to, "%s/tokenizer.json", dir);
    tiny_write_tokenizer_json(to);
}

static void load(eng_model *m, const char *path, const char *quant)
{
    char msg[1024];
    eng_load_opts o = {.path = path, .quant = quant};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

/* Every position's logits of the first n fixture tokens, in one prefill on
 * version w (NULL: the model's weights) with the adapter terms applied. */
static float *run_phi3(const eng_model *m, int n, const eng_weights *w, const eng_lora_term *delta,
                       int32_t n_delta)
{
    prompt_run r = {
        .tokens = PHI3_TOKENS, .n_tokens = n, .weights = w, .delta = delta, .n_delta = n_delta};
    return run_prompt(m, &r);
}

/* The same for a sequence that reserves `reserve` positions (its factor
 * set follows them), prefilled `prefill` tokens, then one a step. */
static float *run_reserved(const eng_model *m, int n, int prefill, int32_t reserve)
{
    prompt_run r = {.tokens = PHI3_TOKENS, .n_tokens = n, .prefill = prefill, .reserve = reserve};
    return run_prompt(m, &r);
}

/* The largest |ours - reference| over n positions of [n][PHI3_VOCAB]
 * (test_max_abs_err: +inf when any logit is NaN or infinite). */
static double worst_error(const float *all, const double (*want)[PHI3_VOCAB], int n)
{
    return test_max_abs_err(all, &want[0][0], (size_t)n * PHI3_VOCAB);
}

static void check_against_reference(const eng_model *m, const char *label);

/* What transformers' _compute_longrope_parameters makes of factor 64 / 16
 * and the original context 16 (test_architectures.c's phi3 rows check the
 * fixture's own). */
static double expected_attn_factor(void)
{
    return sqrt(1.0 + log(64.0 / 16.0) / log(16.0));
}

/* A short sequence and a long-reserved one on m: transformers' short and
 * long logits, each set for all its positions, the boundary at the
 * original context (16 reserved: short, 17: long, as transformers switches
 * past 16 positions). */
static void check_factor_sets(const eng_model *m, const char *label)
{
    cr_assert_not(eng_rope_long_for(&m->cfg, 16), "%s", label);
    cr_assert(eng_rope_long_for(&m->cfg, 17), "%s", label);
    /* the two references differ: a set taken wrongly shows */
    float *probe = run_reserved(m, PHI3_SHORT_N, 0, 0);
    cr_assert_gt(worst_error(probe, PHI3_LOGITS, PHI3_SHORT_N), 1e-3, "%s", label);
    free(probe);
    const struct {
        int32_t reserve;
        int prefill;
        const double (*want)[PHI3_VOCAB];
    } cases[] = {
        {0, 0, PHI3_SHORT_LOGITS}, {16, 0, PHI3_SHORT_LOGITS}, {16, 4, PHI3_SHORT_LOGITS},
        {17, 0, PHI3_LOGITS},      {17, 4, PHI3_LOGITS},       {64, 1, PHI3_LOGITS},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        float *all = run_reserved(m, PHI3_SHORT_N, cases[i].prefill, cases[i].reserve);
        double worst = worst_error(all, cases[i].want, PHI3_SHORT_N);
        cr_log_info("%s, %d tokens reserving %d: worst logit error %g", label, PHI3_SHORT_N,
                    cases[i].reserve, worst);
        cr_assert_lt(worst, 1e-5, "%s, reserving %d (prefill %d): worst logit error %g", label,
                     cases[i].reserve, cases[i].prefill, worst);
        free(all);
    }
}

Test(phi3, each_sequence_takes_its_factor_set_from_what_it_reserves)
{
    make_folder(NULL);
    eng_model m;
    load(&m, dir, NULL);
    check_factor_sets(&m, "folder");
    eng_model_free(&m);
    load(&m, FIXTURE("phi3_tiny.gguf"), NULL);
    check_factor_sets(&m, "gguf");
    eng_model_free(&m);
}

/* --- the engine: the set chosen at admission, the prefix cache keyed by it ------ */

/* The first token of one request: its logprob and top alternatives. */
typedef struct first_token {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done, have;
    int32_t cached; /* prompt tokens the prefix cache held */
    eng_logprob top[ENG_MAX_LOGPROBS];
    int32_t n_top;
} first_token;

static void ft_on_token(void *user, const eng_token_event *ev)
{
    first_token *f = user;
    if (f->have || ev->token < 0)
        return;
    f->have = true;
    f->n_top = ev->n_top;
    memcpy(f->top, ev->top, (size_t)ev->n_top * sizeof *ev->top);
}

static void ft_on_done(void *user, eng_finish why, const eng_usage *u)
{
    (void)why;
    first_token *f = user;
    pthread_mutex_lock(&f->mu);
    f->cached = u->cached_tokens;
    f->done = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* The first PHI3_SHORT_N fixture tokens as a prompt with max_new new
 * tokens, greedy with top logprobs, run to its end: how many of its prompt
 * tokens the prefix cache held, and the log-probabilities of its first
 * token's row (the prompt's last position) against log_softmax(want). */
static int32_t run_request(eng_engine *e, int32_t max_new, const double *want, const char *what)
{
    first_token f = {.done = false};
    pthread_mutex_init(&f.mu, NULL);
    pthread_cond_init(&f.cv, NULL);
    int32_t prompt[PHI3_SHORT_N];
    for (int i = 0; i < PHI3_SHORT_N; i++)
        prompt[i] = PHI3_TOKENS[i];
    eng_request r = {.prompt_tokens = prompt,
                     .n_prompt_tokens = PHI3_SHORT_N,
                     .max_new_tokens = max_new,
                     .logprobs = true,
                     .top_logprobs = ENG_MAX_LOGPROBS,
                     .on_token = ft_on_token,
                     .on_done = ft_on_done,
                     .user = &f};
    char msg[512];
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), 0, "%s: %s", what, msg);
    pthread_mutex_lock(&f.mu);
    while (!f.done)
        pthread_cond_wait(&f.cv, &f.mu);
    pthread_mutex_unlock(&f.mu);
    cr_assert(f.have && f.n_top == ENG_MAX_LOGPROBS, "%s: no first token", what);
    double max = want[0], sum = 0.0;
    for (int v = 1; v < PHI3_VOCAB; v++)
        max = want[v] > max ? want[v] : max;
    for (int v = 0; v < PHI3_VOCAB; v++)
        sum += exp(want[v] - max);
    test_diff d = {0};
    for (int32_t j = 0; j < f.n_top; j++)
        test_diff_add(&d, f.top[j].logprob, want[f.top[j].token] - max - log(sum));
    cr_log_info("%s: worst top logprob error %g", what, test_diff_abs(&d));
    cr_assert_lt(test_diff_abs(&d), 1e-4, "%s: worst top logprob error %g", what,
                 test_diff_abs(&d));
    pthread_mutex_destroy(&f.mu);
    pthread_cond_destroy(&f.cv);
    return f.cached;
}

Test(phi3, engine_chooses_the_set_at_admission_and_keys_the_prefix_cache)
{
    make_folder(NULL);
    eng_model m;
    load(&m, dir, NULL);
    /* blocks of 4: the 10-token prompt leaves two whole blocks to keep */
    eng_engine_opts o = {.threads = 2,
                         .kv_bytes = 4 << 20,
                         .block_tokens = 4,
                         .prefill_chunk = 4,
                         .step_tokens = 16};
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &m, &o, msg, sizeof msg), 0, "%s", msg);
    const double *shorts = PHI3_SHORT_LOGITS[PHI3_SHORT_N - 1];
    const double *longs = PHI3_LOGITS[PHI3_SHORT_N - 1];
    /* 10 + 6 stays within the original 16: transformers' short logits */
    cr_assert_eq(run_request(e, 6, shorts, "short"), 0);
    /* 10 + 7 may pass it: the long set, and none of the short one's
     * blocks although the prompt is the same */
    cr_assert_eq(run_request(e, 7, longs, "long"), 0);
    /* each set finds its own blocks again: the two whole ones and the
     * first position of the next, kept with the answer after it (all but
     * the last prompt token, whose logits begin the answer) */
    cr_assert_eq(run_request(e, 1, shorts, "short again"), 9);
    cr_assert_eq(run_request(e, 30, longs, "long again"), 9);
    eng_engine_stop(e);
    eng_model_free(&m);
}

/* The fixture's config.json with `from` replaced by `to` (once). */
static char *config_with(const char *from, const char *to)
{
    char *s = test_read_file(FIXTURE("phi3_tiny/config.json"), NULL);
    cr_assert(s, "cannot read the fixture's config.json");
    char *at = strstr(s, from);
    cr_assert(at, "config.json has no %s", from);
    size_t n = strlen(s) - strlen(from) + strlen(to) + 1;
    char *out = malloc(n);
    snprintf(out, n, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
    free(s);
    return out;
}

Test(phi3, context_within_the_original_takes_short_factors)
{
    /* a context of 16 (= the original) with factor 4 given, so transformers'
     * attention factor is the fixture's: short factors, as transformers
     * takes them for a prompt within the original context */
    char *a = config_with("\"max_position_embeddings\": 64", "\"max_position_embeddings\": 16");
    char *cfg = NULL;
    {
        const char *from = "\"rope_type\": \"longrope\",";
        char *at = strstr(a, from);
        cr_assert(at);
        size_t n = strlen(a) + 32;
        cfg = malloc(n);
        snprintf(cfg, n, "%.*s%s \"factor\": 4.0,%s", (int)(at - a), a, from, at + strlen(from));
    }
    make_folder(cfg);
    free(a);
    free(cfg);
    eng_model m;
    load(&m, dir, NULL);
    cr_assert_not(eng_rope_long_for(&m.cfg, m.cfg.max_position_embeddings));
    cr_assert_float_eq(m.cfg.rope_freq_factors[7], PHI3_SHORT_FACTOR[7], 1e-6);
    cr_assert_float_eq(m.cfg.rope_attn_factor, expected_attn_factor(), 1e-6);
    float *all = run_phi3(&m, PHI3_SHORT_N, NULL, NULL, 0);
    double worst = worst_error(all, PHI3_SHORT_LOGITS, PHI3_SHORT_N);
    cr_log_info("phi3 short factors: worst logit error %g", worst);
    cr_assert_lt(worst, 1e-5, "worst logit error %g", worst);
    free(all);
    eng_model_free(&m);
}

Test(phi3, partial_rotary_reference_pass_rotates_the_same_dims)
{
    /* Phi-4-mini's shape of rope (partial_rotary_factor 0.75): the folder
     * and its GGUF equal transformers (test_architectures.c), and the
     * float64 reference pass rotates the same leading 12 of 16 dims */
    tiny_fixture_folder("phi3_partial_tiny", dir);
    const char *paths[] = {dir, FIXTURE("phi3_partial_tiny.gguf")};
    for (int i = 0; i < 2; i++) {
        eng_model m;
        load(&m, paths[i], NULL);
        cr_assert_eq(m.cfg.rope_dim, 12, "%s", paths[i]);
        check_against_reference(&m, "phi3 partial rotary");
        eng_model_free(&m);
    }
}

Test(phi3, bad_partial_rotary_and_factor_lists_are_refused_by_name)
{
    char msg[1024];
    eng_model m;
    /* 16 * 0.1 leaves one rotary dim: no pair */
    char *cfg = config_with("\"partial_rotary_factor\": 1.0", "\"partial_rotary_factor\": 0.1");
    make_folder(cfg);
    free(cfg);
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), QL_EFORMAT, "%s", msg);
    cr_assert(strstr(msg, "partial_rotary_factor"), "%s", msg);

    cfg = config_with("13.0\n", "13.0, 20.0\n");
    make_folder(cfg);
    free(cfg);
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), QL_EFORMAT, "%s", msg);
    cr_assert(strstr(msg, "long_factor"), "%s", msg);
}

/* Every position against the float64 reference over the model's own
 * (dequantized) weights. */
static void check_against_reference(const eng_model *m, const char *label)
{
    ref_model R;
    ref_load(&R, m);
    double *want = malloc((size_t)PHI3_N_TOKENS * PHI3_VOCAB * sizeof *want);
    int32_t ids[PHI3_N_TOKENS];
    for (int i = 0; i < PHI3_N_TOKENS; i++)
        ids[i] = PHI3_TOKENS[i];
    ref_forward(&R, ids, PHI3_N_TOKENS, want);
    float *all = run_phi3(m, PHI3_N_TOKENS, NULL, NULL, 0);
    for (int t = 0; t < PHI3_N_TOKENS; t++)
        assert_logits_close(all + (size_t)t * PHI3_VOCAB, want + (size_t)t * PHI3_VOCAB, PHI3_VOCAB,
                            label, "logits", t);
    /* and the reference is transformers' model: the f32 weights' one within
     * what the quantization moved */
    free(all);
    free(want);
    ref_free(&R);
}

Test(phi3, q8_0_gguf_splits_fused_rows_in_place)
{
    eng_model m;
    /* its config, and its logits against the float64 reference pass, are
     * a row of test_architectures.c */
    load(&m, FIXTURE("phi3_tiny_q8_0.gguf"), NULL);
    for (int l = 0; l < 2; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_qkv.weight", l);
        const gguf_tensor *qkv = gguf_find_tensor(m.gguf, name);
        snprintf(name, sizeof name, "blk.%d.ffn_up.weight", l);
        const gguf_tensor *gate_up = gguf_find_tensor(m.gguf, name);
        cr_assert(qkv && gate_up);
        const eng_layer *L = &m.layers[l];
        size_t row = 64 / 32 * 34; /* two q8_0 blocks of 34 bytes per row of 64 */
        cr_assert_eq(L->wq.kind, QT_Q8_0);
        cr_assert(L->wq.data_borrowed && L->wk.data_borrowed && L->w_up.data_borrowed);
        cr_assert_eq(L->wq.data, qkv->data);
        cr_assert_eq(L->wk.data, qkv->data + 64 * row);
        cr_assert_eq(L->wv.data, qkv->data + 96 * row);
        cr_assert_eq(L->w_gate.data, gate_up->data);
        cr_assert_eq(L->w_up.data, gate_up->data + 96 * row);
    }
    eng_model_free(&m);
}

Test(phi3, quantized_on_load_each_part_as_its_own_linear)
{
    make_folder(NULL);
    eng_model m;
    load(&m, dir, "int8");
    cr_assert_eq(m.layers[0].wk.kind, QT_AFFINE);
    cr_assert_eq(m.layers[0].wk.rows, 32);
    cr_assert_eq(m.layers[0].w_up.kind, QT_AFFINE);
    check_against_reference(&m, "phi3 int8 on load");
    eng_model_free(&m);
}

static void assert_same_values(const qtensor *a, const qtensor *b, const char *what)
{
    cr_assert_eq(a->rows, b->rows, "%s rows", what);
    cr_assert_eq(a->cols, b->cols, "%s cols", what);
    size_t n = (size_t)(a->rows * a->cols);
    float *x = malloc(n * 4), *y = malloc(n * 4);
    qt_dequantize_rows(a, 0, a->rows, x);
    qt_dequantize_rows(b, 0, b->rows, y);
    cr_assert_eq(memcmp(x, y, n * 4), 0, "%s differ", what);
    free(x);
    free(y);
}

/* The fixture's weights as `qlserve quantize` writes them (bitsandbytes
 * serialization, the fused tensors quantized whole) in a folder whose
 * config says bitsandbytes 4-bit. */
static void make_bnb_folder(const char *sub, bool double_quant)
{
    char folder[700], out[800], msg[512];
    snprintf(folder, sizeof folder, "%s/%s", dir, sub);
    cr_assert_eq(mkdir(folder, 0700), 0);
    snprintf(out, sizeof out, "%s/model.safetensors", folder);
    eng_quantize_opts qo = {.in_path = FIXTURE("phi3_tiny/model.safetensors"),
                            .out_path = out,
                            .kind = "nf4",
                            .double_quant = double_quant};
    cr_assert_eq(eng_quantize_file(&qo, NULL, msg, sizeof msg), 0, "%s", msg);
    char *cfg = config_with("\"tie_word_embeddings\": false",
                            "\"tie_word_embeddings\": false, \"quantization_config\": "
                            "{\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true, "
                            "\"bnb_4bit_quant_type\": \"nf4\"}");
    snprintf(out, sizeof out, "%s/config.json", folder);
    test_write_text(out, cfg);
    free(cfg);
    snprintf(out, sizeof out, "%s/tokenizer.json", folder);
    tiny_write_tokenizer_json(out);
}

Test(phi3, bitsandbytes_4bit_fused_tensors_split_on_block_boundaries)
{
    /* single quantization: each part is what quantizing it alone gives
     * (its rows start on a block of 64), bit for bit */
    make_bnb_folder("nf4", false);
    char path[700];
    snprintf(path, sizeof path, "%s/nf4", dir);
    eng_model q, want;
    load(&q, path, NULL);
    make_folder(NULL);
    load(&want, dir, "nf4");
    cr_assert_str_eq(q.format, "bitsandbytes-4bit");
    for (int l = 0; l < 2; l++) {
        const eng_layer *a = &q.layers[l], *b = &want.layers[l];
        cr_assert_eq(a->wk.kind, QT_NF4);
        assert_same_values(&a->wq, &b->wq, "q");
        assert_same_values(&a->wk, &b->wk, "k");
        assert_same_values(&a->wv, &b->wv, "v");
        assert_same_values(&a->w_gate, &b->w_gate, "gate");
        assert_same_values(&a->w_up, &b->w_up, "up");
    }
    check_against_reference(&q, "phi3 bitsandbytes nf4");
    eng_model_free(&want);
    eng_model_free(&q);

    /* double quantization: the parts take the absmax the fused tensor
     * dequantizes with, so the pass is the fused weights' */
    make_bnb_folder("nf4-dq", true);
    snprintf(path, sizeof path, "%s/nf4-dq", dir);
    load(&q, path, NULL);
    cr_assert_eq(q.layers[0].wv.kind, QT_NF4);
    /* each part's values are its rows of the fused tensor as stored */
    char msg[512];
    qtensor fused;
    cr_assert_eq(bnb_read(&q.shards[0], "model.layers.1.self_attn.qkv_proj.weight", &fused, NULL,
                          msg, sizeof msg),
                 0, "%s", msg);
    cr_assert(fused.nested);
    float *all = malloc(128 * 64 * sizeof *all), *part = malloc(64 * 64 * sizeof *part);
    qt_dequantize_rows(&fused, 0, 128, all);
    const qtensor *parts[3] = {&q.layers[1].wq, &q.layers[1].wk, &q.layers[1].wv};
    for (int k = 0, r0 = 0; k < 3; r0 += (int)parts[k]->rows, k++) {
        qt_dequantize_rows(parts[k], 0, parts[k]->rows, part);
        cr_assert_eq(memcmp(part, all + r0 * 64, (size_t)parts[k]->rows * 64 * sizeof *part), 0,
                     "part %d", k);
    }
    free(all);
    free(part);
    qt_free(&fused);
    check_against_reference(&q, "phi3 bitsandbytes nf4-dq");
    eng_model_free(&q);
}

/* --- the PEFT adapter on qkv_proj and gate_up_proj ------------------------------ */

static eng_lora *load_adapter(const eng_model *m)
{
    char msg[1024];
    eng_lora *l = NULL;
    lora_meta meta;
    cr_assert_eq(lora_load(&l, &meta, FIXTURE("phi3_lora"), "phi3-lora", m, msg, sizeof msg), 0,
                 "%s", msg);
    cr_assert_str_eq(meta.targets, "qkv_proj,o_proj,gate_up_proj,down_proj");
    for (int layer = 0; layer < 2; layer++) {
        const eng_lora_module *q = eng_lora_module_at(l, layer, ENG_PROJ_Q);
        const eng_lora_module *k = eng_lora_module_at(l, layer, ENG_PROJ_K);
        const eng_lora_module *v = eng_lora_module_at(l, layer, ENG_PROJ_V);
        const eng_lora_module *g = eng_lora_module_at(l, layer, ENG_PROJ_GATE);
        const eng_lora_module *u = eng_lora_module_at(l, layer, ENG_PROJ_UP);
        cr_assert(q && k && v && g && u);
        cr_assert_eq(q->b.rows, 64);
        cr_assert_eq(k->b.rows, 32);
        cr_assert_eq(v->b.rows, 32);
        cr_assert_eq(g->b.rows, 96);
        cr_assert_eq(u->b.rows, 96);
        /* A is the fused module's, shared; B's rows follow one another */
        cr_assert_eq(memcmp(q->a.data, v->a.data, q->a.data_bytes), 0);
        cr_assert_eq(k->b.data, q->b.data + 64 * 4 * sizeof(float));
        cr_assert_eq(v->b.data, q->b.data + 96 * 4 * sizeof(float));
        cr_assert_eq(u->b.data, g->b.data + 96 * 4 * sizeof(float));
        cr_assert_float_eq(q->scale, 2.0f, 0.0f);
    }
    return l;
}

/* Unmerged, then merged: PEFT's float64 logits at every position. */
static void check_adapter(const eng_model *m, const char *label)
{
    eng_lora *lora = load_adapter(m);
    eng_lora_term term = {lora, 1.0f};
    float *all = run_phi3(m, PHI3_N_TOKENS, NULL, &term, 1);
    double worst = worst_error(all, PHI3_LORA_LOGITS, PHI3_N_TOKENS);
    cr_log_info("%s unmerged: worst logit error %g", label, worst);
    cr_assert_lt(worst, 1e-5, "%s unmerged: worst logit error %g", label, worst);
    free(all);
    eng_weights *w = lora_fix_merged_version(m, &term, 1, QT_KIND_COUNT);
    all = run_phi3(m, PHI3_N_TOKENS, w, NULL, 0);
    worst = worst_error(all, PHI3_LORA_LOGITS, PHI3_N_TOKENS);
    cr_log_info("%s merged: worst logit error %g", label, worst);
    cr_assert_lt(worst, 1e-5, "%s merged: worst logit error %g", label, worst);
    free(all);
    eng_weights_unref(w);
    eng_lora_unref(lora);
}

Test(phi3, peft_adapter_on_fused_modules_equals_peft_float64)
{
    make_folder(NULL);
    eng_model m;
    load(&m, dir, NULL);
    check_adapter(&m, "phi3 folder + adapter");
    eng_model_free(&m);
}

Test(phi3, peft_adapter_on_the_converted_gguf_equals_peft_float64)
{
    eng_model m;
    load(&m, FIXTURE("phi3_tiny.gguf"), NULL);
    check_adapter(&m, "phi3 gguf + adapter");
    eng_model_free(&m);
}

Test(phi3, adapter_naming_llama_modules_is_refused_with_phi3_names)
{
    /* a Phi-3 model has no q_proj: PEFT could not have trained one */
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    copy_file(FIXTURE("phi3_lora/adapter_model.safetensors"), path);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    test_write_text(path, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, "
                          "\"target_modules\": [\"q_proj\", \"v_proj\"]}");
    eng_model m;
    load(&m, FIXTURE("phi3_tiny.gguf"), NULL);
    eng_lora *l = NULL;
    cr_assert_eq(lora_load(&l, NULL, dir, "wrong", &m, msg, sizeof msg), QL_EINVAL, "%s", msg);
    cr_assert_null(l);
    cr_assert(strstr(msg, "model.layers.0.self_attn.qkv_proj"), "%s", msg);
    eng_model_free(&m);
}

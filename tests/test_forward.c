/*
 * test_forward.c - the CPU forward pass against a float64 reference written
 * plainly here: the tiny Llama/Qwen2 models of tiny_model.h, loaded as every
 * weight kind the engine runs (bf16, f16, f32, nf4, nf4 double-quant, fp4,
 * int4, int8, GGUF q4_0/q4_1/q8_0/q5_0/q5_1/q2_k/q3_k/q4_k/q5_k/q6_k/
 * iq4_nl/iq4_xs/f16, llama-quantize's Q4_K_M mix of them (k-quant weights
 * random super-blocks, on 256-wide layers) and a q3_k model whose 288-wide
 * rows fall back to iq4_nl, quantized lm_head, tied embeddings,
 * attention biases, linear and llama3 RoPE scaling, GQA, MQA and MHA, AVX2
 * and scalar kernels), prefilled in one step and decoded token by token; a
 * mixed batch of prefill chunks and decodes that must give each sequence
 * bit for bit what it gets alone; the paged KV cache's accounting and the
 * forward pass's refusals; the worker pool.
 *
 * The reference takes the engine's weights dequantized (qt_dequantize_rows),
 * so it checks the forward pass's arithmetic for every kind, not the
 * quantization error, and computes everything else in double. It was
 * checked once against transformers 5 run in float64 on the same folders
 * (Llama, Qwen2, linear and llama3 scaling, and a q8_0 GGUF through
 * transformers' reverse q/k permutation): 1.2e-7 relative, which is
 * transformers computing inv_freq in f32.
 *
 * Tolerance: ||engine - reference||_2 / ||reference||_2 <= 1e-5 over one
 * position's logits. The engine computes in f32 (24-bit mantissa, 6e-8 per
 * rounding); every dot product here has at most 96 terms and the model two
 * layers, so summation order and rounding come to ~1e-7 relative (measured:
 * 0.9e-7 to 3.5e-7 over every comparison here, AVX2 and scalar). 1e-5 leaves a factor of 30 for
 * other summation orders and still catches any formula slip: a wrong
 * RMSNorm eps (1e-5 vs 1e-6) moves these logits by ~1e-2 relative, a RoPE
 * pair layout or position off by one, a missing bias, a wrong GQA head
 * mapping by O(1). A per-logit absolute bound such as 1e-3 would not do:
 * these random models' logits are ~0.1-0.5, so it would let through
 * relative errors of 1%.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model.h"
#include "runtime.h"
#include "stages.h"
#include "test_util.h"
#include "tiny_model.h"

#define FWD_REL_TOL   1e-5
#define FWD_KV_BYTES  ((size_t)8 << 20)
#define FWD_MAX_TOKEN 64

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

TestSuite(forward, .init = setup, .fini = teardown, .timeout = 60);

#include "ref_forward.h"

/* --- the engine under test ----------------------------------------------- */

typedef struct fwd_engine {
    eng_model m;
    ref_model ref;
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    int64_t vocab;
} fwd_engine;

/* How a test model is made and loaded. */
typedef struct fwd_case {
    const char *label;
    const char *arch; /* NULL: LlamaForCausalLM */
    bool tie;
    int kv_heads; /* 0: the tiny default's 2 */
    bool gguf;    /* written as a llama GGUF with linear layers of gguf_kind */
    qt_kind gguf_kind;
    const char *quant, *dtype; /* eng_load_opts */
    int32_t group_size;
    bool quantize_lm_head;
    const char *config;   /* JSON object merged into config.json, or NULL */
    bool scalar;          /* the scalar reference kernels instead of AVX2 */
    bool q4_k_m;          /* GGUF with llama-quantize's Q4_K_M mix of types, wider dims */
    bool iq4_nl_fallback; /* GGUF: hidden 288, the rows of 288 IQ4_NL, the rest gguf_kind */
} fwd_case;

/* Merge the members of the JSON object `patch` into dir/config.json. */
static void patch_config(const char *folder, const char *patch)
{
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", folder);
    FILE *f = fopen(path, "rb");
    cr_assert(f);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    cJSON *cfg = cJSON_Parse(buf), *p = cJSON_Parse(patch);
    cr_assert(cfg && p, "config patch %s", patch);
    cJSON *item;
    cJSON_ArrayForEach (item, p) {
        cJSON_DeleteItemFromObjectCaseSensitive(cfg, item->string);
        cJSON_AddItemToObject(cfg, item->string, cJSON_Duplicate(item, true));
    }
    char *text = cJSON_Print(cfg);
    test_write_text(path, text);
    free(text);
    cJSON_Delete(cfg);
    cJSON_Delete(p);
}

/* Write the case's model under dir; path receives what to load. */
static void make_model(const fwd_case *fc, char *path, size_t len)
{
    tiny_spec s = tiny_default();
    if (fc->arch)
        s.arch = fc->arch;
    s.tie = fc->tie;
    if (fc->kv_heads)
        s.kv_heads = fc->kv_heads;
    bool kquant = fc->gguf && qt_traits_table[fc->gguf_kind].block_size == 256;
    if (kquant) { /* k-quant rows are whole super-blocks of 256 */
        s.hidden = 256;
        s.inter = 512;
        s.q4_k_m_mix = fc->q4_k_m;
    }
    if (fc->iq4_nl_fallback) { /* only ffn_down's rows (inter) hold 256-blocks */
        s.hidden = 288;
        s.iq4_nl_fallback = true;
    }
    if (fc->gguf) {
        snprintf(path, len, "%s/tiny.gguf", dir);
        tiny_write_gguf(path, &s, fc->gguf_kind);
        return;
    }
    snprintf(path, len, "%s", dir);
    tiny_write_hf(path, &s);
    if (fc->config)
        patch_config(path, fc->config);
}

static void fwd_open(fwd_engine *e, const fwd_case *fc, int32_t block_tokens)
{
    memset(e, 0, sizeof *e);
    qt_set_force_scalar(fc->scalar); /* each Criterion test runs in its own process */
    char path[700], msg[1024];
    make_model(fc, path, sizeof path);
    eng_load_opts o = {.path = path,
                       .quant = fc->quant,
                       .dtype = fc->dtype,
                       .group_size = fc->group_size,
                       .quantize_lm_head = fc->quantize_lm_head};
    cr_assert_eq(eng_model_load(&e->m, &o, msg, sizeof msg), 0, "%s: load: %s", fc->label, msg);
    ref_load(&e->ref, &e->m);
    e->vocab = e->m.cfg.vocab_size;
    cr_assert_eq(eng_pool_new(&e->pool, 2, msg, sizeof msg), 0, "pool: %s", msg);
    cr_assert_eq(eng_kv_new(&e->kv, &e->m.cfg, FWD_KV_BYTES, block_tokens, msg, sizeof msg), 0,
                 "kv: %s", msg);
    cr_assert_eq(eng_forward_state_new(&e->st, &e->m, FWD_MAX_TOKEN, msg, sizeof msg), 0,
                 "forward state: %s", msg);
}

static void fwd_close(fwd_engine *e)
{
    eng_forward_state_free(e->st);
    eng_kv_free(e->kv);
    eng_pool_free(e->pool);
    ref_free(&e->ref);
    eng_model_free(&e->m);
}

/* Reserve what each sequence writes, run one step, and insist it works. */
static void fwd_step(fwd_engine *e, const eng_step_seq *seqs, int32_t n, float *logits,
                     const char *label)
{
    char msg[1024] = "";
    for (int32_t i = 0; i < n; i++)
        cr_assert_eq(eng_kv_reserve(e->kv, seqs[i].kv, seqs[i].pos + seqs[i].n_tokens), QL_OK,
                     "%s: reserve %d positions", label, seqs[i].pos + seqs[i].n_tokens);
    int rc = eng_forward(e->st, &e->m, e->kv, e->pool, seqs, n, logits, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s: eng_forward: %s (%s)", label, msg, ql_strerror(rc));
}

/* --- 1. every kind: prefill 7 tokens, then decode 3 ---------------------- */

#define PREFILL 7
#define DECODE  3

static void prefill_and_decode_match_reference(const fwd_case *fc)
{
    fwd_engine e;
    fwd_open(&e, fc, 16);
    int64_t V = e.vocab;
    int32_t tokens[PREFILL + DECODE] = {259, 72, 101, 108, 256, 258, 33};
    float *logits = malloc((size_t)((DECODE + 1) * V) * sizeof *logits);
    eng_seq_kv kv = {0};

    // prefill all 7 tokens in one step, then feed back the greedy token
    eng_step_seq s = {.kv = &kv, .tokens = tokens, .n_tokens = PREFILL, .pos = 0};
    fwd_step(&e, &s, 1, logits, fc->label);
    for (int d = 0; d < DECODE; d++) {
        tokens[PREFILL + d] = argmax(logits + d * V, V);
        s = (eng_step_seq){
            .kv = &kv, .tokens = tokens + PREFILL + d, .n_tokens = 1, .pos = PREFILL + d};
        fwd_step(&e, &s, 1, logits + (d + 1) * V, fc->label);
    }

    double *ref = malloc((size_t)((PREFILL + DECODE) * V) * sizeof *ref);
    ref_forward(&e.ref, tokens, PREFILL + DECODE, ref);
    for (int d = 0; d <= DECODE; d++) {
        int pos = PREFILL - 1 + d;
        assert_logits_close(logits + d * V, ref + pos * V, V, fc->label,
                            d == 0 ? "prefill" : "decode", pos);
    }
    eng_kv_release(e.kv, &kv);
    free(ref);
    free(logits);
    fwd_close(&e);
}

#define KIND_TEST(name, ...)                                                                       \
    Test(forward, name)                                                                            \
    {                                                                                              \
        fwd_case fc = {.label = #name, __VA_ARGS__};                                               \
        prefill_and_decode_match_reference(&fc);                                                   \
    }

KIND_TEST(bf16_matches_reference, .quant = NULL)
KIND_TEST(f32_matches_reference, .dtype = "f32")
KIND_TEST(f16_matches_reference, .dtype = "f16")
KIND_TEST(nf4_matches_reference, .quant = "nf4")
KIND_TEST(nf4_double_quant_matches_reference, .quant = "nf4-dq")
KIND_TEST(fp4_matches_reference, .quant = "fp4")
KIND_TEST(int4_group32_matches_reference, .quant = "int4", .group_size = 32)
KIND_TEST(int8_per_channel_matches_reference, .quant = "int8")
KIND_TEST(nf4_with_quantized_lm_head_matches_reference, .quant = "nf4", .quantize_lm_head = true)
KIND_TEST(gguf_q4_0_matches_reference, .gguf = true, .gguf_kind = QT_Q4_0)
KIND_TEST(gguf_q4_1_matches_reference, .gguf = true, .gguf_kind = QT_Q4_1)
KIND_TEST(gguf_q8_0_matches_reference, .gguf = true, .gguf_kind = QT_Q8_0)
KIND_TEST(gguf_q5_0_matches_reference, .gguf = true, .gguf_kind = QT_Q5_0)
KIND_TEST(gguf_q5_1_matches_reference, .gguf = true, .gguf_kind = QT_Q5_1)
KIND_TEST(gguf_q4_k_m_mix_matches_reference, .gguf = true, .gguf_kind = QT_Q4_K, .q4_k_m = true)
KIND_TEST(gguf_q4_k_m_mix_scalar_kernels_match_reference, .gguf = true, .gguf_kind = QT_Q4_K,
          .q4_k_m = true, .scalar = true)
KIND_TEST(gguf_q4_k_matches_reference, .gguf = true, .gguf_kind = QT_Q4_K)
KIND_TEST(gguf_q5_k_matches_reference, .gguf = true, .gguf_kind = QT_Q5_K)
KIND_TEST(gguf_q6_k_matches_reference, .gguf = true, .gguf_kind = QT_Q6_K)
KIND_TEST(gguf_q2_k_matches_reference, .gguf = true, .gguf_kind = QT_Q2_K)
KIND_TEST(gguf_q3_k_matches_reference, .gguf = true, .gguf_kind = QT_Q3_K)
KIND_TEST(gguf_iq4_nl_matches_reference, .gguf = true, .gguf_kind = QT_IQ4_NL)
KIND_TEST(gguf_iq4_xs_matches_reference, .gguf = true, .gguf_kind = QT_IQ4_XS)
KIND_TEST(gguf_mxfp4_matches_reference, .gguf = true, .gguf_kind = QT_MXFP4)
KIND_TEST(gguf_q3_k_iq4_nl_fallback_matches_reference, .gguf = true, .gguf_kind = QT_Q3_K,
          .iq4_nl_fallback = true)
KIND_TEST(gguf_q3_k_iq4_nl_fallback_scalar_kernels_match_reference, .gguf = true,
          .gguf_kind = QT_Q3_K, .iq4_nl_fallback = true, .scalar = true)
KIND_TEST(gguf_f16_tied_matches_reference, .gguf = true, .gguf_kind = QT_F16, .tie = true)
KIND_TEST(qwen2_biases_tied_matches_reference, .arch = "Qwen2ForCausalLM", .tie = true)
KIND_TEST(qwen2_nf4_matches_reference, .arch = "Qwen2ForCausalLM", .tie = true, .quant = "nf4")
KIND_TEST(nf4_scalar_kernels_match_reference, .quant = "nf4", .scalar = true)
KIND_TEST(gguf_q4_1_scalar_kernels_match_reference, .gguf = true, .gguf_kind = QT_Q4_1,
          .scalar = true)
KIND_TEST(multi_query_attention_matches_reference, .kv_heads = 1)
KIND_TEST(multi_head_attention_matches_reference, .kv_heads = 4)
KIND_TEST(rope_linear_scaling_matches_reference,
          .config = "{\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}}")
/* original context 64 puts the tiny model's 8 wavelengths (6.3 to 2e4) in
 * all three llama3 bands: kept (< 16), blended, divided (> 64) */
KIND_TEST(rope_llama3_scaling_matches_reference,
          .config = "{\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                    "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                    "\"original_max_position_embeddings\": 64}}")
/* a window shorter than the 7-token prompt, so it cuts during prefill and
 * during every decode step */
KIND_TEST(mistral_sliding_window_matches_reference, .arch = "MistralForCausalLM",
          .config = "{\"sliding_window\": 3}")
KIND_TEST(rope_theta_and_eps_from_config_match_reference,
          .config = "{\"rope_theta\": 500000.0, \"rms_norm_eps\": 1e-6}")

Test(forward, config_patches_reach_the_model)
{
    /* the reference follows cfg, so a patch the loader ignored would pass
     * unnoticed: the patched fields must be what the tests above think */
    fwd_case fc = {.label = "patched",
                   .config = "{\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                             "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                             "\"original_max_position_embeddings\": 64}, "
                             "\"rope_theta\": 500000.0, \"rms_norm_eps\": 1e-6}"};
    char path[700], msg[512];
    make_model(&fc, path, sizeof path);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.rope_scaling, ENG_ROPE_LLAMA3);
    cr_assert_eq(m.cfg.rope_original_max_position, 64);
    cr_assert_float_eq(m.cfg.rope_factor, 8.0f, 0);
    cr_assert_float_eq(m.cfg.rope_low_freq_factor, 1.0f, 0);
    cr_assert_float_eq(m.cfg.rope_high_freq_factor, 4.0f, 0);
    cr_assert_float_eq(m.cfg.rope_theta, 500000.0f, 0);
    cr_assert_float_eq(m.cfg.rms_norm_eps, 1e-6f, 0);
    eng_model_free(&m);
    fc.config = "{\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}}";
    make_model(&fc, path, sizeof path);
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.rope_scaling, ENG_ROPE_LINEAR);
    cr_assert_float_eq(m.cfg.rope_factor, 2.0f, 0);
    eng_model_free(&m);
}

/* The stage clock (stages.h, bench_decode --stages): attached, a step adds
 * each stage it runs (every layer's projections, the lm_head once, attention,
 * the norms and activations, the KV writes, the embeddings) with its calls,
 * the stages' time within the step's; detached, a step adds nothing. */
Test(forward, the_stage_clock_counts_each_stage_of_a_step)
{
    fwd_case fc = {.label = "stages"};
    fwd_engine e;
    fwd_open(&e, &fc, 16);
    int32_t tokens[5] = {3, 1, 4, 1, 5};
    float *logits = malloc((size_t)e.vocab * sizeof *logits);
    eng_seq_kv kv = {0};
    eng_stage_times t = {0};
    eng_forward_time_stages(e.st, &t);
    eng_step_seq s = {.kv = &kv, .tokens = tokens, .n_tokens = 5, .pos = 0};
    int64_t t0 = ql_now_ns();
    fwd_step(&e, &s, 1, logits, "timed");
    int64_t wall = ql_now_ns() - t0, timed = 0;
    int32_t L = e.m.cfg.n_layers;
    /* seven projections a layer, the head once, attention and the K/V
     * writes once a layer, the embeddings once */
    cr_assert_eq(t.calls[ENG_STAGE_MATMUL], 7 * L, "%lld projections",
                 (long long)t.calls[ENG_STAGE_MATMUL]);
    cr_assert_eq(t.calls[ENG_STAGE_LM_HEAD], 1);
    cr_assert_eq(t.calls[ENG_STAGE_ATTENTION], L);
    cr_assert_eq(t.calls[ENG_STAGE_KV_WRITE], L);
    cr_assert_eq(t.calls[ENG_STAGE_EMBED], 1);
    cr_assert_geq(t.calls[ENG_STAGE_ELEMENTWISE], 2 * L + 1, "two norms a layer and the final");
    for (int k = 0; k < ENG_STAGE_COUNT; k++) {
        cr_assert_geq(t.ns[k], 0, "%s", eng_stage_names[k]);
        cr_assert_not_null(eng_stage_names[k]);
        timed += t.ns[k];
    }
    cr_assert_leq(timed, wall, "the stages took %lld ns of a %lld ns step", (long long)timed,
                  (long long)wall);
    eng_stage_times before = t;
    eng_forward_time_stages(e.st, NULL);
    s = (eng_step_seq){.kv = &kv, .tokens = tokens + 4, .n_tokens = 1, .pos = 5};
    fwd_step(&e, &s, 1, logits, "untimed");
    cr_assert_eq(memcmp(&before, &t, sizeof t), 0, "a detached clock still counted");
    eng_kv_release(e.kv, &kv);
    free(logits);
    fwd_close(&e);
}

/* A sequence longer than a KV block, whose blocks are not contiguous:
 * another sequence takes a block between each of its growths. */
Test(forward, long_sequence_over_scattered_blocks_matches_reference)
{
    fwd_case fc = {.label = "long"};
    fwd_engine e;
    fwd_open(&e, &fc, 16);
    int64_t V = e.vocab;
    enum { PROMPT = 40, TOTAL = 52 };
    int32_t tokens[TOTAL];
    uint64_t rng = 7;
    for (int i = 0; i < PROMPT; i++)
        tokens[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
    float *logits = malloc((size_t)((TOTAL - PROMPT + 1) * V) * sizeof *logits);
    eng_seq_kv kv = {0}, spacer = {0};
    int32_t bt = eng_kv_block_tokens(e.kv);
    cr_assert_eq(bt, 16);
    /* prefill in chunks of 16, the spacer growing by a block after each */
    for (int p = 0; p < PROMPT; p += 16) {
        int n = PROMPT - p < 16 ? PROMPT - p : 16;
        eng_step_seq s = {.kv = &kv, .tokens = tokens + p, .n_tokens = n, .pos = p};
        fwd_step(&e, &s, 1, logits, "long prefill");
        cr_assert_eq(eng_kv_reserve(e.kv, &spacer, spacer.n_blocks * bt + 1), QL_OK);
    }
    for (int d = 0; PROMPT + d < TOTAL; d++) {
        int pos = PROMPT + d;
        tokens[pos] = argmax(logits + d * V, V);
        eng_step_seq s = {.kv = &kv, .tokens = tokens + pos, .n_tokens = 1, .pos = pos};
        fwd_step(&e, &s, 1, logits + (d + 1) * V, "long decode");
        if (pos % bt == 0)
            cr_assert_eq(eng_kv_reserve(e.kv, &spacer, spacer.n_blocks * bt + 1), QL_OK);
    }
    bool scattered = false;
    for (int i = 0; i + 1 < kv.n_blocks; i++)
        scattered |= kv.blocks[i + 1] != kv.blocks[i] + 1;
    cr_assert(scattered, "the sequence's %d blocks are one run: the test means them apart",
              kv.n_blocks);
    double *ref = malloc((size_t)(TOTAL * V) * sizeof *ref);
    ref_forward(&e.ref, tokens, TOTAL, ref);
    for (int d = 0; d <= TOTAL - PROMPT; d++)
        assert_logits_close(logits + d * V, ref + (PROMPT - 1 + d) * V, V, "long sequence",
                            d ? "decode" : "prefill", PROMPT - 1 + d);
    eng_kv_release(e.kv, &kv);
    eng_kv_release(e.kv, &spacer);
    free(ref);
    free(logits);
    fwd_close(&e);
}

/* --- 2. a mixed batch: prefill chunks and decodes in the same steps ------- */

#define MB_GEN   8  /* tokens each sequence generates greedily */
#define MB_STEPS 16 /* the most steps (and logits) a sequence takes part in */

typedef struct mb_seq {
    const int32_t *prompt;
    int n_prompt;
    const int *chunks; /* prefill chunk per step; 0 sits the step out */
    int n_chunks;
    /* run state */
    int next_chunk;
    int32_t tokens[64]; /* prompt, then the generated tokens */
    int n_tokens, fed, n_gen;
    float *logits; /* MB_STEPS * vocab: the logits of each step taken part in */
    int logit_pos[MB_STEPS];
    int n_logits;
    eng_seq_kv kv;
} mb_seq;

static void mb_reset(mb_seq *s, int64_t V)
{
    memcpy(s->tokens, s->prompt, (size_t)s->n_prompt * sizeof *s->tokens);
    s->n_tokens = s->n_prompt;
    s->fed = s->n_gen = s->n_logits = s->next_chunk = 0;
    memset(&s->kv, 0, sizeof s->kv);
    if (!s->logits)
        s->logits = malloc((size_t)(MB_STEPS * V) * sizeof *s->logits);
}

static bool mb_done(const mb_seq *s)
{
    return s->next_chunk == s->n_chunks && s->n_gen == MB_GEN;
}

/* Run the sequences' schedule together, one eng_forward per step: each step
 * a sequence takes its next prefill chunk, or, once prefilled, feeds the
 * token it generated last; the last new token's logits pick the next. */
static void mb_run(fwd_engine *e, mb_seq **seqs, int n, const char *label)
{
    int64_t V = e->vocab;
    eng_step_seq step[4];
    mb_seq *who[4];
    float *logits = malloc((size_t)(4 * V) * sizeof *logits);
    for (;;) {
        bool all_done = true;
        int k = 0;
        for (int i = 0; i < n; i++) {
            mb_seq *s = seqs[i];
            if (mb_done(s))
                continue;
            all_done = false;
            int len;
            if (s->next_chunk < s->n_chunks)
                len = s->chunks[s->next_chunk++];
            else
                len = 1; /* the generated token not yet fed */
            if (len == 0)
                continue;
            cr_assert_leq(s->fed + len, s->n_tokens);
            step[k] = (eng_step_seq){
                .kv = &s->kv, .tokens = s->tokens + s->fed, .n_tokens = len, .pos = s->fed};
            who[k++] = s;
        }
        if (all_done)
            break;
        if (k == 0)
            continue;
        fwd_step(e, step, k, logits, label);
        for (int j = 0; j < k; j++) {
            mb_seq *s = who[j];
            s->fed += step[j].n_tokens;
            cr_assert_lt(s->n_logits, MB_STEPS);
            memcpy(s->logits + s->n_logits * V, logits + j * V, (size_t)V * sizeof *logits);
            s->logit_pos[s->n_logits++] = s->fed - 1;
            if (s->fed >= s->n_prompt) {
                s->tokens[s->n_tokens++] = argmax(logits + j * V, V);
                s->n_gen++;
            }
        }
    }
    free(logits);
}

static void mixed_batch_matches_each_alone(const fwd_case *fc)
{
    fwd_engine e;
    /* blocks of 4: every sequence spans several, interleaved with the others' */
    fwd_open(&e, fc, 4);
    int64_t V = e.vocab;
    static const int32_t pa[] = {259, 84, 104, 101, 32};
    static const int32_t pb[] = {259, 256, 258, 97, 98, 99, 100, 46, 10};
    static const int32_t pc[] = {259, 63};
    /* step 1: A prefills all 5, B its first 4; step 2: A decodes its first
     * token, B prefills its other 5, C all 2; then all three decode */
    static const int ca[] = {5}, cb[] = {4, 5}, cc[] = {0, 2};
    mb_seq together[3] = {{.prompt = pa, .n_prompt = 5, .chunks = ca, .n_chunks = 1},
                          {.prompt = pb, .n_prompt = 9, .chunks = cb, .n_chunks = 2},
                          {.prompt = pc, .n_prompt = 2, .chunks = cc, .n_chunks = 2}};
    mb_seq alone[3];
    memcpy(alone, together, sizeof alone);
    static const char *const names[3] = {"A", "B", "C"};

    mb_seq *all[3] = {&together[0], &together[1], &together[2]};
    for (int i = 0; i < 3; i++) {
        mb_reset(&together[i], V);
        mb_reset(&alone[i], V);
    }
    mb_run(&e, all, 3, fc->label);
    for (int i = 0; i < 3; i++) {
        mb_seq *one = &alone[i];
        mb_run(&e, &one, 1, fc->label);
    }

    char what[128];
    for (int i = 0; i < 3; i++) {
        mb_seq *t = &together[i], *a = &alone[i];
        cr_assert_eq(t->n_logits, a->n_logits);
        cr_assert_eq(t->n_tokens, t->n_prompt + MB_GEN);
        for (int j = 0; j < t->n_tokens; j++)
            cr_assert_eq(t->tokens[j], a->tokens[j],
                         "%s: sequence %s's token %d is %d in the batch, %d alone", fc->label,
                         names[i], j, t->tokens[j], a->tokens[j]);
        /* the batch against the sequence alone, then both against the reference */
        double *ref = malloc((size_t)(t->n_tokens * V) * sizeof *ref);
        ref_forward(&e.ref, t->tokens, t->fed, ref);
        double *alone64 = malloc((size_t)V * sizeof *alone64);
        for (int j = 0; j < t->n_logits; j++) {
            int pos = t->logit_pos[j];
            cr_assert_eq(pos, a->logit_pos[j]);
            const float *lt = t->logits + j * V, *la = a->logits + j * V;
            for (int64_t x = 0; x < V; x++)
                alone64[x] = la[x];
            snprintf(what, sizeof what, "sequence %s batched vs alone", names[i]);
            assert_logits_close(lt, alone64, V, fc->label, what, pos);
            /* every row takes the same arithmetic at any batch size, so the
             * batch changes no bit (and no sampled token) of a sequence */
            for (int64_t x = 0; x < V; x++)
                cr_assert(same_bits(lt[x], la[x]),
                          "%s: sequence %s at position %d, logit %ld: %.9g batched, %.9g alone "
                          "(not bit-exact)",
                          fc->label, names[i], pos, (long)x, (double)lt[x], (double)la[x]);
            snprintf(what, sizeof what, "sequence %s batched", names[i]);
            assert_logits_close(lt, ref + pos * V, V, fc->label, what, pos);
            snprintf(what, sizeof what, "sequence %s alone", names[i]);
            assert_logits_close(la, ref + pos * V, V, fc->label, what, pos);
        }
        free(alone64);
        free(ref);
        eng_kv_release(e.kv, &t->kv);
        eng_kv_release(e.kv, &a->kv);
        free(t->logits);
        free(a->logits);
    }
    cr_assert_eq(eng_kv_free_blocks(e.kv), eng_kv_total_blocks(e.kv), "every block came back");
    fwd_close(&e);
}

Test(forward, mixed_batch_bf16_matches_each_alone)
{
    fwd_case fc = {.label = "mixed bf16"};
    mixed_batch_matches_each_alone(&fc);
}

Test(forward, mixed_batch_nf4_matches_each_alone)
{
    fwd_case fc = {.label = "mixed nf4", .quant = "nf4"};
    mixed_batch_matches_each_alone(&fc);
}

Test(forward, mixed_batch_gguf_q4_0_matches_each_alone)
{
    fwd_case fc = {.label = "mixed q4_0", .gguf = true, .gguf_kind = QT_Q4_0};
    mixed_batch_matches_each_alone(&fc);
}

Test(forward, mixed_batch_scalar_kernels_fp4_matches_each_alone)
{
    fwd_case fc = {.label = "mixed fp4 scalar", .quant = "fp4", .scalar = true};
    mixed_batch_matches_each_alone(&fc);
}

Test(forward, mixed_batch_qwen2_int8_matches_each_alone)
{
    fwd_case fc = {.label = "mixed qwen2 int8", .arch = "Qwen2ForCausalLM", .quant = "int8"};
    mixed_batch_matches_each_alone(&fc);
}

/* --- 3. shared prompts: forks with copy on write, every row's logits ----- */

/* The CPU backend over e's model (its own KV cache: the one the
 * scheduler uses, with eng_backend_copy_blocks). */
static eng_backend *cpu_backend(fwd_engine *e)
{
    char msg[512];
    eng_backend_opts o = {.device = ENG_DEVICE_CPU,
                          .threads = 2,
                          .max_tokens = FWD_MAX_TOKEN,
                          .max_seqs = 4,
                          .kv_bytes = FWD_KV_BYTES,
                          .block_tokens = 16};
    eng_backend *b = NULL;
    cr_assert_eq(eng_backend_new(&b, &e->m, &o, msg, sizeof msg), QL_OK, "%s", msg);
    return b;
}

static void backend_step(eng_backend *b, const eng_step_seq *seqs, int32_t n, float *logits,
                         const char *label)
{
    char msg[512] = "";
    int rc = eng_backend_forward(b, seqs, n, logits, NULL, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s: %s (%s)", label, msg, ql_strerror(rc));
}

static void assert_same_bits(const float *got, const float *want, int64_t n, const char *what,
                             int pos)
{
    for (int64_t x = 0; x < n; x++)
        cr_assert(same_bits(got[x], want[x]), "%s at position %d, logit %ld: %.9g, want %.9g", what,
                  pos, (long)x, (double)got[x], (double)want[x]);
}

/*
 * A source prefills 21 tokens (a full block and a partial one); two forks
 * take its blocks by reference and the three decode different tokens in
 * the same steps, each write prepared (copy on write) and the copies made
 * before the step. The first fork must give, bit for bit, what a sequence
 * that prefilled the prompt itself gives on the same tokens; the source
 * and the second fork must match the reference on theirs (a missed copy
 * would have one write into another's block).
 */
static void forks_decode_as_if_prefilled_alone(const fwd_case *fc)
{
    enum { PROMPT = 21, STEPS = 14, TOTAL = PROMPT + STEPS }; /* past 32: a fork-grown block */
    fwd_engine e;
    fwd_open(&e, fc, 16);
    int64_t V = e.vocab;
    eng_backend *b = cpu_backend(&e);
    eng_kv_cache *kv = eng_backend_kv(b);
    uint64_t rng = 21;
    int32_t tok[3][TOTAL]; /* the source's, the first fork's, the second's */
    for (int i = 0; i < TOTAL; i++) {
        tok[0][i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        for (int f = 1; f < 3; f++)
            tok[f][i] = i < PROMPT ? tok[0][i] : (int32_t)(test_rand(&rng) % (uint64_t)V);
    }
    float *logits = malloc((size_t)(4 * V) * sizeof *logits);
    float *got = malloc((size_t)(3 * STEPS * V) * sizeof *got);
    float *alone = malloc((size_t)(STEPS * V) * sizeof *alone);
    eng_seq_kv seq[3] = {{0}, {0}, {0}}, solo = {0};

    // the source's prefill, and the holds for two forks and its own copy
    cr_assert_eq(eng_kv_reserve(kv, &seq[0], TOTAL), QL_OK);
    eng_step_seq s = {.kv = &seq[0], .tokens = tok[0], .n_tokens = PROMPT, .pos = 0};
    backend_step(b, &s, 1, logits, "source prefill");
    cr_assert_eq(seq[0].n_tokens, PROMPT);
    int32_t per_fork = eng_kv_fork_blocks(kv, PROMPT, TOTAL);
    cr_assert_eq(per_fork, 2, "the partial block's copy and the block for positions 32+");
    cr_assert_eq(eng_kv_hold(kv, &seq[0], 2 * per_fork + 1), QL_OK);
    for (int f = 1; f < 3; f++)
        cr_assert_eq(eng_kv_fork(kv, &seq[f], &seq[0], TOTAL), QL_OK);
    cr_assert_eq(eng_kv_shared_blocks(kv), 2);

    // a write into the shared partial block without its copy is refused
    for (int f = 0; f < 3; f++) {
        eng_step_seq bad = {.kv = &seq[f], .tokens = tok[f] + PROMPT, .n_tokens = 1, .pos = PROMPT};
        char msg[256] = "";
        cr_assert_eq(eng_backend_forward(b, &bad, 1, logits, NULL, msg, sizeof msg), QL_EINVAL,
                     "sequence %d wrote into a shared block", f);
        cr_assert(strstr(msg, "shared"), "'%s' says why", msg);
        cr_assert_eq(seq[f].n_tokens, PROMPT, "the refused step changed n_tokens");
    }

    // decode: all three in every step, copies first
    int copied = 0;
    for (int d = 0; d < STEPS; d++) {
        eng_kv_copy copies[8];
        int32_t n_copies = 0;
        eng_step_seq step[3];
        for (int f = 0; f < 3; f++) {
            cr_assert_eq(eng_kv_prepare_write(kv, &seq[f], PROMPT + d, 1, copies, 8, &n_copies),
                         QL_OK);
            step[f] = (eng_step_seq){
                .kv = &seq[f], .tokens = tok[f] + PROMPT + d, .n_tokens = 1, .pos = PROMPT + d};
        }
        char msg[256] = "";
        cr_assert_eq(eng_backend_copy_blocks(b, copies, n_copies, msg, sizeof msg), QL_OK, "%s",
                     msg);
        copied += n_copies;
        backend_step(b, step, 3, logits, "forks decode");
        for (int f = 0; f < 3; f++)
            memcpy(got + ((size_t)f * STEPS + (size_t)d) * (size_t)V, logits + f * V,
                   (size_t)V * sizeof *logits);
    }
    cr_assert_eq(copied, 2, "the partial block copied for two of its three sharers");
    cr_assert_eq(eng_kv_shared_blocks(kv), 1, "the full first block is shared still");

    // the same prompt prefilled by a sequence of its own, then the first fork's tokens
    cr_assert_eq(eng_kv_reserve(kv, &solo, TOTAL), QL_OK);
    s = (eng_step_seq){.kv = &solo, .tokens = tok[1], .n_tokens = PROMPT, .pos = 0};
    backend_step(b, &s, 1, logits, "alone prefill");
    for (int d = 0; d < STEPS; d++) {
        s = (eng_step_seq){
            .kv = &solo, .tokens = tok[1] + PROMPT + d, .n_tokens = 1, .pos = PROMPT + d};
        backend_step(b, &s, 1, alone + d * V, "alone decode");
        assert_same_bits(got + ((size_t)STEPS + (size_t)d) * (size_t)V, alone + d * V, V,
                         "the fork against a sequence that prefilled alone", PROMPT + d);
    }
    double *ref = malloc((size_t)(TOTAL * V) * sizeof *ref);
    for (int f = 0; f < 3; f += 2) {
        ref_forward(&e.ref, tok[f], TOTAL, ref);
        for (int d = 0; d < STEPS; d++)
            assert_logits_close(got + ((size_t)f * STEPS + (size_t)d) * (size_t)V,
                                ref + (PROMPT + d) * V, V, fc->label,
                                f ? "second fork" : "source after forks", PROMPT + d);
    }
    for (int f = 0; f < 3; f++)
        eng_kv_release(kv, &seq[f]);
    eng_kv_release(kv, &solo);
    cr_assert_eq(eng_kv_free_blocks(kv), eng_kv_total_blocks(kv), "every block came back");
    cr_assert_eq(eng_kv_shared_blocks(kv), 0);
    free(ref);
    free(alone);
    free(got);
    free(logits);
    eng_backend_free(b);
    fwd_close(&e);
}

Test(forward, forks_decode_as_if_prefilled_alone_bf16)
{
    fwd_case fc = {.label = "forks bf16"};
    forks_decode_as_if_prefilled_alone(&fc);
}

Test(forward, forks_decode_as_if_prefilled_alone_q4_0)
{
    fwd_case fc = {.label = "forks q4_0", .gguf = true, .gguf_kind = QT_Q4_0};
    forks_decode_as_if_prefilled_alone(&fc);
}

Test(forward, backend_copy_blocks_refuses_blocks_outside_the_cache)
{
    fwd_case fc = {.label = "copy refusals"};
    fwd_engine e;
    fwd_open(&e, &fc, 16);
    eng_backend *b = cpu_backend(&e);
    int32_t total = eng_kv_total_blocks(eng_backend_kv(b));
    eng_kv_copy bad[][2] = {{{0, 1}, {2, total}}, {{-1, 0}, {0, 1}}, {{3, 3}, {0, 1}}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char msg[256] = "";
        cr_assert_eq(eng_backend_copy_blocks(b, bad[i], 2, msg, sizeof msg), QL_EINVAL);
        cr_assert(strstr(msg, "block"), "'%s' names the block", msg);
    }
    char msg[256] = "";
    cr_assert_eq(eng_backend_copy_blocks(b, NULL, 0, msg, sizeof msg), QL_OK, "none to copy");
    eng_backend_free(b);
    fwd_close(&e);
}

/*
 * all_logits: a prompt's rows in one step (the second chunk of a prefill,
 * beside another sequence's decode so its rows start mid-batch) against
 * the same positions fed one at a time, bit for bit; its last row is the
 * step's row for it.
 */
static void all_logits_equal_one_position_at_a_time(const fwd_case *fc)
{
    enum { FIRST = 16, CHUNK = 13, N = FIRST + CHUNK };
    fwd_engine e;
    fwd_open(&e, fc, 16);
    int64_t V = e.vocab;
    uint64_t rng = 5;
    int32_t tok[N], other[4] = {7, 9, 11, 13};
    for (int i = 0; i < N; i++)
        tok[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
    float *rows = malloc((size_t)(CHUNK * V) * sizeof *rows);
    float *first = malloc((size_t)(FIRST * V) * sizeof *first);
    float *logits = malloc((size_t)(2 * V) * sizeof *logits);
    float *one = malloc((size_t)V * sizeof *one);
    for (int64_t i = 0; i < CHUNK * V; i++)
        rows[i] = NAN;
    eng_seq_kv a = {0}, b = {0}, c = {0};

    // b has 3 positions; a its first chunk (every row asked for too)
    eng_step_seq s[2] = {
        {.kv = &b, .tokens = other, .n_tokens = 3, .pos = 0},
        {.kv = &a, .tokens = tok, .n_tokens = FIRST, .pos = 0, .all_logits = first}};
    fwd_step(&e, s, 2, logits, "first chunk");
    assert_same_bits(first + (FIRST - 1) * V, logits + V, V, "the first chunk's last row",
                     FIRST - 1);
    // b decodes while a's second chunk gives every row
    s[0] = (eng_step_seq){.kv = &b, .tokens = other + 3, .n_tokens = 1, .pos = 3};
    s[1] = (eng_step_seq){
        .kv = &a, .tokens = tok + FIRST, .n_tokens = CHUNK, .pos = FIRST, .all_logits = rows};
    fwd_step(&e, s, 2, logits, "second chunk");
    assert_same_bits(rows + (CHUNK - 1) * V, logits + V, V, "all_logits' last row vs the step's",
                     N - 1);
    // c feeds the same tokens one position at a time
    for (int p = 0; p < N; p++) {
        eng_step_seq q = {.kv = &c, .tokens = tok + p, .n_tokens = 1, .pos = p};
        fwd_step(&e, &q, 1, one, "one at a time");
        const float *row = p < FIRST ? first + p * V : rows + (p - FIRST) * V;
        assert_same_bits(row, one, V, "an all_logits row vs that position fed alone", p);
    }
    double *ref = malloc((size_t)(N * V) * sizeof *ref);
    ref_forward(&e.ref, tok, N, ref);
    for (int p = FIRST; p < N; p++)
        assert_logits_close(rows + (p - FIRST) * V, ref + p * V, V, fc->label, "all_logits", p);
    eng_kv_release(e.kv, &a);
    eng_kv_release(e.kv, &b);
    eng_kv_release(e.kv, &c);
    free(ref);
    free(one);
    free(logits);
    free(first);
    free(rows);
    fwd_close(&e);
}

/*
 * Speculative decoding's rows: sequences whose all_logits buffers lie end
 * to end go through the classifier as one run (walk.c's every_row_logits);
 * each row is the bits the same sequence's rows give in a step of its own,
 * and each last row (which that run gives when it heads the step) is the
 * row the step's classifier gives it. Plain decodes after them keep theirs.
 */
Test(forward, all_logits_packed_end_to_end_equal_each_sequence_alone)
{
    enum { P = 5, KA = 4, KB = 2, NS = 4 };
    fwd_case fc = {.label = "packed all_logits"};
    fwd_engine e;
    fwd_open(&e, &fc, 16);
    int64_t V = e.vocab;
    int32_t prompt[P] = {3, 1, 4, 1, 5}, ra[KA + 1] = {9, 2, 6, 5, 3}, rb[KB + 1] = {5, 8, 9},
            rc[1] = {7};
    int32_t na[NS] = {KA + 1, KB + 1, 1, 1};
    const int32_t *toks[NS] = {ra, rb, rc, rc};
    eng_seq_kv kv[2][NS];
    memset(kv, 0, sizeof kv);
    float *packed = malloc((size_t)((KA + KB + 2) * V) * sizeof *packed);
    float *alone = malloc((size_t)((KA + 1) * V) * sizeof *alone);
    float *logits = malloc((size_t)(NS * V) * sizeof *logits);
    float *one = malloc((size_t)V * sizeof *one);
    for (int set = 0; set < 2; set++)
        for (int i = 0; i < NS; i++) { /* every sequence's prompt first */
            eng_step_seq q = {.kv = &kv[set][i], .tokens = prompt, .n_tokens = P, .pos = 0};
            fwd_step(&e, &q, 1, one, "prompt");
        }
    /* a and b drafting, their rows packed end to end (one run); c and d plain */
    eng_step_seq s[NS];
    float *at = packed;
    for (int i = 0; i < NS; i++) {
        s[i] = (eng_step_seq){.kv = &kv[0][i], .tokens = toks[i], .n_tokens = na[i], .pos = P};
        if (i < 2) {
            s[i].all_logits = at;
            at += na[i] * V;
        }
    }
    fwd_step(&e, s, NS, logits, "packed step");
    at = packed;
    for (int i = 0; i < NS; i++) {
        eng_step_seq q = {.kv = &kv[1][i],
                          .tokens = toks[i],
                          .n_tokens = na[i],
                          .pos = P,
                          .all_logits = i < 2 ? alone : NULL};
        fwd_step(&e, &q, 1, one, "alone");
        assert_same_bits(logits + i * V, one, V, "a sequence's row, packed vs alone", i);
        q.all_logits = NULL; /* the same step again, its last row from the step's classifier */
        fwd_step(&e, &q, 1, one, "alone, no rows asked");
        assert_same_bits(logits + i * V, one, V, "a last row, packed vs the classifier's", i);
        for (int j = 0; i < 2 && j < na[i]; j++)
            assert_same_bits(at + j * V, alone + j * V, V, "a drafting row, packed vs alone", j);
        at += i < 2 ? na[i] * V : 0;
    }
    for (int set = 0; set < 2; set++)
        for (int i = 0; i < NS; i++)
            eng_kv_release(e.kv, &kv[set][i]);
    free(one);
    free(logits);
    free(alone);
    free(packed);
    fwd_close(&e);
}

Test(forward, all_logits_equal_one_position_at_a_time_bf16)
{
    fwd_case fc = {.label = "all_logits bf16"};
    all_logits_equal_one_position_at_a_time(&fc);
}

Test(forward, all_logits_equal_one_position_at_a_time_nf4_quantized_head)
{
    fwd_case fc = {.label = "all_logits nf4", .quant = "nf4", .quantize_lm_head = true};
    all_logits_equal_one_position_at_a_time(&fc);
}

Test(forward, all_logits_equal_one_position_at_a_time_gguf_q8_0_tied)
{
    fwd_case fc = {.label = "all_logits q8_0", .gguf = true, .gguf_kind = QT_Q8_0, .tie = true};
    all_logits_equal_one_position_at_a_time(&fc);
}

/* --- 4. the KV cache and the forward pass's refusals -------------------- */

/* Bytes of one block: K and V, f32, for every layer and kv head. */
static size_t block_bytes(const eng_config *c, int32_t block_tokens)
{
    return (size_t)block_tokens * (size_t)c->n_layers * (size_t)c->n_kv_heads *
           (size_t)c->head_dim * 2 * sizeof(float);
}

Test(forward, kv_cache_hands_out_whole_blocks_and_takes_them_back)
{
    char path[700], msg[512] = "";
    fwd_case fc = {.label = "kv"};
    make_model(&fc, path, sizeof path);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    size_t bb = block_bytes(&m.cfg, 16);

    eng_kv_cache *kv = NULL;
    cr_assert_neq(eng_kv_new(&kv, &m.cfg, bb - 1, 16, msg, sizeof msg), QL_OK,
                  "an arena too small for one block is refused");
    cr_assert(msg[0], "with a message");
    cr_assert_eq(eng_kv_new(&kv, &m.cfg, 4 * bb, 0, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(eng_kv_block_tokens(kv), 16, "block_tokens 0 means 16");
    cr_assert_eq(eng_kv_total_blocks(kv), 4, "4 blocks' bytes hold 4 blocks");
    cr_assert_eq(eng_kv_free_blocks(kv), 4);
    cr_assert_eq(eng_kv_blocks_for(kv, 0), 0);
    cr_assert_eq(eng_kv_blocks_for(kv, 1), 1);
    cr_assert_eq(eng_kv_blocks_for(kv, 16), 1);
    cr_assert_eq(eng_kv_blocks_for(kv, 17), 2);
    cr_assert_eq(eng_kv_blocks_for(kv, 64), 4);

    eng_seq_kv a = {0}, b = {0};
    cr_assert_eq(eng_kv_reserve(kv, &a, 17), QL_OK);
    cr_assert_eq(a.n_blocks, 2);
    cr_assert_eq(eng_kv_free_blocks(kv), 2);
    cr_assert_eq(eng_kv_reserve(kv, &a, 20), QL_OK, "room within the last block");
    cr_assert_eq(a.n_blocks, 2);
    cr_assert_eq(eng_kv_reserve(kv, &a, 5), QL_OK, "reserving less keeps what is held");
    cr_assert_eq(a.n_blocks, 2);
    cr_assert_eq(eng_kv_free_blocks(kv), 2);

    /* a request that does not fit takes nothing, from a new sequence or a
     * growing one */
    cr_assert_eq(eng_kv_reserve(kv, &b, 48), QL_ENOMEM);
    cr_assert_eq(b.n_blocks, 0);
    cr_assert_eq(eng_kv_free_blocks(kv), 2);
    cr_assert_eq(eng_kv_reserve(kv, &b, 16), QL_OK);
    cr_assert_eq(eng_kv_reserve(kv, &a, 64), QL_ENOMEM);
    cr_assert_eq(a.n_blocks, 2, "a failed growth keeps the blocks held");
    cr_assert_eq(eng_kv_free_blocks(kv), 1);
    cr_assert_eq(eng_kv_reserve(kv, &a, 48), QL_OK, "the last block");
    cr_assert_eq(eng_kv_free_blocks(kv), 0);
    cr_assert_eq(eng_kv_reserve(kv, &b, 17), QL_ENOMEM, "full");
    cr_assert_eq(b.n_blocks, 1);

    /* every block is held by exactly one sequence */
    int owner[4] = {0, 0, 0, 0};
    for (int i = 0; i < a.n_blocks; i++) {
        cr_assert(a.blocks[i] >= 0 && a.blocks[i] < 4, "block id %d", a.blocks[i]);
        owner[a.blocks[i]]++;
    }
    for (int i = 0; i < b.n_blocks; i++) {
        cr_assert(b.blocks[i] >= 0 && b.blocks[i] < 4, "block id %d", b.blocks[i]);
        owner[b.blocks[i]]++;
    }
    for (int i = 0; i < 4; i++)
        cr_assert_eq(owner[i], 1, "block %d held %d times", i, owner[i]);

    eng_kv_release(kv, &a);
    cr_assert_eq(a.n_blocks, 0);
    cr_assert_eq(a.n_tokens, 0);
    cr_assert_null(a.blocks, "release zeroes the sequence");
    cr_assert_eq(eng_kv_free_blocks(kv), 3);
    cr_assert_eq(eng_kv_reserve(kv, &b, 64), QL_OK, "released blocks are handed out again");
    cr_assert_eq(eng_kv_free_blocks(kv), 0);
    eng_kv_release(kv, &b);
    cr_assert_eq(eng_kv_free_blocks(kv), 4);
    eng_kv_release(kv, &b); /* releasing an empty sequence is harmless */
    cr_assert_eq(eng_kv_free_blocks(kv), 4);
    eng_kv_free(kv);
    eng_model_free(&m);
}

/* A refused step: nonzero, a message (naming `expect` when given), and the
 * KV bookkeeping untouched. */
static void assert_refused(fwd_engine *e, const eng_step_seq *seqs, int32_t n, float *logits,
                           const char *why, const char *expect)
{
    char msg[1024] = "";
    int32_t before[4];
    for (int32_t i = 0; i < n; i++)
        before[i] = seqs[i].kv->n_tokens;
    int32_t free_before = eng_kv_free_blocks(e->kv);
    int rc = eng_forward(e->st, &e->m, e->kv, e->pool, seqs, n, logits, msg, sizeof msg);
    cr_assert_neq(rc, QL_OK, "%s: eng_forward accepted it", why);
    cr_assert(msg[0], "%s: refused (%s) without a message", why, ql_strerror(rc));
    if (expect)
        cr_assert(strstr(msg, expect), "%s: '%s' lacks '%s'", why, msg, expect);
    for (int32_t i = 0; i < n; i++)
        cr_assert_eq(seqs[i].kv->n_tokens, before[i], "%s: sequence %d's n_tokens changed", why, i);
    cr_assert_eq(eng_kv_free_blocks(e->kv), free_before, "%s: KV blocks taken or given", why);
}

Test(forward, refuses_bad_steps_without_harming_other_sequences)
{
    fwd_case fc = {.label = "refusals", .config = "{\"max_position_embeddings\": 24}"};
    fwd_engine e;
    fwd_open(&e, &fc, 16);
    int64_t V = e.vocab;
    cr_assert_eq(e.m.cfg.max_position_embeddings, 24);
    int32_t tokens[32];
    uint64_t rng = 11;
    for (int i = 0; i < 32; i++)
        tokens[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
    float *logits = malloc((size_t)(2 * V) * sizeof *logits);
    float *keep = malloc((size_t)(8 * V) * sizeof *keep);
    int kept_pos[8], n_kept = 0;

    /* A: 10 positions written; B: one block reserved, 6 written */
    eng_seq_kv a = {0}, b = {0};
    eng_step_seq sa = {.kv = &a, .tokens = tokens, .n_tokens = 10, .pos = 0};
    fwd_step(&e, &sa, 1, keep, "A prefill");
    kept_pos[n_kept++] = 9;
    int32_t other[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    eng_step_seq sb = {.kv = &b, .tokens = other, .n_tokens = 6, .pos = 0};
    fwd_step(&e, &sb, 1, logits, "B prefill");
    cr_assert_eq(b.n_blocks, 1);

    /* B writing past its reserved block, in a step with A's next tokens */
    eng_step_seq bad[2] = {{.kv = &a, .tokens = tokens + 10, .n_tokens = 2, .pos = 10},
                           {.kv = &b, .tokens = other + 6, .n_tokens = 11, .pos = 6}};
    cr_assert_eq(eng_kv_reserve(e.kv, &a, 12), QL_OK);
    assert_refused(&e, bad, 2, logits, "positions past the reserved KV", "reserved");

    /* a token id outside the vocabulary, either side */
    int32_t oov[2] = {5, (int32_t)V};
    bad[1] = (eng_step_seq){.kv = &b, .tokens = oov, .n_tokens = 2, .pos = 6};
    assert_refused(&e, bad, 2, logits, "token id == vocab_size", "vocabulary");
    oov[1] = -1;
    assert_refused(&e, bad, 2, logits, "token id -1", "vocabulary");

    /* a position after a gap: B has 6 cached, writing at 8 would attend to
     * positions 6 and 7 that hold nothing */
    bad[1] = (eng_step_seq){.kv = &b, .tokens = other + 8, .n_tokens = 2, .pos = 8};
    assert_refused(&e, bad, 2, logits, "a gap before the new positions", NULL);

    /* more new tokens than the forward state was sized for: three fresh
     * sequences of 22 (each inside the context), 66 in all */
    enum { N = 22 };
    cr_assert_gt(3 * N, FWD_MAX_TOKEN);
    eng_seq_kv c[3] = {{0}, {0}, {0}};
    eng_step_seq big[3];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(eng_kv_reserve(e.kv, &c[i], N), QL_OK);
        big[i] = (eng_step_seq){.kv = &c[i], .tokens = tokens + i, .n_tokens = N, .pos = 0};
    }
    float *out = malloc((size_t)(3 * V) * sizeof *out);
    assert_refused(&e, big, 3, out, "more tokens than max_tokens", NULL);
    for (int i = 0; i < 3; i++)
        eng_kv_release(e.kv, &c[i]);
    free(out);

    /* A goes on as if nothing had happened: 10..11, then 12..20 */
    sa = (eng_step_seq){.kv = &a, .tokens = tokens + 10, .n_tokens = 2, .pos = 10};
    fwd_step(&e, &sa, 1, keep + n_kept * V, "A after refusals");
    kept_pos[n_kept++] = 11;
    sa = (eng_step_seq){.kv = &a, .tokens = tokens + 12, .n_tokens = 9, .pos = 12};
    fwd_step(&e, &sa, 1, keep + n_kept * V, "A to 21");
    kept_pos[n_kept++] = 20;

    /* past the context (24): A at 21 with 4 tokens is refused, with 3 taken */
    cr_assert_eq(eng_kv_reserve(e.kv, &a, 32), QL_OK);
    sa = (eng_step_seq){.kv = &a, .tokens = tokens + 21, .n_tokens = 4, .pos = 21};
    assert_refused(&e, &sa, 1, logits, "positions past max_position_embeddings", "context");
    sa.n_tokens = 3;
    fwd_step(&e, &sa, 1, keep + n_kept * V, "A to the context's end");
    kept_pos[n_kept++] = 23;

    double *ref = malloc((size_t)(24 * V) * sizeof *ref);
    ref_forward(&e.ref, tokens, 24, ref);
    for (int i = 0; i < n_kept; i++)
        assert_logits_close(keep + i * V, ref + kept_pos[i] * V, V, "sequence A",
                            "after refused steps", kept_pos[i]);

    /* and B, whose bad steps were refused, still continues correctly */
    sb = (eng_step_seq){.kv = &b, .tokens = other + 6, .n_tokens = 4, .pos = 6};
    fwd_step(&e, &sb, 1, logits, "B after refusals");
    ref_forward(&e.ref, other, 10, ref);
    assert_logits_close(logits, ref + 9 * V, V, "sequence B", "after refused steps", 9);

    eng_kv_release(e.kv, &a);
    eng_kv_release(e.kv, &b);
    free(ref);
    free(keep);
    free(logits);
    fwd_close(&e);
}

/* --- 5. the worker pool ----------------------------------------------------- */

typedef struct cover_ctx {
    atomic_int *hits;
    int64_t n;
    atomic_int bad_ranges;
} cover_ctx;

static void cover(void *ctx, int64_t begin, int64_t end)
{
    cover_ctx *c = ctx;
    if (begin < 0 || end > c->n || begin > end) {
        atomic_fetch_add(&c->bad_ranges, 1);
        return;
    }
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add(&c->hits[i], 1);
}

static void pool_covers_every_index_once(int threads)
{
    eng_pool *p = NULL;
    char msg[256];
    cr_assert_eq(eng_pool_new(&p, threads, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(eng_pool_threads(p), threads);
    static const int64_t ns[] = {0, 1, 2, 3, 7, 64, 100, 1000, 4097};
    static const int64_t grains[] = {1, 2, 3, 16, 64, 1000, 5000};
    atomic_int *hits = malloc(4097 * sizeof *hits);
    for (int rep = 0; rep < 20; rep++) {
        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++) {
            for (size_t g = 0; g < sizeof grains / sizeof *grains; g++) {
                int64_t n = ns[a];
                for (int64_t i = 0; i < n; i++)
                    atomic_init(&hits[i], 0);
                cover_ctx c = {.hits = hits, .n = n};
                atomic_init(&c.bad_ranges, 0);
                eng_pool_run(p, cover, &c, n, grains[g]);
                cr_assert_eq(atomic_load(&c.bad_ranges), 0,
                             "%d threads, n %ld, grain %ld: a range outside [0, n)", threads,
                             (long)n, (long)grains[g]);
                for (int64_t i = 0; i < n; i++)
                    cr_assert_eq(atomic_load(&hits[i]), 1,
                                 "%d threads, n %ld, grain %ld: index %ld run %d times", threads,
                                 (long)n, (long)grains[g], (long)i, atomic_load(&hits[i]));
            }
        }
    }
    free(hits);
    eng_pool_free(p);
}

Test(forward, pool_of_one_thread_covers_every_index_once)
{
    pool_covers_every_index_once(1);
}

Test(forward, pool_of_three_threads_covers_every_index_once)
{
    pool_covers_every_index_once(3);
}

/* More threads than this machine's cores: workers join late or never, and
 * jobs close and open while they race to join; every index still runs
 * once, and no job's chunk runs under another job's parameters. */
Test(forward, pool_of_sixteen_threads_covers_every_index_once)
{
    pool_covers_every_index_once(16);
}

static double cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Every index once, each chunk first sleeping `ms`: long enough that the
 * caller gives up spinning and sleeps until the last chunk is done. */
typedef struct slow_ctx {
    atomic_int *hits;
    int ms;
} slow_ctx;

static void slow_cover(void *ctx, int64_t begin, int64_t end)
{
    slow_ctx *c = ctx;
    test_sleep_ms(c->ms);
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add(&c->hits[i], 1);
}

/* The pool's threads spin only briefly for the next job (200 us), then
 * sleep: an idle pool costs no CPU, and jobs posted after a pause (which
 * must wake the sleepers) or chunks slower than the spin (the caller
 * sleeps for them) still run every index once. */
Test(forward, pool_sleeps_when_idle_and_wakes_for_work)
{
    eng_pool *p = NULL;
    char msg[256];
    cr_assert_eq(eng_pool_new(&p, 3, msg, sizeof msg), QL_OK, "%s", msg);
    atomic_int hits[64];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 64; i++)
            atomic_init(&hits[i], 0);
        slow_ctx c = {hits, round % 2 ? 2 : 0};
        eng_pool_run(p, slow_cover, &c, 64, 1);
        for (int i = 0; i < 64; i++)
            cr_assert_eq(atomic_load(&hits[i]), 1, "round %d: index %d run %d times", round, i,
                         atomic_load(&hits[i]));
        /* idle: three threads spinning through this would burn ~0.9 s of CPU */
        double cpu0 = cpu_seconds();
        test_sleep_ms(300);
        double idle_cpu = cpu_seconds() - cpu0;
        cr_assert_lt(idle_cpu, 0.1, "round %d: an idle pool used %.3f s of CPU in 0.3 s", round,
                     idle_cpu);
    }
    eng_pool_free(p);
}

Test(forward, pool_of_zero_threads_uses_the_machine)
{
    eng_pool *p = NULL;
    char msg[256];
    cr_assert_eq(eng_pool_new(&p, 0, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_geq(eng_pool_threads(p), 1);
    eng_pool_free(p);
}

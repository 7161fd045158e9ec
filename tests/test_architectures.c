/*
 * test_architectures.c - every model family against its reference logits,
 * one table row per (family, file format): the tiny random models that
 * tests/fixtures/make_*_reference.py made with transformers, loaded from
 * their safetensors folders (with the tiny byte-level tokenizer: the test
 * feeds ids, so any 260-token vocabulary does) and from llama.cpp's
 * convert_hf_to_gguf.py conversions of them, give at every position of the
 * fixture's prompt the logits transformers computes in float64, within the
 * row's tolerance (1e-5 absolute: our pass is float32, the logits O(1);
 * measured 7e-7 for Qwen3). A new family is a row: its fixture, its
 * reference header, what its config must say, and the features whose
 * removal must move the logits (each turned off alone must move them past
 * the row's `moved`, so the test sees each).
 *
 * The Llama, Qwen2 and Mistral shapes are test_forward.c's (tiny models of
 * every weight kind against the float64 reference of ref_forward.h, itself
 * checked once against transformers); what is not "these logits equal those"
 * stays with its family: Phi-3's longrope factor choice, fused-tensor
 * splits and adapters in test_phi3.c, Gemma's adapter and refused configs
 * in test_gemma.c, Llama 3's rope_freqs in test_rope_freqs.c.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures/gemma_reference.h"
#include "fixtures/moe_reference.h"
#include "fixtures/phi3_reference.h"
#include "fixtures/qwen3_reference.h"
#include "model.h"
#include "modelfile.h"
#include "ref_forward.h"
#include "run_prompt.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

/* A feature of the family, turned off in the loaded config. */
typedef struct arch_feature {
    const char *what;
    void (*off)(eng_config *c);
} arch_feature;

enum { ARCH_MAX_FEATURES = 4 };

typedef struct arch_row {
    const char *label;
    const char *fixture; /* tests/fixtures/<fixture>: a folder, or a .gguf file */
    const char *source;  /* where the reference logits come from */
    const int *tokens;
    int n_tokens;
    int64_t vocab;
    /* [n_tokens][vocab], float64; NULL: ref_forward.h's float64 pass over
     * the model's own (dequantized) weights, within its relative tolerance
     * per position (for a quantized file, whose weights transformers never
     * saw) */
    const double *logits;
    const char *quant;    /* --quant on load (NULL: none) */
    int prefill;          /* tokens in the first step, the rest one a step (0: all in one) */
    int32_t block_tokens; /* the KV cache's block (0: 16) */
    double tol;           /* on the largest |ours - reference| over every logit */
    /* asserts what the loader read from the file, and sets what the file
     * cannot say (NULL: nothing) */
    void (*check)(eng_model *m);
    arch_feature features[ARCH_MAX_FEATURES]; /* .what NULL ends the list */
    double moved;                             /* each feature off moves the worst error past this */
} arch_row;

/* --- what each row's config must say ------------------------------------------------- */

static void check_qwen3_folder(eng_model *m)
{
    cr_assert_eq(m->cfg.arch, ENG_ARCH_QWEN3);
    cr_assert(m->cfg.qk_norm);
    cr_assert_eq(m->cfg.head_dim, 24);
    cr_assert_str_eq(eng_arch_name(m->cfg.arch), "qwen3");
}

static void check_qwen3_gguf(eng_model *m)
{
    cr_assert_eq(m->cfg.arch, ENG_ARCH_QWEN3);
    cr_assert(m->cfg.qk_norm);
    cr_assert_not(m->cfg.rope_interleaved, "qwen3 rows are not permuted by the converter");
    cr_assert_eq(m->cfg.head_dim, 24);
    cr_assert_eq(m->layers[1].q_norm.cols, 24);
}

static void check_gemma2_folder(eng_model *m)
{
    const eng_config *c = &m->cfg;
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
}

static void check_gemma2_gguf(eng_model *m)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA2);
    cr_assert_str_eq(m->format, "gguf");
    cr_assert_float_eq(c->norm_offset, 0.0f, 0); /* the converter stored 1 + w */
    cr_assert(!c->rope_interleaved && c->tie_word_embeddings && c->sandwich_norms);
    cr_assert_float_eq(c->attn_softcap, 2.0f, 0);
    cr_assert_float_eq(c->final_softcap, 3.0f, 0);
    cr_assert_eq(c->sliding_window, 5);
    cr_assert_eq(c->sliding_pattern, 2);
}

static void check_gemma3_folder(eng_model *m)
{
    const eng_config *c = &m->cfg;
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
}

static void check_gemma3_gguf(eng_model *m)
{
    const eng_config *c = &m->cfg;
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
    m->cfg.attn_scale = (float)(1.0 / sqrt(20.0));
}

/* The Phi-3 fixture's config: longrope with the long factors chosen (what
 * transformers' _compute_longrope_parameters makes of factor 64 / 16 and
 * the original context 16), the window, the split shapes. */
static void check_phi3(const eng_model *m, const char *format)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_PHI3);
    cr_assert_str_eq(eng_arch_name(c->arch), "phi3");
    cr_assert_eq(c->rope_scaling, ENG_ROPE_LONGROPE);
    cr_assert(c->rope_long_factors);
    cr_assert_eq(c->rope_original_max_position, 16);
    cr_assert_eq(c->max_position_embeddings, 64);
    cr_assert_eq(c->n_rope_freq_factors, 8);
    for (int i = 0; i < 8; i++)
        cr_assert_float_eq(c->rope_freq_factors[i], PHI3_LONG_FACTOR[i], 1e-6, "factor %d", i);
    cr_assert_float_eq(c->rope_attn_factor, sqrt(1.0 + log(64.0 / 16.0) / log(16.0)), 1e-6);
    cr_assert_eq(c->sliding_window, 20);
    cr_assert_not(c->rope_interleaved, "phi3 rows stay as Hugging Face has them");
    cr_assert_str_eq(m->format, format);
    const eng_layer *L = &m->layers[1];
    cr_assert_eq(L->wq.rows, 64);
    cr_assert_eq(L->wk.rows, 32);
    cr_assert_eq(L->wv.rows, 32);
    cr_assert_eq(L->w_gate.rows, 96);
    cr_assert_eq(L->w_up.rows, 96);
    cr_assert_eq(L->wq.cols, 64);
}

static void check_phi3_folder(eng_model *m)
{
    check_phi3(m, "safetensors");
}

static void check_phi3_gguf(eng_model *m)
{
    check_phi3(m, "gguf");
}

/* Phi-4-mini's shape of rope: partial_rotary_factor 0.75, the leading 12
 * of 16 dims rotate (longrope factors of 6), the rest pass through. */
static void check_phi3_partial(eng_model *m)
{
    cr_assert_eq(m->cfg.rope_dim, 12);
    cr_assert_eq(m->cfg.n_rope_freq_factors, 6);
    cr_assert_float_eq(m->cfg.rope_freq_factors[5], PHI3_LONG_FACTOR[5], 1e-6);
}

/* The mixtures of experts (make_moe_reference.py: 8 experts, 2 chosen per
 * token, each 32 wide, 3 layers). */
static void check_moe(const eng_model *m, eng_arch arch, bool norm_topk)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, arch);
    cr_assert_eq(c->n_experts, 8);
    cr_assert_eq(c->n_experts_used, 2);
    cr_assert_eq(c->expert_ff, 32);
    cr_assert_eq(c->norm_topk_prob, norm_topk);
    cr_assert_eq(eng_n_proj(c), ENG_N_PROJ + 24);
    const eng_layer *L = &m->layers[2];
    cr_assert_eq(L->router.rows, 8);
    cr_assert_eq(L->router.cols, 64);
    cr_assert_eq(eng_model_proj(m, 2, eng_expert_proj(7, ENG_PROJ_DOWN))->rows, 64);
    cr_assert_eq(eng_model_proj(m, 2, eng_expert_proj(7, ENG_PROJ_DOWN))->cols, 32);
    cr_assert_eq(eng_model_proj(m, 2, eng_expert_proj(3, ENG_PROJ_UP))->rows, 32);
}

static void check_qwen3moe(eng_model *m)
{
    check_moe(m, ENG_ARCH_QWEN3_MOE, true);
    cr_assert(m->cfg.qk_norm);
    cr_assert_str_eq(eng_arch_name(m->cfg.arch), "qwen3moe");
    for (int l = 0; l < 3; l++)
        cr_assert(eng_layer_is_moe(&m->cfg, l), "layer %d", l);
}

/* mlp_only_layers [1]: layer 1 is a plain MLP 48 wide */
static void check_qwen3moe_dense(eng_model *m)
{
    check_moe(m, ENG_ARCH_QWEN3_MOE, true);
    cr_assert(!eng_layer_is_moe(&m->cfg, 1) && eng_layer_is_moe(&m->cfg, 0));
    cr_assert_eq(m->layers[1].w_gate.rows, 48);
    cr_assert_eq(m->layers[1].router.rows, 0);
    cr_assert_eq(eng_model_proj(m, 1, eng_expert_proj(0, ENG_PROJ_GATE))->rows, 0);
}

static void check_qwen2moe(eng_model *m)
{
    check_moe(m, ENG_ARCH_QWEN2_MOE, false);
    cr_assert(m->cfg.attention_bias);
    cr_assert_eq(m->cfg.shared_expert_ff, 40);
    cr_assert_eq(m->layers[0].w_gate.rows, 40, "the shared expert");
    cr_assert_eq(m->layers[0].shared_gate.cols, 64);
}

static void check_mixtral(eng_model *m)
{
    check_moe(m, ENG_ARCH_MIXTRAL, true);
    cr_assert_str_eq(eng_arch_name(m->cfg.arch), "mixtral");
}

/* Every expert's weights quantized as --quant says; the router dense. */
static void check_experts_kind(const eng_model *m, qt_kind kind)
{
    for (int l = 0; l < m->cfg.n_layers; l++) {
        cr_assert_eq(m->layers[l].router.kind, QT_F32, "layer %d: the router stays dense", l);
        for (int e = 0; e < 3 * m->cfg.n_experts; e++)
            cr_assert_eq(m->layers[l].experts[e].kind, kind, "layer %d expert part %d", l, e);
    }
}

static void check_qwen3moe_nf4(eng_model *m)
{
    check_qwen3moe(m);
    check_experts_kind(m, QT_NF4);
}

static void check_mixtral_int8(eng_model *m)
{
    check_mixtral(m);
    check_experts_kind(m, QT_AFFINE);
}

/* --- the features each family's test must see ------------------------------------------ */

static void one_expert(eng_config *c)
{
    c->n_experts_used = 1;
}

static void flip_topk_norm(eng_config *c)
{
    c->norm_topk_prob = !c->norm_topk_prob;
}

static void no_qk_norm(eng_config *c)
{
    c->qk_norm = false;
}

static void no_sliding_window(eng_config *c)
{
    c->sliding_window = 0;
}

static void no_attn_softcap(eng_config *c)
{
    c->attn_softcap = 0;
}

static void no_final_softcap(eng_config *c)
{
    c->final_softcap = 0;
}

static void no_local_rope_base(eng_config *c)
{
    c->rope_local_theta = 0;
}

static void no_norm_offset(eng_config *c)
{
    c->norm_offset = 0;
}

static void no_attn_factor(eng_config *c)
{
    c->rope_attn_factor = 1.0f;
}

static void short_factors(eng_config *c)
{
    for (int i = 0; i < 8; i++)
        c->rope_freq_factors[i] = (float)PHI3_SHORT_FACTOR[i];
}

static void whole_head_rotation(eng_config *c)
{
    c->rope_dim = 0;
}

/* --- the table --------------------------------------------------------------------------- */

#define QWEN3_REF                                                                                  \
    .source = "transformers float64 (make_qwen3_reference.py)", .tokens = QWEN3_TOKENS,            \
    .n_tokens = QWEN3_N_TOKENS, .vocab = QWEN3_VOCAB, .logits = &QWEN3_LOGITS[0][0], .tol = 1e-5
/* a prefill of the first 11, then one token a step: the decode path and the
 * window's edge (5) over the cache's blocks of 4 are both seen */
#define GEMMA_REF(which)                                                                           \
    .source = "transformers float64 (make_gemma_reference.py)", .tokens = GEMMA_TOKENS,            \
    .n_tokens = GEMMA_N_TOKENS, .vocab = GEMMA_VOCAB, .logits = &which[0][0], .prefill = 11,       \
    .block_tokens = 4, .tol = 1e-5
#define PHI3_REF(which)                                                                            \
    .source = "transformers float64 (make_phi3_reference.py)", .tokens = PHI3_TOKENS,              \
    .n_tokens = PHI3_N_TOKENS, .vocab = PHI3_VOCAB, .logits = &which[0][0], .tol = 1e-5

#define MOE_REF(which)                                                                             \
    .source = "transformers float64 (make_moe_reference.py)", .tokens = which##_TOKENS,            \
    .n_tokens = which##_N_TOKENS, .vocab = which##_VOCAB, .logits = &which##_LOGITS[0][0],         \
    .prefill = 9, .block_tokens = 4, .tol = 1e-5

static const arch_row ARCH_ROWS[] = {
    {.label = "qwen3moe folder",
     .fixture = "qwen3moe_tiny",
     MOE_REF(QWEN3MOE),
     .check = check_qwen3moe,
     .features = {{"the second expert", one_expert}, {"the top-k renormalization", flip_topk_norm}},
     .moved = 1e-3},
    {.label = "qwen3moe gguf",
     .fixture = "qwen3moe_tiny.gguf",
     MOE_REF(QWEN3MOE),
     .check = check_qwen3moe},
    /* llama.cpp's own quantized files of it (llama-quantize), against the
     * float64 pass over their dequantized weights */
    {.label = "qwen3moe gguf q8_0",
     .fixture = "qwen3moe_tiny_q8_0.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = QWEN3MOE_TOKENS,
     .n_tokens = QWEN3MOE_N_TOKENS,
     .vocab = QWEN3MOE_VOCAB,
     .check = check_qwen3moe},
    {.label = "qwen3moe gguf q4_k_m",
     .fixture = "qwen3moe_tiny_q4_k_m.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = QWEN3MOE_TOKENS,
     .n_tokens = QWEN3MOE_N_TOKENS,
     .vocab = QWEN3MOE_VOCAB,
     .check = check_qwen3moe},
    /* --quant on load quantizes the experts (and leaves the router dense) */
    {.label = "qwen3moe folder --quant nf4",
     .fixture = "qwen3moe_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = QWEN3MOE_TOKENS,
     .n_tokens = QWEN3MOE_N_TOKENS,
     .vocab = QWEN3MOE_VOCAB,
     .quant = "nf4",
     .check = check_qwen3moe_nf4},
    {.label = "mixtral folder --quant int8",
     .fixture = "mixtral_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = MIXTRAL_TOKENS,
     .n_tokens = MIXTRAL_N_TOKENS,
     .vocab = MIXTRAL_VOCAB,
     .quant = "int8",
     .check = check_mixtral_int8},
    {.label = "qwen3moe with a dense layer folder",
     .fixture = "qwen3moe_dense_tiny",
     MOE_REF(QWEN3MOE_DENSE),
     .check = check_qwen3moe_dense},
    {.label = "qwen2moe folder",
     .fixture = "qwen2moe_tiny",
     MOE_REF(QWEN2MOE),
     .check = check_qwen2moe,
     .features = {{"the second expert", one_expert}, {"the top-k renormalization", flip_topk_norm}},
     .moved = 1e-3},
    {.label = "qwen2moe gguf",
     .fixture = "qwen2moe_tiny.gguf",
     MOE_REF(QWEN2MOE),
     .check = check_qwen2moe},
    {.label = "mixtral folder",
     .fixture = "mixtral_tiny",
     MOE_REF(MIXTRAL),
     .check = check_mixtral,
     .features = {{"the second expert", one_expert}},
     .moved = 1e-3},
    {.label = "mixtral gguf",
     .fixture = "mixtral_tiny.gguf",
     MOE_REF(MIXTRAL),
     .check = check_mixtral},
    {.label = "qwen3 folder",
     .fixture = "qwen3_tiny",
     QWEN3_REF,
     .check = check_qwen3_folder,
     .features = {{"the q/k norms", no_qk_norm}},
     .moved = 1e-2},
    {.label = "qwen3 gguf", .fixture = "qwen3_tiny.gguf", QWEN3_REF, .check = check_qwen3_gguf},
    {.label = "gemma2 folder",
     .fixture = "gemma2_tiny",
     GEMMA_REF(GEMMA2_LOGITS),
     .check = check_gemma2_folder,
     .features = {{"the sliding window", no_sliding_window},
                  {"the attention soft-cap", no_attn_softcap},
                  {"the final soft-cap", no_final_softcap}},
     .moved = 1e-3},
    {.label = "gemma2 gguf",
     .fixture = "gemma2_tiny.gguf",
     GEMMA_REF(GEMMA2_LOGITS),
     .check = check_gemma2_gguf},
    {.label = "gemma3 folder",
     .fixture = "gemma3_tiny",
     GEMMA_REF(GEMMA3_LOGITS),
     .check = check_gemma3_folder,
     .features = {{"the local rotary base", no_local_rope_base},
                  {"the (1 + w) norm offset", no_norm_offset},
                  {"the sliding window", no_sliding_window}},
     .moved = 1e-3},
    {.label = "gemma3 gguf",
     .fixture = "gemma3_tiny.gguf",
     GEMMA_REF(GEMMA3_LOGITS),
     .check = check_gemma3_gguf},
    {.label = "phi3 folder",
     .fixture = "phi3_tiny",
     PHI3_REF(PHI3_LOGITS),
     .check = check_phi3_folder,
     .features = {{"the attention factor", no_attn_factor},
                  {"the long factors", short_factors},
                  {"the sliding window", no_sliding_window}},
     .moved = 1e-3},
    {.label = "phi3 gguf f32",
     .fixture = "phi3_tiny.gguf",
     PHI3_REF(PHI3_LOGITS),
     .check = check_phi3_gguf},
    /* the q/k/v and gate/up rows are views into the mapped fused q8_0
     * tensors (test_phi3.c) */
    {.label = "phi3 gguf q8_0",
     .fixture = "phi3_tiny_q8_0.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = PHI3_TOKENS,
     .n_tokens = PHI3_N_TOKENS,
     .vocab = PHI3_VOCAB,
     .check = check_phi3_gguf},
    {.label = "phi3 partial rotary folder",
     .fixture = "phi3_partial_tiny",
     PHI3_REF(PHI3_PARTIAL_LOGITS),
     .check = check_phi3_partial,
     .features = {{"partial rotation", whole_head_rotation}},
     .moved = 1e-3},
    {.label = "phi3 partial rotary gguf",
     .fixture = "phi3_partial_tiny.gguf",
     PHI3_REF(PHI3_PARTIAL_LOGITS),
     .check = check_phi3_partial,
     .features = {{"partial rotation", whole_head_rotation}},
     .moved = 1e-3},
};

enum { ARCH_N_ROWS = sizeof ARCH_ROWS / sizeof *ARCH_ROWS };

/* --- the one test ------------------------------------------------------------------------ */

/* The worst logit error of m on the row's prompt (test_max_abs_err: +inf
 * when any logit is NaN or infinite). */
static double worst_error(const eng_model *m, const arch_row *row)
{
    prompt_run r = {.tokens = row->tokens,
                    .n_tokens = row->n_tokens,
                    .prefill = row->prefill,
                    .block_tokens = row->block_tokens};
    float *all = run_prompt(m, &r);
    double worst = test_max_abs_err(all, row->logits, (size_t)row->n_tokens * (size_t)row->vocab);
    free(all);
    return worst;
}

/* Every position of the row's prompt against the float64 reference pass
 * over m's own weights (assert_logits_close: relative L2 per position). */
static void against_reference_pass(const eng_model *m, const arch_row *row)
{
    ref_model R;
    ref_load(&R, m);
    double *want = malloc((size_t)row->n_tokens * (size_t)row->vocab * sizeof *want);
    ref_forward(&R, row->tokens, row->n_tokens, want);
    prompt_run r = {.tokens = row->tokens, .n_tokens = row->n_tokens, .prefill = row->prefill};
    float *all = run_prompt(m, &r);
    for (int t = 0; t < row->n_tokens; t++)
        assert_logits_close(all + (size_t)t * (size_t)row->vocab,
                            want + (size_t)t * (size_t)row->vocab, row->vocab, row->label, "logits",
                            t);
    free(all);
    free(want);
    ref_free(&R);
}

/* The row's index: a plain int crosses into Criterion's runner process
 * (its parameters are copied; the row itself is read from the table). */
ParameterizedTestParameters(architectures, logits_equal_the_reference_at_every_position)
{
    static int rows[ARCH_N_ROWS];
    for (int i = 0; i < ARCH_N_ROWS; i++)
        rows[i] = i;
    return cr_make_param_array(int, rows, ARCH_N_ROWS);
}

ParameterizedTest(int *index, architectures, logits_equal_the_reference_at_every_position,
                  .timeout = 120)
{
    const arch_row *row = &ARCH_ROWS[*index];
    char path[1024], dir[512] = "", msg[1024];
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, row->fixture);
    if (!strstr(row->fixture, ".gguf")) {
        test_tmpdir(dir, sizeof dir);
        cr_assert(dir[0]);
        tiny_fixture_folder(row->fixture, dir);
        snprintf(path, sizeof path, "%s", dir);
    }
    eng_model m;
    eng_load_opts o = {.path = path, .quant = row->quant};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s: %s", row->label, msg);
    cr_assert_eq(m.cfg.vocab_size, row->vocab, "%s: the reference's vocabulary", row->label);
    if (row->check)
        row->check(&m);

    if (!row->logits) {
        against_reference_pass(&m, row);
        eng_model_free(&m);
        return;
    }
    double worst = worst_error(&m, row);
    cr_log_info("%s: worst logit error %g against %s", row->label, worst, row->source);
    cr_assert_lt(worst, row->tol, "%s: worst logit error %g against %s", row->label, worst,
                 row->source);

    /* the test sees each feature: without it the answer is another */
    for (int f = 0; f < ARCH_MAX_FEATURES && row->features[f].what; f++) {
        eng_config keep = m.cfg;
        row->features[f].off(&m.cfg);
        double off = worst_error(&m, row);
        cr_assert_gt(off, row->moved, "%s: turning off %s changed nothing (%g)", row->label,
                     row->features[f].what, off);
        m.cfg = keep;
    }
    eng_model_free(&m);
    if (dir[0])
        test_rmtree(dir);
}

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

#include "fixtures/gemma4_dims_reference.h"
#include "fixtures/gemma4_reference.h"
#include "fixtures/gemma4_shapes_reference.h"
#include "fixtures/gemma_reference.h"
#include "fixtures/ministral3_reference.h"
#include "fixtures/moe_reference.h"
#include "fixtures/olmo3_reference.h"
#include "fixtures/phi3_reference.h"
#include "fixtures/qwen3_reference.h"
#include "fixtures/smollm3_reference.h"
#include "lora.h"
#include "lora_fixture.h"
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

enum { ARCH_MAX_FEATURES = 6 };

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

/* The Phi-3 fixture's config: longrope with both factor sets (each
 * sequence takes one) and the attention factor transformers'
 * _compute_longrope_parameters makes of factor 64 / 16 and the original
 * context 16, the window, the split shapes. The fixture's 32 tokens reach
 * past the original context: the long factors rotate them. */
static void check_phi3(const eng_model *m, const char *format)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_PHI3);
    cr_assert_str_eq(eng_arch_name(c->arch), "phi3");
    cr_assert_eq(c->rope_scaling, ENG_ROPE_LONGROPE);
    cr_assert_eq(c->rope_original_max_position, 16);
    cr_assert_eq(c->max_position_embeddings, 64);
    cr_assert_eq(c->n_rope_freq_factors, 8);
    for (int i = 0; i < 8; i++) {
        cr_assert_float_eq(c->rope_freq_factors[i], PHI3_SHORT_FACTOR[i], 1e-6, "short %d", i);
        cr_assert_float_eq(c->rope_long_freq_factors[i], PHI3_LONG_FACTOR[i], 1e-6, "long %d", i);
    }
    cr_assert(eng_rope_long_for(c, PHI3_N_TOKENS));
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
    cr_assert_float_eq(m->cfg.rope_freq_factors[5], PHI3_SHORT_FACTOR[5], 1e-6);
    cr_assert_float_eq(m->cfg.rope_long_freq_factors[5], PHI3_LONG_FACTOR[5], 1e-6);
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
    cr_assert_eq(eng_n_proj(c), ENG_PROJ_FIRST_EXPERT + 24);
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

/* GPT-OSS (make_moe_reference.py): the router's and experts' biases, the
 * sinks, o's bias, layers 0 and 2 sliding over 4 positions, the clamped
 * SwiGLU, YaRN (factor 32 over 4096, betas 32 and 1, truncate false). */
static void check_gpt_oss(eng_model *m)
{
    const eng_config *c = &m->cfg;
    check_moe(m, ENG_ARCH_GPT_OSS, true);
    cr_assert_str_eq(eng_arch_name(c->arch), "gpt-oss");
    cr_assert_eq(c->router, ENG_ROUTER_TOPK_SOFTMAX);
    cr_assert(c->router_bias && c->attention_bias && c->o_bias && c->attn_sinks);
    cr_assert_eq(c->ffn_act, ENG_FFN_SWIGLU_OAI);
    cr_assert_float_eq(c->swiglu_alpha, 1.702f, 1e-6);
    cr_assert_float_eq(c->swiglu_limit, 7.0f, 1e-6);
    cr_assert_eq(c->sliding_window, 4);
    cr_assert(eng_layer_slides(c, 0) && !eng_layer_slides(c, 1) && eng_layer_slides(c, 2));
    cr_assert_eq(c->rope_scaling, ENG_ROPE_YARN);
    cr_assert_float_eq(c->rope_factor, 32.0f, 1e-6);
    cr_assert_eq(c->rope_original_max_position, 4096);
    cr_assert_float_eq(c->rope_yarn_beta_fast, 32.0f, 1e-6);
    cr_assert_float_eq(c->rope_yarn_beta_slow, 1.0f, 1e-6);
    cr_assert(!c->rope_yarn_truncate);
    cr_assert_float_eq(c->rope_attn_factor, 0.1 * log(32.0) + 1.0, 1e-6);
    const eng_layer *L = &m->layers[1];
    cr_assert_eq(L->sinks.cols, 4);
    cr_assert_eq(L->bo.cols, 64);
    cr_assert_eq(L->router_b.cols, 8);
    cr_assert_eq(L->expert_b[0].rows, 8);
    cr_assert_eq(L->expert_b[1].cols, 32);
    cr_assert_eq(L->expert_b[2].cols, 64);
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

/* The MXFP4_MOE file: every expert MXFP4 (GGUF type 39, read in place),
 * the router dense. */
static void check_gpt_oss_mxfp4(eng_model *m)
{
    check_gpt_oss(m);
    check_experts_kind(m, QT_MXFP4);
}

/* make_moe_kquant.py's wider Qwen3-MoE (4 experts of 256): llama-quantize's
 * Q4_K_M recipe (q4_K and q6_K experts), and MXFP4_MOE (MXFP4 experts) */
static void check_kq(const eng_model *m, qt_kind down_kind)
{
    cr_assert_eq(m->cfg.arch, ENG_ARCH_QWEN3_MOE);
    cr_assert_eq(m->cfg.n_experts, 4);
    cr_assert_eq(m->cfg.expert_ff, 256);
    cr_assert_eq(eng_model_proj(m, 0, eng_expert_proj(3, ENG_PROJ_GATE))->kind,
                 down_kind == QT_MXFP4 ? QT_MXFP4 : QT_Q4_K);
    cr_assert_eq(eng_model_proj(m, 1, eng_expert_proj(2, ENG_PROJ_DOWN))->kind, down_kind);
}

static void check_kq_q4_k_m(eng_model *m)
{
    /* the recipe gives the last layer's down more bits */
    check_kq(m, QT_Q6_K);
}

static void check_kq_mxfp4(eng_model *m)
{
    check_kq(m, QT_MXFP4);
}

/* SmolLM3 (make_smollm3_reference.py): layer 3 of 5 applies no RoPE, the
 * others do; tied embeddings. The GGUF says nothing of it: llama.cpp's
 * every fourth layer, the same layers. */
static void check_smollm3(const eng_model *m, bool interleaved)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_SMOLLM3);
    cr_assert_str_eq(eng_arch_name(c->arch), "smollm3");
    cr_assert(c->tie_word_embeddings && !c->qk_norm && c->sliding_window == 0);
    cr_assert_eq(c->rope_interleaved, interleaved);
    for (int l = 0; l < 5; l++)
        cr_assert_eq(eng_layer_rotates(c, l), l != 3, "layer %d", l);
}

static void check_smollm3_folder(eng_model *m)
{
    check_smollm3(m, false);
}

static void check_smollm3_gguf(eng_model *m)
{
    check_smollm3(m, true);
}

/* Gemma 4 text (make_gemma4_reference.py): plain-weight norms in Gemma's
 * sandwich and on each head of q, k (and weightless on v), unscaled scores,
 * layers 2 and 5 full with the proportional rotation (base 1e6, 2 of 8
 * pairs turn, divided by 2), the others sliding over 5 with base 1e4, a
 * layer_scalar per layer, logits soft-capped at 30. */
static void check_gemma4(eng_model *m)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA4);
    cr_assert_str_eq(eng_arch_name(c->arch), "gemma4");
    cr_assert(c->sandwich_norms && c->qk_norm && c->v_norm && c->layer_scalar);
    cr_assert(c->tie_word_embeddings && !c->rope_interleaved);
    cr_assert_float_eq(c->norm_offset, 0.0f, 0);
    cr_assert_float_eq(c->attn_scale, 1.0f, 0);
    cr_assert_float_eq(c->attn_softcap, 0.0f, 0);
    cr_assert_float_eq(c->final_softcap, 30.0f, 0);
    cr_assert_float_eq(c->embed_scale, 8.0f, 0);
    cr_assert_eq(c->rope_scaling, ENG_ROPE_PROPORTIONAL);
    cr_assert_eq(c->rope_prop_pairs, 2);
    cr_assert_eq(c->rope_dim, 0);
    cr_assert_float_eq(c->rope_factor, 2.0f, 0);
    cr_assert_float_eq(c->rope_theta, 1e6f, 0);
    cr_assert_float_eq(c->rope_local_theta, 1e4f, 0);
    cr_assert_eq(c->sliding_window, 5);
    for (int l = 0; l < 6; l++)
        cr_assert_eq(eng_layer_slides(c, l), l != 2 && l != 5, "layer %d", l);
    cr_assert_eq(m->layers[3].layer_scalar.cols, 1);
}

/* The same with num_kv_shared_layers 2: layers 4 and 5 have no k, v or k
 * norm and attend over layers 3's and 2's caches. */
static void check_gemma4_kv_shared(eng_model *m)
{
    check_gemma4(m);
    cr_assert_eq(m->cfg.kv_shared_layers, 2);
    int32_t src[6] = {0, 1, 2, 3, 3, 2};
    for (int l = 0; l < 6; l++) {
        cr_assert_eq(eng_layer_kv_source(&m->cfg, l), src[l], "layer %d", l);
        cr_assert_eq(m->layers[l].wk.rows == 0, l >= 4, "layer %d", l);
        cr_assert_eq(m->layers[l].k_norm.rows == 0, l >= 4, "layer %d", l);
    }
}

/* The small dense Gemma 4s' shape (make_gemma4_shapes_reference.py):
 * per-layer inputs of 8 per layer, layers 4 and 5 kv-shared with an MLP
 * twice as wide (192). */
static void check_gemma4_ple(eng_model *m)
{
    check_gemma4_kv_shared(m);
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->g4.ple_dim, 8);
    cr_assert_eq(c->g4.ple_vocab, 260);
    cr_assert(c->g4.double_wide && !c->g4.k_eq_v);
    cr_assert_float_eq(c->g4.ple_embed_scale, sqrtf(8.0f), 0);
    cr_assert_eq(m->g4.ple_embed.cols, 6 * 8);
    cr_assert_eq(m->g4.ple_proj.rows, 6 * 8);
    for (int l = 0; l < 6; l++) {
        cr_assert_eq(eng_layer_ff(c, l), l >= 4 ? 192 : 96, "layer %d", l);
        cr_assert_eq(m->layers[l].w_down.cols, eng_layer_ff(c, l), "layer %d", l);
        cr_assert_eq(m->layers[l].g4.ple_gate.rows, 8, "layer %d", l);
        cr_assert_eq(m->layers[l].g4.ple_proj.cols, 8, "layer %d", l);
    }
}

/* Gemma4ForConditionalGeneration's text model (the per-layer-input shape
 * above, its tensors under model.language_model.) */
static void check_gemma4_cg(eng_model *m)
{
    check_gemma4_ple(m);
    cr_assert(m->cfg.g4.language_model);
    cr_assert(m->cfg.tie_word_embeddings && !m->lm_head.rows);
}

/* The large dense Gemma 4's shape: attention_k_eq_v, so the full layers
 * (2, 5) have no v_proj and take k's projection as their values. */
static void check_gemma4_keqv(eng_model *m)
{
    check_gemma4(m);
    const eng_config *c = &m->cfg;
    cr_assert(c->g4.k_eq_v && c->g4.ple_dim == 0 && !c->g4.double_wide);
    for (int l = 0; l < 6; l++) {
        cr_assert_eq(eng_layer_k_is_v(c, l), l == 2 || l == 5, "layer %d", l);
        cr_assert_eq(m->layers[l].wv.rows == 0, l == 2 || l == 5, "layer %d", l);
        cr_assert_eq(m->layers[l].wk.rows, 32, "layer %d", l);
    }
}

/* The released checkpoints' full layers (make_gemma4_dims_reference.py):
 * head_dim 32 there against 16 on the sliding layers, so the proportional
 * rotation turns a quarter of 16 pairs; kv heads 1 under attention_k_eq_v
 * (the 31B shape), else the sliding layers' 2 (the E2B shape, whose last
 * two layers share keys and values: layer 5 over layer 2's). */
static void check_gemma4_dims(eng_model *m)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_GEMMA4);
    cr_assert(c->v_norm && c->layer_scalar && eng_heads_vary(c));
    cr_assert_eq(c->rope_scaling, ENG_ROPE_PROPORTIONAL);
    cr_assert_eq(c->rope_prop_pairs, 4, "a quarter of global_head_dim 32's 16 pairs");
    cr_assert_eq(c->head_dim, 16);
    cr_assert_eq(c->g4.full_head_dim, 32);
    cr_assert_eq(c->g4.full_kv_heads, c->g4.k_eq_v ? 1 : 2);
    for (int l = 0; l < 6; l++) {
        bool full = l == 2 || l == 5;
        cr_assert_eq(eng_layer_slides(c, l), !full, "layer %d", l);
        cr_assert_eq(m->layers[l].wq.rows, full ? 128 : 64, "layer %d", l);
        if (eng_layer_kv_source(c, l) == l)
            cr_assert_eq(m->layers[l].wk.rows, full ? 32 * c->g4.full_kv_heads : 32, "layer %d", l);
    }
    cr_assert_eq(eng_layer_kv_source(c, 5), c->g4.k_eq_v ? 5 : 2);
}

/* The full layers' pairs counted over head_dim 16, not global_head_dim. */
static void pairs_of_the_sliding_head(eng_config *c)
{
    c->rope_prop_pairs = c->head_dim / 8;
}

/* The mixture's shape (gemma-4-26B-A4B): the large dense one's attention,
 * and on every layer the MLP beside 4 experts of 32, 2 chosen a token. */
static void check_gemma4_moe(eng_model *m)
{
    check_gemma4_keqv(m);
    const eng_config *c = &m->cfg;
    cr_assert(c->g4.moe_block && c->norm_topk_prob);
    cr_assert_eq(c->n_experts, 4);
    cr_assert_eq(c->n_experts_used, 2);
    cr_assert_eq(c->expert_ff, 32);
    cr_assert_eq(c->router, ENG_ROUTER_SOFTMAX_TOPK);
    cr_assert_eq(eng_n_proj(c), ENG_PROJ_FIRST_EXPERT + 12);
    for (int l = 0; l < 6; l++) {
        cr_assert(eng_layer_is_moe(c, l), "layer %d", l);
        cr_assert_eq(m->layers[l].w_gate.rows, 96, "layer %d: the MLP stays", l);
        cr_assert_eq(m->layers[l].router.rows, 4, "layer %d", l);
        cr_assert_eq(m->layers[l].experts[3 * 3 + 2].cols, 32, "layer %d", l);
        cr_assert_eq(m->layers[l].g4.expert_scale.cols, 4, "layer %d", l);
    }
}

/* OLMo 3 (make_olmo3_reference.py): norms after attention and the MLP
 * only, whole-projection q/k norms, layers 0-2 and 4-5 sliding over 5,
 * layer 3 full with YaRN (factor 4 over 32, attention factor 1.2), the
 * sliding ones with the plain rotation of the same base. */
static void check_olmo3(eng_model *m)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_OLMO3);
    cr_assert_str_eq(eng_arch_name(c->arch), "olmo3");
    cr_assert(c->post_norms && c->qk_norm && c->qk_norm_whole && !c->sandwich_norms);
    cr_assert(!c->rope_interleaved && !c->tie_word_embeddings);
    cr_assert_eq(c->sliding_window, 5);
    for (int l = 0; l < 6; l++)
        cr_assert_eq(eng_layer_slides(c, l), l != 3, "layer %d", l);
    cr_assert_eq(c->rope_scaling, ENG_ROPE_YARN);
    cr_assert_float_eq(c->rope_factor, 4.0f, 1e-6);
    cr_assert_eq(c->rope_original_max_position, 32);
    cr_assert_float_eq(c->rope_attn_factor, 1.2f, 1e-6);
    cr_assert_float_eq(c->rope_theta, 10000.0f, 0);
    cr_assert_float_eq(c->rope_local_theta, 10000.0f, 0);
    const eng_layer *L = &m->layers[2];
    cr_assert_eq(L->attn_norm.rows, 0, "no norm before attention");
    cr_assert_eq(L->ffn_norm.rows, 0, "no norm before the MLP");
    cr_assert_eq(L->q_norm.cols, 64);
    cr_assert_eq(L->k_norm.cols, 32);
    cr_assert_eq(L->post_attn_norm.cols, 64);
    cr_assert_eq(L->post_ffn_norm.cols, 64);
}

/* Ministral 3 (make_ministral3_reference.py): YaRN with mscale and
 * mscale_all_dim 1 (attention factor 1), Llama 4's query scaling with beta
 * 0.3 over periods of 4 positions. */
static void check_ministral3(const eng_model *m, bool interleaved)
{
    const eng_config *c = &m->cfg;
    cr_assert_eq(c->arch, ENG_ARCH_MINISTRAL3);
    cr_assert_str_eq(eng_arch_name(c->arch), "ministral3");
    cr_assert_eq(c->rope_interleaved, interleaved);
    cr_assert_eq(c->rope_scaling, ENG_ROPE_YARN);
    cr_assert_float_eq(c->rope_factor, 8.0f, 1e-6);
    cr_assert_eq(c->rope_original_max_position, 4);
    cr_assert_float_eq(c->rope_attn_factor, 1.0f, 1e-6);
    cr_assert_float_eq(c->attn_temp_beta, 0.3f, 1e-6);
    cr_assert_eq(c->attn_temp_floor, 4);
    cr_assert_eq(c->sliding_window, 0);
    cr_assert_eq(c->head_dim, 16);
}

static void check_ministral3_folder(eng_model *m)
{
    check_ministral3(m, false);
}

static void check_ministral3_gguf(eng_model *m)
{
    check_ministral3(m, true);
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

/* The long set replaced by the short one. */
static void short_factors(eng_config *c)
{
    for (int i = 0; i < 8; i++)
        c->rope_long_freq_factors[i] = (float)PHI3_SHORT_FACTOR[i];
}

static void whole_head_rotation(eng_config *c)
{
    c->rope_dim = 0;
}

static void no_sinks(eng_config *c)
{
    c->attn_sinks = false;
}

static void no_swiglu_clamp(eng_config *c)
{
    c->swiglu_limit = 0.0f;
}

static void no_yarn(eng_config *c)
{
    c->rope_scaling = ENG_ROPE_NONE;
}

static void no_o_bias(eng_config *c)
{
    c->o_bias = false;
}

static void no_expert_biases(eng_config *c)
{
    c->router_bias = false;
}

static void no_query_temperature(eng_config *c)
{
    c->attn_temp_beta = 0.0f;
}

static void per_head_qk_norm_off(eng_config *c)
{
    c->qk_norm = false;
}

static void no_v_norm(eng_config *c)
{
    c->v_norm = false;
}

static void no_layer_scalar(eng_config *c)
{
    c->layer_scalar = false;
}

static void no_rope_factor(eng_config *c)
{
    c->rope_factor = 1.0f;
}

static void no_per_layer_inputs(eng_config *c)
{
    c->g4.ple_dim = 0;
}

static void all_pairs_turn(eng_config *c)
{
    c->rope_prop_pairs = c->head_dim / 2;
}

static void rope_every_layer(eng_config *c)
{
    memset(c->nope_layers, 0, sizeof c->nope_layers);
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

/* a prefill of 9, then one token a step over blocks of 4 */
#define SMOLLM3_REF                                                                                \
    .source = "transformers float64 (make_smollm3_reference.py)", .tokens = SMOLLM3_TOKENS,        \
    .n_tokens = SMOLLM3_N_TOKENS, .vocab = SMOLLM3_VOCAB, .logits = &SMOLLM3_LOGITS[0][0],         \
    .prefill = 9, .block_tokens = 4, .tol = 1e-5

#define OLMO3_REF                                                                                  \
    .source = "transformers float64 (make_olmo3_reference.py)", .tokens = OLMO3_TOKENS,            \
    .n_tokens = OLMO3_N_TOKENS, .vocab = OLMO3_VOCAB, .logits = &OLMO3_LOGITS[0][0], .prefill = 9, \
    .block_tokens = 4, .tol = 1e-5
/* each of OLMo 3's features moves the logits: its q/k norms, the window,
 * YaRN on the full layers, the sliding layers' own (unscaled) rotation */
#define OLMO3_FEATURES                                                                             \
    .features = {{"the q/k norms", per_head_qk_norm_off},                                          \
                 {"the sliding window", no_sliding_window},                                        \
                 {"YaRN on the full layers", no_yarn},                                             \
                 {"the sliding layers' unscaled rotation", no_local_rope_base}},                   \
    .moved = 1e-3

/* a prefill of 9, then one token a step over blocks of 4; each of Gemma 4's
 * own features moves the logits */
#define GEMMA4_REF                                                                                 \
    .source = "transformers float64 (make_gemma4_reference.py)", .tokens = GEMMA4_TOKENS,          \
    .n_tokens = GEMMA4_N_TOKENS, .vocab = GEMMA4_VOCAB, .logits = &GEMMA4_LOGITS[0][0],            \
    .prefill = 9, .block_tokens = 4, .tol = 1e-5,                                                  \
    .features = {{"the weightless v norm", no_v_norm},                                             \
                 {"layer_scalar", no_layer_scalar},                                                \
                 {"the proportional rotation's still pairs", all_pairs_turn},                      \
                 {"the proportional rotation's factor", no_rope_factor},                           \
                 {"the sliding window", no_sliding_window},                                        \
                 {"the sliding layers' own base", no_local_rope_base}},                            \
    .moved = 1e-3

/* the shapes of the released checkpoints (make_gemma4_shapes_reference.py) */
#define GEMMA4_SHAPE_REF(which)                                                                    \
    .source = "transformers float64 (make_gemma4_shapes_reference.py)", .tokens = GEMMA4_TOKENS,   \
    .n_tokens = GEMMA4_N_TOKENS, .vocab = GEMMA4_VOCAB, .logits = &which[0][0], .prefill = 9,      \
    .block_tokens = 4, .tol = 1e-5

#define GEMMA4_DIMS_REF(which)                                                                     \
    .source = "transformers float64 (make_gemma4_dims_reference.py)", .tokens = GEMMA4_TOKENS,     \
    .n_tokens = GEMMA4_N_TOKENS, .vocab = GEMMA4_VOCAB, .logits = &which[0][0], .prefill = 9,      \
    .block_tokens = 4, .tol = 1e-5

#define MINISTRAL3_REF                                                                             \
    .source = "transformers float64 (make_ministral3_reference.py)", .tokens = MINISTRAL3_TOKENS,  \
    .n_tokens = MINISTRAL3_N_TOKENS, .vocab = MINISTRAL3_VOCAB,                                    \
    .logits = &MINISTRAL3_LOGITS[0][0], .prefill = 9, .block_tokens = 4, .tol = 1e-5,              \
    .features = {{"Llama 4's query scaling", no_query_temperature}, {"YaRN", no_yarn}},            \
    .moved = 1e-3

#define MOE_REF(which)                                                                             \
    .source = "transformers float64 (make_moe_reference.py)", .tokens = which##_TOKENS,            \
    .n_tokens = which##_N_TOKENS, .vocab = which##_VOCAB, .logits = &which##_LOGITS[0][0],         \
    .prefill = 9, .block_tokens = 4, .tol = 1e-5

/* GPT-OSS's features each must see: the sinks (3.3 in transformers' own
 * logits when removed), the window (3.0), the clamp (0.037: 4 gate and 6
 * up values reach it), YaRN, o's bias, the router's and experts' biases */
#define GPT_OSS_FEATURES                                                                           \
    .features = {{"the attention sinks", no_sinks},                                                \
                 {"the sliding window", no_sliding_window},                                        \
                 {"the SwiGLU clamp", no_swiglu_clamp},                                            \
                 {"YaRN", no_yarn},                                                                \
                 {"the output projection's bias", no_o_bias},                                      \
                 {"the router's and experts' biases", no_expert_biases}},                          \
    .moved = 1e-3

static const arch_row ARCH_ROWS[] = {
    {.label = "gpt-oss folder",
     .fixture = "gptoss_tiny",
     MOE_REF(GPTOSS),
     .check = check_gpt_oss,
     GPT_OSS_FEATURES},
    {.label = "gpt-oss gguf",
     .fixture = "gptoss_tiny.gguf",
     MOE_REF(GPTOSS),
     .check = check_gpt_oss,
     GPT_OSS_FEATURES},
    /* llama-quantize's MXFP4_MOE file of it (experts MXFP4, attention,
     * embeddings and lm_head q8_0), against transformers' float64 forward
     * over the weights gguf-py dequantizes from it */
    /* the Hub's form: experts as MXFP4 _blocks / _scales (llama-quantize's
     * codes regrouped by make_moe_reference.py), against transformers' float64
     * forward of it (Mxfp4Config(dequantize=True)); and the converter's GGUF
     * of that folder (MXFP4 experts, everything else f32) */
    {.label = "gpt-oss folder mxfp4",
     .fixture = "gptoss_mxfp4_tiny",
     .source = "transformers float64 (make_moe_reference.py)",
     .tokens = GPTOSS_TOKENS,
     .n_tokens = GPTOSS_N_TOKENS,
     .vocab = GPTOSS_VOCAB,
     .logits = &GPTOSS_HF_MXFP4_LOGITS[0][0],
     .prefill = 9,
     .block_tokens = 4,
     .tol = 1e-5,
     .check = check_gpt_oss_mxfp4},
    {.label = "gpt-oss mxfp4 folder's gguf",
     .fixture = "gptoss_mxfp4_tiny.gguf",
     .source = "transformers float64 (make_moe_reference.py)",
     .tokens = GPTOSS_TOKENS,
     .n_tokens = GPTOSS_N_TOKENS,
     .vocab = GPTOSS_VOCAB,
     .logits = &GPTOSS_HF_MXFP4_LOGITS[0][0],
     .prefill = 9,
     .block_tokens = 4,
     .tol = 1e-5,
     .check = check_gpt_oss_mxfp4},
    {.label = "gpt-oss gguf mxfp4",
     .fixture = "gptoss_tiny_mxfp4.gguf",
     .source = "transformers float64 over gguf-py's dequantized weights (make_moe_reference.py)",
     .tokens = GPTOSS_TOKENS,
     .n_tokens = GPTOSS_N_TOKENS,
     .vocab = GPTOSS_VOCAB,
     .logits = &GPTOSS_MXFP4_LOGITS[0][0],
     .prefill = 9,
     .block_tokens = 4,
     .tol = 1e-5,
     .check = check_gpt_oss_mxfp4},
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
    {.label = "qwen3moe 256-wide gguf Q4_K_M",
     .fixture = "qwen3moe_kq_q4_k_m.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = QWEN3MOE_TOKENS,
     .n_tokens = QWEN3MOE_N_TOKENS,
     .vocab = QWEN3MOE_VOCAB,
     .check = check_kq_q4_k_m},
    {.label = "qwen3moe 256-wide gguf MXFP4_MOE",
     .fixture = "qwen3moe_kq_mxfp4.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = QWEN3MOE_TOKENS,
     .n_tokens = QWEN3MOE_N_TOKENS,
     .vocab = QWEN3MOE_VOCAB,
     .check = check_kq_mxfp4},
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
    /* the same weights in transformers 5's fused form (mlp.experts.gate_up_proj
     * [experts, 2 ff, hidden], down_proj [experts, hidden, ff]) */
    {.label = "qwen3moe fused folder",
     .fixture = "qwen3moe_fused_tiny",
     MOE_REF(QWEN3MOE),
     .check = check_qwen3moe},
    {.label = "mixtral fused folder",
     .fixture = "mixtral_fused_tiny",
     MOE_REF(MIXTRAL),
     .check = check_mixtral},
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
    {.label = "smollm3 folder",
     .fixture = "smollm3_tiny",
     SMOLLM3_REF,
     .check = check_smollm3_folder,
     .features = {{"the NoPE layer", rope_every_layer}},
     .moved = 1e-3},
    {.label = "smollm3 gguf",
     .fixture = "smollm3_tiny.gguf",
     SMOLLM3_REF,
     .check = check_smollm3_gguf,
     .features = {{"the NoPE layer", rope_every_layer}},
     .moved = 1e-3},
    {.label = "olmo3 folder",
     .fixture = "olmo3_tiny",
     OLMO3_REF,
     .check = check_olmo3,
     OLMO3_FEATURES},
    {.label = "olmo3 gguf",
     .fixture = "olmo3_tiny.gguf",
     OLMO3_REF,
     .check = check_olmo3,
     OLMO3_FEATURES},
    {.label = "gemma4 folder", .fixture = "gemma4_tiny", GEMMA4_REF, .check = check_gemma4},
    {.label = "gemma4 kv-shared folder",
     .fixture = "gemma4_kv_shared_tiny",
     .source = "transformers float64 (make_gemma4_reference.py)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .logits = &GEMMA4_KV_SHARED_LOGITS[0][0],
     .prefill = 9,
     .block_tokens = 4,
     .tol = 1e-5,
     .check = check_gemma4_kv_shared},
    {.label = "gemma4 per-layer inputs folder",
     .fixture = "gemma4_ple_tiny",
     GEMMA4_SHAPE_REF(GEMMA4_PLE_LOGITS),
     .check = check_gemma4_ple,
     .features = {{"the per-layer inputs", no_per_layer_inputs}},
     .moved = 1e-3},
    {.label = "gemma4 k_eq_v folder",
     .fixture = "gemma4_keqv_tiny",
     GEMMA4_SHAPE_REF(GEMMA4_KEQV_LOGITS),
     .check = check_gemma4_keqv},
    {.label = "gemma4 ConditionalGeneration folder (its text model)",
     .fixture = "gemma4_cg_tiny",
     GEMMA4_SHAPE_REF(GEMMA4_CG_LOGITS),
     .check = check_gemma4_cg},
    {.label = "gemma4 full layers' own head size folder",
     .fixture = "gemma4_dims_tiny",
     GEMMA4_DIMS_REF(GEMMA4_DIMS_LOGITS),
     .check = check_gemma4_dims,
     .features = {{"the full layers' pairs over global_head_dim", pairs_of_the_sliding_head}},
     .moved = 1e-3},
    {.label = "gemma4 k_eq_v full layers' own kv heads folder",
     .fixture = "gemma4_dims_keqv_tiny",
     GEMMA4_DIMS_REF(GEMMA4_DIMS_KEQV_LOGITS),
     .check = check_gemma4_dims},
    {.label = "gemma4 MoE block folder",
     .fixture = "gemma4_moe_tiny",
     GEMMA4_SHAPE_REF(GEMMA4_MOE_LOGITS),
     .check = check_gemma4_moe,
     .features = {{"the second expert", one_expert}, {"the top-k renormalization", flip_topk_norm}},
     .moved = 1e-3},
    {.label = "ministral3 folder",
     .fixture = "ministral3_tiny",
     MINISTRAL3_REF,
     .check = check_ministral3_folder},
    {.label = "ministral3 gguf",
     .fixture = "ministral3_tiny.gguf",
     MINISTRAL3_REF,
     .check = check_ministral3_gguf},
    /* the new families quantized: llama.cpp's q8_0 files and --quant on load,
     * against the float64 pass over their own weights (which knows NoPE
     * layers, post-norms, whole-projection q/k norms and the temperature) */
    {.label = "smollm3 gguf q8_0",
     .fixture = "smollm3_tiny_q8_0.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = SMOLLM3_TOKENS,
     .n_tokens = SMOLLM3_N_TOKENS,
     .vocab = SMOLLM3_VOCAB,
     .check = check_smollm3_gguf},
    {.label = "smollm3 folder --quant nf4",
     .fixture = "smollm3_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = SMOLLM3_TOKENS,
     .n_tokens = SMOLLM3_N_TOKENS,
     .vocab = SMOLLM3_VOCAB,
     .quant = "nf4",
     .check = check_smollm3_folder},
    {.label = "olmo3 gguf q8_0",
     .fixture = "olmo3_tiny_q8_0.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = OLMO3_TOKENS,
     .n_tokens = OLMO3_N_TOKENS,
     .vocab = OLMO3_VOCAB,
     .check = check_olmo3},
    {.label = "olmo3 folder --quant nf4",
     .fixture = "olmo3_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = OLMO3_TOKENS,
     .n_tokens = OLMO3_N_TOKENS,
     .vocab = OLMO3_VOCAB,
     .quant = "nf4",
     .check = check_olmo3},
    {.label = "gemma4 folder --quant nf4",
     .fixture = "gemma4_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "nf4",
     .check = check_gemma4},
    {.label = "gemma4 folder --quant int8",
     .fixture = "gemma4_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "int8",
     .check = check_gemma4},
    {.label = "gemma4 kv-shared folder --quant nf4",
     .fixture = "gemma4_kv_shared_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "nf4",
     .check = check_gemma4_kv_shared},
    {.label = "gemma4 per-layer inputs folder --quant nf4",
     .fixture = "gemma4_ple_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "nf4",
     .check = check_gemma4_ple},
    {.label = "gemma4 k_eq_v full layers' own kv heads folder --quant nf4",
     .fixture = "gemma4_dims_keqv_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "nf4",
     .check = check_gemma4_dims},
    {.label = "gemma4 MoE block folder --quant nf4",
     .fixture = "gemma4_moe_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "nf4",
     .check = check_gemma4_moe},
    {.label = "gemma4 k_eq_v folder --quant int8",
     .fixture = "gemma4_keqv_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = GEMMA4_TOKENS,
     .n_tokens = GEMMA4_N_TOKENS,
     .vocab = GEMMA4_VOCAB,
     .quant = "int8",
     .check = check_gemma4_keqv},
    {.label = "ministral3 gguf q8_0",
     .fixture = "ministral3_tiny_q8_0.gguf",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = MINISTRAL3_TOKENS,
     .n_tokens = MINISTRAL3_N_TOKENS,
     .vocab = MINISTRAL3_VOCAB,
     .check = check_ministral3_gguf},
    {.label = "ministral3 folder --quant int8",
     .fixture = "ministral3_tiny",
     .source = "the float64 reference pass (ref_forward.h)",
     .tokens = MINISTRAL3_TOKENS,
     .n_tokens = MINISTRAL3_N_TOKENS,
     .vocab = MINISTRAL3_VOCAB,
     .quant = "int8",
     .check = check_ministral3_folder},
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

/* ggml always rounds YaRN's correction range out to whole dims
 * (ggml_rope_yarn_corr_dims); transformers does only with truncate, which
 * GPT-OSS's config turns off, and a GPT-OSS GGUF says nothing of it (we take
 * the model's own false). With truncate set, the logits are transformers'
 * with truncate true (0.0064 from the untruncated ones, so the flag is seen). */
Test(architectures, gpt_oss_yarn_truncated_equals_transformers_truncated, .timeout = 120)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/gptoss_tiny.gguf", QL_FIXTURES);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    m.cfg.rope_yarn_truncate = true;
    arch_row row = {.tokens = GPTOSS_TOKENS,
                    .n_tokens = GPTOSS_N_TOKENS,
                    .vocab = GPTOSS_VOCAB,
                    .logits = &GPTOSS_YARN_TRUNCATED_LOGITS[0][0],
                    .prefill = 9,
                    .block_tokens = 4};
    double worst = worst_error(&m, &row);
    cr_assert_lt(worst, 1e-5, "truncated YaRN: worst logit error %g", worst);
    row.logits = &GPTOSS_LOGITS[0][0];
    cr_assert_gt(worst_error(&m, &row), 1e-3, "the truncation changed nothing");
    eng_model_free(&m);
}

/* The folder's config.json with `from` replaced by `to`, loaded: the
 * loader's code, its message in msg, the model in *m when it loads. */
static int load_edited_folder(const char *fixture, const char *from, const char *to, eng_model *m,
                              char *msg, size_t msg_len)
{
    char dir[512] = "", cfg_path[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    tiny_fixture_folder(fixture, dir);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    size_t len = 0;
    char *text = test_read_file(cfg_path, &len);
    cr_assert(text);
    char *at = strstr(text, from);
    cr_assert(at, "%s is not in %s's config.json", from, fixture);
    size_t n = strlen(text) - strlen(from) + strlen(to) + 1;
    char *edited = malloc(n);
    snprintf(edited, n, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    test_write_text(cfg_path, edited);
    free(edited);
    free(text);
    eng_load_opts o = {.path = dir};
    int rc = eng_model_load(m, &o, msg, msg_len);
    test_rmtree(dir);
    return rc;
}

/* GPT-OSS's experts in a form the config does not announce are refused by
 * name, never run wrong: the MXFP4 folder without its quantization_config
 * (the loader looks for the dense gate_up_proj and says where the MXFP4
 * pairs would have been read). */
Test(architectures, gpt_oss_experts_in_an_unannounced_form_are_refused_by_name, .timeout = 60)
{
    char msg[1024];
    eng_model m;
    cr_assert_neq(load_edited_folder("gptoss_mxfp4_tiny", "\"quantization_config\"",
                                     "\"quantization_confiX\"", &m, msg, sizeof msg),
                  0);
    cr_assert(strstr(msg, "model.layers.0.mlp.experts.gate_up_proj' is missing") &&
                  strstr(msg, "quantization_config"),
              "%s", msg);
}

/* SmolLM3's no_rope_layers is read as it stands (1: the layer rotates),
 * not rebuilt from no_rope_layer_interval. */
Test(architectures, smollm3_no_rope_layers_list_is_read_per_layer, .timeout = 60)
{
    char msg[1024];
    eng_model m;
    cr_assert_eq(load_edited_folder("smollm3_tiny", "\"no_rope_layers\": [\n    1,\n    1,",
                                    "\"no_rope_layers\": [\n    0,\n    1,", &m, msg, sizeof msg),
                 0, "%s", msg);
    for (int l = 0; l < 5; l++)
        cr_assert_eq(eng_layer_rotates(&m.cfg, l), l != 0 && l != 3, "layer %d", l);
    eng_model_free(&m);
}

/* Gemma 4 options that leave a text model as it is load: "vision"
 * bidirectional attention (text stays causal), and global_head_dim equal
 * to head_dim in place of per_layer_config. */
Test(architectures, gemma4_options_that_change_nothing_for_text_load, .timeout = 60)
{
    static const char *const edits[][2] = {
        {"\"use_bidirectional_attention\": null", "\"use_bidirectional_attention\": \"vision\""},
        {"\"per_layer_config\": {}", "\"global_head_dim\": 16"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
        char msg[1024];
        eng_model m;
        cr_assert_eq(
            load_edited_folder("gemma4_tiny", edits[i][0], edits[i][1], &m, msg, sizeof msg), 0,
            "%s: %s", edits[i][1], msg);
        cr_assert_eq(m.cfg.head_dim, 16);
        eng_model_free(&m);
    }
}

/* A released Gemma 4 config.json names the full layers' shape with
 * global_head_dim and num_global_key_value_heads, not per_layer_config
 * (what transformers 5 writes of them): the dims folders with their
 * per_layer_config put back into those keys load as they are, the kv
 * heads applied only under attention_k_eq_v (gemma4_dims_tiny has none:
 * its full layers keep num_key_value_heads 2), as Gemma4TextConfig does. */
Test(architectures, gemma4_global_head_dim_keys_load_as_per_layer_config, .timeout = 60)
{
    static const struct {
        const char *folder, *per_layer;
        int32_t full_kv;
    } want[] = {
        {"gemma4_dims_keqv_tiny",
         "\"per_layer_config\": {\n    \"2\": {\n      \"head_dim\": 32,\n      "
         "\"num_key_value_heads\": 1\n    },\n    \"5\": {\n      \"head_dim\": 32,\n      "
         "\"num_key_value_heads\": 1\n    }\n  }",
         1},
        {"gemma4_dims_tiny",
         "\"per_layer_config\": {\n    \"2\": {\n      \"head_dim\": 32\n    },\n    \"5\": {\n "
         "     \"head_dim\": 32\n    }\n  }",
         2},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        char msg[1024];
        eng_model m;
        cr_assert_eq(
            load_edited_folder(want[i].folder, want[i].per_layer,
                               "\"global_head_dim\": 32, \"num_global_key_value_heads\": 1", &m,
                               msg, sizeof msg),
            0, "%s: %s", want[i].folder, msg);
        cr_assert_eq(m.cfg.g4.full_head_dim, 32, "%s", want[i].folder);
        cr_assert_eq(m.cfg.g4.full_kv_heads, want[i].full_kv, "%s", want[i].folder);
        cr_assert_eq(eng_layer_head_dim(&m.cfg, 0), 16);
        eng_model_free(&m);
    }
}

/* A config edit the loader must refuse, and words its message must hold. */
typedef struct refused_edit {
    const char *fixture, *from, *to, *want;
} refused_edit;

/* What qlserve does not run of the 2025 families is refused by name:
 * SmolLM3's sliding layers, a no_rope_layers list of the wrong length and
 * biases (o_proj's among them); OLMo 3's biases, a sliding rotation other
 * than the plain one, layer types that are not a repeating pattern closed
 * by a full layer; Ministral 3 without llama_4_scaling_beta (transformers
 * cannot run it either) or with biases. */
static const refused_edit REFUSED_EDITS[] = {
    {"smollm3_tiny", "\"use_sliding_window\": false", "\"use_sliding_window\": true",
     "use_sliding_window"},
    {"smollm3_tiny", "\"no_rope_layers\": [\n    1,", "\"no_rope_layers\": [", "no_rope_layers"},
    {"smollm3_tiny", "\"attention_bias\": false", "\"attention_bias\": true",
     "attention_bias is not supported for SmolLM3"},
    {"olmo3_tiny", "\"attention_bias\": false", "\"attention_bias\": true",
     "attention_bias is not supported for OLMo 3"},
    {"olmo3_tiny", "\"rope_theta\": 10000.0,\n      \"rope_type\": \"default\"",
     "\"rope_theta\": 10000.0,\n      \"rope_type\": \"linear\"",
     "sliding_attention.rope_type linear"},
    {"olmo3_tiny", "\"layer_types\": [\n    \"sliding_attention\"",
     "\"layer_types\": [\n    \"full_attention\"", "layer_types"},
    {"ministral3_tiny", "\"llama_4_scaling_beta\"", "\"llama_4_scaling_betX\"",
     "llama_4_scaling_beta is missing"},
    {"ministral3_tiny", "\"architectures\"", "\"attention_bias\": true,\n  \"architectures\"",
     "attention_bias is not supported for Ministral 3"},
    /* per-layer inputs (Gemma4TextConfig's default 256 when absent) need their tensors */
    {"gemma4_tiny", "\"hidden_size_per_layer_input\": 0", "\"hidden_size_per_layer_input\": 8",
     "tensor 'model.embed_tokens_per_layer.weight' is missing"},
    {"gemma4_tiny", "\"hidden_size_per_layer_input\": 0", "\"hidden_size_per_layeX\": 0",
     "tensor 'model.embed_tokens_per_layer.weight' is missing"},
    {"gemma4_ple_tiny", "\"vocab_size_per_layer_input\": 260",
     "\"vocab_size_per_layer_input\": 100", "\"vocab_size_per_layer_input\" must be"},
    /* a double-wide MLP's layers are twice intermediate_size */
    {"gemma4_kv_shared_tiny", "\"use_double_wide_mlp\": false", "\"use_double_wide_mlp\": true",
     "model.layers.4.mlp.gate_proj.weight' is [96, 64]; the config needs [192, 64]"},
    /* the full layers' own kv heads (attention_k_eq_v's) and head size
     * shape their tensors */
    {"gemma4_keqv_tiny", "\"per_layer_config\": {}",
     "\"num_global_key_value_heads\": 1, \"global_head_dim\": 16",
     "model.layers.2.self_attn.k_proj.weight' is [32, 64]; the config needs [16, 64]"},
    {"gemma4_tiny", "\"num_kv_shared_layers\": 0", "\"num_kv_shared_layers\": 6",
     "num_kv_shared_layers"},
    {"gemma4_tiny", "\"enable_moe_block\": false", "\"enable_moe_block\": true",
     "\"num_experts\" is missing"},
    {"gemma4_cg_tiny", "\"text_config\"", "\"text_configX\"",
     "Gemma4ForConditionalGeneration without a \"text_config\" object"},
    {"gemma4_moe_tiny", "\"top_k_experts\": 2", "\"top_k_experts\": 5", "5 experts per token of 4"},
    {"gemma4_tiny", "\"attention_bias\": false", "\"attention_bias\": true",
     "attention_bias is not supported for Gemma 4"},
    {"gemma4_tiny", "\"use_bidirectional_attention\": null",
     "\"use_bidirectional_attention\": \"all\"", "use_bidirectional_attention"},
    /* per_layer_config: one shape for the full layers, the sliding ones
     * their own, head_dim and num_key_value_heads only */
    {"gemma4_tiny", "\"per_layer_config\": {}", "\"per_layer_config\": {\"2\": {\"head_dim\": 32}}",
     "per_layer_config gives layer 5 (full) head_dim 16"},
    {"gemma4_tiny", "\"per_layer_config\": {}", "\"per_layer_config\": {\"0\": {\"head_dim\": 32}}",
     "per_layer_config gives layer 0 (sliding) head_dim 32"},
    {"gemma4_tiny", "\"per_layer_config\": {}",
     "\"per_layer_config\": {\"2\": {\"sliding_window\": 3}}",
     "per_layer_config[2].sliding_window is not supported"},
    {"gemma4_tiny", "\"per_layer_config\": {}", "\"per_layer_config\": {\"9\": {}}",
     "per_layer_config has \"9\", not a layer"},
    /* without per_layer_config, global_head_dim (512 when absent) */
    {"gemma4_tiny", "\"per_layer_config\": {}", "\"per_layer_configX\": {}",
     "model.layers.2.self_attn.q_proj.weight' is [64, 64]; the config needs [2048, 64]"},
    {"gemma4_tiny", "\"per_layer_config\": {}", "\"global_head_dim\": 32",
     "model.layers.2.self_attn.q_proj.weight' is [64, 64]; the config needs [128, 64]"},
    {"gemma4_tiny", "\"per_layer_config\": {}", "\"global_head_dim\": 31", "head_dim 31"},
    {"gemma4_tiny",
     "\"full_attention\",\n    \"sliding_attention\",\n    \"sliding_attention\",\n    "
     "\"full_attention\"",
     "\"sliding_attention\",\n    \"full_attention\",\n    \"sliding_attention\",\n    "
     "\"sliding_attention\"",
     "last layer slides"},
    {"gemma4_tiny", "\"rope_type\": \"default\"", "\"rope_type\": \"linear\"",
     "sliding_attention.rope_type linear"},
};

Test(architectures, options_not_run_are_refused_by_name, .timeout = 120)
{
    for (size_t i = 0; i < sizeof REFUSED_EDITS / sizeof *REFUSED_EDITS; i++) {
        const refused_edit *e = &REFUSED_EDITS[i];
        char msg[1024];
        eng_model m;
        cr_assert_neq(load_edited_folder(e->fixture, e->from, e->to, &m, msg, sizeof msg), 0,
                      "%s: %s loaded", e->fixture, e->to);
        cr_assert(strstr(msg, e->want), "%s: \"%s\" is not in: %s", e->fixture, e->want, msg);
    }
}

/* --- the float64 pass and adapters on the 2025 families -------------------------------- */

/* A family's tiny folder and transformers' logits of its prompt. */
typedef struct family_fixture {
    const char *folder;
    const int *tokens;
    int n_tokens;
    int64_t vocab;
    const double *logits;
} family_fixture;

static const family_fixture NEW_FAMILIES[] = {
    {"smollm3_tiny", SMOLLM3_TOKENS, SMOLLM3_N_TOKENS, SMOLLM3_VOCAB, &SMOLLM3_LOGITS[0][0]},
    {"olmo3_tiny", OLMO3_TOKENS, OLMO3_N_TOKENS, OLMO3_VOCAB, &OLMO3_LOGITS[0][0]},
    {"ministral3_tiny", MINISTRAL3_TOKENS, MINISTRAL3_N_TOKENS, MINISTRAL3_VOCAB,
     &MINISTRAL3_LOGITS[0][0]},
    {"gemma4_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB, &GEMMA4_LOGITS[0][0]},
    {"gemma4_kv_shared_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB,
     &GEMMA4_KV_SHARED_LOGITS[0][0]},
    {"gemma4_ple_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB, &GEMMA4_PLE_LOGITS[0][0]},
    {"gemma4_keqv_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB, &GEMMA4_KEQV_LOGITS[0][0]},
    {"gemma4_moe_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB, &GEMMA4_MOE_LOGITS[0][0]},
    {"gemma4_dims_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB, &GEMMA4_DIMS_LOGITS[0][0]},
    {"gemma4_dims_keqv_tiny", GEMMA4_TOKENS, GEMMA4_N_TOKENS, GEMMA4_VOCAB,
     &GEMMA4_DIMS_KEQV_LOGITS[0][0]},
};

/* f's folder loaded from a scratch copy (dir: the copy, the caller's to
 * remove). */
static void load_family(eng_model *m, const family_fixture *f, char *dir, size_t dir_len)
{
    char msg[1024];
    test_tmpdir(dir, dir_len);
    cr_assert(dir[0]);
    tiny_fixture_folder(f->folder, dir);
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s: %s", f->folder, msg);
}

/* R's float64 logits of f's prompt, [n_tokens][vocab] (the caller frees). */
static double *family_reference(const ref_model *R, const family_fixture *f)
{
    int32_t ids[64];
    cr_assert(f->n_tokens <= 64);
    for (int i = 0; i < f->n_tokens; i++)
        ids[i] = f->tokens[i];
    double *ref = malloc((size_t)f->n_tokens * (size_t)f->vocab * sizeof *ref);
    cr_assert(ref);
    ref_forward(R, ids, f->n_tokens, ref);
    return ref;
}

/* The float64 pass the quantized rows are held to is transformers' own on
 * the f32 weights (5e-6: two float64 computations of one model). */
Test(architectures, reference_pass_equals_transformers_on_the_new_families, .timeout = 60)
{
    for (size_t i = 0; i < sizeof NEW_FAMILIES / sizeof *NEW_FAMILIES; i++) {
        const family_fixture *f = &NEW_FAMILIES[i];
        char dir[512];
        eng_model m;
        load_family(&m, f, dir, sizeof dir);
        ref_model R;
        ref_load(&R, &m);
        double *ref = family_reference(&R, f);
        test_diff d = {0};
        for (size_t k = 0; k < (size_t)f->n_tokens * (size_t)f->vocab; k++)
            test_diff_add(&d, ref[k], f->logits[k]);
        double worst = test_diff_abs(&d);
        cr_log_info("%s: float64 reference vs transformers: %g", f->folder, worst);
        cr_assert_lt(worst, 5e-6, "%s: float64 reference vs transformers: %g", f->folder, worst);
        free(ref);
        ref_free(&R);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* The config whose kv-shared layers (Gemma 4) no_kv_of_its_own reads. */
static const eng_config *skip_cfg;

/* PEFT has no k_proj or v_proj to adapt on a kv-shared layer
 * (transformers builds none there), nor v_proj on a full layer of an
 * attention_k_eq_v model. */
static bool no_kv_of_its_own(int32_t layer, eng_proj p)
{
    return ((p == ENG_PROJ_K || p == ENG_PROJ_V) &&
            eng_layer_kv_source(skip_cfg, layer) != layer) ||
           (p == ENG_PROJ_V && eng_layer_k_is_v(skip_cfg, layer));
}

/* A PEFT adapter on all seven projections of each new family, unmerged
 * (through the walk's inputs: OLMo 3's blocks read the residual) and
 * merged, against the float64 pass with the adapter added; it moves the
 * logits far past the tolerance. */
Test(architectures, adapters_on_the_new_families_match_the_reference, .timeout = 120)
{
    for (size_t i = 0; i < sizeof NEW_FAMILIES / sizeof *NEW_FAMILIES; i++) {
        const family_fixture *f = &NEW_FAMILIES[i];
        char dir[512], adir[700], msg[1024];
        eng_model m;
        load_family(&m, f, dir, sizeof dir);
        snprintf(adir, sizeof adir, "%s/adapter", dir);
        lora_fix_spec s = lora_fix_default();
        skip_cfg = &m.cfg;
        s.skip = no_kv_of_its_own;
        lora_fix_write(adir, &m.cfg, &s);
        eng_lora *lora = NULL;
        cr_assert_eq(lora_load(&lora, NULL, adir, "all", &m, msg, sizeof msg), 0, "%s", msg);
        ref_model R;
        ref_load(&R, &m);
        ref_add_lora(&R, lora, 1.0);
        double *ref = family_reference(&R, f);
        eng_lora_term term = {lora, 1.0f};
        eng_weights *v = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
        prompt_run runs[2] = {
            {.tokens = f->tokens,
             .n_tokens = f->n_tokens,
             .prefill = 9,
             .delta = &term,
             .n_delta = 1},
            {.tokens = f->tokens, .n_tokens = f->n_tokens, .prefill = 9, .weights = v}};
        const char *what[2] = {"unmerged", "merged"};
        for (int r = 0; r < 2; r++) {
            float *all = run_prompt(&m, &runs[r]);
            for (int t = 0; t < f->n_tokens; t++)
                assert_logits_close(all + (size_t)t * (size_t)f->vocab,
                                    ref + (size_t)t * (size_t)f->vocab, f->vocab, f->folder,
                                    what[r], t);
            double moved = test_max_abs_err(all, f->logits, (size_t)f->n_tokens * (size_t)f->vocab);
            cr_assert_gt(moved, 1e-2, "%s: the adapter moved the logits by only %g", f->folder,
                         moved);
            free(all);
        }
        eng_weights_unref(v);
        free(ref);
        ref_free(&R);
        eng_lora_unref(lora);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

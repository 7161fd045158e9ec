/*
 * test_qwen35.c - Qwen3.5 (Qwen3_5ForCausalLM): Gated DeltaNet linear
 * attention layers beside gated full attention, and the recurrent state
 * each sequence carries beside its KV blocks.
 *
 * The fixture (tests/fixtures/make_qwen35_reference.py) is a tiny
 * 6-layer model made by transformers, four linear layers and two full
 * ones, with transformers' float64 logits at every position of an
 * 18-token prompt and the 12 greedy ids after it. Pinned here: the logits
 * within 5e-5 whatever the chunking of the prompt, a prompt fed in chunks
 * bit for bit equal to one token at a time, the greedy ids, a fork that
 * copies the state, a state given back when its sequence ends, a step that
 * would rewind a state refused, options qlserve does not run refused by
 * name; the Qwen3.5-MoE folder and llama.cpp's conversions of it (GGUF
 * qwen35moe, f32 and q8_0) against its float64 logits, an MTP block
 * appended by the converter left unread; a PEFT adapter on in_proj_qkv,
 * in_proj_z, out_proj, the gated q_proj, v_proj and down_proj against
 * PEFT's float64 forward, unmerged and merged; served by the binary, n
 * greedy choices equal to one (each fork carries a copy of the state) with
 * the prefix cache off and said so in the log and /info, the states
 * counted in /metrics.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drafter_internal.h"
#include "fixtures/qwen35_mtp_reference.h"
#include "fixtures/qwen35_reference.h"
#include "gguf_writer.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "qtensor.h"
#include "run_prompt.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_server.h"

/* transformers' float64 forward (its RMSNorms in f32) against ours (f32
 * activations and state): the worst absolute logit difference measured is
 * 1.1e-5 (2.6e-5 with the adapter), at logits up to 3.2; transformers' own
 * float32 forward of the model is 2.3e-5 from its float64 one */
#define QWEN35_TOL 5e-5
/* quantized on load: the worst logit error measured (int8 0.38, nf4 3.0),
 * about doubled. The tiny random model is sensitive: transformers' own
 * weights rounded to symmetric per-channel int8 move its logits by 0.15 */
#define QWEN35_INT8_BOUND 0.8
#define QWEN35_NF4_BOUND  6.0
/* llama.cpp's q8_0 file rounds the embeddings, lm_head and in_proj_a/b
 * too: measured 2.91, and transformers' own weights rounded to q8_0 the
 * same way move its logits by 2.98 (in_proj_a feeds an exp) */
#define QWEN35_Q8_0_BOUND 6.0
/* the MoE's q8_0 file (the experts and shared expert in q8_0 but for the
 * shared down_proj's 48 columns, which the converter leaves f16; the
 * routers f32): measured 0.38, bound about doubled */
#define QWEN35_MOE_Q8_0_BOUND 0.8

static void load_qwen35(eng_model *m, char *dir, size_t dir_len, const char *quant)
{
    char msg[1024];
    test_tmpdir(dir, dir_len);
    cr_assert(dir[0]);
    tiny_fixture_folder("qwen35_tiny", dir);
    eng_load_opts o = {.path = dir, .quant = quant};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

Test(qwen35, config_reads_the_layer_types_and_linear_heads)
{
    char dir[512];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    const eng_config *c = &m.cfg;
    cr_assert_eq(c->arch, ENG_ARCH_QWEN3_5);
    cr_assert_str_eq(eng_arch_name(c->arch), "qwen3_5");
    cr_assert_eq(c->linear.n_layers, 4);
    for (int32_t l = 0; l < 6; l++)
        cr_assert_eq(eng_linear_is(&c->linear, l), l != 3 && l != 5, "layer %d", l);
    cr_assert_eq(c->linear.n_k_heads, 2);
    cr_assert_eq(c->linear.n_v_heads, 4);
    cr_assert_eq(c->linear.k_head_dim, 16);
    cr_assert_eq(c->linear.v_head_dim, 8);
    cr_assert_eq(c->linear.conv_kernel, 4);
    cr_assert(c->linear.attn_output_gate);
    cr_assert_eq(c->rope_dim, 4, "partial_rotary_factor 0.25 of 16");
    cr_assert_float_eq(c->norm_offset, 1.0f, 0.0f);
    /* the gated q_proj has each head's query and gate; in_proj_qkv in wq */
    cr_assert_eq(m.layers[3].wq.rows, 2 * 4 * 16);
    cr_assert_eq(m.layers[0].wq.rows, 2 * 2 * 16 + 4 * 8);
    cr_assert_eq(m.layers[0].wv.rows, 0);
    cr_assert_eq(m.layers[0].lin.conv.rows, 96);
    cr_assert_eq(m.layers[0].lin.conv.cols, 4);
    cr_assert_eq(m.layers[3].lin.conv.rows, 0);
    eng_model_free(&m);
}

/* The prompt's logits, fed in steps of `chunk` tokens (the last step
 * what is left). */
static float *run_chunks(const eng_model *m, int chunk)
{
    char msg[1024];
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    const int n = QWEN35_N_TOKENS;
    const size_t V = (size_t)m->cfg.vocab_size;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&kv, &m->cfg, (size_t)8 << 20, 4, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, m, chunk, msg, sizeof msg), 0, "%s", msg);
    eng_seq_kv skv = {0};
    cr_assert_eq(eng_kv_reserve(kv, &skv, n), 0);
    float *all = malloc((size_t)n * V * sizeof(float)), *last = malloc(V * sizeof(float));
    int32_t toks[QWEN35_N_TOKENS];
    for (int i = 0; i < n; i++)
        toks[i] = QWEN35_TOKENS[i];
    for (int p = 0; p < n; p += chunk) {
        int k = n - p < chunk ? n - p : chunk;
        eng_step_seq s = {
            .kv = &skv, .tokens = toks + p, .n_tokens = k, .pos = p, .all_logits = all + p * V};
        cr_assert_eq(eng_forward(st, m, kv, pool, &s, 1, last, msg, sizeof msg), 0, "%s", msg);
    }
    free(last);
    eng_kv_release(kv, &skv);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    return all;
}

Test(qwen35, logits_equal_transformers_float64_in_every_chunking)
{
    char dir[512];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    const size_t N = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    float *one = run_chunks(&m, 1);
    double worst = test_max_abs_err(one, &QWEN35_LOGITS[0][0], N);
    cr_assert(worst < QWEN35_TOL, "one token a step: worst |logit error| %g", worst);
    /* chunks that end before, at and past the conv's window (3 inputs),
     * and the whole prompt at once: the same bits as one token a step */
    const int chunks[] = {2, 3, 5, 7, QWEN35_N_TOKENS};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++) {
        float *got = run_chunks(&m, chunks[i]);
        for (size_t k = 0; k < N; k++)
            cr_assert(same_bits(got[k], one[k]), "chunks of %d: logit %zu is %.9g, %.9g alone",
                      chunks[i], k, got[k], one[k]);
        free(got);
    }
    free(one);
    eng_model_free(&m);
}

/* The text model of a Qwen3_5ForConditionalGeneration folder (text_config,
 * model.language_model.* tensors, a vision tower left unread): the same
 * bits as the Qwen3_5ForCausalLM folder holding its weights. */
Test(qwen35, conditional_generation_folder_runs_its_text_model)
{
    char dir[512], vdir[512], msg[1024];
    eng_model m, vm;
    load_qwen35(&m, dir, sizeof dir, NULL);
    test_tmpdir(vdir, sizeof vdir);
    tiny_fixture_folder("qwen35_vl_tiny", vdir);
    eng_load_opts o = {.path = vdir};
    cr_assert_eq(eng_model_load(&vm, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(vm.cfg.arch, ENG_ARCH_QWEN3_5);
    cr_assert_eq(vm.cfg.linear.n_layers, 4);
    const size_t N = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    float *want = run_chunks(&m, 5), *got = run_chunks(&vm, 5);
    for (size_t k = 0; k < N; k++)
        cr_assert(same_bits(got[k], want[k]), "logit %zu: %.9g, the text folder's %.9g", k, got[k],
                  want[k]);
    free(got);
    free(want);
    eng_model_free(&vm);
    eng_model_free(&m);
}

/* The fixture GGUF `file` (under QL_FIXTURES) into *m, whose quant kind is
 * `quant` (its layers' kind: f32, q8_0). */
static void load_fixture_gguf(eng_model *m, const char *file, const char *quant)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, file);
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_str_eq(m->quant, quant, "%s", file);
}

/* The worst |logit error| of the prompt's logits, fed in chunks of 5, from
 * the reference `want` [tokens][vocab]. */
static double worst_in_chunks_of_5(const eng_model *m, const double *want)
{
    float *got = run_chunks(m, 5);
    double worst = test_max_abs_err(got, want, (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB);
    free(got);
    return worst;
}

/* llama.cpp's conversion (GGUF qwen35): norms stored as 1 + w, A as
 * -exp(A_log), the value heads in tiled order (head h reads key head h %
 * 2): the same logits within the tolerance. */
Test(qwen35, gguf_from_llama_cpp_equals_transformers)
{
    char msg[1024];
    eng_model m;
    load_fixture_gguf(&m, "qwen35_tiny.gguf", "f32");
    cr_assert_eq(m.cfg.arch, ENG_ARCH_QWEN3_5);
    cr_assert_eq(m.cfg.linear.n_layers, 4);
    cr_assert(eng_linear_is(&m.cfg.linear, 4) && !eng_linear_is(&m.cfg.linear, 5));
    cr_assert(m.cfg.linear.v_tiled && m.cfg.linear.a_neg_exp);
    cr_assert_eq(eng_linear_key_head(&m.cfg.linear, 1), 1, "tiled: value head 1 reads key head 1");
    cr_assert_eq(m.cfg.linear.v_head_dim, 8);
    cr_assert_eq(m.cfg.rope_dim, 4);
    double worst = worst_in_chunks_of_5(&m, &QWEN35_LOGITS[0][0]);
    cr_assert(worst < QWEN35_TOL, "gguf: worst |logit error| %g", worst);
    /* PEFT's rows are in the folder's value-head order: refused here, by name */
    char adir[1024];
    snprintf(adir, sizeof adir, "%s/qwen35_lora", QL_FIXTURES);
    eng_lora *lora = NULL;
    cr_assert_neq(lora_load(&lora, NULL, adir, "q35", &m, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "in_proj_qkv") || strstr(msg, "out_proj") || strstr(msg, "in_proj_z"),
              "%s", msg);
    cr_assert(strstr(msg, "qwen35 GGUF"), "%s", msg);
    eng_model_free(&m);
}

/* Qwen3.5-MoE (Qwen3_5MoeForCausalLM): the hybrid layers with a mixture
 * in every MLP (softmax router, top 2 of 4 renormalized, Qwen2-MoE's
 * sigmoid-gated shared expert): transformers' float64 logits. */
Test(qwen35, moe_logits_equal_transformers_float64)
{
    char dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    tiny_fixture_folder("qwen35_moe_tiny", dir);
    eng_model m;
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.arch, ENG_ARCH_QWEN3_5);
    cr_assert_eq(m.cfg.n_experts, 4);
    cr_assert_eq(m.cfg.n_experts_used, 2);
    cr_assert_eq(m.cfg.shared_expert_ff, 48);
    cr_assert(m.cfg.norm_topk_prob);
    cr_assert_eq(m.cfg.linear.n_layers, 3);
    const size_t N = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    float *one = run_chunks(&m, 1), *all = run_chunks(&m, QWEN35_N_TOKENS);
    double worst = test_max_abs_err(one, &QWEN35_MOE_LOGITS[0][0], N);
    cr_assert(worst < QWEN35_TOL, "moe: worst |logit error| %g", worst);
    for (size_t k = 0; k < N; k++)
        cr_assert(same_bits(all[k], one[k]), "logit %zu: %.9g in one step, %.9g alone", k, all[k],
                  one[k]);
    free(all);
    free(one);
    eng_model_free(&m);
}

/* The MoE's llama.cpp conversion (GGUF qwen35moe, --no-mtp): qwen35's
 * layers, the experts stacked in ffn_{gate,up,down}_exps and split per
 * expert, the router ffn_gate_inp, the shared expert ffn_*_shexp with its
 * gate ffn_gate_inp_shexp; no feed_forward_length (the config has no
 * intermediate_size): the same float64 logits within the folder's
 * tolerance. */
Test(qwen35, moe_gguf_from_llama_cpp_equals_transformers)
{
    eng_model m;
    load_fixture_gguf(&m, "qwen35_moe_tiny.gguf", "f32");
    cr_assert_eq(m.cfg.arch, ENG_ARCH_QWEN3_5);
    cr_assert_eq(m.cfg.n_experts, 4);
    cr_assert_eq(m.cfg.n_experts_used, 2);
    cr_assert_eq(m.cfg.expert_ff, 32);
    cr_assert_eq(m.cfg.shared_expert_ff, 48);
    cr_assert(m.cfg.norm_topk_prob);
    cr_assert_eq(m.cfg.linear.n_layers, 3);
    cr_assert(m.cfg.linear.v_tiled && m.cfg.linear.a_neg_exp);
    for (int32_t l = 0; l < 4; l++) {
        cr_assert(eng_layer_is_moe(&m.cfg, l), "layer %d", l);
        cr_assert_eq(m.layers[l].shared_gate.cols, 64, "layer %d", l);
    }
    double worst = worst_in_chunks_of_5(&m, &QWEN35_MOE_LOGITS[0][0]);
    cr_log_info("moe gguf: worst |logit error| %g", worst);
    cr_assert(worst < QWEN35_TOL, "moe gguf: worst |logit error| %g", worst);
    eng_model_free(&m);
}

/* Its q8_0 conversion (the experts' stacks in q8_0, read in place): runs,
 * within about what the rounding does of the float64 logits. */
Test(qwen35, moe_gguf_q8_0_runs_near_the_reference)
{
    eng_model m;
    load_fixture_gguf(&m, "qwen35_moe_tiny_q8_0.gguf", "q8_0");
    cr_assert_eq(m.cfg.n_experts, 4);
    double worst = worst_in_chunks_of_5(&m, &QWEN35_MOE_LOGITS[0][0]);
    cr_log_info("moe gguf q8_0: worst |logit error| %g", worst);
    cr_assert(worst > 1e-3 && worst < QWEN35_MOE_Q8_0_BOUND,
              "moe gguf q8_0: worst |logit error| %g", worst);
    eng_model_free(&m);
}

/* gguf_with_mtp_block's metadata: recurrent_layers a bool per block, the
 * MTP one false; block_count left out (set anew). */
static bool mtp_block_kv(gguf_kv *kv, void *ctx)
{
    static const uint8_t recurrent[5] = {1, 1, 1, 0, 0};
    (void)ctx;
    if (strcmp(kv->key, "qwen35moe.attention.recurrent_layers") == 0) {
        cr_assert_eq(kv->n, 4);
        kv->n = 5;
        kv->data = recurrent;
    }
    return strcmp(kv->key, "qwen35moe.block_count") != 0;
}

/* The MoE's file as the converter writes it without --no-mtp for a
 * checkpoint with one MTP block: that block appended as blk.4
 * (block_count 5, nextn_predict_layers 1, recurrent_layers false for it),
 * here two of its tensors' stand-ins (the output norm's data), into out. */
static void gguf_with_mtp_block(const char *out)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/qwen35_moe_tiny.gguf", QL_FIXTURES);
    static const char *const keys[] = {"qwen35moe.block_count", "qwen35moe.nextn_predict_layers"};
    static const uint32_t values[] = {5, 1};
    static const char *const names[] = {"blk.4.attn_norm.weight", "blk.4.nextn.enorm.weight"};
    static const char *const sources[] = {"output_norm.weight", "output_norm.weight"};
    gguf_rewrite r = {.edit_kv = mtp_block_kv,
                      .u32_keys = keys,
                      .u32_values = values,
                      .n_u32 = 2,
                      .extra_names = names,
                      .extra_sources = sources,
                      .n_extra = 2};
    cr_assert_eq(gguf_writer_rewrite(path, out, &r, msg, sizeof msg), 0, "%s", msg);
}

/* A mixture's MTP blocks (their layer a mixture too) are not read yet, and
 * the forward pass needs none: the decoder is the first block_count -
 * nextn_predict_layers blocks, the logits bit for bit those of the file
 * without the block. A dense file's are read (the last tests). */
Test(qwen35, moe_gguf_mtp_blocks_are_left_unread)
{
    char dir[512], path[600], msg[1024];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/mtp.gguf", dir);
    gguf_with_mtp_block(path);
    eng_model m, plain;
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = path}, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.n_layers, 4);
    cr_assert_eq(m.cfg.linear.n_layers, 3);
    cr_assert(eng_linear_is(&m.cfg.linear, 2) && !eng_linear_is(&m.cfg.linear, 3));
    cr_assert_eq(m.mtp.n_layers, 0);
    load_fixture_gguf(&plain, "qwen35_moe_tiny.gguf", "f32");
    float *got = run_chunks(&m, 5), *want = run_chunks(&plain, 5);
    for (size_t k = 0; k < (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB; k++)
        cr_assert(same_bits(got[k], want[k]), "logit %zu: %.9g, without the MTP block %.9g", k,
                  got[k], want[k]);
    free(got);
    free(want);
    eng_model_free(&plain);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* Quantized on load (in_proj_qkv, in_proj_z, out_proj and the rest of
 * the projections; in_proj_a/b, the conv and the norms stay dense): it
 * runs, and its logits move from transformers' float64 ones by about what
 * the rounding does, int8 less than nf4. */
Test(qwen35, quantized_on_load_stays_near_the_reference)
{
    const char *quants[] = {"int8", "nf4"};
    const double bound[] = {QWEN35_INT8_BOUND, QWEN35_NF4_BOUND};
    const size_t N = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    for (int i = 0; i < 2; i++) {
        char dir[512];
        eng_model m;
        load_qwen35(&m, dir, sizeof dir, quants[i]);
        cr_assert(strncmp(m.quant, quants[i], strlen(quants[i])) == 0, "%s", m.quant);
        float *got = run_chunks(&m, 5);
        double worst = test_max_abs_err(got, &QWEN35_LOGITS[0][0], N);
        cr_log_info("--quant %s: worst |logit error| %g", quants[i], worst);
        cr_assert(worst > 1e-6 && worst < bound[i], "--quant %s: worst |logit error| %g", quants[i],
                  worst);
        free(got);
        eng_model_free(&m);
    }
}

/* llama.cpp's q8_0 conversion (every matrix in q8_0, read in place):
 * runs, within about what the rounding does of the float64 logits. */
Test(qwen35, gguf_q8_0_runs_near_the_reference)
{
    eng_model m;
    load_fixture_gguf(&m, "qwen35_tiny_q8_0.gguf", "q8_0");
    double worst = worst_in_chunks_of_5(&m, &QWEN35_LOGITS[0][0]);
    cr_log_info("gguf q8_0: worst |logit error| %g", worst);
    cr_assert(worst > 1e-3 && worst < QWEN35_Q8_0_BOUND, "gguf q8_0: worst |logit error| %g",
              worst);
    eng_model_free(&m);
}

/* The delta rule's step on this CPU's path (AVX2 where it has it) gives
 * the scalar reference's bits: value widths around multiples of eight,
 * many tokens carried through one state. */
Test(qwen35, delta_rule_fast_path_equals_the_scalar_bit_for_bit)
{
    const int32_t widths[] = {8, 13, 16, 128};
    uint64_t rng = 3505;
    for (size_t w = 0; w < sizeof widths / sizeof *widths; w++) {
        int32_t dk = 16, dv = widths[w];
        float *S1 = calloc((size_t)dk * dv, sizeof(float)), *S2 = calloc((size_t)dk * dv, 4);
        float q[16], k[16], v[128], o1[128], o2[128], m1[128], m2[128];
        for (int t = 0; t < 20; t++) {
            for (int i = 0; i < dk; i++) {
                q[i] = test_normal(&rng);
                k[i] = 0.25f * test_normal(&rng);
            }
            for (int i = 0; i < dv; i++)
                v[i] = test_normal(&rng);
            float decay = (float)test_uniform(&rng), beta = (float)test_uniform(&rng);
            qt_delta_rule(S1, dk, dv, q, k, v, decay, beta, o1, m1);
            qt_delta_rule_ref(S2, dk, dv, q, k, v, decay, beta, o2, m2);
            for (int e = 0; e < dv; e++)
                cr_assert(same_bits(o1[e], o2[e]), "width %d token %d dim %d: %.9g, %.9g", dv, t, e,
                          o1[e], o2[e]);
        }
        for (int32_t i = 0; i < dk * dv; i++)
            cr_assert(same_bits(S1[i], S2[i]), "width %d: state %d", dv, i);
        free(S1);
        free(S2);
    }
}

/* The full layers' partial rotation and the (1 + w) norms, each turned
 * off, move the logits past 1e-3: the test would see either gone. */
Test(qwen35, partial_rotary_and_norm_offset_move_the_logits)
{
    char dir[512];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    const size_t N = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    m.cfg.rope_dim = 0; /* the whole head turning */
    float *got = run_chunks(&m, QWEN35_N_TOKENS);
    double moved = test_max_abs_err(got, &QWEN35_LOGITS[0][0], N);
    cr_assert(moved > 1e-3, "partial rotary off moved the logits by %g only", moved);
    free(got);
    m.cfg.rope_dim = 4;
    m.cfg.norm_offset = 0.0f; /* plain w norms */
    got = run_chunks(&m, QWEN35_N_TOKENS);
    moved = test_max_abs_err(got, &QWEN35_LOGITS[0][0], N);
    cr_assert(moved > 1e-3, "the (1 + w) norms off moved the logits by %g only", moved);
    free(got);
    eng_model_free(&m);
}

/* Greedy decoding after the prompt: the 12 ids transformers' float64
 * forward chooses. */
Test(qwen35, greedy_ids_equal_transformers)
{
    char dir[512], msg[1024];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    const int n = QWEN35_N_TOKENS, total = n + QWEN35_N_GREEDY;
    const size_t V = (size_t)m.cfg.vocab_size;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&kv, &m.cfg, (size_t)8 << 20, 4, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, &m, n, msg, sizeof msg), 0, "%s", msg);
    eng_seq_kv skv = {0};
    cr_assert_eq(eng_kv_reserve(kv, &skv, total), 0);
    int32_t toks[QWEN35_N_TOKENS + QWEN35_N_GREEDY];
    for (int i = 0; i < n; i++)
        toks[i] = QWEN35_TOKENS[i];
    float *logits = malloc(V * sizeof(float));
    for (int p = 0, k = n; p < total - 1; p += k, k = 1) {
        eng_step_seq s = {.kv = &skv, .tokens = toks + p, .n_tokens = k, .pos = p};
        cr_assert_eq(eng_forward(st, &m, kv, pool, &s, 1, logits, msg, sizeof msg), 0, "%s", msg);
        int32_t best = 0;
        for (size_t v = 1; v < V; v++)
            if (logits[v] > logits[best])
                best = (int32_t)v;
        toks[p + k] = best;
        cr_assert_eq(best, QWEN35_GREEDY[p + k - n], "greedy id %d", p + k - n);
    }
    free(logits);
    eng_kv_release(kv, &skv);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    eng_model_free(&m);
}

/* A fork carries on from a copy of its source's state: both continue with
 * the same token to the same bits as the source alone would; ended, each
 * gives its state back. A step that does not start where a state is
 * (a rewind) is refused. */
Test(qwen35, fork_copies_the_state_and_release_gives_it_back)
{
    char dir[512], msg[1024];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    const int n = 10;
    const size_t V = (size_t)m.cfg.vocab_size;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new_states(&kv, &m.cfg, (size_t)8 << 20, 4, QT_F32, 3, msg, sizeof msg), 0,
                 "%s", msg);
    cr_assert_eq(eng_kv_total_states(kv), 3);
    cr_assert_eq(eng_kv_free_states(kv), 3);
    cr_assert_eq(eng_forward_state_new(&st, &m, n, msg, sizeof msg), 0, "%s", msg);
    int32_t toks[QWEN35_N_TOKENS];
    for (int i = 0; i < QWEN35_N_TOKENS; i++)
        toks[i] = QWEN35_TOKENS[i];
    eng_seq_kv a = {0}, b = {0};
    cr_assert_eq(eng_kv_reserve(kv, &a, n + 1), 0);
    cr_assert_eq(eng_kv_free_states(kv), 2);
    /* the fork's blocks, and one for a's own copy on write of the shared last block */
    cr_assert_eq(eng_kv_hold(kv, &a, eng_kv_fork_blocks(kv, n, n + 1) + 1), 0);
    float *la = malloc(2 * V * sizeof(float)), *lb = la + V;
    eng_step_seq s = {.kv = &a, .tokens = toks, .n_tokens = n};
    cr_assert_eq(eng_forward(st, &m, kv, pool, &s, 1, la, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_fork(kv, &b, &a, n + 1), 0);
    cr_assert_eq(eng_kv_free_states(kv), 1, "the fork took a state of its own");
    eng_kv_copy copies[4];
    int32_t n_copies = 0;
    cr_assert_eq(eng_kv_prepare_write(kv, &a, n, 1, copies, 4, &n_copies), 0);
    cr_assert_eq(eng_kv_prepare_write(kv, &b, n, 1, copies, 4, &n_copies), 0);
    eng_kv_copy_blocks(kv, copies, n_copies);
    eng_step_seq both[2] = {{.kv = &a, .tokens = toks + n, .n_tokens = 1, .pos = n},
                            {.kv = &b, .tokens = toks + n, .n_tokens = 1, .pos = n}};
    cr_assert_eq(eng_forward(st, &m, kv, pool, both, 2, la, msg, sizeof msg), 0, "%s", msg);
    for (size_t v = 0; v < V; v++)
        cr_assert(same_bits(la[v], lb[v]), "logit %zu: %.9g, the fork's %.9g", v, la[v], lb[v]);
    /* the same position again: a recurrent state cannot be rewound */
    cr_assert_neq(eng_forward(st, &m, kv, pool, both, 1, la, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "recurrent state"), "%s", msg);
    eng_kv_release(kv, &b);
    eng_kv_release(kv, &a);
    cr_assert_eq(eng_kv_free_states(kv), 3, "every state back");
    free(la);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    eng_model_free(&m);
}

/* The pool's states come out of the cache's bytes first: too few bytes for
 * them and a block is refused, naming the linear layers; the blocks hold
 * the full layers' keys and values only. */
Test(qwen35, state_pool_is_sized_with_the_kv_cache)
{
    char dir[512], msg[1024];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    eng_kv_cache *kv;
    size_t one = (size_t)eng_linear_seq_state(&m.cfg.linear) * sizeof(float);
    cr_assert_eq(one, 4 * (3 * 96 + 4 * 16 * 8) * sizeof(float));
    /* a block holds the two full layers' keys and values alone */
    cr_assert_eq(eng_kv_token_bytes(&m.cfg, QT_F32), 2 * 2 * 32 * sizeof(float));
    cr_assert_neq(eng_kv_new_states(&kv, &m.cfg, 4 * one, 4, QT_F32, 4, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "recurrent states"), "%s", msg);
    cr_assert_eq(eng_kv_new_states(&kv, &m.cfg, (size_t)1 << 20, 4, QT_F32, 4, msg, sizeof msg), 0,
                 "%s", msg);
    cr_assert_eq(eng_kv_state_bytes(kv), one);
    size_t blocks = ((size_t)1 << 20) - 4 * one;
    cr_assert_eq(eng_kv_total_blocks(kv),
                 (int32_t)(blocks / (4 * eng_kv_token_bytes(&m.cfg, QT_F32))));
    eng_kv_free(kv);
    eng_model_free(&m);
}

/* (the CUDA backend runs the model too: tests/gpu/test_cuda_hybrid.c) */
Test(qwen35, backend_keeps_one_state_per_sequence_a_step_carries)
{
    char dir[512], msg[1024];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    eng_backend *b = NULL;
    eng_backend_opts o = {.device = ENG_DEVICE_CPU,
                          .threads = 1,
                          .max_tokens = 16,
                          .max_seqs = 2,
                          .kv_bytes = (size_t)4 << 20};
    cr_assert_eq(eng_backend_new(&b, &m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_total_states(eng_backend_kv(b)), 2,
                 "one state per sequence a step carries");
    eng_backend_free(b);
    eng_model_free(&m);
}

/* dir's config.json with its first `from` replaced by `to`. */
static void edit_config(const char *dir, const char *from, const char *to)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len;
    char *text = test_read_file(path, &len);
    char *at = strstr(text, from);
    cr_assert(at, "%s not in config.json", from);
    char edited[8192];
    snprintf(edited, sizeof edited, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    cr_assert(test_write_file(path, edited, strlen(edited)));
    free(text);
}

/* One sequence of a model on a fresh cache of its own, stepped by hand. */
typedef struct one_seq {
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    eng_seq_kv s;
    float *last; /* the step's logits */
} one_seq;

static void one_open(one_seq *o, const eng_model *m, int32_t n)
{
    char msg[1024];
    cr_assert_eq(eng_pool_new(&o->pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&o->kv, &m->cfg, (size_t)8 << 20, 4, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&o->st, m, n, msg, sizeof msg), 0, "%s", msg);
    o->s = (eng_seq_kv){0};
    cr_assert_eq(eng_kv_reserve(o->kv, &o->s, n + 1), 0);
    o->last = malloc((size_t)m->cfg.vocab_size * sizeof(float));
}

static void one_step(one_seq *o, const eng_model *m, eng_step_seq q)
{
    char msg[1024];
    q.kv = &o->s;
    cr_assert_eq(eng_forward(o->st, m, o->kv, o->pool, &q, 1, o->last, msg, sizeof msg), 0, "%s",
                 msg);
}

static void one_close(one_seq *o)
{
    eng_kv_release(o->kv, &o->s);
    eng_forward_state_free(o->st);
    eng_kv_free(o->kv);
    eng_pool_free(o->pool);
    free(o->last);
}

/* The MTP layer of qwen35_mtp_tiny run as vLLM's Qwen3.5 MTP runs it (mtp.h): the target's
 * final-normed hidden states (eng_step_seq.hidden_out) and the next tokens through
 * eng_mtp_input, the layer as a model of its own (eng_mtp_view) taking those rows in place of
 * embeddings (eng_step_seq.embeds), with its own KV: every row's logits match
 * make_qwen35_mtp.py's float64 reference, their argmax its drafts, and a second draft chained
 * on the MTP's own output too. */
static void mtp_drafts_as_the_reference(const eng_model *m, const char *what)
{
    eng_model v;
    const int32_t n = QWEN35_MTP_N_TOKENS;
    const size_t H = (size_t)m->cfg.hidden_size, V = (size_t)m->cfg.vocab_size;
    int32_t toks[QWEN35_MTP_N_TOKENS];
    for (int32_t i = 0; i < n; i++)
        toks[i] = QWEN35_MTP_TOKENS[i];
    float *hidden = malloc(n * H * sizeof(float)), *out = malloc(n * H * sizeof(float));
    float *x = malloc(n * H * sizeof(float)), *all = malloc(n * V * sizeof(float));
    float *cat = malloc(n * 2 * H * sizeof(float));
    // the target: every position's hidden state after the final norm
    one_seq t, d;
    one_open(&t, m, n);
    one_step(&t, m, (eng_step_seq){.tokens = toks, .n_tokens = n, .hidden_out = hidden});
    // the MTP: row i takes token i + 1 and hidden state i, at position i
    eng_mtp_view(m, &v);
    one_open(&d, &v, n);
    cr_assert_eq(eng_mtp_input(d.pool, m, toks + 1, hidden, n - 1, cat, x), QL_OK);
    one_step(&d, &v,
             (eng_step_seq){.tokens = toks + 1,
                            .n_tokens = n - 1,
                            .embeds = x,
                            .all_logits = all,
                            .hidden_out = out});
    double worst = test_max_abs_err(all, &QWEN35_MTP_LOGITS[0][0], (size_t)(n - 1) * V);
    cr_log_info("%s: MTP rows, worst |logit error| %g", what, worst);
    cr_assert(worst < QWEN35_TOL, "%s: MTP rows, worst |logit error| %g", what, worst);
    for (int32_t i = 0; i < n - 1; i++) {
        size_t best = 0;
        for (size_t k = 1; k < V; k++)
            best = all[i * V + k] > all[i * V + best] ? k : best;
        cr_assert_eq((int)best, QWEN35_MTP_DRAFT[i], "%s: row %d's draft", what, i);
    }
    // the second draft: the MTP's own output and its draft, at position n - 1
    int32_t draft = QWEN35_MTP_DRAFT[n - 2];
    cr_assert_eq(eng_mtp_input(d.pool, m, &draft, out + (size_t)(n - 2) * H, 1, cat, x), QL_OK);
    one_step(&d, &v, (eng_step_seq){.tokens = &draft, .n_tokens = 1, .pos = n - 1, .embeds = x});
    worst = test_max_abs_err(d.last, QWEN35_MTP_CHAIN_LOGITS, V);
    cr_log_info("%s: the chained draft, worst |logit error| %g", what, worst);
    cr_assert(worst < QWEN35_TOL, "%s: the chained draft, worst |logit error| %g", what, worst);
    one_close(&d);
    one_close(&t);
    free(hidden);
    free(out);
    free(x);
    free(all);
    free(cat);
}

Test(qwen35, mtp_layer_drafts_as_the_float64_reference)
{
    char dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    tiny_fixture_folder("qwen35_mtp_tiny", dir);
    eng_model m;
    eng_load_opts lo = {.path = dir};
    cr_assert_eq(eng_model_load(&m, &lo, msg, sizeof msg), 0, "%s", msg);
    mtp_drafts_as_the_reference(&m, "folder");
    eng_model_free(&m);
    test_rmtree(dir);
}

/* config.json edited to an option qlserve does not run: refused, naming it. */
static void refused_with(const char *from, const char *to, const char *named)
{
    char dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    tiny_fixture_folder("qwen35_tiny", dir);
    edit_config(dir, from, to);
    eng_model m;
    eng_load_opts o = {.path = dir};
    cr_assert_neq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s loaded", to);
    cr_assert(strstr(msg, named), "%s: %s", named, msg);
}

/* qwen35_mtp_tiny (make_qwen35_mtp.py) is qwen35_tiny plus one MTP layer: its tensors are read
 * beside the decoder's, every one of them (the weight bytes grow by exactly theirs), with the
 * decoder unchanged (the same float64 logits); a config that declares MTP layers the
 * checkpoint does not hold loads without them. */
Test(qwen35, mtp_layers_are_read_beside_the_decoder)
{
    char dir[512], mdir[512], msg[1024];
    eng_model plain, m;
    load_qwen35(&plain, dir, sizeof dir, NULL);
    cr_assert_eq(plain.mtp.n_layers, 0);
    test_tmpdir(mdir, sizeof mdir);
    cr_assert(mdir[0]);
    tiny_fixture_folder("qwen35_mtp_tiny", mdir);
    eng_load_opts o = {.path = mdir};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.linear.mtp_layers, 1);
    cr_assert_eq(m.mtp.n_layers, 1);
    int64_t H = m.cfg.hidden_size, F = m.cfg.intermediate_size;
    int64_t Q = (int64_t)m.cfg.n_heads * m.cfg.head_dim,
            KV = (int64_t)m.cfg.n_kv_heads * m.cfg.head_dim;
    cr_assert_eq(m.mtp.fc.rows, H);
    cr_assert_eq(m.mtp.fc.cols, 2 * H);
    cr_assert_eq(m.mtp.norm_hidden.rows * m.mtp.norm_hidden.cols, H);
    const eng_layer *ly = &m.mtp.layers[0];
    cr_assert_eq(ly->wo.cols, Q);
    cr_assert_eq(ly->w_down.cols, F);
    /* fc, three norms; the layer's two norms, gated q, k, v, o, q/k norms, gate, up, down */
    int64_t floats =
        2 * H * H + 3 * H + 2 * H + 2 * Q * H + 2 * KV * H + H * Q + 2 * m.cfg.head_dim + 3 * F * H;
    cr_assert_eq(eng_model_weight_bytes(&m) - eng_model_weight_bytes(&plain),
                 (size_t)floats * sizeof(float), "every MTP tensor is the model's, f32");
    double worst = worst_in_chunks_of_5(&m, &QWEN35_LOGITS[0][0]);
    cr_assert(worst < QWEN35_TOL, "the decoder beside the MTP layer: worst |logit error| %g",
              worst);
    eng_model_free(&m);
    test_rmtree(mdir);
    eng_model_free(&plain);
    test_rmtree(dir);
    /* declared, not shipped */
    test_tmpdir(mdir, sizeof mdir);
    tiny_fixture_folder("qwen35_tiny", mdir);
    edit_config(mdir, "\"use_cache\"", "\"mtp_num_hidden_layers\": 1, \"use_cache\"");
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.linear.mtp_layers, 1);
    cr_assert_eq(m.mtp.n_layers, 0, "no mtp.* tensors: no MTP layers");
    eng_model_free(&m);
    test_rmtree(mdir);
}

/* A mixture's MTP layer is a mixture layer, not read yet: a Qwen3.5-MoE folder that ships
 * mtp.* (the hub's do) loads without it, as its GGUF does, and --speculative mtp says why it
 * has none. Here the MoE fixture with mtp_num_hidden_layers 1 and an mtp.fc.weight in a second
 * shard. */
Test(qwen35, moe_folder_mtp_layers_are_left_unread)
{
    char dir[512], path[700], msg[1024];
    test_tmpdir(dir, sizeof dir);
    tiny_fixture_folder("qwen35_moe_tiny", dir);
    edit_config(dir, "\"use_cache\"", "\"mtp_num_hidden_layers\": 1, \"use_cache\"");
    static float fc[64 * 128];
    st_writer *w = st_writer_new();
    cr_assert_eq(st_writer_add(w, "mtp.fc.weight", ST_F32, 2, (const int64_t[]){64, 128}, fc,
                               sizeof fc, false, msg, sizeof msg),
                 0, "%s", msg);
    snprintf(path, sizeof path, "%s/mtp.safetensors", dir);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    static const char index[] = "{\"weight_map\": {\"mtp.fc.weight\": \"mtp.safetensors\", "
                                "\"model.norm.weight\": \"model.safetensors\"}}";
    cr_assert(test_write_file(path, index, strlen(index)));
    eng_model m;
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.cfg.linear.mtp_layers, 1);
    cr_assert_eq(m.mtp.n_layers, 0);
    eng_engine_opts o = {.threads = 1, .kv_bytes = 1 << 20, .spec = {.drafter = ENG_SPEC_MTP}};
    eng_engine *e = NULL;
    cr_assert_eq(eng_engine_start(&e, &m, &o, msg, sizeof msg), QL_EUNSUPPORTED, "%s", msg);
    cr_assert(strstr(msg, "MTP layers (1) are mixture-of-experts layers"), "%s", msg);
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(qwen35, options_it_does_not_run_are_refused_by_name)
{
    refused_with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act gelu");
    refused_with("\"attention_bias\": false", "\"attention_bias\": true", "attention_bias");
    refused_with("\"full_attention\",\n    \"linear_attention\"",
                 "\"sliding_attention\",\n    \"linear_attention\"", "sliding_attention");
    refused_with("\"use_cache\": true", "\"use_cache\": true, \"attn_output_gate\": false",
                 "attn_output_gate");
}

/* The adapter's fixture folder loaded onto m. */
static eng_lora *load_qwen35_lora(eng_model *m)
{
    char adir[1024], msg[1024];
    eng_lora *lora = NULL;
    snprintf(adir, sizeof adir, "%s/qwen35_lora", QL_FIXTURES);
    cr_assert_eq(lora_load(&lora, NULL, adir, "q35", m, msg, sizeof msg), 0, "%s", msg);
    return lora;
}

Test(qwen35, peft_adapter_unmerged_and_merged_equals_peft_float64)
{
    char dir[512];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    eng_lora *lora = load_qwen35_lora(&m);
    /* the linear layers' modules by their own names, the full layers' q and v */
    cr_assert(eng_lora_module_at(lora, 0, ENG_PROJ_Q) && eng_lora_module_at(lora, 0, ENG_PROJ_K) &&
              eng_lora_module_at(lora, 0, ENG_PROJ_O));
    cr_assert_null(eng_lora_module_at(lora, 0, ENG_PROJ_V));
    cr_assert(eng_lora_module_at(lora, 3, ENG_PROJ_Q) && eng_lora_module_at(lora, 3, ENG_PROJ_V));
    cr_assert_null(eng_lora_module_at(lora, 3, ENG_PROJ_K));
    const size_t N = (size_t)QWEN35_N_TOKENS * QWEN35_VOCAB;
    eng_lora_term term = {lora, 1.0f};
    prompt_run r = {.tokens = (const int32_t *)QWEN35_TOKENS,
                    .n_tokens = QWEN35_N_TOKENS,
                    .prefill = 7,
                    .delta = &term,
                    .n_delta = 1};
    float *all = run_prompt(&m, &r);
    double worst = test_max_abs_err(all, &QWEN35_LORA_LOGITS[0][0], N);
    cr_assert(worst < QWEN35_TOL, "unmerged: worst |logit error| %g", worst);
    /* the adapter does something: the base's logits are far from these */
    double moved = test_max_abs_err(all, &QWEN35_LOGITS[0][0], N);
    cr_assert_gt(moved, 1e-2, "the adapter moved the logits by only %g", moved);
    free(all);
    /* merged into the f32 weights: W + BA rounded once */
    eng_weights *v = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    r = (prompt_run){.tokens = (const int32_t *)QWEN35_TOKENS,
                     .n_tokens = QWEN35_N_TOKENS,
                     .prefill = 7,
                     .weights = v};
    all = run_prompt(&m, &r);
    worst = test_max_abs_err(all, &QWEN35_LORA_LOGITS[0][0], N);
    cr_assert(worst < QWEN35_TOL, "merged: worst |logit error| %g", worst);
    free(all);
    eng_weights_unref(v);
    eng_lora_unref(lora);
    eng_model_free(&m);
}

/* in_proj_b and in_proj_a are dense parameters here: an adapter on them
 * is refused by name. */
Test(qwen35, adapter_on_in_proj_a_is_refused_by_name)
{
    char dir[512], adir[600], tmp[400], msg[1024];
    eng_model m;
    load_qwen35(&m, dir, sizeof dir, NULL);
    test_tmpdir(tmp, sizeof tmp);
    snprintf(adir, sizeof adir, "%s/adapter", tmp);
    lora_fix_spec s = lora_fix_default();
    s.projs = 1u << ENG_PROJ_Q;
    s.target_modules = "[\"in_proj_qkv\", \"in_proj_a\"]";
    lora_fix_write(adir, &m.cfg, &s);
    eng_lora *lora = NULL;
    cr_assert_neq(lora_load(&lora, NULL, adir, "a", &m, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "linear_attn.in_proj_a"), "%s", msg);
    test_rmtree(tmp);
    eng_model_free(&m);
}

/* The served folder: the fixture's config and weights beside the tiny
 * byte-level tokenizer ts_start_spec wrote. */
static void qwen35_weights(const char *model_dir)
{
    const char *files[] = {"config.json", "model.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        char from[1024], to[1024];
        snprintf(from, sizeof from, "%s/qwen35_tiny/%s", QL_FIXTURES, files[i]);
        snprintf(to, sizeof to, "%s/%s", model_dir, files[i]);
        cr_assert(test_copy_file(from, to), "%s", from);
    }
}

static char *get_text(const char *path)
{
    hc_response r = sp_request("GET", path, NULL, NULL);
    cr_assert_eq(r.status, 200, "GET %s -> %d", path, r.status);
    char *text = strdup(r.body);
    hc_response_free(&r);
    return text;
}

Test(qwen35, served_choices_fork_the_state_with_the_prefix_cache_off, .timeout = 120)
{
    tiny_spec spec = tiny_default();
    ts_start_spec(TS_JOIN_TEMPLATE, &spec, qwen35_weights, NULL);
    char *info = get_text("/info");
    cJSON *j = sp_json(info);
    cr_assert_str_eq(sp_str_at(j, "prefix_cache"), "off", "%s", info);
    cr_assert(strstr(sp_str_at(j, "prefix_cache_off_because"), "linear-attention"), "%s", info);
    cr_assert_gt(sp_num_at(j, "recurrent_states_total"), 0);
    cJSON_Delete(j);
    free(info);
    char *log = sp_read_log();
    cr_assert(strstr(log, "prefix cache off: the model has linear-attention layers"), "%s", log);
    free(log);
    /* one choice, then three of the same prompt: every greedy choice is the one */
    cJSON *one = ts_ok("/v1/completions",
                       "{\"prompt\": \"Hello world\", \"max_tokens\": 10, \"temperature\": 0}");
    const char *want =
        sp_str_at(cJSON_GetArrayItem(cJSON_GetObjectItem(one, "choices"), 0), "text");
    cJSON *three = ts_ok("/v1/completions", "{\"prompt\": \"Hello world\", \"max_tokens\": 10, "
                                            "\"temperature\": 0, \"n\": 3}");
    const cJSON *choices = cJSON_GetObjectItem(three, "choices");
    cr_assert_eq(cJSON_GetArraySize(choices), 3);
    for (int i = 0; i < 3; i++)
        cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(choices, i), "text"), want, "choice %d", i);
    cJSON_Delete(three);
    cJSON_Delete(one);
    /* every state back once the requests are done */
    char *metrics = get_text("/metrics");
    cr_assert(strstr(metrics, "\nqlserve_recurrent_states_used 0\n"), "%s", metrics);
    cr_assert(strstr(metrics, "\nqlserve_recurrent_states_total "), "%s", metrics);
    free(metrics);
    ts_teardown();
}

/* llama.cpp's converter keeps a checkpoint's MTP layer unless told --no-mtp: qwen35_mtp_tiny.gguf
 * (make_qwen35_mtp.py) is block_count 7 with nextn_predict_layers 1, the layer as blk.6 and fc,
 * the input norms and mtp.norm as blk.6.nextn.eh_proj, .enorm, .hnorm, .shared_head_norm (the
 * norms stored as 1 + w). They are read into the same eng_model.mtp as the folder's, so the
 * decoder is the first six blocks (the float64 logits), the weights are the folder's byte for
 * byte in count, and the MTP drafts as the float64 reference within the folder's tolerance. The
 * file converted with --no-mtp has none. */
Test(qwen35, gguf_mtp_blocks_draft_as_the_float64_reference)
{
    char dir[512], msg[1024];
    eng_model m, plain, folder;
    load_fixture_gguf(&m, "qwen35_mtp_tiny.gguf", "f32");
    cr_assert_eq(m.cfg.n_layers, 6);
    cr_assert_eq(m.cfg.linear.n_layers, 4);
    cr_assert_eq(m.cfg.linear.mtp_layers, 1);
    cr_assert_eq(m.mtp.n_layers, 1);
    cr_assert_eq(m.mtp.fc.rows, m.cfg.hidden_size);
    cr_assert_eq(m.mtp.fc.cols, 2 * m.cfg.hidden_size);
    load_fixture_gguf(&plain, "qwen35_tiny.gguf", "f32");
    cr_assert_eq(plain.cfg.linear.mtp_layers, 0);
    cr_assert_eq(plain.mtp.n_layers, 0, "converted with --no-mtp: no MTP layers");
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    tiny_fixture_folder("qwen35_mtp_tiny", dir);
    cr_assert_eq(eng_model_load(&folder, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(eng_model_weight_bytes(&m), eng_model_weight_bytes(&folder));
    cr_assert_gt(eng_model_weight_bytes(&m), eng_model_weight_bytes(&plain));
    double worst = worst_in_chunks_of_5(&m, &QWEN35_LOGITS[0][0]);
    cr_assert(worst < QWEN35_TOL, "the decoder beside the MTP blocks: worst |logit error| %g",
              worst);
    mtp_drafts_as_the_reference(&m, "gguf");
    eng_model_free(&folder);
    eng_model_free(&plain);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* mtp_gguf_refused's edit_kv: leaves out the key ctx names. */
static bool without_key(gguf_kv *kv, void *ctx)
{
    return strcmp(kv->key, ctx) != 0;
}

/* qwen35_mtp_tiny.gguf rewritten with r: refused, the message naming `named` and `too`. */
static void mtp_gguf_refused(const gguf_rewrite *r, const char *named, const char *too)
{
    char dir[512], path[600], src[1024], msg[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(path, sizeof path, "%s/mtp.gguf", dir);
    snprintf(src, sizeof src, "%s/qwen35_mtp_tiny.gguf", QL_FIXTURES);
    cr_assert_eq(gguf_writer_rewrite(src, path, r, msg, sizeof msg), 0, "%s", msg);
    eng_model m;
    cr_assert_neq(eng_model_load(&m, &(eng_load_opts){.path = path}, msg, sizeof msg), 0,
                  "loaded; expected a refusal naming %s", named);
    cr_log_info("refused: %s", msg);
    cr_assert(strstr(msg, named) && strstr(msg, too), "%s, %s: %s", named, too, msg);
    test_rmtree(dir);
}

/* A GGUF whose nextn_predict_layers disagrees with its nextn tensors is refused by name: the
 * key left out (block 6 read as a decoder block, yet it has blk.6.nextn.*), the key saying 2
 * (the MTP's tensors on block 6, not the first past a decoder of five), the fc missing; so are
 * MTP layers with their own embeddings (nextn.embed_tokens), which qlserve does not run. */
Test(qwen35, gguf_mtp_blocks_disagreeing_with_nextn_predict_layers_are_refused)
{
    static const char *const key[] = {"qwen35.nextn_predict_layers"};
    static const uint32_t two[] = {2};
    mtp_gguf_refused(&(gguf_rewrite){.edit_kv = without_key, .ctx = (void *)key[0]}, "blk.6.nextn.",
                     "qwen35.nextn_predict_layers = 0");
    mtp_gguf_refused(&(gguf_rewrite){.edit_kv = without_key,
                                     .ctx = (void *)key[0],
                                     .u32_keys = key,
                                     .u32_values = two,
                                     .n_u32 = 1},
                     "blk.6.nextn.", "qwen35.nextn_predict_layers = 2");
    mtp_gguf_refused(&(gguf_rewrite){.rename_from = "blk.6.nextn.eh_proj.weight",
                                     .rename_to = "blk.6.eh_proj.weight"},
                     "blk.6.nextn.eh_proj.weight", "missing");
    static const char *const own[] = {"blk.6.nextn.embed_tokens.weight"}, *const from[] = {
                                                                              "token_embd.weight"};
    mtp_gguf_refused(&(gguf_rewrite){.extra_names = own, .extra_sources = from, .n_extra = 1},
                     "blk.6.nextn.embed_tokens.weight", "embeddings");
}

/* Without blk.6.nextn.shared_head_norm the MTP's final norm is the model's own
 * output_norm, as llama.cpp's MTP graph falls back to it. */
Test(qwen35, gguf_mtp_without_its_final_norm_uses_the_models)
{
    char dir[512], path[600], src[1024], msg[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(path, sizeof path, "%s/mtp.gguf", dir);
    snprintf(src, sizeof src, "%s/qwen35_mtp_tiny.gguf", QL_FIXTURES);
    gguf_rewrite r = {.rename_from = "blk.6.nextn.shared_head_norm.weight",
                      .rename_to = "blk.6.shared_head_norm.weight"};
    cr_assert_eq(gguf_writer_rewrite(src, path, &r, msg, sizeof msg), 0, "%s", msg);
    eng_model m;
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = path}, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(m.mtp.n_layers, 1);
    size_t H = (size_t)m.cfg.hidden_size;
    float *got = malloc(2 * H * sizeof(float)), *want = got + H;
    qt_dequantize_rows(&m.mtp.norm, 0, m.mtp.norm.rows, got);
    qt_dequantize_rows(&m.norm, 0, m.norm.rows, want);
    cr_assert_eq(memcmp(got, want, H * sizeof(float)), 0);
    free(got);
    eng_model_free(&m);
    test_rmtree(dir);
}

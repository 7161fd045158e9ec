/*
 * test_moe.c - what a mixture of experts promises beyond its logits
 * (test_architectures.c pins those against transformers' float64 forward):
 *
 *   - a sequence gets the same bits in a step shared with others as alone,
 *     though its rows are grouped with theirs by expert;
 *   - each chosen expert runs once per layer and step, whatever number of
 *     rows chose it, and an expert no row chose is never read (the step's
 *     figures, eng_backend_moe_step / eng_forward_moe_step, and /metrics);
 *   - a config or file whose experts we cannot run is refused by name;
 *   - the binary serves a mixture from its folder (its FP8 one too) and its
 *     GGUF through the completions, chat and TGI routes.
 *
 * The fixtures are make_moe_reference.py's tiny models (8 experts, 2 per
 * token, 3 layers; Qwen2-MoE's with its shared expert).
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fixtures/gptoss_lora_reference.h"
#include "fixtures/moe_reference.h"
#include "gguf_writer.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "quant_checkpoint.h"
#include "ref_forward.h"
#include "run_prompt.h"
#include "runtime.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

/* tests/fixtures/<name> as a folder the loader takes, in a temporary dir
 * (*dir, to test_rmtree), loaded into *m. */
static void load_fixture(const char *name, eng_model *m, char *dir, size_t cap)
{
    test_tmpdir(dir, cap);
    cr_assert(dir[0]);
    tiny_fixture_folder(name, dir);
    char msg[1024];
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s: %s", name, msg);
}

/* A step's runner: a pool, a cache and a forward state of 32 rows. */
typedef struct step_env {
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
} step_env;

static void env_new(step_env *env, const eng_model *m)
{
    char msg[512];
    cr_assert_eq(eng_pool_new(&env->pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&env->kv, &m->cfg, (size_t)4 << 20, 4, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&env->st, m, 32, msg, sizeof msg), 0, "%s", msg);
}

static void env_free(step_env *env)
{
    eng_forward_state_free(env->st);
    eng_kv_free(env->kv);
    eng_pool_free(env->pool);
}

/* One step of n sequences, each a prompt from position 0; each sequence's
 * last-row logits into logits[n][vocab]. */
static void prefill(step_env *env, const eng_model *m, const int32_t *const *tokens,
                    const int *lens, int n, float *logits)
{
    eng_seq_kv skv[4] = {0};
    eng_step_seq seqs[4];
    for (int s = 0; s < n; s++) {
        cr_assert_eq(eng_kv_reserve(env->kv, &skv[s], lens[s]), 0);
        seqs[s] = (eng_step_seq){.kv = &skv[s], .tokens = tokens[s], .n_tokens = lens[s]};
    }
    char msg[512];
    cr_assert_eq(eng_forward(env->st, m, env->kv, env->pool, seqs, n, logits, msg, sizeof msg), 0,
                 "%s", msg);
    for (int s = 0; s < n; s++)
        eng_kv_release(env->kv, &skv[s]);
}

Test(moe, a_sequence_gets_the_same_bits_in_a_shared_step)
{
    char dir[512];
    eng_model m;
    load_fixture("qwen2moe_tiny", &m, dir, sizeof dir);
    step_env env;
    env_new(&env, &m);
    size_t V = (size_t)m.cfg.vocab_size;
    const int32_t *prompts[3] = {QWEN2MOE_TOKENS, QWEN2MOE_TOKENS + 5, QWEN2MOE_TOKENS + 2};
    int lens[3] = {9, 11, 6};
    float *together = malloc(3 * V * sizeof(float)), *alone = malloc(V * sizeof(float));
    cr_assert(together && alone);
    prefill(&env, &m, prompts, lens, 3, together);
    for (int s = 0; s < 3; s++) {
        prefill(&env, &m, &prompts[s], &lens[s], 1, alone);
        cr_assert_eq(memcmp(alone, together + (size_t)s * V, V * sizeof(float)), 0,
                     "sequence %d: its logits in a step of three differ from its own step's", s);
    }
    free(together);
    free(alone);
    env_free(&env);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* The bytes of one expert's three weights (the fixture's experts are all
 * of one kind and shape). */
static uint64_t expert_bytes(const eng_model *m)
{
    uint64_t n = 0;
    for (int k = 0; k < 3; k++)
        n += qt_nbytes(eng_model_proj(m, 0, eng_expert_proj(0, (eng_proj)(ENG_PROJ_GATE + k))));
    return n;
}

Test(moe, each_chosen_expert_runs_once_per_step)
{
    char dir[512];
    eng_model m;
    load_fixture("qwen3moe_tiny", &m, dir, sizeof dir);
    step_env env;
    env_new(&env, &m);
    float *logits = malloc(2 * (size_t)m.cfg.vocab_size * sizeof(float));
    cr_assert(logits);
    uint64_t ran, bytes, L = (uint64_t)m.cfg.n_layers;
    // one token: its two experts in each of the three layers, nothing else
    const int32_t *one[1] = {QWEN3MOE_TOKENS};
    int len1[1] = {1};
    prefill(&env, &m, one, len1, 1, logits);
    eng_forward_moe_step(env.st, &ran, &bytes);
    cr_assert_eq(ran, 2 * L, "one token ran %llu experts over %llu layers", (unsigned long long)ran,
                 (unsigned long long)L);
    cr_assert_eq(bytes, ran * expert_bytes(&m));
    // sixteen tokens choose 32 (token, expert) pairs of 8 experts per layer:
    // each chosen expert runs once, so at most 8 per layer, never 32
    const int32_t *two[2] = {QWEN3MOE_TOKENS, QWEN3MOE_TOKENS + 3};
    int len2[2] = {QWEN3MOE_N_TOKENS, 10};
    prefill(&env, &m, two, len2, 2, logits);
    eng_forward_moe_step(env.st, &ran, &bytes);
    cr_assert_leq(ran, 8 * L, "%llu experts ran", (unsigned long long)ran);
    cr_assert_gt(ran, 2 * L, "26 tokens all chose the same two experts in every layer?");
    cr_assert_eq(bytes, ran * expert_bytes(&m));
    free(logits);
    env_free(&env);
    eng_model_free(&m);

    // a dense model has no figures
    char msg[512];
    eng_forward_state *st;
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = QL_FIXTURES "/qwen3_tiny.gguf"}, msg,
                                sizeof msg),
                 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, &m, 4, msg, sizeof msg), 0, "%s", msg);
    eng_forward_moe_step(st, &ran, &bytes);
    cr_assert_eq(ran + bytes, 0);
    eng_forward_state_free(st);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* The fixture's config.json with `edit` applied (a cJSON change), loaded:
 * refused, the message holding needle. */
static void refused_with(const char *fixture, void (*edit)(cJSON *c), const char *needle)
{
    char dir[512], path[600], msg[1024];
    test_tmpdir(dir, sizeof dir);
    tiny_fixture_folder(fixture, dir);
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = test_read_file(path, NULL);
    cJSON *c = cJSON_Parse(text);
    free(text);
    cr_assert(c);
    edit(c);
    char *out = cJSON_Print(c);
    test_write_text(path, out);
    free(out);
    cJSON_Delete(c);
    eng_model m;
    eng_load_opts o = {.path = dir};
    cr_assert_neq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s loaded", fixture);
    cr_assert(strstr(msg, needle), "%s: \"%s\" (wanted \"%s\")", fixture, msg, needle);
    test_rmtree(dir);
}

static void too_many_chosen(cJSON *c)
{
    cJSON_ReplaceItemInObject(c, "num_experts_per_tok", cJSON_CreateNumber(9));
}

static void no_expert_count(cJSON *c)
{
    cJSON_DeleteItemFromObject(c, "num_local_experts");
    cJSON_DeleteItemFromObject(c, "num_experts");
}

static void bad_dense_layer(cJSON *c)
{
    cJSON_ReplaceItemInObject(c, "mlp_only_layers", cJSON_CreateString("1"));
}

static void more_experts(cJSON *c)
{
    cJSON_ReplaceItemInObject(c, "num_local_experts", cJSON_CreateNumber(9));
}

Test(moe, what_we_cannot_run_is_refused_by_name)
{
    refused_with("qwen3moe_tiny", too_many_chosen, "9 experts per token of 8");
    refused_with("qwen3moe_tiny", no_expert_count, "num_local_experts");
    refused_with("qwen3moe_tiny", bad_dense_layer, "mlp_only_layers");
    /* a ninth expert the file does not hold: the router names it */
    refused_with("mixtral_tiny", more_experts, "block_sparse_moe.gate.weight' is [8, 64]");
}

/* gguf_rewritten's edit_kv: leave out the key being set. */
static bool drop_key(gguf_kv *kv, void *key)
{
    return strcmp(kv->key, key) != 0;
}

/* tests/fixtures/<in> rewritten to out with the u32 metadata key set
 * (added, or replacing the file's) where key is given, the tensor `from`
 * renamed `to` where from is given, everything else as it was. */
static void gguf_rewritten(const char *in, const char *out, const char *key, uint32_t value,
                           const char *from, const char *to)
{
    char path[600], msg[512];
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, in);
    gguf_rewrite r = {.edit_kv = key ? drop_key : NULL,
                      .ctx = (void *)key,
                      .u32_keys = &key,
                      .u32_values = &value,
                      .n_u32 = key ? 1 : 0,
                      .rename_from = from,
                      .rename_to = to};
    cr_assert_eq(gguf_writer_rewrite(path, out, &r, msg, sizeof msg), 0, "%s", msg);
}

/* A GGUF whose routing llama.cpp was told to do otherwise (a sigmoid
 * gating function) is refused naming the key; the unchanged file loads. */
Test(moe, a_gguf_routing_we_do_not_run_is_refused_by_name)
{
    char dir[512], path[600], msg[1024];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/gated.gguf", dir);
    eng_model m;
    gguf_rewritten("qwen3moe_tiny.gguf", path, "qwen3moe.expert_gating_func", 1, NULL, NULL);
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = path}, msg, sizeof msg), 0, "%s", msg);
    eng_model_free(&m);
    gguf_rewritten("qwen3moe_tiny.gguf", path, "qwen3moe.expert_gating_func", 2, NULL, NULL);
    cr_assert_neq(eng_model_load(&m, &(eng_load_opts){.path = path}, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "qwen3moe.expert_gating_func is 2"), "%s", msg);
    test_rmtree(dir);
}

/* The converter's --fuse-gate-up-exps writes each layer's experts' gate
 * and up as one ffn_gate_up_exps: refused naming the tensor and the flag
 * (here a Qwen3.5-MoE file whose layer 0 gate stack bears that name). */
Test(moe, fused_gate_up_experts_in_a_gguf_are_refused_by_name)
{
    char dir[512], path[600], msg[1024];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/fused.gguf", dir);
    gguf_rewritten("qwen35_moe_tiny.gguf", path, NULL, 0, "blk.0.ffn_gate_exps.weight",
                   "blk.0.ffn_gate_up_exps.weight");
    eng_model m;
    cr_assert_neq(eng_model_load(&m, &(eng_load_opts){.path = path}, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "'blk.0.ffn_gate_up_exps.weight'") && strstr(msg, "--fuse-gate-up-exps"),
              "%s", msg);
    test_rmtree(dir);
}

/* --- adapters on experts ------------------------------------------------------------ */

/* The worst |ours - PEFT's| over every position's logits of the prompt
 * (test_max_abs_err: +inf for a NaN), on version w and with terms
 * unmerged. */
static double adapter_error(const eng_model *m, const eng_weights *w, const eng_lora_term *terms,
                            int n_terms, const int *tokens, int n, const double *want)
{
    prompt_run r = {.tokens = tokens,
                    .n_tokens = n,
                    .prefill = 9,
                    .block_tokens = 4,
                    .weights = w,
                    .delta = terms,
                    .n_delta = n_terms};
    float *all = run_prompt(m, &r);
    double worst = test_max_abs_err(all, want, (size_t)n * (size_t)m->cfg.vocab_size);
    free(all);
    return worst;
}

/* The adapter folder tests/fixtures/peft/<name> loaded onto m. */
static eng_lora *load_peft(const eng_model *m, const char *name, lora_meta *meta)
{
    char path[512], msg[1024];
    snprintf(path, sizeof path, "%s/peft/%s", QL_FIXTURES, name);
    eng_lora *l = NULL;
    cr_assert_eq(lora_load(&l, meta, path, name, m, msg, sizeof msg), 0, "%s: %s", name, msg);
    return l;
}

/* Unmerged and merged (f32, as PEFT merges): PEFT's float64 logits. */
static void against_peft(const eng_model *m, eng_lora *l, const int *tokens, int n,
                         const double *unmerged, const double *merged, const char *label)
{
    eng_lora_term term = {l, 1.0f};
    double worst = adapter_error(m, NULL, &term, 1, tokens, n, unmerged);
    cr_log_info("%s unmerged: worst logit error %g", label, worst);
    cr_assert_lt(worst, 1e-5, "%s unmerged: worst logit error %g", label, worst);
    eng_weights *w = lora_fix_merged_version(m, &term, 1, QT_KIND_COUNT);
    worst = adapter_error(m, w, NULL, 0, tokens, n, merged);
    cr_log_info("%s merged: worst logit error %g", label, worst);
    cr_assert_lt(worst, 1e-5, "%s merged: worst logit error %g", label, worst);
    cr_assert_neq(eng_weights_digest(m, w), eng_weights_digest(m, NULL));
    eng_weights_unref(w);
}

/* PEFT's target_parameters on Qwen3-MoE's fused experts (gate_up_proj,
 * down_proj: ParamWrapper's rank-r block per expert) beside q_proj and
 * v_proj, from the folder and the GGUF. */
Test(moe, a_peft_adapter_on_fused_experts_equals_peft_float64)
{
    char dir[512];
    eng_model m;
    load_fixture("qwen3moe_tiny", &m, dir, sizeof dir);
    lora_meta meta;
    eng_lora *l = load_peft(&m, "qwen3moe_experts", &meta);
    cr_assert_str_eq(meta.targets, "q_proj,v_proj,experts.gate_up_proj,experts.down_proj");
    const eng_lora_module *g = eng_lora_module_at(l, 2, eng_expert_proj(5, ENG_PROJ_GATE));
    const eng_lora_module *d = eng_lora_module_at(l, 2, eng_expert_proj(5, ENG_PROJ_DOWN));
    cr_assert(g && d, "expert 5 of layer 2 has its gate and down modules");
    cr_assert(g->a.rows == 4 && g->a.cols == 64 && g->b.rows == 32 && g->b.cols == 4);
    cr_assert(d->a.rows == 4 && d->a.cols == 32 && d->b.rows == 64);
    cr_assert_null(eng_lora_module_at(l, 2, ENG_PROJ_K));
    against_peft(&m, l, QWEN3MOE_TOKENS, QWEN3MOE_N_TOKENS, &QWEN3MOE_LORA_LOGITS[0][0],
                 &QWEN3MOE_MERGED_LOGITS[0][0], "qwen3moe folder + fused experts");
    eng_lora_unref(l);
    eng_model_free(&m);
    char msg[1024];
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = QL_FIXTURES "/qwen3moe_tiny.gguf"},
                                msg, sizeof msg),
                 0, "%s", msg);
    l = load_peft(&m, "qwen3moe_experts", NULL);
    against_peft(&m, l, QWEN3MOE_TOKENS, QWEN3MOE_N_TOKENS, &QWEN3MOE_LORA_LOGITS[0][0],
                 &QWEN3MOE_MERGED_LOGITS[0][0], "qwen3moe gguf + fused experts");
    eng_lora_unref(l);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* GPT-OSS's experts are stored transposed with gate and up alternating:
 * PEFT's target_parameters factors split per expert the same way give
 * PEFT's float64 logits (make_gptoss_adapter.py), folder and GGUF. */
Test(moe, a_peft_adapter_on_gpt_oss_experts_equals_peft_float64)
{
    char dir[512], msg[1024];
    eng_model m;
    load_fixture("gptoss_tiny", &m, dir, sizeof dir);
    eng_lora *l = load_peft(&m, "gptoss_experts", NULL);
    against_peft(&m, l, GPTOSS_TOKENS, GPTOSS_N_TOKENS, &GPTOSS_LORA_LOGITS[0][0],
                 &GPTOSS_MERGED_LOGITS[0][0], "gpt-oss folder + fused experts");
    eng_lora_unref(l);
    eng_model_free(&m);
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = QL_FIXTURES "/gptoss_tiny.gguf"}, msg,
                                sizeof msg),
                 0, "%s", msg);
    l = load_peft(&m, "gptoss_experts", NULL);
    against_peft(&m, l, GPTOSS_TOKENS, GPTOSS_N_TOKENS, &GPTOSS_LORA_LOGITS[0][0],
                 &GPTOSS_MERGED_LOGITS[0][0], "gpt-oss gguf + fused experts");
    eng_lora_unref(l);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* Every position of the prompt on version w (with terms unmerged) against
 * the float64 pass R, the first 9 in one step. */
static void against_reference(const eng_model *m, const ref_model *R, const eng_weights *w,
                              const eng_lora_term *terms, int n_terms, const char *label)
{
    qcp_against_pass(m, R, w, terms, n_terms, QWEN3MOE_TOKENS, QWEN3MOE_N_TOKENS, 9, label);
}

/* Merged into llama.cpp's q8_0 experts: each merged expert stays q8_0,
 * the served logits are the float64 pass over the merged weights, and the
 * unmerged adapter's the pass over the model's plus the float64 deltas. */
Test(moe, an_adapter_merges_into_quantized_experts)
{
    char msg[1024];
    eng_model m;
    cr_assert_eq(eng_model_load(&m,
                                &(eng_load_opts){.path = QL_FIXTURES "/qwen3moe_tiny_q8_0.gguf"},
                                msg, sizeof msg),
                 0, "%s", msg);
    eng_lora *l = load_peft(&m, "qwen3moe_experts", NULL);
    eng_lora_term term = {l, 1.0f};
    ref_model R;
    ref_load(&R, &m);
    ref_add_lora(&R, l, 1.0);
    against_reference(&m, &R, NULL, &term, 1, "q8_0 + unmerged fused experts");
    ref_free(&R);
    eng_weights *w = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    eng_proj p = eng_expert_proj(6, ENG_PROJ_DOWN);
    cr_assert_neq(eng_weights_proj(w, 1, p), eng_model_proj(&m, 1, p), "expert 6's down merged");
    cr_assert_eq(eng_weights_proj(w, 1, p)->kind, QT_Q8_0);
    ref_load_version(&R, &m, w);
    against_reference(&m, &R, w, NULL, 0, "q8_0 with the fused experts merged");
    ref_free(&R);
    eng_weights_unref(w);
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* target_modules naming each expert's own weights (Mixtral's w1, w2, w3),
 * from the folder and the GGUF. */
Test(moe, a_peft_adapter_on_each_expert_equals_peft_float64)
{
    char dir[512];
    eng_model m;
    load_fixture("mixtral_tiny", &m, dir, sizeof dir);
    eng_lora *l = load_peft(&m, "mixtral_experts", NULL);
    cr_assert(eng_lora_module_at(l, 1, eng_expert_proj(7, ENG_PROJ_UP)));
    against_peft(&m, l, MIXTRAL_TOKENS, MIXTRAL_N_TOKENS, &MIXTRAL_LORA_LOGITS[0][0],
                 &MIXTRAL_MERGED_LOGITS[0][0], "mixtral folder + per-expert adapter");
    eng_lora_unref(l);
    eng_model_free(&m);
    char msg[1024];
    cr_assert_eq(eng_model_load(&m, &(eng_load_opts){.path = QL_FIXTURES "/mixtral_tiny.gguf"}, msg,
                                sizeof msg),
                 0, "%s", msg);
    l = load_peft(&m, "mixtral_experts", NULL);
    against_peft(&m, l, MIXTRAL_TOKENS, MIXTRAL_N_TOKENS, &MIXTRAL_LORA_LOGITS[0][0],
                 &MIXTRAL_MERGED_LOGITS[0][0], "mixtral gguf + per-expert adapter");
    eng_lora_unref(l);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* Two sequences in one step, one with the adapter and one without: each
 * gets its own bits (an expert's delta only for the rows that applied it). */
Test(moe, adapters_on_experts_apply_per_sequence_in_a_shared_step)
{
    char dir[512];
    eng_model m;
    load_fixture("qwen3moe_tiny", &m, dir, sizeof dir);
    eng_lora *l = load_peft(&m, "qwen3moe_experts", NULL);
    step_env env;
    env_new(&env, &m);
    size_t V = (size_t)m.cfg.vocab_size;
    float *together = malloc(2 * V * sizeof(float)), *alone = malloc(V * sizeof(float));
    cr_assert(together && alone);
    eng_lora_term term = {l, 1.0f};
    eng_seq_kv skv[2] = {0};
    eng_step_seq seqs[2];
    for (int s = 0; s < 2; s++) {
        cr_assert_eq(eng_kv_reserve(env.kv, &skv[s], 12), 0);
        seqs[s] = (eng_step_seq){.kv = &skv[s], .tokens = QWEN3MOE_TOKENS, .n_tokens = 12};
    }
    seqs[1].delta = &term;
    seqs[1].n_delta = 1;
    char msg[512];
    cr_assert_eq(eng_forward(env.st, &m, env.kv, env.pool, seqs, 2, together, msg, sizeof msg), 0,
                 "%s", msg);
    for (int s = 0; s < 2; s++) {
        eng_kv_release(env.kv, &skv[s]);
        eng_seq_kv one = {0};
        cr_assert_eq(eng_kv_reserve(env.kv, &one, 12), 0);
        eng_step_seq q = seqs[s];
        q.kv = &one;
        cr_assert_eq(eng_forward(env.st, &m, env.kv, env.pool, &q, 1, alone, msg, sizeof msg), 0,
                     "%s", msg);
        cr_assert_eq(memcmp(alone, together + (size_t)s * V, V * sizeof(float)), 0,
                     "sequence %d (%s the adapter) differs in the shared step", s,
                     s ? "with" : "without");
        eng_kv_release(env.kv, &one);
    }
    cr_assert_neq(memcmp(together, together + V, V * sizeof(float)), 0,
                  "the adapter changed nothing");
    free(together);
    free(alone);
    env_free(&env);
    eng_lora_unref(l);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* --- the binary ------------------------------------------------------------------- */

/* POST body to path: 200, with a body holding needle. */
static void answers(const char *path, const char *body, const char *needle)
{
    int status;
    char *text = sp_answer(path, body, &status);
    cr_assert_eq(status, 200, "%s %s -> %d %s", path, body, status, text);
    cr_assert(strstr(text, needle), "%s -> %s (wanted \"%s\")", path, text, needle);
    free(text);
}

/* GET /admin/state's weights_digest into out[20]. */
static void digest_of(char *out)
{
    hc_response r = sp_request("GET", "/admin/state", NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cJSON *j = sp_json(r.body);
    snprintf(out, 20, "%s", sp_str_at(j, "weights_digest"));
    cJSON_Delete(j);
    hc_response_free(&r);
}

/* The fused-experts adapter through the admin API: loaded, asked for,
 * merged into the experts (the report lists them), unmerged to the
 * pristine digest, bit for bit. */
static void adapter_round_trip(void)
{
    char pristine[20], merged[20], back[20];
    digest_of(pristine);
    hc_response r = sp_request("POST", "/admin/adapters", NULL,
                               "{\"name\": \"experts\", \"path\": \"qwen3moe_experts\"}");
    cr_assert_eq(r.status, 201, "%s", r.body);
    hc_response_free(&r);
    answers("/v1/completions",
            "{\"model\": \"experts\", \"prompt\": \"Hi\", \"max_tokens\": 2, \"temperature\": 0}",
            "\"completion_tokens\":2");
    r = sp_request("POST", "/admin/adapters/experts/merge", NULL, "{}");
    cr_assert_eq(r.status, 200, "%s", r.body);
    cr_assert(strstr(r.body, "model.layers.2.mlp.experts.7.down_proj"), "%s", r.body);
    hc_response_free(&r);
    digest_of(merged);
    cr_assert_str_neq(merged, pristine);
    r = sp_request("POST", "/admin/adapters/experts/unmerge", NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    digest_of(back);
    cr_assert_str_eq(back, pristine, "unmerging the experts gave other bits");
}

/* The binary on model (a folder or a GGUF) answers each route, and counts
 * the experts it ran; with adapters (a folder holding PEFT's fused-experts
 * adapter) it loads, merges and unmerges one. */
static void serve_and_ask(const char *model, const char *dir, const char *adapters)
{
    char log[600], tmpl[600];
    snprintf(log, sizeof log, "%s/server.log", dir);
    snprintf(tmpl, sizeof tmpl, "%s/chat.jinja", dir);
    test_write_text(tmpl, "{% for m in messages %}{{ m['content'] }}{% endfor %}");
    const char *argv[] = {QL_BINARY,
                          "serve",
                          "--model",
                          model,
                          "--port",
                          "0",
                          "--threads",
                          "2",
                          "--kv-mib",
                          "8",
                          "--chat-template",
                          tmpl,
                          adapters ? "--adapter-dir" : NULL,
                          adapters,
                          NULL};
    sp_spawn(argv, log);
    sp_wait_ready();
    answers("/v1/completions", "{\"prompt\": \"Hello\", \"max_tokens\": 4, \"temperature\": 0}",
            "\"completion_tokens\":4");
    answers("/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 3, "
            "\"temperature\": 0}",
            "\"completion_tokens\":3");
    answers("/generate", "{\"inputs\": \"Hey\", \"parameters\": {\"max_new_tokens\": 2}}",
            "generated_text");
    hc_response r = sp_request("GET", "/metrics", NULL, NULL);
    cr_assert_eq(r.status, 200);
    const char *line = strstr(r.body, "\nqlserve_moe_experts_run_total ");
    cr_assert(line, "no experts counter in /metrics");
    cr_assert_gt(strtoull(line + strlen("\nqlserve_moe_experts_run_total "), NULL, 10), 0);
    hc_response_free(&r);
    if (adapters)
        adapter_round_trip();
    sp_stop_cleanly();
}

Test(moe, the_binary_serves_each_family_from_its_folder_and_its_gguf, .timeout = 300)
{
    char dir[512], model[600];
    test_tmpdir(dir, sizeof dir);
    snprintf(model, sizeof model, "%s/qwen3moe", dir);
    cr_assert_eq(mkdir(model, 0700), 0);
    tiny_fixture_folder("qwen3moe_tiny", model);
    serve_and_ask(model, dir, QL_FIXTURES "/peft");
    test_rmtree(model);
    /* its FP8 experts, fused with UE8M0 scales (make_fp8_moe_reference.py):
     * the adapter merges into them and unmerges back (a state dir of its
     * own, so the journal starts without the adapter) */
    char fp8_dir[600]; /* the state dir of a quantized folder */
    snprintf(fp8_dir, sizeof fp8_dir, "%s/fp8", dir);
    cr_assert_eq(mkdir(model, 0700), 0);
    cr_assert_eq(mkdir(fp8_dir, 0700), 0);
    tiny_fixture_folder("fp8moe_fused_tiny_ue8m0", model);
    serve_and_ask(model, fp8_dir, QL_FIXTURES "/peft");
    test_rmtree(model);
    test_rmtree(fp8_dir);
    /* and per expert in GPTQ, AWQ and compressed-tensors
     * (make_quant_moe_reference.py), the adapter merged into each kind */
    static const char *quant[] = {"gptqmoe_tiny", "awqmoe_tiny", "ctmoe_int4_tiny"};
    for (size_t i = 0; i < sizeof quant / sizeof *quant; i++) {
        cr_assert_eq(mkdir(model, 0700), 0);
        cr_assert_eq(mkdir(fp8_dir, 0700), 0);
        tiny_fixture_folder(quant[i], model);
        serve_and_ask(model, fp8_dir, QL_FIXTURES "/peft");
        test_rmtree(model);
        test_rmtree(fp8_dir);
    }
    cr_assert_eq(mkdir(model, 0700), 0);
    tiny_fixture_folder("gptoss_tiny", model);
    serve_and_ask(model, dir, NULL);
    /* each family's GGUF (GPT-OSS's with MXFP4 experts, Qwen3.5-MoE's
     * hybrid layers with their recurrent state) */
    const char *ggufs[] = {"mixtral_tiny.gguf", "qwen2moe_tiny.gguf", "qwen3moe_tiny.gguf",
                           "gptoss_tiny_mxfp4.gguf", "qwen35_moe_tiny.gguf"};
    for (size_t i = 0; i < sizeof ggufs / sizeof *ggufs; i++) {
        snprintf(model, sizeof model, "%s/%s", QL_FIXTURES, ggufs[i]);
        serve_and_ask(model, dir, NULL);
    }
    test_rmtree(dir);
}

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
 *   - the binary serves a mixture from its folder and its GGUF through the
 *     completions, chat and TGI routes.
 *
 * The fixtures are make_moe_reference.py's tiny models (8 experts, 2 per
 * token, 3 layers; Qwen2-MoE's with its shared expert).
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fixtures/moe_reference.h"
#include "model.h"
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

/* The binary on model (a folder or a GGUF) answers each route, and counts
 * the experts it ran. */
static void serve_and_ask(const char *model, const char *dir)
{
    char log[600], tmpl[600];
    snprintf(log, sizeof log, "%s/server.log", dir);
    snprintf(tmpl, sizeof tmpl, "%s/chat.jinja", dir);
    test_write_text(tmpl, "{% for m in messages %}{{ m['content'] }}{% endfor %}");
    const char *argv[] = {QL_BINARY,   "serve", "--model",  model, "--port",          "0",
                          "--threads", "2",     "--kv-mib", "8",   "--chat-template", tmpl,
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
    sp_stop_cleanly();
}

Test(moe, the_binary_serves_a_mixture_from_its_folder_and_its_gguf, .timeout = 240)
{
    char dir[512], model[600];
    test_tmpdir(dir, sizeof dir);
    snprintf(model, sizeof model, "%s/qwen3moe", dir);
    cr_assert_eq(mkdir(model, 0700), 0);
    tiny_fixture_folder("qwen3moe_tiny", model);
    serve_and_ask(model, dir);
    serve_and_ask(QL_FIXTURES "/mixtral_tiny.gguf", dir);
    test_rmtree(dir);
}

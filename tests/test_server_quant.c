/*
 * test_server_quant.c - `qlserve serve` on each tiny quantized checkpoint
 * of test_ctensors.c (compressed-tensors' five schemes and fbgemm_fp8),
 * test_fp8.c (finegrained FP8, f32 and UE8M0 scales) and test_gptq.c
 * (GPTQ v1 and v2, AWQ):
 * with a PEFT adapter loaded, every API (TGI /generate, OpenAI completions
 * and chat, Anthropic messages, Responses) answers for the adapter
 * unmerged; merged (POST /admin/adapters/alpha/merge into the weight's own
 * layout) it answers again, and the unmerge gives the weights digest and
 * the base model's greedy answer back exactly.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "http_client.h"
#include "lora_fixture.h"
#include "model.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512]; /* test_tmpdir gives short paths */

static void teardown(void)
{
    sp_kill();
    if (dir[0])
        test_rmtree(dir);
}

TestSuite(server_quant, .fini = teardown, .timeout = 300);

/* The fixture copied into dir/model with a chat template joining the
 * messages, an adapter of every projection written into dir/adapters/alpha
 * for it, and the server started on them. */
static void start(const char *folder)
{
    char model_dir[600], adapter_dir[600], log_path[560], path[700], msg[1024];
    test_tmpdir(dir, sizeof dir);
    snprintf(model_dir, sizeof model_dir, "%s/model", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapters", dir);
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
    cr_assert_eq(mkdir(adapter_dir, 0700), 0);
    tiny_fixture_folder(folder, model_dir);
    snprintf(path, sizeof path, "%s/chat_template.jinja", model_dir);
    test_write_text(path, "{% for m in messages %}{{ m['content'] }}{% endfor %}");
    eng_model m;
    eng_load_opts o = {.path = model_dir};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    snprintf(path, sizeof path, "%s/alpha", adapter_dir);
    lora_fix_spec spec = lora_fix_default();
    lora_fix_write(path, &m.cfg, &spec);
    eng_model_free(&m);
    const char *argv[] = {QL_BINARY,   "serve", "--model",  model_dir, "--port",        "0",
                          "--threads", "2",     "--kv-mib", "16",      "--adapter-dir", adapter_dir,
                          NULL};
    sp_spawn(argv, log_path);
    sp_wait_ready();
}

/* POST body to path: 200 and a JSON body, which the caller frees. */
static cJSON *post_ok(const char *path, const char *body)
{
    hc_response r = sp_request("POST", path, NULL, body);
    cr_assert_eq(r.status, 200, "%s: %d %s", path, r.status, r.body);
    cJSON *j = cJSON_Parse(r.body);
    cr_assert(j, "%s: not JSON: %s", path, r.body);
    hc_response_free(&r);
    return j;
}

/* Every API answers a greedy request for model (an adapter's name, or the
 * base's with "adapter_id" absent): non-empty text, where each puts it. */
static void every_api_answers(const char *model)
{
    char body[512];
    static const struct api {
        const char *path, *body;
    } apis[] = {
        {"/generate", "{\"inputs\": \"Hi\", \"parameters\": {\"max_new_tokens\": 4, "
                      "\"do_sample\": false, \"adapter_id\": \"%s\"}}"},
        {"/v1/completions", "{\"model\": \"%s\", \"prompt\": \"Hi\", \"max_tokens\": 4, "
                            "\"temperature\": 0}"},
        {"/v1/chat/completions", "{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", "
                                 "\"content\": \"Hi\"}], \"max_tokens\": 4, \"temperature\": 0}"},
        {"/v1/messages", "{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": "
                         "\"Hi\"}], \"max_tokens\": 4, \"temperature\": 0}"},
        {"/v1/responses", "{\"model\": \"%s\", \"input\": \"Hi\", \"max_output_tokens\": 4, "
                          "\"temperature\": 0}"},
    };
    for (size_t i = 0; i < sizeof apis / sizeof *apis; i++) {
        snprintf(body, sizeof body, apis[i].body, model);
        cJSON *j = post_ok(apis[i].path, body);
        char *text = cJSON_PrintUnformatted(j);
        cr_assert(strlen(text) > 20, "%s: %s", apis[i].path, text);
        free(text);
        cJSON_Delete(j);
    }
}

/* /generate's greedy text for the base model (adapter NULL) or an adapter. */
static char *greedy(const char *adapter)
{
    char body[256], ad[64] = "";
    if (adapter)
        snprintf(ad, sizeof ad, ", \"adapter_id\": \"%s\"", adapter);
    snprintf(body, sizeof body,
             "{\"inputs\": \"Hello\", \"parameters\": {\"max_new_tokens\": 8, \"do_sample\": "
             "false%s}}",
             ad);
    cJSON *j = post_ok("/generate", body);
    char *text = strdup(cJSON_GetObjectItemCaseSensitive(j, "generated_text")->valuestring);
    cJSON_Delete(j);
    return text;
}

/* /admin/state's weights_digest. */
static char *digest(void)
{
    hc_response r = sp_request("GET", "/admin/state", NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cJSON *j = cJSON_Parse(r.body);
    char *d = strdup(cJSON_GetObjectItemCaseSensitive(j, "weights_digest")->valuestring);
    cJSON_Delete(j);
    hc_response_free(&r);
    return d;
}

Test(server_quant, every_checkpoint_serves_an_adapter_unmerged_and_merged)
{
    static const char *const folders[] = {"ct_int4_group_asym",
                                          "ct_int8_channel_sym",
                                          "ct_int8_tensor_naive",
                                          "ct_fp8_channel",
                                          "ct_fp8_block",
                                          "fbgemm_fp8_tiny",
                                          "fp8_tiny_float",
                                          "fp8_tiny_ue8m0",
                                          "gptq_tiny_v1",
                                          "gptq_tiny_v2",
                                          "awq_tiny"};
    for (size_t f = 0; f < sizeof folders / sizeof *folders; f++) {
        start(folders[f]);
        hc_response r = sp_request("POST", "/admin/adapters", NULL,
                                   "{\"name\": \"alpha\", \"path\": \"alpha\"}");
        cr_assert_eq(r.status, 201, "%s: %s", folders[f], r.body);
        hc_response_free(&r);
        char *base = greedy(NULL), *before = digest();
        every_api_answers("alpha");
        cJSON *j = post_ok("/admin/adapters/alpha/merge", "{\"scale\": 1.0}");
        cr_assert(cJSON_GetObjectItemCaseSensitive(j, "delta_retained"), "%s: no cost report",
                  folders[f]);
        cJSON_Delete(j);
        char *merged = digest();
        cr_assert_str_neq(merged, before, "%s: the merge changed nothing", folders[f]);
        every_api_answers("alpha");
        free(greedy("alpha"));
        cJSON_Delete(post_ok("/admin/adapters/alpha/unmerge", NULL));
        char *after = digest(), *base_again = greedy(NULL);
        cr_assert_str_eq(after, before, "%s: unmerge restores the weights", folders[f]);
        cr_assert_str_eq(base_again, base, "%s: the base answers as before", folders[f]);
        free(base);
        free(before);
        free(merged);
        free(after);
        free(base_again);
        sp_stop_cleanly();
        test_rmtree(dir);
        dir[0] = '\0';
    }
}

/*
 * test_server_chat.c - POST /v1/chat/completions end to end: the real
 * binary on a tiny random model given a chat template (chat_template.jinja
 * in its folder), spoken to over TCP (tests/server_process.h).
 *
 * What is pinned: the prompt the model is fed is the template's rendering
 * of the messages, tokenized without an added BOS (the answer and its
 * prompt_tokens equal /v1/completions' greedy answer to the rendered text
 * written out by hand); a whole answer is a chat.completion, a stream
 * opens with the role, carries the content in deltas that join to the
 * whole answer, ends with finish_reason, the usage when asked and [DONE];
 * without max_tokens the answer may fill the context; the usage has the
 * request's drafts only when it drafted; and every refusal
 * names what was wrong: no template, a template refused at load, a
 * template that raises, a bad role or content part, fields not supported.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "http_client.h"
#include "lora_fixture.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];
static char model_dir[600];
static char log_path[600];
static char adapter_dir[600];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(model_dir, sizeof model_dir, "%s/tiny-chat", dir);
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapters", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
    cr_assert_eq(mkdir(adapter_dir, 0700), 0);
}

static void teardown(void)
{
    sp_kill();
    test_rmtree(dir);
}

TestSuite(chat, .init = setup, .fini = teardown, .timeout = 300);

/* A ChatML-style template in the shape SmolLM2's has: a system message
 * when none is given, each message framed, the assistant's turn opened
 * when add_generation_prompt. It raises on a message of role "tool" so
 * that the template's own refusal can be seen. */
static const char chatml[] =
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tools are not for this model') }}"
    "{% endif %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + "
    "'\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* The tiny model with `chat_template` as its chat_template.jinja (NULL:
 * none), served with the flags extra (NULL-ended; NULL: none) after the
 * usual ones; returns once it answers. */
static void start_with_flags(const char *chat_template, const char *const *extra)
{
    tiny_spec spec = tiny_default();
    tiny_write_hf(model_dir, &spec);
    if (chat_template) {
        char path[700];
        snprintf(path, sizeof path, "%s/chat_template.jinja", model_dir);
        test_write_text(path, chat_template);
    }
    const char *argv[24] = {QL_BINARY,  "serve", "--model",       model_dir,
                            "--port",   "0",     "--threads",     "2",
                            "--kv-mib", "16",    "--adapter-dir", adapter_dir};
    size_t n = 12;
    for (size_t i = 0; extra && extra[i]; i++) {
        cr_assert_lt(n, 23);
        argv[n++] = extra[i];
    }
    argv[n] = NULL;
    sp_spawn(argv, log_path);
    sp_wait_ready();
}

static void start_with_template(const char *chat_template)
{
    start_with_flags(chat_template, NULL);
}

static void expect_refusal(const char *body, int status, const char *needle)
{
    int got;
    char *text = sp_answer("/v1/chat/completions", body, &got);
    cr_assert_eq(got, status, "%s -> %d %s", body, got, text);
    cJSON *j = sp_json(text);
    const char *message = sp_str_at(cJSON_GetObjectItem(j, "error"), "message");
    cr_assert(strstr(message, needle), "%s -> %s (wanted \"%s\")", body, message, needle);
    cJSON_Delete(j);
    free(text);
}

/* The completion of the rendered prompt, as /v1/completions gives it. */
static cJSON *completion_of(const char *rendered, int max_tokens)
{
    cJSON *body = cJSON_CreateObject();
    cJSON_AddStringToObject(body, "prompt", rendered);
    cJSON_AddNumberToObject(body, "max_tokens", max_tokens);
    cJSON_AddNumberToObject(body, "temperature", 0);
    char *text = cJSON_PrintUnformatted(body);
    cJSON_Delete(body);
    int status;
    char *answer = sp_answer("/v1/completions", text, &status);
    cr_assert_eq(status, 200, "%s", answer);
    cJSON *j = sp_json(answer);
    free(text);
    free(answer);
    return j;
}

static const char conversation[] =
    "\"messages\": [{\"role\": \"user\", \"content\": \"  What is the sea?  \"}, "
    "{\"role\": \"assistant\", \"content\": \"Water.\"}, "
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"And\"}, "
    "{\"type\": \"text\", \"text\": \"the sky?\"}]}]";

/* What the template renders the conversation to, written out by hand (the
 * parts joined with a newline, contents trimmed by the template). */
static const char rendered[] = "<|im_start|>system\nBe brief.<|im_end|>\n"
                               "<|im_start|>user\nWhat is the sea?<|im_end|>\n"
                               "<|im_start|>assistant\nWater.<|im_end|>\n"
                               "<|im_start|>user\nAnd\nthe sky?<|im_end|>\n"
                               "<|im_start|>assistant\n";

Test(chat, answer_is_the_completion_of_the_rendered_messages)
{
    start_with_template(chatml);
    char body[1024];
    snprintf(body, sizeof body,
             "{\"model\": \"tiny-chat\", %s, \"max_tokens\": 8, \"temperature\": 0}", conversation);
    int status;
    char *text = sp_answer("/v1/chat/completions", body, &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *chat = sp_json(text);
    cr_assert_str_eq(sp_str_at(chat, "object"), "chat.completion");
    cr_assert_eq(strncmp(sp_str_at(chat, "id"), "chatcmpl-", 9), 0, "%s", text);
    const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0);
    const cJSON *message = cJSON_GetObjectItem(choice, "message");
    cr_assert_str_eq(sp_str_at(message, "role"), "assistant");
    cJSON *plain = completion_of(rendered, 8);
    const cJSON *plain_choice = cJSON_GetArrayItem(cJSON_GetObjectItem(plain, "choices"), 0);
    cr_assert_str_eq(sp_str_at(message, "content"), sp_str_at(plain_choice, "text"));
    cr_assert_str_eq(sp_str_at(choice, "finish_reason"), sp_str_at(plain_choice, "finish_reason"));
    /* the same prompt tokens: the template's text, no BOS added */
    const cJSON *usage = cJSON_GetObjectItem(chat, "usage");
    const cJSON *plain_usage = cJSON_GetObjectItem(plain, "usage");
    cr_assert_eq(sp_num_at(usage, "prompt_tokens"), sp_num_at(plain_usage, "prompt_tokens"));
    cr_assert_eq(sp_num_at(usage, "completion_tokens"),
                 sp_num_at(plain_usage, "completion_tokens"));
    cJSON_Delete(plain);
    cJSON_Delete(chat);
    free(text);
    sp_stop_cleanly();
}

Test(chat, stream_opens_with_the_role_and_its_deltas_join_to_the_answer)
{
    start_with_template(chatml);
    char body[1024];
    snprintf(body, sizeof body, "{%s, \"max_tokens\": 10, \"temperature\": 0}", conversation);
    int status;
    char *whole = sp_answer("/v1/chat/completions", body, &status);
    cr_assert_eq(status, 200, "%s", whole);
    cJSON *w = sp_json(whole);
    const cJSON *wc = cJSON_GetArrayItem(cJSON_GetObjectItem(w, "choices"), 0);
    const char *want = sp_str_at(cJSON_GetObjectItem(wc, "message"), "content");

    snprintf(body, sizeof body,
             "{%s, \"max_tokens\": 10, \"temperature\": 0, \"stream\": true, "
             "\"stream_options\": {\"include_usage\": true}}",
             conversation);
    char *events[64];
    int n = sp_stream_events("/v1/chat/completions", body, events, 64);
    cr_assert_geq(n, 4, "%d events", n);
    cr_assert_str_eq(events[n - 1], "[DONE]");
    /* the first delta is the role, with empty content */
    cJSON *first = sp_json(events[0]);
    cr_assert_str_eq(sp_str_at(first, "object"), "chat.completion.chunk");
    const cJSON *d0 =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(first, "choices"), 0), "delta");
    cr_assert_str_eq(sp_str_at(d0, "role"), "assistant");
    cr_assert_str_eq(sp_str_at(d0, "content"), "");
    /* content deltas, then the finish, then the usage */
    char joined[4096] = "";
    const char *finish = NULL;
    cJSON *last_choice_event = NULL;
    for (int i = 1; i < n - 2; i++) {
        cJSON *e = sp_json(events[i]);
        const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(e, "choices"), 0);
        const cJSON *delta = cJSON_GetObjectItem(c, "delta");
        cr_assert_null(cJSON_GetObjectItem(delta, "role"), "%s", events[i]);
        const cJSON *content = cJSON_GetObjectItem(delta, "content");
        if (cJSON_IsString(content))
            strncat(joined, content->valuestring, sizeof joined - strlen(joined) - 1);
        const cJSON *f = cJSON_GetObjectItem(c, "finish_reason");
        if (cJSON_IsString(f)) {
            cr_assert_eq(i, n - 3, "finish_reason before the last chunk: %s", events[i]);
            finish = f->valuestring;
        }
        cJSON_Delete(last_choice_event);
        last_choice_event = e;
    }
    cr_assert_str_eq(joined, want);
    cr_assert(finish, "no chunk carried finish_reason");
    cr_assert_str_eq(finish, sp_str_at(wc, "finish_reason"));
    cJSON *usage_event = sp_json(events[n - 2]);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(usage_event, "choices")), 0);
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(usage_event, "usage"), "completion_tokens"),
                 sp_num_at(cJSON_GetObjectItem(w, "usage"), "completion_tokens"));
    cJSON_Delete(usage_event);
    cJSON_Delete(last_choice_event);
    cJSON_Delete(first);
    for (int i = 0; i < n; i++)
        free(events[i]);
    cJSON_Delete(w);
    free(whole);
    sp_stop_cleanly();
}

/* A token without text (here the end token, which ignore_eos lets through
 * and logit_bias forces) still streams as its own chunk, its content
 * empty, as vLLM streams it: a client sees every token arrive. */
Test(chat, every_token_streams_a_chunk_even_one_without_text)
{
    start_with_template(chatml);
    char body[1024];
    snprintf(body, sizeof body,
             "{%s, \"max_tokens\": 3, \"ignore_eos\": true, \"logit_bias\": {\"259\": 100}, "
             "\"stream\": true}",
             conversation);
    char *events[16];
    int n = sp_stream_events("/v1/chat/completions", body, events, 16);
    /* the role, three tokens, the finish, [DONE] */
    cr_assert_eq(n, 6, "%d events", n);
    for (int i = 1; i <= 3; i++) {
        cJSON *e = sp_json(events[i]);
        const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(e, "choices"), 0);
        cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(c, "delta"), "content"), "", "%s",
                         events[i]);
        cr_assert(cJSON_IsNull(cJSON_GetObjectItem(c, "finish_reason")), "%s", events[i]);
        cJSON_Delete(e);
    }
    cJSON *last = sp_json(events[4]);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(last, "choices"), 0);
    cr_assert_str_eq(sp_str_at(c, "finish_reason"), "length");
    cJSON_Delete(last);
    for (int i = 0; i < n; i++)
        free(events[i]);
    /* /v1/completions the same: three token chunks, the finish, [DONE] */
    n = sp_stream_events("/v1/completions",
                         "{\"prompt\": \"the\", \"max_tokens\": 3, \"ignore_eos\": true, "
                         "\"logit_bias\": {\"259\": 100}, \"stream\": true}",
                         events, 16);
    cr_assert_eq(n, 5, "%d events", n);
    for (int i = 0; i < 3; i++) {
        cJSON *e = sp_json(events[i]);
        const cJSON *ci = cJSON_GetArrayItem(cJSON_GetObjectItem(e, "choices"), 0);
        cr_assert_str_eq(sp_str_at(ci, "text"), "", "%s", events[i]);
        cr_assert(cJSON_IsNull(cJSON_GetObjectItem(ci, "finish_reason")), "%s", events[i]);
        cJSON_Delete(e);
    }
    for (int i = 0; i < n; i++)
        free(events[i]);
    sp_stop_cleanly();
}

Test(chat, without_max_tokens_the_answer_may_fill_the_context)
{
    start_with_template(chatml);
    /* the tiny model's context is 512 positions; random weights rarely
     * choose its one EOS, so the answer runs to the context's end */
    int status;
    char *text = sp_answer("/v1/chat/completions",
                           "{\"messages\": [{\"role\": \"user\", \"content\": \"Go on.\"}], "
                           "\"temperature\": 0}",
                           &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *chat = sp_json(text);
    const cJSON *usage = cJSON_GetObjectItem(chat, "usage");
    const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0);
    double total = sp_num_at(usage, "prompt_tokens") + sp_num_at(usage, "completion_tokens");
    if (strcmp(sp_str_at(choice, "finish_reason"), "length") == 0)
        cr_assert_eq(total, 512, "%s", text);
    else
        cr_assert_leq(total, 512, "%s", text);
    cr_assert_gt(sp_num_at(usage, "completion_tokens"), 128, "the answer stopped early: %s", text);
    cJSON_Delete(chat);
    free(text);
    sp_stop_cleanly();
}

Test(chat, refusals_name_what_was_wrong)
{
    start_with_template(chatml);
    expect_refusal("{\"model\": \"tiny-chat\"}", 400, "\"messages\" must be a non-empty list");
    expect_refusal("{\"messages\": []}", 400, "\"messages\" must be a non-empty list");
    expect_refusal("{\"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}", 400,
                   "messages[0].role must be system, user, assistant or tool, not robot");
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", "
                   "\"image_url\": {\"url\": \"x\"}}]}]}",
                   400, "messages[0].content[0]: only {\"type\": \"text\"");
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": 7}]}", 400,
                   "messages[0].content must be a string or a list of text parts");
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"mood\": 1}]}", 400,
                   "mood");
    /* the template's own refusal, in its words */
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, "
                   "{\"role\": \"tool\", \"content\": \"42\"}]}",
                   400, "tools are not for this model");
    /* what this server does not do yet is refused by name, not ignored */
    const char *user = "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]";
    char body[512];
    snprintf(body, sizeof body, "{%s, \"n\": 65}", user);
    expect_refusal(body, 400, "\"n\"");
    snprintf(body, sizeof body, "{%s, \"top_logprobs\": 2}", user);
    expect_refusal(body, 400, "\"top_logprobs\" needs \"logprobs\": true");
    snprintf(body, sizeof body, "{%s, \"logit_bias\": {\"5\": 101}}", user);
    expect_refusal(body, 400, "\"logit_bias\": the bias of token 5 is 101");
    /* (response_format and tool_choice: test_server_grammar.c) */
    snprintf(body, sizeof body, "{%s, \"model\": \"no-such-adapter\"}", user);
    expect_refusal(body, 404, "no-such-adapter");
    /* accepted and ignored: user, metadata; text response_format; auto tools */
    snprintf(body, sizeof body,
             "{%s, \"user\": \"u1\", \"metadata\": {\"k\": \"v\"}, \"response_format\": "
             "{\"type\": \"text\"}, \"tool_choice\": \"auto\", \"max_tokens\": 2}",
             user);
    int status;
    char *text = sp_answer("/v1/chat/completions", body, &status);
    cr_assert_eq(status, 200, "%s", text);
    free(text);
    /* the placeholders TGI's clients send for "the model behind this URL" */
    const char *placeholders[] = {"tgi", "dummy"};
    for (int i = 0; i < 2; i++) {
        snprintf(body, sizeof body, "{%s, \"model\": \"%s\", \"max_tokens\": 2}", user,
                 placeholders[i]);
        text = sp_answer("/v1/chat/completions", body, &status);
        cr_assert_eq(status, 200, "%s: %s", placeholders[i], text);
        free(text);
    }
    sp_stop_cleanly();
}

Test(chat, a_model_without_a_template_refuses_chat_and_serves_completions)
{
    start_with_template(NULL);
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", 400,
                   "has no chat template");
    cJSON *plain = completion_of("Hello", 2);
    cJSON_Delete(plain);
    sp_stop_cleanly();
}

Test(chat, a_template_refused_at_load_refuses_chat_with_its_reason)
{
    /* an unsupported construct: refused when the template is compiled, at
     * load, never rendered wrongly; the model still serves completions */
    start_with_template("{% for m in messages %}{{ m['content'] | wordwrap(10) }}{% endfor %}");
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", 400,
                   "chat template was refused at load");
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", 400, "wordwrap");
    char *log = sp_read_log();
    cr_assert(strstr(log, "wordwrap"), "the log does not say why: %s", log);
    free(log);
    cJSON *plain = completion_of("Hello", 2);
    cJSON_Delete(plain);
    sp_stop_cleanly();
}

Test(chat, an_adapters_own_template_serves_requests_to_that_adapter)
{
    /* PEFT saves the tokenizer beside an adapter when training changed
     * it: its chat_template.jinja frames requests naming that adapter */
    char folder[800], path[900];
    snprintf(folder, sizeof folder, "%s/tuned", adapter_dir);
    lora_fix_write_tiny(folder, NULL, NULL, NULL);
    snprintf(path, sizeof path, "%s/chat_template.jinja", folder);
    test_write_text(path,
                    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}");
    start_with_template(chatml);
    int status;
    char *text =
        sp_answer("/admin/adapters", "{\"name\": \"tuned\", \"path\": \"tuned\"}", &status);
    cr_assert_eq(status, 201, "%s", text);
    free(text);
    const char *messages = "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]";
    char body[512];
    snprintf(body, sizeof body, "{\"model\": \"tuned\", %s, \"max_tokens\": 6, \"temperature\": 0}",
             messages);
    text = sp_answer("/v1/chat/completions", body, &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *chat = sp_json(text);
    free(text);
    /* the same as the adapter's completion of its template's rendering */
    text = sp_answer("/v1/completions",
                     "{\"model\": \"tuned\", \"prompt\": \"[user] hi\\n[assistant] \", "
                     "\"max_tokens\": 6, \"temperature\": 0}",
                     &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *plain = sp_json(text);
    free(text);
    const cJSON *m =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0), "message");
    const cJSON *p = cJSON_GetArrayItem(cJSON_GetObjectItem(plain, "choices"), 0);
    cr_assert_str_eq(sp_str_at(m, "content"), sp_str_at(p, "text"));
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(chat, "usage"), "prompt_tokens"),
                 sp_num_at(cJSON_GetObjectItem(plain, "usage"), "prompt_tokens"));
    cr_assert_str_eq(sp_str_at(chat, "model"), "tuned");
    /* the base model keeps its own template: a longer, ChatML prompt */
    snprintf(body, sizeof body, "{%s, \"max_tokens\": 2, \"temperature\": 0}", messages);
    text = sp_answer("/v1/chat/completions", body, &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *base = sp_json(text);
    free(text);
    cr_assert_gt(sp_num_at(cJSON_GetObjectItem(base, "usage"), "prompt_tokens"),
                 sp_num_at(cJSON_GetObjectItem(chat, "usage"), "prompt_tokens"));
    cJSON_Delete(base);
    cJSON_Delete(plain);
    cJSON_Delete(chat);
    sp_stop_cleanly();
}

Test(chat, chat_tokenize_shows_the_rendered_text_and_its_tokens)
{
    start_with_template(chatml);
    char body[1024];
    snprintf(body, sizeof body, "{%s}", conversation);
    int status;
    char *text = sp_answer("/chat_tokenize", body, &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *j = sp_json(text);
    cr_assert_str_eq(sp_str_at(j, "templated_text"), rendered);
    /* its tokens are what /tokenize gives for that text with nothing added */
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "inputs", rendered);
    cJSON_AddFalseToObject(req, "add_special_tokens");
    char *req_text = cJSON_PrintUnformatted(req);
    char *plain = sp_answer("/tokenize", req_text, &status);
    cr_assert_eq(status, 200, "%s", plain);
    cJSON *pj = sp_json(plain);
    cr_assert(cJSON_Compare(cJSON_GetObjectItem(j, "tokenize_response"), pj, true), "%s vs %s",
              text, plain);
    /* the number of tokens is the prompt a chat request is fed */
    snprintf(body, sizeof body, "{%s, \"max_tokens\": 1}", conversation);
    char *chat = sp_answer("/v1/chat/completions", body, &status);
    cr_assert_eq(status, 200, "%s", chat);
    cJSON *cj = sp_json(chat);
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(cj, "usage"), "prompt_tokens"),
                 cJSON_GetArraySize(pj));
    /* add_generation_prompt false leaves the assistant's turn unopened */
    snprintf(body, sizeof body, "{%s, \"add_generation_prompt\": false}", conversation);
    char *closed = sp_answer("/chat_tokenize", body, &status);
    cr_assert_eq(status, 200, "%s", closed);
    cJSON *cl = sp_json(closed);
    size_t n = strlen(rendered) - strlen("<|im_start|>assistant\n");
    cr_assert_eq(strncmp(sp_str_at(cl, "templated_text"), rendered, n), 0);
    cr_assert_eq(strlen(sp_str_at(cl, "templated_text")), n);
    cJSON_Delete(cl);
    cJSON_Delete(cj);
    cJSON_Delete(pj);
    cJSON_Delete(req);
    cJSON_Delete(j);
    free(closed);
    free(chat);
    free(plain);
    free(req_text);
    free(text);
    sp_stop_cleanly();
}

Test(chat, completions_refuse_suffix_and_a_best_of_under_n)
{
    start_with_template(NULL);
    const char *bodies[][2] = {
        {"{\"prompt\": \"a\", \"suffix\": \"z\"}", "\"suffix\" (insertion) is not supported"},
        {"{\"prompt\": \"a\", \"best_of\": 1, \"n\": 2}",
         "\"best_of\" (1) must be at least \"n\" (2)"},
    };
    for (size_t i = 0; i < 2; i++) {
        int status;
        char *text = sp_answer("/v1/completions", bodies[i][0], &status);
        cr_assert_eq(status, 400, "%s -> %d %s", bodies[i][0], status, text);
        cJSON *j = sp_json(text);
        const char *m = sp_str_at(cJSON_GetObjectItem(j, "error"), "message");
        cr_assert(strstr(m, bodies[i][1]), "%s -> %s", bodies[i][0], m);
        cJSON_Delete(j);
        free(text);
    }
    /* their neutral values are accepted */
    int status;
    char *text = sp_answer(
        "/v1/completions",
        "{\"prompt\": \"a\", \"suffix\": null, \"best_of\": 1, \"max_tokens\": 1}", &status);
    cr_assert_eq(status, 200, "%s", text);
    free(text);
    sp_stop_cleanly();
}

/* A chat answer's usage has the request's drafts (OpenAI's completion_tokens_details with
 * accepted_prediction_tokens and rejected_prediction_tokens) only when it drafted: llama-server's
 * "speculative.n_max": 0 asks for none, and the answer is the same greedy text. */
Test(chat, usage_has_the_requests_prediction_tokens_only_when_it_drafted)
{
    start_with_flags(chatml, (const char *[]){"--speculative", "ngram", NULL});
    hc_response r = sp_request("GET", "/info", NULL, NULL);
    cJSON *info = sp_json(r.body);
    bool drafts = strcmp(sp_str_at(info, "speculative"), "ngram") == 0; /* off on CUDA */
    cJSON_Delete(info);
    hc_response_free(&r);
    int status;
    char *text[2];
    for (int off = 0; off < 2; off++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"a b c a b c a b c a b\"}], "
                 "\"max_tokens\": 32, \"temperature\": 0%s}",
                 off ? ", \"speculative.n_max\": 0" : "");
        char *answer = sp_answer("/v1/chat/completions", body, &status);
        cr_assert_eq(status, 200, "%s", answer);
        cJSON *j = sp_json(answer);
        const cJSON *usage = cJSON_GetObjectItem(j, "usage");
        const cJSON *d = cJSON_GetObjectItem(usage, "completion_tokens_details");
        if (off || !drafts)
            cr_assert_null(d, "%s", answer);
        else {
            double accepted = sp_num_at(d, "accepted_prediction_tokens");
            double rejected = sp_num_at(d, "rejected_prediction_tokens");
            cr_assert_gt(accepted + rejected, 0, "%s", answer);
            cr_assert_leq(accepted, sp_num_at(usage, "completion_tokens"));
        }
        const cJSON *message = cJSON_GetObjectItem(
            cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
        text[off] = strdup(sp_str_at(message, "content"));
        cJSON_Delete(j);
        free(answer);
    }
    cr_assert_str_eq(text[0], text[1]);
    free(text[0]);
    free(text[1]);
    expect_refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], "
                   "\"speculative.n_max\": 1.5}",
                   400, "\"speculative.n_max\" must be an integer");
    sp_stop_cleanly();
}

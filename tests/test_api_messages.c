/*
 * test_api_messages.c - Anthropic's Messages API (POST /v1/messages and
 * /v1/messages/count_tokens) end to end: the real binary on the tiny
 * random model (tests/tiny_server.h), spoken to over TCP.
 *
 * What is pinned: the Messages API is chat completions read and written in
 * another shape, so a greedy answer is chat's answer to the same
 * conversation (the text, and input_tokens + cache_read_input_tokens its
 * prompt_tokens); tool_use and tool_result blocks render as chat's
 * tool_calls and tool messages (count_tokens equals /chat_tokenize's count
 * for the chat body written by hand); a stream is Anthropic's named events
 * in Anthropic's order, whose text deltas join to the whole answer; a stop
 * sequence ends the answer, is left out of its text and named; a forced
 * tool is a tool_use block (its input the whole answer's, whole and as
 * input_json_delta); every refusal is Anthropic's error shape, naming the
 * field; the API key is taken from x-api-key as from Bearer, and its 401
 * is Anthropic's authentication_error on these routes only.
 */
#include "tiny_server.h"

/* A template that shows what the translation must keep: each message's
 * role and content, an assistant's calls (name and arguments) and a tool
 * message's call id. */
#define MSG_TEMPLATE                                                                               \
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"                                   \
    "{% if m['tool_calls'] %}{% for t in m['tool_calls'] %}[{{ t['function']['name'] }} "          \
    "{{ t['function']['arguments'] | tojson }}]{% endfor %}{% endif %}"                            \
    "{% if m['tool_call_id'] %}({{ m['tool_call_id'] }}){% endif %}{% endfor %}<assistant>"

static void setup(void)
{
    ts_start(MSG_TEMPLATE);
}

TestSuite(messages, .init = setup, .fini = ts_teardown, .timeout = 300);

/* The events of a stream's whole body: names and parsed data, in order. */
typedef struct msg_events {
    int n;
    char name[256][48];
    cJSON *data[256];
} msg_events;

static void events_free(msg_events *ev)
{
    for (int i = 0; i < ev->n; i++)
        cJSON_Delete(ev->data[i]);
}

/* POST body (streamed) and read its events, each "event: NAME\ndata: JSON". */
static void stream_of(const char *body, msg_events *ev)
{
    hc_response r = sp_request("POST", "/v1/messages", NULL, body);
    cr_assert_eq(r.status, 200, "%s -> %d %s", body, r.status, r.body);
    char ct[128];
    cr_assert(hc_header(&r, "Content-Type", ct, sizeof ct));
    cr_assert_str_eq(ct, "text/event-stream");
    ev->n = 0;
    for (char *at = r.body; at && *at;) {
        char *end = strstr(at, "\n\n");
        cr_assert(end, "an event without its blank line: %s", at);
        *end = 0;
        cr_assert_eq(strncmp(at, "event: ", 7), 0, "an event without a name: %s", at);
        char *data = strstr(at, "\ndata: ");
        cr_assert(data, "%s", at);
        cr_assert_lt(ev->n, 256);
        snprintf(ev->name[ev->n], sizeof ev->name[0], "%.*s", (int)(data - at - 7), at + 7);
        ev->data[ev->n] = sp_json(data + 7);
        cr_assert_str_eq(sp_str_at(ev->data[ev->n], "type"), ev->name[ev->n],
                         "the data's type is the event's name");
        ev->n++;
        at = end + 2;
    }
    hc_response_free(&r);
}

/* A 400 (or status) in Anthropic's shape whose message holds needle. */
static void refused_as(const char *path, int status, const char *type, const char *body,
                       const char *needle)
{
    int got;
    char *text = sp_answer(path, body, &got);
    cr_assert_eq(got, status, "%s -> %d %s", body, got, text);
    cJSON *j = sp_json(text);
    cr_assert_str_eq(sp_str_at(j, "type"), "error", "%s", text);
    const cJSON *err = cJSON_GetObjectItem(j, "error");
    cr_assert_str_eq(sp_str_at(err, "type"), type, "%s", text);
    cr_assert(strstr(sp_str_at(err, "message"), needle), "%s -> %s (wanted \"%s\")", body, text,
              needle);
    cJSON_Delete(j);
    free(text);
}

static const char conversation[] =
    "\"system\": [{\"type\": \"text\", \"text\": \"Be brief.\"}], "
    "\"messages\": [{\"role\": \"user\", \"content\": \"What is the sea?\"}, "
    "{\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": \"Water.\"}]}, "
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"And\"}, "
    "{\"type\": \"text\", \"text\": \"the sky?\"}]}]";

static const char chat_conversation[] =
    "\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
    "{\"role\": \"user\", \"content\": \"What is the sea?\"}, "
    "{\"role\": \"assistant\", \"content\": \"Water.\"}, "
    "{\"role\": \"user\", \"content\": \"And\\nthe sky?\"}]";

Test(messages, a_whole_answer_is_chats_answer_in_anthropics_shape)
{
    char body[1024];
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"max_tokens\": 12, \"temperature\": 0, "
             "\"metadata\": {\"user_id\": \"u1\"}}",
             conversation);
    cJSON *m = ts_ok("/v1/messages", body);
    snprintf(body, sizeof body, "{\"model\": \"tiny\", %s, \"max_tokens\": 12, \"temperature\": 0}",
             chat_conversation);
    cJSON *chat = ts_ok("/v1/chat/completions", body);
    const cJSON *message =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0), "message");

    cr_assert_str_eq(sp_str_at(m, "type"), "message");
    cr_assert_str_eq(sp_str_at(m, "role"), "assistant");
    cr_assert_str_eq(sp_str_at(m, "model"), "tiny");
    cr_assert_str_eq(sp_str_at(m, "stop_reason"), "max_tokens");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(m, "stop_sequence")));
    const cJSON *content = cJSON_GetObjectItem(m, "content");
    cr_assert_eq(cJSON_GetArraySize(content), 1);
    const cJSON *block = cJSON_GetArrayItem(content, 0);
    cr_assert_str_eq(sp_str_at(block, "type"), "text");
    cr_assert_str_eq(sp_str_at(block, "text"), sp_str_at(message, "content"));
    const cJSON *usage = cJSON_GetObjectItem(m, "usage");
    const cJSON *chat_usage = cJSON_GetObjectItem(chat, "usage");
    cr_assert_eq(sp_num_at(usage, "output_tokens"), 12);
    cr_assert_eq(sp_num_at(usage, "input_tokens") + sp_num_at(usage, "cache_read_input_tokens"),
                 sp_num_at(chat_usage, "prompt_tokens"));
    cJSON_Delete(m);
    cJSON_Delete(chat);
}

Test(messages, a_stream_is_anthropics_events_in_order_joining_to_the_answer)
{
    char body[1024];
    snprintf(body, sizeof body, "{\"model\": \"tiny\", %s, \"max_tokens\": 10, \"temperature\": 0}",
             conversation);
    cJSON *whole = ts_ok("/v1/messages", body);
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"max_tokens\": 10, \"temperature\": 0, \"stream\": true}",
             conversation);
    msg_events ev;
    stream_of(body, &ev);
    cr_assert_geq(ev.n, 7);
    cr_assert_str_eq(ev.name[0], "message_start");
    cr_assert_str_eq(ev.name[1], "ping");
    cr_assert_str_eq(ev.name[2], "content_block_start");
    cr_assert_str_eq(ev.name[ev.n - 3], "content_block_stop");
    cr_assert_str_eq(ev.name[ev.n - 2], "message_delta");
    cr_assert_str_eq(ev.name[ev.n - 1], "message_stop");
    const cJSON *start = cJSON_GetObjectItem(ev.data[0], "message");
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(start, "content")), 0);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(start, "stop_reason")));
    char joined[256] = "";
    for (int i = 3; i < ev.n - 3; i++) {
        cr_assert_str_eq(ev.name[i], "content_block_delta");
        cr_assert_eq(sp_num_at(ev.data[i], "index"), 0);
        const cJSON *d = cJSON_GetObjectItem(ev.data[i], "delta");
        cr_assert_str_eq(sp_str_at(d, "type"), "text_delta");
        strncat(joined, sp_str_at(d, "text"), sizeof joined - strlen(joined) - 1);
    }
    const cJSON *block = cJSON_GetArrayItem(cJSON_GetObjectItem(whole, "content"), 0);
    cr_assert_str_eq(joined, sp_str_at(block, "text"));
    const cJSON *delta = cJSON_GetObjectItem(ev.data[ev.n - 2], "delta");
    cr_assert_str_eq(sp_str_at(delta, "stop_reason"), "max_tokens");
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(ev.data[ev.n - 2], "usage"), "output_tokens"), 10);
    events_free(&ev);
    cJSON_Delete(whole);
}

Test(messages, a_stop_sequence_ends_the_answer_is_left_out_and_named)
{
    const char *ask = "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": "
                      "\"Hi\"}], \"max_tokens\": 16, \"temperature\": 0%s}";
    char body[512];
    snprintf(body, sizeof body, ask, "");
    cJSON *free_run = ts_ok("/v1/messages", body);
    const char *text =
        sp_str_at(cJSON_GetArrayItem(cJSON_GetObjectItem(free_run, "content"), 0), "text");
    cr_assert_geq(strlen(text), 6, "%s", text);
    /* two printable ASCII characters from the free answer, past its first
     * (the model's bytes may be any), and one stop never in it */
    size_t at = 1;
    while (text[at] && text[at + 1] &&
           !(text[at] >= 0x20 && text[at] < 0x7f && text[at + 1] >= 0x20 && text[at + 1] < 0x7f))
        at++;
    cr_assert(text[at] && text[at + 1], "no two ASCII characters in %s", text);
    char stop[3] = {text[at], text[at + 1], 0};
    char expected[64];
    snprintf(expected, sizeof expected, "%.*s", (int)(strstr(text, stop) - text), text);
    char extra[128];
    /* stop strings written as JSON escapes, so any character goes */
    cr_assert_null(strstr(text, "~~~~"));
    snprintf(extra, sizeof extra, ", \"stop_sequences\": [\"~~~~\", \"\\u%04x\\u%04x\"]",
             (unsigned char)stop[0], (unsigned char)stop[1]);
    snprintf(body, sizeof body, ask, extra);
    cJSON *m = ts_ok("/v1/messages", body);
    cr_assert_str_eq(sp_str_at(m, "stop_reason"), "stop_sequence");
    cr_assert_str_eq(sp_str_at(m, "stop_sequence"), stop);
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(cJSON_GetObjectItem(m, "content"), 0), "text"),
                     expected);

    char streamed[600];
    snprintf(streamed, sizeof streamed, "%.*s, \"stream\": true}", (int)strlen(body) - 1, body);
    msg_events ev;
    stream_of(streamed, &ev);
    char joined[128] = "";
    for (int i = 0; i < ev.n; i++)
        if (strcmp(ev.name[i], "content_block_delta") == 0)
            strncat(joined, sp_str_at(cJSON_GetObjectItem(ev.data[i], "delta"), "text"),
                    sizeof joined - strlen(joined) - 1);
    cr_assert_str_eq(joined, expected);
    const cJSON *delta = cJSON_GetObjectItem(ev.data[ev.n - 2], "delta");
    cr_assert_str_eq(sp_str_at(delta, "stop_reason"), "stop_sequence");
    cr_assert_str_eq(sp_str_at(delta, "stop_sequence"), stop);
    events_free(&ev);
    cJSON_Delete(m);
    cJSON_Delete(free_run);
}

static const char weather_tool[] =
    "\"tools\": [{\"name\": \"get_weather\", \"description\": \"The weather\", \"input_schema\": "
    "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 6}}, "
    "\"required\": [\"city\"], \"additionalProperties\": false}}]";

Test(messages, a_forced_tool_is_a_tool_use_block_whole_and_streamed)
{
    char body[1024];
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"Rain?\"}], "
             "%s, \"tool_choice\": {\"type\": \"tool\", \"name\": \"get_weather\"}, "
             "\"max_tokens\": 64, \"temperature\": 0%s}",
             weather_tool, "");
    cJSON *m = ts_ok("/v1/messages", body);
    cr_assert_str_eq(sp_str_at(m, "stop_reason"), "tool_use");
    const cJSON *content = cJSON_GetObjectItem(m, "content");
    cr_assert_eq(cJSON_GetArraySize(content), 1);
    const cJSON *use = cJSON_GetArrayItem(content, 0);
    cr_assert_str_eq(sp_str_at(use, "type"), "tool_use");
    cr_assert_str_eq(sp_str_at(use, "name"), "get_weather");
    cr_assert(strlen(sp_str_at(use, "id")) > 0);
    const cJSON *input = cJSON_GetObjectItem(use, "input");
    cr_assert(cJSON_IsString(cJSON_GetObjectItem(input, "city")));

    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"Rain?\"}], "
             "%s, \"tool_choice\": {\"type\": \"tool\", \"name\": \"get_weather\"}, "
             "\"max_tokens\": 64, \"temperature\": 0, \"stream\": true}",
             weather_tool);
    msg_events ev;
    stream_of(body, &ev);
    cr_assert_str_eq(ev.name[2], "content_block_start");
    const cJSON *block = cJSON_GetObjectItem(ev.data[2], "content_block");
    cr_assert_str_eq(sp_str_at(block, "type"), "tool_use");
    cr_assert_str_eq(sp_str_at(block, "name"), "get_weather");
    cr_assert(strlen(sp_str_at(block, "id")) > 0);
    char joined[256] = "";
    for (int i = 3; i < ev.n - 3; i++) {
        const cJSON *d = cJSON_GetObjectItem(ev.data[i], "delta");
        cr_assert_str_eq(sp_str_at(d, "type"), "input_json_delta");
        strncat(joined, sp_str_at(d, "partial_json"), sizeof joined - strlen(joined) - 1);
    }
    cJSON *streamed_input = sp_json(joined);
    cr_assert(cJSON_Compare(streamed_input, input, true), "%s", joined);
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(ev.data[ev.n - 2], "delta"), "stop_reason"),
                     "tool_use");
    cJSON_Delete(streamed_input);
    events_free(&ev);
    cJSON_Delete(m);
}

Test(messages, tool_use_and_tool_result_are_chats_tool_calls_and_tool_messages)
{
    char body[2048];
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"system\": \"Be brief.\", \"messages\": ["
             "{\"role\": \"user\", \"content\": \"Rain in Oslo?\"}, "
             "{\"role\": \"assistant\", \"content\": [{\"type\": \"tool_use\", \"id\": \"tu_1\", "
             "\"name\": \"get_weather\", \"input\": {\"city\": \"Oslo\"}}]}, "
             "{\"role\": \"user\", \"content\": [{\"type\": \"tool_result\", \"tool_use_id\": "
             "\"tu_1\", \"content\": [{\"type\": \"text\", \"text\": \"wet\"}], \"is_error\": "
             "false}, {\"type\": \"text\", \"text\": \"So?\"}]}]}",
             weather_tool);
    cJSON *count = ts_ok("/v1/messages/count_tokens", body);
    const char *chat_body =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
        "{\"role\": \"user\", \"content\": \"Rain in Oslo?\"}, "
        "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"tu_1\", "
        "\"type\": "
        "\"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
        "\"{\\\"city\\\": \\\"Oslo\\\"}\"}}]}, "
        "{\"role\": \"tool\", \"tool_call_id\": \"tu_1\", \"content\": \"wet\"}, "
        "{\"role\": \"user\", \"content\": \"So?\"}]}";
    cJSON *tokenized = ts_ok("/chat_tokenize", chat_body);
    const char *text = sp_str_at(tokenized, "templated_text");
    cr_assert(strstr(text, "<tool>wet(tu_1)<user>So?"), "%s", text);
    cr_assert(strstr(text, "[get_weather {\"city\": \"Oslo\"}]"), "%s", text);
    cr_assert_eq(sp_num_at(count, "input_tokens"),
                 cJSON_GetArraySize(cJSON_GetObjectItem(tokenized, "tokenize_response")));
    cJSON_Delete(count);
    cJSON_Delete(tokenized);
}

Test(messages, refusals_are_anthropics_shape_and_name_the_field)
{
    const char *p = "/v1/messages", *t = "invalid_request_error";
    const char *user = "\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]";
    char body[1024];
    snprintf(body, sizeof body, "{\"model\": \"tiny\", %s}", user);
    refused_as(p, 400, t, body, "max_tokens: field required");
    snprintf(body, sizeof body, "{\"model\": \"tiny\", %s, \"max_tokens\": 4, \"bogus\": 1}", user);
    refused_as(p, 400, t, body, "unknown field \"bogus\"");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"max_tokens\": 4, \"temperature\": 1.5}", user);
    refused_as(p, 400, t, body, "\"temperature\" is 1.5");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", "
             "\"content\": [{\"type\": \"image\", \"source\": {}}]}]}");
    refused_as(p, 400, t, body, "messages[0].content[0]: a \"image\" block is not supported");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", "
             "\"content\": [{\"type\": \"tool_use\", \"id\": \"a\", \"name\": \"f\", \"input\": "
             "{}}]}]}");
    refused_as(p, 400, t, body, "a user's may be text and tool_result");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"max_tokens\": 4, \"tools\": [{\"type\": "
             "\"web_search_20250305\", \"name\": \"web_search\"}]}",
             user);
    refused_as(p, 400, t, body, "tools[0]: server tools (\"web_search_20250305\")");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"max_tokens\": 4, %s, \"tool_choice\": {\"type\": "
             "\"tool\", \"name\": \"nope\"}}",
             user, weather_tool);
    refused_as(p, 400, t, body, "tool_choice.name must name one of the tools, not nope");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", %s, \"max_tokens\": 4, \"thinking\": {\"type\": \"always\"}}",
             user);
    refused_as(p, 400, t, body, "thinking: must be {\"type\": \"enabled\"");
    snprintf(body, sizeof body, "{\"model\": \"tiny\", %s, \"max_tokens\": 4, \"mcp_servers\": []}",
             user);
    refused_as(p, 400, t, body, "mcp_servers: not supported");
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"max_tokens\": 4, \"messages\": [{\"role\": \"system\", "
             "\"content\": \"x\"}]}");
    refused_as(p, 400, t, body, "messages[0].role must be user or assistant, not system");
    snprintf(body, sizeof body, "{\"model\": \"no-such\", %s, \"max_tokens\": 4}", user);
    refused_as(p, 404, "not_found_error", body, "model no-such");
    refused_as("/v1/messages/count_tokens", 400, t, "{\"model\": \"tiny\", \"messages\": []}",
               "messages: must be a non-empty list");
    refused_as("/v1/messages/nope", 404, "not_found_error", "{}", "no route");
    /* the other routes keep OpenAI's shape */
    int got;
    char *text = sp_answer("/v1/chat/completions", "{\"bogus\": 1}", &got);
    cJSON *j = sp_json(text);
    cr_assert_eq(got, 400);
    cr_assert_null(cJSON_GetObjectItem(j, "type"), "%s", text);
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(j, "error"), "type"), "invalid_request");
    cJSON_Delete(j);
    free(text);
}

/* A server asking for an API key (its own suite: no server of setup's). */
TestSuite(messages_key, .fini = ts_teardown, .timeout = 300);

Test(messages_key, the_key_is_read_from_x_api_key_or_bearer)
{
    char key_dir[512], key_path[600];
    test_tmpdir(key_dir, sizeof key_dir);
    snprintf(key_path, sizeof key_path, "%s/key", key_dir);
    test_write_text(key_path, "s3cret-key\n");
    cr_assert_eq(chmod(key_path, 0600), 0);
    const char *extra[] = {"--api-key-file", key_path, NULL};
    ts_start_with(MSG_TEMPLATE, extra);
    const char *body = "{\"model\": \"tiny\", \"max_tokens\": 2, \"messages\": [{\"role\": "
                       "\"user\", \"content\": \"Hi\"}]}";
    hc_response r = sp_request("POST", "/v1/messages",
                               "x-api-key: s3cret-key\r\nanthropic-version: 2023-06-01\r\n", body);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    r = sp_request("POST", "/v1/messages", "Authorization: Bearer s3cret-key\r\n", body);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    r = sp_request("POST", "/v1/messages", "x-api-key: wrong\r\n", body);
    cr_assert_eq(r.status, 401, "%s", r.body);
    cJSON *j = sp_json(r.body);
    cr_assert_str_eq(sp_str_at(j, "type"), "error");
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(j, "error"), "type"), "authentication_error");
    cJSON_Delete(j);
    hc_response_free(&r);
    /* OpenAI's routes take x-api-key too, and keep OpenAI's 401 */
    r = sp_request("POST", "/v1/chat/completions", "x-api-key: wrong\r\n", body);
    cr_assert_eq(r.status, 401, "%s", r.body);
    j = sp_json(r.body);
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(j, "error"), "code"), "invalid_api_key");
    cJSON_Delete(j);
    hc_response_free(&r);
    test_rmtree(key_dir);
}

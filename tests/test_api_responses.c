/*
 * test_api_responses.c - OpenAI's Responses API (POST /v1/responses) end to
 * end: the real binary on the tiny random model (tests/tiny_server.h),
 * spoken to over TCP.
 *
 * What is pinned: the Responses API is chat completions read and written
 * in another shape, so a greedy answer is chat's answer to the same
 * conversation (instructions and input items, function_call and
 * function_call_output items included: the same text and the same prompt
 * tokens); a cut answer is status "incomplete" with reason
 * max_output_tokens; a stream is OpenAI's named events, numbered from 0
 * without gaps, whose text deltas join to the whole answer and whose call
 * argument deltas join to the call's arguments; text.format json_schema
 * constrains the answer; a named function is one function_call item; a
 * stored response is answered again by GET, forgotten by DELETE and
 * continued by previous_response_id as chat's answer to the whole
 * conversation; the store keeps its bounds, dropping the least recently
 * used; and the fields not implemented are refused by name.
 */
#include "internal/responses_store.h"
#include "tiny_server.h"

/* Each message's role and content, an assistant's calls and a tool
 * message's call id: what the translation must keep. */
#define RESP_TEMPLATE                                                                              \
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"                                   \
    "{% if m['tool_calls'] %}{% for t in m['tool_calls'] %}[{{ t['function']['name'] }} "          \
    "{{ t['function']['arguments'] | tojson }}]{% endfor %}{% endif %}"                            \
    "{% if m['tool_call_id'] %}({{ m['tool_call_id'] }}){% endif %}{% endfor %}<assistant>"

static void setup(void)
{
    ts_start(RESP_TEMPLATE);
}

TestSuite(responses, .init = setup, .fini = ts_teardown, .timeout = 300);

/* A stream's events (names, parsed data), read whole. */
typedef struct resp_events {
    int n;
    char name[512][64];
    cJSON *data[512];
} resp_events;

static void events_free(resp_events *ev)
{
    for (int i = 0; i < ev->n; i++)
        cJSON_Delete(ev->data[i]);
}

static void stream_of(const char *body, resp_events *ev)
{
    hc_response r = sp_request("POST", "/v1/responses", NULL, body);
    cr_assert_eq(r.status, 200, "%s -> %d %s", body, r.status, r.body);
    ev->n = 0;
    for (char *at = r.body; at && *at;) {
        char *end = strstr(at, "\n\n");
        cr_assert(end, "%s", at);
        *end = 0;
        cr_assert_eq(strncmp(at, "event: ", 7), 0, "%s", at);
        char *data = strstr(at, "\ndata: ");
        cr_assert(data, "%s", at);
        cr_assert_lt(ev->n, 512);
        snprintf(ev->name[ev->n], sizeof ev->name[0], "%.*s", (int)(data - at - 7), at + 7);
        ev->data[ev->n] = sp_json(data + 7);
        cr_assert_str_eq(sp_str_at(ev->data[ev->n], "type"), ev->name[ev->n]);
        cr_assert_eq(sp_num_at(ev->data[ev->n], "sequence_number"), ev->n,
                     "sequence numbers count the events from 0");
        ev->n++;
        at = end + 2;
    }
    hc_response_free(&r);
}

/* The text of a response's output (its message items' output_text). */
static void output_text(const cJSON *r, char *out, size_t cap)
{
    out[0] = 0;
    const cJSON *item;
    cJSON_ArrayForEach (item, cJSON_GetObjectItem(r, "output")) {
        if (strcmp(sp_str_at(item, "type"), "message") != 0)
            continue;
        const cJSON *part;
        cJSON_ArrayForEach (part, cJSON_GetObjectItem(item, "content"))
            strncat(out, sp_str_at(part, "text"), cap - strlen(out) - 1);
    }
}

static const char chat_form[] =
    "{\"model\": \"tiny\", \"max_tokens\": 10, \"temperature\": 0, \"messages\": ["
    "{\"role\": \"system\", \"content\": \"Be brief.\"}, "
    "{\"role\": \"user\", \"content\": \"Rain in Oslo?\"}, "
    "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": "
    "\"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": "
    "\\\"Oslo\\\"}\"}}]}, "
    "{\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"wet\"}, "
    "{\"role\": \"system\", \"content\": \"Answer now\"}]}";

static const char responses_form[] =
    "{\"model\": \"tiny\", \"max_output_tokens\": 10, \"temperature\": 0, "
    "\"instructions\": \"Be brief.\", \"input\": ["
    "{\"role\": \"user\", \"content\": [{\"type\": \"input_text\", \"text\": \"Rain in Oslo?\"}]}, "
    "{\"type\": \"function_call\", \"call_id\": \"c1\", \"name\": \"get_weather\", "
    "\"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}, "
    "{\"type\": \"function_call_output\", \"call_id\": \"c1\", \"output\": \"wet\"}, "
    "{\"type\": \"message\", \"role\": \"developer\", \"content\": \"Answer now\"}]}";

Test(responses, a_whole_answer_is_chats_answer_to_the_same_conversation)
{
    cJSON *chat = ts_ok("/v1/chat/completions", chat_form);
    cJSON *r = ts_ok("/v1/responses", responses_form);
    cr_assert_str_eq(sp_str_at(r, "object"), "response");
    cr_assert_str_eq(sp_str_at(r, "status"), "incomplete");
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(r, "incomplete_details"), "reason"),
                     "max_output_tokens");
    cr_assert_str_eq(sp_str_at(r, "instructions"), "Be brief.");
    char text[256];
    output_text(r, text, sizeof text);
    const cJSON *message =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0), "message");
    cr_assert_str_eq(text, sp_str_at(message, "content"));
    const cJSON *usage = cJSON_GetObjectItem(r, "usage");
    cr_assert_eq(sp_num_at(usage, "input_tokens"),
                 sp_num_at(cJSON_GetObjectItem(chat, "usage"), "prompt_tokens"));
    cr_assert_eq(sp_num_at(usage, "output_tokens"), 10);
    cr_assert_eq(sp_num_at(usage, "total_tokens"), sp_num_at(usage, "input_tokens") + 10);
    cJSON_Delete(r);
    cJSON_Delete(chat);
}

Test(responses, a_stream_is_numbered_events_joining_to_the_answer)
{
    const char *ask = "{\"model\": \"tiny\", \"input\": \"Hi\", \"max_output_tokens\": 9, "
                      "\"temperature\": 0%s}";
    char body[256];
    snprintf(body, sizeof body, ask, "");
    cJSON *whole = ts_ok("/v1/responses", body);
    snprintf(body, sizeof body, ask, ", \"stream\": true");
    resp_events ev;
    stream_of(body, &ev);
    static const char *const head[] = {"response.created", "response.in_progress",
                                       "response.output_item.added", "response.content_part.added"};
    static const char *const tail[] = {"response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"};
    cr_assert_geq(ev.n, 9);
    for (int i = 0; i < 4; i++) {
        cr_assert_str_eq(ev.name[i], head[i]);
        cr_assert_str_eq(ev.name[ev.n - 4 + i], tail[i]);
    }
    char joined[256] = "", text[256];
    for (int i = 4; i < ev.n - 4; i++) {
        cr_assert_str_eq(ev.name[i], "response.output_text.delta");
        strncat(joined, sp_str_at(ev.data[i], "delta"), sizeof joined - strlen(joined) - 1);
    }
    output_text(whole, text, sizeof text);
    cr_assert_str_eq(joined, text);
    cr_assert_str_eq(sp_str_at(ev.data[ev.n - 4], "text"), text);
    const cJSON *final = cJSON_GetObjectItem(ev.data[ev.n - 1], "response");
    cr_assert_str_eq(sp_str_at(final, "status"), "incomplete");
    output_text(final, joined, sizeof joined);
    cr_assert_str_eq(joined, text);
    /* the items' ids agree from added to done and the final response */
    const char *id = sp_str_at(cJSON_GetObjectItem(ev.data[2], "item"), "id");
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(ev.data[ev.n - 2], "item"), "id"), id);
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(cJSON_GetObjectItem(final, "output"), 0), "id"),
                     id);
    events_free(&ev);
    cJSON_Delete(whole);
}

static const char weather_tool[] =
    "\"tools\": [{\"type\": \"function\", \"name\": \"get_weather\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 6}}, "
    "\"required\": [\"city\"], \"additionalProperties\": false}, \"strict\": true}]";

Test(responses, a_named_function_is_one_function_call_item_whole_and_streamed)
{
    const char *ask = "{\"model\": \"tiny\", \"input\": \"Rain?\", %s, \"tool_choice\": {\"type\": "
                      "\"function\", \"name\": \"get_weather\"}, \"max_output_tokens\": 64, "
                      "\"temperature\": 0%s}";
    char body[1024];
    snprintf(body, sizeof body, ask, weather_tool, "");
    cJSON *r = ts_ok("/v1/responses", body);
    cr_assert_str_eq(sp_str_at(r, "status"), "completed");
    const cJSON *output = cJSON_GetObjectItem(r, "output");
    cr_assert_eq(cJSON_GetArraySize(output), 1);
    const cJSON *call = cJSON_GetArrayItem(output, 0);
    cr_assert_str_eq(sp_str_at(call, "type"), "function_call");
    cr_assert_str_eq(sp_str_at(call, "name"), "get_weather");
    cJSON *args = sp_json(sp_str_at(call, "arguments"));
    cr_assert(cJSON_IsString(cJSON_GetObjectItem(args, "city")));

    snprintf(body, sizeof body, ask, weather_tool, ", \"stream\": true");
    resp_events ev;
    stream_of(body, &ev);
    cr_assert_str_eq(ev.name[2], "response.output_item.added");
    cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(ev.data[2], "item"), "type"), "function_call");
    char joined[256] = "";
    int i = 3;
    for (; i < ev.n && strcmp(ev.name[i], "response.function_call_arguments.delta") == 0; i++)
        strncat(joined, sp_str_at(ev.data[i], "delta"), sizeof joined - strlen(joined) - 1);
    cr_assert_str_eq(ev.name[i], "response.function_call_arguments.done");
    cr_assert_str_eq(sp_str_at(ev.data[i], "arguments"), joined);
    cJSON *streamed = sp_json(joined);
    cr_assert(cJSON_Compare(streamed, args, true), "%s", joined);
    cr_assert_str_eq(ev.name[ev.n - 1], "response.completed");
    cJSON_Delete(streamed);
    cJSON_Delete(args);
    events_free(&ev);
    cJSON_Delete(r);
}

Test(responses, text_format_json_schema_constrains_the_answer)
{
    const char *body =
        "{\"model\": \"tiny\", \"input\": \"A pet\", \"max_output_tokens\": 80, \"temperature\": "
        "0, "
        "\"text\": {\"format\": {\"type\": \"json_schema\", \"name\": \"pet\", \"strict\": true, "
        "\"schema\": {\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", "
        "\"maxLength\": 5}}, \"required\": [\"name\"], \"additionalProperties\": false}}}}";
    cJSON *r = ts_ok("/v1/responses", body);
    cr_assert_str_eq(sp_str_at(r, "status"), "completed");
    char text[256];
    output_text(r, text, sizeof text);
    cJSON *pet = sp_json(text);
    cr_assert(cJSON_IsString(cJSON_GetObjectItem(pet, "name")), "%s", text);
    cr_assert_eq(cJSON_GetArraySize(pet), 1, "%s", text);
    cJSON_Delete(pet);
    cJSON_Delete(r);
}

Test(responses, fields_not_implemented_are_refused_by_name)
{
    const char *p = "/v1/responses";
    ts_refused(p, "{\"model\": \"tiny\", \"input\": \"x\", \"background\": true}",
               "background: not supported");
    ts_refused(p,
               "{\"model\": \"tiny\", \"input\": \"x\", \"tools\": [{\"type\": \"web_search\"}]}",
               "tools[0]: \"web_search\" tools are not supported");
    ts_refused(p,
               "{\"model\": \"tiny\", \"input\": [{\"role\": \"user\", \"content\": [{\"type\": "
               "\"input_image\", \"image_url\": \"x\"}]}]}",
               "input[0].content[0]: \"input_image\" parts are not supported");
    ts_refused(p,
               "{\"model\": \"tiny\", \"input\": [{\"type\": \"item_reference\", \"id\": \"x\"}]}",
               "input[0]: \"item_reference\" items are not supported");
    ts_refused(p, "{\"model\": \"tiny\", \"input\": \"x\", \"bogus\": 1}",
               "unknown field \"bogus\"");
    ts_refused(p, "{\"model\": \"tiny\", \"input\": []}", "input: must be a string or a list");
    ts_refused(p,
               "{\"model\": \"tiny\", \"input\": \"x\", \"text\": {\"format\": {\"type\": "
               "\"json_schema\", \"name\": \"n\"}}}",
               "text.format must be text, json_object, or json_schema with a \"schema\"");
}

Test(responses, a_stored_response_is_read_again_continued_and_deleted)
{
    cJSON *first =
        ts_ok("/v1/responses", "{\"model\": \"tiny\", \"instructions\": \"Be brief.\", \"input\": "
                               "\"Rain?\", \"max_output_tokens\": 6, \"temperature\": 0}");
    const char *id = sp_str_at(first, "id");
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(first, "store")));
    char text[256], path[256];
    output_text(first, text, sizeof text);
    snprintf(path, sizeof path, "/v1/responses/%s", id);
    hc_response r = sp_request("GET", path, NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cJSON *again = sp_json(r.body);
    cr_assert(cJSON_Compare(again, first, true), "GET answers the response as it was");
    cJSON_Delete(again);
    hc_response_free(&r);

    /* continued: chat's answer to the conversation (instructions not carried) */
    char body[1024];
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"previous_response_id\": \"%s\", \"input\": \"So?\", "
             "\"max_output_tokens\": 6, \"temperature\": 0}",
             id);
    cJSON *second = ts_ok("/v1/responses", body);
    cr_assert_str_eq(sp_str_at(second, "previous_response_id"), id);
    cJSON *messages = cJSON_CreateArray();
    const char *turns[][2] = {{"user", "Rain?"}, {"assistant", text}, {"user", "So?"}};
    for (size_t i = 0; i < 3; i++) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", turns[i][0]);
        cJSON_AddStringToObject(m, "content", turns[i][1]);
        cJSON_AddItemToArray(messages, m);
    }
    cJSON *chat_body = cJSON_CreateObject();
    cJSON_AddStringToObject(chat_body, "model", "tiny");
    cJSON_AddItemToObject(chat_body, "messages", messages);
    cJSON_AddNumberToObject(chat_body, "max_tokens", 6);
    cJSON_AddNumberToObject(chat_body, "temperature", 0);
    char *chat_text = cJSON_PrintUnformatted(chat_body);
    cJSON *chat = ts_ok("/v1/chat/completions", chat_text);
    char continued[256];
    output_text(second, continued, sizeof continued);
    const cJSON *message =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0), "message");
    cr_assert_str_eq(continued, sp_str_at(message, "content"));
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(second, "usage"), "input_tokens"),
                 sp_num_at(cJSON_GetObjectItem(chat, "usage"), "prompt_tokens"));

    r = sp_request("DELETE", path, NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cJSON *deleted = sp_json(r.body);
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(deleted, "deleted")));
    cJSON_Delete(deleted);
    hc_response_free(&r);
    r = sp_request("GET", path, NULL, NULL);
    cr_assert_eq(r.status, 404, "%s", r.body);
    hc_response_free(&r);
    int got;
    char *refused = sp_answer("/v1/responses", body, &got);
    cr_assert_eq(got, 404, "%s", refused);
    cr_assert(strstr(refused, "previous_response_id: no stored response"), "%s", refused);
    free(refused);

    /* store false: nothing kept */
    cJSON *unstored = ts_ok("/v1/responses", "{\"model\": \"tiny\", \"input\": \"Hi\", "
                                             "\"max_output_tokens\": 2, \"store\": false}");
    cr_assert(cJSON_IsFalse(cJSON_GetObjectItem(unstored, "store")));
    snprintf(path, sizeof path, "/v1/responses/%s", sp_str_at(unstored, "id"));
    r = sp_request("GET", path, NULL, NULL);
    cr_assert_eq(r.status, 404, "%s", r.body);
    hc_response_free(&r);
    cJSON_Delete(unstored);
    free(chat_text);
    cJSON_Delete(chat_body);
    cJSON_Delete(chat);
    cJSON_Delete(second);
    cJSON_Delete(first);
}

/* The store alone: its bounds and its order of use. */
Test(responses_store, keeps_its_bounds_dropping_the_least_recently_used)
{
    srv_resp_store *st = srv_resp_store_new(3, 4096);
    cr_assert(st);
    char id[8];
    for (int i = 0; i < 3; i++) {
        snprintf(id, sizeof id, "r%d", i);
        cr_assert(srv_resp_store_put(st, id, "{}", "[]"));
    }
    char *response = NULL, *conversation = NULL;
    cr_assert(srv_resp_store_get(st, "r0", &response, &conversation)); /* r0 now the newest */
    cr_assert_str_eq(response, "{}");
    cr_assert_str_eq(conversation, "[]");
    free(response);
    free(conversation);
    cr_assert(srv_resp_store_put(st, "r3", "{}", "[]")); /* count: r1 goes */
    cr_assert_not(srv_resp_store_get(st, "r1", NULL, NULL));
    cr_assert(srv_resp_store_get(st, "r0", NULL, NULL));
    cr_assert(srv_resp_store_get(st, "r2", NULL, NULL));
    /* a fourth again: the least recently used (r3) goes, not r2 just read */
    static char big[3000];
    memset(big, 'x', sizeof big - 1);
    cr_assert(srv_resp_store_put(st, "big", big, "[]"));
    cr_assert(srv_resp_store_get(st, "big", NULL, NULL));
    cr_assert(srv_resp_store_get(st, "r2", NULL, NULL), "the most recently used stays");
    cr_assert_not(srv_resp_store_get(st, "r3", NULL, NULL), "the least recently used went");
    /* one past the whole byte bound is not kept at all */
    static char huge[5000];
    memset(huge, 'x', sizeof huge - 1);
    cr_assert_not(srv_resp_store_put(st, "huge", huge, "[]"));
    cr_assert(srv_resp_store_delete(st, "big"));
    cr_assert_not(srv_resp_store_delete(st, "big"));
    srv_resp_store_free(st);
}

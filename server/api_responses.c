/*
 * api_responses.c - OpenAI's Responses API, what newer OpenAI SDK code, the
 * Agents SDK and Codex call: POST /v1/responses, whole or streamed.
 *
 * A reader and a writer around chat completions' path, as api_messages.c
 * is (api_chat.h's srv_chat_prepare reads, chat_answer.c's parts are
 * written). The reader rewrites the body as a chat request: instructions
 * become a system message; input, a string (one user message) or a list
 * of items: messages (roles user, system, developer (a system message),
 * assistant; content a string or input_text / output_text parts), then
 * function_call items (the calls of an assistant message: consecutive
 * ones share it) and function_call_output items (tool messages); tools
 * {"type": "function", "name", "description", "parameters", "strict"}
 * become chat's function tools, tool_choice (auto, required, none,
 * {"type": "function", "name"}) and parallel_tool_calls pass as chat's;
 * text.format (text, json_object, json_schema) keeps the answer inside the
 * grammar compiler's JSON Schema as response_format does; max_output_tokens,
 * temperature and top_p are chat's sampling fields. The writer turns the
 * answer's parts into output items: a text part a message item with one
 * output_text part, a call a function_call item; status "incomplete" with
 * incomplete_details {"reason": "max_output_tokens"} when the token budget
 * cut it; usage with input_tokens_details.cached_tokens. A stream is
 * OpenAI's events, each with its sequence_number: response.created,
 * response.in_progress, per item response.output_item.added, (a message's)
 * response.content_part.added, response.output_text.delta,
 * response.output_text.done, response.content_part.done, (a call's)
 * response.function_call_arguments.delta and .done,
 * response.output_item.done; then response.completed, or
 * response.incomplete when cut.
 *
 * store (OpenAI's default true) keeps the finished response in the
 * server's bounded store (responses_store.c: by count and bytes, least
 * recently used dropped first), with its conversation as chat messages:
 * GET /v1/responses/{id} answers it again, DELETE forgets it, and
 * previous_response_id puts its conversation (its input and output, not
 * its instructions, as OpenAI does) before the new input; an id not kept
 * is a 404 in OpenAI's shape.
 *
 * What was chosen where OpenAI leaves it open or this server cannot
 * follow: ids are "resp-N" (the answer's; N restarts with the server, as
 * the store does), "msg_N_K" and "fc_" and the call's id; without
 * max_output_tokens the answer may fill the context (chat's default). Not
 * implemented, refused by name: conversation, background, prompt,
 * item types other than message, function_call, function_call_output and
 * reasoning (taken back, left out of the prompt), content parts other than text
 * (input_image, input_file, input_audio), tools other than function tools
 * (web_search, file_search, mcp, ...), top_logprobs. Accepted and ignored:
 * metadata (repeated, not searched), user, safety_identifier,
 * prompt_cache_key, service_tier, truncation "disabled", include [] or
 * ["reasoning.encrypted_content"] (a local model's reasoning is in the
 * clear: nothing is encrypted), and text.verbosity. reasoning: effort onto
 * the template's enable_thinking (read_reasoning).
 *
 * Offers srv_responses_create, srv_responses_get and srv_responses_delete
 * (internal/api_responses.h) to routes.c; owns the Responses request and
 * answer shapes and a request's resp_writer. Touches api_chat.c's
 * srv_chat_prepare, chat_answer.c's parts, responses_store.c,
 * request.c's helpers, http.c's named stream events and bridge.c's
 * srv_gen_submit_made.
 */
#include "internal/api_responses.h"
#include "internal/api_chat.h"
#include "internal/chat_answer.h"
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/request.h"
#include "internal/responses_store.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Items of one request's input: as many as Anthropic's messages (a
 * conversation's turns, calls and results); their text is bounded by the
 * body's size. */
#define RESP_MAX_ITEMS 100000

/* --- the reader -------------------------------------------------------------------- */

/* Content (a string, or a list of input_text / output_text parts) as chat
 * content: the string, or chat's text parts; NULL after the 400. */
static cJSON *item_content(srv_conn *c, const cJSON *content, const char *where)
{
    if (cJSON_IsString(content))
        return cJSON_CreateString(content->valuestring);
    if (!cJSON_IsArray(content)) {
        srv_req_fail(c, 400, "%s must be a string or a list of input_text parts", where);
        return NULL;
    }
    static const char *const fields[] = {"type", "text", "annotations", "logprobs", NULL};
    cJSON *parts = cJSON_CreateArray();
    int k = 0;
    for (const cJSON *p = content->child; p; p = p->next, k++) {
        char at[96];
        snprintf(at, sizeof at, "%s[%d]", where, k);
        const char *type = cJSON_IsObject(p) ? mf_json_str(p, "type") : NULL;
        const char *text = mf_json_str(p, "text");
        bool texty = type && (strcmp(type, "input_text") == 0 || strcmp(type, "output_text") == 0);
        if (!texty || !text || !srv_req_only_known(c, p, at, fields)) {
            if (!texty || !text)
                srv_req_fail(c, 400,
                             "%s: %s%s%s parts are not supported here (input_text and "
                             "output_text are)",
                             at, type ? "\"" : "", type ? type : "untyped", type ? "\"" : "");
            cJSON_Delete(parts);
            return NULL;
        }
        cJSON *part = cJSON_CreateObject();
        cJSON_AddStringToObject(part, "type", "text");
        cJSON_AddStringToObject(part, "text", text);
        cJSON_AddItemToArray(parts, part);
    }
    return parts;
}

/* A message item (role and content) as a chat message appended to list. */
static bool message_item(srv_conn *c, const cJSON *it, const char *where, cJSON *list)
{
    static const char *const fields[] = {"type", "role", "content", "id", "status", NULL};
    if (!srv_req_only_known(c, it, where, fields))
        return false;
    const char *role = mf_json_str(it, "role");
    static const char *const roles[] = {"user", "system", "developer", "assistant", NULL};
    size_t r = 0;
    while (role && roles[r] && strcmp(roles[r], role) != 0)
        r++;
    if (!role || !roles[r]) {
        srv_req_fail(c, 400, "%s.role must be user, system, developer or assistant%s%s", where,
                     role ? ", not " : "", role ? role : "");
        return false;
    }
    char at[96];
    snprintf(at, sizeof at, "%s.content", where);
    cJSON *content = item_content(c, cJSON_GetObjectItemCaseSensitive(it, "content"), at);
    if (!content)
        return false;
    cJSON *m = cJSON_CreateObject();
    /* developer is OpenAI's newer name for system, which templates know */
    cJSON_AddStringToObject(m, "role", strcmp(role, "developer") == 0 ? "system" : role);
    cJSON_AddItemToObject(m, "content", content);
    cJSON_AddItemToArray(list, m);
    return true;
}

/* A function_call item as a call of the assistant message before it (one
 * made when the last message is not an assistant's). */
static bool call_item(srv_conn *c, const cJSON *it, const char *where, cJSON *list)
{
    static const char *const fields[] = {"type", "call_id", "name", "arguments",
                                         "id",   "status",  NULL};
    const char *call_id = mf_json_str(it, "call_id"), *name = mf_json_str(it, "name");
    const char *args = mf_json_str(it, "arguments");
    if (!srv_req_only_known(c, it, where, fields))
        return false;
    cJSON *parsed = args ? cJSON_Parse(args) : NULL;
    if (!call_id || !name || !cJSON_IsObject(parsed)) {
        cJSON_Delete(parsed);
        srv_req_fail(c, 400,
                     "%s must be {\"type\": \"function_call\", \"call_id\", \"name\", "
                     "\"arguments\": a JSON object written as a string}",
                     where);
        return false;
    }
    cJSON *last = cJSON_GetArrayItem(list, cJSON_GetArraySize(list) - 1);
    const char *last_role = last ? mf_json_str(last, "role") : NULL;
    if (!last_role || strcmp(last_role, "assistant") != 0) {
        last = cJSON_CreateObject();
        cJSON_AddStringToObject(last, "role", "assistant");
        cJSON_AddStringToObject(last, "content", "");
        cJSON_AddItemToArray(list, last);
    }
    cJSON *calls = cJSON_GetObjectItemCaseSensitive(last, "tool_calls");
    if (!calls)
        calls = cJSON_AddArrayToObject(last, "tool_calls");
    cJSON *call = cJSON_CreateObject();
    cJSON_AddStringToObject(call, "id", call_id);
    cJSON_AddStringToObject(call, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(call, "function");
    cJSON_AddStringToObject(fn, "name", name);
    cJSON_AddItemToObject(fn, "arguments", parsed);
    cJSON_AddItemToArray(calls, call);
    return true;
}

/* A function_call_output item as a tool message. */
static bool output_item(srv_conn *c, const cJSON *it, const char *where, cJSON *list)
{
    static const char *const fields[] = {"type", "call_id", "output", "id", "status", NULL};
    const char *call_id = mf_json_str(it, "call_id");
    if (!srv_req_only_known(c, it, where, fields))
        return false;
    if (!call_id) {
        srv_req_fail(c, 400, "%s.call_id must be a string", where);
        return false;
    }
    char at[96];
    snprintf(at, sizeof at, "%s.output", where);
    cJSON *content = item_content(c, cJSON_GetObjectItemCaseSensitive(it, "output"), at);
    if (!content)
        return false;
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "tool");
    cJSON_AddStringToObject(m, "tool_call_id", call_id);
    cJSON_AddItemToObject(m, "content", content);
    cJSON_AddItemToArray(list, m);
    return true;
}

/* previous_response_id's conversation (the stored response's input and
 * output as chat messages, its instructions not carried over, as OpenAI
 * does) appended to list; a 404 when it is not stored. */
static bool previous_conversation(srv_conn *c, const cJSON *root, cJSON *list)
{
    const char *previous = NULL;
    if (!srv_req_get_string(c, root, "previous_response_id", &previous))
        return false;
    if (!previous)
        return true;
    char *text = NULL;
    if (!srv_resp_store_get(c->s->responses, previous, NULL, &text)) {
        srv_req_fail(c, 404,
                     "previous_response_id: no stored response %s (stored responses are kept in "
                     "memory, the least recently used dropped first)",
                     previous);
        return false;
    }
    cJSON *messages = cJSON_Parse(text);
    free(text);
    for (cJSON *m; messages && (m = cJSON_DetachItemFromArray(messages, 0));)
        cJSON_AddItemToArray(list, m);
    cJSON_Delete(messages);
    return true;
}

/* instructions, previous_response_id's conversation and input into chat's
 * "messages". */
static bool read_input(srv_conn *c, const cJSON *root, cJSON *chat)
{
    cJSON *list = cJSON_AddArrayToObject(chat, "messages");
    const char *instructions = NULL;
    if (!srv_req_get_string(c, root, "instructions", &instructions))
        return false;
    if (instructions) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddStringToObject(m, "content", instructions);
        cJSON_AddItemToArray(list, m);
    }
    if (!previous_conversation(c, root, list))
        return false;
    const cJSON *input = cJSON_GetObjectItemCaseSensitive(root, "input");
    if (cJSON_IsString(input)) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", input->valuestring);
        cJSON_AddItemToArray(list, m);
        return true;
    }
    int n = cJSON_IsArray(input) ? cJSON_GetArraySize(input) : 0;
    if (n == 0 || n > RESP_MAX_ITEMS) {
        srv_req_fail(c, 400, "input: must be a string or a list of 1 to %d items", RESP_MAX_ITEMS);
        return false;
    }
    int i = 0;
    for (const cJSON *it = input->child; it; it = it->next, i++) {
        char where[32];
        snprintf(where, sizeof where, "input[%d]", i);
        const char *type = cJSON_IsObject(it) ? mf_json_str(it, "type") : NULL;
        bool ok;
        if (!cJSON_IsObject(it)) {
            srv_req_fail(c, 400, "%s must be an object", where);
            ok = false;
        } else if (!type || strcmp(type, "message") == 0)
            ok = message_item(c, it, where, list);
        else if (strcmp(type, "function_call") == 0)
            ok = call_item(c, it, where, list);
        else if (strcmp(type, "function_call_output") == 0)
            ok = output_item(c, it, where, list);
        else if (strcmp(type, "reasoning") == 0)
            ok = true; /* an earlier turn's: templates leave it out (Qwen3's drops it) */
        else {
            srv_req_fail(c, 400,
                         "%s: \"%s\" items are not supported by this server (message, "
                         "function_call, function_call_output and reasoning are)",
                         where, type);
            ok = false;
        }
        if (!ok)
            return false;
    }
    return true;
}

/* tools[k] {"type": "function", "name", "description", "parameters",
 * "strict"} as a chat tool appended to out. */
static bool read_tool(srv_conn *c, const cJSON *tool, int k, cJSON *out)
{
    static const char *const fields[] = {"type",       "name",   "description",
                                         "parameters", "strict", NULL};
    char where[32];
    snprintf(where, sizeof where, "tools[%d]", k);
    const char *type = cJSON_IsObject(tool) ? mf_json_str(tool, "type") : NULL;
    if (!type || strcmp(type, "function") != 0) {
        srv_req_fail(c, 400,
                     "%s: %s%s%s tools are not supported by this server (function tools are)",
                     where, type ? "\"" : "", type ? type : "untyped", type ? "\"" : "");
        return false;
    }
    if (!srv_req_only_known(c, tool, where, fields))
        return false;
    cJSON *t = cJSON_CreateObject();
    cJSON_AddStringToObject(t, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(t, "function");
    for (const cJSON *f = tool->child; f; f = f->next)
        if (strcmp(f->string, "type") != 0)
            cJSON_AddItemToObject(fn, f->string, cJSON_Duplicate(f, true));
    cJSON_AddItemToArray(out, t);
    return true; /* chat_tools.c checks the name and the parameters */
}

/* tools, tool_choice and parallel_tool_calls into chat. */
static bool read_tools(srv_conn *c, const cJSON *root, cJSON *chat)
{
    if (!srv_chat_read_tools(c, root, chat, read_tool))
        return false;
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    if (cJSON_IsObject(tc)) { /* {"type": "function", "name"}: chat's named function */
        static const char *const fields[] = {"type", "name", NULL};
        const char *type = mf_json_str(tc, "type"), *name = mf_json_str(tc, "name");
        if (!type || strcmp(type, "function") != 0 || !name ||
            !srv_req_only_known(c, tc, "tool_choice", fields)) {
            if (!type || strcmp(type, "function") != 0 || !name)
                srv_req_fail(c, 400,
                             "tool_choice must be auto, required, none or {\"type\": "
                             "\"function\", \"name\"}");
            return false;
        }
        cJSON *choice = cJSON_AddObjectToObject(chat, "tool_choice");
        cJSON_AddStringToObject(choice, "type", "function");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(choice, "function"), "name", name);
    } else if (!srv_req_is_null(tc)) {
        cJSON_AddItemToObject(chat, "tool_choice", cJSON_Duplicate(tc, true));
    }
    const cJSON *parallel = cJSON_GetObjectItemCaseSensitive(root, "parallel_tool_calls");
    if (!srv_req_is_null(parallel))
        cJSON_AddItemToObject(chat, "parallel_tool_calls", cJSON_Duplicate(parallel, true));
    return true;
}

/* text {"format": {"type": text | json_object | json_schema, "name",
 * "schema", "strict", "description"}, "verbosity"} into a's grammar. */
static bool read_text_format(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    static const char *const fields[] = {"format", "verbosity", NULL};
    static const char *const format_fields[] = {"type",   "name",        "schema",
                                                "strict", "description", NULL};
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text");
    if (srv_req_is_null(text))
        return true;
    if (!cJSON_IsObject(text) || !srv_req_only_known(c, text, "text", fields))
        return cJSON_IsObject(text) ? false
                                    : (srv_req_fail(c, 400, "text: must be an object"), false);
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(text, "format");
    if (srv_req_is_null(format))
        return true;
    const char *type = cJSON_IsObject(format) ? mf_json_str(format, "type") : NULL;
    if (!type || !srv_req_only_known(c, format, "text.format", format_fields)) {
        if (!type)
            srv_req_fail(c, 400, "text.format must be an object with a \"type\"");
        return false;
    }
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(format, "schema");
    if (strcmp(type, "text") == 0)
        return true;
    if (strcmp(type, "json_object") == 0)
        return srv_req_ask_grammar(c, a, GR_JSON_SCHEMA, "{\"type\":\"object\"}", 17,
                                   "text.format");
    if (strcmp(type, "json_schema") == 0 && cJSON_IsObject(schema))
        return srv_req_ask_schema(c, a, schema, "text.format.schema");
    srv_req_fail(c, 400,
                 "text.format must be text, json_object, or json_schema with a \"schema\""
                 " object, not %s",
                 type);
    return false;
}

/* reasoning {"effort", "summary"}: onto the template's enable_thinking
 * (chat_template_kwargs): effort "none" turns thinking off, any other
 * effort on (and is the template's reasoning_effort, as chat's field);
 * no effort leaves the template's default. The effort's degree
 * and summary are not implemented (the reasoning item carries the whole
 * reasoning as content, and an empty summary). */
static bool read_reasoning(srv_conn *c, const cJSON *root, cJSON *chat)
{
    static const char *const fields[] = {"effort", "summary", "generate_summary", NULL};
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(root, "reasoning");
    if (srv_req_is_null(r))
        return true;
    const char *effort = NULL;
    if (!cJSON_IsObject(r)) {
        srv_req_fail(c, 400, "reasoning: must be an object");
        return false;
    }
    if (!srv_req_only_known(c, r, "reasoning", fields) ||
        !srv_req_get_string(c, r, "effort", &effort))
        return false;
    bool on = effort && strcmp(effort, "none") != 0;
    if (effort)
        cJSON_AddBoolToObject(cJSON_AddObjectToObject(chat, "chat_template_kwargs"),
                              "enable_thinking", on);
    if (on) /* GPT-OSS's template's own variable */
        cJSON_AddStringToObject(chat, "reasoning_effort", effort);
    return true;
}

/* Fields a Responses body may carry that this server does not implement. */
static bool refuse_unimplemented(srv_conn *c, const cJSON *root)
{
    static const char *const refused[] = {"conversation", "prompt", "top_logprobs"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
        if (!srv_req_is_null(cJSON_GetObjectItemCaseSensitive(root, refused[i]))) {
            srv_req_fail(c, 400, "%s: not supported by this server", refused[i]);
            return false;
        }
    bool background = false;
    if (!srv_req_get_bool(c, root, "background", &background))
        return false;
    if (background) {
        srv_req_fail(c, 400, "background: not supported by this server (answers are synchronous)");
        return false;
    }
    /* reasoning.encrypted_content: what Codex asks for with store false,
     * to send its reasoning items back; a local model's reasoning is its
     * content in the clear, so there is nothing to encrypt and the item
     * carries none */
    const cJSON *include = cJSON_GetObjectItemCaseSensitive(root, "include");
    if (!srv_req_is_null(include) && !cJSON_IsArray(include)) {
        srv_req_fail(c, 400, "include: must be a list");
        return false;
    }
    for (const cJSON *it = include ? include->child : NULL; it; it = it->next)
        if (!cJSON_IsString(it) || strcmp(it->valuestring, "reasoning.encrypted_content") != 0) {
            srv_req_fail(c, 400,
                         "include: only \"reasoning.encrypted_content\" is supported by this "
                         "server, not %s",
                         cJSON_IsString(it) ? it->valuestring : "a non-string");
            return false;
        }
    const char *truncation = NULL;
    if (!srv_req_get_string(c, root, "truncation", &truncation))
        return false;
    if (truncation && strcmp(truncation, "disabled") != 0) {
        srv_req_fail(c, 400, "truncation: only \"disabled\" is supported, not %s", truncation);
        return false;
    }
    return true;
}

/* max_output_tokens, temperature, top_p and text.format. */
static bool read_sampling(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    bool has_max = false;
    double temperature = 1.0;
    a->max_new_tokens = c->s->cfg->max_new_tokens;
    if (!srv_req_get_int(c, root, "max_output_tokens", 1, INT32_MAX, &a->max_new_tokens,
                         &has_max) ||
        !srv_req_get_number(c, root, "temperature", 0.0, 2.0, &temperature, NULL) ||
        !srv_req_get_sampling(c, root, a, false) || !read_text_format(c, root, a) ||
        !srv_req_get_guided(c, root, a))
        return false;
    a->fill_context = !has_max;
    a->n = 1;
    return true;
}

/* --- the writer's state ------------------------------------------------------------- */

/* What a response's writer keeps (srv_chat_answer_take's writer): what the
 * response object repeats of the request, and a stream's place. */
typedef struct resp_writer {
    cJSON *echo;    /* instructions, max_output_tokens, tools, tool_choice, ... */
    int64_t seq;    /* the stream's next sequence_number */
    time_t created; /* created_at, the same in every event */
    bool started;
    cJSON *items; /* the stream's finished output items */
    char *part;   /* the open part's text (or arguments) so far */
    size_t part_len, part_cap;
    char call_id[64], name[72]; /* the open call part's */
    bool grow_failed;
    /* store: where the finished response goes (NULL: not stored), with
     * its conversation so far (chat messages: the previous response's and
     * this input, without instructions) */
    srv_resp_store *store;
    cJSON *conversation;
} resp_writer;

static void writer_drop(void *arg)
{
    resp_writer *w = arg;
    cJSON_Delete(w->echo);
    cJSON_Delete(w->items);
    cJSON_Delete(w->conversation);
    free(w->part);
    free(w);
}

/* The request's fields the response repeats, read from root (checked),
 * and, when it is to be stored in store, its conversation: chat's
 * messages without the instructions. */
static resp_writer *writer_new(const cJSON *root, const cJSON *chat, srv_resp_store *store)
{
    static const char *const echoed[] = {"instructions",
                                         "max_output_tokens",
                                         "tools",
                                         "tool_choice",
                                         "parallel_tool_calls",
                                         "temperature",
                                         "top_p",
                                         "text",
                                         "metadata",
                                         "user",
                                         "previous_response_id"};
    resp_writer *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->echo = cJSON_CreateObject();
    w->items = cJSON_CreateArray();
    w->created = time(NULL);
    for (size_t i = 0; i < sizeof echoed / sizeof *echoed; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, echoed[i]);
        if (v)
            cJSON_AddItemToObject(w->echo, echoed[i], cJSON_Duplicate(v, true));
    }
    if (store) {
        w->store = store;
        w->conversation = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(chat, "messages"), true);
        if (!srv_req_is_null(cJSON_GetObjectItemCaseSensitive(root, "instructions")))
            cJSON_DeleteItemFromArray(w->conversation, 0);
    }
    return w;
}

/* r's output items as the assistant message of a conversation. */
static cJSON *assistant_of(const cJSON *r)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "assistant");
    cJSON_AddStringToObject(m, "content", "");
    cJSON *calls = cJSON_CreateArray();
    const cJSON *item;
    cJSON_ArrayForEach (item, cJSON_GetObjectItemCaseSensitive(r, "output")) {
        const char *type = mf_json_str(item, "type");
        if (type && strcmp(type, "reasoning") == 0)
            continue; /* a later turn's template leaves it out */
        if (type && strcmp(type, "message") == 0) {
            const cJSON *part = cJSON_GetArrayItem(cJSON_GetObjectItem(item, "content"), 0);
            cJSON_ReplaceItemInObjectCaseSensitive(
                m, "content", cJSON_Duplicate(cJSON_GetObjectItem(part, "text"), true));
            continue;
        }
        cJSON *args = cJSON_Parse(mf_json_str(item, "arguments"));
        if (!cJSON_IsObject(args)) { /* cut short by max_output_tokens */
            cJSON_Delete(args);
            args = cJSON_CreateObject();
        }
        cJSON *call = cJSON_CreateObject();
        cJSON_AddStringToObject(call, "id", mf_json_str(item, "call_id"));
        cJSON_AddStringToObject(call, "type", "function");
        cJSON *fn = cJSON_AddObjectToObject(call, "function");
        cJSON_AddStringToObject(fn, "name", mf_json_str(item, "name"));
        cJSON_AddItemToObject(fn, "arguments", args);
        cJSON_AddItemToArray(calls, call);
    }
    if (cJSON_GetArraySize(calls) > 0)
        cJSON_AddItemToObject(m, "tool_calls", calls);
    else
        cJSON_Delete(calls);
    return m;
}

/* Keep the finished response r, and its conversation with r's output as
 * the assistant's turn, when the request asked for it. Any thread: reads
 * w, which nothing changes once the answer has ended. */
static void store_response(const srv_gen *g, const resp_writer *w, const cJSON *r)
{
    if (!w->store || !w->conversation)
        return;
    cJSON *conversation = cJSON_Duplicate(w->conversation, true);
    cJSON_AddItemToArray(conversation, assistant_of(r));
    char *response = cJSON_PrintUnformatted(r), *messages = cJSON_PrintUnformatted(conversation);
    if (response && messages)
        srv_resp_store_put(w->store, g->oai_id, response, messages);
    free(response);
    free(messages);
    cJSON_Delete(conversation);
}

/* --- the writer ------------------------------------------------------------------- */

/* The response object: id, status (NULL end: in progress), output
 * (consumed; NULL: []), usage when ended, and what it repeats. */
static cJSON *response_object(const srv_gen *g, const srv_chat_end *e, cJSON *output,
                              const eng_usage *u)
{
    const resp_writer *w = srv_chat_answer_writer(g);
    bool cut = e && e->why == ENG_FINISH_LENGTH;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->oai_id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddNumberToObject(o, "created_at", (double)(int64_t)w->created);
    cJSON_AddStringToObject(o, "status", !e ? "in_progress" : cut ? "incomplete" : "completed");
    cJSON_AddNullToObject(o, "error");
    if (cut)
        cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "incomplete_details"), "reason",
                                "max_output_tokens");
    else
        cJSON_AddNullToObject(o, "incomplete_details");
    cJSON_AddStringToObject(o, "model", g->model_id);
    cJSON_AddItemToObject(o, "output", output ? output : cJSON_CreateArray());
    static const char *const defaults[] = {"instructions", "max_output_tokens", "temperature",
                                           "top_p"};
    for (size_t i = 0; i < sizeof defaults / sizeof *defaults; i++)
        if (!cJSON_GetObjectItemCaseSensitive(w->echo, defaults[i]))
            cJSON_AddNullToObject(o, defaults[i]);
    for (const cJSON *v = w->echo->child; v; v = v->next)
        cJSON_AddItemToObject(o, v->string, cJSON_Duplicate(v, true));
    if (!cJSON_GetObjectItemCaseSensitive(o, "tools"))
        cJSON_AddArrayToObject(o, "tools");
    if (!cJSON_GetObjectItemCaseSensitive(o, "tool_choice"))
        cJSON_AddStringToObject(o, "tool_choice", "auto");
    if (!cJSON_GetObjectItemCaseSensitive(o, "parallel_tool_calls"))
        cJSON_AddTrueToObject(o, "parallel_tool_calls");
    if (!cJSON_GetObjectItemCaseSensitive(o, "metadata"))
        cJSON_AddObjectToObject(o, "metadata");
    if (!cJSON_GetObjectItemCaseSensitive(o, "previous_response_id"))
        cJSON_AddNullToObject(o, "previous_response_id");
    cJSON_AddBoolToObject(o, "store", w->store != NULL);
    if (u) {
        cJSON *us = cJSON_AddObjectToObject(o, "usage");
        cJSON_AddNumberToObject(us, "input_tokens", u->prompt_tokens);
        cJSON_AddNumberToObject(cJSON_AddObjectToObject(us, "input_tokens_details"),
                                "cached_tokens", u->cached_tokens);
        cJSON_AddNumberToObject(us, "output_tokens", u->generated_tokens);
        cJSON_AddNumberToObject(cJSON_AddObjectToObject(us, "output_tokens_details"),
                                "reasoning_tokens", srv_gen_reasoning_tokens(g, 0));
        cJSON_AddNumberToObject(us, "total_tokens", u->prompt_tokens + u->generated_tokens);
    } else {
        cJSON_AddNullToObject(o, "usage");
    }
    return o;
}

/* Item index's id ("msg_" the answer's serial and the index; a call's
 * "fc_" and its call id) into out (96 bytes). */
static void item_id(const srv_gen *g, int index, srv_chat_part kind, const char *call_id, char *out)
{
    const char *serial = strchr(g->oai_id, '-');
    if (kind == SRV_PART_CALL)
        snprintf(out, 96, "fc_%s", call_id);
    else if (kind == SRV_PART_REASONING)
        snprintf(out, 96, "rs_%s_%d", serial ? serial + 1 : g->oai_id, index);
    else
        snprintf(out, 96, "msg_%s_%d", serial ? serial + 1 : g->oai_id, index);
}

/* A content part: output_text (a message's) or reasoning_text (a
 * reasoning item's). */
static cJSON *text_part(srv_chat_part kind, const char *text, size_t len)
{
    cJSON *part = cJSON_CreateObject();
    bool reasoning = kind == SRV_PART_REASONING;
    cJSON_AddStringToObject(part, "type", reasoning ? "reasoning_text" : "output_text");
    cJSON_AddItemToObject(part, "text", srv_req_json_text(text, len));
    if (!reasoning) {
        cJSON_AddArrayToObject(part, "annotations");
        cJSON_AddArrayToObject(part, "logprobs");
    }
    return part;
}

/* An output item: a message with one output_text part of text, a
 * reasoning item with one reasoning_text part (and an empty summary), or
 * a function_call with its arguments; status "completed", or
 * "in_progress" as a stream first shows it. */
static cJSON *output_item_of(const srv_gen *g, int index, srv_chat_part kind, const char *call_id,
                             const char *name, const char *text, size_t len, bool done)
{
    static const char *const types[] = {[SRV_PART_TEXT] = "message",
                                        [SRV_PART_CALL] = "function_call",
                                        [SRV_PART_REASONING] = "reasoning"};
    char id[96];
    item_id(g, index, kind, call_id, id);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "type", types[kind]);
    cJSON_AddStringToObject(o, "status", done ? "completed" : "in_progress");
    if (kind == SRV_PART_CALL) {
        cJSON_AddStringToObject(o, "call_id", call_id);
        cJSON_AddStringToObject(o, "name", name);
        cJSON_AddItemToObject(o, "arguments", srv_req_json_text(text, len));
        return o;
    }
    if (kind == SRV_PART_REASONING)
        cJSON_AddArrayToObject(o, "summary");
    else
        cJSON_AddStringToObject(o, "role", "assistant");
    cJSON *content = cJSON_AddArrayToObject(o, "content");
    if (done)
        cJSON_AddItemToArray(content, text_part(kind, text, len));
    return o;
}

/* A whole answer's items, built from its parts (ctx: whole_items). */
typedef struct whole_items {
    const srv_gen *g;
    cJSON *items;
    char call_id[64], name[72];
    const char *text;
    size_t len;
} whole_items;

static void whole_begin(void *ctx, int index, srv_chat_part kind, const char *id, const char *name)
{
    (void)index, (void)kind;
    whole_items *wi = ctx;
    snprintf(wi->call_id, sizeof wi->call_id, "%s", id ? id : "");
    snprintf(wi->name, sizeof wi->name, "%s", name ? name : "");
    wi->text = "";
    wi->len = 0;
}

static void whole_delta(void *ctx, int index, srv_chat_part kind, const char *text, size_t len)
{
    (void)index, (void)kind;
    whole_items *wi = ctx;
    wi->text = text; /* one delta per part: it lives until the part's end */
    wi->len = len;
}

static void whole_end(void *ctx, int index, srv_chat_part kind)
{
    whole_items *wi = ctx;
    cJSON_AddItemToArray(wi->items, output_item_of(wi->g, index, kind, wi->call_id, wi->name,
                                                   wi->text, wi->len, true));
}

static const srv_chat_writer whole_writer = {whole_begin, whole_delta, whole_end};

/* The whole answer (srv_gen_shape.whole: may run on a pool thread). */
static cJSON *whole_json(const srv_gen *g, const eng_usage *u)
{
    whole_items wi = {.g = g, .items = cJSON_CreateArray()};
    srv_chat_end e = srv_chat_answer_whole(g, &whole_writer, &wi);
    cJSON *r = response_object(g, &e, wi.items, u);
    store_response(g, srv_chat_answer_writer(g), r);
    return r;
}

/* --- the stream -------------------------------------------------------------------- */

typedef struct stream_ctx {
    srv_gen *g;
    srv_conn *c;
    resp_writer *w;
} stream_ctx;

/* Send o (consumed) as the event its "type" names, numbered. */
static void send_event(stream_ctx *sc, cJSON *o)
{
    cJSON_AddNumberToObject(o, "sequence_number", (double)sc->w->seq++);
    char *text = cJSON_PrintUnformatted(o);
    if (text)
        srv_http_stream_named_event(sc->c, mf_json_str(o, "type"), text, strlen(text));
    free(text);
    cJSON_Delete(o);
}

static cJSON *event_of(const char *type, int index)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    if (index >= 0)
        cJSON_AddNumberToObject(o, "output_index", index);
    return o;
}

/* response.created and response.in_progress, once. */
static void stream_start(stream_ctx *sc)
{
    if (sc->w->started)
        return;
    sc->w->started = true;
    const char *types[] = {"response.created", "response.in_progress"};
    for (size_t i = 0; i < 2; i++) {
        cJSON *o = event_of(types[i], -1);
        cJSON_AddItemToObject(o, "response", response_object(sc->g, NULL, NULL, NULL));
        send_event(sc, o);
    }
}

static void add_item_id(stream_ctx *sc, cJSON *o, int index, srv_chat_part kind)
{
    char id[96];
    item_id(sc->g, index, kind, sc->w->call_id, id);
    cJSON_AddStringToObject(o, "item_id", id);
}

static void stream_begin(void *ctx, int index, srv_chat_part kind, const char *id, const char *name)
{
    stream_ctx *sc = ctx;
    resp_writer *w = sc->w;
    snprintf(w->call_id, sizeof w->call_id, "%s", id ? id : "");
    snprintf(w->name, sizeof w->name, "%s", name ? name : "");
    w->part_len = 0;
    cJSON *o = event_of("response.output_item.added", index);
    cJSON_AddItemToObject(o, "item",
                          output_item_of(sc->g, index, kind, w->call_id, w->name, "", 0, false));
    send_event(sc, o);
    if (kind == SRV_PART_CALL)
        return;
    o = event_of("response.content_part.added", index);
    add_item_id(sc, o, index, kind);
    cJSON_AddNumberToObject(o, "content_index", 0);
    cJSON_AddItemToObject(o, "part", text_part(kind, "", 0));
    send_event(sc, o);
}

/* The open part's text so far, grown by text[0..len). */
static void keep_text(resp_writer *w, const char *text, size_t len)
{
    if (w->part_len + len + 1 > w->part_cap) {
        size_t cap = w->part_cap ? w->part_cap : 256;
        while (cap < w->part_len + len + 1)
            cap *= 2;
        char *grown = realloc(w->part, cap);
        if (!grown) {
            w->grow_failed = true;
            return;
        }
        w->part = grown;
        w->part_cap = cap;
    }
    memcpy(w->part + w->part_len, text, len);
    w->part_len += len;
}

static void stream_delta(void *ctx, int index, srv_chat_part kind, const char *text, size_t len)
{
    stream_ctx *sc = ctx;
    static const char *const types[] = {[SRV_PART_TEXT] = "response.output_text.delta",
                                        [SRV_PART_CALL] = "response.function_call_arguments.delta",
                                        [SRV_PART_REASONING] = "response.reasoning_text.delta"};
    keep_text(sc->w, text, len);
    bool call = kind == SRV_PART_CALL;
    cJSON *o = event_of(types[kind], index);
    add_item_id(sc, o, index, kind);
    if (!call)
        cJSON_AddNumberToObject(o, "content_index", 0);
    cJSON_AddItemToObject(o, "delta", srv_req_json_text(text, len));
    if (kind == SRV_PART_TEXT)
        cJSON_AddArrayToObject(o, "logprobs");
    send_event(sc, o);
}

static void stream_end(void *ctx, int index, srv_chat_part kind)
{
    stream_ctx *sc = ctx;
    resp_writer *w = sc->w;
    const char *text = w->part ? w->part : "";
    static const char *const types[] = {[SRV_PART_TEXT] = "response.output_text.done",
                                        [SRV_PART_CALL] = "response.function_call_arguments.done",
                                        [SRV_PART_REASONING] = "response.reasoning_text.done"};
    bool call = kind == SRV_PART_CALL;
    cJSON *o = event_of(types[kind], index);
    add_item_id(sc, o, index, kind);
    if (call) {
        cJSON_AddStringToObject(o, "name", w->name);
        cJSON_AddItemToObject(o, "arguments", srv_req_json_text(text, w->part_len));
    } else {
        cJSON_AddNumberToObject(o, "content_index", 0);
        cJSON_AddItemToObject(o, "text", srv_req_json_text(text, w->part_len));
        if (kind == SRV_PART_TEXT)
            cJSON_AddArrayToObject(o, "logprobs");
    }
    send_event(sc, o);
    if (!call) {
        o = event_of("response.content_part.done", index);
        add_item_id(sc, o, index, kind);
        cJSON_AddNumberToObject(o, "content_index", 0);
        cJSON_AddItemToObject(o, "part", text_part(kind, text, w->part_len));
        send_event(sc, o);
    }
    cJSON *item = output_item_of(sc->g, index, kind, w->call_id, w->name, text, w->part_len, true);
    cJSON_AddItemToArray(w->items, cJSON_Duplicate(item, true));
    o = event_of("response.output_item.done", index);
    cJSON_AddItemToObject(o, "item", item);
    send_event(sc, o);
}

static const srv_chat_writer stream_writer = {stream_begin, stream_delta, stream_end};

static void stream_token(srv_gen *g, srv_conn *c, int32_t i, int32_t token, const char *text,
                         size_t len)
{
    (void)i, (void)token, (void)text, (void)len; /* the one choice's whole text is read */
    stream_ctx sc = {.g = g, .c = c, .w = srv_chat_answer_writer(g)};
    stream_start(&sc);
    srv_chat_answer_stream(g, false, &stream_writer, &sc);
}

static void stream_done(srv_gen *g, srv_conn *c, eng_finish why, const eng_usage *u)
{
    (void)why; /* the one choice's own */
    stream_ctx sc = {.g = g, .c = c, .w = srv_chat_answer_writer(g)};
    stream_start(&sc);
    srv_chat_end e = srv_chat_answer_stream(g, true, &stream_writer, &sc);
    cJSON *items = sc.w->items;
    sc.w->items = NULL;
    cJSON *r = response_object(g, &e, items, u);
    store_response(g, sc.w, r);
    bool cut = e.why == ENG_FINISH_LENGTH;
    cJSON *o = event_of(cut ? "response.incomplete" : "response.completed", -1);
    cJSON_AddItemToObject(o, "response", r);
    send_event(&sc, o);
    srv_http_stream_end(c);
}

static const srv_gen_shape resp_whole = {.id_prefix = "resp",
                                         .adapter_noun = "model",
                                         .adapter_unknown = SRV_UNKNOWN_MODEL,
                                         .whole = whole_json};
static const srv_gen_shape resp_stream = {.stream = true,
                                          .id_prefix = "resp",
                                          .adapter_noun = "model",
                                          .adapter_unknown = SRV_UNKNOWN_MODEL,
                                          .on_token = stream_token,
                                          .on_done = stream_done};

/* --- the route --------------------------------------------------------------------- */

void srv_responses_create(srv_conn *c, const char *name)
{
    (void)name;
    static const char *const fields[] = {"model",
                                         "input",
                                         "instructions",
                                         "max_output_tokens",
                                         "temperature",
                                         "top_p",
                                         "top_k", /* and seed: extensions, as chat's */
                                         "seed",
                                         "tools",
                                         "tool_choice",
                                         "parallel_tool_calls",
                                         "text",
                                         "stream",
                                         "store",
                                         "metadata",
                                         "user",
                                         "safety_identifier",
                                         "prompt_cache_key",
                                         "service_tier",
                                         "truncation",
                                         "include",
                                         "background",
                                         "reasoning",
                                         "previous_response_id",
                                         "conversation",
                                         "prompt",
                                         "top_logprobs",
                                         SRV_GUIDED_FIELDS,
                                         NULL};
    if (!srv_gen_ready(c))
        return;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    srv_req_ask a = {0};
    bool stream = false, store = true;
    const char *model = NULL;
    cJSON *chat = cJSON_CreateObject();
    srv_gen_prompt_maker maker;
    bool ok = chat && srv_req_only_known(c, root, "the body", fields) &&
              refuse_unimplemented(c, root) && srv_req_get_string(c, root, "model", &model) &&
              srv_req_get_bool(c, root, "stream", &stream) &&
              srv_req_get_bool(c, root, "store", &store) && read_input(c, root, chat) &&
              read_tools(c, root, chat) && read_reasoning(c, root, chat) &&
              read_sampling(c, root, &a);
    if (ok) {
        a.adapter = srv_req_adapter_named(c, model);
        ok = srv_chat_prepare(c, chat, &a, &maker);
    }
    /* OpenAI's default: stored */
    resp_writer *w = ok ? writer_new(root, chat, store ? c->s->responses : NULL) : NULL;
    if (ok && !w) {
        maker.drop(maker.arg);
        srv_req_fail(c, 503, "out of memory");
    } else if (ok && srv_chat_answer_take(c, &a, w, writer_drop)) {
        srv_gen_submit_made(c, &a, stream ? &resp_stream : &resp_whole, maker);
    } else if (ok) {
        maker.drop(maker.arg);
    }
    cJSON_Delete(chat);
    srv_req_ask_free(&a);
    cJSON_Delete(root);
}

/* GET /v1/responses/{id}: a stored response as it was answered. */
void srv_responses_get(srv_conn *c, const char *name)
{
    char *text = NULL;
    if (!srv_resp_store_get(c->s->responses, name, &text, NULL)) {
        srv_req_fail(c, 404, "Response with id '%s' not found.", name);
        return;
    }
    srv_http_respond_json_owned(c, 200, text);
}

/* DELETE /v1/responses/{id}: forget a stored response. */
void srv_responses_delete(srv_conn *c, const char *name)
{
    if (!srv_resp_store_delete(c->s->responses, name)) {
        srv_req_fail(c, 404, "Response with id '%s' not found.", name);
        return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", name);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddTrueToObject(o, "deleted");
    srv_req_respond_cjson(c, 200, o);
}

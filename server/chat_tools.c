/*
 * chat_tools.c - tool calling on /v1/chat/completions: the request's
 * tools and tool_choice read and checked, the assistant's past calls made
 * ready for the template, and the answer's text turned into
 * message.tool_calls (or, streamed, delta.tool_calls) as OpenAI shapes
 * them.
 *
 * tool_choice, and what each does to the answer:
 *   "none" (or no tools): nothing; the text is content.
 *   "auto" (the default with tools): the model writes calls in its own
 *     syntax, the one its chat template teaches (tool_calls.c finds it at
 *     load), and they are parsed out of its text; the text before the
 *     first call is content. A stream holds back what may be the start of
 *     a call until it cannot be one (and whitespace until text follows
 *     it: before a call it is not content), then sends each call as it is
 *     written (tool_calls.c's srv_tool_calls_scan): its first delta once
 *     its name is whole, then its arguments as they come, minified; the
 *     whole answer's arguments are the same minified object, so the
 *     deltas join to them (with logprobs asked, a token's go out with
 *     what it lets out; a token held back sends none).
 *     A template with no syntax tool_calls.c knows: the answer is
 *     content, as without tools.
 *   "required": the answer is constrained (a JSON Schema grammar) to a
 *     JSON list of one or more {"name": one of the tools' names,
 *     "parameters": that tool's parameters schema} (at most one with
 *     parallel_tool_calls false), vLLM's way; each item is a call.
 *   {"type": "function", "function": {"name": N}} (or TGI's forms: no
 *     "type", as huggingface_hub sends it, or N alone as a string): the
 *     answer is constrained to N's parameters schema and is the
 *     arguments of one call to N; a stream sends them as they come.
 * A call's id is "call_" and 24 letters and digits, as OpenAI's look,
 * except for a model whose template speaks Mistral's syntax: those
 * templates refuse any tool_call_id that is not 9 letters and digits, so
 * its ids are 9. Ids are drawn from the answer's id, the server's start
 * time and the call's place: never two alike within a server's life, and
 * (through the start time) unlikely across restarts.
 * finish_reason is "tool_calls" when calls were made and the answer ended
 * by itself (EOS or a stop string); "length" stays "length". Without
 * tools, parallel_tool_calls is ignored; false keeps only an "auto"
 * answer's first call.
 *
 * Incoming messages: an assistant's tool_calls carry arguments as a JSON
 * string (OpenAI's shape); templates index them as a mapping, so they
 * are parsed into objects for the template, as vLLM does.
 *
 * Offers srv_chat_tools_read, srv_chat_tools_message_in,
 * srv_chat_tools_answer and srv_chat_tools_stream (internal/
 * chat_tools.h) to api_chat.c; owns a request's srv_chat_tools (the
 * generation holds it through srv_req_ask.answer). Touches request.c's
 * helpers (srv_req_ask_schema puts a grammar on the request) and
 * tool_calls.c's parsers and name rule.
 */
#include "internal/chat_tools.h"
#include "internal/gen.h"
#include "internal/request.h"
#include "internal/tool_calls.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

typedef enum tool_mode { MODE_AUTO, MODE_REQUIRED, MODE_NAMED } tool_mode;

/* A choice's stream: how much of its text has gone out (as content, or
 * as a named call's arguments), and whether its call's first delta has;
 * with "auto" and "required", how many calls have been opened and how
 * much of the last one's arguments (as the answer gives them: minified)
 * has gone out. */
typedef struct tool_stream {
    size_t sent;
    bool call_opened;
    int opened;
    size_t args_sent;
} tool_stream;

/* The most calls a stream follows as they are written (past them, the
 * rest arrive at the end). */
#define SCAN_CALLS 64

struct srv_chat_tools {
    tool_mode mode;
    srv_tool_format format; /* how the answer's text is read */
    bool parallel;          /* parallel_tool_calls */
    bool short_ids;         /* Mistral's 9-character ids */
    char named[72];         /* MODE_NAMED: the function */
    tool_stream *streams;   /* one per choice, made at the first token */
    int32_t n_streams;
};

static void tools_drop(void *arg)
{
    srv_chat_tools *t = arg;
    free(t->streams);
    free(t);
}

/* --- the request ------------------------------------------------------------- */

/* tools[k]: {"type": "function", "function": {"name", "description",
 * "parameters", "strict"}}, checked. */
static bool check_tool(srv_conn *c, const cJSON *tool, int k)
{
    static const char *const fields[] = {"type", "function", NULL};
    static const char *const fn_fields[] = {"name", "description", "parameters", "strict", NULL};
    char where[48];
    snprintf(where, sizeof where, "tools[%d]", k);
    if (!cJSON_IsObject(tool)) {
        srv_req_fail(c, 400, "%s must be an object", where);
        return false;
    }
    const char *type = mf_json_str(tool, "type");
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
    if (!srv_req_only_known(c, tool, where, fields))
        return false;
    /* "type" may be left out (vLLM's default, the only kind there is) */
    if ((type && strcmp(type, "function") != 0) || !cJSON_IsObject(fn)) {
        srv_req_fail(c, 400, "%s must be {\"type\": \"function\", \"function\": {...}}", where);
        return false;
    }
    snprintf(where, sizeof where, "tools[%d].function", k);
    if (!srv_req_only_known(c, fn, where, fn_fields))
        return false;
    const char *name = mf_json_str(fn, "name");
    if (!name || !srv_tool_name_ok(name, strlen(name))) {
        srv_req_fail(c, 400, "%s.name must be 1 to 64 letters, digits, '_', '-' or '.'%s%s", where,
                     name ? ", not " : " (it is missing)", name ? name : "");
        return false;
    }
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    if (!srv_req_is_null(params) && !cJSON_IsObject(params)) {
        srv_req_fail(c, 400, "%s.parameters must be an object (a JSON Schema)", where);
        return false;
    }
    bool strict = false;
    return srv_req_get_bool(c, fn, "strict", &strict);
}

/* A tool's parameters when it has none: any object. */
static const char any_object[] = "{\"type\":\"object\"}";

/* tools[k]'s parameters schema, the request's own (NULL: it has none). */
static const cJSON *parameters_of(const cJSON *tool)
{
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    return cJSON_IsObject(params) ? params : NULL;
}

/* tool_choice "required": a list of calls, each an object naming one of
 * the tools with its parameters. */
static bool required_grammar(srv_conn *c, srv_req_ask *a, const cJSON *tools, bool parallel)
{
    cJSON *schema = cJSON_CreateObject();
    cJSON_AddStringToObject(schema, "type", "array");
    cJSON_AddNumberToObject(schema, "minItems", 1);
    if (!parallel)
        cJSON_AddNumberToObject(schema, "maxItems", 1);
    cJSON *any = cJSON_AddArrayToObject(cJSON_AddObjectToObject(schema, "items"), "anyOf");
    for (const cJSON *tool = tools->child; tool; tool = tool->next) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
        cJSON *call = cJSON_CreateObject();
        cJSON_AddStringToObject(call, "type", "object");
        cJSON *props = cJSON_AddObjectToObject(call, "properties");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(props, "name"), "const",
                                mf_json_str(fn, "name"));
        const cJSON *params = parameters_of(tool); /* referenced, not copied */
        if (params)
            cJSON_AddItemReferenceToObject(props, "parameters", (cJSON *)params);
        else
            cJSON_AddRawToObject(props, "parameters", any_object);
        cJSON *req = cJSON_AddArrayToObject(call, "required");
        cJSON_AddItemToArray(req, cJSON_CreateString("name"));
        cJSON_AddItemToArray(req, cJSON_CreateString("parameters"));
        cJSON_AddFalseToObject(call, "additionalProperties");
        cJSON_AddItemToArray(any, call);
    }
    bool ok =
        srv_req_ask_schema(c, a, schema,
                           "tool_choice \"required\" (the calls' schema, whose "
                           "/items/anyOf/K/properties/parameters is tools[K].function.parameters)");
    cJSON_Delete(schema); /* the references only */
    return ok;
}

/* The index in tools of the function named name, or -1. */
static int tool_index(const cJSON *tools, const char *name)
{
    int k = 0;
    for (const cJSON *tool = tools ? tools->child : NULL; tool; tool = tool->next, k++)
        if (strcmp(mf_json_str(cJSON_GetObjectItemCaseSensitive(tool, "function"), "name"), name) ==
            0)
            return k;
    return -1;
}

/* The function tool_choice names: OpenAI's {"type": "function",
 * "function": {"name"}}, TGI's {"function": {"name"}} (huggingface_hub
 * sends no type) or TGI's bare name; NULL after answering the 400. */
static const char *named_function(srv_conn *c, const cJSON *tc)
{
    static const char *const fields[] = {"type", "function", NULL};
    if (cJSON_IsString(tc))
        return tc->valuestring;
    const cJSON *fn = cJSON_IsObject(tc) ? cJSON_GetObjectItemCaseSensitive(tc, "function") : NULL;
    const char *type = cJSON_IsObject(tc) ? mf_json_str(tc, "type") : NULL;
    const char *name = cJSON_IsObject(fn) ? mf_json_str(fn, "name") : NULL;
    if ((type && strcmp(type, "function") != 0) || !name) {
        srv_req_fail(c, 400,
                     "\"tool_choice\" must be none, auto, required or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}");
        return NULL;
    }
    return srv_req_only_known(c, tc, "tool_choice", fields) ? name : NULL;
}

/* tool_choice into *mode (and the named function's index into *named);
 * *none when it is "none". */
static bool read_choice(srv_conn *c, const cJSON *tc, const cJSON *tools, tool_mode *mode,
                        int *named, bool *none)
{
    const char *s = cJSON_IsString(tc) ? tc->valuestring : "";
    *none = strcmp(s, "none") == 0;
    *mode = strcmp(s, "required") == 0 ? MODE_REQUIRED : MODE_AUTO;
    if (*none || strcmp(s, "auto") == 0 || *mode == MODE_REQUIRED) {
        if (!tools && *mode == MODE_REQUIRED) {
            srv_req_fail(c, 400, "\"tool_choice\": \"required\" needs \"tools\"");
            return false;
        }
        return true;
    }
    const char *name = named_function(c, tc);
    if (!name)
        return false;
    *mode = MODE_NAMED;
    *named = tool_index(tools, name);
    if (*named < 0) {
        srv_req_fail(c, 400,
                     "\"tool_choice\" must be none, auto, required or a function in \"tools\", "
                     "not %s%s",
                     name, tools ? "" : " (no tools were given)");
        return false;
    }
    return true;
}

/* The grammar a forced choice puts on the answer, and how its text is read. */
static bool constrain(srv_conn *c, srv_req_ask *a, srv_chat_tools *t, const cJSON *tools, int named)
{
    if (t->mode == MODE_REQUIRED) {
        t->format = SRV_TOOLS_JSON;
        return required_grammar(c, a, tools, t->parallel);
    }
    if (t->mode == MODE_NAMED) {
        const cJSON *tool = cJSON_GetArrayItem(tools, named);
        snprintf(t->named, sizeof t->named, "%s",
                 mf_json_str(cJSON_GetObjectItemCaseSensitive(tool, "function"), "name"));
        char where[96];
        snprintf(where, sizeof where, "tool_choice's function (tools[%d].function.parameters)",
                 named);
        const cJSON *params = parameters_of(tool);
        return params ? srv_req_ask_schema(c, a, params, where)
                      : srv_req_ask_grammar(c, a, GR_JSON_SCHEMA, any_object, strlen(any_object),
                                            where);
    }
    t->format = (srv_tool_format)c->s->tool_format;
    return true;
}

bool srv_chat_tools_read(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    if (!srv_req_is_null(tools) && !cJSON_IsArray(tools)) {
        srv_req_fail(c, 400, "\"tools\" must be a list");
        return false;
    }
    int n_tools = cJSON_GetArraySize(tools);
    if (n_tools == 0)
        tools = NULL; /* an empty list is no tools */
    if (n_tools > SRV_MAX_TOOLS) {
        srv_req_fail(c, 400, "\"tools\" lists %d tools; at most %d", n_tools, SRV_MAX_TOOLS);
        return false;
    }
    int k = 0;
    for (const cJSON *tool = tools ? tools->child : NULL; tool; tool = tool->next, k++)
        if (!check_tool(c, tool, k))
            return false;
    bool parallel = true, none = false;
    tool_mode mode = MODE_AUTO;
    int named = -1;
    if (!srv_req_get_bool(c, root, "parallel_tool_calls", &parallel) ||
        (!srv_req_is_null(tc) && !read_choice(c, tc, tools, &mode, &named, &none)))
        return false;
    if (!tools || none || (mode == MODE_AUTO && c->s->tool_format == SRV_TOOLS_NONE))
        return true; /* the text is content (a model with no known syntax: as without tools) */
    srv_chat_tools *t = calloc(1, sizeof *t);
    if (!t) {
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    *t = (srv_chat_tools){
        .mode = mode, .parallel = parallel, .short_ids = c->s->tool_format == SRV_TOOLS_MISTRAL};
    if (!constrain(c, a, t, tools, named)) {
        tools_drop(t);
        return false;
    }
    /* these syntaxes' markers are special tokens, which the default
     * skip_special_tokens would erase from the text: unless the client
     * chose, they are kept, so that a call can be seen */
    if (mode == MODE_AUTO && srv_tool_marks_special(t->format) &&
        !cJSON_GetObjectItemCaseSensitive(root, "skip_special_tokens"))
        a->keep_special = true;
    a->answer = t;
    a->answer_drop = tools_drop;
    return true;
}

/* --- incoming messages --------------------------------------------------------- */

bool srv_chat_tools_message_in(srv_conn *c, cJSON *copy, int i)
{
    cJSON *calls = cJSON_GetObjectItemCaseSensitive(copy, "tool_calls");
    if (srv_req_is_null(calls))
        return true;
    if (!cJSON_IsArray(calls)) {
        srv_req_fail(c, 400, "messages[%d].tool_calls must be a list", i);
        return false;
    }
    int k = 0;
    for (cJSON *call = calls->child; call; call = call->next, k++) {
        cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
        const char *name = cJSON_IsObject(fn) ? mf_json_str(fn, "name") : NULL;
        if (!cJSON_IsObject(call) || !name) {
            srv_req_fail(c, 400,
                         "messages[%d].tool_calls[%d] must be {\"id\", \"type\": \"function\", "
                         "\"function\": {\"name\", \"arguments\"}}",
                         i, k);
            return false;
        }
        cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        if (cJSON_IsObject(args) || srv_req_is_null(args))
            continue; /* already a mapping, or none */
        cJSON *parsed =
            cJSON_IsString(args) ? cJSON_ParseWithOpts(args->valuestring, NULL, true) : NULL;
        if (!cJSON_IsObject(parsed)) {
            cJSON_Delete(parsed);
            srv_req_fail(c, 400,
                         "messages[%d].tool_calls[%d].function.arguments must be a JSON object "
                         "written as a string",
                         i, k);
            return false;
        }
        cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", parsed);
    }
    return true;
}

/* --- the answer ---------------------------------------------------------------- */

/* Call k of choice i's id (out holds 40 bytes): letters and digits drawn
 * from the answer's id and the server's start, so that the stream and a
 * retelling agree, and two answers of one server never share one. */
static void call_id(const srv_gen *g, const srv_chat_tools *t, int32_t i, size_t k, char *out)
{
    static const char digits[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    uint64_t h = ql_fnv1a(g->oai_id, strlen(g->oai_id));
    h ^= (uint64_t)g->s->started_at * 0x9e3779b97f4a7c15ull;
    h ^= ((uint64_t)i << 32 | k) * 0xbf58476d1ce4e5b9ull;
    size_t n = t->short_ids ? 9 : 24, at = 0;
    if (!t->short_ids) {
        memcpy(out, "call_", 5);
        at = 5;
    }
    for (size_t j = 0; j < n; j++)
        out[at++] = digits[ql_splitmix64(&h) % 62];
    out[at] = 0;
}

/* One tool call in OpenAI's shape; arguments NULL leaves them out (a
 * stream's later deltas), index < 0 leaves the index out (a message's). */
static cJSON *call_object(int index, const char *id, const char *name, const char *arguments,
                          size_t args_len)
{
    cJSON *o = cJSON_CreateObject();
    if (index >= 0)
        cJSON_AddNumberToObject(o, "index", index);
    if (id) {
        cJSON_AddStringToObject(o, "id", id);
        cJSON_AddStringToObject(o, "type", "function");
    }
    cJSON *fn = cJSON_AddObjectToObject(o, "function");
    if (name)
        cJSON_AddStringToObject(fn, "name", name);
    if (arguments)
        cJSON_AddItemToObject(fn, "arguments", srv_req_json_text(arguments, args_len));
    return o;
}

/* The calls in choice i's whole text (and the content beside them). */
static int calls_of(const srv_gen *g, const srv_chat_tools *t, int32_t i, srv_tool_calls *tc)
{
    size_t len;
    const char *text = srv_gen_content(g, i, &len);
    if (t->mode != MODE_NAMED)
        return srv_tool_calls_parse(t->format, text, len, tc);
    /* the whole answer is the arguments of the one call */
    *tc = (srv_tool_calls){0};
    tc->calls = calloc(1, sizeof *tc->calls);
    if (!tc->calls)
        return -1;
    tc->n = 1;
    tc->calls[0].name = strdup(t->named);
    tc->calls[0].arguments = strndup(text, len);
    if (!tc->calls[0].name || !tc->calls[0].arguments) {
        srv_tool_calls_free(tc);
        return -1;
    }
    return 1;
}

/* finish_reason when calls were made: "tool_calls" for an answer that
 * ended by itself. */
static const char *finish_with_calls(const char *finish, size_t n_calls)
{
    return n_calls > 0 && strcmp(finish, "stop") == 0 ? "tool_calls" : finish;
}

/* How many of the calls to answer with (parallel_tool_calls false: one). */
static size_t calls_kept(const srv_chat_tools *t, const srv_tool_calls *tc)
{
    return !t->parallel && tc->n > 1 ? 1 : tc->n;
}

/* Call k's arguments as the answer gives them (malloc'd; NULL when
 * memory is short): the model's own JSON object without its whitespace
 * (p, the scan's, when it has the whole object: what a stream sends as it
 * is written, so that its deltas join to this), else what the parser read
 * (parsed; a JSON string's object), else "{}". */
static char *whole_arguments(const char *text, const srv_tool_partial *p,
                             const srv_tool_call *parsed)
{
    if (p && p->args_whole && !p->args_string) {
        char *out = malloc(p->args_len + 1);
        if (out)
            srv_tool_json_minify(text + p->args_at, p->args_len, out);
        return out;
    }
    return strdup(parsed ? parsed->arguments : "{}");
}

/* The scan of choice i's calls (into parts) when it found the parsed
 * ones, in order (else 0: the parsed arguments serve). */
static int scan_matching(const srv_chat_tools *t, const char *text, size_t len,
                         const srv_tool_calls *tc, srv_tool_partial *parts)
{
    if (t->mode == MODE_NAMED)
        return 0;
    int n = srv_tool_calls_scan(t->format, text, len, parts, SCAN_CALLS);
    if (n < (int)tc->n)
        return 0;
    for (size_t k = 0; k < tc->n; k++)
        if (parts[k].name_len != strlen(tc->calls[k].name) ||
            memcmp(text + parts[k].name_at, tc->calls[k].name, parts[k].name_len) != 0)
            return 0;
    return n;
}

void srv_chat_tools_answer(const srv_gen *g, const srv_chat_tools *t, int32_t i, cJSON *message,
                           const char **finish)
{
    size_t len;
    const char *text = srv_gen_content(g, i, &len);
    srv_tool_calls tc;
    if (calls_of(g, t, i, &tc) <= 0) {
        srv_tool_calls_free(&tc);
        cJSON_AddItemToObject(message, "content", srv_req_json_text(text, len));
        return;
    }
    if (tc.content)
        cJSON_AddStringToObject(message, "content", tc.content);
    else
        cJSON_AddNullToObject(message, "content");
    cJSON *list = cJSON_AddArrayToObject(message, "tool_calls");
    size_t n = calls_kept(t, &tc);
    srv_tool_partial parts[SCAN_CALLS];
    int scanned = scan_matching(t, text, len, &tc, parts);
    for (size_t k = 0; k < n; k++) {
        char id[40];
        call_id(g, t, i, k, id);
        char *args = whole_arguments(text, (int)k < scanned ? &parts[k] : NULL, &tc.calls[k]);
        cJSON_AddItemToArray(list, call_object(-1, id, tc.calls[k].name, args ? args : "{}",
                                               args ? strlen(args) : 2));
        free(args);
    }
    *finish = finish_with_calls(*finish, n);
    srv_tool_calls_free(&tc);
}

/* --- the stream ---------------------------------------------------------------- */

static cJSON *content_delta(const char *text, size_t len)
{
    cJSON *d = cJSON_CreateObject();
    cJSON_AddItemToObject(d, "content", srv_req_json_text(text, len));
    return d;
}

static cJSON *calls_delta(cJSON *call)
{
    cJSON *d = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(d, "tool_calls"), call);
    return d;
}

/* A choice's stream state, made for every choice at the first call. */
static tool_stream *stream_of(const srv_gen *g, srv_chat_tools *t, int32_t i)
{
    if (!t->streams) {
        t->streams = calloc((size_t)g->n_choices, sizeof *t->streams);
        if (!t->streams)
            return NULL;
        t->n_streams = g->n_choices;
    }
    return i < t->n_streams ? &t->streams[i] : NULL;
}

/* Call k's first delta: its index, id, type, name and arguments "". */
static void open_call(const srv_gen *g, const srv_chat_tools *t, int32_t i, tool_stream *ts, int k,
                      const char *name, size_t name_len, cJSON *deltas)
{
    char id[40], fn[72];
    call_id(g, t, i, (size_t)k, id);
    snprintf(fn, sizeof fn, "%.*s", (int)name_len, name);
    cJSON_AddItemToArray(deltas, calls_delta(call_object(k, id, fn, "", 0)));
    ts->opened = k + 1;
    ts->args_sent = 0;
}

/* More of call k's arguments: args[0..n), of which ts->args_sent have
 * gone out. */
static void more_arguments(tool_stream *ts, int k, const char *args, size_t n, cJSON *deltas)
{
    if (n <= ts->args_sent)
        return;
    cJSON_AddItemToArray(
        deltas, calls_delta(call_object(k, NULL, NULL, args + ts->args_sent, n - ts->args_sent)));
    ts->args_sent = n;
}

/* How many of s[0..n) are whole UTF-8 characters (a last one not yet
 * whole waits for its other bytes). */
static size_t whole_chars(const char *s, size_t n)
{
    size_t lead = n;
    while (lead > 0 && ((unsigned char)s[lead - 1] & 0xC0) == 0x80)
        lead--;
    if (lead == 0)
        return n;
    unsigned char c = (unsigned char)s[lead - 1];
    size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return lead - 1 + want > n ? lead - 1 : n;
}

/* The calls of choice i's text[0..len) as they are written ("auto" and
 * "required"): each call's first delta once its name is whole, then its
 * arguments as they come (minified, cut at a character's start), each
 * call's finished before the next opens. */
static void stream_calls_written(const srv_gen *g, const srv_chat_tools *t, int32_t i,
                                 tool_stream *ts, const char *text, size_t len, cJSON *deltas)
{
    srv_tool_partial parts[SCAN_CALLS];
    int n = srv_tool_calls_scan(t->format, text, len, parts, SCAN_CALLS);
    if (!t->parallel && n > 1)
        n = 1;
    for (int k = ts->opened > 0 ? ts->opened - 1 : 0; k < n; k++) {
        const srv_tool_partial *p = &parts[k];
        if (k >= ts->opened) {
            if (!p->name_len)
                return;
            open_call(g, t, i, ts, k, text + p->name_at, p->name_len, deltas);
        }
        if (!p->args_begun || (p->args_string && !p->args_whole))
            return;
        char *args = p->args_whole ? whole_arguments(text, p, NULL) : malloc(p->args_len + 1);
        size_t m = 0;
        if (args && p->args_whole && p->args_string) { /* the string's object, whole */
            cJSON *v = cJSON_ParseWithLength(text + p->args_at, p->args_len);
            free(args);
            args = strdup(cJSON_IsString(v) ? v->valuestring : "{}");
            cJSON_Delete(v);
        } else if (args && !p->args_whole) {
            m = whole_chars(args, srv_tool_json_minify(text + p->args_at, p->args_len, args));
        }
        if (args)
            more_arguments(ts, k, args, p->args_whole ? strlen(args) : m, deltas);
        free(args);
        if (!p->args_whole)
            return;
    }
}

/* Choice i's calls at its end: the content not yet sent, then what is
 * left of the calls (those not yet opened opened, the arguments' rest),
 * as the whole answer reads them. */
static void stream_calls_at_end(const srv_gen *g, const srv_chat_tools *t, int32_t i,
                                tool_stream *ts, cJSON *deltas, const char **finish)
{
    size_t len;
    const char *text = srv_gen_content(g, i, &len);
    srv_tool_calls tc;
    size_t content_end = len;
    int parsed = calls_of(g, t, i, &tc);
    if (parsed > 0 || ts->opened > 0)
        content_end = tc.content && parsed > 0 ? strlen(tc.content) : 0;
    if (content_end > ts->sent)
        cJSON_AddItemToArray(deltas, content_delta(text + ts->sent, content_end - ts->sent));
    srv_tool_partial parts[SCAN_CALLS];
    int scanned = parsed > 0 ? scan_matching(t, text, len, &tc, parts) : 0;
    size_t n = parsed > 0 ? calls_kept(t, &tc) : 0;
    /* a call streamed and then found malformed stays made (its arguments as written) */
    if (n == 0 && ts->opened > 0)
        stream_calls_written(g, t, i, ts, text, len, deltas);
    for (size_t k = ts->opened > 0 ? (size_t)ts->opened - 1 : 0; k < n; k++) {
        if ((int)k >= ts->opened)
            open_call(g, t, i, ts, (int)k, tc.calls[k].name, strlen(tc.calls[k].name), deltas);
        char *args = whole_arguments(text, (int)k < scanned ? &parts[k] : NULL, &tc.calls[k]);
        if (args)
            more_arguments(ts, (int)k, args, strlen(args), deltas);
        free(args);
    }
    *finish = finish_with_calls(*finish, n > 0 ? n : (size_t)ts->opened);
    srv_tool_calls_free(&tc);
}

cJSON *srv_chat_tools_stream(const srv_gen *g, srv_chat_tools *t, int32_t i, bool end,
                             const char **finish)
{
    size_t len;
    const char *text = srv_gen_content(g, i, &len);
    cJSON *deltas = cJSON_CreateArray();
    tool_stream *ts = stream_of(g, t, i);
    if (!ts || !deltas)
        return deltas;
    if (t->mode == MODE_NAMED) {
        /* the answer is the arguments: sent as they come */
        if (!ts->call_opened) {
            char id[40];
            call_id(g, t, i, 0, id);
            cJSON_AddItemToArray(deltas, calls_delta(call_object(0, id, t->named, "", 0)));
            ts->call_opened = true;
        }
        if (len > ts->sent)
            cJSON_AddItemToArray(
                deltas, calls_delta(call_object(0, NULL, NULL, text + ts->sent, len - ts->sent)));
        ts->sent = len;
        if (end)
            *finish = finish_with_calls(*finish, 1);
        return deltas;
    }
    if (end) {
        stream_calls_at_end(g, t, i, ts, deltas, finish);
        return deltas;
    }
    size_t safe =
        ts->opened > 0 ? ts->sent : srv_tool_calls_safe_prefix(t->format, text, len, ts->sent);
    /* whitespace waits: before a call it is not content (whole answers trim it) */
    size_t upto = safe;
    while (upto > ts->sent && (text[upto - 1] == ' ' || text[upto - 1] == '\n' ||
                               text[upto - 1] == '\t' || text[upto - 1] == '\r'))
        upto--;
    if (upto > ts->sent) {
        cJSON_AddItemToArray(deltas, content_delta(text + ts->sent, upto - ts->sent));
        ts->sent = upto;
    }
    if (safe < len)
        stream_calls_written(g, t, i, ts, text, len, deltas);
    return deltas;
}

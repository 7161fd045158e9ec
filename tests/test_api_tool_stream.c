/*
 * test_api_tool_stream.c - tool calls streamed as they are generated, on
 * chat completions, the Messages API and the Responses API: the real
 * binary on the tiny random model (tests/tiny_server.h) with a template
 * of one line whose comment names Hermes' <tool_call> (what load reads to
 * know the syntax; a real template's tool prompt does not fit the tiny
 * model's 512 positions). Under "auto" the model's text is forced by a
 * guided_regex, so the call is known byte for byte; under "required" the
 * calls' grammar makes it.
 *
 * What is pinned: a call's name goes out in its own delta before its
 * arguments are whole, and its arguments in several deltas (one per token
 * of the byte-level model, not one at the end), which join to the whole
 * answer's arguments exactly; nothing of the call's markup goes out as
 * text; the finish is tool_calls / tool_use. And a model that thinks
 * first (a template naming <think> too): the thinking block streams, then
 * the call as it is written, and chat's whole answer has both.
 */
#include "tiny_server.h"

#define HERMES_SHORT "{# <tool_call> #}{% for m in messages %}{{ m['content'] }}{% endfor %}"

static void setup(void)
{
    ts_start(HERMES_SHORT);
}

TestSuite(tool_stream, .init = setup, .fini = ts_teardown, .timeout = 300);

/* The answer forced: a sentence, then one call (a regex as a JSON string:
 * \{ and \} are braces) */
#define CALL_REGEX                                                                                 \
    "\"Checking\\\\. <tool_call>\\n\\\\{\\\"name\\\": \\\"now\\\", \\\"arguments\\\": "            \
    "\\\\{\\\"zone\\\": \\\"UTC\\\", \\\"n\\\": 12\\\\}\\\\}\\n</tool_call>\""
#define CALL_ARGS "{\"zone\":\"UTC\",\"n\":12}"
#define TOOL                                                                                       \
    "{\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {\"type\": "       \
    "\"object\"}}}"

/* chat's stream of body: its content joined, the call's name (the
 * index of the chunk that named it in *named), its arguments joined and
 * how many deltas carried them, and the last finish_reason */
typedef struct chat_call {
    char content[256], name[64], args[512], finish[32];
    int named, arg_deltas, chunks;
} chat_call;

static void chat_stream(const char *body, chat_call *out)
{
    ts_events ev;
    ts_events_of("/v1/chat/completions", body, &ev);
    *out = (chat_call){.named = -1, .chunks = ev.n};
    for (int i = 0; i < ev.n; i++) {
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(ev.data[i], "choices"), 0);
        const cJSON *d = cJSON_GetObjectItem(ch, "delta");
        const cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
        if (cJSON_IsString(f))
            snprintf(out->finish, sizeof out->finish, "%s", f->valuestring);
        const cJSON *c = cJSON_GetObjectItem(d, "content");
        if (cJSON_IsString(c))
            strncat(out->content, c->valuestring, 200);
        const cJSON *call = cJSON_GetArrayItem(cJSON_GetObjectItem(d, "tool_calls"), 0);
        const cJSON *fn = cJSON_GetObjectItem(call, "function");
        const cJSON *name = cJSON_GetObjectItem(fn, "name"),
                    *args = cJSON_GetObjectItem(fn, "arguments");
        if (cJSON_IsString(name)) {
            cr_assert_eq(out->named, -1, "a second call");
            out->named = i;
            snprintf(out->name, sizeof out->name, "%s", name->valuestring);
        }
        if (cJSON_IsString(args) && args->valuestring[0]) {
            out->arg_deltas++;
            strncat(out->args, args->valuestring, 400);
        }
    }
    ts_events_free(&ev);
}

/* the whole answer's first call's arguments (chat) */
static char *whole_args(const char *body)
{
    cJSON *j = ts_ok("/v1/chat/completions", body);
    const cJSON *m =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
    const cJSON *call = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0);
    char *args = strdup(sp_str_at(cJSON_GetObjectItem(call, "function"), "arguments"));
    cJSON_Delete(j);
    return args;
}

#define AUTO_BODY(stream)                                                                          \
    "{\"messages\": [{\"role\": \"user\", \"content\": \"time?\"}], \"max_tokens\": 96, "          \
    "\"tools\": [" TOOL "], \"guided_regex\": " CALL_REGEX stream "}"

Test(tool_stream, chat_auto_streams_the_name_then_the_arguments_as_written)
{
    chat_call cc;
    chat_stream(AUTO_BODY(", \"stream\": true"), &cc);
    cr_assert_str_eq(cc.content, "Checking.", "the text before the call, none of its markup");
    cr_assert_str_eq(cc.name, "now");
    cr_assert_str_eq(cc.args, CALL_ARGS);
    /* one delta per token of the arguments' bytes, not one at the end */
    cr_assert_geq(cc.arg_deltas, 10, "%d argument deltas", cc.arg_deltas);
    cr_assert_lt(cc.named, cc.chunks - cc.arg_deltas, "the name came after the arguments");
    cr_assert_str_eq(cc.finish, "tool_calls");
    char *whole = whole_args(AUTO_BODY(""));
    cr_assert_str_eq(whole, cc.args, "the stream's arguments are the whole answer's");
    free(whole);
}

#define REQUIRED_BODY(stream)                                                                      \
    "{\"messages\": [{\"role\": \"user\", \"content\": \"time?\"}], \"max_tokens\": 96, "          \
    "\"temperature\": 0, \"tool_choice\": \"required\", \"parallel_tool_calls\": false, "          \
    "\"tools\": [{\"type\": \"function\", "                                                        \
    "\"function\": {\"name\": \"now\", \"parameters\": {\"type\": \"object\", \"properties\": "    \
    "{\"unit\": {\"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"unit\"], "            \
    "\"additionalProperties\": false}}}]" stream "}"

Test(tool_stream, chat_required_streams_the_arguments_as_written)
{
    chat_call cc;
    chat_stream(REQUIRED_BODY(", \"stream\": true"), &cc);
    cr_assert_str_eq(cc.content, "");
    cr_assert_str_eq(cc.name, "now");
    cr_assert_geq(cc.arg_deltas, 5, "%d argument deltas: %s", cc.arg_deltas, cc.args);
    char *whole = whole_args(REQUIRED_BODY(""));
    cr_assert_str_eq(whole, cc.args);
    cr_assert(strstr(whole, "celsius") || strstr(whole, "fahrenheit"), "%s", whole);
    free(whole);
}

Test(tool_stream, messages_stream_input_json_deltas_as_written)
{
    ts_events ev;
    ts_events_of(
        "/v1/messages",
        "{\"model\": \"tiny\", \"max_tokens\": 96, \"stream\": true, \"messages\": [{\"role\": "
        "\"user\", \"content\": \"time?\"}], \"tools\": [{\"name\": \"now\", \"input_schema\": "
        "{\"type\": \"object\"}}], \"guided_regex\": " CALL_REGEX "}",
        &ev);
    char text[256] = "", args[512] = "", stop[32] = "";
    int deltas = 0, tool_block = -1;
    for (int i = 0; i < ev.n; i++) {
        const char *type = sp_str_at(ev.data[i], "type");
        const cJSON *d = cJSON_GetObjectItem(ev.data[i], "delta");
        if (strcmp(type, "content_block_start") == 0 &&
            strcmp(sp_str_at(cJSON_GetObjectItem(ev.data[i], "content_block"), "type"),
                   "tool_use") == 0) {
            tool_block = i;
            cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(ev.data[i], "content_block"), "name"),
                             "now");
        } else if (strcmp(type, "content_block_delta") == 0 &&
                   strcmp(sp_str_at(d, "type"), "input_json_delta") == 0) {
            deltas++;
            strncat(args, sp_str_at(d, "partial_json"), 400);
        } else if (strcmp(type, "content_block_delta") == 0) {
            strncat(text, sp_str_at(d, "text"), 200);
        } else if (strcmp(type, "message_delta") == 0) {
            snprintf(stop, sizeof stop, "%s", sp_str_at(d, "stop_reason"));
        }
    }
    cr_assert_str_eq(text, "Checking.", "the whitespace before the call is not text");
    cr_assert_geq(tool_block, 0);
    cr_assert_geq(deltas, 10, "%d input_json_delta events", deltas);
    cr_assert_str_eq(args, CALL_ARGS);
    cr_assert_str_eq(stop, "tool_use");
    ts_events_free(&ev);
}

Test(tool_stream, responses_stream_function_call_arguments_as_written)
{
    ts_events ev;
    ts_events_of(
        "/v1/responses",
        "{\"model\": \"tiny\", \"input\": \"time?\", \"max_output_tokens\": 96, \"stream\": "
        "true, \"store\": false, \"tools\": [{\"type\": \"function\", \"name\": \"now\", "
        "\"parameters\": {\"type\": \"object\"}}], \"guided_regex\": " CALL_REGEX "}",
        &ev);
    char args[512] = "", done[512] = "";
    int deltas = 0;
    for (int i = 0; i < ev.n; i++) {
        const char *type = sp_str_at(ev.data[i], "type");
        if (strcmp(type, "response.function_call_arguments.delta") == 0) {
            deltas++;
            strncat(args, sp_str_at(ev.data[i], "delta"), 400);
        } else if (strcmp(type, "response.function_call_arguments.done") == 0) {
            snprintf(done, sizeof done, "%s", sp_str_at(ev.data[i], "arguments"));
            cr_assert_str_eq(sp_str_at(ev.data[i], "name"), "now");
        }
    }
    cr_assert_geq(deltas, 10, "%d argument deltas", deltas);
    cr_assert_str_eq(args, CALL_ARGS);
    cr_assert_str_eq(done, CALL_ARGS);
    ts_events_free(&ev);
}

/* --- a thought, then a call -------------------------------------------------------- */

/* A template of one line whose comment names Qwen3's markers: reasoning
 * kept apart and Hermes calls, as Qwen3's own template teaches both. */
#define THINKER_SHORT                                                                              \
    "{# <think> </think> <tool_call> #}{% for m in messages %}{{ m['content'] }}{% endfor %}"

static void setup_thinker(void)
{
    ts_start(THINKER_SHORT);
}

TestSuite(think_then_call, .init = setup_thinker, .fini = ts_teardown, .timeout = 300);

#define THINK_CALL_REGEX                                                                           \
    "\"<think>\\nask the clock\\n</think>\\n\\n<tool_call>\\n\\\\{\\\"name\\\": \\\"now\\\", "     \
    "\\\"arguments\\\": \\\\{\\\"zone\\\": \\\"UTC\\\", \\\"n\\\": 12\\\\}\\\\}\\n</tool_call>\""

Test(think_then_call, the_reasoning_streams_first_then_the_call_as_written)
{
    ts_events ev;
    ts_events_of("/v1/messages",
                 "{\"model\": \"tiny\", \"max_tokens\": 128, \"stream\": true, \"messages\": "
                 "[{\"role\": \"user\", \"content\": \"time?\"}], \"tools\": [{\"name\": \"now\", "
                 "\"input_schema\": {\"type\": \"object\"}}], \"guided_regex\": " THINK_CALL_REGEX
                 "}",
                 &ev);
    char thinking[256] = "", args[512] = "", kinds[64] = "";
    int arg_deltas = 0;
    for (int i = 0; i < ev.n; i++) {
        const char *type = sp_str_at(ev.data[i], "type");
        const cJSON *d = cJSON_GetObjectItem(ev.data[i], "delta");
        if (strcmp(type, "content_block_start") == 0) {
            const char *kind = sp_str_at(cJSON_GetObjectItem(ev.data[i], "content_block"), "type");
            strncat(kinds, kind, 20);
            strcat(kinds, " ");
        } else if (strcmp(type, "content_block_delta") == 0) {
            const char *dt = sp_str_at(d, "type");
            if (strcmp(dt, "thinking_delta") == 0)
                strncat(thinking, sp_str_at(d, "thinking"), 200);
            else if (strcmp(dt, "input_json_delta") == 0 && ++arg_deltas)
                strncat(args, sp_str_at(d, "partial_json"), 400);
            else
                cr_assert_fail("a text delta: %s", sp_str_at(d, "text"));
        }
    }
    cr_assert_str_eq(kinds, "thinking tool_use ");
    cr_assert_str_eq(thinking, "ask the clock");
    cr_assert_str_eq(args, CALL_ARGS);
    cr_assert_geq(arg_deltas, 10);
    ts_events_free(&ev);
    /* chat: reasoning_content beside the call, whole */
    cJSON *j =
        ts_ok("/v1/chat/completions",
              "{\"messages\": [{\"role\": \"user\", \"content\": \"time?\"}], \"max_tokens\": "
              "128, \"tools\": [" TOOL "], \"guided_regex\": " THINK_CALL_REGEX "}");
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(ch, "message");
    cr_assert_str_eq(sp_str_at(m, "reasoning_content"), "ask the clock");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(m, "content")));
    const cJSON *fn = cJSON_GetObjectItem(
        cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0), "function");
    cr_assert_str_eq(sp_str_at(fn, "arguments"), CALL_ARGS);
    cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "tool_calls");
    cJSON_Delete(j);
}

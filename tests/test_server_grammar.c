/*
 * test_server_grammar.c - constrained answers and tool calls end to end:
 * the real binary on the tiny random model (tests/tiny_model.h) with a
 * small chat template that teaches the Hermes tool-call syntax (it
 * mentions <tool_call>) and renders tools, past calls and tool results.
 *
 * What is pinned: a json_schema response_format answers, over many seeds
 * at temperature 1, are all JSON the schema's grammar accepts (cJSON
 * parses them; gr_grammar_accepts of the same schema, compiled here,
 * takes them); /v1/completions takes response_format and TGI's /generate
 * its grammar (JSON Schema, as an object or a string, and a regular
 * expression); tool_choice "required" and a named function answer with
 * tool_calls whose arguments parse, whole and streamed as OpenAI streams
 * them; with "auto", the model's own syntax (forced here through a regex
 * response_format, since a random model never writes it) is parsed out of
 * its text, whole and streamed, the text before the call its content;
 * past calls' arguments reach the template as a mapping; every bad input
 * is a 400 that names the field, and the server keeps serving; an
 * ambiguous guided_regex ends at one engine step's budget of matcher
 * steps with a 400 naming the field, while another client's stream goes
 * on.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "tiny_server.h"

/* Tools listed, past calls shown with their city argument (a mapping,
 * not a string: the server parses it), tool results with their id. */
static const char hermes_template[] =
    "{%- if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}{% for t in m.tool_calls %}[call {{ t.function.name }} "
    "{{ t.function.arguments.city }}]{% endfor %}\n"
    "{%- elif m.role == 'tool' %}[result {{ m.tool_call_id }}: {{ m.content }}]\n"
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}assistant: {% endif %}";

static void setup(void)
{
    ts_start(hermes_template);
}

TestSuite(grammar, .init = setup, .fini = ts_teardown, .timeout = 120);

/* POST body to path: a 400 whose message holds needle, and needle2
 * (NULL: none). */
static void refused(const char *path, const char *body, const char *needle, const char *needle2)
{
    ts_refused(path, body, needle);
    if (needle2)
        ts_refused(path, body, needle2);
}

static gr_grammar *compile(gr_kind kind, const char *text)
{
    gr_grammar *g = NULL;
    char msg[512];
    cr_assert_eq(gr_compile(kind, text, strlen(text), 0, &g, msg, sizeof msg), QL_OK, "%s: %s",
                 text, msg);
    return g;
}

static const cJSON *choice_at(const cJSON *answer, int i)
{
    return cJSON_GetArrayItem(cJSON_GetObjectItem(answer, "choices"), i);
}

/* Bounded in every direction (strings, lists, enums), so that a random
 * model ends inside max_tokens whatever it draws. */
static const char person_schema[] =
    "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"maxLength\": 6}, "
    "\"ok\": {\"type\": \"boolean\"}, \"kind\": {\"enum\": [\"cat\", \"dog\", 3]}, "
    "\"tags\": {\"type\": \"array\", \"items\": {\"type\": \"string\", \"maxLength\": 2}, "
    "\"maxItems\": 2}}, \"required\": [\"name\", \"ok\", \"kind\"], "
    "\"additionalProperties\": false}";

/* Each of the n choices of answer (whose text is at field) is JSON the
 * grammar accepts, and an object with the required fields. */
static void expect_all_accepted(const cJSON *answer, int n, const gr_grammar *g, bool chat)
{
    for (int i = 0; i < n; i++) {
        const cJSON *ch = choice_at(answer, i);
        const char *text =
            chat ? sp_str_at(cJSON_GetObjectItem(ch, "message"), "content") : sp_str_at(ch, "text");
        cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "stop", "choice %d: %s", i, text);
        cr_assert(gr_grammar_accepts(g, text, strlen(text)), "choice %d: %s", i, text);
        cJSON *v = cJSON_Parse(text);
        cr_assert(cJSON_IsObject(v), "choice %d is not a JSON object: %s", i, text);
        cr_assert(cJSON_IsString(cJSON_GetObjectItem(v, "name")), "%s", text);
        cr_assert(cJSON_IsBool(cJSON_GetObjectItem(v, "ok")), "%s", text);
        cr_assert(cJSON_GetObjectItem(v, "kind"), "%s", text);
        cJSON_Delete(v);
    }
}

Test(grammar, json_schema_answers_all_validate_over_many_seeds)
{
    char body[2048];
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"A pet, please.\"}], "
             "\"temperature\": 1, \"seed\": 11, \"n\": 24, \"max_tokens\": 160, "
             "\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": "
             "\"pet\", \"strict\": true, \"schema\": %s}}}",
             person_schema);
    cJSON *answer = ts_ok("/v1/chat/completions", body);
    gr_grammar *g = compile(GR_JSON_SCHEMA, person_schema);
    expect_all_accepted(answer, 24, g, true);
    cJSON_Delete(answer);
    /* /v1/completions takes it too (vLLM does) */
    snprintf(body, sizeof body,
             "{\"prompt\": \"A pet:\", \"temperature\": 1, \"seed\": 5, \"n\": 8, "
             "\"max_tokens\": 160, \"response_format\": {\"type\": \"json_schema\", "
             "\"json_schema\": {\"name\": \"pet\", \"schema\": %s}}}",
             person_schema);
    answer = ts_ok("/v1/completions", body);
    expect_all_accepted(answer, 8, g, false);
    cJSON_Delete(answer);
    gr_grammar_unref(g);
    /* json_object: any object. An unbounded object may run out of tokens,
     * so only the choices the grammar ended (stop) are judged, and enough
     * of them must have ended for the check to mean something: the seed
     * fixes the samples, of which 13 of 16 end by stop within 400 tokens
     * (the rest run on inside long strings); at least 8 must. */
    enum { N_OBJECTS = 16, MIN_ENDED = 8 };
    answer = ts_ok("/v1/chat/completions",
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"temperature\": 1, "
                   "\"seed\": 3, \"n\": 16, \"max_tokens\": 400, "
                   "\"response_format\": {\"type\": \"json_object\"}}");
    int ended = 0;
    for (int i = 0; i < N_OBJECTS; i++) {
        const cJSON *ch = choice_at(answer, i);
        const char *text = sp_str_at(cJSON_GetObjectItem(ch, "message"), "content");
        const char *why = sp_str_at(ch, "finish_reason");
        cr_assert(strcmp(why, "stop") == 0 || strcmp(why, "length") == 0, "choice %d: %s", i, why);
        if (strcmp(why, "stop") != 0)
            continue;
        ended++;
        cJSON *v = cJSON_Parse(text);
        cr_assert(cJSON_IsObject(v), "choice %d ended by stop but is not a JSON object: %s", i,
                  text);
        cJSON_Delete(v);
    }
    cr_assert_geq(ended, MIN_ENDED, "only %d of %d json_object choices ended by stop", ended,
                  N_OBJECTS);
    cJSON_Delete(answer);
}

Test(grammar, tgi_grammar_json_and_regex)
{
    static const char re[] = "(yes|no)-[0-9]{2}";
    gr_grammar *g = compile(GR_REGEX, re);
    for (int seed = 1; seed <= 6; seed++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"inputs\": \"Answer:\", \"parameters\": {\"do_sample\": true, \"seed\": %d, "
                 "\"max_new_tokens\": 20, \"grammar\": {\"type\": \"regex\", \"value\": \"%s\"}}}",
                 seed, re);
        cJSON *j = ts_ok("/generate", body);
        const char *text = sp_str_at(j, "generated_text");
        cr_assert(gr_grammar_accepts(g, text, strlen(text)), "%s", text);
        cr_assert(strncmp(text, "yes-", 4) == 0 || strncmp(text, "no-", 3) == 0, "%s", text);
        cJSON_Delete(j);
    }
    /* streamed: the tokens' texts join to an answer the grammar takes,
     * which the last event carries, ended by the grammar (eos_token) */
    char *events[64];
    int n = sp_stream_events("/generate_stream",
                             "{\"inputs\": \"Answer:\", \"parameters\": {\"do_sample\": true, "
                             "\"seed\": 9, \"max_new_tokens\": 20, \"details\": true, "
                             "\"grammar\": {\"type\": \"regex\", \"value\": "
                             "\"(yes|no)-[0-9]{2}\"}}}",
                             events, 64);
    cr_assert_geq(n, 2);
    char joined[256] = "";
    for (int i = 0; i < n; i++) {
        cJSON *e = sp_json(events[i]);
        strncat(joined, sp_str_at(cJSON_GetObjectItem(e, "token"), "text"),
                sizeof joined - strlen(joined) - 1);
        if (i == n - 1) {
            cr_assert_str_eq(sp_str_at(e, "generated_text"), joined);
            cr_assert_str_eq(sp_str_at(cJSON_GetObjectItem(e, "details"), "finish_reason"),
                             "eos_token");
        }
        cJSON_Delete(e);
        free(events[i]);
    }
    cr_assert(gr_grammar_accepts(g, joined, strlen(joined)), "%s", joined);
    gr_grammar_unref(g);
    /* a schema as TGI's clients send it: an object, or a JSON string */
    g = compile(GR_JSON_SCHEMA, person_schema);
    cJSON *schema = cJSON_Parse(person_schema);
    for (int as_string = 0; as_string < 2; as_string++) {
        cJSON *req = cJSON_CreateObject();
        cJSON_AddStringToObject(req, "inputs", "Pet:");
        cJSON *p = cJSON_AddObjectToObject(req, "parameters");
        cJSON_AddNumberToObject(p, "max_new_tokens", 160);
        cJSON_AddTrueToObject(p, "do_sample");
        cJSON_AddNumberToObject(p, "seed", 40 + as_string);
        cJSON *grammar = cJSON_AddObjectToObject(p, "grammar");
        cJSON_AddStringToObject(grammar, "type", "json");
        cJSON_AddItemToObject(grammar, "value",
                              as_string ? cJSON_CreateString(person_schema)
                                        : cJSON_Duplicate(schema, true));
        char *body = cJSON_PrintUnformatted(req);
        cJSON *j = ts_ok("/generate", body);
        const char *text = sp_str_at(j, "generated_text");
        cr_assert(gr_grammar_accepts(g, text, strlen(text)), "%s", text);
        cJSON_Delete(j);
        free(body);
        cJSON_Delete(req);
    }
    cJSON_Delete(schema);
    gr_grammar_unref(g);
}

static const char weather_tools[] =
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
    "\"description\": \"The weather in a city\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 8}, \"celsius\": "
    "{\"type\": \"boolean\"}}, \"required\": [\"city\", \"celsius\"], \"additionalProperties\": "
    "false}}}, {\"type\": \"function\", \"function\": {\"name\": \"get_time\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {}, \"additionalProperties\": false}}}]";

/* A call in OpenAI's shape: an id of "call_" and 24 letters and digits,
 * type function, one of the tools' names, arguments a JSON object. */
static void expect_call(const cJSON *call, const char *want_name)
{
    const char *id = sp_str_at(call, "id");
    cr_assert_eq(strlen(id), 29, "%s", id);
    cr_assert_eq(strncmp(id, "call_", 5), 0, "%s", id);
    cr_assert_str_eq(sp_str_at(call, "type"), "function");
    const cJSON *fn = cJSON_GetObjectItem(call, "function");
    const char *name = sp_str_at(fn, "name");
    if (want_name)
        cr_assert_str_eq(name, want_name);
    else
        cr_assert(strcmp(name, "get_weather") == 0 || strcmp(name, "get_time") == 0, "%s", name);
    cJSON *args = cJSON_Parse(sp_str_at(fn, "arguments"));
    cr_assert(cJSON_IsObject(args), "%s", sp_str_at(fn, "arguments"));
    if (strcmp(name, "get_weather") == 0) {
        cr_assert(cJSON_IsString(cJSON_GetObjectItem(args, "city")));
        cr_assert(cJSON_IsBool(cJSON_GetObjectItem(args, "celsius")));
    } else {
        cr_assert_eq(cJSON_GetArraySize(args), 0);
    }
    cJSON_Delete(args);
}

Test(grammar, tool_choice_required_and_named_answer_with_tool_calls)
{
    /* one call each (parallel_tool_calls false bounds the list, so that
     * the random model's answers end inside max_tokens) */
    char body[2048];
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Oslo?\"}], %s, "
             "\"tool_choice\": \"required\", \"parallel_tool_calls\": false, \"temperature\": 1, "
             "\"seed\": 2, \"n\": 8, \"max_tokens\": 300}",
             weather_tools);
    cJSON *answer = ts_ok("/v1/chat/completions", body);
    for (int i = 0; i < 8; i++) {
        const cJSON *ch = choice_at(answer, i);
        const cJSON *m = cJSON_GetObjectItem(ch, "message");
        char *shown = cJSON_PrintUnformatted(ch);
        cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "tool_calls", "%d: %s", i, shown);
        cr_assert(cJSON_IsNull(cJSON_GetObjectItem(m, "content")), "%s", shown);
        const cJSON *calls = cJSON_GetObjectItem(m, "tool_calls");
        cr_assert_eq(cJSON_GetArraySize(calls), 1, "%s", shown);
        expect_call(calls->child, NULL);
        free(shown);
    }
    cJSON_Delete(answer);
    /* several calls allowed: an answer that ended is a list of calls; one
     * cut by max_tokens is its text, with no call made up */
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}], %s, "
             "\"tool_choice\": \"required\", \"temperature\": 1, \"seed\": 9, \"n\": 4, "
             "\"max_tokens\": 120}",
             weather_tools);
    answer = ts_ok("/v1/chat/completions", body);
    for (int i = 0; i < 4; i++) {
        const cJSON *ch = choice_at(answer, i);
        const cJSON *m = cJSON_GetObjectItem(ch, "message");
        const cJSON *calls = cJSON_GetObjectItem(m, "tool_calls");
        if (strcmp(sp_str_at(ch, "finish_reason"), "length") == 0) {
            cr_assert_null(calls);
            cr_assert(cJSON_IsString(cJSON_GetObjectItem(m, "content")));
            continue;
        }
        cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "tool_calls");
        cr_assert_geq(cJSON_GetArraySize(calls), 1);
        for (const cJSON *call = calls->child; call; call = call->next)
            expect_call(call, NULL);
    }
    cJSON_Delete(answer);
    /* a named function: one call to it */
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}], %s, "
             "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
             "\"get_weather\"}}, \"temperature\": 1, \"seed\": 4, \"n\": 6, \"max_tokens\": 200}",
             weather_tools);
    answer = ts_ok("/v1/chat/completions", body);
    for (int i = 0; i < 6; i++) {
        const cJSON *ch = choice_at(answer, i);
        cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "tool_calls");
        const cJSON *calls = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "tool_calls");
        cr_assert_eq(cJSON_GetArraySize(calls), 1);
        expect_call(calls->child, "get_weather");
    }
    cJSON_Delete(answer);
    /* TGI's ways of naming one: the bare name, and no "type" (as
     * huggingface_hub sends it) */
    const char *tgi_forms[] = {"\"get_time\"", "{\"function\": {\"name\": \"get_time\"}}"};
    for (int f = 0; f < 2; f++) {
        snprintf(body, sizeof body,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"Time?\"}], %s, "
                 "\"tool_choice\": %s, \"max_tokens\": 100}",
                 weather_tools, tgi_forms[f]);
        answer = ts_ok("/v1/chat/completions", body);
        const cJSON *calls =
            cJSON_GetObjectItem(cJSON_GetObjectItem(choice_at(answer, 0), "message"), "tool_calls");
        cr_assert_eq(cJSON_GetArraySize(calls), 1, "%s", tgi_forms[f]);
        expect_call(calls->child, "get_time");
        cJSON_Delete(answer);
    }
}

/* A stream's events for body: its tool-call deltas joined per call
 * (names, ids and arguments), its content joined, its finish_reason. */
typedef struct streamed {
    char content[2048];
    char names[4][64], ids[4][64], args[4][1024];
    int n_calls;
    char finish[32];
} streamed;

static void read_call_delta(streamed *s, const cJSON *call)
{
    int k = (int)sp_num_at(call, "index");
    cr_assert(k >= 0 && k < 4 && k <= s->n_calls, "call index %d after %d calls", k, s->n_calls);
    const cJSON *fn = cJSON_GetObjectItem(call, "function");
    if (k == s->n_calls) {
        /* a call's first delta: index, id, type, name, arguments "" */
        s->n_calls++;
        snprintf(s->ids[k], sizeof s->ids[k], "%s", sp_str_at(call, "id"));
        cr_assert_str_eq(sp_str_at(call, "type"), "function");
        snprintf(s->names[k], sizeof s->names[k], "%s", sp_str_at(fn, "name"));
        cr_assert_str_eq(sp_str_at(fn, "arguments"), "");
        return;
    }
    cr_assert_null(cJSON_GetObjectItem(call, "id"), "only a call's first delta has its id");
    strncat(s->args[k], sp_str_at(fn, "arguments"), sizeof s->args[k] - strlen(s->args[k]) - 1);
}

static void stream(const char *body, streamed *s)
{
    memset(s, 0, sizeof *s);
    char *events[512];
    int n = sp_stream_events("/v1/chat/completions", body, events, 512);
    cr_assert_geq(n, 3, "%s: %d events", body, n);
    cr_assert_str_eq(events[n - 1], "[DONE]");
    for (int i = 0; i < n - 1; i++) {
        cJSON *e = sp_json(events[i]);
        const cJSON *ch = choice_at(e, 0);
        const cJSON *delta = cJSON_GetObjectItem(ch, "delta");
        const cJSON *content = cJSON_GetObjectItem(delta, "content");
        if (cJSON_IsString(content))
            strncat(s->content, content->valuestring, sizeof s->content - strlen(s->content) - 1);
        const cJSON *calls = cJSON_GetObjectItem(delta, "tool_calls");
        for (const cJSON *call = calls ? calls->child : NULL; call; call = call->next)
            read_call_delta(s, call);
        const cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
        if (cJSON_IsString(f)) {
            cr_assert_eq(i, n - 2, "finish_reason before the last chunk");
            snprintf(s->finish, sizeof s->finish, "%s", f->valuestring);
        }
        cJSON_Delete(e);
        free(events[i]);
    }
    free(events[n - 1]);
}

Test(grammar, streams_carry_tool_call_deltas_as_openai_sends_them)
{
    char body[2048];
    const char *kinds[] = {"\"required\"",
                           "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}"};
    for (int k = 0; k < 2; k++) {
        snprintf(body, sizeof body,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}], %s, "
                 "\"tool_choice\": %s, \"parallel_tool_calls\": false, \"temperature\": 1, "
                 "\"seed\": 21, \"max_tokens\": 300, \"stream\": true}",
                 weather_tools, kinds[k]);
        streamed s;
        stream(body, &s);
        cr_assert_str_eq(s.finish, "tool_calls", "%s", kinds[k]);
        cr_assert_geq(s.n_calls, 1);
        cr_assert_str_eq(s.content, "");
        /* the same request whole: the same calls, ids included */
        char whole[2048];
        snprintf(whole, sizeof whole, "%.*s}", (int)(strstr(body, ", \"stream\"") - body), body);
        cJSON *answer = ts_ok("/v1/chat/completions", whole);
        const cJSON *calls =
            cJSON_GetObjectItem(cJSON_GetObjectItem(choice_at(answer, 0), "message"), "tool_calls");
        cr_assert_eq(cJSON_GetArraySize(calls), s.n_calls);
        for (int i = 0; i < s.n_calls; i++) {
            const cJSON *call = cJSON_GetArrayItem(calls, i);
            const cJSON *fn = cJSON_GetObjectItem(call, "function");
            cr_assert_str_eq(s.names[i], sp_str_at(fn, "name"));
            cr_assert_str_eq(s.args[i], sp_str_at(fn, "arguments"));
            cr_assert_str_neq(s.ids[i], "");
            expect_call(call, NULL);
        }
        cJSON_Delete(answer);
    }
}

/* What the model writes when the regex makes it: text, then a Hermes
 * call. JSON-escaped regex: literal braces escaped for the regex. */
static const char forced_call[] =
    "\"response_format\": {\"type\": \"regex\", \"value\": \"Sure\\\\. "
    "<tool_call>\\n\\\\{\\\"name\\\": \\\"get_time\\\", \\\"arguments\\\": "
    "\\\\{\\\"tz\\\": \\\"(UTC|CET)\\\"\\\\}\\\\}\\n</tool_call>\"}";

Test(grammar, auto_parses_the_models_own_syntax_whole_and_streamed)
{
    char body[2048];
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Time?\"}], %s, %s, "
             "\"temperature\": 1, \"seed\": 1, \"max_tokens\": 120}",
             weather_tools, forced_call);
    cJSON *answer = ts_ok("/v1/chat/completions", body);
    const cJSON *ch = choice_at(answer, 0);
    const cJSON *m = cJSON_GetObjectItem(ch, "message");
    cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "tool_calls");
    cr_assert_str_eq(sp_str_at(m, "content"), "Sure.");
    const cJSON *calls = cJSON_GetObjectItem(m, "tool_calls");
    cr_assert_eq(cJSON_GetArraySize(calls), 1);
    const cJSON *fn = cJSON_GetObjectItem(calls->child, "function");
    cr_assert_str_eq(sp_str_at(fn, "name"), "get_time");
    char args[64];
    snprintf(args, sizeof args, "%s", sp_str_at(fn, "arguments"));
    cr_assert(strcmp(args, "{\"tz\":\"UTC\"}") == 0 || strcmp(args, "{\"tz\":\"CET\"}") == 0, "%s",
              args);
    cJSON_Delete(answer);
    /* streamed: the content before the call, and no byte of the call as content */
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Time?\"}], %s, %s, "
             "\"temperature\": 1, \"seed\": 1, \"max_tokens\": 120, \"stream\": true}",
             weather_tools, forced_call);
    streamed s;
    stream(body, &s);
    /* the space before '<' waits, and is not content once the call begins: the whole's */
    cr_assert_str_eq(s.content, "Sure.", "%s", s.content);
    cr_assert_eq(s.n_calls, 1);
    cr_assert_str_eq(s.names[0], "get_time");
    cr_assert_str_eq(s.args[0], args);
    cr_assert_str_eq(s.finish, "tool_calls");
    /* tool_choice none: the same text is content */
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Time?\"}], %s, %s, "
             "\"tool_choice\": \"none\", \"temperature\": 1, \"seed\": 1, \"max_tokens\": 120}",
             weather_tools, forced_call);
    answer = ts_ok("/v1/chat/completions", body);
    ch = choice_at(answer, 0);
    cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "stop");
    cr_assert(strstr(sp_str_at(cJSON_GetObjectItem(ch, "message"), "content"), "<tool_call>"));
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "tool_calls"));
    cJSON_Delete(answer);
}

Test(grammar, past_calls_and_tool_results_reach_the_template)
{
    char body[2048];
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}, "
             "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": "
             "\"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
             "\"arguments\": \"{\\\"city\\\": \\\"Oslo\\\", \\\"celsius\\\": true}\"}}]}, "
             "{\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"-3\"}], %s}",
             weather_tools);
    cJSON *j = ts_ok("/chat_tokenize", body);
    const char *text = sp_str_at(j, "templated_text");
    cr_assert(strstr(text, "Tools: get_weather get_time."), "%s", text);
    cr_assert(strstr(text, "[call get_weather Oslo]"), "%s", text);
    cr_assert(strstr(text, "[result call_1: -3]"), "%s", text);
    cJSON_Delete(j);
    /* arguments that are not JSON: named by message and call */
    refused("/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": "
            "\"assistant\", \"tool_calls\": [{\"id\": \"c\", \"type\": \"function\", "
            "\"function\": {\"name\": \"f\", \"arguments\": \"{oops\"}}]}]}",
            "messages[1].tool_calls[0].function.arguments", NULL);
    /* nor is an object with text after it */
    refused("/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": "
            "\"assistant\", \"tool_calls\": [{\"id\": \"c\", \"type\": \"function\", "
            "\"function\": {\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1} and more\"}}]}]}",
            "messages[1].tool_calls[0].function.arguments", NULL);
}

Test(grammar, bad_grammars_and_tools_are_refused_by_name)
{
    const char *user = "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]";
    char body[2048];
    snprintf(body, sizeof body,
             "{%s, \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": "
             "\"x\", \"schema\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": "
             "\"strnig\"}}}}}}",
             user);
    refused("/v1/chat/completions", body, "response_format.json_schema.schema", "/properties/a");
    refused("/generate",
            "{\"inputs\": \"x\", \"parameters\": {\"grammar\": {\"type\": \"regex\", \"value\": "
            "\"(ab\"}}}",
            "parameters.grammar.value", NULL);
    refused("/generate",
            "{\"inputs\": \"x\", \"parameters\": {\"grammar\": {\"type\": \"json\", \"value\": "
            "\"{not json\"}}}",
            "parameters.grammar.value", NULL);
    refused("/generate",
            "{\"inputs\": \"x\", \"parameters\": {\"grammar\": {\"type\": \"lark\", \"value\": "
            "\"x\"}}}",
            "parameters.grammar.type", "lark");
    snprintf(body, sizeof body, "{%s, \"response_format\": {\"type\": \"yaml\"}}", user);
    refused("/v1/chat/completions", body, "response_format.type", "yaml");
    snprintf(body, sizeof body,
             "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", "
             "\"json_schema\": {\"schema\": 5}}}");
    refused("/v1/completions", body, "response_format.json_schema.schema", NULL);
    /* tools */
    snprintf(body, sizeof body,
             "{%s, \"tools\": [{\"type\": \"function\", \"function\": {\"parameters\": {}}}]}",
             user);
    refused("/v1/chat/completions", body, "tools[0].function.name", NULL);
    snprintf(body, sizeof body,
             "{%s, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
             "\"parameters\": [1]}}]}",
             user);
    refused("/v1/chat/completions", body, "tools[0].function.parameters", NULL);
    snprintf(body, sizeof body,
             "{%s, %s, \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
             "\"fly\"}}}",
             user, weather_tools);
    refused("/v1/chat/completions", body, "tool_choice", "a function in \"tools\", not fly");
    snprintf(body, sizeof body, "{%s, \"tool_choice\": \"required\"}", user);
    refused("/v1/chat/completions", body, "\"required\" needs \"tools\"", NULL);
    snprintf(body, sizeof body, "{%s, %s, \"tool_choice\": \"sometimes\"}", user, weather_tools);
    refused("/v1/chat/completions", body, "tool_choice", "not sometimes");
    snprintf(body, sizeof body,
             "{%s, \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
             "\"f\"}}}",
             user);
    refused("/v1/chat/completions", body, "tool_choice", "no tools were given");
    snprintf(body, sizeof body, "{%s, %s, \"tool_choice\": {\"type\": \"code\"}}", user,
             weather_tools);
    refused("/v1/chat/completions", body, "tool_choice", NULL);
    snprintf(body, sizeof body,
             "{%s, %s, \"tool_choice\": \"required\", \"response_format\": {\"type\": "
             "\"json_object\"}}",
             user, weather_tools);
    refused("/v1/chat/completions", body, "both constrain", "response_format");
    snprintf(body, sizeof body,
             "{%s, %s, \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
             "\"get_time\"}}, \"guided_regex\": \"a+\"}",
             user, weather_tools);
    refused("/v1/chat/completions", body, "guided_regex and tool_choice's function", NULL);
    /* a tool whose schema cannot be compiled: named through tool_choice */
    snprintf(body, sizeof body,
             "{%s, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
             "\"parameters\": {\"type\": \"object\", \"properties\": {\"n\": {\"type\": "
             "\"nmber\"}}}}}], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
             "\"f\"}}}",
             user);
    refused("/v1/chat/completions", body, "tools[0].function.parameters", "/properties/n");
    /* and the server still serves */
    snprintf(body, sizeof body,
             "{%s, \"max_tokens\": 4, \"response_format\": {\"type\": \"text\"}, %s}", user,
             weather_tools);
    cJSON *j = ts_ok("/v1/chat/completions", body);
    cJSON_Delete(j);
}

Test(grammar, vllm_guided_fields_constrain_the_answer)
{
    char body[2048];
    /* guided_json on completions, n = 6 */
    snprintf(body, sizeof body,
             "{\"prompt\": \"A pet:\", \"temperature\": 1, \"seed\": 7, \"n\": 6, "
             "\"max_tokens\": 160, \"guided_json\": %s}",
             person_schema);
    cJSON *answer = ts_ok("/v1/completions", body);
    gr_grammar *g = compile(GR_JSON_SCHEMA, person_schema);
    expect_all_accepted(answer, 6, g, false);
    cJSON_Delete(answer);
    gr_grammar_unref(g);
    /* guided_choice: the answer is one of the strings, metacharacters literal */
    static const char *const choices[] = {"yes", "no (maybe)", "a.b*"};
    answer = ts_ok("/v1/chat/completions",
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"?\"}], \"temperature\": 1, "
                   "\"seed\": 2, \"n\": 8, \"max_tokens\": 20, "
                   "\"guided_choice\": [\"yes\", \"no (maybe)\", \"a.b*\"]}");
    for (int i = 0; i < 8; i++) {
        const char *text =
            sp_str_at(cJSON_GetObjectItem(choice_at(answer, i), "message"), "content");
        bool one = false;
        for (int k = 0; k < 3; k++)
            one |= strcmp(text, choices[k]) == 0;
        cr_assert(one, "choice %d: '%s' is none of the strings", i, text);
    }
    cJSON_Delete(answer);
    /* newer vLLM's structured_outputs: regex */
    answer =
        ts_ok("/v1/completions",
              "{\"prompt\": \"x\", \"temperature\": 1, \"seed\": 4, \"n\": 4, \"max_tokens\": 20, "
              "\"structured_outputs\": {\"regex\": \"[a-c]{3}-[0-9]\"}}");
    g = compile(GR_REGEX, "[a-c]{3}-[0-9]");
    for (int i = 0; i < 4; i++) {
        const char *text = sp_str_at(choice_at(answer, i), "text");
        cr_assert(gr_grammar_accepts(g, text, strlen(text)), "choice %d: '%s'", i, text);
    }
    gr_grammar_unref(g);
    cJSON_Delete(answer);
    refused("/v1/completions", "{\"prompt\": \"x\", \"guided_grammar\": \"root ::= \\\"a\\\"\"}",
            "guided_grammar", "EBNF");
    refused("/v1/completions",
            "{\"prompt\": \"x\", \"guided_regex\": \"a\", \"response_format\": {\"type\": "
            "\"json_object\"}}",
            "guided_regex", "response_format");
    refused("/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"?\"}], \"guided_choice\": []}",
            "guided_choice", "non-empty");
    refused("/v1/completions", "{\"prompt\": \"x\", \"structured_outputs\": {\"jsonx\": {}}}",
            "jsonx", NULL);
}

/* Issue 30's row: guided_regex (.*.){300} with n = 16 took every other
 * client's token from 9 ms to 290 ms for 20 s, then answered 500. Held
 * one step at a time with the engine's gate, beside a neighbour's stream:
 * the bomb ends long before its token limit (its masks passed one step's
 * budget, test_engine_grammar pins the per-step work) and answers 400
 * naming the field and the budget; the neighbour took a token every step
 * meanwhile and its stream completes whole. Steps counted, never time. */
Test(grammar, an_ambiguous_guided_regex_is_a_400_at_its_step_budget_and_a_neighbour_streams_on)
{
    enum { LIMIT = 150, NEIGHBOUR = 200, CHOICES = 16 };
    sp_hold_after(0, NULL);
    hc_conn bomb, other;
    cr_assert(hc_open(&bomb, sp.port));
    cr_assert(hc_open(&other, sp.port));
    char body[512];
    snprintf(body, sizeof body,
             "{\"prompt\": \"the theme\", \"n\": %d, \"max_tokens\": %d, \"temperature\": 1, "
             "\"seed\": 30, \"guided_regex\": \"(.*.){300}\"}",
             CHOICES, LIMIT);
    cr_assert(hc_send_request(&bomb, "POST", "/v1/completions", NULL, body));
    snprintf(body, sizeof body,
             "{\"prompt\": \"the theme\", \"max_tokens\": %d, \"ignore_eos\": true, "
             "\"stream\": true, \"stream_options\": {\"include_usage\": true}}",
             NEIGHBOUR);
    cr_assert(hc_send_request(&other, "POST", "/v1/completions", NULL, body));
    sp_engine_reaches("running", 2, NULL); /* admitted: choice 0 and the neighbour */
    /* one step at a time until only the neighbour runs */
    int steps = 0;
    do {
        sp_hold_after(1, NULL);
        steps++;
        cr_assert_eq(sp_engine_figure("tokens_generated", NULL) >= steps, true, "step %d", steps);
        cr_assert_lt(steps, LIMIT, "the bomb ran to its token limit");
    } while (sp_engine_figure("running", NULL) > 1);
    hc_response r = {0};
    cr_assert(hc_read_response(&bomb, &r), "the bomb got no answer");
    cr_assert_eq(r.status, 400, "%d %s", r.status, r.body ? r.body : "");
    cJSON *j = sp_json(r.body);
    const char *message = sp_str_at(cJSON_GetObjectItem(j, "error"), "message");
    cr_assert(strstr(message, "guided_regex: ") == message, "%s", message);
    cr_assert(strstr(message, "matcher steps"), "%s", message);
    cJSON_Delete(j);
    hc_response_free(&r);
    hc_close(&bomb);
    /* the neighbour: a token each step so far, then the rest, whole */
    cr_assert_eq(sp_engine_figure("running", NULL), 1);
    sp_hold_after(-1, NULL);
    hc_response head = {0};
    cr_assert(hc_read_head(&other, &head));
    cr_assert_eq(head.status, 200);
    int tokens = 0;
    const char *finish = NULL;
    for (char *ev; (ev = hc_next_event(&other, &head)); free(ev)) {
        if (strcmp(ev, "[DONE]") == 0)
            continue;
        cJSON *e = sp_json(ev);
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(e, "choices"), 0);
        const cJSON *why = cJSON_GetObjectItem(ch, "finish_reason");
        const cJSON *usage = cJSON_GetObjectItem(e, "usage");
        if (cJSON_IsString(why))
            finish = strcmp(why->valuestring, "length") == 0 ? "length" : "other";
        /* the usage chunk counts tokens: a chunk may carry several (text
         * held back until its UTF-8 is whole) */
        if (cJSON_IsObject(usage))
            tokens = cJSON_GetObjectItem(usage, "completion_tokens")->valueint;
        cJSON_Delete(e);
    }
    cr_assert(head.body_done, "the neighbour's stream did not end");
    cr_assert_eq(tokens, NEIGHBOUR);
    cr_assert_str_eq(finish, "length");
    hc_response_free(&head);
    hc_close(&other);
}

/* The same bomb streamed: its 200 is sent before a token, so the budget's
 * end reaches the client as an error event naming the field (what the
 * OpenAI SDK and huggingface_hub raise), then every choice's end with
 * finish_reason "error" and [DONE]. */
Test(grammar, a_streamed_guided_regex_past_its_budget_ends_with_an_error_event)
{
    enum { LIMIT = 150, CHOICES = 16, CAP = LIMIT * CHOICES + CHOICES + 8 };
    char body[512];
    snprintf(body, sizeof body,
             "{\"prompt\": \"the theme\", \"n\": %d, \"max_tokens\": %d, \"temperature\": 1, "
             "\"seed\": 30, \"stream\": true, \"guided_regex\": \"(.*.){300}\"}",
             CHOICES, LIMIT);
    char **events = calloc(CAP, sizeof *events);
    cr_assert(events);
    int n = sp_stream_events("/v1/completions", body, events, CAP);
    int errors = 0, ended = 0, at_error = -1;
    for (int i = 0; i < n; i++) {
        if (strcmp(events[i], "[DONE]") == 0) {
            cr_assert_eq(i, n - 1, "[DONE] is the last event");
            continue;
        }
        cJSON *e = sp_json(events[i]);
        const cJSON *err = cJSON_GetObjectItem(e, "error");
        if (err) {
            const char *message = sp_str_at(err, "message");
            cr_assert(strstr(message, "guided_regex: ") == message, "%s", message);
            cr_assert(strstr(message, "matcher steps"), "%s", message);
            cr_assert_eq(cJSON_GetObjectItem(err, "code")->valueint, 400);
            errors++;
            at_error = i;
        } else {
            const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(e, "choices"), 0);
            const cJSON *why = cJSON_GetObjectItem(ch, "finish_reason");
            if (cJSON_IsString(why)) {
                cr_assert_str_eq(why->valuestring, "error");
                cr_assert_gt(i, at_error, "a choice ended before the error event");
                cr_assert_geq(at_error, 0, "a choice ended before the error event");
                ended++;
            }
        }
        cJSON_Delete(e);
    }
    cr_assert_eq(errors, 1);
    cr_assert_eq(ended, CHOICES);
    for (int i = 0; i < n; i++)
        free(events[i]);
    free(events);
    /* the server serves on */
    int status;
    free(sp_answer("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2}", &status));
    cr_assert_eq(status, 200);
}

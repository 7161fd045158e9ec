/*
 * tool_calls.c - tool calls found in a model's text, in the syntax its
 * chat template teaches (internal/tool_calls.h).
 *
 * Which syntax: the template's source is searched for each syntax's
 * marker, most specific first (a Mistral template mentions [TOOL_CALLS],
 * DeepSeek's its fullwidth call markers, Granite's <|tool_call|>, the
 * Hermes family's <tool_call>, Llama 3.1+'s <|python_tag|> or the
 * "ipython" role), as llama.cpp's common/chat.cpp chooses its parser by
 * what the template contains. The parsers follow vLLM's tool parsers
 * (hermes, llama3_json, mistral, granite, deepseek_v3) in what they
 * accept and in their one rule for what is not a call: when a marker is
 * there but what follows is not a whole call, the answer is left as
 * content, whole, and no call is made up.
 *
 * JSON inside a call is read with cJSON, which reports where a value ends,
 * so calls written back to back (Llama's "; ", Mistral's [ARGS]{...}
 * repeated) are read one after another without guessing at braces.
 *
 * Offers srv_tool_format_of, srv_tool_calls_parse, srv_tool_name_ok,
 * srv_tool_calls_safe_prefix; owns nothing past a call but the
 * srv_tool_calls it fills. Touches cJSON only.
 */
#define _GNU_SOURCE /* memmem */
#include "internal/tool_calls.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* --- which syntax ------------------------------------------------------------ */

static const char MISTRAL_MARK[] = "[TOOL_CALLS]";
static const char MISTRAL_ARGS[] = "[ARGS]";
static const char MISTRAL_CALL_ID[] = "[CALL_ID]"; /* Magistral's, between name and [ARGS] */
static const char HERMES_OPEN[] = "<tool_call>";
static const char HERMES_CLOSE[] = "</tool_call>";
static const char GRANITE_MARK[] = "<|tool_call|>";
static const char PYTHON_TAG[] = "<|python_tag|>";
static const char DS_CALLS_BEGIN[] = "<｜tool▁calls▁begin｜>";
static const char DS_CALL_BEGIN[] = "<｜tool▁call▁begin｜>";
static const char DS_CALL_END[] = "<｜tool▁call▁end｜>";
static const char DS_SEP[] = "<｜tool▁sep｜>";
static const char HARMONY_START[] = "<|start|>";
static const char HARMONY_CHANNEL[] = "<|channel|>";
static const char HARMONY_TO[] = "to=functions.";
static const char HARMONY_MESSAGE[] = "<|message|>";

srv_tool_format srv_tool_format_of(const char *src)
{
    if (!src)
        return SRV_TOOLS_NONE;
    if (strstr(src, HARMONY_CHANNEL) && strstr(src, "functions."))
        return SRV_TOOLS_HARMONY;
    if (strstr(src, MISTRAL_MARK))
        return SRV_TOOLS_MISTRAL;
    if (strstr(src, DS_CALLS_BEGIN) || strstr(src, DS_CALL_BEGIN))
        return SRV_TOOLS_DEEPSEEK;
    if (strstr(src, GRANITE_MARK))
        return SRV_TOOLS_GRANITE;
    if (strstr(src, HERMES_OPEN))
        return SRV_TOOLS_HERMES;
    if (strstr(src, PYTHON_TAG) || strstr(src, "ipython"))
        return SRV_TOOLS_LLAMA3;
    return SRV_TOOLS_NONE;
}

/* Each syntax, by srv_tool_format: its name, the markers that begin a
 * call (NULL-terminated), and whether they are special tokens, which
 * skip_special_tokens would erase from the text. */
static const struct {
    const char *name;
    const char *markers[3];
    bool special;
} formats[] = {
    [SRV_TOOLS_NONE] = {"none", {NULL}, false},
    [SRV_TOOLS_HERMES] = {"hermes", {HERMES_OPEN, NULL}, false},
    [SRV_TOOLS_LLAMA3] = {"llama3_json", {PYTHON_TAG, NULL}, true},
    [SRV_TOOLS_MISTRAL] = {"mistral", {MISTRAL_MARK, NULL}, true},
    [SRV_TOOLS_GRANITE] = {"granite", {GRANITE_MARK, NULL}, true},
    [SRV_TOOLS_DEEPSEEK] = {"deepseek_r1", {DS_CALLS_BEGIN, DS_CALL_BEGIN, NULL}, true},
    [SRV_TOOLS_JSON] = {"json", {NULL}, false},
    [SRV_TOOLS_HARMONY] = {"openai (harmony)", {HARMONY_START, HARMONY_CHANNEL, NULL}, true},
};

static bool known(srv_tool_format f)
{
    return (unsigned)f < sizeof formats / sizeof formats[0];
}

const char *srv_tool_format_name(srv_tool_format f)
{
    return known(f) ? formats[f].name : "none";
}

bool srv_tool_marks_special(srv_tool_format f)
{
    return known(f) && formats[f].special;
}

/* The markers that begin a call in syntax f (NULL-terminated). */
static const char *const *markers_of(srv_tool_format f)
{
    return formats[known(f) ? f : SRV_TOOLS_NONE].markers;
}

/* --- small readers over text ------------------------------------------------- */

/* The first occurrence of needle in text[0..len), or NULL. */
static const char *find(const char *text, size_t len, const char *needle)
{
    size_t n = strlen(needle);
    if (n == 0 || n > len)
        return NULL;
    return memmem(text, len, needle, n);
}

static bool is_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r';
}

static const char *skip_space(const char *p, const char *end)
{
    while (p < end && is_space(*p))
        p++;
    return p;
}

static bool starts_with(const char *p, const char *end, const char *s)
{
    size_t n = strlen(s);
    return (size_t)(end - p) >= n && memcmp(p, s, n) == 0;
}

/* Whether p..end holds nothing but whitespace and control tokens written
 * as text (<|eom_id|>, <|eot_id|>: what a model ends a call with, shown
 * when special tokens are kept so that a call's own marker is seen). */
static bool only_end_marks(const char *p, const char *end)
{
    for (;;) {
        p = skip_space(p, end);
        if (p == end)
            return true;
        if (!starts_with(p, end, "<|"))
            return false;
        const char *close = find(p, (size_t)(end - p), "|>");
        if (!close)
            return false;
        p = close + 2;
    }
}

static char *copy_text(const char *p, size_t n)
{
    char *out = malloc(n + 1);
    if (out) {
        memcpy(out, p, n);
        out[n] = 0;
    }
    return out;
}

/* One JSON value at p (leading whitespace skipped, at most end), into
 * *out; *next just past it. False when there is none. */
static bool json_at(const char *p, const char *end, cJSON **out, const char **next)
{
    p = skip_space(p, end);
    const char *stop = NULL;
    *out = cJSON_ParseWithLengthOpts(p, (size_t)(end - p), &stop, false);
    if (!*out)
        return false;
    *next = stop;
    return true;
}

/* --- the calls --------------------------------------------------------------- */

bool srv_tool_name_ok(const char *p, size_t n)
{
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '_' || ch == '-' || ch == '.'))
            return false;
    }
    return true;
}

/* Add a call named name[0..name_len) with arguments args (a JSON object,
 * printed; a string holding one, as some models write it, taken as it
 * is; NULL: "{}"). False when the name is not one, args is neither, or
 * memory is short. */
static bool add_call(srv_tool_calls *tc, const char *name, size_t name_len, const cJSON *args)
{
    if (!srv_tool_name_ok(name, name_len))
        return false; /* text that is no function's name is no call */
    char *arguments = NULL;
    if (!args) {
        arguments = copy_text("{}", 2);
    } else if (cJSON_IsObject(args)) {
        arguments = cJSON_PrintUnformatted(args);
    } else if (cJSON_IsString(args)) {
        cJSON *inner = cJSON_ParseWithOpts(args->valuestring, NULL, true); /* nothing after */
        bool object = cJSON_IsObject(inner);
        cJSON_Delete(inner);
        if (!object)
            return false;
        arguments = copy_text(args->valuestring, strlen(args->valuestring));
    } else {
        return false;
    }
    srv_tool_call *grown = realloc(tc->calls, (tc->n + 1) * sizeof *grown);
    char *n = copy_text(name, name_len);
    if (!arguments || !grown || !n) {
        if (grown)
            tc->calls = grown;
        free(arguments);
        free(n);
        return false;
    }
    tc->calls = grown;
    tc->calls[tc->n++] = (srv_tool_call){.name = n, .arguments = arguments};
    return true;
}

/* A call as a JSON object: {"name", "arguments"} (or "parameters", as
 * Llama's template writes it). */
static bool add_object_call(srv_tool_calls *tc, const cJSON *o)
{
    if (!cJSON_IsObject(o))
        return false;
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    if (!cJSON_IsString(name))
        return false;
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
    if (!args)
        args = cJSON_GetObjectItemCaseSensitive(o, "parameters");
    return add_call(tc, name->valuestring, strlen(name->valuestring), args);
}

/* One object call, or an array of them, at p; *next past it. */
static bool add_json_calls(srv_tool_calls *tc, const char *p, const char *end, const char **next)
{
    cJSON *v;
    if (!json_at(p, end, &v, next))
        return false;
    bool ok = true;
    if (cJSON_IsArray(v)) {
        ok = cJSON_GetArraySize(v) > 0;
        for (const cJSON *o = v->child; ok && o; o = o->next)
            ok = add_object_call(tc, o);
    } else {
        ok = add_object_call(tc, v);
    }
    cJSON_Delete(v);
    return ok;
}

/* Hermes: each <tool_call> JSON </tool_call>, anywhere after the first. */
static bool parse_hermes(srv_tool_calls *tc, const char *p, const char *end)
{
    while ((p = find(p, (size_t)(end - p), HERMES_OPEN))) {
        p += strlen(HERMES_OPEN);
        const char *next;
        if (!add_json_calls(tc, p, end, &next))
            return false;
        p = skip_space(next, end);
        /* the closing tag may be missing at the very end (EOS came first) */
        if (starts_with(p, end, HERMES_CLOSE))
            p += strlen(HERMES_CLOSE);
        else if (!only_end_marks(p, end) && !starts_with(p, end, HERMES_OPEN))
            return false;
    }
    return true;
}

/* Llama 3: JSON objects separated by ";" to the end of the answer. */
static bool parse_llama(srv_tool_calls *tc, const char *p, const char *end)
{
    for (;;) {
        const char *next;
        if (!add_json_calls(tc, p, end, &next))
            return false;
        p = skip_space(next, end);
        if (only_end_marks(p, end))
            return true;
        if (*p != ';')
            return false;
        p = skip_space(p + 1, end);
        if (p == end)
            return true;
    }
}

/* Mistral after [TOOL_CALLS]: a JSON array of calls, or name[ARGS]{...}
 * (with [CALL_ID]id before [ARGS] in Magistral's), each such call
 * possibly after its own [TOOL_CALLS]. */
static bool parse_mistral(srv_tool_calls *tc, const char *p, const char *end)
{
    for (;;) {
        p = skip_space(p, end);
        const char *next;
        if (p < end && (*p == '[' || *p == '{')) {
            if (!add_json_calls(tc, p, end, &next))
                return false;
        } else {
            const char *args = find(p, (size_t)(end - p), MISTRAL_ARGS);
            if (!args)
                return false;
            const char *name_end = find(p, (size_t)(args - p), MISTRAL_CALL_ID);
            if (!name_end)
                name_end = args;
            while (name_end > p && is_space(name_end[-1]))
                name_end--;
            cJSON *v;
            if (name_end == p || !json_at(args + strlen(MISTRAL_ARGS), end, &v, &next))
                return false;
            bool ok = cJSON_IsObject(v) && add_call(tc, p, (size_t)(name_end - p), v);
            cJSON_Delete(v);
            if (!ok)
                return false;
        }
        p = skip_space(next, end);
        if (only_end_marks(p, end))
            return true;
        if (!starts_with(p, end, MISTRAL_MARK))
            return false;
        p += strlen(MISTRAL_MARK);
    }
}

/* DeepSeek R1:
 * <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>,
 * repeated; the fence is optional. */
static bool parse_deepseek(srv_tool_calls *tc, const char *p, const char *end)
{
    int found = 0;
    while ((p = find(p, (size_t)(end - p), DS_CALL_BEGIN))) {
        p += strlen(DS_CALL_BEGIN);
        const char *sep = find(p, (size_t)(end - p), DS_SEP);
        if (!sep)
            return false;
        const char *name = sep + strlen(DS_SEP);
        const char *nl = memchr(name, '\n', (size_t)(end - name));
        if (!nl || nl == name)
            return false;
        const char *q = skip_space(nl, end);
        if (starts_with(q, end, "```json"))
            q += 7;
        else if (starts_with(q, end, "```"))
            q += 3;
        cJSON *v;
        const char *next;
        if (!json_at(q, end, &v, &next))
            return false;
        bool ok = cJSON_IsObject(v) && add_call(tc, name, (size_t)(nl - name), v);
        cJSON_Delete(v);
        if (!ok)
            return false;
        p = skip_space(next, end);
        if (starts_with(p, end, "```"))
            p += 3;
        p = skip_space(p, end);
        if (!starts_with(p, end, DS_CALL_END))
            return false;
        found++;
    }
    return found > 0;
}

/* Harmony: each message whose header says to=functions.NAME, its
 * arguments the JSON object after its <|message|> (then <|call|>, or the
 * text's end: <|call|> ends the answer). */
static bool parse_harmony(srv_tool_calls *tc, const char *p, const char *end)
{
    int found = 0;
    while ((p = find(p, (size_t)(end - p), HARMONY_TO))) {
        const char *name = p + strlen(HARMONY_TO), *q = name;
        while (q < end && srv_tool_name_ok(q, 1))
            q++;
        const char *msg = find(q, (size_t)(end - q), HARMONY_MESSAGE);
        cJSON *v;
        const char *next;
        if (!msg || !json_at(msg + strlen(HARMONY_MESSAGE), end, &v, &next))
            return false;
        bool ok = cJSON_IsObject(v) && add_call(tc, name, (size_t)(q - name), v);
        cJSON_Delete(v);
        if (!ok)
            return false;
        p = next;
        found++;
    }
    return found > 0;
}

/* Where the first call begins in text (a marker, or Llama's opening
 * brace), or NULL when none does. */
static const char *call_start(srv_tool_format f, const char *text, size_t len)
{
    const char *first = NULL;
    for (const char *const *m = markers_of(f); *m; m++) {
        const char *at = find(text, len, *m);
        if (at && (!first || at < first))
            first = at;
    }
    if (f == SRV_TOOLS_LLAMA3 || f == SRV_TOOLS_JSON) {
        const char *p = skip_space(text, text + len);
        if (p < text + len && (*p == '{' || (f == SRV_TOOLS_JSON && *p == '[')))
            return p;
    }
    return first;
}

void srv_tool_calls_free(srv_tool_calls *tc)
{
    for (size_t i = 0; i < tc->n; i++) {
        free(tc->calls[i].name);
        free(tc->calls[i].arguments);
    }
    free(tc->calls);
    free(tc->content);
    *tc = (srv_tool_calls){0};
}

/* The calls after start, the first call's beginning. */
static bool parse_from(srv_tool_format f, srv_tool_calls *tc, const char *start, const char *end)
{
    switch (f) {
    case SRV_TOOLS_NONE: return false;
    case SRV_TOOLS_HERMES: return parse_hermes(tc, start, end);
    case SRV_TOOLS_LLAMA3:
        if (starts_with(start, end, PYTHON_TAG))
            start += strlen(PYTHON_TAG);
        return parse_llama(tc, start, end);
    case SRV_TOOLS_MISTRAL: return parse_mistral(tc, start + strlen(MISTRAL_MARK), end);
    case SRV_TOOLS_GRANITE: return add_json_calls(tc, start + strlen(GRANITE_MARK), end, &start);
    case SRV_TOOLS_DEEPSEEK: return parse_deepseek(tc, start, end);
    case SRV_TOOLS_HARMONY: return parse_harmony(tc, start, end);
    case SRV_TOOLS_JSON:
        return add_json_calls(tc, start, end, &start) && skip_space(start, end) == end;
    }
    return false;
}

int srv_tool_calls_parse(srv_tool_format f, const char *text, size_t len, srv_tool_calls *out)
{
    *out = (srv_tool_calls){0};
    const char *end = text + len;
    const char *start = call_start(f, text, len);
    size_t content_len = len;
    if (start && parse_from(f, out, start, end) && out->n > 0) {
        content_len = (size_t)(start - text);
        while (content_len > 0 && is_space(text[content_len - 1]))
            content_len--;
    } else {
        /* no call, or a malformed one: the whole answer is content */
        srv_tool_calls_free(out);
    }
    if (content_len > 0 && skip_space(text, text + content_len) < text + content_len) {
        out->content = copy_text(text, content_len);
        if (!out->content) {
            srv_tool_calls_free(out);
            return -1;
        }
    }
    return (int)out->n;
}

size_t srv_tool_calls_safe_prefix(srv_tool_format f, const char *text, size_t len, size_t from)
{
    if (f == SRV_TOOLS_NONE)
        return len;
    if (f == SRV_TOOLS_JSON)
        return 0; /* the whole answer is the calls */
    if (f == SRV_TOOLS_LLAMA3 && from == 0) {
        /* a call is only a whole answer of JSON: hold back until the
         * first character that is not whitespace shows it is not one */
        const char *p = skip_space(text, text + len);
        if (p == text + len || *p == '{')
            return 0;
    }
    /* no call begins before from: what went out held no marker's start
     * (so each token costs its own bytes, not the whole answer's) */
    size_t safe = len;
    for (const char *const *m = markers_of(f); *m; m++) {
        const char *at = find(text + from, len - from, *m);
        if (at && (size_t)(at - text) < safe)
            safe = (size_t)(at - text);
    }
    if (safe < len)
        return safe;
    /* hold back a tail that may grow into a marker */
    for (const char *const *m = markers_of(f); *m; m++) {
        size_t n = strlen(*m);
        for (size_t k = n - 1; k > 0; k--) {
            if (k <= len - from && memcmp(text + len - k, *m, k) == 0) {
                if (len - k < safe)
                    safe = len - k;
                break;
            }
        }
    }
    return safe;
}

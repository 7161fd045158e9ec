/*
 * tool_calls.c - tool calls found in a model's text, in the syntax its
 * chat template teaches (internal/tool_calls.h).
 *
 * Which syntax: the template's source is searched for each syntax's
 * marker, most specific first (a Mistral template mentions [TOOL_CALLS],
 * DeepSeek's its fullwidth call markers, Granite's <|tool_call|>, the
 * Hermes family's <tool_call>, Llama 3.1+'s <|python_tag|> or the
 * "ipython" role; GPT-OSS's harmony <|channel|> before all), as llama.cpp's common/chat.cpp chooses
 * its parser by what the template contains. The parsers follow vLLM's tool parsers (hermes,
 * llama3_json, mistral, granite, deepseek_v3) in what they accept and in their one rule for what is
 * not a call: when a marker is there but what follows is not a whole call, the answer is left as
 * content, whole, and no call is made up.
 *
 * JSON inside a call is read with cJSON, which reports where a value ends,
 * so calls written back to back (Llama's "; ", Mistral's [ARGS]{...}
 * repeated) are read one after another without guessing at braces.
 *
 * A stream reads calls as they are written (srv_tool_calls_scan): a
 * small scanner that tracks JSON strings and nesting, so that a call's
 * name is known once whole and its arguments' object is followed byte by
 * byte, without waiting for cJSON to see a whole value.
 *
 * Offers srv_tool_format_of, srv_tool_calls_parse, srv_tool_name_ok,
 * srv_tool_calls_safe_prefix, srv_tool_calls_scan, srv_tool_json_minify;
 * owns nothing past a call but the
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

/* --- calls as they are written ----------------------------------------------------- */

size_t srv_tool_json_minify(const char *p, size_t n, char *out)
{
    size_t m = 0;
    bool in_string = false, escaped = false;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (in_string) {
            in_string = escaped || ch != '"';
            escaped = !escaped && ch == '\\';
        } else if (is_space(ch)) {
            continue;
        } else {
            in_string = ch == '"';
        }
        out[m++] = ch;
    }
    out[m] = 0;
    return m;
}

/* How many bytes of the JSON object at text[at..len) are written so far,
 * and (*whole) whether it has closed. */
static size_t object_extent(const char *text, size_t at, size_t len, bool *whole)
{
    int depth = 0;
    bool in_string = false, escaped = false;
    *whole = false;
    for (size_t i = at; i < len; i++) {
        char ch = text[i];
        if (in_string) {
            in_string = escaped || ch != '"';
            escaped = !escaped && ch == '\\';
        } else if (ch == '"') {
            in_string = true;
        } else if (ch == '{' || ch == '[') {
            depth++;
        } else if ((ch == '}' || ch == ']') && --depth == 0) {
            *whole = true;
            return i + 1 - at;
        }
    }
    return len - at;
}

/* A call's arguments object, when it begins at the first '{' of
 * text[at..len) before any other character but whitespace and
 * ```json fences. */
static void args_from(const char *text, size_t at, size_t len, srv_tool_partial *p)
{
    const char *q = skip_space(text + at, text + len);
    if (starts_with(q, text + len, "```json"))
        q = skip_space(q + 7, text + len);
    if (q == text + len || *q != '{')
        return;
    p->args_at = (size_t)(q - text);
    p->args_begun = true;
    p->args_len = object_extent(text, p->args_at, len, &p->args_whole);
}

/* What scan_objects keeps while inside one call object. */
typedef struct object_scan {
    int depth, call_depth, objects; /* containers open; the call's level; objects open */
    bool expect_key;
    int key; /* 0 another, 1 "name", 2 "arguments" or "parameters" */
    char kinds[64];
} object_scan;

/* A string from at to i (its quotes included) at the call object's own
 * level: a key, or the value of "name" or of the arguments. */
static void object_string(object_scan *sc, const char *text, size_t at, size_t i,
                          srv_tool_partial *p)
{
    size_t n = i - at - 1;
    if (sc->expect_key) {
        sc->key = n == 4 && memcmp(text + at + 1, "name", 4) == 0 ? 1
                  : (n == 9 && memcmp(text + at + 1, "arguments", 9) == 0) ||
                          (n == 10 && memcmp(text + at + 1, "parameters", 10) == 0)
                      ? 2
                      : 0;
    } else if (sc->key == 1 && srv_tool_name_ok(text + at + 1, n)) {
        p->name_at = at + 1;
        p->name_len = n;
    } else if (sc->key == 2) {
        *p = (srv_tool_partial){.name_at = p->name_at,
                                .name_len = p->name_len,
                                .args_at = at,
                                .args_len = i + 1 - at,
                                .args_begun = true,
                                .args_whole = true,
                                .args_string = true};
    }
}

/* Calls written as JSON objects {"name", "arguments" | "parameters"}
 * (Hermes, Llama 3, Mistral's lists, Granite, tool_choice "required"):
 * each object with no object around it is a call. */
static int scan_objects(const char *text, size_t from, size_t len, srv_tool_partial *out, int cap)
{
    object_scan sc = {.call_depth = -1};
    int n = 0;
    bool in_string = false, escaped = false;
    size_t string_at = 0;
    for (size_t i = from; i < len && sc.depth < 64; i++) {
        char ch = text[i];
        bool level = n > 0 && sc.depth == sc.call_depth;
        if (in_string) {
            in_string = escaped || ch != '"';
            escaped = !escaped && ch == '\\';
            if (!in_string && level)
                object_string(&sc, text, string_at, i, &out[n - 1]);
            continue;
        }
        if (ch == '"') {
            in_string = true;
            string_at = i;
        } else if (ch == '{' && sc.objects == 0) {
            if (n == cap)
                break;
            out[n++] = (srv_tool_partial){0};
            sc.call_depth = sc.depth + 1;
            sc.expect_key = true;
        } else if (ch == '{' && level && !sc.expect_key && sc.key == 2) {
            out[n - 1].args_at = i;
            out[n - 1].args_begun = true;
            out[n - 1].args_len = object_extent(text, i, len, &out[n - 1].args_whole);
        } else if (ch == ':' && level) {
            sc.expect_key = false;
        } else if (ch == ',' && level) {
            sc.expect_key = true;
            sc.key = 0;
        }
        if (ch == '{' || ch == '[') {
            sc.objects += ch == '{';
            sc.kinds[sc.depth++] = ch;
        } else if ((ch == '}' || ch == ']') && sc.depth > 0) {
            sc.objects -= sc.kinds[--sc.depth] == '{';
        }
    }
    return n;
}

/* Calls whose name is text before their arguments object: Mistral's
 * name[ARGS]{...}, DeepSeek's function<｜tool▁sep｜>NAME\n```json{...},
 * harmony's to=functions.NAME ...<|message|>{...}. open: what each call
 * begins with; name_end: what ends its name; args: what its arguments
 * follow (NULL: at once after the name's end). */
static int scan_named(const char *text, size_t from, size_t len, const char *open,
                      const char *name_end, const char *args, srv_tool_partial *out, int cap)
{
    int n = 0;
    const char *end = text + len;
    for (const char *p = text + from; n < cap && (p = find(p, (size_t)(end - p), open));) {
        const char *name = skip_space(p + strlen(open), end), *stop;
        if (name_end)
            stop = find(name, (size_t)(end - name), name_end);
        else
            for (stop = name; stop < end && srv_tool_name_ok(stop, 1); stop++)
                ;
        if (!stop || stop == end)
            break; /* the name is still coming */
        srv_tool_partial *c = &out[n++];
        *c = (srv_tool_partial){.name_at = (size_t)(name - text)};
        size_t name_len = (size_t)(stop - name);
        while (name_len > 0 && is_space(name[name_len - 1]))
            name_len--;
        c->name_len = name_len; /* checked by the caller */
        const char *a = args ? find(stop, (size_t)(end - stop), args) : stop;
        if (!a)
            break;
        args_from(text, (size_t)(a - text) + (args ? strlen(args) : strlen(name_end)), len, c);
        if (!c->args_whole)
            break;
        p = text + c->args_at + c->args_len;
    }
    return n;
}

/* The calls of the syntaxes whose names are text, their names checked
 * (one that is no name is not known). */
static int scan_named_calls(srv_tool_format f, const char *text, size_t from, size_t len,
                            srv_tool_partial *out, int cap)
{
    int n = f == SRV_TOOLS_DEEPSEEK ? scan_named(text, from, len, DS_SEP, "\n", NULL, out, cap)
            : f == SRV_TOOLS_HARMONY
                ? scan_named(text, from, len, HARMONY_TO, NULL, HARMONY_MESSAGE, out, cap)
                : scan_named(text, from, len, MISTRAL_MARK, MISTRAL_ARGS, NULL, out, cap);
    for (int k = 0; k < n; k++) {
        /* Magistral's [CALL_ID] between name and [ARGS] is cut off the name */
        const char *id = f == SRV_TOOLS_MISTRAL
                             ? find(text + out[k].name_at, out[k].name_len, MISTRAL_CALL_ID)
                             : NULL;
        if (id)
            out[k].name_len = (size_t)(id - (text + out[k].name_at));
        if (!srv_tool_name_ok(text + out[k].name_at, out[k].name_len))
            out[k].name_len = 0;
    }
    return n;
}

int srv_tool_calls_scan(srv_tool_format f, const char *text, size_t len, srv_tool_partial *out,
                        int cap)
{
    const char *start = call_start(f, text, len);
    if (!start || cap <= 0 || f == SRV_TOOLS_NONE)
        return 0;
    size_t from = (size_t)(start - text);
    bool named = f == SRV_TOOLS_DEEPSEEK || f == SRV_TOOLS_HARMONY;
    if (f == SRV_TOOLS_MISTRAL) {
        const char *p = skip_space(start + strlen(MISTRAL_MARK), text + len);
        named = p < text + len && *p != '[' && *p != '{';
        if (p == text + len)
            return 0; /* which form is not known yet */
    }
    return named ? scan_named_calls(f, text, from, len, out, cap)
                 : scan_objects(text, from, len, out, cap);
}

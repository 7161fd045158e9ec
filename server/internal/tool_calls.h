/*
 * tool_calls.h - the tool calls a model writes in its own syntax, found in
 * its text (server/tool_calls.c): which syntax a chat template teaches its
 * model, recognised by markers in the template's source; the calls parsed
 * out of a whole answer; and how much of an answer still being streamed
 * can go out as content (the rest may be the start of a call).
 *
 * Pure functions over text, so tests/test_tool_calls.c pins each format
 * without a model. Included by api_chat.c and tool_calls.c only.
 */
#ifndef QL_SERVER_TOOL_CALLS_H
#define QL_SERVER_TOOL_CALLS_H

#include <stdbool.h>
#include <stddef.h>

/*
 * The syntaxes, each named by the models that write it:
 *   HERMES    <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>, repeated
 *             (Hermes 2 Pro and 3, Qwen2.5, Qwen3);
 *   LLAMA3    {"name": N, "parameters": {...}} as the whole answer, several
 *             joined by ";", or after <|python_tag|> (Llama 3.1, 3.2, 3.3);
 *   MISTRAL   [TOOL_CALLS][{"name": N, "arguments": {...}}, ...] (Nemo) or
 *             [TOOL_CALLS]N[ARGS]{...}, repeated (Small 3.2, Magistral);
 *   GRANITE   <|tool_call|>[{"name": N, "arguments": {...}}, ...] (Granite 3);
 *   DEEPSEEK  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
 *             then the arguments in a ```json fence, <｜tool▁call▁end｜>,
 *             repeated (DeepSeek R1 and its distills);
 *   HARMONY   <|start|>assistant<|channel|>commentary to=functions.N
 *             <|constrain|>json<|message|>{...}<|call|>, repeated (GPT-OSS;
 *             reasoning.h's split leaves such a message whole as content);
 *   JSON      no model's own: the whole answer a JSON list of {"name",
 *             "parameters"} (or one such object), what tool_choice
 *             "required" constrains an answer to.
 * NONE: no known syntax; the answer is content.
 */
typedef enum srv_tool_format {
    SRV_TOOLS_NONE,
    SRV_TOOLS_HERMES,
    SRV_TOOLS_LLAMA3,
    SRV_TOOLS_MISTRAL,
    SRV_TOOLS_GRANITE,
    SRV_TOOLS_DEEPSEEK,
    SRV_TOOLS_JSON,
    SRV_TOOLS_HARMONY,
} srv_tool_format;

/* The syntax a chat template's source teaches (SRV_TOOLS_NONE: none
 * known, or source NULL), and its name for logs and docs. */
srv_tool_format srv_tool_format_of(const char *template_source);
const char *srv_tool_format_name(srv_tool_format f);
/* Whether f's markers are special tokens (erased from the text by the
 * default skip_special_tokens). */
bool srv_tool_marks_special(srv_tool_format f);

/* Whether p[0..n) is a function's name: 1 to 64 letters, digits, '_',
 * '-' or '.' (OpenAI's rule, plus the dots of some models' namespaced
 * names). A model's text that names anything else makes no call. */
bool srv_tool_name_ok(const char *p, size_t n);

/* One call: the function's name and its arguments as JSON text (an
 * object's, "{}" when the model gave none). Both malloc'd. */
typedef struct srv_tool_call {
    char *name;
    char *arguments;
} srv_tool_call;

/* What an answer held: its calls, and the text that is not part of any
 * (what came before the first call, right-trimmed; NULL when nothing
 * but whitespace). */
typedef struct srv_tool_calls {
    srv_tool_call *calls;
    size_t n;
    char *content;
} srv_tool_calls;

/*
 * The calls written in text[0..len) in syntax f, into *out (zeroed first;
 * srv_tool_calls_free it). A call is all or nothing, and so is the
 * answer: when a call's marker is there but what follows is not a whole
 * call (bad JSON, no name), no call is taken and the whole text is the
 * content, as vLLM's parsers do. Returns the number of calls (0 when none
 * or malformed; -1 when memory is short, *out then empty).
 */
int srv_tool_calls_parse(srv_tool_format f, const char *text, size_t len, srv_tool_calls *out);
void srv_tool_calls_free(srv_tool_calls *tc);

/*
 * How many bytes of text[0..len), an answer still arriving, may be sent
 * as content now: up to where a call begins (a whole marker), less any
 * tail that could still grow into a marker; for Llama 3's bare JSON,
 * nothing while the answer is only whitespace or opens with "{". from:
 * what this function allowed last time for this answer (0 at first), so
 * that only the new bytes are searched. Never decreases as text grows.
 */
size_t srv_tool_calls_safe_prefix(srv_tool_format f, const char *text, size_t len, size_t from);

/* One call as it stands in an answer still arriving (or whole): where its
 * name lies once it is whole (name_len 0 before), and its arguments' JSON
 * text so far, text[args_at, args_at + args_len) (args_begun false
 * before they begin), args_whole once the value is complete; args_string:
 * the arguments were written as a JSON string holding the object. */
typedef struct srv_tool_partial {
    size_t name_at, name_len;
    size_t args_at, args_len;
    bool args_begun, args_whole, args_string;
} srv_tool_partial;

/*
 * The calls begun in text[0..len) in syntax f, from the first call's
 * start on, into out (at most cap); returns how many. A stream reads it at
 * each token to send a call's name once it is known and its arguments as
 * they are written; the calls themselves are only srv_tool_calls_parse's
 * (a call that turns out malformed has been streamed all the same, as
 * vLLM's streaming parsers do).
 */
int srv_tool_calls_scan(srv_tool_format f, const char *text, size_t len, srv_tool_partial *out,
                        int cap);
/* JSON text p[0..n) without its whitespace outside strings, into out (n +
 * 1 bytes); returns its length. A prefix of a JSON text gives a prefix of
 * the whole's. */
size_t srv_tool_json_minify(const char *p, size_t n, char *out);

#endif

/*
 * test_tool_calls.c - server/tool_calls.c without a model: each syntax a
 * chat template teaches is recognised from the templates models ship
 * (tests/fixtures/chat_templates), and the calls are parsed out of text
 * written in it: one call, several, text before the call, and malformed
 * calls left whole as content; while an answer streams, no byte of a
 * marker (or of Llama's bare JSON) is let out as content. And
 * server/reasoning.c the same way: the templates that mark reasoning, and
 * an answer split into its reasoning and content, whole and as it grows
 * byte by byte (no byte of a marker ever let out, and the stream's pieces
 * joined equal to the whole answer's).
 */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal/reasoning.h"
#include "internal/tool_calls.h"
#include "modelfile.h"

static char *read_fixture(const char *name)
{
    char path[1024], msg[256];
    snprintf(path, sizeof path, "%s/chat_templates/%s", QL_FIXTURES, name);
    char *text = NULL;
    size_t len = 0;
    cr_assert_eq(mf_read_file(path, 1 << 20, &text, &len, msg, sizeof msg), QL_OK, "%s", msg);
    return text;
}

Test(tool_calls, each_template_names_the_syntax_its_model_writes)
{
    static const struct {
        const char *file;
        srv_tool_format want;
    } cases[] = {
        {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", SRV_TOOLS_HERMES},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", SRV_TOOLS_HERMES},
        {"Qwen-Qwen3-0.6B.jinja", SRV_TOOLS_HERMES},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", SRV_TOOLS_LLAMA3},
        {"meta-llama-Llama-3.2-3B-Instruct.jinja", SRV_TOOLS_LLAMA3},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", SRV_TOOLS_MISTRAL},
        {"Mistral-Small-3.2-24B-Instruct-2506.jinja", SRV_TOOLS_MISTRAL},
        {"ibm-granite-granite-3.3-2B-Instruct.jinja", SRV_TOOLS_GRANITE},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", SRV_TOOLS_DEEPSEEK},
        {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", SRV_TOOLS_DEEPSEEK},
        {"HuggingFaceTB-SmolLM2-135M-Instruct.jinja", SRV_TOOLS_NONE},
        {"google-gemma-2-2b-it.jinja", SRV_TOOLS_NONE},
        {"microsoft-Phi-3.5-mini-instruct.jinja", SRV_TOOLS_NONE},
        {"openai-gpt-oss-120b.jinja", SRV_TOOLS_HARMONY},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *src = read_fixture(cases[i].file);
        srv_tool_format got = srv_tool_format_of(src);
        cr_assert_eq(got, cases[i].want, "%s: %s, wanted %s", cases[i].file,
                     srv_tool_format_name(got), srv_tool_format_name(cases[i].want));
        free(src);
    }
    cr_assert_eq(srv_tool_format_of(NULL), SRV_TOOLS_NONE);
}

/* Parse text in f; expect n calls (names and arguments given as
 * alternating strings) and content (NULL: none). */
static void expect(srv_tool_format f, const char *text, const char *content, int n, ...)
{
    srv_tool_calls tc;
    int got = srv_tool_calls_parse(f, text, strlen(text), &tc);
    cr_assert_eq(got, n, "%s: %d calls, wanted %d", text, got, n);
    cr_assert_eq((size_t)got, tc.n);
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++) {
        const char *name = va_arg(ap, const char *);
        const char *args = va_arg(ap, const char *);
        cr_assert_str_eq(tc.calls[i].name, name, "%s: call %d", text, i);
        cr_assert_str_eq(tc.calls[i].arguments, args, "%s: call %d", text, i);
    }
    va_end(ap);
    if (content)
        cr_assert(tc.content && strcmp(tc.content, content) == 0, "%s: content [%s], wanted [%s]",
                  text, tc.content ? tc.content : "(null)", content);
    else
        cr_assert_null(tc.content, "%s: content [%s]", text, tc.content);
    srv_tool_calls_free(&tc);
}

Test(tool_calls, hermes_calls_between_tags)
{
    expect(SRV_TOOLS_HERMES,
           "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
           "</tool_call>",
           NULL, 1, "get_weather", "{\"city\":\"Paris\"}");
    /* several, with the text before them as content */
    expect(SRV_TOOLS_HERMES,
           "Let me look.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
           "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>",
           "Let me look.", 2, "a", "{}", "b", "{\"x\":[1,2]}");
    /* Qwen3 thinks first: the thinking is content */
    expect(SRV_TOOLS_HERMES,
           "<think>\nweather\n</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": "
           "{\"q\": 1}}\n</tool_call>",
           "<think>\nweather\n</think>", 1, "w", "{\"q\":1}");
    /* an answer cut before its closing tag (EOS came first) */
    expect(SRV_TOOLS_HERMES, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": \"v\"}}", NULL,
           1, "a", "{\"k\":\"v\"}");
    /* malformed JSON, or no name: the whole answer is content */
    const char *bad = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": }\n</tool_call>";
    expect(SRV_TOOLS_HERMES, bad, bad, 0);
    const char *nameless = "Sure <tool_call>{\"arguments\": {}}</tool_call>";
    expect(SRV_TOOLS_HERMES, nameless, nameless, 0);
    /* plain text */
    expect(SRV_TOOLS_HERMES, "The sky is blue.", "The sky is blue.", 0);
}

Test(tool_calls, llama3_bare_json_and_python_tag)
{
    expect(SRV_TOOLS_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
           NULL, 1, "get_weather", "{\"city\":\"Oslo\"}");
    /* "arguments" too, and several separated by ";" */
    expect(SRV_TOOLS_LLAMA3,
           "  {\"name\": \"a\", \"arguments\": {\"n\": 1}}; {\"name\": \"b\", \"parameters\": {}}",
           NULL, 2, "a", "{\"n\":1}", "b", "{}");
    expect(SRV_TOOLS_LLAMA3, "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"n\": 2}}", NULL, 1,
           "a", "{\"n\":2}");
    /* the end-of-message token a call ends with, kept as text */
    expect(SRV_TOOLS_LLAMA3, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}<|eom_id|>", NULL,
           1, "a", "{}");
    expect(SRV_TOOLS_LLAMA3,
           "I will check.<|python_tag|>{\"name\": \"a\", \"parameters\": {\"n\": 2}}",
           "I will check.", 1, "a", "{\"n\":2}");
    /* JSON that is not a call, and text after the call, are content */
    expect(SRV_TOOLS_LLAMA3, "{\"answer\": 42}", "{\"answer\": 42}", 0);
    const char *trailing = "{\"name\": \"a\", \"parameters\": {}} and then some";
    expect(SRV_TOOLS_LLAMA3, trailing, trailing, 0);
    /* a builtin tool's python call is not JSON: left as content */
    const char *builtin = "<|python_tag|>brave_search.call(query=\"x\")";
    expect(SRV_TOOLS_LLAMA3, builtin, builtin, 0);
}

Test(tool_calls, mistral_both_syntaxes)
{
    /* Nemo's: a JSON list (ids the model writes are not its calls') */
    expect(SRV_TOOLS_MISTRAL,
           "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}, \"id\": \"abcdefghi\"}, "
           "{\"name\": \"b\", \"arguments\": {}}]",
           NULL, 2, "a", "{\"x\":1}", "b", "{}");
    /* Small 3.2's: name[ARGS]{...}, repeated */
    expect(
        SRV_TOOLS_MISTRAL,
        "Checking. [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}[TOOL_CALLS]get_time[ARGS]{}",
        "Checking.", 2, "get_weather", "{\"city\":\"Rome\"}", "get_time", "{}");
    /* Magistral's [CALL_ID] between name and arguments */
    expect(SRV_TOOLS_MISTRAL, "[TOOL_CALLS]f[CALL_ID]123456789[ARGS]{\"a\": true}", NULL, 1, "f",
           "{\"a\":true}");
    const char *bad = "[TOOL_CALLS]f[ARGS]{\"a\": tru";
    expect(SRV_TOOLS_MISTRAL, bad, bad, 0);
    const char *noargs = "[TOOL_CALLS]just words";
    expect(SRV_TOOLS_MISTRAL, noargs, noargs, 0);
    /* a name is a function's name, not any text before [ARGS] */
    const char *spaced = "[TOOL_CALLS]two words[ARGS]{}";
    expect(SRV_TOOLS_MISTRAL, spaced, spaced, 0);
    /* arguments written as a JSON string holding an object are kept as
     * written; a string holding anything else is no call */
    expect(SRV_TOOLS_MISTRAL, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}]",
           NULL, 1, "f", "{\"a\": 1}");
    const char *stringy = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": \"yes\"}]";
    expect(SRV_TOOLS_MISTRAL, stringy, stringy, 0);
    const char *trailing =
        "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1} and more\"}]";
    expect(SRV_TOOLS_MISTRAL, trailing, trailing, 0);
}

Test(tool_calls, granite_and_deepseek)
{
    expect(SRV_TOOLS_GRANITE,
           "<|tool_call|>[{\"name\": \"a\", \"arguments\": {\"u\": \"v\"}}, {\"name\": \"b\", "
           "\"arguments\": {}}]",
           NULL, 2, "a", "{\"u\":\"v\"}", "b", "{}");
    const char *bad = "<|tool_call|>[{\"name\": \"a\", \"arguments\": ";
    expect(SRV_TOOLS_GRANITE, bad, bad, 0);
    expect(
        SRV_TOOLS_DEEPSEEK,
        "<think>\nhm\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "get_weather\n```json\n{\"city\": \"Lima\"}\n```<｜tool▁call▁end｜>\n"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "<think>\nhm\n</think>", 2, "get_weather", "{\"city\":\"Lima\"}", "get_time", "{}");
    const char *cut =
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{";
    expect(SRV_TOOLS_DEEPSEEK, cut, cut, 0);
}

Test(tool_calls, the_json_list_tool_choice_required_asks_for)
{
    expect(SRV_TOOLS_JSON,
           "[{\"name\": \"a\", \"parameters\": {\"x\": \"y\"}}, {\"name\": \"b\", "
           "\"parameters\": {}}]",
           NULL, 2, "a", "{\"x\":\"y\"}", "b", "{}");
    const char *cut = "[{\"name\": \"a\", \"parameters\": {\"x\": ";
    expect(SRV_TOOLS_JSON, cut, cut, 0);
    expect(SRV_TOOLS_JSON, "[]", "[]", 0);
}

Test(tool_calls, no_syntax_means_content)
{
    expect(SRV_TOOLS_NONE, "<tool_call>{\"name\": \"a\"}</tool_call>",
           "<tool_call>{\"name\": \"a\"}</tool_call>", 0);
    expect(SRV_TOOLS_NONE, "   ", NULL, 0);
}

/* Feed text one byte at a time: what may be sent never shrinks, never
 * passes want, and ends at want. */
static void expect_streamed(srv_tool_format f, const char *text, size_t want)
{
    size_t len = strlen(text), last = 0;
    for (size_t n = 0; n <= len; n++) {
        size_t safe = srv_tool_calls_safe_prefix(f, text, n, last);
        /* the same as a search of the whole text from its start */
        cr_assert_eq(safe, srv_tool_calls_safe_prefix(f, text, n, 0), "%s at %zu", text, n);
        cr_assert_leq(safe, n);
        cr_assert_geq(safe, last, "%s at %zu: %zu after %zu", text, n, safe, last);
        cr_assert_leq(safe, want, "%s at %zu: %zu let out, the call begins at %zu", text, n, safe,
                      want);
        last = safe;
    }
    cr_assert_eq(last, want, "%s: %zu let out, wanted %zu", text, last, want);
}

Test(tool_calls, a_stream_holds_back_what_may_begin_a_call)
{
    expect_streamed(SRV_TOOLS_HERMES, "Hi there <tool_call>\n{\"name\": \"a\"}", 9);
    expect_streamed(SRV_TOOLS_HERMES, "a < b and <tool", 10);
    expect_streamed(SRV_TOOLS_HERMES, "a < b", 5);
    expect_streamed(SRV_TOOLS_MISTRAL, "ok [TOOL_CALLS]f[ARGS]{}", 3);
    expect_streamed(SRV_TOOLS_LLAMA3, "  {\"name\": \"a\", \"parameters\": {}}", 0);
    expect_streamed(SRV_TOOLS_LLAMA3, "Sure.<|python_tag|>{}", 5);
    expect_streamed(SRV_TOOLS_DEEPSEEK, "x<｜tool▁calls▁begin｜>", 1);
    expect_streamed(SRV_TOOLS_NONE, "<tool_call>", 11);
}

/* Every prefix of each syntax's answers, and each with one byte changed
 * to one that matters to a parser (a brace, a quote, a marker's first
 * byte, a stray continuation byte, NUL): the parser and the hold-back
 * never read outside the text (ASan in CI), never invent a call from
 * nothing, and keep their contracts on what they return. */
Test(tool_calls, prefixes_and_mutations_keep_the_contracts)
{
    static const struct {
        srv_tool_format f;
        const char *text;
    } samples[] = {
        {SRV_TOOLS_HERMES, "Hi <tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": [1, \"x\"]}}\n"
                           "</tool_call>\n<tool_call>{\"name\": \"b\"}</tool_call>"},
        {SRV_TOOLS_LLAMA3, " {\"name\": \"a\", \"parameters\": {\"n\": 1}}; {\"name\": \"b\", "
                           "\"arguments\": {}}<|eom_id|>"},
        {SRV_TOOLS_LLAMA3, "ok<|python_tag|>{\"name\": \"a\", \"parameters\": {}}"},
        {SRV_TOOLS_MISTRAL,
         "x[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{\"a\": 1}[TOOL_CALLS][{\"name\": "
         "\"g\", \"arguments\": \"{}\"}]"},
        {SRV_TOOLS_GRANITE, "<|tool_call|>[{\"name\": \"a\", \"arguments\": {\"u\": null}}]"},
        {SRV_TOOLS_DEEPSEEK, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
                             "```json\n{\"a\": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"},
        {SRV_TOOLS_JSON, "[{\"name\": \"a\", \"parameters\": {\"b\": [true, false]}}]"},
    };
    static const char swaps[] = {'{', '}', '"', '<', '[', ']', ';', '\\', (char)0x80, 0};
    char buf[512];
    for (size_t s = 0; s < sizeof samples / sizeof samples[0]; s++) {
        size_t len = strlen(samples[s].text);
        cr_assert_lt(len, sizeof buf);
        for (size_t at = 0; at <= len; at++) {
            for (size_t w = 0; w <= sizeof swaps; w++) {
                memcpy(buf, samples[s].text, len);
                size_t n = len;
                if (w < sizeof swaps && at < len)
                    buf[at] = swaps[w]; /* one byte changed */
                else if (w == sizeof swaps)
                    n = at; /* a prefix */
                else
                    continue;
                srv_tool_calls tc;
                int got = srv_tool_calls_parse(samples[s].f, buf, n, &tc);
                cr_assert_geq(got, 0);
                cr_assert_eq((size_t)got, tc.n);
                for (size_t k = 0; k < tc.n; k++)
                    cr_assert(tc.calls[k].name[0] && tc.calls[k].arguments[0]);
                if (tc.content)
                    cr_assert_leq(strlen(tc.content), n);
                srv_tool_calls_free(&tc);
                size_t safe = srv_tool_calls_safe_prefix(samples[s].f, buf, n, 0);
                cr_assert_leq(safe, n);
            }
        }
    }
}

/* --- reasoning kept apart (server/reasoning.c) ---------------------------------- */

Test(reasoning, the_templates_of_thinking_models_mark_it_and_others_do_not)
{
    static const struct {
        const char *file;
        srv_reason_format want;
    } cases[] = {
        {"Qwen-Qwen3-0.6B.jinja", SRV_REASON_THINK},
        {"HuggingFaceTB-SmolLM3-3B.jinja", SRV_REASON_THINK},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", SRV_REASON_THINK},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", SRV_REASON_NONE},
        {"HuggingFaceTB-SmolLM2-135M-Instruct.jinja", SRV_REASON_NONE},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", SRV_REASON_NONE},
        {"openai-gpt-oss-120b.jinja", SRV_REASON_HARMONY},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *src = read_fixture(cases[i].file);
        cr_assert_eq(srv_reason_format_of(false, false, src), cases[i].want, "%s", cases[i].file);
        free(src);
    }
    cr_assert_eq(srv_reason_format_of(true, false, NULL), SRV_REASON_THINK,
                 "the vocabulary's pair");
    cr_assert_eq(srv_reason_format_of(false, true, NULL), SRV_REASON_HARMONY, "harmony's tokens");
    cr_assert_eq(srv_reason_format_of(false, false, NULL), SRV_REASON_NONE);
    /* the prompts' ends: R1's opens the block, Qwen3's asked not to think closes it */
    static const char r1[] = "<｜User｜>x<｜Assistant｜><think>\n";
    static const char qwen_off[] = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    static const char qwen_on[] = "<|im_start|>assistant\n";
    cr_assert(srv_reason_prompt_opens(SRV_REASON_THINK, r1, strlen(r1)));
    cr_assert_not(srv_reason_prompt_opens(SRV_REASON_THINK, qwen_off, strlen(qwen_off)));
    cr_assert_not(srv_reason_prompt_opens(SRV_REASON_THINK, qwen_on, strlen(qwen_on)));
    cr_assert_not(srv_reason_prompt_opens(SRV_REASON_NONE, r1, strlen(r1)));
}

/* text split whole in format f: its reasoning and content as wanted */
static void split_whole_as(srv_reason_format f, bool opens, const char *text, const char *reasoning,
                           const char *content)
{
    srv_reason_view v;
    size_t len = strlen(text);
    srv_reason_split(f, opens, text, len, true, 0, &v);
    cr_assert(v.done, "%s", text);
    cr_assert_eq(v.reason_to - v.reason_from, strlen(reasoning), "%s", text);
    cr_assert_eq(memcmp(text + v.reason_from, reasoning, strlen(reasoning)), 0, "%s", text);
    cr_assert_str_eq(text + v.content_from, content, "%s", text);
}

static void split_whole(bool opens, const char *text, const char *reasoning, const char *content)
{
    split_whole_as(SRV_REASON_THINK, opens, text, reasoning, content);
}

Test(reasoning, a_whole_answer_splits_at_the_closing_marker)
{
    split_whole(false, "<think>\nadd them\n</think>\n\nTwo.", "add them", "Two.");
    split_whole(false, "  <think>a</think>b", "a", "b");
    split_whole(false, "<think>\n\n</think>\n\nTwo.", "", "Two."); /* an empty thought */
    split_whole(false, "Two.", "", "Two.");                        /* no block: all content */
    split_whole(false, "Two. <think>x</think>", "", "Two. <think>x</think>"); /* not first */
    split_whole(false, "<think>\ncut short", "cut short", "");                /* never closed */
    split_whole(true, "add them\n</think>\n\nTwo.", "add them", "Two.");      /* R1: opened */
    split_whole(true, "still thinking", "still thinking", "");
    split_whole(false, "<thi", "", "<thi"); /* the start of a marker, never finished */
    split_whole(false, "", "", "");
    srv_reason_view v;
    srv_reason_split(SRV_REASON_NONE, false, "<think>a</think>b", 17, true, 0, &v);
    cr_assert(v.done && v.content_from == 0 && v.reason_to == v.reason_from);
}

/* text fed byte by byte: the reasoning let out grows, never holds a
 * marker's byte, and joins to the whole's; the content begins only once
 * the reasoning is done */
static void split_streamed_as(srv_reason_format f, bool opens, const char *text)
{
    size_t len = strlen(text);
    srv_reason_view whole, v;
    srv_reason_split(f, opens, text, len, true, 0, &whole);
    size_t sent_to = 0;
    bool done = false;
    for (size_t n = 0; n <= len; n++) {
        /* as a stream does: the last split's searched carried on */
        srv_reason_split(f, opens, text, n, n == len, n ? v.searched : 0, &v);
        if (v.reason_to > v.reason_from) {
            cr_assert_eq(v.reason_from, whole.reason_from, "%s at %zu", text, n);
            cr_assert_geq(v.reason_to, sent_to, "%s at %zu: what went out is taken back", text, n);
            cr_assert_leq(v.reason_to, whole.reason_to, "%s at %zu: past the reasoning", text, n);
            sent_to = v.reason_to;
        }
        if (done)
            cr_assert(v.done && v.content_from == whole.content_from, "%s at %zu", text, n);
        done = v.done;
        if (v.done)
            cr_assert_eq(v.content_from, whole.content_from, "%s at %zu", text, n);
    }
    cr_assert_eq(sent_to, whole.reason_to, "%s", text);
}

static void split_streamed(bool opens, const char *text)
{
    split_streamed_as(SRV_REASON_THINK, opens, text);
}

Test(reasoning, a_stream_holds_back_only_what_may_be_a_marker)
{
    split_streamed(false, "<think>\nadd them\n</think>\n\nTwo.");
    split_streamed(false, "<think>a </think> b");
    split_streamed(false, "<think>a</thin</think>b"); /* a false start of the marker */
    split_streamed(false, "Two.");
    split_streamed(true, "add them\n</think>\n\nTwo.");
    split_streamed(false, "<think>\ncut short");
    /* while "</thi" may still be the marker, "a" goes out and it does not */
    srv_reason_view v;
    srv_reason_split(SRV_REASON_THINK, false, "<think>a</thi", 13, false, 0, &v);
    cr_assert(!v.done && v.reason_to == 8 && v.reason_from == 7);
    /* "<th" may still open a block: nothing is content yet */
    srv_reason_split(SRV_REASON_THINK, false, "<th", 3, false, 0, &v);
    cr_assert(!v.done);
}

#define H_ANALYSIS "<|channel|>analysis<|message|>"
#define H_FINAL    "<|start|>assistant<|channel|>final<|message|>"
#define H_CALL                                                                                     \
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"             \
    "{\"city\": \"Lima\"}"

Test(reasoning, harmony_channels_split_into_analysis_and_final)
{
    srv_reason_format h = SRV_REASON_HARMONY;
    split_whole_as(h, false, H_ANALYSIS "add them<|end|>" H_FINAL "Two.", "add them", "Two.");
    split_whole_as(h, false, "<|channel|>final<|message|>Two.", "", "Two.");
    split_whole_as(h, false, "Two.", "", "Two."); /* no channel: all content */
    split_whole_as(h, false, H_ANALYSIS "cut sho", "cut sho", "");
    /* a call after the analysis: the call's message whole, for the tool reader */
    split_whole_as(h, false, H_ANALYSIS "ask<|end|>" H_CALL, "ask", H_CALL);
    split_streamed_as(h, false, H_ANALYSIS "add them<|end|>" H_FINAL "Two.");
    split_streamed_as(h, false, H_ANALYSIS "a<|en<|end|>" H_CALL);
    split_streamed_as(h, false, "<|channel|>final<|message|>Two.");
    /* the call's message read as a call */
    srv_tool_calls tc;
    cr_assert_eq(srv_tool_calls_parse(SRV_TOOLS_HARMONY, H_CALL, strlen(H_CALL), &tc), 1);
    cr_assert_str_eq(tc.calls[0].name, "get_weather");
    cr_assert_str_eq(tc.calls[0].arguments, "{\"city\":\"Lima\"}");
    cr_assert_null(tc.content);
    srv_tool_calls_free(&tc);
    static const char two[] = "<|start|>assistant<|channel|>commentary to=functions.a "
                              "<|constrain|>json<|message|>{}<|call|><|start|>assistant "
                              "to=functions.b<|channel|>commentary json<|message|>{\"x\": 1}";
    cr_assert_eq(srv_tool_calls_parse(SRV_TOOLS_HARMONY, two, strlen(two), &tc), 2);
    cr_assert_str_eq(tc.calls[0].name, "a");
    cr_assert_str_eq(tc.calls[1].arguments, "{\"x\":1}");
    srv_tool_calls_free(&tc);
    /* while streaming, nothing of a call's header goes out as content */
    cr_assert_eq(srv_tool_calls_safe_prefix(SRV_TOOLS_HARMONY, "<|sta", 5, 0), 0);
}

/* --- calls as they are written (srv_tool_calls_scan) ------------------------------ */

/* text fed byte by byte in syntax f: the first call's name is known only
 * once whole, its arguments (minified) only grow, each prefix of the
 * whole's, and end as the whole's minified object, equal to the parser's
 * arguments */
static void scan_grows(srv_tool_format f, const char *text, int calls, const char *name,
                       const char *args)
{
    size_t len = strlen(text);
    char sent[256] = "", now[256];
    for (size_t n = 0; n <= len; n++) {
        srv_tool_partial p[8];
        int got = srv_tool_calls_scan(f, text, n, p, 8);
        cr_assert_leq(got, calls, "%s at %zu", text, n);
        if (got == 0)
            continue;
        if (p[0].name_len)
            cr_assert(p[0].name_len == strlen(name) &&
                          memcmp(text + p[0].name_at, name, strlen(name)) == 0,
                      "%s at %zu: a name not yet whole", text, n);
        if (!p[0].args_begun)
            continue;
        cr_assert(p[0].name_len, "%s at %zu: arguments before the name", text, n);
        size_t m = srv_tool_json_minify(text + p[0].args_at, p[0].args_len, now);
        cr_assert_eq(strncmp(now, sent, strlen(sent)), 0, "%s at %zu: %s then %s", text, n, sent,
                     now);
        snprintf(sent, sizeof sent, "%.*s", (int)m, now);
    }
    cr_assert_str_eq(sent, args, "%s", text);
    srv_tool_partial p[8];
    cr_assert_eq(srv_tool_calls_scan(f, text, len, p, 8), calls, "%s", text);
    cr_assert(p[0].args_whole, "%s", text);
    srv_tool_calls tc;
    cr_assert_eq(srv_tool_calls_parse(f, text, len, &tc), calls, "%s", text);
    cr_assert_str_eq(tc.calls[0].arguments, args, "the parser reads the same arguments");
    srv_tool_calls_free(&tc);
}

Test(tool_calls, each_syntax_shows_a_call_as_it_is_written)
{
    scan_grows(
        SRV_TOOLS_HERMES,
        "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\", "
        "\"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": "
        "{}}\n</tool_call>",
        2, "get_weather", "{\"city\":\"Lima\",\"days\":[1,2]}");
    scan_grows(SRV_TOOLS_JSON,
               "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a b\"}}, {\"name\": "
               "\"t\", \"parameters\": {}}]",
               2, "get_weather", "{\"city\":\"a b\"}");
    scan_grows(SRV_TOOLS_LLAMA3,
               "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Lima\"}}", 1,
               "get_weather", "{\"city\":\"Lima\"}");
    scan_grows(SRV_TOOLS_MISTRAL,
               "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]", 1,
               "get_weather", "{\"city\":\"Lima\"}");
    scan_grows(SRV_TOOLS_MISTRAL, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Lima\"}", 1,
               "get_weather", "{\"city\":\"Lima\"}");
    scan_grows(SRV_TOOLS_GRANITE,
               "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]", 1,
               "get_weather", "{\"city\":\"Lima\"}");
    scan_grows(SRV_TOOLS_DEEPSEEK,
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
               "```json\n{\"city\": \"Lima\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
               1, "get_weather", "{\"city\":\"Lima\"}");
    scan_grows(SRV_TOOLS_HARMONY, H_CALL, 1, "get_weather", "{\"city\":\"Lima\"}");
    /* braces and quotes inside strings are the arguments' own */
    scan_grows(SRV_TOOLS_HERMES,
               "<tool_call>{\"name\": \"say\", \"arguments\": {\"s\": \"a } \\\" {\"}}</tool_call>",
               1, "say", "{\"s\":\"a } \\\" {\"}");
}

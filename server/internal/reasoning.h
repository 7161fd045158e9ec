/*
 * reasoning.h - a reasoning model's thinking kept apart from its answer
 * (server/reasoning.c), prefix srv_reason_: which markers a model thinks
 * between, found at load from its vocabulary and chat template, and an
 * answer's text split into its reasoning and its content, whole or as it
 * streams (holding back only what may still be the start of a marker).
 *
 * Pure functions over text, so tests/test_tool_calls.c pins the split
 * without a model. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_REASONING_H
#define QL_SERVER_REASONING_H

#include <stdbool.h>
#include <stddef.h>

/*
 * The markers, each named by the models that write them:
 *   THINK    <think> the reasoning </think> then the answer (Qwen3, QwQ,
 *            DeepSeek R1 and its distills, SmolLM3);
 *   HARMONY  GPT-OSS's channels: <|channel|>analysis<|message|> the
 *            reasoning <|end|>, then <|start|>assistant<|channel|>final
 *            <|message|> the answer, or a commentary message to=functions.NAME
 *            (a call: tool_calls.h's SRV_TOOLS_HARMONY reads it);
 * NONE: the model marks no reasoning; its text is all answer.
 */
typedef enum srv_reason_format {
    SRV_REASON_NONE,
    SRV_REASON_THINK,
    SRV_REASON_HARMONY
} srv_reason_format;

/* The markers a model uses: HARMONY when its vocabulary has <|channel|>
 * and <|message|> (vocab_harmony) or its chat template writes
 * <|channel|>; THINK when its vocabulary has both <think> and </think>
 * (vocab_think) or its template names both; else NONE. */
srv_reason_format srv_reason_format_of(bool vocab_think, bool vocab_harmony,
                                       const char *template_source);
const char *srv_reason_format_name(srv_reason_format f);
/* Whether a rendered prompt ends inside a reasoning block (its last
 * opening marker after its last closing one): the model's text then
 * begins as reasoning without an opening marker of its own (DeepSeek R1's
 * templates end their prompt with "<think>\n"). THINK only. */
bool srv_reason_prompt_opens(srv_reason_format f, const char *prompt, size_t len);

/* Where an answer's reasoning and content lie in its text (byte offsets).
 * The reasoning is text[reason_from, reason_to), whitespace around it left
 * out; the content is text[content_from, len) once done, whitespace
 * before it left out. Before done (a stream), reason_to stops short of a
 * tail that may still be a marker or whitespace, and the content is not
 * known yet. */
typedef struct srv_reason_view {
    size_t reason_from, reason_to;
    size_t content_from;
    bool done;
    size_t searched; /* text[0..searched) holds no whole closing marker */
} srv_reason_view;

/*
 * Split text[0..len) in format f into *v. opens: the prompt left the model
 * inside a reasoning block (srv_reason_prompt_opens). end: the text is
 * whole (a closing marker never written: everything after the opening is
 * reasoning, and the content is empty, as vLLM reads an unfinished
 * thought). A text that does not begin (after whitespace) with the
 * opening marker, when the prompt did not open one, is all content.
 * searched: the last split's v->searched for this text (0 at first), so
 * that a stream searches each byte for the closing marker about once.
 * f NONE: all content. HARMONY: a text opening with the analysis channel's
 * message is reasoning to its <|end|>; the content is the final channel's
 * message, or (a call) the commentary message from its <|start|> on, left
 * whole for the tool call reader; a text that opens with no channel is
 * all content.
 */
void srv_reason_split(srv_reason_format f, bool opens, const char *text, size_t len, bool end,
                      size_t searched, srv_reason_view *v);

#endif

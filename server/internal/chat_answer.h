/*
 * chat_answer.h - a chat answer as a sequence of parts (chat_answer.c),
 * prefix srv_chat_answer_: the writer's half of the one translation layer.
 * The APIs that are chat completions in another shape (Anthropic's
 * Messages, OpenAI's Responses) read their body into a chat request
 * (api_chat.h's srv_chat_prepare) and write the answer in their own
 * shape from these parts: text, and tool calls (an id, a name and
 * arguments as JSON text), whole or as they stream. Included by the .c
 * files of server/ only.
 */
#ifndef QL_SERVER_CHAT_ANSWER_H
#define QL_SERVER_CHAT_ANSWER_H

#include "gen.h"

/* A reasoning part (the model's thinking, kept apart: reasoning.h) comes
 * first, only for a model that marks it and only when it thought. */
typedef enum srv_chat_part { SRV_PART_TEXT, SRV_PART_CALL, SRV_PART_REASONING } srv_chat_part;

/* What an API does with the parts, in order; index counts the parts from
 * 0, kind is the part's. */
typedef struct srv_chat_writer {
    /* A part begins: text or reasoning (id and name NULL), or a call (its
     * id and name). */
    void (*begin)(void *ctx, int index, srv_chat_part kind, const char *id, const char *name);
    /* More of the open part: its text, or the call's arguments. A whole
     * answer gives each part's whole content in one delta (none for an
     * empty text). */
    void (*delta)(void *ctx, int index, srv_chat_part kind, const char *text, size_t len);
    /* The open part has ended. */
    void (*end)(void *ctx, int index, srv_chat_part kind);
} srv_chat_writer;

/* What an answer needs beyond chat's (g->answer): chat_tools.c's state when
 * the request's tools may make calls, the stop sequences to name the one
 * that ended it, and the stream's place. */
typedef struct srv_chat_answer srv_chat_answer;

/* Wrap a's answer state (chat_tools.c's, or none) into a srv_chat_answer
 * (a->answer from here on), copying a's stop sequences; without tools,
 * asks for the stop string to be left in the text (include_stop_str), so
 * that the one which ended the answer is known (it is taken out of the
 * parts). writer: the API writer's own state for this answer (NULL: none),
 * taken (writer_drop frees it with the answer, or at once on failure).
 * Call after srv_chat_prepare. False after the 503. */
bool srv_chat_answer_take(srv_conn *c, srv_req_ask *a, void *writer,
                          void (*writer_drop)(void *writer));
/* The writer state g's answer holds (srv_chat_answer_take's). */
void *srv_chat_answer_writer(const srv_gen *g);

/* How an answer ended: chat's finish_reason (srv_oai_finish's, "tool_calls"
 * when calls were made and it ended by itself), and the stop sequence that
 * ended it (NULL: none, or not known: with tools, the one given when there
 * was one). */
typedef struct srv_chat_end {
    const char *finish;
    const char *stop;
    eng_finish why;
} srv_chat_end;

/* The whole answer of g's first choice (g->answer a srv_chat_answer) as
 * parts to w, and how it ended. Reads only g: any thread. */
srv_chat_end srv_chat_answer_whole(const srv_gen *g, const srv_chat_writer *w, void *ctx);
/* g's first choice as it streams: the parts' news since the last call
 * (text held back while it may be the start of a call or of a stop
 * sequence); at its end (end true) the rest, the open part ended, and how
 * it ended (before the end: finish "stop", stop NULL). */
srv_chat_end srv_chat_answer_stream(srv_gen *g, bool end, const srv_chat_writer *w, void *ctx);

#endif

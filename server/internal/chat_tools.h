/*
 * chat_tools.h - tools on chat completions (chat_tools.c), prefix
 * srv_chat_tools_. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_CHAT_TOOLS_H
#define QL_SERVER_CHAT_TOOLS_H

#include <cjson/cJSON.h>

#include "gen.h"

/* What a chat request's tools ask of its answer (chat_tools.c says how its
 * text becomes tool calls); srv_chat_tools_read hands it to the request as
 * a->answer, which the API keeps (chat completions: g->answer itself) and
 * passes back to the two functions below. */
typedef struct srv_chat_tools srv_chat_tools;

/* Read root's "tools", "tool_choice" and "parallel_tool_calls": checked (a
 * 400 naming the field), and, when the answer may carry tool calls, a
 * srv_chat_tools put in a->answer; for "required" or a named function the
 * calls' grammar in a too (read response_format first: the two together
 * are refused). False after answering. */
bool srv_chat_tools_read(srv_conn *c, const cJSON *root, srv_req_ask *a);
/* copy, the template's copy of messages[i]: an assistant's tool_calls
 * checked and their arguments (JSON text) parsed into objects, as
 * templates read them. False after answering the 400. */
bool srv_chat_tools_message_in(srv_conn *c, cJSON *copy, int i);
/* Choice i of g, read for t's calls, as a whole message in chat
 * completions' shape: content and tool_calls (arguments as JSON text)
 * added to message, *finish (srv_oai_finish's) set to "tool_calls" when
 * calls were made and the answer ended by itself. */
void srv_chat_tools_answer(const srv_gen *g, const srv_chat_tools *t, int32_t i, cJSON *message,
                           const char **finish);
/* Choice i's stream: the deltas to send now (a new list of delta objects,
 * possibly empty, the caller's), content held back while it may be the
 * start of a call, each call as it is written (its name once whole, then
 * its arguments); at its end (end true), what is left, and *finish as
 * srv_chat_tools_answer sets it. */
cJSON *srv_chat_tools_stream(const srv_gen *g, srv_chat_tools *t, int32_t i, bool end,
                             const char **finish);

#endif

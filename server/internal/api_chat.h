/*
 * api_chat.h - chat completions (api_chat.c), prefix srv_chat_: the
 * routes, and the model's chat templates loaded and freed with it.
 * Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_API_CHAT_H
#define QL_SERVER_API_CHAT_H

#include "gen.h"
#include "routes.h"

srv_route_handler srv_chat_completions; /* POST /v1/chat/completions */
srv_route_handler srv_chat_tokenize;    /* POST /chat_tokenize (TGI's) */
/* Compile the loaded model's chat templates (a refused one is logged and
 * answers chat requests with its reason) and keep its BOS/EOS text; free
 * them. Called by serve.c around the model's life. */
void srv_chat_templates_load(srv_server *s);
void srv_chat_templates_free(srv_server *s);

/*
 * The one translation layer of the chat-shaped APIs: each reads its own
 * body into a chat request in chat completions' shape (chat, a JSON object
 * with "messages", and "tools", "tool_choice", "parallel_tool_calls" when
 * given, "skip_special_tokens" when the client chose) and its sampling
 * fields into a, then calls this: the tools read (chat_tools.c: a grammar
 * and g->answer on a when the answer may carry calls) and the messages
 * made ready to render off the loop (*maker, the caller's: hand it to
 * srv_gen_submit_made or srv_chat_tokens). a->adapter must be set. chat is
 * only borrowed (copied where kept). False after answering the refusal.
 * What the generation sends back is then the same for every API: text,
 * and with tools chat_tools.c's content and tool_calls (whole, or as
 * stream deltas); each API writes it in its own shape.
 */
bool srv_chat_prepare(srv_conn *c, const cJSON *chat, srv_req_ask *a, srv_gen_prompt_maker *maker);
/* An API's "tools" (absent, null, or a list of at most SRV_MAX_TOOLS, each
 * rewritten by each as a chat tool appended to out) into chat's "tools"
 * when there are any; false after the 400. */
typedef bool srv_chat_tool_reader(srv_conn *c, const cJSON *tool, int k, cJSON *out);
bool srv_chat_read_tools(srv_conn *c, const cJSON *root, cJSON *chat, srv_chat_tool_reader *each);
/* What a rendered prompt's tokens are answered as: prompt, and tokens
 * (TGI's token list, consumed), into a new object. */
typedef cJSON *srv_chat_token_answer(const char *prompt, cJSON *tokens);
/* Render maker's prompt (for adapter, NULL: the base model) and tokenize
 * it on the pool, answering c with shape's object. maker is the callee's. */
void srv_chat_tokens(srv_conn *c, const char *adapter, srv_gen_prompt_maker maker,
                     srv_chat_token_answer *shape);

#endif

/*
 * api_chat.h - chat completions (api_chat.c), prefix srv_chat_: the
 * routes, and the model's chat templates loaded and freed with it.
 * Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_API_CHAT_H
#define QL_SERVER_API_CHAT_H

#include "routes.h"

srv_route_handler srv_chat_completions; /* POST /v1/chat/completions */
srv_route_handler srv_chat_tokenize;    /* POST /chat_tokenize (TGI's) */
/* Compile the loaded model's chat templates (a refused one is logged and
 * answers chat requests with its reason) and keep its BOS/EOS text; free
 * them. Called by serve.c around the model's life. */
void srv_chat_templates_load(srv_server *s);
void srv_chat_templates_free(srv_server *s);

#endif

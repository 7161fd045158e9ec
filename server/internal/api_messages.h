/*
 * api_messages.h - Anthropic's Messages API (api_messages.c), prefix
 * srv_messages_: its two routes. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_API_MESSAGES_H
#define QL_SERVER_API_MESSAGES_H

#include "routes.h"

srv_route_handler srv_messages_create;       /* POST /v1/messages */
srv_route_handler srv_messages_count_tokens; /* POST /v1/messages/count_tokens */

#endif

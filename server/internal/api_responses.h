/*
 * api_responses.h - OpenAI's Responses API (api_responses.c), prefix
 * srv_responses_: its route. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_API_RESPONSES_H
#define QL_SERVER_API_RESPONSES_H

#include "routes.h"

srv_route_handler srv_responses_create; /* POST /v1/responses */
srv_route_handler srv_responses_get;    /* GET /v1/responses/{id} */
srv_route_handler srv_responses_delete; /* DELETE /v1/responses/{id} */

#endif

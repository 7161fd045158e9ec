/*
 * api_openai.h - OpenAI's completions and models routes (api_openai.c),
 * prefix srv_oai_, and what OpenAI's two generation APIs share. Included by
 * the .c files of server/ only.
 */
#ifndef QL_SERVER_API_OPENAI_H
#define QL_SERVER_API_OPENAI_H

#include <cjson/cJSON.h>

#include "request.h"
#include "routes.h"

srv_route_handler srv_oai_completions; /* POST /v1/completions */
srv_route_handler srv_oai_models;      /* GET /v1/models */
/* What OpenAI's two generation APIs share (api_openai.c, used by
 * api_chat.c): the finish_reason of an engine finish, the usage object
 * added to o (with completion_tokens_details' accepted_prediction_tokens
 * and rejected_prediction_tokens only when the request speculated), the
 * stream's last usage chunk (chunk emptied of choices, then sent), and
 * stream_options.include_usage read into a. */
const char *srv_oai_finish(eng_finish f);
void srv_oai_add_usage(cJSON *o, const eng_usage *u);
void srv_oai_usage_chunk(srv_conn *c, cJSON *chunk, const eng_usage *u);
bool srv_oai_stream_options(srv_conn *c, const cJSON *root, srv_req_ask *a);

#endif

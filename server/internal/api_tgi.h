/*
 * api_tgi.h - Text Generation Inference's routes (api_tgi.c), prefix
 * srv_tgi_, and the token list /tokenize and /chat_tokenize answer.
 * Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_API_TGI_H
#define QL_SERVER_API_TGI_H

#include <cjson/cJSON.h>

#include "routes.h"

srv_route_handler srv_tgi_generate;        /* POST /generate */
srv_route_handler srv_tgi_generate_stream; /* POST /generate_stream */
srv_route_handler srv_tgi_info;            /* GET /info */
srv_route_handler srv_tgi_compat;          /* POST / (TGI's compat route) */
srv_route_handler srv_tgi_tokenize;        /* POST /tokenize */
/* What a token list answers (srv_tgi_tokenize_spans): BOS when add_special
 * and the tokenizer adds one; only the last keep_last tokens (0: all); and
 * at most max_tokens of them (the context length: srv_tgi_context_tokens), or
 * a 400 naming field (the request's field that holds the text) and the
 * bound, mentioning "truncate" when can_truncate. */
typedef struct srv_tgi_token_list {
    bool add_special;
    size_t keep_last, max_tokens;
    const char *field;
    bool can_truncate;
} srv_tgi_token_list;
/* text[0..len) tokenized as the engine tokenizes a prompt (special tokens
 * in the text parsed), as TGI's token list: [{"id", "text", "start",
 * "stop"}] with byte offsets into text (api_tgi.c says how they are
 * found), into *out (the caller's to cJSON_Delete). On error a QL_E*
 * code, msg, and *out NULL. For /tokenize, and for /chat_tokenize's
 * "tokenize_response". */
int srv_tgi_tokenize_spans(const tok_tokenizer *t, const char *text, size_t len,
                           const srv_tgi_token_list *want, cJSON **out, char *msg, size_t msg_len);
/* The most tokens a sequence may hold: the model's context length, or
 * --max-context when smaller (a loaded model's). */
int64_t srv_tgi_context_tokens(const srv_server *s);

#endif

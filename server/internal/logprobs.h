/*
 * logprobs.h - logprobs in the APIs' shapes (logprobs.c), prefix
 * srv_logprobs_. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_LOGPROBS_H
#define QL_SERVER_LOGPROBS_H

#include <cjson/cJSON.h>

#include "gen.h"

/* How a token shows in logprobs: its own decoding when whole UTF-8, else
 * "bytes:\xNN..." (allocated, free()); *bytes (when not NULL) a JSON list
 * of its raw bytes. */
char *srv_logprobs_token_text(const tok_tokenizer *t, int32_t id, cJSON **bytes);
/* Completions' logprobs of choice i's tokens [from, to), the prompt's
 * first when echo. */
cJSON *srv_logprobs_oai(const srv_gen *g, int32_t i, size_t from, size_t to, bool echo);
/* Chat's logprobs ({"content", "refusal"}) of choice i's tokens [from, to). */
cJSON *srv_logprobs_chat(const srv_gen *g, int32_t i, size_t from, size_t to);

#endif

/*
 * responses_store.h - the Responses API's stored responses
 * (responses_store.c), prefix srv_resp_store_: recent responses kept in
 * memory by id, bounded in count and in bytes, the least recently used
 * dropped first, so that GET /v1/responses/{id} can answer one again and
 * previous_response_id can continue its conversation. Any thread (one
 * mutex). Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_RESPONSES_STORE_H
#define QL_SERVER_RESPONSES_STORE_H

#include <stdbool.h>
#include <stddef.h>

/* The bounds serve.c gives it: 1024 responses (an agent's session keeps
 * one per turn, and a few sessions share a server), and 64 MiB in all (a
 * response is its answer's JSON and its conversation's, each at most about
 * the body limit and the answer). */
#define SRV_RESP_STORE_MAX_ENTRIES 1024
#define SRV_RESP_STORE_MAX_BYTES   ((size_t)64 << 20)

typedef struct srv_resp_store srv_resp_store;

/* A store of at most max_entries responses and max_bytes of their text;
 * NULL when memory is short. */
srv_resp_store *srv_resp_store_new(size_t max_entries, size_t max_bytes);
void srv_resp_store_free(srv_resp_store *st);
/* Keep id's response (its JSON text) and conversation (chat messages as
 * JSON text), both copied, replacing one of the same id; the least
 * recently used ones are dropped until the bounds hold. One larger than
 * max_bytes alone, or one memory cannot hold, is not kept (false). */
bool srv_resp_store_put(srv_resp_store *st, const char *id, const char *response,
                        const char *conversation);
/* id's response and conversation (copies, malloc'd, the caller's; either
 * pointer may be NULL when not wanted), and it becomes the most recently
 * used; false when none is kept under id (or memory is short). */
bool srv_resp_store_get(srv_resp_store *st, const char *id, char **response, char **conversation);
/* Drop id's response; false when none was kept. */
bool srv_resp_store_delete(srv_resp_store *st, const char *id);

#endif

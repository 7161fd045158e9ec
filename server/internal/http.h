/*
 * http.h - the connections room (http.c), prefix srv_http_: listening,
 * responses and server-sent events, closing, and the hooks through which
 * http.c and the rooms below the routes reach the ones above them.
 * Included by the .c files of server/ only, as "internal/http.h".
 *
 * Where a lower file must reach a higher one (a request is complete, a
 * connection ends, something ended that a drain waits on) it calls through
 * the server's srv_http_hooks, which serve.c sets, as libuv hands a handle
 * its callbacks. Every function here runs on the loop thread.
 */
#ifndef QL_SERVER_HTTP_H
#define QL_SERVER_HTTP_H

#include "server.h"

/* What the lower files ask of the files above them. One constant table in
 * serve.c; s->hooks points at it from srv_serve or srv_conn_init_detached
 * on. */
typedef struct srv_http_hooks {
    /* c->req is complete: answer it (routes.c's srv_route). */
    void (*on_request)(srv_conn *c);
    /* c is ending (closed, aborted or released): whatever waits to answer
     * it lets go of it (bridge.c's srv_gen_conn_gone). */
    void (*on_conn_end)(srv_conn *c);
    /* A connection, generation or piece of work has ended: when the server
     * drains and nothing is left, close everything (serve.c). */
    void (*check_drained)(srv_server *s);
} srv_http_hooks;

/* Start listening on host:port (port 0: any free one, *bound_port says). */
int srv_http_listen(srv_server *s, const char *host, int port, int *bound_port, char *msg,
                    size_t msg_len);
/* Stop accepting; close idle connections (those between requests). */
void srv_http_stop_accepting(srv_server *s);

/* Responses. Each ends the request unless it begins a stream. */
void srv_http_respond(srv_conn *c, int status, const char *content_type, const char *body,
                      size_t len, const char *extra_headers);
void srv_http_respond_json(srv_conn *c, int status, const char *json);
/* The same, taking json (malloc'd; freed here, whatever happens): written
 * without a copy, for large answers. */
void srv_http_respond_json_owned(srv_conn *c, int status, char *json);
/* Hand the heap's free memory back to the system soon (malloc_trim, once,
 * on the pool): after a large answer is freed, written or not. */
void srv_http_trim_soon(srv_server *s);
/* A response without a body (a 204: no Content-Type, no Content-Length). */
void srv_http_respond_empty(srv_conn *c, int status, const char *extra_headers);
/* What Access-Control-Allow-Origin says to c's request: its Origin when
 * that is listed in --cors-allow-origin (exact match), "*" when the list
 * holds *, NULL when there is no Origin, no list, or the origin is not in
 * it. Every response to a non-NULL one carries it; while the list is set,
 * every response carries Vary: Origin. Points
 * into c->req or the config; lives until the response ends. */
const char *srv_http_cors_origin(const srv_conn *c);
/* An error body in c's request's shape (srv_error_shape): OpenAI's
 * {"error": {"type", "message"}} with type as given, or Anthropic's
 * {"type": "error", "error": {"type", "message"}} with the type its API
 * gives status. Malloc'd (the caller frees it); NULL when memory is short. */
char *srv_http_error_json(const srv_conn *c, int status, const char *type, const char *message);
/* That body, answered with status. */
void srv_http_respond_error(srv_conn *c, int status, const char *type, const char *message,
                            const char *extra_headers);
/* Begin a text/event-stream response; srv_http_stream_event sends one event
 * (the data line), srv_http_stream_end ends the response. */
void srv_http_stream_begin(srv_conn *c);
void srv_http_stream_event(srv_conn *c, const char *data, size_t len);
/* An event with a name ("event: NAME" before its data line, as Anthropic's
 * streams have; NULL: none, srv_http_stream_event's). */
void srv_http_stream_named_event(srv_conn *c, const char *event, const char *data, size_t len);
void srv_http_stream_end(srv_conn *c);
/* How many bytes wait in c's write queue (slow clients). */
size_t srv_http_backlog(const srv_conn *c);
/* Close c once what was written has gone out (after a response that
 * ends the connection). */
void srv_http_close(srv_conn *c);
/* Close c at once, dropping unsent bytes (the client has gone, or does not
 * read). */
void srv_http_abort(srv_conn *c);
/* Ready c, allocated by the caller with sink set, as a connection without
 * a socket; srv_conn_init_detached (serve.c) is this plus the hooks. */
void srv_http_init_sink(srv_server *s, srv_conn *c);

#endif

/*
 * server.h - the internal header of server/, shared by its files only:
 *   http.c     connections: libuv TCP, llhttp parsing (keep-alive,
 *              pipelined requests answered in order, chunked bodies),
 *              limits and timeouts, responses and server-sent events;
 *   routes.c   the routes: JSON in (cJSON, validated field by field) and
 *              out, TGI and OpenAI shapes, the admin adapter API;
 *   metrics.c  counters and histograms, Prometheus text;
 *   serve.c    `qlserve serve`: the loop, the model loaded off the loop,
 *              the engine bridge (tokens back through uv_async), signals
 *              and the graceful drain.
 *
 * One libuv loop thread owns every connection and every generation's
 * state; the engine thread only appends events to a mutex-guarded queue
 * and wakes the loop. Admin work that reads files or merges runs on
 * libuv's thread pool and reports back on the loop.
 */
#ifndef QL_SERVER_H
#define QL_SERVER_H

#include <llhttp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "engine.h"
#include "lora.h"

typedef struct srv_server srv_server;
typedef struct srv_conn srv_conn;
typedef struct srv_gen srv_gen;

/* --- metrics (metrics.c) ----------------------------------------------------- */

#define SRV_HIST_BUCKETS 12

typedef struct srv_hist {
    double bounds[SRV_HIST_BUCKETS]; /* upper bounds, seconds */
    uint64_t counts[SRV_HIST_BUCKETS + 1];
    double sum;
    uint64_t n;
} srv_hist;

typedef struct srv_metrics {
    uint64_t by_status[600];
    uint64_t generations, generated_tokens, prompt_tokens, cancelled;
    uint64_t disconnects; /* clients that left mid-generation */
    uint64_t merges, unmerges, merge_failures;
    srv_hist ttft;      /* time to first token */
    srv_hist per_token; /* time between tokens */
    srv_hist request;   /* whole generation requests */
} srv_metrics;

void srv_metrics_init(srv_metrics *m);
void srv_hist_observe(srv_hist *h, double seconds);
/* The Prometheus text exposition of everything (allocated, free()). */
char *srv_metrics_render(const srv_server *s, size_t *len);

/* --- connections (http.c) ---------------------------------------------------- */

/* A parsed request, owned by its connection until the response ends. */
typedef struct srv_request {
    uint8_t method; /* llhttp_method_t */
    char *url;
    size_t url_len;
    char *body;
    size_t body_len;
    char authorization[512];
    bool auth_too_long;
    bool expect_continue; /* Expect: 100-continue (curl sends it for bodies over 1 KiB) */
    bool keep_alive;
    bool http10; /* an HTTP/1.0 client: no chunked encoding, no 100-continue */
} srv_request;

struct srv_conn {
    uv_tcp_t tcp;
    srv_server *s;
    uint64_t serial;
    llhttp_t parser;
    srv_request req; /* the request being read or answered */
    char hfield[64]; /* the header name being read (only ones we use) */
    size_t hfield_len;
    bool hfield_long;    /* longer than any header we use */
    int hwant;           /* which header's value is being read: 1 authorization, 2 expect */
    char hvalue[32];     /* the value of Expect */
    size_t header_bytes; /* url + fields + values of this request */
    char *pending;       /* bytes read but not yet parsed (while a request is answered) */
    size_t pending_len, pending_cap;
    bool busy; /* a request is being answered */
    bool closing;
    bool refused;     /* the request was refused while being read (413, 431) */
    bool linger_done; /* the lingering close after a refusal has ended */
    uv_shutdown_t shutdown;
    bool loopback;         /* the peer is 127.0.0.0/8 or ::1 */
    bool reading;          /* a request has started arriving */
    uv_timer_t timer;      /* request read timeout, or keep-alive idle */
    srv_gen *gen;          /* the generation this connection waits on */
    struct srv_work *work; /* or the admin work it waits on */
    /* for the fuzz target and tests: take response bytes here instead of
     * writing to the socket */
    void (*sink)(srv_conn *c, const char *data, size_t len);
    void *sink_data;
    srv_conn *next, *prev; /* the server's list */
};

/* Start listening on host:port (port 0: any free one, *bound_port says). */
int srv_listen(srv_server *s, const char *host, int port, int *bound_port, char *msg,
               size_t msg_len);
/* Stop accepting; close idle connections (those between requests). */
void srv_stop_accepting(srv_server *s);
/* Feed bytes as if read from c's socket (the fuzz target). */
void srv_conn_feed(srv_conn *c, const char *data, size_t len);
/* A connection with a sink instead of a socket (the fuzz target). */
void srv_conn_init_detached(srv_server *s, srv_conn *c);
void srv_conn_release_detached(srv_conn *c);

/* Responses. Each ends the request unless it begins a stream. */
void srv_respond(srv_conn *c, int status, const char *content_type, const char *body, size_t len,
                 const char *extra_headers);
void srv_respond_json(srv_conn *c, int status, const char *json);
/* {"error": {"type": ..., "message": ...}} with status. */
void srv_respond_error(srv_conn *c, int status, const char *type, const char *message,
                       const char *extra_headers);
/* Begin a text/event-stream response; srv_stream_event sends one event
 * (the data line), srv_stream_end ends the response. */
void srv_stream_begin(srv_conn *c);
void srv_stream_event(srv_conn *c, const char *data, size_t len);
void srv_stream_end(srv_conn *c);
/* How many bytes wait in c's write queue (slow clients). */
size_t srv_conn_backlog(const srv_conn *c);
/* Close c once what was written has gone out (after a response that
 * ends the connection). */
void srv_conn_close(srv_conn *c);
/* Close c at once, dropping unsent bytes (the client has gone, or does not
 * read). */
void srv_conn_abort(srv_conn *c);
/* The parser callbacks, set once per server. */
void srv_http_settings(llhttp_settings_t *st);

/* --- routes (routes.c) ------------------------------------------------------- */

/* Answer c's complete request (c->req). */
void srv_route(srv_conn *c);

/* --- generations and the engine bridge (serve.c) ------------------------------ */

typedef enum srv_shape {
    SRV_TGI,        /* /generate */
    SRV_TGI_STREAM, /* /generate_stream */
    SRV_OAI,        /* /v1/completions */
    SRV_OAI_STREAM, /* /v1/completions, stream: true */
} srv_shape;

/* One generation request, from submit to its engine on_done. Lives on the
 * loop; conn is NULL once the client has gone (the generation is then
 * cancelled and only waits for its on_done). */
struct srv_gen {
    srv_server *s;
    srv_conn *conn;
    srv_shape shape;
    uint64_t id; /* the engine's */
    char *text;  /* everything generated so far */
    size_t text_len, text_cap;
    size_t tail_len; /* of that, the text the engine held back to the end */
    int32_t *tokens; /* token ids, for details */
    char **pieces;   /* their text, for details */
    size_t n_tokens, cap_tokens;
    bool details;
    bool include_usage;
    bool return_full_text;
    char *prompt; /* kept when return_full_text */
    uint64_t seed;
    bool sampled;
    char model_id[160];
    char oai_id[48];
    double t_start, t_last;
    bool first_seen;
    srv_gen *next_live; /* the server's list of live generations */
    srv_gen *prev_live;
};

/* Submit r for gen (callbacks are filled in here). ENG_E* on refusal, msg. */
int srv_gen_submit(srv_gen *g, eng_request *r, char *msg, size_t msg_len);
/* The client went away: cancel and forget the connection. */
void srv_gen_detach(srv_gen *g);

/* Work off the loop (uv thread pool) with a completion on the loop. */
typedef struct srv_work {
    uv_work_t req;
    srv_server *s;
    srv_conn *conn;                   /* NULL once the client has gone */
    void (*run)(struct srv_work *w);  /* on a pool thread */
    void (*done)(struct srv_work *w); /* on the loop */
    int rc;
    char msg[1024];
    char name[160];
    char path[4096];
    float scale;
    bool safe_merge;
    qt_kind into;
    bool has_report;
    lora_report report;
    lora_meta meta;
} srv_work;
int srv_work_start(srv_work *w);

/* --- the server --------------------------------------------------------------- */

struct srv_server {
    uv_loop_t *loop;
    const cfg_serve *cfg;
    uv_tcp_t listener;
    bool listening;
    llhttp_settings_t http_settings;
    srv_conn *conns;
    int32_t n_conns;
    uint64_t next_serial;
    /* the model, once loaded (serving true) */
    bool serving;
    char load_error[1024];
    eng_model model;
    eng_engine *engine;
    lora_registry *registry;
    char model_id[160];
    double started_at; /* unix time */
    /* the engine's events, appended on the engine thread */
    pthread_mutex_t events_mu;
    struct srv_event *events, *events_tail;
    uv_async_t wake;
    srv_gen *live; /* generations not yet done */
    int32_t n_live;
    int32_t n_work; /* admin work in flight */
    /* shutdown */
    bool draining;
    bool in_check, handles_closed;
    uv_timer_t grace;
    uv_signal_t sigterm, sigint;
    srv_metrics metrics;
    uint64_t oai_serial;
    int exit_code;
};

/* After an event that may end a drain: exits the loop when nothing is left. */
void srv_check_drained(srv_server *s);

/* Run `qlserve serve` with cfg until a signal drains it; the exit status. */
int srv_serve(const cfg_serve *cfg);

/* A process-wide monotonic clock, seconds. */
double srv_now(void);

#endif

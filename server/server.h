/*
 * server.h - the public header of server/: `qlserve serve` (srv_serve, what
 * cli/ calls) and the connection seam the HTTP fuzz target and
 * tests/test_deploy.c drive the real parser and router through without a
 * socket (a server struct, a detached connection whose sink takes the
 * response bytes, srv_conn_feed).
 *
 * The server's rooms and what each owns, bottom up (each calls only the
 * ones above it in this list; a lower one reaches a higher one through
 * the hooks serve.c sets in the server struct). Each room's contract is
 * one header under internal/, its names carry the room's prefix:
 *   http.c        (internal/http.h, srv_http_) connections: libuv TCP,
 *                 llhttp parsing (keep-alive, pipelined requests answered
 *                 in order, chunked bodies), limits and timeouts,
 *                 responses and server-sent events;
 *   metrics.c     (internal/metrics.h, srv_metrics_) counters and
 *                 histograms, Prometheus text;
 *   request.c     (internal/request.h, srv_req_) the request helpers
 *                 every route shares: JSON field readers, errors and the
 *                 status each error code maps to; srv_req_ask, what a
 *                 generation request asks;
 *   pool_job.c    (internal/pool_job.h, srv_pool_) work on libuv's
 *                 thread pool answered on the loop;
 *   bridge.c      (internal/gen.h, srv_gen_) generations: the prompt
 *                 prepared, the submit, the engine bridge (tokens back
 *                 through uv_async);
 *   logprobs.c    (internal/logprobs.h, srv_logprobs_) logprobs in the
 *                 APIs' shapes;
 *   api_tgi.c     (internal/api_tgi.h, srv_tgi_) Text Generation
 *                 Inference: /generate, /generate_stream, /info,
 *                 /tokenize, their request fields in and JSON/SSE out;
 *   api_openai.c  (internal/api_openai.h, srv_oai_) OpenAI:
 *                 /v1/completions, /v1/models, likewise;
 *   tool_calls.c  (internal/tool_calls.h, srv_tool_) tool calls parsed out
 *                 of a model's text, in its syntax;
 *   chat_tools.c  (internal/chat_tools.h, srv_chat_tools_) chat's tools
 *                 and tool_choice, and the answer's tool calls;
 *   api_chat.c    (internal/api_chat.h, srv_chat_) /v1/chat/completions
 *                 and /chat_tokenize;
 *   admin.c       (internal/admin.h, srv_admin_) the admin routes under
 *                 /admin/ (adapters, merge, unmerge, state) and who may
 *                 use them (the token, or a request no web page can
 *                 send), and the Host rule against DNS rebinding;
 *   routes.c      (internal/routes.h, srv_route) the route table, /health
 *                 and /metrics, the Host and API key gates and CORS
 *                 preflights;
 *   serve.c       setup (the hooks), the loop, the model loaded off the
 *                 loop, signals and the graceful drain.
 *
 * One libuv loop thread owns every connection and every generation's
 * state; the engine thread only appends events to a mutex-guarded queue
 * and wakes the loop. Admin work that reads files or merges runs on
 * libuv's thread pool and reports back on the loop.
 *
 * The structs are whole here because the seam's users allocate a server
 * and a connection and set the fields the comments mark as theirs.
 */
#ifndef QL_SERVER_H
#define QL_SERVER_H

#include <llhttp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <uv.h>

#include "config.h"
#include "grammar.h"
#include "lora.h"
#include "model.h"
#include "scheduler.h"
#include "template.h"

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
    uint64_t disconnects;        /* clients that left mid-generation */
    uint64_t held_bytes_refused; /* 503s past --max-held-bytes */
    /* connections turned away at accept, by which bound (503), and those
     * closed for sending no request within --first-byte-timeout-ms */
    uint64_t refused_max_connections, refused_per_peer, first_byte_timeouts;
    uint64_t merges, unmerges, merge_failures;
    srv_hist ttft;      /* time to first token */
    srv_hist per_token; /* time between tokens */
    srv_hist request;   /* whole generation requests */
    /* the event loop's own work: CPU seconds the loop thread spent in one
     * turn of the loop (callbacks, parsing, writing; never the wait), so
     * how long one turn held every other client, whatever else the
     * machine runs; and the longest turn so far */
    srv_hist loop_turn;
    double loop_turn_max;
} srv_metrics;

void srv_metrics_init(srv_metrics *m);

/* --- connections (http.c) ---------------------------------------------------- */

/* The shape of an error body and of a stream's error event: OpenAI's
 * {"error": {"type", "message"}} (every route but Anthropic's), or
 * Anthropic's {"type": "error", "error": {"type", "message"}} with its
 * error types (the Messages API's routes). */
typedef enum srv_error_shape { SRV_ERRORS_OPENAI, SRV_ERRORS_ANTHROPIC } srv_error_shape;

/* A parsed request, owned by its connection until the response ends. */
typedef struct srv_request {
    uint8_t method; /* llhttp_method_t */
    char *url;
    size_t url_len;
    char *body;
    size_t body_len, body_cap;
    /* "Bearer " and a secret of at most CFG_SECRET_MAX bytes (config
     * refuses a longer admin token or API key at start), and its NUL */
    char authorization[7 + CFG_SECRET_MAX + 1];
    bool auth_too_long;
    /* x-api-key, the header Anthropic's clients carry the key in (the
     * same bound as a bearer secret); "" when absent */
    char api_key[CFG_SECRET_MAX + 1];
    bool api_key_too_long;
    /* whose shape the request's errors take (routes.c sets it from the
     * path before any gate answers) */
    srv_error_shape error_shape;
    /* Host and Content-Type, "" when absent (admin.c's trust rules); a
     * value too long for its field sets host_too_long or
     * content_type_too_long, and is then neither an allowed host nor JSON.
     * 264: a 253-byte DNS name, ":65535" and room. */
    char host[264];
    char content_type[128];
    bool host_too_long, content_type_too_long;
    /* CORS (routes.c and http.c read them): Origin, and a preflight's
     * Access-Control-Request-Method and -Headers; "" when absent. A value
     * too long for its field sets cors_too_long, and the request is then
     * answered without CORS headers. */
    char origin[256];
    char cors_method[32];
    char cors_headers[512];
    bool cors_too_long;
    bool expect_continue; /* Expect: 100-continue (curl sends it for bodies over 1 KiB) */
    bool keep_alive;
    bool http10; /* an HTTP/1.0 client: no chunked encoding, no 100-continue */
} srv_request;

/* Where a connection's current request is: http.c says what each allows
 * (which timer runs, whether bytes are parsed or kept for later). */
typedef enum srv_conn_phase {
    SRV_CONN_IDLE,      /* between requests: the keep-alive timer, or before the
                         * first request the first-byte deadline */
    SRV_CONN_HEADERS,   /* a request has begun: its line and headers arriving
                         * (the request timer runs, as in the next two) */
    SRV_CONN_BODY,      /* its body arriving */
    SRV_CONN_TRAILERS,  /* the trailers after a chunked body's last chunk */
    SRV_CONN_ANSWERING, /* complete and being answered (no timer) */
} srv_conn_phase;

/* Where the connection itself is, whatever its request's phase (a
 * generation may still answer a connection that has ended: it is then
 * written nowhere, but to a sink). */
typedef enum srv_conn_life {
    SRV_CONN_OPEN,    /* on the server's list */
    SRV_CONN_ENDING,  /* off the list and in s->n_closing (a sink's: only
                       * ended): its last bytes going out, or lingering
                       * after a refusal */
    SRV_CONN_CLOSING, /* its timer and socket being closed; freed after */
} srv_conn_life;

struct srv_conn {
    uv_tcp_t tcp;
    srv_server *s;
    uint64_t serial;
    llhttp_t parser;
    srv_request req; /* the request being read or answered */
    char hfield[64]; /* the header name being read (only ones we use) */
    size_t hfield_len;
    bool hfield_long;    /* longer than any header we use */
    int hwant;           /* which kept header's value is being read (http.c's H_*) */
    char hvalue[32];     /* the value of Expect */
    size_t header_bytes; /* url + fields + values of this request */
    char *pending;       /* bytes read but not yet parsed (while a request is answered) */
    size_t pending_len, pending_cap;
    srv_conn_phase phase;
    srv_conn_life life;
    bool refused; /* the request was refused while being read (413, 431) */
    /* reading stops while pending holds too much or the write backlog is
     * too large; write_blocked: pipelined requests wait for the backlog */
    bool read_paused, write_blocked;
    size_t out_bytes; /* written, not yet completed (srv_http_backlog) */
    /* pipelined requests left for the loop's next turn (s->resume_head) */
    bool resume_queued;
    srv_conn *resume_next;
    uv_shutdown_t shutdown;
    bool loopback; /* the peer is 127.0.0.0/8 or ::1 (a detached one: set by its user) */
    /* the peer's IP address (an IPv4-mapped IPv6 one as IPv4), for
     * --max-connections-per-peer; family 0: unknown (a detached one) */
    uint8_t peer_family;
    uint8_t peer_ip[16];
    uint64_t requests; /* requests begun on c: until one has, the first-byte deadline runs */
    /* obs-fold (a header line continued on the next one) is looked for in
     * the raw bytes between the parser's header callbacks: fold_scan is
     * where the current llhttp_execute's unlooked-at bytes begin, and
     * fold_lf whether the last byte looked at was a LF */
    const char *fold_scan;
    bool fold_lf;
    uv_timer_t timer;          /* first byte, request read timeout, or keep-alive idle */
    srv_gen *gen;              /* the generation this connection waits on */
    struct srv_pool_job *work; /* or the admin work it waits on */
    /* for the fuzz target and tests: take response bytes here instead of
     * writing to the socket */
    void (*sink)(srv_conn *c, const char *data, size_t len);
    void *sink_data;
    srv_conn *next, *prev; /* the server's list */
};

/* Feed bytes as if read from c's socket (the fuzz target). */
void srv_conn_feed(srv_conn *c, const char *data, size_t len);
/* A connection with a sink instead of a socket (the fuzz target): the
 * caller allocates c, sets sink and sink_data, and frees c after
 * srv_conn_release_detached. Also sets s's hooks (serve.c), so the
 * request is routed as `qlserve serve` routes it. */
void srv_conn_init_detached(srv_server *s, srv_conn *c);
void srv_conn_release_detached(srv_conn *c);
/* The parser callbacks, set once per server (into s->http_settings). */
void srv_http_settings(llhttp_settings_t *st);

/* --- the server --------------------------------------------------------------- */

/* A seam user (no loop, no model) sets cfg, serving, draining, model_id,
 * metrics (srv_metrics_init) and http_settings (srv_http_settings), the
 * rest zero (srv_conn_init_detached sets hooks). */
struct srv_server {
    uv_loop_t *loop;
    const cfg_serve *cfg;
    /* what the lower files call up through (internal/http.h),
     * set by serve.c */
    const struct srv_http_hooks *hooks;
    uv_tcp_t listener;
    bool listening;
    llhttp_settings_t http_settings;
    srv_conn *conns;
    int32_t n_conns;
    /* connections ended but not yet freed (flushing their last bytes, or
     * lingering): they still hold a socket, so max_connections counts them */
    int32_t n_closing;
    /* connections with pipelined requests to answer on the loop's next
     * turn: one pass answers a few per connection, so a client pipelining
     * thousands of requests cannot hold the loop (http.c) */
    uv_idle_t resume;
    srv_conn *resume_head, *resume_tail;
    uint64_t next_serial;
    /* the model, once loaded (serving true) */
    bool serving;
    char load_error[1024];
    eng_model model;
    eng_model draft_model; /* --draft-model's, when given (layers NULL: none) */
    eng_engine *engine;
    lora_registry *registry;
    /* the model's chat templates, compiled at load (NULL: none, or refused,
     * and chat_template_error says why), and its BOS and EOS text */
    tpl_template *chat_template, *chat_template_tools;
    char chat_template_error[512];
    char *chat_bos, *chat_eos;
    /* the syntax of tool calls the model's template teaches
     * (internal/tool_calls.h's srv_tool_format), found at load */
    int tool_format;
    /* the markers the model's reasoning lies between
     * (internal/reasoning.h's srv_reason_format), found at load; whether
     * its template's prompt leaves it inside one (reason_opens), and
     * whether the closing marker is a control token, erased from the text
     * unless special tokens are kept (reason_special) */
    int reason_format;
    bool reason_opens, reason_special;
    /* compiled grammars by their text (response_format, TGI's grammar,
     * tool_choice), shared by every request and thread; made by
     * srv_serve (a seam user may leave it NULL: grammars are then
     * compiled per request) */
    gr_cache *grammars;
    /* the Responses API's stored responses (internal/responses_store.h),
     * made by srv_serve (a seam user may leave it NULL: nothing is then
     * stored, and a stored id is never found) */
    struct srv_resp_store *responses;
    char model_id[160];
    double started_at; /* unix time */
    /* the port listened on (0 for a seam user: any port in a Host header
     * is then taken), and the admin token serve.c generated or read from
     * the state directory when --host is not loopback and cfg has none
     * ("": none; admin.c's srv_admin_token says which one is in force) */
    int port;
    char generated_token[CFG_SECRET_MAX + 1];
    /* the engine's events, appended on the engine thread */
    pthread_mutex_t events_mu;
    struct srv_event *events, *events_tail;
    uv_async_t wake;
    srv_gen *live; /* generations not yet done */
    int32_t n_live;
    int32_t n_work; /* admin work in flight */
    /* generation requests accepted and not yet answered: the bytes they may
     * hold (bridge.c's request_cost, against cfg->max_held_bytes), and the
     * prompts being built on the pool, not yet in the engine's queue (they
     * count against max_queued before anything is built for them) */
    size_t held_bytes;
    int32_t n_building;
    /* shutdown */
    bool draining;
    bool in_check, handles_closed;
    uv_timer_t grace;
    uv_signal_t sigterm, sigint;
    srv_metrics metrics;
    /* after each turn's polling: the loop thread's CPU clock then
     * (metrics.loop_turn) */
    uv_check_t turn_check;
    double turn_cpu_s;
    /* malloc_trim on the pool after a large answer's memory is freed
     * (http.c), one at a time */
    uv_work_t trim;
    bool trim_queued;
    uint64_t oai_serial;
    int exit_code;
};

/* Whether given[0, given_len) is the secret want (NUL-terminated, at most
 * CFG_SECRET_MAX bytes; config refuses a longer API key). Its time depends
 * on neither where the two first differ nor, beyond copying want into a
 * fixed buffer, want's length: both are zero-padded to CFG_SECRET_MAX bytes
 * and every byte compared (request.c). A longer given is false at once: its
 * length is the client's own. */
bool srv_secret_equal(const char *given, size_t given_len, const char *want);

/* value as a Prometheus label value (text exposition format 0.0.4):
 * backslash, double quote and newline escaped as \\, \" and \n, into out
 * (cap bytes, NUL-terminated, cut short when it does not fit); the length
 * the whole escaped value needs, as snprintf counts. Every label value
 * /metrics prints goes through it (metrics.c). */
size_t srv_prom_label_escape(char *out, size_t cap, const char *value);

/* Run `qlserve serve` with cfg until a signal drains it; the exit status. */
int srv_serve(const cfg_serve *cfg);

/* --activations for this process (serve's, and generate's through cli/):
 * srv_activations_set gives word (config checked it against
 * ql_activations_names; NULL: f32) to qt_set_activations, before a model
 * loads; srv_activations_settle, once engine e runs, turns q8 back to f32
 * on the CUDA backend (whose kernels keep f32 activations) with a line on
 * log naming why (who: "qlserve serve"), so that what the logs and /info
 * report afterwards (qt_get_activations) is what the run computes. */
void srv_activations_set(const char *word);
void srv_activations_settle(const eng_engine *e, FILE *log, const char *who);
/* serve's and generate's speculative decoding flags (config's cfg_spec) as
 * the engine's options: the drafter's word parsed (--draft-model without
 * --speculative draft refused by name, QL_EINVAL), the sizes as
 * given (the engine checks their ranges). The draft model is not loaded
 * here (srv_draft_load). */
int srv_spec_opts(const cfg_spec *c, eng_spec_opts *out, char *msg, size_t msg_len);
/* --draft-model's model into *dm (the caller's: eng_model_free after the
 * engine stops), loaded as lo loads the target but from its own path, and
 * named in o->draft_model; nothing (dm zeroed) without --draft-model. A
 * load error names the draft model. */
int srv_draft_load(const cfg_spec *c, const eng_load_opts *lo, eng_model *dm, eng_spec_opts *o,
                   char *msg, size_t msg_len);

#endif

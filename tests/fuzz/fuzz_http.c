/*
 * fuzz_http.c - libFuzzer target for the HTTP request path: llhttp's
 * callbacks in http.c (limits, pipelining, refusals), the router in
 * routes.c (reached through the hooks srv_conn_init_detached sets, as
 * `qlserve serve` sets them; the API key and CORS gates among them), and
 * the body validation the handlers do
 * with request.c's field readers, on a server with no model (the state
 * `qlserve serve` is in while it loads, or once it drains). No socket, no
 * loop, no thread: the bytes go through a detached connection whose sink
 * reads every response back.
 *
 * Input: byte 0 picks the server's setup (FLAG_*), bytes 1..7 are where
 * the rest is cut into separate feeds (each byte * len / 255, so reads
 * that split a request anywhere are explored), and the rest is what the
 * client sends.
 *
 * Whatever the bytes, the responses must be well formed: each begins
 * "HTTP/1.1 ", has a status the server knows, a Content-Length that its
 * body matches, a JSON body that parses, and nothing follows a response
 * that closes the connection; every request read is answered before the
 * input ends (nothing here waits on an engine), and nothing leaks.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seeds in tests/fuzz/corpus_http/.
 */
#include "server.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FLAG_ADMIN_TOKEN  0x01 /* an admin token is configured: bearer checks */
#define FLAG_DRAINING     0x02 /* the server is shutting down */
#define FLAG_TINY_LIMITS  0x04 /* header and body limits small enough to hit */
#define FLAG_NOT_LOOPBACK 0x08 /* the client is remote: admin needs the token */
#define FLAG_API_KEY      0x10 /* an API key is configured: every route but health needs it */
#define FLAG_CORS         0x20 /* browsers from two origins: CORS headers and preflights */

#define N_CUTS      7
#define HEADER_SIZE (1 + N_CUTS)

/* What the sink has seen of the response stream. */
typedef struct wire {
    bool want_body; /* the head has come; its body is next */
    size_t body_len;
    bool json;
    bool closes;      /* the last response said Connection: close */
    bool closed;      /* ... and its body has come */
    unsigned answers; /* responses, to make the sink's work visible */
} wire;

static bool known_status(int status)
{
    static const int known[] = {200, 201, 204, 400, 401, 403, 404, 405,
                                408, 409, 413, 414, 422, 429, 431, 503};
    for (size_t i = 0; i < sizeof known / sizeof *known; i++)
        if (known[i] == status)
            return true;
    return false;
}

/* The value of header name in head[0, len), or NULL. */
static const char *header(const char *head, size_t len, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = head; p + n + 2 <= head + len; p++)
        if (p[0] == '\n' && strncmp(p + 1, name, n) == 0 && p[1 + n] == ':')
            return p + 1 + n + 2;
    return NULL;
}

/* http.c sends each response as two writes, the head then the body (none
 * for HEAD); streams need the engine and never begin here. */
static void sink(srv_conn *c, const char *data, size_t len)
{
    wire *w = c->sink_data;
    static int trace = -1; /* FUZZ_HTTP_TRACE=1: the responses to stderr, to read a crash */
    if (trace < 0)
        trace = getenv("FUZZ_HTTP_TRACE") != NULL;
    if (trace)
        fprintf(stderr, "%s%.*s", w->want_body ? "" : "\n<<< ", (int)len, data);
    if (w->want_body) {
        if (len != w->body_len)
            abort(); /* the body does not match its Content-Length */
        if (w->json) {
            cJSON *j = cJSON_ParseWithLength(data, len);
            if (!j)
                abort(); /* an error body that is not JSON: an unescaped message */
            const cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "message");
            static const char paused[] = "malformed HTTP request: HPE_PAUSED";
            if (cJSON_IsString(m) && strncmp(m->valuestring, paused, sizeof paused - 1) == 0)
                abort(); /* a pause of the parser answered as a malformed request */
            cJSON_Delete(j);
        }
        w->want_body = false;
        w->closed = w->closes;
        return;
    }
    if (w->closed)
        abort(); /* bytes after a response that closed the connection */
    static const char version[] = "HTTP/1.1 ";
    if (len < sizeof version - 1 + 3 || memcmp(data, version, sizeof version - 1) != 0)
        abort();
    if (len < 4 || memcmp(data + len - 4, "\r\n\r\n", 4) != 0)
        abort(); /* the head ends the write */
    const char *code = data + sizeof version - 1;
    int status = (code[0] - '0') * 100 + (code[1] - '0') * 10 + (code[2] - '0');
    if (status == 100) {
        /* Expect: 100-continue's go-ahead: a head alone, before the answer */
        static const char go_ahead[] = "HTTP/1.1 100 Continue\r\n\r\n";
        if (len != sizeof go_ahead - 1 || memcmp(data, go_ahead, len) != 0)
            abort();
        return;
    }
    if (!known_status(status))
        abort();
    const char *conn = header(data, len, "Connection");
    w->closes = conn && strncmp(conn, "close", 5) == 0;
    if (status == 204) {
        /* a preflight's answer: a head alone, no length and no type */
        if (header(data, len, "Content-Length") || header(data, len, "Content-Type"))
            abort();
        w->want_body = false;
        w->closed = w->closes;
        w->answers++;
        return;
    }
    const char *cl = header(data, len, "Content-Length");
    const char *ct = header(data, len, "Content-Type");
    if (!cl || !ct)
        abort();
    w->body_len = strtoul(cl, NULL, 10);
    w->json = strncmp(ct, "application/json", 16) == 0;
    /* the answer to HEAD has no body (RFC 9110 9.3.2); its length is still said */
    w->want_body = c->req.method != HTTP_HEAD;
    w->closed = w->closes && !w->want_body;
    w->answers++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < HEADER_SIZE)
        return 0;
    uint8_t flags = data[0];
    const char *bytes = (const char *)data + HEADER_SIZE;
    size_t len = size - HEADER_SIZE;

    bool tiny = flags & FLAG_TINY_LIMITS;
    cfg_serve cfg = {
        .host = "127.0.0.1",
        .admin_token = (flags & FLAG_ADMIN_TOKEN) ? "fuzz-admin-token" : NULL,
        .api_key = (flags & FLAG_API_KEY) ? "fuzz-api-key" : NULL,
        .cors_allow_origin =
            (flags & FLAG_CORS) ? "https://app.example.com,http://localhost:5173" : NULL,
        .kv_mib = 16,
        .max_running = 4,
        .max_queued = 8,
        .max_new_tokens = 256,
        .max_context = 512,
        .max_connections = 8,
        .max_body_bytes = tiny ? 32 : 65536,
        .max_header_bytes = tiny ? 96 : 8192,
        .request_timeout_ms = 30000,
        .keepalive_timeout_ms = 60000,
        .grace_ms = 1000,
        .merge_threads = 1,
    };
    srv_server *s = calloc(1, sizeof *s);
    if (!s)
        return 0;
    s->cfg = &cfg;
    s->serving = false; /* no model: every route must answer without one */
    s->draining = flags & FLAG_DRAINING;
    snprintf(s->model_id, sizeof s->model_id, "fuzz-model");
    srv_metrics_init(&s->metrics);
    srv_http_settings(&s->http_settings);

    wire w = {0};
    srv_conn *c = calloc(1, sizeof *c);
    if (!c) {
        free(s);
        return 0;
    }
    c->sink = sink;
    c->sink_data = &w;
    srv_conn_init_detached(s, c);
    c->loopback = !(flags & FLAG_NOT_LOOPBACK);

    /* cut points, in order */
    size_t cuts[N_CUTS + 1];
    for (int i = 0; i < N_CUTS; i++)
        cuts[i] = (size_t)data[1 + i] * len / 255;
    for (int i = 1; i < N_CUTS; i++)
        for (int j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
            size_t t = cuts[j];
            cuts[j] = cuts[j - 1];
            cuts[j - 1] = t;
        }
    cuts[N_CUTS] = len;
    size_t at = 0;
    for (int i = 0; i <= N_CUTS; i++) {
        if (cuts[i] > at) {
            srv_conn_feed(c, bytes + at, cuts[i] - at);
            at = cuts[i];
        }
    }

    if (c->phase == SRV_CONN_ANSWERING && c->life == SRV_CONN_OPEN)
        abort(); /* a request read but never answered */
    if (w.want_body)
        abort(); /* a head without its body */
    srv_conn_release_detached(c);
    free(c);
    free(s);
    return 0;
}

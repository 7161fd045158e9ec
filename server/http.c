/*
 * http.c - connections: one libuv TCP handle and one llhttp parser each,
 * on the loop thread.
 *
 * Requests are answered strictly in order. When llhttp completes a message
 * the parser is paused, the request is routed, and bytes that arrive
 * meanwhile (pipelined requests) wait in `pending`; once the response has
 * ended, parsing resumes there. A connection's request is therefore always
 * in one of three states (c->phase, server.h's srv_conn_phase): idle between
 * requests (the keep-alive timer runs, or, before its first request, the
 * shorter first-byte deadline), reading a request (its headers, body or
 * trailers; the request timer runs: 408 when it fires), or answering one
 * (no timer: a generation takes as long as it takes). Apart from that, the
 * connection itself is open, ending (flushing its last bytes, or lingering
 * after a refusal) or closing its handles (c->life, srv_conn_life).
 *
 * Limits: the request line plus headers (431), the body (413, checked
 * against Content-Length before the body is read and against what arrives
 * for chunked bodies), how many connections are open at once and how many
 * from one IP address (503 to the one over, counted in /metrics), and how
 * long a new connection may stay silent (first_byte_timeout_ms, then it
 * is closed and counted). A malformed request gets 400 and the connection
 * is closed, since its framing can no longer be trusted; so does a header
 * folded onto a continuation line (obs-fold). A reader too slow to
 * take its stream (more than 8 MiB waiting) is cut off.
 *
 * Memory per connection is bounded whatever the client sends: reading
 * stops while more than PENDING_MAX bytes wait behind the request being
 * answered (a pipelining client waits; TCP pushes back), and pipelined
 * requests are not answered while more than WRITE_HIGH bytes of earlier
 * answers are still in the server (a client that pipelines and never reads
 * holds a few answers, not thousands); both resume as the backlog drains
 * below WRITE_LOW. Pipelined requests are answered one per connection per
 * turn of the loop (PASS_REQUESTS, s->resume), so a client pipelining
 * thousands of requests cannot hold the loop from the others. An ended
 * connection keeps counting (s->n_closing, in max_connections and
 * qlserve_connections) until its socket is freed, and one whose last bytes
 * are not taken within request_timeout_ms is closed regardless, so its
 * memory comes back and a drain always ends. Bytes that start no request
 * (bare CRLF) do not restart the keep-alive timer, and trailers of a
 * chunked body never stand in for request headers.
 *
 * Offers srv_http_settings, srv_conn_feed and srv_conn_release_detached
 * (the fuzz seam in server.h) and, to the other server files, the
 * listener, the sink connection (srv_http_init_sink), the responses
 * (whole, bodiless, error, server-sent events), the CORS origin check
 * (srv_http_cors_origin: every response to a listed browser origin carries
 * Access-Control-Allow-Origin) and the connection's end. Owns every
 * connection's memory. Knows nothing above it: it reaches the rest of the
 * server only through s->hooks (serve.c's), for each complete request
 * (on_request), a connection that ends (on_conn_end, so what waits to
 * answer it lets go), and after one has left (check_drained). Touches the
 * status counters.
 */
#include "internal/http.h"

#include <cjson/cJSON.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* what a stream may leave unread before the client counts as gone */
#define SLOW_READER_BYTES ((size_t)8 << 20)
/* the bounds above: pipelined bytes kept unparsed, and the write backlog
 * past which pipelined requests wait (until it falls under WRITE_LOW) */
#define PENDING_MAX ((size_t)256 << 10)
#define WRITE_HIGH  ((size_t)256 << 10)
#define WRITE_LOW   ((size_t)64 << 10)
/* pipelined requests answered in one pass over a connection's bytes (one:
 * a connection's next request waits for the loop's next turn, so many
 * pipelining connections take turns and a new request is never behind
 * more than one answer per connection) */
#define PASS_REQUESTS 1

static void on_backlog_drained(srv_conn *c);
static void unqueue_resume(srv_conn *c);

static const char *status_text(int status)
{
    switch (status) {
    case 200: return "OK";
    case 201: return "Created";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    }
    return "Unknown";
}

/* --- the connection's state -------------------------------------------------- */

/* c has ended (srv_http_close, srv_http_abort): nothing more is read or
 * written, whatever its request's phase. */
static bool ended(const srv_conn *c)
{
    return c->life != SRV_CONN_OPEN;
}

/* A request is arriving on c: its headers, body or trailers. */
static bool reading(const srv_conn *c)
{
    return c->phase == SRV_CONN_HEADERS || c->phase == SRV_CONN_BODY ||
           c->phase == SRV_CONN_TRAILERS;
}

/* --- writing ----------------------------------------------------------------- */

typedef struct write_req {
    uv_write_t req;
    char *data;
    size_t len;
} write_req;

/* An answer at least this large, once written and freed, has its memory
 * handed back to the system: glibc keeps freed heap memory (and raises its
 * mmap threshold after a large free, so the next large answers come from
 * the heap too), and after a burst of large answers the server's RSS would
 * stay at the burst's peak. 1 MiB: ordinary answers are far smaller, so
 * the trim runs only after the rare large one. */
#define TRIM_AFTER_BYTES ((size_t)1 << 20)

static void trim_run(uv_work_t *req)
{
    (void)req;
    malloc_trim(0); /* every arena's free pages, on the pool: it walks the heap */
}

static void trim_done(uv_work_t *req, int status)
{
    (void)status;
    srv_server *s = req->data;
    s->trim_queued = false;
}

/* One malloc_trim queued on the pool, unless one is queued already. */
void srv_http_trim_soon(srv_server *s)
{
    if (s->trim_queued || !s->loop)
        return;
    s->trim.data = s;
    if (uv_queue_work(s->loop, &s->trim, trim_run, trim_done) == 0)
        s->trim_queued = true;
}

static void on_written(uv_write_t *req, int status)
{
    write_req *w = (write_req *)req;
    srv_conn *c = req->handle->data;
    c->out_bytes -= w->len;
    if (w->len >= TRIM_AFTER_BYTES)
        srv_http_trim_soon(c->s);
    free(w->data);
    free(w);
    if (status == UV_ECANCELED || ended(c))
        return; /* the socket is being closed */
    if (status < 0)
        srv_http_abort(c); /* the client has gone (reading may be paused, so say it here) */
    else if (c->write_blocked)
        on_backlog_drained(c);
}

/* Write data[0, len), which c takes: freed once written (or at once when
 * it cannot be). */
static void send_owned(srv_conn *c, char *data, size_t len)
{
    if (c->sink)
        c->sink(c, data, len);
    if (c->sink || ended(c) || len == 0) {
        free(data);
        return;
    }
    write_req *w = malloc(sizeof *w);
    if (!w) {
        free(data);
        srv_http_close(c);
        return;
    }
    w->data = data;
    w->len = len;
    uv_buf_t buf = uv_buf_init(data, (unsigned)len);
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &buf, 1, on_written) != 0) {
        free(data);
        free(w);
        srv_http_abort(c);
        return;
    }
    c->out_bytes += len;
}

/* Write a copy of data[0, len). */
static void send_bytes(srv_conn *c, const char *data, size_t len)
{
    if (c->sink) {
        c->sink(c, data, len);
        return;
    }
    if (ended(c) || len == 0)
        return;
    char *copy = malloc(len);
    if (!copy) {
        srv_http_close(c);
        return;
    }
    memcpy(copy, data, len);
    send_owned(c, copy, len);
}

/* Bytes written whose write has not completed: queued in libuv, or handed
 * to the kernel but not yet called back (a write the socket takes at once
 * still holds its copy until the loop's next turn), so what an answer
 * costs the server until the loop has freed it. */
size_t srv_http_backlog(const srv_conn *c)
{
    return c->sink ? 0 : c->out_bytes;
}

/* --- the connection's life ----------------------------------------------------- */

static void request_reset(srv_conn *c)
{
    free(c->req.url);
    free(c->req.body);
    memset(&c->req, 0, sizeof c->req);
    c->hfield_len = 0;
    c->hfield_long = false;
    c->hwant = 0;
    c->header_bytes = 0;
    c->phase = SRV_CONN_IDLE;
    c->fold_lf = false;
}

static void on_closed(uv_handle_t *h)
{
    srv_conn *c = h->data;
    /* the timer closes first, then the socket: free after the last */
    if (h != (uv_handle_t *)&c->tcp)
        return;
    c->s->n_closing--; /* counted since conn_end */
    request_reset(c);
    free(c->pending);
    free(c);
}

/* A connection whose accept failed, never on the books: its timer closed,
 * then its socket, then it is freed. */
static void on_unaccepted_closed(uv_handle_t *h)
{
    srv_conn *c = h->data;
    if (h == (uv_handle_t *)&c->tcp)
        free(c);
    else
        uv_close((uv_handle_t *)&c->tcp, on_unaccepted_closed);
}

static void on_timer_closed(uv_handle_t *h)
{
    srv_conn *c = h->data;
    uv_close((uv_handle_t *)&c->tcp, on_closed);
}

/* how long a refused client may go on sending before it is cut off */
#define LINGER_MS 2000

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);

/* Close the timer, then the socket (which cancels unsent writes), once. */
static void close_handles(srv_conn *c)
{
    if (c->life == SRV_CONN_CLOSING)
        return;
    c->life = SRV_CONN_CLOSING;
    uv_timer_stop(&c->timer);
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_close((uv_handle_t *)&c->timer, on_timer_closed);
}

static void linger_end(srv_conn *c)
{
    close_handles(c);
}

static void linger_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    free(buf->base); /* what the client still sends is dropped */
    if (n < 0)
        linger_end(st->data);
}

static void linger_over(uv_timer_t *t)
{
    linger_end(t->data);
}

/*
 * Our bytes are out. After a request refused while it was arriving (413,
 * 431, 408, malformed), the client may still be sending its body; closing
 * with unread bytes makes the kernel answer with a reset that can destroy
 * the response before the client reads it. So read and drop what comes
 * until the client closes or LINGER_MS passes (the "lingering close" of
 * RFC 9112, 9.6). Otherwise close now.
 */
static void on_shutdown(uv_shutdown_t *req, int status)
{
    srv_conn *c = req->data;
    if (c->life == SRV_CONN_CLOSING)
        return; /* forced (close_overdue): the close cancelled the shutdown */
    if (status == 0 && c->refused &&
        uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, linger_read) == 0) {
        uv_timer_start(&c->timer, linger_over, LINGER_MS, 0);
        return;
    }
    close_handles(c);
}

/* The client has not taken its last bytes in time: close regardless. */
static void close_overdue(uv_timer_t *t)
{
    close_handles(t->data);
}

/* Take c off the server's books; close it once its bytes are out (flush)
 * or at once. */
static void conn_end(srv_conn *c, bool flush)
{
    if (ended(c))
        return;
    c->life = SRV_CONN_ENDING;
    srv_server *s = c->s;
    s->hooks->on_conn_end(c); /* what waits to answer c lets go of it */
    if (c->sink)
        return;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->n_conns--;
    s->n_closing++;
    unqueue_resume(c);
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_timer_stop(&c->timer);
    c->shutdown.data = c;
    if (!flush || uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) != 0)
        close_handles(c);
    else
        uv_timer_start(&c->timer, close_overdue, (uint64_t)s->cfg->request_timeout_ms, 0);
    s->hooks->check_drained(s);
}

void srv_http_close(srv_conn *c)
{
    conn_end(c, true);
}

void srv_http_abort(srv_conn *c)
{
    conn_end(c, false);
}

static void on_timeout(uv_timer_t *t)
{
    srv_conn *c = t->data;
    if (c->phase == SRV_CONN_ANSWERING)
        return;
    if (reading(c)) {
        srv_http_respond_error(c, 408, "timeout", "the request did not arrive in time", NULL);
        c->refused = true;
    } else if (c->requests == 0) {
        /* a connection that never began a request: closed without an
         * answer, as there is no request to answer */
        c->s->metrics.first_byte_timeouts++;
    }
    srv_http_close(c); /* idle keep-alive, never begun, or after the 408 */
}

/* Arm the timer for the state c is in: a request being read has
 * request_timeout_ms; an idle connection that has had a request the
 * keep-alive's time, and a new one that has not the first-byte deadline,
 * or the keep-alive's time when that is shorter (short: an idle new
 * connection costs its slot and nothing else, so a client opening many
 * would hold them all for the keep-alive minute). */
static void arm_timer(srv_conn *c)
{
    if (c->sink || ended(c))
        return;
    if (c->phase == SRV_CONN_ANSWERING) {
        uv_timer_stop(&c->timer);
        return;
    }
    const cfg_serve *cfg = c->s->cfg;
    int32_t first = cfg->first_byte_timeout_ms < cfg->keepalive_timeout_ms
                        ? cfg->first_byte_timeout_ms
                        : cfg->keepalive_timeout_ms; /* never longer than an idle keep-alive */
    int32_t ms = reading(c)         ? cfg->request_timeout_ms
                 : c->requests == 0 ? first
                                    : cfg->keepalive_timeout_ms;
    uv_timer_start(&c->timer, on_timeout, (uint64_t)ms, 0);
}

/* --- parsing --------------------------------------------------------------------- */

static srv_conn *conn_of(llhttp_t *p)
{
    return p->data;
}

static int refuse_headers(srv_conn *c)
{
    if (!c->refused)
        srv_http_respond_error(c, 431, "invalid_request",
                               "the request line and headers are larger than the server's limit",
                               "Connection: close\r\n");
    c->refused = true;
    return -1;
}

static int on_message_begin(llhttp_t *p)
{
    srv_conn *c = conn_of(p);
    request_reset(c);
    c->phase = SRV_CONN_HEADERS;
    c->requests++;
    arm_timer(c);
    return 0;
}

/*
 * obs-fold: a header value continued on a line that begins with a space or
 * tab. RFC 9112 5.2 lets a server refuse it with 400, and we do, as nginx
 * does: llhttp 8 joins the lines, so a folded "Transfer-Encoding:\r\n
 * chunked" is read as chunked here while a proxy in front may read it
 * otherwise, and the two would frame the body differently (request
 * smuggling). llhttp's spans leave out the line breaks, so the raw bytes
 * between the header callbacks are looked at: a LF, then a space or tab,
 * anywhere in the header section (or the trailers) is a fold.
 */
static void refuse_fold(srv_conn *c)
{
    if (!c->refused)
        srv_http_respond_error(c, 400, "invalid_request",
                               "a header line continues on the next line (obs-fold, RFC 9112 5.2); "
                               "send each header on one line",
                               "Connection: close\r\n");
    c->refused = true;
}

/* Look at the bytes from c->fold_scan up to a header span at[0, len) and
 * its first byte: -1 (refused) on a fold. */
static int look_for_fold(srv_conn *c, const char *at, size_t len)
{
    const char *from = c->fold_scan && c->fold_scan <= at ? c->fold_scan : at;
    for (const char *b = from; b < at + (len > 0); b++) {
        if (c->fold_lf && (*b == ' ' || *b == '\t')) {
            refuse_fold(c);
            return -1;
        }
        c->fold_lf = *b == '\n';
    }
    c->fold_scan = at + len;
    if (len > 0)
        c->fold_lf = false;
    return 0;
}

/* A span that is not a header (the URL, the body): the bytes up to its end
 * are not looked at. */
static void skip_fold_scan(srv_conn *c, const char *at, size_t len)
{
    c->fold_scan = at + len;
    c->fold_lf = false;
}

static int count_header_bytes(srv_conn *c, size_t n)
{
    c->header_bytes += n;
    return c->header_bytes > (size_t)c->s->cfg->max_header_bytes ? -1 : 0;
}

static int on_url(llhttp_t *p, const char *at, size_t len)
{
    srv_conn *c = conn_of(p);
    skip_fold_scan(c, at, len);
    if (count_header_bytes(c, len))
        return refuse_headers(c);
    char *u = realloc(c->req.url, c->req.url_len + len + 1);
    if (!u)
        return -1;
    memcpy(u + c->req.url_len, at, len);
    c->req.url = u;
    c->req.url_len += len;
    u[c->req.url_len] = 0;
    return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t len)
{
    srv_conn *c = conn_of(p);
    if (count_header_bytes(c, len))
        return refuse_headers(c);
    if (look_for_fold(c, at, len))
        return -1;
    if (c->hfield_len + len >= sizeof c->hfield) {
        c->hfield_long = true;
    } else {
        memcpy(c->hfield + c->hfield_len, at, len);
        c->hfield_len += len;
        c->hfield[c->hfield_len] = 0;
    }
    return 0;
}

/* The request headers kept, by c->hwant: where each value goes. The rest
 * are read past. */
enum {
    H_NONE,
    H_AUTHORIZATION,
    H_EXPECT,
    H_ORIGIN,
    H_CORS_METHOD,
    H_CORS_HEADERS,
    H_HOST,
    H_CONTENT_TYPE,
    H_API_KEY,
    H_LAST = H_API_KEY
};

static const char *const kept_headers[] = {
    [H_AUTHORIZATION] = "authorization",
    [H_EXPECT] = "expect",
    [H_ORIGIN] = "origin",
    [H_CORS_METHOD] = "access-control-request-method",
    [H_CORS_HEADERS] = "access-control-request-headers",
    [H_HOST] = "host",
    [H_CONTENT_TYPE] = "content-type",
    [H_API_KEY] = "x-api-key",
};

/* The field header h's value is read into, its size, and what to set when
 * it does not fit. */
static char *kept_value(srv_conn *c, int h, size_t *cap, bool **too_long)
{
    *too_long = &c->req.cors_too_long;
    switch (h) {
    case H_AUTHORIZATION:
        *too_long = &c->req.auth_too_long;
        *cap = sizeof c->req.authorization;
        return c->req.authorization;
    case H_EXPECT:
        *too_long = NULL;
        *cap = sizeof c->hvalue;
        return c->hvalue;
    case H_ORIGIN: *cap = sizeof c->req.origin; return c->req.origin;
    case H_CORS_METHOD: *cap = sizeof c->req.cors_method; return c->req.cors_method;
    case H_CORS_HEADERS: *cap = sizeof c->req.cors_headers; return c->req.cors_headers;
    case H_HOST:
        *too_long = &c->req.host_too_long;
        *cap = sizeof c->req.host;
        return c->req.host;
    case H_CONTENT_TYPE:
        *too_long = &c->req.content_type_too_long;
        *cap = sizeof c->req.content_type;
        return c->req.content_type;
    case H_API_KEY:
        *too_long = &c->req.api_key_too_long;
        *cap = sizeof c->req.api_key;
        return c->req.api_key;
    }
    return NULL;
}

static int on_header_field_complete(llhttp_t *p)
{
    srv_conn *c = conn_of(p);
    c->hwant = H_NONE;
    if (c->phase != SRV_CONN_HEADERS)
        return 0; /* a trailer: read past, never kept as a header */
    for (int h = H_AUTHORIZATION; h <= H_LAST && !c->hfield_long; h++) {
        if (strcasecmp(c->hfield, kept_headers[h]) == 0) {
            size_t cap;
            bool *too_long;
            c->hwant = h;
            kept_value(c, h, &cap, &too_long)[0] = 0; /* a repeated header: the last one */
        }
    }
    return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t len)
{
    srv_conn *c = conn_of(p);
    if (count_header_bytes(c, len))
        return refuse_headers(c);
    if (look_for_fold(c, at, len))
        return -1;
    size_t cap;
    bool *too_long;
    char *v = kept_value(c, c->hwant, &cap, &too_long);
    if (!v)
        return 0;
    size_t have = strlen(v);
    if (have + len >= cap) {
        if (too_long)
            *too_long = true;
    } else {
        memcpy(v + have, at, len);
        v[have + len] = 0;
    }
    return 0;
}

static int on_header_value_complete(llhttp_t *p)
{
    srv_conn *c = conn_of(p);
    if (c->hwant == H_EXPECT)
        c->req.expect_continue = strcasecmp(c->hvalue, "100-continue") == 0;
    c->hfield_len = 0;
    c->hfield_long = false;
    c->hwant = H_NONE;
    return 0;
}

static int refuse_body(srv_conn *c)
{
    char m[160];
    snprintf(m, sizeof m, "the request body is larger than the server's limit of %lld bytes",
             (long long)c->s->cfg->max_body_bytes);
    if (!c->refused)
        srv_http_respond_error(c, 413, "invalid_request", m, "Connection: close\r\n");
    c->refused = true;
    return -1;
}

static int on_headers_complete(llhttp_t *p)
{
    srv_conn *c = conn_of(p);
    /* no protocol is switched to here: Upgrade is ignored (RFC 9110 7.8)
     * and CONNECT is answered as any other method. Left set, llhttp would
     * take the bytes after this request as another protocol, and the next
     * request on the connection (curl --http2 sends Upgrade: h2c) would get
     * a 400 */
    p->upgrade = 0;
    c->phase = SRV_CONN_BODY;
    /* refuse a declared body over the limit before reading any of it */
    if ((p->flags & F_CONTENT_LENGTH) && p->content_length > (uint64_t)c->s->cfg->max_body_bytes)
        return refuse_body(c);
    /* the client waits for a go-ahead before sending the body */
    c->req.http10 = p->http_major == 1 && p->http_minor == 0;
    if (c->req.expect_continue && !c->req.http10)
        send_bytes(c, "HTTP/1.1 100 Continue\r\n\r\n", 25);
    return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len)
{
    srv_conn *c = conn_of(p);
    skip_fold_scan(c, at, len);
    if (c->req.body_len + len > (size_t)c->s->cfg->max_body_bytes)
        return refuse_body(c);
    size_t need = c->req.body_len + len + 1;
    if (need > c->req.body_cap) {
        /* doubling: a megabyte arriving in 64 KiB reads is copied about
         * twice over in all, not once per read */
        size_t cap = c->req.body_cap ? c->req.body_cap : 4096;
        while (cap < need)
            cap *= 2;
        size_t most = (size_t)c->s->cfg->max_body_bytes + 1;
        cap = cap > most && need <= most ? most : cap;
        char *b = realloc(c->req.body, cap);
        if (!b)
            return -1;
        c->req.body = b;
        c->req.body_cap = cap;
    }
    memcpy(c->req.body + c->req.body_len, at, len);
    c->req.body_len += len;
    c->req.body[c->req.body_len] = 0;
    return 0;
}

/* The last chunk of a chunked body (size 0): trailers follow, and are
 * looked at for folds as headers are. */
static int on_chunk_header(llhttp_t *p)
{
    srv_conn *c = conn_of(p);
    if (p->content_length == 0) {
        c->phase = SRV_CONN_TRAILERS;
        c->fold_lf = false;
    }
    return 0;
}

static int on_message_complete(llhttp_t *p)
{
    srv_conn *c = conn_of(p);
    c->req.method = (uint8_t)llhttp_get_method(p);
    c->req.keep_alive = llhttp_should_keep_alive(p) && !c->s->draining;
    c->phase = SRV_CONN_ANSWERING;
    return HPE_PAUSED; /* answer this one before parsing the next */
}

void srv_http_settings(llhttp_settings_t *st)
{
    llhttp_settings_init(st);
    st->on_message_begin = on_message_begin;
    st->on_url = on_url;
    st->on_header_field = on_header_field;
    st->on_header_field_complete = on_header_field_complete;
    st->on_header_value = on_header_value;
    st->on_header_value_complete = on_header_value_complete;
    st->on_headers_complete = on_headers_complete;
    st->on_body = on_body;
    st->on_chunk_header = on_chunk_header;
    st->on_message_complete = on_message_complete;
}

static void on_read(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf);

/* Read while c can take more: pipelined bytes under PENDING_MAX and no
 * write backlog holding its requests back. A paused client's bytes wait in
 * its kernel buffers, and TCP stops it from sending more. */
static void update_reading(srv_conn *c)
{
    if (c->sink || ended(c))
        return;
    bool want = c->pending_len < PENDING_MAX && !c->write_blocked;
    if (want && c->read_paused) {
        if (uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, on_read) == 0)
            c->read_paused = false;
    } else if (!want && !c->read_paused) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->read_paused = true;
    }
}

/* Keep data[0, len) for after the current response. */
static void keep_pending(srv_conn *c, const char *data, size_t len)
{
    if (len == 0)
        return;
    if (c->pending_len + len > c->pending_cap) {
        size_t cap = (c->pending_len + len) * 2;
        char *p = realloc(c->pending, cap);
        if (!p) {
            srv_http_close(c);
            return;
        }
        c->pending = p;
        c->pending_cap = cap;
    }
    memmove(c->pending + c->pending_len, data, len);
    c->pending_len += len;
    update_reading(c);
}

static void resume_pending(srv_conn *c);

/* Each queued connection answers its next few pipelined requests. */
static void on_resume(uv_idle_t *h)
{
    srv_server *s = h->data;
    srv_conn *c = s->resume_head;
    s->resume_head = s->resume_tail = NULL;
    uv_idle_stop(&s->resume);
    while (c) {
        srv_conn *next = c->resume_next;
        c->resume_next = NULL;
        c->resume_queued = false;
        resume_pending(c); /* may queue c again, at the tail */
        c = next;
    }
}

/* Answer c's pipelined requests on the loop's next turn. */
static void queue_resume(srv_conn *c)
{
    srv_server *s = c->s;
    if (c->resume_queued)
        return;
    c->resume_queued = true;
    if (s->resume_tail)
        s->resume_tail->resume_next = c;
    else
        s->resume_head = c;
    s->resume_tail = c;
    uv_idle_start(&s->resume, on_resume);
}

/* Take an ending c out of the queue. */
static void unqueue_resume(srv_conn *c)
{
    srv_server *s = c->s;
    if (!c->resume_queued)
        return;
    srv_conn *prev = NULL;
    for (srv_conn *q = s->resume_head; q; prev = q, q = q->resume_next) {
        if (q != c)
            continue;
        if (prev)
            prev->resume_next = c->resume_next;
        else
            s->resume_head = c->resume_next;
        if (s->resume_tail == c)
            s->resume_tail = prev;
        break;
    }
    c->resume_queued = false;
    c->resume_next = NULL;
}

/* After a read that ends within a request's headers or trailers: its last
 * bytes, after the last header span, looked at too (a fold may begin in
 * this read and go on in the next); whether they hold a fold (refused). */
static bool ends_in_fold(srv_conn *c, const char *end)
{
    if (c->phase != SRV_CONN_HEADERS && c->phase != SRV_CONN_TRAILERS)
        return false;
    return look_for_fold(c, end, 0) != 0;
}

/* Parse data; route each completed request, up to PASS_REQUESTS of them
 * (a sink's: all); keep what follows a request that is still being
 * answered, or that waits for the loop's next turn. */
static void parse(srv_conn *c, const char *data, size_t len)
{
    int routed = 0;
    while (len > 0 && !ended(c)) {
        if (c->phase == SRV_CONN_ANSWERING || c->write_blocked || c->resume_queued) {
            keep_pending(c, data, len);
            return;
        }
        if (routed == PASS_REQUESTS && !c->sink) {
            keep_pending(c, data, len);
            queue_resume(c);
            return;
        }
        c->fold_scan = data;
        llhttp_errno_t err = llhttp_execute(&c->parser, data, len);
        if (err == HPE_OK && ends_in_fold(c, data + len)) {
            srv_http_close(c); /* refuse_fold has answered */
            return;
        }
        if (err == HPE_OK) {
            /* the request timer runs from the request's first byte
             * (on_message_begin): more of it does not restart it, or a
             * client trickling bytes would never time out; and bytes that
             * begin no request (CRLF between requests) leave the keep-alive
             * timer as it was, or a client could hold the connection
             * forever with one CRLF a minute */
            return;
        }
        if (err == HPE_PAUSED) {
            const char *stop = llhttp_get_error_pos(&c->parser);
            size_t used = stop ? (size_t)(stop - data) : len;
            llhttp_resume(&c->parser);
            arm_timer(c);
            data += used;
            len -= used;
            routed++;
            c->s->hooks->on_request(c); /* may end the response at once (c idle again) */
            continue;
        }
        if (!c->refused) {
            /* the framing is broken: say so once and close */
            char m[256];
            snprintf(m, sizeof m, "malformed HTTP request: %s (%s)", llhttp_errno_name(err),
                     llhttp_get_error_reason(&c->parser) ? llhttp_get_error_reason(&c->parser)
                                                         : "");
            srv_http_respond_error(c, 400, "invalid_request", m, "Connection: close\r\n");
            c->refused = true;
        }
        srv_http_close(c);
        return;
    }
}

void srv_conn_feed(srv_conn *c, const char *data, size_t len)
{
    parse(c, data, len);
}

/* Parse what was pipelined while c was answering, and read again. */
static void resume_pending(srv_conn *c)
{
    if (c->pending_len && !c->resume_queued) {
        /* parse moves the pipelined bytes; take them out first */
        char *p = c->pending;
        size_t n = c->pending_len;
        c->pending = NULL;
        c->pending_len = c->pending_cap = 0;
        parse(c, p, n);
        free(p);
    }
    update_reading(c);
}

/* The response ended: close, or go on with what was pipelined behind it. */
static void response_done(srv_conn *c, bool keep_alive)
{
    bool keep = keep_alive && c->req.keep_alive && !c->s->draining;
    request_reset(c);
    if (!keep) {
        srv_http_close(c);
        return;
    }
    arm_timer(c);
    if (srv_http_backlog(c) > WRITE_HIGH) {
        /* the client is not reading its answers: its next requests wait */
        c->write_blocked = true;
        update_reading(c);
        return;
    }
    resume_pending(c);
}

/* The write backlog fell (on_written): go on when it is under WRITE_LOW. */
static void on_backlog_drained(srv_conn *c)
{
    if (srv_http_backlog(c) > WRITE_LOW)
        return;
    c->write_blocked = false;
    if (c->phase == SRV_CONN_ANSWERING)
        update_reading(c);
    else
        resume_pending(c);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)h;
    buf->base = malloc(suggested);
    buf->len = buf->base ? suggested : 0;
}

static void on_read(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf)
{
    srv_conn *c = stream->data;
    if (n < 0) {
        srv_http_abort(c); /* EOF or error: the client has gone */
    } else if (n > 0) {
        parse(c, buf->base, (size_t)n);
    }
    free(buf->base);
}

/* c's peer address into c->peer_family and c->peer_ip (an IPv4-mapped
 * IPv6 address as the IPv4 one it is, so a dual-stack listener counts a
 * peer once), and whether it is loopback (127.0.0.0/8 or ::1). */
static void read_peer(srv_conn *c)
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) != 0)
        return;
    static const uint8_t v4mapped[12] = {[10] = 0xff, [11] = 0xff};
    if (ss.ss_family == AF_INET) {
        c->peer_family = AF_INET;
        memcpy(c->peer_ip, &((const struct sockaddr_in *)&ss)->sin_addr, 4);
    } else if (ss.ss_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)&ss)->sin6_addr.s6_addr;
        bool mapped = memcmp(a, v4mapped, 12) == 0;
        c->peer_family = mapped ? AF_INET : AF_INET6;
        memcpy(c->peer_ip, mapped ? a + 12 : a, mapped ? 4 : 16);
    }
    static const uint8_t one[16] = {[15] = 1};
    c->loopback = (c->peer_family == AF_INET && c->peer_ip[0] == 127) ||
                  (c->peer_family == AF_INET6 && memcmp(c->peer_ip, one, 16) == 0);
}

/* Whether c's peer already holds --max-connections-per-peer open
 * connections besides c. One walk over the open connections (at most
 * --max-connections of them) per accepted one: a table by address would
 * be faster, but the walk is a compare per connection and only at accept. */
static bool peer_over_cap(const srv_conn *c)
{
    int32_t cap = c->s->cfg->max_connections_per_peer, n = 0;
    if (cap <= 0 || c->peer_family == 0)
        return false;
    size_t bytes = c->peer_family == AF_INET ? 4 : 16;
    for (const srv_conn *o = c->s->conns; o; o = o->next)
        if (o != c && o->peer_family == c->peer_family && !memcmp(o->peer_ip, c->peer_ip, bytes) &&
            ++n >= cap)
            return true;
    return false;
}

/* Turn c away at accept (503, Retry-After) when the server is draining,
 * is at --max-connections, or c's address at --max-connections-per-peer
 * (as nginx's limit_conn answers, 503 by default): true when it was. */
static bool refuse_at_accept(srv_conn *c)
{
    srv_server *s = c->s;
    const char *why = NULL;
    if (s->draining) {
        why = "the server is shutting down";
    } else if (s->n_conns + s->n_closing > s->cfg->max_connections) {
        why = "too many connections; try again later";
        s->metrics.refused_max_connections++;
    } else if (peer_over_cap(c)) {
        why = "too many connections from this address (--max-connections-per-peer); "
              "try again later";
        s->metrics.refused_per_peer++;
    }
    if (!why)
        return false;
    srv_http_respond_error(c, 503, "overloaded", why, "Retry-After: 1\r\nConnection: close\r\n");
    srv_http_close(c);
    return true;
}

static void on_connection(uv_stream_t *server, int status)
{
    srv_server *s = server->data;
    if (status < 0)
        return;
    srv_conn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->s = s;
    c->serial = ++s->next_serial;
    uv_tcp_init(s->loop, &c->tcp);
    c->tcp.data = c;
    uv_timer_init(s->loop, &c->timer);
    c->timer.data = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
        c->life = SRV_CONN_CLOSING;
        uv_close((uv_handle_t *)&c->timer, on_unaccepted_closed);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1); /* tokens go out as they come */
    llhttp_init(&c->parser, HTTP_REQUEST, &s->http_settings);
    c->parser.data = c;
    read_peer(c);
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    if (refuse_at_accept(c))
        return;
    uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, on_read);
    arm_timer(c); /* the first-byte deadline */
}

int srv_http_listen(srv_server *s, const char *host, int port, int *bound_port, char *msg,
                    size_t msg_len)
{
    struct sockaddr_storage addr;
    int rc = strchr(host, ':') ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr)
                               : uv_ip4_addr(host, port, (struct sockaddr_in *)&addr);
    if (rc != 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "--host %s is not an IP address (%s)", host,
                       uv_strerror(rc));
    uv_tcp_init(s->loop, &s->listener);
    s->listener.data = s;
    rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection);
    if (rc != 0) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        return ql_fail(msg, msg_len, QL_EIO, "cannot listen on %s port %d: %s", host, port,
                       uv_strerror(rc));
    }
    s->listening = true;
    struct sockaddr_storage got;
    int len = sizeof got;
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&got, &len);
    *bound_port = ntohs(got.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&got)->sin6_port
                                                  : ((struct sockaddr_in *)&got)->sin_port);
    return QL_OK;
}

void srv_http_stop_accepting(srv_server *s)
{
    if (s->listening) {
        s->listening = false;
        uv_close((uv_handle_t *)&s->listener, NULL);
    }
    for (srv_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (c->phase == SRV_CONN_IDLE)
            srv_http_close(c);
    }
}

/* --- counting ------------------------------------------------------------------ */

static void count_status(srv_server *s, int status)
{
    if (status >= 100 && status < 600)
        s->metrics.by_status[status]++;
}

/* --- CORS ----------------------------------------------------------------------- */

const char *srv_http_cors_origin(const srv_conn *c)
{
    const char *list = c->s->cfg ? c->s->cfg->cors_allow_origin : NULL, *origin = c->req.origin;
    if (!list || !*origin || c->req.cors_too_long)
        return NULL;
    size_t len = strlen(origin), n;
    for (const char *at = list, *o; ql_list_next(&at, &o, &n);) {
        if (n == 1 && *o == '*')
            return "*";
        if (n == len && memcmp(o, origin, len) == 0)
            return origin;
    }
    return NULL;
}

/* The CORS headers of every response while --cors-allow-origin is set:
 * Access-Control-Allow-Origin to a listed origin, and Vary: Origin to
 * every request, listed or not, because the answer differs by origin and
 * a cache between must not hand one origin's answer to another (Fetch,
 * "CORS protocol and HTTP caches"). Without the flag, none. */
static void cors_headers(const srv_conn *c, char *cors, size_t cap)
{
    const char *allow = srv_http_cors_origin(c);
    cors[0] = 0;
    if (allow)
        snprintf(cors, cap, "Access-Control-Allow-Origin: %s\r\nVary: Origin\r\n", allow);
    else if (c->s->cfg && c->s->cfg->cors_allow_origin)
        snprintf(cors, cap, "Vary: Origin\r\n");
}

/* --- responses ---------------------------------------------------------------- */

/* The status line and headers; content_type NULL: a response without a body
 * (204), which sends neither Content-Type nor Content-Length (RFC 9110
 * 8.6). */
static void send_head(srv_conn *c, int status, const char *content_type, size_t len,
                      const char *extra_headers, bool keep)
{
    char cors[sizeof c->req.origin + 64], head[2048], length[64] = "";
    cors_headers(c, cors, sizeof cors);
    if (content_type)
        snprintf(length, sizeof length, "Content-Length: %zu\r\n", len);
    const char *extra = extra_headers ? extra_headers : "";
    int n = snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\n%s%s%s%s%s%s%s\r\n", status,
                     status_text(status), content_type ? "Content-Type: " : "",
                     content_type ? content_type : "", content_type ? "\r\n" : "", length, extra,
                     cors, keep || strstr(extra, "Connection:") ? "" : "Connection: close\r\n");
    if (n < 0 || (size_t)n >= sizeof head) {
        srv_http_abort(c); /* cannot happen: the callers' headers are short */
        return;
    }
    count_status(c->s, status);
    send_bytes(c, head, (size_t)n);
}

/* A whole response; body_owned: body is c's to free, and is written
 * without a copy (a large answer is not held twice). */
static void respond(srv_conn *c, int status, const char *content_type, char *body, size_t len,
                    bool body_owned, const char *extra_headers)
{
    if (ended(c) && !c->sink) {
        if (body_owned)
            free(body);
        return;
    }
    /* a request refused while it was being read never completed, so its
     * keep_alive is false: those (400 malformed, 408, 413, 431) close */
    bool keep = c->req.keep_alive && !c->s->draining && !c->refused;
    send_head(c, status, content_type, len, extra_headers, keep);
    if (c->req.method == HTTP_HEAD) { /* HEAD: the headers alone, or the framing breaks */
        if (body_owned)
            free(body);
    } else if (body_owned) {
        send_owned(c, body, len);
    } else {
        send_bytes(c, body, len);
    }
    if (c->phase == SRV_CONN_ANSWERING)
        response_done(c, keep);
}

void srv_http_respond(srv_conn *c, int status, const char *content_type, const char *body,
                      size_t len, const char *extra_headers)
{
    respond(c, status, content_type, (char *)body, len, false, extra_headers);
}

void srv_http_respond_empty(srv_conn *c, int status, const char *extra_headers)
{
    if (ended(c) && !c->sink)
        return;
    bool keep = c->req.keep_alive && !c->s->draining && !c->refused;
    send_head(c, status, NULL, 0, extra_headers, keep);
    if (c->phase == SRV_CONN_ANSWERING)
        response_done(c, keep);
}

void srv_http_respond_json(srv_conn *c, int status, const char *json)
{
    srv_http_respond(c, status, "application/json", json, strlen(json), NULL);
}

void srv_http_respond_json_owned(srv_conn *c, int status, char *json)
{
    respond(c, status, "application/json", json, strlen(json), true, NULL);
}

/* Anthropic's error type for a status (its API's errors page: 400
 * invalid_request_error, 401 authentication_error, 403 permission_error,
 * 404 not_found_error, 413 request_too_large, 429 rate_limit_error, 529
 * overloaded_error, 500 api_error); our 503 (busy, loading, short of
 * memory) is its overloaded_error, kept at 503 so that HTTP's meaning of
 * the status (and Retry-After) holds for every client. */
static const char *anthropic_type(int status)
{
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503:
    case 529: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

char *srv_http_error_json(const srv_conn *c, int status, const char *type, const char *message)
{
    /* the message may hold anything a client sent: escape it through cJSON */
    cJSON *root = cJSON_CreateObject();
    bool anthropic = c->req.error_shape == SRV_ERRORS_ANTHROPIC;
    if (anthropic)
        cJSON_AddStringToObject(root, "type", "error");
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "type", anthropic ? anthropic_type(status) : type);
    cJSON_AddStringToObject(err, "message", message);
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return text;
}

void srv_http_respond_error(srv_conn *c, int status, const char *type, const char *message,
                            const char *extra_headers)
{
    char *text = srv_http_error_json(c, status, type, message);
    if (!text) {
        srv_http_close(c);
        return;
    }
    srv_http_respond(c, status, "application/json", text, strlen(text), extra_headers);
    free(text);
}

void srv_http_stream_begin(srv_conn *c)
{
    char cors[sizeof c->req.origin + 64], head[512];
    cors_headers(c, cors, sizeof cors);
    /* HTTP/1.0 knows no chunked encoding: the stream ends with the connection */
    int n =
        snprintf(head, sizeof head,
                 "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 "Cache-Control: no-cache\r\n%s%s\r\n",
                 c->req.http10 ? "Connection: close\r\n" : "Transfer-Encoding: chunked\r\n", cors);
    count_status(c->s, 200);
    send_bytes(c, head, (size_t)n);
}

/* One chunk of the chunked body. */
static void send_chunk(srv_conn *c, const char *a, size_t alen, const char *b, size_t blen,
                       const char *tail, size_t tlen)
{
    char size[32];
    int n = snprintf(size, sizeof size, "%zx\r\n", alen + blen + tlen);
    size_t total = (size_t)n + alen + blen + tlen + 2;
    char *buf = malloc(total);
    if (!buf) {
        srv_http_close(c);
        return;
    }
    memcpy(buf, size, (size_t)n);
    memcpy(buf + n, a, alen);
    memcpy(buf + n + alen, b, blen);
    memcpy(buf + n + alen + blen, tail, tlen);
    memcpy(buf + total - 2, "\r\n", 2);
    send_bytes(c, buf, total);
    free(buf);
}

void srv_http_stream_event(srv_conn *c, const char *data, size_t len)
{
    srv_http_stream_named_event(c, NULL, data, len);
}

void srv_http_stream_named_event(srv_conn *c, const char *event, const char *data, size_t len)
{
    if (ended(c) && !c->sink)
        return;
    char head[80]; /* "event: NAME\ndata: " (names are this server's literals) */
    int n = snprintf(head, sizeof head, "%s%s%sdata: ", event ? "event: " : "", event ? event : "",
                     event ? "\n" : "");
    size_t hl = n > 0 && (size_t)n < sizeof head ? (size_t)n : 0;
    if (c->req.http10) {
        send_bytes(c, head, hl);
        send_bytes(c, data, len);
        send_bytes(c, "\n\n", 2);
    } else {
        send_chunk(c, head, hl, data, len, "\n\n", 2);
    }
    if (srv_http_backlog(c) > SLOW_READER_BYTES)
        srv_http_abort(c); /* it does not read what it asked for */
}

void srv_http_stream_end(srv_conn *c)
{
    if (ended(c) && !c->sink)
        return;
    bool http10 = c->req.http10;
    if (!http10)
        send_bytes(c, "0\r\n\r\n", 5);
    if (c->phase == SRV_CONN_ANSWERING)
        response_done(c, !http10);
}

/* --- detached connections (the fuzz target) ----------------------------------- */

void srv_http_init_sink(srv_server *s, srv_conn *c)
{
    /* the caller sets sink and sink_data */
    c->s = s;
    c->serial = ++s->next_serial;
    llhttp_init(&c->parser, HTTP_REQUEST, &s->http_settings);
    c->parser.data = c;
    c->loopback = true;
}

void srv_conn_release_detached(srv_conn *c)
{
    conn_end(c, false); /* a sink's: only what waits on c lets go */
    request_reset(c);
    free(c->pending);
    c->pending = NULL;
}

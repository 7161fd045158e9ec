/*
 * http_client.h - the smallest HTTP/1.1 client the server's end-to-end
 * tests need, on plain POSIX sockets (libcurl is not a dependency): write
 * raw bytes or a request, read a response whose body has a Content-Length
 * or is chunked, and take a server-sent event stream one `data:` event at
 * a time.
 *
 * One hc_conn is one TCP connection to 127.0.0.1 with its read buffer, so
 * bytes of a pipelined second response that arrive with the first stay for
 * the next read. Every read waits at most HC_READ_TIMEOUT_S, so a server
 * that stops answering fails the test instead of hanging it.
 *
 *   hc_conn c;
 *   hc_open(&c, port);
 *   hc_send_request(&c, "POST", "/generate", NULL, "{\"inputs\": \"hi\"}");
 *   hc_response r;
 *   hc_read_response(&c, &r);       r.status, r.body, hc_header(&r, ...)
 *   hc_response_free(&r);
 *   hc_close(&c);
 */
#ifndef QL_HTTP_CLIENT_H
#define QL_HTTP_CLIENT_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

/* longer than any answer the tests wait for, shorter than their timeout */
#define HC_READ_TIMEOUT_S 120

typedef struct hc_conn {
    int fd;
    char *buf; /* read but not yet taken */
    size_t len, cap;
    bool eof; /* the server closed its side */
} hc_conn;

typedef struct hc_response {
    int status;
    char *head; /* the status line and headers, up to the blank line */
    char *body; /* the (de-chunked) body read so far, NUL-terminated */
    size_t body_len;
    bool chunked;
    long long content_length; /* -1: none */
    bool body_done;           /* the whole body has been read */
    size_t event_pos;         /* server-sent events: where the next one begins in body */
} hc_response;

/* Connect to 127.0.0.1:port; -1 with errno on failure. */
static inline int hc_connect_fd(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    struct timeval tv = {.tv_sec = HC_READ_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* Open c on port; false (c->fd -1) when the connection is refused. */
static inline bool hc_open(hc_conn *c, int port)
{
    memset(c, 0, sizeof *c);
    c->fd = hc_connect_fd(port);
    return c->fd >= 0;
}

static inline void hc_close(hc_conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    free(c->buf);
    c->buf = NULL;
    c->len = c->cap = 0;
}

static inline bool hc_send(hc_conn *c, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        data += n;
        len -= (size_t)n;
    }
    return true;
}

static inline bool hc_send_str(hc_conn *c, const char *text)
{
    return hc_send(c, text, strlen(text));
}

/* A request with a Content-Length body (body NULL: none). extra_headers:
 * whole lines ("Authorization: Bearer x\r\n") or NULL. A body, and any
 * POST, goes as Content-Type: application/json, as an admin request
 * without a token must (server/admin.c). */
static inline bool hc_send_request(hc_conn *c, const char *method, const char *path,
                                   const char *extra_headers, const char *body)
{
    size_t blen = body ? strlen(body) : 0;
    size_t cap = 512 + strlen(path) + (extra_headers ? strlen(extra_headers) : 0) + blen;
    char *req = malloc(cap);
    if (!req)
        return false;
    int n =
        snprintf(req, cap, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%s%s", method, path,
                 extra_headers ? extra_headers : "",
                 body || strcmp(method, "POST") == 0 ? "Content-Type: application/json\r\n" : "");
    if (body)
        n += snprintf(req + n, cap - (size_t)n, "Content-Length: %zu\r\n", blen);
    n += snprintf(req + n, cap - (size_t)n, "\r\n");
    memcpy(req + n, body ? body : "", blen);
    bool ok = hc_send(c, req, (size_t)n + blen);
    free(req);
    return ok;
}

/* Read more bytes into c's buffer: how many (0 at EOF, -1 on an error or
 * the read timeout). */
static inline ssize_t hc_fill(hc_conn *c)
{
    if (c->cap - c->len < 4096) {
        size_t cap = c->cap ? 2 * c->cap : 16384;
        char *b = realloc(c->buf, cap);
        if (!b)
            return -1;
        c->buf = b;
        c->cap = cap;
    }
    ssize_t n;
    do
        n = recv(c->fd, c->buf + c->len, c->cap - c->len - 1, 0);
    while (n < 0 && errno == EINTR);
    if (n > 0)
        c->len += (size_t)n;
    if (n == 0)
        c->eof = true;
    c->buf[c->len] = 0;
    return n;
}

/* Take the first n buffered bytes out of c into out (allocated,
 * NUL-terminated; NULL: drop them). */
static inline void hc_take(hc_conn *c, size_t n, char **out)
{
    if (out) {
        *out = malloc(n + 1);
        if (n)
            memcpy(*out, c->buf, n);
        (*out)[n] = 0;
    }
    if (!c->buf)
        return;
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
    c->buf[c->len] = 0;
}

/* Where delim first occurs in c's buffer; -1: not yet. */
static inline long hc_find(const hc_conn *c, const char *delim)
{
    size_t dl = strlen(delim);
    for (size_t i = 0; i + dl <= c->len; i++)
        if (memcmp(c->buf + i, delim, dl) == 0)
            return (long)i;
    return -1;
}

/* The bytes up to and including the first occurrence of delim, waiting for
 * them; false at EOF or timeout first. */
static inline bool hc_until(hc_conn *c, const char *delim, char **out)
{
    for (;;) {
        long at = hc_find(c, delim);
        if (at >= 0) {
            hc_take(c, (size_t)at + strlen(delim), out);
            return true;
        }
        if (hc_fill(c) <= 0)
            return false;
    }
}

/* Exactly n bytes; false at EOF or timeout first. */
static inline bool hc_exactly(hc_conn *c, size_t n, char **out)
{
    while (c->len < n)
        if (hc_fill(c) <= 0)
            return false;
    hc_take(c, n, out);
    return true;
}

/* The value of header name in r (its first occurrence), copied into out;
 * false when absent. */
static inline bool hc_header(const hc_response *r, const char *name, char *out, size_t out_len)
{
    size_t nl = strlen(name);
    const char *line = r->head ? strstr(r->head, "\r\n") : NULL;
    while (line && line[2]) {
        line += 2;
        if (strncasecmp(line, name, nl) == 0 && line[nl] == ':') {
            const char *v = line + nl + 1;
            while (*v == ' ' || *v == '\t')
                v++;
            size_t vl = strcspn(v, "\r\n");
            if (vl >= out_len)
                vl = out_len - 1;
            memcpy(out, v, vl);
            out[vl] = 0;
            return true;
        }
        line = strstr(line, "\r\n");
    }
    return false;
}

static inline void hc_response_free(hc_response *r)
{
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof *r);
}

static inline void hc_body_append(hc_response *r, const char *data, size_t len)
{
    char *b = realloc(r->body, r->body_len + len + 1);
    if (!b)
        abort();
    memcpy(b + r->body_len, data, len);
    r->body = b;
    r->body_len += len;
    b[r->body_len] = 0;
}

/* The status line and headers. */
static inline bool hc_read_head(hc_conn *c, hc_response *r)
{
    memset(r, 0, sizeof *r);
    r->content_length = -1;
    hc_body_append(r, "", 0);
    if (!hc_until(c, "\r\n\r\n", &r->head))
        return false;
    if (sscanf(r->head, "HTTP/1.%*d %d", &r->status) != 1)
        return false;
    char v[64];
    if (hc_header(r, "Transfer-Encoding", v, sizeof v))
        r->chunked = strcasecmp(v, "chunked") == 0;
    if (hc_header(r, "Content-Length", v, sizeof v))
        r->content_length = atoll(v);
    if (!r->chunked && r->content_length <= 0)
        r->body_done = true;
    return true;
}

/* One chunk of a chunked body appended to r->body: its size (0: the last
 * chunk, r->body_done), -1 on a framing error, EOF or timeout. */
static inline long long hc_read_chunk(hc_conn *c, hc_response *r)
{
    char *line = NULL;
    if (!hc_until(c, "\r\n", &line))
        return -1;
    char *end = NULL;
    long long n = strtoll(line, &end, 16);
    bool bad = end == line || n < 0;
    free(line);
    if (bad)
        return -1;
    if (n == 0) {
        if (!hc_until(c, "\r\n", NULL)) /* no trailers: the blank line */
            return -1;
        r->body_done = true;
        return 0;
    }
    char *data = NULL;
    if (!hc_exactly(c, (size_t)n, &data))
        return -1;
    hc_body_append(r, data, (size_t)n);
    free(data);
    char *crlf = NULL;
    if (!hc_exactly(c, 2, &crlf))
        return -1;
    bool ok = memcmp(crlf, "\r\n", 2) == 0;
    free(crlf);
    return ok ? n : -1;
}

/* The rest of the body. */
static inline bool hc_read_body(hc_conn *c, hc_response *r)
{
    if (r->chunked) {
        while (!r->body_done)
            if (hc_read_chunk(c, r) < 0)
                return false;
        return true;
    }
    if (r->body_done)
        return true;
    char *data = NULL;
    if (!hc_exactly(c, (size_t)r->content_length, &data))
        return false;
    hc_body_append(r, data, (size_t)r->content_length);
    free(data);
    r->body_done = true;
    return true;
}

static inline bool hc_read_response(hc_conn *c, hc_response *r)
{
    return hc_read_head(c, r) && hc_read_body(c, r);
}

/*
 * The next server-sent event's data (after "data: ", allocated), reading
 * chunks as needed; NULL once the stream has ended (r->body_done) or on an
 * error. Events are "data: ...\n\n".
 */
static inline char *hc_next_event(hc_conn *c, hc_response *r)
{
    for (;;) {
        char *start = r->body + r->event_pos;
        char *end = strstr(start, "\n\n");
        if (end) {
            r->event_pos = (size_t)(end + 2 - r->body);
            if (strncmp(start, "data: ", 6) != 0)
                return NULL;
            size_t n = (size_t)(end - start) - 6;
            char *ev = malloc(n + 1);
            memcpy(ev, start + 6, n);
            ev[n] = 0;
            return ev;
        }
        if (r->body_done || hc_read_chunk(c, r) < 0)
            return NULL;
    }
}

/* Whether the server closes the connection (reads and drops anything it
 * still sends, until EOF or the read timeout). */
static inline bool hc_closed_by_server(hc_conn *c)
{
    for (;;) {
        ssize_t n = hc_fill(c);
        if (n == 0)
            return true;
        if (n < 0)
            return errno == ECONNRESET;
        hc_take(c, c->len, NULL);
    }
}

/* One request on a fresh connection (Connection: close); the whole
 * response in *r. False when the connection or the response failed. */
static inline bool hc_request(int port, const char *method, const char *path,
                              const char *extra_headers, const char *body, hc_response *r)
{
    hc_conn c;
    memset(r, 0, sizeof *r);
    if (!hc_open(&c, port))
        return false;
    char headers[2048];
    snprintf(headers, sizeof headers, "Connection: close\r\n%s",
             extra_headers ? extra_headers : "");
    bool ok = hc_send_request(&c, method, path, headers, body) && hc_read_response(&c, r);
    hc_close(&c);
    return ok;
}

#endif

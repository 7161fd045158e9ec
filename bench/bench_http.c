/*
 * bench_http.c - what `qlserve serve` answers over HTTP, as JSON.
 *
 * The server: `qlserve serve --model M --port 0 --threads N` started as a
 * child (its port read from its "listening on" line, then GET /health
 * polled until the model serves; SIGTERM at the end, its exit status
 * reported), or one already running (--url).
 *
 * The client: ours, one thread and epoll, C connections each sending one
 * request at a time on a keep-alive connection (no pipelining), so
 * latency is request written to response read, and requests/s is what C
 * clients in a closed loop get. Client and server share the machine.
 *
 * Figures:
 *   - GET /health and a 1-token POST /generate under --connections (64)
 *     keep-alive connections for --seconds each: requests/s, latency
 *     p50/p99/mean/max;
 *   - --streams (32) concurrent POST /generate_stream of --stream-tokens
 *     (32) new tokens each, --stream-rounds (2) after one another on each
 *     connection: time to first token (request written to first token
 *     event) and inter-token latency (between two token events of one
 *     stream), p50/p99, and the tokens/s all streams together got;
 *   - the peer: when `wrk` (Debian's wrk) is on PATH, wrk on GET /health
 *     with the same connections and duration, its requests/s and latency
 *     p50/p99 beside ours.
 *
 * Usage: bench_http [--model PATH] [--threads N] [--binary QLSERVE]
 *                   [--url http://HOST:PORT] [--connections C] [--seconds S]
 *                   [--streams S] [--stream-tokens T] [--stream-rounds R]
 *                   [--wrk-threads N] [-- extra qlserve serve flags...]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef QL_BINARY
#define QL_BINARY "build/qlserve"
#endif

/* the prompt of the streams: greedy decoding of the default model goes on
 * past 40 tokens from it (measured), so streams run to their token count
 * rather than ending at EOS */
#define STREAM_PROMPT "Once upon a time, in a small village,"

#include "bench_server.h"

/* The string value of "key" in a flat JSON object, into out ("" if none). */
static void json_field(const char *json, const char *key, char *out, size_t out_len)
{
    out[0] = 0;
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = json ? strstr(json, pat) : NULL;
    if (!p)
        return;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    size_t n = 0;
    if (*p == '"') {
        for (p++; *p && *p != '"' && n + 1 < out_len; p++)
            out[n++] = *p;
    } else {
        for (; *p && *p != ',' && *p != '}' && n + 1 < out_len; p++)
            out[n++] = *p;
    }
    out[n] = 0;
}

/* --- the load: C connections, one request at a time each ----------------------- */

typedef struct phase {
    const char *request; /* the bytes of one request */
    size_t request_len;
    bool stream;     /* the answer is an event stream (chunked) */
    double t_end;    /* no request starts after this (0: rounds decides) */
    int rounds;      /* requests per connection when t_end is 0 */
    samples latency; /* request written to response read */
    samples ttft, itl;
    uint64_t ok, errors, tokens, short_streams;
    int stream_tokens;
    double t_first_sent, t_last_done;
} phase;

typedef struct client {
    int fd;
    phase *ph;
    size_t sent;
    char *buf;
    size_t len, cap;
    size_t head_end; /* 0 until the head is in */
    int status;
    long content_length; /* -1: chunked */
    size_t pos;          /* next unread chunk in a chunked body */
    double t_sent, t_last_token;
    int tokens; /* token events of this answer */
    int done_rounds;
    bool open;
} client;

static void client_send(client *c, int ep)
{
    while (c->sent < c->ph->request_len) {
        ssize_t w = write(c->fd, c->ph->request + c->sent, c->ph->request_len - c->sent);
        if (w < 0 && errno == EAGAIN)
            break;
        if (w <= 0) {
            c->ph->errors++;
            c->open = false;
            return;
        }
        c->sent += (size_t)w;
    }
    struct epoll_event ev = {.events = EPOLLIN | (c->sent < c->ph->request_len ? EPOLLOUT : 0),
                             .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static void client_start(client *c, int ep)
{
    c->sent = 0;
    c->len = 0;
    c->head_end = 0;
    c->status = 0;
    c->pos = 0;
    c->tokens = 0;
    c->t_sent = now();
    if (c->ph->t_first_sent == 0)
        c->ph->t_first_sent = c->t_sent;
    client_send(c, ep);
}

/* Case-insensitive: the value of name in the head buf[0, head_end), or NULL. */
static const char *head_value(const client *c, const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; i + n + 3 < c->head_end; i++)
        if (c->buf[i] == '\n' && strncasecmp(c->buf + i + 1, name, n) == 0 &&
            c->buf[i + 1 + n] == ':')
            return c->buf + i + 1 + n + 1;
    return NULL;
}

/* One event of a stream arrived (a chunk: "data: {...}\n\n"). */
static void on_event(client *c, const char *data, size_t len, double t)
{
    /* token events carry "generated_text":null; the last one the text */
    if (!memmem(data, len, "\"generated_text\":null", 21))
        return;
    if (c->tokens == 0)
        sample_add(&c->ph->ttft, t - c->t_sent);
    else
        sample_add(&c->ph->itl, t - c->t_last_token);
    c->t_last_token = t;
    c->tokens++;
    c->ph->tokens++;
}

/* Whether the answer in c->buf is complete (events handled on the way). */
static bool answer_complete(client *c, double t)
{
    if (!c->head_end) {
        char *end = memmem(c->buf, c->len, "\r\n\r\n", 4);
        if (!end)
            return false;
        c->head_end = (size_t)(end - c->buf) + 4;
        if (sscanf(c->buf, "HTTP/1.%*d %d", &c->status) != 1)
            c->status = 0;
        const char *cl = head_value(c, "Content-Length");
        const char *te = head_value(c, "Transfer-Encoding");
        c->content_length = cl ? atol(cl) : (te && strstr(te, "chunked")) ? -1 : 0;
        c->pos = c->head_end;
    }
    if (c->content_length >= 0)
        return c->len >= c->head_end + (size_t)c->content_length;
    for (;;) {
        char *nl = memmem(c->buf + c->pos, c->len - c->pos, "\r\n", 2);
        if (!nl)
            return false;
        size_t size = strtoul(c->buf + c->pos, NULL, 16);
        size_t data_at = (size_t)(nl - c->buf) + 2;
        if (c->len < data_at + size + 2)
            return false;
        if (size == 0)
            return true;
        on_event(c, c->buf + data_at, size, t);
        c->pos = data_at + size + 2;
    }
}

static void client_read(client *c, int ep)
{
    for (;;) {
        if (c->cap - c->len < 16384) {
            c->cap = c->cap ? 2 * c->cap : 65536;
            c->buf = realloc(c->buf, c->cap);
            if (!c->buf)
                die("out of memory", NULL);
        }
        ssize_t r = read(c->fd, c->buf + c->len, c->cap - c->len);
        if (r < 0 && errno == EAGAIN)
            return;
        if (r <= 0) {
            c->ph->errors++; /* the server closed a keep-alive connection */
            c->open = false;
            return;
        }
        c->len += (size_t)r;
        double t = now();
        if (!answer_complete(c, t))
            continue;
        phase *ph = c->ph;
        sample_add(&ph->latency, t - c->t_sent);
        ph->t_last_done = t;
        if (c->status == 200)
            ph->ok++;
        else
            ph->errors++;
        if (ph->stream && c->tokens < ph->stream_tokens)
            ph->short_streams++; /* ended early (EOS) */
        c->done_rounds++;
        bool more = ph->t_end > 0 ? t < ph->t_end : c->done_rounds < ph->rounds;
        if (!more) {
            c->open = false;
            return;
        }
        client_start(c, ep);
    }
}

/* Run ph on n connections until each has no more requests to send. */
static void run_phase(phase *ph, int n)
{
    int ep = epoll_create1(EPOLL_CLOEXEC);
    client *cs = calloc((size_t)n, sizeof *cs);
    for (int i = 0; i < n; i++) {
        client *c = &cs[i];
        c->ph = ph;
        c->fd = dial();
        if (c->fd < 0)
            die("cannot connect to the server", strerror(errno));
        fcntl(c->fd, F_SETFL, O_NONBLOCK);
        c->open = true;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev);
    }
    for (int i = 0; i < n; i++)
        client_start(&cs[i], ep);
    int open = n;
    struct epoll_event evs[256];
    while (open > 0) {
        int k = epoll_wait(ep, evs, 256, 1000);
        for (int i = 0; i < k; i++) {
            client *c = evs[i].data.ptr;
            if (!c->open)
                continue;
            if (evs[i].events & EPOLLOUT)
                client_send(c, ep);
            if (c->open && (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)))
                client_read(c, ep);
        }
        open = 0;
        for (int i = 0; i < n; i++) {
            if (cs[i].open) {
                open++;
            } else if (cs[i].fd >= 0) {
                epoll_ctl(ep, EPOLL_CTL_DEL, cs[i].fd, NULL);
                close(cs[i].fd);
                cs[i].fd = -1;
            }
        }
    }
    for (int i = 0; i < n; i++)
        free(cs[i].buf);
    free(cs);
    close(ep);
}

static char *request_text(const char *method, const char *path, const char *json, size_t *len)
{
    char *r = NULL;
    int n = asprintf(&r,
                     "%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s",
                     method, path, json ? strlen(json) : 0, json ? json : "");
    if (n < 0)
        die("out of memory", NULL);
    *len = (size_t)n;
    return r;
}

/* Requests/s of method path under n connections for seconds. */
static void bench_route(FILE *out, const char *name, const char *method, const char *path,
                        const char *json, int n, double seconds, bool last)
{
    phase ph = {0};
    char *req = request_text(method, path, json, &ph.request_len);
    ph.request = req;
    ph.t_end = now() + seconds;
    run_phase(&ph, n);
    double span = ph.t_last_done - ph.t_first_sent;
    fprintf(out, "    \"%s\": {\n      \"request\": \"%s %s\",\n", name, method, path);
    if (json) {
        fprintf(out, "      \"body\": ");
        print_json_string(out, json);
        fprintf(out, ",\n");
    }
    fprintf(out,
            "      \"ok\": %llu,\n      \"errors\": %llu,\n      \"seconds\": %.3f,\n"
            "      \"requests_per_s\": %.1f,\n",
            (unsigned long long)ph.ok, (unsigned long long)ph.errors, span,
            span > 0 ? (double)ph.ok / span : 0.0);
    print_ms(out, "latency_ms", &ph.latency, "      ");
    fprintf(out, "\n    }%s\n", last ? "" : ",");
    free(ph.latency.v);
    free(req);
}

static void bench_streams(FILE *out, int n, int tokens, int rounds)
{
    char json[512];
    snprintf(json, sizeof json, "{\"inputs\":\"%s\",\"parameters\":{\"max_new_tokens\":%d}}",
             STREAM_PROMPT, tokens);
    phase ph = {.stream = true, .rounds = rounds, .stream_tokens = tokens};
    char *req = request_text("POST", "/generate_stream", json, &ph.request_len);
    ph.request = req;
    run_phase(&ph, n);
    double span = ph.t_last_done - ph.t_first_sent;
    fprintf(out, "  \"streams\": {\n    \"request\": \"POST /generate_stream\",\n    \"body\": ");
    print_json_string(out, json);
    fprintf(out,
            ",\n    \"concurrent\": %d,\n    \"rounds\": %d,\n    \"ok\": %llu,\n"
            "    \"errors\": %llu,\n    \"ended_before_max_new_tokens\": %llu,\n"
            "    \"tokens\": %llu,\n    \"seconds\": %.3f,\n    \"tokens_per_s\": %.1f,\n",
            n, rounds, (unsigned long long)ph.ok, (unsigned long long)ph.errors,
            (unsigned long long)ph.short_streams, (unsigned long long)ph.tokens, span,
            span > 0 ? (double)ph.tokens / span : 0.0);
    print_ms(out, "time_to_first_token_ms", &ph.ttft, "    ");
    fprintf(out, ",\n");
    print_ms(out, "inter_token_latency_ms", &ph.itl, "    ");
    fprintf(out, ",\n");
    print_ms(out, "stream_ms", &ph.latency, "    ");
    fprintf(out, "\n  },\n");
    free(ph.latency.v);
    free(ph.ttft.v);
    free(ph.itl.v);
    free(req);
}

/* --- the peer: wrk ---------------------------------------------------------------------- */

/* wrk's "1.23ms" / "456.00us" / "1.02s" in milliseconds. */
static double wrk_ms(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (strncmp(end, "us", 2) == 0)
        return v / 1e3;
    if (strncmp(end, "ms", 2) == 0)
        return v;
    if (*end == 's')
        return v * 1e3;
    if (*end == 'm')
        return v * 60e3;
    return v;
}

static bool have_wrk(void)
{
    return system("command -v wrk >/dev/null 2>&1") == 0;
}

static void bench_wrk(FILE *out, int connections, int threads, double seconds)
{
    if (!have_wrk()) {
        fprintf(out, "  \"wrk\": null,\n");
        return;
    }
    char cmd[512];
    char host[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &server_addr.sin_addr, host, sizeof host);
    snprintf(cmd, sizeof cmd, "wrk -t%d -c%d -d%ds --latency http://%s:%d/health 2>&1", threads,
             connections, (int)(seconds + 0.5), host, ntohs(server_addr.sin_port));
    FILE *p = popen(cmd, "r");
    if (!p) {
        fprintf(out, "  \"wrk\": null,\n");
        return;
    }
    char line[512], version[128] = "";
    double rps = 0, p50 = 0, p99 = 0;
    long long requests = 0, non2xx = 0;
    while (fgets(line, sizeof line, p)) {
        char v[64];
        const char *t = line;
        while (isspace((unsigned char)*t))
            t++;
        if (sscanf(t, "Requests/sec: %lf", &rps) == 1)
            continue;
        if (sscanf(t, "50%% %63s", v) == 1)
            p50 = wrk_ms(v);
        else if (sscanf(t, "99%% %63s", v) == 1)
            p99 = wrk_ms(v);
        else if (sscanf(t, "%lld requests in", &requests) == 1)
            continue;
        else if (sscanf(t, "Non-2xx or 3xx responses: %lld", &non2xx) == 1)
            continue;
    }
    pclose(p);
    FILE *vp = popen("wrk --version 2>&1 | head -1", "r");
    if (vp) {
        if (fgets(version, sizeof version, vp))
            version[strcspn(version, "\n")] = 0;
        pclose(vp);
    }
    fprintf(out, "  \"wrk\": {\n    \"version\": ");
    print_json_string(out, version);
    fprintf(out,
            ",\n    \"command\": \"wrk -t%d -c%d -d%ds --latency /health\",\n"
            "    \"health\": {\"requests\": %lld, \"non_2xx\": %lld, \"requests_per_s\": %.1f, "
            "\"latency_ms\": {\"p50\": %.3f, \"p99\": %.3f}}\n  },\n",
            threads, connections, (int)(seconds + 0.5), requests, non2xx, rps, p50, p99);
}

/* --- main -------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    char default_model[1024];
    test_default_model_path(default_model, sizeof default_model);
    const char *model = default_model, *binary = QL_BINARY, *url = NULL;
    int threads = 0, connections = 64, streams = 32, stream_tokens = 32, rounds = 2;
    int wrk_threads = 2;
    double seconds = 5;
    char **extra = NULL;
    int n_extra = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) {
            extra = argv + i + 1;
            n_extra = argc - i - 1;
            break;
        }
        if (i + 1 >= argc)
            die("a value is missing after", argv[i]);
        const char *v = argv[++i];
        if (!strcmp(argv[i - 1], "--model"))
            model = v;
        else if (!strcmp(argv[i - 1], "--binary"))
            binary = v;
        else if (!strcmp(argv[i - 1], "--url"))
            url = v;
        else if (!strcmp(argv[i - 1], "--threads"))
            threads = atoi(v);
        else if (!strcmp(argv[i - 1], "--connections"))
            connections = atoi(v);
        else if (!strcmp(argv[i - 1], "--seconds"))
            seconds = atof(v);
        else if (!strcmp(argv[i - 1], "--streams"))
            streams = atoi(v);
        else if (!strcmp(argv[i - 1], "--stream-tokens"))
            stream_tokens = atoi(v);
        else if (!strcmp(argv[i - 1], "--stream-rounds"))
            rounds = atoi(v);
        else if (!strcmp(argv[i - 1], "--wrk-threads"))
            wrk_threads = atoi(v);
        else {
            fprintf(stderr,
                    "usage: bench_http [--model PATH] [--threads N] [--binary QLSERVE] "
                    "[--url http://HOST:PORT] [--connections C] [--seconds S] [--streams S] "
                    "[--stream-tokens T] [--stream-rounds R] [--wrk-threads N] "
                    "[-- qlserve serve flags...]\n");
            return 2;
        }
    }
    if (connections < 1 || streams < 1 || stream_tokens < 1 || rounds < 1 || seconds <= 0)
        die("--connections, --streams, --stream-tokens, --stream-rounds and --seconds must be "
            "positive",
            NULL);
    signal(SIGPIPE, SIG_IGN);

    int port = 0;
    server_addr.sin_family = AF_INET;
    if (url) {
        char host[256];
        if (sscanf(url, "http://%255[^:/]:%d", host, &port) != 2)
            die("--url must be http://HOST:PORT with an IPv4 host", url);
        if (inet_pton(AF_INET, host, &server_addr.sin_addr) != 1)
            die("--url must name an IPv4 address", host);
    } else {
        inet_pton(AF_INET, "127.0.0.1", &server_addr.sin_addr);
        /* room for the load, the one-shot requests and wrk's connections */
        static char *more[64];
        static char conns[16];
        snprintf(conns, sizeof conns, "%d",
                 2 * (connections > streams ? connections : streams) + 16);
        int k = 0;
        more[k++] = "--max-connections";
        more[k++] = conns;
        /* all of it from this one address: no per-address cap */
        more[k++] = "--max-connections-per-peer";
        more[k++] = "0";
        for (int i = 0; i < n_extra && k < 63; i++)
            more[k++] = extra[i];
        port = start_server(binary, model, threads, more, k);
    }
    server_addr.sin_port = htons((uint16_t)port);
    double t_load = now();
    wait_serving(300);
    double load_s = now() - t_load;

    char *info = NULL;
    fetch("GET", "/info", NULL, &info);
    char model_id[256], quant[64], arch[64], kernels[64], activations[16];
    json_field(info, "model_id", model_id, sizeof model_id);
    json_field(info, "quant", quant, sizeof quant);
    json_field(info, "architecture", arch, sizeof arch);
    json_field(info, "cpu_kernels", kernels, sizeof kernels);
    json_field(info, "activations", activations, sizeof activations);
    free(info);
    /* warm up: the first generation pages the weights in */
    const char *one_token = "{\"inputs\":\"Hello\",\"parameters\":{\"max_new_tokens\":1}}";
    if (fetch("POST", "/generate", one_token, NULL) != 200)
        die("a warm-up POST /generate did not answer 200", NULL);

    bench_machine mc = machine_now();
    FILE *out = stdout;
    fprintf(out, "{\n  \"benchmark\": \"http\",\n  \"engine\": \"qlserve\",\n  \"date\": \"%s\",\n",
            mc.date);
    fprintf(out, "  \"machine\": {\"cpu\": ");
    print_json_string(out, mc.cpu);
    fprintf(out, ", \"cores\": %ld, \"kernel\": \"%s\"},\n", sysconf(_SC_NPROCESSORS_ONLN),
            mc.kernel);
    fprintf(out, "  \"server\": {\"started_by_bench\": %s, \"binary\": ", url ? "false" : "true");
    print_json_string(out, url ? "" : binary);
    fprintf(out, ", \"model\": ");
    print_json_string(out, url ? "" : model);
    fprintf(out, ", \"threads\": %d, \"load_seconds\": %.2f, \"model_id\": ", url ? -1 : threads,
            url ? 0.0 : load_s);
    print_json_string(out, model_id);
    fprintf(out, ", \"architecture\": ");
    print_json_string(out, arch);
    fprintf(out, ", \"quant\": ");
    print_json_string(out, quant);
    fprintf(out, ", \"cpu_kernels\": ");
    print_json_string(out, kernels);
    fprintf(out, ", \"activations\": ");
    print_json_string(out, activations);
    fprintf(out, "},\n");
    fprintf(out,
            "  \"inputs\": {\"connections\": %d, \"seconds\": %g, \"streams\": %d, "
            "\"stream_tokens\": %d, \"stream_rounds\": %d},\n",
            connections, seconds, streams, stream_tokens, rounds);
    fprintf(out, "  \"client\": \"bench_http: one thread, epoll, keep-alive, one request in "
                 "flight per connection; on the server's machine\",\n");
    fprintf(out, "  \"keep_alive\": {\n");
    bench_route(out, "health", "GET", "/health", NULL, connections, seconds, false);
    bench_route(out, "generate_1_token", "POST", "/generate", one_token, connections, seconds,
                true);
    fprintf(out, "  },\n");
    bench_streams(out, streams, stream_tokens, rounds);
    bench_wrk(out, connections, wrk_threads, seconds);
    int code = url ? 0 : stop_server();
    fprintf(out, "  \"server_exit\": %d\n}\n", code);
    return code == 0 ? 0 : 1;
}

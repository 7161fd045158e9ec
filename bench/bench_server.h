/*
 * bench_server.h - what the benchmarks that drive `qlserve serve` share:
 * the clock, dying with a message, JSON string output, latency samples
 * and their percentiles, the machine (CPU, date, kernel), and the server
 * as a child process (started with --port 0 and without the caller's
 * QLSERVE_* variables, which would override its flags; its port read from
 * its "listening on" line; GET /health polled until the model serves;
 * SIGTERM at the end and its exit status; killed with its parent), with a
 * one-shot request on a fresh connection (`fetch`). spawn_child starts
 * any other server the same way (bench_serve.c's llama-server). The
 * default model's path is tests/test_util.h's.
 *
 * One server at a time per process: the child, its stderr pipe and its
 * address are this header's globals, for the one program (bench_http.c,
 * soak.c, bench_serve.c) that includes it. The child's stderr stays in a
 * pipe after its listening line: the server writes a few lines there
 * (serving, draining, stopped), never one per request, so the pipe does
 * not fill.
 */
#ifndef QL_BENCH_SERVER_H
#define QL_BENCH_SERVER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h" /* test_default_model_path */

extern char **environ;

static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void die(const char *what, const char *detail)
{
    fprintf(stderr, "%s: %s%s%s\n", program_invocation_short_name, what, detail ? ": " : "",
            detail ? detail : "");
    exit(1);
}

static inline void print_json_string(FILE *out, const char *s)
{
    fputc('"', out);
    for (; s && *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(out, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(out, "\\u%04x", ch);
        else
            fputc(ch, out);
    }
    fputc('"', out);
}

/* --- samples and their percentiles ---------------------------------------------- */

typedef struct samples {
    double *v;
    size_t n, cap;
} samples;

static inline void sample_add(samples *s, double x)
{
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 1024;
        s->v = realloc(s->v, s->cap * sizeof *s->v);
        if (!s->v)
            die("out of memory", NULL);
    }
    s->v[s->n++] = x;
}

static inline int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static inline void samples_sort(samples *s)
{
    if (s->n)
        qsort(s->v, s->n, sizeof *s->v, cmp_double);
}

/* Nearest-rank percentile of s, sorted (samples_sort); 0 when empty. */
static inline double pct(const samples *s, double p)
{
    if (s->n == 0)
        return 0;
    size_t k = (size_t)(p * (double)s->n + 0.999999);
    k = k < 1 ? 1 : k > s->n ? s->n : k;
    return s->v[k - 1];
}

/* {"samples": n, "p50": ..., "p99": ..., "mean": ..., "max": ...} in
 * milliseconds (s in seconds; sorted here). */
static inline void print_ms(FILE *out, const char *name, samples *s, const char *indent)
{
    samples_sort(s);
    double sum = 0;
    for (size_t i = 0; i < s->n; i++)
        sum += s->v[i];
    fprintf(out,
            "%s\"%s\": {\"samples\": %zu, \"p50\": %.3f, \"p99\": %.3f, \"mean\": %.3f, "
            "\"max\": %.3f}",
            indent, name, s->n, 1e3 * pct(s, 0.50), 1e3 * pct(s, 0.99),
            s->n ? 1e3 * sum / (double)s->n : 0.0, s->n ? 1e3 * s->v[s->n - 1] : 0.0);
}

/* --- the server's address and a one-shot request ------------------------------- */

static struct sockaddr_in server_addr;

static inline int dial(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket", strerror(errno));
    if (connect(fd, (struct sockaddr *)&server_addr, sizeof server_addr) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* Send one request with Connection: close and read the whole answer.
 * Returns the status (0: no answer); *body (malloc'ed, NUL-terminated,
 * caller frees) when body is not NULL. */
static inline int fetch(const char *method, const char *path, const char *json, char **body)
{
    if (body)
        *body = NULL;
    int fd = dial();
    if (fd < 0)
        return 0;
    char req[1024];
    int n = snprintf(req, sizeof req,
                     "%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     method, path, json ? strlen(json) : 0, json ? json : "");
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return 0;
    }
    size_t len = 0, cap = 4096;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 1 == cap)
            buf = realloc(buf, cap *= 2);
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    buf[len] = 0;
    int status = 0;
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1)
        status = 0;
    char *start = strstr(buf, "\r\n\r\n");
    if (body && start)
        *body = strdup(start + 4);
    free(buf);
    return status;
}

/* --- the server as a child --------------------------------------------------------- */

static pid_t child = -1;
static int child_stderr = -1;

/* What the server said after its listening line, to our stderr. */
static inline void show_server_stderr(void)
{
    char text[8192];
    ssize_t n = child_stderr >= 0 ? read(child_stderr, text, sizeof text) : 0;
    if (n > 0)
        fprintf(stderr, "%s: the server said:\n%.*s", program_invocation_short_name, (int)n, text);
}

/* A bench that dies leaves no server behind. */
static inline void kill_child(void)
{
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        child = -1;
    }
}

/* Run argv[0] with argv as the child, its stderr on err_fd (1 to /dev/null,
 * without the caller's QLSERVE_* variables); returns once it is forked. */
static inline void spawn_child(char **argv, int err_fd)
{
    static bool kill_at_exit;
    child = fork();
    if (child < 0)
        die("fork", strerror(errno));
    if (child > 0 && !kill_at_exit) {
        atexit(kill_child);
        kill_at_exit = true;
    }
    if (child == 0) {
        /* a benchmark killed by a signal (no atexit) leaves no server behind */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(err_fd, 2);
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0)
            dup2(devnull, 1);
        /* the flags say what is served: QLSERVE_* variables would win over them */
        for (char **e = environ; *e;) {
            if (strncmp(*e, "QLSERVE_", 8) == 0) {
                char name[256];
                snprintf(name, sizeof name, "%.*s", (int)strcspn(*e, "="), *e);
                unsetenv(name);
            } else {
                e++;
            }
        }
        execv(argv[0], argv);
        fprintf(stderr, "%s: cannot run %s: %s\n", program_invocation_short_name, argv[0],
                strerror(errno));
        _exit(127);
    }
}

/* Start `binary serve --model M --port 0 --threads T extra...`; the port. */
static inline int start_server(const char *binary, const char *model, int threads, char **extra,
                               int n_extra)
{
    int errp[2];
    if (pipe2(errp, O_CLOEXEC) != 0)
        die("pipe", strerror(errno));
    char threads_s[16];
    snprintf(threads_s, sizeof threads_s, "%d", threads);
    char **argv = calloc((size_t)n_extra + 16, sizeof *argv);
    int a = 0;
    argv[a++] = (char *)binary;
    argv[a++] = "serve";
    argv[a++] = "--model";
    argv[a++] = (char *)model;
    argv[a++] = "--host";
    argv[a++] = "127.0.0.1";
    argv[a++] = "--port";
    argv[a++] = "0";
    argv[a++] = "--threads";
    argv[a++] = threads_s;
    for (int i = 0; i < n_extra; i++)
        argv[a++] = extra[i];
    argv[a] = NULL;
    spawn_child(argv, errp[1]);
    free(argv);
    close(errp[1]);
    /* "qlserve: listening on http://127.0.0.1:PORT (loading ...)" */
    char line[4096];
    size_t len = 0;
    double deadline = now() + 30;
    for (;;) {
        struct pollfd pfd = {.fd = errp[0], .events = POLLIN};
        if (now() > deadline || poll(&pfd, 1, 1000) < 0)
            die("the server did not say where it listens", NULL);
        if (!(pfd.revents & (POLLIN | POLLHUP)))
            continue;
        ssize_t r = read(errp[0], line + len, sizeof line - 1 - len);
        if (r <= 0) {
            line[len] = 0;
            die("the server exited before listening", line);
        }
        len += (size_t)r;
        line[len] = 0;
        const char *at = strstr(line, "listening on http://");
        const char *nl = at ? strchr(at, '\n') : NULL;
        if (nl) {
            /* the port follows the last ':' before " (loading" */
            const char *end = strstr(at, " (");
            end = end && end < nl ? end : nl;
            const char *p = end;
            while (p > at && *p != ':')
                p--;
            if (*p != ':')
                die("cannot read the port from", at);
            /* the rest of its stderr is a few lines (serving, draining):
             * the pipe holds them until stop_server reads them */
            fcntl(errp[0], F_SETFL, O_NONBLOCK);
            child_stderr = errp[0];
            return atoi(p + 1);
        }
        if (len + 1 >= sizeof line)
            len = 0;
    }
}

/* SIGTERM the child and wait for its drain; its exit status (-1: killed). */
static inline int stop_server(void)
{
    if (child <= 0)
        return 0;
    kill(child, SIGTERM);
    int status = 0, code = -1;
    pid_t r = 0;
    for (double deadline = now() + 60; now() < deadline && r != child;)
        if ((r = waitpid(child, &status, WNOHANG)) != child)
            usleep(20000);
    if (r != child)
        kill_child();
    else if (WIFEXITED(status))
        code = WEXITSTATUS(status);
    child = -1;
    if (code != 0)
        show_server_stderr();
    if (child_stderr >= 0)
        close(child_stderr);
    child_stderr = -1;
    return code;
}

static inline void wait_serving(double timeout_s)
{
    double deadline = now() + timeout_s;
    while (now() < deadline) {
        if (fetch("GET", "/health", NULL, NULL) == 200)
            return;
        if (child > 0 && waitpid(child, NULL, WNOHANG) == child) {
            child = -1;
            show_server_stderr();
            die("the server exited while loading the model", NULL);
        }
        usleep(50000);
    }
    die("the server did not serve in time", NULL);
}

static inline void cpu_name(char *out, size_t len)
{
    snprintf(out, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            const char *v = strchr(line, ':');
            if (v) {
                v++;
                while (*v == ' ')
                    v++;
                snprintf(out, len, "%s", v);
                out[strcspn(out, "\n")] = 0;
            }
            break;
        }
    }
    fclose(f);
}

/* What a benchmark's JSON says of where and when it ran: the CPU's name,
 * the UTC date (ISO 8601) and the kernel ("Linux 6.1.0"). */
typedef struct bench_machine {
    char cpu[256], date[64], kernel[300];
} bench_machine;

static inline bench_machine machine_now(void)
{
    bench_machine m;
    cpu_name(m.cpu, sizeof m.cpu);
    struct utsname un;
    uname(&un);
    snprintf(m.kernel, sizeof m.kernel, "%s %s", un.sysname, un.release);
    time_t tt = time(NULL);
    strftime(m.date, sizeof m.date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&tt));
    return m;
}

#endif

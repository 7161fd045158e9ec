/*
 * server_watch.h - what the hostile-client tests measure of a server
 * process started by server_process.h: its resident memory (VmRSS in
 * /proc/PID/status), a figure of GET /metrics, and the event loop's turns
 * by the CPU time its thread spent in each
 * (qlserve_event_loop_turn_cpu_seconds: the server's own measure, which
 * neither a wait in epoll nor a loaded machine changes, where a round
 * trip's wall time does). SANITIZED and TURN_BOUND say how a sanitizer
 * build is measured.
 */
#ifndef QL_TEST_SERVER_WATCH_H
#define QL_TEST_SERVER_WATCH_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_client.h"
#include "server_process.h"

/* A sanitizer build's server is several times slower, and AddressSanitizer
 * holds freed memory in its quarantine (up to 256 MiB), so its RSS says
 * nothing about what the server keeps: there a loop turn gets a wider bound
 * and RSS is logged, not asserted (the buffered-bytes gauge and the bytes
 * a client manages to send still are). */
#if defined(__SANITIZE_ADDRESS__)
#define SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SANITIZED 1
#endif
#endif
#ifndef SANITIZED
#define SANITIZED 0
#endif
/* The most CPU one turn of the event loop may take, in seconds: a bucket
 * bound of qlserve_event_loop_turn_cpu_seconds. A turn that answers one
 * request per connection takes microseconds; a hostile input handled on
 * the loop takes seconds. */
#if SANITIZED
#define TURN_BOUND "0.25"
#else
#define TURN_BOUND "0.05"
#endif

/* The server's resident memory in KiB. */
static inline long rss_kib(void)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)sp.pid);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s", path);
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

/* The value of the line `name` (labels included) in a /metrics text. */
static inline double metric_in(const char *text, const char *name)
{
    char key[160];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *at = strstr(text, key);
    cr_assert(at, "no %s in /metrics", name);
    return atof(at + strlen(key));
}

/* A gauge's value from GET /metrics. */
static inline double gauge(const char *name)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/metrics", NULL, NULL, &r));
    cr_assert_eq(r.status, 200);
    double v = metric_in(r.body, name);
    hc_response_free(&r);
    return v;
}

/* The turns of the event loop so far that took its thread more than
 * TURN_BOUND seconds of CPU, and the longest turn so far (one scrape). */
static inline double slow_loop_turns(double *longest)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/metrics", NULL, NULL, &r));
    cr_assert_eq(r.status, 200);
    double all = metric_in(r.body, "qlserve_event_loop_turn_cpu_seconds_count");
    double quick =
        metric_in(r.body, "qlserve_event_loop_turn_cpu_seconds_bucket{le=\"" TURN_BOUND "\"}");
    if (longest)
        *longest = metric_in(r.body, "qlserve_event_loop_turn_cpu_seconds_max");
    hc_response_free(&r);
    return all - quick;
}

/* No turn of the event loop since slow_loop_turns said `before` took more
 * than TURN_BOUND seconds of CPU: none held the other clients back. */
static inline void expect_no_slow_turn(double before)
{
    double longest, now = slow_loop_turns(&longest);
    cr_log_info("event loop: the longest turn so far took %.4f s of CPU", longest);
    cr_assert_eq(now, before, "%.0f turns of the event loop took over %s s of CPU (longest %.3f s)",
                 now - before, TURN_BOUND, longest);
}

#endif

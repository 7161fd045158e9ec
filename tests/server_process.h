/*
 * server_process.h - the end-to-end tests' server: the real binary
 * (QL_BINARY) started on a model folder with --port 0 and the
 * environment's QLSERVE_* variables removed, its log captured, waited for
 * until GET /health says 200, stopped with SIGTERM (exit status 0 and no
 * sanitizer report in its log), and the requests the tests make of it.
 * One server per test process at a time (Criterion runs each test in its
 * own process). sp_hold_after holds its engine between two steps
 * (POST /admin/engine/pause), so a test has a request running or waiting
 * for as long as it needs, never for as long as a machine happens to take.
 */
#ifndef QL_TEST_SERVER_PROCESS_H
#define QL_TEST_SERVER_PROCESS_H

#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "http_client.h"
#include "test_util.h"

extern char **environ;

typedef struct sp_server {
    char log_path[600];
    pid_t pid;
    int port;
} sp_server;

static sp_server sp = {.pid = -1};

/* The server's log so far (malloc'd; the caller frees); "" when there is
 * none yet. */
static inline char *sp_read_log(void)
{
    char *text = test_read_file(sp.log_path, NULL);
    return text ? text : strdup("");
}

static inline void sp_kill(void)
{
    if (sp.pid > 0) {
        kill(sp.pid, SIGKILL);
        waitpid(sp.pid, NULL, 0);
        sp.pid = -1;
    }
}

/* The server's default state directory (its journal, a generated admin
 * token) under sp_spawn: $XDG_STATE_HOME/qlserve with XDG_STATE_HOME the
 * folder xdg-state beside log_path, so that no test's server reads or
 * writes the user's own ~/.local/state/qlserve or another test's. */
static inline void sp_state_dir(const char *log_path, char *out, size_t cap)
{
    const char *slash = strrchr(log_path, '/');
    int n = slash ? (int)(slash - log_path) : 1;
    snprintf(out, cap, "%.*s/xdg-state/qlserve", n, slash ? log_path : ".");
}

/* Fork and exec the binary with argv (argv[0] is QL_BINARY), stdout and
 * stderr into log_path, without the caller's QLSERVE_* variables and with
 * XDG_STATE_HOME beside log_path (sp_state_dir). */
static inline void sp_spawn(const char *const *argv, const char *log_path)
{
    snprintf(sp.log_path, sizeof sp.log_path, "%s", log_path);
    static char state_home[640];
    sp_state_dir(log_path, state_home, sizeof state_home);
    *strrchr(state_home, '/') = 0; /* XDG_STATE_HOME: without /qlserve */
    memmove(state_home + strlen("XDG_STATE_HOME="), state_home, strlen(state_home) + 1);
    memcpy(state_home, "XDG_STATE_HOME=", strlen("XDG_STATE_HOME="));
    size_t n_env = 0;
    while (environ[n_env])
        n_env++;
    char **env = calloc(n_env + 2, sizeof *env);
    cr_assert(env);
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++)
        if (strncmp(environ[i], "QLSERVE_", 8) != 0 && strncmp(environ[i], "XDG_STATE_HOME=", 15))
            env[k++] = environ[i];
    env[k] = state_home;
    /* emptied here, not in the child: a restart on the same log must not
     * find the last run's port in it (sp_wait_ready) */
    int log_fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    cr_assert_geq(log_fd, 0, "cannot write %s", log_path);
    fflush(NULL);
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        dup2(log_fd, 1);
        dup2(log_fd, 2);
        execve(QL_BINARY, (char *const *)argv, env);
        _exit(127);
    }
    close(log_fd);
    free(env);
    sp.pid = pid;
}

/* Wait for the port in the log, then for GET /health to say 200. */
static inline void sp_wait_ready(void)
{
    sp.port = 0;
    const char *mark = "listening on http://";
    for (int tries = 0; tries < 2000 && !sp.port; tries++) {
        char *log = sp_read_log();
        const char *at = strstr(log, mark);
        const char *colon = at ? strchr(at + strlen(mark), ' ') : NULL;
        while (colon && colon > at && *colon != ':')
            colon--; /* the port after the address (127.0.0.1, 0.0.0.0) */
        if (colon && *colon == ':')
            sp.port = atoi(colon + 1);
        free(log);
        if (!sp.port) {
            int st;
            cr_assert_eq(waitpid(sp.pid, &st, WNOHANG), 0, "the server exited: %s", sp_read_log());
            test_sleep_ms(10);
        }
    }
    cr_assert_gt(sp.port, 0, "the server did not listen: %s", sp_read_log());
    for (int tries = 0;; tries++) {
        hc_response r;
        bool ok = hc_request(sp.port, "GET", "/health", NULL, NULL, &r);
        int status = r.status;
        hc_response_free(&r);
        if (ok && status == 200)
            break;
        cr_assert(ok && status == 503, "GET /health: %d", status);
        cr_assert_lt(tries, 2000, "the model did not load: %s", sp_read_log());
        test_sleep_ms(10);
    }
}

/* Wait (30 s at most) for a server already told to stop: its exit status,
 * -1 when a signal ended it or it outlived the wait (then it is killed).
 * A test that sent SIGTERM itself waits here: a second SIGTERM could land
 * after the server's drain put its handler away, and end it by signal. */
static inline int sp_wait_exit(void)
{
    cr_assert_gt(sp.pid, 0);
    for (int tries = 0; tries < 3000; tries++) {
        int st;
        if (waitpid(sp.pid, &st, WNOHANG) == sp.pid) {
            sp.pid = -1;
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        test_sleep_ms(10);
    }
    sp_kill();
    return -1;
}

/* Signal the server; its exit status once it exits (-1: killed by a
 * signal, or still running after half a minute, then killed). */
static inline int sp_stop(int sig)
{
    cr_assert_gt(sp.pid, 0);
    kill(sp.pid, sig);
    return sp_wait_exit();
}

/* The server's log holds no sanitizer report (a build with QL_SANITIZE
 * runs the server under AddressSanitizer and UBSan). */
static inline void sp_check_log_clean(void)
{
    char *log = sp_read_log();
    cr_assert_null(strstr(log, "Sanitizer"), "%s", log);
    cr_assert_null(strstr(log, "runtime error"), "%s", log);
    free(log);
}

/* The end of a test: SIGTERM drains the server, it exits 0 and its log
 * holds no sanitizer report. */
static inline void sp_stop_cleanly(void)
{
    int code = sp_stop(SIGTERM);
    cr_assert_eq(code, 0, "exit status %d: %s", code, sp_read_log());
    sp_check_log_clean();
}

/* --- requests ----------------------------------------------------------------- */

/* One request on its own connection (headers and body may be NULL); the
 * whole response (the caller hc_response_free's it). */
static inline hc_response sp_request(const char *method, const char *path, const char *headers,
                                     const char *body)
{
    hc_response r;
    cr_assert(hc_request(sp.port, method, path, headers, body, &r), "%s %s: no response", method,
              path);
    return r;
}

static inline hc_response sp_post(const char *path, const char *body)
{
    return sp_request("POST", path, NULL, body);
}

/* The body of a whole answer (malloc'd), with its status. */
static inline char *sp_answer(const char *path, const char *body, int *status)
{
    hc_response r = sp_post(path, body);
    *status = r.status;
    char *text = strdup(r.body ? r.body : "");
    hc_response_free(&r);
    return text;
}

/* A stream's events' data, in order, read to its end (at most cap); each
 * event is malloc'd. */
static inline int sp_stream_events(const char *path, const char *body, char **events, int cap)
{
    hc_conn c;
    hc_response r = {0};
    cr_assert(hc_open(&c, sp.port));
    cr_assert(hc_send_request(&c, "POST", path, NULL, body));
    cr_assert(hc_read_head(&c, &r), "no response to %s", path);
    cr_assert_eq(r.status, 200, "%s: %d", path, r.status);
    char ct[128];
    cr_assert(hc_header(&r, "Content-Type", ct, sizeof ct));
    cr_assert_str_eq(ct, "text/event-stream");
    int n = 0;
    for (char *ev; (ev = hc_next_event(&c, &r));) {
        cr_assert_lt(n, cap);
        events[n++] = ev;
    }
    cr_assert(r.body_done, "the stream did not end");
    hc_response_free(&r);
    hc_close(&c);
    return n;
}

static inline cJSON *sp_json(const char *text)
{
    cJSON *j = cJSON_Parse(text);
    cr_assert(j, "not JSON: %s", text);
    return j;
}

static inline const char *sp_str_at(const cJSON *obj, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    cr_assert(cJSON_IsString(v), "\"%s\" is not a string", name);
    return v->valuestring;
}

static inline double sp_num_at(const cJSON *obj, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    cr_assert(cJSON_IsNumber(v), "\"%s\" is not a number", name);
    return v->valuedouble;
}

/* --- the engine's step gate: state held, not timed ------------------------------ */

/* What GET /admin/engine says (the caller's to cJSON_Delete); admin_headers
 * carries the admin token where the server has one (else NULL: loopback). */
static inline cJSON *sp_engine_state(const char *admin_headers)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/admin/engine", admin_headers, NULL, &r));
    cr_assert_eq(r.status, 200, "GET /admin/engine: %d %s", r.status, r.body ? r.body : "");
    cJSON *j = sp_json(r.body);
    hc_response_free(&r);
    return j;
}

/* Let the engine run `steps` more steps, then hold it there, and wait
 * until it has settled: what GET /admin/engine then says (running,
 * waiting, steps, tokens_generated) is what it holds. steps < 0 resumes,
 * without waiting. */
static inline void sp_hold_after(int64_t steps, const char *admin_headers)
{
    char body[64];
    snprintf(body, sizeof body, "{\"after_steps\": %lld}", (long long)steps);
    hc_response r;
    cr_assert(hc_request(sp.port, "POST",
                         steps < 0 ? "/admin/engine/resume" : "/admin/engine/pause", admin_headers,
                         steps < 0 ? NULL : body, &r));
    cr_assert_eq(r.status, 200, "pause: %d %s", r.status, r.body ? r.body : "");
    hc_response_free(&r);
    if (steps < 0)
        return;
    for (int i = 0; i < 120000; i++) { /* a bound for a broken gate, not a timing */
        cJSON *st = sp_engine_state(admin_headers);
        bool settled = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(st, "settled"));
        cJSON_Delete(st);
        if (settled)
            return;
        test_sleep_ms(1);
    }
    cr_assert_fail("the engine never settled at its gate");
}

/* A figure of GET /admin/engine (running, waiting, steps, ...). */
static inline double sp_engine_figure(const char *name, const char *admin_headers)
{
    cJSON *st = sp_engine_state(admin_headers);
    double v = sp_num_at(st, name);
    cJSON_Delete(st);
    return v;
}

/* Wait until GET /admin/engine's figure `name` lies in [lo, hi], polling
 * at most `tries` times a millisecond apart (a bound for a broken server,
 * not a timing); fails naming the figure otherwise. */
static inline void sp_engine_until(const char *name, double lo, double hi, int tries,
                                   const char *admin_headers)
{
    double now = sp_engine_figure(name, admin_headers);
    for (int i = 0; i < tries && (now < lo || now > hi); i++) {
        test_sleep_ms(1);
        now = sp_engine_figure(name, admin_headers);
    }
    cr_assert(now >= lo && now <= hi, "the engine's %s never came into [%g, %g] (it is %g)", name,
              lo, hi, now);
}

/* Wait until the figure is at least `want` (a request the server has yet
 * to hand the engine: sp_hold_after settles on what the engine has, not on
 * what is still on its way). */
static inline void sp_engine_reaches(const char *name, double want, const char *admin_headers)
{
    sp_engine_until(name, want, INFINITY, 120000, admin_headers);
}

/* Wait until the figure is at most `want` (a cancel on its way to the
 * engine, as sp_engine_reaches waits for a request). */
static inline void sp_engine_falls_to(const char *name, double want, const char *admin_headers)
{
    sp_engine_until(name, -INFINITY, want, 30000, admin_headers);
}

/* With the engine held, let it run one step at a time until its
 * tokens_generated is at least `tokens`, and hold it there: a stream
 * held just past its first token, whatever the machine's speed. */
static inline void sp_step_until_generated(double tokens, const char *admin_headers)
{
    for (int i = 0; i < 100000 && sp_engine_figure("tokens_generated", admin_headers) < tokens; i++)
        sp_hold_after(1, admin_headers);
    double now = sp_engine_figure("tokens_generated", admin_headers);
    cr_assert_geq(now, tokens, "the engine generated %g tokens, not %g", now, tokens);
}

#endif

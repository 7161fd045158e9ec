/*
 * soak.c - `qlserve serve` (the real binary) held under mixed streaming
 * load for a given time while an admin client merges, unmerges, loads and
 * unloads adapters, and checked: one JSON document on stdout with the
 * inputs, the machine, the figures and pass/fail per check; exit status 1
 * when a check fails, 77 when the model is absent (ctest's skip code; 1
 * under QL_REQUIRE_ALL=1, which CI sets).
 *
 * The setup: three random PEFT adapters for the model (bench/peft_writer.h,
 * delta 5% of each weight so they change greedy answers): soak_a, which
 * the admin client merges and unmerges; soak_b, always loaded; soak_c,
 * which it unloads and loads again. The admin client cycles, one step
 * every --admin-interval seconds: merge soak_a, unload soak_c, unmerge
 * soak_a, load soak_c.
 *
 * The references: before the load, every (route, prompt, adapter asked
 * for, merged state) is asked alone, greedy, with the merged state set by
 * the admin client first. Routes: TGI /generate_stream, OpenAI
 * /v1/completions and /v1/chat/completions (when the model has a chat
 * template), all streamed. Adapters asked for: none, soak_a, soak_b,
 * soak_c. Merged states: nothing, soak_a at scale 1. Whether a request
 * naming no adapter gets the base model's answer exactly while soak_a is
 * merged is measured (base_exact_under_merge), not assumed: by the design
 * it is served as the merged weights minus soak_a applied unmerged, which
 * carries the merge's requantization rounding.
 *
 * The load: --clients threads, each a loop of requests until the duration
 * ends, each request a random route, prompt and adapter, and a random
 * manner: read the whole stream; vanish (close the socket after 1-3
 * events); send the request slowly (1-16 bytes at a time, 10-60 ms
 * apart); or pipeline 2-3 requests on one keep-alive connection. A
 * complete answer must equal the reference of a merged state in force
 * while it ran: the state when it was sent, and every state published
 * before it ended. A merge's publication is known to lie between the admin
 * request's send and --publish-slack seconds after its answer (the engine
 * takes a published version at its next step, which may admit a request
 * that was submitted just after the answer).
 *
 * The process: VmRSS and the fd count from /proc/PID every second; after
 * --warmup seconds, their least-squares slopes (KiB/min, fds/min) against
 * --rss-slope-max and --fd-slope-max, VmRSS's over the samples taken while
 * the server held only its pristine weights (process_slopes says why).
 * At the end: the clients stop, and within --settle seconds /metrics must
 * show no KV blocks in use, nothing queued or running, and no connection
 * but the one asking; then the idle fd count is compared with the one
 * before the load, the server's own response counts are read, and SIGTERM
 * must end it with status 0. Statuses: 5xx other than 503 fail, and so
 * does any 4xx but soak_c's 404 while it is unloaded.
 *
 * Usage: soak [--duration S (120)] [--clients N (12)] [--model PATH]
 *             [--binary QLSERVE] [--seed N (1)] [--threads N (0: all)]
 *             [--prompts 1..4 (2)] [--max-tokens N (16)]
 *             [--admin-interval S (2.5)] [--warmup S (a quarter, <= 60)]
 *             [--settle S (5)] [--rss-slope-max KIB_PER_MIN (2048)]
 *             [--fd-slope-max FDS_PER_MIN (1)] [--publish-slack S (1)]
 *             [--workdir DIR (a temporary one, removed)]
 * --model defaults to the default model as scripts/fetch-model.sh caches
 * it ($QLSERVE_MODEL, $QLSERVE_CACHE or ~/.cache/qlserve); --binary to
 * the qlserve built beside this program.
 */
#include "bench_server.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/stat.h>

#include "http_client.h"
#include "peft_writer.h"

#ifndef QL_BINARY
#define QL_BINARY "build/qlserve"
#endif

enum { ROUTE_TGI, ROUTE_COMPLETIONS, ROUTE_CHAT, N_ROUTES };
static const char *const route_path[N_ROUTES] = {"/generate_stream", "/v1/completions",
                                                 "/v1/chat/completions"};

/* prompts whose greedy answers run on for a while on the default model */
#define MAX_PROMPTS 4
static const char *const prompts[MAX_PROMPTS] = {
    "Once upon a time, in a small village,",
    "The three most important things to know about the ocean are",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a child.",
};

/* adapters asked for: none, then the three the soak writes */
enum { AD_NONE, AD_A, AD_B, AD_C, N_ADAPTERS };
static const char *const adapter_name[N_ADAPTERS] = {NULL, "soak_a", "soak_b", "soak_c"};
static const char *const adapter_dir[N_ADAPTERS] = {NULL, "a", "b", "c"};

/* merged states: nothing, soak_a */
#define N_STATES 2

enum { MANNER_WHOLE, MANNER_VANISH, MANNER_SLOW, MANNER_PIPELINE, N_MANNERS };
static const char *const manner_name[N_MANNERS] = {"whole", "vanish", "slow", "pipeline"};

typedef struct soak_opts {
    double duration, warmup, admin_interval, settle, publish_slack;
    double rss_slope_max, fd_slope_max;
    int clients, threads, n_prompts, max_tokens;
    uint64_t seed;
    const char *model, *binary;
    char workdir[512];
} soak_opts;

static soak_opts opt;
static int port;
static bool have_chat;
/* refs[route][prompt][adapter][state]: the answer alone (NULL: none) */
static char *refs[N_ROUTES][MAX_PROMPTS][N_ADAPTERS][N_STATES];

/* --- what the threads record (under mu) --------------------------------------------- */

typedef struct transition {
    double t_begin, t_end; /* the admin request sent; its answer plus the slack */
    int state;             /* the merged state after it */
} transition;

#define MAX_MISMATCHES 8

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    transition *tr;
    size_t n_tr, cap_tr;
    long long by_status[600]; /* the clients' responses by status (0: none) */
    long long manner[N_MANNERS];
    long long compared, matched, ambiguous, vanished, no_ref;
    long long transport_errors; /* a connection that broke or timed out */
    long long unexpected_4xx;   /* a 4xx but soak_c's 404 while it is unloaded */
    char first_unexpected[160];
    long long admin_ok, admin_failed;
    double longest_drain;     /* after an unmerge, until one version was alive */
    long long drain_timeouts; /* such waits that gave up after a minute */
    long long admin_ops[4];
    char admin_failures[4][512];
    int n_admin_failures;
    cJSON *mismatches;
    uint64_t digest[N_STATES]; /* /admin/state's weights_digest per state (0: not seen) */
    bool digest_stable;
    char digest_text[N_STATES][80];
} rec = {.digest_stable = true};

static double t_end_load;

static int states_in_force(double t0, double t1)
{
    pthread_mutex_lock(&mu);
    int cur = 0;
    size_t i = 0;
    for (; i < rec.n_tr && rec.tr[i].t_end <= t0; i++)
        cur = rec.tr[i].state;
    int mask = 1 << cur;
    for (; i < rec.n_tr; i++)
        if (rec.tr[i].t_begin < t1)
            mask |= 1 << rec.tr[i].state;
    pthread_mutex_unlock(&mu);
    return mask;
}

static void record_transition(double t_begin, double t_end, int state)
{
    pthread_mutex_lock(&mu);
    if (rec.n_tr == rec.cap_tr) {
        rec.cap_tr = rec.cap_tr ? 2 * rec.cap_tr : 256;
        rec.tr = realloc(rec.tr, rec.cap_tr * sizeof *rec.tr);
        if (!rec.tr)
            die("out of memory", NULL);
    }
    rec.tr[rec.n_tr++] = (transition){t_begin, t_end + opt.publish_slack, state};
    pthread_mutex_unlock(&mu);
}

/* --- requests and answers ----------------------------------------------------------- */

/* The bytes of one streamed greedy request (malloc'd, *len set). */
static char *request_bytes(int route, int prompt, int adapter, bool close_after, size_t *len)
{
    cJSON *b = cJSON_CreateObject();
    const char *name = adapter_name[adapter];
    if (route == ROUTE_TGI) {
        cJSON_AddStringToObject(b, "inputs", prompts[prompt]);
        cJSON *p = cJSON_AddObjectToObject(b, "parameters");
        cJSON_AddNumberToObject(p, "max_new_tokens", opt.max_tokens);
        if (name)
            cJSON_AddStringToObject(p, "adapter_id", name);
    } else {
        if (route == ROUTE_COMPLETIONS) {
            cJSON_AddStringToObject(b, "prompt", prompts[prompt]);
        } else {
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "user");
            cJSON_AddStringToObject(m, "content", prompts[prompt]);
            cJSON *ms = cJSON_AddArrayToObject(b, "messages");
            cJSON_AddItemToArray(ms, m);
        }
        if (name)
            cJSON_AddStringToObject(b, "model", name);
        cJSON_AddNumberToObject(b, "max_tokens", opt.max_tokens);
        cJSON_AddNumberToObject(b, "temperature", 0);
        cJSON_AddBoolToObject(b, "stream", true);
    }
    char *body = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    char *req = NULL;
    int n =
        asprintf(&req,
                 "POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n%s\r\n%s",
                 route_path[route], strlen(body), close_after ? "Connection: close\r\n" : "", body);
    free(body);
    if (n < 0)
        die("out of memory", NULL);
    *len = (size_t)n;
    return req;
}

typedef struct answer {
    int status;    /* 0: no response head */
    bool complete; /* the stream ended with its final event */
    bool broken;   /* the connection broke or timed out before the answer ended */
    int events;
    char *text; /* the generated text, accumulated */
} answer;

static void text_append(answer *a, const char *s)
{
    size_t have = a->text ? strlen(a->text) : 0, n = strlen(s);
    a->text = realloc(a->text, have + n + 1);
    if (!a->text)
        die("out of memory", NULL);
    memcpy(a->text + have, s, n + 1);
}

/* One event of route's stream into a; whether it was the last one. */
static bool take_event(int route, const char *data, answer *a)
{
    if (route != ROUTE_TGI && strcmp(data, "[DONE]") == 0)
        return true;
    cJSON *j = cJSON_Parse(data);
    if (!j)
        return false;
    bool last = false;
    if (route == ROUTE_TGI) {
        const cJSON *g = cJSON_GetObjectItemCaseSensitive(j, "generated_text");
        if (cJSON_IsString(g)) {
            free(a->text);
            a->text = strdup(g->valuestring);
            last = true;
        }
    } else {
        const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
        const cJSON *t = route == ROUTE_COMPLETIONS
                             ? cJSON_GetObjectItemCaseSensitive(c0, "text")
                             : cJSON_GetObjectItemCaseSensitive(
                                   cJSON_GetObjectItemCaseSensitive(c0, "delta"), "content");
        if (cJSON_IsString(t))
            text_append(a, t->valuestring);
    }
    cJSON_Delete(j);
    return last;
}

/* Read one answer of route from c; vanish_after > 0: stop after that many
 * events (the caller closes the socket). */
static void read_answer(hc_conn *c, int route, int vanish_after, answer *a)
{
    memset(a, 0, sizeof *a);
    text_append(a, "");
    hc_response r;
    if (!hc_read_head(c, &r)) {
        a->broken = true;
        hc_response_free(&r);
        return;
    }
    a->status = r.status;
    if (r.status != 200) {
        a->broken = !hc_read_body(c, &r);
        hc_response_free(&r);
        return;
    }
    bool ended = false;
    for (char *ev; !ended && (ev = hc_next_event(c, &r));) {
        a->events++;
        ended = take_event(route, ev, a);
        free(ev);
        if (vanish_after > 0 && a->events >= vanish_after && !ended) {
            hc_response_free(&r);
            return;
        }
    }
    /* the TGI stream's last event is its last chunk; OpenAI's is [DONE] */
    while (ended && !r.body_done)
        if (hc_read_chunk(c, &r) < 0)
            break;
    a->complete = ended && r.body_done;
    a->broken = !a->complete; /* cut off, or ended without its last event */
    hc_response_free(&r);
}

/* Count a; compare a complete answer with the references of the merged
 * states in force during [t0, t1]. */
static void record_answer(int route, int prompt, int adapter, double t0, double t1, const answer *a,
                          bool vanished)
{
    int mask = a->complete ? states_in_force(t0, t1) : 0;
    bool any_ref = false, match = false;
    for (int s = 0; s < N_STATES; s++) {
        const char *ref = refs[route][prompt][adapter][s];
        if ((mask >> s & 1) && ref) {
            any_ref = true;
            match = match || strcmp(ref, a->text) == 0;
        }
    }
    pthread_mutex_lock(&mu);
    rec.by_status[a->status >= 0 && a->status < 600 ? a->status : 0]++;
    if (a->status >= 400 && a->status < 500 && !(adapter == AD_C && a->status == 404)) {
        if (!rec.unexpected_4xx++)
            snprintf(rec.first_unexpected, sizeof rec.first_unexpected, "%d on %s naming %s",
                     a->status, route_path[route], adapter ? adapter_name[adapter] : "none");
    }
    if (vanished)
        rec.vanished++;
    else if (a->broken)
        rec.transport_errors++;
    if (a->complete && !vanished) {
        if (!any_ref) {
            rec.no_ref++;
        } else {
            rec.compared++;
            rec.ambiguous += mask == 3;
            if (match) {
                rec.matched++;
            } else if (cJSON_GetArraySize(rec.mismatches) < MAX_MISMATCHES) {
                cJSON *m = cJSON_CreateObject();
                cJSON_AddStringToObject(m, "route", route_path[route]);
                cJSON_AddStringToObject(m, "prompt", prompts[prompt]);
                cJSON_AddStringToObject(m, "adapter", adapter ? adapter_name[adapter] : "none");
                cJSON_AddNumberToObject(m, "merged_states_in_force", mask);
                cJSON_AddStringToObject(m, "answer", a->text);
                for (int s = 0; s < N_STATES; s++)
                    if (mask >> s & 1)
                        cJSON_AddStringToObject(
                            m, s ? "reference_merged" : "reference_unmerged",
                            refs[route][prompt][adapter][s] ? refs[route][prompt][adapter][s] : "");
                cJSON_AddItemToArray(rec.mismatches, m);
            }
        }
    }
    pthread_mutex_unlock(&mu);
}

/* --- the clients ---------------------------------------------------------------------- */

typedef struct client {
    int index;
    uint64_t rng;
    pthread_t thread;
} client;

static int pick(client *c, int n)
{
    return (int)(peft_rng_next(&c->rng) % (uint64_t)n);
}

static int pick_route(client *c)
{
    return pick(c, have_chat ? 3 : 2);
}

static void sleep_s(double s)
{
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* One request on its own connection: read whole, vanish or sent slowly. */
static void one_request(client *c, int manner)
{
    int route = pick_route(c), prompt = pick(c, opt.n_prompts), adapter = pick(c, N_ADAPTERS);
    size_t len;
    char *req = request_bytes(route, prompt, adapter, true, &len);
    hc_conn conn;
    double t0 = now();
    answer a = {0};
    bool vanished = false;
    if (!hc_open(&conn, port)) {
        a.broken = true;
    } else {
        bool sent = true;
        if (manner == MANNER_SLOW) {
            for (size_t at = 0; sent && at < len;) {
                size_t n = 1 + (size_t)pick(c, 16);
                n = n > len - at ? len - at : n;
                sent = hc_send(&conn, req + at, n);
                at += n;
                if (at < len)
                    sleep_s(0.010 + 0.050 * (double)pick(c, 1000) / 1000.0);
            }
        } else {
            sent = hc_send(&conn, req, len);
        }
        if (!sent)
            a.broken = true;
        else
            read_answer(&conn, route, manner == MANNER_VANISH ? 1 + pick(c, 3) : 0, &a);
        vanished = manner == MANNER_VANISH && a.status == 200 && !a.complete && !a.broken;
        hc_close(&conn);
    }
    record_answer(route, prompt, adapter, t0, now(), &a, vanished);
    free(a.text);
    free(req);
}

/* 2-3 requests written at once on one keep-alive connection, read in order. */
static void pipelined(client *c)
{
    int n = 2 + pick(c, 2);
    int route[3], prompt[3], adapter[3];
    char *all = NULL;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        route[i] = pick_route(c);
        prompt[i] = pick(c, opt.n_prompts);
        adapter[i] = pick(c, N_ADAPTERS);
        size_t len;
        char *req = request_bytes(route[i], prompt[i], adapter[i], i == n - 1, &len);
        all = realloc(all, total + len);
        if (!all)
            die("out of memory", NULL);
        memcpy(all + total, req, len);
        total += len;
        free(req);
    }
    hc_conn conn;
    double t0 = now();
    bool ok = hc_open(&conn, port) && hc_send(&conn, all, total);
    for (int i = 0; i < n; i++) {
        answer a = {0};
        if (ok)
            read_answer(&conn, route[i], 0, &a);
        else
            a.broken = true;
        ok = ok && !a.broken;
        record_answer(route[i], prompt[i], adapter[i], t0, now(), &a, false);
        free(a.text);
    }
    if (conn.fd >= 0)
        hc_close(&conn);
    free(all);
}

static void *client_main(void *arg)
{
    client *c = arg;
    while (now() < t_end_load) {
        /* whole 45%, vanish 15%, slow 15%, pipeline 25% */
        int p = pick(c, 100);
        int manner = p < 45   ? MANNER_WHOLE
                     : p < 60 ? MANNER_VANISH
                     : p < 75 ? MANNER_SLOW
                              : MANNER_PIPELINE;
        pthread_mutex_lock(&mu);
        rec.manner[manner]++;
        pthread_mutex_unlock(&mu);
        if (manner == MANNER_PIPELINE)
            pipelined(c);
        else
            one_request(c, manner);
    }
    return NULL;
}

/* --- /metrics ---------------------------------------------------------------------------- */

/* The value of the metric line that starts with name followed by a space
 * (a gauge or a labelled series), or -1. */
static double metric_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, name, n) == 0 && p[n] == ' ')
            return atof(p + n + 1);
    return -1;
}

static char *get_metrics(void)
{
    hc_response r;
    char *text = NULL;
    if (hc_request(port, "GET", "/metrics", NULL, NULL, &r) && r.status == 200)
        text = strdup(r.body);
    hc_response_free(&r);
    return text;
}

/* One weight version alive and no adapter merged (false when /metrics
 * does not answer). */
static bool only_pristine_weights(void)
{
    char *m = get_metrics();
    bool yes = m && metric_value(m, "qlserve_weights_versions_alive") == 1 &&
               metric_value(m, "qlserve_adapters_merged") == 0;
    free(m);
    return yes;
}

/* --- the admin client ------------------------------------------------------------------ */

enum { OP_MERGE, OP_UNLOAD, OP_UNMERGE, OP_LOAD };
static const char *const op_name[4] = {"merge soak_a", "unload soak_c", "unmerge soak_a",
                                       "load soak_c"};

/* One admin request; its status, the body in *body (malloc'd) when asked. */
static int admin(const char *method, const char *path, const char *json, char **body)
{
    hc_response r;
    bool ok = hc_request(port, method, path, NULL, json, &r);
    int status = ok ? r.status : 0;
    if (body)
        *body = strdup(r.body ? r.body : "");
    hc_response_free(&r);
    return status;
}

/* The serving weights' digest (/admin/state) noted for state; a state
 * whose digest changes between visits is not stable. */
static void note_digest(int state)
{
    char *body = NULL;
    if (admin("GET", "/admin/state", NULL, &body) != 200) {
        free(body);
        return;
    }
    cJSON *j = cJSON_Parse(body);
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "weights_digest");
    char text[80] = "";
    if (cJSON_IsString(d))
        snprintf(text, sizeof text, "%s", d->valuestring);
    else if (cJSON_IsNumber(d))
        snprintf(text, sizeof text, "%.0f", d->valuedouble);
    cJSON_Delete(j);
    free(body);
    pthread_mutex_lock(&mu);
    if (!rec.digest_text[state][0])
        snprintf(rec.digest_text[state], sizeof rec.digest_text[state], "%s", text);
    else if (strcmp(rec.digest_text[state], text) != 0)
        rec.digest_stable = false;
    pthread_mutex_unlock(&mu);
}

static bool in_references;

/* After an unmerge: wait (at most a minute) for the merged version to be
 * freed, which it is when the last sequence running on it ends, so the
 * process samples see the server with only its pristine weights. */
static void wait_merged_version_gone(double t_unmerged)
{
    while (!only_pristine_weights() && now() - t_unmerged < 60)
        sleep_s(0.05);
    double waited = now() - t_unmerged;
    pthread_mutex_lock(&mu);
    rec.longest_drain = waited > rec.longest_drain ? waited : rec.longest_drain;
    rec.drain_timeouts += waited >= 60;
    pthread_mutex_unlock(&mu);
}

/* Do op; whether it answered as it should. */
static bool admin_op(int op)
{
    static const int want[4] = {200, 200, 200, 201};
    char path[128], *body = NULL;
    double t0 = now();
    int status;
    switch (op) {
    case OP_MERGE:
        status = admin("POST", "/admin/adapters/soak_a/merge", "{\"scale\": 1.0}", &body);
        break;
    case OP_UNMERGE: status = admin("POST", "/admin/adapters/soak_a/unmerge", NULL, &body); break;
    case OP_UNLOAD: status = admin("DELETE", "/admin/adapters/soak_c", NULL, &body); break;
    default:
        snprintf(path, sizeof path, "{\"name\": \"soak_c\", \"path\": \"c\", \"scale\": 1.0}");
        status = admin("POST", "/admin/adapters", path, &body);
        break;
    }
    double t1 = now();
    bool ok = status == want[op];
    if (ok && (op == OP_MERGE || op == OP_UNMERGE)) {
        record_transition(t0, t1, op == OP_MERGE);
        note_digest(op == OP_MERGE);
    }
    if (ok && op == OP_UNMERGE && !in_references)
        wait_merged_version_gone(t1);
    pthread_mutex_lock(&mu);
    rec.admin_ops[op]++;
    if (ok) {
        rec.admin_ok++;
    } else {
        rec.admin_failed++;
        if (rec.n_admin_failures < 4)
            snprintf(rec.admin_failures[rec.n_admin_failures++], sizeof rec.admin_failures[0],
                     "%s: %d %.400s", op_name[op], status, body ? body : "");
    }
    pthread_mutex_unlock(&mu);
    free(body);
    return ok;
}

static void *admin_main(void *arg)
{
    (void)arg;
    int op = 0;
    for (double next = now() + opt.admin_interval;; next = now() + opt.admin_interval) {
        while (now() < next && now() < t_end_load)
            sleep_s(0.05);
        if (now() >= t_end_load)
            break;
        admin_op(op);
        op = (op + 1) % 4;
    }
    /* leave the state the load began with: nothing merged, soak_c loaded */
    while (op != 0) {
        admin_op(op);
        op = (op + 1) % 4;
    }
    return NULL;
}

/* --- the process: RSS and fds ---------------------------------------------------------- */

typedef struct sample {
    double t, rss_kib, fds;
    /* the server held only its pristine weights: one weight version alive
     * and nothing merged, by /metrics just before and just after */
    bool pristine;
} sample;

static pid_t server_pid;
static sample *samples_v;
static size_t n_samples, cap_samples;
static volatile bool sampling = true;

/* The "VmRSS" (or another field) of /proc/PID/status, KiB; -1 if none. */
static double status_kib(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    double v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':') {
            v = atof(line + n + 1);
            break;
        }
    if (f)
        fclose(f);
    return v;
}

static double rss_kib(pid_t pid)
{
    return status_kib(pid, "VmRSS");
}

static double fd_count(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static void *sampler_main(void *arg)
{
    double t_start = *(double *)arg;
    while (sampling) {
        bool before = only_pristine_weights();
        sample s = {now() - t_start, rss_kib(server_pid), fd_count(server_pid), false};
        s.pristine = before && only_pristine_weights();
        if (n_samples == cap_samples) {
            cap_samples = cap_samples ? 2 * cap_samples : 1024;
            samples_v = realloc(samples_v, cap_samples * sizeof *samples_v);
            if (!samples_v)
                die("out of memory", NULL);
        }
        samples_v[n_samples++] = s;
        sleep_s(1.0);
    }
    return NULL;
}

/* The least-squares slope of v against t (seconds), per minute; 0 with
 * fewer than two points. */
static double slope_per_min(const double *t, const double *v, int n)
{
    double st = 0, sv = 0, stt = 0, stv = 0;
    for (int i = 0; i < n; i++)
        st += t[i], sv += v[i], stt += t[i] * t[i], stv += t[i] * v[i];
    double den = n * stt - st * st;
    return n >= 2 && den > 0 ? 60.0 * (n * stv - st * sv) / den : 0.0;
}

/* The slopes of the samples after the warm-up: VmRSS over every one, and
 * over those taken while the server held only its pristine weights (what
 * is checked); the fd count over every one. A merged version holds a
 * second copy of the merged modules (about the model's size) from its
 * merge until the last sequence that runs on it ends, after the unmerge,
 * so VmRSS is a square wave with the admin cycle's period whose highs
 * depend on how long requests take; a leak raises the pristine samples,
 * which are comparable with each other. The admin client waits after each
 * unmerge for the merged version to go, so every cycle has some. */
typedef struct slopes {
    int n_all, n_pristine;
    double rss_all, rss_pristine, fds_all;
} slopes;

static slopes process_slopes(void)
{
    slopes out = {0};
    size_t cap = n_samples + 1;
    double *t = calloc(cap, sizeof *t), *rss = calloc(cap, sizeof *rss);
    double *fds = calloc(cap, sizeof *fds);
    double *pt = calloc(cap, sizeof *pt), *prss = calloc(cap, sizeof *prss);
    if (!t || !rss || !fds || !pt || !prss)
        die("out of memory", NULL);
    for (size_t i = 0; i < n_samples; i++) {
        const sample *s = &samples_v[i];
        if (s->t < opt.warmup || s->t > opt.duration)
            continue;
        t[out.n_all] = s->t, rss[out.n_all] = s->rss_kib, fds[out.n_all] = s->fds;
        out.n_all++;
        if (s->pristine) {
            pt[out.n_pristine] = s->t, prss[out.n_pristine] = s->rss_kib;
            out.n_pristine++;
        }
    }
    out.rss_all = slope_per_min(t, rss, out.n_all);
    out.fds_all = slope_per_min(t, fds, out.n_all);
    out.rss_pristine = slope_per_min(pt, prss, out.n_pristine);
    free(t), free(rss), free(fds), free(pt), free(prss);
    return out;
}

/* --- setup: adapters and references ---------------------------------------------------- */

static void write_adapters(void)
{
    char msg[1024], dir[800];
    eng_model m;
    eng_load_opts lo = {.path = opt.model};
    if (eng_model_load(&m, &lo, msg, sizeof msg) != QL_OK)
        die("cannot load the model to write adapters for it", msg);
    snprintf(dir, sizeof dir, "%s/adapters", opt.workdir);
    mkdir(dir, 0755);
    for (int a = AD_A; a < N_ADAPTERS; a++) {
        snprintf(dir, sizeof dir, "%s/adapters/%s", opt.workdir, adapter_dir[a]);
        /* delta 5% of each weight: enough to change greedy answers, and a
         * Q4_1 merge keeps about 0.43 of it (README, "What merging costs") */
        if (peft_write_random(&m, dir, 8, 16.0f, 0.05, opt.seed + (uint64_t)a, msg, sizeof msg) !=
            QL_OK)
            die("cannot write an adapter", msg);
    }
    eng_model_free(&m);
}

static void remove_workdir(void)
{
    char path[1200];
    for (int a = AD_A; a < N_ADAPTERS; a++) {
        static const char *const files[] = {"adapter_config.json", "adapter_model.safetensors"};
        for (int f = 0; f < 2; f++) {
            snprintf(path, sizeof path, "%s/adapters/%s/%s", opt.workdir, adapter_dir[a], files[f]);
            unlink(path);
        }
        snprintf(path, sizeof path, "%s/adapters/%s", opt.workdir, adapter_dir[a]);
        rmdir(path);
    }
    snprintf(path, sizeof path, "%s/adapters", opt.workdir);
    rmdir(path);
    rmdir(opt.workdir);
}

/* Ask (route, prompt, adapter) alone; its complete answer, or NULL with
 * *status saying why. */
static char *ask_alone(int route, int prompt, int adapter, int *status)
{
    size_t len;
    char *req = request_bytes(route, prompt, adapter, true, &len);
    hc_conn c;
    answer a = {0};
    if (hc_open(&c, port) && hc_send(&c, req, len))
        read_answer(&c, route, 0, &a);
    hc_close(&c);
    free(req);
    *status = a.status;
    if (!a.complete) {
        free(a.text);
        return NULL;
    }
    return a.text;
}

/* Every reference, the merged state set first; fills refs. */
static void compute_references(void)
{
    int status;
    in_references = true;
    char *chat = ask_alone(ROUTE_CHAT, 0, AD_NONE, &status);
    have_chat = chat != NULL;
    free(chat);
    for (int s = 0; s < N_STATES; s++) {
        if (s == 1 && !admin_op(OP_MERGE))
            die("merging soak_a for the references failed", rec.admin_failures[0]);
        for (int r = 0; r < N_ROUTES; r++)
            for (int p = 0; p < opt.n_prompts && (r != ROUTE_CHAT || have_chat); p++)
                for (int a = 0; a < N_ADAPTERS; a++) {
                    refs[r][p][a][s] = ask_alone(r, p, a, &status);
                    if (!refs[r][p][a][s]) {
                        char what[256];
                        snprintf(what, sizeof what, "%s, prompt %d, adapter %s, state %d: %d",
                                 route_path[r], p, a ? adapter_name[a] : "none", s, status);
                        die("a reference request failed", what);
                    }
                }
        if (s == 1 && !admin_op(OP_UNMERGE))
            die("unmerging soak_a after the references failed", rec.admin_failures[0]);
    }
    in_references = false;
    /* the references' own merge and unmerge are not the load's */
    pthread_mutex_lock(&mu);
    rec.n_tr = 0;
    memset(rec.admin_ops, 0, sizeof rec.admin_ops);
    rec.admin_ok = 0;
    pthread_mutex_unlock(&mu);
}

/* How many (route, prompt) pairs of adapter have a merged-state reference
 * equal to the unmerged one, and how many differ. */
static void compare_states(int adapter, int *equal, int *differ)
{
    *equal = *differ = 0;
    for (int r = 0; r < N_ROUTES; r++)
        for (int p = 0; p < opt.n_prompts; p++)
            if (refs[r][p][adapter][0] && refs[r][p][adapter][1])
                (strcmp(refs[r][p][adapter][0], refs[r][p][adapter][1]) == 0 ? (*equal)++
                                                                             : (*differ)++);
}

/* How many (route, prompt, state) references of adapter differ from the
 * base model's (adapter none) in the same state. */
static int differ_from_base(int adapter)
{
    int n = 0;
    for (int r = 0; r < N_ROUTES; r++)
        for (int p = 0; p < opt.n_prompts; p++)
            for (int s = 0; s < N_STATES; s++)
                if (refs[r][p][adapter][s] && refs[r][p][AD_NONE][s])
                    n += strcmp(refs[r][p][adapter][s], refs[r][p][AD_NONE][s]) != 0;
    return n;
}

/* --- the report --------------------------------------------------------------------------- */

static cJSON *checks;
static bool all_passed = true;

static void check(const char *name, bool pass, const char *detail_fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void check(const char *name, bool pass, const char *detail_fmt, ...)
{
    char detail[1024];
    va_list ap;
    va_start(ap, detail_fmt);
    vsnprintf(detail, sizeof detail, detail_fmt, ap);
    va_end(ap);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddBoolToObject(c, "pass", pass);
    cJSON_AddStringToObject(c, "detail", detail);
    cJSON_AddItemToObject(checks, name, c);
    all_passed = all_passed && pass;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: soak [--duration S] [--clients N] [--model PATH] [--binary QLSERVE] "
            "[--seed N] [--threads N] [--prompts 1..%d] [--max-tokens N] [--admin-interval S] "
            "[--warmup S] [--settle S] [--rss-slope-max KIB_PER_MIN] "
            "[--fd-slope-max FDS_PER_MIN] [--publish-slack S] [--workdir DIR]\n",
            MAX_PROMPTS);
    exit(2);
}

static void parse_args(int argc, char **argv, char *default_model)
{
    opt = (soak_opts){.duration = 120,
                      .clients = 12,
                      .threads = 0,
                      .n_prompts = 2,
                      .max_tokens = 16,
                      .admin_interval = 2.5,
                      .warmup = -1,
                      .settle = 5,
                      .publish_slack = 1.0,
                      .rss_slope_max = 2048,
                      .fd_slope_max = 1,
                      .seed = 1,
                      .model = default_model,
                      .binary = QL_BINARY};
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage();
        const char *k = argv[i], *v = argv[++i];
        if (!strcmp(k, "--duration"))
            opt.duration = atof(v);
        else if (!strcmp(k, "--clients"))
            opt.clients = atoi(v);
        else if (!strcmp(k, "--model"))
            opt.model = v;
        else if (!strcmp(k, "--binary"))
            opt.binary = v;
        else if (!strcmp(k, "--seed"))
            opt.seed = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--threads"))
            opt.threads = atoi(v);
        else if (!strcmp(k, "--prompts"))
            opt.n_prompts = atoi(v);
        else if (!strcmp(k, "--max-tokens"))
            opt.max_tokens = atoi(v);
        else if (!strcmp(k, "--admin-interval"))
            opt.admin_interval = atof(v);
        else if (!strcmp(k, "--warmup"))
            opt.warmup = atof(v);
        else if (!strcmp(k, "--settle"))
            opt.settle = atof(v);
        else if (!strcmp(k, "--rss-slope-max"))
            opt.rss_slope_max = atof(v);
        else if (!strcmp(k, "--fd-slope-max"))
            opt.fd_slope_max = atof(v);
        else if (!strcmp(k, "--publish-slack"))
            opt.publish_slack = atof(v);
        else if (!strcmp(k, "--workdir"))
            snprintf(opt.workdir, sizeof opt.workdir, "%s", v);
        else
            usage();
    }
    if (!(opt.duration > 0) || opt.clients < 1 || opt.clients > 256 || opt.n_prompts < 1 ||
        opt.n_prompts > MAX_PROMPTS || opt.max_tokens < 1 || !(opt.admin_interval > 0) ||
        opt.threads < 0 || !(opt.settle > 0) || opt.publish_slack < 0)
        usage();
    /* the first quarter, at most a minute: the KV cache and the allocator's
     * arenas fill while the load ramps up */
    if (opt.warmup < 0)
        opt.warmup = opt.duration / 4 < 60 ? opt.duration / 4 : 60;
    if (opt.warmup >= opt.duration)
        die("--warmup must be shorter than --duration", NULL);
}

/* Load the three adapters; die when one does not load. */
static void load_adapters(void)
{
    for (int a = AD_A; a < N_ADAPTERS; a++) {
        char json[256], *body = NULL;
        snprintf(json, sizeof json, "{\"name\": \"%s\", \"path\": \"%s\", \"scale\": 1.0}",
                 adapter_name[a], adapter_dir[a]);
        int status = admin("POST", "/admin/adapters", json, &body);
        if (status != 201)
            die("an adapter did not load", body);
        free(body);
    }
}

/* Poll /metrics until nothing is in use; the seconds it took (-1: not
 * within --settle) and the last values seen. */
static double settle(double *kv, double *conns, double *queued, double *running)
{
    double t0 = now();
    for (;;) {
        char *m = get_metrics();
        *kv = m ? metric_value(m, "qlserve_kv_blocks_used") : -1;
        /* the connection asking for /metrics is open while it is answered */
        *conns = m ? metric_value(m, "qlserve_connections") - 1 : -1;
        *queued = m ? metric_value(m, "qlserve_queue_depth") : -1;
        *running = m ? metric_value(m, "qlserve_batch_size") : -1;
        free(m);
        if (*kv == 0 && *conns == 0 && *queued == 0 && *running == 0)
            return now() - t0;
        if (now() - t0 > opt.settle)
            return -1;
        sleep_s(0.1);
    }
}

static void add_machine(cJSON *doc)
{
    bench_machine mc = machine_now();
    cJSON_AddStringToObject(doc, "date", mc.date);
    cJSON *m = cJSON_AddObjectToObject(doc, "machine");
    cJSON_AddStringToObject(m, "cpu", mc.cpu);
    cJSON_AddNumberToObject(m, "cores", (double)sysconf(_SC_NPROCESSORS_ONLN));
    cJSON_AddStringToObject(m, "kernel", mc.kernel);
}

static void add_inputs(cJSON *doc)
{
    cJSON *in = cJSON_AddObjectToObject(doc, "inputs");
    cJSON_AddNumberToObject(in, "duration_s", opt.duration);
    cJSON_AddNumberToObject(in, "clients", opt.clients);
    cJSON_AddStringToObject(in, "model", opt.model);
    cJSON_AddStringToObject(in, "binary", opt.binary);
    cJSON_AddNumberToObject(in, "seed", (double)opt.seed);
    cJSON_AddNumberToObject(in, "threads", opt.threads);
    cJSON_AddNumberToObject(in, "prompts", opt.n_prompts);
    cJSON_AddNumberToObject(in, "max_tokens", opt.max_tokens);
    cJSON_AddNumberToObject(in, "admin_interval_s", opt.admin_interval);
    cJSON_AddNumberToObject(in, "warmup_s", opt.warmup);
    cJSON_AddNumberToObject(in, "settle_s", opt.settle);
    cJSON_AddNumberToObject(in, "publish_slack_s", opt.publish_slack);
    cJSON_AddNumberToObject(in, "rss_slope_max_kib_per_min", opt.rss_slope_max);
    cJSON_AddNumberToObject(in, "fd_slope_max_per_min", opt.fd_slope_max);
    cJSON *routes = cJSON_AddArrayToObject(in, "routes");
    for (int r = 0; r < N_ROUTES; r++)
        if (r != ROUTE_CHAT || have_chat)
            cJSON_AddItemToArray(routes, cJSON_CreateString(route_path[r]));
    cJSON_AddStringToObject(in, "manners",
                            "whole 45%, vanish after 1-3 events 15%, slow send 15%, "
                            "pipeline 2-3 25%");
    cJSON_AddStringToObject(in, "adapters",
                            "none, soak_a (merged and unmerged), soak_b, soak_c (unloaded and "
                            "loaded): rank 8, alpha 16, delta 5% of each weight");
}

/* The checks on what the clients and the admin client saw. */
static void check_answers(cJSON *doc)
{
    cJSON *st = cJSON_AddObjectToObject(doc, "responses_by_status");
    long long bad5xx = 0, total = 0;
    for (int s = 0; s < 600; s++) {
        if (!rec.by_status[s])
            continue;
        char k[8];
        snprintf(k, sizeof k, "%d", s);
        cJSON_AddNumberToObject(st, s ? k : "none", (double)rec.by_status[s]);
        bad5xx += s >= 500 && s != 503 ? rec.by_status[s] : 0;
        total += rec.by_status[s];
    }
    cJSON *mn = cJSON_AddObjectToObject(doc, "requests_by_manner");
    for (int k = 0; k < N_MANNERS; k++)
        cJSON_AddNumberToObject(mn, manner_name[k], (double)rec.manner[k]);
    cJSON *ans = cJSON_AddObjectToObject(doc, "answers");
    cJSON_AddNumberToObject(ans, "responses", (double)total);
    cJSON_AddNumberToObject(ans, "compared", (double)rec.compared);
    cJSON_AddNumberToObject(ans, "matched", (double)rec.matched);
    cJSON_AddNumberToObject(ans, "compared_while_a_merge_was_in_flight", (double)rec.ambiguous);
    cJSON_AddNumberToObject(ans, "vanished", (double)rec.vanished);
    cJSON_AddNumberToObject(ans, "transport_errors", (double)rec.transport_errors);
    cJSON_AddItemToObject(ans, "mismatches", cJSON_Duplicate(rec.mismatches, true));
    cJSON *ad = cJSON_AddObjectToObject(doc, "admin");
    for (int k = 0; k < 4; k++)
        cJSON_AddNumberToObject(ad, op_name[k], (double)rec.admin_ops[k]);
    cJSON_AddNumberToObject(ad, "failed", (double)rec.admin_failed);
    cJSON *fl = cJSON_AddArrayToObject(ad, "failures");
    for (int k = 0; k < rec.n_admin_failures; k++)
        cJSON_AddItemToArray(fl, cJSON_CreateString(rec.admin_failures[k]));
    cJSON_AddStringToObject(ad, "weights_digest_unmerged", rec.digest_text[0]);
    cJSON_AddStringToObject(ad, "weights_digest_merged", rec.digest_text[1]);

    check("no_5xx_but_503", bad5xx == 0, "%lld responses with a 5xx other than 503", bad5xx);
    check("no_4xx_but_unloaded_adapter", rec.unexpected_4xx == 0,
          "%lld 4xx other than 404 for soak_c (which the admin client unloads)%s%s",
          rec.unexpected_4xx, rec.unexpected_4xx ? "; the first: " : "", rec.first_unexpected);
    check("no_broken_connections", rec.transport_errors == 0,
          "%lld requests whose connection broke or timed out, or whose stream ended without "
          "its last event (clients that vanished on purpose not counted)",
          rec.transport_errors);
    check("answers_equal_references", rec.compared > 0 && rec.matched == rec.compared,
          "%lld of %lld complete answers equal a reference of a merged state in force "
          "(%lld with no reference)",
          rec.matched, rec.compared, rec.no_ref);
    check("admin_operations_succeed", rec.admin_failed == 0 && rec.admin_ops[OP_MERGE] > 0,
          "%lld failed; %lld merges, %lld unmerges, %lld loads, %lld unloads", rec.admin_failed,
          rec.admin_ops[OP_MERGE], rec.admin_ops[OP_UNMERGE], rec.admin_ops[OP_LOAD],
          rec.admin_ops[OP_UNLOAD]);
    check("weights_digest_stable", rec.digest_stable,
          "each merged state's /admin/state weights_digest is the same every time it is served");
}

/* What the references say: does each adapter change answers, and is the
 * base served exactly while soak_a is merged. */
static void check_references(cJSON *doc)
{
    cJSON *r = cJSON_AddObjectToObject(doc, "references");
    int n = 0;
    for (int a = 0; a < N_ADAPTERS; a++)
        for (int ro = 0; ro < N_ROUTES; ro++)
            for (int p = 0; p < opt.n_prompts; p++)
                n += refs[ro][p][a][0] != NULL;
    cJSON_AddNumberToObject(r, "configurations", 2 * n);
    int eq, df;
    compare_states(AD_NONE, &eq, &df);
    cJSON *b = cJSON_AddObjectToObject(r, "base_exact_under_merge");
    cJSON_AddNumberToObject(b, "equal", eq);
    cJSON_AddNumberToObject(b, "differ", df);
    cJSON_AddStringToObject(b, "note",
                            "a request naming no adapter while soak_a is merged is served as the "
                            "merged weights minus soak_a unmerged (the design); 'differ' counts "
                            "(route, prompt) whose greedy answer then is not the base model's");
    compare_states(AD_A, &eq, &df);
    cJSON *m = cJSON_AddObjectToObject(r, "soak_a_merged_equals_unmerged");
    cJSON_AddNumberToObject(m, "equal", eq);
    cJSON_AddNumberToObject(m, "differ", df);
    cJSON *d = cJSON_AddObjectToObject(r, "differ_from_base");
    int least = 1 << 30;
    for (int a = AD_A; a < N_ADAPTERS; a++) {
        int k = differ_from_base(a);
        cJSON_AddNumberToObject(d, adapter_name[a], k);
        least = k < least ? k : least;
    }
    /* otherwise an answer served with the wrong adapter could not be told */
    check("adapters_change_answers", least > 0,
          "every adapter's references differ from the base model's somewhere (least: %d)", least);
}

/* The server at rest, before and after the load. */
typedef struct idle_process {
    double rss, rss_anon, fds;
} idle_process;

static idle_process idle_now(void)
{
    return (idle_process){rss_kib(server_pid), status_kib(server_pid, "RssAnon"),
                          fd_count(server_pid)};
}

/* The process's figures and the checks on its RSS and fds. */
static void check_process(cJSON *doc, const idle_process *before, const idle_process *after)
{
    slopes sl = process_slopes();
    cJSON *pr = cJSON_AddObjectToObject(doc, "process");
    cJSON_AddNumberToObject(pr, "samples", (double)n_samples);
    cJSON_AddNumberToObject(pr, "samples_after_warmup", sl.n_all);
    cJSON_AddNumberToObject(pr, "samples_with_only_pristine_weights", sl.n_pristine);
    cJSON_AddNumberToObject(pr, "rss_kib_idle_before", before->rss);
    cJSON_AddNumberToObject(pr, "rss_kib_idle_after", after->rss);
    cJSON_AddNumberToObject(pr, "rss_anon_kib_idle_before", before->rss_anon);
    cJSON_AddNumberToObject(pr, "rss_anon_kib_idle_after", after->rss_anon);
    cJSON_AddNumberToObject(pr, "rss_kib_per_min_pristine", sl.rss_pristine);
    cJSON_AddNumberToObject(pr, "rss_kib_per_min_every_sample", sl.rss_all);
    cJSON_AddNumberToObject(pr, "fds_idle_before", before->fds);
    cJSON_AddNumberToObject(pr, "fds_idle_after", after->fds);
    cJSON_AddNumberToObject(pr, "fds_per_min", sl.fds_all);
    double rss_min = 1e18, rss_max = 0, fd_max = 0;
    for (size_t i = 0; i < n_samples; i++) {
        rss_min = samples_v[i].rss_kib < rss_min ? samples_v[i].rss_kib : rss_min;
        rss_max = samples_v[i].rss_kib > rss_max ? samples_v[i].rss_kib : rss_max;
        fd_max = samples_v[i].fds > fd_max ? samples_v[i].fds : fd_max;
    }
    cJSON_AddNumberToObject(pr, "rss_kib_min", n_samples ? rss_min : 0);
    cJSON_AddNumberToObject(pr, "rss_kib_max", rss_max);
    cJSON_AddNumberToObject(pr, "fds_max", fd_max);
    cJSON_AddNumberToObject(pr, "longest_wait_for_merged_version_to_go_s", rec.longest_drain);
    check("rss_flat", sl.n_pristine >= 10 && sl.rss_pristine <= opt.rss_slope_max,
          "VmRSS slope %.1f KiB/min over the %d samples after %.0f s of warm-up taken while the "
          "server held only its pristine weights (every sample: %.1f KiB/min); bound %.1f",
          sl.rss_pristine, sl.n_pristine, opt.warmup, sl.rss_all, opt.rss_slope_max);
    check("fds_flat", sl.n_all >= 10 && sl.fds_all <= opt.fd_slope_max,
          "fd count slope %.2f /min over %d samples after %.0f s of warm-up; bound %.2f",
          sl.fds_all, sl.n_all, opt.warmup, opt.fd_slope_max);
    check("merged_versions_go", rec.drain_timeouts == 0,
          "after each unmerge the merged version is freed once its sequences end (%lld waits "
          "over 60 s; the longest %.1f s)",
          rec.drain_timeouts, rec.longest_drain);
    check("fds_back_to_idle", after->fds >= 0 && after->fds <= before->fds,
          "open fds idle: %.0f before the load, %.0f after it", before->fds, after->fds);
}

int main(int argc, char **argv)
{
    char default_model[1024];
    bool have_default = test_default_model_path(default_model, sizeof default_model);
    parse_args(argc, argv, default_model);
    if (opt.model == default_model && !have_default) {
        /* ctest's skip code, unless CI asked that every test run */
        bool required = test_require_all();
        fprintf(stderr,
                "soak: %s: the default model %s is absent; scripts/fetch-model.sh puts it "
                "there (or pass --model PATH)%s\n",
                required ? "FAILED" : "NOT RUN", default_model,
                required ? "; QL_REQUIRE_ALL=1 and the soak cannot run" : "");
        return required ? 1 : 77;
    }
    if (access(opt.model, R_OK) != 0)
        die("--model is not readable", opt.model);
    signal(SIGPIPE, SIG_IGN);
    bool own_workdir = !opt.workdir[0];
    if (own_workdir) {
        snprintf(opt.workdir, sizeof opt.workdir, "/tmp/qlserve-soak.XXXXXX");
        if (!mkdtemp(opt.workdir))
            die("cannot make a work folder", strerror(errno));
    } else if (mkdir(opt.workdir, 0755) != 0 && errno != EEXIST) {
        die("cannot make --workdir", strerror(errno));
    }
    rec.mismatches = cJSON_CreateArray();
    checks = cJSON_CreateObject();
    write_adapters();

    /* room for every client's connections, pipelined ones and the admin's */
    char adapters[700], conns[16], journal[700];
    snprintf(adapters, sizeof adapters, "%s/adapters", opt.workdir);
    snprintf(conns, sizeof conns, "%d", 4 * opt.clients + 16);
    /* the run's own journal, never the user's state directory (a flag an
     * older binary knows too, for before/after runs) */
    snprintf(journal, sizeof journal, "%s/state.json", opt.workdir);
    char *extra[] = {"--adapter-dir", adapters, "--max-connections",          conns,
                     "--state-file",  journal,  "--max-connections-per-peer", "0"};
    inet_pton(AF_INET, "127.0.0.1", &server_addr.sin_addr);
    server_addr.sin_family = AF_INET;
    port = start_server(opt.binary, opt.model, opt.threads, extra, 6);
    server_addr.sin_port = htons((uint16_t)port);
    server_pid = child;
    double t_load = now();
    wait_serving(300);
    double load_s = now() - t_load;
    load_adapters();
    fprintf(stderr, "soak: serving after %.1f s; asking the references alone\n", load_s);
    double t_refs = now();
    compute_references();
    double refs_s = now() - t_refs;
    fprintf(stderr, "soak: references in %.1f s; %d clients for %.0f s\n", refs_s, opt.clients,
            opt.duration);
    idle_process before = idle_now();

    /* the load */
    double t_start = now();
    t_end_load = t_start + opt.duration;
    pthread_t sampler, admin_thread;
    pthread_create(&sampler, NULL, sampler_main, &t_start);
    pthread_create(&admin_thread, NULL, admin_main, NULL);
    client *cs = calloc((size_t)opt.clients, sizeof *cs);
    for (int i = 0; i < opt.clients; i++) {
        cs[i].index = i;
        cs[i].rng = opt.seed * 1000003u + (uint64_t)i;
        pthread_create(&cs[i].thread, NULL, client_main, &cs[i]);
    }
    for (int i = 0; i < opt.clients; i++)
        pthread_join(cs[i].thread, NULL);
    double t_clients_done = now();
    fprintf(stderr, "soak: the clients stopped after %.1f s\n", t_clients_done - t_start);
    pthread_join(admin_thread, NULL);
    double kv, conns_open, queued, running;
    double settle_s = settle(&kv, &conns_open, &queued, &running);
    sampling = false;
    pthread_join(sampler, NULL);
    idle_process after = idle_now();
    char *metrics = get_metrics();
    int exit_code = stop_server();

    cJSON *doc = cJSON_CreateObject();
    cJSON_AddStringToObject(doc, "benchmark", "soak");
    cJSON_AddStringToObject(doc, "engine", "qlserve");
    add_machine(doc);
    add_inputs(doc);
    cJSON *sv = cJSON_AddObjectToObject(doc, "server");
    cJSON_AddNumberToObject(sv, "load_seconds", load_s);
    cJSON_AddNumberToObject(sv, "references_seconds", refs_s);
    cJSON_AddNumberToObject(sv, "load_ran_seconds", t_clients_done - t_start);
    check_references(doc);
    check_answers(doc);

    /* the server's own count: 5xx other than 503 */
    long long server5xx = 0;
    cJSON *sc = cJSON_AddObjectToObject(doc, "server_responses_by_status");
    for (int code = 100; code < 600 && metrics; code++) {
        char name[64];
        snprintf(name, sizeof name, "qlserve_http_responses_total{code=\"%d\"}", code);
        double v = metric_value(metrics, name);
        if (v > 0) {
            char k[8];
            snprintf(k, sizeof k, "%d", code);
            cJSON_AddNumberToObject(sc, k, v);
            server5xx += code >= 500 && code != 503 ? (long long)v : 0;
        }
    }
    check("server_counts_no_5xx_but_503", metrics && server5xx == 0,
          "/metrics qlserve_http_responses_total: %lld 5xx other than 503", server5xx);
    free(metrics);

    check_process(doc, &before, &after);

    cJSON *end = cJSON_AddObjectToObject(doc, "after_the_load");
    cJSON_AddNumberToObject(end, "settle_seconds", settle_s);
    cJSON_AddNumberToObject(end, "kv_blocks_used", kv);
    cJSON_AddNumberToObject(end, "connections_besides_the_scrape", conns_open);
    cJSON_AddNumberToObject(end, "queue_depth", queued);
    cJSON_AddNumberToObject(end, "batch_size", running);
    check("idle_after_load", settle_s >= 0,
          "within %.1f s of the clients stopping: kv_blocks_used %.0f, connections %.0f (besides "
          "the /metrics one), queue_depth %.0f, batch_size %.0f",
          opt.settle, kv, conns_open, queued, running);
    cJSON_AddNumberToObject(doc, "server_exit", exit_code);
    check("sigterm_exits_0", exit_code == 0, "exit status %d after SIGTERM", exit_code);
    cJSON_AddItemToObject(doc, "checks", checks);
    cJSON_AddBoolToObject(doc, "pass", all_passed);

    char *text = cJSON_Print(doc);
    printf("%s\n", text);
    free(text);
    cJSON_Delete(doc);
    if (own_workdir)
        remove_workdir();
    return all_passed ? 0 : 1;
}

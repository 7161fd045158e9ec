/*
 * test_server_gateway.c - many replicas behind a router (issue 17):
 * adapters loaded by name on first use from a shared folder (one load for
 * concurrent requests, refusals for what is not an adapter folder there,
 * eviction under the memory budget, two replicas sharing the folder), the
 * Kubernetes Gateway API Inference Extension's model-server metrics
 * scraped under load (requests waiting and running, KV-cache use, the
 * running and waiting adapters), and each replica's identity (weights
 * digest and merged configuration) in /info and /metrics. Over loopback
 * against the real binary on the tiny model, with adapters made by
 * tests/lora_fixture.h.
 */
#define _GNU_SOURCE /* F_SETLEASE */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include "http_client.h"
#include "lora_fixture.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512], model_dir[600], adapter_dir[600], log_path[600];

/* An adapter folder `name` under the adapter folder, of rank r. */
static void write_adapter(const char *name, int32_t r, uint64_t seed)
{
    lora_fix_spec ls = lora_fix_default();
    ls.r = r;
    ls.seed = seed;
    ls.std = 0.2f; /* enough to change the tiny model's greedy answers */
    lora_fix_write_tiny(adapter_dir, name, NULL, &ls);
}

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(model_dir, sizeof model_dir, "%s/tiny", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapters", dir);
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
    cr_assert_eq(mkdir(adapter_dir, 0700), 0);
    tiny_spec spec = tiny_default();
    tiny_write_hf(model_dir, &spec);
    write_adapter("ad", 8, 7);
}

static void teardown(void)
{
    if (sp.pid > 0)
        sp_stop_cleanly();
    test_rmtree(dir);
}

TestSuite(server_gateway, .init = setup, .fini = teardown, .timeout = 120);

/* Serve the tiny model over the adapter folder, with `extra` flags. */
static void start_with(const char *const *extra, const char *log)
{
    const char *argv[32] = {
        QL_BINARY,  "serve", "--model",       model_dir,   "--port",       "0",   "--threads", "2",
        "--kv-mib", "16",    "--adapter-dir", adapter_dir, "--state-file", "none"};
    size_t n = 14;
    for (size_t i = 0; extra && extra[i] && n < 31; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    sp_spawn(argv, log);
    sp_wait_ready();
}

static void start(void)
{
    start_with(NULL, log_path);
}

/* GET path's body (the caller's to free); status 200. */
static char *get(const char *path)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", path, NULL, NULL, &r));
    cr_assert_eq(r.status, 200, "GET %s -> %d %s", path, r.status, r.body);
    char *body = strdup(r.body);
    hc_response_free(&r);
    return body;
}

/* The value of the sample whose line starts with `series` (a name, or a
 * name and the start of its labels) in /metrics text; NaN when absent. */
static double sample(const char *metrics, const char *series)
{
    for (const char *at = metrics; (at = strstr(at, series)) != NULL; at++) {
        if (at != metrics && at[-1] != '\n')
            continue;
        const char *v = strchr(at, ' ');
        return v ? atof(v + 1) : NAN;
    }
    return NAN;
}

/* The value of label `name` on the first sample of `metric` (allocated). */
static char *label(const char *metrics, const char *metric, const char *name)
{
    char start[128], key[128];
    snprintf(start, sizeof start, "\n%s{", metric);
    snprintf(key, sizeof key, "%s=\"", name);
    const char *at = strstr(metrics, start);
    cr_assert(at, "no %s in /metrics", metric);
    const char *eol = strchr(at + 1, '\n');
    const char *k = strstr(at, key);
    cr_assert(k && (!eol || k < eol), "%s has no label %s", metric, name);
    k += strlen(key);
    return strndup(k, strcspn(k, "\""));
}

/* Opens a stream for model on a new connection and returns it once its
 * request is sent (its answer is not read). */
static void open_stream(hc_conn *c, const char *model)
{
    char body[256];
    snprintf(body, sizeof body,
             "{\"model\": \"%s\", \"prompt\": \"the\", \"max_tokens\": 500, \"ignore_eos\": true, "
             "\"stream\": true}",
             model);
    cr_assert(hc_open(c, sp.port));
    cr_assert(hc_send_request(c, "POST", "/v1/completions", NULL, body));
}

/* A stream for model, held running with its first token out: the engine
 * is held while the request comes in, then stepped until it has begun,
 * and the first event is read; the engine stays held (*c and *head the
 * caller's to free). */
static void begin_held_stream(hc_conn *c, hc_response *head, const char *model)
{
    sp_hold_after(0, NULL);
    double before = sp_engine_figure("tokens_generated", NULL);
    open_stream(c, model);
    sp_engine_reaches("running", 1, NULL);
    sp_step_until_generated(before + 1, NULL);
    cr_assert(hc_read_head(c, head));
    cr_assert_eq(head->status, 200, "%s: %d", model, head->status);
    char *event = hc_next_event(c, head);
    cr_assert(event, "no first event");
    free(event);
}

/* Closes a held stream's connection and waits, still held, until the
 * engine has let it go: what the client leaving did, not the stream's end. */
static void leave_held_stream(hc_conn *c, hc_response *head)
{
    hc_response_free(head);
    hc_close(c);
    sp_engine_falls_to("running", 0, NULL);
    sp_hold_after(0, NULL);
}

/* While a stream for the adapter runs (held by the engine's gate, its
 * first token out), the gateway's gauges show one running request, the
 * adapter among the running ones and KV blocks in use; when the client
 * goes (the engine still held: the stream did not end by itself), they
 * are back to none. */
Test(server_gateway, the_gateway_metrics_follow_the_running_adapter)
{
    start();
    hc_response r = sp_post("/admin/adapters", "{\"name\": \"ad\", \"path\": \"ad\"}");
    cr_assert_eq(r.status, 201, "%s", r.body);
    hc_response_free(&r);
    char *idle = get("/metrics");
    cr_assert_eq(sample(idle, "vllm:num_requests_running "), 0);
    cr_assert_eq(sample(idle, "vllm:num_requests_waiting "), 0);
    cr_assert_eq(sample(idle, "vllm:kv_cache_usage_perc "), 0);
    char *none = label(idle, "vllm:lora_requests_info", "running_lora_adapters");
    cr_assert_str_empty(none);
    char *max_lora = label(idle, "vllm:lora_requests_info", "max_lora");
    cr_assert_gt(atoi(max_lora), 0);
    free(none);
    free(max_lora);
    free(idle);

    hc_conn c;
    hc_response head;
    begin_held_stream(&c, &head, "ad");
    char *busy = get("/metrics");
    cr_assert_eq(sample(busy, "vllm:num_requests_running "), 1);
    cr_assert_gt(sample(busy, "vllm:kv_cache_usage_perc "), 0);
    cr_assert_gt(sample(busy, "vllm:lora_requests_info{"), 1.7e9, "the value is a wall time");
    char *running = label(busy, "vllm:lora_requests_info", "running_lora_adapters");
    cr_assert_str_eq(running, "ad");
    free(running);
    free(busy);

    leave_held_stream(&c, &head);
    char *after = get("/metrics");
    cr_assert_eq(sample(after, "vllm:num_requests_running "), 0);
    cr_assert_eq(sample(after, "vllm:kv_cache_usage_perc "), 0,
                 "the client left and its KV blocks are still in use");
    char *names = label(after, "vllm:lora_requests_info", "running_lora_adapters");
    cr_assert_str_empty(names, "the client left and its adapter is still named running");
    free(names);
    free(after);
    sp_hold_after(-1, NULL);
}

/* /info and /metrics carry the weights digest and the merged configuration,
 * the same as /admin/state: replicas with equal digests are interchangeable.
 * A merge changes both; an unmerge brings the first digest back. */
Test(server_gateway, info_and_metrics_say_which_weights_serve)
{
    start();
    hc_response r = sp_post("/admin/adapters", "{\"name\": \"ad\", \"path\": \"ad\"}");
    cr_assert_eq(r.status, 201, "%s", r.body);
    hc_response_free(&r);
    char digests[3][32];
    for (int round = 0; round < 3; round++) {
        if (round == 1) {
            r = sp_post("/admin/adapters/ad/merge", "{\"scale\": 0.5}");
            cr_assert_eq(r.status, 200, "%s", r.body);
            hc_response_free(&r);
        } else if (round == 2) {
            r = sp_post("/admin/adapters/ad/unmerge", NULL);
            cr_assert_eq(r.status, 200, "%s", r.body);
            hc_response_free(&r);
        }
        char *state_text = get("/admin/state"), *info_text = get("/info");
        char *metrics = get("/metrics");
        cJSON *state = sp_json(state_text), *info = sp_json(info_text);
        const char *digest = sp_str_at(state, "weights_digest");
        cr_assert_str_eq(sp_str_at(info, "weights_digest"), digest);
        char *labelled = label(metrics, "qlserve_weights_info", "digest");
        cr_assert_str_eq(labelled, digest);
        char *merged = label(metrics, "qlserve_weights_info", "merged");
        const cJSON *list = cJSON_GetObjectItem(info, "merged");
        cr_assert_eq(cJSON_GetArraySize(list), round == 1 ? 1 : 0);
        cr_assert_str_eq(merged, round == 1 ? "ad:0.5" : "");
        snprintf(digests[round], sizeof digests[round], "%s", digest);
        free(merged);
        free(labelled);
        cJSON_Delete(state);
        cJSON_Delete(info);
        free(state_text);
        free(info_text);
        free(metrics);
    }
    cr_assert_str_neq(digests[1], digests[0]);
    cr_assert_str_eq(digests[2], digests[0]);
}

/* The body of a greedy completion of `model` for a fixed prompt. */
static void completion_body(const char *model, char *body, size_t size)
{
    snprintf(body, size,
             "{\"model\": \"%s\", \"prompt\": \"the\", \"max_tokens\": 8, \"temperature\": 0, "
             "\"ignore_eos\": true}",
             model);
}

/* A completion's answer (status, body): its text (allocated) when 200,
 * else the error body; takes the body. */
static char *completion_text(int status, char *text)
{
    if (status != 200)
        return text;
    cJSON *j = sp_json(text);
    const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    char *out = strdup(sp_str_at(choice, "text"));
    cJSON_Delete(j);
    free(text);
    return out;
}

/* The greedy completion of `model` for a fixed prompt: its status, and its
 * text (allocated) when 200, else the error body. */
static char *complete(const char *model, int *status)
{
    char body[512];
    completion_body(model, body, sizeof body);
    char *text = sp_answer("/v1/completions", body, status);
    return completion_text(*status, text);
}

static char *complete_ok(const char *model)
{
    int status;
    char *text = complete(model, &status);
    cr_assert_eq(status, 200, "%s: %d %s", model, status, text);
    return text;
}

/* How many adapters /admin/adapters lists, and whether name is one. */
static int listed(const char *name, bool *found)
{
    char *text = get("/admin/adapters");
    cJSON *j = sp_json(text);
    const cJSON *list = cJSON_IsArray(j) ? j : cJSON_GetObjectItem(j, "adapters");
    cr_assert(cJSON_IsArray(list), "%s", text);
    *found = false;
    for (const cJSON *a = list->child; a; a = a->next)
        *found = *found || strcmp(sp_str_at(a, "name"), name) == 0;
    int n = cJSON_GetArraySize(list);
    cJSON_Delete(j);
    free(text);
    return n;
}

/* --- an adapter's weights held in their read: how many loads read them --- */

/* The test's write lease on an adapter's weights file: the server's open
 * of it (its load) waits until the lease goes, so a load is held in its
 * read for as long as the test needs; and an inotify watch that sees each
 * open. */
typedef struct weights_hold {
    int fd, watch;
    ino_t ino;
} weights_hold;

static void hold_weights(weights_hold *h, const char *path)
{
    signal(SIGIO, SIG_IGN); /* a lease holder is told of a break by SIGIO */
    h->fd = open(path, O_RDONLY);
    cr_assert_geq(h->fd, 0, "%s", path);
    cr_assert_eq(fcntl(h->fd, F_SETLEASE, F_WRLCK), 0, "no lease on %s: %s", path, strerror(errno));
    struct stat sb;
    cr_assert_eq(fstat(h->fd, &sb), 0);
    h->ino = sb.st_ino;
    h->watch = inotify_init1(IN_NONBLOCK);
    cr_assert_geq(h->watch, 0);
    cr_assert_geq(inotify_add_watch(h->watch, path, IN_OPEN | IN_CLOSE_NOWRITE), 0);
}

/* How many opens of the held file wait for its lease: /proc/locks lists
 * each under the lease ("N: LEASE BREAKING ... pid dev:ino ..." then one
 * "N: -> LEASE BREAKER ..." per waiting open). */
static int opens_waiting(const weights_hold *h)
{
    FILE *f = fopen("/proc/locks", "r");
    cr_assert(f);
    char line[512], ours[64], inode[64];
    snprintf(ours, sizeof ours, " %d ", (int)getpid());
    snprintf(inode, sizeof inode, ":%lu ", (unsigned long)h->ino);
    int lease = -1, waiting = 0;
    while (fgets(line, sizeof line, f)) {
        bool blocked = strstr(line, "->") != NULL;
        if (!blocked && strstr(line, "LEASE") && strstr(line, ours) && strstr(line, inode))
            lease = atoi(line);
        else if (blocked && lease >= 0 && atoi(line) == lease)
            waiting++;
    }
    fclose(f);
    return waiting;
}

/* Lets the waiting opens through (the lease goes). */
static void release_weights(weights_hold *h)
{
    cr_assert_eq(fcntl(h->fd, F_SETLEASE, F_UNLCK), 0);
    close(h->fd);
}

/* How many times the held file was opened since hold_weights; closes the
 * watch. Opens and closes alternate for loads one after another; two
 * opens in a row are merged into one event by inotify, so loads at once
 * are counted by opens_waiting instead. */
static int opens_seen(weights_hold *h)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int opens = 0;
    ssize_t n;
    while ((n = read(h->watch, buf, sizeof buf)) > 0)
        for (char *at = buf; at < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)at;
            opens += (ev->mask & IN_OPEN) != 0;
            at += sizeof *ev + ev->len;
        }
    close(h->watch);
    return opens;
}

/* A request naming an adapter that is not loaded, but is a folder of the
 * adapter folder, is answered: the adapter is loaded on first use (once,
 * for four requests at once), and answers as it does loaded by the admin
 * route. /v1/models lists it as loadable before and as loaded after. */
Test(server_gateway, an_adapter_is_loaded_by_name_on_first_use)
{
    start();
    char *models = get("/v1/models");
    cr_assert_null(strstr(models, "\"ad\""), "listed before it was loaded: %s", models);
    free(models);
    models = get("/v1/models?all=1");
    cJSON *j = sp_json(models);
    bool seen = false;
    for (const cJSON *m = cJSON_GetObjectItem(j, "data")->child; m; m = m->next)
        if (strcmp(sp_str_at(m, "id"), "ad") == 0) {
            seen = true;
            cr_assert(cJSON_IsFalse(cJSON_GetObjectItem(m, "loaded")), "%s", models);
        }
    cr_assert(seen, "?all=1 does not list the loadable adapter: %s", models);
    cJSON_Delete(j);
    free(models);

    /* four requests at once, while the first load is held reading the
     * adapter's weights: the others wait for it, none loads again */
    char weights[700];
    snprintf(weights, sizeof weights, "%s/ad/adapter_model.safetensors", adapter_dir);
    weights_hold hold;
    hold_weights(&hold, weights);
    hc_conn c[4];
    char body[512];
    completion_body("ad", body, sizeof body);
    for (int i = 0; i < 4; i++) {
        cr_assert(hc_open(&c[i], sp.port));
        cr_assert(hc_send_request(&c[i], "POST", "/v1/completions", NULL, body));
    }
    for (int i = 0; i < 30000 && opens_waiting(&hold) == 0; i++)
        test_sleep_ms(1); /* a bound for a broken server (30 s at least), not a timing */
    /* a round trip through the server's loop after the four were sent, so
     * they are on their way to the registry: a correct server gives 1
     * whatever the order; a request still late could only hide a second
     * load of a broken one */
    free(get("/health"));
    int loading = opens_waiting(&hold);
    release_weights(&hold);
    char *texts[4];
    for (int i = 0; i < 4; i++) {
        hc_response r;
        cr_assert(hc_read_response(&c[i], &r));
        texts[i] = completion_text(r.status, strdup(r.body));
        cr_assert_eq(r.status, 200, "request %d for the unloaded adapter: %d %s", i, r.status,
                     texts[i]);
        hc_response_free(&r);
        hc_close(&c[i]);
    }
    cr_assert_eq(loading, 1, "%d loads of the adapter read its weights at once", loading);
    int opens = opens_seen(&hold);
    cr_assert_eq(opens, 1, "the adapter's weights were read %d times for four requests", opens);
    for (int i = 1; i < 4; i++)
        cr_assert_str_eq(texts[i], texts[0]);
    bool found;
    cr_assert_eq(listed("ad", &found), 1);
    cr_assert(found);
    char *base = complete_ok("tgi"); /* a placeholder: the base model */
    cr_assert_str_neq(texts[0], base, "the adapter does not change the answer");
    /* the same adapter loaded by the admin route answers the same */
    hc_response r;
    cr_assert(hc_request(sp.port, "DELETE", "/admin/adapters/ad", NULL, NULL, &r));
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    r = sp_post("/admin/adapters", "{\"name\": \"ad\", \"path\": \"ad\"}");
    cr_assert_eq(r.status, 201, "%s", r.body);
    hc_response_free(&r);
    char *again = complete_ok("ad");
    cr_assert_str_eq(again, texts[0]);
    /* TGI's adapter_id loads by name too */
    write_adapter("second", 8, 11);
    r = sp_post("/generate", "{\"inputs\": \"the\", \"parameters\": {\"adapter_id\": \"second\", "
                             "\"max_new_tokens\": 4}}");
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    cr_assert_eq(listed("second", &found), 2);
    cr_assert(found);
    for (int i = 0; i < 4; i++)
        free(texts[i]);
    free(base);
    free(again);
}

/* What is not an adapter folder of the adapter folder gets the 404 it got
 * before lazy loading: no such folder, a path, "..", a hidden name, a
 * symlink leading out; a folder that is not a valid adapter is refused by
 * the loader (400, naming the file, as the admin route refuses it);
 * --no-lazy-adapters turns it off. */
Test(server_gateway, only_adapter_folders_load_by_name)
{
    char link[700], broken[700], config[800];
    snprintf(link, sizeof link, "%s/outside", adapter_dir);
    cr_assert_eq(symlink(model_dir, link), 0);
    snprintf(broken, sizeof broken, "%s/broken", adapter_dir);
    cr_assert_eq(mkdir(broken, 0700), 0);
    snprintf(config, sizeof config, "%s/adapter_config.json", broken);
    FILE *f = fopen(config, "w");
    cr_assert(f);
    fputs("{\"r\": \"eight\"}", f);
    fclose(f);
    start();
    const char *refused[] = {"nope", "../tiny", "..", ".hidden", "outside", "ad/..", NULL};
    for (size_t i = 0; refused[i]; i++) {
        int status;
        char *text = complete(refused[i], &status);
        cr_assert_eq(status, 404, "%s: %d %s", refused[i], status, text);
        free(text);
    }
    int status;
    char *text = complete("broken", &status);
    cr_assert_eq(status, 400, "%d %s", status, text);
    cr_assert(strstr(text, "adapter_config.json"), "%s", text);
    free(text);
    bool found;
    cr_assert_eq(listed("ad", &found), 0);
    sp_stop_cleanly();
    char second_log[600];
    snprintf(second_log, sizeof second_log, "%.500s/no-lazy.log", dir);
    start_with((const char *[]){"--no-lazy-adapters", NULL}, second_log);
    text = complete("ad", &status);
    cr_assert_eq(status, 404, "%d %s", status, text);
    free(text);
}

/* The running_lora_adapters label of a /metrics scrape while a stream for
 * `model` is held running (allocated). */
static char *running_while_streaming(const char *model)
{
    hc_conn c;
    hc_response head;
    begin_held_stream(&c, &head, model);
    char *metrics = get("/metrics");
    char *running = label(metrics, "vllm:lora_requests_info", "running_lora_adapters");
    free(metrics);
    leave_held_stream(&c, &head);
    sp_hold_after(-1, NULL);
    return running;
}

/* Two replicas share one adapter folder: a request for an adapter neither
 * has loaded is answered by each (the same text: the same weights), and
 * each names it in running_lora_adapters while it runs; under a budget
 * that holds one such adapter, loading a second by name evicts the first,
 * which stays loadable. */
Test(server_gateway, two_replicas_share_one_adapter_folder)
{
    write_adapter("a1", 128, 21);
    write_adapter("a2", 128, 22);
    sp_server replica[2];
    char logs[2][600];
    /* f32 in memory: each adapter then takes more than half the budget
     * (bf16, the default, would fit both) */
    const char *const flags[] = {"--adapter-budget-mib", "1", "--adapter-dtype", "f32", NULL};
    for (int k = 0; k < 2; k++) {
        snprintf(logs[k], sizeof logs[k], "%.500s/replica%d.log", dir, k);
        start_with(flags, logs[k]);
        replica[k] = sp;
    }
    char *texts[2];
    for (int k = 0; k < 2; k++) {
        sp = replica[k];
        char *running = running_while_streaming("a1");
        cr_assert_str_eq(running, "a1", "replica %d", k);
        free(running);
        texts[k] = complete_ok("a1");
        bool found;
        cr_assert_eq(listed("a1", &found), 1);
        cr_assert(found);
    }
    cr_assert_str_eq(texts[1], texts[0]);
    /* replica 0: a2 by name, and a1 goes to make room */
    sp = replica[0];
    char *a2 = complete_ok("a2");
    bool found;
    cr_assert_eq(listed("a2", &found), 1, "a1 was not evicted under the budget");
    cr_assert(found);
    char *models = get("/v1/models?all=1");
    cr_assert(strstr(models, "\"a1\""), "a1 is no longer listed as loadable: %s", models);
    free(models);
    /* and comes back by name, the same */
    char *back = complete_ok("a1");
    cr_assert_str_eq(back, texts[0]);
    free(back);
    free(a2);
    free(texts[0]);
    free(texts[1]);
    sp = replica[1];
    sp_stop_cleanly();
    sp = replica[0];
}

/* With one running slot, a second adapter's request waits: the queue gauge
 * counts it and waiting_lora_adapters names its adapter, while
 * running_lora_adapters names the first's. The engine is held from
 * before the first request, so the first is still running when the
 * second comes. */
Test(server_gateway, a_waiting_request_names_its_adapter)
{
    write_adapter("second", 8, 11);
    start_with((const char *[]){"--max-running", "1", NULL}, log_path);
    sp_hold_after(0, NULL);
    hc_conn first, second;
    open_stream(&first, "ad");
    sp_engine_reaches("running", 1, NULL);
    open_stream(&second, "second");
    sp_engine_reaches("waiting", 1, NULL);
    sp_hold_after(0, NULL);
    char *m = get("/metrics");
    char *waiting = label(m, "vllm:lora_requests_info", "waiting_lora_adapters");
    char *running = label(m, "vllm:lora_requests_info", "running_lora_adapters");
    cr_assert_str_eq(waiting, "second", "the waiting request's adapter is not named waiting");
    cr_assert_str_eq(running, "ad");
    cr_assert_eq(sample(m, "vllm:num_requests_waiting "), 1);
    cr_assert_eq(sample(m, "vllm:num_requests_running "), 1);
    free(waiting);
    free(running);
    free(m);
    hc_close(&first);
    hc_close(&second);
    sp_hold_after(-1, NULL);
}

/*
 * test_server_gateway.c - what a router in front of many replicas reads
 * from qlserve (issue 17): the Kubernetes Gateway API Inference
 * Extension's model-server metrics scraped under load (requests waiting and
 * running, KV-cache use, the running and waiting adapters), and each
 * replica's identity (weights digest and merged configuration) in /info and
 * /metrics. Over loopback against the real binary on the tiny model, with
 * adapters made by tests/lora_fixture.h.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "http_client.h"
#include "lora_fixture.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512], model_dir[600], adapter_dir[600], log_path[600];

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
    eng_config cfg = lora_fix_config(&spec);
    lora_fix_spec ls = lora_fix_default();
    char folder[700];
    snprintf(folder, sizeof folder, "%s/ad", adapter_dir);
    lora_fix_write(folder, &cfg, &ls);
}

static void teardown(void)
{
    if (sp.pid > 0)
        sp_stop_cleanly();
    test_rmtree(dir);
}

TestSuite(server_gateway, .init = setup, .fini = teardown, .timeout = 120);

static void start(void)
{
    const char *argv[] = {
        QL_BINARY,  "serve", "--model",       model_dir,   "--port",       "0",    "--threads", "2",
        "--kv-mib", "16",    "--adapter-dir", adapter_dir, "--state-file", "none", NULL};
    sp_spawn(argv, log_path);
    sp_wait_ready();
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

/* While a stream for the adapter runs, the gateway's gauges show one
 * running request, the adapter among the running ones and KV blocks in use;
 * when the client goes, they are back to none. */
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
    cr_assert(hc_open(&c, sp.port));
    cr_assert(hc_send_request(&c, "POST", "/v1/completions", NULL,
                              "{\"model\": \"ad\", \"prompt\": \"the\", \"max_tokens\": 500, "
                              "\"ignore_eos\": true, \"stream\": true}"));
    hc_response head;
    cr_assert(hc_read_head(&c, &head));
    cr_assert_eq(head.status, 200, "%d", head.status);
    char *event = hc_next_event(&c, &head);
    cr_assert(event, "no first event");
    free(event);
    char *busy = get("/metrics");
    cr_log_info("under load: running %g, kv %g", sample(busy, "vllm:num_requests_running "),
                sample(busy, "vllm:kv_cache_usage_perc "));
    cr_assert_eq(sample(busy, "vllm:num_requests_running "), 1);
    cr_assert_gt(sample(busy, "vllm:kv_cache_usage_perc "), 0);
    cr_assert_gt(sample(busy, "vllm:lora_requests_info{"), 1.7e9, "the value is a wall time");
    char *running = label(busy, "vllm:lora_requests_info", "running_lora_adapters");
    cr_assert_str_eq(running, "ad");
    free(running);
    free(busy);
    hc_response_free(&head);
    hc_close(&c);

    bool idle_again = false;
    for (int waited = 0; waited < 5000 && !idle_again; waited += 50) {
        char *m = get("/metrics");
        char *names = label(m, "vllm:lora_requests_info", "running_lora_adapters");
        idle_again = sample(m, "vllm:num_requests_running ") == 0 &&
                     sample(m, "vllm:kv_cache_usage_perc ") == 0 && names[0] == 0;
        free(names);
        free(m);
        if (!idle_again)
            test_sleep_ms(50);
    }
    cr_assert(idle_again, "the gauges did not come back to idle after the client left");
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

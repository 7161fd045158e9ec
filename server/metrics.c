/*
 * metrics.c - the counters and histograms behind GET /metrics, in
 * Prometheus' text exposition format (version 0.0.4). Everything is
 * updated and read on the loop thread; the engine's own figures come from
 * its stats snapshot.
 *
 * Offers srv_metrics_init (server.h), srv_metrics_observe (bridge.c's
 * latencies) and srv_metrics_render (routes.c's GET /metrics); owns the
 * histogram bounds. Calls no other file of server/. Reads the engine's
 * stats and the adapter registry's state and list; writes nothing outside
 * the text it returns.
 */
#include "internal/metrics.h"
#include "internal/http.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Seconds: time to first token spans a queue wait; per-token latency is
 * milliseconds on a CPU; a request spans both. */
static const double ttft_bounds[SRV_HIST_BUCKETS] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                     1,    2.5,   5,    10,  30,   60};
static const double token_bounds[SRV_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04,
                                                      0.08,  0.16,   0.32,  0.64, 1.28, 2.56};
static const double request_bounds[SRV_HIST_BUCKETS] = {0.05, 0.1, 0.25, 0.5, 1,   2.5,
                                                        5,    10,  30,   60,  120, 300};
/* One turn of the event loop: a handful of callbacks is microseconds;
 * what holds every client shows from a few milliseconds up. */
static const double loop_turn_bounds[SRV_HIST_BUCKETS] = {
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5};

void srv_metrics_init(srv_metrics *m)
{
    memset(m, 0, sizeof *m);
    memcpy(m->ttft.bounds, ttft_bounds, sizeof ttft_bounds);
    memcpy(m->per_token.bounds, token_bounds, sizeof token_bounds);
    memcpy(m->request.bounds, request_bounds, sizeof request_bounds);
    memcpy(m->loop_turn.bounds, loop_turn_bounds, sizeof loop_turn_bounds);
}

void srv_metrics_observe(srv_hist *h, double seconds)
{
    int b = 0;
    while (b < SRV_HIST_BUCKETS && seconds > h->bounds[b])
        b++;
    h->counts[b]++;
    h->sum += seconds;
    h->n++;
}

typedef struct text {
    char *buf;
    size_t len, cap;
    bool failed;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...)
{
    if (t->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = true;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = 2 * t->cap + (size_t)n + 1;
        char *b = realloc(t->buf, cap);
        if (!b) {
            t->failed = true;
            return;
        }
        t->buf = b;
        t->cap = cap;
    }
}

size_t srv_prom_label_escape(char *out, size_t cap, const char *value)
{
    size_t need = 0, kept = 0; /* kept: what fits, whole escapes only */
    for (const char *v = value; *v; v++) {
        const char *esc = *v == '\\' ? "\\\\" : *v == '"' ? "\\\"" : *v == '\n' ? "\\n" : NULL;
        size_t n = esc ? 2 : 1;
        if (kept == need && need + n < cap) {
            memcpy(out + need, esc ? esc : v, n);
            kept += n;
        }
        need += n;
    }
    if (cap)
        out[kept] = 0;
    return need;
}

/* A series' name and labels, name{k1="v1",k2="v2"}, every value escaped
 * by srv_prom_label_escape (the one place a label value is written, so a
 * name a client or a file gave can never end the line and forge a series);
 * the caller puts " VALUE\n" after. The labels are key, value pairs,
 * ended by NULL. */
static void series(text *t, const char *name, ...) __attribute__((sentinel));
static void series(text *t, const char *name, ...)
{
    put(t, "%s", name);
    va_list ap;
    va_start(ap, name);
    const char *sep = "{";
    for (const char *key; (key = va_arg(ap, const char *)) != NULL; sep = ",") {
        const char *value = va_arg(ap, const char *);
        char small[256], *escaped = small;
        size_t need = srv_prom_label_escape(small, sizeof small, value);
        if (need >= sizeof small && (escaped = malloc(need + 1)) != NULL)
            srv_prom_label_escape(escaped, need + 1, value);
        if (!escaped)
            t->failed = true;
        else
            put(t, "%s%s=\"%s\"", sep, key, escaped);
        if (escaped != small)
            free(escaped);
    }
    va_end(ap);
    if (sep[0] == ',')
        put(t, "}");
}

static void metric(text *t, const char *name, const char *type, const char *help)
{
    put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void hist(text *t, const char *name, const char *help, const srv_hist *h)
{
    metric(t, name, "histogram", help);
    uint64_t cum = 0;
    char bucket[128], le[32];
    snprintf(bucket, sizeof bucket, "%s_bucket", name);
    for (int b = 0; b < SRV_HIST_BUCKETS; b++) {
        cum += h->counts[b];
        snprintf(le, sizeof le, "%g", h->bounds[b]);
        series(t, bucket, "le", le, NULL);
        put(t, " %llu\n", (unsigned long long)cum);
    }
    cum += h->counts[SRV_HIST_BUCKETS];
    series(t, bucket, "le", "+Inf", NULL);
    put(t, " %llu\n%s_sum %.6f\n%s_count %llu\n", (unsigned long long)cum, name, h->sum, name,
        (unsigned long long)h->n);
}

/* The server's own counters: responses, generations, merges, connections. */
static void put_server(text *t, const srv_server *s)
{
    const srv_metrics *m = &s->metrics;
    metric(t, "qlserve_http_responses_total", "counter", "HTTP responses by status code");
    for (int code = 100; code < 600; code++) {
        if (!m->by_status[code])
            continue;
        char text_code[8];
        snprintf(text_code, sizeof text_code, "%d", code);
        series(t, "qlserve_http_responses_total", "code", text_code, NULL);
        put(t, " %llu\n", (unsigned long long)m->by_status[code]);
    }
    metric(t, "qlserve_requests_total", "counter", "generation requests admitted by the engine");
    put(t, "qlserve_requests_total %llu\n", (unsigned long long)m->generations);
    metric(t, "qlserve_generated_tokens_total", "counter", "tokens generated");
    put(t, "qlserve_generated_tokens_total %llu\n", (unsigned long long)m->generated_tokens);
    metric(t, "qlserve_prompt_tokens_total", "counter", "prompt tokens read");
    put(t, "qlserve_prompt_tokens_total %llu\n", (unsigned long long)m->prompt_tokens);
    metric(t, "qlserve_cancelled_total", "counter", "generations cancelled");
    put(t, "qlserve_cancelled_total %llu\n", (unsigned long long)m->cancelled);
    metric(t, "qlserve_client_disconnects_total", "counter",
           "clients that left before their answer ended");
    put(t, "qlserve_client_disconnects_total %llu\n", (unsigned long long)m->disconnects);
    metric(t, "qlserve_held_bytes", "gauge",
           "bytes the unanswered generation requests may hold (against --max-held-bytes)");
    put(t, "qlserve_held_bytes %zu\n", s->held_bytes);
    metric(t, "qlserve_held_bytes_refused_total", "counter",
           "requests refused (503) past --max-held-bytes");
    put(t, "qlserve_held_bytes_refused_total %llu\n", (unsigned long long)m->held_bytes_refused);
    metric(t, "qlserve_merges_total", "counter", "adapter merges published");
    put(t, "qlserve_merges_total %llu\n", (unsigned long long)m->merges);
    metric(t, "qlserve_unmerges_total", "counter", "adapter unmerges published");
    put(t, "qlserve_unmerges_total %llu\n", (unsigned long long)m->unmerges);
    metric(t, "qlserve_merge_failures_total", "counter", "merges or unmerges refused");
    put(t, "qlserve_merge_failures_total %llu\n", (unsigned long long)m->merge_failures);
    metric(t, "qlserve_connections", "gauge", "open HTTP connections, closing ones included");
    put(t, "qlserve_connections %d\n", s->n_conns + s->n_closing);
    metric(t, "qlserve_connections_refused_total", "counter",
           "connections turned away at accept (503), by the bound they met");
    put(t, "qlserve_connections_refused_total{reason=\"max_connections\"} %llu\n",
        (unsigned long long)m->refused_max_connections);
    put(t, "qlserve_connections_refused_total{reason=\"per_peer\"} %llu\n",
        (unsigned long long)m->refused_per_peer);
    metric(t, "qlserve_connections_first_byte_timeouts_total", "counter",
           "new connections closed for beginning no request within --first-byte-timeout-ms");
    put(t, "qlserve_connections_first_byte_timeouts_total %llu\n",
        (unsigned long long)m->first_byte_timeouts);
    metric(t, "qlserve_connections_closing", "gauge",
           "connections ended whose last bytes are still going out");
    put(t, "qlserve_connections_closing %d\n", s->n_closing);
    size_t buffered = 0;
    for (const srv_conn *c = s->conns; c; c = c->next)
        buffered += c->pending_len + srv_http_backlog(c);
    metric(t, "qlserve_connection_buffered_bytes", "gauge",
           "bytes held for open connections: pipelined input not yet parsed, output not yet "
           "taken by the client");
    put(t, "qlserve_connection_buffered_bytes %zu\n", buffered);
}

/*
 * What the Kubernetes Gateway API Inference Extension's endpoint picker
 * scrapes from a model server (its model-server protocol), under the names
 * vLLM gives them, which the protocol recommends: requests waiting and
 * running, the share of the KV cache in use (0..1; both vLLM's current name
 * and its older one, which earlier pickers read), and the LoRA affinity
 * info, a gauge whose labels are what a batch can hold (max_lora: every
 * running slot may carry its own adapter) and the adapters of the running
 * and waiting requests, and whose value is when they were read (the
 * picker takes the newest series). Adapter names are letters, digits,
 * '-', '_' and '.' (lora_name_valid, at load and at the journal's replay),
 * and are escaped all the same, as every label value is (series).
 */
static double wall_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void put_gateway(text *t, const srv_server *s, const eng_engine_stats *st)
{
    metric(t, "vllm:num_requests_waiting", "gauge", "requests waiting for admission");
    put(t, "vllm:num_requests_waiting %d\n", st->waiting);
    metric(t, "vllm:num_requests_running", "gauge", "sequences in the running batch");
    put(t, "vllm:num_requests_running %d\n", st->running);
    double used = st->kv_blocks_total > 0 ? (double)st->kv_blocks_used / st->kv_blocks_total : 0;
    metric(t, "vllm:kv_cache_usage_perc", "gauge", "share of KV cache blocks in use (1: all)");
    put(t, "vllm:kv_cache_usage_perc %.6f\n", used);
    metric(t, "vllm:gpu_cache_usage_perc", "gauge",
           "share of KV cache blocks in use (1: all; vLLM's older name)");
    put(t, "vllm:gpu_cache_usage_perc %.6f\n", used);
    metric(t, "vllm:lora_requests_info", "gauge",
           "adapters of the running and waiting requests; the value is when they were read");
    char max_lora[16];
    snprintf(max_lora, sizeof max_lora, "%d", s->cfg->max_running);
    series(t, "vllm:lora_requests_info", "max_lora", max_lora, "running_lora_adapters",
           st->running_adapters, "waiting_lora_adapters", st->waiting_adapters, NULL);
    put(t, " %.3f\n", wall_seconds());
}

/* One counter series per drafter label. */
static void put_counter(text *t, const char *name, const char *drafter, uint64_t value)
{
    series(t, name, "drafter", drafter, NULL);
    put(t, " %llu\n", (unsigned long long)value);
}

/* A counter of one series per drafter label, with its HELP and TYPE lines. */
static void spec_counter(text *t, const char *name, const char *help, const char *drafter,
                         uint64_t value)
{
    metric(t, name, "counter", help);
    put_counter(t, name, drafter, value);
}

/* Speculative decoding's counters (labelled with the drafter that runs, "off" when none),
 * under qlserve's names and vLLM's spec_decode ones, and the acceptance length of each
 * verification as a histogram of whole tokens. */
static void put_spec(text *t, const eng_spec_stats *sp)
{
    const char *d = ql_name_of(&ql_speculative_names, (int)sp->drafter);
    spec_counter(t, "qlserve_spec_decode_drafts_total",
                 "verifications: a sequence's step that carried drafted tokens", d, sp->drafts);
    spec_counter(t, "qlserve_spec_decode_drafted_tokens_total", "tokens the drafter proposed", d,
                 sp->drafted);
    spec_counter(t, "qlserve_spec_decode_verified_tokens_total",
                 "drafted tokens run through the model (the rest cut by a grammar's mask first)", d,
                 sp->verified);
    spec_counter(t, "qlserve_spec_decode_accepted_tokens_total",
                 "verified tokens the model accepted", d, sp->accepted);
    spec_counter(t, "qlserve_spec_decode_memory_verified_tokens_total",
                 "of the verified tokens, those the n-gram drafter's memory of earlier answers "
                 "drafted",
                 d, sp->memory_verified);
    spec_counter(t, "qlserve_spec_decode_memory_accepted_tokens_total",
                 "of the accepted tokens, those the memory of earlier answers drafted", d,
                 sp->memory_accepted);
    const char *len = "qlserve_spec_decode_acceptance_length";
    char name[64];
    metric(t, len, "histogram", "drafted tokens each verification accepted");
    snprintf(name, sizeof name, "%s_bucket", len);
    uint64_t below = 0, sum = 0;
    for (int i = 0; i <= ENG_SPEC_MAX_DRAFT + 1; i++) {
        char le[8];
        snprintf(le, sizeof le, "%d", i);
        if (i <= ENG_SPEC_MAX_DRAFT) {
            below += sp->accepted_len[i];
            sum += (uint64_t)i * sp->accepted_len[i];
        }
        series(t, name, "drafter", d, "le", i <= ENG_SPEC_MAX_DRAFT ? le : "+Inf", NULL);
        put(t, " %llu\n", (unsigned long long)below);
    }
    snprintf(name, sizeof name, "%s_sum", len);
    put_counter(t, name, d, sum);
    snprintf(name, sizeof name, "%s_count", len);
    put_counter(t, name, d, below);
    /* vLLM's names (its v1 engine's SpecDecodingProm), for dashboards made for it */
    metric(t, "vllm:spec_decode_num_drafts_total", "counter", "verifications (qlserve's drafts)");
    put(t, "vllm:spec_decode_num_drafts_total %llu\n", (unsigned long long)sp->drafts);
    metric(t, "vllm:spec_decode_num_draft_tokens_total", "counter", "drafted tokens verified");
    put(t, "vllm:spec_decode_num_draft_tokens_total %llu\n", (unsigned long long)sp->verified);
    metric(t, "vllm:spec_decode_num_accepted_tokens_total", "counter", "drafted tokens accepted");
    put(t, "vllm:spec_decode_num_accepted_tokens_total %llu\n", (unsigned long long)sp->accepted);
    metric(t, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "verifications whose drafted token at this position was accepted");
    for (int i = 0; i < ENG_SPEC_MAX_DRAFT; i++) {
        char pos[8];
        snprintf(pos, sizeof pos, "%d", i);
        series(t, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position", pos, NULL);
        put(t, " %llu\n", (unsigned long long)sp->accepted_pos[i]);
    }
}

/* The engine's gauges, from its stats snapshot. */
_Static_assert(ENG_STEP_BUCKETS == SRV_HIST_BUCKETS, "the step histogram reuses srv_hist");

static void put_engine(text *t, const srv_server *s)
{
    eng_engine_stats st;
    eng_engine_stats_get(s->engine, &st);
    put_gateway(t, s, &st);
    metric(t, "qlserve_queue_depth", "gauge", "requests waiting for admission");
    put(t, "qlserve_queue_depth %d\n", st.waiting);
    metric(t, "qlserve_batch_size", "gauge", "sequences in the running batch");
    put(t, "qlserve_batch_size %d\n", st.running);
    metric(t, "qlserve_kv_blocks_used", "gauge", "KV cache blocks in use");
    put(t, "qlserve_kv_blocks_used %d\n", st.kv_blocks_used);
    metric(t, "qlserve_kv_blocks_total", "gauge", "KV cache blocks in all");
    put(t, "qlserve_kv_blocks_total %d\n", st.kv_blocks_total);
    metric(t, "qlserve_recurrent_states_used", "gauge",
           "recurrent states (a hybrid model's linear layers, one per sequence) in use");
    put(t, "qlserve_recurrent_states_used %d\n", st.states_used);
    metric(t, "qlserve_recurrent_states_total", "gauge",
           "recurrent states in all, out of the KV cache's bytes");
    put(t, "qlserve_recurrent_states_total %d\n", st.states_total);
    metric(t, "qlserve_prefilled_tokens_total", "counter",
           "prompt tokens run through the model (a prompt of n choices once)");
    put(t, "qlserve_prefilled_tokens_total %llu\n", (unsigned long long)st.prompt_tokens);
    metric(t, "qlserve_kv_blocks_shared_total", "counter",
           "KV blocks a request's further choices shared from its first instead of computing");
    put(t, "qlserve_kv_blocks_shared_total %llu\n", (unsigned long long)st.kv_blocks_shared);
    /* the engine's steps, to tell a slow step from a slow path to the client
     * when per-token latency has a long tail */
    srv_hist steps = {.sum = st.step_seconds};
    memcpy(steps.bounds, eng_step_bounds, sizeof steps.bounds);
    for (int b = 0; b <= SRV_HIST_BUCKETS; b++) {
        steps.counts[b] = st.step_counts[b];
        steps.n += st.step_counts[b];
    }
    hist(t, "qlserve_step_seconds",
         "engine steps (forward pass, sampling, streaming out) by wall time", &steps);
    /* the step budget: how many prompt tokens a step carries beside decode tokens */
    metric(t, "qlserve_step_budget_prefill_tokens", "gauge",
           "prompt tokens the last step with decode tokens could carry beside them");
    put(t, "qlserve_step_budget_prefill_tokens %d\n", st.prefill_budget);
    metric(t, "qlserve_step_budget_target_seconds", "gauge",
           "the step time that budget aimed at (0: a fixed --max-prefill-per-step)");
    put(t, "qlserve_step_budget_target_seconds %.6f\n", st.step_target_s);
    metric(t, "qlserve_step_cost_fixed_seconds", "gauge",
           "a step's fitted cost whatever its tokens (the recent steps' least squares)");
    put(t, "qlserve_step_cost_fixed_seconds %.6f\n", st.step_fixed_s);
    metric(t, "qlserve_step_cost_token_seconds", "gauge", "a step's fitted cost per token");
    put(t, "qlserve_step_cost_token_seconds %.9f\n", st.step_token_s);
    metric(t, "qlserve_step_budget_held_steps_total", "counter",
           "steps with decode tokens that left prompt tokens for later steps (chunked prefill)");
    put(t, "qlserve_step_budget_held_steps_total %llu\n",
        (unsigned long long)st.prefill_held_steps);
    metric(t, "qlserve_moe_experts_run_total", "counter",
           "experts a mixture-of-experts model ran, each once per layer and step for all the "
           "tokens routed to it (0 for a dense model)");
    put(t, "qlserve_moe_experts_run_total %llu\n", (unsigned long long)st.experts_run);
    metric(t, "qlserve_moe_expert_bytes_total", "counter",
           "bytes of expert weights those runs read");
    put(t, "qlserve_moe_expert_bytes_total %llu\n", (unsigned long long)st.expert_bytes);
    metric(t, "qlserve_prefix_cache_queries_total", "counter",
           "prompt tokens looked up in the prefix cache");
    put(t, "qlserve_prefix_cache_queries_total %llu\n",
        (unsigned long long)st.prefix_queried_tokens);
    metric(t, "qlserve_prefix_cache_hits_total", "counter",
           "prompt tokens whose KV the prefix cache gave");
    put(t, "qlserve_prefix_cache_hits_total %llu\n", (unsigned long long)st.prefix_hit_tokens);
    metric(t, "qlserve_prefix_cache_blocks", "gauge",
           "KV blocks the prefix cache keeps (free for new writes all the same)");
    put(t, "qlserve_prefix_cache_blocks %d\n", st.prefix_blocks);
    metric(t, "qlserve_grammar_masks_total", "counter",
           "Tokens drawn under a grammar (response_format, TGI grammar, forced tool calls)");
    put(t, "qlserve_grammar_masks_total %llu\n", (unsigned long long)st.grammar_masks);
    metric(t, "qlserve_grammar_mask_seconds_total", "counter",
           "Time the grammars' vocabulary masks took, summed over those draws");
    put(t, "qlserve_grammar_mask_seconds_total %.6f\n", st.grammar_seconds);
    metric(t, "qlserve_grammar_matcher_steps_total", "counter",
           "Work the grammars' masks took, in matcher steps (one request may take a budget of "
           "them per engine step)");
    put(t, "qlserve_grammar_matcher_steps_total %llu\n", (unsigned long long)st.grammar_steps);
    metric(t, "qlserve_kv_blocks_copied_total", "counter",
           "KV blocks copied because a choice wrote into a shared one (copy on write)");
    put(t, "qlserve_kv_blocks_copied_total %llu\n", (unsigned long long)st.kv_blocks_copied);
    metric(t, "qlserve_engine_steps_total", "counter", "forward steps run");
    put(t, "qlserve_engine_steps_total %llu\n", (unsigned long long)st.steps);
    metric(t, "qlserve_weights_version", "gauge", "the serving weight version");
    put(t, "qlserve_weights_version %llu\n", (unsigned long long)st.weights_version);
    metric(t, "qlserve_weights_versions_alive", "gauge",
           "weight versions in use (older ones finish running sequences)");
    put(t, "qlserve_weights_versions_alive %d\n", st.weights_versions);
    metric(t, "qlserve_unmerged_adapter_requests_total", "counter",
           "sequences that applied an adapter unmerged");
    put(t, "qlserve_unmerged_adapter_requests_total %llu\n",
        (unsigned long long)st.adapter_requests);
    put_spec(t, &st.spec);
}

/* The adapter registry's gauges, and per adapter its requests and last merge. */
static void put_registry(text *t, lora_registry *registry)
{
    lora_state st;
    lora_registry_state(registry, &st);
    metric(t, "qlserve_adapters_loaded", "gauge", "adapters in the registry");
    put(t, "qlserve_adapters_loaded %zu\n", st.n_loaded);
    metric(t, "qlserve_adapter_bytes", "gauge", "memory the loaded adapters hold");
    put(t, "qlserve_adapter_bytes %zu\n", st.bytes);
    metric(t, "qlserve_adapters_merged", "gauge", "adapters merged into the serving weights");
    put(t, "qlserve_adapters_merged %zu\n", st.n_merged);
    /* which replicas are interchangeable: the digest of the serving
     * weights and the merged configuration that made them */
    char merged[ENG_MAX_MERGED * 160] = "";
    for (size_t i = 0, len = 0; i < st.n_merged && i < ENG_MAX_MERGED && len < sizeof merged; i++)
        len += (size_t)snprintf(merged + len, sizeof merged - len, "%s%s:%g", i ? "," : "",
                                st.merged[i].name, (double)st.merged[i].scale);
    metric(t, "qlserve_weights_info", "gauge",
           "1, labelled with the serving weights' digest and merged configuration");
    char digest[20];
    snprintf(digest, sizeof digest, "%016llx", (unsigned long long)st.digest);
    series(t, "qlserve_weights_info", "digest", digest, "merged", merged, NULL);
    put(t, " 1\n");
    lora_info *list = NULL;
    size_t n = 0;
    if (lora_registry_list(registry, &list, &n) == QL_OK) {
        metric(t, "qlserve_adapter_requests_total", "counter",
               "sequences that asked for each adapter");
        for (size_t i = 0; i < n; i++) {
            series(t, "qlserve_adapter_requests_total", "adapter", list[i].name, NULL);
            put(t, " %llu\n", (unsigned long long)list[i].requests);
        }
        metric(t, "qlserve_merge_delta_retained", "gauge",
               "share of the adapter's delta its last merge kept (1: all)");
        for (size_t i = 0; i < n; i++) {
            if (list[i].last_merge.delta_sq > 0) {
                series(t, "qlserve_merge_delta_retained", "adapter", list[i].name, NULL);
                put(t, " %.6f\n", list[i].last_merge.delta_retained);
            }
        }
        metric(t, "qlserve_merge_seconds", "gauge",
               "how long the adapter's last merge took to build its weight version");
        for (size_t i = 0; i < n; i++) {
            if (list[i].last_merge.delta_sq > 0) {
                series(t, "qlserve_merge_seconds", "adapter", list[i].name, NULL);
                put(t, " %.6f\n", list[i].last_merge_seconds);
            }
        }
        metric(t, "qlserve_merge_relative_error", "gauge",
               "|Q(W+delta) - (W+delta)| / |delta| of the adapter's last merge");
        for (size_t i = 0; i < n; i++) {
            if (list[i].last_merge.delta_sq > 0) {
                series(t, "qlserve_merge_relative_error", "adapter", list[i].name, NULL);
                put(t, " %.6f\n", list[i].last_merge.relative_error);
            }
        }
    }
    free(list);
}

char *srv_metrics_render(const srv_server *s, size_t *len)
{
    text t = {.cap = 8192};
    t.buf = malloc(t.cap);
    if (!t.buf)
        return NULL;
    const srv_metrics *m = &s->metrics;
    put_server(&t, s);
    if (s->engine)
        put_engine(&t, s);
    if (s->registry)
        put_registry(&t, s->registry);
    hist(&t, "qlserve_time_to_first_token_seconds", "submit to the first token", &m->ttft);
    hist(&t, "qlserve_time_per_output_token_seconds", "between two tokens of one request",
         &m->per_token);
    hist(&t, "qlserve_request_duration_seconds", "submit to the last token", &m->request);
    hist(&t, "qlserve_event_loop_turn_cpu_seconds",
         "CPU time of the event loop thread in one turn of the loop (its callbacks, not its wait)",
         &m->loop_turn);
    metric(&t, "qlserve_event_loop_turn_cpu_seconds_max", "gauge",
           "the longest turn of the event loop so far, in CPU seconds of its thread");
    put(&t, "qlserve_event_loop_turn_cpu_seconds_max %.6f\n", m->loop_turn_max);
    if (t.failed) {
        free(t.buf);
        return NULL;
    }
    *len = t.len;
    return t.buf;
}

/*
 * test_server_bounds.c - a request's cost is bounded before anything is
 * built for it, and built off the event loop (issue 30's first and third
 * rows), over loopback against the real binary on the tiny model
 * (tests/tiny_model.h).
 *
 * Stop strings past their bounds are a 400 naming "stop" and the bound,
 * whatever n; a request at the bounds (the most stop bytes, many choices)
 * costs little while it waits, since its choices share one copy of its
 * stop strings; past the server's budget of bytes held by unanswered
 * requests (--max-held-bytes) a request is a 503 with Retry-After, before
 * it is built; prompt logprobs past their bounds (tokens scored, entries
 * answered) are a 400 naming the field. Requests are held waiting or
 * running at the engine's gate (sp_hold_after), never by timing; no turn
 * of the event loop takes long meanwhile (its CPU time per turn, the
 * server's own measure, whatever the machine's speed), and the server
 * serves after.
 */
#include <criterion/criterion.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_watch.h"
#include "tiny_server.h"

TestSuite(server_bounds, .fini = ts_teardown, .timeout = 120);

/* Serve the tiny model with `extra` flags (NULL-ended, or NULL). */
static void start(const char *const *extra)
{
    ts_start_with(TS_JOIN_TEMPLATE, extra);
}

/* The server answers /health and a small completion: it serves. */
static void still_serves(void)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/health", NULL, NULL, &r));
    cr_assert_eq(r.status, 200);
    hc_response_free(&r);
    cJSON_Delete(ts_ok("/v1/completions", "{\"prompt\": \"ab\", \"max_tokens\": 2}"));
}

/* A completion's body: n choices, `stops` stop strings of `stop_len`
 * bytes each (distinct), max_tokens (malloc'd). */
static char *stops_body(int n, int stops, size_t stop_len, int max_tokens)
{
    size_t cap = 256 + (size_t)stops * (stop_len + 4);
    char *b = malloc(cap), *o = b;
    cr_assert(b);
    o += sprintf(o, "{\"prompt\": \"ab\", \"n\": %d, \"max_tokens\": %d, \"stop\": [", n,
                 max_tokens);
    for (int i = 0; i < stops; i++) {
        *o++ = i ? ',' : ' ';
        *o++ = '"';
        memset(o, 'a' + i, stop_len);
        o += stop_len;
        *o++ = '"';
    }
    strcpy(o, "]}");
    return b;
}

/* Issue 30's first row: n 64 with 8 stop strings of 120 KB (a body just
 * under 1 MiB) held 560 MB per request, built on the event loop. Now a
 * 400 naming "stop" and the bound per string, and then in all; the
 * server's RSS does not move, no loop turn is slow, and it serves after. */
Test(server_bounds, stop_strings_past_their_bounds_are_refused_at_once)
{
    start(NULL);
    long before = rss_kib();
    double slow = slow_loop_turns(NULL);
    char *body = stops_body(64, 8, 120000, 16);
    for (int i = 0; i < 4; i++)
        ts_refused("/v1/completions", body,
                   "\"stop\": a stop string of 120000 bytes; at most 4096 bytes each");
    free(body);
    /* each at the bound, but over it in all */
    body = stops_body(1, 3, 4096, 16);
    ts_refused("/v1/completions", body, "\"stop\": the stop strings have over 8192 bytes in all");
    free(body);
    long during = rss_kib();
    cr_log_info("4 requests of n 64 with 8 stops of 120 KB: RSS +%ld KiB", during - before);
    cr_assert(SANITIZED || during - before < 32 * 1024, "RSS grew by %ld KiB", during - before);
    expect_no_slow_turn(slow);
    still_serves();
}

#define HELD 8

/* A request at the bounds: 8 stop strings, 8 KiB of them in all, and 64
 * choices. HELD of them wait at the engine's gate: their choices share
 * one copy of the stop strings (5 bytes a byte, once), where each choice
 * held its own at 9 bytes a byte (4.7 MB a request). They cost little,
 * the loop stays quick while they are built, and all are answered. */
Test(server_bounds, a_request_at_the_stop_bounds_costs_little_while_it_waits)
{
    start(NULL);
    sp_hold_after(0, NULL);
    long before = rss_kib();
    double slow = slow_loop_turns(NULL);
    char *body = stops_body(64, 8, 1024, 4);
    hc_conn conns[HELD];
    for (int i = 0; i < HELD; i++) {
        cr_assert(hc_open(&conns[i], sp.port));
        cr_assert(hc_send_request(&conns[i], "POST", "/v1/completions", NULL, body));
    }
    /* all in the engine: one admitted (64 running slots), the rest waiting */
    sp_engine_reaches("waiting", HELD - 1, NULL);
    long during = rss_kib();
    cr_log_info("%d requests of n 64 with 8 KiB of stops, held: RSS +%ld KiB", HELD,
                during - before);
    cr_assert(SANITIZED || during - before < 16 * 1024, "RSS grew by %ld KiB", during - before);
    expect_no_slow_turn(slow);
    sp_hold_after(-1, NULL);
    for (int i = 0; i < HELD; i++) {
        hc_response r;
        cr_assert(hc_read_response(&conns[i], &r));
        cr_assert_eq(r.status, 200, "%d %s", r.status, r.body ? r.body : "");
        hc_response_free(&r);
        hc_close(&conns[i]);
    }
    free(body);
    still_serves();
}

/* Whether the server has answered on c yet (without waiting). */
static bool answered(const hc_conn *c)
{
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    return c->len > 0 || poll(&p, 1, 0) > 0;
}

/* Past --max-held-bytes (the bytes unanswered requests may hold, figured
 * before anything is built for them) a request is a 503 with Retry-After
 * naming the flag, counted in /metrics; those within it are answered when
 * the engine runs, and their bytes come back, so the next one is taken. */
Test(server_bounds, past_the_held_bytes_budget_a_request_is_a_503_with_retry_after)
{
    /* a request of 4 choices of 256 tokens figures about 75 KB */
    start((const char *[]){"--max-held-bytes", "200000", NULL});
    sp_hold_after(0, NULL);
    const char *body = "{\"prompt\": \"ab\", \"n\": 4, \"max_tokens\": 256}";
    hc_conn conns[8];
    int taken = 0, refused = -1;
    for (int i = 0; i < 8 && refused < 0; i++) {
        cr_assert(hc_open(&conns[i], sp.port));
        double held = gauge("qlserve_held_bytes");
        cr_assert(hc_send_request(&conns[i], "POST", "/v1/completions", NULL, body));
        /* taken (its bytes counted) or answered (refused): a state, not a time */
        for (int tries = 0; tries < 60000; tries++) {
            if (answered(&conns[i])) {
                refused = i;
                break;
            }
            if (gauge("qlserve_held_bytes") > held) {
                taken++;
                break;
            }
            test_sleep_ms(1);
        }
    }
    cr_assert_geq(refused, 1, "no request was refused, or the first was (%d taken)", taken);
    cr_assert_eq(taken, refused);
    hc_response r;
    cr_assert(hc_read_response(&conns[refused], &r));
    cr_assert_eq(r.status, 503, "%d %s", r.status, r.body ? r.body : "");
    cr_assert(strstr(r.body, "--max-held-bytes"), "%s", r.body);
    char retry[32];
    cr_assert(hc_header(&r, "Retry-After", retry, sizeof retry), "%s", r.head);
    hc_response_free(&r);
    hc_close(&conns[refused]);
    cr_assert_eq(gauge("qlserve_held_bytes_refused_total"), 1);
    sp_hold_after(-1, NULL);
    for (int i = 0; i < taken; i++) {
        cr_assert(hc_read_response(&conns[i], &r));
        cr_assert_eq(r.status, 200, "%d %s", r.status, r.body ? r.body : "");
        hc_response_free(&r);
        hc_close(&conns[i]);
    }
    cr_assert_eq(gauge("qlserve_held_bytes"), 0);
    cJSON_Delete(ts_ok("/v1/completions", body));
}

/* An echo request scoring `prompts` prompts of `ids` token ids each, with
 * `logprobs` alternatives and max_tokens 0 (malloc'd). */
static char *echo_body(int prompts, int ids, int logprobs)
{
    char *b = malloc(128 + (size_t)prompts * ((size_t)ids * 4 + 4)), *o = b;
    cr_assert(b);
    o +=
        sprintf(o, "{\"echo\": true, \"logprobs\": %d, \"max_tokens\": 0, \"prompt\": [", logprobs);
    for (int p = 0; p < prompts; p++) {
        *o++ = p ? ',' : ' ';
        *o++ = '[';
        for (int i = 0; i < ids; i++)
            o += sprintf(o, i ? ",%d" : "%d", 40 + (p + i) % 200);
        *o++ = ']';
    }
    strcpy(o, "]}");
    return b;
}

/* Issue 30's prompt-logprobs row: 8 prompts of 1000 ids with echo,
 * logprobs 20 and max_tokens 0 took 59 s of engine time and a 4.5 MB
 * answer. Past SRV_MAX_PROMPT_LOGPROB_TOKENS (4096 tokens scored per
 * request) or _ENTRIES (32768: tokens x (1 + alternatives)) it is a 400
 * naming the field and the bound; within them it is answered. */
Test(server_bounds, prompt_logprobs_past_their_bounds_are_a_400_naming_the_field)
{
    start(NULL);
    struct {
        int prompts, ids, logprobs;
        const char *message;
    } past[] = {
        {64, 100, 0,
         "\"echo\" with \"logprobs\" would score 6400 prompt tokens; at most 4096 per request"},
        {8, 200, 20,
         "\"echo\" with \"logprobs\" would answer 1600 prompt tokens x 20 alternatives (33600 "
         "entries); at most 32768"},
    };
    for (size_t k = 0; k < sizeof past / sizeof past[0]; k++) {
        char *body = echo_body(past[k].prompts, past[k].ids, past[k].logprobs);
        ts_refused("/v1/completions", body, past[k].message);
        free(body);
    }
    char *body = echo_body(4, 100, 5); /* 400 tokens x 6 */
    cJSON_Delete(ts_ok("/v1/completions", body));
    free(body);
    still_serves();
}

/* The other fields that scale an answer or a request's work: echo with
 * many choices (each answer repeats the prompt's text: at most
 * SRV_MAX_ECHO_BYTES, 16 MiB, in all) and tools (at most 128, OpenAI's
 * limit): a 400 naming the field and the bound, before anything is built. */
Test(server_bounds, echo_and_tools_past_their_bounds_are_a_400_naming_the_field)
{
    start(NULL);
    size_t len = 300000; /* x 64 choices: over 16 MiB */
    char *body = malloc(len + 128);
    cr_assert(body);
    int at = sprintf(body, "{\"echo\": true, \"n\": 64, \"max_tokens\": 1, \"prompt\": \"");
    memset(body + at, 'a', len);
    strcpy(body + at + len, "\"}");
    ts_refused("/v1/completions", body,
               "\"echo\" (TGI's return_full_text) would repeat 19200000 bytes of prompt text in "
               "the answer (each prompt's text once per choice); at most 16777216");
    free(body);
    const char *tool = "{\"type\": \"function\", \"function\": {\"name\": \"f\"}}";
    body = malloc(128 + 129 * (strlen(tool) + 1));
    cr_assert(body);
    char *o = body + sprintf(body, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                                   "\"max_tokens\": 1, \"tools\": [");
    for (int i = 0; i < 129; i++)
        o += sprintf(o, "%s%s", i ? "," : "", tool);
    strcpy(o, "]}");
    ts_refused("/v1/chat/completions", body, "\"tools\" lists 129 tools; at most 128");
    free(body);
    still_serves();
}

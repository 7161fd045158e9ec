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
#include <signal.h>
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

/* A completion whose whole answer is a few MB of JSON: 64 choices of 96
 * tokens (ignore_eos: all of them), each with logprobs 20 and echo (the
 * prompt's logprobs too); about 3 MB printed. */
#define LARGE_ANSWER                                                                               \
    "{\"prompt\": \"ab\", \"n\": 64, \"max_tokens\": 192, \"ignore_eos\": true, \"logprobs\": "    \
    "20, \"echo\": true, \"temperature\": 1.0, \"seed\": 7}"
#define LARGE_CHOICES 64
#define LARGE_TOKENS  192

/* The bytes unanswered requests hold fall back to 0 (a request's end is
 * on its way to the loop: polled, a bound for a broken server). */
static void held_bytes_fall_to_zero(void)
{
    double held = gauge("qlserve_held_bytes");
    for (int i = 0; i < 30000 && held > 0; i++) {
        test_sleep_ms(1);
        held = gauge("qlserve_held_bytes");
    }
    cr_assert_eq(held, 0, "%.0f bytes still held", held);
}

/* Issue 30's "large JSON is serialized on the pool", for whole answers: a
 * completion of 64 choices with logprobs 20 and echo (about 3 MB of JSON,
 * over 150 ms of the loop's CPU when built and printed there) is answered
 * whole and right (every choice, every token's logprob and alternatives),
 * and no turn of the event loop took long meanwhile; a TGI answer with
 * details of 8 candidates and a chat answer with logprobs, both large
 * enough for the pool too, are whole and right. */
Test(server_bounds, a_large_whole_answer_is_built_off_the_event_loop)
{
    start(NULL);
    double slow = slow_loop_turns(NULL);
    int status;
    char *text = sp_answer("/v1/completions", LARGE_ANSWER, &status);
    cr_assert_eq(status, 200, "%d %.200s", status, text);
    size_t bytes = strlen(text);
    cr_log_info("a whole answer of %zu bytes", bytes);
    cr_assert_gt(bytes, (size_t)1 << 20);
    cJSON *j = sp_json(text);
    free(text);
    expect_no_slow_turn(slow);
    const cJSON *choices = cJSON_GetObjectItem(j, "choices");
    cr_assert_eq(cJSON_GetArraySize(choices), LARGE_CHOICES);
    int prompt_tokens = (int)sp_num_at(cJSON_GetObjectItem(j, "usage"), "prompt_tokens");
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(j, "usage"), "completion_tokens"),
                 LARGE_CHOICES * LARGE_TOKENS);
    int i = 0, entries = 0;
    for (const cJSON *ch = choices->child; ch; ch = ch->next, i++) {
        cr_assert_eq(sp_num_at(ch, "index"), i);
        const cJSON *lp = cJSON_GetObjectItem(ch, "logprobs");
        const cJSON *top = cJSON_GetObjectItem(lp, "top_logprobs");
        cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")),
                     prompt_tokens + LARGE_TOKENS);
        cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "token_logprobs")),
                     prompt_tokens + LARGE_TOKENS);
        cr_assert_eq(cJSON_GetArraySize(top), prompt_tokens + LARGE_TOKENS);
        /* the prompt's first token has no logprob; every other one has its
         * 20 alternatives and itself, those of one text shown once (the
         * tiny tokenizer's special tokens all show as "") */
        cr_assert(cJSON_IsNull(cJSON_GetArrayItem(top, 0)));
        for (int k = 1; k < prompt_tokens + LARGE_TOKENS; k++) {
            int alts = cJSON_GetArraySize(cJSON_GetArrayItem(top, k));
            cr_assert(alts >= 1 && alts <= 21, "choice %d token %d: %d alternatives", i, k, alts);
            entries += alts;
        }
    }
    cr_log_info("%d alternatives in all", entries);
    cr_assert_gt(entries, LARGE_CHOICES * LARGE_TOKENS * 10);
    cJSON_Delete(j);

    /* TGI: the best of 8 candidates with every token, 20 alternatives each,
     * and the prompt's (about 1.5 MB figured: the pool's) */
    j = ts_ok("/generate", "{\"inputs\": \"ab\", \"parameters\": {\"max_new_tokens\": 64, "
                           "\"best_of\": 8, \"do_sample\": true, \"details\": true, "
                           "\"decoder_input_details\": true, \"top_n_tokens\": 20}}");
    const cJSON *d = cJSON_GetObjectItem(j, "details");
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(d, "best_of_sequences")), 7);
    int generated = (int)sp_num_at(d, "generated_tokens");
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(d, "tokens")), generated);
    const cJSON *tops = cJSON_GetObjectItem(d, "top_tokens");
    cr_assert_eq(cJSON_GetArraySize(tops), generated);
    for (const cJSON *t = tops->child; t; t = t->next)
        cr_assert_eq(cJSON_GetArraySize(t), 20);
    cr_assert_gt(cJSON_GetArraySize(cJSON_GetObjectItem(d, "prefill")), 0);
    cJSON_Delete(j);

    /* chat: 8 choices of up to 64 tokens with 20 alternatives each */
    j = ts_ok(
        "/v1/chat/completions",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"ab\"}], \"n\": 8, "
        "\"max_tokens\": 64, \"ignore_eos\": true, \"logprobs\": true, \"top_logprobs\": 20}");
    choices = cJSON_GetObjectItem(j, "choices");
    cr_assert_eq(cJSON_GetArraySize(choices), 8);
    for (const cJSON *ch = choices->child; ch; ch = ch->next) {
        const cJSON *content = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "content");
        cr_assert_eq(cJSON_GetArraySize(content), 64);
        for (const cJSON *e = content->child; e; e = e->next)
            cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(e, "top_logprobs")), 20);
    }
    cJSON_Delete(j);
    expect_no_slow_turn(slow);
    held_bytes_fall_to_zero();
    still_serves();
}

/* LARGE_ANSWER sent on a new connection c, held at the engine's gate
 * until it runs, then let go until the engine has nothing left: its
 * generation has ended, and its answer is being built or has been. */
static void send_until_generated(hc_conn *c)
{
    sp_hold_after(0, NULL);
    cr_assert(hc_open(c, sp.port));
    cr_assert(hc_send_request(c, "POST", "/v1/completions", NULL, LARGE_ANSWER));
    sp_engine_reaches("running", 1, NULL);
    sp_hold_after(-1, NULL);
    sp_engine_falls_to("running", 0, NULL);
}

/* A client that leaves once its generation has ended, while its large
 * answer is being built (on the pool): the answer is dropped unheard, the
 * generation's bytes come back, no loop turn is slow, and the server
 * serves; a SIGTERM at the same moment lets the answer come whole before
 * the server exits 0 (in a sanitizer build with nothing leaked: its log is
 * checked). Each request is held at the engine's gate until it is running,
 * and the client closes (or the signal goes) as soon as the engine has
 * nothing left, whatever the order in which the server then hears the end
 * and the close: each order must leave it fine. */
Test(server_bounds, a_client_gone_while_its_answer_is_built_leaves_the_server_fine)
{
    start(NULL);
    double slow = slow_loop_turns(NULL);
    double gone = gauge("qlserve_client_disconnects_total");
    for (int round = 0; round < 2; round++) {
        hc_conn c;
        send_until_generated(&c);
        hc_close(&c);
        held_bytes_fall_to_zero();
    }
    cr_log_info("clients gone before their answer: %.0f of 2",
                gauge("qlserve_client_disconnects_total") - gone);
    expect_no_slow_turn(slow);
    still_serves();
    /* and SIGTERM's drain waits for an answer being built: it still comes
     * whole, and the server exits 0 after it */
    hc_conn c;
    send_until_generated(&c);
    kill(sp.pid, SIGTERM);
    hc_response r;
    cr_assert(hc_read_response(&c, &r));
    cr_assert_eq(r.status, 200, "%d %.200s", r.status, r.body ? r.body : "");
    cJSON *j = sp_json(r.body);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")), LARGE_CHOICES);
    cJSON_Delete(j);
    hc_response_free(&r);
    hc_close(&c);
    int code = sp_wait_exit();
    cr_assert_eq(code, 0, "exit status %d: %s", code, sp_read_log());
    sp_check_log_clean();
}

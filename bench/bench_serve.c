/*
 * bench_serve.c - qlserve against llama.cpp's llama-server, server against
 * server, the way users meet them: both started on the same GGUF with the
 * same kernel threads, driven one at a time by this one load generator
 * with the same OpenAI-shaped streaming requests, alternately (qlserve's
 * workload set, then llama-server's, then qlserve's again, --rounds
 * times, each server started afresh per round), so both see the same
 * machine. One JSON document on stdout: the inputs, the machine, both
 * servers' versions, every (round, server, workload)'s figures, their
 * medians over the rounds and every ratio qlserve/llama-server.
 *
 * The requests: streamed, greedy (temperature 0), max_tokens --max-tokens
 * (64; the copy and quote workloads --copy-max-tokens, 192, room for the
 * paragraph or summary their answer writes out) with ignore_eos (both servers take it) so every
 * answer runs to its length, stream_options.include_usage so both report their token counts. Each
 * token chunk counts as one token arriving: a chunk with text (delta content for chat), or with an
 * empty text that is neither the finish chunk nor chat's role chunk. The servers read ignore_eos
 * differently: llama-server bans the end tokens, qlserve (as vLLM) generates them as tokens without
 * text, each its own chunk. The token count is usage.completion_tokens where the server sends it,
 * else the chunks.
 *
 * The workloads (--workloads picks some, in this order):
 *   distinct_1   1 stream, /v1/completions, a distinct prompt per request
 *                (~60 tokens: two topics and a number lead, so no two
 *                requests share more than a token or two of prefix);
 *   distinct_8, distinct_32   the same with 8 and 32 streams;
 *   prefix_1     1 stream, /v1/chat/completions: one shared ~1000-token
 *                system prompt and a distinct short user turn each time,
 *                the same prefix asked again and again (a prompt cache's
 *                case: what llama-server's prompt cache and a prefix cache
 *                reuse);
 *   prefix_8     the same with 8 streams;
 *   copy_1       1 stream, /v1/chat/completions: a ~150-token paragraph to
 *                write out again with its misspellings corrected, an answer
 *                that copies the prompt (speculative decoding's case: an
 *                n-gram drafter finds what comes next in the prompt);
 *   copy_8       the same with 8 streams;
 *   quote_1      1 stream, /v1/chat/completions: a ~250-token passage to
 *                summarize, quoting its key sentences word for word (the
 *                other half of speculative decoding's case: an answer that
 *                copies some spans of the prompt between words of its own);
 *   quote_8      the same with 8 streams.
 * The copy and quote workloads run only when --workloads names them (the
 * default set is the five above, as before).
 * A stream is a closed loop on one keep-alive connection: its next
 * request goes when the previous answer ends, until --seconds have passed
 * since the workload began (the requests then in flight finish and
 * count). Each stream is a thread; the prompt numbers are one counter per
 * server start, so both servers are asked the same sequence.
 *
 * The figures, per (round, server, workload):
 *   itl_p50_ms, itl_p99_ms     inter-token latency: the gaps between two
 *                              consecutive token chunks of one answer;
 *   ttft_p50_ms, ttft_p99_ms   time to first token: request written to its
 *                              first token chunk read;
 *   tok_s                      tokens of all answers / the workload's wall
 *                              time (first request sent to last answer
 *                              ended);
 *   steady_tok_s               token chunks that arrived within --seconds /
 *                              --seconds: the rate while every stream was
 *                              busy, without the tail of the last answers;
 *   requests                   answers that ended complete and 200.
 * Ratios are qlserve/llama-server for each; "better" says which direction
 * is qlserve's gain (lower for latencies, higher for rates).
 *
 * The servers: `qlserve serve --threads N --kv-mib K` (bench_server.h's
 * start_server; K is --qlserve-kv-mib, room for every workload's live
 * tokens) and `llama-server -m M -t N -tb N -np 32 -c 32*C -ngl 0` (C is
 * --ctx-per-stream; its prompt cache on, as by default), each with extra
 * flags from --qlserve-arg and --llama-arg. Each is polled on GET /health
 * until it answers 200, then warmed up with a few short requests of
 * prompts the workloads never ask. llama-server's log goes to a file named
 * in the JSON (it writes lines per request, which a pipe would not hold).
 *
 * Usage: bench_serve --llama-server PATH [--qlserve PATH] [--model PATH]
 *                    [--threads N (2)] [--rounds R (2)] [--seconds S (20)]
 *                    [--max-tokens N (64)] [--copy-max-tokens N (192)]
 *                    [--ctx-per-stream C (2048)]
 *                    [--qlserve-kv-mib K (1024)] [--workloads a,b,...]
 *                    [--llama-commit HASH] [--qlserve-commit HASH]
 *                    [--qlserve-arg FLAG]... [--llama-arg FLAG]...
 *                    [--peer-log PATH] [--servers qlserve,llama_server]
 *        bench_serve --print-requests N [--workloads a,b,...] [--max-tokens N]
 *                    [--copy-max-tokens N]
 * --print-requests N prints the first N request bodies of each workload named, one JSON
 * object a line ({"workload", "path", "body"}), and exits without starting a server
 * (bench/spec_replay.py replays speculative decoding over their answers).
 * --servers llama_server measures llama-server alone (a model qlserve cannot
 * load yet, as bench/moe.sh does until it can); the ratios are then null.
 * scripts/bench-serve.sh builds everything and runs it.
 */
#include "bench_server.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>

#include "http_client.h"

#ifndef QL_BINARY
#define QL_BINARY "build/qlserve"
#endif
#ifndef QL_SOURCE_DIR
#define QL_SOURCE_DIR "."
#endif

/* --- the workloads and their figures --------------------------------------------- */

/* what a workload asks: a distinct completion prompt, a chat turn after the
 * shared system prompt, a chat turn asking to copy a paragraph, or one
 * asking to summarize a passage with quotes */
typedef enum prompt_kind { DISTINCT, SHARED_PREFIX, COPY, QUOTE } prompt_kind;

typedef struct workload {
    const char *name;
    int streams;
    prompt_kind kind;
    bool by_default; /* run when --workloads is not given */
    const char *what;
} workload;

static const workload workloads[] = {
    {"distinct_1", 1, DISTINCT, true, "1 stream, /v1/completions, distinct prompts"},
    {"distinct_8", 8, DISTINCT, true, "8 streams, /v1/completions, distinct prompts"},
    {"distinct_32", 32, DISTINCT, true, "32 streams, /v1/completions, distinct prompts"},
    {"prefix_1", 1, SHARED_PREFIX, true,
     "1 stream, /v1/chat/completions, a shared ~1000-token system prompt, distinct user turns"},
    {"prefix_8", 8, SHARED_PREFIX, true,
     "8 streams, /v1/chat/completions, a shared ~1000-token system prompt, distinct user turns"},
    {"copy_1", 1, COPY, false,
     "1 stream, /v1/chat/completions, a ~150-token paragraph to write out again corrected"},
    {"copy_8", 8, COPY, false,
     "8 streams, /v1/chat/completions, a ~150-token paragraph to write out again corrected"},
    {"quote_1", 1, QUOTE, false,
     "1 stream, /v1/chat/completions, a ~250-token passage to summarize with word-for-word "
     "quotes"},
    {"quote_8", 8, QUOTE, false,
     "8 streams, /v1/chat/completions, a ~250-token passage to summarize with word-for-word "
     "quotes"},
};
#define N_WORKLOADS (int)(sizeof workloads / sizeof workloads[0])
/* llama-server's slots: the most streams a workload has */
#define PEER_SLOTS 32

enum figure { ITL_P50, ITL_P99, TTFT_P50, TTFT_P99, TOK_S, STEADY_TOK_S, REQUESTS, N_FIGURES };
static const struct {
    const char *name, *better;
} figure_info[N_FIGURES] = {
    [ITL_P50] = {"itl_p50_ms", "lower"},   [ITL_P99] = {"itl_p99_ms", "lower"},
    [TTFT_P50] = {"ttft_p50_ms", "lower"}, [TTFT_P99] = {"ttft_p99_ms", "lower"},
    [TOK_S] = {"tok_s", "higher"},         [STEADY_TOK_S] = {"steady_tok_s", "higher"},
    [REQUESTS] = {"requests", "higher"},
};

enum server_kind { QLSERVE, LLAMA_SERVER, N_SERVERS };
static const char *const server_name[N_SERVERS] = {"qlserve", "llama_server"};

/* One workload's run on one server: its figures and its counts. */
typedef struct result {
    bool ran;
    double fig[N_FIGURES];
    long errors, reconnects, short_answers, tokens, chunks, itl_samples, ttft_samples;
    double wall_s, prompt_tokens_mean;
    char first_error[256];
} result;

typedef struct bench_opts {
    const char *qlserve, *llama_server, *model, *llama_commit, *qlserve_commit, *peer_log;
    int threads, rounds, max_tokens, copy_max_tokens, ctx_per_stream, qlserve_kv_mib;
    double seconds;
    bool run[N_WORKLOADS];
    bool serve[N_SERVERS]; /* --servers: which of the two are started (default both) */
    int print_requests;    /* --print-requests: bodies to print per workload, then exit */
    char **qlserve_args, **llama_args;
    int n_qlserve_args, n_llama_args;
} bench_opts;

static bench_opts opt;

/* --- the prompts ---------------------------------------------------------------------- */

static const char *const topics[32] = {
    "Volcanoes", "Honey bees", "Lighthouses",  "Glaciers",  "Violins", "Comets", "Bridges",
    "Owls",      "Copper",     "Tides",        "Bicycles",  "Deserts", "Chess",  "Whales",
    "Bread",     "Clocks",     "Rain forests", "Kites",     "Salt",    "Trains", "Coffee",
    "Maps",      "Paper",      "Glass",        "Caves",     "Wool",    "Ink",    "Rice",
    "Rivers",    "Telescopes", "Gardens",      "Submarines"};

/* Distinct prompt i (malloc'd): two topics and i first, then a fixed body. */
static char *distinct_prompt(int i)
{
    char *p = NULL;
    if (asprintf(&p,
                 "%s and %s, essay number %d. Write a long and detailed essay about both of "
                 "them. Begin with their history and the people who studied them, then "
                 "describe how they work and why they matter today, and end with what might "
                 "change about them over the next hundred years.",
                 topics[i % 32], topics[(i / 32 + i + 1) % 32], i) < 0)
        die("out of memory", NULL);
    return p;
}

/* The shared system prompt: ~1000 tokens on the default model (the
 * servers' usage.prompt_tokens, reported per workload, says how many). */
static char *system_prompt(void)
{
    static const char *const rules[12] = {
        "Answer in plain English and keep each paragraph short enough to read aloud.",
        "When a visitor asks about an exhibit, name the hall it stands in and its floor.",
        "Never invent opening hours; say that the front desk has the current ones.",
        "Explain every technical word the first time you use it, with an example.",
        "If a question is about safety, tell the visitor to ask a member of staff.",
        "Suggest one related exhibit at the end of each answer, with a reason.",
        "Children may be asking: prefer simple sentences and concrete comparisons.",
        "Do not give prices; tickets and memberships change through the year.",
        "When you are not sure, say so, and offer what you do know instead.",
        "Mention the workshop schedule only when the visitor asks to build something.",
        "Keep a friendly tone and thank the visitor for their question once.",
        "Refer to the museum as the Hall of Science and Industry, never by nickname.",
    };
    size_t cap = 16384, len = 0;
    char *s = malloc(cap);
    if (!s)
        die("out of memory", NULL);
    len += (size_t)snprintf(s, cap,
                            "You are the guide of the Hall of Science and Industry, a museum "
                            "of machines, materials and the natural world. Follow these rules. ");
    for (int k = 0; k < 48; k++)
        len += (size_t)snprintf(s + len, cap - len, "Rule %d: %s ", k + 1, rules[k % 12]);
    return s;
}

static char *shared_system; /* system_prompt(), made once */

/* The copying prompts, each set with request i's number and two topics
 * (macros, so the format is checked against the arguments). COPY: a
 * paragraph with two words misspelt, to be written out again corrected:
 * most of the answer is in the prompt. QUOTE: a passage to summarize with
 * its key sentences quoted: the quotes are spans of the prompt, the words
 * around them are the model's own. */
#define COPY_PROMPT                                                                                \
    "Here is paragraph number %d of a school report:\n\n"                                          \
    "%s and %s have more in common than most people think. Both were studied "                     \
    "for centuries by curious people who wrote down what they saw, and both "                      \
    "changed the way that towns and villages grew along the coast and in the "                     \
    "hills. Today teachers use them to explain how the world works, becuase "                      \
    "children remember a good story better than a list of facts. In the next "                     \
    "hundred years we will probably learn even more about them, and the "                          \
    "questions we ask will become more interresting as our tools improve.\n\n"                     \
    "Write the whole paragraph out again with its spelling mistakes corrected. "                   \
    "Change nothing else."
#define QUOTE_PROMPT                                                                               \
    "Read this passage from chapter %d of a guide for new teachers:\n\n"                           \
    "\"Most pupils meet %s and %s long before they meet them in a lesson. "                        \
    "A good teacher starts from what the class already knows and asks them to "                    \
    "describe it in their own words. The first lesson should always end with a "                   \
    "question that the pupils cannot yet answer. Over the following weeks the "                    \
    "class collects examples from home, from the library and from the town "                       \
    "around the school. Measurements matter more than opinions, so every "                         \
    "group keeps a notebook of what it counted, weighed or timed. When the "                       \
    "notebooks disagree, the disagreement is the most useful part of the "                         \
    "lesson, because it shows why careful methods were invented. By the end "                      \
    "of the term the pupils should be able to explain one idea to a younger "                      \
    "child without using any difficult words.\"\n\n"                                               \
    "Summarize the passage in a few sentences for a head teacher. Quote the "                      \
    "three most important sentences word for word, each in quotation marks."

/* Copying prompt i of kind (COPY or QUOTE), malloc'd. */
static char *copying_prompt(prompt_kind kind, int i)
{
    const char *a = topics[i % 32], *b = topics[(i / 32 + i + 1) % 32];
    char *p = NULL;
    int n = kind == COPY ? asprintf(&p, COPY_PROMPT, i, a, b) : asprintf(&p, QUOTE_PROMPT, i, a, b);
    if (n < 0)
        die("out of memory", NULL);
    return p;
}

/* The tokens a request of w may generate: a copying answer is the whole
 * paragraph (~130 tokens) or summary written out, so it gets room for it
 * (--copy-max-tokens); cut at --max-tokens it would be mostly the
 * answer's opening line and the prompt's prefill. */
static int workload_max_tokens(const workload *w)
{
    return w->kind == COPY || w->kind == QUOTE ? opt.copy_max_tokens : opt.max_tokens;
}

/* The endpoint w's requests go to: completions for the distinct prompts, chat for the rest. */
static const char *workload_path(const workload *w)
{
    return w->kind != DISTINCT ? "/v1/chat/completions" : "/v1/completions";
}

/* The JSON body of request i of workload w (malloc'd). warm: a warm-up
 * request, whose prompt no workload asks, of a few tokens. */
static char *request_body(const workload *w, int i, bool warm)
{
    cJSON *b = cJSON_CreateObject();
    char text[256];
    if (w->kind == COPY || w->kind == QUOTE) {
        char *p = warm ? NULL : copying_prompt(w->kind, i);
        snprintf(text, sizeof text, "Warm-up %d: repeat the words red, green and blue.", i);
        cJSON *user = cJSON_CreateObject();
        cJSON_AddStringToObject(user, "role", "user");
        cJSON_AddStringToObject(user, "content", p ? p : text);
        cJSON_AddItemToArray(cJSON_AddArrayToObject(b, "messages"), user);
        free(p);
    } else if (w->kind == SHARED_PREFIX) {
        cJSON *ms = cJSON_AddArrayToObject(b, "messages");
        cJSON *sys = cJSON_CreateObject();
        cJSON_AddStringToObject(sys, "role", "system");
        cJSON_AddStringToObject(sys, "content", warm ? "You are a warm-up guide." : shared_system);
        cJSON_AddItemToArray(ms, sys);
        cJSON *user = cJSON_CreateObject();
        snprintf(text, sizeof text, "Question %d: what should a visitor know about %s?", i,
                 topics[i % 32]);
        cJSON_AddStringToObject(user, "role", "user");
        cJSON_AddStringToObject(user, "content", text);
        cJSON_AddItemToArray(ms, user);
    } else if (warm) {
        snprintf(text, sizeof text, "Warm-up %d: count from one to ten.", i);
        cJSON_AddStringToObject(b, "prompt", text);
    } else {
        char *p = distinct_prompt(i);
        cJSON_AddStringToObject(b, "prompt", p);
        free(p);
    }
    cJSON_AddNumberToObject(b, "max_tokens", warm ? 8 : workload_max_tokens(w));
    cJSON_AddNumberToObject(b, "temperature", 0);
    cJSON_AddBoolToObject(b, "ignore_eos", true);
    cJSON_AddBoolToObject(b, "stream", true);
    cJSON_AddBoolToObject(cJSON_AddObjectToObject(b, "stream_options"), "include_usage", true);
    char *body = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    if (!body)
        die("out of memory", NULL);
    return body;
}

/* --print-requests: the first N bodies of each workload run, a JSON object a line. */
static void print_requests(void)
{
    for (int w = 0; w < N_WORKLOADS; w++) {
        if (!opt.run[w])
            continue;
        for (int i = 0; i < opt.print_requests; i++) {
            char *body = request_body(&workloads[w], i, false);
            cJSON *line = cJSON_CreateObject();
            cJSON_AddStringToObject(line, "workload", workloads[w].name);
            cJSON_AddStringToObject(line, "path", workload_path(&workloads[w]));
            cJSON_AddItemToObject(line, "body", cJSON_Parse(body));
            char *text = cJSON_PrintUnformatted(line);
            if (!text)
                die("out of memory", NULL);
            printf("%s\n", text);
            free(text);
            cJSON_Delete(line);
            free(body);
        }
    }
}

/* --- one stream -------------------------------------------------------------------- */
/* Whether choice c0 of a streamed chunk (text: its text or delta.content)
 * carries a token: any text, or an empty text that is neither the
 * finish chunk nor chat's opening role chunk. A generated token whose
 * text is nothing (an end token that ignore_eos lets through, as vLLM
 * generates it; a special token) still arrives as its own chunk, and
 * counts, as vLLM's serving benchmark counts every such chunk. */
static bool token_chunk(const cJSON *c0, const cJSON *text, bool chat)
{
    if (!cJSON_IsString(text))
        return false;
    if (text->valuestring[0])
        return true;
    const cJSON *finish = cJSON_GetObjectItemCaseSensitive(c0, "finish_reason");
    if (finish && !cJSON_IsNull(finish))
        return false;
    return !chat ||
           !cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c0, "delta"), "role");
}

typedef struct stream {
    const workload *w;
    int port;
    double deadline; /* no request starts after it */
    atomic_int *next_prompt;
    pthread_t thread;
    samples ttft, itl;
    long requests, errors, reconnects, short_answers, tokens, chunks, steady_chunks;
    long prompt_tokens;
    double t_first_sent, t_last_done;
    char first_error[256];
} stream;

static void stream_error(stream *s, const char *fmt, const char *detail)
{
    if (!s->errors++)
        snprintf(s->first_error, sizeof s->first_error, fmt, detail ? detail : "");
}

/* One streamed request on s's connection c (opened when closed); its
 * figures into s. Whether the answer was whole and 200. */
static bool stream_request(stream *s, hc_conn *c, int i, bool warm)
{
    bool chat = s->w->kind != DISTINCT;
    const char *path = workload_path(s->w);
    char *body = request_body(s->w, i, warm);
    /* a kept-alive connection the server closed meanwhile fails before
     * any answer: the request goes again once on a fresh connection, as
     * HTTP clients do (counted in reconnects) */
    bool reused = c->fd >= 0, got_head = false;
    double t_sent = 0, t_prev = 0;
    hc_response r = {0}; /* freed below even when no head was read */
    for (int attempt = 0; attempt < 2 && !got_head; attempt++) {
        if (attempt > 0) {
            if (!reused)
                break;
            hc_response_free(&r);
            hc_close(c);
            s->reconnects++;
        }
        if (c->fd < 0 && !hc_open(c, s->port)) {
            free(body);
            stream_error(s, "cannot connect: %s", strerror(errno));
            return false;
        }
        t_sent = now();
        got_head = hc_send_request(c, "POST", path, NULL, body) && hc_read_head(c, &r);
    }
    free(body);
    if (s->t_first_sent == 0)
        s->t_first_sent = t_sent;
    if (!got_head) {
        hc_response_free(&r);
        hc_close(c);
        stream_error(s, "the connection broke before an answer%s", "");
        return false;
    }
    if (r.status != 200) {
        hc_read_body(c, &r);
        char what[200];
        snprintf(what, sizeof what, "%d %.180s", r.status, r.body ? r.body : "");
        stream_error(s, "answered %s", what);
        hc_response_free(&r);
        hc_close(c);
        return false;
    }
    bool done = false;
    long chunks = 0, completion_tokens = -1;
    for (char *ev; !done && (ev = hc_next_event(c, &r)); free(ev)) {
        double t = now();
        if (strcmp(ev, "[DONE]") == 0) {
            done = true;
            continue;
        }
        cJSON *j = cJSON_Parse(ev);
        const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
        const cJSON *text = chat ? cJSON_GetObjectItemCaseSensitive(
                                       cJSON_GetObjectItemCaseSensitive(c0, "delta"), "content")
                                 : cJSON_GetObjectItemCaseSensitive(c0, "text");
        const cJSON *usage = cJSON_GetObjectItemCaseSensitive(j, "usage");
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
        if (cJSON_IsNumber(ct))
            completion_tokens = (long)ct->valuedouble;
        if (cJSON_IsNumber(pt) && !warm)
            s->prompt_tokens += (long)pt->valuedouble;
        bool token = token_chunk(c0, text, chat);
        if (token && !warm) {
            if (chunks == 0)
                sample_add(&s->ttft, t - t_sent);
            else
                sample_add(&s->itl, t - t_prev);
            s->steady_chunks += t <= s->deadline;
        }
        if (token) {
            chunks++;
            t_prev = t;
        }
        if (!j)
            stream_error(s, "an event that is not JSON: %.200s", ev);
        cJSON_Delete(j);
    }
    /* after [DONE], the chunked body's last chunk */
    while (done && !r.body_done)
        if (hc_read_chunk(c, &r) < 0)
            break;
    char conn_value[32] = "";
    bool close_after = hc_header(&r, "Connection", conn_value, sizeof conn_value) &&
                       strcasecmp(conn_value, "close") == 0;
    bool whole = done && r.body_done;
    hc_response_free(&r);
    if (!whole || close_after)
        hc_close(c);
    if (!whole) {
        stream_error(s, "a stream ended without [DONE]%s", "");
        return false;
    }
    if (warm)
        return true;
    long tokens = completion_tokens >= 0 ? completion_tokens : chunks;
    s->requests++;
    s->chunks += chunks;
    s->tokens += tokens;
    s->short_answers += tokens < workload_max_tokens(s->w);
    s->t_last_done = now();
    return true;
}

static void *stream_main(void *arg)
{
    stream *s = arg;
    hc_conn c = {.fd = -1};
    /* a server that fails every request stops the stream, not the bench */
    while (s->errors < 20) {
        int i = atomic_fetch_add(s->next_prompt, 1);
        if (!stream_request(s, &c, i, false))
            usleep(10000);
        if (now() >= s->deadline)
            break;
    }
    hc_close(&c);
    return NULL;
}

/* --- a workload on a running server ------------------------------------------------ */

static result run_workload(const workload *w, int port, atomic_int *next_prompt)
{
    stream *ss = calloc((size_t)w->streams, sizeof *ss);
    if (!ss)
        die("out of memory", NULL);
    double t0 = now();
    for (int k = 0; k < w->streams; k++) {
        ss[k] = (stream){
            .w = w, .port = port, .deadline = t0 + opt.seconds, .next_prompt = next_prompt};
        if (pthread_create(&ss[k].thread, NULL, stream_main, &ss[k]) != 0)
            die("pthread_create", strerror(errno));
    }
    result r = {.ran = true};
    samples ttft = {0}, itl = {0};
    double first = 0, last = 0;
    long steady = 0, prompt_tokens = 0;
    for (int k = 0; k < w->streams; k++) {
        stream *s = &ss[k];
        pthread_join(s->thread, NULL);
        for (size_t j = 0; j < s->ttft.n; j++)
            sample_add(&ttft, s->ttft.v[j]);
        for (size_t j = 0; j < s->itl.n; j++)
            sample_add(&itl, s->itl.v[j]);
        r.fig[REQUESTS] += (double)s->requests;
        r.errors += s->errors;
        r.reconnects += s->reconnects;
        r.short_answers += s->short_answers;
        r.tokens += s->tokens;
        r.chunks += s->chunks;
        steady += s->steady_chunks;
        prompt_tokens += s->prompt_tokens;
        if (s->t_first_sent > 0 && (first == 0 || s->t_first_sent < first))
            first = s->t_first_sent;
        if (s->t_last_done > last)
            last = s->t_last_done;
        if (s->errors && !r.first_error[0])
            snprintf(r.first_error, sizeof r.first_error, "%s", s->first_error);
        free(s->ttft.v);
        free(s->itl.v);
    }
    samples_sort(&ttft);
    samples_sort(&itl);
    r.fig[ITL_P50] = 1e3 * pct(&itl, 0.50);
    r.fig[ITL_P99] = 1e3 * pct(&itl, 0.99);
    r.fig[TTFT_P50] = 1e3 * pct(&ttft, 0.50);
    r.fig[TTFT_P99] = 1e3 * pct(&ttft, 0.99);
    r.wall_s = last > first ? last - first : 0;
    r.fig[TOK_S] = r.wall_s > 0 ? (double)r.tokens / r.wall_s : 0;
    r.fig[STEADY_TOK_S] = (double)steady / opt.seconds;
    r.itl_samples = (long)itl.n;
    r.ttft_samples = (long)ttft.n;
    r.prompt_tokens_mean = r.fig[REQUESTS] > 0 ? (double)prompt_tokens / r.fig[REQUESTS] : 0;
    free(ttft.v);
    free(itl.v);
    free(ss);
    return r;
}

/* A few short requests of each route, one after another; dies when one
 * fails (a server that refuses the requests' shape would fail them all). */
static void warm_up(int port, const char *who)
{
    atomic_int unused = 0;
    for (int k = 0; k < 4; k++) {
        stream s = {.w = &workloads[k % 2 ? 3 : 0],
                    .port = port,
                    .deadline = now() + 60,
                    .next_prompt = &unused};
        hc_conn c = {.fd = -1};
        bool ok = stream_request(&s, &c, k, true);
        hc_close(&c);
        if (!ok) {
            fprintf(stderr, "bench_serve: %s's warm-up request on %s failed: %s\n", who,
                    workload_path(s.w), s.first_error);
            exit(1);
        }
    }
}

/* --- the servers --------------------------------------------------------------------- */

/* A TCP port free on 127.0.0.1 now (for llama-server, which is told one). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        die("cannot find a free port", strerror(errno));
    close(fd);
    return ntohs(a.sin_port);
}

/* v as a string that lives as long as the program. */
static char *int_string(int v)
{
    char *s;
    if (asprintf(&s, "%d", v) < 0)
        die("out of memory", NULL);
    return s;
}

/* The flags each server is started with (after its binary), for the JSON
 * and for starting it: a NULL-terminated list of strings that live as long
 * as the program. port_at: where the port goes (llama-server's, filled per
 * start; -1 for qlserve, which picks one). */
static char **server_flags(enum server_kind k, int *n, int *port_at)
{
    char **f = calloc(64 + (size_t)(opt.n_qlserve_args + opt.n_llama_args), sizeof *f);
    int a = 0;
    *port_at = -1;
    if (k == QLSERVE) {
        f[a++] = "--kv-mib";
        f[a++] = int_string(opt.qlserve_kv_mib);
        /* the streams, the warm-up's and the health polls' connections */
        f[a++] = "--max-connections";
        f[a++] = "256";
        /* every stream comes from this one address: no per-address cap */
        f[a++] = "--max-connections-per-peer";
        f[a++] = "0";
        for (int i = 0; i < opt.n_qlserve_args; i++)
            f[a++] = opt.qlserve_args[i];
    } else {
        char *threads = int_string(opt.threads);
        const char *const fixed[] = {"-m",  opt.model, "--host", "127.0.0.1", "-t",    threads,
                                     "-tb", threads,   "-ngl",   "0",         "--port"};
        for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
            f[a++] = (char *)fixed[i];
        *port_at = a;
        f[a++] = "PORT"; /* a free one, found per start */
        f[a++] = "-np";
        f[a++] = int_string(PEER_SLOTS);
        f[a++] = "-c";
        f[a++] = int_string(PEER_SLOTS * opt.ctx_per_stream);
        for (int i = 0; i < opt.n_llama_args; i++)
            f[a++] = opt.llama_args[i];
    }
    f[a] = NULL;
    *n = a;
    return f;
}

/* Start server k; its port once GET /health answers 200. */
static int start(enum server_kind k, char **flags, int n_flags, int port_at, double *load_s)
{
    double t0 = now();
    int port;
    if (k == QLSERVE) {
        port = start_server(opt.qlserve, opt.model, opt.threads, flags, n_flags);
    } else {
        port = free_port();
        char port_s[16];
        snprintf(port_s, sizeof port_s, "%d", port);
        char **argv = calloc((size_t)n_flags + 2, sizeof *argv);
        argv[0] = (char *)opt.llama_server;
        for (int i = 0; i < n_flags; i++)
            argv[i + 1] = i == port_at ? port_s : flags[i];
        int log = open(opt.peer_log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (log < 0)
            die("cannot write llama-server's log", opt.peer_log);
        spawn_child(argv, log);
        close(log);
        free(argv);
    }
    server_addr.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &server_addr.sin_addr);
    server_addr.sin_port = htons((uint16_t)port);
    if (k == LLAMA_SERVER)
        fprintf(stderr, "bench_serve: llama-server on port %d, its log in %s\n", port,
                opt.peer_log);
    wait_serving(300);
    *load_s = now() - t0;
    return port;
}

/* The first line `cmd` prints, into out ("" when none). */
static void first_line_of(const char *cmd, char *out, size_t len)
{
    out[0] = 0;
    FILE *p = popen(cmd, "r");
    if (!p)
        return;
    if (!fgets(out, (int)len, p))
        out[0] = 0;
    out[strcspn(out, "\n")] = 0;
    pclose(p);
}

/* --- the JSON -------------------------------------------------------------------------- */

/* x rounded to 3 decimals, so the document reads as measured, not as a
 * double's 17 digits. */
static double r3(double x)
{
    return round(x * 1e3) / 1e3;
}

static cJSON *result_json(const result *r)
{
    cJSON *o = cJSON_CreateObject();
    for (int f = 0; f < N_FIGURES; f++)
        cJSON_AddNumberToObject(o, figure_info[f].name, r3(r->fig[f]));
    cJSON_AddNumberToObject(o, "errors", (double)r->errors);
    cJSON_AddNumberToObject(o, "reconnects", (double)r->reconnects);
    cJSON_AddNumberToObject(o, "answers_shorter_than_max_tokens", (double)r->short_answers);
    cJSON_AddNumberToObject(o, "tokens", (double)r->tokens);
    cJSON_AddNumberToObject(o, "token_chunks", (double)r->chunks);
    cJSON_AddNumberToObject(o, "itl_samples", (double)r->itl_samples);
    cJSON_AddNumberToObject(o, "ttft_samples", (double)r->ttft_samples);
    cJSON_AddNumberToObject(o, "wall_s", r3(r->wall_s));
    cJSON_AddNumberToObject(o, "prompt_tokens_mean", r3(r->prompt_tokens_mean));
    if (r->first_error[0])
        cJSON_AddStringToObject(o, "first_error", r->first_error);
    return o;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* {figure: qlserve's / llama-server's} (null where llama-server's is 0, or where --servers left
 * one of them out). */
static cJSON *ratios_json(const double *q, const double *l)
{
    cJSON *o = cJSON_CreateObject();
    bool both = opt.serve[QLSERVE] && opt.serve[LLAMA_SERVER];
    for (int f = 0; f < N_FIGURES; f++) {
        if (both && l[f] > 0)
            cJSON_AddNumberToObject(o, figure_info[f].name, r3(q[f] / l[f]));
        else
            cJSON_AddNullToObject(o, figure_info[f].name);
    }
    return o;
}

static cJSON *string_array(char **v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateString(v[i]));
    return a;
}

/* --- the command line ------------------------------------------------------------------ */

static void usage(FILE *out)
{
    fprintf(out,
            "usage: bench_serve --llama-server PATH [--qlserve PATH] [--model PATH]\n"
            "                   [--threads N (2)] [--rounds R (2)] [--seconds S (20)]\n"
            "                   [--max-tokens N (64)] [--copy-max-tokens N (192)]\n"
            "                   [--ctx-per-stream C (2048)]\n"
            "                   [--qlserve-kv-mib K (1024)] [--workloads a,b,...]\n"
            "                   [--llama-commit HASH] [--qlserve-commit HASH]\n"
            "                   [--qlserve-arg FLAG]... [--llama-arg FLAG]... [--peer-log PATH]\n"
            "                   [--servers qlserve,llama_server (both)]\n"
            "       bench_serve --print-requests N [--workloads a,b,...] [--max-tokens N]\n"
            "                   [--copy-max-tokens N]\n"
            "workloads: ");
    for (int w = 0; w < N_WORKLOADS; w++)
        fprintf(out, "%s%s", w ? "," : "", workloads[w].name);
    fprintf(out, " (default: all but copy_1,copy_8,quote_1,quote_8)\n"
                 "Prints one JSON document: qlserve against llama-server, alternating, per "
                 "round and workload.\n");
}

/* v as an integer in [min, max]; dies naming flag and v otherwise. */
static int int_flag(const char *flag, const char *v, int min, int max)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < min || x > max) {
        fprintf(stderr, "bench_serve: %s %s: want an integer from %d to %d\n", flag, v, min, max);
        exit(2);
    }
    return (int)x;
}

/* Sets on[k] for each of names[0..n) that the comma-separated list names and clears the rest;
 * dies naming flag and the word where one is not in names, or where the list names none. */
static void parse_names(const char *flag, const char *list, const char *const *names, int n,
                        bool *on)
{
    memset(on, 0, (size_t)n * sizeof *on);
    char *copy = strdup(list), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int k = 0;
        while (k < n && strcmp(names[k], t) != 0)
            k++;
        if (k == n) {
            fprintf(stderr, "bench_serve: %s: no '%s' (", flag, t);
            for (int j = 0; j < n; j++)
                fprintf(stderr, "%s%s", j ? ", " : "", names[j]);
            fprintf(stderr, ")\n");
            exit(2);
        }
        on[k] = true;
    }
    free(copy);
    bool any = false;
    for (int k = 0; k < n; k++)
        any = any || on[k];
    if (!any) {
        fprintf(stderr, "bench_serve: %s names none\n", flag);
        exit(2);
    }
}

static void parse_workloads(const char *list)
{
    const char *names[N_WORKLOADS];
    for (int w = 0; w < N_WORKLOADS; w++)
        names[w] = workloads[w].name;
    parse_names("--workloads", list, names, N_WORKLOADS, opt.run);
}

static void parse_args(int argc, char **argv, char *default_model)
{
    opt = (bench_opts){.qlserve = QL_BINARY,
                       .model = default_model,
                       .threads = 2,
                       .rounds = 2,
                       .seconds = 20,
                       .max_tokens = 64,
                       .copy_max_tokens = 192,
                       .ctx_per_stream = 2048,
                       .qlserve_kv_mib = 1024};
    for (int w = 0; w < N_WORKLOADS; w++)
        opt.run[w] = workloads[w].by_default;
    for (int k = 0; k < N_SERVERS; k++)
        opt.serve[k] = true;
    opt.qlserve_args = calloc((size_t)argc, sizeof *opt.qlserve_args);
    opt.llama_args = calloc((size_t)argc, sizeof *opt.llama_args);
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage(stdout);
            exit(0);
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_serve: %s needs a value\n", f);
            usage(stderr);
            exit(2);
        }
        const char *v = argv[++i];
        if (!strcmp(f, "--llama-server"))
            opt.llama_server = v;
        else if (!strcmp(f, "--qlserve"))
            opt.qlserve = v;
        else if (!strcmp(f, "--model"))
            opt.model = v;
        else if (!strcmp(f, "--threads"))
            opt.threads = int_flag(f, v, 1, 4096);
        else if (!strcmp(f, "--rounds"))
            opt.rounds = int_flag(f, v, 1, 100);
        else if (!strcmp(f, "--max-tokens"))
            opt.max_tokens = int_flag(f, v, 2, 4096);
        else if (!strcmp(f, "--copy-max-tokens"))
            opt.copy_max_tokens = int_flag(f, v, 2, 4096);
        else if (!strcmp(f, "--ctx-per-stream"))
            opt.ctx_per_stream = int_flag(f, v, 256, 1 << 20);
        else if (!strcmp(f, "--qlserve-kv-mib"))
            opt.qlserve_kv_mib = int_flag(f, v, 1, 1 << 24);
        else if (!strcmp(f, "--workloads"))
            parse_workloads(v);
        else if (!strcmp(f, "--servers"))
            parse_names(f, v, server_name, N_SERVERS, opt.serve);
        else if (!strcmp(f, "--llama-commit"))
            opt.llama_commit = v;
        else if (!strcmp(f, "--qlserve-commit"))
            opt.qlserve_commit = v;
        else if (!strcmp(f, "--peer-log"))
            opt.peer_log = v;
        else if (!strcmp(f, "--print-requests"))
            opt.print_requests = int_flag(f, v, 1, 100000);
        else if (!strcmp(f, "--qlserve-arg"))
            opt.qlserve_args[opt.n_qlserve_args++] = (char *)v;
        else if (!strcmp(f, "--llama-arg"))
            opt.llama_args[opt.n_llama_args++] = (char *)v;
        else if (!strcmp(f, "--seconds")) {
            char *end;
            opt.seconds = strtod(v, &end);
            if (end == v || *end || !(opt.seconds > 0 && opt.seconds <= 86400)) {
                fprintf(stderr,
                        "bench_serve: --seconds %s: want a number of seconds in (0, "
                        "86400]\n",
                        v);
                exit(2);
            }
        } else {
            fprintf(stderr, "bench_serve: unknown flag %s\n", f);
            usage(stderr);
            exit(2);
        }
    }
    if (opt.print_requests)
        return; /* no server is started */
    if (!opt.llama_server) {
        fprintf(stderr, "bench_serve: --llama-server PATH is needed (scripts/build-llama-server.sh "
                        "builds one and prints its path)\n");
        exit(2);
    }
    if (access(opt.llama_server, X_OK) != 0)
        die("--llama-server is not an executable file", opt.llama_server);
    if (opt.serve[QLSERVE] && access(opt.qlserve, X_OK) != 0)
        die("--qlserve is not an executable file", opt.qlserve);
    if (access(opt.model, R_OK) != 0)
        die("--model cannot be read (scripts/fetch-model.sh fetches the default one)", opt.model);
}

/* --- main -------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    char default_model[1024];
    test_default_model_path(default_model, sizeof default_model);
    parse_args(argc, argv, default_model);
    signal(SIGPIPE, SIG_IGN);
    char peer_log[64];
    if (!opt.peer_log) {
        snprintf(peer_log, sizeof peer_log, "/tmp/bench_serve.%d.llama-server.log", (int)getpid());
        opt.peer_log = peer_log;
    }
    shared_system = system_prompt();
    if (opt.print_requests) {
        print_requests();
        return 0;
    }

    /* what is compared: versions and commits */
    char cmd[PATH_MAX + 128], llama_version[256], llama_commit[64] = "unknown";
    char ql_commit[128] = "", ql_dirty[8] = "";
    snprintf(cmd, sizeof cmd, "'%s' --version 2>&1 | grep -m1 '^version'", opt.llama_server);
    first_line_of(cmd, llama_version, sizeof llama_version);
    if (opt.llama_commit)
        snprintf(llama_commit, sizeof llama_commit, "%s", opt.llama_commit);
    else if (strstr(llama_version, "commit ")) /* "version: 0.5.0-dev (build 1, commit 0c1e570)" */
        sscanf(strstr(llama_version, "commit ") + 7, "%63[0-9a-f]", llama_commit);
    else if (strchr(llama_version, '(')) /* older: "version: 4589 (0c1e570)" */
        sscanf(strchr(llama_version, '(') + 1, "%63[0-9a-f]", llama_commit);
    if (opt.qlserve_commit) {
        snprintf(ql_commit, sizeof ql_commit, "%s", opt.qlserve_commit);
    } else {
        first_line_of("git -C '" QL_SOURCE_DIR "' rev-parse HEAD 2>/dev/null", ql_commit,
                      sizeof ql_commit);
        first_line_of("git -C '" QL_SOURCE_DIR "' status --porcelain --untracked-files=no "
                      "2>/dev/null | head -1",
                      ql_dirty, sizeof ql_dirty);
        if (ql_dirty[0])
            strncat(ql_commit, "-dirty", sizeof ql_commit - strlen(ql_commit) - 1);
    }

    int n_flags[N_SERVERS], port_at[N_SERVERS];
    char **flags[N_SERVERS];
    for (int k = 0; k < N_SERVERS; k++)
        flags[k] = server_flags((enum server_kind)k, &n_flags[k], &port_at[k]);

    result(*res)[N_SERVERS][N_WORKLOADS] = calloc((size_t)opt.rounds, sizeof *res);
    cJSON *runs = cJSON_CreateArray();
    bench_machine mc = machine_now();
    for (int round = 0; round < opt.rounds; round++) {
        for (int k = 0; k < N_SERVERS; k++) {
            if (!opt.serve[k])
                continue;
            char loadavg[128];
            first_line_of("cat /proc/loadavg", loadavg, sizeof loadavg);
            double load_s;
            int port = start((enum server_kind)k, flags[k], n_flags[k], port_at[k], &load_s);
            warm_up(port, server_name[k]);
            atomic_int next_prompt = 0;
            cJSON *run = cJSON_CreateObject(), *by_w = cJSON_CreateObject();
            for (int w = 0; w < N_WORKLOADS; w++) {
                if (!opt.run[w])
                    continue;
                fprintf(stderr, "bench_serve: round %d, %s, %s\n", round + 1, server_name[k],
                        workloads[w].name);
                res[round][k][w] = run_workload(&workloads[w], port, &next_prompt);
                cJSON_AddItemToObject(by_w, workloads[w].name, result_json(&res[round][k][w]));
            }
            int code = stop_server();
            cJSON_AddNumberToObject(run, "round", round + 1);
            cJSON_AddStringToObject(run, "server", server_name[k]);
            cJSON_AddStringToObject(run, "loadavg_before", loadavg);
            cJSON_AddNumberToObject(run, "load_seconds", r3(load_s));
            cJSON_AddNumberToObject(run, "exit_status", code);
            cJSON_AddItemToObject(run, "workloads", by_w);
            cJSON_AddItemToArray(runs, run);
        }
    }

    /* medians over the rounds, and the ratios */
    cJSON *medians = cJSON_CreateObject(), *ratios = cJSON_CreateObject();
    cJSON *better = cJSON_AddObjectToObject(ratios, "better");
    for (int f = 0; f < N_FIGURES; f++)
        cJSON_AddStringToObject(better, figure_info[f].name, figure_info[f].better);
    cJSON *per_round = cJSON_AddArrayToObject(ratios, "per_round");
    for (int round = 0; round < opt.rounds; round++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "round", round + 1);
        for (int w = 0; w < N_WORKLOADS; w++)
            if (opt.run[w])
                cJSON_AddItemToObject(
                    o, workloads[w].name,
                    ratios_json(res[round][QLSERVE][w].fig, res[round][LLAMA_SERVER][w].fig));
        cJSON_AddItemToArray(per_round, o);
    }
    double med[N_SERVERS][N_WORKLOADS][N_FIGURES] = {0};
    double *v = calloc((size_t)opt.rounds, sizeof *v);
    for (int k = 0; k < N_SERVERS; k++) {
        if (!opt.serve[k])
            continue;
        cJSON *by_w = cJSON_AddObjectToObject(medians, server_name[k]);
        for (int w = 0; w < N_WORKLOADS; w++) {
            if (!opt.run[w])
                continue;
            cJSON *o = cJSON_AddObjectToObject(by_w, workloads[w].name);
            for (int f = 0; f < N_FIGURES; f++) {
                for (int round = 0; round < opt.rounds; round++)
                    v[round] = res[round][k][w].fig[f];
                med[k][w][f] = median(v, opt.rounds);
                cJSON_AddNumberToObject(o, figure_info[f].name, r3(med[k][w][f]));
            }
        }
    }
    free(v);
    cJSON *of_medians = cJSON_AddObjectToObject(ratios, "of_medians");
    for (int w = 0; w < N_WORKLOADS; w++)
        if (opt.run[w])
            cJSON_AddItemToObject(of_medians, workloads[w].name,
                                  ratios_json(med[QLSERVE][w], med[LLAMA_SERVER][w]));

    /* the document */
    cJSON *doc = cJSON_CreateObject();
    cJSON_AddStringToObject(doc, "benchmark", "serve");
    cJSON_AddStringToObject(doc, "date", mc.date);
    cJSON *m = cJSON_AddObjectToObject(doc, "machine");
    cJSON_AddStringToObject(m, "cpu", mc.cpu);
    cJSON_AddNumberToObject(m, "cores", (double)sysconf(_SC_NPROCESSORS_ONLN));
    cJSON_AddStringToObject(m, "kernel", mc.kernel);
    cJSON *in = cJSON_AddObjectToObject(doc, "inputs");
    cJSON_AddStringToObject(in, "model", opt.model);
    cJSON_AddNumberToObject(in, "threads", opt.threads);
    cJSON_AddNumberToObject(in, "rounds", opt.rounds);
    cJSON_AddNumberToObject(in, "seconds_per_workload", opt.seconds);
    cJSON_AddNumberToObject(in, "max_tokens", opt.max_tokens);
    cJSON_AddNumberToObject(in, "copy_max_tokens", opt.copy_max_tokens);
    cJSON_AddStringToObject(in, "sampling", "greedy (temperature 0), ignore_eos, streamed");
    cJSON_AddStringToObject(in, "order",
                            "per round: qlserve's workloads, then llama-server's; "
                            "each server started afresh per round");
    cJSON *servers = cJSON_AddArrayToObject(in, "servers");
    for (int k = 0; k < N_SERVERS; k++)
        if (opt.serve[k])
            cJSON_AddItemToArray(servers, cJSON_CreateString(server_name[k]));
    cJSON *wl = cJSON_AddObjectToObject(in, "workloads");
    for (int w = 0; w < N_WORKLOADS; w++)
        if (opt.run[w])
            cJSON_AddStringToObject(wl, workloads[w].name, workloads[w].what);
    cJSON_AddStringToObject(in, "client",
                            "bench_serve: one thread per stream, each a closed "
                            "loop on one keep-alive connection; on the servers' "
                            "machine");
    cJSON *qs = cJSON_AddObjectToObject(doc, "qlserve");
    cJSON_AddStringToObject(qs, "binary", opt.qlserve);
    cJSON_AddStringToObject(qs, "commit", ql_commit[0] ? ql_commit : "unknown");
    char **ql_argv = calloc((size_t)n_flags[QLSERVE] + 16, sizeof *ql_argv);
    char threads_s[16];
    snprintf(threads_s, sizeof threads_s, "%d", opt.threads);
    int a = 0;
    for (const char *const *p =
             (const char *const[]){"serve", "--model", opt.model, "--host", "127.0.0.1", "--port",
                                   "0", "--threads", threads_s, NULL};
         *p; p++)
        ql_argv[a++] = (char *)*p;
    for (int i = 0; i < n_flags[QLSERVE]; i++)
        ql_argv[a++] = flags[QLSERVE][i];
    cJSON_AddItemToObject(qs, "args", string_array(ql_argv, a));
    free(ql_argv);
    cJSON *ls = cJSON_AddObjectToObject(doc, "llama_server");
    cJSON_AddStringToObject(ls, "binary", opt.llama_server);
    cJSON_AddStringToObject(ls, "version", llama_version);
    cJSON_AddStringToObject(ls, "llama_cpp_commit", llama_commit);
    cJSON_AddItemToObject(ls, "args", string_array(flags[LLAMA_SERVER], n_flags[LLAMA_SERVER]));
    cJSON_AddStringToObject(ls, "log", opt.peer_log);
    cJSON_AddItemToObject(doc, "runs", runs);
    cJSON_AddItemToObject(doc, "medians", medians);
    cJSON_AddItemToObject(doc, "ratios_qlserve_over_llama_server", ratios);
    char *text = cJSON_Print(doc);
    puts(text);
    free(text);
    cJSON_Delete(doc);
    free(res);
    free(shared_system);
    return 0;
}

/*
 * bridge.c - generations: prepared off the loop, run on the engine's
 * thread, answered on the loop.
 *
 * A generation: srv_gen_submit checks readiness (503 while loading or
 * draining), the adapter (acquired once for the whole request; one not
 * loaded is loaded on first use when it may be, else a 404 in the API's
 * words), the server's limit on new tokens, and room for it before
 * anything is built: the engine's queue and the server's budget of bytes
 * held by unanswered requests (--max-held-bytes; request_cost), each a 503
 * with Retry-After. Its prompts are then prepared on the pool (gen_prep,
 * one pass) and queued from the loop. The
 * engine calls on_token / on_done on its own thread; they only append an
 * event to a mutex-guarded list and uv_async_send the loop, which takes
 * the whole list at once (srv_gen_on_wake), keeps each token's text and
 * id on the generation, and hands the event to the generation's API shape
 * (api_tgi.c, api_openai.c), which turns it into bytes on the connection
 * (or nothing, when the client has gone). A generation's memory lives
 * until its on_done has been handled, whatever the connection did. A
 * whole (not streamed) answer is built from the shape's whole builder:
 * on the loop when small, on the pool when large (answer_estimate), so
 * no answer's JSON holds the loop; the generation is then the pool's
 * work's until it has answered.
 *
 * A constrained request (srv_req_ask.grammar_text) is compiled on the pool
 * with its prompts, through the server's grammar cache (a schema a
 * thousand agents send is compiled once), and a compile error is the
 * request's 400; the engine takes its own reference at submit.
 *
 * Offers srv_gen_submit and srv_gen_submit_made, srv_gen_ready,
 * srv_gen_adapter_loaded, srv_gen_on_wake, srv_gen_conn_gone, and a
 * generation's srv_gen_cancel, srv_gen_answer_order and srv_gen_full_text
 * (internal/gen.h). Owns every srv_gen, gen_prep and srv_event. Touches
 * the engine (build, queue, cancel), the adapter registry
 * (lora_registry_want, lora_registry_acquire), pool_job.c's work,
 * request.c's errors, http.c's stream start, metrics.c's histograms, and,
 * after a generation ends, the drain check through s->hooks (serve.c's:
 * this file names nothing above it).
 */
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/metrics.h"
#include "internal/pool_job.h"
#include "internal/request.h"

#include <cjson/cJSON.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum ev_kind { EV_PROMPT, EV_TOKEN, EV_CHOICE, EV_DONE } ev_kind;

/* One thing the engine said, queued for the loop. Arrays are owned. */
typedef struct srv_event {
    struct srv_event *next;
    srv_gen_part *part;
    ev_kind kind;
    int32_t choice;
    int32_t token;
    char *text;
    size_t len;
    float logprob;
    eng_logprob *top; /* EV_TOKEN: n_top; EV_PROMPT: n x n_top */
    int32_t n_top;
    int32_t *tokens; /* EV_PROMPT: the prompt's n tokens */
    float *logprobs;
    int32_t n;
    eng_choice_end end;
    eng_finish why;
    eng_usage usage;
} srv_event;

/* --- the engine's callbacks (engine thread) -------------------------------------- */

static void push_event(srv_gen_part *part, srv_event *ev)
{
    srv_server *s = part->g->s;
    ev->part = part;
    pthread_mutex_lock(&s->events_mu);
    if (s->events_tail)
        s->events_tail->next = ev;
    else
        s->events = ev;
    s->events_tail = ev;
    pthread_mutex_unlock(&s->events_mu);
    uv_async_send(&s->wake);
}

/* A copy of n items of size each (NULL when n is 0 or memory is short). */
static void *dup_array(const void *p, size_t n, size_t size)
{
    if (!p || n == 0)
        return NULL;
    void *q = malloc(n * size);
    if (q)
        memcpy(q, p, n * size);
    return q;
}

/* An event that must arrive (a choice's or a request's end): retry the
 * allocation rather than lose it. */
static srv_event *must_alloc(void)
{
    srv_event *ev;
    while (!(ev = calloc(1, sizeof *ev)))
        sched_yield();
    return ev;
}

static void bridge_prompt(void *user, const eng_prompt_info *p)
{
    srv_event *ev = calloc(1, sizeof *ev);
    if (!ev)
        return; /* the prompt's details are lost; the generation goes on */
    ev->kind = EV_PROMPT;
    ev->n = p->n;
    ev->n_top = p->n_top;
    ev->tokens = dup_array(p->tokens, (size_t)p->n, sizeof *p->tokens);
    ev->logprobs = dup_array(p->logprobs, (size_t)p->n, sizeof *p->logprobs);
    ev->top = dup_array(p->top, (size_t)p->n * (size_t)p->n_top, sizeof *p->top);
    push_event(user, ev);
}

static void bridge_token(void *user, const eng_token_event *te)
{
    srv_event *ev = calloc(1, sizeof *ev);
    if (!ev)
        return; /* the token's text is lost; the generation goes on */
    ev->kind = EV_TOKEN;
    ev->choice = te->choice;
    ev->token = te->token;
    ev->logprob = te->logprob;
    ev->n_top = te->top ? te->n_top : 0;
    ev->top = dup_array(te->top, (size_t)ev->n_top, sizeof *te->top);
    if (te->len) {
        ev->text = malloc(te->len);
        if (ev->text) {
            memcpy(ev->text, te->text, te->len);
            ev->len = te->len;
        }
    }
    push_event(user, ev);
}

static void bridge_choice_done(void *user, const eng_choice_end *end)
{
    srv_event *ev = must_alloc();
    ev->kind = EV_CHOICE;
    ev->end = *end;
    push_event(user, ev);
}

static void bridge_done(void *user, eng_finish why, const eng_usage *u)
{
    srv_event *ev = must_alloc();
    ev->kind = EV_DONE;
    ev->why = why;
    ev->usage = *u;
    push_event(user, ev);
}

/* --- generations (loop) ---------------------------------------------------------- */

/* Put g on the server's live list and name it. */
static void gen_live(srv_gen *g)
{
    srv_server *s = g->s;
    s->oai_serial++;
    snprintf(g->oai_id, sizeof g->oai_id, "%s-%llu",
             g->shape->id_prefix ? g->shape->id_prefix : "cmpl", (unsigned long long)s->oai_serial);
    g->next_live = s->live;
    if (s->live)
        s->live->prev_live = g;
    s->live = g;
    s->n_live++;
}

void srv_gen_cancel(srv_gen *g)
{
    for (int32_t i = 0; i < g->n_parts; i++)
        if (!g->parts[i].done)
            eng_engine_cancel(g->s->engine, g->parts[i].id);
}

/* Cancel g and forget the connection: g then only waits for its requests'
 * ends. */
static void gen_cancel(srv_gen *g)
{
    g->conn = NULL;
    srv_gen_cancel(g);
}

/* The client went away. */
static void gen_detach(srv_gen *g)
{
    g->s->metrics.cancelled++;
    gen_cancel(g);
}

/* Free what ch holds and empty it (freeing it again does nothing). */
static void choice_free(srv_gen_choice *ch)
{
    for (size_t i = 0; i < ch->n_tokens; i++)
        free(ch->pieces[i]);
    free(ch->pieces);
    free(ch->offsets);
    free(ch->tokens);
    free(ch->logprobs);
    free(ch->top);
    free(ch->text);
    *ch = (srv_gen_choice){0};
}

/* Free what p holds and empty it, as choice_free. */
static void part_free(srv_gen_part *p)
{
    free(p->text);
    free(p->tokens);
    free(p->logprobs);
    free(p->top);
    p->text = NULL;
    p->tokens = NULL;
    p->logprobs = NULL;
    p->top = NULL;
    p->n_tokens = 0;
}

/* Free g (its parts and choices) without touching the live list. */
static void gen_free_memory(srv_gen *g)
{
    g->s->held_bytes -= g->cost;
    for (int32_t i = 0; g->choices && i < g->n_choices; i++)
        choice_free(&g->choices[i]);
    for (int32_t i = 0; g->parts && i < g->n_parts; i++)
        part_free(&g->parts[i]);
    free(g->choices);
    free(g->parts);
    if (g->answer_drop)
        g->answer_drop(g->answer);
    free(g);
}

/* Take g off the server's live list (its memory stays). */
static void gen_unlive(srv_gen *g)
{
    srv_server *s = g->s;
    if (g->prev_live)
        g->prev_live->next_live = g->next_live;
    else
        s->live = g->next_live;
    if (g->next_live)
        g->next_live->prev_live = g->prev_live;
    g->prev_live = g->next_live = NULL;
    s->n_live--;
}

static bool append_text(srv_gen_choice *ch, const char *text, size_t len)
{
    if (ch->text_len + len + 1 > ch->text_cap) {
        size_t cap = (ch->text_len + len + 1) * 2;
        char *t = realloc(ch->text, cap);
        if (!t)
            return false;
        ch->text = t;
        ch->text_cap = cap;
    }
    memcpy(ch->text + ch->text_len, text, len);
    ch->text_len += len;
    ch->text[ch->text_len] = 0;
    return true;
}

/* With reasoning kept apart: where ch's reasoning and content lie now. */
static void reason_update(const srv_gen *g, srv_gen_choice *ch)
{
    /* once the content has begun, the split is final */
    if (!g->reasoning || (ch->reason.done && ch->reason.content_from < ch->text_len))
        return;
    srv_reason_split((srv_reason_format)g->s->reason_format, g->reason_opens, ch->text,
                     ch->text_len, ch->ended, ch->reason.searched, &ch->reason);
}

const char *srv_gen_content(const srv_gen *g, int32_t i, size_t *len)
{
    const srv_gen_choice *ch = &g->choices[i];
    const char *text = ch->text ? ch->text : "";
    if (!g->reasoning) {
        *len = ch->text_len;
        return text;
    }
    size_t from = ch->reason.done ? ch->reason.content_from : ch->text_len;
    *len = ch->text_len - from;
    return text + from;
}

const char *srv_gen_reasoning(const srv_gen *g, int32_t i, size_t *len)
{
    const srv_gen_choice *ch = &g->choices[i];
    *len = g->reasoning ? ch->reason.reason_to - ch->reason.reason_from : 0;
    return (ch->text ? ch->text : "") + (g->reasoning ? ch->reason.reason_from : 0);
}

int32_t srv_gen_reasoning_tokens(const srv_gen *g, int32_t i)
{
    const srv_gen_choice *ch = &g->choices[i];
    if (!g->reasoning || !ch->text || ch->reason.reason_to == ch->reason.reason_from)
        return 0;
    size_t from = ch->reason.done ? ch->reason.content_from : ch->text_len;
    size_t chars = ql_utf8_chars((const uint8_t *)ch->text, from); /* offsets count characters */
    int32_t n = 0;
    while ((size_t)n < ch->n_tokens && ch->offsets[n] < chars)
        n++;
    return n;
}

/* Keep a token, its text, where that text starts (offset, in characters)
 * and (when asked) its logprobs on the choice; a token that cannot be kept
 * (out of memory) is left out of the details. */
static void record_token(const srv_gen *g, srv_gen_choice *ch, const srv_event *ev, size_t offset)
{
    if (ch->n_tokens == ch->cap_tokens) {
        size_t cap = ch->cap_tokens ? 2 * ch->cap_tokens : 32;
        int32_t *t = realloc(ch->tokens, cap * sizeof *t);
        if (t)
            ch->tokens = t;
        char **p = t ? realloc(ch->pieces, cap * sizeof *p) : NULL;
        if (p)
            ch->pieces = p;
        size_t *o = p ? realloc(ch->offsets, cap * sizeof *o) : NULL;
        if (o)
            ch->offsets = o;
        float *l = o ? realloc(ch->logprobs, cap * sizeof *l) : NULL;
        if (l)
            ch->logprobs = l;
        eng_logprob *top =
            l && g->top_n ? realloc(ch->top, cap * (size_t)g->top_n * sizeof *top) : NULL;
        if (top)
            ch->top = top;
        if (!l || (g->top_n && !top))
            return;
        ch->cap_tokens = cap;
    }
    char *piece = malloc(ev->len + 1);
    if (!piece)
        return;
    memcpy(piece, ev->text ? ev->text : "", ev->len);
    piece[ev->len] = 0;
    size_t i = ch->n_tokens++;
    ch->tokens[i] = ev->token;
    ch->pieces[i] = piece;
    ch->offsets[i] = offset;
    ch->logprobs[i] = ev->logprob;
    if (g->top_n) {
        eng_logprob *row = ch->top + i * (size_t)g->top_n;
        for (int32_t k = 0; k < g->top_n; k++)
            row[k] = k < ev->n_top ? ev->top[k] : (eng_logprob){-1, 0.0f};
    }
}

static void on_token_event(srv_gen *g, srv_gen_part *part, const srv_event *ev)
{
    srv_server *s = g->s;
    if (ev->choice < 0 || ev->choice >= g->per_part)
        return;
    int32_t i = part->index * g->per_part + ev->choice;
    srv_gen_choice *ch = &g->choices[i];
    double t = ql_now_s();
    if (ev->token >= 0) {
        if (!g->first_seen)
            srv_metrics_observe(&s->metrics.ttft, t - g->t_start);
        else
            srv_metrics_observe(&s->metrics.per_token, t - g->t_last);
        g->first_seen = true;
        g->t_last = t;
    }
    size_t offset = ch->text_chars;
    if (append_text(ch, ev->text ? ev->text : "", ev->len)) {
        ch->text_chars +=
            ql_utf8_chars((const uint8_t *)ch->text + ch->text_len - ev->len, ev->len);
        if (ev->token < 0)
            ch->tail_len += ev->len;
    }
    if (ev->token >= 0)
        record_token(g, ch, ev, offset);
    reason_update(g, ch);
    if (g->conn && g->shape->on_token)
        g->shape->on_token(g, g->conn, i, ev->token, ev->text, ev->len);
}

/* The prompt as the model saw it: its tokens and, when asked, logprobs. */
static void on_prompt_event(srv_gen *g, srv_gen_part *part, srv_event *ev)
{
    if (g->top_n && ev->n_top != g->top_n) {
        free(ev->top);
        ev->top = NULL;
    }
    part->tokens = ev->tokens;
    part->logprobs = ev->logprobs;
    part->top = ev->top;
    part->n_tokens = ev->tokens ? ev->n : 0;
    ev->tokens = NULL; /* the part's now */
    ev->logprobs = NULL;
    ev->top = NULL;
}

static void on_choice_event(srv_gen *g, srv_gen_part *part, const srv_event *ev)
{
    if (ev->end.choice < 0 || ev->end.choice >= g->per_part)
        return;
    srv_gen_choice *ch = &g->choices[part->index * g->per_part + ev->end.choice];
    ch->ended = true;
    reason_update(g, ch);
    ch->why = ev->end.why;
    ch->generated = ev->end.generated_tokens;
    ch->logprob_sum = ev->end.logprob_sum;
}

/* --- a whole answer: printed on the loop, or on the pool when large ------------- */

/*
 * A whole answer's JSON is built (a cJSON tree) and printed in time linear
 * in its size, and the request bounds let one be tens of megabytes: 64
 * choices of up to the context's tokens, each with 20 alternatives, and
 * the prompt's logprobs with echo (--max-held-bytes holds the largest at
 * about 60 MB). Built on the loop, every other client would wait for it.
 * So an answer whose estimate (answer_estimate) passes
 * ANSWER_ON_LOOP_BYTES is built, printed and its generation's tokens freed
 * on a pool thread, and answered from the loop with the printed text (no
 * copy). Meanwhile g is the work's alone: its every prompt has ended on
 * the engine, it is off the live list (no drain or grace walks it), and
 * its connection no longer points at it (c->work points at the work, and
 * a client that leaves clears the work's conn: srv_gen_conn_gone). It keeps
 * its bytes counted in s->held_bytes until answer_done frees it, so the
 * --max-held-bytes budget still sees it, and the drain waits for it as for
 * any work (s->n_work). The shapes' whole builders read only g and what of
 * the server does not change while it serves (srv_gen_shape.whole).
 */

/* Answers estimated at up to 64 KiB are built and printed on the loop.
 * Logprob entries are the slow kind: a 3.9 MB answer of completions'
 * logprobs (64 choices x 194 tokens x ~11 alternatives) took 137 ms of the
 * loop's CPU, about 2 ms per 64 KiB, and the estimate counts them at twice
 * to three times what they print to; text alone prints far faster. So an
 * answer kept on the loop costs it a few milliseconds at most, well under
 * the 50 ms a turn may take, and ordinary answers (a few hundred tokens of
 * text, without logprobs) never pay a pool round trip (two thread
 * hand-offs) for nothing. */
#define ANSWER_ON_LOOP_BYTES ((size_t)64 << 10)
/* What one token or alternative of a logprobs or details list prints to,
 * a middle figure: OpenAI's alternative ("text": logprob) is about 20
 * bytes, chat's and TGI's objects 50 to 80 with a token's text; the
 * threshold above leaves room for either. */
#define ANSWER_BYTES_PER_ENTRY 48

/* What g's whole answer may print to, figured in time linear in its
 * choices and prompts, not their tokens: each choice's text (and its
 * prompt's, with echo or return_full_text) and, when the answer lists
 * tokens (logprobs, TGI's details), ANSWER_BYTES_PER_ENTRY per token and
 * per alternative, the prompt's scored tokens too. Every choice counts,
 * answered or not (TGI's best_of_sequences lists them all): an estimate
 * within about twice either way (escapes aside), which is all the choice
 * of thread needs. */
static size_t answer_estimate(const srv_gen *g)
{
    bool lists = g->logprobs || g->details;
    size_t per_token = ANSWER_BYTES_PER_ENTRY * (1 + (size_t)g->top_n);
    size_t bytes = 0;
    for (int32_t p = 0; p < g->n_parts; p++) {
        const srv_gen_part *part = &g->parts[p];
        size_t prompt = g->return_full_text && part->text ? strlen(part->text) : 0;
        if (lists && g->prompt_logprobs)
            prompt += (size_t)part->n_tokens * per_token;
        for (int32_t k = 0; k < g->per_part; k++) {
            const srv_gen_choice *ch = &g->choices[p * g->per_part + k];
            bytes += prompt + ch->text_len + (lists ? ch->n_tokens * per_token : 0);
        }
    }
    return bytes;
}

/* A whole answer being built on the pool (answer_run), and answered
 * (answer_done), which frees g. */
typedef struct answer_job {
    srv_gen *g;
    char *json; /* the printed answer; NULL when memory was short */
} answer_job;

/* On a pool thread: g's answer built and printed, then the tree and g's
 * choices and prompts (a block per token: many small frees) freed here
 * rather than on the loop; what is left of g is freed by answer_done. */
static void answer_run(srv_pool_job *w)
{
    answer_job *j = w->data;
    srv_gen *g = j->g;
    cJSON *o = g->shape->whole(g, &g->usage);
    j->json = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    for (int32_t i = 0; i < g->n_choices; i++)
        choice_free(&g->choices[i]);
    for (int32_t p = 0; p < g->n_parts; p++)
        part_free(&g->parts[p]);
}

/* On the loop: answer with what answer_run printed (the write takes it;
 * http.c trims the heap once a large one is written), or a 500 when
 * memory was short; a client that has gone hears nothing, and its answer
 * is freed and the heap trimmed here. Frees g (and its held bytes). */
static void answer_done(srv_pool_job *w)
{
    answer_job *j = w->data;
    if (w->conn && j->json) {
        srv_http_respond_json_owned(w->conn, 200, j->json);
    } else if (w->conn) {
        srv_http_respond_error(w->conn, 500, "internal", "out of memory", NULL);
    } else {
        free(j->json);
        srv_http_trim_soon(w->s); /* never written, so http.c will not trim after it */
    }
    gen_free_memory(j->g);
    free(j);
}

/* Hand g's answer to c to the pool: true, g being the work's from here
 * on; false when memory is short or the pool refuses (g still the
 * caller's, nothing started). */
static bool answer_on_pool(srv_gen *g, srv_conn *c)
{
    answer_job *j = calloc(1, sizeof *j);
    srv_pool_job *w = j ? calloc(1, sizeof *w) : NULL;
    if (!w) {
        free(j);
        return false;
    }
    j->g = g;
    *w = (srv_pool_job){.s = g->s, .conn = c, .data = j, .run = answer_run, .done = answer_done};
    if (srv_pool_start(w) != 0) {
        free(w);
        free(j);
        return false;
    }
    c->work = w;
    return true;
}

/* Answer c with g's whole answer, g's every prompt ended and g off the
 * live list: a 500 when the engine failed it (nothing built), built and
 * printed here when small (or when the pool cannot take it), else on the
 * pool: true, g being the work's. */
static bool answer_whole(srv_gen *g, srv_conn *c)
{
    bool failed = g->why == ENG_FINISH_ERROR;
    if (!failed && answer_estimate(g) > ANSWER_ON_LOOP_BYTES && answer_on_pool(g, c))
        return true;
    srv_req_respond_generation(c, failed ? NULL : g->shape->whole(g, &g->usage), g->why);
    return false;
}

/* error, then the grammar's, then cancelled, then whatever came first */
static eng_finish worse(eng_finish a, eng_finish b)
{
    if (a == ENG_FINISH_ERROR || b == ENG_FINISH_ERROR)
        return ENG_FINISH_ERROR;
    if (a == ENG_FINISH_GRAMMAR || b == ENG_FINISH_GRAMMAR)
        return ENG_FINISH_GRAMMAR;
    if (a == ENG_FINISH_CANCELLED || b == ENG_FINISH_CANCELLED)
        return ENG_FINISH_CANCELLED;
    return a;
}

/* Why g failed, into msg, with the status it answers (400: its grammar passed its
 * budget; 500: the engine failed it), or 0 when it did not. */
static int failure_of(const srv_gen *g, char *msg, size_t cap)
{
    if (g->why == ENG_FINISH_GRAMMAR) {
        snprintf(msg, cap,
                 "%s: the grammar needs more matcher steps for one token than a request may "
                 "take in one engine step (%d walks of the vocabulary); simplify it",
                 g->grammar_where, GR_STEP_WALKS);
        return 400;
    }
    if (g->why == ENG_FINISH_ERROR) {
        snprintf(msg, cap, "the engine failed this request");
        return 500;
    }
    return 0;
}

/* One prompt's request has ended; the last one answers and frees g. */
static void on_done_event(srv_gen *g, srv_gen_part *part, const srv_event *ev)
{
    srv_server *s = g->s;
    srv_metrics *m = &s->metrics;
    if (ev->usage.prompt_tokens > 0 || ev->why != ENG_FINISH_CANCELLED) {
        m->generations++;
        m->generated_tokens += (uint64_t)ev->usage.generated_tokens;
        m->prompt_tokens += (uint64_t)ev->usage.prompt_tokens;
    }
    g->why = g->parts_done == 0 ? ev->why : worse(g->why, ev->why);
    g->usage.prompt_tokens += ev->usage.prompt_tokens;
    g->usage.cached_tokens += ev->usage.cached_tokens;
    g->usage.generated_tokens += ev->usage.generated_tokens;
    g->usage.spec.drafted += ev->usage.spec.drafted;
    g->usage.spec.accepted += ev->usage.spec.accepted;
    part->done = true;
    /* a choice that never began (cancelled while waiting) ends as its request did */
    for (int32_t k = 0; k < g->per_part; k++) {
        srv_gen_choice *ch = &g->choices[part->index * g->per_part + k];
        if (!ch->ended) {
            ch->ended = true;
            reason_update(g, ch);
            ch->why = ev->why;
            ch->generated = (int32_t)ch->n_tokens;
        }
    }
    if (++g->parts_done < g->n_parts)
        return;
    srv_metrics_observe(&m->request, ql_now_s() - g->t_start);
    srv_conn *c = g->conn;
    gen_unlive(g); /* off the engine: nothing but its answer reaches it now */
    if (c) {
        c->gen = NULL;
        char failure[512];
        int status = failure_of(g, failure, sizeof failure);
        if (status == 400 && !g->shape->stream) /* the client's grammar: a 400 */
            srv_req_fail(c, 400, "%s", failure);
        else if (!g->shape->whole) {
            /* a stream's 200 is sent: the failure is an event before its choices' ends */
            if (status)
                srv_req_stream_error(c, status, failure);
            g->shape->on_done(g, c, g->why, &g->usage);
        } else if (answer_whole(g, c))
            return; /* the pool's until its work is done */
    }
    gen_free_memory(g);
    s->hooks->check_drained(s);
}

void srv_gen_on_wake(uv_async_t *a)
{
    srv_server *s = a->data;
    pthread_mutex_lock(&s->events_mu);
    srv_event *ev = s->events;
    s->events = s->events_tail = NULL;
    pthread_mutex_unlock(&s->events_mu);
    while (ev) {
        srv_event *next = ev->next;
        srv_gen_part *part = ev->part;
        switch (ev->kind) {
        case EV_PROMPT: on_prompt_event(part->g, part, ev); break;
        case EV_TOKEN: on_token_event(part->g, part, ev); break;
        case EV_CHOICE: on_choice_event(part->g, part, ev); break;
        case EV_DONE: on_done_event(part->g, part, ev); break;
        }
        free(ev->text);
        free(ev->top);
        free(ev->tokens);
        free(ev->logprobs);
        free(ev);
        ev = next;
    }
}

/* --- what an answer is made of --------------------------------------------------- */

int32_t srv_gen_answer_order(const srv_gen *g, int32_t *idx)
{
    int32_t n = 0;
    for (int32_t p = 0; p < g->n_parts; p++) {
        const srv_gen_choice *ch = g->choices + p * g->per_part;
        bool taken[SRV_MAX_CHOICES] = {false};
        for (int32_t k = 0; k < g->keep; k++) {
            int32_t best = -1;
            for (int32_t j = 0; j < g->per_part; j++) {
                if (taken[j])
                    continue;
                if (g->per_part == g->keep) { /* all, in order */
                    best = j;
                    break;
                }
                if (best < 0 || ch[j].logprob_sum > ch[best].logprob_sum)
                    best = j;
            }
            taken[best] = true;
            idx[n++] = p * g->per_part + best;
        }
    }
    return n;
}

char *srv_gen_full_text(const srv_gen *g, int32_t i, size_t *len)
{
    *len = 0;
    const srv_gen_choice *ch = &g->choices[i];
    const srv_gen_part *part = &g->parts[i / g->per_part];
    const char *prompt = g->return_full_text && part->text ? part->text : "";
    size_t pl = strlen(prompt);
    char *out = malloc(pl + ch->text_len + 1);
    if (!out)
        return NULL;
    memcpy(out, prompt, pl);
    if (ch->text_len)
        memcpy(out + pl, ch->text, ch->text_len);
    out[pl + ch->text_len] = 0;
    *len = pl + ch->text_len;
    return out;
}

/* --- a generation request ------------------------------------------------------ */

/* The server's own limit on new tokens; the context length (prompt plus
 * new tokens) is checked by the engine at submit, which counts the
 * prompt's tokens once. */
static bool check_limits(srv_conn *c, const srv_req_ask *a)
{
    const cfg_serve *cfg = c->s->cfg;
    if (a->max_new_tokens > cfg->max_new_tokens) {
        srv_req_fail(c, 400, "max new tokens %lld is over the server's limit of %d",
                     (long long)a->max_new_tokens, cfg->max_new_tokens);
        return false;
    }
    return true;
}

/*
 * What a generation may come to hold, in bytes, figured before anything is
 * built for it: s->held_bytes counts it until the answer is done. An
 * estimate from above of the allocations (not the allocator's overhead):
 * the body (the pool's copies of its prompts, stops and grammar); each
 * prompt's ids (at most a token per byte plus BOS, and the context) in the
 * copies that keep them (the reader's, the pool's, the engine's, and each
 * choice's sampler's); the stop tables (5 bytes a byte, once per prompt);
 * each choice's state and, per token it may generate, what the engine's
 * events and the answer keep (COST_PER_TOKEN, plus 8 bytes an alternative);
 * and the prompt logprobs asked for, held by the engine and by the answer.
 */
#define COST_PER_CHOICE 1024 /* a choice's seq, sampler and stop matcher, and its answer's */
#define COST_PER_TOKEN  64   /* a token's id, text piece, offset, logprob and event */
static size_t request_cost(const srv_conn *c, const srv_req_ask *a)
{
    size_t parts = a->n_prompts ? a->n_prompts : 1;
    size_t per_part = (size_t)(a->best_of > a->n ? a->best_of : a->n > 0 ? a->n : 1);
    size_t top = a->logprobs || a->prompt_logprobs ? (size_t)a->top_logprobs : 0;
    size_t context = (size_t)c->s->model.cfg.max_position_embeddings;
    size_t stop_bytes = 0, longest = 0;
    for (size_t i = 0; i < a->n_stops; i++) {
        size_t len = strlen(a->stops[i]);
        stop_bytes += len;
        longest = len > longest ? len : longest;
    }
    size_t cost = c->req.body_len + parts * 5 * stop_bytes;
    for (size_t k = 0; k < parts; k++) {
        const srv_req_prompt *in = a->n_prompts ? &a->prompts[k] : NULL;
        const char *text = in ? in->text : a->prompt;
        size_t ids = in && !text ? in->n_tokens : text ? strlen(text) + 2 : context;
        if (context && ids > context)
            ids = context;
        cost += ids * sizeof(int32_t) * (3 + per_part);
        if (a->return_full_text) /* the prompt's text, kept and in each answer */
            cost += (text ? strlen(text) : ids * sizeof(int32_t)) * (1 + per_part);
        if (a->prompt_logprobs)
            cost += 2 * ids * (sizeof(float) + top * sizeof(eng_logprob));
    }
    size_t max_new = a->max_new_tokens > 0 ? (size_t)a->max_new_tokens : 0;
    size_t per_choice = COST_PER_CHOICE + 2 * longest +
                        a->sampling.n_logit_bias * sizeof(eng_logit_bias) +
                        max_new * (COST_PER_TOKEN + top * sizeof(eng_logprob));
    return cost + parts * per_part * per_choice;
}

/* Whether g's answer repeats at most SRV_MAX_ECHO_BYTES of prompt text
 * (echo, return_full_text: each choice's answer begins with its prompt's
 * text, kept in g's parts); else the 400. */
static bool echo_bounded(srv_conn *c, const srv_gen *g)
{
    size_t bytes = 0;
    for (int32_t p = 0; g->return_full_text && p < g->n_parts; p++)
        bytes += (g->parts[p].text ? strlen(g->parts[p].text) : 0) * (size_t)g->per_part;
    if (bytes <= SRV_MAX_ECHO_BYTES)
        return true;
    srv_req_fail(c, 400,
                 "\"echo\" (TGI's return_full_text) would repeat %zu bytes of prompt text in the "
                 "answer (each prompt's text once per choice); at most %zu",
                 bytes, SRV_MAX_ECHO_BYTES);
    return false;
}

/* Room for a request of n_parts prompts costing cost bytes, before
 * anything is built for it: the engine's queue (what waits there and what
 * the pool is building for it; the engine checks again when it queues)
 * and the server's budget of bytes held by unanswered requests. A 503
 * (with Retry-After) when there is none. */
static bool room_for(srv_conn *c, int32_t n_parts, size_t cost)
{
    srv_server *s = c->s;
    const cfg_serve *cfg = s->cfg;
    if (s->engine) {
        eng_engine_stats st;
        eng_engine_stats_get(s->engine, &st);
        int32_t limit = cfg->max_queued > 0 ? cfg->max_queued : 1; /* as serve.c starts it */
        if (st.waiting + s->n_building + n_parts > limit) {
            srv_req_fail(c, 503,
                         "the queue is full (%d requests waiting, %d being prepared, of %d); try "
                         "again later",
                         (int)st.waiting, (int)s->n_building, (int)limit);
            return false;
        }
    }
    if (cfg->max_held_bytes > 0 && s->held_bytes + cost > (size_t)cfg->max_held_bytes) {
        s->metrics.held_bytes_refused++;
        srv_req_fail(c, 503,
                     "the requests waiting and running hold %zu bytes; this one may hold %zu more, "
                     "past the server's budget of %lld (--max-held-bytes); try again later",
                     s->held_bytes, cost, (long long)cfg->max_held_bytes);
        return false;
    }
    return true;
}

bool srv_gen_ready(srv_conn *c)
{
    if (c->s->draining) {
        srv_req_fail(c, 503, "the server is shutting down");
        return false;
    }
    if (!c->s->serving) {
        srv_req_fail(c, 503, "the model is still loading");
        return false;
    }
    return true;
}

/* A new generation for a's prompts and choices, its parts' texts kept for
 * echo; NULL when memory is short. */
static srv_gen *gen_new(srv_conn *c, const srv_req_ask *a, const srv_gen_shape *shape,
                        const char *model)
{
    srv_gen *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->s = c->s;
    g->conn = c;
    g->shape = shape;
    g->t_start = ql_now_s(); /* the wait for a prompt's tokens counts */
    g->n_parts = a->n_prompts ? (int32_t)a->n_prompts : 1;
    g->keep = a->n > 0 ? a->n : 1;
    g->per_part = a->best_of > g->keep ? a->best_of : g->keep;
    g->n_choices = g->n_parts * g->per_part;
    g->logprobs = a->logprobs;
    g->prompt_logprobs = a->prompt_logprobs;
    g->top_n = a->logprobs || a->prompt_logprobs ? a->top_logprobs : 0;
    g->details = a->details;
    g->include_usage = a->include_usage;
    g->return_full_text = a->return_full_text;
    g->reasoning = a->reasoning;
    /* an answer kept inside a grammar begins where the grammar does */
    g->reason_opens = a->reasoning && c->s->reason_opens && !a->grammar_text;
    g->seed = a->sampling.seed;
    snprintf(g->grammar_where, sizeof g->grammar_where, "%s", a->grammar_where);
    g->sampled = a->sampling.temperature > 0;
    snprintf(g->model_id, sizeof g->model_id, "%s", model);
    g->parts = calloc((size_t)g->n_parts, sizeof *g->parts);
    g->choices = calloc((size_t)g->n_choices, sizeof *g->choices);
    if (!g->parts || !g->choices) {
        gen_free_memory(g);
        return NULL;
    }
    const tok_tokenizer *tok = c->s->model.tok;
    for (int32_t p = 0; p < g->n_parts; p++) {
        srv_gen_part *part = &g->parts[p];
        part->g = g;
        part->index = p;
        const srv_req_prompt *in = a->n_prompts ? &a->prompts[p] : NULL;
        const char *text = in ? in->text : a->prompt;
        size_t len = 0;
        if (!g->return_full_text)
            ; /* nothing to keep */
        else if (text)
            part->text = strdup(text);
        else if (tok_decode(tok, in->tokens, in->n_tokens, false, &part->text, &len, NULL, 0) !=
                 QL_OK)
            part->text = NULL; /* an id outside the vocabulary: submit says so */
        for (int32_t k = 0; k < g->per_part; k++)
            g->choices[p * g->per_part + k].seed = g->seed + (uint64_t)k;
    }
    return g;
}

/* Answer a refused prompt with status: "prompt <part>: " before msg when
 * the request has several (part >= 0). */
static void fail_part(srv_conn *c, int status, int32_t part, const char *msg)
{
    if (part >= 0)
        srv_req_fail(c, status, "prompt %d: %s", part, msg);
    else
        srv_req_fail(c, status, "%s", msg);
}

/* Queue each of g's prompts, built off the loop (built[p], each taken);
 * on a refusal (a full queue) cancel those already in, which then end
 * unheard (g is detached), and answer it. */
static bool gen_submit_all(srv_conn *c, srv_gen *g, eng_built **built)
{
    char msg[1024];
    bool several = g->n_parts > 1;
    for (int32_t p = 0; p < g->n_parts; p++) {
        eng_built *b = built[p];
        built[p] = NULL;
        int rc = eng_engine_queue(c->s->engine, b, &g->parts[p].id, msg, sizeof msg);
        if (rc == QL_OK)
            continue;
        if (p == 0) {
            gen_free_memory(g);
        } else {
            /* the prompts already in end unheard; the rest never began */
            for (int32_t k = p; k < g->n_parts; k++)
                part_free(&g->parts[k]);
            g->n_parts = p;
            gen_live(g);
            gen_cancel(g);
        }
        fail_part(c, srv_req_status_of(rc), several ? p : -1, msg);
        return false;
    }
    gen_live(g);
    c->gen = g;
    if (g->shape->stream)
        srv_http_stream_begin(c);
    return true;
}

/*
 * Every generation is prepared off the loop, in one pass on a pool thread
 * (prep_run): an adapter named for the first time loaded, the grammar
 * compiled, a chat template rendered (maker, handed the adapter), and
 * each prompt prepared by the engine's one call (eng_engine_build: BOS,
 * tokenizing, truncation, the context and KV checks, samplers, stop
 * tables, prompt logprob arrays); then queued from the loop (prep_done),
 * where only the queue's room is checked again. Each step is linear in
 * what the client sent, which may be a megabyte of hostile text, and
 * nothing on the loop may take that long: /health must answer meanwhile.
 * A request given as ids only is the same path with nothing to tokenize.
 *
 * A gen_prep owns everything of the request from generate's first line
 * until prep_done hands the generation to the loop's live list: the API's
 * answer state (until the generation takes it), the maker, the adapter's
 * one reference, the generation itself, and copies of everything of the
 * srv_req_ask the engine still reads, since the body it pointed into is
 * gone by then; prep_free lets go of whatever it still holds. Its prompts
 * count in s->n_building until it is freed.
 */
typedef struct gen_prep {
    srv_server *s;
    int32_t reserved; /* what it counts in s->n_building */
    srv_gen *g;       /* the generation (NULL until made; handed on by prep_done) */
    /* the API's answer state (srv_req_ask.answer), until g takes it */
    void *answer;
    void (*answer_drop)(void *answer);
    eng_request r; /* shared by every part; its pointers lead into this struct */
    /* the adapter (lora NULL: the base model), one reference: taken on the
     * loop when loaded, else by the pool from lazy, the name to load on
     * first use ("": none) */
    eng_lora_term term;
    char lazy[128];
    bool has_scale; /* the request's scale, over the adapter's default */
    float scale;
    char *stops[SRV_MAX_STOPS];
    eng_logit_bias logit_bias[ENG_MAX_LOGIT_BIAS];
    srv_gen_prompt_maker maker;        /* make NULL: the prompts are a's */
    char *texts[SRV_MAX_PROMPTS];      /* a text prompt's copy (or the one made), else NULL */
    int32_t *ids[SRV_MAX_PROMPTS];     /* a prompt given as ids: their copy */
    size_t n_ids[SRV_MAX_PROMPTS];     /* and their count */
    eng_built *built[SRV_MAX_PROMPTS]; /* each part's request, built by run (owned) */
    const char *prompt_logprobs_field; /* srv_req_ask's (a literal) */
    int32_t failed;                    /* the part refused, or -1 */
    /* the grammar to compile (NULL: none) and what it came from; the
     * compiled one is r.grammar, a reference of ours */
    char *grammar_text;
    gr_kind grammar_kind;
    char grammar_where[128];
} gen_prep;

static void prep_free(gen_prep *p)
{
    if (p->maker.drop)
        p->maker.drop(p->maker.arg);
    for (size_t i = 0; i < SRV_MAX_STOPS; i++)
        free(p->stops[i]);
    for (size_t i = 0; i < SRV_MAX_PROMPTS; i++) {
        free(p->texts[i]);
        free(p->ids[i]);
        eng_built_free(p->built[i]);
    }
    p->s->n_building -= p->reserved;
    eng_lora_unref(p->term.lora);
    free(p->grammar_text);
    if (p->r.grammar)
        gr_grammar_unref(p->r.grammar);
    if (p->g)
        gen_free_memory(p->g); /* and the answer state with it */
    else if (p->answer_drop)
        p->answer_drop(p->answer);
    free(p);
}

/* A preparation for c taking a's answer state and maker (make NULL: a's
 * own prompts); NULL after the 503 when memory is short, both dropped. */
static gen_prep *prep_take(srv_conn *c, srv_req_ask *a, srv_gen_prompt_maker maker)
{
    gen_prep *p = calloc(1, sizeof *p);
    if (p) {
        *p = (gen_prep){.s = c->s,
                        .answer = a->answer,
                        .answer_drop = a->answer_drop,
                        .term = {NULL, 1.0f},
                        .maker = maker,
                        .failed = -1};
    } else {
        srv_req_fail(c, 503, "out of memory");
        if (a->answer_drop)
            a->answer_drop(a->answer);
        if (maker.drop)
            maker.drop(maker.arg);
    }
    a->answer = NULL;
    a->answer_drop = NULL;
    return p;
}

/* Whether a request naming name, not loaded, may have it loaded on first
 * use: an adapter folder, lazy loading not turned off, and a name that can
 * only be a folder's own (admin.c's name rules; no leading '.', so neither
 * "." nor ".." nor a hidden file). Whether the folder exists is for the
 * pool to find out (lora_registry_acquire). */
static bool loadable_by_name(const srv_server *s, const char *name)
{
    if (!s->registry || !s->cfg->adapter_dir || s->cfg->no_lazy_adapters)
        return false;
    return name[0] != '.' && srv_req_is_adapter_name(name);
}

/* The adapter a names, acquired once for the whole request: a loaded one's
 * reference into p->term with its default scale, unless the request gives
 * one; one not loaded is left for the pool to load (p->lazy) when it may
 * be, else the 404 in the API's words. */
static bool prep_adapter(srv_conn *c, gen_prep *p, const srv_req_ask *a, const srv_gen_shape *shape)
{
    const char *name = a->adapter;
    if (name && name[0] &&
        (!c->s->registry || lora_registry_want(c->s->registry, name, &p->term, NULL, 0) != QL_OK)) {
        if (!loadable_by_name(c->s, name)) {
            srv_req_fail(c, 404, "%s %s%s", shape->adapter_noun, name, shape->adapter_unknown);
            return false;
        }
        snprintf(p->lazy, sizeof p->lazy, "%s", name);
    }
    p->has_scale = a->has_scale;
    p->scale = (float)a->adapter_scale;
    if (p->has_scale)
        p->term.scale = p->scale;
    return true;
}

/* Room for a's cost, then its generation (p->g, holding the answer state
 * and counted in s->held_bytes), its echo bounded; false after answering. */
static bool prep_gen(srv_conn *c, gen_prep *p, const srv_req_ask *a, const srv_gen_shape *shape)
{
    size_t cost = request_cost(c, a);
    if (!room_for(c, a->n_prompts ? (int32_t)a->n_prompts : 1, cost))
        return false;
    const char *model = p->term.lora ? p->term.lora->name : p->lazy[0] ? p->lazy : c->s->model_id;
    p->g = gen_new(c, a, shape, model);
    if (!p->g) {
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    p->g->answer = p->answer;
    p->g->answer_drop = p->answer_drop;
    p->answer = NULL;
    p->answer_drop = NULL;
    p->g->cost = cost;
    c->s->held_bytes += cost;
    return echo_bounded(c, p->g);
}

/* The engine's request for a (p->r, adapters set on the pool), with a's
 * prompts (texts, or ids; none with a maker), stops, logit bias and
 * grammar copied into p, and its prompts counted in s->n_building; false
 * after the 503 when memory is short. */
static bool prep_copy(srv_conn *c, gen_prep *p, const srv_req_ask *a)
{
    const srv_gen *g = p->g;
    p->r = (eng_request){.max_new_tokens = (int32_t)a->max_new_tokens,
                         .sampling = a->sampling,
                         .spec = a->spec,
                         .stop = (const char *const *)p->stops,
                         .n_stop = a->n_stops,
                         .fill_context = a->fill_context,
                         .templated = a->templated,
                         .truncate = a->truncate,
                         .n_choices = g->per_part,
                         .logprobs = a->logprobs || g->per_part > g->keep,
                         .top_logprobs = a->logprobs || a->prompt_logprobs ? a->top_logprobs : 0,
                         .prompt_logprobs = a->prompt_logprobs,
                         .skip_special_tokens = !a->keep_special,
                         .include_stop_str = a->include_stop_str,
                         .on_prompt = bridge_prompt,
                         .on_token = bridge_token,
                         .on_choice_done = bridge_choice_done,
                         .on_done = bridge_done};
    p->reserved = g->n_parts;
    p->s->n_building += p->reserved;
    p->prompt_logprobs_field = a->prompt_logprobs_field;
    bool ok = true;
    for (size_t i = 0; i < a->n_stops && i < SRV_MAX_STOPS; i++)
        ok = ok && (p->stops[i] = strdup(a->stops[i])) != NULL;
    if (a->sampling.n_logit_bias)
        memcpy(p->logit_bias, a->sampling.logit_bias,
               a->sampling.n_logit_bias * sizeof *p->logit_bias);
    p->r.sampling.logit_bias = p->logit_bias;
    if (ok && a->grammar_text) {
        ok = (p->grammar_text = strdup(a->grammar_text)) != NULL;
        p->grammar_kind = a->grammar_kind;
        snprintf(p->grammar_where, sizeof p->grammar_where, "%s", a->grammar_where);
    }
    for (int32_t k = 0; ok && !p->maker.make && k < g->n_parts; k++) {
        const srv_req_prompt *in = a->n_prompts ? &a->prompts[k] : NULL;
        const char *text = in ? in->text : a->prompt;
        if (text) {
            ok = (p->texts[k] = strdup(text)) != NULL;
        } else if (in->n_tokens) {
            ok = (p->ids[k] = malloc(in->n_tokens * sizeof *p->ids[k])) != NULL;
            if (ok)
                memcpy(p->ids[k], in->tokens, in->n_tokens * sizeof *p->ids[k]);
            p->n_ids[k] = in->n_tokens;
        }
    }
    if (!ok)
        srv_req_fail(c, 503, "out of memory");
    return ok;
}

/* On a pool thread: the adapter p->lazy names loaded (or found, when
 * another request loaded it meanwhile) into p->term, with the request's
 * scale; false with the refusal in w (404 in the API's words when there is
 * no such folder). */
static bool acquire_adapter(srv_pool_job *w, gen_prep *p)
{
    srv_server *s = w->s;
    w->rc = lora_registry_acquire(s->registry, p->lazy, s->cfg->adapter_dir, &p->term, w->msg,
                                  sizeof w->msg);
    if (w->rc == QL_ENOTFOUND) {
        w->status = 404;
        snprintf(w->msg, sizeof w->msg, "%s %s%s", p->g->shape->adapter_noun, p->lazy,
                 p->g->shape->adapter_unknown);
    }
    if (w->rc != QL_OK)
        return false;
    if (p->has_scale)
        p->term.scale = p->scale;
    return true;
}

/* On a pool thread: the request's grammar compiled (or found in the
 * server's cache) into p->r.grammar; false with the refusal in w, which
 * names the field the grammar came from and the place in it. */
static bool compile_grammar(srv_pool_job *w, gen_prep *p)
{
    gr_cache *cache = w->s->grammars;
    size_t len = strlen(p->grammar_text);
    char why[768];
    w->rc = cache ? gr_cache_get(cache, p->grammar_kind, p->grammar_text, len, &p->r.grammar, why,
                                 sizeof why)
                  : gr_compile(p->grammar_kind, p->grammar_text, len, 0, &p->r.grammar, why,
                               sizeof why);
    /* its first token within one engine step's budget, found here rather than on the engine */
    if (w->rc == QL_OK &&
        (w->rc = eng_engine_check_grammar(w->s->engine, p->r.grammar, why, sizeof why)) != QL_OK)
        gr_grammar_unref(p->r.grammar);
    if (w->rc == QL_OK)
        return true;
    p->r.grammar = NULL;
    /* a bad schema or regex, or one over the bound, is the client's */
    w->status = w->rc == QL_ENOMEM ? 503 : 400;
    snprintf(w->msg, sizeof w->msg, "%s: %s", p->grammar_where, why);
    return false;
}

/* On a pool thread: each prompt prepared by the engine's one call
 * (p->built: tokenized with BOS or copied, truncated, checked against the
 * context and the cache); false with the refusal in w and the part in
 * p->failed. */
static bool build_parts(srv_pool_job *w, gen_prep *p)
{
    for (int32_t k = 0; k < p->g->n_parts; k++) {
        eng_request r = p->r;
        r.prompt = p->texts[k];
        r.prompt_len = p->texts[k] ? strlen(p->texts[k]) : 0;
        r.prompt_tokens = p->texts[k] ? NULL : p->ids[k];
        r.n_prompt_tokens = p->texts[k] ? 0 : p->n_ids[k];
        r.user = &p->g->parts[k];
        w->rc = eng_engine_build(w->s->engine, &r, &p->built[k], w->msg, sizeof w->msg);
        if (w->rc != QL_OK) {
            p->failed = k;
            return false;
        }
    }
    return true;
}

/* On a pool thread: whether the prompt logprobs asked for stay inside
 * SRV_MAX_PROMPT_LOGPROB_TOKENS and _ENTRIES, summed over the prompts as
 * the engine prepared them (truncated); else the 400 in w, naming the
 * field. */
static bool prompt_logprobs_bounded(srv_pool_job *w, gen_prep *p)
{
    size_t tokens = 0;
    for (int32_t k = 0; k < p->g->n_parts; k++)
        tokens += eng_built_prompt_tokens(p->built[k]);
    size_t entries = tokens * (1 + (size_t)p->r.top_logprobs);
    const char *field = p->prompt_logprobs_field ? p->prompt_logprobs_field : "prompt logprobs";
    if (tokens <= SRV_MAX_PROMPT_LOGPROB_TOKENS && entries <= SRV_MAX_PROMPT_LOGPROB_ENTRIES)
        return true;
    w->rc = QL_EINVAL;
    w->status = 400;
    if (tokens > SRV_MAX_PROMPT_LOGPROB_TOKENS)
        snprintf(w->msg, sizeof w->msg,
                 "%s would score %zu prompt tokens; at most %d per request (over all its prompts)",
                 field, tokens, SRV_MAX_PROMPT_LOGPROB_TOKENS);
    else
        snprintf(w->msg, sizeof w->msg,
                 "%s would answer %zu prompt tokens x %d alternatives (%zu entries); at most %d "
                 "per request",
                 field, tokens, (int)p->r.top_logprobs, entries, SRV_MAX_PROMPT_LOGPROB_ENTRIES);
    return false;
}

/* On a pool thread, the request's whole preparation, step by step; the
 * first refusal stops it (in w). */
static void prep_run(srv_pool_job *w)
{
    gen_prep *p = w->data;
    w->rc = QL_OK;
    /* the adapter: loaded on first use (the loop found it not loaded) */
    if (p->lazy[0] && !acquire_adapter(w, p))
        return;
    p->r.adapters = p->term.lora ? &p->term : NULL;
    p->r.n_adapters = p->term.lora ? 1 : 0;
    /* the grammar, compiled or from the cache */
    if (p->grammar_text && !compile_grammar(w, p))
        return;
    /* the chat prompt, rendered with the adapter's own template when it has one */
    if (p->maker.make && (w->rc = p->maker.make(p->maker.arg, p->term.lora, &p->texts[0], w->msg,
                                                sizeof w->msg)) != QL_OK)
        return;
    /* each prompt, prepared once for the engine */
    if (!build_parts(w, p))
        return;
    if (p->r.prompt_logprobs)
        prompt_logprobs_bounded(w, p);
}

/* On the loop: submit what prep_run made, unless the client has gone. */
static void prep_done(srv_pool_job *w)
{
    gen_prep *p = w->data;
    srv_conn *c = w->conn;
    if (c && w->rc != QL_OK) {
        fail_part(c, w->status ? w->status : srv_req_status_of(w->rc),
                  p->g->n_parts > 1 ? p->failed : -1, w->msg);
    } else if (c && srv_gen_ready(c)) {
        srv_gen *g = p->g;
        p->g = NULL; /* the loop's now: live, or freed with the refusal */
        gen_submit_all(c, g, p->built);
    }
    prep_free(p); /* the generation with it, when it was not submitted */
}

/* Take a's request for c, to be answered in shape: readiness, the adapter
 * acquired once, the limits and room checked on the loop (each refusal
 * answered there), then the preparation on the pool. Whatever is refused,
 * prep_free lets go of what was taken. */
static void generate(srv_conn *c, srv_req_ask *a, const srv_gen_shape *shape,
                     srv_gen_prompt_maker maker)
{
    gen_prep *p = prep_take(c, a, maker);
    if (!p)
        return;
    if (srv_gen_ready(c) && prep_adapter(c, p, a, shape) && check_limits(c, a) &&
        prep_gen(c, p, a, shape) && prep_copy(c, p, a) &&
        srv_pool_begin(c, p, prep_run, prep_done) == 0)
        return; /* p is the pool's */
    prep_free(p);
}

eng_lora *srv_gen_adapter_loaded(const srv_server *s, const char *name)
{
    eng_lora_term term = {NULL, 1.0f};
    if (!name || !s->registry || lora_registry_want(s->registry, name, &term, NULL, 0) != QL_OK)
        return NULL;
    return term.lora;
}

void srv_gen_submit(srv_conn *c, srv_req_ask *a, const srv_gen_shape *shape)
{
    generate(c, a, shape, (srv_gen_prompt_maker){0});
}

void srv_gen_submit_made(srv_conn *c, srv_req_ask *a, const srv_gen_shape *shape,
                         srv_gen_prompt_maker maker)
{
    generate(c, a, shape, maker);
}

/* --- a connection that ends ------------------------------------------------------ */

void srv_gen_conn_gone(srv_conn *c)
{
    if (c->gen) {
        /* the client left before its answer: cancel, free its KV blocks */
        c->s->metrics.disconnects++;
        gen_detach(c->gen);
        c->gen = NULL;
    }
    if (c->work) {
        /* a whole answer being built on the pool: the client left before it */
        if (c->work->done == answer_done)
            c->s->metrics.disconnects++;
        c->work->conn = NULL; /* it finishes; nobody hears */
        c->work = NULL;
    }
}

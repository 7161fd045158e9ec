/*
 * bridge.c - what runs off the loop and answers on it: generations on the
 * engine's thread and admin work on libuv's thread pool.
 *
 * A generation: srv_generate checks readiness (503 while loading or
 * draining), the adapter (one not loaded is a 404 in the API's words) and
 * the server's limit on new tokens, then submits to the engine. The
 * engine calls on_token / on_done on its own thread; they only append an
 * event to a mutex-guarded list and uv_async_send the loop, which takes
 * the whole list at once (srv_bridge_on_wake), keeps each token's text and
 * id on the generation, and hands the event to the generation's API shape
 * (api_tgi.c, api_openai.c), which turns it into bytes on the connection
 * (or nothing, when the client has gone). A generation's memory lives
 * until its on_done has been handled, whatever the connection did.
 *
 * Admin work: srv_work_start queues a srv_work whose run goes on a pool
 * thread and whose done answers on the loop, unless the client has gone.
 *
 * Offers srv_generate, srv_bridge_on_wake, srv_work_start and
 * srv_conn_gone (internal/server_internal.h). Owns every srv_gen and
 * srv_event, and a srv_work once started. Touches the engine (submit,
 * cancel), the adapter registry's lora_registry_want, request.c's errors,
 * http.c's stream start, metrics.c's histograms, and, after a generation
 * or a piece of work ends, the drain check through s->hooks (serve.c's:
 * this file names nothing above it).
 */
#include "internal/server_internal.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct srv_event {
    struct srv_event *next;
    srv_gen *g;
    bool done;
    int32_t token;
    char *text;
    size_t len;
    eng_finish why;
    eng_usage usage;
} srv_event;

/* --- the engine's callbacks (engine thread) -------------------------------------- */

static void push_event(srv_gen *g, srv_event *ev)
{
    srv_server *s = g->s;
    ev->g = g;
    pthread_mutex_lock(&s->events_mu);
    if (s->events_tail)
        s->events_tail->next = ev;
    else
        s->events = ev;
    s->events_tail = ev;
    pthread_mutex_unlock(&s->events_mu);
    uv_async_send(&s->wake);
}

static void bridge_token(void *user, const eng_token_event *te)
{
    int32_t token = te->token;
    const char *text = te->text;
    size_t len = te->len;
    srv_event *ev = calloc(1, sizeof *ev);
    if (!ev)
        return; /* the token's text is lost; the generation goes on */
    ev->token = token;
    if (len) {
        ev->text = malloc(len);
        if (ev->text) {
            memcpy(ev->text, text, len);
            ev->len = len;
        }
    }
    push_event(user, ev);
}

static void bridge_done(void *user, eng_finish why, const eng_usage *u)
{
    /* the one event that must arrive: retry the allocation rather than
     * lose a generation's end */
    srv_event *ev;
    while (!(ev = calloc(1, sizeof *ev)))
        sched_yield();
    ev->done = true;
    ev->why = why;
    ev->usage = *u;
    push_event(user, ev);
}

/* --- generations (loop) ---------------------------------------------------------- */

/* Submit r for g (the bridge's callbacks are filled in here) and put g on
 * the server's live list. A QL_E* code on refusal, msg. */
static int gen_submit(srv_gen *g, eng_request *r, char *msg, size_t msg_len)
{
    srv_server *s = g->s;
    r->on_token = bridge_token;
    r->on_done = bridge_done;
    r->user = g;
    g->t_start = ql_now_s();
    int rc = eng_engine_submit(s->engine, r, &g->id, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    s->oai_serial++;
    snprintf(g->oai_id, sizeof g->oai_id, "%s-%llu",
             g->shape->id_prefix ? g->shape->id_prefix : "cmpl", (unsigned long long)s->oai_serial);
    g->next_live = s->live;
    if (s->live)
        s->live->prev_live = g;
    s->live = g;
    s->n_live++;
    return QL_OK;
}

/* The client went away: cancel and forget the connection. */
static void gen_detach(srv_gen *g)
{
    g->conn = NULL;
    g->s->metrics.cancelled++;
    eng_engine_cancel(g->s->engine, g->id);
}

static void gen_free(srv_gen *g)
{
    srv_server *s = g->s;
    if (g->prev_live)
        g->prev_live->next_live = g->next_live;
    else
        s->live = g->next_live;
    if (g->next_live)
        g->next_live->prev_live = g->prev_live;
    s->n_live--;
    for (size_t i = 0; i < g->n_tokens; i++)
        free(g->pieces[i]);
    free(g->pieces);
    free(g->tokens);
    free(g->text);
    free(g->prompt);
    free(g);
}

static bool append_text(srv_gen *g, const char *text, size_t len)
{
    if (g->text_len + len + 1 > g->text_cap) {
        size_t cap = (g->text_len + len + 1) * 2;
        char *t = realloc(g->text, cap);
        if (!t)
            return false;
        g->text = t;
        g->text_cap = cap;
    }
    memcpy(g->text + g->text_len, text, len);
    g->text_len += len;
    g->text[g->text_len] = 0;
    return true;
}

static void record_token(srv_gen *g, int32_t token, const char *text, size_t len)
{
    if (g->n_tokens == g->cap_tokens) {
        size_t cap = g->cap_tokens ? 2 * g->cap_tokens : 32;
        int32_t *t = realloc(g->tokens, cap * sizeof *t);
        if (!t)
            return;
        g->tokens = t;
        char **p = realloc(g->pieces, cap * sizeof *p);
        if (!p)
            return;
        g->pieces = p;
        g->cap_tokens = cap;
    }
    char *piece = malloc(len + 1);
    if (!piece)
        return;
    memcpy(piece, text, len);
    piece[len] = 0;
    g->tokens[g->n_tokens] = token;
    g->pieces[g->n_tokens++] = piece;
}

static void on_token_event(srv_gen *g, const srv_event *ev)
{
    srv_server *s = g->s;
    double t = ql_now_s();
    if (ev->token >= 0) {
        if (!g->first_seen)
            srv_hist_observe(&s->metrics.ttft, t - g->t_start);
        else
            srv_hist_observe(&s->metrics.per_token, t - g->t_last);
        g->first_seen = true;
        g->t_last = t;
    }
    if (append_text(g, ev->text ? ev->text : "", ev->len) && ev->token < 0)
        g->tail_len += ev->len;
    if (ev->token >= 0)
        record_token(g, ev->token, ev->text ? ev->text : "", ev->len);
    if (g->conn && g->shape->on_token)
        g->shape->on_token(g, g->conn, ev->token, ev->text, ev->len);
}

static void on_done_event(srv_gen *g, const srv_event *ev)
{
    srv_server *s = g->s;
    srv_metrics *m = &s->metrics;
    if (ev->usage.prompt_tokens > 0 || ev->why != ENG_FINISH_CANCELLED) {
        m->generations++;
        m->generated_tokens += (uint64_t)ev->usage.generated_tokens;
        m->prompt_tokens += (uint64_t)ev->usage.prompt_tokens;
    }
    srv_hist_observe(&m->request, ql_now_s() - g->t_start);
    srv_conn *c = g->conn;
    if (c) {
        c->gen = NULL;
        const char *full = g->text ? g->text : "";
        char *joined = NULL;
        if (g->return_full_text && g->prompt) {
            size_t pl = strlen(g->prompt);
            joined = malloc(pl + g->text_len + 1);
            if (joined) {
                memcpy(joined, g->prompt, pl);
                memcpy(joined + pl, full, g->text_len + 1);
                full = joined;
            }
        }
        g->shape->on_done(g, c, full, ev->why, &ev->usage);
        free(joined);
    }
    gen_free(g);
    s->hooks->check_drained(s);
}

void srv_bridge_on_wake(uv_async_t *a)
{
    srv_server *s = a->data;
    pthread_mutex_lock(&s->events_mu);
    srv_event *ev = s->events;
    s->events = s->events_tail = NULL;
    pthread_mutex_unlock(&s->events_mu);
    while (ev) {
        srv_event *next = ev->next;
        if (ev->done)
            on_done_event(ev->g, ev);
        else
            on_token_event(ev->g, ev);
        free(ev->text);
        free(ev);
        ev = next;
    }
}

/* --- a generation request ------------------------------------------------------ */

/* The server's own limit on new tokens; the context length (prompt plus
 * new tokens) is checked by the engine at submit, which counts the
 * prompt's tokens once. */
static bool check_limits(srv_conn *c, const srv_ask *a)
{
    const cfg_serve *cfg = c->s->cfg;
    if (a->max_new_tokens > cfg->max_new_tokens) {
        srv_fail(c, 400, "max new tokens %lld is over the server's limit of %d",
                 (long long)a->max_new_tokens, cfg->max_new_tokens);
        return false;
    }
    return true;
}

bool srv_ready(srv_conn *c)
{
    if (c->s->draining) {
        srv_fail(c, 503, "the server is shutting down");
        return false;
    }
    if (!c->s->serving) {
        srv_fail(c, 503, "the model is still loading");
        return false;
    }
    return true;
}

void srv_generate(srv_conn *c, const srv_ask *a, const srv_shape *shape)
{
    if (!srv_ready(c))
        return;
    /* the adapter and its default scale, when the request gives none */
    eng_lora_term term = {NULL, 1.0f};
    char msg[1024];
    if (a->adapter && a->adapter[0]) {
        if (!c->s->registry ||
            lora_registry_want(c->s->registry, a->adapter, &term, msg, sizeof msg) != QL_OK) {
            eng_lora_unref(term.lora);
            srv_fail(c, 404, "%s %s%s", shape->adapter_noun, a->adapter, shape->adapter_unknown);
            return;
        }
    }
    eng_lora *lora = term.lora;
    if (a->has_scale)
        term.scale = (float)a->adapter_scale;
    if (!check_limits(c, a)) {
        eng_lora_unref(lora);
        return;
    }
    srv_gen *g = calloc(1, sizeof *g);
    if (!g) {
        eng_lora_unref(lora);
        srv_fail(c, 503, "out of memory");
        return;
    }
    g->s = c->s;
    g->conn = c;
    g->shape = shape;
    g->details = a->details;
    g->include_usage = a->include_usage;
    g->return_full_text = a->return_full_text;
    g->seed = a->sampling.seed;
    g->sampled = a->sampling.temperature > 0;
    snprintf(g->model_id, sizeof g->model_id, "%s", lora ? lora->name : c->s->model_id);
    if (a->return_full_text)
        g->prompt = strdup(a->prompt);
    eng_request r = {.prompt = a->prompt,
                     .prompt_len = strlen(a->prompt),
                     .max_new_tokens = (int32_t)a->max_new_tokens,
                     .sampling = a->sampling,
                     .stop = a->stops,
                     .n_stop = a->n_stops,
                     .adapters = lora ? &term : NULL,
                     .n_adapters = lora ? 1 : 0,
                     .fill_context = a->fill_context,
                     .templated = a->templated};
    int rc = gen_submit(g, &r, msg, sizeof msg);
    eng_lora_unref(lora); /* the engine took its own reference */
    if (rc != QL_OK) {
        free(g->prompt);
        free(g);
        srv_fail(c, srv_status_of(rc), "%s", msg);
        return;
    }
    c->gen = g;
    if (shape->stream)
        srv_stream_begin(c);
}

/* --- work off the loop ----------------------------------------------------------- */

static void work_run(uv_work_t *req)
{
    srv_work *w = req->data;
    w->run(w);
}

static void work_after(uv_work_t *req, int status)
{
    (void)status;
    srv_work *w = req->data;
    srv_server *s = w->s;
    if (w->conn)
        w->conn->work = NULL;
    w->done(w);
    if (w->has_report)
        lora_report_free(&w->report);
    free(w);
    s->n_work--;
    s->hooks->check_drained(s);
}

int srv_work_start(srv_work *w)
{
    w->req.data = w;
    int rc = uv_queue_work(w->s->loop, &w->req, work_run, work_after);
    if (rc == 0)
        w->s->n_work++;
    return rc;
}

/* --- a connection that ends ------------------------------------------------------ */

void srv_conn_gone(srv_conn *c)
{
    if (c->gen) {
        /* the client left before its answer: cancel, free its KV blocks */
        c->s->metrics.disconnects++;
        gen_detach(c->gen);
        c->gen = NULL;
    }
    if (c->work) {
        c->work->conn = NULL; /* it finishes; nobody hears */
        c->work = NULL;
    }
}

/*
 * scheduler.c - the engine: one thread that owns the model's run state, the
 * KV cache and the running set, and turns requests into tokens by
 * continuous batching. Other threads only submit and cancel, through a
 * small mutex-guarded inbox; nothing the engine thread computes with is
 * shared, so no lock guards a weight or a KV block.
 *
 * Each step:
 *   - take in what was submitted or cancelled;
 *   - admit waiting requests, first come first served, while a slot and
 *     their KV blocks are free (a request reserves blocks for its prompt
 *     plus max_new_tokens at admission, so a running sequence never waits
 *     for memory and never corrupts another's);
 *   - build one batch under the step's token budget: one decode token for
 *     every sequence past its prompt first, then prompt chunks (chunked
 *     prefill, so a long prompt never stalls the decodes for long);
 *   - one forward pass; sample each sequence that needs a token with its
 *     own sampler; stream its text through its stop-string filter; finish
 *     what ended and give its blocks back at once. EOS ends a sequence
 *     unless the request set ignore_eos (it is then a token of the answer)
 *     or fewer than min_tokens tokens came before it; stop strings end it
 *     only once more than min_tokens tokens are out (vLLM's rules).
 *
 * Adapters: a request names the configuration it wants; at admission a
 * sequence takes a reference on the serving weight version and keeps it to
 * its end, and applies the difference between what it wants and what that
 * version has merged, unmerged. A new version published by a merge is
 * taken between two steps; sequences already running finish on theirs.
 *
 * It offers eng_engine_* (scheduler.h) and owns the engine thread, the
 * inbox and the running set; it touches the runtime only through runtime.h
 * (eng_backend_*, eng_kv_* for the block tables), the model's weight
 * versions and adapters (references), the tokenizer's stream, and
 * sampler.c's eng_sampler and eng_stop.
 */
#include "scheduler.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *eng_finish_name(eng_finish f)
{
    switch (f) {
    case ENG_FINISH_EOS: return "eos";
    case ENG_FINISH_LENGTH: return "length";
    case ENG_FINISH_STOP: return "stop";
    case ENG_FINISH_CANCELLED: return "cancelled";
    case ENG_FINISH_ERROR: return "error";
    }
    return "unknown";
}

typedef struct seq {
    uint64_t id;
    eng_request req; /* callbacks, user, sampling, max_new_tokens (strings not kept) */
    int32_t *prompt;
    int32_t n_prompt;
    int32_t n_prefilled; /* prompt tokens in the KV cache */
    int32_t n_generated; /* tokens sampled */
    int32_t next_token;  /* the sampled token to feed next */
    int32_t reserve;     /* KV positions reserved at admission */
    eng_seq_kv kv;
    eng_sampler sampler;
    eng_stop *stop;
    tok_stream stream;
    eng_lora_term *want; /* the configuration asked for (a reference each) */
    size_t n_want;
    eng_weights *weights; /* the version it runs on, from admission (a reference) */
    eng_lora_term *delta; /* want minus what weights has merged */
    size_t n_delta;
    double t_submit, t_admit, t_first;
    struct seq *next; /* in the inbox or the waiting list */
} seq;

struct eng_engine {
    const eng_model *m;
    eng_engine_opts o;
    int32_t eos;
    eng_backend *backend; /* where steps run: cpu or cuda */
    eng_kv_cache *kv;     /* the backend's block bookkeeping */
    float *logits;        /* max_running x vocab */
    int32_t *tokens;      /* max_running: greedy tokens the backend chose */
    void *scratch;        /* the sampler's */
    pthread_t thread;

    pthread_mutex_t mu; /* guards what follows, up to the engine-only part */
    pthread_cond_t wake;
    seq *inbox, *inbox_tail;
    uint64_t *cancels;
    size_t n_cancels, cap_cancels;
    bool stopping;
    uint64_t next_id;
    int32_t queued; /* inbox + waiting, for the queue limit */
    eng_engine_stats stats;
    eng_weights *latest;          /* the last published version (a reference) */
    eng_weights *pending;         /* published, not yet taken by the engine thread */
    struct prepare_job *prepares; /* versions to build on the device, waited for */
    pthread_cond_t prepared_cv;
    int32_t old_running; /* running sequences on a version older than current */
    pthread_cond_t versions_cv;

    /* engine thread only */
    eng_weights *current; /* what new sequences get (a reference) */
    seq *waiting, *waiting_tail;
    seq **running;
    int32_t n_running;
    eng_step_seq *step;
    seq **step_owner;
};

static void seq_free(seq *s)
{
    for (size_t i = 0; i < s->n_want; i++)
        eng_lora_unref(s->want[i].lora);
    free(s->want);
    free(s->delta);
    eng_weights_unref(s->weights);
    free(s->prompt);
    eng_sampler_free(&s->sampler);
    eng_stop_free(s->stop);
    free(s);
}

/* --- finishing ------------------------------------------------------------------ */

static void emit(seq *s, int32_t token, const char *text, size_t len)
{
    eng_token_event ev = {.token = token, .text = text, .len = len};
    if (s->req.on_token)
        s->req.on_token(s->req.user, &ev);
}

/* End s: flush what the stop filter held back (unless a stop string or a
 * cancel ended it), give back its blocks, report, free. */
static void finish(eng_engine *e, seq *s, eng_finish why)
{
    if (why == ENG_FINISH_EOS || why == ENG_FINISH_LENGTH) {
        char tail[64];
        long n = tok_stream_flush(e->m->tok, &s->stream, tail, sizeof tail);
        const char *text = NULL;
        size_t len = 0;
        if (n > 0) {
            eng_stop_feed(s->stop, tail, (size_t)n, &text, &len);
            if (len)
                emit(s, -1, text, len);
        }
        eng_stop_flush(s->stop, &text, &len);
        if (len)
            emit(s, -1, text, len);
    }
    double t = ql_now_s();
    eng_usage u = {
        .prompt_tokens = s->n_prompt,
        .generated_tokens = s->n_generated,
        .queued_s = s->t_admit > 0 ? s->t_admit - s->t_submit : t - s->t_submit,
        .prefill_s = s->t_first > 0 ? s->t_first - s->t_admit : 0,
        .decode_s = s->t_first > 0 ? t - s->t_first : 0,
    };
    eng_kv_release(e->kv, &s->kv);
    /* the snapshot says the blocks are back before anyone hears it ended */
    pthread_mutex_lock(&e->mu);
    e->stats.kv_blocks_used = eng_kv_total_blocks(e->kv) - eng_kv_free_blocks(e->kv);
    pthread_mutex_unlock(&e->mu);
    if (s->req.on_done)
        s->req.on_done(s->req.user, why, &u);
    seq_free(s);
}

/* --- submitting ------------------------------------------------------------------ */

/* fill_context: lower *max_new to the room the context and the whole KV
 * cache leave after the prompt's n tokens; refuse a prompt that leaves none. */
static int fit_to_context(const eng_engine *e, size_t n, int32_t *max_new, char *msg,
                          size_t msg_len)
{
    int64_t context = e->o.max_context > 0 ? e->o.max_context : e->m->cfg.max_position_embeddings;
    int64_t cache = (int64_t)eng_kv_total_blocks(e->kv) * eng_kv_block_tokens(e->kv);
    int64_t room = (context < cache ? context : cache) - (int64_t)n;
    if (room < 1)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the prompt's %zu tokens leave no room in the context of %lld tokens", n,
                       (long long)(context < cache ? context : cache));
    if (room < *max_new)
        *max_new = (int32_t)room;
    return QL_OK;
}

int eng_engine_submit(eng_engine *e, const eng_request *r, uint64_t *id, char *msg, size_t msg_len)
{
    const eng_config *c = &e->m->cfg;
    if (!r->prompt || r->prompt_len == 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "the prompt is empty");
    long bad = ql_utf8_invalid_at((const uint8_t *)r->prompt, r->prompt_len);
    if (bad >= 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "the prompt is not valid UTF-8 at byte %ld", bad);
    if (r->max_new_tokens < 1 || r->max_new_tokens > e->o.max_new_tokens)
        return ql_fail(msg, msg_len, QL_EINVAL, "max_new_tokens %d is not in [1, %d]",
                       r->max_new_tokens, e->o.max_new_tokens);
    int rc = eng_sampling_check(&r->sampling, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    for (size_t i = 0; i < r->n_adapters; i++) {
        const eng_lora_term *t = &r->adapters[i];
        if (!t->lora || t->lora->n_layers != c->n_layers)
            return ql_fail(msg, msg_len, QL_EINVAL, "adapter %zu is not one for this model", i);
        if (!(t->scale == t->scale) || t->scale > 1e6f || t->scale < -1e6f)
            return ql_fail(msg, msg_len, QL_EINVAL, "adapter %s: scale %g is not a usable number",
                           t->lora->name, (double)t->scale);
        for (size_t j = 0; j < i; j++)
            if (r->adapters[j].lora == t->lora)
                return ql_fail(msg, msg_len, QL_EINVAL, "adapter %s is named twice", t->lora->name);
    }
    seq *s = calloc(1, sizeof *s);
    if (!s)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    if (r->n_adapters) {
        s->want = malloc(r->n_adapters * sizeof *s->want);
        if (!s->want) {
            free(s);
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        }
        for (size_t i = 0; i < r->n_adapters; i++) {
            s->want[i] = r->adapters[i];
            eng_lora_ref(s->want[i].lora);
        }
        s->n_want = r->n_adapters;
    }
    size_t n = 0;
    rc = tok_encode(e->m->tok, r->prompt, r->prompt_len, tok_adds_bos(e->m->tok) && !r->templated,
                    true, &s->prompt, &n, msg, msg_len);
    if (rc == QL_OK && n == 0)
        rc = ql_fail(msg, msg_len, QL_EINVAL, "the prompt encodes to no tokens");
    if (rc == QL_OK && (int64_t)n >= c->max_position_embeddings)
        rc = ql_fail(msg, msg_len, QL_EINVAL,
                     "the prompt is %zu tokens; the context holds %d, with room for one more", n,
                     c->max_position_embeddings);
    int32_t max_new = r->max_new_tokens;
    if (rc == QL_OK && r->fill_context)
        rc = fit_to_context(e, n, &max_new, msg, msg_len);
    if (rc == QL_OK && e->o.max_context > 0 && (int64_t)n + max_new > e->o.max_context)
        rc = ql_fail(msg, msg_len, QL_EINVAL,
                     "the prompt's %zu tokens plus max new tokens %d exceed the context length of "
                     "%d tokens",
                     n, max_new, e->o.max_context);
    s->n_prompt = (int32_t)n;
    int64_t want = (int64_t)n + max_new;
    s->reserve = (int32_t)(want < c->max_position_embeddings ? want : c->max_position_embeddings);
    if (rc == QL_OK && eng_kv_blocks_for(e->kv, s->reserve) > eng_kv_total_blocks(e->kv))
        rc = ql_fail(msg, msg_len, QL_EINVAL,
                     "%zu prompt tokens + max_new_tokens %d need %d KV blocks; the cache has %d "
                     "(lower max_new_tokens or give the KV cache more bytes)",
                     n, max_new, eng_kv_blocks_for(e->kv, s->reserve), eng_kv_total_blocks(e->kv));
    if (rc == QL_OK)
        rc = eng_sampler_init(&s->sampler, &r->sampling, s->prompt, n);
    if (rc == QL_OK)
        eng_sampler_set_eos(&s->sampler, e->eos);
    if (rc == QL_OK)
        rc = eng_stop_new(&s->stop, r->stop, r->n_stop, msg, msg_len);
    if (rc != QL_OK) {
        seq_free(s);
        return rc;
    }
    s->req = *r;
    s->req.max_new_tokens = max_new;
    s->req.prompt = NULL; /* not kept */
    s->req.stop = NULL;
    s->req.adapters = NULL;
    s->req.sampling.logit_bias = NULL; /* the sampler holds its copy */
    s->req.sampling.n_logit_bias = 0;
    eng_stop_hold(s->stop, s->req.sampling.min_tokens > 0);
    s->t_submit = ql_now_s();

    pthread_mutex_lock(&e->mu);
    if (e->stopping || e->queued >= e->o.max_queued) {
        int32_t queued = e->queued;
        bool stopping = e->stopping;
        pthread_mutex_unlock(&e->mu);
        seq_free(s);
        return stopping
                   ? ql_fail(msg, msg_len, QL_EBUSY, "the engine is stopping")
                   : ql_fail(msg, msg_len, QL_EBUSY,
                             "the queue is full (%d requests waiting); try again later", queued);
    }
    s->id = ++e->next_id;
    if (id)
        *id = s->id;
    if (e->inbox_tail)
        e->inbox_tail->next = s;
    else
        e->inbox = s;
    e->inbox_tail = s;
    e->queued++;
    e->stats.waiting = e->queued;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    return QL_OK;
}

void eng_engine_cancel(eng_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->mu);
    if (e->n_cancels == e->cap_cancels) {
        size_t cap = e->cap_cancels ? 2 * e->cap_cancels : 16;
        uint64_t *c = realloc(e->cancels, cap * sizeof *c);
        if (!c) {
            pthread_mutex_unlock(&e->mu);
            return; /* out of memory: the request runs to its end */
        }
        e->cancels = c;
        e->cap_cancels = cap;
    }
    e->cancels[e->n_cancels++] = id;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

/* --- the engine thread ---------------------------------------------------------- */

static bool is_cancelled(const uint64_t *ids, size_t n, uint64_t id)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id)
            return true;
    return false;
}

/* Cancel what the cancel list names, in the waiting list and the running set. */
static void apply_cancels(eng_engine *e, const uint64_t *ids, size_t n, bool all)
{
    seq **pp = &e->waiting;
    e->waiting_tail = NULL;
    while (*pp) {
        seq *s = *pp;
        if (all || is_cancelled(ids, n, s->id)) {
            *pp = s->next;
            pthread_mutex_lock(&e->mu);
            e->queued--;
            pthread_mutex_unlock(&e->mu);
            finish(e, s, ENG_FINISH_CANCELLED);
        } else {
            e->waiting_tail = s;
            pp = &s->next;
        }
    }
    for (int32_t i = 0; i < e->n_running;) {
        if (all || is_cancelled(ids, n, e->running[i]->id)) {
            finish(e, e->running[i], ENG_FINISH_CANCELLED);
            e->running[i] = e->running[--e->n_running];
        } else {
            i++;
        }
    }
}

/* Admit waiting requests in order while a slot and their blocks are free. */
static void admit(eng_engine *e)
{
    while (e->waiting && e->n_running < e->o.max_running) {
        seq *s = e->waiting;
        if (eng_kv_reserve(e->kv, &s->kv, s->reserve) != QL_OK)
            return; /* the head waits for blocks; order is kept */
        e->waiting = s->next;
        if (!e->waiting)
            e->waiting_tail = NULL;
        s->next = NULL;
        s->t_admit = ql_now_s();
        pthread_mutex_lock(&e->mu);
        e->queued--;
        pthread_mutex_unlock(&e->mu);
        /* the serving version, and what to apply on top of it */
        s->weights = e->current;
        eng_weights_ref(s->weights);
        if (eng_lora_difference(s->want, s->n_want, s->weights->merged, s->weights->n_merged,
                                &s->delta, &s->n_delta) != QL_OK) {
            finish(e, s, ENG_FINISH_ERROR);
            continue;
        }
        for (size_t i = 0; i < s->n_want; i++)
            __atomic_add_fetch(&s->want[i].lora->requests, 1, __ATOMIC_RELAXED);
        if (s->n_delta) {
            pthread_mutex_lock(&e->mu);
            e->stats.adapter_requests++;
            pthread_mutex_unlock(&e->mu);
        }
        e->running[e->n_running++] = s;
    }
}

/* A sampled token: stream its text, decide whether s ends. Returns true
 * when s has finished (and is freed). */
static bool take_token(eng_engine *e, seq *s, int32_t token)
{
    const eng_config *c = &e->m->cfg;
    s->n_generated++;
    if (s->n_generated == 1)
        s->t_first = ql_now_s();
    /* min_tokens keeps EOS from being chosen (the sampler); should it come
     * all the same (every logit -inf), it does not end the answer early,
     * and with ignore_eos it never does: it is then a token like another */
    if (token == e->eos && !s->req.sampling.ignore_eos && eng_sampler_may_end(&s->sampler)) {
        s->n_generated--; /* the end marker is not part of the answer */
        finish(e, s, ENG_FINISH_EOS);
        return true;
    }
    /* stop strings end the answer only once more than min_tokens tokens are
     * out (vLLM v1's detokenizer, tests/detokenizer/test_min_tokens.py) */
    eng_stop_hold(s->stop, s->n_generated <= s->req.sampling.min_tokens);
    char piece[1024];
    long n = tok_stream_push(e->m->tok, &s->stream, token, piece, sizeof piece);
    const char *text = NULL;
    size_t len = 0;
    bool stopped = eng_stop_feed(s->stop, piece, n > 0 ? (size_t)n : 0, &text, &len);
    emit(s, token, text, len);
    if (stopped) {
        finish(e, s, ENG_FINISH_STOP);
        return true;
    }
    if (s->n_generated >= s->req.max_new_tokens ||
        s->n_prompt + s->n_generated >= c->max_position_embeddings) {
        finish(e, s, ENG_FINISH_LENGTH);
        return true;
    }
    s->next_token = token;
    return false;
}

/* One forward step over the running set; false when there was nothing to do. */
static bool run_step(eng_engine *e)
{
    int32_t n = 0, budget = e->o.step_tokens;
    /* decodes first: one token each */
    for (int32_t i = 0; i < e->n_running && budget > 0; i++) {
        seq *s = e->running[i];
        if (s->n_prefilled < s->n_prompt)
            continue;
        e->step[n] = (eng_step_seq){.kv = &s->kv,
                                    .tokens = &s->next_token,
                                    .n_tokens = 1,
                                    .pos = s->n_prompt + s->n_generated - 1,
                                    .weights = s->weights,
                                    .delta = s->delta,
                                    .n_delta = (int32_t)s->n_delta};
        e->step_owner[n++] = s;
        budget--;
    }
    /* then prompt chunks */
    for (int32_t i = 0; i < e->n_running && budget > 0; i++) {
        seq *s = e->running[i];
        if (s->n_prefilled >= s->n_prompt)
            continue;
        int32_t chunk = s->n_prompt - s->n_prefilled;
        chunk = chunk < e->o.prefill_chunk ? chunk : e->o.prefill_chunk;
        chunk = chunk < budget ? chunk : budget;
        e->step[n] = (eng_step_seq){.kv = &s->kv,
                                    .tokens = s->prompt + s->n_prefilled,
                                    .n_tokens = chunk,
                                    .pos = s->n_prefilled,
                                    .weights = s->weights,
                                    .delta = s->delta,
                                    .n_delta = (int32_t)s->n_delta};
        e->step_owner[n++] = s;
        budget -= chunk;
    }
    if (n == 0)
        return false;

    char msg[256];
    /* what the backend may choose where the logits are: greedy tokens, and
     * plain temperature draws of the sequences that take a token this step
     * (their uniform drawn here, as eng_sample would) */
    bool draws = eng_backend_draws(e->backend);
    int32_t vocab_size = e->m->cfg.vocab_size;
    for (int32_t k = 0; k < n; k++) {
        seq *s = e->step_owner[k];
        eng_step_seq *q = &e->step[k];
        bool takes_token = s->n_prefilled + q->n_tokens >= s->n_prompt;
        q->greedy = eng_sampler_greedy(&s->sampler);
        q->draw = draws && takes_token && !q->greedy &&
                  eng_sampler_plain_draw(&s->sampler, vocab_size, &q->inv_temperature);
        if (q->draw)
            q->u = eng_sampler_uniform(&s->sampler);
    }
    int rc = eng_backend_forward(e->backend, e->step, n, e->logits, e->tokens, msg, sizeof msg);
    if (rc != QL_OK) /* the step's sequences end with an error; say why once */
        fprintf(stderr, "qlserve: a step of %d sequences failed: %s\n", n, msg);
    int32_t vocab = e->m->cfg.vocab_size;
    uint64_t generated = 0, prompt = 0;
    for (int32_t k = 0; k < n; k++) {
        seq *s = e->step_owner[k];
        bool prefill = s->n_prefilled < s->n_prompt;
        if (prefill) {
            s->n_prefilled += e->step[k].n_tokens;
            prompt += (uint64_t)e->step[k].n_tokens;
        }
        bool ended;
        if (rc != QL_OK) {
            finish(e, s, ENG_FINISH_ERROR);
            ended = true;
        } else if (prefill && s->n_prefilled < s->n_prompt) {
            continue; /* more prompt to go: these logits are not needed */
        } else {
            int32_t token = e->tokens[k];
            if (token >= 0 || e->step[k].draw) /* a draw's uniform is taken: never again */
                eng_sampler_record(&s->sampler, token = token >= 0 ? token : 0);
            else
                token = eng_sample(&s->sampler, e->logits + (size_t)k * (size_t)vocab, vocab,
                                   e->scratch);
            generated++;
            ended = take_token(e, s, token);
        }
        if (ended) {
            for (int32_t i = 0; i < e->n_running; i++)
                if (e->running[i] == s) {
                    e->running[i] = e->running[--e->n_running];
                    break;
                }
        }
    }
    pthread_mutex_lock(&e->mu);
    e->stats.steps++;
    e->stats.tokens_generated += generated;
    e->stats.prompt_tokens += prompt;
    pthread_mutex_unlock(&e->mu);
    return true;
}

/* Publish the step's stats: what runs, and on which versions. */
static void note_versions(eng_engine *e)
{
    int32_t old = 0, versions = 1;
    for (int32_t i = 0; i < e->n_running; i++) {
        eng_weights *w = e->running[i]->weights;
        if (w == e->current)
            continue;
        old++;
        bool seen = false;
        for (int32_t j = 0; j < i && !seen; j++)
            seen = e->running[j]->weights == w;
        versions += !seen;
    }
    pthread_mutex_lock(&e->mu);
    e->stats.running = e->n_running;
    e->stats.waiting = e->queued;
    e->stats.kv_blocks_used = eng_kv_total_blocks(e->kv) - eng_kv_free_blocks(e->kv);
    e->stats.weights_versions = versions;
    e->old_running = old;
    if (old == 0 && !e->pending)
        pthread_cond_broadcast(&e->versions_cv);
    pthread_mutex_unlock(&e->mu);
}

/* A version for the backend to build between two steps (eng_engine_prepare);
 * the caller waits on prepared_cv until done. */
typedef struct prepare_job {
    const eng_weights *w;
    eng_merge_cost *costs;
    uint64_t *digest;
    int rc;
    bool done;
    char msg[512];
    struct prepare_job *next;
} prepare_job;

/* Run the prepare jobs taken off the list (engine thread, no lock held). */
static void run_prepares(eng_engine *e, prepare_job *jobs)
{
    for (prepare_job *j = jobs; j; j = j->next)
        j->rc = eng_backend_prepare(e->backend, j->w, j->costs, j->digest, j->msg, sizeof j->msg);
    pthread_mutex_lock(&e->mu);
    for (prepare_job *j = jobs, *next; j; j = next) {
        next = j->next; /* j belongs to its waiter once done is set */
        j->done = true;
    }
    pthread_cond_broadcast(&e->prepared_cv);
    pthread_mutex_unlock(&e->mu);
}

static void *engine_main(void *arg)
{
    eng_engine *e = arg;
    uint64_t *cancels = NULL;
    size_t cap = 0;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stopping && !e->inbox && e->n_cancels == 0 && !e->waiting && e->n_running == 0 &&
               !e->pending && !e->prepares)
            pthread_cond_wait(&e->wake, &e->mu);
        prepare_job *prepares = e->prepares;
        e->prepares = NULL;
        /* a published version: new sequences get it from now on */
        eng_weights *retired = NULL;
        if (e->pending) {
            retired = e->current;
            e->current = e->pending;
            e->pending = NULL;
        }
        /* take in the inbox and the cancel list */
        if (e->inbox) {
            if (e->waiting_tail)
                e->waiting_tail->next = e->inbox;
            else
                e->waiting = e->inbox;
            e->waiting_tail = e->inbox_tail;
            e->inbox = e->inbox_tail = NULL;
        }
        size_t n_cancels = e->n_cancels;
        if (n_cancels > cap) {
            uint64_t *c = realloc(cancels, n_cancels * sizeof *c);
            if (c) {
                cancels = c;
                cap = n_cancels;
            } else {
                n_cancels = cap; /* the rest stay listed for the next round */
            }
        }
        if (n_cancels) {
            memcpy(cancels, e->cancels, n_cancels * sizeof *cancels);
            memmove(e->cancels, e->cancels + n_cancels,
                    (e->n_cancels - n_cancels) * sizeof *cancels);
            e->n_cancels -= n_cancels;
        }
        bool stopping = e->stopping;
        pthread_mutex_unlock(&e->mu);
        eng_weights_unref(retired); /* freed here if no sequence runs on it */
        if (prepares)
            run_prepares(e, prepares);

        apply_cancels(e, cancels, n_cancels, stopping);
        if (stopping)
            break;
        admit(e);
        run_step(e);

        note_versions(e);
    }
    free(cancels);
    return NULL;
}

/* --- start and stop ---------------------------------------------------------------- */

static void engine_free(eng_engine *e)
{
    eng_backend_free(e->backend);
    free(e->logits);
    free(e->tokens);
    free(e->scratch);
    free(e->running);
    free(e->step);
    free(e->step_owner);
    free(e->cancels);
    eng_weights_unref(e->current);
    eng_weights_unref(e->latest);
    eng_weights_unref(e->pending);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->versions_cv);
    pthread_cond_destroy(&e->prepared_cv);
    free(e);
}

int eng_engine_start(eng_engine **out, const eng_model *m, const eng_engine_opts *o, char *msg,
                     size_t msg_len)
{
    *out = NULL;
    eng_engine *e = calloc(1, sizeof *e);
    if (!e)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->versions_cv, NULL);
    pthread_cond_init(&e->prepared_cv, NULL);
    e->m = m;
    e->o = *o;
#define DEFAULT(field, value)                                                                      \
    if (e->o.field <= 0)                                                                           \
    e->o.field = (value)
    DEFAULT(kv_bytes, (size_t)256 << 20);
    DEFAULT(block_tokens, 16);
    DEFAULT(step_tokens, 256);
    DEFAULT(prefill_chunk, 128);
    DEFAULT(max_running, 64);
    DEFAULT(max_queued, 256);
    DEFAULT(max_new_tokens, 4096);
#undef DEFAULT
    /* every running sequence must fit its decode token into one step */
    if (e->o.step_tokens < e->o.max_running + 1)
        e->o.step_tokens = e->o.max_running + 1;
    e->eos = m->cfg.eos_token_id >= 0 ? m->cfg.eos_token_id : tok_eos(m->tok);
    int32_t vocab = m->cfg.vocab_size;
    int rc = eng_weights_new(&e->current, m, 0, msg, msg_len);
    if (rc == QL_OK) {
        e->latest = e->current;
        eng_weights_ref(e->latest);
        eng_backend_opts bo = {.device = o->device,
                               .threads = o->threads,
                               .max_tokens = e->o.step_tokens,
                               .max_seqs = e->o.max_running,
                               .kv_bytes = e->o.kv_bytes,
                               .block_tokens = e->o.block_tokens};
        rc = eng_backend_new(&e->backend, m, &bo, msg, msg_len);
    }
    if (rc == QL_OK) {
        e->kv = eng_backend_kv(e->backend);
        e->logits = malloc((size_t)e->o.max_running * (size_t)vocab * sizeof(float));
        e->tokens = malloc((size_t)e->o.max_running * sizeof(int32_t));
        e->scratch = malloc((size_t)vocab * (sizeof(float) + sizeof(int32_t)));
        e->running = calloc((size_t)e->o.max_running, sizeof *e->running);
        e->step = calloc((size_t)e->o.max_running, sizeof *e->step);
        e->step_owner = calloc((size_t)e->o.max_running, sizeof *e->step_owner);
        if (!e->logits || !e->tokens || !e->scratch || !e->running || !e->step || !e->step_owner)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for %d sequences",
                         e->o.max_running);
    }
    if (rc == QL_OK && pthread_create(&e->thread, NULL, engine_main, e) != 0)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "cannot start the engine thread");
    if (rc != QL_OK) {
        engine_free(e);
        return rc;
    }
    *out = e;
    return QL_OK;
}

void eng_engine_stop(eng_engine *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    /* what was submitted after the last round */
    seq *s = e->inbox;
    while (s) {
        seq *next = s->next;
        finish(e, s, ENG_FINISH_CANCELLED);
        s = next;
    }
    engine_free(e);
}

void eng_engine_publish(eng_engine *e, eng_weights *w)
{
    eng_weights_ref(w); /* one for latest; the caller's goes to pending */
    pthread_mutex_lock(&e->mu);
    eng_weights *replaced = e->pending, *old_latest = e->latest;
    e->pending = w;
    e->latest = w;
    e->stats.weights_version = w->version;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    eng_weights_unref(replaced); /* published and replaced before any sequence took it */
    eng_weights_unref(old_latest);
}

eng_weights *eng_engine_weights(eng_engine *e)
{
    pthread_mutex_lock(&e->mu);
    eng_weights *w = e->latest;
    eng_weights_ref(w);
    pthread_mutex_unlock(&e->mu);
    return w;
}

bool eng_engine_wait_versions(eng_engine *e, double timeout_s)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double end = (double)until.tv_sec + 1e-9 * (double)until.tv_nsec + timeout_s;
    until.tv_sec = (time_t)end;
    until.tv_nsec = (long)((end - (double)until.tv_sec) * 1e9);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while ((e->old_running > 0 || e->pending) && rc == 0)
        rc = pthread_cond_timedwait(&e->versions_cv, &e->mu, &until);
    bool done = e->old_running == 0 && !e->pending;
    pthread_mutex_unlock(&e->mu);
    return done;
}

void eng_engine_stats_get(eng_engine *e, eng_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->kv_blocks_total = eng_kv_total_blocks(e->kv);
    pthread_mutex_unlock(&e->mu);
}

const char *eng_engine_backend(const eng_engine *e)
{
    return eng_backend_describe(e->backend);
}

bool eng_engine_merges_on_device(const eng_engine *e)
{
    return eng_backend_merges_on_device(e->backend);
}

int eng_engine_prepare(eng_engine *e, const eng_weights *w, eng_merge_cost *costs, uint64_t *digest,
                       char *msg, size_t msg_len)
{
    if (!eng_backend_merges_on_device(e->backend)) /* refused here, before any queueing */
        return eng_backend_prepare(e->backend, w, costs, digest, msg, msg_len);
    prepare_job job = {.w = w, .costs = costs, .digest = digest};
    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        return ql_fail(msg, msg_len, QL_EINVAL, "the engine is stopping");
    }
    job.next = e->prepares;
    e->prepares = &job;
    pthread_cond_signal(&e->wake);
    while (!job.done)
        pthread_cond_wait(&e->prepared_cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    if (job.rc != QL_OK)
        return ql_fail(msg, msg_len, job.rc, "%s", job.msg);
    return QL_OK;
}

/*
 * scheduler.c - the engine: one thread that owns the model's run state, the
 * KV cache and the running set, and turns requests into tokens by
 * continuous batching. Other threads only submit and cancel, through a
 * small mutex-guarded inbox; nothing the engine thread computes with is
 * shared, so no lock guards a weight or a KV block.
 *
 * Each step:
 *   - take in what was submitted or cancelled;
 *   - admit waiting requests, first come first served, while running slots
 *     and KV blocks are free for all their choices (a request reserves
 *     blocks for its prompt plus max_new_tokens at admission, and holds
 *     what its further choices' forks and copies on write will take, so a
 *     running sequence never waits for memory and never corrupts another's);
 *   - build one batch under the step's token budget: one decode token for
 *     every choice past its prompt first, then prompt chunks (chunked
 *     prefill), as many prompt tokens as the step budget gives a step that
 *     carries decode tokens (step_budget.c: sized from the steps' measured
 *     cost, so a decoding stream never waits behind a whole prefill; the
 *     rest of a prompt goes in later steps) and the step's room when none
 *     decodes;
 *   - copy the shared KV blocks a sequence is about to write into (copy on
 *     write), then one forward pass; sample each sequence that needs a
 *     token with its own sampler; stream its text through its stop-string
 *     filter; end what ended and give its blocks back at once. EOS ends a
 *     choice unless the request set ignore_eos (it is then a token of the
 *     answer) or fewer than min_tokens tokens came before it; stop strings
 *     end it only once more than min_tokens tokens are out (vLLM's rules).
 *
 * A request of n choices (n_choices) is prefilled once, by choice 0. When
 * its prefill completes the logits row is kept, choices 1..n-1 are made
 * then as forks of choice 0's KV (sharing the prompt's blocks by
 * reference, eng_kv_fork) and every choice samples its first token from
 * that same row with its own sampler (seeded seed + choice). A choice
 * "begins" there: a request cancelled or failed before its prefill is done
 * reports no choice, only its end.
 *
 * Log-probabilities (logprobs, prompt_logprobs) are the float64
 * log-softmax of the raw logits row, taken before the sampler touches it
 * (eng_sample changes the row in place): sequences that ask for them get
 * their rows back from the backend (greedy and draw off). A prompt's come
 * from eng_step_seq.all_logits: one host buffer of prefill_chunk x vocab
 * floats, allocated when the first such request is admitted, so at most
 * one prompt_logprobs chunk runs per step (others wait their turn).
 *
 * Adapters: a request names the configuration it wants; at admission a
 * request takes a reference on the serving weight version and keeps it to
 * its end, and applies the difference between what it wants and what that
 * version has merged, unmerged. A new version published by a merge is
 * taken between two steps; sequences already running finish on theirs.
 *
 * It offers eng_engine_* (scheduler.h) and owns the engine thread, the
 * inbox and the running set; it touches the runtime only through runtime.h
 * (eng_backend_*, eng_kv_* for the block tables, forks and copies on
 * write), the model's weight versions and adapters (references), the
 * tokenizer's stream, and sampler.c's eng_sampler and eng_stop.
 */
#include "scheduler.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "drafter_internal.h"
#include "step_budget_internal.h"

const char *eng_finish_name(eng_finish f)
{
    switch (f) {
    case ENG_FINISH_EOS: return "eos";
    case ENG_FINISH_LENGTH: return "length";
    case ENG_FINISH_STOP: return "stop";
    case ENG_FINISH_CANCELLED: return "cancelled";
    case ENG_FINISH_ERROR: return "error";
    case ENG_FINISH_GRAMMAR: return "grammar";
    }
    return "unknown";
}

typedef struct eng_built request; /* scheduler.h names it for two-phase submit */

/* One choice of a request: what it samples, caches and streams on its own. */
typedef struct seq {
    request *r;
    int32_t choice;
    int32_t n_generated; /* tokens sampled (not the EOS that ended it) */
    int32_t next_token;  /* the sampled token to feed next */
    eng_seq_kv kv;
    eng_sampler sampler; /* seeded sampling.seed + choice */
    eng_stop *stop;
    tok_stream stream;
    double logprob_sum; /* of the logprobs reported (and the ending EOS's) */
    /* the sampled tokens handed on to be fed, in order (owned, realloc'd;
     * at most the reservation's room past the prompt): the answer's part
     * of what its KV holds, for the prefix cache at its end (keep_answer) */
    int32_t *fed;
    int32_t n_fed, cap_fed;
    /* speculative decoding: this step's tokens when it drafted (next_token, then n_draft
     * drafted ones; 0: next_token alone), the class of that draft, and the draft length
     * its acceptance has earned in each class */
    int32_t row[ENG_SPEC_MAX_DRAFT + 1];
    int32_t n_draft, draft_class;
    eng_spec_len spec[ENG_SPEC_CLASSES];
    eng_seq_kv draft_kv;       /* its KV in the drafter's cache (a draft model's, the MTP's) */
    eng_draft_rows draft_rows; /* the target's hidden states the MTP has not fed (mtp) */
} seq;

/* One submitted request: the prompt and what its choices share. */
struct eng_built {
    uint64_t id;
    eng_request req; /* callbacks, user, flags, sampling, max_new_tokens (strings not kept) */
    int32_t *prompt;
    int32_t n_prompt;
    int32_t n_prefilled;    /* prompt tokens in choice 0's KV */
    int32_t n_cached;       /* of them, found in the prefix cache at admission */
    uint64_t prefix_key;    /* what computes its KV: version and adapters */
    eng_prefix_chain chain; /* where its prompt's kept blocks end */
    int32_t reserve;        /* KV positions of each choice */
    bool rope_long;         /* longrope: the long factors, from reserve (eng_rope_long_for) */
    int32_t hold;           /* blocks choice 0 holds for the others' forks and copies */
    int32_t n_choices;
    seq *choices;      /* n_choices of them; 0 prefills, the others fork from it */
    bool admitted;     /* holds n_choices running slots */
    bool begun;        /* the prefill is done: every choice began */
    int32_t n_live;    /* choices begun and not ended */
    int32_t generated; /* tokens of the choices ended so far */
    bool errored, cancelled;
    /* the matcher steps its choices' grammars may still take in engine
     * step grammar_step (e->grammar_budget each step, shared by the
     * choices); grammar_failed: one of them stopped, and every choice
     * ends with ENG_FINISH_GRAMMAR by the step's end */
    int64_t grammar_left;
    uint64_t grammar_step;
    bool grammar_failed;
    eng_finish first_why;
    /* its choices' draft lengths (eng_spec_request_bounds: 0 drafts nothing), and what their
     * verifications drafted and accepted, for its usage */
    int32_t draft_max, draft_min;
    eng_spec_usage spec;
    float *prompt_lp;        /* prompt_logprobs: n_prompt of them */
    eng_logprob *prompt_top; /* and n_prompt x top_logprobs */
    eng_lora_term *want;     /* the configuration asked for (a reference each) */
    size_t n_want;
    eng_weights *weights; /* the version it runs on, from admission (a reference) */
    eng_lora_term *delta; /* want minus what weights has merged */
    size_t n_delta;
    double t_submit, t_admit, t_first;
    request *next; /* in the inbox or the waiting list */
};

/* What one step adds to the statistics (engine thread, published once). */
typedef struct step_tally {
    uint64_t generated, prompt, shared, copied;
    uint64_t prefix_queried, prefix_hit; /* prompt tokens looked up, found */
    uint64_t grammar_masks, grammar_steps;
    int64_t grammar_ns;
    eng_spec_stats spec; /* the counts only */
} step_tally;

struct eng_engine {
    const eng_model *m;
    eng_engine_opts o;
    int32_t eos;
    /* the tokens that end an answer: eos, then the config's others */
    int32_t ends[ENG_MAX_EOG + 1], n_ends;
    eng_backend *backend;    /* where steps run: cpu or cuda */
    eng_kv_cache *kv;        /* the backend's block bookkeeping */
    float *logits;           /* max_running x vocab */
    int32_t *tokens;         /* max_running: greedy tokens the backend chose */
    void *scratch;           /* the sampler's */
    gr_vocab *grammar_vocab; /* the vocabulary's bytes as a trie, for grammars (fixed) */
    int64_t grammar_budget;  /* its gr_vocab_step_budget: one request's matcher steps per step */
    eng_drafter drafter;     /* speculative decoding's (fixed); ops NULL: off */
    /* the rows of the sequences that draft in a step, end to end (speculation_start sizes it;
     * NULL: speculation off) */
    float *spec_rows;
    eng_draft_job *draft_jobs; /* max_running: a step's drafting sequences, */
    seq **draft_seqs;          /* and whose each is */
    pthread_t thread;

    pthread_mutex_t mu; /* guards what follows, up to the engine-only part */
    pthread_cond_t wake;
    request *inbox, *inbox_tail;
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
    int64_t gate; /* eng_engine_gate's: -1 open, else steps left */
    bool settled; /* the engine thread waits with nothing it can do */
    pthread_cond_t settled_cv;

    /* engine thread only */
    eng_weights *current; /* what new sequences get (a reference) */
    request *waiting, *waiting_tail;
    seq **running;
    int32_t n_running;
    int32_t slots; /* running slots the admitted requests hold (<= max_running) */
    eng_step_seq *step;
    seq **step_owner;
    eng_kv_copy *copies; /* step_tokens: a step writes into at most that many blocks */
    float *raw_row;      /* vocab: a logits row as the model gave it */
    float *work_row;     /* vocab: a copy of it for one choice's sampler */
    float *prompt_rows;  /* prefill_chunk x vocab, for prompt_logprobs (lazily) */
    step_tally tally;
    /* every sequence's verifications per class of draft, decayed alike: what a new
     * sequence's draft lengths start from (eng_spec_len_prior) */
    eng_spec_len spec_seen[ENG_SPEC_CLASSES];
    eng_step_cost cost;    /* the steps measured, for the step budget */
    eng_prefill_plan plan; /* the last step with decode tokens' budget */
    bool held;             /* the step being built left prompt tokens waiting for it */
};

static void request_free(request *r)
{
    for (int32_t i = 0; r->choices && i < r->n_choices; i++) {
        eng_sampler_free(&r->choices[i].sampler);
        eng_stop_free(r->choices[i].stop);
        free(r->choices[i].fed);
    }
    free(r->choices);
    for (size_t i = 0; i < r->n_want; i++)
        eng_lora_unref(r->want[i].lora);
    free(r->want);
    free(r->delta);
    eng_weights_unref(r->weights);
    free(r->prompt);
    free(r->prompt_lp);
    free(r->prompt_top);
    free(r);
}

/* --- log-probabilities ------------------------------------------------------------ */

/* The figures of one raw logits row: log(sum exp) in float64 (max
 * subtracted first) and its n_top most likely tokens. */
typedef struct row_lp {
    const float *raw;
    double lse;
    eng_logprob top[ENG_MAX_LOGPROBS];
    int32_t n_top;
} row_lp;

static double log_sum_exp(const float *row, int32_t vocab)
{
    float max = row[0];
    for (int32_t v = 1; v < vocab; v++)
        if (row[v] > max)
            max = row[v];
    double sum = 0;
    for (int32_t v = 0; v < vocab; v++)
        sum += exp((double)row[v] - (double)max);
    return (double)max + log(sum);
}

/* The k most likely tokens of row into top, most likely first, ties the
 * lower id first (ids come in increasing order: an equal one stays behind). */
static int32_t top_tokens(const float *row, int32_t vocab, int32_t k, double lse, eng_logprob *top)
{
    int32_t id[ENG_MAX_LOGPROBS], n = 0;
    for (int32_t v = 0; v < vocab && k > 0; v++) {
        if (n == k && !(row[v] > row[id[k - 1]]))
            continue;
        int32_t i = n < k ? n++ : k - 1;
        while (i > 0 && row[v] > row[id[i - 1]]) {
            id[i] = id[i - 1];
            i--;
        }
        id[i] = v;
    }
    for (int32_t i = 0; i < n; i++)
        top[i] = (eng_logprob){id[i], (float)((double)row[id[i]] - lse)};
    return n;
}

static void row_lp_compute(row_lp *o, const float *raw, int32_t vocab, int32_t n_top)
{
    o->raw = raw;
    o->lse = log_sum_exp(raw, vocab);
    o->n_top = top_tokens(raw, vocab, n_top, o->lse, o->top);
}

/* A prefill chunk's rows (all_logits): row j, at position pos + j, gives
 * the distribution of the prompt token at pos + j + 1. */
static void score_prompt(eng_engine *e, request *r, int32_t pos, int32_t n, const float *rows)
{
    int32_t vocab = e->m->cfg.vocab_size, n_top = r->req.top_logprobs;
    for (int32_t j = 0; j < n && pos + j + 1 < r->n_prompt; j++) {
        const float *row = rows + (size_t)j * (size_t)vocab;
        int32_t p = pos + j + 1;
        double lse = log_sum_exp(row, vocab);
        r->prompt_lp[p] = (float)((double)row[r->prompt[p]] - lse);
        if (n_top > 0)
            top_tokens(row, vocab, n_top, lse, r->prompt_top + (size_t)p * (size_t)n_top);
    }
}

/* --- ending ----------------------------------------------------------------------- */

/* What one token event carries beyond its text. */
typedef struct token_lp {
    float logprob;
    const eng_logprob *top;
    int32_t n_top;
} token_lp;

static void emit(seq *s, int32_t token, const char *text, size_t len, const token_lp *lp)
{
    eng_token_event ev = {.choice = s->choice, .token = token, .text = text, .len = len};
    if (lp) {
        ev.logprob = lp->logprob;
        ev.top = lp->top;
        ev.n_top = lp->n_top;
    }
    if (s->r->req.on_token)
        s->r->req.on_token(s->r->req.user, &ev);
}

static void drop_running(eng_engine *e, const seq *s)
{
    for (int32_t i = 0; i < e->n_running; i++)
        if (e->running[i] == s) {
            e->running[i] = e->running[--e->n_running];
            return;
        }
}

/* Add the step's counts so far to the statistics (mu held). */
static void publish_tally(eng_engine *e)
{
    e->stats.tokens_generated += e->tally.generated;
    e->stats.prompt_tokens += e->tally.prompt;
    e->stats.kv_blocks_shared += e->tally.shared;
    e->stats.kv_blocks_copied += e->tally.copied;
    e->stats.prefix_queried_tokens += e->tally.prefix_queried;
    e->stats.prefix_hit_tokens += e->tally.prefix_hit;
    e->stats.grammar_masks += e->tally.grammar_masks;
    e->stats.grammar_steps += e->tally.grammar_steps;
    e->stats.grammar_seconds += (double)e->tally.grammar_ns * 1e-9;
    e->stats.prefix_blocks = eng_kv_prefix_blocks(e->kv);
    eng_spec_stats *to = &e->stats.spec;
    const eng_spec_stats *from = &e->tally.spec;
    to->drafts += from->drafts;
    to->drafted += from->drafted;
    to->verified += from->verified;
    to->accepted += from->accepted;
    to->memory_verified += from->memory_verified;
    to->memory_accepted += from->memory_accepted;
    for (int32_t i = 0; i <= ENG_SPEC_MAX_DRAFT; i++)
        to->accepted_len[i] += from->accepted_len[i];
    for (int32_t i = 0; i < ENG_SPEC_MAX_DRAFT; i++)
        to->accepted_pos[i] += from->accepted_pos[i];
    e->tally = (step_tally){0};
}

/* Report r's end (its blocks are back and its tokens counted: the snapshot
 * says so first), free it. */
static void request_end(eng_engine *e, request *r, eng_finish why)
{
    double t = ql_now_s();
    eng_usage u = {
        .prompt_tokens = r->n_prompt,
        .cached_tokens = r->n_cached,
        .generated_tokens = r->generated,
        .queued_s = r->t_admit > 0 ? r->t_admit - r->t_submit : t - r->t_submit,
        .prefill_s = r->t_first > 0 ? r->t_first - r->t_admit : 0,
        .decode_s = r->t_first > 0 ? t - r->t_first : 0,
        .spec = r->spec,
    };
    pthread_mutex_lock(&e->mu);
    e->stats.kv_blocks_used = eng_kv_total_blocks(e->kv) - eng_kv_free_blocks(e->kv);
    e->stats.states_used = eng_kv_total_states(e->kv) - eng_kv_free_states(e->kv);
    publish_tally(e);
    pthread_mutex_unlock(&e->mu);
    if (r->req.on_done)
        r->req.on_done(r->req.user, why, &u);
    request_free(r);
}

/* End a request whose choices have not begun (waiting, or prefilling). */
static void end_unbegun(eng_engine *e, request *r, eng_finish why)
{
    eng_kv_release(e->kv, &r->choices[0].kv);
    eng_drafter_release(&e->drafter, &r->choices[0].draft_kv, &r->choices[0].draft_rows);
    drop_running(e, &r->choices[0]);
    if (r->admitted)
        e->slots -= r->n_choices;
    request_end(e, r, why);
}

/* Keep in the prefix cache the whole blocks of s's prompt and answer
 * whose KV is written (the tokens fed: not the last one sampled), going
 * on from the prompt's chain (each choice its own blocks after it), so a
 * chat's next turn, whose prompt holds this answer, starts past it. Not
 * after an error: a failed step may have written part of a block. */
static void keep_answer(eng_engine *e, seq *s, eng_finish why)
{
    request *r = s->r;
    int32_t bt = eng_kv_block_tokens(e->kv), n_fed = s->kv.n_tokens - r->n_prompt;
    if (why == ENG_FINISH_ERROR || e->o.no_prefix_cache || n_fed <= 0)
        return;
    n_fed = n_fed < s->n_fed ? n_fed : s->n_fed;
    int32_t n = r->n_prompt + n_fed;
    if (n / bt <= r->chain.n_blocks)
        return; /* no whole block past the prompt's kept ones */
    int32_t *tokens = malloc((size_t)n * sizeof *tokens);
    if (!tokens)
        return; /* the cache is an optimization: nothing kept */
    memcpy(tokens, r->prompt, (size_t)r->n_prompt * sizeof *tokens);
    memcpy(tokens + r->n_prompt, s->fed, (size_t)n_fed * sizeof *tokens);
    eng_prefix_chain chain = r->chain; /* the prompt's, shared by the choices */
    eng_kv_prefix_insert(e->kv, r->prefix_key, tokens, n, &s->kv, &chain);
    free(tokens);
}

/* Note that s's token will be fed next (keep_answer's record), within
 * the reservation; a failed growth only stops the record. */
static void record_fed(seq *s, int32_t token)
{
    int32_t room = s->r->reserve - s->r->n_prompt;
    if (s->n_fed == s->cap_fed) {
        int32_t cap = s->cap_fed ? 2 * s->cap_fed : 64;
        cap = cap < room ? cap : room;
        int32_t *p = cap > s->cap_fed ? realloc(s->fed, (size_t)cap * sizeof *p) : NULL;
        if (!p)
            return;
        s->fed = p;
        s->cap_fed = cap;
    }
    s->fed[s->n_fed++] = token;
}

/* End choice s: flush what the stop filter held back (unless a stop string
 * or a cancel ended it), give back its blocks and slot, report; the last
 * choice to end ends the request (why: error, then cancelled, then choice
 * 0's). */
static void end_choice(eng_engine *e, seq *s, eng_finish why)
{
    request *r = s->r;
    if (why == ENG_FINISH_EOS || why == ENG_FINISH_LENGTH) {
        char tail[64];
        long n = tok_stream_flush(e->m->tok, &s->stream, tail, sizeof tail);
        const char *text = NULL;
        size_t len = 0;
        if (n > 0) {
            eng_stop_feed(s->stop, tail, (size_t)n, &text, &len);
            if (len)
                emit(s, -1, text, len, NULL);
        }
        eng_stop_flush(s->stop, &text, &len);
        if (len)
            emit(s, -1, text, len, NULL);
    }
    keep_answer(e, s, why);
    if (why != ENG_FINISH_ERROR)
        eng_drafter_remember(&e->drafter, s->fed, s->n_fed);
    eng_kv_release(e->kv, &s->kv);
    eng_drafter_release(&e->drafter, &s->draft_kv, &s->draft_rows);
    drop_running(e, s);
    e->slots--;
    r->generated += s->n_generated;
    r->errored |= why == ENG_FINISH_ERROR;
    r->grammar_failed |= why == ENG_FINISH_GRAMMAR;
    r->cancelled |= why == ENG_FINISH_CANCELLED;
    if (s->choice == 0)
        r->first_why = why;
    eng_choice_end end = {.choice = s->choice,
                          .why = why,
                          .generated_tokens = s->n_generated,
                          .logprob_sum = r->req.logprobs ? s->logprob_sum : 0};
    if (r->req.on_choice_done)
        r->req.on_choice_done(r->req.user, &end);
    if (--r->n_live == 0)
        request_end(e, r,
                    r->errored          ? ENG_FINISH_ERROR
                    : r->grammar_failed ? ENG_FINISH_GRAMMAR
                    : r->cancelled      ? ENG_FINISH_CANCELLED
                                        : r->first_why);
}

/* End a running sequence, whether its request began or not. */
static void end_seq(eng_engine *e, seq *s, eng_finish why)
{
    if (s->r->begun)
        end_choice(e, s, why);
    else
        end_unbegun(e, s->r, why);
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

/* The request's fields that need no tokenizer: ranges and adapters. */
static int check_fields(const eng_engine *e, const eng_request *r, char *msg, size_t msg_len)
{
    if (r->prompt_tokens ? r->n_prompt_tokens == 0 : !r->prompt || r->prompt_len == 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "the prompt is empty");
    long bad =
        r->prompt_tokens ? -1 : ql_utf8_invalid_at((const uint8_t *)r->prompt, r->prompt_len);
    if (bad >= 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "the prompt is not valid UTF-8 at byte %ld", bad);
    if (r->grammar && r->sampling.ignore_eos)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "ignore_eos cannot be combined with a grammar: a grammar ends the answer "
                       "where the language does");
    int32_t lowest = r->prompt_logprobs ? 0 : 1;
    if (r->max_new_tokens < lowest || r->max_new_tokens > e->o.max_new_tokens)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "max_new_tokens %d is not in [%d, %d] (0 only to score the prompt, with "
                       "prompt_logprobs)",
                       r->max_new_tokens, lowest, e->o.max_new_tokens);
    int32_t most = e->o.max_running < ENG_MAX_CHOICES ? e->o.max_running : ENG_MAX_CHOICES;
    if (r->n_choices < 0 || r->n_choices > most)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "n_choices %d is not in [1, %d] (each choice needs one of the engine's %d "
                       "running slots; at most %d)",
                       r->n_choices, most, e->o.max_running, ENG_MAX_CHOICES);
    if (r->top_logprobs < 0 || r->top_logprobs > ENG_MAX_LOGPROBS)
        return ql_fail(msg, msg_len, QL_EINVAL, "top_logprobs %d is not in [0, %d]",
                       r->top_logprobs, ENG_MAX_LOGPROBS);
    if (r->truncate < 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "truncate %d is negative", r->truncate);
    int rc = eng_sampling_check(&r->sampling, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_spec_request_check(&r->spec, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    for (size_t i = 0; i < r->n_adapters; i++) {
        const eng_lora_term *t = &r->adapters[i];
        if (!t->lora || t->lora->n_layers != e->m->cfg.n_layers)
            return ql_fail(msg, msg_len, QL_EINVAL, "adapter %zu is not one for this model", i);
        if (!(t->scale == t->scale) || t->scale > 1e6f || t->scale < -1e6f)
            return ql_fail(msg, msg_len, QL_EINVAL, "adapter %s: scale %g is not a usable number",
                           t->lora->name, (double)t->scale);
        for (size_t j = 0; j < i; j++)
            if (r->adapters[j].lora == t->lora)
                return ql_fail(msg, msg_len, QL_EINVAL, "adapter %s is named twice", t->lora->name);
    }
    return QL_OK;
}

/* The prompt's ids into *ids (allocated): the given ones checked against
 * the vocabulary, or the text tokenized; *ids NULL on error. */
static int untruncated_ids(const eng_engine *e, const eng_request *r, int32_t **ids, size_t *n,
                           char *msg, size_t msg_len)
{
    *ids = NULL;
    *n = 0;
    if (r->prompt_tokens) {
        for (size_t i = 0; i < r->n_prompt_tokens; i++)
            if (r->prompt_tokens[i] < 0 || r->prompt_tokens[i] >= e->m->cfg.vocab_size)
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "prompt token %zu is %d, outside the vocabulary of %d", i,
                               r->prompt_tokens[i], e->m->cfg.vocab_size);
        *ids = malloc(r->n_prompt_tokens * sizeof **ids);
        if (!*ids)
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        memcpy(*ids, r->prompt_tokens, r->n_prompt_tokens * sizeof **ids);
        *n = r->n_prompt_tokens;
    } else {
        int rc = tok_encode(e->m->tok, r->prompt, r->prompt_len,
                            tok_adds_bos(e->m->tok) && !r->templated, true, ids, n, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        if (*n == 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "the prompt encodes to no tokens");
    }
    return QL_OK;
}

/* The prompt's ids into *ids (allocated): the given ones checked against
 * the vocabulary, or the text tokenized; then truncate's last tokens. */
static int prompt_ids(const eng_engine *e, const eng_request *r, int32_t **ids, size_t *n,
                      char *msg, size_t msg_len)
{
    int rc = untruncated_ids(e, r, ids, n, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (r->truncate > 0 && *n > (size_t)r->truncate) {
        memmove(*ids, *ids + (*n - (size_t)r->truncate), (size_t)r->truncate * sizeof **ids);
        *n = (size_t)r->truncate;
    }
    return QL_OK;
}

/* A prompt of n tokens leaves room in the context for one more. */
static int check_length(const eng_engine *e, size_t n, char *msg, size_t msg_len)
{
    int32_t context = e->m->cfg.max_position_embeddings;
    if ((int64_t)n >= context)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the prompt is %zu tokens; the context holds %d, with room for one more", n,
                       context);
    return QL_OK;
}

int eng_engine_check_grammar(const eng_engine *e, gr_grammar *g, char *msg, size_t msg_len)
{
    gr_matcher *m = NULL;
    int rc = gr_matcher_new(&m, g, e->grammar_vocab, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    /* each of up to ENG_MAX_CHOICES choices makes its own start at submit */
    int64_t start = (int64_t)gr_matcher_steps(m), most = e->grammar_budget / ENG_MAX_CHOICES;
    float *logits = malloc((size_t)e->m->cfg.vocab_size * sizeof *logits);
    if (!logits)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for a grammar's first mask");
    else if (start > most)
        rc = ql_fail(msg, msg_len, QL_EINVAL,
                     "the grammar's start takes %lld matcher steps, more than the %lld each choice "
                     "may take (one engine step's budget of %lld over %d choices); simplify it",
                     (long long)start, (long long)most, (long long)e->grammar_budget,
                     ENG_MAX_CHOICES);
    int64_t left = e->grammar_budget - start;
    if (rc == QL_OK) {
        gr_matcher_set_budget(m, &left);
        memset(logits, 0, (size_t)e->m->cfg.vocab_size * sizeof *logits);
        rc = gr_matcher_mask(m, logits);
        if (rc != QL_OK && left < 0)
            ql_fail(msg, msg_len, rc,
                    "the grammar needs more than %lld matcher steps (%d walks of the "
                    "vocabulary, one request's budget in one engine step) for its first token; "
                    "simplify it",
                    (long long)e->grammar_budget, GR_STEP_WALKS);
        else if (rc != QL_OK)
            gr_matcher_error(m, msg, msg_len);
    }
    free(logits);
    gr_matcher_free(m);
    return rc;
}

/* Positions each choice reserves, and the blocks choice 0 holds besides
 * for the others (their forks, and its own copy of the prompt's partly
 * filled last block: the first to write into it copies it), for max_new. */
static void plan_blocks(const eng_engine *e, const request *q, int32_t max_new, int32_t *reserve,
                        int32_t *hold)
{
    int64_t want = (int64_t)q->n_prompt + max_new, context = e->m->cfg.max_position_embeddings;
    *reserve = (int32_t)(want < context ? want : context);
    *hold = 0;
    if (q->n_choices > 1 && max_new > 0) {
        bool partial = q->n_prompt % eng_kv_block_tokens(e->kv) != 0;
        *hold = (q->n_choices - 1) * eng_kv_fork_blocks(e->kv, q->n_prompt, *reserve) + partial;
    }
}

static int32_t blocks_needed(const eng_engine *e, const request *q, int32_t max_new)
{
    int32_t reserve, hold;
    plan_blocks(e, q, max_new, &reserve, &hold);
    return eng_kv_blocks_for(e->kv, reserve) + hold;
}

/* fill_context with several choices: the largest max_new (<= *max_new)
 * whose blocks for every choice fit the whole cache (what they need grows
 * with max_new: a bisection). */
static void fit_choices_to_cache(const eng_engine *e, const request *q, int32_t *max_new)
{
    int32_t total = eng_kv_total_blocks(e->kv), lo = 1, hi = *max_new;
    if (q->n_choices == 1 || blocks_needed(e, q, hi) <= total || blocks_needed(e, q, lo) > total)
        return; /* fits, or not even one token does: refused below */
    while (hi - lo > 1) {
        int32_t mid = lo + (hi - lo) / 2;
        if (blocks_needed(e, q, mid) <= total)
            lo = mid;
        else
            hi = mid;
    }
    *max_new = lo;
}

/* The prompt's length against the context and the cache, for all choices;
 * sets max_new (fill_context), reserve and hold. */
static int fit_prompt(const eng_engine *e, request *q, const eng_request *r, char *msg,
                      size_t msg_len)
{
    size_t n = (size_t)q->n_prompt;
    int rc = check_length(e, n, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int32_t max_new = r->max_new_tokens;
    if (r->fill_context && max_new > 0) {
        rc = fit_to_context(e, n, &max_new, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        fit_choices_to_cache(e, q, &max_new);
    }
    if (e->o.max_context > 0 && (int64_t)n + max_new > e->o.max_context)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the prompt's %zu tokens plus max new tokens %d exceed the context length "
                       "of %d tokens",
                       n, max_new, e->o.max_context);
    q->req.max_new_tokens = max_new;
    plan_blocks(e, q, max_new, &q->reserve, &q->hold);
    /* longrope: one factor set for all its positions, by how far it may go */
    q->rope_long = eng_rope_long_for(&e->m->cfg, q->reserve);
    int32_t need = eng_kv_blocks_for(e->kv, q->reserve) + q->hold;
    if (need > eng_kv_total_blocks(e->kv))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%zu prompt tokens + max_new_tokens %d (%d choices) need %d KV blocks; the "
                       "cache has %d (lower max_new_tokens or give the KV cache more bytes)",
                       n, max_new, q->n_choices, need, eng_kv_total_blocks(e->kv));
    return QL_OK;
}

/* Each choice's sampler (seeded seed + choice), stop filter and stream. */
static int make_choices(const eng_engine *e, request *q, const eng_request *r, char *msg,
                        size_t msg_len)
{
    q->choices = calloc((size_t)q->n_choices, sizeof *q->choices);
    if (!q->choices)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (int32_t i = 0; i < q->n_choices; i++) {
        seq *s = &q->choices[i];
        s->r = q;
        s->choice = i;
        eng_sampling p = r->sampling;
        p.seed += (uint64_t)i;
        if (eng_sampler_init(&s->sampler, &p, q->prompt, (size_t)q->n_prompt) != QL_OK)
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        eng_sampler_set_eos(&s->sampler, e->ends, e->n_ends);
        int rc = r->grammar ? eng_sampler_constrain(&s->sampler, r->grammar, e->grammar_vocab, msg,
                                                    msg_len)
                            : QL_OK;
        if (rc != QL_OK)
            return rc;
        /* one copy of the stop strings, shared by every choice */
        rc = i == 0 ? eng_stop_new(&s->stop, r->stop, r->n_stop, msg, msg_len)
                    : eng_stop_fork(q->choices[0].stop, &s->stop, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        eng_stop_hold(s->stop, r->sampling.min_tokens > 0);
        eng_stop_include(s->stop, r->include_stop_str);
    }
    if (r->prompt_logprobs) {
        size_t n = (size_t)q->n_prompt, k = (size_t)r->top_logprobs;
        q->prompt_lp = malloc(n * sizeof *q->prompt_lp);
        q->prompt_top = k ? malloc(n * k * sizeof *q->prompt_top) : NULL;
        if (!q->prompt_lp || (k && !q->prompt_top))
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the prompt's logprobs");
        q->prompt_lp[0] = NAN; /* nothing comes before the first */
        for (size_t j = 0; j < k; j++)
            q->prompt_top[j] = (eng_logprob){-1, NAN};
    }
    return QL_OK;
}

/* The checked request, with everything it needs copied (*out: NULL on error). */
static int request_new(const eng_engine *e, const eng_request *r, request **out, char *msg,
                       size_t msg_len)
{
    *out = NULL;
    int rc = check_fields(e, r, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    request *q = calloc(1, sizeof *q);
    if (!q)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    q->req = *r;
    q->n_choices = r->n_choices > 1 ? r->n_choices : 1;
    eng_spec_request_bounds(&r->spec, e->drafter.o.draft_max, &q->draft_max, &q->draft_min);
    if (r->n_adapters) {
        q->want = malloc(r->n_adapters * sizeof *q->want);
        if (!q->want) {
            request_free(q);
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        }
        for (size_t i = 0; i < r->n_adapters; i++) {
            q->want[i] = r->adapters[i];
            eng_lora_ref(q->want[i].lora);
        }
        q->n_want = r->n_adapters;
    }
    size_t n = 0;
    rc = prompt_ids(e, r, &q->prompt, &n, msg, msg_len);
    q->n_prompt = (int32_t)n;
    if (rc == QL_OK)
        rc = fit_prompt(e, q, r, msg, msg_len);
    if (rc == QL_OK)
        rc = make_choices(e, q, r, msg, msg_len);
    if (rc != QL_OK) {
        request_free(q);
        return rc;
    }
    q->req.n_choices = q->n_choices;
    q->req.prompt = NULL; /* not kept */
    q->req.prompt_tokens = NULL;
    q->req.stop = NULL;
    q->req.adapters = NULL;
    q->req.grammar = NULL;             /* the samplers' matchers hold it */
    q->req.sampling.logit_bias = NULL; /* the samplers hold their copies */
    q->req.sampling.n_logit_bias = 0;
    *out = q;
    return QL_OK;
}

int eng_engine_build(const eng_engine *e, const eng_request *r, eng_built **out, char *msg,
                     size_t msg_len)
{
    return request_new(e, r, out, msg, msg_len);
}

void eng_built_free(eng_built *b)
{
    if (b)
        request_free(b);
}

size_t eng_built_prompt_tokens(const eng_built *b)
{
    return (size_t)b->n_prompt;
}

/* Whether the queue has room (called with e->mu held): QL_OK, or QL_EBUSY
 * with the reason. */
static int queue_room(const eng_engine *e, char *msg, size_t msg_len)
{
    if (e->stopping)
        return ql_fail(msg, msg_len, QL_EBUSY, "the engine is stopping");
    if (e->queued >= e->o.max_queued)
        return ql_fail(msg, msg_len, QL_EBUSY,
                       "the queue is full (%d requests waiting); try again later", e->queued);
    return QL_OK;
}

int eng_engine_submit(eng_engine *e, const eng_request *r, uint64_t *id, char *msg, size_t msg_len)
{
    /* a full queue refuses before anything is built for the request */
    pthread_mutex_lock(&e->mu);
    int rc = queue_room(e, msg, msg_len);
    pthread_mutex_unlock(&e->mu);
    if (rc != QL_OK)
        return rc;
    request *q;
    rc = request_new(e, r, &q, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    return eng_engine_queue(e, q, id, msg, msg_len);
}

int eng_engine_queue(eng_engine *e, eng_built *q, uint64_t *id, char *msg, size_t msg_len)
{
    q->t_submit = ql_now_s(); /* its wait in the queue begins */
    pthread_mutex_lock(&e->mu);
    int rc = queue_room(e, msg, msg_len);
    if (rc != QL_OK) {
        pthread_mutex_unlock(&e->mu);
        request_free(q);
        return rc;
    }
    q->id = ++e->next_id;
    if (id)
        *id = q->id;
    if (e->inbox_tail)
        e->inbox_tail->next = q;
    else
        e->inbox = q;
    e->inbox_tail = q;
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

/* --- the engine thread: admitting --------------------------------------------------- */

static bool is_cancelled(const uint64_t *ids, size_t n, uint64_t id)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id)
            return true;
    return false;
}

/* Cancel what the cancel list names (every choice of it), in the waiting
 * list and the running set. */
static void apply_cancels(eng_engine *e, const uint64_t *ids, size_t n, bool all)
{
    request **pp = &e->waiting;
    e->waiting_tail = NULL;
    while (*pp) {
        request *r = *pp;
        if (all || is_cancelled(ids, n, r->id)) {
            *pp = r->next;
            pthread_mutex_lock(&e->mu);
            e->queued--;
            pthread_mutex_unlock(&e->mu);
            end_unbegun(e, r, ENG_FINISH_CANCELLED);
        } else {
            e->waiting_tail = r;
            pp = &r->next;
        }
    }
    for (int32_t i = 0; i < e->n_running;) {
        seq *s = e->running[i];
        if (all || is_cancelled(ids, n, s->r->id))
            end_seq(e, s, ENG_FINISH_CANCELLED); /* the last running one takes its place */
        else
            i++;
    }
}

/* The prefix cache's key of what computes a sequence's KV on version w
 * with the adapters want applied on top: a version with nothing merged
 * serves the pristine weights whatever its number; an adapter is named by
 * its uid and its scale's bits, in order (the order of the sums); and
 * longrope's factor set, which rotated its keys. */
static uint64_t prefix_key(const eng_weights *w, const eng_lora_term *want, size_t n_want,
                           bool rope_long)
{
    uint64_t h = (w->n_merged ? w->version + 1 : 0) * 2 + rope_long;
    h = h * 0x9e3779b97f4a7c15ULL + n_want;
    for (size_t i = 0; i < n_want; i++) {
        uint32_t bits;
        memcpy(&bits, &want[i].scale, sizeof bits);
        h = (h ^ eng_lora_uid(want[i].lora)) * 0xff51afd7ed558ccdULL;
        h = (h ^ bits) * 0xc4ceb9fe1a85ec53ULL;
        h ^= h >> 29;
    }
    return h;
}

/* Whether r can be admitted now: slots for all its choices, and KV blocks
 * for choice 0 and what it holds for the others (taken then). Choice 0
 * first takes what the prefix cache holds of its prompt (never the last
 * token: its logits begin the answer; never for prompt_logprobs, which
 * need every position's), so fewer blocks are needed. r->prefix_key is
 * set. */
static bool take_room(eng_engine *e, request *r)
{
    if (e->slots + r->n_choices > e->o.max_running)
        return false;
    seq *s = &r->choices[0];
    int32_t cached = 0;
    if (!r->req.prompt_logprobs)
        cached = eng_kv_prefix_match(e->kv, r->prefix_key, r->prompt, r->n_prompt - 1, &s->kv,
                                     &r->chain);
    if (eng_kv_blocks_for(e->kv, r->reserve) - s->kv.n_blocks + r->hold >
            eng_kv_free_blocks(e->kv) ||
        eng_kv_reserve(e->kv, &s->kv, r->reserve) != QL_OK ||
        (r->hold && eng_kv_hold(e->kv, &s->kv, r->hold) != QL_OK)) {
        eng_kv_release(e->kv, &s->kv); /* the cached blocks go back as they were */
        r->chain = (eng_prefix_chain){0};
        return false;
    }
    r->n_prefilled = r->n_cached = cached;
    e->tally.prompt += (uint64_t)cached;
    e->tally.prefix_queried += (uint64_t)r->n_prompt;
    e->tally.prefix_hit += (uint64_t)cached;
    return true;
}

/* Whether r should wait for a request now prefilling the same whole
 * blocks of prompt under the same key: they will be in the prefix cache
 * when that prefill reaches them, so r computes none of them again (eight
 * requests with one long system prompt, arriving together, compute it
 * once rather than eight times). */
static bool prefix_in_flight(const eng_engine *e, const request *r)
{
    if (e->o.no_prefix_cache || r->req.prompt_logprobs)
        return false;
    int32_t bt = eng_kv_block_tokens(e->kv);
    for (int32_t i = 0; i < e->n_running; i++) {
        const request *q = e->running[i]->r;
        if (q->begun || q->prefix_key != r->prefix_key)
            continue;
        int32_t n = q->n_prompt < r->n_prompt - 1 ? q->n_prompt : r->n_prompt - 1, same = 0;
        while (same < n && q->prompt[same] == r->prompt[same])
            same++;
        if (same / bt * bt > q->n_prefilled)
            return true; /* whole blocks of r that q has yet to compute */
    }
    return false;
}

/* Admit waiting requests in order while their slots and blocks are free. */
static void admit(eng_engine *e)
{
    int32_t vocab = e->m->cfg.vocab_size;
    while (e->waiting) {
        request *r = e->waiting;
        /* what computes its KV now: the key of its prefix blocks */
        r->prefix_key = prefix_key(e->current, r->want, r->n_want, r->rope_long);
        if (prefix_in_flight(e, r) || !take_room(e, r))
            return; /* the head waits; order is kept */
        e->waiting = r->next;
        if (!e->waiting)
            e->waiting_tail = NULL;
        r->next = NULL;
        r->t_admit = ql_now_s();
        r->admitted = true;
        e->slots += r->n_choices;
        pthread_mutex_lock(&e->mu);
        e->queued--;
        pthread_mutex_unlock(&e->mu);
        if (r->req.prompt_logprobs && !e->prompt_rows)
            e->prompt_rows = malloc((size_t)e->o.prefill_chunk * (size_t)vocab * sizeof(float));
        /* the serving version, and what to apply on top of it */
        r->weights = e->current;
        eng_weights_ref(r->weights);
        if ((r->req.prompt_logprobs && !e->prompt_rows) ||
            eng_lora_difference(r->want, r->n_want, r->weights->merged, r->weights->n_merged,
                                &r->delta, &r->n_delta) != QL_OK) {
            end_unbegun(e, r, ENG_FINISH_ERROR);
            continue;
        }
        int64_t now_s = (int64_t)time(NULL);
        for (size_t i = 0; i < r->n_want; i++) {
            __atomic_add_fetch(&r->want[i].lora->requests, 1, __ATOMIC_RELAXED);
            __atomic_store_n(&r->want[i].lora->last_used, now_s, __ATOMIC_RELAXED);
        }
        if (r->n_delta) {
            pthread_mutex_lock(&e->mu);
            e->stats.adapter_requests++;
            pthread_mutex_unlock(&e->mu);
        }
        e->running[e->n_running++] = &r->choices[0];
    }
}

/* --- the engine thread: tokens ------------------------------------------------------ */

/* A sampled token: stream its text, decide whether s ends. Returns true
 * when s has ended (its request perhaps freed). */
static bool take_token(eng_engine *e, seq *s, int32_t token, const token_lp *lp)
{
    const eng_config *c = &e->m->cfg;
    request *r = s->r;
    s->n_generated++;
    e->tally.generated++;
    if (r->t_first == 0)
        r->t_first = ql_now_s();
    if (lp)
        s->logprob_sum += (double)lp->logprob;
    /* min_tokens keeps EOS from being chosen (the sampler); should it come
     * all the same (every logit -inf), it does not end the answer early,
     * and with ignore_eos it never does: it is then a token like another */
    bool ends = false;
    for (int32_t i = 0; i < e->n_ends; i++)
        ends |= token == e->ends[i];
    if (ends && !r->req.sampling.ignore_eos && eng_sampler_may_end(&s->sampler)) {
        s->n_generated--; /* the end marker is not part of the answer */
        end_choice(e, s, ENG_FINISH_EOS);
        return true;
    }
    /* stop strings end the answer only once more than min_tokens tokens are
     * out (vLLM v1's detokenizer, tests/detokenizer/test_min_tokens.py) */
    eng_stop_hold(s->stop, s->n_generated <= r->req.sampling.min_tokens);
    const char *text = ""; /* a skipped special token's */
    size_t len = 0;
    bool stopped = false;
    if (!r->req.skip_special_tokens || !tok_is_special(e->m->tok, token)) {
        char piece[1024];
        long n = tok_stream_push(e->m->tok, &s->stream, token, piece, sizeof piece);
        stopped = eng_stop_feed(s->stop, piece, n > 0 ? (size_t)n : 0, &text, &len);
    }
    emit(s, token, text, len, lp);
    if (stopped) {
        end_choice(e, s, ENG_FINISH_STOP);
        return true;
    }
    if (eng_sampler_grammar_done(&s->sampler)) { /* whole, and nothing may follow */
        end_choice(e, s, ENG_FINISH_EOS);
        return true;
    }
    if (s->n_generated >= r->req.max_new_tokens ||
        r->n_prompt + s->n_generated >= c->max_position_embeddings) {
        end_choice(e, s, ENG_FINISH_LENGTH);
        return true;
    }
    s->next_token = token;
    record_fed(s, token);
    return false;
}

/* Give grammar g of r's choice what r's masks may still take this step
 * (r's whole budget again at its first draw of a step); false when
 * another choice's grammar has failed: r ends. */
static bool grammar_budget_give(const eng_engine *e, request *r, gr_matcher *g)
{
    if (r->grammar_failed)
        return false;
    uint64_t step = e->stats.steps + 1; /* written by this thread alone; never 0 */
    if (r->grammar_step != step) {
        r->grammar_step = step;
        r->grammar_left = e->grammar_budget;
    }
    gr_matcher_set_budget(g, &r->grammar_left);
    return true;
}

/* Sample s's token from logits (changed in place) and take it; lp, when not
 * NULL, holds the figures of the raw row logits was copied from. Returns
 * true when s has ended (its request perhaps freed). */
static bool sample_take(eng_engine *e, seq *s, float *logits, const row_lp *lp)
{
    request *r = s->r;
    gr_matcher *g = s->sampler.grammar;
    if (g && !grammar_budget_give(e, r, g)) {
        end_choice(e, s, ENG_FINISH_GRAMMAR);
        return true;
    }
    uint64_t steps = g ? gr_matcher_steps(g) : 0;
    int32_t token = eng_sample(&s->sampler, logits, e->m->cfg.vocab_size, e->scratch);
    if (g) {
        e->tally.grammar_masks++;
        e->tally.grammar_ns += s->sampler.grammar_ns;
        e->tally.grammar_steps += gr_matcher_steps(g) - steps;
        gr_matcher_set_budget(g, NULL);
    }
    if (token < 0) {
        /* its grammar stopped (past its budget or the matcher's bounds:
         * the client's grammar), ran out of memory, or allowed no token */
        char why[256];
        int stopped = g ? gr_matcher_error(g, why, sizeof why) : QL_OK;
        fprintf(stderr, "qlserve: request %llu: %s\n", (unsigned long long)r->id,
                stopped != QL_OK ? why : "the grammar allows no next token");
        end_choice(e, s, stopped == QL_EINVAL ? ENG_FINISH_GRAMMAR : ENG_FINISH_ERROR);
        return true;
    }
    token_lp t = {0};
    if (lp)
        t = (token_lp){.logprob = (float)((double)lp->raw[token] - lp->lse),
                       .top = lp->n_top ? lp->top : NULL,
                       .n_top = lp->n_top};
    return take_token(e, s, token, lp ? &t : NULL);
}

/* Sample s's token from a logits row (changed in place) and take it, its
 * logprobs from the raw row when asked; true when s has ended. */
static bool sample_row(eng_engine *e, seq *s, float *row)
{
    if (!s->r->req.logprobs)
        return sample_take(e, s, row, NULL);
    int32_t vocab = e->m->cfg.vocab_size;
    row_lp lp; /* the row came back whole (greedy and draw were off): its figures first */
    memcpy(e->raw_row, row, (size_t)vocab * sizeof *row);
    row_lp_compute(&lp, e->raw_row, vocab, s->r->req.top_logprobs);
    return sample_take(e, s, row, &lp);
}

/* s's token from step row k: the backend's choice, or sampled here. */
static void next_token(eng_engine *e, seq *s, int32_t k)
{
    int32_t vocab = e->m->cfg.vocab_size;
    int32_t token = e->tokens[k];
    float *row = e->logits + (size_t)k * (size_t)vocab;
    if (token >= 0 || e->step[k].draw) { /* a draw's uniform is taken: never again */
        eng_sampler_record(&s->sampler, token = token >= 0 ? token : 0);
        take_token(e, s, token, NULL);
    } else {
        sample_row(e, s, row);
    }
}

/* --- the engine thread: speculative decoding --------------------------------------------
 *
 * A sequence that drafts carries its next token and the k drafted tokens
 * as one row run of k + 1 tokens in the step, every row's logits returned
 * (eng_step_seq.all_logits): row j is what the model says follows the
 * next token and drafts 1..j. Verification samples row 0 exactly as a step
 * without speculation would (the same sampler: its seeded stream,
 * penalties, logit_bias, min_tokens, grammar mask; logprobs of the raw
 * row), takes the token (stop strings, EOS, max_new_tokens end it as
 * always), and goes on to row j + 1 only while the token sampled from row
 * j is draft j + 1: row j + 1 was then computed after the very tokens the
 * answer now holds, so it is the row the next step would have computed.
 * The first token that differs (or the last row's, which nothing drafted
 * past) ends the verification; rows after it are dropped unread.
 *
 * So every token comes from the model's own row, sampled with the stream
 * it would have used: a greedy answer is the tokens it is without
 * speculation, and a sampled one follows the model's distribution (for a
 * drafter that proposes one token, this is the standard accept/resample
 * rule: draft d is kept with probability p(d), else the token is drawn from
 * p without d, renormalised; with the same seed it is even the same
 * tokens, as long as the step's rows are the bits a one-token step gives,
 * which the walk keeps). A drafted token the grammar refuses can never be
 * sampled, so the draft is cut there; the first drafted token is checked
 * against the mask before the step, sparing its rows.
 *
 * KV: the step wrote positions for all k drafts; those past the accepted
 * ones are rolled back (eng_kv_rollback), so the next step writes over
 * them in the same blocks, and the prefix cache never keeps them.
 */

/* Whether the cost rule cuts e's drafts once they are made, by their
 * class (the n-gram lookup: its drafts cost nothing and say which suffix
 * they followed), rather than bounding the drafter beforehand (a model
 * drafter pays for every position it drafts). */
static bool cut_after(const eng_engine *e)
{
    return !e->drafter.o.draft_fixed && e->drafter.o.drafter == ENG_SPEC_NGRAM;
}

/* How many tokens s may draft this step, at most room: what its draft
 * length, its answer's room (the token the verification adds included) and
 * its KV reservation allow (the length --draft-fixed's draft_max, the
 * request's own where the rule cuts after drafting, else the cost rule's);
 * 0 when it does not draft. */
static int32_t draft_want(const eng_engine *e, seq *s, const eng_spec_cost *cost, int32_t room)
{
    request *r = s->r;
    if (r->draft_max == 0)
        return 0; /* the request asked for none: not even the probe */
    int32_t pos = r->n_prompt + s->n_generated - 1;
    /* the request's least length where the rule keeps some (a shorter draft would not be
     * verified); draft_max is never under it */
    int32_t want = e->drafter.o.draft_fixed || cut_after(e)
                       ? r->draft_max
                       : eng_spec_len_keep(&s->spec[0], cost, r->draft_max, r->draft_min);
    int32_t answer_left = r->req.max_new_tokens - s->n_generated - 1;
    int32_t kv_left = r->reserve - pos - 1;
    want = want < room ? want : room;
    want = want < answer_left ? want : answer_left;
    want = want < kv_left ? want : kv_left;
    /* the history is the prompt and the tokens fed (a failed record leaves it short) */
    return s->n_fed == s->n_generated && want > 0 && want >= r->draft_min ? want : 0;
}

/* Every begun sequence's draft for this step (n_decode decode tokens in
 * it), all sequences' at once (a draft model steps once per drafted
 * position for all of them): each drafts into s->row after its next token,
 * in the room no decode token needs; a first drafted token the grammar
 * refuses cuts its draft. */
static void plan_drafts(eng_engine *e, int32_t n_decode)
{
    int32_t n = 0, room = e->o.step_tokens - n_decode;
    /* what a row costs against the step's fixed part, from the steps measured */
    eng_spec_cost cost = {.n_decode = n_decode, .draft_s = e->drafter.position_s};
    eng_step_cost_fit(&e->cost, &cost.fixed_s, &cost.token_s);
    for (int32_t i = 0; i < e->n_running; i++) {
        seq *s = e->running[i];
        request *r = s->r;
        s->n_draft = 0;
        int32_t want = r->begun ? draft_want(e, s, &cost, room) : 0;
        if (want == 0)
            continue;
        e->draft_jobs[n] = (eng_draft_job){.h = {r->prompt, r->n_prompt, s->fed, s->n_fed},
                                           .max = want,
                                           .reserve = r->reserve,
                                           .kv = &s->draft_kv,
                                           .rows = &s->draft_rows,
                                           .out = s->row + 1};
        e->draft_seqs[n++] = s;
        room -= want;
    }
    if (n > 0)
        e->drafter.ops->draft(&e->drafter, e->draft_jobs, n);
    for (int32_t i = 0; i < n; i++) {
        seq *s = e->draft_seqs[i];
        int32_t k = e->draft_jobs[i].n;
        s->draft_class = eng_spec_class(e->draft_jobs[i].match, e->draft_jobs[i].remembered);
        if (k > 0 && cut_after(e))
            k = eng_spec_len_keep(&s->spec[s->draft_class], &cost, k, s->r->draft_min);
        e->tally.spec.drafted += (uint64_t)k;
        /* shorter than the request's least, or its first token one the grammar refuses */
        if (k > 0 && (k < s->r->draft_min ||
                      (s->sampler.grammar && !gr_matcher_allows(s->sampler.grammar, s->row[1])))) {
            k = 0; /* never verified: a draft model forgets the drafts it fed */
            eng_drafter_rollback(&e->drafter, &s->draft_kv, &s->draft_rows,
                                 s->r->n_prompt + s->n_fed);
        }
        s->row[0] = s->next_token;
        s->n_draft = k;
    }
}

/* Verify s's drafted tokens from its step row run q (see above); its KV
 * past the accepted ones is rolled back and its draft length adapted. */
static void verify_draft(eng_engine *e, seq *s, const eng_step_seq *q)
{
    int32_t vocab = e->m->cfg.vocab_size, k = s->n_draft, j = 0;
    eng_spec_stats *t = &e->tally.spec;
    eng_spec_usage *u = &s->r->spec; /* counted as they go: the last token may end and free r */
    bool remembered = s->draft_class >= ENG_SPEC_MEMORY_CLASS;
    s->n_draft = 0;
    t->drafts++;
    t->verified += (uint64_t)k;
    u->drafted += k;
    bool ended = false;
    for (;; j++) {
        /* each row stands for a step of its own: a grammar's mask gets a step's budget for it,
         * so a drafted token never ends an answer the plain step would have let go on */
        if (j > 0)
            s->r->grammar_step = 0;
        ended = sample_row(e, s, q->all_logits + (size_t)j * (size_t)vocab);
        if (ended || j == k || s->next_token != s->row[j + 1])
            break; /* s may be freed once ended: nothing of it is read after */
        t->accepted_pos[j]++;
        u->accepted++;
    }
    t->accepted += (uint64_t)j;
    t->accepted_len[j]++;
    if (remembered) {
        t->memory_verified += (uint64_t)k;
        t->memory_accepted += (uint64_t)j;
    }
    if (ended)
        return; /* its blocks went back; the prefix cache kept only the answer's fed tokens */
    char msg[160];
    /* the draft model keeps what it saw of the accepted tokens; the next draft feeds the rest */
    eng_drafter_rollback(&e->drafter, &s->draft_kv, &s->draft_rows, q->pos + 1 + j);
    if (eng_kv_rollback(e->kv, &s->kv, q->pos + 1 + j, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "qlserve: request %llu: %s\n", (unsigned long long)s->r->id, msg);
        end_choice(e, s, ENG_FINISH_ERROR);
        return;
    }
    eng_spec_len_adapt(&s->spec[s->draft_class], k, j);
    eng_spec_len_adapt(&e->spec_seen[s->draft_class], k, j);
}

/* Whether the step's decoding sequences (n_decode of them) speculate:
 * speculation is on, and the batch is small enough that a step is still
 * bound by reading the weights (extra rows then cost little). */
static bool speculating(const eng_engine *e, int32_t n_decode)
{
    return e->spec_rows && n_decode <= e->drafter.o.max_batch;
}

/* r's prefill is done (its last chunk was step row k): report the prompt,
 * fork choices 1..n-1 from choice 0, and give each choice its first token
 * from that one row, in choice order. */
static void begin_choices(eng_engine *e, request *r, int32_t k)
{
    int32_t vocab = e->m->cfg.vocab_size, n = r->n_choices;
    seq *c = r->choices;
    r->begun = true;
    r->n_live = n;
    for (int32_t i = 0; i < n; i++)
        for (int32_t a = 0; a < ENG_SPEC_CLASSES; a++)
            c[i].spec[a] = eng_spec_len_prior(&e->spec_seen[a]);
    if (r->req.on_prompt) {
        bool scored = r->req.prompt_logprobs;
        eng_prompt_info p = {.tokens = r->prompt,
                             .n = r->n_prompt,
                             .logprobs = scored ? r->prompt_lp : NULL,
                             .top = scored && r->req.top_logprobs ? r->prompt_top : NULL,
                             .n_top = scored ? r->req.top_logprobs : 0};
        r->req.on_prompt(r->req.user, &p);
    }
    if (r->req.max_new_tokens == 0) { /* scored: nothing to generate */
        for (int32_t i = 0; i < n; i++)
            end_choice(e, &c[i], ENG_FINISH_LENGTH);
        return;
    }
    if (n == 1) {
        next_token(e, &c[0], k);
        return;
    }
    /* the row all choices draw from, kept before any sampler changes it */
    memcpy(e->raw_row, e->logits + (size_t)k * (size_t)vocab, (size_t)vocab * sizeof(float));
    row_lp lp;
    if (r->req.logprobs)
        row_lp_compute(&lp, e->raw_row, vocab, r->req.top_logprobs);
    bool forked[ENG_MAX_CHOICES] = {true};
    for (int32_t i = 1; i < n; i++) {
        forked[i] = eng_kv_fork(e->kv, &c[i].kv, &c[0].kv, r->reserve) == QL_OK;
        if (forked[i]) {
            eng_drafter_fork(&e->drafter, &c[i].draft_rows, &c[0].draft_rows, &c[0].draft_kv);
            e->tally.shared += (uint64_t)eng_kv_blocks_for(e->kv, c[0].kv.n_tokens);
            e->running[e->n_running++] = &c[i];
        } else { /* choice 0 holds too few blocks: a reservation bug */
            fprintf(stderr, "qlserve: request %llu: choice %d could not fork its prompt\n",
                    (unsigned long long)r->id, i);
            end_choice(e, &c[i], ENG_FINISH_ERROR);
        }
    }
    /* the last of them to end frees r: nothing of r is read after it */
    for (int32_t i = 0; i < n; i++) {
        if (!forked[i])
            continue;
        memcpy(e->work_row, e->raw_row, (size_t)vocab * sizeof(float));
        sample_take(e, &c[i], e->work_row, r->req.logprobs ? &lp : NULL);
    }
}

/* --- the engine thread: one step ---------------------------------------------------- */

/* Whether the model has linear-attention layers: a drafting sequence then keeps its recurrent
 * state after each row (eng_step_seq.row_states; the drafting ones lead the step, so step row n
 * takes slot n of the max_batch speculation_start made), which verify_draft's rollback needs. */
static bool hybrid(const eng_engine *e)
{
    return e->m->cfg.linear.n_layers > 0;
}

/* Where the MTP drafter takes the hidden states of s's n step rows at pos (NULL: nowhere): every
 * step of a sequence that may draft, so its MTP covers all it has seen. */
static float *mtp_rows(eng_engine *e, seq *s, int32_t pos, int32_t n)
{
    return s->r->draft_max > 0 ? eng_drafter_hidden_out(&e->drafter, &s->draft_rows, pos, n) : NULL;
}

/* The step's decode rows: every begun choice's next token, the drafting
 * ones first with their drafts, their rows' buffers end to end in
 * spec_rows (so the walk classifies all their rows in one pass). Returns
 * how many; *budget loses the tokens they take. */
static int32_t build_decodes(eng_engine *e, int32_t *budget)
{
    int32_t n = 0, n_decode = 0, drafted = 0;
    for (int32_t i = 0; i < e->n_running; i++) {
        n_decode += e->running[i]->r->begun;
        e->running[i]->n_draft = 0;
    }
    if (speculating(e, n_decode))
        plan_drafts(e, n_decode);
    float *rows = e->spec_rows;
    for (int pass = 0; pass < 2; pass++) {
        for (int32_t i = 0; i < e->n_running; i++) {
            seq *s = e->running[i];
            request *r = s->r;
            /* the drafting ones first, then the others */
            if (!r->begun || (pass == 0) != (s->n_draft > 0))
                continue;
            int32_t k = s->n_draft, pos = r->n_prompt + s->n_generated - 1;
            e->step[n] = (eng_step_seq){.kv = &s->kv,
                                        .tokens = k ? s->row : &s->next_token,
                                        .n_tokens = 1 + k,
                                        .pos = pos,
                                        .weights = r->weights,
                                        .delta = r->delta,
                                        .n_delta = (int32_t)r->n_delta,
                                        .rope_long = r->rope_long,
                                        .all_logits = k ? rows : NULL,
                                        .row_states = k && hybrid(e) ? n + 1 : 0,
                                        .hidden_out = mtp_rows(e, s, pos, 1 + k)};
            rows += k ? (size_t)(k + 1) * (size_t)e->m->cfg.vocab_size : 0;
            drafted += k;
            e->step_owner[n++] = s;
        }
    }
    *budget -= n + drafted;
    return n;
}

/* The MTP drafter takes in the hidden states of sequences that kept a prefill chunk's worth of them
 * without drafting (mid-prefill, or past --spec-max-batch: 512 KiB of a 1024-wide model at the
 * default 128), in an MTP step of about a target chunk's size, before this step hands out where
 * its own go. */
static void feed_mtp(eng_engine *e)
{
    int32_t n = 0;
    for (int32_t i = 0; e->draft_jobs && i < e->n_running; i++) {
        seq *s = e->running[i];
        request *r = s->r;
        if (s->draft_rows.n < e->o.prefill_chunk)
            continue;
        if (r->begun && s->n_fed != s->n_generated) { /* its history is short: it never drafts */
            eng_drafter_release(&e->drafter, &s->draft_kv, &s->draft_rows);
            continue;
        }
        eng_history h = {r->prompt, r->begun ? r->n_prompt : r->n_prefilled, s->fed, s->n_fed};
        e->draft_jobs[n++] = (eng_draft_job){
            .h = h, .max = 1, .reserve = r->reserve, .kv = &s->draft_kv, .rows = &s->draft_rows};
    }
    if (n > 0)
        eng_drafter_feed(&e->drafter, e->draft_jobs, n);
}

/* The step's batch: one decode token (and its drafts) for every begun
 * choice, then prompt chunks under the step budget (eng_prefill_budget; one
 * prompt_logprobs chunk at most: the rows buffer is one), first admitted
 * first. Returns its size. */
static int32_t build_step(eng_engine *e)
{
    feed_mtp(e);
    int32_t budget = e->o.step_tokens;
    int32_t n = build_decodes(e, &budget);
    /* decode tokens: the step budget bounds the prompt tokens beside them */
    bool budgeted = false;
    if (n > 0) {
        e->plan = eng_prefill_budget(&e->o, &e->cost, n, e->n_running, budget);
        budgeted = e->plan.tokens < budget;
        budget = e->plan.tokens;
    }
    e->held = false;
    bool rows_taken = false;
    for (int32_t i = 0; i < e->n_running; i++) {
        seq *s = e->running[i];
        request *r = s->r;
        if (r->begun || (r->req.prompt_logprobs && rows_taken))
            continue;
        int32_t want = r->n_prompt - r->n_prefilled;
        want = want < e->o.prefill_chunk ? want : e->o.prefill_chunk;
        int32_t chunk = want < budget ? want : budget;
        e->held |= budgeted && chunk < want; /* the rest waits for a later step */
        if (chunk == 0)
            break;
        e->step[n] = (eng_step_seq){.kv = &s->kv,
                                    .tokens = r->prompt + r->n_prefilled,
                                    .n_tokens = chunk,
                                    .pos = r->n_prefilled,
                                    .weights = r->weights,
                                    .delta = r->delta,
                                    .n_delta = (int32_t)r->n_delta,
                                    .rope_long = r->rope_long,
                                    .all_logits = r->req.prompt_logprobs ? e->prompt_rows : NULL,
                                    .hidden_out = mtp_rows(e, s, r->n_prefilled, chunk)};
        rows_taken |= r->req.prompt_logprobs;
        e->step_owner[n++] = s;
        budget -= chunk;
    }
    return n;
}

/* What the backend may choose where the logits are: greedy tokens, and
 * plain temperature draws of the sequences that take a token this step
 * (their uniform drawn here, as eng_sample would). Not for a row this side
 * needs whole: logprobs, and the first row of a request of several choices. */
static void set_choosing(eng_engine *e, int32_t n)
{
    bool draws = eng_backend_draws(e->backend);
    int32_t vocab = e->m->cfg.vocab_size;
    for (int32_t k = 0; k < n; k++) {
        seq *s = e->step_owner[k];
        request *r = s->r;
        eng_step_seq *q = &e->step[k];
        bool takes_token =
            r->req.max_new_tokens > 0 && (r->begun || r->n_prefilled + q->n_tokens >= r->n_prompt);
        /* a drafting sequence's rows come back whole (all_logits) */
        bool row = takes_token && (r->req.logprobs || (!r->begun && r->n_choices > 1) ||
                                   (r->begun && s->n_draft > 0));
        q->greedy = !row && eng_sampler_greedy(&s->sampler);
        q->draw = draws && takes_token && !row && !q->greedy &&
                  eng_sampler_plain_draw(&s->sampler, vocab, &q->inv_temperature);
        if (q->draw)
            q->u = eng_sampler_uniform(&s->sampler);
    }
}

/* Copy on write: each step sequence's write range made its own (a block
 * another choice still references is swapped for one it holds), the
 * copies made on the backend before the step. A sequence that cannot (it
 * holds no block for its copy: its reservation was wrong) ends alone. */
static int prepare_writes(eng_engine *e, int32_t *n, char *msg, size_t msg_len)
{
    int32_t n_copies = 0;
    for (int32_t k = 0; k < *n;) {
        eng_step_seq *q = &e->step[k];
        if (eng_kv_prepare_write(e->kv, q->kv, q->pos, q->n_tokens, e->copies, e->o.step_tokens,
                                 &n_copies) == QL_OK) {
            k++;
            continue;
        }
        fprintf(stderr, "qlserve: request %llu: no KV block to copy on write\n",
                (unsigned long long)e->step_owner[k]->r->id);
        end_seq(e, e->step_owner[k], ENG_FINISH_ERROR);
        (*n)--;
        memmove(e->step + k, e->step + k + 1, (size_t)(*n - k) * sizeof *e->step);
        memmove(e->step_owner + k, e->step_owner + k + 1, (size_t)(*n - k) * sizeof *e->step_owner);
    }
    if (n_copies == 0)
        return QL_OK;
    int rc = eng_backend_copy_blocks(e->backend, e->copies, n_copies, msg, msg_len);
    if (rc == QL_OK)
        e->tally.copied += (uint64_t)n_copies;
    return rc;
}

/* Step row k's sequence after the pass (rc: the pass's outcome). */
static void after_step(eng_engine *e, int32_t k, int rc)
{
    seq *s = e->step_owner[k];
    request *r = s->r;
    const eng_step_seq *q = &e->step[k];
    if (r->begun) {
        if (rc != QL_OK)
            end_choice(e, s, ENG_FINISH_ERROR);
        else if (s->n_draft > 0)
            verify_draft(e, s, q);
        else
            next_token(e, s, k);
        return;
    }
    r->n_prefilled += q->n_tokens;
    e->tally.prompt += (uint64_t)q->n_tokens;
    if (rc != QL_OK) {
        end_unbegun(e, r, ENG_FINISH_ERROR);
        return;
    }
    if (q->all_logits)
        score_prompt(e, r, q->pos, q->n_tokens, q->all_logits);
    eng_kv_prefix_insert(e->kv, r->prefix_key, r->prompt, r->n_prefilled, &s->kv, &r->chain);
    if (r->n_prefilled >= r->n_prompt)
        begin_choices(e, r, k);
}

/* End the choices of requests whose grammar failed in this step that drew
 * before it did (the rest ended at their draws). */
static void end_grammar_failures(eng_engine *e)
{
    for (int32_t i = 0; i < e->n_running;) {
        seq *s = e->running[i];
        if (s->r->grammar_failed)
            end_choice(e, s, ENG_FINISH_GRAMMAR); /* the last running one takes its place */
        else
            i++;
    }
}

/* Seconds: a decode step of a small model on a CPU is milliseconds; a
 * prefill chunk of a large one on a CPU, seconds. */
const double eng_step_bounds[ENG_STEP_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04,
                                                  0.08,  0.16,   0.32,  0.64, 1.28, 2.56};

/* One forward step over the running set; false when there was nothing to do. */
static bool run_step(eng_engine *e)
{
    int32_t n = build_step(e);
    if (n == 0)
        return false;
    double t0 = ql_now_s();
    set_choosing(e, n);
    char msg[256];
    int rc = prepare_writes(e, &n, msg, sizeof msg);
    if (rc == QL_OK && n > 0)
        rc = eng_backend_forward(e->backend, e->step, n, e->logits, e->tokens, msg, sizeof msg);
    if (rc != QL_OK) /* the step's sequences end with an error; say why once */
        fprintf(stderr, "qlserve: a step of %d sequences failed: %s\n", n, msg);
    for (int32_t k = 0; k < n; k++)
        after_step(e, k, rc);
    end_grammar_failures(e);
    /* the whole step as a sequence sees it: the pass, sampling, streaming */
    double took = ql_now_s() - t0;
    int32_t tokens = 0; /* a failed step's time says nothing of the next one's */
    for (int32_t k = 0; rc == QL_OK && k < n; k++)
        tokens += e->step[k].n_tokens;
    eng_step_cost_add(&e->cost, tokens, took);
    int b = 0;
    while (b < ENG_STEP_BUCKETS && took > eng_step_bounds[b])
        b++;
    uint64_t experts = 0, bytes = 0;
    if (rc == QL_OK && n > 0)
        eng_backend_moe_step(e->backend, &experts, &bytes);
    pthread_mutex_lock(&e->mu);
    e->stats.experts_run += experts;
    e->stats.expert_bytes += bytes;
    e->stats.step_counts[b]++;
    e->stats.step_seconds += took;
    e->stats.steps++;
    e->stats.prefill_budget = e->plan.tokens;
    e->stats.step_target_s = e->plan.target_s;
    eng_step_cost_fit(&e->cost, &e->stats.step_fixed_s, &e->stats.step_token_s);
    e->stats.prefill_held_steps += e->held;
    publish_tally(e);
    pthread_mutex_unlock(&e->mu);
    return true;
}

/* Add the names of r's adapters to list (cap bytes), each once. */
static void list_adapters(const request *r, char *list, size_t cap)
{
    for (size_t i = 0; i < r->n_want; i++) {
        const char *name = r->want[i].lora->name;
        size_t len = strlen(list), n = strlen(name);
        bool seen = false;
        for (const char *p = list; *p && !seen;) {
            size_t seg = strcspn(p, ",");
            seen = seg == n && memcmp(p, name, n) == 0;
            p += seg + (p[seg] == ',');
        }
        if (seen || (len >= 3 && strcmp(list + len - 3, "...") == 0))
            continue;
        if (len + 1 + n + 4 < cap) /* room for ",..." after it */
            snprintf(list + len, cap - len, "%s%s", len ? "," : "", name);
        else
            snprintf(list + len, cap - len, "%s...", len ? "," : "");
    }
}

/* Publish the step's stats: what runs, and on which versions. */
static void note_versions(eng_engine *e)
{
    char running[ENG_ADAPTER_LIST_MAX] = "", waiting[ENG_ADAPTER_LIST_MAX] = "";
    for (int32_t i = 0; i < e->n_running; i++)
        list_adapters(e->running[i]->r, running, sizeof running);
    for (const request *r = e->waiting; r; r = r->next)
        list_adapters(r, waiting, sizeof waiting);
    int32_t old = 0, versions = 1;
    for (int32_t i = 0; i < e->n_running; i++) {
        eng_weights *w = e->running[i]->r->weights;
        if (w == e->current)
            continue;
        old++;
        bool seen = false;
        for (int32_t j = 0; j < i && !seen; j++)
            seen = e->running[j]->r->weights == w;
        versions += !seen;
    }
    pthread_mutex_lock(&e->mu);
    for (const request *r = e->inbox; r; r = r->next)
        list_adapters(r, waiting, sizeof waiting);
    memcpy(e->stats.running_adapters, running, sizeof running);
    memcpy(e->stats.waiting_adapters, waiting, sizeof waiting);
    e->stats.running = e->n_running;
    e->stats.waiting = e->queued;
    e->stats.kv_blocks_used = eng_kv_total_blocks(e->kv) - eng_kv_free_blocks(e->kv);
    e->stats.states_used = eng_kv_total_states(e->kv) - eng_kv_free_states(e->kv);
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

/* Nothing has arrived for the engine thread to take in (e->mu held). */
static bool nothing_new(const eng_engine *e)
{
    return !e->inbox && e->n_cancels == 0 && !e->pending && !e->prepares;
}

/* Whether a step could run now: sequences to run and the gate open to it
 * (e->mu held; waiting and n_running are the engine thread's, which calls
 * this). */
static bool may_step(const eng_engine *e)
{
    return (e->waiting || e->n_running > 0) && e->gate != 0;
}

static void *engine_main(void *arg)
{
    eng_engine *e = arg;
    uint64_t *cancels = NULL;
    size_t cap = 0;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stopping && nothing_new(e) && !may_step(e)) {
            e->settled = true;
            pthread_cond_broadcast(&e->settled_cv);
            pthread_cond_wait(&e->wake, &e->mu);
        }
        e->settled = false;
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
        bool gated = e->gate == 0; /* the step gate holds this round's step */
        pthread_mutex_unlock(&e->mu);
        eng_weights_unref(retired); /* freed here if no sequence runs on it */
        if (prepares)
            run_prepares(e, prepares);

        apply_cancels(e, cancels, n_cancels, stopping);
        if (stopping)
            break;
        admit(e);
        if (!gated && run_step(e)) {
            pthread_mutex_lock(&e->mu);
            if (e->gate > 0)
                e->gate--;
            pthread_mutex_unlock(&e->mu);
        }
        note_versions(e);
    }
    free(cancels);
    return NULL;
}

/* --- start and stop ---------------------------------------------------------------- */

/* Why speculation, asked for, cannot run for this model on this backend (NULL: it can). Both
 * backends verify: the walk returns a drafting sequence's rows from the device as from the CPU
 * (every_row_logits), and a rollback is the host's block bookkeeping alone, which the CUDA
 * backend reads afresh every step (tests/gpu/test_cuda_speculative.c pins both under the
 * emulator). A hybrid model's recurrent state takes in every token a step feeds, drafts the
 * model rejects too: its rollback copies back the state kept after the last accepted row
 * (eng_kv_row_states_new), which the CPU backend keeps in host memory and the CUDA backend,
 * whose states live on the device, does not keep. */
static const char *speculation_off(const eng_engine *e)
{
    if (hybrid(e) && eng_backend_device(e->backend) != ENG_DEVICE_CPU)
        return "the model has linear-attention layers, whose recurrent state the CUDA backend "
               "cannot roll back past rejected drafts (the CPU backend can)";
    return NULL;
}

/* Set up the drafter o asks for: its rows, or off with the reason (logged, and in the stats
 * for /info) when the model cannot. */
static int speculation_start(eng_engine *e, char *msg, size_t msg_len)
{
    e->stats.spec.drafter = ENG_SPEC_OFF;
    if (!e->drafter.ops)
        return QL_OK;
    /* the draft model beside the target: refused by name where it cannot serve */
    eng_draft_sizes sz = {.threads = e->o.threads,
                          .max_tokens = e->o.step_tokens,
                          .max_seqs = e->o.max_running,
                          .block_tokens = e->o.block_tokens,
                          .target_kv_bytes = e->o.kv_bytes,
                          .kv_dtype = eng_kv_dtype(e->kv),
                          .device = eng_backend_device(e->backend)};
    int rc = eng_drafter_start(&e->drafter, e->m, &sz, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const char *off = speculation_off(e);
    if (off) {
        eng_drafter_free(&e->drafter); /* a draft model's backend and cache are not needed */
        snprintf(e->stats.spec.off_reason, sizeof e->stats.spec.off_reason, "%s", off);
        fprintf(stderr, "qlserve: speculative decoding off: %s\n", off);
        return QL_OK;
    }
    /* a hybrid model keeps a recurrent state per drafted row (below): n-gram's long default
     * draft would set aside 16 per drafting sequence, so it drafts the draft model's 4 unless
     * asked for more */
    if (hybrid(e) && e->o.spec.draft_max == 0)
        e->drafter.o.draft_max = 4;
    /* the drafting sequences' rows of one step: at most max_batch of them (and no more than
     * run), each with its draft, and never more rows than a step carries */
    const eng_spec_opts *o = &e->drafter.o;
    int64_t seqs = o->max_batch < e->o.max_running ? o->max_batch : e->o.max_running;
    int64_t rows = seqs * (o->draft_max + 1);
    rows = rows < e->o.step_tokens ? rows : e->o.step_tokens;
    size_t floats = (size_t)rows * (size_t)e->m->cfg.vocab_size;
    e->spec_rows = malloc(floats * sizeof *e->spec_rows);
    e->draft_jobs = calloc((size_t)e->o.max_running, sizeof *e->draft_jobs);
    e->draft_seqs = calloc((size_t)e->o.max_running, sizeof *e->draft_seqs);
    if (!e->spec_rows || !e->draft_jobs || !e->draft_seqs)
        return ql_fail(msg, msg_len, QL_ENOMEM,
                       "out of memory for speculative decoding's rows (%zu floats: lower "
                       "--spec-max-batch or --draft-max)",
                       floats);
    /* a hybrid model's recurrent state after each verified row but the last, per drafting
     * sequence: the rollback's source (the state takes in rejected drafts too) */
    size_t bytes = 0;
    rc = eng_kv_row_states_new(e->kv, (int32_t)seqs, o->draft_max, &bytes, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (bytes > 0)
        fprintf(stderr,
                "qlserve: speculative decoding keeps %lld x %d recurrent states of the drafting "
                "sequences (%.1f MiB: --spec-max-batch x --draft-max)\n",
                (long long)seqs, o->draft_max, (double)bytes / (1 << 20));
    e->stats.spec.drafter = o->drafter;
    return QL_OK;
}

static void engine_free(eng_engine *e)
{
    eng_backend_free(e->backend);
    free(e->logits);
    free(e->tokens);
    free(e->scratch);
    free(e->running);
    free(e->step);
    free(e->step_owner);
    free(e->copies);
    free(e->raw_row);
    free(e->work_row);
    free(e->prompt_rows);
    free(e->spec_rows);
    free(e->draft_jobs);
    free(e->draft_seqs);
    eng_drafter_free(&e->drafter);
    free(e->cancels);
    gr_vocab_free(e->grammar_vocab);
    eng_weights_unref(e->current);
    eng_weights_unref(e->latest);
    eng_weights_unref(e->pending);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->versions_cv);
    pthread_cond_destroy(&e->prepared_cv);
    pthread_cond_destroy(&e->settled_cv);
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
    pthread_cond_init(&e->settled_cv, NULL);
    e->gate = -1;
    e->m = m;
    e->o = *o;
#define DEFAULT(field, value)                                                                      \
    if (e->o.field <= 0)                                                                           \
    e->o.field = (value)
    DEFAULT(kv_bytes, (size_t)QL_KV_MIB_DEFAULT << 20);
    DEFAULT(block_tokens, 16);
    DEFAULT(step_tokens, 256);
    DEFAULT(prefill_chunk, 128);
    DEFAULT(min_prefill_per_step, ENG_MIN_PREFILL_DEFAULT);
    DEFAULT(max_running, 64);
    DEFAULT(max_queued, 256);
    DEFAULT(max_new_tokens, 4096);
#undef DEFAULT
    /* every running sequence must fit its decode token into one step */
    if (e->o.step_tokens < e->o.max_running + 1)
        e->o.step_tokens = e->o.max_running + 1;
    e->eos = m->cfg.eos_token_id >= 0 ? m->cfg.eos_token_id : tok_eos(m->tok);
    e->n_ends = 0;
    if (e->eos >= 0)
        e->ends[e->n_ends++] = e->eos;
    for (int32_t i = 0; i < m->cfg.n_eog && i < ENG_MAX_EOG; i++)
        if (m->cfg.eog_token_ids[i] != e->eos && m->cfg.eog_token_ids[i] < m->cfg.vocab_size)
            e->ends[e->n_ends++] = m->cfg.eog_token_ids[i];
    int32_t vocab = m->cfg.vocab_size;
    int rc = eng_drafter_init(&e->drafter, &o->spec, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_weights_new(&e->current, m, 0, msg, msg_len);
    if (rc == QL_OK) {
        e->latest = e->current;
        eng_weights_ref(e->latest);
        eng_backend_opts bo = {.device = o->device,
                               .threads = o->threads,
                               .max_tokens = e->o.step_tokens,
                               .max_seqs = e->o.max_running,
                               .kv_bytes = e->o.kv_bytes,
                               .block_tokens = e->o.block_tokens,
                               .kv_dtype = e->o.kv_dtype};
        rc = eng_backend_new(&e->backend, m, &bo, msg, msg_len);
    }
    if (rc == QL_OK) {
        e->kv = eng_backend_kv(e->backend);
        /* a hybrid model's recurrent state is not kept at block boundaries,
         * so a cached prefix could not be resumed: the prefix cache (and
         * the next-turn cache, its tail) is off, said in the log and /info */
        e->stats.states_total = eng_kv_total_states(e->kv);
        if (eng_linear_prefix_off(&m->cfg.linear) || o->spec.drafter == ENG_SPEC_MTP)
            e->o.no_prefix_cache = true; /* MTP: a cached prefix gives its drafter no states */
        if (!e->o.no_prefix_cache)
            rc = eng_kv_prefix_enable(e->kv, msg, msg_len);
        e->logits = malloc((size_t)e->o.max_running * (size_t)vocab * sizeof(float));
        e->tokens = malloc((size_t)e->o.max_running * sizeof(int32_t));
        e->scratch = malloc((size_t)vocab * (sizeof(float) + sizeof(int32_t)));
        e->running = calloc((size_t)e->o.max_running, sizeof *e->running);
        e->step = calloc((size_t)e->o.max_running, sizeof *e->step);
        e->step_owner = calloc((size_t)e->o.max_running, sizeof *e->step_owner);
        e->copies = malloc((size_t)e->o.step_tokens * sizeof *e->copies);
        e->raw_row = malloc((size_t)vocab * sizeof(float));
        e->work_row = malloc((size_t)vocab * sizeof(float));
        if (!e->logits || !e->tokens || !e->scratch || !e->running || !e->step || !e->step_owner ||
            !e->copies || !e->raw_row || !e->work_row)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for %d sequences",
                         e->o.max_running);
    }
    if (rc == QL_OK)
        rc = gr_vocab_from_tokenizer(&e->grammar_vocab, m->tok, m->cfg.vocab_size, e->eos, msg,
                                     msg_len);
    if (rc == QL_OK)
        e->grammar_budget = gr_vocab_step_budget(e->grammar_vocab);
    if (rc == QL_OK)
        rc = speculation_start(e, msg, msg_len);
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
    request *r = e->inbox;
    while (r) {
        request *next = r->next;
        request_end(e, r, ENG_FINISH_CANCELLED);
        r = next;
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

/* timeout_s from now, on the clock pthread_cond_timedwait reads. */
static struct timespec deadline_after(double timeout_s)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double end = (double)until.tv_sec + 1e-9 * (double)until.tv_nsec + timeout_s;
    until.tv_sec = (time_t)end;
    until.tv_nsec = (long)((end - (double)until.tv_sec) * 1e9);
    return until;
}

bool eng_engine_wait_versions(eng_engine *e, double timeout_s)
{
    struct timespec until = deadline_after(timeout_s);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while ((e->old_running > 0 || e->pending) && rc == 0)
        rc = pthread_cond_timedwait(&e->versions_cv, &e->mu, &until);
    bool done = e->old_running == 0 && !e->pending;
    pthread_mutex_unlock(&e->mu);
    return done;
}

void eng_engine_gate(eng_engine *e, int64_t steps)
{
    pthread_mutex_lock(&e->mu);
    e->gate = steps < 0 ? -1 : steps;
    e->settled = false; /* until the engine thread has looked at the gate again */
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

bool eng_engine_settle(eng_engine *e, double timeout_s)
{
    struct timespec until = deadline_after(timeout_s);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while (!(e->settled && nothing_new(e)) && rc == 0)
        rc = pthread_cond_timedwait(&e->settled_cv, &e->mu, &until);
    bool settled = e->settled && nothing_new(e);
    pthread_mutex_unlock(&e->mu);
    return settled;
}

void eng_engine_stats_get(eng_engine *e, eng_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->gate_steps = e->gate;
    out->settled = e->settled && nothing_new(e);
    out->kv_blocks_total = eng_kv_total_blocks(e->kv);
    out->kv_block_tokens = eng_kv_block_tokens(e->kv);
    out->kv_dtype = eng_kv_dtype(e->kv);
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

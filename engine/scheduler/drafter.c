/*
 * drafter.c - speculative decoding's drafters (internal/drafter_internal.h)
 * and the parsing of its options (speculative.h): the n-gram lookup, each
 * sequence's draft length following its acceptance, and the bounds one
 * request may set on it.
 *
 * The n-gram lookup (prompt lookup decoding, Saxena 2023; llama.cpp's
 * ngram drafters) costs no model: an answer that copies from its prompt
 * (an edit, a summary with quotes, code with its context) repeats runs of
 * tokens it has seen, so the tokens that followed the last occurrence of
 * its current suffix are a good guess of what follows now. It owns no
 * state; the scheduler holds each sequence's history and length. The
 * draft model's drafter lives in draft_model.c, the MTP's in mtp_drafter.c.
 */
#include "drafter_internal.h"

#include <stdio.h>
#include <stdlib.h>

int eng_speculative_parse(const char *name, eng_speculative *out, char *msg, size_t msg_len)
{
    int v = ql_name_expect(&ql_speculative_names, "speculative", name, msg, msg_len);
    if (v < 0)
        return v;
    *out = (eng_speculative)v;
    return QL_OK;
}

int eng_spec_opts_resolve(eng_spec_opts *o, char *msg, size_t msg_len)
{
    if (o->drafter != ENG_SPEC_OFF && o->drafter != ENG_SPEC_NGRAM &&
        o->drafter != ENG_SPEC_DRAFT && o->drafter != ENG_SPEC_MTP)
        return ql_fail(msg, msg_len, QL_EINVAL, "speculative: unknown drafter %d", (int)o->drafter);
    if (o->drafter == ENG_SPEC_DRAFT && !o->draft_model)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "speculative draft needs a draft model (--draft-model PATH)");
    /* n-gram drafts cost no model, so the length is left to the cost rule
     * (eng_spec_len_want); a draft model and the MTP step once per drafted token */
    if (o->draft_max == 0)
        o->draft_max = o->drafter == ENG_SPEC_NGRAM ? ENG_SPEC_MAX_DRAFT : 4;
    if (o->ngram_min == 0)
        o->ngram_min = 1;
    if (o->ngram_max == 0)
        o->ngram_max = o->ngram_min > 3 ? o->ngram_min : 3;
    if (o->max_batch == 0)
        o->max_batch = 4;
    if (o->memory_tokens == 0)
        o->memory_tokens = ENG_SPEC_MEMORY_TOKENS;
    if (o->draft_max < 1 || o->draft_max > ENG_SPEC_MAX_DRAFT)
        return ql_fail(msg, msg_len, QL_EINVAL, "draft-max %d is not in [1, %d]", o->draft_max,
                       ENG_SPEC_MAX_DRAFT);
    if (o->ngram_min < 1 || o->ngram_max < o->ngram_min || o->ngram_max > 64)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "ngram-min %d and ngram-max %d: want 1 <= ngram-min <= ngram-max <= 64",
                       o->ngram_min, o->ngram_max);
    if (o->max_batch < 1)
        return ql_fail(msg, msg_len, QL_EINVAL, "spec-max-batch %d is not positive", o->max_batch);
    if (o->memory_tokens != -1 &&
        (o->memory_tokens < ENG_NGRAM_MEMORY_LEAST || o->memory_tokens > ENG_NGRAM_MEMORY_MOST))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "ngram-memory %d is not -1 (none) nor in [%d, %d] tokens", o->memory_tokens,
                       ENG_NGRAM_MEMORY_LEAST, ENG_NGRAM_MEMORY_MOST);
    return QL_OK;
}

int eng_spec_request_check(const eng_spec_request *r, char *msg, size_t msg_len)
{
    if (r->draft_max < 0 || r->draft_max > ENG_SPEC_MAX_DRAFT)
        return ql_fail(msg, msg_len, QL_EINVAL, "speculative draft_max %d is not in [0, %d]",
                       r->draft_max, ENG_SPEC_MAX_DRAFT);
    int32_t most = r->draft_max ? r->draft_max : ENG_SPEC_MAX_DRAFT;
    if (r->draft_min < 0 || r->draft_min > most)
        return ql_fail(msg, msg_len, QL_EINVAL, "speculative draft_min %d is not in [0, %d]",
                       r->draft_min, most);
    return QL_OK;
}

void eng_spec_request_bounds(const eng_spec_request *r, int32_t engine_max, int32_t *max,
                             int32_t *min)
{
    int32_t m = r->draft_max && r->draft_max < engine_max ? r->draft_max : engine_max;
    *max = r->off ? 0 : m;
    *min = r->draft_min < *max ? r->draft_min : *max;
}

/* --- the n-gram lookup ------------------------------------------------------------ */

/* Whether the n tokens at a equal those at b. */
static bool same_run(const eng_history *h, int32_t a, int32_t b, int32_t n)
{
    for (int32_t j = 0; j < n; j++)
        if (eng_history_at(h, a + j) != eng_history_at(h, b + j))
            return false;
    return true;
}

int32_t eng_ngram_draft(const eng_history *h, int32_t n_min, int32_t n_max, int32_t max,
                        int32_t *out, int32_t *matched)
{
    int32_t total = h->n_prompt + h->n_answer;
    *matched = 0;
    for (int32_t n = n_max; n >= n_min; n--) {
        int32_t suffix = total - n;
        if (suffix <= 0)
            continue;
        /* the latest occurrence first: the most recent context is the likeliest to repeat */
        for (int32_t at = suffix - 1; at >= 0; at--) {
            if (!same_run(h, at, suffix, n))
                continue;
            int32_t k = 0;
            for (int32_t i = at + n; i < total && k < max; i++)
                out[k++] = eng_history_at(h, i);
            *matched = n;
            return k;
        }
    }
    return 0;
}

/* The prompt and answer's lookup, and the memory's where it remembers a
 * longer run than the lookup matched (the longer context is the likelier
 * guess). */
static void ngram_draft(eng_drafter *d, eng_draft_job *jobs, int32_t n_jobs)
{
    for (int32_t i = 0; i < n_jobs; i++) {
        eng_draft_job *j = &jobs[i];
        j->n = eng_ngram_draft(&j->h, d->o.ngram_min, d->o.ngram_max, j->max, j->out, &j->match);
        j->remembered = false;
        if (!d->memory)
            continue;
        /* the memory writes out only when it has a draft, which then replaces the lookup's */
        int32_t matched;
        int32_t k = eng_ngram_memory_draft(d->memory, &j->h, j->n > 0 ? j->match : 0, j->max,
                                           j->out, &matched);
        if (k > 0) {
            j->n = k;
            j->match = matched;
            j->remembered = true;
        }
    }
}

void eng_drafter_remember(eng_drafter *d, const int32_t *fed, int32_t n)
{
    eng_ngram_memory_add(d->memory, fed, n);
}

static void model_draft(eng_drafter *d, eng_draft_job *jobs, int32_t n_jobs)
{
    int32_t steps = 0;
    double took = eng_draft_model_run(d->model, jobs, n_jobs, &steps);
    eng_drafter_timed(d, took, steps);
}

static void mtp_draft(eng_drafter *d, eng_draft_job *jobs, int32_t n_jobs)
{
    int32_t steps = 0;
    double took = eng_mtp_drafter_run(d->mtp, jobs, n_jobs, &steps);
    eng_drafter_timed(d, took, steps);
}

static const eng_drafter_ops ngram_ops = {.name = "ngram", .draft = ngram_draft};
static const eng_drafter_ops model_ops = {.name = "draft", .draft = model_draft};
static const eng_drafter_ops mtp_ops = {.name = "mtp", .draft = mtp_draft};

int eng_drafter_init(eng_drafter *d, const eng_spec_opts *o, char *msg, size_t msg_len)
{
    d->o = *o;
    d->ops = NULL;
    d->model = NULL;
    d->mtp = NULL;
    d->memory = NULL;
    int rc = eng_spec_opts_resolve(&d->o, msg, msg_len);
    if (rc == QL_OK && d->o.drafter == ENG_SPEC_NGRAM)
        d->ops = &ngram_ops;
    if (rc == QL_OK && d->o.drafter == ENG_SPEC_NGRAM && d->o.memory_tokens > 0)
        rc = eng_ngram_memory_new(&d->memory, d->o.memory_tokens, msg, msg_len);
    if (rc == QL_OK && d->o.drafter == ENG_SPEC_DRAFT)
        d->ops = &model_ops;
    if (rc == QL_OK && d->o.drafter == ENG_SPEC_MTP)
        d->ops = &mtp_ops;
    return rc;
}

int eng_drafter_start(eng_drafter *d, const eng_model *target, const eng_draft_sizes *sz, char *msg,
                      size_t msg_len)
{
    if (d->o.drafter == ENG_SPEC_DRAFT && !d->model)
        return eng_draft_model_new(&d->model, target, &d->o, sz, msg, msg_len);
    if (d->o.drafter == ENG_SPEC_MTP && !d->mtp)
        return eng_mtp_drafter_new(&d->mtp, target, &d->o, sz, msg, msg_len);
    return QL_OK;
}

void eng_drafter_free(eng_drafter *d)
{
    eng_draft_model_free(d->model);
    d->model = NULL;
    eng_mtp_drafter_free(d->mtp);
    d->mtp = NULL;
    eng_ngram_memory_free(d->memory);
    d->memory = NULL;
}

void eng_drafter_rollback(eng_drafter *d, eng_seq_kv *kv, eng_draft_rows *rows, int32_t n_tokens)
{
    if (d->model)
        eng_draft_model_rollback(d->model, kv, n_tokens);
    if (d->mtp)
        eng_mtp_drafter_rollback(d->mtp, kv, rows, n_tokens);
}

void eng_drafter_release(eng_drafter *d, eng_seq_kv *kv, eng_draft_rows *rows)
{
    eng_kv_cache *cache = eng_drafter_kv(d);
    if (cache)
        eng_kv_release(cache, kv);
    if (rows) {
        free(rows->rows);
        *rows = (eng_draft_rows){0};
    }
}

uint64_t eng_drafter_steps(const eng_drafter *d)
{
    return d->model ? eng_draft_model_steps(d->model) : d->mtp ? eng_mtp_drafter_steps(d->mtp) : 0;
}

eng_kv_cache *eng_drafter_kv(eng_drafter *d)
{
    return d->model ? eng_draft_model_kv(d->model) : d->mtp ? eng_mtp_drafter_kv(d->mtp) : NULL;
}

/* --- the draft length ------------------------------------------------------------- */

void eng_spec_len_init(eng_spec_len *l)
{
    double hits = ENG_SPEC_PRIOR_RATE * ENG_SPEC_PRIOR_TRIALS;
    *l = (eng_spec_len){.first_hits = hits,
                        .first_trials = ENG_SPEC_PRIOR_TRIALS,
                        .hits = hits,
                        .trials = ENG_SPEC_PRIOR_TRIALS};
}

/* hits of `trials` weighing at most ENG_SPEC_PRIOR_TRIALS, topped up to that
 * weight at the fresh start's rate */
static void prior_counts(double hits, double trials, double *out_hits, double *out_trials)
{
    double w = trials < ENG_SPEC_PRIOR_TRIALS ? trials : ENG_SPEC_PRIOR_TRIALS;
    double taken = trials > 0 ? hits * (w / trials) : 0.0;
    *out_hits = taken + ENG_SPEC_PRIOR_RATE * (ENG_SPEC_PRIOR_TRIALS - w);
    *out_trials = ENG_SPEC_PRIOR_TRIALS;
}

eng_spec_len eng_spec_len_prior(const eng_spec_len *seen)
{
    eng_spec_len l = {0};
    prior_counts(seen->first_hits, seen->first_trials, &l.first_hits, &l.first_trials);
    prior_counts(seen->hits, seen->trials, &l.hits, &l.trials);
    return l;
}

void eng_spec_len_rates(const eng_spec_len *l, double *first, double *next)
{
    *first = l->first_trials > 0 ? l->first_hits / l->first_trials : 0.0;
    *next = l->trials > 0 ? l->hits / l->trials : 0.0;
}

int32_t eng_spec_len_want(eng_spec_len *l, const eng_spec_cost *c, int32_t draft_max)
{
    double first, next, n = c->n_decode > 0 ? (double)c->n_decode : 1.0;
    eng_spec_len_rates(l, &first, &next);
    bool measured = c->fixed_s > 0 && c->token_s > 0;
    double fixed = measured ? c->fixed_s / c->token_s : ENG_SPEC_FIXED_ROWS;
    /* a drafted position's rows: its own in the step, and the drafter's time in rows */
    double drafter = measured && c->draft_s > 0 ? c->draft_s / c->token_s : 0.0;
    double per = 1.0 + drafter;
    /* tokens per row-cost of drafting j: position j adds first x next^(j-1) tokens */
    double gain = 0, p = first, best_value = n / (fixed + n);
    int32_t best = 0;
    for (int32_t j = 1; j <= draft_max; j++, p *= next) {
        gain += p;
        double value = (n + gain) / (fixed + n + per * (double)j);
        if (value > best_value) {
            best_value = value;
            best = j;
        }
    }
    if (best == 0 && first > 0.5 && drafter < 0.5 && draft_max > 0)
        best = 1;
    if (best > 0) {
        l->idle = 0;
        return best;
    }
    if (++l->idle >= ENG_SPEC_PROBE_STEPS) {
        l->idle = 0;
        return 1;
    }
    return 0;
}

int32_t eng_spec_len_keep(eng_spec_len *l, const eng_spec_cost *c, int32_t drafted, int32_t least)
{
    int32_t keep = eng_spec_len_want(l, c, drafted);
    if (keep > 0 && keep < least)
        keep = least < drafted ? least : drafted;
    return keep;
}

void eng_spec_len_adapt(eng_spec_len *l, int32_t drafted, int32_t accepted)
{
    if (drafted <= 0)
        return;
    /* the first position is always tried; a later one only when the one
     * before it was accepted, so past the first rejection none was */
    int32_t later_tried = accepted < drafted ? accepted : drafted - 1;
    int32_t later_hits = accepted > 0 ? accepted - 1 : 0;
    l->first_hits = l->first_hits * ENG_SPEC_DECAY + (accepted > 0);
    l->first_trials = l->first_trials * ENG_SPEC_DECAY + 1.0;
    l->hits = l->hits * ENG_SPEC_DECAY + (double)later_hits;
    l->trials = l->trials * ENG_SPEC_DECAY + (double)later_tried;
}

void eng_drafter_timed(eng_drafter *d, double took_s, int32_t steps)
{
    if (steps <= 0 || !(took_s >= 0))
        return;
    double per = took_s / (double)steps;
    /* the first measure stands alone; then each weighs a fifth */
    d->position_s = d->position_s > 0 ? d->position_s * 0.8 + per * 0.2 : per;
}

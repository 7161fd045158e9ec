/*
 * drafter.c - speculative decoding's drafters (internal/drafter_internal.h)
 * and the parsing of its options (speculative.h): the n-gram lookup, and
 * each sequence's draft length following its acceptance.
 *
 * The n-gram lookup (prompt lookup decoding, Saxena 2023; llama.cpp's
 * ngram drafters) costs no model: an answer that copies from its prompt
 * (an edit, a summary with quotes, code with its context) repeats runs of
 * tokens it has seen, so the tokens that followed the last occurrence of
 * its current suffix are a good guess of what follows now. It owns no
 * state; the scheduler holds each sequence's history and length.
 */
#include "drafter_internal.h"

#include <stdio.h>

int eng_speculative_parse(const char *name, eng_speculative *out, char *msg, size_t msg_len)
{
    int v = ql_name_expect(&ql_speculative_names, "speculative", name, msg, msg_len);
    if (v < 0)
        return v;
    if (v == QL_SPEC_DRAFT || v == QL_SPEC_MTP)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "speculative \"%s\": %s is not built yet (issue 37); use ngram or off", name,
                       v == QL_SPEC_DRAFT ? "a draft model" : "a model's MTP heads");
    *out = (eng_speculative)v;
    return QL_OK;
}

int eng_spec_opts_resolve(eng_spec_opts *o, char *msg, size_t msg_len)
{
    if (o->drafter == ENG_SPEC_DRAFT || o->drafter == ENG_SPEC_MTP)
        return eng_speculative_parse(ql_name_of(&ql_speculative_names, (int)o->drafter),
                                     &o->drafter, msg, msg_len);
    if (o->drafter != ENG_SPEC_OFF && o->drafter != ENG_SPEC_NGRAM)
        return ql_fail(msg, msg_len, QL_EINVAL, "speculative: unknown drafter %d", (int)o->drafter);
    if (o->draft_max == 0)
        o->draft_max = 4;
    if (o->ngram_min == 0)
        o->ngram_min = 1;
    if (o->ngram_max == 0)
        o->ngram_max = o->ngram_min > 3 ? o->ngram_min : 3;
    if (o->max_batch == 0)
        o->max_batch = 8;
    if (o->draft_max < 1 || o->draft_max > ENG_SPEC_MAX_DRAFT)
        return ql_fail(msg, msg_len, QL_EINVAL, "draft-max %d is not in [1, %d]", o->draft_max,
                       ENG_SPEC_MAX_DRAFT);
    if (o->ngram_min < 1 || o->ngram_max < o->ngram_min || o->ngram_max > 64)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "ngram-min %d and ngram-max %d: want 1 <= ngram-min <= ngram-max <= 64",
                       o->ngram_min, o->ngram_max);
    if (o->max_batch < 1)
        return ql_fail(msg, msg_len, QL_EINVAL, "spec-max-batch %d is not positive", o->max_batch);
    return QL_OK;
}

/* --- the n-gram lookup ------------------------------------------------------------ */

static int32_t token_at(const eng_history *h, int32_t i)
{
    return i < h->n_prompt ? h->prompt[i] : h->answer[i - h->n_prompt];
}

/* Whether the n tokens at a equal those at b. */
static bool same_run(const eng_history *h, int32_t a, int32_t b, int32_t n)
{
    for (int32_t j = 0; j < n; j++)
        if (token_at(h, a + j) != token_at(h, b + j))
            return false;
    return true;
}

int32_t eng_ngram_draft(const eng_history *h, int32_t n_min, int32_t n_max, int32_t max,
                        int32_t *out)
{
    int32_t total = h->n_prompt + h->n_answer;
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
                out[k++] = token_at(h, i);
            return k;
        }
    }
    return 0;
}

static int32_t ngram_draft(const eng_drafter *d, const eng_history *h, int32_t max, int32_t *out)
{
    return eng_ngram_draft(h, d->o.ngram_min, d->o.ngram_max, max, out);
}

static const eng_drafter_ops ngram_ops = {.name = "ngram", .draft = ngram_draft};

int eng_drafter_init(eng_drafter *d, const eng_spec_opts *o, char *msg, size_t msg_len)
{
    d->o = *o;
    d->ops = NULL;
    int rc = eng_spec_opts_resolve(&d->o, msg, msg_len);
    if (rc == QL_OK && d->o.drafter == ENG_SPEC_NGRAM)
        d->ops = &ngram_ops;
    return rc;
}

/* --- the draft length ------------------------------------------------------------- */

void eng_spec_len_init(eng_spec_len *l, int32_t draft_max)
{
    l->len = draft_max;
    l->idle = 0;
}

int32_t eng_spec_len_want(eng_spec_len *l)
{
    if (l->len == 0 && ++l->idle >= ENG_SPEC_PROBE_STEPS) {
        l->len = 1;
        l->idle = 0;
    }
    return l->len;
}

void eng_spec_len_adapt(eng_spec_len *l, int32_t drafted, int32_t accepted, int32_t draft_max)
{
    if (drafted <= 0)
        return;
    if (accepted >= drafted) {
        int32_t more = drafted + 1 > l->len ? drafted + 1 : l->len;
        l->len = more < draft_max ? more : draft_max;
    } else if (accepted > 0)
        l->len = accepted + 1;
    else
        l->len = drafted / 2;
    if (l->len == 0)
        l->idle = 0;
}

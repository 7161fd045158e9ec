/*
 * draft_model.c - speculative decoding's draft model (internal/drafter_internal.h):
 * a second, smaller model with the target's vocabulary, run on its own CPU
 * backend with its own paged KV cache, that guesses each drafting
 * sequence's next tokens greedily.
 *
 * Each sequence keeps its own KV in the draft's cache, in step with what
 * the target accepted: after a verification the scheduler rolls it back to
 * the accepted tokens (eng_drafter_rollback), and the next draft first
 * feeds what it has not seen (the prompt at the first draft, then the
 * sampled token and any accepted drafts it had not fed). Drafting k tokens
 * for every drafting sequence then costs k draft steps in all, not k per
 * sequence: one step per drafted position carries all of them.
 *
 * The draft runs the base model only: a request's unmerged adapters apply
 * in the target's verification, and a merged adapter changes the target's
 * weights, not the draft's. Either way the answer is the target's; only
 * acceptance changes.
 */
#include "drafter_internal.h"
#include "ops_math.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct eng_draft_model {
    const eng_model *m; /* borrowed (eng_spec_opts.draft_model) */
    eng_backend *backend;
    eng_kv_cache *kv;
    int32_t max_tokens, max_seqs, vocab;
    eng_step_seq *step; /* max_seqs */
    int32_t *owner;     /* max_seqs: the job each step row is */
    float *logits;      /* max_seqs x vocab */
    int32_t *tokens;    /* max_seqs: the backend's greedy choices (-1: none) */
    int32_t *feed;      /* max_tokens: the tokens a step feeds, end to end */
    uint64_t steps;     /* draft steps run (eng_drafter_steps) */
};

/* Why m cannot be the draft model (NULL: it can). */
static const char *hybrid(const eng_model *m)
{
    return m->cfg.linear.n_layers > 0 ? "has linear-attention layers, whose recurrent state cannot "
                                        "be rolled back past rejected drafts"
                                      : NULL;
}

/* Whether token id reads the same in both tokenizers (its text and type). */
static bool same_token(const tok_tokenizer *a, const tok_tokenizer *b, int32_t id, char *msg,
                       size_t msg_len)
{
    size_t la = 0, lb = 0;
    int ta = 0, tb = 0;
    const char *sa = tok_token_text(a, id, &la, &ta), *sb = tok_token_text(b, id, &lb, &tb);
    if ((!sa) == (!sb) && la == lb && ta == tb && (!sa || memcmp(sa, sb, la) == 0))
        return true;
    ql_fail(msg, msg_len, QL_EINVAL,
            "--draft-model: the vocabularies differ at token %d: \"%.*s\" in the draft model, "
            "\"%.*s\" in the target",
            id, sb ? (int)(lb < 40 ? lb : 40) : 6, sb ? sb : "(none)",
            sa ? (int)(la < 40 ? la : 40) : 6, sa ? sa : "(none)");
    return false;
}

/* The draft's vocabulary must be the target's: the same size, and every id the same token. */
static int check_vocab(const eng_model *target, const eng_model *draft, char *msg, size_t msg_len)
{
    int32_t n = target->cfg.vocab_size;
    if (draft->cfg.vocab_size != n || tok_vocab_size(draft->tok) != tok_vocab_size(target->tok))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--draft-model: the vocabularies differ in size: %d tokens (%zu in its "
                       "tokenizer) in the draft model, %d (%zu) in the target",
                       draft->cfg.vocab_size, tok_vocab_size(draft->tok), n,
                       tok_vocab_size(target->tok));
    int32_t texts = (int32_t)tok_vocab_size(target->tok);
    for (int32_t id = 0; id < texts; id++)
        if (!same_token(target->tok, draft->tok, id, msg, msg_len))
            return QL_EINVAL;
    return QL_OK;
}

int eng_draft_model_new(eng_draft_model **out, const eng_model *target, const eng_spec_opts *o,
                        const eng_draft_sizes *sz, char *msg, size_t msg_len)
{
    *out = NULL;
    const eng_model *m = o->draft_model;
    /* a hybrid target rolls back from its row states (eng_kv_rollback); the draft model
     * steps one drafted token at a time and keeps none */
    if (hybrid(m))
        return ql_fail(msg, msg_len, QL_EINVAL, "--draft-model: the draft model %s", hybrid(m));
    int rc = check_vocab(target, m, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_draft_model *dm = calloc(1, sizeof *dm);
    if (!dm)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    dm->m = m;
    dm->max_tokens = sz->max_tokens;
    dm->max_seqs = sz->max_seqs;
    dm->vocab = m->cfg.vocab_size;
    eng_backend_opts bo = {.device = ENG_DEVICE_CPU,
                           .threads = sz->threads,
                           .max_tokens = sz->max_tokens,
                           .max_seqs = sz->max_seqs,
                           .kv_bytes = eng_draft_kv_bytes(&target->cfg, &m->cfg, o, sz),
                           .block_tokens = sz->block_tokens,
                           .kv_dtype = sz->kv_dtype};
    rc = eng_backend_new(&dm->backend, m, &bo, msg, msg_len);
    if (rc == QL_OK) {
        dm->kv = eng_backend_kv(dm->backend);
        size_t seqs = (size_t)sz->max_seqs;
        dm->step = calloc(seqs, sizeof *dm->step);
        dm->owner = calloc(seqs, sizeof *dm->owner);
        dm->logits = malloc(seqs * (size_t)dm->vocab * sizeof *dm->logits);
        dm->tokens = malloc(seqs * sizeof *dm->tokens);
        dm->feed = malloc((size_t)sz->max_tokens * sizeof *dm->feed);
        if (!dm->step || !dm->owner || !dm->logits || !dm->tokens || !dm->feed)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the draft model's steps");
    }
    if (rc != QL_OK) {
        eng_draft_model_free(dm);
        return rc;
    }
    *out = dm;
    return QL_OK;
}

void eng_draft_model_free(eng_draft_model *dm)
{
    if (!dm)
        return;
    eng_backend_free(dm->backend);
    free(dm->step);
    free(dm->owner);
    free(dm->logits);
    free(dm->tokens);
    free(dm->feed);
    free(dm);
}

/* kv keeps at most n_tokens positions; one it cannot roll back starts over. */
static void rollback_kv(eng_draft_model *dm, eng_seq_kv *kv, int32_t n_tokens)
{
    if (kv->n_tokens <= n_tokens)
        return;
    char msg[160];
    if (eng_kv_rollback(dm->kv, kv, n_tokens, msg, sizeof msg) != QL_OK)
        eng_kv_release(dm->kv, kv); /* the next draft feeds it everything again */
}

/* Run the n rows of dm->step; each row's greedy token into dm->tokens. A
 * failed step drafts nothing for its jobs (their KV is given back whole, so
 * the next draft starts them over). */
static bool draft_step(eng_draft_model *dm, eng_draft_job *jobs, int32_t n)
{
    char msg[256];
    dm->steps++;
    int rc = eng_backend_forward(dm->backend, dm->step, n, dm->logits, dm->tokens, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve: a draft model step of %d sequences failed: %s\n", n, msg);
        for (int32_t i = 0; i < n; i++) {
            eng_draft_job *j = &jobs[dm->owner[i]];
            eng_kv_release(dm->kv, j->kv);
            j->max = 0;
            j->n = 0;
        }
        return false;
    }
    for (int32_t i = 0; i < n; i++)
        if (dm->tokens[i] < 0)
            /* the sampler's greedy rule: the lowest id on ties */
            dm->tokens[i] = om_greedy_argmax(dm->logits + (size_t)i * (size_t)dm->vocab, dm->vocab);
    return true;
}

/* Feed each job what its KV has not seen of its history, in steps of at
 * most max_tokens tokens; a job whose last token is fed gets its first
 * draft from that row. Jobs whose KV cannot hold their reservation are
 * left out (max 0). */
static void catch_up(eng_draft_model *dm, eng_draft_job *jobs, int32_t n_jobs)
{
    for (int32_t i = 0; i < n_jobs; i++) {
        eng_draft_job *j = &jobs[i];
        j->n = 0;
        int32_t total = j->h.n_prompt + j->h.n_answer;
        if (j->kv->n_tokens >= total) /* it saw the last token as a draft: feed it again */
            rollback_kv(dm, j->kv, total - 1);
        if (j->kv->n_blocks == 0 && eng_kv_reserve(dm->kv, j->kv, j->reserve) != QL_OK)
            j->max = 0; /* the draft's cache is full: no draft until a sequence ends */
    }
    for (;;) {
        int32_t n = 0, fed = 0;
        for (int32_t i = 0; i < n_jobs && n < dm->max_seqs && fed < dm->max_tokens; i++) {
            eng_draft_job *j = &jobs[i];
            int32_t seen = j->kv->n_tokens, total = j->h.n_prompt + j->h.n_answer;
            if (j->max == 0 || seen >= total)
                continue;
            int32_t c = total - seen < dm->max_tokens - fed ? total - seen : dm->max_tokens - fed;
            for (int32_t t = 0; t < c; t++)
                dm->feed[fed + t] = eng_history_at(&j->h, seen + t);
            dm->step[n] = (eng_step_seq){
                .kv = j->kv, .tokens = dm->feed + fed, .n_tokens = c, .pos = seen, .greedy = true};
            dm->owner[n++] = i;
            fed += c;
        }
        if (n == 0 || !draft_step(dm, jobs, n))
            return;
        for (int32_t i = 0; i < n; i++) {
            eng_draft_job *j = &jobs[dm->owner[i]];
            if (j->kv->n_tokens == j->h.n_prompt + j->h.n_answer)
                j->out[j->n++] = dm->tokens[i];
        }
    }
}

double eng_draft_model_run(eng_draft_model *dm, eng_draft_job *jobs, int32_t n_jobs, int32_t *steps)
{
    catch_up(dm, jobs, n_jobs);
    /* then one step per drafted position, every job still drafting in it: each feeds its last
     * draft and gets the next */
    double t0 = ql_now_s();
    for (*steps = 0;; ++*steps) {
        int32_t n = 0;
        for (int32_t i = 0; i < n_jobs && n < dm->max_seqs; i++) {
            eng_draft_job *j = &jobs[i];
            if (j->n == 0 || j->n >= j->max)
                continue;
            dm->step[n] = (eng_step_seq){.kv = j->kv,
                                         .tokens = &j->out[j->n - 1],
                                         .n_tokens = 1,
                                         .pos = j->kv->n_tokens,
                                         .greedy = true};
            dm->owner[n++] = i;
        }
        if (n == 0 || !draft_step(dm, jobs, n))
            return ql_now_s() - t0;
        for (int32_t i = 0; i < n; i++) {
            eng_draft_job *j = &jobs[dm->owner[i]];
            j->out[j->n++] = dm->tokens[i];
        }
    }
}

void eng_draft_model_rollback(eng_draft_model *dm, eng_seq_kv *kv, int32_t n_tokens)
{
    rollback_kv(dm, kv, n_tokens);
}

uint64_t eng_draft_model_steps(const eng_draft_model *dm)
{
    return dm->steps;
}

eng_kv_cache *eng_draft_model_kv(eng_draft_model *dm)
{
    return dm->kv;
}

size_t eng_draft_kv_bytes(const eng_config *target, const eng_config *cfg, const eng_spec_opts *o,
                          const eng_draft_sizes *sz)
{
    if (o->draft_kv_bytes > 0)
        return o->draft_kv_bytes;
    size_t per_target = eng_kv_token_bytes(target, sz->kv_dtype);
    size_t per_draft = eng_kv_token_bytes(cfg, sz->kv_dtype);
    return sz->target_kv_bytes / (per_target ? per_target : 1) * per_draft;
}

/*
 * mtp_drafter.c - speculative decoding's mtp drafter (internal/drafter_internal.h):
 * the target's own multi-token-prediction layers (Qwen3.5's mtp.*, mtp.h)
 * guessing each drafting sequence's next tokens greedily.
 *
 * MTP row i takes the target's hidden state at position i (after its
 * final norm) and token i + 1, and says token i + 2. So the drafter lives
 * on what the target computes: while it is on, every target step of a
 * sequence that may draft (its prefill chunks too) writes its rows' hidden
 * states into that sequence's eng_draft_rows (eng_drafter_hidden_out), and
 * the MTP's own KV (one full-attention layer) covers every position the
 * target has, fed from those rows. At a draft, the sequence's last token
 * is known, so every row the MTP has not seen can be fed: one step over
 * them gives, at its last row, the first draft. The next drafts chain: the
 * MTP's own output (after its norm) and its draft stand in for the
 * target's hidden state and token, one position on (vLLM's MTP proposer).
 * Those chained rows are the MTP's guesses, not the target's states, so
 * its KV goes back to the target's rows after the draft; the target's
 * hidden states of the tokens it accepts come in with the next step, and
 * the rows of rejected drafts are dropped with its rollback.
 *
 * It runs on the CPU: its own pool (which also runs fc, eng_mtp_input), KV
 * cache and forward scratch, as the draft model runs its own backend; one
 * draft step carries every drafting sequence, as there. A request's
 * unmerged adapters apply in the target's verification only.
 */
#include "drafter_internal.h"
#include "ops_math.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct eng_mtp_drafter {
    const eng_model *target; /* borrowed (the engine's model) */
    eng_model view;          /* its MTP layers as a model (eng_mtp_view: borrows target's) */
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    int32_t max_tokens, max_seqs, vocab;
    int64_t hidden;
    eng_step_seq *step; /* max_seqs */
    int32_t *owner;     /* max_seqs: the job each step row is */
    float *logits;      /* max_seqs x vocab */
    int32_t *tokens;    /* max_seqs: each step row's greedy token */
    int32_t *feed;      /* max_tokens: the tokens a step feeds (token i + 1 of row i) */
    float *hid;         /* max_tokens x hidden: the target's (or chained) states a step takes */
    float *cat;         /* max_tokens x 2 hidden: eng_mtp_concat's rows */
    float *in;          /* max_tokens x hidden: fc of them, the step's input rows */
    float *out;         /* max_tokens x hidden: the step's output states (hidden_out) */
    float *chain;       /* max_seqs x hidden: each job's last output state */
    uint64_t steps;     /* MTP steps run (eng_drafter_steps) */
};

int eng_mtp_input(eng_pool *pool, const eng_model *m, const int32_t *tokens, const float *hidden,
                  int32_t n, float *cat, float *out)
{
    int rc = eng_mtp_concat(m, tokens, hidden, n, cat);
    if (rc == QL_OK)
        eng_cpu_matmul(pool, &m->mtp.fc, cat, n, out);
    return rc;
}

int eng_mtp_drafter_new(eng_mtp_drafter **out, const eng_model *target, const eng_spec_opts *o,
                        const eng_draft_sizes *sz, char *msg, size_t msg_len)
{
    *out = NULL;
    if (target->mtp.n_layers == 0 && target->cfg.n_experts > 0 && target->cfg.linear.mtp_layers > 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "--speculative mtp: the model %s's MTP layers (%d) are mixture-of-experts "
                       "layers, which qlserve does not read yet",
                       target->name, target->cfg.linear.mtp_layers);
    if (target->mtp.n_layers == 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--speculative mtp: the model %s has no MTP layers (mtp.* tensors)",
                       target->name);
    /* the MTP runs on the CPU beside the target; the target's hidden states would come from
     * the CUDA backend, whose hybrid models keep no row states to roll back either */
    if (sz->device != ENG_DEVICE_CPU)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--speculative mtp: the model %s runs on %s; its MTP drafts on the CPU "
                       "backend only (--device cpu)",
                       target->name, ql_name_of(&ql_device_names, (int)sz->device));
    eng_mtp_drafter *md = calloc(1, sizeof *md);
    if (!md)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    md->target = target;
    eng_mtp_view(target, &md->view);
    md->max_tokens = sz->max_tokens;
    md->max_seqs = sz->max_seqs;
    md->vocab = target->cfg.vocab_size;
    md->hidden = target->cfg.hidden_size;
    int rc = eng_pool_new(&md->pool, sz->threads, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_kv_new_dtype(&md->kv, &md->view.cfg,
                              eng_draft_kv_bytes(&target->cfg, &md->view.cfg, o, sz),
                              sz->block_tokens, sz->kv_dtype, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_forward_state_new(&md->st, &md->view, sz->max_tokens, msg, msg_len);
    if (rc == QL_OK) {
        size_t seqs = (size_t)sz->max_seqs, rows = (size_t)sz->max_tokens;
        size_t H = (size_t)md->hidden;
        md->step = calloc(seqs, sizeof *md->step);
        md->owner = calloc(seqs, sizeof *md->owner);
        md->logits = malloc(seqs * (size_t)md->vocab * sizeof *md->logits);
        md->tokens = malloc(seqs * sizeof *md->tokens);
        md->feed = malloc(rows * sizeof *md->feed);
        md->hid = malloc(rows * H * sizeof *md->hid);
        md->cat = malloc(rows * 2 * H * sizeof *md->cat);
        md->in = malloc(rows * H * sizeof *md->in);
        md->out = malloc(rows * H * sizeof *md->out);
        md->chain = malloc(seqs * H * sizeof *md->chain);
        if (!md->step || !md->owner || !md->logits || !md->tokens || !md->feed || !md->hid ||
            !md->cat || !md->in || !md->out || !md->chain)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the MTP drafter's steps");
    }
    if (rc != QL_OK) {
        eng_mtp_drafter_free(md);
        return rc;
    }
    *out = md;
    return QL_OK;
}

void eng_mtp_drafter_free(eng_mtp_drafter *md)
{
    if (!md)
        return;
    eng_forward_state_free(md->st);
    eng_kv_free(md->kv);
    eng_pool_free(md->pool);
    free(md->step);
    free(md->owner);
    free(md->logits);
    free(md->tokens);
    free(md->feed);
    free(md->hid);
    free(md->cat);
    free(md->in);
    free(md->out);
    free(md->chain);
    free(md);
}

/* rows can no longer follow the target: the MTP drafts nothing more for them. */
static void lose(eng_draft_rows *rows)
{
    free(rows->rows);
    *rows = (eng_draft_rows){.lost = true};
}

float *eng_drafter_hidden_out(eng_drafter *d, eng_draft_rows *rows, int32_t pos, int32_t n)
{
    if (!d->mtp || rows->lost)
        return NULL;
    if (pos != rows->pos + rows->n) { /* a position the target did not give it */
        lose(rows);
        return NULL;
    }
    size_t H = (size_t)d->mtp->hidden;
    if (rows->n + n > rows->cap) {
        int32_t cap = rows->cap ? rows->cap : 16;
        while (cap < rows->n + n)
            cap *= 2;
        float *grown = realloc(rows->rows, (size_t)cap * H * sizeof *grown);
        if (!grown) {
            lose(rows);
            return NULL;
        }
        rows->rows = grown;
        rows->cap = cap;
    }
    float *at = rows->rows + (size_t)rows->n * H;
    rows->n += n;
    return at;
}

void eng_drafter_fork(eng_drafter *d, eng_draft_rows *dst, const eng_draft_rows *src,
                      const eng_seq_kv *src_kv)
{
    if (!d->mtp)
        return;
    if (src->lost || src_kv->n_tokens > 0 || src->pos > 0) {
        lose(dst);
        return;
    }
    if (src->n == 0)
        return;
    eng_draft_rows copy = {.pos = src->pos, .n = src->n, .cap = src->n};
    size_t bytes = (size_t)src->n * (size_t)d->mtp->hidden * sizeof(float);
    copy.rows = malloc(bytes);
    if (!copy.rows) {
        lose(dst);
        return;
    }
    memcpy(copy.rows, src->rows, bytes);
    free(dst->rows);
    *dst = copy;
}

/* kv keeps at most n_tokens positions; one it cannot roll back loses rows. */
static void rollback_kv(eng_mtp_drafter *md, eng_seq_kv *kv, eng_draft_rows *rows, int32_t n_tokens)
{
    if (kv->n_tokens <= n_tokens)
        return;
    char msg[160];
    if (eng_kv_rollback(md->kv, kv, n_tokens < 0 ? 0 : n_tokens, msg, sizeof msg) != QL_OK) {
        eng_kv_release(md->kv, kv);
        lose(rows);
    }
}

void eng_mtp_drafter_rollback(eng_mtp_drafter *md, eng_seq_kv *kv, eng_draft_rows *rows,
                              int32_t n_tokens)
{
    if (!rows || rows->lost)
        return;
    /* MTP row i needs token i + 1: of n_tokens positions, the last waits for the next token */
    if (rows->pos > 0 && rows->pos > n_tokens - 1) { /* it fed rows of rejected tokens */
        eng_kv_release(md->kv, kv);
        lose(rows);
        return;
    }
    if (rows->pos + rows->n > n_tokens)
        rows->n = n_tokens - rows->pos;
    rollback_kv(md, kv, rows, n_tokens - 1);
}

eng_kv_cache *eng_mtp_drafter_kv(eng_mtp_drafter *md)
{
    return md->kv;
}

uint64_t eng_mtp_drafter_steps(const eng_mtp_drafter *md)
{
    return md->steps;
}

/* Run the n rows of md->step (rows in all: their input states in md->hid,
 * their tokens in md->feed); each row's greedy token into md->tokens. A
 * failed step drafts nothing for its jobs, which lose their rows. */
static bool mtp_step(eng_mtp_drafter *md, eng_draft_job *jobs, int32_t n, int32_t rows)
{
    char msg[256];
    md->steps++;
    int rc = eng_mtp_input(md->pool, md->target, md->feed, md->hid, rows, md->cat, md->in);
    if (rc == QL_OK)
        rc = eng_forward(md->st, &md->view, md->kv, md->pool, md->step, n, md->logits, msg,
                         sizeof msg);
    else
        snprintf(msg, sizeof msg, "out of memory for the MTP's input rows");
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve: an MTP step of %d sequences failed: %s\n", n, msg);
        for (int32_t i = 0; i < n; i++) {
            eng_draft_job *j = &jobs[md->owner[i]];
            eng_kv_release(md->kv, j->kv);
            lose(j->rows);
            j->max = 0;
            j->n = 0;
        }
        return false;
    }
    for (int32_t i = 0; i < n; i++) /* the sampler's greedy rule: the lowest id on ties */
        md->tokens[i] = om_greedy_argmax(md->logits + (size_t)i * (size_t)md->vocab, md->vocab);
    return true;
}

/* Step row n of md: job i's c rows from position pos, their inputs at row offset at. */
static void add_row(eng_mtp_drafter *md, int32_t n, int32_t i, eng_draft_job *j, int32_t pos,
                    int32_t c, int32_t at)
{
    size_t H = (size_t)md->hidden;
    md->step[n] = (eng_step_seq){.kv = j->kv,
                                 .tokens = md->feed + at,
                                 .n_tokens = c,
                                 .pos = pos,
                                 .embeds = md->in + (size_t)at * H,
                                 .hidden_out = md->out + (size_t)at * H};
    md->owner[n] = i;
}

/* Whether job j can take in its rows: they follow its MTP KV and reach the
 * token before h's last (a draft: the last token fed to the target) or at
 * most h's last (a feed, during a prefill too), and its KV holds its
 * reservation. */
static bool ready(eng_mtp_drafter *md, eng_draft_job *j, bool draft)
{
    eng_draft_rows *r = j->rows;
    int32_t total = j->h.n_prompt + j->h.n_answer, end = r->pos + r->n;
    j->n = 0;
    if (r->lost || r->n == 0)
        return false; /* lost, or nothing new (a failed draft before): no first draft */
    if (r->pos != j->kv->n_tokens || (draft ? end != total - 1 : end > total)) {
        eng_kv_release(md->kv, j->kv);
        lose(r);
        return false;
    }
    return j->kv->n_blocks > 0 || eng_kv_reserve(md->kv, j->kv, j->reserve) == QL_OK;
}

/* Feed each ready job its rows, in steps of at most max_tokens rows: all of
 * them for a draft, where a job whose last row is fed gets its first draft
 * and its output state from it; all but the last otherwise (the next
 * draft's first step needs one). */
static void catch_up(eng_mtp_drafter *md, eng_draft_job *jobs, int32_t n_jobs, bool draft)
{
    size_t H = (size_t)md->hidden;
    for (int32_t i = 0; i < n_jobs; i++)
        if (!ready(md, &jobs[i], draft))
            jobs[i].max = 0;
    for (;;) {
        int32_t n = 0, fed = 0;
        for (int32_t i = 0; i < n_jobs && n < md->max_seqs && fed < md->max_tokens; i++) {
            eng_draft_job *j = &jobs[i];
            eng_draft_rows *r = j->rows;
            int32_t seen = j->kv->n_tokens, end = r->pos + r->n - !draft;
            if (j->max == 0 || seen >= end)
                continue;
            int32_t c = end - seen < md->max_tokens - fed ? end - seen : md->max_tokens - fed;
            for (int32_t t = 0; t < c; t++)
                md->feed[fed + t] = eng_history_at(&j->h, seen + t + 1);
            memcpy(md->hid + (size_t)fed * H, r->rows + (size_t)(seen - r->pos) * H,
                   (size_t)c * H * sizeof *md->hid);
            add_row(md, n++, i, j, seen, c, fed);
            fed += c;
        }
        if (n == 0 || !mtp_step(md, jobs, n, fed))
            break;
        for (int32_t k = 0; k < n; k++) {
            eng_draft_job *j = &jobs[md->owner[k]];
            const eng_step_seq *q = &md->step[k];
            if (!draft || j->kv->n_tokens < j->rows->pos + j->rows->n)
                continue;
            j->out[j->n++] = md->tokens[k];
            memcpy(md->chain + (size_t)md->owner[k] * H,
                   q->hidden_out + (size_t)(q->n_tokens - 1) * H, H * sizeof *md->chain);
        }
    }
    /* the rows fed are in the KV now (all of a job that drafts; a step that did not run for
     * the rest leaves some) */
    for (int32_t i = 0; i < n_jobs; i++) {
        eng_draft_rows *r = jobs[i].rows;
        int32_t fed = jobs[i].kv->n_tokens - r->pos;
        if (r->lost || fed <= 0)
            continue;
        memmove(r->rows, r->rows + (size_t)fed * H, (size_t)(r->n - fed) * H * sizeof *r->rows);
        r->pos += fed;
        r->n -= fed;
    }
}

double eng_mtp_drafter_run(eng_mtp_drafter *md, eng_draft_job *jobs, int32_t n_jobs, int32_t *steps)
{
    size_t H = (size_t)md->hidden;
    catch_up(md, jobs, n_jobs, true);
    /* then one step per drafted position, every job still drafting in it: each takes its last
     * output state and draft, one position on, and gets the next */
    double t0 = ql_now_s();
    for (*steps = 0;; ++*steps) {
        int32_t n = 0;
        for (int32_t i = 0; i < n_jobs && n < md->max_seqs; i++) {
            eng_draft_job *j = &jobs[i];
            if (j->n == 0 || j->n >= j->max)
                continue;
            md->feed[n] = j->out[j->n - 1];
            memcpy(md->hid + (size_t)n * H, md->chain + (size_t)i * H, H * sizeof *md->hid);
            add_row(md, n, i, j, j->kv->n_tokens, 1, n);
            n++;
        }
        if (n == 0 || !mtp_step(md, jobs, n, n))
            break;
        for (int32_t k = 0; k < n; k++) {
            int32_t i = md->owner[k];
            jobs[i].out[jobs[i].n++] = md->tokens[k];
            memcpy(md->chain + (size_t)i * H, md->out + (size_t)k * H, H * sizeof *md->chain);
        }
    }
    double took = ql_now_s() - t0;
    /* the chained rows were the MTP's guesses: its KV keeps the target's rows alone */
    for (int32_t i = 0; i < n_jobs; i++)
        if (jobs[i].n > 0 && !jobs[i].rows->lost)
            rollback_kv(md, jobs[i].kv, jobs[i].rows, jobs[i].rows->pos);
    return took;
}

void eng_drafter_feed(eng_drafter *d, eng_draft_job *jobs, int32_t n_jobs)
{
    if (d->mtp)
        catch_up(d->mtp, jobs, n_jobs, false);
}

/*
 * drafter_internal.h - speculative decoding's drafters and the per-sequence
 * draft length (drafter.c), for scheduler.c and the tests alone.
 *
 * A drafter is a row of operations (eng_drafter_ops): given what a sequence
 * has seen (its prompt and its answer so far), propose up to max tokens
 * that may follow, for every drafting sequence of a step at once: the
 * n-gram lookup (drafter.c), a draft model (draft_model.c) and the
 * model's own MTP layers (mtp_drafter.c).
 */
#ifndef QL_DRAFTER_INTERNAL_H
#define QL_DRAFTER_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "scheduler.h"

/* What a sequence has seen, in two spans (the prompt, shared by a request's
 * choices, and the choice's own answer): token i is prompt[i] below
 * n_prompt, else answer[i - n_prompt]. Borrowed. */
typedef struct eng_history {
    const int32_t *prompt;
    int32_t n_prompt;
    const int32_t *answer;
    int32_t n_answer;
} eng_history;

/* Token i of h. */
static inline int32_t eng_history_at(const eng_history *h, int32_t i)
{
    return i < h->n_prompt ? h->prompt[i] : h->answer[i - h->n_prompt];
}

/* The target's hidden states (after its final norm) that the MTP drafter has
 * not fed yet, of one sequence: rows (n x hidden, owned, grown to cap) hold
 * positions pos .. pos + n - 1. Lost: a position's row never came (a step
 * that failed, a prefix the target did not compute), so the MTP cannot
 * cover the sequence and drafts nothing for it. The zero value is a fresh
 * sequence's. */
typedef struct eng_draft_rows {
    float *rows;
    int32_t pos, n, cap;
    bool lost;
} eng_draft_rows;

/* One drafting sequence of a step: what it has seen (the last token of h is
 * the one the step feeds next), how many tokens it wants, and where they go. */
typedef struct eng_draft_job {
    eng_history h;
    int32_t max;          /* >= 1 */
    int32_t reserve;      /* positions its answer may reach (what its draft KV reserves) */
    eng_seq_kv *kv;       /* its KV in the drafter's cache (a draft model's, the MTP's) */
    eng_draft_rows *rows; /* the target's hidden states the MTP has not seen */
    int32_t *out;         /* max of them */
    int32_t n;            /* out: how many were drafted (0: no guess) */
    int32_t match;        /* out: the n-gram suffix the draft followed (its length; 0 else) */
    bool remembered;      /* out: the draft came from the memory of earlier answers */
} eng_draft_job;

typedef struct eng_drafter eng_drafter;
typedef struct eng_drafter_ops {
    const char *name; /* as the metrics label it: "ngram", "draft" */
    /* Each job's guess of up to max tokens that follow its h. */
    void (*draft)(eng_drafter *d, eng_draft_job *jobs, int32_t n_jobs);
} eng_drafter_ops;

typedef struct eng_draft_model eng_draft_model;
typedef struct eng_mtp_drafter eng_mtp_drafter;
typedef struct eng_ngram_memory eng_ngram_memory;

struct eng_drafter {
    const eng_drafter_ops *ops;
    eng_spec_opts o;          /* resolved (eng_spec_opts_resolve) */
    eng_draft_model *model;   /* the draft drafter's (owned); else NULL */
    double position_s;        /* what a drafted position costs (eng_drafter_timed) */
    eng_mtp_drafter *mtp;     /* the mtp drafter's (owned); else NULL */
    eng_ngram_memory *memory; /* the ngram drafter's earlier answers (owned); NULL: none */
};

/* After a model drafter's chained steps took took_s for `steps` positions
 * (each a step for every job still drafting; the catch-up over what its KV
 * had not seen is not one: its cost comes whatever the length): the
 * decayed mean of seconds per drafted position, which the draft length
 * weighs against the target's rows. n-gram lookup costs none. */
void eng_drafter_timed(eng_drafter *d, double took_s, int32_t steps);

/* The drafter o names (resolved first); QL_EINVAL as eng_spec_opts_resolve.
 * The draft drafter's model gets its backend and cache later
 * (eng_drafter_start), once the engine knows its sizes. */
int eng_drafter_init(eng_drafter *d, const eng_spec_opts *o, char *msg, size_t msg_len);
void eng_drafter_free(eng_drafter *d);

/* What the draft model's backend is sized by: the engine's own figures. */
typedef struct eng_draft_sizes {
    int threads;
    int32_t max_tokens, max_seqs, block_tokens;
    size_t target_kv_bytes; /* its cache's share, when o.draft_kv_bytes is 0 */
    qt_kind kv_dtype;
    eng_device device; /* where the target runs */
} eng_draft_sizes;

/* The bytes of a drafter's own cache for a model of cfg beside target:
 * o->draft_kv_bytes, or as many positions as target_kv_bytes gives target. */
size_t eng_draft_kv_bytes(const eng_config *target, const eng_config *cfg, const eng_spec_opts *o,
                          const eng_draft_sizes *sz);

/* The draft drafter's model, or the mtp drafter's MTP layers, beside target
 * (eng_draft_model_new, eng_mtp_drafter_new); nothing for the n-gram. */
int eng_drafter_start(eng_drafter *d, const eng_model *target, const eng_draft_sizes *sz, char *msg,
                      size_t msg_len);

/*
 * The draft drafter's model beside target (draft_model.c): refused by name
 * when the draft model is hybrid (it keeps no row states to roll back) or
 * the vocabularies differ (the size, or the first token whose text differs);
 * else its CPU backend and its own paged KV cache, o->draft_kv_bytes or as
 * many positions as target_kv_bytes gives the target. *out owned by the caller.
 */
int eng_draft_model_new(eng_draft_model **out, const eng_model *target, const eng_spec_opts *o,
                        const eng_draft_sizes *sz, char *msg, size_t msg_len);
void eng_draft_model_free(eng_draft_model *dm);
/* The draft model's greedy guesses for jobs: it first takes in what each
 * job's KV has not seen of its h (in chunks a step holds), then one step
 * per drafted position for all jobs together. A job whose KV cannot be
 * reserved, or whose step fails, drafts nothing. Returns the seconds the
 * steps after the catch-up took, their count in *steps (eng_drafter_timed). */
double eng_draft_model_run(eng_draft_model *dm, eng_draft_job *jobs, int32_t n_jobs,
                           int32_t *steps);
/*
 * The mtp drafter beside target (mtp_drafter.c): refused by name when target
 * has no MTP layers or runs on CUDA; else its MTP layers (eng_mtp_view) on a
 * pool, KV cache and forward scratch of their own, the cache sized as a
 * draft model's. *out owned by the caller.
 */
int eng_mtp_drafter_new(eng_mtp_drafter **out, const eng_model *target, const eng_spec_opts *o,
                        const eng_draft_sizes *sz, char *msg, size_t msg_len);
void eng_mtp_drafter_free(eng_mtp_drafter *md);
/* The MTP's greedy guesses for jobs: first one step over each job's rows
 * (every hidden state it has not fed, in chunks a step holds), whose last
 * row drafts the first token, then one step per further position for all
 * jobs together, each chaining its own output and token; each job's KV
 * then goes back to the rows the target gave. A job whose rows are lost or
 * do not reach its last fed token, whose KV cannot be reserved, or whose
 * step fails, drafts nothing (a failed step loses its rows). Returns the
 * seconds the steps after the first took, their count in *steps. */
double eng_mtp_drafter_run(eng_mtp_drafter *md, eng_draft_job *jobs, int32_t n_jobs,
                           int32_t *steps);
/* The rows one MTP input takes, n of them into out (n x hidden): fc of
 * eng_mtp_concat's rows (into cat, n x 2 hidden), on pool. QL_ENOMEM as
 * eng_mtp_concat. */
int eng_mtp_input(eng_pool *pool, const eng_model *m, const int32_t *tokens, const float *hidden,
                  int32_t n, float *cat, float *out);
/* The draft model's and the mtp drafter's parts of eng_drafter_rollback,
 * eng_drafter_kv and eng_drafter_steps. */
void eng_draft_model_rollback(eng_draft_model *dm, eng_seq_kv *kv, int32_t n_tokens);
eng_kv_cache *eng_draft_model_kv(eng_draft_model *dm);
uint64_t eng_draft_model_steps(const eng_draft_model *dm);
void eng_mtp_drafter_rollback(eng_mtp_drafter *md, eng_seq_kv *kv, eng_draft_rows *rows,
                              int32_t n_tokens);
eng_kv_cache *eng_mtp_drafter_kv(eng_mtp_drafter *md);
uint64_t eng_mtp_drafter_steps(const eng_mtp_drafter *md);

/* Where a target step's n hidden states of a sequence at positions pos..
 * go (eng_step_seq.hidden_out), appended to its rows; NULL when the drafter
 * takes none (not mtp), the rows are lost, or pos does not follow them (they
 * are lost then). */
float *eng_drafter_hidden_out(eng_drafter *d, eng_draft_rows *rows, int32_t pos, int32_t n);
/* The MTP takes in each job's rows but the last (the next draft's first
 * step needs one; a job's h is what its target steps have seen, with or
 * without the token it feeds next), drafting nothing; nothing for other
 * drafters. A job that cannot is left as eng_mtp_drafter_run leaves it. So
 * a sequence that drafts nothing for a while (a long prompt's prefill, a
 * batch past max_batch) need not keep a hidden state per position. */
void eng_drafter_feed(eng_drafter *d, eng_draft_job *jobs, int32_t n_jobs);
/* A forked choice's rows: a copy of its first choice's (lost where that one
 * has fed some to its MTP KV already, which the fork does not share). */
void eng_drafter_fork(eng_drafter *d, eng_draft_rows *dst, const eng_draft_rows *src,
                      const eng_seq_kv *src_kv);
/* After a verification: kv keeps at most n_tokens positions (the tokens the
 * target accepted); what it saw past them is forgotten, and so are rows at
 * n_tokens and on (rows may be NULL for a draft model). */
void eng_drafter_rollback(eng_drafter *d, eng_seq_kv *kv, eng_draft_rows *rows, int32_t n_tokens);
/* A sequence's end: its draft KV goes back and its rows are freed. */
void eng_drafter_release(eng_drafter *d, eng_seq_kv *kv, eng_draft_rows *rows);
/* The drafter's KV cache and the steps it has run (for the tests); NULL and
 * 0 for the n-gram. */
eng_kv_cache *eng_drafter_kv(eng_drafter *d);
uint64_t eng_drafter_steps(const eng_drafter *d);

/* The n-gram lookup: for n from n_max down to n_min, the latest earlier
 * place where h's last n tokens occur with at least one token after them;
 * the first n that has one gives up to max of the tokens that follow it
 * there (they may run into the matched suffix itself: a repeated run
 * drafts its own continuation), and that n in *matched. 0 (and *matched 0)
 * when no n matches. */
int32_t eng_ngram_draft(const eng_history *h, int32_t n_min, int32_t n_max, int32_t max,
                        int32_t *out, int32_t *matched);

/*
 * The n-gram drafter's memory of earlier answers (ngram_memory.c): runs of
 * ENG_NGRAM_MEMORY_MIN to _MAX tokens of the answers the engine ended, the
 * latest place of each, in a ring of at least `tokens` (rounded up to a
 * power of two; [ENG_NGRAM_MEMORY_LEAST, _MOST], else QL_EINVAL) and a table
 * of four times its slots: 36 bytes a token. *out owned by the caller; engine
 * thread only.
 */
#define ENG_NGRAM_MEMORY_MIN   2
#define ENG_NGRAM_MEMORY_MAX   4
#define ENG_NGRAM_MEMORY_LEAST 64
#define ENG_NGRAM_MEMORY_MOST  (1 << 24)
int eng_ngram_memory_new(eng_ngram_memory **out, int32_t tokens, char *msg, size_t msg_len);
void eng_ngram_memory_free(eng_ngram_memory *m);
/* An answer's n tokens, after the earlier ones: the oldest are written
 * over once the ring is full. Nothing for m NULL. */
void eng_ngram_memory_add(eng_ngram_memory *m, const int32_t *tokens, int32_t n);
/* The lookup: for n from ENG_NGRAM_MEMORY_MAX down to the larger of
 * ENG_NGRAM_MEMORY_MIN and shorter + 1 (a longer run than the prompt
 * lookup's match), the latest earlier answer where h's last n tokens were
 * followed by at least one more of that answer; up to max of those
 * followers into out, n in *matched. 0 (and *matched 0, out untouched) when
 * none is remembered. */
int32_t eng_ngram_memory_draft(const eng_ngram_memory *m, const eng_history *h, int32_t shorter,
                               int32_t max, int32_t *out, int32_t *matched);
/* A sequence's answer at its end (fed tokens, n of them), into the n-gram
 * drafter's memory; nothing for other drafters or without one. */
void eng_drafter_remember(eng_drafter *d, const int32_t *fed, int32_t n);

/* The draft lengths request r gets from an engine that drafts at most engine_max tokens: *max 0
 * when r drafts nothing (off), else r's draft_max (0: engine_max) bounded to engine_max; *min r's
 * draft_min bounded to *max. */
void eng_spec_request_bounds(const eng_spec_request *r, int32_t engine_max, int32_t *max,
                             int32_t *min);

/* One sequence's acceptance, as the draft length reads it: decayed counts
 * of the drafted positions it verified (a position is tried when every one
 * before it was accepted) and of those accepted, the first position apart
 * from the rest. Copying makes the two differ: the first guess after a
 * divergence often misses, but once one is taken the next follow the same
 * copied run, so a draft's later positions are accepted more often than its
 * first (the rate of each after the one before it was). */
typedef struct eng_spec_len {
    double first_hits, first_trials; /* the first drafted position */
    double hits, trials;             /* the later ones, each given the one before it */
    int32_t idle;                    /* steps since it last drafted */
} eng_spec_len;

/* A sequence keeps its acceptance apart for each class of draft, as they
 * are accepted at rates of their own: class 0 for the model drafters, and
 * for the n-gram lookup the length of the suffix its draft followed, 1, 2,
 * and 3 or more in the prompt and answer (classes 1-3), 2, 3, and 4 or
 * more in the memory of earlier answers (classes 4-6). On a copying answer a 3-gram's continuation
 * is the copied run and is taken nine times in ten, a lone token's is a guess at where the answer
 * rejoins its source and is taken a third of the time: one rate for both would draft the guesses
 * too long and the runs too short. */
#define ENG_SPEC_CLASSES      7
#define ENG_SPEC_MEMORY_CLASS 4 /* the first of the memory's */
/* The class of a draft that followed a suffix of `match` tokens (0: a
 * model drafter's), from the memory or not. */
static inline int32_t eng_spec_class(int32_t match, bool remembered)
{
    if (remembered) {
        int32_t n = match < ENG_NGRAM_MEMORY_MIN   ? ENG_NGRAM_MEMORY_MIN
                    : match > ENG_NGRAM_MEMORY_MAX ? ENG_NGRAM_MEMORY_MAX
                                                   : match;
        return ENG_SPEC_MEMORY_CLASS + n - ENG_NGRAM_MEMORY_MIN;
    }
    return match < 3 ? (match > 0 ? match : 0) : 3;
}
/* A sequence that has not drafted for this many steps tries one token
 * again: a prompt-copying stretch may begin after a free-writing one. 16
 * steps cost at most one row in sixteen. */
#define ENG_SPEC_PROBE_STEPS 16
/* Each verification's counts weigh this much more than the one before:
 * about the last five verifications decide, so a copying stretch is taken
 * up within a few steps and left as fast. */
#define ENG_SPEC_DECAY 0.8
/* A step's fixed cost (reading the weights, the step's own overhead) in
 * rows' worth of per-token cost, until the steps measured tell it apart
 * (eng_step_cost_fit without spread): on a CPU a batch-1 decode step of a
 * small model is mostly weight reads. */
#define ENG_SPEC_FIXED_ROWS 4.0

/* What a step costs, as the step budget measures it: fixed_s + token_s x
 * rows; fixed_s 0 when the fit cannot tell (ENG_SPEC_FIXED_ROWS then); and
 * what the drafter spends per drafted position (eng_drafter.position_s). */
typedef struct eng_spec_cost {
    double fixed_s, token_s, draft_s;
    int32_t n_decode; /* decode tokens the step carries without drafts */
} eng_spec_cost;

/* A fresh start: as if ENG_SPEC_PRIOR_RATE of ENG_SPEC_PRIOR_TRIALS
 * positions had been accepted (three of five), the first and the later
 * ones alike. */
#define ENG_SPEC_PRIOR_TRIALS 5.0
#define ENG_SPEC_PRIOR_RATE   0.6
void eng_spec_len_init(eng_spec_len *l);
/* What a new sequence's draft length starts from in one class: seen, the
 * counts of every sequence's verifications of that class (decayed as a
 * sequence's are: the engine's last few), weighing at most five positions
 * (scaled down), topped up to five at the fresh start's rate. So a server
 * whose copying answers take their 3-gram runs whole starts the next one's
 * runs long, instead of ramping up from three in five each time; one that
 * has verified nothing of the class starts fresh. */
eng_spec_len eng_spec_len_prior(const eng_spec_len *seen);
/* The acceptance rates the counts give: of the first drafted position, and
 * of a later one given the one before it. */
void eng_spec_len_rates(const eng_spec_len *l, double *first, double *next);
/* How many tokens to draft this step, at most draft_max: the length that
 * gives the step the most tokens per second, (n_decode + expected
 * accepted) / (fixed + n_decode + drafted rows + the drafter's cost of
 * them in rows), position i (from 1) accepted with probability
 * first x next^(i-1); at least one while the first is accepted more often
 * than not and the drafter's cost is under half a row (a lone row accepted
 * more often than not is nearly free at a small batch, a draft model's
 * step is not); one every ENG_SPEC_PROBE_STEPS steps while it drafts none. */
int32_t eng_spec_len_want(eng_spec_len *l, const eng_spec_cost *c, int32_t draft_max);
/* How many of a draft of `drafted` tokens to verify, made before its
 * length was chosen (the n-gram lookup's, free to make whole): what
 * eng_spec_len_want gives l (the draft's class) at most drafted, raised to
 * least (the request's least length, at most drafted) where it keeps some. */
int32_t eng_spec_len_keep(eng_spec_len *l, const eng_spec_cost *c, int32_t drafted, int32_t least);
/* After a verification of `drafted` tokens of which `accepted` were. */
void eng_spec_len_adapt(eng_spec_len *l, int32_t drafted, int32_t accepted);

#endif

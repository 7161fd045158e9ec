/*
 * drafter_internal.h - speculative decoding's drafters and the per-sequence
 * draft length (drafter.c), for scheduler.c and the tests alone.
 *
 * A drafter is a row of operations (eng_drafter_ops): given what a sequence
 * has seen (its prompt and its answer so far), propose up to max tokens
 * that may follow. The n-gram lookup is the one built; a draft model and
 * MTP heads will be rows beside it.
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

typedef struct eng_drafter eng_drafter;
typedef struct eng_drafter_ops {
    const char *name; /* as the metrics label it: "ngram" */
    /* Up to max (>= 1) tokens that may follow h into out; how many (0: no guess). */
    int32_t (*draft)(const eng_drafter *d, const eng_history *h, int32_t max, int32_t *out);
} eng_drafter_ops;

struct eng_drafter {
    const eng_drafter_ops *ops;
    eng_spec_opts o; /* resolved (eng_spec_opts_resolve) */
};

/* The drafter o names (resolved first); QL_EINVAL as eng_spec_opts_resolve. */
int eng_drafter_init(eng_drafter *d, const eng_spec_opts *o, char *msg, size_t msg_len);

/* The n-gram lookup: for n from n_max down to n_min, the latest earlier
 * place where h's last n tokens occur with at least one token after them;
 * the first n that has one gives up to max of the tokens that follow it
 * there (they may run into the matched suffix itself: a repeated run
 * drafts its own continuation). 0 when no n matches. */
int32_t eng_ngram_draft(const eng_history *h, int32_t n_min, int32_t n_max, int32_t max,
                        int32_t *out);

/* One sequence's draft length, following its acceptance. */
typedef struct eng_spec_len {
    int32_t len;  /* tokens to draft next; 0: not speculating */
    int32_t idle; /* steps since len fell to 0 */
} eng_spec_len;

/* A sequence that has not speculated for this many steps tries one token
 * again: a prompt-copying stretch may begin after a free-writing one. 16
 * steps cost at most one row in sixteen. */
#define ENG_SPEC_PROBE_STEPS 16

void eng_spec_len_init(eng_spec_len *l, int32_t draft_max);
/* How many tokens to draft this step (counting a step at 0 towards the probe). */
int32_t eng_spec_len_want(eng_spec_len *l);
/* After a verification of drafted tokens of which accepted were: all
 * accepted, one more next time (at most draft_max); some, one past what
 * was accepted; none, half as many (down to 0). */
void eng_spec_len_adapt(eng_spec_len *l, int32_t drafted, int32_t accepted, int32_t draft_max);

#endif

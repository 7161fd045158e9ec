/*
 * speculative.h - speculative decoding's part of engine/scheduler/'s public
 * interface (scheduler.h includes it; no other file need): which drafter
 * the engine runs, its sizes, what one request may ask of it, and the
 * figures /metrics and each request's usage report.
 *
 * A drafter guesses the next few tokens of a sequence cheaply; the engine
 * runs them through the model as extra rows of the sequence in the same
 * batched step as every other row, and keeps the longest run the model
 * itself would have produced (drafter.c drafts, scheduler.c verifies).
 * Greedy answers are the same tokens as without it; sampled ones keep the
 * model's distribution (scheduler.c says how).
 */
#ifndef QL_SPECULATIVE_H
#define QL_SPECULATIVE_H

#include <stdbool.h>
#include <stdint.h>

#include "ql_base.h"

/* The most tokens one sequence drafts in one step (--draft-max's bound):
 * past a dozen, even copying workloads rarely accept more, and every row
 * costs the step a row of logits. */
#define ENG_SPEC_MAX_DRAFT 16
/* The n-gram drafter's memory by default: the last few hundred answers, 2.25 MiB. */
#define ENG_SPEC_MEMORY_TOKENS 65536

typedef enum eng_speculative {
    ENG_SPEC_OFF = QL_SPEC_OFF, /* the zero value: options built by hand do not speculate */
    ENG_SPEC_NGRAM = QL_SPEC_NGRAM,
    ENG_SPEC_DRAFT = QL_SPEC_DRAFT, /* a smaller model with the same vocabulary */
    ENG_SPEC_MTP = QL_SPEC_MTP,     /* the model's own MTP layers (mtp.h), on the CPU backend */
} eng_speculative;

typedef struct eng_spec_opts {
    eng_speculative drafter;
    /* most tokens drafted per sequence per step, in [1, ENG_SPEC_MAX_DRAFT]; 0: 16 for ngram,
     * 4 for draft and mtp */
    int32_t draft_max;
    /* every drafting sequence drafts draft_max tokens each step (its request's bound, the room
     * left), as vLLM's num_speculative_tokens: the draft length's cost rule off */
    bool draft_fixed;
    /* the n-gram drafter matches the answer's last n tokens, n from ngram_max down to
     * ngram_min, in the prompt and answer before them; 0: 1 and 3 */
    int32_t ngram_min, ngram_max;
    /* the n-gram drafter's memory of earlier answers (drafts for the words answers share with
     * each other, not with their prompts), in tokens: 0 ENG_SPEC_MEMORY_TOKENS, -1 none */
    int32_t memory_tokens;
    /* no sequence speculates in a step that decodes more than this many (a large batch's step
     * is no longer bound by reading the weights, so extra rows cost time); 0: 4 */
    int32_t max_batch;
    /* the draft drafter's model (borrowed: it must outlive the engine), with the target's
     * vocabulary, and the bytes of its own KV cache (0: as many positions as the target's) */
    const struct eng_model *draft_model;
    size_t draft_kv_bytes;
} eng_spec_opts;

/* "off", "ngram", "draft", "mtp" -> *out; any other word is refused
 * naming the choices (QL_EINVAL). */
int eng_speculative_parse(const char *name, eng_speculative *out, char *msg, size_t msg_len);
/* o with its zeros replaced by the defaults, checked: an unknown drafter,
 * draft without its model, sizes out of range (named). Whether the model
 * has MTP layers is checked at the engine's start. */
int eng_spec_opts_resolve(eng_spec_opts *o, char *msg, size_t msg_len);

/* One request's say over speculation (eng_request.spec); the zero value takes the engine's. A
 * request may draft less than the engine does, never more, and never with another drafter: the
 * drafter and the rows a step holds for drafts are fixed at start. */
typedef struct eng_spec_request {
    bool off; /* draft nothing for it */
    /* most tokens drafted per step for it: 0 the engine's draft_max; else in
     * [1, ENG_SPEC_MAX_DRAFT], and bounded to the engine's draft_max */
    int32_t draft_max;
    /* a shorter draft is not verified (llama.cpp's speculative.n_min): in [0, draft_max] (0: any,
     * and at most ENG_SPEC_MAX_DRAFT when draft_max is 0); bounded with draft_max */
    int32_t draft_min;
} eng_spec_request;

/* r's bounds: QL_EINVAL naming the field and its value. */
int eng_spec_request_check(const eng_spec_request *r, char *msg, size_t msg_len);

/* What speculation did for one request (eng_usage.spec), its choices together: drafted tokens the
 * model verified (those a grammar cut not counted) and, of them, the accepted; 0 and 0 when it
 * never speculated. */
typedef struct eng_spec_usage {
    int64_t drafted, accepted; /* up to ENG_SPEC_MAX_DRAFT per generated token: past int32 */
} eng_spec_usage;

/* What speculation did (eng_engine_stats.spec), summed over the steps. */
typedef struct eng_spec_stats {
    eng_speculative drafter; /* what runs: off when asked for but refused for the model */
    char off_reason[160];    /* why it was turned off though asked for; else empty */
    uint64_t drafts;         /* verifications: a sequence's step that carried drafted tokens */
    uint64_t drafted;        /* tokens the drafter proposed */
    uint64_t verified;       /* of them, run through the model (the rest cut by a grammar) */
    uint64_t accepted;       /* of those, accepted */
    /* of the verified and the accepted, those the n-gram drafter's memory of earlier answers
     * drafted */
    uint64_t memory_verified, memory_accepted;
    /* verifications by the tokens they accepted, 0 .. ENG_SPEC_MAX_DRAFT */
    uint64_t accepted_len[ENG_SPEC_MAX_DRAFT + 1];
    /* [i]: verifications whose draft token i was accepted (vLLM's per position count) */
    uint64_t accepted_pos[ENG_SPEC_MAX_DRAFT];
} eng_spec_stats;

#endif

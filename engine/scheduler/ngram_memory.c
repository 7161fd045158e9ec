/*
 * ngram_memory.c - the n-gram drafter's memory of earlier answers
 * (internal/drafter_internal.h): the last few tens of thousands of tokens
 * the engine's answers ended with, and where each short run of them was
 * last followed by what.
 *
 * Why: answers repeat each other's words as well as their prompts'. An
 * editing assistant opens every answer with "Here is the corrected
 * paragraph:" and closes with "I made the following changes:"; a
 * summarizer's, an agent's or a form-filler's answers share their frames.
 * The prompt lookup (drafter.c) cannot guess those words the first time
 * an answer writes them; this memory can, as llama.cpp's ngram-mod and
 * lookup caches, vLLM's suffix decoding and SGLang's n-gram drafter do with
 * the text their earlier requests generated. A draft from it is verified as
 * any other, so it changes how fast an answer comes, never which tokens.
 *
 * Shape: a ring of tokens (answers in the order they ended, each followed
 * by a break that no draft crosses) and an open table, four times the ring's
 * size, from a hash of each run of ENG_NGRAM_MEMORY_MIN to _MAX tokens to
 * the ring position that followed its latest place. A slot holds one run:
 * a newer run with the same slot takes it, and a slot whose position the
 * ring has since written over is found stale by comparing the tokens, so
 * a lookup costs at most three hashes and three short compares whatever
 * the memory holds. Its size is fixed at start (--ngram-memory); the
 * engine thread alone adds and looks up, so it has no lock.
 */
#include "drafter_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Between two answers: never a token id. */
#define BREAK (-1)

struct eng_ngram_memory {
    int32_t *tok;  /* cap of them: position p (from 0, as written) at tok[p & (cap - 1)] */
    uint64_t *at;  /* 4 cap slots: 1 + the position after a run's latest place; 0 empty */
    uint64_t head; /* positions written */
    uint64_t cap;  /* a power of two */
};

int eng_ngram_memory_new(eng_ngram_memory **out, int32_t tokens, char *msg, size_t msg_len)
{
    *out = NULL;
    if (tokens < ENG_NGRAM_MEMORY_LEAST || tokens > ENG_NGRAM_MEMORY_MOST)
        return ql_fail(msg, msg_len, QL_EINVAL, "ngram-memory %d is not in [%d, %d] tokens", tokens,
                       ENG_NGRAM_MEMORY_LEAST, ENG_NGRAM_MEMORY_MOST);
    uint64_t cap = ENG_NGRAM_MEMORY_LEAST;
    while (cap < (uint64_t)tokens)
        cap <<= 1;
    eng_ngram_memory *m = calloc(1, sizeof *m);
    if (m) {
        m->tok = malloc(cap * sizeof *m->tok);
        m->at = calloc(4 * cap, sizeof *m->at);
    }
    if (!m || !m->tok || !m->at) {
        eng_ngram_memory_free(m);
        return ql_fail(msg, msg_len, QL_ENOMEM, "ngram-memory: %llu tokens: out of memory",
                       (unsigned long long)cap);
    }
    m->cap = cap;
    *out = m;
    return QL_OK;
}

void eng_ngram_memory_free(eng_ngram_memory *m)
{
    if (!m)
        return;
    free(m->tok);
    free(m->at);
    free(m);
}

/* The slot of the run of n tokens (n <= ENG_NGRAM_MEMORY_MAX). */
static uint64_t run_slot(const eng_ngram_memory *m, const int32_t *run, int32_t n)
{
    uint64_t h = (uint64_t)n * 0x9e3779b97f4a7c15ull;
    for (int32_t i = 0; i < n; i++) {
        h ^= (uint32_t)run[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    return h & (4 * m->cap - 1);
}

/* The n ring tokens from position p into run. */
static void ring_run(const eng_ngram_memory *m, uint64_t p, int32_t n, int32_t *run)
{
    for (int32_t i = 0; i < n; i++)
        run[i] = m->tok[(p + (uint64_t)i) & (m->cap - 1)];
}

void eng_ngram_memory_add(eng_ngram_memory *m, const int32_t *tokens, int32_t n)
{
    if (!m || n <= 0)
        return;
    uint64_t mask = m->cap - 1, start = m->head;
    for (int32_t i = 0; i < n; i++) {
        m->tok[m->head & mask] = tokens[i];
        m->head++;
        /* the runs that end just before this token now have their follower */
        for (int32_t len = ENG_NGRAM_MEMORY_MIN; len <= ENG_NGRAM_MEMORY_MAX; len++) {
            if (m->head - 1 - start < (uint64_t)len)
                break;
            int32_t run[ENG_NGRAM_MEMORY_MAX];
            ring_run(m, m->head - 1 - (uint64_t)len, len, run);
            m->at[run_slot(m, run, len)] = m->head; /* 1 + the follower's position */
        }
    }
    m->tok[m->head & mask] = BREAK;
    m->head++;
}

int32_t eng_ngram_memory_draft(const eng_ngram_memory *m, const eng_history *h, int32_t shorter,
                               int32_t max, int32_t *out, int32_t *matched)
{
    *matched = 0;
    if (!m || max <= 0)
        return 0;
    /* h's last tokens, up to the longest run looked up: the run of n is its last n */
    int32_t total = h->n_prompt + h->n_answer, last[ENG_NGRAM_MEMORY_MAX];
    int32_t have = total < ENG_NGRAM_MEMORY_MAX ? total : ENG_NGRAM_MEMORY_MAX;
    for (int32_t i = 0; i < have; i++)
        last[i] = eng_history_at(h, total - have + i);
    int32_t least = shorter + 1 > ENG_NGRAM_MEMORY_MIN ? shorter + 1 : ENG_NGRAM_MEMORY_MIN;
    for (int32_t n = have; n >= least; n--) {
        const int32_t *tail = last + have - n;
        int32_t run[ENG_NGRAM_MEMORY_MAX];
        uint64_t v = m->at[run_slot(m, tail, n)];
        if (v == 0)
            continue;
        uint64_t next = v - 1; /* the follower of the run's latest place */
        /* the run must still be in the ring and be this one (a slot is shared, the ring wraps) */
        if (next < (uint64_t)n || next >= m->head || m->head - (next - (uint64_t)n) > m->cap)
            continue;
        ring_run(m, next - (uint64_t)n, n, run);
        if (memcmp(run, tail, (size_t)n * sizeof *run) != 0)
            continue;
        int32_t k = 0;
        for (uint64_t p = next; p < m->head && k < max; p++) {
            int32_t tok = m->tok[p & (m->cap - 1)];
            if (tok == BREAK)
                break;
            out[k++] = tok;
        }
        if (k == 0)
            continue;
        *matched = n;
        return k;
    }
    return 0;
}

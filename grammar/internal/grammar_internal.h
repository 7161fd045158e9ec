/*
 * grammar_internal.h - the compiled form of a grammar, shared by
 * builder.c (which writes it) and matcher.c (which walks it); nothing
 * outside grammar/ sees it.
 *
 * A grammar is rules; rule r's alternatives are alts[first_alt ..
 * first_alt + n_alts), each the index of its first element; an
 * alternative's elements run to a GR_E_END. Rule 0 is the root: the
 * whole answer.
 */
#ifndef QL_GRAMMAR_INTERNAL_H
#define QL_GRAMMAR_INTERNAL_H

#include "grammar.h"

#include <pthread.h>
#include <stdlib.h>

/* Grow *p (*cap elements of elem bytes held) to hold at least need,
 * doubling from 64; false when out of memory (*p as it was). */
static inline bool gr_grow(void **p, size_t need, size_t *cap, size_t elem)
{
    if (need <= *cap)
        return true;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need)
        cap2 *= 2;
    void *q = realloc(*p, cap2 * elem);
    if (!q)
        return false;
    *p = q;
    *cap = cap2;
    return true;
}

/* A set of bytes: bit c of bits[c / 32]. */
typedef struct gr_set {
    uint32_t bits[8];
} gr_set;

static inline bool gr_set_has(const gr_set *s, uint8_t c)
{
    return (s->bits[c >> 5] >> (c & 31)) & 1u;
}

enum {
    GR_E_END, /* the alternative is whole */
    GR_E_SET, /* read one byte of sets[arg] */
    GR_E_REF, /* call rule arg */
};

typedef struct gr_elem {
    uint8_t kind;
    int32_t arg;
} gr_elem;

typedef struct gr_rule_info {
    int32_t first_alt, n_alts;
    int32_t name; /* offset into names; -1 for a rule the lowering made */
} gr_rule_info;

/* Masks shared by every matcher of one grammar (matcher.c): a state's
 * mask depends only on its stacks' positions, not on which matcher holds
 * it, so sequences of one schema in a batch, and later requests with the
 * same cached grammar, walk the vocabulary once per state between them. */
typedef struct gr_shared_masks gr_shared_masks;

/* Free g whole (grammar.c): its last reference is gone, or gr_build failed. */
void gr_grammar_destroy(gr_grammar *g);
/* The shared mask of the state whose signature is sig[0..sig_len) under
 * vocabulary uid vocab (hash h of both), copied into mask (words long):
 * false when none is kept. gr_shared_put keeps a copy (quietly nothing
 * when out of memory: the table is only a cache). */
bool gr_shared_get(gr_grammar *g, uint64_t vocab, const uint32_t *sig, size_t sig_len, uint64_t h,
                   uint32_t *mask, size_t words);
void gr_shared_put(gr_grammar *g, uint64_t vocab, const uint32_t *sig, size_t sig_len, uint64_t h,
                   const uint32_t *mask, size_t words);

struct gr_grammar {
    int refs;
    pthread_mutex_t masks_mu; /* guards masks */
    gr_shared_masks *masks;   /* made on first use; NULL before */
    gr_elem *elems;
    size_t n_elems;
    int32_t *alts;
    size_t n_alts;
    gr_rule_info *rules;
    size_t n_rules;
    gr_set *sets;
    size_t n_sets;
    char *names; /* the named rules' names, NUL-separated */
};

/* For tests: the bytes past which the matcher drops its memos (matcher.c;
 * GR_MATCHER_MAX_BYTES otherwise), and how often it has. */
void gr_matcher_set_memory_bound(gr_matcher *m, size_t bytes);
uint64_t gr_matcher_compactions(const gr_matcher *m);
/* For tests: how many masks this matcher took from its grammar's shared
 * table rather than walking the vocabulary. */
uint64_t gr_matcher_shared_hits(const gr_matcher *m);
/* For tests: the bytes every grammar's shared masks may keep together
 * (grammar.c; GR_SHARED_TOTAL_MAX_BYTES otherwise), and what they keep. */
void gr_shared_set_total_bound(size_t bytes);
size_t gr_shared_total_bytes(void);
/* For tests: the texts a cache keeps (cache.c). */
size_t gr_cache_entries(gr_cache *c);

#endif

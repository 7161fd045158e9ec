/*
 * grammar.c - a compiled grammar's life: its references (atomic: any
 * thread), its end, and the masks its matchers share.
 *
 * A state's mask depends only on its stacks' positions, not on which
 * matcher holds the state, so the grammar keeps each mask made under that
 * signature and the vocabulary's uid (never its address, which a later
 * vocabulary may reuse): every sequence of one schema, in one batch or in
 * later requests through the server's grammar cache, walks the vocabulary
 * once per state between them. The table is open addressing under the
 * grammar's mutex, and is emptied whole when it would pass
 * GR_SHARED_MAX_BYTES, or when every grammar's tables together would pass
 * GR_SHARED_TOTAL_MAX_BYTES (each matcher keeps its own copies
 * meanwhile).
 *
 * Owns gr_grammar's memory and its shared masks; builder.c makes
 * grammars, matcher.c reads and fills the masks. Touches nothing else.
 */
#include "internal/grammar_internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct shared_entry {
    uint64_t hash;
    uint64_t vocab; /* its uid */
    uint32_t *sig;  /* owned */
    size_t sig_len;
    uint32_t *mask; /* owned: the vocabulary's words */
} shared_entry;

struct gr_shared_masks {
    shared_entry *slots; /* open addressing; sig NULL: empty */
    size_t cap, n, bytes;
};

/* Past this many bytes of one grammar's shared masks the table is
 * emptied and filled again (each matcher keeps its own copies). */
#define GR_SHARED_MAX_BYTES ((size_t)64 << 20)
/* Every grammar's shared masks together (the server's cache holds 64
 * grammars) keep at most this many bytes: past it, the grammar keeping
 * one more empties its own table first, and keeps nothing while the
 * others hold the rest. */
#define GR_SHARED_TOTAL_MAX_BYTES ((size_t)256 << 20)

static size_t shared_total;                                 /* atomic */
static size_t shared_total_max = GR_SHARED_TOTAL_MAX_BYTES; /* lower in tests */

/* bytes taken from the process's budget; false (nothing taken) when they
 * would pass it. */
static bool budget_take(size_t bytes)
{
    size_t max = __atomic_load_n(&shared_total_max, __ATOMIC_RELAXED);
    if (__atomic_add_fetch(&shared_total, bytes, __ATOMIC_RELAXED) <= max)
        return true;
    __atomic_sub_fetch(&shared_total, bytes, __ATOMIC_RELAXED);
    return false;
}

void gr_shared_set_total_bound(size_t bytes)
{
    __atomic_store_n(&shared_total_max, bytes, __ATOMIC_RELAXED);
}

size_t gr_shared_total_bytes(void)
{
    return __atomic_load_n(&shared_total, __ATOMIC_RELAXED);
}

static void shared_masks_free(gr_shared_masks *c)
{
    if (!c)
        return;
    __atomic_sub_fetch(&shared_total, c->bytes, __ATOMIC_RELAXED);
    for (size_t i = 0; i < c->cap; i++) {
        free(c->slots[i].sig);
        free(c->slots[i].mask);
    }
    free(c->slots);
    free(c);
}

void gr_grammar_destroy(gr_grammar *g)
{
    if (!g)
        return;
    free(g->elems);
    free(g->alts);
    free(g->rules);
    free(g->sets);
    free(g->names);
    shared_masks_free(g->masks);
    pthread_mutex_destroy(&g->masks_mu);
    free(g);
}

gr_grammar *gr_grammar_ref(gr_grammar *g)
{
    if (g)
        __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
    return g;
}

void gr_grammar_unref(gr_grammar *g)
{
    if (g && __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) == 0)
        gr_grammar_destroy(g);
}

size_t gr_grammar_size(const gr_grammar *g)
{
    return g ? g->n_elems : 0;
}

/* The shared mask for sig, copied into mask; false when none. */
bool gr_shared_get(gr_grammar *g, uint64_t vocab, const uint32_t *sig, size_t sig_len, uint64_t h,
                   uint32_t *mask, size_t words)
{
    bool found = false;
    pthread_mutex_lock(&g->masks_mu);
    const gr_shared_masks *c = g->masks;
    for (size_t i = c ? h & (c->cap - 1) : 0; c && c->slots[i].sig; i = (i + 1) & (c->cap - 1)) {
        const shared_entry *e = &c->slots[i];
        if (e->hash == h && e->vocab == vocab && e->sig_len == sig_len &&
            memcmp(e->sig, sig, sig_len * sizeof *sig) == 0) {
            memcpy(mask, e->mask, words * sizeof *mask);
            found = true;
            break;
        }
    }
    pthread_mutex_unlock(&g->masks_mu);
    return found;
}

/* An empty table of cap slots (a power of two); NULL when out of memory. */
static gr_shared_masks *shared_new(size_t cap)
{
    gr_shared_masks *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->slots = calloc(cap, sizeof *c->slots);
    if (!c->slots) {
        free(c);
        return NULL;
    }
    c->cap = cap;
    return c;
}

/* e into the first empty slot of its probe sequence (one is free). */
static void shared_place(gr_shared_masks *c, shared_entry e)
{
    size_t k = e.hash & (c->cap - 1);
    while (c->slots[k].sig)
        k = (k + 1) & (c->cap - 1);
    c->slots[k] = e;
}

/* Room for one more entry of bytes in g->masks, the bytes taken from the
 * process's budget: a first table, an emptied one when they would pass
 * the grammar's bound or the budget, or one twice as large with the same
 * entries; false when out of memory or budget (nothing taken). */
static bool shared_room(gr_grammar *g, size_t bytes)
{
    gr_shared_masks *c = g->masks, *n;
    bool taken = budget_take(bytes);
    if (!c || !taken || c->bytes + bytes > GR_SHARED_MAX_BYTES) { /* start over: bounded */
        if (!(n = shared_new(1024)))
            goto refused;
        shared_masks_free(c); /* its bytes back to the budget */
        g->masks = n;
        return taken || budget_take(bytes);
    }
    if ((c->n + 1) * 2 <= c->cap)
        return true;
    if (!(n = shared_new(c->cap * 2))) /* grow: the entries move */
        goto refused;
    for (size_t i = 0; i < c->cap; i++)
        if (c->slots[i].sig)
            shared_place(n, c->slots[i]);
    n->n = c->n;
    n->bytes = c->bytes;
    free(c->slots);
    free(c);
    g->masks = n;
    return true;
refused:
    if (taken)
        __atomic_sub_fetch(&shared_total, bytes, __ATOMIC_RELAXED);
    return false;
}

/* Keep a copy of mask under sig; quietly nothing when out of memory (the
 * table is only a cache). */
void gr_shared_put(gr_grammar *g, uint64_t vocab, const uint32_t *sig, size_t sig_len, uint64_t h,
                   const uint32_t *mask, size_t words)
{
    uint32_t *sig_copy = malloc(sig_len * sizeof *sig_copy),
             *mask_copy = malloc(words * sizeof *mask_copy);
    if (!sig_copy || !mask_copy) {
        free(sig_copy);
        free(mask_copy);
        return;
    }
    memcpy(sig_copy, sig, sig_len * sizeof *sig_copy);
    memcpy(mask_copy, mask, words * sizeof *mask_copy);
    size_t bytes = (sig_len + words) * sizeof(uint32_t) + sizeof(shared_entry);
    pthread_mutex_lock(&g->masks_mu);
    bool ok = shared_room(g, bytes);
    if (ok) {
        shared_place(g->masks, (shared_entry){h, vocab, sig_copy, sig_len, mask_copy});
        g->masks->n++;
        g->masks->bytes += bytes;
    }
    pthread_mutex_unlock(&g->masks_mu);
    if (!ok) {
        free(sig_copy);
        free(mask_copy);
    }
}

/*
 * cache.c - a grammar from its text in one call (gr_compile, through the
 * compiler its kind names), and the cache that compiles each text once.
 *
 * Requests of one client tend to send one schema again and again; a
 * compile is milliseconds for a typical schema but bounded only by the
 * builder's node bound, so the server keeps the last few dozen grammars
 * by kind and text, least recently used dropped. Owns gr_cache.
 */
#include "internal/grammar_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

int gr_compile(gr_kind kind, const char *text, size_t len, size_t max_nodes, gr_grammar **out,
               char *msg, size_t msg_len)
{
    *out = NULL;
    gr_builder *b = gr_builder_new(max_nodes);
    if (!b)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for a grammar builder");
    gr_expr root = -1;
    int rc = kind == GR_REGEX ? gr_from_regex(b, text, len, &root, msg, msg_len)
                              : gr_from_json_schema(b, text, len, &root, msg, msg_len);
    if (rc == QL_OK)
        rc = gr_build(b, root, out, msg, msg_len);
    gr_builder_free(b);
    return rc;
}

/* --- the cache ----------------------------------------------------------------- */

typedef struct cache_entry {
    gr_kind kind;
    char *text;
    size_t len;
    gr_grammar *g;
    uint64_t used; /* the cache's clock at its last get */
} cache_entry;

struct gr_cache {
    pthread_mutex_t mu;
    cache_entry *entries;
    size_t n, max;
    size_t max_nodes;
    uint64_t clock;
};

gr_cache *gr_cache_new(size_t max_entries, size_t max_nodes)
{
    gr_cache *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->max = max_entries ? max_entries : 1;
    c->max_nodes = max_nodes;
    c->entries = calloc(c->max, sizeof *c->entries);
    if (!c->entries) {
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

void gr_cache_free(gr_cache *c)
{
    if (!c)
        return;
    for (size_t i = 0; i < c->n; i++) {
        free(c->entries[i].text);
        gr_grammar_unref(c->entries[i].g);
    }
    free(c->entries);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* The entry for kind and text (the lock held), or NULL. */
static cache_entry *entry_of(gr_cache *c, gr_kind kind, const char *text, size_t len)
{
    for (size_t i = 0; i < c->n; i++) {
        cache_entry *e = &c->entries[i];
        if (e->kind == kind && e->len == len && memcmp(e->text, text, len) == 0)
            return e;
    }
    return NULL;
}

/* The grammar kept for kind and text, with a reference for the caller;
 * NULL. */
static gr_grammar *cache_find(gr_cache *c, gr_kind kind, const char *text, size_t len)
{
    pthread_mutex_lock(&c->mu);
    cache_entry *e = entry_of(c, kind, text, len);
    if (e)
        e->used = ++c->clock;
    gr_grammar *g = e ? gr_grammar_ref(e->g) : NULL;
    pthread_mutex_unlock(&c->mu);
    return g;
}

/* Keep g under kind and text (the least recently used entry makes room),
 * unless another thread kept its own compile of the text meanwhile; a
 * copy of the text fails quietly: the cache is only a cache. */
static void cache_put(gr_cache *c, gr_kind kind, const char *text, size_t len, gr_grammar *g)
{
    char *copy = malloc(len + 1);
    if (!copy)
        return;
    memcpy(copy, text, len);
    copy[len] = 0;
    pthread_mutex_lock(&c->mu);
    if (entry_of(c, kind, text, len)) {
        pthread_mutex_unlock(&c->mu);
        free(copy);
        return;
    }
    size_t at = c->n;
    if (c->n == c->max) {
        at = 0;
        for (size_t i = 1; i < c->n; i++)
            if (c->entries[i].used < c->entries[at].used)
                at = i;
        free(c->entries[at].text);
        gr_grammar_unref(c->entries[at].g);
    } else
        c->n++;
    c->entries[at] = (cache_entry){kind, copy, len, gr_grammar_ref(g), ++c->clock};
    pthread_mutex_unlock(&c->mu);
}

int gr_cache_get(gr_cache *c, gr_kind kind, const char *text, size_t len, gr_grammar **out,
                 char *msg, size_t msg_len)
{
    *out = cache_find(c, kind, text, len);
    if (*out)
        return QL_OK;
    /* compiled outside the lock: two threads asking for one new text at
     * once both compile it, both results are right, and the first kept
     * stays the cache's */
    int rc = gr_compile(kind, text, len, c->max_nodes, out, msg, msg_len);
    if (rc == QL_OK)
        cache_put(c, kind, text, len, *out);
    return rc;
}

size_t gr_cache_entries(gr_cache *c)
{
    pthread_mutex_lock(&c->mu);
    size_t n = c->n;
    pthread_mutex_unlock(&c->mu);
    return n;
}

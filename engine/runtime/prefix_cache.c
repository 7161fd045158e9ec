/*
 * prefix_cache.c - the prefix cache: full KV blocks of prompts, found again
 * by their content, so a request whose prompt begins as an earlier one's
 * (a shared system prompt, a chat's earlier turns, the same prompt asked
 * again) starts past that prefix instead of computing it anew.
 *
 * What a block holds depends on every token before it and on the weights
 * and adapters that computed it, so a block is named by a chain: the
 * configuration key the scheduler gives (the weight version and the
 * adapters applied unmerged, with their scales), the block before it, and
 * its own tokens. A lookup hashes that chain; a hit is then checked in
 * full (the key, the very block before it by number and generation, every
 * token), so a hash collision can never hand out another prompt's keys and
 * values: only a key collision could, with the odds of the weights digest.
 *
 * The cache holds no reference: a kept block lives in the KV cache's free
 * queue, at its tail (kv_cache.c), counted free. Blocks nothing keeps are
 * taken first, then kept ones least recently freed first; a kept block is
 * forgotten the moment it is taken to be written (kv_prefix_forget). So
 * the cache costs no memory a request could use, and eviction is least
 * recently used by construction. A hit takes the block back off the queue
 * (or one more reference when a running sequence has it too).
 *
 * It offers eng_kv_prefix_* (runtime.h) and the kv_prefix_* hooks of
 * kv_cache_internal.h; it owns the index (per block: its chain hash, key,
 * parent, generation and tokens; buckets by hash). Engine thread only, as
 * the rest of the KV cache.
 */
#include "internal/kv_cache_internal.h"
#include "runtime.h"

#include <stdlib.h>
#include <string.h>

struct kv_prefix {
    int32_t *bucket; /* n_buckets heads of chains through next; -1 ends */
    uint32_t mask;   /* n_buckets - 1 */
    int32_t *next;   /* per block: the next kept block of its bucket */
    uint64_t *hash;  /* per block: its chain hash */
    uint64_t *key;   /* per block: the configuration it was computed under */
    int32_t *parent; /* per block: the block before it (-1: the first) */
    uint64_t *parent_gen;
    uint64_t *gen;   /* per block: nonzero while kept, new at each keeping */
    int32_t *tokens; /* per block: its block_tokens token ids */
    uint64_t next_gen;
    int32_t n_kept;
};

void kv_prefix_free(struct kv_prefix *p)
{
    if (!p)
        return;
    free(p->bucket);
    free(p->next);
    free(p->hash);
    free(p->key);
    free(p->parent);
    free(p->parent_gen);
    free(p->gen);
    free(p->tokens);
    free(p);
}

int eng_kv_prefix_enable(eng_kv_cache *kv, char *msg, size_t msg_len)
{
    if (kv->prefix)
        return QL_OK;
    size_t n = (size_t)kv->n_blocks, buckets = 16;
    while (buckets < 2 * n)
        buckets *= 2;
    struct kv_prefix *p = calloc(1, sizeof *p);
    if (p) {
        p->bucket = malloc(buckets * sizeof *p->bucket);
        p->next = malloc(n * sizeof *p->next);
        p->hash = malloc(n * sizeof *p->hash);
        p->key = malloc(n * sizeof *p->key);
        p->parent = malloc(n * sizeof *p->parent);
        p->parent_gen = malloc(n * sizeof *p->parent_gen);
        p->gen = calloc(n, sizeof *p->gen);
        p->tokens = malloc(n * (size_t)kv->block_tokens * sizeof *p->tokens);
    }
    if (!p || !p->bucket || !p->next || !p->hash || !p->key || !p->parent || !p->parent_gen ||
        !p->gen || !p->tokens) {
        kv_prefix_free(p);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the prefix cache of %zu blocks",
                       n);
    }
    for (size_t i = 0; i < buckets; i++)
        p->bucket[i] = -1;
    p->mask = (uint32_t)(buckets - 1);
    p->next_gen = 1;
    kv->prefix = p;
    return QL_OK;
}

int32_t eng_kv_prefix_blocks(const eng_kv_cache *kv)
{
    return kv->prefix ? kv->prefix->n_kept : 0;
}

/* splitmix64's finalizer: every input bit reaches every output bit. */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* The chain hash of a block of n tokens after a block hashed h. */
static uint64_t chain_hash(uint64_t h, const int32_t *tokens, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        h = mix64(h ^ (uint32_t)tokens[i]) + 0x9e3779b97f4a7c15ULL;
    return mix64(h);
}

bool kv_prefix_keeps(const eng_kv_cache *kv, int32_t b)
{
    return kv->prefix->gen[b] != 0;
}

void kv_prefix_forget(eng_kv_cache *kv, int32_t b)
{
    struct kv_prefix *p = kv->prefix;
    if (!p->gen[b])
        return;
    int32_t *pp = &p->bucket[p->hash[b] & p->mask];
    while (*pp != b)
        pp = &p->next[*pp];
    *pp = p->next[b];
    p->gen[b] = 0;
    p->n_kept--;
}

/* The kept block continuing chain c with these tokens, or -1. */
static int32_t find(const eng_kv_cache *kv, uint64_t key, uint64_t h, const eng_prefix_chain *c,
                    const int32_t *tokens)
{
    const struct kv_prefix *p = kv->prefix;
    size_t bt = (size_t)kv->block_tokens;
    for (int32_t b = p->bucket[h & p->mask]; b >= 0; b = p->next[b])
        if (p->hash[b] == h && p->key[b] == key && p->parent[b] == c->block &&
            p->parent_gen[b] == c->gen &&
            memcmp(p->tokens + (size_t)b * bt, tokens, bt * sizeof *tokens) == 0)
            return b;
    return -1;
}

/* After the whole blocks of chain c: a kept block no table holds that
 * continues c and begins with the most of tokens[0, max_tokens), at most
 * a block less one, becomes s's next block, its first positions reused
 * (the next turn of a chat shares the system prompt and the turn's
 * opening with the kept block of the turn before, but not the whole
 * block). It leaves the prefix cache, since s writes its later positions
 * over another prompt's: when s fills it, it is kept again under s's
 * tokens. Returns the positions reused, 0 for none. Blocks are scanned,
 * not indexed: once per admission, and fewer than the cache's blocks. */
static int32_t match_partial(eng_kv_cache *kv, uint64_t key, const int32_t *tokens,
                             int32_t max_tokens, eng_seq_kv *s, const eng_prefix_chain *c)
{
    const struct kv_prefix *p = kv->prefix;
    int32_t bt = kv->block_tokens, best = -1, best_len = 0;
    if (max_tokens > bt - 1)
        max_tokens = bt - 1;
    for (int32_t b = 0; b < kv->n_blocks && best_len < max_tokens; b++) {
        if (!p->gen[b] || kv->refs[b] != 0 || p->key[b] != key || p->parent[b] != c->block ||
            p->parent_gen[b] != c->gen)
            continue;
        const int32_t *kept = p->tokens + (size_t)b * (size_t)bt;
        int32_t same = 0;
        while (same < max_tokens && kept[same] == tokens[same])
            same++;
        if (same > best_len) {
            best = b;
            best_len = same;
        }
    }
    if (best < 0)
        return 0;
    kv_prefix_forget(kv, best);
    kv_take_block(kv, best);
    s->blocks[s->n_blocks++] = best;
    return best_len;
}

int32_t eng_kv_prefix_match(eng_kv_cache *kv, uint64_t key, const int32_t *tokens,
                            int32_t max_tokens, eng_seq_kv *s, eng_prefix_chain *chain)
{
    *chain = (eng_prefix_chain){.hash = key, .block = -1};
    if (!kv->prefix || s->n_blocks != 0 || s->n_tokens != 0)
        return 0;
    int32_t bt = kv->block_tokens, n = max_tokens / bt;
    if (max_tokens <= 0 || !kv_grow_list(&s->blocks, n + 1))
        return 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t *t = tokens + (size_t)i * (size_t)bt;
        uint64_t h = chain_hash(chain->hash, t, bt);
        int32_t b = find(kv, key, h, chain, t);
        if (b < 0)
            break;
        kv_take_block(kv, b);
        s->blocks[s->n_blocks++] = b;
        *chain =
            (eng_prefix_chain){.hash = h, .block = b, .gen = kv->prefix->gen[b], .n_blocks = i + 1};
    }
    s->n_tokens = s->n_blocks * bt + match_partial(kv, key, tokens + (size_t)s->n_blocks * bt,
                                                   max_tokens - s->n_blocks * bt, s, chain);
    return s->n_tokens;
}

void eng_kv_prefix_insert(eng_kv_cache *kv, uint64_t key, const int32_t *tokens, int32_t n_tokens,
                          const eng_seq_kv *s, eng_prefix_chain *chain)
{
    struct kv_prefix *p = kv->prefix;
    if (!p)
        return;
    int32_t bt = kv->block_tokens, full = n_tokens / bt;
    if (full > s->n_blocks)
        full = s->n_blocks;
    if (chain->n_blocks == 0) /* a zeroed chain: nothing kept yet */
        *chain = (eng_prefix_chain){.hash = key, .block = -1};
    for (int32_t i = chain->n_blocks; i < full; i++) {
        const int32_t *t = tokens + (size_t)i * (size_t)bt;
        uint64_t h = chain_hash(chain->hash, t, bt);
        /* the same content kept already (two requests computed it at
         * once): the chain goes on through that one */
        int32_t b = find(kv, key, h, chain, t);
        if (b < 0) {
            b = s->blocks[i];
            if (p->gen[b]) /* kept under another chain: a block is kept once */
                kv_prefix_forget(kv, b);
            p->hash[b] = h;
            p->key[b] = key;
            p->parent[b] = chain->block;
            p->parent_gen[b] = chain->gen;
            p->gen[b] = p->next_gen++;
            memcpy(p->tokens + (size_t)b * (size_t)bt, t, (size_t)bt * sizeof *t);
            uint32_t at = (uint32_t)(h & p->mask);
            p->next[b] = p->bucket[at];
            p->bucket[at] = b;
            p->n_kept++;
        }
        *chain = (eng_prefix_chain){.hash = h, .block = b, .gen = p->gen[b], .n_blocks = i + 1};
    }
}

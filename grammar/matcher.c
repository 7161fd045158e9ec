/*
 * matcher.c - decoding under a grammar: which tokens may come next, and
 * the walk through the grammar as tokens are chosen.
 *
 * Where a parse may be is a set of stacks, as in llama.cpp's GBNF
 * sampler: each stack's top is an element that reads a byte (GR_E_SET),
 * and below it the positions to return to once the rules called are
 * whole. A byte advances every stack whose top reads it; the advanced
 * position is then closed: a call pushes the callee's alternatives (the
 * return position below them, unless the call ends its alternative, so
 * that repetition S ::= x S runs in constant stack), the end of an
 * alternative pops to the return position below, and the end of the root
 * makes the state accepting. Stacks are persistent: a stack entry is a
 * (position, entry below) pair interned in a hash table, so two stacks
 * that agree below share it, the same stack always has the same id, and
 * a set of stacks is a sorted list of ids: a state, interned too. Equal
 * states are then one id, which makes two memos exact and cheap:
 *   - per state, its transition by each byte (256 ids, made on first
 *     use), so walking a byte the state has seen is one load;
 *   - per state, its mask over the vocabulary (one bit per token): since
 *     a mask depends only on the state's stack positions, the grammar
 *     keeps every mask made under that signature (grammar.c), and any
 *     matcher of the grammar meeting the state again (this one, or
 *     another sequence's) copies it rather than walk the vocabulary. A
 *     matcher holds only its current state's mask, so its memory does not
 *     grow with the masks of a long answer.
 *
 * A mask is made by walking the vocabulary as a trie of the tokens'
 * bytes (gr_vocab: its nodes in depth-first order, each with the index
 * past its subtree): the state after a node's bytes is the transition
 * of its parent's state by the node's byte, and a dead state skips the
 * whole subtree, so a step visits only prefixes the grammar allows
 * rather than every byte of every token. End-of-sequence is allowed
 * exactly where the state accepts; a token of no bytes never is.
 *
 * Memory is bounded per matcher (GR_MATCHER_MAX_BYTES): past it, the
 * memos are dropped and only the current state's stacks are copied into
 * fresh tables, so a long answer through a large grammar costs time,
 * never unbounded memory. A grammar so ambiguous that one state would
 * hold more than GR_MAX_STACKS stacks, or one transition would take
 * more than GR_MAX_CLOSURE steps, stops the matcher with QL_EINVAL.
 *
 * Time is counted in matcher steps (a work item of a closure, a stack
 * tested against a byte, a trie node walked), against the budget its
 * caller gives (none by default): an engine gives each request
 * gr_vocab_step_budget per step, so an ambiguous grammar ends its request
 * after that much work instead of stalling everyone's steps.
 *
 * Owns gr_vocab and gr_matcher, and gr_grammar_accepts.
 */
#include "internal/grammar_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GR_MATCHER_MAX_BYTES ((size_t)32 << 20)
#define GR_MAX_STACKS        4096
#define GR_MAX_CLOSURE       1000000
/* Tokens longer than this (none in real vocabularies, whose longest are
 * a few hundred bytes of spaces) are never allowed under a grammar. */
#define GR_MAX_TOKEN_BYTES 1024

enum { UNKNOWN = -2, DEAD = -1 };

/* What stopped a matcher: memory ran out (QL_ENOMEM), or the grammar
 * asked more than a bound or the caller's budget allows (QL_EINVAL). */
typedef enum stop_reason { STOP_MEMORY, STOP_STACKS, STOP_CLOSURE, STOP_BUDGET } stop_reason;

/* --- the vocabulary trie -------------------------------------------------------- */

struct gr_vocab {
    uint64_t uid; /* never reused: what shared masks are keyed on, not the address */
    int32_t n_tokens, eos;
    int32_t n_nodes, max_depth;
    uint8_t *byte;      /* per node: the byte it adds */
    uint16_t *depth;    /* per node: its bytes' count, 1.. */
    int32_t *skip;      /* per node: the first node after its subtree */
    int32_t *tok_first; /* per node: ids[tok_first ..] end here; -1: none */
    uint16_t *tok_count;
    int32_t *ids;    /* the tokens with bytes, sorted by them */
    uint8_t *pool;   /* every token's bytes */
    size_t *tok_off; /* per token: its bytes in pool */
    uint32_t *tok_len;
};

typedef struct sorted_token {
    const uint8_t *s;
    size_t n;
    int32_t id;
} sorted_token;

static int cmp_token(const void *a, const void *b)
{
    const sorted_token *x = a, *y = b;
    size_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->s, y->s, n);
    if (c)
        return c;
    if (x->n != y->n)
        return x->n < y->n ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void gr_vocab_free(gr_vocab *v)
{
    if (!v)
        return;
    free(v->byte);
    free(v->depth);
    free(v->skip);
    free(v->tok_first);
    free(v->tok_count);
    free(v->ids);
    free(v->pool);
    free(v->tok_off);
    free(v->tok_len);
    free(v);
}

/* The trie of the sorted tokens t[0..n): a node per byte past the
 * prefix each shares with the one before. */
static int build_trie(gr_vocab *v, const sorted_token *t, size_t n, size_t total)
{
    v->byte = malloc(total + 1);
    v->depth = malloc((total + 1) * sizeof *v->depth);
    v->skip = malloc((total + 1) * sizeof *v->skip);
    v->tok_first = malloc((total + 1) * sizeof *v->tok_first);
    v->tok_count = calloc(total + 1, sizeof *v->tok_count);
    int32_t *open = malloc((GR_MAX_TOKEN_BYTES + 1) * sizeof *open); /* node at each depth */
    if (!v->byte || !v->depth || !v->skip || !v->tok_first || !v->tok_count || !open) {
        free(open);
        return QL_ENOMEM;
    }
    int32_t nn = 0;
    for (size_t i = 0; i < n; i++) {
        size_t lcp = 0;
        if (i > 0)
            while (lcp < t[i].n && lcp < t[i - 1].n && t[i].s[lcp] == t[i - 1].s[lcp])
                lcp++;
        for (size_t d = lcp; d < t[i].n; d++) {
            v->byte[nn] = t[i].s[d];
            v->depth[nn] = (uint16_t)(d + 1);
            v->tok_first[nn] = -1;
            open[d + 1] = nn++;
        }
        int32_t end = open[t[i].n];
        if (v->tok_first[end] < 0)
            v->tok_first[end] = (int32_t)i;
        v->tok_count[end]++;
        v->ids[i] = t[i].id;
        if ((int32_t)t[i].n > v->max_depth)
            v->max_depth = (int32_t)t[i].n;
    }
    v->n_nodes = nn;
    /* skip: the first later node no deeper than this one */
    int32_t n_open = 0;
    for (int32_t j = 0; j <= nn; j++) {
        int depth = j < nn ? v->depth[j] : 0;
        while (n_open && v->depth[open[n_open - 1]] >= depth)
            v->skip[open[--n_open]] = j;
        if (j < nn)
            open[n_open++] = j;
    }
    free(open);
    return QL_OK;
}

/* Token id's bytes appended to v->pool (grown as needed, *cap its size)
 * at *used; their count, or 0 when it has none or more than
 * GR_MAX_TOKEN_BYTES (never allowed); -1 when out of memory. */
static long pool_token(gr_vocab *v, size_t *cap, size_t *used, int32_t id,
                       gr_token_bytes_fn token_bytes, void *user)
{
    if (*used + GR_MAX_TOKEN_BYTES > *cap) {
        uint8_t *p = realloc(v->pool, *cap * 2);
        if (!p)
            return -1;
        v->pool = p;
        *cap *= 2;
    }
    long k = token_bytes(user, id, v->pool + *used, GR_MAX_TOKEN_BYTES);
    if (k <= 0 || k > GR_MAX_TOKEN_BYTES)
        return 0;
    v->tok_off[id] = *used;
    v->tok_len[id] = (uint32_t)k;
    *used += (size_t)k;
    return k;
}

int64_t gr_vocab_step_budget(const gr_vocab *v)
{
    int64_t nodes = v->n_nodes > GR_STEP_MIN_NODES ? v->n_nodes : GR_STEP_MIN_NODES;
    return GR_STEP_WALKS * nodes;
}

int gr_vocab_new(gr_vocab **out, int32_t n_tokens, gr_token_bytes_fn token_bytes, void *user,
                 int32_t eos, char *msg, size_t msg_len)
{
    *out = NULL;
    if (n_tokens <= 0 || eos >= n_tokens)
        return ql_fail(msg, msg_len, QL_EINVAL, "a vocabulary of %d tokens with end token %d",
                       n_tokens, eos);
    gr_vocab *v = calloc(1, sizeof *v);
    sorted_token *t = malloc((size_t)n_tokens * sizeof *t);
    size_t cap = (size_t)1 << 16, used = 0, n = 0;
    if (v) {
        static uint64_t last_uid;
        v->uid = __atomic_add_fetch(&last_uid, 1, __ATOMIC_RELAXED);
        v->n_tokens = n_tokens;
        v->eos = eos;
        v->tok_off = calloc((size_t)n_tokens, sizeof *v->tok_off);
        v->tok_len = calloc((size_t)n_tokens, sizeof *v->tok_len);
        v->ids = malloc((size_t)n_tokens * sizeof *v->ids);
        v->pool = malloc(cap);
    }
    if (!v || !t || !v->tok_off || !v->tok_len || !v->ids || !v->pool)
        goto oom;
    for (int32_t i = 0; i < n_tokens; i++) {
        long k = i == eos ? 0 : pool_token(v, &cap, &used, i, token_bytes, user);
        if (k < 0)
            goto oom;
        if (k > 0)
            t[n++] = (sorted_token){NULL, (size_t)k, i};
    }
    uint8_t *fit = realloc(v->pool, used + 1); /* the slack back */
    if (fit)
        v->pool = fit;
    for (size_t i = 0; i < n; i++) /* the pool is whole: point into it */
        t[i].s = v->pool + v->tok_off[t[i].id];
    qsort(t, n, sizeof *t, cmp_token);
    if (build_trie(v, t, n, used) != QL_OK)
        goto oom;
    free(t);
    *out = v;
    return QL_OK;
oom:
    free(t);
    gr_vocab_free(v);
    return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the vocabulary trie");
}

/* --- the matcher's tables -------------------------------------------------------- */

/* A stack entry: the element at pos, above the entry parent (-1: the
 * bottom). */
typedef struct snode {
    int32_t pos, parent;
} snode;

/* A state by what it is, not by its ids in one matcher: its stacks, each
 * written as its length then its positions top to bottom, in sorted
 * order, then whether it accepts. */
typedef struct signature {
    uint32_t *w;
    size_t n, cap;
} signature;

typedef struct mstate {
    int32_t off, len; /* its stacks: st_nodes[off .. off + len) */
    bool accept;
    int32_t *trans; /* 256: by byte, UNKNOWN, DEAD or a state; NULL until used */
} mstate;

struct gr_matcher {
    gr_grammar *g;
    const gr_vocab *v;
    /* stack entries, interned */
    snode *nodes;
    size_t n_nodes, cap_nodes;
    int32_t *nhash; /* open addressing: node ids, -1 empty */
    size_t nhash_cap;
    /* states, interned */
    mstate *st;
    size_t n_st, cap_st;
    int32_t *st_nodes;
    size_t n_st_nodes, cap_st_nodes;
    int32_t *shash;
    size_t shash_cap;
    /* a transition's work: the visited (pos, parent) pairs (by
     * generation), the pairs to visit, the stacks found */
    uint64_t *vkey;
    uint32_t *vgen;
    size_t vcap, n_visited;
    uint32_t gen;
    int64_t *work;
    size_t n_work, cap_work;
    int32_t *res;
    size_t n_res, cap_res;
    bool res_accept;
    size_t closure_steps;
    /* matcher steps: a position closed, a stack tested against a byte, a
     * trie node walked for a mask; each a few nanoseconds of work */
    int64_t *budget; /* the steps it may still take (gr_matcher_set_budget); NULL: any */
    uint64_t steps;  /* taken in all */
    int32_t *walk;   /* the trie walk's state per depth */
    size_t mem;      /* bytes held by memos, for the bound */
    size_t max_mem;  /* GR_MATCHER_MAX_BYTES, lower in tests */
    uint64_t compactions;
    signature sig; /* the last state's signature (its buffer reused) */
    signature raw; /* its stacks before sorting, and where each starts */
    size_t *starts, cap_starts;
    uint32_t *mask; /* the mask of state mask_state (-1: none), a bit per token */
    int32_t mask_state;
    uint64_t shared_hits; /* masks another matcher of the grammar had made */
    int32_t cur;
    bool ended;
    int err;
    stop_reason why; /* when err is set: what stopped it */
};

static uint64_t node_key(int32_t pos, int32_t parent)
{
    return (uint64_t)(uint32_t)pos << 32 | (uint32_t)parent;
}

static uint64_t node_hash(const gr_matcher *m, size_t id)
{
    return ql_mix64(node_key(m->nodes[id].pos, m->nodes[id].parent));
}

static uint64_t state_hash(const int32_t *ids, size_t n, bool accept)
{
    uint64_t h = accept ? 0x9e3779b97f4a7c15ULL : 0x7f4a7c159e3779b9ULL;
    for (size_t i = 0; i < n; i++)
        h = ql_mix64(h ^ (uint32_t)ids[i]);
    return h;
}

static uint64_t state_hash_of(const gr_matcher *m, size_t id)
{
    const mstate *s = &m->st[id];
    return state_hash(m->st_nodes + s->off, (size_t)s->len, s->accept);
}

/* An index of twice the old capacity (first: first_cap) over ids
 * 0..n-1 by hash, in *table (open addressing, -1 empty); false when out
 * of memory (the old one kept). */
static bool reindex(const gr_matcher *m, int32_t **table, size_t *cap, size_t first_cap, size_t n,
                    uint64_t (*hash)(const gr_matcher *, size_t))
{
    size_t cap2 = *cap ? *cap * 2 : first_cap;
    int32_t *t = malloc(cap2 * sizeof *t);
    if (!t)
        return false;
    memset(t, 0xff, cap2 * sizeof *t);
    for (size_t id = 0; id < n; id++) {
        size_t h = hash(m, id) & (cap2 - 1);
        while (t[h] >= 0)
            h = (h + 1) & (cap2 - 1);
        t[h] = (int32_t)id;
    }
    free(*table);
    *table = t;
    *cap = cap2;
    return true;
}

/* The id of stack entry (pos, parent); -1 when out of memory. */
static int32_t node_intern(gr_matcher *m, int32_t pos, int32_t parent)
{
    if ((m->n_nodes + 1) * 2 > m->nhash_cap &&
        !reindex(m, &m->nhash, &m->nhash_cap, 1024, m->n_nodes, node_hash))
        return -1;
    size_t h = ql_mix64(node_key(pos, parent)) & (m->nhash_cap - 1);
    for (; m->nhash[h] >= 0; h = (h + 1) & (m->nhash_cap - 1)) {
        int32_t id = m->nhash[h];
        if (m->nodes[id].pos == pos && m->nodes[id].parent == parent)
            return id;
    }
    if (!gr_grow((void **)&m->nodes, m->n_nodes + 1, &m->cap_nodes, sizeof *m->nodes))
        return -1;
    m->nodes[m->n_nodes] = (snode){pos, parent};
    m->nhash[h] = (int32_t)m->n_nodes;
    m->mem += 3 * sizeof(snode);
    return (int32_t)m->n_nodes++;
}

/* The id of the state of stacks ids[0..n) (sorted, distinct) accepting
 * or not; -1 when out of memory. */
static int32_t state_intern(gr_matcher *m, const int32_t *ids, size_t n, bool accept)
{
    if ((m->n_st + 1) * 2 > m->shash_cap &&
        !reindex(m, &m->shash, &m->shash_cap, 256, m->n_st, state_hash_of))
        return -1;
    size_t h = state_hash(ids, n, accept) & (m->shash_cap - 1);
    for (; m->shash[h] >= 0; h = (h + 1) & (m->shash_cap - 1)) {
        const mstate *s = &m->st[m->shash[h]];
        if (s->accept == accept && (size_t)s->len == n &&
            (n == 0 || memcmp(m->st_nodes + s->off, ids, n * sizeof *ids) == 0))
            return m->shash[h];
    }
    if (!gr_grow((void **)&m->st, m->n_st + 1, &m->cap_st, sizeof *m->st) ||
        !gr_grow((void **)&m->st_nodes, m->n_st_nodes + n, &m->cap_st_nodes, sizeof *m->st_nodes))
        return -1;
    if (n)
        memcpy(m->st_nodes + m->n_st_nodes, ids, n * sizeof *ids);
    m->st[m->n_st] = (mstate){.off = (int32_t)m->n_st_nodes, .len = (int32_t)n, .accept = accept};
    m->n_st_nodes += n;
    m->shash[h] = (int32_t)m->n_st;
    m->mem += sizeof(mstate) + 2 * sizeof(int32_t) + n * sizeof *ids;
    return (int32_t)m->n_st++;
}

/* --- closing positions into stacks ------------------------------------------------ */

static int stop(gr_matcher *m, stop_reason why)
{
    if (m->err == QL_OK) {
        m->err = why == STOP_MEMORY ? QL_ENOMEM : QL_EINVAL;
        m->why = why;
    }
    return m->err;
}

/* Take n matcher steps from the budget; false (the matcher stopped) when
 * it has run out. */
static bool spend(gr_matcher *m, int64_t n)
{
    m->steps += (uint64_t)n;
    if (!m->budget || (*m->budget -= n) >= 0)
        return true;
    stop(m, STOP_BUDGET);
    return false;
}

void gr_matcher_set_budget(gr_matcher *m, int64_t *left)
{
    m->budget = left;
}

/* Whether (pos, parent) was visited in this transition; marks it. */
static bool visited(gr_matcher *m, int32_t pos, int32_t parent)
{
    if ((m->n_visited + 1) * 2 > m->vcap) { /* grow: the old marks are of this generation */
        size_t cap = m->vcap ? m->vcap * 2 : 1024;
        uint64_t *k = malloc(cap * sizeof *k);
        uint32_t *gen = calloc(cap, sizeof *gen);
        if (!k || !gen) {
            free(k);
            free(gen);
            stop(m, STOP_MEMORY);
            return true;
        }
        for (size_t i = 0; i < m->vcap; i++)
            if (m->vgen[i] == m->gen) {
                size_t h = ql_mix64(m->vkey[i]) & (cap - 1);
                while (gen[h] == m->gen)
                    h = (h + 1) & (cap - 1);
                k[h] = m->vkey[i];
                gen[h] = m->gen;
            }
        free(m->vkey);
        free(m->vgen);
        m->vkey = k;
        m->vgen = gen;
        m->vcap = cap;
    }
    uint64_t key = node_key(pos, parent);
    size_t h = ql_mix64(key) & (m->vcap - 1);
    for (; m->vgen[h] == m->gen; h = (h + 1) & (m->vcap - 1))
        if (m->vkey[h] == key)
            return true;
    m->vkey[h] = key;
    m->vgen[h] = m->gen;
    m->n_visited++;
    return false;
}

static void push_work(gr_matcher *m, int32_t pos, int32_t parent)
{
    if (!gr_grow((void **)&m->work, m->n_work + 1, &m->cap_work, sizeof *m->work)) {
        stop(m, STOP_MEMORY);
        return;
    }
    m->work[m->n_work++] = (int64_t)node_key(pos, parent);
}

/* Close position pos above entry parent: every stack it can become
 * before reading a byte goes into res; reaching the root's end sets
 * res_accept. */
static void closure(gr_matcher *m, int32_t pos, int32_t parent)
{
    const gr_grammar *g = m->g;
    push_work(m, pos, parent);
    while (m->n_work && m->err == QL_OK) {
        uint64_t k = (uint64_t)m->work[--m->n_work];
        pos = (int32_t)(k >> 32);
        parent = (int32_t)(uint32_t)k;
        if (!spend(m, 1) || visited(m, pos, parent))
            continue;
        if (++m->closure_steps > GR_MAX_CLOSURE) {
            stop(m, STOP_CLOSURE);
            return;
        }
        const gr_elem *e = &g->elems[pos];
        if (e->kind == GR_E_SET) {
            if (m->n_res >= GR_MAX_STACKS) {
                stop(m, STOP_STACKS);
                return;
            }
            int32_t id = node_intern(m, pos, parent);
            if (id < 0 || !gr_grow((void **)&m->res, m->n_res + 1, &m->cap_res, sizeof *m->res)) {
                stop(m, STOP_MEMORY);
                return;
            }
            m->res[m->n_res++] = id;
        } else if (e->kind == GR_E_END) {
            if (parent < 0)
                m->res_accept = true;
            else
                push_work(m, m->nodes[parent].pos, m->nodes[parent].parent);
        } else {
            const gr_rule_info *r = &g->rules[e->arg];
            int32_t below = parent;
            if (g->elems[pos + 1].kind != GR_E_END &&
                (below = node_intern(m, pos + 1, parent)) < 0) {
                stop(m, STOP_MEMORY);
                return;
            }
            for (int32_t a = r->first_alt + r->n_alts - 1; a >= r->first_alt; a--)
                push_work(m, g->alts[a], below);
        }
    }
}

static void begin_closure(gr_matcher *m)
{
    m->n_res = 0;
    m->res_accept = false;
    m->closure_steps = 0;
    m->n_visited = 0;
    if (++m->gen == 0) { /* wrapped: clear the marks of old generations */
        if (m->vgen)
            memset(m->vgen, 0, m->vcap * sizeof *m->vgen);
        m->gen = 1;
    }
}

static int cmp_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

/* The state res (sorted, made distinct) makes: DEAD when it has no
 * stack and does not accept; -1 on failure (m->err). */
static int32_t end_closure(gr_matcher *m)
{
    if (m->err != QL_OK)
        return -1;
    if (m->n_res == 0 && !m->res_accept)
        return DEAD;
    if (m->n_res > 1)
        qsort(m->res, m->n_res, sizeof *m->res, cmp_id);
    size_t n = 0;
    for (size_t i = 0; i < m->n_res; i++)
        if (n == 0 || m->res[n - 1] != m->res[i])
            m->res[n++] = m->res[i];
    int32_t s = state_intern(m, m->res, n, m->res_accept);
    if (s < 0)
        stop(m, STOP_MEMORY);
    return s;
}

/* State s after byte c: DEAD, a state, or -1 on failure. */
static int32_t step(gr_matcher *m, int32_t s, uint8_t c)
{
    if (m->st[s].trans && m->st[s].trans[c] != UNKNOWN)
        return m->st[s].trans[c];
    begin_closure(m);
    if (!spend(m, m->st[s].len)) /* each stack is tested against c */
        return -1;
    for (int32_t i = 0; i < m->st[s].len && m->err == QL_OK; i++) {
        const snode *n = &m->nodes[m->st_nodes[m->st[s].off + i]];
        if (gr_set_has(&m->g->sets[m->g->elems[n->pos].arg], c))
            closure(m, n->pos + 1, n->parent);
    }
    int32_t t = end_closure(m);
    if (t == -1)
        return -1;
    if (!m->st[s].trans) {
        int32_t *tr = malloc(256 * sizeof *tr);
        if (!tr)
            return stop(m, STOP_MEMORY), -1;
        for (int i = 0; i < 256; i++)
            tr[i] = UNKNOWN;
        m->st[s].trans = tr;
        m->mem += 256 * sizeof *tr;
    }
    m->st[s].trans[c] = t;
    return t;
}

/* --- the matcher ---------------------------------------------------------------- */

/* Drop every memo and table, then rebuild the current state (its stacks
 * copied out of the old tables) as the only one: memory back to what it
 * needs. */
static int compact(gr_matcher *m)
{
    const mstate *cur = &m->st[m->cur];
    size_t n = (size_t)cur->len;
    bool accept = cur->accept;
    snode *old = m->nodes;
    int32_t *tops = malloc((n + 1) * sizeof *tops), *chain = NULL;
    size_t cap_chain = 0;
    int rc = tops ? QL_OK : QL_ENOMEM;
    for (size_t i = 0; i < n && tops; i++)
        tops[i] = m->st_nodes[cur->off + i];
    for (size_t i = 0; i < m->n_st; i++)
        free(m->st[i].trans);
    m->mask_state = -1; /* state ids change */
    m->nodes = NULL;
    m->n_nodes = m->cap_nodes = m->n_st = m->n_st_nodes = 0;
    free(m->nhash);
    free(m->shash);
    m->nhash = m->shash = NULL;
    m->nhash_cap = m->shash_cap = 0;
    m->mem = 0;
    for (size_t i = 0; i < n && rc == QL_OK; i++) { /* copy each stack, bottom up */
        size_t depth = 0;
        for (int32_t id = tops[i]; id >= 0; id = old[id].parent) {
            if (!gr_grow((void **)&chain, depth + 1, &cap_chain, sizeof *chain)) {
                rc = QL_ENOMEM;
                break;
            }
            chain[depth++] = id;
        }
        int32_t below = -1;
        while (rc == QL_OK && depth > 0)
            if ((below = node_intern(m, old[chain[--depth]].pos, below)) < 0)
                rc = QL_ENOMEM;
        tops[i] = below;
    }
    if (rc == QL_OK) {
        if (n > 1)
            qsort(tops, n, sizeof *tops, cmp_id);
        m->cur = state_intern(m, tops, n, accept);
        rc = m->cur < 0 ? QL_ENOMEM : QL_OK;
    }
    free(old);
    free(chain);
    free(tops);
    return rc == QL_OK ? QL_OK : stop(m, STOP_MEMORY);
}

/* A matcher at the grammar's start; a failure's sentence into msg. */
static int matcher_new(gr_matcher **out, gr_grammar *g, const gr_vocab *v, char *msg,
                       size_t msg_len)
{
    gr_matcher *m = calloc(1, sizeof *m);
    if (!m)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the grammar's matcher");
    m->g = gr_grammar_ref(g);
    m->v = v;
    m->max_mem = GR_MATCHER_MAX_BYTES;
    m->mask_state = -1;
    if (v && !(m->walk = malloc(((size_t)v->max_depth + 1) * sizeof *m->walk)))
        stop(m, STOP_MEMORY);
    begin_closure(m);
    const gr_rule_info *root = &g->rules[0];
    for (int32_t a = root->first_alt; a < root->first_alt + root->n_alts; a++)
        closure(m, g->alts[a], -1);
    m->cur = end_closure(m);
    /* a grammar of no sentence: accepting nothing, stuck */
    if (m->err == QL_OK && m->cur == DEAD && (m->cur = state_intern(m, NULL, 0, false)) < 0)
        stop(m, STOP_MEMORY);
    if (m->err != QL_OK) { /* its first step does not fit the bounds */
        int rc = gr_matcher_error(m, msg, msg_len);
        gr_matcher_free(m);
        return rc;
    }
    *out = m;
    return QL_OK;
}

int gr_matcher_new(gr_matcher **out, gr_grammar *g, const gr_vocab *v, char *msg, size_t msg_len)
{
    *out = NULL;
    if (!g || !v)
        return ql_fail(msg, msg_len, QL_EINVAL, "a matcher needs a grammar and a vocabulary");
    return matcher_new(out, g, v, msg, msg_len);
}

void gr_matcher_free(gr_matcher *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_st; i++)
        free(m->st[i].trans);
    free(m->mask);
    free(m->st);
    free(m->st_nodes);
    free(m->shash);
    free(m->nodes);
    free(m->nhash);
    free(m->vkey);
    free(m->vgen);
    free(m->work);
    free(m->res);
    free(m->walk);
    free(m->sig.w);
    free(m->raw.w);
    free(m->starts);
    gr_grammar_unref(m->g);
    free(m);
}

/* The state after bytes s[0..n) from state from: DEAD, or -1 on failure. */
static int32_t walk_bytes(gr_matcher *m, int32_t from, const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n && from >= 0; i++)
        from = step(m, from, s[i]);
    return from;
}

/* --- masks shared by a grammar's matchers ---------------------------------------- */

/* Stack of entry id, in the matcher's tables, appended to sig. */
static bool sig_stack(const gr_matcher *m, int32_t id, signature *sig)
{
    size_t depth = 0;
    for (int32_t k = id; k >= 0; k = m->nodes[k].parent)
        depth++;
    if (!gr_grow((void **)&sig->w, sig->n + depth + 1, &sig->cap, sizeof *sig->w))
        return false;
    sig->w[sig->n++] = (uint32_t)depth;
    for (int32_t k = id; k >= 0; k = m->nodes[k].parent)
        sig->w[sig->n++] = (uint32_t)m->nodes[k].pos;
    return true;
}

/* Compare the stacks written at a and b (each: length, positions). */
static int cmp_stack(const uint32_t *a, const uint32_t *b)
{
    size_t n = a[0] < b[0] ? a[0] : b[0];
    for (size_t i = 1; i <= n; i++)
        if (a[i] != b[i])
            return a[i] < b[i] ? -1 : 1;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* State s's signature into m->sig (the buffers reused). */
static bool make_signature(gr_matcher *m, int32_t s)
{
    const mstate *st = &m->st[s];
    signature *raw = &m->raw, *sig = &m->sig;
    size_t *starts;
    raw->n = 0;
    bool ok = gr_grow((void **)&m->starts, (size_t)st->len + 1, &m->cap_starts, sizeof *starts);
    starts = m->starts;
    for (int32_t i = 0; ok && i < st->len; i++) {
        starts[i] = raw->n;
        ok = sig_stack(m, m->st_nodes[st->off + i], raw);
    }
    /* insertion sort of the stacks: a state holds few */
    for (int32_t i = 1; ok && i < st->len; i++)
        for (int32_t j = i; j > 0 && cmp_stack(raw->w + starts[j - 1], raw->w + starts[j]) > 0;
             j--) {
            size_t t = starts[j];
            starts[j] = starts[j - 1];
            starts[j - 1] = t;
        }
    sig->n = 0;
    ok = ok && gr_grow((void **)&sig->w, raw->n + 1, &sig->cap, sizeof *sig->w);
    for (int32_t i = 0; ok && i < st->len; i++) {
        const uint32_t *w = raw->w + starts[i];
        memcpy(sig->w + sig->n, w, (w[0] + 1) * sizeof *w);
        sig->n += w[0] + 1;
    }
    if (ok)
        sig->w[sig->n++] = st->accept;
    return ok;
}

static uint64_t sig_hash(const signature *sig, const gr_vocab *v)
{
    uint64_t h = ql_mix64(v->uid);
    for (size_t i = 0; i < sig->n; i++)
        h = ql_mix64(h ^ sig->w[i]);
    return h;
}

/* The mask of the current state into m->mask: another matcher's of the
 * same grammar when one made it, else a walk of the trie from it (and
 * then kept for the others). */
static bool make_mask(gr_matcher *m)
{
    const gr_vocab *v = m->v;
    size_t words = ((size_t)v->n_tokens + 31) / 32;
    if (!m->mask && !(m->mask = malloc(words * sizeof *m->mask))) {
        stop(m, STOP_MEMORY);
        return false;
    }
    uint32_t *mask = m->mask;
    int32_t s = m->cur;
    m->mask_state = -1;
    bool signed_ = make_signature(m, s);
    uint64_t h = signed_ ? sig_hash(&m->sig, v) : 0;
    if (signed_ && gr_shared_get(m->g, v->uid, m->sig.w, m->sig.n, h, mask, words)) {
        m->shared_hits++;
        m->mask_state = s;
        return true;
    }
    memset(mask, 0, words * sizeof *mask);
    m->walk[0] = s;
    for (int32_t i = 0; i < v->n_nodes && m->err == QL_OK && spend(m, 1);) {
        int32_t t = step(m, m->walk[v->depth[i] - 1], v->byte[i]);
        if (t < 0) { /* dead: nothing below either (or a failure: the loop ends) */
            i = v->skip[i];
            continue;
        }
        m->walk[v->depth[i]] = t;
        for (int32_t k = 0; k < v->tok_count[i]; k++) {
            int32_t id = v->ids[v->tok_first[i] + k];
            mask[id >> 5] |= 1u << (id & 31);
        }
        i++;
    }
    if (v->eos >= 0 && m->st[s].accept)
        mask[v->eos >> 5] |= 1u << (v->eos & 31);
    if (m->err != QL_OK)
        return false;
    if (signed_)
        gr_shared_put(m->g, v->uid, m->sig.w, m->sig.n, h, mask, words);
    m->mask_state = s;
    return true;
}

int gr_matcher_mask(gr_matcher *m, float *logits)
{
    if (m->err != QL_OK)
        return m->err;
    if (m->mem > m->max_mem) {
        m->compactions++;
        if (compact(m) != QL_OK)
            return m->err;
    }
    if (m->mask_state != m->cur && !make_mask(m))
        return m->err;
    const uint32_t *mask = m->mask;
    int32_t n = m->v->n_tokens;
    for (int32_t w = 0; w * 32 < n; w++) {
        uint32_t bits = mask[w];
        if (bits == 0xffffffffu)
            continue;
        int32_t end = w * 32 + 32 < n ? w * 32 + 32 : n;
        for (int32_t t = w * 32; t < end; t++)
            if (!((bits >> (t & 31)) & 1u))
                logits[t] = -INFINITY;
    }
    return QL_OK;
}

bool gr_matcher_allows(gr_matcher *m, int32_t token)
{
    const gr_vocab *v = m->v;
    if (m->err != QL_OK || m->ended || token < 0 || token >= v->n_tokens)
        return false;
    if (token == v->eos)
        return m->st[m->cur].accept;
    if (v->tok_len[token] == 0)
        return false;
    if (m->mask_state == m->cur)
        return (m->mask[token >> 5] >> (token & 31)) & 1u;
    return walk_bytes(m, m->cur, v->pool + v->tok_off[token], v->tok_len[token]) >= 0;
}

int gr_matcher_accept(gr_matcher *m, int32_t token)
{
    if (!gr_matcher_allows(m, token))
        return m->err != QL_OK ? m->err : QL_EINVAL;
    const gr_vocab *v = m->v;
    if (token == v->eos) {
        m->ended = true;
        return QL_OK;
    }
    int32_t t = walk_bytes(m, m->cur, v->pool + v->tok_off[token], v->tok_len[token]);
    if (t < 0)
        return m->err != QL_OK ? m->err : QL_EINVAL;
    m->cur = t;
    return QL_OK;
}

bool gr_matcher_can_end(const gr_matcher *m)
{
    return m->err == QL_OK && m->st[m->cur].accept;
}

bool gr_matcher_done(const gr_matcher *m)
{
    return gr_matcher_can_end(m) && m->st[m->cur].len == 0;
}

int gr_matcher_error(const gr_matcher *m, char *msg, size_t msg_len)
{
    if (m->err == QL_OK)
        return ql_fail(msg, msg_len, QL_OK, "the matcher has not stopped");
    switch (m->why) {
    case STOP_STACKS:
        return ql_fail(msg, msg_len, m->err,
                       "the grammar is too ambiguous: one byte would leave more than %d parse "
                       "stacks",
                       GR_MAX_STACKS);
    case STOP_CLOSURE:
        return ql_fail(msg, msg_len, m->err,
                       "the grammar is too ambiguous: one byte would take more than %d closure "
                       "steps",
                       GR_MAX_CLOSURE);
    case STOP_BUDGET:
        return ql_fail(msg, msg_len, m->err,
                       "the grammar needed more matcher steps than its budget for one token");
    case STOP_MEMORY: break;
    }
    return ql_fail(msg, msg_len, m->err, "out of memory for the grammar's matcher");
}

uint64_t gr_matcher_steps(const gr_matcher *m)
{
    return m->steps;
}

void gr_matcher_set_memory_bound(gr_matcher *m, size_t bytes)
{
    m->max_mem = bytes;
}

uint64_t gr_matcher_compactions(const gr_matcher *m)
{
    return m->compactions;
}

uint64_t gr_matcher_shared_hits(const gr_matcher *m)
{
    return m->shared_hits;
}

bool gr_grammar_accepts(const gr_grammar *g, const void *s, size_t n)
{
    gr_matcher *m = NULL;
    if (!g || matcher_new(&m, (gr_grammar *)g, NULL, NULL, 0) != QL_OK)
        return false;
    int32_t t = walk_bytes(m, m->cur, s, n);
    bool ok = t >= 0 && m->err == QL_OK && m->st[t].accept;
    gr_matcher_free(m);
    return ok;
}

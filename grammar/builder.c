/*
 * builder.c - writing a grammar and compiling it to the flat rules the
 * matcher walks; the compiled grammars' cache.
 *
 * A compiler (schema.c, regex.c) writes a tree of expressions: literals,
 * byte sets, sequences, alternatives, repeats and named rules. gr_build
 * lowers it to rules in the shape of a BNF (llama.cpp's GBNF runs the same
 * way): a rule is a list of alternatives, an alternative a list of
 * elements ended by GR_E_END, and an element either reads one byte of a
 * set (GR_E_SET: a 256-bit set, interned, so a grammar holds each
 * distinct set once) or calls a rule (GR_E_REF). Sequences are written
 * inline into the alternative that holds them; each alternative
 * expression becomes a rule of its own, once however often it is used;
 * x{m,n} is x written m times, then a chain of n - m optional copies
 * (O_k ::= x O_k-1 | empty, one rule per x and k), and x* the rule
 * S ::= x S | empty, whose call of itself is the last element of its
 * alternative, which the matcher walks without growing its stack.
 *
 * Lowering never recurses into an alternative: those go on a worklist,
 * so only nested sequences and repeats recurse, bounded by
 * GR_MAX_DEPTH. Every expression node and every lowered element counts
 * against the builder's bound, and lowering's steps against a multiple
 * of it, the guards that keep a huge schema or a regex like
 * a{99999}{99999} or (){1000}{1000}{1000} from taking the server's
 * memory or time.
 *
 * The matcher (matcher.c) keeps, per sequence, the stacks of positions
 * a parse may be in; a rule that can call itself before reading a byte
 * would push frames forever, so gr_build refuses it by name: among the
 * calls reachable without a byte read (those after only nullable
 * elements), a cycle through a call that is not its alternative's last
 * element (the only kind that pushes a frame) is left recursion. Tarjan's
 * strongly connected components over those calls find it in linear time.
 *
 * Owns the builders; a grammar it builds is grammar.c's to keep.
 */
#include "internal/grammar_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Nesting of sequences and repeats lowering may recurse through: the
 * compilers nest far less (a schema's depth, a regex's groups). */
#define GR_MAX_DEPTH 1000
/* Lowering's steps (its visits of expressions) per element of the bound:
 * an expression that writes nothing (an empty group) is still visited
 * once per copy, so ((((){1000}){1000}){1000}) is refused here rather
 * than walked 10^9 times. Real grammars take at most 2 per element. */
#define GR_LOWER_STEPS_PER_NODE 4

typedef enum x_kind { X_EMPTY, X_NOTHING, X_SET, X_SEQ, X_ALT, X_REPEAT, X_RULE } x_kind;

/* One expression: X_SET: a = set; X_SEQ/X_ALT: kids[a .. a + b);
 * X_REPEAT: a = x, b = min, c = max; X_RULE: a = body (-1 until
 * defined), b = name offset in names. */
typedef struct x_node {
    uint8_t kind;
    int32_t a, b, c;
} x_node;

struct gr_builder {
    x_node *nodes;
    size_t n_nodes, cap_nodes;
    gr_expr *kids;
    size_t n_kids, cap_kids;
    gr_set *sets; /* distinct */
    size_t n_sets, cap_sets;
    int32_t *set_index; /* open addressing over sets by content, -1 empty */
    size_t set_index_cap;
    char *names;
    size_t n_names, cap_names;
    size_t max_nodes;
    int err;
    char err_msg[256];
};

/* --- failing once -------------------------------------------------------------- */

static gr_expr fail(gr_builder *b, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static gr_expr fail(gr_builder *b, int err, const char *fmt, ...)
{
    if (b->err == QL_OK) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err_msg, sizeof b->err_msg, fmt, ap);
        va_end(ap);
        b->err = err;
    }
    return -1;
}

int gr_builder_error(const gr_builder *b, char *msg, size_t msg_len)
{
    if (!b)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for a grammar builder");
    if (b->err != QL_OK)
        return ql_fail(msg, msg_len, b->err, "%s", b->err_msg);
    return QL_OK;
}

gr_builder *gr_builder_new(size_t max_nodes)
{
    gr_builder *b = calloc(1, sizeof *b);
    if (b)
        b->max_nodes = max_nodes ? max_nodes : GR_DEFAULT_MAX_NODES;
    return b;
}

void gr_builder_free(gr_builder *b)
{
    if (!b)
        return;
    free(b->nodes);
    free(b->kids);
    free(b->sets);
    free(b->set_index);
    free(b->names);
    free(b);
}

/* --- expressions --------------------------------------------------------------- */

static gr_expr node(gr_builder *b, x_kind kind, int32_t a, int32_t bb, int32_t c)
{
    if (b->err != QL_OK)
        return -1;
    if (b->n_nodes + b->n_kids >= b->max_nodes)
        return fail(b, QL_EINVAL, "the grammar is too large: over %zu expressions (the bound)",
                    b->max_nodes);
    if (!gr_grow((void **)&b->nodes, b->n_nodes + 1, &b->cap_nodes, sizeof *b->nodes))
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    b->nodes[b->n_nodes] = (x_node){.kind = (uint8_t)kind, .a = a, .b = bb, .c = c};
    return (gr_expr)b->n_nodes++;
}

static bool valid(const gr_builder *b, gr_expr x)
{
    return x >= 0 && (size_t)x < b->n_nodes;
}

static uint64_t set_hash(const gr_set *s)
{
    uint64_t h = 0;
    for (int i = 0; i < 8; i++)
        h = ql_mix64(h ^ s->bits[i]);
    return h;
}

/* The index over the sets at twice the capacity (at least 256). */
static bool set_reindex(gr_builder *b)
{
    size_t cap = b->set_index_cap ? b->set_index_cap * 2 : 256;
    int32_t *t = malloc(cap * sizeof *t);
    if (!t)
        return false;
    memset(t, 0xff, cap * sizeof *t);
    for (size_t i = 0; i < b->n_sets; i++) {
        size_t h = set_hash(&b->sets[i]) & (cap - 1);
        while (t[h] >= 0)
            h = (h + 1) & (cap - 1);
        t[h] = (int32_t)i;
    }
    free(b->set_index);
    b->set_index = t;
    b->set_index_cap = cap;
    return true;
}

/* The id of set s: the one already made with its bytes, or a new one. */
static int32_t add_set(gr_builder *b, const gr_set *s)
{
    if (b->err != QL_OK)
        return -1;
    if ((b->n_sets + 1) * 2 > b->set_index_cap && !set_reindex(b))
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    size_t h = set_hash(s) & (b->set_index_cap - 1);
    for (; b->set_index[h] >= 0; h = (h + 1) & (b->set_index_cap - 1))
        if (memcmp(&b->sets[b->set_index[h]], s, sizeof *s) == 0)
            return b->set_index[h];
    if (!gr_grow((void **)&b->sets, b->n_sets + 1, &b->cap_sets, sizeof *b->sets))
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    b->sets[b->n_sets] = *s;
    b->set_index[h] = (int32_t)b->n_sets;
    return (int32_t)b->n_sets++;
}

gr_expr gr_empty(gr_builder *b)
{
    return node(b, X_EMPTY, 0, 0, 0);
}

gr_expr gr_nothing(gr_builder *b)
{
    return node(b, X_NOTHING, 0, 0, 0);
}

gr_expr gr_byte_range(gr_builder *b, uint8_t lo, uint8_t hi)
{
    if (lo > hi)
        return fail(b, QL_EINVAL, "byte range %u..%u is empty", lo, hi);
    gr_set s = {{0}};
    for (unsigned c = lo; c <= hi; c++)
        s.bits[c >> 5] |= 1u << (c & 31);
    return node(b, X_SET, add_set(b, &s), 0, 0);
}

static gr_expr list(gr_builder *b, x_kind kind, const gr_expr *xs, size_t n)
{
    if (b->err != QL_OK)
        return -1;
    for (size_t i = 0; i < n; i++)
        if (!valid(b, xs[i]))
            return fail(b, QL_EINVAL, "an expression that failed or is not this builder's");
    if (n > INT32_MAX || b->n_nodes + b->n_kids + n >= b->max_nodes)
        return fail(b, QL_EINVAL, "the grammar is too large: over %zu expressions (the bound)",
                    b->max_nodes);
    int32_t at = (int32_t)b->n_kids;
    for (size_t i = 0; i < n; i++) {
        if (!gr_grow((void **)&b->kids, b->n_kids + 1, &b->cap_kids, sizeof *b->kids))
            return fail(b, QL_ENOMEM, "out of memory writing a grammar");
        b->kids[b->n_kids++] = xs[i];
    }
    return node(b, kind, at, (int32_t)n, 0);
}

gr_expr gr_seq(gr_builder *b, const gr_expr *xs, size_t n)
{
    return n == 1 && valid(b, xs[0]) ? xs[0] : list(b, X_SEQ, xs, n);
}

gr_expr gr_alt(gr_builder *b, const gr_expr *xs, size_t n)
{
    return n == 1 && valid(b, xs[0]) ? xs[0] : list(b, X_ALT, xs, n);
}

gr_expr gr_seq2(gr_builder *b, gr_expr x, gr_expr y)
{
    gr_expr xs[2] = {x, y};
    return list(b, X_SEQ, xs, 2);
}

gr_expr gr_alt2(gr_builder *b, gr_expr x, gr_expr y)
{
    gr_expr xs[2] = {x, y};
    return list(b, X_ALT, xs, 2);
}

gr_expr gr_literal(gr_builder *b, const void *s, size_t n)
{
    if (n == 0)
        return gr_empty(b);
    const uint8_t *p = s;
    gr_expr first = -1;
    for (size_t i = 0; i < n; i++) {
        gr_expr e = gr_byte_range(b, p[i], p[i]);
        if (i == 0)
            first = e;
        if (e < 0)
            return -1;
    }
    /* the n sets just made are consecutive nodes: one sequence of them */
    gr_expr *xs = malloc(n * sizeof *xs);
    if (!xs)
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    for (size_t i = 0; i < n; i++)
        xs[i] = first + (gr_expr)i;
    gr_expr e = list(b, X_SEQ, xs, n);
    free(xs);
    return e;
}

gr_expr gr_repeat(gr_builder *b, gr_expr x, int32_t min, int32_t max)
{
    if (b->err != QL_OK)
        return -1;
    if (!valid(b, x))
        return fail(b, QL_EINVAL, "an expression that failed or is not this builder's");
    if (min < 0 || (max != GR_UNBOUNDED && max < min))
        return fail(b, QL_EINVAL, "repeat {%d,%d} is not a range", min, max);
    /* each copy is at least one element once lowered: refuse now what the
     * lowering would refuse later, before a caller nests it further */
    if ((size_t)min > b->max_nodes || (max != GR_UNBOUNDED && (size_t)max > b->max_nodes))
        return fail(b, QL_EINVAL,
                    "the grammar is too large: a repeat of up to %d (the bound is %zu)",
                    max == GR_UNBOUNDED ? min : max, b->max_nodes);
    return node(b, X_REPEAT, x, min, max);
}

gr_expr gr_optional(gr_builder *b, gr_expr x)
{
    return gr_repeat(b, x, 0, 1);
}

gr_expr gr_rule(gr_builder *b, const char *name)
{
    if (b->err != QL_OK)
        return -1;
    size_t n = strlen(name ? name : "") + 1;
    int32_t at = (int32_t)b->n_names;
    if (!gr_grow((void **)&b->names, b->n_names + n, &b->cap_names, 1))
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    memcpy(b->names + b->n_names, name ? name : "", n); /* and its NUL */
    b->n_names += n;
    return node(b, X_RULE, -1, at, 0);
}

int gr_define(gr_builder *b, gr_expr rule, gr_expr body)
{
    if (b->err != QL_OK)
        return b->err;
    if (!valid(b, rule) || b->nodes[rule].kind != X_RULE || !valid(b, body))
        return fail(b, QL_EINVAL, "gr_define needs a rule and an expression of this builder"),
               b->err;
    if (b->nodes[rule].a >= 0)
        return fail(b, QL_EINVAL, "rule '%s' is defined twice", b->names + b->nodes[rule].b),
               b->err;
    b->nodes[rule].a = body;
    return QL_OK;
}

/* --- code points as UTF-8 byte sequences -------------------------------------- */

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* One UTF-8 sequence per byte position: [lo_k .. hi_k] for k < n. */
static gr_expr byte_ranges(gr_builder *b, const uint8_t *lo, const uint8_t *hi, size_t n)
{
    gr_expr xs[4];
    for (size_t k = 0; k < n; k++)
        xs[k] = gr_byte_range(b, lo[k], hi[k]);
    return gr_seq(b, xs, n);
}

/* The code points lo..hi, all of one UTF-8 length, as sequences of byte
 * ranges appended to alts: split until every continuation byte spans its
 * whole range or a single value (the usual construction, as RE2's and
 * the Rust regex crate's utf8 ranges). */
static void utf8_split(gr_builder *b, uint32_t lo, uint32_t hi, gr_expr *alts, size_t *n_alts)
{
    size_t len = lo < 0x80 ? 1 : lo < 0x800 ? 2 : lo < 0x10000 ? 3 : 4;
    for (size_t i = 1; i < len; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_split(b, lo, lo | m, alts, n_alts);
                utf8_split(b, (lo | m) + 1, hi, alts, n_alts);
                return;
            }
            if ((hi & m) != m) {
                utf8_split(b, lo, (hi & ~m) - 1, alts, n_alts);
                utf8_split(b, hi & ~m, hi, alts, n_alts);
                return;
            }
        }
    }
    uint8_t l[4], h[4];
    ql_utf8_put(lo, l);
    ql_utf8_put(hi, h);
    alts[(*n_alts)++] = byte_ranges(b, l, h, len);
}

/* lo..hi split at the UTF-8 length boundaries, surrogates left out. */
static void utf8_ranges(gr_builder *b, uint32_t lo, uint32_t hi, gr_expr *alts, size_t *n_alts)
{
    static const uint32_t ends[] = {0x7F, 0x7FF, 0xD7FF, 0xFFFF, 0x10FFFF};
    for (size_t i = 0; i < sizeof ends / sizeof *ends && lo <= hi; i++) {
        if (lo > ends[i])
            continue;
        uint32_t top = hi < ends[i] ? hi : ends[i];
        utf8_split(b, lo, top, alts, n_alts);
        lo = ends[i] + 1;
        if (ends[i] == 0xD7FF)
            lo = 0xE000; /* past the surrogates */
    }
}

gr_expr gr_codepoints(gr_builder *b, const uint32_t *ranges, size_t n_ranges)
{
    if (b->err != QL_OK)
        return -1;
    uint32_t *r = malloc((n_ranges + 1) * 2 * sizeof *r);
    if (!r)
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    size_t n = 0;
    for (size_t i = 0; i < n_ranges; i++) {
        uint32_t lo = ranges[2 * i],
                 hi = ranges[2 * i + 1] > 0x10FFFF ? 0x10FFFF : ranges[2 * i + 1];
        if (lo <= hi) {
            r[2 * n] = lo;
            r[2 * n++ + 1] = hi;
        }
    }
    qsort(r, n, 2 * sizeof *r, cmp_range);
    size_t m = 0; /* merged: sorted, disjoint, not adjacent */
    for (size_t i = 0; i < n; i++) {
        if (m && r[2 * i] <= r[2 * (m - 1) + 1] + 1) {
            if (r[2 * i + 1] > r[2 * (m - 1) + 1])
                r[2 * (m - 1) + 1] = r[2 * i + 1];
        } else {
            r[2 * m] = r[2 * i];
            r[2 * m++ + 1] = r[2 * i + 1];
        }
    }
    /* every range splits into at most 4 lengths x 7 sequences */
    gr_expr *alts = malloc((m * 32 + 1) * sizeof *alts);
    size_t n_alts = 0;
    if (!alts) {
        free(r);
        return fail(b, QL_ENOMEM, "out of memory writing a grammar");
    }
    gr_set ascii = {{0}};
    bool any_ascii = false;
    for (size_t i = 0; i < m; i++) {
        uint32_t lo = r[2 * i], hi = r[2 * i + 1];
        for (; lo <= hi && lo < 0x80; lo++, any_ascii = true) /* one set for them all */
            ascii.bits[lo >> 5] |= 1u << (lo & 31);
        if (lo <= hi)
            utf8_ranges(b, lo, hi, alts, &n_alts);
    }
    if (any_ascii)
        alts[n_alts++] = node(b, X_SET, add_set(b, &ascii), 0, 0);
    gr_expr e = b->err != QL_OK ? -1 : gr_alt(b, alts, n_alts);
    free(alts);
    free(r);
    return e;
}

/* --- lowering ------------------------------------------------------------------ */

/* A rule to write: an expression's (alternatives, named rules, nothing),
 * x* (S ::= x S | empty) or x{0,k} (O_k ::= x O_k-1 | empty). */
typedef enum todo_kind { T_EXPR, T_STAR, T_CHAIN } todo_kind;
typedef struct todo {
    uint8_t kind;
    gr_expr x;
    int32_t k;
    int32_t rule;
} todo;

/* What lowering builds: the grammar's arrays as they grow. Only one
 * alternative is open at a time; rules met on the way go on the
 * worklist, so a rule's alternatives are written together. */
typedef struct lowering {
    gr_builder *b;
    gr_grammar *g;
    size_t cap_elems, cap_alts, cap_rules;
    int32_t *rule_of; /* per expression: its rule (alternatives, rules), -1 */
    int32_t *star_of; /* per expression: the rule of x*, -1 */
    /* the rule O_k of x, by (x, k): open addressing, key 0 empty */
    uint64_t *chain_key;
    int32_t *chain_rule;
    size_t n_chains, cap_chains;
    todo *todo;
    size_t n_todo, cap_todo;
    size_t steps; /* lower's visits, bounded by GR_LOWER_STEPS_PER_NODE */
} lowering;

static bool add_elem(lowering *l, uint8_t kind, int32_t arg)
{
    gr_grammar *g = l->g;
    if (l->b->err != QL_OK)
        return false;
    if (g->n_elems >= l->b->max_nodes) {
        fail(l->b, QL_EINVAL,
             "the grammar is too large: over %zu elements once compiled (the bound)",
             l->b->max_nodes);
        return false;
    }
    if (!gr_grow((void **)&g->elems, g->n_elems + 1, &l->cap_elems, sizeof *g->elems)) {
        fail(l->b, QL_ENOMEM, "out of memory compiling a grammar");
        return false;
    }
    g->elems[g->n_elems++] = (gr_elem){.kind = kind, .arg = arg};
    return true;
}

/* A new rule, queued to be written as t says; -1 on failure. */
static int32_t new_rule(lowering *l, todo t, int32_t name)
{
    gr_grammar *g = l->g;
    if (!gr_grow((void **)&g->rules, g->n_rules + 1, &l->cap_rules, sizeof *g->rules) ||
        !gr_grow((void **)&l->todo, l->n_todo + 1, &l->cap_todo, sizeof *l->todo)) {
        fail(l->b, QL_ENOMEM, "out of memory compiling a grammar");
        return -1;
    }
    g->rules[g->n_rules] =
        (gr_rule_info){.first_alt = (int32_t)g->n_alts, .n_alts = 0, .name = name};
    t.rule = (int32_t)g->n_rules;
    l->todo[l->n_todo++] = t;
    return (int32_t)g->n_rules++;
}

/* Open an alternative of rule r: its elements are appended next. */
static bool open_alt(lowering *l, int32_t r)
{
    gr_grammar *g = l->g;
    if (!gr_grow((void **)&g->alts, g->n_alts + 1, &l->cap_alts, sizeof *g->alts)) {
        fail(l->b, QL_ENOMEM, "out of memory compiling a grammar");
        return false;
    }
    if (g->rules[r].n_alts == 0)
        g->rules[r].first_alt = (int32_t)g->n_alts;
    g->rules[r].n_alts++;
    g->alts[g->n_alts++] = (int32_t)g->n_elems;
    return true;
}

static uint64_t chain_key(gr_expr x, int32_t k)
{
    return (uint64_t)(uint32_t)x << 32 | (uint32_t)k; /* k >= 1: never 0 */
}

/* The chain index at twice the capacity (at least 64). */
static bool chains_grow(lowering *l)
{
    size_t cap = l->cap_chains ? l->cap_chains * 2 : 64;
    uint64_t *keys = calloc(cap, sizeof *keys);
    int32_t *rules = malloc(cap * sizeof *rules);
    if (!keys || !rules) {
        free(keys);
        free(rules);
        return false;
    }
    for (size_t i = 0; i < l->cap_chains; i++)
        if (l->chain_key[i]) {
            size_t h = ql_mix64(l->chain_key[i]) & (cap - 1);
            while (keys[h])
                h = (h + 1) & (cap - 1);
            keys[h] = l->chain_key[i];
            rules[h] = l->chain_rule[i];
        }
    free(l->chain_key);
    free(l->chain_rule);
    l->chain_key = keys;
    l->chain_rule = rules;
    l->cap_chains = cap;
    return true;
}

/* The rule O_k ::= x O_k-1 | empty (O_1 ::= x | empty): up to k more
 * copies of x, made once per (x, k) and shared by every x{m,m+k} and
 * every longer chain of x; -1 on failure. */
static int32_t chain_of(lowering *l, gr_expr x, int32_t k)
{
    if ((l->n_chains + 1) * 2 > l->cap_chains && !chains_grow(l)) {
        fail(l->b, QL_ENOMEM, "out of memory compiling a grammar");
        return -1;
    }
    uint64_t key = chain_key(x, k);
    size_t h = ql_mix64(key) & (l->cap_chains - 1);
    for (; l->chain_key[h]; h = (h + 1) & (l->cap_chains - 1))
        if (l->chain_key[h] == key)
            return l->chain_rule[h];
    int32_t r = new_rule(l, (todo){.kind = T_CHAIN, .x = x, .k = k}, -1);
    if (r >= 0) {
        l->chain_key[h] = key;
        l->chain_rule[h] = r;
        l->n_chains++;
    }
    return r;
}

static int32_t rule_for(lowering *l, gr_expr x, int32_t name)
{
    if (l->rule_of[x] < 0)
        l->rule_of[x] = new_rule(l, (todo){.kind = T_EXPR, .x = x}, name);
    return l->rule_of[x];
}

/* Append x's elements to the alternative being written. */
static bool lower(lowering *l, gr_expr x, int depth)
{
    gr_builder *b = l->b;
    if (depth > GR_MAX_DEPTH) {
        fail(b, QL_EINVAL, "the grammar nests deeper than %d", GR_MAX_DEPTH);
        return false;
    }
    if (++l->steps > GR_LOWER_STEPS_PER_NODE * b->max_nodes) {
        fail(b, QL_EINVAL,
             "the grammar is too large: compiling it takes over %zu steps (the bound, %d per "
             "element)",
             GR_LOWER_STEPS_PER_NODE * b->max_nodes, GR_LOWER_STEPS_PER_NODE);
        return false;
    }
    const x_node *n = &b->nodes[x];
    int32_t r = -1;
    switch ((x_kind)n->kind) {
    case X_EMPTY: return true;
    case X_SET: return add_elem(l, GR_E_SET, n->a);
    case X_SEQ:
        for (int32_t i = 0; i < n->b; i++)
            if (!lower(l, b->kids[n->a + i], depth + 1))
                return false;
        return true;
    case X_NOTHING: /* a call of a rule with no alternative: never matches */
    case X_ALT: r = rule_for(l, x, -1); break;
    case X_RULE:
        if (n->a < 0) {
            fail(b, QL_EINVAL, "rule '%s' is used but never defined", b->names + n->b);
            return false;
        }
        r = rule_for(l, x, n->b);
        break;
    case X_REPEAT:
        for (int32_t i = 0; i < n->b; i++)
            if (!lower(l, n->a, depth + 1))
                return false;
        if (n->c == n->b)
            return true;
        if (n->c != GR_UNBOUNDED)
            r = chain_of(l, n->a, n->c - n->b);
        else if ((r = l->star_of[n->a]) < 0)
            r = l->star_of[n->a] = new_rule(l, (todo){.kind = T_STAR, .x = n->a}, -1);
        break;
    }
    return r >= 0 && add_elem(l, GR_E_REF, r);
}

/* Write the alternatives of queued rule *queued (copied first: writing
 * may queue more rules, which moves the queue). */
static bool lower_rule(lowering *l, const todo *queued)
{
    const todo copy = *queued, *t = &copy;
    const gr_builder *b = l->b;
    const x_node *n = &b->nodes[t->x];
    int32_t r = t->rule;
    switch ((todo_kind)t->kind) {
    case T_STAR: /* x S | empty */
        return open_alt(l, r) && lower(l, t->x, 0) && add_elem(l, GR_E_REF, r) &&
               add_elem(l, GR_E_END, 0) && open_alt(l, r) && add_elem(l, GR_E_END, 0);
    case T_CHAIN: { /* x O_k-1 | empty */
        if (!open_alt(l, r) || !lower(l, t->x, 0))
            return false;
        if (t->k > 1) {
            int32_t inner = chain_of(l, t->x, t->k - 1);
            if (inner < 0 || !add_elem(l, GR_E_REF, inner))
                return false;
        }
        return add_elem(l, GR_E_END, 0) && open_alt(l, r) && add_elem(l, GR_E_END, 0);
    }
    case T_EXPR: break;
    }
    if (n->kind == X_NOTHING)
        return true;
    if (n->kind == X_RULE)
        return open_alt(l, r) && lower(l, n->a, 0) && add_elem(l, GR_E_END, 0);
    for (int32_t i = 0; i < n->b; i++)
        if (!open_alt(l, r) || !lower(l, b->kids[n->a + i], 0) || !add_elem(l, GR_E_END, 0))
            return false;
    return true;
}

/* --- left recursion -------------------------------------------------------------- */

/* A call reachable before any byte is read: rule from calls rule to,
 * pushing a frame unless tail (the call ends its alternative). */
typedef struct call {
    int32_t to;
    bool tail;
} call;

/* Which rules can match the empty string: an alternative is nullable
 * once every rule it calls is and it reads no byte; each rule found
 * nullable is spread to the alternatives that call it once (linear, not
 * a fixpoint). NULL when out of memory. */
static bool *nullable_rules(const gr_grammar *g)
{
    size_t nr = g->n_rules, na = g->n_alts, ne = g->n_elems;
    bool *nullable = calloc(nr + 1, sizeof *nullable);
    int32_t *waiting = calloc(na + 1, sizeof *waiting);   /* calls not yet nullable; -1: reads */
    int32_t *alt_rule = calloc(na + 1, sizeof *alt_rule); /* the rule it belongs to */
    int32_t *start = calloc(nr + 2, sizeof *start);       /* callers of r: [start[r], start[r+1]) */
    int32_t *fill = calloc(nr + 1, sizeof *fill);
    int32_t *callers = calloc(ne + 1, sizeof *callers);
    int32_t *queue = calloc(nr + 1, sizeof *queue);
    bool ok = nullable && waiting && alt_rule && start && fill && callers && queue;
    size_t nq = 0;
    for (size_t r = 0; ok && r < nr; r++)
        for (int32_t a = g->rules[r].first_alt; a < g->rules[r].first_alt + g->rules[r].n_alts;
             a++) {
            alt_rule[a] = (int32_t)r;
            bool reads = false;
            for (const gr_elem *e = g->elems + g->alts[a]; e->kind != GR_E_END; e++) {
                reads |= e->kind == GR_E_SET;
                if (e->kind == GR_E_REF) {
                    waiting[a]++;
                    start[e->arg + 1]++;
                }
            }
            if (reads)
                waiting[a] = -1; /* its decrements below never bring it to 0 */
            else if (waiting[a] == 0 && !nullable[r]) {
                nullable[r] = true;
                queue[nq++] = (int32_t)r;
            }
        }
    for (size_t r = 0; ok && r < nr; r++) {
        start[r + 1] += start[r];
        fill[r] = start[r];
    }
    for (size_t a = 0; ok && a < na; a++)
        for (const gr_elem *e = g->elems + g->alts[a]; e->kind != GR_E_END; e++)
            if (e->kind == GR_E_REF)
                callers[fill[e->arg]++] = (int32_t)a;
    for (size_t i = 0; ok && i < nq; i++)
        for (int32_t k = start[queue[i]]; k < start[queue[i] + 1]; k++) {
            int32_t a = callers[k];
            if (--waiting[a] == 0 && !nullable[alt_rule[a]]) {
                nullable[alt_rule[a]] = true;
                queue[nq++] = alt_rule[a];
            }
        }
    free(waiting);
    free(alt_rule);
    free(start);
    free(fill);
    free(callers);
    free(queue);
    if (!ok) {
        free(nullable);
        return NULL;
    }
    return nullable;
}

/* The calls each rule makes before reading a byte, in CSR form: rule r's
 * are calls[from[r] .. from[r + 1]). */
static call *first_calls(const gr_grammar *g, const bool *nullable, int32_t **from_out)
{
    int32_t *from = calloc(g->n_rules + 1, sizeof *from);
    call *calls = calloc(g->n_elems + 1, sizeof *calls);
    if (!from || !calls) {
        free(from);
        free(calls);
        return NULL;
    }
    int32_t n = 0;
    for (size_t r = 0; r < g->n_rules; r++) {
        from[r] = n;
        for (int32_t a = g->rules[r].first_alt; a < g->rules[r].first_alt + g->rules[r].n_alts; a++)
            for (const gr_elem *e = g->elems + g->alts[a]; e->kind == GR_E_REF; e++) {
                calls[n++] = (call){.to = e->arg, .tail = e[1].kind == GR_E_END};
                if (!nullable[e->arg])
                    break;
            }
    }
    from[g->n_rules] = n;
    *from_out = from;
    return calls;
}

/* The name of rule r for an error. */
static const char *rule_name(const gr_grammar *g, int32_t r)
{
    return g->rules[r].name >= 0 ? g->names + g->rules[r].name : "(an unnamed rule)";
}

/* Tarjan's strongly connected components over the first calls
 * (iteratively: a grammar may have many rules), then a pushing call
 * inside one component is left recursion. */
static int check_left_recursion(const gr_grammar *g, char *msg, size_t msg_len)
{
    size_t nr = g->n_rules;
    bool *nullable = nullable_rules(g);
    int32_t *from = NULL;
    call *calls = nullable ? first_calls(g, nullable, &from) : NULL;
    int32_t *index = malloc((nr + 1) * sizeof *index), *low = malloc((nr + 1) * sizeof *low);
    int32_t *comp = malloc((nr + 1) * sizeof *comp), *stack = malloc((nr + 1) * sizeof *stack);
    int32_t *frames = malloc((nr + 1) * sizeof *frames),
            *cursor = malloc((nr + 1) * sizeof *cursor);
    bool *on = calloc(nr + 1, sizeof *on);
    int rc = QL_OK;
    if (!calls || !index || !low || !comp || !stack || !frames || !cursor || !on)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory compiling a grammar");
    int32_t counter = 0, n_stack = 0, n_comp = 0;
    for (size_t r = 0; rc == QL_OK && r < nr; r++)
        index[r] = -1;
    for (size_t root = 0; rc == QL_OK && root < nr; root++) {
        if (index[root] >= 0)
            continue;
        int32_t n_frames = 0;
        frames[n_frames++] = (int32_t)root;
        index[root] = low[root] = counter++;
        cursor[root] = from[root];
        stack[n_stack++] = (int32_t)root;
        on[root] = true;
        while (n_frames) {
            int32_t v = frames[n_frames - 1];
            if (cursor[v] < from[v + 1]) {
                int32_t w = calls[cursor[v]++].to;
                if (index[w] < 0) {
                    index[w] = low[w] = counter++;
                    cursor[w] = from[w];
                    stack[n_stack++] = w;
                    on[w] = true;
                    frames[n_frames++] = w;
                } else if (on[w] && index[w] < low[v])
                    low[v] = index[w];
                continue;
            }
            if (low[v] == index[v]) { /* v roots a component */
                int32_t w;
                do {
                    w = stack[--n_stack];
                    on[w] = false;
                    comp[w] = n_comp;
                } while (w != v);
                n_comp++;
            }
            if (--n_frames > 0) {
                int32_t u = frames[n_frames - 1];
                if (low[v] < low[u])
                    low[u] = low[v];
            }
        }
    }
    for (size_t r = 0; rc == QL_OK && r < nr; r++)
        for (int32_t k = from[r]; k < from[r + 1]; k++)
            if (!calls[k].tail && comp[calls[k].to] == comp[r]) {
                int32_t named = (int32_t)r; /* name a rule the writer named, if the cycle has one */
                for (size_t q = 0; q < nr && g->rules[named].name < 0; q++)
                    if (comp[q] == comp[r] && g->rules[q].name >= 0)
                        named = (int32_t)q;
                rc = ql_fail(msg, msg_len, QL_EINVAL,
                             "rule '%s' is left-recursive: it can reach itself before reading a "
                             "byte",
                             rule_name(g, named));
                break;
            }
    free(nullable);
    free(from);
    free(calls);
    free(index);
    free(low);
    free(comp);
    free(stack);
    free(frames);
    free(cursor);
    free(on);
    return rc;
}

/* --- compiled grammars ------------------------------------------------------------ */

/* Lower everything reachable from root into g: rule 0 the root, then
 * each queued rule in turn. */
static bool lower_all(lowering *l, gr_expr root)
{
    int32_t r0 = new_rule(l, (todo){.kind = T_EXPR, .x = -1}, -1);
    l->n_todo = 0; /* the root is written here, not from the queue */
    if (r0 != 0 || !open_alt(l, 0) || !lower(l, root, 0) || !add_elem(l, GR_E_END, 0))
        return false;
    for (size_t i = 0; i < l->n_todo; i++)
        if (!lower_rule(l, &l->todo[i]))
            return false;
    return true;
}

int gr_build(gr_builder *b, gr_expr root, gr_grammar **out, char *msg, size_t msg_len)
{
    *out = NULL;
    if (!b)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for a grammar builder");
    if (b->err == QL_OK && !valid(b, root))
        fail(b, QL_EINVAL, "the grammar's root is not an expression of its builder");
    if (b->err != QL_OK)
        return gr_builder_error(b, msg, msg_len);
    /* lowering fails into the builder; keep the builder as it was */
    int saved_err = b->err;
    lowering l = {.b = b, .g = calloc(1, sizeof(gr_grammar))};
    l.rule_of = malloc(b->n_nodes * sizeof *l.rule_of);
    l.star_of = malloc(b->n_nodes * sizeof *l.star_of);
    int rc = QL_OK;
    if (l.g)
        pthread_mutex_init(&l.g->masks_mu, NULL);
    if (!l.g || !l.rule_of || !l.star_of)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory compiling a grammar");
    for (size_t i = 0; rc == QL_OK && i < b->n_nodes; i++)
        l.rule_of[i] = l.star_of[i] = -1;
    if (rc == QL_OK && !lower_all(&l, root))
        rc = gr_builder_error(b, msg, msg_len);
    b->err = saved_err;
    gr_grammar *g = l.g;
    if (rc == QL_OK) {
        g->refs = 1;
        g->n_sets = b->n_sets;
        g->sets = malloc((b->n_sets + 1) * sizeof *g->sets);
        g->names = malloc(b->n_names + 1);
        if (!g->sets || !g->names)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory compiling a grammar");
        else {
            if (b->n_sets)
                memcpy(g->sets, b->sets, b->n_sets * sizeof *g->sets);
            memcpy(g->names, b->names ? b->names : "", b->n_names);
            g->names[b->n_names] = 0;
        }
    }
    if (rc == QL_OK)
        rc = check_left_recursion(g, msg, msg_len);
    free(l.rule_of);
    free(l.chain_key);
    free(l.chain_rule);
    free(l.star_of);
    free(l.todo);
    if (rc != QL_OK) {
        gr_grammar_destroy(g);
        return rc;
    }
    *out = g;
    return QL_OK;
}

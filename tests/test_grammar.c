/*
 * test_grammar.c - grammar/'s builder and matcher: what a grammar
 * written through the builder accepts, what gr_build refuses, and the
 * matcher's masks against walking each token's bytes one by one.
 * (The JSON Schema and regex compilers are pinned in test_grammar_schema.)
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "grammar_internal.h"

static bool accepts(const gr_grammar *g, const char *s)
{
    return gr_grammar_accepts(g, s, strlen(s));
}

static gr_grammar *build(gr_builder *b, gr_expr root)
{
    gr_grammar *g = NULL;
    char msg[256];
    int rc = gr_build(b, root, &g, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "gr_build: %s", msg);
    return g;
}

#define LIT(b, s) gr_literal((b), (s), strlen(s))

Test(grammar, literals_alternatives_and_bounded_repeats)
{
    gr_builder *b = gr_builder_new(0);
    /* ("ab" | "c"){2,3} "!" */
    gr_expr x = gr_alt2(b, LIT(b, "ab"), LIT(b, "c"));
    gr_expr root = gr_seq2(b, gr_repeat(b, x, 2, 3), LIT(b, "!"));
    gr_grammar *g = build(b, root);
    gr_builder_free(b);
    cr_assert(accepts(g, "abc!"));
    cr_assert(accepts(g, "cc!"));
    cr_assert(accepts(g, "ababab!"));
    cr_assert(accepts(g, "cabc!"));
    cr_assert_not(accepts(g, "c!"));
    cr_assert_not(accepts(g, "abababc!"));
    cr_assert_not(accepts(g, "abc"));
    cr_assert_not(accepts(g, "a!"));
    cr_assert_not(accepts(g, ""));
    gr_grammar_unref(g);
}

Test(grammar, a_grammar_holds_each_distinct_byte_set_once)
{
    gr_builder *b = gr_builder_new(0);
    gr_expr xs[300];
    for (int i = 0; i < 300; i++) /* "ab", "ba" and [a-c], 100 times each */
        xs[i] = i % 3 == 0 ? LIT(b, "ab") : i % 3 == 1 ? LIT(b, "ba") : gr_byte_range(b, 'a', 'c');
    gr_grammar *g = build(b, gr_seq(b, xs, 300));
    gr_builder_free(b);
    cr_assert_eq(g->n_sets, 3, "%zu sets", g->n_sets);
    char text[700] = "";
    for (int i = 0; i < 100; i++)
        strcat(text, "abbac");
    cr_assert(accepts(g, text));
    text[4] = 'd';
    cr_assert_not(accepts(g, text));
    gr_grammar_unref(g);
}

Test(grammar, unbounded_repeat_of_a_nullable_expression_is_walked_not_refused)
{
    gr_builder *b = gr_builder_new(0);
    /* (a*)* b: the inner star matches the empty string */
    gr_expr inner = gr_repeat(b, LIT(b, "a"), 0, GR_UNBOUNDED);
    gr_expr root = gr_seq2(b, gr_repeat(b, inner, 0, GR_UNBOUNDED), LIT(b, "b"));
    gr_grammar *g = build(b, root);
    gr_builder_free(b);
    cr_assert(accepts(g, "b"));
    cr_assert(accepts(g, "aaaab"));
    cr_assert_not(accepts(g, "aaaa"));
    gr_grammar_unref(g);
}

Test(grammar, recursion_through_named_rules_balances_brackets)
{
    gr_builder *b = gr_builder_new(0);
    /* P ::= ( "(" P ")" P )? */
    gr_expr p = gr_rule(b, "parens");
    gr_expr xs[] = {LIT(b, "("), p, LIT(b, ")"), p};
    cr_assert_eq(gr_define(b, p, gr_optional(b, gr_seq(b, xs, 4))), QL_OK);
    gr_grammar *g = build(b, p);
    gr_builder_free(b);
    cr_assert(accepts(g, ""));
    cr_assert(accepts(g, "(()())()"));
    cr_assert(accepts(g, "((((((((((((((((((((()))))))))))))))))))))"));
    cr_assert_not(accepts(g, "(()"));
    cr_assert_not(accepts(g, "())("));
    gr_grammar_unref(g);
}

Test(grammar, codepoint_sets_match_exactly_their_utf8)
{
    gr_builder *b = gr_builder_new(0);
    const uint32_t ranges[] = {'a',   'z',    0xE9,   0xE9,    0x3B1,
                               0x3C9, 0x4E00, 0x9FFF, 0x1F600, 0x1F64F};
    /* and its complement, written out (ranges in any order) */
    const uint32_t gaps[] = {0x1F650, 0x10FFFF, 0,     'a' - 1, 'z' + 1, 0xE8,
                             0xEA,    0x3B0,    0x3CA, 0x4DFF,  0xA000,  0x1F5FF};
    gr_expr in = gr_codepoints(b, ranges, 5);
    gr_expr out = gr_codepoints(b, gaps, 6);
    gr_grammar *gin = build(b, in), *gout = build(b, out);
    gr_builder_free(b);
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp += cp < 0x800 ? 1 : 61) {
        if (cp >= 0xD800 && cp <= 0xDFFF)
            continue;
        uint8_t s[4];
        size_t n = ql_utf8_put(cp, s);
        bool want = false;
        for (size_t i = 0; i < 5; i++)
            want |= cp >= ranges[2 * i] && cp <= ranges[2 * i + 1];
        cr_assert_eq(gr_grammar_accepts(gin, s, n), want, "U+%04X in the set", cp);
        cr_assert_eq(gr_grammar_accepts(gout, s, n), !want, "U+%04X in the complement", cp);
    }
    /* what is not UTF-8 never matches: overlong, surrogate, past U+10FFFF, a lone continuation */
    const char *bad[] = {"\xC0\xA1", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\x80", "\xE4\xB8"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_not(gr_grammar_accepts(gout, bad[i], strlen(bad[i])), "bad sequence %zu", i);
    gr_grammar_unref(gin);
    gr_grammar_unref(gout);
}

Test(grammar, left_recursion_and_undefined_rules_are_refused_by_name)
{
    char msg[256];
    gr_grammar *g = NULL;
    gr_builder *b = gr_builder_new(0);
    /* list ::= (" ")? list "x" | "y": calls itself after only a nullable element */
    gr_expr list = gr_rule(b, "list");
    gr_expr xs[] = {gr_optional(b, LIT(b, " ")), list, LIT(b, "x")};
    gr_define(b, list, gr_alt2(b, gr_seq(b, xs, 3), LIT(b, "y")));
    cr_assert_eq(gr_build(b, list, &g, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "'list' is left-recursive"), "%s", msg);
    cr_assert_null(g);
    gr_builder_free(b);

    b = gr_builder_new(0);
    gr_expr item = gr_rule(b, "item");
    cr_assert_eq(gr_build(b, gr_seq2(b, LIT(b, "a"), item), &g, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "'item' is used but never defined"), "%s", msg);
    gr_builder_free(b);
}

Test(grammar, the_builders_bound_refuses_a_huge_grammar_quickly)
{
    char msg[256];
    gr_grammar *g = NULL;
    gr_builder *b = gr_builder_new(5000);
    gr_expr big = gr_repeat(b, gr_repeat(b, LIT(b, "abc"), 0, 4000), 4000, 4000);
    cr_assert_eq(gr_build(b, big, &g, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "too large"), "%s", msg);
    gr_builder_free(b);
    b = gr_builder_new(5000);
    cr_assert_lt(gr_repeat(b, LIT(b, "a"), 0, 1000000), 0);
    cr_assert_eq(gr_builder_error(b, msg, sizeof msg), QL_EINVAL);
    gr_builder_free(b);
}

/* --- the matcher over a vocabulary ----------------------------------------------- */

typedef struct vocab_fixture {
    const char *const *tokens;
    int32_t n, eos;
    gr_vocab *v;
} vocab_fixture;

/* gr_token_bytes_fn over a list of token strings (user). */
static long string_token(void *user, int32_t id, uint8_t *out, size_t cap)
{
    const char *s = ((const char *const *)user)[id];
    size_t n = strlen(s);
    if (n > cap)
        return -1;
    memcpy(out, s, n);
    return (long)n;
}

static gr_vocab *make_vocab(const char *const *tokens, int32_t n, int32_t eos)
{
    gr_vocab *v = NULL;
    char msg[256];
    cr_assert_eq(gr_vocab_new(&v, n, string_token, (void *)tokens, eos, msg, sizeof msg), QL_OK,
                 "%s", msg);
    return v;
}

/* The tokens the mask leaves finite. */
static void allowed(gr_matcher *m, int32_t n, bool *out)
{
    float *logits = malloc((size_t)n * sizeof *logits);
    for (int32_t i = 0; i < n; i++)
        logits[i] = 0;
    cr_assert_eq(gr_matcher_mask(m, logits), QL_OK);
    for (int32_t i = 0; i < n; i++)
        out[i] = isfinite(logits[i]);
    free(logits);
}

Test(grammar, masks_allow_exactly_the_tokens_that_keep_the_answer_inside)
{
    /* a+ "b", over tokens that split it every way; 0 is the end token, 1 a
     * control token of no bytes */
    static const char *const tokens[] = {"", "", "a", "b", "ab", "aab", "ba", "c", "bb", "aa"};
    int32_t n = 10;
    gr_vocab *v = make_vocab(tokens, n, 0);
    gr_builder *b = gr_builder_new(0);
    gr_grammar *g = build(b, gr_seq2(b, gr_repeat(b, LIT(b, "a"), 1, GR_UNBOUNDED), LIT(b, "b")));
    gr_builder_free(b);
    gr_matcher *m = NULL;
    char msg[256];
    cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_OK);
    gr_grammar_unref(g); /* the matcher keeps its own reference */
    bool ok[10];
    allowed(m, n, ok);
    bool start[10] = {false, false, true, false, true, true, false, false, false, true};
    cr_assert_arr_eq(ok, start, sizeof ok);
    cr_assert_eq(gr_matcher_accept(m, 3), QL_EINVAL, "\"b\" first is refused");
    cr_assert_eq(gr_matcher_accept(m, 9), QL_OK);
    cr_assert_not(gr_matcher_can_end(m));
    cr_assert_eq(gr_matcher_accept(m, 4), QL_OK); /* "ab": whole */
    cr_assert(gr_matcher_done(m));
    allowed(m, n, ok);
    bool end[10] = {true};
    cr_assert_arr_eq(ok, end, sizeof ok);
    cr_assert_eq(gr_matcher_accept(m, 0), QL_OK);
    gr_matcher_free(m);
    gr_vocab_free(v);
}

/* A small JSON-shaped grammar: value ::= "\"" [a-c]* "\"" | "[" (value ("," value)*)? "]" | digit+
 */
static gr_grammar *small_json(void)
{
    gr_builder *b = gr_builder_new(0);
    gr_expr value = gr_rule(b, "value");
    gr_expr str[] = {LIT(b, "\""), gr_repeat(b, gr_byte_range(b, 'a', 'c'), 0, GR_UNBOUNDED),
                     LIT(b, "\"")};
    gr_expr more = gr_repeat(b, gr_seq2(b, LIT(b, ","), value), 0, GR_UNBOUNDED);
    gr_expr arr[] = {LIT(b, "["), gr_optional(b, gr_seq2(b, value, more)), LIT(b, "]")};
    gr_expr alts[] = {gr_seq(b, str, 3), gr_seq(b, arr, 3),
                      gr_repeat(b, gr_byte_range(b, '0', '9'), 1, GR_UNBOUNDED)};
    gr_define(b, value, gr_alt(b, alts, 3));
    gr_grammar *g = build(b, value);
    gr_builder_free(b);
    return g;
}

static const char *const json_tokens[] = {
    "",     "[",  "]",   "[]",   "\"", "a",   "b",   "c",     "abc",  "\"a",  ",",    ",[",
    "]]",   "1",  "23",  "4\"",  "],", "[\"", "\"]", "\",\"", "x",    "ca",   "[[",   "0]",
    "\"\"", "[1", "5,6", "]]]]", "bb", ",\"", "9",   "[\"ab", "c\"]", "\xc3", "\xa9", " "};

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Random walks: at every step the trie mask equals asking each token
 * alone (a fresh matcher that never built a mask). With bound set, the
 * matcher under test drops its memos at every step. */
static void walk_and_compare(size_t bound, uint64_t seed)
{
    int32_t n = (int32_t)(sizeof json_tokens / sizeof *json_tokens);
    gr_vocab *v = make_vocab(json_tokens, n, 0);
    gr_grammar *g = small_json();
    gr_matcher *m = NULL, *ref = NULL; /* ref follows m but never makes a mask */
    char msg[256];
    cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_OK);
    cr_assert_eq(gr_matcher_new(&ref, g, v, msg, sizeof msg), QL_OK);
    if (bound)
        gr_matcher_set_memory_bound(m, bound);
    bool ok[64], want[64];
    for (int step = 0; step < 60; step++) {
        int32_t pick[64], n_pick = 0;
        for (int32_t t = 0; t < n; t++) /* each token's bytes walked alone */
            want[t] = gr_matcher_allows(ref, t);
        allowed(m, n, ok);
        for (int32_t t = 0; t < n; t++) {
            cr_assert_eq(ok[t], want[t], "seed %llu step %d token %d '%s'",
                         (unsigned long long)seed, step, t, json_tokens[t]);
            if (ok[t])
                pick[n_pick++] = t;
        }
        cr_assert_gt(n_pick, 0, "the grammar never gets stuck");
        int32_t t = pick[next_rand(&seed) % (uint64_t)n_pick];
        cr_assert_eq(gr_matcher_accept(m, t), QL_OK);
        cr_assert_eq(gr_matcher_accept(ref, t), QL_OK);
        if (t == 0)
            break;
    }
    if (bound)
        cr_assert_gt(gr_matcher_compactions(m), 0);
    gr_matcher_free(m);
    gr_matcher_free(ref);
    gr_grammar_unref(g);
    gr_vocab_free(v);
}

Test(grammar, trie_masks_equal_token_by_token_checks_on_random_walks)
{
    for (uint64_t seed = 1; seed <= 20; seed++)
        walk_and_compare(0, seed * 7919);
}

Test(grammar, a_matcher_over_its_memory_bound_drops_its_memos_and_answers_the_same)
{
    for (uint64_t seed = 1; seed <= 10; seed++)
        walk_and_compare(1, seed * 104729);
}

/* 5000 alternatives: 5000 stacks at the start; after "xa" when they
 * follow it (after "x", one) */
static gr_grammar *ambiguous(bool after_xa)
{
    gr_builder *b = gr_builder_new(0);
    gr_expr *alts = malloc(5000 * sizeof *alts);
    for (int i = 0; i < 5000; i++) {
        char s[16];
        snprintf(s, sizeof s, "%d", i);
        alts[i] = LIT(b, s);
    }
    gr_expr all = gr_alt(b, alts, 5000);
    gr_grammar *g = build(b, after_xa ? gr_seq2(b, LIT(b, "xa"), all) : all);
    free(alts);
    gr_builder_free(b);
    return g;
}

Test(grammar, a_grammar_too_ambiguous_for_the_bounds_stops_the_matcher_not_the_process)
{
    static const char *const tokens[] = {"", "a", "1", "a1", "x"};
    gr_vocab *v = make_vocab(tokens, 5, 0);
    gr_matcher *m = NULL;
    char msg[256];
    /* at the start: the matcher is refused, naming the bound */
    gr_grammar *g = ambiguous(false);
    cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "4096 parse stacks"), "%s", msg);
    cr_assert_null(m);
    gr_grammar_unref(g);
    /* two bytes in: the matcher stops, and says why */
    g = ambiguous(true);
    cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(gr_matcher_accept(m, 4), QL_OK);
    float logits[5] = {0};
    cr_assert_eq(gr_matcher_mask(m, logits), QL_EINVAL);
    cr_assert_eq(gr_matcher_accept(m, 1), QL_EINVAL);
    cr_assert_eq(gr_matcher_error(m, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "4096 parse stacks"), "%s", msg);
    gr_matcher_free(m);
    gr_grammar_unref(g);
    gr_vocab_free(v);
}

/* A matcher over a compile of re of its own (no mask shared with
 * another matcher), past the first n of path's tokens. */
static gr_matcher *own_matcher(const char *re, gr_vocab *v, const int32_t *path, int n)
{
    gr_grammar *g = NULL;
    gr_matcher *m = NULL;
    char msg[256];
    cr_assert_eq(gr_compile(GR_REGEX, re, strlen(re), 0, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_OK, "%s", msg);
    gr_grammar_unref(g); /* the matcher holds it */
    for (int i = 0; i < n; i++)
        cr_assert_eq(gr_matcher_accept(m, path[i]), QL_OK);
    return m;
}

/* A mask takes the same steps on any run: given exactly those it is the
 * unbudgeted mask, and the whole budget is spent; given one fewer, the
 * matcher stops at the step past it (QL_EINVAL, naming the budget) and
 * stays stopped. */
Test(grammar, a_matcher_past_its_budget_of_steps_stops_and_says_so)
{
    static const char *const tokens[] = {"", "a", "b", "ab", "ba", "aab", "c", "bc"};
    gr_vocab *v = make_vocab(tokens, 8, 0);
    static const char re[] = "(a|ab|b|ba)*c";
    static const int32_t path[] = {3, 1, 4};
    char msg[256];
    for (int n = 0; n <= 3; n++) {
        gr_matcher *ref = own_matcher(re, v, path, n);
        uint64_t before = gr_matcher_steps(ref);
        float want[8] = {0}, got[8] = {0};
        cr_assert_eq(gr_matcher_mask(ref, want), QL_OK);
        int64_t need = (int64_t)(gr_matcher_steps(ref) - before);
        cr_assert_gt(need, 1, "after %d tokens", n);
        gr_matcher *m = own_matcher(re, v, path, n);
        int64_t left = need;
        gr_matcher_set_budget(m, &left);
        cr_assert_eq(gr_matcher_mask(m, got), QL_OK, "after %d tokens, exactly enough", n);
        cr_assert_eq(left, 0);
        cr_assert_arr_eq(got, want, sizeof want);
        gr_matcher_free(m);
        m = own_matcher(re, v, path, n);
        left = need - 1;
        gr_matcher_set_budget(m, &left);
        before = gr_matcher_steps(m);
        cr_assert_eq(gr_matcher_mask(m, got), QL_EINVAL, "after %d tokens, one step short", n);
        cr_assert_eq((int64_t)(gr_matcher_steps(m) - before), need);
        cr_assert_eq(left, -1);
        cr_assert_eq(gr_matcher_error(m, msg, sizeof msg), QL_EINVAL);
        cr_assert(strstr(msg, "budget"), "%s", msg);
        gr_matcher_set_budget(m, NULL);
        cr_assert_eq(gr_matcher_accept(m, 6), QL_EINVAL, "a stopped matcher stays stopped");
        cr_assert_eq(gr_matcher_error(ref, msg, sizeof msg), QL_OK);
        gr_matcher_free(m);
        gr_matcher_free(ref);
    }
    gr_vocab_free(v);
}

Test(grammar, a_second_matcher_of_a_grammar_takes_the_first_ones_masks_and_they_are_right)
{
    int32_t n = (int32_t)(sizeof json_tokens / sizeof *json_tokens);
    gr_vocab *v = make_vocab(json_tokens, n, 0);
    gr_grammar *g = small_json(), *alone = small_json(); /* alone: the same, unshared */
    char msg[256];
    uint64_t seed = 99;
    for (int round = 0; round < 2; round++) {
        gr_matcher *m = NULL, *ref = NULL;
        cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_OK);
        cr_assert_eq(gr_matcher_new(&ref, alone, v, msg, sizeof msg), QL_OK);
        bool ok[64], want[64];
        for (int step = 0; step < 60; step++) {
            allowed(m, n, ok);
            allowed(ref, n, want);
            cr_assert_arr_eq(ok, want, (size_t)n * sizeof *ok, "round %d step %d", round, step);
            int32_t pick[64], n_pick = 0;
            for (int32_t t = 0; t < n; t++)
                if (ok[t])
                    pick[n_pick++] = t;
            int32_t t = pick[next_rand(&seed) % (uint64_t)n_pick];
            cr_assert_eq(gr_matcher_accept(m, t), QL_OK);
            cr_assert_eq(gr_matcher_accept(ref, t), QL_OK);
            if (t == 0)
                break;
        }
        if (round == 1) /* the first round's states are the second's start */
            cr_assert_gt(gr_matcher_shared_hits(m), 0);
        gr_grammar_unref(alone);
        alone = small_json(); /* a fresh one each round: never shared */
        gr_matcher_free(m);
        gr_matcher_free(ref);
    }
    gr_grammar_unref(g);
    gr_grammar_unref(alone);
    gr_vocab_free(v);
}

Test(grammar, every_grammars_shared_masks_together_stay_inside_the_process_bound)
{
    int32_t n = (int32_t)(sizeof json_tokens / sizeof *json_tokens);
    gr_vocab *v = make_vocab(json_tokens, n, 0);
    /* a few masks' worth (each: its signature, 2 words, an entry) */
    const size_t bound = 600;
    gr_shared_set_total_bound(bound);
    gr_grammar *g[3] = {small_json(), small_json(), small_json()};
    /* three answers, one per grammar, in turns; ref[k] follows m[k] but
     * never makes a mask: each token's bytes are walked alone */
    gr_matcher *m[3], *ref[3];
    char msg[256];
    for (int k = 0; k < 3; k++) {
        cr_assert_eq(gr_matcher_new(&m[k], g[k], v, msg, sizeof msg), QL_OK);
        cr_assert_eq(gr_matcher_new(&ref[k], g[k], v, msg, sizeof msg), QL_OK);
    }
    uint64_t seed = 5;
    size_t most = 0;
    for (int step = 0; step < 200; step++) {
        int k = (int)(next_rand(&seed) % 3);
        bool ok[64];
        allowed(m[k], n, ok);
        int32_t pick[64], n_pick = 0;
        for (int32_t t = 0; t < n; t++) {
            cr_assert_eq(ok[t], gr_matcher_allows(ref[k], t), "step %d token %d", step, t);
            if (ok[t])
                pick[n_pick++] = t;
        }
        size_t total = gr_shared_total_bytes();
        cr_assert_leq(total, bound, "step %d: %zu bytes kept", step, total);
        most = total > most ? total : most;
        int32_t t = pick[next_rand(&seed) % (uint64_t)n_pick];
        cr_assert_eq(gr_matcher_accept(m[k], t), QL_OK);
        cr_assert_eq(gr_matcher_accept(ref[k], t), QL_OK);
        if (t == 0) { /* that answer ended: begin it again */
            gr_matcher_free(m[k]);
            gr_matcher_free(ref[k]);
            cr_assert_eq(gr_matcher_new(&m[k], g[k], v, msg, sizeof msg), QL_OK);
            cr_assert_eq(gr_matcher_new(&ref[k], g[k], v, msg, sizeof msg), QL_OK);
        }
    }
    cr_assert_gt(most, bound / 2, "the masks were shared up to the bound");
    for (int k = 0; k < 3; k++) {
        gr_matcher_free(m[k]);
        gr_matcher_free(ref[k]);
        gr_grammar_unref(g[k]);
    }
    cr_assert_eq(gr_shared_total_bytes(), 0, "a grammar's end gives its bytes back");
    gr_vocab_free(v);
}

/* --- the cache ------------------------------------------------------------------- */

Test(grammar, the_cache_keeps_the_most_recently_used_texts)
{
    gr_cache *c = gr_cache_new(2, 0);
    char msg[256];
    gr_grammar *a, *b, *again, *cc;
    cr_assert_eq(gr_cache_get(c, GR_REGEX, "a+", 2, &a, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(gr_cache_get(c, GR_REGEX, "b+", 2, &b, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(gr_cache_get(c, GR_REGEX, "a+", 2, &again, msg, sizeof msg), QL_OK);
    cr_assert_eq(again, a, "a text met before is not compiled again");
    gr_grammar_unref(again);
    /* a third text: b, the least recently used, makes room */
    cr_assert_eq(gr_cache_get(c, GR_REGEX, "c+", 2, &cc, msg, sizeof msg), QL_OK);
    cr_assert_eq(gr_cache_entries(c), 2);
    cr_assert_eq(gr_cache_get(c, GR_REGEX, "a+", 2, &again, msg, sizeof msg), QL_OK);
    cr_assert_eq(again, a);
    gr_grammar_unref(again);
    /* the same text as another kind is another grammar */
    cr_assert_eq(gr_cache_get(c, GR_JSON_SCHEMA, "{}", 2, &again, msg, sizeof msg), QL_OK);
    cr_assert_neq(again, a);
    gr_grammar_unref(again);
    /* a refusal is the caller's, and not kept */
    gr_grammar *bad = NULL;
    cr_assert_eq(gr_cache_get(c, GR_REGEX, "(a", 2, &bad, msg, sizeof msg), QL_EINVAL);
    cr_assert_null(bad);
    cr_assert_eq(gr_cache_entries(c), 2);
    gr_grammar_unref(a);
    gr_grammar_unref(b);
    gr_grammar_unref(cc);
    gr_cache_free(c);
}

/* Threads that ask for one new text at once. */
typedef struct racer {
    gr_cache *c;
    pthread_barrier_t *go;
    const char *text;
    gr_grammar *g;
} racer;

static void *race(void *arg)
{
    racer *r = arg;
    char msg[256];
    pthread_barrier_wait(r->go);
    if (gr_cache_get(r->c, GR_JSON_SCHEMA, r->text, strlen(r->text), &r->g, msg, sizeof msg))
        r->g = NULL;
    return NULL;
}

Test(grammar, threads_compiling_one_new_text_at_once_leave_one_entry)
{
    /* a schema of some milliseconds to compile, so that they all miss */
    char *schema = malloc(1 << 16);
    size_t at = (size_t)sprintf(schema, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < 300; i++)
        at += (size_t)sprintf(schema + at, "%s\"p%d\":{\"type\":\"string\",\"maxLength\":20}",
                              i ? "," : "", i);
    sprintf(schema + at, "}}");
    gr_cache *c = gr_cache_new(8, 0);
    enum { N = 6 };
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, N);
    racer r[N];
    pthread_t t[N];
    for (int i = 0; i < N; i++) {
        r[i] = (racer){c, &go, schema, NULL};
        pthread_create(&t[i], NULL, race, &r[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        cr_assert_not_null(r[i].g);
        gr_grammar_unref(r[i].g);
    }
    cr_assert_eq(gr_cache_entries(c), 1, "one text, one entry");
    pthread_barrier_destroy(&go);
    gr_cache_free(c);
    free(schema);
}

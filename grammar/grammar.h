/*
 * grammar.h - the public header of grammar/: constrained decoding.
 *
 * A grammar is a context-free language over bytes: what a constrained
 * answer may say. It is written once (from a JSON Schema, a regular
 * expression, or any JSON value) through a small expression builder
 * (gr_builder: literals, byte and code-point sets, sequences,
 * alternatives, bounded and unbounded repeats, named rules for
 * recursion), compiled to flat rules (gr_grammar, immutable, shared by
 * reference between requests and cached by text in a gr_cache), and
 * walked per sequence by a gr_matcher: at each step the matcher gives the
 * tokens whose bytes keep the answer inside the language (a mask over the
 * vocabulary, found by walking the vocabulary as a trie of byte strings,
 * gr_vocab), and advances by the token the sampler chose.
 *
 * Inside the folder: builder.c (gr_builder, the lowering to rules),
 * grammar.c (gr_grammar's references and the masks its matchers share),
 * cache.c (gr_compile, gr_cache), matcher.c (gr_vocab, gr_matcher),
 * regex.c (gr_from_regex), schema.c (gr_from_json_schema),
 * vocab_tokenizer.c (gr_vocab_from_tokenizer). It touches base/, cJSON
 * and tokenizer/ (a token's bytes, read once into the vocabulary's trie).
 */
#ifndef QL_GRAMMAR_H
#define QL_GRAMMAR_H

#include "ql_base.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* --- writing a grammar: the expression builder (builder.c) ------------------ */

/* An expression of one builder: an index into it; negative after an error. */
typedef int32_t gr_expr;
typedef struct gr_builder gr_builder;

/* A builder that refuses to hold more than max_nodes expression nodes and
 * lowered elements together (0: GR_DEFAULT_MAX_NODES): the bound that
 * keeps a huge schema or regex from taking the server's memory or time.
 * NULL when out of memory. */
#define GR_DEFAULT_MAX_NODES 200000
gr_builder *gr_builder_new(size_t max_nodes);
void gr_builder_free(gr_builder *b);
/*
 * Every constructor below returns a new expression, or -1 once the builder
 * has failed (out of memory, over its bound, an argument out of range):
 * the first failure is kept, later calls return -1 at once, and
 * gr_builder_error gives its code and sentence. So a compiler may build a
 * whole tree and check once at the end. An expression may be used many
 * times, in any builder of its own.
 */
int gr_builder_error(const gr_builder *b, char *msg, size_t msg_len);

gr_expr gr_empty(gr_builder *b);                            /* the empty string */
gr_expr gr_nothing(gr_builder *b);                          /* no string at all */
gr_expr gr_literal(gr_builder *b, const void *s, size_t n); /* exactly these bytes */
gr_expr gr_byte_range(gr_builder *b, uint8_t lo, uint8_t hi);
/* One UTF-8 encoded code point in the union of the inclusive ranges
 * ranges[2i]..ranges[2i+1], i < n_ranges; surrogates (U+D800..DFFF) and
 * values past U+10FFFF never match. */
gr_expr gr_codepoints(gr_builder *b, const uint32_t *ranges, size_t n_ranges);
gr_expr gr_seq(gr_builder *b, const gr_expr *xs, size_t n); /* n == 0: empty */
gr_expr gr_alt(gr_builder *b, const gr_expr *xs, size_t n); /* n == 0: nothing */
gr_expr gr_seq2(gr_builder *b, gr_expr x, gr_expr y);
gr_expr gr_alt2(gr_builder *b, gr_expr x, gr_expr y);
/* x repeated min..max times; max GR_UNBOUNDED: no upper bound. */
#define GR_UNBOUNDED (-1)
gr_expr gr_repeat(gr_builder *b, gr_expr x, int32_t min, int32_t max);
gr_expr gr_optional(gr_builder *b, gr_expr x); /* x{0,1} */
/* A named rule, defined (once) later with gr_define: the way to write
 * recursion ($ref to an enclosing schema). The name is copied; it appears
 * in errors ("rule 'x' is left-recursive"). */
gr_expr gr_rule(gr_builder *b, const char *name);
int gr_define(gr_builder *b, gr_expr rule, gr_expr body);

/* --- compiled grammars (builder.c, grammar.c) ----------------------------- */

/* Immutable, reference counted (atomically: any thread may ref and unref). */
typedef struct gr_grammar gr_grammar;

/*
 * Compile root into a grammar. Refused with the reason: the builder's own
 * failure, a rule used but never defined, a rule that can reach itself
 * without reading a byte (left recursion: it could never be walked), or a
 * grammar over the builder's bound once lowered. The builder is not
 * changed and may be freed at once.
 */
int gr_build(gr_builder *b, gr_expr root, gr_grammar **out, char *msg, size_t msg_len);
gr_grammar *gr_grammar_ref(gr_grammar *g);
void gr_grammar_unref(gr_grammar *g);
/* The grammar's size: elements of its rules (what GR_DEFAULT_MAX_NODES bounds). */
size_t gr_grammar_size(const gr_grammar *g);
/* Whether bytes s[0..n) are a whole answer of the language (walks a
 * matcher over bytes; for tests and tools, not the decoding path). */
bool gr_grammar_accepts(const gr_grammar *g, const void *s, size_t n);

/* --- what a grammar can be written from --------------------------------- */

typedef enum gr_kind {
    GR_JSON_SCHEMA, /* text: a JSON Schema document ("{}": any JSON value) */
    GR_REGEX,       /* text: a regular expression the whole answer matches */
} gr_kind;

/*
 * JSON Schema (schema.c): text is the schema as JSON. Writes into b the
 * expression of a JSON document that validates (draft 2020-12 semantics)
 * and sets *root. Keywords it cannot enforce are refused by name (QL_EUNSUPPORTED,
 * "... 'minimum' at /properties/age is not supported"); a malformed schema
 * gets QL_EINVAL naming where (a JSON pointer into the schema).
 */
int gr_from_json_schema(gr_builder *b, const char *text, size_t len, gr_expr *root, char *msg,
                        size_t msg_len);
/*
 * Regular expression (regex.c): the whole answer must match text (as
 * re.fullmatch; leading ^ and trailing $ are allowed and change nothing).
 * Over code points of UTF-8. Refused by name: backreferences, lookaround,
 * anchors inside the expression, and what the syntax does not know, with
 * the offset of the character.
 */
int gr_from_regex(gr_builder *b, const char *text, size_t len, gr_expr *root, char *msg,
                  size_t msg_len);
/* A regular expression matched anywhere in a JSON string's decoded value
 * (JSON Schema's "pattern": unanchored, as ECMA-262 search), as the
 * expression of that string's characters between the quotes, escaped as
 * JSON requires. */
int gr_from_pattern_in_json_string(gr_builder *b, const char *text, size_t len, gr_expr *root,
                                   char *msg, size_t msg_len);

/* Compile text of the kind into a grammar in one call (a builder of
 * max_nodes, 0: the default). */
int gr_compile(gr_kind kind, const char *text, size_t len, size_t max_nodes, gr_grammar **out,
               char *msg, size_t msg_len);

/*
 * A cache of compiled grammars by kind and text (thread safe): the same
 * schema sent by many requests is compiled once. At most max_entries kept,
 * least recently used dropped. gr_cache_get returns a reference of the
 * caller's (or the compile error).
 */
typedef struct gr_cache gr_cache;
gr_cache *gr_cache_new(size_t max_entries, size_t max_nodes);
void gr_cache_free(gr_cache *c);
int gr_cache_get(gr_cache *c, gr_kind kind, const char *text, size_t len, gr_grammar **out,
                 char *msg, size_t msg_len);

/* --- decoding under a grammar (matcher.c) -------------------------------- */

/*
 * A vocabulary as a trie of its tokens' bytes. token_bytes(user, i, out,
 * cap) writes what token i adds to the answer's text in the middle of a
 * stream and returns their count; 0 or less for a token of no bytes (a
 * control token) or of more than cap. Such a token is never allowed by a
 * mask, but for eos (-1: none), which is allowed exactly where the
 * grammar may end. Each token is read once, straight into the
 * vocabulary's own pool. Immutable once made: one per model, shared by
 * every matcher.
 */
typedef struct gr_vocab gr_vocab;
typedef long (*gr_token_bytes_fn)(void *user, int32_t id, uint8_t *out, size_t cap);
int gr_vocab_new(gr_vocab **out, int32_t n_tokens, gr_token_bytes_fn token_bytes, void *user,
                 int32_t eos, char *msg, size_t msg_len);
void gr_vocab_free(gr_vocab *v);
/*
 * The vocabulary as a grammar judges a tokenizer's tokens
 * (vocab_tokenizer.c): what each of n_tokens ids (a model's vocab_size,
 * which may pass the tokenizer's with padding rows) adds to a text in the
 * middle of it (tok_token_bytes; special tokens and ids past the
 * tokenizer's add nothing, so a mask never allows them), eos allowed
 * where a grammar may end. tok is borrowed for the call only; *out is the
 * caller's (gr_vocab_free).
 */
struct tok_tokenizer;
int gr_vocab_from_tokenizer(gr_vocab **out, const struct tok_tokenizer *tok, int32_t n_tokens,
                            int32_t eos, char *msg, size_t msg_len);
/*
 * The matcher steps (below) one request's masks may take in one engine
 * step, for all its choices together: GR_STEP_WALKS whole walks of v's
 * trie, a vocabulary of fewer than GR_STEP_MIN_NODES trie nodes counted
 * as that many. Why: a mask of a grammar that is not ambiguous walks the
 * trie about once (the test suite's schemas and regexes take at most 1.4
 * walks per mask, and 13 per step at n = 64 choices drawing random
 * tokens, on SmolLM2's 49152 tokens, 100297 nodes), while an ambiguous
 * one ((.*.){300}) takes 14 to 64 walks per mask, each walk a few ms of
 * the engine thread that every other request waits for. Counted in
 * steps, not time, so the same request is refused on any machine. The
 * floor keeps small vocabularies' closures (a whole-grammar transition
 * per byte can outweigh a 260-node walk) from being refused: 1048576
 * steps is ~10-20 ms of one core.
 */
#define GR_STEP_WALKS     16
#define GR_STEP_MIN_NODES 65536
int64_t gr_vocab_step_budget(const gr_vocab *v);

/* One sequence's walk through a grammar: its own state, memory bounded. */
typedef struct gr_matcher gr_matcher;
/* g is referenced, v borrowed (it must outlive the matcher). */
int gr_matcher_new(gr_matcher **out, gr_grammar *g, const gr_vocab *v, char *msg, size_t msg_len);
void gr_matcher_free(gr_matcher *m);
/* Set every logit of a token the grammar does not allow now to -inf
 * (logits has the vocabulary's n_tokens entries). Once a call fails the
 * matcher has stopped, and every later one fails the same way:
 * QL_EINVAL when the grammar needs more than the matcher's bounds or its
 * budget allow, QL_ENOMEM when memory runs out (gr_matcher_error). */
int gr_matcher_mask(gr_matcher *m, float *logits);
/*
 * The matcher's work, in matcher steps (a position closed, a stack tested
 * against a byte, a vocabulary trie node walked for a mask: each a few
 * nanoseconds), counted the same on any machine (_steps: in all, the
 * first closure included). Given a budget (left: the steps it may take,
 * the caller's, borrowed until set again; several matchers may share
 * one; NULL, the default: none), each step is taken from *left, and the
 * matcher stops with QL_EINVAL once *left goes below zero. How an engine
 * keeps one request's masks to a share of a step (gr_vocab_step_budget).
 */
void gr_matcher_set_budget(gr_matcher *m, int64_t *left);
uint64_t gr_matcher_steps(const gr_matcher *m);
/* Why m stopped (QL_OK: it has not), its sentence into msg. */
int gr_matcher_error(const gr_matcher *m, char *msg, size_t msg_len);
/* Whether token may come next (eos: whether the grammar may end here). */
bool gr_matcher_allows(gr_matcher *m, int32_t token);
/* Advance by token (which must be allowed: QL_EINVAL otherwise, nothing
 * changed). */
int gr_matcher_accept(gr_matcher *m, int32_t token);
/* Whether the answer so far is a whole sentence of the language, and
 * whether it is and nothing may follow (the only token allowed is eos). */
bool gr_matcher_can_end(const gr_matcher *m);
bool gr_matcher_done(const gr_matcher *m);

#endif

/*
 * test_grammar_schema.c - the grammar compilers of grammar/
 * (schema.c: JSON Schema, regex.c: regular expressions) against reference
 * implementations: tests/fixtures/grammar/vectors.json holds schemas and
 * regexes with candidate texts labelled by Python's jsonschema (Draft
 * 2020-12 with its format checker) and re.fullmatch (make_vectors.py). The
 * grammar writes a subset of the valid texts, so every text marked
 * must_accept (valid and in that subset) is accepted and every invalid one
 * refused. Then: keywords and syntax refused by name and place, grammars
 * over the size bound refused, and random walks of a matcher over a byte
 * vocabulary that end only in texts cJSON parses and the grammar accepts.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "modelfile.h"
#include "test_util.h"

#define VECTORS QL_FIXTURES "/grammar/vectors.json"

static cJSON *load_vectors(void)
{
    cJSON *root = NULL;
    char msg[512];
    int rc = mf_read_json(VECTORS, 4u << 20, &root, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s", msg);
    return root;
}

/* Check one compiled grammar against its labelled texts; the failures
 * (logged), and the counts of texts that had to be accepted and refused. */
static int check_texts(const gr_grammar *g, const char *what, const cJSON *texts, int *n_accept,
                       int *n_refuse)
{
    int failures = 0;
    const cJSON *t;
    cJSON_ArrayForEach (t, texts) {
        const char *text = cJSON_GetObjectItemCaseSensitive(t, "text")->valuestring;
        bool valid = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t, "valid"));
        bool must = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t, "must_accept"));
        bool accepted = gr_grammar_accepts(g, text, strlen(text));
        if ((must && !accepted) || (!valid && accepted)) {
            cr_log_error("%s: %s %s", what, accepted ? "accepts the invalid" : "refuses the valid",
                         text);
            failures++;
        }
        *n_accept += must;
        *n_refuse += !valid;
    }
    return failures;
}

Test(grammar_schema, schema_vectors_agree_with_jsonschema)
{
    cJSON *root = load_vectors();
    int failures = 0, n_accept = 0, n_refuse = 0, n = 0;
    const cJSON *s;
    cJSON_ArrayForEach (s, cJSON_GetObjectItemCaseSensitive(root, "schemas")) {
        const char *name = cJSON_GetObjectItemCaseSensitive(s, "name")->valuestring;
        char *schema = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(s, "schema"));
        gr_grammar *g = NULL;
        char msg[512];
        int rc = gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg);
        if (rc != QL_OK) {
            cr_log_error("%s: %s does not compile: %s", name, schema, msg);
            failures++;
        } else {
            failures += check_texts(g, name, cJSON_GetObjectItemCaseSensitive(s, "texts"),
                                    &n_accept, &n_refuse);
            gr_grammar_unref(g);
        }
        cJSON_free(schema);
        n++;
    }
    cJSON_Delete(root);
    cr_assert_eq(failures, 0, "%d schema vectors disagree with jsonschema", failures);
    /* the file is what it should be: many schemas, both answers pinned */
    cr_assert_geq(n, 50);
    cr_assert_geq(n_accept, 150);
    cr_assert_geq(n_refuse, 100);
}

Test(grammar_schema, regex_vectors_agree_with_python_re)
{
    cJSON *root = load_vectors();
    int failures = 0, n_accept = 0, n_refuse = 0, n = 0;
    const cJSON *r;
    cJSON_ArrayForEach (r, cJSON_GetObjectItemCaseSensitive(root, "regexes")) {
        const char *re = cJSON_GetObjectItemCaseSensitive(r, "regex")->valuestring;
        gr_grammar *g = NULL;
        char msg[512];
        if (gr_compile(GR_REGEX, re, strlen(re), 0, &g, msg, sizeof msg) != QL_OK) {
            cr_log_error("/%s/ does not compile: %s", re, msg);
            failures++;
        } else {
            failures += check_texts(g, re, cJSON_GetObjectItemCaseSensitive(r, "texts"), &n_accept,
                                    &n_refuse);
            gr_grammar_unref(g);
        }
        n++;
    }
    cJSON_Delete(root);
    cr_assert_eq(failures, 0, "%d regex vectors disagree with re.fullmatch", failures);
    cr_assert_geq(n, 20);
    cr_assert_geq(n_accept, 40);
    cr_assert_geq(n_refuse, 30);
}

/* --- refusals ------------------------------------------------------------------------ */

typedef struct refusal {
    const char *text;
    int err;
    const char *says[3]; /* what the message must name */
} refusal;

static void check_refusals(gr_kind kind, const refusal *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        gr_grammar *g = NULL;
        char msg[512] = "";
        int rc = gr_compile(kind, cases[i].text, strlen(cases[i].text), 0, &g, msg, sizeof msg);
        cr_expect_eq(rc, cases[i].err, "%s: got %s (%s), not %s", cases[i].text, ql_err_name(rc),
                     msg, ql_err_name(cases[i].err));
        cr_expect_null(g, "%s", cases[i].text);
        for (int k = 0; k < 3 && cases[i].says[k]; k++)
            cr_expect(strstr(msg, cases[i].says[k]), "%s: \"%s\" does not name %s", cases[i].text,
                      msg, cases[i].says[k]);
        gr_grammar_unref(g);
    }
}

Test(grammar_schema, schema_keywords_it_cannot_enforce_are_refused_by_name_and_pointer)
{
    static const refusal cases[] = {
        {"{\"multipleOf\":2}", QL_EUNSUPPORTED, {"'multipleOf'"}},
        {"{\"type\":\"array\",\"items\":{\"uniqueItems\":true}}",
         QL_EUNSUPPORTED,
         {"'uniqueItems'", "/items"}},
        {"{\"patternProperties\":{\"a\":{}}}", QL_EUNSUPPORTED, {"'patternProperties'"}},
        {"{\"dependentRequired\":{}}", QL_EUNSUPPORTED, {"'dependentRequired'"}},
        {"{\"if\":{},\"then\":{}}", QL_EUNSUPPORTED, {"'if'"}},
        {"{\"anyOf\":[{\"not\":{}}]}", QL_EUNSUPPORTED, {"'not'", "/anyOf/0"}},
        {"{\"contains\":{}}", QL_EUNSUPPORTED, {"'contains'"}},
        {"{\"minProperties\":1}", QL_EUNSUPPORTED, {"'minProperties'"}},
        {"{\"propertyNames\":{}}", QL_EUNSUPPORTED, {"'propertyNames'"}},
        {"{\"unevaluatedProperties\":false}", QL_EUNSUPPORTED, {"'unevaluatedProperties'"}},
        {"{\"x-custom\":1}", QL_EUNSUPPORTED, {"'x-custom'"}},
        {"{\"$defs\":{\"a\":{\"maxContains\":1}},\"$ref\":\"#/$defs/a\"}",
         QL_EUNSUPPORTED,
         {"'maxContains'", "/$defs/a"}},
        {"{\"oneOf\":[{\"type\":\"string\"},{\"type\":\"string\",\"maxLength\":3}]}",
         QL_EUNSUPPORTED,
         {"'oneOf'", "anyOf"}},
        {"{\"oneOf\":[{\"type\":\"integer\"},{\"type\":\"number\"}]}", QL_EUNSUPPORTED, {"anyOf"}},
        {"{\"allOf\":[{},{}]}", QL_EUNSUPPORTED, {"'allOf'"}},
        {"{\"$ref\":\"http://example.com/s.json\"}", QL_EUNSUPPORTED, {"'$ref'"}},
        {"{\"type\":\"string\",\"format\":\"uri\"}", QL_EUNSUPPORTED, {"'uri'"}},
        {"{\"type\":\"array\",\"items\":[{}]}", QL_EUNSUPPORTED, {"'items'", "prefixItems"}},
        {"{\"type\":\"string\",\"pattern\":\"a\",\"maxLength\":3}",
         QL_EUNSUPPORTED,
         {"'pattern'", "'maxLength'"}},
        {"{\"type\":\"string\",\"enum\":[\"a\"],\"minLength\":1}",
         QL_EUNSUPPORTED,
         {"'minLength'", "'enum'"}},
        {"{\"type\":\"object\",\"anyOf\":[{}]}", QL_EUNSUPPORTED, {"'type'", "'anyOf'"}},
        {"{\"$ref\":\"#\",\"type\":\"object\"}", QL_EUNSUPPORTED, {"'type'", "'$ref'"}},
        {"{\"items\":{\"$id\":\"http://x/s\"}}", QL_EUNSUPPORTED, {"'$id'", "/items"}},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)\"}",
         QL_EUNSUPPORTED,
         {"'pattern'", "lookahead", "offset 0"}},
    };
    check_refusals(GR_JSON_SCHEMA, cases, sizeof cases / sizeof cases[0]);
}

Test(grammar_schema, malformed_schemas_are_refused_naming_the_pointer)
{
    static const refusal cases[] = {
        {"not json", QL_EINVAL, {"not JSON"}},
        {"{} x", QL_EINVAL, {"not JSON"}},
        {"3", QL_EINVAL, {"the root"}},
        {"{\"type\":\"strin\"}", QL_EINVAL, {"'type'", "the root"}},
        {"{\"type\":5}", QL_EINVAL, {"'type'"}},
        {"{\"type\":[]}", QL_EINVAL, {"'type'"}},
        {"{\"type\":\"object\",\"required\":\"a\"}", QL_EINVAL, {"'required'"}},
        {"{\"type\":\"object\",\"required\":[1]}", QL_EINVAL, {"'required'"}},
        {"{\"properties\":{\"a\":3}}", QL_EINVAL, {"/properties"}},
        {"{\"$ref\":\"#/$defs/missing\"}", QL_EINVAL, {"#/$defs/missing", "resolve"}},
        {"{\"type\":\"string\",\"minLength\":5,\"maxLength\":2}", QL_EINVAL, {"'minLength'"}},
        {"{\"properties\":{\"a\":{\"type\":\"string\",\"minLength\":-1}}}",
         QL_EINVAL,
         {"'minLength'", "/properties/a"}},
        {"{\"properties\":{\"a/b~\":{\"type\":\"string\",\"maxLength\":1.5}}}",
         QL_EINVAL,
         {"/properties/a~1b~0"}},
        {"{\"type\":\"array\",\"minItems\":3,\"maxItems\":1}", QL_EINVAL, {"'minItems'"}},
        {"{\"enum\":[]}", QL_EINVAL, {"'enum'"}},
        {"{\"type\":\"integer\",\"enum\":[\"a\"]}", QL_EINVAL, {"'enum'"}},
        {"{\"type\":\"string\",\"pattern\":\"(a\"}", QL_EINVAL, {"'pattern'", "'('", "offset 0"}},
        {"{\"type\":\"string\",\"pattern\":3}", QL_EINVAL, {"'pattern'"}},
        {"{\"type\":\"object\",\"required\":[\"x\"],\"additionalProperties\":false}",
         QL_EINVAL,
         {"'x'", "/required/0"}},
        {"{\"anyOf\":[]}", QL_EINVAL, {"'anyOf'"}},
        {"{\"items\":3}", QL_EINVAL, {"'items'"}},
    };
    check_refusals(GR_JSON_SCHEMA, cases, sizeof cases / sizeof cases[0]);
}

Test(grammar_schema, regex_syntax_it_cannot_enforce_is_refused_with_the_offset)
{
    static const refusal cases[] = {
        {"(a", QL_EINVAL, {"unbalanced '('", "offset 0"}},
        {"ab)", QL_EINVAL, {"unbalanced ')'", "offset 2"}},
        {"(a)\\1", QL_EUNSUPPORTED, {"backreference", "offset 3"}},
        {"(?P<n>a)(?P=n)", QL_EUNSUPPORTED, {"backreference", "offset 8"}},
        {"a(?=b)", QL_EUNSUPPORTED, {"lookahead", "offset 1"}},
        {"(?!b)", QL_EUNSUPPORTED, {"lookahead"}},
        {"(?<=a)b", QL_EUNSUPPORTED, {"lookbehind", "offset 0"}},
        {"a^b", QL_EUNSUPPORTED, {"anchor", "offset 1"}},
        {"a$b", QL_EUNSUPPORTED, {"anchor", "offset 1"}},
        {"(^a)", QL_EUNSUPPORTED, {"anchor", "offset 1"}},
        {"\\bfoo", QL_EUNSUPPORTED, {"word boundary", "offset 0"}},
        {"x\\Z", QL_EUNSUPPORTED, {"anchor", "offset 1"}},
        {"*a", QL_EINVAL, {"quantifier of nothing", "offset 0"}},
        {"a|+", QL_EINVAL, {"quantifier of nothing", "offset 2"}},
        {"a**", QL_EUNSUPPORTED, {"quantifier of a quantifier", "offset 2"}},
        {"a{2}+", QL_EUNSUPPORTED, {"quantifier of a quantifier"}},
        {"a{3,2}", QL_EINVAL, {"n > m", "offset 1"}},
        {"a{1001}", QL_EINVAL, {"over 1000", "offset 1"}},
        {"a{,3}", QL_EUNSUPPORTED, {"'{'", "offset 1"}},
        {"[z-a]", QL_EINVAL, {"bad range", "offset 1"}},
        {"[\\d-z]", QL_EINVAL, {"bad range"}},
        {"[abc", QL_EINVAL, {"unterminated class", "offset 0"}},
        {"[]a]", QL_EUNSUPPORTED, {"']'"}},
        {"\\q", QL_EUNSUPPORTED, {"unknown escape", "offset 0"}},
        {"\\x4", QL_EINVAL, {"hexadecimal", "offset 0"}},
        {"\\ud83d", QL_EUNSUPPORTED, {"surrogate", "offset 0"}},
        {"a\\ude00", QL_EUNSUPPORTED, {"surrogate", "offset 1"}},
        {"\\ud83d\\u0041", QL_EUNSUPPORTED, {"surrogate", "offset 0"}},
        {"(?i)abc", QL_EUNSUPPORTED, {"'(?'", "offset 0"}},
        {"a\\", QL_EINVAL, {"trailing", "offset 1"}},
        {"\xff", QL_EINVAL, {"UTF-8", "offset 0"}},
    };
    check_refusals(GR_REGEX, cases, sizeof cases / sizeof cases[0]);
}

Test(grammar_schema, grammars_over_the_size_bound_are_refused)
{
    static const refusal cases[] = {
        {"{\"type\":\"string\",\"maxLength\":10000000}", QL_EINVAL, {NULL}},
        {"{\"type\":\"array\",\"minItems\":10000000}", QL_EINVAL, {NULL}},
    };
    check_refusals(GR_JSON_SCHEMA, cases, sizeof cases / sizeof cases[0]);
    static const refusal regexes[] = {
        {"((a{1000}){1000}){1000}", QL_EINVAL, {NULL}},
        /* copies that write nothing still cost lowering's steps: refused,
         * not walked 10^9 or 10^12 times */
        {"((((a{0}){1000}){1000}){1000})", QL_EINVAL, {"steps", NULL}},
        {"((((()){1000}){1000}){1000}){1000}", QL_EINVAL, {"steps", NULL}},
    };
    check_refusals(GR_REGEX, regexes, sizeof regexes / sizeof regexes[0]);
    /* and a small bound refuses what the default takes */
    gr_grammar *g = NULL;
    char msg[256];
    const char *schema = "{\"type\":\"string\",\"maxLength\":300}";
    cr_assert_eq(gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg), QL_OK,
                 "%s", msg);
    gr_grammar_unref(g);
    g = NULL;
    cr_assert_neq(gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 100, &g, msg, sizeof msg),
                  QL_OK);
    cr_assert_null(g);
}

/* Proving oneOf's branches exclusive has a budget: 3000 consts (4.5
 * million pairs) are refused by name rather than compared for seconds. */
Test(grammar_schema, a_oneof_too_large_to_prove_exclusive_is_refused)
{
    static char schema[3000 * 16];
    size_t s = (size_t)snprintf(schema, sizeof schema, "{\"oneOf\":[");
    for (int i = 0; i < 3000; i++)
        s += (size_t)snprintf(schema + s, sizeof schema - s, "%s{\"const\":%d}", i ? "," : "", i);
    snprintf(schema + s, sizeof schema - s, "]}");
    gr_grammar *g = NULL;
    char msg[256];
    cr_assert_eq(gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg),
                 QL_EUNSUPPORTED);
    cr_expect(strstr(msg, "'oneOf'") && strstr(msg, "anyOf"), "%s", msg);
    schema[2] = 'a', schema[3] = 'n', schema[4] = 'y'; /* "anyOf" takes it */
    cr_assert_eq(gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg), QL_OK,
                 "%s", msg);
    cr_expect(gr_grammar_accepts(g, "2999", 4));
    cr_expect(!gr_grammar_accepts(g, "3000", 4));
    gr_grammar_unref(g);
}

/* Hundreds of required properties: one flat sequence, not a nest deeper
 * than the builder's bound on nesting. */
Test(grammar_schema, objects_of_many_required_properties_compile)
{
    enum { N = 1500 };
    static char schema[N * 40], text[N * 16];
    size_t s = (size_t)snprintf(schema, sizeof schema, "{\"type\":\"object\",\"properties\":{");
    size_t t = (size_t)snprintf(text, sizeof text, "{");
    for (int i = 0; i < N; i++) {
        s += (size_t)snprintf(schema + s, sizeof schema - s, "%s\"p%d\":{\"type\":\"integer\"}",
                              i ? "," : "", i);
        t += (size_t)snprintf(text + t, sizeof text - t, "%s\"p%d\":%d", i ? "," : "", i, i);
    }
    s += (size_t)snprintf(schema + s, sizeof schema - s, "},\"required\":[");
    for (int i = 0; i < N; i++)
        s += (size_t)snprintf(schema + s, sizeof schema - s, "%s\"p%d\"", i ? "," : "", i);
    snprintf(schema + s, sizeof schema - s, "],\"additionalProperties\":false}");
    snprintf(text + t, sizeof text - t, "}");
    gr_grammar *g = NULL;
    char msg[256];
    cr_assert_eq(gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg), QL_OK,
                 "%s", msg);
    cr_expect(gr_grammar_accepts(g, text, strlen(text)));
    text[strlen(text) - 1] = 0; /* without its closing brace */
    cr_expect(!gr_grammar_accepts(g, text, strlen(text)));
    gr_grammar_unref(g);
}

/* A pattern's characters are written as JSON writes them: '"' and '\' only
 * escaped, control characters never raw. */
Test(grammar_schema, an_escaped_surrogate_pair_is_its_one_character)
{
    /* as ECMA-262 reads UTF-16: \ud83d\ude00 is U+1F600, in a class too */
    static const char *const res[] = {"\\ud83d\\ude00", "[\\ud83d\\ude00-\\ud83d\\ude4f]"};
    gr_grammar *g[2] = {NULL, NULL};
    char msg[256];
    for (size_t i = 0; i < 2; i++) {
        cr_assert_eq(gr_compile(GR_REGEX, res[i], strlen(res[i]), 0, &g[i], msg, sizeof msg), QL_OK,
                     "%s: %s", res[i], msg);
        cr_expect(gr_grammar_accepts(g[i], "\xf0\x9f\x98\x80", 4), "%s refuses U+1F600", res[i]);
        cr_expect(!gr_grammar_accepts(g[i], "\xed\xa0\xbd\xed\xb8\x80", 6),
                  "%s takes surrogates' bytes", res[i]);
    }
    cr_expect(gr_grammar_accepts(g[1], "\xf0\x9f\x99\x8f", 4), "U+1F64F is in the range");
    cr_expect(!gr_grammar_accepts(g[1], "\xf0\x9f\x99\x90", 4), "U+1F650 is past it");
    gr_grammar_unref(g[0]);
    gr_grammar_unref(g[1]);
}

Test(grammar_schema, pattern_characters_are_json_escaped)
{
    const char *schema = "{\"type\":\"string\",\"pattern\":\"^[\\\"\\\\\\\\\\\\u0001]$\"}";
    gr_grammar *g = NULL;
    char msg[256];
    cr_assert_eq(gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg), QL_OK,
                 "%s: %s", schema, msg);
    static const char *const yes[] = {"\"\\\"\"", "\"\\\\\"", "\"\\u0001\""};
    static const char *const no[] = {"\"\"\"", "\"\\\"", "\"\x01\"", "\"a\""};
    for (size_t i = 0; i < 3; i++)
        cr_expect(gr_grammar_accepts(g, yes[i], strlen(yes[i])), "%s refused", yes[i]);
    for (size_t i = 0; i < 4; i++)
        cr_expect(!gr_grammar_accepts(g, no[i], strlen(no[i])), "%s accepted", no[i]);
    gr_grammar_unref(g);
}

/* --- random walks ---------------------------------------------------------------------- */

/* Every byte as a token, a few longer ones, and an end token. */
enum { N_BYTES = 256, N_TOKENS = N_BYTES + 7, EOS = N_TOKENS - 1 };
static const char *const long_tokens[] = {"true", "\", \"", "{\"", "\xc3\xa9", "null", "12"};

/* gr_token_bytes_fn: byte i for i < N_BYTES, then long_tokens; EOS has
 * none. */
static long byte_token(void *user, int32_t id, uint8_t *out, size_t cap)
{
    (void)user;
    (void)cap; /* every token here is shorter */
    if (id < N_BYTES) {
        out[0] = (uint8_t)id;
        return 1;
    }
    if (id == EOS)
        return 0;
    size_t n = strlen(long_tokens[id - N_BYTES]);
    memcpy(out, long_tokens[id - N_BYTES], n);
    return (long)n;
}

static gr_vocab *byte_vocab(void)
{
    gr_vocab *v = NULL;
    char msg[256];
    cr_assert_eq(gr_vocab_new(&v, N_TOKENS, byte_token, NULL, EOS, msg, sizeof msg), QL_OK, "%s",
                 msg);
    return v;
}

/* Bytes that close what is open, preferred half the time so walks end. */
static bool closes(int tok)
{
    return tok >= N_BYTES || (tok < 128 && strchr("\"]}0123456789,:", tok) && tok);
}

/* One walk: a random allowed token at a time until the end token is
 * chosen, nothing may follow, or max_steps. The text in out; whether it
 * ended. */
static bool walk(gr_grammar *g, const gr_vocab *v, uint64_t seed, char *out, size_t cap,
                 int max_steps)
{
    gr_matcher *m = NULL;
    char msg[256];
    cr_assert_eq(gr_matcher_new(&m, g, v, msg, sizeof msg), QL_OK, "%s", msg);
    static float logits[N_TOKENS];
    int allowed[N_TOKENS], closing[N_TOKENS];
    size_t len = 0;
    bool ended = false;
    for (int step = 0; step < max_steps && !ended; step++) {
        for (int i = 0; i < N_TOKENS; i++)
            logits[i] = 0.0f;
        cr_assert_eq(gr_matcher_mask(m, logits), QL_OK);
        int n = 0, n_closing = 0;
        for (int i = 0; i < N_TOKENS; i++) {
            bool ok = !isinf(logits[i]);
            cr_assert_eq(ok, gr_matcher_allows(m, i), "mask and allows differ on token %d", i);
            if (ok && i != EOS)
                allowed[n++] = i;
            if (ok && i != EOS && closes(i))
                closing[n_closing++] = i;
        }
        bool can_end = gr_matcher_allows(m, EOS);
        cr_assert_eq(can_end, gr_matcher_can_end(m));
        cr_assert(n > 0 || can_end, "a dead end after %zu bytes: %.*s", len, (int)len, out);
        if (can_end && (n == 0 || test_uniform(&seed) < 0.3)) {
            ended = true;
            break;
        }
        int tok = n_closing && test_uniform(&seed) < 0.6
                      ? closing[test_rand(&seed) % (uint64_t)n_closing]
                      : allowed[test_rand(&seed) % (uint64_t)n];
        cr_assert_eq(gr_matcher_accept(m, tok), QL_OK);
        size_t tl = tok < N_BYTES ? 1 : strlen(long_tokens[tok - N_BYTES]);
        if (len + tl >= cap)
            break;
        memcpy(out + len,
               tok < N_BYTES ? (const char *)&(uint8_t){(uint8_t)tok} : long_tokens[tok - N_BYTES],
               tl);
        len += tl;
        if (gr_matcher_done(m))
            ended = true;
    }
    out[len] = 0;
    gr_matcher_free(m);
    return ended;
}

Test(grammar_schema, random_walks_end_in_json_the_grammar_accepts)
{
    static const char *const schemas[] = {
        "{}",
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},"
        "\"n\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\","
        "\"b\"]},\"maxItems\":3}},\"required\":[\"name\",\"n\"]}",
        "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"number\"},"
        "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/t\"},\"maxItems\":2}},"
        "\"required\":[\"v\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/t\"}",
        "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"format\":\"date-time\"},"
        "\"minItems\":1,\"maxItems\":2}",
        "{\"type\":\"string\",\"pattern\":\"^[a-z]+(-[0-9]+)?$\"}",
        "{\"anyOf\":[{\"type\":\"null\"},{\"type\":\"boolean\"},{\"const\":{\"k\":[1,\"x\"]}}]}",
    };
    gr_vocab *v = byte_vocab();
    static char text[4096];
    for (size_t s = 0; s < sizeof schemas / sizeof schemas[0]; s++) {
        gr_grammar *g = NULL;
        char msg[256];
        cr_assert_eq(
            gr_compile(GR_JSON_SCHEMA, schemas[s], strlen(schemas[s]), 0, &g, msg, sizeof msg),
            QL_OK, "%s: %s", schemas[s], msg);
        int ended = 0;
        for (uint64_t seed = 1; seed <= 40; seed++) {
            if (!walk(g, v, seed * 7919 + s, text, sizeof text, 600))
                continue;
            ended++;
            size_t n = strlen(text);
            cr_expect(gr_grammar_accepts(g, text, n), "%s: the walk's %s is refused", schemas[s],
                      text);
            cr_expect_eq(ql_utf8_invalid_at((const uint8_t *)text, n), -1, "%s", text);
            cJSON *doc = cJSON_ParseWithLength(text, n);
            cr_expect_not_null(doc, "%s: the walk's %s does not parse", schemas[s], text);
            cJSON_Delete(doc);
        }
        cr_log_info("%s: %d of 40 walks ended, the last: %s", schemas[s], ended, text);
        cr_expect_geq(ended, 10, "%s: only %d of 40 walks ended", schemas[s], ended);
        gr_grammar_unref(g);
    }
    gr_vocab_free(v);
}

Test(grammar_schema, random_walks_of_a_regex_stay_in_its_language)
{
    const char *re = "[a-z]{1,5}(,[a-z]{1,5}){0,3}|\\d+\\.\\d{2}|\xc3\xa9+";
    gr_grammar *g = NULL;
    char msg[256];
    cr_assert_eq(gr_compile(GR_REGEX, re, strlen(re), 0, &g, msg, sizeof msg), QL_OK, "%s", msg);
    gr_vocab *v = byte_vocab();
    static char text[1024];
    int ended = 0;
    for (uint64_t seed = 1; seed <= 60; seed++) {
        if (!walk(g, v, seed, text, sizeof text, 200))
            continue;
        ended++;
        cr_expect(gr_grammar_accepts(g, text, strlen(text)), "%s refused", text);
    }
    cr_log_info("/%s/: %d of 60 walks ended, the last: %s", re, ended, text);
    cr_expect_geq(ended, 30);
    gr_grammar_unref(g);
    gr_vocab_free(v);
}

/* The accepted and refused texts of one schema. */
typedef struct bounded_case {
    const char *schema;
    const char *accept[8], *refuse[8];
    double lo, hi; /* every generated value lies in [lo, hi] */
} bounded_case;

Test(grammar_schema, numeric_bounds_generate_only_numbers_inside_them)
{
    static const bounded_case cases[] = {
        {"{\"type\":\"integer\",\"minimum\":0,\"maximum\":120}",
         {"0", "7", "99", "100", "120"},
         {"-1", "121", "007", "1.5", "1000", "-0"},
         0,
         120},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":-3,\"exclusiveMaximum\":3}",
         {"-2", "0", "2"},
         {"-3", "3", "2.0"},
         -2,
         2},
        {"{\"type\":\"integer\",\"minimum\":-250,\"maximum\":-17}",
         {"-17", "-250", "-100", "-99", "-199"},
         {"-16", "-251", "17", "-0", "-1000"},
         -250,
         -17},
        {"{\"type\":\"number\",\"minimum\":0,\"maximum\":1}",
         {"0", "0.5", "1", "1.0", "0.999", "1.000"},
         {"1.5", "1.01", "-0.5", "2", "1e0"},
         0,
         1},
        /* fractional bounds move inward to integers: [-1, 2], a subset */
        {"{\"type\":\"number\",\"minimum\":-1.5,\"maximum\":2.5}",
         {"-1", "-0.5", "0", "1.75", "2", "2.00", "-0.25"},
         {"-1.5", "2.5", "3", "-2", "-1.01"},
         -1.5,
         2.5},
        {"{\"type\":\"number\",\"exclusiveMinimum\":0}",
         {"1", "1.5", "123456", "10.01"},
         {"0", "-1", "0.0"},
         1e-300,
         1e300},
        {"{\"minimum\":5}", {"5", "6.25", "1000"}, {"4", "4.99", "\"a\"", "-5"}, 5, 1e300},
        {"{\"type\":[\"integer\",\"string\"],\"maximum\":10}",
         {"10", "-3", "\"x\""},
         {"11", "10.5"},
         -1e300,
         10},
    };
    gr_vocab *v = byte_vocab();
    static char text[4096];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const bounded_case *k = &cases[i];
        gr_grammar *g = NULL;
        char msg[256];
        cr_assert_eq(
            gr_compile(GR_JSON_SCHEMA, k->schema, strlen(k->schema), 0, &g, msg, sizeof msg), QL_OK,
            "%s: %s", k->schema, msg);
        for (int j = 0; j < 8 && k->accept[j]; j++)
            cr_expect(gr_grammar_accepts(g, k->accept[j], strlen(k->accept[j])), "%s refuses %s",
                      k->schema, k->accept[j]);
        for (int j = 0; j < 8 && k->refuse[j]; j++)
            cr_expect_not(gr_grammar_accepts(g, k->refuse[j], strlen(k->refuse[j])),
                          "%s accepts %s", k->schema, k->refuse[j]);
        for (uint64_t seed = 1; seed <= 40; seed++) { /* what a sampler could write */
            if (!walk(g, v, seed * 104729 + i, text, sizeof text, 200) || text[0] == '"')
                continue;
            char *end = NULL;
            double x = strtod(text, &end);
            cr_expect(end && *end == 0 && x >= k->lo && x <= k->hi, "%s generated %s", k->schema,
                      text);
        }
        gr_grammar_unref(g);
    }
    static const refusal bad[] = {
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", QL_EINVAL, {"leave no", "the root"}},
        {"{\"type\":\"number\",\"minimum\":0.2,\"maximum\":0.8}", QL_EINVAL, {"leave no"}},
        {"{\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":1e20}}}",
         QL_EUNSUPPORTED,
         {"15 digits", "/properties/n"}},
        {"{\"type\":\"integer\",\"maximum\":\"3\"}", QL_EINVAL, {"'maximum'", "a number"}},
        {"{\"enum\":[1,2],\"minimum\":1}", QL_EUNSUPPORTED, {"'minimum'", "'enum'"}},
    };
    check_refusals(GR_JSON_SCHEMA, bad, sizeof bad / sizeof *bad);
    gr_vocab_free(v);
}

/*
 * schema.c - JSON Schema to a grammar expression (gr_from_json_schema):
 * the JSON documents a schema accepts, or a subset of them, never more.
 *
 * Supported: type (a name or a list), properties, required,
 * additionalProperties, items, prefixItems, enum, const, anyOf, oneOf
 * (when its branches are proven exclusive: disjoint types, disjoint
 * enum/const values, or objects whose required property pins different
 * const values), allOf (of one schema), minItems, maxItems, minLength,
 * maxLength, pattern, $ref (to '#' or a JSON pointer '#/...' in the
 * document, ~0 ~1 and %XX decoded, recursive or not: one named rule per
 * referenced schema), format (date, time, date-time, uuid, email, ipv4;
 * on strings, as format only applies to them), minimum, maximum,
 * exclusiveMinimum, exclusiveMaximum (values generated between integer
 * bounds, a fractional or exclusive one moved inward: bounded_number).
 * Ignored, as they constrain nothing: title, description, $schema, $id (at the root only),
 * $comment, default, examples, deprecated, readOnly, writeOnly, discriminator, contentEncoding,
 * contentMediaType, contentSchema, and $defs / definitions (read through $ref). Any other keyword
 * is refused by name and JSON pointer (QL_EUNSUPPORTED): a constraint silently dropped would let
 * through answers the client's validator refuses.
 *
 * The subset, and why:
 *  - objects list their properties in the schema's order, required ones
 *    always and optional ones or not; no property beyond those listed
 *    (additionalProperties true or a schema only matters with no
 *    properties, where any key may come with values under it); a required
 *    name not in properties comes last, its value under
 *    additionalProperties;
 *  - a schema without "type" means the types its keywords constrain
 *    (properties: objects; items: arrays; minLength: strings), or any;
 *  - whitespace between tokens is nothing, one space, or one newline and
 *    up to SC_MAX_INDENT spaces or tabs, never before a comma or a colon
 *    (none before or after the whole document): unbounded whitespace is
 *    an answer a sampler may never end;
 *  - numbers have at most 16 integer digits, 16 fraction digits and a
 *    two-digit exponent, for the same reason;
 *  - const and enum values are written as cJSON prints them (compact);
 *  - string characters are JSON's, escapes included (a \u escape is never a
 *    lone surrogate), except under pattern, where regex.c writes them.
 *  - formats: days 01-28 (always a valid date), times with seconds and a
 *    Z or +HH:MM offset (RFC 3339), as jsonschema's FormatChecker accepts.
 * Combinations whose intersection is not written here (pattern with
 * minLength, enum with minLength, anyOf beside type, ...) are refused.
 *
 * Compiling is linear in the schema's size (lookups go through an index
 * of the document) but for proving oneOf exclusive, which has a budget.
 *
 * It owns nothing past the call: the parsed schema is freed, expressions
 * live in the caller's builder.
 */
#include "grammar.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Spaces or tabs allowed after a newline (an indent of 2 to depth 10). */
#define SC_MAX_INDENT 20
/* Comparisons one oneOf may spend proving its branches exclusive (pairs
 * of branches and of listed values): a few tenths of a second at most;
 * past it the proof is not attempted and oneOf refused. */
#define SC_ONEOF_BUDGET (1L << 22)
/* Subschemas nested deeper than this ($ref chains included) are refused. */
#define SC_MAX_DEPTH 64

enum sc_type {
    T_NULL = 1,
    T_BOOL = 2,
    T_OBJECT = 4,
    T_ARRAY = 8,
    T_NUMBER = 16,
    T_INTEGER = 32,
    T_STRING = 64,
    T_ALL = 127
};
static const char *const sc_type_names[] = {"null",   "boolean", "object", "array",
                                            "number", "integer", "string"};

/* The keywords supported, as bits of a schema's mask. */
enum sc_kw {
    K_TYPE,
    K_PROPERTIES,
    K_REQUIRED,
    K_ADDITIONAL,
    K_ITEMS,
    K_PREFIX,
    K_ENUM,
    K_CONST,
    K_ANYOF,
    K_ONEOF,
    K_ALLOF,
    K_MINITEMS,
    K_MAXITEMS,
    K_MINLEN,
    K_MAXLEN,
    K_PATTERN,
    K_REF,
    K_FORMAT,
    K_MINIMUM,
    K_MAXIMUM,
    K_EXMIN,
    K_EXMAX,
    K_COUNT
};
static const char *const sc_keywords[K_COUNT] = {"type",
                                                 "properties",
                                                 "required",
                                                 "additionalProperties",
                                                 "items",
                                                 "prefixItems",
                                                 "enum",
                                                 "const",
                                                 "anyOf",
                                                 "oneOf",
                                                 "allOf",
                                                 "minItems",
                                                 "maxItems",
                                                 "minLength",
                                                 "maxLength",
                                                 "pattern",
                                                 "$ref",
                                                 "format",
                                                 "minimum",
                                                 "maximum",
                                                 "exclusiveMinimum",
                                                 "exclusiveMaximum"};
#define KB(k)        (1u << (k))
#define K_OBJECT_KWS (KB(K_PROPERTIES) | KB(K_REQUIRED) | KB(K_ADDITIONAL))
#define K_ARRAY_KWS  (KB(K_ITEMS) | KB(K_PREFIX) | KB(K_MINITEMS) | KB(K_MAXITEMS))
#define K_STRING_KWS (KB(K_MINLEN) | KB(K_MAXLEN) | KB(K_PATTERN) | KB(K_FORMAT))
#define K_NUMBER_KWS (KB(K_MINIMUM) | KB(K_MAXIMUM) | KB(K_EXMIN) | KB(K_EXMAX))

/* ($id only at the root: a nested $id starts a schema resource of its
 * own, against which '#/...' inside it would resolve; refused there.
 * The content* keywords are annotations in draft 2020-12, never asserted.) */
static const char *const sc_annotations[] = {"title",         "description",     "$schema",
                                             "$id",           "$comment",        "default",
                                             "examples",      "deprecated",      "readOnly",
                                             "writeOnly",     "$defs",           "definitions",
                                             "discriminator", "contentEncoding", "contentMediaType",
                                             "contentSchema"};

/* Formats, as regular expressions of the string's characters (ASCII, so
 * no JSON escaping is needed). */
#define SC_DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"
#define SC_TIME                                                                                    \
    "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9]" \
    ")"
#define SC_OCTET     "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
#define SC_N_FORMATS 6
static const struct {
    const char *name, *regex;
} sc_formats[SC_N_FORMATS] = {
    {"date", SC_DATE},
    {"time", SC_TIME},
    {"date-time", SC_DATE "T" SC_TIME},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {"email", "[A-Za-z0-9_%+-][A-Za-z0-9._%+-]{0,63}@[A-Za-z0-9]{1,63}(\\.[A-Za-z0-9]{1,63}){1,4}"},
    {"ipv4", SC_OCTET "(\\." SC_OCTET "){3}"},
};

/*
 * An index of the document, so that compiling stays linear in the
 * schema's size (a 1 MiB schema of 20000 properties or $defs must not
 * take seconds): an object's members by key, an array's string elements
 * by value and its elements by position, and each referenced schema's
 * rule. Open addressing, at most half full.
 */
typedef enum sc_slot_kind { S_EMPTY, S_MEMBER, S_POSITION, S_RULE } sc_slot_kind;
typedef struct sc_slot {
    uint8_t kind;
    const cJSON *owner; /* the object or array; for S_RULE, the referenced schema */
    const char *name;   /* S_MEMBER: the key or string element */
    size_t position;    /* S_POSITION */
    const cJSON *value;
    gr_expr rule; /* S_RULE */
} sc_slot;

typedef struct sc_ctx {
    gr_builder *b;
    cJSON *doc;
    char *msg;
    size_t msg_len;
    int err;
    char path[512]; /* the JSON pointer of the schema being compiled */
    int depth;
    sc_slot *slots;
    size_t n_slots, cap_slots; /* cap a power of two */
    /* shared pieces, made once (-2: not yet) */
    gr_expr ws, comma, value, string, string_char, number, integer;
    gr_expr formats[SC_N_FORMATS], any_frac, zero_frac;
} sc_ctx;

static gr_expr compile(sc_ctx *c, const cJSON *s);

/* --- errors and pointers -------------------------------------------------------- */

static const char *where(const sc_ctx *c)
{
    return c->path[0] ? c->path : "the root";
}

static gr_expr sc_fail(sc_ctx *c, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static gr_expr sc_fail(sc_ctx *c, int err, const char *fmt, ...)
{
    if (!c->err) {
        char what[400];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(what, sizeof what, fmt, ap);
        va_end(ap);
        c->err = ql_fail(c->msg, c->msg_len, err, "json schema: %s", what);
    }
    return -1;
}

/* Append /key (escaped as RFC 6901 says) to the path; the old length, to
 * restore with path_pop. */
static size_t path_push(sc_ctx *c, const char *key)
{
    size_t old = strlen(c->path), n = old;
    if (n + 1 < sizeof c->path)
        c->path[n++] = '/';
    for (const char *k = key; *k && n + 2 < sizeof c->path; k++) {
        if (*k == '~' || *k == '/') {
            c->path[n++] = '~';
            c->path[n++] = *k == '~' ? '0' : '1';
        } else {
            c->path[n++] = *k;
        }
    }
    c->path[n] = 0;
    return old;
}

static size_t path_push_index(sc_ctx *c, const char *key, size_t i)
{
    size_t old = path_push(c, key);
    char idx[24];
    snprintf(idx, sizeof idx, "%zu", i);
    path_push(c, idx);
    return old;
}

static void path_pop(sc_ctx *c, size_t old)
{
    c->path[old] = 0;
}

/* --- the index ------------------------------------------------------------------------ */

static size_t slot_hash(const sc_slot *k)
{
    uint64_t h = (uint64_t)(uintptr_t)k->owner * 0x9E3779B97F4A7C15ull ^ k->kind ^ k->position;
    for (const char *p = k->kind == S_MEMBER ? k->name : ""; *p; p++)
        h = (h ^ (uint8_t)*p) * 0x100000001B3ull; /* FNV-1a */
    return (size_t)(h ^ (h >> 29));
}

static bool slot_is(const sc_slot *a, const sc_slot *k)
{
    return a->kind == k->kind && a->owner == k->owner && a->position == k->position &&
           (k->kind != S_MEMBER || !strcmp(a->name, k->name));
}

/* The slot holding k, or the empty one where it would go. */
static sc_slot *slot_find(const sc_ctx *c, const sc_slot *k)
{
    size_t mask = c->cap_slots - 1;
    for (size_t i = slot_hash(k) & mask;; i = (i + 1) & mask)
        if (c->slots[i].kind == S_EMPTY || slot_is(&c->slots[i], k))
            return &c->slots[i];
}

/* The slot holding k, or NULL. */
static const sc_slot *slot_get(const sc_ctx *c, const sc_slot *k)
{
    const sc_slot *at = c->cap_slots ? slot_find(c, k) : NULL;
    return at && at->kind != S_EMPTY ? at : NULL;
}

/* Add k unless a slot holds it already (the first of duplicate keys
 * stays, as cJSON's lookups find it); the slot, or NULL out of memory. */
static sc_slot *slot_put(sc_ctx *c, const sc_slot *k)
{
    if (2 * (c->n_slots + 1) > c->cap_slots) {
        sc_slot *old = c->slots;
        size_t old_cap = c->cap_slots;
        c->cap_slots = old_cap ? 2 * old_cap : 64;
        c->slots = calloc(c->cap_slots, sizeof *c->slots);
        if (!c->slots) {
            sc_fail(c, QL_ENOMEM, "out of memory");
            c->slots = old, c->cap_slots = old_cap;
            return NULL;
        }
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].kind != S_EMPTY)
                *slot_find(c, &old[i]) = old[i];
        free(old);
    }
    sc_slot *at = slot_find(c, k);
    if (at->kind == S_EMPTY) {
        *at = *k;
        c->n_slots++;
    }
    return at;
}

/* Index every object's members and every array's elements of v. */
static bool index_doc(sc_ctx *c, const cJSON *v)
{
    size_t i = 0;
    for (const cJSON *x = v->child; x; x = x->next, i++) {
        sc_slot k = {.owner = v};
        if (cJSON_IsObject(v))
            k.kind = S_MEMBER, k.name = x->string;
        else
            k.kind = S_POSITION, k.position = i;
        k.value = x;
        if (!slot_put(c, &k))
            return false;
        if (cJSON_IsArray(v) && cJSON_IsString(x)) {
            k = (sc_slot){.kind = S_MEMBER, .owner = v, .name = x->valuestring, .value = x};
            if (!slot_put(c, &k))
                return false;
        }
        if (x->child && !index_doc(c, x))
            return false;
    }
    return true;
}

/* The member key of object o, or the first string element equal to key
 * of array o; NULL when none (or o is neither). */
static const cJSON *member(const sc_ctx *c, const cJSON *o, const char *key)
{
    sc_slot k = {.kind = S_MEMBER, .owner = o, .name = key};
    const sc_slot *at = o ? slot_get(c, &k) : NULL;
    return at ? at->value : NULL;
}

/* --- shared pieces --------------------------------------------------------------- */

/* One of this file's own regular expressions: they always compile. */
static gr_expr re(sc_ctx *c, const char *text)
{
    char msg[200];
    gr_expr x;
    int err = gr_from_regex(c->b, text, strlen(text), &x, msg, sizeof msg);
    return err == QL_OK ? x : sc_fail(c, err, "%s", msg);
}

/* re(c, text) made once, into *slot (-2: not yet): a piece every use of
 * which shares its expressions. */
static gr_expr re_once(sc_ctx *c, gr_expr *slot, const char *text)
{
    if (*slot == -2)
        *slot = re(c, text);
    return *slot;
}

static gr_expr lit(sc_ctx *c, const char *s)
{
    return gr_literal(c->b, s, strlen(s));
}

static gr_expr ws(sc_ctx *c)
{
    char text[64];
    snprintf(text, sizeof text, "( |\\n[ \\t]{0,%d})?", SC_MAX_INDENT);
    return re_once(c, &c->ws, text);
}

/* "," ws: between members and items. No whitespace before a comma or a
 * colon, as every JSON printer writes them (json.dumps, JSON.stringify):
 * given the room, a small model spends tokens on "\n," lines. */
static gr_expr comma(sc_ctx *c)
{
    if (c->comma == -2)
        c->comma = gr_seq2(c->b, lit(c, ","), ws(c));
    return c->comma;
}

static gr_expr string_char(sc_ctx *c)
{
    return re_once(c, &c->string_char,
                   "[^\"\\\\\\x00-\\x1f]|\\\\([\"\\\\/bfnrt]|u([0-9a-cA-C][0-9a-fA-F]{3}"
                   "|[dD][0-7][0-9a-fA-F]{2}|[eEfF][0-9a-fA-F]{3}))");
}

static gr_expr quoted(sc_ctx *c, gr_expr body)
{
    gr_expr xs[3] = {lit(c, "\""), body, lit(c, "\"")};
    return gr_seq(c->b, xs, 3);
}

static gr_expr any_string(sc_ctx *c)
{
    if (c->string == -2)
        c->string = quoted(c, gr_repeat(c->b, string_char(c), 0, GR_UNBOUNDED));
    return c->string;
}

static gr_expr number(sc_ctx *c, bool integer)
{
    if (integer)
        return re_once(c, &c->integer, "-?(0|[1-9][0-9]{0,15})");
    return re_once(c, &c->number, "-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?");
}

/* An object of any keys (from the shared string), values under value:
 * '{' (ws member (comma member)*)? ws '}'. */
static gr_expr keyed_object(sc_ctx *c, gr_expr value)
{
    gr_expr m[4] = {any_string(c), lit(c, ":"), ws(c), value};
    gr_expr member = gr_seq(c->b, m, 4);
    gr_expr rest = gr_repeat(c->b, gr_seq2(c->b, comma(c), member), 0, GR_UNBOUNDED);
    gr_expr some[3] = {ws(c), member, rest};
    gr_expr xs[4] = {lit(c, "{"), gr_optional(c->b, gr_seq(c->b, some, 3)), ws(c), lit(c, "}")};
    return gr_seq(c->b, xs, 4);
}

static gr_expr array_tail(sc_ctx *c, gr_expr item, int32_t next, int32_t lo, int32_t hi);

/* Any JSON value: one recursive rule shared by every use. */
static gr_expr any_value(sc_ctx *c)
{
    if (c->value == -2) {
        c->value = gr_rule(c->b, "any JSON value");
        gr_expr arr[4] = {lit(c, "["), array_tail(c, c->value, 1, 0, GR_UNBOUNDED), ws(c),
                          lit(c, "]")};
        gr_expr xs[7] = {keyed_object(c, c->value),
                         gr_seq(c->b, arr, 4),
                         any_string(c),
                         number(c, false),
                         lit(c, "true"),
                         lit(c, "false"),
                         lit(c, "null")};
        gr_define(c->b, c->value, gr_alt(c->b, xs, 7));
    }
    return c->value;
}

/* A JSON value's text as cJSON prints it, as a literal. */
static gr_expr value_literal(sc_ctx *c, const cJSON *v)
{
    char *text = cJSON_PrintUnformatted(v);
    if (!text)
        return sc_fail(c, QL_ENOMEM, "out of memory printing a value at %s", where(c));
    gr_expr x = lit(c, text);
    cJSON_free(text);
    return x;
}

/* --- reading keywords ------------------------------------------------------------- */

static bool is_annotation(const char *key)
{
    for (size_t i = 0; i < sizeof sc_annotations / sizeof sc_annotations[0]; i++)
        if (!strcmp(key, sc_annotations[i]))
            return true;
    return false;
}

/* The supported keywords s has, as bits; any other keyword is refused. */
static unsigned keyword_mask(sc_ctx *c, const cJSON *s)
{
    unsigned mask = 0;
    const cJSON *k;
    cJSON_ArrayForEach (k, s) {
        size_t i = 0;
        while (i < K_COUNT && strcmp(k->string, sc_keywords[i]))
            i++;
        if (i < K_COUNT)
            mask |= KB(i);
        else if (!is_annotation(k->string) || (!strcmp(k->string, "$id") && s != c->doc))
            return sc_fail(c, QL_EUNSUPPORTED, "'%s' at %s is not supported", k->string, where(c)),
                   0;
    }
    return mask;
}

static const char *keyword_name(unsigned mask)
{
    for (int i = 0; i < K_COUNT; i++)
        if (mask & KB(i))
            return sc_keywords[i];
    return "?";
}

/* The bit of the type name n ("null", ..., "string"); 0 when n is none. */
static unsigned type_bit(const cJSON *n)
{
    for (unsigned i = 0; cJSON_IsString(n) && i < 7; i++)
        if (!strcmp(n->valuestring, sc_type_names[i]))
            return 1u << i;
    return 0;
}

/* The types of "type" (a name or a list of names) as bits; 0 after an error. */
static unsigned read_type(sc_ctx *c, const cJSON *t)
{
    unsigned mask = 0;
    const cJSON *one = t;
    bool list = cJSON_IsArray(t);
    if (list && cJSON_GetArraySize(t) == 0)
        return sc_fail(c, QL_EINVAL, "'type' at %s is an empty list", where(c)), 0;
    for (one = list ? t->child : t; one; one = list ? one->next : NULL) {
        unsigned bit = type_bit(one);
        if (!bit)
            return sc_fail(c, QL_EINVAL,
                           "'type' at %s must be one of null, boolean, object, array, number, "
                           "integer, string, or a list of them",
                           where(c)),
                   0;
        mask |= bit;
    }
    return mask;
}

/* A count keyword (minLength, maxItems, ...): *v, or keep *v when absent. */
static bool read_count(sc_ctx *c, const cJSON *s, const char *key, int32_t *v)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!x)
        return true;
    if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble != floor(x->valuedouble)) {
        sc_fail(c, QL_EINVAL, "'%s' at %s must be a non-negative integer", key, where(c));
        return false;
    }
    if (x->valuedouble > INT32_MAX) {
        sc_fail(c, QL_EINVAL, "'%s' at %s is over %d", key, where(c), INT32_MAX);
        return false;
    }
    *v = (int32_t)x->valuedouble;
    return true;
}

static bool read_bounds(sc_ctx *c, const cJSON *s, const char *lo_key, const char *hi_key,
                        int32_t *lo, int32_t *hi)
{
    *lo = 0;
    *hi = GR_UNBOUNDED;
    if (!read_count(c, s, lo_key, lo) || !read_count(c, s, hi_key, hi))
        return false;
    if (*hi != GR_UNBOUNDED && *lo > *hi) {
        sc_fail(c, QL_EINVAL, "'%s' at %s is over '%s'", lo_key, where(c), hi_key);
        return false;
    }
    return true;
}

static bool is_schema(const cJSON *s)
{
    return cJSON_IsObject(s) || cJSON_IsBool(s);
}

/* A subschema under key (and index, when i >= 0), its path pushed. */
static gr_expr compile_at(sc_ctx *c, const cJSON *s, const char *key, long i)
{
    size_t old = i >= 0 ? path_push_index(c, key, (size_t)i) : path_push(c, key);
    gr_expr x = compile(c, s);
    path_pop(c, old);
    return x;
}

/* --- values: enum and const ------------------------------------------------------ */

static unsigned type_of(const cJSON *v)
{
    if (cJSON_IsNull(v))
        return T_NULL;
    if (cJSON_IsBool(v))
        return T_BOOL;
    if (cJSON_IsObject(v))
        return T_OBJECT;
    if (cJSON_IsArray(v))
        return T_ARRAY;
    if (cJSON_IsString(v))
        return T_STRING;
    return isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble)
               ? T_NUMBER | T_INTEGER
               : T_NUMBER;
}

/* Whether every number in v prints as a text that reads back as itself:
 * an integer past 2^53 does not (cJSON holds numbers as doubles). */
static bool printable(const cJSON *v)
{
    if (cJSON_IsNumber(v))
        return fabs(v->valuedouble) < 9007199254740992.0;
    for (const cJSON *x = v->child; x; x = x->next)
        if (!printable(x))
            return false;
    return true;
}

/* const or enum, values filtered by "type" when given. */
static gr_expr compile_values(sc_ctx *c, const cJSON *s, unsigned mask)
{
    if ((mask & KB(K_CONST)) && (mask & KB(K_ENUM)))
        return sc_fail(c, QL_EUNSUPPORTED, "'const' alongside 'enum' at %s is not supported",
                       where(c));
    unsigned other = mask & ~(KB(K_CONST) | KB(K_ENUM) | KB(K_TYPE));
    if (other)
        return sc_fail(c, QL_EUNSUPPORTED, "'%s' alongside '%s' at %s is not supported",
                       keyword_name(other), mask & KB(K_CONST) ? "const" : "enum", where(c));
    unsigned types = T_ALL;
    if (mask & KB(K_TYPE) && !(types = read_type(c, cJSON_GetObjectItemCaseSensitive(s, "type"))))
        return -1;
    const cJSON *values = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *one = cJSON_GetObjectItemCaseSensitive(s, "const");
    if (values && (!cJSON_IsArray(values) || !values->child))
        return sc_fail(c, QL_EINVAL, "'enum' at %s must be a non-empty list", where(c));
    gr_expr *parts = calloc(values ? (size_t)cJSON_GetArraySize(values) : 1, sizeof *parts);
    if (!parts)
        return sc_fail(c, QL_ENOMEM, "out of memory");
    size_t n = 0;
    for (const cJSON *v = values ? values->child : one; v && !c->err; v = values ? v->next : NULL) {
        if (!printable(v))
            sc_fail(c, QL_EUNSUPPORTED, "a number past 2^53 in '%s' at %s is not supported",
                    values ? "enum" : "const", where(c));
        else if (type_of(v) & types)
            parts[n++] = value_literal(c, v);
    }
    if (!n && !c->err)
        sc_fail(c, QL_EINVAL, "no value of '%s' at %s has the type 'type' asks for",
                values ? "enum" : "const", where(c));
    gr_expr out = c->err ? -1 : gr_alt(c->b, parts, n);
    free(parts);
    return out;
}

/* --- strings ---------------------------------------------------------------------- */

static gr_expr compile_format(sc_ctx *c, const cJSON *f)
{
    if (!cJSON_IsString(f))
        return sc_fail(c, QL_EINVAL, "'format' at %s must be a string", where(c));
    for (size_t i = 0; i < SC_N_FORMATS; i++)
        if (!strcmp(f->valuestring, sc_formats[i].name))
            return quoted(c, re_once(c, &c->formats[i], sc_formats[i].regex));
    return sc_fail(c, QL_EUNSUPPORTED, "'format' '%s' at %s is not supported", f->valuestring,
                   where(c));
}

static gr_expr compile_string(sc_ctx *c, const cJSON *s, unsigned mask)
{
    int32_t lo, hi;
    if (!read_bounds(c, s, "minLength", "maxLength", &lo, &hi))
        return -1;
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(s, "pattern");
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(s, "format");
    unsigned lengths = mask & (KB(K_MINLEN) | KB(K_MAXLEN));
    if ((pattern || format) && lengths)
        return sc_fail(c, QL_EUNSUPPORTED, "'%s' alongside '%s' at %s is not supported",
                       pattern ? "pattern" : "format", keyword_name(lengths), where(c));
    if (pattern && format)
        return sc_fail(c, QL_EUNSUPPORTED, "'pattern' alongside 'format' at %s is not supported",
                       where(c));
    if (format)
        return compile_format(c, format);
    if (pattern) {
        if (!cJSON_IsString(pattern))
            return sc_fail(c, QL_EINVAL, "'pattern' at %s must be a string", where(c));
        char msg[300];
        gr_expr body;
        int err = gr_from_pattern_in_json_string(
            c->b, pattern->valuestring, strlen(pattern->valuestring), &body, msg, sizeof msg);
        if (err != QL_OK)
            return sc_fail(c, err, "'pattern' at %s: %s", where(c), msg);
        return quoted(c, body);
    }
    if (lo == 0 && hi == GR_UNBOUNDED)
        return any_string(c);
    return quoted(c, gr_repeat(c->b, string_char(c), lo, hi));
}

/* --- arrays ------------------------------------------------------------------------ */

/* Items after the prefix: next is the 1-based index of the next item
 * (next - 1 written), item its schema (-1: none may follow). */
static gr_expr array_tail(sc_ctx *c, gr_expr item, int32_t next, int32_t lo, int32_t hi)
{
    int32_t done = next - 1;
    if (item < 0)
        return done >= lo ? gr_empty(c->b) : gr_nothing(c->b);
    int32_t more_lo = lo > done ? lo - done : 0;
    int32_t more_hi = hi == GR_UNBOUNDED ? GR_UNBOUNDED : hi - done;
    if (more_hi != GR_UNBOUNDED && more_hi < more_lo)
        return gr_nothing(c->b);
    if (next > 1)
        return gr_repeat(c->b, gr_seq2(c->b, comma(c), item), more_lo, more_hi);
    if (more_hi == 0)
        return gr_empty(c->b);
    gr_expr rest = gr_repeat(c->b, gr_seq2(c->b, comma(c), item), more_lo > 0 ? more_lo - 1 : 0,
                             more_hi == GR_UNBOUNDED ? GR_UNBOUNDED : more_hi - 1);
    gr_expr some[3] = {ws(c), item, rest};
    gr_expr x = gr_seq(c->b, some, 3);
    return more_lo == 0 ? gr_optional(c->b, x) : x;
}

static gr_expr compile_array(sc_ctx *c, const cJSON *s)
{
    int32_t lo, hi;
    if (!read_bounds(c, s, "minItems", "maxItems", &lo, &hi))
        return -1;
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    const cJSON *prefix = cJSON_GetObjectItemCaseSensitive(s, "prefixItems");
    if (items && cJSON_IsArray(items))
        return sc_fail(c, QL_EUNSUPPORTED,
                       "'items' as a list (a tuple before draft 2020-12) at %s is not supported: "
                       "use 'prefixItems'",
                       where(c));
    if ((items && !is_schema(items)) || (prefix && (!cJSON_IsArray(prefix) || !prefix->child)))
        return sc_fail(c, QL_EINVAL, "'%s' at %s must be a %s",
                       items && !is_schema(items) ? "items" : "prefixItems", where(c),
                       items && !is_schema(items) ? "schema" : "non-empty list of schemas");
    gr_expr item = -1;
    if (!items)
        item = any_value(c);
    else if (!cJSON_IsFalse(items))
        item = compile_at(c, items, "items", -1);
    int32_t k = prefix ? cJSON_GetArraySize(prefix) : 0;
    gr_expr tail = array_tail(c, item, k + 1, lo, hi);
    /* the prefix from its end: after item j - 1, stop there or write item j and go on */
    for (int32_t j = k; j >= 1 && !c->err; j--) {
        gr_expr x = compile_at(c, cJSON_GetArrayItem(prefix, j - 1), "prefixItems", j - 1);
        gr_expr step[3] = {j == 1 ? ws(c) : comma(c), x, tail};
        gr_expr go = j - 1 < hi || hi == GR_UNBOUNDED ? gr_seq(c->b, step, 3) : gr_nothing(c->b);
        tail = gr_alt2(c->b, j - 1 >= lo ? gr_empty(c->b) : gr_nothing(c->b), go);
    }
    gr_expr xs[4] = {lit(c, "["), tail, ws(c), lit(c, "]")};
    return gr_seq(c->b, xs, 4);
}

/* --- objects ----------------------------------------------------------------------- */

typedef struct sc_member {
    gr_expr kv; /* "name" ws ':' ws value */
    bool required;
} sc_member;

static gr_expr member_kv(sc_ctx *c, const char *name, gr_expr value)
{
    cJSON *key = cJSON_CreateString(name);
    gr_expr k = key ? value_literal(c, key) : sc_fail(c, QL_ENOMEM, "out of memory");
    cJSON_Delete(key);
    gr_expr xs[4] = {k, lit(c, ":"), ws(c), value};
    return gr_seq(c->b, xs, 4);
}

/* The listed members in order, required ones always, optional ones or
 * not, built from the end: next[first] is what may follow once the
 * members before are settled (first: none written yet, so no comma). A
 * run of required members is one flat sequence, not a nest of pairs: the
 * builder bounds how deep sequences nest, and schemas list hundreds. */
static gr_expr member_chain(sc_ctx *c, const sc_member *m, size_t n)
{
    gr_expr next[2] = {gr_empty(c->b), gr_empty(c->b)};
    gr_expr *xs = calloc(2 * n + 1, sizeof *xs);
    if (!xs)
        return sc_fail(c, QL_ENOMEM, "out of memory");
    for (size_t i = n; i > 0;) {
        size_t from = i - 1; /* an optional member alone, or the run of required ones */
        while (m[i - 1].required && from > 0 && m[from - 1].required)
            from--;
        gr_expr cur[2];
        for (int first = 0; first < 2; first++) {
            size_t k = 0;
            for (size_t j = from; j < i; j++) {
                xs[k++] = j == from && first ? ws(c) : comma(c);
                xs[k++] = m[j].kv;
            }
            xs[k++] = next[0];
            gr_expr with = gr_seq(c->b, xs, k);
            cur[first] = m[from].required ? with : gr_alt2(c->b, with, next[first]);
        }
        next[0] = cur[0];
        next[1] = cur[1];
        i = from;
    }
    free(xs);
    return next[1];
}

static gr_expr compile_object(sc_ctx *c, const cJSON *s)
{
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *required = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    const cJSON *x;
    if (props && !cJSON_IsObject(props))
        return sc_fail(c, QL_EINVAL, "'properties' at %s must be an object", where(c));
    if (extra && !is_schema(extra))
        return sc_fail(c, QL_EINVAL, "'additionalProperties' at %s must be a schema", where(c));
    if (required && !cJSON_IsArray(required))
        return sc_fail(c, QL_EINVAL, "'required' at %s must be a list of strings", where(c));
    cJSON_ArrayForEach (x, required)
        if (!cJSON_IsString(x))
            return sc_fail(c, QL_EINVAL, "'required' at %s must be a list of strings", where(c));
    if (!(props && props->child) && !(required && required->child)) {
        if (extra && cJSON_IsFalse(extra)) {
            gr_expr xs[3] = {lit(c, "{"), ws(c), lit(c, "}")};
            return gr_seq(c->b, xs, 3);
        }
        return keyed_object(c, extra && cJSON_IsObject(extra)
                                   ? compile_at(c, extra, "additionalProperties", -1)
                                   : any_value(c));
    }
    size_t n = (size_t)cJSON_GetArraySize(props) + (size_t)cJSON_GetArraySize(required), k = 0;
    sc_member *m = calloc(n ? n : 1, sizeof *m);
    if (!m)
        return sc_fail(c, QL_ENOMEM, "out of memory");
    cJSON_ArrayForEach (x, props) {
        size_t old = path_push(c, "properties");
        bool schema = is_schema(x);
        gr_expr v = schema
                        ? compile_at(c, x, x->string, -1)
                        : sc_fail(c, QL_EINVAL, "'%s' at %s must be a schema", x->string, where(c));
        path_pop(c, old);
        if (!schema)
            break;
        m[k++] = (sc_member){member_kv(c, x->string, v), member(c, required, x->string) != NULL};
    }
    /* required names not in properties: values under additionalProperties */
    long i = -1;
    cJSON_ArrayForEach (x, required) {
        i++;
        /* listed in properties, or named before (member gives the first) */
        if (c->err || member(c, props, x->valuestring) || member(c, required, x->valuestring) != x)
            continue;
        if (extra && cJSON_IsFalse(extra)) {
            size_t old = path_push_index(c, "required", (size_t)i);
            sc_fail(c, QL_EINVAL,
                    "'%s' at %s is required but not in 'properties' and 'additionalProperties' "
                    "is false: no object is valid",
                    x->valuestring, where(c));
            path_pop(c, old);
            break;
        }
        gr_expr v = extra && cJSON_IsObject(extra)
                        ? compile_at(c, extra, "additionalProperties", -1)
                        : any_value(c);
        m[k++] = (sc_member){member_kv(c, x->valuestring, v), true};
    }
    gr_expr out = -1;
    if (!c->err) {
        gr_expr xs[4] = {lit(c, "{"), member_chain(c, m, k), ws(c), lit(c, "}")};
        out = gr_seq(c->b, xs, 4);
    }
    free(m);
    return out;
}

/* --- numbers with bounds ------------------------------------------------------------ */

/* The largest integer part a bounded number is generated with: 15
 * digits, below 2^53, so a bound read as a double is exact. */
#define SC_MAX_UINT 999999999999999ULL

/* The fixed-width digit strings from x to y (d digits each, x <= y,
 * leading zeros allowed): the usual split of a range by its first digit
 * (a prefix of x's, whole middle digits, a prefix of y's). */
static gr_expr digit_range(sc_ctx *c, const char *x, const char *y, size_t d)
{
    if (d == 0)
        return gr_empty(c->b);
    if (x[0] == y[0])
        return gr_seq2(c->b, gr_byte_range(c->b, (uint8_t)x[0], (uint8_t)x[0]),
                       digit_range(c, x + 1, y + 1, d - 1));
    static const char nines[] = "9999999999999999", zeros[] = "0000000000000000";
    bool x_low = strspn(x + 1, "0") >= d - 1, y_high = strspn(y + 1, "9") >= d - 1;
    gr_expr parts[3];
    size_t n = 0;
    if (!x_low)
        parts[n++] = gr_seq2(c->b, gr_byte_range(c->b, (uint8_t)x[0], (uint8_t)x[0]),
                             digit_range(c, x + 1, nines, d - 1));
    char lo = (char)(x[0] + (x_low ? 0 : 1)), hi = (char)(y[0] - (y_high ? 0 : 1));
    if (lo <= hi)
        parts[n++] = gr_seq2(
            c->b, gr_byte_range(c->b, (uint8_t)lo, (uint8_t)hi),
            gr_repeat(c->b, gr_byte_range(c->b, '0', '9'), (int32_t)(d - 1), (int32_t)(d - 1)));
    if (!y_high)
        parts[n++] = gr_seq2(c->b, gr_byte_range(c->b, (uint8_t)y[0], (uint8_t)y[0]),
                             digit_range(c, zeros, y + 1, d - 1));
    return gr_alt(c->b, parts, n);
}

/* The decimal integers a..b (a <= b <= SC_MAX_UINT), without leading
 * zeros: one fixed-width range per digit count. */
static gr_expr uint_range(sc_ctx *c, uint64_t a, uint64_t b)
{
    gr_expr parts[17];
    size_t n = 0;
    uint64_t first = 0, last = 9; /* the d-digit numbers */
    for (size_t d = 1; d <= 16 && first <= b; d++, first = last + 1, last = last * 10 + 9) {
        uint64_t lo = a > first ? a : first, hi = b < last ? b : last;
        if (lo > hi)
            continue;
        char x[24], y[24];
        snprintf(x, sizeof x, "%0*llu", (int)d, (unsigned long long)lo);
        snprintf(y, sizeof y, "%0*llu", (int)d, (unsigned long long)hi);
        parts[n++] = digit_range(c, x, y, d);
    }
    return gr_alt(c->b, parts, n);
}

/* A magnitude from a to b (b past SC_MAX_UINT: none above), with a
 * fraction: integer parts a..b-1 take any fraction, b only zeros (so the
 * value never passes b). */
static gr_expr magnitude(sc_ctx *c, uint64_t a, uint64_t b, bool integer)
{
    if (integer)
        return uint_range(c, a, b > SC_MAX_UINT ? SC_MAX_UINT : b);
    gr_expr any_frac = re_once(c, &c->any_frac, "(\\.[0-9]{1,16})?");
    if (b > SC_MAX_UINT)
        return gr_seq2(c->b, uint_range(c, a, SC_MAX_UINT), any_frac);
    gr_expr last = gr_seq2(c->b, uint_range(c, b, b), re_once(c, &c->zero_frac, "(\\.0{1,16})?"));
    if (a == b)
        return last;
    return gr_alt2(c->b, gr_seq2(c->b, uint_range(c, a, b - 1), any_frac), last);
}

/* One bound keyword as an integer bound on the values generated (a
 * subset: an exclusive or fractional bound moves inward to the next
 * integer): false after an error; *set false when absent. */
static bool read_limit(sc_ctx *c, const cJSON *s, const char *key, bool upper, bool exclusive,
                       double *limit, bool *set)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(s, key);
    *set = x != NULL;
    if (!x)
        return true;
    if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble)) {
        sc_fail(c, QL_EINVAL, "'%s' at %s must be a number", key, where(c));
        return false;
    }
    double v = upper ? floor(x->valuedouble) : ceil(x->valuedouble);
    if (exclusive && v == x->valuedouble)
        v += upper ? -1 : 1;
    *limit = v;
    return true;
}

/* A number (or integer) within minimum, maximum, exclusiveMinimum and
 * exclusiveMaximum. Values are generated from integer bounds (an
 * exclusive or fractional one moves inward to the next integer: a subset
 * of what validates), with no exponent, and at most 15 integer digits. A
 * range that keeps no integer part is refused. */
static gr_expr bounded_number(sc_ctx *c, const cJSON *s, bool integer)
{
    double lo = -(double)SC_MAX_UINT, hi = (double)SC_MAX_UINT, v;
    bool set;
    static const struct {
        const char *key;
        bool upper, exclusive;
    } keys[] = {{"minimum", false, false},
                {"exclusiveMinimum", false, true},
                {"maximum", true, false},
                {"exclusiveMaximum", true, true}};
    bool hi_set = false, lo_set = false;
    for (size_t i = 0; i < 4; i++) {
        if (!read_limit(c, s, keys[i].key, keys[i].upper, keys[i].exclusive, &v, &set))
            return -1;
        if (set && keys[i].upper && (!hi_set || v < hi))
            hi = v, hi_set = true;
        if (set && !keys[i].upper && (!lo_set || v > lo))
            lo = v, lo_set = true;
    }
    if (lo > (double)SC_MAX_UINT || hi < -(double)SC_MAX_UINT)
        return sc_fail(c, QL_EUNSUPPORTED,
                       "the bounds at %s are past 15 digits, the most a bounded number has",
                       where(c));
    if (lo < -(double)SC_MAX_UINT)
        lo = -(double)SC_MAX_UINT;
    if (hi > (double)SC_MAX_UINT)
        hi = (double)SC_MAX_UINT;
    if (lo > hi)
        return sc_fail(c, lo_set && hi_set ? QL_EINVAL : QL_EUNSUPPORTED,
                       "the bounds at %s leave no %s to generate", where(c),
                       integer ? "integer" : "number with an integer part between them");
    /* unbounded above: any magnitude, fractions included */
    uint64_t top = hi_set || integer ? (uint64_t)fabs(hi) : SC_MAX_UINT + 1;
    gr_expr parts[2];
    size_t n = 0;
    if (hi >= 0) /* 0 and up: magnitudes max(lo, 0) .. hi */
        parts[n++] = magnitude(c, lo > 0 ? (uint64_t)lo : 0, top, integer);
    if (lo < 0) { /* below 0: -m for m from max(-hi, 1) to -lo */
        uint64_t from = hi < 0 ? (uint64_t)-hi : 1;
        uint64_t to = lo_set || integer ? (uint64_t)-lo : SC_MAX_UINT + 1;
        if (!integer && hi >= 0)
            from = 0; /* -0.5 lies between -1 and 0 */
        parts[n++] = gr_seq2(c->b, lit(c, "-"), magnitude(c, from, to, integer));
    }
    return gr_alt(c->b, parts, n);
}

/* --- typed schemas ------------------------------------------------------------------ */

/* The types a schema without "type" can mean, from its keywords: those a
 * keyword constrains (writing only those is a subset), or all. */
static unsigned implied_types(unsigned mask)
{
    unsigned t = 0;
    if (mask & K_OBJECT_KWS)
        t |= T_OBJECT;
    if (mask & K_ARRAY_KWS)
        t |= T_ARRAY;
    if (mask & K_STRING_KWS)
        t |= T_STRING;
    if (mask & K_NUMBER_KWS)
        t |= T_NUMBER | T_INTEGER;
    return t ? t : T_ALL;
}

static gr_expr compile_typed(sc_ctx *c, const cJSON *s, unsigned mask)
{
    unsigned types = implied_types(mask);
    if (mask & KB(K_TYPE) && !(types = read_type(c, cJSON_GetObjectItemCaseSensitive(s, "type"))))
        return -1;
    if (types == T_ALL && !(mask & (K_OBJECT_KWS | K_ARRAY_KWS | K_STRING_KWS | K_NUMBER_KWS)))
        return any_value(c);
    gr_expr parts[7];
    size_t n = 0;
    if (types & T_OBJECT)
        parts[n++] = compile_object(c, s);
    if (types & T_ARRAY)
        parts[n++] = compile_array(c, s);
    if (types & T_STRING)
        parts[n++] = compile_string(c, s, mask);
    if (types & (T_NUMBER | T_INTEGER)) /* number holds every integer */
        parts[n++] = mask & K_NUMBER_KWS ? bounded_number(c, s, !(types & T_NUMBER))
                                         : number(c, !(types & T_NUMBER));
    if (types & T_BOOL)
        parts[n++] = gr_alt2(c->b, lit(c, "true"), lit(c, "false"));
    if (types & T_NULL)
        parts[n++] = lit(c, "null");
    return c->err ? -1 : n == 1 ? parts[0] : gr_alt(c->b, parts, n);
}

/* --- $ref ---------------------------------------------------------------------------- */

/* The schema a "#..." reference names, or NULL. Only '#' and JSON
 * pointers into this document ("#/$defs/a", "#/definitions/a", ...). */
static const cJSON *resolve(const sc_ctx *c, const char *ref)
{
    if (ref[0] != '#')
        return NULL;
    const cJSON *at = c->doc;
    const char *p = ref + 1;
    if (*p && *p != '/')
        return NULL;
    while (*p == '/' && at) {
        char token[256];
        size_t n = 0;
        for (p++; *p && *p != '/'; p++) {
            if (n + 1 >= sizeof token)
                return NULL;
            if (*p == '~' && (p[1] == '0' || p[1] == '1'))
                token[n++] = *++p == '0' ? '~' : '/';
            else if (*p == '%' && isxdigit((unsigned char)p[1]) && isxdigit((unsigned char)p[2]))
                token[n++] = (char)strtol((char[3]){p[1], p[2], 0}, NULL, 16), p += 2; /* %XX */
            else
                token[n++] = *p;
        }
        token[n] = 0;
        if (cJSON_IsArray(at)) {
            char *end;
            long i = strtol(token, &end, 10);
            sc_slot k = {.kind = S_POSITION, .owner = at, .position = (size_t)i};
            const sc_slot *slot = n && !*end && i >= 0 ? slot_get(c, &k) : NULL;
            at = slot ? slot->value : NULL;
        } else {
            at = cJSON_IsObject(at) ? member(c, at, token) : NULL;
        }
    }
    return at;
}

/* The rule of a referenced schema: made, and its body compiled with the
 * path at the target, the first time it is referenced. */
static gr_expr rule_for(sc_ctx *c, const cJSON *target, const char *ref)
{
    sc_slot k = {.kind = S_RULE, .owner = target};
    const sc_slot *known = slot_get(c, &k);
    if (known)
        return known->rule;
    gr_expr rule = gr_rule(c->b, ref);
    k.rule = rule;
    if (!slot_put(c, &k))
        return -1;
    char saved[sizeof c->path];
    memcpy(saved, c->path, sizeof saved);
    snprintf(c->path, sizeof c->path, "%s", ref + 1);
    gr_expr body = compile(c, target);
    memcpy(c->path, saved, sizeof saved);
    if (!c->err)
        gr_define(c->b, rule, body);
    return c->err ? -1 : rule;
}

static gr_expr compile_ref(sc_ctx *c, const cJSON *s)
{
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    if (!cJSON_IsString(ref))
        return sc_fail(c, QL_EINVAL, "'$ref' at %s must be a string", where(c));
    if (ref->valuestring[0] != '#' || (ref->valuestring[1] && ref->valuestring[1] != '/'))
        return sc_fail(c, QL_EUNSUPPORTED,
                       "'$ref' '%s' at %s is not supported: only '#' and '#/...' pointers into "
                       "the schema",
                       ref->valuestring, where(c));
    const cJSON *target = resolve(c, ref->valuestring);
    if (!target)
        return sc_fail(c, QL_EINVAL, "'$ref' '%s' at %s does not resolve", ref->valuestring,
                       where(c));
    return rule_for(c, target, ref->valuestring);
}

/* --- anyOf, oneOf, allOf --------------------------------------------------------------- */

/* What a schema may match, roughly: its types, and its values when it
 * lists them (enum or const), and the object schema itself for an
 * object-only schema. Enough to prove oneOf branches exclusive. */
typedef struct sc_shape {
    unsigned types;
    const cJSON *values; /* a list (enum) or one value (const), or NULL */
    bool one_value;
    const cJSON *object;
} sc_shape;

static sc_shape shape_of(const sc_ctx *c, const cJSON *s, int depth)
{
    sc_shape sh = {.types = T_ALL};
    if (cJSON_IsFalse(s))
        sh.types = 0;
    if (!cJSON_IsObject(s) || depth > 16)
        return sh;
    const cJSON *x;
    if ((x = cJSON_GetObjectItemCaseSensitive(s, "$ref")) && cJSON_IsString(x)) {
        const cJSON *target = resolve(c, x->valuestring);
        return target ? shape_of(c, target, depth + 1) : sh;
    }
    if ((x = cJSON_GetObjectItemCaseSensitive(s, "allOf")) && cJSON_GetArraySize(x) == 1)
        return shape_of(c, x->child, depth + 1);
    if ((x = cJSON_GetObjectItemCaseSensitive(s, "const"))) {
        sh = (sc_shape){.types = type_of(x), .values = x, .one_value = true};
        return sh;
    }
    if ((x = cJSON_GetObjectItemCaseSensitive(s, "enum")) && cJSON_IsArray(x)) {
        sh = (sc_shape){.types = 0, .values = x};
        const cJSON *v;
        cJSON_ArrayForEach (v, x)
            sh.types |= type_of(v);
        return sh;
    }
    if ((x = cJSON_GetObjectItemCaseSensitive(s, "type"))) {
        sh.types = 0;
        for (const cJSON *t = cJSON_IsArray(x) ? x->child : x; t;
             t = cJSON_IsArray(x) ? t->next : NULL)
            sh.types |= type_bit(t);
    }
    if (sh.types == T_OBJECT)
        sh.object = s;
    return sh;
}

/* The single value a property schema pins (const, or an enum of one). */
static const cJSON *pinned(const cJSON *s)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(s, "const");
    if (x)
        return x;
    x = cJSON_GetObjectItemCaseSensitive(s, "enum");
    return cJSON_GetArraySize(x) == 1 ? x->child : NULL;
}

/* Whether a and b list a value in common; true too once the budget of
 * comparisons is spent (not proven apart). */
static bool shares_value(const sc_shape *a, const sc_shape *b, long *budget)
{
    for (const cJSON *x = a->one_value ? a->values : a->values->child; x;
         x = a->one_value ? NULL : x->next)
        for (const cJSON *y = b->one_value ? b->values : b->values->child; y;
             y = b->one_value ? NULL : y->next)
            if (--*budget < 0 || cJSON_Compare(x, y, true))
                return true;
    return false;
}

/* Whether no instance can match both: disjoint types, disjoint listed
 * values, or objects whose required property pins different values (a
 * tagged union). */
static bool exclusive(const sc_ctx *c, const sc_shape *a, const sc_shape *b, long *budget)
{
    unsigned num = T_NUMBER | T_INTEGER;
    unsigned ta = a->types & num ? a->types | num : a->types;
    unsigned tb = b->types & num ? b->types | num : b->types;
    if (!(ta & tb))
        return true;
    if (a->values && b->values)
        return !shares_value(a, b, budget);
    if (!a->object || !b->object)
        return false;
    const cJSON *pa = cJSON_GetObjectItemCaseSensitive(a->object, "properties");
    const cJSON *pb = cJSON_GetObjectItemCaseSensitive(b->object, "properties");
    const cJSON *ra = cJSON_GetObjectItemCaseSensitive(a->object, "required");
    const cJSON *rb = cJSON_GetObjectItemCaseSensitive(b->object, "required");
    const cJSON *x;
    cJSON_ArrayForEach (x, pa) {
        const cJSON *y = member(c, pb, x->string);
        const cJSON *va = pinned(x), *vb = y ? pinned(y) : NULL;
        if (--*budget < 0)
            return false;
        if (va && vb && member(c, ra, x->string) && member(c, rb, x->string) &&
            !cJSON_Compare(va, vb, true))
            return true;
    }
    return false;
}

/* Whether oneOf's branches are proven pairwise exclusive (then anyOf's
 * language is oneOf's); refused with the reason when not. */
static bool one_of_exclusive(sc_ctx *c, const cJSON *list, int n)
{
    sc_shape *shapes = calloc((size_t)n, sizeof *shapes);
    if (!shapes)
        return sc_fail(c, QL_ENOMEM, "out of memory"), false;
    const cJSON *x;
    int k = 0;
    cJSON_ArrayForEach (x, list)
        shapes[k++] = shape_of(c, x, 0);
    long budget = SC_ONEOF_BUDGET;
    for (int i = 0; i < n && !c->err; i++)
        for (int j = i + 1; j < n && !c->err; j++) {
            bool apart = --budget >= 0 && exclusive(c, &shapes[i], &shapes[j], &budget);
            if (budget < 0)
                sc_fail(c, QL_EUNSUPPORTED,
                        "'oneOf' at %s has too many branches or values to prove them exclusive: "
                        "use 'anyOf'",
                        where(c));
            else if (!apart)
                sc_fail(c, QL_EUNSUPPORTED,
                        "'oneOf' at %s: branches %d and %d may both match, which is not "
                        "enforced: use 'anyOf'",
                        where(c), i, j);
        }
    free(shapes);
    return !c->err;
}

static gr_expr compile_combination(sc_ctx *c, const cJSON *s, unsigned mask)
{
    int kw = mask & KB(K_ANYOF) ? K_ANYOF : mask & KB(K_ONEOF) ? K_ONEOF : K_ALLOF;
    const char *name = sc_keywords[kw];
    unsigned other = mask & ~KB(kw);
    if (other)
        return sc_fail(c, QL_EUNSUPPORTED, "'%s' alongside '%s' at %s is not supported",
                       keyword_name(other), name, where(c));
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(s, name);
    if (!cJSON_IsArray(list) || !list->child)
        return sc_fail(c, QL_EINVAL, "'%s' at %s must be a non-empty list of schemas", name,
                       where(c));
    int n = cJSON_GetArraySize(list);
    if (kw == K_ALLOF && n != 1)
        return sc_fail(c, QL_EUNSUPPORTED,
                       "'allOf' of %d schemas at %s is not supported (only of one)", n, where(c));
    if (kw == K_ONEOF && !one_of_exclusive(c, list, n))
        return -1;
    gr_expr *parts = calloc((size_t)n, sizeof *parts);
    if (!parts)
        return sc_fail(c, QL_ENOMEM, "out of memory");
    const cJSON *x;
    int i = 0;
    cJSON_ArrayForEach (x, list) {
        parts[i] = compile_at(c, x, name, i);
        i++;
    }
    gr_expr out = c->err ? -1 : gr_alt(c->b, parts, (size_t)n);
    free(parts);
    return out;
}

/* --- the walk ------------------------------------------------------------------------ */

static gr_expr compile(sc_ctx *c, const cJSON *s)
{
    if (c->err || gr_builder_error(c->b, NULL, 0) != QL_OK)
        return -1; /* the builder's failure is reported once, at the end */
    if (cJSON_IsTrue(s))
        return any_value(c);
    if (cJSON_IsFalse(s))
        return gr_nothing(c->b);
    if (!cJSON_IsObject(s))
        return sc_fail(c, QL_EINVAL, "the schema at %s must be an object or a boolean", where(c));
    if (c->depth >= SC_MAX_DEPTH)
        return sc_fail(c, QL_EINVAL, "the schema at %s is nested deeper than %d", where(c),
                       SC_MAX_DEPTH);
    unsigned mask = keyword_mask(c, s);
    if (c->err)
        return -1;
    c->depth++;
    gr_expr x;
    if (mask & KB(K_REF)) {
        unsigned other = mask & ~KB(K_REF);
        x = other ? sc_fail(c, QL_EUNSUPPORTED, "'%s' alongside '$ref' at %s is not supported",
                            keyword_name(other), where(c))
                  : compile_ref(c, s);
    } else if (mask & (KB(K_ANYOF) | KB(K_ONEOF) | KB(K_ALLOF))) {
        x = compile_combination(c, s, mask);
    } else if (mask & (KB(K_ENUM) | KB(K_CONST))) {
        x = compile_values(c, s, mask);
    } else {
        x = compile_typed(c, s, mask);
    }
    c->depth--;
    return c->err ? -1 : x;
}

int gr_from_json_schema(gr_builder *b, const char *text, size_t len, gr_expr *root, char *msg,
                        size_t msg_len)
{
    if (!b || !text || !root)
        return ql_fail(msg, msg_len, QL_EINVAL, "json schema: no builder, text or root");
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(text, len, &end, false);
    size_t at = end ? (size_t)(end - text) : 0;
    while (doc && at < len && strchr(" \t\r\n", text[at]) && text[at])
        at++;
    if (!doc || at < len) {
        cJSON_Delete(doc);
        return ql_fail(msg, msg_len, QL_EINVAL, "json schema: not JSON (at byte %zu)", at);
    }
    sc_ctx c = {.b = b,
                .doc = doc,
                .msg = msg,
                .msg_len = msg_len,
                .ws = -2,
                .comma = -2,
                .value = -2,
                .string = -2,
                .string_char = -2,
                .number = -2,
                .integer = -2,
                .any_frac = -2,
                .zero_frac = -2};
    for (size_t i = 0; i < SC_N_FORMATS; i++)
        c.formats[i] = -2;
    gr_expr x = index_doc(&c, doc) ? rule_for(&c, doc, "#") : -1;
    free(c.slots);
    cJSON_Delete(doc);
    if (c.err)
        return c.err;
    int err = gr_builder_error(b, msg, msg_len);
    if (err != QL_OK)
        return err;
    *root = x;
    return QL_OK;
}

/*
 * regex.c - regular expressions to grammar expressions: gr_from_regex (a
 * whole answer that matches, as Python's re.fullmatch) and
 * gr_from_pattern_in_json_string (JSON Schema's "pattern": ECMA-262,
 * matched anywhere in the string's decoded value unless ^ / $ anchor it,
 * written as the characters of a JSON string between its quotes).
 *
 * One recursive-descent parser over the pattern's UTF-8 text builds the
 * expression as it reads: literals, escapes, classes, '.', groups
 * (capturing, (?:), (?P<n>) and (?<n>)), alternation, and the quantifiers
 * * + ? {n} {n,} {n,m} with their lazy forms (the same language). What it
 * cannot enforce as a language over bytes is refused by name with the
 * byte offset: backreferences, lookaround, word boundaries, anchors other
 * than a leading ^ and trailing $ of a top-level branch, inline flags,
 * possessive quantifiers, and repeat bounds over RX_MAX_REPEAT.
 *
 * Why a subset, never a superset: Python's \d \w \s are Unicode-aware and
 * ECMA's \s knows Unicode spaces, so each class escape has an inner set
 * (surely in the class under both: ASCII only) and an outer set (all it
 * might hold: its ASCII part and everything past ASCII). A positive use
 * takes the inner set and a negated class takes the complement of the
 * outer ones, so every answer the grammar allows matches under Python's re
 * and under ECMA-262 alike; '.' likewise leaves out every line terminator
 * of either. In a JSON string, '"' and '\' are written \" and \\, control
 * characters only escaped (\b \f \n \r \t, or \u00XX), never raw.
 *
 * It owns nothing: expressions live in the caller's builder.
 */
#include "grammar.h"

#include <stdlib.h>
#include <string.h>

/* The largest n or m of {n}, {n,} and {n,m}: bounded repeats are written
 * out by the builder, so a huge bound is refused here by name rather than
 * by the builder's size bound with a vaguer sentence. */
#define RX_MAX_REPEAT 1000
/* Groups nested deeper than this are refused: the parser recurses. */
#define RX_MAX_DEPTH 100
/* Ranges a code-point set may hold, and a class may list (fewer, so that
 * a complement or the few characters JSON escapes always fit). */
#define RX_MAX_RANGES       128
#define RX_MAX_CLASS_RANGES 100
#define RX_MAX_CP           0x10FFFFu

typedef struct cp_set {
    size_t n;
    uint32_t r[2 * RX_MAX_RANGES]; /* sorted, disjoint, not adjacent: lo0 hi0 lo1 hi1 ... */
} cp_set;

/* An escape or class member: the sets it surely holds and may hold. */
typedef struct rx_item {
    cp_set inner, outer;
    bool single; /* one character (may end a range), cp */
    uint32_t cp;
} rx_item;

typedef struct rx_parser {
    gr_builder *b;
    const char *s;
    size_t n, pos;
    bool json;   /* pattern mode: ECMA-262, written inside a JSON string */
    int depth;   /* groups open */
    int err;     /* a parse error (QL_OK while none); builder errors are the builder's */
    gr_expr dot; /* '.' and any character, made once (-2: not yet) */
    gr_expr any;
    char *msg;
    size_t msg_len;
} rx_parser;

/* --- code-point sets ---------------------------------------------------------- */

/* Add lo..hi; false when the set is full. */
static bool set_add(cp_set *s, uint32_t lo, uint32_t hi)
{
    uint32_t out[2 * RX_MAX_RANGES + 2];
    size_t k = 0, i = 0;
    while (i < s->n && s->r[2 * i + 1] + 1 < lo) { /* wholly before, not touching */
        out[k++] = s->r[2 * i];
        out[k++] = s->r[2 * i + 1];
        i++;
    }
    while (i < s->n && s->r[2 * i] <= hi + 1) { /* overlapping or touching: merge */
        lo = s->r[2 * i] < lo ? s->r[2 * i] : lo;
        hi = s->r[2 * i + 1] > hi ? s->r[2 * i + 1] : hi;
        i++;
    }
    out[k++] = lo;
    out[k++] = hi;
    for (; i < s->n; i++) {
        out[k++] = s->r[2 * i];
        out[k++] = s->r[2 * i + 1];
    }
    if (k / 2 > RX_MAX_RANGES)
        return false;
    memcpy(s->r, out, k * sizeof out[0]);
    s->n = k / 2;
    return true;
}

static bool set_union(cp_set *s, const cp_set *t)
{
    for (size_t i = 0; i < t->n; i++)
        if (!set_add(s, t->r[2 * i], t->r[2 * i + 1]))
            return false;
    return true;
}

/* Every code point 0..RX_MAX_CP not in s (a complement never grows past
 * n + 1 ranges, so it always fits when n < RX_MAX_RANGES). */
static cp_set set_complement(const cp_set *s)
{
    cp_set c = {0};
    uint32_t next = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->r[2 * i] > next && c.n < RX_MAX_RANGES) {
            c.r[2 * c.n] = next;
            c.r[2 * c.n + 1] = s->r[2 * i] - 1;
            c.n++;
        }
        next = s->r[2 * i + 1] + 1;
    }
    if (next <= RX_MAX_CP && c.n < RX_MAX_RANGES) {
        c.r[2 * c.n] = next;
        c.r[2 * c.n + 1] = RX_MAX_CP;
        c.n++;
    }
    return c;
}

static bool set_has(const cp_set *s, uint32_t cp)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->r[2 * i] <= cp && cp <= s->r[2 * i + 1])
            return true;
    return false;
}

static cp_set set_of(const uint32_t *ranges, size_t n_ranges)
{
    cp_set s = {0};
    for (size_t i = 0; i < n_ranges; i++)
        set_add(&s, ranges[2 * i], ranges[2 * i + 1]);
    return s;
}

/* The class escapes' sets (see the opening comment): ASCII parts exact
 * under both Python and ECMA-262, everything past ASCII uncertain. */
static const uint32_t digit_ascii[] = {'0', '9'};
static const uint32_t word_ascii[] = {'0', '9', 'A', 'Z', '_', '_', 'a', 'z'};
static const uint32_t space_inner[] = {'\t', '\r', ' ', ' '};
/* Python's \s also holds U+001C..U+001F */
static const uint32_t space_outer_ascii[] = {'\t', '\r', 0x1C, ' '};

static rx_item class_escape(char c)
{
    rx_item it = {0};
    bool negate = c == 'D' || c == 'W' || c == 'S';
    char lower = negate ? (char)(c + ('a' - 'A')) : c;
    if (lower == 'd')
        it.inner = set_of(digit_ascii, 1);
    else if (lower == 'w')
        it.inner = set_of(word_ascii, 4);
    else
        it.inner = set_of(space_inner, 2);
    it.outer = lower == 's' ? set_of(space_outer_ascii, 2) : it.inner;
    set_add(&it.outer, 0x80, RX_MAX_CP);
    if (negate) {
        cp_set inner = set_complement(&it.outer);
        it.outer = set_complement(&it.inner);
        it.inner = inner;
    }
    return it;
}

static rx_item single_item(uint32_t cp)
{
    rx_item it = {.single = true, .cp = cp};
    set_add(&it.inner, cp, cp);
    it.outer = it.inner;
    return it;
}

/* --- writing characters --------------------------------------------------------- */

static gr_expr set_expr_raw(rx_parser *p, const cp_set *s)
{
    return gr_codepoints(p->b, s->r, s->n);
}

static const char *short_escape(uint32_t cp)
{
    switch (cp) {
    case '\b': return "\\b";
    case '\t': return "\\t";
    case '\n': return "\\n";
    case '\f': return "\\f";
    case '\r': return "\\r";
    default: return NULL;
    }
}

/* One character of s as JSON writes it inside a string. */
static gr_expr set_expr_json(rx_parser *p, const cp_set *s)
{
    gr_expr parts[64];
    size_t k = 0;
    /* plain: s less what JSON escapes, the complement of (~s | special) */
    static const uint32_t special[] = {0, 0x1F, '"', '"', '\\', '\\'};
    cp_set sp = set_of(special, 3);
    cp_set out = set_complement(s);
    set_union(&out, &sp); /* fits: s has at most RX_MAX_CLASS_RANGES + 1 ranges */
    cp_set plain = set_complement(&out);
    if (plain.n)
        parts[k++] = set_expr_raw(p, &plain);
    if (set_has(s, '"'))
        parts[k++] = gr_literal(p->b, "\\\"", 2);
    if (set_has(s, '\\'))
        parts[k++] = gr_literal(p->b, "\\\\", 2);
    bool all_controls = true;
    for (uint32_t c = 0; c < 0x20; c++)
        all_controls = all_controls && set_has(s, c);
    for (uint32_t c = 0; c < 0x20; c++) {
        const char *esc = short_escape(c);
        if (!set_has(s, c) || (!esc && all_controls))
            continue;
        char u[8];
        if (!esc) {
            static const char hex[] = "0123456789abcdef";
            memcpy(u, "\\u00", 4);
            u[4] = hex[c >> 4];
            u[5] = hex[c & 15];
            u[6] = 0;
            esc = u;
        }
        parts[k++] = gr_literal(p->b, esc, strlen(esc));
    }
    if (all_controls) { /* \u0000..\u001f, either case of hex digit */
        static const uint32_t hexdigit[] = {'0', '9', 'A', 'F', 'a', 'f'};
        gr_expr u[3] = {gr_literal(p->b, "\\u00", 4), gr_byte_range(p->b, '0', '1'),
                        gr_codepoints(p->b, hexdigit, 3)};
        parts[k++] = gr_seq(p->b, u, 3);
    }
    return gr_alt(p->b, parts, k);
}

static gr_expr set_expr(rx_parser *p, const cp_set *s)
{
    return p->json ? set_expr_json(p, s) : set_expr_raw(p, s);
}

static gr_expr char_expr(rx_parser *p, uint32_t cp)
{
    uint8_t utf8[4];
    if (p->json && (cp < 0x20 || cp == '"' || cp == '\\')) {
        cp_set one = {0};
        set_add(&one, cp, cp);
        return set_expr_json(p, &one);
    }
    return gr_literal(p->b, utf8, ql_utf8_put(cp, utf8));
}

/* '.': any character but a line terminator (Python: \n; ECMA-262 also \r,
 * U+2028 and U+2029, left out in pattern mode so both agree). */
static gr_expr dot_expr(rx_parser *p)
{
    if (p->dot == -2) {
        static const uint32_t py[] = {'\n', '\n'};
        static const uint32_t ecma[] = {'\n', '\n', '\r', '\r', 0x2028, 0x2029};
        cp_set s = p->json ? set_of(ecma, 3) : set_of(py, 1);
        s = set_complement(&s);
        p->dot = set_expr(p, &s);
    }
    return p->dot;
}

static gr_expr any_expr(rx_parser *p)
{
    if (p->any == -2) {
        cp_set none = {0};
        cp_set all = set_complement(&none);
        p->any = gr_repeat(p->b, set_expr(p, &all), 0, GR_UNBOUNDED);
    }
    return p->any;
}

/* --- parsing ------------------------------------------------------------------- */

static gr_expr fail(rx_parser *p, int err, const char *what, size_t at)
{
    if (!p->err)
        p->err = ql_fail(p->msg, p->msg_len, err, "regex: %s at offset %zu", what, at);
    return -1;
}

static bool at_end(const rx_parser *p)
{
    return p->pos >= p->n;
}

static char peek(const rx_parser *p)
{
    return at_end(p) ? 0 : p->s[p->pos];
}

/* The UTF-8 character at the cursor, consumed; false when malformed. */
static bool next_char(rx_parser *p, uint32_t *cp)
{
    size_t len = ql_utf8_next((const uint8_t *)p->s + p->pos, p->n - p->pos, cp);
    if (!len) {
        fail(p, QL_EINVAL, "malformed UTF-8", p->pos);
        return false;
    }
    p->pos += len;
    return true;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* \xHH or \uHHHH after the letter: digits hex digits into *cp. */
static bool hex_escape(rx_parser *p, int digits, uint32_t *cp, size_t at)
{
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        int h = hex_value(peek(p));
        if (h < 0) {
            fail(p, QL_EINVAL, "malformed hexadecimal escape", at);
            return false;
        }
        v = v * 16 + (uint32_t)h;
        p->pos++;
    }
    *cp = v;
    return true;
}

/* After \u escaped cp (at: its backslash): a high surrogate followed by
 * an escaped low one is the pair's one character, as ECMA-262 reads
 * UTF-16; a surrogate alone can be in no UTF-8 text, and is refused. */
static bool surrogate_pair(rx_parser *p, uint32_t *cp, size_t at)
{
    if (*cp < 0xD800 || *cp > 0xDFFF)
        return true;
    uint32_t low = 0;
    if (*cp <= 0xDBFF && p->pos + 1 < p->n && p->s[p->pos] == '\\' && p->s[p->pos + 1] == 'u') {
        size_t mark = p->pos;
        p->pos += 2;
        if (hex_escape(p, 4, &low, mark) && low >= 0xDC00 && low <= 0xDFFF) {
            *cp = 0x10000 + ((*cp - 0xD800) << 10) + (low - 0xDC00);
            return true;
        }
        if (p->err != QL_OK)
            return false;
    }
    fail(p, QL_EUNSUPPORTED, "a lone UTF-16 surrogate escape (no UTF-8 text holds one)", at);
    return false;
}

/* The escape after a '\' (the cursor past it; at: the backslash). In a
 * class, \b is the backspace character, as in both dialects. */
static bool parse_escape(rx_parser *p, bool in_class, size_t at, rx_item *it)
{
    if (at_end(p)) {
        fail(p, QL_EINVAL, "a trailing '\\'", at);
        return false;
    }
    char c = p->s[p->pos++];
    uint32_t cp;
    switch (c) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S': *it = class_escape(c); return true;
    case 'n': *it = single_item('\n'); return true;
    case 't': *it = single_item('\t'); return true;
    case 'r': *it = single_item('\r'); return true;
    case 'f': *it = single_item('\f'); return true;
    case 'v': *it = single_item('\v'); return true;
    case 'x':
    case 'u':
        if (!hex_escape(p, c == 'x' ? 2 : 4, &cp, at) || (c == 'u' && !surrogate_pair(p, &cp, at)))
            return false;
        *it = single_item(cp);
        return true;
    case '0':
        if (peek(p) >= '0' && peek(p) <= '9') {
            fail(p, QL_EUNSUPPORTED, "an octal escape", at);
            return false;
        }
        *it = single_item(0);
        return true;
    case 'b':
        if (in_class) {
            *it = single_item('\b');
            return true;
        }
        fail(p, QL_EUNSUPPORTED, "a word boundary \\b", at);
        return false;
    case 'B': fail(p, QL_EUNSUPPORTED, "a word boundary \\B", at); return false;
    case 'A':
    case 'Z':
    case 'z':
    case 'G': fail(p, QL_EUNSUPPORTED, "an anchor escape inside the expression", at); return false;
    case 'k': fail(p, QL_EUNSUPPORTED, "a backreference", at); return false;
    default: break;
    }
    if (c >= '1' && c <= '9') {
        fail(p, QL_EUNSUPPORTED, "a backreference", at);
        return false;
    }
    if ((unsigned char)c < 0x80 && !(c >= '0' && c <= '9') && !(c >= 'a' && c <= 'z') &&
        !(c >= 'A' && c <= 'Z')) {
        *it = single_item((uint32_t)c); /* an escaped metacharacter or punctuation */
        return true;
    }
    fail(p, QL_EUNSUPPORTED, "an unknown escape", at);
    return false;
}

/* One end of a class member, into *it: an escape or a character. */
static bool class_end(rx_parser *p, rx_item *it)
{
    size_t at = p->pos;
    if (peek(p) == '\\') {
        p->pos++;
        return parse_escape(p, true, at, it);
    }
    uint32_t cp;
    if (!next_char(p, &cp))
        return false;
    *it = single_item(cp);
    return true;
}

/* One member of a class: a character, an escape, or a range lo-hi. */
static bool class_member(rx_parser *p, rx_item *it)
{
    size_t at = p->pos;
    if (!class_end(p, it))
        return false;
    if (peek(p) != '-' || p->pos + 1 >= p->n || p->s[p->pos + 1] == ']')
        return true;
    p->pos++; /* a range */
    rx_item hi;
    if (!class_end(p, &hi))
        return false;
    if (!it->single || !hi.single || hi.cp < it->cp) {
        fail(p, QL_EINVAL, "a bad range in a class", at);
        return false;
    }
    uint32_t lo = it->cp;
    *it = single_item(lo);
    it->single = false;
    set_add(&it->inner, lo, hi.cp);
    it->outer = it->inner;
    return true;
}

/* A class [...] (the cursor past the '['). */
static gr_expr parse_class(rx_parser *p, size_t at)
{
    bool negate = peek(p) == '^';
    if (negate)
        p->pos++;
    if (peek(p) == ']') /* Python reads a literal ']', ECMA-262 an empty class */
        return fail(p, QL_EUNSUPPORTED, "a ']' first in a class (write \\])", p->pos);
    cp_set in = {0}, out = {0};
    while (!at_end(p) && peek(p) != ']') {
        rx_item it;
        if (!class_member(p, &it))
            return -1;
        if (!set_union(&in, &it.inner) || !set_union(&out, &it.outer) ||
            in.n > RX_MAX_CLASS_RANGES || out.n > RX_MAX_CLASS_RANGES)
            return fail(p, QL_EINVAL, "a class of too many ranges", at);
    }
    if (at_end(p))
        return fail(p, QL_EINVAL, "an unterminated class '['", at);
    p->pos++;
    if (negate)
        in = set_complement(&out);
    return set_expr(p, &in);
}

static gr_expr parse_alt(rx_parser *p, bool top);

/* A group (the cursor past the '('): capturing, (?:...), (?P<n>...) or
 * (?<n>...); lookaround, backreferences and flags refused. */
static gr_expr parse_group(rx_parser *p, size_t at)
{
    if (peek(p) == '?') {
        p->pos++;
        const char *rest = p->s + p->pos;
        size_t left = p->n - p->pos;
        if (left >= 1 && rest[0] == ':') {
            p->pos++;
        } else if (left >= 1 && (rest[0] == '=' || rest[0] == '!')) {
            return fail(p, QL_EUNSUPPORTED, "a lookahead", at);
        } else if (left >= 2 && rest[0] == '<' && (rest[1] == '=' || rest[1] == '!')) {
            return fail(p, QL_EUNSUPPORTED, "a lookbehind", at);
        } else if (left >= 2 && rest[0] == 'P' && rest[1] == '=') {
            return fail(p, QL_EUNSUPPORTED, "a backreference", at);
        } else if (left >= 1 &&
                   (rest[0] == '<' || (left >= 2 && rest[0] == 'P' && rest[1] == '<'))) {
            p->pos += rest[0] == 'P' ? 2 : 1;
            size_t name = p->pos;
            while (!at_end(p) && (peek(p) == '_' || (peek(p) >= '0' && peek(p) <= '9') ||
                                  ((peek(p) | 0x20) >= 'a' && (peek(p) | 0x20) <= 'z')))
                p->pos++;
            if (p->pos == name || peek(p) != '>')
                return fail(p, QL_EINVAL, "a malformed group name", at);
            p->pos++;
        } else {
            return fail(p, QL_EUNSUPPORTED, "an unknown group '(?' (inline flags?)", at);
        }
    }
    if (++p->depth > RX_MAX_DEPTH)
        return fail(p, QL_EINVAL, "groups nested too deeply", at);
    gr_expr inner = parse_alt(p, false);
    p->depth--;
    if (p->err)
        return -1;
    if (peek(p) != ')')
        return fail(p, QL_EINVAL, "an unbalanced '('", at);
    p->pos++;
    return inner;
}

/* A decimal number of at most RX_MAX_REPEAT; -1 when none is there. */
static int32_t parse_count(rx_parser *p, bool *over)
{
    size_t start = p->pos;
    int64_t v = 0;
    while (peek(p) >= '0' && peek(p) <= '9') {
        v = v * 10 + (peek(p) - '0');
        if (v > RX_MAX_REPEAT)
            *over = true, v = RX_MAX_REPEAT;
        p->pos++;
    }
    return p->pos == start ? -1 : (int32_t)v;
}

/* {n}, {n,} or {n,m} at the cursor: true and the bounds when it is one
 * (consumed), false when '{' starts no quantifier (cursor unchanged; an
 * error when the syntax is one but the bounds are wrong). */
static bool parse_braces(rx_parser *p, int32_t *min, int32_t *max)
{
    size_t at = p->pos;
    bool over = false;
    p->pos++;
    *min = parse_count(p, &over);
    *max = *min;
    if (peek(p) == ',') {
        p->pos++;
        *max = parse_count(p, &over);
        if (*max < 0)
            *max = GR_UNBOUNDED;
    }
    if (*min < 0 || peek(p) != '}') {
        p->pos = at;
        return false;
    }
    p->pos++;
    if (over) {
        fail(p, QL_EINVAL, "a repeat bound over 1000", at);
        return false;
    }
    if (*max != GR_UNBOUNDED && *max < *min) {
        fail(p, QL_EINVAL, "a repeat {n,m} with n > m", at);
        return false;
    }
    return true;
}

static bool is_quantifier_start(const rx_parser *p)
{
    char c = peek(p);
    return c == '*' || c == '+' || c == '?' || c == '{';
}

/* What a '{' that is no quantifier is refused as. */
static const char rx_lone_brace[] = "a '{' that starts no {n}, {n,} or {n,m} (write \\{)";

/* The quantifier after an atom, if any, applied to it. */
static gr_expr parse_quantifier(rx_parser *p, gr_expr atom)
{
    size_t at = p->pos;
    int32_t min, max;
    char c = peek(p);
    if (c == '*' || c == '+' || c == '?') {
        p->pos++;
        min = c == '+' ? 1 : 0;
        max = c == '?' ? 1 : GR_UNBOUNDED;
    } else if (c == '{') {
        if (!parse_braces(p, &min, &max))
            return p->err ? -1 : fail(p, QL_EUNSUPPORTED, rx_lone_brace, at);
    } else {
        return atom;
    }
    if (peek(p) == '?')
        p->pos++; /* lazy: the same language */
    if (is_quantifier_start(p))
        return fail(p, QL_EUNSUPPORTED, "a quantifier of a quantifier (possessive or repeated)",
                    p->pos);
    return gr_repeat(p->b, atom, min, max);
}

/* One atom at the cursor (not '|', ')' or the end). */
static gr_expr parse_atom(rx_parser *p)
{
    size_t at = p->pos;
    char c = peek(p);
    uint32_t cp;
    rx_item it;
    switch (c) {
    case '(': p->pos++; return parse_group(p, at);
    case '[': p->pos++; return parse_class(p, at);
    case '.': p->pos++; return dot_expr(p);
    case '^':
    case '$': return fail(p, QL_EUNSUPPORTED, "an anchor inside the expression", at);
    case '*':
    case '+':
    case '?': return fail(p, QL_EINVAL, "a quantifier of nothing", at);
    case '{': {
        int32_t min, max;
        if (parse_braces(p, &min, &max))
            return fail(p, QL_EINVAL, "a quantifier of nothing", at);
        return p->err ? -1 : fail(p, QL_EUNSUPPORTED, rx_lone_brace, at);
    }
    case '\\':
        p->pos++;
        if (!parse_escape(p, false, at, &it))
            return -1;
        return it.single ? char_expr(p, it.cp) : set_expr(p, &it.inner);
    default:
        if (!next_char(p, &cp))
            return -1;
        return char_expr(p, cp);
    }
}

/* Append x to the growing list *xs (n used of cap); false when out of memory. */
static bool push(rx_parser *p, gr_expr **xs, size_t *n, size_t *cap, gr_expr x)
{
    if (*n == *cap) {
        size_t grown_cap = *cap ? 2 * *cap : 8;
        gr_expr *grown = realloc(*xs, grown_cap * sizeof *grown);
        if (!grown) {
            fail(p, QL_ENOMEM, "out of memory", p->pos);
            return false;
        }
        *xs = grown;
        *cap = grown_cap;
    }
    (*xs)[(*n)++] = x;
    return true;
}

/* A sequence up to '|', ')' or the end. At the top a trailing '$' is an
 * anchor: *anchored_end says it was there. */
static gr_expr parse_seq(rx_parser *p, bool top, bool *anchored_end)
{
    gr_expr *xs = NULL;
    size_t n = 0, cap = 0;
    gr_expr out = -1;
    while (!at_end(p) && peek(p) != '|' && peek(p) != ')') {
        if (top && peek(p) == '$' && (p->pos + 1 == p->n || p->s[p->pos + 1] == '|')) {
            p->pos++;
            *anchored_end = true;
            break;
        }
        gr_expr x = parse_atom(p);
        if (!p->err)
            x = parse_quantifier(p, x);
        if (p->err)
            goto done;
        if (!push(p, &xs, &n, &cap, x))
            goto done;
    }
    out = gr_seq(p->b, xs, n);
done:
    free(xs);
    return p->err ? -1 : out;
}

/* Branches separated by '|'. At the top each branch may start with '^'
 * and end with '$'; in pattern mode a branch not anchored so may have any
 * characters before or after it (ECMA-262 search). */
static gr_expr parse_alt(rx_parser *p, bool top)
{
    gr_expr *xs = NULL;
    size_t n = 0, cap = 0;
    gr_expr out = -1;
    for (;;) {
        bool start = false, end = false;
        if (top && peek(p) == '^') {
            p->pos++;
            start = true;
        }
        gr_expr x = parse_seq(p, top, &end);
        if (p->err)
            goto done;
        if (top && p->json) {
            gr_expr parts[3] = {start ? gr_empty(p->b) : any_expr(p), x,
                                end ? gr_empty(p->b) : any_expr(p)};
            x = gr_seq(p->b, parts, 3);
        }
        if (!push(p, &xs, &n, &cap, x))
            goto done;
        if (peek(p) != '|')
            break;
        p->pos++;
    }
    if (top && !at_end(p))
        fail(p, QL_EINVAL, "an unbalanced ')'", p->pos);
    else
        out = gr_alt(p->b, xs, n);
done:
    free(xs);
    return p->err ? -1 : out;
}

static int compile(gr_builder *b, const char *text, size_t len, bool json, gr_expr *root, char *msg,
                   size_t msg_len)
{
    if (!b || (!text && len) || !root)
        return ql_fail(msg, msg_len, QL_EINVAL, "regex: no builder, text or root");
    rx_parser p = {.b = b,
                   .s = text ? text : "",
                   .n = len,
                   .json = json,
                   .dot = -2,
                   .any = -2,
                   .msg = msg,
                   .msg_len = msg_len};
    gr_expr x = parse_alt(&p, true);
    if (p.err)
        return p.err;
    int err = gr_builder_error(b, msg, msg_len);
    if (err != QL_OK)
        return err;
    *root = x;
    return QL_OK;
}

int gr_from_regex(gr_builder *b, const char *text, size_t len, gr_expr *root, char *msg,
                  size_t msg_len)
{
    return compile(b, text, len, false, root, msg, msg_len);
}

int gr_from_pattern_in_json_string(gr_builder *b, const char *text, size_t len, gr_expr *root,
                                   char *msg, size_t msg_len)
{
    return compile(b, text, len, true, root, msg, msg_len);
}

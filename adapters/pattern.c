/*
 * pattern.c - Python regular expressions (PEFT's target_modules,
 * rank_pattern, alpha_pattern, layers_pattern) compiled as POSIX ones, with
 * a guard on what they may cost regcomp (internal/pattern.h).
 *
 * Python's re, which PEFT uses, is not POSIX. A pattern is translated to a
 * POSIX extended expression: the escapes \d \D \w \W \s \S become bracket
 * classes, (?:...) a plain group, lazy and possessive quantifiers (*? +?
 * ?? {m,n}?, *+ ...) plain ones (a full match exists or not whichever is
 * used, and only that is asked). Lookarounds, backreferences, named
 * groups, inline flags and \b have no POSIX form and are refused naming
 * the construct. What glibc's regcomp would spend unbounded memory or time
 * on (counted repeats that multiply, loops over what can match nothing) is
 * measured and refused before it is compiled (check_ere_cost).
 *
 * It owns nothing past a call (the compiled regex_t is the caller's) and
 * touches nothing but its arguments and libc's regcomp.
 */
#include "internal/pattern.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct strbuf {
    char *s;
    size_t len, cap;
    bool oom;
} strbuf;

static void sb_add(strbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        char *t = realloc(b->s, cap);
        if (!t) {
            b->oom = true;
            return;
        }
        b->s = t;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

static void sb_str(strbuf *b, const char *s)
{
    sb_add(b, s, strlen(s));
}

static void sb_chr(strbuf *b, char c)
{
    sb_add(b, &c, 1);
}

/* The ERE special characters: these keep their backslash. */
static bool ere_special(char c)
{
    return c && strchr(".[]()*+?{}|^$\\", c) != NULL;
}

/* The character of the escape \xHH whose digits start at p, or 0 when p
 * does not hold two hex digits (or they name NUL, which no name holds). */
static char hex_escape(const char *p)
{
    if (!isxdigit((unsigned char)p[0]) || !isxdigit((unsigned char)p[1]))
        return 0;
    char digits[3] = {p[0], p[1], 0};
    return (char)strtol(digits, NULL, 16);
}

/* A Python bracket expression starting at py[*i] == '[' into POSIX form.
 * POSIX brackets take no escapes, so an escaped ']', '-' or '^' is moved
 * where POSIX reads it literally (first, last, not first). */
static int translate_bracket(const char *py, size_t *i, strbuf *out, char *why, size_t why_len)
{
    size_t k = *i + 1;
    bool negate = py[k] == '^';
    if (negate)
        k++;
    bool rbracket = false, dash = false, caret = false;
    strbuf body = {0};
    if (py[k] == ']') { /* a leading ']' is literal in both */
        rbracket = true;
        k++;
    }
    for (; py[k] && py[k] != ']'; k++) {
        if (py[k] != '\\') {
            if (py[k] == '[' && py[k + 1] == ':') {
                free(body.s);
                return snprintf(why, why_len, "'[:' inside a bracket means a class in POSIX"), -1;
            }
            sb_chr(&body, py[k]);
            continue;
        }
        char e = py[++k];
        switch (e) {
        case 'd': sb_str(&body, "0-9"); break;
        case 'w': sb_str(&body, "_[:alnum:]"); break;
        case 's': sb_str(&body, "[:space:]"); break;
        case 'n': sb_chr(&body, '\n'); break;
        case 't': sb_chr(&body, '\t'); break;
        case 'x': { /* \xHH: Kubernetes' header-name pattern has \x60 */
            char h = hex_escape(py + k + 1);
            if (!h) {
                free(body.s);
                return snprintf(why, why_len, "\\x inside [...] without two hex digits"), -1;
            }
            k += 2;
            rbracket |= h == ']';
            dash |= h == '-';
            caret |= h == '^';
            if (h != ']' && h != '-' && h != '^')
                sb_chr(&body, h);
            break;
        }
        case ']': rbracket = true; break;
        case '-': dash = true; break;
        case '^': caret = true; break;
        case 0: free(body.s); return snprintf(why, why_len, "a pattern ends in '\\'"), -1;
        default:
            if (isalnum((unsigned char)e)) {
                free(body.s);
                return snprintf(why, why_len, "the escape \\%c inside [...] has no POSIX form", e),
                       -1;
            }
            sb_chr(&body, e); /* \. \\ \[ ... are the character itself */
        }
    }
    if (!py[k]) {
        free(body.s);
        return snprintf(why, why_len, "an unterminated '['"), -1;
    }
    sb_chr(out, '[');
    if (negate)
        sb_chr(out, '^');
    if (rbracket)
        sb_chr(out, ']');
    if (body.s)
        sb_str(out, body.s);
    if (caret)
        sb_chr(out, '^');
    if (dash)
        sb_chr(out, '-');
    sb_chr(out, ']');
    free(body.s);
    *i = k;
    return 0;
}

/*
 * What glibc's regcomp is slow on, so a pattern from an adapter file (which
 * any client with admin rights can name) is measured before it is compiled.
 * Measured with glibc 2.36 (regcomp of "^(" pattern ")$", REG_EXTENDED):
 *   - a counted repeat is expanded into copies of its operand, and nested
 *     counts multiply: "((a{1,100}){1,100}){1,100}" grew past 6 GiB in 20
 *     s; "(a{4000}){1000}" took 6 s and 818 MiB; so the copies of every
 *     character, counted through every repeat around it, may total at most
 *     PATTERN_MAX_COPIES;
 *   - a quantifier over something that can match nothing ("(a*)*", "(|a)+",
 *     "()*", "(a{0,3})*") costs time exponential in how many there are:
 *     "(a*)*" 16 times took 0.3 s, 32 times did not finish; so at most
 *     PATTERN_MAX_EMPTY_LOOPS such (counting copies);
 *   - quantifiers copied by a count: "([a-z]*" 13 times "){1000}" took 25
 *     s and 2.6 GiB, and "a?" 2000 times 0.9 s; so at most
 *     PATTERN_MAX_QUANTIFIERS quantifiers, counting copies;
 *   - "x+" is built as "x x*", two copies of x, so stacked pluses double
 *     ("f" and 120 '+' ran out of 2 GiB): each '+' counts as a count of 2.
 * PEFT's own patterns ("(.*\.)?(q_proj|v_proj)", ".*\.(q|k|v)_proj") are
 * far inside all of these. The measure is taken on the POSIX text regcomp
 * gets (with our anchors), so nothing regcomp reads escapes it; glibc's
 * "{,n}" (0 to n) and "{,}" (a star) are intervals too, and "x{0}" costs
 * x once (regcomp builds x, then drops it). fuzz_adapter_config found each
 * of those last four.
 */
#define PATTERN_MAX_BYTES       4096
#define PATTERN_MAX_COPIES      20000
#define PATTERN_MAX_EMPTY_LOOPS 4
#define PATTERN_MAX_QUANTIFIERS 256
#define PATTERN_MAX_DEPTH       256 /* groups inside groups */

/* What a part of a pattern costs regcomp, counted through the repeats
 * around it; nullable: it can match the empty string. */
typedef struct ere_cost {
    double copies, quantifiers, empty_loops;
    bool nullable;
} ere_cost;

typedef struct ere_scan {
    const char *p;
    int depth;
    bool too_deep;
} ere_scan;

static ere_cost ere_alternatives(ere_scan *s);

/* The costs of a and b one after the other (or side by side): they add. */
static void ere_add(ere_cost *into, ere_cost a)
{
    into->copies += a.copies;
    into->quantifiers += a.quantifiers;
    into->empty_loops += a.empty_loops;
}

/* Past the bracket expression at s->p ('['), with its [:class:], [=e=] and
 * [.c.] parts and a leading ']' or '^]' taken literally. */
static void ere_skip_bracket(ere_scan *s)
{
    const char *p = s->p + 1;
    if (*p == '^')
        p++;
    if (*p == ']')
        p++;
    while (*p && *p != ']') {
        if (*p == '[' && (p[1] == ':' || p[1] == '=' || p[1] == '.')) {
            char close = p[1];
            const char *e = p + 2;
            while (*e && !(e[0] == close && e[1] == ']'))
                e++;
            p = *e ? e + 2 : e;
        } else {
            p++;
        }
    }
    s->p = *p ? p + 1 : p;
}

/* The interval at p ('{'): {m}, {m,}, {m,n} or glibc's {,n} and {,}. Its largest
 * number of copies (m + 1 for {m,}: m copies and a loop), *end past it and
 * *can_be_zero; -1 when it is none (regcomp then refuses or reads a
 * literal '{'). */
static double ere_interval(const char *p, const char **end, bool *can_be_zero)
{
    double lo = 0, hi = 0;
    bool has_lo = false, has_hi = false, comma = false;
    for (p++; isdigit((unsigned char)*p); p++, has_lo = true)
        lo = lo * 10 + (*p - '0');
    if (*p == ',') {
        comma = true;
        for (p++; isdigit((unsigned char)*p); p++, has_hi = true)
            hi = hi * 10 + (*p - '0');
    }
    if (*p != '}' || (!has_lo && !has_hi && !comma))
        return -1; /* "{,}" is glibc's {0,}, a star */
    *end = p + 1;
    *can_be_zero = lo == 0;
    if (!comma)
        return lo;
    return has_hi ? (hi > lo ? hi : lo) : lo + 1;
}

/* An atom and its quantifiers. */
static ere_cost ere_piece(ere_scan *s)
{
    ere_cost a = {0, 0, 0, false};
    char c = *s->p;
    if (c == '(') {
        s->p++;
        if (++s->depth > PATTERN_MAX_DEPTH) {
            s->too_deep = true;
            s->p += strlen(s->p);
            return a;
        }
        a = ere_alternatives(s);
        s->depth--;
        if (*s->p == ')')
            s->p++;
    } else if (c == '[') {
        ere_skip_bracket(s);
        a.copies = 1;
    } else if (c == '\\') {
        s->p += s->p[1] ? 2 : 1;
        a.copies = 1;
    } else {
        s->p++;
        a.copies = 1;
        a.nullable = c == '^' || c == '$';
    }
    for (;;) {
        double k = 1;
        bool zero = false;
        char q = *s->p;
        if (q == '*' || q == '?' || q == '+') {
            zero = q != '+';
            k = q == '+' ? 2 : 1; /* glibc builds x+ as x x*: two copies */
            s->p++;
        } else if (q == '{') {
            const char *end;
            k = ere_interval(s->p, &end, &zero);
            if (k < 0)
                break;
            s->p = end;
            if (k < 1)
                k = 1; /* "x{0}": regcomp builds x all the same, then drops it */
        } else {
            break;
        }
        a.empty_loops = a.empty_loops * k + (a.nullable ? k : 0);
        a.copies *= k;
        a.quantifiers = a.quantifiers * k + 1;
        a.nullable = a.nullable || zero;
    }
    return a;
}

static ere_cost ere_sequence(ere_scan *s)
{
    ere_cost c = {0, 0, 0, true};
    while (*s->p && *s->p != '|' && *s->p != ')') {
        ere_cost a = ere_piece(s);
        ere_add(&c, a);
        c.nullable = c.nullable && a.nullable;
    }
    return c;
}

static ere_cost ere_alternatives(ere_scan *s)
{
    ere_cost c = {0, 0, 0, false};
    for (;;) {
        ere_cost a = ere_sequence(s);
        ere_add(&c, a);
        c.nullable = c.nullable || a.nullable;
        if (*s->p != '|')
            return c;
        s->p++;
    }
}

/* 0 when regcomp may compile the POSIX ERE `ere`, with *copies its size
 * once counted repeats are expanded; -1 with why set naming the limit it
 * passes. */
static int check_ere_cost(const char *ere, double *copies, char *why, size_t why_len)
{
    ere_scan s = {ere, 0, false};
    ere_cost c = {0, 0, 0, false};
    while (*s.p) { /* a stray ')' ends nothing: go on past it */
        ere_cost a = ere_alternatives(&s);
        ere_add(&c, a);
        if (*s.p)
            s.p++;
    }
    if (s.too_deep)
        return snprintf(why, why_len, "its groups nest deeper than %d", PATTERN_MAX_DEPTH), -1;
    if (c.copies > PATTERN_MAX_COPIES)
        return snprintf(why, why_len,
                        "its counted repeats ({m,n}) expand it past %d characters, which regcomp "
                        "would build in memory and time without bound",
                        PATTERN_MAX_COPIES),
               -1;
    if (c.empty_loops > PATTERN_MAX_EMPTY_LOOPS)
        return snprintf(why, why_len,
                        "it repeats something that can match nothing (as in '(a*)*' or '(|a)+') "
                        "more than %d times, which regcomp takes exponential time over",
                        PATTERN_MAX_EMPTY_LOOPS),
               -1;
    *copies = c.copies;
    if (c.quantifiers > PATTERN_MAX_QUANTIFIERS)
        return snprintf(why, why_len,
                        "it holds more than %d quantifiers (* + ? {m,n}, counting what counted "
                        "repeats copy), which regcomp would be slow to build",
                        PATTERN_MAX_QUANTIFIERS),
               -1;
    return 0;
}

/* Python pattern py into POSIX ERE text appended to out; -1 with why set for
 * a construct POSIX cannot express. */
static int translate_regex(const char *py, strbuf *out, char *why, size_t why_len)
{
    if (strlen(py) > PATTERN_MAX_BYTES)
        return snprintf(why, why_len, "the pattern is %zu bytes long, over the %d allowed",
                        strlen(py), PATTERN_MAX_BYTES),
               -1;
    for (size_t i = 0; py[i]; i++) {
        char c = py[i];
        if (c == '\\') {
            char e = py[++i];
            switch (e) {
            case 'd': sb_str(out, "[0-9]"); break;
            case 'D': sb_str(out, "[^0-9]"); break;
            case 'w': sb_str(out, "[_[:alnum:]]"); break;
            case 'W': sb_str(out, "[^_[:alnum:]]"); break;
            case 's': sb_str(out, "[[:space:]]"); break;
            case 'S': sb_str(out, "[^[:space:]]"); break;
            case 'A': sb_chr(out, '^'); break;
            case 'Z': sb_chr(out, '$'); break;
            case 'n': sb_chr(out, '\n'); break;
            case 't': sb_chr(out, '\t'); break;
            case 'x': {
                char h = hex_escape(py + i + 1);
                if (!h)
                    return snprintf(why, why_len, "\\x without two hex digits"), -1;
                i += 2;
                if (ere_special(h))
                    sb_chr(out, '\\');
                sb_chr(out, h);
                break;
            }
            case 0: return snprintf(why, why_len, "the pattern ends in '\\'"), -1;
            default:
                if (isalnum((unsigned char)e))
                    return snprintf(why, why_len, "the escape \\%c has no POSIX form", e), -1;
                if (ere_special(e))
                    sb_chr(out, '\\');
                sb_chr(out, e);
            }
            continue;
        }
        if (c == '[') {
            if (translate_bracket(py, &i, out, why, why_len) != 0)
                return -1;
            continue;
        }
        if (c == '(' && py[i + 1] == '?') {
            if (py[i + 2] != ':')
                return snprintf(why, why_len,
                                "'(?%c' (a lookaround, named group or inline flag) has no POSIX "
                                "form",
                                py[i + 2] ? py[i + 2] : ' '),
                       -1;
            sb_chr(out, '(');
            i += 2;
            continue;
        }
        if (c == '{') { /* a bounded quantifier: copied to its '}' (check_ere_cost
                         * counts what it costs) */
            size_t k = i;
            while (py[k] && py[k] != '}')
                k++;
            if (!py[k])
                return snprintf(why, why_len, "an unterminated '{'"), -1;
            sb_add(out, py + i, k - i + 1);
            i = k;
        } else {
            sb_chr(out, c);
        }
        /* after a quantifier, Python's lazy '?' or possessive '+' changes
         * which match is found, never whether one is */
        if ((c == '*' || c == '+' || c == '?' || c == '{') &&
            (py[i + 1] == '?' || py[i + 1] == '+'))
            i++;
    }
    return 0;
}

int lora_pattern_compile_within(regex_t *re, const char *prefix, const char *py, const char *suffix,
                                double *copies_left, char *why, size_t why_len)
{
    strbuf b = {0};
    sb_str(&b, prefix);
    if (translate_regex(py, &b, why, why_len) != 0) {
        free(b.s);
        return -1;
    }
    sb_str(&b, suffix);
    if (b.oom) {
        free(b.s);
        return snprintf(why, why_len, "out of memory"), -1;
    }
    double copies = 0;
    if (check_ere_cost(b.s, &copies, why, why_len) != 0) {
        free(b.s);
        return -1;
    }
    if (copies > *copies_left) {
        free(b.s);
        return snprintf(why, why_len,
                        "the config's patterns together expand past %d characters, more than "
                        "regcomp should be given for one adapter",
                        LORA_PATTERN_CONFIG_COPIES),
               -1;
    }
    *copies_left -= copies;
    int rc = regcomp(re, b.s, REG_EXTENDED | REG_NOSUB);
    if (rc != 0) {
        char err[64];
        regerror(rc, re, err, sizeof err);
        snprintf(why, why_len, "not a regular expression POSIX accepts (%s)", err);
    }
    free(b.s);
    return rc == 0 ? 0 : -1;
}

int lora_pattern_compile(regex_t *re, const char *prefix, const char *py, const char *suffix,
                         char *why, size_t why_len)
{
    double copies_left = LORA_PATTERN_CONFIG_COPIES;
    return lora_pattern_compile_within(re, prefix, py, suffix, &copies_left, why, why_len);
}

/*
 * lexer.c - a template's source as tokens, the way jinja2's lexer cuts it
 * with trim_blocks and lstrip_blocks on (transformers' environment):
 *   - newlines are normalised to \n and one trailing newline is dropped
 *     (keep_trailing_newline=False);
 *   - "{%-", "{{-", "{#-" strip all whitespace before the tag, "-%}",
 *     "-}}", "-#}" all whitespace after;
 *   - trim_blocks: a "%}" or "#}" eats the one newline right after it;
 *   - lstrip_blocks: spaces and tabs from the start of a line up to a "{%"
 *     or "{#" go, unless the tag opens with "+" ("{%+");
 *   - comments vanish; inside a tag come names, numbers, strings (Python
 *     escapes) and operators, and an end tag counts only outside brackets.
 *
 * It owns nothing; tokens and unescaped strings live in the caller's arena.
 */
#include "internal/template_internal.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct lexer {
    tpl_arena *a;
    const char *src;
    size_t len, pos;
    int line;
    tpl_token *toks;
    size_t n, cap;
} lexer;

static void push(lexer *L, tpl_token t)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        tpl_token *nt = tpl_alloc(L->a, cap * sizeof *nt);
        if (L->n)
            memcpy(nt, L->toks, L->n * sizeof *nt);
        L->toks = nt;
        L->cap = cap;
    }
    L->toks[L->n++] = t;
}

static int count_lines(const char *p, size_t n)
{
    int c = 0;
    for (size_t i = 0; i < n; i++)
        c += p[i] == '\n';
    return c;
}

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* \n for \r\n and \r; one trailing newline dropped */
static char *normalise(tpl_arena *a, const char *src, size_t len, size_t *out_len)
{
    char *p = tpl_alloc(a, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            p[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            p[n++] = src[i];
        }
    }
    if (n && p[n - 1] == '\n')
        n--;
    p[n] = 0;
    *out_len = n;
    return p;
}

/* Python string-literal escapes (jinja2 decodes with unicode-escape) */
static size_t hex_escape(lexer *L, const char *s, size_t n, size_t digits, char *o)
{
    if (n < digits)
        tpl_raise(L->a->fail, QL_EFORMAT, L->line, "truncated \\x, \\u or \\U escape in a string");
    uint32_t cp = 0;
    for (size_t i = 0; i < digits; i++) {
        if (!isxdigit((unsigned char)s[i]))
            tpl_raise(L->a->fail, QL_EFORMAT, L->line, "bad \\x, \\u or \\U escape in a string");
        cp = cp * 16 + (uint32_t)(isdigit((unsigned char)s[i])
                                      ? s[i] - '0'
                                      : (tolower((unsigned char)s[i]) - 'a' + 10));
    }
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000))
        tpl_raise(L->a->fail, QL_EUNSUPPORTED, L->line, "escape of a surrogate or past U+10FFFF");
    return ql_utf8_put(cp, (uint8_t *)o);
}

static tpl_token lex_string(lexer *L)
{
    char q = L->src[L->pos];
    size_t start = ++L->pos;
    while (L->pos < L->len && L->src[L->pos] != q)
        L->pos += L->src[L->pos] == '\\' ? 2 : 1;
    if (L->pos >= L->len)
        tpl_raise(L->a->fail, QL_EFORMAT, L->line, "unterminated string");
    const char *s = L->src + start;
    size_t n = L->pos - start, k = 0;
    L->pos++;
    char *o = tpl_alloc(L->a, n + 1);
    static const char simple[] = "n\nt\tr\r\\\\''\"\"a\ab\bf\fv\v\n\0";
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\') {
            o[k++] = s[i];
            continue;
        }
        char e = s[++i];
        const char *hit = NULL;
        for (const char *p = simple; p[0] && !hit; p += 2)
            if (p[0] == e)
                hit = p;
        if (hit && e == '\n')
            continue; /* backslash-newline: a line continuation */
        if (hit)
            o[k++] = hit[1];
        else if (e == 'x' || e == 'u' || e == 'U') {
            size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            k += hex_escape(L, s + i + 1, n - i - 1, digits, o + k);
            i += digits;
        } else if (e >= '0' && e <= '7') {
            uint32_t cp = 0;
            for (int d = 0; d < 3 && i < n && s[i] >= '0' && s[i] <= '7'; d++, i++)
                cp = cp * 8 + (uint32_t)(s[i] - '0');
            i--;
            k += ql_utf8_put(cp, (uint8_t *)o + k);
        } else if (e == 'N') {
            tpl_raise(L->a->fail, QL_EUNSUPPORTED, L->line, "\\N{...} escapes are not supported");
        } else {
            o[k++] = '\\';
            o[k++] = e;
        }
    }
    L->line += count_lines(s, n);
    return (tpl_token){.kind = TK_STRING, .line = L->line, .s = o, .n = k};
}

static tpl_token lex_number(lexer *L)
{
    const char *s = L->src + L->pos;
    size_t n = 0;
    bool is_float = false;
    while (isdigit((unsigned char)s[n]) || (s[n] == '_' && isdigit((unsigned char)s[n + 1])))
        n++;
    if (s[n] == '.' && isdigit((unsigned char)s[n + 1])) {
        is_float = true;
        for (n++; isdigit((unsigned char)s[n]) || s[n] == '_'; n++)
            ;
    }
    if ((s[n] == 'e' || s[n] == 'E') &&
        (isdigit((unsigned char)s[n + 1]) ||
         ((s[n + 1] == '+' || s[n + 1] == '-') && isdigit((unsigned char)s[n + 2])))) {
        is_float = true;
        for (n += 2; isdigit((unsigned char)s[n]); n++)
            ;
    }
    char digits[64];
    size_t k = 0;
    for (size_t i = 0; i < n && k < sizeof digits - 1; i++)
        if (s[i] != '_')
            digits[k++] = s[i];
    digits[k] = 0;
    L->pos += n;
    tpl_token t = {.kind = is_float ? TK_FLOAT : TK_INT, .line = L->line};
    if (is_float)
        t.f = strtod(digits, NULL);
    else {
        errno = 0;
        unsigned long long v = strtoull(digits, NULL, 10);
        if (errno || v > INT64_MAX)
            tpl_raise(L->a->fail, QL_EUNSUPPORTED, L->line, "integer literal past 64 bits");
        t.i = (int64_t)v;
    }
    return t;
}

static const char *const operators[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "/",
                                        "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                        "<",  ">",  "=",  ".",  ":",  "|",  ",", ";", NULL};

/* The tokens of one tag after its opening, through its end ("}}" or "%}"). */
static void lex_tag(lexer *L, bool is_block)
{
    const char *end = is_block ? "%}" : "}}";
    int depth = 0;
    for (;;) {
        while (L->pos < L->len && is_space(L->src[L->pos]))
            L->line += L->src[L->pos++] == '\n';
        if (L->pos >= L->len)
            tpl_raise(L->a->fail, QL_EFORMAT, L->line, "unexpected end of template, expected '%s'",
                      end);
        const char *s = L->src + L->pos;
        if (depth == 0 && (!strncmp(s, end, 2) || (s[0] == '-' && !strncmp(s + 1, end, 2)) ||
                           (s[0] == '+' && is_block && !strncmp(s + 1, end, 2)))) {
            bool strip = s[0] == '-', plus = s[0] == '+';
            L->pos += 2 + (strip || plus);
            push(L, (tpl_token){.kind = is_block ? TK_BLOCK_END : TK_VAR_END, .line = L->line});
            if (strip)
                while (L->pos < L->len && is_space(L->src[L->pos]))
                    L->line += L->src[L->pos++] == '\n';
            else if (is_block && !plus && L->pos < L->len && L->src[L->pos] == '\n')
                L->pos++, L->line++;
            return;
        }
        if (isalpha((unsigned char)s[0]) || s[0] == '_') {
            size_t n = 1;
            while (isalnum((unsigned char)s[n]) || s[n] == '_')
                n++;
            push(L, (tpl_token){
                        .kind = TK_NAME, .line = L->line, .s = tpl_strdup(L->a, s, n), .n = n});
            L->pos += n;
        } else if (isdigit((unsigned char)s[0])) {
            push(L, lex_number(L));
        } else if (s[0] == '\'' || s[0] == '"') {
            push(L, lex_string(L));
        } else {
            const char *const *op = operators;
            while (*op && strncmp(s, *op, strlen(*op)))
                op++;
            if (!*op)
                tpl_raise(L->a->fail, QL_EFORMAT, L->line, "unexpected character '%c'", s[0]);
            depth += (s[0] == '(' || s[0] == '[' || s[0] == '{') -
                     (s[0] == ')' || s[0] == ']' || s[0] == '}');
            if (depth < 0)
                depth = 0;
            push(L, (tpl_token){.kind = TK_OP, .line = L->line, .s = *op, .n = strlen(*op)});
            L->pos += strlen(*op);
        }
    }
}

/* The comment after "{#"; its end applies the same whitespace rules. */
static void skip_comment(lexer *L)
{
    const char *s = L->src + L->pos;
    const char *e = strstr(s, "#}");
    if (!e)
        tpl_raise(L->a->fail, QL_EFORMAT, L->line, "unterminated comment");
    bool strip = e > s && e[-1] == '-', plus = e > s && e[-1] == '+';
    L->line += count_lines(s, (size_t)(e - s));
    L->pos = (size_t)(e - L->src) + 2;
    if (strip)
        while (L->pos < L->len && is_space(L->src[L->pos]))
            L->line += L->src[L->pos++] == '\n';
    else if (!plus && L->pos < L->len && L->src[L->pos] == '\n')
        L->pos++, L->line++;
}

/* The text before a tag, with the tag's "-" or lstrip_blocks applied. */
static void emit_text(lexer *L, const char *text, size_t n, char mod, char kind, bool line_start)
{
    int line = L->line;
    L->line += count_lines(text, n);
    if (mod == '-') {
        while (n && is_space(text[n - 1]))
            n--;
    } else if (mod != '+' && kind != '{') {
        size_t l = n;
        while (l && text[l - 1] != '\n')
            l--;
        if (l > 0 || line_start) {
            size_t k = l;
            while (k < n && (text[k] == ' ' || text[k] == '\t' || text[k] == '\f' ||
                             text[k] == '\v' || text[k] == '\r'))
                k++;
            if (k == n)
                n = l;
        }
    }
    if (n)
        push(L, (tpl_token){.kind = TK_TEXT, .line = line, .s = text, .n = n});
}

size_t tpl_lex(tpl_arena *a, const char *source, size_t source_len, tpl_token **toks)
{
    lexer L = {.a = a, .line = 1};
    L.src = normalise(a, source, source_len, &L.len);
    bool line_start = true;
    while (L.pos < L.len) {
        const char *s = L.src + L.pos, *tag = s;
        while ((tag = strchr(tag, '{')) && tag[1] != '{' && tag[1] != '%' && tag[1] != '#')
            tag++;
        if (!tag) {
            emit_text(&L, s, L.len - L.pos, 0, '{', false);
            break;
        }
        char kind = tag[1], mod = (tag[2] == '-' || tag[2] == '+') ? tag[2] : 0;
        emit_text(&L, s, (size_t)(tag - s), mod, kind, line_start);
        L.pos = (size_t)(tag - L.src) + 2 + (mod != 0);
        if (kind == '#') {
            skip_comment(&L);
        } else {
            push(&L,
                 (tpl_token){.kind = kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, .line = L.line});
            lex_tag(&L, kind == '%');
        }
        line_start = L.pos > 0 && L.src[L.pos - 1] == '\n';
    }
    push(&L, (tpl_token){.kind = TK_EOF, .line = L.line});
    *toks = L.toks;
    return L.n;
}

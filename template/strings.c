/*
 * strings.c - Python's str methods as chat templates call them (strip,
 * split, startswith, replace, title, find, join, ...) and the dict and
 * loop methods (items, keys, values, get, loop.cycle), over UTF-8 text.
 * Whitespace is Python's str.isspace set; case mapping (upper, lower,
 * title, capitalize) covers ASCII letters only and leaves other
 * characters as they are.
 *
 * It owns nothing; results live in the render's arena.
 */
#include "internal/template_internal.h"

#include <ctype.h>
#include <string.h>

/* the byte length of the whitespace character at p[0..n), or 0 */
static size_t space_at(const char *p, size_t n)
{
    unsigned char c = (unsigned char)p[0];
    if (c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f))
        return 1;
    uint32_t cp;
    size_t k = c >= 0x80 ? ql_utf8_next((const uint8_t *)p, n, &cp) : 0;
    if (!k)
        return 0;
    bool ws = cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
              cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
    return ws ? k : 0;
}

/* the start of the UTF-8 character that ends at p[n) */
static size_t char_before(const char *p, size_t n)
{
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)p[i] & 0xC0) == 0x80 && n - i < 4)
        i--;
    return i;
}

static bool in_chars(tv chars, const char *p, size_t k)
{
    for (size_t i = 0; i + k <= chars.s.n; i++)
        if (!memcmp(chars.s.p + i, p, k))
            return true;
    return false;
}

/* strip/lstrip/rstrip: whitespace, or any character of chars */
tv tpl_strip(tv s, tv chars, bool left, bool right)
{
    const char *p = s.s.p;
    size_t a = 0, b = s.s.n;
    bool by_chars = chars.kind == TV_STR;
    while (left && a < b) {
        size_t k = by_chars ? tv_str_offset(p + a, b - a, 1) : space_at(p + a, b - a);
        if (!k || (by_chars && !in_chars(chars, p + a, k)))
            break;
        a += k;
    }
    while (right && b > a) {
        size_t i = char_before(p + a, b - a) + a;
        size_t k = by_chars ? (in_chars(chars, p + i, b - i) ? b - i : 0) : space_at(p + i, b - i);
        if (k != b - i || !k)
            break;
        b = i;
    }
    return tv_str(p + a, b - a);
}

static tv split(tpl_run *r, tv s, tv sep, int64_t maxsplit, int line)
{
    tv_list *l = tv_list_new(r->a, 0);
    const char *p = s.s.p;
    size_t n = s.s.n, i = 0;
    if (sep.kind == TV_STR) {
        if (!sep.s.n)
            TPL_RAISE(r, line, "split(): empty separator");
        size_t start = 0;
        while (i + sep.s.n <= n && maxsplit != 0) {
            if (!memcmp(p + i, sep.s.p, sep.s.n)) {
                tv_list_push(r->a, l, tv_str(p + start, i - start));
                i += sep.s.n;
                start = i;
                maxsplit--;
            } else {
                i++;
            }
        }
        tv_list_push(r->a, l, tv_str(p + start, n - start));
        return tv_list_value(l);
    }
    for (;;) {
        size_t k;
        while (i < n && (k = space_at(p + i, n - i)))
            i += k;
        if (i >= n)
            break;
        if (maxsplit == 0) {
            tv rest = tpl_strip(tv_str(p + i, n - i), tv_none(), false, true);
            tv_list_push(r->a, l, rest);
            break;
        }
        size_t start = i;
        while (i < n && !space_at(p + i, n - i))
            i++;
        tv_list_push(r->a, l, tv_str(p + start, i - start));
        maxsplit--;
    }
    return tv_list_value(l);
}

static tv rsplit(tpl_run *r, tv s, tv sep, int64_t maxsplit, int line)
{
    if (sep.kind != TV_STR || maxsplit < 0)
        return split(r, s, sep, maxsplit, line);
    if (!sep.s.n)
        TPL_RAISE(r, line, "rsplit(): empty separator");
    tv_list *rev = tv_list_new(r->a, 0);
    size_t end = s.s.n, i = s.s.n;
    while (i >= sep.s.n && maxsplit != 0) {
        if (!memcmp(s.s.p + i - sep.s.n, sep.s.p, sep.s.n)) {
            tv_list_push(r->a, rev, tv_str(s.s.p + i, end - i));
            i -= sep.s.n;
            end = i;
            maxsplit--;
        } else {
            i--;
        }
    }
    tv_list_push(r->a, rev, tv_str(s.s.p, end));
    tv_list *l = tv_list_new(r->a, rev->n);
    for (size_t k = rev->n; k-- > 0;)
        tv_list_push(r->a, l, rev->v[k]);
    return tv_list_value(l);
}

tv tpl_replace(tpl_run *r, tv s, tv old, tv new_, int64_t count)
{
    tpl_buf b = {.a = r->a};
    size_t i = 0;
    if (!old.s.n) {
        /* Python puts new before every character and at the end */
        for (; i < s.s.n && count != 0; count--) {
            size_t k = tv_str_offset(s.s.p + i, s.s.n - i, 1);
            tb_put(&b, new_.s.p, new_.s.n);
            tb_put(&b, s.s.p + i, k);
            i += k;
        }
        if (i == s.s.n && count != 0)
            tb_put(&b, new_.s.p, new_.s.n);
        tb_put(&b, s.s.p + i, s.s.n - i);
        return tb_value(&b);
    }
    while (i < s.s.n) {
        if (count != 0 && i + old.s.n <= s.s.n && !memcmp(s.s.p + i, old.s.p, old.s.n)) {
            tb_put(&b, new_.s.p, new_.s.n);
            i += old.s.n;
            count--;
        } else {
            tb_putc(&b, s.s.p[i++]);
        }
    }
    return tb_value(&b);
}

/* case: 'u' upper, 'l' lower, 't' Python str.title, 'c' capitalize */
tv tpl_case(tpl_run *r, tv s, char mode)
{
    char *o = tpl_strdup(r->a, s.s.p, s.s.n);
    bool prev_cased = false;
    for (size_t i = 0; i < s.s.n; i++) {
        unsigned char c = (unsigned char)o[i];
        bool up = mode == 'u' || (mode == 'c' && i == 0) || (mode == 't' && !prev_cased);
        o[i] = (char)(up ? toupper(c) : tolower(c));
        prev_cased = isalpha(c) || c >= 0x80;
    }
    return tv_str(o, s.s.n);
}

static int64_t find(tv s, tv sub, bool from_right)
{
    if (sub.s.n > s.s.n)
        return -1;
    for (size_t k = 0; k <= s.s.n - sub.s.n; k++) {
        size_t i = from_right ? s.s.n - sub.s.n - k : k;
        if (!memcmp(s.s.p + i, sub.s.p, sub.s.n))
            return (int64_t)tv_str_len(s.s.p, i);
    }
    return -1;
}

static bool affix(tpl_run *r, tv s, tv x, bool at_end, int line)
{
    if (x.kind == TV_LIST) {
        for (size_t i = 0; i < x.l->n; i++)
            if (affix(r, s, x.l->v[i], at_end, line))
                return true;
        return false;
    }
    if (x.kind != TV_STR)
        TPL_RAISE(r, line, "%s arg must be str or a tuple of str, not %s",
                  at_end ? "endswith" : "startswith", tv_type_name(x));
    return x.s.n <= s.s.n && !memcmp(s.s.p + (at_end ? s.s.n - x.s.n : 0), x.s.p, x.s.n);
}

static tv join(tpl_run *r, tv sep, tv items, int line)
{
    tv_list *l = tpl_iterable(r, items, line);
    tpl_buf b = {.a = r->a};
    for (size_t i = 0; i < l->n; i++) {
        if (l->v[i].kind != TV_STR)
            TPL_RAISE(r, line, "sequence item %zu: expected str instance, %s found", i,
                      tv_type_name(l->v[i]));
        if (i)
            tb_put(&b, sep.s.p, sep.s.n);
        tb_put(&b, l->v[i].s.p, l->v[i].s.n);
    }
    return tb_value(&b);
}

static tv splitlines(tpl_run *r, tv s)
{
    tv_list *l = tv_list_new(r->a, 0);
    size_t start = 0, i = 0;
    while (i < s.s.n) {
        char c = s.s.p[i];
        if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e)) {
            tv_list_push(r->a, l, tv_str(s.s.p + start, i - start));
            i += (c == '\r' && i + 1 < s.s.n && s.s.p[i + 1] == '\n') ? 2 : 1;
            start = i;
        } else {
            i++;
        }
    }
    if (start < s.s.n)
        tv_list_push(r->a, l, tv_str(s.s.p + start, s.s.n - start));
    return tv_list_value(l);
}
tv tpl_splitlines(tpl_run *r, tv s)
{
    return splitlines(r, s);
}

static bool all_chars(tv s, int (*pred)(int))
{
    if (!s.s.n)
        return false;
    for (size_t i = 0; i < s.s.n; i++)
        if (!pred((unsigned char)s.s.p[i]))
            return false;
    return true;
}

static void need_str(tpl_run *r, tv v, const char *what, int line)
{
    if (v.kind != TV_STR)
        TPL_RAISE(r, line, "%s: expected a string, got %s", what, tv_type_name(v));
}

static int64_t opt_int(tpl_run *r, tv v, int64_t dflt, const char *what, int line)
{
    if (v.kind == TV_MISSING || v.kind == TV_NONE)
        return dflt;
    if (v.kind != TV_INT)
        TPL_RAISE(r, line, "%s: expected an integer, got %s", what, tv_type_name(v));
    return v.i;
}

/* the argument a replacement field names: "" (the next), a number or a
 * keyword */
static tv format_arg(tpl_run *r, const tpl_args *args, const char *f, size_t n, size_t *next,
                     int line)
{
    bool numeric = n > 0;
    size_t idx = 0;
    for (size_t i = 0; i < n; i++) {
        numeric = numeric && isdigit((unsigned char)f[i]);
        idx = idx * 10 + (size_t)(f[i] - '0');
    }
    if (!n || numeric) {
        idx = n ? idx : (*next)++;
        if (idx >= args->npos)
            TPL_RAISE(r, line, "format: replacement index %zu out of range", idx);
        return args->pos[idx];
    }
    for (size_t k = 0; k < args->nkw; k++)
        if (strlen(args->kwn[k]) == n && !memcmp(args->kwn[k], f, n))
            return args->kwv[k];
    TPL_RAISE(r, line, "format: no argument named '%.*s'", (int)n, f);
}

/* str.format with plain fields: {}, {0}, {name}, {{ and }}; a format spec,
 * conversion or attribute in a field is refused rather than guessed */
static tv format(tpl_run *r, tv s, const tpl_args *args, int line)
{
    tpl_buf b = {.a = r->a};
    size_t next = 0;
    for (size_t i = 0; i < s.s.n; i++) {
        char c = s.s.p[i];
        if ((c == '{' || c == '}') && i + 1 < s.s.n && s.s.p[i + 1] == c) {
            tb_putc(&b, c);
            i++;
            continue;
        }
        if (c == '}')
            TPL_RAISE(r, line, "format: single '}' encountered in format string");
        if (c != '{') {
            tb_putc(&b, c);
            continue;
        }
        const char *f = s.s.p + i + 1, *end = memchr(f, '}', s.s.n - i - 1);
        if (!end)
            TPL_RAISE(r, line, "format: single '{' encountered in format string");
        size_t n = (size_t)(end - f);
        if (memchr(f, ':', n) || memchr(f, '!', n) || memchr(f, '.', n) || memchr(f, '[', n))
            TPL_RAISE(r, line, "format: only plain fields ({}, {0}, {name}) are supported");
        tv v = format_arg(r, args, f, n, &next, line);
        tpl_check_printable(r, v, line);
        tv_print(&b, v);
        i += n + 1;
    }
    return tb_value(&b);
}

static tv str_method(tpl_run *r, tv s, const char *name, const tpl_args *args, int line)
{
    static const char *const p_chars[] = {"chars", NULL},
                             *const p_split[] = {"sep", "maxsplit", NULL},
                             *const p_affix[] = {"prefix", NULL}, *const p_sub[] = {"sub", NULL},
                             *const p_repl[] = {"old", "new", "count", NULL},
                             *const p_join[] = {"iterable", NULL}, *const p_none[] = {NULL};
    tv a[4];
    if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
        tpl_bind(r, name, p_chars, args, a, line);
        if (a[0].kind != TV_MISSING && a[0].kind != TV_NONE)
            need_str(r, a[0], name, line);
        return tpl_strip(s, a[0], name[0] != 'r', name[0] != 'l');
    }
    if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
        tpl_bind(r, name, p_split, args, a, line);
        if (a[0].kind != TV_MISSING && a[0].kind != TV_NONE)
            need_str(r, a[0], name, line);
        int64_t max = opt_int(r, a[1], -1, name, line);
        return name[0] == 'r' ? rsplit(r, s, a[0], max, line) : split(r, s, a[0], max, line);
    }
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        tpl_bind(r, name, p_affix, args, a, line);
        return tv_bool(affix(r, s, a[0], name[0] == 'e', line));
    }
    if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "count")) {
        tpl_bind(r, name, p_sub, args, a, line);
        need_str(r, a[0], name, line);
        if (name[0] != 'c')
            return tv_int(find(s, a[0], name[0] == 'r'));
        int64_t c = 0;
        if (!a[0].s.n)
            return tv_int((int64_t)tv_str_len(s.s.p, s.s.n) + 1);
        for (size_t i = 0; i + a[0].s.n <= s.s.n;)
            if (!memcmp(s.s.p + i, a[0].s.p, a[0].s.n))
                c++, i += a[0].s.n;
            else
                i++;
        return tv_int(c);
    }
    if (!strcmp(name, "replace")) {
        tpl_bind(r, name, p_repl, args, a, line);
        need_str(r, a[0], name, line);
        need_str(r, a[1], name, line);
        return tpl_replace(r, s, a[0], a[1], opt_int(r, a[2], -1, name, line));
    }
    if (!strcmp(name, "format"))
        return format(r, s, args, line);
    if (!strcmp(name, "join")) {
        tpl_bind(r, name, p_join, args, a, line);
        return join(r, s, a[0], line);
    }
    tpl_bind(r, name, p_none, args, a, line);
    if (!strcmp(name, "splitlines"))
        return splitlines(r, s);
    if (!strncmp(name, "is", 2)) {
        int (*pred)(int) = !strcmp(name, "isdigit")   ? isdigit
                           : !strcmp(name, "isalpha") ? isalpha
                           : !strcmp(name, "isalnum") ? isalnum
                           : !strcmp(name, "isspace") ? isspace
                           : !strcmp(name, "isupper") ? isupper
                                                      : islower;
        return tv_bool(all_chars(s, pred));
    }
    return tpl_case(r, s, name[0] == 'c' ? 'c' : name[0]);
}

static tv dict_method(tpl_run *r, tv d, const char *name, const tpl_args *args, int line)
{
    static const char *const p_get[] = {"key", "default", NULL}, *const p_none[] = {NULL};
    tv a[2];
    if (!strcmp(name, "get")) {
        tpl_bind(r, name, p_get, args, a, line);
        if (a[0].kind == TV_MISSING)
            TPL_RAISE(r, line, "get() takes at least 1 argument");
        tv *v = tv_dict_get(d.d, a[0]);
        return v ? *v : a[1].kind == TV_MISSING ? tv_none() : a[1];
    }
    tpl_bind(r, name, p_none, args, a, line);
    tv_list *l = tv_list_new(r->a, d.d->n);
    l->pyclass = name[0] == 'k' ? "dict_keys" : name[0] == 'v' ? "dict_values" : "dict_items";
    for (size_t i = 0; i < d.d->n; i++) {
        if (name[0] == 'k') {
            tv_list_push(r->a, l, d.d->keys[i]);
        } else if (name[0] == 'v') {
            tv_list_push(r->a, l, d.d->vals[i]);
        } else {
            tv_list *pair = tv_list_new(r->a, 2);
            pair->tuple = true;
            tv_list_push(r->a, pair, d.d->keys[i]);
            tv_list_push(r->a, pair, d.d->vals[i]);
            tv_list_push(r->a, l, tv_list_value(pair));
        }
    }
    return tv_list_value(l);
}

tv tpl_call_method(tpl_run *r, tv self, const char *name, const tpl_args *args, int line)
{
    if (self.kind == TV_DICT && self.d->flavor == TD_LOOP && !strcmp(name, "cycle")) {
        if (!args->npos || args->nkw)
            TPL_RAISE(r, line, "loop.cycle() takes one or more positional arguments");
        tv *i = tv_dict_gets(self.d, "index0", 6);
        return args->pos[(size_t)i->i % args->npos];
    }
    if (self.kind == TV_STR && tpl_is_str_method(name))
        return str_method(r, self, name, args, line);
    if (self.kind == TV_DICT && self.d->flavor == TD_DICT &&
        (!strcmp(name, "items") || !strcmp(name, "keys") || !strcmp(name, "values") ||
         !strcmp(name, "get")))
        return dict_method(r, self, name, args, line);
    if (self.kind == TV_UNDEF)
        TPL_RAISE(r, line, "'%s' is undefined", self.s.p ? self.s.p : "value");
    TPL_RAISE(r, line, "'%s' object has no method '%s'", tv_type_name(self), name);
}

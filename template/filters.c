/*
 * filters.c - the filters and tests this renderer supports, each as
 * jinja2 3.x defines it (filters.py, tests.py), with transformers' tojson
 * in place of jinja2's: one table of names for each, which the parser
 * consults to refuse any other name at compile time.
 *
 * It owns nothing; results live in the render's arena.
 */
#include "internal/template_internal.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FILTER(name)                                                                               \
    static tv f_##name(tpl_run *r, tpl_scope *s, tv v, const tpl_args *args, int line)
#define BIND(...)                                                                                  \
    static const char *const params[] = {__VA_ARGS__, NULL};                                       \
    tv a[sizeof params / sizeof params[0]];                                                        \
    tpl_bind(r, what, params, args, a, line)

static bool given(tv v)
{
    return v.kind != TV_MISSING;
}

static tv str_of(tpl_run *r, tv v)
{
    return tv_to_str(r->a, v);
}

static tv_list *list_of(tpl_run *r, tv v, int line)
{
    return tpl_iterable(r, v, line);
}

FILTER(trim)
{
    (void)s;
    static const char what[] = "trim";
    BIND("chars");
    return tpl_strip(str_of(r, v), given(a[0]) ? a[0] : tv_none(), true, true);
}

static const char *json_sep(tpl_run *r, tv v, int line)
{
    if (v.kind != TV_STR)
        TPL_RAISE(r, line, "tojson: separators must be two strings");
    return tpl_strdup(r->a, v.s.p, v.s.n);
}

/* transformers' tojson: json.dumps(x, ensure_ascii, indent, separators,
 * sort_keys) with ensure_ascii False by default */
FILTER(tojson)
{
    (void)s;
    static const char what[] = "tojson";
    BIND("ensure_ascii", "indent", "separators", "sort_keys");
    tv_json_opts o = {.indent = -1};
    if (given(a[1]) && a[1].kind != TV_NONE) {
        if (a[1].kind != TV_INT || a[1].i < 0 || a[1].i > 64)
            TPL_RAISE(r, line, "tojson: indent must be an integer in [0, 64]");
        o.indent = (int)a[1].i;
    }
    o.ensure_ascii = given(a[0]) && tv_truthy(a[0]);
    o.sort_keys = given(a[3]) && tv_truthy(a[3]);
    o.item_sep = o.indent >= 0 ? "," : ", ";
    o.key_sep = ": ";
    if (given(a[2]) && a[2].kind != TV_NONE) {
        if (a[2].kind != TV_LIST || a[2].l->n != 2)
            TPL_RAISE(r, line, "tojson: separators must be (item_separator, key_separator)");
        o.item_sep = json_sep(r, a[2].l->v[0], line);
        o.key_sep = json_sep(r, a[2].l->v[1], line);
    }
    tpl_buf b = {.a = r->a};
    tv_tojson_opts(&b, v, &o, 0, r->fail, line);
    return tb_value(&b);
}

static int64_t length(tpl_run *r, tv v, int line)
{
    switch (v.kind) {
    case TV_UNDEF: return 0;
    case TV_STR: return (int64_t)tv_str_len(v.s.p, v.s.n);
    case TV_LIST:
        if (v.l->gen)
            break;
        return (int64_t)v.l->n;
    case TV_DICT: return (int64_t)v.d->n;
    default: break;
    }
    TPL_RAISE(r, line, "object of type '%s' has no len()",
              v.kind == TV_LIST ? "generator" : tv_type_name(v));
}

FILTER(length)
{
    (void)s;
    static const char what[] = "length";
    BIND("value");
    (void)a;
    return tv_int(length(r, v, line));
}

FILTER(default)
{
    (void)s;
    static const char what[] = "default";
    BIND("default_value", "boolean");
    bool replace = v.kind == TV_UNDEF || (given(a[1]) && tv_truthy(a[1]) && !tv_truthy(v));
    return replace ? (given(a[0]) ? a[0] : tv_str("", 0)) : v;
}

/* item.attr, where attr may be dotted ("function.name") or an index */
static tv attr_of(tpl_run *r, tv item, tv attr, int line)
{
    if (attr.kind == TV_INT)
        return tpl_getitem(r, item, attr, line);
    if (attr.kind != TV_STR)
        TPL_RAISE(r, line, "attribute must be a string or an integer");
    size_t start = 0;
    for (size_t i = 0; i <= attr.s.n; i++) {
        if (i < attr.s.n && attr.s.p[i] != '.')
            continue;
        const char *part = attr.s.p + start;
        size_t n = i - start;
        char *end;
        long long idx = n && isdigit((unsigned char)part[0]) ? strtoll(part, &end, 10) : -1;
        if (idx >= 0 && end == part + n)
            item = tpl_getitem(r, item, tv_int(idx), line);
        else
            item = tpl_getitem(r, item, tv_str(part, n), line);
        if (item.kind == TV_UNDEF && i < attr.s.n)
            return item;
        start = i + 1;
    }
    return item;
}

FILTER(join)
{
    (void)s;
    static const char what[] = "join";
    BIND("d", "attribute");
    tv_list *l = list_of(r, v, line);
    tv sep = given(a[0]) ? str_of(r, a[0]) : tv_str("", 0);
    tpl_buf b = {.a = r->a};
    for (size_t i = 0; i < l->n; i++) {
        if (i)
            tb_put(&b, sep.s.p, sep.s.n);
        tv item = given(a[1]) ? attr_of(r, l->v[i], a[1], line) : l->v[i];
        tpl_check_printable(r, item, line);
        tv_print(&b, item);
    }
    return tb_value(&b);
}

static tv case_filter(tpl_run *r, tv v, const tpl_args *args, char mode, int line)
{
    static const char what[] = "upper, lower or capitalize";
    BIND("value");
    (void)a;
    return tpl_case(r, str_of(r, v), mode);
}
FILTER(upper)
{
    (void)s;
    return case_filter(r, v, args, 'u', line);
}
FILTER(lower)
{
    (void)s;
    return case_filter(r, v, args, 'l', line);
}
FILTER(capitalize)
{
    (void)s;
    return case_filter(r, v, args, 'c', line);
}

/* jinja2's title: upper the first letter after a space, -, (, {, [ or <;
 * lower the rest of each word */
FILTER(title)
{
    (void)s;
    static const char what[] = "title";
    BIND("value");
    (void)a;
    tv t = str_of(r, v);
    char *o = tpl_strdup(r->a, t.s.p, t.s.n);
    bool start = true;
    for (size_t i = 0; i < t.s.n; i++) {
        unsigned char c = (unsigned char)o[i];
        bool boundary = isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
        o[i] = (char)(start && !boundary ? toupper(c) : boundary ? c : tolower(c));
        start = boundary;
    }
    return tv_str(o, t.s.n);
}

FILTER(replace)
{
    (void)s;
    static const char what[] = "replace";
    BIND("old", "new", "count");
    if (!given(a[0]) || !given(a[1]))
        TPL_RAISE(r, line, "replace takes old and new");
    int64_t count = given(a[2]) && a[2].kind == TV_INT ? a[2].i : -1;
    return tpl_replace(r, str_of(r, v), str_of(r, a[0]), str_of(r, a[1]), count);
}

FILTER(first)
{
    (void)s;
    static const char what[] = "first";
    BIND("value");
    (void)a;
    tv_list *l = list_of(r, v, line);
    return l->n ? l->v[0] : tv_undef("first of an empty sequence");
}

FILTER(last)
{
    (void)s;
    static const char what[] = "last";
    BIND("value");
    (void)a;
    tv_list *l = list_of(r, v, line);
    if (l->gen)
        TPL_RAISE(r, line, "last: 'generator' object is not reversible (add |list)");
    return l->n ? l->v[l->n - 1] : tv_undef("last of an empty sequence");
}

static bool run_test(tpl_run *r, tv item, const tpl_args *args, size_t first, int line)
{
    if (args->npos <= first)
        return tv_truthy(item);
    tv name = args->pos[first];
    if (name.kind != TV_STR)
        TPL_RAISE(r, line, "the test name must be a string");
    char buf[32];
    snprintf(buf, sizeof buf, "%.*s", (int)name.s.n, name.s.p);
    tpl_test_fn t = tpl_find_test(buf);
    if (!t)
        TPL_RAISE(r, line, "test '%s' is not supported", buf);
    tpl_args rest = {.pos = args->pos + first + 1, .npos = args->npos - first - 1};
    return t(r, item, &rest, line);
}

/* select/reject(test, args) and selectattr/rejectattr(attr, test, args) */
static tv select_items(tpl_run *r, tv v, const tpl_args *args, bool by_attr, bool keep, int line)
{
    if (args->nkw)
        TPL_RAISE(r, line, "select filters take no keyword arguments");
    if (by_attr && !args->npos)
        TPL_RAISE(r, line, "selectattr/rejectattr need an attribute");
    tv_list *out = tv_list_new(r->a, 0);
    out->gen = true;
    if (!tv_truthy(v)) /* jinja2 walks nothing when the value is falsy */
        return tv_list_value(out);
    tv_list *l = list_of(r, v, line);
    for (size_t i = 0; i < l->n; i++) {
        tpl_step(r, line);
        tv item = by_attr ? attr_of(r, l->v[i], args->pos[0], line) : l->v[i];
        if (run_test(r, item, args, by_attr, line) == keep)
            tv_list_push(r->a, out, l->v[i]);
    }
    return tv_list_value(out);
}
FILTER(selectattr)
{
    (void)s;
    return select_items(r, v, args, true, true, line);
}
FILTER(rejectattr)
{
    (void)s;
    return select_items(r, v, args, true, false, line);
}
FILTER(select)
{
    (void)s;
    return select_items(r, v, args, false, true, line);
}
FILTER(reject)
{
    (void)s;
    return select_items(r, v, args, false, false, line);
}

FILTER(map)
{
    tv_list *out = tv_list_new(r->a, 0);
    out->gen = true;
    if (!tv_truthy(v)) /* jinja2 walks nothing when the value is falsy */
        return tv_list_value(out);
    tv_list *l = list_of(r, v, line);
    tv attr = {0}, dflt = {0};
    for (size_t k = 0; k < args->nkw; k++) {
        if (!strcmp(args->kwn[k], "attribute"))
            attr = args->kwv[k];
        else if (!strcmp(args->kwn[k], "default"))
            dflt = args->kwv[k];
        else if (given(attr) || args->npos == 0)
            TPL_RAISE(r, line, "map: unexpected keyword argument '%s'", args->kwn[k]);
    }
    tpl_filter_fn f = NULL;
    tpl_args rest = {0};
    if (!given(attr)) {
        if (!args->npos || args->pos[0].kind != TV_STR)
            TPL_RAISE(r, line, "map needs attribute= or a filter name");
        char name[32];
        snprintf(name, sizeof name, "%.*s", (int)args->pos[0].s.n, args->pos[0].s.p);
        if (!(f = tpl_find_filter(name)))
            TPL_RAISE(r, line, "filter '%s' is not supported", name);
        rest = (tpl_args){.pos = args->pos + 1,
                          .npos = args->npos - 1,
                          .kwn = args->kwn,
                          .kwv = args->kwv,
                          .nkw = args->nkw};
    }
    for (size_t i = 0; i < l->n; i++) {
        tpl_step(r, line);
        tv x;
        if (f) {
            x = f(r, s, l->v[i], &rest, line);
        } else {
            x = attr_of(r, l->v[i], attr, line);
            if (x.kind == TV_UNDEF && given(dflt))
                x = dflt;
        }
        tv_list_push(r->a, out, x);
    }
    return tv_list_value(out);
}

static tv pair(tpl_run *r, tv k, tv v)
{
    tv_list *p = tv_list_new(r->a, 2);
    p->tuple = true;
    tv_list_push(r->a, p, k);
    tv_list_push(r->a, p, v);
    return tv_list_value(p);
}

FILTER(items)
{
    (void)s;
    static const char what[] = "items";
    BIND("value");
    (void)a;
    tv_list *out = tv_list_new(r->a, 0);
    out->gen = true;
    if (v.kind == TV_UNDEF)
        return tv_list_value(out);
    if (v.kind != TV_DICT || v.d->flavor != TD_DICT)
        TPL_RAISE(r, line, "items: can only get item pairs from a mapping, not %s",
                  tv_type_name(v));
    for (size_t i = 0; i < v.d->n; i++)
        tv_list_push(r->a, out, pair(r, v.d->keys[i], v.d->vals[i]));
    return tv_list_value(out);
}

FILTER(string)
{
    (void)s;
    static const char what[] = "string";
    BIND("value");
    (void)a;
    tpl_check_printable(r, v, line);
    return str_of(r, v);
}

FILTER(list)
{
    (void)s;
    static const char what[] = "list";
    BIND("value");
    (void)a;
    tv_list *l = list_of(r, v, line), *out = tv_list_new(r->a, l->n);
    for (size_t i = 0; i < l->n; i++)
        tv_list_push(r->a, out, l->v[i]);
    return tv_list_value(out);
}

static bool parse_number(tv v, bool want_int, tv *out)
{
    char buf[64], *end;
    if (v.s.n == 0 || v.s.n >= sizeof buf)
        return false;
    memcpy(buf, v.s.p, v.s.n);
    buf[v.s.n] = 0;
    if (want_int) {
        long long i = strtoll(buf, &end, 10);
        while (isspace((unsigned char)*end))
            end++;
        if (end != buf && !*end)
            return *out = tv_int(i), true;
        double f = strtod(buf, &end);
        while (isspace((unsigned char)*end))
            end++;
        if (*end || isnan(f) || isinf(f) || fabs(f) > 9.2e18)
            return false;
        return *out = tv_int((int64_t)f), true;
    }
    double f = strtod(buf, &end);
    while (isspace((unsigned char)*end))
        end++;
    if (*end)
        return false;
    return *out = tv_float(f), true;
}

FILTER(int)
{
    (void)s;
    static const char what[] = "int";
    BIND("default", "base");
    tv dflt = given(a[0]) ? a[0] : tv_int(0), out;
    if (v.kind == TV_UNDEF)
        TPL_RAISE(r, line, "'%s' is undefined", v.s.p ? v.s.p : "value");
    if (given(a[1]) && !(a[1].kind == TV_INT && a[1].i == 10))
        TPL_RAISE(r, line, "int: only base 10 is supported");
    if (v.kind == TV_INT)
        return v;
    if (v.kind == TV_BOOL)
        return tv_int(v.b);
    if (v.kind == TV_FLOAT)
        return isnan(v.f) || isinf(v.f) || fabs(v.f) > 9.2e18 ? dflt : tv_int((int64_t)v.f);
    if (v.kind == TV_STR && parse_number(v, true, &out))
        return out;
    return dflt;
}

FILTER(float)
{
    (void)s;
    static const char what[] = "float";
    BIND("default");
    tv out;
    if (v.kind == TV_UNDEF)
        TPL_RAISE(r, line, "'%s' is undefined", v.s.p ? v.s.p : "value");
    if (tv_is_num(v))
        return tv_float(tv_num(v));
    if (v.kind == TV_STR && parse_number(v, false, &out))
        return out;
    return given(a[0]) ? a[0] : tv_float(0.0);
}

FILTER(abs)
{
    (void)s;
    static const char what[] = "abs";
    BIND("value");
    (void)a;
    if (v.kind == TV_INT && v.i == INT64_MIN)
        TPL_RAISE(r, line, "integer overflow");
    if (v.kind == TV_INT || v.kind == TV_BOOL)
        return tv_int(llabs(v.kind == TV_INT ? v.i : v.b));
    if (v.kind == TV_FLOAT)
        return tv_float(fabs(v.f));
    TPL_RAISE(r, line, "bad operand type for abs(): '%s'", tv_type_name(v));
}

FILTER(round)
{
    (void)s;
    static const char what[] = "round";
    BIND("precision", "method");
    if (!tv_is_num(v))
        TPL_RAISE(r, line, "round: expected a number, got %s", tv_type_name(v));
    int64_t prec = given(a[0]) && a[0].kind == TV_INT ? a[0].i : 0;
    const char *method = given(a[1]) && a[1].kind == TV_STR ? a[1].s.p : "common";
    if (v.kind != TV_FLOAT && !strncmp(method, "common", 6) && prec >= 0)
        return tv_int(v.kind == TV_INT ? v.i : v.b); /* Python's round(int, n) is the int */
    double x = tv_num(v), scale = pow(10.0, (double)prec), y = x * scale;
    if (!strncmp(method, "ceil", 4))
        y = ceil(y);
    else if (!strncmp(method, "floor", 5))
        y = floor(y);
    else
        y = nearbyint(y); /* Python's round: half to even */
    return tv_float(y / scale);
}

FILTER(indent)
{
    (void)s;
    static const char what[] = "indent";
    BIND("width", "first", "blank");
    tpl_buf pad = {.a = r->a};
    if (given(a[0]) && a[0].kind == TV_STR)
        tb_put(&pad, a[0].s.p, a[0].s.n);
    else
        for (int64_t i = 0, w = given(a[0]) && a[0].kind == TV_INT ? a[0].i : 4; i < w && i < 256;
             i++)
            tb_putc(&pad, ' ');
    bool first = given(a[1]) && tv_truthy(a[1]), blank = given(a[2]) && tv_truthy(a[2]);
    if (v.kind != TV_STR) /* jinja2 appends "\n" to the value itself */
        TPL_RAISE(r, line, "indent: expected a string, got %s", tv_type_name(v));
    tv text = v;
    tpl_buf t = {.a = r->a};
    tb_put(&t, text.s.p, text.s.n);
    tb_putc(&t, '\n'); /* jinja2 appends a newline before splitlines */
    tv_list *lines = tpl_splitlines(r, tb_value(&t)).l;
    tpl_buf b = {.a = r->a};
    if (first)
        tb_put(&b, pad.p, pad.n);
    for (size_t i = 0; i < lines->n; i++) {
        tv ln = lines->v[i];
        if (i) {
            tb_putc(&b, '\n');
            if (blank || ln.s.n)
                tb_put(&b, pad.p, pad.n);
        }
        tb_put(&b, ln.s.p, ln.s.n);
    }
    return tb_value(&b);
}

FILTER(safe)
{
    (void)s;
    static const char what[] = "safe";
    BIND("value");
    (void)a;
    tpl_check_printable(r, v, line);
    tv m = str_of(r, v);
    m.markup = true;
    return m;
}

FILTER(escape)
{
    (void)s;
    static const char what[] = "escape";
    BIND("value");
    (void)a;
    if (v.kind == TV_STR && v.markup)
        return v;
    tpl_check_printable(r, v, line);
    tpl_buf b = {.a = r->a};
    tpl_html_escape(&b, str_of(r, v));
    tv m = tb_value(&b);
    m.markup = true;
    return m;
}

/* ---- ordering filters: a stable merge sort whose comparisons may raise ---- */
typedef struct sort_key {
    tpl_run *r;
    bool case_sensitive;
    int line;
} sort_key;

static tv fold(sort_key *k, tv v)
{
    return !k->case_sensitive && v.kind == TV_STR ? tpl_case(k->r, v, 'l') : v;
}

static int sort_cmp(sort_key *k, tv a, tv b)
{
    a = fold(k, a);
    b = fold(k, b);
    if (tv_truthy(tpl_binop(k->r, "<", a, b, k->line)))
        return -1;
    return tv_truthy(tpl_binop(k->r, "<", b, a, k->line));
}

static void merge_sort(sort_key *k, tv *v, tv *keys, size_t n, tv *tmp, tv *tmpk)
{
    if (n < 2)
        return;
    size_t h = n / 2;
    merge_sort(k, v, keys, h, tmp, tmpk);
    merge_sort(k, v + h, keys + h, n - h, tmp, tmpk);
    size_t i = 0, j = h, o = 0;
    while (i < h || j < n) {
        bool left = j >= n || (i < h && sort_cmp(k, keys[j], keys[i]) >= 0);
        tmp[o] = left ? v[i] : v[j];
        tmpk[o++] = left ? keys[i++] : keys[j++];
    }
    memcpy(v, tmp, n * sizeof *v);
    memcpy(keys, tmpk, n * sizeof *keys);
}

static tv_list *sorted(tpl_run *r, tv_list *l, tv *keys, bool cs, bool reverse, int line)
{
    tv_list *out = tv_list_new(r->a, l->n);
    memcpy(out->v, l->v, l->n * sizeof(tv));
    out->n = l->n;
    sort_key k = {r, cs, line};
    tv *tmp = tpl_alloc(r->a, (l->n + 1) * sizeof(tv)),
       *tmpk = tpl_alloc(r->a, (l->n + 1) * sizeof(tv));
    r->steps += (long)l->n;
    tpl_step(r, line);
    if (reverse) {
        /* sorted(reverse=True) keeps equal items in their order */
        for (size_t i = 0; i < l->n / 2; i++) {
            tv t = out->v[i], tk = keys[i];
            out->v[i] = out->v[l->n - 1 - i], keys[i] = keys[l->n - 1 - i];
            out->v[l->n - 1 - i] = t, keys[l->n - 1 - i] = tk;
        }
    }
    merge_sort(&k, out->v, keys, l->n, tmp, tmpk);
    if (reverse)
        for (size_t i = 0; i < l->n / 2; i++) {
            tv t = out->v[i];
            out->v[i] = out->v[l->n - 1 - i];
            out->v[l->n - 1 - i] = t;
        }
    return out;
}

FILTER(sort)
{
    (void)s;
    static const char what[] = "sort";
    BIND("reverse", "case_sensitive", "attribute");
    tv_list *l = list_of(r, v, line);
    tv *keys = tpl_alloc(r->a, (l->n + 1) * sizeof(tv));
    for (size_t i = 0; i < l->n; i++)
        keys[i] = given(a[2]) ? attr_of(r, l->v[i], a[2], line) : l->v[i];
    return tv_list_value(
        sorted(r, l, keys, given(a[1]) && tv_truthy(a[1]), given(a[0]) && tv_truthy(a[0]), line));
}

FILTER(dictsort)
{
    (void)s;
    static const char what[] = "dictsort";
    BIND("case_sensitive", "by", "reverse");
    if (v.kind != TV_DICT)
        TPL_RAISE(r, line, "dictsort: expected a mapping, got %s", tv_type_name(v));
    bool by_value =
        given(a[1]) && a[1].kind == TV_STR && a[1].s.n == 5 && !memcmp(a[1].s.p, "value", 5);
    tv_list *pairs = tv_list_new(r->a, v.d->n);
    tv *keys = tpl_alloc(r->a, (v.d->n + 1) * sizeof(tv));
    for (size_t i = 0; i < v.d->n; i++) {
        tv_list_push(r->a, pairs, pair(r, v.d->keys[i], v.d->vals[i]));
        keys[i] = by_value ? v.d->vals[i] : v.d->keys[i];
    }
    return tv_list_value(sorted(r, pairs, keys, given(a[0]) && tv_truthy(a[0]),
                                given(a[2]) && tv_truthy(a[2]), line));
}

FILTER(unique)
{
    (void)s;
    static const char what[] = "unique";
    BIND("case_sensitive", "attribute");
    tv_list *l = list_of(r, v, line), *out = tv_list_new(r->a, l->n),
            *seen = tv_list_new(r->a, l->n);
    out->gen = true;
    sort_key k = {r, given(a[0]) && tv_truthy(a[0]), line};
    for (size_t i = 0; i < l->n; i++) {
        tpl_step(r, line);
        tv key = fold(&k, given(a[1]) ? attr_of(r, l->v[i], a[1], line) : l->v[i]);
        bool dup = false;
        for (size_t j = 0; j < seen->n && !dup; j++)
            dup = tv_eq(seen->v[j], key);
        if (!dup) {
            tv_list_push(r->a, seen, key);
            tv_list_push(r->a, out, l->v[i]);
        }
    }
    return tv_list_value(out);
}

FILTER(reverse)
{
    (void)s;
    static const char what[] = "reverse";
    BIND("value");
    (void)a;
    tv_list *l = list_of(r, v, line), *out = tv_list_new(r->a, l->n);
    for (size_t i = l->n; i-- > 0;)
        tv_list_push(r->a, out, l->v[i]);
    out->gen = v.kind == TV_DICT; /* reversed(dict): an iterator */
    if (v.kind != TV_STR)
        return tv_list_value(out);
    tpl_buf b = {.a = r->a};
    for (size_t i = 0; i < out->n; i++)
        tb_put(&b, out->v[i].s.p, out->v[i].s.n);
    return tb_value(&b);
}

/* min/max(case_sensitive=False, attribute=None): the first smallest or
 * largest item; undefined when empty */
static tv extreme(tpl_run *r, tv v, const tpl_args *args, bool want_max, int line)
{
    static const char what[] = "min or max";
    BIND("case_sensitive", "attribute");
    tv_list *l = list_of(r, v, line);
    sort_key k = {r, given(a[0]) && tv_truthy(a[0]), line};
    tv best = tv_undef("min or max of an empty sequence"), best_key = {0};
    for (size_t i = 0; i < l->n; i++) {
        tv key = given(a[1]) ? attr_of(r, l->v[i], a[1], line) : l->v[i];
        if (i == 0 || sort_cmp(&k, key, best_key) == (want_max ? 1 : -1)) {
            best = l->v[i];
            best_key = key;
        }
    }
    return best;
}
FILTER(sum)
{
    (void)s;
    static const char what[] = "sum";
    BIND("attribute", "start");
    tv total = given(a[1]) ? a[1] : tv_int(0);
    tv_list *l = list_of(r, v, line);
    for (size_t i = 0; i < l->n; i++)
        total =
            tpl_binop(r, "+", total, given(a[0]) ? attr_of(r, l->v[i], a[0], line) : l->v[i], line);
    return total;
}

FILTER(min)
{
    (void)s;
    return extreme(r, v, args, false, line);
}
FILTER(max)
{
    (void)s;
    return extreme(r, v, args, true, line);
}

static const struct {
    const char *name;
    tpl_filter_fn fn;
} filters[] = {
    {"max", f_max},
    {"min", f_min},
    {"sum", f_sum},
    {"abs", f_abs},
    {"capitalize", f_capitalize},
    {"count", f_length},
    {"d", f_default},
    {"e", f_escape},
    {"escape", f_escape},
    {"default", f_default},
    {"dictsort", f_dictsort},
    {"first", f_first},
    {"float", f_float},
    {"indent", f_indent},
    {"int", f_int},
    {"items", f_items},
    {"join", f_join},
    {"last", f_last},
    {"length", f_length},
    {"list", f_list},
    {"lower", f_lower},
    {"map", f_map},
    {"reject", f_reject},
    {"rejectattr", f_rejectattr},
    {"replace", f_replace},
    {"reverse", f_reverse},
    {"round", f_round},
    {"safe", f_safe},
    {"select", f_select},
    {"selectattr", f_selectattr},
    {"sort", f_sort},
    {"string", f_string},
    {"title", f_title},
    {"tojson", f_tojson},
    {"trim", f_trim},
    {"unique", f_unique},
    {"upper", f_upper},
};

tpl_filter_fn tpl_find_filter(const char *name)
{
    for (size_t i = 0; i < sizeof filters / sizeof filters[0]; i++)
        if (!strcmp(filters[i].name, name))
            return filters[i].fn;
    return NULL;
}

/* ---- tests ---- */
#define TEST(name) static bool t_##name(tpl_run *r, tv v, const tpl_args *args, int line)
static tv test_arg(tpl_run *r, const tpl_args *args, const char *what, int line)
{
    if (args->npos + args->nkw != 1)
        TPL_RAISE(r, line, "test '%s' takes one argument", what);
    return args->npos ? args->pos[0] : args->kwv[0];
}
#define NOARG(v) ((void)r, (void)args, (void)line)

TEST(defined)
{
    NOARG();
    return v.kind != TV_UNDEF;
}
TEST(undefined)
{
    NOARG();
    return v.kind == TV_UNDEF;
}
TEST(none)
{
    NOARG();
    return v.kind == TV_NONE;
}
TEST(string)
{
    NOARG();
    return v.kind == TV_STR;
}
TEST(number)
{
    NOARG();
    return tv_is_num(v);
}
TEST(integer)
{
    NOARG();
    return v.kind == TV_INT;
}
TEST(float)
{
    NOARG();
    return v.kind == TV_FLOAT;
}
TEST(boolean)
{
    NOARG();
    return v.kind == TV_BOOL;
}
TEST(true)
{
    NOARG();
    return v.kind == TV_BOOL && v.b;
}
TEST(false)
{
    NOARG();
    return v.kind == TV_BOOL && !v.b;
}
TEST(mapping)
{
    NOARG();
    return v.kind == TV_DICT && v.d->flavor == TD_DICT;
}
TEST(iterable)
{
    NOARG();
    return v.kind == TV_STR || v.kind == TV_LIST || (v.kind == TV_DICT && v.d->flavor == TD_DICT) ||
           v.kind == TV_UNDEF;
}
TEST(sequence)
{
    return t_iterable(r, v, args, line);
}
TEST(callable)
{
    NOARG();
    return v.kind == TV_MACRO || v.kind == TV_METHOD || v.kind == TV_FUNC;
}
TEST(lower)
{
    NOARG();
    if (v.kind != TV_STR)
        return false;
    tv l = tpl_case(r, v, 'l');
    return !memcmp(l.s.p, v.s.p, v.s.n);
}
TEST(upper)
{
    NOARG();
    if (v.kind != TV_STR)
        return false;
    tv u = tpl_case(r, v, 'u');
    return !memcmp(u.s.p, v.s.p, v.s.n);
}
/* value % divisor == want, with Python's % (so floats work as in jinja2) */
static bool mod_is(tpl_run *r, tv v, tv divisor, int64_t want, int line)
{
    if (!tv_is_num(v) || !tv_is_num(divisor))
        TPL_RAISE(r, line, "a number test needs numbers, got %s and %s", tv_type_name(v),
                  tv_type_name(divisor));
    return tv_eq(tpl_binop(r, "%", v, divisor, line), tv_int(want));
}
TEST(odd)
{
    NOARG();
    return mod_is(r, v, tv_int(2), 1, line);
}
TEST(even)
{
    NOARG();
    return mod_is(r, v, tv_int(2), 0, line);
}
TEST(divisibleby)
{
    return mod_is(r, v, test_arg(r, args, "divisibleby", line), 0, line);
}
TEST(eq)
{
    return tv_eq(v, test_arg(r, args, "eq", line));
}
TEST(ne)
{
    return !tv_eq(v, test_arg(r, args, "ne", line));
}
TEST(lt)
{
    return tv_truthy(tpl_binop(r, "<", v, test_arg(r, args, "lt", line), line));
}
TEST(le)
{
    return tv_truthy(tpl_binop(r, "<=", v, test_arg(r, args, "le", line), line));
}
TEST(gt)
{
    return tv_truthy(tpl_binop(r, ">", v, test_arg(r, args, "gt", line), line));
}
TEST(ge)
{
    return tv_truthy(tpl_binop(r, ">=", v, test_arg(r, args, "ge", line), line));
}
TEST(in)
{
    return tv_truthy(tpl_binop(r, "in", v, test_arg(r, args, "in", line), line));
}
TEST(sameas)
{
    tv o = test_arg(r, args, "sameas", line);
    if (v.kind != o.kind)
        return false;
    switch (v.kind) {
    case TV_NONE:
    case TV_UNDEF: return true;
    case TV_BOOL: return v.b == o.b;
    case TV_INT: return v.i == o.i && v.i >= -5 && v.i <= 256; /* CPython's small-int cache */
    case TV_LIST: return v.l == o.l;
    case TV_DICT: return v.d == o.d;
    default: return false;
    }
}

static const struct {
    const char *name;
    tpl_test_fn fn;
} tests[] = {
    {"boolean", t_boolean},
    {"callable", t_callable},
    {"defined", t_defined},
    {"divisibleby", t_divisibleby},
    {"eq", t_eq},
    {"equalto", t_eq},
    {"even", t_even},
    {"false", t_false},
    {"float", t_float},
    {"ge", t_ge},
    {"greaterthan", t_gt},
    {"gt", t_gt},
    {"in", t_in},
    {"integer", t_integer},
    {"iterable", t_iterable},
    {"le", t_le},
    {"lessthan", t_lt},
    {"lower", t_lower},
    {"lt", t_lt},
    {"mapping", t_mapping},
    {"ne", t_ne},
    {"none", t_none},
    {"number", t_number},
    {"odd", t_odd},
    {"sameas", t_sameas},
    {"sequence", t_sequence},
    {"string", t_string},
    {"true", t_true},
    {"undefined", t_undefined},
    {"upper", t_upper},
};

tpl_test_fn tpl_find_test(const char *name)
{
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!strcmp(tests[i].name, name))
            return tests[i].fn;
    return NULL;
}

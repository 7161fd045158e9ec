/*
 * ops.c - what jinja2 does with values through Python: attribute and item
 * access (jinja2's getattr tries the attribute, then the item; getitem the
 * item, then the attribute), the operators with Python's semantics (floor
 * division and modulo, true division to float, str/list repetition and
 * concatenation, int overflow refused rather than wrapped), the methods of
 * str, dict and the loop object that chat templates call, argument
 * binding, and the globals (range, namespace, dict, and transformers'
 * raise_exception and strftime_now).
 *
 * It owns nothing; results live in the render's arena.
 */
#include "internal/template_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---- the render's bounds and iteration ---- */
void tpl_step(tpl_run *r, int line)
{
    if (++r->steps > TPL_MAX_STEPS)
        TPL_RAISE(r, line, "the template ran more than %d loop iterations and calls",
                  TPL_MAX_STEPS);
}

/* the values a for loop walks: a list's items, a dict's keys, a
 * string's characters; undefined walks nothing */
tv_list *tpl_iterable(tpl_run *r, tv v, int line)
{
    if (v.kind == TV_LIST)
        return v.l;
    tv_list *l = tv_list_new(r->a, 0);
    if (v.kind == TV_UNDEF)
        return l;
    if (v.kind == TV_DICT && v.d->flavor == TD_DICT) {
        for (size_t i = 0; i < v.d->n; i++)
            tv_list_push(r->a, l, v.d->keys[i]);
        return l;
    }
    if (v.kind == TV_STR) {
        for (size_t off = 0; off < v.s.n;) {
            size_t end = tv_str_offset(v.s.p + off, v.s.n - off, 1);
            tv_list_push(r->a, l, tv_str(v.s.p + off, end));
            off += end;
        }
        return l;
    }
    TPL_RAISE(r, line, "'%s' object is not iterable", tv_type_name(v));
}

/* ---- argument binding ---- */
void tpl_bind(tpl_run *r, const char *what, const char *const *params, const tpl_args *args,
              tv *out, int line)
{
    size_t np = 0;
    while (params[np])
        np++;
    for (size_t i = 0; i < np; i++)
        out[i] = (tv){.kind = TV_MISSING};
    if (args->npos > np)
        TPL_RAISE(r, line, "%s takes at most %zu arguments (%zu given)", what, np, args->npos);
    for (size_t i = 0; i < args->npos; i++)
        out[i] = args->pos[i];
    for (size_t k = 0; k < args->nkw; k++) {
        size_t i = 0;
        while (i < np && strcmp(params[i], args->kwn[k]))
            i++;
        if (i == np)
            TPL_RAISE(r, line, "%s got an unexpected keyword argument '%s'", what, args->kwn[k]);
        if (out[i].kind != TV_MISSING)
            TPL_RAISE(r, line, "%s got multiple values for argument '%s'", what, args->kwn[k]);
        out[i] = args->kwv[k];
    }
}

/* ---- attribute and item access ---- */
static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};
static const char *const str_methods[] = {
    "strip",   "lstrip",  "rstrip",     "split",   "rsplit",     "startswith", "endswith",
    "upper",   "lower",   "replace",    "title",   "capitalize", "find",       "rfind",
    "count",   "join",    "splitlines", "isdigit", "isalpha",    "isalnum",    "isspace",
    "isupper", "islower", "format",     NULL};
/* what jinja2's ImmutableSandboxedEnvironment refuses to touch (it modifies
 * a list or dict): known, so the refusal comes at render as transformers'
 * does, not at compile */
static const char *const unsafe_methods[] = {"append",  "extend",     "insert", "pop",
                                             "remove",  "reverse",    "sort",   "clear",
                                             "popitem", "setdefault", "update", NULL};

/* the other attributes Python's str, list and dict have: touching one
 * fails at render rather than printing jinja2's undefined where Python
 * would give a bound method */
static const char *const python_attrs[] = {
    "casefold", "center",     "encode",       "expandtabs",   "format_map",   "index",
    "isascii",  "isdecimal",  "isidentifier", "isnumeric",    "isprintable",  "istitle",
    "ljust",    "maketrans",  "partition",    "removeprefix", "removesuffix", "rindex",
    "rjust",    "rpartition", "swapcase",     "translate",    "zfill",        NULL};
static const char *const python_list_attrs[] = {"index", "count", "copy", NULL};

static bool in_list(const char *const *l, const char *name)
{
    for (; *l; l++)
        if (!strcmp(*l, name))
            return true;
    return false;
}

bool tpl_is_method(const char *name)
{
    return in_list(dict_methods, name) || in_list(str_methods, name) ||
           in_list(unsafe_methods, name) || !strcmp(name, "cycle");
}

bool tpl_is_str_method(const char *name)
{
    return in_list(str_methods, name);
}

static tv method_value(tpl_run *r, tv self, const char *name)
{
    struct tv_method *m = tpl_alloc(r->a, sizeof *m);
    m->self = self;
    m->name = name;
    return (tv){.kind = TV_METHOD, .m = m};
}

static _Noreturn void undefined_access(tpl_run *r, tv obj, int line)
{
    if (obj.s.p)
        TPL_RAISE(r, line, "'%s' is undefined", obj.s.p);
    TPL_RAISE(r, line, "an undefined value has no attributes or items");
}

tv tpl_getattr(tpl_run *r, tv obj, const char *name, int line)
{
    if (obj.kind == TV_UNDEF)
        undefined_access(r, obj, line);
    if (((obj.kind == TV_DICT && obj.d->flavor == TD_DICT) || obj.kind == TV_LIST) &&
        in_list(unsafe_methods, name))
        TPL_RAISE(r, line, "access to attribute '%s' of '%s' object is unsafe.", name,
                  tv_type_name(obj));
    if (obj.kind == TV_DICT) {
        if (obj.d->flavor == TD_DICT && in_list(dict_methods, name))
            return method_value(r, obj, name);
        if (obj.d->flavor == TD_LOOP && !strcmp(name, "cycle"))
            return method_value(r, obj, name);
        tv *v = tv_dict_gets(obj.d, name, strlen(name));
        return v ? *v : tv_undef(NULL);
    }
    if (obj.kind == TV_STR && in_list(str_methods, name))
        return method_value(r, obj, name);
    if ((obj.kind == TV_STR && in_list(python_attrs, name)) ||
        (obj.kind == TV_LIST && in_list(python_list_attrs, name)))
        TPL_RAISE(r, line, "'%s' attribute '%s' is not supported", tv_type_name(obj), name);
    return tv_undef(NULL);
}

tv tpl_getitem(tpl_run *r, tv obj, tv key, int line)
{
    if (obj.kind == TV_UNDEF)
        undefined_access(r, obj, line);
    if (obj.kind == TV_DICT) {
        tv *v = tv_dict_get(obj.d, key);
        if (v)
            return *v;
        if (key.kind == TV_STR && obj.d->flavor != TD_DICT)
            return tpl_getattr(r, obj, tpl_strdup(r->a, key.s.p, key.s.n), line);
        return tv_undef(NULL);
    }
    if (obj.kind == TV_LIST && (obj.l->gen || (obj.l->pyclass && strcmp(obj.l->pyclass, "range"))))
        return tv_undef(NULL); /* a generator or dict view is not subscriptable */
    if ((obj.kind == TV_LIST || obj.kind == TV_STR) &&
        (key.kind == TV_INT || key.kind == TV_BOOL)) {
        int64_t i = key.kind == TV_INT ? key.i : key.b;
        int64_t n = obj.kind == TV_LIST ? (int64_t)obj.l->n : (int64_t)tv_str_len(obj.s.p, obj.s.n);
        if (i < 0)
            i += n;
        if (i < 0 || i >= n)
            return tv_undef(NULL);
        if (obj.kind == TV_LIST)
            return obj.l->v[i];
        size_t off = tv_str_offset(obj.s.p, obj.s.n, (size_t)i);
        return tv_str(obj.s.p + off, tv_str_offset(obj.s.p + off, obj.s.n - off, 1));
    }
    if (key.kind == TV_STR)
        return tpl_getattr(r, obj, tpl_strdup(r->a, key.s.p, key.s.n), line);
    return tv_undef(NULL);
}

/* ---- operators ---- */
static int compare(tpl_run *r, tv a, tv b, const char *op, int line)
{
    if (tv_is_num(a) && tv_is_num(b)) {
        double x = tv_num(a), y = tv_num(b);
        if (a.kind != TV_FLOAT && b.kind != TV_FLOAT) {
            int64_t i = a.kind == TV_INT ? a.i : a.b, j = b.kind == TV_INT ? b.i : b.b;
            return (i > j) - (i < j);
        }
        return (x > y) - (x < y);
    }
    if (a.kind == TV_STR && b.kind == TV_STR) {
        size_t n = a.s.n < b.s.n ? a.s.n : b.s.n;
        int c = memcmp(a.s.p, b.s.p, n);
        return c ? (c > 0) - (c < 0) : (a.s.n > b.s.n) - (a.s.n < b.s.n);
    }
    if (a.kind == TV_LIST && b.kind == TV_LIST) {
        for (size_t i = 0; i < a.l->n && i < b.l->n; i++)
            if (!tv_eq(a.l->v[i], b.l->v[i]))
                return compare(r, a.l->v[i], b.l->v[i], op, line);
        return (a.l->n > b.l->n) - (a.l->n < b.l->n);
    }
    TPL_RAISE(r, line, "'%s' not supported between instances of '%s' and '%s'", op, tv_type_name(a),
              tv_type_name(b));
}

static bool contains(tpl_run *r, tv item, tv seq, int line)
{
    if (seq.kind == TV_STR) {
        if (item.kind != TV_STR)
            TPL_RAISE(r, line, "'in <string>' requires string as left operand, not %s",
                      tv_type_name(item));
        if (!item.s.n)
            return true;
        for (size_t i = 0; i + item.s.n <= seq.s.n; i++)
            if (!memcmp(seq.s.p + i, item.s.p, item.s.n))
                return true;
        return false;
    }
    if (seq.kind == TV_DICT)
        return tv_dict_get(seq.d, item) != NULL;
    if (seq.kind == TV_UNDEF)
        return false;
    if (seq.kind != TV_LIST)
        TPL_RAISE(r, line, "argument of type '%s' is not iterable", tv_type_name(seq));
    for (size_t i = 0; i < seq.l->n; i++)
        if (tv_eq(seq.l->v[i], item))
            return true;
    return false;
}

static tv repeat(tpl_run *r, tv seq, int64_t times, int line)
{
    size_t n = seq.kind == TV_STR ? seq.s.n : seq.l->n;
    if (times <= 0 || !n)
        return seq.kind == TV_STR ? tv_str("", 0) : tv_list_value(tv_list_new(r->a, 0));
    if ((uint64_t)times > r->max_out / n + 1)
        TPL_RAISE(r, line, "repetition past the output limit of %zu bytes", r->max_out);
    if (seq.kind == TV_STR) {
        tpl_buf b = {.a = r->a};
        for (int64_t i = 0; i < times; i++)
            tb_put(&b, seq.s.p, seq.s.n);
        return tb_value(&b);
    }
    tv_list *l = tv_list_new(r->a, n * (size_t)times);
    l->tuple = seq.l->tuple;
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < n; k++)
            tv_list_push(r->a, l, seq.l->v[k]);
    return tv_list_value(l);
}

static tv int_arith(tpl_run *r, char op, int64_t x, int64_t y, int line)
{
    int64_t z = 0;
    bool overflow = false;
    switch (op) {
    case '+': overflow = __builtin_add_overflow(x, y, &z); break;
    case '-': overflow = __builtin_sub_overflow(x, y, &z); break;
    case '*': overflow = __builtin_mul_overflow(x, y, &z); break;
    case 'f': /* floor division */
    case '%':
        if (y == 0)
            TPL_RAISE(r, line, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1)
            TPL_RAISE(r, line, "integer overflow");
        z = op == 'f' ? x / y : x % y;
        if (op == 'f' && (x % y != 0) && ((x < 0) != (y < 0)))
            z--;
        if (op == '%' && z != 0 && ((z < 0) != (y < 0)))
            z += y;
        break;
    case 'p':
        if (y < 0)
            return tv_float(pow((double)x, (double)y));
        z = 1;
        for (int64_t i = 0; i < y && !overflow; i++)
            overflow = __builtin_mul_overflow(z, x, &z);
        break;
    }
    if (overflow)
        TPL_RAISE(r, line, "integer overflow (past 64 bits)");
    return tv_int(z);
}

static tv float_arith(tpl_run *r, char op, double x, double y, int line)
{
    switch (op) {
    case '+': return tv_float(x + y);
    case '-': return tv_float(x - y);
    case '*': return tv_float(x * y);
    case '/':
        if (y == 0)
            TPL_RAISE(r, line, "division by zero");
        return tv_float(x / y);
    case 'f':
    case '%': {
        if (y == 0)
            TPL_RAISE(r, line, "float division or modulo by zero");
        double m = fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0)))
            m += y;
        return tv_float(op == '%' ? m : floor((x - m) / y));
    }
    default: return tv_float(pow(x, y));
    }
}

static tv arith(tpl_run *r, const char *op, tv a, tv b, int line)
{
    char c = !strcmp(op, "//") ? 'f' : !strcmp(op, "**") ? 'p' : op[0];
    if (tv_is_num(a) && tv_is_num(b)) {
        if (c != '/' && a.kind != TV_FLOAT && b.kind != TV_FLOAT)
            return int_arith(r, c, a.kind == TV_INT ? a.i : a.b, b.kind == TV_INT ? b.i : b.b,
                             line);
        return float_arith(r, c, tv_num(a), tv_num(b), line);
    }
    if (c == '+' && a.kind == TV_STR && b.kind == TV_STR) {
        bool markup = a.markup || b.markup;
        tpl_buf s = {.a = r->a};
        if (markup && !a.markup)
            tpl_html_escape(&s, a);
        else
            tb_put(&s, a.s.p, a.s.n);
        if (markup && !b.markup)
            tpl_html_escape(&s, b);
        else
            tb_put(&s, b.s.p, b.s.n);
        tv out = tb_value(&s);
        out.markup = markup;
        return out;
    }
    if (c == '+' && a.kind == TV_LIST && b.kind == TV_LIST && !a.l->pyclass && !b.l->pyclass &&
        !a.l->gen && !b.l->gen && a.l->tuple == b.l->tuple) {
        tv_list *l = tv_list_new(r->a, a.l->n + b.l->n);
        l->tuple = a.l->tuple;
        for (size_t i = 0; i < a.l->n; i++)
            tv_list_push(r->a, l, a.l->v[i]);
        for (size_t i = 0; i < b.l->n; i++)
            tv_list_push(r->a, l, b.l->v[i]);
        return tv_list_value(l);
    }
    if (c == '*' && (a.kind == TV_STR || a.kind == TV_LIST) &&
        (b.kind == TV_INT || b.kind == TV_BOOL))
        return repeat(r, a, b.kind == TV_INT ? b.i : b.b, line);
    if (c == '*' && (b.kind == TV_STR || b.kind == TV_LIST) &&
        (a.kind == TV_INT || a.kind == TV_BOOL))
        return repeat(r, b, a.kind == TV_INT ? a.i : a.b, line);
    if (c == '%' && a.kind == TV_STR)
        TPL_RAISE(r, line, "printf-style string formatting ('%%') is not supported");
    if (a.kind == TV_UNDEF || b.kind == TV_UNDEF)
        undefined_access(r, a.kind == TV_UNDEF ? a : b, line);
    TPL_RAISE(r, line, "unsupported operand type(s) for %s: '%s' and '%s'", op, tv_type_name(a),
              tv_type_name(b));
}

void tpl_html_escape(tpl_buf *b, tv s)
{
    for (size_t i = 0; i < s.s.n; i++) {
        char c = s.s.p[i];
        switch (c) {
        case '&': tb_puts(b, "&amp;"); break;
        case '<': tb_puts(b, "&lt;"); break;
        case '>': tb_puts(b, "&gt;"); break;
        case '"': tb_puts(b, "&#34;"); break;
        case '\'': tb_puts(b, "&#39;"); break;
        default: tb_putc(b, c);
        }
    }
}

void tpl_check_printable(tpl_run *r, tv v, int line)
{
    if (v.kind == TV_LIST && v.l->pyclass)
        TPL_RAISE(r, line, "printing a %s is not supported; add |list", v.l->pyclass);
    if (v.kind == TV_LIST && v.l->gen)
        TPL_RAISE(r, line,
                  "a generator (from map, select, selectattr, unique or items) has no "
                  "text; add |list");
}

tv tpl_binop(tpl_run *r, const char *op, tv a, tv b, int line)
{
    if (!strcmp(op, "~")) {
        tpl_check_printable(r, a, line);
        tpl_check_printable(r, b, line);
        tpl_buf s = {.a = r->a};
        tv_print(&s, a);
        tv_print(&s, b);
        return tb_value(&s);
    }
    if (!strcmp(op, "=="))
        return tv_bool(tv_eq(a, b));
    if (!strcmp(op, "!="))
        return tv_bool(!tv_eq(a, b));
    if (!strcmp(op, "in"))
        return tv_bool(contains(r, a, b, line));
    if (!strcmp(op, "not in"))
        return tv_bool(!contains(r, a, b, line));
    if (op[0] == '<' || op[0] == '>') {
        int c = compare(r, a, b, op, line);
        bool eq_ok = op[1] == '=';
        return tv_bool(op[0] == '<' ? (c < 0 || (eq_ok && c == 0)) : (c > 0 || (eq_ok && c == 0)));
    }
    return arith(r, op, a, b, line);
}

/* ---- globals ---- */
static tv make_range(tpl_run *r, const tpl_args *args, int line)
{
    int64_t v[3] = {0, 0, 1};
    if (args->npos < 1 || args->npos > 3 || args->nkw)
        TPL_RAISE(r, line, "range() takes 1 to 3 positional arguments");
    for (size_t i = 0; i < args->npos; i++) {
        tv a = args->pos[i];
        if (a.kind != TV_INT && a.kind != TV_BOOL)
            TPL_RAISE(r, line, "range() arguments must be integers, not %s", tv_type_name(a));
        v[args->npos == 1 ? 1 : i] = a.kind == TV_INT ? a.i : a.b;
    }
    if (v[2] == 0)
        TPL_RAISE(r, line, "range() arg 3 must not be zero");
    tv_list *l = tv_list_new(r->a, 0);
    l->pyclass = "range";
    for (int64_t i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2]) {
        tpl_step(r, line);
        tv_list_push(r->a, l, tv_int(i));
        if (__builtin_add_overflow(i, v[2], &(int64_t){0}))
            break;
    }
    return tv_list_value(l);
}

static tv make_dict(tpl_run *r, const tpl_args *args, int flavor, int line)
{
    tv_dict *d = tv_dict_new(r->a, flavor);
    if (args->npos > 1)
        TPL_RAISE(r, line, "%s() takes at most one positional argument",
                  flavor == TD_NAMESPACE ? "namespace" : "dict");
    if (args->npos == 1) {
        tv init = args->pos[0];
        if (init.kind != TV_DICT)
            TPL_RAISE(r, line, "%s() takes a mapping",
                      flavor == TD_NAMESPACE ? "namespace" : "dict");
        for (size_t i = 0; i < init.d->n; i++)
            tv_dict_set(r->a, d, init.d->keys[i], init.d->vals[i]);
    }
    for (size_t i = 0; i < args->nkw; i++)
        tv_dict_set(r->a, d, tv_str(args->kwn[i], strlen(args->kwn[i])), args->kwv[i]);
    return tv_dict_value(d);
}

static tv strftime_now(tpl_run *r, const tpl_args *args, int line)
{
    if (args->npos != 1 || args->pos[0].kind != TV_STR || args->nkw)
        TPL_RAISE(r, line, "strftime_now() takes one format string");
    char fmt[256], out[512];
    if (args->pos[0].s.n >= sizeof fmt)
        TPL_RAISE(r, line, "strftime_now(): format longer than %zu bytes", sizeof fmt - 1);
    memcpy(fmt, args->pos[0].s.p, args->pos[0].s.n);
    fmt[args->pos[0].s.n] = 0;
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    size_t n = strftime(out, sizeof out, fmt, &tm);
    return tv_str(tpl_strdup(r->a, out, n), n);
}

tv tpl_call_builtin(tpl_run *r, int fn, const tpl_args *args, int line)
{
    tpl_step(r, line);
    switch (fn) {
    case TF_RANGE: return make_range(r, args, line);
    case TF_NAMESPACE: return make_dict(r, args, TD_NAMESPACE, line);
    case TF_DICT: return make_dict(r, args, TD_DICT, line);
    case TF_RAISE: {
        tpl_buf b = {.a = r->a};
        if (args->npos)
            tv_print(&b, args->pos[0]);
        /* the template's own message, without a line: the client reads it */
        tpl_raise(r->fail, QL_EINVAL, 0, "%s", b.p ? b.p : "");
    }
    default: return strftime_now(r, args, line);
    }
}

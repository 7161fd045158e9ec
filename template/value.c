/*
 * value.c - the renderer's arena and values: lists, insertion-ordered
 * dicts, truth, equality, and the three ways a value becomes text as
 * Python does it: str() (what {{ v }} prints: None, True, 1.0, 1e-05,
 * ['a', 1]), repr(), and json.dumps as transformers' tojson calls it
 * (ensure_ascii=False, separators (", ", ": ") or with an indent (",",
 * ": ")). Also the mapping of a cJSON context onto values.
 *
 * It owns the arena chunks it hands out (freed by tpl_arena_free) and
 * touches nothing else.
 */
#include "internal/template_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Noreturn void tpl_raise(tpl_fail *f, int err, int line, const char *fmt, ...)
{
    /* straight into the caller's buffer, so a template's own long message
     * (raise_exception) is cut only by msg_len */
    if (f->msg && f->msg_len) {
        int k = line > 0 ? snprintf(f->msg, f->msg_len, "line %d: ", line) : 0;
        if (k < 0 || (size_t)k >= f->msg_len)
            k = 0;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(f->msg + k, f->msg_len - (size_t)k, fmt, ap);
        va_end(ap);
    }
    longjmp(f->jump, err);
}

/* ---- arena ---- */
struct tpl_chunk {
    tpl_chunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
};
#define TPL_CHUNK_BYTES (64u << 10)

void *tpl_alloc(tpl_arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (a->limit && a->used + n > a->limit)
        tpl_raise(a->fail, QL_EINVAL, 0, "the template used more than %zu bytes of memory",
                  a->limit);
    tpl_chunk *c = a->head;
    if (!c || c->size - c->used < n) {
        size_t size = n > TPL_CHUNK_BYTES ? n : TPL_CHUNK_BYTES;
        c = malloc(sizeof *c + size);
        if (!c)
            tpl_raise(a->fail, QL_ENOMEM, 0, "out of memory rendering the template");
        c->size = size;
        c->used = 0;
        /* a big block goes behind the current chunk so its space stays in use */
        if (a->head && n > TPL_CHUNK_BYTES) {
            c->next = a->head->next;
            a->head->next = c;
        } else {
            c->next = a->head;
            a->head = c;
        }
    }
    void *p = c->data + c->used;
    c->used += n;
    a->used += n;
    memset(p, 0, n);
    return p;
}

void tpl_arena_free(tpl_arena *a)
{
    for (tpl_chunk *c = a->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    a->head = NULL;
    a->used = 0;
}

char *tpl_strdup(tpl_arena *a, const char *s, size_t n)
{
    char *p = tpl_alloc(a, n + 1);
    if (n)
        memcpy(p, s, n);
    return p;
}

/* ---- byte strings ---- */
void tb_put(tpl_buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = tpl_alloc(b->a, cap);
        if (b->n)
            memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
void tb_puts(tpl_buf *b, const char *s)
{
    tb_put(b, s, strlen(s));
}
void tb_putc(tpl_buf *b, char c)
{
    tb_put(b, &c, 1);
}
tv tb_value(tpl_buf *b)
{
    return tv_str(b->p ? b->p : "", b->n);
}

/* ---- lists and dicts ---- */
tv_list *tv_list_new(tpl_arena *a, size_t cap)
{
    tv_list *l = tpl_alloc(a, sizeof *l);
    l->cap = cap ? cap : 4;
    l->v = tpl_alloc(a, l->cap * sizeof(tv));
    return l;
}

static unsigned value_depth(tv v)
{
    if (v.kind == TV_LIST)
        return v.l->depth;
    return v.kind == TV_DICT && v.d->flavor == TD_DICT ? v.d->depth : 0;
}

static void deepen(tpl_arena *a, unsigned *depth, tv v)
{
    unsigned d = value_depth(v) + 1;
    if (d > TPL_MAX_VALUE_DEPTH)
        tpl_raise(a->fail, QL_EINVAL, 0, "values nested deeper than %d", TPL_MAX_VALUE_DEPTH);
    if (d > *depth)
        *depth = d;
}

void tv_list_push(tpl_arena *a, tv_list *l, tv v)
{
    deepen(a, &l->depth, v);
    if (l->n == l->cap) {
        tv *nv = tpl_alloc(a, 2 * l->cap * sizeof(tv));
        memcpy(nv, l->v, l->n * sizeof(tv));
        l->v = nv;
        l->cap *= 2;
    }
    l->v[l->n++] = v;
}

tv_dict *tv_dict_new(tpl_arena *a, int flavor)
{
    tv_dict *d = tpl_alloc(a, sizeof *d);
    d->flavor = flavor;
    return d;
}

tv *tv_dict_get(const tv_dict *d, tv key)
{
    for (size_t i = 0; i < d->n; i++)
        if (tv_eq(d->keys[i], key))
            return &d->vals[i];
    return NULL;
}

tv *tv_dict_gets(const tv_dict *d, const char *key, size_t n)
{
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i].kind == TV_STR && d->keys[i].s.n == n && !memcmp(d->keys[i].s.p, key, n))
            return &d->vals[i];
    return NULL;
}

void tv_dict_set(tpl_arena *a, tv_dict *d, tv key, tv val)
{
    if (d->flavor == TD_DICT)
        deepen(a, &d->depth, val);
    tv *old = tv_dict_get(d, key);
    if (old) {
        *old = val;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        tv *k = tpl_alloc(a, cap * sizeof(tv)), *v = tpl_alloc(a, cap * sizeof(tv));
        if (d->n) {
            memcpy(k, d->keys, d->n * sizeof(tv));
            memcpy(v, d->vals, d->n * sizeof(tv));
        }
        d->keys = k;
        d->vals = v;
        d->cap = cap;
    }
    d->keys[d->n] = key;
    d->vals[d->n++] = val;
}

tv tv_list_value(tv_list *l)
{
    return (tv){.kind = TV_LIST, .l = l};
}
tv tv_dict_value(tv_dict *d)
{
    return (tv){.kind = TV_DICT, .d = d};
}

/* ---- truth and equality ---- */
bool tv_truthy(tv v)
{
    switch (v.kind) {
    case TV_MISSING:
    case TV_UNDEF:
    case TV_NONE: return false;
    case TV_BOOL: return v.b;
    case TV_INT: return v.i != 0;
    case TV_FLOAT: return v.f != 0;
    case TV_STR: return v.s.n != 0;
    case TV_LIST: return v.l->gen || v.l->n != 0;
    case TV_DICT: return v.d->flavor != TD_DICT || v.d->n != 0;
    default: return true;
    }
}

bool tv_is_num(tv v)
{
    return v.kind == TV_INT || v.kind == TV_FLOAT || v.kind == TV_BOOL;
}
double tv_num(tv v)
{
    return v.kind == TV_FLOAT ? v.f : v.kind == TV_INT ? (double)v.i : (double)v.b;
}

bool tv_eq(tv a, tv b)
{
    if (tv_is_num(a) && tv_is_num(b)) {
        if (a.kind != TV_FLOAT && b.kind != TV_FLOAT)
            return (a.kind == TV_INT ? a.i : a.b) == (b.kind == TV_INT ? b.i : b.b);
        return tv_num(a) == tv_num(b);
    }
    if (a.kind != b.kind)
        return false;
    switch (a.kind) {
    case TV_UNDEF:
    case TV_NONE: return true;
    case TV_STR: return a.s.n == b.s.n && !memcmp(a.s.p, b.s.p, a.s.n);
    case TV_LIST:
        if (a.l->n != b.l->n || a.l->tuple != b.l->tuple)
            return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!tv_eq(a.l->v[i], b.l->v[i]))
                return false;
        return true;
    case TV_DICT:
        if (a.d->flavor != TD_DICT || b.d->flavor != TD_DICT)
            return a.d == b.d;
        if (a.d->n != b.d->n)
            return false;
        for (size_t i = 0; i < a.d->n; i++) {
            tv *o = tv_dict_get(b.d, a.d->keys[i]);
            if (!o || !tv_eq(a.d->vals[i], *o))
                return false;
        }
        return true;
    case TV_MACRO: return a.macro == b.macro;
    case TV_FUNC: return a.fn == b.fn;
    default: return false;
    }
}

const char *tv_type_name(tv v)
{
    static const char *const names[] = {
        [TV_MISSING] = "missing", [TV_UNDEF] = "undefined", [TV_NONE] = "NoneType",
        [TV_BOOL] = "bool",       [TV_INT] = "int",         [TV_FLOAT] = "float",
        [TV_STR] = "str",         [TV_LIST] = "list",       [TV_DICT] = "dict",
        [TV_MACRO] = "macro",     [TV_METHOD] = "method",   [TV_FUNC] = "function",
    };
    if (v.kind == TV_LIST && v.l->tuple)
        return "tuple";
    if (v.kind == TV_DICT && v.d->flavor == TD_NAMESPACE)
        return "Namespace";
    if (v.kind == TV_DICT && v.d->flavor == TD_LOOP)
        return "LoopContext";
    return names[v.kind];
}

/* ---- text ---- */

/* Python's repr(float): the shortest digits that read back exactly,
 * positional when the exponent is in [-4, 16), else d.ddde+XX. */
void tv_float_repr(char out[40], double f)
{
    if (isnan(f)) {
        strcpy(out, "nan");
        return;
    }
    if (isinf(f)) {
        strcpy(out, f < 0 ? "-inf" : "inf");
        return;
    }
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, f);
        if (strtod(e, NULL) == f)
            break;
    }
    /* e is [-]d[.ddd]e[+-]XX */
    bool neg = e[0] == '-';
    char digits[24];
    size_t nd = 0;
    const char *p = e + neg;
    for (; *p && *p != 'e'; p++)
        if (*p != '.')
            digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    char *o = out;
    if (neg)
        *o++ = '-';
    if (exp < -4 || exp >= 16) {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            memcpy(o, digits + 1, nd - 1);
            o += nd - 1;
        }
        snprintf(o, 16, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
        return;
    }
    if (exp < 0) {
        *o++ = '0';
        *o++ = '.';
        for (int i = -1; i > exp; i--)
            *o++ = '0';
        memcpy(o, digits, nd);
        o += nd;
    } else {
        for (int i = 0; i <= exp; i++)
            *o++ = (size_t)i < nd ? digits[i] : '0';
        *o++ = '.';
        if ((size_t)exp + 1 < nd) {
            memcpy(o, digits + exp + 1, nd - (size_t)exp - 1);
            o += nd - (size_t)exp - 1;
        } else {
            *o++ = '0';
        }
    }
    *o = 0;
}

/* Python's str.isprintable for the characters chat text carries: the C0
 * and C1 controls, the separators other than space (Zs, Zl, Zp), the
 * format characters (Cf: zero-width, bidi, BOM) and private use are not.
 * Unassigned code points (Cn) would need Unicode's tables and print as is. */
static bool printable_cp(uint32_t cp)
{
    if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad || cp == 0x1680 ||
        (cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
        (cp >= 0x205f && cp <= 0x2064) || (cp >= 0x2066 && cp <= 0x206f) || cp == 0x3000 ||
        (cp >= 0xe000 && cp <= 0xf8ff) || cp == 0xfeff || (cp >= 0xfff9 && cp <= 0xfffb) ||
        cp >= 0xf0000 || cp == 0x061c || cp == 0x180e)
        return false;
    return true;
}

static void repr_str(tpl_buf *b, const char *s, size_t n)
{
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    tb_putc(b, q);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[16];
        if (c == '\\' || c == (unsigned char)q) {
            tb_putc(b, '\\');
            tb_putc(b, (char)c);
        } else if (c == '\n') {
            tb_puts(b, "\\n");
        } else if (c == '\r') {
            tb_puts(b, "\\r");
        } else if (c == '\t') {
            tb_puts(b, "\\t");
        } else if (c < 0x20 || c == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", c);
            tb_puts(b, esc);
        } else if (c >= 0x80) {
            uint32_t cp;
            size_t k = ql_utf8_next((const uint8_t *)s + i, n - i, &cp);
            if (!k || printable_cp(cp)) {
                tb_put(b, s + i, k ? k : 1);
            } else {
                snprintf(esc, sizeof esc,
                         cp < 0x100     ? "\\x%02x"
                         : cp < 0x10000 ? "\\u%04x"
                                        : "\\U%08x",
                         cp);
                tb_puts(b, esc);
            }
            i += k ? k - 1 : 0;
        } else {
            tb_putc(b, (char)c);
        }
    }
    tb_putc(b, q);
}

static void print_scalar(tpl_buf *b, tv v)
{
    char num[40];
    switch (v.kind) {
    case TV_NONE: tb_puts(b, "None"); break;
    case TV_BOOL: tb_puts(b, v.b ? "True" : "False"); break;
    case TV_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.i);
        tb_puts(b, num);
        break;
    case TV_FLOAT:
        tv_float_repr(num, v.f);
        tb_puts(b, num);
        break;
    case TV_MACRO:
        tb_puts(b, "<Macro '");
        tb_puts(b, v.macro->def->name);
        tb_puts(b, "'>");
        break;
    case TV_METHOD:
        tb_puts(b, "<built-in method ");
        tb_puts(b, v.m->name);
        tb_puts(b, ">");
        break;
    case TV_FUNC: tb_puts(b, "<built-in function>"); break;
    default: break;
    }
}

static void repr(tpl_buf *b, tv v, int depth)
{
    /* lists and dicts are bounded by TPL_MAX_VALUE_DEPTH; a namespace may
     * hold itself */
    if (depth > TPL_MAX_VALUE_DEPTH)
        tpl_raise(b->a->fail, QL_EINVAL, 0,
                  "printing a value nested deeper than %d (a namespace holding itself?)",
                  TPL_MAX_VALUE_DEPTH);
    switch (v.kind) {
    case TV_STR: repr_str(b, v.s.p, v.s.n); return;
    case TV_UNDEF: tb_puts(b, "Undefined"); return; /* jinja2's Undefined.__repr__ */
    case TV_LIST:
        tb_putc(b, v.l->tuple ? '(' : '[');
        for (size_t i = 0; i < v.l->n; i++) {
            if (i)
                tb_puts(b, ", ");
            repr(b, v.l->v[i], depth + 1);
        }
        if (v.l->tuple && v.l->n == 1)
            tb_putc(b, ',');
        tb_putc(b, v.l->tuple ? ')' : ']');
        return;
    case TV_DICT:
        if (v.d->flavor == TD_NAMESPACE)
            tb_puts(b, "<Namespace ");
        tb_putc(b, '{');
        for (size_t i = 0; i < v.d->n; i++) {
            if (i)
                tb_puts(b, ", ");
            repr(b, v.d->keys[i], depth + 1);
            tb_puts(b, ": ");
            repr(b, v.d->vals[i], depth + 1);
        }
        tb_putc(b, '}');
        if (v.d->flavor == TD_NAMESPACE)
            tb_putc(b, '>');
        return;
    default: print_scalar(b, v);
    }
}

void tv_repr(tpl_buf *b, tv v)
{
    repr(b, v, 0);
}

void tv_print(tpl_buf *b, tv v)
{
    if (v.kind == TV_STR)
        tb_put(b, v.s.p, v.s.n);
    else if (v.kind != TV_UNDEF && v.kind != TV_MISSING)
        tv_repr(b, v);
}

tv tv_to_str(tpl_arena *a, tv v)
{
    if (v.kind == TV_STR)
        return v;
    tpl_buf b = {.a = a};
    tv_print(&b, v);
    return tb_value(&b);
}

static void json_escape_cp(tpl_buf *b, uint32_t cp)
{
    char esc[16];
    if (cp >= 0x10000) {
        cp -= 0x10000;
        snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
    } else {
        snprintf(esc, sizeof esc, "\\u%04x", cp);
    }
    tb_puts(b, esc);
}

static void json_str(tpl_buf *b, const char *s, size_t n, bool ascii)
{
    tb_putc(b, '"');
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\' && (c < 0x80 || !ascii))
            continue;
        tb_put(b, s + run, i - run);
        run = i + 1;
        switch (c) {
        case '"': tb_puts(b, "\\\""); break;
        case '\\': tb_puts(b, "\\\\"); break;
        case '\n': tb_puts(b, "\\n"); break;
        case '\r': tb_puts(b, "\\r"); break;
        case '\t': tb_puts(b, "\\t"); break;
        case '\b': tb_puts(b, "\\b"); break;
        case '\f': tb_puts(b, "\\f"); break;
        default:
            if (c >= 0x80) {
                uint32_t cp = 0xFFFD;
                size_t k = ql_utf8_next((const uint8_t *)s + i, n - i, &cp);
                i += k ? k - 1 : 0;
                run = i + 1;
                json_escape_cp(b, cp);
            } else {
                json_escape_cp(b, c);
            }
        }
    }
    tb_put(b, s + run, n - run);
    tb_putc(b, '"');
}

static void json_newline(tpl_buf *b, int indent, int depth)
{
    tb_putc(b, '\n');
    for (int i = 0; i < indent * depth; i++)
        tb_putc(b, ' ');
}

static void json_key(tpl_buf *b, tv k, bool ascii, tpl_fail *f, int line)
{
    char num[48];
    switch (k.kind) {
    case TV_STR: json_str(b, k.s.p, k.s.n, ascii); return;
    case TV_INT: snprintf(num, sizeof num, "\"%lld\"", (long long)k.i); break;
    case TV_FLOAT: {
        char fl[40];
        tv_float_repr(fl, k.f);
        snprintf(num, sizeof num, "\"%s\"", fl);
        break;
    }
    case TV_BOOL: strcpy(num, k.b ? "\"true\"" : "\"false\""); break;
    case TV_NONE: strcpy(num, "\"null\""); break;
    default: tpl_raise(f, QL_EINVAL, line, "tojson: keys must be str, int, float, bool or None");
    }
    tb_puts(b, num);
}

/* the order json.dumps writes a dict's items in: as inserted, or with
 * sort_keys by key (all keys strings, else Python raises) */
static size_t *json_order(tpl_buf *b, const tv_dict *d, bool sort, tpl_fail *f, int line)
{
    size_t *ord = tpl_alloc(b->a, d->n * sizeof *ord);
    for (size_t i = 0; i < d->n; i++) {
        ord[i] = i;
        if (sort && d->keys[i].kind != TV_STR)
            tpl_raise(f, QL_EINVAL, line, "tojson: sort_keys needs string keys");
    }
    for (size_t i = 1; sort && i < d->n; i++) { /* insertion sort: stable, keys are few */
        size_t j = i, x = ord[i];
        for (; j > 0; j--) {
            tv p = d->keys[ord[j - 1]], q = d->keys[x];
            size_t m = p.s.n < q.s.n ? p.s.n : q.s.n;
            int c = memcmp(p.s.p, q.s.p, m);
            if (c < 0 || (c == 0 && p.s.n <= q.s.n))
                break;
            ord[j] = ord[j - 1];
        }
        ord[j] = x;
    }
    return ord;
}

static void json_container(tpl_buf *b, tv v, const tv_json_opts *o, int depth, tpl_fail *f,
                           int line)
{
    bool is_list = v.kind == TV_LIST;
    size_t n = is_list ? v.l->n : v.d->n;
    if (!n) {
        tb_puts(b, is_list ? "[]" : "{}");
        return;
    }
    size_t *ord = is_list ? NULL : json_order(b, v.d, o->sort_keys, f, line);
    tb_putc(b, is_list ? '[' : '{');
    for (size_t i = 0; i < n; i++) {
        if (i)
            tb_puts(b, o->item_sep);
        if (o->indent >= 0)
            json_newline(b, o->indent, depth + 1);
        if (!is_list) {
            json_key(b, v.d->keys[ord[i]], o->ensure_ascii, f, line);
            tb_puts(b, o->key_sep);
        }
        tv_tojson_opts(b, is_list ? v.l->v[i] : v.d->vals[ord[i]], o, depth + 1, f, line);
    }
    if (o->indent >= 0)
        json_newline(b, o->indent, depth);
    tb_putc(b, is_list ? ']' : '}');
}

void tv_tojson_opts(tpl_buf *b, tv v, const tv_json_opts *o, int depth, tpl_fail *f, int line)
{
    if (depth > TPL_MAX_VALUE_DEPTH)
        tpl_raise(f, QL_EINVAL, line, "tojson: nesting deeper than %d", TPL_MAX_VALUE_DEPTH);
    char num[40];
    switch (v.kind) {
    case TV_NONE: tb_puts(b, "null"); return;
    case TV_BOOL: tb_puts(b, v.b ? "true" : "false"); return;
    case TV_INT: print_scalar(b, v); return;
    case TV_FLOAT:
        if (isnan(v.f) || isinf(v.f))
            tb_puts(b, isnan(v.f) ? "NaN" : v.f < 0 ? "-Infinity" : "Infinity");
        else {
            tv_float_repr(num, v.f);
            tb_puts(b, num);
        }
        return;
    case TV_STR: json_str(b, v.s.p, v.s.n, o->ensure_ascii); return;
    case TV_LIST:
        if (v.l->gen || v.l->pyclass)
            break;
        json_container(b, v, o, depth, f, line);
        return;
    case TV_DICT:
        if (v.d->flavor != TD_DICT)
            break;
        json_container(b, v, o, depth, f, line);
        return;
    default: break;
    }
    tpl_raise(f, QL_EINVAL, line, "tojson: Object of type %s is not JSON serializable",
              v.kind != TV_LIST ? tv_type_name(v)
              : v.l->gen        ? "generator"
                                : v.l->pyclass);
}

/* JSON numbers: cJSON keeps no source text, so an integral number within
 * 2^53 is an int (json.loads("1.0") would be a float; see template.h). */
tv tv_from_json(tpl_arena *a, const cJSON *j)
{
    if (cJSON_IsNull(j) || !j)
        return tv_none();
    if (cJSON_IsBool(j))
        return tv_bool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) <= 9007199254740992.0)
            return tv_int((int64_t)d);
        return tv_float(d);
    }
    if (cJSON_IsString(j))
        return tv_str(j->valuestring, strlen(j->valuestring));
    if (cJSON_IsArray(j)) {
        tv_list *l = tv_list_new(a, (size_t)cJSON_GetArraySize(j));
        for (const cJSON *c = j->child; c; c = c->next)
            tv_list_push(a, l, tv_from_json(a, c));
        return tv_list_value(l);
    }
    tv_dict *d = tv_dict_new(a, TD_DICT);
    for (const cJSON *c = j->child; c; c = c->next)
        tv_dict_set(a, d, tv_str(c->string, strlen(c->string)), tv_from_json(a, c));
    return tv_dict_value(d);
}

size_t tv_str_len(const char *p, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += ((unsigned char)p[i] & 0xC0) != 0x80;
    return count;
}

size_t tv_str_offset(const char *p, size_t n, size_t i)
{
    size_t off = 0;
    while (off < n && i) {
        off++;
        while (off < n && ((unsigned char)p[off] & 0xC0) == 0x80)
            off++;
        i--;
    }
    return off;
}

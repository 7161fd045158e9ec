/*
 * eval.c - the tree-walking evaluator: expressions to values and
 * statements to output, with jinja2's scoping (a for loop's body is a new
 * scope each iteration, so a set inside it is gone after it, which is why
 * templates use namespace(); if does not scope; a macro runs in a scope
 * under the one it was defined in, seeing that scope as it is at the
 * call), the loop object, break/continue, and the render's bounds (steps,
 * depth, output size).
 *
 * It owns nothing: values live in the render's arena, output in r->out.
 */
#include "internal/template_internal.h"

#include <stdio.h>
#include <string.h>

enum { SIG_NONE, SIG_BREAK, SIG_CONTINUE };

static tv lookup(tpl_scope *s, const char *name)
{
    size_t n = strlen(name);
    for (; s; s = s->parent) {
        tv *v = tv_dict_gets(s->vars, name, n);
        if (v)
            return *v;
    }
    return tv_undef(name);
}

static void assign(tpl_run *r, tpl_scope *s, const char *name, tv v)
{
    tv_dict_set(r->a, s->vars, tv_str(name, strlen(name)), v);
}

static tpl_scope *new_scope(tpl_run *r, tpl_scope *parent)
{
    tpl_scope *s = tpl_alloc(r->a, sizeof *s);
    s->vars = tv_dict_new(r->a, TD_DICT);
    s->parent = parent;
    return s;
}

/* the positional and keyword arguments of a call, filter or test node */
static tpl_args eval_args(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tpl_args args = {.npos = n->args.n, .nkw = n->kwvals.n, .kwn = n->kwnames};
    tv *pos = tpl_alloc(r->a, (n->args.n + n->kwvals.n + 1) * sizeof(tv));
    for (size_t i = 0; i < n->args.n; i++)
        pos[i] = tpl_eval(r, s, n->args.v[i]);
    for (size_t i = 0; i < n->kwvals.n; i++)
        pos[n->args.n + i] = tpl_eval(r, s, n->kwvals.v[i]);
    args.pos = pos;
    args.kwv = pos + n->args.n;
    return args;
}

static tv call_macro(tpl_run *r, struct tv_macro *m, const tpl_args *args, int line)
{
    const tpl_node *def = m->def;
    if (++r->depth > TPL_MAX_DEPTH)
        TPL_RAISE(r, line, "macro calls nested deeper than %d", TPL_MAX_DEPTH);
    tpl_step(r, line);
    const char **params = tpl_alloc(r->a, (def->names.n + 1) * sizeof *params);
    for (size_t i = 0; i < def->names.n; i++)
        params[i] = def->names.v[i]->name;
    tv *vals = tpl_alloc(r->a, (def->names.n + 1) * sizeof(tv));
    char what[80];
    snprintf(what, sizeof what, "macro '%s'", def->name);
    tpl_bind(r, what, params, args, vals, line);
    tpl_scope *s = new_scope(r, m->closure);
    for (size_t i = 0; i < def->names.n; i++) {
        tv v = vals[i];
        if (v.kind == TV_MISSING)
            v = def->kwvals.v[i] ? tpl_eval(r, s, def->kwvals.v[i]) : tv_undef(params[i]);
        assign(r, s, params[i], v);
    }
    size_t start = r->out.n;
    int sig = SIG_NONE;
    tpl_exec_body(r, s, &def->body, &sig);
    tv result = tv_str(tpl_strdup(r->a, r->out.p + start, r->out.n - start), r->out.n - start);
    r->out.n = start;
    r->depth--;
    return result;
}

tv tpl_call_value(tpl_run *r, tpl_scope *s, tv fn, const tv *pos, size_t npos, const char **kwn,
                  const tv *kwv, size_t nkw, int line)
{
    (void)s;
    tpl_args args = {.pos = pos, .npos = npos, .kwn = kwn, .kwv = kwv, .nkw = nkw};
    switch (fn.kind) {
    case TV_MACRO: return call_macro(r, fn.macro, &args, line);
    case TV_METHOD: return tpl_call_method(r, fn.m->self, fn.m->name, &args, line);
    case TV_FUNC: return tpl_call_builtin(r, fn.fn, &args, line);
    case TV_UNDEF: TPL_RAISE(r, line, "'%s' is undefined", fn.s.p ? fn.s.p : "value");
    default: TPL_RAISE(r, line, "'%s' object is not callable", tv_type_name(fn));
    }
}

static tv eval_call(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tpl_args args;
    if (n->a->kind == N_ATTR) {
        /* obj.method(...): no bound-method value needed */
        tv self = tpl_eval(r, s, n->a->a);
        if (self.kind == TV_LIST || self.kind == TV_DICT)
            tpl_getattr(r, self, n->a->name, n->line); /* raises for an unsafe method */
        if (self.kind == TV_STR || self.kind == TV_LIST ||
            (self.kind == TV_DICT && self.d->flavor != TD_NAMESPACE)) {
            args = eval_args(r, s, n);
            return tpl_call_method(r, self, n->a->name, &args, n->line);
        }
        tv fn = tpl_getattr(r, self, n->a->name, n->line);
        args = eval_args(r, s, n);
        return tpl_call_value(r, s, fn, args.pos, args.npos, args.kwn, args.kwv, args.nkw, n->line);
    }
    tv fn = tpl_eval(r, s, n->a);
    args = eval_args(r, s, n);
    return tpl_call_value(r, s, fn, args.pos, args.npos, args.kwn, args.kwv, args.nkw, n->line);
}

/* Python's slice semantics over n elements */
static void slice_bounds(tpl_run *r, tv a, tv b, tv c, int64_t n, int64_t *start, int64_t *stop,
                         int64_t *step, int line)
{
    *step = c.kind == TV_NONE || c.kind == TV_MISSING ? 1 : c.i;
    if ((c.kind != TV_NONE && c.kind != TV_MISSING && c.kind != TV_INT) || *step == 0)
        TPL_RAISE(r, line, "slice step must be a non-zero integer");
    int64_t lo = *step < 0 ? -1 : 0, hi = *step < 0 ? n - 1 : n;
    tv bound[2] = {a, b};
    int64_t *out[2] = {start, stop};
    for (int k = 0; k < 2; k++) {
        tv v = bound[k];
        if (v.kind == TV_NONE || v.kind == TV_MISSING) {
            *out[k] = (k == 0) == (*step > 0) ? lo : hi;
            continue;
        }
        if (v.kind != TV_INT && v.kind != TV_BOOL)
            TPL_RAISE(r, line, "slice indices must be integers or None");
        int64_t i = v.kind == TV_INT ? v.i : v.b;
        if (i < 0)
            i = i + n < lo ? lo : i + n;
        else if (i > hi)
            i = hi;
        *out[k] = i;
    }
}

static tv eval_slice(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tv obj = tpl_eval(r, s, n->a);
    tv part[3] = {{0}};
    const tpl_node *pn[3] = {n->b, n->c, n->d};
    for (int i = 0; i < 3; i++)
        part[i] = pn[i] ? tpl_eval(r, s, pn[i]) : tv_none();
    bool is_str = obj.kind == TV_STR;
    if (obj.kind == TV_UNDEF)
        TPL_RAISE(r, n->line, "'%s' is undefined", obj.s.p ? obj.s.p : "value");
    if (!is_str && (obj.kind != TV_LIST || obj.l->gen))
        TPL_RAISE(r, n->line, "'%s' object is not subscriptable",
                  obj.kind == TV_LIST ? "generator" : tv_type_name(obj));
    int64_t len = is_str ? (int64_t)tv_str_len(obj.s.p, obj.s.n) : (int64_t)obj.l->n;
    int64_t start, stop, step;
    slice_bounds(r, part[0], part[1], part[2], len, &start, &stop, &step, n->line);
    tpl_buf b = {.a = r->a};
    if (!is_str && obj.l->pyclass && strcmp(obj.l->pyclass, "range"))
        TPL_RAISE(r, n->line, "'%s' object is not subscriptable", obj.l->pyclass);
    tv_list *l = tv_list_new(r->a, 0);
    l->tuple = !is_str && obj.l->tuple;
    l->pyclass = is_str ? NULL : obj.l->pyclass; /* a range's slice is a range */
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (is_str) {
            size_t off = tv_str_offset(obj.s.p, obj.s.n, (size_t)i);
            size_t end = tv_str_offset(obj.s.p, obj.s.n, (size_t)i + 1);
            tb_put(&b, obj.s.p + off, end - off);
        } else {
            tv_list_push(r->a, l, obj.l->v[i]);
        }
    }
    return is_str ? tb_value(&b) : tv_list_value(l);
}

static tv eval_filter(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tv v = n->a ? tpl_eval(r, s, n->a) : r->block_text;
    tpl_args args = eval_args(r, s, n);
    return tpl_find_filter(n->name)(r, s, v, &args, n->line);
}

static tv eval_test(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tv v = tpl_eval(r, s, n->a);
    tpl_args args = eval_args(r, s, n);
    bool yes = tpl_find_test(n->name)(r, v, &args, n->line);
    return tv_bool(yes != n->neg);
}

static tv eval_collection(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    if (n->kind == N_DICT) {
        tv_dict *d = tv_dict_new(r->a, TD_DICT);
        for (size_t i = 0; i < n->args.n; i++)
            tv_dict_set(r->a, d, tpl_eval(r, s, n->args.v[i]), tpl_eval(r, s, n->kwvals.v[i]));
        return tv_dict_value(d);
    }
    tv_list *l = tv_list_new(r->a, n->args.n);
    l->tuple = n->kind == N_TUPLE;
    for (size_t i = 0; i < n->args.n; i++)
        tv_list_push(r->a, l, tpl_eval(r, s, n->args.v[i]));
    return tv_list_value(l);
}

static tv eval(tpl_run *r, tpl_scope *s, const tpl_node *n);

tv tpl_eval(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    if (++r->eval_depth > TPL_MAX_EVAL_DEPTH)
        TPL_RAISE(r, n->line, "evaluation nested deeper than %d", TPL_MAX_EVAL_DEPTH);
    tv v = eval(r, s, n);
    r->eval_depth--;
    return v;
}

static tv eval(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tv a;
    switch (n->kind) {
    case N_LIT: return n->lit;
    case N_NAME: return lookup(s, n->name);
    case N_LIST:
    case N_TUPLE:
    case N_DICT: return eval_collection(r, s, n);
    case N_ATTR: return tpl_getattr(r, tpl_eval(r, s, n->a), n->name, n->line);
    case N_INDEX: a = tpl_eval(r, s, n->a); return tpl_getitem(r, a, tpl_eval(r, s, n->b), n->line);
    case N_SLICE: return eval_slice(r, s, n);
    case N_CALL: return eval_call(r, s, n);
    case N_FILTER: return eval_filter(r, s, n);
    case N_TEST: return eval_test(r, s, n);
    case N_NEG:
    case N_POS:
        a = tpl_eval(r, s, n->a);
        if (a.kind == TV_BOOL)
            a = tv_int(a.b);
        if (a.kind == TV_INT && n->kind == N_NEG && a.i == INT64_MIN)
            TPL_RAISE(r, n->line, "integer overflow");
        if (a.kind == TV_INT)
            return tv_int(n->kind == N_NEG ? -a.i : a.i);
        if (a.kind == TV_FLOAT)
            return tv_float(n->kind == N_NEG ? -a.f : a.f);
        TPL_RAISE(r, n->line, "bad operand type for unary %s: '%s'", n->kind == N_NEG ? "-" : "+",
                  tv_type_name(a));
    case N_NOT: return tv_bool(!tv_truthy(tpl_eval(r, s, n->a)));
    case N_AND: a = tpl_eval(r, s, n->a); return tv_truthy(a) ? tpl_eval(r, s, n->b) : a;
    case N_OR: a = tpl_eval(r, s, n->a); return tv_truthy(a) ? a : tpl_eval(r, s, n->b);
    case N_BINOP:
    case N_COMPARE:
        a = tpl_eval(r, s, n->a);
        return tpl_binop(r, n->op, a, tpl_eval(r, s, n->b), n->line);
    case N_COND:
        if (tv_truthy(tpl_eval(r, s, n->b)))
            return tpl_eval(r, s, n->a);
        return n->c ? tpl_eval(r, s, n->c) : tv_undef("the else of an inline if");
    default: TPL_RAISE(r, n->line, "a statement where an expression belongs");
    }
}

/* ---- statements ---- */
static void emit(tpl_run *r, const char *p, size_t n, int line)
{
    if (r->out.n + n > r->max_out)
        TPL_RAISE(r, line, "the output grew past %zu bytes", r->max_out);
    tb_put(&r->out, p, n);
}

static void emit_value(tpl_run *r, tv v, int line)
{
    tpl_check_printable(r, v, line);
    if (v.kind == TV_STR) {
        emit(r, v.s.p, v.s.n, line);
        return;
    }
    tpl_buf b = {.a = r->a};
    tv_print(&b, v);
    emit(r, b.p, b.n, line);
}

static void bind_targets(tpl_run *r, tpl_scope *s, const tpl_nodes *names, tv v, int line)
{
    if (names->n == 1) {
        assign(r, s, names->v[0]->name, v);
        return;
    }
    tv_list *parts = tpl_iterable(r, v, line);
    if (parts->n != names->n)
        TPL_RAISE(r, line, "cannot unpack %zu values into %zu names", parts->n, names->n);
    for (size_t i = 0; i < names->n; i++)
        assign(r, s, names->v[i]->name, parts->v[i]);
}

/* jinja2's loop is one object advanced each iteration; so is this one */
static void loop_advance(tpl_run *r, tv_dict *d, tv_list *items, size_t i)
{
    size_t n = items->n;
    struct {
        const char *k;
        tv v;
    } f[] = {
        {"index", tv_int((int64_t)i + 1)},
        {"index0", tv_int((int64_t)i)},
        {"revindex", tv_int((int64_t)(n - i))},
        {"revindex0", tv_int((int64_t)(n - i - 1))},
        {"first", tv_bool(i == 0)},
        {"last", tv_bool(i + 1 == n)},
        {"length", tv_int((int64_t)n)},
        {"depth", tv_int(1)},
        {"depth0", tv_int(0)},
        {"previtem", i ? items->v[i - 1] : tv_undef("loop.previtem")},
        {"nextitem", i + 1 < n ? items->v[i + 1] : tv_undef("loop.nextitem")},
    };
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
        if (d->n == k)
            tv_dict_set(r->a, d, tv_str(f[k].k, strlen(f[k].k)), f[k].v);
        else
            d->vals[k] = f[k].v;
    }
}

static void exec_for(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tv_list *all = tpl_iterable(r, tpl_eval(r, s, n->a), n->line), *items = all;
    if (n->b) {
        /* the loop's "if" filters first: loop.length counts what passes */
        items = tv_list_new(r->a, all->n);
        tpl_scope *fs = new_scope(r, s);
        for (size_t i = 0; i < all->n; i++) {
            tpl_step(r, n->line);
            fs->vars->n = 0;
            bind_targets(r, fs, &n->names, all->v[i], n->line);
            if (tv_truthy(tpl_eval(r, fs, n->b)))
                tv_list_push(r->a, items, all->v[i]);
        }
    }
    tv_dict *loop = tv_dict_new(r->a, TD_LOOP);
    tpl_scope *body = NULL;
    for (size_t i = 0; i < items->n; i++) {
        tpl_step(r, n->line);
        /* each iteration a fresh scope: the last one's is reused unless a
         * macro defined in it still holds it */
        if (!body || body->captured)
            body = new_scope(r, s);
        else
            body->vars->n = 0;
        loop_advance(r, loop, items, i);
        assign(r, body, "loop", tv_dict_value(loop));
        bind_targets(r, body, &n->names, items->v[i], n->line);
        int sig = SIG_NONE;
        tpl_exec_body(r, body, &n->body, &sig);
        if (sig == SIG_BREAK)
            break;
    }
    if (!items->n) {
        int sig = SIG_NONE;
        tpl_exec_body(r, s, &n->alt, &sig);
    }
}

static void exec_set(tpl_run *r, tpl_scope *s, const tpl_node *n)
{
    tv v = tpl_eval(r, s, n->a);
    const tpl_node *t = n->names.v[0];
    if (n->names.n == 1 && t->kind == N_ATTR) {
        tv ns = lookup(s, t->a->name);
        if (ns.kind != TV_DICT || ns.d->flavor != TD_NAMESPACE)
            TPL_RAISE(r, n->line, "cannot assign attribute on a non-namespace object ('%s')",
                      t->a->name);
        tv_dict_set(r->a, ns.d, tv_str(t->name, strlen(t->name)), v);
        return;
    }
    for (size_t i = 0; i < n->names.n; i++)
        if (n->names.v[i]->kind != N_NAME)
            TPL_RAISE(r, n->line, "namespace attributes cannot be unpacked into");
    bind_targets(r, s, &n->names, v, n->line);
}

static void exec_node(tpl_run *r, tpl_scope *s, const tpl_node *n, int *signal)
{
    size_t start;
    switch (n->kind) {
    case N_TEXT: emit(r, n->lit.s.p, n->lit.s.n, n->line); return;
    case N_OUTPUT: emit_value(r, tpl_eval(r, s, n->a), n->line); return;
    case N_IF:
        tpl_exec_body(r, s, tv_truthy(tpl_eval(r, s, n->b)) ? &n->body : &n->alt, signal);
        return;
    case N_FOR: exec_for(r, s, n); return;
    case N_SET: exec_set(r, s, n); return;
    case N_SETBLOCK:
        start = r->out.n;
        tpl_exec_body(r, s, &n->body, signal);
        assign(r, s, n->names.v[0]->name,
               tv_str(tpl_strdup(r->a, r->out.p + start, r->out.n - start), r->out.n - start));
        r->out.n = start;
        return;
    case N_MACRO: {
        struct tv_macro *m = tpl_alloc(r->a, sizeof *m);
        m->def = n;
        m->closure = s;
        s->captured = true;
        assign(r, s, n->name, (tv){.kind = TV_MACRO, .macro = m});
        return;
    }
    case N_FILTERBLOCK: {
        start = r->out.n;
        tpl_exec_body(r, s, &n->body, signal);
        tv saved = r->block_text;
        r->block_text =
            tv_str(tpl_strdup(r->a, r->out.p + start, r->out.n - start), r->out.n - start);
        r->out.n = start;
        tv v = tpl_eval(r, s, n->a);
        r->block_text = saved;
        emit_value(r, v, n->line);
        return;
    }
    case N_BREAK: *signal = SIG_BREAK; return;
    case N_CONTINUE: *signal = SIG_CONTINUE; return;
    case N_BODY: tpl_exec_body(r, s, &n->body, signal); return;
    default: TPL_RAISE(r, n->line, "an expression where a statement belongs");
    }
}

void tpl_exec_body(tpl_run *r, tpl_scope *s, const tpl_nodes *body, int *signal)
{
    if (++r->eval_depth > TPL_MAX_EVAL_DEPTH)
        TPL_RAISE(r, body->n ? body->v[0]->line : 0, "evaluation nested deeper than %d",
                  TPL_MAX_EVAL_DEPTH);
    for (size_t i = 0; i < body->n && *signal == SIG_NONE; i++)
        exec_node(r, s, body->v[i], signal);
    r->eval_depth--;
}

/*
 * parser.c - tokens to a syntax tree, following jinja2's parser
 * (parser.py) for the grammar and its precedence: condexpr < or < and <
 * not < compare < + - < ~ < * / // % < ** < unary - + < postfix (. [] ())
 * and filters/tests. Every statement, filter, test and method name is
 * checked here, so a construct this renderer lacks is refused at compile
 * time by name and line (QL_EUNSUPPORTED) and never rendered wrongly.
 *
 * It owns nothing; nodes live in the caller's arena.
 */
#include "internal/template_internal.h"

#include <string.h>

typedef struct parser {
    tpl_arena *a;
    const tpl_token *t;
    size_t i, n;
    int depth;
} parser;

#define FAIL(P, ...)   tpl_raise((P)->a->fail, QL_EFORMAT, (P)->t[(P)->i].line, __VA_ARGS__)
#define REFUSE(P, ...) tpl_raise((P)->a->fail, QL_EUNSUPPORTED, (P)->t[(P)->i].line, __VA_ARGS__)

static const tpl_token *cur(parser *P)
{
    return &P->t[P->i];
}
static const tpl_token *peek(parser *P, size_t k)
{
    return P->i + k < P->n ? &P->t[P->i + k] : &P->t[P->n - 1];
}
static void next(parser *P)
{
    if (P->i + 1 < P->n)
        P->i++;
}
static bool is_op(const tpl_token *t, const char *op)
{
    return t->kind == TK_OP && !strcmp(t->s, op);
}
static bool is_name(const tpl_token *t, const char *name)
{
    return t->kind == TK_NAME && !strcmp(t->s, name);
}
static bool accept_op(parser *P, const char *op)
{
    if (!is_op(cur(P), op))
        return false;
    next(P);
    return true;
}
static bool accept_name(parser *P, const char *name)
{
    if (!is_name(cur(P), name))
        return false;
    next(P);
    return true;
}
static const char *tok_text(const tpl_token *t)
{
    switch (t->kind) {
    case TK_EOF: return "end of template";
    case TK_TEXT: return "text";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "'}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "'%}'";
    case TK_STRING: return "a string";
    case TK_INT:
    case TK_FLOAT: return "a number";
    default: return t->s;
    }
}
static void expect_op(parser *P, const char *op)
{
    if (!accept_op(P, op))
        FAIL(P, "expected '%s', got %s", op, tok_text(cur(P)));
}
static const char *expect_name(parser *P)
{
    if (cur(P)->kind != TK_NAME)
        FAIL(P, "expected a name, got %s", tok_text(cur(P)));
    const char *s = cur(P)->s;
    next(P);
    return s;
}
static void expect_block_end(parser *P)
{
    if (cur(P)->kind != TK_BLOCK_END)
        FAIL(P, "expected '%%}', got %s", tok_text(cur(P)));
    next(P);
}

static tpl_node *node(parser *P, tpl_node_kind kind)
{
    tpl_node *n = tpl_alloc(P->a, sizeof *n);
    n->kind = kind;
    n->line = cur(P)->line;
    return n;
}
static void add(parser *P, tpl_nodes *l, tpl_node *n)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        tpl_node **v = tpl_alloc(P->a, cap * sizeof *v);
        if (l->n)
            memcpy(v, l->v, l->n * sizeof *v);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = n;
}

static tpl_node *parse_expr(parser *P, bool with_cond);
static tpl_node *parse_tuple(parser *P, bool with_cond, bool simplified);
static tpl_node *parse_unary(parser *P, bool with_filter);

static void enter(parser *P)
{
    if (++P->depth > TPL_MAX_DEPTH)
        REFUSE(P, "nesting deeper than %d", TPL_MAX_DEPTH);
}

/* (args, name=value): positional before keywords; no star-args */
static void parse_call_args(parser *P, tpl_node *n)
{
    expect_op(P, "(");
    size_t kcap = 0;
    while (!accept_op(P, ")")) {
        if (n->args.n || n->kwvals.n)
            expect_op(P, ",");
        if (accept_op(P, ")"))
            break;
        if (is_op(cur(P), "*") || is_op(cur(P), "**"))
            REFUSE(P, "*args and **kwargs in calls are not supported");
        if (cur(P)->kind == TK_NAME && is_op(peek(P, 1), "=")) {
            const char *k = expect_name(P);
            next(P);
            add(P, &n->kwvals, parse_expr(P, true));
            if (n->kwvals.n > kcap) {
                kcap = kcap ? kcap * 2 : 4;
                const char **kn = tpl_alloc(P->a, kcap * sizeof *kn);
                if (n->kwvals.n > 1)
                    memcpy(kn, n->kwnames, (n->kwvals.n - 1) * sizeof *kn);
                n->kwnames = kn;
            }
            n->kwnames[n->kwvals.n - 1] = k;
        } else {
            if (n->kwvals.n)
                FAIL(P, "a positional argument after a keyword argument");
            add(P, &n->args, parse_expr(P, true));
        }
    }
}

/* a dotted name: filter and test names may be "a.b" in jinja2 */
static const char *parse_dotted(parser *P)
{
    const char *name = expect_name(P);
    if (is_op(cur(P), ".")) {
        next(P);
        REFUSE(P, "dotted filter or test name '%s.%s' is not supported", name, cur(P)->s);
    }
    return name;
}

static tpl_node *parse_filter(parser *P, tpl_node *operand)
{
    tpl_node *n = node(P, N_FILTER);
    n->a = operand;
    n->name = parse_dotted(P);
    if (!tpl_find_filter(n->name))
        tpl_raise(P->a->fail, QL_EUNSUPPORTED, n->line, "filter '%s' is not supported", n->name);
    if (is_op(cur(P), "("))
        parse_call_args(P, n);
    return n;
}

static tpl_node *parse_test(parser *P, tpl_node *operand)
{
    tpl_node *n = node(P, N_TEST);
    n->a = operand;
    n->neg = accept_name(P, "not");
    n->name = parse_dotted(P);
    if (!tpl_find_test(n->name))
        tpl_raise(P->a->fail, QL_EUNSUPPORTED, n->line, "test '%s' is not supported", n->name);
    const tpl_token *t = cur(P);
    if (is_op(t, "(")) {
        parse_call_args(P, n);
    } else if ((t->kind == TK_NAME || t->kind == TK_STRING || t->kind == TK_INT ||
                t->kind == TK_FLOAT || is_op(t, "[") || is_op(t, "{")) &&
               !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and")) {
        if (is_name(t, "is"))
            FAIL(P, "you cannot chain multiple tests with is");
        tpl_node *arg = parse_unary(P, false);
        add(P, &n->args, arg);
    }
    return n;
}

static tpl_node *parse_subscript(parser *P, tpl_node *obj)
{
    tpl_node *n = node(P, N_INDEX), *part[3] = {0};
    n->a = obj;
    int colons = 0;
    for (;;) {
        if (is_op(cur(P), "]"))
            break;
        if (accept_op(P, ":")) {
            if (++colons > 2)
                FAIL(P, "a slice takes at most two ':'");
            continue;
        }
        if (part[colons])
            FAIL(P, "expected ':' or ']' in a subscript");
        part[colons] = parse_expr(P, true);
        if (is_op(cur(P), ","))
            REFUSE(P, "tuple subscripts are not supported");
    }
    expect_op(P, "]");
    if (colons == 0) {
        if (!part[0])
            FAIL(P, "an empty subscript");
        n->b = part[0];
    } else {
        n->kind = N_SLICE;
        n->b = part[0];
        n->c = part[1];
        n->d = part[2];
    }
    return n;
}

static tpl_node *parse_postfix(parser *P, tpl_node *n)
{
    for (;;) {
        if (accept_op(P, ".")) {
            tpl_node *attr = node(P, N_ATTR);
            attr->a = n;
            if (cur(P)->kind == TK_INT) {
                REFUSE(P, "numeric attribute access ('.%lld') is not supported",
                       (long long)cur(P)->i);
            }
            attr->name = expect_name(P);
            n = attr;
        } else if (accept_op(P, "[")) {
            n = parse_subscript(P, n);
        } else if (is_op(cur(P), "(")) {
            tpl_node *call = node(P, N_CALL);
            call->a = n;
            if (n->kind == N_NAME && (!strcmp(n->name, "cycler") || !strcmp(n->name, "joiner") ||
                                      !strcmp(n->name, "lipsum")))
                tpl_raise(P->a->fail, QL_EUNSUPPORTED, n->line, "function '%s' is not supported",
                          n->name);
            if (n->kind == N_ATTR && !tpl_is_method(n->name))
                tpl_raise(P->a->fail, QL_EUNSUPPORTED, n->line, "method '%s' is not supported",
                          n->name);
            parse_call_args(P, call);
            n = call;
        } else {
            return n;
        }
    }
}

static tpl_node *lit(parser *P, tv v)
{
    tpl_node *n = node(P, N_LIT);
    n->lit = v;
    next(P);
    return n;
}

static tpl_node *parse_primary(parser *P)
{
    const tpl_token *t = cur(P);
    if (t->kind == TK_NAME) {
        static const char *const t_names[] = {"true", "True", NULL},
                                 *const f_names[] = {"false", "False", NULL},
                                 *const n_names[] = {"none", "None", NULL};
        for (int i = 0; t_names[i]; i++) {
            if (!strcmp(t->s, t_names[i]))
                return lit(P, tv_bool(true));
            if (!strcmp(t->s, f_names[i]))
                return lit(P, tv_bool(false));
            if (!strcmp(t->s, n_names[i]))
                return lit(P, tv_none());
        }
        tpl_node *n = node(P, N_NAME);
        n->name = t->s;
        next(P);
        return n;
    }
    if (t->kind == TK_STRING) {
        /* adjacent strings concatenate, as in Python */
        tpl_buf b = {.a = P->a};
        tpl_node *n = node(P, N_LIT);
        while (cur(P)->kind == TK_STRING) {
            tb_put(&b, cur(P)->s, cur(P)->n);
            next(P);
        }
        n->lit = tb_value(&b);
        return n;
    }
    if (t->kind == TK_INT)
        return lit(P, tv_int(t->i));
    if (t->kind == TK_FLOAT)
        return lit(P, tv_float(t->f));
    if (accept_op(P, "(")) {
        if (accept_op(P, ")")) {
            tpl_node *n = node(P, N_TUPLE);
            return n;
        }
        tpl_node *n = parse_tuple(P, true, false);
        expect_op(P, ")");
        return n;
    }
    if (is_op(t, "[")) {
        tpl_node *n = node(P, N_LIST);
        next(P);
        while (!accept_op(P, "]")) {
            if (n->args.n)
                expect_op(P, ",");
            if (accept_op(P, "]"))
                break;
            add(P, &n->args, parse_expr(P, true));
        }
        return n;
    }
    if (is_op(t, "{")) {
        tpl_node *n = node(P, N_DICT);
        next(P);
        while (!accept_op(P, "}")) {
            if (n->args.n)
                expect_op(P, ",");
            if (accept_op(P, "}"))
                break;
            add(P, &n->args, parse_expr(P, true));
            expect_op(P, ":");
            add(P, &n->kwvals, parse_expr(P, true));
        }
        return n;
    }
    FAIL(P, "unexpected %s", tok_text(t));
}

static tpl_node *parse_filter_expr(parser *P, tpl_node *n)
{
    for (;;) {
        if (accept_op(P, "|"))
            n = parse_filter(P, n);
        else if (accept_name(P, "is"))
            n = parse_test(P, n);
        else if (is_op(cur(P), "(")) {
            tpl_node *call = node(P, N_CALL);
            call->a = n;
            parse_call_args(P, call);
            n = call;
        } else
            return n;
    }
}

static tpl_node *parse_unary(parser *P, bool with_filter)
{
    enter(P);
    tpl_node *n;
    if (is_op(cur(P), "-") || is_op(cur(P), "+")) {
        n = node(P, is_op(cur(P), "-") ? N_NEG : N_POS);
        next(P);
        n->a = parse_unary(P, false);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_expr(P, n);
    P->depth--;
    return n;
}

static tpl_node *binop(parser *P, const char *op, tpl_node *a, tpl_node *b, int line)
{
    tpl_node *n = tpl_alloc(P->a, sizeof *n);
    n->kind = N_BINOP;
    n->line = line;
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

/* one precedence level of left-associative binary operators */
typedef tpl_node *(*level_fn)(parser *P);
static tpl_node *parse_level(parser *P, const char *const *ops, level_fn below)
{
    tpl_node *n = below(P);
    for (;;) {
        const char *const *op = ops;
        while (*op && !is_op(cur(P), *op))
            op++;
        if (!*op)
            return n;
        int line = cur(P)->line;
        next(P);
        n = binop(P, *op, n, below(P), line);
    }
}
static tpl_node *parse_pow(parser *P)
{
    static const char *const ops[] = {"**", NULL};
    tpl_node *n = parse_unary(P, true);
    while (is_op(cur(P), ops[0])) {
        int line = cur(P)->line;
        next(P);
        n = binop(P, "**", n, parse_unary(P, true), line);
    }
    return n;
}
static tpl_node *parse_math2(parser *P)
{
    static const char *const ops[] = {"*", "/", "//", "%", NULL};
    return parse_level(P, ops, parse_pow);
}
static tpl_node *parse_concat(parser *P)
{
    static const char *const ops[] = {"~", NULL};
    return parse_level(P, ops, parse_math2);
}
static tpl_node *parse_math1(parser *P)
{
    static const char *const ops[] = {"+", "-", NULL};
    return parse_level(P, ops, parse_concat);
}

static tpl_node *parse_compare(parser *P)
{
    static const char *const ops[] = {"==", "!=", "<", ">", "<=", ">=", NULL};
    tpl_node *n = parse_math1(P);
    bool chained = false;
    for (;;) {
        const char *op = NULL;
        for (int i = 0; ops[i] && !op; i++)
            if (is_op(cur(P), ops[i]))
                op = ops[i];
        int line = cur(P)->line;
        if (op) {
            next(P);
        } else if (is_name(cur(P), "in")) {
            next(P);
            op = "in";
        } else if (is_name(cur(P), "not") && is_name(peek(P, 1), "in")) {
            next(P);
            next(P);
            op = "not in";
        } else {
            return n;
        }
        if (chained)
            REFUSE(P, "chained comparisons (a < b < c) are not supported");
        chained = true;
        n = binop(P, op, n, parse_math1(P), line);
        n->kind = N_COMPARE;
    }
}

static tpl_node *parse_not(parser *P)
{
    if (is_name(cur(P), "not")) {
        tpl_node *n = node(P, N_NOT);
        next(P);
        enter(P);
        n->a = parse_not(P);
        P->depth--;
        return n;
    }
    return parse_compare(P);
}

static tpl_node *parse_andor(parser *P, bool is_or)
{
    tpl_node *n = is_or ? parse_andor(P, false) : parse_not(P);
    while (is_name(cur(P), is_or ? "or" : "and")) {
        tpl_node *b = node(P, is_or ? N_OR : N_AND);
        next(P);
        b->a = n;
        b->b = is_or ? parse_andor(P, false) : parse_not(P);
        n = b;
    }
    return n;
}

static tpl_node *parse_expr(parser *P, bool with_cond)
{
    enter(P);
    tpl_node *n = parse_andor(P, true);
    while (with_cond && is_name(cur(P), "if")) {
        tpl_node *c = node(P, N_COND);
        next(P);
        c->a = n;
        c->b = parse_andor(P, true);
        if (accept_name(P, "else"))
            c->c = parse_expr(P, true);
        n = c;
    }
    P->depth--;
    return n;
}

/* a, b, c (a tuple when a comma appears) or one expression */
static tpl_node *parse_tuple(parser *P, bool with_cond, bool simplified)
{
    int line = cur(P)->line;
    tpl_node *first = simplified ? parse_primary(P) : parse_expr(P, with_cond);
    if (!is_op(cur(P), ","))
        return first;
    tpl_node *t = node(P, N_TUPLE);
    t->line = line;
    add(P, &t->args, first);
    while (accept_op(P, ",")) {
        const tpl_token *c = cur(P);
        if (c->kind == TK_VAR_END || c->kind == TK_BLOCK_END || is_op(c, ")") || is_op(c, "=") ||
            is_name(c, "in"))
            break;
        add(P, &t->args, simplified ? parse_primary(P) : parse_expr(P, with_cond));
    }
    return t;
}

/* ---- statements ---- */
static void parse_body(parser *P, tpl_nodes *body, const char *const *ends);

static void parse_assign_targets(parser *P, tpl_node *n, bool allow_attr)
{
    do {
        if (cur(P)->kind != TK_NAME)
            FAIL(P, "expected a name to assign to, got %s", tok_text(cur(P)));
        tpl_node *t = node(P, N_NAME);
        t->name = expect_name(P);
        if (allow_attr && accept_op(P, ".")) {
            tpl_node *attr = node(P, N_ATTR);
            attr->a = t;
            attr->name = expect_name(P);
            t = attr;
        }
        add(P, &n->names, t);
    } while (accept_op(P, ",") && cur(P)->kind == TK_NAME);
}

static tpl_node *parse_for(parser *P)
{
    tpl_node *n = node(P, N_FOR);
    bool paren = accept_op(P, "(");
    parse_assign_targets(P, n, false);
    if (paren)
        expect_op(P, ")");
    if (!accept_name(P, "in"))
        FAIL(P, "expected 'in' in a for loop");
    n->a = parse_tuple(P, false, false);
    if (accept_name(P, "if"))
        n->b = parse_expr(P, true);
    if (is_name(cur(P), "recursive"))
        REFUSE(P, "recursive for loops are not supported");
    expect_block_end(P);
    static const char *const ends[] = {"endfor", "else", NULL};
    parse_body(P, &n->body, ends);
    if (accept_name(P, "else")) {
        expect_block_end(P);
        static const char *const end[] = {"endfor", NULL};
        parse_body(P, &n->alt, end);
    }
    next(P); /* endfor */
    expect_block_end(P);
    return n;
}

static tpl_node *parse_if(parser *P)
{
    tpl_node *n = node(P, N_IF), *top = n;
    static const char *const ends[] = {"endif", "elif", "else", NULL};
    for (;;) {
        n->b = parse_tuple(P, false, false);
        expect_block_end(P);
        parse_body(P, &n->body, ends);
        if (accept_name(P, "elif")) {
            tpl_node *e = node(P, N_IF);
            add(P, &n->alt, e);
            n = e;
            continue;
        }
        if (accept_name(P, "else")) {
            expect_block_end(P);
            static const char *const end[] = {"endif", NULL};
            parse_body(P, &n->alt, end);
        }
        next(P); /* endif */
        expect_block_end(P);
        return top;
    }
}

static tpl_node *parse_set(parser *P)
{
    tpl_node *n = node(P, N_SET);
    parse_assign_targets(P, n, true);
    if (accept_op(P, "=")) {
        n->a = parse_tuple(P, true, false);
        expect_block_end(P);
        return n;
    }
    if (n->names.n != 1 || n->names.v[0]->kind != N_NAME)
        FAIL(P, "expected '=' in a set");
    if (is_op(cur(P), "|"))
        REFUSE(P, "filters on a block set are not supported");
    expect_block_end(P);
    n->kind = N_SETBLOCK;
    static const char *const end[] = {"endset", NULL};
    parse_body(P, &n->body, end);
    next(P);
    expect_block_end(P);
    return n;
}

static tpl_node *parse_macro(parser *P)
{
    tpl_node *n = node(P, N_MACRO);
    n->name = expect_name(P);
    expect_op(P, "(");
    size_t ndef = 0;
    while (!accept_op(P, ")")) {
        if (n->names.n)
            expect_op(P, ",");
        tpl_node *param = node(P, N_NAME);
        param->name = expect_name(P);
        add(P, &n->names, param);
        if (accept_op(P, "=")) {
            add(P, &n->kwvals, parse_expr(P, true));
            ndef++;
        } else if (ndef) {
            FAIL(P, "a macro parameter without a default after one with a default");
        } else {
            add(P, &n->kwvals, NULL);
        }
    }
    expect_block_end(P);
    static const char *const end[] = {"endmacro", NULL};
    parse_body(P, &n->body, end);
    next(P);
    if (cur(P)->kind == TK_NAME)
        next(P); /* {% endmacro name %} */
    expect_block_end(P);
    return n;
}

static tpl_node *parse_statement(parser *P)
{
    int line = cur(P)->line;
    const char *kw = expect_name(P);
    tpl_node *n;
    enter(P);
    if (!strcmp(kw, "for"))
        n = parse_for(P);
    else if (!strcmp(kw, "if"))
        n = parse_if(P);
    else if (!strcmp(kw, "set"))
        n = parse_set(P);
    else if (!strcmp(kw, "macro"))
        n = parse_macro(P);
    else if (!strcmp(kw, "break") || !strcmp(kw, "continue")) {
        n = node(P, kw[0] == 'b' ? N_BREAK : N_CONTINUE);
        expect_block_end(P);
    } else if (!strcmp(kw, "filter")) {
        n = node(P, N_FILTERBLOCK);
        n->a = parse_filter(P, NULL);
        while (accept_op(P, "|"))
            n->a = parse_filter(P, n->a);
        expect_block_end(P);
        static const char *const end[] = {"endfilter", NULL};
        parse_body(P, &n->body, end);
        next(P);
        expect_block_end(P);
    } else if (!strcmp(kw, "generation")) {
        /* transformers' AssistantTracker: marks assistant text, renders it as is */
        n = node(P, N_BODY);
        expect_block_end(P);
        static const char *const end[] = {"endgeneration", NULL};
        parse_body(P, &n->body, end);
        next(P);
        expect_block_end(P);
    } else {
        tpl_raise(P->a->fail, QL_EUNSUPPORTED, line, "statement '%s' is not supported", kw);
    }
    n->line = line;
    P->depth--;
    return n;
}

/* statements and text until a block whose keyword is in ends (left as the
 * current token) or, with ends NULL, the end of the template */
static void parse_body(parser *P, tpl_nodes *body, const char *const *ends)
{
    for (;;) {
        const tpl_token *t = cur(P);
        if (t->kind == TK_EOF) {
            if (ends)
                FAIL(P, "unexpected end of template, expected '%s'", ends[0]);
            return;
        }
        if (t->kind == TK_TEXT) {
            tpl_node *n = node(P, N_TEXT);
            n->lit = tv_str(t->s, t->n);
            add(P, body, n);
            next(P);
        } else if (t->kind == TK_VAR_BEGIN) {
            tpl_node *n = node(P, N_OUTPUT);
            next(P);
            n->a = parse_tuple(P, true, false);
            if (cur(P)->kind != TK_VAR_END)
                FAIL(P, "expected '}}', got %s", tok_text(cur(P)));
            next(P);
            add(P, body, n);
        } else if (t->kind == TK_BLOCK_BEGIN) {
            const tpl_token *kw = peek(P, 1);
            for (const char *const *e = ends; e && *e; e++)
                if (is_name(kw, *e)) {
                    next(P);
                    return;
                }
            if (kw->kind == TK_NAME && !strncmp(kw->s, "end", 3))
                tpl_raise(P->a->fail, QL_EFORMAT, kw->line, "unexpected '%s'", kw->s);
            if (kw->kind == TK_NAME && (!strcmp(kw->s, "elif") || !strcmp(kw->s, "else")))
                tpl_raise(P->a->fail, QL_EFORMAT, kw->line, "unexpected '%s'", kw->s);
            next(P);
            add(P, body, parse_statement(P));
        } else {
            FAIL(P, "unexpected %s", tok_text(t));
        }
    }
}

tpl_node *tpl_parse(tpl_arena *a, const tpl_token *toks, size_t ntoks)
{
    parser P = {.a = a, .t = toks, .n = ntoks};
    tpl_node *root = node(&P, N_BODY);
    parse_body(&P, &root->body, NULL);
    return root;
}

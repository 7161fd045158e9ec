/*
 * template.c - the public entry points of template/ (template.h):
 * compile = normalise + lex + parse into the template's own arena; render
 * = map the JSON context onto values in a fresh arena, walk the tree, hand
 * the output out as one malloc'd string, drop the arena.
 *
 * It owns the compiled template (its arena) and, during a render, that
 * render's arena; it touches nothing else.
 */
#include "template.h"

#include "internal/template_internal.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

struct tpl_template {
    tpl_arena arena;
    tpl_node *root;
};

int tpl_compile(tpl_template **out, const char *source, size_t len, char *msg, size_t msg_len)
{
    *out = NULL;
    if (!source && len)
        return ql_fail(msg, msg_len, QL_EINVAL, "template: no source");
    if (source && memchr(source, 0, len))
        return ql_fail(msg, msg_len, QL_EFORMAT, "template: a NUL byte at offset %zu",
                       (size_t)((const char *)memchr(source, 0, len) - source));
    tpl_template *t = calloc(1, sizeof *t);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOMEM, "template: out of memory");
    tpl_fail fail = {.msg = msg, .msg_len = msg_len};
    t->arena.fail = &fail;
    int err = setjmp(fail.jump);
    if (err) {
        tpl_arena_free(&t->arena);
        free(t);
        return err;
    }
    tpl_token *toks;
    size_t n = tpl_lex(&t->arena, source ? source : "", len, &toks);
    t->root = tpl_parse(&t->arena, toks, n);
    t->arena.fail = NULL; /* a compiled template allocates no more */
    *out = t;
    return QL_OK;
}

void tpl_free(tpl_template *t)
{
    if (!t)
        return;
    tpl_arena_free(&t->arena);
    free(t);
}

static const struct {
    const char *name;
    int fn;
} globals[] = {
    {"range", TF_RANGE},           {"namespace", TF_NAMESPACE},   {"dict", TF_DICT},
    {"raise_exception", TF_RAISE}, {"strftime_now", TF_STRFTIME},
};

/* the globals under the context's variables, as jinja2 layers them */
static tpl_scope *context_scope(tpl_arena *a, const cJSON *context)
{
    tpl_scope *g = tpl_alloc(a, sizeof *g), *s = tpl_alloc(a, sizeof *s);
    g->vars = tv_dict_new(a, TD_DICT);
    for (size_t i = 0; i < sizeof globals / sizeof globals[0]; i++)
        tv_dict_set(a, g->vars, tv_str(globals[i].name, strlen(globals[i].name)),
                    (tv){.kind = TV_FUNC, .fn = globals[i].fn});
    s->parent = g;
    s->vars = tv_dict_new(a, TD_DICT);
    for (const cJSON *c = context ? context->child : NULL; c; c = c->next)
        tv_dict_set(a, s->vars, tv_str(c->string, strlen(c->string)), tv_from_json(a, c));
    return s;
}

/* The render proper. setjmp lives here, not in tpl_render, so the arena
 * and output that the walk changes belong to a caller's frame and keep
 * their values when an error unwinds (C11 7.13.2.1). */
static int render_guarded(tpl_run *r, const tpl_template *t, const cJSON *context)
{
    int err = setjmp(r->fail->jump);
    if (err)
        return err;
    tpl_scope *s = context_scope(r->a, context);
    int signal = 0;
    tpl_exec_body(r, s, &t->root->body, &signal);
    return QL_OK;
}

int tpl_render(const tpl_template *t, const cJSON *context, size_t max_out, char **out,
               size_t *out_len, char *msg, size_t msg_len)
{
    *out = NULL;
    *out_len = 0;
    if (!t)
        return ql_fail(msg, msg_len, QL_EINVAL, "template: none compiled");
    if (context && !cJSON_IsObject(context))
        return ql_fail(msg, msg_len, QL_EINVAL, "template: the context must be a JSON object");
    if (!max_out)
        max_out = TPL_DEFAULT_MAX_OUT;
    tpl_fail fail = {.msg = msg, .msg_len = msg_len};
    tpl_arena arena = {.fail = &fail};
    arena.limit = TPL_MEMORY_BASE +
                  (max_out > SIZE_MAX / 64 ? SIZE_MAX / 4 : max_out * TPL_MEMORY_PER_OUT_BYTE);
    tpl_run r = {.a = &arena, .fail = &fail, .max_out = max_out};
    r.out.a = &arena;
    int err = render_guarded(&r, t, context);
    if (err) {
        tpl_arena_free(&arena);
        return err;
    }
    char *text = malloc(r.out.n + 1);
    if (!text) {
        tpl_arena_free(&arena);
        return ql_fail(msg, msg_len, QL_ENOMEM, "template: out of memory for the output");
    }
    if (r.out.n)
        memcpy(text, r.out.p, r.out.n);
    text[r.out.n] = 0;
    *out = text;
    *out_len = r.out.n;
    tpl_arena_free(&arena);
    return QL_OK;
}

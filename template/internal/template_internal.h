/*
 * template_internal.h - what the files of template/ share: the
 * arena, the value model (Jinja's values as jinja2 sees them: undefined,
 * none, bool, int, float, str, list/tuple, dict keeping insertion order,
 * namespace, loop, macro, bound method, builtin function), the tokens, the
 * syntax tree, and the render state.
 *
 * It owns no data itself. Errors inside the renderer unwind with longjmp
 * (tpl_raise) to tpl_compile / tpl_render: a tree-walking interpreter has
 * hundreds of failure points, and every allocation lives in an arena that
 * is dropped whole, so unwinding leaks nothing and keeps each helper short.
 * Only the .c files of template/ include this header. They call
 * each other one way (test_layout checks the object files): value.c (the
 * arena, values, text) <- ops.c (access, operators, bounds, globals) <-
 * strings.c (str and dict methods) <- filters.c (filters, tests) <- eval.c
 * (expressions, statements); lexer.c <- parser.c (which asks filters.c and
 * ops.c what names exist) <- template.c (the public entry points).
 */
#ifndef QL_TEMPLATE_INTERNAL_H
#define QL_TEMPLATE_INTERNAL_H

#include "ql_base.h"

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bounds of one render, each so a hostile template fails instead of
 * hanging or exhausting the server. */
/* Nesting of the syntax tree and of macro calls: real chat templates nest
 * under 20 deep; 200 keeps the C stack (a few hundred bytes a level) far
 * under a thread's 8 MiB. */
#define TPL_MAX_DEPTH 200
/* Nesting of evaluation (expressions inside statements inside macro
 * calls, all together): bounds the C stack at a few hundred bytes a level
 * whatever mix of deep expressions and recursive macros a template has. */
#define TPL_MAX_EVAL_DEPTH 1000
/* Nesting of list and dict values: past cJSON's own parse limit
 * (CJSON_NESTING_LIMIT, 1000) so any context fits, and the recursive walks
 * over values (==, <, repr, tojson) stay bounded however a template nests
 * values through a namespace in a loop. */
#define TPL_MAX_VALUE_DEPTH 1100
/* Loop iterations, macro calls and range() elements together: a real
 * template over a long chat makes a few thousand. */
#define TPL_MAX_STEPS 2000000
/* Arena bytes of a render beyond its context, over max_out: values are
 * copies of the output's parts, so a few times the output suffices. */
#define TPL_MEMORY_BASE         (32u << 20)
#define TPL_MEMORY_PER_OUT_BYTE 16
#define TPL_DEFAULT_MAX_OUT     (4u << 20)

/* ---- errors: unwinding to the public entry point ---- */
typedef struct tpl_fail {
    jmp_buf jump;
    char *msg;
    size_t msg_len;
} tpl_fail;

_Noreturn void tpl_raise(tpl_fail *f, int err, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- arena: everything of a compile or a render, freed at once ---- */
typedef struct tpl_chunk tpl_chunk;
typedef struct tpl_arena {
    tpl_chunk *head;
    size_t used, limit; /* bytes handed out, the most allowed (0: none) */
    tpl_fail *fail;
} tpl_arena;

void *tpl_alloc(tpl_arena *a, size_t n); /* zeroed, 16-aligned; raises */
void tpl_arena_free(tpl_arena *a);
char *tpl_strdup(tpl_arena *a, const char *s, size_t n);

/* ---- values ---- */
typedef enum {
    TV_MISSING = 0, /* an argument not given (never seen by a template) */
    TV_UNDEF,
    TV_NONE,
    TV_BOOL,
    TV_INT,
    TV_FLOAT,
    TV_STR,
    TV_LIST, /* list or tuple (l->tuple) */
    TV_DICT, /* dict, namespace or loop (d->flavor) */
    TV_MACRO,
    TV_METHOD,
    TV_FUNC,
} tv_kind;

enum { TD_DICT, TD_NAMESPACE, TD_LOOP };
enum { TF_RANGE, TF_NAMESPACE, TF_DICT, TF_RAISE, TF_STRFTIME };

typedef struct tv tv;
typedef struct tv_list tv_list;
typedef struct tv_dict tv_dict;
struct tv {
    uint8_t kind;
    /* TV_STR: a markupsafe.Markup (from |safe or |escape): Markup + str
     * HTML-escapes the str, as jinja2 does even without autoescape. Only
     * + keeps it; other operations give plain strings. */
    bool markup;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s; /* TV_STR; TV_UNDEF: the name that was undefined */
        tv_list *l;
        tv_dict *d;
        struct tv_macro *macro;
        struct tv_method *m;
        int fn;
    };
};
struct tv_list {
    size_t n, cap;
    tv *v;
    bool tuple;
    unsigned depth; /* 1 + the deepest item's depth */
    /* a generator (what map, select, selectattr, unique and the items
     * filter return in jinja2): iterable once, always true, no len(), not
     * printable or serializable; |list makes it a list */
    bool gen;
    /* Python's type when not a list ("range", "dict_items", "dict_keys",
     * "dict_values"): such a value iterates and has a len() like a list but
     * prints and serializes as Python would not let a list, so both fail */
    const char *pyclass;
};
struct tv_dict {
    size_t n, cap;
    tv *keys, *vals;
    int flavor;
    unsigned depth; /* TD_DICT: 1 + the deepest value's depth */
};
struct tv_method {
    tv self;
    const char *name;
};

static inline tv tv_undef(const char *name)
{
    tv v = {.kind = TV_UNDEF};
    v.s.p = name;
    v.s.n = 0;
    return v;
}
static inline tv tv_none(void)
{
    return (tv){.kind = TV_NONE};
}
static inline tv tv_bool(bool b)
{
    return (tv){.kind = TV_BOOL, .b = b};
}
static inline tv tv_int(int64_t i)
{
    return (tv){.kind = TV_INT, .i = i};
}
static inline tv tv_float(double f)
{
    return (tv){.kind = TV_FLOAT, .f = f};
}
static inline tv tv_str(const char *p, size_t n)
{
    tv v = {.kind = TV_STR};
    v.s.p = p;
    v.s.n = n;
    return v;
}

/* a growable byte string in an arena */
typedef struct tpl_buf {
    tpl_arena *a;
    char *p;
    size_t n, cap;
} tpl_buf;
void tb_put(tpl_buf *b, const char *s, size_t n);
void tb_puts(tpl_buf *b, const char *s);
void tb_putc(tpl_buf *b, char c);
tv tb_value(tpl_buf *b);

tv_list *tv_list_new(tpl_arena *a, size_t cap);
void tv_list_push(tpl_arena *a, tv_list *l, tv v);
tv_dict *tv_dict_new(tpl_arena *a, int flavor);
void tv_dict_set(tpl_arena *a, tv_dict *d, tv key, tv val);
tv *tv_dict_get(const tv_dict *d, tv key);
tv *tv_dict_gets(const tv_dict *d, const char *key, size_t n);
tv tv_list_value(tv_list *l);
tv tv_dict_value(tv_dict *d);

bool tv_truthy(tv v);
bool tv_eq(tv a, tv b);
bool tv_is_num(tv v); /* int, float or bool: Python's numbers */
double tv_num(tv v);
const char *tv_type_name(tv v);
/* str(v) appended to b: what {{ v }} prints */
void tv_print(tpl_buf *b, tv v);
void tv_repr(tpl_buf *b, tv v);
void tv_float_repr(char out[40], double f);
tv tv_to_str(tpl_arena *a, tv v);
struct cJSON;
tv tv_from_json(tpl_arena *a, const struct cJSON *j);
/* code-point length of a UTF-8 string; the byte offset of code point i */
size_t tv_str_len(const char *p, size_t n);
size_t tv_str_offset(const char *p, size_t n, size_t i);

/* json.dumps(v, indent=, ensure_ascii=, separators=, sort_keys=) */
typedef struct tv_json_opts {
    int indent; /* < 0: none */
    bool ensure_ascii, sort_keys;
    const char *item_sep, *key_sep;
} tv_json_opts;
void tv_tojson_opts(tpl_buf *b, tv v, const tv_json_opts *o, int depth, tpl_fail *f, int line);

/* ---- tokens ---- */
typedef enum {
    TK_EOF,
    TK_TEXT,
    TK_VAR_BEGIN,
    TK_VAR_END,
    TK_BLOCK_BEGIN,
    TK_BLOCK_END,
    TK_NAME,
    TK_STRING, /* s: the unescaped value */
    TK_INT,
    TK_FLOAT,
    TK_OP, /* s: the operator's text */
} tpl_tok_kind;

typedef struct tpl_token {
    tpl_tok_kind kind;
    int line;
    const char *s;
    size_t n;
    int64_t i;
    double f;
} tpl_token;

/* Tokenize src (after newline normalisation) into *toks; raises. */
size_t tpl_lex(tpl_arena *a, const char *src, size_t len, tpl_token **toks);

/* ---- syntax tree ---- */
typedef enum {
    /* expressions */
    N_LIT,
    N_NAME,
    N_LIST,
    N_TUPLE,
    N_DICT,
    N_ATTR,
    N_INDEX,
    N_SLICE,
    N_CALL,
    N_FILTER,
    N_TEST,
    N_NEG,
    N_POS,
    N_NOT,
    N_AND,
    N_OR,
    N_BINOP,
    N_COMPARE,
    N_COND,
    /* statements */
    N_TEXT,
    N_OUTPUT,
    N_IF,
    N_FOR,
    N_SET,
    N_SETBLOCK,
    N_MACRO,
    N_FILTERBLOCK,
    N_BREAK,
    N_CONTINUE,
    N_BODY,
} tpl_node_kind;

typedef struct tpl_node tpl_node;
typedef struct tpl_nodes {
    tpl_node **v;
    size_t n, cap;
} tpl_nodes;

/*
 * One node. Which fields mean what, by kind:
 *   N_LIT lit; N_NAME/N_ATTR/N_FILTER/N_TEST/N_MACRO name;
 *   N_ATTR a.name; N_INDEX a[b]; N_SLICE a[b:c:d] (NULL parts omitted);
 *   N_CALL a(args, kwnames=kwvals); N_FILTER a|name(args, kw...), N_TEST
 *   a is [not: neg] name(args); N_BINOP/N_COMPARE a op b; N_COND a if b
 *   else c (c NULL: undefined); N_IF b: body else alt; N_FOR names in a if
 *   b: body else alt; N_SET names (N_NAME or N_ATTR) = a; N_SETBLOCK
 *   names[0] = body; N_MACRO name(names = kwvals defaults): body;
 *   N_FILTERBLOCK a: a filter chain whose innermost operand (NULL) is body.
 */
struct tpl_node {
    tpl_node_kind kind;
    int line;
    const char *name;
    const char *op; /* "+", "==", "in", "not in", ... */
    bool neg;
    tv lit;
    tpl_node *a, *b, *c, *d;
    tpl_nodes args, kwvals, names, body, alt;
    const char **kwnames;
};

/* Parse tokens into the root N_BODY; raises (QL_EFORMAT, QL_EUNSUPPORTED). */
tpl_node *tpl_parse(tpl_arena *a, const tpl_token *toks, size_t ntoks);

/* ---- render state ---- */
typedef struct tpl_scope tpl_scope;
struct tpl_scope {
    tv_dict *vars;
    tpl_scope *parent;
    bool captured; /* a macro defined here holds it: it may not be reused */
};
struct tv_macro {
    const tpl_node *def;
    tpl_scope *closure;
};

typedef struct tpl_run {
    tpl_arena *a;
    tpl_fail *fail;
    tpl_buf out;
    size_t max_out;
    long steps, depth, eval_depth;
    tv block_text; /* the body of the innermost {% filter %} block */
} tpl_run;

#define TPL_RAISE(r, line, ...) tpl_raise((r)->fail, QL_EINVAL, (line), __VA_ARGS__)

void tpl_step(tpl_run *r, int line);
tv tpl_eval(tpl_run *r, tpl_scope *s, const tpl_node *n);
void tpl_exec_body(tpl_run *r, tpl_scope *s, const tpl_nodes *body, int *signal);
tv tpl_call_value(tpl_run *r, tpl_scope *s, tv fn, const tv *args, size_t nargs, const char **kwn,
                  const tv *kwv, size_t nkw, int line);

/* the values a for loop walks: a list's items, a dict's keys, a string's
 * characters; undefined walks nothing; else raises */
tv_list *tpl_iterable(tpl_run *r, tv v, int line);

/* str helpers the filters share with the methods (strings.c): strip
 * (chars TV_STR, or whitespace), replace (count < 0: all), case ('u'
 * upper, 'l' lower, 't' str.title, 'c' capitalize), splitlines */
tv tpl_strip(tv s, tv chars, bool left, bool right);
tv tpl_replace(tpl_run *r, tv s, tv old, tv new_, int64_t count);
tv tpl_case(tpl_run *r, tv s, char mode);
tv tpl_splitlines(tpl_run *r, tv s);

/* The builtins, by name (NULL when not supported): for the parser's
 * refusals and the evaluator's calls. */
typedef struct tpl_args {
    const tv *pos;
    size_t npos;
    const char **kwn;
    const tv *kwv;
    size_t nkw;
} tpl_args;
typedef tv (*tpl_filter_fn)(tpl_run *r, tpl_scope *s, tv v, const tpl_args *args, int line);
typedef bool (*tpl_test_fn)(tpl_run *r, tv v, const tpl_args *args, int line);
tpl_filter_fn tpl_find_filter(const char *name);
tpl_test_fn tpl_find_test(const char *name);
bool tpl_is_method(const char *name);
bool tpl_is_str_method(const char *name);
/* obj.name(args): a method of a str, dict, list or loop */
tv tpl_call_method(tpl_run *r, tv self, const char *name, const tpl_args *args, int line);
tv tpl_call_builtin(tpl_run *r, int fn, const tpl_args *args, int line);
/* obj.name / obj[key] as jinja2's getattr/getitem resolve them */
tv tpl_getattr(tpl_run *r, tv obj, const char *name, int line);
tv tpl_getitem(tpl_run *r, tv obj, tv key, int line);
/* the arithmetic and comparison operators */
tv tpl_binop(tpl_run *r, const char *op, tv a, tv b, int line);
/* raise when v cannot become text as Python would (a generator prints its
 * address) */
void tpl_check_printable(tpl_run *r, tv v, int line);
/* markupsafe.escape: & < > " ' as entities */
void tpl_html_escape(tpl_buf *b, tv s);
/* Bind args to params (NULL-terminated) into out (TV_MISSING where not
 * given); raises on an unknown keyword or too many positionals. */
void tpl_bind(tpl_run *r, const char *what, const char *const *params, const tpl_args *args,
              tv *out, int line);

#endif

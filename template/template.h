/*
 * template.h - the public header of template/: chat templates, the
 * Jinja programs models ship in tokenizer_config.json, chat_template.jinja
 * or GGUF metadata, rendered in C exactly as transformers'
 * apply_chat_template renders them (jinja2 with trim_blocks and
 * lstrip_blocks, plus transformers' raise_exception, strftime_now and
 * tojson).
 *
 * It offers compiling a template once (tpl_compile: parse the whole
 * source, refusing at load, by name, any construct this renderer does not
 * support, so a template is never rendered wrongly) and rendering it any
 * number of times, from any thread, against a context given as JSON
 * (tpl_render). A compiled template owns its parsed form and is immutable;
 * a render owns nothing past its return but the text it hands out. It
 * touches nothing but its arguments (and the clock, for strftime_now).
 *
 * Supported: if/elif/else, for (loop.*, else, "if" filter, unpacking,
 * break/continue), set (names, tuples, namespace attributes, block set),
 * macro, filter blocks, transformers' generation block; every expression
 * form but chained comparisons and star-arguments; the filters, tests and
 * str/dict methods listed in filters.c and ops.c. Where this differs from
 * Python it refuses rather than guesses, with two known approximations:
 * case mapping (upper, lower, title, capitalize) covers ASCII letters only,
 * and a JSON number with an integral value is an int (cJSON keeps no
 * source text, so a context's 1.0 prints as 1; non-integral numbers print
 * as Python's repr).
 */
#ifndef QL_TEMPLATE_H
#define QL_TEMPLATE_H

#include "ql_base.h"

#include <stdbool.h>
#include <stddef.h>

struct cJSON;
typedef struct tpl_template tpl_template;

/*
 * Parse source[0..len) into *out (free with tpl_free). Errors:
 * QL_EFORMAT for a syntax error, QL_EUNSUPPORTED for a statement, filter,
 * test or method this renderer does not implement, each with msg naming
 * the construct and its line ("line 12: filter 'wordwrap' is not
 * supported"). On error *out is NULL.
 */
int tpl_compile(tpl_template **out, const char *source, size_t len, char *msg, size_t msg_len);
void tpl_free(tpl_template *t);

/*
 * Render t with the variables of `context`, a JSON object (messages,
 * tools, add_generation_prompt, bos_token, eos_token, ... as transformers
 * passes them): each key is a top-level variable, JSON values map to
 * Jinja's (null -> none, object -> dict keeping key order, array -> list).
 * *out receives the text (malloc'd, NUL-terminated; free()), *out_len its
 * length (authoritative: a template's '\x00' escape may put a NUL inside,
 * as in Python; a source holding a NUL byte is refused at compile).
 * Errors: QL_EINVAL when the template raises (raise_exception): msg is
 * the template's own message; QL_EINVAL for a runtime error (an undefined
 * operation such as adding a list to a number), naming it and the line;
 * QL_ENOMEM; QL_EBUSY never. A render is bounded: output past max_out
 * bytes (0: 4 MiB), more than a fixed number of loop iterations and
 * calls, nesting or memory (internal/template_internal.h names each bound
 * and its reason) fails with QL_EINVAL naming the limit, so a hostile
 * template cannot hang or exhaust the server.
 */
int tpl_render(const tpl_template *t, const struct cJSON *context, size_t max_out, char **out,
               size_t *out_len, char *msg, size_t msg_len);

#endif

/*
 * inspect_text.h - what `qlserve inspect` prints for a model folder or
 * file, as text, through the cli library's eng_inspect (no process): the
 * one way the tests that pin inspect's lines read them.
 *
 *   char *text = inspect_text(dir);   malloc'd, freed by the caller
 */
#ifndef QL_INSPECT_TEXT_H
#define QL_INSPECT_TEXT_H

#include <criterion/criterion.h>
#include <stdio.h>

#include "cli.h"
#include "model.h"

/* eng_inspect of path loaded as it is, into a string the caller frees;
 * asserts that it succeeds. */
static inline char *inspect_text(const char *path)
{
    char msg[1024];
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    cr_assert(out);
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_inspect(path, &o, out, msg, sizeof msg), 0, "%s: %s", path, msg);
    fclose(out);
    return text;
}

#endif

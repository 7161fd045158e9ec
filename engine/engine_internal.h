/*
 * engine_internal.h - helpers shared by the files of engine/ only.
 */
#ifndef QL_ENGINE_INTERNAL_H
#define QL_ENGINE_INTERNAL_H

#include <stdarg.h>
#include <stdio.h>

/* Format an error sentence into msg (if any) and return err. */
static inline int eng_fail(char *msg, size_t msg_len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline int eng_fail(char *msg, size_t msg_len, int err, const char *fmt, ...)
{
    if (msg && msg_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_len, fmt, ap);
        va_end(ap);
    }
    return err;
}

#endif

/*
 * ql_base.c - the error space's phrases and names, the message helper, the
 * clock and the UTF-8 checks (see ql_base.h).
 */
#include "ql_base.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

const char *ql_strerror(int err)
{
    switch (err) {
    case QL_OK: return "ok";
#define QL_ERRNO_PHRASE(name, value, phrase)                                                       \
    case QL_##name: return phrase;
        QL_ERRNO_MAP(QL_ERRNO_PHRASE)
#undef QL_ERRNO_PHRASE
    default: return "unknown error";
    }
}

const char *ql_err_name(int err)
{
    switch (err) {
    case QL_OK: return "OK";
#define QL_ERRNO_NAME(name, value, phrase)                                                         \
    case QL_##name: return #name;
        QL_ERRNO_MAP(QL_ERRNO_NAME)
#undef QL_ERRNO_NAME
    default: return "UNKNOWN";
    }
}

int ql_fail(char *msg, size_t msg_len, int err, const char *fmt, ...)
{
    if (msg && msg_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_len, fmt, ap);
        va_end(ap);
    }
    return err;
}

int64_t ql_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

double ql_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The length of the sequence a lead byte starts (1..4), or 0 for a byte
 * that cannot lead (a continuation byte, C0, C1, F5..FF). */
static size_t lead_length(uint8_t b)
{
    if (b < 0x80)
        return 1;
    if (b >= 0xC2 && b <= 0xDF)
        return 2;
    if (b >= 0xE0 && b <= 0xEF)
        return 3;
    if (b >= 0xF0 && b <= 0xF4)
        return 4;
    return 0;
}

/* Whether b may be byte k (1..3) of a sequence led by `lead`: the second
 * byte's narrower ranges exclude overlongs (E0, F0), surrogates (ED) and
 * code points past U+10FFFF (F4). */
static bool continuation_ok(uint8_t lead, size_t k, uint8_t b)
{
    if (b < 0x80 || b > 0xBF)
        return false;
    if (k == 1) {
        if (lead == 0xE0)
            return b >= 0xA0;
        if (lead == 0xED)
            return b <= 0x9F;
        if (lead == 0xF0)
            return b >= 0x90;
        if (lead == 0xF4)
            return b <= 0x8F;
    }
    return true;
}

size_t ql_utf8_next(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t b = s[0];
    size_t len = lead_length(b);
    if (len == 0 || len > n)
        return 0;
    for (size_t k = 1; k < len; k++)
        if (!continuation_ok(b, k, s[k]))
            return 0;
    uint32_t c = len == 1 ? b : len == 2 ? b & 0x1F : len == 3 ? b & 0x0F : b & 0x07;
    for (size_t k = 1; k < len; k++)
        c = c << 6 | (s[k] & 0x3F);
    *cp = c;
    return len;
}

size_t ql_utf8_chars(const uint8_t *p, size_t n)
{
    size_t chars = 0;
    for (size_t i = 0; i < n; i++)
        chars += (p[i] & 0xC0) != 0x80;
    return chars;
}

long ql_utf8_invalid_at(const uint8_t *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        size_t len = ql_utf8_next(p + i, n - i, &cp);
        if (len == 0)
            return (long)i;
        i += len;
    }
    return -1;
}

size_t ql_utf8_put(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | cp >> 6);
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | cp >> 12);
        out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | cp >> 18);
    out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

bool ql_list_next(const char **cursor, const char **entry, size_t *len)
{
    const char *at = *cursor;
    if (!at)
        return false;
    size_t n = strcspn(at, ",");
    const char *e = at, *end = at + n;
    while (e < end && *e == ' ')
        e++;
    while (end > e && end[-1] == ' ')
        end--;
    *entry = e;
    *len = (size_t)(end - e);
    *cursor = at[n] ? at + n + 1 : NULL;
    return true;
}

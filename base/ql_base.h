/*
 * ql_base.h - the public header of base/: what every module of qlserve
 * shares and nothing else.
 *
 * It offers:
 *   - the one error space: QL_ERRNO_MAP lists every code once, and gives
 *     the enum (QL_OK = 0, QL_E* < 0), ql_strerror (a short phrase) and
 *     ql_err_name ("EFORMAT"). Functions everywhere return QL_OK or a
 *     negative code and put the sentence naming the file, tensor, field or
 *     value into the caller's message buffer (ql_fail); the HTTP layer
 *     maps codes to statuses in one table (server/routes.c);
 *   - the monotonic clock (ql_now_s, ql_now_ns);
 *   - UTF-8 validation, decoding and encoding of one character
 *     (ql_utf8_next, ql_utf8_invalid_at, ql_utf8_put), the one definition
 *     of well-formed UTF-8 that the tokenizer, the chat templates and the
 *     request checks share.
 *
 * It owns nothing and touches nothing but its arguments: base/ depends on
 * libc alone, and every other folder may include it.
 */
#ifndef QL_BASE_H
#define QL_BASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * X(name, value, phrase): libuv's UV_ERRNO_MAP is the model. Values are
 * fixed so that a code logged or returned by one build reads the same in
 * another; add new codes at the end.
 */
#define QL_ERRNO_MAP(X)                                                                            \
    /* a parameter, shape or request that cannot be carried out as asked */                        \
    X(EINVAL, -1, "invalid argument")                                                              \
    X(ENOMEM, -2, "out of memory")                                                                 \
    /* a NaN or Inf where only finite values may be */                                             \
    X(ENONFINITE, -3, "non-finite value")                                                          \
    /* the operation does not apply to this kind, format or feature */                             \
    X(EUNSUPPORTED, -4, "unsupported")                                                             \
    /* no usable device, or the accelerator failed (a launch error, a fault) */                    \
    X(EDEVICE, -5, "device error")                                                                 \
    /* a file cannot be opened, read or written; a socket cannot listen */                         \
    X(EIO, -6, "input/output error")                                                               \
    /* a file is not what it claims: bad header, offsets, dtypes */                                \
    X(EFORMAT, -7, "malformed file")                                                               \
    /* a tensor, key, adapter or file that must be there is not */                                 \
    X(ENOTFOUND, -8, "not found")                                                                  \
    /* the queue is full: try again later */                                                       \
    X(EBUSY, -9, "busy")                                                                           \
    /* the state forbids it now (unloading a merged adapter) */                                    \
    X(ECONFLICT, -10, "conflict")                                                                  \
    /* the command line or configuration is wrong */                                               \
    X(EUSAGE, -11, "usage error")                                                                  \
    /* not a failure: --help was asked for, and printed */                                         \
    X(EHELP, -12, "help was asked for")

enum {
    QL_OK = 0,
#define QL_ERRNO_ENUM(name, value, phrase) QL_##name = (value),
    QL_ERRNO_MAP(QL_ERRNO_ENUM)
#undef QL_ERRNO_ENUM
};

/* "invalid argument", "malformed file", ...; "ok" for QL_OK and "unknown
 * error" for a value not in the map. Static strings. */
const char *ql_strerror(int err);
/* "EINVAL", "EFORMAT", ...; "OK" and "UNKNOWN" likewise. */
const char *ql_err_name(int err);

/* Write the printf-style sentence into msg (when msg and msg_len are set,
 * truncated to fit) and return err, so a failure reads
 * `return ql_fail(msg, msg_len, QL_EFORMAT, "%s: ...", path);`. */
int ql_fail(char *msg, size_t msg_len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* MurmurHash3's 64-bit finalizer: every bit of x reaches every bit of
 * the result, so its low bits can pick a hash table's slot. */
static inline uint64_t ql_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

/* splitmix64 (Steele, Lea & Flood 2014): the next draw of the stream
 * whose state is *x (advanced). */
static inline uint64_t ql_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* 64-bit FNV-1a of p[0..n): cheap, but its low bits are weak alone
 * (ql_mix64 it for a hash table's slot). */
static inline uint64_t ql_fnv1a(const void *p, size_t n)
{
    const uint8_t *s = (const uint8_t *)p; /* C++ (nvcc) includes this too */
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 0x100000001b3ULL;
    return h;
}

/* CLOCK_MONOTONIC in seconds and in nanoseconds: for durations only. */
double ql_now_s(void);
int64_t ql_now_ns(void);

/*
 * The well-formed UTF-8 character at s[0..n) (n >= 1), as Unicode's table
 * of well-formed sequences defines it (no overlong forms, no surrogates,
 * nothing past U+10FFFF): its byte length (1..4) with *cp its code point,
 * or 0 when s does not start one (*cp untouched).
 */
size_t ql_utf8_next(const uint8_t *s, size_t n, uint32_t *cp);
/* The offset of the first byte of p[0..n) that is not part of well-formed
 * UTF-8, or -1 when all of it is. */
long ql_utf8_invalid_at(const uint8_t *p, size_t n);
/* Encode code point cp (at most U+10FFFF) as UTF-8 at out (room for 4
 * bytes); its length, 1..4. */
size_t ql_utf8_put(uint32_t cp, uint8_t *out);
/* The characters of well-formed UTF-8 p[0..n): its bytes that are not
 * continuation bytes. */
size_t ql_utf8_chars(const uint8_t *p, size_t n);

/* The next entry of a comma-separated list (a flag such as
 * --cors-allow-origin): *entry and *len the entry at *cursor, spaces
 * around it trimmed (an empty one too, as between two commas), and
 * *cursor moved past it (NULL after the last); false when *cursor is NULL,
 * the list done. Start with *cursor the list (NULL: no entries). */
bool ql_list_next(const char **cursor, const char **entry, size_t *len);

#ifdef __cplusplus
}
#endif

#endif

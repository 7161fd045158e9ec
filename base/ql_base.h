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
 *   - the words a user types for a choice (--device, --kv-dtype, --into,
 *     --adapter-dtype, --activations): one table per choice (ql_names.c), parsed by
 *     ql_name_parse and printed by ql_name_of, which config checks flags
 *     with and the engine, the adapters, the CLI and the server parse the
 *     same words with; and QL_KV_MIB_DEFAULT, the KV cache's default size.
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

/* --- the words a user types for a choice (ql_names.c) ------------------- */

/* Where a forward step runs (--device): the engine's eng_device takes its
 * values from these. cpu is the zero value, so options built by hand stay
 * on the CPU; auto: cuda when this build has it and a device is present. */
typedef enum ql_device { QL_DEVICE_CPU = 0, QL_DEVICE_CUDA, QL_DEVICE_AUTO } ql_device;
/* What the KV cache stores values as (--kv-dtype): the engine maps each to
 * its quant kind (eng_kv_dtype_parse). */
typedef enum ql_kv_dtype { QL_KV_DTYPE_F32 = 0, QL_KV_DTYPE_F16, QL_KV_DTYPE_Q8_0 } ql_kv_dtype;
/* What merged modules are stored in (--into, the admin API's and the
 * journal's "into"): the weight's own kind (the flag or field absent), int8
 * (affine, per channel) or bf16. adapters/ maps each to its quant kind
 * (lora_into_kind). */
typedef enum ql_into { QL_INTO_OWN = 0, QL_INTO_INT8, QL_INTO_BF16 } ql_into;
/* What unmerged adapters keep A and B in (--adapter-dtype): adapters/'
 * lora_dtype takes its values from these. */
typedef enum ql_adapter_dtype { QL_ADAPTER_DTYPE_F32 = 0, QL_ADAPTER_DTYPE_BF16 } ql_adapter_dtype;
/* What the CPU's K-quant products multiply their weights by (--activations):
 * f32 activations, or activations quantized to int8 per block (llama.cpp's
 * arithmetic). The server and the CLI map each to kernels/' ql_activations
 * (QL_ACTIVATIONS_F32, QL_ACTIVATIONS_Q8). */
typedef enum ql_activations { QL_ACTIVATIONS_F32 = 0, QL_ACTIVATIONS_Q8 } ql_activations;
/* Which drafter speculative decoding uses (--speculative): off (the zero
 * value), n-gram lookup in the prompt and answer, a draft model, a model's
 * own MTP layers. The engine's eng_speculative takes its values from
 * these. */
typedef enum ql_speculative {
    QL_SPEC_OFF = 0,
    QL_SPEC_NGRAM,
    QL_SPEC_DRAFT,
    QL_SPEC_MTP
} ql_speculative;

/* One word and the value of the enum above it stands for. */
typedef struct ql_name {
    const char *word;
    int value;
} ql_name;

/* A choice's words, in the order messages list them. */
typedef struct ql_names {
    const ql_name *rows;
    size_t n;
} ql_names;

/* The tables: cpu, cuda, auto; f32, f16, q8_0; int8, bf16 (QL_INTO_OWN has
 * no word: it is the flag left out); bf16, f32; f32, q8; off, ngram, draft,
 * mtp. Static. */
extern const ql_names ql_device_names, ql_kv_dtype_names, ql_into_names, ql_adapter_dtype_names,
    ql_activations_names, ql_speculative_names;

/* The value word stands for in t, or -1 (word NULL too). */
int ql_name_parse(const ql_names *t, const char *word);
/* The word for value in t (static), or NULL when none has it. */
const char *ql_name_of(const ql_names *t, int value);
/* t's words as messages list them, "cpu, cuda, auto", into out (cut to
 * fit); out. */
const char *ql_name_list(const ql_names *t, char *out, size_t out_len);
/* The value word stands for in t; else QL_EINVAL with 'what "word": one of
 * ...' in msg (what: the choice as the message names it, "device"). */
int ql_name_expect(const ql_names *t, const char *what, const char *word, char *msg,
                   size_t msg_len);

/* The KV cache's size when none is given, in MiB: serve's --kv-mib
 * default, and the engine's when its options leave it 0 (generate). */
#define QL_KV_MIB_DEFAULT 256

#ifdef __cplusplus
}
#endif

#endif

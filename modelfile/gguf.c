/*
 * gguf.c - read GGUF v2/v3, llama.cpp's model file:
 *
 *   "GGUF"  u32 version  u64 n_tensors  u64 n_kv
 *   n_kv x     { string key, u32 value type, value }
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset }
 *   padding to the alignment (general.alignment, default 32)
 *   the data section: each tensor at its offset, a multiple of the alignment
 *
 * Strings are a u64 length and that many bytes (no NUL); every number is
 * little-endian (the format spec, ggml/docs/gguf.md; big-endian files exist
 * but are refused here). Version 1 used u32 counts and lengths and is
 * refused by its number.
 *
 * Reading maps the file and checks every count, length and offset against
 * the bytes that are actually there before a pointer into the mapping is
 * handed out, since a model file is untrusted input: a truncated download or
 * a hostile header must give a message that names the file, the key or the
 * tensor, never a read past the end or an allocation of a terabyte.
 *
 * Where llama.cpp's two readers differ, this one follows the one that loads
 * models (llama-model-loader, which maps the file): a tensor must lie inside
 * the file, but the padding after the last tensor may be missing. Tensors
 * must not overlap; unlike ggml's gguf.cpp they need not be packed in the
 * order of their infos.
 *
 * What the reader hands out (modelfile.h's gguf_kv and gguf_tensor), beyond
 * what the header says:
 *   - a numeric scalar's value in f as a double, whatever its type (an
 *     integer too, so a loader can take rope_freq_base written as either);
 *     integers in i and u where the value fits (the other is 0); a bool's
 *     byte must be 0 or 1 and is in i, u and f;
 *   - a numeric array's elements at data, inside the mapping and not
 *     necessarily aligned for their type (memcpy them); a string array's
 *     data is NULL. Arrays of arrays are refused: no model file uses them;
 *   - keys and tensor names holding a NUL byte are refused (they would
 *     compare equal to a different name);
 *   - a tensor's ne[] past n_dims are 1, and each dimension is at least 1.
 *
 * It offers gguf_open/gguf_close, the lookups (gguf_find_kv,
 * gguf_find_tensor), GGML type names and geometry, and gguf_tensor_qtensor
 * (modelfile.h). It owns the mapping and the key and name copies gguf_open
 * makes, until gguf_close; everything it hands out borrows from them. It
 * touches only the file it is given. The product's writer is gguf_write.c
 * (`qlserve quantize` to a GGUF kind); the tests' is tests/gguf_writer.c.
 */
#include "modelfile.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS          4 /* ggml's GGML_MAX_DIMS */

/* The fewest bytes one entry can take, to bound counts before allocating:
 * a key/value is an empty key (8), a type (4) and a 1-byte value; a tensor
 * info an empty name (8), n_dims (4), one ne (8), the type (4), the offset (8). */
#define GGUF_MIN_KV_BYTES          13u
#define GGUF_MIN_TENSOR_INFO_BYTES 32u

/* --- GGML tensor types --------------------------------------------------- */

typedef struct ggml_type_info {
    const char *name;    /* lowercase, as qlserve prints it */
    uint32_t block_size; /* elements per block; 0: removed from ggml, no size */
    uint32_t type_size;  /* bytes per block */
} ggml_type_info;

/*
 * Block geometry of every GGML tensor type, from llama.cpp's
 * ggml/src/ggml.c type_traits[] (.blck_size, .type_size = sizeof(block_*))
 * with the block structs of ggml/src/ggml-common.h (QK_K = 256), as of
 * ggml-org/llama.cpp 00bdaa10. gguf-py 0.19's GGML_QUANT_SIZES agrees
 * except for q8_1, where it still has the old 40-byte block (two f32);
 * ggml's block_q8_1 is two halves and 32 codes, 36 bytes. ggml names the
 * k-quants "q4_K"; we print them lowercase. Numbers ggml removed (4, 5: q4_2,
 * q4_3; 31-33: the q4_0 repacks; 36-38: the iq4_nl repacks) keep their names
 * for messages but have no size, so a tensor of such a type is refused.
 */
static const ggml_type_info ggml_types[] = {
    [0] = {"f32", 1, 4},         [1] = {"f16", 1, 2},         [2] = {"q4_0", 32, 18},
    [3] = {"q4_1", 32, 20},      [4] = {"q4_2", 0, 0},        [5] = {"q4_3", 0, 0},
    [6] = {"q5_0", 32, 22},      [7] = {"q5_1", 32, 24},      [8] = {"q8_0", 32, 34},
    [9] = {"q8_1", 32, 36},      [10] = {"q2_k", 256, 84},    [11] = {"q3_k", 256, 110},
    [12] = {"q4_k", 256, 144},   [13] = {"q5_k", 256, 176},   [14] = {"q6_k", 256, 210},
    [15] = {"q8_k", 256, 292},   [16] = {"iq2_xxs", 256, 66}, [17] = {"iq2_xs", 256, 74},
    [18] = {"iq3_xxs", 256, 98}, [19] = {"iq1_s", 256, 50},   [20] = {"iq4_nl", 32, 18},
    [21] = {"iq3_s", 256, 110},  [22] = {"iq2_s", 256, 82},   [23] = {"iq4_xs", 256, 136},
    [24] = {"i8", 1, 1},         [25] = {"i16", 1, 2},        [26] = {"i32", 1, 4},
    [27] = {"i64", 1, 8},        [28] = {"f64", 1, 8},        [29] = {"iq1_m", 256, 56},
    [30] = {"bf16", 1, 2},       [31] = {"q4_0_4_4", 0, 0},   [32] = {"q4_0_4_8", 0, 0},
    [33] = {"q4_0_8_8", 0, 0},   [34] = {"tq1_0", 256, 54},   [35] = {"tq2_0", 256, 66},
    [36] = {"iq4_nl_4_4", 0, 0}, [37] = {"iq4_nl_4_8", 0, 0}, [38] = {"iq4_nl_8_8", 0, 0},
    [39] = {"mxfp4", 32, 17},    [40] = {"nvfp4", 64, 36},    [41] = {"q1_0", 128, 18},
};

#define GGML_TYPE_TABLE_LEN (sizeof ggml_types / sizeof *ggml_types)

static const ggml_type_info *ggml_type_of(uint32_t type)
{
    return type < GGML_TYPE_TABLE_LEN ? &ggml_types[type] : NULL;
}

bool gguf_ggml_type_geometry(uint32_t ggml_type, uint32_t *block_size, uint32_t *type_size)
{
    const ggml_type_info *ti = ggml_type_of(ggml_type);
    if (!ti || ti->block_size == 0)
        return false;
    *block_size = ti->block_size;
    *type_size = ti->type_size;
    return true;
}

const char *gguf_ggml_type_name(uint32_t ggml_type)
{
    const ggml_type_info *ti = ggml_type_of(ggml_type);
    if (ti)
        return ti->name;
    /* one buffer per thread, so the name lives until this thread asks again */
    static _Thread_local char unknown[24];
    snprintf(unknown, sizeof unknown, "type %u", ggml_type);
    return unknown;
}

/* The qt kind a GGML type is read as in place, or -1. */
static int qt_kind_of_ggml(uint32_t type)
{
    switch (type) {
    case GGML_TYPE_F32: return QT_F32;
    case GGML_TYPE_F16: return QT_F16;
    case GGML_TYPE_BF16: return QT_BF16;
    case GGML_TYPE_Q4_0: return QT_Q4_0;
    case GGML_TYPE_Q4_1: return QT_Q4_1;
    case GGML_TYPE_Q8_0: return QT_Q8_0;
    case GGML_TYPE_Q5_0: return QT_Q5_0;
    case GGML_TYPE_Q5_1: return QT_Q5_1;
    case GGML_TYPE_Q4_K: return QT_Q4_K;
    case GGML_TYPE_Q5_K: return QT_Q5_K;
    case GGML_TYPE_Q6_K: return QT_Q6_K;
    case GGML_TYPE_Q2_K: return QT_Q2_K;
    case GGML_TYPE_Q3_K: return QT_Q3_K;
    case GGML_TYPE_IQ4_NL: return QT_IQ4_NL;
    case GGML_TYPE_IQ4_XS: return QT_IQ4_XS;
    case GGML_TYPE_MXFP4: return QT_MXFP4;
    default: return -1;
    }
}

/* --- metadata value types ------------------------------------------------ */

static const char *const value_type_names[GGUF_TYPE_COUNT] = {
    [GGUF_UINT8] = "uint8",     [GGUF_INT8] = "int8",     [GGUF_UINT16] = "uint16",
    [GGUF_INT16] = "int16",     [GGUF_UINT32] = "uint32", [GGUF_INT32] = "int32",
    [GGUF_FLOAT32] = "float32", [GGUF_BOOL] = "bool",     [GGUF_STRING] = "string",
    [GGUF_ARRAY] = "array",     [GGUF_UINT64] = "uint64", [GGUF_INT64] = "int64",
    [GGUF_FLOAT64] = "float64",
};

size_t gguf_value_size(gguf_type t)
{
    switch (t) {
    case GGUF_UINT8:
    case GGUF_INT8:
    case GGUF_BOOL: return 1;
    case GGUF_UINT16:
    case GGUF_INT16: return 2;
    case GGUF_UINT32:
    case GGUF_INT32:
    case GGUF_FLOAT32: return 4;
    case GGUF_UINT64:
    case GGUF_INT64:
    case GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static uint64_t le_u64(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;)
        v = (v << 8) | p[i];
    return v;
}

/* --- reading ------------------------------------------------------------- */

/* A cursor over the mapping; every take is checked against the end. */
typedef struct cursor {
    const uint8_t *map;
    size_t len, pos;
} cursor;

static size_t left(const cursor *c)
{
    return c->len - c->pos;
}

/* n bytes at the cursor, or NULL when fewer are left. */
static const uint8_t *take(cursor *c, uint64_t n)
{
    if (n > left(c))
        return NULL;
    const uint8_t *p = c->map + c->pos;
    c->pos += (size_t)n;
    return p;
}

static bool take_u32(cursor *c, uint32_t *v)
{
    const uint8_t *p = take(c, 4);
    if (p)
        *v = (uint32_t)le_u64(p, 4);
    return p != NULL;
}

static bool take_u64(cursor *c, uint64_t *v)
{
    const uint8_t *p = take(c, 8);
    if (p)
        *v = le_u64(p, 8);
    return p != NULL;
}

/* How reading a string went. */
typedef enum str_status { STR_OK, STR_NO_LENGTH, STR_PAST_END } str_status;

/* A string: a u64 length, then that many bytes. */
static str_status take_str(cursor *c, gguf_str *s)
{
    s->ptr = NULL;
    s->len = 0;
    if (!take_u64(c, &s->len))
        return STR_NO_LENGTH;
    const uint8_t *p = take(c, s->len);
    s->ptr = (const char *)p;
    return p ? STR_OK : STR_PAST_END;
}

/* The message for a string that did not fit; what names it. */
static int string_past_end(const gguf_file *f, str_status st, const gguf_str *s, const char *what,
                           char *msg, size_t msg_len)
{
    if (st == STR_NO_LENGTH)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s: the file ends at byte %zu before the string's length "
                       "(truncated?)",
                       f->path, what, f->map_len);
    return ql_fail(msg, msg_len, QL_EFORMAT,
                   "%s: %s: string length %llu runs past the end of the %zu-byte file "
                   "(truncated?)",
                   f->path, what, (unsigned long long)s->len, f->map_len);
}

/* A NUL-terminated copy of a name from the file; NULL (with msg) when it
 * holds a NUL byte, which would make two different names look alike. */
static char *copy_name(const gguf_file *f, const gguf_str *s, const char *what, int *rc, char *msg,
                       size_t msg_len)
{
    if (memchr(s->ptr, 0, (size_t)s->len)) {
        *rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s '%.*s' contains a NUL byte", f->path, what,
                      (int)strnlen(s->ptr, (size_t)s->len), s->ptr);
        return NULL;
    }
    char *name = malloc((size_t)s->len + 1);
    if (!name) {
        *rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
        return NULL;
    }
    memcpy(name, s->ptr, (size_t)s->len);
    name[s->len] = '\0';
    return name;
}

/* Convert a scalar of a fixed-size type at p into kv's i/u/f. */
static int set_scalar(const gguf_file *f, gguf_kv *kv, const uint8_t *p, char *msg, size_t msg_len)
{
    uint64_t raw = le_u64(p, gguf_value_size(kv->type));
    switch (kv->type) {
    case GGUF_BOOL:
        if (raw > 1)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: metadata '%s': bool value %llu is neither 0 nor 1", f->path,
                           kv->key, (unsigned long long)raw);
        kv->u = raw;
        kv->i = (int64_t)raw;
        kv->f = (double)raw;
        break;
    case GGUF_UINT8:
    case GGUF_UINT16:
    case GGUF_UINT32:
    case GGUF_UINT64:
        kv->u = raw;
        kv->i = raw <= INT64_MAX ? (int64_t)raw : 0;
        kv->f = (double)raw;
        break;
    case GGUF_INT8:
    case GGUF_INT16:
    case GGUF_INT32:
    case GGUF_INT64: {
        /* sign-extend from the value's width */
        unsigned shift = 64 - 8 * (unsigned)gguf_value_size(kv->type);
        kv->i = (int64_t)(raw << shift) >> shift;
        kv->u = kv->i >= 0 ? (uint64_t)kv->i : 0;
        kv->f = (double)kv->i;
        break;
    }
    case GGUF_FLOAT32: {
        uint32_t bits = (uint32_t)raw;
        float v;
        memcpy(&v, &bits, sizeof v);
        kv->f = v;
        break;
    }
    case GGUF_FLOAT64: memcpy(&kv->f, &raw, sizeof kv->f); break;
    default: break;
    }
    return QL_OK;
}

/* Read one value of type kv->type (the type field already read). */
static int parse_value(gguf_file *f, cursor *c, gguf_kv *kv, char *msg, size_t msg_len)
{
    char what[160];
    snprintf(what, sizeof what, "metadata '%s'", kv->key);
    if (kv->type == GGUF_STRING) {
        kv->elem = GGUF_STRING;
        kv->n = 1;
        str_status st = take_str(c, &kv->str);
        if (st != STR_OK)
            return string_past_end(f, st, &kv->str, what, msg, msg_len);
        return QL_OK;
    }
    if (kv->type != GGUF_ARRAY) {
        kv->elem = kv->type;
        kv->n = 1;
        const uint8_t *p = take(c, gguf_value_size(kv->type));
        if (!p)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: %s: the %s value runs past the end of the %zu-byte file "
                           "(truncated?)",
                           f->path, what, value_type_names[kv->type], f->map_len);
        return set_scalar(f, kv, p, msg, msg_len);
    }

    uint32_t elem;
    uint64_t n;
    if (!take_u32(c, &elem) || !take_u64(c, &n))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s: the file ends inside the array's type and length (truncated?)",
                       f->path, what);
    if (elem >= GGUF_TYPE_COUNT)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s: array element type %u is not a GGUF value type (0..12)", f->path,
                       what, elem);
    if (elem == GGUF_ARRAY)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s: arrays of arrays are not supported (no model file uses them)",
                       f->path, what);
    kv->elem = (gguf_type)elem;
    kv->n = n;
    if (elem != GGUF_STRING) {
        size_t sz = gguf_value_size(kv->elem);
        if (n > left(c) / sz)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: %s: an array of %llu %s values runs past the end of the "
                           "%zu-byte file (truncated?)",
                           f->path, what, (unsigned long long)n, value_type_names[elem],
                           f->map_len);
        kv->data = take(c, n * sz);
        return QL_OK;
    }
    /* each string takes at least its 8-byte length: bound n before allocating */
    if (n > left(c) / 8)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s: an array of %llu strings cannot fit in the %zu bytes left in "
                       "the file (truncated?)",
                       f->path, what, (unsigned long long)n, left(c));
    kv->strs = calloc(n ? (size_t)n : 1, sizeof *kv->strs);
    if (!kv->strs)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: %s: out of memory for %llu strings", f->path,
                       what, (unsigned long long)n);
    for (uint64_t j = 0; j < n; j++) {
        str_status st = take_str(c, &kv->strs[j]);
        if (st != STR_OK) {
            snprintf(what, sizeof what, "metadata '%s', string %llu of %llu", kv->key,
                     (unsigned long long)j, (unsigned long long)n);
            return string_past_end(f, st, &kv->strs[j], what, msg, msg_len);
        }
    }
    return QL_OK;
}

static int parse_kv(gguf_file *f, cursor *c, uint64_t index, gguf_kv *kv, char *msg, size_t msg_len)
{
    char what[64];
    snprintf(what, sizeof what, "metadata entry %llu's key", (unsigned long long)index);
    gguf_str key;
    str_status st = take_str(c, &key);
    if (st != STR_OK)
        return string_past_end(f, st, &key, what, msg, msg_len);
    int rc = QL_OK;
    kv->key = copy_name(f, &key, "metadata key", &rc, msg, msg_len);
    if (!kv->key)
        return rc;
    uint32_t type;
    if (!take_u32(c, &type))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: metadata '%s': the file ends before its value type (truncated?)",
                       f->path, kv->key);
    if (type >= GGUF_TYPE_COUNT)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: metadata '%s': value type %u is not a GGUF value type (0..12)", f->path,
                       kv->key, type);
    kv->type = (gguf_type)type;
    return parse_value(f, c, kv, msg, msg_len);
}

static int cmp_kv_key(const void *a, const void *b)
{
    const gguf_kv *x = *(const gguf_kv *const *)a, *y = *(const gguf_kv *const *)b;
    return strcmp(x->key, y->key);
}

static int cmp_tensor_name(const void *a, const void *b)
{
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_offset(const void *a, const void *b)
{
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : (x->nbytes > y->nbytes);
}

/* No key twice: sort pointers by key, compare neighbours. */
static int check_duplicate_keys(const gguf_file *f, char *msg, size_t msg_len)
{
    if (f->n_kv < 2)
        return QL_OK;
    const gguf_kv **by_key = malloc((size_t)f->n_kv * sizeof *by_key);
    if (!by_key)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    for (uint64_t i = 0; i < f->n_kv; i++)
        by_key[i] = &f->kvs[i];
    qsort(by_key, (size_t)f->n_kv, sizeof *by_key, cmp_kv_key);
    int rc = QL_OK;
    for (uint64_t i = 1; i < f->n_kv && rc == QL_OK; i++)
        if (strcmp(by_key[i - 1]->key, by_key[i]->key) == 0)
            rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata key '%s' appears twice", f->path,
                         by_key[i]->key);
    free(by_key);
    return rc;
}

/* general.alignment: a u32 power of two when present, else 32. */
static int read_alignment(gguf_file *f, char *msg, size_t msg_len)
{
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *kv = gguf_find_kv(f, "general.alignment");
    if (!kv)
        return QL_OK;
    if (kv->type != GGUF_UINT32)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: metadata 'general.alignment' is a %s, not a uint32", f->path,
                       value_type_names[kv->type]);
    if (kv->u == 0 || (kv->u & (kv->u - 1)) != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: metadata 'general.alignment' = %llu is not a power of two", f->path,
                       (unsigned long long)kv->u);
    f->alignment = kv->u;
    return QL_OK;
}

/* One tensor info: name, dims, type; the byte count from the type's block
 * geometry. Offsets are checked later, once the data section is known. */
static int parse_tensor_info(gguf_file *f, cursor *c, uint64_t index, gguf_tensor *t, char *msg,
                             size_t msg_len)
{
    char what[64];
    snprintf(what, sizeof what, "tensor info %llu's name", (unsigned long long)index);
    gguf_str name;
    str_status st = take_str(c, &name);
    if (st != STR_OK)
        return string_past_end(f, st, &name, what, msg, msg_len);
    int rc = QL_OK;
    t->name = copy_name(f, &name, "tensor name", &rc, msg, msg_len);
    if (!t->name)
        return rc;
    uint32_t n_dims;
    if (!take_u32(c, &n_dims))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': the file ends before its dimension count (truncated?)",
                       f->path, t->name);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': %u dimensions; GGUF tensors have 1 to %d", f->path,
                       t->name, n_dims, GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    int64_t numel = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        if (d < t->n_dims && !take_u64(c, &ne))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s': the file ends inside its shape (truncated?)", f->path,
                           t->name);
        if (ne < 1 || ne > INT64_MAX)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s': ne[%d] = %llu is not a positive dimension", f->path,
                           t->name, d, (unsigned long long)ne);
        if (numel > INT64_MAX / (int64_t)ne)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s': the shape's element count overflows 64 bits", f->path,
                           t->name);
        t->ne[d] = (int64_t)ne;
        numel *= (int64_t)ne;
    }
    if (!take_u32(c, &t->ggml_type) || !take_u64(c, &t->offset))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': the file ends inside its type and offset (truncated?)",
                       f->path, t->name);
    const ggml_type_info *ti = ggml_type_of(t->ggml_type);
    if (!ti)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': GGML type %u is not one ggml defines (0..%zu)", f->path,
                       t->name, t->ggml_type, GGML_TYPE_TABLE_LEN - 1);
    if (ti->block_size == 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': GGML type %u (%s) was removed from ggml; its size is "
                       "not defined",
                       f->path, t->name, t->ggml_type, ti->name);
    if (t->ne[0] % ti->block_size != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': ne[0] = %lld is not a multiple of the %s block of %u",
                       f->path, t->name, (long long)t->ne[0], ti->name, ti->block_size);
    /* bytes = (ne0 / block) * type_size * ne1 * ne2 * ne3 */
    uint64_t bytes = (uint64_t)(t->ne[0] / ti->block_size);
    bool overflow = __builtin_mul_overflow(bytes, (uint64_t)ti->type_size, &bytes);
    for (int d = 1; d < GGUF_MAX_DIMS; d++)
        overflow = overflow || __builtin_mul_overflow(bytes, (uint64_t)t->ne[d], &bytes);
    if (overflow || bytes > SIZE_MAX)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s': its byte size overflows 64 bits",
                       f->path, t->name);
    t->nbytes = (size_t)bytes;
    return QL_OK;
}

/* Each tensor aligned, inside the data section, and no two overlapping. */
static int check_tensor_data(gguf_file *f, char *msg, size_t msg_len)
{
    size_t data_len = f->map_len - f->data_offset;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        if (t->offset % f->alignment != 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s': offset %llu is not a multiple of the alignment "
                           "%llu",
                           f->path, t->name, (unsigned long long)t->offset,
                           (unsigned long long)f->alignment);
        if (t->offset > data_len || t->nbytes > data_len - t->offset)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s': its %zu bytes at offset %llu run past the end of "
                           "the %zu-byte data section (truncated?)",
                           f->path, t->name, t->nbytes, (unsigned long long)t->offset, data_len);
        t->data = f->map + f->data_offset + t->offset;
    }
    if (f->n_tensors < 2)
        return QL_OK;
    gguf_tensor **sorted = malloc((size_t)f->n_tensors * sizeof *sorted);
    if (!sorted)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    for (uint64_t i = 0; i < f->n_tensors; i++)
        sorted[i] = &f->tensors[i];
    int rc = QL_OK;
    qsort(sorted, (size_t)f->n_tensors, sizeof *sorted, cmp_tensor_name);
    for (uint64_t i = 1; i < f->n_tensors && rc == QL_OK; i++)
        if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0)
            rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s' appears twice", f->path,
                         sorted[i]->name);
    if (rc == QL_OK) {
        /* kept for gguf_find_tensor's binary search: a loader looking up
         * each layer's tensors by name is then O(n log n), not O(n^2) */
        f->by_name = malloc((size_t)f->n_tensors * sizeof *f->by_name);
        if (!f->by_name)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
        else
            memcpy(f->by_name, sorted, (size_t)f->n_tensors * sizeof *f->by_name);
    }
    if (rc == QL_OK) {
        qsort(sorted, (size_t)f->n_tensors, sizeof *sorted, cmp_tensor_offset);
        for (uint64_t i = 1; i < f->n_tensors && rc == QL_OK; i++) {
            const gguf_tensor *a = sorted[i - 1], *b = sorted[i];
            if (a->offset + a->nbytes > b->offset)
                rc = ql_fail(msg, msg_len, QL_EFORMAT,
                             "%s: tensors '%s' (bytes %llu..%llu) and '%s' (from %llu) overlap",
                             f->path, a->name, (unsigned long long)a->offset,
                             (unsigned long long)(a->offset + a->nbytes), b->name,
                             (unsigned long long)b->offset);
        }
    }
    free(sorted);
    return rc;
}

static int parse_header(gguf_file *f, char *msg, size_t msg_len)
{
    cursor c = {.map = f->map, .len = f->map_len, .pos = 0};
    const uint8_t *magic = take(&c, 4);
    if (!magic || memcmp(magic, "GGUF", 4) != 0) {
        if (!magic)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: %zu bytes is too short for a GGUF header (truncated?)", f->path,
                           f->map_len);
        char shown[5];
        for (int i = 0; i < 4; i++)
            shown[i] = magic[i] >= 0x20 && magic[i] < 0x7f ? (char)magic[i] : '?';
        shown[4] = '\0';
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: not a GGUF file: bad magic '%s' (expected 'GGUF')", f->path, shown);
    }
    if (!take_u32(&c, &f->version))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %zu bytes is too short for a GGUF header (truncated?)", f->path,
                       f->map_len);
    if (f->version == 1)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: GGUF version 1 (32-bit counts) is not supported; convert the file "
                       "to version 3",
                       f->path);
    if (f->version != 2 && f->version != 3) {
        /* a big-endian file reads as version 0x0N000000 */
        if ((f->version & 0x00ffffffu) == 0 && (f->version >> 24) <= 3)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: a big-endian GGUF file (version %u); only little-endian files "
                           "are supported",
                           f->path, f->version >> 24);
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: GGUF version %u is not supported (only 2 and 3)", f->path, f->version);
    }
    if (!take_u64(&c, &f->n_tensors) || !take_u64(&c, &f->n_kv)) {
        f->n_tensors = f->n_kv = 0;
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %zu bytes is too short for a GGUF header (truncated?)", f->path,
                       f->map_len);
    }
    /* counts are untrusted: bound them by the bytes that could hold them
     * before allocating anything */
    uint64_t n_kv = f->n_kv, n_tensors = f->n_tensors;
    f->n_kv = f->n_tensors = 0; /* from here on: how many are parsed */
    if (n_kv > left(&c) / GGUF_MIN_KV_BYTES)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the header claims %llu metadata entries, more than the %zu bytes "
                       "after it can hold (corrupt or truncated)",
                       f->path, (unsigned long long)n_kv, left(&c));
    if (n_tensors > left(&c) / GGUF_MIN_TENSOR_INFO_BYTES)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the header claims %llu tensors, more than the %zu bytes after it "
                       "can hold (corrupt or truncated)",
                       f->path, (unsigned long long)n_tensors, left(&c));

    f->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof *f->kvs);
    if (!f->kvs)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    for (uint64_t i = 0; i < n_kv; i++) {
        f->n_kv = i + 1; /* so gguf_close frees what this entry allocated */
        int rc = parse_kv(f, &c, i, &f->kvs[i], msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    int rc = check_duplicate_keys(f, msg, msg_len);
    if (rc == QL_OK)
        rc = read_alignment(f, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    if (n_tensors > left(&c) / GGUF_MIN_TENSOR_INFO_BYTES)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the header claims %llu tensors, more than the %zu bytes after the "
                       "metadata can hold (corrupt or truncated)",
                       f->path, (unsigned long long)n_tensors, left(&c));
    f->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *f->tensors);
    if (!f->tensors)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    for (uint64_t i = 0; i < n_tensors; i++) {
        f->n_tensors = i + 1;
        rc = parse_tensor_info(f, &c, i, &f->tensors[i], msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }

    /* the data section starts at the next multiple of the alignment; with
     * no tensors the file may end before it */
    uint64_t start = ((uint64_t)c.pos + f->alignment - 1) / f->alignment * f->alignment;
    if (start > f->map_len) {
        if (f->n_tensors > 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: the file ends at byte %zu, before its data section at byte "
                           "%llu (truncated?)",
                           f->path, f->map_len, (unsigned long long)start);
        start = f->map_len;
    }
    f->data_offset = (size_t)start;
    return check_tensor_data(f, msg, msg_len);
}

int gguf_open(gguf_file *f, const char *path, char *msg, size_t msg_len)
{
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    int rc = mf_map_file(path, 4, "GGUF", &f->map, &f->map_len, msg, msg_len);
    if (rc != QL_OK) {
        gguf_close(f);
        return rc;
    }
    rc = parse_header(f, msg, msg_len);
    if (rc != QL_OK)
        gguf_close(f);
    return rc;
}

void gguf_close(gguf_file *f)
{
    if (f->map)
        mf_unmap_file(f->map, f->map_len);
    for (uint64_t i = 0; f->kvs && i < f->n_kv; i++) {
        free(f->kvs[i].key);
        free(f->kvs[i].strs);
    }
    free(f->kvs);
    for (uint64_t i = 0; f->tensors && i < f->n_tensors; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    free(f->by_name);
    free(f->path);
    memset(f, 0, sizeof *f);
}

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key)
{
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (f->kvs[i].key && strcmp(f->kvs[i].key, key) == 0)
            return &f->kvs[i];
    return NULL;
}

static int cmp_name_key(const void *name, const void *elem)
{
    return strcmp(name, (*(const gguf_tensor *const *)elem)->name);
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (f->by_name) {
        gguf_tensor *const *hit =
            bsearch(name, f->by_name, (size_t)f->n_tensors, sizeof *f->by_name, cmp_name_key);
        return hit ? *hit : NULL;
    }
    /* fewer than two tensors: no index was built */
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].name && strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    return NULL;
}

int gguf_tensor_qtensor(const gguf_file *f, const gguf_tensor *t, qtensor *out, char *msg,
                        size_t msg_len)
{
    memset(out, 0, sizeof *out);
    int kind = qt_kind_of_ggml(t->ggml_type);
    if (kind < 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: tensor '%s' has GGML type %s, which qlserve cannot run (it runs "
                       "f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, "
                       "q6_k, iq4_nl, iq4_xs and mxfp4)",
                       f->path, t->name, gguf_ggml_type_name(t->ggml_type));
    /* the tensor must be one of f's, as gguf_open checked it */
    if (!t->data || t->data < f->map || t->nbytes > f->map_len ||
        (size_t)(t->data - f->map) > f->map_len - t->nbytes)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s' does not lie in this file",
                       f->path, t->name);
    const qt_traits *tr = &qt_traits_table[kind];
    const ggml_type_info *gi = ggml_type_of(t->ggml_type);
    int64_t cols = t->ne[0], rows = 1;
    for (int d = 1; d < t->n_dims; d++)
        rows *= t->ne[d];
    if (tr->is_dense) {
        /* the dense kernels load whole elements; only general.alignment of
         * 1 or 2 can leave one off its natural boundary */
        if ((uintptr_t)t->data % gi->type_size != 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s' (%s) starts at byte %zu, not on a %u-byte "
                           "boundary, and cannot be read in place",
                           f->path, t->name, gi->name, (size_t)(t->data - f->map), gi->type_size);
    } else if ((size_t)gi->type_size != tr->block_bytes ||
               gi->block_size != (uint32_t)tr->block_size || cols % tr->block_size != 0) {
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: tensor '%s': GGML %s blocks (%u elements, %u bytes) do not match "
                       "qlserve's %s",
                       f->path, t->name, gi->name, gi->block_size, gi->type_size, tr->name);
    }
    out->kind = (qt_kind)kind;
    out->rows = rows;
    out->cols = cols;
    /* read-only mapping: the kernels only read a qtensor's data */
    out->data = (uint8_t *)(uintptr_t)t->data;
    out->data_bytes = t->nbytes;
    out->data_borrowed = true;
    if (!tr->is_dense)
        out->row_stride = (size_t)(cols / tr->block_size) * tr->block_bytes;
    return QL_OK;
}

/*
 * gguf_writer.c - the tests' GGUF writer (gguf_writer.h): everything is
 * built in memory and written as version 3 through a temporary file and a
 * rename, as gguf-py and ggml lay it out (every tensor, the last one
 * included, padded to the alignment).
 */
#include "gguf_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS          4 /* ggml's GGML_MAX_DIMS */

/* --- writing ------------------------------------------------------------- */

/* A growable byte buffer. */
typedef struct bytes {
    uint8_t *p;
    size_t len, cap;
    bool failed;
} bytes;

static void put(bytes *b, const void *src, size_t n)
{
    if (b->failed || n == 0)
        return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->failed = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put_le(bytes *b, uint64_t v, size_t n)
{
    uint8_t le[8];
    for (size_t i = 0; i < n; i++)
        le[i] = (uint8_t)(v >> (8 * i));
    put(b, le, n);
}

static void put_str(bytes *b, const char *s, size_t n)
{
    put_le(b, n, 8);
    put(b, s, n);
}

typedef struct gguf_wkv {
    char *key;
    gguf_type type;
    bytes value;  /* serialized as the file holds it, after the type field */
    uint32_t u32; /* the value, when type is GGUF_UINT32 (for general.alignment) */
} gguf_wkv;

typedef struct gguf_wtensor {
    char *name;
    uint32_t ggml_type;
    int n_dims;
    int64_t ne[4];
    uint8_t *data;
    size_t nbytes;
} gguf_wtensor;

struct gguf_writer {
    gguf_wkv *kvs;
    size_t n_kv, cap_kv;
    gguf_wtensor *tensors;
    size_t n_tensors, cap_tensors;
};

gguf_writer *gguf_writer_new(void)
{
    return calloc(1, sizeof(gguf_writer));
}

void gguf_writer_free(gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].value.p);
    }
    free(w->kvs);
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w);
}

/* Store a serialized value under key, replacing an earlier one (the key
 * keeps its first position). Takes value's buffer in every case. */
static int set_kv(gguf_writer *w, const char *key, gguf_type type, bytes *value, uint32_t u32)
{
    if (!w || !key || value->failed) {
        free(value->p);
        return value->failed ? QL_ENOMEM : QL_EINVAL;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].value.p);
            w->kvs[i].type = type;
            w->kvs[i].value = *value;
            w->kvs[i].u32 = u32;
            return QL_OK;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        gguf_wkv *kvs = realloc(w->kvs, cap * sizeof *kvs);
        if (!kvs) {
            free(value->p);
            return QL_ENOMEM;
        }
        w->kvs = kvs;
        w->cap_kv = cap;
    }
    char *copy = strdup(key);
    if (!copy) {
        free(value->p);
        return QL_ENOMEM;
    }
    w->kvs[w->n_kv++] = (gguf_wkv){.key = copy, .type = type, .value = *value, .u32 = u32};
    return QL_OK;
}

static int set_scalar_bits(gguf_writer *w, const char *key, gguf_type type, uint64_t bits)
{
    bytes b = {0};
    put_le(&b, bits, gguf_value_size(type));
    return set_kv(w, key, type, &b, (uint32_t)bits);
}

int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v)
{
    return set_scalar_bits(w, key, GGUF_UINT32, v);
}

int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v)
{
    return set_scalar_bits(w, key, GGUF_INT32, (uint32_t)v);
}

int gguf_writer_set_f32(gguf_writer *w, const char *key, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return set_scalar_bits(w, key, GGUF_FLOAT32, bits);
}

int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v)
{
    return set_scalar_bits(w, key, GGUF_BOOL, v ? 1 : 0);
}

int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v)
{
    if (!v)
        return QL_EINVAL;
    bytes b = {0};
    put_str(&b, v, strlen(v));
    return set_kv(w, key, GGUF_STRING, &b, 0);
}

int gguf_writer_set_array(gguf_writer *w, const char *key, gguf_type elem, const void *data,
                          uint64_t n)
{
    size_t sz = (unsigned)elem < GGUF_TYPE_COUNT ? gguf_value_size(elem) : 0;
    if (sz == 0 || (n && !data) || n > SIZE_MAX / sz)
        return QL_EINVAL; /* strings go through gguf_writer_set_str_array */
    bytes b = {0};
    put_le(&b, (uint64_t)elem, 4);
    put_le(&b, n, 8);
    /* the caller's elements are host order; the file is little-endian */
    const uint8_t *src = data;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t v = 0;
        switch (sz) {
        case 1: v = src[i]; break;
        case 2: {
            uint16_t x;
            memcpy(&x, src + i * 2, 2);
            v = x;
            break;
        }
        case 4: {
            uint32_t x;
            memcpy(&x, src + i * 4, 4);
            v = x;
            break;
        }
        default: memcpy(&v, src + i * 8, 8); break;
        }
        put_le(&b, v, sz);
    }
    return set_kv(w, key, GGUF_ARRAY, &b, 0);
}

int gguf_writer_set_str_array(gguf_writer *w, const char *key, const char *const *strs, uint64_t n)
{
    if (n && !strs)
        return QL_EINVAL;
    bytes b = {0};
    put_le(&b, GGUF_STRING, 4);
    put_le(&b, n, 8);
    for (uint64_t i = 0; i < n; i++) {
        if (!strs[i]) {
            free(b.p);
            return QL_EINVAL;
        }
        put_str(&b, strs[i], strlen(strs[i]));
    }
    return set_kv(w, key, GGUF_ARRAY, &b, 0);
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t ggml_type, int n_dims,
                           const int64_t *ne, const void *data, size_t nbytes)
{
    uint32_t block_size, type_size;
    if (!w || !name || !ne || n_dims < 1 || n_dims > GGUF_MAX_DIMS ||
        !gguf_ggml_type_geometry(ggml_type, &block_size, &type_size) || (nbytes && !data))
        return QL_EINVAL;
    uint64_t want = 1;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] < 1)
            return QL_EINVAL;
        uint64_t dim = d == 0 ? (uint64_t)ne[0] / block_size : (uint64_t)ne[d];
        if (__builtin_mul_overflow(want, dim, &want))
            return QL_EINVAL;
    }
    if (ne[0] % block_size != 0 || __builtin_mul_overflow(want, type_size, &want) || want != nbytes)
        return QL_EINVAL;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return QL_EINVAL;
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? 2 * w->cap_tensors : 16;
        gguf_wtensor *t = realloc(w->tensors, cap * sizeof *t);
        if (!t)
            return QL_ENOMEM;
        w->tensors = t;
        w->cap_tensors = cap;
    }
    gguf_wtensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    t->data = malloc(nbytes ? nbytes : 1);
    if (!t->name || !t->data) {
        free(t->name);
        free(t->data);
        return QL_ENOMEM;
    }
    if (nbytes)
        memcpy(t->data, data, nbytes);
    t->nbytes = nbytes;
    t->ggml_type = ggml_type;
    t->n_dims = n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = d < n_dims ? ne[d] : 1;
    w->n_tensors++;
    return QL_OK;
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/* Everything before the data section, padded to the alignment. */
static int build_header(const gguf_writer *w, uint64_t alignment, bytes *b)
{
    put(b, "GGUF", 4);
    put_le(b, 3, 4);
    put_le(b, w->n_tensors, 8);
    put_le(b, w->n_kv, 8);
    for (size_t i = 0; i < w->n_kv; i++) {
        put_str(b, w->kvs[i].key, strlen(w->kvs[i].key));
        put_le(b, w->kvs[i].type, 4);
        put(b, w->kvs[i].value.p, w->kvs[i].value.len);
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const gguf_wtensor *t = &w->tensors[i];
        put_str(b, t->name, strlen(t->name));
        put_le(b, (uint64_t)t->n_dims, 4);
        for (int d = 0; d < t->n_dims; d++)
            put_le(b, (uint64_t)t->ne[d], 8);
        put_le(b, t->ggml_type, 4);
        put_le(b, offset, 8);
        offset += align_up(t->nbytes, alignment);
    }
    static const uint8_t zeros[64];
    size_t pad = (size_t)(align_up(b->len, alignment) - b->len);
    for (; pad > 0 && !b->failed; pad -= pad < sizeof zeros ? pad : sizeof zeros)
        put(b, zeros, pad < sizeof zeros ? pad : sizeof zeros);
    return b->failed ? QL_ENOMEM : QL_OK;
}

static bool write_all(FILE *fp, const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, fp) == n;
}

static bool write_zeros(FILE *fp, size_t n)
{
    static const uint8_t zeros[64];
    while (n > 0) {
        size_t k = n < sizeof zeros ? n : sizeof zeros;
        if (!write_all(fp, zeros, k))
            return false;
        n -= k;
    }
    return true;
}

int gguf_writer_write(gguf_writer *w, const char *path, char *msg, size_t msg_len)
{
    if (!w || !path)
        return ql_fail(msg, msg_len, QL_EINVAL, "gguf_writer_write: no writer or no path");
    uint64_t alignment = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, "general.alignment") != 0)
            continue;
        uint32_t a = w->kvs[i].u32;
        if (w->kvs[i].type != GGUF_UINT32 || a == 0 || (a & (a - 1)) != 0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: metadata 'general.alignment' must be a uint32 power of two", path);
        alignment = a;
    }
    bytes header = {0};
    if (build_header(w, alignment, &header) != QL_OK) {
        free(header.p);
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: cannot build the header", path);
    }
    size_t tlen = strlen(path) + 5;
    char *tmp = malloc(tlen);
    if (!tmp) {
        free(header.p);
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    }
    snprintf(tmp, tlen, "%s.tmp", path);
    FILE *fp = fopen(tmp, "wb");
    if (!fp) {
        int rc = ql_fail(msg, msg_len, QL_EIO, "%s: cannot create: %s", tmp, strerror(errno));
        free(header.p);
        free(tmp);
        return rc;
    }
    bool ok = write_all(fp, header.p, header.len);
    for (size_t i = 0; ok && i < w->n_tensors; i++) {
        const gguf_wtensor *t = &w->tensors[i];
        ok = write_all(fp, t->data, t->nbytes) &&
             write_zeros(fp, (size_t)(align_up(t->nbytes, alignment) - t->nbytes));
    }
    ok = (fflush(fp) == 0) && ok;
    ok = (fclose(fp) == 0) && ok;
    free(header.p);
    int rc = QL_OK;
    if (!ok || rename(tmp, path) != 0) {
        rc = ql_fail(msg, msg_len, QL_EIO, "%s: cannot write: %s", path, strerror(errno));
        unlink(tmp);
    }
    free(tmp);
    return rc;
}

/* The name and source of the i-th tensor the rewrite writes: f's own, then
 * the added ones; NULL source for an added one f does not hold. */
static const gguf_tensor *rewritten_tensor(const gguf_file *f, const gguf_rewrite *r, size_t i,
                                           const char **name)
{
    if (i >= f->n_tensors) {
        *name = r->extra_names[i - f->n_tensors];
        return gguf_find_tensor(f, r->extra_sources[i - f->n_tensors]);
    }
    const gguf_tensor *t = &f->tensors[i];
    *name = r->rename_from && strcmp(t->name, r->rename_from) == 0 ? r->rename_to : t->name;
    return t;
}

/* r's metadata into o: f's entries as edit_kv leaves them, then its u32
 * keys. */
static int rewrite_kvs(gguf_out *o, const gguf_file *f, const gguf_rewrite *r, char *msg,
                       size_t msg_len)
{
    int rc = QL_OK;
    for (uint64_t i = 0; i < f->n_kv && rc == QL_OK; i++) {
        gguf_kv kv = f->kvs[i];
        if (!r->edit_kv || r->edit_kv(&kv, r->ctx))
            rc = gguf_out_copy_kv(o, &kv, msg, msg_len);
    }
    for (size_t i = 0; i < r->n_u32 && rc == QL_OK; i++)
        rc = gguf_out_set_u32(o, r->u32_keys[i], r->u32_values[i], msg, msg_len);
    return rc;
}

int gguf_writer_rewrite(const char *in, const char *out, const gguf_rewrite *r, char *msg,
                        size_t msg_len)
{
    gguf_file f;
    int rc = gguf_open(&f, in, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    gguf_out *o = gguf_out_new(f.alignment);
    rc = o ? rewrite_kvs(o, &f, r, msg, msg_len) : QL_ENOMEM;
    size_t n = f.n_tensors + r->n_extra;
    for (size_t i = 0; i < n && rc == QL_OK; i++) {
        const char *name;
        const gguf_tensor *t = rewritten_tensor(&f, r, i, &name);
        rc = t ? gguf_out_add_tensor(o, name, t->ggml_type, t->n_dims, t->ne, msg, msg_len)
               : ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: no tensor %s to copy", in,
                         r->extra_sources[i - f.n_tensors]);
    }
    if (rc == QL_OK)
        rc = gguf_out_begin(o, out, msg, msg_len);
    for (size_t i = 0; i < n && rc == QL_OK; i++) {
        const char *name;
        const gguf_tensor *t = rewritten_tensor(&f, r, i, &name);
        rc = gguf_out_write(o, t->data, t->nbytes, msg, msg_len);
    }
    if (rc == QL_OK)
        rc = gguf_out_finish(o, msg, msg_len);
    gguf_out_free(o);
    gguf_close(&f);
    return rc;
}

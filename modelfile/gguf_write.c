/*
 * gguf_write.c - the GGUF v3 writer (gguf_out_): metadata and tensor
 * infos first, then the tensors' data streamed in the order they were
 * declared, so a quantizer holds one tensor's chunk at a time, never the
 * file. The layout is the one gguf.c reads and llama.cpp's gguf.cpp
 * writes: "GGUF", version 3, tensor and metadata counts, the key/value
 * pairs, the tensor infos (name, dims with ne[0] fastest, GGML type,
 * offset into the data section), zero padding to the alignment, then each
 * tensor's bytes padded to the alignment.
 *
 * It owns the metadata bytes, the tensor list and the open temporary file
 * (PATH.tmp, renamed over PATH only when every byte was written, so a
 * failed write never leaves half a file). It touches only that file, and
 * reads gguf.c's geometry (gguf_ggml_type_geometry) for the tensor sizes.
 */
#include "modelfile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct out_tensor {
    char *name;
    uint32_t type;
    int n_dims;
    int64_t ne[4];
    uint64_t nbytes, offset;
} out_tensor;

struct gguf_out {
    uint64_t alignment;
    uint8_t *kv; /* the serialized key/value pairs */
    size_t kv_len, kv_cap;
    uint64_t n_kv;
    out_tensor *tensors;
    size_t n_tensors, cap_tensors;
    uint64_t data_len; /* the data section's length so far, padded */
    /* while writing */
    FILE *fp;
    char *path, *tmp;
    size_t cur;        /* the tensor being written */
    uint64_t cur_done; /* its bytes written so far */
    bool failed;       /* an allocation failed while building the metadata */
};

gguf_out *gguf_out_new(uint64_t alignment)
{
    gguf_out *o = calloc(1, sizeof *o);
    if (o)
        o->alignment = alignment ? alignment : 32;
    return o;
}

void gguf_out_free(gguf_out *o)
{
    if (!o)
        return;
    if (o->fp) {
        fclose(o->fp);
        remove(o->tmp);
    }
    for (size_t i = 0; i < o->n_tensors; i++)
        free(o->tensors[i].name);
    free(o->tensors);
    free(o->kv);
    free(o->path);
    free(o->tmp);
    free(o);
}

/* --- metadata ------------------------------------------------------------- */

static void put(gguf_out *o, const void *p, size_t n)
{
    if (o->failed)
        return;
    if (o->kv_len + n > o->kv_cap) {
        size_t cap = o->kv_cap ? o->kv_cap : 4096;
        while (cap < o->kv_len + n)
            cap *= 2;
        uint8_t *k = realloc(o->kv, cap);
        if (!k) {
            o->failed = true;
            return;
        }
        o->kv = k;
        o->kv_cap = cap;
    }
    memcpy(o->kv + o->kv_len, p, n);
    o->kv_len += n;
}

/* Little-endian integers, as GGUF stores them (this writer, like the
 * reader, assumes a little-endian host). */
static void put_u32(gguf_out *o, uint32_t v)
{
    put(o, &v, 4);
}

static void put_u64(gguf_out *o, uint64_t v)
{
    put(o, &v, 8);
}

static void put_str(gguf_out *o, const char *s, uint64_t len)
{
    put_u64(o, len);
    put(o, s, (size_t)len);
}

/* One scalar of type t from the reader's converted fields. */
static void put_scalar(gguf_out *o, const gguf_kv *kv)
{
    union {
        uint8_t u8;
        uint16_t u16;
        uint32_t u32;
        uint64_t u64;
        float f32;
        double f64;
    } v;
    size_t n = gguf_value_size(kv->type);
    switch (kv->type) {
    case GGUF_UINT8:
    case GGUF_INT8:
    case GGUF_BOOL: v.u8 = (uint8_t)(kv->type == GGUF_INT8 ? (uint64_t)kv->i : kv->u); break;
    case GGUF_UINT16:
    case GGUF_INT16: v.u16 = (uint16_t)(kv->type == GGUF_INT16 ? (uint64_t)kv->i : kv->u); break;
    case GGUF_UINT32:
    case GGUF_INT32: v.u32 = (uint32_t)(kv->type == GGUF_INT32 ? (uint64_t)kv->i : kv->u); break;
    case GGUF_UINT64:
    case GGUF_INT64: v.u64 = kv->type == GGUF_INT64 ? (uint64_t)kv->i : kv->u; break;
    case GGUF_FLOAT32: v.f32 = (float)kv->f; break;
    default: v.f64 = kv->f; break; /* GGUF_FLOAT64 */
    }
    put(o, &v, n);
}

int gguf_out_copy_kv(gguf_out *o, const gguf_kv *kv, char *msg, size_t msg_len)
{
    if (kv->type == GGUF_ARRAY && kv->elem == GGUF_ARRAY)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "metadata '%s' is an array of arrays, which this writer does not copy",
                       kv->key);
    put_str(o, kv->key, strlen(kv->key));
    put_u32(o, (uint32_t)kv->type);
    if (kv->type == GGUF_STRING) {
        put_str(o, kv->str.ptr, kv->str.len);
    } else if (kv->type == GGUF_ARRAY) {
        put_u32(o, (uint32_t)kv->elem);
        put_u64(o, kv->n);
        if (kv->elem == GGUF_STRING)
            for (uint64_t i = 0; i < kv->n; i++)
                put_str(o, kv->strs[i].ptr, kv->strs[i].len);
        else
            put(o, kv->data, (size_t)(kv->n * gguf_value_size(kv->elem)));
    } else {
        put_scalar(o, kv);
    }
    o->n_kv++;
    return o->failed ? ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for metadata") : QL_OK;
}

int gguf_out_set_u32(gguf_out *o, const char *key, uint32_t v, char *msg, size_t msg_len)
{
    put_str(o, key, strlen(key));
    put_u32(o, GGUF_UINT32);
    put_u32(o, v);
    o->n_kv++;
    return o->failed ? ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for metadata") : QL_OK;
}

/* --- tensors ---------------------------------------------------------------- */

static uint64_t pad_to(uint64_t n, uint64_t align)
{
    return (n + align - 1) / align * align;
}

int gguf_out_add_tensor(gguf_out *o, const char *name, uint32_t ggml_type, int n_dims,
                        const int64_t *ne, char *msg, size_t msg_len)
{
    uint32_t bs, ts;
    if (!gguf_ggml_type_geometry(ggml_type, &bs, &ts))
        return ql_fail(msg, msg_len, QL_EINVAL, "tensor '%s': GGML type %u is not known", name,
                       (unsigned)ggml_type);
    if (n_dims < 1 || n_dims > 4 || ne[0] <= 0 || ne[0] % bs != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "tensor '%s': %d dims with %lld columns do not fit %s blocks of %u", name,
                       n_dims, (long long)ne[0], gguf_ggml_type_name(ggml_type), (unsigned)bs);
    uint64_t rows = 1;
    for (int d = 1; d < n_dims; d++) {
        if (ne[d] <= 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "tensor '%s': dimension %d is %lld", name, d,
                           (long long)ne[d]);
        rows *= (uint64_t)ne[d];
    }
    if (o->n_tensors == o->cap_tensors) {
        size_t cap = o->cap_tensors ? 2 * o->cap_tensors : 64;
        out_tensor *t = realloc(o->tensors, cap * sizeof *t);
        if (!t)
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for tensor '%s'", name);
        o->tensors = t;
        o->cap_tensors = cap;
    }
    out_tensor *t = &o->tensors[o->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for tensor '%s'", name);
    t->type = ggml_type;
    t->n_dims = n_dims;
    memcpy(t->ne, ne, (size_t)n_dims * sizeof *ne);
    t->nbytes = rows * (uint64_t)(ne[0] / bs) * ts;
    t->offset = o->data_len;
    o->data_len = pad_to(o->data_len + t->nbytes, o->alignment);
    o->n_tensors++;
    return QL_OK;
}

/* --- the file ------------------------------------------------------------- */

static bool write_all(FILE *fp, const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, fp) == n;
}

static bool write_zeros(FILE *fp, uint64_t n)
{
    static const uint8_t zeros[64];
    while (n > 0) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        if (!write_all(fp, zeros, k))
            return false;
        n -= k;
    }
    return true;
}

/* The header, metadata and tensor infos, padded to the alignment. */
static bool write_head(gguf_out *o)
{
    uint32_t version = 3;
    uint64_t n_tensors = o->n_tensors;
    bool ok = write_all(o->fp, "GGUF", 4) && write_all(o->fp, &version, 4) &&
              write_all(o->fp, &n_tensors, 8) && write_all(o->fp, &o->n_kv, 8) &&
              write_all(o->fp, o->kv, o->kv_len);
    uint64_t len = 24 + o->kv_len;
    for (size_t i = 0; ok && i < o->n_tensors; i++) {
        const out_tensor *t = &o->tensors[i];
        uint64_t nlen = strlen(t->name);
        uint32_t nd = (uint32_t)t->n_dims;
        ok = write_all(o->fp, &nlen, 8) && write_all(o->fp, t->name, (size_t)nlen) &&
             write_all(o->fp, &nd, 4) && write_all(o->fp, t->ne, (size_t)nd * 8) &&
             write_all(o->fp, &t->type, 4) && write_all(o->fp, &t->offset, 8);
        len += 8 + nlen + 4 + 8 * (uint64_t)nd + 4 + 8;
    }
    return ok && write_zeros(o->fp, pad_to(len, o->alignment) - len);
}

int gguf_out_begin(gguf_out *o, const char *path, char *msg, size_t msg_len)
{
    if (o->failed)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for metadata");
    if (o->fp || o->path)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: this GGUF writer was already begun", path);
    size_t n = strlen(path);
    o->path = strdup(path);
    o->tmp = malloc(n + 5);
    if (!o->path || !o->tmp)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    snprintf(o->tmp, n + 5, "%s.tmp", path);
    o->fp = fopen(o->tmp, "wb");
    if (!o->fp)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot create", o->tmp);
    if (!write_head(o))
        return ql_fail(msg, msg_len, QL_EIO, "%s: write failed (disk full?)", o->tmp);
    return QL_OK;
}

int gguf_out_write(gguf_out *o, const void *data, size_t n, char *msg, size_t msg_len)
{
    const uint8_t *p = data;
    while (n > 0) {
        if (!o->fp || o->cur >= o->n_tensors)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: more tensor data than the %zu tensors declared",
                           o->path ? o->path : "(not begun)", o->n_tensors);
        out_tensor *t = &o->tensors[o->cur];
        uint64_t room = t->nbytes - o->cur_done;
        size_t k = n < room ? n : (size_t)room;
        if (!write_all(o->fp, p, k))
            return ql_fail(msg, msg_len, QL_EIO, "%s: write failed (disk full?)", o->tmp);
        p += k;
        n -= k;
        o->cur_done += k;
        if (o->cur_done == t->nbytes) {
            uint64_t end = t->offset + t->nbytes;
            if (!write_zeros(o->fp, pad_to(end, o->alignment) - end))
                return ql_fail(msg, msg_len, QL_EIO, "%s: write failed (disk full?)", o->tmp);
            o->cur++;
            o->cur_done = 0;
        }
    }
    return QL_OK;
}

int gguf_out_finish(gguf_out *o, char *msg, size_t msg_len)
{
    if (!o->fp)
        return ql_fail(msg, msg_len, QL_EINVAL, "this GGUF writer was not begun");
    if (o->cur < o->n_tensors)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s' got %llu of its %llu bytes",
                       o->path, o->tensors[o->cur].name, (unsigned long long)o->cur_done,
                       (unsigned long long)o->tensors[o->cur].nbytes);
    bool ok = fflush(o->fp) == 0;
    ok = fclose(o->fp) == 0 && ok;
    o->fp = NULL;
    if (!ok || rename(o->tmp, o->path) != 0) {
        remove(o->tmp);
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot write the file", o->path);
    }
    return QL_OK;
}

/*
 * safetensors.c - read and write the safetensors format: an 8-byte
 * little-endian header length, a JSON header mapping each tensor name to
 * {dtype, shape, data_offsets}, then the tensor bytes.
 *
 * Reading maps the file and checks every number against the file before a
 * pointer into it is handed out, since a model file is untrusted input: a
 * truncated download or a hostile header must give a message, never a read
 * past the end. Writing goes through a temporary file and a rename, so a
 * crash mid-write leaves either the old file or the new one.
 *
 * It offers the st_dtype table, st_open/st_close/st_find and the st_writer
 * (modelfile.h). An st_file owns its mapping and tensor table until
 * st_close; a writer owns what it copied until st_writer_free, and borrows
 * what it was told to. It touches only the files it is given (and, when
 * writing, path.tmp beside the target).
 */
#include "modelfile.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The format's own cap on the header (safetensors' MAX_HEADER_SIZE). */
#define ST_MAX_HEADER (100u * 1000u * 1000u)

static const struct {
    const char *name;
    size_t size;
} dtype_info[ST_DTYPE_COUNT] = {
    [ST_BOOL] = {"BOOL", 1},       [ST_U8] = {"U8", 1},           [ST_I8] = {"I8", 1},
    [ST_U16] = {"U16", 2},         [ST_I16] = {"I16", 2},         [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2},       [ST_U32] = {"U32", 4},         [ST_I32] = {"I32", 4},
    [ST_F32] = {"F32", 4},         [ST_U64] = {"U64", 8},         [ST_I64] = {"I64", 8},
    [ST_F64] = {"F64", 8},         [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
    [ST_F8_E8M0] = {"F8_E8M0", 1},
};

const char *st_dtype_name(st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT ? dtype_info[dt].name : "?";
}

size_t st_dtype_size(st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT ? dtype_info[dt].size : 0;
}

int st_dtype_from_name(const char *name)
{
    for (int i = 0; i < ST_DTYPE_COUNT; i++)
        if (strcmp(dtype_info[i].name, name) == 0)
            return i;
    return -1;
}

/* --- reading ------------------------------------------------------------ */

static int cmp_by_data(const void *a, const void *b)
{
    const st_tensor *x = a, *y = b;
    if (x->data != y->data)
        return x->data < y->data ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : (x->nbytes > y->nbytes);
}

static int cmp_by_name(const void *a, const void *b)
{
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return strcmp(x->name, y->name);
}

/* Parse one header entry into t; the data area is [base, base + len). */
static int parse_entry(const char *path, const cJSON *e, const uint8_t *base, size_t len,
                       st_tensor *t, char *msg, size_t msg_len)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s': entry is not an object", path,
                       name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt) || st_dtype_from_name(dt->valuestring) < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s': dtype %s is not known", path,
                       name, cJSON_IsString(dt) ? dt->valuestring : "(missing)");
    t->dtype = (st_dtype)st_dtype_from_name(dt->valuestring);
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) > ST_MAX_DIMS)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': shape is missing or has more than %d dimensions", path,
                       name, ST_MAX_DIMS);
    t->ndim = cJSON_GetArraySize(shape);
    t->numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        const cJSON *d = cJSON_GetArrayItem(shape, i);
        if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 9.0e15 ||
            d->valuedouble != (double)(int64_t)d->valuedouble)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name,
                           i);
        t->shape[i] = (int64_t)d->valuedouble;
        if (t->shape[i] && t->numel > INT64_MAX / 16 / t->shape[i])
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s': shape overflows", path,
                           name);
        t->numel *= t->shape[i];
    }
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': data_offsets is not [begin, end]", path, name);
    double b = cJSON_GetArrayItem(offs, 0)->valuedouble;
    double en = cJSON_GetArrayItem(offs, 1)->valuedouble;
    if (!cJSON_IsNumber(cJSON_GetArrayItem(offs, 0)) ||
        !cJSON_IsNumber(cJSON_GetArrayItem(offs, 1)) || b < 0 || en < b || en > (double)len ||
        b != (double)(uint64_t)b || en != (double)(uint64_t)en)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': data_offsets [%.0f, %.0f] fall outside the %zu "
                       "bytes of data (truncated file?)",
                       path, name, b, en, len);
    t->nbytes = (size_t)(en - b);
    size_t want = (size_t)t->numel * st_dtype_size(t->dtype);
    if (t->nbytes != want)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s': %zu bytes of data for %lld %s elements (%zu bytes)", path,
                       name, t->nbytes, (long long)t->numel, st_dtype_name(t->dtype), want);
    t->data = base + (size_t)b;
    t->name = strdup(name);
    if (!t->name)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    return QL_OK;
}

static int parse_metadata(st_file *f, const cJSON *meta, char *msg, size_t msg_len)
{
    if (!cJSON_IsObject(meta))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: __metadata__ is not an object", f->path);
    if (f->meta_keys) /* JSON allows a key twice; cJSON keeps both */
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: __metadata__ appears twice", f->path);
    size_t n = (size_t)cJSON_GetArraySize(meta);
    f->meta_keys = calloc(n ? n : 1, sizeof(char *));
    f->meta_values = calloc(n ? n : 1, sizeof(char *));
    if (!f->meta_keys || !f->meta_values)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    const cJSON *kv;
    cJSON_ArrayForEach (kv, meta) {
        if (!cJSON_IsString(kv))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: __metadata__ value of '%s' is not a string", f->path, kv->string);
        f->meta_keys[f->n_meta] = strdup(kv->string);
        f->meta_values[f->n_meta] = strdup(kv->valuestring);
        if (!f->meta_keys[f->n_meta] || !f->meta_values[f->n_meta])
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
        f->n_meta++;
    }
    return QL_OK;
}

static int parse_header(st_file *f, const char *json, size_t json_len, char *msg, size_t msg_len)
{
    const uint8_t *data = f->map + 8 + json_len;
    size_t data_len = f->map_len - 8 - json_len;
    cJSON *root = cJSON_ParseWithLength(json, json_len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: the header is not a JSON object", f->path);
    }
    int rc = QL_OK;
    size_t n = (size_t)cJSON_GetArraySize(root);
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    if (!f->tensors)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    const cJSON *e;
    cJSON_ArrayForEach (e, root) {
        if (rc != QL_OK)
            break;
        if (strcmp(e->string, "__metadata__") == 0) {
            rc = parse_metadata(f, e, msg, msg_len);
            continue;
        }
        rc = parse_entry(f->path, e, data, data_len, &f->tensors[f->n_tensors], msg, msg_len);
        if (rc == QL_OK)
            f->n_tensors++;
    }
    cJSON_Delete(root);
    if (rc != QL_OK)
        return rc;
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_by_data);
    /* no name twice (JSON allows a key twice; cJSON keeps both): sorted by
     * name, a duplicate is a neighbour, so a header of n names costs
     * O(n log n), not the n^2 / 2 comparisons of looking each one up */
    f->by_name = malloc((f->n_tensors ? f->n_tensors : 1) * sizeof *f->by_name);
    if (!f->by_name)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path);
    for (size_t i = 0; i < f->n_tensors; i++)
        f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, f->n_tensors, sizeof *f->by_name, cmp_by_name);
    for (size_t i = 1; i < f->n_tensors; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s' appears twice", f->path,
                           f->by_name[i]->name);
    /* no two tensors may share bytes */
    for (size_t i = 1; i < f->n_tensors; i++) {
        const st_tensor *a = &f->tensors[i - 1], *b = &f->tensors[i];
        if (a->nbytes && b->nbytes && a->data + a->nbytes > b->data)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensors '%s' and '%s' overlap", f->path,
                           a->name, b->name);
    }
    return QL_OK;
}

static int open_bytes(st_file *f, const char *path, char *msg, size_t msg_len);

int st_open(st_file *f, const char *path, char *msg, size_t msg_len)
{
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    int rc = mf_map_file(path, 8, "safetensors", &f->map, &f->map_len, msg, msg_len);
    if (rc != QL_OK) {
        st_close(f);
        return rc;
    }
    return open_bytes(f, path, msg, msg_len);
}

int st_open_copy(st_file *f, char *bytes, size_t len, const char *path, char *msg, size_t msg_len)
{
    memset(f, 0, sizeof *f);
    /* f owns the bytes from here on, so that st_close frees them on any
     * error below */
    f->map = (uint8_t *)bytes;
    f->map_len = len;
    f->owned = true;
    f->path = strdup(path);
    int rc = QL_OK;
    if (!f->path)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    else if (len < 8)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: %zu bytes is too short for a safetensors header (truncated?)", path, len);
    if (rc != QL_OK) {
        st_close(f);
        return rc;
    }
    return open_bytes(f, path, msg, msg_len);
}

/* Validate f's bytes (f->map, mapped or read) and parse the header. */
static int open_bytes(st_file *f, const char *path, char *msg, size_t msg_len)
{
    int rc = QL_OK;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | f->map[i];
    if (hlen > ST_MAX_HEADER)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: header length %llu exceeds the format's 100 MB limit", path,
                     (unsigned long long)hlen);
    else if (hlen > f->map_len - 8)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: header length %llu runs past the end of the %zu-byte file "
                     "(truncated?)",
                     path, (unsigned long long)hlen, f->map_len);
    else if (hlen < 2 || f->map[8] != '{')
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: the header does not start with '{'", path);
    else
        rc = parse_header(f, (const char *)f->map + 8, (size_t)hlen, msg, msg_len);
    if (rc != QL_OK)
        st_close(f);
    return rc;
}

void st_close(st_file *f)
{
    if (f->map && f->owned)
        free(f->map);
    else if (f->map)
        mf_unmap_file(f->map, f->map_len);
    for (size_t i = 0; i < f->n_tensors; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    free(f->by_name);
    for (size_t i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->meta_keys);
    free(f->meta_values);
    free(f->path);
    memset(f, 0, sizeof *f);
}

static int cmp_name_key(const void *name, const void *elem)
{
    return strcmp(name, (*(const st_tensor *const *)elem)->name);
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    if (!f->by_name)
        return NULL;
    st_tensor *const *hit =
        bsearch(name, f->by_name, f->n_tensors, sizeof *f->by_name, cmp_name_key);
    return hit ? *hit : NULL;
}

/* --- writing ------------------------------------------------------------ */

typedef struct st_wtensor {
    char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
    void *owned;
    size_t nbytes;
} st_wtensor;

struct st_writer {
    st_wtensor *tensors;
    size_t n, cap;
    cJSON *meta;
};

st_writer *st_writer_new(void)
{
    st_writer *w = calloc(1, sizeof *w);
    if (w && !(w->meta = cJSON_CreateObject())) {
        free(w);
        w = NULL;
    }
    return w;
}

void st_writer_free(st_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].owned);
    }
    free(w->tensors);
    cJSON_Delete(w->meta);
    free(w);
}

int st_writer_add(st_writer *w, const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                  const void *data, size_t nbytes, bool copy, char *msg, size_t msg_len)
{
    if (ndim < 0 || ndim > ST_MAX_DIMS || (unsigned)dtype >= ST_DTYPE_COUNT)
        return ql_fail(msg, msg_len, QL_EINVAL, "tensor '%s': bad dtype or rank", name);
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++)
        numel *= shape[i];
    if ((size_t)numel * st_dtype_size(dtype) != nbytes)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "tensor '%s': %zu bytes do not match its shape and dtype %s", name, nbytes,
                       st_dtype_name(dtype));
    for (size_t i = 0; i < w->n; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "tensor '%s' added twice", name);
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 16;
        st_wtensor *t = realloc(w->tensors, cap * sizeof *t);
        if (!t)
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        w->tensors = t;
        w->cap = cap;
    }
    st_wtensor *t = &w->tensors[w->n];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (copy) {
        t->owned = malloc(nbytes ? nbytes : 1);
        if (t->owned)
            memcpy(t->owned, data, nbytes);
    }
    if (!t->name || (copy && !t->owned)) {
        free(t->name);
        free(t->owned);
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    }
    t->data = copy ? t->owned : data;
    t->dtype = dtype;
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    t->nbytes = nbytes;
    w->n++;
    return QL_OK;
}

int st_writer_set_metadata(st_writer *w, const char *key, const char *value)
{
    cJSON_DeleteItemFromObjectCaseSensitive(w->meta, key);
    return cJSON_AddStringToObject(w->meta, key, value) ? QL_OK : QL_ENOMEM;
}

static char *build_header(st_writer *w, size_t *len_out)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NULL;
    bool ok = true;
    if (cJSON_GetArraySize(w->meta) > 0)
        ok = cJSON_AddItemToObject(root, "__metadata__", cJSON_Duplicate(w->meta, 1));
    size_t off = 0;
    for (size_t i = 0; ok && i < w->n; i++) {
        const st_wtensor *t = &w->tensors[i];
        cJSON *e = cJSON_AddObjectToObject(root, t->name);
        cJSON *shape = e ? cJSON_AddArrayToObject(e, "shape") : NULL;
        cJSON *offs = e ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
        ok = e && shape && offs && cJSON_AddStringToObject(e, "dtype", st_dtype_name(t->dtype));
        for (int d = 0; ok && d < t->ndim; d++)
            ok = cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->shape[d]));
        ok = ok && cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off)) &&
             cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + t->nbytes)));
        off += t->nbytes;
    }
    char *json = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!json)
        return NULL;
    /* pad with spaces so the data starts 8-byte aligned, as the format's
     * reference writer does */
    size_t n = strlen(json), padded = (n + 7) & ~(size_t)7;
    char *out = realloc(json, padded + 1);
    if (!out) {
        free(json);
        return NULL;
    }
    memset(out + n, ' ', padded - n);
    out[padded] = '\0';
    *len_out = padded;
    return out;
}

static bool write_all(FILE *fp, const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, fp) == n;
}

int st_writer_write(st_writer *w, const char *path, char *msg, size_t msg_len)
{
    size_t hlen = 0;
    char *header = build_header(w, &hlen);
    if (!header)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: cannot build the header", path);
    size_t tlen = strlen(path) + 5;
    char *tmp = malloc(tlen);
    if (!tmp) {
        free(header);
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    }
    snprintf(tmp, tlen, "%s.tmp", path);
    FILE *fp = fopen(tmp, "wb");
    if (!fp) {
        int rc = ql_fail(msg, msg_len, QL_EIO, "%s: cannot create: %s", tmp, strerror(errno));
        free(header);
        free(tmp);
        return rc;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    bool ok = write_all(fp, len8, 8) && write_all(fp, header, hlen);
    for (size_t i = 0; ok && i < w->n; i++)
        ok = write_all(fp, w->tensors[i].data, w->tensors[i].nbytes);
    ok = (fflush(fp) == 0) && ok;
    ok = (fclose(fp) == 0) && ok;
    free(header);
    int rc = QL_OK;
    if (!ok || rename(tmp, path) != 0) {
        rc = ql_fail(msg, msg_len, QL_EIO, "%s: cannot write: %s", path, strerror(errno));
        unlink(tmp);
    }
    free(tmp);
    return rc;
}

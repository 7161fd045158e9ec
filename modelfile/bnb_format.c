/*
 * bnb_format.c - the tensors transformers writes for a bitsandbytes 4-bit
 * weight, read into one qtensor without dequantizing, and written back the
 * same way, so checkpoints cross between qlserve and transformers +
 * bitsandbytes unchanged.
 *
 * For a weight X (bitsandbytes QuantState.as_dict(packed=True)):
 *   X                                 U8 [ceil(n/2), 1]  packed codes
 *   X.absmax                          F32 [blocks], or U8 [blocks] when nested
 *   X.quant_map                       F32 [16]           the 4-bit codebook
 *   X.nested_absmax                   F32 [nested blocks]      (nested only)
 *   X.nested_quant_map                F32 [256]               (nested only)
 *   X.quant_state.bitsandbytes__nf4   U8: JSON text {"quant_type", "blocksize",
 *                                     "dtype", "shape", and when nested
 *                                     "nested_blocksize", "nested_offset",
 *                                     "nested_dtype"}
 *
 * It offers bnb_is_quantized, bnb_read and bnb_write (modelfile.h). It owns
 * nothing past a call: bnb_read copies the parts into a qtensor the caller
 * frees, bnb_write copies them into the caller's writer. It touches only
 * the st_file or st_writer it is given; the quant state's JSON goes
 * through the shared mf_json_* readers.
 */
#include "modelfile.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QS_PREFIX ".quant_state.bitsandbytes__"

/* The quant-state tensor of base, and its quant type ("nf4"/"fp4"). */
static const st_tensor *find_quant_state(const st_file *f, const char *base, const char **type)
{
    static const char *types[] = {"nf4", "fp4"};
    char key[1024];
    for (int i = 0; i < 2; i++) {
        snprintf(key, sizeof key, "%s%s%s", base, QS_PREFIX, types[i]);
        const st_tensor *t = st_find(f, key);
        if (t) {
            *type = types[i];
            return t;
        }
    }
    return NULL;
}

bool bnb_is_quantized(const st_file *f, const char *base)
{
    const char *type;
    return find_quant_state(f, base, &type) != NULL;
}

/* The part base + suffix with the given dtype, or an error naming it. */
static int get_part(const st_file *f, const char *base, const char *suffix, st_dtype dtype,
                    const st_tensor **out, char *msg, size_t msg_len)
{
    char key[1024];
    snprintf(key, sizeof key, "%s%s", base, suffix);
    const st_tensor *t = st_find(f, key);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor '%s' is missing", f->path, key);
    if (t->dtype != dtype)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s' is %s; expected %s", f->path, key,
                       st_dtype_name(t->dtype), st_dtype_name(dtype));
    *out = t;
    return QL_OK;
}

/* Copy an f32 tensor out of the (possibly unaligned) mapping. */
static float *f32_copy(const st_tensor *t)
{
    float *v = malloc(t->nbytes ? t->nbytes : 1);
    if (v)
        memcpy(v, t->data, t->nbytes);
    return v;
}

typedef struct bnb_state {
    const char *type;
    char dtype[16];
    int64_t rows, cols;
    int32_t blocksize;
    bool nested;
    int32_t nested_blocksize;
    float nested_offset;
} bnb_state;

static int parse_quant_state(const st_file *f, const char *base, const st_tensor *qs, bnb_state *s,
                             char *msg, size_t msg_len)
{
    cJSON *j = cJSON_ParseWithLength((const char *)qs->data, qs->nbytes);
    int rc = QL_OK;
    if (!cJSON_IsObject(j)) {
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: '%s%s%s' does not hold a JSON object", f->path,
                     base, QS_PREFIX, s->type);
        goto out;
    }
    const char *qt = mf_json_str(j, "quant_type");
    if (!qt || strcmp(qt, s->type) != 0) {
        rc =
            ql_fail(msg, msg_len, QL_EFORMAT, "%s: '%s': quant_type %s does not match the key's %s",
                    f->path, base, qt ? qt : "(missing)", s->type);
        goto out;
    }
    int64_t bs;
    if (!mf_json_integer(cJSON_GetObjectItemCaseSensitive(j, "blocksize"), 1, 4096, &bs)) {
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: '%s': blocksize is missing or invalid", f->path,
                     base);
        goto out;
    }
    s->blocksize = (int32_t)bs;
    const char *dt = mf_json_str(j, "dtype");
    if (!dt || (strcmp(dt, "float32") && strcmp(dt, "float16") && strcmp(dt, "bfloat16"))) {
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: '%s': dtype %s is not float32, float16 or bfloat16", f->path, base,
                     dt ? dt : "(missing)");
        goto out;
    }
    snprintf(s->dtype, sizeof s->dtype, "%s", dt);
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(j, "shape");
    int nd = cJSON_IsArray(shape) ? cJSON_GetArraySize(shape) : 0;
    if (nd < 1 || nd > ST_MAX_DIMS) {
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: '%s': shape is missing", f->path, base);
        goto out;
    }
    /* all leading dimensions fold into rows; the last is the input dim */
    s->rows = 1;
    for (int i = 0; i < nd; i++) {
        int64_t d;
        if (!mf_json_integer(cJSON_GetArrayItem(shape, i), 1, (int64_t)1e12, &d)) {
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: '%s': shape[%d] is not a positive "
                         "integer",
                         f->path, base, i);
            goto out;
        }
        if (i == nd - 1)
            s->cols = d;
        else
            s->rows *= d;
    }
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(j, "nested_offset");
    s->nested = off != NULL;
    if (s->nested) {
        int64_t nbs;
        double offset;
        if (!mf_json_number(off, &offset) ||
            !mf_json_integer(cJSON_GetObjectItemCaseSensitive(j, "nested_blocksize"), 1, 4096,
                             &nbs)) {
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: '%s': nested_offset or nested_blocksize is invalid", f->path, base);
            goto out;
        }
        s->nested_blocksize = (int32_t)nbs;
        s->nested_offset = (float)offset;
    }
out:
    cJSON_Delete(j);
    return rc;
}

int bnb_read(const st_file *f, const char *base, qtensor *out, char *dtype_out, char *msg,
             size_t msg_len)
{
    memset(out, 0, sizeof *out);
    bnb_state s = {0};
    const st_tensor *qs = find_quant_state(f, base, &s.type);
    if (!qs)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: '%s' has no bitsandbytes quant state",
                       f->path, base);
    if (qs->dtype != ST_U8)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: quant state of '%s' is %s, not U8", f->path,
                       base, st_dtype_name(qs->dtype));
    int rc = parse_quant_state(f, base, qs, &s, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    const st_tensor *codes, *absmax, *qmap, *nabsmax = NULL, *nqmap = NULL;
    rc = get_part(f, base, "", ST_U8, &codes, msg, msg_len);
    if (rc == QL_OK)
        rc = get_part(f, base, ".absmax", s.nested ? ST_U8 : ST_F32, &absmax, msg, msg_len);
    if (rc == QL_OK)
        rc = get_part(f, base, ".quant_map", ST_F32, &qmap, msg, msg_len);
    if (rc == QL_OK && s.nested)
        rc = get_part(f, base, ".nested_absmax", ST_F32, &nabsmax, msg, msg_len);
    if (rc == QL_OK && s.nested)
        rc = get_part(f, base, ".nested_quant_map", ST_F32, &nqmap, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (qmap->numel != 16 || (nqmap && nqmap->numel != 256))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: '%s': quant_map has %lld values (16 expected) or "
                       "nested_quant_map is not 256",
                       f->path, base, (long long)qmap->numel);

    float *cb = f32_copy(qmap), *am = s.nested ? NULL : f32_copy(absmax);
    float *nam = nabsmax ? f32_copy(nabsmax) : NULL, *nq = nqmap ? f32_copy(nqmap) : NULL;
    if (!cb || (!s.nested && !am) || (s.nested && (!nam || !nq))) {
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: '%s': out of memory", f->path, base);
    } else {
        qt_bnb4_parts parts = {
            .kind = strcmp(s.type, "nf4") == 0 ? QT_NF4 : QT_FP4,
            .rows = s.rows,
            .cols = s.cols,
            .blocksize = s.blocksize,
            .codes = codes->data,
            .codes_bytes = codes->nbytes,
            .codebook = cb,
            .n_blocks = absmax->numel,
            .absmax = am,
            .absmax_codes = s.nested ? absmax->data : NULL,
            .nested_absmax = nam,
            .n_nested_blocks = nabsmax ? nabsmax->numel : 0,
            .nested_blocksize = s.nested_blocksize,
            .nested_offset = s.nested_offset,
            .nested_code = nq,
        };
        char why[256];
        rc = qt_from_bnb4(out, &parts, why, sizeof why);
        if (rc != QL_OK)
            rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: '%s': %s", f->path, base, why);
    }
    free(cb);
    free(am);
    free(nam);
    free(nq);
    if (rc == QL_OK && dtype_out)
        snprintf(dtype_out, 16, "%s", s.dtype);
    return rc;
}

/* The shortest decimal that reads back as the same double, as Python's
 * repr writes nested_offset into the quant state. */
static void shortest_double(double v, char *buf, size_t len)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    /* Python writes a float with a '.' or an exponent; keep it a float */
    if (!strpbrk(buf, ".en"))
        strncat(buf, ".0", len - strlen(buf) - 1);
}

/* The quant state JSON with Python json.dumps spacing, key order as
 * bitsandbytes writes it. Caller frees. */
static char *quant_state_json(const qtensor *t, const char *dtype)
{
    const char *type = t->kind == QT_NF4 ? "nf4" : "fp4";
    char *buf = malloc(512);
    if (!buf)
        return NULL;
    int n = snprintf(buf, 512,
                     "{\"quant_type\": \"%s\", \"blocksize\": %d, \"dtype\": \"%s\", "
                     "\"shape\": [%lld, %lld]",
                     type, t->blocksize, dtype, (long long)t->rows, (long long)t->cols);
    if (t->nested) {
        char off[40];
        shortest_double((double)t->nested_offset, off, sizeof off);
        n += snprintf(buf + n, 512 - (size_t)n,
                      ", \"nested_blocksize\": %d, \"nested_offset\": %s, "
                      "\"nested_dtype\": \"float32\"",
                      t->nested_blocksize, off);
    }
    snprintf(buf + n, 512 - (size_t)n, "}");
    return buf;
}

int bnb_write(st_writer *w, const char *base, const qtensor *t, const char *dtype, char *msg,
              size_t msg_len)
{
    if (t->kind != QT_NF4 && t->kind != QT_FP4)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "'%s': a %s tensor has no bitsandbytes serialization", base,
                       qt_kind_name(t->kind));
    char key[1024];
    int rc;
#define ADD(suffix, dt, nd, shp, ptr, bytes)                                                       \
    do {                                                                                           \
        snprintf(key, sizeof key, "%s%s", base, suffix);                                           \
        rc = st_writer_add(w, key, dt, nd, shp, ptr, bytes, true, msg, msg_len);                   \
        if (rc != QL_OK)                                                                           \
            return rc;                                                                             \
    } while (0)
    int64_t packed_shape[2] = {(int64_t)t->data_bytes, 1};
    ADD("", ST_U8, 2, packed_shape, t->data, t->data_bytes);
    int64_t nb[1] = {t->n_blocks};
    if (t->nested)
        ADD(".absmax", ST_U8, 1, nb, t->absmax_codes, (size_t)t->n_blocks);
    else
        ADD(".absmax", ST_F32, 1, nb, t->absmax, (size_t)t->n_blocks * sizeof(float));
    int64_t n16[1] = {16};
    ADD(".quant_map", ST_F32, 1, n16, t->codebook, sizeof t->codebook);
    if (t->nested) {
        int64_t nn[1] = {t->n_nested_blocks}, n256[1] = {256};
        ADD(".nested_absmax", ST_F32, 1, nn, t->nested_absmax,
            (size_t)t->n_nested_blocks * sizeof(float));
        ADD(".nested_quant_map", ST_F32, 1, n256, t->nested_code, sizeof t->nested_code);
    }
    char *json = quant_state_json(t, dtype);
    if (!json)
        return ql_fail(msg, msg_len, QL_ENOMEM, "'%s': out of memory", base);
    int64_t jl[1] = {(int64_t)strlen(json)};
    snprintf(key, sizeof key, "%s%s%s", base, QS_PREFIX, t->kind == QT_NF4 ? "nf4" : "fp4");
    rc = st_writer_add(w, key, ST_U8, 1, jl, json, strlen(json), true, msg, msg_len);
    free(json);
#undef ADD
    return rc;
}

/*
 * tools.c - the jobs behind `qlserve quantize` and `qlserve inspect`: whole
 * safetensors files in, a quantized file or a description out. They live in
 * the engine because they are made of the loader's parts (the safetensors
 * reader, the bitsandbytes serialization); the command line only parses
 * flags and calls them.
 */
#include "engine.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#define QS_MARK ".quant_state.bitsandbytes__"

/* A safetensors float dtype as the quant state names it, or NULL. */
static const char *torch_dtype_name(st_dtype dt)
{
    switch (dt) {
    case ST_F32: return "float32";
    case ST_F16: return "float16";
    case ST_BF16: return "bfloat16";
    default: return NULL;
    }
}

/* The tensor's values as f32 (caller frees), for F32, F16 and BF16. */
static float *to_f32(const st_tensor *t)
{
    float *v = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *v);
    if (!v)
        return NULL;
    for (int64_t i = 0; i < t->numel; i++) {
        const uint8_t *p = t->data + (size_t)i * st_dtype_size(t->dtype);
        if (t->dtype == ST_F32) {
            memcpy(&v[i], p, 4);
        } else {
            uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
            v[i] = t->dtype == ST_F16 ? qt_f16_to_f32(h) : qt_bf16_to_f32(h);
        }
    }
    return v;
}

static int quantize_one(const eng_quantize_opts *o, const st_tensor *t, const qt_quant_params *p,
                        st_writer *w, FILE *log, char *msg, size_t msg_len)
{
    float *v = to_f32(t);
    if (!v)
        return qt_fail(msg, msg_len, ENG_ENOMEM, "%s: tensor '%s': out of memory", o->in_path,
                       t->name);
    qtensor q;
    char why[256];
    int rc = qt_quantize(&q, v, t->shape[0], t->shape[1], p, why, sizeof why);
    free(v);
    if (rc != QT_OK)
        return qt_fail(msg, msg_len, ENG_EINVAL, "%s: tensor '%s': %s", o->in_path, t->name, why);
    rc = eng_bnb_write(w, t->name, &q, torch_dtype_name(t->dtype), msg, msg_len);
    if (rc == ENG_OK && log)
        fprintf(log, "%s: %s [%" PRId64 ", %" PRId64 "] -> %s blocksize %d%s, %zu -> %zu bytes\n",
                t->name, st_dtype_name(t->dtype), t->shape[0], t->shape[1], o->kind, q.blocksize,
                q.nested ? " double-quant" : "", t->nbytes, qt_nbytes(&q));
    qt_free(&q);
    return rc;
}

int eng_quantize_file(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len)
{
    int kind = qt_kind_from_name(o->kind);
    if (kind != QT_NF4 && kind != QT_FP4)
        return qt_fail(msg, msg_len, ENG_EINVAL, "--kind %s: quantize writes nf4 or fp4",
                       o->kind ? o->kind : "(missing)");
    qt_quant_params p = {.kind = (qt_kind)kind,
                         .blocksize = o->blocksize ? o->blocksize : 64,
                         .double_quant = o->double_quant};
    int32_t bs = p.blocksize;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return qt_fail(msg, msg_len, ENG_EINVAL, "--blocksize %d: a power of two from 32 to 4096",
                       (int)bs);
    st_file in;
    int rc = st_open(&in, o->in_path, msg, msg_len);
    if (rc != ENG_OK)
        return rc;
    for (size_t i = 0; i < in.n_tensors; i++) {
        if (strstr(in.tensors[i].name, QS_MARK)) {
            rc = qt_fail(msg, msg_len, ENG_EINVAL,
                         "%s: tensor '%s' shows the file is already quantized by "
                         "bitsandbytes; quantizing it again would lose precision",
                         o->in_path, in.tensors[i].name);
            st_close(&in);
            return rc;
        }
    }
    st_writer *w = st_writer_new();
    if (!w) {
        st_close(&in);
        return qt_fail(msg, msg_len, ENG_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < in.n_meta && rc == ENG_OK; i++)
        rc = st_writer_set_metadata(w, in.meta_keys[i], in.meta_values[i]);
    size_t quantized = 0;
    for (size_t i = 0; i < in.n_tensors && rc == ENG_OK; i++) {
        const st_tensor *t = &in.tensors[i];
        if (t->ndim == 2 && t->numel > 0 && torch_dtype_name(t->dtype)) {
            rc = quantize_one(o, t, &p, w, log, msg, msg_len);
            quantized++;
        } else {
            /* borrowed from the mapping, which outlives the write below */
            rc = st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes, false,
                               msg, msg_len);
            if (rc == ENG_OK && log)
                fprintf(log, "%s: %s, %d-D, copied unchanged\n", t->name, st_dtype_name(t->dtype),
                        t->ndim);
        }
    }
    if (rc == ENG_OK)
        rc = st_writer_write(w, o->out_path, msg, msg_len);
    if (rc == ENG_OK && log)
        fprintf(log, "wrote %s: %zu tensors quantized to %s, %zu copied\n", o->out_path, quantized,
                o->kind, in.n_tensors - quantized);
    st_writer_free(w);
    st_close(&in);
    return rc;
}

/* True when name is one of the parts serialized under a quantized base. */
static bool is_part_of_quantized(const st_file *f, const char *name)
{
    static const char *suffixes[] = {".absmax", ".quant_map", ".nested_absmax",
                                     ".nested_quant_map"};
    if (strstr(name, QS_MARK))
        return true;
    if (eng_bnb_is_quantized(f, name))
        return true;
    for (size_t i = 0; i < sizeof suffixes / sizeof *suffixes; i++) {
        size_t n = strlen(name), s = strlen(suffixes[i]);
        if (n > s && strcmp(name + n - s, suffixes[i]) == 0) {
            char base[1024];
            snprintf(base, sizeof base, "%.*s", (int)(n - s), name);
            if (eng_bnb_is_quantized(f, base))
                return true;
        }
    }
    return false;
}

static void print_shape(FILE *out, const st_tensor *t)
{
    fputc('[', out);
    for (int d = 0; d < t->ndim; d++)
        fprintf(out, "%s%" PRId64, d ? ", " : "", t->shape[d]);
    fputc(']', out);
}

static int inspect_quantized(const st_file *f, const char *qs_name, FILE *out, char *msg,
                             size_t msg_len)
{
    char base[1024];
    snprintf(base, sizeof base, "%.*s", (int)(strstr(qs_name, QS_MARK) - qs_name), qs_name);
    qtensor q;
    char dtype[16];
    int rc = eng_bnb_read(f, base, &q, dtype, msg, msg_len);
    if (rc != ENG_OK)
        return rc;
    float lo = 0, hi = 0;
    for (int64_t b = 0; b < q.n_blocks; b++) {
        float a = qt_block_absmax(&q, b);
        lo = b ? (a < lo ? a : lo) : a;
        hi = b ? (a > hi ? a : hi) : a;
    }
    fprintf(out, "%s: %s [%" PRId64 ", %" PRId64 "] blocksize %d, dtype %s", base,
            qt_kind_name(q.kind), q.rows, q.cols, q.blocksize, dtype);
    if (q.nested)
        fprintf(out, ", double-quant (nested blocksize %d, offset %.9g)", q.nested_blocksize,
                (double)q.nested_offset);
    fprintf(out, ", %" PRId64 " blocks, absmax in [%.6g, %.6g], %zu bytes\n", q.n_blocks,
            (double)lo, (double)hi, qt_nbytes(&q));
    qt_free(&q);
    return ENG_OK;
}

int eng_inspect_file(const char *path, FILE *out, char *msg, size_t msg_len)
{
    st_file f;
    int rc = st_open(&f, path, msg, msg_len);
    if (rc != ENG_OK)
        return rc;
    size_t bytes = 0;
    for (size_t i = 0; i < f.n_tensors; i++)
        bytes += f.tensors[i].nbytes;
    fprintf(out, "%s: safetensors, %zu tensors, %zu bytes of data\n", path, f.n_tensors, bytes);
    for (size_t i = 0; i < f.n_meta; i++)
        fprintf(out, "metadata %s = %s\n", f.meta_keys[i], f.meta_values[i]);
    for (size_t i = 0; i < f.n_tensors && rc == ENG_OK; i++) {
        const st_tensor *t = &f.tensors[i];
        if (strstr(t->name, QS_MARK)) {
            rc = inspect_quantized(&f, t->name, out, msg, msg_len);
        } else if (!is_part_of_quantized(&f, t->name)) {
            fprintf(out, "%s: %s ", t->name, st_dtype_name(t->dtype));
            print_shape(out, t);
            fprintf(out, ", %zu bytes\n", t->nbytes);
        }
    }
    st_close(&f);
    return rc;
}

/*
 * quantize.c - `qlserve quantize`: its flags (cli_quantize) and its job
 * (eng_quantize_file), a whole safetensors file in and its bitsandbytes
 * NF4/FP4 serialization out. Made of the loader's parts (the safetensors
 * reader and writer, bnb_write, qt_quantize); owns the input mapping and the
 * writer for the length of the call and touches only the output file and
 * the log stream.
 */
#include "cli.h"
#include "modelfile.h"
#include "qtensor.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

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
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: tensor '%s': out of memory", o->in_path,
                       t->name);
    qtensor q;
    char why[256];
    int rc = qt_quantize(&q, v, t->shape[0], t->shape[1], p, why, sizeof why);
    free(v);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s': %s", o->in_path, t->name, why);
    rc = bnb_write(w, t->name, &q, torch_dtype_name(t->dtype), msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log, "%s: %s [%" PRId64 ", %" PRId64 "] -> %s blocksize %d%s, %zu -> %zu bytes\n",
                t->name, st_dtype_name(t->dtype), t->shape[0], t->shape[1], o->kind, q.blocksize,
                q.nested ? " double-quant" : "", t->nbytes, qt_nbytes(&q));
    qt_free(&q);
    return rc;
}

/* The quant parameters --kind and --blocksize ask for, or QL_EINVAL. */
static int quant_params(const eng_quantize_opts *o, qt_quant_params *p, char *msg, size_t msg_len)
{
    int kind = qt_kind_from_name(o->kind);
    if (kind != QT_NF4 && kind != QT_FP4)
        return ql_fail(msg, msg_len, QL_EINVAL, "--kind %s: quantize writes nf4 or fp4",
                       o->kind ? o->kind : "(missing)");
    *p = (qt_quant_params){.kind = (qt_kind)kind,
                           .blocksize = o->blocksize ? o->blocksize : 64,
                           .double_quant = o->double_quant};
    int32_t bs = p->blocksize;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return ql_fail(msg, msg_len, QL_EINVAL, "--blocksize %d: a power of two from 32 to 4096",
                       (int)bs);
    return QL_OK;
}

/* QL_EINVAL when the file already holds bitsandbytes quant state. */
static int refuse_quantized(const st_file *in, const char *path, char *msg, size_t msg_len)
{
    for (size_t i = 0; i < in->n_tensors; i++)
        if (strstr(in->tensors[i].name, CLI_BNB_QUANT_STATE))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tensor '%s' shows the file is already quantized by "
                           "bitsandbytes; quantizing it again would lose precision",
                           path, in->tensors[i].name);
    return QL_OK;
}

/* Every tensor of in into w: 2-D floats quantized, the rest copied. */
static int add_tensors(const eng_quantize_opts *o, const st_file *in, const qt_quant_params *p,
                       st_writer *w, size_t *quantized, FILE *log, char *msg, size_t msg_len)
{
    int rc = QL_OK;
    for (size_t i = 0; i < in->n_tensors && rc == QL_OK; i++) {
        const st_tensor *t = &in->tensors[i];
        if (t->ndim == 2 && t->numel > 0 && torch_dtype_name(t->dtype)) {
            rc = quantize_one(o, t, p, w, log, msg, msg_len);
            (*quantized)++;
        } else {
            /* borrowed from the mapping, which outlives the write */
            rc = st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes, false,
                               msg, msg_len);
            if (rc == QL_OK && log)
                fprintf(log, "%s: %s, %d-D, copied unchanged\n", t->name, st_dtype_name(t->dtype),
                        t->ndim);
        }
    }
    return rc;
}

int eng_quantize_file(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len)
{
    qt_quant_params p;
    int rc = quant_params(o, &p, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    st_file in;
    rc = st_open(&in, o->in_path, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = refuse_quantized(&in, o->in_path, msg, msg_len);
    if (rc != QL_OK) {
        st_close(&in);
        return rc;
    }
    st_writer *w = st_writer_new();
    if (!w) {
        st_close(&in);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < in.n_meta && rc == QL_OK; i++)
        rc = st_writer_set_metadata(w, in.meta_keys[i], in.meta_values[i]);
    size_t quantized = 0;
    if (rc == QL_OK)
        rc = add_tensors(o, &in, &p, w, &quantized, log, msg, msg_len);
    if (rc == QL_OK)
        rc = st_writer_write(w, o->out_path, msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log, "wrote %s: %zu tensors quantized to %s, %zu copied\n", o->out_path, quantized,
                o->kind, in.n_tensors - quantized);
    st_writer_free(w);
    st_close(&in);
    return rc;
}

int cli_quantize(int argc, char **argv)
{
    char msg[1024];
    cfg_quantize c;
    int rc = cfg_parse_quantize(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("quantize", rc, msg);
    eng_quantize_opts o = {.in_path = c.in_path,
                           .out_path = c.out_path,
                           .kind = c.kind,
                           .blocksize = c.blocksize,
                           .double_quant = c.double_quant};
    rc = eng_quantize_file(&o, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve quantize: %s\n", msg);
        return 1;
    }
    return 0;
}

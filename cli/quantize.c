/*
 * quantize.c - `qlserve quantize`: its flags (cli_quantize) and its job
 * (eng_quantize_file): a whole safetensors file in and its bitsandbytes
 * NF4/FP4 serialization out, or, for --kind q2_k ... q6_k, q8_0, mxfp4 or f32, a
 * GGUF file in (f32/f16/bf16 weights, as convert_hf_to_gguf.py writes them;
 * quantized ones only with --allow-requantize, as llama-quantize's flag of
 * that name, since their dequantized values are quantized a second time)
 * and the same model requantized out, metadata (tokenizer included) copied;
 * a Hugging Face folder in goes to quantize_hf.c, which converts it first,
 * or, for --kind fp8, to quantize_fp8.c (transformers' finegrained FP8).
 * Made of the loader's parts (the safetensors and GGUF readers and
 * writers, bnb_write, qt_quantize); owns the input mapping and the writer
 * for the length of the call and touches only the output file and the log
 * stream.
 *
 * The GGUF kinds follow llama-quantize with one type for every weight
 * (src/llama-quant.cpp): a tensor is quantized when it has two or more
 * dims, its name ends in "weight" and it is not a norm, a MoE router
 * (ffn_gate_inp), a position or token-type embedding or an SSM conv; the
 * rest is copied as it is. A weight whose columns are not a multiple of
 * the kind's block falls back as llama-quantize's tensor_type_fallback
 * does (q2_k, q3_k -> q4_0, q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0; to
 * f16 when the fallback
 * does not fit either, and a kind of blocks of 32, q8_0 and mxfp4, goes
 * to f16 at once), and the log says so. Unlike llama-quantize's
 * Q4_K_M and friends there is no per-tensor mix: output.weight and
 * attn_v get the kind too (mxfp4 included: llama-quantize's MXFP4_MOE
 * writes MXFP4 for the 3-D expert tensors alone and Q8_0 for the rest). The k-quants' bytes are
 * llama.cpp's reference quantizers' (kernels/quant_kquant.c), without an importance matrix.
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

static int quantize_one(const eng_quantize_opts *o, const st_tensor *t, const qt_quant_params *p,
                        st_writer *w, FILE *log, char *msg, size_t msg_len)
{
    float *v = cli_st_to_f32(t);
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

/* --- GGUF kinds -------------------------------------------------------- */

/* What each GGUF --kind writes: the kind, its fallback, and the
 * general.file_type llama.cpp names such a file by (llama.h's
 * LLAMA_FTYPE_MOSTLY_*: Q8_0 7, Q2_K 10, Q3_K_S 11, Q4_K_S 14, Q5_K_S 16,
 * Q6_K 18, MXFP4_MOE 38, the nearest name for an all-MXFP4 file; ALL_F32
 * 0 for f32, which keeps every weight as it is). */
static const cli_gguf_target gguf_targets[] = {
    {"q2_k", QT_Q2_K, QT_Q4_0, 10},  {"q3_k", QT_Q3_K, QT_Q4_0, 11}, {"q4_k", QT_Q4_K, QT_Q5_0, 14},
    {"q5_k", QT_Q5_K, QT_Q5_1, 16},  {"q6_k", QT_Q6_K, QT_Q8_0, 18}, {"q8_0", QT_Q8_0, QT_F16, 7},
    {"mxfp4", QT_MXFP4, QT_F16, 38}, {"f32", QT_F32, QT_F32, 0},
};

static const cli_gguf_target *gguf_target_named(const char *name)
{
    for (size_t i = 0; name && i < sizeof gguf_targets / sizeof *gguf_targets; i++)
        if (strcmp(gguf_targets[i].name, name) == 0)
            return &gguf_targets[i];
    return NULL;
}

/* Tensor t of a GGUF file quantized into `kind` and written to o; a quantized t is refused
 * unless allow_requantize, when its dequantized rows are quantized again. */
static int gguf_quantize_tensor(const gguf_file *in, const gguf_tensor *t, qt_kind kind,
                                bool allow_requantize, gguf_out *o, char *msg, size_t msg_len)
{
    qtensor src;
    char why[512];
    int rc = gguf_tensor_qtensor(in, t, &src, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "%s", why);
    if (!qt_traits_table[src.kind].is_dense && !allow_requantize) {
        rc = ql_fail(msg, msg_len, QL_EINVAL,
                     "%s: tensor '%s' is already %s; quantizing it again would lose precision "
                     "(give a GGUF file with f32, f16 or bf16 weights, or --allow-requantize)",
                     in->path, t->name, qt_kind_name(src.kind));
        qt_free(&src);
        return rc;
    }
    char what[512];
    snprintf(what, sizeof what, "%s: tensor '%s'", in->path, t->name);
    rc = cli_gguf_write_rows(&src, NULL, kind, what, o, msg, msg_len);
    qt_free(&src);
    return rc;
}

/* The metadata of in, but general.file_type and general.quantization_version,
 * which say what this file is (GGML_QNT_VERSION 2, as llama-quantize). */
static int gguf_copy_meta(const gguf_file *in, const cli_gguf_target *g, gguf_out *o, char *msg,
                          size_t msg_len)
{
    int rc = QL_OK;
    for (uint64_t i = 0; i < in->n_kv && rc == QL_OK; i++)
        if (strcmp(in->kvs[i].key, "general.file_type") &&
            strcmp(in->kvs[i].key, "general.quantization_version"))
            rc = gguf_out_copy_kv(o, &in->kvs[i], msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_set_u32(o, "general.quantization_version", 2, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_set_u32(o, "general.file_type", g->file_type, msg, msg_len);
    return rc;
}

/* Declare every tensor with its planned type, logging the plan. A weight that is already
 * quantized is refused before anything is written, unless allow_requantize. */
static int gguf_declare(const gguf_file *in, const cli_gguf_target *g, bool allow_requantize,
                        gguf_out *o, size_t counts[3], FILE *log, char *msg, size_t msg_len)
{
    int rc = QL_OK;
    for (uint64_t i = 0; i < in->n_tensors && rc == QL_OK; i++) {
        const gguf_tensor *t = &in->tensors[i];
        bool fell_back;
        qt_kind k = cli_gguf_plan(g, t, &fell_back);
        bool is_float = t->ggml_type == GGML_TYPE_F32 || t->ggml_type == GGML_TYPE_F16 ||
                        t->ggml_type == GGML_TYPE_BF16;
        if (k != QT_KIND_COUNT && !is_float && !allow_requantize)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tensor '%s' is already %s; quantizing it again would lose "
                           "precision (give a GGUF file with f32, f16 or bf16 weights, or "
                           "--allow-requantize)",
                           in->path, t->name, gguf_ggml_type_name(t->ggml_type));
        uint32_t type = k == QT_KIND_COUNT ? t->ggml_type : cli_ggml_type_of(k);
        rc = gguf_out_add_tensor(o, t->name, type, t->n_dims, t->ne, msg, msg_len);
        counts[k == QT_KIND_COUNT ? 2 : fell_back ? 1 : 0]++;
        if (rc != QL_OK || !log)
            continue;
        if (k == QT_KIND_COUNT)
            fprintf(log, "%s: %s, %d-D, copied unchanged\n", t->name,
                    gguf_ggml_type_name(t->ggml_type), t->n_dims);
        else if (fell_back)
            fprintf(log,
                    "%s: %s [%" PRId64 ", %" PRId64 "] -> %s: %" PRId64 " columns are not a "
                    "multiple of the %s block of %d, falling back as llama-quantize does\n",
                    t->name, gguf_ggml_type_name(t->ggml_type), t->ne[0], t->ne[1], qt_kind_name(k),
                    t->ne[0], g->name, (int)qt_traits_table[g->kind].block_size);
        else
            fprintf(log, "%s: %s [%" PRId64 ", %" PRId64 "] -> %s\n", t->name,
                    gguf_ggml_type_name(t->ggml_type), t->ne[0], t->ne[1], qt_kind_name(k));
    }
    return rc;
}

static int gguf_write_data(const gguf_file *in, const cli_gguf_target *g, bool allow_requantize,
                           gguf_out *o, char *msg, size_t msg_len)
{
    int rc = QL_OK;
    for (uint64_t i = 0; i < in->n_tensors && rc == QL_OK; i++) {
        const gguf_tensor *t = &in->tensors[i];
        bool fell_back;
        qt_kind k = cli_gguf_plan(g, t, &fell_back);
        rc = k == QT_KIND_COUNT ? gguf_out_write(o, t->data, t->nbytes, msg, msg_len)
                                : gguf_quantize_tensor(in, t, k, allow_requantize, o, msg, msg_len);
    }
    return rc;
}

/* QL_OK when path starts with GGUF's magic; else a sentence saying what
 * a GGUF --kind needs. */
static int require_gguf(const char *path, const char *kind, char *msg, size_t msg_len)
{
    char magic[4] = {0};
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot open", path);
    size_t got = fread(magic, 1, 4, fp);
    fclose(fp);
    if (got != 4 || memcmp(magic, "GGUF", 4) != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s is not a GGUF file: --kind %s reads a GGUF file with f32, f16 or bf16 "
                       "weights (e.g. from convert_hf_to_gguf.py --outtype f16), or a Hugging "
                       "Face folder, and writes it quantized",
                       path, kind);
    return QL_OK;
}

static int quantize_gguf(const eng_quantize_opts *o, const cli_gguf_target *g, FILE *log, char *msg,
                         size_t msg_len)
{
    if (o->double_quant)
        return ql_fail(msg, msg_len, QL_EINVAL, "--double-quant is for nf4 and fp4, not %s",
                       g->name);
    int rc = require_gguf(o->in_path, g->name, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    gguf_file in;
    rc = gguf_open(&in, o->in_path, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    gguf_out *w = gguf_out_new(in.alignment);
    size_t counts[3] = {0}; /* quantized to the kind, fell back, copied */
    rc = w ? gguf_copy_meta(&in, g, w, msg, msg_len)
           : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    if (rc == QL_OK)
        rc = gguf_declare(&in, g, o->allow_requantize, w, counts, log, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_begin(w, o->out_path, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_write_data(&in, g, o->allow_requantize, w, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_finish(w, msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log, "wrote %s: %zu tensors quantized to %s, %zu fell back, %zu copied\n",
                o->out_path, counts[0], g->name, counts[1], counts[2]);
    gguf_out_free(w);
    gguf_close(&in);
    return rc;
}

/* The quant parameters --kind and --blocksize ask for, or QL_EINVAL. */
static int quant_params(const eng_quantize_opts *o, qt_quant_params *p, char *msg, size_t msg_len)
{
    int kind = qt_kind_from_name(o->kind);
    if (kind != QT_NF4 && kind != QT_FP4)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--kind %s: quantize writes nf4 or fp4 (safetensors), q2_k, q3_k, "
                       "q4_k, q5_k, q6_k, q8_0, mxfp4 or f32 (GGUF), or fp8 (a Hugging Face "
                       "folder, transformers' finegrained FP8)",
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

/* QL_EINVAL when the file already holds bitsandbytes quant state, or FP8
 * codes and their block scales (transformers' finegrained FP8): the
 * scales are 2-D floats, and quantizing them as weights would misread the
 * checkpoint; likewise GPTQ's and AWQ's packed `qweight` / `qzeros`
 * (int32) and their f16 `scales`, and compressed-tensors' (and fbgemm's)
 * `weight_packed` / `weight_scale` / `weight_zero_point` (an int8 naive
 * `weight` or a bf16 scale would pass for a weight otherwise). */
static const struct {
    const char *suffix, *format, *codes;
} packed_names[] = {
    {".qweight", "gptq or awq", "packed int32"},
    {".qzeros", "gptq or awq", "packed int32"},
    {".weight_packed", "compressed-tensors or fbgemm", "packed int32 or int8"},
    {".weight_scale", "compressed-tensors or fbgemm", "packed int32 or int8"},
    {".weight_zero_point", "compressed-tensors or fbgemm", "packed int32 or int8"},
};

static int refuse_quantized(const st_file *in, const char *path, char *msg, size_t msg_len)
{
    for (size_t i = 0; i < in->n_tensors; i++) {
        const st_tensor *t = &in->tensors[i];
        if (strstr(t->name, CLI_BNB_QUANT_STATE))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tensor '%s' shows the file is already quantized by "
                           "bitsandbytes; quantizing it again would lose precision",
                           path, t->name);
        const char *dot = strrchr(t->name, '.');
        for (size_t k = 0; dot && k < sizeof packed_names / sizeof *packed_names; k++)
            if (strcmp(dot, packed_names[k].suffix) == 0)
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "%s: tensor '%s' shows the file is already quantized (%s: %s "
                               "codes, their scales beside them); quantizing it again would "
                               "lose precision",
                               path, t->name, packed_names[k].format, packed_names[k].codes);
        if (t->dtype == ST_F8_E4M3 || t->dtype == ST_F8_E8M0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tensor '%s' is %s: the file is already quantized (fp8, its "
                           "block scales beside it); quantizing it again would lose precision",
                           path, t->name, st_dtype_name(t->dtype));
    }
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
    const cli_gguf_target *g = gguf_target_named(o->kind);
    /* only a GGUF file can hold weights quantized in a kind we dequantize */
    if (o->allow_requantize && (!g || cli_is_folder(o->in_path)))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--allow-requantize is for a GGUF file in with a GGUF --kind, not %s "
                       "from %s",
                       o->kind ? o->kind : "(missing)", o->in_path);
    if (o->kind && strcmp(o->kind, "fp8") == 0)
        return cli_quantize_fp8(o, log, msg, msg_len);
    if (o->block || o->scale_fmt)
        return ql_fail(msg, msg_len, QL_EINVAL, "--%s is for --kind fp8, not %s",
                       o->block ? "block" : "scale-fmt", o->kind ? o->kind : "(missing)");
    if (g && cli_is_folder(o->in_path))
        return cli_quantize_hf(o, g, log, msg, msg_len);
    if (g)
        return quantize_gguf(o, g, log, msg, msg_len);
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
                           .double_quant = c.double_quant,
                           .block = c.block,
                           .scale_fmt = c.scale_fmt,
                           .allow_requantize = c.allow_requantize};
    rc = eng_quantize_file(&o, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve quantize: %s\n", msg);
        return 1;
    }
    return 0;
}

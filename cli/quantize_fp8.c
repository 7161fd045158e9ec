/*
 * quantize_fp8.c - `qlserve quantize --in DIR --out DIR --kind fp8`: a
 * Hugging Face folder of float weights written as transformers' finegrained
 * FP8 (FineGrainedFP8Config, quant_method "fp8"), the layout of Qwen3-*-FP8
 * and DeepSeek's releases, which transformers, vLLM and qlserve load. It
 * offers cli_quantize_fp8 (cli.h); it owns the input shards' mappings and
 * one writer at a time for the length of the call and touches only the
 * output folder and the log stream.
 *
 * What it writes is what transformers' own quantizer writes for the same
 * weights (integrations/finegrained_fp8.py, Fp8Quantize._quantize_one):
 *
 *   - every linear of the decoder layers (the modules replace_with_fp8_linear
 *     swaps for FP8Linear: q/k/v/o, gate/up/down, Phi-3's qkv_proj and
 *     gate_up_proj, Mixtral's w1/w2/w3, Qwen2-MoE's shared expert and its
 *     gate) and the fused experts transformers 5 holds as FP8Experts
 *     (mlp.experts.gate_up_proj [experts, 2 * ff, hidden] and down_proj)
 *     become F8_E4M3 codes with a `weight_scale_inv` per block of the
 *     weight's last two dims (`<x>.weight_scale_inv`, or `<x>_scale_inv`
 *     for a fused expert tensor), F32 (scale_fmt "float") or F8_E8M0
 *     (scale_fmt "ue8m0"), by the kernels' quantizer (quant_fp8.c, which
 *     test_fp8 holds to Fp8Quantize byte for byte);
 *   - a weight whose last two dims the block does not divide is passed
 *     through as Fp8Quantize passes it, and its module is named in
 *     modules_to_not_convert so that transformers builds a plain Linear
 *     for it; lm_head is always named there (what transformers'
 *     get_keys_to_not_convert gives), and the embeddings, norms and MoE
 *     routers, which are no nn.Linear, are copied in their own dtype;
 *   - config.json gains FineGrainedFP8Config.to_dict()'s fields; the
 *     shards keep their names (the index is rewritten with the scales'
 *     entries and the new total_size), and every other file of the folder
 *     (tokenizer, generation config, chat template) is copied.
 *
 * Refused by name: an architecture outside the families listed in
 * fp8_archs, a folder whose config already has a quantization_config or
 * whose shards hold quantized tensors, a block that is not two positive
 * sizes, a scale format other than float and ue8m0, --double-quant.
 */
#include "cli.h"
#include "modelfile.h"
#include "qtensor.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define FP8_JSON_MAX ((size_t)64 << 20)
#define FP8_MAX_SKIP 4096 /* modules named in modules_to_not_convert */

/* What one run writes: the options and what the shards taught us. */
typedef struct fp8_job {
    const eng_quantize_opts *o;
    qt_quant_params p;
    const char *fmt;     /* "float" or "ue8m0" */
    cJSON *skip;         /* modules_to_not_convert, lm_head first */
    cJSON *weight_map;   /* name -> shard, for the index */
    uint64_t total_size; /* bytes of every tensor written */
    size_t quantized, kept, copied;
    FILE *log;
} fp8_job;

/* The families whose linears replace_with_fp8_linear swaps and whose
 * experts, when they have them, are per expert or FP8Experts' fused
 * [experts, out, in] (GPT-OSS's transposed, biased experts are not). */
static const char *const fp8_archs[] = {
    "LlamaForCausalLM",    "MistralForCausalLM",  "Qwen2ForCausalLM",   "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
};

/* The nn.Linear modules of those families' decoder layers, by their last
 * name component. */
static const char *const fp8_linears[] = {
    "q_proj",    "k_proj",       "v_proj", "o_proj", "qkv_proj", "gate_proj",          "up_proj",
    "down_proj", "gate_up_proj", "w1",     "w2",     "w3",       "shared_expert_gate",
};

/* The one widening of a safetensors float tensor both quantize paths use
 * (quantize.c's bitsandbytes one calls down here: cli.h). */
float *cli_st_to_f32(const st_tensor *t)
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

/* --- options ------------------------------------------------------------------ */

/* --block RxC (default 128x128, transformers' weight_block_size) and
 * --scale-fmt float|ue8m0 into j->p. */
static int fp8_options(fp8_job *j, char *msg, size_t msg_len)
{
    const eng_quantize_opts *o = j->o;
    if (o->double_quant)
        return ql_fail(msg, msg_len, QL_EINVAL, "--double-quant is for nf4 and fp4, not fp8");
    const char *block = o->block ? o->block : "128x128";
    long r = 0, c = 0;
    int used = 0;
    if (sscanf(block, "%ld%*[xX]%ld%n", &r, &c, &used) != 2 || block[used] != '\0' || r < 1 ||
        c < 1 || r > 65536 || c > 65536)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--block %s: two block sizes ROWSxCOLS from 1 to 65536 (transformers' "
                       "weight_block_size, e.g. 128x128)",
                       block);
    j->fmt = o->scale_fmt ? o->scale_fmt : "float";
    if (strcmp(j->fmt, "float") != 0 && strcmp(j->fmt, "ue8m0") != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--scale-fmt %s: float (f32 scales) or ue8m0 (one F8_E8M0 byte per block)",
                       j->fmt);
    j->p = (qt_quant_params){.kind = QT_FP8,
                             .block_rows = (int32_t)r,
                             .block_cols = (int32_t)c,
                             .scale_dtype = j->fmt[0] == 'u' ? QT_SCALE_E8M0 : QT_SCALE_F32};
    return QL_OK;
}

/* --- which tensors ------------------------------------------------------------- */

/* The module a tensor belongs to ("model.layers.0.mlp.experts" for a fused
 * expert tensor, the name less ".weight" for a linear) into out, and
 * whether Fp8Quantize would be handed the tensor: a linear's 2-D weight
 * or a fused expert tensor, in a float dtype. */
static bool fp8_candidate(const st_tensor *t, char *module, size_t len)
{
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16)
        return false;
    int layer, at = 0;
    if (sscanf(t->name, "model.layers.%d.%n", &layer, &at) != 1 || at == 0)
        return false;
    size_t n = strlen(t->name);
    static const char *const fused[2] = {".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"};
    for (int k = 0; k < 2; k++) {
        size_t f = strlen(fused[k]);
        if (t->ndim == 3 && n > f && strcmp(t->name + n - f, fused[k]) == 0) {
            snprintf(module, len, "%.*s", (int)(n - f + strlen(".mlp.experts")), t->name);
            return true;
        }
    }
    if (t->ndim != 2 || n < 8 || strcmp(t->name + n - 7, ".weight") != 0)
        return false;
    snprintf(module, len, "%.*s", (int)(n - 7), t->name);
    const char *last = strrchr(module, '.');
    for (size_t i = 0; last && i < sizeof fp8_linears / sizeof *fp8_linears; i++)
        if (strcmp(last + 1, fp8_linears[i]) == 0)
            return true;
    return false;
}

/* Name module in modules_to_not_convert once. */
static int fp8_skip(fp8_job *j, const char *module, char *msg, size_t msg_len)
{
    const cJSON *e;
    cJSON_ArrayForEach (e, j->skip)
        if (strcmp(e->valuestring, module) == 0)
            return QL_OK;
    if (cJSON_GetArraySize(j->skip) >= FP8_MAX_SKIP)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: more than %d modules left dense; give a block that divides the "
                       "weights",
                       j->o->in_path, FP8_MAX_SKIP);
    cJSON *s = cJSON_CreateString(module);
    if (!s || !cJSON_AddItemToArray(j->skip, s))
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    return QL_OK;
}

/* Tensor t as FP8 codes and block scales into w (both copied). */
static int fp8_quantize_tensor(fp8_job *j, const st_file *f, const st_tensor *t, st_writer *w,
                               const char *shard, char *msg, size_t msg_len)
{
    int64_t rows = t->shape[t->ndim - 2], cols = t->shape[t->ndim - 1];
    int64_t lead = t->ndim == 3 ? t->shape[0] : 1;
    qtensor q;
    char why[256];
    /* a 3-D stack is its experts' rows back to back; whole blocks per
     * expert make the stacked grid each expert's grid in turn */
    float *v = cli_st_to_f32(t);
    if (!v)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: tensor '%s': out of memory", f->path, t->name);
    int rc = qt_quantize(&q, v, lead * rows, cols, &j->p, why, sizeof why);
    free(v);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "%s: tensor '%s': %s", f->path, t->name, why);
    char scale_name[600];
    size_t n = strlen(t->name);
    if (t->ndim == 2)
        snprintf(scale_name, sizeof scale_name, "%.*s.weight_scale_inv", (int)(n - 7), t->name);
    else
        snprintf(scale_name, sizeof scale_name, "%s_scale_inv", t->name);
    int64_t sshape[3] = {lead, rows / j->p.block_rows, cols / j->p.block_cols};
    st_dtype sdt = j->p.scale_dtype == QT_SCALE_E8M0 ? ST_F8_E8M0 : ST_F32;
    size_t sbytes = (size_t)(lead * sshape[1] * sshape[2]) * qt_scale_dtype_size(j->p.scale_dtype);
    const int64_t *ss = t->ndim == 3 ? sshape : sshape + 1;
    rc = st_writer_add(w, t->name, ST_F8_E4M3, t->ndim, t->shape, q.data, q.data_bytes, true, msg,
                       msg_len);
    if (rc == QL_OK)
        rc = st_writer_add(w, scale_name, sdt, t->ndim, ss, q.block_scales, sbytes, true, msg,
                           msg_len);
    qt_free(&q);
    if (rc == QL_OK && j->log)
        fprintf(j->log, "%s: %s %d-D -> fp8 block %dx%d, scales %s %s\n", t->name,
                st_dtype_name(t->dtype), t->ndim, j->p.block_rows, j->p.block_cols,
                st_dtype_name(sdt), scale_name);
    j->total_size += (uint64_t)(t->numel + (int64_t)sbytes);
    j->quantized++;
    if (rc == QL_OK && (!cJSON_AddStringToObject(j->weight_map, t->name, shard) ||
                        !cJSON_AddStringToObject(j->weight_map, scale_name, shard)))
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    return rc;
}

/* Every tensor of shard `file` into out_dir/file: quantized, kept dense
 * (and named in modules_to_not_convert) or copied as it is. */
static int fp8_shard(fp8_job *j, const char *file, char *msg, size_t msg_len)
{
    char in[PATH_MAX], out[PATH_MAX];
    if (strchr(file, '/'))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: shard name '%s' leaves the folder",
                       j->o->in_path, file);
    snprintf(in, sizeof in, "%s/%s", j->o->in_path, file);
    snprintf(out, sizeof out, "%s/%s", j->o->out_path, file);
    st_file f;
    int rc = st_open(&f, in, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    st_writer *w = st_writer_new();
    if (!w)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (size_t i = 0; w && i < f.n_meta && rc == QL_OK; i++)
        rc = st_writer_set_metadata(w, f.meta_keys[i], f.meta_values[i]);
    for (size_t i = 0; w && i < f.n_tensors && rc == QL_OK; i++) {
        const st_tensor *t = &f.tensors[i];
        char module[512];
        if (t->dtype == ST_F8_E4M3 || t->dtype == ST_F8_E8M0 || t->dtype == ST_F8_E5M2) {
            rc = ql_fail(msg, msg_len, QL_EINVAL,
                         "%s: tensor '%s' is %s: the folder is already quantized; quantizing "
                         "it again would lose precision",
                         in, t->name, st_dtype_name(t->dtype));
        } else if (fp8_candidate(t, module, sizeof module) &&
                   t->shape[t->ndim - 2] % j->p.block_rows == 0 &&
                   t->shape[t->ndim - 1] % j->p.block_cols == 0 && t->numel > 0) {
            rc = fp8_quantize_tensor(j, &f, t, w, file, msg, msg_len);
            continue;
        } else if (fp8_candidate(t, module, sizeof module)) {
            /* as Fp8Quantize passes through a shape its block does not
             * divide; transformers then needs the module left a Linear */
            rc = fp8_skip(j, module, msg, msg_len);
            j->kept++;
            if (rc == QL_OK && j->log)
                fprintf(j->log,
                        "%s: %s, the block %dx%d does not divide it: kept, %s in "
                        "modules_to_not_convert\n",
                        t->name, st_dtype_name(t->dtype), j->p.block_rows, j->p.block_cols, module);
        } else {
            j->copied++;
        }
        /* borrowed from the mapping, which outlives the write */
        if (rc == QL_OK)
            rc = st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes, false,
                               msg, msg_len);
        j->total_size += t->nbytes;
        if (rc == QL_OK && !cJSON_AddStringToObject(j->weight_map, t->name, file))
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    if (rc == QL_OK)
        rc = st_writer_write(w, out, msg, msg_len);
    st_writer_free(w);
    st_close(&f);
    return rc;
}

/* --- the folder ------------------------------------------------------------------ */

/* The shards' file names (caller deletes): the index's weight_map values
 * once each, or model.safetensors. *indexed says which. */
static int fp8_shard_names(const char *dir, cJSON **names, bool *indexed, char *msg, size_t msg_len)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    struct stat sb;
    *indexed = stat(path, &sb) == 0;
    *names = cJSON_CreateArray();
    if (!*names)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    if (!*indexed)
        return cJSON_AddItemToArray(*names, cJSON_CreateString("model.safetensors"))
                   ? QL_OK
                   : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    cJSON *idx;
    int rc = mf_read_json(path, FP8_JSON_MAX, &idx, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map"), *e, *n;
    if (!cJSON_IsObject(map))
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"weight_map\" is missing", path);
    cJSON_ArrayForEach (e, map) {
        if (rc != QL_OK)
            break;
        if (!cJSON_IsString(e)) {
            rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: weight_map entry '%s' is not a file name",
                         path, e->string);
            break;
        }
        bool seen = false;
        cJSON_ArrayForEach (n, *names)
            seen = seen || strcmp(n->valuestring, e->valuestring) == 0;
        if (!seen && !cJSON_AddItemToArray(*names, cJSON_CreateString(e->valuestring)))
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    cJSON_Delete(idx);
    return rc;
}

/* config.json with FineGrainedFP8Config.to_dict()'s fields (refusing a
 * config that is already quantized or of another family). */
static int fp8_config(fp8_job *j, cJSON **config, char *msg, size_t msg_len)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/config.json", j->o->in_path);
    int rc = mf_read_json(path, FP8_JSON_MAX, config, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(*config, "architectures");
    const cJSON *first = cJSON_IsArray(a) ? cJSON_GetArrayItem(a, 0) : NULL;
    const char *arch = cJSON_IsString(first) ? first->valuestring : "(none)";
    bool known = false;
    for (size_t i = 0; i < sizeof fp8_archs / sizeof *fp8_archs; i++)
        known = known || strcmp(arch, fp8_archs[i]) == 0;
    if (!known)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: architecture %s is not one quantize writes as fp8 (Llama, Mistral, "
                       "Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, Phi-3)",
                       path, arch);
    const cJSON *had = cJSON_GetObjectItemCaseSensitive(*config, "quantization_config");
    if (had && !cJSON_IsNull(had))
        return ql_fail(
            msg, msg_len, QL_EINVAL,
            "%s: the model already has a quantization_config (quant_method %s); "
            "quantize reads float weights",
            path, mf_json_str(had, "quant_method") ? mf_json_str(had, "quant_method") : "(none)");
    return QL_OK;
}

static int fp8_write_json(const char *path, const cJSON *j, char *msg, size_t msg_len)
{
    char *text = cJSON_Print(j);
    FILE *fp = text ? fopen(path, "wb") : NULL;
    bool ok = fp && fputs(text, fp) >= 0 && fputc('\n', fp) != EOF;
    ok = fp && fclose(fp) == 0 && ok;
    free(text);
    return ok ? QL_OK : ql_fail(msg, msg_len, QL_EIO, "%s: cannot write", path);
}

/* The quantization_config into config and both JSON files into out. */
static int fp8_finish(fp8_job *j, cJSON *config, bool indexed, char *msg, size_t msg_len)
{
    cJSON *qc = cJSON_CreateObject();
    cJSON *bs = cJSON_CreateArray();
    bool ok = qc && bs && cJSON_AddStringToObject(qc, "activation_scheme", "dynamic") &&
              cJSON_AddFalseToObject(qc, "dequantize") &&
              cJSON_AddStringToObject(qc, "expert_dtype", "fp8") &&
              cJSON_AddNullToObject(qc, "modules_to_convert");
    ok = ok && cJSON_AddItemToObject(qc, "modules_to_not_convert", j->skip);
    if (ok)
        j->skip = NULL; /* qc owns it now */
    ok = ok && cJSON_AddStringToObject(qc, "quant_method", "fp8") &&
         cJSON_AddStringToObject(qc, "scale_fmt", j->fmt) &&
         cJSON_AddItemToArray(bs, cJSON_CreateNumber(j->p.block_rows)) &&
         cJSON_AddItemToArray(bs, cJSON_CreateNumber(j->p.block_cols)) &&
         cJSON_AddItemToObject(qc, "weight_block_size", bs);
    if (ok)
        bs = NULL;
    ok = ok && cJSON_AddItemToObject(config, "quantization_config", qc);
    if (!ok) {
        cJSON_Delete(bs);
        cJSON_Delete(qc);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/config.json", j->o->out_path);
    int rc = fp8_write_json(path, config, msg, msg_len);
    if (rc != QL_OK || !indexed)
        return rc;
    cJSON *idx = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    ok = idx && meta && cJSON_AddNumberToObject(meta, "total_size", (double)j->total_size) &&
         cJSON_AddItemToObject(idx, "metadata", meta);
    if (ok)
        meta = NULL;
    ok = ok && cJSON_AddItemToObject(idx, "weight_map", j->weight_map);
    if (ok)
        j->weight_map = NULL;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", j->o->out_path);
    rc = ok ? fp8_write_json(path, idx, msg, msg_len)
            : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    cJSON_Delete(meta);
    cJSON_Delete(idx);
    return rc;
}

/* Every other regular file of the folder (tokenizer, generation config,
 * chat template, README) copied into out. */
static int fp8_copy_rest(const char *in, const char *out, char *msg, size_t msg_len)
{
    DIR *d = opendir(in);
    if (!d)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot read the folder", in);
    int rc = QL_OK;
    struct dirent *e;
    while (rc == QL_OK && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        char src[PATH_MAX], dst[PATH_MAX];
        struct stat sb;
        snprintf(src, sizeof src, "%s/%s", in, e->d_name);
        if (stat(src, &sb) != 0 || !S_ISREG(sb.st_mode) ||
            (n > 12 && strcmp(e->d_name + n - 12, ".safetensors") == 0) ||
            strcmp(e->d_name, "config.json") == 0 ||
            strcmp(e->d_name, "model.safetensors.index.json") == 0)
            continue;
        snprintf(dst, sizeof dst, "%s/%s", out, e->d_name);
        char *text = NULL;
        size_t len = 0;
        rc = mf_read_file(src, (size_t)1 << 30, &text, &len, msg, msg_len);
        FILE *fp = rc == QL_OK ? fopen(dst, "wb") : NULL;
        if (rc == QL_OK && (!fp || fwrite(text, 1, len, fp) != len))
            rc = ql_fail(msg, msg_len, QL_EIO, "%s: cannot write", dst);
        if (fp && fclose(fp) != 0 && rc == QL_OK)
            rc = ql_fail(msg, msg_len, QL_EIO, "%s: cannot write", dst);
        free(text);
    }
    closedir(d);
    return rc;
}

/* The output folder made (or taken when it exists), never the input. */
static int fp8_out_folder(const eng_quantize_opts *o, char *msg, size_t msg_len)
{
    if (mkdir(o->out_path, 0755) != 0 && errno != EEXIST)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot make the folder: %s", o->out_path,
                       strerror(errno));
    char a[PATH_MAX], b[PATH_MAX];
    if (!realpath(o->in_path, a) || !realpath(o->out_path, b) || !cli_is_folder(b))
        return ql_fail(msg, msg_len, QL_EIO, "%s: not a folder quantize can write", o->out_path);
    if (strcmp(a, b) == 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--out %s is the input folder; quantize writes a new folder", o->out_path);
    return QL_OK;
}

int cli_quantize_fp8(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len)
{
    fp8_job j = {.o = o, .log = log};
    if (!cli_is_folder(o->in_path))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s is not a folder: --kind fp8 reads a Hugging Face folder (config.json, "
                       "safetensors) and writes one",
                       o->in_path);
    cJSON *config = NULL, *names = NULL;
    bool indexed = false;
    int rc = fp8_options(&j, msg, msg_len);
    if (rc == QL_OK)
        rc = fp8_config(&j, &config, msg, msg_len);
    if (rc == QL_OK)
        rc = fp8_shard_names(o->in_path, &names, &indexed, msg, msg_len);
    if (rc == QL_OK)
        rc = fp8_out_folder(o, msg, msg_len);
    j.skip = cJSON_CreateArray();
    j.weight_map = cJSON_CreateObject();
    if (rc == QL_OK &&
        (!j.skip || !j.weight_map || !cJSON_AddItemToArray(j.skip, cJSON_CreateString("lm_head"))))
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    const cJSON *n;
    cJSON_ArrayForEach (n, names)
        if (rc == QL_OK)
            rc = fp8_shard(&j, n->valuestring, msg, msg_len);
    if (rc == QL_OK)
        rc = fp8_finish(&j, config, indexed, msg, msg_len);
    if (rc == QL_OK)
        rc = fp8_copy_rest(o->in_path, o->out_path, msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log,
                "wrote %s: %zu tensors quantized to fp8 (block %dx%d, %s scales), %zu linears "
                "kept dense, %zu copied\n",
                o->out_path, j.quantized, j.p.block_rows, j.p.block_cols, j.fmt, j.kept, j.copied);
    cJSON_Delete(j.skip);
    cJSON_Delete(j.weight_map);
    cJSON_Delete(names);
    cJSON_Delete(config);
    return rc;
}

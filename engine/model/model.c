/*
 * model.c - load a model into an eng_model from what users arrive with: a
 * Hugging Face folder (config.json, one model.safetensors or shards listed
 * in model.safetensors.index.json, tokenizer.json), the same folder saved by
 * transformers with bitsandbytes 4-bit weights, or a GGUF file.
 *
 * Shape of the loader: first the config (what the model must look like),
 * then each tensor by name, checked against the shape the config implies
 * before it is kept. Weights stay in the mapped file wherever the file's
 * layout is the kind's layout (dense tensors, bitsandbytes codes are copied
 * once, GGUF blocks are borrowed); quantizing on load replaces a dense (or
 * GGUF-block) weight by a new qtensor, and never touches one that is already
 * NF4/FP4/AFFINE. Nothing here computes: the forward pass lives elsewhere.
 */
#include "model.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *eng_arch_name(eng_arch a)
{
    switch (a) {
    case ENG_ARCH_LLAMA: return "llama";
    case ENG_ARCH_MISTRAL: return "mistral";
    case ENG_ARCH_QWEN2: return "qwen2";
    }
    return "unknown";
}

/* What the loader carries while it works. */
typedef struct loader {
    const eng_load_opts *o;
    eng_model *m;
    char dir[4096];      /* the folder (HF) */
    bool quantize;       /* a quant kind was asked for */
    qt_quant_params qp;  /* ... and its parameters */
    bool bnb_checkpoint; /* config.json says bitsandbytes 4-bit */
    char bnb_type[8];    /* "nf4" / "fp4" from quantization_config */
    qt_kind dtype;       /* target dense kind, or QT_KIND_COUNT to keep */
} loader;

/* --- reading files --------------------------------------------------------- */

/* config.json and the shard index are small; anything past this is not
 * one of them. */
#define JSON_MAX_BYTES ((size_t)64 << 20)

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* --- config.json ------------------------------------------------------------ */

/* An integer field in [lo, hi]; absent gives def (or an error when def < 0
 * and required). */
static int json_int_field(const char *path, const cJSON *j, const char *key, int64_t def,
                          bool required, int64_t lo, int64_t hi, int32_t *out, char *msg,
                          size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) {
        if (required)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"%s\" is missing", path, key);
        *out = (int32_t)def;
        return QL_OK;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble < (double)lo || v->valuedouble > (double)hi)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: \"%s\" must be an integer in [%" PRId64 ", %" PRId64 "]", path, key, lo,
                       hi);
    *out = (int32_t)v->valuedouble;
    return QL_OK;
}

static int json_float_field(const char *path, const cJSON *j, const char *key, double def,
                            float *out, char *msg, size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) {
        *out = (float)def;
        return QL_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble <= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"%s\" must be a positive number", path, key);
    *out = (float)v->valuedouble;
    return QL_OK;
}

static bool json_bool_field(const cJSON *j, const char *key, bool def)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

/* bos/eos ids may be an int or a list of ints (the first is taken). */
static int32_t json_token_id(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (cJSON_IsArray(v))
        v = cJSON_GetArrayItem(v, 0);
    if (cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < 1e9)
        return (int32_t)v->valuedouble;
    return -1;
}

/* rope_scaling (transformers 4), or rope_parameters (transformers 5, which
 * moved rope_theta and the scaling's rope_type and factors into it). */
static int parse_rope_scaling(const char *path, const cJSON *j, eng_config *c, char *msg,
                              size_t msg_len)
{
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(j, "rope_scaling");
    if (!rs || cJSON_IsNull(rs))
        rs = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    c->rope_scaling = ENG_ROPE_NONE;
    c->rope_factor = 1.0f;
    if (!rs || cJSON_IsNull(rs))
        return QL_OK;
    if (!cJSON_IsObject(rs))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"rope_scaling\" is not an object", path);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!type)
        type = cJSON_GetObjectItemCaseSensitive(rs, "type");
    const char *t = cJSON_IsString(type) ? type->valuestring : "(missing)";
    int rc = json_float_field(path, rs, "factor", 1.0, &c->rope_factor, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (strcmp(t, "default") == 0)
        return QL_OK;
    if (strcmp(t, "linear") == 0) {
        c->rope_scaling = ENG_ROPE_LINEAR;
        return QL_OK;
    }
    if (strcmp(t, "llama3") == 0) {
        c->rope_scaling = ENG_ROPE_LLAMA3;
        rc = json_float_field(path, rs, "low_freq_factor", 1.0, &c->rope_low_freq_factor, msg,
                              msg_len);
        if (rc == QL_OK)
            rc = json_float_field(path, rs, "high_freq_factor", 4.0, &c->rope_high_freq_factor, msg,
                                  msg_len);
        if (rc == QL_OK)
            rc = json_int_field(path, rs, "original_max_position_embeddings", 8192, false, 1,
                                1 << 24, &c->rope_original_max_position, msg, msg_len);
        return rc;
    }
    return ql_fail(msg, msg_len, QL_EINVAL,
                   "%s: rope_scaling type \"%s\" is not supported (linear, llama3)", path, t);
}

static int parse_hf_config(loader *L, const char *path, const cJSON *j, char *msg, size_t msg_len)
{
    eng_config *c = &L->m->cfg;
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(j, "architectures");
    const cJSON *a0 = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
    const char *arch = cJSON_IsString(a0) ? a0->valuestring : NULL;
    if (!arch)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"architectures\" is missing", path);
    if (strcmp(arch, "LlamaForCausalLM") == 0)
        c->arch = ENG_ARCH_LLAMA;
    else if (strcmp(arch, "MistralForCausalLM") == 0)
        c->arch = ENG_ARCH_MISTRAL;
    else if (strcmp(arch, "Qwen2ForCausalLM") == 0)
        c->arch = ENG_ARCH_QWEN2;
    else
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: architecture %s is not one qlserve runs (LlamaForCausalLM, "
                       "MistralForCausalLM, Qwen2ForCausalLM)",
                       path, arch);
    int rc = QL_OK;
#define INT_FIELD(key, def, req, lo, hi, dst)                                                      \
    if (rc == QL_OK)                                                                               \
    rc = json_int_field(path, j, key, def, req, lo, hi, dst, msg, msg_len)
    INT_FIELD("vocab_size", 0, true, 1, 1 << 24, &c->vocab_size);
    INT_FIELD("hidden_size", 0, true, 1, 1 << 20, &c->hidden_size);
    INT_FIELD("intermediate_size", 0, true, 1, 1 << 22, &c->intermediate_size);
    INT_FIELD("num_hidden_layers", 0, true, 1, 4096, &c->n_layers);
    INT_FIELD("num_attention_heads", 0, true, 1, 4096, &c->n_heads);
    if (rc != QL_OK)
        return rc;
    INT_FIELD("num_key_value_heads", c->n_heads, false, 1, 4096, &c->n_kv_heads);
    INT_FIELD("head_dim", c->hidden_size / c->n_heads, false, 1, 1 << 16, &c->head_dim);
    INT_FIELD("max_position_embeddings", 2048, false, 1, 1 << 24, &c->max_position_embeddings);
    INT_FIELD("sliding_window", 0, false, 0, 1 << 24, &c->sliding_window);
#undef INT_FIELD
    const cJSON *rope_params = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    if (rc == QL_OK && cJSON_IsObject(rope_params) &&
        !cJSON_GetObjectItemCaseSensitive(j, "rope_theta"))
        rc = json_float_field(path, rope_params, "rope_theta", 10000.0, &c->rope_theta, msg,
                              msg_len);
    else if (rc == QL_OK)
        rc = json_float_field(path, j, "rope_theta", 10000.0, &c->rope_theta, msg, msg_len);
    if (rc == QL_OK)
        rc = json_float_field(path, j, "rms_norm_eps", 1e-6, &c->rms_norm_eps, msg, msg_len);
    if (rc == QL_OK)
        rc = parse_rope_scaling(path, j, c, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (c->n_heads % c->n_kv_heads != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                       path, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: head_dim %d is odd; rotary needs pairs", path,
                       c->head_dim);
    c->tie_word_embeddings = json_bool_field(j, "tie_word_embeddings", false);
    c->attention_bias =
        c->arch == ENG_ARCH_QWEN2 ? true : json_bool_field(j, "attention_bias", false);
    c->rope_interleaved = false;
    c->bos_token_id = json_token_id(j, "bos_token_id");
    c->eos_token_id = json_token_id(j, "eos_token_id");

    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(j, "quantization_config");
    if (qc) {
        const cJSON *method = cJSON_GetObjectItemCaseSensitive(qc, "quant_method");
        if (!cJSON_IsString(method) || strcmp(method->valuestring, "bitsandbytes") != 0 ||
            !json_bool_field(qc, "load_in_4bit", false))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: quantization_config %s is not supported (bitsandbytes 4-bit is)",
                           path,
                           cJSON_IsString(method) ? method->valuestring : "(no quant_method)");
        const cJSON *qt = cJSON_GetObjectItemCaseSensitive(qc, "bnb_4bit_quant_type");
        const char *type = cJSON_IsString(qt) ? qt->valuestring : "fp4";
        if (strcmp(type, "nf4") != 0 && strcmp(type, "fp4") != 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: bnb_4bit_quant_type %s is not nf4 or fp4",
                           path, type);
        L->bnb_checkpoint = true;
        snprintf(L->bnb_type, sizeof L->bnb_type, "%s", type);
    }
    return QL_OK;
}

/* --- tensors: finding, checking, converting --------------------------------- */

/* The shard holding name, or NULL. */
static const st_tensor *find_st(const loader *L, const char *name, const st_file **file)
{
    for (size_t i = 0; i < L->m->n_shards; i++) {
        const st_tensor *t = st_find(&L->m->shards[i], name);
        if (t) {
            *file = &L->m->shards[i];
            return t;
        }
    }
    return NULL;
}

static int dense_kind(st_dtype dt)
{
    return dt == ST_F32 ? QT_F32 : dt == ST_F16 ? QT_F16 : dt == ST_BF16 ? QT_BF16 : -1;
}

/* The shard holding a bitsandbytes quant state for `name`, or NULL. */
static const st_file *bnb_shard(const loader *L, const char *name)
{
    for (size_t i = 0; i < L->m->n_shards; i++)
        if (bnb_is_quantized(&L->m->shards[i], name))
            return &L->m->shards[i];
    return NULL;
}

/* A dense safetensors tensor as a qtensor: borrowed when its address suits
 * its element type, else copied. */
static int dense_from_st(const st_file *f, const st_tensor *t, int64_t rows, int64_t cols,
                         qtensor *out, char *msg, size_t msg_len)
{
    int kind = dense_kind(t->dtype);
    if (kind < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s' is %s; expected F32, F16 or BF16",
                       f->path, t->name, st_dtype_name(t->dtype));
    size_t align = st_dtype_size(t->dtype);
    if (((uintptr_t)t->data % align) != 0) {
        char why[256];
        int rc = qt_from_dense(out, (qt_kind)kind, t->data, rows, cols, why, sizeof why);
        return rc == QL_OK
                   ? QL_OK
                   : ql_fail(msg, msg_len, QL_ENOMEM, "%s: tensor '%s': %s", f->path, t->name, why);
    }
    memset(out, 0, sizeof *out);
    out->kind = (qt_kind)kind;
    out->rows = rows;
    out->cols = cols;
    out->data = (uint8_t *)t->data;
    out->data_bytes = t->nbytes;
    out->data_borrowed = true;
    return QL_OK;
}

static int shape_mismatch(const char *file, const char *name, int64_t rows, int64_t cols,
                          int64_t want_rows, int64_t want_cols, char *msg, size_t msg_len)
{
    return ql_fail(msg, msg_len, QL_EFORMAT,
                   "%s: tensor '%s' is [%" PRId64 ", %" PRId64 "]; the config needs [%" PRId64
                   ", %" PRId64 "]",
                   file, name, rows, cols, want_rows, want_cols);
}

/* Replace a dense or GGUF-block weight by its quantization as L->qp; a
 * weight already NF4/FP4/AFFINE is kept as it is. */
static int quantize_weight(const loader *L, const char *name, qtensor *t, char *msg, size_t msg_len)
{
    if (t->kind == QT_NF4 || t->kind == QT_FP4 || t->kind == QT_AFFINE)
        return QL_OK;
    size_t n = (size_t)(t->rows * t->cols);
    float *w = malloc(n * sizeof *w);
    if (!w)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    qt_dequantize_rows(t, 0, t->rows, w);
    qtensor q;
    char why[256];
    int rc = qt_quantize(&q, w, t->rows, t->cols, &L->qp, why, sizeof why);
    free(w);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s': cannot quantize to %s: %s",
                       L->o->path, name, L->o->quant, why);
    qt_free(t);
    *t = q;
    return QL_OK;
}

/* Give a dense tensor the dtype asked for with --dtype. Quantized tensors
 * are left alone: their quant state is the quantizer's. */
static int apply_dtype(const loader *L, const char *name, qtensor *t, char *msg, size_t msg_len)
{
    if (L->dtype == QT_KIND_COUNT || !qt_traits_table[t->kind].is_dense || t->rows == 0)
        return QL_OK;
    char why[256];
    if (qt_cast_dense(t, L->dtype, why, sizeof why) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': %s", name, why);
    return QL_OK;
}

/* What a tensor is to the loader: a dense parameter (norms, biases), a
 * linear layer (quantized on load when asked), lm_head (only with
 * --quantize-lm-head), or the embeddings (never quantized on load, but
 * taken as stored when a checkpoint quantized them, as `qlserve quantize`
 * does: a row of any kind dequantizes for the lookup). */
typedef enum { ROLE_DENSE, ROLE_LINEAR, ROLE_LM_HEAD, ROLE_EMBED } tensor_role;

/* Load HF tensor `name` of shape [rows, cols] (cols == 0: 1-D of rows). */
static int load_hf_tensor(loader *L, const char *name, int64_t rows, int64_t cols, tensor_role role,
                          qtensor *out, char *msg, size_t msg_len)
{
    const st_file *f = NULL;
    bool one_d = cols == 0;
    int64_t want_rows = one_d ? 1 : rows, want_cols = one_d ? rows : cols;
    int rc;
    const st_file *bnb = role != ROLE_DENSE ? bnb_shard(L, name) : NULL;
    if (bnb) {
        /* a bitsandbytes-quantized linear, read as it is: whatever --quant
         * says, it is never quantized again (--quant still applies to the
         * modules the checkpoint left dense, llm_int8_skip_modules) */
        rc = bnb_read(bnb, name, out, NULL, msg, msg_len);
        if (rc == QL_OK && (out->rows != want_rows || out->cols != want_cols)) {
            rc = shape_mismatch(bnb->path, name, out->rows, out->cols, want_rows, want_cols, msg,
                                msg_len);
            qt_free(out);
        }
        return rc;
    }
    const st_tensor *t = find_st(L, name, &f);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor '%s' is missing", L->dir, name);
    if (t->ndim != (one_d ? 1 : 2))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' has %d dimensions; the config needs a %s of %" PRId64
                       " x %" PRId64,
                       f->path, name, t->ndim, one_d ? "vector" : "matrix", want_rows, want_cols);
    int64_t r = one_d ? 1 : t->shape[0], c = one_d ? t->shape[0] : t->shape[1];
    if (r != want_rows || c != want_cols)
        return shape_mismatch(f->path, name, r, c, want_rows, want_cols, msg, msg_len);
    rc = dense_from_st(f, t, want_rows, want_cols, out, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    bool quantize =
        L->quantize && (role == ROLE_LINEAR || (role == ROLE_LM_HEAD && L->o->quantize_lm_head));
    rc = quantize ? quantize_weight(L, name, out, msg, msg_len)
                  : apply_dtype(L, name, out, msg, msg_len);
    if (rc != QL_OK)
        qt_free(out);
    return rc;
}

/* --- the decoder layers, in both namings ------------------------------------------ */

typedef enum { DIM_NONE, DIM_HIDDEN, DIM_Q, DIM_KV, DIM_FF } layer_dim;

/* Each tensor of a layer: its Hugging Face and GGUF names, its shape in
 * config terms (cols DIM_NONE: a vector), and where it goes. */
static const struct layer_part {
    const char *hf, *gguf;
    layer_dim rows, cols;
    tensor_role role;
    size_t field; /* offsetof(eng_layer, ...) */
    bool bias;    /* present only with attention_bias */
} layer_parts[] = {
    {"input_layernorm.weight", "attn_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, attn_norm), false},
    {"post_attention_layernorm.weight", "ffn_norm.weight", DIM_HIDDEN, DIM_NONE, ROLE_DENSE,
     offsetof(eng_layer, ffn_norm), false},
    {"self_attn.q_proj.weight", "attn_q.weight", DIM_Q, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wq), false},
    {"self_attn.k_proj.weight", "attn_k.weight", DIM_KV, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wk), false},
    {"self_attn.v_proj.weight", "attn_v.weight", DIM_KV, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, wv), false},
    {"self_attn.o_proj.weight", "attn_output.weight", DIM_HIDDEN, DIM_Q, ROLE_LINEAR,
     offsetof(eng_layer, wo), false},
    {"mlp.gate_proj.weight", "ffn_gate.weight", DIM_FF, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, w_gate), false},
    {"mlp.up_proj.weight", "ffn_up.weight", DIM_FF, DIM_HIDDEN, ROLE_LINEAR,
     offsetof(eng_layer, w_up), false},
    {"mlp.down_proj.weight", "ffn_down.weight", DIM_HIDDEN, DIM_FF, ROLE_LINEAR,
     offsetof(eng_layer, w_down), false},
    {"self_attn.q_proj.bias", "attn_q.bias", DIM_Q, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bq),
     true},
    {"self_attn.k_proj.bias", "attn_k.bias", DIM_KV, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bk),
     true},
    {"self_attn.v_proj.bias", "attn_v.bias", DIM_KV, DIM_NONE, ROLE_DENSE, offsetof(eng_layer, bv),
     true},
};

typedef int (*tensor_loader)(loader *L, const char *name, int64_t rows, int64_t cols,
                             tensor_role role, qtensor *out, char *msg, size_t msg_len);

static int load_layers(loader *L, tensor_loader load, bool gguf, char *msg, size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    const int64_t dims[] = {
        [DIM_NONE] = 0,
        [DIM_HIDDEN] = c->hidden_size,
        [DIM_Q] = (int64_t)c->n_heads * c->head_dim,
        [DIM_KV] = (int64_t)c->n_kv_heads * c->head_dim,
        [DIM_FF] = c->intermediate_size,
    };
    int rc = QL_OK;
    for (int32_t l = 0; l < c->n_layers && rc == QL_OK; l++) {
        for (size_t p = 0; p < sizeof layer_parts / sizeof *layer_parts && rc == QL_OK; p++) {
            const struct layer_part *part = &layer_parts[p];
            if (part->bias && !c->attention_bias)
                continue;
            char name[256];
            if (gguf)
                snprintf(name, sizeof name, "blk.%d.%s", l, part->gguf);
            else
                snprintf(name, sizeof name, "model.layers.%d.%s", l, part->hf);
            qtensor *dst = (qtensor *)((char *)&L->m->layers[l] + part->field);
            rc = load(L, name, dims[part->rows], dims[part->cols], part->role, dst, msg, msg_len);
        }
    }
    return rc;
}

/* --- Hugging Face folders ------------------------------------------------------ */

/* The open shard whose file name is `file`, or NULL. */
static const st_file *shard_named(const loader *L, const char *file)
{
    for (size_t i = 0; i < L->m->n_shards; i++) {
        const char *p = strrchr(L->m->shards[i].path, '/');
        if (strcmp(p ? p + 1 : L->m->shards[i].path, file) == 0)
            return &L->m->shards[i];
    }
    return NULL;
}

static int open_shard(loader *L, const char *file, char *msg, size_t msg_len)
{
    if (shard_named(L, file))
        return QL_OK;
    if (strchr(file, '/') || strcmp(file, "..") == 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: shard name '%s' leaves the folder", L->dir,
                       file);
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", L->dir, file);
    if (!file_exists(path))
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: shard %s is missing", L->dir, file);
    st_file *s = realloc(L->m->shards, (L->m->n_shards + 1) * sizeof *s);
    if (!s)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    L->m->shards = s;
    int rc = st_open(&s[L->m->n_shards], path, msg, msg_len);
    if (rc == QL_OK)
        L->m->n_shards++;
    return rc;
}

static int open_hf_weights(loader *L, char *msg, size_t msg_len)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", L->dir);
    if (file_exists(path)) {
        cJSON *idx;
        int rc = mf_read_json(path, JSON_MAX_BYTES, &idx, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
        if (!cJSON_IsObject(map))
            rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"weight_map\" is missing", path);
        const cJSON *e;
        cJSON_ArrayForEach (e, map) {
            if (rc != QL_OK)
                break;
            if (!cJSON_IsString(e)) {
                rc = ql_fail(msg, msg_len, QL_EFORMAT,
                             "%s: weight_map entry '%s' is not a file name", path, e->string);
                break;
            }
            rc = open_shard(L, e->valuestring, msg, msg_len);
        }
        /* every tensor the index lists is in the shard it names */
        cJSON_ArrayForEach (e, map) {
            if (rc != QL_OK)
                break;
            const st_file *shard = shard_named(L, e->valuestring);
            if (!shard || !st_find(shard, e->string))
                rc = ql_fail(msg, msg_len, QL_EFORMAT,
                             "%s: tensor '%s' is listed for %s but is not in it", path, e->string,
                             e->valuestring);
        }
        cJSON_Delete(idx);
        if (rc != QL_OK)
            return rc;
    } else {
        int rc = open_shard(L, "model.safetensors", msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    /* a tensor named in two shards is ambiguous: refuse */
    for (size_t i = 1; i < L->m->n_shards; i++)
        for (size_t k = 0; k < L->m->shards[i].n_tensors; k++)
            for (size_t j = 0; j < i; j++)
                if (st_find(&L->m->shards[j], L->m->shards[i].tensors[k].name))
                    return ql_fail(msg, msg_len, QL_EFORMAT, "tensor '%s' is in both %s and %s",
                                   L->m->shards[i].tensors[k].name, L->m->shards[j].path,
                                   L->m->shards[i].path);
    return QL_OK;
}

/* What the model calls itself (eng_model.name): the name its file gives
 * (own, not NUL-terminated, may be NULL), else the base name of its path,
 * so an adapter's base_model_name_or_path can be compared with it. */
static void set_model_name(eng_model *m, const char *own, size_t own_len, const char *path)
{
    if (own && own_len) {
        snprintf(m->name, sizeof m->name, "%.*s", (int)(own_len < 255 ? own_len : 255), own);
        return;
    }
    mf_path_base(path, m->name, sizeof m->name);
}

static int load_hf(loader *L, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    eng_config *c = &m->cfg;
    char path[8192];
    snprintf(path, sizeof path, "%s/config.json", L->dir);
    cJSON *j;
    int rc = mf_read_json(path, JSON_MAX_BYTES, &j, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = parse_hf_config(L, path, j, msg, msg_len);
    const cJSON *own = cJSON_GetObjectItemCaseSensitive(j, "_name_or_path");
    set_model_name(m, cJSON_IsString(own) ? own->valuestring : NULL,
                   cJSON_IsString(own) ? strlen(own->valuestring) : 0, L->dir);
    cJSON_Delete(j);
    if (rc != QL_OK)
        return rc;
    snprintf(m->format, sizeof m->format, "%s",
             L->bnb_checkpoint ? "bitsandbytes-4bit" : "safetensors");
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    rc = open_hf_weights(L, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    int64_t h = c->hidden_size;
    rc = load_hf_tensor(L, "model.embed_tokens.weight", c->vocab_size, h, ROLE_EMBED, &m->embed,
                        msg, msg_len);
    if (rc == QL_OK)
        rc = load_hf_tensor(L, "model.norm.weight", h, 0, ROLE_DENSE, &m->norm, msg, msg_len);
    const st_file *f;
    if (rc == QL_OK && !c->tie_word_embeddings) {
        rc = load_hf_tensor(L, "lm_head.weight", c->vocab_size, h, ROLE_LM_HEAD, &m->lm_head, msg,
                            msg_len);
    } else if (rc == QL_OK &&
               (find_st(L, "lm_head.weight", &f) || bnb_shard(L, "lm_head.weight"))) {
        /* tied in the config but stored anyway (some exports do): use it */
        rc = load_hf_tensor(L, "lm_head.weight", c->vocab_size, h, ROLE_LM_HEAD, &m->lm_head, msg,
                            msg_len);
    }
    if (rc == QL_OK)
        rc = load_layers(L, load_hf_tensor, false, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    char tok_path[8192], tok_cfg[8192];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", L->dir);
    snprintf(tok_cfg, sizeof tok_cfg, "%s/tokenizer_config.json", L->dir);
    if (!file_exists(tok_path))
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tokenizer.json is missing", L->dir);
    return tok_from_hf(&m->tok, tok_path, file_exists(tok_cfg) ? tok_cfg : NULL, msg, msg_len);
}

/* --- GGUF ---------------------------------------------------------------------- */

/* An unsigned integer metadata value, or def when absent. */
static int gguf_uint(const gguf_file *f, const char *key, int64_t def, bool required, int32_t *out,
                     char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) {
        if (required)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata %s is missing", f->path, key);
        *out = (int32_t)def;
        return QL_OK;
    }
    bool integer = kv->type == GGUF_UINT8 || kv->type == GGUF_INT8 || kv->type == GGUF_UINT16 ||
                   kv->type == GGUF_INT16 || kv->type == GGUF_UINT32 || kv->type == GGUF_INT32 ||
                   kv->type == GGUF_UINT64 || kv->type == GGUF_INT64;
    if (!integer || kv->i < 0 || kv->i > INT32_MAX)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata %s is not a non-negative integer",
                       f->path, key);
    *out = (int32_t)kv->i;
    return QL_OK;
}

static int gguf_float(const gguf_file *f, const char *key, double def, float *out, char *msg,
                      size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) {
        *out = (float)def;
        return QL_OK;
    }
    if ((kv->type != GGUF_FLOAT32 && kv->type != GGUF_FLOAT64) || !isfinite(kv->f) || kv->f <= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata %s is not a positive number",
                       f->path, key);
    *out = (float)kv->f;
    return QL_OK;
}

static int parse_gguf_config(loader *L, char *msg, size_t msg_len)
{
    const gguf_file *f = L->m->gguf;
    eng_config *c = &L->m->cfg;
    const gguf_kv *a = gguf_find_kv(f, "general.architecture");
    if (!a || a->type != GGUF_STRING)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: general.architecture is missing", f->path);
    char arch[64];
    snprintf(arch, sizeof arch, "%.*s", (int)(a->str.len < 63 ? a->str.len : 63), a->str.ptr);
    if (strcmp(arch, "llama") == 0)
        c->arch = ENG_ARCH_LLAMA;
    else if (strcmp(arch, "qwen2") == 0)
        c->arch = ENG_ARCH_QWEN2;
    else
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: GGUF architecture %s is not one qlserve runs (llama, qwen2)", f->path,
                       arch);
    char key[128];
    int rc = QL_OK;
#define U(k, def, req, dst)                                                                        \
    if (rc == QL_OK) {                                                                             \
        snprintf(key, sizeof key, "%s.%s", arch, k);                                               \
        rc = gguf_uint(f, key, def, req, dst, msg, msg_len);                                       \
    }
    U("embedding_length", 0, true, &c->hidden_size);
    U("feed_forward_length", 0, true, &c->intermediate_size);
    U("block_count", 0, true, &c->n_layers);
    U("attention.head_count", 0, true, &c->n_heads);
    if (rc != QL_OK)
        return rc;
    if (c->n_heads <= 0 || c->hidden_size <= 0 || c->n_layers <= 0 || c->intermediate_size <= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: model sizes must be positive", f->path);
    U("attention.head_count_kv", c->n_heads, false, &c->n_kv_heads);
    U("attention.key_length", c->hidden_size / c->n_heads, false, &c->head_dim);
    U("context_length", 2048, false, &c->max_position_embeddings);
#undef U
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 10000.0, &c->rope_theta, msg, msg_len);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 1e-5, &c->rms_norm_eps, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads != 0 || c->head_dim <= 0 ||
        c->head_dim % 2)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %d heads, %d kv heads, head dim %d do not make an attention layer",
                       f->path, c->n_heads, c->n_kv_heads, c->head_dim);
    c->rope_factor = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    const gguf_kv *st = gguf_find_kv(f, key);
    if (st && st->type == GGUF_STRING) {
        char type[32];
        snprintf(type, sizeof type, "%.*s", (int)(st->str.len < 31 ? st->str.len : 31),
                 st->str.ptr);
        snprintf(key, sizeof key, "%s.rope.scaling.factor", arch);
        if (strcmp(type, "linear") == 0) {
            c->rope_scaling = ENG_ROPE_LINEAR;
            rc = gguf_float(f, key, 1.0, &c->rope_factor, msg, msg_len);
        } else if (strcmp(type, "none") != 0) {
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: rope scaling type %s is not supported (linear)", f->path, type);
        }
    }
    if (gguf_find_tensor(f, "rope_freqs.weight"))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: tensor 'rope_freqs.weight' (rope scaling stored as frequencies, as "
                       "llama.cpp writes Llama 3.1) is not supported yet",
                       f->path);
    /* llama.cpp's converter permutes llama q/k rows into adjacent rotary
     * pairs; it leaves qwen2's as Hugging Face has them */
    c->rope_interleaved = c->arch == ENG_ARCH_LLAMA;
    c->attention_bias = c->arch == ENG_ARCH_QWEN2;
    c->tie_word_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (!emb || emb->n_dims != 2)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor 'token_embd.weight' is missing",
                       f->path);
    c->vocab_size = (int32_t)emb->ne[1];
    int32_t bos = -1, eos = -1;
    rc = gguf_uint(f, "tokenizer.ggml.bos_token_id", -1, false, &bos, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_uint(f, "tokenizer.ggml.eos_token_id", -1, false, &eos, msg, msg_len);
    c->bos_token_id = bos;
    c->eos_token_id = eos;
    return rc;
}

static int load_gguf_tensor(loader *L, const char *name, int64_t rows, int64_t cols,
                            tensor_role role, qtensor *out, char *msg, size_t msg_len)
{
    const gguf_file *f = L->m->gguf;
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor '%s' is missing", f->path, name);
    int rc = gguf_tensor_qtensor(f, t, out, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int64_t want_rows = cols == 0 ? 1 : rows, want_cols = cols == 0 ? rows : cols;
    if (out->rows != want_rows || out->cols != want_cols) {
        rc =
            shape_mismatch(f->path, name, out->rows, out->cols, want_rows, want_cols, msg, msg_len);
        qt_free(out);
        return rc;
    }
    bool quantize =
        L->quantize && (role == ROLE_LINEAR || (role == ROLE_LM_HEAD && L->o->quantize_lm_head));
    rc = quantize ? quantize_weight(L, name, out, msg, msg_len)
                  : apply_dtype(L, name, out, msg, msg_len);
    if (rc != QL_OK)
        qt_free(out);
    return rc;
}

static int load_gguf(loader *L, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    m->gguf = calloc(1, sizeof *m->gguf);
    if (!m->gguf)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    int rc = gguf_open(m->gguf, L->o->path, msg, msg_len);
    if (rc != QL_OK) {
        free(m->gguf);
        m->gguf = NULL;
        return rc;
    }
    snprintf(m->format, sizeof m->format, "gguf");
    const gguf_kv *own = gguf_find_kv(m->gguf, "general.name");
    bool named = own && own->type == GGUF_STRING;
    set_model_name(m, named ? own->str.ptr : NULL, named ? own->str.len : 0, L->o->path);
    rc = parse_gguf_config(L, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_config *c = &m->cfg;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    int64_t h = c->hidden_size;
    rc = load_gguf_tensor(L, "token_embd.weight", c->vocab_size, h, ROLE_EMBED, &m->embed, msg,
                          msg_len);
    if (rc == QL_OK)
        rc = load_gguf_tensor(L, "output_norm.weight", h, 0, ROLE_DENSE, &m->norm, msg, msg_len);
    if (rc == QL_OK && !c->tie_word_embeddings)
        rc = load_gguf_tensor(L, "output.weight", c->vocab_size, h, ROLE_LM_HEAD, &m->lm_head, msg,
                              msg_len);
    if (rc == QL_OK)
        rc = load_layers(L, load_gguf_tensor, true, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    return tok_from_gguf(&m->tok, m->gguf, msg, msg_len);
}

/* --- the entry points ------------------------------------------------------------ */

/* --quant names and what they mean (torchao's int4/int8 weight-only
 * defaults for the affine ones). */
static int parse_quant(loader *L, char *msg, size_t msg_len)
{
    const eng_load_opts *o = L->o;
    const char *q = o->quant ? o->quant : "none";
    qt_quant_params *p = &L->qp;
    memset(p, 0, sizeof *p);
    L->quantize = true;
    if (strcmp(q, "none") == 0) {
        L->quantize = false;
    } else if (strcmp(q, "nf4") == 0 || strcmp(q, "nf4-dq") == 0 || strcmp(q, "fp4") == 0) {
        p->kind = q[0] == 'n' ? QT_NF4 : QT_FP4;
        p->blocksize = o->blocksize ? o->blocksize : 64;
        p->double_quant = strcmp(q, "nf4-dq") == 0;
    } else if (strcmp(q, "int4") == 0) {
        p->kind = QT_AFFINE;
        p->bits = 4;
        p->group_size = o->group_size ? o->group_size : 128;
        p->zero_domain = QT_ZERO_FLOAT;
        p->eps = 1e-6f;
    } else if (strcmp(q, "int8") == 0) {
        p->kind = QT_AFFINE;
        p->bits = 8;
        p->symmetric = true;
        p->group_size = o->group_size; /* 0: per channel */
    } else {
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--quant %s: one of none, nf4, nf4-dq, fp4, int4, int8", q);
    }
    L->dtype = QT_KIND_COUNT;
    if (o->dtype) {
        int k = qt_kind_from_name(o->dtype);
        if (k != QT_F32 && k != QT_F16 && k != QT_BF16)
            return ql_fail(msg, msg_len, QL_EINVAL, "--dtype %s: one of f32, bf16, f16", o->dtype);
        L->dtype = (qt_kind)k;
    }
    return QL_OK;
}

/* What the linear layers hold, for messages and /info. */
static void describe_quant(eng_model *m)
{
    const qtensor *w = &m->layers[0].wq;
    if (w->kind == QT_AFFINE && w->group_size == w->cols)
        snprintf(m->quant, sizeof m->quant, "int%d-channel", w->bits);
    else if (w->kind == QT_AFFINE)
        snprintf(m->quant, sizeof m->quant, "int%d-g%d", w->bits, w->group_size);
    else if (w->kind == QT_NF4 || w->kind == QT_FP4)
        snprintf(m->quant, sizeof m->quant, "%s%s-b%d", qt_kind_name(w->kind),
                 w->nested ? "-dq" : "", w->blocksize);
    else
        snprintf(m->quant, sizeof m->quant, "%s", qt_kind_name(w->kind));
}

int eng_model_load(eng_model *m, const eng_load_opts *o, char *msg, size_t msg_len)
{
    memset(m, 0, sizeof *m);
    loader L = {.o = o, .m = m};
    int rc = parse_quant(&L, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    struct stat sb;
    if (!o->path || stat(o->path, &sb) != 0)
        return ql_fail(msg, msg_len, QL_EIO, "%s: %s", o->path ? o->path : "(no model path)",
                       o->path ? strerror(errno) : "give --model");
    if (S_ISDIR(sb.st_mode)) {
        snprintf(L.dir, sizeof L.dir, "%s", o->path);
        rc = load_hf(&L, msg, msg_len);
    } else {
        rc = load_gguf(&L, msg, msg_len);
    }
    if (rc == QL_OK && tok_vocab_size(m->tok) > (size_t)m->cfg.vocab_size)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: the tokenizer has %zu tokens but the model embeds only %d", o->path,
                     tok_vocab_size(m->tok), m->cfg.vocab_size);
    if (rc != QL_OK) {
        eng_model_free(m);
        return rc;
    }
    describe_quant(m);
    return QL_OK;
}

/* Layer l's part p, through the layer table's offsets. */
static qtensor *layer_part(const eng_model *m, int32_t l, size_t p)
{
    return (qtensor *)((char *)&m->layers[l] + layer_parts[p].field);
}

void eng_model_each_tensor(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx)
{
    const qtensor *top[] = {&m->embed, &m->norm, &m->lm_head};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++)
        if (top[i]->rows)
            fn(top[i], ctx);
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++)
        for (size_t p = 0; p < sizeof layer_parts / sizeof *layer_parts; p++)
            if (layer_part(m, l, p)->rows)
                fn(layer_part(m, l, p), ctx);
}

static void add_bytes(const qtensor *t, void *total)
{
    *(size_t *)total += qt_nbytes(t);
}

size_t eng_model_weight_bytes(const eng_model *m)
{
    size_t n = 0;
    eng_model_each_tensor(m, add_bytes, &n);
    return n;
}

void eng_model_free(eng_model *m)
{
    qt_free(&m->embed);
    qt_free(&m->norm);
    qt_free(&m->lm_head);
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++)
        for (size_t p = 0; p < sizeof layer_parts / sizeof *layer_parts; p++)
            qt_free(layer_part(m, l, p));
    free(m->layers);
    if (m->tok)
        tok_free(m->tok);
    for (size_t i = 0; i < m->n_shards; i++)
        st_close(&m->shards[i]);
    free(m->shards);
    if (m->gguf) {
        gguf_close(m->gguf);
        free(m->gguf);
    }
    memset(m, 0, sizeof *m);
}

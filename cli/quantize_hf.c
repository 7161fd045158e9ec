/*
 * quantize_hf.c - `qlserve quantize --in DIR --out X.gguf --kind K`: a
 * Hugging Face folder (config.json, model.safetensors or the shards
 * model.safetensors.index.json lists, tokenizer.json, tokenizer_config.json)
 * of a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
 * Qwen3ForCausalLM written as the GGUF llama.cpp's convert_hf_to_gguf.py
 * makes of it, quantized as quantize.c quantizes a GGUF (cli_gguf_plan:
 * the same kinds and fallbacks). It offers cli_quantize_hf (cli.h); it owns
 * the folder's mappings, its tokenizer and the writer for the length of the
 * call and touches only the output file and the log stream.
 *
 * What the converter does and this file does too: the metadata keys it
 * writes for these architectures (general.*, ARCH.* sizes, rope base and
 * dimension count, linear rope scaling; Llama 3 rope scaling as the
 * rope_freqs.weight factors); its tensor names (token_embd, blk.N.attn_q
 * ..., output_norm, output, none when the embeddings are tied); llama's
 * (and Mistral's) q/k rows permuted, head by head, from the two rotary
 * halves into adjacent pairs, which the loader runs as interleaved rotary;
 * 1-D tensors as f32; the tokenizer as tokenizer.ggml.* (model "gpt2" with
 * merges for byte-level BPE, "llama" for SentencePiece-style BPE, tokens
 * padded to the embedding's rows with [PADn]). Where it differs: a "llama"
 * vocabulary's scores are minus the rank of the merge that makes each token
 * (the converter writes -1000 for every token of a tokenizer.json, which
 * makes llama.cpp merge left to right), so llama.cpp and qlserve give the
 * ids tokenizer.json gives.
 */
#include "cli.h"
#include "model.h"
#include "modelfile.h"
#include "qtensor.h"
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define HF_JSON_MAX ((size_t)64 << 20)

bool cli_is_folder(const char *path)
{
    struct stat sb;
    return path && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* One tensor of the output: where it comes from and what it becomes. */
typedef struct hf_tensor {
    char name[96];
    const st_file *file;  /* the shard src is in */
    const st_tensor *src; /* NULL: rope_freqs.weight, computed */
    int permute_heads;    /* llama q/k: the heads to permute the rows of; 0 none */
    qt_kind kind;         /* QT_KIND_COUNT: 1-D, written as f32 */
    bool fell_back;
} hf_tensor;

typedef struct hf_model {
    const char *dir;
    cJSON *config;
    const char *arch; /* GGUF general.architecture */
    bool llama;       /* llama.cpp's "llama": Llama and Mistral */
    int64_t layers, hidden, ffn, heads, kv_heads, head_dim, ctx, vocab;
    bool head_dim_given, tied;
    double eps, theta;
    double rope_linear; /* linear rope scaling factor; 0 none */
    float *rope_freqs;  /* Llama 3 rope scaling: head_dim / 2 factors */
    st_file *shards;
    size_t n_shards;
    tok_tokenizer *tok;
    hf_tensor *tensors;
    size_t n_tensors;
} hf_model;

static void hf_free(hf_model *m)
{
    cJSON_Delete(m->config);
    for (size_t i = 0; i < m->n_shards; i++)
        st_close(&m->shards[i]);
    free(m->shards);
    free(m->rope_freqs);
    tok_free(m->tok);
    free(m->tensors);
}

/* --- config.json ---------------------------------------------------------- */

static int hf_arch(hf_model *m, const char *path, char *msg, size_t msg_len)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(m->config, "architectures");
    const cJSON *first = cJSON_IsArray(a) ? cJSON_GetArrayItem(a, 0) : NULL;
    const char *name = cJSON_IsString(first) ? first->valuestring : "(none)";
    static const struct {
        const char *hf, *gguf;
    } archs[] = {{"LlamaForCausalLM", "llama"},
                 {"MistralForCausalLM", "llama"},
                 {"Qwen2ForCausalLM", "qwen2"},
                 {"Qwen3ForCausalLM", "qwen3"}};
    for (size_t i = 0; i < sizeof archs / sizeof *archs; i++)
        if (strcmp(name, archs[i].hf) == 0) {
            m->arch = archs[i].gguf;
            m->llama = strcmp(m->arch, "llama") == 0;
            return QL_OK;
        }
    return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                   "%s: architecture %s is not one quantize converts to GGUF (LlamaForCausalLM, "
                   "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)",
                   path, name);
}

/* rope_scaling: none, linear (ARCH.rope.scaling.*) or llama3 (the
 * converter's rope_freqs.weight factors, llama only). */
static int hf_rope_scaling(hf_model *m, const char *path, char *msg, size_t msg_len)
{
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(m->config, "rope_scaling");
    if (!rs || cJSON_IsNull(rs)) /* transformers 5 keeps it in rope_parameters */
        rs = cJSON_GetObjectItemCaseSensitive(m->config, "rope_parameters");
    if (!rs || cJSON_IsNull(rs))
        return QL_OK;
    const char *type = mf_json_str(rs, "rope_type");
    type = type ? type : mf_json_str(rs, "type");
    if (!type || strcmp(type, "default") == 0)
        return QL_OK;
    double factor, low, high, old;
    int rc = mf_json_positive_field(path, rs, "factor", 8.0, &factor, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (strcmp(type, "linear") == 0) {
        m->rope_linear = factor;
        return QL_OK;
    }
    if (strcmp(type, "llama3") != 0 || !m->llama)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: rope_scaling type %s is not supported here (linear; llama3 for llama)",
                       path, type);
    rc = mf_json_positive_field(path, rs, "low_freq_factor", 1.0, &low, msg, msg_len);
    if (rc == QL_OK)
        rc = mf_json_positive_field(path, rs, "high_freq_factor", 4.0, &high, msg, msg_len);
    if (rc == QL_OK)
        rc = mf_json_positive_field(path, rs, "original_max_position_embeddings", 8192, &old, msg,
                                    msg_len);
    if (rc != QL_OK)
        return rc;
    if (high <= low)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: rope_scaling high_freq_factor must exceed low_freq_factor", path);
    int64_t n = m->head_dim / 2;
    m->rope_freqs = malloc((size_t)n * sizeof *m->rope_freqs);
    if (!m->rope_freqs)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    /* Llama 3's frequency-dependent scaling: long wavelengths divided by
     * factor, short ones kept, a smooth blend between (the converter's
     * formula, in f32 as torch computes the frequencies) */
    for (int64_t i = 0; i < n; i++) {
        float freq = 1.0f / powf((float)m->theta, (float)(2 * i) / (float)m->head_dim);
        double wavelen = 2 * M_PI / freq;
        double f = 1.0;
        if (wavelen > old / low)
            f = factor;
        else if (wavelen >= old / high) {
            double smooth = (old / wavelen - low) / (high - low);
            f = 1 / ((1 - smooth) / factor + smooth);
        }
        m->rope_freqs[i] = (float)f;
    }
    return QL_OK;
}

static int hf_config(hf_model *m, char *msg, size_t msg_len)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/config.json", m->dir);
    int rc = mf_read_json(path, HF_JSON_MAX, &m->config, msg, msg_len);
    if (rc == QL_OK)
        rc = hf_arch(m, path, msg, msg_len);
    const cJSON *j = m->config;
    const int64_t big = (int64_t)1 << 30;
#define I(key, def, req, dst)                                                                      \
    if (rc == QL_OK)                                                                               \
        rc = mf_json_int_field(path, j, key, def, req, 1, big, dst, msg, msg_len);
    I("num_hidden_layers", 0, true, &m->layers);
    I("hidden_size", 0, true, &m->hidden);
    I("intermediate_size", 0, true, &m->ffn);
    I("num_attention_heads", 0, true, &m->heads);
    I("vocab_size", 0, true, &m->vocab);
    I("max_position_embeddings", 2048, false, &m->ctx);
    if (rc != QL_OK)
        return rc;
    I("num_key_value_heads", m->heads, false, &m->kv_heads);
    m->head_dim_given = cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "head_dim"));
    I("head_dim", m->hidden / m->heads, false, &m->head_dim);
#undef I
    if (rc == QL_OK)
        rc = mf_json_positive_field(path, j, "rms_norm_eps", 1e-6, &m->eps, msg, msg_len);
    if (rc == QL_OK)
        rc = mf_json_positive_field(path, j, "rope_theta", 10000.0, &m->theta, msg, msg_len);
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    if (rc == QL_OK && cJSON_IsObject(rp)) /* transformers 5 */
        rc = mf_json_positive_field(path, rp, "rope_theta", m->theta, &m->theta, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (m->heads % m->kv_heads || m->head_dim % 2)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %" PRId64 " heads, %" PRId64 " kv heads, head dim %" PRId64
                       " do not make an attention layer",
                       path, m->heads, m->kv_heads, m->head_dim);
    m->tied = mf_json_bool(j, "tie_word_embeddings", false);
    return hf_rope_scaling(m, path, msg, msg_len);
}

/* --- the weights -------------------------------------------------------- */

static int hf_open_shard(hf_model *m, const char *file, char *msg, size_t msg_len)
{
    for (size_t i = 0; i < m->n_shards; i++) {
        const char *slash = strrchr(m->shards[i].path, '/');
        if (strcmp(slash ? slash + 1 : m->shards[i].path, file) == 0)
            return QL_OK;
    }
    if (strchr(file, '/'))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: shard name '%s' leaves the folder", m->dir,
                       file);
    st_file *s = realloc(m->shards, (m->n_shards + 1) * sizeof *s);
    if (!s)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    m->shards = s;
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", m->dir, file);
    int rc = st_open(&s[m->n_shards], path, msg, msg_len);
    if (rc == QL_OK)
        m->n_shards++;
    return rc;
}

static int hf_open_weights(hf_model *m, char *msg, size_t msg_len)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", m->dir);
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return hf_open_shard(m, "model.safetensors", msg, msg_len);
    fclose(fp);
    cJSON *idx;
    int rc = mf_read_json(path, HF_JSON_MAX, &idx, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map"), *e;
    if (!cJSON_IsObject(map))
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"weight_map\" is missing", path);
    cJSON_ArrayForEach (e, map) {
        if (rc == QL_OK && !cJSON_IsString(e))
            rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: weight_map entry '%s' is not a file name",
                         path, e->string);
        if (rc == QL_OK)
            rc = hf_open_shard(m, e->valuestring, msg, msg_len);
    }
    cJSON_Delete(idx);
    return rc;
}

/* The GGUF name of Hugging Face tensor hf into out, with *permute set to
 * the heads whose rows the converter permutes. 0: mapped; 1: left out
 * (tied lm_head, rotary inv_freq); QL_EUNSUPPORTED: not a tensor these
 * architectures have. */
static int hf_map_name(const hf_model *m, const char *hf, char *out, size_t len, int *permute)
{
    static const struct {
        const char *hf, *gguf;
        int permute; /* 1 q heads, 2 kv heads */
    } layer_names[] = {
        {"self_attn.q_proj.weight", "attn_q.weight", 1},
        {"self_attn.k_proj.weight", "attn_k.weight", 2},
        {"self_attn.v_proj.weight", "attn_v.weight", 0},
        {"self_attn.o_proj.weight", "attn_output.weight", 0},
        {"self_attn.q_proj.bias", "attn_q.bias", 1},
        {"self_attn.k_proj.bias", "attn_k.bias", 2},
        {"self_attn.v_proj.bias", "attn_v.bias", 0},
        {"self_attn.q_norm.weight", "attn_q_norm.weight", 0},
        {"self_attn.k_norm.weight", "attn_k_norm.weight", 0},
        {"mlp.gate_proj.weight", "ffn_gate.weight", 0},
        {"mlp.up_proj.weight", "ffn_up.weight", 0},
        {"mlp.down_proj.weight", "ffn_down.weight", 0},
        {"input_layernorm.weight", "attn_norm.weight", 0},
        {"post_attention_layernorm.weight", "ffn_norm.weight", 0},
    };
    *permute = 0;
    if (strcmp(hf, "model.embed_tokens.weight") == 0)
        return snprintf(out, len, "token_embd.weight"), 0;
    if (strcmp(hf, "model.norm.weight") == 0)
        return snprintf(out, len, "output_norm.weight"), 0;
    if (strcmp(hf, "lm_head.weight") == 0)
        return m->tied ? 1 : (snprintf(out, len, "output.weight"), 0);
    size_t n = strlen(hf);
    if (n >= 20 && strcmp(hf + n - 20, "rotary_emb.inv_freq") == 0)
        return 1;
    int layer, at = 0;
    if (sscanf(hf, "model.layers.%d.%n", &layer, &at) != 1 || at == 0 || layer < 0 ||
        layer >= m->layers)
        return QL_EUNSUPPORTED;
    for (size_t i = 0; i < sizeof layer_names / sizeof *layer_names; i++)
        if (strcmp(hf + at, layer_names[i].hf) == 0) {
            snprintf(out, len, "blk.%d.%s", layer, layer_names[i].gguf);
            *permute = !m->llama                     ? 0
                       : layer_names[i].permute == 1 ? (int)m->heads
                       : layer_names[i].permute == 2 ? (int)m->kv_heads
                                                     : 0;
            return 0;
        }
    return QL_EUNSUPPORTED;
}

/* Map every tensor of the shards and plan its kind. */
static int hf_plan(hf_model *m, const cli_gguf_target *g, char *msg, size_t msg_len)
{
    size_t total = 1;
    for (size_t s = 0; s < m->n_shards; s++)
        total += m->shards[s].n_tensors;
    m->tensors = calloc(total, sizeof *m->tensors);
    if (!m->tensors)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    if (m->rope_freqs) {
        hf_tensor *t = &m->tensors[m->n_tensors++];
        snprintf(t->name, sizeof t->name, "rope_freqs.weight");
        t->kind = QT_KIND_COUNT;
    }
    for (size_t s = 0; s < m->n_shards; s++)
        for (size_t i = 0; i < m->shards[s].n_tensors; i++) {
            const st_tensor *st = &m->shards[s].tensors[i];
            hf_tensor *t = &m->tensors[m->n_tensors];
            int r = hf_map_name(m, st->name, t->name, sizeof t->name, &t->permute_heads);
            if (r == 1)
                continue;
            if (r != 0)
                return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                               "%s: tensor '%s' is not one a %s model has", m->shards[s].path,
                               st->name, m->arch);
            if (st->ndim < 1 || st->ndim > 2 || st_dtype_qt_kind(st->dtype) < 0 ||
                !qt_traits_table[st_dtype_qt_kind(st->dtype)].is_dense)
                return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                               "%s: tensor '%s' is %s with %d dims; quantize converts 1-D and "
                               "2-D f32, f16 and bf16 tensors",
                               m->shards[s].path, st->name, st_dtype_name(st->dtype), st->ndim);
            for (size_t k = 0; k < m->n_tensors; k++)
                if (strcmp(m->tensors[k].name, t->name) == 0)
                    return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s' appears twice",
                                   m->dir, st->name);
            t->src = st;
            t->file = &m->shards[s];
            gguf_tensor gt = {.name = t->name, .n_dims = st->ndim};
            gt.ne[0] = st->shape[st->ndim - 1];
            gt.ne[1] = st->ndim == 2 ? st->shape[0] : 1;
            t->kind = st->ndim == 1 ? QT_KIND_COUNT : cli_gguf_plan(g, &gt, &t->fell_back);
            if (st->ndim == 2 && t->kind == QT_KIND_COUNT)
                t->kind = QT_F32;
            m->n_tensors++;
        }
    return QL_OK;
}

/* --- metadata ------------------------------------------------------------- */

static int put_str(gguf_out *o, const char *key, const char *v, size_t n, char *msg, size_t msg_len)
{
    gguf_kv kv = {.key = (char *)key, .type = GGUF_STRING, .elem = GGUF_STRING, .n = 1};
    kv.str = (gguf_str){v, n};
    return gguf_out_copy_kv(o, &kv, msg, msg_len);
}

static int put_f32(gguf_out *o, const char *key, double v, char *msg, size_t msg_len)
{
    gguf_kv kv = {.key = (char *)key, .type = GGUF_FLOAT32, .elem = GGUF_FLOAT32, .n = 1, .f = v};
    return gguf_out_copy_kv(o, &kv, msg, msg_len);
}

static int put_bool(gguf_out *o, const char *key, bool v, char *msg, size_t msg_len)
{
    gguf_kv kv = {.key = (char *)key, .type = GGUF_BOOL, .elem = GGUF_BOOL, .n = 1, .u = v};
    return gguf_out_copy_kv(o, &kv, msg, msg_len);
}

static int put_array(gguf_out *o, const char *key, gguf_type elem, uint64_t n, const void *data,
                     const gguf_str *strs, char *msg, size_t msg_len)
{
    gguf_kv kv = {.key = (char *)key, .type = GGUF_ARRAY, .elem = elem, .n = n};
    kv.data = data;
    kv.strs = (gguf_str *)strs;
    return gguf_out_copy_kv(o, &kv, msg, msg_len);
}

/* general.* and ARCH.*, as the converter writes them for these models. */
static int hf_put_model_meta(const hf_model *m, const cli_gguf_target *g, gguf_out *o, char *msg,
                             size_t msg_len)
{
    char name[256], key[128];
    const char *own = mf_json_str(m->config, "_name_or_path");
    mf_path_base(own && *own ? own : m->dir, name, sizeof name);
    int rc = put_str(o, "general.architecture", m->arch, strlen(m->arch), msg, msg_len);
    if (rc == QL_OK)
        rc = put_str(o, "general.type", "model", 5, msg, msg_len);
    if (rc == QL_OK)
        rc = put_str(o, "general.name", name, strlen(name), msg, msg_len);
    const struct {
        const char *key;
        int64_t v;
        bool write;
    } sizes[] = {
        {"vocab_size", m->vocab, m->llama},
        {"context_length", m->ctx, true},
        {"embedding_length", m->hidden, true},
        {"block_count", m->layers, true},
        {"feed_forward_length", m->ffn, true},
        {"attention.head_count", m->heads, true},
        {"attention.head_count_kv", m->kv_heads, true},
        {"attention.key_length", m->head_dim, m->head_dim_given},
        {"attention.value_length", m->head_dim, m->head_dim_given},
        {"rope.dimension_count", m->head_dim, true},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes && rc == QL_OK; i++) {
        snprintf(key, sizeof key, "%s.%s", m->arch, sizes[i].key);
        if (sizes[i].write)
            rc = gguf_out_set_u32(o, key, (uint32_t)sizes[i].v, msg, msg_len);
    }
    snprintf(key, sizeof key, "%s.rope.freq_base", m->arch);
    if (rc == QL_OK)
        rc = put_f32(o, key, m->theta, msg, msg_len);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", m->arch);
    if (rc == QL_OK)
        rc = put_f32(o, key, m->eps, msg, msg_len);
    if (rc == QL_OK && m->rope_linear > 0) {
        snprintf(key, sizeof key, "%s.rope.scaling.type", m->arch);
        rc = put_str(o, key, "linear", 6, msg, msg_len);
        snprintf(key, sizeof key, "%s.rope.scaling.factor", m->arch);
        if (rc == QL_OK)
            rc = put_f32(o, key, m->rope_linear, msg, msg_len);
    }
    if (rc == QL_OK)
        rc = gguf_out_set_u32(o, "general.file_type", g->file_type, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_set_u32(o, "general.quantization_version", 2, msg, msg_len);
    return rc;
}

/* The tokens, their types and (a "llama" vocabulary) scores; ids the
 * tokenizer has no entry for, up to the embedding's rows, are [PADn] of
 * type unused, as the converter pads them. */
static int hf_put_tokens(const hf_model *m, gguf_out *o, char *msg, size_t msg_len)
{
    size_t n = (size_t)m->vocab;
    bool spm = strcmp(tok_gguf_model(m->tok), "llama") == 0;
    gguf_str *strs = calloc(n, sizeof *strs);
    int32_t *types = calloc(n, sizeof *types), *merges = NULL;
    float *scores = calloc(n, sizeof *scores);
    char *pads = calloc(n, 16);
    size_t n_merges = 0;
    int rc = strs && types && scores && pads && tok_merges(m->tok, &merges, &n_merges) == QL_OK
                 ? QL_OK
                 : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the vocabulary");
    for (size_t id = 0; id < n && rc == QL_OK; id++) {
        size_t len;
        int type;
        const char *s = tok_token_text(m->tok, (int32_t)id, &len, &type);
        if (!s) {
            len = (size_t)snprintf(pads + 16 * id, 16, "[PAD%zu]", id);
            s = pads + 16 * id;
            type = 5; /* unused */
        }
        strs[id] = (gguf_str){s, len};
        types[id] = type;
        /* below every merge: only merges decide the order */
        scores[id] = -(float)(n_merges + 1);
    }
    for (size_t r = 0; r < n_merges; r++)
        if (merges[3 * r + 2] >= 0 && (size_t)merges[3 * r + 2] < n)
            scores[merges[3 * r + 2]] = -(float)r;
    if (rc == QL_OK)
        rc = put_array(o, "tokenizer.ggml.tokens", GGUF_STRING, n, NULL, strs, msg, msg_len);
    if (rc == QL_OK && spm)
        rc = put_array(o, "tokenizer.ggml.scores", GGUF_FLOAT32, n, scores, NULL, msg, msg_len);
    if (rc == QL_OK)
        rc = put_array(o, "tokenizer.ggml.token_type", GGUF_INT32, n, types, NULL, msg, msg_len);
    free(strs);
    free(types);
    free(scores);
    free(pads);
    free(merges);
    return rc;
}

/* tokenizer.ggml.merges: "left right" per merge, in rank order. */
static int hf_put_merges(const hf_model *m, gguf_out *o, char *msg, size_t msg_len)
{
    int32_t *merges;
    size_t n, total = 0;
    if (tok_merges(m->tok, &merges, &n) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for the merges");
    for (size_t r = 0; r < 3 * n; r++) {
        size_t len;
        int type;
        total += (tok_token_text(m->tok, merges[r], &len, &type) ? len : 0) + 1;
    }
    gguf_str *strs = calloc(n ? n : 1, sizeof *strs);
    char *text = malloc(total ? total : 1);
    int rc = strs && text ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    size_t at = 0;
    for (size_t r = 0; r < n && rc == QL_OK; r++) {
        size_t la = 0, lb = 0;
        int type;
        const char *a = tok_token_text(m->tok, merges[3 * r], &la, &type);
        const char *b = tok_token_text(m->tok, merges[3 * r + 1], &lb, &type);
        strs[r].ptr = text + at;
        memcpy(text + at, a, la);
        text[at + la] = ' ';
        memcpy(text + at + la + 1, b, lb);
        strs[r].len = la + 1 + lb;
        at += la + 1 + lb;
    }
    if (rc == QL_OK)
        rc = put_array(o, "tokenizer.ggml.merges", GGUF_STRING, n, NULL, strs, msg, msg_len);
    free(strs);
    free(text);
    free(merges);
    return rc;
}

/* The token id tokenizer_config.json names at key (a string, or an object
 * with "content"), or -1. */
static int32_t config_token(const hf_model *m, const cJSON *tc, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(tc, key);
    const char *s = cJSON_IsString(v) ? v->valuestring : mf_json_str(v, "content");
    return s ? tok_token_id(m->tok, s, strlen(s)) : -1;
}

static int hf_put_tokenizer(const hf_model *m, gguf_out *o, char *msg, size_t msg_len)
{
    const char *model = tok_gguf_model(m->tok), *pre = tok_gguf_pre(m->tok);
    if (!pre)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: the tokenizer's pre-tokenizer (%s) has no llama.cpp name, so a GGUF "
                       "cannot say it",
                       m->dir, tok_describe(m->tok));
    if (tok_vocab_size(m->tok) > (size_t)m->vocab)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the tokenizer has %zu tokens, more than vocab_size %" PRId64, m->dir,
                       tok_vocab_size(m->tok), m->vocab);
    int rc = put_str(o, "tokenizer.ggml.model", model, strlen(model), msg, msg_len);
    if (rc == QL_OK)
        rc = put_str(o, "tokenizer.ggml.pre", pre, strlen(pre), msg, msg_len);
    if (rc == QL_OK)
        rc = hf_put_tokens(m, o, msg, msg_len);
    if (rc == QL_OK && strcmp(model, "gpt2") == 0)
        rc = hf_put_merges(m, o, msg, msg_len);
    char path[8192];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", m->dir);
    cJSON *tc = NULL;
    FILE *fp = fopen(path, "rb");
    if (fp) {
        fclose(fp);
        if (rc == QL_OK)
            rc = mf_read_json(path, HF_JSON_MAX, &tc, msg, msg_len);
    }
    const struct {
        const char *key;
        int32_t id;
    } ids[] = {{"tokenizer.ggml.bos_token_id", tok_bos(m->tok)},
               {"tokenizer.ggml.eos_token_id", tok_eos(m->tok)},
               {"tokenizer.ggml.unknown_token_id", tok_unk(m->tok)},
               {"tokenizer.ggml.padding_token_id", config_token(m, tc, "pad_token")}};
    for (size_t i = 0; i < sizeof ids / sizeof *ids && rc == QL_OK; i++)
        if (ids[i].id >= 0)
            rc = gguf_out_set_u32(o, ids[i].key, (uint32_t)ids[i].id, msg, msg_len);
    if (rc == QL_OK)
        rc = put_bool(o, "tokenizer.ggml.add_bos_token", tok_adds_bos(m->tok), msg, msg_len);
    if (rc == QL_OK)
        rc = put_bool(o, "tokenizer.ggml.add_eos_token", mf_json_bool(tc, "add_eos_token", false),
                      msg, msg_len);
    cJSON_Delete(tc);
    char *tmpl = NULL, *tool_use = NULL;
    if (rc == QL_OK)
        rc = eng_chat_templates_from_folder(m->dir, &tmpl, &tool_use, msg, msg_len);
    if (rc == QL_OK && tmpl)
        rc = put_str(o, "tokenizer.chat_template", tmpl, strlen(tmpl), msg, msg_len);
    if (rc == QL_OK && tool_use)
        rc = put_str(o, "tokenizer.chat_template.tool_use", tool_use, strlen(tool_use), msg,
                     msg_len);
    free(tmpl);
    free(tool_use);
    return rc;
}

/* --- the tensors ---------------------------------------------------------- */

static int hf_declare(const hf_model *m, gguf_out *o, size_t counts[3], FILE *log, char *msg,
                      size_t msg_len)
{
    int rc = QL_OK;
    for (size_t i = 0; i < m->n_tensors && rc == QL_OK; i++) {
        const hf_tensor *t = &m->tensors[i];
        int64_t ne[2] = {t->src ? t->src->shape[t->src->ndim - 1] : m->head_dim / 2, 1};
        int nd = t->src ? t->src->ndim : 1;
        if (nd == 2)
            ne[1] = t->src->shape[0];
        qt_kind k = t->kind == QT_KIND_COUNT ? QT_F32 : t->kind;
        rc = gguf_out_add_tensor(o, t->name, cli_ggml_type_of(k), nd, ne, msg, msg_len);
        counts[t->kind == QT_KIND_COUNT ? 2 : t->fell_back ? 1 : 0]++;
        if (rc == QL_OK && log)
            fprintf(log, "%s -> %s: [%" PRId64 ", %" PRId64 "] %s%s%s\n",
                    t->src ? t->src->name : "(llama3 rope scaling)", t->name, ne[0], ne[1],
                    qt_kind_name(k), t->permute_heads ? ", rows permuted as llama.cpp's" : "",
                    t->fell_back ? ", a fallback: columns not a multiple of the kind's block" : "");
    }
    return rc;
}

/* One tensor's data to o: a 1-D one as f32 (a permuted bias reordered),
 * a 2-D one through cli_gguf_write_rows with the permutation as its row
 * map. */
static int hf_write_tensor(const hf_model *m, const hf_tensor *t, gguf_out *o, char *msg,
                           size_t msg_len)
{
    if (!t->src)
        return gguf_out_write(o, m->rope_freqs, (size_t)(m->head_dim / 2) * sizeof(float), msg,
                              msg_len);
    qtensor src;
    int rc = st_tensor_qtensor(t->file, t->src, &src, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int64_t rows = t->src->shape[0];
    int64_t *row_of = NULL;
    if (t->permute_heads) {
        int64_t per = rows / t->permute_heads, half = per / 2;
        row_of = malloc((size_t)rows * sizeof *row_of);
        if (!row_of || rows % t->permute_heads || per % 2) {
            free(row_of);
            qt_free(&src);
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "tensor '%s': %" PRId64 " rows do not split into %d heads of rotary "
                           "pairs",
                           t->src->name, rows, t->permute_heads);
        }
        /* output row h*per + 2i + j is row h*per + j*half + i: the two
         * rotary halves of each head interleaved into adjacent pairs */
        for (int64_t r = 0; r < rows; r++)
            row_of[r] = r / per * per + (r % per % 2) * half + (r % per) / 2;
    }
    if (t->src->ndim == 1) {
        float *v = malloc((size_t)rows * sizeof *v);
        rc = v ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        if (rc == QL_OK) {
            float *in = malloc((size_t)rows * sizeof *in);
            rc = in ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
            if (in) {
                qt_dequantize_rows(&src, 0, src.rows, in);
                for (int64_t r = 0; r < rows; r++)
                    v[r] = in[row_of ? row_of[r] : r];
                rc = gguf_out_write(o, v, (size_t)rows * sizeof *v, msg, msg_len);
            }
            free(in);
        }
        free(v);
    } else {
        rc = cli_gguf_write_rows(&src, row_of, t->kind, t->src->name, o, msg, msg_len);
    }
    free(row_of);
    qt_free(&src);
    return rc;
}

int cli_quantize_hf(const eng_quantize_opts *o, const cli_gguf_target *g, FILE *log, char *msg,
                    size_t msg_len)
{
    if (o->double_quant)
        return ql_fail(msg, msg_len, QL_EINVAL, "--double-quant is for nf4 and fp4, not %s",
                       g->name);
    hf_model m = {.dir = o->in_path};
    int rc = hf_config(&m, msg, msg_len);
    if (rc == QL_OK)
        rc = hf_open_weights(&m, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_tokenizer_load(&m.tok, m.dir, msg, msg_len);
    if (rc == QL_OK)
        rc = hf_plan(&m, g, msg, msg_len);
    gguf_out *w = rc == QL_OK ? gguf_out_new(32) : NULL;
    if (rc == QL_OK && !w)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    size_t counts[3] = {0}; /* quantized to the kind, fell back, kept f32 */
    if (rc == QL_OK)
        rc = hf_put_model_meta(&m, g, w, msg, msg_len);
    if (rc == QL_OK)
        rc = hf_put_tokenizer(&m, w, msg, msg_len);
    if (rc == QL_OK)
        rc = hf_declare(&m, w, counts, log, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_begin(w, o->out_path, msg, msg_len);
    for (size_t i = 0; i < m.n_tensors && rc == QL_OK; i++)
        rc = hf_write_tensor(&m, &m.tensors[i], w, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_out_finish(w, msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log, "wrote %s (%s): %zu tensors quantized to %s, %zu fell back, %zu kept f32\n",
                o->out_path, m.arch, counts[0], g->name, counts[1], counts[2]);
    gguf_out_free(w);
    hf_free(&m);
    return rc;
}

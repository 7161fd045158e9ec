/*
 * qwen35.c - Qwen3.5's config (Qwen3_5ForCausalLM, transformers 5's
 * Qwen3_5TextConfig): which layers are Gated DeltaNet linear attention
 * (layer_types, or every full_attention_interval-th layer full), their
 * heads and conv (hybrid.h's eng_linear_cfg), and the full layers' output
 * gate and (1 + w) norms; the same from a qwen35 or qwen35moe GGUF (llama.cpp's
 * converter's keys), whose MTP blocks it reads into eng_model.mtp (mtp.h)
 * as mtp.c reads a folder's mtp.*. What it does not run is refused by name.
 *
 * It offers model_qwen35_config_hf, model_qwen35_text_config,
 * model_qwen35_config_gguf and model_qwen35_mtp_load_gguf
 * (internal/model_internal.h); it owns nothing, and touches only the
 * eng_config it is given and, for the MTP blocks, the model's mtp.
 */
#include "internal/model_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Mark layer l linear attention. */
static void set_linear(eng_linear_cfg *lc, int32_t l)
{
    lc->layers[l / 64] |= (uint64_t)1 << (l % 64);
    lc->n_layers++;
}

/* layer_types when given ("linear_attention" / "full_attention"), else
 * Qwen3_5TextConfig's default: layer l full when (l + 1) is a multiple of
 * full_attention_interval. */
static int read_layer_types(const char *path, const cJSON *j, eng_config *c, char *msg,
                            size_t msg_len)
{
    eng_linear_cfg *lc = &c->linear;
    if (c->n_layers > ENG_MAX_LINEAR_LAYERS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: %d layers; a hybrid model may have %d",
                       path, c->n_layers, ENG_MAX_LINEAR_LAYERS);
    const cJSON *types = cJSON_GetObjectItemCaseSensitive(j, "layer_types");
    if (!types || cJSON_IsNull(types)) {
        int32_t every = 4;
        int rc = model_json_int32(path, j, "full_attention_interval", 4, false, 1, 1 << 20, &every,
                                  msg, msg_len);
        for (int32_t l = 0; rc == QL_OK && l < c->n_layers; l++)
            if ((l + 1) % every != 0)
                set_linear(lc, l);
        return rc;
    }
    if (!cJSON_IsArray(types) || cJSON_GetArraySize(types) != c->n_layers)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: \"layer_types\" is not a list of num_hidden_layers = %d entries", path,
                       c->n_layers);
    for (int32_t l = 0; l < c->n_layers; l++) {
        const char *t = cJSON_GetArrayItem(types, l)->valuestring;
        if (t && strcmp(t, "linear_attention") == 0)
            set_linear(lc, l);
        else if (!t || strcmp(t, "full_attention") != 0)
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: layer_types[%d] is %s; qlserve runs \"linear_attention\" and "
                           "\"full_attention\" layers",
                           path, l, t ? t : "not a string");
    }
    return QL_OK;
}

/* Options of Qwen3.5 checkpoints qlserve does not run, refused by name. */
static int refuse_options(const char *path, const cJSON *j, char *msg, size_t msg_len)
{
    const char *act = mf_json_str(j, "hidden_act");
    if (act && strcmp(act, "silu") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: hidden_act %s; qlserve runs Qwen3.5 with silu (the MLP's and the "
                       "conv's activation)",
                       path, act);
    if (mf_json_bool(j, "attention_bias", false))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: attention_bias is true; qlserve runs Qwen3.5 without biases", path);
    if (!mf_json_bool(j, "attn_output_gate", true))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: attn_output_gate is false; qlserve runs Qwen3.5's gated attention only",
                       path);
    return QL_OK;
}

/* GGUF key ARCH.NAME as a positive int32 into *out; required. */
static int gguf_int(const gguf_file *f, const char *arch, const char *name, int32_t *out, char *msg,
                    size_t msg_len)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, name);
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv || kv->type == GGUF_ARRAY || kv->i <= 0 || kv->i > (1 << 20))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s is missing or not a positive count",
                       f->path, key);
    *out = (int32_t)kv->i;
    return QL_OK;
}

/*
 * llama.cpp's converter, unless told --no-mtp, appends a checkpoint's
 * multi-token-prediction layers (its mtp.*) after the decoder's blocks,
 * counted in block_count and in ARCH.nextn_predict_layers
 * (conversion/qwen.py's _QwenMtpMixin): mtp.layers.i is block n + i, n the
 * decoder's blocks (llama.cpp's n_layer()), and fc, the two input norms and
 * mtp.norm are block n's nextn.eh_proj, nextn.enorm, nextn.hnorm and
 * nextn.shared_head_norm. So the decoder is the first n blocks, and
 * c->linear.mtp_layers gets the count (model_qwen35_mtp_load_gguf reads
 * them). A nextn tensor on any other block means the key and the tensors
 * disagree: refused by name. *n_blocks gets block_count.
 */
static int split_mtp_blocks(const gguf_file *f, const char *arch, eng_config *c, int32_t *n_blocks,
                            char *msg, size_t msg_len)
{
    char key[96];
    snprintf(key, sizeof key, "%s.nextn_predict_layers", arch);
    const gguf_kv *kv = gguf_find_kv(f, key);
    *n_blocks = c->n_layers;
    if (kv) {
        bool integer = kv->type != GGUF_ARRAY && kv->type != GGUF_STRING &&
                       kv->type != GGUF_FLOAT32 && kv->type != GGUF_FLOAT64 &&
                       kv->type != GGUF_BOOL;
        if (!integer || kv->i < 0 || kv->i >= c->n_layers || kv->i > 16)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: %s is not a count of MTP blocks (at most 16) below block_count "
                           "= %d",
                           f->path, key, c->n_layers);
        c->linear.mtp_layers = (int32_t)kv->i;
        c->n_layers -= c->linear.mtp_layers;
    }
    for (uint64_t t = 0; t < f->n_tensors; t++) {
        int block = -1, at = 0;
        if (sscanf(f->tensors[t].name, "blk.%d.nextn.%n", &block, &at) == 1 && at > 0 &&
            (c->linear.mtp_layers == 0 || block != c->n_layers))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor %s disagrees with %s = %d: the MTP tensors (nextn.*) "
                           "belong to block %d, the first past the decoder's",
                           f->path, f->tensors[t].name, key, c->linear.mtp_layers, c->n_layers);
    }
    return QL_OK;
}

int model_qwen35_mtp_load_gguf(model_loader *L, model_tensor_loader load, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    const eng_config *c = &m->cfg;
    const gguf_file *f = m->gguf;
    int32_t n = c->n_layers, k = c->linear.mtp_layers;
    /* a mixture's MTP layer is a mixture too, not read yet: the decoder
     * runs without it, as before */
    if (c->arch != ENG_ARCH_QWEN3_5 || k == 0 || c->n_experts > 0)
        return QL_OK;
    char name[96];
    static const char *const own[] = {"embed_tokens", "shared_head_head"};
    for (size_t i = 0; i < sizeof own / sizeof *own; i++) {
        snprintf(name, sizeof name, "blk.%d.nextn.%s.weight", n, own[i]);
        if (gguf_find_tensor(f, name))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: tensor %s: qlserve runs MTP layers on the model's own "
                           "embeddings and lm_head",
                           f->path, name);
    }
    snprintf(name, sizeof name, "blk.%d.nextn.eh_proj.weight", n);
    if (!gguf_find_tensor(f, name))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: qwen35.nextn_predict_layers is %d but tensor %s (the MTP's fc) is "
                       "missing",
                       f->path, k, name);
    eng_mtp *mtp = &m->mtp;
    mtp->layers = calloc((size_t)k, sizeof *mtp->layers);
    if (!mtp->layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    mtp->n_layers = k; /* what model_mtp_free frees, loaded or half */
    int64_t h = c->hidden_size;
    const struct {
        const char *name;
        int64_t cols;
        tensor_role role;
        qtensor *dst;
    } parts[] = {{"eh_proj", 2 * h, ROLE_LINEAR, &mtp->fc},
                 {"enorm", 0, ROLE_DENSE, &mtp->norm_embed},
                 {"hnorm", 0, ROLE_DENSE, &mtp->norm_hidden},
                 {"shared_head_norm", 0, ROLE_DENSE, &mtp->norm}};
    int rc = QL_OK;
    for (size_t i = 0; i < sizeof parts / sizeof *parts && rc == QL_OK; i++) {
        snprintf(name, sizeof name, "blk.%d.nextn.%s.weight", n, parts[i].name);
        /* llama.cpp's graph falls back to the model's final norm without it */
        if (parts[i].dst == &mtp->norm && !gguf_find_tensor(f, name))
            snprintf(name, sizeof name, "output_norm.weight");
        rc = load(L, name, h, parts[i].cols, parts[i].role, parts[i].dst, msg, msg_len);
    }
    for (int32_t i = 0; i < k && rc == QL_OK; i++)
        rc = model_layer_load_full_gguf(L, load, n + i, &mtp->layers[i], msg, msg_len);
    return rc;
}

int model_qwen35_config_gguf(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                             size_t msg_len)
{
    eng_linear_cfg *lc = &c->linear;
    int32_t inner = 0, every = 4, n_blocks = 0;
    int rc = split_mtp_blocks(f, arch, c, &n_blocks, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_int(f, arch, "ssm.conv_kernel", &lc->conv_kernel, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_int(f, arch, "ssm.state_size", &lc->k_head_dim, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_int(f, arch, "ssm.group_count", &lc->n_k_heads, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_int(f, arch, "ssm.time_step_rank", &lc->n_v_heads, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_int(f, arch, "ssm.inner_size", &inner, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (inner % lc->n_v_heads || lc->n_v_heads % lc->n_k_heads ||
        c->n_layers > ENG_MAX_LINEAR_LAYERS)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s.ssm: %d value dims over %d value heads and %d key heads, %d "
                       "layers, do not make linear-attention layers qlserve runs",
                       f->path, arch, inner, lc->n_v_heads, lc->n_k_heads, c->n_layers);
    lc->v_head_dim = inner / lc->n_v_heads;
    char key[96];
    snprintf(key, sizeof key, "%s.attention.recurrent_layers", arch);
    const gguf_kv *rec = gguf_find_kv(f, key);
    if (rec && rec->type == GGUF_ARRAY && rec->elem == GGUF_BOOL && rec->n == (uint64_t)n_blocks &&
        rec->data) { /* a bool per block, MTP ones false */
        for (int32_t l = 0; l < c->n_layers; l++)
            if (rec->data[l]) /* bools, one byte each */
                set_linear(lc, l);
    } else {
        snprintf(key, sizeof key, "%s.full_attention_interval", arch);
        const gguf_kv *iv = gguf_find_kv(f, key);
        every = iv && iv->i > 0 ? (int32_t)iv->i : 4;
        for (int32_t l = 0; l < c->n_layers; l++)
            if ((l + 1) % every != 0)
                set_linear(lc, l);
    }
    lc->attn_output_gate = true;
    lc->v_tiled = lc->n_k_heads != lc->n_v_heads;
    lc->a_neg_exp = true;
    c->norm_offset = 0.0f; /* the converter stored 1 + w */
    c->qk_norm = true;
    c->attention_bias = false;
    return QL_OK;
}

int model_qwen35_text_config(const char *path, const cJSON *j, cJSON **text, bool *multimodal,
                             char *msg, size_t msg_len)
{
    *text = NULL;
    *multimodal = false;
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(j, "architectures");
    const cJSON *a0 = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
    const char *arch = cJSON_IsString(a0) ? a0->valuestring : "";
    bool moe = strcmp(arch, "Qwen3_5MoeForCausalLM") == 0 ||
               strcmp(arch, "Qwen3_5MoeForConditionalGeneration") == 0;
    *multimodal = strcmp(arch, "Qwen3_5ForConditionalGeneration") == 0 ||
                  strcmp(arch, "Qwen3_5MoeForConditionalGeneration") == 0;
    if (!moe && !*multimodal)
        return QL_OK;
    const cJSON *tc = *multimodal ? cJSON_GetObjectItemCaseSensitive(j, "text_config") : j;
    if (!cJSON_IsObject(tc))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s without a \"text_config\" object", path,
                       arch);
    cJSON *t = cJSON_Duplicate(tc, true),
          *names = cJSON_CreateStringArray((const char *[]){"Qwen3_5ForCausalLM"}, 1);
    if (!t || !names) {
        cJSON_Delete(t);
        cJSON_Delete(names);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    cJSON_DeleteItemFromObjectCaseSensitive(t, "architectures");
    cJSON_AddItemToObject(t, "architectures", names);
    /* a mixture (model_qwen35_config_hf reads num_experts) has no dense
     * MLP: the shared loader's intermediate_size is its experts' */
    const cJSON *ff = cJSON_GetObjectItemCaseSensitive(t, "moe_intermediate_size");
    if (moe && ff && !cJSON_GetObjectItemCaseSensitive(t, "intermediate_size"))
        cJSON_AddItemToObject(t, "intermediate_size", cJSON_Duplicate(ff, true));
    /* what the outer config holds for the whole model */
    const char *outer[] = {"tie_word_embeddings", "quantization_config", "_name_or_path"};
    for (size_t i = 0; i < sizeof outer / sizeof *outer; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, outer[i]);
        if (v && !cJSON_GetObjectItemCaseSensitive(t, outer[i]))
            cJSON_AddItemToObject(t, outer[i], cJSON_Duplicate(v, true));
    }
    *text = t;
    return QL_OK;
}

int model_qwen35_config_hf(const char *path, const cJSON *j, eng_config *c, char *msg,
                           size_t msg_len)
{
    eng_linear_cfg *lc = &c->linear;
    int rc = refuse_options(path, j, msg, msg_len);
    if (rc == QL_OK)
        rc = read_layer_types(path, j, c, msg, msg_len);
#define LIN_FIELD(key, def, dst)                                                                   \
    if (rc == QL_OK)                                                                               \
    rc = model_json_int32(path, j, key, def, false, 1, 1 << 16, dst, msg, msg_len)
    LIN_FIELD("linear_num_key_heads", 16, &lc->n_k_heads);
    LIN_FIELD("linear_num_value_heads", 32, &lc->n_v_heads);
    LIN_FIELD("linear_key_head_dim", 128, &lc->k_head_dim);
    LIN_FIELD("linear_value_head_dim", 128, &lc->v_head_dim);
    LIN_FIELD("linear_conv_kernel_dim", 4, &lc->conv_kernel);
#undef LIN_FIELD
    if (rc == QL_OK)
        rc = model_json_int32(path, j, "mtp_num_hidden_layers", 0, false, 0, 16, &lc->mtp_layers,
                              msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (lc->n_v_heads % lc->n_k_heads != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: linear_num_value_heads %d is not a multiple of linear_num_key_heads %d",
                       path, lc->n_v_heads, lc->n_k_heads);
    if (lc->k_head_dim > 512 || lc->v_head_dim > 512 || lc->conv_kernel > 16)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: linear heads of %d x %d dims and a conv of %d taps; qlserve runs up "
                       "to 512 dims and 16 taps",
                       path, lc->k_head_dim, lc->v_head_dim, lc->conv_kernel);
    /* Qwen3.5-MoE: every layer's MLP a mixture with Qwen2-MoE's gated
     * shared expert, the chosen experts' weights renormalized */
    if (rc == QL_OK && cJSON_GetObjectItemCaseSensitive(j, "num_experts")) {
        rc = model_json_int32(path, j, "shared_expert_intermediate_size", 0, true, 1, 1 << 22,
                              &c->shared_expert_ff, msg, msg_len);
        if (rc == QL_OK)
            rc = model_moe_config_hf(path, j, c, msg, msg_len);
        c->norm_topk_prob = true;
        if (rc != QL_OK)
            return rc;
    }
    lc->attn_output_gate = true;
    /* every RMSNorm but the gated one scales by (1 + w), as Gemma's */
    c->norm_offset = 1.0f;
    c->qk_norm = true;
    c->attention_bias = false;
    return QL_OK;
}

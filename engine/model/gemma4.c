/*
 * gemma4.c - Gemma 4's options beyond a Gemma 3-shaped layer, read from a
 * Hugging Face folder as transformers 5's Gemma4TextConfig and
 * modeling_gemma4.py define them: the per-layer input embeddings
 * (hidden_size_per_layer_input: embed_tokens_per_layer,
 * per_layer_model_projection, per_layer_projection_norm; each layer's
 * gate, projection and norm are rows of layers.c's table), keys used as
 * values on the full layers (attention_k_eq_v) and the kv-shared layers'
 * double-wide MLP (use_double_wide_mlp), and the full layers' own head
 * size and kv heads (global_head_dim, num_global_key_value_heads,
 * per_layer_config). load_hf.c's parse_gemma4_config refuses what is
 * still not run.
 *
 * It owns nothing; it fills eng_config.g4 and eng_model.g4 through the
 * loader it is given.
 */
#include "internal/model_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Gemma's embedding scale: sqrt(hidden), which transformers casts to the
 * embeddings' dtype before multiplying (so a bf16 model scales by
 * sqrt(hidden) rounded to bf16; f16 and f32 as their own). */
float model_gemma_embed_scale(int32_t hidden, qt_kind embed_kind)
{
    float s = (float)sqrt((double)hidden);
    if (embed_kind == QT_BF16)
        return qt_bf16_to_f32(qt_f32_to_bf16(s));
    if (embed_kind == QT_F16)
        return qt_f16_to_f32(qt_f32_to_f16(s));
    return s;
}

int64_t eng_layer_ff(const eng_config *c, int32_t l)
{
    /* Gemma4TextMLP: is_kv_shared_layer = l >= first_kv_shared > 0 */
    bool shared = c->kv_shared_layers > 0 && l >= c->n_layers - c->kv_shared_layers;
    return (int64_t)c->intermediate_size * (c->g4.double_wide && shared ? 2 : 1);
}

bool eng_layer_k_is_v(const eng_config *c, int32_t l)
{
    return c->g4.k_eq_v && !eng_layer_slides(c, l);
}

int32_t eng_layer_head_dim(const eng_config *c, int32_t l)
{
    return c->g4.full_head_dim > 0 && !eng_layer_slides(c, l) ? c->g4.full_head_dim : c->head_dim;
}

int32_t eng_layer_kv_heads(const eng_config *c, int32_t l)
{
    return c->g4.full_kv_heads > 0 && !eng_layer_slides(c, l) ? c->g4.full_kv_heads : c->n_kv_heads;
}

int32_t eng_max_head_dim(const eng_config *c)
{
    return c->g4.full_head_dim > c->head_dim ? c->g4.full_head_dim : c->head_dim;
}

int64_t eng_max_kv_dim(const eng_config *c)
{
    int64_t most = (int64_t)c->n_kv_heads * c->head_dim;
    for (int32_t l = 0; eng_heads_vary(c) && l < c->n_layers; l++) {
        int64_t kv = (int64_t)eng_layer_kv_heads(c, l) * eng_layer_head_dim(c, l);
        most = kv > most ? kv : most;
    }
    return most;
}

bool eng_heads_vary(const eng_config *c)
{
    return (c->g4.full_head_dim > 0 && c->g4.full_head_dim != c->head_dim) ||
           (c->g4.full_kv_heads > 0 && c->g4.full_kv_heads != c->n_kv_heads);
}

int32_t eng_rope_head_dim(const eng_config *c)
{
    return c->g4.full_head_dim > 0 ? c->g4.full_head_dim : c->head_dim;
}

/* enable_moe_block: num_experts, top_k_experts and moe_intermediate_size
 * (required: the config class has no defaults for them) into the
 * mixture's fields; every layer is a mixture, routed with a softmax over
 * all experts and the top-k renormalized. */
static int gemma4_moe_block(const char *path, const cJSON *j, eng_config *c, char *msg,
                            size_t msg_len)
{
    int rc =
        model_json_int32(path, j, "num_experts", 0, true, 1, 1 << 20, &c->n_experts, msg, msg_len);
    if (rc == QL_OK)
        rc = model_json_int32(path, j, "top_k_experts", 0, true, 1, 1 << 20, &c->n_experts_used,
                              msg, msg_len);
    if (rc == QL_OK)
        rc = model_json_int32(path, j, "moe_intermediate_size", 0, true, 1, 1 << 22, &c->expert_ff,
                              msg, msg_len);
    if (rc == QL_OK)
        rc = model_moe_check(path, c, msg, msg_len);
    c->g4.moe_block = c->norm_topk_prob = true;
    return rc;
}

int model_gemma4_options(const char *path, const cJSON *j, eng_config *c, char *msg, size_t msg_len)
{
    eng_gemma4_config *g = &c->g4;
    /* Gemma4TextConfig's default is 256: a config that leaves it out has them */
    int rc = model_json_int32(path, j, "hidden_size_per_layer_input", 256, false, 0, 1 << 16,
                              &g->ple_dim, msg, msg_len);
    if (rc == QL_OK && g->ple_dim > 0)
        rc = model_json_int32(path, j, "vocab_size_per_layer_input", c->vocab_size, false,
                              c->vocab_size, 1 << 24, &g->ple_vocab, msg, msg_len);
    if (rc == QL_OK && g->ple_dim > 0 && (int64_t)g->ple_dim * c->n_layers > (1 << 22))
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: hidden_size_per_layer_input %d x %d layers is more than 4M values a "
                     "token",
                     path, g->ple_dim, c->n_layers);
    if (rc != QL_OK)
        return rc;
    if (mf_json_bool(j, "enable_moe_block", false) &&
        (rc = gemma4_moe_block(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    g->k_eq_v = mf_json_bool(j, "attention_k_eq_v", false);
    g->double_wide = mf_json_bool(j, "use_double_wide_mlp", false);
    return QL_OK;
}

/* One layer's shape as per_layer_config gives it: head_dim and
 * num_key_value_heads (absent: the config's); any other key is refused
 * by name. */
static int layer_overrides(const char *path, const cJSON *e, const eng_config *c, int32_t *hd,
                           int32_t *kv, char *msg, size_t msg_len)
{
    *hd = c->head_dim;
    *kv = c->n_kv_heads;
    const cJSON *v;
    cJSON_ArrayForEach (v, e) {
        bool head = strcmp(v->string, "head_dim") == 0,
             heads = strcmp(v->string, "num_key_value_heads") == 0;
        if (!head && !heads)
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: per_layer_config[%s].%s is not supported (qlserve runs "
                           "head_dim and num_key_value_heads per layer)",
                           path, e->string, v->string);
        int64_t n = 0;
        if (!mf_json_integer(v, 1, head ? 1 << 16 : 4096, &n))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: per_layer_config[%s].%s is not a positive integer", path, e->string,
                           v->string);
        *(head ? hd : kv) = (int32_t)n;
    }
    return QL_OK;
}

/* per_layer_config (what save_pretrained writes from global_head_dim and
 * num_global_key_value_heads): layer index -> its overrides. qlserve runs
 * one shape for the full layers and the sliding layers' own, so a sliding
 * layer given another shape, or two full layers given different ones, is
 * refused by name. */
static int per_layer_shapes(const char *path, const cJSON *plc, eng_config *c, char *msg,
                            size_t msg_len)
{
    if (!cJSON_IsObject(plc))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: per_layer_config is not an object", path);
    int32_t full_hd = -1, full_kv = -1;
    for (int32_t l = 0; l < c->n_layers; l++) {
        char key[16];
        snprintf(key, sizeof key, "%d", l);
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(plc, key);
        int32_t hd = c->head_dim, kv = c->n_kv_heads;
        int rc = e ? layer_overrides(path, e, c, &hd, &kv, msg, msg_len) : QL_OK;
        if (rc != QL_OK)
            return rc;
        bool slides = eng_layer_slides(c, l);
        if ((slides && (hd != c->head_dim || kv != c->n_kv_heads)) ||
            (!slides && full_hd >= 0 && (hd != full_hd || kv != full_kv)))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: per_layer_config gives layer %d (%s) head_dim %d and %d kv "
                           "heads; qlserve runs one shape for the sliding layers and one for "
                           "the full ones",
                           path, l, slides ? "sliding" : "full", hd, kv);
        if (!slides && full_hd < 0) {
            full_hd = hd;
            full_kv = kv;
        }
    }
    const cJSON *e;
    cJSON_ArrayForEach (e, plc) {
        char *end = NULL;
        long l = strtol(e->string, &end, 10);
        if (!end || *end || end == e->string || l < 0 || l >= c->n_layers)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: per_layer_config has \"%s\", not a layer of the %d", path,
                           e->string, c->n_layers);
    }
    c->g4.full_head_dim = full_hd > 0 ? full_hd : c->head_dim;
    c->g4.full_kv_heads = full_kv > 0 ? full_kv : c->n_kv_heads;
    return QL_OK;
}

int model_gemma4_head_shapes(const char *path, const cJSON *j, eng_config *c, char *msg,
                             size_t msg_len)
{
    eng_gemma4_config *g = &c->g4;
    const cJSON *plc = cJSON_GetObjectItemCaseSensitive(j, "per_layer_config");
    int rc;
    if (plc && !cJSON_IsNull(plc)) {
        rc = per_layer_shapes(path, plc, c, msg, msg_len);
    } else {
        /* Gemma4TextConfig: global_head_dim (512 when absent) on every
         * full layer; num_global_key_value_heads only where
         * attention_k_eq_v lets it apply */
        rc = model_json_int32(path, j, "global_head_dim", 512, false, 2, 1 << 16, &g->full_head_dim,
                              msg, msg_len);
        g->full_kv_heads = c->n_kv_heads;
        if (rc == QL_OK && g->k_eq_v)
            rc = model_json_int32(path, j, "num_global_key_value_heads", c->n_kv_heads, false, 1,
                                  4096, &g->full_kv_heads, msg, msg_len);
    }
    if (rc != QL_OK)
        return rc;
    if (g->full_head_dim % 2 != 0 || c->n_heads % g->full_kv_heads != 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the full layers' head_dim %d (global_head_dim) is odd, or their %d "
                       "kv heads (num_global_key_value_heads) do not divide %d heads",
                       path, g->full_head_dim, g->full_kv_heads, c->n_heads);
    if (eng_heads_vary(c) && c->sliding_window <= 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: without a sliding_window qlserve cannot tell the full layers "
                       "(global_head_dim %d) from the sliding ones (head_dim %d)",
                       path, g->full_head_dim, c->head_dim);
    return QL_OK;
}

int model_gemma4_text_config(const char *path, const cJSON *j, cJSON **text, char *msg,
                             size_t msg_len)
{
    *text = NULL;
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(j, "architectures");
    const cJSON *a0 = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
    if (!cJSON_IsString(a0) || strcmp(a0->valuestring, "Gemma4ForConditionalGeneration") != 0)
        return QL_OK;
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(j, "text_config");
    if (!cJSON_IsObject(tc))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: Gemma4ForConditionalGeneration without a \"text_config\" object", path);
    const char *causal[] = {"Gemma4ForCausalLM"};
    cJSON *t = cJSON_Duplicate(tc, true), *arch = cJSON_CreateStringArray(causal, 1);
    if (t && arch) {
        cJSON_DeleteItemFromObjectCaseSensitive(t, "architectures");
        cJSON_AddItemToObject(t, "architectures", arch);
    } else {
        cJSON_Delete(arch);
        cJSON_Delete(t);
        t = NULL;
    }
    static const char *const outer[] = {"tie_word_embeddings", "quantization_config",
                                        "_name_or_path"};
    for (size_t i = 0; t && i < sizeof outer / sizeof *outer; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, outer[i]);
        if (v && !cJSON_GetObjectItemCaseSensitive(t, outer[i]))
            cJSON_AddItemToObject(t, outer[i], cJSON_Duplicate(v, true));
    }
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    *text = t;
    return QL_OK;
}

int model_gemma4_load(model_loader *L, model_tensor_loader load, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    eng_config *c = &m->cfg;
    int64_t P = c->g4.ple_dim, LP = (int64_t)c->n_layers * P;
    /* the table is an embedding (never quantized on load); the projection
     * a linear of the model's, quantized with the layers' */
    int rc = load(L, "model.embed_tokens_per_layer.weight", c->g4.ple_vocab, LP, ROLE_EMBED,
                  &m->g4.ple_embed, msg, msg_len);
    if (rc == QL_OK)
        rc = load(L, "model.per_layer_model_projection.weight", LP, c->hidden_size, ROLE_LINEAR,
                  &m->g4.ple_proj, msg, msg_len);
    if (rc == QL_OK)
        rc = load(L, "model.per_layer_projection_norm.weight", P, 0, ROLE_DENSE, &m->g4.ple_norm,
                  msg, msg_len);
    if (rc == QL_OK)
        c->g4.ple_embed_scale = model_gemma_embed_scale(c->g4.ple_dim, m->g4.ple_embed.kind);
    return rc;
}

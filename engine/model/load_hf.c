/*
 * load_hf.c - load a Hugging Face folder into an eng_model: config.json,
 * one model.safetensors or the shards model.safetensors.index.json lists,
 * tokenizer.json (and tokenizer_config.json when there), and the same
 * folder saved by transformers with bitsandbytes 4-bit weights.
 *
 * Shape of the loader: first the config (what the model must look like),
 * then each tensor by name, checked against the shape the config implies
 * before it is kept. Dense tensors stay in the mapped shards (borrowed,
 * st_tensor_qtensor); bitsandbytes codes are copied once (bnb_read). It
 * owns nothing itself: the shards it opens and the tensors it loads go
 * into the model, which eng_model_free releases. It touches the folder's
 * files only.
 */
#include "internal/model_internal.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

/* config.json and the shard index are small; anything past this is not
 * one of them. */
#define JSON_MAX_BYTES ((size_t)64 << 20)

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* --- config.json ------------------------------------------------------------ */

/* mf_json_positive_field into a float field of eng_config. */
static int positive_float(const char *path, const cJSON *j, const char *key, double def, float *out,
                          char *msg, size_t msg_len)
{
    double v;
    int rc = mf_json_positive_field(path, j, key, def, &v, msg, msg_len);
    if (rc == QL_OK)
        *out = (float)v;
    return rc;
}

/* One of longrope's factor lists (rs[key]): head_dim / 2 positive numbers
 * (each divides a pair's frequency) into out. */
static int longrope_factors(const char *path, const cJSON *rs, const char *key, int32_t half,
                            float *out, char *msg, size_t msg_len)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(rs, key);
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != half)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: rope_scaling %s must be a list of rotary dims / 2 = %d numbers", path,
                       key, half);
    for (int32_t i = 0; i < half; i++) {
        double v;
        if (!mf_json_number(cJSON_GetArrayItem(a, i), &v) || !isfinite(v) || v <= 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: rope_scaling %s[%d] is not a positive number", path, key, i);
        out[i] = (float)v;
    }
    return QL_OK;
}

/*
 * Phi-3's longrope (type "longrope", or "su" in its first configs), as
 * transformers' _compute_longrope_parameters reads it: the original
 * context from rope_scaling or, as Phi-3 saves it, the top level (else the
 * context itself); factor, when not given, the context over the original;
 * attention_factor, when not given, sqrt(1 + ln(factor) / ln(original)),
 * or 1 when factor <= 1. Both short_factor and long_factor are kept: each
 * sequence takes one (eng_rope_long_for).
 */
static int parse_longrope(const char *path, const cJSON *j, const cJSON *rs, eng_config *c,
                          char *msg, size_t msg_len)
{
    int32_t half = (c->rope_dim ? c->rope_dim : c->head_dim) / 2;
    if (half > ENG_MAX_ROPE_FREQ_FACTORS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: head dim %d has more rotary pairs than the %d frequency factors "
                       "qlserve holds",
                       path, c->head_dim, ENG_MAX_ROPE_FREQ_FACTORS);
    const cJSON *where =
        cJSON_GetObjectItemCaseSensitive(rs, "original_max_position_embeddings") ? rs : j;
    int rc = model_json_int32(path, where, "original_max_position_embeddings",
                              c->max_position_embeddings, false, 1, 1 << 24,
                              &c->rope_original_max_position, msg, msg_len);
    double orig = (double)c->rope_original_max_position;
    double factor = (double)c->max_position_embeddings / orig;
    if (rc == QL_OK && cJSON_GetObjectItemCaseSensitive(rs, "factor"))
        rc = mf_json_positive_field(path, rs, "factor", 1.0, &factor, msg, msg_len);
    double attn = factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log(orig));
    const cJSON *af = cJSON_GetObjectItemCaseSensitive(rs, "attention_factor");
    if (rc == QL_OK && af && !cJSON_IsNull(af))
        rc = mf_json_positive_field(path, rs, "attention_factor", 1.0, &attn, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = longrope_factors(path, rs, "short_factor", half, c->rope_freq_factors, msg, msg_len);
    if (rc == QL_OK)
        rc = longrope_factors(path, rs, "long_factor", half, c->rope_long_freq_factors, msg,
                              msg_len);
    if (rc != QL_OK)
        return rc;
    c->rope_scaling = ENG_ROPE_LONGROPE;
    c->rope_factor = (float)factor;
    c->rope_attn_factor = (float)attn;
    c->n_rope_freq_factors = half;
    return QL_OK;
}

/* An optional number of rs (absent or null: def), which must be finite. */
static int yarn_number(const char *path, const cJSON *rs, const char *key, double def, double *out,
                       char *msg, size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(rs, key);
    *out = def;
    if (!v || cJSON_IsNull(v))
        return QL_OK;
    if (!mf_json_number(v, out) || !isfinite(*out))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: rope_scaling %s is not a number", path, key);
    return QL_OK;
}

/*
 * YaRN (GPT-OSS), as transformers' _compute_yarn_parameters reads it:
 * original_max_position_embeddings (required), factor (when null, the
 * context over the original), beta_fast and beta_slow (32 and 1 when absent
 * or 0), truncate (true when absent; GPT-OSS's config says false), and the
 * attention factor: attention_factor when given, else mscale / mscale_all_dim
 * of the factor when both are, else 0.1 ln(factor) + 1.
 */
static int parse_yarn(const char *path, const cJSON *rs, eng_config *c, char *msg, size_t msg_len)
{
    int rc = model_json_int32(path, rs, "original_max_position_embeddings", 0, true, 1, 1 << 24,
                              &c->rope_original_max_position, msg, msg_len);
    double factor = 0, attn = 0, fast = 0, slow = 0, ms = 0, ms_all = 0;
    if (rc == QL_OK)
        rc = yarn_number(path, rs, "factor",
                         (double)c->max_position_embeddings / c->rope_original_max_position,
                         &factor, msg, msg_len);
    if (rc == QL_OK)
        rc = yarn_number(path, rs, "beta_fast", 0, &fast, msg, msg_len);
    if (rc == QL_OK)
        rc = yarn_number(path, rs, "beta_slow", 0, &slow, msg, msg_len);
    if (rc == QL_OK)
        rc = yarn_number(path, rs, "mscale", 0, &ms, msg, msg_len);
    if (rc == QL_OK)
        rc = yarn_number(path, rs, "mscale_all_dim", 0, &ms_all, msg, msg_len);
    if (rc == QL_OK)
        rc = yarn_number(path, rs, "attention_factor", 0, &attn, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (!(factor > 0) || fast < 0 || slow < 0 || attn < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: rope_scaling yarn needs a positive factor and non-negative betas and "
                       "attention_factor",
                       path);
    if (attn == 0)
        attn = ms != 0 && ms_all != 0
                   ? model_yarn_mscale(factor, ms) / model_yarn_mscale(factor, ms_all)
                   : model_yarn_mscale(factor, 1.0);
    c->rope_scaling = ENG_ROPE_YARN;
    c->rope_factor = (float)factor;
    c->rope_attn_factor = (float)attn;
    c->rope_yarn_beta_fast = fast != 0 ? (float)fast : 32.0f;
    c->rope_yarn_beta_slow = slow != 0 ? (float)slow : 1.0f;
    c->rope_yarn_truncate = mf_json_bool(rs, "truncate", true);
    return QL_OK;
}

/* partial_rotary_factor (top level, or in rope_parameters, where
 * transformers 5 moves it): the leading int(head_dim * factor) dims of each
 * head rotate (Phi-4-mini: 0.75), as transformers computes the rotary dim;
 * it must be in (0, 1] and leave an even, non-zero count. */
static int read_partial_rotary(const char *path, const cJSON *j, const cJSON *rs, eng_config *c,
                               char *msg, size_t msg_len)
{
    const cJSON *objs[] = {rs, j};
    c->rope_dim = 0;
    for (size_t i = 0; i < 2; i++) {
        const cJSON *v =
            objs[i] ? cJSON_GetObjectItemCaseSensitive(objs[i], "partial_rotary_factor") : NULL;
        if (!v || cJSON_IsNull(v))
            continue;
        double f;
        int32_t rot = 0;
        if (mf_json_number(v, &f) && f > 0 && f <= 1)
            rot = (int32_t)((double)c->head_dim * f);
        if (rot <= 0 || rot % 2)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: partial_rotary_factor must be in (0, 1] and leave an even number "
                           "of rotary dims of the head's %d",
                           path, c->head_dim);
        c->rope_dim = rot == c->head_dim ? 0 : rot;
        return QL_OK;
    }
    return QL_OK;
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
    if (rs && !cJSON_IsNull(rs) && !cJSON_IsObject(rs))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"rope_scaling\" is not an object", path);
    if (rs && cJSON_IsNull(rs))
        rs = NULL;
    int rc = read_partial_rotary(path, j, rs, c, msg, msg_len);
    if (rc != QL_OK || !rs)
        return rc;
    /* Gemma 3 in transformers 5: a set per layer type; the full layers'
     * is the model's scaling (parse_gemma_config reads the sliding one) */
    const cJSON *full = cJSON_GetObjectItemCaseSensitive(rs, "full_attention");
    if (cJSON_IsObject(full))
        rs = full;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!type)
        type = cJSON_GetObjectItemCaseSensitive(rs, "type");
    const char *t = cJSON_IsString(type) ? type->valuestring : "(missing)";
    /* transformers' Phi3Config reads "su" and "yarn" as longrope too */
    if (strcmp(t, "longrope") == 0 || strcmp(t, "su") == 0 ||
        (strcmp(t, "yarn") == 0 && c->arch == ENG_ARCH_PHI3))
        return parse_longrope(path, j, rs, c, msg, msg_len);
    if (strcmp(t, "yarn") == 0)
        return parse_yarn(path, rs, c, msg, msg_len);
    rc = positive_float(path, rs, "factor", 1.0, &c->rope_factor, msg, msg_len);
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
        rc = positive_float(path, rs, "low_freq_factor", 1.0, &c->rope_low_freq_factor, msg,
                            msg_len);
        if (rc == QL_OK)
            rc = positive_float(path, rs, "high_freq_factor", 4.0, &c->rope_high_freq_factor, msg,
                                msg_len);
        if (rc == QL_OK)
            rc = model_json_int32(path, rs, "original_max_position_embeddings", 8192, false, 1,
                                  1 << 24, &c->rope_original_max_position, msg, msg_len);
        return rc;
    }
    if (strcmp(t, "proportional") == 0 && c->arch == ENG_ARCH_GEMMA4) {
        c->rope_scaling = ENG_ROPE_PROPORTIONAL; /* parse_gemma4_config counts the pairs */
        return QL_OK;
    }
    return ql_fail(msg, msg_len, QL_EINVAL,
                   "%s: rope_scaling type \"%s\" is not supported (linear, llama3, longrope, yarn)",
                   path, t);
}

/* --- Gemma 2 and 3 ------------------------------------------------------------ */

/* A number field that may be null (off: 0) or absent (def), else > 0. */
static int nullable_positive(const char *path, const cJSON *j, const char *key, double def,
                             float *out, char *msg, size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    double d = def;
    if (v && cJSON_IsNull(v))
        d = 0.0;
    else if (v && (!mf_json_number(v, &d) || !(d > 0.0) || !isfinite(d)))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"%s\" is not a positive number or null",
                       path, key);
    *out = (float)d;
    return QL_OK;
}

/* Which layers slide, from layer_types (transformers 5: one
 * "sliding_attention" or "full_attention" per layer) or the older
 * sliding_window_pattern (Gemma 3; Gemma 2 and GPT-OSS alternate, layer 0
 * sliding). We run the patterns both transformers and llama.cpp build
 * (layer l slides when l % n < n - 1); another list is refused by name. */
static int parse_layer_types(const char *path, const cJSON *j, eng_config *c, char *msg,
                             size_t msg_len)
{
    const cJSON *types = cJSON_GetObjectItemCaseSensitive(j, "layer_types");
    if (!types || cJSON_IsNull(types)) {
        int32_t def = c->arch == ENG_ARCH_GEMMA3 || c->arch == ENG_ARCH_GEMMA4 ? 6 : 2;
        int rc = model_json_int32(path, j, "sliding_window_pattern", def, false, 1, 1 << 20,
                                  &c->sliding_pattern, msg, msg_len);
        if (rc == QL_OK && c->sliding_pattern == 1)
            c->sliding_window = 0; /* every layer full */
        return rc;
    }
    if (!cJSON_IsArray(types) || cJSON_GetArraySize(types) != c->n_layers)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: \"layer_types\" is not a list of num_hidden_layers = %d entries", path,
                       c->n_layers);
    int32_t n_sliding = 0, first_full = -1;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const char *t = cJSON_GetArrayItem(types, l)->valuestring;
        if (t && strcmp(t, "sliding_attention") == 0)
            n_sliding++;
        else if (t && strcmp(t, "full_attention") == 0)
            first_full = first_full < 0 ? l : first_full;
        else
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: layer_types[%d] is not \"sliding_attention\" or "
                           "\"full_attention\"",
                           path, l);
    }
    if (n_sliding == 0) {
        c->sliding_window = 0;
        return QL_OK;
    }
    /* all sliding: pattern 0; else the first full layer ends the period */
    c->sliding_pattern = first_full < 0 ? 0 : first_full + 1;
    for (int32_t l = 0; l < c->n_layers; l++) {
        bool slides = strcmp(cJSON_GetArrayItem(types, l)->valuestring, "sliding_attention") == 0;
        if (slides != eng_layer_slides(c, l))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: layer_types is not a repeating pattern of sliding layers closed by "
                           "a full one (layer %d breaks it); qlserve runs only those",
                           path, l);
    }
    return QL_OK;
}

/* A sliding layer type's rotation (rope_parameters.sliding_attention of
 * Gemma 3, OLMo 3, Gemma 4): plain, with its own base (def when absent);
 * another rope_type is refused by name. */
static int sliding_rope_base(const char *path, const cJSON *slide, double def, float *out,
                             char *msg, size_t msg_len)
{
    const char *t = mf_json_str(slide, "rope_type");
    if (t && strcmp(t, "default") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: rope_parameters.sliding_attention.rope_type %s is not supported "
                       "(default)",
                       path, t);
    return positive_float(path, slide, "rope_theta", def, out, msg, msg_len);
}

/* Gemma 2 and 3 (Gemma3ForCausalLM, text only): what their configs say
 * beyond a Llama's, with transformers' defaults for what they leave out. */
static int parse_gemma_config(const char *path, const cJSON *j, eng_config *c, char *msg,
                              size_t msg_len)
{
    bool g3 = c->arch == ENG_ARCH_GEMMA3;
    const char *act = mf_json_str(j, "hidden_activation");
    if (!act)
        act = mf_json_str(j, "hidden_act");
    if (act && strcmp(act, "gelu_pytorch_tanh") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: hidden_activation %s is not supported (gelu_pytorch_tanh)", path, act);
    if (mf_json_bool(j, "use_bidirectional_attention", false))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: use_bidirectional_attention is not supported (qlserve is causal)",
                       path);
    c->ffn_act = ENG_FFN_GELU_TANH;
    c->norm_offset = 1.0f;
    c->sandwich_norms = true;
    c->qk_norm = g3;
    c->tie_word_embeddings = mf_json_bool(j, "tie_word_embeddings", true);
    if (!cJSON_GetObjectItemCaseSensitive(j, "head_dim"))
        c->head_dim = 256; /* both configs' default */
    float window = 0.0f, scalar = 0.0f;
    int rc = nullable_positive(path, j, "query_pre_attn_scalar", 256.0, &scalar, msg, msg_len);
    if (rc == QL_OK && scalar == 0.0f)
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"query_pre_attn_scalar\" is null", path);
    if (rc == QL_OK)
        rc = nullable_positive(path, j, "attn_logit_softcapping", g3 ? 0.0 : 50.0, &c->attn_softcap,
                               msg, msg_len);
    if (rc == QL_OK)
        rc = nullable_positive(path, j, "final_logit_softcapping", g3 ? 0.0 : 30.0,
                               &c->final_softcap, msg, msg_len);
    if (rc == QL_OK)
        rc = nullable_positive(path, j, "sliding_window", 4096.0, &window, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    c->attn_scale = (float)(1.0 / sqrt((double)scalar));
    c->sliding_window = (int32_t)window;
    rc = parse_layer_types(path, j, c, msg, msg_len);
    if (rc != QL_OK || !g3)
        return rc;
    /* Gemma 3's two rotary bases: rope_parameters' per layer type
     * (transformers 5), else rope_theta and rope_local_base_freq */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    const cJSON *full =
        cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "full_attention") : NULL;
    const cJSON *slide =
        cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "sliding_attention") : NULL;
    if (cJSON_IsObject(full))
        rc = positive_float(path, full, "rope_theta", 1e6, &c->rope_theta, msg, msg_len);
    else if (!cJSON_GetObjectItemCaseSensitive(j, "rope_theta"))
        c->rope_theta = 1e6f;
    if (rc == QL_OK && cJSON_IsObject(slide))
        rc = sliding_rope_base(path, slide, 1e4, &c->rope_local_theta, msg, msg_len);
    else if (rc == QL_OK)
        rc = positive_float(path, j, "rope_local_base_freq", 1e4, &c->rope_local_theta, msg,
                            msg_len);
    return rc;
}

/* --- Gemma 4 ------------------------------------------------------------------ */

/* The Gemma 4 options qlserve does not run, each refused by name: a key
 * whose value (absent: Gemma4TextConfig's default) is not the one given. */
static const struct gemma4_refusal {
    const char *key, *what;
    double runs, def;
} gemma4_refusals[] = {
    {"attention_bias", "biases on the attention projections", 0, 0},
};

/* What Gemma 4's config asks that qlserve does not run, refused by name. */
static int gemma4_refuse(const char *path, const cJSON *j, char *msg, size_t msg_len)
{
    for (size_t i = 0; i < sizeof gemma4_refusals / sizeof *gemma4_refusals; i++) {
        const struct gemma4_refusal *r = &gemma4_refusals[i];
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, r->key);
        double d = r->def;
        if (cJSON_IsBool(v))
            d = cJSON_IsTrue(v) ? 1 : 0;
        else if (v && !cJSON_IsNull(v) && !mf_json_number(v, &d))
            d = NAN;
        if (!(d == r->runs))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: %s is not supported for Gemma 4 (%s), only %g", path, r->key,
                           r->what, r->runs);
    }
    /* "vision" leaves text causal (only image tokens see each other) */
    const cJSON *bi = cJSON_GetObjectItemCaseSensitive(j, "use_bidirectional_attention");
    if (bi && !cJSON_IsNull(bi) && !(cJSON_IsString(bi) && strcmp(bi->valuestring, "vision") == 0))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: use_bidirectional_attention other than \"vision\" is not supported "
                       "(qlserve is causal)",
                       path);
    const char *act = mf_json_str(j, "hidden_activation");
    if (act && strcmp(act, "gelu_pytorch_tanh") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: hidden_activation %s is not supported (gelu_pytorch_tanh)", path, act);
    return QL_OK;
}

/* Gemma 4's last num_kv_shared_layers layers attend over the cache of the
 * last unshared layer of their type (eng_layer_kv_source), which must
 * exist, as transformers' kv_sharing_modes requires (their double-wide
 * MLP is gemma4.c's eng_layer_ff). */
static int gemma4_kv_sharing(const char *path, const cJSON *j, eng_config *c, char *msg,
                             size_t msg_len)
{
    int rc = model_json_int32(path, j, "num_kv_shared_layers", 0, false, 0, c->n_layers - 1,
                              &c->kv_shared_layers, msg, msg_len);
    if (rc != QL_OK || c->kv_shared_layers == 0)
        return rc;
    for (int32_t l = c->n_layers - c->kv_shared_layers; l < c->n_layers; l++)
        if (eng_layer_kv_source(c, l) == l)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: layer %d shares keys and values, but no unshared layer of its "
                           "type has them",
                           path, l);
    return QL_OK;
}

/* Gemma 4's two rotations: the full layers' (rope_parameters.full_attention,
 * "proportional" over partial_rotary_factor of each head's pairs, base
 * 1e6), the sliding layers' (default, base 1e4); without rope_parameters,
 * the config class's defaults (proportional over a quarter). */
static int gemma4_rope(const char *path, const cJSON *j, eng_config *c, char *msg, size_t msg_len)
{
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    const cJSON *full =
        cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "full_attention") : NULL;
    const cJSON *slide =
        cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "sliding_attention") : NULL;
    double part = 0.25;
    c->rope_dim = 0;
    c->rope_theta = 1e6f;
    c->rope_local_theta = c->sliding_window > 0 ? 1e4f : 0.0f;
    if (!cJSON_IsObject(rp))
        c->rope_scaling = ENG_ROPE_PROPORTIONAL;
    int rc = QL_OK;
    if (cJSON_IsObject(full)) {
        rc = positive_float(path, full, "rope_theta", 1e6, &c->rope_theta, msg, msg_len);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(full, "partial_rotary_factor");
        part = 1.0;
        if (rc == QL_OK && v && !(mf_json_number(v, &part) && part > 0 && part <= 1))
            rc = ql_fail(
                msg, msg_len, QL_EFORMAT,
                "%s: rope_parameters.full_attention.partial_rotary_factor is not in (0, 1]", path);
    }
    if (rc == QL_OK && c->rope_scaling != ENG_ROPE_PROPORTIONAL && part != 1.0)
        rc = ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                     "%s: partial_rotary_factor on the full layers is supported only with the "
                     "proportional rope_type",
                     path);
    /* transformers' int(factor * head_dim // 2), the full layers' head_dim */
    c->rope_prop_pairs = (int32_t)floor(part * (double)eng_rope_head_dim(c) / 2.0);
    if (rc == QL_OK && cJSON_IsObject(slide) && c->rope_local_theta > 0.0f)
        rc = sliding_rope_base(path, slide, 1e4, &c->rope_local_theta, msg, msg_len);
    return rc;
}

/* Gemma 4's text model (Gemma4ForCausalLM) beyond a Llama: Gemma 3's
 * sandwich and GeGLU with plain RMSNorm weights (x * w, norm_offset 0), a
 * weightless norm on each head of v, unscaled scores (scaling 1), a
 * layer_scalar per layer, the proportional rotary on the full layers, the
 * final soft cap; the config class's defaults for what it leaves out.
 * Every option gemma4_refuse names is refused. */
static int parse_gemma4_config(const char *path, const cJSON *j, eng_config *c, char *msg,
                               size_t msg_len)
{
    if (!cJSON_GetObjectItemCaseSensitive(j, "head_dim"))
        c->head_dim = 256;
    int rc = gemma4_refuse(path, j, msg, msg_len);
    if (rc == QL_OK)
        rc = model_gemma4_options(path, j, c, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    c->ffn_act = ENG_FFN_GELU_TANH;
    c->norm_offset = 0.0f;
    c->sandwich_norms = c->qk_norm = c->v_norm = c->layer_scalar = true;
    c->attn_scale = 1.0f;
    c->tie_word_embeddings = mf_json_bool(j, "tie_word_embeddings", true);
    float window = 0.0f;
    rc =
        nullable_positive(path, j, "final_logit_softcapping", 0.0, &c->final_softcap, msg, msg_len);
    if (rc == QL_OK)
        rc = nullable_positive(path, j, "sliding_window", 512.0, &window, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    c->sliding_window = (int32_t)window;
    rc = parse_layer_types(path, j, c, msg, msg_len);
    if (rc == QL_OK && eng_layer_slides(c, c->n_layers - 1))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: the last layer slides; transformers makes it full, which breaks the "
                       "repeating pattern qlserve runs",
                       path);
    if (rc == QL_OK)
        rc = model_gemma4_head_shapes(path, j, c, msg, msg_len);
    if (rc == QL_OK)
        rc = gemma4_kv_sharing(path, j, c, msg, msg_len);
    return rc == QL_OK ? gemma4_rope(path, j, c, msg, msg_len) : rc;
}

/* GPT-OSS beyond a Llama: biases on q, k, v and o (attention_bias), the
 * attention sinks, the clamped SwiGLU (swiglu_alpha, swiglu_limit; the
 * config class's 1.702 and 7.0 when absent), the sliding layers
 * (layer_types; without it every other layer from layer 0, over a window
 * of 128 when sliding_window is absent, as GptOssConfig makes them), and
 * the mixture (model_moe_config_hf). */
static int parse_gpt_oss_config(const char *path, const cJSON *j, eng_config *c, char *msg,
                                size_t msg_len)
{
    c->attention_bias = mf_json_bool(j, "attention_bias", true);
    c->o_bias = c->attention_bias;
    c->attn_sinks = true;
    c->ffn_act = ENG_FFN_SWIGLU_OAI;
    if (!cJSON_GetObjectItemCaseSensitive(j, "sliding_window"))
        c->sliding_window = 128; /* GptOssConfig's default */
    int rc = positive_float(path, j, "swiglu_alpha", 1.702, &c->swiglu_alpha, msg, msg_len);
    if (rc == QL_OK)
        rc = positive_float(path, j, "swiglu_limit", 7.0, &c->swiglu_limit, msg, msg_len);
    if (rc == QL_OK && c->sliding_window > 0)
        rc = parse_layer_types(path, j, c, msg, msg_len);
    if (rc == QL_OK)
        rc = model_moe_config_hf(path, j, c, msg, msg_len);
    return rc;
}

/* What SmolLM3, OLMo 3 and Ministral 3 share beyond a Llama's refusals:
 * the MLP is SwiGLU (hidden_act silu) and no projection has a bias
 * (attention_bias would put one on o_proj too, which c->attention_bias
 * does not load); family names the model in the message. */
static int require_plain_llama_parts(const char *path, const cJSON *j, const eng_config *c,
                                     const char *family, char *msg, size_t msg_len)
{
    const char *act = mf_json_str(j, "hidden_act");
    if (act && strcmp(act, "silu") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: hidden_act %s is not supported for %s (silu)", path, act, family);
    if (c->attention_bias)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: attention_bias is not supported for %s",
                       path, family);
    return QL_OK;
}

/* SmolLM3 beyond a Llama: which layers skip RoPE, from no_rope_layers
 * (one 0 or 1 per layer, 1 when the layer rotates, as SmolLM3Attention's
 * use_rope reads it) or, without it, every no_rope_layer_interval-th
 * (4 when absent: layer l rotates when (l + 1) % interval != 0, as
 * SmolLM3Config fills the list). Its sliding layers and an MLP with
 * biases are refused by name; ties lm_head to the embeddings unless the
 * config says not (the config class's default). */
static int parse_smollm3_config(const char *path, const cJSON *j, eng_config *c, char *msg,
                                size_t msg_len)
{
    c->tie_word_embeddings = mf_json_bool(j, "tie_word_embeddings", true);
    int rc = require_plain_llama_parts(path, j, c, "SmolLM3", msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (mf_json_bool(j, "mlp_bias", false))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: mlp_bias is not supported", path);
    const cJSON *types = cJSON_GetObjectItemCaseSensitive(j, "layer_types");
    for (int32_t l = 0; cJSON_IsArray(types) && l < cJSON_GetArraySize(types); l++) {
        const char *t = cJSON_GetArrayItem(types, l)->valuestring;
        if (t && strcmp(t, "full_attention") != 0)
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: layer_types[%d] is %s; qlserve runs SmolLM3 with full attention "
                           "layers only",
                           path, l, t);
    }
    if (mf_json_bool(j, "use_sliding_window", false))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: use_sliding_window is not supported for SmolLM3", path);
    c->sliding_window = 0;
    if (c->n_layers > ENG_MAX_NOPE_LAYERS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: SmolLM3 with more than %d layers", path,
                       ENG_MAX_NOPE_LAYERS);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "no_rope_layers");
    if (list && !cJSON_IsNull(list)) {
        if (!cJSON_IsArray(list) || cJSON_GetArraySize(list) != c->n_layers)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: \"no_rope_layers\" is not a list of num_hidden_layers = %d "
                           "entries",
                           path, c->n_layers);
        for (int32_t l = 0; l < c->n_layers; l++) {
            double v;
            if (!mf_json_number(cJSON_GetArrayItem(list, l), &v) || (v != 0 && v != 1))
                return ql_fail(msg, msg_len, QL_EFORMAT, "%s: no_rope_layers[%d] is not 0 or 1",
                               path, l);
            if (v == 0)
                c->nope_layers[l / 64] |= (uint64_t)1 << (l % 64);
        }
        return QL_OK;
    }
    int32_t interval = 4;
    rc = model_json_int32(path, j, "no_rope_layer_interval", 4, false, 1, 1 << 20, &interval, msg,
                          msg_len);
    for (int32_t l = 0; rc == QL_OK && l < c->n_layers; l++)
        if ((l + 1) % interval == 0)
            c->nope_layers[l / 64] |= (uint64_t)1 << (l % 64);
    return rc;
}

/* OLMo 3 beyond a Llama: norms after attention and the MLP only, q/k
 * norms over the whole projection, sliding and full layers (layer_types;
 * without it Olmo3Config's every fourth layer full, over a window of 4096
 * when sliding_window is absent), and a rotary set per layer type
 * (rope_parameters' full_attention and sliding_attention, each with its
 * base, 500000 when absent as the config class has it; in transformers 4's
 * form rope_scaling is the full layers' and rope_theta both's): the full
 * layers' scaling is the model's (parse_rope_scaling), the sliding ones
 * rotate with their own base and no scaling (rope_local_theta). Biases and
 * another activation are refused by name. */
static int parse_olmo3_config(const char *path, const cJSON *j, eng_config *c, char *msg,
                              size_t msg_len)
{
    int rc = require_plain_llama_parts(path, j, c, "OLMo 3", msg, msg_len);
    if (rc != QL_OK)
        return rc;
    c->qk_norm = true;
    c->qk_norm_whole = true;
    c->post_norms = true;
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(j, "sliding_window");
    if (!sw)
        c->sliding_window = 4096; /* Olmo3Config's default */
    if (c->sliding_window > 0 && cJSON_GetObjectItemCaseSensitive(j, "layer_types"))
        rc = parse_layer_types(path, j, c, msg, msg_len);
    else
        c->sliding_pattern = 4; /* layer l full when (l + 1) % 4 == 0 */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    const cJSON *full =
        cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "full_attention") : NULL;
    const cJSON *slide =
        cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "sliding_attention") : NULL;
    if (rc == QL_OK && cJSON_IsObject(full))
        rc = positive_float(path, full, "rope_theta", 5e5, &c->rope_theta, msg, msg_len);
    else if (rc == QL_OK && !cJSON_GetObjectItemCaseSensitive(j, "rope_theta"))
        c->rope_theta = 5e5f;
    c->rope_local_theta = c->rope_theta;
    if (rc == QL_OK && cJSON_IsObject(slide))
        rc = sliding_rope_base(path, slide, 5e5, &c->rope_local_theta, msg, msg_len);
    return rc;
}

/* transformers' finegrained FP8 (FineGrainedFP8Config): F8_E4M3 weights
 * with a weight_scale_inv per weight_block_size block, read as stored
 * (st_fp8_qtensor); the modules it left dense (modules_to_not_convert)
 * have no scale and load as any dense tensor. What qlserve does not
 * compute is refused by name: static activation scales, a per-tensor
 * scale (no weight_block_size), FP4 experts, a scale_fmt other than
 * float and ue8m0. */
static int parse_fp8_config(model_loader *L, const char *path, const cJSON *qc, char *msg,
                            size_t msg_len)
{
    const char *act = mf_json_str(qc, "activation_scheme");
    if (act && strcmp(act, "dynamic") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config activation_scheme %s is not supported (fp8 "
                       "checkpoints with dynamic activation scales are)",
                       path, act);
    const char *fmt = mf_json_str(qc, "scale_fmt");
    if (fmt && strcmp(fmt, "float") != 0 && strcmp(fmt, "ue8m0") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config scale_fmt %s is not float or ue8m0", path, fmt);
    const char *experts = mf_json_str(qc, "expert_dtype");
    if (experts && strcmp(experts, "fp8") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config expert_dtype %s is not supported (fp8 is)", path,
                       experts);
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(qc, "weight_block_size");
    int64_t b[2];
    if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2 ||
        !mf_json_integer(cJSON_GetArrayItem(bs, 0), 1, 1 << 20, &b[0]) ||
        !mf_json_integer(cJSON_GetArrayItem(bs, 1), 1, 1 << 20, &b[1]))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config weight_block_size must be two positive "
                       "integers (per-tensor fp8 scales are not supported)",
                       path);
    L->fp8_checkpoint = true;
    L->fp8_block[0] = (int32_t)b[0];
    L->fp8_block[1] = (int32_t)b[1];
    return QL_OK;
}

/* GPTQ (GPTQConfig; optimum, auto-gptq and gptqmodel write it): each
 * quantized linear as `<prefix>.qweight`, `.qzeros`, `.scales` (f16) and
 * `.g_idx`, read as stored (qt_from_gptq); act-order (desc_act) is what
 * g_idx says, so either value loads. Refused by name: bits other than 4
 * and 8, a checkpoint_format other than gptq and gptq_v2 (marlin, ...),
 * and auto-gptq's is_marlin_format. Modules left dense (lm_head) load as
 * any dense tensor. */
static int parse_gptq_config(model_loader *L, const char *path, const cJSON *qc, char *msg,
                             size_t msg_len)
{
    int64_t bits = 0, group = 0;
    if (!mf_json_integer(cJSON_GetObjectItemCaseSensitive(qc, "bits"), 1, 64, &bits) ||
        (bits != 4 && bits != 8))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config bits must be 4 or 8 for gptq (2 and 3 are not "
                       "supported)",
                       path);
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(qc, "group_size");
    if (!gs || !mf_json_integer(gs, -1, 1 << 20, &group) || group == 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: quantization_config group_size must be -1 or a positive integer", path);
    const char *fmt = mf_json_str(qc, "checkpoint_format");
    if (!fmt)
        fmt = mf_json_str(qc, "format");
    if (fmt && strcmp(fmt, "gptq") != 0 && strcmp(fmt, "gptq_v2") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config checkpoint_format %s is not supported (gptq and "
                       "gptq_v2 are)",
                       path, fmt);
    if (mf_json_bool(qc, "is_marlin_format", false))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config is_marlin_format (a marlin repacking) is not "
                       "supported",
                       path);
    L->gptq_checkpoint = true;
    L->gptq_bits = (int32_t)bits;
    L->gptq_group = (int32_t)group;
    L->gptq_v2 = fmt && strcmp(fmt, "gptq_v2") == 0;
    return QL_OK;
}

/* AWQ (AwqConfig, AutoAWQ's GEMM layout): `<prefix>.qweight`, `.qzeros`
 * (int32 packed along the output dim) and `.scales` (f16), read as the
 * GPTQ parts are, in AWQ's packing (QT_AWQ). Refused by name: bits other
 * than 4, a version other than gemm (gemv, gemv_fast, exllama, marlin,
 * ipex), zero_point false. */
static int parse_awq_config(model_loader *L, const char *path, const cJSON *qc, char *msg,
                            size_t msg_len)
{
    int64_t bits = 0, group = 0;
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(qc, "bits");
    if (!b)
        b = cJSON_GetObjectItemCaseSensitive(qc, "w_bit");
    if (!mf_json_integer(b, 1, 64, &bits) || bits != 4)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config bits must be 4 for awq", path);
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(qc, "group_size");
    if (!gs)
        gs = cJSON_GetObjectItemCaseSensitive(qc, "q_group_size");
    if (!mf_json_integer(gs, 1, 1 << 20, &group))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: quantization_config group_size must be a positive integer for awq",
                       path);
    const char *version = mf_json_str(qc, "version");
    if (version && strcasecmp(version, "gemm") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config version %s is not supported for awq (gemm is)",
                       path, version);
    if (!mf_json_bool(qc, "zero_point", true))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config zero_point false is not supported for awq", path);
    L->gptq_checkpoint = true;
    L->awq = true;
    L->gptq_bits = 4;
    L->gptq_group = (int32_t)group;
    return QL_OK;
}

/* config.json's quantization_config (absent: a float checkpoint), by its
 * quant_method; one qlserve does not read is refused by name. */
static int parse_quantization_config(model_loader *L, const char *path, const cJSON *j, char *msg,
                                     size_t msg_len)
{
    const eng_config *c = &L->m->cfg;
    int rc;
    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(j, "quantization_config");
    const char *qm = qc ? mf_json_str(qc, "quant_method") : NULL;
    if (qm && strcmp(qm, "mxfp4") == 0 && c->arch == ENG_ARCH_GPT_OSS) {
        /* GPT-OSS's Hub checkpoints: experts as MXFP4 _blocks / _scales
         * (experts.c), everything else dense */
        L->mxfp4_experts = true;
        qc = NULL;
    }
    if (qm && (strcmp(qm, "fp8") == 0 || strcmp(qm, "gptq") == 0 || strcmp(qm, "awq") == 0)) {
        rc = strcmp(qm, "fp8") == 0    ? parse_fp8_config(L, path, qc, msg, msg_len)
             : strcmp(qm, "gptq") == 0 ? parse_gptq_config(L, path, qc, msg, msg_len)
                                       : parse_awq_config(L, path, qc, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        qc = NULL;
    }
    if (qm && (strcmp(qm, "compressed-tensors") == 0 || strcmp(qm, "fbgemm_fp8") == 0)) {
        if ((rc = model_ct_config(L, path, qc, msg, msg_len)) != QL_OK) /* load_ct.c */
            return rc;
        qc = NULL;
    }
    if (qc) {
        const char *method = mf_json_str(qc, "quant_method");
        if (!method || strcmp(method, "bitsandbytes") != 0 ||
            !mf_json_bool(qc, "load_in_4bit", false))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: quantization_config %s is not supported (bitsandbytes 4-bit, "
                           "finegrained fp8, gptq, awq, compressed-tensors, fbgemm_fp8, and "
                           "GPT-OSS's mxfp4, are)",
                           path, method ? method : "(no quant_method)");
        const char *type = mf_json_str(qc, "bnb_4bit_quant_type");
        if (!type)
            type = "fp4";
        if (strcmp(type, "nf4") != 0 && strcmp(type, "fp4") != 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: bnb_4bit_quant_type %s is not nf4 or fp4",
                           path, type);
        L->bnb_checkpoint = true;
        snprintf(L->bnb_type, sizeof L->bnb_type, "%s", type);
    }
    return QL_OK;
}

/* Ministral 3 beyond a Mistral: Llama 4's query scaling, whose beta
 * (llama_4_scaling_beta) and period (original_max_position_embeddings)
 * sit in the rotary parameters beside YaRN's (parse_rope_scaling reads
 * those), as Ministral3Attention reads them; both are required there, as
 * transformers cannot run the model without them. head_dim is 128 when
 * absent (the config class's default). */
static int parse_ministral3_config(const char *path, const cJSON *j, eng_config *c, char *msg,
                                   size_t msg_len)
{
    int rc = require_plain_llama_parts(path, j, c, "Ministral 3", msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (!cJSON_GetObjectItemCaseSensitive(j, "head_dim"))
        c->head_dim = 128;
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    if (!cJSON_IsObject(rs))
        rs = cJSON_GetObjectItemCaseSensitive(j, "rope_scaling");
    if (!cJSON_IsObject(rs) || !cJSON_GetObjectItemCaseSensitive(rs, "llama_4_scaling_beta"))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: rope_parameters.llama_4_scaling_beta is missing; Ministral 3 scales "
                       "its queries by it",
                       path);
    double beta;
    rc = yarn_number(path, rs, "llama_4_scaling_beta", 0, &beta, msg, msg_len);
    if (rc == QL_OK && beta < 0)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: rope_parameters.llama_4_scaling_beta must not be negative", path);
    if (rc == QL_OK)
        rc = model_json_int32(path, rs, "original_max_position_embeddings", 0, true, 1, 1 << 30,
                              &c->attn_temp_floor, msg, msg_len);
    c->attn_temp_beta = (float)beta;
    return rc;
}

static int parse_hf_config(model_loader *L, const char *path, const cJSON *j, char *msg,
                           size_t msg_len)
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
    else if (strcmp(arch, "Qwen3ForCausalLM") == 0)
        c->arch = ENG_ARCH_QWEN3;
    else if (strcmp(arch, "Phi3ForCausalLM") == 0)
        c->arch = ENG_ARCH_PHI3;
    else if (strcmp(arch, "Gemma2ForCausalLM") == 0)
        c->arch = ENG_ARCH_GEMMA2;
    else if (strcmp(arch, "Gemma3ForCausalLM") == 0)
        c->arch = ENG_ARCH_GEMMA3;
    else if (strcmp(arch, "Qwen2MoeForCausalLM") == 0)
        c->arch = ENG_ARCH_QWEN2_MOE;
    else if (strcmp(arch, "Qwen3MoeForCausalLM") == 0)
        c->arch = ENG_ARCH_QWEN3_MOE;
    else if (strcmp(arch, "MixtralForCausalLM") == 0)
        c->arch = ENG_ARCH_MIXTRAL;
    else if (strcmp(arch, "GptOssForCausalLM") == 0)
        c->arch = ENG_ARCH_GPT_OSS;
    else if (strcmp(arch, "SmolLM3ForCausalLM") == 0)
        c->arch = ENG_ARCH_SMOLLM3;
    else if (strcmp(arch, "Olmo3ForCausalLM") == 0)
        c->arch = ENG_ARCH_OLMO3;
    else if (strcmp(arch, "Ministral3ForCausalLM") == 0)
        c->arch = ENG_ARCH_MINISTRAL3;
    else if (strcmp(arch, "Gemma4ForCausalLM") == 0)
        c->arch = ENG_ARCH_GEMMA4;
    else if (strcmp(arch, "Qwen3_5ForCausalLM") == 0)
        c->arch = ENG_ARCH_QWEN3_5;
    else
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: architecture %s is not one qlserve runs (LlamaForCausalLM, "
                       "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
                       "Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen2MoeForCausalLM, "
                       "Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM, "
                       "SmolLM3ForCausalLM, Olmo3ForCausalLM, Ministral3ForCausalLM, "
                       "Gemma4ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration)",
                       path, arch);
    int rc = QL_OK;
#define INT_FIELD(key, def, req, lo, hi, dst)                                                      \
    if (rc == QL_OK)                                                                               \
    rc = model_json_int32(path, j, key, def, req, lo, hi, dst, msg, msg_len)
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
        rc = positive_float(path, rope_params, "rope_theta", 10000.0, &c->rope_theta, msg, msg_len);
    else if (rc == QL_OK)
        rc = positive_float(path, j, "rope_theta", 10000.0, &c->rope_theta, msg, msg_len);
    if (rc == QL_OK)
        rc = positive_float(path, j, "rms_norm_eps", 1e-6, &c->rms_norm_eps, msg, msg_len);
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
    c->tie_word_embeddings = mf_json_bool(j, "tie_word_embeddings", false);
    c->attention_bias = c->arch == ENG_ARCH_QWEN2 || c->arch == ENG_ARCH_QWEN2_MOE
                            ? mf_json_bool(j, "qkv_bias", true)
                            : mf_json_bool(j, "attention_bias", false);
    c->qk_norm = c->arch == ENG_ARCH_QWEN3 || c->arch == ENG_ARCH_QWEN3_MOE;
    c->rope_interleaved = false;
    c->bos_token_id = mf_json_token_id(j, "bos_token_id");
    c->eos_token_id = mf_json_token_id(j, "eos_token_id");
    if ((c->arch == ENG_ARCH_GEMMA2 || c->arch == ENG_ARCH_GEMMA3) &&
        (rc = parse_gemma_config(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    if (c->arch == ENG_ARCH_QWEN2_MOE || c->arch == ENG_ARCH_QWEN3_MOE ||
        c->arch == ENG_ARCH_MIXTRAL) {
        rc = model_moe_config_hf(path, j, c, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    if (c->arch == ENG_ARCH_GPT_OSS &&
        (rc = parse_gpt_oss_config(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    if (c->arch == ENG_ARCH_SMOLLM3 &&
        (rc = parse_smollm3_config(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    if (c->arch == ENG_ARCH_OLMO3 && (rc = parse_olmo3_config(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    if (c->arch == ENG_ARCH_MINISTRAL3 &&
        (rc = parse_ministral3_config(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    if (c->arch == ENG_ARCH_GEMMA4 && (rc = parse_gemma4_config(path, j, c, msg, msg_len)) != QL_OK)
        return rc;
    return parse_quantization_config(L, path, j, msg, msg_len);
}

/* --- tensors: finding, checking, converting --------------------------------- */

/* The shard holding a bitsandbytes quant state for `name`, or NULL. */
static const st_file *bnb_shard(const model_loader *L, const char *name)
{
    for (size_t i = 0; i < L->m->n_shards; i++)
        if (bnb_is_quantized(&L->m->shards[i], name))
            return &L->m->shards[i];
    return NULL;
}

/* The `<name>_scale_inv` of a finegrained FP8 checkpoint's tensor, or NULL
 * (a module the checkpoint left dense: modules_to_not_convert). */
static const st_tensor *fp8_scale_of(const model_loader *L, const char *name, const st_file **sf)
{
    char scale_name[512];
    if (!L->fp8_checkpoint ||
        (size_t)snprintf(scale_name, sizeof scale_name, "%s_scale_inv", name) >= sizeof scale_name)
        return NULL;
    return model_find_st(L, scale_name, sf);
}

/* An FP8 weight (F8_E4M3 [rows, cols]) with its block scales (F32 or
 * F8_E8M0, the grid of weight_block_size): the codes read in place from
 * the mapping, the scales copied in their stored dtype, never converted;
 * whatever --quant and --dtype say (they apply to what the checkpoint left
 * dense). Fused experts (transformers' FP8Experts: gate_up_proj [experts,
 * 2 * ff, hidden] with gate_up_proj_scale_inv [experts, 2 * ff / block
 * rows, hidden / block cols]) are read as the rows of their first two dims
 * when each expert is whole blocks of rows, so the stacked grid is the 2-D
 * one. Another dtype, rank or grid is refused naming both tensors. */
static int load_fp8_tensor(const model_loader *L, const st_file *f, const st_tensor *t,
                           const st_file *sf, const st_tensor *s, bool stacked, int64_t want_rows,
                           int64_t want_cols, qtensor *out, char *msg, size_t msg_len)
{
    int ndim = stacked && t->ndim == 3 ? 3 : 2;
    if (t->dtype != ST_F8_E4M3 || t->ndim != ndim)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: fp8 weight '%s' is %s with %d dimensions; expected a F8_E4M3 matrix",
                       f->path, t->name, st_dtype_name(t->dtype), t->ndim);
    if ((s->dtype != ST_F32 && s->dtype != ST_F8_E8M0) || s->ndim != ndim ||
        (ndim == 3 && (s->shape[0] != t->shape[0] || t->shape[1] % L->fp8_block[0] != 0)))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: fp8 scale '%s' is %s with %d dimensions; expected a F32 or F8_E8M0 "
                       "%s (weight_scale_inv per block%s)",
                       sf->path, s->name, st_dtype_name(s->dtype), s->ndim,
                       ndim == 3 ? "[experts, rows / block, cols / block]" : "matrix",
                       ndim == 3 ? ", each expert whole blocks of rows" : "");
    int64_t rows = ndim == 3 ? t->shape[0] * t->shape[1] : t->shape[0], cols = t->shape[ndim - 1];
    if (rows != want_rows || cols != want_cols)
        return model_shape_mismatch(f->path, t->name, rows, cols, want_rows, want_cols, msg,
                                    msg_len);
    qt_fp8_parts p = {
        .rows = rows,
        .cols = cols,
        .block_rows = L->fp8_block[0],
        .block_cols = L->fp8_block[1],
        .codes = t->data,
        .borrow_codes = true, /* the shards stay mapped as long as the model */
        .scale_dtype = s->dtype == ST_F8_E8M0 ? QT_SCALE_E8M0 : QT_SCALE_F32,
        .scales = s->data,
        .scale_rows = ndim == 3 ? s->shape[0] * s->shape[1] : s->shape[0],
        .scale_cols = s->shape[ndim - 1],
    };
    char why[256];
    int rc = qt_from_fp8(out, &p, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "%s: '%s' with '%s': %s", f->path, t->name, s->name, why);
    return QL_OK;
}

/* A GPTQ checkpoint's parts `<prefix>.<part>` of weight `<prefix>.weight`;
 * NULL where it has no qweight (a module left dense). */
static const st_tensor *gptq_part(const model_loader *L, const char *name, const char *part,
                                  const st_file **f)
{
    size_t n = strlen(name);
    char buf[512];
    if (!L->gptq_checkpoint || n < 7 || strcmp(name + n - 7, ".weight") != 0 ||
        (size_t)snprintf(buf, sizeof buf, "%.*s.%s", (int)(n - 7), name, part) >= sizeof buf)
        return NULL;
    return model_find_st(L, buf, f);
}

/* A GPTQ linear (out `want_rows`, in `want_cols`): qweight I32 [in * bits
 * / 32, out] read in place, qzeros I32, scales F16 and g_idx I32 copied as
 * stored. A missing part, another dtype or shape is refused by name. */
static int load_gptq_tensor(const model_loader *L, const char *name, const st_file *f,
                            const st_tensor *qw, int64_t want_rows, int64_t want_cols, qtensor *out,
                            char *msg, size_t msg_len)
{
    static const char *parts[3] = {"qzeros", "scales", "g_idx"};
    static const st_dtype want[3] = {ST_I32, ST_F16, ST_I32};
    const st_tensor *t[3];
    const st_file *pf;
    for (int i = 0; i < 3; i++) {
        t[i] = gptq_part(L, name, parts[i], &pf);
        if (!t[i] && i < 2)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: gptq weight '%s' has no %s", f->path,
                           qw->name, parts[i]);
        if (t[i] && (t[i]->dtype != want[i] || t[i]->ndim != (i == 2 ? 1 : 2)))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: gptq '%s' is %s with %d dimensions; expected %s %s", f->path,
                           t[i]->name, st_dtype_name(t[i]->dtype), t[i]->ndim,
                           st_dtype_name(want[i]), i == 2 ? "vector" : "matrix");
    }
    int64_t per = 32 / L->gptq_bits;
    /* GPTQ packs qweight along the input dim, AWQ along the output dim */
    int64_t qw_rows = L->awq ? want_cols : want_cols / per;
    int64_t qw_cols = L->awq ? want_rows / per : want_rows;
    if (qw->dtype != ST_I32 || qw->ndim != 2 || qw->shape[0] != qw_rows ||
        qw->shape[1] != qw_cols || want_cols % per != 0 || t[0]->shape[1] * per != want_rows ||
        t[1]->shape[1] != want_rows || t[0]->shape[0] != t[1]->shape[0] ||
        (t[2] && (L->awq || t[2]->shape[0] != want_cols)))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s '%s' (%s [%lld, %lld]) with its qzeros, scales and g_idx does "
                       "not hold a %d-bit [%lld, %lld] weight",
                       f->path, L->awq ? "awq" : "gptq", qw->name, st_dtype_name(qw->dtype),
                       (long long)qw->shape[0], (long long)(qw->ndim > 1 ? qw->shape[1] : 0),
                       L->gptq_bits, (long long)want_rows, (long long)want_cols);
    qt_gptq_parts p = {
        .rows = want_rows,
        .cols = want_cols,
        .bits = L->gptq_bits,
        .group_size = L->gptq_group,
        .v2 = L->gptq_v2,
        .awq = L->awq,
        .qweight = qw->data,
        .borrow_codes = true, /* the shards stay mapped as long as the model */
        .qzeros = t[0]->data,
        .scales = t[1]->data,
        .g_idx = t[2] ? t[2]->data : NULL,
        .groups = t[1]->shape[0],
    };
    char why[256];
    int rc = qt_from_gptq(out, &p, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "%s: '%s': %s", f->path, qw->name, why);
    return QL_OK;
}

/* Load HF tensor `name` of shape [rows, cols] (cols == 0: 1-D of rows). */
static int load_hf_tensor(model_loader *L, const char *name, int64_t rows, int64_t cols,
                          tensor_role role, qtensor *out, char *msg, size_t msg_len)
{
    const st_file *f = NULL;
    bool one_d = cols == 0;
    char text_name[512];
    if (L->text_model && strncmp(name, "model.", 6) == 0) {
        snprintf(text_name, sizeof text_name, "model.language_model.%s", name + 6);
        name = text_name;
    }
    int64_t want_rows = one_d ? 1 : rows, want_cols = one_d ? rows : cols;
    int rc;
    const st_file *bnb = role != ROLE_DENSE ? bnb_shard(L, name) : NULL;
    if (bnb) {
        /* a bitsandbytes-quantized linear, read as it is: whatever --quant
         * says, it is never quantized again (--quant still applies to the
         * modules the checkpoint left dense, llm_int8_skip_modules) */
        rc = bnb_read(bnb, name, out, NULL, msg, msg_len);
        if (rc == QL_OK && (out->rows != want_rows || out->cols != want_cols)) {
            rc = model_shape_mismatch(bnb->path, name, out->rows, out->cols, want_rows, want_cols,
                                      msg, msg_len);
            qt_free(out);
        }
        return rc;
    }
    const st_tensor *t = role != ROLE_DENSE ? gptq_part(L, name, "qweight", &f) : NULL;
    if (t)
        return load_gptq_tensor(L, name, f, t, want_rows, want_cols, out, msg, msg_len);
    bool handled = false;
    if (L->ct && role != ROLE_DENSE && !one_d) { /* compressed-tensors, fbgemm_fp8 */
        rc = model_ct_tensor(L, name, want_rows, want_cols, role != ROLE_EMBED, out, &handled, msg,
                             msg_len);
        if (rc != QL_OK || handled)
            return rc;
    }
    t = model_find_st(L, name, &f);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor '%s' is missing", L->dir, name);
    const st_file *sf = NULL;
    const st_tensor *scale = role != ROLE_DENSE ? fp8_scale_of(L, name, &sf) : NULL;
    if (scale)
        return load_fp8_tensor(L, f, t, sf, scale, role == ROLE_FUSED, want_rows, want_cols, out,
                               msg, msg_len);
    /* a 3-D stack (experts) is read as the rows of its first two dims */
    bool stacked = role == ROLE_FUSED && t->ndim == 3;
    if (t->ndim != (one_d ? 1 : 2) && !stacked)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' has %d dimensions; the config needs a %s of %" PRId64
                       " x %" PRId64,
                       f->path, name, t->ndim, one_d ? "vector" : "matrix", want_rows, want_cols);
    int64_t r = one_d ? 1 : t->shape[0], c = one_d ? t->shape[0] : t->shape[1];
    if (stacked) {
        r = t->shape[0] * t->shape[1];
        c = t->shape[2];
    }
    if (r != want_rows || c != want_cols)
        return model_shape_mismatch(f->path, name, r, c, want_rows, want_cols, msg, msg_len);
    rc = st_tensor_qtensor(f, t, out, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    return model_finish_weight(L, name, role, out, msg, msg_len);
}

/* --- Hugging Face folders ------------------------------------------------------ */

/* The open shard whose file name is `file`, or NULL. */
static const st_file *shard_named(const model_loader *L, const char *file)
{
    for (size_t i = 0; i < L->m->n_shards; i++) {
        const char *p = strrchr(L->m->shards[i].path, '/');
        if (strcmp(p ? p + 1 : L->m->shards[i].path, file) == 0)
            return &L->m->shards[i];
    }
    return NULL;
}

static int open_shard(model_loader *L, const char *file, char *msg, size_t msg_len)
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

static int open_hf_weights(model_loader *L, char *msg, size_t msg_len)
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

static int load_hf_folder(model_loader *L, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    eng_config *c = &m->cfg;
    char path[8192];
    snprintf(path, sizeof path, "%s/config.json", L->dir);
    cJSON *j;
    int rc = mf_read_json(path, JSON_MAX_BYTES, &j, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    /* a multimodal folder's text model's config as its own (gemma4.c,
     * qwen35.c): Gemma4ForConditionalGeneration's, Qwen3.5's */
    cJSON *text = NULL;
    rc = model_gemma4_text_config(path, j, &text, msg, msg_len);
    if (rc == QL_OK && text)
        L->text_model = c->g4.language_model = true;
    else if (rc == QL_OK)
        rc = model_qwen35_text_config(path, j, &text, &L->text_model, msg, msg_len);
    if (rc == QL_OK)
        rc = parse_hf_config(L, path, text ? text : j, msg, msg_len);
    /* Qwen3.5's own fields (qwen35.c), once the shared ones are read */
    if (rc == QL_OK && c->arch == ENG_ARCH_QWEN3_5)
        rc = model_qwen35_config_hf(path, text ? text : j, c, msg, msg_len);
    cJSON_Delete(text);
    const char *own = mf_json_str(j, "_name_or_path");
    model_set_name(m, own, own ? strlen(own) : 0, L->dir);
    cJSON_Delete(j);
    if (rc != QL_OK)
        return rc;
    snprintf(m->format, sizeof m->format, "%s",
             L->bnb_checkpoint    ? "bitsandbytes-4bit"
             : L->fp8_checkpoint  ? "fp8"
             : L->ct              ? model_ct_format(L)
             : L->awq             ? "awq"
             : L->gptq_checkpoint ? "gptq"
                                  : "safetensors");
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    rc = open_hf_weights(L, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    int64_t h = c->hidden_size;
    rc = load_hf_tensor(L, "model.embed_tokens.weight", c->vocab_size, h, ROLE_EMBED, &m->embed,
                        msg, msg_len);
    if (rc == QL_OK &&
        (c->arch == ENG_ARCH_GEMMA2 || c->arch == ENG_ARCH_GEMMA3 || c->arch == ENG_ARCH_GEMMA4))
        c->embed_scale = model_gemma_embed_scale(c->hidden_size, m->embed.kind);
    if (rc == QL_OK && c->g4.ple_dim > 0)
        rc = model_gemma4_load(L, load_hf_tensor, msg, msg_len);
    if (rc == QL_OK)
        rc = load_hf_tensor(L, "model.norm.weight", h, 0, ROLE_DENSE, &m->norm, msg, msg_len);
    const st_file *f;
    if (rc == QL_OK && !c->tie_word_embeddings) {
        rc = load_hf_tensor(L, "lm_head.weight", c->vocab_size, h, ROLE_LM_HEAD, &m->lm_head, msg,
                            msg_len);
    } else if (rc == QL_OK &&
               (model_find_st(L, "lm_head.weight", &f) || bnb_shard(L, "lm_head.weight"))) {
        /* tied in the config but stored anyway (some exports do): use it */
        rc = load_hf_tensor(L, "lm_head.weight", c->vocab_size, h, ROLE_LM_HEAD, &m->lm_head, msg,
                            msg_len);
    }
    if (rc == QL_OK)
        rc = model_layers_load(L, load_hf_tensor, false, msg, msg_len);
    if (rc == QL_OK)
        rc = model_mtp_load_hf(L, load_hf_tensor, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    return model_folder_tokenizer(L->dir, &m->tok, msg, msg_len);
}

int model_load_hf(model_loader *L, char *msg, size_t msg_len)
{
    int rc = load_hf_folder(L, msg, msg_len);
    model_ct_free(L); /* the quantization_config is read by now */
    return rc;
}

int model_folder_tokenizer(const char *dir, tok_tokenizer **out, char *msg, size_t msg_len)
{
    char tok_path[8192], tok_cfg[8192];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", dir);
    snprintf(tok_cfg, sizeof tok_cfg, "%s/tokenizer_config.json", dir);
    if (!file_exists(tok_path))
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tokenizer.json is missing", dir);
    return tok_from_hf(out, tok_path, file_exists(tok_cfg) ? tok_cfg : NULL, msg, msg_len);
}

/*
 * peft.c - load a PEFT LoRA adapter folder (adapter_config.json and
 * adapter_model.safetensors) for a loaded model, as PEFT itself would
 * apply it, and refuse by name whatever PEFT would do differently from
 * y += scale * B @ A on the seven projections of a decoder layer.
 *
 * Shape of the loader: the config first, read into which modules are
 * targeted with which rank and alpha (PEFT's matching rules, below); then
 * every tensor key of the file, each of which must be the lora_A or lora_B
 * of a targeted module; then each targeted module's pair, checked against
 * the model's own projection (shape, dtype, every value finite). Nothing
 * is kept until everything has passed: *out is set last.
 *
 * PEFT's rules followed here (peft/tuners/tuners_utils.py
 * check_target_module_exists, peft/utils/other.py get_pattern_key,
 * peft/tuners/lora/layer.py update_layer), against the module names of a
 * transformers LlamaForCausalLM ("model.layers.N.self_attn.q_proj",
 * "model.embed_tokens", "lm_head"):
 *   - target_modules as a list: a module is targeted when its name equals
 *     an entry or ends with "." + entry; as a string: when the whole name
 *     matches it as a regular expression (re.fullmatch); "all-linear": the
 *     seven projections (PEFT leaves the output layer out); null: PEFT's
 *     default for llama, mistral and qwen2, q_proj and v_proj.
 *   - exclude_modules (same two forms) takes modules back out.
 *   - layers_to_transform (an int or a list) keeps only those layers, for
 *     a module that matched a list entry by suffix (not one named in full,
 *     as in PEFT); layers_pattern says what the layer list is called
 *     ("layers"). Both are refused with a string target_modules, as PEFT's
 *     LoraConfig refuses them.
 *   - rank_pattern / alpha_pattern: the first key, in the file's order,
 *     for which re.match(r"(.*\.)?(key)$", name) matches gives the
 *     module's rank / alpha; otherwise r / lora_alpha.
 *   - scale = alpha / r, or alpha / sqrt(r) with use_rslora, per module.
 *   - fan_in_fan_out: our projections are nn.Linear, for which PEFT warns
 *     and forces it false; we do the same and say so in meta.warning.
 *
 * On a Phi-3 model the module names are its own: self_attn.qkv_proj and
 * mlp.gate_up_proj (fused; PEFT targets and trains them whole) beside
 * o_proj and down_proj. Their lora_B rows are split as the model's weights
 * are (q, k, v; gate, up) and their lora_A shared (proj_group below).
 *
 * Regular expressions: Python's re, which PEFT uses, is not POSIX. A
 * pattern is translated to a POSIX extended expression by pattern.c
 * (internal/pattern.h), anchored here as each field needs, and whatever
 * POSIX cannot express or regcomp would spend unbounded memory or time on
 * is refused naming the field and the construct. All of one config's
 * patterns share one budget (LORA_PATTERN_CONFIG_COPIES).
 *
 * A mixture of experts' modules are its experts' own: target_modules
 * naming each expert's weights (mlp.experts.N.gate_proj, Mixtral's
 * block_sparse_moe.experts.N.w1), Qwen2-MoE's mlp.shared_expert.*, and
 * target_parameters on the fused expert parameters (mlp.experts.
 * gate_up_proj, mlp.experts.down_proj: PEFT's ParamWrapper, split per
 * expert by fused_experts.c).
 *
 * Refused by the field's name: peft_type other than LORA, bias other than
 * "none", use_dora, lora_bias, modules_to_save, layer_replication,
 * target_parameters other than fused experts, trainable_token_indices,
 * use_qalora, and the LoRA
 * variants whose forward pass is not B @ A (alora_invocation_tokens,
 * arrow_config, use_bdlora, velora_config, monteclora_config, kasa_config).
 * Other fields PEFT writes (dropout, task_type, init options, ...) do not
 * change inference and are ignored; an init_lora_weights that rewrote the
 * base weights during training (pissa, olora, corda, loftq, lora_ga) gets a
 * warning, since the adapter then belongs to that residual base.
 *
 * Tensor keys: "base_model.model." (what PeftModel.save_pretrained writes)
 * or nothing (what transformers' own adapter integration writes), then
 * "model.layers.N.<self_attn|mlp>.<proj>.lora_<A|B>", then ".weight", or
 * ".default.weight" (a raw state_dict of a PeftModel carries the adapter
 * name; save_pretrained strips it). Any other key is refused by name.
 *
 * With LORA_DTYPE_BF16 (serve's --adapter-dtype default) every f32 or f16
 * A and B is rounded to bf16 once, here, into memory the adapter owns, and
 * the file's copy is let go when nothing borrows from it any more: half an
 * f32 adapter's bytes, read by every step that applies it unmerged.
 *
 * Files: the folder is opened once (beneath the adapter directory with no
 * symlink followed, lora_open_dir, when the caller names that directory),
 * and each file is opened beneath that descriptor with no symlink followed
 * and read from the descriptor its open returned (mf_read_in, MF_NO_LINKS).
 * An uploader may write into the adapter directory, and a symlink named
 * adapter_config.json would otherwise read any file the server can (its
 * base_model_name_or_path echoed by the admin API); a check of a path
 * followed by an open of the same path could be beaten by a swap in
 * between. Refusing every symlink, even one whose target stays inside, is
 * the rule because it is one a reader can check at a glance.
 *
 * It offers lora_load, lora_load_as and lora_load_in (lora.h). The eng_lora it builds owns
 * adapter_model.safetensors read into memory at load (st_open_copy: A and
 * B borrow from that copy, through st_tensor_qtensor, so rewriting or
 * truncating the file on disk changes nothing that serves), the copies it
 * had to make (a misaligned tensor, a
 * llama GGUF's permuted B) and the folder's chat templates, released by its
 * destroy. It reads the model
 * (shapes, rope layout, name) and never writes it.
 */
#include "internal/fused_experts.h"
#include "internal/pattern.h"
#include "lora.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* adapter_config.json is small; a bigger file is not one */
#define CONFIG_MAX_BYTES ((size_t)16 << 20)
/* A module's full name: "model.language_model.layers.N." and its path (96). */
#define MODULE_NAME_MAX 160

/* --- the adapter as the engine sees it, plus the file it borrows from ------ */

typedef struct peft_lora {
    eng_lora lora; /* first: the engine holds an eng_lora * to this */
    st_file file;  /* adapter_model.safetensors, read into memory */
} peft_lora;

static void peft_destroy(eng_lora *l)
{
    peft_lora *p = (peft_lora *)l;
    if (l->modules)
        for (size_t i = 0; i < (size_t)l->n_layers * (size_t)l->n_proj; i++) {
            qt_free(&l->modules[i].a);
            qt_free(&l->modules[i].b);
        }
    free(l->modules);
    free(l->chat_template);
    free(l->chat_template_tool_use);
    st_close(&p->file);
    free(p);
}

/* --- the config --------------------------------------------------------------- */

/* A target_modules or exclude_modules value: a list of names or a pattern. */
typedef struct module_set {
    bool present;
    bool is_regex;
    regex_t re;
    const char **names; /* the list (borrowed from the JSON tree, or literals) */
    size_t n_names;
} module_set;

/* rank_pattern or alpha_pattern: compiled keys in the file's order. */
typedef struct pattern_map {
    size_t n;
    regex_t *re;
    const char **keys; /* borrowed from the JSON tree */
    double *values;
} pattern_map;

typedef struct adapter_config {
    const char *path;
    int32_t r;
    double alpha;
    bool use_rslora;
    module_set targets;
    bool all_linear;
    module_set exclude;
    bool has_layers; /* layers_to_transform */
    int64_t *layers;
    size_t n_layers;
    size_t n_layers_pattern;
    regex_t *layers_pattern;
    pattern_map rank, alpha_map;
    const char *base_model; /* borrowed from the JSON tree */
    /* target_parameters: the fused expert parameters adapted, and their
     * factors found per layer ([n_layers][LORA_FUSED_N][A, B]) */
    bool fused[LORA_FUSED_N];
    const st_tensor **fused_ab;
    char warning[512];
    double copies_left; /* what its patterns may still cost regcomp */
} adapter_config;

static void module_set_free(module_set *s)
{
    if (s->is_regex)
        regfree(&s->re);
    free(s->names);
    memset(s, 0, sizeof *s);
}

static void pattern_map_free(pattern_map *p)
{
    for (size_t i = 0; i < p->n; i++)
        regfree(&p->re[i]);
    free(p->re);
    free(p->keys);
    free(p->values);
    memset(p, 0, sizeof *p);
}

static void config_free(adapter_config *c)
{
    module_set_free(&c->targets);
    module_set_free(&c->exclude);
    free(c->layers);
    for (size_t i = 0; i < c->n_layers_pattern; i++)
        regfree(&c->layers_pattern[i]);
    free(c->layers_pattern);
    pattern_map_free(&c->rank);
    pattern_map_free(&c->alpha_map);
}

static void add_warning(adapter_config *c, const char *text)
{
    /* a long warning is cut, never refused */
    if (c->warning[0])
        strncat(c->warning, "; ", sizeof c->warning - strlen(c->warning) - 1);
    strncat(c->warning, text, sizeof c->warning - strlen(c->warning) - 1);
}

/* Python's truth of a JSON value: null, false, 0, "", [] and {} are false. */
static bool json_truthy(const cJSON *v)
{
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v))
        return false;
    if (cJSON_IsNumber(v))
        return v->valuedouble != 0;
    if (cJSON_IsString(v))
        return v->valuestring[0] != 0;
    if (cJSON_IsArray(v) || cJSON_IsObject(v))
        return v->child != NULL;
    return true;
}

static int read_module_set(adapter_config *c, const cJSON *v, const char *field, module_set *out,
                           char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if (!v || cJSON_IsNull(v))
        return QL_OK;
    out->present = true;
    if (cJSON_IsString(v)) {
        char why[160];
        if (lora_pattern_compile_within(&out->re, "^(", v->valuestring, ")$", &c->copies_left, why,
                                        sizeof why) != 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: %s \"%.80s%s\": %s", c->path, field,
                           v->valuestring, strlen(v->valuestring) > 80 ? "..." : "", why);
        out->is_regex = true;
        return QL_OK;
    }
    if (!cJSON_IsArray(v))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s must be a list of names or a string",
                       c->path, field);
    size_t n = (size_t)cJSON_GetArraySize(v);
    out->names = calloc(n ? n : 1, sizeof *out->names);
    if (!out->names)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", c->path);
    const cJSON *e;
    cJSON_ArrayForEach (e, v) {
        if (!cJSON_IsString(e))
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s holds something not a string", c->path,
                           field);
        out->names[out->n_names++] = e->valuestring;
    }
    return QL_OK;
}

static int read_pattern_map(adapter_config *c, const cJSON *root, const char *field, bool integer,
                            pattern_map *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, field);
    if (!v || cJSON_IsNull(v))
        return QL_OK;
    if (!cJSON_IsObject(v))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s must be an object", c->path, field);
    size_t n = (size_t)cJSON_GetArraySize(v);
    out->re = calloc(n ? n : 1, sizeof *out->re);
    out->keys = calloc(n ? n : 1, sizeof *out->keys);
    out->values = calloc(n ? n : 1, sizeof *out->values);
    if (!out->re || !out->keys || !out->values)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", c->path);
    const cJSON *e;
    cJSON_ArrayForEach (e, v) {
        int64_t rank;
        double x = 0;
        bool ok = integer ? mf_json_integer(e, 1, 65536, &rank) : mf_json_number(e, &x);
        if (integer && ok)
            x = (double)rank;
        if (!ok)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s[\"%s\"] must be %s", c->path, field,
                           e->string,
                           integer ? "a positive integer (a rank)" : "a finite number (an alpha)");
        char why[160];
        if (lora_pattern_compile_within(&out->re[out->n], "^(.*\\.)?(", e->string, ")$",
                                        &c->copies_left, why, sizeof why) != 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: %s key \"%.80s%s\": %s", c->path, field,
                           e->string, strlen(e->string) > 80 ? "..." : "", why);
        out->keys[out->n] = e->string;
        out->values[out->n] = x;
        out->n++;
    }
    return QL_OK;
}

/* The fields whose truth means a feature qlserve does not run, and why. */
static const struct {
    const char *field, *what;
} refused_fields[] = {
    {"use_dora", "DoRA (weight-decomposed LoRA) is not supported"},
    {"lora_bias", "a trained bias on lora_B is not supported"},
    {"modules_to_save", "fully trained modules (modules_to_save) are not supported"},
    {"layer_replication", "layer replication changes the model's layers and is not supported"},
    {"trainable_token_indices", "trained token embeddings are not supported"},
    {"use_qalora", "QA-LoRA (pooled inputs) is not supported"},
    {"alora_invocation_tokens", "activated LoRA (aLoRA) is not supported"},
    {"arrow_config", "Arrow routing is not supported"},
    {"use_bdlora", "block-diagonal LoRA is not supported"},
    {"velora_config", "VeLoRA is not supported"},
    {"monteclora_config", "MonteCLoRA is not supported"},
    {"kasa_config", "KaSA is not supported"},
};

/* target_parameters: a list naming a mixture's fused expert parameters
 * (lora_fused_param_of); anything else is refused by name. */
static int read_fused_targets(adapter_config *c, const cJSON *v, char *msg, size_t msg_len)
{
    if (!v || cJSON_IsNull(v))
        return QL_OK;
    if (!cJSON_IsArray(v))
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: target_parameters is not a list", c->path);
    const cJSON *e;
    cJSON_ArrayForEach (e, v) {
        int which = cJSON_IsString(e) ? lora_fused_param_of(e->valuestring) : -1;
        if (which < 0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: target_parameters holds %s%.80s%s; qlserve adapts only a mixture's "
                           "fused experts (mlp.experts.gate_up_proj, mlp.experts.down_proj)",
                           c->path, cJSON_IsString(e) ? "\"" : "",
                           cJSON_IsString(e) ? e->valuestring : "a non-string",
                           cJSON_IsString(e) ? "\"" : "");
        c->fused[which] = true;
    }
    return QL_OK;
}

static int parse_config(adapter_config *c, const cJSON *root, char *msg, size_t msg_len)
{
    c->copies_left = LORA_PATTERN_CONFIG_COPIES;
    const char *peft_type = mf_json_str(root, "peft_type");
    if (!peft_type || strcmp(peft_type, "LORA") != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: peft_type is %s; only LORA adapters are supported", c->path,
                       peft_type ? peft_type : "missing");
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "bias");
    if (v && !cJSON_IsNull(v) && (!cJSON_IsString(v) || strcmp(v->valuestring, "none") != 0))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: bias is \"%s\"; trained biases are not supported (only \"none\")",
                       c->path, cJSON_IsString(v) ? v->valuestring : "not a string");
    for (size_t i = 0; i < sizeof refused_fields / sizeof *refused_fields; i++)
        if (json_truthy(cJSON_GetObjectItemCaseSensitive(root, refused_fields[i].field)))
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: %s is set: %s", c->path,
                           refused_fields[i].field, refused_fields[i].what);

    int64_t r;
    if (!mf_json_integer(cJSON_GetObjectItemCaseSensitive(root, "r"), 1, 65536, &r))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: r must be a positive integer", c->path);
    c->r = (int32_t)r;
    v = cJSON_GetObjectItemCaseSensitive(root, "lora_alpha");
    if (!v || cJSON_IsNull(v))
        c->alpha = 8; /* LoraConfig's default */
    else if (!mf_json_number(v, &c->alpha))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: lora_alpha must be a number", c->path);
    c->use_rslora = mf_json_bool(root, "use_rslora", false);
    if (mf_json_bool(root, "fan_in_fan_out", false))
        add_warning(c, "fan_in_fan_out is true, but the targets are Linear layers: PEFT forces it "
                       "false for them and so does qlserve");
    const char *init = mf_json_str(root, "init_lora_weights");
    if (init) {
        static const char *const rewrites[] = {"pissa", "olora", "corda", "loftq", "lora_ga"};
        for (size_t i = 0; i < sizeof rewrites / sizeof *rewrites; i++)
            if (strncasecmp(init, rewrites[i], strlen(rewrites[i])) == 0) {
                char w[200];
                snprintf(w, sizeof w,
                         "init_lora_weights \"%s\" changed the base weights during training: "
                         "the adapter fits the residual base saved with it",
                         init);
                add_warning(c, w);
            }
    }
    c->base_model = mf_json_str(root, "base_model_name_or_path");
    int rc = read_fused_targets(c, cJSON_GetObjectItemCaseSensitive(root, "target_parameters"), msg,
                                msg_len);
    if (rc != QL_OK)
        return rc;

    v = cJSON_GetObjectItemCaseSensitive(root, "target_modules");
    if (cJSON_IsString(v) && strcasecmp(v->valuestring, "all-linear") == 0) {
        c->all_linear = true;
    } else {
        rc = read_module_set(c, v, "target_modules", &c->targets, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    bool any_fused = c->fused[LORA_FUSED_GATE_UP] || c->fused[LORA_FUSED_DOWN];
    if (!c->all_linear && !c->targets.present && !any_fused) {
        /* PeftModel fills a missing target_modules with its default for the
         * model type: q_proj and v_proj for llama, mistral and qwen2 */
        static const char *const defaults[] = {"q_proj", "v_proj"};
        c->targets.names = malloc(sizeof defaults);
        if (!c->targets.names)
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", c->path);
        memcpy(c->targets.names, defaults, sizeof defaults);
        c->targets.n_names = 2;
        c->targets.present = true;
    }
    rc = read_module_set(c, cJSON_GetObjectItemCaseSensitive(root, "exclude_modules"),
                         "exclude_modules", &c->exclude, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layers_to_transform");
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(root, "layers_pattern");
    bool str_targets = c->all_linear || c->targets.is_regex;
    if (str_targets && lt && !cJSON_IsNull(lt))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: layers_to_transform cannot be used when target_modules is a string "
                       "(PEFT refuses it too)",
                       c->path);
    if (str_targets && lp && !cJSON_IsNull(lp))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: layers_pattern cannot be used when target_modules is a string (PEFT "
                       "refuses it too)",
                       c->path);
    if (json_truthy(lp) && (!lt || cJSON_IsNull(lt)))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: layers_pattern is set without layers_to_transform (PEFT refuses it "
                       "too)",
                       c->path);
    if (lt && !cJSON_IsNull(lt)) {
        size_t n = cJSON_IsArray(lt) ? (size_t)cJSON_GetArraySize(lt) : 1;
        c->layers = calloc(n ? n : 1, sizeof *c->layers);
        if (!c->layers)
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", c->path);
        const cJSON *e = cJSON_IsArray(lt) ? lt->child : lt;
        for (; e && c->n_layers < n; e = e->next) {
            if (!mf_json_integer(e, 0, 1000000000, &c->layers[c->n_layers]))
                return ql_fail(msg, msg_len, QL_EFORMAT,
                               "%s: layers_to_transform must be a layer index or a list of them",
                               c->path);
            c->n_layers++;
        }
        /* an empty list restricts nothing (PEFT: is_using_layer_indexes) */
        c->has_layers = c->n_layers > 0;
    }
    if (json_truthy(lp) && c->has_layers) {
        size_t n = cJSON_IsArray(lp) ? (size_t)cJSON_GetArraySize(lp) : 1;
        c->layers_pattern = calloc(n, sizeof *c->layers_pattern);
        if (!c->layers_pattern)
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", c->path);
        const cJSON *e = cJSON_IsArray(lp) ? lp->child : lp;
        for (; e && c->n_layers_pattern < n; e = e->next) {
            char why[160];
            /* PEFT: re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key); our
             * module names have one numeric part, the layer, so whether it
             * matches settles which layer it found */
            if (!cJSON_IsString(e) ||
                lora_pattern_compile_within(&c->layers_pattern[c->n_layers_pattern], "^(|.*\\.)(",
                                            e->valuestring, ")\\.[0-9]+\\.", &c->copies_left, why,
                                            sizeof why) != 0)
                return ql_fail(msg, msg_len, QL_EINVAL, "%s: layers_pattern %.80s: %s", c->path,
                               cJSON_IsString(e) ? e->valuestring : "entry",
                               cJSON_IsString(e) ? why : "is not a string");
            c->n_layers_pattern++;
        }
    }
    rc = read_pattern_map(c, root, "rank_pattern", true, &c->rank, msg, msg_len);
    if (rc == QL_OK)
        rc = read_pattern_map(c, root, "alpha_pattern", false, &c->alpha_map, msg, msg_len);
    return rc;
}

/* --- which modules the config targets -------------------------------------- */

static bool in_module_set(const module_set *s, const char *name, bool *exact)
{
    *exact = false;
    if (!s->present)
        return false;
    if (s->is_regex)
        return regexec(&s->re, name, 0, NULL, 0) == 0;
    size_t n = strlen(name);
    for (size_t i = 0; i < s->n_names; i++) {
        const char *t = s->names[i];
        size_t k = strlen(t);
        if (strcmp(name, t) == 0) {
            *exact = true;
            return true;
        }
        if (k < n && name[n - k - 1] == '.' && strcmp(name + n - k, t) == 0)
            return true;
    }
    return false;
}

/* PEFT's check_target_module_exists for one module name (layer < 0: a
 * module outside the decoder layers). */
static bool config_targets(const adapter_config *c, const char *name, int32_t layer, bool linear)
{
    bool exact;
    if (in_module_set(&c->exclude, name, &exact))
        return false;
    if (c->all_linear)
        return linear;
    if (!in_module_set(&c->targets, name, &exact))
        return false;
    if (exact || c->targets.is_regex || !c->has_layers)
        return true;
    if (layer < 0)
        return false; /* no layer index in the name */
    if (c->n_layers_pattern) {
        bool found = false;
        for (size_t i = 0; i < c->n_layers_pattern && !found; i++)
            found = regexec(&c->layers_pattern[i], name, 0, NULL, 0) == 0;
        if (!found)
            return false;
    }
    for (size_t i = 0; i < c->n_layers; i++)
        if (c->layers[i] == layer)
            return true;
    return false;
}

/* get_pattern_key: the value of the first key matching name, or def; *key
 * receives the key (NULL when none matched). */
static double pattern_value(const pattern_map *p, const char *name, double def, const char **key)
{
    *key = NULL;
    for (size_t i = 0; i < p->n; i++)
        if (regexec(&p->re[i], name, 0, NULL, 0) == 0) {
            *key = p->keys[i];
            return p->values[i];
        }
    return def;
}

/*
 * Phi-3's fused modules. Its transformers model has self_attn.qkv_proj and
 * mlp.gate_up_proj where llama has q/k/v_proj and gate/up_proj; PEFT
 * targets and trains those. The model splits them by rows at load
 * (engine/model/layers.c); an adapter is split the same way: its lora_B
 * rows into the parts' (q, k, v; gate, up, in that order), its lora_A
 * shared by all of them, so each part's B_part @ A is exactly the rows of
 * the fused B @ A. The projections of one fused module form a group: its
 * first projection and how many.
 */
static void proj_group(const eng_model *m, eng_proj p, eng_proj *first, int *n)
{
    *first = p;
    *n = 1;
    if (m->cfg.arch != ENG_ARCH_PHI3)
        return;
    if (p == ENG_PROJ_Q || p == ENG_PROJ_K || p == ENG_PROJ_V) {
        *first = ENG_PROJ_Q;
        *n = 3;
    } else if (p == ENG_PROJ_GATE || p == ENG_PROJ_UP) {
        *first = ENG_PROJ_GATE;
        *n = 2;
    }
}

/* The model's own module name for projection p ("q_proj", or Phi-3's
 * "qkv_proj" / "gate_up_proj"). */
static const char *proj_module(const eng_model *m, eng_proj p)
{
    eng_proj first;
    int n;
    proj_group(m, p, &first, &n);
    if (n == 3)
        return "qkv_proj";
    if (n == 2)
        return "gate_up_proj";
    return eng_proj_name(p);
}

/* Mixtral's checkpoints name an expert's gate, up and down w1, w3, w2. */
static const char *const mixtral_part[3] = {"w1", "w3", "w2"};

/*
 * The module path of projection p under layer `layer`: "self_attn.q_proj";
 * in a mixture-of-experts layer "mlp.shared_expert.gate_proj" (Qwen2-MoE's
 * shared expert holds the MLP's projections) and an expert's
 * "mlp.experts.3.gate_proj" (Mixtral's "block_sparse_moe.experts.3.w1").
 */
static void module_path(char *buf, size_t len, const eng_model *m, int32_t layer, eng_proj p)
{
    eng_proj part;
    int32_t e = eng_proj_expert(p, &part);
    /* Qwen3.5's linear layers hold in_proj_qkv, in_proj_z and out_proj
     * where attention's q, k and o are (engine/model/hybrid.h); no v */
    static const char *const linear_part[ENG_N_PROJ] = {[ENG_PROJ_Q] = "linear_attn.in_proj_qkv",
                                                        [ENG_PROJ_K] = "linear_attn.in_proj_z",
                                                        [ENG_PROJ_V] = "linear_attn.(none)",
                                                        [ENG_PROJ_O] = "linear_attn.out_proj"};
    if (e < 0 && p < ENG_N_PROJ && eng_linear_is(&m->cfg.linear, layer) && linear_part[p])
        snprintf(buf, len, "%s", linear_part[p]);
    else if (e >= 0 && m->cfg.arch == ENG_ARCH_MIXTRAL)
        snprintf(buf, len, "block_sparse_moe.experts.%d.%s", e, mixtral_part[part - ENG_PROJ_GATE]);
    else if (e >= 0)
        snprintf(buf, len, "mlp.experts.%d.%s", e, eng_proj_name(p));
    else if (eng_layer_is_moe(&m->cfg, layer) && !m->cfg.g4.moe_block &&
             !strcmp(eng_proj_parent(p), "mlp"))
        snprintf(buf, len, "mlp.shared_expert.%s", eng_proj_name(p));
    else if (!*eng_proj_parent(p)) /* Gemma 4's per-layer input modules */
        snprintf(buf, len, "%s", proj_module(m, p));
    else
        snprintf(buf, len, "%s.%s", eng_proj_parent(p), proj_module(m, p));
}

static void module_name(char *buf, size_t len, const eng_model *m, int32_t layer, eng_proj p)
{
    char path[96];
    module_path(path, sizeof path, m, layer, p);
    /* Gemma4ForConditionalGeneration's text model's, as PEFT names them */
    snprintf(buf, len, "model.%slayers.%d.%s", m->cfg.g4.language_model ? "language_model." : "",
             layer, path);
}

/* What a module is to get from the file. */
typedef struct module_plan {
    bool targeted;
    int32_t rank;
    double alpha;
    const char *rank_key, *alpha_key; /* the pattern keys that set them, or NULL */
    const st_tensor *a, *b;
} module_plan;

static int plan_modules(const adapter_config *c, const eng_model *m, module_plan *plan,
                        size_t *n_targeted, char *msg, size_t msg_len)
{
    /* the modules outside the layers a LoRA could target in a transformers
     * model: PEFT would adapt them (an Embedding, the output Linear), we
     * cannot */
    static const char *const outer[] = {"model.embed_tokens", "lm_head",
                                        "model.embed_tokens_per_layer",
                                        "model.per_layer_model_projection"};
    for (size_t i = 0; i < sizeof outer / sizeof *outer; i++)
        if (config_targets(c, outer[i], -1, false))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: target_modules selects %s; qlserve adapts only the attention "
                           "and MLP projections (q_proj, k_proj, v_proj, o_proj, gate_proj, "
                           "up_proj, down_proj) and Gemma 4's per_layer_input_gate and "
                           "per_layer_projection",
                           c->path, outer[i]);
    /* a linear layer's in_proj_b and in_proj_a are dense parameters here,
     * not projections an adapter may change */
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int k = 0; k < 2 && eng_linear_is(&m->cfg.linear, l); k++) {
            char name[MODULE_NAME_MAX];
            snprintf(name, sizeof name, "model.layers.%d.linear_attn.%s", l,
                     k ? "in_proj_a" : "in_proj_b");
            if (config_targets(c, name, l, true))
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "%s: target_modules selects %s; qlserve adapts a linear-attention "
                               "layer's in_proj_qkv, in_proj_z and out_proj only",
                               c->path, name);
        }
    *n_targeted = 0;
    int32_t np = eng_n_proj(&m->cfg);
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int p = 0; p < np; p++) {
            if (!eng_model_proj(m, l, (eng_proj)p)->rows)
                continue; /* an expert's in a dense layer; a mixture's plain MLP */
            if (m->cfg.g4.moe_block && eng_proj_expert((eng_proj)p, NULL) >= 0)
                continue; /* Gemma 4's experts are 3-D parameters, no modules */
            module_plan *mp = &plan[(size_t)l * (size_t)np + (size_t)p];
            char name[MODULE_NAME_MAX];
            module_name(name, sizeof name, m, l, (eng_proj)p);
            mp->targeted = config_targets(c, name, l, true);
            if (!mp->targeted)
                continue;
            /* llama.cpp's converter reorders a linear layer's value heads */
            if (m->cfg.linear.v_tiled && eng_linear_is(&m->cfg.linear, l))
                return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                               "%s: target_modules selects %s, whose value heads a qwen35 GGUF "
                               "holds in another order than PEFT trained; use the Hugging Face "
                               "folder for adapters on the linear-attention layers",
                               c->path, name);
            (*n_targeted)++;
            mp->rank = (int32_t)pattern_value(&c->rank, name, c->r, &mp->rank_key);
            mp->alpha = pattern_value(&c->alpha_map, name, c->alpha, &mp->alpha_key);
        }
    bool fused = c->fused[LORA_FUSED_GATE_UP] || c->fused[LORA_FUSED_DOWN];
    if (fused && m->cfg.g4.moe_block)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: target_parameters on Gemma 4's experts (experts.gate_up_proj, "
                       "experts.down_proj) is not supported; its attention, MLP and per-layer "
                       "input projections are",
                       c->path);
    if (fused && m->cfg.n_experts <= 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: target_parameters adapts a mixture's experts; %s (%s) has none",
                       c->path, m->name, eng_arch_name(m->cfg.arch));
    if (*n_targeted == 0 && !fused) {
        char example[MODULE_NAME_MAX];
        module_name(example, sizeof example, m, 0, ENG_PROJ_Q);
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: target_modules selects no projection of this model (module names "
                       "look like %s)",
                       c->path, example);
    }
    return QL_OK;
}

/* --- the tensors ----------------------------------------------------------------- */

static bool skip_prefix(const char **s, const char *prefix)
{
    size_t n = strlen(prefix);
    if (strncmp(*s, prefix, n) != 0)
        return false;
    *s += n;
    return true;
}

/* Why a key we do not take is there, for the message. */
static const char *key_hint(const char *key)
{
    if (strstr(key, "lora_magnitude_vector"))
        return "a DoRA magnitude (use_dora) is not supported";
    if (strstr(key, "lora_embedding_") || strstr(key, "embed_tokens"))
        return "LoRA on the embeddings is not supported";
    if (strstr(key, "lm_head"))
        return "LoRA on lm_head is not supported";
    if (strstr(key, ".bias"))
        return "a trained bias is not supported";
    if (strstr(key, "modules_to_save") || strstr(key, "base_layer"))
        return "fully trained modules (modules_to_save) are not supported";
    return "it is not the lora_A or lora_B weight of a decoder layer's projection";
}

/*
 * An expert's module at *s ("mlp.experts.3.gate_proj.", Mixtral's
 * "block_sparse_moe.experts.3.w1."): its projection, *s moved past it; -1
 * (and *s as it was) for any other module.
 */
static int expert_key(const char **s, const eng_model *m)
{
    const char *t = *s;
    if (m->cfg.n_experts <= 0 ||
        !(skip_prefix(&t, "mlp.experts.") || skip_prefix(&t, "block_sparse_moe.experts.")) ||
        !isdigit((unsigned char)*t))
        return -1;
    char *end;
    unsigned long e = strtoul(t, &end, 10);
    if (*end != '.' || e >= (unsigned long)m->cfg.n_experts)
        return -1;
    t = end + 1;
    static const char *const qwen_part[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int k = 0; k < 6; k++) {
        const char *u = t;
        if (skip_prefix(&u, k < 3 ? qwen_part[k] : mixtral_part[k - 3]) && skip_prefix(&u, ".")) {
            *s = u;
            return (int)eng_expert_proj((int32_t)e, (eng_proj)(ENG_PROJ_GATE + k % 3));
        }
    }
    return -1;
}

/*
 * Parse key into (layer, projection, is B). Returns false for a key of any
 * other form. layer may be out of range (the caller says so).
 */
static bool parse_key(const char *key, const eng_model *m, int64_t *layer, eng_proj *proj,
                      bool *is_b)
{
    const char *s = key;
    skip_prefix(&s, "base_model.model.");
    /* a multimodal checkpoint's text model (Gemma4ForConditionalGeneration,
     * Qwen3_5ForConditionalGeneration) */
    if (!(skip_prefix(&s, "model.layers.") || skip_prefix(&s, "model.language_model.layers.")) ||
        !isdigit((unsigned char)*s))
        return false;
    char *end;
    unsigned long long l = strtoull(s, &end, 10);
    if (*end != '.' || l > INT32_MAX)
        return false;
    s = end + 1;
    int p = expert_key(&s, m);
    for (int q = 0; p < 0 && q < eng_n_layer_proj(&m->cfg); q++) {
        char path[96];
        module_path(path, sizeof path, m, (int32_t)l, (eng_proj)q);
        const char *t = s;
        if (skip_prefix(&t, path) && skip_prefix(&t, ".")) {
            s = t;
            p = q;
        }
    }
    if (p < 0)
        return false;
    if (skip_prefix(&s, "lora_A"))
        *is_b = false;
    else if (skip_prefix(&s, "lora_B"))
        *is_b = true;
    else
        return false;
    if (strcmp(s, ".weight") != 0 && strcmp(s, ".default.weight") != 0)
        return false;
    *layer = (int64_t)l;
    *proj = (eng_proj)p;
    return true;
}

/* The first element that is NaN or Inf, or -1. */
static int64_t first_nonfinite(const st_tensor *t)
{
    for (int64_t i = 0; i < t->numel; i++) {
        if (t->dtype == ST_F32) {
            uint32_t u;
            memcpy(&u, t->data + i * 4, 4);
            if ((u & 0x7f800000u) == 0x7f800000u)
                return i;
        } else {
            uint16_t h;
            memcpy(&h, t->data + i * 2, 2);
            uint16_t exp = t->dtype == ST_F16 ? 0x7c00u : 0x7f80u;
            if ((h & exp) == exp)
                return i;
        }
    }
    return -1;
}

static float element(const st_tensor *t, int64_t i)
{
    if (t->dtype == ST_F32) {
        float f;
        memcpy(&f, t->data + i * 4, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, t->data + i * 2, 2);
    return t->dtype == ST_F16 ? qt_f16_to_f32(h) : qt_bf16_to_f32(h);
}

/* Check one of a module's tensors: 2-D, [rows, cols], a float dtype we
 * compute with, every value finite. */
static int check_tensor(const char *path, const st_tensor *t, const char *module, int64_t rows,
                        int64_t cols, const module_plan *mp, char *msg, size_t msg_len)
{
    if (st_dtype_qt_kind(t->dtype) < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' is %s; LoRA weights must be F32, F16 or BF16", path,
                       t->name, st_dtype_name(t->dtype));
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        char shape[96] = "[";
        for (int i = 0; i < t->ndim; i++) {
            size_t n = strlen(shape);
            snprintf(shape + n, sizeof shape - n, "%s%" PRId64, i ? ", " : "", t->shape[i]);
        }
        strncat(shape, "]", sizeof shape - strlen(shape) - 1);
        char why[160] = "";
        if (mp->rank_key)
            snprintf(why, sizeof why, ", rank %d from rank_pattern \"%s\"", mp->rank, mp->rank_key);
        else
            snprintf(why, sizeof why, ", rank %d from r", mp->rank);
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' is %s; module %s needs [%" PRId64 ", %" PRId64 "]%s", path,
                       t->name, shape, module, rows, cols, why);
    }
    int64_t bad = first_nonfinite(t);
    if (bad >= 0)
        return ql_fail(msg, msg_len, QL_ENONFINITE,
                       "%s: tensor '%s' holds %g at element %" PRId64 " (row %" PRId64
                       ", column %" PRId64 "); every LoRA weight must be finite",
                       path, t->name, (double)element(t, bad), bad, bad / cols, bad % cols);
    return QL_OK;
}

/* t as a dense qtensor (st_tensor_qtensor: borrowed from the mapping, or
 * copied when misaligned); a copy's bytes are added to *copied. */
static int wrap_tensor(const st_file *f, const st_tensor *t, qtensor *out, size_t *copied,
                       char *msg, size_t msg_len)
{
    int rc = st_tensor_qtensor(f, t, out, msg, msg_len);
    if (rc == QL_OK && !out->data_borrowed)
        *copied += out->data_bytes;
    return rc;
}

/*
 * B with its rows in a llama GGUF's order. llama.cpp's convert_hf_to_gguf.py
 * permutes q_proj with permute(w, n_head, n_head) and k_proj with
 * permute(w, n_head, n_kv_head), which uses n_kv_head whenever it differs:
 * w.reshape(heads, 2, rows / heads / 2, cols).swapaxes(1, 2).reshape(rows,
 * cols). Row 2j + i of a head is the Hugging Face row i * half + j: the
 * rotary pairs (j, j + half) become adjacent. W = B @ A, so permuting W's
 * rows is permuting B's.
 */
static int permuted_copy(const st_tensor *t, int32_t heads, qtensor *out, size_t *copied, char *msg,
                         size_t msg_len)
{
    int64_t rows = t->shape[0], cols = t->shape[1];
    int64_t head_rows = rows / heads, half = head_rows / 2;
    size_t row_bytes = (size_t)cols * st_dtype_size(t->dtype);
    memset(out, 0, sizeof *out);
    out->data = malloc(t->nbytes ? t->nbytes : 1);
    if (!out->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", t->name);
    out->kind = (qt_kind)st_dtype_qt_kind(t->dtype);
    out->rows = rows;
    out->cols = cols;
    out->data_bytes = t->nbytes;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < half; j++)
            for (int64_t i = 0; i < 2; i++)
                memcpy(out->data + (size_t)(h * head_rows + 2 * j + i) * row_bytes,
                       t->data + (size_t)(h * head_rows + i * half + j) * row_bytes, row_bytes);
    *copied += t->nbytes;
    return QL_OK;
}

/* Rows [r0, r0 + n) of B (wrapped whole in *whole, which this consumes)
 * into *out: a view of the mapping when B is borrowed from it, else a copy
 * of those rows (its bytes added to *copied). */
static int slice_rows(qtensor *whole, int64_t r0, int64_t n, qtensor *out, size_t *copied,
                      char *msg, size_t msg_len)
{
    size_t row_bytes = whole->data_bytes / (size_t)whole->rows;
    *out = *whole;
    out->rows = n;
    out->data_bytes = (size_t)n * row_bytes;
    if (whole->data_borrowed) {
        out->data = whole->data + (size_t)r0 * row_bytes;
        memset(whole, 0, sizeof *whole);
        return QL_OK;
    }
    out->data = malloc(out->data_bytes ? out->data_bytes : 1);
    if (!out->data) {
        qt_free(whole);
        memset(out, 0, sizeof *out);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for an adapter's fused B");
    }
    memcpy(out->data, whole->data + (size_t)r0 * row_bytes, out->data_bytes);
    *copied += out->data_bytes;
    *copied -= whole->data_bytes; /* wrap_tensor counted the whole copy, freed here */
    qt_free(whole);
    return QL_OK;
}

/* Module (layer, p)'s B: its own lora_B, or its rows of a fused module's
 * (the projections of the group before p come first). */
static int wrap_b(const st_file *f, const st_tensor *t, const eng_model *m, int32_t layer,
                  eng_proj p, qtensor *out, size_t *copied, char *msg, size_t msg_len)
{
    eng_proj first;
    int n;
    proj_group(m, p, &first, &n);
    if (n == 1)
        return wrap_tensor(f, t, out, copied, msg, msg_len);
    int64_t r0 = 0;
    for (int k = first; k < (int)p; k++)
        r0 += eng_model_proj(m, layer, (eng_proj)k)->rows;
    qtensor whole;
    int rc = wrap_tensor(f, t, &whole, copied, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    return slice_rows(&whole, r0, eng_model_proj(m, layer, p)->rows, out, copied, msg, msg_len);
}

/* The rows of a module's lora_B: its projection's, or the whole fused
 * module's. */
static int64_t b_rows(const eng_model *m, int32_t layer, eng_proj p)
{
    eng_proj first;
    int n;
    proj_group(m, p, &first, &n);
    int64_t rows = 0;
    for (int k = 0; k < n; k++)
        rows += eng_model_proj(m, layer, (eng_proj)(first + k))->rows;
    return rows;
}

/* --- names ----------------------------------------------------------------------- */

/* A model name reduced to what two spellings of it share: the base name's
 * letters and digits, lower case, without a ".gguf" ending. So
 * "HuggingFaceTB/SmolLM2-135M-Instruct" and a GGUF's "SmolLM2 135M
 * Instruct" are the same model. */
static void name_key(const char *s, char *buf, size_t len)
{
    char base[256];
    mf_path_base(s, base, sizeof base);
    size_t n = strlen(base);
    if (n > 5 && strcasecmp(base + n - 5, ".gguf") == 0)
        base[n - 5] = 0;
    size_t k = 0;
    for (const char *p = base; *p && k + 1 < len; p++)
        if (isalnum((unsigned char)*p))
            buf[k++] = (char)tolower((unsigned char)*p);
    buf[k] = 0;
}

/* --- loading ------------------------------------------------------------------------ */

/* Every key of the file is a targeted module's A or B; each is recorded in
 * its module's plan. */
/*
 * A fused expert parameter's factor t (lora_fused_key: layer, depth, A or
 * B) into c->fused_ab. PEFT nests the wrapped parameters in the order the
 * experts module registers them, the first innermost: of n targeted, the
 * one `depth` base_layers deep is the (n - 1 - depth)-th.
 */
static int map_fused_key(const adapter_config *c, const st_file *f, const eng_model *m,
                         const st_tensor *t, int64_t layer, int depth, bool is_b, char *msg,
                         size_t msg_len)
{
    int order[LORA_FUSED_N], n = 0;
    for (int p = 0; p < LORA_FUSED_N; p++)
        if (c->fused[p])
            order[n++] = p;
    if (n == 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: tensor '%s' adapts fused experts, and %s has no target_parameters",
                       f->path, t->name, c->path);
    if (layer >= m->cfg.n_layers || !eng_layer_is_moe(&m->cfg, (int32_t)layer))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: tensor '%s' is for layer %lld, which has no experts in this model",
                       f->path, t->name, (long long)layer);
    if (depth >= n)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' is nested %d base_layers deep; target_parameters wraps %d "
                       "parameter%s",
                       f->path, t->name, depth, n, n == 1 ? "" : "s");
    const st_tensor **slot =
        &c->fused_ab[((size_t)layer * LORA_FUSED_N + (size_t)order[n - 1 - depth]) * 2 + is_b];
    if (*slot)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensors '%s' and '%s' are the same factor",
                       f->path, (*slot)->name, t->name);
    *slot = t;
    return QL_OK;
}

/* Every targeted fused expert parameter's modules, in each layer with
 * experts (lora_fused_build); *n_modules grows by the modules made. */
static int build_fused(const adapter_config *c, peft_lora *pl, const eng_model *m,
                       size_t *n_modules, size_t *copied, char *msg, size_t msg_len)
{
    static const char *const names[LORA_FUSED_N] = {"gate_up_proj", "down_proj"};
    float scale = (float)(c->use_rslora ? c->alpha / sqrt((double)c->r) : c->alpha / (double)c->r);
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int p = 0; p < LORA_FUSED_N; p++) {
            if (!c->fused[p] || !eng_layer_is_moe(&m->cfg, l))
                continue;
            const st_tensor *a = c->fused_ab[((size_t)l * LORA_FUSED_N + (size_t)p) * 2];
            const st_tensor *b = c->fused_ab[((size_t)l * LORA_FUSED_N + (size_t)p) * 2 + 1];
            if (!a || !b)
                return ql_fail(msg, msg_len, QL_ENOTFOUND,
                               "%s: layer %d's mlp.experts.%s has no lora_%c tensor, and %s "
                               "targets it",
                               pl->file.path, l, names[p], a ? 'B' : 'A', c->path);
            int rc = lora_fused_build(m, l, (lora_fused_param)p, a, b, c->r, scale,
                                      pl->lora.modules + (size_t)l * (size_t)pl->lora.n_proj,
                                      copied, pl->file.path, msg, msg_len);
            if (rc != QL_OK)
                return rc;
            *n_modules += (size_t)m->cfg.n_experts * (p == LORA_FUSED_GATE_UP ? 2 : 1);
        }
    return QL_OK;
}

static int map_keys(const adapter_config *c, const st_file *f, const eng_model *m,
                    module_plan *plan, char *msg, size_t msg_len)
{
    for (size_t i = 0; i < f->n_tensors; i++) {
        const st_tensor *t = &f->tensors[i];
        int64_t layer;
        eng_proj p;
        bool is_b;
        int depth;
        if (lora_fused_key(t->name, &layer, &depth, &is_b)) {
            int rc = map_fused_key(c, f, m, t, layer, depth, is_b, msg, msg_len);
            if (rc != QL_OK)
                return rc;
            continue;
        }
        if (!parse_key(t->name, m, &layer, &p, &is_b))
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s' is not supported: %s", f->path,
                           t->name, key_hint(t->name));
        if (layer >= m->cfg.n_layers)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tensor '%s' is for layer %" PRId64 "; the model has %d layers",
                           f->path, t->name, layer, m->cfg.n_layers);
        size_t np = (size_t)eng_n_proj(&m->cfg);
        module_plan *mp = &plan[(size_t)layer * np + p];
        char name[MODULE_NAME_MAX];
        module_name(name, sizeof name, m, (int32_t)layer, p);
        if (!mp->targeted)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tensor '%s' is for %s, which %s does not target (check "
                           "target_modules, exclude_modules, layers_to_transform)",
                           f->path, t->name, name, c->path);
        const st_tensor **slot = is_b ? &mp->b : &mp->a;
        if (*slot)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensors '%s' and '%s' are both lora_%c of %s", f->path,
                           (*slot)->name, t->name, is_b ? 'B' : 'A', name);
        /* a fused module's tensors serve every projection of its group */
        eng_proj first;
        int n;
        proj_group(m, p, &first, &n);
        for (int k = 0; k < n; k++) {
            module_plan *part = &plan[(size_t)layer * np + first + k];
            *(is_b ? &part->b : &part->a) = t;
        }
    }
    return QL_OK;
}

/* Check and wrap every targeted module into l->modules. */
static int build_modules(const adapter_config *c, peft_lora *pl, const eng_model *m,
                         const module_plan *plan, size_t *copied, char *msg, size_t msg_len)
{
    eng_lora *l = &pl->lora;
    const char *path = pl->file.path;
    int32_t np = eng_n_proj(&m->cfg);
    for (int32_t layer = 0; layer < m->cfg.n_layers; layer++)
        for (int p = 0; p < np; p++) {
            size_t idx = (size_t)layer * (size_t)np + (size_t)p;
            const module_plan *mp = &plan[idx];
            if (!mp->targeted)
                continue;
            char name[MODULE_NAME_MAX];
            module_name(name, sizeof name, m, layer, (eng_proj)p);
            if (!mp->a || !mp->b)
                return ql_fail(msg, msg_len, QL_ENOTFOUND,
                               "%s: module %s has no lora_%c tensor, and %s targets it", path, name,
                               mp->a ? 'B' : 'A', c->path);
            const qtensor *w = eng_model_proj(m, layer, (eng_proj)p);
            int rc = check_tensor(path, mp->a, name, mp->rank, w->cols, mp, msg, msg_len);
            if (rc == QL_OK)
                rc = check_tensor(path, mp->b, name, b_rows(m, layer, (eng_proj)p), mp->rank, mp,
                                  msg, msg_len);
            if (rc != QL_OK)
                return rc;
            eng_lora_module *mod = &l->modules[idx];
            rc = wrap_tensor(&pl->file, mp->a, &mod->a, copied, msg, msg_len);
            if (rc != QL_OK)
                return rc;
            bool permute = m->cfg.rope_interleaved && (p == ENG_PROJ_Q || p == ENG_PROJ_K);
            int32_t heads = p == ENG_PROJ_Q ? m->cfg.n_heads : eng_layer_kv_heads(&m->cfg, layer);
            rc = permute ? permuted_copy(mp->b, heads, &mod->b, copied, msg, msg_len)
                         : wrap_b(&pl->file, mp->b, m, layer, (eng_proj)p, &mod->b, copied, msg,
                                  msg_len);
            if (rc != QL_OK)
                return rc;
            mod->scale = (float)(c->use_rslora ? mp->alpha / sqrt((double)mp->rank)
                                               : mp->alpha / (double)mp->rank);
        }
    return QL_OK;
}

/* Round every module's A and B that is not bf16 to bf16 (f32 and f16: in
 * place, qt_cast_dense: nearest even); *copied follows the bytes owned. */
static int modules_to_bf16(eng_lora *l, size_t *copied, char *msg, size_t msg_len)
{
    for (size_t i = 0; i < (size_t)l->n_layers * (size_t)l->n_proj; i++) {
        qtensor *ts[2] = {&l->modules[i].a, &l->modules[i].b};
        for (int k = 0; k < 2; k++) {
            if (!ts[k]->rows || ts[k]->kind == QT_BF16)
                continue;
            size_t owned = ts[k]->data_borrowed ? 0 : ts[k]->data_bytes;
            int rc = qt_cast_dense(ts[k], QT_BF16, msg, msg_len);
            if (rc != QL_OK)
                return rc;
            *copied = *copied - owned + ts[k]->data_bytes;
        }
    }
    return QL_OK;
}

/* Whether any module's tensor still points into the file's copy. */
static bool borrows_file(const eng_lora *l)
{
    for (size_t i = 0; i < (size_t)l->n_layers * (size_t)l->n_proj; i++)
        if (l->modules[i].a.data_borrowed || l->modules[i].b.data_borrowed)
            return true;
    return false;
}

int lora_dtype_from_name(const char *name)
{
    return ql_name_parse(&ql_adapter_dtype_names, name);
}

static void fill_meta(lora_meta *meta, const adapter_config *c, const module_plan *plan,
                      const eng_model *m, size_t n_modules)
{
    meta->r = c->r;
    meta->alpha = (float)c->alpha;
    meta->use_rslora = c->use_rslora;
    snprintf(meta->base_model, sizeof meta->base_model, "%s", c->base_model ? c->base_model : "");
    meta->n_modules = (int32_t)n_modules;
    for (int p = 0; p < eng_n_layer_proj(&m->cfg); p++) {
        eng_proj first;
        int group;
        proj_group(m, (eng_proj)p, &first, &group);
        if ((int)first != p)
            continue; /* a fused module is listed once, by its own name */
        bool any = false;
        for (int32_t l = 0; l < m->cfg.n_layers && !any; l++)
            any = plan[(size_t)l * (size_t)eng_n_proj(&m->cfg) + (size_t)p].targeted;
        if (!any)
            continue;
        size_t n = strlen(meta->targets);
        snprintf(meta->targets + n, sizeof meta->targets - n, "%s%s", n ? "," : "",
                 proj_module(m, (eng_proj)p));
    }
    for (int p = 0; p < LORA_FUSED_N; p++) {
        size_t n = strlen(meta->targets);
        if (c->fused[p])
            snprintf(meta->targets + n, sizeof meta->targets - n, "%sexperts.%s", n ? "," : "",
                     p == LORA_FUSED_GATE_UP ? "gate_up_proj" : "down_proj");
    }
    snprintf(meta->warning, sizeof meta->warning, "%s", c->warning);
}

int lora_load(eng_lora **out, lora_meta *meta, const char *dir, const char *name,
              const eng_model *m, char *msg, size_t msg_len)
{
    return lora_load_in(out, meta, NULL, dir, name, m, LORA_DTYPE_F32, msg, msg_len);
}

int lora_load_as(eng_lora **out, lora_meta *meta, const char *dir, const char *name,
                 const eng_model *m, lora_dtype dtype, char *msg, size_t msg_len)
{
    return lora_load_in(out, meta, NULL, dir, name, m, dtype, msg, msg_len);
}

/* adapter_config.json of the folder dir_fd (dir), parsed; *path receives
 * its path for messages. */
static int read_config(int dir_fd, const char *dir, char *path, size_t path_len, cJSON **root,
                       char *msg, size_t msg_len)
{
    *root = NULL;
    snprintf(path, path_len, "%s/adapter_config.json", dir);
    char *text;
    size_t len;
    int rc = mf_read_in(dir_fd, dir, "adapter_config.json", MF_NO_LINKS, CONFIG_MAX_BYTES, &text,
                        &len, msg, msg_len);
    if (rc == QL_ENOTFOUND)
        return ql_fail(msg, msg_len, QL_ENOTFOUND,
                       "%s: adapter_config.json is missing (not a PEFT adapter folder?)", dir);
    if (rc != QL_OK)
        return rc;
    rc = mf_parse_json(text, len, path, root, msg, msg_len);
    free(text);
    return rc;
}

/* adapter_model.safetensors of the folder dir_fd (dir), read whole into f:
 * not mapped, since the file may be rewritten on disk while the adapter
 * serves (a trainer saving into the same folder), and a mapping would then
 * change under running requests or fault. */
static int read_weights(int dir_fd, const char *dir, st_file *f, char *msg, size_t msg_len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    char *bytes;
    size_t len;
    int rc = mf_read_in(dir_fd, dir, "adapter_model.safetensors", MF_NO_LINKS, SIZE_MAX / 2, &bytes,
                        &len, msg, msg_len);
    struct stat sb;
    if (rc == QL_ENOTFOUND)
        return fstatat(dir_fd, "adapter_model.bin", &sb, AT_SYMLINK_NOFOLLOW) == 0
                   ? ql_fail(msg, msg_len, QL_EINVAL,
                             "%s: only adapter_model.bin (a pickle, which qlserve does not read) "
                             "is there; save the adapter with safe_serialization=True",
                             dir)
                   : ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: adapter_model.safetensors is missing",
                             dir);
    return rc == QL_OK ? st_open_copy(f, bytes, len, path, msg, msg_len) : rc;
}

static int load_folder(eng_lora **out, lora_meta *meta, int dir_fd, const char *dir,
                       const char *name, const eng_model *m, lora_dtype dtype, char *msg,
                       size_t msg_len);

int lora_load_in(eng_lora **out, lora_meta *meta, const char *root, const char *dir,
                 const char *name, const eng_model *m, lora_dtype dtype, char *msg, size_t msg_len)
{
    *out = NULL;
    if (meta)
        memset(meta, 0, sizeof *meta);
    int dir_fd = -1, rc = QL_OK;
    if (root) {
        rc = lora_open_dir(root, dir, &dir_fd, NULL, 0, msg, msg_len);
    } else if ((dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        int err = errno;
        rc = ql_fail(msg, msg_len, err == ENOENT ? QL_ENOTFOUND : QL_EIO,
                     "%s: cannot open the adapter folder: %s", dir, strerror(err));
    }
    if (rc != QL_OK)
        return rc;
    rc = load_folder(out, meta, dir_fd, dir, name, m, dtype, msg, msg_len);
    close(dir_fd);
    return rc;
}

/* The load itself, from the open folder dir_fd (dir in messages): every
 * file is opened beneath it (mf_read_in, MF_NO_LINKS). */
static int load_folder(eng_lora **out, lora_meta *meta, int dir_fd, const char *dir,
                       const char *name, const eng_model *m, lora_dtype dtype, char *msg,
                       size_t msg_len)
{
    char own_name[256];
    if (!name) {
        mf_path_base(dir, own_name, sizeof own_name);
        name = own_name;
    }
    if (!name[0] || strlen(name) >= sizeof((eng_lora *)0)->name)
        return ql_fail(msg, msg_len, QL_EINVAL, "adapter name \"%s\" must be 1 to %zu bytes long",
                       name, sizeof((eng_lora *)0)->name - 1);

    char config_path[4096];
    cJSON *root;
    int rc = read_config(dir_fd, dir, config_path, sizeof config_path, &root, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    adapter_config c = {.path = config_path};
    size_t n_all = (size_t)m->cfg.n_layers * (size_t)eng_n_proj(&m->cfg);
    module_plan *plan = calloc(n_all, sizeof *plan);
    peft_lora *pl = calloc(1, sizeof *pl);
    size_t n_modules = 0, copied = 0;
    if (!plan || !pl) {
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", dir);
        goto done;
    }
    rc = parse_config(&c, root, msg, msg_len);
    if (rc == QL_OK)
        rc = plan_modules(&c, m, plan, &n_modules, msg, msg_len);
    if (rc != QL_OK)
        goto done;

    rc = read_weights(dir_fd, dir, &pl->file, msg, msg_len);
    if (rc != QL_OK)
        goto done;
    eng_lora *l = &pl->lora;
    memcpy(l->name, name, strlen(name) + 1); /* its length was checked */
    l->n_layers = m->cfg.n_layers;
    l->n_proj = eng_n_proj(&m->cfg);
    l->refs = 1;
    l->destroy = peft_destroy;
    l->modules = calloc(n_all, sizeof *l->modules);
    if (!l->modules) {
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", dir);
        goto done;
    }
    c.fused_ab = calloc((size_t)m->cfg.n_layers * LORA_FUSED_N * 2, sizeof *c.fused_ab);
    if (!c.fused_ab) {
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", dir);
        goto done;
    }
    rc = map_keys(&c, &pl->file, m, plan, msg, msg_len);
    if (rc == QL_OK)
        rc = build_modules(&c, pl, m, plan, &copied, msg, msg_len);
    if (rc == QL_OK)
        rc = build_fused(&c, pl, m, &n_modules, &copied, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_chat_templates_at(dir_fd, dir, true, &l->chat_template, &l->chat_template_tool_use,
                                   msg, msg_len);
    if (rc == QL_OK && dtype == LORA_DTYPE_BF16)
        rc = modules_to_bf16(l, &copied, msg, msg_len);
    if (rc != QL_OK)
        goto done;
    /* converted tensors own their bytes: the file's copy goes when nothing
     * points into it any more */
    if (dtype == LORA_DTYPE_BF16 && !borrows_file(l)) {
        st_close(&pl->file);
        memset(&pl->file, 0, sizeof pl->file);
    }
    /* the whole file's copy stays while the adapter borrows from it, plus
     * what was copied */
    l->bytes = pl->file.map_len + copied + n_all * sizeof *l->modules +
               (l->chat_template ? strlen(l->chat_template) : 0) +
               (l->chat_template_tool_use ? strlen(l->chat_template_tool_use) : 0);

    if (c.base_model && m->name[0]) {
        char want[256], have[256];
        name_key(c.base_model, want, sizeof want);
        name_key(m->name, have, sizeof have);
        if (want[0] && strcmp(want, have) != 0) {
            char w[600];
            snprintf(w, sizeof w, "the adapter was trained on %s; the model loaded is %s",
                     c.base_model, m->name);
            add_warning(&c, w);
        }
    }
    if (meta)
        fill_meta(meta, &c, plan, m, n_modules);
    *out = l;
    pl = NULL;

done:
    if (pl)
        peft_destroy(&pl->lora);
    free(plan);
    free(c.fused_ab);
    config_free(&c);
    cJSON_Delete(root);
    return rc;
}

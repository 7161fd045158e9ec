/*
 * lora_fixture.h - tests make their own PEFT adapters: a folder with
 * adapter_config.json and adapter_model.safetensors as PeftModel.
 * save_pretrained writes them, for any model config, with A and B of a
 * chosen dtype, rank and alpha, and the config fields a test wants to try
 * (rank_pattern, alpha_pattern, a regex target_modules, refused features);
 * and the same tiny Hugging Face model written as a llama GGUF the way
 * llama.cpp's converter writes it (q/k rows permuted), so an adapter can be
 * checked on both.
 *
 *   lora_fix_spec s = lora_fix_default();      r 8, alpha 16, F32, all seven
 *   s.use_rslora = true; ...                   projections of every layer
 *   lora_fix_write(folder, &model.cfg, &s);
 *   float v = lora_fix_value(&s, layer, ENG_PROJ_Q, true, i);  B's element i
 *
 * Every value is a function of (seed, layer, projection, A or B, index), so
 * a test can recompute any element without keeping the file's contents.
 */
#ifndef QL_LORA_FIXTURE_H
#define QL_LORA_FIXTURE_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf_writer.h"
#include "lora.h"
#include "model.h"
#include "modelfile.h"
#include "qt_math.h"
#include "test_util.h"
#include "tiny_model.h"

typedef struct lora_fix_spec {
    int32_t r;       /* the config's r, and every tensor's rank unless rank_of says */
    double alpha;    /* lora_alpha */
    bool use_rslora; /* written as use_rslora */
    st_dtype dtype;  /* of A and B: ST_F32, ST_F16, ST_BF16 (ST_F64 to try a refusal) */
    /* projections written, and listed in target_modules: bit (1u << eng_proj);
     * 0: all seven */
    uint32_t projs;
    uint64_t layers;                         /* layers written: bit l; 0: every layer */
    bool (*skip)(int32_t layer, eng_proj p); /* modules left out of the file (NULL: none) */
    /* target_modules as JSON text, verbatim ("\".*\\\\.q_proj\"", "\"all-linear\"",
     * "[\"q_proj\"]", "null"); NULL: the list of the written projections' names */
    const char *target_modules;
    const char *rank_pattern;  /* a JSON object, verbatim; NULL: {} */
    const char *alpha_pattern; /* a JSON object, verbatim; NULL: {} */
    /* the rank module (layer, p) is written with; NULL: r. Pair it with
     * rank_pattern to test the loader's reading, or leave rank_pattern
     * empty to write a shape the config does not allow. */
    int32_t (*rank_of)(int32_t layer, eng_proj p);
    const char *base_model; /* base_model_name_or_path; NULL: null */
    /* more members of adapter_config.json, verbatim, comma-separated, no
     * braces: "\"use_dora\": true, \"bias\": \"all\"". A member named twice
     * is read by cJSON as its first occurrence: extra comes first. */
    const char *extra;
    const char *prefix;            /* of every key; NULL: "base_model.model." */
    bool adapter_name_in_keys;     /* "lora_A.default.weight", as a raw state_dict */
    const char *const *extra_keys; /* more tensors (F32 [2, 2], zero), for refusals */
    size_t n_extra_keys;
    const char *omit_key; /* a key left out of the file */
    uint64_t seed;
    float std; /* A and B ~ N(0, std) */
    /* one element replaced by poison_value (NaN, Inf) */
    bool poison;
    int32_t poison_layer;
    eng_proj poison_proj;
    bool poison_b;
    int64_t poison_index;
    float poison_value;
} lora_fix_spec;

static inline lora_fix_spec lora_fix_default(void)
{
    return (lora_fix_spec){.r = 8, .alpha = 16, .dtype = ST_F32, .seed = 7, .std = 0.05f};
}

/* A suite's scratch folders: dir (a fresh temporary one), dir/model
 * (made) and dir/adapter (named only; lora_fix_write makes it). */
static inline void lora_fix_dirs(char *dir, size_t dir_len, char *model_dir, size_t model_len,
                                 char *adapter_dir, size_t adapter_len)
{
    test_tmpdir(dir, dir_len);
    cr_assert(dir[0]);
    snprintf(model_dir, model_len, "%s/model", dir);
    snprintf(adapter_dir, adapter_len, "%s/adapter", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
}

/* The tiny model's config as the loader would read it (tiny_model.h). */
static inline eng_config lora_fix_config(const tiny_spec *t)
{
    eng_config c = {0};
    c.arch = ENG_ARCH_LLAMA;
    c.vocab_size = t->vocab;
    c.hidden_size = t->hidden;
    c.intermediate_size = t->inter;
    c.n_layers = t->layers;
    c.n_heads = t->heads;
    c.n_kv_heads = t->kv_heads;
    c.head_dim = t->hidden / t->heads;
    return c;
}

/* Projection p's weight shape, [out, in], in layer l of a model of config c. */
static inline void lora_fix_proj_shape(const eng_config *c, int32_t l, eng_proj p, int64_t *out,
                                       int64_t *in)
{
    /* the layer's own heads (Gemma 4's full layers) */
    int64_t h = c->hidden_size, q = (int64_t)c->n_heads * eng_layer_head_dim(c, l),
            kv = (int64_t)eng_layer_kv_heads(c, l) * eng_layer_head_dim(c, l),
            ff = eng_layer_ff(c, l);
    switch (p) {
    case ENG_PROJ_PLE_GATE: *out = c->g4.ple_dim, *in = h; break;
    case ENG_PROJ_PLE_PROJ: *out = h, *in = c->g4.ple_dim; break;
    case ENG_PROJ_Q: *out = q, *in = h; break;
    case ENG_PROJ_K:
    case ENG_PROJ_V: *out = kv, *in = h; break;
    case ENG_PROJ_O: *out = h, *in = q; break;
    case ENG_PROJ_GATE:
    case ENG_PROJ_UP: *out = ff, *in = h; break;
    default: *out = h, *in = ff; break;
    }
}

static inline int32_t lora_fix_rank(const lora_fix_spec *s, int32_t layer, eng_proj p)
{
    return s->rank_of ? s->rank_of(layer, p) : s->r;
}

/* The key of layer's projection p's A (b false) or B, as the spec writes it. */
static inline void lora_fix_key(char *buf, size_t len, const lora_fix_spec *s, int32_t layer,
                                eng_proj p, bool b)
{
    char path[96];
    snprintf(buf, len, "%smodel.layers.%d.%s.lora_%c%s.weight",
             s->prefix ? s->prefix : "base_model.model.", layer,
             eng_proj_path(p, path, sizeof path), b ? 'B' : 'A',
             s->adapter_name_in_keys ? ".default" : "");
}

/* Element i of layer's projection p's A or B, as stored (rounded to the
 * spec's dtype; poison included). */
static inline float lora_fix_value(const lora_fix_spec *s, int32_t layer, eng_proj p, bool b,
                                   int64_t i)
{
    if (s->poison && layer == s->poison_layer && p == s->poison_proj && b == s->poison_b &&
        i == s->poison_index)
        return s->poison_value;
    uint64_t st = s->seed * 0x9e3779b97f4a7c15ull ^ ((uint64_t)layer << 40) ^ ((uint64_t)p << 33) ^
                  ((uint64_t)b << 32) ^ (uint64_t)i;
    test_rand(&st); /* decorrelate neighbouring states */
    float v = s->std * test_normal(&st);
    if (s->dtype == ST_F16)
        return qm_f16_to_f32(qm_f32_to_f16(v));
    if (s->dtype == ST_BF16)
        return qm_bf16_to_f32(qm_f32_to_bf16(v));
    return v;
}

static inline void lora_fix_add(st_writer *w, const lora_fix_spec *s, const char *key,
                                int32_t layer, eng_proj p, bool b, int64_t rows, int64_t cols)
{
    if (s->omit_key && strcmp(key, s->omit_key) == 0)
        return;
    int64_t n = rows * cols;
    size_t es = st_dtype_size(s->dtype);
    uint8_t *buf = malloc((size_t)n * es + 1);
    for (int64_t i = 0; i < n; i++) {
        float v = lora_fix_value(s, layer, p, b, i);
        if (s->dtype == ST_F32) {
            memcpy(buf + i * 4, &v, 4);
        } else if (s->dtype == ST_F64) {
            double d = v;
            memcpy(buf + i * 8, &d, 8);
        } else {
            uint16_t h = s->dtype == ST_F16 ? qm_f32_to_f16(v) : qm_f32_to_bf16(v);
            memcpy(buf + i * 2, &h, 2);
        }
    }
    int64_t shape[2] = {rows, cols};
    char msg[256];
    cr_assert_eq(
        st_writer_add(w, key, s->dtype, 2, shape, buf, (size_t)n * es, true, msg, sizeof msg), 0,
        "%s", msg);
    free(buf);
}

/* Write the adapter folder folder (created when missing) for a model of
 * config c. */
static inline void lora_fix_write(const char *folder, const eng_config *c, const lora_fix_spec *s)
{
    mkdir(folder, 0700);
    uint32_t projs = s->projs ? s->projs : (1u << ENG_N_PROJ) - 1;
    char targets[256] = "[";
    for (int p = 0; p < ENG_N_PROJ; p++)
        if (projs & (1u << p)) {
            size_t n = strlen(targets);
            snprintf(targets + n, sizeof targets - n, "%s\"%s\"", n > 1 ? ", " : "",
                     eng_proj_name((eng_proj)p));
        }
    strcat(targets, "]");
    char base[300] = "null";
    if (s->base_model)
        snprintf(base, sizeof base, "\"%s\"", s->base_model);
    size_t cap = 4096 + (s->extra ? strlen(s->extra) : 0) +
                 (s->target_modules ? strlen(s->target_modules) : 0) +
                 (s->rank_pattern ? strlen(s->rank_pattern) : 0) +
                 (s->alpha_pattern ? strlen(s->alpha_pattern) : 0);
    char *cfg = malloc(cap);
    /* the members PEFT 0.21 writes that matter here, in its order */
    snprintf(cfg, cap,
             "{%s%s\"alpha_pattern\": %s, \"base_model_name_or_path\": %s, \"bias\": \"none\", "
             "\"fan_in_fan_out\": false, \"inference_mode\": true, \"init_lora_weights\": true, "
             "\"layers_pattern\": null, \"layers_to_transform\": null, \"lora_alpha\": %.17g, "
             "\"lora_dropout\": 0.0, \"modules_to_save\": null, \"peft_type\": \"LORA\", "
             "\"r\": %d, \"rank_pattern\": %s, \"target_modules\": %s, \"task_type\": "
             "\"CAUSAL_LM\", \"use_dora\": false, \"use_rslora\": %s}",
             s->extra ? s->extra : "", s->extra ? ", " : "",
             s->alpha_pattern ? s->alpha_pattern : "{}", base, s->alpha, s->r,
             s->rank_pattern ? s->rank_pattern : "{}",
             s->target_modules ? s->target_modules : targets, s->use_rslora ? "true" : "false");
    char path[1024];
    snprintf(path, sizeof path, "%s/adapter_config.json", folder);
    test_write_text(path, cfg);
    free(cfg);

    st_writer *w = st_writer_new();
    for (int32_t l = 0; l < c->n_layers; l++) {
        if (s->layers && !(s->layers & (1ull << l)))
            continue;
        for (int p = 0; p < ENG_N_PROJ; p++) {
            if (!(projs & (1u << p)) || (s->skip && s->skip(l, (eng_proj)p)))
                continue;
            int64_t out, in;
            lora_fix_proj_shape(c, l, (eng_proj)p, &out, &in);
            int32_t r = lora_fix_rank(s, l, (eng_proj)p);
            char key[256];
            lora_fix_key(key, sizeof key, s, l, (eng_proj)p, false);
            lora_fix_add(w, s, key, l, (eng_proj)p, false, r, in);
            lora_fix_key(key, sizeof key, s, l, (eng_proj)p, true);
            lora_fix_add(w, s, key, l, (eng_proj)p, true, out, r);
        }
    }
    for (size_t i = 0; i < s->n_extra_keys; i++) {
        float zero[4] = {0};
        int64_t shape[2] = {2, 2};
        char msg[256];
        cr_assert_eq(st_writer_add(w, s->extra_keys[i], ST_F32, 2, shape, zero, sizeof zero, true,
                                   msg, sizeof msg),
                     0, "%s", msg);
    }
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", folder);
    char msg[512];
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
}

/* The adapter folder dir/name (name NULL: dir itself) for the tiny model
 * of spec `model` (NULL: tiny_default(), the model the server tests serve),
 * written as s says (NULL: lora_fix_default()): the one adapter writer of
 * the tests that serve or load the tiny model. */
static inline void lora_fix_write_tiny(const char *dir, const char *name, const tiny_spec *model,
                                       const lora_fix_spec *s)
{
    char folder[990]; /* lora_fix_write joins file names to it in 1024 */
    int n = name ? snprintf(folder, sizeof folder, "%s/%s", dir, name)
                 : snprintf(folder, sizeof folder, "%s", dir);
    cr_assert(n > 0 && (size_t)n < sizeof folder, "adapter folder %s/%s: too long", dir,
              name ? name : "");
    tiny_spec spec = model ? *model : tiny_default();
    eng_config cfg = lora_fix_config(&spec);
    lora_fix_spec fallback = lora_fix_default();
    lora_fix_write(folder, &cfg, s ? s : &fallback);
}

/*
 * llama.cpp's convert_hf_to_gguf.py LlamaModel.permute(w, n_head, n_head_kv):
 * w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows,
 * cols), with n_head_kv in place of n_head when given and different (so k
 * uses the kv head count). dst row h*d + 2j + i = src row h*d + i*d/2 + j.
 */
static inline void lora_fix_permute_rows(const float *src, float *dst, int64_t rows, int64_t cols,
                                         int32_t heads)
{
    int64_t d = rows / heads, half = d / 2;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < half; j++)
            for (int64_t i = 0; i < 2; i++)
                memcpy(dst + (h * d + 2 * j + i) * cols, src + (h * d + i * half + j) * cols,
                       (size_t)cols * sizeof *dst);
}

static inline void lora_fix_gguf_tensor(gguf_writer *w, const char *name, const qtensor *t,
                                        int32_t permute_heads)
{
    size_t n = (size_t)(t->rows * t->cols);
    float *v = malloc(n * sizeof *v), *p = NULL;
    qt_dequantize_rows(t, 0, t->rows, v);
    if (permute_heads) {
        p = malloc(n * sizeof *p);
        lora_fix_permute_rows(v, p, t->rows, t->cols, permute_heads);
    }
    int64_t ne[2] = {t->cols, t->rows};
    int n_dims = t->rows == 1 ? 1 : 2;
    cr_assert_eq(
        gguf_writer_add_tensor(w, name, GGML_TYPE_F32, n_dims, ne, p ? p : v, n * sizeof *v), 0,
        "%s", name);
    free(v);
    free(p);
}

/*
 * A loaded tiny Hugging Face llama model (tiny_model.h: its tokenizer is
 * the tiny one) as a llama GGUF, every tensor f32, q/k rows permuted as
 * llama.cpp's converter permutes them, general.name = name, in a writer a
 * test may add to before writing it (then gguf_writer_free). Loaded back,
 * its forward pass is the HF model's (rope pairs (2i, 2i+1) on the permuted
 * rows instead of (i, i + d/2)). name NULL: no general.name.
 */
static inline gguf_writer *lora_fix_llama_gguf(const eng_model *hf, const char *name)
{
    const eng_config *c = &hf->cfg;
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_str(w, "general.architecture", "llama");
    if (name)
        gguf_writer_set_str(w, "general.name", name);
    gguf_writer_set_u32(w, "llama.context_length", (uint32_t)c->max_position_embeddings);
    gguf_writer_set_u32(w, "llama.embedding_length", (uint32_t)c->hidden_size);
    gguf_writer_set_u32(w, "llama.feed_forward_length", (uint32_t)c->intermediate_size);
    gguf_writer_set_u32(w, "llama.block_count", (uint32_t)c->n_layers);
    gguf_writer_set_u32(w, "llama.attention.head_count", (uint32_t)c->n_heads);
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", (uint32_t)c->n_kv_heads);
    gguf_writer_set_u32(w, "llama.attention.key_length", (uint32_t)c->head_dim);
    gguf_writer_set_f32(w, "llama.rope.freq_base", c->rope_theta);
    gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", c->rms_norm_eps);
    gguf_writer_set_u32(w, "llama.rope.dimension_count", (uint32_t)c->head_dim);
    tiny_gguf_tokenizer(w);

    lora_fix_gguf_tensor(w, "token_embd.weight", &hf->embed, 0);
    lora_fix_gguf_tensor(w, "output_norm.weight", &hf->norm, 0);
    if (hf->lm_head.rows)
        lora_fix_gguf_tensor(w, "output.weight", &hf->lm_head, 0);
    char key[128];
    for (int32_t l = 0; l < c->n_layers; l++) {
        const eng_layer *L = &hf->layers[l];
        const struct {
            const char *name;
            const qtensor *t;
            int32_t heads;
        } parts[] = {
            {"attn_norm.weight", &L->attn_norm, 0}, {"ffn_norm.weight", &L->ffn_norm, 0},
            {"attn_q.weight", &L->wq, c->n_heads},  {"attn_k.weight", &L->wk, c->n_kv_heads},
            {"attn_v.weight", &L->wv, 0},           {"attn_output.weight", &L->wo, 0},
            {"ffn_gate.weight", &L->w_gate, 0},     {"ffn_up.weight", &L->w_up, 0},
            {"ffn_down.weight", &L->w_down, 0},
        };
        for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) {
            snprintf(key, sizeof key, "blk.%d.%s", l, parts[i].name);
            lora_fix_gguf_tensor(w, key, parts[i].t, parts[i].heads);
        }
    }
    return w;
}

/* The same, written to path. */
static inline void lora_fix_write_llama_gguf(const char *path, const eng_model *hf,
                                             const char *name)
{
    gguf_writer *w = lora_fix_llama_gguf(hf, name);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
}

/* A weight version with `terms` (up to 4) merged into every projection
 * they target, built through the merge dispatch as the registry builds it,
 * into kind `into` (QT_KIND_COUNT: each weight's own); the caller
 * eng_weights_unref's it. */
static inline eng_weights *lora_fix_merged_version(const eng_model *m, const eng_lora_term *terms,
                                                   size_t n, qt_kind into)
{
    char msg[512];
    eng_weights *v = NULL;
    cr_assert_eq(eng_weights_new(&v, m, 1, msg, sizeof msg), 0, "%s", msg);
    lora_merge_opts o = {.safe_merge = true, .into = into};
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        for (int p = 0; p < eng_n_proj(&m->cfg); p++) {
            lora_part parts[4];
            size_t np = 0;
            for (size_t t = 0; t < n; t++) {
                const eng_lora_module *mod = eng_lora_module_at(terms[t].lora, l, (eng_proj)p);
                if (mod)
                    parts[np++] = (lora_part){terms[t].lora->name, mod, terms[t].scale};
            }
            if (!np)
                continue;
            const qtensor *w = eng_model_proj(m, l, (eng_proj)p);
            const lora_ops *ops = NULL;
            cr_assert_eq(lora_dispatch(w, &ops, msg, sizeof msg), 0, "%s", msg);
            qtensor merged;
            lora_cost cost;
            cr_assert_eq(ops->merge(w, parts, np, &o, "module", &merged, &cost, msg, sizeof msg), 0,
                         "%s", msg);
            cr_assert_eq(merged.kind, into == QT_KIND_COUNT ? w->kind : into);
            eng_weights_set(v, l, (eng_proj)p, &merged);
        }
    }
    cr_assert_eq(eng_weights_set_merged(v, terms, n, msg, sizeof msg), 0);
    return v;
}

#endif

/*
 * tiny_model.h - tests build their own models: a tiny Llama-family model of
 * random weights, written as a Hugging Face folder (config.json, one or
 * several safetensors shards, tokenizer.json) or as a GGUF file, with a
 * byte-level tokenizer of 256 byte tokens, a few merges and <|endoftext|>.
 */
#ifndef QL_TINY_MODEL_H
#define QL_TINY_MODEL_H

#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_writer.h"
#include "model.h"
#include "modelfile.h"
#include "qt_math.h"
#include "scheduler.h"
#include "test_kquant.h"
#include "test_util.h"

typedef struct tiny_spec {
    const char *arch; /* "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM" */
    int vocab, hidden, inter, layers, heads, kv_heads;
    bool tie;
    st_dtype dtype; /* F32, F16 or BF16 */
    int shards;     /* 1: model.safetensors; more: an index and that many shards */
    uint64_t seed;
    /* GGUF only: the types llama-quantize's Q4_K_M mixes, by tensor as it
     * does (token_embd and most linears q4_k, attn_v, ffn_down and output
     * q6_k, attn_k q5_0, attn_q q8_0) instead of one kind for every
     * linear; needs hidden, heads * head_dim and inter multiples of 256 */
    bool q4_k_m_mix;
    /* GGUF only: a linear whose kind has blocks of 256 but whose rows do
     * not hold whole ones is written IQ4_NL instead, as llama-quantize
     * falls back (for IQ4_XS, and in earlier versions for Q2_K and Q3_K) */
    bool iq4_nl_fallback;
} tiny_spec;

static inline tiny_spec tiny_default(void)
{
    return (tiny_spec){.arch = "LlamaForCausalLM",
                       .vocab = 260,
                       .hidden = 64,
                       .inter = 96,
                       .layers = 2,
                       .heads = 4,
                       .kv_heads = 2,
                       .tie = false,
                       .dtype = ST_BF16,
                       .shards = 1,
                       .seed = 1};
}

/* GPT-2's byte-to-unicode map: printable bytes stand for themselves, the
 * rest shift to U+0100 upward. Writes the UTF-8 of byte b's symbol. */
static inline void tiny_byte_symbol(int b, char out[4])
{
    int cp;
    if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) {
        cp = b;
    } else {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= '!' && x <= '~') || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff)))
                n++;
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

/* The tiny tokenizer's vocabulary: 256 bytes, then "Ġt", "he", "Ġthe"
 * (ids 256..258) by merges, then <|endoftext|> (259). */
#define TINY_N_MERGES 3
static const char *const tiny_merges[TINY_N_MERGES] = {"\xc4\xa0 t", "h e", "\xc4\xa0t he"};
static const char *const tiny_merged[TINY_N_MERGES] = {"\xc4\xa0t", "he", "\xc4\xa0the"};

static inline void tiny_write_tokenizer_json(const char *path)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int b = 0; b < 256; b++) {
        char sym[4];
        tiny_byte_symbol(b, sym);
        cJSON_AddNumberToObject(vocab, sym, b);
    }
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    for (int i = 0; i < TINY_N_MERGES; i++) {
        cJSON_AddNumberToObject(vocab, tiny_merged[i], 256 + i);
        cJSON_AddItemToArray(merges, cJSON_CreateString(tiny_merges[i]));
    }
    cJSON *pre = cJSON_AddObjectToObject(root, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "ByteLevel");
    cJSON_AddFalseToObject(pre, "add_prefix_space");
    cJSON_AddTrueToObject(pre, "trim_offsets");
    cJSON_AddTrueToObject(pre, "use_regex");
    cJSON *dec = cJSON_AddObjectToObject(root, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    cJSON *eot = cJSON_CreateObject();
    cJSON_AddNumberToObject(eot, "id", 259);
    cJSON_AddStringToObject(eot, "content", "<|endoftext|>");
    cJSON_AddTrueToObject(eot, "special");
    cJSON_AddItemToArray(added, eot);
    char *text = cJSON_Print(root);
    FILE *f = fopen(path, "wb");
    cr_assert(f, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
    free(text);
    cJSON_Delete(root);
}

#ifdef QL_FIXTURES
/* The checked-in fixture folder tests/fixtures/<name> (config.json and
 * model.safetensors, as transformers saved them) copied into dir, with the
 * tiny byte-level tokenizer (the fixtures' tests feed ids, so any 260-token
 * vocabulary does). */
static inline void tiny_fixture_folder(const char *name, const char *dir)
{
    char from[1024], to[1024];
    const char *files[] = {"config.json", "model.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/%s/%s", QL_FIXTURES, name, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        copy_file(from, to);
    }
    snprintf(to, sizeof to, "%s/tokenizer.json", dir);
    tiny_write_tokenizer_json(to);
}
#endif

/* Random values of shape [rows, cols] (cols 0: 1-D) in the spec's dtype. */
static inline void tiny_add(st_writer *w, const tiny_spec *s, const char *name, int64_t rows,
                            int64_t cols, bool norm, uint64_t *rng)
{
    int64_t n = cols ? rows * cols : rows;
    size_t es = st_dtype_size(s->dtype);
    uint8_t *buf = malloc((size_t)n * es);
    for (int64_t i = 0; i < n; i++) {
        float v = norm ? 1.0f + 0.01f * test_normal(rng) : 0.02f * test_normal(rng);
        if (s->dtype == ST_F32) {
            memcpy(buf + i * 4, &v, 4);
        } else {
            uint16_t h = s->dtype == ST_F16 ? qm_f32_to_f16(v) : qm_f32_to_bf16(v);
            memcpy(buf + i * 2, &h, 2);
        }
    }
    int64_t shape[2] = {rows, cols};
    char msg[256];
    cr_assert_eq(st_writer_add(w, name, s->dtype, cols ? 2 : 1, shape, buf, (size_t)n * es, true,
                               msg, sizeof msg),
                 0, "%s", msg);
    free(buf);
}

/* Write the folder: config.json, weights, tokenizer.json. */
static inline void tiny_write_hf(const char *dir, const tiny_spec *s)
{
    char path[1024];
    bool qwen = strcmp(s->arch, "Qwen2ForCausalLM") == 0;
    int head_dim = s->hidden / s->heads;
    snprintf(path, sizeof path, "%s/config.json", dir);
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"%s\"], \"vocab_size\": %d, \"hidden_size\": %d, "
             "\"intermediate_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d, "
             "\"num_key_value_heads\": %d, \"max_position_embeddings\": 512, \"rope_theta\": "
             "10000.0, \"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": %s, \"bos_token_id\": "
             "259, \"eos_token_id\": 259, \"torch_dtype\": \"bfloat16\"}",
             s->arch, s->vocab, s->hidden, s->inter, s->layers, s->heads, s->kv_heads,
             s->tie ? "true" : "false");
    test_write_text(path, cfg);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    tiny_write_tokenizer_json(path);

    int nw = s->shards < 1 ? 1 : s->shards;
    st_writer **w = calloc((size_t)nw, sizeof *w);
    for (int i = 0; i < nw; i++)
        w[i] = st_writer_new();
    cJSON *map = cJSON_CreateObject();
    uint64_t rng = s->seed;
    int64_t h = s->hidden, q = (int64_t)s->heads * head_dim, kv = (int64_t)s->kv_heads * head_dim;
    int k = 0; /* tensors go round-robin over the shards */
    char name[256], shard[64];
#define TINY_ADD(nm, r, c, norm)                                                                   \
    do {                                                                                           \
        tiny_add(w[k % nw], s, nm, r, c, norm, &rng);                                              \
        snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", k % nw + 1, nw);           \
        cJSON_AddStringToObject(map, nm, shard);                                                   \
        k++;                                                                                       \
    } while (0)
    TINY_ADD("model.embed_tokens.weight", s->vocab, h, false);
    TINY_ADD("model.norm.weight", h, 0, true);
    if (!s->tie)
        TINY_ADD("lm_head.weight", s->vocab, h, false);
    for (int l = 0; l < s->layers; l++) {
        struct {
            const char *suffix;
            int64_t r, c;
            bool norm;
        } parts[] = {
            {"input_layernorm.weight", h, 0, true},
            {"post_attention_layernorm.weight", h, 0, true},
            {"self_attn.q_proj.weight", q, h, false},
            {"self_attn.k_proj.weight", kv, h, false},
            {"self_attn.v_proj.weight", kv, h, false},
            {"self_attn.o_proj.weight", h, q, false},
            {"mlp.gate_proj.weight", s->inter, h, false},
            {"mlp.up_proj.weight", s->inter, h, false},
            {"mlp.down_proj.weight", h, s->inter, false},
            {"self_attn.q_proj.bias", q, 0, false},
            {"self_attn.k_proj.bias", kv, 0, false},
            {"self_attn.v_proj.bias", kv, 0, false},
        };
        size_t n = sizeof parts / sizeof *parts - (qwen ? 0 : 3);
        for (size_t p = 0; p < n; p++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, parts[p].suffix);
            TINY_ADD(name, parts[p].r, parts[p].c, parts[p].norm);
        }
    }
#undef TINY_ADD
    char msg[512];
    for (int i = 0; i < nw; i++) {
        if (nw == 1)
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
        else
            snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, i + 1, nw);
        cr_assert_eq(st_writer_write(w[i], path, msg, sizeof msg), 0, "%s", msg);
        st_writer_free(w[i]);
    }
    free(w);
    if (nw > 1) {
        cJSON *idx = cJSON_CreateObject();
        cJSON_AddItemToObject(idx, "metadata", cJSON_CreateObject());
        cJSON_AddItemToObject(idx, "weight_map", map);
        char *text = cJSON_Print(idx);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        test_write_text(path, text);
        free(text);
        cJSON_Delete(idx);
    } else {
        cJSON_Delete(map);
    }
}

/* The same model as a llama GGUF: linear layers as `linear` (a GGUF block
 * kind or a dense one), embeddings and norms f32, the tokenizer as
 * tokenizer.ggml.* metadata. */
/* The engine tests' fixture: tiny_default() written as a Hugging Face
 * folder in a fresh temporary dir (dir_cap bytes) and loaded into m with
 * NF4 linears; tiny_unload_default undoes both. */
static inline void tiny_load_default(char *dir, size_t dir_cap, eng_model *m)
{
    test_tmpdir(dir, dir_cap);
    tiny_spec s = tiny_default();
    tiny_write_hf(dir, &s);
    eng_load_opts o = {.path = dir, .quant = "nf4"};
    char msg[512];
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

static inline void tiny_unload_default(const char *dir, eng_model *m)
{
    eng_model_free(m);
    test_rmtree(dir);
}

/* A Criterion suite over that fixture: the file's own tiny_dir and
 * tiny_model, loaded before each test and unloaded after it. */
#define TINY_DEFAULT_SUITE(suite, seconds)                                                         \
    static char tiny_dir[512];                                                                     \
    static eng_model tiny_model;                                                                   \
    static void tiny_suite_init(void)                                                              \
    {                                                                                              \
        tiny_load_default(tiny_dir, sizeof tiny_dir, &tiny_model);                                 \
    }                                                                                              \
    static void tiny_suite_fini(void)                                                              \
    {                                                                                              \
        tiny_unload_default(tiny_dir, &tiny_model);                                                \
    }                                                                                              \
    TestSuite(suite, .init = tiny_suite_init, .fini = tiny_suite_fini, .timeout = (seconds))

static inline void tiny_add_gguf(gguf_writer *w, const char *name, int64_t rows, int64_t cols,
                                 qt_kind kind, bool norm, uint64_t *rng)
{
    int64_t n = cols ? rows * cols : rows;
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = norm ? 1.0f + 0.01f * test_normal(rng) : 0.02f * test_normal(rng);
    qtensor t;
    qt_quant_params p = {.kind = kind};
    char msg[256];
    if (test_kquant_is_read_only(kind)) /* no quantizer: random blocks */
        test_random_kquant(&t, kind, cols ? rows : 1, cols ? cols : rows, rng);
    else
        cr_assert_eq(qt_quantize(&t, v, cols ? rows : 1, cols ? cols : rows, &p, msg, sizeof msg),
                     0, "%s: %s", name, msg);
    static const uint32_t ggml[QT_KIND_COUNT] = {
        [QT_F32] = GGML_TYPE_F32,    [QT_F16] = GGML_TYPE_F16,       [QT_BF16] = GGML_TYPE_BF16,
        [QT_Q4_0] = GGML_TYPE_Q4_0,  [QT_Q4_1] = GGML_TYPE_Q4_1,     [QT_Q8_0] = GGML_TYPE_Q8_0,
        [QT_Q5_0] = GGML_TYPE_Q5_0,  [QT_Q5_1] = GGML_TYPE_Q5_1,     [QT_Q4_K] = GGML_TYPE_Q4_K,
        [QT_Q5_K] = GGML_TYPE_Q5_K,  [QT_Q6_K] = GGML_TYPE_Q6_K,     [QT_Q2_K] = GGML_TYPE_Q2_K,
        [QT_Q3_K] = GGML_TYPE_Q3_K,  [QT_IQ4_NL] = GGML_TYPE_IQ4_NL, [QT_IQ4_XS] = GGML_TYPE_IQ4_XS,
        [QT_MXFP4] = GGML_TYPE_MXFP4};
    int64_t ne[2] = {cols ? cols : rows, rows};
    cr_assert_eq(
        gguf_writer_add_tensor(w, name, ggml[kind], cols ? 2 : 1, ne, t.data, t.data_bytes), 0,
        "%s", name);
    qt_free(&t);
    free(v);
}

/* The tiny tokenizer as tokenizer.ggml.* metadata, as llama.cpp's converter
 * writes a gpt2-style one. */
static inline void tiny_gguf_tokenizer(gguf_writer *w)
{
    const char *tokens[260];
    char syms[256][4];
    int32_t types[260];
    for (int b = 0; b < 256; b++) {
        tiny_byte_symbol(b, syms[b]);
        tokens[b] = syms[b];
        types[b] = 1; /* normal */
    }
    for (int i = 0; i < TINY_N_MERGES; i++) {
        tokens[256 + i] = tiny_merged[i];
        types[256 + i] = 1;
    }
    tokens[259] = "<|endoftext|>";
    types[259] = 3; /* control */
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_str(w, "tokenizer.ggml.pre", "gpt-2");
    gguf_writer_set_str_array(w, "tokenizer.ggml.tokens", tokens, 260);
    gguf_writer_set_array(w, "tokenizer.ggml.token_type", GGUF_INT32, types, 260);
    gguf_writer_set_str_array(w, "tokenizer.ggml.merges", tiny_merges, TINY_N_MERGES);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 259);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 259);
    gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false);
}

/* The kind a linear of `cols` columns is written in: kind, or IQ4_NL where
 * the spec asks for the fallback and the rows cannot hold 256-blocks. */
static inline qt_kind tiny_fallback_kind(const tiny_spec *s, qt_kind kind, int64_t cols)
{
    if (s->iq4_nl_fallback && qt_traits_table[kind].block_size == 256 && cols % 256 != 0)
        return QT_IQ4_NL;
    return kind;
}

/* The GGUF file, with more string metadata: meta holds key, value pairs
 * and ends with NULL (meta NULL: none). */
static inline void tiny_write_gguf_meta(const char *path, const tiny_spec *s, qt_kind linear,
                                        const char *const *meta)
{
    gguf_writer *w = gguf_writer_new();
    for (size_t i = 0; meta && meta[i]; i += 2)
        gguf_writer_set_str(w, meta[i], meta[i + 1]);
    int head_dim = s->hidden / s->heads;
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "general.name", "tiny");
    gguf_writer_set_u32(w, "llama.context_length", 512);
    gguf_writer_set_u32(w, "llama.embedding_length", (uint32_t)s->hidden);
    gguf_writer_set_u32(w, "llama.feed_forward_length", (uint32_t)s->inter);
    gguf_writer_set_u32(w, "llama.block_count", (uint32_t)s->layers);
    gguf_writer_set_u32(w, "llama.attention.head_count", (uint32_t)s->heads);
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", (uint32_t)s->kv_heads);
    gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gguf_writer_set_u32(w, "llama.rope.dimension_count", (uint32_t)head_dim);
    tiny_gguf_tokenizer(w);

    uint64_t rng = s->seed;
    int64_t h = s->hidden, q = (int64_t)s->heads * head_dim, kv = (int64_t)s->kv_heads * head_dim;
    bool mix = s->q4_k_m_mix;
    tiny_add_gguf(w, "token_embd.weight", s->vocab, h, mix ? QT_Q4_K : QT_F32, false, &rng);
    tiny_add_gguf(w, "output_norm.weight", h, 0, QT_F32, true, &rng);
    if (!s->tie)
        tiny_add_gguf(w, "output.weight", s->vocab, h,
                      tiny_fallback_kind(s, mix ? QT_Q6_K : linear, h), false, &rng);
    char name[128];
    for (int l = 0; l < s->layers; l++) {
        struct {
            const char *suffix;
            int64_t r, c;
            bool norm;
            qt_kind mixed; /* its type in the Q4_K_M mix */
        } parts[] = {
            {"attn_norm.weight", h, 0, true, QT_F32},
            {"ffn_norm.weight", h, 0, true, QT_F32},
            {"attn_q.weight", q, h, false, QT_Q8_0},
            {"attn_k.weight", kv, h, false, QT_Q5_0},
            {"attn_v.weight", kv, h, false, QT_Q6_K},
            {"attn_output.weight", h, q, false, QT_Q4_K},
            {"ffn_gate.weight", s->inter, h, false, QT_Q4_K},
            {"ffn_up.weight", s->inter, h, false, QT_Q4_K},
            {"ffn_down.weight", h, s->inter, false, QT_Q6_K},
        };
        for (size_t p = 0; p < sizeof parts / sizeof *parts; p++) {
            snprintf(name, sizeof name, "blk.%d.%s", l, parts[p].suffix);
            qt_kind kind = parts[p].norm ? QT_F32 : mix ? parts[p].mixed : linear;
            kind = tiny_fallback_kind(s, kind, parts[p].c);
            tiny_add_gguf(w, name, parts[p].r, parts[p].c, kind, parts[p].norm, &rng);
        }
    }
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
}

static inline void tiny_write_gguf(const char *path, const tiny_spec *s, qt_kind linear)
{
    tiny_write_gguf_meta(path, s, linear, NULL);
}

/* --- holding an engine between steps (eng_engine_gate), never by timing ----------- */

/* Let e run `steps` more steps (-1: open the gate), then hold it there, and
 * wait until it has: its statistics then say what runs and what waits. */
static inline void engine_hold_after(eng_engine *e, int64_t steps)
{
    eng_engine_gate(e, steps);
    cr_assert(eng_engine_settle(e, 120), "the engine never settled at its gate");
}

/* Run e one step at a time until it has generated n tokens in all (a
 * prompt may take several steps), then hold it. */
static inline void engine_step_until_generated(eng_engine *e, uint64_t n)
{
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    for (int i = 0; i < 10000 && st.tokens_generated < n; i++) {
        engine_hold_after(e, 1);
        eng_engine_stats_get(e, &st);
    }
    cr_assert_geq(st.tokens_generated, n, "the engine generated no more tokens");
}

#endif

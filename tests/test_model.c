/*
 * test_model.c - the model loader: tiny Llama-family models made here load
 * from a Hugging Face folder (dense, sharded, quantized on load to every
 * kind), from a bitsandbytes 4-bit folder (never quantized again) and from
 * GGUF (blocks used in place, or requantized to NF4); the default SmolLM2
 * GGUF loads when present; and every kind of bad folder is refused with the
 * file, the tensor and the reason.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "qt_math.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(model, .init = setup, .fini = teardown);

static void load_ok(eng_model *m, const char *path, const char *quant, const char *dtype,
                    bool lm_head)
{
    eng_load_opts o = {.path = path,
                       .quant = quant,
                       .dtype = dtype,
                       .quantize_lm_head = lm_head,
                       .group_size = quant && strncmp(quant, "int", 3) == 0 ? 32 : 0};
    char msg[1024];
    int rc = eng_model_load(m, &o, msg, sizeof msg);
    cr_assert_eq(rc, 0, "load %s (--quant %s): %s", path, quant ? quant : "none", msg);
}

static void load_fails(const char *path, const char *quant, const char *expect1,
                       const char *expect2)
{
    eng_load_opts o = {.path = path, .quant = quant};
    eng_model m;
    char msg[1024] = "";
    cr_assert_neq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s loaded (expected: %s)", path,
                  expect1);
    cr_assert(strstr(msg, expect1), "'%s' lacks '%s'", msg, expect1);
    if (expect2)
        cr_assert(strstr(msg, expect2), "'%s' lacks '%s'", msg, expect2);
}

/* Every element of two tensors, dequantized, the same bits. */
static void assert_same_values(const qtensor *a, const qtensor *b, const char *what)
{
    cr_assert_eq(a->rows, b->rows, "%s rows", what);
    cr_assert_eq(a->cols, b->cols, "%s cols", what);
    size_t n = (size_t)(a->rows * a->cols);
    float *x = malloc(n * 4), *y = malloc(n * 4);
    qt_dequantize_rows(a, 0, a->rows, x);
    qt_dequantize_rows(b, 0, b->rows, y);
    cr_assert_eq(memcmp(x, y, n * 4), 0, "%s differ", what);
    free(x);
    free(y);
}

Test(model, hf_folder_loads_dense_in_place)
{
    tiny_spec s = tiny_default();
    tiny_write_hf(dir, &s);
    eng_model m;
    load_ok(&m, dir, NULL, NULL, false);
    cr_assert_str_eq(m.format, "safetensors");
    cr_assert_eq(m.cfg.arch, ENG_ARCH_LLAMA);
    cr_assert_eq(m.cfg.n_layers, 2);
    cr_assert_eq(m.cfg.n_kv_heads, 2);
    cr_assert_eq(m.cfg.head_dim, 16);
    cr_assert_eq(m.cfg.vocab_size, 260);
    cr_assert_eq(m.cfg.rope_interleaved, false);
    cr_assert_eq(m.layers[1].w_down.kind, QT_BF16);
    cr_assert(m.layers[1].w_down.data_borrowed, "dense weights are used in the mapping");
    cr_assert_eq(m.layers[0].wk.rows, 32);
    cr_assert_eq(m.lm_head.rows, 260);
    cr_assert_eq(m.layers[0].bq.rows, 0, "llama has no q bias");
    cr_assert_eq(tok_vocab_size(m.tok), 260u);
    cr_assert_str_eq(m.quant, "bf16");
    eng_model_free(&m);
}

/* The tokens besides eos that end an answer: config.json's and
 * generation_config.json's eos_token_id lists, each id once, eos left out;
 * a generation_config.json that is not JSON is refused naming it. */
Test(model, every_end_token_of_the_configs_ends_an_answer)
{
    tiny_spec s = tiny_default();
    tiny_write_hf(dir, &s);
    char path[700];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    test_write_text(path, "{\"eos_token_id\": [259, 7, 200, 7], \"do_sample\": true}");
    eng_model m;
    load_ok(&m, dir, NULL, NULL, false);
    cr_assert_eq(m.cfg.eos_token_id, 259);
    cr_assert_eq(m.cfg.n_eog, 2);
    cr_assert_eq(m.cfg.eog_token_ids[0], 7);
    cr_assert_eq(m.cfg.eog_token_ids[1], 200);
    eng_model_free(&m);
    test_write_text(path, "{\"eos_token_id\": [");
    char msg[1024];
    cr_assert_neq(eng_model_load(&m, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "generation_config.json"), "%s", msg);
}

Test(model, quantize_on_load_to_every_kind)
{
    tiny_spec s = tiny_default();
    tiny_write_hf(dir, &s);
    eng_model dense;
    load_ok(&dense, dir, NULL, NULL, false);
    struct {
        const char *quant;
        qt_kind kind;
        qt_quant_params p;
    } cases[] = {
        {"nf4", QT_NF4, {.kind = QT_NF4, .blocksize = 64}},
        {"nf4-dq", QT_NF4, {.kind = QT_NF4, .blocksize = 64, .double_quant = true}},
        {"fp4", QT_FP4, {.kind = QT_FP4, .blocksize = 64}},
        {"int4",
         QT_AFFINE,
         {.kind = QT_AFFINE,
          .bits = 4,
          .group_size = 32,
          .zero_domain = QT_ZERO_FLOAT,
          .eps = 1e-6f}},
        {"int8", QT_AFFINE, {.kind = QT_AFFINE, .bits = 8, .symmetric = true, .group_size = 32}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        eng_model m;
        load_ok(&m, dir, cases[i].quant, NULL, false);
        cr_assert_eq(m.layers[0].wq.kind, cases[i].kind, "%s", cases[i].quant);
        cr_assert_eq(m.layers[1].w_up.kind, cases[i].kind, "%s", cases[i].quant);
        cr_assert_eq(m.embed.kind, QT_BF16, "embeddings stay dense");
        cr_assert_eq(m.layers[0].attn_norm.kind, QT_BF16, "norms stay dense");
        cr_assert_eq(m.lm_head.kind, QT_BF16, "lm_head stays dense by default");
        /* exactly the quantization of the file's weights */
        const qtensor *src = &dense.layers[1].w_down;
        float *w = malloc((size_t)(src->rows * src->cols) * 4);
        qt_dequantize_rows(src, 0, src->rows, w);
        qtensor want;
        char msg[256];
        cr_assert_eq(qt_quantize(&want, w, src->rows, src->cols, &cases[i].p, msg, sizeof msg), 0,
                     "%s", msg);
        assert_same_values(&m.layers[1].w_down, &want, cases[i].quant);
        qt_free(&want);
        free(w);
        eng_model_free(&m);
    }
    eng_model m;
    load_ok(&m, dir, "nf4", NULL, true);
    cr_assert_eq(m.lm_head.kind, QT_NF4, "--quantize-lm-head");
    eng_model_free(&m);
    eng_model_free(&dense);
}

Test(model, dtype_changes_dense_parameters_only)
{
    tiny_spec s = tiny_default();
    tiny_write_hf(dir, &s);
    eng_model a, b;
    load_ok(&a, dir, "nf4-dq", NULL, false);
    load_ok(&b, dir, "nf4-dq", "f32", false);
    cr_assert_eq(b.embed.kind, QT_F32);
    cr_assert_eq(b.layers[0].ffn_norm.kind, QT_F32);
    cr_assert_eq(b.lm_head.kind, QT_F32);
    const qtensor *x = &a.layers[0].wv, *y = &b.layers[0].wv;
    cr_assert_eq(y->kind, QT_NF4);
    cr_assert_eq(memcmp(x->data, y->data, x->data_bytes), 0);
    cr_assert_eq(memcmp(x->nested_absmax, y->nested_absmax, (size_t)x->n_nested_blocks * 4), 0);
    cr_assert(same_bits(x->nested_offset, y->nested_offset));
    assert_same_values(&a.embed, &b.embed, "bf16 -> f32 embeddings keep their values");
    eng_model_free(&a);
    eng_model_free(&b);
}

Test(model, sharded_folder_loads_the_same_weights)
{
    char one[600], three[600];
    snprintf(one, sizeof one, "%s/one", dir);
    snprintf(three, sizeof three, "%s/three", dir);
    cr_assert_eq(mkdir(one, 0700), 0);
    cr_assert_eq(mkdir(three, 0700), 0);
    tiny_spec s = tiny_default();
    tiny_write_hf(one, &s);
    s.shards = 3;
    tiny_write_hf(three, &s);
    eng_model a, b;
    load_ok(&a, one, NULL, NULL, false);
    load_ok(&b, three, NULL, NULL, false);
    cr_assert_eq(b.n_shards, 3u);
    assert_same_values(&a.layers[1].wo, &b.layers[1].wo, "o_proj");
    assert_same_values(&a.embed, &b.embed, "embeddings");
    eng_model_free(&a);
    eng_model_free(&b);

    /* a shard gone */
    char path[700];
    snprintf(path, sizeof path, "%s/model-00002-of-00003.safetensors", three);
    cr_assert_eq(unlink(path), 0);
    load_fails(three, NULL, "shard model-00002-of-00003.safetensors is missing", three);
}

Test(model, tensor_in_two_shards_is_refused)
{
    tiny_spec s = tiny_default();
    s.shards = 2;
    tiny_write_hf(dir, &s);
    /* a third shard, listed in the index, that repeats model.norm.weight */
    char path[700], msg[256];
    snprintf(path, sizeof path, "%s/extra.safetensors", dir);
    st_writer *w = st_writer_new();
    uint16_t v[64] = {0};
    int64_t shape[1] = {64};
    st_writer_add(w, "model.norm.weight", ST_BF16, 1, shape, v, sizeof v, true, msg, sizeof msg);
    st_writer_add(w, "extra.bias", ST_BF16, 1, shape, v, sizeof v, true, msg, sizeof msg);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0);
    st_writer_free(w);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "rb");
    char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    cJSON *idx = cJSON_Parse(text);
    cJSON_AddStringToObject(cJSON_GetObjectItem(idx, "weight_map"), "extra.bias",
                            "extra.safetensors");
    char *out = cJSON_Print(idx);
    test_write_text(path, out);
    free(out);
    cJSON_Delete(idx);
    load_fails(dir, NULL, "tensor 'model.norm.weight' is in both", "extra.safetensors");
}

Test(model, bad_configs_and_tensors_are_refused_by_name)
{
    tiny_spec s = tiny_default();
    tiny_write_hf(dir, &s);
    char cfg[700];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);

    test_write_text(cfg, "{\"architectures\": [\"GPT2LMHeadModel\"], \"vocab_size\": 260}");
    load_fails(dir, NULL, "GPT2LMHeadModel", "config.json");

    test_write_text(cfg, "[1, 2]");
    load_fails(dir, NULL, "config.json: not a JSON object", NULL);

    const char *base = "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 260, "
                       "\"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": "
                       "4, \"num_key_value_heads\": 2, ";
    char text[1024];
    snprintf(text, sizeof text, "%s\"intermediate_size\": 128}", base);
    test_write_text(cfg, text);
    load_fails(dir, NULL, "tensor 'model.layers.0.mlp.gate_proj.weight' is [96, 64]",
               "needs [128, 64]");

    snprintf(text, sizeof text,
             "%s\"intermediate_size\": 96, \"rope_scaling\": {\"rope_type\": "
             "\"dynamic\", \"factor\": 4.0}}",
             base);
    test_write_text(cfg, text);
    load_fails(dir, NULL, "rope_scaling type \"dynamic\"", NULL);

    /* YaRN runs (GPT-OSS) but needs the context it was trained on */
    snprintf(text, sizeof text,
             "%s\"intermediate_size\": 96, \"rope_scaling\": {\"rope_type\": "
             "\"yarn\", \"factor\": 4.0}}",
             base);
    test_write_text(cfg, text);
    load_fails(dir, NULL, "\"original_max_position_embeddings\" is missing", NULL);

    snprintf(text, sizeof text,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 260, \"hidden_size\": "
             "64, \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": "
             "2, \"intermediate_size\": 96}");
    test_write_text(cfg, text);
    load_fails(dir, NULL, "tensor 'model.layers.2.input_layernorm.weight' is missing", NULL);

    snprintf(text, sizeof text, "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 260}");
    test_write_text(cfg, text);
    load_fails(dir, NULL, "\"hidden_size\" is missing", NULL);

    snprintf(text, sizeof text,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 260, \"hidden_size\": "
             "64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": "
             "3, \"intermediate_size\": 96}");
    test_write_text(cfg, text);
    load_fails(dir, NULL, "not a multiple of num_key_value_heads 3", NULL);

    /* a llama3 rope scaling is read */
    snprintf(text, sizeof text,
             "%s\"intermediate_size\": 96, \"rope_scaling\": {\"rope_type\": "
             "\"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
             "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": "
             "8192}}",
             base);
    test_write_text(cfg, text);
    eng_model m;
    load_ok(&m, dir, NULL, NULL, false);
    cr_assert_eq(m.cfg.rope_scaling, ENG_ROPE_LLAMA3);
    cr_assert_eq(m.cfg.rope_factor, 8.0f);
    cr_assert_eq(m.cfg.rope_original_max_position, 8192);
    eng_model_free(&m);

    /* transformers 5 writes rope_theta and the scaling in rope_parameters */
    snprintf(text, sizeof text,
             "%s\"intermediate_size\": 96, \"rope_parameters\": {\"rope_theta\": 500000.0, "
             "\"rope_type\": \"linear\", \"factor\": 2.0}}",
             base);
    test_write_text(cfg, text);
    load_ok(&m, dir, NULL, NULL, false);
    cr_assert_eq(m.cfg.rope_theta, 500000.0f);
    cr_assert_eq(m.cfg.rope_scaling, ENG_ROPE_LINEAR);
    cr_assert_eq(m.cfg.rope_factor, 2.0f);
    eng_model_free(&m);
    snprintf(text, sizeof text,
             "%s\"intermediate_size\": 96, \"rope_parameters\": {\"rope_theta\": 1000.0, "
             "\"rope_type\": \"default\"}}",
             base);
    test_write_text(cfg, text);
    load_ok(&m, dir, NULL, NULL, false);
    cr_assert_eq(m.cfg.rope_theta, 1000.0f);
    cr_assert_eq(m.cfg.rope_scaling, ENG_ROPE_NONE);
    eng_model_free(&m);

    /* a norm stored as integers */
    snprintf(text, sizeof text, "%s\"intermediate_size\": 96}", base);
    test_write_text(cfg, text);
    char path[700], msg[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0);
    st_writer *w = st_writer_new();
    for (size_t i = 0; i < f.n_tensors; i++) {
        const st_tensor *t = &f.tensors[i];
        bool bad = strcmp(t->name, "model.norm.weight") == 0;
        st_writer_add(w, t->name, bad ? ST_I16 : t->dtype, t->ndim, t->shape, t->data, t->nbytes,
                      true, msg, sizeof msg);
    }
    st_close(&f);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0);
    st_writer_free(w);
    load_fails(dir, NULL, "tensor 'model.norm.weight' is I16", "model.safetensors");
    load_fails(dir, "q9", "--quant q9", NULL);
}

Test(model, qwen2_has_attention_biases)
{
    tiny_spec s = tiny_default();
    s.arch = "Qwen2ForCausalLM";
    s.tie = true;
    tiny_write_hf(dir, &s);
    eng_model m;
    load_ok(&m, dir, "nf4", NULL, false);
    cr_assert_eq(m.cfg.arch, ENG_ARCH_QWEN2);
    cr_assert(m.cfg.attention_bias);
    cr_assert_eq(m.layers[1].bk.cols, 32);
    cr_assert_eq(m.layers[1].bk.kind, QT_BF16, "biases stay dense");
    cr_assert_eq(m.lm_head.rows, 0, "tied: no separate lm_head");
    eng_model_free(&m);
}

/* A folder as transformers saves a bitsandbytes 4-bit model: linear layers
 * serialized by bitsandbytes, the rest dense, quantization_config set. */
static void write_bnb_folder(const char *src, const char *dst, bool nested)
{
    eng_model m;
    load_ok(&m, src, nested ? "nf4-dq" : "nf4", NULL, false);
    char path[700], msg[512];
    snprintf(path, sizeof path, "%s/config.json", dst);
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 260, \"hidden_size\": "
             "64, \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": "
             "4, \"num_key_value_heads\": 2, \"quantization_config\": {\"quant_method\": "
             "\"bitsandbytes\", \"load_in_4bit\": true, \"bnb_4bit_quant_type\": \"nf4\", "
             "\"bnb_4bit_use_double_quant\": %s, \"llm_int8_skip_modules\": [\"lm_head\"]}}",
             nested ? "true" : "false");
    test_write_text(path, cfg);
    snprintf(path, sizeof path, "%s/tokenizer.json", dst);
    tiny_write_tokenizer_json(path);
    st_writer *w = st_writer_new();
    int64_t shape2[2] = {260, 64}, shape1[1] = {64};
    st_writer_add(w, "model.embed_tokens.weight", ST_BF16, 2, shape2, m.embed.data,
                  m.embed.data_bytes, true, msg, sizeof msg);
    st_writer_add(w, "lm_head.weight", ST_BF16, 2, shape2, m.lm_head.data, m.lm_head.data_bytes,
                  true, msg, sizeof msg);
    st_writer_add(w, "model.norm.weight", ST_BF16, 1, shape1, m.norm.data, m.norm.data_bytes, true,
                  msg, sizeof msg);
    for (int l = 0; l < 2; l++) {
        eng_layer *ly = &m.layers[l];
        struct {
            const char *suffix;
            qtensor *t;
        } parts[] = {{"self_attn.q_proj.weight", &ly->wq},  {"self_attn.k_proj.weight", &ly->wk},
                     {"self_attn.v_proj.weight", &ly->wv},  {"self_attn.o_proj.weight", &ly->wo},
                     {"mlp.gate_proj.weight", &ly->w_gate}, {"mlp.up_proj.weight", &ly->w_up},
                     {"mlp.down_proj.weight", &ly->w_down}};
        char name[128];
        for (size_t p = 0; p < sizeof parts / sizeof *parts; p++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, parts[p].suffix);
            cr_assert_eq(bnb_write(w, name, parts[p].t, "bfloat16", msg, sizeof msg), 0, "%s", msg);
        }
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        st_writer_add(w, name, ST_BF16, 1, shape1, ly->attn_norm.data, 128, true, msg, 256);
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        st_writer_add(w, name, ST_BF16, 1, shape1, ly->ffn_norm.data, 128, true, msg, 256);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dst);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
    eng_model_free(&m);
}

Test(model, bitsandbytes_folder_loads_without_requantizing)
{
    char src[600], bnb[600];
    snprintf(src, sizeof src, "%s/dense", dir);
    snprintf(bnb, sizeof bnb, "%s/bnb", dir);
    cr_assert_eq(mkdir(src, 0700), 0);
    cr_assert_eq(mkdir(bnb, 0700), 0);
    tiny_spec s = tiny_default();
    tiny_write_hf(src, &s);
    write_bnb_folder(src, bnb, true);

    eng_model ref, m, again;
    load_ok(&ref, src, "nf4-dq", NULL, false);
    load_ok(&m, bnb, NULL, NULL, false);
    cr_assert_str_eq(m.format, "bitsandbytes-4bit");
    cr_assert_eq(m.layers[0].w_gate.kind, QT_NF4);
    cr_assert(m.layers[0].w_gate.nested);
    cr_assert_eq(
        memcmp(m.layers[0].w_gate.data, ref.layers[0].w_gate.data, ref.layers[0].w_gate.data_bytes),
        0);
    cr_assert_eq(m.lm_head.kind, QT_BF16, "skipped module stays dense");
    /* --quant never quantizes an already quantized weight again */
    load_ok(&again, bnb, "int8", NULL, false);
    cr_assert_eq(again.layers[1].wo.kind, QT_NF4);
    assert_same_values(&again.layers[1].wo, &ref.layers[1].wo, "o_proj");
    cr_assert_eq(again.lm_head.kind, QT_BF16);
    eng_model_free(&ref);
    eng_model_free(&m);
    eng_model_free(&again);
}

Test(model, gguf_loads_blocks_in_place_and_requantizes)
{
    char path[700];
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    tiny_spec s = tiny_default();
    s.tie = true;
    tiny_write_gguf(path, &s, QT_Q4_0);
    eng_model m, q;
    load_ok(&m, path, NULL, NULL, false);
    cr_assert_str_eq(m.format, "gguf");
    cr_assert_eq(m.cfg.arch, ENG_ARCH_LLAMA);
    cr_assert(m.cfg.rope_interleaved, "llama GGUF q/k rows are permuted");
    cr_assert(m.cfg.tie_word_embeddings);
    cr_assert_eq(m.cfg.vocab_size, 260);
    cr_assert_eq(m.cfg.n_kv_heads, 2);
    cr_assert_eq(m.layers[0].wq.kind, QT_Q4_0);
    cr_assert(m.layers[0].wq.data_borrowed, "GGUF blocks are used in the mapping");
    cr_assert_eq(m.embed.kind, QT_F32);
    cr_assert_eq(m.cfg.eos_token_id, 259);
    cr_assert_eq(tok_vocab_size(m.tok), 260u);

    load_ok(&q, path, "nf4", NULL, false);
    cr_assert_eq(q.layers[1].w_down.kind, QT_NF4);
    const qtensor *src = &m.layers[1].w_down;
    float *w = malloc((size_t)(src->rows * src->cols) * 4);
    qt_dequantize_rows(src, 0, src->rows, w);
    qtensor want;
    qt_quant_params p = {.kind = QT_NF4, .blocksize = 64};
    char msg[256];
    cr_assert_eq(qt_quantize(&want, w, src->rows, src->cols, &p, msg, sizeof msg), 0);
    assert_same_values(&q.layers[1].w_down, &want, "requantized from q4_0");
    qt_free(&want);
    free(w);
    eng_model_free(&m);
    eng_model_free(&q);
}

Test(model, default_smollm2_gguf_loads, .timeout = 120)
{
    char path[1024];
    if (!test_default_model_path(path, sizeof path))
        test_cannot_run("%s is absent: scripts/fetch-model.sh puts it there", path);
    eng_model m;
    load_ok(&m, path, NULL, NULL, false);
    cr_assert_eq(m.cfg.arch, ENG_ARCH_LLAMA);
    cr_assert_eq(m.cfg.n_layers, 30);
    cr_assert_eq(m.cfg.hidden_size, 576);
    cr_assert_eq(m.cfg.n_heads, 9);
    cr_assert_eq(m.cfg.n_kv_heads, 3);
    cr_assert_eq(m.cfg.head_dim, 64);
    cr_assert_eq(m.cfg.intermediate_size, 1536);
    cr_assert_eq(m.cfg.vocab_size, 49152);
    cr_assert(m.cfg.tie_word_embeddings);
    cr_assert_eq(m.layers[7].wq.kind, QT_Q4_1);
    cr_assert_eq(m.embed.kind, QT_Q8_0);
    cr_assert_eq(tok_vocab_size(m.tok), 49152u);
    eng_model_free(&m);
}

/* A folder whose weights `qlserve quantize` wrote (every 2-D tensor NF4,
 * embeddings and lm_head included) loads as a bitsandbytes checkpoint, as
 * it is, and computes. */
Test(model, a_folder_quantized_by_qlserve_loads_as_stored)
{
    char src[600], q[600], path[700], out[700], msg[512];
    snprintf(src, sizeof src, "%s/dense", dir);
    snprintf(q, sizeof q, "%s/quantized", dir);
    cr_assert_eq(mkdir(src, 0700), 0);
    cr_assert_eq(mkdir(q, 0700), 0);
    tiny_spec s = tiny_default();
    tiny_write_hf(src, &s);
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    snprintf(out, sizeof out, "%s/model.safetensors", q);
    eng_quantize_opts qo = {.in_path = path, .out_path = out, .kind = "nf4", .double_quant = true};
    cr_assert_eq(eng_quantize_file(&qo, NULL, msg, sizeof msg), 0, "%s", msg);
    snprintf(path, sizeof path, "%s/config.json", q);
    test_write_text(path, "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 260, "
                          "\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": "
                          "2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
                          "\"quantization_config\": {\"quant_method\": \"bitsandbytes\", "
                          "\"load_in_4bit\": true, \"bnb_4bit_quant_type\": \"nf4\", "
                          "\"bnb_4bit_use_double_quant\": true}}");
    snprintf(path, sizeof path, "%s/tokenizer.json", q);
    tiny_write_tokenizer_json(path);
    eng_model m, ref;
    load_ok(&m, q, NULL, NULL, false);
    load_ok(&ref, src, "nf4-dq", NULL, true);
    cr_assert_eq(m.embed.kind, QT_NF4);
    cr_assert_eq(m.lm_head.kind, QT_NF4);
    cr_assert_eq(m.layers[1].wq.kind, QT_NF4);
    assert_same_values(&m.layers[1].wq, &ref.layers[1].wq, "q_proj");
    assert_same_values(&m.lm_head, &ref.lm_head, "lm_head");
    cr_assert_eq(m.layers[0].attn_norm.kind, QT_BF16, "1-D tensors stay as they were");
    /* and a step runs on it */
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    cr_assert_eq(eng_pool_new(&pool, 1, msg, sizeof msg), 0);
    cr_assert_eq(eng_kv_new(&kv, &m.cfg, 1 << 20, 16, msg, sizeof msg), 0);
    cr_assert_eq(eng_forward_state_new(&st, &m, 8, msg, sizeof msg), 0);
    eng_seq_kv sk = {0};
    cr_assert_eq(eng_kv_reserve(kv, &sk, 3), 0);
    int32_t toks[3] = {116, 256, 259};
    eng_step_seq step = {.kv = &sk, .tokens = toks, .n_tokens = 3, .pos = 0};
    float logits[260];
    cr_assert_eq(eng_forward(st, &m, kv, pool, &step, 1, logits, msg, sizeof msg), 0, "%s", msg);
    for (int i = 0; i < 260; i++)
        cr_assert(isfinite(logits[i]));
    eng_kv_release(kv, &sk);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    eng_model_free(&m);
    eng_model_free(&ref);
}

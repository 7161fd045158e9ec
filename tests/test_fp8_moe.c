/*
 * test_fp8_moe.c - transformers' finegrained FP8 written by `qlserve
 * quantize --kind fp8` and read back, and FP8 experts (Qwen3-30B-A3B-FP8's
 * layout, per expert, and transformers 5's fused FP8Experts):
 *
 *   - quantize on the tiny Qwen3-MoE's float folders writes, tensor by
 *     tensor, the bytes transformers' own quantizer op (Fp8Quantize) wrote
 *     into the fixtures, in both scale widths and two block shapes, and
 *     the quantization_config transformers reads;
 *   - a sharded folder keeps its shards, each scale beside its weight, and
 *     an index of every tensor;
 *   - a weight the block does not divide is kept in its dtype and its
 *     module named in modules_to_not_convert, as Fp8Quantize passes it;
 *   - both fixtures load with their experts FP8 in place (codes borrowed
 *     from the mapping, scales in their stored dtype), the attention
 *     weights dequantized bit for bit as transformers does, logits within 1e-5
 *     of transformers' float64 forward over the weights it dequantized and
 *     12 greedy ids equal; quantize's own output loads back the same;
 *   - a --dtype bf16 load leaves the experts and their scales' dtype alone,
 *     and inspect counts them by that dtype;
 *   - PEFT's target_parameters adapter on the FP8 experts, unmerged
 *     against the float64 pass with the adapter, merged (requantized into
 *     each expert's own block and scale dtype) against the float64 pass
 *     over the merged weights;
 *   - what quantize does not write is refused by name.
 *
 * Fixtures: make_fp8_moe_reference.py (fp8moe_tiny_float/,
 * fp8moe_fused_tiny_ue8m0/, fp8_moe_reference.h) over make_moe_reference.py's
 * qwen3moe_tiny/ and qwen3moe_fused_tiny/.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fixtures/fp8_moe_reference.h"
#include "quant_checkpoint.h"
#include "tiny_model.h"

/* One fixture and the quantize run that must reproduce it. */
typedef struct fp8_case {
    const char *source, *fixture;
    const char *block, *fmt;
    int32_t block_rows, block_cols;
    qt_scale_dtype scale_dtype;
    const double *logits;
    const int *greedy;
    const fp8moe_digest *digests; /* each attention weight's dequantization */
    size_t n_digests;
} fp8_case;

static const fp8_case cases[2] = {
    {"qwen3moe_tiny", "fp8moe_tiny_float", "16x32", "float", FP8MOE_FLOAT_BLOCK_ROWS,
     FP8MOE_FLOAT_BLOCK_COLS, QT_SCALE_F32, &FP8MOE_FLOAT_LOGITS[0][0], FP8MOE_FLOAT_GREEDY,
     FP8MOE_FLOAT_DIGESTS, sizeof FP8MOE_FLOAT_DIGESTS / sizeof *FP8MOE_FLOAT_DIGESTS},
    {"qwen3moe_fused_tiny", "fp8moe_fused_tiny_ue8m0", "32x16", "ue8m0",
     FP8MOE_FUSED_UE8M0_BLOCK_ROWS, FP8MOE_FUSED_UE8M0_BLOCK_COLS, QT_SCALE_E8M0,
     &FP8MOE_FUSED_UE8M0_LOGITS[0][0], FP8MOE_FUSED_UE8M0_GREEDY, FP8MOE_FUSED_UE8M0_DIGESTS,
     sizeof FP8MOE_FUSED_UE8M0_DIGESTS / sizeof *FP8MOE_FUSED_UE8M0_DIGESTS},
};

/* `qlserve quantize --kind fp8` of fixture folder `source` (with a
 * tokenizer.json beside it) into <tmp>/out; the temporary dir into tmp. */
static int quantize_source(const char *source, const char *block, const char *fmt, char *tmp,
                           size_t cap, char *msg, size_t msg_len)
{
    test_tmpdir(tmp, cap);
    cr_assert(tmp[0]);
    char in[600], out[600];
    snprintf(in, sizeof in, "%s/in", tmp);
    snprintf(out, sizeof out, "%s/out", tmp);
    cr_assert_eq(mkdir(in, 0755), 0);
    tiny_fixture_folder(source, in);
    eng_quantize_opts o = {
        .in_path = in, .out_path = out, .kind = "fp8", .block = block, .scale_fmt = fmt};
    return eng_quantize_file(&o, NULL, msg, msg_len);
}

/* The case's fixture folder (a tokenizer beside it) in a temporary dir
 * (*dir, to test_rmtree), loaded into *m. */
static void load_fixture(const fp8_case *c, eng_model *m, char *dir, size_t cap)
{
    char msg[1024];
    test_tmpdir(dir, cap);
    cr_assert(dir[0]);
    tiny_fixture_folder(c->fixture, dir);
    cr_assert_eq(eng_model_load(m, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0, "%s: %s",
                 c->fixture, msg);
}

static void load_folder(eng_model *m, const char *dir)
{
    char msg[1024];
    cr_assert_eq(eng_model_load(m, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0, "%s: %s",
                 dir, msg);
}

/* Every tensor of want in got with its dtype, shape and bytes, and nothing more. */
static void same_tensors(const char *got_path, const char *want_path)
{
    char msg[1024];
    st_file got, want;
    cr_assert_eq(st_open(&got, got_path, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(st_open(&want, want_path, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(got.n_tensors, want.n_tensors, "%zu tensors, transformers wrote %zu",
                 got.n_tensors, want.n_tensors);
    size_t fp8 = 0;
    for (size_t i = 0; i < want.n_tensors; i++) {
        const st_tensor *w = &want.tensors[i], *g = st_find(&got, w->name);
        cr_assert(g, "%s is missing", w->name);
        cr_assert_eq(g->dtype, w->dtype, "%s: %s, transformers %s", w->name,
                     st_dtype_name(g->dtype), st_dtype_name(w->dtype));
        cr_assert_eq(g->ndim, w->ndim, "%s", w->name);
        for (int d = 0; d < w->ndim; d++)
            cr_assert_eq(g->shape[d], w->shape[d], "%s dim %d", w->name, d);
        cr_assert(g->nbytes == w->nbytes && memcmp(g->data, w->data, w->nbytes) == 0,
                  "%s: bytes differ from transformers' Fp8Quantize", w->name);
        fp8 += w->dtype == ST_F8_E4M3;
    }
    cr_assert_geq(fp8, 18, "only %zu fp8 tensors", fp8);
    st_close(&got);
    st_close(&want);
}

/* config.json's quantization_config as transformers reads it. */
static void quantization_config_of(const char *dir, const fp8_case *c)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    cJSON *j;
    cr_assert_eq(mf_read_json(path, 1 << 20, &j, msg, sizeof msg), 0, "%s", msg);
    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(j, "quantization_config");
    cr_assert_str_eq(mf_json_str(qc, "quant_method"), "fp8");
    cr_assert_str_eq(mf_json_str(qc, "activation_scheme"), "dynamic");
    cr_assert_str_eq(mf_json_str(qc, "scale_fmt"), c->fmt);
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(qc, "weight_block_size");
    cr_assert_eq(cJSON_GetArraySize(bs), 2);
    cr_assert_eq(cJSON_GetArrayItem(bs, 0)->valueint, c->block_rows);
    cr_assert_eq(cJSON_GetArrayItem(bs, 1)->valueint, c->block_cols);
    const cJSON *skip = cJSON_GetObjectItemCaseSensitive(qc, "modules_to_not_convert");
    cr_assert_eq(cJSON_GetArraySize(skip), 1);
    cr_assert_str_eq(cJSON_GetArrayItem(skip, 0)->valuestring, "lm_head");
    cJSON_Delete(j);
}

Test(fp8_moe, quantize_writes_the_bytes_of_transformers_fp8quantize)
{
    for (int k = 0; k < 2; k++) {
        const fp8_case *c = &cases[k];
        char tmp[512], msg[1024], got[700], want[700];
        cr_assert_eq(quantize_source(c->source, c->block, c->fmt, tmp, sizeof tmp, msg, sizeof msg),
                     0, "%s: %s", c->source, msg);
        snprintf(got, sizeof got, "%s/out/model.safetensors", tmp);
        snprintf(want, sizeof want, "%s/%s/model.safetensors", QL_FIXTURES, c->fixture);
        same_tensors(got, want);
        snprintf(got, sizeof got, "%s/out", tmp);
        quantization_config_of(got, c);
        /* and qlserve loads what it wrote, tokenizer copied beside it */
        eng_model m;
        load_folder(&m, got);
        qcp_logits_and_greedy(&m, c->fixture,
                              &(qcp_reference){FP8MOE_TOKENS, FP8MOE_N_TOKENS, c->logits,
                                               FP8MOE_VOCAB, FP8MOE_PROMPT, 6, c->greedy,
                                               FP8MOE_N_GREEDY});
        eng_model_free(&m);
        test_rmtree(tmp);
    }
}

/* dir/model.safetensors split into two shards (layer 0 and what is not
 * in a layer in the first, the rest in the second) and their index. */
static void reshard(const char *dir)
{
    static const char *names[2] = {"model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors"};
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    st_writer *w[2] = {st_writer_new(), st_writer_new()};
    cJSON *map = cJSON_CreateObject();
    for (size_t i = 0; i < f.n_tensors; i++) {
        const st_tensor *t = &f.tensors[i];
        int k = strncmp(t->name, "model.layers.", 13) == 0 &&
                strncmp(t->name, "model.layers.0.", 15) != 0;
        cr_assert_eq(st_writer_add(w[k], t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes,
                                   false, msg, sizeof msg),
                     0, "%s", msg);
        cJSON_AddStringToObject(map, t->name, names[k]);
    }
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        cr_assert_eq(st_writer_write(w[k], path, msg, sizeof msg), 0, "%s", msg);
        st_writer_free(w[k]);
    }
    st_close(&f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    cr_assert_eq(remove(path), 0);
    cJSON *idx = cJSON_CreateObject();
    cJSON_AddItemToObject(idx, "weight_map", map);
    char *text = cJSON_Print(idx);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    test_write_text(path, text);
    free(text);
    cJSON_Delete(idx);
}

/* A sharded folder keeps its shards: each scale lands in its weight's
 * shard, the index names every tensor and the new total_size, and the
 * folder loads with the fixture's logits. */
Test(fp8_moe, a_sharded_folder_keeps_its_shards_and_index)
{
    char tmp[512], in[600], out[600], path[1024], msg[1024];
    test_tmpdir(tmp, sizeof tmp);
    snprintf(in, sizeof in, "%s/in", tmp);
    snprintf(out, sizeof out, "%s/out", tmp);
    cr_assert_eq(mkdir(in, 0755), 0);
    tiny_fixture_folder("qwen3moe_tiny", in);
    reshard(in);
    eng_quantize_opts o = {
        .in_path = in, .out_path = out, .kind = "fp8", .block = "16x32", .scale_fmt = "float"};
    cr_assert_eq(eng_quantize_file(&o, NULL, msg, sizeof msg), 0, "%s", msg);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    cJSON *idx;
    cr_assert_eq(mf_read_json(path, 1 << 20, &idx, msg, sizeof msg), 0, "%s", msg);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
    cr_assert_eq(cJSON_GetArraySize(map), 186, "every tensor and scale indexed");
    cr_assert_str_eq(mf_json_str(map, "model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"),
                     "model-00001-of-00002.safetensors");
    cr_assert_str_eq(mf_json_str(map, "model.layers.2.self_attn.q_proj.weight_scale_inv"),
                     "model-00002-of-00002.safetensors");
    double total = 0, bytes = 0;
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(idx, "metadata");
    cr_assert(mf_json_number(cJSON_GetObjectItemCaseSensitive(meta, "total_size"), &total));
    for (int k = 1; k <= 2; k++) {
        st_file f;
        snprintf(path, sizeof path, "%s/model-0000%d-of-00002.safetensors", out, k);
        cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
        for (size_t i = 0; i < f.n_tensors; i++) {
            bytes += (double)f.tensors[i].nbytes;
            cr_assert_str_eq(mf_json_str(map, f.tensors[i].name), strrchr(path, '/') + 1);
        }
        st_close(&f);
    }
    cr_assert_eq(total, bytes);
    cJSON_Delete(idx);
    eng_model m;
    load_folder(&m, out);
    qcp_logits_and_greedy(&m, "sharded",
                          &(qcp_reference){FP8MOE_TOKENS, FP8MOE_N_TOKENS, cases[0].logits,
                                           FP8MOE_VOCAB, FP8MOE_PROMPT, 6, cases[0].greedy,
                                           FP8MOE_N_GREEDY});
    eng_model_free(&m);
    test_rmtree(tmp);
}

/* Every expert of m FP8 in the case's block and scale dtype, its codes
 * borrowed from the mapping. */
static void experts_are_fp8_in_place(const eng_model *m, const fp8_case *c)
{
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int32_t e = 0; e < m->cfg.n_experts; e++)
            for (int k = 0; k < 3; k++) {
                eng_proj p = eng_expert_proj(e, k == 0   ? ENG_PROJ_GATE
                                                : k == 1 ? ENG_PROJ_UP
                                                         : ENG_PROJ_DOWN);
                const qtensor *t = eng_model_proj(m, l, p);
                cr_assert_eq(t->kind, QT_FP8, "layer %d expert %d part %d: %s", l, e, k,
                             qt_kind_name(t->kind));
                cr_assert(t->data_borrowed, "layer %d expert %d: codes copied", l, e);
                cr_assert_eq(t->block_rows, c->block_rows);
                cr_assert_eq(t->block_cols, c->block_cols);
                cr_assert_eq(t->scale_dtype, c->scale_dtype);
            }
}

Test(fp8_moe, fp8_experts_load_in_place_and_match_float64)
{
    for (int k = 0; k < 2; k++) {
        const fp8_case *c = &cases[k];
        char dir[512];
        eng_model m;
        load_fixture(c, &m, dir, sizeof dir);
        experts_are_fp8_in_place(&m, c);
        for (size_t i = 0; i < c->n_digests; i++) {
            const qtensor *t = qcp_projection(&m, c->digests[i].name);
            cr_assert_eq(t->kind, QT_FP8, "%s", c->digests[i].name);
            size_t n = (size_t)(t->rows * t->cols);
            float *w = malloc(n * sizeof *w);
            qt_dequantize_rows(t, 0, t->rows, w);
            cr_assert_eq(qcp_fnv1a64(w, n * sizeof *w), c->digests[i].fnv,
                         "%s: not transformers' dequantization, bit for bit", c->digests[i].name);
            free(w);
        }
        qcp_logits_and_greedy(&m, c->fixture,
                              &(qcp_reference){FP8MOE_TOKENS, FP8MOE_N_TOKENS, c->logits,
                                               FP8MOE_VOCAB, FP8MOE_PROMPT, 6, c->greedy,
                                               FP8MOE_N_GREEDY});
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* --dtype bf16 casts what the checkpoint left dense (embeddings, norms,
 * routers, lm_head) and leaves every FP8 expert and its scales' dtype
 * alone; inspect counts the FP8 weights by their scales' dtype. */
Test(fp8_moe, a_bf16_load_leaves_the_experts_and_inspect_names_their_scales)
{
    static const char *counts[2] = {"fp8 (f32 scales) x84", "fp8 (e8m0 scales) x84"};
    for (int k = 0; k < 2; k++) {
        const fp8_case *c = &cases[k];
        char dir[512], msg[1024];
        eng_model m;
        load_fixture(c, &m, dir, sizeof dir);
        eng_model_free(&m);
        cr_assert_eq(
            eng_model_load(&m, &(eng_load_opts){.path = dir, .dtype = "bf16"}, msg, sizeof msg), 0,
            "%s", msg);
        experts_are_fp8_in_place(&m, c);
        cr_assert_eq(m.layers[1].router.kind, QT_BF16);
        eng_model_free(&m);
        char *text = NULL;
        size_t len = 0;
        FILE *out = open_memstream(&text, &len);
        cr_assert_eq(eng_inspect(dir, &(eng_load_opts){.path = dir}, out, msg, sizeof msg), 0, "%s",
                     msg);
        fclose(out);
        cr_assert(strstr(text, counts[k]), "no '%s' in:\n%s", counts[k], text);
        free(text);
        test_rmtree(dir);
    }
}

/* PEFT's target_parameters adapter (make_moe_reference.py's
 * peft/qwen3moe_experts: q_proj, v_proj and the fused experts) on both
 * FP8 fixtures: unmerged, and merged into each expert's own FP8 layout. */
Test(fp8_moe, a_peft_adapter_on_fp8_experts_unmerged_and_merged)
{
    for (int k = 0; k < 2; k++) {
        const fp8_case *c = &cases[k];
        char dir[512], path[600], msg[1024];
        eng_model m;
        load_fixture(c, &m, dir, sizeof dir);
        snprintf(path, sizeof path, "%s/peft/qwen3moe_experts", QL_FIXTURES);
        eng_lora *l = NULL;
        cr_assert_eq(lora_load(&l, NULL, path, "experts", &m, msg, sizeof msg), 0, "%s", msg);
        cr_assert(eng_lora_module_at(l, 1, eng_expert_proj(3, ENG_PROJ_DOWN)));
        eng_lora_term term = {l, 1.0f};
        ref_model R;
        ref_load(&R, &m);
        ref_add_lora(&R, l, 1.0);
        qcp_against_pass(&m, &R, NULL, &term, 1, FP8MOE_TOKENS, FP8MOE_N_TOKENS, 9,
                         "fp8 experts + unmerged adapter");
        ref_free(&R);
        uint64_t base = eng_weights_digest(&m, NULL);
        eng_weights *w = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
        eng_proj p = eng_expert_proj(6, ENG_PROJ_DOWN);
        const qtensor *merged = eng_weights_proj(w, 1, p);
        cr_assert_neq(merged, eng_model_proj(&m, 1, p), "expert 6's down merged");
        cr_assert_eq(merged->kind, QT_FP8);
        cr_assert_eq(merged->block_rows, c->block_rows);
        cr_assert_eq(merged->block_cols, c->block_cols);
        cr_assert_eq(merged->scale_dtype, c->scale_dtype, "the scale keeps its dtype");
        ref_load_version(&R, &m, w);
        qcp_against_pass(&m, &R, w, NULL, 0, FP8MOE_TOKENS, FP8MOE_N_TOKENS, 9,
                         "fp8 experts with the adapter merged");
        ref_free(&R);
        cr_assert_neq(eng_weights_digest(&m, w), base);
        eng_weights_unref(w);
        cr_assert_eq(eng_weights_digest(&m, NULL), base, "the served weights untouched");
        eng_lora_unref(l);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* The default block (128x128) divides none of the tiny model's weights:
 * Fp8Quantize passes each through, so every linear and the experts stay
 * f32 and are named in modules_to_not_convert for transformers. */
Test(fp8_moe, a_block_that_does_not_divide_keeps_the_weight_and_names_its_module)
{
    char tmp[512], msg[1024], path[700];
    cr_assert_eq(
        quantize_source("qwen3moe_fused_tiny", NULL, NULL, tmp, sizeof tmp, msg, sizeof msg), 0,
        "%s", msg);
    snprintf(path, sizeof path, "%s/out/model.safetensors", tmp);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    for (size_t i = 0; i < f.n_tensors; i++)
        cr_assert_neq(f.tensors[i].dtype, ST_F8_E4M3, "%s", f.tensors[i].name);
    st_close(&f);
    snprintf(path, sizeof path, "%s/out/config.json", tmp);
    size_t len = 0;
    char *text = test_read_file(path, &len);
    cr_assert(strstr(text, "\"model.layers.2.mlp.experts\""), "%s", text);
    cr_assert(strstr(text, "\"model.layers.0.self_attn.q_proj\""), "%s", text);
    cr_assert(strstr(text, "\"weight_block_size\":\t[128, 128]"), "%s", text);
    free(text);
    test_rmtree(tmp);
}

Test(fp8_moe, what_quantize_does_not_write_is_refused_by_name)
{
    char tmp[512], msg[1024];
    static const struct {
        const char *block, *fmt, *want;
    } bad[] = {
        {"0x128", NULL, "--block 0x128"},
        {"128", NULL, "--block 128"},
        {"16x32x2", NULL, "--block 16x32x2"},
        {NULL, "e4m3", "--scale-fmt e4m3"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_neq(quantize_source("qwen3moe_tiny", bad[i].block, bad[i].fmt, tmp, sizeof tmp,
                                      msg, sizeof msg),
                      0);
        cr_assert(strstr(msg, bad[i].want), "%s", msg);
        test_rmtree(tmp);
    }
    /* an FP8 folder is already quantized */
    cr_assert_neq(
        quantize_source("fp8moe_tiny_float", NULL, NULL, tmp, sizeof tmp, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "already has a quantization_config (quant_method fp8)"), "%s", msg);
    test_rmtree(tmp);
    /* GPT-OSS's transposed, biased experts are not FP8Experts' */
    cr_assert_neq(quantize_source("gptoss_tiny", NULL, NULL, tmp, sizeof tmp, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "architecture GptOssForCausalLM is not one quantize writes as fp8"), "%s",
              msg);
    test_rmtree(tmp);
    /* --block and --scale-fmt belong to fp8 */
    eng_quantize_opts o = {.in_path = "x", .out_path = "y", .kind = "nf4", .scale_fmt = "ue8m0"};
    cr_assert_neq(eng_quantize_file(&o, NULL, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "--scale-fmt is for --kind fp8, not nf4"), "%s", msg);
}

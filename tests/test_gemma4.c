/*
 * test_gemma4.c - Gemma 4 text models shaped like the released
 * checkpoints (make_gemma4_shapes_reference.py): greedy ids equal to
 * transformers' float64 ones, a PEFT adapter on the per-layer input gate
 * and projection (and the usual seven) equal to PEFT's float64 forward
 * unmerged and merged, the same adapter on the model quantized on load
 * against the float64 pass, and adapters qlserve cannot apply refused by
 * name. Every position's logits of both folders (and quantized on load)
 * are test_architectures.c's rows. The released checkpoints' full layers
 * with their own head size and kv heads (make_gemma4_dims_reference.py):
 * transformers' greedy ids, a prefill then decode over blocks in every KV
 * dtype, and a PEFT adapter whose modules take each layer's shape.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures/gemma4_dims_reference.h"
#include "fixtures/gemma4_reference.h"
#include "fixtures/gemma4_shapes_reference.h"
#include "inspect_text.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "quant_checkpoint.h"
#include "ref_forward.h"
#include "run_prompt.h"
#include "test_util.h"
#include "tiny_model.h"

/* tests/fixtures/<name> loaded from a scratch copy beside a tokenizer
 * (tiny_fixture_folder), with --quant quant when not NULL. */
static void load_shape(eng_model *m, const char *name, const char *quant)
{
    char dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    tiny_fixture_folder(name, dir);
    eng_load_opts o = {.path = dir, .quant = quant};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s: %s", name, msg);
    test_rmtree(dir);
}

/* Every position within 1e-5 (relative L2 of a row) and twelve greedy ids
 * after the prompt equal to transformers' float64 ones. */
Test(gemma4, released_shapes_give_transformers_greedy_ids, .timeout = 60)
{
    struct {
        const char *folder;
        const double *logits;
        const int *greedy;
    } shapes[] = {
        {"gemma4_ple_tiny", &GEMMA4_PLE_LOGITS[0][0], GEMMA4_PLE_GREEDY},
        {"gemma4_keqv_tiny", &GEMMA4_KEQV_LOGITS[0][0], GEMMA4_KEQV_GREEDY},
        {"gemma4_moe_tiny", &GEMMA4_MOE_LOGITS[0][0], GEMMA4_MOE_GREEDY},
        {"gemma4_cg_tiny", &GEMMA4_CG_LOGITS[0][0], GEMMA4_CG_GREEDY},
        {"gemma4_dims_tiny", &GEMMA4_DIMS_LOGITS[0][0], GEMMA4_DIMS_GREEDY},
        {"gemma4_dims_keqv_tiny", &GEMMA4_DIMS_KEQV_LOGITS[0][0], GEMMA4_DIMS_KEQV_GREEDY},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        eng_model m;
        load_shape(&m, shapes[i].folder, NULL);
        qcp_logits_and_greedy(&m, shapes[i].folder,
                              &(qcp_reference){.tokens = GEMMA4_TOKENS,
                                               .n_tokens = GEMMA4_N_TOKENS,
                                               .logits = shapes[i].logits,
                                               .vocab = GEMMA4_VOCAB,
                                               .prompt = GEMMA4_SHAPES_PROMPT,
                                               .n_prompt = GEMMA4_SHAPES_N_PROMPT,
                                               .greedy = shapes[i].greedy,
                                               .n_greedy = GEMMA4_SHAPES_N_GREEDY});
        eng_model_free(&m);
    }
}

/* The worst |logit - want| of every position of the prompt (a prefill of
 * 9, then one a step over blocks of 4) on version w with terms unmerged. */
static double prompt_error(const eng_model *m, const eng_weights *w, const eng_lora_term *terms,
                           int n_terms, const double *want)
{
    prompt_run r = {.tokens = GEMMA4_TOKENS,
                    .n_tokens = GEMMA4_N_TOKENS,
                    .prefill = 9,
                    .block_tokens = 4,
                    .weights = w,
                    .delta = terms,
                    .n_delta = n_terms};
    float *all = run_prompt(m, &r);
    double worst = test_max_abs_err(all, want, (size_t)GEMMA4_N_TOKENS * GEMMA4_VOCAB);
    free(all);
    return worst;
}

/* The float64 pass over m's own (dequantized) weights, or version w's,
 * with lora added when not NULL, against the walk's logits. */
static void against_reference(const eng_model *m, const eng_weights *w, eng_lora *lora,
                              const char *what)
{
    ref_model R;
    ref_load_version(&R, m, w);
    if (lora && !w)
        ref_add_lora(&R, lora, 1.0);
    double *ref = malloc((size_t)GEMMA4_N_TOKENS * GEMMA4_VOCAB * sizeof *ref);
    int32_t ids[GEMMA4_N_TOKENS];
    for (int i = 0; i < GEMMA4_N_TOKENS; i++)
        ids[i] = GEMMA4_TOKENS[i];
    ref_forward(&R, ids, GEMMA4_N_TOKENS, ref);
    eng_lora_term term = {lora, 1.0f};
    prompt_run r = {.tokens = GEMMA4_TOKENS,
                    .n_tokens = GEMMA4_N_TOKENS,
                    .prefill = 9,
                    .block_tokens = 4,
                    .weights = w,
                    .delta = lora && !w ? &term : NULL,
                    .n_delta = lora && !w ? 1 : 0};
    float *all = run_prompt(m, &r);
    for (int t = 0; t < GEMMA4_N_TOKENS; t++)
        assert_logits_close(all + (size_t)t * GEMMA4_VOCAB, ref + (size_t)t * GEMMA4_VOCAB,
                            GEMMA4_VOCAB, m->name, what, t);
    free(all);
    free(ref);
    ref_free(&R);
}

/* The adapter folder tests/fixtures/peft/<name> loaded onto m. */
static eng_lora *load_peft(const eng_model *m, const char *name)
{
    char path[512], msg[1024];
    snprintf(path, sizeof path, "%s/peft/%s", QL_FIXTURES, name);
    eng_lora *l = NULL;
    cr_assert_eq(lora_load(&l, NULL, path, name, m, msg, sizeof msg), 0, "%s", msg);
    return l;
}

static eng_lora *load_ple_adapter(const eng_model *m)
{
    return load_peft(m, "gemma4_ple");
}

/* PEFT's LoRA on q, k, v, o, gate, up, down and each layer's
 * per_layer_input_gate and per_layer_projection: every module where PEFT
 * made one (none for k and v on the kv-shared layers 4, 5), and PEFT's
 * float64 logits unmerged and merged (f32, as PEFT merges), within 5e-5:
 * transformers' Gemma4RMSNorm normalizes in float32 even in a float64
 * model, and with the adapter's larger activations that alone is 1.4e-5
 * (the float64 pass against PEFT's logits); the walk is held to the
 * float64 pass itself at its relative 1e-5 too. */
Test(gemma4, a_peft_adapter_on_the_per_layer_projections_equals_peft_float64, .timeout = 60)
{
    eng_model m;
    load_shape(&m, "gemma4_ple_tiny", NULL);
    eng_lora *l = load_ple_adapter(&m);
    for (int layer = 0; layer < 6; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const eng_lora_module *mod = eng_lora_module_at(l, layer, (eng_proj)p);
            bool kv = p == ENG_PROJ_K || p == ENG_PROJ_V;
            cr_assert_eq(mod != NULL, !(kv && layer >= 4), "layer %d %s", layer,
                         eng_proj_name((eng_proj)p));
        }
    const eng_lora_module *gate = eng_lora_module_at(l, 5, ENG_PROJ_PLE_GATE);
    const eng_lora_module *proj = eng_lora_module_at(l, 5, ENG_PROJ_PLE_PROJ);
    cr_assert(gate->a.rows == 4 && gate->a.cols == 64 && gate->b.rows == 8);
    cr_assert(proj->a.rows == 4 && proj->a.cols == 8 && proj->b.rows == 64);
    cr_assert_float_eq(gate->scale, 2.0f, 0);
    eng_lora_term term = {l, 1.0f};
    double worst = prompt_error(&m, NULL, &term, 1, &GEMMA4_PLE_LORA_LOGITS[0][0]);
    cr_log_info("gemma4_ple_tiny + adapter unmerged: worst logit error %g", worst);
    cr_assert_lt(worst, 5e-5, "unmerged: worst logit error %g", worst);
    against_reference(&m, NULL, l, "f32 + adapter unmerged");
    eng_weights *w = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    worst = prompt_error(&m, w, NULL, 0, &GEMMA4_PLE_MERGED_LOGITS[0][0]);
    cr_log_info("gemma4_ple_tiny + adapter merged: worst logit error %g", worst);
    cr_assert_lt(worst, 5e-5, "merged: worst logit error %g", worst);
    cr_assert_neq(eng_weights_digest(&m, w), eng_weights_digest(&m, NULL));
    eng_weights_unref(w);
    /* without the per-layer modules the answer is another */
    double moved = prompt_error(&m, NULL, NULL, 0, &GEMMA4_PLE_LORA_LOGITS[0][0]);
    cr_assert_gt(moved, 1e-2, "the adapter moved the logits by only %g", moved);
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* Quantized on load (nf4, the per-layer gate and projection and the
 * model's per-layer projection with the other linears), the adapter
 * unmerged, and merged back into nf4, hold against the float64 pass. */
Test(gemma4, the_adapter_on_a_model_quantized_on_load_holds_against_float64, .timeout = 60)
{
    eng_model m;
    load_shape(&m, "gemma4_ple_tiny", "nf4");
    cr_assert_eq(m.layers[3].g4.ple_gate.kind, QT_NF4);
    cr_assert_eq(m.layers[3].g4.ple_proj.kind, QT_NF4);
    cr_assert_eq(m.g4.ple_proj.kind, QT_NF4);
    cr_assert_eq(m.g4.ple_embed.kind, QT_F32, "an embedding table stays as stored");
    eng_lora *l = load_ple_adapter(&m);
    against_reference(&m, NULL, l, "nf4 + adapter unmerged");
    eng_lora_term term = {l, 1.0f};
    eng_weights *w = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    cr_assert_eq(eng_weights_proj(w, 3, ENG_PROJ_PLE_PROJ)->kind, QT_NF4);
    against_reference(&m, w, NULL, "nf4 + adapter merged");
    eng_weights_unref(w);
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* The model-wide per-layer modules (an Embedding and a Linear outside the
 * layers) are refused by name, as the main embeddings are. */
Test(gemma4, an_adapter_on_the_model_wide_per_layer_modules_is_refused_by_name, .timeout = 60)
{
    const char *targets[] = {"[\"per_layer_model_projection\"]", "[\"embed_tokens_per_layer\"]"};
    const char *want[] = {"model.per_layer_model_projection", "model.embed_tokens_per_layer"};
    eng_model m;
    load_shape(&m, "gemma4_ple_tiny", NULL);
    char dir[512], adir[700], msg[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    for (int i = 0; i < 2; i++) {
        lora_fix_spec s = lora_fix_default();
        s.target_modules = targets[i];
        s.projs = 1u << ENG_PROJ_Q;
        lora_fix_write(adir, &m.cfg, &s);
        eng_lora *l = NULL;
        cr_assert_neq(lora_load(&l, NULL, adir, "outer", &m, msg, sizeof msg), 0);
        cr_assert(strstr(msg, want[i]), "%s is not in: %s", want[i], msg);
    }
    test_rmtree(dir);
    eng_model_free(&m);
}

/* On the MoE block's model an adapter on the attention and the MLP beside
 * the experts loads (PEFT's module names: no mlp.shared_expert, and the
 * experts, 3-D parameters, are no modules), and one on the experts'
 * parameters (target_parameters) is refused by name. */
Test(gemma4, adapters_on_the_moe_block_model, .timeout = 60)
{
    eng_model m;
    load_shape(&m, "gemma4_moe_tiny", NULL);
    char dir[512], adir[700], msg[1024];
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    lora_fix_spec s = lora_fix_default();
    s.projs = 1u << ENG_PROJ_Q | 1u << ENG_PROJ_GATE | 1u << ENG_PROJ_DOWN;
    lora_fix_write(adir, &m.cfg, &s);
    eng_lora *l = NULL;
    cr_assert_eq(lora_load(&l, NULL, adir, "mlp", &m, msg, sizeof msg), 0, "%s", msg);
    cr_assert_not_null(eng_lora_module_at(l, 3, ENG_PROJ_GATE));
    cr_assert_null(eng_lora_module_at(l, 3, eng_expert_proj(0, ENG_PROJ_GATE)));
    against_reference(&m, NULL, l, "moe block + adapter unmerged");
    eng_lora_unref(l);
    s.extra = "\"target_parameters\": [\"experts.gate_up_proj\"]";
    lora_fix_write(adir, &m.cfg, &s);
    cr_assert_neq(lora_load(&l, NULL, adir, "experts", &m, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "target_parameters on Gemma 4's experts"), "%s", msg);
    test_rmtree(dir);
    eng_model_free(&m);
}

/* PEFT's LoRA on a Gemma4ForConditionalGeneration's text model (keys
 * under model.language_model.layers., target_modules a regex over those
 * names) on q, v, down and the per-layer input gate: PEFT's float64
 * logits, unmerged, within the 5e-5 above. */
Test(gemma4, a_peft_adapter_on_the_conditional_generation_text_model, .timeout = 60)
{
    eng_model m;
    load_shape(&m, "gemma4_cg_tiny", NULL);
    eng_lora *l = load_peft(&m, "gemma4_cg");
    cr_assert_not_null(eng_lora_module_at(l, 3, ENG_PROJ_PLE_GATE));
    cr_assert_not_null(eng_lora_module_at(l, 3, ENG_PROJ_V));
    cr_assert_null(eng_lora_module_at(l, 4, ENG_PROJ_V), "no v on a kv-shared layer");
    cr_assert_null(eng_lora_module_at(l, 3, ENG_PROJ_K));
    eng_lora_term term = {l, 1.0f};
    double worst = prompt_error(&m, NULL, &term, 1, &GEMMA4_CG_LORA_LOGITS[0][0]);
    cr_log_info("gemma4_cg_tiny + adapter unmerged: worst logit error %g", worst);
    cr_assert_lt(worst, 5e-5, "unmerged: worst logit error %g", worst);
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* qlserve inspect says what of Gemma 4 a folder uses. */
Test(gemma4, inspect_names_the_options, .timeout = 60)
{
    struct {
        const char *folder, *line;
    } want[] = {
        {"gemma4_cg_tiny", "gemma 4: 5 sliding window, 2 kv-shared layers (double-wide MLP); "
                           "per-layer inputs 8 a layer; the text model of a "
                           "Gemma4ForConditionalGeneration\n"},
        {"gemma4_moe_tiny", "gemma 4: 5 sliding window, 0 kv-shared layers; keys as values on "
                            "full layers; MoE block: 4 experts of 32, 2 a token\n"},
        {"gemma4_dims_keqv_tiny", "gemma 4: 5 sliding window, 0 kv-shared layers; full layers: "
                                  "head_dim 32, 1 kv heads; keys as values on full layers\n"},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        char dir[512];
        test_tmpdir(dir, sizeof dir);
        cr_assert(dir[0]);
        tiny_fixture_folder(want[i].folder, dir);
        char *text = inspect_text(dir);
        cr_assert(strstr(text, want[i].line), "%s: no \"%s\" in:\n%s", want[i].folder, want[i].line,
                  text);
        free(text);
        test_rmtree(dir);
    }
}

/* --- full layers with their own head size and kv heads ------------------------ */

/* The released shape as loaded: the full layers (2, 5) have head_dim 32
 * and their own kv heads (1 under attention_k_eq_v; 2 without it, where
 * transformers leaves num_global_key_value_heads unapplied), every other
 * layer head_dim 16 and 2; each layer's KV row in the cache is its own
 * (f32: sliding 2 x 16, full kv x 32 values; q8_0: 34 bytes a block of
 * 32), and the kv-shared full layer 5 reads layer 2's. */
Test(gemma4, full_layers_have_their_own_head_size_and_kv_heads, .timeout = 60)
{
    struct {
        const char *folder;
        int32_t full_kv;
    } want[] = {{"gemma4_dims_tiny", 2}, {"gemma4_dims_keqv_tiny", 1}};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        eng_model m;
        load_shape(&m, want[i].folder, NULL);
        const eng_config *c = &m.cfg;
        cr_assert_eq(c->head_dim, 16);
        cr_assert(eng_heads_vary(c));
        for (int32_t l = 0; l < c->n_layers; l++) {
            bool full = l == 2 || l == 5;
            cr_assert_eq(eng_layer_head_dim(c, l), full ? 32 : 16, "%s layer %d", want[i].folder,
                         l);
            cr_assert_eq(eng_layer_kv_heads(c, l), full ? want[i].full_kv : 2, "layer %d", l);
            cr_assert_eq(m.layers[l].wq.rows, 4 * eng_layer_head_dim(c, l), "layer %d", l);
            cr_assert_eq(m.layers[l].wo.cols, 4 * eng_layer_head_dim(c, l), "layer %d", l);
            cr_assert_eq(m.layers[l].q_norm.cols ? m.layers[l].q_norm.cols
                                                 : m.layers[l].q_norm.rows,
                         eng_layer_head_dim(c, l), "layer %d", l);
        }
        cr_assert_eq(m.layers[2].wk.rows, want[i].full_kv * 32);
        cr_assert_eq(eng_layer_kv_source(c, 5), c->kv_shared_layers ? 2 : 5);
        size_t f32 = (size_t)(4 * 2 * 32 + 2 * 2 * want[i].full_kv * 32) * sizeof(float);
        cr_assert_eq(eng_kv_token_bytes(c, QT_F32), f32, "%s", want[i].folder);
        cr_assert_eq(eng_kv_token_bytes(c, QT_Q8_0),
                     (size_t)(4 * 2 * 34 + 2 * 2 * 34 * want[i].full_kv), "%s", want[i].folder);
        eng_model_free(&m);
    }
}

/* The worst relative L2 of a row of every position's logits of the prompt
 * (a prefill of 9, then one a step over blocks of 4, the cache in
 * kv_dtype) against want. */
static double prompt_row_l2(const eng_model *m, qt_kind kv_dtype, const double *want)
{
    prompt_run r = {.tokens = GEMMA4_TOKENS,
                    .n_tokens = GEMMA4_N_TOKENS,
                    .prefill = 9,
                    .block_tokens = 4,
                    .kv_dtype = kv_dtype};
    float *all = run_prompt(m, &r);
    double worst = test_worst_row_l2(all, want, GEMMA4_N_TOKENS, GEMMA4_VOCAB);
    free(all);
    return worst;
}

/* The prompt as a prefill of 9 then one a step over blocks of 4 (the
 * full layers' rows beside the sliding ones' in every block): every
 * position within 1e-5 (relative L2 of a row, as the greedy test) of
 * transformers' float64 logits with the cache in f32. f16 and q8_0 caches
 * hold each layer's rows at their own size; Gemma 4's unscaled scores
 * (scaling 1, over unit-RMS q and k) amplify their rounding, so these
 * models measure f16 4.3e-3 and 3.2e-3, q8_0 8.6e-2 and 4.6e-2, as the
 * one-shape gemma4_ple_tiny and gemma4_keqv_tiny do (f16 1.7e-3 and
 * 4.7e-3, q8_0 9.8e-2 and 9.5e-2); bounds 1e-2 and 0.2, where a row read
 * at another layer's size or offset gives logits of no relation (O(1)). */
Test(gemma4, full_layers_own_heads_prefill_then_decode_over_blocks, .timeout = 60)
{
    struct {
        const char *folder;
        const double *logits;
    } shapes[] = {{"gemma4_dims_tiny", &GEMMA4_DIMS_LOGITS[0][0]},
                  {"gemma4_dims_keqv_tiny", &GEMMA4_DIMS_KEQV_LOGITS[0][0]}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        eng_model m;
        load_shape(&m, shapes[i].folder, NULL);
        double f32 = prompt_row_l2(&m, QT_F32, shapes[i].logits);
        double f16 = prompt_row_l2(&m, QT_F16, shapes[i].logits);
        double q8 = prompt_row_l2(&m, QT_Q8_0, shapes[i].logits);
        cr_log_info("%s over blocks of 4: worst relative L2 f32 %g, f16 %g, q8_0 %g",
                    shapes[i].folder, f32, f16, q8);
        cr_assert_lt(f32, 1e-5, "%s f32: %g", shapes[i].folder, f32);
        cr_assert_lt(f16, 1e-2, "%s f16: %g", shapes[i].folder, f16);
        cr_assert_lt(q8, 0.2, "%s q8_0: %g", shapes[i].folder, q8);
        eng_model_free(&m);
    }
}

/* PEFT's LoRA on q, k, v, o and the MLP of the attention_k_eq_v model:
 * each module's B is its layer's shape (q 4 heads of 32 on the full
 * layers, of 16 on the sliding ones; k 1 head of 32 against 2 of 16; no v
 * on a full layer), o's A reads its layer's heads; PEFT's float64 logits
 * unmerged and merged within the 5e-5 above. */
Test(gemma4, a_peft_adapter_takes_each_layers_head_shape, .timeout = 60)
{
    eng_model m;
    load_shape(&m, "gemma4_dims_keqv_tiny", NULL);
    eng_lora *l = load_peft(&m, "gemma4_dims");
    for (int layer = 0; layer < 6; layer++) {
        bool full = layer == 2 || layer == 5;
        int hd = full ? 32 : 16, kv = full ? 1 : 2;
        const eng_lora_module *q = eng_lora_module_at(l, layer, ENG_PROJ_Q);
        const eng_lora_module *k = eng_lora_module_at(l, layer, ENG_PROJ_K);
        const eng_lora_module *v = eng_lora_module_at(l, layer, ENG_PROJ_V);
        const eng_lora_module *o = eng_lora_module_at(l, layer, ENG_PROJ_O);
        cr_assert(q && k && o, "layer %d", layer);
        cr_assert_eq(q->b.rows, 4 * hd, "layer %d", layer);
        cr_assert_eq(k->b.rows, kv * hd, "layer %d", layer);
        cr_assert_eq(o->a.cols, 4 * hd, "layer %d", layer);
        cr_assert_eq(v != NULL, !full, "layer %d", layer);
        if (v)
            cr_assert_eq(v->b.rows, kv * hd, "layer %d", layer);
    }
    eng_lora_term term = {l, 1.0f};
    double worst = prompt_error(&m, NULL, &term, 1, &GEMMA4_DIMS_LORA_LOGITS[0][0]);
    cr_log_info("gemma4_dims_keqv_tiny + adapter unmerged: worst logit error %g", worst);
    cr_assert_lt(worst, 5e-5, "unmerged: worst logit error %g", worst);
    eng_weights *w = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    worst = prompt_error(&m, w, NULL, 0, &GEMMA4_DIMS_MERGED_LOGITS[0][0]);
    cr_log_info("gemma4_dims_keqv_tiny + adapter merged: worst logit error %g", worst);
    cr_assert_lt(worst, 5e-5, "merged: worst logit error %g", worst);
    eng_weights_unref(w);
    double moved = prompt_error(&m, NULL, NULL, 0, &GEMMA4_DIMS_LORA_LOGITS[0][0]);
    cr_assert_gt(moved, 1e-2, "the adapter moved the logits by only %g", moved);
    eng_lora_unref(l);
    eng_model_free(&m);
}

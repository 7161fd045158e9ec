/*
 * test_lora_load.c - loading PEFT adapters (adapters/peft.c): every
 * projection with its shape, values and scale; PEFT's matching rules for
 * target_modules (list and regex), exclude_modules, layers_to_transform,
 * rank_pattern and alpha_pattern; every unsupported feature refused by the
 * field's or the key's name with nothing returned; bad tensors (shape,
 * dtype, NaN, truncated file) named; tensors borrowed from the mapping; the
 * same adapter on a llama GGUF (q/k rows permuted) giving the logits it
 * gives on the Hugging Face model; and adapters written by PEFT itself
 * giving the logits PEFT computed in float64 (tests/fixtures/peft); and
 * no file read from outside the adapter's folder: a symlink (to anywhere)
 * or a FIFO in its place, or the folder named through a link, is refused
 * naming it, even when the link is made after the path was checked.
 */
#include <criterion/criterion.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "modelfile.h"
#include "run_prompt.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];
static char model_dir[600], adapter_dir[600];

static void setup(void)
{
    lora_fix_dirs(dir, sizeof dir, model_dir, sizeof model_dir, adapter_dir, sizeof adapter_dir);
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(lora_load, .init = setup, .fini = teardown);

static void load_model(eng_model *m, const char *path)
{
    eng_load_opts o = {.path = path};
    char msg[1024];
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "load %s: %s", path, msg);
}

/* The tiny llama (tiny_model.h) in model_dir, loaded. */
static void tiny_model(eng_model *m, st_dtype dtype)
{
    tiny_spec t = tiny_default();
    t.dtype = dtype;
    tiny_write_hf(model_dir, &t);
    load_model(m, model_dir);
}

static eng_lora *lora_ok(lora_meta *meta, const char *adir, const char *name, const eng_model *m)
{
    eng_lora *l = NULL;
    char msg[1024] = "";
    int rc = lora_load(&l, meta, adir, name, m, msg, sizeof msg);
    cr_assert_eq(rc, 0, "lora_load %s: %s (%s)", adir, msg, ql_strerror(rc));
    cr_assert_not_null(l);
    return l;
}

/* lora_load refuses, returns nothing, and says expect1 (and expect2). */
static void lora_fails(const char *adir, const eng_model *m, const char *expect1,
                       const char *expect2)
{
    eng_lora *l = (eng_lora *)&l; /* anything but NULL */
    char msg[1024] = "";
    int rc = lora_load(&l, NULL, adir, NULL, m, msg, sizeof msg);
    cr_assert_neq(rc, 0, "%s loaded (expected: %s)", adir, expect1);
    cr_assert_null(l, "nothing is returned on failure");
    cr_assert(strstr(msg, expect1), "'%s' lacks '%s'", msg, expect1);
    if (expect2)
        cr_assert(strstr(msg, expect2), "'%s' lacks '%s'", msg, expect2);
}

/* Module (layer, p) holds exactly the fixture's A and B. */
static void assert_module_values(const eng_lora *l, const lora_fix_spec *s, const eng_model *m,
                                 int32_t layer, eng_proj p)
{
    const eng_lora_module *mod = eng_lora_module_at(l, layer, p);
    cr_assert_not_null(mod, "layer %d %s is loaded", layer, eng_proj_name(p));
    const qtensor *w = eng_model_proj(m, layer, p);
    int32_t r = lora_fix_rank(s, layer, p);
    cr_assert_eq(mod->a.rows, r);
    cr_assert_eq(mod->a.cols, w->cols);
    cr_assert_eq(mod->b.rows, w->rows);
    cr_assert_eq(mod->b.cols, r);
    const qtensor *t[2] = {&mod->a, &mod->b};
    for (int b = 0; b < 2; b++) {
        size_t n = (size_t)(t[b]->rows * t[b]->cols);
        float *v = malloc(n * sizeof *v);
        qt_dequantize_rows(t[b], 0, t[b]->rows, v);
        for (size_t i = 0; i < n; i++)
            cr_assert(same_bits(v[i], lora_fix_value(s, layer, p, b, (int64_t)i)),
                      "layer %d %s %c[%zu]", layer, eng_proj_name(p), b ? 'B' : 'A', i);
        free(v);
    }
}

/* Which of layer l's projections are loaded, as a bit mask. */
static uint32_t loaded_mask(const eng_lora *l, int32_t layer)
{
    uint32_t mask = 0;
    for (int p = 0; p < ENG_N_PROJ; p++)
        if (eng_lora_module_at(l, layer, (eng_proj)p))
            mask |= 1u << p;
    return mask;
}

#define BIT(p)   (1u << (p))
#define ALL_PROJ ((1u << ENG_N_PROJ) - 1)

Test(lora_load, loads_every_projection_with_its_shape_values_and_scale_alpha_over_r)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.base_model = "model";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_meta meta;
    eng_lora *l = lora_ok(&meta, adapter_dir, "mine", &m);
    cr_assert_str_eq(l->name, "mine");
    cr_assert_eq(l->refs, 1);
    cr_assert_not_null(l->destroy);
    cr_assert_eq(l->n_layers, 2);
    for (int32_t layer = 0; layer < 2; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++) {
            assert_module_values(l, &s, &m, layer, (eng_proj)p);
            const eng_lora_module *mod = eng_lora_module_at(l, layer, (eng_proj)p);
            cr_assert(same_bits(mod->scale, 2.0f), "16 / 8");
            cr_assert_eq(mod->a.kind, QT_F32);
        }
    cr_assert_eq(meta.r, 8);
    cr_assert(same_bits(meta.alpha, 16.0f));
    cr_assert_eq(meta.use_rslora, false);
    cr_assert_eq(meta.n_modules, 14);
    cr_assert_str_eq(meta.targets, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
    cr_assert_str_eq(meta.base_model, "model");
    cr_assert_str_eq(meta.warning, "", "the base model's name matches the folder's");
    cr_assert_geq(l->bytes, (size_t)14 * (8 * 64 + 8 * 96) * 4 / 2, "bytes counts the tensors");
    eng_lora_unref(l);
    eng_model_free(&m);
}

Test(lora_load, adapter_name_defaults_to_the_folder_name_and_must_fit)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(adapter_dir, &m.cfg, &s);
    char slashed[700];
    snprintf(slashed, sizeof slashed, "%s/", adapter_dir);
    eng_lora *l = lora_ok(NULL, slashed, NULL, &m);
    cr_assert_str_eq(l->name, "adapter");
    eng_lora_unref(l);
    char long_name[200];
    memset(long_name, 'x', 150);
    long_name[150] = 0;
    eng_lora *none = NULL;
    char msg[512] = "";
    cr_assert_neq(lora_load(&none, NULL, adapter_dir, long_name, &m, msg, sizeof msg), 0);
    cr_assert_null(none);
    cr_assert(strstr(msg, "adapter name"), "%s", msg);
    eng_model_free(&m);
}

Test(lora_load, rslora_scale_is_alpha_over_sqrt_r)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.r = 16;
    s.alpha = 8;
    s.use_rslora = true;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_meta meta;
    eng_lora *l = lora_ok(&meta, adapter_dir, NULL, &m);
    cr_assert(meta.use_rslora);
    for (int p = 0; p < ENG_N_PROJ; p++)
        cr_assert(same_bits(eng_lora_module_at(l, 1, (eng_proj)p)->scale, 2.0f), "8 / sqrt(16)");
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* What the rank_pattern below gives: "proj" matches nothing ((.*\.)?proj$
 * never matches "q_proj"), "down_proj" matches every down_proj before the
 * layer-1 key does, the layer-1 q_proj key matches by its dotted suffix. */
static int32_t pattern_rank(int32_t layer, eng_proj p)
{
    if (p == ENG_PROJ_DOWN)
        return 4;
    if (p == ENG_PROJ_Q && layer == 1)
        return 2;
    return 8;
}

Test(lora_load, rank_and_alpha_patterns_take_the_first_key_matching_a_dotted_suffix)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.rank_of = pattern_rank;
    s.rank_pattern = "{\"proj\": 3, \"down_proj\": 4, \"model.layers.1.mlp.down_proj\": 6, "
                     "\"layers.1.self_attn.q_proj\": 2}";
    s.alpha_pattern = "{\"v_proj\": 4, \"layers\\\\.1\\\\.mlp\\\\..*\": 24, \"up_proj\": 40}";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    for (int32_t layer = 0; layer < 2; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++)
            assert_module_values(l, &s, &m, layer, (eng_proj)p);
    struct {
        int32_t layer;
        eng_proj p;
        float scale;
    } want[] = {
        {0, ENG_PROJ_Q, 16.0f / 8},    {1, ENG_PROJ_Q, 16.0f / 2},    {0, ENG_PROJ_V, 4.0f / 8},
        {1, ENG_PROJ_V, 4.0f / 8},     {0, ENG_PROJ_UP, 40.0f / 8},   {1, ENG_PROJ_UP, 24.0f / 8},
        {0, ENG_PROJ_DOWN, 16.0f / 4}, {1, ENG_PROJ_DOWN, 24.0f / 4}, {1, ENG_PROJ_GATE, 24.0f / 8},
        {0, ENG_PROJ_GATE, 16.0f / 8},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        cr_assert(same_bits(eng_lora_module_at(l, want[i].layer, want[i].p)->scale, want[i].scale),
                  "layer %d %s: scale %g, want %g", want[i].layer, eng_proj_name(want[i].p),
                  (double)eng_lora_module_at(l, want[i].layer, want[i].p)->scale,
                  (double)want[i].scale);
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* The modules a list target_modules selects in the next test. */
static bool not_list_selected(int32_t layer, eng_proj p)
{
    return !(p == ENG_PROJ_Q || p == ENG_PROJ_V || (p == ENG_PROJ_DOWN && layer == 1));
}

Test(lora_load, target_modules_list_matches_whole_names_and_dotted_suffixes)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.skip = not_list_selected;
    /* "proj" is no dotted suffix of any module; "self_attn.v_proj" is */
    s.target_modules =
        "[\"q_proj\", \"model.layers.1.mlp.down_proj\", \"proj\", \"self_attn.v_proj\"]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_meta meta;
    eng_lora *l = lora_ok(&meta, adapter_dir, NULL, &m);
    cr_assert_eq(loaded_mask(l, 0), BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V));
    cr_assert_eq(loaded_mask(l, 1), BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V) | BIT(ENG_PROJ_DOWN));
    cr_assert_eq(meta.n_modules, 5);
    cr_assert_str_eq(meta.targets, "q_proj,v_proj,down_proj");
    eng_lora_unref(l);

    s.skip = NULL;
    s.target_modules = "[\"proj\", \"attn\"]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules selects no projection", NULL);
    eng_model_free(&m);
}

Test(lora_load, target_modules_string_is_a_python_regex_matched_against_the_whole_name)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    struct {
        const char *target_modules; /* JSON */
        uint32_t want;
    } cases[] = {
        {"\".*\\\\.(q|v)_proj\"", BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V)},
        /* \d and a non-capturing group, translated for POSIX */
        {"\"model\\\\.layers\\\\.\\\\d+\\\\.self_attn\\\\.(?:q|k)_proj\"",
         BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_K)},
        /* a lazy quantifier and a bracket with \w */
        {"\".*?mlp\\\\.[\\\\w]+\"", BIT(ENG_PROJ_GATE) | BIT(ENG_PROJ_UP) | BIT(ENG_PROJ_DOWN)},
        {"\"all-linear\"", ALL_PROJ},
        {"\"ALL-LINEAR\"", ALL_PROJ},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        lora_fix_spec s = lora_fix_default();
        s.projs = cases[i].want;
        s.target_modules = cases[i].target_modules;
        lora_fix_write(adapter_dir, &m.cfg, &s);
        eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
        cr_assert_eq(loaded_mask(l, 0), cases[i].want, "%s", cases[i].target_modules);
        cr_assert_eq(loaded_mask(l, 1), cases[i].want, "%s", cases[i].target_modules);
        eng_lora_unref(l);
    }
    /* a string is a full match: "q_proj" alone matches no module's name */
    lora_fix_spec s = lora_fix_default();
    s.projs = BIT(ENG_PROJ_Q);
    s.target_modules = "\"q_proj\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules selects no projection", NULL);
    /* Python-only constructs are refused by name */
    s.target_modules = "\"(?!.*mlp).*_proj\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "(?!");
    s.target_modules = "\".*\\\\bq_proj\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "\\b");
    eng_model_free(&m);
}

Test(lora_load, missing_target_modules_means_peft_default_q_and_v)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.projs = BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V);
    s.target_modules = "null";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    cr_assert_eq(loaded_mask(l, 1), BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V));
    eng_lora_unref(l);
    eng_model_free(&m);
}

static bool layer0_v(int32_t layer, eng_proj p)
{
    return layer == 0 && p == ENG_PROJ_V;
}

Test(lora_load, exclude_modules_take_modules_back_out)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.projs = BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V);
    s.skip = layer0_v;
    s.extra = "\"exclude_modules\": [\"layers.0.self_attn.v_proj\"]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    cr_assert_eq(loaded_mask(l, 0), BIT(ENG_PROJ_Q));
    cr_assert_eq(loaded_mask(l, 1), BIT(ENG_PROJ_Q) | BIT(ENG_PROJ_V));
    eng_lora_unref(l);

    /* as a regex, and with a tensor left for the excluded module: refused */
    s.skip = NULL;
    s.extra = "\"exclude_modules\": \".*layers\\\\.0\\\\.self_attn\\\\.v_proj\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "model.layers.0.self_attn.v_proj.lora_A.weight", "does not target");
    eng_model_free(&m);
}

Test(lora_load, layers_to_transform_keeps_only_those_layers)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    const char *extras[] = {
        "\"layers_to_transform\": [1]",
        "\"layers_to_transform\": 1",
        "\"layers_to_transform\": [1], \"layers_pattern\": \"layers\"",
        "\"layers_to_transform\": [1], \"layers_pattern\": [\"h\", \"layers\"]",
    };
    for (size_t i = 0; i < sizeof extras / sizeof *extras; i++) {
        lora_fix_spec s = lora_fix_default();
        s.layers = 1u << 1;
        s.extra = extras[i];
        lora_fix_write(adapter_dir, &m.cfg, &s);
        eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
        cr_assert_eq(loaded_mask(l, 0), 0, "%s", extras[i]);
        cr_assert_eq(loaded_mask(l, 1), ALL_PROJ, "%s", extras[i]);
        eng_lora_unref(l);
    }
    /* a layer list that is not called "h" */
    lora_fix_spec s = lora_fix_default();
    s.layers = 1u << 1;
    s.extra = "\"layers_to_transform\": [1], \"layers_pattern\": \"h\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "selects no projection", NULL);
    /* PEFT applies the layer filter only to suffix matches: a module named
     * in full is targeted whatever its layer */
    s = lora_fix_default();
    s.projs = BIT(ENG_PROJ_Q);
    s.target_modules = "[\"model.layers.0.self_attn.q_proj\", \"k_proj\"]";
    s.extra = "\"layers_to_transform\": [1]";
    s.layers = 1u << 0;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "module model.layers.1.self_attn.k_proj has no lora_A", NULL);
    eng_model_free(&m);
}

Test(lora_load, unsupported_features_are_refused_by_the_field_name)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    struct {
        const char *extra, *field;
    } cases[] = {
        {"\"use_dora\": true", "use_dora"},
        {"\"bias\": \"all\"", "bias"},
        {"\"bias\": \"lora_only\"", "bias"},
        {"\"modules_to_save\": [\"lm_head\"]", "modules_to_save"},
        {"\"lora_bias\": true", "lora_bias"},
        {"\"layer_replication\": [[0, 2], [1, 2]]", "layer_replication"},
        {"\"target_parameters\": [\"experts.gate_up_proj\"]", "target_parameters"},
        {"\"trainable_token_indices\": [1, 2]", "trainable_token_indices"},
        {"\"use_qalora\": true", "use_qalora"},
        {"\"alora_invocation_tokens\": [259]", "alora_invocation_tokens"},
        {"\"use_bdlora\": {\"nblocks\": 2}", "use_bdlora"},
        {"\"kasa_config\": {}", NULL}, /* empty: falsy, as in PEFT */
        {"\"peft_type\": \"IA3\"", "peft_type"},
        {"\"r\": 0", "r must be"},
        {"\"layers_pattern\": \"layers\"", "layers_pattern"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        lora_fix_spec s = lora_fix_default();
        s.extra = cases[i].extra;
        lora_fix_write(adapter_dir, &m.cfg, &s);
        if (!cases[i].field) {
            eng_lora_unref(lora_ok(NULL, adapter_dir, NULL, &m));
            continue;
        }
        lora_fails(adapter_dir, &m, cases[i].field, "adapter_config.json");
    }
    /* layers_to_transform needs a list target_modules, as in PEFT */
    lora_fix_spec s = lora_fix_default();
    s.target_modules = "\".*_proj\"";
    s.extra = "\"layers_to_transform\": [0]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "layers_to_transform", "string");
    /* targets outside the decoder layers */
    s = lora_fix_default();
    s.target_modules = "[\"q_proj\", \"lm_head\"]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules selects lm_head", NULL);
    s.target_modules = "[\"embed_tokens\", \"q_proj\"]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules selects model.embed_tokens", NULL);
    s.target_modules = "\".*\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules selects model.embed_tokens", NULL);
    eng_model_free(&m);
}

Test(lora_load, fan_in_fan_out_is_forced_false_with_a_warning)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.extra = "\"fan_in_fan_out\": true";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_meta meta;
    eng_lora *l = lora_ok(&meta, adapter_dir, NULL, &m);
    cr_assert(strstr(meta.warning, "fan_in_fan_out"), "%s", meta.warning);
    assert_module_values(l, &s, &m, 0, ENG_PROJ_O); /* B @ A as stored, not transposed */
    eng_lora_unref(l);
    eng_model_free(&m);
}

Test(lora_load, a_different_base_model_is_a_warning_not_an_error)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    cr_assert_str_eq(m.name, "model", "an HF folder without _name_or_path: its folder's name");
    lora_fix_spec s = lora_fix_default();
    s.base_model = "someone/Model";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_meta meta;
    eng_lora_unref(lora_ok(&meta, adapter_dir, NULL, &m));
    cr_assert_str_eq(meta.warning, "", "base names compare, case aside: %s", meta.warning);
    s.base_model = "HuggingFaceTB/SmolLM2-135M";
    s.extra = "\"init_lora_weights\": \"pissa_niter_4\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora_unref(lora_ok(&meta, adapter_dir, NULL, &m));
    cr_assert(strstr(meta.warning, "HuggingFaceTB/SmolLM2-135M"), "%s", meta.warning);
    cr_assert(strstr(meta.warning, "model"), "%s", meta.warning);
    cr_assert(strstr(meta.warning, "pissa"), "%s", meta.warning);
    cr_assert_str_eq(meta.base_model, "HuggingFaceTB/SmolLM2-135M");
    eng_model_free(&m);
}

Test(lora_load, model_name_comes_from_the_config_or_the_gguf_or_the_path)
{
    eng_model m;
    tiny_model(&m, ST_F32);
    char gguf[700];
    snprintf(gguf, sizeof gguf, "%s/tiny-model.gguf", dir);
    lora_fix_write_llama_gguf(gguf, &m, "SmolLM2 135M Instruct");
    eng_model g;
    load_model(&g, gguf);
    cr_assert_str_eq(g.name, "SmolLM2 135M Instruct");
    /* a spelling of the same name is no warning */
    lora_fix_spec s = lora_fix_default();
    s.base_model = "HuggingFaceTB/SmolLM2-135M-Instruct";
    lora_fix_write(adapter_dir, &g.cfg, &s);
    lora_meta meta;
    eng_lora_unref(lora_ok(&meta, adapter_dir, NULL, &g));
    cr_assert_str_eq(meta.warning, "", "%s", meta.warning);
    eng_model_free(&g);
    lora_fix_write_llama_gguf(gguf, &m, NULL);
    load_model(&g, gguf);
    cr_assert_str_eq(g.name, "tiny-model.gguf");
    eng_model_free(&g);
    eng_model_free(&m);

    /* config.json's _name_or_path */
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    FILE *f = fopen(path, "rb");
    char cfg[4096];
    size_t n = fread(cfg, 1, sizeof cfg - 1, f);
    fclose(f);
    cfg[n] = 0;
    char patched[4200];
    snprintf(patched, sizeof patched, "{\"_name_or_path\": \"org/tiny-llama\", %s", cfg + 1);
    test_write_text(path, patched);
    load_model(&m, model_dir);
    cr_assert_str_eq(m.name, "org/tiny-llama");
    eng_model_free(&m);
}

Test(lora_load, unknown_tensor_keys_are_refused_by_their_name)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    const char *keys[] = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.embed_tokens.lora_A.weight",
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight",
        "base_model.model.model.norm.weight",
        "something_else",
    };
    const char *hints[] = {"DoRA",           "embeddings",     "embeddings",
                           "lm_head",        "bias",           "not the lora_A",
                           "not the lora_A", "not the lora_A", "not the lora_A"};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        lora_fix_spec s = lora_fix_default();
        s.extra_keys = &keys[i];
        s.n_extra_keys = 1;
        lora_fix_write(adapter_dir, &m.cfg, &s);
        char want[300];
        snprintf(want, sizeof want, "tensor '%s' is not supported", keys[i]);
        lora_fails(adapter_dir, &m, want, hints[i]);
    }
    eng_model_free(&m);
}

Test(lora_load, keys_without_prefix_or_with_the_adapter_name_load_the_same)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.prefix = "";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    assert_module_values(l, &s, &m, 1, ENG_PROJ_DOWN);
    eng_lora_unref(l);
    s = lora_fix_default();
    s.adapter_name_in_keys = true;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    l = lora_ok(NULL, adapter_dir, NULL, &m);
    assert_module_values(l, &s, &m, 0, ENG_PROJ_K);
    eng_lora_unref(l);
    /* both spellings of one tensor: ambiguous */
    const char *dup = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight";
    s = lora_fix_default();
    s.extra_keys = &dup;
    s.n_extra_keys = 1;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "are both lora_A of model.layers.0.self_attn.q_proj", NULL);
    eng_model_free(&m);
}

Test(lora_load, a_targeted_module_without_its_A_or_B_is_refused)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.omit_key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "module model.layers.1.mlp.up_proj has no lora_B", NULL);
    eng_model_free(&m);
}

Test(lora_load, a_tensor_for_a_module_the_config_does_not_target_is_refused)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.target_modules = "[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", "
                       "\"up_proj\"]";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "mlp.down_proj.lora_", "does not target");
    eng_model_free(&m);
}

static int32_t k_rank_4(int32_t layer, eng_proj p)
{
    return layer == 1 && p == ENG_PROJ_K ? 4 : 8;
}

Test(lora_load, a_shape_mismatch_names_the_tensor_and_both_shapes)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.rank_of = k_rank_4;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m,
               "tensor 'base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight' is [4, "
               "64]; module model.layers.1.self_attn.k_proj needs [8, 64]",
               "rank 8 from r");
    /* the same rank from rank_pattern is accepted, and named when wrong */
    s.rank_pattern = "{\"layers.1.self_attn.k_proj\": 4}";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora_unref(lora_ok(NULL, adapter_dir, NULL, &m));
    s.rank_pattern = "{\"layers.1.self_attn.k_proj\": 2}";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "needs [2, 64]", "rank_pattern \"layers.1.self_attn.k_proj\"");
    /* B written for a model with twice the kv heads */
    eng_config wide = m.cfg;
    wide.n_kv_heads = 4;
    s = lora_fix_default();
    lora_fix_write(adapter_dir, &wide, &s);
    lora_fails(adapter_dir, &m,
               "tensor 'base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight' is [64, "
               "8]; module model.layers.0.self_attn.k_proj needs [32, 8]",
               NULL);
    eng_model_free(&m);
}

Test(lora_load, dtypes_other_than_f32_f16_bf16_are_refused_by_name)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.dtype = ST_F64;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "lora_A.weight' is F64", "F32, F16 or BF16");
    s.dtype = ST_F16;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    cr_assert_eq(eng_lora_module_at(l, 0, ENG_PROJ_UP)->b.kind, QT_F16);
    assert_module_values(l, &s, &m, 0, ENG_PROJ_UP);
    eng_lora_unref(l);
    eng_model_free(&m);
}

Test(lora_load, a_non_finite_value_is_refused_naming_the_tensor_and_its_index)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    struct {
        st_dtype dtype;
        float value;
        bool b;
        eng_proj p;
        int64_t index;
        const char *where;
    } cases[] = {
        {ST_F32, NAN, true, ENG_PROJ_Q, 100, "element 100 (row 12, column 4)"},
        {ST_BF16, INFINITY, false, ENG_PROJ_DOWN, 95, "element 95 (row 0, column 95)"},
        {ST_F16, -INFINITY, true, ENG_PROJ_GATE, 767, "element 767 (row 95, column 7)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        lora_fix_spec s = lora_fix_default();
        s.dtype = cases[i].dtype;
        s.poison = true;
        s.poison_layer = 1;
        s.poison_proj = cases[i].p;
        s.poison_b = cases[i].b;
        s.poison_index = cases[i].index;
        s.poison_value = cases[i].value;
        lora_fix_write(adapter_dir, &m.cfg, &s);
        char key[256];
        lora_fix_key(key, sizeof key, &s, 1, cases[i].p, cases[i].b);
        char want[400];
        snprintf(want, sizeof want, "tensor '%s' holds", key);
        lora_fails(adapter_dir, &m, want, cases[i].where);
    }
    eng_model_free(&m);
}

Test(lora_load, a_layer_past_the_model_is_refused)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    eng_config deeper = m.cfg;
    deeper.n_layers = 3;
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(adapter_dir, &deeper, &s);
    lora_fails(adapter_dir, &m, "model.layers.2.", "the model has 2 layers");
    eng_model_free(&m);
}

Test(lora_load, a_truncated_or_missing_file_is_refused)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(adapter_dir, &m.cfg, &s);
    char path[700];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", adapter_dir);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(truncate(path, sb.st_size - 100), 0);
    lora_fails(adapter_dir, &m, "adapter_model.safetensors", "truncated");
    cr_assert_eq(truncate(path, 20), 0);
    lora_fails(adapter_dir, &m, "adapter_model.safetensors", "truncated");
    cr_assert_eq(unlink(path), 0);
    lora_fails(adapter_dir, &m, "adapter_model.safetensors is missing", NULL);
    snprintf(path, sizeof path, "%s/adapter_model.bin", adapter_dir);
    test_write_text(path, "not read");
    lora_fails(adapter_dir, &m, "adapter_model.bin", "safe_serialization");
    snprintf(path, sizeof path, "%s/adapter_config.json", adapter_dir);
    test_write_text(path, "{\"r\": 8, ");
    lora_fails(adapter_dir, &m, "adapter_config.json", NULL);
    cr_assert_eq(unlink(path), 0);
    lora_fails(adapter_dir, &m, "adapter_config.json is missing", NULL);
    eng_model_free(&m);
}

/* Rewrite a safetensors file with its header one byte longer (a space
 * JSON ignores), so every tensor's data sits one byte off its alignment. */
static void misalign_safetensors(const char *path)
{
    size_t n;
    /* test_read_file's NUL gives the one byte of room the space needs */
    uint8_t *buf = (uint8_t *)test_read_file(path, &n);
    cr_assert(buf, "cannot read %s", path);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = (h << 8) | buf[i];
    memmove(buf + 8 + h + 1, buf + 8 + h, (size_t)n - 8 - h);
    buf[8 + h] = ' ';
    h++;
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(h >> (8 * i));
    test_write_bytes(path, buf, n + 1);
    free(buf);
}

Test(lora_load, aligned_tensors_are_borrowed_and_misaligned_ones_copied)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    st_dtype dtypes[] = {ST_F32, ST_BF16};
    for (size_t i = 0; i < 2; i++) {
        lora_fix_spec s = lora_fix_default();
        s.dtype = dtypes[i];
        lora_fix_write(adapter_dir, &m.cfg, &s);
        char path[700];
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", adapter_dir);
        struct stat sb;
        cr_assert_eq(stat(path, &sb), 0);
        eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const eng_lora_module *mod = eng_lora_module_at(l, 1, (eng_proj)p);
            cr_assert(mod->a.data_borrowed && mod->b.data_borrowed, "%s %s borrowed",
                      st_dtype_name(dtypes[i]), eng_proj_name((eng_proj)p));
        }
        /* the mapping and the module table, no copy */
        size_t table = (size_t)2 * ENG_N_PROJ * sizeof(eng_lora_module);
        cr_assert_eq(l->bytes, (size_t)sb.st_size + table);
        eng_lora_unref(l);

        misalign_safetensors(path);
        l = lora_ok(NULL, adapter_dir, NULL, &m);
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const eng_lora_module *mod = eng_lora_module_at(l, 1, (eng_proj)p);
            cr_assert(!mod->a.data_borrowed && !mod->b.data_borrowed, "%s %s copied",
                      st_dtype_name(dtypes[i]), eng_proj_name((eng_proj)p));
            assert_module_values(l, &s, &m, 1, (eng_proj)p);
        }
        size_t copies = 0;
        for (int32_t layer = 0; layer < 2; layer++)
            for (int p = 0; p < ENG_N_PROJ; p++) {
                const eng_lora_module *mod = eng_lora_module_at(l, layer, (eng_proj)p);
                copies += mod->a.data_bytes + mod->b.data_bytes;
            }
        cr_assert_eq(l->bytes, (size_t)sb.st_size + 1 + copies + table,
                     "the mapping, the copies and the module table");
        eng_lora_unref(l);
    }
    eng_model_free(&m);
}

/* --- against forward passes --------------------------------------------------- */

/* The logits of every position of tokens[0..n), one decode step at a time,
 * with lora applied unmerged at scale 1 (NULL: the base model). */
static void run_logits(const eng_model *m, eng_lora *lora, const int32_t *tokens, int32_t n,
                       float *logits)
{
    eng_lora_term term = {.lora = lora, .scale = 1.0f};
    prompt_run r = {.tokens = tokens,
                    .n_tokens = n,
                    .prefill = 1,
                    .delta = lora ? &term : NULL,
                    .n_delta = lora ? 1 : 0};
    float *all = run_prompt(m, &r);
    memcpy(logits, all, (size_t)n * (size_t)m->cfg.vocab_size * sizeof *all);
    free(all);
}

/* max |a - b| over max |b|, over n values (test_diff_rel: +inf when any
 * value is NaN or infinite) */
static double rel_diff(const float *a, const double *b, size_t n)
{
    test_diff d = test_diff_f64(a, b, n);
    return test_diff_rel(&d);
}

Test(lora_load, llama_gguf_with_permuted_q_k_gives_the_hf_logits_with_the_adapter, .timeout = 60)
{
    eng_model hf, gg;
    tiny_model(&hf, ST_F32);
    char gguf[700];
    snprintf(gguf, sizeof gguf, "%s/tiny.gguf", dir);
    lora_fix_write_llama_gguf(gguf, &hf, "tiny");
    load_model(&gg, gguf);
    cr_assert(gg.cfg.rope_interleaved && !hf.cfg.rope_interleaved);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(adapter_dir, &hf.cfg, &s);
    eng_lora *lh = lora_ok(NULL, adapter_dir, NULL, &hf);
    eng_lora *lg = lora_ok(NULL, adapter_dir, NULL, &gg);

    /* B of q and k permuted as the weights were (k by the kv heads), the
     * rest as stored */
    for (int p = 0; p < ENG_N_PROJ; p++) {
        const eng_lora_module *a = eng_lora_module_at(lh, 0, (eng_proj)p),
                              *b = eng_lora_module_at(lg, 0, (eng_proj)p);
        size_t n = (size_t)(a->b.rows * a->b.cols);
        float *want = malloc(n * sizeof *want);
        const float *hb = (const float *)a->b.data;
        if (p == ENG_PROJ_Q || p == ENG_PROJ_K)
            lora_fix_permute_rows(hb, want, a->b.rows, a->b.cols,
                                  p == ENG_PROJ_Q ? hf.cfg.n_heads : hf.cfg.n_kv_heads);
        else
            memcpy(want, hb, n * sizeof *want);
        cr_assert_eq(memcmp(b->b.data, want, n * sizeof *want), 0, "%s B",
                     eng_proj_name((eng_proj)p));
        cr_assert_eq(memcmp(b->a.data, a->a.data, a->a.data_bytes), 0, "A is never permuted");
        cr_assert_eq(b->b.data_borrowed, !(p == ENG_PROJ_Q || p == ENG_PROJ_K));
        free(want);
    }

    enum { N = 10 };
    const int32_t tokens[N] = {259, 84, 104, 101, 256, 258, 32, 99, 97, 33};
    size_t nl = (size_t)N * 260;
    float *base = malloc(nl * 4), *with_hf = malloc(nl * 4), *with_gg = malloc(nl * 4);
    run_logits(&hf, NULL, tokens, N, base);
    run_logits(&hf, lh, tokens, N, with_hf);
    run_logits(&gg, lg, tokens, N, with_gg);
    double *ref = test_widen(with_hf, nl);
    double d = rel_diff(with_gg, ref, nl);
    cr_assert_lt(d, 1e-5, "GGUF + adapter vs HF + adapter: relative max diff %g", d);
    free(ref);
    ref = test_widen(base, nl);
    double effect = rel_diff(with_hf, ref, nl);
    cr_assert_gt(effect, 1e-2, "the adapter moves the logits (%g), far past the tolerance", effect);
    free(base);
    free(with_hf);
    free(with_gg);
    free(ref);
    eng_lora_unref(lh);
    eng_lora_unref(lg);
    eng_model_free(&gg);
    eng_model_free(&hf);
}

/*
 * tests/fixtures/peft (make_peft_fixture.py): a tiny Llama saved by
 * transformers in bf16, adapters saved by PEFT, and PEFT's float64 logits.
 * Our forward runs in f32 on the same bf16 weights: the tolerance, 1e-5 of
 * the largest logit, is f32 rounding over 64..96-wide products two layers
 * deep (measured: under 1e-6), with room; a wrong scale, rank or key moves
 * the logits by more than 1e-1 (the adapters change them by about as much
 * as their size).
 */
Test(lora_load, peft_adapters_give_the_logits_peft_computes, .timeout = 60)
{
    eng_model m;
    load_model(&m, QL_FIXTURES "/peft/base");
    st_file ref;
    char msg[512];
    cr_assert_eq(st_open(&ref, QL_FIXTURES "/peft/reference.safetensors", msg, sizeof msg), 0, "%s",
                 msg);
    const st_tensor *tok = st_find(&ref, "tokens");
    cr_assert(tok && tok->dtype == ST_I64);
    int32_t n = (int32_t)tok->numel;
    int32_t tokens[64];
    cr_assert_leq(n, 64);
    for (int32_t i = 0; i < n; i++) {
        int64_t v;
        memcpy(&v, tok->data + i * 8, 8);
        tokens[i] = (int32_t)v;
    }
    size_t nl = (size_t)n * (size_t)m.cfg.vocab_size;
    float *got = malloc(nl * 4);
    double *want = malloc(nl * 8);
    const char *cases[] = {"base", "plain", "patterns"};
    for (size_t c = 0; c < 3; c++) {
        const st_tensor *t = st_find(&ref, cases[c]);
        cr_assert(t && t->dtype == ST_F64 && (size_t)t->numel == nl, "%s", cases[c]);
        memcpy(want, t->data, nl * 8);
        eng_lora *l = NULL;
        lora_meta meta;
        if (c > 0) {
            char adir[512];
            snprintf(adir, sizeof adir, "%s/peft/%s", QL_FIXTURES, cases[c]);
            l = lora_ok(&meta, adir, NULL, &m);
            cr_assert_str_eq(meta.warning, "", "%s: %s", cases[c], meta.warning);
            cr_assert_eq(meta.n_modules, 14);
        }
        run_logits(&m, l, tokens, n, got);
        double d = rel_diff(got, want, nl);
        cr_assert_lt(d, 1e-5, "%s: relative max diff %g from PEFT's logits", cases[c], d);
        if (l) {
            /* the patterns adapter: rslora with rank and alpha patterns */
            if (c == 2) {
                cr_assert(meta.use_rslora);
                cr_assert_eq(eng_lora_module_at(l, 1, ENG_PROJ_Q)->a.rows, 2);
                cr_assert_eq(eng_lora_module_at(l, 1, ENG_PROJ_DOWN)->a.rows, 4);
                cr_assert_eq(eng_lora_module_at(l, 0, ENG_PROJ_V)->a.kind, QT_BF16);
                cr_assert(same_bits(eng_lora_module_at(l, 0, ENG_PROJ_UP)->scale,
                                    (float)(40 / sqrt(8.0))));
            }
            eng_lora_unref(l);
        }
    }
    free(got);
    free(want);
    st_close(&ref);
    eng_model_free(&m);
}

/* A trainer saving into the folder of a loaded adapter rewrites (or first
 * truncates) adapter_model.safetensors: the loaded adapter keeps the
 * values it was loaded with, and reading them never faults (a mapping of
 * a truncated file raises SIGBUS on the next read of a lost page). */
Test(lora_load, rewriting_the_file_of_a_loaded_adapter_changes_nothing_loaded)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, "a", &m);
    char path[700];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", adapter_dir);
    cr_assert_eq(truncate(path, 0), 0);
    for (int32_t layer = 0; layer < 2; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++)
            assert_module_values(l, &s, &m, layer, (eng_proj)p);
    /* and saved again with other values */
    lora_fix_spec other = s;
    other.seed = s.seed + 1;
    lora_fix_write(adapter_dir, &m.cfg, &other);
    for (int32_t layer = 0; layer < 2; layer++)
        for (int p = 0; p < ENG_N_PROJ; p++)
            assert_module_values(l, &s, &m, layer, (eng_proj)p);
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* A JSON string holding `times` copies of part (static buffer). */
static const char *json_repeat(const char *part, int times)
{
    static char buf[4096];
    size_t at = 0;
    buf[at++] = '"';
    for (int i = 0; i < times; i++) {
        memcpy(buf + at, part, strlen(part));
        at += strlen(part);
    }
    buf[at++] = '"';
    buf[at] = 0;
    return buf;
}

/* Patterns fuzz_adapter_config found (or measured next to what it found)
 * on which glibc's regcomp spends exponential time or unbounded memory,
 * each under the old bound (4096 bytes, counts multiplying to 1000 copies):
 * glibc's "{,n}" interval, which the old count missed; loops over what can
 * match nothing ("(a*)*" 32 times did not finish); quantifiers copied by a
 * count ("([a-z]*" 13 times "){1000}" took 25 s and 2.6 GiB; "a?" 2000
 * times 0.9 s). Each is refused by its field and the reason, at once. */
Test(lora_load, patterns_regcomp_would_take_exponential_time_are_refused, .timeout = 20)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.projs = BIT(ENG_PROJ_Q);
    struct {
        const char *part;
        int times;
        const char *expect;
    } cases[] = {
        {"(a{,1010}){1,100}", 1, "counted repeats"},
        {"((a11){,}){1,10}", 1, "can match nothing"},
        {"($(((a0{,811}){1,100}){1,100}){0}))", 1, "counted repeats"},
        {"(a*)*", 32, "can match nothing"},
        {"(|a)+", 18, "can match nothing"},
        {"()*", 22, "can match nothing"},
        {"(a{0,3})*", 18, "can match nothing"},
        {"a?", 300, "quantifiers"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        s.target_modules = json_repeat(cases[i].part, cases[i].times);
        lora_fix_write(adapter_dir, &m.cfg, &s);
        double t0 = ql_now_s();
        lora_fails(adapter_dir, &m, "target_modules", cases[i].expect);
        cr_assert_lt(ql_now_s() - t0, 2.0, "%s x %d", cases[i].part, cases[i].times);
    }
    /* fuzz_adapter_config: 120 '+' in a row ran out of 2 GiB (glibc builds
     * x+ as x x*, so each doubles; the translation drops every second one
     * as Python's possessive '+') */
    s.target_modules = json_repeat("+", 120);
    memcpy((char *)s.target_modules + 1, "self_", 5); /* "self_" then 115 '+' */
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "counted repeats");
    /* 25 s and 2.6 GiB; and with a letter that keeps the group from
     * matching nothing, still 13,000 quantifiers once copied */
    s.target_modules = "\"([a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*"
                       "[a-z]*){1000}\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "can match nothing");
    s.target_modules =
        "\"(a[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*"
        "[a-z]*){1000}\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "quantifiers");
    /* keys each within the limits, but together more than one config may
     * give regcomp (a 16 MiB file could hold thousands) */
    s.target_modules = NULL;
    char many[1024];
    size_t at = (size_t)snprintf(many, sizeof many, "{");
    for (int k = 0; k < 12; k++)
        at +=
            (size_t)snprintf(many + at, sizeof many - at, "%s\"q%d{19000}\": 2", k ? ", " : "", k);
    snprintf(many + at, sizeof many - at, "}");
    s.rank_pattern = many;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "rank_pattern key", "together expand");
    s.rank_pattern = NULL;
    /* rank_pattern keys are patterns too */
    s.target_modules = NULL;
    s.rank_pattern = "{\"(a*)*(a*)*(a*)*(a*)*(a*)*(a*)*(a*)*(a*)*q_proj\": 2}";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "rank_pattern key", "can match nothing");
    /* what PEFT writes still compiles: an optional prefix, alternatives
     * (qkv_proj is Phi-3's: no module of this llama) */
    s.rank_pattern = NULL;
    s.target_modules = "\"(.*\\\\.)?(q|qkv)_proj\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    cr_assert_eq(loaded_mask(l, 0), BIT(ENG_PROJ_Q));
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* Counted repeats nested in a target_modules pattern would make glibc's
 * regcomp expand them without bound (this one grew past 6 GiB in 20 s):
 * refused by name before compiling, while a modest count still works. */
Test(lora_load, target_modules_with_explosive_counted_repeats_are_refused, .timeout = 10)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    lora_fix_spec s = lora_fix_default();
    s.projs = BIT(ENG_PROJ_Q);
    s.target_modules = "\"(((((a{1,100}){1,100}){1,100}){1,100}))\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "counted repeats");
    /* a pattern longer than any real one */
    char *long_pattern = malloc(6000);
    cr_assert(long_pattern);
    long_pattern[0] = '"';
    memset(long_pattern + 1, 'a', 5000);
    strcpy(long_pattern + 5001, "\"");
    s.target_modules = long_pattern;
    lora_fix_write(adapter_dir, &m.cfg, &s);
    lora_fails(adapter_dir, &m, "target_modules", "4096");
    free(long_pattern);
    /* a count that stays small is still a regular expression */
    s.target_modules = "\"model\\\\.layers\\\\.[0-9]{1,3}\\\\.self_attn\\\\.q_proj\"";
    lora_fix_write(adapter_dir, &m.cfg, &s);
    eng_lora *l = lora_ok(NULL, adapter_dir, NULL, &m);
    cr_assert_eq(loaded_mask(l, 0), BIT(ENG_PROJ_Q));
    eng_lora_unref(l);
    eng_model_free(&m);
}

/* --- adapter files stay inside their folder ------------------------------------------ */

/* folder's chat_template.jinja holding tmpl, and its
 * additional_chat_templates/ folder, holding tool_use.jinja unless tool_use
 * is NULL. */
static void write_templates(const char *folder, const char *tmpl, const char *tool_use)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/chat_template.jinja", folder);
    test_write_text(path, tmpl);
    snprintf(path, sizeof path, "%s/additional_chat_templates", folder);
    cr_assert_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/additional_chat_templates/tool_use.jinja", folder);
    if (tool_use)
        test_write_text(path, tool_use);
}

/* The outside a hostile folder's links lead to: dir/outside, an adapter
 * of its own whose base model names a secret, with chat templates and a
 * tokenizer_config.json of its own. */
static void write_outside(const eng_model *m, char *outside, size_t len)
{
    snprintf(outside, len, "%s/outside", dir);
    lora_fix_spec s = lora_fix_default();
    s.base_model = "outside-secret-model";
    lora_fix_write(outside, &m->cfg, &s);
    write_templates(outside, "outside-secret-template", "outside-secret-template");
    char path[900];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", outside);
    test_write_text(path, "{\"chat_template\": \"outside-secret-template\"}");
}

/* Each file a load reads from an adapter folder (its config, its weights,
 * its chat templates and tokenizer_config.json, and the folder holding the
 * tool_use template), put there as a symlink to the same file outside the
 * adapter's folder (or, for the config, to a copy inside it: every link is
 * refused, wherever it leads), or as a FIFO: the load is refused naming the
 * file, nothing is returned, and nothing of the outside file is echoed.
 * Before, every link was followed (the outside config's base model came
 * back in lora_meta) and a FIFO tokenizer_config.json was skipped. */
Test(lora_load, a_file_of_an_adapter_folder_that_is_a_symlink_or_not_a_file_is_refused)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    char outside[700];
    write_outside(&m, outside, sizeof outside);
    static const struct {
        const char *file;   /* in the adapter folder */
        const char *target; /* NULL: outside's file of the same name; "": a FIFO */
        const char *jinja;  /* a chat_template.jinja of the folder's own (NULL: none) */
    } cases[] = {
        {"adapter_config.json", NULL, NULL},
        {"adapter_config.json", "real_config.json", NULL},
        {"adapter_model.safetensors", NULL, NULL},
        {"chat_template.jinja", NULL, NULL},
        {"tokenizer_config.json", NULL, NULL},
        {"tokenizer_config.json", "", NULL},
        {"additional_chat_templates/tool_use.jinja", NULL, "{{ messages }}"},
        {"additional_chat_templates", NULL, "{{ messages }}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char adir[800], path[1200], target[1200];
        snprintf(adir, sizeof adir, "%s/case%zu", dir, i);
        lora_fix_spec s = lora_fix_default();
        lora_fix_write(adir, &m.cfg, &s);
        if (cases[i].jinja)
            write_templates(adir, cases[i].jinja, NULL);
        snprintf(path, sizeof path, "%s/%s", adir, cases[i].file);
        if (cases[i].target && !cases[i].target[0]) {
            cr_assert_eq(mkfifo(path, 0600), 0, "%s", path);
        } else {
            if (cases[i].target) {
                snprintf(target, sizeof target, "%s/%s", adir, cases[i].target);
                cr_assert_eq(rename(path, target), 0);
                snprintf(target, sizeof target, "%s", cases[i].target);
            } else {
                snprintf(target, sizeof target, "%s/%s", outside, cases[i].file);
            }
            remove(path); /* what the folder held there, if anything */
            cr_assert_eq(symlink(target, path), 0, "%s", path);
        }
        eng_lora *l = (eng_lora *)&l; /* anything but NULL */
        lora_meta meta;
        char msg[2048] = "";
        int rc = lora_load(&l, &meta, adir, "a", &m, msg, sizeof msg);
        cr_assert_eq(rc, QL_EINVAL, "case %zu (%s): %s (%s)", i, cases[i].file, msg,
                     ql_strerror(rc));
        cr_assert_null(l, "case %zu: nothing is returned", i);
        cr_assert(strstr(msg, path), "case %zu: '%s' does not name %s", i, msg, path);
        const char *why =
            cases[i].target && !cases[i].target[0] ? "not a regular file" : "is a symbolic link";
        cr_assert(strstr(msg, why), "case %zu: '%s' lacks '%s'", i, msg, why);
        cr_assert(!strstr(msg, "outside-secret") && !strstr(meta.base_model, "outside-secret"),
                  "case %zu: '%s'", i, msg);
    }
    eng_model_free(&m);
}

/* The adapter folder itself, named under the adapter directory: a symlink
 * to a folder outside, or to one inside, is refused naming it; a real
 * folder loads, by its relative or absolute path, with its own chat
 * templates; the listing shows the real folder only. Before, a link
 * leading inside loaded (it was listed, too). */
Test(lora_load, an_adapter_folder_named_through_a_symlink_is_refused)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    char outside[700], root[700], good[800], path[900], real[PATH_MAX], abs_good[PATH_MAX + 16];
    write_outside(&m, outside, sizeof outside);
    snprintf(root, sizeof root, "%s/adapters", dir);
    cr_assert_eq(mkdir(root, 0700), 0);
    snprintf(good, sizeof good, "%s/good", root);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(good, &m.cfg, &s);
    write_templates(good, "{{ messages }}", "{{ tools }}");
    snprintf(path, sizeof path, "%s/out", root);
    cr_assert_eq(symlink(outside, path), 0);
    snprintf(path, sizeof path, "%s/in", root);
    cr_assert_eq(symlink("good", path), 0);

    const char *refused[] = {"out", "in", "in/", "./out"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        eng_lora *l = (eng_lora *)&l;
        char msg[2048] = "";
        int rc = lora_load_in(&l, NULL, root, refused[i], "a", &m, LORA_DTYPE_F32, msg, sizeof msg);
        cr_assert_eq(rc, QL_EINVAL, "%s: %s", refused[i], msg);
        cr_assert_null(l);
        cr_assert(strstr(msg, "is a symbolic link"), "%s: %s", refused[i], msg);
        cr_assert_eq(lora_resolve_dir(root, refused[i], real, sizeof real, msg, sizeof msg),
                     QL_EINVAL, "%s", refused[i]);
    }
    char msg[2048] = "";
    cr_assert_eq(lora_resolve_dir(root, "../outside", real, sizeof real, msg, sizeof msg),
                 QL_EINVAL);
    cr_assert(strstr(msg, "\"..\""), "%s", msg);

    cr_assert_eq(lora_resolve_dir(root, "./good/", real, sizeof real, msg, sizeof msg), QL_OK, "%s",
                 msg);
    char want[PATH_MAX];
    cr_assert(realpath(good, want));
    cr_assert_str_eq(real, want);
    snprintf(abs_good, sizeof abs_good, "%s", want);
    const char *loaded[] = {"good", abs_good};
    for (size_t i = 0; i < 2; i++) {
        eng_lora *l = NULL;
        int rc = lora_load_in(&l, NULL, root, loaded[i], "a", &m, LORA_DTYPE_F32, msg, sizeof msg);
        cr_assert_eq(rc, QL_OK, "%s: %s", loaded[i], msg);
        cr_assert_str_eq(l->chat_template, "{{ messages }}");
        cr_assert_str_eq(l->chat_template_tool_use, "{{ tools }}");
        eng_lora_unref(l);
    }
    char **names;
    size_t n;
    cr_assert_eq(lora_list_dir(root, &names, &n, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(names[0], "good");
    free(names[0]);
    free(names);
    eng_model_free(&m);
}

/* The admin API resolves a client's path and then loads the folder: a
 * folder swapped for a symlink to outside between the two (the race the
 * check and the opens had) is refused by the load itself, which opens the
 * path beneath the adapter directory again with no link followed; the
 * server's load used to open the resolved path as a path, following the
 * new link out. */
Test(lora_load, a_folder_swapped_for_a_symlink_after_the_check_is_refused_by_the_load)
{
    eng_model m;
    tiny_model(&m, ST_BF16);
    char outside[700], root[700], a[800], aside[800], resolved[PATH_MAX];
    write_outside(&m, outside, sizeof outside);
    snprintf(root, sizeof root, "%s/adapters", dir);
    cr_assert_eq(mkdir(root, 0700), 0);
    snprintf(a, sizeof a, "%s/a", root);
    snprintf(aside, sizeof aside, "%s/a-before", root);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(a, &m.cfg, &s);
    char msg[2048] = "";
    cr_assert_eq(lora_resolve_dir(root, "a", resolved, sizeof resolved, msg, sizeof msg), QL_OK,
                 "%s", msg);
    cr_assert_eq(rename(a, aside), 0);
    cr_assert_eq(symlink(outside, a), 0);
    eng_lora *l = (eng_lora *)&l;
    lora_meta meta;
    int rc = lora_load_in(&l, &meta, root, resolved, "a", &m, LORA_DTYPE_F32, msg, sizeof msg);
    cr_assert_eq(rc, QL_EINVAL, "%s", msg);
    cr_assert_null(l);
    cr_assert(strstr(msg, "is a symbolic link"), "%s", msg);
    cr_assert(!strstr(meta.base_model, "outside-secret"));
    eng_model_free(&m);
}

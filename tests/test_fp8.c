/*
 * test_fp8.c - transformers' finegrained FP8 checkpoints (quant_method
 * "fp8"): the QT_FP8 kind against torch's own widening of every E4M3FN and
 * E8M0 byte, a tiny Llama quantized by transformers' quantizer in both
 * scale widths (scale_fmt "float": F32 scales; "ue8m0": F8_E8M0 scales)
 * dequantized bit for bit as transformers dequantizes it on a CPU, its
 * logits and greedy ids against the float64 forward over those weights, a
 * --dtype bf16 load that leaves the scales' dtype alone, and the configs
 * qlserve refuses by name. tests/fixtures/make_fp8_reference.py made the
 * fixtures (fp8_tiny_float/, fp8_tiny_ue8m0/, fp8_reference.h).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "lora.h"
#include "model.h"
#include "modelfile.h"
#include "qt_math.h"
#include "qtensor.h"
#include "run_prompt.h"
#include "test_util.h"
#include "tiny_model.h"

#include "lora_fixture.h"
#include "quant_checkpoint.h"
#include "ref_forward.h"

#include "fixtures/fp8_reference.h"

/* One format's fixture and references. */
typedef struct fp8_case {
    const char *folder; /* under tests/fixtures */
    qt_scale_dtype scale_dtype;
    const fp8_digest *digests;
    size_t n_digests;
    const double *logits;
    const int *greedy;
} fp8_case;

static const fp8_case FP8_FLOAT = {
    "fp8_tiny_float",        QT_SCALE_F32,
    FP8_FLOAT_DIGESTS,       sizeof FP8_FLOAT_DIGESTS / sizeof FP8_FLOAT_DIGESTS[0],
    &FP8_FLOAT_LOGITS[0][0], FP8_FLOAT_GREEDY};
static const fp8_case FP8_UE8M0 = {
    "fp8_tiny_ue8m0",        QT_SCALE_E8M0,
    FP8_UE8M0_DIGESTS,       sizeof FP8_UE8M0_DIGESTS / sizeof FP8_UE8M0_DIGESTS[0],
    &FP8_UE8M0_LOGITS[0][0], FP8_UE8M0_GREEDY};

/* The fixture folder copied into a fresh temporary one with the tiny
 * tokenizer; dir receives its path. */
static void fixture_dir(const fp8_case *c, char *dir, size_t len)
{
    test_tmpdir(dir, len);
    tiny_fixture_folder(c->folder, dir);
}

static void load(eng_model *m, const char *dir, const char *dtype)
{
    char msg[1024];
    eng_load_opts o = {.path = dir, .dtype = dtype};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

/* One element, code times scale, through a one-element FP8 tensor's
 * scalar dequantization: its f32 bits. */
static uint32_t widen(uint8_t code, qt_scale_dtype sd, const void *scale)
{
    qt_fp8_parts p = {.rows = 1,
                      .cols = 1,
                      .block_rows = 1,
                      .block_cols = 1,
                      .codes = &code,
                      .scale_dtype = sd,
                      .scales = scale,
                      .scale_rows = 1,
                      .scale_cols = 1};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_fp8(&t, &p, msg, sizeof msg), 0, "%s", msg);
    float got;
    qt_dequantize_rows_ref(&t, 0, 1, &got);
    qt_free(&t);
    uint32_t bits;
    memcpy(&bits, &got, 4);
    return bits;
}

Test(fp8, e4m3_and_e8m0_bytes_widen_as_torch)
{
    const float f_one = 1.0f;
    for (int b = 0; b < 256; b++) {
        uint32_t got = widen((uint8_t)b, QT_SCALE_F32, &f_one);
        cr_assert_eq(got, FP8_E4M3_F32_BITS[b], "e4m3 byte 0x%02x: 0x%08x, torch 0x%08x", b, got,
                     FP8_E4M3_F32_BITS[b]);
        if (b == 255)
            continue; /* a NaN scale is refused, below */
        uint8_t e = (uint8_t)b;
        got = widen(0x38 /* 1.0 */, QT_SCALE_E8M0, &e);
        cr_assert_eq(got, FP8_E8M0_F32_BITS[b], "e8m0 byte 0x%02x: 0x%08x, torch 0x%08x", b, got,
                     FP8_E8M0_F32_BITS[b]);
    }
    uint8_t nan_scale = 255, code = 0x38;
    qtensor t;
    char msg[256];
    qt_fp8_parts p = {.rows = 1,
                      .cols = 1,
                      .block_rows = 1,
                      .block_cols = 1,
                      .codes = &code,
                      .scale_dtype = QT_SCALE_E8M0,
                      .scales = &nan_scale,
                      .scale_rows = 1,
                      .scale_cols = 1};
    cr_assert_eq(qt_from_fp8(&t, &p, msg, sizeof msg), QL_ENONFINITE);
    cr_assert(strstr(msg, "block scale 0"), "%s", msg);
}

/* Every linear weight of the loaded fixture dequantizes to transformers'
 * float32 bits (a digest of the whole tensor), through the scalar and the
 * fast entry alike. */
static void check_dequantization(const fp8_case *c)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    for (size_t i = 0; i < c->n_digests; i++) {
        const qtensor *t = qcp_projection(&m, c->digests[i].name);
        cr_assert(t->kind == QT_FP8 && t->scale_dtype == c->scale_dtype && t->data_borrowed);
        size_t n = (size_t)(t->rows * t->cols);
        float *out = malloc(n * sizeof *out), *fast = malloc(n * sizeof *fast);
        qt_dequantize_rows_ref(t, 0, t->rows, out);
        qt_dequantize_rows(t, 0, t->rows, fast);
        uint64_t h = qcp_fnv1a64(out, n * sizeof *out);
        cr_assert_eq(h, (uint64_t)c->digests[i].fnv, "%s: digest %016llx, transformers %016llx",
                     c->digests[i].name, (unsigned long long)h,
                     (unsigned long long)c->digests[i].fnv);
        cr_assert_eq(memcmp(out, fast, n * sizeof *out), 0);
        free(out);
        free(fast);
    }
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(fp8, float_scales_dequantize_as_transformers_bit_for_bit)
{
    check_dequantization(&FP8_FLOAT);
}

Test(fp8, ue8m0_scales_dequantize_as_transformers_bit_for_bit)
{
    check_dequantization(&FP8_UE8M0);
}

/* The loaded model's projections are FP8 in the stored scale dtype, the rest dense. */
static void check_kinds(const eng_model *m, qt_scale_dtype sd, qt_kind dense)
{
    cr_assert_str_eq(m->format, "fp8");
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        const eng_layer *L = &m->layers[l];
        const qtensor *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < 7; i++) {
            cr_assert_eq(ws[i]->kind, QT_FP8, "layer %d weight %zu is %s", l, i,
                         qt_kind_name(ws[i]->kind));
            cr_assert_eq(ws[i]->scale_dtype, sd, "layer %d weight %zu scales are %s", l, i,
                         qt_scale_dtype_name(ws[i]->scale_dtype));
            cr_assert(ws[i]->block_rows == FP8_BLOCK_ROWS && ws[i]->block_cols == FP8_BLOCK_COLS);
        }
        cr_assert_eq(L->attn_norm.kind, dense);
    }
    cr_assert_eq(m->embed.kind, dense);
    cr_assert_eq(m->lm_head.kind, dense); /* modules_to_not_convert: lm_head */
}

static void check_logits_and_greedy(const fp8_case *c)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    check_kinds(&m, c->scale_dtype, QT_F32);
    qcp_logits_and_greedy(&m, c->folder,
                          &(qcp_reference){FP8_TOKENS, FP8_N_TOKENS, c->logits, FP8_VOCAB,
                                           FP8_PROMPT, (int)(sizeof FP8_PROMPT / sizeof(int)),
                                           c->greedy, FP8_N_GREEDY});
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(fp8, float_scales_logits_and_greedy_ids_match_float64)
{
    check_logits_and_greedy(&FP8_FLOAT);
}

Test(fp8, ue8m0_scales_logits_and_greedy_ids_match_float64)
{
    check_logits_and_greedy(&FP8_UE8M0);
}

/* --dtype bf16 casts the dense parameters and leaves each FP8 weight's
 * codes and scales (dtype and bytes) as the file stores them. */
static void check_bf16_load(const fp8_case *c)
{
    char dir[512], msg[1024], path[1024];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, "bf16");
    check_kinds(&m, c->scale_dtype, QT_BF16);
    snprintf(path, sizeof path, "%s/%s/model.safetensors", QL_FIXTURES, c->folder);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    const st_tensor *s = st_find(&f, "model.layers.1.mlp.down_proj.weight_scale_inv");
    cr_assert_eq(s->dtype, c->scale_dtype == QT_SCALE_E8M0 ? ST_F8_E8M0 : ST_F32);
    const qtensor *w = &m.layers[1].w_down;
    cr_assert(s && (size_t)(w->scale_rows * w->scale_cols) * qt_scale_dtype_size(w->scale_dtype) ==
                       s->nbytes);
    cr_assert_eq(memcmp(w->block_scales, s->data, s->nbytes), 0);
    st_close(&f);
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(fp8, bf16_load_keeps_float_scales)
{
    check_bf16_load(&FP8_FLOAT);
}

Test(fp8, bf16_load_keeps_ue8m0_scales)
{
    check_bf16_load(&FP8_UE8M0);
}

/* The fixture with its config.json's quantization_config edited: `from`
 * replaced by `to`; loading must fail with a message holding `want`. */
static void check_refused(const char *from, const char *to, const char *want)
{
    char dir[512];
    fixture_dir(&FP8_FLOAT, dir, sizeof dir);
    qcp_refused(dir, from, to, want);
    test_rmtree(dir);
}

Test(fp8, configs_it_cannot_compute_are_refused_by_name)
{
    check_refused("\"activation_scheme\": \"dynamic\"", "\"activation_scheme\": \"static\"",
                  "activation_scheme static");
    check_refused("\"scale_fmt\": \"float\"", "\"scale_fmt\": \"e4m3\"", "scale_fmt e4m3");
    check_refused("\"quant_method\": \"fp8\"", "\"quant_method\": \"hqq\"",
                  "quantization_config hqq");
    check_refused("\"weight_block_size\": [", "\"weight_block_size\": null, \"x\": [",
                  "weight_block_size");
    /* a block that does not give the stored grid */
    check_refused("\"weight_block_size\": [\n      16,", "\"weight_block_size\": [\n      32,",
                  "scale grid");
}

Test(fp8, quantizer_writes_transformers_codes_and_scales)
{
    /* transformers' Fp8Quantize on one input (ordinary, zero, tiny, huge
     * blocks, values on E4M3 rounding midpoints), both scale formats */
    const int64_t rows = FP8_QV_ROWS, cols = FP8_QV_COLS, n = rows * cols;
    float x[FP8_QV_ROWS * FP8_QV_COLS];
    memcpy(x, FP8_QV_INPUT_BITS, sizeof x);
    for (int k = 0; k < 2; k++) {
        qt_scale_dtype sd = k ? QT_SCALE_E8M0 : QT_SCALE_F32;
        qt_quant_params p = {.kind = QT_FP8,
                             .block_rows = FP8_BLOCK_ROWS,
                             .block_cols = FP8_BLOCK_COLS,
                             .scale_dtype = sd};
        qtensor q;
        char msg[256];
        cr_assert_eq(qt_quantize(&q, x, rows, cols, &p, msg, sizeof msg), 0, "%s", msg);
        const uint8_t *want = k ? FP8_QV_UE8M0_CODES : FP8_QV_FLOAT_CODES;
        for (int64_t i = 0; i < n; i++)
            cr_assert_eq(q.data[i], want[i], "%s: code %lld (%a): 0x%02x, transformers 0x%02x",
                         qt_scale_dtype_name(sd), (long long)i, (double)x[i], q.data[i], want[i]);
        const void *ws =
            k ? (const void *)FP8_QV_UE8M0_SCALES : (const void *)FP8_QV_FLOAT_SCALE_BITS;
        size_t sbytes = (size_t)(q.scale_rows * q.scale_cols) * qt_scale_dtype_size(sd);
        cr_assert_eq(sbytes, k ? sizeof FP8_QV_UE8M0_SCALES : sizeof FP8_QV_FLOAT_SCALE_BITS);
        cr_assert_eq(memcmp(q.block_scales, ws, sbytes), 0, "%s scales differ",
                     qt_scale_dtype_name(sd));
        qt_free(&q);
    }
}

/* A PEFT adapter (every projection, r 8) on the FP8 base: applied
 * unmerged, the logits are the float64 forward over dequant(W) + scale * BA;
 * merged, each projection is FP8 again in its own block and scale dtype,
 * within a fraction of |delta| of W + delta. */
static void check_adapter(const fp8_case *c)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    ref_model R;
    eng_lora *lora =
        qcp_unmerged_adapter(&m, dir, c->folder, FP8_TOKENS, FP8_N_TOKENS, FP8_VOCAB, &R);
    eng_lora_term term = {lora, 1.0f};
    eng_weights *v = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    double worst = qcp_merged_error(v, &m, &R, QT_FP8);
    /* each projection FP8 again in the weight's own block and scale dtype */
    for (int32_t l = 0; l < m.cfg.n_layers; l++) {
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const qtensor *q = eng_weights_proj(v, l, (eng_proj)p);
            const qtensor *w = eng_model_proj(&m, l, (eng_proj)p);
            cr_assert(q->scale_dtype == c->scale_dtype && q->block_rows == w->block_rows &&
                      q->block_cols == w->block_cols);
        }
    }
    /* E4M3 keeps 3 mantissa bits: half a step near a block's largest
     * value is 1/16 of it, a sizeable part of these adapters' deltas, as
     * for the 4-bit kinds (0.25 in test_lora_engine.c); a UE8M0 scale,
     * rounded up to a power of two, can leave a block's codes in half the
     * range, a bit less. Measured worst 0.22 (f32 scales) and 0.34 (UE8M0),
     * so 0.3 and 0.45, which a dropped or halved delta (0.5 and more) fails */
    double tol = c->scale_dtype == QT_SCALE_E8M0 ? 0.45 : 0.3;
    cr_assert(worst <= tol, "%s: a merged projection is off by %g of |delta|", c->folder, worst);
    eng_weights_unref(v);
    ref_free(&R);
    eng_lora_unref(lora);
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(fp8, float_scales_adapter_unmerged_and_merged)
{
    check_adapter(&FP8_FLOAT);
}

Test(fp8, ue8m0_scales_adapter_unmerged_and_merged)
{
    check_adapter(&FP8_UE8M0);
}

/* `qlserve inspect` names the kind and the scales' dtype, of the model as
 * loaded and of the file's tensors. */
static void check_inspect(const fp8_case *c, const char *model_line, const char *count,
                          const char *scale_tensor)
{
    char dir[512], msg[1024], path[1024];
    fixture_dir(c, dir, sizeof dir);
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_inspect(dir, &o, out, msg, sizeof msg), 0, "%s", msg);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    cr_assert_eq(eng_inspect(path, &(eng_load_opts){.path = path}, out, msg, sizeof msg), 0, "%s",
                 msg);
    fclose(out);
    cr_assert(strstr(text, ": fp8 model"), "%s", text);
    cr_assert(strstr(text, model_line), "no '%s' in:\n%s", model_line, text);
    cr_assert(strstr(text, count), "no '%s' in:\n%s", count, text);
    cr_assert(strstr(text, scale_tensor), "no '%s' in:\n%s", scale_tensor, text);
    free(text);
    test_rmtree(dir);
}

Test(fp8, inspect_names_the_kind_and_the_scale_dtype)
{
    check_inspect(&FP8_FLOAT, "linear layers fp8-b16x32-f32", "fp8 (f32 scales) x14",
                  "model.layers.0.mlp.down_proj.weight_scale_inv: F32 [4, 3]");
    check_inspect(&FP8_UE8M0, "linear layers fp8-b16x32-e8m0", "fp8 (e8m0 scales) x14",
                  "model.layers.0.mlp.down_proj.weight_scale_inv: F8_E8M0 [4, 3], 12 bytes");
}

/* A grid the block does not divide (DeepSeek's shapes): every element of
 * the rows' dequantization equals qt_math.h's per-element form (what a
 * device thread computes from the raw arrays), rows read alone too. */
Test(fp8, ragged_grid_rows_equal_the_element_function)
{
    enum { ROWS = 37, COLS = 70, BR = 16, BC = 32, SR = 3, SC = 3 };
    uint64_t rng = 5;
    uint8_t codes[ROWS * COLS], e8m0[SR * SC];
    float f32[SR * SC];
    for (int i = 0; i < ROWS * COLS; i++)
        codes[i] = (uint8_t)(test_rand(&rng) & 0xFF);
    for (int i = 0; i < SR * SC; i++) {
        e8m0[i] = (uint8_t)(100 + test_rand(&rng) % 40);
        f32[i] = 1e-3f * (1.0f + (float)(test_rand(&rng) % 1000));
    }
    for (int k = 0; k < 2; k++) {
        bool is_e8m0 = k == 1;
        qt_fp8_parts p = {.rows = ROWS,
                          .cols = COLS,
                          .block_rows = BR,
                          .block_cols = BC,
                          .codes = codes,
                          .scale_dtype = is_e8m0 ? QT_SCALE_E8M0 : QT_SCALE_F32,
                          .scales = is_e8m0 ? (const void *)e8m0 : (const void *)f32,
                          .scale_rows = SR,
                          .scale_cols = SC};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_from_fp8(&t, &p, msg, sizeof msg), 0, "%s", msg);
        float all[ROWS * COLS], one[COLS];
        qt_dequantize_rows(&t, 0, ROWS, all);
        for (int r = 0; r < ROWS; r++) {
            qt_dequantize_rows_ref(&t, r, 1, one);
            cr_assert_eq(memcmp(one, all + r * COLS, sizeof one), 0, "row %d alone", r);
            for (int c = 0; c < COLS; c++) {
                float e = qm_fp8_element(t.data, t.block_scales, is_e8m0, COLS, BR, BC, SC, r, c);
                cr_assert(same_bits(e, all[r * COLS + c]) || (isnan(e) && isnan(all[r * COLS + c])),
                          "(%d, %d): %a vs %a", r, c, (double)e, (double)all[r * COLS + c]);
            }
        }
        qt_free(&t);
        /* a grid of another size is refused by name */
        p.scale_cols = 2;
        cr_assert_eq(qt_from_fp8(&t, &p, msg, sizeof msg), QL_EFORMAT);
        cr_assert(strstr(msg, "scale grid [3, 2]") && strstr(msg, "want [3, 3]"), "%s", msg);
    }
}

/* The fast product (AVX2 where this CPU has it) against the scalar
 * reference within f32 rounding, and a row of x gives the same bits alone
 * as in a batch; the fast dequantization gives the reference's bits. */
Test(fp8, fast_product_agrees_with_the_reference)
{
    enum { ROWS = 37, COLS = 70, BATCH = 5 };
    uint64_t rng = 9;
    float w[ROWS * COLS], x[BATCH * COLS];
    for (int i = 0; i < ROWS * COLS; i++)
        w[i] = 0.1f * test_normal(&rng);
    for (int i = 0; i < BATCH * COLS; i++)
        x[i] = test_normal(&rng);
    for (int k = 0; k < 2; k++) {
        qt_quant_params p = {.kind = QT_FP8,
                             .block_rows = 16,
                             .block_cols = 32,
                             .scale_dtype = k ? QT_SCALE_E8M0 : QT_SCALE_F32};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, w, ROWS, COLS, &p, msg, sizeof msg), 0, "%s", msg);
        float fast[BATCH * ROWS], ref[BATCH * ROWS], alone[ROWS];
        qt_matmul(&t, x, BATCH, fast, 0, ROWS);
        qt_matmul_ref(&t, x, BATCH, ref, 0, ROWS);
        test_diff d = test_diff_f32(fast, ref, BATCH * ROWS);
        cr_assert(test_diff_rel(&d) <= 1e-5, "%s path off the reference by %g", qt_cpu_path(),
                  test_diff_rel(&d));
        qt_matmul(&t, x + 3 * COLS, 1, alone, 0, ROWS);
        cr_assert_eq(memcmp(alone, fast + 3 * ROWS, sizeof alone), 0, "batched differs from alone");
        float dq_fast[ROWS * COLS], dq_ref[ROWS * COLS];
        qt_dequantize_rows(&t, 0, ROWS, dq_fast);
        qt_dequantize_rows_ref(&t, 0, ROWS, dq_ref);
        cr_assert_eq(memcmp(dq_fast, dq_ref, sizeof dq_ref), 0);
        qt_free(&t);
    }
}

/* `qlserve quantize` never takes an FP8 checkpoint's block scales (2-D
 * floats) for weights: the file is refused as already quantized. */
Test(fp8, quantize_refuses_an_fp8_file)
{
    char path[1024], out[600], dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    snprintf(out, sizeof out, "%s/out.safetensors", dir);
    snprintf(path, sizeof path, "%s/fp8_tiny_float/model.safetensors", QL_FIXTURES);
    eng_quantize_opts o = {.in_path = path, .out_path = out, .kind = "nf4"};
    cr_assert_eq(eng_quantize_file(&o, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "is F8_E4M3: the file is already quantized (fp8"), "%s", msg);
    test_rmtree(dir);
}

/*
 * test_ctensors.c - compressed-tensors checkpoints (quant_method
 * "compressed-tensors", what llm-compressor writes) and fbgemm's FP8
 * (quant_method "fbgemm_fp8"): a tiny Llama written by compressed-tensors'
 * own compressors in five schemes (pack-quantized int4 group asymmetric
 * with bf16 scales, pack-quantized int8 channel symmetric with f16 scales,
 * naive-quantized int8 per tensor asymmetric with an f32 scale,
 * float-quantized FP8 per channel with bf16 scales, float-quantized FP8 in
 * 16 x 32 blocks with f16 scales) and in fbgemm's layout. Each is read in
 * place (QT_CT_INT or QT_FP8, the scales in their stored dtype),
 * dequantized bit for bit as the compressor's own decompress(), its logits
 * and greedy ids against the float64 forward over those weights, a PEFT
 * adapter unmerged and merged into the same layout, a --dtype bf16 load
 * that leaves the scales alone, inspect's lines, and the configs refused
 * by name. tests/fixtures/make_ctensors_reference.py made the fixtures.
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
#include "qtensor.h"
#include "run_prompt.h"
#include "test_util.h"
#include "tiny_model.h"

#include "lora_fixture.h"
#include "quant_checkpoint.h"
#include "ref_forward.h"

#include "fixtures/ctensors_reference.h"

/* One fixture and its references. */
typedef struct ct_case {
    const char *folder; /* under tests/fixtures */
    const char *format; /* eng_model.format */
    qt_kind kind;
    qt_scale_dtype scale_dtype;
    int32_t bits;             /* CT_INT */
    int32_t block_rows;       /* 0: the whole weight's rows */
    int32_t block_cols;       /* 0: the whole weight's cols */
    bool zeros;               /* asymmetric */
    const char *quant;        /* eng_model.quant */
    double merged_tol;        /* worst |merged - (W + delta)| / |delta| */
    const ct_digest *digests; /* 14, one per linear */
    const double *logits;
    const int *greedy;
} ct_case;

#define DIGESTS(x) x##_DIGESTS
/* The merge bounds: measured worst 0.32 (int4, group 16), 0.025 (int8
 * per channel and per tensor), 0.22 to 0.24 (FP8), with room; a dropped
 * delta (1) or a halved one (0.5) fails each. */
static const ct_case CASES[] = {
    {"ct_int4_group_asym", "compressed-tensors", QT_CT_INT, QT_SCALE_BF16, 4, 1, 16, true,
     "ct-int4-b1x16-bf16-asym", 0.45, CT_INT4_GROUP_ASYM_DIGESTS, &CT_INT4_GROUP_ASYM_LOGITS[0][0],
     CT_INT4_GROUP_ASYM_GREEDY},
    {"ct_int8_channel_sym", "compressed-tensors", QT_CT_INT, QT_SCALE_F16, 8, 1, 0, false,
     "ct-int8-b1x64-f16-sym", 0.05, CT_INT8_CHANNEL_SYM_DIGESTS, &CT_INT8_CHANNEL_SYM_LOGITS[0][0],
     CT_INT8_CHANNEL_SYM_GREEDY},
    {"ct_int8_tensor_naive", "compressed-tensors", QT_CT_INT, QT_SCALE_F32, 8, 0, 0, true,
     "ct-int8-b64x64-f32-asym", 0.05, CT_INT8_TENSOR_NAIVE_DIGESTS,
     &CT_INT8_TENSOR_NAIVE_LOGITS[0][0], CT_INT8_TENSOR_NAIVE_GREEDY},
    {"ct_fp8_channel", "compressed-tensors", QT_FP8, QT_SCALE_BF16, 0, 1, 0, false,
     "fp8-b1x64-bf16", 0.35, CT_FP8_CHANNEL_DIGESTS, &CT_FP8_CHANNEL_LOGITS[0][0],
     CT_FP8_CHANNEL_GREEDY},
    {"ct_fp8_block", "compressed-tensors", QT_FP8, QT_SCALE_F16, 0, 16, 32, false, "fp8-b16x32-f16",
     0.35, CT_FP8_BLOCK_DIGESTS, &CT_FP8_BLOCK_LOGITS[0][0], CT_FP8_BLOCK_GREEDY},
    {"fbgemm_fp8_tiny", "fbgemm_fp8", QT_FP8, QT_SCALE_F32, 0, 1, 0, false, "fp8-b1x64-f32", 0.35,
     CT_FBGEMM_DIGESTS, &CT_FBGEMM_LOGITS[0][0], CT_FBGEMM_GREEDY},
};
#define N_CASES   (sizeof CASES / sizeof CASES[0])
#define N_LINEARS 14

static void fixture_dir(const ct_case *c, char *dir, size_t len)
{
    test_tmpdir(dir, len);
    tiny_fixture_folder(c->folder, dir);
}

/* The case's fixture copied into a new dir and loaded into *m (--dtype dtype). */
static void open_case(const ct_case *c, char *dir, size_t len, eng_model *m, const char *dtype)
{
    char msg[1024];
    fixture_dir(c, dir, len);
    eng_load_opts o = {.path = dir, .dtype = dtype};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

/* The layout of a weight is the case's. */
static void check_layout(const ct_case *c, const qtensor *t)
{
    cr_assert(t->kind == c->kind, "%s: %s", c->folder, qt_kind_name(t->kind));
    cr_assert_eq(t->scale_dtype, c->scale_dtype, "%s: scales %s", c->folder,
                 qt_scale_dtype_name(t->scale_dtype));
    cr_assert_eq(t->block_rows, c->block_rows ? c->block_rows : t->rows, "%s", c->folder);
    cr_assert_eq(t->block_cols, c->block_cols ? c->block_cols : t->cols, "%s", c->folder);
    if (c->kind == QT_CT_INT)
        cr_assert(t->bits == c->bits && (t->block_zeros != NULL) == c->zeros, "%s", c->folder);
}

/* Every linear weight dequantizes to the compressor's decompress() bits
 * (a digest of the whole tensor), scalar and dispatched entry alike. */
Test(ctensors, every_scheme_dequantizes_as_compressed_tensors_bit_for_bit)
{
    for (size_t k = 0; k < N_CASES; k++) {
        const ct_case *c = &CASES[k];
        char dir[512];
        eng_model m;
        open_case(c, dir, sizeof dir, &m, NULL);
        cr_assert_str_eq(m.format, c->format);
        cr_assert_str_eq(m.quant, c->quant);
        for (size_t i = 0; i < N_LINEARS; i++) {
            const qtensor *t = qcp_projection(&m, c->digests[i].name);
            check_layout(c, t);
            cr_assert(t->data_borrowed, "%s: the codes are read in place", c->folder);
            size_t n = (size_t)(t->rows * t->cols);
            float *out = malloc(n * sizeof *out), *fast = malloc(n * sizeof *fast);
            qt_dequantize_rows_ref(t, 0, t->rows, out);
            qt_dequantize_rows(t, 0, t->rows, fast);
            uint64_t h = qcp_fnv1a64(out, n * sizeof *out);
            cr_assert_eq(h, (uint64_t)c->digests[i].fnv, "%s %s: digest %016llx, reference %016llx",
                         c->folder, c->digests[i].name, (unsigned long long)h,
                         (unsigned long long)c->digests[i].fnv);
            cr_assert_eq(memcmp(out, fast, n * sizeof *out), 0, "%s", c->folder);
            free(out);
            free(fast);
        }
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

Test(ctensors, every_scheme_gives_the_float64_logits_and_greedy_ids)
{
    for (size_t k = 0; k < N_CASES; k++) {
        const ct_case *c = &CASES[k];
        char dir[512];
        eng_model m;
        open_case(c, dir, sizeof dir, &m, NULL);
        cr_assert_eq(m.lm_head.kind, QT_F32, "%s: lm_head is ignored, so dense", c->folder);
        qcp_logits_and_greedy(&m, c->folder,
                              &(qcp_reference){CT_TOKENS, CT_N_TOKENS, c->logits, CT_VOCAB,
                                               CT_PROMPT, (int)(sizeof CT_PROMPT / sizeof(int)),
                                               c->greedy, CT_N_GREEDY});
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* --dtype bf16 casts the dense parameters only: every scale keeps its
 * stored dtype and bytes (bf16, f16 and f32 alike), and the zero points
 * their values. */
Test(ctensors, bf16_load_keeps_every_scale_as_stored)
{
    for (size_t k = 0; k < N_CASES; k++) {
        const ct_case *c = &CASES[k];
        char dir[512], msg[1024], path[1024];
        eng_model m;
        open_case(c, dir, sizeof dir, &m, "bf16");
        cr_assert_eq(m.lm_head.kind, QT_BF16);
        snprintf(path, sizeof path, "%s/%s/model.safetensors", QL_FIXTURES, c->folder);
        st_file f;
        cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
        const st_tensor *s = st_find(&f, "model.layers.1.mlp.down_proj.weight_scale");
        const qtensor *w = &m.layers[1].w_down;
        check_layout(c, w);
        cr_assert(s &&
                  (size_t)(w->scale_rows * w->scale_cols) * qt_scale_dtype_size(w->scale_dtype) ==
                      s->nbytes);
        cr_assert_eq(memcmp(w->block_scales, s->data, s->nbytes), 0, "%s", c->folder);
        st_close(&f);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* A fixture with config.json's `from` replaced by `to`; loading must fail
 * with a message holding `want`. */
static void check_refused(const char *folder, const char *from, const char *to, const char *want)
{
    char dir[512];
    test_tmpdir(dir, sizeof dir);
    tiny_fixture_folder(folder, dir);
    qcp_refused(dir, from, to, want);
    test_rmtree(dir);
}

Test(ctensors, configs_it_cannot_read_are_refused_by_name)
{
    const char *i4 = "ct_int4_group_asym", *f8 = "ct_fp8_channel";
    check_refused(i4, "\"format\": \"pack-quantized\",\n    \"global",
                  "\"format\": \"marlin-24\",\n    \"global", "format marlin-24 is not supported");
    check_refused(i4, "\"format\": \"pack-quantized\",\n        \"input",
                  "\"format\": \"nvfp4-pack-quantized\",\n        \"input",
                  "format nvfp4-pack-quantized is not supported");
    check_refused(i4, "\"num_bits\": 4", "\"num_bits\": 3", "num_bits 3 is not supported");
    check_refused(i4, "\"strategy\": \"group\"", "\"strategy\": \"tensor_group\"",
                  "strategy tensor_group is not supported");
    check_refused(i4, "\"quantization_status\": \"compressed\"",
                  "\"quantization_status\": \"frozen\"", "quantization_status frozen");
    check_refused(i4, "\"kv_cache_scheme\": null", "\"kv_cache_scheme\": {\"num_bits\": 8}",
                  "kv_cache_scheme is not supported");
    check_refused(i4, "\"output_activations\": null", "\"output_activations\": {\"num_bits\": 8}",
                  "output_activations is not supported");
    check_refused(i4, "\"Linear\"", "\"LlamaAttention\"", "entry LlamaAttention is not supported");
    check_refused(f8, "\"dynamic\": true", "\"dynamic\": false",
                  "input_activations with static scales");
    /* the weights' block is the one its two closing braces end */
    check_refused(f8, "\"symmetric\": true,\n          \"type\": \"float\"\n        }\n      }",
                  "\"symmetric\": false,\n          \"type\": \"float\"\n        }\n      }",
                  "asymmetric fp8");
    /* 8 bits said of a 4-bit file: weight_packed is half as wide as 8-bit codes need */
    check_refused(i4, "\"num_bits\": 4", "\"num_bits\": 8", "expected I32 [64, 16]");
    /* the config and the file disagree on which modules are quantized */
    check_refused(i4, "\"lm_head\"", "\"lm_head\", \"re:.*mlp.*\"",
                  "model.layers.0.mlp.gate_proj is stored quantized but no config group");
    check_refused(i4, "\"ignore\": [\n      \"lm_head\"\n    ]", "\"ignore\": []",
                  "targets lm_head but the checkpoint holds it dense");
}

/* s with every `from` replaced by `to` (a new string, the caller's). */
static char *replace_all(const char *s, const char *from, const char *to)
{
    size_t n = 0, lf = strlen(from), lt = strlen(to);
    for (const char *p = strstr(s, from); p; p = strstr(p + lf, from))
        n++;
    char *out = malloc(strlen(s) + n * lt + 1), *o = out;
    for (const char *p; (p = strstr(s, from)); s = p + lf) {
        memcpy(o, s, (size_t)(p - s));
        o += p - s;
        memcpy(o, to, lt);
        o += lt;
    }
    strcpy(o, s);
    return out;
}

/* llm-compressor's W8A8 int8 (format int-quantized, dynamic per-token
 * input activations) stores what naive-quantized stores: it loads, the
 * same weights, with activations kept in float. */
Test(ctensors, int_quantized_with_dynamic_activations_loads_as_naive)
{
    const ct_case *c = &CASES[2];
    char dir[512], path[700];
    fixture_dir(c, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len;
    char *text = test_read_file(path, &len);
    char *a = replace_all(text, "naive-quantized", "int-quantized");
    char *b = replace_all(a, "\"input_activations\": null",
                          "\"input_activations\": {\"dynamic\": true, \"num_bits\": 8, "
                          "\"strategy\": \"token\", \"symmetric\": true, \"type\": \"int\"}");
    cr_assert(strcmp(a, b) != 0 && strcmp(text, a) != 0);
    test_write_text(path, b);
    eng_model m;
    char msg[1024];
    eng_load_opts o = {.path = dir};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_str_eq(m.quant, c->quant);
    const qtensor *t = qcp_projection(&m, c->digests[0].name);
    size_t n = (size_t)(t->rows * t->cols);
    float *out = malloc(n * sizeof *out);
    qt_dequantize_rows(t, 0, t->rows, out);
    cr_assert_eq(qcp_fnv1a64(out, n * sizeof *out), (uint64_t)c->digests[0].fnv);
    free(out);
    free(text);
    free(a);
    free(b);
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(ctensors, qlserve_quantizes_to_ct_int_only_into_a_loaded_layout)
{
    float x[64] = {0};
    qt_quant_params p = {.kind = QT_CT_INT};
    qtensor q;
    char msg[256];
    cr_assert_eq(qt_quantize(&q, x, 8, 8, &p, msg, sizeof msg), QL_EUNSUPPORTED);
    cr_assert(strstr(msg, "ct_int is read from compressed-tensors checkpoints"), "%s", msg);
}

/* `qlserve quantize` never takes a compressed-tensors checkpoint's packed
 * codes, int8 weights or 16-bit scales for weights: every integer scheme's
 * file is refused as already quantized. */
Test(ctensors, quantize_refuses_a_compressed_tensors_file)
{
    static const char *const names[] = {"ct_int4_group_asym", "ct_int8_channel_sym",
                                        "ct_int8_tensor_naive"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        char path[1024], out[600], dir[512], msg[1024];
        test_tmpdir(dir, sizeof dir);
        snprintf(out, sizeof out, "%s/out.safetensors", dir);
        snprintf(path, sizeof path, "%s/%s/model.safetensors", QL_FIXTURES, names[k]);
        eng_quantize_opts o = {.in_path = path, .out_path = out, .kind = "nf4"};
        cr_assert_eq(eng_quantize_file(&o, NULL, msg, sizeof msg), QL_EINVAL, "%s", names[k]);
        cr_assert(strstr(msg, "already quantized (compressed-tensors"), "%s: %s", names[k], msg);
        test_rmtree(dir);
    }
}

/* One scheme of the requantizer's vectors: its layout, what
 * compressed-tensors stored (codes, scales' bits, zero points or NULL). */
typedef struct qv_case {
    const char *name;
    qt_kind kind;
    int32_t bits, block_rows, block_cols; /* 0: the whole dim */
    bool packed;
    qt_scale_dtype scale_dtype;
    const unsigned char *codes;
    size_t n_codes;
    const unsigned *scale_bits;
    const signed char *zeros;
} qv_case;

#define QV(n) CT_QV_##n##_CODES, sizeof CT_QV_##n##_CODES, CT_QV_##n##_SCALE_BITS

/* The scales' bits as stored bytes (2 or 4 each, little-endian). */
static void *scale_bytes(const qv_case *c, int64_t n)
{
    size_t es = qt_scale_dtype_size(c->scale_dtype);
    uint8_t *b = malloc((size_t)n * es);
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = c->scale_bits[i];
        memcpy(b + i * (int64_t)es, &v, es); /* little-endian host */
    }
    return b;
}

/* A merge's requantization (qt_quantize into a loaded layout) gives, for
 * f32 weights, the codes, scales and zero points compressed-tensors'
 * calculate_qparams and compress() give, byte for byte: every integer
 * scheme of the fixtures, and FP8 with bf16 and f16 scales. */
Test(ctensors, requantizing_gives_compressed_tensors_bytes)
{
    static const qv_case cases[] = {
        {"int4 group asym bf16", QT_CT_INT, 4, 1, 16, true, QT_SCALE_BF16, QV(INT4_GROUP_ASYM),
         CT_QV_INT4_GROUP_ASYM_ZEROS},
        {"int8 channel sym f16", QT_CT_INT, 8, 1, 0, true, QT_SCALE_F16, QV(INT8_CHANNEL_SYM),
         NULL},
        {"int8 tensor naive f32", QT_CT_INT, 8, 0, 0, false, QT_SCALE_F32, QV(INT8_TENSOR_NAIVE),
         CT_QV_INT8_TENSOR_NAIVE_ZEROS},
        {"fp8 channel bf16", QT_FP8, 8, 1, 0, false, QT_SCALE_BF16, QV(FP8_CHANNEL), NULL},
        {"fp8 block f16", QT_FP8, 8, 16, 32, false, QT_SCALE_F16, QV(FP8_BLOCK), NULL},
    };
    const int64_t rows = CT_QV_ROWS, cols = CT_QV_COLS;
    float x[CT_QV_ROWS * CT_QV_COLS];
    memcpy(x, CT_QV_INPUT_BITS, sizeof x);
    char msg[256];
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const qv_case *c = &cases[k];
        int32_t br = c->block_rows ? c->block_rows : (int32_t)rows;
        int32_t bc = c->block_cols ? c->block_cols : (int32_t)cols;
        int64_t grid = ((rows + br - 1) / br) * ((cols + bc - 1) / bc);
        void *scales = scale_bytes(c, grid);
        qtensor layout = {0}, q;
        qt_quant_params p = {.kind = c->kind,
                             .block_rows = br,
                             .block_cols = bc,
                             .scale_dtype = c->scale_dtype,
                             .layout = &layout};
        if (c->kind == QT_CT_INT) {
            qt_ct_int_parts parts = {.rows = rows,
                                     .cols = cols,
                                     .bits = c->bits,
                                     .packed = c->packed,
                                     .block_rows = br,
                                     .block_cols = bc,
                                     .codes = c->codes,
                                     .scale_dtype = c->scale_dtype,
                                     .scales = scales,
                                     .scale_rows = (rows + br - 1) / br,
                                     .scale_cols = (cols + bc - 1) / bc,
                                     .zeros = (const uint8_t *)c->zeros};
            cr_assert_eq(qt_from_ct_int(&layout, &parts, msg, sizeof msg), 0, "%s", msg);
        }
        cr_assert_eq(qt_quantize(&q, x, rows, cols, &p, msg, sizeof msg), 0, "%s: %s", c->name,
                     msg);
        cr_assert_eq(q.data_bytes, c->n_codes, "%s", c->name);
        cr_assert_eq(memcmp(q.data, c->codes, c->n_codes), 0, "%s: codes", c->name);
        cr_assert_eq(
            memcmp(q.block_scales, scales, (size_t)grid * qt_scale_dtype_size(c->scale_dtype)), 0,
            "%s: scales", c->name);
        if (c->zeros)
            cr_assert_eq(memcmp(q.block_zeros, c->zeros, (size_t)grid), 0, "%s: zeros", c->name);
        qt_free(&q);
        qt_free(&layout);
        free(scales);
    }
}

/* A PEFT adapter (every projection, r 8) on each base: applied unmerged,
 * the logits are the float64 forward over dequant(W) + BA; merged into
 * its own kind, the same layout (bits, block, zero points, scale dtype)
 * within a share of |BA|; unmerged again, the pristine weights bit for bit. */
Test(ctensors, adapters_unmerged_merged_and_unmerged_again)
{
    for (size_t k = 0; k < N_CASES; k++) {
        const ct_case *c = &CASES[k];
        char dir[512];
        eng_model m;
        open_case(c, dir, sizeof dir, &m, NULL);
        ref_model R;
        eng_lora *lora =
            qcp_unmerged_adapter(&m, dir, c->folder, CT_TOKENS, CT_N_TOKENS, CT_VOCAB, &R);
        eng_lora_term term = {lora, 1.0f};
        eng_weights *v = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
        for (int32_t l = 0; l < m.cfg.n_layers; l++)
            check_layout(c, eng_weights_proj(v, l, ENG_PROJ_DOWN));
        double err = qcp_merged_error(v, &m, &R, c->kind);
        cr_assert(err <= c->merged_tol, "%s: merged into %s off by %g of |delta|", c->folder,
                  qt_kind_name(c->kind), err);
        eng_weights_unref(v);
        /* the pristine weights a version without the merge serves (an
         * unmerge) are the checkpoint's, bit for bit */
        for (size_t i = 0; i < N_LINEARS; i++) {
            const qtensor *t = qcp_projection(&m, c->digests[i].name);
            size_t n = (size_t)(t->rows * t->cols);
            float *out = malloc(n * sizeof *out);
            qt_dequantize_rows(t, 0, t->rows, out);
            cr_assert_eq(qcp_fnv1a64(out, n * sizeof *out), (uint64_t)c->digests[i].fnv);
            free(out);
        }
        ref_free(&R);
        eng_lora_unref(lora);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* `qlserve inspect` names the format, the linear layers' layout and each
 * kind with its scales' dtype. */
Test(ctensors, inspect_names_the_kind_and_scale_dtype)
{
    static const char *const counts[N_CASES] = {
        "ct_int (bf16 scales) x14", "ct_int (f16 scales) x14", "ct_int (f32 scales) x14",
        "fp8 (bf16 scales) x14",    "fp8 (f16 scales) x14",    "fp8 (f32 scales) x14",
    };
    for (size_t k = 0; k < N_CASES; k++) {
        const ct_case *c = &CASES[k];
        char dir[512], msg[1024], want[128];
        fixture_dir(c, dir, sizeof dir);
        char *text = NULL;
        size_t len = 0;
        FILE *out = open_memstream(&text, &len);
        eng_load_opts o = {.path = dir};
        cr_assert_eq(eng_inspect(dir, &o, out, msg, sizeof msg), 0, "%s", msg);
        fclose(out);
        snprintf(want, sizeof want, ": %s model", c->format);
        cr_assert(strstr(text, want), "%s", text);
        snprintf(want, sizeof want, "linear layers %s", c->quant);
        cr_assert(strstr(text, want), "%s", text);
        cr_assert(strstr(text, counts[k]), "%s", text);
        free(text);
        test_rmtree(dir);
    }
}

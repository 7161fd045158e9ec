/*
 * test_gptq.c - GPTQ checkpoints (quant_method "gptq", the layout optimum,
 * auto-gptq and gptqmodel save): the QT_GPTQ kind read in place from a
 * tiny Llama written in GPTQ's layout in two variants (gptq_tiny_v1: 4
 * bits, group 16, asymmetric, act-order g_idx, v1 zeros stored as z - 1;
 * gptq_tiny_v2: 8 bits, group 32, symmetric, checkpoint_format gptq_v2),
 * dequantized bit for bit as the reference unpacking, its logits and
 * greedy ids against the float64 forward over those weights, a --dtype
 * bf16 load that leaves the f16 scales alone, an unmerged PEFT adapter,
 * and the configs qlserve refuses by name.
 * tests/fixtures/make_gptq_reference.py made the fixtures.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "inspect_text.h"
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

#include "fixtures/gptq_reference.h"

/* One variant's fixture and references. */
typedef struct gptq_case {
    const char *folder; /* under tests/fixtures */
    qt_kind kind;
    int32_t bits, group_size, zero_offset;
    const gptq_digest *digests;
    size_t n_digests;
    const double *logits;
    const int *greedy;
} gptq_case;

static const gptq_case GPTQ_V1 = {"gptq_tiny_v1",
                                  QT_GPTQ,
                                  4,
                                  16,
                                  1,
                                  GPTQ_V1_DIGESTS,
                                  sizeof GPTQ_V1_DIGESTS / sizeof GPTQ_V1_DIGESTS[0],
                                  &GPTQ_V1_LOGITS[0][0],
                                  GPTQ_V1_GREEDY};
static const gptq_case GPTQ_V2 = {"gptq_tiny_v2",
                                  QT_GPTQ,
                                  8,
                                  32,
                                  0,
                                  GPTQ_V2_DIGESTS,
                                  sizeof GPTQ_V2_DIGESTS / sizeof GPTQ_V2_DIGESTS[0],
                                  &GPTQ_V2_LOGITS[0][0],
                                  GPTQ_V2_GREEDY};
static const gptq_case AWQ = {"awq_tiny",
                              QT_AWQ,
                              4,
                              32,
                              0,
                              GPTQ_AWQ_DIGESTS,
                              sizeof GPTQ_AWQ_DIGESTS / sizeof GPTQ_AWQ_DIGESTS[0],
                              &GPTQ_AWQ_LOGITS[0][0],
                              GPTQ_AWQ_GREEDY};

static void fixture_dir(const gptq_case *c, char *dir, size_t len)
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

/* Every linear weight dequantizes to the reference unpacking's float32
 * bits (a digest of the whole tensor), scalar and dispatched entry alike. */
static void check_dequantization(const gptq_case *c)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    cr_assert_str_eq(m.format, qt_kind_name(c->kind));
    for (size_t i = 0; i < c->n_digests; i++) {
        const qtensor *t = qcp_projection(&m, c->digests[i].name);
        cr_assert(t->kind == c->kind && t->data_borrowed && t->bits == c->bits &&
                  t->group_size == c->group_size && t->gptq_zero_offset == c->zero_offset);
        size_t n = (size_t)(t->rows * t->cols);
        float *out = malloc(n * sizeof *out), *fast = malloc(n * sizeof *fast);
        qt_dequantize_rows_ref(t, 0, t->rows, out);
        qt_dequantize_rows(t, 0, t->rows, fast);
        uint64_t h = qcp_fnv1a64(out, n * sizeof *out);
        cr_assert_eq(h, (uint64_t)c->digests[i].fnv, "%s: digest %016llx, reference %016llx",
                     c->digests[i].name, (unsigned long long)h,
                     (unsigned long long)c->digests[i].fnv);
        cr_assert_eq(memcmp(out, fast, n * sizeof *out), 0);
        free(out);
        free(fast);
    }
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(gptq, v1_act_order_dequantizes_as_the_reference_bit_for_bit)
{
    check_dequantization(&GPTQ_V1);
}

Test(gptq, v2_8bit_dequantizes_as_the_reference_bit_for_bit)
{
    check_dequantization(&GPTQ_V2);
}

Test(gptq, awq_gemm_dequantizes_as_autoawq_bit_for_bit)
{
    check_dequantization(&AWQ);
}

Test(gptq, v1_fixture_is_act_ordered)
{
    /* the act-order fixture's g_idx is not c / group_size (else the
     * permutation would go untested) */
    char dir[512];
    fixture_dir(&GPTQ_V1, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    const qtensor *t = &m.layers[0].wq;
    int64_t moved = 0;
    for (int64_t c = 0; c < t->cols; c++)
        moved += t->gptq_g_idx[c] != c / t->group_size;
    cr_assert(moved > t->cols / 2, "only %lld channels permuted", (long long)moved);
    eng_model_free(&m);
    test_rmtree(dir);
}

static void check_logits_and_greedy(const gptq_case *c)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    cr_assert_eq(m.lm_head.kind, QT_F32);
    qcp_logits_and_greedy(&m, c->folder,
                          &(qcp_reference){GPTQ_TOKENS, GPTQ_N_TOKENS, c->logits, GPTQ_VOCAB,
                                           GPTQ_PROMPT, (int)(sizeof GPTQ_PROMPT / sizeof(int)),
                                           c->greedy, GPTQ_N_GREEDY});
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(gptq, v1_logits_and_greedy_ids_match_float64)
{
    check_logits_and_greedy(&GPTQ_V1);
}

Test(gptq, v2_logits_and_greedy_ids_match_float64)
{
    check_logits_and_greedy(&GPTQ_V2);
}

Test(gptq, awq_logits_and_greedy_ids_match_float64)
{
    check_logits_and_greedy(&AWQ);
}

Test(gptq, bf16_load_keeps_f16_scales_and_packed_zeros)
{
    char dir[512], msg[1024], path[1024];
    fixture_dir(&GPTQ_V1, dir, sizeof dir);
    eng_model m;
    load(&m, dir, "bf16");
    cr_assert_eq(m.lm_head.kind, QT_BF16);
    snprintf(path, sizeof path, "%s/%s/model.safetensors", QL_FIXTURES, GPTQ_V1.folder);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    const st_tensor *s = st_find(&f, "model.layers.1.mlp.down_proj.scales");
    const st_tensor *z = st_find(&f, "model.layers.1.mlp.down_proj.qzeros");
    cr_assert(s && z && s->dtype == ST_F16);
    const qtensor *w = &m.layers[1].w_down;
    cr_assert_eq(w->kind, QT_GPTQ);
    cr_assert_eq((size_t)(w->gptq_groups * w->rows) * 2, s->nbytes);
    cr_assert_eq(memcmp(w->gptq_scales, s->data, s->nbytes), 0);
    cr_assert_eq(memcmp(w->gptq_qzeros, z->data, z->nbytes), 0);
    st_close(&f);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* The v1 fixture with config.json's `from` replaced by `to`; loading must
 * fail with a message holding `want`. */
static void check_refused_in(const gptq_case *c, const char *from, const char *to, const char *want)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    qcp_refused(dir, from, to, want);
    test_rmtree(dir);
}

static void check_refused(const char *from, const char *to, const char *want)
{
    check_refused_in(&GPTQ_V1, from, to, want);
}

Test(gptq, configs_and_layouts_it_cannot_read_are_refused_by_name)
{
    check_refused("\"bits\": 4", "\"bits\": 3", "bits must be 4 or 8");
    check_refused("\"bits\": 4", "\"bits\": 2", "bits must be 4 or 8");
    check_refused("\"checkpoint_format\": \"gptq\"", "\"checkpoint_format\": \"marlin\"",
                  "checkpoint_format marlin");
    check_refused("\"desc_act\"", "\"is_marlin_format\": true, \"desc_act\"", "is_marlin_format");
    check_refused("\"group_size\": 16", "\"group_size\": 0", "group_size");
    /* 8 bits on a 4-bit file: qweight has half the rows 8-bit codes need */
    check_refused("\"bits\": 4", "\"bits\": 8", "does not hold a 8-bit");
    /* a GPTQ file said to be AWQ: the packing does not fit the shapes */
    check_refused("\"quant_method\": \"gptq\"", "\"quant_method\": \"awq\"",
                  "awq 'model.layers.0.self_attn.q_proj.qweight' (I32 [8, 64])");
}

Test(gptq, awq_configs_it_cannot_read_are_refused_by_name)
{
    check_refused_in(&AWQ, "\"version\": \"gemm\"", "\"version\": \"gemv\"",
                     "version gemv is not supported for awq");
    check_refused_in(&AWQ, "\"zero_point\": true", "\"zero_point\": false", "zero_point false");
    check_refused_in(&AWQ, "\"bits\": 4", "\"bits\": 8", "bits must be 4 for awq");
    /* an AWQ file said to be GPTQ: the packing does not fit the shapes */
    check_refused_in(&AWQ, "\"quant_method\": \"awq\"", "\"quant_method\": \"gptq\"",
                     "gptq 'model.layers.0.self_attn.q_proj.qweight' (I32 [64, 8])");
}

Test(gptq, qlserve_does_not_quantize_to_gptq)
{
    float x[64] = {0};
    qt_quant_params p = {.kind = QT_GPTQ};
    qtensor q;
    char msg[256];
    cr_assert_eq(qt_quantize(&q, x, 8, 8, &p, msg, sizeof msg), QL_EUNSUPPORTED);
    cr_assert(strstr(msg, "gptq is read from checkpoints"), "%s", msg);
}

/* A PEFT adapter (every projection, r 8) on the base: applied unmerged,
 * the logits are the float64 forward over dequant(W) + BA; merged into
 * bf16, within bf16's rounding of W + BA; merged into its own kind, the
 * same layout (bits, g_idx, zero convention) within a share of |BA|. */
static void check_adapter(const gptq_case *c, double own_tol)
{
    char dir[512];
    fixture_dir(c, dir, sizeof dir);
    eng_model m;
    load(&m, dir, NULL);
    ref_model R;
    eng_lora *lora =
        qcp_unmerged_adapter(&m, dir, c->folder, GPTQ_TOKENS, GPTQ_N_TOKENS, GPTQ_VOCAB, &R);
    eng_lora_term term = {lora, 1.0f};
    eng_weights *v = lora_fix_merged_version(&m, &term, 1, QT_BF16);
    double bf16_err = qcp_merged_error(v, &m, &R, QT_BF16);
    cr_assert(bf16_err <= 0.05, "%s: merged into bf16 off by %g of |delta|", c->folder, bf16_err);
    eng_weights_unref(v);
    v = lora_fix_merged_version(&m, &term, 1, QT_KIND_COUNT);
    for (int32_t l = 0; l < m.cfg.n_layers; l++) {
        const qtensor *q = eng_weights_proj(v, l, ENG_PROJ_DOWN), *w = &m.layers[l].w_down;
        cr_assert(q->bits == w->bits && q->gptq_groups == w->gptq_groups &&
                  q->gptq_zero_offset == w->gptq_zero_offset &&
                  memcmp(q->gptq_g_idx, w->gptq_g_idx, (size_t)w->cols * 4) == 0);
    }
    double own_err = qcp_merged_error(v, &m, &R, c->kind);
    cr_assert(own_err <= own_tol, "%s: merged into %s off by %g of |delta|", c->folder,
              qt_kind_name(c->kind), own_err);
    eng_weights_unref(v);
    ref_free(&R);
    eng_lora_unref(lora);
    eng_model_free(&m);
    test_rmtree(dir);
}

/* Requantizing costs what one 4-bit step is against these adapters'
 * deltas: measured worst 0.32 (v1, group 16), 0.37 (AWQ, group 32) and
 * 0.024 (8 bits), so 0.45 and 0.05, which a dropped delta (1) or a halved
 * one (0.5) fails. bf16 measured 0.02. */
Test(gptq, v1_adapter_unmerged_and_merged)
{
    check_adapter(&GPTQ_V1, 0.45);
}

Test(gptq, v2_adapter_unmerged_and_merged)
{
    check_adapter(&GPTQ_V2, 0.05);
}

Test(gptq, awq_adapter_unmerged_and_merged)
{
    check_adapter(&AWQ, 0.45);
}

/* `qlserve quantize` never takes a GPTQ checkpoint's f16 scales (2-D
 * floats) for weights: the file is refused as already quantized. */
Test(gptq, quantize_refuses_a_gptq_file)
{
    char path[1024], out[600], dir[512], msg[1024];
    test_tmpdir(dir, sizeof dir);
    snprintf(out, sizeof out, "%s/out.safetensors", dir);
    snprintf(path, sizeof path, "%s/gptq_tiny_v1/model.safetensors", QL_FIXTURES);
    eng_quantize_opts o = {.in_path = path, .out_path = out, .kind = "nf4"};
    cr_assert_eq(eng_quantize_file(&o, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "already quantized (gptq or awq"), "%s", msg);
    test_rmtree(dir);
}

/* `qlserve inspect` names the model's format and its GPTQ layers. */
Test(gptq, inspect_names_the_kind)
{
    char dir[512];
    fixture_dir(&GPTQ_V1, dir, sizeof dir);
    char *text = inspect_text(dir);
    cr_assert(strstr(text, ": gptq model"), "%s", text);
    cr_assert(strstr(text, "linear layers gptq-int4-g16-v1"), "%s", text);
    cr_assert(strstr(text, "gptq (f16 scales) x14"), "%s", text);
    free(text);
    test_rmtree(dir);
    fixture_dir(&AWQ, dir, sizeof dir);
    text = inspect_text(dir);
    cr_assert(strstr(text, ": awq model") && strstr(text, "linear layers awq-int4-g32") &&
                  strstr(text, "awq (f16 scales) x14"),
              "%s", text);
    free(text);
    test_rmtree(dir);
}

/*
 * test_lora_engine.c - adapters in the engine: unmerged per-request
 * application and merged weight versions against the float64 reference
 * (tests/ref_forward.h) for every quant kind; a batch mixing base,
 * adapters, a scaled adapter and an older weight version gives each
 * sequence its alone bits; a merge published in the middle of a running
 * generation leaves its tokens alone.
 *
 * Adapters here are built in memory (random A and B) so these tests pin
 * the engine's arithmetic; test_lora_load.c pins reading PEFT's files.
 *
 * Tolerance: FWD_REL_TOL (1e-5 relative L2 over one position's logits, as
 * test_forward.c argues): the adapters add two products of at most 96
 * terms per projection, well inside it, while a missing or doubled delta
 * moves these logits by more than 1e-2. A merged version's weights are
 * held to W + delta in float64 within a fraction of |delta| (merge_tol):
 * the requantization's rounding, which the logits of the merged version
 * then carry exactly.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"
#include "lora_fixture.h"
#include "ref_forward.h"
#include "test_util.h"
#include "tiny_model.h"

#define KV_BYTES  ((size_t)8 << 20)
#define MAX_TOKEN 64
#define ALL_PROJ  0x7fu

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

TestSuite(lora_engine, .init = setup, .fini = teardown, .timeout = 120);

/* --- adapters in memory ------------------------------------------------------ */

static void mem_lora_destroy(eng_lora *l)
{
    for (size_t i = 0; i < (size_t)l->n_layers * ENG_N_PROJ; i++) {
        qt_free(&l->modules[i].a);
        qt_free(&l->modules[i].b);
    }
    free(l->modules);
    free(l);
}

/* A rank-`rank` adapter on the projections in `mask` (bit p: eng_proj p),
 * A and B random normal times amp, stored as `dtype`. */
static eng_lora *mem_lora(const eng_model *m, const char *name, int rank, float module_scale,
                          unsigned mask, qt_kind dtype, uint64_t seed, float amp)
{
    eng_lora *l = calloc(1, sizeof *l);
    cr_assert(l);
    snprintf(l->name, sizeof l->name, "%s", name);
    l->n_layers = m->cfg.n_layers;
    l->n_proj = ENG_N_PROJ;
    l->modules = calloc((size_t)l->n_layers * ENG_N_PROJ, sizeof *l->modules);
    cr_assert(l->modules);
    uint64_t rng = seed;
    char msg[256];
    for (int32_t layer = 0; layer < l->n_layers; layer++) {
        for (int p = 0; p < ENG_N_PROJ; p++) {
            if (!(mask & (1u << p)))
                continue;
            const qtensor *w = eng_model_proj(m, layer, (eng_proj)p);
            eng_lora_module *mod = &l->modules[(size_t)layer * ENG_N_PROJ + (size_t)p];
            int64_t na = rank * w->cols, nb = w->rows * rank;
            float *a = malloc((size_t)na * sizeof *a), *b = malloc((size_t)nb * sizeof *b);
            cr_assert(a && b);
            for (int64_t i = 0; i < na; i++)
                a[i] = amp * test_normal(&rng);
            for (int64_t i = 0; i < nb; i++)
                b[i] = amp * test_normal(&rng);
            cr_assert_eq(qt_from_dense(&mod->a, QT_F32, a, rank, w->cols, msg, sizeof msg), 0);
            cr_assert_eq(qt_from_dense(&mod->b, QT_F32, b, w->rows, rank, msg, sizeof msg), 0);
            if (dtype != QT_F32) {
                cr_assert_eq(qt_cast_dense(&mod->a, dtype, msg, sizeof msg), 0);
                cr_assert_eq(qt_cast_dense(&mod->b, dtype, msg, sizeof msg), 0);
            }
            mod->scale = module_scale;
            l->bytes += qt_nbytes(&mod->a) + qt_nbytes(&mod->b);
            free(a);
            free(b);
        }
    }
    l->refs = 1;
    l->destroy = mem_lora_destroy;
    return l;
}

/* --- the model under test ------------------------------------------------------ */

typedef struct kind_case {
    const char *label;
    bool gguf;
    qt_kind gguf_kind;
    const char *quant, *dtype;
    int32_t group_size;
    /* GGUF with llama-quantize's Q4_K_M mix of types (tiny_model.h), on
     * 256-wide layers */
    bool q4_k_m;
    /* GGUF of a read-in-place kind (k-quants, IQ4): hidden 288 with the
     * 288-wide rows IQ4_NL (tiny_model.h's fallback), or 256 without */
    bool iq4_nl_fallback;
} kind_case;

/* Whether the case's weights merge into int8 (no requantizer for them). */
static bool merges_into_int8(const kind_case *kc)
{
    return kc->q4_k_m || (kc->gguf && test_kquant_is_read_only(kc->gguf_kind));
}

typedef struct rig {
    eng_model m;
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    int64_t vocab;
} rig;

static void rig_open(rig *g, const kind_case *kc)
{
    memset(g, 0, sizeof *g);
    char path[700], msg[1024];
    tiny_spec s = tiny_default();
    if (kc->q4_k_m) {
        s.hidden = 256;
        s.inter = 512;
        s.q4_k_m_mix = true;
    } else if (kc->gguf && qt_traits_table[kc->gguf_kind].block_size == 256) {
        s.hidden = kc->iq4_nl_fallback ? 288 : 256;
        s.inter = 512;
        s.iq4_nl_fallback = kc->iq4_nl_fallback;
    }
    if (kc->gguf) {
        snprintf(path, sizeof path, "%s/tiny.gguf", dir);
        tiny_write_gguf(path, &s, kc->gguf_kind);
    } else {
        snprintf(path, sizeof path, "%s", dir);
        tiny_write_hf(path, &s);
    }
    eng_load_opts o = {
        .path = path, .quant = kc->quant, .dtype = kc->dtype, .group_size = kc->group_size};
    cr_assert_eq(eng_model_load(&g->m, &o, msg, sizeof msg), 0, "%s: load: %s", kc->label, msg);
    g->vocab = g->m.cfg.vocab_size;
    cr_assert_eq(eng_pool_new(&g->pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&g->kv, &g->m.cfg, KV_BYTES, 16, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&g->st, &g->m, MAX_TOKEN, msg, sizeof msg), 0, "%s", msg);
}

static void rig_close(rig *g)
{
    eng_forward_state_free(g->st);
    eng_kv_free(g->kv);
    eng_pool_free(g->pool);
    eng_model_free(&g->m);
}

static void rig_step(rig *g, const eng_step_seq *seqs, int32_t n, float *logits, const char *label)
{
    char msg[1024] = "";
    for (int32_t i = 0; i < n; i++)
        cr_assert_eq(eng_kv_reserve(g->kv, seqs[i].kv, seqs[i].pos + seqs[i].n_tokens), QL_OK);
    int rc = eng_forward(g->st, &g->m, g->kv, g->pool, seqs, n, logits, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s: eng_forward: %s", label, msg);
}

/* --- 1. unmerged and merged against the float64 reference, every kind --------- */

/* Projection p of a reference layer: the dequantized weight. */
/*
 * How far a correct merge may be from W + delta, as a fraction of |delta|
 * (assert_merge_adds_delta). Codes of 8 bits or more (f32, f16, bf16, Q8_0,
 * int8) round to steps far below these adapters' deltas: measured worst
 * 0.0055 (IQ4_XS merged into int8), so 0.02 fails a delta 3% off. Codes
 * of 4 or 5 bits round W + delta to steps that are a sizeable part of the
 * delta: measured worst 0.18 (FP4), 0.16 (NF4), 0.10 (Q4_0), so 0.25,
 * still half of what the nearest wrong merge (the delta at half its
 * scale) scores.
 */
#define MERGE_TOL_8BIT   0.02
#define MERGE_TOL_4_5BIT 0.25

static double merge_tol(const qtensor *merged)
{
    bool eight_bits = qt_traits_table[merged->kind].is_dense || merged->kind == QT_Q8_0 ||
                      (merged->kind == QT_AFFINE && merged->bits >= 8);
    return eight_bits ? MERGE_TOL_8BIT : MERGE_TOL_4_5BIT;
}

/*
 * The merge against a reference it had no part in: every projection of
 * version v against dequant(W) + sum of scale * B @ A in float64
 * (ref_add_lora, from the model's weights and the adapters alone). A
 * targeted projection's worst error must be at most merge_tol times the
 * worst error of a merge that dropped the delta (|delta|): requantizing W +
 * delta costs a fraction of a quantization step, while a missing, doubled,
 * negated or misplaced delta costs |delta| or more, a half-scaled one half
 * of it. A projection no term targets must be the pristine one, bit for
 * bit.
 */
static void assert_merge_adds_delta(const eng_model *m, const eng_weights *v,
                                    const eng_lora_term *terms, size_t n, const char *label)
{
    ref_model R;
    ref_load(&R, m);
    for (size_t t = 0; t < n; t++)
        ref_add_lora(&R, terms[t].lora, terms[t].scale);
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const qtensor *q = eng_weights_proj(v, l, (eng_proj)p);
            int64_t rows = q->rows, cols = q->cols;
            float *got = malloc((size_t)(rows * cols) * sizeof *got);
            cr_assert(got);
            qt_dequantize_rows(q, 0, rows, got);
            const float *w = ref_proj(&R.layers[l], (eng_proj)p);
            const double *delta = R.layers[l].delta[p];
            test_diff merged = {0}, dropped = {0};
            for (int64_t i = 0; i < rows * cols; i++) {
                double want = (double)w[i] + (delta ? delta[i] : 0.0);
                test_diff_add(&merged, got[i], want);
                test_diff_add(&dropped, w[i], want);
            }
            if (!delta) {
                cr_assert(test_diff_abs(&merged) == 0.0,
                          "%s: layer %d %s is targeted by no adapter yet moved by %.3g", label, l,
                          eng_proj_name((eng_proj)p), test_diff_abs(&merged));
            } else {
                double tol = merge_tol(q);
                cr_assert(test_diff_abs(&merged) <= tol * test_diff_abs(&dropped),
                          "%s: layer %d %s: merged W + delta is off by %.3g (element %zu), "
                          "more than %g x the %.3g a dropped delta would be",
                          label, l, eng_proj_name((eng_proj)p), test_diff_abs(&merged),
                          merged.worst, tol, test_diff_abs(&dropped));
            }
            free(got);
        }
    }
    ref_free(&R);
}

#define PREFILL 7
#define DECODE  3

/* Prefill and decode one sequence on version w (NULL: the model's) with
 * delta applied, and compare each position with reference R. */
static void run_against(rig *g, const ref_model *R, const eng_weights *w,
                        const eng_lora_term *delta, int32_t n_delta, const char *label)
{
    int64_t V = g->vocab;
    int32_t tokens[PREFILL + DECODE] = {259, 72, 101, 108, 256, 258, 33};
    float *logits = malloc((size_t)((DECODE + 1) * V) * sizeof *logits);
    eng_seq_kv kv = {0};
    eng_step_seq s = {.kv = &kv,
                      .tokens = tokens,
                      .n_tokens = PREFILL,
                      .pos = 0,
                      .weights = w,
                      .delta = delta,
                      .n_delta = n_delta};
    rig_step(g, &s, 1, logits, label);
    for (int d = 0; d < DECODE; d++) {
        tokens[PREFILL + d] = argmax(logits + d * V, V);
        s = (eng_step_seq){.kv = &kv,
                           .tokens = tokens + PREFILL + d,
                           .n_tokens = 1,
                           .pos = PREFILL + d,
                           .weights = w,
                           .delta = delta,
                           .n_delta = n_delta};
        rig_step(g, &s, 1, logits + (d + 1) * V, label);
    }
    double *ref = malloc((size_t)((PREFILL + DECODE) * V) * sizeof *ref);
    ref_forward(R, tokens, PREFILL + DECODE, ref);
    for (int d = 0; d <= DECODE; d++)
        assert_logits_close(logits + d * V, ref + (PREFILL - 1 + d) * V, V, label,
                            d == 0 ? "prefill" : "decode", PREFILL - 1 + d);
    eng_kv_release(g->kv, &kv);
    free(ref);
    free(logits);
}

/* The logits of one position without any adapter, to show an adapter
 * moved them by far more than the tolerance. */
static double adapter_effect(rig *g, const eng_lora_term *delta, int32_t n)
{
    int64_t V = g->vocab;
    int32_t tokens[4] = {259, 72, 101, 108};
    float *a = malloc((size_t)V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
    eng_seq_kv k1 = {0}, k2 = {0};
    eng_step_seq s1 = {.kv = &k1, .tokens = tokens, .n_tokens = 4, .pos = 0};
    eng_step_seq s2 = {.kv = &k2,
                       .tokens = tokens,
                       .n_tokens = 4,
                       .pos = 0,
                       .weights = NULL,
                       .delta = delta,
                       .n_delta = n};
    rig_step(g, &s1, 1, a, "base");
    rig_step(g, &s2, 1, b, "adapter");
    double num = 0, den = 0;
    for (int64_t i = 0; i < V; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)a[i] * a[i];
    }
    eng_kv_release(g->kv, &k1);
    eng_kv_release(g->kv, &k2);
    free(a);
    free(b);
    return sqrt(num / den);
}

static void adapters_match_reference(const kind_case *kc)
{
    rig g;
    rig_open(&g, kc);
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 11, 0.1f);
    eng_lora *two = mem_lora(&g.m, "two", 8, 0.5f,
                             (1u << ENG_PROJ_Q) | (1u << ENG_PROJ_V) | (1u << ENG_PROJ_DOWN),
                             QT_BF16, 12, 0.1f);
    char label[128];

    // the adapters matter: they move the logits far past the tolerance
    eng_lora_term t1 = {one, 1.0f};
    double effect = adapter_effect(&g, &t1, 1);
    cr_assert(effect > 100 * FWD_REL_TOL, "%s: adapter one moves the logits by %.3g only",
              kc->label, effect);

    // unmerged: one adapter; two adapters, one scaled and one negative
    ref_model R;
    ref_load(&R, &g.m);
    ref_add_lora(&R, one, 0.75);
    eng_lora_term d1 = {one, 0.75f};
    snprintf(label, sizeof label, "%s unmerged one x0.75", kc->label);
    run_against(&g, &R, NULL, &d1, 1, label);
    ref_free(&R);

    ref_load(&R, &g.m);
    ref_add_lora(&R, one, 1.0);
    ref_add_lora(&R, two, -1.5);
    eng_lora_term d2[2] = {{one, 1.0f}, {two, -1.5f}};
    snprintf(label, sizeof label, "%s unmerged one - 1.5 two", kc->label);
    run_against(&g, &R, NULL, d2, 2, label);
    ref_free(&R);

    // merged: the version holds W + delta (against the float64 sum, not the
    // merge's output), and the engine serves it as the float64 model on the
    // version's own weights, dequant(Q(W + delta))
    eng_lora_term merged = {one, 1.0f};
    eng_weights *v =
        lora_fix_merged_version(&g.m, &merged, 1, merges_into_int8(kc) ? QT_AFFINE : QT_KIND_COUNT);
    snprintf(label, sizeof label, "%s merged one", kc->label);
    assert_merge_adds_delta(&g.m, v, &merged, 1, label);
    ref_load_version(&R, &g.m, v);
    run_against(&g, &R, v, NULL, 0, label);
    // a base request on the merged version applies minus the adapter, unmerged
    ref_add_lora(&R, one, -1.0);
    eng_lora_term *diff = NULL;
    size_t n_diff = 0;
    cr_assert_eq(eng_lora_difference(NULL, 0, v->merged, v->n_merged, &diff, &n_diff), 0);
    cr_assert_eq(n_diff, 1);
    cr_assert_eq(diff[0].lora, one);
    cr_assert_eq(diff[0].scale, -1.0f);
    snprintf(label, sizeof label, "%s base on merged", kc->label);
    run_against(&g, &R, v, diff, (int32_t)n_diff, label);
    free(diff);
    ref_free(&R);
    eng_weights_unref(v);

    eng_lora_unref(one);
    eng_lora_unref(two);
    rig_close(&g);
}

#define KIND_TEST(name, ...)                                                                       \
    Test(lora_engine, name)                                                                        \
    {                                                                                              \
        kind_case kc = {.label = #name, __VA_ARGS__};                                              \
        adapters_match_reference(&kc);                                                             \
    }

KIND_TEST(bf16_adapters_match_reference, .quant = NULL)
KIND_TEST(f32_adapters_match_reference, .dtype = "f32")
KIND_TEST(f16_adapters_match_reference, .dtype = "f16")
KIND_TEST(nf4_adapters_match_reference, .quant = "nf4")
KIND_TEST(nf4_double_quant_adapters_match_reference, .quant = "nf4-dq")
KIND_TEST(fp4_adapters_match_reference, .quant = "fp4")
KIND_TEST(int4_adapters_match_reference, .quant = "int4", .group_size = 32)
KIND_TEST(int8_adapters_match_reference, .quant = "int8")
KIND_TEST(gguf_q4_0_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q4_0)
KIND_TEST(gguf_q4_1_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q4_1)
KIND_TEST(gguf_q8_0_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q8_0)
KIND_TEST(gguf_q5_0_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q5_0)
KIND_TEST(gguf_q5_1_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q5_1)
KIND_TEST(gguf_q4_k_m_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q4_K, .q4_k_m = true)
KIND_TEST(gguf_q3_k_iq4_nl_fallback_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q3_K,
          .iq4_nl_fallback = true)
KIND_TEST(gguf_q2_k_adapters_match_reference, .gguf = true, .gguf_kind = QT_Q2_K)
KIND_TEST(gguf_iq4_xs_adapters_match_reference, .gguf = true, .gguf_kind = QT_IQ4_XS)

Test(lora_engine, merge_into_int8_and_bf16_matches_reference)
{
    kind_case kc = {.label = "nf4 into wider", .quant = "nf4"};
    rig g;
    rig_open(&g, &kc);
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 11, 0.1f);
    eng_lora_term t = {one, 1.0f};
    qt_kind into[2] = {QT_AFFINE, QT_BF16};
    for (int i = 0; i < 2; i++) {
        eng_weights *v = lora_fix_merged_version(&g.m, &t, 1, into[i]);
        assert_merge_adds_delta(&g.m, v, &t, 1, qt_kind_name(into[i]));
        ref_model R;
        ref_load_version(&R, &g.m, v);
        run_against(&g, &R, v, NULL, 0, qt_kind_name(into[i]));
        ref_free(&R);
        eng_weights_unref(v);
    }
    eng_lora_unref(one);
    rig_close(&g);
}

/* --- 2. a mixed batch gives each sequence its alone bits ---------------------- */

#define MB_SEQS  6
#define MB_STEPS 8

typedef struct mb_seq {
    int32_t tokens[64];
    int32_t n_prompt, n_tokens, start;
    const eng_weights *w;
    eng_lora_term delta[2];
    int32_t n_delta;
    eng_seq_kv kv;
    float *logits; /* [MB_STEPS][vocab]: its logits per step (NaN: no step) */
} mb_seq;

/* Run seqs together: each starts at its step, prefills its prompt in one
 * go, then decodes greedily. */
static void mb_run(rig *g, mb_seq **seqs, int n)
{
    int64_t V = g->vocab;
    eng_step_seq step[MB_SEQS];
    mb_seq *owner[MB_SEQS];
    float *logits = malloc((size_t)(MB_SEQS * V) * sizeof *logits);
    for (int k = 0; k < MB_STEPS; k++) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            mb_seq *s = seqs[i];
            if (k < s->start)
                continue;
            bool prefill = s->n_tokens == s->n_prompt && s->kv.n_tokens == 0;
            int32_t pos = prefill ? 0 : s->n_tokens - 1;
            step[m] = (eng_step_seq){.kv = &s->kv,
                                     .tokens = s->tokens + pos,
                                     .n_tokens = prefill ? s->n_prompt : 1,
                                     .pos = pos,
                                     .weights = s->w,
                                     .delta = s->delta,
                                     .n_delta = s->n_delta};
            owner[m++] = s;
        }
        if (m == 0)
            continue;
        rig_step(g, step, m, logits, "mixed batch");
        for (int j = 0; j < m; j++) {
            mb_seq *s = owner[j];
            memcpy(s->logits + k * V, logits + j * V, (size_t)V * sizeof(float));
            s->tokens[s->n_tokens++] = argmax(logits + j * V, V);
        }
    }
    for (int i = 0; i < n; i++)
        eng_kv_release(g->kv, &seqs[i]->kv);
    free(logits);
}

Test(lora_engine, mixed_batch_of_adapters_gives_each_sequence_its_alone_bits)
{
    kind_case kc = {.label = "nf4 mixed", .quant = "nf4"};
    rig g;
    rig_open(&g, &kc);
    int64_t V = g.vocab;
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 21, 0.1f);
    eng_lora *two = mem_lora(&g.m, "two", 8, 1.0f, ALL_PROJ, QT_BF16, 22, 0.1f);
    eng_lora_term merged_term = {two, 1.0f};
    eng_weights *v = lora_fix_merged_version(&g.m, &merged_term, 1, QT_KIND_COUNT);

    /* base, adapter one, adapter two, one at 0.5, base on the merged
     * version (minus two), one on the merged version (one, minus two) */
    mb_seq proto[MB_SEQS] = {
        {.start = 0},
        {.start = 0, .delta = {{one, 1.0f}}, .n_delta = 1},
        {.start = 1, .delta = {{two, 1.0f}}, .n_delta = 1},
        {.start = 2, .delta = {{one, 0.5f}}, .n_delta = 1},
        {.start = 1, .w = v, .delta = {{two, -1.0f}}, .n_delta = 1},
        {.start = 3, .w = v, .delta = {{one, 1.0f}, {two, -1.0f}}, .n_delta = 2},
    };
    mb_seq batch[MB_SEQS], alone[MB_SEQS];
    mb_seq *ptrs[MB_SEQS];
    for (int i = 0; i < MB_SEQS; i++) {
        proto[i].n_prompt = 3 + 2 * i;
        for (int t = 0; t < proto[i].n_prompt; t++)
            proto[i].tokens[t] = (int32_t)((37 * i + 11 * t) % 259);
        proto[i].n_tokens = proto[i].n_prompt;
        batch[i] = alone[i] = proto[i];
        batch[i].logits = malloc((size_t)(MB_STEPS * V) * sizeof(float));
        alone[i].logits = malloc((size_t)(MB_STEPS * V) * sizeof(float));
        ptrs[i] = &batch[i];
    }
    mb_run(&g, ptrs, MB_SEQS);
    for (int i = 0; i < MB_SEQS; i++) {
        mb_seq *one_seq = &alone[i];
        mb_run(&g, &one_seq, 1);
    }
    static const char *names[MB_SEQS] = {"base",     "one",        "two",
                                         "one x0.5", "base on v1", "one on v1"};
    for (int i = 0; i < MB_SEQS; i++) {
        cr_assert_eq(batch[i].n_tokens, alone[i].n_tokens);
        cr_assert(memcmp(batch[i].tokens, alone[i].tokens,
                         (size_t)batch[i].n_tokens * sizeof(int32_t)) == 0,
                  "%s: its tokens in the batch differ from alone", names[i]);
        for (int k = batch[i].start; k < MB_STEPS; k++)
            cr_assert(memcmp(batch[i].logits + k * V, alone[i].logits + k * V,
                             (size_t)V * sizeof(float)) == 0,
                      "%s: step %d logits differ in the batch from alone", names[i], k);
    }
    /* and the adapters were applied: each adapted sequence's prompt, run
     * alone on the base weights without adapters, gives prefill logits far
     * from its own (like with like: the same prompt, the same position).
     * "base on v1" is left out: minus two on the merged two is the base. */
    static const bool adapted[MB_SEQS] = {false, true, true, true, false, true};
    for (int i = 0; i < MB_SEQS; i++) {
        if (!adapted[i])
            continue;
        mb_seq plain = proto[i], *plain_seq = &plain;
        plain.w = NULL;
        plain.n_delta = 0;
        plain.logits = malloc((size_t)(MB_STEPS * V) * sizeof(float));
        mb_run(&g, &plain_seq, 1);
        int k = plain.start;
        test_diff d = test_diff_f32(alone[i].logits + k * V, plain.logits + k * V, (size_t)V);
        cr_assert(isfinite(test_diff_rel(&d)) && test_diff_rel(&d) > 100 * FWD_REL_TOL,
                  "%s: its adapters changed its prefill logits by %.3g only (worst logit %zu)",
                  names[i], test_diff_rel(&d), d.worst);
        free(plain.logits);
    }
    for (int i = 0; i < MB_SEQS; i++) {
        free(batch[i].logits);
        free(alone[i].logits);
    }
    eng_weights_unref(v);
    eng_lora_unref(one);
    eng_lora_unref(two);
    rig_close(&g);
}

/* --- 3. the engine: a merge in the middle of a generation ---------------------- */

typedef struct gen {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[128];
    int n;
    int pause_at;   /* block the engine thread after this many tokens (0: never) */
    bool released;  /* the test let it go on */
    int32_t cached; /* prompt tokens the prefix cache gave it */
    bool done;
    eng_finish why;
} gen;

static void gen_init(gen *g, int pause_at)
{
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->pause_at = pause_at;
}

static void gen_token(void *user, const eng_token_event *ev)
{
    int32_t token = ev->token;
    const char *text = ev->text;
    size_t len = ev->len;
    (void)text;
    (void)len;
    gen *g = user;
    pthread_mutex_lock(&g->mu);
    if (token >= 0 && g->n < 128)
        g->tokens[g->n++] = token;
    if (g->pause_at && g->n == g->pause_at) {
        /* hold the engine between two steps until the test has published */
        pthread_cond_broadcast(&g->cv);
        while (!g->released)
            pthread_cond_wait(&g->cv, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
}

static void gen_done(void *user, eng_finish why, const eng_usage *u)
{
    gen *g = user;
    pthread_mutex_lock(&g->mu);
    g->cached = u->cached_tokens;
    g->done = true;
    g->why = why;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void gen_wait(gen *g, bool (*until)(const gen *))
{
    pthread_mutex_lock(&g->mu);
    while (!until(g))
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static bool gen_paused(const gen *g)
{
    return g->done || (g->pause_at && g->n >= g->pause_at);
}

static bool gen_finished(const gen *g)
{
    return g->done;
}

static void gen_release(gen *g)
{
    pthread_mutex_lock(&g->mu);
    g->released = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static eng_request greedy_request(gen *g, int32_t n_new, const eng_lora_term *adapters, size_t n)
{
    static const char prompt[] = "the then he";
    return (eng_request){.prompt = prompt,
                         .prompt_len = sizeof prompt - 1,
                         .max_new_tokens = n_new,
                         .adapters = adapters,
                         .n_adapters = n,
                         .on_token = gen_token,
                         .on_done = gen_done,
                         .user = g};
}

Test(lora_engine, merge_in_the_middle_of_a_generation_leaves_its_tokens_alone)
{
    kind_case kc = {.label = "nf4 engine", .quant = "nf4"};
    rig g;
    rig_open(&g, &kc);
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 31, 0.1f);
    char msg[512];
    eng_engine *e = NULL;
    eng_engine_opts eo = {.kv_bytes = KV_BYTES, .threads = 2};
    cr_assert_eq(eng_engine_start(&e, &g.m, &eo, msg, sizeof msg), 0, "%s", msg);

    // the generation with nothing happening
    gen quiet;
    gen_init(&quiet, 0);
    eng_request rq = greedy_request(&quiet, 24, NULL, 0);
    cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    gen_wait(&quiet, gen_finished);

    // the same, with adapter one merged after its 6th token
    gen busy;
    gen_init(&busy, 6);
    rq = greedy_request(&busy, 24, NULL, 0);
    cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    gen_wait(&busy, gen_paused);
    eng_lora_term t = {one, 1.0f};
    eng_weights *v = lora_fix_merged_version(&g.m, &t, 1, QT_KIND_COUNT);
    eng_engine_publish(e, v);
    eng_weights *serving = eng_engine_weights(e);
    cr_assert_eq(serving, v, "the published version serves new sequences");
    eng_weights_unref(serving);

    // a request that starts now runs on the merged version: base minus one
    gen later;
    gen_init(&later, 0);
    rq = greedy_request(&later, 24, NULL, 0);
    cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    gen_release(&busy);
    gen_wait(&busy, gen_finished);
    gen_wait(&later, gen_finished);

    cr_assert_eq(busy.n, quiet.n);
    cr_assert(memcmp(busy.tokens, quiet.tokens, (size_t)quiet.n * sizeof(int32_t)) == 0,
              "the merge changed a running generation's tokens");
    cr_assert(eng_engine_wait_versions(e, 10.0), "the old version is released");
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.weights_version, 1);
    cr_assert_eq(st.weights_versions, 1);
    cr_assert_eq(st.adapter_requests, 1, "the later base request applied -one unmerged");
    eng_engine_stop(e);
    eng_lora_unref(one);
    rig_close(&g);
}

Test(lora_engine, requests_with_adapters_get_the_forward_pass_tokens)
{
    kind_case kc = {.label = "q4_1 engine", .gguf = true, .gguf_kind = QT_Q4_1};
    rig g;
    rig_open(&g, &kc);
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 41, 0.1f);
    eng_lora *two = mem_lora(&g.m, "two", 4, 2.0f, ALL_PROJ, QT_BF16, 42, 0.1f);
    char msg[512];
    eng_engine *e = NULL;
    eng_engine_opts eo = {.kv_bytes = KV_BYTES, .threads = 2};
    cr_assert_eq(eng_engine_start(&e, &g.m, &eo, msg, sizeof msg), 0, "%s", msg);
    eng_lora_term want[3][2] = {{{one, 1.0f}}, {{two, 0.5f}}, {{one, 1.0f}, {two, 1.0f}}};
    size_t n_want[3] = {1, 1, 2};
    gen runs[3];
    for (int i = 0; i < 3; i++) {
        gen_init(&runs[i], 0);
        eng_request rq = greedy_request(&runs[i], 12, want[i], n_want[i]);
        cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    }
    for (int i = 0; i < 3; i++)
        gen_wait(&runs[i], gen_finished);
    // each against the forward pass run by hand with the same delta
    for (int i = 0; i < 3; i++) {
        int64_t V = g.vocab;
        float *logits = malloc((size_t)V * sizeof *logits);
        int32_t tokens[64];
        size_t n_ids = 0;
        int32_t *ids = NULL;
        cr_assert_eq(tok_encode(g.m.tok, "the then he", 11, tok_adds_bos(g.m.tok), true, &ids,
                                &n_ids, msg, sizeof msg),
                     0);
        memcpy(tokens, ids, n_ids * sizeof *ids);
        free(ids);
        eng_seq_kv kv = {0};
        eng_step_seq s = {.kv = &kv,
                          .tokens = tokens,
                          .n_tokens = (int32_t)n_ids,
                          .pos = 0,
                          .weights = NULL,
                          .delta = want[i],
                          .n_delta = (int32_t)n_want[i]};
        int n = 0;
        for (; n < runs[i].n; n++) {
            rig_step(&g, &s, 1, logits, "by hand");
            int32_t best = argmax(logits, V);
            cr_assert_eq(best, runs[i].tokens[n], "request %d token %d", i, n);
            tokens[n_ids + (size_t)n] = best;
            s = (eng_step_seq){.kv = &kv,
                               .tokens = tokens + n_ids + n,
                               .n_tokens = 1,
                               .pos = (int32_t)n_ids + n,
                               .weights = NULL,
                               .delta = want[i],
                               .n_delta = (int32_t)n_want[i]};
        }
        eng_kv_release(g.kv, &kv);
        free(logits);
    }
    cr_assert_eq(__atomic_load_n(&one->requests, __ATOMIC_RELAXED), 2);
    cr_assert_eq(__atomic_load_n(&two->requests, __ATOMIC_RELAXED), 2);
    // a request naming an adapter twice is refused
    gen bad;
    gen_init(&bad, 0);
    eng_lora_term twice[2] = {{one, 1.0f}, {one, 0.5f}};
    eng_request rq = greedy_request(&bad, 4, twice, 2);
    cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "named twice"), "%s", msg);
    eng_engine_stop(e);
    eng_lora_unref(one);
    eng_lora_unref(two);
    rig_close(&g);
}

/* One greedy request for prompt with these adapters, run to its end. */
static void run_prompt_on(eng_engine *e, gen *g, const char *prompt, const eng_lora_term *adapters,
                          size_t n)
{
    char msg[512];
    gen_init(g, 0);
    eng_request rq = greedy_request(g, 8, adapters, n);
    rq.prompt = prompt;
    rq.prompt_len = strlen(prompt);
    cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    gen_wait(g, gen_finished);
    cr_assert_eq(g->why, ENG_FINISH_LENGTH);
}

static void assert_same_tokens(const gen *a, const gen *b, const char *what)
{
    cr_assert_eq(a->n, b->n, "%s: %d tokens, then %d", what, a->n, b->n);
    cr_assert(memcmp(a->tokens, b->tokens, (size_t)a->n * sizeof *a->tokens) == 0,
              "%s: the tokens differ", what);
}

/* Two engines on g's model with blocks of 4 tokens: *e keeps a prefix
 * cache, *plain none (the reference). */
static void start_cached_and_plain(rig *g, eng_engine **e, eng_engine **plain)
{
    char msg[512];
    eng_engine_opts eo = {.kv_bytes = KV_BYTES, .threads = 2, .block_tokens = 4};
    cr_assert_eq(eng_engine_start(e, &g->m, &eo, msg, sizeof msg), 0, "%s", msg);
    eo.no_prefix_cache = true;
    cr_assert_eq(eng_engine_start(plain, &g->m, &eo, msg, sizeof msg), 0, "%s", msg);
}

Test(lora_engine, the_prefix_cache_gives_the_same_tokens_and_never_across_configurations)
{
    kind_case kc = {.label = "q4_1 prefix", .gguf = true, .gguf_kind = QT_Q4_1};
    rig g;
    rig_open(&g, &kc);
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 51, 0.1f);
    char msg[512];
    eng_engine *e = NULL, *plain = NULL;
    start_cached_and_plain(&g, &e, &plain);
    const char *p = "the then he the then he the then he then the he";
    eng_lora_term with_one = {one, 1.0f}, half_one = {one, 0.5f};

    gen ref, first, again, ad, ad_again, half, ref_ad;
    run_prompt_on(plain, &ref, p, NULL, 0);
    run_prompt_on(plain, &ref_ad, p, &with_one, 1);
    run_prompt_on(e, &first, p, NULL, 0);
    cr_assert_eq(first.cached, 0);
    run_prompt_on(e, &again, p, NULL, 0);
    cr_assert_gt(again.cached, 0, "the same prompt again found nothing");
    assert_same_tokens(&ref, &first, "base, computed");
    assert_same_tokens(&ref, &again, "base, from the prefix cache");
    // another adapter configuration never takes the base's blocks
    run_prompt_on(e, &ad, p, &with_one, 1);
    cr_assert_eq(ad.cached, 0, "an adapter request took the base's blocks");
    run_prompt_on(e, &half, p, &half_one, 1);
    cr_assert_eq(half.cached, 0, "another scale took the adapter's blocks");
    run_prompt_on(e, &ad_again, p, &with_one, 1);
    cr_assert_eq(ad_again.cached, again.cached);
    assert_same_tokens(&ref_ad, &ad, "adapter, computed");
    assert_same_tokens(&ref_ad, &ad_again, "adapter, from the prefix cache");

    // a merged version never takes blocks computed on the pristine weights
    eng_weights *v = lora_fix_merged_version(&g.m, &with_one, 1, QT_KIND_COUNT);
    eng_weights_ref(v);
    eng_engine_publish(e, v);
    eng_engine_publish(plain, v);
    gen m1, m2, mref;
    run_prompt_on(plain, &mref, p, NULL, 0);
    run_prompt_on(e, &m1, p, NULL, 0);
    cr_assert_eq(m1.cached, 0, "a merge served a stale block");
    run_prompt_on(e, &m2, p, NULL, 0);
    cr_assert_gt(m2.cached, 0);
    assert_same_tokens(&mref, &m1, "merged, computed");
    assert_same_tokens(&mref, &m2, "merged, from the prefix cache");
    // back to the pristine weights (a new version, nothing merged): the
    // base's blocks serve again
    eng_weights *back = NULL;
    cr_assert_eq(eng_weights_new(&back, &g.m, 2, msg, sizeof msg), 0, "%s", msg);
    eng_engine_publish(e, back);
    gen b1;
    run_prompt_on(e, &b1, p, NULL, 0);
    cr_assert_eq(b1.cached, again.cached, "the pristine weights' blocks were lost");
    assert_same_tokens(&ref, &b1, "unmerged, from the prefix cache");

    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.prefix_hit_tokens,
                 (uint64_t)(again.cached + ad_again.cached + m2.cached + b1.cached));
    cr_assert_gt(st.prefix_blocks, 0);
    cr_assert_eq(st.kv_blocks_used, 0, "kept blocks count as free");
    eng_engine_stats_get(plain, &st);
    cr_assert_eq(st.prefix_hit_tokens, 0);
    cr_assert_eq(st.prefix_blocks, 0);
    eng_engine_stop(e);
    eng_engine_stop(plain);
    eng_lora_unref(one);
    rig_close(&g);
}

Test(lora_engine, a_prompt_leaving_a_kept_block_midway_reuses_its_first_positions)
{
    kind_case kc = {.label = "q4_1 partial", .gguf = true, .gguf_kind = QT_Q4_1};
    rig g;
    rig_open(&g, &kc);
    eng_engine *e = NULL, *plain = NULL;
    start_cached_and_plain(&g, &e, &plain);
    /* b shares a's first words, then goes its own way inside a block */
    const char *a = "the then he the then he the then he then the he then he the";
    const char *b = "the then he the then he the then he then the the he he then";
    gen ga, gb, ref;
    run_prompt_on(e, &ga, a, NULL, 0);
    run_prompt_on(e, &gb, b, NULL, 0);
    run_prompt_on(plain, &ref, b, NULL, 0);
    cr_assert_gt(gb.cached, 4, "b found no whole block of a's");
    cr_assert_neq(gb.cached % 4, 0, "b reused no positions of a's partly shared block");
    assert_same_tokens(&ref, &gb, "b, its prefix from a's blocks");
    eng_engine_stop(e);
    eng_engine_stop(plain);
    rig_close(&g);
}

Test(lora_engine, requests_arriving_together_with_one_prefix_compute_it_once)
{
    kind_case kc = {.label = "q4_1 prefix", .gguf = true, .gguf_kind = QT_Q4_1};
    rig g;
    rig_open(&g, &kc);
    char msg[512];
    eng_engine *e = NULL;
    eng_engine_opts eo = {
        .kv_bytes = KV_BYTES, .threads = 2, .block_tokens = 4, .prefill_chunk = 4};
    cr_assert_eq(eng_engine_start(&e, &g.m, &eo, msg, sizeof msg), 0, "%s", msg);
    static const char *prompts[4] = {
        "the then he the then he the then he the then he then the he he",
        "the then he the then he the then he the then he then the he the",
        "the then he the then he the then he the then he then the he then",
        "the then he the then he the then he the then he then the then he",
    };
    gen runs[4];
    for (int i = 0; i < 4; i++) {
        gen_init(&runs[i], 0);
        eng_request rq = greedy_request(&runs[i], 4, NULL, 0);
        rq.prompt = prompts[i];
        rq.prompt_len = strlen(prompts[i]);
        cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    }
    for (int i = 0; i < 4; i++)
        gen_wait(&runs[i], gen_finished);
    // the first computes the shared blocks while the others wait for them
    cr_assert_eq(runs[0].cached, 0);
    for (int i = 1; i < 4; i++)
        cr_assert_gt(runs[i].cached, 8, "request %d computed the shared prefix again (%d cached)",
                     i, runs[i].cached);
    eng_engine_stop(e);
    rig_close(&g);
}

/* --- 4. the registry: PEFT folders, merge reports, restore, budget ------------- */

typedef struct reg_rig {
    rig g;
    eng_engine *e;
    lora_registry *reg;
} reg_rig;

static void reg_open(reg_rig *r, const kind_case *kc, size_t budget)
{
    rig_open(&r->g, kc);
    char msg[512];
    eng_engine_opts eo = {.kv_bytes = KV_BYTES, .threads = 2};
    cr_assert_eq(eng_engine_start(&r->e, &r->g.m, &eo, msg, sizeof msg), 0, "%s", msg);
    lora_registry_opts ro = {.budget_bytes = budget, .threads = 2};
    cr_assert_eq(lora_registry_new(&r->reg, r->e, &r->g.m, &ro, msg, sizeof msg), 0, "%s", msg);
}

static void reg_close(reg_rig *r)
{
    eng_engine_stop(r->e);
    lora_registry_free(r->reg);
    rig_close(&r->g);
}

/* Write adapter `name` (a PEFT folder) under dir and return its path. */
static const char *write_folder(const eng_model *m, const char *name, uint64_t seed, float std)
{
    static char paths[8][700];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, 700, "%s/%s", dir, name);
    lora_fix_spec s = lora_fix_default();
    s.seed = seed;
    s.std = std;
    lora_fix_write(p, &m->cfg, &s);
    return p;
}

static const lora_merge_opts own_kind = {.safe_merge = true, .into = QT_KIND_COUNT};

Test(lora_engine, merge_report_matches_costs_recomputed_in_float64)
{
    kind_case kc = {.label = "nf4 registry", .quant = "nf4"};
    reg_rig r;
    reg_open(&r, &kc, 0);
    char msg[512];
    const char *a = write_folder(&r.g.m, "a", 5, 0.05f);
    lora_meta meta;
    cr_assert_eq(lora_registry_load(r.reg, "a", a, 1.0f, &meta, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(meta.n_modules, r.g.m.cfg.n_layers * ENG_N_PROJ);
    lora_report rep;
    cr_assert_eq(lora_registry_merge(r.reg, "a", 0.8f, &own_kind, &rep, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(rep.n_modules, (size_t)(r.g.m.cfg.n_layers * ENG_N_PROJ));
    eng_weights *v = eng_engine_weights(r.e);
    cr_assert_eq(v->version, rep.version);
    cr_assert_eq(eng_weights_digest(&r.g.m, v), rep.digest);
    eng_lora *lora;
    cr_assert_eq(lora_registry_get(r.reg, "a", &lora, msg, sizeof msg), 0);
    double dot = 0, dsq = 0, esq = 0;
    for (size_t i = 0; i < rep.n_modules; i++) {
        const struct lora_module_cost *mc = &rep.modules[i];
        const qtensor *w = eng_model_proj(&r.g.m, mc->layer, mc->proj);
        const qtensor *q = eng_weights_proj(v, mc->layer, mc->proj);
        const eng_lora_module *mod = eng_lora_module_at(lora, mc->layer, mc->proj);
        cr_assert(q != w && q->kind == QT_NF4 && q->blocksize == w->blocksize);
        int64_t R = w->rows, C = w->cols, K = mod->a.rows;
        float *W = malloc((size_t)(R * C) * sizeof *W), *Q = malloc((size_t)(R * C) * sizeof *Q);
        float *A = malloc((size_t)(K * C) * sizeof *A), *B = malloc((size_t)(R * K) * sizeof *B);
        qt_dequantize_rows(w, 0, R, W);
        qt_dequantize_rows(q, 0, R, Q);
        qt_dequantize_rows(&mod->a, 0, K, A);
        qt_dequantize_rows(&mod->b, 0, R, B);
        double s = 0.8 * (double)mod->scale, m_dot = 0, m_dsq = 0, m_esq = 0;
        for (int64_t row = 0; row < R; row++) {
            for (int64_t c = 0; c < C; c++) {
                double d = 0;
                for (int64_t k = 0; k < K; k++)
                    d += (double)B[row * K + k] * A[k * C + c];
                d *= s;
                double qd = (double)Q[row * C + c], wd = (double)W[row * C + c];
                m_dot += (qd - wd) * d;
                m_dsq += d * d;
                m_esq += (qd - wd - d) * (qd - wd - d);
            }
        }
        /* the merge rounds each delta to f32 before adding it: 1e-6 covers that */
        cr_assert(fabs(mc->cost.dot - m_dot) <= 1e-6 * m_dsq, "module %zu dot", i);
        cr_assert(fabs(mc->cost.delta_sq - m_dsq) <= 1e-6 * m_dsq, "module %zu delta_sq", i);
        cr_assert(fabs(mc->cost.err_sq - m_esq) <= 1e-6 * m_esq, "module %zu err_sq", i);
        cr_assert(fabs(mc->cost.delta_retained - m_dot / m_dsq) <= 1e-6);
        cr_assert(fabs(mc->cost.relative_error - sqrt(m_esq / m_dsq)) <= 1e-6);
        dot += m_dot;
        dsq += m_dsq;
        esq += m_esq;
        free(W);
        free(Q);
        free(A);
        free(B);
    }
    cr_assert(fabs(rep.overall.delta_retained - dot / dsq) <= 1e-6, "overall retained %.9g vs %.9g",
              rep.overall.delta_retained, dot / dsq);
    cr_assert(fabs(rep.overall.relative_error - sqrt(esq / dsq)) <= 1e-6);
    cr_log_info("tiny nf4, adapter std 0.05: delta_retained %.4f, relative_error %.4f",
                rep.overall.delta_retained, rep.overall.relative_error);
    // the listing carries it
    lora_info *list;
    size_t n;
    cr_assert_eq(lora_registry_list(r.reg, &list, &n), 0);
    cr_assert_eq(n, 1);
    cr_assert(list[0].merged && list[0].merged_scale == 0.8f);
    cr_assert_eq(list[0].last_merge.delta_retained, rep.overall.delta_retained);
    cr_assert_eq(list[0].last_merge_seconds, rep.seconds);
    cr_assert_gt(rep.seconds, 0.0);
    free(list);
    eng_lora_unref(lora);
    eng_weights_unref(v);
    lora_report_free(&rep);
    reg_close(&r);
}

static void restore_after_cycles(const kind_case *kc, int cycles)
{
    reg_rig r;
    reg_open(&r, kc, 0);
    char msg[512];
    cr_assert_eq(lora_registry_load(r.reg, "a", write_folder(&r.g.m, "a", 5, 0.05f), 1.0f, NULL,
                                    msg, sizeof msg),
                 0, "%s", msg);
    cr_assert_eq(lora_registry_load(r.reg, "b", write_folder(&r.g.m, "b", 6, 0.05f), 1.0f, NULL,
                                    msg, sizeof msg),
                 0, "%s", msg);
    lora_state st;
    lora_registry_state(r.reg, &st);
    uint64_t pristine = st.digest;
    cr_assert_eq(pristine, eng_weights_digest(&r.g.m, NULL));
    for (int cycle = 0; cycle < cycles; cycle++) {
        float scale = 0.25f + 0.01f * (float)cycle;
        cr_assert_eq(lora_registry_merge(r.reg, "a", scale, &own_kind, NULL, msg, sizeof msg), 0,
                     "%s", msg);
        if (cycle % 3 == 0) /* a second adapter on top, and a changed scale */
            cr_assert_eq(lora_registry_merge(r.reg, "b", 0.5f, &own_kind, NULL, msg, sizeof msg), 0,
                         "%s", msg);
        if (cycle % 5 == 0)
            cr_assert_eq(
                lora_registry_merge(r.reg, "a", 2 * scale, &own_kind, NULL, msg, sizeof msg), 0,
                "%s", msg);
        lora_registry_state(r.reg, &st);
        cr_assert_neq(st.digest, pristine, "cycle %d: merged weights hash like pristine", cycle);
        cr_assert_eq(lora_registry_unmerge(r.reg, "a", NULL, msg, sizeof msg), 0, "%s", msg);
        if (cycle % 3 == 0)
            cr_assert_eq(lora_registry_unmerge(r.reg, "b", NULL, msg, sizeof msg), 0, "%s", msg);
    }
    lora_registry_state(r.reg, &st);
    cr_assert_eq(st.n_merged, 0);
    cr_assert_eq(st.digest, pristine, "%s: %d cycles in, the digest differs from pristine",
                 kc->label, cycles);
    eng_weights *v = eng_engine_weights(r.e);
    for (int32_t l = 0; l < r.g.m.cfg.n_layers; l++)
        for (int p = 0; p < ENG_N_PROJ; p++)
            cr_assert_eq(
                eng_weights_proj(v, l, (eng_proj)p), eng_model_proj(&r.g.m, l, (eng_proj)p),
                "layer %d %s serves a copy after the last unmerge", l, eng_proj_name((eng_proj)p));
    eng_weights_unref(v);
    cr_assert(eng_engine_wait_versions(r.e, 10.0));
    reg_close(&r);
}

Test(lora_engine, unmerge_restores_nf4_weights_bit_for_bit_after_100_cycles)
{
    kind_case kc = {.label = "nf4-dq", .quant = "nf4-dq"};
    restore_after_cycles(&kc, 100);
}

Test(lora_engine, unmerge_restores_gguf_q4_1_weights_bit_for_bit_after_100_cycles)
{
    kind_case kc = {.label = "q4_1", .gguf = true, .gguf_kind = QT_Q4_1};
    restore_after_cycles(&kc, 100);
}

/* Q4_K_M's k-quants (and its q5_0, q8_0) merge into their own kinds, and
 * unmerging gives the pristine bytes back, digest equal; 20 cycles, as the
 * k-quants' requantization searches cost 20 times Q4_1's */
Test(lora_engine, unmerge_restores_gguf_q4_k_m_weights_bit_for_bit_after_20_cycles)
{
    kind_case kc = {.label = "q4_k_m", .gguf = true, .gguf_kind = QT_Q4_K, .q4_k_m = true};
    restore_after_cycles(&kc, 20);
}

Test(lora_engine, unload_while_merged_conflicts_and_unknown_names_are_not_found)
{
    kind_case kc = {.label = "int8 registry", .quant = "int8"};
    reg_rig r;
    reg_open(&r, &kc, 0);
    char msg[512];
    const char *a = write_folder(&r.g.m, "a", 5, 0.05f);
    cr_assert_eq(lora_registry_load(r.reg, "a", a, 1.0f, NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_load(r.reg, "a", a, 1.0f, NULL, msg, sizeof msg), QL_ECONFLICT);
    cr_assert(strstr(msg, "already loaded"), "%s", msg);
    eng_lora *l = NULL;
    cr_assert_eq(lora_registry_get(r.reg, "nope", &l, msg, sizeof msg), QL_ENOTFOUND);
    cr_assert(strstr(msg, "nope"), "%s", msg);
    cr_assert_eq(lora_registry_merge(r.reg, "nope", 1.0f, &own_kind, NULL, msg, sizeof msg),
                 QL_ENOTFOUND);
    cr_assert_eq(lora_registry_unmerge(r.reg, "a", NULL, msg, sizeof msg), QL_ECONFLICT);
    cr_assert(strstr(msg, "not merged"), "%s", msg);
    cr_assert_eq(lora_registry_merge(r.reg, "a", 1.0f, &own_kind, NULL, msg, sizeof msg), 0);
    cr_assert_eq(lora_registry_unload(r.reg, "a", msg, sizeof msg), QL_ECONFLICT);
    cr_assert(strstr(msg, "unmerge it first"), "%s", msg);
    cr_assert_eq(lora_registry_unmerge(r.reg, "a", NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_unload(r.reg, "a", msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_unload(r.reg, "a", msg, sizeof msg), QL_ENOTFOUND);
    lora_state st;
    lora_registry_state(r.reg, &st);
    cr_assert_eq(st.n_loaded, 0);
    cr_assert_eq(st.merges, 1);
    cr_assert_eq(st.unmerges, 1);
    reg_close(&r);
}

Test(lora_engine, safe_merge_refuses_an_infinite_result_and_changes_nothing)
{
    kind_case kc = {.label = "q8_0 registry", .gguf = true, .gguf_kind = QT_Q8_0};
    reg_rig r;
    reg_open(&r, &kc, 0);
    char msg[512];
    /* finite factors whose product overflows f32: 1e19 * 1e19 * 8 * 2 */
    cr_assert_eq(lora_registry_load(r.reg, "huge", write_folder(&r.g.m, "huge", 5, 1e19f), 1.0f,
                                    NULL, msg, sizeof msg),
                 0, "%s", msg);
    cr_assert_eq(lora_registry_load(r.reg, "a", write_folder(&r.g.m, "a", 6, 0.05f), 1.0f, NULL,
                                    msg, sizeof msg),
                 0, "%s", msg);
    cr_assert_eq(lora_registry_merge(r.reg, "a", 1.0f, &own_kind, NULL, msg, sizeof msg), 0);
    lora_state before, after;
    lora_registry_state(r.reg, &before);
    int rc = lora_registry_merge(r.reg, "huge", 1.0f, &own_kind, NULL, msg, sizeof msg);
    cr_assert_eq(rc, QL_ENONFINITE, "%d: %s", rc, msg);
    cr_assert(strstr(msg, "huge") && strstr(msg, "model.layers.") && strstr(msg, "row"), "%s", msg);
    lora_registry_state(r.reg, &after);
    cr_assert_eq(after.version, before.version, "a refused merge published a version");
    cr_assert_eq(after.digest, before.digest);
    cr_assert_eq(after.n_merged, 1);
    cr_assert_str_eq(after.merged[0].name, "a");
    reg_close(&r);
}

Test(lora_engine, budget_evicts_the_least_recently_used_idle_adapter)
{
    kind_case kc = {.label = "bf16 registry"};
    char msg[512];
    /* the size of one adapter, to set the budget at two and a half */
    rig probe;
    rig_open(&probe, &kc);
    const char *pa = write_folder(&probe.m, "probe", 1, 0.05f);
    eng_lora *l;
    cr_assert_eq(lora_load(&l, NULL, pa, "probe", &probe.m, msg, sizeof msg), 0, "%s", msg);
    size_t one = l->bytes;
    eng_lora_unref(l);
    rig_close(&probe);

    reg_rig r;
    reg_open(&r, &kc, one * 5 / 2);
    const char *folders[4];
    const char *names[4] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; i++)
        folders[i] = write_folder(&r.g.m, names[i], 10 + (uint64_t)i, 0.05f);
    cr_assert_eq(lora_registry_load(r.reg, "a", folders[0], 1.0f, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(lora_registry_load(r.reg, "b", folders[1], 1.0f, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(lora_registry_get(r.reg, "a", &l, msg, sizeof msg), 0); /* a used after b */
    eng_lora_unref(l);
    cr_assert_eq(lora_registry_load(r.reg, "c", folders[2], 1.0f, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(lora_registry_get(r.reg, "b", &l, msg, sizeof msg), QL_ENOTFOUND,
                 "b, the least recently used, was evicted");
    // a merged and c in use: nothing can go, so d is refused and nothing changes
    cr_assert_eq(lora_registry_merge(r.reg, "a", 1.0f, &own_kind, NULL, msg, sizeof msg), 0);
    eng_lora *held;
    cr_assert_eq(lora_registry_get(r.reg, "c", &held, msg, sizeof msg), 0);
    cr_assert_eq(lora_registry_load(r.reg, "d", folders[3], 1.0f, NULL, msg, sizeof msg),
                 QL_ENOMEM);
    cr_assert(strstr(msg, "budget"), "%s", msg);
    lora_state st;
    lora_registry_state(r.reg, &st);
    cr_assert_eq(st.n_loaded, 2);
    // once c is idle, d evicts it
    eng_lora_unref(held);
    cr_assert_eq(lora_registry_load(r.reg, "d", folders[3], 1.0f, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(lora_registry_get(r.reg, "c", &l, msg, sizeof msg), QL_ENOTFOUND);
    cr_assert_eq(lora_registry_get(r.reg, "a", &l, msg, sizeof msg), 0, "a is merged: kept");
    eng_lora_unref(l);
    reg_close(&r);
}

Test(lora_engine, an_adapter_keeps_its_default_scale_until_unloaded)
{
    kind_case kc = {.label = "bf16 scale"};
    reg_rig r;
    reg_open(&r, &kc, 0);
    char msg[512];
    const char *a = write_folder(&r.g.m, "a", 5, 0.05f);
    cr_assert_eq(lora_registry_load(r.reg, "a", a, 0.5f, NULL, msg, sizeof msg), 0, "%s", msg);
    eng_lora_term t;
    cr_assert_eq(lora_registry_want(r.reg, "a", &t, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(t.scale, 0.5f);
    cr_assert_str_eq(t.lora->name, "a");
    eng_lora_unref(t.lora);
    lora_info *list;
    size_t n;
    cr_assert_eq(lora_registry_list(r.reg, &list, &n), 0);
    cr_assert_eq(n, 1);
    cr_assert_eq(list[0].scale, 0.5f);
    free(list);
    cr_assert_eq(lora_registry_unload(r.reg, "a", msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_want(r.reg, "a", &t, msg, sizeof msg), QL_ENOTFOUND);
    cr_assert_null(t.lora);
    /* loaded again without a scale of its own, it has scale 1 */
    cr_assert_eq(lora_registry_load(r.reg, "a", a, 1.0f, NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_want(r.reg, "a", &t, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(t.scale, 1.0f);
    eng_lora_unref(t.lora);
    reg_close(&r);
}

/* --- 5. the journal: state that survives a restart ------------------------------ */

/* A registry like reg_open's, journaling to state_file. */
static void reg_open_journaled(reg_rig *r, const kind_case *kc, const char *state_file)
{
    rig_open(&r->g, kc);
    char msg[512];
    eng_engine_opts eo = {.kv_bytes = KV_BYTES, .threads = 2};
    cr_assert_eq(eng_engine_start(&r->e, &r->g.m, &eo, msg, sizeof msg), 0, "%s", msg);
    lora_registry_opts ro = {.threads = 2, .state_file = state_file};
    cr_assert_eq(lora_registry_new(&r->reg, r->e, &r->g.m, &ro, msg, sizeof msg), 0, "%s", msg);
}

/* The journal at path, which must read back. */
static lora_journal journal_at(const char *path)
{
    lora_journal j;
    char msg[512];
    cr_assert_eq(lora_journal_read(path, &j, msg, sizeof msg), 0, "%s", msg);
    return j;
}

Test(lora_engine, the_journal_follows_every_change_and_a_replay_gives_the_same_weights)
{
    kind_case kc = {.label = "nf4 journal", .quant = "nf4"};
    char state_file[700], root[4096], msg[512], pa[4096], pb[4096];
    snprintf(state_file, sizeof state_file, "%s/state.json", dir);
    cr_assert(realpath(dir, root));
    reg_rig r;
    reg_open_journaled(&r, &kc, state_file);
    write_folder(&r.g.m, "a", 5, 0.05f);
    write_folder(&r.g.m, "b", 6, 0.05f);
    cr_assert_eq(lora_resolve_dir(root, "a", pa, sizeof pa, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_resolve_dir(root, "b/", pb, sizeof pb, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_load(r.reg, "a", pa, 0.5f, NULL, msg, sizeof msg), 0, "%s", msg);
    lora_journal j = journal_at(state_file);
    cr_assert_eq(j.n_adapters, 1);
    cr_assert_str_eq(j.adapters[0].name, "a");
    cr_assert_str_eq(j.adapters[0].path, pa);
    cr_assert_eq(j.adapters[0].scale, 0.5f);
    cr_assert_eq(j.n_merged, 0);
    lora_journal_free(&j);
    cr_assert_eq(lora_registry_load(r.reg, "b", pb, 1.0f, NULL, msg, sizeof msg), 0, "%s", msg);
    /* a scale that is not a short decimal must come back as the same float */
    float scale_b = 0.7f / 3.0f;
    lora_merge_opts int8 = {.safe_merge = false, .into = QT_AFFINE};
    cr_assert_eq(lora_registry_merge(r.reg, "a", 1.0f, &own_kind, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(lora_registry_merge(r.reg, "b", scale_b, &int8, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    j = journal_at(state_file);
    cr_assert_eq(j.n_adapters, 2);
    cr_assert_eq(j.n_merged, 2);
    cr_assert_str_eq(j.merged[0].name, "a");
    cr_assert_eq(j.merged[0].into, QT_AFFINE, "the configuration's into, for every entry");
    cr_assert(j.merged[0].safe_merge);
    cr_assert_str_eq(j.merged[1].name, "b");
    cr_assert(same_bits(j.merged[1].scale, scale_b));
    cr_assert(!j.merged[1].safe_merge);
    lora_journal_free(&j);
    lora_state before;
    lora_registry_state(r.reg, &before);
    cr_assert_str_eq(before.state_file, state_file);
    cr_assert_str_eq(before.state_file_error, "");
    reg_close(&r);

    /* a new registry on the same model replays it: same adapters, same
     * merged configuration, the same weights bit for bit */
    reg_open_journaled(&r, &kc, state_file);
    cr_assert_eq(lora_registry_restore(r.reg, root), 0);
    lora_state after;
    lora_registry_state(r.reg, &after);
    cr_assert_eq(after.digest, before.digest);
    cr_assert_eq(after.n_loaded, 2);
    cr_assert_eq(after.n_merged, 2);
    cr_assert_str_eq(after.merged[0].name, "a");
    cr_assert_str_eq(after.merged[1].name, "b");
    cr_assert(same_bits(after.merged[1].scale, scale_b));
    lora_info *list;
    size_t n;
    cr_assert_eq(lora_registry_list(r.reg, &list, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(list[0].name, "a");
    cr_assert_str_eq(list[0].path, pa);
    cr_assert_eq(list[0].scale, 0.5f);
    free(list);
    /* the replay did not write; the next change does, and the journal
     * then follows an unmerge and an unload */
    cr_assert_eq(lora_registry_unmerge(r.reg, "a", NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_unload(r.reg, "a", msg, sizeof msg), 0, "%s", msg);
    j = journal_at(state_file);
    cr_assert_eq(j.n_adapters, 1);
    cr_assert_str_eq(j.adapters[0].name, "b");
    cr_assert_eq(j.n_merged, 1);
    cr_assert_str_eq(j.merged[0].name, "b");
    cr_assert_eq(j.merged[0].into, QT_AFFINE, "an unmerge keeps what stays merged as it was");
    lora_journal_free(&j);
    reg_close(&r);
}

Test(lora_engine, a_replay_reports_what_does_not_come_back_and_restores_the_rest)
{
    kind_case kc = {.label = "bf16 replay"};
    char state_file[700], root[4096], msg[512], pa[4096], pb[4096], gone[800];
    snprintf(state_file, sizeof state_file, "%s/state.json", dir);
    cr_assert(realpath(dir, root));
    reg_rig r;
    reg_open_journaled(&r, &kc, state_file);
    lora_state base;
    lora_registry_state(r.reg, &base);
    write_folder(&r.g.m, "a", 5, 0.05f);
    write_folder(&r.g.m, "b", 6, 0.05f);
    cr_assert_eq(lora_resolve_dir(root, "a", pa, sizeof pa, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_resolve_dir(root, "b", pb, sizeof pb, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_load(r.reg, "a", pa, 1.0f, NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_load(r.reg, "b", pb, 1.0f, NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(lora_registry_merge(r.reg, "a", 1.0f, &own_kind, NULL, msg, sizeof msg), 0, "%s",
                 msg);
    reg_close(&r);
    snprintf(gone, sizeof gone, "%s/a", dir);
    test_rmtree(gone);

    reg_open_journaled(&r, &kc, state_file);
    cr_assert_eq(lora_registry_restore(r.reg, root), 2, "a's load, and a's merge");
    lora_restore_error *errs;
    size_t n;
    cr_assert_eq(lora_registry_restore_errors(r.reg, &errs, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(errs[0].name, "a");
    cr_assert_str_eq(errs[0].path, pa);
    cr_assert(strstr(errs[0].error, "No such file"), "%s", errs[0].error);
    cr_assert_str_eq(errs[1].name, "a");
    cr_assert(strstr(errs[1].error, "merge skipped"), "%s", errs[1].error);
    free(errs);
    lora_state st;
    lora_registry_state(r.reg, &st);
    cr_assert_eq(st.n_loaded, 1, "b came back");
    cr_assert_eq(st.n_merged, 0);
    cr_assert_eq(st.digest, base.digest, "nothing merged: the initial weights");
    reg_close(&r);

    /* a path that now leads outside the adapter folder is refused, too;
     * the replay above wrote nothing, so the journal still names a */
    reg_open_journaled(&r, &kc, state_file);
    char elsewhere[4200];
    snprintf(elsewhere, sizeof elsewhere, "%s/sub", root);
    cr_assert_eq(mkdir(elsewhere, 0700), 0);
    cr_assert_eq(lora_registry_restore(r.reg, elsewhere), 3, "a, b, and a's merge");
    cr_assert_eq(lora_registry_restore_errors(r.reg, &errs, &n), 0);
    cr_assert_str_eq(errs[0].name, "a");
    cr_assert_str_eq(errs[1].name, "b");
    cr_assert(strstr(errs[1].error, "outside the adapter directory"), "%s", errs[1].error);
    free(errs);
    reg_close(&r);
}

Test(lora_engine, a_journal_that_is_not_one_is_refused_by_its_field)
{
    char path[700], msg[512];
    snprintf(path, sizeof path, "%s/state.json", dir);
    lora_journal j;
    cr_assert_eq(lora_journal_read(path, &j, msg, sizeof msg), QL_ENOTFOUND);
    static const struct {
        const char *text, *needle;
    } bad[] = {
        {"{\"version\": 1, \"adapters\": [", "not valid JSON"},
        {"[]", "not a JSON object"},
        {"{\"adapters\": [], \"merged\": []}", "\"version\""},
        {"{\"version\": 2, \"adapters\": [], \"merged\": []}", "version 2"},
        {"{\"version\": 1, \"merged\": []}", "\"adapters\" must be an array"},
        {"{\"version\": 1, \"adapters\": [{\"name\": \"a\", \"scale\": 1}], \"merged\": []}",
         "adapters[0]: \"path\""},
        {"{\"version\": 1, \"adapters\": [{\"name\": \"a\", \"path\": \"/x\", \"scale\": \"1\"}], "
         "\"merged\": []}",
         "adapters[0]: \"scale\""},
        {"{\"version\": 1, \"adapters\": [{\"name\": \"a\", \"path\": \"/x\", \"scale\": 1}, "
         "{\"name\": \"a\", \"path\": \"/y\", \"scale\": 1}], \"merged\": []}",
         "named twice"},
        {"{\"version\": 1, \"adapters\": [], \"merged\": [{\"name\": \"a\", \"scale\": 1, "
         "\"into\": \"nf4\"}]}",
         "merged[0]: \"into\""},
        {"{\"version\": 1, \"adapters\": [], \"merged\": [{\"name\": \"a\", \"scale\": 1, "
         "\"safe_merge\": 1}]}",
         "merged[0]: \"safe_merge\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        test_write_text(path, bad[i].text);
        cr_assert_eq(lora_journal_read(path, &j, msg, sizeof msg), QL_EFORMAT, "%s", bad[i].text);
        cr_assert(strstr(msg, path), "%s", msg);
        cr_assert(strstr(msg, bad[i].needle), "%s: %s (wanted %s)", bad[i].text, msg,
                  bad[i].needle);
        cr_assert_null(j.adapters);
    }
    /* what lora_journal_write writes reads back field for field */
    lora_journal_adapter ad[2] = {{"x", "/srv/x", 0.25f}, {"y", "/srv/y", -3.5f}};
    lora_journal w = {.adapters = ad, .n_adapters = 2, .n_merged = 1};
    w.merged[0] = (lora_journal_merge){"y", 1.0f / 3.0f, QT_BF16, true};
    cr_assert_eq(lora_journal_write(path, &w, msg, sizeof msg), 0, "%s", msg);
    j = journal_at(path);
    cr_assert_eq(j.n_adapters, 2);
    cr_assert_str_eq(j.adapters[1].path, "/srv/y");
    cr_assert_eq(j.adapters[1].scale, -3.5f);
    cr_assert_eq(j.n_merged, 1);
    cr_assert(same_bits(j.merged[0].scale, 1.0f / 3.0f));
    cr_assert_eq(j.merged[0].into, QT_BF16);
    lora_journal_free(&j);
    /* a write that cannot happen leaves the journal as it was and says why */
    char folder[720];
    snprintf(folder, sizeof folder, "%s/nope/state.json", dir);
    cr_assert_eq(lora_journal_write(folder, &w, msg, sizeof msg), QL_EIO);
    cr_assert(strstr(msg, folder), "%s", msg);
}

/* --- 4. the prefix cache: the next turn starts past the answer ----------------- */

/* A request's tokens and logprobs per choice; g (first: gen_done's user)
 * its end and cached prompt tokens. */
typedef struct turn {
    gen g;
    int32_t tokens[2][32];
    float logprob[2][32];
    int n[2];
} turn;

static void turn_token(void *user, const eng_token_event *ev)
{
    turn *t = user;
    pthread_mutex_lock(&t->g.mu);
    int c = ev->choice;
    if (ev->token >= 0 && c < 2 && t->n[c] < 32) {
        t->logprob[c][t->n[c]] = ev->logprob;
        t->tokens[c][t->n[c]++] = ev->token;
    }
    pthread_mutex_unlock(&t->g.mu);
}

/* Run prompt (token ids) to its end: n_new tokens per choice, with
 * logprobs; choices > 1 sample (seeded), one is greedy. */
static void run_turn(eng_engine *e, turn *t, const int32_t *prompt, size_t n, int32_t n_new,
                     int32_t choices, const eng_lora_term *adapters, size_t n_adapters)
{
    char msg[512];
    memset(t, 0, sizeof *t);
    gen_init(&t->g, 0);
    eng_request rq = {.prompt_tokens = prompt,
                      .n_prompt_tokens = n,
                      .max_new_tokens = n_new,
                      .n_choices = choices,
                      .logprobs = true,
                      .sampling = {.temperature = choices > 1 ? 1.0f : 0.0f, .seed = 7},
                      .adapters = adapters,
                      .n_adapters = n_adapters,
                      .on_token = turn_token,
                      .on_done = gen_done,
                      .user = t};
    cr_assert_eq(eng_engine_submit(e, &rq, NULL, msg, sizeof msg), 0, "%s", msg);
    gen_wait(&t->g, gen_finished);
    cr_assert_eq(t->g.why, ENG_FINISH_LENGTH);
}

/* The same tokens and the same logprobs, bit for bit, in choice c. */
static void assert_same_turn(const turn *a, const turn *b, int c, const char *what)
{
    cr_assert_eq(a->n[c], b->n[c], "%s: %d tokens, then %d", what, a->n[c], b->n[c]);
    for (int i = 0; i < a->n[c]; i++) {
        cr_assert_eq(a->tokens[c][i], b->tokens[c][i], "%s: token %d", what, i);
        cr_assert(same_bits(a->logprob[c][i], b->logprob[c][i]), "%s: token %d's logprob %g, %g",
                  what, i, (double)a->logprob[c][i], (double)b->logprob[c][i]);
    }
}

/* A next turn's prompt: prompt, then the first n of answer, then more. */
static size_t next_prompt(int32_t *out, const int32_t *prompt, size_t n_prompt,
                          const int32_t *answer, size_t n, const int32_t *more, size_t n_more)
{
    memcpy(out, prompt, n_prompt * sizeof *out);
    memcpy(out + n_prompt, answer, n * sizeof *out);
    memcpy(out + n_prompt + n, more, n_more * sizeof *out);
    return n_prompt + n + n_more;
}

Test(lora_engine, a_chats_next_turn_starts_past_the_previous_answer)
{
    kind_case kc = {.label = "q4_1 next turn", .gguf = true, .gguf_kind = QT_Q4_1};
    rig g;
    rig_open(&g, &kc);
    eng_lora *one = mem_lora(&g.m, "one", 4, 2.0f, ALL_PROJ, QT_F32, 61, 0.1f);
    char msg[512];
    eng_engine *e = NULL, *plain = NULL;
    start_cached_and_plain(&g, &e, &plain);
    int32_t *ids = NULL;
    size_t n_p = 0;
    cr_assert_eq(tok_encode(g.m.tok, "the then he the then", 20, tok_adds_bos(g.m.tok), true, &ids,
                            &n_p, msg, sizeof msg),
                 0, "%s", msg);
    const int32_t more[3] = {ids[n_p - 1], ids[n_p - 2], ids[n_p - 1]};
    int32_t q[128];
    const int32_t bt = 4, n_new = 10;

    // turn one, then turn two holding its whole answer: the KV of the
    // prompt and of the answer's fed tokens (all but the last sampled),
    // in whole blocks, comes from the cache
    turn t1, t2, ref2;
    run_turn(e, &t1, ids, n_p, n_new, 1, NULL, 0);
    cr_assert_eq(t1.n[0], n_new);
    size_t n_q = next_prompt(q, ids, n_p, t1.tokens[0], (size_t)n_new, more, 3);
    run_turn(e, &t2, q, n_q, 6, 1, NULL, 0);
    run_turn(plain, &ref2, q, n_q, 6, 1, NULL, 0);
    cr_assert_eq(t2.g.cached, ((int32_t)n_p + n_new - 1) / bt * bt,
                 "turn two found %d tokens cached (prompt %zu, answer %d)", t2.g.cached, n_p,
                 n_new);
    cr_assert_gt(t2.g.cached, (int32_t)n_p / bt * bt, "nothing of the answer was kept");
    assert_same_turn(&ref2, &t2, 0, "turn two, past the cached answer");

    // an adapter, and another weight version, never take those blocks
    eng_lora_term with_one = {one, 1.0f};
    turn ad, ad_ref;
    run_turn(e, &ad, q, n_q, 6, 1, &with_one, 1);
    run_turn(plain, &ad_ref, q, n_q, 6, 1, &with_one, 1);
    cr_assert_eq(ad.g.cached, 0, "an adapter request took the base's answer blocks");
    assert_same_turn(&ad_ref, &ad, 0, "adapter turn two");

    // two choices: each keeps its own answer after the shared prompt
    turn two;
    run_turn(e, &two, ids, n_p, n_new, 2, NULL, 0);
    cr_assert(memcmp(two.tokens[0], two.tokens[1], sizeof two.tokens[0]) != 0,
              "the seeded choices gave the same answer: pick another seed");
    for (int c = 0; c < 2; c++) {
        turn next, next_ref;
        n_q = next_prompt(q, ids, n_p, two.tokens[c], (size_t)n_new, more, 3);
        run_turn(e, &next, q, n_q, 6, 1, NULL, 0);
        run_turn(plain, &next_ref, q, n_q, 6, 1, NULL, 0);
        cr_assert_eq(next.g.cached, ((int32_t)n_p + n_new - 1) / bt * bt, "choice %d's next turn",
                     c);
        assert_same_turn(&next_ref, &next, 0, "a choice's next turn");
    }

    eng_weights *v = lora_fix_merged_version(&g.m, &with_one, 1, QT_KIND_COUNT);
    eng_engine_publish(e, v);
    turn merged;
    n_q = next_prompt(q, ids, n_p, t1.tokens[0], (size_t)n_new, more, 3);
    run_turn(e, &merged, q, n_q, 6, 1, NULL, 0);
    cr_assert_eq(merged.g.cached, 0, "a merged version took the pristine answer's blocks");

    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.kv_blocks_used, 0, "kept answer blocks count as free");
    cr_assert_leq(st.prefix_blocks, st.kv_blocks_total);
    free(ids);
    eng_engine_stop(e);
    eng_engine_stop(plain);
    eng_lora_unref(one);
    rig_close(&g);
}

Test(lora_engine, kept_answers_are_evicted_as_prompts_are)
{
    kind_case kc = {.label = "q4_1 next turn", .gguf = true, .gguf_kind = QT_Q4_1};
    rig g;
    rig_open(&g, &kc);
    char msg[512];
    eng_engine *e = NULL;
    // a cache of few blocks: many answers more than fill it
    eng_engine_opts eo = {.kv_bytes = KV_BYTES / 128, .threads = 2, .block_tokens = 4};
    cr_assert_eq(eng_engine_start(&e, &g.m, &eo, msg, sizeof msg), 0, "%s", msg);
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    int32_t total = st.kv_blocks_total, prompt[4] = {1, 2, 3, 4};
    cr_assert_lt(total, 64, "the cache is meant to be small (%d blocks)", total);
    for (int i = 0; i < 24; i++) {
        prompt[0] = 1 + i % 8;
        prompt[1] = 2 + i / 8;
        turn t;
        run_turn(e, &t, prompt, 4, 24, 1, NULL, 0);
        eng_engine_stats_get(e, &st);
        cr_assert_leq(st.prefix_blocks, total);
        cr_assert_eq(st.kv_blocks_used, 0);
    }
    cr_assert_gt(st.prefix_blocks, 0);
    eng_engine_stop(e);
    rig_close(&g);
}

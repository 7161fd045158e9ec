/*
 * test_lora_merge.c - the dispatch by quant kind (adapters/merge.c): merging
 * LoRA deltas into every kind of kernels/qtensor.h, what the merge reports
 * it cost, safe merge, and the wider kinds a merge may store into.
 *
 * The references are the test's own: the delta in float64 (parts in order,
 * each scale * sum_k B[r][k] * A[k][c] with k ascending, rounded once to
 * f32, as merge.c documents), W + delta requantized with qt_quantize using
 * the parameters the pristine weight was made with (not the ones merge.c
 * reads back from it), and the cost summed in float64.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lora.h"
#include "qtensor.h"
#include "test_kquant.h"
#include "test_util.h"

/* One kind and layout, as a loader would have quantized the weight. */
typedef struct kind_case {
    const char *name;
    qt_quant_params p;
    int64_t rows, cols;
    /* whether requantizing the dequantized weight gives it back bit for
     * bit (what a merge with a zero delta leaves); see
     * zero_scale_part_gives_the_requantized_pristine for why */
    bool requant_is_identity;
} kind_case;

/* 64 x 96 fits every kind but the k-quants and IQ4_XS: GGUF blocks of 32 along a row, int4 groups
 * of 32, NF4 blocks of 64 over the flattened tensor; 63 x 96 with blocks of 4096 leaves NF4 a short
 * last block. */
static const kind_case cases[] = {
    {"nf4", {.kind = QT_NF4, .blocksize = 64}, 64, 96, true},
    {"nf4-dq", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}, 64, 96, false},
    {"nf4-b4096-short", {.kind = QT_NF4, .blocksize = 4096}, 63, 96, true},
    {"fp4", {.kind = QT_FP4, .blocksize = 64}, 64, 96, true},
    {"fp4-b128-dq", {.kind = QT_FP4, .blocksize = 128, .double_quant = true}, 64, 96, false},
    /* engine/model/loader.c's --quant int4: torchao int4 weight-only */
    {"int4-g32",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f},
     64,
     96,
     false},
    /* engine/model/loader.c's --quant int8: torchao int8 weight-only */
    {"int8-channel", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, 64, 96, false},
    /* the other torchao mappings: symmetry must be read from the zeros */
    {"int4-sym-g32",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .symmetric = true},
     64,
     96,
     false},
    {"int8-asym-int-g32",
     {.kind = QT_AFFINE,
      .bits = 8,
      .group_size = 32,
      .zero_domain = QT_ZERO_INT,
      .qmin = -128,
      .qmax = 127},
     64,
     96,
     false},
    {"q4_0", {.kind = QT_Q4_0}, 64, 96, true},
    {"q4_1", {.kind = QT_Q4_1}, 64, 96, true},
    {"q8_0", {.kind = QT_Q8_0}, 64, 96, true},
    {"f32", {.kind = QT_F32}, 64, 96, true},
    {"f16", {.kind = QT_F16}, 64, 96, true},
    {"bf16", {.kind = QT_BF16}, 64, 96, true},
    {"q5_0", {.kind = QT_Q5_0}, 64, 96, true},
    {"q5_1", {.kind = QT_Q5_1}, 64, 96, true},
    /* the k-quants need whole super-blocks of 256 along a row; llama.cpp's
     * searches are not idempotent: on these weights Q4_K's and Q2_K's give
     * their codes back, Q5_K's and Q3_K's move some, Q6_K's mirrors some
     * sub-blocks; IQ4_NL's single fit gives its codes back, IQ4_XS's
     * recoded sub-block scales move some */
    {"q4_k", {.kind = QT_Q4_K}, 16, 512, true},
    {"q5_k", {.kind = QT_Q5_K}, 16, 512, false},
    {"q6_k", {.kind = QT_Q6_K}, 16, 512, false},
    {"q2_k", {.kind = QT_Q2_K}, 16, 512, true},
    {"q3_k", {.kind = QT_Q3_K}, 16, 512, false},
    {"iq4_nl", {.kind = QT_IQ4_NL}, 64, 96, true},
    {"iq4_xs", {.kind = QT_IQ4_XS}, 16, 512, false},
    /* MXFP4's largest level in a block it wrote is 8 or 12, so the scale
     * and every code come back */
    {"mxfp4", {.kind = QT_MXFP4}, 64, 96, true},
};
#define N_CASES (sizeof cases / sizeof *cases)

/* --- building weights and adapters -------------------------------------- */

static float *normal_values(uint64_t *seed, int64_t n, double sd)
{
    float *v = malloc((size_t)n * sizeof *v);
    cr_assert(v);
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)(sd * test_normal(seed));
    return v;
}

/* A pristine weight of kind case k, N(0, 0.02) as a trained projection. */
static void make_weight(qtensor *w, const kind_case *k, uint64_t seed)
{
    float *v = normal_values(&seed, k->rows * k->cols, 0.02);
    char msg[256];
    cr_assert_eq(qt_quantize(w, v, k->rows, k->cols, &k->p, msg, sizeof msg), QL_OK, "%s: %s",
                 k->name, msg);
    free(v);
}

/* A dense tensor of kind (F32 or BF16) holding v. */
static void dense_tensor(qtensor *t, qt_kind kind, const float *v, int64_t rows, int64_t cols)
{
    char msg[256];
    int64_t n = rows * cols;
    if (kind == QT_F32) {
        cr_assert_eq(qt_from_dense(t, QT_F32, v, rows, cols, msg, sizeof msg), QL_OK, "%s", msg);
        return;
    }
    uint16_t *h = malloc((size_t)n * sizeof *h);
    for (int64_t i = 0; i < n; i++)
        h[i] = qt_f32_to_bf16(v[i]);
    cr_assert_eq(qt_from_dense(t, QT_BF16, h, rows, cols, msg, sizeof msg), QL_OK, "%s", msg);
    free(h);
}

/* A rank-`rank` module for a rows x cols weight: A ~ N(0, sd_a), B ~ N(0,
 * sd_b), stored as `kind`, module scale alpha / r = 2. */
static void make_module(eng_lora_module *m, qt_kind kind, int64_t rows, int64_t cols, int64_t rank,
                        double sd_a, double sd_b, uint64_t seed)
{
    memset(m, 0, sizeof *m);
    float *a = normal_values(&seed, rank * cols, sd_a);
    float *b = normal_values(&seed, rows * rank, sd_b);
    dense_tensor(&m->a, kind, a, rank, cols);
    dense_tensor(&m->b, kind, b, rows, rank);
    m->scale = 2.0f;
    free(a);
    free(b);
}

static void free_module(eng_lora_module *m)
{
    qt_free(&m->a);
    qt_free(&m->b);
}

/* Element i of a dense F32 or BF16 tensor. */
static double dense_at(const qtensor *t, int64_t i)
{
    if (t->kind == QT_F32)
        return ((const float *)t->data)[i];
    return qt_bf16_to_f32(((const uint16_t *)t->data)[i]);
}

static float *dequant(const qtensor *t)
{
    float *v = malloc((size_t)(t->rows * t->cols) * sizeof *v);
    cr_assert(v);
    qt_dequantize_rows_ref(t, 0, t->rows, v);
    return v;
}

/* --- the references ------------------------------------------------------ */

/* The delta in float64, rounded once to f32 (what merge.c documents). */
static float *reference_delta(const lora_part *parts, size_t n_parts, int64_t rows, int64_t cols)
{
    float *d = malloc((size_t)(rows * cols) * sizeof *d);
    cr_assert(d);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            double total = 0.0;
            for (size_t i = 0; i < n_parts; i++) {
                const eng_lora_module *m = parts[i].module;
                int64_t rank = m->a.rows;
                double ba = 0.0;
                for (int64_t k = 0; k < rank; k++)
                    ba += dense_at(&m->b, r * rank + k) * dense_at(&m->a, k * cols + c);
                total += (double)parts[i].scale * (double)m->scale * ba;
            }
            d[r * cols + c] = (float)total;
        }
    }
    return d;
}

/* qt_quantize(dequant(w) + d) with the parameters p. */
static void reference_merge(qtensor *out, const qtensor *w, const float *d,
                            const qt_quant_params *p)
{
    float *x = dequant(w);
    for (int64_t i = 0; i < w->rows * w->cols; i++)
        x[i] += d[i];
    char msg[256];
    cr_assert_eq(qt_quantize(out, x, w->rows, w->cols, p, msg, sizeof msg), QL_OK, "%s", msg);
    free(x);
}

/* The cost recomputed in float64 from the merged tensor itself. */
static lora_cost reference_cost(const qtensor *pristine, const qtensor *merged, const float *d)
{
    float *w = dequant(pristine), *q = dequant(merged);
    lora_cost c = {0};
    for (int64_t i = 0; i < pristine->rows * pristine->cols; i++) {
        double moved = (double)q[i] - (double)w[i];
        double err = (double)q[i] - ((double)w[i] + (double)d[i]);
        c.dot += moved * (double)d[i];
        c.delta_sq += (double)d[i] * (double)d[i];
        c.err_sq += err * err;
    }
    free(w);
    free(q);
    return c;
}

/* Within 1e-9 of want, relative: both sides sum the same float64 terms. */
static bool close_rel(double got, double want)
{
    return fabs(got - want) <= 1e-9 * fabs(want);
}

static void assert_cost(const lora_cost *got, const lora_cost *want, const char *what)
{
    cr_assert(close_rel(got->dot, want->dot), "%s: dot %.17g vs %.17g", what, got->dot, want->dot);
    cr_assert(close_rel(got->delta_sq, want->delta_sq), "%s: delta_sq %.17g vs %.17g", what,
              got->delta_sq, want->delta_sq);
    cr_assert(close_rel(got->err_sq, want->err_sq), "%s: err_sq %.17g vs %.17g", what, got->err_sq,
              want->err_sq);
    cr_assert(want->delta_sq > 0.0, "%s: the reference delta is zero", what);
    cr_assert(close_rel(got->delta_retained, want->dot / want->delta_sq), "%s: retained %.17g",
              what, got->delta_retained);
    cr_assert(close_rel(got->relative_error, sqrt(want->err_sq / want->delta_sq)),
              "%s: relative error %.17g", what, got->relative_error);
}

static bool same_array(const void *a, const void *b, size_t bytes)
{
    if (bytes == 0)
        return true;
    return a && b && memcmp(a, b, bytes) == 0;
}

/* Every field and every byte of two tensors, quant state included. */
static void assert_same_tensor(const qtensor *got, const qtensor *want, const char *what)
{
    cr_assert_eq(got->kind, want->kind, "%s: kind %s vs %s", what, qt_kind_name(got->kind),
                 qt_kind_name(want->kind));
    cr_assert_eq(got->rows, want->rows, "%s: rows", what);
    cr_assert_eq(got->cols, want->cols, "%s: cols", what);
    cr_assert_eq(got->data_bytes, want->data_bytes, "%s: data bytes", what);
    cr_assert(same_array(got->data, want->data, want->data_bytes), "%s: codes differ", what);
    cr_assert_eq(got->blocksize, want->blocksize, "%s: blocksize", what);
    cr_assert_eq(got->n_blocks, want->n_blocks, "%s: blocks", what);
    cr_assert(same_array(got->codebook, want->codebook, sizeof got->codebook), "%s: codebook",
              what);
    cr_assert_eq(got->nested, want->nested, "%s: nested", what);
    cr_assert_eq(got->absmax != NULL, want->absmax != NULL, "%s: absmax presence", what);
    if (want->absmax)
        cr_assert(same_array(got->absmax, want->absmax, (size_t)want->n_blocks * sizeof(float)),
                  "%s: absmax differs", what);
    cr_assert_eq(got->absmax_codes != NULL, want->absmax_codes != NULL, "%s: nested codes", what);
    if (want->nested) {
        cr_assert(same_array(got->absmax_codes, want->absmax_codes, (size_t)want->n_blocks),
                  "%s: absmax codes differ", what);
        cr_assert_eq(got->n_nested_blocks, want->n_nested_blocks, "%s: nested blocks", what);
        cr_assert(same_array(got->nested_absmax, want->nested_absmax,
                             (size_t)want->n_nested_blocks * sizeof(float)),
                  "%s: nested absmax differs", what);
        cr_assert_eq(got->nested_blocksize, want->nested_blocksize, "%s: nested blocksize", what);
        cr_assert(same_bits(got->nested_offset, want->nested_offset), "%s: nested offset", what);
        cr_assert(same_array(got->nested_code, want->nested_code, sizeof got->nested_code),
                  "%s: nested code", what);
    }
    cr_assert_eq(got->bits, want->bits, "%s: bits", what);
    cr_assert_eq(got->group_size, want->group_size, "%s: group size", what);
    cr_assert_eq(got->groups_per_row, want->groups_per_row, "%s: groups per row", what);
    cr_assert_eq(got->qmin, want->qmin, "%s: qmin", what);
    cr_assert_eq(got->qmax, want->qmax, "%s: qmax", what);
    cr_assert_eq(got->zero_domain, want->zero_domain, "%s: zero domain", what);
    cr_assert_eq(got->row_stride, want->row_stride, "%s: row stride", what);
    size_t nq = (size_t)(want->rows * want->groups_per_row) * sizeof(float);
    cr_assert(same_array(got->scales, want->scales, want->scales ? nq : 0), "%s: scales differ",
              what);
    cr_assert(same_array(got->zeros, want->zeros, want->zeros ? nq : 0), "%s: zeros differ", what);
}

/* The layout a merged tensor must keep from its pristine one. */
static void assert_same_layout(const qtensor *merged, const qtensor *pristine, const char *what)
{
    cr_assert_eq(merged->kind, pristine->kind, "%s: kind", what);
    cr_assert_eq(merged->rows, pristine->rows, "%s: rows", what);
    cr_assert_eq(merged->cols, pristine->cols, "%s: cols", what);
    cr_assert_eq(merged->data_bytes, pristine->data_bytes, "%s: data bytes", what);
    cr_assert_eq(merged->blocksize, pristine->blocksize, "%s: blocksize", what);
    cr_assert_eq(merged->nested, pristine->nested, "%s: nested", what);
    cr_assert_eq(merged->nested_blocksize, pristine->nested_blocksize, "%s: nested blocks", what);
    cr_assert(same_array(merged->codebook, pristine->codebook, sizeof merged->codebook),
              "%s: codebook", what);
    cr_assert_eq(merged->bits, pristine->bits, "%s: bits", what);
    cr_assert_eq(merged->group_size, pristine->group_size, "%s: group size", what);
    cr_assert_eq(merged->zero_domain, pristine->zero_domain, "%s: zero domain", what);
    cr_assert_eq(merged->qmin, pristine->qmin, "%s: qmin", what);
    cr_assert_eq(merged->qmax, pristine->qmax, "%s: qmax", what);
    cr_assert_eq(merged->row_stride, pristine->row_stride, "%s: row stride", what);
}

static const lora_ops *ops_for(const qtensor *w)
{
    const lora_ops *ops = NULL;
    char msg[256];
    cr_assert_eq(lora_dispatch(w, &ops, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert(ops);
    return ops;
}

static int merge(const qtensor *w, const lora_part *parts, size_t n, bool safe, qt_kind into,
                 qtensor *merged, lora_cost *cost, char *msg, size_t msg_len)
{
    lora_merge_opts o = {.safe_merge = safe, .into = into};
    return ops_for(w)->merge(w, parts, n, &o, "model.layers.3.self_attn.q_proj", merged, cost, msg,
                             msg_len);
}

/* --- the dispatch --------------------------------------------------------- */

Test(lora_merge, dispatch_gives_every_kind_its_operations)
{
    for (int k = 0; k < QT_KIND_COUNT; k++) {
        qtensor w = {.kind = (qt_kind)k, .rows = 2, .cols = 32};
        const lora_ops *ops = ops_for(&w);
        cr_assert_str_eq(ops->kind, qt_kind_name((qt_kind)k));
        cr_assert(ops->merge, "%s: merge", ops->kind);
    }
}

Test(lora_merge, dispatch_names_an_unsupported_kind)
{
    qtensor w = {.kind = (qt_kind)QT_KIND_COUNT, .rows = 2, .cols = 32};
    const lora_ops *ops = (const lora_ops *)&w;
    char msg[256] = "", want[64];
    cr_assert_eq(lora_dispatch(&w, &ops, msg, sizeof msg), QL_EUNSUPPORTED);
    cr_assert_null(ops);
    snprintf(want, sizeof want, "quant kind %d", (int)QT_KIND_COUNT);
    cr_assert(strstr(msg, want), "the message names the kind by number: %s", msg);
}

Test(lora_merge, a_family_merge_refuses_a_weight_of_another_family)
{
    qtensor nf4, q8;
    make_weight(&nf4, &cases[0], 1);
    make_weight(&q8, &cases[11], 2);
    const lora_ops *ops = ops_for(&nf4);
    qtensor merged;
    lora_cost cost;
    char msg[256] = "";
    lora_merge_opts o = {.safe_merge = true, .into = QT_KIND_COUNT};
    cr_assert_eq(ops->merge(&q8, NULL, 0, &o, "m", &merged, &cost, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "q8_0"), "%s", msg);
    qt_free(&nf4);
    qt_free(&q8);
}

/* --- merging into each kind ----------------------------------------------- */

Test(lora_merge, merged_keeps_the_pristine_layout_and_equals_requantized_sum_bit_for_bit)
{
    const qt_kind ab_kinds[] = {QT_F32, QT_BF16};
    for (size_t i = 0; i < N_CASES; i++) {
        for (size_t j = 0; j < 2; j++) {
            const kind_case *k = &cases[i];
            char what[64];
            snprintf(what, sizeof what, "%s, A/B %s", k->name, qt_kind_name(ab_kinds[j]));
            qtensor w;
            make_weight(&w, k, 100 + i);
            eng_lora_module m;
            make_module(&m, ab_kinds[j], k->rows, k->cols, 4, 0.05, 0.05, 200 + i);
            lora_part part = {.adapter = "french", .module = &m, .scale = 0.5f};

            qtensor merged, want;
            lora_cost cost;
            char msg[256] = "";
            cr_assert_eq(merge(&w, &part, 1, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                         QL_OK, "%s: %s", what, msg);
            float *d = reference_delta(&part, 1, k->rows, k->cols);
            reference_merge(&want, &w, d, &k->p);
            assert_same_layout(&merged, &w, what);
            assert_same_tensor(&merged, &want, what);
            lora_cost ref = reference_cost(&w, &merged, d);
            assert_cost(&cost, &ref, what);

            free(d);
            qt_free(&want);
            qt_free(&merged);
            free_module(&m);
            qt_free(&w);
        }
    }
}

/* eps is not stored: a constant group's scale is the clamp itself, so
 * requantizing shows which eps the merge used (torchao: 1e-6 for int4
 * weight-only, FLT_EPSILON for int8 weight-only). */
Test(lora_merge, affine_merge_keeps_torchao_eps_on_constant_groups)
{
    const size_t affine_cases[] = {5, 6}; /* int4-g32 (float zero), int8-channel */
    const float want_eps[] = {1e-6f, FLT_EPSILON};
    for (size_t i = 0; i < 2; i++) {
        const kind_case *k = &cases[affine_cases[i]];
        uint64_t seed = 50 + i;
        float *v = normal_values(&seed, k->rows * k->cols, 0.02);
        for (int64_t c = 0; c < k->cols; c++)
            v[c] = i == 0 ? 0.01f : 0.0f; /* row 0 constant: 0.01 (int4), 0 (int8) */
        qtensor w, merged, want;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&w, v, k->rows, k->cols, &k->p, msg, sizeof msg), QL_OK, "%s",
                     msg);
        cr_assert_eq(w.scales[0], want_eps[i], "%s: the pristine scale is the clamp", k->name);
        lora_cost cost;
        cr_assert_eq(merge(&w, NULL, 0, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        cr_assert_eq(merged.scales[0], want_eps[i], "%s: merged scale %a", k->name,
                     (double)merged.scales[0]);
        float *wv = dequant(&w);
        cr_assert_eq(qt_quantize(&want, wv, k->rows, k->cols, &k->p, msg, sizeof msg), QL_OK);
        assert_same_tensor(&merged, &want, k->name);
        free(wv);
        free(v);
        qt_free(&want);
        qt_free(&merged);
        qt_free(&w);
    }
}

Test(lora_merge, merging_leaves_the_pristine_weight_untouched)
{
    for (size_t i = 0; i < N_CASES; i++) {
        const kind_case *k = &cases[i];
        qtensor w, before, merged;
        make_weight(&w, k, 300 + i);
        cr_assert_eq(qt_clone(&before, &w), QL_OK);
        eng_lora_module m;
        make_module(&m, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 400 + i);
        lora_part part = {.adapter = "french", .module = &m, .scale = 1.0f};
        lora_cost cost;
        char msg[256] = "";
        cr_assert_eq(merge(&w, &part, 1, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        assert_same_tensor(&w, &before, k->name);
        qt_free(&merged);
        qt_free(&before);
        free_module(&m);
        qt_free(&w);
    }
}

/* The AVX2 merge (two rows at a time, 16 columns at a time, the cost in
 * eight lanes, the AVX2 quantizer) against the scalar one: the same bytes
 * and the same report, bit for bit, and both the float64 reference's.
 * Shapes with a column tail (53, 40: no multiple of 16), an odd row count
 * and more rows than one block of the merge (300 x 64: blocks of 256 rows),
 * two parts of different ranks. */
Test(lora_merge, avx2_and_scalar_merges_give_the_same_bytes_and_report)
{
    if (strcmp(qt_cpu_path(), "avx2") != 0)
        test_cannot_run("no AVX2 on this CPU: the scalar merge is the only one");
    const kind_case shapes[] = {
        {"f32-53", {.kind = QT_F32}, 37, 53, true},
        {"nf4-40", {.kind = QT_NF4, .blocksize = 64}, 37, 40, true},
        {"nf4-300x64", {.kind = QT_NF4, .blocksize = 64}, 300, 64, true},
        {"int8-53", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, 37, 53, false},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const kind_case *k = &shapes[i];
        qtensor w;
        make_weight(&w, k, 900 + i);
        eng_lora_module m1, m2;
        make_module(&m1, QT_F32, k->rows, k->cols, 16, 0.05, 0.05, 910 + i);
        make_module(&m2, QT_BF16, k->rows, k->cols, 3, 0.04, 0.03, 920 + i);
        lora_part parts[2] = {{.adapter = "french", .module = &m1, .scale = 0.5f},
                              {.adapter = "legal", .module = &m2, .scale = -1.25f}};
        qtensor fast, ref, want;
        lora_cost c_fast, c_ref;
        char msg[256] = "";
        qt_set_force_scalar(false);
        cr_assert_eq(merge(&w, parts, 2, true, QT_KIND_COUNT, &fast, &c_fast, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        qt_set_force_scalar(true);
        cr_assert_eq(merge(&w, parts, 2, true, QT_KIND_COUNT, &ref, &c_ref, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        qt_set_force_scalar(false);
        assert_same_tensor(&fast, &ref, k->name);
        cr_assert(same_array(&c_fast.dot, &c_ref.dot, sizeof c_ref.dot) &&
                      same_array(&c_fast.delta_sq, &c_ref.delta_sq, sizeof c_ref.delta_sq) &&
                      same_array(&c_fast.err_sq, &c_ref.err_sq, sizeof c_ref.err_sq),
                  "%s: reports differ: dot %a/%a, delta_sq %a/%a, err_sq %a/%a", k->name,
                  c_fast.dot, c_ref.dot, c_fast.delta_sq, c_ref.delta_sq, c_fast.err_sq,
                  c_ref.err_sq);
        float *d = reference_delta(parts, 2, k->rows, k->cols);
        reference_merge(&want, &w, d, &k->p);
        assert_same_tensor(&fast, &want, k->name);
        lora_cost rc = reference_cost(&w, &fast, d);
        assert_cost(&c_fast, &rc, k->name);
        free(d);
        qt_free(&want);
        qt_free(&fast);
        qt_free(&ref);
        qt_free(&w);
        free_module(&m1);
        free_module(&m2);
    }
}

Test(lora_merge, two_parts_merge_as_the_sum_of_their_deltas)
{
    for (size_t i = 0; i < N_CASES; i++) {
        const kind_case *k = &cases[i];
        qtensor w;
        make_weight(&w, k, 500 + i);
        eng_lora_module m1, m2;
        make_module(&m1, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 600 + i);
        make_module(&m2, QT_BF16, k->rows, k->cols, 8, 0.04, 0.03, 700 + i);
        lora_part parts[2] = {{.adapter = "french", .module = &m1, .scale = 0.5f},
                              {.adapter = "legal", .module = &m2, .scale = -1.25f}};
        qtensor merged, want;
        lora_cost cost;
        char msg[256] = "";
        cr_assert_eq(merge(&w, parts, 2, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        float *d = reference_delta(parts, 2, k->rows, k->cols);
        reference_merge(&want, &w, d, &k->p);
        assert_same_tensor(&merged, &want, k->name);
        lora_cost ref = reference_cost(&w, &merged, d);
        assert_cost(&cost, &ref, k->name);
        if (k->p.kind == QT_F32) {
            /* f32 stores the sum itself: W + d1 + d2, one rounding */
            float *wv = dequant(&w), *q = dequant(&merged);
            for (int64_t e = 0; e < k->rows * k->cols; e++)
                cr_assert(same_bits(q[e], wv[e] + d[e]), "f32 element %lld", (long long)e);
            free(wv);
            free(q);
        }
        free(d);
        qt_free(&want);
        qt_free(&merged);
        free_module(&m1);
        free_module(&m2);
        qt_free(&w);
    }
}

/*
 * With scale 0 the delta is zero and the merge gives Q(dequant(W)), which
 * is W itself, bit for bit, exactly where requantizing is idempotent:
 *   - f32, f16, bf16: the values are already in the dtype;
 *   - nf4, fp4 without double quantization: each block's largest value sits
 *     on code +-1, so absmax comes back the same and every other value
 *     lands on its own code again (fp4: the same value; its zero has two
 *     codes);
 *   - q4_0, q8_0: the block scale comes back from the extreme value, which
 *     sits on code -8 (q4_0) or +-127 (q8_0), through the same f16;
 *   - q4_1: the minimum sits on code 0 and the maximum on 15, so min and
 *     (max - min) / 15 come back through the same f16s (300 of 300 random
 *     tensors, every element);
 *   - not with double quantization: the offset is the mean of the
 *     dequantized absmax, not of the original, so nested codes move (about
 *     90% of elements change);
 *   - not for affine: the scale is recomputed in f32 from the dequantized
 *     extremes; torchao's symmetric divisor (qmax - qmin) / 2 = 127.5 puts
 *     the extreme on code 127 and shrinks the scale by 127 / 127.5 on every
 *     requantization (int8 per channel: almost every element changes; int4
 *     with a float zero: about 10%).
 * The report then says nothing of the delta was lost (retained 1) and gives
 * relative_error 0 where W came back and +inf where requantization alone
 * moved W (no finite multiple of a zero delta describes it).
 */
/* FP4 has two codes for zero (0 and 8, both +0.0 in bitsandbytes' table):
 * requantizing a zero picks code 0, so the values come back bit for bit
 * but a code 8 may come back as 0. */
static void assert_fp4_same_but_zero_codes(const qtensor *got, const qtensor *want,
                                           const char *what)
{
    cr_assert_eq(got->data_bytes, want->data_bytes, "%s", what);
    for (int64_t e = 0; e < want->rows * want->cols; e++) {
        int shift = (e & 1) ? 0 : 4;
        int g = (got->data[e / 2] >> shift) & 15, w = (want->data[e / 2] >> shift) & 15;
        cr_assert(g == w || (w == 8 && g == 0), "%s: code %lld: %d vs %d", what, (long long)e, g,
                  w);
    }
    cr_assert(same_array(got->absmax, want->absmax, (size_t)want->n_blocks * sizeof(float)),
              "%s: absmax differs", what);
}

Test(lora_merge, zero_scale_part_gives_the_requantized_pristine)
{
    for (size_t i = 0; i < N_CASES; i++) {
        const kind_case *k = &cases[i];
        qtensor w, merged, want;
        make_weight(&w, k, 800 + i);
        eng_lora_module m;
        make_module(&m, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 900 + i);
        lora_part part = {.adapter = "french", .module = &m, .scale = 0.0f};
        lora_cost cost;
        char msg[256] = "";
        cr_assert_eq(merge(&w, &part, 1, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        float *wv = dequant(&w);
        cr_assert_eq(qt_quantize(&want, wv, k->rows, k->cols, &k->p, msg, sizeof msg), QL_OK);
        assert_same_tensor(&merged, &want, k->name);

        float *q = dequant(&merged);
        bool identity = memcmp(q, wv, (size_t)(k->rows * k->cols) * sizeof(float)) == 0;
        cr_assert_eq(identity, k->requant_is_identity, "%s: Q(dequant(W)) == W is %s", k->name,
                     identity ? "true" : "false");
        if (identity && k->p.kind != QT_FP4)
            assert_same_tensor(&merged, &w, k->name);
        if (identity && k->p.kind == QT_FP4)
            assert_fp4_same_but_zero_codes(&merged, &w, k->name);
        cr_assert_eq(cost.delta_sq, 0.0, "%s", k->name);
        cr_assert_eq(cost.dot, 0.0, "%s", k->name);
        cr_assert_eq(cost.delta_retained, 1.0, "%s", k->name);
        /* Q6_K's requantization gives every value back (==) but may mirror
         * a sub-block (its scale's sign flipped, its codes reflected about
         * 32), so a zero may come back as -0: no error, other bytes */
        bool same_values = true;
        for (int64_t e = 0; e < k->rows * k->cols; e++)
            same_values = same_values && q[e] == wv[e];
        if (k->p.kind == QT_Q6_K)
            cr_assert(same_values && cost.err_sq == 0.0 && cost.relative_error == 0.0,
                      "%s: requantizing changed values (relative error %g)", k->name,
                      cost.relative_error);
        else if (identity)
            cr_assert_eq(cost.relative_error, 0.0, "%s", k->name);
        else
            cr_assert(cost.err_sq > 0.0 && isinf(cost.relative_error), "%s: %g", k->name,
                      cost.relative_error);
        free(wv);
        free(q);
        qt_free(&want);
        qt_free(&merged);
        free_module(&m);
        qt_free(&w);
    }
}

Test(lora_merge, no_parts_merge_like_a_zero_delta)
{
    qtensor w, merged, want;
    make_weight(&w, &cases[0], 11);
    lora_cost cost;
    char msg[256] = "";
    cr_assert_eq(merge(&w, NULL, 0, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg), QL_OK,
                 "%s", msg);
    cr_assert_eq(qt_clone(&want, &w), QL_OK);
    assert_same_tensor(&merged, &want, "nf4, no parts");
    cr_assert_eq(cost.delta_retained, 1.0);
    cr_assert_eq(cost.relative_error, 0.0);
    qt_free(&want);
    qt_free(&merged);
    qt_free(&w);
}

/* --- storing into a wider kind -------------------------------------------- */

Test(lora_merge, into_int8_and_bf16_store_those_kinds_and_lose_less_than_4bit)
{
    const size_t four_bit[] = {0, 1, 3, 5, 9, 10}; /* nf4, nf4-dq, fp4, int4, q4_0, q4_1 */
    for (size_t f = 0; f < sizeof four_bit / sizeof *four_bit; f++) {
        const kind_case *k = &cases[four_bit[f]];
        qtensor w;
        make_weight(&w, k, 1000 + f);
        eng_lora_module m;
        make_module(&m, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 1100 + f);
        lora_part part = {.adapter = "french", .module = &m, .scale = 0.5f};
        float *d = reference_delta(&part, 1, k->rows, k->cols);
        char msg[256] = "";

        qtensor own, int8, bf16, want;
        lora_cost c_own, c_int8, c_bf16;
        cr_assert_eq(merge(&w, &part, 1, true, QT_KIND_COUNT, &own, &c_own, msg, sizeof msg), QL_OK,
                     "%s", msg);
        cr_assert_eq(merge(&w, &part, 1, true, QT_AFFINE, &int8, &c_int8, msg, sizeof msg), QL_OK,
                     "%s", msg);
        cr_assert_eq(merge(&w, &part, 1, true, QT_BF16, &bf16, &c_bf16, msg, sizeof msg), QL_OK,
                     "%s", msg);

        /* int8: per channel, symmetric, as engine/model/loader.c's --quant int8 */
        cr_assert_eq(int8.kind, QT_AFFINE, "%s", k->name);
        cr_assert_eq(int8.bits, 8, "%s", k->name);
        cr_assert_eq(int8.group_size, k->cols, "%s: per channel", k->name);
        cr_assert_eq(int8.qmin, -128, "%s", k->name);
        cr_assert_eq(int8.qmax, 127, "%s", k->name);
        cr_assert_eq(int8.zero_domain, QT_ZERO_INT, "%s", k->name);
        for (int64_t g = 0; g < int8.rows; g++)
            cr_assert_eq(int8.zeros[g], 0.0f, "%s: symmetric zero", k->name);
        qt_quant_params p8 = {.kind = QT_AFFINE, .bits = 8, .symmetric = true};
        reference_merge(&want, &w, d, &p8);
        assert_same_tensor(&int8, &want, k->name);
        qt_free(&want);
        lora_cost ref = reference_cost(&w, &int8, d);
        assert_cost(&c_int8, &ref, k->name);

        cr_assert_eq(bf16.kind, QT_BF16, "%s", k->name);
        qt_quant_params pb = {.kind = QT_BF16};
        reference_merge(&want, &w, d, &pb);
        assert_same_tensor(&bf16, &want, k->name);
        qt_free(&want);
        ref = reference_cost(&w, &bf16, d);
        assert_cost(&c_bf16, &ref, k->name);

        cr_assert_lt(c_int8.relative_error, c_own.relative_error, "%s: int8 %g vs own %g", k->name,
                     c_int8.relative_error, c_own.relative_error);
        cr_assert_lt(c_bf16.relative_error, c_own.relative_error, "%s: bf16 %g vs own %g", k->name,
                     c_bf16.relative_error, c_own.relative_error);
        cr_assert_lt(c_bf16.relative_error, c_int8.relative_error, "%s: bf16 %g vs int8 %g",
                     k->name, c_bf16.relative_error, c_int8.relative_error);

        free(d);
        qt_free(&own);
        qt_free(&int8);
        qt_free(&bf16);
        free_module(&m);
        qt_free(&w);
    }
}

/* A k-quant weight (Q2_K ... Q6_K, IQ4_NL, IQ4_XS) as a GGUF file holds it (random block bytes, not
 * made by our quantizer) merges into its own kind as the reference does (dequantize, add the delta,
 * qt_quantize into the same kind: llama.cpp's reference quantizer), reports what that cost, and
 * "into" int8 or bf16 still merges it as any kind; the wider kinds lose less. */
Test(lora_merge, a_kquant_merges_into_its_own_kind_int8_or_bf16)
{
    const qt_kind kinds[] = {QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_Q2_K, QT_Q3_K, QT_IQ4_NL, QT_IQ4_XS};
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
        const char *name = qt_kind_name(kinds[i]);
        uint64_t rng = 70 + i;
        qtensor w, before;
        test_random_kquant(&w, kinds[i], 8, 512, &rng);
        cr_assert_eq(qt_clone(&before, &w), QL_OK);
        eng_lora_module m;
        make_module(&m, QT_F32, 8, 512, 4, 0.05, 0.05, 80 + i);
        lora_part part = {.adapter = "french", .module = &m, .scale = 0.5f};
        float *d = reference_delta(&part, 1, 8, 512);
        qtensor merged, want;
        lora_cost own, cost;
        char msg[256] = "";
        cr_assert_eq(merge(&w, &part, 1, true, QT_KIND_COUNT, &merged, &own, msg, sizeof msg),
                     QL_OK, "%s: %s", name, msg);
        qt_quant_params po = {.kind = kinds[i]};
        reference_merge(&want, &w, d, &po);
        assert_same_layout(&merged, &w, name);
        assert_same_tensor(&merged, &want, name);
        lora_cost ref = reference_cost(&w, &merged, d);
        assert_cost(&own, &ref, name);
        cr_assert(own.merged && own.delta_retained > 0.5 && own.delta_retained < 1.5 &&
                      isfinite(own.relative_error) && own.relative_error > 0.0,
                  "%s: retained %g, relative error %g", name, own.delta_retained,
                  own.relative_error);
        assert_same_tensor(&w, &before, name);
        qt_free(&want);
        qt_free(&merged);
        const qt_kind into[] = {QT_AFFINE, QT_BF16};
        for (int j = 0; j < 2; j++) {
            cr_assert_eq(merge(&w, &part, 1, true, into[j], &merged, &cost, msg, sizeof msg), QL_OK,
                         "%s", msg);
            qt_quant_params p = {.kind = into[j], .bits = 8, .symmetric = true};
            reference_merge(&want, &w, d, &p);
            assert_same_tensor(&merged, &want, name);
            cr_assert_lt(cost.relative_error, own.relative_error, "%s into %s: %g vs own %g", name,
                         qt_kind_name(into[j]), cost.relative_error, own.relative_error);
            qt_free(&want);
            qt_free(&merged);
        }
        free(d);
        free_module(&m);
        qt_free(&before);
        qt_free(&w);
    }
}

Test(lora_merge, into_a_kind_other_than_int8_or_bf16_is_refused)
{
    qtensor w, merged;
    make_weight(&w, &cases[0], 12);
    lora_cost cost;
    char msg[256] = "";
    cr_assert_eq(merge(&w, NULL, 0, true, QT_F16, &merged, &cost, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "f16"), "%s", msg);
    qtensor zero = {0};
    cr_assert(memcmp(&merged, &zero, sizeof zero) == 0);
    qt_free(&w);
}

Test(lora_merge, a_bnb4_weight_with_a_foreign_codebook_merges_only_into_a_wider_kind)
{
    for (size_t i = 0; i < 2; i++) {
        const kind_case *k = &cases[i]; /* nf4, nf4 double-quant */
        qtensor w, merged;
        make_weight(&w, k, 40 + i);
        w.codebook[14] = nextafterf(w.codebook[14], 1.0f);
        lora_cost cost;
        char msg[512] = "";
        cr_assert_eq(merge(&w, NULL, 0, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                     QL_EUNSUPPORTED, "%s", k->name);
        cr_assert(strstr(msg, "quant_map"), "%s: %s", k->name, msg);
        cr_assert_eq(merge(&w, NULL, 0, true, QT_AFFINE, &merged, &cost, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        cr_assert_eq(merged.kind, QT_AFFINE);
        qt_free(&merged);
        qt_free(&w);
    }
}

/* --- safe merge ------------------------------------------------------------ */

static void assert_nothing_produced(const qtensor *merged, const lora_cost *cost)
{
    qtensor zero_t;
    lora_cost zero_c;
    memset(&zero_t, 0, sizeof zero_t);
    memset(&zero_c, 0, sizeof zero_c);
    cr_assert(memcmp(merged, &zero_t, sizeof zero_t) == 0, "the merged tensor is not zeroed");
    cr_assert(memcmp(cost, &zero_c, sizeof zero_c) == 0, "the cost is not zeroed");
}

Test(lora_merge, safe_merge_refuses_a_nan_naming_adapter_module_and_index)
{
    for (size_t i = 0; i < N_CASES; i++) {
        const kind_case *k = &cases[i];
        qtensor w, merged;
        make_weight(&w, k, 1200 + i);
        eng_lora_module good, bad;
        make_module(&good, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 1300 + i);
        make_module(&bad, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 1400 + i);
        ((float *)bad.b.data)[5 * 4 + 2] = NAN; /* B[5][2]: all of row 5 */
        lora_part parts[2] = {{.adapter = "french", .module = &good, .scale = 1.0f},
                              {.adapter = "broken", .module = &bad, .scale = 1.0f}};
        lora_cost cost;
        char msg[512] = "";
        cr_assert_eq(merge(&w, parts, 2, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                     QL_ENONFINITE, "%s", k->name);
        cr_assert(strstr(msg, "broken"), "%s: names the adapter: %s", k->name, msg);
        cr_assert(strstr(msg, "model.layers.3.self_attn.q_proj"), "%s: names the module: %s",
                  k->name, msg);
        cr_assert(strstr(msg, "(row 5, col 0)"), "%s: names the index: %s", k->name, msg);
        assert_nothing_produced(&merged, &cost);
        free_module(&good);
        free_module(&bad);
        qt_free(&w);
    }
}

Test(lora_merge, safe_merge_refuses_an_inf_from_a_huge_scale)
{
    const kind_case *k = &cases[0];
    qtensor w, merged;
    make_weight(&w, k, 13);
    eng_lora_module good, huge;
    make_module(&good, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 14);
    make_module(&huge, QT_F32, k->rows, k->cols, 4, 0.05, 100.0, 15);
    memset(huge.b.data, 0, 10 * 4 * sizeof(float)); /* rows 0-9 stay finite */
    lora_part parts[2] = {{.adapter = "french", .module = &good, .scale = 1.0f},
                          {.adapter = "overflowing", .module = &huge, .scale = 1e38f}};
    /* where the first overflow to f32 Inf lands, from the reference */
    float *d = reference_delta(parts, 2, k->rows, k->cols);
    float *wv = dequant(&w);
    int64_t first = -1;
    for (int64_t e = 0; e < k->rows * k->cols && first < 0; e++)
        if (!isfinite(wv[e] + d[e]))
            first = e;
    cr_assert_geq(first, 0, "the scale must overflow somewhere");
    char want[64];
    snprintf(want, sizeof want, "(row %lld, col %lld)", (long long)(first / k->cols),
             (long long)(first % k->cols));

    lora_cost cost;
    char msg[512] = "";
    cr_assert_eq(merge(&w, parts, 2, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                 QL_ENONFINITE);
    cr_assert(strstr(msg, "overflowing"), "names the adapter: %s", msg);
    cr_assert(strstr(msg, "model.layers.3.self_attn.q_proj"), "names the module: %s", msg);
    cr_assert(strstr(msg, want), "names %s: %s", want, msg);
    assert_nothing_produced(&merged, &cost);
    free(d);
    free(wv);
    free_module(&good);
    free_module(&huge);
    qt_free(&w);
}

Test(lora_merge, safe_merge_names_a_non_finite_pristine_weight)
{
    float v[2 * 32] = {0};
    v[32 + 3] = INFINITY;
    qtensor w, merged;
    char msg[512] = "";
    cr_assert_eq(qt_from_dense(&w, QT_F32, v, 2, 32, msg, sizeof msg), QL_OK);
    lora_cost cost;
    cr_assert_eq(merge(&w, NULL, 0, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                 QL_ENONFINITE);
    cr_assert(strstr(msg, "pristine") && strstr(msg, "(row 1, col 3)"), "%s", msg);
    assert_nothing_produced(&merged, &cost);
    qt_free(&w);
}

Test(lora_merge, without_safe_merge_the_quantizer_still_refuses_a_nan)
{
    const kind_case *k = &cases[0];
    qtensor w, merged;
    make_weight(&w, k, 16);
    eng_lora_module bad;
    make_module(&bad, QT_F32, k->rows, k->cols, 4, 0.05, 0.05, 17);
    ((float *)bad.b.data)[7 * 4] = NAN;
    lora_part part = {.adapter = "broken", .module = &bad, .scale = 1.0f};
    lora_cost cost;
    char msg[512] = "";
    cr_assert_eq(merge(&w, &part, 1, false, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                 QL_ENONFINITE);
    cr_assert(strstr(msg, "model.layers.3.self_attn.q_proj"), "names the module: %s", msg);
    cr_assert(strstr(msg, "row 7, col 0"), "keeps the quantizer's index: %s", msg);
    assert_nothing_produced(&merged, &cost);
    free_module(&bad);
    qt_free(&w);
}

Test(lora_merge, a_module_of_the_wrong_shape_is_refused_by_adapter_and_module)
{
    const kind_case *k = &cases[0];
    qtensor w, merged;
    make_weight(&w, k, 18);
    eng_lora_module m;
    make_module(&m, QT_F32, k->rows, k->cols + 32, 4, 0.05, 0.05, 19);
    lora_part part = {.adapter = "other-model", .module = &m, .scale = 1.0f};
    lora_cost cost;
    char msg[512] = "";
    cr_assert_eq(merge(&w, &part, 1, true, QT_KIND_COUNT, &merged, &cost, msg, sizeof msg),
                 QL_EINVAL);
    cr_assert(strstr(msg, "other-model") && strstr(msg, "q_proj") && strstr(msg, "[4, 128]"), "%s",
              msg);
    assert_nothing_produced(&merged, &cost);
    free_module(&m);
    qt_free(&w);
}

/* --- the report ------------------------------------------------------------ */

Test(lora_merge, cost_add_sums_the_sums_and_recomputes_the_ratios)
{
    lora_cost a = {.dot = 1.0, .delta_sq = 4.0, .err_sq = 1.0};
    lora_cost b = {.dot = 2.0, .delta_sq = 4.0, .err_sq = 7.0};
    lora_cost_add(&a, &b);
    cr_assert_eq(a.dot, 3.0);
    cr_assert_eq(a.delta_sq, 8.0);
    cr_assert_eq(a.err_sq, 8.0);
    cr_assert_eq(a.delta_retained, 3.0 / 8.0);
    cr_assert_eq(a.relative_error, 1.0);

    /* zero deltas: retained 1; error 0 while nothing moved, +inf once
     * something did */
    lora_cost z = {0}, moved = {.err_sq = 1e-6};
    lora_cost_add(&z, &(lora_cost){0});
    cr_assert_eq(z.delta_retained, 1.0);
    cr_assert_eq(z.relative_error, 0.0);
    lora_cost_add(&z, &moved);
    cr_assert_eq(z.delta_retained, 1.0);
    cr_assert(isinf(z.relative_error));
}

/* --- unmerged application -------------------------------------------------- */

Test(lora_merge, apply_adds_the_scaled_low_rank_product_for_every_kind)
{
    const int64_t rows = 64, cols = 96, rank = 4, batch = 3;
    eng_lora_module m;
    make_module(&m, QT_F32, rows, cols, rank, 0.05, 0.05, 20);
    uint64_t seed = 21;
    float *x = normal_values(&seed, batch * cols, 1.0);
    float *y0 = normal_values(&seed, batch * rows, 1.0);
    float *y = malloc((size_t)(batch * rows) * sizeof *y);
    float *t = malloc((size_t)(batch * rank) * sizeof *t);
    float *u = malloc((size_t)(batch * rows) * sizeof *u);
    for (int k = 0; k < QT_KIND_COUNT; k++) {
        qtensor w = {.kind = (qt_kind)k, .rows = rows, .cols = cols};
        memcpy(y, y0, (size_t)(batch * rows) * sizeof *y);
        cr_assert(ops_for(&w)->merge, "%s: dispatched", qt_kind_name((qt_kind)k));
        eng_lora_apply(NULL, &m, 0.5f, x, batch, y, t, u);
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t r = 0; r < rows; r++) {
                double want = y0[b * rows + r];
                for (int64_t j = 0; j < rank; j++) {
                    double xa = 0.0;
                    for (int64_t c = 0; c < cols; c++)
                        xa += (double)x[b * cols + c] * dense_at(&m.a, j * cols + c);
                    want += 0.5 * 2.0 * xa * dense_at(&m.b, r * rank + j);
                }
                cr_assert_float_eq(y[b * rows + r], want, 1e-5, "%s: y[%lld][%lld]",
                                   qt_kind_name((qt_kind)k), (long long)b, (long long)r);
            }
        }
    }
    free(x);
    free(y0);
    free(y);
    free(t);
    free(u);
    free_module(&m);
}

/* --- how much of a realistic adapter survives ------------------------------ */

/*
 * A trained LoRA's delta is small next to the weight: here rank 16 with
 * |delta| = 1% of |W| over a SmolLM2-135M MLP shape (576 x 1536), W ~
 * N(0, 0.02). A 4-bit step is far wider than most of such a delta, so most
 * of it rounds away; int8's step is about the delta's size, and storing
 * into int8 re-grids W + delta, keeping most of it. The figures are printed
 * so a change in them is seen.
 */
Test(lora_merge, realistic_delta_what_nf4_and_int8_retain)
{
    const int64_t rows = 576, cols = 1536, rank = 16;
    const kind_case nf4 = {"nf4", {.kind = QT_NF4, .blocksize = 64}, rows, cols, true};
    const kind_case int8 = {
        "int8", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, rows, cols, false};
    qtensor w4, w8;
    make_weight(&w4, &nf4, 31);
    make_weight(&w8, &int8, 31);
    eng_lora_module m;
    make_module(&m, QT_F32, rows, cols, rank, 1.0 / sqrt((double)cols), 1.0, 32);
    /* scale the part so that |delta| = 1% of |W| */
    lora_part part = {.adapter = "trained", .module = &m, .scale = 1.0f};
    float *d = reference_delta(&part, 1, rows, cols);
    float *wv = dequant(&w4);
    double dn = 0.0, wn = 0.0;
    for (int64_t e = 0; e < rows * cols; e++) {
        dn += (double)d[e] * d[e];
        wn += (double)wv[e] * wv[e];
    }
    part.scale = (float)(0.01 * sqrt(wn / dn));
    free(d);
    free(wv);

    const struct {
        const char *what;
        const qtensor *w;
        qt_kind into;
    } runs[] = {{"nf4", &w4, QT_KIND_COUNT},
                {"nf4 into int8", &w4, QT_AFFINE},
                {"nf4 into bf16", &w4, QT_BF16},
                {"int8", &w8, QT_KIND_COUNT}};
    lora_cost cost[4];
    for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
        qtensor merged;
        char msg[256] = "";
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        cr_assert_eq(
            merge(runs[i].w, &part, 1, true, runs[i].into, &merged, &cost[i], msg, sizeof msg),
            QL_OK, "%s", msg);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        cr_log_info("%s: |delta|/|W| = %.4f, delta_retained = %.4f, relative_error = %.4f "
                    "(merge of 576x1536 rank 16 in %.3f s)",
                    runs[i].what, sqrt(cost[i].delta_sq / wn), cost[i].delta_retained,
                    cost[i].relative_error, seconds);
        qt_free(&merged);
    }
    cr_assert(fabs(sqrt(cost[0].delta_sq / wn) - 0.01) < 1e-4, "the delta is 1%% of W");
    cr_assert(cost[0].delta_retained > 0.0 && cost[0].delta_retained < 1.2, "nf4 retains %g",
              cost[0].delta_retained);
    cr_assert_gt(cost[1].delta_retained, 0.9, "nf4 into int8 retains %g", cost[1].delta_retained);
    cr_assert_gt(cost[2].delta_retained, 0.9, "nf4 into bf16 retains %g", cost[2].delta_retained);
    /* a pristine int8 W is nearly on the grid it is requantized onto (the
     * channel scale shrinks by 127 / 127.5, torchao's symmetric divisor,
     * moving a typical code by a fraction of a step) and the delta is about
     * 0.4 of a step rms, so part of it rounds back: measured 0.887 */
    cr_assert(cost[3].delta_retained > 0.85 && cost[3].delta_retained < 0.95, "int8 retains %g",
              cost[3].delta_retained);
    free_module(&m);
    qt_free(&w4);
    qt_free(&w8);
}

/*
 * test_matmul.c - the matrix kernel y = x @ W^T of every kind, fast path
 * against scalar reference against a float64 reference, on ragged shapes
 * (rows and columns not multiples of the block, odd columns so rows start
 * mid-byte) and batches of 1, 3 and 17; and the fast dequantization against
 * the scalar one, bit for bit. The AVX-512 products against the AVX2 ones,
 * and their two-row register tiles against the one-row kernel (batches 2 ..
 * 33 against each row of x alone), bit for bit. qt_attend: both paths
 * against float64, and the AVX-512 path against the AVX2 one bit for bit.
 *
 * The k-quants (Q2_K ... Q6_K) and IQ4_NL, IQ4_XS cannot be quantized into
 * yet: their tensors are random blocks (random codes and sub-block scales,
 * small finite f16 d and dmin), as a GGUF file would hold them.
 *
 * Tolerance: both f32 paths differ from the exact sum only by summation
 * order, so |y - y64| <= 1e-5 * sum_k |x_k w_k| (f32 has 24 bits; a sum of
 * 4096 terms accumulates at most ~log2(4096) * 2^-24 relative to the
 * magnitude sum in the blocked orders used; 1e-5 leaves room).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"
#include "test_kquant.h"
#include "test_util.h"

typedef struct kcase {
    const char *label;
    qt_quant_params p;
    bool gguf;   /* columns must be a multiple of 32 */
    bool kquant; /* random blocks (test_kquant.h) instead of qt_quantize */
} kcase;

static const kcase kinds[] = {
    {"f32", {.kind = QT_F32}, false, false},
    {"f16", {.kind = QT_F16}, false, false},
    {"bf16", {.kind = QT_BF16}, false, false},
    {"nf4-64", {.kind = QT_NF4, .blocksize = 64}, false, false},
    {"nf4-32-dq", {.kind = QT_NF4, .blocksize = 32, .double_quant = true}, false, false},
    {"nf4-4096-dq", {.kind = QT_NF4, .blocksize = 4096, .double_quant = true}, false, false},
    {"fp4-128", {.kind = QT_FP4, .blocksize = 128}, false, false},
    {"int4-float-zero-channel",
     {.kind = QT_AFFINE, .bits = 4, .zero_domain = QT_ZERO_FLOAT},
     false,
     false},
    {"int4-sym-channel", {.kind = QT_AFFINE, .bits = 4, .symmetric = true}, false, false},
    {"int8-asym-int-channel",
     {.kind = QT_AFFINE, .bits = 8, .zero_domain = QT_ZERO_INT},
     false,
     false},
    {"q4_0", {.kind = QT_Q4_0}, true, false},
    {"q4_1", {.kind = QT_Q4_1}, true, false},
    {"q8_0", {.kind = QT_Q8_0}, true, false},
    {"q5_0", {.kind = QT_Q5_0}, true, false},
    {"q5_1", {.kind = QT_Q5_1}, true, false},
    {"q4_k", {.kind = QT_Q4_K}, true, true},
    {"q5_k", {.kind = QT_Q5_K}, true, true},
    {"q6_k", {.kind = QT_Q6_K}, true, true},
    {"q2_k", {.kind = QT_Q2_K}, true, true},
    {"q3_k", {.kind = QT_Q3_K}, true, true},
    {"iq4_nl", {.kind = QT_IQ4_NL}, true, true},
    {"iq4_xs", {.kind = QT_IQ4_XS}, true, true},
    {"mxfp4", {.kind = QT_MXFP4}, true, false},
};

/* Random blocks of super-blocks of 256 (every kquant kind but IQ4_NL,
 * whose blocks are 32). */
static bool super_blocks(const kcase *kc)
{
    return kc->kquant && qt_traits_table[kc->p.kind].block_size == 256;
}

/* The tensor a case multiplies: quantized from w, or random super-blocks. */
static void make_tensor(const kcase *kc, const float *w, int64_t rows, int64_t cols, uint64_t *rng,
                        qtensor *t)
{
    char msg[256];
    if (kc->kquant)
        test_random_kquant(t, kc->p.kind, rows, cols, rng);
    else
        cr_assert_eq(qt_quantize(t, w, rows, cols, &kc->p, msg, sizeof msg), QL_OK, "%s: %s",
                     kc->label, msg);
}

/* Grouped AFFINE kinds need columns divisible by the group. */
static const kcase grouped[] = {
    {"int4-g32-float-zero",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f},
     true,
     false},
    {"int4-g64-sym",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 64, .symmetric = true},
     true,
     false},
    {"int8-g128-sym",
     {.kind = QT_AFFINE, .bits = 8, .group_size = 128, .symmetric = true},
     true,
     false},
};

static void check_kind(const kcase *kc, int64_t rows, int64_t cols, uint64_t seed)
{
    uint64_t rng = seed;
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    float *x = malloc((size_t)(17 * cols) * sizeof *x);
    float *wd = malloc((size_t)(rows * cols) * sizeof *wd);
    float *wd_fast = malloc((size_t)(rows * cols) * sizeof *wd_fast);
    float *y_ref = malloc((size_t)(17 * rows) * sizeof *y_ref);
    float *y_fast = malloc((size_t)(17 * rows) * sizeof *y_fast);
    for (int64_t i = 0; i < rows * cols; i++)
        w[i] = 0.02f * test_normal(&rng);
    for (int64_t i = 0; i < 17 * cols; i++)
        x[i] = test_normal(&rng);
    qtensor t;
    make_tensor(kc, w, rows, cols, &rng, &t);

    /* the fast dequantization gives the reference's bits */
    qt_dequantize_rows_ref(&t, 0, rows, wd);
    qt_dequantize_rows(&t, 0, rows, wd_fast);
    for (int64_t i = 0; i < rows * cols; i++)
        cr_assert(same_bits(wd[i], wd_fast[i]), "%s [%lldx%lld] dequant %lld: %a vs %a", kc->label,
                  (long long)rows, (long long)cols, (long long)i, (double)wd[i],
                  (double)wd_fast[i]);
    /* dequantizing a middle row range alone gives the same bits */
    if (rows > 2) {
        qt_dequantize_rows(&t, 1, rows - 2, wd_fast);
        cr_assert_eq(memcmp(wd_fast, wd + cols, (size_t)((rows - 2) * cols) * 4), 0,
                     "%s: row range", kc->label);
    }

    int batches[3] = {1, 3, 17};
    for (int bi = 0; bi < 3; bi++) {
        int64_t batch = batches[bi];
        for (int64_t i = 0; i < batch * rows; i++)
            y_ref[i] = y_fast[i] = NAN;
        qt_matmul_ref(&t, x, batch, y_ref, 0, rows);
        qt_matmul(&t, x, batch, y_fast, 0, rows);
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t r = 0; r < rows; r++) {
                double exact = 0, mag = 0;
                for (int64_t k = 0; k < cols; k++) {
                    double term = (double)x[b * cols + k] * (double)wd[r * cols + k];
                    exact += term;
                    mag += fabs(term);
                }
                double tol = 1e-5 * mag + 1e-30;
                float yr = y_ref[b * rows + r], yf = y_fast[b * rows + r];
                cr_assert(fabs(yr - exact) <= tol, "%s ref b%lld r%lld: %g vs %g (tol %g)",
                          kc->label, (long long)b, (long long)r, (double)yr, exact, tol);
                cr_assert(fabs(yf - exact) <= tol,
                          "%s fast [%lldx%lld] batch %lld b%lld r%lld: %g vs %g (tol %g)",
                          kc->label, (long long)rows, (long long)cols, (long long)batch,
                          (long long)b, (long long)r, (double)yf, exact, tol);
            }
        }
    }

    /* a row range writes those rows only */
    if (rows > 3) {
        for (int64_t i = 0; i < 3 * rows; i++)
            y_fast[i] = -7.0f;
        qt_matmul(&t, x, 3, y_fast, 1, rows - 1);
        for (int64_t b = 0; b < 3; b++) {
            cr_assert_eq(y_fast[b * rows], -7.0f, "%s: row 0 written", kc->label);
            cr_assert_eq(y_fast[b * rows + rows - 1], -7.0f, "%s: last row written", kc->label);
            cr_assert_neq(y_fast[b * rows + 1], -7.0f);
        }
    }
    qt_free(&t);
    free(w);
    free(x);
    free(wd);
    free(wd_fast);
    free(y_ref);
    free(y_fast);
}

Test(matmul, fast_path_matches_reference_on_ragged_shapes, .timeout = 120)
{
    /* columns: odd, not a block multiple, one tile plus a ragged tail */
    const int64_t shapes[][2] = {{5, 37}, {7, 200}, {3, 1037}, {1, 1}, {13, 64}};
    /* 576: a row of 18 blocks of 32, no whole 256 (llama-quantize's IQ4_NL fallback) */
    const int64_t gguf_shapes[][2] = {{5, 96}, {3, 1056}, {1, 32}, {9, 544}, {4, 576}};
    /* k-quants: one super-block, one tile plus a super-block, several tiles */
    const int64_t kquant_shapes[][2] = {{5, 256}, {3, 768}, {1, 256}, {9, 1792}};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        if (super_blocks(&kinds[k])) {
            for (size_t s = 0; s < sizeof kquant_shapes / sizeof *kquant_shapes; s++)
                check_kind(&kinds[k], kquant_shapes[s][0], kquant_shapes[s][1], 400 + s);
        } else if (kinds[k].gguf) {
            for (size_t s = 0; s < sizeof gguf_shapes / sizeof *gguf_shapes; s++)
                check_kind(&kinds[k], gguf_shapes[s][0], gguf_shapes[s][1], 100 + s);
        } else {
            for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
                check_kind(&kinds[k], shapes[s][0], shapes[s][1], 200 + s);
        }
    }
    for (size_t k = 0; k < sizeof grouped / sizeof *grouped; k++) {
        check_kind(&grouped[k], 5, 128, 300);
        check_kind(&grouped[k], 3, 640, 301);
    }
}

Test(matmul, random_shapes_against_reference, .timeout = 120)
{
    uint64_t rng = 99;
    for (int i = 0; i < 40; i++) {
        const kcase *kc = &kinds[test_rand(&rng) % (sizeof kinds / sizeof *kinds)];
        int64_t rows = 1 + (int64_t)(test_rand(&rng) % 9);
        int64_t cols = 1 + (int64_t)(test_rand(&rng) % 700);
        if (super_blocks(kc))
            cols = 256 * (1 + cols / 256);
        else if (kc->gguf)
            cols = 32 * (1 + cols / 32);
        check_kind(kc, rows, cols, 1000 + (uint64_t)i);
    }
}

Test(matmul, scalar_switch_takes_the_reference_path)
{
    qt_set_force_scalar(true);
    cr_assert_str_eq(qt_cpu_path(), "scalar");
    check_kind(&kinds[3], 4, 100, 5);
    qt_set_force_scalar(false);
}

/* A row of x gets the same bits alone or in a batch, on every path: the
 * engine's batched decoding relies on it. */
Test(matmul, batching_never_changes_a_result, .timeout = 60)
{
    uint64_t rng = 4321;
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        int64_t rows = 7, cols = super_blocks(&kinds[k]) ? 768
                                 : kinds[k].kquant       ? 576
                                 : kinds[k].gguf         ? 320
                                                         : 301;
        float *w = malloc((size_t)(rows * cols) * 4), *x = malloc((size_t)(17 * cols) * 4);
        float *yb = malloc((size_t)(17 * rows) * 4), *y1 = malloc((size_t)rows * 4);
        for (int64_t i = 0; i < rows * cols; i++)
            w[i] = 0.02f * test_normal(&rng);
        for (int64_t i = 0; i < 17 * cols; i++)
            x[i] = test_normal(&rng);
        qtensor t;
        make_tensor(&kinds[k], w, rows, cols, &rng, &t);
        qt_matmul(&t, x, 17, yb, 0, rows);
        for (int64_t b = 0; b < 17; b++) {
            qt_matmul(&t, x + b * cols, 1, y1, 0, rows);
            for (int64_t r = 0; r < rows; r++)
                cr_assert(same_bits(y1[r], yb[b * rows + r]), "%s: row %lld of x, output %lld",
                          kinds[k].label, (long long)b, (long long)r);
        }
        qt_free(&t);
        free(w);
        free(x);
        free(yb);
        free(y1);
    }
}

/* A rows x cols tensor of kind kc from N(0, 0.02) weights into *t, and nx
 * rows of x from N(0, 1), returned (the caller frees both). */
static float *random_product(const kcase *kc, int64_t rows, int64_t cols, int64_t nx, uint64_t *rng,
                             qtensor *t)
{
    float *w = malloc((size_t)(rows * cols) * 4), *x = malloc((size_t)(nx * cols) * 4);
    cr_assert(w && x);
    for (int64_t i = 0; i < rows * cols; i++)
        w[i] = 0.02f * test_normal(rng);
    for (int64_t i = 0; i < nx * cols; i++)
        x[i] = test_normal(rng);
    make_tensor(kc, w, rows, cols, rng, t);
    free(w);
    return x;
}

/* Skips the running test where the f32 products have no AVX-512 set. */
static void skip_without_avx512(const char *what)
{
    if (strcmp(qt_f32_path(), "avx512") != 0)
        cr_skip_test("this CPU has no AVX-512 F and VL: %s cannot run here", what);
}

/* The AVX-512 products (eight rows of x per pass) give the AVX2 ones'
 * (four) bit for bit, for every kind and batches 1 .. 9 and 17, narrow and
 * wide (rows spanning several tiles and blocks). */
static void check_avx512_kind(const kcase *kc, int64_t cols, uint64_t *rng)
{
    int64_t rows = 11;
    qtensor t;
    float *x = random_product(kc, rows, cols, 17, rng, &t);
    float *y2 = malloc((size_t)(17 * rows) * 4), *y5 = malloc((size_t)(17 * rows) * 4);
    cr_assert(y2 && y5);
    for (int64_t batch = 1; batch <= 17; batch += batch < 9 ? 1 : 8) {
        qt_set_no_avx512(true);
        qt_matmul(&t, x, batch, y2, 0, rows);
        qt_set_no_avx512(false);
        qt_matmul(&t, x, batch, y5, 0, 4); /* two ranges, as the pool splits */
        qt_matmul(&t, x, batch, y5, 4, rows);
        for (int64_t i = 0; i < batch * rows; i++)
            cr_assert(same_bits(y2[i], y5[i]), "%s batch %lld output %lld: AVX2 %.9g, AVX-512 %.9g",
                      kc->label, (long long)batch, (long long)i, y2[i], y5[i]);
    }
    qt_free(&t);
    free(x);
    free(y2);
    free(y5);
}

Test(matmul, avx512_products_equal_the_avx2_ones, .timeout = 60)
{
    skip_without_avx512("the AVX-512 products");
    uint64_t rng = 77;
    /* narrow rows ride eight to a pass, wide ones (past 32 KiB of x) four */
    for (int wide = 0; wide < 2; wide++) {
        for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
            const kcase *kc = &kinds[k];
            int64_t cols = super_blocks(kc) ? 768 : kc->kquant ? 608 : kc->gguf ? 544 : 541;
            check_avx512_kind(kc, wide ? 3 * cols : cols, &rng);
        }
        for (size_t k = 0; k < sizeof grouped / sizeof *grouped; k++)
            check_avx512_kind(&grouped[k], wide ? 1280 : 640, &rng);
    }
}

/* The AVX-512 register tiles (two weight rows a pass, each x vector fed to
 * both) give every output the one-row kernel's bits: a batch of 1 .. 33
 * (chunks of eight and four rows of x, passes of four and the rest) against
 * each row of x alone (batch 1 never takes a tile), 13 rows split 0..5,
 * 5..13 (a range starting off a pair, each range ending in an odd row). */
static void check_tile_kind(const kcase *kc, int64_t cols, uint64_t *rng)
{
    int64_t rows = 13, nx = 33;
    qtensor t;
    float *x = random_product(kc, rows, cols, nx, rng, &t);
    float *y1 = malloc((size_t)(2 * nx * rows) * 4), *yb = y1 + nx * rows;
    cr_assert(y1);
    for (int64_t b = 0; b < nx; b++)
        qt_matmul(&t, x + b * cols, 1, y1 + b * rows, 0, rows);
    for (int64_t batch = 2; batch <= nx; batch++) {
        qt_matmul(&t, x, batch, yb, 0, 5);
        qt_matmul(&t, x, batch, yb, 5, rows);
        for (int64_t i = 0; i < batch * rows; i++)
            cr_assert(same_bits(y1[i], yb[i]),
                      "%s [%lldx%lld] batch %lld, row %lld of x, output %lld: one row %a, tile %a",
                      kc->label, (long long)rows, (long long)cols, (long long)batch,
                      (long long)(i / rows), (long long)(i % rows), (double)y1[i], (double)yb[i]);
    }
    qt_free(&t);
    free(x);
    free(y1);
}

Test(matmul, register_tiles_give_the_one_row_bits, .timeout = 120)
{
    skip_without_avx512("the register tiles");
    uint64_t rng = 2024;
    /* 640: a tile of 512 columns and a part; 1536: eight rows of x a
     * chunk; 2560: four; 301: a scalar tail; 544: blocks of 64 the row
     * does not hold whole. NF4/FP4 take their tile only in chunks of at
     * most four rows of x (2560 columns). */
    const int64_t cols[] = {640, 1536, 2560, 301, 544};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        const kcase *kc = &kinds[k];
        if (kc->gguf)
            continue; /* rows_gguf_pair and the others: avx512_products_equal_the_avx2_ones */
        for (size_t c = 0; c < sizeof cols / sizeof *cols; c++)
            check_tile_kind(kc, cols[c], &rng);
    }
    for (size_t k = 0; k < sizeof grouped / sizeof *grouped; k++)
        check_tile_kind(&grouped[k], 1280, &rng);
}

/* One query's attention over n positions on the path selected now, in
 * runs of uneven length, from a carried-over state (so the first block
 * rescales what came before): acc[0..d), then *max and *sum. */
static void attend_runs(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                        int32_t d, float *out)
{
    static const int32_t runs[] = {1, 5, 16, 3, 9, 7};
    float max = -4.0f, sum = 1.5f, scale = 1.0f / sqrtf((float)d);
    for (int32_t u = 0; u < d; u++)
        out[u] = 0.125f * (float)(u % 7) - 0.25f;
    for (int32_t p = 0, r = 0; p < n; r++) {
        int32_t len = runs[r % 6] < n - p ? runs[r % 6] : n - p;
        qt_attend(q, k + p * stride, v + p * stride, stride, len, d, scale, &max, &sum, out);
        p += len;
    }
    out[d] = max;
    out[d + 1] = sum;
}

/* The AVX-512 path (zmm registers) gives the AVX2 path's bits: the same
 * block softmax, the score's sixteen lanes folded the same way. Head sizes
 * off the 16 grid take the scalar reference on both. */
Test(matmul, avx512_attention_gives_the_avx2_bits)
{
    if (strcmp(qt_rows_path(), "avx512") != 0)
        cr_skip_test("this CPU has no AVX-512 F and VL: the AVX-512 attention cannot run here");
    static const int32_t dims[] = {16, 24, 32, 48, 64, 128, 256};
    uint64_t rng = 5;
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        int32_t d = dims[di], n = 61;
        int64_t stride = 2 * d + 16;
        float *q = malloc((size_t)d * 4), *kv = malloc((size_t)(2 * n * stride) * 4);
        float got[258], want[258];
        cr_assert(q && kv);
        for (int32_t t = 0; t < d; t++)
            q[t] = 2.0f * test_normal(&rng);
        for (int64_t i = 0; i < 2 * n * stride; i++)
            kv[i] = test_normal(&rng);
        for (int32_t p = 0; p < n; p++) /* later keys score higher: the max keeps rising */
            kv[p * stride] += 0.05f * (float)p * (q[0] > 0 ? 1.0f : -1.0f);
        qt_set_no_avx512(true);
        cr_assert_str_eq(qt_rows_path(), "avx2");
        attend_runs(q, kv, kv + n * stride, stride, n, d, want);
        qt_set_no_avx512(false);
        cr_assert_str_eq(qt_rows_path(), "avx512");
        attend_runs(q, kv, kv + n * stride, stride, n, d, got);
        for (int32_t u = 0; u < d + 2; u++)
            cr_assert(same_bits(got[u], want[u]), "d %d, %s %d: avx512 %a, avx2 %a", d,
                      u < d ? "element" : "state", u < d ? u : u - d, (double)got[u],
                      (double)want[u]);
        free(q);
        free(kv);
    }
}

/* qt_attend, both paths, against softmax(q.k * scale) . v in float64: n
 * positions stored `stride` floats apart, walked in runs of uneven length
 * (as the paged cache hands them over), for head sizes that take the AVX2
 * path (multiples of 16) and one that does not. */
Test(matmul, attention_runs_match_float64)
{
    static const int32_t dims[] = {16, 24, 64, 128};
    static const int32_t runs[] = {1, 5, 16, 3, 16, 7};
    uint64_t rng = 99;
    for (int scalar = 0; scalar < 2; scalar++) {
        qt_set_force_scalar(scalar);
        for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
            int32_t d = dims[di], n = 48;
            int64_t stride = 3 * d; /* other heads between positions */
            float *q = malloc((size_t)d * 4), *kv = malloc((size_t)(2 * n * stride) * 4);
            float *k = kv, *v = kv + n * stride, acc[128] = {0};
            for (int32_t t = 0; t < d; t++)
                q[t] = test_normal(&rng);
            for (int64_t i = 0; i < 2 * n * stride; i++)
                kv[i] = test_normal(&rng);
            float scale = 1.0f / sqrtf((float)d), max = -INFINITY, sum = 0.0f;
            for (int32_t p = 0, r = 0; p < n; r++) {
                int32_t len = runs[r % 6] < n - p ? runs[r % 6] : n - p;
                qt_attend(q, k + p * stride, v + p * stride, stride, len, d, scale, &max, &sum,
                          acc);
                p += len;
            }
            double s[48], top = -INFINITY, z = 0.0;
            for (int32_t p = 0; p < n; p++) {
                s[p] = 0.0;
                for (int32_t t = 0; t < d; t++)
                    s[p] += (double)q[t] * k[p * stride + t];
                s[p] *= (double)scale;
                top = s[p] > top ? s[p] : top;
            }
            for (int32_t p = 0; p < n; p++)
                z += exp(s[p] - top);
            for (int32_t u = 0; u < d; u++) {
                double want = 0.0;
                for (int32_t p = 0; p < n; p++)
                    want += exp(s[p] - top) / z * v[p * stride + u];
                double got = acc[u] / sum;
                cr_assert(fabs(got - want) <= 1e-5 * (1.0 + fabs(want)),
                          "%s path, d %d, element %d: %.9g, float64 says %.9g",
                          scalar ? "scalar" : "fast", d, u, got, want);
            }
            free(q);
            free(kv);
        }
    }
    qt_set_force_scalar(false);
}

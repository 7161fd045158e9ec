/*
 * test_quant_math.c - the quantizing arithmetic of kernels/qt_quant_math.h,
 * the functions the CPU quantizers and the CUDA merge both call.
 *
 * Why shaped so: the CUDA merge requantizes on the device by calling these
 * functions with the arguments a GPU thread has (one block's values, a
 * group's min and max, an element and its block's scale), and must write
 * the CPU's bytes. So this file pins (a) the rules by hand values: the tie
 * rules (a midpoint goes to the lower code, half to even, half away from
 * zero, the first of equal maxima, the first of tied signed zeros),
 * clamping, the absmax floor, gcc's x86 float-to-int8 conversion; and (b)
 * that calling them the way a GPU thread does (a block at a time, a group's
 * min and max reduced in another order) gives exactly qt_quantize's bytes,
 * which test_bnb4, test_affine and test_gguf pin against bitsandbytes,
 * torchao and gguf-py.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qt_quant_math.h"
#include "qtensor.h"
#include "test_util.h"

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float *random_values(uint64_t *seed, int64_t n, double sd)
{
    float *v = malloc((size_t)n * sizeof *v);
    cr_assert(v != NULL);
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)(test_normal(seed) * sd);
    return v;
}

/* --- comparisons and conversions ----------------------------------------- */

Test(quant_math, min_and_max_keep_the_first_operand_on_a_tie)
{
    cr_assert_eq(qq_minf(1.0f, 2.0f), 1.0f);
    cr_assert_eq(qq_minf(2.0f, -3.0f), -3.0f);
    cr_assert_eq(qq_maxf(1.0f, 2.0f), 2.0f);
    cr_assert_eq(qq_maxf(2.0f, -3.0f), 2.0f);
    /* the only ties that show: zeros of both signs */
    cr_assert_eq(bits_of(qq_minf(-0.0f, 0.0f)), 0x80000000u);
    cr_assert_eq(bits_of(qq_minf(0.0f, -0.0f)), 0x00000000u);
    cr_assert_eq(bits_of(qq_maxf(-0.0f, 0.0f)), 0x80000000u);
    cr_assert_eq(bits_of(qq_maxf(0.0f, -0.0f)), 0x00000000u);
    cr_assert_eq(qq_clampf(5.0f, -1.0f, 1.0f), 1.0f);
    cr_assert_eq(qq_clampf(-5.0f, -1.0f, 1.0f), -1.0f);
    cr_assert_eq(qq_clampf(0.25f, -1.0f, 1.0f), 0.25f);
}

Test(quant_math, trunc_i8_is_gccs_x86_float_to_int8_conversion)
{
    cr_assert_eq(qq_trunc_i8(8.5f), 8);
    cr_assert_eq(qq_trunc_i8(8.99f), 8);
    cr_assert_eq(qq_trunc_i8(-0.7f), 0);
    cr_assert_eq(qq_trunc_i8(-1.5f), -1);
    cr_assert_eq(qq_trunc_i8(127.9f), 127);
    /* out of int8: the low byte of the int32, read signed */
    cr_assert_eq(qq_trunc_i8(128.0f), -128);
    cr_assert_eq(qq_trunc_i8(255.0f), -1);
    cr_assert_eq(qq_trunc_i8(256.0f), 0);
    cr_assert_eq(qq_trunc_i8(2147483520.0f), -128); /* 0x7fffff80 */
    /* out of int32, NaN: cvttss2si's 0x80000000, whose low byte is 0 */
    cr_assert_eq(qq_trunc_i8(2147483648.0f), 0);
    cr_assert_eq(qq_trunc_i8(-2147483648.0f), 0);
    cr_assert_eq(qq_trunc_i8(3e9f), 0);
    cr_assert_eq(qq_trunc_i8(INFINITY), 0);
    cr_assert_eq(qq_trunc_i8(-INFINITY), 0);
    cr_assert_eq(qq_trunc_i8(NAN), 0);
}

/* --- NF4, FP4 ---------------------------------------------------------------- */

Test(quant_math, nf4_midpoints_go_to_the_lower_code)
{
    qq_buckets cb;
    qq_build_buckets(qt_nf4_code, &cb);
    for (int i = 0; i < 16; i++)
        cr_assert_eq(cb.order[i], i, "NF4 is sorted: order[%d] = %d", i, cb.order[i]);
    for (int i = 0; i < 15; i++) {
        float mid = (qt_nf4_code[i] + qt_nf4_code[i + 1]) / 2.0f;
        cr_assert(same_bits(cb.bounds[i], mid), "bound %d", i);
        cr_assert_eq(qq_bucket(&cb, mid), (unsigned)i, "on midpoint %d", i);
        cr_assert_eq(qq_bucket(&cb, nextafterf(mid, 2.0f)), (unsigned)i + 1, "above midpoint %d",
                     i);
        cr_assert_eq(qq_bucket(&cb, nextafterf(mid, -2.0f)), (unsigned)i, "below midpoint %d", i);
    }
    cr_assert_eq(qq_bucket(&cb, -1.0f), 0u);
    cr_assert_eq(qq_bucket(&cb, 1.0f), 15u);
    cr_assert_eq(qq_bucket(&cb, 0.0f), 7u);
    /* clamping before bucketing */
    cr_assert_eq(qq_clamp_unit(3.0f), 1.0f);
    cr_assert_eq(qq_clamp_unit(-3.0f), -1.0f);
}

Test(quant_math, fp4_buckets_map_back_through_the_stable_sort)
{
    qq_buckets cb;
    qq_build_buckets(qt_fp4_code, &cb);
    /* sorted: the negatives from -1 up, then +0 (entry 0) before +0 (entry 8) */
    static const uint8_t want[16] = {11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3};
    for (int i = 0; i < 16; i++)
        cr_assert_eq(cb.order[i], want[i], "order[%d] = %d, want %d", i, cb.order[i], want[i]);
    for (int i = 1; i < 15; i++)
        cr_assert(cb.bounds[i - 1] <= cb.bounds[i], "bounds must ascend for counting to bucket");
    cr_assert_eq(qq_bucket(&cb, 1.0f), 3u);
    cr_assert_eq(qq_bucket(&cb, -1.0f), 11u);
    cr_assert_eq(qq_bucket(&cb, 0.0f), 0u, "0 sits on the midpoint of the two zeros: the lower");
    cr_assert_eq(qq_bucket(&cb, 0.5f), 5u);
    cr_assert_eq(qq_bucket(&cb, -0.5f), 13u);
}

Test(quant_math, bnb4_absmax_floor_and_full_versus_short_blocks)
{
    qq_buckets cb;
    qq_build_buckets(qt_nf4_code, &cb);
    cr_assert(same_bits(qq_bnb4_recip(0.0f), 1.0f / 1e-38f));
    cr_assert(same_bits(qq_bnb4_recip(2.0f), 0.5f));
    cr_assert(same_bits(qq_bnb4_short_absmax(0.0f), 1e-38f));
    cr_assert(same_bits(qq_bnb4_short_absmax(3.0f), 3.0f));
    /* an all-zero block codes 0.0 (NF4 code 7) either way */
    cr_assert_eq(qq_bnb4_code_full(&cb, 0.0f, qq_bnb4_recip(0.0f)), 7u);
    cr_assert_eq(qq_bnb4_code_short(&cb, 0.0f, qq_bnb4_short_absmax(0.0f)), 7u);
    cr_assert_eq(qq_bnb4_code_full(&cb, -3.0f, qq_bnb4_recip(3.0f)), 0u);
    cr_assert_eq(qq_bnb4_code_short(&cb, 3.0f, 3.0f), 15u);
    /* multiply-by-reciprocal and divide differ: x * (1 / 3) vs x / 3 */
    int differ = 0;
    for (int k = 1; k < 1000; k++) {
        float x = (float)k / 997.0f;
        differ += !same_bits(x * qq_bnb4_recip(3.0f), x / 3.0f);
    }
    cr_assert(differ > 0, "the two scalings must be told apart for the test to mean anything");
}

/* A GPU warp's view of qt_bnb4_quantize: per block the absmax (here summed
 * from the back), the full or short rule, the codes through qq_*; equal to
 * qt_quantize's bytes and absmax. */
static void check_bnb4_as_blocks(qt_kind kind, int64_t rows, int64_t cols, int32_t bs,
                                 bool double_quant)
{
    uint64_t seed = 7 + (uint64_t)rows * 131 + (uint64_t)bs;
    int64_t n = rows * cols;
    float *x = random_values(&seed, n, 0.05);
    x[n / 3] = 0.0f;
    x[n / 2] = -0.0f;
    qt_quant_params p = {.kind = kind, .blocksize = bs, .double_quant = double_quant};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_quantize(&t, x, rows, cols, &p, msg, sizeof msg), QL_OK, "%s", msg);
    qq_buckets cb;
    qq_build_buckets(t.codebook, &cb);
    int64_t nb = (n + bs - 1) / bs;
    float *absmax = malloc((size_t)nb * sizeof *absmax);
    uint8_t *codes = calloc((size_t)(n + 1) / 2, 1);
    cr_assert(absmax && codes);
    for (int64_t b = 0; b < nb; b++) {
        int64_t b0 = b * bs, end = b0 + bs < n ? b0 + bs : n;
        float am = 0.0f;
        for (int64_t e = end - 1; e >= b0; e--)
            am = qq_maxf(am, fabsf(x[e]));
        bool full = end - b0 == bs;
        absmax[b] = full ? am : qq_bnb4_short_absmax(am);
        float recip = qq_bnb4_recip(am);
        for (int64_t e = b0; e < end; e++) {
            unsigned q = full ? qq_bnb4_code_full(&cb, x[e], recip)
                              : qq_bnb4_code_short(&cb, x[e], absmax[b]);
            codes[e / 2] |= (uint8_t)(e & 1 ? q : q << 4);
        }
    }
    if (n & 1)
        codes[n / 2] |= (uint8_t)qq_bucket(&cb, 0.0f);
    cr_assert(memcmp(codes, t.data, (size_t)(n + 1) / 2) == 0, "%s %lldx%lld bs %d: codes differ",
              qt_kind_name(kind), (long long)rows, (long long)cols, bs);
    if (!double_quant) {
        cr_assert(memcmp(absmax, t.absmax, (size_t)nb * sizeof *absmax) == 0, "absmax differ");
    } else {
        uint8_t *ac = malloc((size_t)nb), *lut = malloc(QQ_DYNAMIC_LUT_SIZE);
        int64_t nn = (nb + QQ_NESTED_BLOCKSIZE - 1) / QQ_NESTED_BLOCKSIZE;
        float *na = malloc((size_t)nn * sizeof *na), *centered = malloc((size_t)nb * sizeof *na);
        float offset;
        cr_assert(ac && lut && na && centered);
        qq_bnb4_double_quantize(absmax, nb, qt_dynamic_map_signed, ac, na, &offset, lut, centered);
        cr_assert(same_bits(offset, t.nested_offset), "nested offset %a vs %a", (double)offset,
                  (double)t.nested_offset);
        cr_assert_eq(t.n_nested_blocks, nn);
        cr_assert(memcmp(ac, t.absmax_codes, (size_t)nb) == 0, "nested codes differ");
        cr_assert(memcmp(na, t.nested_absmax, (size_t)nn * sizeof *na) == 0,
                  "nested absmax differ");
        free(ac);
        free(lut);
        free(na);
        free(centered);
    }
    free(absmax);
    free(codes);
    free(x);
    qt_free(&t);
}

Test(quant_math, bnb4_block_by_block_equals_qt_quantize)
{
    check_bnb4_as_blocks(QT_NF4, 64, 96, 64, false);
    check_bnb4_as_blocks(QT_FP4, 64, 96, 32, false);
    check_bnb4_as_blocks(QT_NF4, 63, 96, 4096, false); /* one short block */
    check_bnb4_as_blocks(QT_NF4, 33, 35, 64, false);   /* odd count: padded */
    check_bnb4_as_blocks(QT_FP4, 33, 35, 128, false);
    check_bnb4_as_blocks(QT_NF4, 200, 300, 64, true); /* 938 blocks: 4 nested */
    check_bnb4_as_blocks(QT_FP4, 64, 96, 128, true);
}

/* --- AFFINE -------------------------------------------------------------------- */

Test(quant_math, affine_params_by_hand)
{
    float scale, zero;
    /* asymmetric integer domain [0, 15], range [0, 15]: scale 1, zero 0 */
    qq_affine_qparams(0.0f, 15.0f, 0, 15, false, false, FLT_EPSILON, &scale, &zero);
    cr_assert_eq(scale, 1.0f);
    cr_assert_eq(zero, 0.0f);
    /* the minimum below zero moves the zero point: -3 / 1 -> zero 3 */
    qq_affine_qparams(-3.0f, 12.0f, 0, 15, false, false, FLT_EPSILON, &scale, &zero);
    cr_assert_eq(scale, 1.0f);
    cr_assert_eq(zero, 3.0f);
    /* a group of positives keeps 0 in the range (preserve_zero) */
    qq_affine_qparams(5.0f, 15.0f, 0, 15, false, false, FLT_EPSILON, &scale, &zero);
    cr_assert_eq(scale, 1.0f);
    cr_assert_eq(zero, 0.0f);
    /* float domain: scale (mx - mn) / 15, zero mn + scale * mid (mid 8) */
    qq_affine_qparams(1.0f, 16.0f, 0, 15, false, true, 1e-6f, &scale, &zero);
    cr_assert_eq(scale, 1.0f);
    cr_assert_eq(zero, 9.0f);
    /* symmetric int8: max |w| / 127.5, zero the middle code 0 */
    qq_affine_qparams(-255.0f, 100.0f, -128, 127, true, false, FLT_EPSILON, &scale, &zero);
    cr_assert_eq(scale, 2.0f);
    cr_assert_eq(bits_of(zero), 0u);
    /* symmetric [0, 15]: the middle code 8 */
    qq_affine_qparams(-1.0f, 1.0f, 0, 15, true, false, FLT_EPSILON, &scale, &zero);
    cr_assert_eq(zero, 8.0f);
    /* an all-zero group: the scale is eps, in every mapping, whatever the zeros' signs */
    qq_affine_qparams(-0.0f, 0.0f, -8, 7, true, false, 1e-6f, &scale, &zero);
    cr_assert_eq(scale, 1e-6f);
    qq_affine_qparams(-0.0f, -0.0f, 0, 15, false, false, FLT_EPSILON, &scale, &zero);
    cr_assert_eq(scale, FLT_EPSILON);
    cr_assert_eq(bits_of(zero), 0u, "qmin - (-0) is +0");
    qq_affine_qparams(0.0f, -0.0f, 0, 15, false, true, 1e-6f, &scale, &zero);
    cr_assert_eq(scale, 1e-6f);
    cr_assert(same_bits(zero, 1e-6f * 8.0f));
}

Test(quant_math, affine_codes_round_half_to_even_and_clamp)
{
    qq_affine_group g = qq_affine_group_of(1.0f, 0.0f, 8.0f);
    cr_assert_eq(g.recip, 1.0f);
    cr_assert_eq(g.min_val, -8.0f);
    /* integer domain, [0, 15], zero 0 */
    cr_assert_eq(qq_affine_code(2.5f, &g, 0, 15, false), 2u);
    cr_assert_eq(qq_affine_code(3.5f, &g, 0, 15, false), 4u);
    cr_assert_eq(qq_affine_code(-1.0f, &g, 0, 15, false), 0u);
    cr_assert_eq(qq_affine_code(100.0f, &g, 0, 15, false), 15u);
    /* signed range [-8, 7]: stored as q + 8 */
    cr_assert_eq(qq_affine_code(-8.0f, &g, -8, 7, false), 0u);
    cr_assert_eq(qq_affine_code(0.5f, &g, -8, 7, false), 8u);
    cr_assert_eq(qq_affine_code(1.5f, &g, -8, 7, false), 10u);
    cr_assert_eq(qq_affine_code(9.0f, &g, -8, 7, false), 15u);
    /* the zero point shifts the integer code */
    qq_affine_group gz = qq_affine_group_of(1.0f, 3.0f, 8.0f);
    cr_assert_eq(qq_affine_code(-3.0f, &gz, 0, 15, false), 0u);
    cr_assert_eq(qq_affine_code(0.0f, &gz, 0, 15, false), 3u);
    /* float domain: (w - min_val) / scale, min_val = zero - scale * mid */
    qq_affine_group gf = qq_affine_group_of(2.0f, 9.0f, 8.0f);
    cr_assert_eq(gf.min_val, -7.0f);
    cr_assert_eq(qq_affine_code(-7.0f, &gf, 0, 15, true), 0u);
    cr_assert_eq(qq_affine_code(-2.0f, &gf, 0, 15, true), 2u); /* 2.5 -> 2 */
    cr_assert_eq(qq_affine_code(0.0f, &gf, 0, 15, true), 4u);  /* 3.5 -> 4 */
    cr_assert_eq(qq_affine_code(50.0f, &gf, 0, 15, true), 15u);
}

/* A GPU warp's view of qt_affine_quantize: each group's min and max reduced
 * from the back, scale and zero from qq_affine_qparams, each code from
 * qq_affine_code; equal to qt_quantize's scales, zeros and codes. */
static void check_affine_as_groups(const qt_quant_params *p, int64_t rows, int64_t cols,
                                   bool with_zero_ties)
{
    uint64_t seed = 99 + (uint64_t)cols;
    int64_t n = rows * cols;
    float *x = random_values(&seed, n, 0.02);
    /* whole groups of signed zeros, and groups whose minimum is a zero */
    for (int64_t i = 0; with_zero_ties && i < n; i++) {
        if ((i / 64) % 5 == 0)
            x[i] = (i & 1) ? -0.0f : 0.0f;
        else if ((i / 64) % 5 == 1)
            x[i] = fabsf(x[i]) * ((i & 3) == 0 ? 0.0f : 1.0f);
    }
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_quantize(&t, x, rows, cols, p, msg, sizeof msg), QL_OK, "%s", msg);
    bool symmetric = p->symmetric, float_zero = t.zero_domain == QT_ZERO_FLOAT;
    float eps = p->eps > 0.0f ? p->eps : FLT_EPSILON;
    float mid = qm_affine_mid(t.qmin, t.qmax);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < t.groups_per_row; g++) {
            const float *w = x + r * cols + g * t.group_size;
            float mn = w[t.group_size - 1], mx = mn;
            for (int64_t i = t.group_size - 1; i >= 0; i--) {
                mn = qq_minf(mn, w[i]);
                mx = qq_maxf(mx, w[i]);
            }
            float scale, zero;
            qq_affine_qparams(mn, mx, t.qmin, t.qmax, symmetric, float_zero, eps, &scale, &zero);
            int64_t gi = r * t.groups_per_row + g;
            cr_assert(same_bits(scale, t.scales[gi]), "row %lld group %lld: scale %a vs %a",
                      (long long)r, (long long)g, (double)scale, (double)t.scales[gi]);
            cr_assert(same_bits(zero, t.zeros[gi]), "row %lld group %lld: zero %a vs %a",
                      (long long)r, (long long)g, (double)zero, (double)t.zeros[gi]);
            qq_affine_group grp = qq_affine_group_of(scale, zero, mid);
            for (int64_t i = 0; i < t.group_size; i++) {
                int64_t c = g * t.group_size + i;
                unsigned want = qm_affine_code(t.data + r * t.row_stride, t.bits, c);
                unsigned got = qq_affine_code(w[i], &grp, t.qmin, t.qmax, float_zero);
                cr_assert_eq(got, want, "row %lld col %lld: code %u vs %u", (long long)r,
                             (long long)c, got, want);
            }
        }
    }
    free(x);
    qt_free(&t);
}

Test(quant_math, affine_group_by_group_equals_qt_quantize)
{
    qt_quant_params int4 = {
        .kind = QT_AFFINE, .bits = 4, .group_size = 64, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f};
    qt_quant_params int4_sym = {.kind = QT_AFFINE, .bits = 4, .group_size = 64, .symmetric = true};
    qt_quant_params int8 = {.kind = QT_AFFINE, .bits = 8, .symmetric = true};
    qt_quant_params int8_asym = {.kind = QT_AFFINE,
                                 .bits = 8,
                                 .group_size = 32,
                                 .zero_domain = QT_ZERO_INT,
                                 .qmin = -128,
                                 .qmax = 127};
    qt_quant_params int4_asym_int = {
        .kind = QT_AFFINE, .bits = 4, .group_size = 16, .zero_domain = QT_ZERO_INT};
    for (int ties = 0; ties < 2; ties++) {
        check_affine_as_groups(&int4, 17, 128, ties);
        check_affine_as_groups(&int4_sym, 17, 128, ties);
        check_affine_as_groups(&int8, 17, 96, ties);
        check_affine_as_groups(&int8_asym, 17, 96, ties);
        check_affine_as_groups(&int4_asym_int, 17, 96, ties);
    }
    qt_quant_params int4_channel_odd = {
        .kind = QT_AFFINE, .bits = 4, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f};
    check_affine_as_groups(&int4_channel_odd, 5, 35, false);
}

/* --- GGUF ------------------------------------------------------------------------ */

Test(quant_math, q4_0_scale_is_the_first_largest_magnitude_over_minus_8)
{
    float x[32];
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j - 16); /* -16 .. 15: the largest is x[0] = -16 */
    uint16_t d;
    uint8_t qs[16];
    qq_q4_0_block(x, &d, qs);
    cr_assert_eq(d, 0x4000, "d = -16 / -8 = 2 (f16 0x4000), got 0x%04x", d);
    /* q = min(15, trunc(x / 2 + 8.5)): x[0] -16 -> 0, x[16] 0 -> 8, x[31] 15 -> 15 */
    cr_assert_eq(qs[0] & 0x0f, 0);
    cr_assert_eq(qs[0] >> 4, 8);
    cr_assert_eq(qs[15] >> 4, 15);
    cr_assert_eq(qs[1] & 0x0f, 1); /* -15 / 2 + 8.5 = 1.0 */
    cr_assert_eq(qs[2] & 0x0f, 1); /* -14 / 2 + 8.5 = 1.5 */

    memset(x, 0, sizeof x);
    x[3] = -5.0f;
    x[7] = 5.0f;
    qq_q4_0_block(x, &d, qs);
    cr_assert_eq(d, qm_f32_to_f16(0.625f), "the first of equal magnitudes (-5) sets the sign");
    x[3] = 5.0f;
    x[7] = -5.0f;
    qq_q4_0_block(x, &d, qs);
    cr_assert_eq(d, qm_f32_to_f16(-0.625f));
    /* an all-zero block: d = 0 / -8 = -0.0 (f16 0x8000), every code 8 */
    memset(x, 0, sizeof x);
    qq_q4_0_block(x, &d, qs);
    cr_assert_eq(d, 0x8000, "d 0x%04x", d);
    for (int j = 0; j < 16; j++)
        cr_assert_eq(qs[j], 0x88);
}

Test(quant_math, q4_1_stores_the_minimum_and_the_first_of_tied_zeros)
{
    float x[32];
    for (int j = 0; j < 32; j++)
        x[j] = (float)j + 1.0f; /* 1 .. 32: d = 31 / 15, m = 1 */
    uint16_t d, m;
    uint8_t qs[16];
    qq_q4_1_block(x, &d, &m, qs);
    cr_assert_eq(d, qm_f32_to_f16(31.0f / 15.0f));
    cr_assert_eq(m, 0x3c00);
    cr_assert_eq(qs[0] & 0x0f, 0);
    cr_assert_eq(qs[15] >> 4, 15);
    /* signed zeros as the minimum: the first one seen is stored */
    memset(x, 0, sizeof x);
    x[0] = -0.0f;
    x[9] = 1.0f;
    qq_q4_1_block(x, &d, &m, qs);
    cr_assert_eq(m, 0x8000, "first -0.0 kept: m 0x%04x", m);
    x[0] = 0.0f;
    x[5] = -0.0f;
    qq_q4_1_block(x, &d, &m, qs);
    cr_assert_eq(m, 0x0000, "first +0.0 kept: m 0x%04x", m);
}

Test(quant_math, q8_0_rounds_half_away_from_zero)
{
    float x[32] = {0};
    x[0] = 127.0f; /* d = 1 */
    x[1] = 2.5f;
    x[2] = -2.5f;
    x[3] = 0.5f;
    x[4] = -126.5f;
    uint16_t d;
    uint8_t qs[32];
    qq_q8_0_block(x, &d, qs);
    cr_assert_eq(d, 0x3c00);
    cr_assert_eq((int8_t)qs[0], 127);
    cr_assert_eq((int8_t)qs[1], 3);
    cr_assert_eq((int8_t)qs[2], -3);
    cr_assert_eq((int8_t)qs[3], 1);
    cr_assert_eq((int8_t)qs[4], -127);
    cr_assert_eq(qs[5], 0);
}

Test(quant_math, gguf_blocks_with_an_infinite_reciprocal_code_as_x86_does)
{
    /* amax 1e-40: d = amax / 127 is so small that 1 / d is +inf; x * inf
     * is inf (or NaN for 0), which the x86 conversion turns into 0 */
    float x[32] = {0};
    x[0] = 1e-40f;
    x[1] = -1e-40f;
    uint16_t d, m;
    uint8_t qs[32];
    qq_q8_0_block(x, &d, qs);
    cr_assert_eq(d, 0);
    for (int j = 0; j < 32; j++)
        cr_assert_eq(qs[j], 0, "q8_0 code %d is %d", j, qs[j]);
    qq_q4_1_block(x, &d, &m, qs); /* d = 2e-40 / 15: 1 / d is +inf */
    cr_assert_eq(qs[0] & 0x0f, 0, "x[0] - m > 0 times inf: 0 after the conversion");
    cr_assert_eq(qs[1] & 0x0f, 0, "x[1] - m = 0 times inf is NaN: 0");
}

/* Every block of a tensor through qq_*_block, assembled as ggml lays it
 * out, equals qt_quantize's bytes. */
static void check_gguf_blocks(qt_kind kind, int zero_ties)
{
    uint64_t seed = 5 + (uint64_t)kind;
    int64_t rows = 9, cols = 128, n = rows * cols;
    float *x = random_values(&seed, n, 0.1);
    for (int64_t i = 0; zero_ties && i < n; i++) {
        if ((i / 32) % 3 == 0)
            x[i] = i % 7 == 0 ? -0.0f : fabsf(x[i]) * (i % 5 == 0 ? 0.0f : 1.0f);
    }
    x[40] = -x[41]; /* equal magnitudes in one block */
    qt_quant_params p = {.kind = kind};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_quantize(&t, x, rows, cols, &p, msg, sizeof msg), QL_OK, "%s", msg);
    size_t bb = qt_traits_table[kind].block_bytes;
    for (int64_t b = 0; b < n / 32; b++) {
        uint8_t blk[34] = {0};
        uint16_t d, m = 0;
        if (kind == QT_Q4_0)
            qq_q4_0_block(x + b * 32, &d, blk + 2);
        else if (kind == QT_Q4_1)
            qq_q4_1_block(x + b * 32, &d, &m, blk + 4);
        else
            qq_q8_0_block(x + b * 32, &d, blk + 2);
        blk[0] = (uint8_t)(d & 0xff);
        blk[1] = (uint8_t)(d >> 8);
        if (kind == QT_Q4_1) {
            blk[2] = (uint8_t)(m & 0xff);
            blk[3] = (uint8_t)(m >> 8);
        }
        cr_assert(memcmp(blk, t.data + b * bb, bb) == 0, "%s block %lld differs",
                  qt_kind_name(kind), (long long)b);
    }
    free(x);
    qt_free(&t);
}

Test(quant_math, gguf_block_by_block_equals_qt_quantize)
{
    for (int ties = 0; ties < 2; ties++) {
        check_gguf_blocks(QT_Q4_0, ties);
        check_gguf_blocks(QT_Q4_1, ties);
        check_gguf_blocks(QT_Q8_0, ties);
    }
}

/* --- the nested absmax --------------------------------------------------------- */

Test(quant_math, torch_sum_follows_the_cascade_not_the_naive_order)
{
    /* fewer than 8: row_sum's four partials, leftovers into the first */
    float small[5] = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
    cr_assert_eq(qq_torch_f32_sum(small, 5), 15.0f);
    /* 1e8 + 1 + ... loses the ones in a naive f32 sum; the eight lanes of
     * the cascade keep 1e8 in lane 0 and the ones elsewhere */
    float v[64];
    for (int i = 0; i < 64; i++)
        v[i] = 1.0f;
    v[0] = 1e8f;
    float naive = 0.0f;
    for (int i = 0; i < 64; i++)
        naive += v[i];
    float cascade = qq_torch_f32_sum(v, 64);
    cr_assert_eq(naive, 1e8f);
    cr_assert_eq(cascade, 1e8f + 56.0f, "lanes 1..7 hold 56 ones: %a", (double)cascade);
}

Test(quant_math, double_quantize_of_zero_absmax_stores_zero_codes)
{
    float absmax[300] = {0};
    uint8_t codes[300];
    float nested[2], offset, centered[300];
    uint8_t *lut = malloc(QQ_DYNAMIC_LUT_SIZE);
    cr_assert(lut != NULL);
    memset(codes, 0xaa, sizeof codes);
    qq_bnb4_double_quantize(absmax, 300, qt_dynamic_map_signed, codes, nested, &offset, lut,
                            centered);
    cr_assert_eq(offset, 0.0f);
    cr_assert_eq(nested[0], 0.0f);
    cr_assert_eq(nested[1], 0.0f);
    for (int i = 0; i < 300; i++)
        cr_assert_eq(codes[i], 0);
    free(lut);
}

/* --- dequantizing GGUF Q2_K, Q3_K, IQ4_NL, IQ4_XS ------------------------------
 *
 * The functions a device thread calls with one block and one element index.
 * By hand: the fields each reads (which byte, which bits, which offset); on
 * gguf-py's vectors (tests/fixtures/gguf_kquant_vectors.h, checked against
 * llama.cpp's own dequantize_row_*): every element, bit for bit. */

#include "fixtures/gguf_kquant_vectors.h"

static void put_f16_le(uint8_t *p, float v)
{
    uint16_t h = qm_f32_to_f16(v);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

Test(quant_math, iq4nl_levels_are_llama_cpps_table)
{
    static const int want[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                 1,    13,   25,  38,  53,  69,  89,  113};
    for (int c = 0; c < 16; c++)
        cr_assert_eq(qm_iq4nl_level(c), want[c], "level %d", c);
    cr_assert_eq(qm_iq4_value(0, 0.5f), -63.5f);
}

Test(quant_math, q2_k_fields_by_hand)
{
    uint8_t blk[QM_Q2_K_BYTES] = {0};
    for (int s = 0; s < 16; s++)
        blk[s] = (uint8_t)((s % 16) | ((15 - s) << 4)); /* scale s, minimum 15 - s */
    /* every byte of qs holds fields 0, 1, 2, 3 in bits 0-1, 2-3, 4-5, 6-7 */
    for (int i = 0; i < 64; i++)
        blk[16 + i] = 0xe4;
    put_f16_le(blk + 80, 0.5f);
    put_f16_le(blk + 82, 0.25f);
    for (int j = 0; j < 256; j++) {
        int s = j / 16, k = (j % 128) / 32;
        cr_assert_eq(qm_q2_k_code(blk, j), k, "code %d", j);
        float want = 0.5f * (float)s * (float)k - 0.25f * (float)(15 - s);
        cr_assert_eq(qm_q2_k_block_value(blk, j), want, "value %d", j);
    }
}

/* Q3_K's 6-bit scales: the low four bits in nibbles of bytes 0..7, the top
 * two in bytes 8..11, so that ggml's word shuffle unpacks scale s. */
static void q3_k_pack_scales(uint8_t *sc12, const int *v)
{
    memset(sc12, 0, 12);
    for (int s = 0; s < 16; s++) {
        int lo = v[s] & 0xF, hi = (v[s] >> 4) & 3;
        sc12[s % 8] |= (uint8_t)(s < 8 ? lo : lo << 4);
        sc12[8 + s % 4] |= (uint8_t)(hi << (2 * (s / 4)));
    }
}

Test(quant_math, q3_k_fields_by_hand)
{
    uint8_t blk[QM_Q3_K_BYTES] = {0};
    int stored[16];
    for (int s = 0; s < 16; s++)
        stored[s] = (s * 23 + 5) % 64; /* every stored value 0..63 class */
    q3_k_pack_scales(blk + 96, stored);
    for (int s = 0; s < 16; s++)
        cr_assert_eq(qm_q3_k_scale(blk, s), stored[s] - 32, "scale %d", s);
    /* codes: field k of qs = 3 - k; hmask bit 4h + k set for odd l only */
    for (int i = 0; i < 64; i++)
        blk[32 + i] = (uint8_t)(3 | (2 << 2) | (1 << 4));
    for (int l = 1; l < 32; l += 2)
        blk[l] = 0xff;
    put_f16_le(blk + 108, 0.125f);
    for (int j = 0; j < 256; j++) {
        int k = (j % 128) / 32, l = j % 32;
        int want_code = (3 - k) - (l % 2 ? 0 : 4);
        cr_assert_eq(qm_q3_k_code(blk, j), want_code, "code %d", j);
        float want = (0.125f * (float)(stored[j / 16] - 32)) * (float)want_code;
        cr_assert_eq(qm_q3_k_block_value(blk, j), want, "value %d", j);
    }
}

Test(quant_math, iq4_nl_and_iq4_xs_fields_by_hand)
{
    uint8_t nl[QM_IQ4_NL_BYTES] = {0};
    put_f16_le(nl, 0.5f);
    for (int j = 0; j < 16; j++)
        nl[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    for (int j = 0; j < 32; j++)
        cr_assert_eq(qm_iq4_nl_block_value(nl, j),
                     0.5f * (float)qm_iq4nl_level(j < 16 ? j : 31 - j), "iq4_nl %d", j);
    uint8_t xs[QM_IQ4_XS_BYTES] = {0};
    put_f16_le(xs, 0.25f);
    int stored[8] = {0, 63, 32, 1, 31, 33, 17, 48};
    uint16_t h = 0;
    for (int s = 0; s < 8; s++) {
        xs[4 + s / 2] |= (uint8_t)((stored[s] & 0xF) << (4 * (s % 2)));
        h |= (uint16_t)(((stored[s] >> 4) & 3) << (2 * s));
    }
    xs[2] = (uint8_t)(h & 0xff);
    xs[3] = (uint8_t)(h >> 8);
    for (int i = 0; i < 128; i++)
        xs[8 + i] = (uint8_t)((i % 16) | (((i + 3) % 16) << 4));
    for (int s = 0; s < 8; s++)
        cr_assert_eq(qm_iq4_xs_scale(xs, s), stored[s] - 32, "iq4_xs scale %d", s);
    for (int j = 0; j < 256; j++) {
        int l = j % 32, code = l < 16 ? l : (l - 16 + 3) % 16;
        cr_assert_eq(qm_iq4_xs_code(xs, j), code, "iq4_xs code %d", j);
        float want = (0.25f * (float)(stored[j / 32] - 32)) * (float)qm_iq4nl_level(code);
        cr_assert_eq(qm_iq4_xs_block_value(xs, j), want, "iq4_xs value %d", j);
    }
}

/* Element e of a tensor from its blocks and e alone, as a device thread
 * computes it, equals gguf-py's value and qt_dequantize_rows_ref's. */
Test(quant_math, later_gguf_elements_equal_gguf_py_bit_for_bit)
{
    int seen = 0;
    for (size_t c = 0; c < sizeof gkqv_cases / sizeof *gkqv_cases; c++) {
        const gkqv_case *k = &gkqv_cases[c];
        int kind = qt_kind_from_name(k->type);
        if (kind != QT_Q2_K && kind != QT_Q3_K && kind != QT_IQ4_NL && kind != QT_IQ4_XS)
            continue;
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_from_gguf_blocks(&t, (qt_kind)kind, k->blocks, (size_t)k->blocks_len,
                                         k->rows, k->cols, msg, sizeof msg),
                     QL_OK, "%s: %s", k->name, msg);
        long n = k->rows * k->cols;
        float *ref = malloc((size_t)n * sizeof *ref);
        qt_dequantize_rows_ref(&t, 0, k->rows, ref);
        for (long e = 0; e < n; e++) {
            float v = kind == QT_Q2_K     ? qm_q2_k_element(k->blocks, e)
                      : kind == QT_Q3_K   ? qm_q3_k_element(k->blocks, e)
                      : kind == QT_IQ4_NL ? qm_iq4_nl_element(k->blocks, e)
                                          : qm_iq4_xs_element(k->blocks, e);
            cr_assert_eq(bits_of(v), bits_of(k->dequant[e]), "%s element %ld: %a vs %a", k->name, e,
                         (double)v, (double)k->dequant[e]);
            cr_assert_eq(bits_of(v), bits_of(ref[e]), "%s element %ld vs reference", k->name, e);
        }
        free(ref);
        qt_free(&t);
        seen++;
    }
    cr_assert_eq(seen, 8, "two cases for each of q2_k, q3_k, iq4_nl, iq4_xs");
}

/* --- MXFP4 ------------------------------------------------------------------ */

/* qq_mxfp4_floor_log2 is floorf(log2f(a)) as glibc gives it, without the
 * call (which the device computes with other errors): checked at every
 * power of two, normal and subnormal, on the 64 floats below it (where
 * log2f rounds up to the power's exponent for the last few, more of them
 * as |exponent| grows) and on the power itself. An exhaustive run over all
 * positive floats agreed when the function was written. */
Test(quant_math, mxfp4_floor_log2_is_glibc_floorf_log2f_at_every_power_of_two)
{
    int checked = 0, rounded_up = 0;
    for (uint32_t top = 1; top <= 0x7f000000u;
         top = top < 0x00800000u ? top << 1 : top + 0x00800000u) {
        for (uint32_t back = 0; back <= 64 && back < top; back++) {
            float a;
            uint32_t u = top - back;
            memcpy(&a, &u, sizeof a);
            int want = (int)floorf(log2f(a));
            cr_assert_eq(qq_mxfp4_floor_log2(a), want, "a = %a (bits 0x%08x): log2f floors to %d",
                         (double)a, u, want);
            rounded_up += back > 0 && want == ilogbf(a) + 1;
            checked++;
        }
    }
    cr_assert_gt(rounded_up, 5000, "the cases where log2f rounds up are among them");
    cr_assert_gt(checked, 16000);
}

/* The E8M0 scale, the levels and the nibble order by hand. */
Test(quant_math, mxfp4_fields_by_hand)
{
    cr_assert_eq(qm_e8m0_half(127), 0.5f);
    cr_assert_eq(qm_e8m0_half(128), 1.0f);
    cr_assert_eq(bits_of(qm_e8m0_half(0)), 0x00200000u, "2^-128, subnormal");
    cr_assert_eq(bits_of(qm_e8m0_half(1)), 0x00400000u, "2^-127, subnormal");
    cr_assert_eq(qm_e8m0_half(255), 0x1p127f);
    uint8_t blk[QM_MXFP4_BYTES] = {129}; /* d = 2 */
    for (int j = 0; j < 16; j++)
        blk[1 + j] = (uint8_t)(j | ((15 - j) << 4));
    const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int j = 0; j < 32; j++) {
        int code = j < 16 ? j : 31 - j;
        float want = (code < 8 ? 1.0f : -1.0f) * e2m1[code % 8] * 2.0f * 2.0f;
        cr_assert_eq(qm_mxfp4_block_value(blk, j), want, "element %d (code %d)", j, code);
        cr_assert(!signbit(qm_mxfp4_block_value(blk, j)) || want != 0.0f,
                  "code 8 is +0, as ggml's kvalues_mxfp4");
    }
    /* the scale: floor(log2 amax) - 2 + 127; 0 for an all-zero block; a
     * negative exponent wraps as gcc's conversion does */
    cr_assert_eq(qq_mxfp4_scale(6.0f), 127);
    cr_assert_eq(qq_mxfp4_scale(0.0f), 0);
    cr_assert_eq(qq_mxfp4_scale(0x1p-126f), 255);
    cr_assert_eq(qq_mxfp4_scale(0x1p-149f), (uint8_t)(-149 - 2 + 127));
    /* a tie between two levels keeps the first */
    cr_assert_eq(qq_mxfp4_code(0.25f, 0.5f), 0);
    cr_assert_eq(qq_mxfp4_code(-0.25f, 0.5f), 0, "0 ties with -0.5: the first");
    cr_assert_eq(qq_mxfp4_code(5.0f, 0.5f), 6);
}

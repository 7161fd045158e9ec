/*
 * test_dense.c - the dense kinds, the half/bfloat16 conversions shared with
 * the CUDA kernels (kernels/math/qt_math.h), the traits table itself, and the
 * rule that a dtype cast never touches quant state.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qt_math.h"
#include "qtensor.h"
#include "test_util.h"

Test(traits, every_kind_has_a_full_row)
{
    for (int k = 0; k < QT_KIND_COUNT; k++) {
        const qt_traits *t = &qt_traits_table[k];
        cr_assert(t->name && t->quantize && t->dequantize_rows && t->matmul_ref,
                  "kind %d has an empty row", k);
        cr_assert_eq(qt_kind_from_name(t->name), k, "name %s does not map back", t->name);
        cr_assert(t->block_size > 0 && t->block_bytes > 0, "kind %s geometry", t->name);
    }
    cr_assert_eq(qt_kind_from_name("iq2_xxs"), -1);
    cr_assert_eq(qt_kind_from_name("q2_k"), QT_Q2_K);
    cr_assert_eq(qt_kind_from_name("q5_k"), QT_Q5_K);
    cr_assert_eq(qt_traits_table[QT_Q4_0].block_bytes, 18u);
    cr_assert_eq(qt_traits_table[QT_Q4_1].block_bytes, 20u);
    cr_assert_eq(qt_traits_table[QT_Q8_0].block_bytes, 34u);
}

Test(f16, every_half_round_trips_through_f32)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = qm_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            cr_assert(isnan(qm_f16_to_f32(qm_f32_to_f16(f))), "NaN %04x lost", h);
            continue;
        }
        cr_assert_eq(qm_f32_to_f16(f), h, "half %04x -> %a -> %04x", h, (double)f,
                     qm_f32_to_f16(f));
    }
}

Test(f16, matches_the_compiler_conversion_on_random_floats)
{
#ifndef __FLT16_MANT_DIG__
    test_cannot_run("this compiler has no _Float16 to compare with");
#else
    /* GCC's _Float16 conversion is correctly rounded (nearest even) */
    uint64_t rng = 12345;
    for (int i = 0; i < 2000000; i++) {
        uint32_t bits = (uint32_t)(test_rand(&rng) >> 32);
        float f;
        memcpy(&f, &bits, 4);
        if (isnan(f))
            continue;
        _Float16 ref = (_Float16)f;
        uint16_t rb;
        memcpy(&rb, &ref, 2);
        cr_assert_eq(qm_f32_to_f16(f), rb, "%a: got %04x want %04x", (double)f, qm_f32_to_f16(f),
                     rb);
    }
#endif
}

Test(f16, ties_round_to_even_and_overflow_to_inf)
{
    cr_assert_eq(qm_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);     /* tie, down to even */
    cr_assert_eq(qm_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02); /* tie, up to even */
    cr_assert_eq(qm_f32_to_f16(0x1p-25f), 0x0000);            /* half the least subnormal */
    cr_assert_eq(qm_f32_to_f16(3 * 0x1p-26f), 0x0001);
    cr_assert_eq(qm_f32_to_f16(65519.0f), 0x7bff);
    cr_assert_eq(qm_f32_to_f16(65520.0f), 0x7c00);
    cr_assert_eq(qm_f32_to_f16(-INFINITY), 0xfc00);
}

Test(bf16, rounds_to_nearest_even_and_keeps_nan)
{
    cr_assert_eq(qm_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(qm_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);     /* tie, to even */
    cr_assert_eq(qm_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82); /* tie, to even */
    cr_assert_eq(qm_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    cr_assert(isnan(qm_bf16_to_f32(qm_f32_to_bf16(NAN))));
    cr_assert_eq(qm_f32_to_bf16(INFINITY), 0x7f80);
    for (uint32_t b = 0; b < 65536; b++) {
        float f = qm_bf16_to_f32((uint16_t)b);
        if (!isnan(f))
            cr_assert_eq(qm_f32_to_bf16(f), b);
    }
}

Test(dense, quantize_and_dequantize_are_conversions)
{
    float src[6] = {1.0f, -2.5f, 0x1p-20f, 3.14159265f, 65504.0f, -0.0f};
    qt_kind kinds[3] = {QT_F32, QT_F16, QT_BF16};
    for (int k = 0; k < 3; k++) {
        qtensor t;
        qt_quant_params p = {.kind = kinds[k]};
        char msg[256];
        cr_assert_eq(qt_quantize(&t, src, 2, 3, &p, msg, sizeof msg), QL_OK, "%s", msg);
        float out[6];
        qt_dequantize_rows_ref(&t, 0, 2, out);
        for (int i = 0; i < 6; i++) {
            float want = kinds[k] == QT_F32   ? src[i]
                         : kinds[k] == QT_F16 ? qm_f16_to_f32(qm_f32_to_f16(src[i]))
                                              : qm_bf16_to_f32(qm_f32_to_bf16(src[i]));
            cr_assert(same_bits(out[i], want), "%s [%d]: %a vs %a", qt_kind_name(kinds[k]), i,
                      (double)out[i], (double)want);
        }
        qt_free(&t);
    }
}

Test(cast, dense_cast_converts_values)
{
    float src[4] = {1.0f + 0x1p-8f, -3.0f, 0.1f, 1e-3f};
    qtensor t;
    char msg[256];
    cr_assert_eq(qt_from_dense(&t, QT_F32, src, 2, 2, msg, sizeof msg), QL_OK);
    cr_assert_eq(qt_cast_dense(&t, QT_BF16, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(t.kind, QT_BF16);
    cr_assert_eq(t.data_bytes, 8u);
    float out[4];
    qt_dequantize_rows(&t, 0, 2, out);
    for (int i = 0; i < 4; i++)
        cr_assert(same_bits(out[i], qm_bf16_to_f32(qm_f32_to_bf16(src[i]))));
    qt_free(&t);
}

/* The rule of DESIGN.md: a dtype conversion of the model touches ordinary
 * float parameters only, never quant state. */
Test(cast, quant_state_keeps_its_dtype)
{
    float w[4 * 64];
    uint64_t rng = 7;
    for (int i = 0; i < 4 * 64; i++)
        w[i] = test_normal(&rng);
    qt_quant_params kinds[] = {
        {.kind = QT_NF4, .blocksize = 64},
        {.kind = QT_NF4, .blocksize = 64, .double_quant = true},
        {.kind = QT_FP4, .blocksize = 32},
        {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .zero_domain = QT_ZERO_FLOAT},
        {.kind = QT_Q4_1},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        qtensor t, before;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, w, 4, 64, &kinds[k], msg, sizeof msg), QL_OK, "%s", msg);
        cr_assert_eq(qt_clone(&before, &t), QL_OK);
        msg[0] = 0;
        cr_assert_eq(qt_cast_dense(&t, QT_BF16, msg, sizeof msg), QL_EUNSUPPORTED,
                     "cast of %s was not refused", qt_kind_name(t.kind));
        cr_assert(strstr(msg, qt_kind_name(t.kind)), "message does not name the kind: %s", msg);
        cr_assert_eq(t.kind, before.kind);
        cr_assert_eq(memcmp(t.data, before.data, t.data_bytes), 0);
        if (t.absmax)
            cr_assert_eq(memcmp(t.absmax, before.absmax, (size_t)t.n_blocks * 4), 0);
        if (t.nested) {
            cr_assert_eq(
                memcmp(t.nested_absmax, before.nested_absmax, (size_t)t.n_nested_blocks * 4), 0);
            cr_assert(same_bits(t.nested_offset, before.nested_offset));
        }
        if (t.scales)
            cr_assert_eq(memcmp(t.scales, before.scales, (size_t)(t.rows * t.groups_per_row) * 4),
                         0);
        qt_free(&t);
        qt_free(&before);
    }
}

Test(quantize, refuses_nan_and_inf_with_the_first_bad_index)
{
    float w[3 * 64];
    for (int i = 0; i < 3 * 64; i++)
        w[i] = 0.01f * (float)i;
    w[70] = NAN;
    w[100] = INFINITY;
    for (int k = 0; k < QT_KIND_COUNT; k++) {
        qt_quant_params p = {.kind = (qt_kind)k, .bits = 4};
        qtensor t;
        char msg[256] = "";
        cr_assert_eq(qt_quantize(&t, w, 3, 64, &p, msg, sizeof msg), QL_ENONFINITE,
                     "%s accepted a NaN", qt_kind_name((qt_kind)k));
        cr_assert(strstr(msg, "index 70") && strstr(msg, "row 1, col 6"), "message: %s", msg);
        cr_assert_null(t.data);
    }
}

Test(quantize, refuses_shapes_and_sizes_that_do_not_fit)
{
    float w[64] = {0};
    qtensor t;
    char msg[256];
    qt_quant_params bad_bs = {.kind = QT_NF4, .blocksize = 48};
    cr_assert_eq(qt_quantize(&t, w, 1, 64, &bad_bs, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "blocksize 48"), "%s", msg);
    qt_quant_params big_bs = {.kind = QT_FP4, .blocksize = 8192};
    cr_assert_eq(qt_quantize(&t, w, 1, 64, &big_bs, msg, sizeof msg), QL_EINVAL);
    qt_quant_params q40 = {.kind = QT_Q4_0};
    cr_assert_eq(qt_quantize(&t, w, 2, 31, &q40, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "31 columns") && strstr(msg, "q4_0"), "%s", msg);
    qt_quant_params grp = {.kind = QT_AFFINE, .bits = 4, .group_size = 48};
    cr_assert_eq(qt_quantize(&t, w, 1, 64, &grp, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "group size 48"), "%s", msg);
    qt_quant_params bits = {.kind = QT_AFFINE, .bits = 3};
    cr_assert_eq(qt_quantize(&t, w, 1, 64, &bits, msg, sizeof msg), QL_EINVAL);
    qt_quant_params f32 = {.kind = QT_F32};
    cr_assert_eq(qt_quantize(&t, w, 0, 64, &f32, msg, sizeof msg), QL_EINVAL);
}

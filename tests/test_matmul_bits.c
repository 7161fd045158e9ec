/*
 * test_matmul_bits.c - the products whose SIMD entries give the scalar
 * reference's bits, the checkpoint kinds': GPTQ and AWQ (each output one
 * fused multiply-add chain over the columns in order, qt_gptq_matmul_ref)
 * and FP8 (each output's sum in 32 lanes and a fixed reduction,
 * qt_fp8_matmul_ref). The AVX2 and AVX-512 entries equal the reference bit
 * for bit, and the reference is within f32 rounding of the float64 sum over
 * the same dequantized weights.
 *
 * GPTQ and AWQ tensors are random checkpoints' parts (random codes, zeros
 * and f16 scales, act-order g_idx a random permutation's groups) read by
 * qt_from_gptq, for each option: 4 and 8 bits, v1 and v2 zeros, groups of
 * 32 or 128 or one group, act-order; AWQ. FP8 tensors are quantized in
 * blocks of 128 x 128 and of 16 x 40 (a block the columns do not fill),
 * f32 and UE8M0 scales. Shapes: narrow (a panel) and wide (full tiles of
 * 128 and 256 rows, many panels of decoded columns, the last one ragged,
 * a last group shorter than the others), rows not a multiple of a tile,
 * columns not a multiple of 32 or 8 (FP8), and row ranges that start and
 * end off a vector (the scalar rows beside the vector ones); batches 1 ..
 * 9 (AWQ's wide tiles up to 4) and 17, and for FP8 every batch 1 .. 33
 * (odd row counts and ranges, for its two-row AVX-512 walk).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"
#include "test_util.h"

typedef struct gcase {
    const char *label;
    int32_t bits, group_size;
    bool v2, act_order, awq;
} gcase;

static const gcase cases[] = {
    {"gptq-4bit-g32-v1", 4, 32, false, false, false},
    {"gptq-4bit-g128-v1-act-order", 4, 128, false, true, false},
    {"gptq-4bit-g32-v2-act-order", 4, 32, true, true, false},
    {"gptq-4bit-one-group-v2", 4, -1, true, false, false},
    {"gptq-8bit-g32-v2", 8, 32, true, false, false},
    {"gptq-8bit-g128-v1-act-order", 8, 128, false, true, false},
    {"awq-4bit-g32", 4, 32, false, false, true},
    {"awq-4bit-g128", 4, 128, false, false, true},
};

/* A random [rows, cols] tensor of the case's layout; the caller frees the
 * parts (*mem) after qt_free. */
static void make_tensor(const gcase *gc, int64_t rows, int64_t cols, uint64_t *rng, qtensor *t,
                        void **mem)
{
    int64_t gs = gc->group_size == -1 ? cols : gc->group_size;
    int64_t groups = (cols + gs - 1) / gs;
    size_t qbytes = (size_t)(rows * cols * gc->bits / 8);
    size_t zbytes = (size_t)(groups * rows * gc->bits / 8);
    size_t sbytes = (size_t)(groups * rows) * 2, gbytes = (size_t)cols * 4;
    uint8_t *m = malloc(qbytes + zbytes + sbytes + gbytes);
    cr_assert(m);
    uint8_t *q = m, *z = m + qbytes, *s = z + zbytes, *g = s + sbytes;
    for (size_t i = 0; i < qbytes + zbytes; i++)
        m[i] = (uint8_t)test_rand(rng);
    for (int64_t i = 0; i < groups * rows; i++) {
        /* positive scales over two decades, some subnormal in f16 */
        float v = (float)(0.0005 + 0.05 * test_uniform(rng));
        if (i % 97 == 5)
            v = 3e-6f;
        uint16_t h = qt_f32_to_f16(v);
        memcpy(s + i * 2, &h, 2);
    }
    int32_t *perm = malloc(gbytes);
    for (int64_t c = 0; c < cols; c++)
        perm[c] = (int32_t)c;
    for (int64_t c = cols - 1; c > 0; c--) {
        int64_t j = (int64_t)(test_rand(rng) % (uint64_t)(c + 1));
        int32_t tmp = perm[c];
        perm[c] = perm[j];
        perm[j] = tmp;
    }
    for (int64_t c = 0; c < cols; c++) {
        int32_t gi = (int32_t)(perm[c] / gs);
        memcpy(g + c * 4, &gi, 4);
    }
    free(perm);
    qt_gptq_parts p = {.rows = rows,
                       .cols = cols,
                       .bits = gc->bits,
                       .group_size = gc->group_size,
                       .v2 = gc->v2,
                       .awq = gc->awq,
                       .qweight = q,
                       .borrow_codes = true,
                       .qzeros = z,
                       .scales = s,
                       .g_idx = gc->act_order ? g : NULL,
                       .groups = groups};
    char msg[256];
    cr_assert_eq(qt_from_gptq(t, &p, msg, sizeof msg), QL_OK, "%s: %s", gc->label, msg);
    *mem = m;
}

/* The dispatched product of t (over row ranges [0, split) and [split,
 * rows)) equals the scalar reference bit for bit for batches 1 .. 9 and
 * 17 (every batch 1 .. 33 where every_batch: FP8's AVX-512 entry walks two
 * weight rows per pass over four rows of x at a time), and the reference
 * the float64 sum within f32 rounding. */
static void check_tensor(const char *label, const qtensor *t, int64_t split, bool every_batch,
                         uint64_t *rng)
{
    const int64_t rows = t->rows, cols = t->cols;
    float *x = malloc((size_t)(33 * cols) * 4), *wd = malloc((size_t)(rows * cols) * 4);
    float *yr = malloc((size_t)(33 * rows) * 4), *yf = malloc((size_t)(33 * rows) * 4);
    cr_assert(x && wd && yr && yf);
    for (int64_t i = 0; i < 33 * cols; i++)
        x[i] = test_normal(rng);
    qt_dequantize_rows_ref(t, 0, rows, wd);
    for (int64_t batch = 1; batch <= (every_batch ? 33 : 17);
         batch += every_batch || batch < 9 ? 1 : 8) {
        for (int64_t i = 0; i < batch * rows; i++)
            yr[i] = yf[i] = NAN;
        qt_matmul_ref(t, x, batch, yr, 0, rows);
        qt_matmul(t, x, batch, yf, 0, split);
        qt_matmul(t, x, batch, yf, split, rows);
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t r = 0; r < rows; r++) {
                float want = yr[b * rows + r], got = yf[b * rows + r];
                cr_assert(same_bits(want, got),
                          "%s [%lldx%lld] %s path, batch %lld, x row %lld, output %lld: %a, the "
                          "reference %a",
                          label, (long long)rows, (long long)cols, qt_f32_path(), (long long)batch,
                          (long long)b, (long long)r, (double)got, (double)want);
                if (batch != 17)
                    continue;
                double exact = 0, mag = 0;
                for (int64_t c = 0; c < cols; c++) {
                    double term = (double)x[b * cols + c] * wd[r * cols + c];
                    exact += term;
                    mag += fabs(term);
                }
                cr_assert(fabs(want - exact) <= 1e-5 * mag + 1e-30,
                          "%s reference output %lld: %g, float64 %g", label, (long long)r,
                          (double)want, exact);
            }
        }
    }
    free(x);
    free(wd);
    free(yr);
    free(yf);
}

static void check_case(const gcase *gc, int64_t rows, int64_t cols, int64_t split, uint64_t seed)
{
    uint64_t rng = seed;
    qtensor t;
    void *mem;
    make_tensor(gc, rows, cols, &rng, &t, &mem);
    check_tensor(gc->label, &t, split, false, &rng);
    qt_free(&t);
    free(mem);
}

/* FP8 in blocks of br x bc, scale dtype sd, from N(0, 0.02) weights. */
static void check_fp8(int32_t br, int32_t bc, qt_scale_dtype sd, int64_t rows, int64_t cols,
                      int64_t split, uint64_t seed)
{
    uint64_t rng = seed;
    float *w = malloc((size_t)(rows * cols) * 4);
    cr_assert(w);
    for (int64_t i = 0; i < rows * cols; i++)
        w[i] = 0.02f * test_normal(&rng);
    qt_quant_params p = {.kind = QT_FP8, .block_rows = br, .block_cols = bc, .scale_dtype = sd};
    qtensor t;
    char msg[256], label[64];
    cr_assert_eq(qt_quantize(&t, w, rows, cols, &p, msg, sizeof msg), QL_OK, "%s", msg);
    snprintf(label, sizeof label, "fp8-%dx%d-%s", br, bc, qt_scale_dtype_name(sd));
    check_tensor(label, &t, split, true, &rng);
    qt_free(&t);
    free(w);
}

/* Every case over narrow and wide shapes on the current path. */
static void check_all(void)
{
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const gcase *gc = &cases[k];
        /* 8-bit GPTQ packs 4 rows to a zero word: 36 rows end off a vector */
        int64_t narrow_rows = gc->bits == 8 ? 36 : 40;
        check_case(gc, narrow_rows, 128, 13, 10 + k); /* one panel, ranges off a vector */
        check_case(gc, 8, 256, 8, 20 + k);            /* one vector, an empty range */
        check_case(gc, 264, 1544, 24, 30 + k);        /* full tiles, a ragged last panel */
        check_case(gc, narrow_rows, 648, 17, 40 + k); /* a ragged last group and panel */
    }
    for (int sd = 0; sd < 2; sd++) {
        qt_scale_dtype d = sd ? QT_SCALE_E8M0 : QT_SCALE_F32;
        check_fp8(128, 128, d, 37, 1037, 13, 50 + sd); /* runs of 32, of 8, and a tail */
        check_fp8(128, 128, d, 5, 4096, 2, 60 + sd);   /* wide */
        check_fp8(16, 40, d, 19, 70, 7, 70 + sd);      /* a block the columns do not fill */
    }
}

Test(matmul_bits, avx2_products_give_the_scalar_reference_bits, .timeout = 120)
{
    if (strcmp(qt_cpu_path(), "avx2") != 0)
        cr_skip_test("this CPU has no AVX2, FMA and F16C: the AVX2 products cannot run here");
    qt_set_no_avx512(true);
    cr_assert_str_eq(qt_f32_path(), "avx2");
    check_all();
    qt_set_no_avx512(false);
}

Test(matmul_bits, avx512_products_give_the_scalar_reference_bits, .timeout = 120)
{
    if (strcmp(qt_f32_path(), "avx512") != 0)
        cr_skip_test("this CPU has no AVX-512 F and VL: the AVX-512 products cannot run here");
    check_all();
}

/* Every E4M3FN byte (NaNs and subnormals too) dequantizes on the current
 * path to the scalar table's bits, for f32 scales of several exponents and
 * UE8M0 ones: the SIMD paths make the values without the table. */
static void check_every_fp8_code(void)
{
    enum { ROWS = 4, COLS = 256 + 19 }; /* every code in every lane position */
    uint8_t codes[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++)
        codes[i] = (uint8_t)(i * 7 + i / COLS);
    const float f32_scales[2] = {0x1.8p-7f, 3.0e5f};
    const uint8_t e8m0_scales[2] = {127 - 9, 127 + 20};
    for (int sd = 0; sd < 2; sd++) {
        qt_fp8_parts p = {.rows = ROWS,
                          .cols = COLS,
                          .block_rows = 2,
                          .block_cols = COLS,
                          .codes = codes,
                          .scale_dtype = sd ? QT_SCALE_E8M0 : QT_SCALE_F32,
                          .scales = sd ? (const void *)e8m0_scales : (const void *)f32_scales,
                          .scale_rows = 2,
                          .scale_cols = 1};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_from_fp8(&t, &p, msg, sizeof msg), QL_OK, "%s", msg);
        float want[ROWS * COLS], got[ROWS * COLS];
        qt_dequantize_rows_ref(&t, 0, ROWS, want);
        qt_dequantize_rows(&t, 0, ROWS, got);
        for (int i = 0; i < ROWS * COLS; i++)
            cr_assert(same_bits(want[i], got[i]), "%s path, code 0x%02x: %a, the table %a",
                      qt_cpu_path(), codes[i], (double)got[i], (double)want[i]);
        qt_free(&t);
    }
}

Test(matmul_bits, every_fp8_code_dequantizes_as_the_table)
{
    check_every_fp8_code();
}

/* --activations q8 leaves these kinds on the f32 path (their rows have no
 * 8-bit product: GPTQ's and AWQ's vectors run across outputs, not along
 * the activations' blocks, and act-order groups follow g_idx), so the
 * reference's bits still. */
Test(matmul_bits, q8_activations_leave_them_on_the_f32_path)
{
    qt_set_activations(QL_ACTIVATIONS_Q8);
    check_case(&cases[1], 40, 256, 13, 7);
    check_case(&cases[6], 40, 256, 13, 8);
    check_fp8(16, 40, QT_SCALE_F32, 19, 70, 7, 9);
    qt_set_activations(QL_ACTIVATIONS_F32);
}

Test(matmul_bits, scalar_path_is_the_reference)
{
    qt_set_force_scalar(true);
    cr_assert_str_eq(qt_f32_path(), "scalar");
    check_case(&cases[1], 40, 256, 13, 5);
    check_fp8(16, 40, QT_SCALE_F32, 19, 70, 7, 6);
    qt_set_force_scalar(false);
}

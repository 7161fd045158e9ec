/*
 * test_kv_dtype.c - the KV cache's element types (--kv-dtype f32|f16|q8_0):
 *   - the row conversions (qt_kv_store, qt_kv_load): f16 against IEEE
 *     round to nearest even worked out here from the neighbouring halves
 *     (every tie between two adjacent halves, subnormals and the overflow
 *     edge included; Inf, NaN, signed zeros), every half back to f32
 *     exactly, q8_0 against llama.cpp's quantize_row_q8_0_ref written out
 *     here (ties round away from zero); the F16C/AVX2 forms and the
 *     AVX-512 ones (skipped by name without AVX-512 F and VL) equal the
 *     scalar ones bit for bit;
 *   - the arena: the same bytes hold 2x the blocks in f16 and 128/34 x in
 *     q8_0; q8_0 refuses a kv_dim that is not a multiple of 32, naming it;
 *     eng_kv_copy_blocks copies whole blocks of every dtype;
 *   - the forward pass on the tests' tiny model: logits through an f16 or
 *     q8_0 cache within a stated tolerance of the f32 cache's, and greedy
 *     decoding over an f16 cache giving the f32 cache's tokens;
 *   - the flags: --kv-dtype on generate and serve, the config file key and
 *     QLSERVE_KV_DTYPE, a bad value refused by name, and the default
 *     (NULL: f32) as eng_kv_dtype_resolve reads it.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "kv_cache_internal.h"
#include "model.h"
#include "qt_math.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

TestSuite(kv_dtype, .timeout = 120);

/* A half's value from its fields, in double: the definition, not a
 * conversion routine. */
static double half_value(uint16_t h)
{
    int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v = exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
    return h & 0x8000 ? -v : v;
}

/* f32 -> f16 through the scalar and the fast path, one value each. */
static uint16_t store_one(float x, bool scalar)
{
    float row[8] = {x, x, x, x, x, x, x, x};
    uint16_t out[8];
    if (scalar)
        qt_kv_store_ref(QT_F16, row, 8, out);
    else
        qt_kv_store(QT_F16, row, 8, out);
    for (int i = 1; i < 8; i++)
        cr_assert_eq(out[i], out[0]);
    return out[0];
}

static void assert_f16(float x, uint16_t want, const char *what)
{
    uint16_t a = store_one(x, true), b = store_one(x, false);
    cr_assert_eq(a, want, "%s: %a (0x%08x) -> 0x%04x, want 0x%04x", what, (double)x, qm_f32_bits(x),
                 a, want);
    cr_assert_eq(b, want, "%s (fast path): %a -> 0x%04x, want 0x%04x", what, (double)x, b, want);
}

/* Every positive finite half h and its successor: the value of each
 * converts to itself, the midpoint (exact in f32) to the one whose
 * mantissa is even, and the f32 just either side of the midpoint to the
 * nearer one. The last pair's successor is Inf (65504 and the 65520 tie). */
Test(kv_dtype, f16_store_rounds_to_nearest_even_at_every_tie)
{
    for (uint32_t h = 0; h < 0x7c00; h++) {
        for (int sign = 0; sign < 2; sign++) {
            uint16_t s = sign ? 0x8000 : 0, a = (uint16_t)(h | s), b = (uint16_t)((h + 1) | s);
            double va = half_value((uint16_t)h),
                   vb = h + 1 == 0x7c00 ? 65536.0 : half_value(b & 0x7fff);
            float mid = (float)((va + vb) / 2);
            cr_assert_eq((double)mid, (va + vb) / 2, "midpoint of 0x%04x not exact", h);
            float fa = sign ? -(float)va : (float)va, fm = sign ? -mid : mid;
            assert_f16(fa, a, "exact half");
            assert_f16(fm, (h & 1) ? b : a, "tie");
            float up = nextafterf(mid, INFINITY), down = nextafterf(mid, 0.0f);
            assert_f16(sign ? -up : up, b, "above the tie");
            assert_f16(sign ? -down : down, a, "below the tie");
        }
    }
}

Test(kv_dtype, f16_store_specials_and_tiny_values)
{
    assert_f16(INFINITY, 0x7c00, "inf");
    assert_f16(-INFINITY, 0xfc00, "-inf");
    assert_f16(1e10f, 0x7c00, "overflow");
    assert_f16(-0.0f, 0x8000, "-0");
    assert_f16(0.0f, 0x0000, "+0");
    assert_f16(1e-30f, 0x0000, "far below the smallest subnormal");
    assert_f16(-1e-30f, 0x8000, "far below the smallest subnormal, negative");
    assert_f16(ldexpf(1.0f, -25), 0x0000, "half the smallest subnormal: tie to even 0");
    assert_f16(ldexpf(1.5f, -25), 0x0001, "above half the smallest subnormal");
    /* NaN stays NaN, quiet, its sign and top payload bits kept */
    const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu, 0x7fa00000u};
    for (size_t i = 0; i < sizeof nans / sizeof *nans; i++) {
        float x = qm_bits_f32(nans[i]);
        uint16_t a = store_one(x, true), b = store_one(x, false);
        cr_assert_eq(a, b, "NaN 0x%08x: scalar 0x%04x, fast 0x%04x", nans[i], a, b);
        cr_assert((a & 0x7c00) == 0x7c00 && (a & 0x3ff) != 0 && (a & 0x200), "NaN 0x%08x -> 0x%04x",
                  nans[i], a);
        cr_assert_eq(a >> 15, nans[i] >> 31);
    }
}

/* A sweep over f32 bit patterns (every 4099th, all signs and exponents):
 * the fast path stores what the scalar one does, on rows long enough for
 * the 8-wide loop and its scalar tail. */
Test(kv_dtype, f16_store_fast_path_equals_scalar_over_a_sweep)
{
    enum { N = 1021 };
    float row[N];
    uint16_t a[N], b[N];
    uint64_t u = 0;
    while (u <= 0xffffffffu) {
        for (int i = 0; i < N; i++, u += 4099)
            row[i] = qm_bits_f32((uint32_t)u);
        qt_kv_store_ref(QT_F16, row, N, a);
        qt_kv_store(QT_F16, row, N, b);
        for (int i = 0; i < N; i++)
            cr_assert_eq(a[i], b[i], "0x%08x: scalar 0x%04x, fast 0x%04x", qm_f32_bits(row[i]),
                         a[i], b[i]);
    }
}

/* Every half back to f32: its exact value (NaN a NaN), through both paths,
 * and a finite half stored again is itself. */
Test(kv_dtype, f16_load_is_exact_for_every_half)
{
    static uint16_t all[65536];
    static float a[65536], b[65536];
    for (uint32_t h = 0; h < 65536; h++)
        all[h] = (uint16_t)h;
    qt_kv_load_ref(QT_F16, all, 0, 65536, a);
    qt_kv_load(QT_F16, all, 0, 65536, b);
    for (uint32_t h = 0; h < 65536; h++) {
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        /* a signalling NaN half: F16C quiets it, the scalar form keeps its
         * bits; qt_kv_store never writes one (its NaNs are quiet), so a
         * cache only ever holds the halves both read alike */
        if (!nan || (h & 0x200))
            cr_assert(same_bits(a[h], b[h]), "0x%04x: scalar %a, fast %a", h, (double)a[h],
                      (double)b[h]);
        bool inf = (h & 0x7fff) == 0x7c00;
        if (nan)
            cr_assert(isnan(a[h]) && isnan(b[h]), "0x%04x", h);
        else if (inf)
            cr_assert(isinf(a[h]) && (a[h] < 0) == (h >> 15), "0x%04x", h);
        else {
            cr_assert_eq((double)a[h], half_value((uint16_t)h), "0x%04x", h);
            cr_assert_eq(store_one(a[h], true), h, "0x%04x does not round trip", h);
        }
    }
    /* an offset start, off the 8-wide grid: the same values */
    float c[37];
    qt_kv_load(QT_F16, all, 1001, 37, c);
    for (int i = 0; i < 37; i++)
        cr_assert(same_bits(c[i], a[1001 + i]));
}

/* llama.cpp's quantize_row_q8_0_ref, written out: d = amax / 127, the f16
 * of d stored, q = roundf(x / d) through the f32 reciprocal. */
static void q8_0_reference(const float *x, uint8_t blk[34])
{
    float amax = 0;
    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t dh = qt_f32_to_f16(d);
    blk[0] = (uint8_t)(dh & 0xff);
    blk[1] = (uint8_t)(dh >> 8);
    for (int j = 0; j < 32; j++)
        blk[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

Test(kv_dtype, q8_0_rows_are_llama_cpp_blocks_and_load_back_within_half_a_step)
{
    enum { N = 256, B = N / 32 };
    cr_assert_eq(qt_kv_row_bytes(QT_Q8_0, N), (size_t)B * 34);
    cr_assert_eq(qt_kv_row_bytes(QT_Q8_0, 48), 0, "48 values are not whole blocks");
    cr_assert_eq(qt_kv_row_bytes(QT_F16, N), (size_t)N * 2);
    cr_assert_eq(qt_kv_row_bytes(QT_F32, N), (size_t)N * 4);
    uint64_t seed = 7;
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = test_normal(&seed) * (i < 32 ? 1e-6f : 3.0f);
    /* block 1: all zeros (d = 0); block 2: amax 127 so d = 1 and the ties
     * +-2.5, +-0.5 round away from zero; block 3: subnormal-sized d */
    for (int j = 0; j < 32; j++) {
        x[32 + j] = 0.0f;
        x[64 + j] = (float)(j % 5) - 2.0f;
        x[96 + j] = ldexpf((float)(j - 16), -30);
    }
    x[64] = 127.0f;
    x[65] = 2.5f;
    x[66] = -2.5f;
    x[67] = 0.5f;
    x[68] = -0.5f;
    uint8_t got[B * 34], fast[B * 34], want[B * 34];
    qt_kv_store_ref(QT_Q8_0, x, N, got);
    qt_kv_store(QT_Q8_0, x, N, fast);
    for (int b = 0; b < B; b++)
        q8_0_reference(x + 32 * b, want + 34 * b);
    cr_assert_eq(memcmp(got, want, sizeof want), 0, "not llama.cpp's q8_0 blocks");
    cr_assert_eq(memcmp(fast, want, sizeof want), 0, "fast path: not llama.cpp's q8_0 blocks");
    cr_assert_eq((int8_t)got[2 * 34 + 2 + 1], 3, "2.5 rounds away from zero");
    cr_assert_eq((int8_t)got[2 * 34 + 2 + 2], -3, "-2.5 rounds away from zero");
    cr_assert_eq((int8_t)got[2 * 34 + 2 + 3], 1, "0.5 rounds away from zero");
    cr_assert_eq((int8_t)got[2 * 34 + 2 + 4], -1);

    float a[N], b[N];
    qt_kv_load_ref(QT_Q8_0, got, 0, N, a);
    qt_kv_load(QT_Q8_0, got, 0, N, b);
    for (int i = 0; i < N; i++) {
        cr_assert(same_bits(a[i], b[i]), "%d: scalar %a, fast %a", i, (double)a[i], (double)b[i]);
        const uint8_t *blk = got + 34 * (i / 32);
        float d = qt_f16_to_f32((uint16_t)(blk[0] | blk[1] << 8));
        cr_assert(same_bits(a[i], (float)(int8_t)blk[2 + i % 32] * d), "%d", i);
        /* half a step of amax / 127, plus what storing d as an f16 moves
         * a code of at most 127 (all of it when d underflows to 0), plus
         * the f32 roundings of x / d and q * d */
        float amax = 0;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[32 * (i / 32) + j]));
        double dx = (double)amax / 127.0;
        double bound = 0.5 * dx + 127.0 * fabs(dx - d) + 1e-6 * amax;
        cr_assert_leq(fabs((double)a[i] - x[i]), bound, "%d: %g back as %g (d %g)", i, (double)x[i],
                      (double)a[i], (double)d);
    }
    /* a head's slice at every 8-aligned and unaligned start: the same values */
    for (int e0 = 0; e0 + 16 <= N; e0 += 5) {
        float c[16];
        qt_kv_load(QT_Q8_0, got, e0, 16, c);
        for (int i = 0; i < 16; i++)
            cr_assert(same_bits(c[i], a[e0 + i]), "start %d, element %d", e0, i);
    }
}

/* qt_kv_load_rows (one call for a KV block's run, as attention converts a
 * head's slice of each position) gives qt_kv_load_ref's bits row by row,
 * for every dtype, at a head slice off the vector grid as well as on it,
 * and writes nothing past its n_rows x n floats. */
Test(kv_dtype, loading_a_run_of_rows_gives_each_rows_bits)
{
    enum { ROWS = 5, DIM = 96 };
    uint64_t seed = 11;
    float x[ROWS][DIM];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < DIM; i++)
            x[r][i] = test_normal(&seed) * (float)(r + 1);
    static const qt_kind kinds[] = {QT_F32, QT_F16, QT_Q8_0};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        size_t row_bytes = qt_kv_row_bytes(kinds[k], DIM) + 6; /* rows need not be packed */
        uint8_t *arena = calloc(ROWS, row_bytes);
        cr_assert_not_null(arena);
        for (int r = 0; r < ROWS; r++)
            qt_kv_store(kinds[k], x[r], DIM, arena + r * row_bytes);
        static const int64_t starts[][2] = {{0, DIM}, {32, 64}, {5, 27}, {64, 32}};
        for (size_t s = 0; s < sizeof starts / sizeof *starts; s++) {
            int64_t e0 = starts[s][0], n = starts[s][1];
            float got[ROWS * DIM + 1], want[DIM];
            got[ROWS * n] = 12345.0f;
            qt_kv_load_rows(kinds[k], arena, row_bytes, ROWS, e0, n, got);
            cr_assert_eq(got[ROWS * n], 12345.0f, "kind %d: wrote past the rows", (int)kinds[k]);
            for (int r = 0; r < ROWS; r++) {
                qt_kv_load_ref(kinds[k], arena + r * row_bytes, e0, n, want);
                for (int64_t i = 0; i < n; i++)
                    cr_assert(same_bits(got[r * n + i], want[i]),
                              "kind %d, start %lld, row %d, element %lld: %a, one row %a",
                              (int)kinds[k], (long long)e0, r, (long long)i, (double)got[r * n + i],
                              (double)want[i]);
            }
        }
        free(arena);
    }
}

/* The AVX-512 forms (sixteen elements a vector) against the AVX2 forms and
 * the scalar ones: f16 stores over a sweep of f32 patterns with a tail past
 * the vectors, every (quiet) half loaded at starts on and off the 16 grid,
 * q8_0 loads of every start and length a head's slice can have. */
Test(kv_dtype, avx512_forms_equal_avx2_and_scalar)
{
    if (strcmp(qt_rows_path(), "avx512") != 0)
        cr_skip_test(
            "this CPU has no AVX-512 F and VL: the AVX-512 KV conversions cannot run here");
    enum { N = 1021, B = 8 };
    static float row[N], fa[N], fb[N], fc[N];
    static uint16_t a[N], b[N], c[N];
    uint64_t u = 0;
    for (int pass = 0; pass < 64; pass++) {
        for (int i = 0; i < N; i++, u += 65537)
            row[i] = qm_bits_f32((uint32_t)u);
        qt_kv_store_ref(QT_F16, row, N, a);
        qt_set_no_avx512(true);
        qt_kv_store(QT_F16, row, N, b);
        qt_set_no_avx512(false);
        qt_kv_store(QT_F16, row, N, c);
        for (int i = 0; i < N; i++)
            cr_assert(a[i] == c[i] && b[i] == c[i],
                      "0x%08x: scalar 0x%04x, avx2 0x%04x, avx512 0x%04x", qm_f32_bits(row[i]),
                      a[i], b[i], c[i]);
    }
    for (int i = 0; i < N; i++) { /* quiet halves only (see f16_load_is_exact_for_every_half) */
        uint16_t h = (uint16_t)(i * 64 + i);
        a[i] = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) ? (uint16_t)(h | 0x200) : h;
    }
    for (int e0 = 0; e0 < 40; e0 += 3) {
        qt_kv_load_ref(QT_F16, a, e0, N - e0, fa);
        qt_set_no_avx512(true);
        qt_kv_load(QT_F16, a, e0, N - e0, fb);
        qt_set_no_avx512(false);
        qt_kv_load(QT_F16, a, e0, N - e0, fc);
        for (int i = 0; i < N - e0; i++)
            cr_assert(same_bits(fa[i], fc[i]) && same_bits(fb[i], fc[i]), "start %d, half 0x%04x",
                      e0, a[e0 + i]);
    }
    uint64_t seed = 11;
    float x[32 * B];
    uint8_t q8[34 * B];
    for (int i = 0; i < 32 * B; i++)
        x[i] = test_normal(&seed) * (float)(1 + i % 5);
    qt_kv_store_ref(QT_Q8_0, x, 32 * B, q8);
    for (int e0 = 0; e0 < 64; e0 += 4)
        for (int n = 4; e0 + n <= 32 * B; n += 12) {
            qt_kv_load_ref(QT_Q8_0, q8, e0, n, fa);
            qt_set_no_avx512(true);
            qt_kv_load(QT_Q8_0, q8, e0, n, fb);
            qt_set_no_avx512(false);
            qt_kv_load(QT_Q8_0, q8, e0, n, fc);
            for (int i = 0; i < n; i++)
                cr_assert(same_bits(fa[i], fc[i]) && same_bits(fb[i], fc[i]),
                          "start %d, length %d, element %d: scalar %a, avx512 %a", e0, n, i,
                          (double)fa[i], (double)fc[i]);
        }
    cr_assert_str_eq(qt_rows_path(), "avx512");
}

/* --- the arena ------------------------------------------------------------- */

/* 2 layers, 2 kv heads of 16: kv_dim 32, one q8_0 block per row. */
static const eng_config shape = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 16};

static eng_kv_cache *new_cache(qt_kind dtype, size_t bytes)
{
    eng_kv_cache *kv = NULL;
    char msg[256];
    cr_assert_eq(eng_kv_new_dtype(&kv, &shape, bytes, 16, dtype, msg, sizeof msg), QL_OK, "%s",
                 msg);
    cr_assert_eq(eng_kv_dtype(kv), dtype);
    return kv;
}

Test(kv_dtype, the_same_bytes_hold_more_blocks_in_f16_and_q8_0)
{
    /* f32: 16 positions x 2 layers x (K, V) x 32 values x 4 bytes = 8 KiB */
    size_t bytes = (size_t)64 << 13;
    eng_kv_cache *f32 = new_cache(QT_F32, bytes), *f16 = new_cache(QT_F16, bytes),
                 *q8 = new_cache(QT_Q8_0, bytes);
    cr_assert_eq(eng_kv_total_blocks(f32), 64);
    cr_assert_eq(eng_kv_total_blocks(f16), 128, "f16: twice f32's blocks");
    /* q8_0: 34 bytes per 32 values, a block 16 * 2 * 2 * 34 = 2176 bytes */
    cr_assert_eq(eng_kv_total_blocks(q8), (int32_t)(bytes / 2176));
    cr_assert_eq(eng_kv_token_bytes(&shape, QT_F32), 2 * 2 * 32 * 4);
    cr_assert_eq(eng_kv_token_bytes(&shape, QT_F16), 2 * 2 * 32 * 2);
    cr_assert_eq(eng_kv_token_bytes(&shape, QT_Q8_0), 2 * 2 * 34);
    /* the same positions in the same bytes the existing f32 callers see */
    cr_assert_eq(eng_kv_block_floats(f16), eng_kv_block_floats(f32));
    eng_kv_free(f32);
    eng_kv_free(f16);
    eng_kv_free(q8);
}

Test(kv_dtype, q8_0_refuses_a_kv_dim_that_is_not_whole_blocks)
{
    const eng_config odd = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8};
    eng_kv_cache *kv = NULL;
    char msg[256] = "";
    cr_assert_eq(eng_kv_new_dtype(&kv, &odd, 1 << 20, 16, QT_Q8_0, msg, sizeof msg), QL_EINVAL);
    cr_assert_null(kv);
    cr_assert(strstr(msg, "q8_0") && strstr(msg, "multiple of 32") && strstr(msg, "is 16"), "%s",
              msg);
    cr_assert_eq(eng_kv_new_dtype(&kv, &odd, 1 << 20, 16, QT_F16, msg, sizeof msg), QL_OK, "%s",
                 msg);
    eng_kv_free(kv);
    cr_assert_eq(eng_kv_new_dtype(&kv, &odd, 1 << 20, 16, QT_BF16, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "bf16"), "%s", msg);
}

/* Copy on write moves whole blocks: a fork's shared partial block, copied
 * before the fork writes, holds the source's bytes (every layer, K and V)
 * in every dtype, and the source's block is untouched by the fork's write. */
Test(kv_dtype, copy_on_write_copies_whole_blocks_of_every_dtype)
{
    const qt_kind kinds[] = {QT_F32, QT_F16, QT_Q8_0};
    for (size_t k = 0; k < 3; k++) {
        eng_kv_cache *kv = new_cache(kinds[k], (size_t)1 << 20);
        eng_seq_kv src = {0}, dst = {0};
        cr_assert_eq(eng_kv_reserve(kv, &src, 10), QL_OK);
        float row[32];
        for (int32_t pos = 0; pos < 10; pos++)
            for (int32_t l = 0; l < 2; l++)
                for (int v = 0; v < 2; v++) {
                    for (int i = 0; i < 32; i++)
                        row[i] = (float)(pos * 100 + l * 10 + v) + (float)i / 64.0f;
                    qt_kv_store(kinds[k], row, 32, kv_row(kv, src.blocks, l, v, pos));
                }
        src.n_tokens = 10;
        cr_assert_eq(eng_kv_hold(kv, &src, eng_kv_fork_blocks(kv, 10, 12)), QL_OK);
        cr_assert_eq(eng_kv_fork(kv, &dst, &src, 12), QL_OK);
        eng_kv_copy copies[4];
        int32_t n = 0;
        cr_assert_eq(eng_kv_prepare_write(kv, &dst, 10, 1, copies, 4, &n), QL_OK);
        cr_assert_eq(n, 1, "%s: the shared partial block is copied", qt_kind_name(kinds[k]));
        eng_kv_copy_blocks(kv, copies, n);
        cr_assert_neq(dst.blocks[0], src.blocks[0]);
        for (int32_t pos = 0; pos < 10; pos++)
            for (int32_t l = 0; l < 2; l++)
                for (int v = 0; v < 2; v++)
                    cr_assert_eq(memcmp(kv_row(kv, src.blocks, l, v, pos),
                                        kv_row(kv, dst.blocks, l, v, pos), kv->row_bytes),
                                 0, "%s: position %d layer %d %c", qt_kind_name(kinds[k]), pos, l,
                                 v ? 'V' : 'K');
        unsigned char *before = malloc(kv->block_bytes);
        memcpy(before, kv->data + (size_t)src.blocks[0] * kv->block_bytes, kv->block_bytes);
        for (int i = 0; i < 32; i++)
            row[i] = -1.0f;
        qt_kv_store(kinds[k], row, 32, kv_row(kv, dst.blocks, 1, 1, 10));
        cr_assert_eq(
            memcmp(before, kv->data + (size_t)src.blocks[0] * kv->block_bytes, kv->block_bytes), 0,
            "%s: the fork's write reached the source", qt_kind_name(kinds[k]));
        free(before);
        eng_kv_release(kv, &dst);
        eng_kv_release(kv, &src);
        cr_assert_eq(eng_kv_free_blocks(kv), eng_kv_total_blocks(kv));
        eng_kv_free(kv);
    }
}

/* --- the forward pass on the tiny model ------------------------------------ */

enum { PROMPT = 12, STEPS = 48, VOCAB = 260 };

typedef struct run {
    float logits[STEPS][VOCAB]; /* step 0: the prompt's last position */
    int32_t tokens[STEPS];
} run;

/* Prefill PROMPT tokens, then decode greedily over a cache of dtype: each
 * step's logits and its argmax. */
static void greedy(const eng_model *m, eng_pool *pool, qt_kind dtype, run *out)
{
    char msg[512];
    eng_kv_cache *kv;
    eng_forward_state *st;
    cr_assert_eq(eng_kv_new_dtype(&kv, &m->cfg, 4 << 20, 16, dtype, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&st, m, 64, msg, sizeof msg), 0, "%s", msg);
    eng_seq_kv skv = {0};
    cr_assert_eq(eng_kv_reserve(kv, &skv, PROMPT + STEPS), 0);
    int32_t V = m->cfg.vocab_size, prompt[PROMPT];
    cr_assert_eq(V, VOCAB);
    for (int i = 0; i < PROMPT; i++)
        prompt[i] = (i * 37 + 11) % V;
    eng_step_seq s = {.kv = &skv, .tokens = prompt, .n_tokens = PROMPT, .pos = 0};
    cr_assert_eq(eng_forward(st, m, kv, pool, &s, 1, out->logits[0], msg, sizeof msg), 0, "%s",
                 msg);
    for (int t = 0; t < STEPS; t++) {
        int32_t best = 0;
        for (int32_t i = 1; i < V; i++)
            if (out->logits[t][i] > out->logits[t][best])
                best = i;
        out->tokens[t] = best;
        if (t + 1 == STEPS)
            break;
        eng_step_seq d = {.kv = &skv, .tokens = &out->tokens[t], .n_tokens = 1, .pos = PROMPT + t};
        cr_assert_eq(eng_forward(st, m, kv, pool, &d, 1, out->logits[t + 1], msg, sizeof msg), 0,
                     "%s", msg);
    }
    eng_kv_release(kv, &skv);
    eng_forward_state_free(st);
    eng_kv_free(kv);
}

/* The first step whose token differs from ref's (STEPS: none), and the
 * worst ||logits - ref||_2 / ||ref||_2 over the steps before it (their
 * inputs are the same tokens). */
static int compare_runs(const run *ref, const run *got, double *worst)
{
    *worst = 0;
    for (int t = 0; t < STEPS; t++) {
        test_diff d = test_diff_f32(got->logits[t], ref->logits[t], VOCAB);
        /* test_diff_l2 is never NaN (+inf for a NaN logit), so fmax keeps it */
        *worst = fmax(*worst, test_diff_l2(&d));
        if (got->tokens[t] != ref->tokens[t])
            return t;
    }
    return STEPS;
}

/*
 * The tiny model (2 layers, 4 heads of 16, 2 kv heads: kv_dim 32) decoded
 * over each cache. Tolerances, relative L2 over a step's logits: f16 keeps
 * 11 significant bits (relative rounding 2^-12 = 2.4e-4 per K and V value),
 * q8_0 about 7 (half a step of amax / 127: up to 4e-3 of a block's
 * largest value). Measured on this model (the log line): f16 1.8e-4 and
 * all 48 greedy tokens as f32's; q8_0 4.6e-3, its first different token
 * at step 29 (random weights: near-tied logits). Bounds: f16 2e-3, q8_0
 * 2e-2: a wrong scale, a row read from the wrong place or a sign slip
 * moves these logits by O(1).
 * q8_0's greedy tokens must be f32's through step 28 (d8 >= 29). The
 * margin is in the error, not in the steps: measured (fast and scalar
 * alike), at every step before 29 f32's top two logits lie at least 1.8
 * times q8_0's largest logit error apart (tightest: step 0, gap 2.3e-3
 * against 1.2e-3; step 18, 4.2e-3 against 2.0e-3), so a token before 29
 * changes only once q8_0's error grows 1.8 times, and a smaller bound
 * would tolerate no more than that; at step 29 the gap, 9.8e-4, is under
 * the error, 1.7e-3, so the tokens may part there (and do).
 */
static void tiny_decode(bool scalar)
{
    qt_set_force_scalar(scalar);
    char dir[512], path[700], msg[512];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    tiny_spec spec = tiny_default();
    tiny_write_gguf(path, &spec, QT_Q8_0);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    eng_pool *pool;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0, "%s", msg);
    run *f32 = malloc(sizeof *f32), *f16 = malloc(sizeof *f16), *q8 = malloc(sizeof *q8);
    greedy(&m, pool, QT_F32, f32);
    greedy(&m, pool, QT_F16, f16);
    greedy(&m, pool, QT_Q8_0, q8);
    double w16, w8;
    int d16 = compare_runs(f32, f16, &w16), d8 = compare_runs(f32, q8, &w8);
    cr_log_info("%s: f16 KV: %d of %d greedy tokens as f32's, logits within %.3g; q8_0 KV: %d "
                "of %d, within %.3g",
                scalar ? "scalar" : "fast", d16, STEPS, w16, d8, STEPS, w8);
    cr_assert_eq(d16, STEPS, "f16 KV: greedy token %d differs from f32's (%d vs %d)", d16,
                 d16 < STEPS ? f16->tokens[d16] : -1, d16 < STEPS ? f32->tokens[d16] : -1);
    cr_assert_lt(w16, 2e-3, "f16 KV logits %.3g from f32's", w16);
    cr_assert_lt(w8, 2e-2, "q8_0 KV logits %.3g from f32's", w8);
    cr_assert_geq(d8, 29, "q8_0 KV: greedy token %d differs from f32's (%d vs %d)", d8,
                  d8 < STEPS ? q8->tokens[d8] : -1, d8 < STEPS ? f32->tokens[d8] : -1);
    /* the cache's values do matter: f16 is not f32 bit for bit */
    cr_assert_gt(w16, 0.0, "f16 KV gave f32's logits bit for bit: is the cache f16?");
    free(f32);
    free(f16);
    free(q8);
    eng_pool_free(pool);
    eng_model_free(&m);
    test_rmtree(dir);
}

Test(kv_dtype, tiny_model_decodes_over_f16_and_q8_0_as_over_f32)
{
    tiny_decode(false);
}

Test(kv_dtype, tiny_model_decodes_over_f16_and_q8_0_as_over_f32_scalar)
{
    tiny_decode(true);
}

/* --- the flags ---------------------------------------------------------------- */

static int parse_serve(cfg_serve *out, char *msg, size_t len, const char *a0, const char *a1)
{
    char *argv[] = {"serve", "--model", "/m", (char *)a0, (char *)a1, NULL};
    int argc = a0 ? (a1 ? 5 : 4) : 3;
    return cfg_parse_serve(argc, argv, out, msg, len);
}

Test(kv_dtype, kv_dtype_flag_file_key_and_environment)
{
    char msg[1024];
    unsetenv("QLSERVE_KV_DTYPE");
    cfg_serve c;
    cr_assert_eq(parse_serve(&c, msg, sizeof msg, NULL, NULL), QL_OK, "%s", msg);
    cr_assert_null(c.kv_dtype, "unset: the device's default");
    qt_kind k = QT_Q8_0;
    cr_assert_eq(eng_kv_dtype_resolve(c.kv_dtype, ENG_DEVICE_CPU, &k, msg, sizeof msg), QL_OK);
    cr_assert_eq(k, QT_F16, "the CPU default is f16");
    cr_assert_eq(eng_kv_dtype_resolve(c.kv_dtype, ENG_DEVICE_CUDA, &k, msg, sizeof msg), QL_OK);
    cr_assert_eq(k, QT_F32, "the CUDA backend's cache is f32");
    cfg_serve_free(&c);

    const char *names[] = {"f32", "f16", "q8_0"};
    const qt_kind kinds[] = {QT_F32, QT_F16, QT_Q8_0};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(parse_serve(&c, msg, sizeof msg, "--kv-dtype", names[i]), QL_OK, "%s", msg);
        cr_assert_str_eq(c.kv_dtype, names[i]);
        cr_assert_eq(eng_kv_dtype_resolve(c.kv_dtype, ENG_DEVICE_CUDA, &k, msg, sizeof msg), QL_OK);
        cr_assert_eq(k, kinds[i], "an explicit value wins over the device's default");
        cfg_serve_free(&c);
    }
    cr_assert_eq(parse_serve(&c, msg, sizeof msg, "--kv-dtype", "int4"), QL_EUSAGE);
    cr_assert(strstr(msg, "--kv-dtype int4") && strstr(msg, "f32, f16, q8_0"), "%s", msg);
    cfg_serve_free(&c);
    cr_assert_eq(eng_kv_dtype_parse("bf16", &k, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "\"bf16\""), "%s", msg);

    /* the config file's key, then the environment over it */
    char dir[512], path[700], opt[720];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/c.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs("{\"model\": \"/m\", \"kv-dtype\": \"q8_0\"}", f);
    fclose(f);
    snprintf(opt, sizeof opt, "--config=%s", path);
    cr_assert_eq(parse_serve(&c, msg, sizeof msg, opt, NULL), QL_OK, "%s", msg);
    cr_assert_str_eq(c.kv_dtype, "q8_0");
    cfg_serve_free(&c);
    setenv("QLSERVE_KV_DTYPE", "f32", 1);
    cr_assert_eq(parse_serve(&c, msg, sizeof msg, opt, NULL), QL_OK, "%s", msg);
    cr_assert_str_eq(c.kv_dtype, "f32");
    cfg_serve_free(&c);
    setenv("QLSERVE_KV_DTYPE", "half", 1);
    cr_assert_eq(parse_serve(&c, msg, sizeof msg, opt, NULL), QL_EUSAGE);
    cr_assert(strstr(msg, "QLSERVE_KV_DTYPE") && strstr(msg, "half"), "%s", msg);
    cfg_serve_free(&c);
    unsetenv("QLSERVE_KV_DTYPE");
    f = fopen(path, "w");
    fputs("{\"model\": \"/m\", \"kv-dtype\": \"f8\"}", f);
    fclose(f);
    cr_assert_eq(parse_serve(&c, msg, sizeof msg, opt, NULL), QL_EUSAGE);
    cr_assert(strstr(msg, "kv-dtype") && strstr(msg, "f8"), "%s", msg);
    cfg_serve_free(&c);
    test_rmtree(dir);

    cfg_generate g;
    char *gen[] = {"generate", "--model", "/m", "--prompt", "x", "--kv-dtype", "q8_0"};
    cr_assert_eq(cfg_parse_generate(7, gen, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(g.kv_dtype, "q8_0");
    gen[6] = "f64";
    cr_assert_eq(cfg_parse_generate(7, gen, &g, msg, sizeof msg), QL_EUSAGE);
    cr_assert(strstr(msg, "--kv-dtype f64"), "%s", msg);
    cr_assert_eq(cfg_parse_generate(5, gen, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_null(g.kv_dtype);
}

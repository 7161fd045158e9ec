/*
 * test_lora_bf16.c - unmerged adapters kept in bf16 (--adapter-dtype):
 * the rounding at load (nearest even, NaN kept) against a reference
 * written here from the definition; the bf16 LoRA products
 * (qt_lora_down, qt_lora_up) giving the scalar reference's bits on the
 * AVX2 path and on the AVX-512 one (skipped by name on a CPU without
 * AVX-512 F and VL) and a float64 dot product within bf16's own error; an f32
 * PEFT folder loaded both ways on a tiny model, each against the float64
 * reference forward pass (f32: the usual tolerance; bf16: within the
 * rounding's own share of the adapter's effect); and a batch of sequences
 * on distinct bf16 adapters giving each sequence its bits alone.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lora.h"
#include "lora_fixture.h"
#include "ref_forward.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512], model_dir[600], adapter_dir[600];

static void setup(void)
{
    lora_fix_dirs(dir, sizeof dir, model_dir, sizeof model_dir, adapter_dir, sizeof adapter_dir);
}

static void teardown(void)
{
    qt_set_force_scalar(false);
    qt_set_no_avx512(false);
    test_rmtree(dir);
}

TestSuite(lora_bf16, .init = setup, .fini = teardown, .timeout = 120);

/* --- the rounding -------------------------------------------------------------- */

/* f rounded to bf16 from the definition: of the two bf16 values around f
 * (its top 16 bits, and one step further from zero, 2^128 standing for the
 * step past the largest finite, which rounds to Inf), the nearer in
 * float64, the one with an even last bit on a tie. */
static float bf16_by_definition(float f)
{
    if (isinf(f))
        return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    double dhi = isinf(fhi) ? copysign(0x1p128, (double)f) : (double)fhi;
    double below = fabs((double)f - flo), above = fabs(dhi - f);
    if (below < above || (below == above && !(lo & 0x10000u)))
        return flo;
    return fhi;
}

Test(lora_bf16, rounding_at_load_is_nearest_even_and_keeps_nan)
{
    enum { N = 4096 };
    static float v[N];
    uint64_t rng = 3;
    int k = 0;
    float special[] = {0.0f,         -0.0f,      1.0f,         -1.0f,         INFINITY,
                       -INFINITY,    NAN,        -NAN,         0x1p-149f,     -0x1p-140f,
                       0x1.008p0f,   0x1.018p0f, 0x1.00801p0f, 0x1.fffep127f, 0x1.ff8p127f,
                       0x1.ff7p127f, 65504.0f,   1e-40f,       3.14159265f,   -2.71828f};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++)
        v[k++] = special[i];
    for (; k < N; k++) { /* any bits at all, NaNs included */
        uint32_t u = (uint32_t)test_rand(&rng);
        memcpy(&v[k], &u, 4);
    }
    char msg[256];
    qtensor t;
    cr_assert_eq(qt_from_dense(&t, QT_F32, v, 64, N / 64, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(qt_cast_dense(&t, QT_BF16, msg, sizeof msg), 0, "%s", msg);
    const uint16_t *h = (const uint16_t *)t.data;
    for (int i = 0; i < N; i++) {
        float got = qt_bf16_to_f32(h[i]), want = bf16_by_definition(v[i]);
        if (isnan(v[i]))
            cr_assert(isnan(got), "element %d: NaN became %a", i, (double)got);
        else
            cr_assert(same_bits(got, want), "element %d: %a rounds to %a, not %a", i, (double)v[i],
                      (double)got, (double)want);
    }
    qt_free(&t);
}

/* --- the products ---------------------------------------------------------------- */

static void random_bf16(qtensor *t, int64_t rows, int64_t cols, uint64_t *rng)
{
    float *v = malloc((size_t)(rows * cols) * sizeof *v);
    cr_assert(v);
    for (int64_t i = 0; i < rows * cols; i++)
        v[i] = test_normal(rng);
    char msg[256];
    cr_assert_eq(qt_from_dense(t, QT_F32, v, rows, cols, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(qt_cast_dense(t, QT_BF16, msg, sizeof msg), 0, "%s", msg);
    free(v);
}

/* The float64 dot product of bf16 row w with x, and the sum of the
 * products' magnitudes (what bounds f32 summation error). */
static double dot64(const qtensor *w, int64_t r, const float *x, double *mag)
{
    const uint16_t *h = (const uint16_t *)w->data + r * w->cols;
    double s = 0;
    *mag = 0;
    for (int64_t i = 0; i < w->cols; i++) {
        double p = (double)qt_bf16_to_f32(h[i]) * x[i];
        s += p;
        *mag += fabs(p);
    }
    return s;
}

/* The fast path (AVX2 alone where no_avx512, else the widest this CPU
 * has) against the scalar reference, bit for bit, and the float64 sums. */
static void products_give_the_reference_bits(bool no_avx512)
{
    /* ranks and widths with and without a tail past a multiple of eight or
     * sixteen (24 and 29: a sixteen-row pass cut short in each half) */
    const int64_t ranks[] = {1, 4, 8, 13, 16, 24, 29, 64};
    const int64_t widths[] = {5, 8, 37, 576, 1539};
    uint64_t rng = 9;
    for (size_t ri = 0; ri < sizeof ranks / sizeof *ranks; ri++) {
        for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++) {
            int64_t rank = ranks[ri], in = widths[wi], out = widths[(wi + 2) % 5];
            qtensor a, b;
            random_bf16(&a, rank, in, &rng);
            random_bf16(&b, out, rank, &rng);
            float *x = malloc((size_t)in * sizeof *x);
            float *t[2], *y[2];
            for (int p = 0; p < 2; p++) {
                t[p] = malloc((size_t)rank * sizeof(float));
                y[p] = malloc((size_t)out * sizeof(float));
            }
            for (int64_t i = 0; i < in; i++)
                x[i] = test_normal(&rng);
            qt_set_no_avx512(no_avx512);
            for (int p = 0; p < 2; p++) {
                qt_set_force_scalar(p == 1);
                for (int64_t o = 0; o < out; o++)
                    y[p][o] = (float)o * 0.25f;
                // in pieces, as the pool splits them
                qt_lora_down(&a, x, 0.5f, t[p], 0, rank / 2);
                qt_lora_down(&a, x, 0.5f, t[p], rank / 2, rank);
                qt_lora_up(&b, t[p], y[p], 0, out / 3);
                qt_lora_up(&b, t[p], y[p], out / 3, out);
            }
            qt_set_force_scalar(false);
            cr_assert_eq(memcmp(t[0], t[1], (size_t)rank * sizeof(float)), 0,
                         "rank %ld in %ld: down differs between %s and scalar", (long)rank,
                         (long)in, qt_rows_path());
            cr_assert_eq(memcmp(y[0], y[1], (size_t)out * sizeof(float)), 0,
                         "rank %ld out %ld: up differs between %s and scalar", (long)rank,
                         (long)out, qt_rows_path());
            // and both are the float64 sums within f32 summation's error:
            // n * 2^-24 of the products' magnitudes (a loose Higham bound)
            for (int64_t r = 0; r < rank; r++) {
                double mag, want = 0.5 * dot64(&a, r, x, &mag);
                cr_assert(fabs(t[0][r] - want) <= (double)in * 0x1p-24 * 0.5 * mag + 1e-30,
                          "down row %ld: %.9g, float64 %.9g", (long)r, (double)t[0][r], want);
            }
            for (int64_t o = 0; o < out; o++) {
                double mag, want = (double)o * 0.25 + dot64(&b, o, t[0], &mag);
                cr_assert(fabs(y[0][o] - want) <=
                              (double)(rank + 1) * 0x1p-24 * (mag + (double)o * 0.25) + 1e-30,
                          "up row %ld: %.9g, float64 %.9g", (long)o, (double)y[0][o], want);
            }
            for (int p = 0; p < 2; p++) {
                free(t[p]);
                free(y[p]);
            }
            free(x);
            qt_free(&a);
            qt_free(&b);
        }
    }
}

Test(lora_bf16, products_give_the_reference_bits_on_every_path_and_shape)
{
    products_give_the_reference_bits(true);
}

/* Sixteen rows a pass, two rows' lanes to a zmm: the same bits again. */
Test(lora_bf16, avx512_products_give_the_reference_bits)
{
    if (strcmp(qt_rows_path(), "avx512") != 0)
        cr_skip_test("this CPU has no AVX-512 F and VL: the AVX-512 LoRA products cannot run here");
    products_give_the_reference_bits(false);
    cr_assert_str_eq(qt_rows_path(), "avx512");
}

/* --- an adapter loaded both ways on a tiny model ------------------------------- */

typedef struct rig {
    eng_model m;
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
} rig;

static void rig_open(rig *g)
{
    memset(g, 0, sizeof *g);
    char msg[1024];
    tiny_spec t = tiny_default();
    tiny_write_hf(model_dir, &t);
    eng_load_opts o = {.path = model_dir, .quant = "nf4"};
    cr_assert_eq(eng_model_load(&g->m, &o, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_pool_new(&g->pool, 2, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_kv_new(&g->kv, &g->m.cfg, (size_t)8 << 20, 16, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_forward_state_new(&g->st, &g->m, 64, msg, sizeof msg), 0, "%s", msg);
}

static void rig_close(rig *g)
{
    eng_forward_state_free(g->st);
    eng_kv_free(g->kv);
    eng_pool_free(g->pool);
    eng_model_free(&g->m);
}

static eng_lora *load_as(const rig *g, const char *folder, lora_dtype dtype)
{
    eng_lora *l = NULL;
    char msg[1024] = "";
    cr_assert_eq(lora_load_as(&l, NULL, folder, NULL, &g->m, dtype, msg, sizeof msg), 0, "%s", msg);
    return l;
}

#define PROMPT 6

/* The logits of every prompt position, one sequence with `lora` (NULL:
 * none) at scale 1. */
static void prompt_logits(rig *g, eng_lora *lora, float *logits)
{
    static const int32_t tokens[PROMPT] = {259, 72, 101, 108, 256, 33};
    eng_lora_term term = {lora, 1.0f};
    eng_seq_kv kv = {0};
    char msg[1024] = "";
    float *last = malloc((size_t)g->m.cfg.vocab_size * sizeof *last);
    // one token a step, so that every position's logits come back
    for (int32_t i = 0; i < PROMPT; i++) {
        eng_step_seq s = {.kv = &kv,
                          .tokens = tokens + i,
                          .n_tokens = 1,
                          .pos = i,
                          .delta = lora ? &term : NULL,
                          .n_delta = lora ? 1 : 0};
        cr_assert_eq(eng_kv_reserve(g->kv, &kv, i + 1), QL_OK);
        cr_assert_eq(eng_forward(g->st, &g->m, g->kv, g->pool, &s, 1, last, msg, sizeof msg), 0,
                     "%s", msg);
        memcpy(logits + (size_t)i * (size_t)g->m.cfg.vocab_size, last,
               (size_t)g->m.cfg.vocab_size * sizeof *last);
    }
    eng_kv_release(g->kv, &kv);
    free(last);
}

Test(lora_bf16, an_f32_adapter_in_bf16_stays_within_its_rounding_of_float64)
{
    rig g;
    rig_open(&g);
    lora_fix_spec s = lora_fix_default(); /* F32 tensors */
    s.std = 0.2f;
    lora_fix_write(adapter_dir, &g.m.cfg, &s);
    eng_lora *f32 = load_as(&g, adapter_dir, LORA_DTYPE_F32);
    eng_lora *bf16 = load_as(&g, adapter_dir, LORA_DTYPE_BF16);

    // f32 keeps the file's tensors, borrowed; bf16 rounds them into its own
    const eng_lora_module *m32 = eng_lora_module_at(f32, 1, ENG_PROJ_UP);
    const eng_lora_module *m16 = eng_lora_module_at(bf16, 1, ENG_PROJ_UP);
    cr_assert_eq(m32->a.kind, QT_F32);
    cr_assert(m32->a.data_borrowed);
    cr_assert_eq(m16->a.kind, QT_BF16);
    cr_assert_eq(m16->b.kind, QT_BF16);
    cr_assert(!m16->a.data_borrowed && !m16->b.data_borrowed);
    for (int64_t i = 0; i < m16->b.rows * m16->b.cols; i++)
        cr_assert_eq(((const uint16_t *)m16->b.data)[i],
                     qt_f32_to_bf16(((const float *)m32->b.data)[i]), "B element %ld", (long)i);
    // and holds those alone (the file's copy let go): half the f32 bytes
    size_t t16 = 0, t32 = 0,
           table = (size_t)g.m.cfg.n_layers * ENG_N_PROJ * sizeof(eng_lora_module);
    for (int32_t l = 0; l < g.m.cfg.n_layers; l++)
        for (int p = 0; p < ENG_N_PROJ; p++) {
            const eng_lora_module *a = eng_lora_module_at(f32, l, (eng_proj)p),
                                  *b = eng_lora_module_at(bf16, l, (eng_proj)p);
            t32 += a->a.data_bytes + a->b.data_bytes;
            t16 += b->a.data_bytes + b->b.data_bytes;
        }
    cr_assert_eq(2 * t16, t32);
    cr_assert_eq(bf16->bytes, table + t16, "bf16 counts %zu bytes; its tensors and table %zu",
                 bf16->bytes, table + t16);
    cr_assert_gt(f32->bytes, table + t32, "f32 counts the file's copy it borrows from");

    int64_t V = g.m.cfg.vocab_size, n = PROMPT * V;
    float *base = malloc((size_t)n * sizeof *base), *e32 = malloc((size_t)n * sizeof *e32),
          *e16 = malloc((size_t)n * sizeof *e16);
    double *ref = malloc((size_t)n * sizeof *ref);
    prompt_logits(&g, NULL, base);
    prompt_logits(&g, f32, e32);
    prompt_logits(&g, bf16, e16);
    ref_model R;
    ref_load(&R, &g.m);
    ref_add_lora(&R, f32, 1.0);
    static const int32_t tokens[PROMPT] = {259, 72, 101, 108, 256, 33};
    ref_forward(&R, tokens, PROMPT, ref);
    ref_free(&R);

    // relative L2 over all the logits, ||x - float64|| / ||float64|| (test_diff_l2:
    // +inf for a NaN or an infinity, so the effect must also be finite)
    test_diff moved = test_diff_f64(base, ref, (size_t)n);
    double effect = test_diff_l2(&moved);
    cr_assert(effect > 1e3 * FWD_REL_TOL && effect < INFINITY,
              "the adapter moves the logits by %.3g (wanted finite and > %g)", effect,
              1e3 * FWD_REL_TOL);
    // f32: the float64 model's logits, as every unmerged kind is held to
    for (int i = 0; i < PROMPT; i++)
        assert_logits_close(e32 + i * V, ref + i * V, V, "f32 adapter", "prompt", i);
    // bf16: each of A's and B's elements is off by at most 2^-9 of itself,
    // so the delta by about 2^-8 of itself; allowed: 2^-6 of the adapter's
    // whole effect on the logits (four times that, for the nonlinear
    // layers after it), plus the f32 tolerance
    test_diff rounded = test_diff_f64(e16, ref, (size_t)n);
    double err = test_diff_l2(&rounded);
    cr_assert(err <= 0x1p-6 * effect + FWD_REL_TOL,
              "bf16: ||engine - float64|| / ||float64|| = %.4g, against the adapter's effect "
              "%.4g (ratio %.3g)",
              err, effect, err / effect);
    cr_assert(err > 0, "rounding to bf16 changed nothing: were A and B rounded?");
    cr_log_info("bf16: ||engine - float64|| / the adapter's effect = %.3g (bound 2^-6)",
                err / effect);

    free(base);
    free(e32);
    free(e16);
    free(ref);
    eng_lora_unref(f32);
    eng_lora_unref(bf16);
    rig_close(&g);
}

Test(lora_bf16, a_bf16_file_is_kept_as_is_either_way)
{
    rig g;
    rig_open(&g);
    lora_fix_spec s = lora_fix_default();
    s.dtype = ST_BF16;
    lora_fix_write(adapter_dir, &g.m.cfg, &s);
    eng_lora *a = load_as(&g, adapter_dir, LORA_DTYPE_F32);
    eng_lora *b = load_as(&g, adapter_dir, LORA_DTYPE_BF16);
    for (int p = 0; p < ENG_N_PROJ; p++) {
        const eng_lora_module *ma = eng_lora_module_at(a, 0, (eng_proj)p),
                              *mb = eng_lora_module_at(b, 0, (eng_proj)p);
        cr_assert_eq(ma->a.kind, QT_BF16);
        cr_assert_eq(mb->a.kind, QT_BF16);
        cr_assert(mb->a.data_borrowed, "a bf16 tensor is used in place, not converted");
        cr_assert_eq(memcmp(ma->b.data, mb->b.data, ma->b.data_bytes), 0);
    }
    cr_assert_eq(a->bytes, b->bytes);
    eng_lora_unref(a);
    eng_lora_unref(b);
    rig_close(&g);
}

/* Sequences on distinct bf16 adapters (and one on none, one on two),
 * batched, each get the bits they get alone: every row is multiplied by its
 * own module where it lies, whatever else is in the step (one term rides in
 * the base product, two are added after it). */
Test(lora_bf16, a_batch_of_distinct_bf16_adapters_gives_each_sequence_its_alone_bits)
{
    enum { N = 5 };
    rig g;
    rig_open(&g);
    eng_lora *ad[N - 1];
    for (int i = 0; i < N - 1; i++) {
        char folder[700];
        snprintf(folder, sizeof folder, "%s/a%d", dir, i);
        lora_fix_spec s = lora_fix_default();
        s.seed = 100 + (uint64_t)i;
        s.r = i == 2 ? 5 : 8 * (i + 1); /* a rank with a tail, and up to 32 */
        s.alpha = 2.0 * s.r;
        lora_fix_write(folder, &g.m.cfg, &s);
        ad[i] = load_as(&g, folder, LORA_DTYPE_BF16);
    }
    int64_t V = g.m.cfg.vocab_size;
    static const int32_t tokens[4] = {259, 72, 101, 108};
    float *batch = malloc((size_t)(N * 4) * (size_t)V * sizeof *batch);
    float *alone = malloc((size_t)V * sizeof *alone);
    eng_lora_term terms[N][2];
    eng_seq_kv kv[N];
    eng_step_seq seqs[N];
    char msg[1024] = "";
    for (int i = 0; i < N; i++) {
        terms[i][0] = (eng_lora_term){i ? ad[i - 1] : NULL, i == 3 ? -0.5f : 1.0f};
        terms[i][1] = (eng_lora_term){ad[0], 0.25f};
        kv[i] = (eng_seq_kv){0};
    }
    // a prefill of 1 to 4 tokens per sequence in one step
    for (int i = 0; i < N; i++) {
        seqs[i] = (eng_step_seq){.kv = &kv[i],
                                 .tokens = tokens,
                                 .n_tokens = 1 + i % 4,
                                 .pos = 0,
                                 .delta = i ? terms[i] : NULL,
                                 .n_delta = i == N - 1 ? 2
                                            : i        ? 1
                                                       : 0};
        cr_assert_eq(eng_kv_reserve(g.kv, &kv[i], seqs[i].n_tokens), QL_OK);
    }
    cr_assert_eq(eng_forward(g.st, &g.m, g.kv, g.pool, seqs, N, batch, msg, sizeof msg), 0, "%s",
                 msg);
    for (int i = 0; i < N; i++) {
        eng_kv_release(g.kv, &kv[i]);
        kv[i] = (eng_seq_kv){0};
        cr_assert_eq(eng_kv_reserve(g.kv, &kv[i], seqs[i].n_tokens), QL_OK);
        eng_step_seq one = seqs[i];
        one.kv = &kv[i];
        cr_assert_eq(eng_forward(g.st, &g.m, g.kv, g.pool, &one, 1, alone, msg, sizeof msg), 0,
                     "%s", msg);
        cr_assert_eq(memcmp(alone, batch + (size_t)i * (size_t)V, (size_t)V * sizeof *alone), 0,
                     "sequence %d: batched logits differ from its own", i);
        eng_kv_release(g.kv, &kv[i]);
    }
    free(batch);
    free(alone);
    for (int i = 0; i < N - 1; i++)
        eng_lora_unref(ad[i]);
    rig_close(&g);
}

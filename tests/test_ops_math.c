/*
 * test_ops_math.c - the layer arithmetic of kernels/math/ops_math.h (RMSNorm,
 * RoPE, SwiGLU, attention's online softmax, the greedy rule), which both
 * engine/runtime/forward.c and the CUDA kernels run, against hand values and an
 * independent f64 computation.
 *
 * Why shaped so: there is no GPU in CI, so what is pinned here is the
 * arithmetic itself. test_forward pins that forward.c, calling these
 * functions, still gives its old bits; tests/gpu/test_cuda_ops.c pins the
 * kernels' indexing on a device. Tolerances are stated where a result is
 * rounded (f32 against f64); exact equality where the operation is exact
 * or its order is the contract.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops_math.h"
#include "scheduler.h"

/* xorshift64*: reproducible on every machine. */
static uint64_t rng = 0x853c49e6748fea9bull;

static double uniform(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (double)((rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

static float uniform_in(double lo, double hi)
{
    return (float)(lo + (hi - lo) * uniform());
}

/* |got - want| <= rel * |want| + abs. */
static void assert_close(double got, double want, double rel, double abs_tol, const char *what,
                         int i)
{
    cr_assert(fabs(got - want) <= rel * fabs(want) + abs_tol, "%s [%d]: got %.9g, want %.9g", what,
              i, got, want);
}

/* ---- RMSNorm ------------------------------------------------------------------ */

Test(ops_math, rmsnorm_scale_is_one_over_the_root_mean_square)
{
    /* hand value: x = (3, 4), mean of squares 12.5 */
    double ss = om_sumsq_add(om_sumsq_add(0.0, 3.0f), 4.0f);
    cr_assert_eq(ss, 25.0);
    cr_assert_eq(om_rmsnorm_scale(ss, 2, 0.0f), (float)(1.0 / sqrt(12.5)));
    /* eps alone for a zero row: 1 / sqrt(1e-6) = 1000 */
    cr_assert_float_eq(om_rmsnorm_scale(0.0, 4096, 1e-6f), 1000.0f, 1e-3);
    /* a 4096-wide row against f64: the scale is rounded once (<= 0.5 ulp,
     * plus the f32 eps' own rounding: 1e-7 relative is ample) */
    for (int trial = 0; trial < 20; trial++) {
        int n = 4096;
        double ref = 0.0, got = 0.0;
        for (int i = 0; i < n; i++) {
            float x = uniform_in(-3.0, 3.0) * (float)(trial + 1);
            got = om_sumsq_add(got, x);
            ref += (double)x * (double)x;
        }
        cr_assert_eq(got, ref, "the sum of squares is plain f64");
        double want = 1.0 / sqrt(ref / n + (double)1e-5f);
        assert_close(om_rmsnorm_scale(got, n, 1e-5f), want, 1e-7, 0.0, "scale", trial);
    }
}

Test(ops_math, rmsnorm_apply_multiplies_by_the_scale_then_the_weight)
{
    /* the order is the contract (forward.c's bits): (x * scale) * weight,
     * which differs from x * (scale * weight) in the last bit for many
     * inputs; count that some do, so the test sees a reordering */
    int differ = 0;
    for (int i = 0; i < 10000; i++) {
        float x = uniform_in(-4, 4), s = uniform_in(0.1, 3), w = uniform_in(-2, 2);
        float want = x * s;
        want = want * w;
        cr_assert_eq(om_rmsnorm_apply(x, s, w), want, "[%d]", i);
        float other = s * w;
        other = x * other;
        differ += other != want;
    }
    cr_assert_gt(differ, 100);
}

/* ---- RoPE --------------------------------------------------------------------- */

Test(ops_math, rope_pairs_are_half_apart_or_adjacent)
{
    int32_t a, b;
    om_rope_pair(3, 32, false, &a, &b);
    cr_assert(a == 3 && b == 35, "rotate_half pair 3 of 64: (%d, %d)", a, b);
    om_rope_pair(3, 32, true, &a, &b);
    cr_assert(a == 6 && b == 7, "interleaved pair 3: (%d, %d)", a, b);
    om_rope_pair(0, 4, false, &a, &b);
    cr_assert(a == 0 && b == 4);
    om_rope_pair(3, 4, true, &a, &b);
    cr_assert(a == 6 && b == 7);
}

Test(ops_math, rope_rotation_matches_f64_and_hand_values)
{
    /* a quarter turn: (1, 0) -> (0, 1); (0, 1) -> (-1, 0) */
    float x0 = 1.0f, x1 = 0.0f;
    om_rope_rotate(&x0, &x1, 0.0f, 1.0f);
    cr_assert(x0 == 0.0f && x1 == 1.0f, "(%g, %g)", x0, x1);
    x0 = 0.0f;
    x1 = 1.0f;
    om_rope_rotate(&x0, &x1, 0.0f, 1.0f);
    cr_assert(x0 == -1.0f && x1 == 0.0f, "(%g, %g)", x0, x1);
    /* identity at angle 0 */
    x0 = 0.3f;
    x1 = -7.25f;
    om_rope_rotate(&x0, &x1, 1.0f, 0.0f);
    cr_assert(x0 == 0.3f && x1 == -7.25f);

    /* a whole head of 64 in both layouts against f64 rotation: each output
     * is two products and a sum in f32, within 3 * 2^-24 of the pair's
     * norm; and the layouts touch exactly their own pairs */
    enum { D = 64, HALF = D / 2 };
    for (int layout = 0; layout < 2; layout++) {
        bool interleaved = layout == 1;
        float v[D], orig[D], cs[HALF], sn[HALF];
        for (int i = 0; i < D; i++)
            orig[i] = v[i] = uniform_in(-2, 2);
        for (int i = 0; i < HALF; i++) {
            double angle = 37.0 * pow(10000.0, -2.0 * i / D);
            cs[i] = (float)cos(angle);
            sn[i] = (float)sin(angle);
        }
        for (int i = 0; i < HALF; i++) {
            int32_t a, b;
            om_rope_pair(i, HALF, interleaved, &a, &b);
            om_rope_rotate(&v[a], &v[b], cs[i], sn[i]);
        }
        for (int i = 0; i < HALF; i++) {
            int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + HALF;
            double c = cs[i], s = sn[i];
            double want0 = orig[a] * c - orig[b] * s, want1 = orig[a] * s + orig[b] * c;
            double norm = hypot(orig[a], orig[b]);
            assert_close(v[a], want0, 0.0, 3.0 * norm / 16777216.0, "rope a", i);
            assert_close(v[b], want1, 0.0, 3.0 * norm / 16777216.0, "rope b", i);
        }
    }
}

/* ---- SwiGLU -------------------------------------------------------------------- */

Test(ops_math, silu_at_zero_large_and_negative_inputs)
{
    cr_assert_eq(om_silu(0.0f), 0.0f);
    cr_assert_eq(om_silu(20.0f), 20.0f, "e^-20 vanishes next to 1 in f32");
    cr_assert_eq(om_silu(100.0f), 100.0f);
    float neg = om_silu(-100.0f);
    cr_assert(neg == 0.0f && signbit(neg), "silu(-100) = %g, want -0 (e^100 overflows)", neg);
    cr_assert(om_silu(-1000.0f) == 0.0f);
    /* silu(-x) = silu(x) - x */
    assert_close(om_silu(-1.0f), 1.0 / (1.0 + exp(1.0)) * -1.0, 4e-7, 0.0, "silu(-1)", 0);
    assert_close(om_silu(1.0f), 1.0 / (1.0 + exp(-1.0)), 4e-7, 0.0, "silu(1)", 0);
    /* against f64 over [-20, 20]: expf is within 1 ulp (glibc; CUDA's within
     * 2), one add, one divide: 4e-7 relative covers both */
    for (int i = 0; i < 20000; i++) {
        float x = uniform_in(-20, 20);
        double want = (double)x / (1.0 + exp(-(double)x));
        assert_close(om_silu(x), want, 4e-7, 1e-30, "silu", i);
    }
}

Test(ops_math, swiglu_is_silu_of_the_gate_times_up)
{
    for (int i = 0; i < 1000; i++) {
        float g = uniform_in(-10, 10), u = uniform_in(-3, 3);
        cr_assert_eq(om_swiglu(g, u), om_silu(g) * u, "[%d]", i);
    }
    cr_assert_eq(om_swiglu(0.0f, 5.0f), 0.0f);
}

/* GPT-OSS's clamped SwiGLU against transformers' GptOssExperts._apply_gate
 * in float64 (alpha 1.702, limit 7): one value inside both clamps, the
 * gate clamped above (9 -> 7), up clamped above (12 -> 7) and below (-8.5
 * -> -7), a very negative gate (no clamp below); limit 0 turns the clamp off. */
Test(ops_math, swiglu_oai_clamps_the_gate_above_and_up_both_ways)
{
    static const struct {
        float g, u;
        double want;
    } cases[] = {
        {0.5f, -0.3f, 0.24527190562446607},     {9.0f, 2.0f, 20.999859384909954},
        {-3.0f, 12.0f, -0.14457047766228776},   {2.0f, -8.5f, -11.61395173886525},
        {-20.0f, 1.0f, -6.586820482798749e-14},
    };
    for (int i = 0; i < 5; i++)
        assert_close(om_swiglu_oai(cases[i].g, cases[i].u, 1.702f, 7.0f), cases[i].want, 1e-6,
                     1e-30, "swiglu_oai", i);
    /* unclamped: (12 + 1) * 9 * sigmoid(1.702 * 9) */
    assert_close(om_swiglu_oai(9.0f, 12.0f, 1.702f, 0.0f), 13.0 * 9.0 / (1.0 + exp(-1.702 * 9.0)),
                 1e-6, 0.0, "swiglu_oai unclamped", 0);
}

/* ---- attention ------------------------------------------------------------------ */

Test(ops_math, attention_scale_and_window)
{
    cr_assert_eq(om_attention_scale(64), 0.125f);
    cr_assert_eq(om_attention_scale(128), 1.0f / sqrtf(128.0f));
    cr_assert_eq(om_attention_first(10, 0), 0, "window 0 is off");
    cr_assert_eq(om_attention_first(10, 4), 7, "the last 4 positions: 7, 8, 9, 10");
    cr_assert_eq(om_attention_first(3, 4), 0);
    cr_assert_eq(om_attention_first(2, 4), 0);
    cr_assert_eq(om_attention_first(9, 1), 9, "window 1 sees only itself");
}

enum { N_SCORES = 1000, VDIM = 8 };

/* softmax(scores) . V in f64, the reference. */
static void direct_softmax(const float *scores, int n, float v[][VDIM], double *out)
{
    double mx = -INFINITY, sum = 0.0;
    for (int p = 0; p < n; p++)
        mx = scores[p] > mx ? scores[p] : mx;
    for (int e = 0; e < VDIM; e++)
        out[e] = 0.0;
    for (int p = 0; p < n; p++) {
        double w = exp((double)scores[p] - mx);
        sum += w;
        for (int e = 0; e < VDIM; e++)
            out[e] += w * v[p][e];
    }
    for (int e = 0; e < VDIM; e++)
        out[e] /= sum;
}

/* The online softmax over scores[lo, hi), as forward.c's loop runs it. */
static om_online online_over(const float *scores, int lo, int hi, float v[][VDIM], float *acc)
{
    om_online s = om_online_start();
    for (int e = 0; e < VDIM; e++)
        acc[e] = 0.0f;
    for (int p = lo; p < hi; p++) {
        float f;
        if (om_online_raise(&s, scores[p], &f))
            for (int e = 0; e < VDIM; e++)
                acc[e] *= f;
        float w = om_online_weight(&s, scores[p]);
        for (int e = 0; e < VDIM; e++)
            acc[e] = om_online_acc(acc[e], w, v[p][e]);
    }
    return s;
}

static float scores[N_SCORES], values[N_SCORES][VDIM];

static void random_scores(double spread)
{
    for (int p = 0; p < N_SCORES; p++) {
        scores[p] = uniform_in(-spread, spread);
        for (int e = 0; e < VDIM; e++)
            values[p][e] = uniform_in(-1, 1);
    }
    /* a rising run, so the max is raised many times */
    for (int p = 100; p < 200; p++)
        scores[p] = (float)(p - 100) * 0.25f;
}

/* Tolerance of an f32 online softmax of 1000 positions against f64: each
 * weight is within 2 ulp of e^(s - max) and the sums run over 1000 terms
 * of magnitude <= 1 (values in [-1, 1]); 2e-5 absolute is ~300 ulp of the
 * result's scale, far above the observed ~1e-7 and far below what a wrong
 * rescale (errors of order 1) gives. */
#define SOFTMAX_TOL 2e-5

Test(ops_math, online_softmax_equals_a_direct_softmax)
{
    for (int trial = 0; trial < 8; trial++) {
        random_scores(trial < 4 ? 5.0 : 60.0);
        double want[VDIM];
        direct_softmax(scores, N_SCORES, values, want);
        float acc[VDIM];
        om_online s = online_over(scores, 0, N_SCORES, values, acc);
        for (int e = 0; e < VDIM; e++)
            assert_close(om_online_out(acc[e], s.sum), want[e], 0.0, SOFTMAX_TOL, "online", e);
    }
}

Test(ops_math, merged_partial_softmaxes_equal_a_direct_softmax)
{
    for (int trial = 0; trial < 8; trial++) {
        random_scores(trial < 4 ? 5.0 : 60.0);
        double want[VDIM];
        direct_softmax(scores, N_SCORES, values, want);
        /* uneven splits, one of them empty, merged in order */
        int cuts[] = {0, 1, 150, 150, 611, N_SCORES};
        int n_parts = (int)(sizeof cuts / sizeof *cuts) - 1;
        float acc[VDIM], part_acc[VDIM];
        om_online m = online_over(scores, cuts[0], cuts[1], values, acc);
        for (int k = 1; k < n_parts; k++) {
            om_online b = online_over(scores, cuts[k], cuts[k + 1], values, part_acc);
            float fa, fb;
            om_online_merge(&m, b, &fa, &fb);
            for (int e = 0; e < VDIM; e++)
                acc[e] = om_online_merge_acc(acc[e], fa, part_acc[e], fb);
        }
        for (int e = 0; e < VDIM; e++)
            assert_close(om_online_out(acc[e], m.sum), want[e], 0.0, SOFTMAX_TOL, "merged", e);
    }
}

Test(ops_math, online_softmax_edge_states)
{
    /* the first score from the start: factor e^-inf = 0, then weight 1 */
    om_online s = om_online_start();
    float f = -1.0f;
    cr_assert(om_online_raise(&s, 2.5f, &f));
    cr_assert(f == 0.0f && s.max == 2.5f && s.sum == 0.0f);
    cr_assert_eq(om_online_weight(&s, 2.5f), 1.0f);
    cr_assert_eq(s.sum, 1.0f);
    /* an equal or lower score does not raise, nor does NaN */
    f = -1.0f;
    cr_assert_not(om_online_raise(&s, 2.5f, &f));
    cr_assert_not(om_online_raise(&s, 1.0f, &f));
    cr_assert_not(om_online_raise(&s, nanf(""), &f));
    cr_assert_eq(f, -1.0f, "factor untouched when nothing rises");
    /* a higher score rescales the sum by e^(old - new) */
    cr_assert(om_online_raise(&s, 3.5f, &f));
    cr_assert_eq(f, expf(-1.0f));
    cr_assert_eq(s.sum, expf(-1.0f));

    /* merging empty states: two empties stay empty, without NaN */
    om_online a = om_online_start(), e = om_online_start();
    float fa, fb;
    om_online_merge(&a, e, &fa, &fb);
    cr_assert(fa == 1.0f && fb == 0.0f && a.max == -INFINITY && a.sum == 0.0f);
    /* an empty state into a full one contributes nothing, and the reverse */
    om_online full = {1.0f, 3.0f};
    om_online_merge(&full, e, &fa, &fb);
    cr_assert(fa == 1.0f && fb == 0.0f && full.max == 1.0f && full.sum == 3.0f);
    om_online empty = om_online_start();
    om_online_merge(&empty, (om_online){1.0f, 3.0f}, &fa, &fb);
    cr_assert(fa == 0.0f && fb == 1.0f && empty.max == 1.0f && empty.sum == 3.0f);
    /* two states rescale to the larger max */
    om_online x = {0.0f, 2.0f};
    om_online_merge(&x, (om_online){1.0f, 1.0f}, &fa, &fb);
    cr_assert(fa == expf(-1.0f) && fb == 1.0f && x.max == 1.0f);
    cr_assert_eq(x.sum, 2.0f * expf(-1.0f) + 1.0f);
    cr_assert_eq(om_online_merge_acc(2.0f, 0.5f, 3.0f, 0.25f), 1.75f);
}

/* ---- greedy ------------------------------------------------------------------------ */

/* The CPU sampler's greedy token for a copy of logits. */
static int32_t sampler_greedy(const float *logits, int32_t n)
{
    float *copy = malloc((size_t)n * sizeof *copy);
    cr_assert_not_null(copy);
    memcpy(copy, logits, (size_t)n * sizeof *copy);
    eng_sampling p;
    memset(&p, 0, sizeof p);
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    int32_t t = eng_sample(&s, copy, n, NULL);
    eng_sampler_free(&s);
    free(copy);
    return t;
}

Test(ops_math, greedy_takes_the_lowest_id_on_ties_and_ranks_nan_lowest)
{
    float nan = nanf(""), inf = INFINITY;
    struct {
        float v[4];
        int32_t n, want;
    } cases[] = {
        {{1, 3, 3, 2}, 4, 1},           /* tie: the lower id */
        {{nan, -inf, nan, 0}, 3, 1},    /* nothing above -inf: the lowest non-NaN */
        {{nan, nan, nan, nan}, 4, 0},   /* all NaN: 0 */
        {{-0.0f, 0.0f, -1, -1}, 4, 0},  /* -0 ties +0 */
        {{0.0f, -0.0f, -1, -1}, 4, 0},  /* either way round */
        {{nan, 5, inf, inf}, 4, 2},     /* +inf, the first of them */
        {{-inf, -inf, -inf, 0}, 3, 0},  /* all -inf: the lowest id */
        {{nan, -5, nan, -4}, 4, 3},     /* NaN is never the max */
        {{7, nan, nan, nan}, 4, 0},     /* and never displaces one */
        {{-1e38f, nan, -inf, 0}, 3, 0}, /* a finite value above -inf */
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        cr_assert_eq(om_greedy_argmax(cases[c].v, cases[c].n), cases[c].want, "case %zu", c);
        cr_assert_eq(sampler_greedy(cases[c].v, cases[c].n), cases[c].want,
                     "case %zu: the sampler disagrees with this test's expectation", c);
    }
    cr_assert_not(om_greedy_better(1.0f, 4, 1.0f, 2));
    cr_assert(om_greedy_better(1.0f, 2, 1.0f, 4));
    cr_assert(om_greedy_better(-INFINITY, 9, nan, 0));
    cr_assert(om_greedy_better(nan, 0, nan, 9));
}

Test(ops_math, greedy_in_any_reduction_order_equals_the_sampler)
{
    /* random logits from a few values (many ties), with NaN, +-inf and
     * -0; a tree reduction in a shuffled order (as a GPU block reduces)
     * must pick the sampler's token */
    enum { N = 300 };
    float pool[] = {0.0f, -0.0f, 1.0f, 1.0f, -2.0f, 3.5f, nanf(""), INFINITY, -INFINITY};
    int32_t order[N];
    float logits[N];
    for (int trial = 0; trial < 500; trial++) {
        int32_t n = 1 + (int32_t)(uniform() * N);
        for (int32_t i = 0; i < n; i++) {
            /* every fifth trial only NaN and -inf */
            if (trial % 5 == 0)
                logits[i] = uniform() < 0.5 ? pool[6] : pool[8];
            else
                logits[i] = pool[(int)(uniform() * 9)];
            order[i] = i;
        }
        int32_t want = sampler_greedy(logits, n);
        cr_assert_eq(om_greedy_argmax(logits, n), want, "trial %d: scan", trial);
        for (int32_t i = n - 1; i > 0; i--) {
            int32_t j = (int32_t)(uniform() * (i + 1));
            int32_t t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        /* pairwise tree over the shuffled ids */
        for (int32_t width = n; width > 1; width = (width + 1) / 2) {
            for (int32_t i = 0; i < width / 2; i++) {
                int32_t a = order[2 * i], b = order[2 * i + 1];
                order[i] = om_greedy_better(logits[a], a, logits[b], b) ? a : b;
            }
            if (width % 2)
                order[width / 2] = order[width - 1];
        }
        cr_assert_eq(order[0], want, "trial %d: tree reduction", trial);
    }
}

Test(ops_math, moe_route_picks_top_k_lower_index_first_and_renormalizes)
{
    /* logits ln(1), ln(4), ln(2), ln(4), ln(1): probabilities 1/12, 4/12,
     * 2/12, 4/12, 1/12; top-3 is experts 1 and 3 (equal: 1 first), then 2 */
    float p[5] = {0.0f, logf(4.0f), logf(2.0f), logf(4.0f), 0.0f}, q[5];
    memcpy(q, p, sizeof q);
    int32_t pick[3];
    float w[3];
    om_moe_route(p, 5, 3, false, pick, w);
    cr_assert(pick[0] == 1 && pick[1] == 3 && pick[2] == 2, "picks %d %d %d", pick[0], pick[1],
              pick[2]);
    cr_assert_float_eq(w[0], 4.0f / 12.0f, 1e-6f);
    cr_assert_float_eq(w[2], 2.0f / 12.0f, 1e-6f);
    cr_assert_eq(w[0], p[1], "the weights are the softmax probabilities themselves");
    /* renormalized: the chosen probabilities over their sum (10/12) */
    om_moe_route(q, 5, 3, true, pick, w);
    cr_assert_float_eq(w[0], 0.4f, 1e-6f);
    cr_assert_float_eq(w[1], 0.4f, 1e-6f);
    cr_assert_float_eq(w[2], 0.2f, 1e-6f);
}

Test(ops_math, moe_route_topk_softmax_adds_the_bias_then_weighs_the_k_alone)
{
    /* logits 0, 3, 1, 2 plus bias 0, -3, 1, 0: 0, 0, 2, 2; top-2 is
     * experts 2 and 3 (equal: 2 first), each weighed 1/2 by the softmax
     * over those two alone (the others' logits take no part) */
    float p[4] = {0.0f, 3.0f, 1.0f, 2.0f}, bias[4] = {0.0f, -3.0f, 1.0f, 0.0f};
    int32_t pick[2];
    float w[2];
    om_moe_route_topk_softmax(p, bias, 4, 2, pick, w);
    cr_assert(pick[0] == 2 && pick[1] == 3, "picks %d %d", pick[0], pick[1]);
    cr_assert_eq(w[0], 0.5f);
    cr_assert_eq(w[1], 0.5f);
    /* no bias: experts 1 and 3, weighed e^1 / (e^1 + 1) and 1 / (e^1 + 1) */
    float q[4] = {0.0f, 3.0f, 1.0f, 2.0f};
    om_moe_route_topk_softmax(q, NULL, 4, 2, pick, w);
    cr_assert(pick[0] == 1 && pick[1] == 3, "picks %d %d", pick[0], pick[1]);
    cr_assert_eq(w[0], (float)(1.0 / (1.0 + exp(-1.0))));
    cr_assert_eq(w[1], (float)(exp(-1.0) / (1.0 + exp(-1.0))));
}

Test(ops_math, attention_sink_adds_a_denominator_term_with_no_value)
{
    /* scores 0 and ln 2 over values 1 and 4, sink ln 5: weights 1, 2 and 5,
     * so the output is (1 * 1 + 2 * 4) / 8; the sink raises the max */
    float sc[2] = {0.0f, logf(2.0f)}, val[2] = {1.0f, 4.0f};
    om_online s = om_online_start();
    float acc = 0.0f, f;
    for (int i = 0; i < 2; i++) {
        if (om_online_raise(&s, sc[i], &f))
            acc *= f;
        acc = om_online_acc(acc, om_online_weight(&s, sc[i]), val[i]);
    }
    acc *= om_online_sink(&s, logf(5.0f));
    cr_assert_float_eq(om_online_out(acc, s.sum), 9.0f / 8.0f, 1e-6f);
    /* a sink below the max: factor exactly 1, only the sum grows (1 + e^-1) */
    om_online t = {0.0f, 1.0f};
    cr_assert_eq(om_online_sink(&t, -1.0f), 1.0f);
    cr_assert_float_eq(t.sum, 1.0f + expf(-1.0f), 1e-7f);
}

Test(ops_math, moe_weighted_add_rounds_the_product_first)
{
    /* (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 in f32; -1 plus
     * it is then 2^-11, where a fused multiply-add would keep the 2^-24:
     * the CPU and the GPU add experts' outputs with the same bits */
    float y = 1.0f + 0x1p-12f;
    cr_assert_eq(om_weighted_add(-1.0f, y, y), 0x1p-11f);
}

/* Gated DeltaNet's steps (linear_cpu.c and qt_cuda_linear.cu): each the
 * f32 expression transformers evaluates, in its order, so a change to the
 * shared arithmetic shows here before it moves either backend. */
Test(ops_math, delta_net_gates_softplus_threshold_and_l2norm_factor)
{
    for (int i = 0; i < 200; i++) {
        float x = (float)((uniform() - 0.5) * 60.0);
        cr_assert(om_sigmoid(x) == 1.0f / (1.0f + expf(-x)), "sigmoid(%g)", (double)x);
        float sp = x > 20.0f ? x : log1pf(expf(x));
        cr_assert(om_softplus(x) == sp, "softplus(%g)", (double)x);
        cr_assert(om_delta_log_decay(-0.5f, x, 0.25f) == -0.5f * om_softplus(x + 0.25f));
    }
    /* torch's threshold: x itself above 20, log1p(e^x) at and below it */
    cr_assert(om_softplus(20.5f) == 20.5f);
    cr_assert(om_softplus(20.0f) == log1pf(expf(20.0f)));
    cr_assert(om_softplus(0.0f) == log1pf(1.0f));
    /* the epsilon inside the root, f times the rounded factor */
    cr_assert(om_l2norm_factor(4.0, 1.0f) == (float)(1.0 / sqrt(4.0 + 1e-6)));
    cr_assert(om_l2norm_factor(4.0, 0.25f) == (float)(1.0 / sqrt(4.0 + 1e-6)) * 0.25f);
    cr_assert(om_l2norm_factor(0.0, 1.0f) == 1000.0f, "1 / sqrt(1e-6)");
}

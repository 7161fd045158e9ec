/*
 * test_sampler.c - the sampler and the stop strings (engine/scheduler/sampler.c).
 *
 * Sampling: greedy is the argmax with the lowest id on ties and uses no
 * randomness; temperature, top-k and top-p draw with the frequencies of the
 * exact renormalised probabilities, computed here in double from first
 * principles (20000 draws from a fixed seed, each frequency within 0.015 of
 * its probability: more than four standard errors, sqrt(p(1-p)/20000) <=
 * 0.0036, and tokens outside the kept set never drawn at all); top-k ties
 * keep the lower ids and top-p ties likewise; top_k 1 is greedy and a tiny
 * top_p keeps the top token only; the same seed gives the same tokens
 * whatever other sequences draw in between, another seed other tokens; the
 * repetition penalty divides positive and multiplies negative logits of
 * every distinct token seen, prompt included; presence and frequency
 * penalties subtract exactly what OpenAI's formula says over generated
 * tokens only, after the bias and the repetition penalty (vLLM's order);
 * a bias of -100 bans; min_tokens holds EOS back; the backend's fast paths
 * are off while any of them could act; parameter checks name the
 * field and the value; NaN and infinite logits; a 150k vocabulary with
 * every filter draws only tokens the reference keeps.
 *
 * Stop strings: held across feeds and never emitted, partial matches let
 * go, overlapping stop strings, a stop at the very start, whole UTF-8
 * characters held, flush, feeds after a stop, and random texts cut into
 * random feeds matching a byte-by-byte reference.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "sample_math.h"
#include "test_util.h"

/* --- helpers ---------------------------------------------------------------- */

#define DRAWS     20000
#define TOLERANCE 0.015

static void *new_scratch(int32_t vocab)
{
    void *p = malloc((size_t)vocab * (sizeof(float) + sizeof(int32_t)));
    cr_assert(p);
    return p;
}

static void init_sampler(eng_sampler *s, const eng_sampling *p)
{
    cr_assert_eq(eng_sampler_init(s, p, NULL, 0), QL_OK);
}

/* One draw from a copy of logits (eng_sample changes them in place). */
static int32_t sample_copy(eng_sampler *s, const float *logits, int32_t vocab, float *work,
                           void *scratch)
{
    memcpy(work, logits, (size_t)vocab * sizeof *work);
    int32_t t = eng_sample(s, work, vocab, scratch);
    cr_assert(t >= 0 && t < vocab, "token %d outside the vocabulary of %d", t, vocab);
    return t;
}

static const float *g_order_logits;

/* logit descending, id ascending: the order top-k and top-p rank tokens */
static int by_logit_then_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    float lx = g_order_logits[x], ly = g_order_logits[y];
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return (x > y) - (x < y);
}

/*
 * The distribution HF's warpers give, in double: logits / T, keep the top_k
 * best (lower id on ties), softmax, keep the smallest prefix reaching top_p,
 * renormalise. probs[vocab] receives it; returns how many tokens are kept.
 */
static int32_t reference_probs(const float *logits, int32_t vocab, double temperature,
                               int32_t top_k, double top_p, double *probs)
{
    int32_t *order = malloc((size_t)vocab * sizeof *order);
    cr_assert(order);
    for (int32_t i = 0; i < vocab; i++)
        order[i] = i;
    g_order_logits = logits;
    qsort(order, (size_t)vocab, sizeof *order, by_logit_then_id);
    int32_t n = top_k > 0 && top_k < vocab ? top_k : vocab;
    double max = logits[order[0]], total = 0;
    for (int32_t i = 0; i < vocab; i++)
        probs[i] = 0;
    for (int32_t r = 0; r < n; r++)
        total += probs[order[r]] = exp(((double)logits[order[r]] - max) / temperature);
    if (top_p > 0 && top_p < 1) {
        double cum = 0;
        int32_t keep = 0;
        while (keep < n) {
            cum += probs[order[keep++]] / total;
            if (cum >= top_p)
                break;
        }
        for (int32_t r = keep; r < n; r++)
            probs[order[r]] = 0;
        n = keep;
    }
    total = 0;
    for (int32_t r = 0; r < n; r++)
        total += probs[order[r]];
    for (int32_t r = 0; r < n; r++)
        probs[order[r]] /= total;
    free(order);
    return n;
}

/* DRAWS draws with p; every frequency within TOLERANCE of the reference,
 * and no token the reference drops ever drawn. */
static void expect_distribution(const eng_sampling *p, const float *logits, int32_t vocab)
{
    double *expected = malloc((size_t)vocab * sizeof *expected);
    int *counts = calloc((size_t)vocab, sizeof *counts);
    float *work = malloc((size_t)vocab * sizeof *work);
    void *scratch = new_scratch(vocab);
    cr_assert(expected && counts && work);
    reference_probs(logits, vocab, p->temperature, p->top_k, p->top_p, expected);
    eng_sampler s;
    init_sampler(&s, p);
    for (int d = 0; d < DRAWS; d++)
        counts[sample_copy(&s, logits, vocab, work, scratch)]++;
    for (int32_t i = 0; i < vocab; i++) {
        double freq = (double)counts[i] / DRAWS;
        if (expected[i] == 0)
            cr_assert_eq(counts[i], 0, "token %d is outside the kept set but was drawn %d times", i,
                         counts[i]);
        else
            cr_assert(fabs(freq - expected[i]) <= TOLERANCE,
                      "token %d: frequency %.4f, probability %.4f (T %g, top_k %d, top_p %g)", i,
                      freq, expected[i], (double)p->temperature, p->top_k, (double)p->top_p);
    }
    eng_sampler_free(&s);
    free(expected);
    free(counts);
    free(work);
    free(scratch);
}

static const float small_logits[10] = {1.0f, 2.5f, -0.5f, 2.0f, 0.0f,
                                       3.0f, 1.5f, -2.0f, 2.5f, 0.5f};

/* --- greedy -------------------------------------------------------------------- */

Test(sampler, greedy_picks_argmax_lowest_id_on_ties)
{
    eng_sampling p = {0};
    eng_sampler s;
    init_sampler(&s, &p);
    float a[6] = {0.5f, 3.0f, -1.0f, 7.0f, 7.0f, 2.0f};
    cr_assert_eq(eng_sample(&s, a, 6, NULL), 3);
    float b[4] = {-5.0f, -1.0f, -1.0f, -3.0f};
    cr_assert_eq(eng_sample(&s, b, 4, NULL), 1);
    float c[1] = {-100.0f};
    cr_assert_eq(eng_sample(&s, c, 1, NULL), 0);
    eng_sampler_free(&s);
}

Test(sampler, greedy_ignores_top_k_top_p_and_draws_nothing)
{
    eng_sampling p = {.temperature = 0, .top_k = 3, .top_p = 0.1f, .seed = 9};
    eng_sampler s;
    init_sampler(&s, &p);
    uint64_t before[4];
    memcpy(before, s.rng, sizeof before);
    void *scratch = new_scratch(10);
    float work[10];
    for (int i = 0; i < 5; i++)
        cr_assert_eq(sample_copy(&s, small_logits, 10, work, scratch), 5);
    cr_assert(memcmp(before, s.rng, sizeof before) == 0, "greedy advanced the random stream");
    eng_sampler_free(&s);
    free(scratch);
}

/* --- distributions ---------------------------------------------------------------- */

Test(sampler, temperature_draws_the_softmax)
{
    eng_sampling p = {.temperature = 1.0f, .seed = 1};
    expect_distribution(&p, small_logits, 10);
    p.temperature = 0.6f;
    p.seed = 2;
    expect_distribution(&p, small_logits, 10);
    p.temperature = 2.5f;
    p.seed = 3;
    expect_distribution(&p, small_logits, 10);
}

Test(sampler, top_k_draws_the_renormalised_best_k)
{
    eng_sampling p = {.temperature = 1.0f, .top_k = 4, .seed = 4};
    expect_distribution(&p, small_logits, 10);
    p.top_k = 2; /* 5 and the tie 1/8 at 2.5: the lower id (1) stays */
    p.seed = 5;
    expect_distribution(&p, small_logits, 10);
    p.top_k = 10; /* the whole vocabulary: off */
    expect_distribution(&p, small_logits, 10);
}

Test(sampler, top_p_draws_the_renormalised_nucleus)
{
    eng_sampling p = {.temperature = 1.0f, .top_p = 0.7f, .seed = 6};
    expect_distribution(&p, small_logits, 10);
    p.top_p = 0.9f;
    p.temperature = 0.8f;
    p.seed = 7;
    expect_distribution(&p, small_logits, 10);
    p.top_p = 1.0f; /* off */
    expect_distribution(&p, small_logits, 10);
}

Test(sampler, top_k_then_top_p)
{
    eng_sampling p = {.temperature = 1.3f, .top_k = 5, .top_p = 0.8f, .seed = 8};
    expect_distribution(&p, small_logits, 10);
}

Test(sampler, top_k_ties_keep_the_lower_ids)
{
    float flat[10];
    for (int i = 0; i < 10; i++)
        flat[i] = 1.25f;
    eng_sampling p = {.temperature = 1.0f, .top_k = 3, .seed = 10};
    expect_distribution(&p, flat, 10); /* 1/3 each on ids 0, 1, 2; none elsewhere */
}

Test(sampler, top_p_ties_keep_the_lower_ids)
{
    /* four equal tokens and top_p 0.5: two of them reach exactly 0.5 and
     * suffice (HF removes what lies at or below 1 - top_p) */
    const float four[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    eng_sampling q = {.temperature = 1.0f, .top_p = 0.5f, .seed = 21};
    expect_distribution(&q, four, 4);

    /* 1000 equal logits: the nucleus of 0.5 is exactly ids 0..499, found by
     * the selection inside one bucket that holds everything */
    enum { V = 1000 };
    float *flat = malloc(V * sizeof *flat), *work = malloc(V * sizeof *work);
    void *scratch = new_scratch(V);
    for (int i = 0; i < V; i++)
        flat[i] = -3.0f;
    eng_sampling p = {.temperature = 0.7f, .top_p = 0.5f, .seed = 11};
    eng_sampler s;
    init_sampler(&s, &p);
    int32_t highest = 0;
    for (int d = 0; d < 5000; d++) {
        int32_t t = sample_copy(&s, flat, V, work, scratch);
        cr_assert(t < 500, "token %d is outside the nucleus 0..499", t);
        if (t > highest)
            highest = t;
    }
    cr_assert(highest > 490, "the nucleus should reach id 499; highest drawn %d", highest);
    eng_sampler_free(&s);
    free(flat);
    free(work);
    free(scratch);
}

Test(sampler, top_p_exact_ties_at_every_size)
{
    /* n equal tokens, top_p 0.5: exactly the n/2 lowest ids, whichever
     * path of the selection the cut falls on */
    float flat[80], work[80];
    void *scratch = new_scratch(80);
    for (int i = 0; i < 80; i++)
        flat[i] = 2.0f;
    for (int32_t n = 18; n <= 80; n += 2) {
        eng_sampling p = {.temperature = 1.0f, .top_p = 0.5f, .seed = (uint64_t)n};
        eng_sampler s;
        init_sampler(&s, &p);
        for (int d = 0; d < 400; d++) {
            int32_t t = sample_copy(&s, flat, n, work, scratch);
            cr_assert(t < n / 2, "%d equal tokens: token %d is past the nucleus of %d", n, t,
                      n / 2);
        }
        eng_sampler_free(&s);
    }
    /* the nucleus ending exactly on the first pivot (the median id): n/2 + 1
     * of n, top_p exact in float */
    for (int32_t n = 32; n <= 64; n *= 2) {
        eng_sampling p = {.temperature = 1.0f, .top_p = (float)(n / 2 + 1) / (float)n, .seed = 7};
        eng_sampler s;
        init_sampler(&s, &p);
        for (int d = 0; d < 800; d++) {
            int32_t t = sample_copy(&s, flat, n, work, scratch);
            cr_assert(t <= n / 2, "%d equal tokens, top_p %g: token %d is past the nucleus", n,
                      (double)p.top_p, t);
        }
        eng_sampler_free(&s);
    }
    free(scratch);
}

Test(sampler, top_p_orders_weights_one_ulp_apart)
{
    /* token 0's weight lies 1, 8, 32, 2048 and 8192 float steps under token
     * 1's (the lowest bit of each refinement level of the selection, and
     * more): with top_p 0.5, token 1 alone suffices, though its id is higher
     * (HF likewise keeps only the larger of [0.4999..., 0.5000...]) */
    const float below_one[5] = {1.0f - 0x1p-24f, 1.0f - 0x1p-21f, 1.0f - 0x1p-19f, 1.0f - 0x1p-13f,
                                1.0f - 0x1p-11f};
    void *scratch = new_scratch(2);
    float work[2];
    for (int c = 0; c < 5; c++) {
        const float l[2] = {below_one[c], 1.0f};
        eng_sampling p = {.temperature = 1.0f, .top_p = 0.5f, .seed = (uint64_t)c};
        eng_sampler s;
        init_sampler(&s, &p);
        for (int d = 0; d < 200; d++)
            cr_assert_eq(sample_copy(&s, l, 2, work, scratch), 1, "case %d", c);
        eng_sampler_free(&s);
    }
    free(scratch);
}

Test(sampler, top_k_1_is_greedy)
{
    enum { V = 500 };
    float logits[V], work[V];
    void *scratch = new_scratch(V);
    uint64_t r = 12;
    eng_sampling p = {.temperature = 1.3f, .top_k = 1, .seed = 12};
    eng_sampler s, g;
    eng_sampling greedy = {0};
    init_sampler(&s, &p);
    init_sampler(&g, &greedy);
    for (int round = 0; round < 50; round++) {
        for (int i = 0; i < V; i++)
            logits[i] = 4 * test_normal(&r);
        if (round % 5 == 0) /* a tie for first place: the lower id */
            logits[400] = logits[17] = 100.0f;
        int32_t want = sample_copy(&g, logits, V, work, scratch);
        cr_assert_eq(sample_copy(&s, logits, V, work, scratch), want);
    }
    eng_sampler_free(&s);
    eng_sampler_free(&g);
    free(scratch);
}

Test(sampler, tiny_top_p_keeps_only_the_top_token)
{
    eng_sampling p = {.temperature = 5.0f, .top_p = 1e-6f, .seed = 13};
    eng_sampler s;
    init_sampler(&s, &p);
    void *scratch = new_scratch(10);
    float work[10];
    for (int d = 0; d < 2000; d++)
        cr_assert_eq(sample_copy(&s, small_logits, 10, work, scratch), 5);
    eng_sampler_free(&s);
    free(scratch);
}

/* --- reproducibility ----------------------------------------------------------------- */

static void draw_sequence(uint64_t seed, int32_t *out, int n, bool interleave)
{
    enum { V = 64 };
    float logits[V], other[V], work[V];
    uint64_t r = 99;
    for (int i = 0; i < V; i++)
        logits[i] = test_normal(&r);
    for (int i = 0; i < V; i++)
        other[i] = 3 * test_normal(&r);
    void *scratch = new_scratch(V);
    eng_sampling p = {.temperature = 1.0f, .top_p = 0.95f, .seed = seed};
    eng_sampling q = {.temperature = 0.5f, .top_k = 7, .seed = 12345};
    eng_sampler s, neighbour;
    init_sampler(&s, &p);
    init_sampler(&neighbour, &q);
    for (int i = 0; i < n; i++) {
        if (interleave) /* another sequence of the batch, drawing in between */
            for (int j = 0; j <= i % 3; j++)
                sample_copy(&neighbour, other, V, work, scratch);
        out[i] = sample_copy(&s, logits, V, work, scratch);
    }
    eng_sampler_free(&s);
    eng_sampler_free(&neighbour);
    free(scratch);
}

Test(sampler, same_seed_same_tokens_whatever_else_is_in_the_batch)
{
    int32_t a[200], b[200], c[200];
    draw_sequence(42, a, 200, false);
    draw_sequence(42, b, 200, false);
    draw_sequence(42, c, 200, true);
    cr_assert(memcmp(a, b, sizeof a) == 0, "the same seed gave different tokens");
    cr_assert(memcmp(a, c, sizeof a) == 0, "another sequence's draws changed this one's tokens");
}

/* The stream written out again: splitmix64 fills xoshiro256**'s state from
 * the seed; a uniform is the top 53 bits. */
static uint64_t ref_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double ref_uniform(uint64_t st[4])
{
    uint64_t x = st[1] * 5;
    uint64_t result = ((x << 7) | (x >> 57)) * 9;
    uint64_t t = st[1] << 17;
    st[2] ^= st[0];
    st[3] ^= st[1];
    st[1] ^= st[2];
    st[0] ^= st[3];
    st[2] ^= t;
    st[3] = (st[3] << 45) | (st[3] >> 19);
    return (double)(result >> 11) * 0x1.0p-53;
}

Test(sampler, one_xoshiro_draw_per_sampled_token)
{
    /* two equal tokens: the token is 0 exactly when the uniform is under
     * 1/2, so the tokens spell out the stream. Calls with nothing to choose
     * (all NaN, one +inf) still take their draw; greedy takes none. */
    uint64_t seed = 0x5eed, x = seed, st[4];
    for (int i = 0; i < 4; i++)
        st[i] = ref_splitmix(&x);
    eng_sampling p = {.temperature = 0.9f, .seed = seed};
    eng_sampler s;
    init_sampler(&s, &p);
    cr_assert(memcmp(s.rng, st, sizeof st) == 0, "state not seeded by splitmix64");
    void *scratch = new_scratch(2);
    float work[2];
    const float even[2] = {1.0f, 1.0f}, nan2[2] = {NAN, NAN}, inf2[2] = {INFINITY, 0.0f};
    for (int i = 0; i < 300; i++) {
        if (i % 7 == 3) {
            cr_assert_eq(sample_copy(&s, nan2, 2, work, scratch), 0);
            ref_uniform(st);
        } else if (i % 7 == 5) {
            cr_assert_eq(sample_copy(&s, inf2, 2, work, scratch), 0);
            ref_uniform(st);
        } else {
            int32_t want = ref_uniform(st) < 0.5 ? 0 : 1;
            cr_assert_eq(sample_copy(&s, even, 2, work, scratch), want, "draw %d", i);
        }
    }
    eng_sampler_free(&s);
    free(scratch);
}

Test(sampler, different_seeds_different_tokens)
{
    int32_t a[200], b[200];
    draw_sequence(42, a, 200, false);
    draw_sequence(43, b, 200, false);
    int differ = 0;
    for (int i = 0; i < 200; i++)
        differ += a[i] != b[i];
    cr_assert(differ > 50, "seeds 42 and 43 differ at %d of 200 tokens", differ);
}

/* --- repetition penalty ------------------------------------------------------------ */

Test(sampler, repetition_penalty_divides_positive_multiplies_negative)
{
    /* the prompt repeats 1, names an id past the vocabulary and a negative
     * one: each distinct seen token is penalised once, the others ignored */
    const int32_t prompt[] = {0, 1, 1, 4, 5, 1, 999999, -5};
    eng_sampling p = {.repetition_penalty = 2.0f};
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, prompt, 8), QL_OK);
    cr_assert_eq(s.n_seen, 5, "distinct non-negative ids seen: %zu", s.n_seen);

    float l[6] = {2.0f, -2.0f, 1.5f, 0.5f, 0.0f, 0.25f};
    cr_assert_eq(eng_sample(&s, l, 6, NULL), 2);
    const float want[6] = {1.0f, -4.0f, 1.5f, 0.5f, 0.0f, 0.125f};
    for (int i = 0; i < 6; i++)
        cr_assert(same_bits(l[i], want[i]), "logit %d: %g, want %g", i, (double)l[i],
                  (double)want[i]);

    /* 2 was generated: now it is penalised too */
    float m[6] = {2.0f, -2.0f, 1.5f, 0.5f, 0.0f, 0.25f};
    cr_assert_eq(eng_sample(&s, m, 6, NULL), 0);
    cr_assert(same_bits(m[2], 0.75f), "generated token's logit %g, want 0.75", (double)m[2]);
    eng_sampler_free(&s);

    /* a penalty under 1 favours what was seen */
    p.repetition_penalty = 0.5f;
    cr_assert_eq(eng_sampler_init(&s, &p, prompt, 2), QL_OK);
    float e[3] = {1.0f, -1.0f, 1.9f};
    cr_assert_eq(eng_sample(&s, e, 3, NULL), 0);
    cr_assert(same_bits(e[0], 2.0f) && same_bits(e[1], -0.5f) && same_bits(e[2], 1.9f));
    eng_sampler_free(&s);
}

Test(sampler, repetition_penalty_off_at_0_and_1)
{
    const int32_t prompt[] = {0};
    for (int k = 0; k < 2; k++) {
        eng_sampling p = {.repetition_penalty = (float)k};
        eng_sampler s;
        cr_assert_eq(eng_sampler_init(&s, &p, prompt, 1), QL_OK);
        float l[2] = {3.0f, 2.0f};
        cr_assert_eq(eng_sample(&s, l, 2, NULL), 0);
        cr_assert(same_bits(l[0], 3.0f));
        eng_sampler_free(&s);
    }
}

/* --- parameter checks -------------------------------------------------------------- */

static void expect_refused(eng_sampling p, const char *field, const char *value)
{
    char msg[256] = "";
    cr_assert_eq(eng_sampling_check(&p, msg, sizeof msg), QL_EINVAL, "%s %s was accepted", field,
                 value);
    cr_assert(strstr(msg, field) && strstr(msg, value), "message \"%s\" should name %s and %s", msg,
              field, value);
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_EINVAL);
    eng_sampler_free(&s);
}

Test(sampler, check_refuses_each_bad_field_by_name)
{
    eng_sampling ok = {.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .repetition_penalty = 1.1f};
    char msg[256];
    cr_assert_eq(eng_sampling_check(&ok, msg, sizeof msg), QL_OK);
    eng_sampling zero = {0};
    cr_assert_eq(eng_sampling_check(&zero, msg, sizeof msg), QL_OK);
    eng_sampling edge = {.temperature = 1e-6f, .top_p = 1.0f, .repetition_penalty = 1e-3f};
    cr_assert_eq(eng_sampling_check(&edge, msg, sizeof msg), QL_OK);

    eng_sampling p = ok;
    p.temperature = -1.0f;
    expect_refused(p, "temperature", "-1");
    p.temperature = NAN;
    expect_refused(p, "temperature", "nan");
    p.temperature = INFINITY;
    expect_refused(p, "temperature", "inf");
    p = ok;
    p.top_k = -3;
    expect_refused(p, "top_k", "-3");
    p = ok;
    p.top_p = 1.5f;
    expect_refused(p, "top_p", "1.5");
    p.top_p = -0.25f;
    expect_refused(p, "top_p", "-0.25");
    p.top_p = NAN;
    expect_refused(p, "top_p", "nan");
    p = ok;
    p.repetition_penalty = -1.0f;
    expect_refused(p, "repetition_penalty", "-1");
    p.repetition_penalty = INFINITY;
    expect_refused(p, "repetition_penalty", "inf");
    p.repetition_penalty = NAN;
    expect_refused(p, "repetition_penalty", "nan");
}

/* --- presence and frequency penalties, logit bias, min_tokens ----------------------- */

static void expect_logits(const float *got, const float *want, int n)
{
    for (int i = 0; i < n; i++)
        cr_assert(same_bits(got[i], want[i]), "logit %d: %g, want %g", i, (double)got[i],
                  (double)want[i]);
}

Test(sampler, presence_and_frequency_penalties_count_generated_tokens_only)
{
    /* the prompt names 0 and 1: they are not penalised; 2 was generated
     * twice, 3 once: logit -= 0.5 * c + 0.25 * (c > 0) */
    const int32_t prompt[] = {0, 1, 1};
    eng_sampling p = {.frequency_penalty = 0.5f, .presence_penalty = 0.25f};
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, prompt, 3), QL_OK);
    eng_sampler_record(&s, 2);
    eng_sampler_record(&s, 3);
    eng_sampler_record(&s, 2);
    float l[5] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    cr_assert_eq(eng_sample(&s, l, 5, NULL), 0);
    const float want[5] = {1.0f, 1.0f, -0.25f, 0.25f, 1.0f};
    expect_logits(l, want, 5);
    cr_assert_eq(s.n_counts, 3, "distinct generated tokens: %zu (2, 3 and the 0 just chosen)",
                 s.n_counts);

    /* negative penalties favour what was generated: 0 now has c = 1 */
    eng_sampler_free(&s);
    p = (eng_sampling){.frequency_penalty = -1.0f, .presence_penalty = -0.5f};
    cr_assert_eq(eng_sampler_init(&s, &p, prompt, 3), QL_OK);
    eng_sampler_record(&s, 4);
    float m[5] = {1.0f, 2.0f, 0.0f, 0.0f, 0.75f};
    cr_assert_eq(eng_sample(&s, m, 5, NULL), 4);
    const float want_m[5] = {1.0f, 2.0f, 0.0f, 0.0f, 2.25f};
    expect_logits(m, want_m, 5);
    eng_sampler_free(&s);
}

Test(sampler, penalties_apply_after_the_bias_and_the_repetition_penalty)
{
    /* vLLM's order: bias, then repetition (prompt and generated), then
     * frequency and presence (generated). Token 1: (3 + 1) / 2 - 0.5 * 1 -
     * 0.25 = 1.25; token 0 (prompt only): -1 * 2 = -2; token 2: 0.5 - 4 */
    const int32_t prompt[] = {0};
    const eng_logit_bias bias[] = {{.token = 1, .bias = 1.0f}, {.token = 2, .bias = -4.0f}};
    eng_sampling p = {.repetition_penalty = 2.0f,
                      .frequency_penalty = 0.5f,
                      .presence_penalty = 0.25f,
                      .logit_bias = bias,
                      .n_logit_bias = 2};
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, prompt, 1), QL_OK);
    eng_sampler_record(&s, 1);
    float l[4] = {-1.0f, 3.0f, 0.5f, 1.0f};
    cr_assert_eq(eng_sample(&s, l, 4, NULL), 1);
    const float want[4] = {-2.0f, 1.25f, -3.5f, 1.0f};
    expect_logits(l, want, 4);
    eng_sampler_free(&s);
}

Test(sampler, logit_bias_is_copied_and_minus_100_bans)
{
    /* token 1 leads by far; -100 keeps it out of greedy choices and of
     * 2000 temperature-1 draws (its weight e^-60 of the others'); an id
     * past the vocabulary is ignored; the caller's array may go at once */
    eng_logit_bias bias[] = {{.token = 1, .bias = -100.0f}, {.token = 70000, .bias = 100.0f}};
    eng_sampling p = {.logit_bias = bias, .n_logit_bias = 2};
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    bias[0].bias = 0.0f;
    const float logits[4] = {0.0f, 40.0f, 0.5f, -0.5f};
    float work[4];
    for (int i = 0; i < 20; i++)
        cr_assert_eq(sample_copy(&s, logits, 4, work, NULL), 2);
    cr_assert(same_bits(work[1], -60.0f), "banned logit %g, want -60", (double)work[1]);
    eng_sampler_free(&s);

    bias[0].bias = -100.0f;
    p.temperature = 1.0f;
    p.seed = 7;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    void *scratch = new_scratch(4);
    int seen[4] = {0};
    for (int i = 0; i < 2000; i++)
        seen[sample_copy(&s, logits, 4, work, scratch)]++;
    cr_assert_eq(seen[1], 0, "the banned token was drawn %d times", seen[1]);
    cr_assert(seen[0] > 0 && seen[2] > 0 && seen[3] > 0);
    free(scratch);
    eng_sampler_free(&s);

    /* +100 forces a token */
    bias[0] = (eng_logit_bias){.token = 3, .bias = 100.0f};
    p = (eng_sampling){.logit_bias = bias, .n_logit_bias = 1};
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    cr_assert_eq(sample_copy(&s, logits, 4, work, NULL), 3);
    eng_sampler_free(&s);
}

Test(sampler, min_tokens_holds_back_eos)
{
    /* EOS (2) is the argmax; for the first three tokens it is -inf */
    eng_sampling p = {.min_tokens = 3};
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    eng_sampler_set_eos(&s, 2);
    const float logits[4] = {0.0f, 1.0f, 5.0f, 0.5f};
    float work[4];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(sample_copy(&s, logits, 4, work, NULL), 1, "token %d", i);
        cr_assert(work[2] == -INFINITY);
        cr_assert_eq(eng_sampler_may_end(&s), false, "after %d tokens", i + 1);
    }
    cr_assert_eq(sample_copy(&s, logits, 4, work, NULL), 2);
    cr_assert(same_bits(work[2], 5.0f));
    cr_assert_eq(eng_sampler_may_end(&s), true);
    eng_sampler_free(&s);

    /* without an EOS known, or with min_tokens 0, nothing is held back */
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    cr_assert_eq(sample_copy(&s, logits, 4, work, NULL), 2);
    eng_sampler_free(&s);
    p.min_tokens = 0;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    eng_sampler_set_eos(&s, 2);
    cr_assert_eq(sample_copy(&s, logits, 4, work, NULL), 2);
    cr_assert_eq(eng_sampler_may_end(&s), true);
    eng_sampler_free(&s);
}

Test(sampler, generated_counts_stay_one_entry_per_distinct_token)
{
    eng_sampling p = {.frequency_penalty = 0.1f};
    eng_sampler s;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    for (int i = 0; i < 3000; i++)
        eng_sampler_record(&s, (int32_t)((i * 7) % 5));
    cr_assert_eq(s.n_counts, 5);
    for (size_t i = 0; i < s.n_counts; i++) {
        cr_assert_eq(s.counts[i].token, (int32_t)i);
        cr_assert_eq(s.counts[i].count, 600);
    }
    cr_assert_eq(s.n_generated, 3000);
    eng_sampler_free(&s);

    /* with no presence or frequency penalty nothing is counted */
    p.frequency_penalty = 0;
    cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
    eng_sampler_record(&s, 3);
    cr_assert_eq(s.n_counts, 0);
    eng_sampler_free(&s);
}

/* Whether the backend may take s's next token: greedy, or a plain draw. */
static void expect_fast_path(const eng_sampler *s, bool want, const char *what)
{
    float inv = 0;
    bool fast = s->p.temperature > 0 ? eng_sampler_plain_draw(s, 8, &inv) : eng_sampler_greedy(s);
    cr_assert_eq(fast, want, "%s: fast path %d, want %d", what, fast, want);
}

Test(sampler, fast_paths_are_off_while_a_penalty_bias_or_min_tokens_could_act)
{
    for (int tempered = 0; tempered < 2; tempered++) {
        float t = tempered ? 0.8f : 0.0f;
        eng_sampler s;
        eng_sampling p = {.temperature = t};
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        expect_fast_path(&s, true, "nothing set");
        eng_sampler_free(&s);

        /* penalties act once something was generated */
        p = (eng_sampling){.temperature = t, .presence_penalty = 0.5f};
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        expect_fast_path(&s, true, "presence, nothing generated");
        eng_sampler_record(&s, 3);
        expect_fast_path(&s, false, "presence, one token generated");
        eng_sampler_free(&s);
        p = (eng_sampling){.temperature = t, .frequency_penalty = -0.5f};
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        eng_sampler_record(&s, 3);
        expect_fast_path(&s, false, "frequency, one token generated");
        eng_sampler_free(&s);

        /* a bias always, unless every value is 0 */
        eng_logit_bias b = {.token = 1, .bias = 0.0f};
        p = (eng_sampling){.temperature = t, .logit_bias = &b, .n_logit_bias = 1};
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        expect_fast_path(&s, true, "a bias of 0");
        eng_sampler_free(&s);
        b.bias = -100.0f;
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        expect_fast_path(&s, false, "a bias of -100");
        eng_sampler_free(&s);

        /* min_tokens while it holds EOS back */
        p = (eng_sampling){.temperature = t, .min_tokens = 2};
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        eng_sampler_set_eos(&s, 5);
        expect_fast_path(&s, false, "min_tokens 2, none generated");
        eng_sampler_record(&s, 1);
        expect_fast_path(&s, false, "min_tokens 2, one generated");
        eng_sampler_record(&s, 1);
        expect_fast_path(&s, true, "min_tokens 2, two generated");
        eng_sampler_free(&s);

        /* ignore_eos alone changes no logit */
        p = (eng_sampling){.temperature = t, .ignore_eos = true};
        cr_assert_eq(eng_sampler_init(&s, &p, NULL, 0), QL_OK);
        eng_sampler_set_eos(&s, 5);
        expect_fast_path(&s, true, "ignore_eos");
        eng_sampler_free(&s);
    }
}

Test(sampler, check_refuses_bad_penalties_biases_and_min_tokens)
{
    eng_sampling ok = {.presence_penalty = 2.0f, .frequency_penalty = -2.0f, .min_tokens = 5};
    char msg[256];
    cr_assert_eq(eng_sampling_check(&ok, msg, sizeof msg), QL_OK, "%s", msg);
    eng_sampling p = ok;
    p.presence_penalty = 2.5f;
    expect_refused(p, "presence_penalty", "2.5");
    p = ok;
    p.frequency_penalty = -3.0f;
    expect_refused(p, "frequency_penalty", "-3");
    p.frequency_penalty = NAN;
    expect_refused(p, "frequency_penalty", "nan");
    p = ok;
    p.min_tokens = -1;
    expect_refused(p, "min_tokens", "-1");
    eng_logit_bias b = {.token = 7, .bias = 100.5f};
    p = ok;
    p.logit_bias = &b;
    p.n_logit_bias = 1;
    expect_refused(p, "logit_bias", "100.5");
    b = (eng_logit_bias){.token = -2, .bias = 1.0f};
    expect_refused(p, "logit_bias", "-2");
    static eng_logit_bias many[ENG_MAX_LOGIT_BIAS + 1];
    p.logit_bias = many;
    p.n_logit_bias = ENG_MAX_LOGIT_BIAS;
    cr_assert_eq(eng_sampling_check(&p, msg, sizeof msg), QL_OK, "%s", msg);
    p.n_logit_bias = ENG_MAX_LOGIT_BIAS + 1;
    expect_refused(p, "logit_bias", "301");
}

/* --- NaN and infinities -------------------------------------------------------------- */

Test(sampler, nan_logits_count_as_minus_infinity)
{
    void *scratch = new_scratch(8);
    float work[8];
    eng_sampling greedy = {0}, hot = {.temperature = 1.0f, .top_p = 0.99f, .seed = 14};
    eng_sampler g, h;
    init_sampler(&g, &greedy);
    init_sampler(&h, &hot);

    const float some[5] = {NAN, 1.0f, NAN, 3.0f, 3.0f};
    cr_assert_eq(sample_copy(&g, some, 5, work, scratch), 3);
    memcpy(work, some, sizeof some);
    eng_sample(&g, work, 5, scratch);
    cr_assert(work[0] == -INFINITY && work[2] == -INFINITY, "NaN left in place");

    const float all_nan[4] = {NAN, NAN, NAN, NAN};
    cr_assert_eq(sample_copy(&g, all_nan, 4, work, scratch), 0);
    cr_assert_eq(sample_copy(&h, all_nan, 4, work, scratch), 0);

    const float nothing[3] = {NAN, -INFINITY, -INFINITY};
    cr_assert_eq(sample_copy(&g, nothing, 3, work, scratch), 1);
    cr_assert_eq(sample_copy(&h, nothing, 3, work, scratch), 1);

    const float mixed[4] = {NAN, 0.0f, NAN, 0.0f};
    int counts[4] = {0};
    for (int d = 0; d < 2000; d++)
        counts[sample_copy(&h, mixed, 4, work, scratch)]++;
    cr_assert(counts[0] == 0 && counts[2] == 0, "a NaN token was drawn");
    cr_assert(counts[1] > 800 && counts[3] > 800, "1 and 3 are equally likely: %d %d", counts[1],
              counts[3]);
    eng_sampler_free(&g);
    eng_sampler_free(&h);
    free(scratch);
}

Test(sampler, infinite_logits_share_all_the_probability)
{
    void *scratch = new_scratch(4);
    float work[4];
    const float l[4] = {0.0f, INFINITY, 5.0f, INFINITY};
    eng_sampling p = {.temperature = 1.0f, .seed = 15};
    eng_sampler s;
    init_sampler(&s, &p);
    int counts[4] = {0};
    for (int d = 0; d < 2000; d++)
        counts[sample_copy(&s, l, 4, work, scratch)]++;
    cr_assert(counts[0] == 0 && counts[2] == 0, "a finite logit beat +inf");
    cr_assert(counts[1] > 800 && counts[3] > 800, "the +inf tokens share equally: %d %d", counts[1],
              counts[3]);
    eng_sampler_free(&s);
    free(scratch);
}

/* --- a real vocabulary's size -------------------------------------------------------- */

Test(sampler, vocabulary_of_150k_draws_only_what_the_reference_keeps)
{
    enum { V = 150000 };
    float *logits = malloc(V * sizeof *logits), *work = malloc(V * sizeof *work);
    double *probs = malloc(V * sizeof *probs);
    void *scratch = new_scratch(V);
    cr_assert(logits && work && probs);
    uint64_t r = 16;
    for (int i = 0; i < V; i++) /* roughly a language model's spread */
        logits[i] = 2.5f * test_normal(&r);
    const eng_sampling cases[] = {
        {.temperature = 1.0f, .top_k = 50, .seed = 1},
        {.temperature = 0.8f, .top_p = 0.9f, .seed = 2},
        {.temperature = 1.0f, .top_k = 40, .top_p = 0.95f, .seed = 3},
        {.temperature = 1.0f, .top_k = 100000, .top_p = 0.5f, .seed = 4},
        {.temperature = 1.0f, .top_p = 0.999999f, .seed = 5},
        {.temperature = 100.0f, .top_p = 0.5f, .seed = 6},
        {.temperature = 0.05f, .top_p = 0.9f, .seed = 7},
        {.temperature = 1.0f, .seed = 8},
        {.temperature = 1.0f, .top_k = 1, .seed = 9},
        {.temperature = 1.0f, .top_k = 5000, .seed = 10},
        {.temperature = 0.7f, .top_k = 5000, .top_p = 0.9f, .seed = 11},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const eng_sampling *p = &cases[c];
        int32_t kept = reference_probs(logits, V, p->temperature, p->top_k, p->top_p, probs);
        eng_sampler s;
        init_sampler(&s, p);
        for (int d = 0; d < 20; d++) {
            int32_t t = sample_copy(&s, logits, V, work, scratch);
            cr_assert(probs[t] > 0, "case %zu: token %d is not among the %d kept", c, t, kept);
        }
        eng_sampler_free(&s);
    }
    free(logits);
    free(work);
    free(probs);
    free(scratch);
}

Test(sampler, top_k_over_sorted_logits_refills_its_buffer)
{
    /* ascending logits make every one a new best, so the candidate buffer
     * fills and is cut back again and again; descending, never */
    enum { V = 20000, K = 50 };
    float *up = malloc(V * sizeof *up), *down = malloc(V * sizeof *down);
    float *work = malloc(V * sizeof *work);
    void *scratch = new_scratch(V);
    for (int i = 0; i < V; i++) {
        up[i] = 0.0001f * (float)i;
        down[i] = -0.0001f * (float)i;
    }
    eng_sampling p = {.temperature = 1.0f, .top_k = K, .seed = 18};
    eng_sampler s;
    init_sampler(&s, &p);
    int32_t lowest = V, highest = -1;
    for (int d = 0; d < 2000; d++) {
        int32_t t = sample_copy(&s, up, V, work, scratch);
        cr_assert(t >= V - K, "ascending: token %d is not among the last %d", t, K);
        lowest = t < lowest ? t : lowest;
        t = sample_copy(&s, down, V, work, scratch);
        cr_assert(t < K, "descending: token %d is not among the first %d", t, K);
        highest = t > highest ? t : highest;
    }
    cr_assert(lowest == V - K && highest == K - 1, "the k-th best is never drawn: %d %d", lowest,
              highest);
    eng_sampler_free(&s);
    free(up);
    free(down);
    free(work);
    free(scratch);
}

Test(sampler, top_p_cut_among_the_tiniest_weights)
{
    /* one token at 0 and 100000 at -28 (e^-28 < 2^-40: the last bucket):
     * top_p 0.99999994 needs a few thousand of the tiny ones, chosen
     * among 100000 equal weights; the top token is drawn all the same */
    enum { V = 100001 };
    float *l = malloc(V * sizeof *l), *work = malloc(V * sizeof *work);
    void *scratch = new_scratch(V);
    l[0] = 0.0f;
    for (int i = 1; i < V; i++)
        l[i] = -28.0f;
    eng_sampling p = {.temperature = 1.0f, .top_p = 0.99999994f, .seed = 19};
    eng_sampler s;
    init_sampler(&s, &p);
    for (int d = 0; d < 50; d++)
        cr_assert_eq(sample_copy(&s, l, V, work, scratch), 0);
    eng_sampler_free(&s);
    free(l);
    free(work);
    free(scratch);
}

Test(sampler, random_cases_draw_only_what_the_reference_keeps)
{
    /* logits on a coarse grid, so that ties are everywhere, including at
     * the top-k and top-p boundaries */
    uint64_t r = 20;
    enum { MAX_V = 3000 };
    float *logits = malloc(MAX_V * sizeof *logits), *work = malloc(MAX_V * sizeof *work);
    double *probs = malloc(MAX_V * sizeof *probs);
    void *scratch = new_scratch(MAX_V);
    for (int round = 0; round < 300; round++) {
        int32_t vocab = 2 + (int32_t)(test_rand(&r) % (MAX_V - 1));
        float spread = 0.5f + 8.0f * (float)test_uniform(&r);
        for (int32_t i = 0; i < vocab; i++)
            logits[i] = roundf(spread * test_normal(&r) * 4.0f) / 4.0f;
        eng_sampling p = {.temperature = 0.2f + 2.0f * (float)test_uniform(&r),
                          .seed = test_rand(&r)};
        if (test_rand(&r) % 2)
            p.top_k = 1 + (int32_t)(test_rand(&r) % (uint64_t)vocab);
        if (test_rand(&r) % 2)
            p.top_p = 0.05f + 0.94f * (float)test_uniform(&r);
        int32_t kept = reference_probs(logits, vocab, p.temperature, p.top_k, p.top_p, probs);
        eng_sampler s;
        init_sampler(&s, &p);
        for (int d = 0; d < 30; d++) {
            int32_t t = sample_copy(&s, logits, vocab, work, scratch);
            cr_assert(probs[t] > 0,
                      "round %d (vocab %d, T %g, top_k %d, top_p %g): token %d is not among the "
                      "%d kept",
                      round, vocab, (double)p.temperature, p.top_k, (double)p.top_p, t, kept);
        }
        eng_sampler_free(&s);
    }
    free(logits);
    free(work);
    free(probs);
    free(scratch);
}

/* --- stop strings ------------------------------------------------------------------ */

/* Feed text; the emitted piece must be `want` and the stop result `stopped`. */
static void feed_expect(eng_stop *st, const char *text, const char *want, bool stopped)
{
    const char *emit;
    size_t len;
    bool got = eng_stop_feed(st, text, strlen(text), &emit, &len);
    cr_assert_eq(got, stopped, "feeding \"%s\": stopped %d", text, got);
    cr_assert(len == strlen(want) && memcmp(emit, want, len) == 0,
              "feeding \"%s\" emitted \"%.*s\", want \"%s\"", text, (int)len, emit, want);
}

static void flush_expect(eng_stop *st, const char *want)
{
    const char *emit;
    size_t len;
    eng_stop_flush(st, &emit, &len);
    cr_assert(len == strlen(want) && memcmp(emit, want, len) == 0,
              "flush emitted \"%.*s\", want \"%s\"", (int)len, emit, want);
}

static eng_stop *new_stop(const char *const *stops, size_t n)
{
    eng_stop *st;
    char msg[256];
    cr_assert_eq(eng_stop_new(&st, stops, n, msg, sizeof msg), QL_OK, "%s", msg);
    return st;
}

Test(stop, no_stop_strings_emit_everything_at_once)
{
    eng_stop *st = new_stop(NULL, 0);
    feed_expect(st, "Hello <|", "Hello <|", false);
    feed_expect(st, "", "", false);
    feed_expect(st, "end|>", "end|>", false);
    flush_expect(st, "");
    eng_stop_free(st);
}

Test(stop, stop_split_across_three_feeds_is_never_emitted)
{
    const char *stops[] = {"<|end|>"};
    eng_stop *st = new_stop(stops, 1);
    feed_expect(st, "Hello <|", "Hello ", false);
    feed_expect(st, "en", "", false);
    feed_expect(st, "d|> and after", "", true);
    eng_stop_free(st);
}

Test(stop, partial_match_that_fails_is_emitted)
{
    const char *stops[] = {"STOP"};
    eng_stop *st = new_stop(stops, 1);
    feed_expect(st, "ST", "", false);
    feed_expect(st, "ART ", "START ", false);
    feed_expect(st, "a STO", "a ", false);
    feed_expect(st, "x", "STOx", false);
    feed_expect(st, "SSTO", "S", false); /* "STO" may still become STOP */
    feed_expect(st, "P!", "", true);
    eng_stop_free(st);
}

Test(stop, overlapping_stop_strings)
{
    /* several stop strings share prefixes; the first to complete wins, and
     * of those completing on one byte the longest */
    const char *stops[] = {"abc", "abd", "bd", "xyz"};
    eng_stop *st = new_stop(stops, 4);
    feed_expect(st, "1 ab", "1 ", false);
    feed_expect(st, "x", "ab", false); /* "x" may begin xyz */
    feed_expect(st, "y", "", false);
    feed_expect(st, "ab", "xy", false);  /* "ab" may begin abc or abd */
    feed_expect(st, "d tail", "", true); /* abd and bd both end here: abd */
    eng_stop_free(st);

    const char *nested[] = {"abcd", "bc"};
    st = new_stop(nested, 2);
    feed_expect(st, "zabcd", "za", true); /* bc completes before abcd would */
    eng_stop_free(st);
}

Test(stop, stop_at_the_very_start)
{
    const char *stops[] = {"###"};
    eng_stop *st = new_stop(stops, 1);
    feed_expect(st, "###rest", "", true);
    eng_stop_free(st);

    st = new_stop(stops, 1);
    feed_expect(st, "#", "", false);
    feed_expect(st, "##", "", true);
    eng_stop_free(st);
}

Test(stop, held_text_is_whole_utf8_characters)
{
    /* a multi-byte stop string fed a byte at a time: what is held is a
     * prefix of it, which begins on a character */
    const char *stops[] = {"\xc3\xb1!"}; /* "ñ!" */
    eng_stop *st = new_stop(stops, 1);
    feed_expect(st, "a\xc3", "a", false);
    feed_expect(st, "\xb1", "", false);
    feed_expect(st, "b",
                "\xc3\xb1"
                "b",
                false);
    eng_stop_free(st);

    /* a stop string that begins inside a character (the last byte of "é"
     * then "!"): the whole "é" is held, never half of it */
    const char *inside[] = {"\xa9!"};
    st = new_stop(inside, 1);
    feed_expect(st, "caf\xc3\xa9", "caf", false);
    feed_expect(st, "?", "\xc3\xa9?", false);
    feed_expect(st, "\xe2\x82\xac \xf0\x9f\x98\x80", "\xe2\x82\xac \xf0\x9f\x98\x80", false);
    eng_stop_free(st);
}

Test(stop, held_stop_strings_are_emitted_and_matching_goes_on)
{
    /* min_tokens not reached: "STOP" goes out as text; once released, a
     * stop that began while held still ends the text where it starts */
    const char *stops[] = {"STOP"};
    eng_stop *st = new_stop(stops, 1);
    eng_stop_hold(st, true);
    feed_expect(st, "a STOP b ST", "a STOP b ", false);
    eng_stop_hold(st, false);
    feed_expect(st, "OP after", "", true);
    eng_stop_free(st);

    st = new_stop(stops, 1);
    eng_stop_hold(st, true);
    feed_expect(st, "STOPSTOP", "STOPSTOP", false);
    eng_stop_hold(st, false);
    feed_expect(st, "x STOP", "x ", true);
    eng_stop_free(st);
}

Test(stop, flush_returns_what_was_held)
{
    const char *stops[] = {"</answer>", "\n\nUser:"};
    eng_stop *st = new_stop(stops, 2);
    feed_expect(st, "42\n\nUs", "42", false);
    flush_expect(st, "\n\nUs");
    flush_expect(st, "");
    /* after a flush the automata start over */
    feed_expect(st, "er:", "er:", false);
    eng_stop_free(st);
}

Test(stop, feeds_after_a_stop_emit_nothing)
{
    const char *stops[] = {"END"};
    eng_stop *st = new_stop(stops, 1);
    feed_expect(st, "done END more", "done ", true);
    feed_expect(st, "still more", "", true);
    feed_expect(st, "E", "", true);
    flush_expect(st, "");
    eng_stop_free(st);
}

Test(stop, long_and_many_stop_strings)
{
    char longest[400];
    memset(longest, 'a', sizeof longest - 1);
    longest[sizeof longest - 1] = 0;
    const char *stops[16];
    char small[15][8];
    for (int i = 0; i < 15; i++) {
        snprintf(small[i], sizeof small[i], "<s%d>", i);
        stops[i] = small[i];
    }
    stops[15] = longest;
    eng_stop *st = new_stop(stops, 16);
    /* 398 a's: all could still begin the long one */
    char text[400];
    memset(text, 'a', 398);
    text[398] = 0;
    feed_expect(st, text, "", false);
    char want[401];
    snprintf(want, sizeof want, "%sb", text);
    feed_expect(st, "b", want, false); /* 398 a's and "b" cannot */
    feed_expect(st, "<s1", "", false); /* may begin <s1> or <s10>..<s14> */
    feed_expect(st, "4>", "", true);
    eng_stop_free(st);
}

Test(stop, refuses_empty_and_null_stop_strings)
{
    eng_stop *st = (eng_stop *)1;
    char msg[256] = "";
    const char *empty[] = {"ok", ""};
    cr_assert_eq(eng_stop_new(&st, empty, 2, msg, sizeof msg), QL_EINVAL);
    cr_assert(st == NULL);
    cr_assert(strstr(msg, "stop string 1") && strstr(msg, "empty"), "%s", msg);
    const char *null[] = {NULL};
    cr_assert_eq(eng_stop_new(&st, null, 1, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "stop string 0"), "%s", msg);
}

/* Byte-by-byte reference: the first byte where some stop string ends the
 * text, the longest of those; the text before it, or all of it. */
static bool reference_stop(const char *text, size_t len, const char *const *stops, size_t n,
                           size_t *out_len)
{
    for (size_t end = 1; end <= len; end++) {
        size_t longest = 0;
        for (size_t j = 0; j < n; j++) {
            size_t l = strlen(stops[j]);
            if (l <= end && memcmp(text + end - l, stops[j], l) == 0 && l > longest)
                longest = l;
        }
        if (longest) {
            *out_len = end - longest;
            return true;
        }
    }
    *out_len = len;
    return false;
}

Test(stop, random_feeds_match_the_reference)
{
    uint64_t r = 17;
    for (int round = 0; round < 3000; round++) {
        char stop_text[3][6];
        const char *stops[3];
        size_t n = 1 + test_rand(&r) % 3;
        for (size_t j = 0; j < n; j++) {
            size_t l = 1 + test_rand(&r) % 5;
            for (size_t i = 0; i < l; i++)
                stop_text[j][i] = "abc"[test_rand(&r) % 3];
            stop_text[j][l] = 0;
            stops[j] = stop_text[j];
        }
        char text[64];
        size_t len = test_rand(&r) % sizeof text;
        for (size_t i = 0; i < len; i++)
            text[i] = "abcc"[test_rand(&r) % 4];

        size_t want_len;
        bool want_stop = reference_stop(text, len, stops, n, &want_len);

        eng_stop *st = new_stop(stops, n);
        char got[64];
        size_t got_len = 0, at = 0;
        bool stopped = false;
        while (at < len && !stopped) {
            size_t piece = 1 + test_rand(&r) % 6;
            if (piece > len - at)
                piece = len - at;
            const char *emit;
            size_t emit_len;
            stopped = eng_stop_feed(st, text + at, piece, &emit, &emit_len);
            cr_assert(got_len + emit_len <= sizeof got);
            memcpy(got + got_len, emit, emit_len);
            got_len += emit_len;
            at += piece;
        }
        if (!stopped) {
            const char *emit;
            size_t emit_len;
            eng_stop_flush(st, &emit, &emit_len);
            memcpy(got + got_len, emit, emit_len);
            got_len += emit_len;
        }
        cr_assert_eq(stopped, want_stop, "round %d: text \"%.*s\": stopped %d, want %d", round,
                     (int)len, text, stopped, want_stop);
        cr_assert(got_len == want_len && memcmp(got, text, got_len) == 0,
                  "round %d: text \"%.*s\" (stops %s %s %s): emitted \"%.*s\", want \"%.*s\"",
                  round, (int)len, text, stops[0], n > 1 ? stops[1] : "", n > 2 ? stops[2] : "",
                  (int)got_len, got, (int)want_len, text);
        eng_stop_free(st);
    }
}

/*
 * A plain temperature draw made as the CUDA kernel makes it (sample_math.h:
 * block sums then the pick) gives eng_sample's token for the same seed, on
 * model-like logits and on the edge cases (NaN, -inf, +inf, ties, a vocabulary
 * not a multiple of the block), and takes the same one uniform per token.
 */
Test(sampler, the_device_draw_equals_eng_sample)
{
    const int32_t vocabs[] = {1, 3, 255, 256, 257, 1000, 49152};
    const float temps[] = {0.05f, 0.7f, 1.0f, 3.0f, 1e-30f};
    uint64_t rng = 5;
    int compared = 0;
    for (size_t v = 0; v < sizeof vocabs / sizeof *vocabs; v++) {
        int32_t vocab = vocabs[v];
        float *logits = malloc((size_t)vocab * sizeof(float));
        float *copy = malloc((size_t)vocab * sizeof(float));
        double *sums = malloc((size_t)(vocab / QM_SAMPLE_BLOCK + 1) * sizeof(double));
        void *scratch = new_scratch(vocab);
        for (size_t k = 0; k < sizeof temps / sizeof *temps; k++) {
            for (int edge = 0; edge < 5; edge++) {
                for (int32_t i = 0; i < vocab; i++) {
                    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                    logits[i] = (float)((double)(rng >> 11) * 0x1.0p-53 * 12.0 - 6.0);
                }
                if (edge == 1 && vocab > 2) /* NaN and -inf scattered */
                    for (int32_t i = 0; i < vocab; i += 3)
                        logits[i] = i % 2 ? NAN : -INFINITY;
                if (edge == 2) /* two +inf share everything */
                    logits[vocab / 2] = logits[vocab - 1] = INFINITY;
                if (edge == 3) /* all NaN but one -inf */
                    for (int32_t i = 0; i < vocab; i++)
                        logits[i] = i == vocab - 1 ? -INFINITY : NAN;
                if (edge == 4) /* flat: ties everywhere, and -0 before +0 */
                    for (int32_t i = 0; i < vocab; i++)
                        logits[i] = i == 0 ? -0.0f : 0.0f;
                eng_sampling p = {.temperature = temps[k], .seed = 42 + (uint64_t)edge};
                eng_sampler cpu, dev;
                cr_assert_eq(eng_sampler_init(&cpu, &p, NULL, 0), 0);
                cr_assert_eq(eng_sampler_init(&dev, &p, NULL, 0), 0);
                for (int draw = 0; draw < 4; draw++) {
                    float inv_t;
                    cr_assert(eng_sampler_plain_draw(&dev, vocab, &inv_t));
                    double u = eng_sampler_uniform(&dev);
                    int32_t want_dev = qm_sample_token(logits, vocab, inv_t, u, sums);
                    memcpy(copy, logits, (size_t)vocab * sizeof(float));
                    int32_t want_cpu = eng_sample(&cpu, copy, vocab, scratch);
                    cr_assert_eq(want_dev, want_cpu,
                                 "vocab %d, T %g, edge %d, draw %d: device %d, cpu %d", vocab,
                                 (double)temps[k], edge, draw, want_dev, want_cpu);
                    compared++;
                }
                eng_sampler_free(&cpu);
                eng_sampler_free(&dev);
            }
        }
        free(logits);
        free(copy);
        free(sums);
        free(scratch);
    }
    cr_assert_eq(compared, 7 * 5 * 5 * 4);
    /* and what is not a plain draw is said so */
    eng_sampler s;
    float inv_t;
    eng_sampling filtered[] = {{.temperature = 0},
                               {.temperature = 1, .top_k = 5},
                               {.temperature = 1, .top_p = 0.9f},
                               {.temperature = 1, .repetition_penalty = 1.2f}};
    for (size_t i = 0; i < sizeof filtered / sizeof *filtered; i++) {
        cr_assert_eq(eng_sampler_init(&s, &filtered[i], NULL, 0), 0);
        cr_assert_not(eng_sampler_plain_draw(&s, 1000, &inv_t), "case %zu", i);
        eng_sampler_free(&s);
    }
}

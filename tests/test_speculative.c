/*
 * test_speculative.c - speculative decoding on the tiny model: the n-gram
 * drafter's lookup, the draft length's adaptation, the KV rollback, the
 * refusals by name; and through the engine, that drafting never changes an
 * answer: greedy answers over many prompts (batched, with logprobs, stop
 * strings, min_tokens, penalties, logit_bias, a grammar, an unmerged
 * adapter) are the tokens an engine without speculation gives, and
 * sampled ones with a seed are too, so their distribution is the model's
 * (a two-sample test over many seeds, bound stated there). Each engine
 * test also checks that drafts were verified, accepted and rejected, so
 * it fails when speculation is silently off. On the tiny hybrid model
 * (Qwen3.5's linear-attention layers) the same holds: its recurrent state
 * goes back to the row of the last accepted token.
 *
 * The tiny model's random weights make it repeat itself, which the
 * prompts below (runs that come back) help: the n-gram drafter then finds
 * matches, some of which the model takes and some not.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "drafter_internal.h"
#include "grammar.h"
#include "lora.h"
#include "lora_fixture.h"
#include "runtime.h"
#include "scheduler.h"
#include "tiny_model.h"
#include "tokenizer.h"

TINY_DEFAULT_SUITE(speculative, 120);

#define MAX_OUT     96
#define MAX_CHOICES 3

/* What one request produced. */
typedef struct outcome {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    eng_finish why;
    eng_usage usage;
    /* per choice */
    int32_t tokens[MAX_CHOICES][MAX_OUT];
    float logprobs[MAX_CHOICES][MAX_OUT];
    eng_logprob top[MAX_CHOICES][MAX_OUT][3];
    int n[MAX_CHOICES];
    char text[MAX_CHOICES][512];
    size_t len[MAX_CHOICES];
} outcome;

static void on_token(void *user, const eng_token_event *ev)
{
    outcome *o = user;
    int c = ev->choice;
    cr_assert_lt(c, MAX_CHOICES);
    if (o->len[c] + ev->len < sizeof o->text[c]) {
        memcpy(o->text[c] + o->len[c], ev->text, ev->len);
        o->len[c] += ev->len;
    }
    if (ev->token < 0 || o->n[c] >= MAX_OUT)
        return;
    o->tokens[c][o->n[c]] = ev->token;
    o->logprobs[c][o->n[c]] = ev->logprob;
    for (int32_t i = 0; i < ev->n_top && i < 3; i++)
        o->top[c][o->n[c]][i] = ev->top[i];
    o->n[c]++;
}

static void on_done(void *user, eng_finish why, const eng_usage *u)
{
    outcome *o = user;
    pthread_mutex_lock(&o->mu);
    o->why = why;
    o->usage = *u;
    o->done = true;
    pthread_cond_signal(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

static outcome *outcomes_new(int n)
{
    outcome *o = calloc((size_t)n, sizeof *o);
    cr_assert(o);
    for (int i = 0; i < n; i++) {
        pthread_mutex_init(&o[i].mu, NULL);
        pthread_cond_init(&o[i].cv, NULL);
    }
    return o;
}

static void wait_done(outcome *o)
{
    pthread_mutex_lock(&o->mu);
    while (!o->done)
        pthread_cond_wait(&o->cv, &o->mu);
    pthread_mutex_unlock(&o->mu);
}

/* The engines' prefill chunk (0: their default); the MTP test lowers it. */
static int32_t prefill_chunk;

/* An engine on m drafting as spec says; spec's max_batch 0 is 8 here (not the
 * engine's 4), so that the tests' batches of up to 8 draft. */
static eng_engine *start_on(const eng_model *m, const eng_spec_opts *spec, int32_t max_running)
{
    eng_engine_opts o = {.threads = 2,
                         .kv_bytes = 16 << 20,
                         .max_running = max_running,
                         .max_queued = 2048,
                         .prefill_chunk = prefill_chunk,
                         .spec = *spec};
    if (o.spec.max_batch == 0)
        o.spec.max_batch = 8;
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, m, &o, msg, sizeof msg), 0, "%s", msg);
    return e;
}

static eng_engine *start_with(const eng_spec_opts *spec, int32_t max_running)
{
    return start_on(&tiny_model, spec, max_running);
}

static eng_engine *start(eng_speculative drafter, int32_t max_running, int32_t max_batch)
{
    eng_spec_opts spec = {.drafter = drafter, .max_batch = max_batch};
    return start_with(&spec, max_running);
}

static const char *prompts[] = {
    "a b c d a b c d a b c",
    "the theme of the thesis, the theme of the",
    "hello hello hello",
    "1 2 3 4 5 1 2 3 4 5 1 2",
    "once upon a time there was a time",
    "xyzzy",
    "the cat sat on the mat; the cat sat on the",
    "to be or not to be, to be",
    "abcabcabcabcab",
    "q",
    "fn main() { let x = 1; let y = 2; let",
    "red green blue red green blue red",
};
#define N_PROMPTS ((int)(sizeof prompts / sizeof *prompts))

/* Submit reqs[0..n) together (they share steps), wait for all. */
static void run_all(eng_engine *e, eng_request *reqs, outcome *out, int n)
{
    char msg[512];
    for (int i = 0; i < n; i++) {
        reqs[i].on_token = on_token;
        reqs[i].on_done = on_done;
        reqs[i].user = &out[i];
        cr_assert_eq(eng_engine_submit(e, &reqs[i], NULL, msg, sizeof msg), QL_OK, "%d: %s", i,
                     msg);
    }
    for (int i = 0; i < n; i++)
        wait_done(&out[i]);
}

static eng_request plain(const char *prompt, int32_t max_new)
{
    return (eng_request){.prompt = prompt, .prompt_len = strlen(prompt), .max_new_tokens = max_new};
}

/* Choice c of request i: the same tokens, logprobs (bit for bit) and text. */
static void expect_same_choice(const outcome *on, const outcome *off, int i, int c)
{
    cr_assert_eq(on->n[c], off->n[c], "request %d choice %d: %d tokens, without drafts %d", i, c,
                 on->n[c], off->n[c]);
    for (int t = 0; t < on->n[c]; t++) {
        cr_assert_eq(on->tokens[c][t], off->tokens[c][t], "request %d/%d token %d: %d, not %d", i,
                     c, t, on->tokens[c][t], off->tokens[c][t]);
        cr_assert(memcmp(&on->logprobs[c][t], &off->logprobs[c][t], sizeof(float)) == 0,
                  "request %d/%d token %d: logprob %.9g, not %.9g", i, c, t,
                  (double)on->logprobs[c][t], (double)off->logprobs[c][t]);
        cr_assert(memcmp(on->top[c][t], off->top[c][t], sizeof on->top[c][t]) == 0,
                  "request %d/%d token %d: its top logprobs differ", i, c, t);
    }
    cr_assert_eq(on->len[c], off->len[c], "request %d/%d's text", i, c);
    cr_assert(memcmp(on->text[c], off->text[c], on->len[c]) == 0, "request %d/%d's text", i, c);
}

/* Requests 0..n) ended alike with and without drafts, each choice the same. */
static void expect_same_outcomes(const outcome *on, const outcome *off, int n)
{
    for (int i = 0; i < n; i++) {
        cr_assert_eq(on[i].why, off[i].why, "request %d ended %s, without drafts %s", i,
                     eng_finish_name(on[i].why), eng_finish_name(off[i].why));
        cr_assert_eq(on[i].usage.generated_tokens, off[i].usage.generated_tokens);
        for (int c = 0; c < MAX_CHOICES; c++)
            expect_same_choice(&on[i], &off[i], i, c);
    }
}

/* The same requests on an engine without speculation and one drafting as
 * so says: every answer's tokens (and logprobs, bit for bit) and end the
 * same; the speculating engine's figures come back in *spec. */
static void expect_same_answers_on(const eng_model *m, eng_request *reqs, int n,
                                   int32_t max_running, const eng_spec_opts *so,
                                   eng_spec_stats *spec)
{
    outcome *off = outcomes_new(n), *on = outcomes_new(n);
    eng_engine *e = start_on(m, &(eng_spec_opts){.drafter = ENG_SPEC_OFF}, max_running);
    run_all(e, reqs, off, n);
    eng_engine_stop(e);
    e = start_on(m, so, max_running);
    run_all(e, reqs, on, n);
    eng_engine_stats st;
    cr_assert(eng_engine_settle(e, 60));
    eng_engine_stats_get(e, &st);
    *spec = st.spec;
    cr_expect_eq(st.kv_blocks_used, 0, "every block came back (prefix-kept ones are free)");
    eng_engine_stop(e);
    expect_same_outcomes(on, off, n);
    free(off);
    free(on);
}

/* The same on the tiny model. */
static void expect_same_answers_with(eng_request *reqs, int n, int32_t max_running,
                                     const eng_spec_opts *so, eng_spec_stats *spec)
{
    expect_same_answers_on(&tiny_model, reqs, n, max_running, so, spec);
}

/* The same with n-gram drafts. */
static void expect_same_answers(eng_request *reqs, int n, int32_t max_running, eng_spec_stats *spec)
{
    eng_spec_opts so = {.drafter = ENG_SPEC_NGRAM};
    expect_same_answers_with(reqs, n, max_running, &so, spec);
}

/* Drafts were verified, some accepted, some rejected (the rollback ran). */
static void expect_drafts_exercised(const eng_spec_stats *s)
{
    cr_assert_neq(s->drafter, ENG_SPEC_OFF);
    cr_assert_gt(s->drafts, 0, "no draft was verified");
    cr_assert_gt(s->accepted, 0, "no drafted token was accepted");
    cr_assert_gt(s->verified, s->accepted, "no drafted token was rejected");
    cr_assert_geq(s->drafted, s->verified);
    uint64_t n = 0, sum = 0;
    for (int i = 0; i <= ENG_SPEC_MAX_DRAFT; i++) {
        n += s->accepted_len[i];
        sum += (uint64_t)i * s->accepted_len[i];
    }
    cr_assert_eq(n, s->drafts, "the acceptance histogram counts every verification");
    cr_assert_eq(sum, s->accepted, "and sums to the accepted tokens");
}

/* --- the drafter, the length, the rollback, the refusals --------------------------- */

Test(speculative, ngram_lookup_takes_the_longest_suffix_at_its_latest_place)
{
    /* "1 2 3" occurs at 0 and 5, "3" alone also at 8: the 3-gram wins, its latest place */
    int32_t prompt[] = {1, 2, 3, 4, 5, 1, 2, 3, 6, 3, 7};
    int32_t answer[] = {1, 2, 3};
    eng_history h = {prompt, 11, answer, 3};
    int32_t out[8], matched;
    cr_assert_eq(eng_ngram_draft(&h, 1, 3, 8, out, &matched), 6, "up to the end of what was seen");
    cr_assert_eq(matched, 3);
    int32_t want[] = {6, 3, 7, 1, 2, 3};
    cr_assert(memcmp(out, want, sizeof want) == 0, "%d %d %d", out[0], out[1], out[2]);
    cr_assert_eq(eng_ngram_draft(&h, 1, 3, 2, out, &matched), 2, "max bounds the draft");
    /* only 1-grams allowed: the latest earlier "3" is at 9 */
    cr_assert_eq(eng_ngram_draft(&h, 1, 1, 8, out, &matched), 4);
    cr_assert_eq(out[0], 7);
    cr_assert_eq(matched, 1);
}

Test(speculative, ngram_lookup_runs_into_a_repeated_run_and_finds_nothing_new)
{
    int32_t prompt[] = {9, 9, 9, 9};
    eng_history h = {prompt, 4, NULL, 0};
    int32_t out[8], matched;
    /* the suffix 9 9 9 at 0 is followed by the suffix itself */
    cr_assert_eq(eng_ngram_draft(&h, 1, 3, 8, out, &matched), 1);
    cr_assert_eq(out[0], 9);
    int32_t fresh[] = {1, 2, 3, 4};
    eng_history g = {fresh, 4, NULL, 0};
    cr_assert_eq(eng_ngram_draft(&g, 1, 3, 8, out, &matched), 0, "no token repeats: no guess");
    cr_assert_eq(matched, 0);
    eng_history one = {fresh, 1, NULL, 0};
    cr_assert_eq(eng_ngram_draft(&one, 1, 3, 8, out, &matched), 0, "nothing before the suffix");
}

Test(speculative, the_memory_drafts_what_followed_a_run_in_an_earlier_answer)
{
    eng_ngram_memory *m;
    char msg[160];
    cr_assert_eq(eng_ngram_memory_new(&m, 64, msg, sizeof msg), QL_OK, "%s", msg);
    int32_t a[] = {10, 11, 12, 13, 14, 15};
    eng_ngram_memory_add(m, a, 6);
    int32_t prompt[] = {1, 2}, answer[] = {11, 12}, out[8], matched;
    eng_history h = {prompt, 2, answer, 2};
    cr_assert_eq(eng_ngram_memory_draft(m, &h, 0, 8, out, &matched), 3,
                 "up to the answer's end, not past it");
    cr_assert_eq(matched, 2);
    cr_assert(out[0] == 13 && out[1] == 14 && out[2] == 15);
    cr_assert_eq(eng_ngram_memory_draft(m, &h, 0, 2, out, &matched), 2, "max bounds the draft");
    cr_assert_eq(eng_ngram_memory_draft(m, &h, 2, 8, out, &matched), 0,
                 "no longer run than the prompt lookup's match");
    cr_assert_eq(matched, 0);
    int32_t longer[] = {10, 11, 12};
    eng_history g = {longer, 3, NULL, 0};
    cr_assert_eq(eng_ngram_memory_draft(m, &g, 2, 8, out, &matched), 3);
    cr_assert_eq(matched, 3, "the longest run first");
    /* an answer's last run has no follower; the next answer's run of the same tokens has */
    int32_t last[] = {14, 15};
    eng_history end = {last, 2, NULL, 0};
    cr_assert_eq(eng_ngram_memory_draft(m, &end, 0, 8, out, &matched), 0);
    int32_t b[] = {7, 14, 15, 99};
    eng_ngram_memory_add(m, b, 4);
    cr_assert_eq(eng_ngram_memory_draft(m, &end, 0, 8, out, &matched), 1);
    cr_assert_eq(out[0], 99);
    int32_t lone[] = {12};
    eng_history one = {lone, 1, NULL, 0};
    cr_assert_eq(eng_ngram_memory_draft(m, &one, 0, 8, out, &matched), 0,
                 "a lone token is not looked up");
    eng_ngram_memory_free(m);
}

Test(speculative, the_memory_forgets_what_its_ring_wrote_over)
{
    eng_ngram_memory *m;
    char msg[160];
    cr_assert_eq(eng_ngram_memory_new(&m, 64, msg, sizeof msg), QL_OK, "%s", msg);
    int32_t old[40], recent[40], out[8], matched;
    for (int i = 0; i < 40; i++) {
        old[i] = 100 + i;
        recent[i] = 200 + i;
    }
    eng_ngram_memory_add(m, old, 40);
    eng_ngram_memory_add(m, recent, 40); /* 82 positions in a ring of 64 */
    eng_history first = {old, 2, NULL, 0}, late = {old + 30, 2, NULL, 0};
    cr_assert_eq(eng_ngram_memory_draft(m, &first, 0, 8, out, &matched), 0, "written over");
    cr_assert_eq(eng_ngram_memory_draft(m, &late, 0, 8, out, &matched), 8,
                 "the old answer's end is still there");
    cr_assert_eq(out[0], 132);
    eng_history now = {recent + 36, 2, NULL, 0};
    cr_assert_eq(eng_ngram_memory_draft(m, &now, 0, 8, out, &matched), 2);
    cr_assert(out[0] == 238 && out[1] == 239);
    eng_ngram_memory_free(m);
    cr_assert_eq(eng_ngram_memory_new(&m, 10, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "ngram-memory 10"), "%s", msg);
    eng_spec_opts o = {.drafter = ENG_SPEC_NGRAM, .memory_tokens = 5};
    cr_assert_eq(eng_spec_opts_resolve(&o, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "ngram-memory 5"), "%s", msg);
    o = (eng_spec_opts){.drafter = ENG_SPEC_NGRAM};
    cr_assert_eq(eng_spec_opts_resolve(&o, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(o.memory_tokens, ENG_SPEC_MEMORY_TOKENS, "on by default");
}

/* The draft length for a sequence that has verified `rounds` drafts of 8
 * accepting `accepted` each, in a step of n_decode whose fixed part costs
 * `fixed` rows. */
static int32_t length_after(int rounds, int32_t accepted, int32_t n_decode, double fixed)
{
    eng_spec_len l;
    eng_spec_len_init(&l);
    for (int i = 0; i < rounds; i++)
        eng_spec_len_adapt(&l, 8, accepted);
    eng_spec_cost c = {.fixed_s = fixed * 1e-3, .token_s = 1e-3, .n_decode = n_decode};
    return eng_spec_len_want(&l, &c, 16);
}

Test(speculative, draft_length_follows_acceptance_and_the_cost_of_a_row)
{
    eng_spec_len l;
    double first, next;
    eng_spec_len_init(&l);
    eng_spec_len_rates(&l, &first, &next);
    cr_assert(first == 0.6 && next == 0.6, "%g %g", first, next);
    eng_spec_len_adapt(&l, 4, 1);
    eng_spec_len_rates(&l, &first, &next);
    cr_assert_float_eq(first, (3 * 0.8 + 1) / (5 * 0.8 + 1), 1e-12, "the first accepted");
    cr_assert_float_eq(next, (3 * 0.8 + 0) / (5 * 0.8 + 1), 1e-12,
                       "one accepted: the second tried and refused, the rest never tried");
    eng_spec_len_adapt(&l, 3, 3);
    eng_spec_len_rates(&l, &first, &next);
    cr_assert_float_eq(next, ((3 * 0.8 + 0) * 0.8 + 2) / ((5 * 0.8 + 1) * 0.8 + 2), 1e-12,
                       "all three accepted: two later positions tried and taken");
    eng_spec_len l2 = l;
    eng_spec_len_adapt(&l, 0, 0);
    cr_assert(memcmp(&l, &l2, sizeof l) == 0, "nothing drafted: nothing learnt");
    /* a copying sequence at batch 1 drafts long; the same at batch 16 drafts less */
    int32_t long1 = length_after(6, 8, 1, 4), long16 = length_after(6, 8, 16, 4);
    cr_assert_geq(long1, 8, "all accepted at batch 1: %d", long1);
    cr_assert_lt(long16, long1, "batch 16 drafts %d, batch 1 %d", long16, long1);
    /* a costlier fixed part (weight reads) makes rows cheaper: longer drafts */
    int32_t half = length_after(6, 4, 1, 4), half_cheap = length_after(6, 4, 1, 40);
    cr_assert(half >= 1 && half_cheap > half, "%d then %d", half, half_cheap);
    /* a rate above a half keeps one row even where the cost says none */
    cr_assert_eq(length_after(6, 8, 64, 0.5), 1);
    /* nothing accepted: none, and one probe every ENG_SPEC_PROBE_STEPS steps */
    eng_spec_len_init(&l);
    for (int i = 0; i < 8; i++)
        eng_spec_len_adapt(&l, 4, 0);
    eng_spec_cost c = {.fixed_s = 4e-3, .token_s = 1e-3, .n_decode = 1};
    for (int i = 1; i < ENG_SPEC_PROBE_STEPS; i++)
        cr_assert_eq(eng_spec_len_want(&l, &c, 16), 0, "step %d", i);
    cr_assert_eq(eng_spec_len_want(&l, &c, 16), 1, "a probe after %d steps", ENG_SPEC_PROBE_STEPS);
    cr_assert_eq(eng_spec_len_want(&l, &c, 16), 0, "then none again");
    /* copying: the first guess taken 3 times in 5, a later one 19 in 20 given the one before
     * it: long drafts, where one rate of 0.6 for every position would draft one */
    eng_spec_cost two_rows = {.fixed_s = 2e-3, .token_s = 1e-3, .n_decode = 1};
    eng_spec_len copying = {.first_hits = 3, .first_trials = 5, .hits = 19, .trials = 20};
    eng_spec_len flat = {.first_hits = 3, .first_trials = 5, .hits = 3, .trials = 5};
    cr_assert_geq(eng_spec_len_want(&copying, &two_rows, 16), 4);
    cr_assert_eq(eng_spec_len_want(&flat, &two_rows, 16), 1);
    /* a drafter whose position costs three rows (a draft model as large as its target) drafts
     * nothing at 90% acceptance, not even the lone row; the same drafts free of cost */
    eng_spec_len sure = {.first_hits = 9, .first_trials = 10, .hits = 9, .trials = 10};
    eng_spec_cost costly = two_rows;
    costly.draft_s = 3e-3;
    cr_assert_eq(eng_spec_len_want(&sure, &costly, 16), 0);
    cr_assert_gt(eng_spec_len_want(&sure, &two_rows, 16), 1);
    /* a drafter's position cost: its chained steps' time per step, decayed; no steps, no news */
    eng_drafter d = {0};
    eng_drafter_timed(&d, 0.03, 3);
    cr_assert_float_eq(d.position_s, 0.01, 1e-15);
    eng_drafter_timed(&d, 0.02, 1);
    cr_assert_float_eq(d.position_s, 0.8 * 0.01 + 0.2 * 0.02, 1e-15);
    eng_drafter_timed(&d, 5.0, 0);
    cr_assert_float_eq(d.position_s, 0.8 * 0.01 + 0.2 * 0.02, 1e-15, "a catch-up alone");
    /* never past draft_max; an unmeasured cost takes the prior */
    eng_spec_cost unknown = {.n_decode = 1};
    eng_spec_len_init(&l);
    for (int i = 0; i < 6; i++)
        eng_spec_len_adapt(&l, 8, 8);
    cr_assert_eq(eng_spec_len_want(&l, &unknown, 3), 3);
    cr_assert_gt(eng_spec_len_want(&l, &unknown, 16), 3);
}

Test(speculative, an_ngram_draft_is_kept_by_the_acceptance_of_its_class)
{
    cr_assert(eng_spec_class(0, false) == 0 && eng_spec_class(1, false) == 1 &&
              eng_spec_class(2, false) == 2);
    cr_assert(eng_spec_class(3, false) == 3 && eng_spec_class(9, false) == 3,
              "3 or more share a class");
    cr_assert(eng_spec_class(2, true) == 4 && eng_spec_class(3, true) == 5 &&
                  eng_spec_class(4, true) == 6 && eng_spec_class(9, true) == 6,
              "the memory's drafts have classes of their own");
    /* a copying answer: its lone-token matches missed, its 3-gram runs were taken whole */
    eng_spec_len by[ENG_SPEC_CLASSES];
    for (int c = 0; c < ENG_SPEC_CLASSES; c++)
        eng_spec_len_init(&by[c]);
    for (int i = 0; i < 6; i++) {
        eng_spec_len_adapt(&by[eng_spec_class(1, false)], 2, 0);
        eng_spec_len_adapt(&by[eng_spec_class(5, false)], 8, 8);
    }
    eng_spec_cost c = {.fixed_s = 2e-3, .token_s = 1e-3, .n_decode = 1};
    cr_assert_eq(eng_spec_len_keep(&by[1], &c, 16, 0), 0, "a 1-gram's guess is dropped");
    int32_t run = eng_spec_len_keep(&by[3], &c, 16, 0);
    cr_assert_geq(run, 8, "a 3-gram's run is verified long: %d", run);
    cr_assert_eq(eng_spec_len_keep(&by[3], &c, 5, 0), 5, "never past what was drafted");
    /* one rate for both would verify the guesses too, as long as the runs */
    eng_spec_len one;
    eng_spec_len_init(&one);
    for (int i = 0; i < 6; i++) {
        eng_spec_len_adapt(&one, 2, 0);
        eng_spec_len_adapt(&one, 8, 8);
    }
    int32_t mixed = eng_spec_len_keep(&one, &c, 16, 0);
    cr_assert_geq(mixed, 8, "a guess verified with %d rows", mixed);
    /* the request's least length: raised to it where some are kept, within what was drafted */
    eng_spec_len half = {.first_hits = 6, .first_trials = 10, .hits = 1, .trials = 10};
    int32_t some = eng_spec_len_keep(&half, &c, 16, 0);
    cr_assert(some >= 1 && some < 4, "%d", some);
    cr_assert_eq(eng_spec_len_keep(&half, &c, 16, 4), 4);
    cr_assert_eq(eng_spec_len_keep(&half, &c, 3, 4), 3, "a draft under the least stays short");
    cr_assert_eq(eng_spec_len_keep(&by[1], &c, 16, 4), 0, "none kept: the least adds none");
}

Test(speculative, a_new_sequence_starts_from_what_the_engine_has_seen_lately)
{
    eng_spec_len fresh, seen = {0};
    eng_spec_len_init(&fresh);
    eng_spec_len p = eng_spec_len_prior(&seen);
    cr_assert(p.first_hits == fresh.first_hits && p.first_trials == fresh.first_trials &&
                  p.hits == fresh.hits && p.trials == fresh.trials && p.idle == 0,
              "nothing seen: the fresh start");
    /* the last verifications took every 3-gram run whole: the next answer starts long */
    for (int i = 0; i < 20; i++)
        eng_spec_len_adapt(&seen, 8, 8);
    p = eng_spec_len_prior(&seen);
    double first, next, seen_first, seen_next;
    eng_spec_len_rates(&p, &first, &next);
    eng_spec_len_rates(&seen, &seen_first, &seen_next);
    cr_assert_float_eq(next, seen_next, 1e-12, "the rate kept (35 positions scaled to 5)");
    cr_assert_float_eq(first, seen_first, 0.01, "4.94 of 5 positions seen: %g %g", first,
                       seen_first);
    cr_assert(p.first_trials == ENG_SPEC_PRIOR_TRIALS && p.trials == ENG_SPEC_PRIOR_TRIALS,
              "weighing five positions: %g %g", p.first_trials, p.trials);
    eng_spec_cost c = {.fixed_s = 2e-3, .token_s = 1e-3, .n_decode = 1};
    eng_spec_len a = p;
    cr_assert_gt(eng_spec_len_want(&a, &c, 16), eng_spec_len_want(&fresh, &c, 16));
    /* its own verifications soon outweigh it: five refusals and it drafts nothing */
    for (int i = 0; i < 5; i++)
        eng_spec_len_adapt(&p, 4, 0);
    eng_spec_len_rates(&p, &first, &next);
    cr_assert_lt(first, 0.5, "%g", first);
    /* one verification seen: it weighs one position of five, the rest the fresh start's */
    eng_spec_len one = {0};
    eng_spec_len_adapt(&one, 1, 1);
    p = eng_spec_len_prior(&one);
    cr_assert_float_eq(p.first_hits, 1 + 0.6 * 4, 1e-12);
    cr_assert_float_eq(p.hits, 0.6 * 5, 1e-12, "no later position tried");
}

Test(speculative, kv_rollback_forgets_positions_but_never_grows)
{
    eng_kv_cache *kv;
    char msg[256];
    cr_assert_eq(eng_kv_new(&kv, &tiny_model.cfg, 1 << 20, 16, msg, sizeof msg), QL_OK, "%s", msg);
    eng_seq_kv s = {0};
    cr_assert_eq(eng_kv_reserve(kv, &s, 40), QL_OK);
    int32_t free_before = eng_kv_free_blocks(kv);
    s.n_tokens = 30; /* as a step that wrote 30 positions leaves it */
    cr_assert_eq(eng_kv_rollback(kv, &s, 31, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "31"), "%s", msg);
    cr_assert_eq(eng_kv_rollback(kv, &s, 27, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(s.n_tokens, 27);
    cr_assert_eq(s.n_blocks, 3, "the blocks stay the sequence's: the next step writes over them");
    cr_assert_eq(eng_kv_free_blocks(kv), free_before);
    s.state = 1; /* a hybrid model's recurrent state cannot go back */
    cr_assert_eq(eng_kv_rollback(kv, &s, 20, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "recurrent"), "%s", msg);
    s.state = 0;
    eng_kv_release(kv, &s);
    eng_kv_free(kv);
}

Test(speculative, a_model_without_mtp_layers_and_a_draft_without_its_model_are_refused_by_name)
{
    char msg[512];
    eng_speculative d;
    cr_assert_eq(eng_speculative_parse("draft", &d, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(d, ENG_SPEC_DRAFT);
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT};
    cr_assert_eq(eng_spec_opts_resolve(&so, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "--draft-model"), "%s", msg);
    cr_assert_eq(eng_speculative_parse("mtp", &d, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(d, ENG_SPEC_MTP);
    cr_assert_eq(eng_speculative_parse("eagle", &d, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "ngram"), "the choices are named: %s", msg);
    cr_assert_eq(eng_speculative_parse("ngram", &d, msg, sizeof msg), QL_OK);
    cr_assert_eq(d, ENG_SPEC_NGRAM);
    /* the tiny model has no mtp.* tensors: refused at the start, naming it */
    eng_engine_opts o = {.threads = 1, .kv_bytes = 1 << 20, .spec = {.drafter = ENG_SPEC_MTP}};
    eng_engine *e = NULL;
    cr_assert_eq(eng_engine_start(&e, &tiny_model, &o, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "has no MTP layers (mtp.* tensors)"), "%s", msg);
    cr_assert(strstr(msg, tiny_model.name), "the model is named: %s", msg);
    o.spec = (eng_spec_opts){.drafter = ENG_SPEC_NGRAM, .draft_max = 17};
    cr_assert_eq(eng_engine_start(&e, &tiny_model, &o, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "draft-max 17"), "%s", msg);
}

/* --- answers unchanged ------------------------------------------------------------- */

Test(speculative, greedy_answers_over_many_prompts_are_the_same_tokens)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++)
        reqs[i] = plain(prompts[i], 48);
    eng_spec_stats spec;
    expect_same_answers(reqs, N_PROMPTS, 4, &spec); /* 12 prompts, 4 at a time */
    expect_drafts_exercised(&spec);
}

/* One sequence alone: each step gives it one token and the drafts it
 * accepted, so the steps saved are exactly the tokens accepted. */
Test(speculative, every_accepted_draft_saves_a_step)
{
    uint64_t steps[2];
    eng_spec_stats spec = {0};
    for (int run = 0; run < 2; run++) {
        eng_engine *e = start(run ? ENG_SPEC_NGRAM : ENG_SPEC_OFF, 2, 0);
        eng_request r = plain("the cat sat on the mat; the cat sat on the", 48);
        outcome *o = outcomes_new(1);
        run_all(e, &r, o, 1);
        cr_assert(eng_engine_settle(e, 60), "the last step's figures are published");
        eng_engine_stats st;
        eng_engine_stats_get(e, &st);
        steps[run] = st.steps;
        spec = st.spec;
        eng_engine_stop(e);
        free(o);
    }
    cr_assert_gt(spec.accepted, 0);
    cr_assert_eq(steps[1], steps[0] - spec.accepted,
                 "%llu steps with drafts, %llu without, %llu accepted",
                 (unsigned long long)steps[1], (unsigned long long)steps[0],
                 (unsigned long long)spec.accepted);
}

/* Requests one after the other (each ends before the next is sent), on an
 * engine with so's drafts and one without: the same answers; the drafting
 * engine's figures in *spec. */
static void expect_same_answers_in_turn(eng_request *reqs, int n, const eng_spec_opts *so,
                                        eng_spec_stats *spec)
{
    outcome *off = outcomes_new(n), *on = outcomes_new(n);
    for (int run = 0; run < 2; run++) {
        eng_engine *e = start_with(run ? so : &(eng_spec_opts){.drafter = ENG_SPEC_OFF}, 2);
        for (int i = 0; i < n; i++)
            run_all(e, &reqs[i], run ? &on[i] : &off[i], 1);
        eng_engine_stats st;
        cr_assert(eng_engine_settle(e, 60));
        eng_engine_stats_get(e, &st);
        *spec = st.spec;
        eng_engine_stop(e);
    }
    expect_same_outcomes(on, off, n);
    free(off);
    free(on);
}

/* The second asking of a prompt drafts from the first's answer, which the
 * prompt lookup cannot see; with the memory off it never does. */
Test(speculative, an_answer_drafts_from_the_memory_of_earlier_answers_and_stays_the_same)
{
    eng_request reqs[4] = {plain("once upon a time there was a time", 48),
                           plain("once upon a time there was a time", 48),
                           plain("red green blue red green blue red", 48),
                           plain("red green blue red green blue red", 48)};
    eng_spec_stats spec;
    expect_same_answers_in_turn(reqs, 4, &(eng_spec_opts){.drafter = ENG_SPEC_NGRAM}, &spec);
    expect_drafts_exercised(&spec);
    cr_assert_gt(spec.memory_verified, 0, "no draft came from the memory");
    cr_assert_gt(spec.memory_accepted, 0, "no remembered token was accepted");
    cr_assert_leq(spec.memory_accepted, spec.accepted);
    cr_assert_leq(spec.memory_verified, spec.verified);
    expect_same_answers_in_turn(
        reqs, 4, &(eng_spec_opts){.drafter = ENG_SPEC_NGRAM, .memory_tokens = -1}, &spec);
    cr_assert_gt(spec.accepted, 0);
    cr_assert_eq(spec.memory_verified, 0, "--ngram-memory -1 remembers nothing");
}

Test(speculative, greedy_answers_with_logprobs_stops_penalties_and_bias_are_the_same)
{
    static const char *stop[] = {"e t", "zz"};
    static const eng_logit_bias bias[] = {{'a', 3.0f}, {'e', -2.0f}};
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 40);
        reqs[i].logprobs = true;
        reqs[i].top_logprobs = 3;
        reqs[i].stop = stop;
        reqs[i].n_stop = 2;
        reqs[i].sampling.min_tokens = i % 3 == 0 ? 12 : 0;
        reqs[i].sampling.repetition_penalty = i % 4 == 1 ? 1.3f : 0.0f;
        reqs[i].sampling.presence_penalty = i % 4 == 2 ? 0.5f : 0.0f;
        reqs[i].sampling.frequency_penalty = i % 4 == 3 ? 0.25f : 0.0f;
        if (i % 2) {
            reqs[i].sampling.logit_bias = bias;
            reqs[i].sampling.n_logit_bias = 2;
        }
    }
    eng_spec_stats spec;
    expect_same_answers(reqs, N_PROMPTS, 6, &spec);
    expect_drafts_exercised(&spec);
}

#define LIT(b, s) gr_literal((b), (s), strlen(s))

/* [ab ]{1,60}: the model's own choice among a, b and space, so drafts
 * from a prompt of them are often taken, and any other token is masked. */
static gr_grammar *ab_grammar(void)
{
    gr_builder *b = gr_builder_new(0);
    gr_expr xs[] = {LIT(b, "a"), LIT(b, "b"), LIT(b, " ")};
    gr_grammar *g = NULL;
    char msg[256];
    cr_assert_eq(gr_build(b, gr_repeat(b, gr_alt(b, xs, 3), 1, 60), &g, msg, sizeof msg), QL_OK,
                 "%s", msg);
    gr_builder_free(b);
    return g;
}

/* Greedy answers under ab_grammar, drafted as so says, against an engine without drafts. */
static void expect_grammar_answers(const eng_spec_opts *so, eng_spec_stats *spec)
{
    gr_grammar *g = ab_grammar();
    static const char *ps[] = {"a b a b a b a",           "ab ab ab ab", "aab aab aab a", "b b b b",
                               "the theme of the thesis", "ba ba ba"};
    enum { N = 6 };
    eng_request reqs[N];
    for (int i = 0; i < N; i++) {
        reqs[i] = plain(ps[i], 40);
        reqs[i].grammar = g;
    }
    expect_same_answers_with(reqs, N, 6, so, spec);
    cr_assert_gt(spec->accepted, 0, "drafts under the grammar were taken");
    gr_grammar_unref(g);
}

Test(speculative, greedy_answers_under_a_grammar_are_the_same_tokens)
{
    eng_spec_opts so = {.drafter = ENG_SPEC_NGRAM};
    eng_spec_stats spec;
    expect_grammar_answers(&so, &spec);
}

/* Greedy answers drafted as so says, two in three of them under an unmerged
 * adapter strong enough to change them, against an engine without drafts. */
static void expect_adapters_answers(const eng_spec_opts *so, eng_spec_stats *spec)
{
    char folder[700], msg[512];
    snprintf(folder, sizeof folder, "%s/adapter", tiny_dir);
    lora_fix_spec fs = lora_fix_default();
    fs.std = 0.5f; /* large enough to change the tiny model's answers */
    lora_fix_write(folder, &tiny_model.cfg, &fs);
    eng_lora *lora = NULL;
    lora_meta meta;
    cr_assert_eq(lora_load(&lora, &meta, folder, "a", &tiny_model, msg, sizeof msg), QL_OK, "%s",
                 msg);
    eng_lora_term term = {.lora = lora, .scale = 1.0f};
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 40);
        if (i % 3 != 2) { /* adapter and base rows in one batch */
            reqs[i].adapters = &term;
            reqs[i].n_adapters = 1;
        }
    }
    expect_same_answers_with(reqs, N_PROMPTS, 6, so, spec);
    eng_lora_unref(lora);
}

Test(speculative, greedy_answers_under_an_unmerged_adapter_are_the_adapters)
{
    eng_spec_opts so = {.drafter = ENG_SPEC_NGRAM};
    eng_spec_stats spec;
    expect_adapters_answers(&so, &spec);
    expect_drafts_exercised(&spec);
}

/* Seeded sampled answers (top-k, top-p, several choices) drafted as so says,
 * against an engine without drafts. */
static void expect_sampled_answers(const eng_spec_opts *so, eng_spec_stats *spec)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 40);
        reqs[i].sampling = (eng_sampling){.temperature = 0.7f,
                                          .top_k = i % 2 ? 5 : 0,
                                          .top_p = i % 3 ? 0.9f : 0.0f,
                                          .seed = 100 + (uint64_t)i};
        reqs[i].n_choices = i % 4 == 0 ? 3 : 1; /* forks of one prompt, each speculating */
    }
    /* up to 16 sequences decode together: a step past spec-max-batch would not draft, and
     * how many run together depends on when the engine thread takes the requests */
    eng_spec_opts all = *so;
    all.max_batch = 16;
    expect_same_answers_with(reqs, N_PROMPTS, 16, &all, spec);
    expect_drafts_exercised(spec);
}

Test(speculative, sampled_answers_with_a_seed_are_the_same_tokens)
{
    eng_spec_opts so = {.drafter = ENG_SPEC_NGRAM};
    eng_spec_stats spec;
    expect_sampled_answers(&so, &spec);
}

/* the model's greedy guesses, each choice with its own draft KV, sampled from as ever */
Test(speculative, sampled_answers_with_a_seed_and_a_draft_model_are_the_same_tokens)
{
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = &tiny_model, .draft_fixed = true};
    eng_spec_stats spec;
    expect_sampled_answers(&so, &spec);
    cr_assert_eq(spec.drafter, ENG_SPEC_DRAFT);
}

/*
 * The distribution test: the token at each of the first positions of many
 * sampled answers (seeds 0..N-1 with drafts, N..2N-1 without, so the two
 * sets are independent draws), compared by the total variation distance of
 * their frequencies. Over K outcomes, two samples of N from one law have an
 * expected distance of at most sqrt(2 K / (pi N)) / 2 (each frequency's
 * error has sd sqrt(p(1-p)/N) per side; Cauchy-Schwarz over the K); the
 * bound asserted is five times that, for the K the two samples show (with
 * two outcomes, four standard deviations of their difference), and top_k 2
 * keeps K small (at most 2^(j+1) at position j). Temperature 0.7 keeps the
 * tiny model near its repetitive greedy path, so drafts are often taken.
 */
Test(speculative, sampled_tokens_keep_the_models_distribution)
{
    enum { N = 1000, POS = 6, K = 2, MAX_SEEN = 128 };
    static const char *p = "hello hello hello";
    int32_t seen[POS][MAX_SEEN], counts[2][POS][MAX_SEEN], n_seen[POS] = {0};
    memset(counts, 0, sizeof counts);
    eng_spec_stats spec = {0};
    for (int run = 0; run < 2; run++) {
        eng_request *reqs = calloc(N, sizeof *reqs);
        outcome *out = outcomes_new(N);
        for (int i = 0; i < N; i++) {
            reqs[i] = plain(p, POS);
            reqs[i].sampling =
                (eng_sampling){.temperature = 0.7f, .top_k = K, .seed = (uint64_t)(run * N + i)};
            reqs[i].sampling.ignore_eos = true;
        }
        eng_engine *e = start(run == 0 ? ENG_SPEC_NGRAM : ENG_SPEC_OFF, 8, 0);
        run_all(e, reqs, out, N);
        if (run == 0) {
            eng_engine_stats st;
            cr_assert(eng_engine_settle(e, 60));
            eng_engine_stats_get(e, &st);
            spec = st.spec;
        }
        eng_engine_stop(e);
        for (int i = 0; i < N; i++) {
            cr_assert_eq(out[i].n[0], POS);
            for (int j = 0; j < POS; j++) {
                int k = 0;
                while (k < n_seen[j] && seen[j][k] != out[i].tokens[0][j])
                    k++;
                cr_assert_lt(k, MAX_SEEN, "position %d: more outcomes than %d", j, MAX_SEEN);
                if (k == n_seen[j])
                    seen[j][n_seen[j]++] = out[i].tokens[0][j];
                counts[run][j][k]++;
            }
        }
        free(reqs);
        free(out);
    }
    cr_assert_gt(spec.accepted, 0, "drafts were taken");
    cr_assert_gt(spec.verified, spec.accepted, "and some rejected");
    for (int j = 0; j < POS; j++) {
        double tv = 0;
        for (int k = 0; k < n_seen[j]; k++)
            tv += fabs((double)counts[0][j][k] - (double)counts[1][j][k]) / N;
        tv /= 2;
        double bound = 5 * sqrt(2.0 * n_seen[j] / (M_PI * N)) / 2;
        cr_log_info("position %d: %d outcomes, total variation %.4f, bound %.4f", j, n_seen[j], tv,
                    bound);
        cr_expect_leq(tv, bound, "position %d: total variation %.4f over %d outcomes", j, tv,
                      n_seen[j]);
    }
}

/* --- the scheduler's choices ------------------------------------------------------ */

Test(speculative, a_batch_past_spec_max_batch_drafts_nothing)
{
    eng_engine *e = start(ENG_SPEC_NGRAM, 4, 1);
    engine_hold_after(e, 0); /* both are admitted and decode in the same steps */
    enum { N = 2 };
    eng_request reqs[N];
    outcome *out = outcomes_new(N);
    for (int i = 0; i < N; i++) {
        reqs[i] = plain("a b c a b c a b", 16);
        reqs[i].sampling.ignore_eos = true; /* both run to the same length */
        reqs[i].sampling.seed = (uint64_t)i;
    }
    char msg[256];
    for (int i = 0; i < N; i++) {
        reqs[i].on_token = on_token;
        reqs[i].on_done = on_done;
        reqs[i].user = &out[i];
        cr_assert_eq(eng_engine_submit(e, &reqs[i], NULL, msg, sizeof msg), QL_OK, "%s", msg);
    }
    engine_hold_after(e, -1);
    for (int i = 0; i < N; i++)
        wait_done(&out[i]);
    eng_engine_stats st;
    cr_assert(eng_engine_settle(e, 60));
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.spec.drafts, 0, "two decoding past a max batch of one: no drafts");
    eng_engine_stop(e);
    /* alone, the same prompt drafts */
    e = start(ENG_SPEC_NGRAM, 4, 1);
    outcome *one = outcomes_new(1);
    run_all(e, reqs, one, 1);
    cr_assert(eng_engine_settle(e, 60));
    eng_engine_stats_get(e, &st);
    cr_assert_gt(st.spec.drafts, 0);
    eng_engine_stop(e);
    free(out);
    free(one);
}

Test(speculative, the_prefix_cache_keeps_only_accepted_tokens)
{
    /* a chat's next turn: its prompt is the first prompt and its answer; on
     * the speculating engine it starts past the kept blocks of that answer
     * and still gives the tokens an engine without speculation gives */
    static const char *p = "the cat sat on the mat; the cat sat on the";
    eng_request first = plain(p, 48);
    outcome *o = outcomes_new(1);
    eng_engine *e = start(ENG_SPEC_NGRAM, 4, 0);
    run_all(e, &first, o, 1);
    eng_engine_stats st;
    cr_assert(eng_engine_settle(e, 60));
    eng_engine_stats_get(e, &st);
    cr_assert_gt(st.spec.verified, st.spec.accepted, "drafts were rejected");
    int32_t ids[256];
    size_t n = 0;
    int32_t *enc = NULL;
    char msg[256];
    cr_assert_eq(tok_encode(tiny_model.tok, p, strlen(p), tok_adds_bos(tiny_model.tok), true, &enc,
                            &n, msg, sizeof msg),
                 QL_OK, "%s", msg);
    memcpy(ids, enc, n * sizeof *ids);
    free(enc);
    memcpy(ids + n, o->tokens[0], (size_t)o->n[0] * sizeof *ids);
    eng_request next = {
        .prompt_tokens = ids, .n_prompt_tokens = n + (size_t)o->n[0], .max_new_tokens = 24};
    outcome *on = outcomes_new(1), *off = outcomes_new(1);
    run_all(e, &next, on, 1);
    cr_assert_gt(on->usage.cached_tokens, (int32_t)n, "the answer's blocks were kept");
    eng_engine_stop(e);
    e = start(ENG_SPEC_OFF, 4, 0);
    run_all(e, &next, off, 1);
    eng_engine_stop(e);
    cr_assert_eq(on->n[0], off->n[0]);
    cr_assert(memcmp(on->tokens[0], off->tokens[0], (size_t)on->n[0] * sizeof(int32_t)) == 0,
              "a kept block held a rejected draft's KV");
    free(o);
    free(on);
    free(off);
}

/* A tiny Qwen3.5 fixture (tests/fixtures/name, with the tiny model's
 * tokenizer) loaded from a fresh dir; hybrid_unload frees both. */
static void fixture_load(eng_model *m, char *dir, size_t dir_cap, const char *name)
{
    char msg[1024];
    test_tmpdir(dir, dir_cap);
    cr_assert(dir[0]);
    tiny_fixture_folder(name, dir);
    eng_load_opts lo = {.path = dir};
    cr_assert_eq(eng_model_load(m, &lo, msg, sizeof msg), 0, "%s", msg);
}

/* The tiny hybrid model (qwen35_tiny). */
static void hybrid_load(eng_model *m, char *dir, size_t dir_cap)
{
    fixture_load(m, dir, dir_cap, "qwen35_tiny");
}

static void hybrid_unload(eng_model *m, const char *dir)
{
    eng_model_free(m);
    test_rmtree(dir);
}

/* The prompts as greedy requests of 32 tokens with logprobs (top 2), the odd ones biased by +30
 * towards the two tokens of few: the model's own logits (so its state) still choose between the
 * two, and the logprobs are raw. */
static void biased_requests(eng_request *reqs, const eng_logit_bias *few)
{
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 32);
        reqs[i].logprobs = true;
        reqs[i].top_logprobs = 2;
        if (i % 2) {
            reqs[i].sampling.logit_bias = few;
            reqs[i].sampling.n_logit_bias = 2;
        }
    }
}

/* A hybrid model's recurrent state takes in rejected drafts too: the
 * rollback puts back the state its step kept after the last accepted row.
 * Four sequences at a time, so several drafting ones share a step (each
 * with its own slot of row states), over prompts that repeat, so drafts
 * are both accepted and rejected: the answers, logprobs bit for bit, are
 * the ones without speculation. */
Test(speculative, a_hybrid_model_rolls_its_recurrent_state_back_to_the_same_answers)
{
    char dir[512];
    eng_model m;
    hybrid_load(&m, dir, sizeof dir);
    cr_assert_gt(m.cfg.linear.n_layers, 0);
    /* the tiny hybrid model's random weights never repeat themselves: a bias towards two
     * tokens makes odd requests' answers runs over them, which the drafter finds */
    static const eng_logit_bias few[] = {{65, 30.0f}, {66, 30.0f}};
    eng_request reqs[N_PROMPTS];
    biased_requests(reqs, few);
    eng_spec_stats spec;
    eng_spec_opts so = {.drafter = ENG_SPEC_NGRAM};
    expect_same_answers_on(&m, reqs, N_PROMPTS, 4, &so, &spec);
    cr_assert_str_empty(spec.off_reason);
    expect_drafts_exercised(&spec);
    hybrid_unload(&m, dir);
}

/* --- the draft model --------------------------------------------------------------- */

/* A draft model beside tiny_model: tiny_default() with one layer and its
 * own random weights (seed), changed further by edit when not NULL, written
 * in a fresh dir and loaded as tiny_model is (NF4 linears). */
static void draft_load(eng_model *m, char *dir, size_t dir_cap, uint64_t seed,
                       void (*edit)(tiny_spec *s, const char *dir))
{
    test_tmpdir(dir, dir_cap);
    cr_assert(dir[0]);
    tiny_spec s = tiny_default();
    s.layers = 1;
    s.seed = seed;
    if (edit)
        edit(&s, NULL);
    tiny_write_hf(dir, &s);
    if (edit)
        edit(&s, dir);
    eng_load_opts o = {.path = dir, .quant = "nf4"};
    char msg[512];
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

static void draft_unload(eng_model *m, const char *dir)
{
    eng_model_free(m);
    test_rmtree(dir);
}

/* The figures of an engine drafting with a model: drafts verified, and the
 * acceptance histogram adds up. */
static void expect_model_drafts(const eng_spec_stats *s)
{
    cr_assert_eq(s->drafter, ENG_SPEC_DRAFT);
    cr_assert_gt(s->drafts, 0, "no draft was verified");
    cr_assert_geq(s->drafted, s->verified);
    uint64_t n = 0, sum = 0;
    for (int i = 0; i <= ENG_SPEC_MAX_DRAFT; i++) {
        n += s->accepted_len[i];
        sum += (uint64_t)i * s->accepted_len[i];
    }
    cr_assert_eq(n, s->drafts);
    cr_assert_eq(sum, s->accepted);
}

/* Greedy answers over the prompts, drafted by dm, against an engine without drafts. */
static void expect_same_answers_drafted_by(const eng_model *dm, eng_spec_stats *spec)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++)
        reqs[i] = plain(prompts[i], 48);
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = dm, .draft_fixed = true};
    expect_same_answers_with(reqs, N_PROMPTS, 4, &so, spec); /* 4 at a time, drafting together */
    expect_model_drafts(spec);
    cr_log_info("draft model: %llu drafted, %llu verified, %llu accepted",
                (unsigned long long)spec->drafted, (unsigned long long)spec->verified,
                (unsigned long long)spec->accepted);
}

Test(speculative, a_different_draft_model_leaves_greedy_answers_the_same_tokens)
{
    /* another model of one layer: its guesses are the target's by chance alone */
    char dir[512], msg[512];
    eng_model dm;
    draft_load(&dm, dir, sizeof dir, 7, NULL);
    eng_spec_stats spec;
    expect_same_answers_drafted_by(&dm, &spec);
    cr_assert_gt(spec.verified, spec.accepted, "another model's drafts were rejected");
    draft_unload(&dm, dir);
    /* the target's own weights unquantized (it runs NF4): a close draft, mostly right */
    eng_load_opts lo = {.path = tiny_dir};
    cr_assert_eq(eng_model_load(&dm, &lo, msg, sizeof msg), 0, "%s", msg);
    expect_same_answers_drafted_by(&dm, &spec);
    cr_assert_gt(spec.accepted, 0, "a close draft's tokens were accepted");
    cr_assert_gt(spec.verified, spec.accepted, "and some rejected: the draft KV rolled back");
    eng_model_free(&dm);
}

Test(speculative, the_model_as_its_own_draft_has_every_draft_accepted)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++)
        reqs[i] = plain(prompts[i], 48);
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = &tiny_model, .draft_fixed = true};
    eng_spec_stats spec;
    expect_same_answers_with(reqs, N_PROMPTS, 4, &so, &spec);
    expect_model_drafts(&spec);
    /* its greedy guesses are the target's greedy tokens: every verified one is taken, but for a
     * draft past the token that ended an answer (EOS), at most one per request */
    cr_assert_gt(spec.accepted, 0);
    cr_assert_leq(spec.verified - spec.accepted, N_PROMPTS, "%llu verified, %llu accepted",
                  (unsigned long long)spec.verified, (unsigned long long)spec.accepted);
    cr_assert_eq(spec.drafted, spec.verified, "nothing cut");
}

/* --draft-fixed: every step drafts draft_max tokens whatever the cost rule would choose. The
 * model as its own draft has each one accepted, so a 21-token answer (EOS a token like another)
 * is its first token, then four verifications of 4 drafts plus the token after them. */
Test(speculative, a_fixed_draft_length_drafts_draft_max_every_step)
{
    eng_request r = plain(prompts[0], 21);
    r.sampling.ignore_eos = true;
    eng_spec_opts so = {
        .drafter = ENG_SPEC_DRAFT, .draft_model = &tiny_model, .draft_max = 4, .draft_fixed = true};
    eng_spec_stats spec;
    expect_same_answers_with(&r, 1, 1, &so, &spec);
    cr_assert_eq(spec.drafts, 4, "%llu verifications", (unsigned long long)spec.drafts);
    cr_assert_eq(spec.drafted, 16);
    cr_assert_eq(spec.accepted, 16);
    cr_assert_eq(spec.accepted_len[4], 4);
}

Test(speculative, greedy_answers_under_an_unmerged_adapter_with_a_draft_model_are_the_adapters)
{
    /* the draft is the base model: the adapter applies in the verification only */
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = &tiny_model, .draft_fixed = true};
    eng_spec_stats spec;
    expect_adapters_answers(&so, &spec);
    expect_model_drafts(&spec);
    cr_assert_gt(spec.accepted, 0);
    cr_assert_gt(spec.verified, spec.accepted, "the adapter's answers reject base drafts");
}

Test(speculative, greedy_answers_under_a_grammar_with_a_draft_model_are_the_same_tokens)
{
    /* the draft knows no grammar: its first token is cut where the mask refuses it */
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = &tiny_model, .draft_fixed = true};
    eng_spec_stats spec;
    expect_grammar_answers(&so, &spec);
    expect_model_drafts(&spec);
    cr_assert_gt(spec.drafted, spec.verified, "the grammar cut drafts");
    cr_log_info("grammar, draft model: %llu drafted, %llu verified, %llu accepted",
                (unsigned long long)spec.drafted, (unsigned long long)spec.verified,
                (unsigned long long)spec.accepted);
}

/* Four more rows in the draft's config: its vocabulary is larger. */
static void larger_vocab(tiny_spec *s, const char *dir)
{
    if (!dir)
        s->vocab = 264;
}

/* The draft's tokenizer names its special token otherwise. */
static void renamed_token(tiny_spec *s, const char *dir)
{
    (void)s;
    if (!dir)
        return;
    char path[700];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    size_t len;
    char *text = test_read_file(path, &len);
    char *at = strstr(text, "<|endoftext|>");
    cr_assert(at);
    memcpy(at, "<|endoftxet|>", 13);
    test_write_text(path, text);
    free(text);
}

/* Starting an engine drafting with draft gives QL_EINVAL naming want. */
static void expect_refused(const eng_model *draft, const char *want)
{
    eng_engine_opts o = {.threads = 1,
                         .kv_bytes = 1 << 20,
                         .spec = {.drafter = ENG_SPEC_DRAFT, .draft_model = draft}};
    eng_engine *e = NULL;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &tiny_model, &o, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, want), "%s", msg);
}

Test(speculative, a_draft_model_with_another_vocabulary_is_refused_naming_the_difference)
{
    char dir[512];
    eng_model dm;
    draft_load(&dm, dir, sizeof dir, 7, larger_vocab);
    expect_refused(&dm, "264 tokens");
    draft_unload(&dm, dir);
    draft_load(&dm, dir, sizeof dir, 7, renamed_token);
    expect_refused(&dm, "token 259: \"<|endoftxet|>\" in the draft model");
    draft_unload(&dm, dir);
    /* a hybrid draft model: its recurrent state could not follow a rollback */
    hybrid_load(&dm, dir, sizeof dir);
    expect_refused(&dm, "draft model has linear-attention");
    hybrid_unload(&dm, dir);
}

/* One step of s (its kv) over tokens at pos, keeping row states in slot
 * rows (0: none); the step's logits in out (vocab floats). */
static int hybrid_step(eng_backend *b, eng_seq_kv *s, const int32_t *tokens, int32_t n, int32_t pos,
                       int32_t rows, float *out, char *msg, size_t msg_len)
{
    eng_step_seq q = {.kv = s, .tokens = tokens, .n_tokens = n, .pos = pos, .row_states = rows};
    return eng_backend_forward(b, &q, 1, out, NULL, msg, msg_len);
}

/* The kv cache's row states directly: after a step that kept them, a
 * rollback leaves the state the shorter history gives (the next step's
 * logits bit for bit those of a sequence fed only that history); what
 * was not kept, or a slot the cache lacks, is refused by name. */
Test(speculative, a_hybrid_rollback_restores_the_kept_row_and_refuses_the_rest)
{
    char dir[512], msg[512];
    eng_model m;
    hybrid_load(&m, dir, sizeof dir);
    eng_backend *b = NULL;
    eng_backend_opts o = {.device = ENG_DEVICE_CPU,
                          .threads = 1,
                          .max_tokens = 16,
                          .max_seqs = 2,
                          .kv_bytes = (size_t)4 << 20};
    cr_assert_eq(eng_backend_new(&b, &m, &o, msg, sizeof msg), 0, "%s", msg);
    eng_kv_cache *kv = eng_backend_kv(b);
    size_t bytes = 0;
    cr_assert_eq(eng_kv_row_states_new(kv, 1, 3, &bytes, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(bytes, 3 * eng_kv_state_bytes(kv));
    cr_assert_eq(eng_kv_row_states_new(kv, 1, 3, &bytes, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "made already"), "%s", msg);
    size_t V = (size_t)m.cfg.vocab_size;
    float *got = malloc(V * sizeof(float)), *want = malloc(V * sizeof(float));
    const int32_t prompt[] = {1, 72, 101, 108, 108}, drafts[] = {7, 200, 258, 44};
    eng_seq_kv a = {0}, c = {0};
    cr_assert_eq(eng_kv_reserve(kv, &a, 16), QL_OK);
    cr_assert_eq(eng_kv_reserve(kv, &c, 16), QL_OK);
    cr_assert_eq(hybrid_step(b, &a, prompt, 5, 0, 0, got, msg, sizeof msg), QL_OK, "%s", msg);
    /* a slot the cache does not have, and more rows than a slot keeps */
    cr_assert_eq(hybrid_step(b, &a, drafts, 4, 5, 2, got, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "row states"), "%s", msg);
    cr_assert_eq(hybrid_step(b, &a, drafts, 4, 5, 1, got, msg, sizeof msg), QL_OK, "%s", msg);
    /* four rows verified, the first two kept: back to position 7 */
    cr_assert_eq(eng_kv_rollback(kv, &a, 7, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(a.n_tokens, 7);
    /* the slot was spent: going back further is refused */
    cr_assert_eq(eng_kv_rollback(kv, &a, 6, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "kept no row state for position 5"), "%s", msg);
    cr_assert_eq(hybrid_step(b, &a, drafts + 3, 1, 7, 0, got, msg, sizeof msg), QL_OK, "%s", msg);
    /* the same history fed without drafts */
    cr_assert_eq(hybrid_step(b, &c, prompt, 5, 0, 0, want, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(hybrid_step(b, &c, drafts, 2, 5, 0, want, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(hybrid_step(b, &c, drafts + 3, 1, 7, 0, want, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert(memcmp(got, want, V * sizeof(float)) == 0,
              "the rolled-back state gives the shorter history's logits");
    eng_kv_release(kv, &a);
    eng_kv_release(kv, &c);
    free(got);
    free(want);
    eng_backend_free(b);
    hybrid_unload(&m, dir);
}

/* A hybrid target rolls its recurrent state back as it does under n-gram drafts; the tiny
 * model (the same vocabulary) drafts for it, so nearly every draft is rejected at its first
 * token and the state goes back to the one after the verified token's row. */
Test(speculative, a_draft_model_drafts_for_a_hybrid_target_to_the_same_answers)
{
    char dir[512];
    eng_model m;
    hybrid_load(&m, dir, sizeof dir);
    eng_request reqs[4];
    for (int i = 0; i < 4; i++)
        reqs[i] = plain(prompts[i], 16);
    eng_spec_stats spec;
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = &tiny_model, .draft_fixed = true};
    expect_same_answers_on(&m, reqs, 4, 2, &so, &spec);
    cr_assert_str_empty(spec.off_reason);
    cr_assert_gt(spec.verified, spec.accepted, "drafts were rejected: the state rolled back");
    hybrid_unload(&m, dir);
}

/* One job for draft d: h's guesses into out (max of them) in kv. */
static eng_draft_job draft_job(eng_history h, eng_seq_kv *kv, int32_t *out)
{
    return (eng_draft_job){.h = h, .max = 4, .reserve = 128, .kv = kv, .out = out};
}

Test(speculative, a_rolled_back_draft_kv_drafts_as_a_fresh_one)
{
    char dir[512], msg[512];
    eng_model dm;
    draft_load(&dm, dir, sizeof dir, 7, NULL);
    eng_drafter d;
    eng_spec_opts so = {.drafter = ENG_SPEC_DRAFT, .draft_model = &dm};
    cr_assert_eq(eng_drafter_init(&d, &so, msg, sizeof msg), QL_OK, "%s", msg);
    eng_draft_sizes sz = {.threads = 2,
                          .max_tokens = 64,
                          .max_seqs = 4,
                          .block_tokens = 16,
                          .target_kv_bytes = 1 << 20};
    cr_assert_eq(eng_drafter_start(&d, &tiny_model, &sz, msg, sizeof msg), QL_OK, "%s", msg);
    const char *p = "the cat sat on the mat; the cat sat on the";
    int32_t *prompt = NULL;
    size_t n = 0;
    cr_assert_eq(
        tok_encode(tiny_model.tok, p, strlen(p), false, true, &prompt, &n, msg, sizeof msg), QL_OK,
        "%s", msg);
    eng_seq_kv a = {0}, b = {0};
    int32_t first[4], again[4], fresh[4];
    eng_draft_job j = draft_job((eng_history){prompt, (int32_t)n, NULL, 0}, &a, first);
    d.ops->draft(&d, &j, 1);
    cr_assert_eq(j.n, 4);
    cr_assert_eq(a.n_tokens, (int32_t)n + 3, "the prompt and three drafts fed");
    /* the target took the first draft and sampled another token than the second */
    int32_t answer[] = {first[0], (first[1] + 1) % 256};
    eng_drafter_rollback(&d, &a, NULL, (int32_t)n + 1);
    cr_assert_eq(a.n_tokens, (int32_t)n + 1);
    eng_history h = {prompt, (int32_t)n, answer, 2};
    /* the rolled back sequence and a fresh one draft in the same steps: one takes in what each
     * has not seen (a token, the whole history), then one per further drafted position */
    eng_draft_job jobs[2] = {draft_job(h, &a, again), draft_job(h, &b, fresh)};
    uint64_t steps = eng_drafter_steps(&d);
    d.ops->draft(&d, jobs, 2);
    cr_assert_eq(eng_drafter_steps(&d) - steps, 4,
                 "%llu draft steps for two sequences' four tokens",
                 (unsigned long long)(eng_drafter_steps(&d) - steps));
    cr_assert_eq(jobs[0].n, 4);
    cr_assert_eq(jobs[1].n, 4);
    cr_assert(memcmp(again, fresh, sizeof again) == 0, "%d %d %d %d, fresh %d %d %d %d", again[0],
              again[1], again[2], again[3], fresh[0], fresh[1], fresh[2], fresh[3]);
    cr_assert_eq(a.n_tokens, b.n_tokens);
    eng_drafter_release(&d, &a, NULL);
    eng_drafter_release(&d, &b, NULL);
    cr_assert_eq(eng_kv_free_blocks(eng_drafter_kv(&d)), eng_kv_total_blocks(eng_drafter_kv(&d)));
    eng_drafter_free(&d);
    free(prompt);
    draft_unload(&dm, dir);
}

/* --- one request's say, and its own figures -------------------------------------- */

Test(speculative, each_requests_drafts_sum_to_the_engines_and_one_asking_none_has_none)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 48);
        reqs[i].spec.off = i % 3 == 2; /* every third asks for no drafts */
    }
    reqs[0].n_choices = 2; /* a request's figures are its choices' together */
    reqs[0].sampling = (eng_sampling){.temperature = 0.8f, .seed = 7};
    eng_engine *e = start(ENG_SPEC_NGRAM, 4, 0);
    outcome *out = outcomes_new(N_PROMPTS);
    run_all(e, reqs, out, N_PROMPTS);
    cr_assert(eng_engine_settle(e, 60), "the last step's figures are published");
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    eng_engine_stop(e);
    expect_drafts_exercised(&st.spec);
    int64_t drafted = 0, accepted = 0;
    int speculated = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        const eng_spec_usage *u = &out[i].usage.spec;
        cr_assert_leq(u->accepted, u->drafted, "request %d", i);
        cr_assert_leq(u->accepted, out[i].usage.generated_tokens, "request %d", i);
        if (reqs[i].spec.off)
            cr_assert(u->drafted == 0 && u->accepted == 0, "request %d asked for no drafts", i);
        drafted += u->drafted;
        accepted += u->accepted;
        speculated += u->drafted > 0;
    }
    cr_assert_gt(speculated, 1);
    cr_assert_eq((uint64_t)drafted, st.spec.verified, "%lld drafted, %llu verified",
                 (long long)drafted, (unsigned long long)st.spec.verified);
    cr_assert_eq((uint64_t)accepted, st.spec.accepted);
    free(out);
}

Test(speculative, requests_asking_for_no_drafts_draft_nothing_and_answer_the_same)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 48);
        reqs[i].spec.off = true;
    }
    eng_spec_stats spec;
    expect_same_answers(reqs, N_PROMPTS, 4, &spec);
    cr_assert_eq(spec.drafter, ENG_SPEC_NGRAM, "the engine speculates: the requests said no");
    cr_assert_eq(spec.drafted, 0, "not even the probe after a long idle stretch");
    cr_assert_eq(spec.drafts, 0);
}

/* A request's draft_max lowers its drafts (one token each: as many verified as verifications);
 * its draft_min drops shorter drafts (each verification then verifies at least that many); the
 * answers stay the engine's without drafts. */
Test(speculative, a_requests_draft_bounds_hold_and_answers_stay_the_same)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        reqs[i] = plain(prompts[i], 48);
        reqs[i].spec.draft_max = 1;
    }
    eng_spec_stats spec;
    expect_same_answers(reqs, N_PROMPTS, 4, &spec);
    cr_assert_gt(spec.drafts, 0);
    cr_assert_eq(spec.verified, spec.drafts, "one drafted token per verification");
    for (int i = 0; i < N_PROMPTS; i++)
        reqs[i].spec = (eng_spec_request){.draft_min = 3};
    expect_same_answers(reqs, N_PROMPTS, 4, &spec);
    cr_assert_gt(spec.drafts, 0);
    cr_assert_geq(spec.verified, 3 * spec.drafts, "no draft shorter than 3 was verified");
    cr_assert_gt(spec.drafted, spec.verified, "shorter drafts were made, and dropped");
}

Test(speculative, a_requests_draft_bounds_are_checked_and_bounded_to_the_engines)
{
    int32_t max, min;
    eng_spec_request_bounds(&(eng_spec_request){.draft_max = 16, .draft_min = 9}, 4, &max, &min);
    cr_assert(max == 4 && min == 4, "never past the engine's: %d %d", max, min);
    eng_spec_request_bounds(&(eng_spec_request){.draft_max = 2}, 4, &max, &min);
    cr_assert(max == 2 && min == 0);
    eng_spec_request_bounds(&(eng_spec_request){0}, 4, &max, &min);
    cr_assert(max == 4 && min == 0, "the zero value: the engine's");
    eng_spec_request_bounds(&(eng_spec_request){.off = true, .draft_min = 2}, 4, &max, &min);
    cr_assert(max == 0 && min == 0, "off drafts nothing");
    eng_engine *e = start(ENG_SPEC_NGRAM, 2, 0);
    char msg[256];
    eng_request r = plain("a b a b", 4);
    r.spec.draft_max = ENG_SPEC_MAX_DRAFT + 1;
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "draft_max 17"), "%s", msg);
    r.spec = (eng_spec_request){.draft_max = 2, .draft_min = 3};
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "draft_min 3"), "%s", msg);
    r.spec = (eng_spec_request){.draft_min = -1};
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "draft_min -1"), "%s", msg);
    eng_engine_stop(e);
}

/* --- the model's own MTP layers ---------------------------------------------------- */

/* The target's hidden states of tokens (n of them, at pos of its sequence s on backend b) into
 * rows, as the engine's steps hand them to the mtp drafter d. */
static void target_rows(eng_backend *b, eng_drafter *d, eng_seq_kv *s, eng_draft_rows *rows,
                        const int32_t *tokens, int32_t n, int32_t pos)
{
    char msg[512];
    float *out = eng_drafter_hidden_out(d, rows, pos, n);
    cr_assert(out, "rows at %d: none (lost %d)", pos, rows->lost);
    eng_step_seq q = {.kv = s, .tokens = tokens, .n_tokens = n, .pos = pos, .hidden_out = out};
    float *logits = malloc((size_t)256 * 1024);
    cr_assert_eq(eng_backend_forward(b, &q, 1, logits, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    free(logits);
}

/* The mtp drafter on its own, beside a target stepped by hand: a draft feeds the target's
 * hidden states it has not seen and chains the rest, after which its KV holds the target's
 * rows alone; a forked choice's copy of the prompt's rows drafts the same; after a
 * verification that took one draft of four, the rollback drops the rejected rows, and the
 * next draft is the one a fresh sequence makes whose rows came from one target step and
 * were taken in without a draft (eng_drafter_feed) but for the last. Every MTP
 * KV block comes back at the end; a target without MTP layers, or on CUDA, is refused by
 * name. */
Test(speculative, an_mtp_draft_rolls_back_to_the_targets_rows_and_drafts_as_a_fresh_one)
{
    char dir[512], msg[512];
    eng_model m;
    fixture_load(&m, dir, sizeof dir, "qwen35_mtp_tiny");
    cr_assert_eq(m.mtp.n_layers, 1);
    eng_backend *b = NULL;
    eng_backend_opts bo = {.device = ENG_DEVICE_CPU,
                           .threads = 2,
                           .max_tokens = 64,
                           .max_seqs = 4,
                           .kv_bytes = (size_t)4 << 20};
    cr_assert_eq(eng_backend_new(&b, &m, &bo, msg, sizeof msg), QL_OK, "%s", msg);
    eng_kv_cache *tkv = eng_backend_kv(b);
    eng_drafter d;
    eng_spec_opts so = {.drafter = ENG_SPEC_MTP, .draft_fixed = true};
    cr_assert_eq(eng_drafter_init(&d, &so, msg, sizeof msg), QL_OK, "%s", msg);
    eng_draft_sizes sz = {.threads = 2,
                          .max_tokens = 64,
                          .max_seqs = 4,
                          .block_tokens = 16,
                          .target_kv_bytes = 1 << 20,
                          .device = ENG_DEVICE_CUDA};
    cr_assert_eq(eng_drafter_start(&d, &m, &sz, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "CPU backend only"), "%s", msg);
    sz.device = ENG_DEVICE_CPU;
    cr_assert_eq(eng_drafter_start(&d, &tiny_model, &sz, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "has no MTP layers"), "%s", msg);
    cr_assert_eq(eng_drafter_start(&d, &m, &sz, msg, sizeof msg), QL_OK, "%s", msg);
    eng_kv_cache *mkv = eng_drafter_kv(&d);
    const int32_t prompt[] = {1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100};
    const int32_t n = (int32_t)(sizeof prompt / sizeof *prompt);
    eng_seq_kv ta = {0}, tb = {0}, a = {0}, bkv = {0}, ckv = {0};
    eng_draft_rows ra = {0}, rb = {0}, rc = {0}, late = {0};
    cr_assert_eq(eng_kv_reserve(tkv, &ta, 64), QL_OK);
    cr_assert_eq(eng_kv_reserve(tkv, &tb, 64), QL_OK);
    // the prompt's prefill, then a first token sampled: the MTP drafts four after it, for the
    // first choice and a second forked from it
    target_rows(b, &d, &ta, &ra, prompt, n, 0);
    eng_drafter_fork(&d, &rc, &ra, &a);
    cr_assert_eq(rc.n, n);
    int32_t answer[3] = {33}, first[4], forked[4], again[4], fresh[4];
    eng_history h0 = {prompt, n, answer, 1};
    eng_draft_job one[2] = {
        {.h = h0, .max = 4, .reserve = 64, .kv = &a, .rows = &ra, .out = first},
        {.h = h0, .max = 4, .reserve = 64, .kv = &ckv, .rows = &rc, .out = forked}};
    uint64_t steps = eng_drafter_steps(&d);
    d.ops->draft(&d, one, 2);
    cr_assert_eq(one[0].n, 4);
    cr_assert_eq(one[1].n, 4);
    cr_assert(memcmp(first, forked, sizeof first) == 0, "the fork drafts as its first choice");
    cr_assert_eq(eng_drafter_steps(&d) - steps, 4, "one step over the rows, three chained");
    eng_drafter_fork(&d, &late, &ra, &a);
    cr_assert(late.lost, "a fork after the MTP fed its first choice has no rows to copy");
    cr_assert_eq(a.n_tokens, n, "the MTP keeps the target's %d rows, not its own guesses", n);
    cr_assert_eq(ra.pos, n);
    cr_assert_eq(ra.n, 0);
    // the target verifies the first token and the drafts; it takes the first draft and samples
    // another token than the second
    const int32_t verify[] = {answer[0], first[0], first[1], first[2], first[3]};
    target_rows(b, &d, &ta, &ra, verify, 5, n);
    cr_assert_eq(ra.n, 5);
    answer[1] = first[0];
    answer[2] = (first[1] + 1) % 256;
    eng_drafter_rollback(&d, &a, &ra, n + 2);
    cr_assert_eq(ra.n, 2, "the rejected drafts' rows are dropped");
    cr_assert_eq(a.n_tokens, n);
    // a fresh sequence: the same history, its target rows from one prefill
    const int32_t history[] = {1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 0};
    int32_t hist[14];
    memcpy(hist, history, sizeof hist);
    hist[n + 1] = first[0];
    target_rows(b, &d, &tb, &rb, hist, n + 2, 0);
    eng_history h = {prompt, n, answer, 3};
    // which the MTP takes in without a draft, but for the last row the next draft starts from
    eng_draft_job feed = {.h = h, .max = 1, .reserve = 64, .kv = &bkv, .rows = &rb};
    eng_drafter_feed(&d, &feed, 1);
    cr_assert_eq(bkv.n_tokens, n + 1);
    cr_assert_eq(rb.pos, n + 1);
    cr_assert_eq(rb.n, 1);
    eng_draft_job jobs[2] = {
        {.h = h, .max = 4, .reserve = 64, .kv = &a, .rows = &ra, .out = again},
        {.h = h, .max = 4, .reserve = 64, .kv = &bkv, .rows = &rb, .out = fresh}};
    steps = eng_drafter_steps(&d);
    d.ops->draft(&d, jobs, 2);
    cr_assert_eq(eng_drafter_steps(&d) - steps, 4, "both in the same steps");
    cr_assert_eq(jobs[0].n, 4);
    cr_assert_eq(jobs[1].n, 4);
    cr_assert(memcmp(again, fresh, sizeof again) == 0, "%d %d %d %d, fresh %d %d %d %d", again[0],
              again[1], again[2], again[3], fresh[0], fresh[1], fresh[2], fresh[3]);
    cr_assert_eq(a.n_tokens, n + 2);
    cr_assert_eq(bkv.n_tokens, n + 2);
    // rows that do not follow what the MTP has: lost, and no draft for them
    cr_assert_null(eng_drafter_hidden_out(&d, &rb, n + 5, 1));
    cr_assert(rb.lost);
    eng_drafter_release(&d, &a, &ra);
    eng_drafter_release(&d, &bkv, &rb);
    eng_drafter_release(&d, &ckv, &rc);
    cr_assert_eq(eng_kv_free_blocks(mkv), eng_kv_total_blocks(mkv), "every MTP block came back");
    cr_assert_null(ra.rows);
    eng_drafter_free(&d);
    eng_kv_release(tkv, &ta);
    eng_kv_release(tkv, &tb);
    eng_backend_free(b);
    hybrid_unload(&m, dir);
}

/* Greedy answers of m over the prompts, four at a time (so several sequences draft in one MTP
 * step), with logprobs, odd ones biased towards tokens 0 and 65, one of them with two choices,
 * against an engine without speculation; the MTP's figures into *spec. */
static void expect_same_answers_drafted_by_mtp(const eng_model *m, eng_spec_stats *spec)
{
    static const eng_logit_bias few[] = {{0, 30.0f}, {65, 30.0f}};
    eng_request reqs[N_PROMPTS];
    biased_requests(reqs, few);
    reqs[3].n_choices = 2; /* the second choice drafts from its copy of the prompt's rows */
    eng_spec_opts so = {.drafter = ENG_SPEC_MTP, .draft_fixed = true};
    expect_same_answers_on(m, reqs, N_PROMPTS, 4, &so, spec);
    cr_assert_str_empty(spec->off_reason);
    cr_assert_eq(spec->drafter, ENG_SPEC_MTP);
    cr_assert_gt(spec->drafts, 0, "no draft was verified");
    cr_assert_geq(spec->drafted, spec->verified);
    cr_log_info("mtp: %llu drafts, %llu drafted, %llu verified, %llu accepted",
                (unsigned long long)spec->drafts, (unsigned long long)spec->drafted,
                (unsigned long long)spec->verified, (unsigned long long)spec->accepted);
}

/* The tiny Qwen3.5 with its MTP layer drafting through the engine: the answers are the ones
 * without speculation, bit for bit. Its random MTP layer hardly ever guesses the target's
 * token, so a second run zeroes its final norm's scale (mtp.norm's w = -1 under the (1 + w)
 * norms): every draft is then token 0 (all logits 0, the lowest id on ties), which the odd
 * requests' bias makes the target choose often but not always, so drafts are accepted and
 * rejected, and the answers still do not change; so too with prompts prefilled in small chunks,
 * whose hidden states the MTP takes in chunk by chunk. */
Test(speculative, mtp_drafts_leave_greedy_answers_the_same_tokens)
{
    char dir[512];
    eng_model m;
    fixture_load(&m, dir, sizeof dir, "qwen35_mtp_tiny");
    eng_spec_stats spec;
    expect_same_answers_drafted_by_mtp(&m, &spec);
    cr_assert_gt(spec.verified, spec.accepted, "the random MTP's drafts were rejected");
    qtensor *norm = &m.mtp.norm;
    cr_assert_eq(norm->kind, QT_F32);
    int64_t H = m.cfg.hidden_size;
    float *minus_one = malloc((size_t)H * sizeof(float));
    for (int64_t i = 0; i < H; i++)
        minus_one[i] = -1.0f;
    uint8_t *data = norm->data;
    bool borrowed = norm->data_borrowed;
    norm->data = (uint8_t *)minus_one;
    norm->data_borrowed = true;
    expect_same_answers_drafted_by_mtp(&m, &spec);
    expect_drafts_exercised(&spec);
    /* prompts in chunks of 4 tokens: the MTP takes each chunk's hidden states in as the next
     * is built (all but the last, which the first draft starts from), and drafts as before */
    prefill_chunk = 4;
    expect_same_answers_drafted_by_mtp(&m, &spec);
    expect_drafts_exercised(&spec);
    prefill_chunk = 0;
    norm->data = data;
    norm->data_borrowed = borrowed;
    free(minus_one);
    hybrid_unload(&m, dir);
}

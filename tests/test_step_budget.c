/*
 * test_step_budget.c - the step budget (engine/scheduler/step_budget.c):
 * how many prompt tokens a step carries beside the sequences decoding in
 * it. Its decision is pinned as a function of explicit inputs (the steps'
 * tokens and seconds given, never measured; a budget given in tokens), and
 * the engine on the tiny model is held one step at a time at its gate: a
 * step with decode tokens carries no more prompt tokens than the budget it
 * reports and never none while a prompt waits, and a prompt prefilled a few
 * tokens per step beside a decoding stream gives the same tokens and
 * logprobs, bit for bit, as the same prompt prefilled at once, with an
 * adapter applied unmerged and with its blocks then found in the prefix
 * cache. Nothing here depends on how fast the machine is.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "scheduler.h"
#include "step_budget_internal.h"
#include "test_util.h"
#include "tiny_model.h"

/* --- the decision, from explicit inputs ------------------------------------------- */

/* Feed steps that cost exactly fixed + token * tokens, tokens cycling
 * through sizes (a spread the fit can tell apart). */
static eng_step_cost exact_cost(double fixed, double token, int32_t steps)
{
    static const int32_t sizes[] = {1, 8, 33, 64, 5, 100};
    eng_step_cost c = {0};
    for (int32_t i = 0; i < steps; i++) {
        int32_t x = sizes[i % 6];
        eng_step_cost_add(&c, x, fixed + token * x);
    }
    return c;
}

Test(step_budget, nothing_decoding_leaves_the_whole_room_to_the_prompt)
{
    eng_engine_opts o = {.max_prefill_per_step = 3, .min_prefill_per_step = 16};
    eng_step_cost c = exact_cost(0.01, 0.001, 20);
    eng_prefill_plan p = eng_prefill_budget(&o, &c, 0, 0, 256);
    cr_assert_eq(p.tokens, 256, "a prefill with nothing decoding runs as it always did");
    cr_assert_eq(p.target_s, 0);
}

Test(step_budget, a_budget_in_tokens_is_that_many_within_the_room)
{
    eng_engine_opts o = {.max_prefill_per_step = 24, .step_budget_ms = 1};
    eng_step_cost c = exact_cost(0.01, 0.001, 20);
    cr_assert_eq(eng_prefill_budget(&o, &c, 8, 8, 248).tokens, 24);
    cr_assert_eq(eng_prefill_budget(&o, &c, 8, 8, 10).tokens, 10, "never past the step's room");
    cr_assert_eq(eng_prefill_budget(&o, &c, 8, 8, 10).target_s, 0, "no time aimed at");
}

Test(step_budget, before_any_step_is_measured_the_floor)
{
    eng_engine_opts o = {.min_prefill_per_step = 5};
    eng_step_cost none = {0};
    eng_prefill_plan p = eng_prefill_budget(&o, &none, 4, 4, 200);
    cr_assert_eq(p.tokens, 5);
    cr_assert_eq(p.target_s, 0);
    o.min_prefill_per_step = 0; /* as a struct built by hand: the default floor */
    cr_assert_eq(eng_prefill_budget(&o, &none, 4, 4, 200).tokens, ENG_MIN_PREFILL_DEFAULT);
}

Test(step_budget, the_fit_recovers_a_fixed_and_a_per_token_cost)
{
    eng_step_cost c = exact_cost(0.010, 0.002, 40);
    double fixed, token;
    cr_assert(eng_step_cost_fit(&c, &fixed, &token));
    cr_assert(fabs(fixed - 0.010) < 1e-12, "fixed %.15g", fixed);
    cr_assert(fabs(token - 0.002) < 1e-12, "per token %.15g", token);
    /* times that cannot be are not taken in */
    eng_step_cost_add(&c, 10, NAN);
    eng_step_cost_add(&c, 10, -1.0);
    eng_step_cost_add(&c, 0, 5.0);
    eng_step_cost_add(&c, 10, INFINITY);
    double f2, t2;
    cr_assert(eng_step_cost_fit(&c, &f2, &t2));
    cr_assert(f2 == fixed && t2 == token);
    eng_step_cost none = {0};
    cr_assert_not(eng_step_cost_fit(&none, &fixed, &token));
    cr_assert(fixed == 0 && token == 0);
}

/* Steps all of one size cannot tell the fixed part from the per-token one:
 * the fit goes through zero, the mean cost per token. */
Test(step_budget, steps_of_one_size_fit_through_zero)
{
    eng_step_cost c = {0};
    for (int i = 0; i < 30; i++)
        eng_step_cost_add(&c, 64, 0.128);
    double fixed, token;
    cr_assert(eng_step_cost_fit(&c, &fixed, &token));
    cr_assert_eq(fixed, 0);
    cr_assert(fabs(token - 0.002) < 1e-12, "per token %.15g", token);
    /* automatic: twice the decode tokens' cost, so as many prompt tokens as decode ones */
    eng_engine_opts o = {.min_prefill_per_step = 1};
    cr_assert_eq(eng_prefill_budget(&o, &c, 32, 32, 224).tokens, 32);
}

/* 10 ms + 1 ms per token: the automatic target is twice a step of the
 * decode tokens alone (all that runs decodes); a given target leaves what
 * fits after them. */
Test(step_budget, the_budget_is_what_fits_the_target_time)
{
    eng_step_cost c = exact_cost(0.010, 0.001, 40);
    eng_engine_opts o = {.min_prefill_per_step = 1};
    eng_prefill_plan p = eng_prefill_budget(&o, &c, 32, 32, 224);
    cr_assert(fabs(p.target_s - 2 * 0.042) < 1e-9, "target %.12g", p.target_s);
    cr_assert(abs(p.tokens - 42) <= 1, "%d tokens: 42 fit in 42 ms more", p.tokens);
    o.step_budget_ms = 50; /* 8 decode tokens cost 18 ms: 32 ms left */
    p = eng_prefill_budget(&o, &c, 8, 8, 248);
    cr_assert(fabs(p.target_s - 0.050) < 1e-12);
    cr_assert(abs(p.tokens - 32) <= 1, "%d tokens", p.tokens);
    o.step_budget_ms = 1000; /* far more than the room */
    cr_assert_eq(eng_prefill_budget(&o, &c, 8, 8, 248).tokens, 248);
}

/* Many prompts arrived at once: 4 decode, 28 more run and prefill. The
 * automatic target is twice a step decoding all 32 (84 ms), so the burst's
 * prompts go in at 70 tokens a step, not at what 4 decode tokens would
 * allow; a running count under the decode count is taken as the latter. */
Test(step_budget, a_burst_of_prompts_gets_the_steps_the_running_set_will_take)
{
    eng_step_cost c = exact_cost(0.010, 0.001, 40);
    eng_engine_opts o = {.min_prefill_per_step = 1};
    eng_prefill_plan p = eng_prefill_budget(&o, &c, 4, 32, 252);
    cr_assert(fabs(p.target_s - 0.084) < 1e-9, "target %.12g", p.target_s);
    cr_assert(abs(p.tokens - 70) <= 1, "%d tokens", p.tokens);
    p = eng_prefill_budget(&o, &c, 4, 0, 252);
    cr_assert(fabs(p.target_s - 0.028) < 1e-9, "target %.12g", p.target_s);
    cr_assert(abs(p.tokens - 14) <= 1, "%d tokens", p.tokens);
}

/* A target the decode tokens alone already pass still lets the floor in:
 * a prompt always progresses. */
Test(step_budget, a_target_already_passed_still_gives_the_floor)
{
    eng_step_cost c = exact_cost(0.010, 0.001, 40);
    eng_engine_opts o = {.step_budget_ms = 5, .min_prefill_per_step = 7};
    cr_assert_eq(eng_prefill_budget(&o, &c, 32, 32, 224).tokens, 7);
    cr_assert_eq(eng_prefill_budget(&o, &c, 32, 32, 3).tokens, 3, "the floor within the room");
}

/* Whatever was measured and asked, a step with decode tokens and room
 * carries at least one prompt token and at most its room: no prompt
 * starves, no step passes its token budget. */
Test(step_budget, every_input_gives_progress_within_the_room)
{
    uint64_t rng = 36;
    for (int i = 0; i < 20000; i++) {
        eng_step_cost c = {0};
        int steps = (int)(test_rand(&rng) % 40);
        for (int k = 0; k < steps; k++)
            eng_step_cost_add(&c, 1 + (int32_t)(test_rand(&rng) % 300),
                              test_uniform(&rng) * (k % 7 == 0 ? 10.0 : 0.2));
        eng_engine_opts o = {
            .step_budget_ms = (float)(test_rand(&rng) % 3 ? 0 : test_uniform(&rng) * 500),
            .max_prefill_per_step = test_rand(&rng) % 4 ? 0 : (int32_t)(test_rand(&rng) % 600),
            .min_prefill_per_step = 1 + (int32_t)(test_rand(&rng) % 64)};
        int32_t n_decode = 1 + (int32_t)(test_rand(&rng) % 64);
        int32_t room = (int32_t)(test_rand(&rng) % 300);
        int32_t n_running = (int32_t)(test_rand(&rng) % 80);
        int32_t t = eng_prefill_budget(&o, &c, n_decode, n_running, room).tokens;
        cr_assert(t <= room, "case %d: %d tokens past the room of %d", i, t, room);
        cr_assert(room == 0 || t >= 1, "case %d: no prompt token in a room of %d", i, room);
        if (o.max_prefill_per_step == 0)
            cr_assert(t >= (o.min_prefill_per_step < room ? o.min_prefill_per_step : room),
                      "case %d: %d tokens under the floor %d", i, t, o.min_prefill_per_step);
    }
}

/* --- the engine, held one step at a time -------------------------------------------- */

TINY_DEFAULT_SUITE(step_budget_engine, 120);

/* One request's tokens, logprobs and end. */
typedef struct answer {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    eng_finish why;
    eng_usage usage;
    int32_t tokens[64];
    float logprob[64];
    int n;
} answer;

static void on_token(void *user, const eng_token_event *ev)
{
    answer *a = user;
    pthread_mutex_lock(&a->mu);
    if (ev->token >= 0 && a->n < 64) {
        a->logprob[a->n] = ev->logprob;
        a->tokens[a->n++] = ev->token;
    }
    pthread_mutex_unlock(&a->mu);
}

static void on_done(void *user, eng_finish why, const eng_usage *u)
{
    answer *a = user;
    pthread_mutex_lock(&a->mu);
    a->done = true;
    a->why = why;
    a->usage = *u;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

static void answer_wait(answer *a)
{
    pthread_mutex_lock(&a->mu);
    while (!a->done)
        pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
}

/* Submit prompt for n greedy tokens with logprobs into a (reset). */
static void submit(eng_engine *e, const char *prompt, int32_t n, const eng_lora_term *adapter,
                   answer *a)
{
    memset(a, 0, sizeof *a);
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    eng_request r = {.prompt = prompt,
                     .prompt_len = strlen(prompt),
                     .max_new_tokens = n,
                     .logprobs = true,
                     .adapters = adapter,
                     .n_adapters = adapter ? 1 : 0,
                     .on_token = on_token,
                     .on_done = on_done,
                     .user = a};
    char msg[512];
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), 0, "%s", msg);
}

static eng_engine *start(const eng_engine_opts *extra)
{
    eng_engine_opts o = *extra;
    o.threads = 2;
    o.kv_bytes = (size_t)8 << 20;
    o.max_running = 4;
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &tiny_model, &o, msg, sizeof msg), 0, "%s", msg);
    return e;
}

static void assert_same(const answer *a, const answer *b, const char *what)
{
    cr_assert_eq(a->why, ENG_FINISH_LENGTH, "%s", what);
    cr_assert_eq(b->why, ENG_FINISH_LENGTH, "%s", what);
    cr_assert_eq(a->n, b->n, "%s: %d tokens, then %d", what, a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        cr_assert_eq(a->tokens[i], b->tokens[i], "%s: token %d", what, i);
        cr_assert(same_bits(a->logprob[i], b->logprob[i]), "%s: token %d's logprob %.9g, %.9g",
                  what, i, (double)a->logprob[i], (double)b->logprob[i]);
    }
}

/* A long prompt (the tiny tokenizer spends about a token per byte). */
static const char *long_prompt = "a b c d e f g h i j k l m n o p q r s t u v w x y z the end";
static const char *short_prompt = "the theme";

/* Run e one step at a time while `decoding` decodes and `waiting` prefills:
 * each step that carried decode tokens carried at most the budget it
 * reports, and at least min(floor, what was left) prompt tokens. Returns
 * the steps the prompt took; *budgets the largest budget seen. */
static int step_through_prefill(eng_engine *e, int32_t floor_tokens, int32_t n_prompt,
                                int32_t *largest)
{
    eng_engine_stats before, after;
    eng_engine_stats_get(e, &before);
    uint64_t start = before.prompt_tokens;
    int steps = 0;
    *largest = 0;
    while (before.prompt_tokens - start < (uint64_t)n_prompt) {
        cr_assert_lt(steps, 1000, "the prompt never finished prefilling");
        engine_hold_after(e, 1);
        eng_engine_stats_get(e, &after);
        uint64_t prompt = after.prompt_tokens - before.prompt_tokens;
        uint64_t left = (uint64_t)n_prompt - (before.prompt_tokens - start);
        uint64_t floor_now = (uint64_t)floor_tokens < left ? (uint64_t)floor_tokens : left;
        cr_assert_geq(after.tokens_generated, before.tokens_generated + 1,
                      "step %d: the decoding stream took no token", steps);
        cr_assert_leq(prompt, (uint64_t)after.prefill_budget,
                      "step %d: %llu prompt tokens beside decode tokens, budget %d", steps,
                      (unsigned long long)prompt, after.prefill_budget);
        cr_assert_geq(prompt, floor_now, "step %d: %llu prompt tokens, the floor %llu", steps,
                      (unsigned long long)prompt, (unsigned long long)floor_now);
        *largest = after.prefill_budget > *largest ? after.prefill_budget : *largest;
        before = after;
        steps++;
    }
    return steps;
}

/* The prompt's token count as the engine sees it (BOS and all). */
static int32_t prompt_tokens(eng_engine *e, const char *prompt)
{
    answer a;
    submit(e, prompt, 1, NULL, &a);
    answer_wait(&a);
    return a.usage.prompt_tokens;
}

/* The long prompt's and the short one's answers from an engine that
 * prefills each at once, alone. */
static void reference_answers(answer *want_long, answer *want_short)
{
    eng_engine *ref = start(&(eng_engine_opts){.no_prefix_cache = true});
    submit(ref, long_prompt, 12, NULL, want_long);
    answer_wait(want_long);
    submit(ref, short_prompt, 40, NULL, want_short);
    answer_wait(want_short);
    eng_engine_stop(ref);
}

/* A budget of 3 tokens: the long prompt goes in steps of 3 beside the
 * decoding stream, the budget is reported, and both answers equal those of
 * an engine that prefills the prompt at once, bit for bit. */
Test(step_budget_engine, a_budget_in_tokens_spreads_the_prompt_and_changes_no_bit)
{
    answer want_long, want_short;
    reference_answers(&want_long, &want_short);
    int32_t n_long = want_long.usage.prompt_tokens;
    cr_assert_gt(n_long, 30);

    eng_engine *e = start(&(eng_engine_opts){.max_prefill_per_step = 3, .no_prefix_cache = true});
    engine_hold_after(e, 0);
    answer got_short, got_long;
    submit(e, short_prompt, 40, NULL, &got_short);
    engine_step_until_generated(e, 1); /* decoding now */
    submit(e, long_prompt, 12, NULL, &got_long);
    int32_t largest;
    int steps = step_through_prefill(e, 3, n_long, &largest);
    cr_assert_eq(largest, 3);
    cr_assert_eq(steps, (n_long + 2) / 3, "%d tokens in %d steps of 3", n_long, steps);
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.prefill_held_steps, (uint64_t)steps - 1, "every step but the last held some");
    cr_assert_eq(st.step_target_s, 0, "a budget in tokens aims at no time");
    engine_hold_after(e, -1);
    answer_wait(&got_long);
    answer_wait(&got_short);
    assert_same(&got_long, &want_long, "the long prompt, 3 tokens a step");
    assert_same(&got_short, &want_short, "the stream decoding beside it");
    eng_engine_stop(e);
}

/* The automatic budget (its time from the steps this machine measures):
 * whatever it chooses, the engine keeps to it and to the floor, and the
 * answers do not change. */
Test(step_budget_engine, the_automatic_budget_is_kept_whatever_it_measures)
{
    answer want_long, want_short;
    reference_answers(&want_long, &want_short);

    eng_engine *e = start(&(eng_engine_opts){.min_prefill_per_step = 2, .no_prefix_cache = true});
    int32_t n_long = prompt_tokens(e, long_prompt);
    engine_hold_after(e, 0);
    answer got_short, got_long;
    submit(e, short_prompt, 40, NULL, &got_short);
    engine_step_until_generated(e, 2); /* the earlier request's token, then this one's */
    submit(e, long_prompt, 12, NULL, &got_long);
    int32_t largest;
    step_through_prefill(e, 2, n_long, &largest);
    cr_assert_geq(largest, 2);
    engine_hold_after(e, -1);
    answer_wait(&got_long);
    answer_wait(&got_short);
    assert_same(&got_long, &want_long, "the long prompt under the automatic budget");
    assert_same(&got_short, &want_short, "the stream decoding beside it");
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_gt(st.step_token_s, 0, "the steps' cost was fitted");
    eng_engine_stop(e);
}

/* An adapter applied unmerged and the prefix cache: the budgeted prompt's
 * blocks are kept as whole ones are, and a second asking finds them and
 * answers the same bits. */
Test(step_budget_engine, adapters_and_the_prefix_cache_keep_working_under_the_budget)
{
    char folder[600];
    snprintf(folder, sizeof folder, "%s/adapter", tiny_dir);
    lora_fix_spec spec = lora_fix_default();
    lora_fix_write(folder, &tiny_model.cfg, &spec);
    eng_lora *lora = NULL;
    char msg[512];
    cr_assert_eq(lora_load(&lora, NULL, folder, "ad", &tiny_model, msg, sizeof msg), 0, "%s", msg);
    eng_lora_term term = {lora, 1.0f};

    eng_engine *ref = start(&(eng_engine_opts){.no_prefix_cache = true});
    answer want;
    submit(ref, long_prompt, 12, &term, &want);
    answer_wait(&want);
    eng_engine_stop(ref);

    eng_engine *e = start(&(eng_engine_opts){.max_prefill_per_step = 5, .block_tokens = 4});
    engine_hold_after(e, 0);
    answer stream, got, again;
    submit(e, short_prompt, 60, NULL, &stream);
    engine_step_until_generated(e, 1);
    submit(e, long_prompt, 12, &term, &got);
    int32_t largest;
    step_through_prefill(e, 5, want.usage.prompt_tokens, &largest);
    cr_assert_eq(largest, 5);
    engine_hold_after(e, -1);
    answer_wait(&got);
    assert_same(&got, &want, "the adapter's answer, 5 prompt tokens a step");
    submit(e, long_prompt, 12, &term, &again);
    answer_wait(&again);
    cr_assert_gt(again.usage.cached_tokens, want.usage.prompt_tokens / 2,
                 "%d of %d prompt tokens cached", again.usage.cached_tokens,
                 want.usage.prompt_tokens);
    assert_same(&again, &want, "the adapter's answer from the prefix cache");
    answer_wait(&stream);
    eng_engine_stop(e);
    eng_lora_unref(lora);
}

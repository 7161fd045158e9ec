/*
 * step_budget_internal.h - the step budget (step_budget.c): how many prompt
 * tokens one step may carry beside the sequences decoding in it, so that a
 * decoding stream never waits behind a whole prefill (the prompt's
 * remainder goes in later steps: chunked prefill). The budget is sized from
 * the steps' measured cost: every step's tokens and wall time feed a fit of
 * seconds = fixed + per_token * tokens, and a step with decoding sequences
 * gets the prompt tokens that keep it within a target time (by default
 * twice what a step decoding the whole running set costs), never fewer
 * than a floor (so a
 * prompt always progresses and its time to first token stays bounded).
 *
 * Pure arithmetic over explicit inputs (the measured steps, the engine's
 * options, the decode count): the scheduler feeds it each step and asks it
 * once per step; tests give it both, never a clock. Only scheduler.c and
 * the tests include this header.
 */
#ifndef QL_STEP_BUDGET_INTERNAL_H
#define QL_STEP_BUDGET_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "scheduler.h"

/* The steps' cost: exponentially weighted sums over the steps measured of
 * x = the step's tokens and y = its seconds (zero-initialised: nothing
 * measured). Each new step weighs ENG_STEP_COST_WEIGHT, the sums before
 * it fade by 1 - that: about the last 16 steps count, a few batch sizes'
 * worth, so the fit follows the running set as it grows and shrinks. */
typedef struct eng_step_cost {
    double w, sx, sy, sxx, sxy;
} eng_step_cost;

#define ENG_STEP_COST_WEIGHT (1.0 / 16)

/* The target step time of the automatic budget (step_budget_ms 0), as a
 * multiple of what a step decoding the whole running set would cost (the
 * sequences decoding and those still prefilling, whose decode tokens will
 * join them): a decoding stream's token takes at most about twice its
 * decode-only time while prompts are prefilled beside it; in steady state
 * a step carries about as many prompt tokens as decode tokens (plus the
 * fixed cost's worth), which keeps up with streams whose prompts are as
 * long as their answers; and when many prompts arrive at once (few decode,
 * many wait) the steps are no longer than they will be once all decode,
 * so the last prompt of a burst does not wait for the first ones' answers. */
#define ENG_STEP_BUDGET_AUTO 2.0

/* The floor's default (min_prefill_per_step 0): one KV block of the
 * default size, a few steps for a chat turn's prompt. */
#define ENG_MIN_PREFILL_DEFAULT 16

/* Add one step of tokens (> 0) that took seconds (>= 0; a negative or
 * non-finite time is ignored). */
void eng_step_cost_add(eng_step_cost *c, int32_t tokens, double seconds);

/* The fit seconds = *fixed_s + *token_s * tokens: least squares over the
 * weighted steps when their token counts spread enough to tell the fixed
 * part from the per-token part (a relative spread of a quarter), else
 * through zero (*fixed_s 0). false, and both 0, before any step. */
bool eng_step_cost_fit(const eng_step_cost *c, double *fixed_s, double *token_s);

/* What a step may carry: tokens, the prompt tokens beside its n_decode
 * decode tokens, and target_s, the step time aimed at (0 when the budget
 * is a fixed number of tokens or nothing is measured yet). */
typedef struct eng_prefill_plan {
    int32_t tokens;
    double target_s;
} eng_prefill_plan;

/* The prompt tokens a step of n_decode decode tokens may carry, n_running
 * being the sequences running (decoding or prefilling; fewer than n_decode
 * is taken as n_decode) and room (>= 0) what the step's token budget
 * leaves after the decode tokens. Nothing decoding: room (a prefill runs
 * as it always did). Else, from o's step_budget_ms, max_prefill_per_step
 * and min_prefill_per_step (as eng_engine_start leaves them: 0
 * min_prefill_per_step is taken as ENG_MIN_PREFILL_DEFAULT): a fixed
 * max_prefill_per_step when set, else the tokens c's fit says fit into the
 * target time after the decode tokens (step_budget_ms, or
 * ENG_STEP_BUDGET_AUTO times the fitted cost of a step decoding
 * n_running), at least the floor (the floor alone while nothing is
 * measured); never more than room. */
eng_prefill_plan eng_prefill_budget(const eng_engine_opts *o, const eng_step_cost *c,
                                    int32_t n_decode, int32_t n_running, int32_t room);

#endif

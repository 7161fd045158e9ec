/*
 * step_budget.c - the step budget (internal/step_budget_internal.h): the
 * steps' cost fitted from their measured times, and from it the prompt
 * tokens a step may carry beside the sequences decoding in it. Shaped as
 * arithmetic over explicit inputs, apart from the engine thread that
 * measures, so the scheduler's decision is tested as a function of the
 * times and options it is given.
 *
 * Why a fit of fixed + per token: a CPU step reads every weight once
 * whatever its batch (the fixed part, which dominates a batch of one) and
 * computes per token (which dominates a batch of tens); a budget sized
 * from the per-token share alone would give a lone decoding stream no
 * room, and one from the whole step time of a batch of one far too much.
 */
#include "step_budget_internal.h"

#include <math.h>

void eng_step_cost_add(eng_step_cost *c, int32_t tokens, double seconds)
{
    if (tokens <= 0 || !(seconds >= 0) || !isfinite(seconds))
        return;
    double keep = 1.0 - ENG_STEP_COST_WEIGHT, x = (double)tokens, y = seconds;
    c->w = c->w * keep + ENG_STEP_COST_WEIGHT;
    c->sx = c->sx * keep + ENG_STEP_COST_WEIGHT * x;
    c->sy = c->sy * keep + ENG_STEP_COST_WEIGHT * y;
    c->sxx = c->sxx * keep + ENG_STEP_COST_WEIGHT * x * x;
    c->sxy = c->sxy * keep + ENG_STEP_COST_WEIGHT * x * y;
}

bool eng_step_cost_fit(const eng_step_cost *c, double *fixed_s, double *token_s)
{
    *fixed_s = *token_s = 0;
    if (!(c->w > 0) || !(c->sxx > 0))
        return false;
    double mx = c->sx / c->w, my = c->sy / c->w;
    double var = c->sxx / c->w - mx * mx, cov = c->sxy / c->w - mx * my;
    /* a quarter's relative spread: below it, timing noise of a shared
     * machine (tens of percent) outweighs what the spread tells apart */
    if (var >= 0.0625 * mx * mx && cov > 0) {
        double b = cov / var, a = my - b * mx;
        if (a >= 0) {
            *fixed_s = a;
            *token_s = b;
            return true;
        }
    }
    *token_s = c->sxy / c->sxx; /* least squares through zero */
    return true;
}

eng_prefill_plan eng_prefill_budget(const eng_engine_opts *o, const eng_step_cost *c,
                                    int32_t n_decode, int32_t n_running, int32_t room)
{
    eng_prefill_plan p = {.tokens = room > 0 ? room : 0, .target_s = 0};
    if (n_decode <= 0 || room <= 0)
        return p;
    if (o->max_prefill_per_step > 0) {
        p.tokens = o->max_prefill_per_step < room ? o->max_prefill_per_step : room;
        return p;
    }
    int32_t floor_tokens =
        o->min_prefill_per_step > 0 ? o->min_prefill_per_step : ENG_MIN_PREFILL_DEFAULT;
    floor_tokens = floor_tokens < room ? floor_tokens : room;
    double fixed_s, token_s;
    if (!eng_step_cost_fit(c, &fixed_s, &token_s) || !(token_s > 0)) {
        p.tokens = floor_tokens;
        return p;
    }
    double decode_s = fixed_s + token_s * n_decode;
    int32_t batch = n_running > n_decode ? n_running : n_decode;
    p.target_s = o->step_budget_ms > 0 ? (double)o->step_budget_ms / 1000.0
                                       : ENG_STEP_BUDGET_AUTO * (fixed_s + token_s * batch);
    double fit = floor((p.target_s - decode_s) / token_s);
    /* clamped as a double first: a tiny token_s could make it huge */
    p.tokens = fit >= (double)room           ? room
               : fit <= (double)floor_tokens ? floor_tokens
                                             : (int32_t)fit;
    return p;
}

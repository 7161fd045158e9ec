/*
 * step.c - what every backend does alike before and around a step
 * (internal/step_internal.h): the rotary frequencies and per-position
 * rotation tables, and the refusals every backend makes before it
 * computes anything. It owns no state and calls no other runtime file
 * (it reads the KV cache's layout, kv_cache_internal.h, for the block
 * size), so walk.c, forward.c and backend_cuda.c lean on it without a
 * cycle.
 */
#include "internal/step_internal.h"

#include <math.h>

#include "internal/kv_cache_internal.h"

/* --- RoPE ------------------------------------------------------------------- */

/* The rotary frequencies with the config's scaling folded in. A GGUF's
 * frequency factors (rope_freqs.weight) divide pair i's frequency, as
 * ggml's rope does (theta / freq_factors[i0 / 2] in ggml_rope_cache_init);
 * then linear divides every frequency by the factor (positions / factor),
 * as ggml's freq_scale multiplies the divided theta; llama3 (Llama 3.1's
 * rope_scaling) keeps high frequencies, divides low ones by the factor and
 * blends in between, as transformers' _compute_llama3_parameters does (the
 * factors llama.cpp's converter stores are this same curve as divisors);
 * YaRN blends each frequency with itself over the factor (yarn_ramp). */
/* rope_dim's leading dims of a head of d, or all d */
static int32_t rotary_dims(const eng_config *c, int32_t d)
{
    return c->rope_dim > 0 && c->rope_dim < d ? c->rope_dim : d;
}

int32_t eng_rope_dims(const eng_config *c)
{
    return rotary_dims(c, eng_rope_head_dim(c));
}

int32_t eng_rope_dims_local(const eng_config *c)
{
    return rotary_dims(c, c->head_dim);
}

/* YaRN's correction dim for a number of rotations over the original
 * context (transformers' find_correction_dim, ggml's
 * ggml_rope_yarn_corr_dim): the pair index whose wavelength makes that
 * many turns. */
static double yarn_correction_dim(double rotations, int32_t rot, double base, double orig)
{
    return (double)rot * log(orig / (rotations * 2.0 * M_PI)) / (2.0 * log(base));
}

/* YaRN's ramp from 0 to 1 over the pairs between its correction dims
 * beta_fast and beta_slow (rounded out to whole dims when truncate), as
 * transformers' _compute_yarn_parameters: pair i's frequency is f / factor
 * times ramp[i] plus f times (1 - ramp[i]), so the fast pairs keep their
 * frequency and the slow ones are interpolated. */
static double yarn_ramp(const eng_config *c, int32_t rot, int32_t i)
{
    double base = (double)c->rope_theta, orig = (double)c->rope_original_max_position;
    double low = yarn_correction_dim((double)c->rope_yarn_beta_fast, rot, base, orig);
    double high = yarn_correction_dim((double)c->rope_yarn_beta_slow, rot, base, orig);
    if (c->rope_yarn_truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0.0 ? low : 0.0;
    high = high < rot - 1 ? high : rot - 1;
    if (low == high)
        high += 0.001; /* transformers' guard against a zero-width ramp */
    double r = ((double)i - low) / (high - low);
    return r < 0.0 ? 0.0 : r > 1.0 ? 1.0 : r;
}

void eng_rope_inv_freq(const eng_config *c, bool long_factors, double *inv_freq)
{
    int32_t rot = eng_rope_dims(c), half = rot / 2;
    const float *factors = long_factors && c->rope_scaling == ENG_ROPE_LONGROPE
                               ? c->rope_long_freq_factors
                               : c->rope_freq_factors;
    for (int32_t i = 0; i < half; i++) {
        double f = 1.0 / pow((double)c->rope_theta, (2.0 * i) / (double)rot);
        if (i < c->n_rope_freq_factors)
            f /= (double)factors[i];
        if (c->rope_scaling == ENG_ROPE_LINEAR) {
            f /= (double)c->rope_factor;
        } else if (c->rope_scaling == ENG_ROPE_YARN) {
            double ramp = yarn_ramp(c, rot, i);
            f = f / (double)c->rope_factor * ramp + f * (1.0 - ramp);
        } else if (c->rope_scaling == ENG_ROPE_LLAMA3) {
            double old = (double)c->rope_original_max_position;
            double low_wavelen = old / (double)c->rope_low_freq_factor;
            double high_wavelen = old / (double)c->rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / f;
            if (wavelen > low_wavelen) {
                f /= (double)c->rope_factor;
            } else if (wavelen >= high_wavelen) {
                double smooth =
                    (old / wavelen - (double)c->rope_low_freq_factor) /
                    ((double)c->rope_high_freq_factor - (double)c->rope_low_freq_factor);
                f = (1.0 - smooth) * f / (double)c->rope_factor + smooth * f;
            }
        } else if (c->rope_scaling == ENG_ROPE_PROPORTIONAL) {
            /* Gemma 4: the pairs past rope_prop_pairs stand still */
            f = i < c->rope_prop_pairs ? f / (double)c->rope_factor : 0.0;
        }
        inv_freq[i] = f;
    }
}

/* Gemma 3's sliding layers: rope_local_theta's frequencies, unscaled (as
 * transformers' default rope for the sliding_attention layer type, and
 * llama.cpp's freq_base_swa with scale 1). */
void eng_rope_inv_freq_local(const eng_config *c, double *inv_freq)
{
    for (int32_t i = 0; i < c->head_dim / 2; i++)
        inv_freq[i] = 1.0 / pow((double)c->rope_local_theta, (2.0 * i) / (double)c->head_dim);
}

/* longrope's and YaRN's attention factor: transformers multiplies cos and
 * sin by it (attention_scaling, from _compute_longrope_parameters and
 * _compute_yarn_parameters), ggml's rope by its attn_factor (mscale; for
 * YaRN times 1 + 0.1 ln(factor) inside ggml_rope_yarn), which llama.cpp's
 * converter stores for Phi-3 as rope.scaling.attn_factor; the same number.
 * Every other scaling: 1. */
double eng_rope_attention_factor(const eng_config *c)
{
    return c->rope_scaling == ENG_ROPE_LONGROPE || c->rope_scaling == ENG_ROPE_YARN
               ? (double)c->rope_attn_factor
               : 1.0;
}

void eng_rope_row(const double *inv_freq, int32_t half, int32_t pos, double attn_factor,
                  float *cos_tab, float *sin_tab)
{
    for (int32_t i = 0; i < half; i++) {
        double angle = (double)pos * inv_freq[i];
        cos_tab[i] = (float)(cos(angle) * attn_factor);
        sin_tab[i] = (float)(sin(angle) * attn_factor);
    }
}

/* --- the refusals of a step ------------------------------------------------ */

int eng_step_check(const eng_model *m, const eng_kv_cache *kv, const eng_step_seq *seqs,
                   int32_t n_seqs, int32_t max_tokens, int64_t *total, int64_t *max_rank, char *msg,
                   size_t msg_len)
{
    const eng_config *c = &m->cfg;
    int64_t T = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const eng_step_seq *q = &seqs[s];
        if (q->n_tokens <= 0 || q->pos < 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "sequence %d: %d tokens at position %d", s,
                           q->n_tokens, q->pos);
        int64_t end = (int64_t)q->pos + q->n_tokens;
        if (end > c->max_position_embeddings)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d: position %lld is past the context of %d", s,
                           (long long)end - 1, c->max_position_embeddings);
        if (end > (int64_t)q->kv->n_blocks * kv->block_tokens)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d: position %lld is past its %d reserved KV positions", s,
                           (long long)end - 1, q->kv->n_blocks * kv->block_tokens);
        if (q->pos > q->kv->n_tokens)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d: position %d leaves a gap after its %d cached positions", s,
                           q->pos, q->kv->n_tokens);
        if (q->weights && q->weights->m != m)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d: its weight version belongs to another model", s);
        for (int32_t k = 0; k < q->n_delta; k++) {
            const eng_lora *lora = q->delta[k].lora;
            if (lora->n_layers != c->n_layers)
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "sequence %d: adapter %s has %d layers, the model %d", s, lora->name,
                               lora->n_layers, c->n_layers);
            if (lora->n_proj != eng_n_proj(c))
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "sequence %d: adapter %s has %d projections per layer, the model %d",
                               s, lora->name, lora->n_proj, eng_n_proj(c));
            for (size_t i = 0; i < (size_t)lora->n_layers * (size_t)lora->n_proj; i++)
                if (lora->modules[i].a.rows > *max_rank)
                    *max_rank = lora->modules[i].a.rows;
        }
        for (int32_t t = 0; t < q->n_tokens; t++)
            if (q->tokens[t] < 0 || q->tokens[t] >= c->vocab_size)
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "sequence %d: token id %d is outside the vocabulary of %d", s,
                               q->tokens[t], c->vocab_size);
        T += q->n_tokens;
    }
    if (T > max_tokens)
        return ql_fail(msg, msg_len, QL_EINVAL, "%lld tokens in one step; at most %d", (long long)T,
                       max_tokens);
    *total = T;
    return QL_OK;
}

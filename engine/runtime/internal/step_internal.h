/*
 * step_internal.h - what every backend does alike before and around a
 * step, offered by engine/runtime/step.c alone: the rotary tables (RoPE)
 * and the refusals of a step. Included by walk.c (which makes the
 * refusals), the backends (forward.c and backend_cuda.c, which rotate) and
 * step.c; nothing outside engine/runtime/ includes it. step.c calls no
 * other runtime file, so they lean on it without a cycle.
 */
#ifndef QL_STEP_INTERNAL_H
#define QL_STEP_INTERNAL_H

#include "runtime.h"

/* The leading dims of each head that rotate with the main table: rope_dim
 * (partial rotary), or the whole head (Gemma 4: its full layers' head,
 * eng_rope_head_dim). */
int32_t eng_rope_dims(const eng_config *c);
/* The same for the sliding layers' own table (rope_local_theta): of a
 * head of head_dim. */
int32_t eng_rope_dims_local(const eng_config *c);
/* inv_freq[i] for i < eng_rope_dims(c) / 2: the rotary frequencies of
 * config c (theta^(-2i / rotary dims)) with its rope scaling folded in
 * (every backend rotates with these). long_factors: longrope's long set
 * (a sequence's eng_step_seq.rope_long) in place of the short one; no
 * other rope reads it. */
void eng_rope_inv_freq(const eng_config *c, bool long_factors, double *inv_freq);
/* What multiplies every cos and sin of config c: longrope's attention
 * factor, 1 for every other rope. */
double eng_rope_attention_factor(const eng_config *c);
/* The same for the sliding layers of a model with rope_local_theta (Gemma
 * 3): that base, no scaling, no frequency factors. */
void eng_rope_inv_freq_local(const eng_config *c, double *inv_freq);
/* cos_tab[i], sin_tab[i] for i < half: the rotation of position pos, each
 * angle pos * inv_freq[i] in double, its cos and sin times attn_factor
 * (eng_rope_attention_factor) in double, rounded once to f32. */
void eng_rope_row(const double *inv_freq, int32_t half, int32_t pos, double attn_factor,
                  float *cos_tab, float *sin_tab);
/* What every backend refuses before computing anything, changing nothing
 * (eng_walk makes them for every backend; eng_forward's list: token ids, positions past the
 * context, the reserved KV or a gap, versions of another model, adapters of another depth, more
 * than max_tokens new tokens): *total gets the step's new tokens and
 * *max_rank (when larger) its adapters' largest rank. */
int eng_step_check(const eng_model *m, const eng_kv_cache *kv, const eng_step_seq *seqs,
                   int32_t n_seqs, int32_t max_tokens, int64_t *total, int64_t *max_rank, char *msg,
                   size_t msg_len);

#endif

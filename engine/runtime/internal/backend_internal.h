/*
 * backend_internal.h - what every backend is, for engine/backend.c (the CPU
 * backend and the choice between backends) and engine/backend_cuda.c.
 * Nothing outside engine/ includes it.
 */
#ifndef QL_BACKEND_INTERNAL_H
#define QL_BACKEND_INTERNAL_H

#include "runtime.h"

struct eng_backend {
    eng_device device;
    char describe[256];
    const eng_model *m;
    eng_kv_cache *kv;
    bool draws; /* chooses tokens where the logits are (eng_backend_draws) */
    int (*forward)(eng_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
                   int32_t *tokens, char *msg, size_t msg_len);
    /* NULL: the host tensors are what it computes with */
    int (*digest)(eng_backend *b, const eng_weights *w, uint64_t *digest, char *msg,
                  size_t msg_len);
    /* NULL: the backend computes with the host's merged tensors */
    int (*prepare)(eng_backend *b, const eng_weights *w, eng_merge_cost *costs, uint64_t *digest,
                   char *msg, size_t msg_len);
    void (*destroy)(eng_backend *b);
};

/* inv_freq[i] for i < head_dim / 2: the rotary frequencies of config c with
 * its rope scaling folded in (every backend rotates with these). */
void eng_rope_inv_freq(const eng_config *c, double *inv_freq);
/* cos_tab[i], sin_tab[i] for i < half: the rotation of position pos, each
 * angle pos * inv_freq[i] in double, rounded once to f32. */
void eng_rope_row(const double *inv_freq, int32_t half, int32_t pos, float *cos_tab,
                  float *sin_tab);
/* What every backend refuses before computing anything, changing nothing
 * (eng_forward's list: token ids, positions past the context, the reserved
 * KV or a gap, versions of another model, adapters of another depth, more
 * than max_tokens new tokens): *total gets the step's new tokens and
 * *max_rank (when larger) its adapters' largest rank. In forward.c. */
int eng_step_check(const eng_model *m, const eng_kv_cache *kv, const eng_step_seq *seqs,
                   int32_t n_seqs, int32_t max_tokens, int64_t *total, int64_t *max_rank, char *msg,
                   size_t msg_len);

#ifdef QL_HAVE_CUDA
/* Whether a CUDA device can be used now (auto asks this). */
bool eng_cuda_present(void);
/* The CUDA backend (engine/backend_cuda.c). */
int eng_backend_cuda_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o,
                         char *msg, size_t msg_len);
#endif

#endif

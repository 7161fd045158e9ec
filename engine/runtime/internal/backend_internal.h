/*
 * backend_internal.h - what every backend is: struct eng_backend, the row
 * each backend fills in (its operations), and the CUDA backend's two entry
 * points. Included by engine/runtime/backend.c (the CPU backend, the choice
 * between backends and the eng_backend_* calls that dispatch through the
 * row) and engine/runtime/backend_cuda.c, and by nothing else: the
 * scheduler reaches a backend only through runtime.h's eng_backend_*.
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
    /* the copies of eng_backend_copy_blocks, block ids already checked */
    int (*copy_blocks)(eng_backend *b, const eng_kv_copy *copies, int32_t n, char *msg,
                       size_t msg_len);
    /* NULL: the host tensors are what it computes with */
    int (*digest)(eng_backend *b, const eng_weights *w, uint64_t *digest, char *msg,
                  size_t msg_len);
    /* the last step's mixture-of-experts figures (eng_backend_moe_step);
     * NULL: none (a backend that runs no mixtures) */
    void (*moe_step)(const eng_backend *b, uint64_t *experts, uint64_t *bytes);
    /* NULL: the backend computes with the host's merged tensors */
    int (*prepare)(eng_backend *b, const eng_weights *w, eng_merge_cost *costs, uint64_t *digest,
                   char *msg, size_t msg_len);
    void (*destroy)(eng_backend *b);
};

#ifdef QL_HAVE_CUDA
/* Whether a CUDA device can be used now (auto asks this). */
bool eng_cuda_present(void);
/* The CUDA backend (engine/runtime/backend_cuda.c). */
int eng_backend_cuda_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o,
                         char *msg, size_t msg_len);
#endif

#endif

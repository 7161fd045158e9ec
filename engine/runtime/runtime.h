/*
 * runtime.h - the public header of engine/runtime/: where and how one
 * forward step runs.
 *
 * It offers the paged KV cache (eng_kv_*), the worker pool of the CPU
 * kernels (eng_pool_*), one batched forward step over a model (eng_forward,
 * with unmerged adapters applied per run of rows), and the backends that
 * run a step on a device (eng_backend_*: the CPU one always, the CUDA one
 * when built).
 *
 * A backend owns its KV cache, its scratch and (CUDA) the device copies of
 * the weights; it borrows the model, which must outlive it, and is used by
 * one thread at a time. It touches engine/model/ and kernels/ (and
 * kernels/cuda/ for the CUDA backend), never the scheduler above it.
 *
 * Inside the folder: backend.c (the choice, the CPU backend, the eng_backend_* calls), walk.c
 * (the one walk over the layers, for both backends), forward.c (the CPU's operations for it),
 * backend_cuda.c (the CUDA ones; CUDA builds), step.c (rotary tables and a step's refusals),
 * kv_cache.c, pool.c; internal/ holds what only these files share.
 */
#ifndef QL_RUNTIME_H
#define QL_RUNTIME_H

#include "model.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* --- the KV cache, the worker pool and the CPU forward pass
 *     (engine/runtime/kv_cache.c, pool.c, forward.c) -------------------------- */

/*
 * The paged KV cache: fixed blocks of `block_tokens` positions, each
 * holding K and V for every layer and kv head (f32, f16 or q8_0), in one arena whose
 * size is set in bytes. A sequence owns a block table; blocks are handed
 * out and taken back whole, so a finished sequence frees its memory at once
 * and a long one never needs a contiguous run.
 */
typedef struct eng_kv_cache eng_kv_cache;

typedef struct eng_seq_kv {
    int32_t *blocks; /* block table, n_blocks entries (owned, realloc'd) */
    int32_t n_blocks;
    int32_t n_tokens; /* positions written so far */
    /* blocks taken from the free list for s but not in its table: what its
     * forks and its copies on write will use (owned, realloc'd) */
    int32_t *held;
    int32_t n_held;
    /* a hybrid model's recurrent state: its slot in the cache's pool + 1
     * (0: none), taken by eng_kv_reserve, copied by eng_kv_fork, given
     * back by eng_kv_release */
    int32_t state;
} eng_seq_kv;

/* A block to copy before a step writes into the copy (copy on write). */
typedef struct eng_kv_copy {
    int32_t src, dst;
} eng_kv_copy;

/* An arena of `bytes` for cfg's layers and kv heads (block_tokens 0: 16),
 * values in f32. Refuses a size too small for one block. Free with
 * eng_kv_free. */
int eng_kv_new(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
               char *msg, size_t msg_len);
/* The same with values stored as dtype: QT_F32, QT_F16 (half the bytes, so
 * twice the blocks in the same bytes) or QT_Q8_0 (34 bytes per 32 values;
 * refused, naming the model's kv_dim, unless kv_dim is a multiple of 32).
 * Writes round on store; attention converts back to f32 on load. */
int eng_kv_new_dtype(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                     qt_kind dtype, char *msg, size_t msg_len);
/* "f32", "f16", "q8_0" (ql_kv_dtype_names) -> *out; QL_EINVAL naming the
 * value otherwise. */
int eng_kv_dtype_parse(const char *name, qt_kind *out, char *msg, size_t msg_len);
/* What the cache stores values as; the bytes one position takes (K and V
 * of every layer of cfg) in dtype: for /info and the startup log. */
qt_kind eng_kv_dtype(const eng_kv_cache *kv);
size_t eng_kv_token_bytes(const eng_config *cfg, qt_kind dtype);
/* The same for a hybrid model (cfg->linear.n_layers > 0) with n_states
 * recurrent states (one per sequence that may run at once), taken out of
 * `bytes` before the blocks; eng_kv_new and _dtype give such a model
 * ENG_KV_DEFAULT_STATES. A model with no linear layers gets none. */
#define ENG_KV_DEFAULT_STATES 16
int eng_kv_new_states(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                      qt_kind dtype, int32_t n_states, char *msg, size_t msg_len);
/* Recurrent states the cache holds in all, and those free now (0, 0 for a
 * model without linear layers); the bytes one takes. */
int32_t eng_kv_total_states(const eng_kv_cache *kv);
int32_t eng_kv_free_states(const eng_kv_cache *kv);
size_t eng_kv_state_bytes(const eng_kv_cache *kv);
/* The same block bookkeeping without the host arena (the positions, and a
 * hybrid model's n_states recurrent states, live elsewhere, e.g. in device
 * memory: see the CUDA backend). */
int eng_kv_new_meta(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                    int32_t n_states, char *msg, size_t msg_len);
void eng_kv_free(eng_kv_cache *kv);
/* Floats one block holds (every layer's K and V for its positions). */
size_t eng_kv_block_floats(const eng_kv_cache *kv);
int32_t eng_kv_block_tokens(const eng_kv_cache *kv);
int32_t eng_kv_total_blocks(const eng_kv_cache *kv);
int32_t eng_kv_free_blocks(const eng_kv_cache *kv);
/* Blocks needed for a sequence to hold n_tokens positions in all. */
int32_t eng_kv_blocks_for(const eng_kv_cache *kv, int32_t n_tokens);
/* Grow s to hold n_tokens positions; QL_ENOMEM (nothing taken) when the
 * free blocks do not suffice. */
int eng_kv_reserve(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_tokens);
/* Take n_blocks more free blocks into s's held ones; QL_ENOMEM (nothing
 * taken) when too few are free. */
int eng_kv_hold(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_blocks);
/*
 * Make dst (empty) a fork of src: dst's table shares (by reference) the
 * blocks that hold src's positions written so far, and is grown from
 * src's held blocks to hold n_tokens positions in all, plus one held
 * block of its own for the copy on write of the last shared block when it
 * is partly filled. dst->n_tokens becomes src->n_tokens. QL_ENOMEM
 * (nothing changed) when src holds too few; QL_EINVAL when dst is not
 * empty or is src. src's own first write into that partly filled block
 * copies too while a fork still shares it: src must hold a block for it.
 */
int eng_kv_fork(eng_kv_cache *kv, eng_seq_kv *dst, eng_seq_kv *src, int32_t n_tokens);
/* How many blocks eng_kv_fork takes from src's held ones for a fork of a
 * sequence with n_shared positions written, grown to n_tokens. */
int32_t eng_kv_fork_blocks(const eng_kv_cache *kv, int32_t n_shared, int32_t n_tokens);
/*
 * Before a step writes positions [pos, pos + n) of s: every block in that
 * range that another sequence also references is replaced in s's table by
 * one of s's held blocks, and the pair is appended to copies (at most
 * max_copies; *n_copies, in and out, counts what the list holds) for the
 * backend to copy before the step (eng_backend_copy_blocks). QL_ENOMEM
 * when s holds no block for a copy, QL_EINVAL when copies is full (or pos
 * is negative); nothing changed then. Blocks past s's table are left to
 * the step to refuse.
 */
int eng_kv_prepare_write(eng_kv_cache *kv, eng_seq_kv *s, int32_t pos, int32_t n,
                         eng_kv_copy *copies, int32_t max_copies, int32_t *n_copies);
/* Blocks referenced by more than one sequence now. */
int32_t eng_kv_shared_blocks(const eng_kv_cache *kv);
/* Copy blocks in the host arena, in order (the CPU backend's
 * eng_backend_copy_blocks; nothing for a cache without one). */
void eng_kv_copy_blocks(eng_kv_cache *kv, const eng_kv_copy *copies, int32_t n);
/* Give back s's references (a block returns to the free list when no
 * other sequence references it) and its held blocks, and zero it. */
void eng_kv_release(eng_kv_cache *kv, eng_seq_kv *s);
/* Speculative decoding's rollback: s's positions from n_tokens on hold the KV of drafted
 * tokens the model rejected; forget them (s->n_tokens becomes n_tokens), so the next step
 * writes over them in the same blocks, which stay s's (reserved for its whole answer), and the
 * prefix cache, which keeps only positions below n_tokens, never keeps them. A hybrid model's
 * s gets back its recurrent state after position n_tokens - 1 from the row states its last
 * step kept (eng_step_seq.row_states). QL_EINVAL, nothing changed, for n_tokens negative or
 * past what s has written, or s with a recurrent state whose last step kept none for it. */
int eng_kv_rollback(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_tokens, char *msg, size_t msg_len);
/* The row states of a hybrid model's host cache: n_slots slots of rows
 * recurrent states each (a step's verifying sequences, and the drafts one
 * may verify), allocated once; *bytes what they take. QL_EINVAL for a
 * cache without host states (bookkeeping only) or called twice; nothing
 * for a model without linear layers. Freed with the cache. */
int eng_kv_row_states_new(eng_kv_cache *kv, int32_t n_slots, int32_t rows, size_t *bytes, char *msg,
                          size_t msg_len);

/*
 * The prefix cache (prefix_cache.c): full blocks of prompts kept, after
 * their sequences free them, in the free queue's tail, and found again by
 * content under a configuration key (what computed them: the caller's
 * hash of the weight version and the adapters applied), so a later prompt
 * that begins the same starts past them. A kept block is still free: it is
 * forgotten when taken for a new write, blocks nothing keeps going first.
 * A chain is where a prompt's kept blocks end, carried from call to call
 * so that each block is hashed once.
 */
typedef struct eng_prefix_chain {
    uint64_t hash;    /* the chain hash of its last block (the key before any) */
    int32_t block;    /* that block (-1: none) */
    uint64_t gen;     /* and its generation, so a reused block never matches */
    int32_t n_blocks; /* the prompt's blocks the chain covers */
} eng_prefix_chain;
/* Turn the prefix cache on (off until then). */
int eng_kv_prefix_enable(eng_kv_cache *kv, char *msg, size_t msg_len);
/* Into s (empty): the kept blocks that hold the longest prefix of tokens,
 * at most max_tokens positions: whole blocks taken by reference, then the
 * first positions of a kept block no table holds that goes on from them
 * (taken out of the cache, as s writes the rest of it); s->n_tokens
 * becomes their positions, returned; *chain where the whole blocks end.
 * 0, s unchanged, when the cache is off or nothing matches. */
int32_t eng_kv_prefix_match(eng_kv_cache *kv, uint64_t key, const int32_t *tokens,
                            int32_t max_tokens, eng_seq_kv *s, eng_prefix_chain *chain);
/* Keep s's blocks that hold whole blocks of tokens[0, n_tokens) (written:
 * the step that wrote them succeeded), from where *chain ends; *chain
 * follows (a zeroed chain: from the first block). A block kept already
 * with the same content is kept once. */
void eng_kv_prefix_insert(eng_kv_cache *kv, uint64_t key, const int32_t *tokens, int32_t n_tokens,
                          const eng_seq_kv *s, eng_prefix_chain *chain);
/* Blocks the prefix cache keeps now (in use or free). */
int32_t eng_kv_prefix_blocks(const eng_kv_cache *kv);

/* A worker pool for the CPU kernels (pool.c): n threads (0: the
 * machine's cores), the caller's thread included. */
typedef struct eng_pool eng_pool;
int eng_pool_new(eng_pool **out, int n_threads, char *msg, size_t msg_len);
void eng_pool_free(eng_pool *p);
int eng_pool_threads(const eng_pool *p);
/* Run fn(ctx, i, n) for i in [0, n) split over the threads; returns when
 * all are done. */
void eng_pool_run(eng_pool *p, void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx,
                  int64_t n, int64_t grain);
/* The same, fn told which thread runs the chunk: worker in [0,
 * eng_pool_threads(p)), 0 the caller's (also for a NULL pool), no two
 * chunks at once on one worker; so a job can keep scratch per thread,
 * allocated once for the pool's threads rather than per chunk. */
void eng_pool_run_workers(eng_pool *p,
                          void (*fn)(void *ctx, int worker, int64_t begin, int64_t end), void *ctx,
                          int64_t n, int64_t grain);
/* y[batch][w.rows] = x[batch][w.cols] @ w^T over the pool (project_cpu.c). */
void eng_cpu_matmul(eng_pool *pool, const qtensor *w, const float *x, int64_t batch, float *y);

/* One sequence's part of a forward step: its new tokens, written at
 * positions [pos, pos + n_tokens) of its KV (already reserved to hold
 * them), attending to everything before them. */
typedef struct eng_step_seq {
    eng_seq_kv *kv;
    const int32_t *tokens;
    int32_t n_tokens;
    int32_t pos;
    /* the weight version the sequence runs on (NULL: the model's own) and
     * the adapters it applies unmerged on top of it, in order (the signed
     * difference between what it wants and what the version has merged) */
    const struct eng_weights *weights;
    const struct eng_lora_term *delta;
    int32_t n_delta;
    /* longrope: every position of the sequence rotates with the long
     * factor set (eng_rope_long_for of what it reserved, chosen once when
     * it began), else the short one; its KV blocks may be shared only with
     * sequences of the same set. Other ropes ignore it. */
    bool rope_long;
    /* the caller only needs the greedy token (eng_sample's at temperature 0
     * without a penalty): a backend that can choose it where the logits are
     * (eng_backend_forward's tokens) need not return this row's logits */
    bool greedy;
    /* or the caller wants a plain temperature draw (eng_sampler_plain_draw)
     * with this 1 / T and this uniform, already taken from the sequence's
     * stream: only for a backend that draws (eng_backend_draws), which then
     * must put the token in tokens */
    bool draw;
    float inv_temperature;
    double u;
    /* when not NULL (host memory, n_tokens x vocab): the logits of every
     * new token of this sequence, not only its last (a prompt's
     * logprobs); its row of the step's logits is written as well */
    float *all_logits;
    /* 1 + the slot of the cache's row states (eng_kv_row_states_new) keeping a hybrid model's
     * state after each row but the last, for eng_kv_rollback (0: none; CPU backend only) */
    int32_t row_states;
    /* the MTP drafter's (mtp.h; NULL: none): hidden_out (host, n_tokens x hidden) gets each
     * row after the final norm; embeds (CPU backend only) replaces the tokens' embeddings */
    float *hidden_out;
    const float *embeds;
} eng_step_seq;

/* Scratch of the forward pass, sized for up to max_tokens new tokens per
 * step (a step's prefill chunks plus decodes). */
typedef struct eng_forward_state eng_forward_state;
int eng_forward_state_new(eng_forward_state **out, const eng_model *m, int32_t max_tokens,
                          char *msg, size_t msg_len);
void eng_forward_state_free(eng_forward_state *st);
/* The last eng_forward's mixture-of-experts figures (eng_backend_moe_step). */
void eng_forward_moe_step(const eng_forward_state *st, uint64_t *experts, uint64_t *bytes);

/*
 * One batched step over n_seqs sequences: every weight is read once for all
 * their new tokens together. logits (n_seqs x vocab) receives the logits of
 * each sequence's last new token. A sequence's result does not depend on
 * what else is in the step (bit for bit). Refuses, changing nothing: token
 * ids outside the vocabulary, positions past the context or the reserved
 * KV, a position that leaves a gap after the cached ones, a write into a
 * KV block another sequence shares (eng_kv_prepare_write not called), and
 * more than the state's max_tokens new tokens in one step.
 */
int eng_forward(eng_forward_state *st, const eng_model *m, eng_kv_cache *kv, eng_pool *pool,
                const eng_step_seq *seqs, int32_t n_seqs, float *logits, char *msg, size_t msg_len);

/*
 * The unmerged LoRA product, added after a base product: y[b] += scale *
 * (x[b] @ A^T) @ B^T for the batch rows of x (in_features wide) and y
 * (out_features wide), both products over the pool. t (batch * rank) and u
 * (batch * out_features) are scratch. Each row's arithmetic is the same
 * whatever the batch, so grouping rows never changes a bit.
 */
void eng_lora_apply(eng_pool *pool, const eng_lora_module *mod, float scale, const float *x,
                    int64_t batch, float *y, float *t, float *u);

/* --- backends: where a forward step runs (backend.c; the CUDA one in
 *     backend_cuda.c when built with CUDA) ------------------------------------ */

/* Which backend: cpu (always built, the reference; the zero value, so
 * options built by hand stay on the CPU), cuda (an NVIDIA GPU), or auto
 * (cuda when this build has it and a device is present, else cpu: what the
 * command line defaults to). The values are base's ql_device, whose table
 * (ql_device_names) holds the words. */
typedef enum eng_device {
    ENG_DEVICE_CPU = QL_DEVICE_CPU,
    ENG_DEVICE_CUDA = QL_DEVICE_CUDA,
    ENG_DEVICE_AUTO = QL_DEVICE_AUTO,
} eng_device;

/* "cpu", "cuda", "auto" -> *out; QL_EINVAL naming the value otherwise. */
int eng_device_parse(const char *name, eng_device *out, char *msg, size_t msg_len);
const char *eng_device_name(eng_device d);
/* Whether this build has the CUDA backend. */
bool eng_cuda_built(void);
/* One line on the CUDA side of this build, for `qlserve version`: the
 * runtime, the devices it sees and the architectures compiled, or that the
 * build has no CUDA backend. */
void eng_cuda_describe(char *out, size_t out_len);

/*
 * A backend: the model's weights where it computes, its KV cache, and the
 * scratch of a step. The CPU backend borrows the model's tensors and runs
 * eng_forward over a worker pool; the CUDA backend uploads every weight
 * once at creation (in its quantized layout), keeps the KV cache in device
 * memory, and runs the step there. Both take the same eng_step_seq lists
 * and must give the same greedy tokens. Owned by one thread at a time.
 */
typedef struct eng_backend eng_backend;

typedef struct eng_backend_opts {
    eng_device device;
    int threads;          /* CPU kernel threads; 0: the machine's cores */
    int32_t max_tokens;   /* new tokens one step may carry */
    int32_t max_seqs;     /* sequences one step may carry */
    size_t kv_bytes;      /* KV cache size (host or device memory) */
    int32_t block_tokens; /* KV block, positions */
    qt_kind kv_dtype;     /* QT_F32 (the zero value), QT_F16 or QT_Q8_0; cuda: f32 only */
} eng_backend_opts;

/* The KV dtype --kv-dtype names (as eng_kv_dtype_parse), or, for name
 * NULL (not given), the default for device: f16 where the CPU backend will
 * run, f32 on CUDA (whose kernels read f32 only). */
int eng_kv_dtype_resolve(const char *name, eng_device device, qt_kind *out, char *msg,
                         size_t msg_len);

/* Make the backend o->device names for model m (borrowed: it must outlive
 * the backend). cuda without a device, or in a build without CUDA, is an
 * error naming why; out of device memory names what did not fit. */
int eng_backend_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o, char *msg,
                    size_t msg_len);
void eng_backend_free(eng_backend *b);
/* "cpu (2 threads)", "cuda (NVIDIA H200, sm_90, 5.1 GiB of weights)": for
 * logs and /info. */
const char *eng_backend_describe(const eng_backend *b);
/* Which device it is (never ENG_DEVICE_AUTO). */
eng_device eng_backend_device(const eng_backend *b);
/* Whether the backend chooses greedy tokens and makes plain temperature
 * draws itself (eng_step_seq.greedy, .draw): the CUDA one does. */
bool eng_backend_draws(const eng_backend *b);
/* The last step's mixture of experts (0, 0 for a dense model): how many
 * experts ran, summed over the layers (each chosen expert runs once per
 * layer for all the rows routed to it), and the bytes of their weights
 * read. */
void eng_backend_moe_step(const eng_backend *b, uint64_t *experts, uint64_t *bytes);
/* The backend's KV cache bookkeeping (block tables are handed out here). */
eng_kv_cache *eng_backend_kv(eng_backend *b);
/*
 * One step, as eng_forward: logits (n_seqs x vocab, host memory) gets each
 * sequence's last-token logits; where tokens is not NULL and seqs[k].greedy,
 * the backend may instead put the greedy token in tokens[k] and leave row k
 * of logits unwritten; tokens[k] = -1 where it did not.
 */
int eng_backend_forward(eng_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
                        int32_t *tokens, char *msg, size_t msg_len);
/* Copy KV blocks (src to dst, in order) where the backend keeps its
 * cache, before the next step reads them (copy on write); QL_EINVAL,
 * nothing copied, for a block outside the cache or src == dst. */
int eng_backend_copy_blocks(eng_backend *b, const eng_kv_copy *copies, int32_t n, char *msg,
                            size_t msg_len);
/*
 * eng_weights_digest of what the backend computes with for version w (NULL:
 * the model's own weights): the CPU backend's are the host tensors
 * themselves; the CUDA backend copies its device tensors back (building
 * the version's device copy, merges included, if no step has yet), so a
 * merge and an unmerge on the device can be checked bit for bit.
 */
int eng_backend_digest(eng_backend *b, const eng_weights *w, uint64_t *digest, char *msg,
                       size_t msg_len);
/* Whether the backend builds a weight version's merges itself, on the
 * device, from its pristine copy (the CUDA one), rather than computing
 * with the host's merged tensors (the CPU one). Constant for a backend, so
 * any thread may ask. */
bool eng_backend_merges_on_device(const eng_backend *b);
/*
 * Build version w's merged copy where the backend computes, with each
 * module's merge figures in costs (n_layers x eng_n_proj, when not NULL)
 * and, when digest is not NULL, eng_backend_digest of the result: from the
 * thread that owns the backend, between steps. A backend that merges on
 * the host refuses (QL_EINVAL naming its device), touching nothing, so that
 * refusal may come from any thread.
 */
int eng_backend_prepare(eng_backend *b, const eng_weights *w, eng_merge_cost *costs,
                        uint64_t *digest, char *msg, size_t msg_len);

#endif

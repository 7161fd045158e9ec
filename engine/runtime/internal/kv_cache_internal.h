/*
 * kv_cache_internal.h - the KV cache's layout (struct eng_kv_cache and
 * kv_row, eng_kv_check_writes), shared by kv_cache.c (which owns the blocks),
 * forward.c (which reads and writes the host arena), walk.c (which
 * refuses writes into shared blocks) and step.c (which reads the block
 * size), and prefix_cache.c (which keeps blocks past their sequences);
 * backend_cuda.c keeps a hybrid model's recurrent states on the device
 * through its state hook. Nothing outside engine/runtime/ includes it.
 */
#ifndef QL_KV_CACHE_INTERNAL_H
#define QL_KV_CACHE_INTERNAL_H

#include "runtime.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* A hybrid model's recurrent states kept outside a bookkeeping-only cache
 * (eng_kv_new_meta; the CUDA backend's device pool): the cache tells their
 * keeper, on the thread that calls eng_kv_*, that slot dst was taken for a
 * new sequence (src -1: zero it, as the host pool is) or forked from slot
 * src (copy it whole, before either steps again). The keeper reports a
 * failure of its own at its next step. */
typedef void (*eng_kv_state_hook)(void *ctx, int32_t dst, int32_t src);
void eng_kv_set_state_hook(struct eng_kv_cache *kv, eng_kv_state_hook hook, void *ctx);

struct eng_kv_cache {
    unsigned char *data; /* n_blocks * block_bytes */
    int32_t n_blocks;
    int32_t block_tokens;
    int32_t n_layers; /* layers with keys and values (a hybrid model's full ones) */
    /* per layer of the model: where its K rows start in a block (bytes;
     * its V rows follow them), its row's bytes and values (kv heads x head
     * size, which Gemma 4's full layers have their own of); a layer without
     * keys and values (a hybrid model's linear one) has rows of 0 */
    size_t *layer_off, *layer_row;
    int64_t *layer_dim;
    int64_t kv_dim;      /* the model's n_kv_heads x head_dim (every layer's but Gemma 4's full) */
    size_t block_floats; /* values one block holds */
    qt_kind dtype;       /* QT_F32, QT_F16 or QT_Q8_0 */
    size_t row_bytes;    /* one position's K (or V) of a layer of kv_dim values */
    size_t block_bytes;
    /* the free blocks, a doubly linked queue taken from its head: a block
     * that holds nothing worth keeping goes back at the head, one the
     * prefix cache keeps at the tail, so such blocks are reused last, least
     * recently freed first */
    int32_t *free_prev, *free_next; /* -1 ends the queue; both -1 off it too */
    int32_t free_head, free_tail;
    int32_t n_free;
    /* per block: the block tables that reference it, or 1 for a block a
     * sequence holds outside its table; 0 exactly when it is free */
    int32_t *refs;
    int32_t n_shared;         /* blocks whose refs is above 1 */
    struct kv_prefix *prefix; /* the prefix cache (prefix_cache.c); NULL: off */
    /* a hybrid model's recurrent states (hybrid.h), one slot a sequence:
     * state_floats each in `states` (host; NULL in a bookkeeping-only
     * cache), the positions each has taken in (-1 while a step writes it,
     * or after one failed), and the free slots as a stack */
    int32_t n_states;
    int64_t state_floats;
    float *states;
    int32_t *state_pos;
    int32_t *state_free;
    int32_t n_state_free;
    /* where the states live outside the cache (no host `states`): told of
     * each slot taken and each fork (eng_kv_set_state_hook); NULL: none */
    eng_kv_state_hook state_hook;
    void *state_hook_ctx;
    /* speculative decoding's row states (eng_kv_row_states_new): n_row_slots
     * slots of row_rows states; per slot, the state slot whose step kept it
     * (-1: none, or kept for a step that is gone), that step's first
     * position and how many rows it kept */
    float *row_states;
    int32_t n_row_slots, row_rows;
    int32_t *row_owner, *row_pos, *row_n;
};

/* Sequence s's recurrent state (eng_seq_kv.state is its slot + 1), or
 * NULL when it has none. */
static inline float *kv_state(const struct eng_kv_cache *kv, const eng_seq_kv *s)
{
    if (s->state <= 0 || !kv->states)
        return NULL;
    return kv->states + (size_t)(s->state - 1) * (size_t)kv->state_floats;
}

/* Row t of row-state slot (eng_step_seq.row_states - 1): a whole
 * recurrent state, laid out as kv_state's. */
static inline float *kv_row_state(const struct eng_kv_cache *kv, int32_t slot, int32_t t)
{
    return kv->row_states +
           ((size_t)slot * (size_t)kv->row_rows + (size_t)t) * (size_t)kv->state_floats;
}

/* Refuse (QL_EINVAL naming the sequence) a step of a hybrid model whose
 * sequence has no recurrent state, or one that has not taken in exactly
 * the positions before the step's first (a prefix match, a rolled-back or
 * failed step: a recurrent state cannot be rewound), or whose row states
 * (eng_step_seq.row_states) the cache cannot keep; then mark every step's
 * state as being written. */
int eng_kv_check_states(struct eng_kv_cache *kv, const eng_step_seq *seqs, int32_t n_seqs,
                        char *msg, size_t msg_len);
/* After a step that succeeded: each sequence's state has taken in its new
 * tokens. */
void eng_kv_states_done(struct eng_kv_cache *kv, const eng_step_seq *seqs, int32_t n_seqs);

/* Free block b (refs 0) whose prompt content the prefix cache keeps:
 * whether it does. */
bool kv_prefix_keeps(const struct eng_kv_cache *kv, int32_t b);
/* Block b leaves the free queue to be written anew: the prefix cache
 * forgets it (nothing when it kept nothing). */
void kv_prefix_forget(struct eng_kv_cache *kv, int32_t b);
void kv_prefix_free(struct kv_prefix *p);
/* The few block moves prefix_cache.c shares with kv_cache.c, inline so
 * that the two files call each other one way only. */

/* Take b off the free queue. */
static inline void kv_unlink_free(struct eng_kv_cache *kv, int32_t b)
{
    int32_t p = kv->free_prev[b], n = kv->free_next[b];
    if (p >= 0)
        kv->free_next[p] = n;
    else
        kv->free_head = n;
    if (n >= 0)
        kv->free_prev[n] = p;
    else
        kv->free_tail = p;
    kv->free_prev[b] = kv->free_next[b] = -1;
    kv->n_free--;
}

/* One more table references b. */
static inline void kv_ref_block(struct eng_kv_cache *kv, int32_t b)
{
    if (++kv->refs[b] == 2)
        kv->n_shared++;
}

/* Take block b, free or referenced, for one more block table (a prefix
 * cache hit): off the free queue when free. */
static inline void kv_take_block(struct eng_kv_cache *kv, int32_t b)
{
    if (kv->refs[b] == 0) {
        kv_unlink_free(kv, b);
        kv->refs[b] = 1;
    } else {
        kv_ref_block(kv, b);
    }
}

/* Room for n entries in *arr (a block table or a held list); false when
 * out of memory, *arr unchanged. */
static inline bool kv_grow_list(int32_t **arr, int32_t n)
{
    if (n == 0)
        return true;
    int32_t *t = realloc(*arr, (size_t)n * sizeof *t);
    if (!t)
        return false;
    *arr = t;
    return true;
}

/* Refuse (QL_EINVAL naming the sequence and block) a step that would
 * write into a block another sequence's table references too: its
 * eng_kv_prepare_write was not called, and the write would reach the other
 * sequence. Both backends ask before computing anything. */
int eng_kv_check_writes(const struct eng_kv_cache *kv, const eng_step_seq *seqs, int32_t n_seqs,
                        char *msg, size_t msg_len);

/* The row (layer_dim[l] values in kv->dtype, layer_row[l] bytes long:
 * qt_kv_store and qt_kv_load read and write it) of K (v = 0) or V (v = 1)
 * of layer l (a layer that has keys and values) at position pos of a
 * sequence whose block table is `blocks`; the next position's row of the
 * block lies layer_row[l] bytes on. */
static inline void *kv_row(const struct eng_kv_cache *kv, const int32_t *blocks, int32_t l, int v,
                           int32_t pos)
{
    int32_t b = blocks[pos / kv->block_tokens], slot = pos % kv->block_tokens;
    return kv->data + (size_t)b * kv->block_bytes + kv->layer_off[l] +
           ((size_t)v * (size_t)kv->block_tokens + (size_t)slot) * kv->layer_row[l];
}

#endif

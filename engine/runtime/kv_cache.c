/*
 * kv_cache.c - the paged KV cache: one arena cut into blocks of
 * `block_tokens` positions, each block holding K and V of every layer for
 * those positions, handed to sequences through per-sequence block tables
 * (the vLLM PagedAttention layout). Sizing is in bytes, as an operator
 * thinks of memory; a sequence that cannot get blocks waits, and a finished
 * one gives them back at once, whatever order sequences end in.
 *
 * Block layout: for layer l, K then V, each [block_tokens] rows of kv_dim
 * values, kv_dim = n_kv_heads * head_dim (Gemma 4's full layers: their
 * own heads and head size, so layers' rows may differ; kv_layout places
 * each layer after the one before), a row stored as the cache's dtype
 * (f32; f16; q8_0, llama.cpp's blocks of 32 with an f16 scale), so the
 * same bytes hold 2x (f16) or 32/8.5 = 3.76x (q8_0) the positions of f32.
 * kernels/ (qt_kv_store, qt_kv_load) converts rows; this file only sizes
 * and copies them. Owned by the engine thread: no locks.
 *
 * Sharing (n choices of one prompt): a block carries a reference count,
 * the number of block tables that hold it (or 1 while a sequence holds it
 * outside its table, for a fork or a copy to come). A fork takes its
 * source's written blocks by reference; a write into a block another table
 * also references first swaps it for a held block of the writer's own and
 * lists the pair to copy (copy on write, as vLLM's block manager), so no
 * allocation ever happens inside a step. Every call costs in proportion to
 * the blocks it touches. What always holds: free + held + referenced
 * blocks == total, and a block is free exactly when its count is 0.
 *
 * Free blocks wait in a queue: those the prefix cache keeps (prompt
 * content a later request may reuse, prefix_cache.c) at its tail, the
 * others at its head, and a block is taken from the head; so kept content
 * is overwritten last, least recently freed first.
 *
 * It offers eng_kv_* (runtime.h; eng_kv_check_writes, for the backends, in
 * internal/kv_cache_internal.h) and owns the arena and the free queue; it
 * calls nothing else in engine/runtime/ but prefix_cache.c's hooks (a
 * sequence that cannot get blocks is the scheduler's to hold back).
 */
#include "internal/kv_cache_internal.h"
#include "runtime.h"

#include <stdlib.h>
#include <string.h>

/* Write one byte of every page of [p, p + n): each page faulted in now. */
static void touch_pages(void *p, size_t n)
{
    volatile unsigned char *b = p;
    for (size_t i = 0; i < n; i += 4096)
        b[i] = 0;
    if (n)
        b[n - 1] = 0;
}

/* A hybrid model's recurrent states (n of them, none for a model without
 * linear layers) into kv, host memory when it has an arena. */
static int states_new(eng_kv_cache *kv, const eng_config *cfg, int32_t n, bool host_arena)
{
    kv->state_floats = eng_linear_seq_state(&cfg->linear);
    if (kv->state_floats <= 0 || n <= 0)
        return QL_OK;
    kv->n_states = kv->n_state_free = n;
    kv->state_pos = malloc((size_t)n * sizeof *kv->state_pos);
    kv->state_free = malloc((size_t)n * sizeof *kv->state_free);
    kv->states = host_arena ? malloc((size_t)n * (size_t)kv->state_floats * sizeof(float)) : NULL;
    if (!kv->state_pos || !kv->state_free || (host_arena && !kv->states))
        return QL_ENOMEM;
    if (kv->states) /* committed now, as the blocks' arena is */
        touch_pages(kv->states, (size_t)n * (size_t)kv->state_floats * sizeof(float));
    for (int32_t i = 0; i < n; i++) {
        kv->state_free[i] = n - 1 - i; /* slot 0 on top */
        kv->state_pos[i] = -1;
    }
    return QL_OK;
}

/* Each layer's place in a block, row bytes and values (kv_cache_internal.h):
 * the layers with keys and values one after another, K then V, a hybrid
 * model's linear layers none; the block's bytes and values into *bytes and
 * *floats. Refuses (QL_EINVAL) a layer whose row the dtype cannot hold. */
static int kv_layout(eng_kv_cache *kv, const eng_config *cfg, size_t *bytes, size_t *floats,
                     char *msg, size_t msg_len)
{
    size_t L = (size_t)cfg->n_layers, bt = (size_t)kv->block_tokens;
    kv->layer_off = malloc(L * sizeof *kv->layer_off);
    kv->layer_row = malloc(L * sizeof *kv->layer_row);
    kv->layer_dim = malloc(L * sizeof *kv->layer_dim);
    if (!kv->layer_off || !kv->layer_row || !kv->layer_dim)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    *bytes = *floats = 0;
    for (int32_t l = 0; l < cfg->n_layers; l++) {
        bool keeps = !eng_linear_is(&cfg->linear, l);
        int64_t dim = keeps ? (int64_t)eng_layer_kv_heads(cfg, l) * eng_layer_head_dim(cfg, l) : 0;
        size_t row = qt_kv_row_bytes(kv->dtype, dim);
        if (keeps && row == 0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "KV cache dtype %s needs kv_dim (kv heads x head_dim) a multiple of "
                           "32; this model's (layer %d's) is %lld (use --kv-dtype f16 or f32)",
                           qt_kind_name(kv->dtype), l, (long long)dim);
        kv->layer_off[l] = *bytes;
        kv->layer_row[l] = row;
        kv->layer_dim[l] = dim;
        *bytes += 2 * bt * row;
        *floats += 2 * bt * (size_t)dim;
    }
    return QL_OK;
}

static int kv_new(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                  qt_kind dtype, bool host_arena, int32_t n_states, char *msg, size_t msg_len)
{
    *out = NULL;
    /* a hybrid model's recurrent states come out of the bytes first */
    int64_t state_floats = eng_linear_seq_state(&cfg->linear);
    size_t state_bytes = state_floats > 0 && n_states > 0
                             ? (size_t)n_states * (size_t)state_floats * sizeof(float)
                             : 0;
    if (state_bytes >= bytes)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "KV cache of %zu bytes cannot hold the %d recurrent states of this hybrid "
                       "model's %d linear layers (%zu bytes each) and a block",
                       bytes, n_states, cfg->linear.n_layers, state_bytes / (size_t)n_states);
    bytes -= state_bytes;
    int32_t bt = block_tokens > 0 ? block_tokens : 16;
    if (dtype != QT_F32 && dtype != QT_F16 && dtype != QT_Q8_0)
        return ql_fail(msg, msg_len, QL_EINVAL, "KV cache dtype %s: expected f32, f16 or q8_0",
                       qt_kind_name(dtype));
    /* a hybrid model's linear layers keep no keys or values (their
     * recurrent states do), so a block holds the full layers' alone */
    int32_t kv_layers = cfg->n_layers - cfg->linear.n_layers;
    if (kv_layers <= 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "every one of the model's %d layers is linear attention: qlserve runs "
                       "hybrids with at least one full-attention layer",
                       cfg->n_layers);
    eng_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    kv->block_tokens = bt;
    kv->n_layers = kv_layers;
    kv->kv_dim = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    kv->dtype = dtype;
    kv->row_bytes = qt_kv_row_bytes(dtype, kv->kv_dim);
    int rc = kv_layout(kv, cfg, &kv->block_bytes, &kv->block_floats, msg, msg_len);
    if (rc != QL_OK) {
        eng_kv_free(kv);
        return rc;
    }
    size_t block_bytes = kv->block_bytes;
    if (block_bytes == 0 || bytes / block_bytes < 1) {
        eng_kv_free(kv);
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "KV cache of %zu bytes holds no block of %d positions (%zu bytes each)",
                       bytes, bt, block_bytes);
    }
    size_t n = bytes / block_bytes;
    if (n > INT32_MAX)
        n = INT32_MAX;
    kv->n_blocks = (int32_t)n;
    kv->data = host_arena ? malloc(n * block_bytes) : NULL;
    kv->free_prev = malloc(n * sizeof *kv->free_prev);
    kv->free_next = malloc(n * sizeof *kv->free_next);
    kv->refs = calloc(n, sizeof *kv->refs);
    if ((host_arena && !kv->data) || !kv->free_prev || !kv->free_next || !kv->refs ||
        states_new(kv, cfg, n_states, host_arena) != QL_OK) {
        eng_kv_free(kv);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate a KV cache of %zu bytes",
                       n * block_bytes);
    }
    /* every page of the arena touched now, not as blocks are first used:
     * the prefix cache hands out fresh blocks before the ones it keeps, so
     * an untouched arena would grow the process's RSS for as long as
     * requests run until the whole pool had been used (the soak's RSS
     * slope measured that, not a leak); the memory is committed up front,
     * as --kv-mib says (a memset after malloc would not do: the compiler
     * may make the pair a calloc, which leaves fresh pages untouched) */
    if (host_arena)
        touch_pages(kv->data, n * block_bytes);
    /* hand out low block numbers first: easier to read in a debugger */
    for (int32_t i = 0; i < kv->n_blocks; i++) {
        kv->free_prev[i] = i - 1;
        kv->free_next[i] = i + 1 < kv->n_blocks ? i + 1 : -1;
    }
    kv->free_head = 0;
    kv->free_tail = kv->n_blocks - 1;
    kv->n_free = kv->n_blocks;
    *out = kv;
    return QL_OK;
}

int eng_kv_new(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
               char *msg, size_t msg_len)
{
    return kv_new(out, cfg, bytes, block_tokens, QT_F32, true, ENG_KV_DEFAULT_STATES, msg, msg_len);
}

int eng_kv_new_states(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                      qt_kind dtype, int32_t n_states, char *msg, size_t msg_len)
{
    return kv_new(out, cfg, bytes, block_tokens, dtype, true, n_states, msg, msg_len);
}

int eng_kv_new_dtype(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                     qt_kind dtype, char *msg, size_t msg_len)
{
    return kv_new(out, cfg, bytes, block_tokens, dtype, true, ENG_KV_DEFAULT_STATES, msg, msg_len);
}

int eng_kv_new_meta(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                    int32_t n_states, char *msg, size_t msg_len)
{
    return kv_new(out, cfg, bytes, block_tokens, QT_F32, false, n_states, msg, msg_len);
}

int eng_kv_dtype_parse(const char *name, qt_kind *out, char *msg, size_t msg_len)
{
    static const qt_kind kinds[] = {
        [QL_KV_DTYPE_F32] = QT_F32, [QL_KV_DTYPE_F16] = QT_F16, [QL_KV_DTYPE_Q8_0] = QT_Q8_0};
    int d = ql_name_expect(&ql_kv_dtype_names, "KV dtype", name, msg, msg_len);
    if (d < 0)
        return d;
    *out = kinds[d];
    return QL_OK;
}

qt_kind eng_kv_dtype(const eng_kv_cache *kv)
{
    return kv->dtype;
}

size_t eng_kv_token_bytes(const eng_config *cfg, qt_kind dtype)
{
    size_t bytes = 0;
    for (int32_t l = 0; l < cfg->n_layers; l++)
        if (!eng_linear_is(&cfg->linear, l))
            bytes += 2 * qt_kv_row_bytes(dtype, (int64_t)eng_layer_kv_heads(cfg, l) *
                                                    eng_layer_head_dim(cfg, l));
    return bytes;
}

size_t eng_kv_block_floats(const eng_kv_cache *kv)
{
    return kv->block_floats;
}

void eng_kv_free(eng_kv_cache *kv)
{
    if (!kv)
        return;
    kv_prefix_free(kv->prefix);
    free(kv->data);
    free(kv->free_prev);
    free(kv->free_next);
    free(kv->refs);
    free(kv->states);
    free(kv->state_pos);
    free(kv->state_free);
    free(kv->row_states);
    free(kv->row_owner);
    free(kv->row_pos);
    free(kv->row_n);
    free(kv->layer_off);
    free(kv->layer_row);
    free(kv->layer_dim);
    free(kv);
}

int32_t eng_kv_total_states(const eng_kv_cache *kv)
{
    return kv->n_states;
}

int32_t eng_kv_free_states(const eng_kv_cache *kv)
{
    return kv->n_state_free;
}

size_t eng_kv_state_bytes(const eng_kv_cache *kv)
{
    return kv->n_states > 0 ? (size_t)kv->state_floats * sizeof(float) : 0;
}

/* A free recurrent state for s, zeroed (a sequence that has taken in
 * nothing), when the model has them and s has none; false when none is
 * free. */
static bool take_state(eng_kv_cache *kv, eng_seq_kv *s)
{
    if (kv->n_states == 0 || s->state > 0)
        return true;
    if (kv->n_state_free == 0)
        return false;
    int32_t slot = kv->state_free[--kv->n_state_free];
    s->state = slot + 1;
    kv->state_pos[slot] = 0;
    if (kv->states)
        memset(kv_state(kv, s), 0, (size_t)kv->state_floats * sizeof(float));
    else if (kv->state_hook)
        kv->state_hook(kv->state_hook_ctx, slot, -1);
    return true;
}

void eng_kv_set_state_hook(eng_kv_cache *kv, eng_kv_state_hook hook, void *ctx)
{
    kv->state_hook = hook;
    kv->state_hook_ctx = ctx;
}

/* The row states kept for state slot `state` describe a step it no longer
 * ends with (it steps again, or is given back): never restore them. */
static void forget_rows(eng_kv_cache *kv, int32_t state)
{
    for (int32_t i = 0; i < kv->n_row_slots; i++)
        if (kv->row_owner[i] == state)
            kv->row_owner[i] = -1;
}

static void give_state(eng_kv_cache *kv, eng_seq_kv *s)
{
    if (s->state <= 0 || kv->n_states == 0)
        return;
    forget_rows(kv, s->state - 1);
    kv->state_pos[s->state - 1] = -1;
    kv->state_free[kv->n_state_free++] = s->state - 1;
    s->state = 0;
}

int32_t eng_kv_block_tokens(const eng_kv_cache *kv)
{
    return kv->block_tokens;
}

int32_t eng_kv_total_blocks(const eng_kv_cache *kv)
{
    return kv->n_blocks;
}

int32_t eng_kv_free_blocks(const eng_kv_cache *kv)
{
    return kv->n_free;
}

int32_t eng_kv_blocks_for(const eng_kv_cache *kv, int32_t n_tokens)
{
    return n_tokens <= 0 ? 0 : (n_tokens + kv->block_tokens - 1) / kv->block_tokens;
}

/* b (refs now 0) back on the free queue: at the tail when the prefix cache
 * keeps its content, to be reused last; at the head otherwise. */
static void give_back(eng_kv_cache *kv, int32_t b)
{
    if (kv->prefix && kv_prefix_keeps(kv, b)) {
        kv->free_prev[b] = kv->free_tail;
        kv->free_next[b] = -1;
        if (kv->free_tail >= 0)
            kv->free_next[kv->free_tail] = b;
        else
            kv->free_head = b;
        kv->free_tail = b;
    } else {
        kv->free_prev[b] = -1;
        kv->free_next[b] = kv->free_head;
        if (kv->free_head >= 0)
            kv->free_prev[kv->free_head] = b;
        else
            kv->free_tail = b;
        kv->free_head = b;
    }
    kv->n_free++;
}

/* A block off the free queue, held once; what the prefix cache kept in it
 * is forgotten, as it is about to be written. */
static int32_t take_free(eng_kv_cache *kv)
{
    int32_t b = kv->free_head;
    kv_unlink_free(kv, b);
    if (kv->prefix)
        kv_prefix_forget(kv, b);
    kv->refs[b] = 1;
    return b;
}

/* One reference to b fewer; back to the free list at none. */
static void unref_block(eng_kv_cache *kv, int32_t b)
{
    int32_t r = --kv->refs[b];
    if (r == 1)
        kv->n_shared--;
    else if (r == 0)
        give_back(kv, b);
}

int eng_kv_reserve(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_tokens)
{
    int32_t need = eng_kv_blocks_for(kv, n_tokens) - s->n_blocks;
    if (need > kv->n_free || (need > 0 && !kv_grow_list(&s->blocks, s->n_blocks + need)))
        return QL_ENOMEM;
    if (!take_state(kv, s))
        return QL_ENOMEM;
    for (int32_t i = 0; i < need; i++)
        s->blocks[s->n_blocks++] = take_free(kv);
    return QL_OK;
}

int eng_kv_hold(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_blocks)
{
    if (n_blocks < 0)
        return QL_EINVAL;
    if (n_blocks > kv->n_free || !kv_grow_list(&s->held, s->n_held + n_blocks))
        return QL_ENOMEM;
    for (int32_t i = 0; i < n_blocks; i++)
        s->held[s->n_held++] = take_free(kv);
    return QL_OK;
}

/* Whether the last of the blocks holding n_shared positions is partly
 * filled (its next write, in a fork, is a copy on write). */
static bool last_block_partial(const eng_kv_cache *kv, int32_t n_shared)
{
    return n_shared % kv->block_tokens != 0;
}

int32_t eng_kv_fork_blocks(const eng_kv_cache *kv, int32_t n_shared, int32_t n_tokens)
{
    int32_t grow = eng_kv_blocks_for(kv, n_tokens) - eng_kv_blocks_for(kv, n_shared);
    return (grow > 0 ? grow : 0) + (last_block_partial(kv, n_shared) ? 1 : 0);
}

int eng_kv_fork(eng_kv_cache *kv, eng_seq_kv *dst, eng_seq_kv *src, int32_t n_tokens)
{
    if (dst == src || dst->n_blocks != 0 || dst->n_held != 0 || dst->n_tokens != 0)
        return QL_EINVAL;
    int32_t n_shared = src->n_tokens, shared = eng_kv_blocks_for(kv, n_shared);
    if (shared > src->n_blocks)
        return QL_EINVAL; /* positions written past the table: not a sequence */
    int32_t take = eng_kv_fork_blocks(kv, n_shared, n_tokens);
    int32_t cow = last_block_partial(kv, n_shared) ? 1 : 0, grow = take - cow;
    if (take > src->n_held || (kv->n_states > 0 && src->state > 0 && kv->n_state_free == 0))
        return QL_ENOMEM;
    /* both lists first, so a failure changes nothing */
    int32_t *blocks = NULL, *held = NULL;
    if (!kv_grow_list(&blocks, shared + grow) || !kv_grow_list(&held, cow)) {
        free(blocks);
        return QL_ENOMEM;
    }
    for (int32_t i = 0; i < shared; i++) {
        blocks[i] = src->blocks[i];
        kv_ref_block(kv, blocks[i]);
    }
    for (int32_t i = 0; i < grow; i++)
        blocks[shared + i] = src->held[--src->n_held];
    if (cow)
        held[0] = src->held[--src->n_held];
    /* dst is empty, but may own empty lists (a prefix match that found
     * nothing grows its table first) */
    free(dst->blocks);
    free(dst->held);
    *dst = (eng_seq_kv){.blocks = blocks,
                        .n_blocks = shared + grow,
                        .n_tokens = n_shared,
                        .held = held,
                        .n_held = cow};
    /* a hybrid model's recurrent state is copied whole: it cannot be shared */
    if (kv->n_states > 0 && src->state > 0) {
        take_state(kv, dst);
        if (kv->states)
            memcpy(kv_state(kv, dst), kv_state(kv, src), (size_t)kv->state_floats * sizeof(float));
        else if (kv->state_hook)
            kv->state_hook(kv->state_hook_ctx, dst->state - 1, src->state - 1);
        kv->state_pos[dst->state - 1] = kv->state_pos[src->state - 1];
    }
    return QL_OK;
}

int eng_kv_prepare_write(eng_kv_cache *kv, eng_seq_kv *s, int32_t pos, int32_t n,
                         eng_kv_copy *copies, int32_t max_copies, int32_t *n_copies)
{
    if (pos < 0 || n <= 0)
        return n == 0 && pos >= 0 ? QL_OK : QL_EINVAL;
    /* blocks past the table are the step's to refuse, not a copy's */
    int32_t first = pos / kv->block_tokens, end = eng_kv_blocks_for(kv, pos + n);
    if (end > s->n_blocks)
        end = s->n_blocks;
    int32_t need = 0;
    for (int32_t i = first; i < end; i++)
        need += kv->refs[s->blocks[i]] > 1;
    if (need > s->n_held)
        return QL_ENOMEM;
    if (need > max_copies - *n_copies)
        return QL_EINVAL;
    for (int32_t i = first; i < end; i++) {
        int32_t old = s->blocks[i];
        if (kv->refs[old] <= 1)
            continue;
        int32_t mine = s->held[--s->n_held];
        copies[(*n_copies)++] = (eng_kv_copy){.src = old, .dst = mine};
        s->blocks[i] = mine;
        unref_block(kv, old);
    }
    return QL_OK;
}

int32_t eng_kv_shared_blocks(const eng_kv_cache *kv)
{
    return kv->n_shared;
}

void eng_kv_copy_blocks(eng_kv_cache *kv, const eng_kv_copy *copies, int32_t n)
{
    if (!kv->data)
        return; /* bookkeeping only: the blocks live where the backend keeps them */
    for (int32_t i = 0; i < n; i++)
        memcpy(kv->data + (size_t)copies[i].dst * kv->block_bytes,
               kv->data + (size_t)copies[i].src * kv->block_bytes, kv->block_bytes);
}

int eng_kv_check_writes(const eng_kv_cache *kv, const eng_step_seq *seqs, int32_t n_seqs, char *msg,
                        size_t msg_len)
{
    for (int32_t s = 0; s < n_seqs; s++) {
        const eng_seq_kv *q = seqs[s].kv;
        int32_t end = eng_kv_blocks_for(kv, seqs[s].pos + seqs[s].n_tokens);
        for (int32_t i = seqs[s].pos / kv->block_tokens; i < end && i < q->n_blocks; i++)
            if (kv->refs[q->blocks[i]] > 1)
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "sequence %d: its KV block %d is shared with another sequence "
                               "(the write needs eng_kv_prepare_write first)",
                               s, q->blocks[i]);
    }
    return QL_OK;
}

void eng_kv_release(eng_kv_cache *kv, eng_seq_kv *s)
{
    for (int32_t i = s->n_blocks - 1; i >= 0; i--)
        unref_block(kv, s->blocks[i]);
    for (int32_t i = s->n_held - 1; i >= 0; i--)
        unref_block(kv, s->held[i]);
    give_state(kv, s);
    free(s->blocks);
    free(s->held);
    memset(s, 0, sizeof *s);
}

int eng_kv_rollback(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_tokens, char *msg, size_t msg_len)
{
    (void)kv; /* the blocks stay where they are: only the count of written positions moves */
    if (n_tokens < 0 || n_tokens > s->n_tokens)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "KV rollback to %d positions: the sequence has written %d", n_tokens,
                       s->n_tokens);
    if (s->state > 0 && n_tokens < s->n_tokens) {
        /* the state after position n_tokens - 1: a row its last step kept */
        int32_t st = s->state - 1, i = 0;
        while (i < kv->n_row_slots && kv->row_owner[i] != st)
            i++;
        int32_t t = i < kv->n_row_slots ? n_tokens - 1 - kv->row_pos[i] : -1;
        if (i == kv->n_row_slots || kv->state_pos[st] != s->n_tokens ||
            kv->row_pos[i] + kv->row_n[i] + 1 != s->n_tokens || t < 0 || t >= kv->row_n[i])
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "KV rollback of a sequence with a recurrent state from %d positions "
                           "to %d: its last step kept no row state for position %d",
                           s->n_tokens, n_tokens, n_tokens - 1);
        memcpy(kv_state(kv, s), kv_row_state(kv, i, t), (size_t)kv->state_floats * sizeof(float));
        kv->state_pos[st] = n_tokens;
        kv->row_owner[i] = -1;
    }
    s->n_tokens = n_tokens;
    return QL_OK;
}

int eng_kv_row_states_new(eng_kv_cache *kv, int32_t n_slots, int32_t rows, size_t *bytes, char *msg,
                          size_t msg_len)
{
    *bytes = 0;
    if (kv->state_floats <= 0 || n_slots <= 0 || rows <= 0)
        return QL_OK;
    if (!kv->states || kv->row_states)
        return ql_fail(msg, msg_len, QL_EINVAL, "row states for speculative decoding: %s",
                       kv->row_states ? "made already"
                                      : "the recurrent states are not in host memory");
    size_t n = (size_t)n_slots * (size_t)rows * (size_t)kv->state_floats;
    kv->row_states = malloc(n * sizeof(float));
    kv->row_owner = malloc((size_t)n_slots * sizeof(int32_t));
    kv->row_pos = calloc((size_t)n_slots, sizeof(int32_t));
    kv->row_n = calloc((size_t)n_slots, sizeof(int32_t));
    if (!kv->row_states || !kv->row_owner || !kv->row_pos || !kv->row_n)
        return ql_fail(msg, msg_len, QL_ENOMEM,
                       "out of memory for speculative decoding's row states: %d x %d recurrent "
                       "states of %zu bytes",
                       n_slots, rows, (size_t)kv->state_floats * sizeof(float));
    for (int32_t i = 0; i < n_slots; i++)
        kv->row_owner[i] = -1;
    kv->n_row_slots = n_slots;
    kv->row_rows = rows;
    *bytes = n * sizeof(float);
    return QL_OK;
}

/* Step sequence s's row states (seqs[s].row_states): a slot the cache
 * has, rows enough, no other sequence of the step in it. */
static int check_rows(const eng_kv_cache *kv, const eng_step_seq *seqs, int32_t s, char *msg,
                      size_t msg_len)
{
    int32_t slot = seqs[s].row_states;
    if (slot == 0)
        return QL_OK;
    if (slot < 0 || slot > kv->n_row_slots || seqs[s].n_tokens - 1 > kv->row_rows)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "sequence %d: row states %d for %d rows, and the cache keeps %d slots of "
                       "%d rows",
                       s, slot, seqs[s].n_tokens, kv->n_row_slots, kv->row_rows + 1);
    for (int32_t u = 0; u < s; u++)
        if (seqs[u].row_states == slot)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequences %d and %d both keep row states in slot %d", u, s, slot);
    return QL_OK;
}

int eng_kv_check_states(eng_kv_cache *kv, const eng_step_seq *seqs, int32_t n_seqs, char *msg,
                        size_t msg_len)
{
    if (kv->state_floats <= 0)
        return QL_OK;
    for (int32_t s = 0; s < n_seqs; s++) {
        const eng_seq_kv *q = seqs[s].kv;
        if (q->state <= 0 || (!kv->states && !kv->state_hook))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d has no recurrent state (a hybrid model's sequence takes "
                           "one in eng_kv_reserve)",
                           s);
        int32_t had = kv->state_pos[q->state - 1];
        if (had != seqs[s].pos)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d: its recurrent state has taken in %d positions and the "
                           "step starts at %d (a recurrent state cannot be rewound or skipped)",
                           s, had, seqs[s].pos);
        int rc = check_rows(kv, seqs, s, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    for (int32_t s = 0; s < n_seqs; s++) {
        kv->state_pos[seqs[s].kv->state - 1] = -1;
        forget_rows(kv, seqs[s].kv->state - 1);
        if (seqs[s].row_states > 0)
            kv->row_owner[seqs[s].row_states - 1] = -1;
    }
    return QL_OK;
}

void eng_kv_states_done(eng_kv_cache *kv, const eng_step_seq *seqs, int32_t n_seqs)
{
    for (int32_t s = 0; kv->state_floats > 0 && s < n_seqs; s++) {
        int32_t st = seqs[s].kv->state - 1, slot = seqs[s].row_states - 1;
        kv->state_pos[st] = seqs[s].pos + seqs[s].n_tokens;
        if (slot < 0)
            continue;
        kv->row_owner[slot] = st;
        kv->row_pos[slot] = seqs[s].pos;
        kv->row_n[slot] = seqs[s].n_tokens - 1;
    }
}

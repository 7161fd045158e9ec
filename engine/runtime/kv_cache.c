/*
 * kv_cache.c - the paged KV cache: one arena cut into blocks of
 * `block_tokens` positions, each block holding K and V of every layer for
 * those positions, handed to sequences through per-sequence block tables
 * (the vLLM PagedAttention layout). Sizing is in bytes, as an operator
 * thinks of memory; a sequence that cannot get blocks waits, and a finished
 * one gives them back at once, whatever order sequences end in.
 *
 * Block layout (f32): for layer l, K then V, each [block_tokens][kv_dim],
 * kv_dim = n_kv_heads * head_dim. Owned by the engine thread: no locks.
 *
 * It offers eng_kv_* (runtime.h) and owns the arena and the free list; it
 * calls nothing else in engine/runtime/ (a sequence that cannot get blocks
 * is the scheduler's to hold back).
 */
#include "internal/kv_cache_internal.h"
#include "runtime.h"

#include <stdlib.h>
#include <string.h>

static int kv_new(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                  bool host_arena, char *msg, size_t msg_len)
{
    *out = NULL;
    int32_t bt = block_tokens > 0 ? block_tokens : 16;
    int64_t kv_dim = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    size_t block_floats = (size_t)cfg->n_layers * 2 * (size_t)bt * (size_t)kv_dim;
    size_t block_bytes = block_floats * sizeof(float);
    if (kv_dim <= 0 || block_bytes == 0 || bytes / block_bytes < 1)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "KV cache of %zu bytes holds no block of %d positions (%zu bytes each)",
                       bytes, bt, block_bytes);
    size_t n = bytes / block_bytes;
    if (n > INT32_MAX)
        n = INT32_MAX;
    eng_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    kv->block_tokens = bt;
    kv->n_layers = cfg->n_layers;
    kv->kv_dim = kv_dim;
    kv->block_floats = block_floats;
    kv->n_blocks = (int32_t)n;
    kv->data = host_arena ? malloc(n * block_bytes) : NULL;
    kv->free_list = malloc(n * sizeof *kv->free_list);
    if ((host_arena && !kv->data) || !kv->free_list) {
        eng_kv_free(kv);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate a KV cache of %zu bytes",
                       n * block_bytes);
    }
    /* hand out low block numbers first: easier to read in a debugger */
    for (int32_t i = 0; i < kv->n_blocks; i++)
        kv->free_list[i] = kv->n_blocks - 1 - i;
    kv->n_free = kv->n_blocks;
    *out = kv;
    return QL_OK;
}

int eng_kv_new(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
               char *msg, size_t msg_len)
{
    return kv_new(out, cfg, bytes, block_tokens, true, msg, msg_len);
}

int eng_kv_new_meta(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                    char *msg, size_t msg_len)
{
    return kv_new(out, cfg, bytes, block_tokens, false, msg, msg_len);
}

size_t eng_kv_block_floats(const eng_kv_cache *kv)
{
    return kv->block_floats;
}

void eng_kv_free(eng_kv_cache *kv)
{
    if (!kv)
        return;
    free(kv->data);
    free(kv->free_list);
    free(kv);
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

int eng_kv_reserve(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_tokens)
{
    int32_t need = eng_kv_blocks_for(kv, n_tokens) - s->n_blocks;
    if (need <= 0)
        return QL_OK;
    if (need > kv->n_free)
        return QL_ENOMEM;
    int32_t *t = realloc(s->blocks, (size_t)(s->n_blocks + need) * sizeof *t);
    if (!t)
        return QL_ENOMEM;
    s->blocks = t;
    for (int32_t i = 0; i < need; i++)
        s->blocks[s->n_blocks++] = kv->free_list[--kv->n_free];
    return QL_OK;
}

void eng_kv_release(eng_kv_cache *kv, eng_seq_kv *s)
{
    for (int32_t i = s->n_blocks - 1; i >= 0; i--)
        kv->free_list[kv->n_free++] = s->blocks[i];
    free(s->blocks);
    memset(s, 0, sizeof *s);
}

/*
 * backend.c - where a forward step runs: the choice between backends
 * (--device cpu|cuda|auto), the CPU backend, which is eng_forward (walk.c's
 * walk on forward.c's row of operations) over a worker pool with the KV
 * cache in host memory, and the eng_backend_* calls
 * (runtime.h), which dispatch through each backend's row of operations
 * (internal/backend_internal.h). The CUDA backend lives in backend_cuda.c
 * and is built only with CUDA; the scheduler sees both through
 * eng_backend_* alone.
 *
 * It owns the CPU backend's pool, scratch and KV cache; it calls forward.c,
 * pool.c, kv_cache.c and (CUDA builds) backend_cuda.c's entry points and
 * kernels/cuda's qt_cuda_describe, and is called back by none of them.
 */
#include "internal/backend_internal.h"
#ifdef QL_HAVE_CUDA
#include "qt_cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int eng_device_parse(const char *name, eng_device *out, char *msg, size_t msg_len)
{
    int d = ql_name_expect(&ql_device_names, "device", name, msg, msg_len);
    if (d < 0)
        return d;
    *out = (eng_device)d;
    return QL_OK;
}

const char *eng_device_name(eng_device d)
{
    const char *word = ql_name_of(&ql_device_names, (int)d);
    return word ? word : "auto";
}

bool eng_cuda_built(void)
{
#ifdef QL_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

void eng_cuda_describe(char *out, size_t out_len)
{
#ifdef QL_HAVE_CUDA
    qt_cuda_describe(out, out_len);
#else
    snprintf(out, out_len, "cuda: not built (nvcc was not found at build time)");
#endif
}

/* --- the CPU backend ------------------------------------------------------- */

typedef struct cpu_backend {
    eng_backend base;
    eng_pool *pool;
    eng_forward_state *st;
} cpu_backend;

static int cpu_forward(eng_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
                       int32_t *tokens, char *msg, size_t msg_len)
{
    cpu_backend *c = (cpu_backend *)b;
    if (tokens)
        for (int32_t k = 0; k < n_seqs; k++)
            tokens[k] = -1; /* the sampler chooses from the logits */
    return eng_forward(c->st, b->m, b->kv, c->pool, seqs, n_seqs, logits, msg, msg_len);
}

static void cpu_moe_step(const eng_backend *b, uint64_t *experts, uint64_t *bytes)
{
    eng_forward_moe_step(((const cpu_backend *)b)->st, experts, bytes);
}

/* The cache is the host arena: eng_kv_copy_blocks does it. */
static int cpu_copy_blocks(eng_backend *b, const eng_kv_copy *copies, int32_t n, char *msg,
                           size_t msg_len)
{
    (void)msg;
    (void)msg_len;
    eng_kv_copy_blocks(b->kv, copies, n);
    return QL_OK;
}

static void cpu_destroy(eng_backend *b)
{
    cpu_backend *c = (cpu_backend *)b;
    eng_forward_state_free(c->st);
    eng_pool_free(c->pool);
    eng_kv_free(b->kv);
    free(c);
}

static int cpu_backend_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o,
                           char *msg, size_t msg_len)
{
    cpu_backend *c = calloc(1, sizeof *c);
    if (!c)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    c->base.device = ENG_DEVICE_CPU;
    c->base.m = m;
    c->base.forward = cpu_forward;
    c->base.copy_blocks = cpu_copy_blocks;
    c->base.moe_step = cpu_moe_step;
    c->base.destroy = cpu_destroy;
    int rc = eng_pool_new(&c->pool, o->threads, msg, msg_len);
    if (rc == QL_OK)
        /* a hybrid model's recurrent states: one for each sequence a step may carry */
        rc = eng_kv_new_states(&c->base.kv, &m->cfg, o->kv_bytes, o->block_tokens, o->kv_dtype,
                               o->max_seqs > 0 ? o->max_seqs : ENG_KV_DEFAULT_STATES, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_forward_state_new(&c->st, m, o->max_tokens, msg, msg_len);
    if (rc != QL_OK) {
        cpu_destroy(&c->base);
        return rc;
    }
    snprintf(c->base.describe, sizeof c->base.describe, "cpu (%d threads)",
             eng_pool_threads(c->pool));
    *out = &c->base;
    return QL_OK;
}

/* --- the choice -------------------------------------------------------------- */

/* The device d names: auto is CUDA where this build has it and a GPU is
 * present, else the CPU. */
static eng_device chosen_device(eng_device d)
{
#ifdef QL_HAVE_CUDA
    if (d == ENG_DEVICE_AUTO)
        return eng_cuda_present() ? ENG_DEVICE_CUDA : ENG_DEVICE_CPU;
#endif
    return d;
}

int eng_kv_dtype_resolve(const char *name, eng_device device, qt_kind *out, char *msg,
                         size_t msg_len)
{
    if (name)
        return eng_kv_dtype_parse(name, out, msg, msg_len);
    /* the CUDA kernels read f32 only; on the CPU f16 (half the bytes,
     * llama.cpp's default), which through the server measured faster than
     * f32 once attention converted each KV head's run of positions once for
     * its query heads and prefill rows (README, "KV cache dtype") */
    *out = chosen_device(device) == ENG_DEVICE_CUDA ? QT_F32 : QT_F16;
    return QL_OK;
}

int eng_backend_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o, char *msg,
                    size_t msg_len)
{
    *out = NULL;
    eng_device d = chosen_device(o->device);
#ifdef QL_HAVE_CUDA
    if (d == ENG_DEVICE_CUDA)
        return eng_backend_cuda_new(out, m, o, msg, msg_len);
#else
    if (d == ENG_DEVICE_CUDA)
        return ql_fail(msg, msg_len, QL_EDEVICE,
                       "device cuda: this qlserve was built without the CUDA backend (no nvcc "
                       "at build time); rebuild with the CUDA toolkit or use --device cpu");
#endif
    return cpu_backend_new(out, m, o, msg, msg_len);
}

void eng_backend_free(eng_backend *b)
{
    if (b)
        b->destroy(b);
}

const char *eng_backend_describe(const eng_backend *b)
{
    return b->describe;
}

eng_device eng_backend_device(const eng_backend *b)
{
    return b->device;
}

void eng_backend_moe_step(const eng_backend *b, uint64_t *experts, uint64_t *bytes)
{
    *experts = *bytes = 0;
    if (b->moe_step)
        b->moe_step(b, experts, bytes);
}

bool eng_backend_draws(const eng_backend *b)
{
    return b->draws;
}

eng_kv_cache *eng_backend_kv(eng_backend *b)
{
    return b->kv;
}

int eng_backend_forward(eng_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
                        int32_t *tokens, char *msg, size_t msg_len)
{
    return b->forward(b, seqs, n_seqs, logits, tokens, msg, msg_len);
}

int eng_backend_copy_blocks(eng_backend *b, const eng_kv_copy *copies, int32_t n, char *msg,
                            size_t msg_len)
{
    int32_t total = eng_kv_total_blocks(b->kv);
    for (int32_t i = 0; i < n; i++)
        if (copies[i].src < 0 || copies[i].src >= total || copies[i].dst < 0 ||
            copies[i].dst >= total || copies[i].src == copies[i].dst)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "KV copy %d: block %d to block %d, of %d blocks (nothing copied)", i,
                           copies[i].src, copies[i].dst, total);
    return n > 0 ? b->copy_blocks(b, copies, n, msg, msg_len) : QL_OK;
}

int eng_backend_digest(eng_backend *b, const eng_weights *w, uint64_t *digest, char *msg,
                       size_t msg_len)
{
    if (b->digest)
        return b->digest(b, w, digest, msg, msg_len);
    *digest = eng_weights_digest(b->m, w);
    return QL_OK;
}

bool eng_backend_merges_on_device(const eng_backend *b)
{
    return b->prepare != NULL;
}

int eng_backend_prepare(eng_backend *b, const eng_weights *w, eng_merge_cost *costs,
                        uint64_t *digest, char *msg, size_t msg_len)
{
    if (!b->prepare)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the %s backend merges on the host: nothing to prepare",
                       eng_device_name(b->device));
    return b->prepare(b, w, costs, digest, msg, msg_len);
}

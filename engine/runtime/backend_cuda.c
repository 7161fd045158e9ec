/*
 * backend_cuda.c - the CUDA backend of the forward pass: walk.c's walk over
 * the layers (the CPU's too) run on this file's row of operations
 * (cuda_ops), with every tensor and activation in device memory and every
 * operation a kernel of kernels/cuda (qt_cuda_ops.h).
 *
 * What lives where:
 *   - the model's weights are uploaded once, at creation, in their own
 *     quantized layout (qt_cuda_tensor); norms and biases as f32;
 *   - the KV cache arena is device memory with the CPU cache's layout; the
 *     block bookkeeping (free list, block tables) stays on the host in an
 *     eng_kv_cache without an arena, so the scheduler is unchanged; a
 *     layer's rows are where and as wide as the host cache says
 *     (layer_cache: Gemma 4's full layers have their own head size);
 *     nothing here remembers a position between steps (the rows'
 *     positions, rotations and block tables are laid out afresh by
 *     cuda_begin), so speculative decoding's rollback (eng_kv_rollback,
 *     a count on the host) needs nothing of the device: the next step
 *     writes over the rejected positions in the arena;
 *   - a hybrid model's (Qwen3.5's) recurrent states are a device pool with
 *     the host pool's layout and slot numbers; the cache's state hook
 *     (kv_cache_internal.h) zeroes a slot when a sequence takes it and
 *     copies one when a sequence forks, on the step stream, and the
 *     linear layers' kernels (qt_cuda_delta_net) carry them on in place;
 *   - a weight version with merged adapters is merged again here, on the
 *     device, from the pristine device weights and the version's merged
 *     configuration (qt_cuda_merge: the same arithmetic as the CPU merge),
 *     so the host's merged copy is never uploaded (unless it was stored
 *     "into" another kind, or is of a kind the device cannot requantize,
 *     the k-quants: those are uploaded as they are, and a k-quant merge
 *     with no host copy is refused by name); unmerging is releasing
 *     the merged copy: the pristine tensors are never written;
 *   - an adapter applied unmerged has its A and B uploaded on first use and
 *     runs as SGMV segments (one segment per sequence, one pass per term);
 *   - device copies of versions and adapters hold a reference on their
 *     host object and are dropped once that reference is the last one
 *     (nothing that runs can ask for them again).
 *
 * A mixture of experts (cuda_moe): the router's product on the device, its
 * logits back to the host, which routes with the CPU's arithmetic
 * (ops_math.h's om_moe_route) and groups the rows by expert; then each
 * chosen expert runs once over its gathered rows through the projections'
 * own path (project_runs: weight versions and unmerged adapters apply to
 * experts as to every projection), and the rows add their experts' outputs
 * with their weights in ascending expert order, as experts_cpu.c does.
 * Experts are projections after the dense ones (eng_expert_proj), so every
 * per-(layer, projection) table here has eng_n_proj entries per layer.
 *
 * A step: the host lays out the rows (token, sequence, position, the
 * rotation tables, the block tables), one set of copies to the device
 * (cuda_begin), the layers as kernels on one stream (a sequence asking for
 * every row's logits, a prompt's logprobs or speculative decoding's
 * verification rows, gets its rows through the classifier in pieces of
 * max_seqs), then the logits (or, for greedy
 * sequences, only the chosen tokens) come back and the stream is
 * synchronised (cuda_deliver). Copies on write of KV blocks are device-to-device copies on the
 * same stream (eng_backend_copy_blocks). Products take the fused dequantize-and-multiply kernels up
 * to 32 rows (a decode step; QT_CUDA_MATVEC_MAX_BATCH) and cuBLASLt above (qt_cuda_matmul);
 * QLSERVE_CUDA_GEMM=bf16
 * makes cuBLASLt multiply in bf16 on the tensor cores (default f32, the
 * closest to the CPU backend's tokens).
 *
 * Every CUDA status is checked; running out of device memory at creation
 * or at a step is an QL_ENOMEM naming what did not fit, and the step's
 * sequences end with an error while the server keeps serving.
 *
 * It offers eng_cuda_present and eng_backend_cuda_new
 * (internal/backend_internal.h) and fills in the backend's row of
 * operations (forward, copy_blocks, digest, prepare, destroy) and the
 * walk's (cuda_ops, internal/walk_internal.h); it owns every device
 * allocation and the pinned staging; it touches the model and the
 * versions and adapters (read only, holding references), the KV block
 * bookkeeping (kv_cache.c's eng_kv_*), kernels/cuda (qt_cuda_ops.h,
 * qt_cuda_sample.h), step.c's rotary tables and walk.c's walk (which
 * makes the step's refusals).
 *
 * Every operation returns a code (a launch can fail), which the walk
 * passes up with the layer it failed in. The SGMV segments of every
 * (layer, projection, term) are laid out and copied once per step
 * (lay_out_step), where forward.c gathers rows per projection: the same sum
 * per row. tests/gpu/test_cuda_engine runs the same step lists on both
 * backends and compares logits, greedy tokens and merged digests.
 */
#include "internal/backend_internal.h"
#include "internal/kv_cache_internal.h"
#include "internal/step_internal.h"
#include "internal/walk_internal.h"
#include "ops_math.h"
#include "qt_cuda_ops.h"
#include "qt_cuda_sample.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- device copies of adapters and weight versions ---------------------------- */

/* An adapter's A and B on the device, per layer and projection. */
typedef struct dev_lora {
    eng_lora *lora; /* a reference */
    void **a, **b;  /* [n_layers * n_proj], NULL where not targeted */
    struct dev_lora *next;
} dev_lora;

/* A weight version's merged projections on the device. */
typedef struct dev_version {
    eng_weights *w;       /* a reference */
    qt_cuda_tensor *proj; /* [n_layers * n_proj]; rows == 0: the pristine one */
    struct dev_version *next;
} dev_version;

typedef struct dev_layer {
    float *attn_norm, *ffn_norm;           /* [hidden] */
    float *bias;                           /* [q + 2 kv] when attention_bias */
    float *q_norm, *k_norm;                /* [eng_qk_norm_width] when qk_norm (Qwen3, OLMo 3) */
    float *v_norm;                         /* [head_dim] of ones when v_norm (Gemma 4) */
    float *post_attn_norm, *post_ffn_norm; /* [hidden] (Gemma's sandwich, OLMo 3's) */
    qt_cuda_tensor *proj;               /* [n_proj] (eng_n_proj): rows 0 where the layer has none */
    qt_cuda_tensor router, shared_gate; /* a mixture of experts' (rows 0: none) */
    /* GPT-OSS's (NULL where the model has none): the output projection's
     * bias [hidden] and the attention sinks [n_heads] on the device, the
     * router's bias [E] on the host (the routing runs there), and each
     * expert's gate, up and down biases [E][2 * expert_ff + hidden] on the
     * device, f32 as experts_cpu.c keeps them */
    float *o_bias, *sinks, *h_router_b, *expert_b;
    /* Qwen3.5's linear layers (hybrid.h; rows 0 and NULL elsewhere):
     * in_proj_b and in_proj_a as uploaded, and f32 the conv's taps
     * [conv_dim][taps], -exp(A_log) and dt_bias [n_v_heads], the gated
     * norm's weight [v_head_dim], as linear_cpu.c keeps them */
    qt_cuda_tensor in_b, in_a;
    float *conv, *neg_a, *dt_bias, *lin_norm;
    /* Gemma 4's (NULL where the model has none): the per-layer input's
     * output norm [hidden]; the MoE block's MLP output norm, router input
     * norm (router.scale over sqrt(hidden), forward.c's), experts' input
     * and output norms [hidden] on the device, and per_expert_scale [E] on
     * the host (the routing runs there) */
    float *ple_norm, *mlp_post_norm, *router_norm, *moe_pre_norm, *moe_post_norm;
    float *h_expert_scale;
} dev_layer;

/* A run of step rows that share one sequence: rows [row0, row0 + rows) of
 * an activation (the step's own, or the rows gathered for one expert). */
typedef struct row_run {
    int32_t seq;
    int64_t row0, rows;
} row_run;

/* A mixture of experts' scratch (every pointer NULL in a dense model). */
typedef struct moe_scratch {
    float *d_logits;  /* [T][E] router logits, then [T] shared-expert gate logits */
    float *h_logits;  /* pinned twin */
    float *xg, *yg;   /* [T][hidden]: the rows gathered for an expert, its output */
    float *gg, *ug;   /* [T][widest expert]: gate and up */
    int32_t *d_order; /* [T * K]: (row * K + k) grouped by expert */
    int32_t *h_order; /* pinned twin */
    float *d_weight;  /* [T * K] the router's weights in d_order's order, [T] shared gates */
    float *h_weight;  /* pinned twin */
    int32_t *pick;    /* host [T * K]: each row's experts */
    float *weight;    /* host [T * K]: and their weights */
    int32_t *count;   /* host [E + 1]: where each expert's rows start */
    int32_t *first;   /* host [E + 1]: where each expert's runs start in runs */
    row_run *runs;    /* host [T * K]: each expert's gathered rows as runs of sequences */
    qt_cuda_lora_segment *h_segs, *d_segs; /* the layer's adapter segments on experts */
    int64_t segs_cap;
    uint64_t ran, bytes; /* the step's figures (eng_backend_moe_step) */
} moe_scratch;

typedef struct cuda_backend {
    eng_backend base;
    cudaStream_t stream;
    qt_cuda_blas *blas;
    int32_t max_tokens, max_seqs, max_rank;
    int32_t n_proj; /* projections per layer: eng_n_proj (experts included) */
    size_t weight_bytes;

    qt_cuda_tensor embed, lm_head; /* lm_head.rows == 0: tied to embed */
    float *final_norm;
    dev_layer *layers;
    eng_walk_layer *walk_layers; /* [n_layers]: the walk's view of layers */
    qt_cuda_kv kv;
    /* host, [2][head_dim / 2]: the short set, then longrope's long one
     * (eng_step_seq.rope_long) */
    double *inv_freq;
    /* Gemma 3's sliding layers' rotation (rope_local_theta): host
     * frequencies, NULL when the model has one rotation, and the step's
     * tables beside d_cos / h_cos */
    double *inv_freq_local;
    float *d_cos_local, *d_sin_local, *h_cos_local, *h_sin_local;
    /* Gemma 4's per-layer inputs (rows 0 / NULL in other models): the
     * per-layer embeddings and their projection from the residual, the
     * projection's norm [ple_dim], the step's inputs [max_tokens][n_layers
     * * ple_dim] */
    qt_cuda_tensor ple_embed, ple_proj;
    float *ple_norm, *ple;

    /* activations, device */
    float *x, *h, *q, *k, *v, *att, *gate, *up, *tmp, *last, *logits;
    float *lora_t; /* [max_tokens][max_rank] */
    /* a step's layout: device arrays and their pinned host staging */
    int32_t *d_tokens, *d_row_seq, *d_row_pos, *d_bt_offset, *d_tables, *d_greedy;
    float *d_cos, *d_sin, *d_inv_t;
    double *d_u;
    qt_cuda_lora_segment *d_segs;
    int32_t *h_tokens, *h_row_seq, *h_row_pos, *h_bt_offset, *h_tables, *h_greedy;
    float *h_cos, *h_sin, *h_inv_t;
    double *h_u;
    qt_cuda_lora_segment *h_segs;
    int64_t tables_cap, segs_cap;
    int64_t *seq_row; /* host: each step sequence's first row */

    dev_lora *loras;
    dev_version *versions;
    moe_scratch moe;

    /* Qwen3.5 (every pointer NULL in other models): the walk's mix and
     * out_gate, the delta rule's beta and decay [max_tokens][n_v_heads];
     * the recurrent states, state_floats for each slot of the cache's pool
     * (zeroed and copied through its state hook); the step's sequences as
     * the delta rule reads them (qt_cuda_delta_seqs: first rows, slots),
     * with their pinned staging; each layer's place among the linear ones
     * (-1: a full layer) */
    float *mix, *out_gate, *beta, *decay, *states;
    int64_t state_floats;
    int32_t *d_seq_first, *d_seq_slot, *h_seq_first, *h_seq_slot;
    int32_t *lin_index;
    /* the first failure of the state hook, refused at every step after it
     * (a state it should have zeroed or copied is wrong) */
    int state_rc;
    char state_msg[256];
} cuda_backend;

/* --- errors -------------------------------------------------------------------- */

/* What a device call's failure means to the engine (one error space,
 * base/ql_base.h): the codes the CUDA kernels share with the host (out of
 * memory, a bad argument, a non-finite value) pass through; anything else
 * they report is the device failing (a 500, not the client's mistake). */
static int device_code(int rc)
{
    switch (rc) {
    case QL_OK: return QL_OK;
    case QL_ENOMEM: return QL_ENOMEM;
    case QL_EINVAL: return QL_EINVAL;
    case QL_ENONFINITE: return QL_ENONFINITE;
    default: return QL_EDEVICE;
    }
}

/* A CUDA runtime failure as an engine error naming what was being done. */
static int cuda_fail(cudaError_t st, char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int cuda_fail(cudaError_t st, char *msg, size_t msg_len, const char *fmt, ...)
{
    char what[192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    int rc = st == cudaErrorMemoryAllocation ? QL_ENOMEM : QL_EDEVICE;
    return ql_fail(msg, msg_len, rc, "cuda: %s: %s (%s)", what, cudaGetErrorString(st),
                   cudaGetErrorName(st));
}

#define CUDA_TRY(call, ...)                                                                        \
    do {                                                                                           \
        cudaError_t st_ = (call);                                                                  \
        if (st_ != cudaSuccess)                                                                    \
            return cuda_fail(st_, msg, msg_len, __VA_ARGS__);                                      \
    } while (0)

#define QT_TRY(call)                                                                               \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != QL_OK)                                                                          \
            return device_code(rc_);                                                               \
    } while (0)

bool eng_cuda_present(void)
{
    int n = 0;
    return qt_cuda_device_count(&n, NULL, 0) == QL_OK && n > 0;
}

/* n bytes of device memory into *p, naming `what` when they are not there. */
static int dev_alloc(void *p, size_t n, const char *what, char *msg, size_t msg_len)
{
    void **out = p;
    *out = NULL;
    if (n == 0)
        n = 1;
    CUDA_TRY(cudaMalloc(out, n), "cannot allocate %zu bytes of device memory for %s", n, what);
    return QL_OK;
}

static int host_alloc(void *p, size_t n, const char *what, char *msg, size_t msg_len)
{
    void **out = p;
    *out = NULL;
    if (n == 0)
        n = 1;
    CUDA_TRY(cudaMallocHost(out, n), "cannot allocate %zu bytes of pinned memory for %s", n, what);
    return QL_OK;
}

/* The first `rows` rows of t to a new f32 device array, offset + w each
 * (a norm's: forward.c's norm_row; Gemma folders), or 0 for a bias's. */
static int upload_rows(const qtensor *t, int64_t rows, float offset, float **out, const char *what,
                       char *msg, size_t msg_len)
{
    size_t n = (size_t)rows * (size_t)t->cols;
    float *host = malloc(n * sizeof(float));
    if (!host)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    qt_dequantize_rows(t, 0, rows, host);
    for (size_t i = 0; offset != 0.0f && i < n; i++)
        host[i] = offset + host[i];
    int rc = dev_alloc(out, n * sizeof(float), what, msg, msg_len);
    if (rc == QL_OK) {
        cudaError_t st = cudaMemcpy(*out, host, n * sizeof(float), cudaMemcpyHostToDevice);
        if (st != cudaSuccess)
            rc = cuda_fail(st, msg, msg_len, "copying %s to the device", what);
    }
    free(host);
    return rc;
}

/* A norm's [1, n] weights to a new f32 device array, as the pass
 * multiplies by them: offset + w; *out stays NULL for a norm the layer
 * does not have (OLMo 3's input norms), so the walk skips it. */
static int upload_norm(const qtensor *t, float offset, float **out, const char *what, char *msg,
                       size_t msg_len)
{
    if (t->rows == 0)
        return QL_OK;
    return upload_rows(t, 1, offset, out, what, msg, msg_len);
}

/* n host floats to a new f32 device array. */
static int upload_floats(const float *host, int64_t n, float **out, const char *what, char *msg,
                         size_t msg_len)
{
    qtensor t = {0};
    int rc = qt_from_dense(&t, QT_F32, host, 1, n, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_rows(&t, 1, 0.0f, out, what, msg, msg_len);
    qt_free(&t);
    return rc;
}

/* n ones to a new f32 device array: a weightless norm's (Gemma 4's v norm). */
static int upload_ones(int64_t n, float **out, const char *what, char *msg, size_t msg_len)
{
    float *ones = malloc((size_t)n * sizeof(float));
    if (!ones)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (int64_t i = 0; i < n; i++)
        ones[i] = 1.0f;
    int rc = upload_floats(ones, n, out, what, msg, msg_len);
    free(ones);
    return rc;
}

static int upload_tensor(const qtensor *t, qt_cuda_tensor *d, const char *what, size_t *bytes,
                         char *msg, size_t msg_len)
{
    char why[256];
    int rc = qt_cuda_tensor_upload(t, d, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, device_code(rc), "uploading %s: %s", what, why);
    *bytes += d->device_bytes;
    return QL_OK;
}

/* --- adapters and versions on the device ---------------------------------------- */

static void dev_lora_free(dev_lora *dl, int32_t n_layers)
{
    size_t n_proj = (size_t)dl->lora->n_proj;
    for (size_t i = 0; dl->a && i < (size_t)n_layers * n_proj; i++) {
        cudaFree(dl->a[i]);
        cudaFree(dl->b[i]);
    }
    free(dl->a);
    free(dl->b);
    eng_lora_unref(dl->lora);
    free(dl);
}

static int upload_dense(const qtensor *t, void **out, char *msg, size_t msg_len)
{
    int rc = dev_alloc(out, t->data_bytes, "an adapter matrix", msg, msg_len);
    if (rc != QL_OK)
        return rc;
    CUDA_TRY(cudaMemcpy(*out, t->data, t->data_bytes, cudaMemcpyHostToDevice),
             "copying an adapter matrix to the device");
    return QL_OK;
}

/* The device copy of adapter l, uploaded on first use. */
static int lora_on_device(cuda_backend *c, const eng_lora *l, dev_lora **out, char *msg,
                          size_t msg_len)
{
    for (dev_lora *dl = c->loras; dl; dl = dl->next)
        if (dl->lora == l) {
            *out = dl;
            return QL_OK;
        }
    if (l->n_proj != c->n_proj)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "adapter %s: %d projections per layer, the model has %d", l->name, l->n_proj,
                       c->n_proj);
    size_t n = (size_t)l->n_layers * (size_t)l->n_proj;
    dev_lora *dl = calloc(1, sizeof *dl);
    if (!dl)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    dl->lora = (eng_lora *)l;
    eng_lora_ref(dl->lora);
    dl->a = calloc(n, sizeof *dl->a);
    dl->b = calloc(n, sizeof *dl->b);
    int rc = dl->a && dl->b ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (size_t i = 0; rc == QL_OK && i < n; i++) {
        const eng_lora_module *mod = &l->modules[i];
        if (mod->a.rows == 0)
            continue;
        if (mod->a.rows > c->max_rank) {
            rc = ql_fail(msg, msg_len, QL_EINVAL,
                         "adapter %s: rank %lld is above the CUDA backend's %d", l->name,
                         (long long)mod->a.rows, c->max_rank);
            break;
        }
        rc = upload_dense(&mod->a, &dl->a[i], msg, msg_len);
        if (rc == QL_OK)
            rc = upload_dense(&mod->b, &dl->b[i], msg, msg_len);
    }
    if (rc != QL_OK) {
        dev_lora_free(dl, l->n_layers);
        return rc;
    }
    dl->next = c->loras;
    c->loras = dl;
    *out = dl;
    return QL_OK;
}

static void dev_version_free(dev_version *dv, int32_t n_layers)
{
    for (size_t i = 0; dv->proj && i < (size_t)n_layers * (size_t)dv->w->n_proj; i++)
        qt_cuda_tensor_release(&dv->proj[i], NULL, 0);
    free(dv->proj);
    eng_weights_unref(dv->w);
    free(dv);
}

/* Layer l's projection p of version w merged on the device: the pristine
 * device tensor plus each merged adapter's scaled B @ A. */
static int merge_projection(cuda_backend *c, const eng_weights *w, int32_t l, eng_proj p,
                            qt_cuda_tensor *out, eng_merge_cost *cost, char *msg, size_t msg_len)
{
    qt_cuda_lora_term terms[ENG_MAX_MERGED];
    int32_t n = 0;
    for (size_t i = 0; i < w->n_merged; i++) {
        const eng_lora_module *mod = eng_lora_module_at(w->merged[i].lora, l, p);
        if (!mod)
            continue;
        if (n == (int32_t)(sizeof terms / sizeof *terms))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "more than %d adapters merged into one projection", n);
        dev_lora *dl;
        int rc = lora_on_device(c, w->merged[i].lora, &dl, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        size_t at = (size_t)l * (size_t)c->n_proj + p;
        terms[n++] = (qt_cuda_lora_term){.a = dl->a[at],
                                         .b = dl->b[at],
                                         .a_kind = mod->a.kind,
                                         .b_kind = mod->b.kind,
                                         .rank = (int32_t)mod->a.rows,
                                         .scale = w->merged[i].scale,
                                         .module_scale = mod->scale};
    }
    char why[256];
    qt_cuda_merge_report report;
    int rc =
        qt_cuda_merge(&c->layers[l].proj[p], terms, n, out, &report, c->stream, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, device_code(rc), "merging layer %d %s on the device: %s", l,
                       eng_proj_name(p), why);
    if (cost)
        *cost = (eng_merge_cost){.dot = report.dot,
                                 .delta_sq = report.delta_sq,
                                 .err_sq = report.err_sq,
                                 .merged = true};
    return QL_OK;
}

/* Whether an adapter merged into w targets layer l's projection p. */
static bool merged_into(const eng_weights *w, int32_t l, eng_proj p)
{
    for (size_t i = 0; i < w->n_merged; i++)
        if (eng_lora_module_at(w->merged[i].lora, l, p))
            return true;
    return false;
}

/* The device copy of version w, built on first use (or by prepare, with
 * each module's merge figures in costs when not NULL). */
static int version_on_device(cuda_backend *c, const eng_weights *w, eng_merge_cost *costs,
                             dev_version **out, char *msg, size_t msg_len)
{
    for (dev_version *dv = c->versions; dv; dv = dv->next)
        if (dv->w == w) {
            *out = dv;
            return QL_OK;
        }
    const eng_model *m = c->base.m;
    int32_t L = m->cfg.n_layers;
    dev_version *dv = calloc(1, sizeof *dv);
    if (!dv)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    dv->w = (eng_weights *)w;
    eng_weights_ref(dv->w);
    dv->proj = calloc((size_t)L * (size_t)c->n_proj, sizeof *dv->proj);
    int rc = dv->proj ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (int32_t l = 0; rc == QL_OK && l < L; l++) {
        for (int p = 0; rc == QL_OK && p < c->n_proj; p++) {
            const qtensor *pristine = eng_model_proj(m, l, (eng_proj)p);
            const qtensor *served = eng_weights_proj(w, l, (eng_proj)p);
            size_t i = (size_t)l * (size_t)c->n_proj + p;
            if (pristine->rows == 0) /* an expert's slot in a dense layer */
                continue;
            qt_cuda_tensor *slot = &dv->proj[i];
            if (served != pristine &&
                (served->kind != pristine->kind || !qt_cuda_merge_requantizes(pristine->kind))) {
                /* stored "into" a wider kind on the host, or in a kind the
                 * device cannot requantize (the k-quants): serve the
                 * host's bytes */
                size_t bytes = 0;
                rc = upload_tensor(served, slot, "a merged projection", &bytes, msg, msg_len);
            } else if (merged_into(w, l, (eng_proj)p)) {
                /* (a k-quant merged with no host copy: qt_cuda_merge
                 * refuses it by name) */
                /* the host's merged copy (if it made one) has these very
                 * bytes: the device merge is the CPU merge's arithmetic */
                rc = merge_projection(c, w, l, (eng_proj)p, slot, costs ? &costs[i] : NULL, msg,
                                      msg_len);
            }
        }
    }
    if (rc != QL_OK) {
        dev_version_free(dv, L);
        return rc;
    }
    dv->next = c->versions;
    c->versions = dv;
    *out = dv;
    return QL_OK;
}

/* Drop the device copies whose host object nobody else holds any more. */
static void prune_device_copies(cuda_backend *c)
{
    int32_t L = c->base.m->cfg.n_layers;
    for (dev_version **pv = &c->versions; *pv;) {
        dev_version *dv = *pv;
        if (__atomic_load_n(&dv->w->refs, __ATOMIC_ACQUIRE) == 1) {
            *pv = dv->next;
            dev_version_free(dv, L);
        } else {
            pv = &dv->next;
        }
    }
    for (dev_lora **pl = &c->loras; *pl;) {
        dev_lora *dl = *pl;
        if (__atomic_load_n(&dl->lora->refs, __ATOMIC_ACQUIRE) == 1) {
            *pl = dl->next;
            dev_lora_free(dl, L);
        } else {
            pl = &dl->next;
        }
    }
}

/* --- a step ------------------------------------------------------------------------ */

/* What each step sequence computes projection (l, p) with. */
static const qt_cuda_tensor *seq_tensor(const cuda_backend *c, dev_version *const *vers, int32_t s,
                                        int32_t l, eng_proj p)
{
    if (vers[s]) {
        const qt_cuda_tensor *t = &vers[s]->proj[(size_t)l * (size_t)c->n_proj + p];
        if (t->rows)
            return t;
    }
    return &c->layers[l].proj[p];
}

/* The SGMV segments of one (layer, projection, term): a slice of the
 * step's segment array. */
typedef struct seg_run {
    int64_t first;
    int32_t n, max_rank;
} seg_run;

/* The context of a step on the device: what every operation is handed. */
typedef struct step_ctx {
    cuda_backend *c;
    const eng_step_seq *seqs;
    int32_t n_seqs;
    int64_t rows;
    qt_cuda_step_rows sr; /* the rows' layout on the device, for the KV kernels */
    dev_version **vers;   /* per sequence, NULL: pristine */
    row_run *seq_runs;    /* per sequence: its rows of the step */
    int32_t max_terms;
    /* a layer's own projections (eng_n_layer_proj: the seven, and Gemma
     * 4's per-layer input gate and projection in a model with them or
     * experts), the experts' after */
    int32_t own;
    seg_run *runs; /* [n_layers][own][max_terms]: the layers' own projections' */
} step_ctx;

/*
 * y = x @ W^T for layer l's projection p over the rows of `runs` (each on
 * its sequence's version's tensor; neighbours sharing one go in one
 * product), then each unmerged term k as one SGMV pass of the segments
 * terms[k] names in d_segs: the sum forward.c's project() makes. rows is
 * how many rows x and y hold.
 */
static int project_runs(step_ctx *sc, int32_t l, eng_proj p, const row_run *runs, int32_t n_runs,
                        int64_t rows, const seg_run *terms, const qt_cuda_lora_segment *d_segs,
                        const float *x, float *y, char *msg, size_t msg_len)
{
    cuda_backend *c = sc->c;
    const qtensor *base = eng_model_proj(c->base.m, l, p);
    int64_t in = base->cols, out = base->rows;
    char why[256];
    for (int32_t i = 0; i < n_runs;) {
        const qt_cuda_tensor *w = seq_tensor(c, sc->vers, runs[i].seq, l, p);
        int32_t e = i;
        int64_t r0 = runs[i].row0, n = 0;
        for (; e < n_runs && seq_tensor(c, sc->vers, runs[e].seq, l, p) == w; e++)
            n += runs[e].rows;
        int rc =
            qt_cuda_matmul(c->blas, w, x + r0 * in, n, y + r0 * out, c->stream, why, sizeof why);
        if (rc != QL_OK)
            return ql_fail(msg, msg_len, device_code(rc), "%s: %s", eng_proj_name(p), why);
        i = e;
    }
    for (int32_t k = 0; terms && k < sc->max_terms; k++) {
        const seg_run *run = &terms[k];
        if (run->n == 0)
            continue;
        int rc = qt_cuda_sgmv(x, in, y, out, d_segs + run->first, run->n, run->max_rank, rows,
                              c->lora_t, c->stream, why, sizeof why);
        if (rc != QL_OK)
            return ql_fail(msg, msg_len, device_code(rc), "%s, adapters: %s", eng_proj_name(p),
                           why);
    }
    return QL_OK;
}

/* y = x @ W^T for layer l's projection p over the step's rows, each
 * sequence on its weight version, with its unmerged adapters. */
static int cuda_project(void *be, int32_t l, eng_proj p, const float *x, float *y, char *msg,
                        size_t msg_len)
{
    step_ctx *sc = be;
    const seg_run *terms =
        sc->runs ? &sc->runs[((size_t)l * (size_t)sc->own + p) * (size_t)sc->max_terms] : NULL;
    return project_runs(sc, l, p, sc->seq_runs, sc->n_seqs, sc->rows, terms, sc->c->d_segs, x, y,
                        msg, msg_len);
}

/*
 * Sequence q's k-th unmerged term on layer l's projection p as an SGMV
 * segment of rows [row0, row0 + rows), staged at segs[*at] and counted in
 * run; nothing when q has no k-th term or it does not target p. The
 * adapter goes to the device on first use.
 */
static int stage_segment(cuda_backend *c, const eng_step_seq *q, int32_t k, int32_t l, eng_proj p,
                         int64_t row0, int64_t rows, qt_cuda_lora_segment *segs, int64_t *at,
                         seg_run *run, char *msg, size_t msg_len)
{
    if (q->n_delta <= k)
        return QL_OK;
    const eng_lora_term *term = &q->delta[k];
    const eng_lora_module *mod = eng_lora_module_at(term->lora, l, p);
    if (!mod)
        return QL_OK;
    dev_lora *dl;
    int rc = lora_on_device(c, term->lora, &dl, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    size_t i = (size_t)l * (size_t)c->n_proj + p;
    segs[(*at)++] = (qt_cuda_lora_segment){
        .row0 = row0,
        .rows = rows,
        .a = dl->a[i],
        .b = dl->b[i],
        .a_kind = mod->a.kind,
        .b_kind = mod->b.kind,
        .rank = (int32_t)mod->a.rows,
        .scale = term->scale * mod->scale, /* in f32, as eng_lora_apply */
    };
    run->n++;
    if ((int32_t)mod->a.rows > run->max_rank)
        run->max_rank = (int32_t)mod->a.rows;
    return QL_OK;
}

/* Grow a pinned host array and its device twin to hold n elements of size
 * bytes each (the stream is idle between steps, so freeing is safe). */
static int grow_pair(void **host, void **dev, int64_t *cap, int64_t n, size_t size,
                     const char *what, char *msg, size_t msg_len)
{
    if (n <= *cap)
        return QL_OK;
    int64_t want = n > 2 * *cap ? n : 2 * *cap;
    cudaFreeHost(*host);
    cudaFree(*dev);
    *host = *dev = NULL;
    *cap = 0;
    int rc = host_alloc(host, (size_t)want * size, what, msg, msg_len);
    if (rc == QL_OK)
        rc = dev_alloc(dev, (size_t)want * size, what, msg, msg_len);
    if (rc == QL_OK)
        *cap = want;
    return rc;
}

/*
 * The step's layout on the host, then on the device: each row's token,
 * sequence, position and rotation; the block tables; the device copies of
 * the versions and adapters the sequences use; the SGMV segments of every
 * (layer, projection, term).
 */
static int lay_out_step(step_ctx *sc, char *msg, size_t msg_len)
{
    cuda_backend *c = sc->c;
    const eng_config *cfg = &c->base.m->cfg;
    /* the sliding layers' table has their head's pairs (Gemma 4's full
     * layers have a wider head) */
    int32_t half = eng_rope_dims(cfg) / 2, half_local = eng_rope_dims_local(cfg) / 2,
            bt = c->kv.block_tokens, L = cfg->n_layers;
    int64_t tables = 0;
    for (int32_t s = 0, r = 0; s < sc->n_seqs; s++) {
        const eng_step_seq *q = &sc->seqs[s];
        c->seq_row[s] = r;
        sc->seq_runs[s] = (row_run){.seq = s, .row0 = r, .rows = q->n_tokens};
        c->h_bt_offset[s] = (int32_t)tables;
        tables += (q->pos + q->n_tokens + bt - 1) / bt;
        if (c->states) { /* a hybrid model: where the sequence's rows start, its state */
            c->h_seq_first[s] = r;
            c->h_seq_slot[s] = q->kv->state - 1;
            c->h_seq_first[s + 1] = r + q->n_tokens;
        }
        const double *inv_freq = c->inv_freq + (q->rope_long ? half : 0); /* its one set */
        for (int32_t t = 0; t < q->n_tokens; t++, r++) {
            c->h_tokens[r] = q->tokens[t];
            c->h_row_seq[r] = s;
            c->h_row_pos[r] = q->pos + t;
            eng_rope_row(inv_freq, half, c->h_row_pos[r], eng_rope_attention_factor(cfg),
                         c->h_cos + (size_t)r * half, c->h_sin + (size_t)r * half);
            if (c->inv_freq_local)
                eng_rope_row(c->inv_freq_local, half_local, c->h_row_pos[r], 1.0,
                             c->h_cos_local + (size_t)r * half_local,
                             c->h_sin_local + (size_t)r * half_local);
        }
    }
    int rc = grow_pair((void **)&c->h_tables, (void **)&c->d_tables, &c->tables_cap, tables,
                       sizeof(int32_t), "block tables", msg, msg_len);
    if (rc != QL_OK)
        return rc;
    for (int32_t s = 0; s < sc->n_seqs; s++) {
        const eng_step_seq *q = &sc->seqs[s];
        int32_t n = (q->pos + q->n_tokens + bt - 1) / bt;
        memcpy(c->h_tables + c->h_bt_offset[s], q->kv->blocks, (size_t)n * sizeof(int32_t));
    }

    /* versions and adapters on the device */
    for (int32_t s = 0; s < sc->n_seqs; s++) {
        const eng_weights *w = sc->seqs[s].weights;
        sc->vers[s] = NULL;
        if (w && w->n_merged > 0 &&
            (rc = version_on_device(c, w, NULL, &sc->vers[s], msg, msg_len)))
            return rc;
        if (sc->seqs[s].n_delta > sc->max_terms)
            sc->max_terms = sc->seqs[s].n_delta;
    }
    if (sc->max_terms > 0) {
        size_t n_runs = (size_t)L * (size_t)sc->own * (size_t)sc->max_terms;
        sc->runs = calloc(n_runs, sizeof *sc->runs);
        if (!sc->runs)
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        int64_t n_segs = (int64_t)n_runs * sc->n_seqs, at = 0;
        rc = grow_pair((void **)&c->h_segs, (void **)&c->d_segs, &c->segs_cap, n_segs,
                       sizeof(qt_cuda_lora_segment), "adapter segments", msg, msg_len);
        if (rc != QL_OK)
            return rc;
        for (int32_t l = 0; l < L; l++)
            for (int p = 0; p < sc->own; p++)
                for (int32_t k = 0; k < sc->max_terms; k++) {
                    seg_run *run = &sc->runs[((size_t)l * (size_t)sc->own + (size_t)p) *
                                                 (size_t)sc->max_terms +
                                             (size_t)k];
                    run->first = at;
                    for (int32_t s = 0; s < sc->n_seqs; s++)
                        if ((rc = stage_segment(c, &sc->seqs[s], k, l, (eng_proj)p, c->seq_row[s],
                                                sc->seqs[s].n_tokens, c->h_segs, &at, run, msg,
                                                msg_len)))
                            return rc;
                }
        if (at > 0)
            CUDA_TRY(cudaMemcpyAsync(c->d_segs, c->h_segs, (size_t)at * sizeof *c->h_segs,
                                     cudaMemcpyHostToDevice, c->stream),
                     "copying adapter segments");
    }

    size_t T = (size_t)sc->rows, S = (size_t)sc->n_seqs;
    struct {
        void *dev;
        const void *host;
        size_t bytes;
    } copies[] = {
        {c->d_tokens, c->h_tokens, T * sizeof(int32_t)},
        {c->d_row_seq, c->h_row_seq, T * sizeof(int32_t)},
        {c->d_row_pos, c->h_row_pos, T * sizeof(int32_t)},
        {c->d_bt_offset, c->h_bt_offset, S * sizeof(int32_t)},
        {c->d_tables, c->h_tables, (size_t)tables * sizeof(int32_t)},
        {c->d_cos, c->h_cos, T * (size_t)half * sizeof(float)},
        {c->d_sin, c->h_sin, T * (size_t)half * sizeof(float)},
        {c->d_cos_local, c->h_cos_local,
         c->inv_freq_local ? T * (size_t)half_local * sizeof(float) : 0},
        {c->d_sin_local, c->h_sin_local,
         c->inv_freq_local ? T * (size_t)half_local * sizeof(float) : 0},
        {c->d_seq_first, c->h_seq_first, c->states ? (S + 1) * sizeof(int32_t) : 0},
        {c->d_seq_slot, c->h_seq_slot, c->states ? S * sizeof(int32_t) : 0},
    };
    for (size_t i = 0; i < sizeof copies / sizeof *copies; i++)
        if (copies[i].bytes)
            CUDA_TRY(cudaMemcpyAsync(copies[i].dev, copies[i].host, copies[i].bytes,
                                     cudaMemcpyHostToDevice, c->stream),
                     "copying the step's layout to the device");
    return QL_OK;
}

/* --- the CUDA row of operations (eng_walk_ops) ----------------------------------- */

/* A kernel's status as an engine error naming the kernel's reason. */
static int kernel(int qt_rc, const char *why, char *msg, size_t msg_len)
{
    return qt_rc == QL_OK ? QL_OK : ql_fail(msg, msg_len, device_code(qt_rc), "cuda: %s", why);
}

/* The step's layout on the device (lay_out_step), the device copies of the
 * versions and adapters it uses (their ranks were bounded at upload). */
static int cuda_begin(void *be, const eng_step_seq *seqs, int32_t n_seqs, int64_t rows,
                      int64_t max_rank, char *msg, size_t msg_len)
{
    (void)max_rank;
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    sc->seqs = seqs;
    sc->n_seqs = n_seqs;
    sc->rows = rows;
    sc->own = eng_n_layer_proj(&c->base.m->cfg);
    prune_device_copies(c);
    c->moe.ran = c->moe.bytes = 0;
    sc->vers = calloc((size_t)n_seqs + 1, sizeof *sc->vers);
    sc->seq_runs = calloc((size_t)n_seqs + 1, sizeof *sc->seq_runs);
    if (!sc->vers || !sc->seq_runs)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    int rc = lay_out_step(sc, msg, msg_len);
    /* (after the layout, which may have grown the block tables) */
    sc->sr = (qt_cuda_step_rows){rows, c->d_row_seq, c->d_row_pos, c->d_bt_offset, c->d_tables};
    return rc;
}

static int cuda_embed(void *be, float *x, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_gather_rows(&sc->c->embed, sc->c->d_tokens, sc->rows, x, sc->c->stream,
                                      why, sizeof why),
                  why, msg, msg_len);
}

static int cuda_scale(void *be, float *v, int64_t n, float s, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_scale(v, s, n, sc->c->stream, why, sizeof why), why, msg, msg_len);
}

static int cuda_rmsnorm(void *be, float *out, const float *x, const float *w, int64_t rows,
                        int64_t n, float eps, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_rmsnorm(out, x, w, rows, n, eps, sc->c->stream, why, sizeof why), why,
                  msg, msg_len);
}

static int cuda_add_bias(void *be, float *y, const float *bias, int64_t rows, int64_t n, char *msg,
                         size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_add_bias(y, bias, rows, n, sc->c->stream, why, sizeof why), why, msg,
                  msg_len);
}

/* head_dim is the layer's (Gemma 4's full layers have their own), the
 * table's pairs its own (the sliding layers' head, or the main one's) */
static int cuda_rope(void *be, float *vec, int32_t n_heads, int32_t head_dim, int table, char *msg,
                     size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    const eng_config *cfg = &c->base.m->cfg;
    bool local = table == ENG_WALK_ROPE_LOCAL;
    char why[256];
    return kernel(qt_cuda_rope_partial(vec, local ? c->d_cos_local : c->d_cos,
                                       local ? c->d_sin_local : c->d_sin, sc->rows, n_heads,
                                       head_dim,
                                       local ? eng_rope_dims_local(cfg) : eng_rope_dims(cfg),
                                       cfg->rope_interleaved, c->stream, why, sizeof why),
                  why, msg, msg_len);
}

/* Layer l's rows of the arena as a cache of one layer: the kernels address
 * block b's layer 0 at b * block_floats, so the arena starts at the
 * layer's offset in the host cache's block (kv_cache_internal.h's
 * layer_off: a hybrid model's blocks hold its full layers alone, Gemma 4's
 * full layers have rows of their own size) and a row is the layer's. */
static qt_cuda_kv layer_cache(const cuda_backend *c, int32_t l)
{
    const eng_kv_cache *kv = c->base.kv;
    qt_cuda_kv one = c->kv;
    one.arena += kv->layer_off[l] / sizeof(float);
    one.n_layers = 1;
    one.kv_dim = kv->layer_dim[l];
    return one;
}

static int cuda_kv_write(void *be, int32_t l, const float *k, const float *v, char *msg,
                         size_t msg_len)
{
    step_ctx *sc = be;
    qt_cuda_kv kv = layer_cache(sc->c, l);
    char why[256];
    return kernel(qt_cuda_kv_write(&kv, 0, &sc->sr, k, v, sc->c->stream, why, sizeof why), why, msg,
                  msg_len);
}

static int cuda_attend(void *be, int32_t l, const float *q, float *out, int32_t window, float scale,
                       float softcap, const float *sinks, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    const eng_config *cfg = &c->base.m->cfg;
    qt_cuda_kv kv = layer_cache(c, l);
    char why[256];
    return kernel(qt_cuda_attention_ex(&kv, 0, &sc->sr, q, out, cfg->n_heads,
                                       eng_layer_kv_heads(cfg, l), eng_layer_head_dim(cfg, l),
                                       window, scale, softcap, sinks, c->stream, why, sizeof why),
                  why, msg, msg_len);
}

static int cuda_add(void *be, float *x, const float *y, int64_t n, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_add(x, y, n, sc->c->stream, why, sizeof why), why, msg, msg_len);
}

static int cuda_split_gate(void *be, const float *src, float *q, float *gate, int64_t n, int32_t d,
                           char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_split_gate(src, q, gate, n, d, sc->c->stream, why, sizeof why), why, msg,
                  msg_len);
}

static int cuda_gate_sigmoid(void *be, float *x, const float *gate, int64_t n, char *msg,
                             size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_gate_sigmoid(x, gate, n, sc->c->stream, why, sizeof why), why, msg,
                  msg_len);
}

/* Layer l's Gated DeltaNet (eng_walk_ops.delta_net): in_proj_b and
 * in_proj_a of x on the layer's own tensors (no version nor adapter
 * touches them, as on the CPU), then qt_cuda_delta_net over the step's
 * sequences and their states on the device. */
static int cuda_delta_net(void *be, int32_t l, const float *x, float *qkv, const float *z,
                          float *out, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    const eng_config *cfg = &c->base.m->cfg;
    const eng_linear_cfg *lc = &cfg->linear;
    const dev_layer *dl = &c->layers[l];
    char why[256];
    // beta's and the decay's inputs: in_proj_b x, in_proj_a x
    int rc = qt_cuda_matmul(c->blas, &dl->in_b, x, sc->rows, c->beta, c->stream, why, sizeof why);
    if (rc == QL_OK)
        rc = qt_cuda_matmul(c->blas, &dl->in_a, x, sc->rows, c->decay, c->stream, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, device_code(rc), "in_proj_b, in_proj_a: %s", why);
    // the conv, l2-normed q and k, the delta rule over each state, the gated norm
    qt_cuda_delta_layer ly = {.n_k_heads = lc->n_k_heads,
                              .n_v_heads = lc->n_v_heads,
                              .k_head_dim = lc->k_head_dim,
                              .v_head_dim = lc->v_head_dim,
                              .conv_kernel = lc->conv_kernel,
                              .v_tiled = lc->v_tiled,
                              .eps = cfg->rms_norm_eps,
                              .conv = dl->conv,
                              .neg_a = dl->neg_a,
                              .dt_bias = dl->dt_bias,
                              .norm = dl->lin_norm,
                              .states = c->states,
                              .state_floats = c->state_floats,
                              .layer_off = c->lin_index[l] * eng_linear_layer_state(lc)};
    qt_cuda_delta_seqs sq = {sc->n_seqs, sc->rows, c->d_seq_first, c->d_seq_slot};
    return kernel(
        qt_cuda_delta_net(&ly, &sq, c->beta, c->decay, qkv, z, out, c->stream, why, sizeof why),
        why, msg, msg_len);
}

/* The cache's state hook (kv_cache_internal.h): slot dst zeroed, or
 * copied from slot src, on the step stream, so before the next step reads
 * it; a failure is kept for the next step to report. */
static void cuda_state_hook(void *ctx, int32_t dst, int32_t src)
{
    cuda_backend *c = ctx;
    size_t bytes = (size_t)c->state_floats * sizeof(float);
    float *to = c->states + (size_t)dst * (size_t)c->state_floats;
    cudaError_t st = src < 0
                         ? cudaMemsetAsync(to, 0, bytes, c->stream)
                         : cudaMemcpyAsync(to, c->states + (size_t)src * (size_t)c->state_floats,
                                           bytes, cudaMemcpyDeviceToDevice, c->stream);
    if (st != cudaSuccess && c->state_rc == QL_OK)
        c->state_rc = cuda_fail(st, c->state_msg, sizeof c->state_msg, "%s recurrent state %d",
                                src < 0 ? "zeroing" : "forking into", dst);
}

static int cuda_glu(void *be, float *gate, const float *up, int64_t n, eng_ffn_act act, char *msg,
                    size_t msg_len)
{
    step_ctx *sc = be;
    const eng_config *cfg = &sc->c->base.m->cfg;
    void *stream = sc->c->stream;
    char why[256];
    int rc = act == ENG_FFN_SWIGLU_OAI
                 ? qt_cuda_swiglu_oai(gate, up, n, cfg->swiglu_alpha, cfg->swiglu_limit, stream,
                                      why, sizeof why)
             : act == ENG_FFN_GELU_TANH ? qt_cuda_geglu(gate, up, n, stream, why, sizeof why)
                                        : qt_cuda_swiglu(gate, up, n, stream, why, sizeof why);
    return kernel(rc, why, msg, msg_len);
}

static int cuda_copy(void *be, float *dst, const float *src, int64_t n, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    CUDA_TRY(cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice,
                             sc->c->stream),
             "copying rows on the device");
    return QL_OK;
}

/* Gemma 4: each row's token's row of embed_tokens_per_layer. */
static int cuda_embed_per_layer(void *be, float *out, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_gather_rows(&sc->c->ple_embed, sc->c->d_tokens, sc->rows, out,
                                      sc->c->stream, why, sizeof why),
                  why, msg, msg_len);
}

/* Gemma 4: the step's rows through per_layer_model_projection. */
static int cuda_project_per_layer(void *be, const float *x, float *out, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    char why[256];
    return kernel(
        qt_cuda_matmul(c->blas, &c->ple_proj, x, sc->rows, out, c->stream, why, sizeof why), why,
        msg, msg_len);
}

/* Gemma 4's per-layer input gate times a layer's slice: GeGLU, the one
 * activation a model with per-layer inputs has (gemma4.c). */
static int cuda_glu_strided(void *be, float *gate, const float *up, int64_t rows, int64_t n,
                            int64_t up_stride, eng_ffn_act act, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    if (act != ENG_FFN_GELU_TANH)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "cuda: a strided GLU takes gelu_tanh only (Gemma 4's per-layer inputs)");
    return kernel(
        qt_cuda_geglu_strided(gate, up, rows, n, up_stride, sc->c->stream, why, sizeof why), why,
        msg, msg_len);
}

static int cuda_classify(void *be, const float *h, int64_t rows, float *logits, char *msg,
                         size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    const qt_cuda_tensor *head = c->lm_head.rows ? &c->lm_head : &c->embed;
    char why[256];
    return kernel(qt_cuda_matmul(c->blas, head, h, rows, logits, c->stream, why, sizeof why), why,
                  msg, msg_len);
}

static int cuda_softcap(void *be, float *v, int64_t n, float cap, char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    char why[256];
    return kernel(qt_cuda_softcap(v, cap, n, sc->c->stream, why, sizeof why), why, msg, msg_len);
}

static int cuda_to_host(void *be, float *host, const float *src, int64_t n, char *msg,
                        size_t msg_len)
{
    step_ctx *sc = be;
    CUDA_TRY(cudaMemcpyAsync(host, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost,
                             sc->c->stream),
             "copying every row's logits back");
    return QL_OK;
}

/* --- a mixture of experts (eng_walk_ops.moe) ------------------------------------ */

/*
 * Layer l's routing on the host, from the router logits the device sent
 * back (moe.h_logits): each row's experts and weights by ops_math.h's
 * om_moe_route, or om_moe_route_topk_softmax with the router's bias
 * router_b (GPT-OSS; NULL: none): experts_cpu.c's arithmetic, so both
 * backends pick the same experts with the same weights from the same
 * logits; the (row, choice) pairs grouped by expert with a counting sort
 * (rows ascending in an expert's run) into h_order, their weights beside
 * them in h_weight;
 * each expert's gathered rows as runs of their sequences; the shared
 * expert's gates after the T * K weights. expert_scale (NULL: none) is
 * Gemma 4's per_expert_scale.
 */
static void route_on_host(step_ctx *sc, bool shared, const float *router_b,
                          const float *expert_scale)
{
    cuda_backend *c = sc->c;
    const eng_config *cfg = &c->base.m->cfg;
    moe_scratch *s = &c->moe;
    int32_t E = cfg->n_experts, K = cfg->n_experts_used;
    int64_t T = sc->rows, pairs = T * K;
    for (int64_t r = 0; r < T; r++) {
        if (cfg->router == ENG_ROUTER_TOPK_SOFTMAX)
            om_moe_route_topk_softmax(s->h_logits + r * E, router_b, E, K, s->pick + r * K,
                                      s->weight + r * K);
        else
            om_moe_route(s->h_logits + r * E, E, K, cfg->norm_topk_prob, s->pick + r * K,
                         s->weight + r * K);
    }
    // Gemma 4: each chosen weight times its expert's per_expert_scale (experts_cpu.c's order)
    for (int64_t i = 0; expert_scale && i < pairs; i++)
        s->weight[i] *= expert_scale[s->pick[i]];
    memset(s->count, 0, (size_t)(E + 1) * sizeof *s->count);
    for (int64_t i = 0; i < pairs; i++)
        s->count[s->pick[i] + 1]++;
    for (int32_t e = 0; e < E; e++)
        s->count[e + 1] += s->count[e];
    // each pair to the next free place of its expert's run (first: a cursor)
    memcpy(s->first, s->count, (size_t)E * sizeof *s->first);
    for (int64_t i = 0; i < pairs; i++)
        s->h_order[s->first[s->pick[i]]++] = (int32_t)i;
    int32_t n_runs = 0;
    for (int32_t e = 0; e < E; e++) {
        s->first[e] = n_runs;
        for (int32_t i = s->count[e]; i < s->count[e + 1]; i++) {
            int32_t seq = c->h_row_seq[s->h_order[i] / K];
            s->h_weight[i] = s->weight[s->h_order[i]];
            if (i > s->count[e] && s->runs[n_runs - 1].seq == seq) {
                s->runs[n_runs - 1].rows++;
                continue;
            }
            s->runs[n_runs++] = (row_run){.seq = seq, .row0 = i - s->count[e], .rows = 1};
        }
    }
    s->first[E] = n_runs;
    for (int64_t r = 0; shared && r < T; r++)
        s->h_weight[pairs + r] = om_moe_shared_gate(s->h_logits[T * E + r]);
}

/* The unmerged adapters' segments on layer l's chosen experts, staged into
 * moe.h_segs and copied to the device; terms[(3 * e + part) * max_terms +
 * k] says where each (expert, part, term)'s segments are. */
static int stage_expert_segments(step_ctx *sc, int32_t l, seg_run *terms, char *msg, size_t msg_len)
{
    cuda_backend *c = sc->c;
    moe_scratch *s = &c->moe;
    int32_t E = c->base.m->cfg.n_experts, M = sc->max_terms;
    int64_t at = 0;
    int rc = grow_pair((void **)&s->h_segs, (void **)&s->d_segs, &s->segs_cap,
                       (int64_t)s->first[E] * 3 * M, sizeof *s->h_segs, "adapter segments", msg,
                       msg_len);
    for (int32_t e = 0; rc == QL_OK && e < E; e++)
        for (int part = 0; rc == QL_OK && part < 3; part++) {
            eng_proj p = eng_expert_proj(e, (eng_proj)(ENG_PROJ_GATE + part));
            for (int32_t k = 0; rc == QL_OK && k < M; k++) {
                seg_run *run = &terms[((size_t)e * 3 + (size_t)part) * (size_t)M + (size_t)k];
                run->first = at;
                for (int32_t i = s->first[e]; rc == QL_OK && i < s->first[e + 1]; i++)
                    rc = stage_segment(c, &sc->seqs[s->runs[i].seq], k, l, p, s->runs[i].row0,
                                       s->runs[i].rows, s->h_segs, &at, run, msg, msg_len);
            }
        }
    if (rc == QL_OK && at > 0)
        CUDA_TRY(cudaMemcpyAsync(s->d_segs, s->h_segs, (size_t)at * sizeof *s->h_segs,
                                 cudaMemcpyHostToDevice, c->stream),
                 "copying adapter segments on experts");
    return rc;
}

/* The GLU of projections gate, up, down of layer l over the rows of runs
 * (x: `rows` rows), into moe.yg; terms: the three parts' segment runs, or
 * NULL for the step's own (cuda_project's); bias (device; NULL: none) the
 * expert's gate, up and down biases side by side (GPT-OSS), each added
 * after its product as experts_cpu.c's glu_rows. */
static int glu_runs(step_ctx *sc, int32_t l, const eng_proj part[3], const row_run *runs,
                    int32_t n_runs, int64_t rows, const seg_run *terms,
                    const qt_cuda_lora_segment *d_segs, const float *bias, const float *x,
                    char *msg, size_t msg_len)
{
    moe_scratch *s = &sc->c->moe;
    const eng_config *cfg = &sc->c->base.m->cfg;
    int64_t F = eng_model_proj(sc->c->base.m, l, part[0])->rows, M = sc->max_terms;
    float *out[3] = {s->gg, s->ug, s->yg};
    for (int i = 0; i < 3; i++) {
        if (i > 0 && bias) { /* the previous part's bias */
            int rc = cuda_add_bias(sc, out[i - 1], bias + (i - 1) * F, rows, F, msg, msg_len);
            if (rc != QL_OK)
                return rc;
        }
        if (i == 2) {
            int rc = cuda_glu(sc, s->gg, s->ug, rows * F, cfg->ffn_act, msg, msg_len);
            if (rc != QL_OK)
                return rc;
        }
        const seg_run *t = terms ? terms + i * M : NULL;
        if (!terms && sc->runs && (int)part[i] < sc->own) /* the step's own */
            t = &sc->runs[((size_t)l * (size_t)sc->own + part[i]) * (size_t)M];
        int rc = project_runs(sc, l, part[i], runs, n_runs, rows, t, d_segs, i == 2 ? s->gg : x,
                              out[i], msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    return bias ? cuda_add_bias(sc, s->yg, bias + 2 * F, rows, cfg->hidden_size, msg, msg_len)
                : QL_OK;
}

/*
 * Layer l's mixture of experts on the device. The router's product (and
 * Qwen2-MoE's shared gate) run here; the T x E logits come back and the
 * routing runs on the host (route_on_host): the host must know how many
 * rows each expert got to size its products and skip the experts no row
 * chose, so it waits for the logits anyway, and routing there is the
 * CPU's very code. Then each chosen expert, in ascending order: its rows
 * gathered, gate / up / down through project_runs (each sequence's weight
 * version and unmerged adapters, as the dense projections), and each row's
 * output added with its weight; the shared expert over every row last.
 */
static int cuda_moe(void *be, int32_t l, const float *x, const float *router_x, float *out,
                    char *msg, size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    const eng_model *m = c->base.m;
    const dev_layer *dl = &c->layers[l];
    moe_scratch *s = &c->moe;
    int32_t E = m->cfg.n_experts, K = m->cfg.n_experts_used;
    int64_t T = sc->rows, H = m->cfg.hidden_size, W = 2 * (int64_t)m->cfg.expert_ff + H;
    bool shared = dl->shared_gate.rows > 0;
    char why[256];
    // router: logits = router_x @ router^T (Gemma 4's MoE block: its own
    // input; else x), and the shared expert's gate logits, to the host
    int rc = kernel(qt_cuda_matmul(c->blas, &dl->router, router_x ? router_x : x, T, s->d_logits,
                                   c->stream, why, sizeof why),
                    why, msg, msg_len);
    if (rc == QL_OK && shared)
        rc = kernel(qt_cuda_matmul(c->blas, &dl->shared_gate, x, T, s->d_logits + T * E, c->stream,
                                   why, sizeof why),
                    why, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    CUDA_TRY(cudaMemcpyAsync(s->h_logits, s->d_logits, (size_t)(T * E + (shared ? T : 0)) * 4,
                             cudaMemcpyDeviceToHost, c->stream),
             "copying layer %d's router logits back", l);
    CUDA_TRY(cudaStreamSynchronize(c->stream), "running layer %d's router", l);
    // each row's top-k experts and weights, grouped by expert (on the host)
    route_on_host(sc, shared, dl->h_router_b, dl->h_expert_scale);
    seg_run *terms = NULL;
    if (sc->max_terms > 0) {
        terms = calloc((size_t)E * 3 * (size_t)sc->max_terms, sizeof *terms);
        rc = terms ? stage_expert_segments(sc, l, terms, msg, msg_len)
                   : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    size_t weights = (size_t)(T * K + (shared ? T : 0));
    cudaError_t st = cudaSuccess;
    if (rc == QL_OK)
        st = cudaMemcpyAsync(s->d_order, s->h_order, (size_t)(T * K) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, c->stream);
    if (rc == QL_OK && st == cudaSuccess)
        st = cudaMemcpyAsync(s->d_weight, s->h_weight, weights * sizeof(float),
                             cudaMemcpyHostToDevice, c->stream);
    if (rc == QL_OK && st == cudaSuccess)
        st = cudaMemsetAsync(out, 0, (size_t)(T * H) * sizeof(float), c->stream);
    if (rc == QL_OK && st != cudaSuccess)
        rc = cuda_fail(st, msg, msg_len, "laying out layer %d's experts", l);
    // each chosen expert once, over the rows routed to it, in ascending order
    for (int32_t e = 0; rc == QL_OK && e < E; e++) {
        int32_t n = s->count[e + 1] - s->count[e];
        if (n == 0)
            continue;
        eng_proj part[3] = {eng_expert_proj(e, ENG_PROJ_GATE), eng_expert_proj(e, ENG_PROJ_UP),
                            eng_expert_proj(e, ENG_PROJ_DOWN)};
        rc = kernel(qt_cuda_gather_f32(s->xg, x, s->d_order + s->count[e], K, n, H, c->stream, why,
                                       sizeof why),
                    why, msg, msg_len);
        if (rc == QL_OK)
            rc = glu_runs(sc, l, part, s->runs + s->first[e], s->first[e + 1] - s->first[e], n,
                          terms ? terms + (size_t)e * 3 * (size_t)sc->max_terms : NULL, s->d_segs,
                          dl->expert_b ? dl->expert_b + (size_t)e * (size_t)W : NULL, s->xg, msg,
                          msg_len);
        if (rc == QL_OK)
            rc = kernel(qt_cuda_scatter_add_weighted(out, s->yg, s->d_order + s->count[e], K,
                                                     s->d_weight + s->count[e], n, H, c->stream,
                                                     why, sizeof why),
                        why, msg, msg_len);
        s->ran++;
        for (int i = 0; i < 3; i++)
            s->bytes += qt_nbytes(&m->layers[l].experts[3 * e + i]);
    }
    free(terms);
    // Qwen2-MoE's shared expert over every row, gated by sigmoid(shared_gate . x)
    if (rc == QL_OK && shared) {
        eng_proj part[3] = {ENG_PROJ_GATE, ENG_PROJ_UP, ENG_PROJ_DOWN};
        rc = glu_runs(sc, l, part, sc->seq_runs, sc->n_seqs, T, NULL, c->d_segs, NULL, x, msg,
                      msg_len);
        if (rc == QL_OK)
            rc = kernel(qt_cuda_scatter_add_weighted(out, s->yg, NULL, 1, s->d_weight + T * K, T, H,
                                                     c->stream, why, sizeof why),
                        why, msg, msg_len);
    }
    return rc;
}

/* Whether q's token is chosen on the device (the caller takes tokens and
 * wants q's argmax or plain draw) rather than by the host sampler; never
 * for a sequence that wants every row's logits (its caller reads them). */
static bool chosen_here(const eng_step_seq *q, const int32_t *tokens)
{
    return tokens && (q->greedy || q->draw) && !q->all_logits;
}

/* Greedy sequences get their token chosen on the device, plain draws drawn
 * there, the others their logits copied back; then the stream is
 * synchronised. */
static int cuda_deliver(void *be, const float *out, float *logits, int32_t *tokens, char *msg,
                        size_t msg_len)
{
    step_ctx *sc = be;
    cuda_backend *c = sc->c;
    int64_t V = c->base.m->cfg.vocab_size, S = sc->n_seqs;
    char why[256];
    /* tokens chosen here: greedy rows by argmax, plain draws by the
     * sampling kernel (which leaves greedy rows alone); the other rows'
     * logits go back to the host sampler */
    bool any_choice = false, any_draw = false;
    for (int32_t s = 0; s < sc->n_seqs; s++) {
        bool draw = tokens && sc->seqs[s].draw;
        any_choice |= chosen_here(&sc->seqs[s], tokens);
        any_draw |= draw;
        c->h_inv_t[s] = draw ? sc->seqs[s].inv_temperature : 0.0f;
        c->h_u[s] = draw ? sc->seqs[s].u : 0.0;
    }
    int rc = QL_OK;
    if (any_choice) {
        rc = kernel(qt_cuda_argmax(out, S, V, c->d_greedy, c->stream, why, sizeof why), why, msg,
                    msg_len);
        if (rc != QL_OK)
            return rc;
        if (any_draw) {
            CUDA_TRY(cudaMemcpyAsync(c->d_inv_t, c->h_inv_t, (size_t)S * sizeof(float),
                                     cudaMemcpyHostToDevice, c->stream),
                     "copying temperatures");
            CUDA_TRY(cudaMemcpyAsync(c->d_u, c->h_u, (size_t)S * sizeof(double),
                                     cudaMemcpyHostToDevice, c->stream),
                     "copying uniforms");
            rc = kernel(qt_cuda_sample(out, S, V, c->d_inv_t, c->d_u, c->d_greedy, c->stream, why,
                                       sizeof why),
                        why, msg, msg_len);
            if (rc != QL_OK)
                return rc;
        }
        CUDA_TRY(cudaMemcpyAsync(c->h_greedy, c->d_greedy, (size_t)S * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, c->stream),
                 "copying chosen tokens back");
    }
    /* logits of the others, in runs of neighbours */
    for (int32_t s = 0; s < sc->n_seqs;) {
        bool chosen = chosen_here(&sc->seqs[s], tokens);
        int32_t e = s + 1;
        while (e < sc->n_seqs && chosen_here(&sc->seqs[e], tokens) == chosen)
            e++;
        if (!chosen)
            CUDA_TRY(cudaMemcpyAsync(logits + (size_t)s * V, out + (size_t)s * V,
                                     (size_t)(e - s) * (size_t)V * sizeof(float),
                                     cudaMemcpyDeviceToHost, c->stream),
                     "copying logits back");
        s = e;
    }
    CUDA_TRY(cudaStreamSynchronize(c->stream), "running the step");
    for (int32_t s = 0; tokens && s < sc->n_seqs; s++)
        tokens[s] = chosen_here(&sc->seqs[s], tokens) ? c->h_greedy[s] : -1;
    return QL_OK;
}

static const eng_walk_ops cuda_ops = {
    .begin = cuda_begin,
    .embed = cuda_embed,
    .scale = cuda_scale,
    .rmsnorm = cuda_rmsnorm,
    .project = cuda_project,
    .add_bias = cuda_add_bias,
    .rope = cuda_rope,
    .kv_write = cuda_kv_write,
    .attend = cuda_attend,
    .split_gate = cuda_split_gate,
    .gate_sigmoid = cuda_gate_sigmoid,
    .delta_net = cuda_delta_net,
    .add = cuda_add,
    .moe = cuda_moe,
    .glu = cuda_glu,
    .embed_per_layer = cuda_embed_per_layer,
    .project_per_layer = cuda_project_per_layer,
    .glu_strided = cuda_glu_strided,
    .copy = cuda_copy,
    .classify = cuda_classify,
    .softcap = cuda_softcap,
    .to_host = cuda_to_host,
    .deliver = cuda_deliver,
};

/* Copy on write in the device arena, on the step stream: ordered after
 * the last step's writes and before the next step's reads. */
static int cuda_copy_blocks(eng_backend *b, const eng_kv_copy *copies, int32_t n, char *msg,
                            size_t msg_len)
{
    cuda_backend *c = (cuda_backend *)b;
    size_t floats = c->kv.block_floats;
    for (int32_t i = 0; i < n; i++) {
        cudaError_t st =
            cudaMemcpyAsync(c->kv.arena + (size_t)copies[i].dst * floats,
                            c->kv.arena + (size_t)copies[i].src * floats, floats * sizeof(float),
                            cudaMemcpyDeviceToDevice, c->stream);
        if (st != cudaSuccess) {
            cudaStreamSynchronize(c->stream);
            return cuda_fail(st, msg, msg_len, "copying KV block %d to block %d", copies[i].src,
                             copies[i].dst);
        }
    }
    return QL_OK;
}

/* A step: the walk (walk.c) over this backend's row of operations. */
static int cuda_forward(eng_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
                        int32_t *tokens, char *msg, size_t msg_len)
{
    cuda_backend *c = (cuda_backend *)b;
    if (n_seqs > c->max_seqs)
        return ql_fail(msg, msg_len, QL_EINVAL, "%d sequences in one step; at most %d", n_seqs,
                       c->max_seqs);
    if (c->state_rc != QL_OK)
        return ql_fail(msg, msg_len, c->state_rc, "%s", c->state_msg);
    step_ctx sc = {.c = c};
    eng_walk_backend wb = {
        .ops = &cuda_ops,
        .be = &sc,
        .m = b->m,
        .kv = b->kv,
        .max_tokens = c->max_tokens,
        .piece_rows = c->max_seqs,
        .x = c->x,
        .h = c->h,
        .q = c->q,
        .k = c->k,
        .v = c->v,
        .att = c->att,
        .gate = c->gate,
        .up = c->up,
        .tmp = c->tmp,
        .last = c->last,
        .logits = c->logits,
        .mix = c->mix,
        .out_gate = c->out_gate,
        .ple = c->ple,
        .layers = c->walk_layers,
        .final_norm = c->final_norm,
        .ple_norm = c->ple_norm,
    };
    // the one walk over the layers (walk.c)
    int rc = eng_walk(&wb, seqs, n_seqs, logits, tokens, msg, msg_len);
    if (rc != QL_OK) {
        /* leave the stream idle (and the staging free to reuse) whatever failed;
         * a fault poisons the context, which the next step reports again */
        cudaStreamSynchronize(c->stream);
        cudaGetLastError();
    }
    free(sc.vers);
    free(sc.seq_runs);
    free(sc.runs);
    return rc;
}

/* --- checking what the device holds ------------------------------------------------ */

/* The digest of the device's tensors for version w: each projection copied
 * back into a clone of the host tensor of the same layout, then hashed as
 * eng_weights_digest hashes a version (embeddings, norms and lm_head are
 * the host's: only projections are ever merged). */
static int cuda_digest(eng_backend *b, const eng_weights *w, uint64_t *digest, char *msg,
                       size_t msg_len)
{
    cuda_backend *c = (cuda_backend *)b;
    const eng_model *m = b->m;
    size_t n = (size_t)m->cfg.n_layers * (size_t)c->n_proj;
    dev_version *dv = NULL;
    if (w && w->n_merged > 0) {
        int rc = version_on_device(c, w, NULL, &dv, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    qtensor *copies = calloc(n, sizeof *copies);
    const qtensor **proj = calloc(n, sizeof *proj);
    int rc = copies && proj ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    CUDA_TRY(cudaStreamSynchronize(c->stream), "finishing the device's work");
    for (size_t i = 0; rc == QL_OK && i < n; i++) {
        int32_t l = (int32_t)(i / (size_t)c->n_proj);
        eng_proj p = (eng_proj)(i % (size_t)c->n_proj);
        const qtensor *host = w ? eng_weights_proj(w, l, p) : eng_model_proj(m, l, p);
        const qt_cuda_tensor *dev = dv && dv->proj[i].rows ? &dv->proj[i] : &c->layers[l].proj[p];
        char why[256];
        if (host->rows == 0) { /* an expert's slot in a dense layer: nothing uploaded */
            proj[i] = host;
            continue;
        }
        if (qt_clone(&copies[i], host) != QL_OK) {
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        } else {
            int qrc = qt_cuda_tensor_download(dev, &copies[i], why, sizeof why);
            if (qrc != QL_OK)
                rc = ql_fail(msg, msg_len, device_code(qrc), "layer %d %s: %s", l, eng_proj_name(p),
                             why);
        }
        proj[i] = &copies[i];
    }
    if (rc == QL_OK) {
        eng_weights view = {.m = m, .n_proj = c->n_proj, .proj = proj};
        *digest = eng_weights_digest(m, &view);
    }
    for (size_t i = 0; copies && i < n; i++)
        qt_free(&copies[i]);
    free(copies);
    free(proj);
    return rc;
}

/* Build version w's device copy now (the registry publishes it after), with
 * each module's merge figures and the digest of what the device serves. */
static int cuda_prepare(eng_backend *b, const eng_weights *w, eng_merge_cost *costs,
                        uint64_t *digest, char *msg, size_t msg_len)
{
    cuda_backend *c = (cuda_backend *)b;
    if (costs)
        memset(costs, 0, (size_t)b->m->cfg.n_layers * (size_t)c->n_proj * sizeof *costs);
    prune_device_copies(c);
    if (w->n_merged > 0) {
        dev_version *dv;
        for (dv = c->versions; dv && dv->w != w;)
            dv = dv->next;
        if (dv && costs)
            return ql_fail(msg, msg_len, QL_EINVAL, "version %llu is on the device already",
                           (unsigned long long)w->version);
        int rc = version_on_device(c, w, costs, &dv, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    return digest ? cuda_digest(b, w, digest, msg, msg_len) : QL_OK;
}

/* --- creation ---------------------------------------------------------------------- */

static void cuda_destroy(eng_backend *b)
{
    cuda_backend *c = (cuda_backend *)b;
    const eng_model *m = b->m;
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    while (c->versions) {
        dev_version *dv = c->versions;
        c->versions = dv->next;
        dev_version_free(dv, m->cfg.n_layers);
    }
    while (c->loras) {
        dev_lora *dl = c->loras;
        c->loras = dl->next;
        dev_lora_free(dl, m->cfg.n_layers);
    }
    for (int32_t l = 0; c->layers && l < m->cfg.n_layers; l++) {
        dev_layer *dl = &c->layers[l];
        cudaFree(dl->attn_norm);
        cudaFree(dl->ffn_norm);
        cudaFree(dl->bias);
        cudaFree(dl->q_norm);
        cudaFree(dl->k_norm);
        cudaFree(dl->v_norm);
        cudaFree(dl->post_attn_norm);
        cudaFree(dl->post_ffn_norm);
        cudaFree(dl->o_bias);
        cudaFree(dl->sinks);
        cudaFree(dl->expert_b);
        free(dl->h_router_b);
        free(dl->h_expert_scale);
        for (int p = 0; dl->proj && p < c->n_proj; p++)
            qt_cuda_tensor_release(&dl->proj[p], NULL, 0);
        free(dl->proj);
        qt_cuda_tensor_release(&dl->router, NULL, 0);
        qt_cuda_tensor_release(&dl->shared_gate, NULL, 0);
        qt_cuda_tensor_release(&dl->in_b, NULL, 0);
        qt_cuda_tensor_release(&dl->in_a, NULL, 0);
        float *lin[] = {dl->conv,        dl->neg_a,        dl->dt_bias,
                        dl->lin_norm,    dl->ple_norm,     dl->mlp_post_norm,
                        dl->router_norm, dl->moe_pre_norm, dl->moe_post_norm};
        for (size_t i = 0; i < sizeof lin / sizeof *lin; i++)
            cudaFree(lin[i]);
    }
    moe_scratch *ms = &c->moe;
    free(ms->pick);
    free(ms->weight);
    free(ms->count);
    free(ms->first);
    free(ms->runs);
    free(c->layers);
    free(c->walk_layers);
    qt_cuda_tensor_release(&c->embed, NULL, 0);
    qt_cuda_tensor_release(&c->lm_head, NULL, 0);
    qt_cuda_tensor_release(&c->ple_embed, NULL, 0);
    qt_cuda_tensor_release(&c->ple_proj, NULL, 0);
    cudaFree(c->ple_norm);
    cudaFree(c->ple);
    qt_cuda_blas_free(c->blas);
    void *dev[] = {c->final_norm, c->kv.arena,  c->x,           c->h,           c->q,
                   c->k,          c->v,         c->att,         c->gate,        c->up,
                   c->tmp,        c->last,      c->logits,      c->lora_t,      c->d_tokens,
                   c->d_row_seq,  c->d_row_pos, c->d_bt_offset, c->d_tables,    c->d_greedy,
                   c->d_cos,      c->d_sin,     c->d_segs,      c->d_inv_t,     c->d_u,
                   ms->d_logits,  ms->xg,       ms->yg,         ms->gg,         ms->ug,
                   ms->d_order,   ms->d_weight, ms->d_segs,     c->mix,         c->out_gate,
                   c->beta,       c->decay,     c->states,      c->d_seq_first, c->d_seq_slot};
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
        cudaFree(dev[i]);
    void *host[] = {c->h_tokens,    c->h_row_seq, c->h_row_pos, c->h_bt_offset, c->h_tables,
                    c->h_greedy,    c->h_cos,     c->h_sin,     c->h_segs,      c->h_inv_t,
                    c->h_u,         ms->h_logits, ms->h_order,  ms->h_weight,   ms->h_segs,
                    c->h_seq_first, c->h_seq_slot};
    for (size_t i = 0; i < sizeof host / sizeof *host; i++)
        cudaFreeHost(host[i]);
    free(c->seq_row);
    free(c->lin_index);
    free(c->inv_freq);
    free(c->inv_freq_local);
    cudaFree(c->d_cos_local);
    cudaFree(c->d_sin_local);
    cudaFreeHost(c->h_cos_local);
    cudaFreeHost(c->h_sin_local);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    eng_kv_free(b->kv);
    free(c);
}

/* The layers as the walk reads them: the device copies of their norms and
 * biases (NULL where the architecture has none) and their shape. */
static int walk_view(cuda_backend *c, char *msg, size_t msg_len)
{
    const eng_config *cfg = &c->base.m->cfg;
    c->walk_layers = calloc((size_t)cfg->n_layers, sizeof *c->walk_layers);
    if (!c->walk_layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (int32_t l = 0; l < cfg->n_layers; l++) {
        const dev_layer *dl = &c->layers[l];
        eng_walk_layer *ly = &c->walk_layers[l];
        *ly = (eng_walk_layer){.attn_norm = dl->attn_norm,
                               .ffn_norm = dl->ffn_norm,
                               .bias = dl->bias,
                               .q_norm = dl->q_norm,
                               .k_norm = dl->k_norm,
                               .v_norm = dl->v_norm,
                               .post_attn_norm = dl->post_attn_norm,
                               .post_ffn_norm = dl->post_ffn_norm,
                               .o_bias = dl->o_bias,
                               .sinks = dl->sinks,
                               .ple_norm = dl->ple_norm,
                               .mlp_post_norm = dl->mlp_post_norm,
                               .router_norm = dl->router_norm,
                               .moe_pre_norm = dl->moe_pre_norm,
                               .moe_post_norm = dl->moe_post_norm};
        eng_walk_layer_shape(cfg, l, ly);
    }
    return QL_OK;
}

/* GPT-OSS's small parameters of layer l (those the config announces): the
 * output projection's bias and the sinks to the device, the router's bias
 * to the host, each expert's gate, up and down biases side by side to the
 * device (dev_layer says where each lives). */
static int upload_gpt_oss(cuda_backend *c, int32_t l, char *msg, size_t msg_len)
{
    const eng_config *cfg = &c->base.m->cfg;
    const eng_layer *hl = &c->base.m->layers[l];
    dev_layer *dl = &c->layers[l];
    char what[96];
    snprintf(what, sizeof what, "layer %d's output bias and sinks", l);
    int rc = cfg->o_bias ? upload_rows(&hl->bo, 1, 0.0f, &dl->o_bias, what, msg, msg_len) : QL_OK;
    if (rc == QL_OK && cfg->attn_sinks)
        rc = upload_rows(&hl->sinks, 1, 0.0f, &dl->sinks, what, msg, msg_len);
    if (rc != QL_OK || !cfg->router_bias || !eng_layer_is_moe(cfg, l))
        return rc;
    size_t E = (size_t)cfg->n_experts, F = (size_t)cfg->expert_ff, H = (size_t)cfg->hidden_size,
           W = 2 * F + H;
    dl->h_router_b = malloc(E * sizeof(float));
    float *host = malloc(E * W * sizeof(float)),
          *part = malloc(E * (F > H ? F : H) * sizeof(float));
    if (!dl->h_router_b || !host || !part) {
        free(host);
        free(part);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    qt_dequantize_rows(&hl->router_b, 0, 1, dl->h_router_b);
    for (int k = 0; k < 3; k++) {
        size_t n = k < 2 ? F : H, at = k == 0 ? 0 : k == 1 ? F : 2 * F;
        qt_dequantize_rows(&hl->expert_b[k], 0, (int64_t)E, part);
        for (size_t e = 0; e < E; e++)
            memcpy(host + e * W + at, part + e * n, n * sizeof(float));
    }
    free(part);
    snprintf(what, sizeof what, "layer %d's expert biases", l);
    rc = dev_alloc(&dl->expert_b, E * W * sizeof(float), what, msg, msg_len);
    if (rc == QL_OK) {
        cudaError_t st =
            cudaMemcpy(dl->expert_b, host, E * W * sizeof(float), cudaMemcpyHostToDevice);
        if (st != cudaSuccess)
            rc = cuda_fail(st, msg, msg_len, "copying %s", what);
    }
    free(host);
    return rc;
}

/* Qwen3.5's linear layer l's own tensors besides its projections, as
 * linear_cpu.c keeps them (dev_layer): in_proj_b and in_proj_a uploaded
 * as they are, the conv's taps, dt_bias and the gated norm's weight in
 * f32, and -exp(A_log) (a GGUF's A holds it already). */
static int upload_linear(cuda_backend *c, int32_t l, char *msg, size_t msg_len)
{
    const eng_linear_cfg *lc = &c->base.m->cfg.linear;
    const eng_linear_layer *hl = &c->base.m->layers[l].lin;
    dev_layer *dl = &c->layers[l];
    char what[96];
    snprintf(what, sizeof what, "layer %d's linear attention", l);
    int rc = upload_tensor(&hl->in_b, &dl->in_b, what, &c->weight_bytes, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_tensor(&hl->in_a, &dl->in_a, what, &c->weight_bytes, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_rows(&hl->conv, hl->conv.rows, 0.0f, &dl->conv, what, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_rows(&hl->dt_bias, 1, 0.0f, &dl->dt_bias, what, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_rows(&hl->norm, 1, 0.0f, &dl->lin_norm, what, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    float *neg_a = malloc((size_t)lc->n_v_heads * sizeof(float));
    if (!neg_a)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    qt_dequantize_rows(&hl->a_log, 0, 1, neg_a);
    for (int32_t h = 0; h < lc->n_v_heads && !lc->a_neg_exp; h++)
        neg_a[h] = -expf(neg_a[h]);
    rc = upload_floats(neg_a, lc->n_v_heads, &dl->neg_a, what, msg, msg_len);
    free(neg_a);
    return rc;
}

/* Gemma 4's small parameters of layer l, as forward.c's gemma_state_new
 * keeps them (dev_layer): the per-layer input's norm, the MoE block's four
 * norms (the router's: router.scale / sqrt(hidden), no offset) and
 * per_expert_scale; nothing for what the model has not. */
static int upload_gemma4_layer(cuda_backend *c, int32_t l, char *msg, size_t msg_len)
{
    const eng_config *cfg = &c->base.m->cfg;
    const eng_gemma4_layer *g = &c->base.m->layers[l].g4;
    dev_layer *dl = &c->layers[l];
    float off = cfg->norm_offset;
    char what[96];
    snprintf(what, sizeof what, "layer %d's Gemma 4 norms", l);
    int rc = cfg->g4.ple_dim > 0 ? upload_norm(&g->ple_norm, off, &dl->ple_norm, what, msg, msg_len)
                                 : QL_OK;
    if (rc != QL_OK || !cfg->g4.moe_block)
        return rc;
    rc = upload_norm(&g->mlp_post_norm, off, &dl->mlp_post_norm, what, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_norm(&g->moe_pre_norm, off, &dl->moe_pre_norm, what, msg, msg_len);
    if (rc == QL_OK)
        rc = upload_norm(&g->moe_post_norm, off, &dl->moe_post_norm, what, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    size_t H = (size_t)cfg->hidden_size, E = (size_t)cfg->n_experts;
    float *router = malloc(H * sizeof(float));
    dl->h_expert_scale = g->expert_scale.rows ? malloc(E * sizeof(float)) : NULL;
    if (!router || (g->expert_scale.rows && !dl->h_expert_scale)) {
        free(router);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    qt_dequantize_rows(&g->router_scale, 0, 1, router);
    for (size_t i = 0; i < H; i++) /* transformers' scalar_root_size, as forward.c */
        router[i] *= (float)(1.0 / sqrt((double)H));
    rc = upload_floats(router, (int64_t)H, &dl->router_norm, what, msg, msg_len);
    free(router);
    if (dl->h_expert_scale)
        qt_dequantize_rows(&g->expert_scale, 0, 1, dl->h_expert_scale);
    return rc;
}

/* Every weight of the model to the device, in its own layout. */
static int upload_model(cuda_backend *c, char *msg, size_t msg_len)
{
    const eng_model *m = c->base.m;
    const eng_config *cfg = &m->cfg;
    int64_t Q = (int64_t)cfg->n_heads * cfg->head_dim,
            KV = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    size_t *bytes = &c->weight_bytes;
    int rc = upload_tensor(&m->embed, &c->embed, "the token embeddings", bytes, msg, msg_len);
    if (rc == QL_OK && m->lm_head.rows)
        rc = upload_tensor(&m->lm_head, &c->lm_head, "lm_head", bytes, msg, msg_len);
    if (rc == QL_OK)
        rc =
            upload_norm(&m->norm, cfg->norm_offset, &c->final_norm, "the final norm", msg, msg_len);
    c->layers = rc == QL_OK ? calloc((size_t)cfg->n_layers, sizeof *c->layers) : NULL;
    if (rc == QL_OK && !c->layers)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (int32_t l = 0; rc == QL_OK && l < cfg->n_layers; l++) {
        const eng_layer *hl = &m->layers[l];
        dev_layer *dl = &c->layers[l];
        char what[96];
        snprintf(what, sizeof what, "layer %d's norms", l);
        float off = cfg->norm_offset; /* Gemma folders: (1 + w) */
        rc = upload_norm(&hl->attn_norm, off, &dl->attn_norm, what, msg, msg_len);
        if (rc == QL_OK)
            rc = upload_norm(&hl->ffn_norm, off, &dl->ffn_norm, what, msg, msg_len);
        if (rc == QL_OK && cfg->qk_norm)
            rc = upload_norm(&hl->q_norm, off, &dl->q_norm, what, msg, msg_len);
        if (rc == QL_OK && cfg->qk_norm)
            rc = upload_norm(&hl->k_norm, off, &dl->k_norm, what, msg, msg_len);
        if (rc == QL_OK && cfg->v_norm)
            rc = upload_ones(eng_max_head_dim(cfg), &dl->v_norm, what, msg, msg_len);
        if (rc == QL_OK && (cfg->sandwich_norms || cfg->post_norms))
            rc = upload_norm(&hl->post_attn_norm, off, &dl->post_attn_norm, what, msg, msg_len);
        if (rc == QL_OK && (cfg->sandwich_norms || cfg->post_norms))
            rc = upload_norm(&hl->post_ffn_norm, off, &dl->post_ffn_norm, what, msg, msg_len);
        if (rc == QL_OK && cfg->attention_bias) {
            /* q, k and v biases side by side, as forward.c keeps them */
            float *host = malloc((size_t)(Q + 2 * KV) * sizeof(float));
            if (!host)
                return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
            qt_dequantize_rows(&hl->bq, 0, 1, host);
            qt_dequantize_rows(&hl->bk, 0, 1, host + Q);
            qt_dequantize_rows(&hl->bv, 0, 1, host + Q + KV);
            snprintf(what, sizeof what, "layer %d's biases", l);
            rc = dev_alloc(&dl->bias, (size_t)(Q + 2 * KV) * sizeof(float), what, msg, msg_len);
            if (rc == QL_OK) {
                cudaError_t st = cudaMemcpy(dl->bias, host, (size_t)(Q + 2 * KV) * sizeof(float),
                                            cudaMemcpyHostToDevice);
                if (st != cudaSuccess)
                    rc = cuda_fail(st, msg, msg_len, "copying %s", what);
            }
            free(host);
        }
        dl->proj = rc == QL_OK ? calloc((size_t)c->n_proj, sizeof *dl->proj) : NULL;
        if (rc == QL_OK && !dl->proj)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        for (int p = 0; rc == QL_OK && p < c->n_proj; p++) {
            const qtensor *t = eng_model_proj(m, l, (eng_proj)p);
            if (t->rows == 0) /* an expert's slot in a dense layer (or MoE's dense MLP) */
                continue;
            eng_proj_path((eng_proj)p, what, sizeof what);
            snprintf(what + strlen(what), sizeof what - strlen(what), " of layer %d", l);
            rc = upload_tensor(t, &dl->proj[p], what, bytes, msg, msg_len);
        }
        if (rc == QL_OK && hl->router.rows) {
            snprintf(what, sizeof what, "layer %d's router", l);
            rc = upload_tensor(&hl->router, &dl->router, what, bytes, msg, msg_len);
        }
        if (rc == QL_OK && hl->shared_gate.rows) {
            snprintf(what, sizeof what, "layer %d's shared expert gate", l);
            rc = upload_tensor(&hl->shared_gate, &dl->shared_gate, what, bytes, msg, msg_len);
        }
        if (rc == QL_OK)
            rc = upload_gpt_oss(c, l, msg, msg_len);
        if (rc == QL_OK && eng_linear_is(&cfg->linear, l))
            rc = upload_linear(c, l, msg, msg_len);
        if (rc == QL_OK)
            rc = upload_gemma4_layer(c, l, msg, msg_len);
    }
    if (rc == QL_OK && cfg->g4.ple_dim > 0) {
        rc = upload_tensor(&m->g4.ple_embed, &c->ple_embed, "embed_tokens_per_layer", bytes, msg,
                           msg_len);
        if (rc == QL_OK)
            rc = upload_tensor(&m->g4.ple_proj, &c->ple_proj, "per_layer_model_projection", bytes,
                               msg, msg_len);
        if (rc == QL_OK)
            rc = upload_norm(&m->g4.ple_norm, cfg->norm_offset, &c->ple_norm,
                             "per_layer_projection_norm", msg, msg_len);
    }
    return rc == QL_OK ? walk_view(c, msg, msg_len) : rc;
}

/* Qwen3.5's scratch and the recurrent states on the device (cuda_backend
 * says what each holds), the cache's state hook pointed at them; nothing
 * for a model without linear layers or the output gate. */
static int allocate_hybrid(cuda_backend *c, char *msg, size_t msg_len)
{
    const eng_config *cfg = &c->base.m->cfg;
    const eng_linear_cfg *lc = &cfg->linear;
    if (lc->n_layers == 0 && !lc->attn_output_gate)
        return QL_OK;
    size_t T = (size_t)c->max_tokens, S = (size_t)c->max_seqs,
           Q = (size_t)cfg->n_heads * (size_t)cfg->head_dim, C = (size_t)eng_linear_conv_dim(lc),
           VD = (size_t)lc->n_v_heads * (size_t)lc->v_head_dim, NV = (size_t)lc->n_v_heads;
    size_t mix = C > 2 * Q ? C : 2 * Q, gate = VD > Q ? VD : Q;
    c->state_floats = eng_linear_seq_state(lc);
    size_t states = (size_t)eng_kv_total_states(c->base.kv) * (size_t)c->state_floats;
    const char *what = "Qwen3.5's linear attention";
    int rc = dev_alloc(&c->mix, T * mix * sizeof(float), what, msg, msg_len);
    rc = rc ? rc : dev_alloc(&c->out_gate, T * gate * sizeof(float), what, msg, msg_len);
    rc = rc ? rc : dev_alloc(&c->beta, T * NV * sizeof(float), what, msg, msg_len);
    rc = rc ? rc : dev_alloc(&c->decay, T * NV * sizeof(float), what, msg, msg_len);
    if (rc != QL_OK || lc->n_layers == 0)
        return rc;
    rc = dev_alloc(&c->states, states * sizeof(float), "the recurrent states", msg, msg_len);
    rc = rc ? rc : dev_alloc(&c->d_seq_first, (S + 1) * sizeof(int32_t), what, msg, msg_len);
    rc = rc ? rc : dev_alloc(&c->d_seq_slot, S * sizeof(int32_t), what, msg, msg_len);
    rc = rc ? rc : host_alloc(&c->h_seq_first, (S + 1) * sizeof(int32_t), what, msg, msg_len);
    rc = rc ? rc : host_alloc(&c->h_seq_slot, S * sizeof(int32_t), what, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    c->lin_index = malloc((size_t)cfg->n_layers * sizeof *c->lin_index);
    if (!c->lin_index)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (int32_t l = 0, i = 0; l < cfg->n_layers; l++)
        c->lin_index[l] = eng_linear_is(lc, l) ? i++ : -1;
    eng_kv_set_state_hook(c->base.kv, cuda_state_hook, c);
    return QL_OK;
}

/* Activations, the step's staging, the KV arena and the cuBLASLt state. */
static int allocate_run_state(cuda_backend *c, const eng_backend_opts *o, char *msg, size_t msg_len)
{
    const eng_model *m = c->base.m;
    const eng_config *cfg = &m->cfg;
    /* Gemma 4's full layers may have more (or larger) heads: the widest
     * layer's, as forward.c */
    size_t T = (size_t)c->max_tokens, S = (size_t)c->max_seqs, H = (size_t)cfg->hidden_size,
           Q = (size_t)cfg->n_heads * (size_t)eng_max_head_dim(cfg),
           KV = (size_t)eng_max_kv_dim(cfg), F = (size_t)cfg->intermediate_size,
           V = (size_t)cfg->vocab_size, half = (size_t)eng_rope_dims(cfg) / 2,
           half_local = (size_t)eng_rope_dims_local(cfg) / 2, L = (size_t)cfg->n_layers,
           P = (size_t)cfg->g4.ple_dim;
    /* Gemma 4: a double-wide MLP's layers, the per-layer input gate's side
     * (ple_dim), the MoE block's router input and output (hidden) in gate
     * and up; all layers' per-layer inputs in tmp (their projection) */
    for (int32_t l = 0; l < cfg->n_layers; l++)
        F = (size_t)eng_layer_ff(cfg, l) > F ? (size_t)eng_layer_ff(cfg, l) : F;
    F = P > F ? P : F;
    F = cfg->g4.moe_block && H > F ? H : F;
    /* Qwen3.5's linear layers answer n_v_heads * v_head_dim per row in att */
    size_t VD = (size_t)cfg->linear.n_v_heads * (size_t)cfg->linear.v_head_dim,
           att = Q > VD ? Q : VD;
    size_t EF =
        (size_t)(cfg->expert_ff > cfg->shared_expert_ff ? cfg->expert_ff : cfg->shared_expert_ff);
    size_t wide = F > Q ? F : Q;
    wide = wide > H ? wide : H;
    wide = wide > EF ? wide : EF;
    wide = wide > att ? wide : att; /* out_proj reads a linear layer's att */
    wide = P * L > wide ? P * L : wide;
    struct {
        void *p;
        size_t bytes;
        const char *what;
    } dev[] = {
        {&c->x, T * H * sizeof(float), "activations"},
        {&c->h, T * H * sizeof(float), "activations"},
        {&c->q, T * Q * sizeof(float), "activations"},
        {&c->k, T * KV * sizeof(float), "activations"},
        {&c->v, T * KV * sizeof(float), "activations"},
        {&c->att, T * att * sizeof(float), "activations"},
        {&c->gate, T * F * sizeof(float), "activations"},
        {&c->up, T * F * sizeof(float), "activations"},
        {&c->tmp, T * wide * sizeof(float), "activations"},
        {&c->last, S * H * sizeof(float), "activations"},
        {&c->logits, S * V * sizeof(float), "logits"},
        {&c->lora_t, T * (size_t)c->max_rank * sizeof(float), "adapter scratch"},
        {&c->d_tokens, T * sizeof(int32_t), "the step's layout"},
        {&c->d_row_seq, T * sizeof(int32_t), "the step's layout"},
        {&c->d_row_pos, T * sizeof(int32_t), "the step's layout"},
        {&c->d_bt_offset, S * sizeof(int32_t), "the step's layout"},
        {&c->d_greedy, S * sizeof(int32_t), "the step's layout"},
        {&c->d_cos, T * half * sizeof(float), "the step's layout"},
        {&c->d_sin, T * half * sizeof(float), "the step's layout"},
        {&c->d_inv_t, S * sizeof(float), "the step's layout"},
        {&c->d_u, S * sizeof(double), "the step's layout"},
        {&c->ple, P ? T * L * P * sizeof(float) : 0, "Gemma 4's per-layer inputs"},
    };
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++) {
        int rc = dev[i].bytes ? dev_alloc(dev[i].p, dev[i].bytes, dev[i].what, msg, msg_len) : 0;
        if (rc != QL_OK)
            return rc;
    }
    struct {
        void *p;
        size_t bytes;
    } host[] = {
        {&c->h_tokens, T * sizeof(int32_t)},   {&c->h_row_seq, T * sizeof(int32_t)},
        {&c->h_row_pos, T * sizeof(int32_t)},  {&c->h_bt_offset, S * sizeof(int32_t)},
        {&c->h_greedy, S * sizeof(int32_t)},   {&c->h_cos, T * half * sizeof(float)},
        {&c->h_sin, T * half * sizeof(float)}, {&c->h_inv_t, S * sizeof(float)},
        {&c->h_u, S * sizeof(double)},
    };
    for (size_t i = 0; i < sizeof host / sizeof *host; i++) {
        int rc = host_alloc(host[i].p, host[i].bytes, "the step's layout", msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    c->seq_row = malloc(S * sizeof(int64_t));
    c->inv_freq = malloc(2 * half * sizeof(double));
    if (!c->seq_row || !c->inv_freq)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    eng_rope_inv_freq(cfg, false, c->inv_freq);
    eng_rope_inv_freq(cfg, true, c->inv_freq + half);
    if (cfg->rope_local_theta > 0.0f) { /* Gemma 3's sliding layers */
        /* (eng_rope_inv_freq_local fills head_dim / 2) */
        size_t n_local =
                   (size_t)cfg->head_dim / 2 > half_local ? (size_t)cfg->head_dim / 2 : half_local,
               bytes = T * half_local * sizeof(float);
        c->inv_freq_local = malloc(n_local * sizeof(double));
        if (!c->inv_freq_local)
            return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        eng_rope_inv_freq_local(cfg, c->inv_freq_local);
        int lrc = dev_alloc(&c->d_cos_local, bytes, "the step's layout", msg, msg_len);
        lrc = lrc ? lrc : dev_alloc(&c->d_sin_local, bytes, "the step's layout", msg, msg_len);
        lrc = lrc ? lrc : host_alloc(&c->h_cos_local, bytes, "the step's layout", msg, msg_len);
        lrc = lrc ? lrc : host_alloc(&c->h_sin_local, bytes, "the step's layout", msg, msg_len);
        if (lrc != QL_OK)
            return lrc;
    }

    /* the KV cache: bookkeeping on the host, the arena here (its kernels
     * read and write f32 only) */
    if (o->kv_dtype != QT_F32)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "--kv-dtype %s: the CUDA backend keeps its KV cache in f32 only (give "
                       "--kv-dtype f32, or --device cpu)",
                       qt_kind_name(o->kv_dtype));
    /* a hybrid model's recurrent states: one for each sequence a step may
     * carry, as the CPU backend, out of the same bytes */
    int rc = eng_kv_new_meta(&c->base.kv, cfg, o->kv_bytes, o->block_tokens,
                             o->max_seqs > 0 ? o->max_seqs : ENG_KV_DEFAULT_STATES, msg, msg_len);
    if (rc == QL_OK)
        rc = allocate_hybrid(c, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    c->kv = (qt_cuda_kv){.block_tokens = eng_kv_block_tokens(c->base.kv),
                         .n_layers = c->base.kv->n_layers, /* a hybrid model's full layers */
                         .kv_dim = c->base.kv->kv_dim,     /* a layer's own: layer_cache */
                         .block_floats = eng_kv_block_floats(c->base.kv)};
    size_t arena = (size_t)eng_kv_total_blocks(c->base.kv) * c->kv.block_floats * sizeof(float);
    rc = dev_alloc(&c->kv.arena, arena, "the KV cache (lower --kv-cache-bytes)", msg, msg_len);
    if (rc != QL_OK)
        return rc;

    /* cuBLASLt: scratch for the largest weight, dequantized */
    int64_t biggest = (int64_t)V * (int64_t)H;
    if ((int64_t)(P * L) * (int64_t)H > biggest) /* Gemma 4's per_layer_model_projection */
        biggest = (int64_t)(P * L) * (int64_t)H;
    for (int32_t l = 0; l < cfg->n_layers; l++)
        for (int p = 0; p < c->n_proj; p++) {
            const qtensor *t = eng_model_proj(m, l, (eng_proj)p);
            if (t->rows * t->cols > biggest)
                biggest = t->rows * t->cols;
        }
    const char *gemm = getenv("QLSERVE_CUDA_GEMM");
    qt_cuda_gemm_type type = QT_CUDA_GEMM_F32;
    if (gemm && strcmp(gemm, "bf16") == 0)
        type = QT_CUDA_GEMM_BF16;
    else if (gemm && *gemm && strcmp(gemm, "f32") != 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "QLSERVE_CUDA_GEMM=\"%s\": expected f32 or bf16",
                       gemm);
    char why[256];
    rc = qt_cuda_blas_new(&c->blas, biggest, (int64_t)T > (int64_t)S ? (int64_t)T : (int64_t)S,
                          (int64_t)wide, type, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, device_code(rc), "cuda: cuBLASLt: %s", why);
    return QL_OK;
}

/* A mixture of experts' scratch (moe_scratch), sized for the largest
 * step; nothing for a dense model. */
static int allocate_moe_scratch(cuda_backend *c, char *msg, size_t msg_len)
{
    const eng_config *cfg = &c->base.m->cfg;
    moe_scratch *s = &c->moe;
    if (cfg->n_experts <= 0)
        return QL_OK;
    size_t T = (size_t)c->max_tokens, E = (size_t)cfg->n_experts, K = (size_t)cfg->n_experts_used,
           H = (size_t)cfg->hidden_size;
    size_t F =
        (size_t)(cfg->expert_ff > cfg->shared_expert_ff ? cfg->expert_ff : cfg->shared_expert_ff);
    const char *what = "the mixture of experts' scratch";
    struct {
        void *p;
        size_t bytes;
    } dev[] =
        {
            {&s->d_logits, T * (E + 1) * sizeof(float)},
            {&s->xg, T * H * sizeof(float)},
            {&s->yg, T * H * sizeof(float)},
            {&s->gg, T * F * sizeof(float)},
            {&s->ug, T * F * sizeof(float)},
            {&s->d_order, T * K * sizeof(int32_t)},
            {&s->d_weight, T * (K + 1) * sizeof(float)},
        },
      host[] = {
          {&s->h_logits, T * (E + 1) * sizeof(float)},
          {&s->h_order, T * K * sizeof(int32_t)},
          {&s->h_weight, T * (K + 1) * sizeof(float)},
      };
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++) {
        int rc = dev_alloc(dev[i].p, dev[i].bytes, what, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    for (size_t i = 0; i < sizeof host / sizeof *host; i++) {
        int rc = host_alloc(host[i].p, host[i].bytes, what, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    s->pick = malloc(T * K * sizeof *s->pick);
    s->weight = malloc(T * K * sizeof *s->weight);
    s->count = malloc((E + 1) * sizeof *s->count);
    s->first = malloc((E + 1) * sizeof *s->first);
    s->runs = malloc(T * K * sizeof *s->runs);
    if (!s->pick || !s->weight || !s->count || !s->first || !s->runs)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    return QL_OK;
}

/* The last step's mixture-of-experts figures (eng_backend_moe_step). */
static void cuda_moe_step(const eng_backend *b, uint64_t *experts, uint64_t *bytes)
{
    const cuda_backend *c = (const cuda_backend *)b;
    *experts = c->moe.ran;
    *bytes = c->moe.bytes;
}

int eng_backend_cuda_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o,
                         char *msg, size_t msg_len)
{
    *out = NULL;
    const eng_config *cfg = &m->cfg;
    char why[256];
    int n = 0;
    int qrc = qt_cuda_device_count(&n, why, sizeof why);
    if (qrc != QL_OK || n < 1)
        return ql_fail(msg, msg_len, QL_EDEVICE, "device cuda: no usable CUDA device (%s)", why);
    /* every layer's head (Gemma 4's full layers: global_head_dim) */
    for (int32_t l = 0; l < cfg->n_layers; l++) {
        int32_t d = eng_layer_head_dim(cfg, l);
        if (d > 512 || d % 2)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "head_dim %d (layer %d): the CUDA attention takes even head sizes up "
                           "to 512; use --device cpu",
                           d, l);
    }
    cuda_backend *c = calloc(1, sizeof *c);
    if (!c)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    c->base.device = ENG_DEVICE_CUDA;
    c->base.m = m;
    c->base.forward = cuda_forward;
    c->base.copy_blocks = cuda_copy_blocks;
    c->base.destroy = cuda_destroy;
    c->base.digest = cuda_digest;
    c->base.prepare = cuda_prepare;
    c->base.moe_step = cuda_moe_step;
    c->base.draws = true;
    c->n_proj = eng_n_proj(cfg);
    c->max_tokens = o->max_tokens > 0 ? o->max_tokens : 256;
    c->max_seqs = o->max_seqs > 0 ? o->max_seqs : 64;
    c->max_rank = 256; /* qt_cuda_sgmv's bound */
    int rc = QL_OK;
    cudaError_t st = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (st != cudaSuccess)
        rc = cuda_fail(st, msg, msg_len, "creating a stream");
    if (rc == QL_OK)
        rc = upload_model(c, msg, msg_len);
    if (rc == QL_OK)
        rc = allocate_run_state(c, o, msg, msg_len);
    if (rc == QL_OK)
        rc = allocate_moe_scratch(c, msg, msg_len);
    if (rc != QL_OK) {
        cuda_destroy(&c->base);
        return rc;
    }
    struct cudaDeviceProp prop = {0};
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess)
        snprintf(prop.name, sizeof prop.name, "device %d", dev);
    snprintf(c->base.describe, sizeof c->base.describe,
             "cuda (%.160s, sm_%d%d, %.2f GiB of weights)", prop.name, prop.major, prop.minor,
             (double)c->weight_bytes / (1024.0 * 1024 * 1024));
    *out = &c->base;
    return QL_OK;
}

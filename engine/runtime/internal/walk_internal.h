/*
 * walk_internal.h - the one walk over a decoder's layers (walk.c's
 * eng_walk) and what a backend hands it: a row of operations
 * (eng_walk_ops: rmsnorm, project, rope, attend, ...), its buffers and its
 * per-layer table (eng_walk_layer). Included by walk.c and by the backends
 * that fill a row in: forward.c (the CPU: host memory, the worker pool)
 * and backend_cuda.c (device memory, kernels on a stream). Nothing outside
 * engine/runtime/ includes it.
 *
 * Why shaped so: the walk was written once per backend, and every
 * architecture feature (Gemma's sandwich norms, Qwen3's q/k norms) landed
 * twice and could drift. Now a backend says how to do each step on its
 * memory, and the walk alone says which steps a layer takes; an
 * architecture's features are data it reads (the config, eng_walk_layer),
 * never a path of a backend's own.
 *
 * Buffers are the backend's: host float * on the CPU, device pointers on
 * CUDA. The walk only does arithmetic on them as addresses (a row's
 * offset) and passes them back to the operations; it never reads one.
 */
#ifndef QL_WALK_INTERNAL_H
#define QL_WALK_INTERNAL_H

#include "runtime.h"

/* Which rotation table a layer's RoPE uses. */
enum {
    ENG_WALK_ROPE_GLOBAL = 0,
    ENG_WALK_ROPE_LOCAL = 1, /* Gemma 3's sliding layers */
    ENG_WALK_ROPE_NONE = 2,  /* SmolLM3's NoPE layers: q and k as projected */
};

/* One layer as the walk reads it: the backend's copies of its small
 * parameters (f32, in the backend's memory; NULL where the architecture has
 * none) and its shape (eng_walk_layer_shape fills window and rope). */
typedef struct eng_walk_layer {
    const float *attn_norm, *ffn_norm;           /* [hidden], offset folded in; NULL: none */
    const float *bias;                           /* [q + 2 kv]: q, k, v side by side (Qwen2) */
    const float *o_bias;                         /* [hidden]: the output projection's (GPT-OSS) */
    const float *sinks;                          /* [n_heads]: attention sinks (GPT-OSS) */
    const float *q_norm, *k_norm;                /* [head_dim] (Qwen3), the projection's (OLMo 3) */
    const float *v_norm;                         /* [head_dim] of ones (Gemma 4) */
    const float *post_attn_norm, *post_ffn_norm; /* [hidden] (Gemma's sandwich, OLMo 3) */
    const float *ple_norm; /* [hidden]: Gemma 4's post_per_layer_input_norm; NULL: none */
    /* Gemma 4's MoE block beside the MLP ([hidden] each, NULL: none): the
     * MLP's output norm, the router's input norm (router.scale over
     * sqrt(hidden)), the experts' input and output norms */
    const float *mlp_post_norm, *router_norm, *moe_pre_norm, *moe_post_norm;
    int32_t window; /* sliding window in positions; 0: all */
    int rope;       /* ENG_WALK_ROPE_* */
    bool moe;       /* the MLP is a mixture of experts (eng_layer_is_moe): ops.moe */
    bool k_is_v;    /* the values are k's projection (eng_layer_k_is_v; Gemma 4) */
    bool linear;    /* a Gated DeltaNet layer (Qwen3.5, hybrid.h): ops.delta_net, no attention */
    int64_t ff;     /* the MLP's width (eng_layer_ff) */
    /* its head size and kv heads (eng_layer_head_dim, eng_layer_kv_heads:
     * Gemma 4's full layers have their own) */
    int32_t head_dim, kv_heads;
} eng_walk_layer;

/* Layer l's window and rotation table under config c: a sliding layer
 * (eng_layer_slides) sees its last sliding_window positions and, where the
 * model has rope_local_theta (Gemma 3), rotates with the local table; a
 * layer that does not rotate (eng_layer_rotates) has none; its MLP's
 * width, whether its values are its keys' projection, its head size and
 * kv heads. */
void eng_walk_layer_shape(const eng_config *c, int32_t l, eng_walk_layer *out);

/*
 * A backend's row of operations. Each takes the backend's context (be, as
 * eng_walk_backend.be) first and returns QL_OK or a negative code with a
 * sentence in msg. "The step's rows" are the rows begin laid out; an
 * operation may enqueue its work (CUDA) as long as later operations see
 * its result, and deliver returns only once the step is done.
 */
typedef struct eng_walk_ops {
    /* lay out the step's rows: each row's token, sequence, position and
     * rotations, the versions and adapters the sequences compute with
     * (adapters up to max_rank) */
    int (*begin)(void *be, const eng_step_seq *seqs, int32_t n_seqs, int64_t rows, int64_t max_rank,
                 char *msg, size_t msg_len);
    /* x[r] = the embedding of row r's token, for the step's rows */
    int (*embed)(void *be, float *x, char *msg, size_t msg_len);
    /* v[i] *= s for i < n */
    int (*scale)(void *be, float *v, int64_t n, float s, char *msg, size_t msg_len);
    /* out = x / rms(x) * w per row of n (out may be x) */
    int (*rmsnorm)(void *be, float *out, const float *x, const float *w, int64_t rows, int64_t n,
                   float eps, char *msg, size_t msg_len);
    /* y = x @ W^T for layer l's projection p, each sequence on its own
     * weight version, with its unmerged adapters, for the step's rows */
    int (*project)(void *be, int32_t l, eng_proj p, const float *x, float *y, char *msg,
                   size_t msg_len);
    /* y[r] += bias per row of n */
    int (*add_bias)(void *be, float *y, const float *bias, int64_t rows, int64_t n, char *msg,
                    size_t msg_len);
    /* rotate n_heads heads of head_dim of each of the step's rows by its
     * position, with rotation table `table` (ENG_WALK_ROPE_*; the global
     * one's pairs are eng_rope_dims', the local one's eng_rope_dims_local's) */
    int (*rope)(void *be, float *vec, int32_t n_heads, int32_t head_dim, int table, char *msg,
                size_t msg_len);
    /* the step's rows of k and v into layer l's KV cache (its row: the
     * layer's kv heads x head size) */
    int (*kv_write)(void *be, int32_t l, const float *k, const float *v, char *msg, size_t msg_len);
    /* out = grouped-query attention of q over layer l's cache, causal, over
     * the last `window` positions (0: all), scores times scale and
     * soft-capped at softcap (0: none); with sinks (NULL: none) head h's
     * softmax has one more term e^sinks[h] in its denominator, which takes
     * no value (GPT-OSS) */
    int (*attend)(void *be, int32_t l, const float *q, float *out, int32_t window, float scale,
                  float softcap, const float *sinks, char *msg, size_t msg_len);
    /* src's n rows of 2 d (Qwen3.5's q_proj: a head's query, then its
     * gate) into q's and gate's n rows of d */
    int (*split_gate)(void *be, const float *src, float *q, float *gate, int64_t n, int32_t d,
                      char *msg, size_t msg_len);
    /* x[i] *= sigmoid(gate[i]) for i < n */
    int (*gate_sigmoid)(void *be, float *x, const float *gate, int64_t n, char *msg,
                        size_t msg_len);
    /* out = layer l's Gated DeltaNet (hybrid.h) for the step's rows, from
     * x (the layer's normed input, for in_proj_b and in_proj_a), qkv
     * (in_proj_qkv's output, the conv's input: overwritten) and z
     * (in_proj_z's): the causal conv and the delta rule carried on from
     * each sequence's recurrent state (updated in place), one sequence's
     * rows in order; the gated norm. NULL in a backend that runs no hybrid
     * model (it refuses one when made). */
    int (*delta_net)(void *be, int32_t l, const float *x, float *qkv, const float *z, float *out,
                     char *msg, size_t msg_len);
    /* x[i] += y[i] for i < n */
    int (*add)(void *be, float *x, const float *y, int64_t n, char *msg, size_t msg_len);
    /* out = layer l's mixture of experts of x for the step's rows: the
     * router's chosen experts per row (eng_config's router, top-k,
     * norm_topk_prob), each chosen expert's GLU over the rows routed to it
     * (each expert's weights read once for all of them), summed with the
     * router's weights; plus Qwen2-MoE's shared expert, gated by
     * sigmoid(shared_gate . x). Experts are projections (eng_expert_proj):
     * each sequence's weight version and adapters apply to them. NULL in a
     * backend that runs no mixtures (it refuses such models when made).
     * router_x (NULL: x) is what the router reads (Gemma 4's MoE block:
     * the residual under its own norm, the experts another). */
    int (*moe)(void *be, int32_t l, const float *x, const float *router_x, float *out, char *msg,
               size_t msg_len);
    /* gate[i] = act(gate[i]) * up[i] for i < n (SwiGLU, GeGLU) */
    int (*glu)(void *be, float *gate, const float *up, int64_t n, eng_ffn_act act, char *msg,
               size_t msg_len);
    /* Gemma 4's per-layer inputs (NULL in a backend that runs none; it
     * refuses such models when made): out[r] = row r's token's row of
     * embed_tokens_per_layer (n_layers * ple_dim values), for the step's
     * rows */
    int (*embed_per_layer)(void *be, float *out, char *msg, size_t msg_len);
    /* out[r] = x[r] @ per_layer_model_projection^T (n_layers * ple_dim
     * values), for the step's rows */
    int (*project_per_layer)(void *be, const float *x, float *out, char *msg, size_t msg_len);
    /* gate[r * n + i] = act(gate[r * n + i]) * up[r * up_stride + i] for
     * r < rows, i < n: a layer's slice of each row's per-layer inputs */
    int (*glu_strided)(void *be, float *gate, const float *up, int64_t rows, int64_t n,
                       int64_t up_stride, eng_ffn_act act, char *msg, size_t msg_len);
    /* dst[i] = src[i] for i < n, both backend memory */
    int (*copy)(void *be, float *dst, const float *src, int64_t n, char *msg, size_t msg_len);
    /* logits[rows][vocab] = h @ head^T (lm_head, or the tied embeddings) */
    int (*classify)(void *be, const float *h, int64_t rows, float *logits, char *msg,
                    size_t msg_len);
    /* v[i] = cap * tanh(v[i] / cap) for i < n */
    int (*softcap)(void *be, float *v, int64_t n, float cap, char *msg, size_t msg_len);
    /* host[i] = src[i] for i < n: backend memory to the caller's */
    int (*to_host)(void *be, float *host, const float *src, int64_t n, char *msg, size_t msg_len);
    /* the step's result to the caller, the step done when it returns: the
     * logits of each sequence's last row (the classifier's output `out`)
     * into logits (host, n_seqs x vocab), and tokens (when not NULL) the
     * ones the backend chose itself, -1 where the caller samples */
    int (*deliver)(void *be, const float *out, float *logits, int32_t *tokens, char *msg,
                   size_t msg_len);
} eng_walk_ops;

/* A backend as the walk sees it; every pointer is borrowed for the step. */
typedef struct eng_walk_backend {
    const eng_walk_ops *ops;
    void *be; /* the backend's context, passed to every operation */
    const eng_model *m;
    eng_kv_cache *kv;   /* the block bookkeeping (the refusals read it) */
    int32_t max_tokens; /* the most rows a step may have */
    int32_t piece_rows; /* rows `last` and `logits` hold: every-row logits go in pieces */
    /* activations, backend memory, max_tokens rows (last: piece_rows) */
    float *x, *h, *q, *k, *v, *att, *gate, *up, *tmp, *last;
    /* Gemma 4's per-layer inputs, max_tokens rows of n_layers * ple_dim
     * (NULL when the model has none); tmp must hold as many per row */
    float *ple;
    /* Qwen3.5's (NULL for other models): a projection's output before it
     * is split (the gated q_proj; in_proj_qkv), and what gates the
     * mixer's output (the attention's gate; in_proj_z) */
    float *mix, *out_gate;
    /* backend memory for piece_rows rows of logits, or NULL: the backend's
     * memory is the host's, and the classifier writes into the caller's */
    float *logits;
    const eng_walk_layer *layers; /* [n_layers] */
    const float *final_norm;      /* [hidden] */
    const float *ple_norm;        /* [ple_dim]: per_layer_projection_norm (Gemma 4); or NULL */
} eng_walk_backend;

/*
 * One batched step over n_seqs sequences on backend b (eng_forward's
 * contract, runtime.h): the refusals of step.c and kv_cache.c, then the
 * layers, then the classifier; logits (host, n_seqs x vocab) gets each
 * sequence's last row, tokens (when not NULL) what deliver chose. On
 * success each sequence's cached positions grow by its new tokens.
 */
int eng_walk(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
             int32_t *tokens, char *msg, size_t msg_len);

#endif

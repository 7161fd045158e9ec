/*
 * forward_internal.h - what the CPU backend's files share: the per-step
 * scratch (eng_forward_state), the context every operation is handed
 * (cpu_step), and the products project_cpu.c offers the other two:
 * forward.c (the row of operations) and experts_cpu.c (the
 * mixture-of-experts step, which groups a step's rows by expert and runs
 * each chosen expert's projections through the same eng_cpu_project, so
 * adapters and weight versions apply to experts as to any projection);
 * and the operations forward.c's row takes from attend_cpu.c (attention)
 * and linear_cpu.c (Qwen3.5's linear layers). Included by those files only.
 */
#ifndef QL_FORWARD_INTERNAL_H
#define QL_FORWARD_INTERNAL_H

#include "runtime.h"
#include "walk_internal.h"

typedef struct eng_moe_state eng_moe_state;
typedef struct eng_linear_state eng_linear_state;
typedef struct eng_attn_scratch eng_attn_scratch;

struct eng_forward_state {
    int32_t max_tokens;
    /* activations, max_tokens rows each */
    float *x, *h, *q, *k, *v, *att, *gate, *up, *tmp; /* q, k, v: the widest layer's heads */
    float *last;      /* the last token's hidden state per sequence */
    int32_t *row_seq; /* which step sequence each row belongs to */
    int32_t *row_pos; /* its position */
    /* [max_tokens][eng_rope_dims / 2]: the main table, over the head of
     * the layers that rotate with it (Gemma 4's full layers' own) */
    float *rope_cos, *rope_sin;
    /* [2][eng_rope_head_dim / 2], scaling applied: the short set, then
     * longrope's long one (eng_step_seq.rope_long; the same numbers for
     * other ropes) */
    double *inv_freq;
    /* dense f32 copies of the small parameters, per layer */
    float *norms;      /* [n_layers][2][hidden]: attn, ffn (unset with post_norms) */
    float *final_norm; /* [hidden] */
    float *biases;     /* [n_layers][q + 2 kv] when attention_bias */
    float *qk_norms;   /* [n_layers][q, k, v: the widest layer's norm widths] when qk_norm */
    float *o_biases;   /* [n_layers][hidden] when o_bias (GPT-OSS) */
    float *sinks;      /* [n_layers][n_heads] when attn_sinks (GPT-OSS) */
    /* Gemma: the sandwich norms [n_layers][2][hidden] (after attention,
     * after the MLP; OLMo 3's post_norms too), and the sliding layers' own
     * rotation */
    float *post_norms;
    float *rope_cos_local, *rope_sin_local; /* [max_tokens][head_dim / 2] */
    double *inv_freq_local;                 /* [head_dim / 2] */
    /* Gemma 4's per-layer inputs [max_tokens][n_layers * ple_dim], and
     * the norms: [n_layers][hidden] after each layer's, then [ple_dim] */
    float *ple, *ple_norms;
    /* Gemma 4's MoE block: [n_layers][4][hidden] (eng_walk_layer's
     * mlp_post_norm, router_norm, moe_pre_norm, moe_post_norm) */
    float *moe_norms;
    /* unmerged adapters: rows gathered by adapter (grown on first use) */
    float *lora_x, *lora_y, *lora_u; /* [max_tokens][widest projection] */
    float *lora_t;                   /* [max_tokens][lora_rank] */
    int64_t lora_rank;               /* the rank lora_t holds */
    int64_t wide;                    /* the widest projection side */
    int64_t *seq_row;                /* [max_tokens]: each step sequence's first row */
    int32_t *seq_group;              /* [max_tokens]: its adapter group, or -1 */
    struct lora_row *lora_rows;      /* [max_tokens]: one term's rows on bf16 modules */
    eng_walk_layer *layers;          /* [n_layers]: the walk's view of the above */
    eng_moe_state *moe;              /* a mixture of experts' scratch (experts_cpu.c), or NULL */
    eng_linear_state *lin;           /* Qwen3.5's (linear_cpu.c), or NULL */
    eng_attn_scratch *attn;          /* attention's per-thread scratch (attend_cpu.c), or NULL */
    struct eng_stage_times *stages;  /* where each step's time goes (stages.h), or NULL */
};

/* The context of a step on the CPU: what every operation is handed. */
typedef struct cpu_step {
    eng_forward_state *st;
    const eng_model *m;
    eng_kv_cache *kv;
    eng_pool *pool;
    const eng_step_seq *seqs;
    int32_t n_seqs;
    int64_t rows;
} cpu_step;

/* --- project_cpu.c -------------------------------------------------------------- */

/* Room in st for the gathered rows of adapters up to `rank`. */
int eng_cpu_lora_scratch(eng_forward_state *st, int64_t rank);
/*
 * y[T][out] = x[T][in] @ W^T for layer l's projection p (an expert's too),
 * every sequence on its own weight version, then each sequence's unmerged
 * adapters; the rows are the n_seqs sequences' n_tokens in order.
 */
void eng_cpu_project(eng_forward_state *st, eng_pool *pool, const eng_model *m,
                     const eng_step_seq *seqs, int32_t n_seqs, int32_t l, eng_proj p,
                     const float *x, float *y);

/* --- experts_cpu.c ----------------------------------------------------------- */

/* A mixture of experts' scratch for steps of up to st->max_tokens rows,
 * into st->moe (NULL for a dense model); freed by eng_moe_state_free. */
int eng_moe_state_new(eng_forward_state *st, const eng_model *m);
void eng_moe_state_free(eng_moe_state *s);
/* The CPU's eng_walk_ops.moe: out = layer l's mixture of experts of x
 * for the step's rows (cpu_step be). */
int eng_cpu_moe(void *be, int32_t l, const float *x, const float *router_x, float *out, char *msg,
                size_t msg_len);

/* --- attend_cpu.c ------------------------------------------------------------ */

/* The CPU's eng_walk_ops.attend (cpu_step be): out = layer l's attention
 * of the step's rows q over their sequences' cached positions. Makes
 * st->attn on the first call (room per pool thread); QL_ENOMEM when it
 * cannot. */
int eng_cpu_attend(void *be, int32_t l, const float *q, float *out, int32_t window, float scale,
                   float softcap, const float *sinks, char *msg, size_t msg_len);
void eng_attn_scratch_free(eng_attn_scratch *s);

/* --- linear_cpu.c ------------------------------------------------------------- */

/* Qwen3.5's scratch and dense copies of its linear layers' small tensors,
 * into st->lin (NULL for a model without them); freed by
 * eng_linear_state_free. QL_ENOMEM (st->lin partly made) when out of
 * memory. */
int eng_linear_state_new(eng_forward_state *st, const eng_model *m);
void eng_linear_state_free(eng_linear_state *s);
/* Its buffers the walk hands the operations (eng_walk_backend's mix and
 * out_gate); NULL for NULL. */
float *eng_linear_mix(const eng_linear_state *s);
float *eng_linear_out_gate(const eng_linear_state *s);
/* The CPU's eng_walk_ops.split_gate, .gate_sigmoid and .delta_net
 * (cpu_step be). */
int eng_cpu_split_gate(void *be, const float *src, float *q, float *gate, int64_t n, int32_t d,
                       char *msg, size_t msg_len);
int eng_cpu_gate_sigmoid(void *be, float *x, const float *gate, int64_t n, char *msg,
                         size_t msg_len);
int eng_cpu_delta_net(void *be, int32_t l, const float *x, float *qkv, const float *z, float *out,
                      char *msg, size_t msg_len);

#endif

/*
 * forward.c - the CPU backend's forward pass on quantized weights, batched:
 * one step takes every running sequence's new tokens (a prefill chunk, or
 * one decode token) as the rows of one activation matrix, so each weight
 * matrix is read once per step for all of them. Attention reads the paged
 * KV cache directly through each sequence's block table.
 *
 * The walk over the layers is walk.c's eng_walk, shared with the CUDA
 * backend; this file is the CPU's row of its operations (cpu_ops: rmsnorm,
 * project with the step's adapters, rope, KV write, attention, ...) over
 * host memory. The matrix products (project_cpu.c) go through the
 * quant-kind traits table (qt_matmul), split by rows of the weight over the
 * worker pool; a mixture of experts' layer is experts_cpu.c's; attention
 * (over the paged cache, in f32, f16 or q8_0) is attend_cpu.c's.
 * Activations are f32. Immutable weights (eng_model), mutable per-step
 * scratch (eng_forward_state) and the KV cache are three separate things.
 *
 * It offers eng_forward_state_* and eng_forward (runtime.h); it owns the
 * per-step scratch; it touches the model's host
 * tensors (read only), the host KV arena through kv_cache_internal.h, the
 * worker pool and kernels/ (qt_matmul, qt_kv_store for a cache in f16 or
 * q8_0, ops_math.h), and takes the walk from walk.c and the rotary tables
 * from step.c.
 *
 * The adapters (project_cpu.c) differ from CUDA's in shape, not in
 * arithmetic: here the rows of every sequence applying one module are
 * gathered per projection (or, for bf16 modules, multiplied where they
 * lie); backend_cuda.c lays out SGMV segments once per step. Both are the
 * same sum per row, and tests/gpu/test_cuda_engine compares the two
 * backends' logits, tokens and merged digests.
 */
#include "runtime.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal/forward_internal.h"
#include "internal/kv_cache_internal.h"
#include "internal/step_internal.h"
#include "internal/walk_internal.h"
#include "ops_math.h"
#include "stages.h"

/* --- setup ------------------------------------------------------------------ */

/* A dense [1, n] parameter as f32. */
static void dense_row(const qtensor *t, float *out)
{
    qt_dequantize_rows(t, 0, 1, out);
}

/* A norm's weights as the pass multiplies by them: offset + w (Gemma's
 * folders keep w with the 1 left out; eng_config.norm_offset). */
static void norm_row(const qtensor *t, float offset, float *out)
{
    qt_dequantize_rows(t, 0, 1, out);
    for (int64_t i = 0; offset != 0.0f && i < t->cols; i++)
        out[i] = offset + out[i];
}

/* Gemma's extra state: the sandwich norms (OLMo 3's norms after attention
 * and the MLP too) and the sliding layers' rotary frequencies (each NULL
 * when the model has none). */
static int gemma_state_new(eng_forward_state *st, const eng_model *m)
{
    const eng_config *c = &m->cfg;
    size_t T = (size_t)st->max_tokens, H = (size_t)c->hidden_size, half = (size_t)c->head_dim / 2;
    if (c->sandwich_norms || c->post_norms) {
        st->post_norms = malloc((size_t)c->n_layers * 2 * H * sizeof(float));
        if (!st->post_norms)
            return QL_ENOMEM;
        for (size_t l = 0; l < (size_t)c->n_layers; l++) {
            norm_row(&m->layers[l].post_attn_norm, c->norm_offset, st->post_norms + 2 * l * H);
            norm_row(&m->layers[l].post_ffn_norm, c->norm_offset, st->post_norms + (2 * l + 1) * H);
        }
    }
    if (c->g4.ple_dim > 0) { /* Gemma 4's per-layer inputs and their norms */
        size_t P = (size_t)c->g4.ple_dim, L = (size_t)c->n_layers;
        st->ple = malloc(T * L * P * sizeof(float));
        st->ple_norms = malloc((L * H + P) * sizeof(float));
        if (!st->ple || !st->ple_norms)
            return QL_ENOMEM;
        for (size_t l = 0; l < L; l++)
            norm_row(&m->layers[l].g4.ple_norm, c->norm_offset, st->ple_norms + l * H);
        norm_row(&m->g4.ple_norm, c->norm_offset, st->ple_norms + L * H);
    }
    if (c->g4.moe_block) { /* Gemma 4's MoE block's norms, four a layer */
        st->moe_norms = malloc((size_t)c->n_layers * 4 * H * sizeof(float));
        if (!st->moe_norms)
            return QL_ENOMEM;
        for (size_t l = 0; l < (size_t)c->n_layers; l++) {
            const eng_gemma4_layer *g = &m->layers[l].g4;
            float *n = st->moe_norms + 4 * l * H;
            norm_row(&g->mlp_post_norm, c->norm_offset, n);
            norm_row(&g->router_scale, 0.0f, n + H);
            for (size_t i = 0; i < H; i++) /* transformers' scalar_root_size */
                n[H + i] *= (float)(1.0 / sqrt((double)H));
            norm_row(&g->moe_pre_norm, c->norm_offset, n + 2 * H);
            norm_row(&g->moe_post_norm, c->norm_offset, n + 3 * H);
        }
    }
    if (c->rope_local_theta > 0.0f) {
        st->rope_cos_local = malloc(T * half * sizeof(float));
        st->rope_sin_local = malloc(T * half * sizeof(float));
        st->inv_freq_local = malloc(half * sizeof(double));
        if (!st->rope_cos_local || !st->rope_sin_local || !st->inv_freq_local)
            return QL_ENOMEM;
        eng_rope_inv_freq_local(c, st->inv_freq_local);
    }
    return QL_OK;
}

/* Layer l's q, k and v norm widths into w (v: Gemma 4's weightless one,
 * 0 without): a head's (Gemma 4's full layers have their own head size),
 * or the projection's (OLMo 3); l < 0: the widest layer's, each layer's
 * room in qk_norms. */
static void norm_widths(const eng_config *c, int32_t l, size_t w[3])
{
    size_t d = (size_t)(l < 0 ? eng_max_head_dim(c) : eng_layer_head_dim(c, l));
    w[0] = c->qk_norm_whole ? (size_t)eng_qk_norm_width(c, false) : d;
    w[1] = c->qk_norm_whole ? (size_t)eng_qk_norm_width(c, true) : d;
    w[2] = c->v_norm ? d : 0;
}

/* Layer l as the walk reads it: pointers into the dense copies above. */
static void layer_view(eng_forward_state *st, const eng_config *c, int32_t l)
{
    size_t H = (size_t)c->hidden_size, i = (size_t)l,
           QKV = (size_t)c->n_heads * (size_t)eng_max_head_dim(c) + 2 * (size_t)eng_max_kv_dim(c);
    size_t wl[3], w[3];
    norm_widths(c, l, wl);
    norm_widths(c, -1, w);
    size_t qn = wl[0], kn = wl[1], vn = wl[2], stride = w[0] + w[1] + w[2];
    eng_walk_layer *ly = &st->layers[l];
    /* OLMo 3's layers have no norm before attention or the MLP */
    ly->attn_norm = c->post_norms ? NULL : st->norms + 2 * i * H;
    ly->ffn_norm = c->post_norms ? NULL : st->norms + (2 * i + 1) * H;
    ly->bias = st->biases ? st->biases + i * QKV : NULL;
    ly->o_bias = st->o_biases ? st->o_biases + i * H : NULL;
    ly->sinks = st->sinks ? st->sinks + i * (size_t)c->n_heads : NULL;
    ly->q_norm = st->qk_norms ? st->qk_norms + i * stride : NULL;
    ly->k_norm = st->qk_norms ? st->qk_norms + i * stride + qn : NULL;
    ly->v_norm = st->qk_norms && vn ? st->qk_norms + i * stride + qn + kn : NULL;
    ly->post_attn_norm = st->post_norms ? st->post_norms + 2 * i * H : NULL;
    ly->post_ffn_norm = st->post_norms ? st->post_norms + (2 * i + 1) * H : NULL;
    ly->ple_norm = st->ple_norms ? st->ple_norms + i * H : NULL;
    const float *mn = st->moe_norms ? st->moe_norms + 4 * i * H : NULL;
    ly->mlp_post_norm = mn;
    ly->router_norm = mn ? mn + H : NULL;
    ly->moe_pre_norm = mn ? mn + 2 * H : NULL;
    ly->moe_post_norm = mn ? mn + 3 * H : NULL;
    eng_walk_layer_shape(c, l, ly);
}

void eng_forward_state_free(eng_forward_state *st)
{
    if (!st)
        return;
    float *bufs[] = {st->x,
                     st->h,
                     st->q,
                     st->k,
                     st->v,
                     st->att,
                     st->gate,
                     st->up,
                     st->tmp,
                     st->last,
                     st->rope_cos,
                     st->rope_sin,
                     st->norms,
                     st->final_norm,
                     st->biases,
                     st->qk_norms,
                     st->o_biases,
                     st->sinks,
                     st->post_norms,
                     st->rope_cos_local,
                     st->rope_sin_local,
                     st->ple,
                     st->ple_norms,
                     st->moe_norms};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        free(bufs[i]);
    free(st->lora_x);
    free(st->lora_y);
    free(st->lora_u);
    free(st->lora_t);
    free(st->lora_rows);
    free(st->seq_row);
    free(st->seq_group);
    free(st->row_seq);
    free(st->row_pos);
    free(st->inv_freq);
    free(st->inv_freq_local);
    free(st->layers);
    eng_moe_state_free(st->moe);
    eng_linear_state_free(st->lin);
    eng_attn_scratch_free(st->attn);
    free(st);
}

int eng_forward_state_new(eng_forward_state **out, const eng_model *m, int32_t max_tokens,
                          char *msg, size_t msg_len)
{
    *out = NULL;
    const eng_config *c = &m->cfg;
    if (max_tokens <= 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "max tokens per step %d must be positive",
                       max_tokens);
    if (eng_max_head_dim(c) > 512)
        return ql_fail(msg, msg_len, QL_EINVAL, "head_dim %d: attention supports up to 512",
                       eng_max_head_dim(c));
    eng_forward_state *st = calloc(1, sizeof *st);
    if (!st)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    /* Gemma 4's full layers may have more (or larger) heads: the widest layer's */
    size_t T = (size_t)max_tokens, H = (size_t)c->hidden_size,
           Q = (size_t)c->n_heads * (size_t)eng_max_head_dim(c), KV = (size_t)eng_max_kv_dim(c),
           F = (size_t)c->intermediate_size, half = (size_t)eng_rope_head_dim(c) / 2,
           L = (size_t)c->n_layers;
    /* Gemma 4: a double-wide MLP's layers, the per-layer input gate's side
     * (ple_dim), and all layers' inputs (tmp holds their projection) */
    for (size_t l = 0; l < L; l++)
        F = (size_t)eng_layer_ff(c, (int32_t)l) > F ? (size_t)eng_layer_ff(c, (int32_t)l) : F;
    F = (size_t)c->g4.ple_dim > F ? (size_t)c->g4.ple_dim : F;
    F = c->g4.moe_block && H > F ? H : F; /* the MoE block's router input and output */
    size_t wide = F > Q ? F : Q;
    wide = (size_t)c->g4.ple_dim * L > wide ? (size_t)c->g4.ple_dim * L : wide;
    wide = wide > H ? wide : H;
    /* Qwen3.5: the gated q_proj, in_proj_qkv, the linear layers' values */
    const eng_linear_cfg *lc = &c->linear;
    size_t lin_v = (size_t)lc->n_v_heads * (size_t)lc->v_head_dim,
           lin_c = (size_t)eng_linear_conv_dim(lc), att = Q > lin_v ? Q : lin_v;
    if (lc->attn_output_gate)
        wide = 2 * Q > wide ? 2 * Q : wide;
    wide = lin_c > wide ? lin_c : wide;
    wide = lin_v > wide ? lin_v : wide;
    /* an expert's (or the shared expert's) side may be wider still */
    wide = (size_t)c->expert_ff > wide ? (size_t)c->expert_ff : wide;
    wide = (size_t)c->shared_expert_ff > wide ? (size_t)c->shared_expert_ff : wide;
    st->max_tokens = max_tokens;
    st->wide = (int64_t)wide;
    st->x = malloc(T * H * sizeof(float));
    st->h = malloc(T * H * sizeof(float));
    st->q = malloc(T * Q * sizeof(float));
    st->k = malloc(T * KV * sizeof(float));
    st->v = malloc(T * KV * sizeof(float));
    st->att = malloc(T * att * sizeof(float));
    st->gate = malloc(T * F * sizeof(float));
    st->up = malloc(T * F * sizeof(float));
    st->tmp = malloc(T * wide * sizeof(float));
    st->last = malloc(T * H * sizeof(float));
    st->row_seq = malloc(T * sizeof(int32_t));
    st->row_pos = malloc(T * sizeof(int32_t));
    st->seq_row = malloc(T * sizeof(int64_t));
    st->seq_group = malloc(T * sizeof(int32_t));
    st->rope_cos = malloc(T * half * sizeof(float));
    st->rope_sin = malloc(T * half * sizeof(float));
    st->inv_freq = malloc(2 * half * sizeof(double));
    st->norms = malloc(L * 2 * H * sizeof(float));
    st->final_norm = malloc(H * sizeof(float));
    st->biases = c->attention_bias ? malloc(L * (Q + 2 * KV) * sizeof(float)) : NULL;
    /* q's and k's norms, and Gemma 4's weightless v norm as ones */
    size_t nw[3];
    norm_widths(c, -1, nw);
    size_t qk_width = nw[0] + nw[1] + nw[2];
    st->qk_norms = c->qk_norm ? malloc(L * qk_width * sizeof(float)) : NULL;
    st->o_biases = c->o_bias ? malloc(L * H * sizeof(float)) : NULL;
    st->sinks = c->attn_sinks ? malloc(L * (size_t)c->n_heads * sizeof(float)) : NULL;
    st->layers = calloc(L, sizeof *st->layers);
    if (!st->layers || !st->x || !st->h || !st->q || !st->k || !st->v || !st->att || !st->gate ||
        !st->up || !st->tmp || !st->last || !st->row_seq || !st->row_pos || !st->seq_row ||
        !st->seq_group || !st->rope_cos || !st->rope_sin || !st->inv_freq || !st->norms ||
        !st->final_norm || (c->attention_bias && !st->biases) || (c->qk_norm && !st->qk_norms) ||
        (c->o_bias && !st->o_biases) || (c->attn_sinks && !st->sinks) ||
        gemma_state_new(st, m) != QL_OK || eng_moe_state_new(st, m) != QL_OK ||
        eng_linear_state_new(st, m) != QL_OK) {
        eng_forward_state_free(st);
        return ql_fail(msg, msg_len, QL_ENOMEM,
                       "cannot allocate activations for %d tokens per step", max_tokens);
    }
    eng_rope_inv_freq(c, false, st->inv_freq);
    eng_rope_inv_freq(c, true, st->inv_freq + half);
    for (size_t l = 0; l < L; l++) {
        if (!c->post_norms) {
            norm_row(&m->layers[l].attn_norm, c->norm_offset, st->norms + (2 * l) * H);
            norm_row(&m->layers[l].ffn_norm, c->norm_offset, st->norms + (2 * l + 1) * H);
        }
        if (c->attention_bias) {
            float *b = st->biases + l * (Q + 2 * KV);
            dense_row(&m->layers[l].bq, b);
            dense_row(&m->layers[l].bk, b + Q);
            dense_row(&m->layers[l].bv, b + Q + KV);
        }
        if (c->o_bias)
            dense_row(&m->layers[l].bo, st->o_biases + l * H);
        if (c->attn_sinks)
            dense_row(&m->layers[l].sinks, st->sinks + l * (size_t)c->n_heads);
        if (c->qk_norm && m->layers[l].q_norm.rows) { /* none on Qwen3.5's linear layers */
            float *qk = st->qk_norms + l * qk_width;
            norm_widths(c, (int32_t)l, nw);
            norm_row(&m->layers[l].q_norm, c->norm_offset, qk);
            if (m->layers[l].k_norm.rows) /* none on Gemma 4's kv-shared layers */
                norm_row(&m->layers[l].k_norm, c->norm_offset, qk + nw[0]);
            for (size_t e = 0; e < nw[2]; e++)
                qk[nw[0] + nw[1] + e] = 1.0f;
        }
        layer_view(st, c, (int32_t)l);
    }
    norm_row(&m->norm, c->norm_offset, st->final_norm);
    *out = st;
    return QL_OK;
}

/* --- the pieces -------------------------------------------------------------- */

/* out = x / rms(x) * weight, row by row (ops_math.h's arithmetic, which the
 * CUDA kernel runs too). */
static void rmsnorm(float *out, const float *x, const float *weight, int64_t rows, int64_t n,
                    float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++)
            ss = om_sumsq_add(ss, xr[i]);
        float scale = om_rmsnorm_scale(ss, n, eps);
        for (int64_t i = 0; i < n; i++)
            out[r * n + i] = om_rmsnorm_apply(xr[i], scale, weight[i]);
    }
}

/* Rotate pairs of q (n_heads) and k (n_kv heads) of d dims each, of each
 * row, by its position (cos_tab, sin_tab: [rows][half]): pairs (i, i + d/2)
 * as Hugging Face, or (2i, 2i + 1) as a llama GGUF stores its permuted
 * rows; with partial rotary (Phi-4-mini) only the leading rot dims, pairs
 * (i, i + rot/2), the rest passing through as transformers'
 * apply_rotary_pos_emb and ggml's neox rope leave them. */
static void rope(const eng_config *c, const float *cos_tab, const float *sin_tab, float *vec,
                 int32_t n_heads, int32_t d, int32_t half, int64_t rows)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *cs = cos_tab + r * half, *sn = sin_tab + r * half;
        for (int32_t hd = 0; hd < n_heads; hd++) {
            float *v = vec + (r * n_heads + hd) * d;
            for (int32_t i = 0; i < half; i++) {
                int32_t a, b;
                om_rope_pair(i, half, c->rope_interleaved, &a, &b);
                om_rope_rotate(&v[a], &v[b], cs[i], sn[i]);
            }
        }
    }
}

/*
 * The elementwise operations of a step (norms, gated activations, rotations,
 * residual adds) over the worker pool, split by rows (or, for the flat ones,
 * by runs of elements): each element's arithmetic is the same whichever
 * thread does it, so the split changes no bit. Done on the engine thread
 * alone they were a tenth of a batch-32 step on two threads, the other
 * thread spinning meanwhile (perf on the server at 32 streams: cpu_glu,
 * expf, cpu_rmsnorm, cpu_rope). Work under ELEMENTWISE_GRAIN elements
 * stays on the engine thread: handing it over would cost more than it.
 */
#define ELEMENTWISE_GRAIN 4096

typedef enum { EW_RMSNORM, EW_GLU, EW_ADD, EW_ROPE } ew_op;

typedef struct ew_job {
    ew_op op;
    float *out;
    const float *x, *w;
    int64_t n, up_stride; /* elements a row (the flat ones: 1); up's row stride (glu) */
    float eps;
    eng_ffn_act act;
    /* rope's */
    const eng_config *c;
    const float *cos_tab, *sin_tab;
    int32_t n_heads, d, half;
} ew_job;

/* Rows [begin, end) of the job (elements, for the flat ones). */
static void ew_rows(void *ctx, int64_t begin, int64_t end)
{
    const ew_job *j = ctx;
    int64_t n = j->n;
    switch (j->op) {
    case EW_RMSNORM:
        rmsnorm(j->out + begin * n, j->x + begin * n, j->w, end - begin, n, j->eps);
        break;
    case EW_GLU: /* gate (out) in rows of n, up in rows of up_stride */
        for (int64_t r = begin; r < end; r++)
            for (int64_t i = 0; i < n; i++) {
                float *g = j->out + r * n + i;
                float u = j->x[r * j->up_stride + i];
                *g = j->act == ENG_FFN_GELU_TANH ? om_geglu(*g, u) : om_swiglu(*g, u);
            }
        break;
    case EW_ADD:
        for (int64_t i = begin; i < end; i++)
            j->out[i] += j->x[i];
        break;
    case EW_ROPE:
        rope(j->c, j->cos_tab + begin * j->half, j->sin_tab + begin * j->half,
             j->out + begin * (int64_t)j->n_heads * j->d, j->n_heads, j->d, j->half, end - begin);
        break;
    }
}

/* The job's rows over the pool (rows of `width` elements each). */
static void ew_run(const cpu_step *cs, ew_job *j, int64_t rows, int64_t width)
{
    if (rows * width < ELEMENTWISE_GRAIN || rows < 2) {
        ew_rows(j, 0, rows);
        return;
    }
    int64_t grain = (ELEMENTWISE_GRAIN + width - 1) / width;
    eng_pool_run(cs->pool, ew_rows, j, rows, grain);
}

/* --- where the time goes (stages.h) ------------------------------------------ */

const char *const eng_stage_names[ENG_STAGE_COUNT] = {
    [ENG_STAGE_MATMUL] = "matmul",       [ENG_STAGE_LM_HEAD] = "lm_head",
    [ENG_STAGE_ATTENTION] = "attention", [ENG_STAGE_ELEMENTWISE] = "elementwise",
    [ENG_STAGE_KV_WRITE] = "kv_write",   [ENG_STAGE_EMBED] = "embed",
};

void eng_forward_time_stages(eng_forward_state *st, eng_stage_times *times)
{
    st->stages = times;
}

/* The clock at an operation's start, when the stages are timed (else 0). */
static int64_t stage_start(const void *be)
{
    return ((const cpu_step *)be)->st->stages ? ql_now_ns() : 0;
}

/* The operation begun at t0 ends: its time into stage s, when timed. */
static void stage_end(const void *be, eng_stage s, int64_t t0)
{
    eng_stage_times *times = ((const cpu_step *)be)->st->stages;
    if (times) {
        times->ns[s] += ql_now_ns() - t0;
        times->calls[s]++;
    }
}

/* --- the CPU row of operations (eng_walk_ops) -------------------------------- */

/* Each row's sequence, position and rotations, and room for the adapters. */
static int cpu_begin(void *be, const eng_step_seq *seqs, int32_t n_seqs, int64_t rows,
                     int64_t max_rank, char *msg, size_t msg_len)
{
    cpu_step *cs = be;
    eng_forward_state *st = cs->st;
    const eng_config *c = &cs->m->cfg;
    cs->seqs = seqs;
    cs->n_seqs = n_seqs;
    cs->rows = rows;
    if (max_rank > 0 && eng_cpu_lora_scratch(st, max_rank) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate adapter scratch for rank %lld",
                       (long long)max_rank);
    /* the main table's pairs (Gemma 4's full layers' head size), the
     * sliding layers' own (Gemma 3, 4) */
    int32_t rot_half = eng_rope_dims(c) / 2, local_half = eng_rope_dims_local(c) / 2;
    for (int32_t s = 0, r = 0; s < n_seqs; s++) {
        /* the sequence's one factor set (longrope's short or long) */
        const double *inv_freq = st->inv_freq + (seqs[s].rope_long ? eng_rope_head_dim(c) / 2 : 0);
        for (int32_t t = 0; t < seqs[s].n_tokens; t++, r++) {
            st->row_seq[r] = s;
            st->row_pos[r] = seqs[s].pos + t;
            eng_rope_row(inv_freq, rot_half, st->row_pos[r], eng_rope_attention_factor(c),
                         st->rope_cos + r * rot_half, st->rope_sin + r * rot_half);
            if (st->inv_freq_local)
                eng_rope_row(st->inv_freq_local, local_half, st->row_pos[r], 1.0,
                             st->rope_cos_local + r * local_half,
                             st->rope_sin_local + r * local_half);
        }
    }
    return QL_OK;
}

/* Each row's token's embedding, or the sequence's own input rows
 * (eng_step_seq.embeds: an MTP drafter's). */
static int cpu_embed(void *be, float *x, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    int64_t H = cs->m->cfg.hidden_size;
    for (int32_t s = 0, r = 0; s < cs->n_seqs; s++)
        for (int32_t t = 0; t < cs->seqs[s].n_tokens; t++, r++)
            if (cs->seqs[s].embeds)
                memcpy(x + r * H, cs->seqs[s].embeds + t * H, (size_t)H * sizeof(float));
            else
                qt_dequantize_rows(&cs->m->embed, cs->seqs[s].tokens[t], 1, x + r * H);
    stage_end(be, ENG_STAGE_EMBED, t0);
    return QL_OK;
}

/* Gemma 4: each row's token's row of embed_tokens_per_layer. */
static int cpu_embed_per_layer(void *be, float *out, char *msg, size_t msg_len)
{
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    int64_t n = cs->m->g4.ple_embed.cols;
    for (int32_t s = 0, r = 0; s < cs->n_seqs; s++)
        for (int32_t t = 0; t < cs->seqs[s].n_tokens; t++, r++)
            qt_dequantize_rows(&cs->m->g4.ple_embed, cs->seqs[s].tokens[t], 1, out + r * n);
    return QL_OK;
}

/* Gemma 4: the step's rows through per_layer_model_projection, over the pool. */
static int cpu_project_per_layer(void *be, const float *x, float *out, char *msg, size_t msg_len)
{
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    eng_cpu_matmul(cs->pool, &cs->m->g4.ple_proj, x, cs->rows, out);
    return QL_OK;
}

static int cpu_scale(void *be, float *v, int64_t n, float s, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)be, (void)msg, (void)msg_len;
    for (int64_t i = 0; i < n; i++)
        v[i] *= s;
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_rmsnorm(void *be, float *out, const float *x, const float *w, int64_t rows,
                       int64_t n, float eps, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    ew_job j = {.op = EW_RMSNORM, .out = out, .x = x, .w = w, .n = n, .eps = eps};
    ew_run(be, &j, rows, n);
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_project(void *be, int32_t l, eng_proj p, const float *x, float *y, char *msg,
                       size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    cpu_step *cs = be;
    eng_cpu_project(cs->st, cs->pool, cs->m, cs->seqs, cs->n_seqs, l, p, x, y);
    stage_end(be, ENG_STAGE_MATMUL, t0);
    return QL_OK;
}

static int cpu_add_bias(void *be, float *y, const float *bias, int64_t rows, int64_t n, char *msg,
                        size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)be, (void)msg, (void)msg_len;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] += bias[i];
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_rope(void *be, float *vec, int32_t n_heads, int32_t head_dim, int table, char *msg,
                    size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    const eng_forward_state *st = cs->st;
    const eng_config *c = &cs->m->cfg;
    bool local = table == ENG_WALK_ROPE_LOCAL;
    int32_t half = (local ? eng_rope_dims_local(c) : eng_rope_dims(c)) / 2;
    ew_job j = {.op = EW_ROPE,
                .out = vec,
                .c = c,
                .cos_tab = local ? st->rope_cos_local : st->rope_cos,
                .sin_tab = local ? st->rope_sin_local : st->rope_sin,
                .n_heads = n_heads,
                .d = head_dim,
                .half = half};
    ew_run(cs, &j, cs->rows, (int64_t)n_heads * head_dim);
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_kv_write(void *be, int32_t l, const float *k, const float *v, char *msg,
                        size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    const eng_kv_cache *kv = cs->kv;
    int64_t KV = kv->layer_dim[l];
    for (int64_t r = 0; r < cs->rows; r++) {
        const eng_step_seq *s = &cs->seqs[cs->st->row_seq[r]];
        int32_t pos = cs->st->row_pos[r];
        qt_kv_store(kv->dtype, k + r * KV, KV, kv_row(kv, s->kv->blocks, l, 0, pos));
        qt_kv_store(kv->dtype, v + r * KV, KV, kv_row(kv, s->kv->blocks, l, 1, pos));
    }
    stage_end(be, ENG_STAGE_KV_WRITE, t0);
    return QL_OK;
}

static int cpu_add(void *be, float *x, const float *y, int64_t n, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    ew_job j = {.op = EW_ADD, .out = x, .x = y, .n = 1};
    ew_run(be, &j, n, 1);
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_glu(void *be, float *gate, const float *up, int64_t n, eng_ffn_act act, char *msg,
                   size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    ew_job j = {.op = EW_GLU, .out = gate, .x = up, .n = 1, .up_stride = 1, .act = act};
    ew_run(be, &j, n, 1);
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_glu_strided(void *be, float *gate, const float *up, int64_t rows, int64_t n,
                           int64_t up_stride, eng_ffn_act act, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    ew_job j = {.op = EW_GLU, .out = gate, .x = up, .n = n, .up_stride = up_stride, .act = act};
    ew_run(be, &j, rows, n);
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

static int cpu_copy(void *be, float *dst, const float *src, int64_t n, char *msg, size_t msg_len)
{
    (void)be, (void)msg, (void)msg_len;
    if (dst != src)
        memcpy(dst, src, (size_t)n * sizeof(float));
    return QL_OK;
}

/* The classifier over the pool: lm_head, or the tied embeddings. */
static int cpu_classify(void *be, const float *h, int64_t rows, float *logits, char *msg,
                        size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)msg, (void)msg_len;
    const cpu_step *cs = be;
    const eng_model *m = cs->m;
    eng_cpu_matmul(cs->pool, m->lm_head.rows ? &m->lm_head : &m->embed, h, rows, logits);
    stage_end(be, ENG_STAGE_LM_HEAD, t0);
    return QL_OK;
}

static int cpu_softcap(void *be, float *v, int64_t n, float cap, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    (void)be, (void)msg, (void)msg_len;
    for (int64_t i = 0; i < n; i++)
        v[i] = om_softcap(v[i], cap);
    stage_end(be, ENG_STAGE_ELEMENTWISE, t0);
    return QL_OK;
}

/* The classifier wrote into the caller's logits already; the sampler
 * chooses every token. */
static int cpu_deliver(void *be, const float *out, float *logits, int32_t *tokens, char *msg,
                       size_t msg_len)
{
    const cpu_step *cs = be;
    for (int32_t s = 0; tokens && s < cs->n_seqs; s++)
        tokens[s] = -1;
    return cpu_copy(be, logits, out, cs->n_seqs * (int64_t)cs->m->cfg.vocab_size, msg, msg_len);
}

static int cpu_attend(void *be, int32_t l, const float *q, float *out, int32_t window, float scale,
                      float softcap, const float *sinks, char *msg, size_t msg_len)
{
    int64_t t0 = stage_start(be);
    int rc = eng_cpu_attend(be, l, q, out, window, scale, softcap, sinks, msg, msg_len);
    stage_end(be, ENG_STAGE_ATTENTION, t0);
    return rc;
}

static const eng_walk_ops cpu_ops = {
    .begin = cpu_begin,
    .embed = cpu_embed,
    .scale = cpu_scale,
    .rmsnorm = cpu_rmsnorm,
    .project = cpu_project,
    .add_bias = cpu_add_bias,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attend = cpu_attend,
    .split_gate = eng_cpu_split_gate,
    .gate_sigmoid = eng_cpu_gate_sigmoid,
    .delta_net = eng_cpu_delta_net,
    .add = cpu_add,
    .moe = eng_cpu_moe,
    .glu = cpu_glu,
    .embed_per_layer = cpu_embed_per_layer,
    .project_per_layer = cpu_project_per_layer,
    .glu_strided = cpu_glu_strided,
    .copy = cpu_copy,
    .classify = cpu_classify,
    .softcap = cpu_softcap,
    .to_host = cpu_copy,
    .deliver = cpu_deliver,
};

/* --- the step ---------------------------------------------------------------- */

int eng_forward(eng_forward_state *st, const eng_model *m, eng_kv_cache *kv, eng_pool *pool,
                const eng_step_seq *seqs, int32_t n_seqs, float *logits, char *msg, size_t msg_len)
{
    cpu_step cs = {.st = st, .m = m, .kv = kv, .pool = pool};
    eng_walk_backend b = {
        .ops = &cpu_ops,
        .be = &cs,
        .m = m,
        .kv = kv,
        .max_tokens = st->max_tokens,
        .piece_rows = st->max_tokens,
        .x = st->x,
        .h = st->h,
        .q = st->q,
        .k = st->k,
        .v = st->v,
        .att = st->att,
        .gate = st->gate,
        .up = st->up,
        .tmp = st->tmp,
        .last = st->last,
        .ple = st->ple,
        .mix = eng_linear_mix(st->lin),
        .out_gate = eng_linear_out_gate(st->lin),
        .logits = NULL, /* host memory: the classifier writes into the caller's */
        .layers = st->layers,
        .final_norm = st->final_norm,
        .ple_norm =
            st->ple_norms ? st->ple_norms + (size_t)m->cfg.n_layers * m->cfg.hidden_size : NULL,
    };
    // the one walk over the layers (walk.c)
    return eng_walk(&b, seqs, n_seqs, logits, NULL, msg, msg_len);
}

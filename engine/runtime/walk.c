/*
 * walk.c - the decoder forward pass as one walk over the layers, for every
 * backend (llama2.c's run.c is the model: top to bottom, one comment per
 * step naming the math). Each step is a call into the backend's row of
 * operations (internal/walk_internal.h): forward.c's for the CPU,
 * backend_cuda.c's for CUDA. What differs between architectures is data
 * read here: the config (embedding scale, activation, soft caps, eps) and
 * the backend's per-layer table (which norms and biases exist, the window,
 * the rotation table).
 *
 * It offers eng_walk and eng_walk_layer_shape; it owns nothing (every
 * buffer is the backend's); it calls step.c's refusals and kv_cache.c's
 * eng_kv_check_writes, and the operations it is given.
 *
 * An operation is an indirect call that returns a code: about twenty per
 * layer, against matrix products of millions of multiply-adds each, so the
 * CPU pays nothing measurable for sharing the walk (bench_decode before
 * and after: issue 31's closing note).
 */
#include "internal/walk_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal/kv_cache_internal.h"
#include "internal/step_internal.h"
#include "ops_math.h"

void eng_walk_layer_shape(const eng_config *c, int32_t l, eng_walk_layer *out)
{
    bool slides = eng_layer_slides(c, l);
    out->window = slides ? c->sliding_window : 0;
    out->rope = slides && c->rope_local_theta > 0.0f ? ENG_WALK_ROPE_LOCAL : ENG_WALK_ROPE_GLOBAL;
    if (!eng_layer_rotates(c, l))
        out->rope = ENG_WALK_ROPE_NONE;
    out->moe = eng_layer_is_moe(c, l);
    out->k_is_v = eng_layer_k_is_v(c, l);
    out->ff = eng_layer_ff(c, l);
    out->linear = eng_linear_is(&c->linear, l);
    out->head_dim = eng_layer_head_dim(c, l);
    out->kv_heads = eng_layer_kv_heads(c, l);
}

/* Llama 4's attention temperature for a query at position pos (eng_config's
 * attn_temp_beta; Ministral 3): 1 + beta ln(1 + floor(pos / floor_scale)),
 * 1 within the first period. */
static float query_temperature(const eng_config *c, int32_t pos)
{
    double periods = floor((double)pos / (double)c->attn_temp_floor);
    return (float)(1.0 + (double)c->attn_temp_beta * log(1.0 + periods));
}

/* Rows [r0, r1) of q times f (nothing to do when f is 1). */
static int scale_rows(const eng_walk_backend *b, float *q, int64_t r0, int64_t r1, float f,
                      char *msg, size_t msg_len)
{
    int64_t Q = (int64_t)b->m->cfg.n_heads * b->m->cfg.head_dim;
    if (f == 1.0f || r1 <= r0)
        return QL_OK;
    return b->ops->scale(b->be, q + r0 * Q, (r1 - r0) * Q, f, msg, msg_len);
}

/* Each query row of the step times its position's temperature, one call
 * per run of rows with one factor (rows are the sequences' tokens in
 * order, so a run is rarely split; rows within a first period have 1 and
 * are left alone). */
static int scale_queries(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs,
                         float *q, char *msg, size_t msg_len)
{
    int64_t r = 0, run0 = 0;
    float run_f = 1.0f;
    for (int32_t s = 0; s < n_seqs; s++)
        for (int32_t t = 0; t < seqs[s].n_tokens; t++, r++) {
            float f = query_temperature(&b->m->cfg, seqs[s].pos + t);
            if (f == run_f)
                continue;
            int rc = scale_rows(b, q, run0, r, run_f, msg, msg_len);
            if (rc != QL_OK)
                return rc;
            run0 = r;
            run_f = f;
        }
    return scale_rows(b, q, run0, r, run_f, msg, msg_len);
}

/* Gemma 4: the residual stream times layer l's layer_scalar (read from the
 * model's host copy each step: one float; nothing to do when it is 1). */
static int scale_layer_output(const eng_walk_backend *b, int32_t l, int64_t n, char *msg,
                              size_t msg_len)
{
    float s = 1.0f;
    qt_dequantize_rows(&b->m->layers[l].layer_scalar, 0, 1, &s);
    if (s == 1.0f)
        return QL_OK;
    return b->ops->scale(b->be, b->x, n, s, msg, msg_len);
}

/* Gemma 4's per-layer inputs of the step's T rows into b->ple (n_layers x
 * ple_dim per row), from x, the scaled embeddings, as transformers'
 * project_per_layer_inputs: (norm(x @ P^T / sqrt(hidden)) per layer's
 * slice + the token's row of the per-layer table times its scale) /
 * sqrt(2). b->tmp holds the projection meanwhile. */
static int per_layer_inputs(const eng_walk_backend *b, int64_t T, char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    const eng_config *c = &b->m->cfg;
    int64_t P = c->g4.ple_dim, n = T * c->n_layers * P;
    int rc = ops->embed_per_layer(b->be, b->ple, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->scale(b->be, b->ple, n, c->g4.ple_embed_scale, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->project_per_layer(b->be, b->x, b->tmp, msg, msg_len);
    if (rc == QL_OK)
        rc =
            ops->scale(b->be, b->tmp, n, (float)(1.0 / sqrt((double)c->hidden_size)), msg, msg_len);
    if (rc == QL_OK)
        rc = ops->rmsnorm(b->be, b->tmp, b->tmp, b->ple_norm, T * c->n_layers, P, c->rms_norm_eps,
                          msg, msg_len);
    if (rc == QL_OK)
        rc = ops->add(b->be, b->ple, b->tmp, n, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->scale(b->be, b->ple, n, (float)(1.0 / sqrt(2.0)), msg, msg_len);
    return rc;
}

/* Layer l's keys and values of the step's rows from its attention input
 * into b->k, b->v (kv: their values in all); Gemma 4's attention_k_eq_v
 * full layers take k's projection as their values. */
static int project_keys_values(const eng_walk_backend *b, int32_t l, const float *in, int64_t kv,
                               char *msg, size_t msg_len)
{
    int rc = b->ops->project(b->be, l, ENG_PROJ_K, in, b->k, msg, msg_len);
    if (rc == QL_OK && b->layers[l].k_is_v)
        return b->ops->copy(b->be, b->v, b->k, kv, msg, msg_len);
    return rc == QL_OK ? b->ops->project(b->be, l, ENG_PROJ_V, in, b->v, msg, msg_len) : rc;
}

/* Gemma 4: layer l's per-layer input added to the residual of the step's
 * T rows, as transformers' decoder layer: x += norm(per_layer_projection(
 * gelu_tanh(per_layer_input_gate(x)) * the layer's slice of b->ple)). */
static int add_per_layer_input(const eng_walk_backend *b, int32_t l, int64_t T, char *msg,
                               size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    const eng_config *c = &b->m->cfg;
    int64_t P = c->g4.ple_dim, H = c->hidden_size;
    int rc = ops->project(b->be, l, ENG_PROJ_PLE_GATE, b->x, b->gate, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->glu_strided(b->be, b->gate, b->ple + l * P, T, P, c->n_layers * P, c->ffn_act,
                              msg, msg_len);
    if (rc == QL_OK)
        rc = ops->project(b->be, l, ENG_PROJ_PLE_PROJ, b->gate, b->tmp, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->rmsnorm(b->be, b->tmp, b->tmp, b->layers[l].ple_norm, T, H, c->rms_norm_eps, msg,
                          msg_len);
    return rc == QL_OK ? ops->add(b->be, b->x, b->tmp, T * H, msg, msg_len) : rc;
}

/* Gemma 4's MoE block on layer l's T rows, beside the MLP whose output is
 * in b->tmp, as transformers' decoder layer: tmp = post_1(tmp) +
 * post_2(experts(pre_2(x)) routed by norm(x) * router.scale / sqrt(hidden)),
 * x the residual. b->h takes the experts' input, b->up the router's,
 * b->gate their output (each at least hidden wide in such a model). */
static int add_moe_block(const eng_walk_backend *b, int32_t l, int64_t T, char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    const eng_walk_layer *ly = &b->layers[l];
    int64_t H = b->m->cfg.hidden_size;
    float eps = b->m->cfg.rms_norm_eps;
    int rc = ops->rmsnorm(b->be, b->tmp, b->tmp, ly->mlp_post_norm, T, H, eps, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->rmsnorm(b->be, b->h, b->x, ly->moe_pre_norm, T, H, eps, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->rmsnorm(b->be, b->up, b->x, ly->router_norm, T, H, eps, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->moe(b->be, l, b->h, b->up, b->gate, msg, msg_len);
    if (rc == QL_OK)
        rc = ops->rmsnorm(b->be, b->gate, b->gate, ly->moe_post_norm, T, H, eps, msg, msg_len);
    return rc == QL_OK ? ops->add(b->be, b->tmp, b->gate, T * H, msg, msg_len) : rc;
}

/* A failure inside layer l (l < 0: around the layers): its code, with the
 * layer put before the operation's sentence. */
static int failed(int rc, int32_t l, char *msg, size_t msg_len)
{
    if (l >= 0 && msg && msg_len > 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", msg);
        snprintf(msg, msg_len, "layer %d: %s", l, why);
    }
    return rc;
}

#define OP(call)                                                                                   \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != QL_OK)                                                                          \
            return failed(rc_, l, msg, msg_len);                                                   \
    } while (0)

/* A failure inside a layer's block: its code as it is (the walk's OP
 * names the layer). */
#define TRY(call)                                                                                  \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != QL_OK)                                                                          \
            return rc_;                                                                            \
    } while (0)

/*
 * Layer l's attention over attn_in, its output projection into b->tmp:
 * q, k, v (Gemma 4's kv-shared layers: q alone; its k_eq_v layers: k as
 * v), their biases and norms, RoPE, the cache write, attention, the
 * output gate (Qwen3.5), o_proj and its bias, the post-attention norm.
 */
static int attention_mixer(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs,
                           int64_t T, int32_t l, const float *attn_in, char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    void *be = b->be;
    const eng_config *c = &b->m->cfg;
    const eng_walk_layer *ly = &b->layers[l];
    /* the layer's own heads (Gemma 4's full layers: global_head_dim and
     * their kv heads) */
    int32_t hd = ly->head_dim, n_kv = ly->kv_heads;
    int64_t H = c->hidden_size, Q = (int64_t)c->n_heads * hd, KV = (int64_t)n_kv * hd;
    float eps = c->rms_norm_eps,
          scale = c->attn_scale > 0.0f ? c->attn_scale : om_attention_scale(hd);
    bool gated = c->linear.attn_output_gate;
    // qkv matmuls (Gemma 4's kv-shared layers: q alone; they attend over
    // an earlier layer's cache)
    int32_t kv_layer = eng_layer_kv_source(c, l);
    bool own = kv_layer == l;
    if (gated) { // Qwen3.5: each head's query, then its gate
        TRY(ops->project(be, l, ENG_PROJ_Q, attn_in, b->mix, msg, msg_len));
        TRY(ops->split_gate(be, b->mix, b->q, b->out_gate, T * c->n_heads, hd, msg, msg_len));
    } else {
        TRY(ops->project(be, l, ENG_PROJ_Q, attn_in, b->q, msg, msg_len));
    }
    // (Gemma 4's attention_k_eq_v full layers: the values are k's projection)
    if (own)
        TRY(project_keys_values(b, l, attn_in, T * KV, msg, msg_len));
    // Qwen2's q, k and v biases
    if (ly->bias) {
        TRY(ops->add_bias(be, b->q, ly->bias, T, Q, msg, msg_len));
        TRY(ops->add_bias(be, b->k, ly->bias + Q, T, KV, msg, msg_len));
        TRY(ops->add_bias(be, b->v, ly->bias + Q + KV, T, KV, msg, msg_len));
    }
    // q and k through their RMSNorms: OLMo 3's each row whole, Qwen3's
    // per head (a head is a row); Gemma 4's weightless one on each head of v
    if (ly->q_norm)
        TRY(ops->rmsnorm(be, b->q, b->q, ly->q_norm, c->qk_norm_whole ? T : T * c->n_heads,
                         c->qk_norm_whole ? Q : hd, eps, msg, msg_len));
    if (ly->k_norm && own)
        TRY(ops->rmsnorm(be, b->k, b->k, ly->k_norm, c->qk_norm_whole ? T : T * n_kv,
                         c->qk_norm_whole ? KV : hd, eps, msg, msg_len));
    if (ly->v_norm && own)
        TRY(ops->rmsnorm(be, b->v, b->v, ly->v_norm, T * n_kv, hd, eps, msg, msg_len));
    // RoPE (Gemma 3's sliding layers with their own table; none on
    // SmolLM3's NoPE layers)
    if (ly->rope != ENG_WALK_ROPE_NONE) {
        TRY(ops->rope(be, b->q, c->n_heads, hd, ly->rope, msg, msg_len));
        if (own)
            TRY(ops->rope(be, b->k, n_kv, hd, ly->rope, msg, msg_len));
    }
    // Llama 4's temperature: each query times its position's factor (Ministral 3)
    if (c->attn_temp_beta > 0.0f)
        TRY(scale_queries(b, seqs, n_seqs, b->q, msg, msg_len));
    // K and V into the paged cache, all rows first so a prefill chunk sees itself
    if (own)
        TRY(ops->kv_write(be, l, b->k, b->v, msg, msg_len));
    // grouped-query attention, causal, over the paged cache (the window on
    // sliding layers, Gemma 2's soft-capped scores, GPT-OSS's sinks)
    TRY(ops->attend(be, kv_layer, b->q, b->att, ly->window, scale, c->attn_softcap, ly->sinks, msg,
                    msg_len));
    // Qwen3.5's output gate: times sigmoid(gate)
    if (gated)
        TRY(ops->gate_sigmoid(be, b->att, b->out_gate, T * Q, msg, msg_len));
    // output projection (GPT-OSS's bias)
    TRY(ops->project(be, l, ENG_PROJ_O, b->att, b->tmp, msg, msg_len));
    if (ly->o_bias)
        TRY(ops->add_bias(be, b->tmp, ly->o_bias, T, H, msg, msg_len));
    // Gemma's and OLMo 3's post-attention norm
    if (ly->post_attn_norm)
        TRY(ops->rmsnorm(be, b->tmp, b->tmp, ly->post_attn_norm, T, H, eps, msg, msg_len));
    return QL_OK;
}

/*
 * Layer l's Gated DeltaNet over attn_in (Qwen3.5's linear attention,
 * hybrid.h), its out_proj into b->tmp: in_proj_qkv and in_proj_z as
 * projections (adapters apply to them), then the backend's delta_net (the
 * causal conv, the delta rule over each sequence's recurrent state, the
 * gated norm).
 */
static int linear_mixer(const eng_walk_backend *b, int32_t l, const float *attn_in, char *msg,
                        size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    void *be = b->be;
    // in_proj_qkv (the conv's q | k | v channels), in_proj_z (the norm's gate)
    TRY(ops->project(be, l, ENG_PROJ_Q, attn_in, b->mix, msg, msg_len));
    TRY(ops->project(be, l, ENG_PROJ_K, attn_in, b->out_gate, msg, msg_len));
    // conv1d + silu, l2-normed q and k, the gated delta rule, the gated RMSNorm
    TRY(ops->delta_net(be, l, attn_in, b->mix, b->out_gate, b->att, msg, msg_len));
    // out_proj
    TRY(ops->project(be, l, ENG_PROJ_O, b->att, b->tmp, msg, msg_len));
    return QL_OK;
}

/* How many sequences at the head of the step form one run of end-to-end
 * all_logits buffers whose last rows every_row_logits gives as well (the
 * step's drafting sequences, which the scheduler puts first): only where
 * the classifier writes host memory (the caller's logits), which the rows
 * are copied into; 0 elsewhere. */
static int32_t head_run(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs)
{
    int64_t V = b->m->cfg.vocab_size;
    if (b->logits || n_seqs == 0 || !seqs[0].all_logits)
        return 0;
    int32_t end = 1;
    while (end < n_seqs &&
           seqs[end].all_logits == seqs[end - 1].all_logits + seqs[end - 1].n_tokens * V)
        end++;
    return end;
}

/*
 * The logits of every new row but the last of each sequence that asks
 * (eng_step_seq.all_logits: a prompt's logprobs, speculative decoding's
 * verification), in pieces of piece_rows rows; the last row is the step's
 * own, copied in once it is delivered. Sequences next to each other in the
 * step whose buffers lie end to end (the scheduler packs a step's drafting
 * sequences so) are one run: their rows, the inner last rows too, go
 * through the classifier together, so the step reads the classifier's
 * weights once for all of them rather than once per sequence. The run of
 * the first head sequences (head_run) takes its last row too: the step's
 * classifier then skips them. Each row's arithmetic is the batch's, so it
 * is the same bits as a step of that row alone (an inner last row is
 * overwritten with the very same bits).
 */
static int every_row_logits(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs,
                            int32_t head, char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    const eng_config *c = &b->m->cfg;
    int64_t H = c->hidden_size, V = c->vocab_size;
    int32_t l = -1;
    for (int32_t s = 0, r = 0; s < n_seqs;) {
        const eng_step_seq *q = &seqs[s];
        int64_t rows = q->n_tokens;
        int32_t end = s + 1;
        while (q->all_logits && end < n_seqs &&
               seqs[end].all_logits == seqs[end - 1].all_logits + seqs[end - 1].n_tokens * V)
            rows += seqs[end++].n_tokens;
        rows -= end != head; /* the run's last row is the step's own */
        for (int64_t j = 0; q->all_logits && j < rows; j += b->piece_rows) {
            int64_t n = rows - j < b->piece_rows ? rows - j : b->piece_rows;
            float *host = q->all_logits + j * V, *out = b->logits ? b->logits : host;
            // final rmsnorm, classifier (Gemma 2's soft cap), to the caller
            OP(ops->rmsnorm(b->be, b->last, b->x + (r + j) * H, b->final_norm, n, H,
                            c->rms_norm_eps, msg, msg_len));
            OP(ops->classify(b->be, b->last, n, out, msg, msg_len));
            if (c->final_softcap > 0.0f)
                OP(ops->softcap(b->be, out, n * V, c->final_softcap, msg, msg_len));
            if (out != host)
                OP(ops->to_host(b->be, host, out, n * V, msg, msg_len));
        }
        for (; s < end; s++)
            r += seqs[s].n_tokens;
    }
    return QL_OK;
}

/* Each row of a sequence that asks (eng_step_seq.hidden_out) after the
 * final rmsnorm, to its host buffer in pieces of piece_rows rows: the
 * hidden states an MTP drafter (mtp.h) takes in. */
static int hidden_rows(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs,
                       char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    const eng_config *c = &b->m->cfg;
    int64_t H = c->hidden_size;
    int32_t l = -1;
    for (int32_t s = 0, r = 0; s < n_seqs; r += seqs[s].n_tokens, s++) {
        const eng_step_seq *q = &seqs[s];
        for (int64_t j = 0; q->hidden_out && j < q->n_tokens; j += b->piece_rows) {
            int64_t n = q->n_tokens - j < b->piece_rows ? q->n_tokens - j : b->piece_rows;
            OP(ops->rmsnorm(b->be, b->last, b->x + (r + j) * H, b->final_norm, n, H,
                            c->rms_norm_eps, msg, msg_len));
            OP(ops->to_host(b->be, q->hidden_out + j * H, b->last, n * H, msg, msg_len));
        }
    }
    return QL_OK;
}

/* Input rows in place of token embeddings (eng_step_seq.embeds) only where
 * the embeddings are host memory (the CPU backend, whose logits are too). */
static int check_embeds(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs,
                        char *msg, size_t msg_len)
{
    for (int32_t s = 0; s < n_seqs && b->logits; s++)
        if (seqs[s].embeds)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "sequence %d: input rows in place of token embeddings run on the CPU "
                           "backend only",
                           s);
    return QL_OK;
}

/* The step's own logits into out (n_seqs x vocab): each sequence's last
 * row through the final rmsnorm and the classifier (Gemma 2's soft cap),
 * but the head run's (head_run), which every_row_logits gave already:
 * copied from their buffers (host memory both, as head_run asks). */
static int step_logits(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs,
                       int32_t head, float *out, char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    const eng_config *c = &b->m->cfg;
    int64_t H = c->hidden_size, V = c->vocab_size, rest = n_seqs - head;
    int32_t l = -1;
    for (int32_t s = 0, r = 0; s < n_seqs; s++) {
        r += seqs[s].n_tokens;
        if (s < head)
            memcpy(out + s * V, seqs[s].all_logits + (seqs[s].n_tokens - 1) * V,
                   (size_t)V * sizeof *out);
        else
            OP(ops->copy(b->be, b->tmp + (s - head) * H, b->x + (r - 1) * H, H, msg, msg_len));
    }
    if (rest == 0)
        return QL_OK;
    OP(ops->rmsnorm(b->be, b->last, b->tmp, b->final_norm, rest, H, c->rms_norm_eps, msg, msg_len));
    OP(ops->classify(b->be, b->last, rest, out + head * V, msg, msg_len));
    if (c->final_softcap > 0.0f)
        OP(ops->softcap(b->be, out + head * V, rest * V, c->final_softcap, msg, msg_len));
    return QL_OK;
}

int eng_walk(const eng_walk_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
             int32_t *tokens, char *msg, size_t msg_len)
{
    const eng_walk_ops *ops = b->ops;
    void *be = b->be;
    const eng_config *c = &b->m->cfg;
    int64_t T = 0, max_rank = 0;
    int rc = eng_step_check(b->m, b->kv, seqs, n_seqs, b->max_tokens, &T, &max_rank, msg, msg_len);
    if (rc == QL_OK)
        rc = eng_kv_check_writes(b->kv, seqs, n_seqs, msg, msg_len);
    if (rc == QL_OK)
        rc = check_embeds(b, seqs, n_seqs, msg, msg_len);
    /* last: it marks a hybrid model's recurrent states as being written */
    if (rc == QL_OK)
        rc = eng_kv_check_states(b->kv, seqs, n_seqs, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int64_t H = c->hidden_size;
    float eps = c->rms_norm_eps;
    int32_t l = -1;

    // each row's token, sequence, position and rotation; the step's adapters
    OP(ops->begin(be, seqs, n_seqs, T, max_rank, msg, msg_len));
    // token embeddings (Gemma: times sqrt(hidden))
    OP(ops->embed(be, b->x, msg, msg_len));
    if (c->embed_scale > 0.0f)
        OP(ops->scale(be, b->x, T * H, c->embed_scale, msg, msg_len));
    // Gemma 4's per-layer inputs: each layer's slice of every row
    if (c->g4.ple_dim > 0)
        OP(per_layer_inputs(b, T, msg, msg_len));

    for (l = 0; l < c->n_layers; l++) {
        const eng_walk_layer *ly = &b->layers[l];
        // attention rmsnorm (none in OLMo 3: the block reads the residual)
        const float *attn_in = ly->attn_norm ? b->h : b->x;
        if (ly->attn_norm)
            OP(ops->rmsnorm(be, b->h, b->x, ly->attn_norm, T, H, eps, msg, msg_len));
        // the token mixer into tmp: a linear layer's Gated DeltaNet (Qwen3.5),
        // else attention
        if (ly->linear)
            OP(linear_mixer(b, l, attn_in, msg, msg_len));
        else
            OP(attention_mixer(b, seqs, n_seqs, T, l, attn_in, msg, msg_len));
        // residual
        OP(ops->add(be, b->x, b->tmp, T * H, msg, msg_len));
        // ffn rmsnorm (none in OLMo 3)
        const float *ffn_in = ly->ffn_norm ? b->h : b->x;
        if (ly->ffn_norm)
            OP(ops->rmsnorm(be, b->h, b->x, ly->ffn_norm, T, H, eps, msg, msg_len));
        if (ly->moe && !ly->router_norm) {
            // mixture of experts: each row's top-k experts by the router, their
            // GLUs summed with the router's weights (Qwen2-MoE's gated shared
            // expert added)
            OP(ops->moe(be, l, ffn_in, NULL, b->tmp, msg, msg_len));
        } else {
            // GLU: act(gate(h)) * up(h), SwiGLU's silu or Gemma's GeGLU gelu_tanh
            OP(ops->project(be, l, ENG_PROJ_GATE, ffn_in, b->gate, msg, msg_len));
            OP(ops->project(be, l, ENG_PROJ_UP, ffn_in, b->up, msg, msg_len));
            OP(ops->glu(be, b->gate, b->up, T * ly->ff, c->ffn_act, msg, msg_len));
            // down projection
            OP(ops->project(be, l, ENG_PROJ_DOWN, b->gate, b->tmp, msg, msg_len));
        }
        // Gemma 4's MoE block: norm(MLP) + norm(experts of the residual)
        if (ly->router_norm)
            OP(add_moe_block(b, l, T, msg, msg_len));
        // Gemma's and OLMo 3's post-ffn norm
        if (ly->post_ffn_norm)
            OP(ops->rmsnorm(be, b->tmp, b->tmp, ly->post_ffn_norm, T, H, eps, msg, msg_len));
        // residual
        OP(ops->add(be, b->x, b->tmp, T * H, msg, msg_len));
        // Gemma 4's per-layer input: x += norm(proj(gelu_tanh(gate(x)) * the layer's slice))
        if (ly->ple_norm)
            OP(add_per_layer_input(b, l, T, msg, msg_len));
        // Gemma 4: the layer's output times its layer_scalar
        if (c->layer_scalar)
            OP(scale_layer_output(b, l, T * H, msg, msg_len));
    }
    l = -1;

    // each row's final-normed hidden state where a sequence asks (an MTP drafter's input)
    if ((rc = hidden_rows(b, seqs, n_seqs, msg, msg_len)) != QL_OK)
        return rc;
    // every-row logits where a sequence asks (before the step's own, whose
    // buffers they share)
    int32_t head = head_run(b, seqs, n_seqs);
    if ((rc = every_row_logits(b, seqs, n_seqs, head, msg, msg_len)) != QL_OK)
        return rc;
    // each sequence's last row: the final rmsnorm, the classifier
    float *out = b->logits ? b->logits : logits;
    if ((rc = step_logits(b, seqs, n_seqs, head, out, msg, msg_len)) != QL_OK)
        return rc;
    // the step's result to the caller
    OP(ops->deliver(be, out, logits, tokens, msg, msg_len));

    size_t V = (size_t)c->vocab_size;
    for (int32_t s = 0; s < n_seqs; s++) {
        const eng_step_seq *q = &seqs[s];
        // the last row of every-row logits is the step's own
        if (q->all_logits)
            memcpy(q->all_logits + (size_t)(q->n_tokens - 1) * V, logits + (size_t)s * V,
                   V * sizeof(float));
        // the sequence's cache now holds its new tokens
        int32_t end = q->pos + q->n_tokens;
        if (end > q->kv->n_tokens)
            q->kv->n_tokens = end;
    }
    // and a hybrid model's recurrent states have taken them in
    eng_kv_states_done(b->kv, seqs, n_seqs);
    return QL_OK;
}

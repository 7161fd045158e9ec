/*
 * ref_forward.h - the float64 reference forward pass the engine is tested
 * against (test_forward.c, test_lora_engine.c): the engine's weights
 * dequantized (qt_dequantize_rows), optionally a weight version's merged
 * projections in their place, and LoRA deltas added in float64; everything
 * else computed in double. See test_forward.c for the tolerance.
 */
#ifndef QL_REF_FORWARD_H
#define QL_REF_FORWARD_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "test_util.h"

#ifndef FWD_REL_TOL
#define FWD_REL_TOL 1e-5
#endif

/* --- the float64 reference ----------------------------------------------- */

typedef struct ref_layer {
    float *attn_norm, *ffn_norm;
    float *wq, *wk, *wv, *wo;
    float *bq, *bk, *bv; /* NULL when the model has none */
    float *w_gate, *w_up, *w_down;
    /* Gemma (NULL elsewhere): the per-head q/k norms [head_dim] (Gemma 3;
     * Qwen3's too), the sandwich norms after attention and after the MLP */
    float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm;
    double layer_scalar; /* Gemma 4: the layer's output times this (1 elsewhere) */
    /* Gemma 4's per-layer input gate [ple_dim, hidden], projection [hidden,
     * ple_dim] and norm [hidden] (NULL elsewhere) */
    float *ple_gate, *ple_proj, *ple_norm;
    /* Gemma 4's MoE block (NULL elsewhere): router.scale [hidden],
     * per_expert_scale [experts], the MLP's output norm, the experts' input
     * and output norms [hidden] */
    float *router_scale, *expert_scale, *mlp_post_norm, *moe_pre_norm, *moe_post_norm;
    /* a mixture of experts' layer (NULL elsewhere): the router [experts,
     * hidden], each expert's gate, up, down at [3e], [3e + 1], [3e + 2]
     * (eng_layer's order), Qwen2-MoE's shared expert gate [hidden] (its
     * shared expert is w_gate, w_up, w_down) */
    float *router, **experts, *shared_gate;
    /* LoRA deltas added in float64, [rows, cols] per projection, experts'
     * included (eng_n_proj entries; NULL: none) */
    double **delta;
} ref_layer;

/* Projection p's dequantized weight in r (borrowed from r). */
static inline const float *ref_proj(const ref_layer *r, eng_proj p)
{
    const float *w[ENG_PROJ_FIRST_EXPERT] = {r->wq,   r->wk,     r->wv,       r->wo,      r->w_gate,
                                             r->w_up, r->w_down, r->ple_gate, r->ple_proj};
    return w[p];
}

/* The model's weights dequantized to f32, row-major [rows, cols]. */
typedef struct ref_model {
    eng_config c;
    float *embed, *norm;
    float *lm_head; /* the embeddings when tied (then not owned) */
    ref_layer *layers;
    /* Gemma 4's per-layer inputs: the table [ple_vocab, n_layers * ple_dim],
     * the model's projection [n_layers * ple_dim, hidden] and its norm
     * [ple_dim] (NULL elsewhere) */
    float *ple_embed, *ple_model_proj, *ple_model_norm;
    /* longrope: the positions a pass is taken to reach (0, as ref_load sets
     * it: its tokens, as transformers switches on the length of a forward
     * call); past the original context, the long factors rotate them all */
    int32_t reserve;
} ref_model;

/* t dequantized, after checking it has the shape the config implies. NULL
 * for an absent tensor (rows 0) where absent is allowed. */
static inline float *ref_dequant(const qtensor *t, int64_t rows, int64_t cols, bool optional,
                                 const char *what, int layer)
{
    if (optional && t->rows == 0)
        return NULL;
    cr_assert_eq(t->rows, rows, "layer %d %s: %ld rows, the config says %ld", layer, what,
                 (long)t->rows, (long)rows);
    cr_assert_eq(t->cols, cols, "layer %d %s: %ld cols, the config says %ld", layer, what,
                 (long)t->cols, (long)cols);
    float *out = malloc((size_t)(rows * cols) * sizeof *out);
    cr_assert(out);
    qt_dequantize_rows(t, 0, rows, out);
    return out;
}

/* Layer l's config as its attention sees it: its own head_dim and
 * n_kv_heads (Gemma 4's full layers' global_head_dim and kv heads), so
 * the rotation, the norms and the heads' loops read one shape. */
static inline eng_config ref_layer_config(const eng_config *c, int32_t l)
{
    eng_config lc = *c;
    lc.head_dim = eng_layer_head_dim(c, l);
    lc.n_kv_heads = eng_layer_kv_heads(c, l);
    return lc;
}

/* The model as version w serves it (NULL: the model's own weights). */
static inline void ref_load_version(ref_model *R, const eng_model *m, const eng_weights *w)
{
    const eng_config *c = &m->cfg;
    int64_t H = c->hidden_size, V = c->vocab_size;
    R->c = *c;
    R->reserve = 0;
    R->embed = ref_dequant(&m->embed, V, H, false, "embed", -1);
    R->norm = ref_dequant(&m->norm, 1, H, false, "norm", -1);
    R->lm_head = ref_dequant(&m->lm_head, V, H, true, "lm_head", -1);
    cr_assert_eq(R->lm_head == NULL, c->tie_word_embeddings,
                 "lm_head is absent exactly when the embeddings are tied");
    if (!R->lm_head)
        R->lm_head = R->embed;
    R->layers = calloc((size_t)c->n_layers, sizeof *R->layers);
    int64_t P = c->g4.ple_dim, LP = P * c->n_layers;
    R->ple_embed = R->ple_model_proj = R->ple_model_norm = NULL;
    if (P > 0) {
        R->ple_embed = ref_dequant(&m->g4.ple_embed, c->g4.ple_vocab, LP, false, "ple_embed", -1);
        R->ple_model_proj = ref_dequant(&m->g4.ple_proj, LP, H, false, "ple_proj", -1);
        R->ple_model_norm = ref_dequant(&m->g4.ple_norm, 1, P, false, "ple_norm", -1);
    }
    for (int l = 0; l < c->n_layers; l++) {
        const eng_layer *L = &m->layers[l];
        ref_layer *r = &R->layers[l];
        const eng_config lc = ref_layer_config(c, l);
        int64_t nq = (int64_t)lc.n_heads * lc.head_dim, nkv = (int64_t)lc.n_kv_heads * lc.head_dim;
        /* OLMo 3 (post_norms): no norm before attention or the MLP */
        r->attn_norm = ref_dequant(&L->attn_norm, 1, H, c->post_norms, "attn_norm", l);
        r->ffn_norm = ref_dequant(&L->ffn_norm, 1, H, c->post_norms, "ffn_norm", l);
        r->wq = ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_Q) : &L->wq, nq, H, false, "wq", l);
        /* Gemma 4's kv-shared layers have no k or v (nor k norm) */
        bool shared = eng_layer_kv_source(c, l) != l;
        r->wk =
            ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_K) : &L->wk, nkv, H, shared, "wk", l);
        /* nor v where k is v (Gemma 4's attention_k_eq_v full layers) */
        bool no_v = shared || eng_layer_k_is_v(c, l);
        r->wv = ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_V) : &L->wv, nkv, H, no_v, "wv", l);
        cr_assert_eq(r->wk == NULL, shared, "layer %d: k is absent exactly when shared", l);
        cr_assert_eq(r->wv == NULL, no_v, "layer %d: v is absent exactly when shared or k", l);
        if (P > 0) {
            r->ple_gate =
                ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_PLE_GATE) : &L->g4.ple_gate, P, H,
                            false, "ple_gate", l);
            r->ple_proj =
                ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_PLE_PROJ) : &L->g4.ple_proj, H, P,
                            false, "ple_proj", l);
            r->ple_norm = ref_dequant(&L->g4.ple_norm, 1, H, false, "ple_norm", l);
        }
        r->wo = ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_O) : &L->wo, H, nq, false, "wo", l);
        r->bq = ref_dequant(&L->bq, 1, nq, true, "bq", l);
        r->bk = ref_dequant(&L->bk, 1, nkv, true, "bk", l);
        r->bv = ref_dequant(&L->bv, 1, nkv, true, "bv", l);
        cr_assert_eq(r->bq != NULL, c->attention_bias, "layer %d: q bias vs attention_bias", l);
        r->delta = calloc((size_t)eng_n_proj(c), sizeof *r->delta);
        cr_assert(r->delta);
        /* the MLP's projections: a plain MLP's, or a mixture's shared expert */
        bool moe = eng_layer_is_moe(c, l);
        int64_t f = moe && !c->g4.moe_block ? c->shared_expert_ff : eng_layer_ff(c, l);
        if (!moe || f > 0) {
            r->w_gate = ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_GATE) : &L->w_gate, f, H,
                                    false, "w_gate", l);
            r->w_up = ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_UP) : &L->w_up, f, H, false,
                                  "w_up", l);
            r->w_down = ref_dequant(w ? eng_weights_proj(w, l, ENG_PROJ_DOWN) : &L->w_down, H, f,
                                    false, "w_down", l);
        }
        if (moe) {
            r->router = ref_dequant(&L->router, c->n_experts, H, false, "router", l);
            if (c->shared_expert_ff > 0)
                r->shared_gate = ref_dequant(&L->shared_gate, 1, H, false, "shared_gate", l);
            r->experts = calloc(3 * (size_t)c->n_experts, sizeof *r->experts);
            cr_assert(r->experts);
            for (int e = 0; e < 3 * c->n_experts; e++) {
                eng_proj p = eng_expert_proj(e / 3, (eng_proj)(ENG_PROJ_GATE + e % 3));
                int64_t rows = e % 3 < 2 ? c->expert_ff : H, cols = e % 3 < 2 ? H : c->expert_ff;
                r->experts[e] = ref_dequant(w ? eng_weights_proj(w, l, p) : eng_model_proj(m, l, p),
                                            rows, cols, false, "expert", l);
            }
        }
        if (c->qk_norm) { /* a head's, or OLMo 3's whole projection's */
            r->q_norm =
                ref_dequant(&L->q_norm, 1, eng_qk_norm_width(&lc, false), false, "q_norm", l);
            r->k_norm =
                ref_dequant(&L->k_norm, 1, eng_qk_norm_width(&lc, true), shared, "k_norm", l);
        }
        if (c->g4.moe_block) {
            const eng_gemma4_layer *g = &L->g4;
            r->router_scale = ref_dequant(&g->router_scale, 1, H, false, "router.scale", l);
            r->expert_scale =
                ref_dequant(&g->expert_scale, 1, c->n_experts, false, "per_expert_scale", l);
            r->mlp_post_norm = ref_dequant(&g->mlp_post_norm, 1, H, false, "post_ffw_norm_1", l);
            r->moe_pre_norm = ref_dequant(&g->moe_pre_norm, 1, H, false, "pre_ffw_norm_2", l);
            r->moe_post_norm = ref_dequant(&g->moe_post_norm, 1, H, false, "post_ffw_norm_2", l);
        }
        r->layer_scalar = 1.0;
        if (c->layer_scalar) {
            float s1;
            qt_dequantize_rows(&L->layer_scalar, 0, 1, &s1);
            r->layer_scalar = s1;
        }
        if (c->sandwich_norms || c->post_norms) {
            r->post_attn_norm = ref_dequant(&L->post_attn_norm, 1, H, false, "post_attn_norm", l);
            r->post_ffn_norm = ref_dequant(&L->post_ffn_norm, 1, H, false, "post_ffn_norm", l);
        }
    }
}

static inline void ref_load(ref_model *R, const eng_model *m)
{
    ref_load_version(R, m, NULL);
}

/* Add scale * lora's module scale * B @ A to every projection it targets,
 * in float64: the model QLoRA trained, dequant(W) + scale * BA. */
static inline void ref_add_lora(ref_model *R, const eng_lora *lora, double scale)
{
    for (int l = 0; l < R->c.n_layers; l++) {
        for (int p = 0; p < eng_n_proj(&R->c); p++) {
            const eng_lora_module *mod = eng_lora_module_at(lora, l, (eng_proj)p);
            if (!mod)
                continue;
            int64_t rows = mod->b.rows, cols = mod->a.cols, rank = mod->a.rows;
            float *A = malloc((size_t)(rank * cols) * sizeof *A);
            float *B = malloc((size_t)(rows * rank) * sizeof *B);
            cr_assert(A && B);
            qt_dequantize_rows(&mod->a, 0, rank, A);
            qt_dequantize_rows(&mod->b, 0, rows, B);
            double **d = &R->layers[l].delta[p];
            if (!*d)
                *d = calloc((size_t)(rows * cols), sizeof **d);
            cr_assert(*d);
            double s = scale * (double)mod->scale;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t k = 0; k < rank; k++)
                    for (int64_t c = 0; c < cols; c++)
                        (*d)[r * cols + c] += s * (double)B[r * rank + k] * (double)A[k * cols + c];
            free(A);
            free(B);
        }
    }
}

static inline void ref_free(ref_model *R)
{
    for (int l = 0; l < R->c.n_layers; l++) {
        ref_layer *r = &R->layers[l];
        for (int p = 0; p < eng_n_proj(&R->c); p++)
            free(r->delta[p]);
        free(r->delta);
        for (int e = 0; r->experts && e < 3 * R->c.n_experts; e++)
            free(r->experts[e]);
        free(r->experts);
        free(r->router);
        free(r->shared_gate);
        float *all[] = {r->attn_norm,
                        r->ffn_norm,
                        r->wq,
                        r->wk,
                        r->wv,
                        r->wo,
                        r->bq,
                        r->bk,
                        r->bv,
                        r->w_gate,
                        r->w_up,
                        r->w_down,
                        r->q_norm,
                        r->k_norm,
                        r->post_attn_norm,
                        r->post_ffn_norm,
                        r->ple_gate,
                        r->ple_proj,
                        r->ple_norm,
                        r->router_scale,
                        r->expert_scale,
                        r->mlp_post_norm,
                        r->moe_pre_norm,
                        r->moe_post_norm};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            free(all[i]);
    }
    free(R->layers);
    if (R->lm_head != R->embed)
        free(R->lm_head);
    free(R->embed);
    free(R->norm);
    free(R->ple_embed);
    free(R->ple_model_proj);
    free(R->ple_model_norm);
    memset(R, 0, sizeof *R);
}

/* out = rmsnorm(x) * (offset + w): x / sqrt(mean(x^2) + eps), times the
 * weight (plus Gemma's 1 for a folder: eng_config.norm_offset). */
static inline void ref_rmsnorm_offset(const double *x, const float *w, double offset, int64_t n,
                                      double eps, double *out)
{
    double ss = 0;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    double inv = 1.0 / sqrt(ss / (double)n + eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = x[i] * inv * (offset + (double)w[i]);
}

static inline void ref_rmsnorm(const double *x, const float *w, int64_t n, double eps, double *out)
{
    ref_rmsnorm_offset(x, w, 0.0, n, eps, out);
}

/* out = (W + D) x (+ b): W is [rows, cols], D a float64 delta or NULL. */
static inline void ref_matvec(const float *W, const double *D, const float *b, int64_t rows,
                              int64_t cols, const double *x, double *out)
{
    for (int64_t r = 0; r < rows; r++) {
        double s = b ? (double)b[r] : 0.0;
        const float *w = W + r * cols;
        for (int64_t c = 0; c < cols; c++)
            s += ((double)w[c] + (D ? D[r * cols + c] : 0.0)) * x[c];
        out[r] = s;
    }
}

/* The rotary frequency of pair i: rope_theta^(-2i/rotary dims) (the head
 * dim, or fewer with partial rotary), divided by a
 * GGUF's frequency factor for the pair when it has them (ggml's rope:
 * theta / freq_factors[i]), scaled as transformers'
 * _compute_linear_scaling_rope_parameters (divided by the factor) and
 * _compute_llama3_parameters (long wavelengths divided by the factor,
 * short ones kept, those between blended) compute it. */
static inline int ref_rope_dims(const eng_config *c)
{
    return c->rope_dim > 0 && c->rope_dim < c->head_dim ? c->rope_dim : c->head_dim;
}

/* YaRN's blend for pair i, written from transformers'
 * _compute_yarn_parameters: 1 - the linear ramp between the correction
 * dims of beta_fast and beta_slow (rounded out when truncate) weighs the
 * extrapolated frequency, the ramp the interpolated one. */
static inline double ref_yarn_freq(const eng_config *c, int i, double freq)
{
    double dim = ref_rope_dims(c), base = c->rope_theta, orig = c->rope_original_max_position;
    double lo = dim * log(orig / (c->rope_yarn_beta_fast * 2 * M_PI)) / (2 * log(base));
    double hi = dim * log(orig / (c->rope_yarn_beta_slow * 2 * M_PI)) / (2 * log(base));
    if (c->rope_yarn_truncate) {
        lo = floor(lo);
        hi = ceil(hi);
    }
    lo = fmax(lo, 0.0);
    hi = fmin(hi, dim - 1);
    if (lo == hi)
        hi += 0.001;
    double ramp = fmin(fmax((i - lo) / (hi - lo), 0.0), 1.0), extrapolate = 1.0 - ramp;
    return freq / c->rope_factor * (1.0 - extrapolate) + freq * extrapolate;
}

/* Pair i's frequency; long_set: longrope's long factors divide it (else
 * the short ones, or a GGUF's rope_freqs.weight). */
static inline double ref_rope_freq(const eng_config *c, int i, bool long_set)
{
    double freq = pow((double)c->rope_theta, -2.0 * i / ref_rope_dims(c));
    if (i < c->n_rope_freq_factors)
        freq /= (double)(long_set ? c->rope_long_freq_factors[i] : c->rope_freq_factors[i]);
    if (c->rope_scaling == ENG_ROPE_LINEAR)
        return freq / c->rope_factor;
    if (c->rope_scaling == ENG_ROPE_PROPORTIONAL) /* Gemma 4: the rest stand still */
        return i < c->rope_prop_pairs ? freq / c->rope_factor : 0.0;
    if (c->rope_scaling == ENG_ROPE_YARN)
        return ref_yarn_freq(c, i, freq);
    if (c->rope_scaling == ENG_ROPE_LLAMA3) {
        double factor = c->rope_factor, lo = c->rope_low_freq_factor;
        double hi = c->rope_high_freq_factor, old = c->rope_original_max_position;
        double wavelen = 6.283185307179586 / freq; /* 2 pi */
        if (wavelen < old / hi)
            return freq;
        if (wavelen > old / lo)
            return freq / factor;
        double smooth = (old / wavelen - lo) / (hi - lo);
        return (1.0 - smooth) * freq / factor + smooth * freq;
    }
    return freq;
}

/* Rotate one head's vector for position pos: pairs (i, i + d/2) as Hugging
 * Face lays them out, or (2i, 2i + 1) in a llama GGUF. longrope (Phi-3):
 * the factor set (long_set: the long one) divides the frequencies above,
 * and cos and sin are multiplied by the attention factor, as
 * transformers' Phi3RotaryEmbedding multiplies them; YaRN's cos and sin
 * too. */
static inline void ref_rope(const eng_config *c, double *v, int pos, bool long_set)
{
    int half = ref_rope_dims(c) / 2; /* partial rotary: the leading dims only */
    bool scaled = c->rope_scaling == ENG_ROPE_LONGROPE || c->rope_scaling == ENG_ROPE_YARN;
    double mscale = scaled ? (double)c->rope_attn_factor : 1.0;
    for (int i = 0; i < half; i++) {
        double angle = pos * ref_rope_freq(c, i, long_set);
        double cs = cos(angle) * mscale, sn = sin(angle) * mscale;
        int a = c->rope_interleaved ? 2 * i : i, b = c->rope_interleaved ? 2 * i + 1 : i + half;
        double x0 = v[a], x1 = v[b];
        v[a] = x0 * cs - x1 * sn;
        v[b] = x1 * cs + x0 * sn;
    }
}

/* Gemma 3's sliding layers: rope_local_theta^(-2i/head_dim), unscaled. */
static inline void ref_rope_local(const eng_config *c, double *v, int pos)
{
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double angle = pos * pow((double)c->rope_local_theta, -2.0 * i / c->head_dim);
        double cs = cos(angle), sn = sin(angle);
        double x0 = v[i], x1 = v[i + half];
        v[i] = x0 * cs - x1 * sn;
        v[i + half] = x1 * cs + x0 * sn;
    }
}

/* Gemma's gelu_pytorch_tanh, in double. */
static inline double ref_gelu_tanh(double x)
{
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

/* out = x through its norm w, or x itself where the layer has none
 * (OLMo 3's blocks read the residual). */
static inline void ref_norm_in(const eng_config *c, const double *x, const float *w, double *out)
{
    if (w)
        ref_rmsnorm_offset(x, w, c->norm_offset, c->hidden_size, c->rms_norm_eps, out);
    else
        memcpy(out, x, (size_t)c->hidden_size * sizeof *out);
}

/* In place: n values of v through the RMSNorm w (q/k norms). */
static inline void ref_norm_in_place(const eng_config *c, double *v, const float *w, int64_t n,
                                     double *tmp)
{
    ref_rmsnorm_offset(v, w, c->norm_offset, n, c->rms_norm_eps, tmp);
    memcpy(v, tmp, (size_t)n * sizeof *tmp);
}

/* In place: a block's output through Gemma's post-norm (NULL: none). */
static inline void ref_post_norm(const eng_config *c, const float *w, double *o, double *tmp)
{
    if (!w)
        return;
    ref_rmsnorm_offset(o, w, c->norm_offset, c->hidden_size, c->rms_norm_eps, tmp);
    memcpy(o, tmp, (size_t)c->hidden_size * sizeof *o);
}

/* out = down(act(gate(h)) * up(h)) for one projection triple (f wide). */
static inline void ref_glu(const eng_config *c, const float *wg, const double *dg, const float *wu,
                           const double *du, const float *wd, const double *dd, int64_t f,
                           const double *h, double *out)
{
    int64_t H = c->hidden_size;
    double *g = calloc((size_t)f, sizeof *g), *u = calloc((size_t)f, sizeof *u);
    cr_assert(g && u);
    ref_matvec(wg, dg, NULL, f, H, h, g);
    ref_matvec(wu, du, NULL, f, H, h, u);
    for (int64_t i = 0; i < f; i++)
        g[i] = c->ffn_act == ENG_FFN_GELU_TANH ? ref_gelu_tanh(g[i]) * u[i]
                                               : g[i] / (1.0 + exp(-g[i])) * u[i];
    ref_matvec(wd, dd, NULL, H, f, g, out);
    free(g);
    free(u);
}

/* A mixture of experts on one row, as transformers' Qwen2/3-MoE and
 * Mixtral blocks: softmax over the router's logits, the k most probable
 * experts (renormalized when norm_topk_prob), the sum of their GLUs so
 * weighted; Qwen2-MoE's shared expert times sigmoid(shared_gate . h). */
static inline void ref_moe(const eng_config *c, const ref_layer *L, const double *h,
                           const double *router_in, double *out)
{
    int64_t H = c->hidden_size, E = c->n_experts;
    double *p = calloc((size_t)E, sizeof *p), *y = calloc((size_t)H, sizeof *y);
    bool *taken = calloc((size_t)E, sizeof *taken);
    cr_assert(p && y && taken);
    ref_matvec(L->router, NULL, NULL, E, H, router_in ? router_in : h, p);
    double mx = -INFINITY, sum = 0, chosen = 0;
    for (int64_t e = 0; e < E; e++)
        mx = fmax(mx, p[e]);
    for (int64_t e = 0; e < E; e++)
        sum += (p[e] = exp(p[e] - mx));
    int pick[64];
    for (int k = 0; k < c->n_experts_used; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best]))
                best = e;
        taken[best] = true;
        pick[k] = best;
        chosen += p[best] / sum;
    }
    memset(out, 0, (size_t)H * sizeof *out);
    for (int k = 0; k < c->n_experts_used; k++) {
        int e = pick[k];
        double w = p[e] / sum / (c->norm_topk_prob ? chosen : 1.0);
        if (L->expert_scale) /* Gemma 4's per_expert_scale */
            w *= L->expert_scale[e];
        double *const *d = L->delta + eng_expert_proj(e, ENG_PROJ_GATE);
        ref_glu(c, L->experts[3 * e], d[0], L->experts[3 * e + 1], d[1], L->experts[3 * e + 2],
                d[2], c->expert_ff, h, y);
        for (int64_t i = 0; i < H; i++)
            out[i] += w * y[i];
    }
    if (L->shared_gate) {
        double g = 0;
        for (int64_t i = 0; i < H; i++)
            g += (double)L->shared_gate[i] * h[i];
        ref_glu(c, L->w_gate, L->delta[ENG_PROJ_GATE], L->w_up, L->delta[ENG_PROJ_UP], L->w_down,
                L->delta[ENG_PROJ_DOWN], c->shared_expert_ff, h, y);
        for (int64_t i = 0; i < H; i++)
            out[i] += y[i] / (1.0 + exp(-g));
    }
    free(p);
    free(y);
    free(taken);
}

/* Gemma 4's MoE block on one row beside its MLP, whose output o becomes
 * norm_1(o) + norm_2(experts(pre_2(x)) routed by norm(x) * router.scale /
 * sqrt(hidden)), x the residual. */
static inline void ref_gemma4_moe_block(const eng_config *c, const ref_layer *L, const double *x,
                                        double *o)
{
    int64_t H = c->hidden_size;
    double *r = calloc((size_t)H, sizeof *r), *e = calloc((size_t)H, sizeof *e);
    double *y = calloc((size_t)H, sizeof *y), *t = calloc((size_t)H, sizeof *t);
    cr_assert(r && e && y && t);
    ref_post_norm(c, L->mlp_post_norm, o, t);
    ref_rmsnorm_offset(x, L->router_scale, 0.0, H, c->rms_norm_eps, r);
    for (int64_t i = 0; i < H; i++)
        r[i] /= sqrt((double)H);
    ref_rmsnorm_offset(x, L->moe_pre_norm, c->norm_offset, H, c->rms_norm_eps, e);
    ref_moe(c, L, e, r, y);
    ref_post_norm(c, L->moe_post_norm, y, t);
    for (int64_t i = 0; i < H; i++)
        o[i] += y[i];
    free(r);
    free(e);
    free(y);
    free(t);
}

/* Gemma 4's per-layer inputs of tokens[0..n) from their scaled embeddings
 * x, [n][n_layers][ple_dim] (the caller frees; NULL when the model has
 * none): (norm(x @ P^T / sqrt(hidden)) + E[token] * sqrt(ple_dim)) /
 * sqrt(2), as transformers' project_per_layer_inputs. */
static inline double *ref_per_layer_inputs(const ref_model *R, const int32_t *tokens, int n,
                                           const double *x)
{
    const eng_config *c = &R->c;
    int64_t H = c->hidden_size, P = c->g4.ple_dim, LP = P * c->n_layers;
    if (P <= 0)
        return NULL;
    double *ple = calloc((size_t)(n * LP), sizeof *ple), *t = calloc((size_t)P, sizeof *t);
    cr_assert(ple && t);
    for (int r = 0; r < n; r++) {
        double *row = ple + r * LP;
        ref_matvec(R->ple_model_proj, NULL, NULL, LP, H, x + r * H, row);
        for (int64_t l = 0; l < c->n_layers; l++) {
            for (int64_t i = 0; i < P; i++)
                row[l * P + i] /= sqrt((double)H);
            ref_rmsnorm_offset(row + l * P, R->ple_model_norm, c->norm_offset, P, c->rms_norm_eps,
                               t);
            for (int64_t i = 0; i < P; i++)
                row[l * P + i] = (t[i] + R->ple_embed[(int64_t)tokens[r] * LP + l * P + i] *
                                             (double)c->g4.ple_embed_scale) /
                                 sqrt(2.0);
        }
    }
    free(t);
    return ple;
}

/* The logits of every position of tokens[0..n): logits is n * vocab. */
static inline void ref_forward(const ref_model *R, const int32_t *tokens, int n, double *logits)
{
    const eng_config *c = &R->c;
    int64_t H = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
    /* room for the widest layer's heads (Gemma 4's full layers) */
    int64_t max_q = (int64_t)c->n_heads * eng_max_head_dim(c), max_kv = eng_max_kv_dim(c);
    double eps = c->rms_norm_eps;
    double *x = calloc((size_t)(n * H), sizeof *x), *h = calloc((size_t)H, sizeof *h);
    double *q = calloc((size_t)(n * max_q), sizeof *q), *att = calloc((size_t)max_q, sizeof *att);
    /* every layer's keys and values, kept for Gemma 4's kv-shared layers */
    size_t kv_n = (size_t)c->n_layers * (size_t)n * (size_t)max_kv;
    double *k_all = calloc(kv_n, sizeof *k_all), *v_all = calloc(kv_n, sizeof *v_all);
    double *k = k_all, *v = v_all;
    double *o = calloc((size_t)H, sizeof *o), *p = calloc((size_t)n, sizeof *p);
    for (int l = 0; l < c->n_layers; l++) /* Gemma 4's double-wide layers */
        F = eng_layer_ff(c, l) > F ? eng_layer_ff(c, l) : F;
    F = c->g4.ple_dim > F ? c->g4.ple_dim : F; /* g holds its per-layer input gate too */
    double *g = calloc((size_t)F, sizeof *g), *u = calloc((size_t)F, sizeof *u);
    double *tmp = calloc((size_t)(H > max_q ? H : max_q), sizeof *tmp);
    cr_assert(x && h && q && att && k_all && v_all && o && p && g && u && tmp);
    double off = c->norm_offset; /* Gemma folders: norms are (1 + w) */
    /* longrope's set, as transformers' longrope_frequency_update takes it:
     * long when the pass reaches past the original context */
    bool long_set = c->rope_scaling == ENG_ROPE_LONGROPE &&
                    (n > R->reserve ? n : R->reserve) > c->rope_original_max_position;

    // token embeddings (Gemma: times sqrt(hidden) as the model's dtype holds it)
    for (int t = 0; t < n; t++)
        for (int64_t i = 0; i < H; i++)
            x[t * H + i] = R->embed[(int64_t)tokens[t] * H + i] *
                           (c->embed_scale > 0 ? (double)c->embed_scale : 1.0);
    double *ple = ref_per_layer_inputs(R, tokens, n, x);
    for (int l = 0; l < c->n_layers; l++) {
        const ref_layer *L = &R->layers[l];
        // the layer's own heads (Gemma 4's full layers: global_head_dim)
        const eng_config lcfg = ref_layer_config(c, l), *lc = &lcfg;
        int64_t hd = lc->head_dim, nq = lc->n_heads * hd, nkv = lc->n_kv_heads * hd;
        int group = lc->n_heads / lc->n_kv_heads;
        // the layer's keys and values, or (Gemma 4's kv-shared layers) an
        // earlier layer's of its type, computed there
        int src = eng_layer_kv_source(c, l);
        bool own = src == l;
        k = k_all + (size_t)src * (size_t)n * (size_t)max_kv;
        v = v_all + (size_t)src * (size_t)n * (size_t)max_kv;
        // attention rmsnorm, qkv projections, RoPE on q and k
        bool slides = eng_layer_slides(c, l), local = slides && c->rope_local_theta > 0;
        // (SmolLM3's NoPE layers: none; OLMo 3: q/k norms over the whole
        // projection; Ministral 3: each query times Llama 4's temperature)
        bool rotates = eng_layer_rotates(c, l);
        int64_t qn = eng_qk_norm_width(lc, false), kn = eng_qk_norm_width(lc, true);
        for (int t = 0; t < n; t++) {
            ref_norm_in(c, x + t * H, L->attn_norm, h);
            ref_matvec(L->wq, L->delta[ENG_PROJ_Q], L->bq, nq, H, h, q + t * nq);
            if (own) {
                ref_matvec(L->wk, L->delta[ENG_PROJ_K], L->bk, nkv, H, h, k + t * nkv);
                if (L->wv)
                    ref_matvec(L->wv, L->delta[ENG_PROJ_V], L->bv, nkv, H, h, v + t * nkv);
                else /* Gemma 4's attention_k_eq_v: k's projection, before its norm */
                    memcpy(v + t * nkv, k + t * nkv, (size_t)nkv * sizeof *v);
            }
            for (int64_t i = 0; L->q_norm && i < nq; i += qn)
                ref_norm_in_place(c, q + t * nq + i, L->q_norm, qn, tmp);
            for (int64_t i = 0; L->k_norm && i < nkv; i += kn)
                ref_norm_in_place(c, k + t * nkv + i, L->k_norm, kn, tmp);
            for (int64_t i = 0; own && c->v_norm && i < nkv; i += hd) { /* Gemma 4: no weights */
                double ss = 0;
                for (int64_t e = 0; e < hd; e++)
                    ss += v[t * nkv + i + e] * v[t * nkv + i + e];
                double r = 1.0 / sqrt(ss / (double)hd + (double)c->rms_norm_eps);
                for (int64_t e = 0; e < hd; e++)
                    v[t * nkv + i + e] *= r;
            }
            for (int hh = 0; rotates && hh < c->n_heads; hh++)
                local ? ref_rope_local(lc, q + t * nq + hh * hd, t)
                      : ref_rope(lc, q + t * nq + hh * hd, t, long_set);
            for (int hh = 0; own && rotates && hh < lc->n_kv_heads; hh++)
                local ? ref_rope_local(lc, k + t * nkv + hh * hd, t)
                      : ref_rope(lc, k + t * nkv + hh * hd, t, long_set);
            double temp =
                c->attn_temp_beta > 0
                    ? 1.0 + c->attn_temp_beta * log(1.0 + floor((double)t / c->attn_temp_floor))
                    : 1.0;
            for (int64_t i = 0; i < nq; i++)
                q[t * nq + i] *= temp;
        }
        double scale = c->attn_scale > 0 ? (double)c->attn_scale : 1.0 / sqrt((double)hd);
        int window = slides ? c->sliding_window : 0;
        // causal attention per head (head hh reads kv head hh / group), output projection
        for (int t = 0; t < n; t++) {
            for (int hh = 0; hh < c->n_heads; hh++) {
                const double *qh = q + t * nq + hh * hd;
                int64_t kvo = (int64_t)(hh / group) * hd;
                double mx = -INFINITY, sum = 0;
                /* a sliding layer: keys at most window - 1 positions back */
                int s0 = window > 0 && t - window + 1 > 0 ? t - window + 1 : 0;
                for (int s = s0; s <= t; s++) {
                    double d = 0;
                    for (int64_t i = 0; i < hd; i++)
                        d += qh[i] * k[s * nkv + kvo + i];
                    p[s] = d * scale;
                    if (c->attn_softcap > 0) /* Gemma 2: tanh(s / cap) * cap */
                        p[s] = tanh(p[s] / c->attn_softcap) * c->attn_softcap;
                    mx = fmax(mx, p[s]);
                }
                for (int s = s0; s <= t; s++) {
                    p[s] = exp(p[s] - mx);
                    sum += p[s];
                }
                for (int64_t i = 0; i < hd; i++) {
                    double a = 0;
                    for (int s = s0; s <= t; s++)
                        a += p[s] / sum * v[s * nkv + kvo + i];
                    att[hh * hd + i] = a;
                }
            }
            ref_matvec(L->wo, L->delta[ENG_PROJ_O], NULL, H, nq, att, o);
            ref_post_norm(c, L->post_attn_norm, o, tmp);
            for (int64_t i = 0; i < H; i++)
                x[t * H + i] += o[i];
        }
        // ffn rmsnorm, SwiGLU: down(silu(gate(h)) * up(h)) (Gemma: GeGLU, post-norm);
        // a mixture of experts' layer: ref_moe
        for (int t = 0; t < n; t++) {
            ref_norm_in(c, x + t * H, L->ffn_norm, h);
            if (L->router && !L->moe_pre_norm) {
                ref_moe(c, L, h, NULL, o);
                for (int64_t i = 0; i < H; i++)
                    x[t * H + i] += o[i];
                continue;
            }
            int64_t f = eng_layer_ff(c, l);
            ref_matvec(L->w_gate, L->delta[ENG_PROJ_GATE], NULL, f, H, h, g);
            ref_matvec(L->w_up, L->delta[ENG_PROJ_UP], NULL, f, H, h, u);
            for (int64_t i = 0; i < f; i++)
                g[i] = c->ffn_act == ENG_FFN_GELU_TANH ? ref_gelu_tanh(g[i]) * u[i]
                                                       : g[i] / (1.0 + exp(-g[i])) * u[i];
            ref_matvec(L->w_down, L->delta[ENG_PROJ_DOWN], NULL, H, f, g, o);
            if (L->moe_pre_norm) /* Gemma 4's MoE block beside the MLP */
                ref_gemma4_moe_block(c, L, x + t * H, o);
            ref_post_norm(c, L->post_ffn_norm, o, tmp);
            for (int64_t i = 0; i < H; i++)
                x[t * H + i] += o[i];
        }
        // Gemma 4's per-layer input: x += norm(proj(gelu_tanh(gate(x)) * the layer's slice))
        for (int t = 0; L->ple_gate && t < n; t++) {
            int64_t P = c->g4.ple_dim;
            const double *slice = ple + ((int64_t)t * c->n_layers + l) * P;
            ref_matvec(L->ple_gate, L->delta[ENG_PROJ_PLE_GATE], NULL, P, H, x + t * H, g);
            for (int64_t i = 0; i < P; i++)
                g[i] = ref_gelu_tanh(g[i]) * slice[i];
            ref_matvec(L->ple_proj, L->delta[ENG_PROJ_PLE_PROJ], NULL, H, P, g, o);
            ref_rmsnorm_offset(o, L->ple_norm, off, H, eps, tmp);
            for (int64_t i = 0; i < H; i++)
                x[t * H + i] += tmp[i];
        }
        // Gemma 4: the layer's output times its layer_scalar
        for (int64_t i = 0; L->layer_scalar != 1.0 && i < n * H; i++)
            x[i] *= L->layer_scalar;
    }
    // final rmsnorm, lm_head (the embeddings when tied), Gemma 2's soft-cap
    for (int t = 0; t < n; t++) {
        ref_rmsnorm_offset(x + t * H, R->norm, off, H, eps, h);
        ref_matvec(R->lm_head, NULL, NULL, V, H, h, logits + t * V);
        for (int64_t i = 0; c->final_softcap > 0 && i < V; i++)
            logits[t * V + i] = tanh(logits[t * V + i] / c->final_softcap) * c->final_softcap;
    }
    free(tmp);
    free(ple);
    free(x);
    free(h);
    free(q);
    free(att);
    free(k_all);
    free(v_all);
    free(o);
    free(p);
    free(g);
    free(u);
}

/* The relative L2 error of e against r (test_diff_l2: +inf for a NaN or an
 * infinity on either side), and the logit that is furthest off. */
static inline double rel_error(const float *e, const double *r, int64_t n, int64_t *worst)
{
    test_diff d = test_diff_f64(e, r, (size_t)n);
    *worst = (int64_t)d.worst;
    return test_diff_l2(&d);
}

static inline void assert_logits_close(const float *e, const double *r, int64_t n,
                                       const char *label, const char *what, int pos)
{
    int64_t w = 0;
    double rel = rel_error(e, r, n, &w);
    cr_assert(rel <= FWD_REL_TOL,
              "%s, %s at position %d: ||engine - reference|| / ||reference|| = %.3g > %g; "
              "worst logit %ld: engine %.9g, reference %.9g",
              label, what, pos, rel, FWD_REL_TOL, (long)w, (double)e[w], r[w]);
}

static inline int32_t argmax(const float *v, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return (int32_t)best;
}

#endif

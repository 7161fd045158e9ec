/*
 * load_gguf.c - load a GGUF file (llama.cpp's format) into an eng_model:
 * the config from its metadata, the weights read in place (F32, F16, BF16,
 * Q4_0, Q4_1 and Q8_0 blocks borrowed from the mapping), the tokenizer
 * from its tokenizer.ggml.* keys.
 *
 * What llama.cpp's converter changes is said where it matters: llama's q/k
 * rows permuted into adjacent rotary pairs (rope_interleaved), a tied
 * lm_head left out (no output.weight), Llama 3.x's rope_scaling stored as
 * per-pair frequency factors (rope_freqs.weight). It owns nothing itself:
 * the mapped file and the tensors go into the model, which eng_model_free
 * releases.
 */
#include "internal/model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An unsigned integer metadata value, or def when absent. */
static int gguf_uint(const gguf_file *f, const char *key, int64_t def, bool required, int32_t *out,
                     char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) {
        if (required)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata %s is missing", f->path, key);
        *out = (int32_t)def;
        return QL_OK;
    }
    bool integer = kv->type == GGUF_UINT8 || kv->type == GGUF_INT8 || kv->type == GGUF_UINT16 ||
                   kv->type == GGUF_INT16 || kv->type == GGUF_UINT32 || kv->type == GGUF_INT32 ||
                   kv->type == GGUF_UINT64 || kv->type == GGUF_INT64;
    if (!integer || kv->i < 0 || kv->i > INT32_MAX)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata %s is not a non-negative integer",
                       f->path, key);
    *out = (int32_t)kv->i;
    return QL_OK;
}

static int gguf_float(const gguf_file *f, const char *key, double def, float *out, char *msg,
                      size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) {
        *out = (float)def;
        return QL_OK;
    }
    if ((kv->type != GGUF_FLOAT32 && kv->type != GGUF_FLOAT64) || !isfinite(kv->f) || kv->f <= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: metadata %s is not a positive number",
                       f->path, key);
    *out = (float)kv->f;
    return QL_OK;
}

/*
 * The rotary layout beyond the frequency base: ARCH.rope.dimension_count
 * (llama.cpp's n_rot): the whole head, or its leading n_rot dims (partial
 * rotary, as Phi-4-mini's converted files have; not for a permuted llama
 * layout), and a
 * rope_freqs.weight tensor (llama.cpp's per-pair frequency factors: its
 * converter writes them for Llama 3.x's rope_scaling llama3, one tensor for
 * every layer) is read into the config, f32 [head_dim / 2] as llama.cpp
 * requires it, every factor finite and positive (each divides a frequency).
 */
static int gguf_rope_dims(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                          size_t msg_len)
{
    char key[128];
    snprintf(key, sizeof key, "%s.rope.dimension_count", arch);
    int32_t n_rot = c->head_dim;
    int rc = gguf_uint(f, key, c->head_dim, false, &n_rot, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (n_rot <= 0 || n_rot > c->head_dim || n_rot % 2)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s = %d is not an even number of rotary dims of the head's %d", f->path,
                       key, n_rot, c->head_dim);
    /* llama.cpp's converter permutes a llama head's rows whole, which a
     * rotation of part of the head would not undo */
    if (n_rot != c->head_dim && c->arch == ENG_ARCH_LLAMA)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: %s = %d rotates part of each llama head of %d; qlserve rotates whole "
                       "heads of a permuted llama layout",
                       f->path, key, n_rot, c->head_dim);
    c->rope_dim = n_rot == c->head_dim ? 0 : n_rot; /* partial rotary: the leading n_rot */
    c->n_rope_freq_factors = 0;
    const gguf_tensor *t = gguf_find_tensor(f, "rope_freqs.weight");
    if (!t)
        return QL_OK;
    int32_t half = n_rot / 2;
    if (t->ggml_type != GGML_TYPE_F32 || t->n_dims != 1 || t->ne[0] != half)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor 'rope_freqs.weight' is %s, %d-D, %lld long; llama.cpp's "
                       "frequency factors are f32, 1-D, %s / 2 = %d long",
                       f->path, gguf_ggml_type_name(t->ggml_type), t->n_dims, (long long)t->ne[0],
                       c->rope_dim ? "rotary dims" : "head_dim", half);
    if (half > ENG_MAX_ROPE_FREQ_FACTORS)
        return ql_fail(
            msg, msg_len, QL_EUNSUPPORTED,
            "%s: head dim %d has more rotary pairs than the %d frequency factors qlserve "
            "holds",
            f->path, c->head_dim, ENG_MAX_ROPE_FREQ_FACTORS);
    for (int32_t i = 0; i < half; i++) {
        float v;
        memcpy(&v, t->data + 4 * (size_t)i, sizeof v); /* the mapping need not align floats */
        if (!isfinite(v) || v <= 0.0f)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: rope_freqs.weight[%d] = %g is not a positive frequency factor",
                           f->path, i, (double)v);
        c->rope_freq_factors[i] = v;
    }
    c->n_rope_freq_factors = half;
    return QL_OK;
}

/* A Phi-3 rope factor tensor (rope_factors_long.weight /
 * rope_factors_short.weight): f32 [head_dim / 2], every factor positive,
 * into out. */
static int gguf_rope_factors(const gguf_file *f, const char *name, int32_t half, float *out,
                             char *msg, size_t msg_len)
{
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND,
                       "%s: tensor '%s' is missing (longrope needs both factor sets)", f->path,
                       name);
    if (t->ggml_type != GGML_TYPE_F32 || t->n_dims != 1 || t->ne[0] != half)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tensor '%s' is %s, %d-D, %lld long; longrope factors are f32, 1-D, "
                       "rotary dims / 2 = %d long",
                       f->path, name, gguf_ggml_type_name(t->ggml_type), t->n_dims,
                       (long long)t->ne[0], half);
    for (int32_t i = 0; i < half; i++) {
        float v;
        memcpy(&v, t->data + 4 * (size_t)i, sizeof v);
        if (!isfinite(v) || v <= 0.0f)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: %s[%d] = %g is not a positive frequency factor", f->path, name, i,
                           (double)v);
        out[i] = v;
    }
    return QL_OK;
}

/*
 * What llama.cpp's converter writes for Phi-3 beyond a llama: the sliding
 * window (phi3.attention.sliding_window, 0 for none; applied as
 * transformers applies it, where llama.cpp at present turns Phi-3's window
 * off), and for the long-context models longrope: rope_factors_long.weight
 * and rope_factors_short.weight, phi3.rope.scaling.original_context_length
 * and phi3.rope.scaling.attn_factor (the converter's sqrt(1 + ln(s) /
 * ln(original)), s = context / original). Both factor sets are kept and
 * each sequence takes one (eng_rope_long_for), where llama.cpp takes one
 * for the whole context it is given.
 */
static int gguf_phi3(const gguf_file *f, eng_config *c, char *msg, size_t msg_len)
{
    int rc =
        gguf_uint(f, "phi3.attention.sliding_window", 0, false, &c->sliding_window, msg, msg_len);
    if (rc != QL_OK || !gguf_find_tensor(f, "rope_factors_long.weight"))
        return rc;
    int32_t half = (c->rope_dim ? c->rope_dim : c->head_dim) / 2;
    if (half > ENG_MAX_ROPE_FREQ_FACTORS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: head dim %d has more rotary pairs than the %d frequency factors "
                       "qlserve holds",
                       f->path, c->head_dim, ENG_MAX_ROPE_FREQ_FACTORS);
    if (c->n_rope_freq_factors)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: both rope_freqs.weight and longrope factors; one set of frequency "
                       "factors at most",
                       f->path);
    rc = gguf_uint(f, "phi3.rope.scaling.original_context_length", 0, true,
                   &c->rope_original_max_position, msg, msg_len);
    if (rc == QL_OK && c->rope_original_max_position <= 0)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: phi3.rope.scaling.original_context_length must be positive", f->path);
    if (rc == QL_OK)
        rc =
            gguf_float(f, "phi3.rope.scaling.attn_factor", 1.0, &c->rope_attn_factor, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc =
        gguf_rope_factors(f, "rope_factors_short.weight", half, c->rope_freq_factors, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_rope_factors(f, "rope_factors_long.weight", half, c->rope_long_freq_factors, msg,
                               msg_len);
    if (rc != QL_OK)
        return rc;
    c->rope_scaling = ENG_ROPE_LONGROPE;
    c->rope_factor =
        (float)((double)c->max_position_embeddings / (double)c->rope_original_max_position);
    c->n_rope_freq_factors = half;
    return QL_OK;
}

/* An optional float metadata value that may be 0 (off), or def. */
static int gguf_float_or_zero(const gguf_file *f, const char *key, double def, float *out,
                              char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (kv && (kv->type == GGUF_FLOAT32 || kv->type == GGUF_FLOAT64) && kv->f == 0.0) {
        *out = 0.0f;
        return QL_OK;
    }
    return gguf_float(f, key, def, out, msg, msg_len);
}

/*
 * Gemma 2 and 3 as llama.cpp reads them (src/models/gemma2.cpp,
 * gemma3.cpp): norms stored as 1 + w by the converter (norm_offset 0),
 * embeddings scaled by sqrtf(hidden), rotary pairs as Hugging Face lays
 * them out, the sliding window on ARCH.attention.sliding_window_pattern's
 * layers (default: Gemma 2 alternates, Gemma 3 five of six), Gemma 3's
 * sliding layers rotating with rope.freq_base_swa (default 10000) and no
 * scaling. The attention scale is not in the file: llama.cpp takes
 * 1/sqrt(head_dim), except 1/sqrt(hidden / heads) for the 27B models (46
 * layers in Gemma 2, 62 in Gemma 3), which is what their configs'
 * query_pre_attn_scalar says; so do we. Gemma 2's soft-caps default to
 * llama.cpp's 50 and 30; llama.cpp never caps Gemma 3's attention.
 */
static int parse_gguf_gemma(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                            size_t msg_len)
{
    bool g3 = c->arch == ENG_ARCH_GEMMA3;
    char key[128];
    c->ffn_act = ENG_FFN_GELU_TANH;
    c->norm_offset = 0.0f;
    c->sandwich_norms = true;
    c->qk_norm = g3;
    c->rope_interleaved = false;
    c->attention_bias = false;
    c->embed_scale = sqrtf((float)c->hidden_size);
    bool big = c->n_layers == (g3 ? 62 : 46);
    c->attn_scale =
        big ? 1.0f / sqrtf((float)(c->hidden_size / c->n_heads)) : 1.0f / sqrtf((float)c->head_dim);
    int rc = QL_OK;
    c->attn_softcap = 0.0f;
    if (!g3) {
        snprintf(key, sizeof key, "%s.attn_logit_softcapping", arch);
        rc = gguf_float_or_zero(f, key, 50.0, &c->attn_softcap, msg, msg_len);
    }
    snprintf(key, sizeof key, "%s.final_logit_softcapping", arch);
    if (rc == QL_OK)
        rc = gguf_float_or_zero(f, key, g3 ? 0.0 : 30.0, &c->final_softcap, msg, msg_len);
    snprintf(key, sizeof key, "%s.attention.sliding_window", arch);
    if (rc == QL_OK)
        rc = gguf_uint(f, key, g3 ? 0 : 4096, false, &c->sliding_window, msg, msg_len);
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", arch);
    const gguf_kv *pat = gguf_find_kv(f, key);
    if (rc == QL_OK && pat && pat->type == GGUF_ARRAY)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: %s is a per-layer list; qlserve reads only a period (a number)",
                       f->path, key);
    if (rc == QL_OK)
        rc = gguf_uint(f, key, g3 ? 6 : 2, false, &c->sliding_pattern, msg, msg_len);
    if (rc == QL_OK && c->sliding_pattern == 1)
        c->sliding_window = 0;
    c->rope_local_theta = 0.0f;
    snprintf(key, sizeof key, "%s.rope.freq_base_swa", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, g3 ? 10000.0 : (double)c->rope_theta, &c->rope_local_theta, msg,
                        msg_len);
    if (rc == QL_OK && !g3 && c->rope_local_theta == c->rope_theta)
        c->rope_local_theta = 0.0f; /* Gemma 2: one base for every layer */
    return rc;
}

/*
 * YaRN as llama.cpp reads it: ARCH.rope.scaling.factor,
 * original_context_length, yarn_beta_fast and yarn_beta_slow (32 and 1 when
 * absent), and the factor cos and sin are multiplied by, as llama_context
 * builds it: 0.1 ln(factor) + 1 (over the same of yarn_log_multiplier when
 * there), or rope.scaling.yarn_attn_factor where the converter wrote
 * the config's attention_factor (transformers uses it in place of that
 * mscale; llama.cpp reads the key for Grok only, which is the same for
 * OLMo 3 7B, whose attention_factor is 0.1 ln(8) + 1), times
 * rope.scaling.attn_factor (1 when absent). ggml always
 * rounds the correction range out to whole dims, so truncate is set, except
 * for GPT-OSS, whose own config says false (and transformers honours it):
 * we compute the model its makers released, so a GPT-OSS GGUF gives the
 * same logits as its folder (0.006 from llama.cpp's on the tiny fixture).
 */
static int parse_gguf_yarn(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                           size_t msg_len)
{
    char key[128];
    float attn = 1.0f, log_mul = 0.0f, yarn_attn = 0.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.factor", arch);
    int rc = gguf_float(f, key, 1.0, &c->rope_factor, msg, msg_len);
    snprintf(key, sizeof key, "%s.rope.scaling.original_context_length", arch);
    if (rc == QL_OK)
        rc = gguf_uint(f, key, 0, true, &c->rope_original_max_position, msg, msg_len);
    if (rc == QL_OK && c->rope_original_max_position <= 0)
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s must be positive", f->path, key);
    snprintf(key, sizeof key, "%s.rope.scaling.yarn_beta_fast", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 32.0, &c->rope_yarn_beta_fast, msg, msg_len);
    snprintf(key, sizeof key, "%s.rope.scaling.yarn_beta_slow", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 1.0, &c->rope_yarn_beta_slow, msg, msg_len);
    snprintf(key, sizeof key, "%s.rope.scaling.attn_factor", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 1.0, &attn, msg, msg_len);
    snprintf(key, sizeof key, "%s.rope.scaling.yarn_log_multiplier", arch);
    if (rc == QL_OK)
        rc = gguf_float_or_zero(f, key, 0.0, &log_mul, msg, msg_len);
    snprintf(key, sizeof key, "%s.rope.scaling.yarn_attn_factor", arch);
    if (rc == QL_OK)
        rc = gguf_float_or_zero(f, key, 0.0, &yarn_attn, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    double factor = (double)c->rope_factor;
    double mscale = log_mul != 0.0f
                        ? model_yarn_mscale(factor, 1.0) / model_yarn_mscale(factor, log_mul)
                        : model_yarn_mscale(factor, 1.0);
    if (yarn_attn > 0.0f)
        mscale = (double)yarn_attn;
    c->rope_scaling = ENG_ROPE_YARN;
    c->rope_attn_factor = (float)(mscale * (double)attn);
    c->rope_yarn_truncate = c->arch != ENG_ARCH_GPT_OSS;
    return QL_OK;
}

/*
 * GPT-OSS as llama.cpp's openai-moe reads it: biases on q, k, v and o, the
 * attention sinks (attn_sinks.weight), every other layer sliding from
 * layer 0 (hard-coded there: the pattern 2) over
 * ARCH.attention.sliding_window, the clamped SwiGLU with the alpha 1.702
 * and limit 7.0 it hard-codes too (transformers' GptOssConfig defaults),
 * a router with a bias weighing the top-k logits by their softmax.
 */
static void parse_gguf_gpt_oss(eng_config *c)
{
    c->attention_bias = true;
    c->o_bias = true;
    c->attn_sinks = true;
    c->ffn_act = ENG_FFN_SWIGLU_OAI;
    c->swiglu_alpha = 1.702f;
    c->swiglu_limit = 7.0f;
    c->sliding_pattern = c->sliding_window > 0 ? 2 : 0;
}

/* gguf_uint of the architecture's key ARCH.name. */
static int gguf_arch_uint(const gguf_file *f, const char *arch, const char *name, int64_t def,
                          bool required, int32_t *out, char *msg, size_t msg_len)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, name);
    return gguf_uint(f, key, def, required, out, msg, msg_len);
}

/*
 * A mixture of experts' ARCH.expert_count, expert_used_count,
 * expert_feed_forward_length (Mixtral, a llama GGUF: its
 * feed_forward_length) and expert_shared_feed_forward_length (Qwen2-MoE,
 * Qwen3.5-MoE); which layers are mixtures is read from the tensors (a
 * layer with ffn_gate_inp). llama.cpp renormalizes the chosen experts'
 * weights for qwen3moe, qwen35moe and mixtral, not for qwen2moe
 * (build_moe_ffn's norm_w), and the file has no key for it; so do we.
 * The converter's --fuse-gate-up-exps (one ffn_gate_up_exps) is refused
 * by name: the experts are read as gate and up apart.
 */
static int parse_gguf_moe(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                          size_t msg_len)
{
    char key[128];
    int rc = QL_OK;
#define U(k, def, req, dst)                                                                        \
    if (rc == QL_OK)                                                                               \
    rc = gguf_arch_uint(f, arch, k, def, req, dst, msg, msg_len)
    U("expert_count", 0, true, &c->n_experts);
    U("expert_used_count", 0, true, &c->n_experts_used);
    U("expert_feed_forward_length", c->intermediate_size, false, &c->expert_ff);
    if (c->arch == ENG_ARCH_QWEN2_MOE || c->arch == ENG_ARCH_QWEN3_5)
        U("expert_shared_feed_forward_length", 0, true, &c->shared_expert_ff);
    /* routing llama.cpp can be told to do otherwise: by a gating function
     * other than softmax (llama-hparams.h's 1), or a scale on the chosen
     * weights; we run softmax and no scale, and refuse the rest by name */
    int32_t gating = 1;
    U("expert_gating_func", 1, false, &gating);
#undef U
    if (rc != QL_OK)
        return rc;
    if (gating != 1)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: %s.expert_gating_func is %d; qlserve routes with softmax (1) only",
                       f->path, arch, gating);
    snprintf(key, sizeof key, "%s.expert_weights_scale", arch);
    const gguf_kv *ws = gguf_find_kv(f, key);
    if (ws && !((ws->type == GGUF_FLOAT32 || ws->type == GGUF_FLOAT64) && ws->f == 1.0))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: %s scales the chosen experts' weights; qlserve runs them unscaled",
                       f->path, key);
    c->norm_topk_prob = c->arch != ENG_ARCH_QWEN2_MOE;
    snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
    const gguf_kv *wn = gguf_find_kv(f, key);
    if (wn && wn->type == GGUF_BOOL)
        c->norm_topk_prob = wn->u != 0;
    rc = model_moe_check(f->path, c, msg, msg_len);
    for (int32_t l = 0; rc == QL_OK && l < c->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_gate_up_exps.weight", l);
        if (gguf_find_tensor(f, name)) {
            rc = ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                         "%s: tensor '%s' holds the experts' gate and up fused (the converter's "
                         "--fuse-gate-up-exps); qlserve reads ffn_gate_exps and ffn_up_exps",
                         f->path, name);
            break;
        }
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
        if (!gguf_find_tensor(f, name) && c->arch == ENG_ARCH_GPT_OSS)
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: tensor '%s' is missing; every GPT-OSS layer is a mixture", f->path,
                         name);
        else if (!gguf_find_tensor(f, name))
            model_moe_set_dense(c, l);
    }
    return rc;
}

/* SmolLM3's NoPE layers: the converter writes no list of them, and
 * llama.cpp's smollm3 graph skips RoPE on every fourth layer ((l + 1) % 4
 * == 0, its n_no_rope_layer_step), which is SmolLM3Config's default; a
 * folder whose no_rope_layers says otherwise converts into a file that
 * llama.cpp and qlserve both run with that default. Its q/k rows are
 * permuted as a llama's (the converter's SmolLM3Model is a LlamaModel). */
static int gguf_smollm3_nope(const gguf_file *f, eng_config *c, char *msg, size_t msg_len)
{
    if (c->n_layers > ENG_MAX_NOPE_LAYERS)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: SmolLM3 with more than %d layers",
                       f->path, ENG_MAX_NOPE_LAYERS);
    for (int32_t l = 0; l < c->n_layers; l++)
        if ((l + 1) % 4 == 0)
            c->nope_layers[l / 64] |= (uint64_t)1 << (l % 64);
    return QL_OK;
}

/*
 * OLMo 3 as llama.cpp's olmo2 reads it (OLMo 2 is the same graph without
 * sliding layers): norms after attention and the MLP only, q/k norms over
 * the whole projection (attn_q_norm of n_embd, attn_k_norm of the kv
 * width), and, when ARCH.attention.sliding_window is set, the layers that
 * ARCH.attention.sliding_window_pattern marks (a bool per layer; every
 * fourth full without it) sliding over it with the rotation of
 * rope.freq_base_swa (freq_base when absent) and no scaling. The list must
 * be the repeating pattern eng_layer_slides knows; another is refused.
 */
static int parse_gguf_olmo(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                           size_t msg_len)
{
    char key[128];
    c->qk_norm = true;
    c->qk_norm_whole = true;
    c->post_norms = true;
    snprintf(key, sizeof key, "%s.attention.sliding_window", arch);
    int rc = gguf_uint(f, key, 0, false, &c->sliding_window, msg, msg_len);
    if (rc != QL_OK || c->sliding_window <= 0)
        return rc;
    c->sliding_pattern = 4;
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", arch);
    const gguf_kv *pat = gguf_find_kv(f, key);
    if (pat &&
        (pat->type != GGUF_ARRAY || pat->elem != GGUF_BOOL || pat->n != (uint64_t)c->n_layers))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s is not a bool per layer (%d)", f->path,
                       key, c->n_layers);
    int32_t first_full = -1;
    for (int32_t l = 0; pat && l < c->n_layers && first_full < 0; l++)
        if (!pat->data[l])
            first_full = l;
    if (pat)
        c->sliding_pattern = first_full < 0 ? 0 : first_full + 1;
    for (int32_t l = 0; pat && l < c->n_layers; l++)
        if ((pat->data[l] != 0) != eng_layer_slides(c, l))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: %s is not a repeating pattern of sliding layers closed by a full "
                           "one (layer %d breaks it); qlserve runs only those",
                           f->path, key, l);
    snprintf(key, sizeof key, "%s.rope.freq_base_swa", arch);
    return gguf_float(f, key, (double)c->rope_theta, &c->rope_local_theta, msg, msg_len);
}

/* Ministral 3 as llama.cpp's mistral3 reads it: Llama 4's query scaling
 * when ARCH.attention.temperature_scale is set (its beta), over periods of
 * the YaRN original context (n_ctx_orig_yarn there), which it then needs;
 * its q/k rows are permuted as a llama's (the converter's Ministral3Model
 * is a LlamaModel). llama.cpp's graph has no sliding window, and neither
 * does a file from its converter. */
static int parse_gguf_mistral3(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                               size_t msg_len)
{
    char key[128];
    snprintf(key, sizeof key, "%s.attention.temperature_scale", arch);
    int rc = gguf_float_or_zero(f, key, 0.0, &c->attn_temp_beta, msg, msg_len);
    if (rc == QL_OK && c->attn_temp_beta != 0.0f) {
        c->attn_temp_floor = c->rope_original_max_position;
        if (c->attn_temp_beta < 0.0f || c->attn_temp_floor <= 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: %s needs a non-negative beta and "
                           "%s.rope.scaling.original_context_length",
                           f->path, key, arch);
    }
    return rc;
}

static int parse_gguf_config(model_loader *L, char *msg, size_t msg_len)
{
    const gguf_file *f = L->m->gguf;
    eng_config *c = &L->m->cfg;
    const gguf_kv *a = gguf_find_kv(f, "general.architecture");
    if (!a || a->type != GGUF_STRING)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: general.architecture is missing", f->path);
    char arch[64];
    snprintf(arch, sizeof arch, "%.*s", (int)(a->str.len < 63 ? a->str.len : 63), a->str.ptr);
    if (strcmp(arch, "llama") == 0)
        c->arch = ENG_ARCH_LLAMA;
    else if (strcmp(arch, "qwen2") == 0)
        c->arch = ENG_ARCH_QWEN2;
    else if (strcmp(arch, "qwen3") == 0)
        c->arch = ENG_ARCH_QWEN3;
    else if (strcmp(arch, "phi3") == 0)
        c->arch = ENG_ARCH_PHI3;
    else if (strcmp(arch, "gemma2") == 0)
        c->arch = ENG_ARCH_GEMMA2;
    else if (strcmp(arch, "gemma3") == 0)
        c->arch = ENG_ARCH_GEMMA3;
    else if (strcmp(arch, "qwen2moe") == 0)
        c->arch = ENG_ARCH_QWEN2_MOE;
    else if (strcmp(arch, "qwen3moe") == 0)
        c->arch = ENG_ARCH_QWEN3_MOE;
    else if (strcmp(arch, "gpt-oss") == 0)
        c->arch = ENG_ARCH_GPT_OSS;
    else if (strcmp(arch, "smollm3") == 0)
        c->arch = ENG_ARCH_SMOLLM3;
    else if (strcmp(arch, "olmo2") == 0)
        c->arch = ENG_ARCH_OLMO3;
    else if (strcmp(arch, "mistral3") == 0)
        c->arch = ENG_ARCH_MINISTRAL3;
    else if (strcmp(arch, "qwen35") == 0 || strcmp(arch, "qwen35moe") == 0)
        c->arch = ENG_ARCH_QWEN3_5;
    else
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: GGUF architecture %s is not one qlserve runs (llama, qwen2, qwen3, "
                       "phi3, gemma2, gemma3, qwen2moe, qwen3moe, gpt-oss, smollm3, olmo2, "
                       "mistral3, qwen35, qwen35moe)",
                       f->path, arch);
    /* Qwen3.5-MoE: qwen35's layers with a mixture in every MLP */
    bool moe35 = strcmp(arch, "qwen35moe") == 0;
    /* Mixtral is a llama GGUF whose layers have experts */
    char experts_key[96];
    snprintf(experts_key, sizeof experts_key, "%s.expert_count", arch);
    const gguf_kv *n_exp = gguf_find_kv(f, experts_key);
    if (c->arch == ENG_ARCH_LLAMA && n_exp && n_exp->i > 0)
        c->arch = ENG_ARCH_MIXTRAL;
    char key[128];
    int rc = QL_OK;
#define U(k, def, req, dst)                                                                        \
    if (rc == QL_OK)                                                                               \
    rc = gguf_arch_uint(f, arch, k, def, req, dst, msg, msg_len)
    U("embedding_length", 0, true, &c->hidden_size);
    /* a Qwen3.5-MoE config has no intermediate_size, so the converter
     * writes no feed_forward_length: the MLP width is the experts' */
    U("feed_forward_length", 0, !moe35, &c->intermediate_size);
    if (moe35 && c->intermediate_size == 0) {
        U("expert_feed_forward_length", 0, true, &c->intermediate_size);
    }
    U("block_count", 0, true, &c->n_layers);
    U("attention.head_count", 0, true, &c->n_heads);
    if (rc != QL_OK)
        return rc;
    if (c->n_heads <= 0 || c->hidden_size <= 0 || c->n_layers <= 0 || c->intermediate_size <= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: model sizes must be positive", f->path);
    U("attention.head_count_kv", c->n_heads, false, &c->n_kv_heads);
    U("attention.key_length", c->hidden_size / c->n_heads, false, &c->head_dim);
    U("context_length", 2048, false, &c->max_position_embeddings);
#undef U
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 10000.0, &c->rope_theta, msg, msg_len);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    if (rc == QL_OK)
        rc = gguf_float(f, key, 1e-5, &c->rms_norm_eps, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads != 0 || c->head_dim <= 0 ||
        c->head_dim % 2)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %d heads, %d kv heads, head dim %d do not make an attention layer",
                       f->path, c->n_heads, c->n_kv_heads, c->head_dim);
    c->rope_factor = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    const gguf_kv *st = gguf_find_kv(f, key);
    if (st && st->type == GGUF_STRING) {
        char type[32];
        snprintf(type, sizeof type, "%.*s", (int)(st->str.len < 31 ? st->str.len : 31),
                 st->str.ptr);
        snprintf(key, sizeof key, "%s.rope.scaling.factor", arch);
        if (strcmp(type, "linear") == 0) {
            c->rope_scaling = ENG_ROPE_LINEAR;
            rc = gguf_float(f, key, 1.0, &c->rope_factor, msg, msg_len);
        } else if (strcmp(type, "yarn") == 0) {
            rc = parse_gguf_yarn(f, arch, c, msg, msg_len);
        } else if (strcmp(type, "none") != 0) {
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: rope scaling type %s is not supported (linear, yarn)", f->path,
                           type);
        }
    }
    if (rc == QL_OK) /* a bad linear factor stops here too */
        rc = gguf_rope_dims(f, arch, c, msg, msg_len);
    if (rc == QL_OK && c->arch == ENG_ARCH_PHI3)
        rc = gguf_phi3(f, c, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    /* llama.cpp's converter permutes llama q/k rows into adjacent rotary
     * pairs; it leaves qwen2's, qwen3's and phi3's as Hugging Face has them
     * (qwen3's q/k norms are attn_q_norm / attn_k_norm, per head as there) */
    c->rope_interleaved = c->arch == ENG_ARCH_LLAMA || c->arch == ENG_ARCH_MIXTRAL ||
                          c->arch == ENG_ARCH_SMOLLM3 || c->arch == ENG_ARCH_MINISTRAL3;
    if (c->arch == ENG_ARCH_SMOLLM3 && (rc = gguf_smollm3_nope(f, c, msg, msg_len)) != QL_OK)
        return rc;
    c->attention_bias = c->arch == ENG_ARCH_QWEN2 || c->arch == ENG_ARCH_QWEN2_MOE;
    c->qk_norm = c->arch == ENG_ARCH_QWEN3 || c->arch == ENG_ARCH_QWEN3_MOE;
    c->tie_word_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (!emb || emb->n_dims != 2)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor 'token_embd.weight' is missing",
                       f->path);
    c->vocab_size = (int32_t)emb->ne[1];
    int32_t bos = -1, eos = -1;
    rc = gguf_uint(f, "tokenizer.ggml.bos_token_id", -1, false, &bos, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_uint(f, "tokenizer.ggml.eos_token_id", -1, false, &eos, msg, msg_len);
    c->bos_token_id = bos;
    c->eos_token_id = eos;
    if (rc == QL_OK && (c->arch == ENG_ARCH_GEMMA2 || c->arch == ENG_ARCH_GEMMA3))
        rc = parse_gguf_gemma(f, arch, c, msg, msg_len);
    if (rc == QL_OK && c->arch == ENG_ARCH_OLMO3)
        rc = parse_gguf_olmo(f, arch, c, msg, msg_len);
    if (rc == QL_OK && c->arch == ENG_ARCH_MINISTRAL3)
        rc = parse_gguf_mistral3(f, arch, c, msg, msg_len);
    if (rc == QL_OK && c->arch == ENG_ARCH_QWEN3_5)
        rc = model_qwen35_config_gguf(f, arch, c, msg, msg_len);
    snprintf(key, sizeof key, "%s.attention.sliding_window", arch);
    if (rc == QL_OK && c->arch == ENG_ARCH_GPT_OSS &&
        (rc = gguf_uint(f, key, 0, false, &c->sliding_window, msg, msg_len)) == QL_OK)
        parse_gguf_gpt_oss(c);
    if (rc == QL_OK && (c->arch == ENG_ARCH_QWEN2_MOE || c->arch == ENG_ARCH_QWEN3_MOE ||
                        c->arch == ENG_ARCH_MIXTRAL || c->arch == ENG_ARCH_GPT_OSS || moe35))
        rc = parse_gguf_moe(f, arch, c, msg, msg_len);
    return rc;
}

static int load_gguf_tensor(model_loader *L, const char *name, int64_t rows, int64_t cols,
                            tensor_role role, qtensor *out, char *msg, size_t msg_len)
{
    const gguf_file *f = L->m->gguf;
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: tensor '%s' is missing", f->path, name);
    int rc = gguf_tensor_qtensor(f, t, out, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int64_t want_rows = cols == 0 ? 1 : rows, want_cols = cols == 0 ? rows : cols;
    if (out->rows != want_rows || out->cols != want_cols) {
        rc = model_shape_mismatch(f->path, name, out->rows, out->cols, want_rows, want_cols, msg,
                                  msg_len);
        qt_free(out);
        return rc;
    }
    return model_finish_weight(L, name, role, out, msg, msg_len);
}

int model_load_gguf(model_loader *L, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    m->gguf = calloc(1, sizeof *m->gguf);
    if (!m->gguf)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    int rc = gguf_open(m->gguf, L->o->path, msg, msg_len);
    if (rc != QL_OK) {
        free(m->gguf);
        m->gguf = NULL;
        return rc;
    }
    snprintf(m->format, sizeof m->format, "gguf");
    const gguf_kv *own = gguf_find_kv(m->gguf, "general.name");
    bool named = own && own->type == GGUF_STRING;
    model_set_name(m, named ? own->str.ptr : NULL, named ? own->str.len : 0, L->o->path);
    rc = parse_gguf_config(L, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_config *c = &m->cfg;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    int64_t h = c->hidden_size;
    rc = load_gguf_tensor(L, "token_embd.weight", c->vocab_size, h, ROLE_EMBED, &m->embed, msg,
                          msg_len);
    if (rc == QL_OK)
        rc = load_gguf_tensor(L, "output_norm.weight", h, 0, ROLE_DENSE, &m->norm, msg, msg_len);
    if (rc == QL_OK && !c->tie_word_embeddings)
        rc = load_gguf_tensor(L, "output.weight", c->vocab_size, h, ROLE_LM_HEAD, &m->lm_head, msg,
                              msg_len);
    if (rc == QL_OK)
        rc = model_layers_load(L, load_gguf_tensor, true, msg, msg_len);
    if (rc == QL_OK)
        rc = model_qwen35_mtp_load_gguf(L, load_gguf_tensor, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    return tok_from_gguf(&m->tok, m->gguf, msg, msg_len);
}

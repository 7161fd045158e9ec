/*
 * fused_experts.c - PEFT's LoRA on a mixture of experts' fused parameters
 * (adapter_config's target_parameters: "mlp.experts.gate_up_proj",
 * "mlp.experts.down_proj", the tensors transformers 5 holds experts in) as
 * the engine's per-expert modules, so an adapter trained on fused experts
 * applies, merges and unmerges expert by expert like any projection.
 *
 * PEFT's ParamWrapper (tuners/lora/layer.py) gives a parameter of shape
 * [experts, d1, d2] one lora_A of r * experts rows and one lora_B of
 * r * experts columns: expert e's A is rows e*r .. e*r + r - 1, its B the
 * columns k * experts + e (get_delta_weight's reshape of B to
 * [out, r, experts]); its delta is scale * B_e @ A_e, in the orientation
 * of the projection (out, in): for Qwen's and Mixtral's experts PEFT swaps
 * d1 and d2 (gate_up_proj [E, 2I, H] has in H, out 2I), which is our
 * [rows, cols]. Two wrapped parameters of one module nest: the one wrapped
 * first sits under "base_layer.".
 *
 * It owns nothing: each module's A and B are copies the adapter owns
 * (peft.c frees them with the rest).
 */
#include "internal/fused_experts.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const fused_names[LORA_FUSED_N] = {"experts.gate_up_proj", "experts.down_proj"};

int lora_fused_param_of(const char *target)
{
    size_t n = strlen(target);
    for (int p = 0; p < LORA_FUSED_N; p++) {
        size_t k = strlen(fused_names[p]);
        if (n >= k && strcmp(target + n - k, fused_names[p]) == 0 &&
            (n == k || target[n - k - 1] == '.'))
            return p;
    }
    return -1;
}

static bool skip(const char **s, const char *prefix)
{
    size_t n = strlen(prefix);
    if (strncmp(*s, prefix, n) != 0)
        return false;
    *s += n;
    return true;
}

bool lora_fused_key(const char *key, int64_t *layer, int *depth, bool *is_b)
{
    const char *s = key;
    skip(&s, "base_model.model.");
    if (!skip(&s, "model.layers.") || !isdigit((unsigned char)*s))
        return false;
    char *end;
    unsigned long long l = strtoull(s, &end, 10);
    s = end;
    if (l > INT32_MAX || !skip(&s, ".mlp.experts."))
        return false;
    int d = 0;
    while (skip(&s, "base_layer."))
        d++;
    bool b;
    if (skip(&s, "lora_A"))
        b = false;
    else if (skip(&s, "lora_B"))
        b = true;
    else
        return false;
    if (strcmp(s, ".weight") != 0 && strcmp(s, ".default.weight") != 0)
        return false;
    *layer = (int64_t)l;
    *depth = d;
    *is_b = b;
    return true;
}

/* A float tensor we compute with, [rows, cols], owned (its bytes added to
 * *copied); NULL data on failure. */
static int new_dense(qtensor *t, st_dtype dt, int64_t rows, int64_t cols, size_t *copied)
{
    memset(t, 0, sizeof *t);
    size_t bytes = (size_t)(rows * cols) * st_dtype_size(dt);
    t->data = malloc(bytes ? bytes : 1);
    if (!t->data)
        return QL_ENOMEM;
    t->kind = (qt_kind)st_dtype_qt_kind(dt);
    t->rows = rows;
    t->cols = cols;
    t->data_bytes = bytes;
    *copied += bytes;
    return QL_OK;
}

/* Expert e's module from the fused factors: A's rows e*r .., and B's rows
 * [o0, o0 + n_out) (every `step`-th from o0: 1, or 2 for interleaved
 * halves) at columns k * E + e. */
static int expert_module(const st_tensor *a, const st_tensor *b, int64_t e, int64_t E, int64_t r,
                         int64_t o0, int64_t n_out, float scale, eng_lora_module *mod,
                         size_t *copied)
{
    size_t es = st_dtype_size(a->dtype), eb = st_dtype_size(b->dtype);
    int64_t in = a->shape[1], cols_b = b->shape[1];
    if (new_dense(&mod->a, a->dtype, r, in, copied) != QL_OK ||
        new_dense(&mod->b, b->dtype, n_out, r, copied) != QL_OK)
        return QL_ENOMEM;
    memcpy(mod->a.data, a->data + (size_t)(e * r * in) * es, (size_t)(r * in) * es);
    for (int64_t o = 0; o < n_out; o++)
        for (int64_t k = 0; k < r; k++)
            memcpy(mod->b.data + (size_t)(o * r + k) * eb,
                   b->data + (size_t)((o0 + o) * cols_b + k * E + e) * eb, eb);
    mod->scale = scale;
    return QL_OK;
}

int lora_fused_build(const eng_model *m, int32_t layer, lora_fused_param which, const st_tensor *a,
                     const st_tensor *b, int32_t rank, float scale, eng_lora_module *row,
                     size_t *copied, const char *path, char *msg, size_t msg_len)
{
    const eng_config *c = &m->cfg;
    int64_t E = c->n_experts, F = c->expert_ff, H = c->hidden_size, r = rank;
    int64_t in = which == LORA_FUSED_GATE_UP ? H : F, out = which == LORA_FUSED_GATE_UP ? 2 * F : H;
    const st_tensor *ts[2] = {a, b};
    const int64_t want[2][2] = {{r * E, in}, {out, r * E}};
    for (int i = 0; i < 2; i++) {
        const st_tensor *t = ts[i];
        if (st_dtype_qt_kind(t->dtype) < 0 || t->ndim != 2 || t->shape[0] != want[i][0] ||
            t->shape[1] != want[i][1])
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: tensor '%s' (lora_%c of layer %d's %s, %lld experts at rank %d) "
                           "must be F32, F16 or BF16 of [%lld, %lld]",
                           path, t->name, i ? 'B' : 'A', layer, fused_names[which], (long long)E,
                           rank, (long long)want[i][0], (long long)want[i][1]);
    }
    for (int64_t e = 0; e < E; e++) {
        int rc = QL_OK;
        if (which == LORA_FUSED_DOWN) {
            eng_lora_module *mod = &row[eng_expert_proj((int32_t)e, ENG_PROJ_DOWN)];
            rc = expert_module(a, b, e, E, r, 0, H, scale, mod, copied);
        } else {
            /* the gate's rows, then the up's */
            eng_lora_module *g = &row[eng_expert_proj((int32_t)e, ENG_PROJ_GATE)];
            eng_lora_module *u = &row[eng_expert_proj((int32_t)e, ENG_PROJ_UP)];
            rc = expert_module(a, b, e, E, r, 0, F, scale, g, copied);
            if (rc == QL_OK)
                rc = expert_module(a, b, e, E, r, F, F, scale, u, copied);
        }
        if (rc != QL_OK)
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory for layer %d's experts",
                           path, layer);
    }
    return QL_OK;
}

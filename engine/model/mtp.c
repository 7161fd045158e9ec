/*
 * mtp.c - reading a checkpoint's multi-token-prediction layers (mtp.h):
 * Qwen3.5's mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
 * mtp.norm and mtp.layers.N.*, each layer a full-attention decoder layer
 * read by layers.c's table as the decoder's are.
 *
 * A GGUF's are the last nextn_predict_layers blocks (blk.N.nextn.eh_proj,
 * .enorm, .hnorm, .shared_head_norm beside the layer's own tensors), which
 * qwen35.c reads into the same eng_mtp. It also has what runs on them
 * beside the forward pass: the layers as a model of their own
 * (eng_mtp_view) and the rows they take in (eng_mtp_concat); the MTP
 * drafter (engine/scheduler/mtp_drafter.c) runs them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal/model_internal.h"

int model_mtp_load_hf(model_loader *L, model_tensor_loader load, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    const eng_config *c = &m->cfg;
    int32_t n = c->linear.mtp_layers;
    const st_file *f;
    /* a mixture's MTP layer is a mixture too, not read yet: the model runs
     * without it, as its GGUF does (--speculative mtp says why it has none) */
    if (n <= 0 || c->n_experts > 0 || !model_find_st(L, "mtp.fc.weight", &f))
        return QL_OK;
    int64_t h = c->hidden_size;
    eng_mtp *mtp = &m->mtp;
    mtp->layers = calloc((size_t)n, sizeof *mtp->layers);
    if (!mtp->layers)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    mtp->n_layers = n; /* what model_mtp_free frees, loaded or half */
    int rc = load(L, "mtp.fc.weight", h, 2 * h, ROLE_LINEAR, &mtp->fc, msg, msg_len);
    if (rc == QL_OK)
        rc = load(L, "mtp.pre_fc_norm_embedding.weight", h, 0, ROLE_DENSE, &mtp->norm_embed, msg,
                  msg_len);
    if (rc == QL_OK)
        rc = load(L, "mtp.pre_fc_norm_hidden.weight", h, 0, ROLE_DENSE, &mtp->norm_hidden, msg,
                  msg_len);
    if (rc == QL_OK)
        rc = load(L, "mtp.norm.weight", h, 0, ROLE_DENSE, &mtp->norm, msg, msg_len);
    for (int32_t i = 0; i < n && rc == QL_OK; i++) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "mtp.layers.%d.", i);
        rc = model_layer_load_full(L, load, prefix, &mtp->layers[i], msg, msg_len);
    }
    return rc;
}

void model_mtp_each(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx)
{
    const eng_mtp *mtp = &m->mtp;
    if (mtp->n_layers == 0)
        return;
    const qtensor *top[] = {&mtp->fc, &mtp->norm_embed, &mtp->norm_hidden, &mtp->norm};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++)
        if (top[i]->rows)
            fn(top[i], ctx);
    for (int32_t i = 0; i < mtp->n_layers; i++)
        model_layer_each(&m->cfg, &mtp->layers[i], fn, ctx);
}

void model_mtp_free(eng_model *m)
{
    eng_mtp *mtp = &m->mtp;
    qt_free(&mtp->fc);
    qt_free(&mtp->norm_embed);
    qt_free(&mtp->norm_hidden);
    qt_free(&mtp->norm);
    for (int32_t i = 0; mtp->layers && i < mtp->n_layers; i++)
        model_layer_free(&mtp->layers[i]);
    free(mtp->layers);
    mtp->layers = NULL;
    mtp->n_layers = 0;
}

void eng_mtp_view(const eng_model *m, eng_model *view)
{
    *view = *m;
    eng_config *c = &view->cfg;
    c->n_layers = m->mtp.n_layers;
    memset(c->linear.layers, 0, sizeof c->linear.layers); /* full attention, all */
    c->linear.n_layers = 0;
    view->layers = m->mtp.layers;
    view->norm = m->mtp.norm;
    memset(&view->mtp, 0, sizeof view->mtp);
}

/* The model's RMSNorm of x (n values) by w into out: x / rms(x) * (norm_offset + w). */
static void rmsnorm_row(const eng_config *c, const float *x, const float *w, int64_t n, float *out)
{
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    double scale = 1.0 / sqrt(ss / (double)n + c->rms_norm_eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = (float)(x[i] * scale * (c->norm_offset + w[i]));
}

int eng_mtp_concat(const eng_model *m, const int32_t *tokens, const float *hidden, int32_t n,
                   float *cat)
{
    const eng_config *c = &m->cfg;
    int64_t H = c->hidden_size;
    float *emb = malloc((size_t)(3 * H) * sizeof(float));
    if (!emb)
        return QL_ENOMEM;
    // the two norms' weights, once for all rows
    float *w_embed = emb + H, *w_hidden = emb + 2 * H;
    qt_dequantize_rows(&m->mtp.norm_embed, 0, m->mtp.norm_embed.rows, w_embed);
    qt_dequantize_rows(&m->mtp.norm_hidden, 0, m->mtp.norm_hidden.rows, w_hidden);
    for (int32_t i = 0; i < n; i++) {
        // the token's embedding and the hidden state, each normed; the embedding first
        float *row = cat + (size_t)i * (size_t)(2 * H);
        qt_dequantize_rows(&m->embed, tokens[i], 1, emb);
        rmsnorm_row(c, emb, w_embed, H, row);
        rmsnorm_row(c, hidden + (size_t)i * (size_t)H, w_hidden, H, row + H);
    }
    free(emb);
    return QL_OK;
}

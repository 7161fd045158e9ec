/*
 * mtp.h - a checkpoint's multi-token-prediction layers as engine/model/
 * holds them (eng_mtp, a part of eng_model): Qwen3.5's mtp.*, which its
 * releases ship for drafting (`--speculative mtp`, issue 37) and the
 * forward pass never reads. Included by model.h (include model.h); split
 * from it for length alone.
 *
 * What they compute (vLLM's Qwen3.5 MTP; tests/fixtures/make_qwen35_mtp.py
 * holds the float64 reference): row i takes the model's hidden state at
 * position i after its final norm and the embedding of token i + 1;
 * fc(concat(norm_embed(e), norm_hidden(h))) runs through layers[0], a
 * full-attention decoder layer with its own KV, at position i; norm, then
 * the model's lm_head, gives the logits of token i + 2.
 */
#ifndef QL_MODEL_MTP_H
#define QL_MODEL_MTP_H

#include <stdint.h>

#include "modelfile.h"

struct eng_layer;

typedef struct eng_mtp {
    int32_t n_layers; /* loaded (0: the checkpoint has none) */
    qtensor fc;       /* [hidden, 2 hidden], no bias: the embedding's half first */
    /* [hidden] each, scaling by (cfg.norm_offset + w) as the model's: pre_fc_norm_embedding,
     * pre_fc_norm_hidden, and the one after the layers */
    qtensor norm_embed, norm_hidden, norm;
    struct eng_layer *layers; /* n_layers (owned) */
} eng_mtp;

struct eng_model;

/* m's MTP layers as a model of their own, into *view: m's config with
 * n_layers of them, all full attention; their layers as its decoder,
 * mtp.norm as its final norm, m's embeddings and lm_head. It borrows
 * every tensor (never free it; m must outlive it) and runs on a backend of
 * its own, whose KV cache is the MTP's. m must have MTP layers. */
void eng_mtp_view(const struct eng_model *m, struct eng_model *view);
/* The rows the MTP's fc takes, n of them into cat (n x 2 hidden): row i is
 * concat(norm_embed(embed(tokens[i])), norm_hidden(hidden + i hidden)), the
 * embedding's half first, each the model's RMSNorm (sums in double). fc of
 * them is what the MTP takes in place of token embeddings; the MTP drafter
 * runs it on its pool (eng_mtp_input). QL_ENOMEM (cat unwritten) when its
 * scratch cannot be had. */
int eng_mtp_concat(const struct eng_model *m, const int32_t *tokens, const float *hidden, int32_t n,
                   float *cat);

#endif

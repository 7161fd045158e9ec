/*
 * vocab_tokenizer.c - the vocabulary trie (gr_vocab) a tokenizer's tokens
 * make: the one file of grammar/ that reads tokenizer/, so the model and
 * the engine never build the trie themselves; whoever needs it (the
 * scheduler, once per engine) asks grammar/ with the model's tokenizer.
 */
#include "grammar.h"
#include "tokenizer.h"

/* gr_token_bytes_fn over a tokenizer: ids past its vocabulary (padding
 * rows of a model's embedding) add nothing. */
static long token_bytes(void *user, int32_t id, uint8_t *out, size_t cap)
{
    const tok_tokenizer *t = user;
    return (size_t)id < tok_vocab_size(t) ? tok_token_bytes(t, id, out, cap) : 0;
}

int gr_vocab_from_tokenizer(gr_vocab **out, const struct tok_tokenizer *tok, int32_t n_tokens,
                            int32_t eos, char *msg, size_t msg_len)
{
    /* gr_vocab_new only reads through user: the cast drops no promise */
    return gr_vocab_new(out, n_tokens, token_bytes, (void *)tok, eos, msg, msg_len);
}

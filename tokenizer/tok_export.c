/*
 * tok_export.c - what a loaded tokenizer holds, read back in the terms a
 * GGUF file stores it in (tokenizer.ggml.*), so `qlserve quantize` can
 * write a Hugging Face folder's tokenizer into a GGUF that llama.cpp and
 * tok_gguf.c read back to the same ids.
 *
 * It offers tok_token_text, tok_gguf_model, tok_gguf_pre, tok_merges,
 * tok_unk and tok_token_id (tokenizer.h); it owns nothing beyond the merge
 * list it returns, and only reads the tokenizer it is given.
 */
#include "internal/tokenizer_internal.h"

#include <string.h>

const char *tok_token_text(const tok_tokenizer *t, int32_t id, size_t *len, int *type)
{
    if (!t || id < 0 || (size_t)id >= t->n_tokens || !t->has_text[id])
        return NULL;
    uint32_t n;
    const char *s = tok_text(t, id, &n);
    *len = n;
    *type = t->type[id];
    if (t->family == FAMILY_SPM && *type == TT_NORMAL) {
        /* tok_hf.c keeps byte and unknown pieces as normal tokens and knows
         * them by id; a GGUF says what they are in the type */
        if (id == t->unk)
            *type = TT_UNKNOWN;
        for (int b = 0; b < 256; b++)
            if (t->byte_id[b] == id)
                *type = TT_BYTE;
    }
    return s;
}

const char *tok_gguf_model(const tok_tokenizer *t)
{
    if (t->line_runs)
        return "gemma4";
    return t->family == FAMILY_SPM ? "llama" : "gpt2";
}

const char *tok_gguf_pre(const tok_tokenizer *t)
{
    if (t->family == FAMILY_SPM)
        return "default";
    /* the converter's name for Llama 3's tokenizer (tokenizer.json's
     * ignore_merges on), before the other names of the same regex */
    if (t->n_steps == 1 && t->steps[0] == STEP_LLAMA3 && t->ignore_merges)
        return "llama-bpe";
    /* o200k's regex: the converter names it "gpt-4o", and llama.cpp runs its
     * own rewrite of it (STEP_GPT4O), as it does for the converter's files */
    if (t->n_steps == 1 && (t->steps[0] == STEP_O200K || t->steps[0] == STEP_GPT4O))
        return "gpt-4o";
    static const char *const names[] = {"gpt-2",          "smollm",       "qwen2",
                                        "smaug-bpe",      "qwen35",       "falcon",
                                        "deepseek-coder", "deepseek-llm", "bloom"};
    for (size_t k = 0; k < N_ELEMS(names); k++) {
        const tok_pre *p = tok_pre_named(names[k], strlen(names[k]));
        bool same = p && p->n_steps == t->n_steps && p->ignore_merges == t->ignore_merges;
        for (int i = 0; same && i < t->n_steps; i++)
            same = p->steps[i] == t->steps[i];
        if (same)
            return p->name;
    }
    return NULL;
}

int tok_merges(const tok_tokenizer *t, int32_t **merges, size_t *n)
{
    *merges = NULL;
    *n = 0;
    const pair_map *m = &t->merges;
    if (!m->slots)
        return QL_OK;
    uint32_t top = 0;
    size_t count = 0;
    for (size_t i = 0; i <= m->mask; i++)
        if (m->slots[i].key != PAIR_EMPTY) {
            count++;
            top = m->slots[i].rank > top ? m->slots[i].rank : top;
        }
    if (count == 0)
        return QL_OK;
    /* a repeated pair keeps its first rank, so ranks may have holes: place
     * each merge at its rank, then close the holes */
    int32_t *by_rank = malloc(((size_t)top + 1) * 3 * sizeof *by_rank);
    if (!by_rank)
        return QL_ENOMEM;
    for (size_t r = 0; r <= top; r++)
        by_rank[3 * r + 2] = -1;
    for (size_t i = 0; i <= m->mask; i++) {
        const pair_slot *s = &m->slots[i];
        if (s->key == PAIR_EMPTY)
            continue;
        int32_t *e = &by_rank[3 * (size_t)s->rank];
        e[0] = (int32_t)(s->key >> 32);
        e[1] = (int32_t)(s->key & 0xffffffffu);
        e[2] = s->id;
    }
    size_t k = 0;
    for (size_t r = 0; r <= top; r++)
        if (by_rank[3 * r + 2] >= 0) {
            memmove(&by_rank[3 * k], &by_rank[3 * r], 3 * sizeof *by_rank);
            k++;
        }
    *merges = by_rank;
    *n = k;
    return QL_OK;
}

int32_t tok_unk(const tok_tokenizer *t)
{
    return t->unk;
}

int32_t tok_token_id(const tok_tokenizer *t, const char *s, size_t n)
{
    return tok_vocab_find(t, s, n);
}

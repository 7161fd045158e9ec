/*
 * fuzz_tok_check.h - what the tokenizer fuzzers check of a loaded
 * tokenizer, shared by fuzz_tokenizer, fuzz_tokenizer_json and
 * fuzz_vocab_gguf: ids decode, and the streaming decoder gives the bytes
 * tok_decode gives (decode.c runs one as the other). Any failure aborts,
 * which libFuzzer reports with the input.
 */
#ifndef QL_FUZZ_TOK_CHECK_H
#define QL_FUZZ_TOK_CHECK_H

#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Decode ids whole and streamed (skipping special tokens as tok_decode
 * does when skip), abort unless both succeed and agree; the whole text
 * (the caller frees it). piece_cap must hold 3 x (3 + the longest piece):
 * a piece is at most its token's text, so 3 x (3 + the file's size) does
 * for a tokenizer loaded from that file. */
static inline char *fuzz_decode_checked(const tok_tokenizer *t, const int32_t *ids, size_t n,
                                        bool skip, size_t piece_cap, size_t *len)
{
    char msg[256];
    char *text = NULL;
    if (tok_decode(t, ids, n, skip, &text, len, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "fuzz: the ids encode gave do not decode: %s\n", msg);
        abort();
    }
    char *piece = malloc(piece_cap);
    if (!piece)
        abort();
    tok_stream s = {0};
    size_t at = 0;
    for (size_t i = 0; i <= n; i++) {
        long got;
        if (i == n)
            got = tok_stream_flush(t, &s, piece, piece_cap);
        else if (skip && tok_is_special(t, ids[i]))
            continue;
        else
            got = tok_stream_push(t, &s, ids[i], piece, piece_cap);
        if (got < 0 || at + (size_t)got > *len || memcmp(text + at, piece, (size_t)got) != 0) {
            fprintf(stderr, "fuzz: the stream differs from tok_decode at byte %zu\n", at);
            abort();
        }
        at += (size_t)got;
    }
    if (at != *len)
        abort(); /* the stream gave less than tok_decode */
    free(piece);
    return text;
}

/* Encode a fixed text mixing letters, digits, spaces, a combining mark,
 * added-token look-alikes, ▁ and invalid bytes, with and without special
 * tokens: a loaded tokenizer encodes any text into ids inside its
 * vocabulary, which decode. */
static inline void fuzz_encode_sample(const tok_tokenizer *t, size_t piece_cap)
{
    static const char sample[] = "Hello, world! 123 4567  \n\t e\xcc\x81 caf\xc3\xa9 <|endoftext|> "
                                 "<s>\xe2\x96\x81x \xff\xfe \xf0\x9f\x98\x80 it's";
    char msg[256];
    for (int special = 0; special < 2; special++) {
        int32_t *ids = NULL;
        size_t n = 0, len;
        if (tok_encode(t, sample, sizeof sample - 1, true, special, &ids, &n, msg, sizeof msg) !=
            QL_OK)
            abort();
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || (size_t)ids[i] >= tok_vocab_size(t))
                abort();
        free(fuzz_decode_checked(t, ids, n, special, piece_cap, &len));
        free(ids);
    }
}

#endif

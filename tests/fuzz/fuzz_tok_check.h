/*
 * fuzz_tok_check.h - what the tokenizer fuzzers check of a loaded
 * tokenizer, shared by fuzz_tokenizer, fuzz_tokenizer_json and
 * fuzz_vocab_gguf: ids decode; the streaming decoder gives the bytes
 * tok_decode gives; and both give the text worked out here from each id's
 * bytes alone (fuzz_reference_decode), not through decode.c, which runs
 * tok_decode as the stream and so could agree with it while both are
 * wrong. Any failure aborts, which libFuzzer reports with the input.
 */
#ifndef QL_FUZZ_TOK_CHECK_H
#define QL_FUZZ_TOK_CHECK_H

#include "tokenizer.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A growing byte buffer; aborts when memory runs out. */
typedef struct fuzz_bytes {
    char *p;
    size_t n, cap;
} fuzz_bytes;

static inline void fuzz_put(fuzz_bytes *b, const void *data, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = 2 * (b->n + n + 1);
        char *p = realloc(b->p, cap);
        if (!p)
            abort();
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
    b->p[b->n] = 0;
}

/*
 * At p[0..n): the length of the well-formed UTF-8 character there, or
 * minus the length of the longest start of one that cannot be completed
 * (at least 1): a maximal subpart, in Unicode's words (chapter 3, U+FFFD
 * substitution). The table is Unicode's Table 3-7: per range of lead
 * bytes, the character's length and its second byte's range (every later
 * byte is 80..BF); 80..C1 and F5..FF lead nothing.
 */
static inline long fuzz_utf8_at(const uint8_t *p, size_t n)
{
    static const struct {
        uint8_t first, last, len, lo, hi;
    } table_3_7[] = {
        {0xC2, 0xDF, 2, 0x80, 0xBF}, {0xE0, 0xE0, 3, 0xA0, 0xBF}, {0xE1, 0xEC, 3, 0x80, 0xBF},
        {0xED, 0xED, 3, 0x80, 0x9F}, {0xEE, 0xEF, 3, 0x80, 0xBF}, {0xF0, 0xF0, 4, 0x90, 0xBF},
        {0xF1, 0xF3, 4, 0x80, 0xBF}, {0xF4, 0xF4, 4, 0x80, 0x8F},
    };
    if (p[0] < 0x80)
        return 1;
    for (size_t r = 0; r < sizeof table_3_7 / sizeof *table_3_7; r++) {
        if (p[0] < table_3_7[r].first || p[0] > table_3_7[r].last)
            continue;
        for (size_t k = 1; k < table_3_7[r].len; k++) {
            uint8_t lo = k == 1 ? table_3_7[r].lo : 0x80, hi = k == 1 ? table_3_7[r].hi : 0xBF;
            if (k >= n || p[k] < lo || p[k] > hi)
                return -(long)k;
        }
        return table_3_7[r].len;
    }
    return -1;
}

/* The bytes p[0..n) into out with each maximal subpart replaced by U+FFFD:
 * once (byte-level BPE, as tokenizers' from_utf8_lossy) or once per byte
 * (SentencePiece's byte fallback). */
static inline void fuzz_put_lossy(fuzz_bytes *out, const uint8_t *p, size_t n, bool per_byte)
{
    static const char replacement[] = "\xEF\xBF\xBD";
    for (size_t i = 0; i < n;) {
        long len = fuzz_utf8_at(p + i, n - i);
        if (len > 0) {
            fuzz_put(out, p + i, (size_t)len);
            i += (size_t)len;
            continue;
        }
        for (long k = 0; k < (per_byte ? -len : 1); k++)
            fuzz_put(out, replacement, 3);
        i += (size_t)-len;
    }
}

/*
 * Under SentencePiece, whether id is a byte token (its text <0xXX>, its
 * one byte XX): a run of them may join into one character, while any other
 * token ends the run. -1 when the public API cannot tell: a one-byte piece
 * of 0x80 or above whose text says no such byte (an added token's text can
 * stand in for the vocabulary's, and tok_token_text gives the latter).
 */
static inline int fuzz_spm_byte_token(const tok_tokenizer *t, int32_t id, const uint8_t *bytes,
                                      long n)
{
    size_t len = 0;
    int type;
    const char *text = tok_token_text(t, id, &len, &type);
    if (text && len == 6 && memcmp(text, "<0x", 3) == 0 && text[5] == '>' &&
        isxdigit((unsigned char)text[3]) && isxdigit((unsigned char)text[4])) {
        char hex[3] = {text[3], text[4], 0};
        if (n == 1 && bytes[0] == (uint8_t)strtol(hex, NULL, 16))
            return 1;
    }
    return n == 1 && bytes[0] >= 0x80 ? -1 : 0;
}

/*
 * The text the non-special ids of ids[0..n) decode to, from each id's bytes
 * alone (tok_token_bytes): joined, each maximal subpart of ill-formed UTF-8
 * replaced (fuzz_put_lossy), where under SentencePiece a run of byte tokens
 * is cut at every other token. A SentencePiece decoder may also drop one
 * leading space (Strip), which the public API does not say: the caller
 * allows both. False (nothing in *out) when fuzz_spm_byte_token cannot
 * tell a token's kind; a fixture tokenizer never makes it so.
 */
static inline bool fuzz_reference_decode(const tok_tokenizer *t, const int32_t *ids, size_t n,
                                         size_t piece_cap, fuzz_bytes *out)
{
    /* Gemma 4's vocabulary is SentencePiece's too (byte tokens, a run of
     * them replaced per byte), without the leading ▁ */
    const char *model = tok_gguf_model(t);
    bool spm = strcmp(model, "llama") == 0 || strcmp(model, "gemma4") == 0;
    uint8_t *piece = malloc(piece_cap);
    fuzz_bytes run = {0}; /* the bytes since the last cut */
    if (!piece)
        abort();
    bool ok = true;
    for (size_t i = 0; ok && i < n; i++) {
        if (tok_is_special(t, ids[i]))
            continue;
        long got = tok_token_bytes(t, ids[i], piece, piece_cap);
        if (got < 0)
            abort(); /* an id encode gave that has no bytes */
        int byte_token = spm ? fuzz_spm_byte_token(t, ids[i], piece, got) : 1;
        ok = byte_token >= 0;
        if (spm && byte_token == 0) {
            fuzz_put_lossy(out, (const uint8_t *)run.p, run.n, true);
            run.n = 0;
        }
        fuzz_put(&run, piece, (size_t)got);
    }
    if (ok)
        fuzz_put_lossy(out, (const uint8_t *)run.p, run.n, spm);
    fuzz_put(out, "", 0);
    free(run.p);
    free(piece);
    return ok;
}

/* ids through a fresh stream (special ids left out when skip), the text
 * joined into out; aborts when a push or the flush fails. */
static inline void fuzz_stream_decode(const tok_tokenizer *t, const int32_t *ids, size_t n,
                                      bool skip, size_t piece_cap, fuzz_bytes *out)
{
    char *piece = malloc(piece_cap);
    if (!piece)
        abort();
    tok_stream s = {0};
    for (size_t i = 0; i <= n; i++) {
        long got;
        if (i == n)
            got = tok_stream_flush(t, &s, piece, piece_cap);
        else if (skip && tok_is_special(t, ids[i]))
            continue;
        else
            got = tok_stream_push(t, &s, ids[i], piece, piece_cap);
        if (got < 0) {
            fprintf(stderr, "fuzz: the stream refused id %zu of %zu\n", i, n);
            abort();
        }
        fuzz_put(out, piece, (size_t)got);
    }
    fuzz_put(out, "", 0);
    free(piece);
}

/* Decode ids whole and streamed (skipping special tokens as tok_decode
 * does when skip), abort unless both succeed and agree, and unless the
 * stream without special tokens gives fuzz_reference_decode's text (or,
 * under SentencePiece, that text less a leading space); the whole text
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
    fuzz_bytes streamed = {0};
    fuzz_stream_decode(t, ids, n, skip, piece_cap, &streamed);
    if (streamed.n != *len || memcmp(streamed.p, text, *len) != 0) {
        fprintf(stderr, "fuzz: the stream gives %zu bytes, tok_decode %zu, and they differ\n",
                streamed.n, *len);
        abort();
    }
    fuzz_bytes plain = {0}, want = {0};
    if (!skip)
        fuzz_stream_decode(t, ids, n, true, piece_cap, &plain);
    const fuzz_bytes *got = skip ? &streamed : &plain;
    if (fuzz_reference_decode(t, ids, n, piece_cap, &want)) {
        bool same = got->n == want.n && memcmp(got->p, want.p, want.n) == 0;
        bool stripped = strcmp(tok_gguf_model(t), "llama") == 0 && want.n > 0 && want.p[0] == ' ' &&
                        got->n + 1 == want.n && memcmp(got->p, want.p + 1, got->n) == 0;
        if (!same && !stripped) {
            fprintf(stderr,
                    "fuzz: the ids decode to %zu bytes, their pieces joined to %zu: \"%s\" vs "
                    "\"%s\"\n",
                    got->n, want.n, got->p, want.p);
            abort();
        }
    }
    free(streamed.p);
    free(plain.p);
    free(want.p);
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

/*
 * fuzz_tokenizer.c - libFuzzer target for tok_encode and tok_decode with
 * real tokenizers: the fixtures of tests/fixtures/tokenizers/ (byte-level
 * GPT-2, Llama 3, SmolLM2; Qwen2, whose tokenizer.json normalizes NFC;
 * SentencePiece-style from tokenizer.json, Prepend, Replace and Metaspace;
 * and from GGUF, where SentencePiece merges by score; GPT-OSS's o200k_harmony
 * from tokenizer.json and GGUF), loaded once.
 *
 * The first input byte picks the tokenizer (low four bits) and the options
 * (0x10 add BOS, 0x20 parse special tokens, 0x40 skip special tokens when
 * decoding); the rest is the text. Whatever the bytes, encoding succeeds
 * and checks, where they are guaranteed:
 *   - every id lies in the vocabulary, and decodes;
 *   - the streaming decoder gives the bytes tok_decode gives, and both the
 *     ids' pieces joined with ill-formed UTF-8 replaced, worked out from
 *     each id's bytes (fuzz_tok_check.h), not by decode.c;
 *   - byte-level BPE without a normalizer is lossless: for valid UTF-8 text
 *     encoded without special-token parsing, decode(encode(x)) == x (an
 *     invalid byte decodes to U+FFFD; a special token may strip the space
 *     beside it, lstrip);
 *   - with NFC (Qwen2), decode(encode(x)) is NFC(x), so encoding it again
 *     gives the same ids (NFC is idempotent).
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seeds in tests/fuzz/corpus_tokenizer/.
 */
#include "fuzz_tok_check.h"
#include "ql_base.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* How a fixture is loaded and which of the invariants above hold for it. */
enum { LOSSLESS = 1, NFC = 2 };
static const struct {
    const char *file; /* under tests/fixtures/tokenizers/ */
    int checks;
} fixtures[] = {
    {"gpt2/tokenizer.json", LOSSLESS},
    {"llama3/tokenizer.json", LOSSLESS},
    {"smollm2/tokenizer.json", LOSSLESS},
    {"qwen2/tokenizer.json", NFC},
    {"spm/tokenizer.json", 0},
    {"spm_gemma/tokenizer.json", 0},
    {"spm_metaspace/tokenizer.json", 0},
    {"spm.gguf", 0},
    {"spm_gemma.gguf", 0},
    {"qwen2.gguf", LOSSLESS}, /* llama.cpp runs no normalizer from GGUF */
    {"llama3.gguf", LOSSLESS},
    {"gpt2.gguf", LOSSLESS},
    /* o200k_harmony cut to its texts: a byte it lacks is dropped, as
     * tokenizers drops it, so not lossless */
    {"gpt-oss/tokenizer.json", 0},
    {"gpt-oss/ggml-vocab-gpt-oss.gguf", 0},
};
#define N_FIXTURES (sizeof fixtures / sizeof *fixtures)

static tok_tokenizer *loaded[N_FIXTURES];

static tok_tokenizer *load(const char *file)
{
    char path[512], msg[512];
    snprintf(path, sizeof path, "%s/tokenizers/%s", QL_FIXTURES, file);
    tok_tokenizer *t = NULL;
    int rc;
    size_t n = strlen(path);
    if (n > 5 && strcmp(path + n - 5, ".gguf") == 0) {
        gguf_file g;
        rc = gguf_open(&g, path, msg, sizeof msg);
        if (rc == QL_OK) {
            rc = tok_from_gguf(&t, &g, msg, sizeof msg);
            gguf_close(&g);
        }
    } else {
        rc = tok_from_hf(&t, path, NULL, msg, sizeof msg);
    }
    if (rc != QL_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", msg);
        abort(); /* a fixture that no longer loads is a broken harness */
    }
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!loaded[0])
        for (size_t i = 0; i < N_FIXTURES; i++)
            loaded[i] = load(fixtures[i].file);
    if (size == 0)
        return 0;
    size_t which = (data[0] & 15u) % N_FIXTURES;
    bool add_bos = data[0] & 0x10, special = data[0] & 0x20, skip = data[0] & 0x40;
    const tok_tokenizer *t = loaded[which];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    char msg[256];
    int32_t *ids = NULL;
    size_t n = 0;
    if (tok_encode(t, text, len, add_bos, special, &ids, &n, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s refused %zu bytes: %s\n", fixtures[which].file, len,
                msg);
        abort(); /* any bytes encode */
    }
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (size_t)ids[i] >= tok_vocab_size(t))
            abort();
    size_t out_len;
    /* the fixtures' longest pieces are a few dozen bytes */
    char *out = fuzz_decode_checked(t, ids, n, skip, 1 << 12, &out_len);

    bool plain = !add_bos && !special && ql_utf8_invalid_at(data + 1, len) < 0;
    if (plain && (fixtures[which].checks & LOSSLESS) &&
        (out_len != len || memcmp(out, text, len) != 0)) {
        fprintf(stderr, "fuzz_tokenizer: %s: decode(encode(x)) != x\n", fixtures[which].file);
        abort();
    }
    if (plain && (fixtures[which].checks & NFC)) {
        int32_t *again = NULL;
        size_t n_again = 0;
        if (tok_encode(t, out, out_len, false, false, &again, &n_again, msg, sizeof msg) != QL_OK ||
            n_again != n || memcmp(again, ids, n * sizeof *ids) != 0) {
            fprintf(stderr, "fuzz_tokenizer: %s: encoding NFC(x) again gives other ids\n",
                    fixtures[which].file);
            abort();
        }
        free(again);
    }
    free(out);
    free(ids);
    return 0;
}

/*
 * fuzz_vocab_gguf.c - libFuzzer target for the GGUF tokenizer loader
 * (tok_from_gguf over tokenizer.ggml.*: model, pre, tokens, token_type,
 * scores, merges, the special token ids and flags). The input is a whole
 * GGUF file: what gguf_open accepts goes to tok_from_gguf, which must
 * refuse with a message or build a tokenizer; one it builds must encode a
 * fixed text (fuzz_encode_sample) into ids inside its vocabulary that
 * decode, whole and streamed alike, to their pieces joined
 * (fuzz_tok_check.h), with no fault, leak or hang.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time, seeded with the small vocabulary GGUFs of
 * tests/fixtures/tokenizers/ (ours and llama.cpp's).
 */
#include "fuzz_input.h"
#include "fuzz_tok_check.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_input_file(data, size, "gguf");
    if (!path)
        return 0;
    gguf_file g;
    char msg[512] = "";
    if (gguf_open(&g, path, msg, sizeof msg) != QL_OK)
        return 0;
    tok_tokenizer *t = NULL;
    msg[0] = 0;
    int rc = tok_from_gguf(&t, &g, msg, sizeof msg);
    gguf_close(&g); /* the tokenizer owns copies of what it kept */
    if (rc != QL_OK) {
        if (t || !msg[0])
            abort(); /* a refusal leaves no tokenizer and says why */
        return 0;
    }
    fuzz_encode_sample(t, 3 * (3 + size));
    tok_free(t);
    return 0;
}

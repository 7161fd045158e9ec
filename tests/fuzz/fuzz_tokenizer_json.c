/*
 * fuzz_tokenizer_json.c - libFuzzer target for the tokenizer.json loader
 * (tok_from_hf_json, the in-memory form of tok_from_hf): vocab, merges
 * (strings and pairs), added tokens, normalizer, pre-tokenizer, decoder
 * and post-processor, whatever the bytes. It must refuse with a message or
 * build a tokenizer; one it builds must encode a fixed text
 * (fuzz_encode_sample) into ids inside its vocabulary that decode, whole
 * and streamed alike, to their pieces joined (fuzz_tok_check.h), with no
 * fault, leak or hang.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time, seeded with tests/fixtures/tokenizers/<name>/tokenizer.json.
 */
#include "fuzz_tok_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char msg[512] = "";
    tok_tokenizer *t = NULL;
    if (tok_from_hf_json(&t, (const char *)data, size, "fuzz/tokenizer.json", msg, sizeof msg) !=
        QL_OK) {
        if (t || !msg[0])
            abort(); /* a refusal leaves no tokenizer and says why */
        return 0;
    }
    fuzz_encode_sample(t, 3 * (3 + size));
    (void)tok_describe(t);
    tok_free(t);
    return 0;
}

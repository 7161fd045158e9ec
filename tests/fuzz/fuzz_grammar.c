/*
 * fuzz_grammar.c - libFuzzer target for the grammar compilers of
 * grammar/: the input is compiled as a JSON Schema and as a regular
 * expression, each in a builder bounded to a small size (so a run stays
 * short). Whatever the bytes, a compile must succeed or refuse with a
 * message and no grammar; a grammar compiled from a schema may accept only
 * texts that are JSON (cJSON parses them), probed with a few fixed texts
 * and the input itself; a regex grammar is walked over the input's bytes.
 * No fault, no leak, no hang.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seeds in tests/fuzz/corpus_grammar/ with grammar.dict.
 */
#include "grammar.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* small: the matcher's work per probe grows with the grammar */
#define FUZZ_MAX_NODES 20000

static const char *const probes[] = {
    "{}",
    "[]",
    "\"a\"",
    "1",
    "-0.5e+3",
    "null",
    "true",
    "{\"a\":1}",
    "[1, \"x\"]",
    "\"\\u00e9\"",
    "{\"name\":\"a\",\"age\":3}",
    "\"2024-01-15T10:20:30Z\"",
    "[[[]]]",
    "{\"a\":{\"b\":[null]}}",
};

static gr_grammar *compile(gr_kind kind, const uint8_t *data, size_t size)
{
    gr_grammar *g = NULL;
    char msg[256] = "";
    if (gr_compile(kind, (const char *)data, size, FUZZ_MAX_NODES, &g, msg, sizeof msg) != QL_OK) {
        if (g || !msg[0])
            abort(); /* a refusal leaves no grammar and says why */
        return NULL;
    }
    if (!g)
        abort();
    return g;
}

/* A schema's grammar accepts JSON only. */
static void probe_json(const gr_grammar *g, const char *text, size_t n)
{
    if (!gr_grammar_accepts(g, text, n))
        return;
    cJSON *doc = cJSON_ParseWithLength(text, n);
    if (!doc)
        abort();
    cJSON_Delete(doc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    gr_grammar *g = compile(GR_JSON_SCHEMA, data, size);
    if (g) {
        for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++)
            probe_json(g, probes[i], strlen(probes[i]));
        probe_json(g, (const char *)data, size < 256 ? size : 256);
        gr_grammar_unref(g);
    }
    g = compile(GR_REGEX, data, size);
    if (g) {
        for (size_t n = 0; n <= size && n <= 64; n += 8)
            (void)gr_grammar_accepts(g, data, n);
        gr_grammar_unref(g);
    }
    return 0;
}

/*
 * fuzz_template.c - libFuzzer target for the chat-template renderer: the
 * input is a template's source. Whatever the bytes, tpl_compile must
 * accept or refuse with a message, and an accepted template must render
 * against a chat context (messages with a tool call, tools,
 * add_generation_prompt) to text or an error, within the renderer's
 * bounds: no fault, no leak, no hang (a small max_out keeps each run
 * short).
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seeds in tests/fuzz/corpus_template/.
 */
#include "template.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char context_json[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"Hi \\u00e9\"},"
    " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\", \"type\":"
    " \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1.5}}}]},"
    " {\"role\": \"tool\", \"content\": \"42\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static cJSON *context;
    if (!context)
        context = cJSON_Parse(context_json);
    char msg[256];
    tpl_template *t = NULL;
    if (tpl_compile(&t, (const char *)data, size, msg, sizeof msg) != QL_OK) {
        if (t || !msg[0])
            abort(); /* a refusal leaves no template and says why */
        return 0;
    }
    char *out = NULL;
    size_t n = 0;
    int err = tpl_render(t, context, 1 << 16, &out, &n, msg, sizeof msg);
    if (err == QL_OK && (!out || out[n] != 0 || n > (1 << 16)))
        abort(); /* NUL-terminated after its n bytes (a '\x00' escape may put a
                    NUL inside, as in Python), within max_out */
    if (err != QL_OK && out)
        abort();
    free(out);
    tpl_free(t);
    return 0;
}

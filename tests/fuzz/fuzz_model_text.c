/*
 * fuzz_model_text.c - libFuzzer target for what the server reads out of a
 * model's text: tool calls (server/tool_calls.c: parsed whole, followed as
 * written, the streaming safe prefix) and reasoning (server/reasoning.c:
 * the split, whole and as a stream). A model can be made to write any
 * bytes, so these are parsers of hostile input. The first byte picks the
 * tool-call syntax and the reasoning markers; the rest is the text. Every
 * range they answer must lie inside the text, the stream's answers must
 * only grow, and the split of a stream must end as the whole's: no fault,
 * no leak, no read past the text.
 *
 * Built with clang (-DQL_FUZZ=ON) and run for a bounded time, seeded from
 * tests/fuzz/corpus_model_text/.
 */
#include "internal/reasoning.h"
#include "internal/tool_calls.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The calls followed in text[0..len) lie inside it. */
static void check_scan(srv_tool_format f, const char *text, size_t len)
{
    srv_tool_partial parts[16];
    int n = srv_tool_calls_scan(f, text, len, parts, 16);
    if (n < 0 || n > 16)
        abort();
    for (int k = 0; k < n; k++) {
        const srv_tool_partial *p = &parts[k];
        if (p->name_at + p->name_len > len || (p->args_begun && p->args_at + p->args_len > len))
            abort();
        if (p->args_begun) {
            char *out = malloc(p->args_len + 1);
            if (srv_tool_json_minify(text + p->args_at, p->args_len, out) > p->args_len)
                abort();
            free(out);
        }
    }
}

static void check_split(srv_reason_format f, bool opens, const char *text, size_t len)
{
    srv_reason_view whole, v = {0};
    srv_reason_split(f, opens, text, len, true, 0, &whole);
    if (!whole.done || whole.reason_from > whole.reason_to || whole.reason_to > len ||
        whole.content_from > len)
        abort();
    /* as a stream: a few prefixes, the search carried on */
    size_t step = len / 7 + 1, sent = 0;
    for (size_t n = 0; n <= len; n += step) {
        srv_reason_split(f, opens, text, n, false, v.searched, &v);
        if (v.reason_from > v.reason_to || v.reason_to > n || v.content_from > n || v.searched > n)
            abort();
        if (v.reason_to > v.reason_from) {
            if (v.reason_to < sent)
                abort(); /* what went out is never taken back */
            sent = v.reason_to;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 8192)
        return 0;
    srv_tool_format f = (srv_tool_format)(data[0] % (SRV_TOOLS_HARMONY + 1));
    srv_reason_format r = (srv_reason_format)((data[0] >> 4) % 3);
    bool opens = data[0] & 0x80;
    /* a copy with a NUL after it, as the server's texts are */
    size_t len = size - 1;
    char *text = malloc(len + 1);
    memcpy(text, data + 1, len);
    text[len] = 0;
    srv_tool_calls tc;
    int n = srv_tool_calls_parse(f, text, len, &tc);
    if (n < -1 || (n > 0 && (size_t)n != tc.n))
        abort();
    srv_tool_calls_free(&tc);
    size_t safe = 0;
    for (size_t at = 0; at <= len; at += len / 5 + 1) {
        size_t next = srv_tool_calls_safe_prefix(f, text, at, safe);
        if (next > at || next < safe)
            abort(); /* within the text, and never less than before */
        safe = next;
        check_scan(f, text, at);
    }
    check_scan(f, text, len);
    check_split(r, opens, text, len);
    free(text);
    return 0;
}

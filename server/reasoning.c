/*
 * reasoning.c - a reasoning model's thinking kept apart from its answer:
 * the markers found at load, and an answer's text split into reasoning and
 * content, whole or while it streams.
 *
 * The split, as vLLM's reasoning parsers read these models: the text may
 * open with <think> (Qwen3 and SmolLM3 write it themselves; DeepSeek R1's
 * templates write it at the prompt's end, so the model's text begins
 * inside the block); the reasoning runs to </think>, and the content is
 * what follows. A thought never closed (max_tokens cut it) is all
 * reasoning. A text that opens with anything else is all content (Qwen3
 * asked not to think writes no block: its template closed an empty one in
 * the prompt). Whitespace around the reasoning and before the content is
 * left out of both, so that a stream can hold it back and still send, in
 * its deltas, exactly what the whole answer says.
 *
 * Offers srv_reason_format_of, srv_reason_prompt_opens and
 * srv_reason_split (internal/reasoning.h). Touches nothing else.
 */
#define _GNU_SOURCE /* memmem */
#include "internal/reasoning.h"

#include <string.h>

static const char open_marker[] = "<think>";
static const char close_marker[] = "</think>";
#define OPEN_LEN  (sizeof open_marker - 1)
#define CLOSE_LEN (sizeof close_marker - 1)

/* Harmony's markers (GPT-OSS's special tokens, kept in the text) */
static const char h_channel[] = "<|channel|>";
static const char h_message[] = "<|message|>";
static const char h_end[] = "<|end|>";

srv_reason_format srv_reason_format_of(bool vocab_think, bool vocab_harmony, const char *src)
{
    if (vocab_harmony || (src && strstr(src, h_channel)))
        return SRV_REASON_HARMONY;
    if (vocab_think || (src && strstr(src, open_marker) && strstr(src, close_marker)))
        return SRV_REASON_THINK;
    return SRV_REASON_NONE;
}

const char *srv_reason_format_name(srv_reason_format f)
{
    return f == SRV_REASON_THINK     ? "<think>...</think>"
           : f == SRV_REASON_HARMONY ? "harmony channels"
                                     : "none";
}

/* The last place needle[0..n) starts in text[0..len), or len when nowhere. */
static size_t last_of(const char *text, size_t len, const char *needle, size_t n)
{
    size_t at = len;
    for (const char *p = text; (p = memmem(p, len - (size_t)(p - text), needle, n)); p++)
        at = (size_t)(p - text);
    return at;
}

bool srv_reason_prompt_opens(srv_reason_format f, const char *prompt, size_t len)
{
    if (f != SRV_REASON_THINK || !prompt)
        return false;
    size_t open = last_of(prompt, len, open_marker, OPEN_LEN);
    size_t close = last_of(prompt, len, close_marker, CLOSE_LEN);
    return open < len && (close == len || open > close);
}

static bool is_space(char ch)
{
    return ch == ' ' || ch == '\n' || ch == '\r' || ch == '\t';
}

static size_t skip_space(const char *text, size_t at, size_t len)
{
    while (at < len && is_space(text[at]))
        at++;
    return at;
}

/* How many bytes of text[from..len) may go out as reasoning while its
 * closing marker (close) is not there: less a tail that may be its start,
 * and less trailing whitespace (it may be the last before the marker). */
static size_t reason_safe_end(const char *text, size_t from, size_t len, const char *close)
{
    size_t end = len, n = strlen(close);
    for (size_t k = n - 1; k > 0; k--) {
        if (len - from >= k && memcmp(text + len - k, close, k) == 0) {
            end = len - k;
            break;
        }
    }
    while (end > from && is_space(text[end - 1]))
        end--;
    return end;
}

/* Whether text[at..len) begins with marker, or (*partial) with only a
 * start of it so far. */
static bool opens_with(const char *text, size_t at, size_t len, const char *marker, bool *partial)
{
    size_t n = strlen(marker), have = len - at < n ? len - at : n;
    *partial = have < n && memcmp(text + at, marker, have) == 0;
    return have == n && memcmp(text + at, marker, n) == 0;
}

/* Harmony: the message after the analysis one, from next: the final
 * channel's text is the content; any other (a call to=functions.NAME)
 * is content from its <|start|> on, whole, for the tool call reader. */
static void harmony_next(const char *text, size_t next, size_t len, bool end, srv_reason_view *v)
{
    const char *msg = memmem(text + next, len - next, h_message, sizeof h_message - 1);
    if (!msg) { /* its header is still coming (at the end: cut short, no content) */
        v->content_from = len;
        v->done = end;
        return;
    }
    const char *final = memmem(text + next, (size_t)(msg - text) - next, "final", 5);
    v->content_from =
        final ? skip_space(text, (size_t)(msg - text) + sizeof h_message - 1, len) : next;
    v->done = true;
}

/* Where the search for a closing marker (n bytes) begins: past the block's
 * opening (from), and past what an earlier search cleared. */
static size_t search_from(size_t from, size_t searched)
{
    return searched > from ? searched : from;
}

/* What a search of text[0..len) that found no closing marker of n bytes
 * cleared: all but a tail that may be its start. */
static size_t cleared(size_t len, size_t n)
{
    return len >= n ? len - (n - 1) : 0;
}

static void split_harmony(const char *text, size_t len, bool end, size_t searched,
                          srv_reason_view *v)
{
    bool partial;
    if (!opens_with(text, 0, len, h_channel, &partial)) {
        if (partial && !end) /* may still become a header: nothing yet */
            *v = (srv_reason_view){.content_from = len};
        return; /* no channel: all content */
    }
    const char *msg = memmem(text, len, h_message, sizeof h_message - 1);
    if (!msg) {
        if (!end)
            *v = (srv_reason_view){.content_from = len};
        return;
    }
    size_t body = (size_t)(msg - text) + sizeof h_message - 1;
    if (!opens_with(text, sizeof h_channel - 1, len, "analysis", &partial)) {
        harmony_next(text, 0, len, end, v); /* final, or a call first */
        return;
    }
    v->reason_from = skip_space(text, body, len);
    size_t at = search_from(body, searched);
    const char *stop = at < len ? memmem(text + at, len - at, h_end, sizeof h_end - 1) : NULL;
    if (!stop) {
        v->searched = cleared(len, sizeof h_end - 1);
        v->reason_to = end ? len : reason_safe_end(text, v->reason_from, len, h_end);
        while (v->reason_to > v->reason_from && is_space(text[v->reason_to - 1]))
            v->reason_to--;
        v->content_from = len;
        v->done = end;
        return;
    }
    v->reason_to = (size_t)(stop - text);
    while (v->reason_to > v->reason_from && is_space(text[v->reason_to - 1]))
        v->reason_to--;
    harmony_next(text, (size_t)(stop - text) + sizeof h_end - 1, len, end, v);
}

void srv_reason_split(srv_reason_format f, bool opens, const char *text, size_t len, bool end,
                      size_t searched, srv_reason_view *v)
{
    *v = (srv_reason_view){.done = true};
    if (f == SRV_REASON_NONE || !text)
        return;
    if (f == SRV_REASON_HARMONY) {
        split_harmony(text, len, end, searched, v);
        if (v->reason_from > v->reason_to)
            v->reason_from = v->reason_to;
        return;
    }
    size_t start = skip_space(text, 0, len);
    if (!opens) {
        size_t have = len - start < OPEN_LEN ? len - start : OPEN_LEN;
        if (memcmp(text + start, open_marker, have) != 0)
            return;            /* all content */
        if (have < OPEN_LEN) { /* may still become the marker: nothing yet */
            if (!end)
                *v = (srv_reason_view){.content_from = len};
            return;
        }
        start += OPEN_LEN;
    }
    v->reason_from = skip_space(text, start, len);
    size_t from = search_from(start, searched);
    const char *close =
        from < len ? memmem(text + from, len - from, close_marker, CLOSE_LEN) : NULL;
    v->searched = close ? 0 : cleared(len, CLOSE_LEN);
    if (close) {
        size_t at = (size_t)(close - text);
        v->reason_to = at;
        while (v->reason_to > v->reason_from && is_space(text[v->reason_to - 1]))
            v->reason_to--;
        v->content_from = skip_space(text, at + CLOSE_LEN, len);
        /* in a stream, content that is so far only whitespace is not begun */
        v->done = end || v->content_from < len;
    } else if (end) {
        v->reason_to = len;
        while (v->reason_to > v->reason_from && is_space(text[v->reason_to - 1]))
            v->reason_to--;
        v->content_from = len;
    } else {
        v->reason_to = reason_safe_end(text, v->reason_from, len, close_marker);
        v->content_from = len;
        v->done = false;
    }
    if (v->reason_from > v->reason_to)
        v->reason_from = v->reason_to;
}

/*
 * decode.c - token ids back to text: tok_decode and the streaming decoder
 * (tok_stream_push, tok_stream_flush).
 *
 * Decoding is the streaming decoder run over the ids, so a stream and a
 * whole decode cannot disagree. Each id's bytes were worked out at load
 * (tok_table.c: the ByteLevel map, or Replace/ByteFallback/Fuse of ▁ and
 * <0xXX>), so here a stream only holds back an incomplete UTF-8 character
 * (up to 3 bytes) until the next token completes or breaks it, turns a
 * broken one into U+FFFD, and (Strip) drops a leading space.
 *
 * Where this knowingly differs from tokenizers (it shows in no fixture): a
 * run of SentencePiece byte tokens that is not UTF-8 becomes one U+FFFD per
 * byte held back when the run breaks; tokenizers replaces every byte of the
 * run, so a run that mixes whole and broken characters decodes differently.
 *
 * tok_token_bytes gives one id's bytes as they are, for a grammar that
 * judges what a token would add to an answer.
 *
 * It owns only the text a tok_decode returns (the caller frees it); it
 * reads the tokenizer and writes the caller's stream and buffer.
 */
#include "internal/tokenizer_internal.h"

#include "ql_base.h"

#include <string.h>

/* --- decoding ------------------------------------------------------------- */

/* Where decoded bytes go: a caller's buffer (fixed) or a growing one. */
typedef struct sink {
    char *p;
    size_t n, cap;
    bool fixed, failed;
} sink;

static void sink_put(sink *o, uint8_t b)
{
    if (o->n == o->cap && (o->fixed || !tok_grow((void **)&o->p, &o->cap, o->n + 1, 1))) {
        o->failed = true;
        return;
    }
    o->p[o->n++] = (char)b;
}

/*
 * The stream's state: pending holds the start of a UTF-8 character that the
 * next bytes may complete; n_pushed counts the bytes produced so far (the
 * SentencePiece decoder drops a space only as the very first byte).
 */
static void out_byte(const tok_tokenizer *t, tok_stream *s, sink *o, uint8_t b)
{
    bool first = s->n_pushed == 0;
    s->n_pushed++;
    if (first && b == ' ' && t->strip_space)
        return;
    sink_put(o, b);
}

/* The pending bytes can no longer become a character: U+FFFD for them, one
 * per byte for SentencePiece byte tokens (tokenizers' ByteFallback), one
 * for the whole incomplete sequence otherwise (from_utf8_lossy). */
static void drop_pending(const tok_tokenizer *t, tok_stream *s, sink *o)
{
    size_t n = t->family == FAMILY_SPM ? s->n_pending : 1;
    s->n_pending = 0;
    for (size_t i = 0; i < n; i++) {
        out_byte(t, s, o, 0xEF);
        out_byte(t, s, o, 0xBF);
        out_byte(t, s, o, 0xBD);
    }
}

/*
 * The length of the well-formed character p[0..m) (1 <= m <= 4, p[0] >=
 * 0x80) is the start of, or 0 when no bytes that follow can make it one.
 * ql_utf8_next judges the bytes completed with continuation bytes: 0x80
 * where the rest is free, or 0xA0 for the second byte, since a lead E0 or
 * F0 needs A0 or above (no overlong forms) and ED and F4 need 80 (no
 * surrogates, nothing past U+10FFFF); every other lead takes either.
 */
static size_t utf8_whole_len(const uint8_t *p, size_t m)
{
    static const uint8_t second[2] = {0x80, 0xA0};
    for (size_t k = 0; k < 2; k++) {
        uint8_t whole[4] = {0x80, second[k], 0x80, 0x80};
        memcpy(whole, p, m);
        uint32_t cp;
        size_t len = ql_utf8_next(whole, sizeof whole, &cp);
        if (len >= 2 && len >= m)
            return len;
    }
    return 0;
}

static void feed_byte(const tok_tokenizer *t, tok_stream *s, sink *o, uint8_t b)
{
    if (s->n_pending) {
        uint8_t next[4];
        memcpy(next, s->pending, s->n_pending);
        next[s->n_pending] = b;
        size_t whole = utf8_whole_len(next, s->n_pending + 1);
        if (whole) {
            s->pending[s->n_pending++] = b;
            if (s->n_pending == whole) {
                for (size_t i = 0; i < s->n_pending; i++)
                    out_byte(t, s, o, s->pending[i]);
                s->n_pending = 0;
            }
            return;
        }
        drop_pending(t, s, o);
    }
    if (b < 0x80) {
        out_byte(t, s, o, b);
    } else if (utf8_whole_len(&b, 1)) {
        s->pending[0] = b;
        s->n_pending = 1;
    } else {
        s->n_pending = 1; /* a byte that starts nothing: U+FFFD on its own */
        drop_pending(t, s, o);
    }
}

static void feed_token(const tok_tokenizer *t, tok_stream *s, sink *o, int32_t id)
{
    if (t->piece_byte[id] >= 0) {
        feed_byte(t, s, o, (uint8_t)t->piece_byte[id]);
        return;
    }
    /* a byte-token run ends at any other token (tokenizers' ByteFallback) */
    if (t->family == FAMILY_SPM && s->n_pending)
        drop_pending(t, s, o);
    const uint8_t *p = (const uint8_t *)t->arena + t->piece_off[id];
    for (uint32_t i = 0; i < t->piece_len[id]; i++)
        feed_byte(t, s, o, p[i]);
}

static bool is_special(const tok_tokenizer *t, int32_t id)
{
    return t->type[id] == TT_CONTROL || t->type[id] == TT_UNKNOWN;
}

bool tok_is_special(const tok_tokenizer *t, int32_t id)
{
    return id >= 0 && (size_t)id < tok_vocab_size(t) && is_special(t, id);
}

long tok_token_bytes(const tok_tokenizer *t, int32_t id, uint8_t *out, size_t out_cap)
{
    if (!t || id < 0 || (size_t)id >= t->n_tokens)
        return QL_EINVAL;
    if (is_special(t, id))
        return 0;
    if (t->piece_byte[id] >= 0) {
        if (out_cap < 1)
            return QL_EINVAL;
        out[0] = (uint8_t)t->piece_byte[id];
        return 1;
    }
    if (t->piece_len[id] > out_cap)
        return QL_EINVAL;
    memcpy(out, t->arena + t->piece_off[id], t->piece_len[id]);
    return (long)t->piece_len[id];
}

int tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **text,
               size_t *len, char *msg, size_t msg_len)
{
    if (text)
        *text = NULL;
    if (len)
        *len = 0;
    if (!t || !text || (!ids && n))
        return ql_fail(msg, msg_len, QL_EINVAL, "tok_decode: no tokenizer, ids or output");
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (size_t)ids[i] >= t->n_tokens)
            return ql_fail(
                msg, msg_len, QL_EINVAL,
                "%s: token id %ld (position %zu) is outside the vocabulary of %zu tokens",
                t->source, (long)ids[i], i, t->n_tokens);
    sink o = {0};
    tok_stream s = {0};
    for (size_t i = 0; i < n; i++)
        if (!skip_special || !is_special(t, ids[i]))
            feed_token(t, &s, &o, ids[i]);
    if (s.n_pending)
        drop_pending(t, &s, &o);
    sink_put(&o, 0);
    if (o.failed) {
        free(o.p);
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory decoding %zu tokens", t->source,
                       n);
    }
    *text = o.p;
    if (len)
        *len = o.n - 1;
    return QL_OK;
}

/* A push that does not fit out_cap returns QL_EINVAL and changes nothing
 * (the same id can be pushed again with room). A 64-byte buffer holds
 * every piece of the fixture vocabularies but not all real ones (SmolLM2 has
 * an 81-byte piece); 3 * (3 + the longest piece) always fits, since every
 * byte held back or pushed can at worst become a 3-byte U+FFFD. */
long tok_stream_push(const tok_tokenizer *t, tok_stream *s, int32_t id, char *out, size_t out_cap)
{
    if (!t || !s || id < 0 || (size_t)id >= t->n_tokens || s->n_pending > 3 || (!out && out_cap))
        return QL_EINVAL;
    tok_stream next = *s;
    sink o = {out, 0, out_cap, true, false};
    feed_token(t, &next, &o, id);
    if (o.failed)
        return QL_EINVAL;
    *s = next;
    return (long)o.n;
}

long tok_stream_flush(const tok_tokenizer *t, tok_stream *s, char *out, size_t out_cap)
{
    if (!t || !s || s->n_pending > 3 || (!out && out_cap))
        return QL_EINVAL;
    tok_stream next = *s;
    sink o = {out, 0, out_cap, true, false};
    if (next.n_pending)
        drop_pending(t, &next, &o);
    if (o.failed)
        return QL_EINVAL;
    *s = next;
    return (long)o.n;
}

/*
 * bpe.c - text to token ids (tok_encode), for the two kinds of BPE the
 * models we run were trained with:
 *
 *   byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): the text's bytes are
 *   mapped one to one onto printable characters (GPT-2's bytes_to_unicode),
 *   cut into pre-tokens by a regex (pretokenize.c), and each pre-token is
 *   merged by rank;
 *
 *   SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): spaces become
 *   U+2581 "▁", one is put in front of the text, the whole is merged (by
 *   rank from tokenizer.json, by score from GGUF as llama.cpp does it), and
 *   a character no piece covers becomes its bytes as <0xXX> tokens. Gemma
 *   4's GGUF ("gemma4") is the same with no ▁ in front, merged by rank
 *   over each run of newlines and each run of other characters apart.
 *
 * The reference is Hugging Face tokenizers: leftmost-longest matching of
 * added tokens before anything else (special ones only when asked),
 * normalizers (NFC, Prepend/Replace) per text fragment between them, the
 * regex splits applied one after another ("Isolated": what a regex does not
 * match stays a piece too), BPE merging lowest rank first and leftmost on
 * ties. GGUF files follow the same rules, with llama.cpp's token types
 * (CONTROL is special, USER_DEFINED an added token that is always matched)
 * and its score-driven merging for "llama" vocabularies. From GGUF, added
 * tokens are matched leftmost-longest as tokenizers does (llama.cpp tries
 * the longest token everywhere first), a knowing difference that shows in
 * no fixture.
 *
 * Text is untrusted: invalid UTF-8 is carried through as raw bytes (a byte
 * that does not start a valid sequence is one "character" of no class), so
 * byte-level BPE encodes it losslessly and SentencePiece falls back to its
 * byte tokens; nothing reads past `len`.
 *
 * It owns only the scratch of one tok_encode call (freed at its end); it
 * reads the tokenizer and touches nothing else, so any thread may encode.
 */
#include "internal/tokenizer_internal.h"

#include <string.h>

/* --- encoding ------------------------------------------------------------- */

typedef struct span {
    uint32_t start, end; /* code point indexes into the fragment */
} span;

/* One symbol of a word being merged: a token (or -1, a character no token
 * is, under score merging), its bytes in the word, and its neighbours. */
typedef struct sym {
    int32_t id;
    int32_t prev, next;
    uint32_t start, len;
} sym;

#define SYM_DEAD INT32_MIN

/* A candidate merge of symbols pos and right (then pos's right neighbour),
 * valid while both still hold left_id and right_id. */
typedef struct cand {
    double priority; /* lower first: the rank, or minus the score */
    uint32_t pos, right;
    int32_t left_id, right_id, id;
} cand;

/* Everything one tok_encode call works in; freed at its end. */
typedef struct scratch {
    uint8_t *text; /* the normalized fragment */
    size_t text_len, text_cap;
    uint32_t *cp; /* its code points, their byte offsets (n + 1) and classes */
    uint32_t *off;
    uint8_t *cls;
    size_t n_cp, cap_cp, cap_off, cap_cls;
    cp_buf decoded, composed;
    span *spans, *spans2;
    size_t n_spans, cap_spans, cap_spans2;
    sym *syms;
    size_t cap_syms;
    cand *heap;
    size_t n_heap, cap_heap;
    char *mapped; /* byte-level: a pre-token as printable characters */
    size_t cap_mapped;
    int32_t *ids; /* the result */
    size_t n_ids, cap_ids;
} scratch;

static void scratch_free(scratch *s)
{
    free(s->text);
    free(s->cp);
    free(s->off);
    free(s->cls);
    free(s->decoded.v);
    free(s->composed.v);
    free(s->spans);
    free(s->spans2);
    free(s->syms);
    free(s->heap);
    free(s->mapped);
    free(s->ids);
}

static bool push_id(scratch *s, int32_t id)
{
    if (!tok_grow((void **)&s->ids, &s->cap_ids, s->n_ids + 1, sizeof *s->ids))
        return false;
    s->ids[s->n_ids++] = id;
    return true;
}

static bool cand_before(const cand *a, const cand *b)
{
    return a->priority < b->priority || (a->priority == b->priority && a->pos < b->pos);
}

static bool heap_push(scratch *s, cand c)
{
    if (!tok_grow((void **)&s->heap, &s->cap_heap, s->n_heap + 1, sizeof *s->heap))
        return false;
    size_t i = s->n_heap++;
    while (i > 0 && cand_before(&c, &s->heap[(i - 1) / 2])) {
        s->heap[i] = s->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    s->heap[i] = c;
    return true;
}

static cand heap_pop(scratch *s)
{
    cand top = s->heap[0], last = s->heap[--s->n_heap];
    size_t i = 0, n = s->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && cand_before(&s->heap[c + 1], &s->heap[c]))
            c++;
        if (!cand_before(&s->heap[c], &last))
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n)
        s->heap[i] = last;
    return top;
}

/* Queue the merge of symbol pos with its right neighbour, if there is one:
 * by rank from the merges, or (score_merges) when the two together are a
 * token, by that token's score. */
static bool try_pair(const tok_tokenizer *t, scratch *s, const uint8_t *word, int32_t pos)
{
    if (pos < 0 || s->syms[pos].next < 0)
        return true;
    const sym *l = &s->syms[pos], *r = &s->syms[l->next];
    cand c = {0, (uint32_t)pos, (uint32_t)l->next, l->id, r->id, -1};
    if (t->score_merges) {
        c.id = tok_vocab_find(t, (const char *)word + l->start, l->len + r->len);
        if (c.id < 0)
            return true;
        c.priority = -(double)t->score[c.id];
    } else {
        const pair_slot *m = tok_merge_find(t, l->id, r->id);
        if (!m)
            return true;
        c.priority = m->rank;
        c.id = m->id;
    }
    return heap_push(s, c);
}

/* Merge the n symbols in s->syms (a chain 0..n-1 over word) until no pair
 * is left, best pair first, leftmost among equals. */
static bool merge_symbols(const tok_tokenizer *t, scratch *s, const uint8_t *word, size_t n)
{
    s->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (!try_pair(t, s, word, (int32_t)i))
            return false;
    while (s->n_heap) {
        cand c = heap_pop(s);
        sym *l = &s->syms[c.pos];
        if (l->id != c.left_id || l->next != (int32_t)c.right || s->syms[c.right].id != c.right_id)
            continue; /* one of the two has been merged since */
        sym *r = &s->syms[c.right];
        l->id = c.id;
        l->len += r->len;
        l->next = r->next;
        if (r->next >= 0)
            s->syms[r->next].prev = (int32_t)c.pos;
        r->id = SYM_DEAD;
        if (!try_pair(t, s, word, l->prev) || !try_pair(t, s, word, (int32_t)c.pos))
            return false;
    }
    return true;
}

static bool add_sym(scratch *s, size_t *n, int32_t id, uint32_t start, uint32_t len)
{
    if (!tok_grow((void **)&s->syms, &s->cap_syms, *n + 1, sizeof *s->syms))
        return false;
    s->syms[*n] = (sym){id, (int32_t)*n - 1, (int32_t)*n + 1, start, len};
    (*n)++;
    return true;
}

/* Byte-level BPE of one pre-token (raw bytes). */
static bool bpe_byte_level(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n)
{
    if (n == 0)
        return true;
    if (t->ignore_merges) {
        /* Llama 3: a pre-token that is itself a token is taken whole */
        if (!tok_grow((void **)&s->mapped, &s->cap_mapped, 2 * n, 1))
            return false;
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            const char *c = t->byte_char[p[i]];
            size_t cl = strlen(c);
            memcpy(s->mapped + m, c, cl);
            m += cl;
        }
        int32_t id = tok_vocab_find(t, s->mapped, m);
        if (id >= 0)
            return push_id(s, id);
    }
    size_t n_syms = 0;
    for (size_t i = 0; i < n; i++)
        if (!add_sym(s, &n_syms, t->byte_char_id[p[i]], (uint32_t)i, 1))
            return false;
    s->syms[n_syms - 1].next = -1;
    if (!merge_symbols(t, s, p, n_syms))
        return false;
    for (int32_t i = 0; i >= 0; i = s->syms[i].next) {
        int32_t id = s->syms[i].id;
        if (id < 0)
            id = t->unk; /* a byte the vocabulary lacks: <unk>, else dropped (as tokenizers) */
        if (id >= 0 && !push_id(s, id))
            return false;
    }
    return true;
}

/* The tokens for the bytes of a character no token covers: <0xXX> each,
 * else <unk>. */
static bool spm_bytes(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n)
{
    bool all = t->byte_fallback || t->score_merges;
    for (size_t i = 0; i < n && all; i++)
        all = t->byte_id[p[i]] >= 0;
    if (all) {
        for (size_t i = 0; i < n; i++)
            if (!push_id(s, t->byte_id[p[i]]))
                return false;
        return true;
    }
    return t->unk < 0 || push_id(s, t->unk);
}

/* SentencePiece-style BPE of one piece (already ▁-escaped). From
 * tokenizer.json (tokenizers' BPE with byte_fallback): each character is its
 * token, or its bytes' tokens, or <unk> (consecutive ones fused when
 * fuse_unk), then merges by rank. From GGUF (llama.cpp's llm_tokenizer_spm):
 * characters merge into the best-scoring token their concatenation is, and
 * what is left untokenized at the end becomes byte tokens. */
static bool bpe_spm(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n)
{
    if (n == 0)
        return true;
    size_t n_syms = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t cl = tok_utf8_next(p + i, n - i, &cp);
        int32_t id = tok_vocab_find(t, (const char *)p + i, cl);
        if (id >= 0 || t->score_merges) {
            if (!add_sym(s, &n_syms, id, (uint32_t)i, (uint32_t)cl))
                return false;
        } else {
            bool bytes = t->byte_fallback;
            for (size_t k = 0; k < cl && bytes; k++)
                bytes = t->byte_id[p[i + k]] >= 0;
            for (size_t k = 0; bytes && k < cl; k++)
                if (!add_sym(s, &n_syms, t->byte_id[p[i + k]], (uint32_t)(i + k), 1))
                    return false;
            if (!bytes && t->unk >= 0) {
                bool fuse = t->fuse_unk && n_syms && s->syms[n_syms - 1].id == t->unk;
                if (fuse)
                    s->syms[n_syms - 1].len += (uint32_t)cl;
                else if (!add_sym(s, &n_syms, t->unk, (uint32_t)i, (uint32_t)cl))
                    return false;
            }
        }
        i += cl;
    }
    if (n_syms == 0)
        return true;
    s->syms[n_syms - 1].next = -1;
    if (!merge_symbols(t, s, p, n_syms))
        return false;
    for (int32_t i = 0; i >= 0; i = s->syms[i].next) {
        const sym *y = &s->syms[i];
        if (y->id >= 0) {
            if (!push_id(s, y->id))
                return false;
        } else if (!spm_bytes(t, s, p + y->start, y->len)) {
            return false;
        }
    }
    return true;
}

/* llama.cpp's "gemma4" split (line_runs): BPE over each run of newlines
 * and each run of other bytes apart, a run of newlines that is one token
 * taken whole (llama.cpp's fix for Gemma 4's newline tokens). */
static bool bpe_line_runs(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n)
{
    for (size_t start = 0, i = 0; start < n; start = i) {
        bool newlines = p[start] == '\n';
        while (i < n && (p[i] == '\n') == newlines)
            i++;
        int32_t whole = newlines ? tok_vocab_find(t, (const char *)p + start, i - start) : -1;
        if (whole >= 0 ? !push_id(s, whole) : !bpe_spm(t, s, p + start, i - start))
            return false;
    }
    return true;
}

static bool text_append(scratch *s, const void *p, size_t n)
{
    if (!tok_grow((void **)&s->text, &s->text_cap, s->text_len + n, 1))
        return false;
    memcpy(s->text + s->text_len, p, n);
    s->text_len += n;
    return true;
}

/* s->text as code points, their byte offsets (off[n_cp] = text_len) and
 * classes. */
static bool split_chars(scratch *s)
{
    size_t n = s->text_len;
    if (!tok_grow((void **)&s->cp, &s->cap_cp, n + 1, sizeof *s->cp) ||
        !tok_grow((void **)&s->off, &s->cap_off, n + 1, sizeof *s->off) ||
        !tok_grow((void **)&s->cls, &s->cap_cls, n + 1, 1))
        return false;
    size_t k = 0;
    for (size_t i = 0; i < n; k++) {
        uint32_t c;
        size_t l = tok_utf8_next(s->text + i, n - i, &c);
        s->cp[k] = c;
        s->off[k] = (uint32_t)i;
        s->cls[k] = uc_class(c);
        i += l;
    }
    s->off[k] = (uint32_t)n;
    s->n_cp = k;
    return true;
}

static bool push_span(span **v, size_t *n, size_t *cap, size_t start, size_t end)
{
    if (!tok_grow((void **)v, cap, *n + 1, sizeof **v))
        return false;
    (*v)[(*n)++] = (span){(uint32_t)start, (uint32_t)end};
    return true;
}

/* Cut the fragment into pre-tokens: each step splits every piece into its
 * regex's matches and the text between them ("Isolated"). */
static bool pre_tokenize(const tok_tokenizer *t, scratch *s)
{
    s->n_spans = 0;
    if (s->n_cp && !push_span(&s->spans, &s->n_spans, &s->cap_spans, 0, s->n_cp))
        return false;
    for (int k = 0; k < t->n_steps; k++) {
        size_t n2 = 0;
        for (size_t j = 0; j < s->n_spans; j++) {
            size_t last = s->spans[j].start, i = last, end = s->spans[j].end;
            while (i < end) {
                size_t m = tok_match_step(t->steps[k], s->cp, s->cls, last, i, end);
                if (m == i) {
                    i++;
                    continue;
                }
                if ((last < i && !push_span(&s->spans2, &n2, &s->cap_spans2, last, i)) ||
                    !push_span(&s->spans2, &n2, &s->cap_spans2, i, m))
                    return false;
                i = last = m;
            }
            if (last < end && !push_span(&s->spans2, &n2, &s->cap_spans2, last, end))
                return false;
        }
        span *tmp = s->spans;
        size_t tmp_cap = s->cap_spans;
        s->spans = s->spans2;
        s->cap_spans = s->cap_spans2;
        s->spans2 = tmp;
        s->cap_spans2 = tmp_cap;
        s->n_spans = n2;
    }
    return true;
}

/* Replace s->text by its NFC form (text that has no code point from U+0300
 * on is NFC already). */
static bool normalize_nfc(scratch *s)
{
    bool simple = true;
    for (size_t i = 0; i < s->text_len && simple; i++)
        simple = s->text[i] < 0xCC; /* lead bytes below 0xCC start code points below U+0300 */
    if (simple)
        return true;
    s->decoded.n = 0;
    for (size_t i = 0; i < s->text_len;) {
        uint32_t c;
        i += tok_utf8_next(s->text + i, s->text_len - i, &c);
        if (!uc_cp_push(&s->decoded, c))
            return false;
    }
    if (!uc_nfc(s->decoded.v, s->decoded.n, &s->composed))
        return false;
    s->text_len = 0;
    for (size_t i = 0; i < s->composed.n; i++) {
        uint8_t b[4];
        if (!text_append(s, b, tok_utf8_put(s->composed.v[i], b)))
            return false;
    }
    return true;
}

/* A text fragment (between added tokens) through the byte-level pipeline:
 * NFC when the tokenizer normalizes, the prefix space, the pre-tokenizer
 * steps, BPE of each pre-token. */
static bool encode_byte_level(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n)
{
    s->text_len = 0;
    if (!text_append(s, p, n) || (t->nfc && !normalize_nfc(s)))
        return false;
    if (t->prefix_space && s->text_len && s->text[0] != ' ') {
        if (!text_append(s, " ", 1))
            return false;
        memmove(s->text + 1, s->text, s->text_len - 1);
        s->text[0] = ' ';
    }
    if (!split_chars(s) || !pre_tokenize(t, s))
        return false;
    for (size_t j = 0; j < s->n_spans; j++) {
        uint32_t a = s->off[s->spans[j].start], b = s->off[s->spans[j].end];
        if (!bpe_byte_level(t, s, s->text + a, b - a))
            return false;
    }
    return true;
}

/* A text fragment through the SentencePiece pipeline: the ▁ prefix, spaces
 * as ▁, then BPE of the whole (or of each ▁-word when Metaspace splits).
 * at_start: the fragment begins the text (Metaspace "first"). */
static bool encode_spm(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n,
                       bool at_start)
{
    bool leads = (n >= SPM_SPACE_LEN && memcmp(p, SPM_SPACE, SPM_SPACE_LEN) == 0) ||
                 (n && p[0] == ' ' && t->replace_space);
    bool prefix = t->prefix == PREFIX_EVERY || (t->prefix == PREFIX_ALWAYS && !leads) ||
                  (t->prefix == PREFIX_FIRST && at_start && !leads);
    s->text_len = 0;
    if (prefix && !text_append(s, SPM_SPACE, SPM_SPACE_LEN))
        return false;
    for (size_t i = 0; i < n; i++) {
        bool ok = p[i] == ' ' && t->replace_space ? text_append(s, SPM_SPACE, SPM_SPACE_LEN)
                                                  : text_append(s, p + i, 1);
        if (!ok)
            return false;
    }
    if (t->line_runs)
        return bpe_line_runs(t, s, s->text, s->text_len);
    if (!t->spm_split)
        return bpe_spm(t, s, s->text, s->text_len);
    size_t start = 0;
    for (size_t i = 1; i + SPM_SPACE_LEN <= s->text_len; i++) {
        if (memcmp(s->text + i, SPM_SPACE, SPM_SPACE_LEN) == 0) {
            if (!bpe_spm(t, s, s->text + start, i - start))
                return false;
            start = i;
        }
    }
    return bpe_spm(t, s, s->text + start, s->text_len - start);
}

static bool encode_text(const tok_tokenizer *t, scratch *s, const uint8_t *p, size_t n,
                        bool at_start)
{
    if (t->family == FAMILY_BYTE_LEVEL)
        return encode_byte_level(t, s, p, n);
    return encode_spm(t, s, p, n, at_start);
}

/* The longest added token at p[i..n), or NULL. */
static const tok_added *match_added(const tok_tokenizer *t, const uint8_t *p, size_t i, size_t n)
{
    for (uint32_t k = t->added_first[p[i]]; k < t->added_first[p[i] + 1]; k++) {
        const tok_added *a = &t->added[k];
        if (a->len <= n - i && memcmp(p + i, a->text, a->len) == 0)
            return a;
    }
    return NULL;
}

/* Where the whitespace (Rust's char::is_whitespace, our UC_SPACE) before p[i]
 * begins, not going below floor. */
static size_t space_before(const uint8_t *p, size_t i, size_t floor)
{
    while (i > floor) {
        size_t k = i - 1;
        while (k > floor && i - k < 4 && (p[k] & 0xC0) == 0x80)
            k--;
        uint32_t c;
        if (tok_utf8_next(p + k, i - k, &c) != i - k || !(uc_class(c) & UC_SPACE))
            break;
        i = k;
    }
    return i;
}

/* Where the whitespace from p[i] ends. */
static size_t space_after(const uint8_t *p, size_t i, size_t n)
{
    while (i < n) {
        uint32_t c;
        size_t l = tok_utf8_next(p + i, n - i, &c);
        if (!(uc_class(c) & UC_SPACE))
            break;
        i += l;
    }
    return i;
}

/* A word character (\w) touching the match at [start, stop)? */
static bool touches_word(const uint8_t *p, size_t start, size_t stop, size_t n)
{
    uint32_t c;
    if (start > 0) {
        size_t k = start - 1;
        while (k > 0 && start - k < 4 && (p[k] & 0xC0) == 0x80)
            k--;
        tok_utf8_next(p + k, start - k, &c);
        if (c == '_' || (uc_class(c) & (UC_LETTER | UC_NUMBER)))
            return true;
    }
    if (stop < n) {
        tok_utf8_next(p + stop, n - stop, &c);
        if (c == '_' || (uc_class(c) & (UC_LETTER | UC_NUMBER)))
            return true;
    }
    return false;
}

int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_bos,
               bool parse_special, int32_t **ids, size_t *n_ids, char *msg, size_t msg_len)
{
    if (ids)
        *ids = NULL;
    if (n_ids)
        *n_ids = 0;
    if (!t || !ids || !n_ids || (!text && len))
        return ql_fail(msg, msg_len, QL_EINVAL, "tok_encode: no tokenizer, text or output");
    scratch s = {0};
    bool ok = push_id(&s, 0); /* so that an empty result is still an allocation */
    s.n_ids = 0;
    if (ok && add_bos && t->adds_bos && t->bos >= 0)
        ok = push_id(&s, t->bos);
    const uint8_t *p = (const uint8_t *)text;
    size_t done = 0; /* text before this is encoded */
    for (size_t i = 0; ok && i < len;) {
        const tok_added *a = match_added(t, p, i, len);
        if (!a) {
            i++;
            continue;
        }
        size_t start = i, stop = i + a->len;
        i = stop; /* a match that is not used is still consumed (as tokenizers' matcher) */
        if ((a->special && !parse_special) || (a->single_word && touches_word(p, start, stop, len)))
            continue;
        if (a->lstrip)
            start = space_before(p, start, done);
        if (a->rstrip)
            i = stop = space_after(p, stop, len);
        if (done < start)
            ok = encode_text(t, &s, p + done, start - done, done == 0);
        ok = ok && push_id(&s, a->id);
        done = stop;
    }
    if (ok && done < len)
        ok = encode_text(t, &s, p + done, len - done, done == 0);
    if (!ok) {
        scratch_free(&s);
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory encoding %zu bytes", t->source,
                       len);
    }
    *ids = s.ids;
    *n_ids = s.n_ids;
    s.ids = NULL;
    scratch_free(&s);
    return QL_OK;
}

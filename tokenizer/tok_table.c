/*
 * tok_table.c - the loaded tokenizer itself: its lifetime, the table of
 * tokens by id, the hash of token text to id and the hash of merge pair to
 * (rank, result), each id's decoded piece, and what the tokenizer says
 * about itself.
 *
 * Both loaders (tok_hf.c, tok_gguf.c) fill a tokenizer through these
 * functions and end with tok_finish, which works out everything encoding
 * and decoding look up (the byte maps, each id's bytes, the added tokens by
 * first byte), so that encoding is lookups only. After that the tokenizer
 * is immutable.
 *
 * It owns the tokenizer's memory (tok_new to tok_free): one arena holds
 * every token text and decoded piece, the per-id arrays and hashes index
 * it. It touches nothing but the tokenizer it is given.
 */
#include "internal/tokenizer_internal.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

/* --- hashes --------------------------------------------------------------- */

static uint64_t hash_bytes(const void *p, size_t n)
{
    return ql_mix64(ql_fnv1a(p, n)); /* the low bits (the slot) depend on all */
}

static size_t table_size_for(size_t n)
{
    size_t cap = 16;
    while (cap < n * 2 + 1)
        cap *= 2;
    return cap;
}

bool tok_vocab_init(tok_tokenizer *t, size_t n)
{
    str_map *m = &t->vocab;
    size_t cap = table_size_for(n);
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots)
        return false;
    memset(m->slots, 0xff, cap * sizeof *m->slots);
    m->mask = cap - 1;
    return true;
}

int32_t tok_vocab_find(const tok_tokenizer *t, const char *s, size_t n)
{
    const str_map *m = &t->vocab;
    if (!m->slots)
        return -1;
    for (size_t i = hash_bytes(s, n) & m->mask;; i = (i + 1) & m->mask) {
        int32_t id = m->slots[i];
        if (id < 0)
            return -1;
        uint32_t len;
        const char *text = tok_text(t, id, &len);
        if (len == n && memcmp(text, s, n) == 0)
            return id;
    }
}

/* The table was sized for every id, so it never fills. */
void tok_vocab_insert(tok_tokenizer *t, int32_t id, bool replace)
{
    str_map *m = &t->vocab;
    uint32_t n;
    const char *s = tok_text(t, id, &n);
    for (size_t i = hash_bytes(s, n) & m->mask;; i = (i + 1) & m->mask) {
        int32_t other = m->slots[i];
        if (other < 0) {
            m->slots[i] = id;
            return;
        }
        uint32_t len;
        const char *text = tok_text(t, other, &len);
        if (len == n && memcmp(text, s, n) == 0) {
            if (replace)
                m->slots[i] = id;
            return;
        }
    }
}

bool tok_merges_init(tok_tokenizer *t, size_t n)
{
    pair_map *m = &t->merges;
    size_t cap = table_size_for(n);
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots)
        return false;
    for (size_t i = 0; i < cap; i++)
        m->slots[i].key = PAIR_EMPTY;
    m->mask = cap - 1;
    return true;
}

static uint64_t pair_key(int32_t a, int32_t b)
{
    return (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
}

/* Add a merge; false when the pair is there already (the first rank stays). */
static bool pair_insert(pair_map *m, int32_t a, int32_t b, uint32_t rank, int32_t id)
{
    uint64_t key = pair_key(a, b);
    for (size_t i = ql_mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == PAIR_EMPTY) {
            m->slots[i] = (pair_slot){key, rank, id};
            return true;
        }
        if (m->slots[i].key == key)
            return false;
    }
}

const pair_slot *tok_merge_find(const tok_tokenizer *t, int32_t a, int32_t b)
{
    const pair_map *m = &t->merges;
    if (!m->slots || a < 0 || b < 0)
        return NULL;
    uint64_t key = pair_key(a, b);
    for (size_t i = ql_mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key)
            return &m->slots[i];
        if (m->slots[i].key == PAIR_EMPTY)
            return NULL;
    }
}

/* --- the token table ------------------------------------------------------ */

/* Copy n bytes into the arena; their offset in *off. p may point into the
 * arena itself (growing it moves them). */
static bool arena_add(tok_tokenizer *t, const void *p, size_t n, uint32_t *off)
{
    const char *src = p;
    bool inside = t->arena && src >= t->arena && src < t->arena + t->arena_len;
    size_t src_off = inside ? (size_t)(src - t->arena) : 0;
    if (t->arena_len + n > UINT32_MAX ||
        !tok_grow((void **)&t->arena, &t->arena_cap, t->arena_len + n + 1, 1))
        return false;
    if (inside)
        src = t->arena + src_off;
    if (n)
        memcpy(t->arena + t->arena_len, src, n);
    *off = (uint32_t)t->arena_len;
    t->arena_len += n;
    return true;
}

tok_tokenizer *tok_new(const char *source)
{
    tok_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->source = strdup(source ? source : "tokenizer");
    t->bos = t->eos = t->unk = -1;
    if (!t->source) {
        free(t);
        return NULL;
    }
    return t;
}

bool tok_alloc_tokens(tok_tokenizer *t, size_t n)
{
    t->n_tokens = n;
    t->text_off = calloc(n ? n : 1, sizeof *t->text_off);
    t->text_len = calloc(n ? n : 1, sizeof *t->text_len);
    t->type = calloc(n ? n : 1, 1);
    t->has_text = calloc(n ? n : 1, sizeof *t->has_text);
    t->score = calloc(n ? n : 1, sizeof *t->score);
    t->piece_off = calloc(n ? n : 1, sizeof *t->piece_off);
    t->piece_len = calloc(n ? n : 1, sizeof *t->piece_len);
    t->piece_byte = malloc((n ? n : 1) * sizeof *t->piece_byte);
    return t->text_off && t->text_len && t->type && t->has_text && t->score && t->piece_off &&
           t->piece_len && t->piece_byte;
}

void tok_free(tok_tokenizer *t)
{
    if (!t)
        return;
    free(t->source);
    free(t->arena);
    free(t->text_off);
    free(t->text_len);
    free(t->type);
    free(t->score);
    free(t->has_text);
    free(t->piece_off);
    free(t->piece_len);
    free(t->piece_byte);
    free(t->vocab.slots);
    free(t->merges.slots);
    free(t->added);
    free(t);
}

bool tok_set_token(tok_tokenizer *t, int32_t id, const char *s, size_t n, uint8_t type)
{
    if (!arena_add(t, s, n, &t->text_off[id]))
        return false;
    t->text_len[id] = (uint32_t)n;
    t->type[id] = type;
    t->has_text[id] = true;
    return true;
}

bool tok_add_added(tok_tokenizer *t, size_t *cap, const tok_added *a, const char *s)
{
    if (a->len == 0)
        return true;
    if (!tok_grow((void **)&t->added, cap, t->n_added + 1, sizeof *t->added))
        return false;
    t->added[t->n_added] = *a;
    if (!arena_add(t, s, a->len, &t->added[t->n_added].off))
        return false;
    t->n_added++;
    return true;
}

/* GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the
 * others for U+0100 onwards in byte order. */
static uint32_t byte_to_cp(int b)
{
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return (uint32_t)b;
    uint32_t n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF)))
            n++;
    return 256 + n;
}

/* The byte-level decoding of s: each character back to its byte, or s as it
 * is when a character has no byte (tokenizers' ByteLevel decoder does that
 * per token). Written at out (room for n bytes); returns the length. */
static size_t byte_level_piece(const int16_t *cp_byte, const char *s, size_t n, char *out)
{
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        i += tok_utf8_next((const uint8_t *)s + i, n - i, &c);
        if (c >= 0x144 || cp_byte[c] < 0) {
            memcpy(out, s, n);
            return n;
        }
        out[m++] = (char)cp_byte[c];
    }
    return m;
}

/* What id decodes to, from its text s[0..n): a byte (<0xXX> under
 * SentencePiece), or bytes appended to the arena. buf has room for n. */
static bool make_piece(tok_tokenizer *t, const int16_t *cp_byte, int32_t id, const char *s,
                       size_t n, bool raw, char *buf)
{
    t->piece_byte[id] = -1;
    t->piece_len[id] = 0;
    if (t->family == FAMILY_SPM && n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>' &&
        isxdigit((unsigned char)s[3]) && isxdigit((unsigned char)s[4])) {
        char hex[3] = {s[3], s[4], 0};
        t->piece_byte[id] = (int16_t)strtol(hex, NULL, 16);
        return true;
    }
    size_t m = 0;
    if (t->family == FAMILY_BYTE_LEVEL && !raw) {
        m = byte_level_piece(cp_byte, s, n, buf);
    } else if (t->family == FAMILY_BYTE_LEVEL) {
        memcpy(buf, s, n);
        m = n;
    } else {
        for (size_t i = 0; i < n;) {
            if (i + SPM_SPACE_LEN <= n && memcmp(s + i, SPM_SPACE, SPM_SPACE_LEN) == 0) {
                buf[m++] = ' ';
                i += SPM_SPACE_LEN;
            } else {
                buf[m++] = s[i++];
            }
        }
    }
    t->piece_len[id] = (uint32_t)m;
    return arena_add(t, buf, m, &t->piece_off[id]);
}

static int cmp_added(const void *pa, const void *pb)
{
    const tok_added *a = pa, *b = pb;
    uint8_t fa = a->len ? (uint8_t)a->text[0] : 0, fb = b->len ? (uint8_t)b->text[0] : 0;
    if (fa != fb)
        return fa < fb ? -1 : 1;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* The byte maps: each byte's printable character under GPT-2's map and its
 * token, each byte's <0xXX> token; cp_byte (0x144 entries) receives the
 * inverse map, -1 for a code point that stands for no byte. */
static void finish_byte_maps(tok_tokenizer *t, int16_t *cp_byte)
{
    memset(cp_byte, 0xff, 0x144 * sizeof *cp_byte);
    for (int b = 0; b < 256; b++) {
        uint32_t c = byte_to_cp(b);
        cp_byte[c] = (int16_t)b;
        uint8_t u[4];
        size_t l = tok_utf8_put(c, u);
        memcpy(t->byte_char[b], u, l);
        t->byte_char[b][l] = 0;
        t->byte_char_id[b] = tok_vocab_find(t, t->byte_char[b], l);
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_id[b] = tok_vocab_find(t, name, 6);
    }
}

/* Every id's decoded piece, then the added tokens' whose text differs from
 * the vocabulary's entry for their id. */
static bool finish_pieces(tok_tokenizer *t, const int16_t *cp_byte, bool raw_added)
{
    size_t longest = 1;
    for (size_t id = 0; id < t->n_tokens; id++)
        if (t->text_len[id] > longest)
            longest = t->text_len[id];
    for (size_t k = 0; k < t->n_added; k++)
        if (t->added[k].len > longest)
            longest = t->added[k].len;
    char *buf = malloc(longest), *text = malloc(longest);
    bool ok = buf && text;
    for (size_t id = 0; ok && id < t->n_tokens; id++) {
        t->piece_byte[id] = -1;
        if (!t->has_text[id])
            continue;
        bool raw = raw_added && (t->type[id] == TT_CONTROL || t->type[id] == TT_USER ||
                                 t->type[id] == TT_UNKNOWN);
        /* the text is in the arena, which the piece may move: copy it out */
        memcpy(text, t->arena + t->text_off[id], t->text_len[id]);
        ok = make_piece(t, cp_byte, (int32_t)id, text, t->text_len[id], raw, buf);
    }
    for (size_t k = 0; ok && k < t->n_added; k++) {
        tok_added *a = &t->added[k];
        /* an added token whose text differs from the vocabulary's entry for
         * its id decodes as the added text (tokenizers looks there first) */
        uint32_t len;
        const char *vocab_text = tok_text(t, a->id, &len);
        if (len != a->len || memcmp(vocab_text, t->arena + a->off, len) != 0) {
            memcpy(text, t->arena + a->off, a->len);
            ok = make_piece(t, cp_byte, a->id, text, a->len, raw_added, buf);
        }
    }
    free(buf);
    free(text);
    return ok;
}

/* The added tokens' text pointers (the arena is final now), sorted by first
 * byte and longest first, indexed by first byte. */
static void finish_added_index(tok_tokenizer *t)
{
    for (size_t k = 0; k < t->n_added; k++)
        t->added[k].text = t->arena + t->added[k].off;
    if (t->n_added)
        qsort(t->added, t->n_added, sizeof *t->added, cmp_added);
    size_t k = 0;
    for (int b = 0; b < 256; b++) {
        t->added_first[b] = (uint32_t)k;
        while (k < t->n_added && t->added[k].len && (uint8_t)t->added[k].text[0] == b)
            k++;
    }
    t->added_first[256] = (uint32_t)k;
}

bool tok_finish(tok_tokenizer *t, bool raw_added)
{
    int16_t cp_byte[0x144];
    finish_byte_maps(t, cp_byte);
    if (!finish_pieces(t, cp_byte, raw_added))
        return false;
    finish_added_index(t);
    return true;
}

/* --- describing what was loaded -------------------------------------------- */

void tok_write_description(tok_tokenizer *t, const char *pre_name)
{
    if (t->family == FAMILY_BYTE_LEVEL) {
        snprintf(t->describe, sizeof t->describe, "byte-level BPE, pre-tokenizer %s%s%s%s",
                 pre_name, t->nfc ? ", NFC" : "", t->ignore_merges ? ", ignore_merges" : "",
                 t->prefix_space ? ", prefix space" : "");
        return;
    }
    static const char *const prefixes[] = {
        [PREFIX_NONE] = "no",
        [PREFIX_EVERY] = "every fragment",
        [PREFIX_ALWAYS] = "always",
        [PREFIX_FIRST] = "first",
    };
    snprintf(t->describe, sizeof t->describe, "sentencepiece BPE, %s, %s%s%s▁ prefix: %s",
             t->score_merges ? "merged by score" : "merged by rank",
             t->byte_fallback ? "byte fallback, " : "", t->spm_split ? "split at ▁, " : "",
             t->line_runs ? "newline runs apart, " : "", prefixes[t->prefix]);
}

/* --- merges ---------------------------------------------------------------- */

int tok_add_merge(tok_tokenizer *t, const char *a, size_t la, const char *b, size_t lb,
                  uint32_t rank, char **buf, size_t *cap, const char *path, char *msg,
                  size_t msg_len)
{
    if (!tok_grow((void **)buf, cap, la + lb + 1, 1))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    memcpy(*buf, a, la);
    memcpy(*buf + la, b, lb);
    int32_t ida = tok_vocab_find(t, a, la), idb = tok_vocab_find(t, b, lb);
    int32_t id = tok_vocab_find(t, *buf, la + lb);
    if (ida < 0 || idb < 0 || id < 0) {
        const char *missing = ida < 0 ? a : idb < 0 ? b : *buf;
        int lm = (int)(ida < 0 ? la : idb < 0 ? lb : la + lb);
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: merge %u (\"%.*s\" + \"%.*s\"): \"%.*s\" is not in the vocabulary",
                       path, rank, (int)la, a, (int)lb, b, lm, missing);
    }
    pair_insert(&t->merges, ida, idb, rank, id); /* a repeated pair keeps its first rank */
    return QL_OK;
}

/* --- what the tokenizer says about itself ------------------------------------ */

int32_t tok_bos(const tok_tokenizer *t)
{
    return t ? t->bos : -1;
}

int32_t tok_eos(const tok_tokenizer *t)
{
    return t ? t->eos : -1;
}

bool tok_adds_bos(const tok_tokenizer *t)
{
    return t && t->adds_bos;
}

size_t tok_vocab_size(const tok_tokenizer *t)
{
    return t ? t->n_tokens : 0;
}

const char *tok_describe(const tok_tokenizer *t)
{
    return t ? t->describe : "no tokenizer";
}

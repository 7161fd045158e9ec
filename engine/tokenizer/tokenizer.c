/*
 * tokenizer.c - text to token ids and back, for the two kinds of BPE the
 * models we run were trained with:
 *
 *   byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): the text's bytes are
 *   mapped one to one onto printable characters (GPT-2's bytes_to_unicode),
 *   cut into pre-tokens by a regex, and each pre-token is merged by rank;
 *
 *   SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): spaces become
 *   U+2581 "▁", one is put in front of the text, the whole is merged (by
 *   rank from tokenizer.json, by score from GGUF as llama.cpp does it), and
 *   a character no piece covers becomes its bytes as <0xXX> tokens.
 *
 * Both load from a Hugging Face tokenizer.json (+ tokenizer_config.json) or
 * from GGUF metadata (tokenizer.ggml.*), into one table of tokens by id, a
 * hash of token text to id and a hash of merge pair to (rank, result), built
 * once at load so that encoding is lookups only.
 *
 * Why it is shaped so:
 *   - No regex library: each pre-tokenizer regex the supported models use is
 *     written out by hand as a matcher over code points classified by the
 *     generated tables (unicode_tables.h), and a pre-tokenizer is recognised
 *     by its exact regex string (tokenizer.json) or llama.cpp's name for it
 *     (GGUF tokenizer.ggml.pre). Anything else is refused by its pattern or
 *     name, since a near miss would silently give other ids than the model
 *     was trained on.
 *   - The reference is Hugging Face tokenizers: leftmost-longest matching of
 *     added tokens before anything else (special ones only when asked),
 *     normalizers (NFC, Prepend/Replace) per text fragment between them, the
 *     regex splits applied one after another ("Isolated": what a regex does
 *     not match stays a piece too), BPE merging lowest rank first and
 *     leftmost on ties, decoding through the ByteLevel or
 *     Replace/ByteFallback/Fuse/Strip decoders. GGUF files follow the same
 *     rules, with llama.cpp's token types (CONTROL is special, USER_DEFINED
 *     an added token that is always matched) and its score-driven merging
 *     for "llama" vocabularies.
 *   - Text is untrusted: invalid UTF-8 is carried through as raw bytes (a
 *     byte that does not start a valid sequence is one "character" of no
 *     class), so byte-level BPE encodes it losslessly and SentencePiece
 *     falls back to its byte tokens; nothing reads past `len`.
 *   - Decoding is the streaming decoder run over the ids, so a stream and a
 *     whole decode cannot disagree; a stream holds back an incomplete UTF-8
 *     character (up to 3 bytes) until the next token completes or breaks
 *     it, and a broken one becomes U+FFFD.
 *
 * Where this knowingly differs from its references (none of it shows in the
 * fixtures or in what the supported models produce):
 *   - added tokens marked "normalized": true are matched in the raw text, as
 *     the normalized: false ones are;
 *   - a run of SentencePiece byte tokens that is not UTF-8 becomes one
 *     U+FFFD per byte held back when the run breaks; tokenizers replaces
 *     every byte of the run, so a run that mixes whole and broken
 *     characters decodes differently;
 *   - from GGUF, added tokens are matched leftmost-longest as tokenizers
 *     does (llama.cpp tries the longest token everywhere first), and the
 *     Qwen2 family gets its NFC normalizer (llama.cpp skips it).
 */
#include "tokenizer.h"
#include "unicode_tables.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Token types: GGUF's tokenizer.ggml.token_type numbers (llama.cpp's
 * llama_token_type), also used for tokens from tokenizer.json. */
enum {
    TT_UNDEFINED = 0,
    TT_NORMAL = 1,
    TT_UNKNOWN = 2, /* <unk>: special */
    TT_CONTROL = 3, /* special: matched only with parse_special, dropped by skip_special */
    TT_USER = 4,    /* added, not special: always matched, always decoded */
    TT_UNUSED = 5,
    TT_BYTE = 6, /* <0xXX> */
    TT_COUNT
};

/* The highest token id accepted from a file: sixteen times the largest
 * real vocabulary (Gemma's 256k), so a hostile id cannot make us allocate
 * gigabytes for the id table. */
#define TOK_MAX_ID (1 << 22)

/* "▁", U+2581, SentencePiece's visible space */
#define SPM_SPACE     "\xe2\x96\x81"
#define SPM_SPACE_LEN 3

/* A byte that does not start a valid UTF-8 sequence is carried as CP_RAW +
 * the byte: a "code point" of no Unicode class that encodes back to itself. */
#define CP_RAW 0x110000u

/* The pre-tokenizer steps: each splits every current piece with one regex
 * (or Digits rule), keeping matches and the text between them as pieces. */
typedef enum pre_step {
    STEP_GPT2,   /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    STEP_LLAMA3, /* (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|... */
    STEP_QWEN2,  /* the same with \p{N} one at a time */
    STEP_PUNCT,  /* [\p{P}\$\+<=>\^~\|]+ (llama.cpp's "default", first) */
    STEP_NUMBERS,     /* \p{N}+ (Digits without individual_digits; "default", third) */
    STEP_DIGIT,       /* \p{N} (Digits with individual_digits) */
    STEP_THREE_DIGITS /* [0-9][0-9][0-9] ("default", fourth) */
} pre_step;

#define TOK_MAX_STEPS 8

static const char *const step_names[] = {
    [STEP_GPT2] = "gpt2",        [STEP_LLAMA3] = "llama3",   [STEP_QWEN2] = "qwen2",
    [STEP_PUNCT] = "punct",      [STEP_NUMBERS] = "numbers", [STEP_DIGIT] = "digits",
    [STEP_THREE_DIGITS] = "999",
};

/* The regexes of tokenizer.json Split pre-tokenizers we recognise, exactly
 * as the files spell them (JSON-unescaped). */
static const struct {
    const char *regex;
    pre_step step;
} known_regexes[] = {
    {"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
     STEP_GPT2},
    /* llama.cpp's spelling of GPT-2's, without the last \s+ (it changes no split) */
    {"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)", STEP_GPT2},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     STEP_LLAMA3},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     STEP_QWEN2},
    {"[\\p{P}\\$\\+<=>\\^~\\|]+", STEP_PUNCT},
    {"\\p{N}+", STEP_NUMBERS},
    {"[0-9][0-9][0-9]", STEP_THREE_DIGITS},
};

/* GGUF tokenizer.ggml.pre names (llama.cpp's llama-vocab.cpp) whose regexes
 * are among ours, and the steps llama.cpp runs for them. A GGUF carries no
 * normalizer: the Qwen2 family gets the NFC its tokenizer.json has (the
 * model was trained on NFC text; llama.cpp leaves it out). */
static const struct {
    const char *name;
    pre_step steps[4];
    int n_steps;
    bool ignore_merges; /* llama.cpp sets it for the Llama 3 family only */
    bool nfc;
} known_pre[] = {
    {"default", {STEP_PUNCT, STEP_GPT2, STEP_NUMBERS, STEP_THREE_DIGITS}, 4, false, false},
    {"gpt-2", {STEP_GPT2}, 1, false, false},
    {"phi-2", {STEP_GPT2}, 1, false, false},
    {"llama3", {STEP_LLAMA3}, 1, true, false},
    {"llama-bpe", {STEP_LLAMA3}, 1, true, false},
    {"llama-v3", {STEP_LLAMA3}, 1, true, false},
    {"qwen2", {STEP_QWEN2}, 1, false, true},
    {"deepseek-r1-qwen", {STEP_QWEN2}, 1, false, true},
    {"smollm", {STEP_DIGIT, STEP_GPT2}, 2, false, false},
    {"starcoder", {STEP_DIGIT, STEP_GPT2}, 2, false, false},
};

/* Where the SentencePiece "▁" prefix goes. */
typedef enum spm_prefix {
    PREFIX_NONE,
    PREFIX_EVERY,  /* every text fragment (Prepend normalizer; GGUF add_space_prefix) */
    PREFIX_ALWAYS, /* every fragment not already starting with ▁ (Metaspace "always") */
    PREFIX_FIRST,  /* only a fragment at the start of the text (Metaspace "first") */
} spm_prefix;

/* An added token: matched in the text before anything else. */
typedef struct tok_added {
    int32_t id;
    uint32_t off, len; /* the text in the tokenizer's arena */
    const char *text;  /* arena + off, set once the arena is final */
    bool special;      /* only with parse_special */
    bool lstrip, rstrip, single_word;
} tok_added;

/* A hash of token text to id: open addressing, the keys are the token texts
 * themselves (by id), so a slot is one int32. */
typedef struct str_map {
    int32_t *slots; /* -1 empty */
    size_t mask;
} str_map;

/* A hash of merge pair (left id, right id) to its rank and result. */
typedef struct pair_slot {
    uint64_t key; /* left << 32 | right; PAIR_EMPTY when free */
    uint32_t rank;
    int32_t id;
} pair_slot;

#define PAIR_EMPTY UINT64_MAX

typedef struct pair_map {
    pair_slot *slots;
    size_t mask;
} pair_map;

typedef enum tok_family { FAMILY_BYTE_LEVEL, FAMILY_SPM } tok_family;

struct tok_tokenizer {
    tok_family family;
    char *source; /* the file it came from, for messages */
    char describe[160];

    /* tokens by id: text (not NUL-terminated) in `arena` */
    size_t n_tokens;
    char *arena;
    size_t arena_len, arena_cap;
    uint32_t *text_off, *text_len;
    uint8_t *type;  /* TT_* */
    float *score;   /* GGUF sentencepiece: merge priority */
    bool *has_text; /* false for an id no entry names (a hole in tokenizer.json) */
    /* what each id decodes to: bytes, or (piece_byte >= 0) one raw byte */
    uint32_t *piece_off, *piece_len;
    int16_t *piece_byte;

    str_map vocab; /* text -> id of the pieces BPE may produce */
    pair_map merges;
    bool score_merges; /* sentencepiece from GGUF: merge the best-scoring piece first */

    tok_added *added; /* sorted by first byte, longest first */
    size_t n_added;
    uint32_t added_first[257]; /* added[added_first[b] .. added_first[b+1]) start with byte b */

    /* byte-level */
    pre_step steps[TOK_MAX_STEPS];
    int n_steps;
    bool nfc;          /* Qwen2's normalizer */
    bool prefix_space; /* ByteLevel add_prefix_space */
    bool ignore_merges;
    int32_t byte_char_id[256]; /* the token of each byte's printable character */
    char byte_char[256][3];    /* that character, UTF-8, NUL-terminated */

    /* sentencepiece */
    spm_prefix prefix;
    bool replace_space; /* ' ' -> ▁ */
    bool spm_split;     /* Metaspace split: a piece per ▁-word */
    bool byte_fallback;
    bool fuse_unk;
    int32_t unk;
    int32_t byte_id[256]; /* <0xXX> */
    bool strip_space;     /* the decoder drops one leading space */

    int32_t bos, eos;
    bool adds_bos;
};

/* --- small helpers ------------------------------------------------------- */

/* Grow *p (elements of `size` bytes, capacity *cap) to hold at least `need`. */
static bool grow(void **p, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return true;
    size_t n = *cap ? *cap : 16;
    while (n < need) {
        if (n > SIZE_MAX / 2 / size)
            return false;
        n *= 2;
    }
    void *q = realloc(*p, n * size);
    if (!q)
        return false;
    *p = q;
    *cap = n;
    return true;
}

static uint64_t hash_bytes(const void *p, size_t n)
{
    /* FNV-1a, then a final mix so the low bits (the slot) depend on all */
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static size_t table_size_for(size_t n)
{
    size_t cap = 16;
    while (cap < n * 2 + 1)
        cap *= 2;
    return cap;
}

static const char *tok_text(const tok_tokenizer *t, int32_t id, uint32_t *len)
{
    *len = t->text_len[id];
    return t->arena + t->text_off[id];
}

static bool str_map_init(str_map *m, size_t n)
{
    size_t cap = table_size_for(n);
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots)
        return false;
    memset(m->slots, 0xff, cap * sizeof *m->slots);
    m->mask = cap - 1;
    return true;
}

/* The id whose text is s[0..n), or -1. */
static int32_t vocab_find(const tok_tokenizer *t, const char *s, size_t n)
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

/* Put id under its text; an id already there with the same text is
 * replaced when `replace` (llama.cpp's map: the last token of a text wins),
 * kept otherwise. The table was sized for every id, so it never fills. */
static void vocab_insert(tok_tokenizer *t, int32_t id, bool replace)
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

static bool pair_map_init(pair_map *m, size_t n)
{
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
    for (size_t i = hash_u64(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == PAIR_EMPTY) {
            m->slots[i] = (pair_slot){key, rank, id};
            return true;
        }
        if (m->slots[i].key == key)
            return false;
    }
}

static const pair_slot *pair_find(const pair_map *m, int32_t a, int32_t b)
{
    if (!m->slots || a < 0 || b < 0)
        return NULL;
    uint64_t key = pair_key(a, b);
    for (size_t i = hash_u64(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key)
            return &m->slots[i];
        if (m->slots[i].key == PAIR_EMPTY)
            return NULL;
    }
}

/* --- UTF-8 and Unicode classes ------------------------------------------- */

/* The length of the sequence a lead byte starts (2..4), or 0. */
static size_t utf8_lead_len(uint8_t b)
{
    if (b >= 0xC2 && b <= 0xDF)
        return 2;
    if (b >= 0xE0 && b <= 0xEF)
        return 3;
    if (b >= 0xF0 && b <= 0xF4)
        return 4;
    return 0;
}

/* Whether b may be byte k (1..3) of a sequence led by `lead`: Unicode's
 * table of well-formed sequences (no overlongs, surrogates or > U+10FFFF). */
static bool utf8_cont_ok(uint8_t lead, size_t k, uint8_t b)
{
    if (b < 0x80 || b > 0xBF)
        return false;
    if (k == 1) {
        if (lead == 0xE0)
            return b >= 0xA0;
        if (lead == 0xED)
            return b <= 0x9F;
        if (lead == 0xF0)
            return b >= 0x90;
        if (lead == 0xF4)
            return b <= 0x8F;
    }
    return true;
}

/* Decode the character at s[0..n) (n >= 1): its byte length, *cp the code
 * point or CP_RAW + s[0] when s does not start a well-formed sequence. */
static size_t utf8_next(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t b = s[0];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    size_t len = utf8_lead_len(b);
    if (len == 0 || len > n) {
        *cp = CP_RAW + b;
        return 1;
    }
    for (size_t k = 1; k < len; k++) {
        if (!utf8_cont_ok(b, k, s[k])) {
            *cp = CP_RAW + b;
            return 1;
        }
    }
    uint32_t c = len == 2 ? b & 0x1F : len == 3 ? b & 0x0F : b & 0x07;
    for (size_t k = 1; k < len; k++)
        c = c << 6 | (s[k] & 0x3F);
    *cp = c;
    return len;
}

/* Encode cp (or a raw byte) at out (4 bytes of room); returns the length. */
static size_t utf8_put(uint32_t cp, uint8_t *out)
{
    if (cp >= CP_RAW) {
        out[0] = (uint8_t)(cp - CP_RAW);
        return 1;
    }
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | cp >> 6);
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | cp >> 12);
        out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | cp >> 18);
    out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* The value of the range holding cp in a sorted uc_range table, or 0. */
static uint8_t range_lookup(const uc_range *r, size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid].lo)
            hi = mid;
        else if (cp > r[mid].hi)
            lo = mid + 1;
        else
            return r[mid].value;
    }
    return 0;
}

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

/* UC_* class bits of a code point; a raw byte has none. */
static uint8_t uc_class(uint32_t cp)
{
    if (cp >= CP_RAW)
        return 0;
    return range_lookup(uc_class_ranges, N_ELEMS(uc_class_ranges), cp);
}

static uint8_t uc_ccc(uint32_t cp)
{
    if (cp < 0x300 || cp >= CP_RAW)
        return 0;
    return range_lookup(uc_ccc_ranges, N_ELEMS(uc_ccc_ranges), cp);
}

/* The ASCII letter cp case-folds to (Oniguruma's (?i:) as Llama 3's
 * contractions use it), or 0. */
static char fold_ascii(uint32_t cp)
{
    if (cp >= 'A' && cp <= 'Z')
        return (char)(cp - 'A' + 'a');
    if (cp >= 'a' && cp <= 'z')
        return (char)cp;
    for (size_t i = 0; i < N_ELEMS(uc_casefold_ascii); i++)
        if (uc_casefold_ascii[i].cp == cp)
            return uc_casefold_ascii[i].folded;
    return 0;
}

/* --- NFC (Qwen2's normalizer) -------------------------------------------- */

typedef struct cp_buf {
    uint32_t *v;
    size_t n, cap;
} cp_buf;

static bool cp_push(cp_buf *b, uint32_t cp)
{
    if (!grow((void **)&b->v, &b->cap, b->n + 1, sizeof *b->v))
        return false;
    b->v[b->n++] = cp;
    return true;
}

/* Hangul syllables compose and decompose by arithmetic (Unicode 3.12). */
#define HANGUL_S       0xAC00u
#define HANGUL_L       0x1100u
#define HANGUL_V       0x1161u
#define HANGUL_T       0x11A7u
#define HANGUL_L_COUNT 19u
#define HANGUL_V_COUNT 21u
#define HANGUL_T_COUNT 28u
#define HANGUL_N_COUNT (HANGUL_V_COUNT * HANGUL_T_COUNT)
#define HANGUL_S_COUNT (HANGUL_L_COUNT * HANGUL_N_COUNT)

static const uint32_t *decomp_find(uint32_t cp)
{
    size_t lo = 0, hi = N_ELEMS(uc_decomp);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (uc_decomp[mid][0] < cp)
            lo = mid + 1;
        else if (uc_decomp[mid][0] > cp)
            hi = mid;
        else
            return uc_decomp[mid];
    }
    return NULL;
}

/* The primary composite of a + b, or 0. */
static uint32_t compose_pair(uint32_t a, uint32_t b)
{
    if (a >= HANGUL_L && a < HANGUL_L + HANGUL_L_COUNT && b >= HANGUL_V &&
        b < HANGUL_V + HANGUL_V_COUNT)
        return HANGUL_S + ((a - HANGUL_L) * HANGUL_V_COUNT + (b - HANGUL_V)) * HANGUL_T_COUNT;
    if (a >= HANGUL_S && a < HANGUL_S + HANGUL_S_COUNT && (a - HANGUL_S) % HANGUL_T_COUNT == 0 &&
        b > HANGUL_T && b < HANGUL_T + HANGUL_T_COUNT)
        return a + (b - HANGUL_T);
    size_t lo = 0, hi = N_ELEMS(uc_comp);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const uint32_t *c = uc_comp[mid];
        if (c[0] < a || (c[0] == a && c[1] < b))
            lo = mid + 1;
        else if (c[0] > a || c[1] > b)
            hi = mid;
        else
            return c[2];
    }
    return 0;
}

/* Append the full canonical decomposition of cp. */
static bool decompose(uint32_t cp, cp_buf *out)
{
    if (cp >= HANGUL_S && cp < HANGUL_S + HANGUL_S_COUNT) {
        uint32_t s = cp - HANGUL_S;
        if (!cp_push(out, HANGUL_L + s / HANGUL_N_COUNT) ||
            !cp_push(out, HANGUL_V + s % HANGUL_N_COUNT / HANGUL_T_COUNT))
            return false;
        return s % HANGUL_T_COUNT == 0 || cp_push(out, HANGUL_T + s % HANGUL_T_COUNT);
    }
    const uint32_t *d = cp < CP_RAW ? decomp_find(cp) : NULL;
    if (!d)
        return cp_push(out, cp);
    return decompose(d[1], out) && (d[2] == 0 || decompose(d[2], out));
}

/* out = NFC(in): canonical decomposition, canonical ordering, canonical
 * composition (UAX #15, composition as its sample code does it). */
static bool nfc(const uint32_t *in, size_t n, cp_buf *out)
{
    out->n = 0;
    for (size_t i = 0; i < n; i++)
        if (!decompose(in[i], out))
            return false;
    uint32_t *v = out->v;
    /* a stable sort of each run of non-starters by combining class */
    for (size_t i = 1; i < out->n; i++) {
        uint8_t c = uc_ccc(v[i]);
        if (c == 0)
            continue;
        uint32_t x = v[i];
        size_t j = i;
        while (j > 0 && uc_ccc(v[j - 1]) > c) {
            v[j] = v[j - 1];
            j--;
        }
        v[j] = x;
    }
    if (out->n == 0)
        return true;
    size_t starter = 0, w = 1;
    int last_class = uc_ccc(v[0]) ? 256 : 0; /* a leading non-starter blocks */
    for (size_t r = 1; r < out->n; r++) {
        uint32_t c = v[r];
        int cls = uc_ccc(c);
        uint32_t comp = compose_pair(v[starter], c);
        if (comp && (last_class < cls || last_class == 0)) {
            v[starter] = comp;
            continue;
        }
        if (cls == 0)
            starter = w;
        last_class = cls;
        v[w++] = c;
    }
    out->n = w;
    return true;
}

/* --- pre-tokenizer regexes, by hand ------------------------------------- */

/*
 * Each matcher is one regex tried at code point i of a piece that ends at n
 * (the piece is the whole subject: lookaheads see its end as the end of the
 * text). It returns where the match ends, or i when nothing matches there.
 * Alternatives are tried in the regex's order, as a backtracking engine
 * does, not longest first. cls[] holds the UC_* bits of each code point.
 */
#define C_L UC_LETTER
#define C_N UC_NUMBER
#define C_S UC_SPACE

static bool is_other(uint8_t c) /* [^\s\p{L}\p{N}] */
{
    return !(c & (C_L | C_N | C_S));
}

static bool is_newline(uint32_t cp)
{
    return cp == '\r' || cp == '\n';
}

static size_t run_of(const uint8_t *cls, size_t i, size_t n, uint8_t bits)
{
    while (i < n && (cls[i] & bits))
        i++;
    return i;
}

static size_t run_of_other(const uint8_t *cls, size_t i, size_t n)
{
    while (i < n && is_other(cls[i]))
        i++;
    return i;
}

/* \s+(?!\S)|\s+ at i (cls[i] is a space): all of a run that ends the piece,
 * else all but its last character (which goes with what follows), else the
 * one character. */
static size_t match_space(const uint8_t *cls, size_t i, size_t n)
{
    size_t e = run_of(cls, i, n, C_S);
    if (e == n || e - i == 1)
        return e;
    return e - 1;
}

/* 's|'t|'re|'ve|'m|'ll|'d with a, b the two characters after the ' (already
 * case-folded for Llama 3's (?i:)); the length of the match or 0. */
static size_t match_contraction(uint32_t a, uint32_t b)
{
    if (a == 's' || a == 't' || a == 'm' || a == 'd')
        return 2;
    if ((a == 'r' || a == 'v') && b == 'e')
        return 3;
    if (a == 'l' && b == 'l')
        return 3;
    return 0;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t match_gpt2(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n)
{
    if (cp[i] == '\'' && i + 1 < n) {
        size_t m = match_contraction(cp[i + 1], i + 2 < n ? cp[i + 2] : 0);
        if (m)
            return i + m;
    }
    /* the optional space: taken when what follows it matches; when it does
     * not, the same alternative without it cannot match at a space either */
    size_t j = cp[i] == ' ' && i + 1 < n ? i + 1 : i;
    if (cls[j] & C_L)
        return run_of(cls, j, n, C_L);
    if (cls[j] & C_N)
        return run_of(cls, j, n, C_N);
    if (is_other(cls[j]))
        return run_of_other(cls, j, n);
    if (cls[i] & C_S)
        return match_space(cls, i, n);
    return i;
}

/* Llama 3 (max_digits 3) and Qwen2 (1):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 * | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t match_llama3(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n,
                           size_t max_digits)
{
    if (cp[i] == '\'' && i + 1 < n) {
        size_t m = match_contraction((uint32_t)fold_ascii(cp[i + 1]),
                                     i + 2 < n ? (uint32_t)fold_ascii(cp[i + 2]) : 0);
        if (m)
            return i + m;
    }
    if (cls[i] & C_L)
        return run_of(cls, i, n, C_L);
    if (!is_newline(cp[i]) && !(cls[i] & C_N) && i + 1 < n && (cls[i + 1] & C_L))
        return run_of(cls, i + 1, n, C_L);
    if (cls[i] & C_N) {
        size_t e = i;
        while (e < n && e - i < max_digits && (cls[e] & C_N))
            e++;
        return e;
    }
    size_t j = cp[i] == ' ' && i + 1 < n && is_other(cls[i + 1]) ? i + 1 : i;
    if (is_other(cls[j])) {
        size_t e = run_of_other(cls, j, n);
        while (e < n && is_newline(cp[e]))
            e++;
        return e;
    }
    if (cls[i] & C_S) {
        /* \s*[\r\n]+: up to the last line break of the whitespace run */
        size_t e = run_of(cls, i, n, C_S), end = i;
        for (size_t k = i; k < e; k++)
            if (is_newline(cp[k]))
                end = k + 1;
        return end > i ? end : match_space(cls, i, n);
    }
    return i;
}

/* [\p{P}\$\+<=>\^~\|]+ */
static bool is_default_punct(uint32_t cp, uint8_t cls)
{
    return (cls & UC_PUNCT) || (cp < 0x80 && cp && strchr("$+<=>^~|", (int)cp));
}

static size_t match_step(pre_step step, const uint32_t *cp, const uint8_t *cls, size_t i, size_t n)
{
    switch (step) {
    case STEP_GPT2: return match_gpt2(cp, cls, i, n);
    case STEP_LLAMA3: return match_llama3(cp, cls, i, n, 3);
    case STEP_QWEN2: return match_llama3(cp, cls, i, n, 1);
    case STEP_PUNCT: {
        size_t e = i;
        while (e < n && is_default_punct(cp[e], cls[e]))
            e++;
        return e;
    }
    case STEP_NUMBERS: return run_of(cls, i, n, C_N);
    case STEP_DIGIT: return cls[i] & C_N ? i + 1 : i;
    case STEP_THREE_DIGITS:
        if (i + 3 <= n && cp[i] >= '0' && cp[i] <= '9' && cp[i + 1] >= '0' && cp[i + 1] <= '9' &&
            cp[i + 2] >= '0' && cp[i + 2] <= '9')
            return i + 3;
        return i;
    }
    return i;
}

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
    if (!grow((void **)&s->ids, &s->cap_ids, s->n_ids + 1, sizeof *s->ids))
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
    if (!grow((void **)&s->heap, &s->cap_heap, s->n_heap + 1, sizeof *s->heap))
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
        c.id = vocab_find(t, (const char *)word + l->start, l->len + r->len);
        if (c.id < 0)
            return true;
        c.priority = -(double)t->score[c.id];
    } else {
        const pair_slot *m = pair_find(&t->merges, l->id, r->id);
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
    if (!grow((void **)&s->syms, &s->cap_syms, *n + 1, sizeof *s->syms))
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
        if (!grow((void **)&s->mapped, &s->cap_mapped, 2 * n, 1))
            return false;
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            const char *c = t->byte_char[p[i]];
            size_t cl = strlen(c);
            memcpy(s->mapped + m, c, cl);
            m += cl;
        }
        int32_t id = vocab_find(t, s->mapped, m);
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
        size_t cl = utf8_next(p + i, n - i, &cp);
        int32_t id = vocab_find(t, (const char *)p + i, cl);
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

static bool text_append(scratch *s, const void *p, size_t n)
{
    if (!grow((void **)&s->text, &s->text_cap, s->text_len + n, 1))
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
    if (!grow((void **)&s->cp, &s->cap_cp, n + 1, sizeof *s->cp) ||
        !grow((void **)&s->off, &s->cap_off, n + 1, sizeof *s->off) ||
        !grow((void **)&s->cls, &s->cap_cls, n + 1, 1))
        return false;
    size_t k = 0;
    for (size_t i = 0; i < n; k++) {
        uint32_t c;
        size_t l = utf8_next(s->text + i, n - i, &c);
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
    if (!grow((void **)v, cap, *n + 1, sizeof **v))
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
                size_t m = match_step(t->steps[k], s->cp, s->cls, i, end);
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
        i += utf8_next(s->text + i, s->text_len - i, &c);
        if (!cp_push(&s->decoded, c))
            return false;
    }
    if (!nfc(s->decoded.v, s->decoded.n, &s->composed))
        return false;
    s->text_len = 0;
    for (size_t i = 0; i < s->composed.n; i++) {
        uint8_t b[4];
        if (!text_append(s, b, utf8_put(s->composed.v[i], b)))
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
        if (utf8_next(p + k, i - k, &c) != i - k || !(uc_class(c) & C_S))
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
        size_t l = utf8_next(p + i, n - i, &c);
        if (!(uc_class(c) & C_S))
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
        utf8_next(p + k, start - k, &c);
        if (c == '_' || (uc_class(c) & (C_L | C_N)))
            return true;
    }
    if (stop < n) {
        utf8_next(p + stop, n - stop, &c);
        if (c == '_' || (uc_class(c) & (C_L | C_N)))
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

/* --- decoding ------------------------------------------------------------- */

/* Where decoded bytes go: a caller's buffer (fixed) or a growing one. */
typedef struct sink {
    char *p;
    size_t n, cap;
    bool fixed, failed;
} sink;

static void sink_put(sink *o, uint8_t b)
{
    if (o->n == o->cap && (o->fixed || !grow((void **)&o->p, &o->cap, o->n + 1, 1))) {
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

static void feed_byte(const tok_tokenizer *t, tok_stream *s, sink *o, uint8_t b)
{
    if (s->n_pending) {
        if (utf8_cont_ok(s->pending[0], s->n_pending, b)) {
            s->pending[s->n_pending++] = b;
            if (s->n_pending == utf8_lead_len(s->pending[0])) {
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
    } else if (utf8_lead_len(b)) {
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
 * (the same id can be pushed again with room). engine.h's 64 bytes hold
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

/* --- the token table ------------------------------------------------------ */

/* Copy n bytes into the arena; their offset in *off. p may point into the
 * arena itself (growing it moves them). */
static bool arena_add(tok_tokenizer *t, const void *p, size_t n, uint32_t *off)
{
    const char *src = p;
    bool inside = t->arena && src >= t->arena && src < t->arena + t->arena_len;
    size_t src_off = inside ? (size_t)(src - t->arena) : 0;
    if (t->arena_len + n > UINT32_MAX ||
        !grow((void **)&t->arena, &t->arena_cap, t->arena_len + n + 1, 1))
        return false;
    if (inside)
        src = t->arena + src_off;
    if (n)
        memcpy(t->arena + t->arena_len, src, n);
    *off = (uint32_t)t->arena_len;
    t->arena_len += n;
    return true;
}

static tok_tokenizer *tok_new(const char *source)
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

static bool tok_alloc_tokens(tok_tokenizer *t, size_t n)
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

static bool set_token(tok_tokenizer *t, int32_t id, const char *s, size_t n, uint8_t type)
{
    if (!arena_add(t, s, n, &t->text_off[id]))
        return false;
    t->text_len[id] = (uint32_t)n;
    t->type[id] = type;
    t->has_text[id] = true;
    return true;
}

/* Add an added token (one with no text is left out: it would match
 * everywhere). */
static bool add_added(tok_tokenizer *t, size_t *cap, const tok_added *a, const char *s)
{
    if (a->len == 0)
        return true;
    if (!grow((void **)&t->added, cap, t->n_added + 1, sizeof *t->added))
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
        i += utf8_next((const uint8_t *)s + i, n - i, &c);
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

/*
 * Everything encoding and decoding need beyond the table and the hashes:
 * the byte maps, each id's decoded piece, the added tokens indexed by first
 * byte. raw_added: added tokens decode as their text (llama.cpp) rather
 * than through the byte-level map (tokenizers).
 */
static bool tok_finish(tok_tokenizer *t, bool raw_added)
{
    int16_t cp_byte[0x144];
    memset(cp_byte, 0xff, sizeof cp_byte);
    for (int b = 0; b < 256; b++) {
        uint32_t c = byte_to_cp(b);
        cp_byte[c] = (int16_t)b;
        uint8_t u[4];
        size_t l = utf8_put(c, u);
        memcpy(t->byte_char[b], u, l);
        t->byte_char[b][l] = 0;
        t->byte_char_id[b] = vocab_find(t, t->byte_char[b], l);
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_id[b] = vocab_find(t, name, 6);
    }
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
    if (!ok)
        return false;
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
    return true;
}

/* --- describing what was loaded -------------------------------------------- */

/* The name of the tokenizer's pre-tokenizer steps: llama.cpp's name when
 * they are one of its, else the steps joined by '+'. */
static void steps_name(const tok_tokenizer *t, char *out, size_t len)
{
    for (size_t k = 0; k < N_ELEMS(known_pre); k++) {
        if (known_pre[k].n_steps != t->n_steps)
            continue;
        bool same = true;
        for (int i = 0; i < t->n_steps; i++)
            same = same && known_pre[k].steps[i] == t->steps[i];
        if (same) {
            snprintf(out, len, "%s", known_pre[k].name);
            return;
        }
    }
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < t->n_steps && at < len; i++)
        at += (size_t)snprintf(out + at, len - at, "%s%s", i ? "+" : "", step_names[t->steps[i]]);
    if (t->n_steps == 0)
        snprintf(out, len, "none");
}

static void describe(tok_tokenizer *t, const char *pre_name)
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
    snprintf(t->describe, sizeof t->describe, "sentencepiece BPE, %s, %s%s▁ prefix: %s",
             t->score_merges ? "merged by score" : "merged by rank",
             t->byte_fallback ? "byte fallback, " : "", t->spm_split ? "split at ▁, " : "",
             prefixes[t->prefix]);
}

/* --- tokenizer.json ----------------------------------------------------------- */

static const char *json_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool json_bool(const cJSON *o, const char *key, bool dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

/* v as a token id: an integer from 0 to TOK_MAX_ID - 1, else -1. */
static long json_id(const cJSON *v)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= TOK_MAX_ID ||
        v->valuedouble != (double)(long)v->valuedouble)
        return -1;
    return (long)v->valuedouble;
}

static int add_step(tok_tokenizer *t, pre_step step, const char *path, char *msg, size_t msg_len)
{
    if (t->n_steps == TOK_MAX_STEPS)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: more than %d pre-tokenizer steps", path,
                       TOK_MAX_STEPS);
    t->steps[t->n_steps++] = step;
    return QL_OK;
}

/* What kind of BPE the normalizer and pre-tokenizer make this. */
typedef struct hf_kind {
    bool byte_level; /* a ByteLevel pre-tokenizer */
    bool spm;        /* Metaspace, a ▁ normalizer, byte_fallback */
} hf_kind;

static int hf_pre_tokenizer(tok_tokenizer *t, const cJSON *pre, hf_kind *k, const char *path,
                            char *msg, size_t msg_len)
{
    if (!pre || cJSON_IsNull(pre))
        return QL_OK;
    const char *type = json_str(pre, "type");
    if (!type)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: a pre_tokenizer without a type", path);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers"), *it;
        if (!cJSON_IsArray(items))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: pre_tokenizer Sequence without a pretokenizers array", path);
        cJSON_ArrayForEach (it, items) {
            int rc = hf_pre_tokenizer(t, it, k, path, msg, msg_len);
            if (rc)
                return rc;
        }
        return QL_OK;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        k->byte_level = true;
        if (json_bool(pre, "add_prefix_space", false)) {
            if (t->n_steps)
                return ql_fail(msg, msg_len, QL_EINVAL,
                               "%s: a ByteLevel pre-tokenizer with add_prefix_space after "
                               "other steps is not supported",
                               path);
            t->prefix_space = true;
        }
        return json_bool(pre, "use_regex", true) ? add_step(t, STEP_GPT2, path, msg, msg_len)
                                                 : QL_OK;
    }
    if (strcmp(type, "Split") == 0) {
        const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(pre, "pattern");
        const char *regex = json_str(pattern, "Regex"), *behavior = json_str(pre, "behavior");
        if (!regex) {
            const char *str = json_str(pattern, "String");
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: Split pre-tokenizer on the string \"%.100s\" is not supported "
                           "(only the regexes of GPT-2, Llama 3, Qwen2 and llama.cpp's default)",
                           path, str ? str : "?");
        }
        if (!behavior || strcmp(behavior, "Isolated") != 0 || json_bool(pre, "invert", false))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: Split pre-tokenizer with behavior %s%s is not supported (only "
                           "Isolated)",
                           path, behavior ? behavior : "(none)",
                           json_bool(pre, "invert", false) ? ", inverted" : "");
        for (size_t i = 0; i < N_ELEMS(known_regexes); i++)
            if (strcmp(regex, known_regexes[i].regex) == 0)
                return add_step(t, known_regexes[i].step, path, msg, msg_len);
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: Split pre-tokenizer regex \"%.300s\" is not one we implement (only "
                       "those of GPT-2, Llama 3, Qwen2 and llama.cpp's default)",
                       path, regex);
    }
    if (strcmp(type, "Digits") == 0)
        return add_step(t, json_bool(pre, "individual_digits", false) ? STEP_DIGIT : STEP_NUMBERS,
                        path, msg, msg_len);
    if (strcmp(type, "Metaspace") == 0) {
        const char *rep = json_str(pre, "replacement"), *scheme = json_str(pre, "prepend_scheme");
        if (!rep || strcmp(rep, SPM_SPACE) != 0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: Metaspace pre-tokenizer with replacement \"%s\" is not supported "
                           "(only \"" SPM_SPACE "\")",
                           path, rep ? rep : "(none)");
        if (!scheme)
            t->prefix = json_bool(pre, "add_prefix_space", true) ? PREFIX_ALWAYS : PREFIX_NONE;
        else if (strcmp(scheme, "always") == 0)
            t->prefix = PREFIX_ALWAYS;
        else if (strcmp(scheme, "first") == 0)
            t->prefix = PREFIX_FIRST;
        else if (strcmp(scheme, "never") == 0)
            t->prefix = PREFIX_NONE;
        else
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: Metaspace prepend_scheme \"%s\" is not known", path, scheme);
        t->replace_space = true;
        t->spm_split = json_bool(pre, "split", true);
        k->spm = true;
        return QL_OK;
    }
    return ql_fail(msg, msg_len, QL_EINVAL, "%s: pre-tokenizer %s is not supported", path, type);
}

static int hf_normalizer(tok_tokenizer *t, const cJSON *norm, hf_kind *k, const char *path,
                         char *msg, size_t msg_len)
{
    if (!norm || cJSON_IsNull(norm))
        return QL_OK;
    const char *type = json_str(norm, "type");
    if (!type)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: a normalizer without a type", path);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(norm, "normalizers"), *it;
        if (!cJSON_IsArray(items))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: normalizer Sequence without a normalizers array", path);
        cJSON_ArrayForEach (it, items) {
            int rc = hf_normalizer(t, it, k, path, msg, msg_len);
            if (rc)
                return rc;
        }
        return QL_OK;
    }
    if (strcmp(type, "NFC") == 0) {
        t->nfc = true;
        return QL_OK;
    }
    if (strcmp(type, "Prepend") == 0) {
        const char *what = json_str(norm, "prepend");
        if (!what || strcmp(what, SPM_SPACE) != 0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: Prepend normalizer of \"%s\" is not supported (only \"" SPM_SPACE
                           "\")",
                           path, what ? what : "(none)");
        t->prefix = PREFIX_EVERY;
        k->spm = true;
        return QL_OK;
    }
    if (strcmp(type, "Replace") == 0) {
        const char *from = json_str(cJSON_GetObjectItemCaseSensitive(norm, "pattern"), "String");
        const char *to = json_str(norm, "content");
        if (!from || !to || strcmp(from, " ") != 0 || strcmp(to, SPM_SPACE) != 0)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: Replace normalizer of \"%s\" by \"%s\" is not supported (only "
                           "\" \" by \"" SPM_SPACE "\")",
                           path, from ? from : "(a regex)", to ? to : "?");
        t->replace_space = true;
        k->spm = true;
        return QL_OK;
    }
    return ql_fail(msg, msg_len, QL_EINVAL, "%s: normalizer %s is not supported", path, type);
}

/* Whether a SentencePiece decoder drops the leading space: a Strip of " "
 * from the start, or a Metaspace decoder that prepends. */
static bool hf_decoder_strips(const cJSON *dec)
{
    const char *type = json_str(dec, "type");
    if (!type)
        return false;
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *it;
        cJSON_ArrayForEach (it, cJSON_GetObjectItemCaseSensitive(dec, "decoders")) {
            if (hf_decoder_strips(it))
                return true;
        }
        return false;
    }
    if (strcmp(type, "Strip") == 0) {
        const char *content = json_str(dec, "content");
        const cJSON *start = cJSON_GetObjectItemCaseSensitive(dec, "start");
        return content && strcmp(content, " ") == 0 && cJSON_IsNumber(start) &&
               start->valuedouble >= 1;
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *scheme = json_str(dec, "prepend_scheme");
        return scheme ? strcmp(scheme, "never") != 0 : json_bool(dec, "add_prefix_space", true);
    }
    return false;
}

/* The TemplateProcessing post-processor, alone or in a Sequence. */
static const cJSON *find_template(const cJSON *pp)
{
    const char *type = json_str(pp, "type");
    if (!type)
        return NULL;
    if (strcmp(type, "TemplateProcessing") == 0)
        return pp;
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *it;
        cJSON_ArrayForEach (it, cJSON_GetObjectItemCaseSensitive(pp, "processors")) {
            const cJSON *found = find_template(it);
            if (found)
                return found;
        }
    }
    return NULL;
}

/* The id of text s: an added token's, else the vocabulary's, else -1. */
static int32_t find_token(const tok_tokenizer *t, const char *s)
{
    size_t n = strlen(s);
    for (size_t k = 0; k < t->n_added; k++)
        if (t->added[k].len == n && memcmp(t->arena + t->added[k].off, s, n) == 0)
            return t->added[k].id;
    return vocab_find(t, s, n);
}

/* tokenizer_config.json's name for a token: a string or {"content": ...}. */
static const char *config_token(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsString(v))
        return v->valuestring;
    return cJSON_IsObject(v) ? json_str(v, "content") : NULL;
}

/* Look up the two halves of a merge and their concatenation; add the pair. */
static int add_merge(tok_tokenizer *t, const char *a, size_t la, const char *b, size_t lb,
                     uint32_t rank, char **buf, size_t *cap, const char *path, char *msg,
                     size_t msg_len)
{
    if (!grow((void **)buf, cap, la + lb + 1, 1))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    memcpy(*buf, a, la);
    memcpy(*buf + la, b, lb);
    int32_t ida = vocab_find(t, a, la), idb = vocab_find(t, b, lb);
    int32_t id = vocab_find(t, *buf, la + lb);
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

static int hf_build(tok_tokenizer *t, const cJSON *root, const cJSON *cfg, const char *path,
                    const char *cfg_path, char *msg, size_t msg_len)
{
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model"), *it;
    if (!cJSON_IsObject(model))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: no \"model\" object", path);
    const char *type = json_str(model, "type");
    if (!type && cJSON_GetObjectItemCaseSensitive(model, "merges"))
        type = "BPE"; /* files from before tokenizers tagged the model */
    if (!type || strcmp(type, "BPE") != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: model type %s is not supported (only BPE: byte-level or "
                       "sentencepiece-style)",
                       path, type ? type : "(none)");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!cJSON_IsObject(vocab))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: model.vocab is not an object", path);
    if (merges && !cJSON_IsArray(merges))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: model.merges is not an array", path);
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: added_tokens is not an array", path);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < N_ELEMS(affixes); i++) {
        const char *v = json_str(model, affixes[i]);
        if (v && *v)
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: BPE with %s \"%s\" is not supported", path,
                           affixes[i], v);
    }
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: BPE dropout %g is not supported (it makes encoding random)", path,
                       dropout->valuedouble);

    /* the id table: every vocabulary entry and added token */
    long max_id = -1;
    size_t n_vocab = 0;
    cJSON_ArrayForEach (it, vocab) {
        long id = json_id(it);
        if (id < 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: vocab entry \"%.100s\" has no id from 0 to %d", path, it->string,
                           TOK_MAX_ID - 1);
        max_id = id > max_id ? id : max_id;
        n_vocab++;
    }
    cJSON_ArrayForEach (it, added) {
        long id = json_id(cJSON_GetObjectItemCaseSensitive(it, "id"));
        if (id < 0 || !json_str(it, "content"))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: an added token without content or an id from 0 to %d", path,
                           TOK_MAX_ID - 1);
        max_id = id > max_id ? id : max_id;
    }
    if (max_id < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: the vocabulary is empty", path);
    if (!tok_alloc_tokens(t, (size_t)max_id + 1) || !str_map_init(&t->vocab, n_vocab))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    cJSON_ArrayForEach (it, vocab) {
        long id = json_id(it);
        if (t->has_text[id])
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: id %ld is given to both \"%.*s\" and \"%.100s\"", path, id,
                           (int)t->text_len[id], t->arena + t->text_off[id], it->string);
        if (!set_token(t, (int32_t)id, it->string, strlen(it->string), TT_NORMAL))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
        vocab_insert(t, (int32_t)id, false);
    }
    size_t added_cap = 0;
    cJSON_ArrayForEach (it, added) {
        tok_added a = {0};
        const char *content = json_str(it, "content");
        a.id = (int32_t)json_id(cJSON_GetObjectItemCaseSensitive(it, "id"));
        a.len = (uint32_t)strlen(content);
        a.special = json_bool(it, "special", false);
        a.lstrip = json_bool(it, "lstrip", false);
        a.rstrip = json_bool(it, "rstrip", false);
        a.single_word = json_bool(it, "single_word", false);
        uint8_t type_of = a.special ? TT_CONTROL : TT_USER;
        bool ok = t->has_text[a.id] || set_token(t, a.id, content, a.len, type_of);
        t->type[a.id] = type_of;
        if (!ok || !add_added(t, &added_cap, &a, content))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    }

    /* merges, by rank: "a b" strings (tokenizers before 0.20) or [a, b] */
    if (!pair_map_init(&t->merges, (size_t)cJSON_GetArraySize(merges)))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    uint32_t rank = 0;
    char *buf = NULL;
    size_t buf_cap = 0;
    int rc = QL_OK;
    cJSON_ArrayForEach (it, merges) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (cJSON_IsString(it)) {
            const char *space = strchr(it->valuestring, ' ');
            if (space && !strchr(space + 1, ' ')) {
                a = it->valuestring;
                la = (size_t)(space - a);
                b = space + 1;
                lb = strlen(b);
            }
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            a = cJSON_GetArrayItem(it, 0)->valuestring;
            b = cJSON_GetArrayItem(it, 1)->valuestring;
            la = strlen(a);
            lb = strlen(b);
        }
        if (!a) {
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: merge %u is neither \"a b\" (one space) nor [\"a\", \"b\"]", path,
                         rank);
            break;
        }
        rc = add_merge(t, a, la, b, lb, rank++, &buf, &buf_cap, path, msg, msg_len);
        if (rc)
            break;
    }
    free(buf);
    if (rc)
        return rc;

    /* which kind of BPE */
    hf_kind k = {0};
    rc = hf_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), &k, path, msg,
                       msg_len);
    if (!rc)
        rc = hf_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), &k, path,
                              msg, msg_len);
    if (rc)
        return rc;
    t->byte_fallback = json_bool(model, "byte_fallback", false);
    t->fuse_unk = json_bool(model, "fuse_unk", false);
    t->ignore_merges = json_bool(model, "ignore_merges", false);
    k.spm = k.spm || t->byte_fallback;
    if (k.byte_level && k.spm)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: mixes byte-level (ByteLevel) and sentencepiece-style (" SPM_SPACE
                       ", byte_fallback) parts; not supported",
                       path);
    if (!k.byte_level && !k.spm)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: a BPE model that is neither byte-level (a ByteLevel pre-tokenizer) "
                       "nor sentencepiece-style (Metaspace, a " SPM_SPACE
                       " normalizer or byte_fallback) is not supported",
                       path);
    if (k.spm && (t->n_steps || t->nfc))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: a sentencepiece-style BPE with %s is not supported", path,
                       t->nfc ? "an NFC normalizer" : "Split or Digits pre-tokenizers");
    t->family = k.byte_level ? FAMILY_BYTE_LEVEL : FAMILY_SPM;
    if (t->family == FAMILY_SPM)
        t->strip_space = hf_decoder_strips(cJSON_GetObjectItemCaseSensitive(root, "decoder"));
    const char *unk = json_str(model, "unk_token");
    if (unk) {
        t->unk = vocab_find(t, unk, strlen(unk));
        if (t->unk < 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: unk_token \"%.100s\" is not in the vocabulary", path, unk);
    }

    /* BOS and EOS: tokenizer_config.json names them; the post-processor's
     * template says whether BOS is added when the config does not */
    const cJSON *tmpl = find_template(cJSON_GetObjectItemCaseSensitive(root, "post_processor"));
    const cJSON *first = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(tmpl, "single"), 0);
    const char *tmpl_name = json_str(cJSON_GetObjectItemCaseSensitive(first, "SpecialToken"), "id");
    int32_t tmpl_id = -1;
    if (tmpl_name) {
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(tmpl, "special_tokens"), tmpl_name);
        long id = json_id(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(sp, "ids"), 0));
        tmpl_id = id >= 0 ? (int32_t)id : find_token(t, tmpl_name);
        if (tmpl_id < 0 || (size_t)tmpl_id >= t->n_tokens)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: the post-processor's template starts with \"%.100s\", which is "
                           "not a token",
                           path, tmpl_name);
    }
    const char *bos = config_token(cfg, "bos_token"), *eos = config_token(cfg, "eos_token");
    t->bos = bos ? find_token(t, bos) : tmpl_id;
    t->eos = eos ? find_token(t, eos) : -1;
    if ((bos && t->bos < 0) || (eos && t->eos < 0))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s \"%.100s\" is not a token of %s", cfg_path,
                       bos && t->bos < 0 ? "bos_token" : "eos_token", bos && t->bos < 0 ? bos : eos,
                       path);
    const cJSON *add_bos = cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token");
    t->adds_bos = cJSON_IsBool(add_bos) ? cJSON_IsTrue(add_bos) : tmpl_id >= 0 && tmpl_id == t->bos;
    if (t->bos < 0)
        t->adds_bos = false;

    if (!tok_finish(t, false))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    char name[96];
    if (t->family == FAMILY_BYTE_LEVEL)
        steps_name(t, name, sizeof name);
    describe(t, name);
    return QL_OK;
}

int tok_from_hf(tok_tokenizer **out, const char *tokenizer_json, const char *config_path, char *msg,
                size_t msg_len)
{
    if (out)
        *out = NULL;
    if (!out || !tokenizer_json)
        return ql_fail(msg, msg_len, QL_EINVAL, "tok_from_hf: no output or no path");
    cJSON *root = NULL, *cfg = NULL;
    tok_tokenizer *t = NULL;
    int rc = mf_read_json(tokenizer_json, 0, &root, msg, msg_len);
    if (!rc && config_path)
        rc = mf_read_json(config_path, 0, &cfg, msg, msg_len);
    if (!rc) {
        t = tok_new(tokenizer_json);
        rc = t ? hf_build(t, root, cfg, tokenizer_json, config_path, msg, msg_len)
               : ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", tokenizer_json);
    }
    cJSON_Delete(root);
    cJSON_Delete(cfg);
    if (rc) {
        tok_free(t);
        return rc;
    }
    *out = t;
    return QL_OK;
}

/* --- GGUF metadata ------------------------------------------------------------ */

static bool gguf_str_is(gguf_str s, const char *want)
{
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

static bool gguf_is_int(gguf_type type)
{
    switch (type) {
    case GGUF_UINT8:
    case GGUF_INT8:
    case GGUF_UINT16:
    case GGUF_INT16:
    case GGUF_UINT32:
    case GGUF_INT32:
    case GGUF_UINT64:
    case GGUF_INT64: return true;
    default: return false;
    }
}

/* A token id under key, if the file has one (a negative one means none). */
static int gguf_token_id(const tok_tokenizer *t, const gguf_file *f, const char *key, int32_t *out,
                         char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv)
        return QL_OK;
    if (!gguf_is_int(kv->type))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s is not an integer", t->source, key);
    if (kv->type != GGUF_UINT64 && kv->i < 0)
        return QL_OK;
    if (kv->u >= t->n_tokens)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s = %llu is outside the vocabulary of %zu tokens", t->source, key,
                       (unsigned long long)kv->u, t->n_tokens);
    *out = (int32_t)kv->u;
    return QL_OK;
}

static int gguf_bool(const tok_tokenizer *t, const gguf_file *f, const char *key, bool *out,
                     char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv)
        return QL_OK;
    if (kv->type != GGUF_BOOL)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: %s is not a bool", t->source, key);
    *out = kv->u != 0;
    return QL_OK;
}

/* tokenizer.ggml.tokens, token_type and scores into the table. */
static int gguf_tokens(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    const char *path = t->source;
    const gguf_kv *toks = gguf_find_kv(f, "tokenizer.ggml.tokens");
    const gguf_kv *types = gguf_find_kv(f, "tokenizer.ggml.token_type");
    const gguf_kv *scores = gguf_find_kv(f, "tokenizer.ggml.scores");
    if (!toks)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s: no tokenizer.ggml.tokens", path);
    if (toks->type != GGUF_ARRAY || toks->elem != GGUF_STRING || toks->n == 0 ||
        toks->n > TOK_MAX_ID)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tokenizer.ggml.tokens is not an array of 1 to %d strings", path,
                       TOK_MAX_ID);
    size_t n = (size_t)toks->n;
    if (types && (types->type != GGUF_ARRAY || types->n != n ||
                  (types->elem != GGUF_INT32 && types->elem != GGUF_UINT32)))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tokenizer.ggml.token_type is not an array of %zu 32-bit integers", path,
                       n);
    if (scores && (scores->type != GGUF_ARRAY || scores->n != n || scores->elem != GGUF_FLOAT32))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tokenizer.ggml.scores is not an array of %zu float32", path, n);
    if (!tok_alloc_tokens(t, n) || !str_map_init(&t->vocab, n))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++) {
        int32_t type = TT_NORMAL;
        if (types) {
            memcpy(&type, types->data + 4 * i, 4);
            if (type < 0 || type >= TT_COUNT)
                return ql_fail(msg, msg_len, QL_EFORMAT,
                               "%s: tokenizer.ggml.token_type[%zu] = %d is not a token type", path,
                               i, (int)type);
        }
        if (scores)
            memcpy(&t->score[i], scores->data + 4 * i, 4);
        if (toks->strs[i].len > UINT32_MAX ||
            !set_token(t, (int32_t)i, toks->strs[i].ptr, (size_t)toks->strs[i].len, (uint8_t)type))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
        vocab_insert(t, (int32_t)i, true);
    }
    return QL_OK;
}

/* tokenizer.ggml.merges ("a b", split at the first space after the first
 * byte, as llama.cpp does), ranked by their order. */
static int gguf_merges(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, "tokenizer.ggml.merges");
    if (!kv)
        return ql_fail(msg, msg_len, QL_ENOTFOUND,
                       "%s: no tokenizer.ggml.merges (a \"gpt2\" tokenizer needs them)", t->source);
    if (kv->type != GGUF_ARRAY || kv->elem != GGUF_STRING || kv->n > UINT32_MAX)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tokenizer.ggml.merges is not an array of strings", t->source);
    if (!pair_map_init(&t->merges, (size_t)kv->n))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", t->source);
    char *buf = NULL;
    size_t cap = 0;
    int rc = QL_OK;
    for (uint64_t i = 0; i < kv->n && !rc; i++) {
        gguf_str s = kv->strs[i];
        const char *space = s.len > 1 ? memchr(s.ptr + 1, ' ', (size_t)s.len - 1) : NULL;
        if (!space) {
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: tokenizer.ggml.merges[%llu] \"%.*s\" is not two tokens and a space",
                         t->source, (unsigned long long)i, (int)(s.len > 100 ? 100 : s.len), s.ptr);
            break;
        }
        size_t la = (size_t)(space - s.ptr);
        rc = add_merge(t, s.ptr, la, space + 1, (size_t)s.len - la - 1, (uint32_t)i, &buf, &cap,
                       t->source, msg, msg_len);
    }
    free(buf);
    return rc;
}

static int gguf_build(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    const char *path = t->source;
    const gguf_kv *model = gguf_find_kv(f, "tokenizer.ggml.model");
    if (!model)
        return ql_fail(msg, msg_len, QL_ENOTFOUND,
                       "%s: no tokenizer.ggml.model: the file carries no tokenizer", path);
    if (model->type != GGUF_STRING)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tokenizer.ggml.model is not a string", path);
    bool gpt2 = gguf_str_is(model->str, "gpt2"), llama = gguf_str_is(model->str, "llama");
    if (!gpt2 && !llama) {
        const char *what = gguf_str_is(model->str, "bert")   ? " (WordPiece)"
                           : gguf_str_is(model->str, "t5")   ? " (Unigram)"
                           : gguf_str_is(model->str, "rwkv") ? " (RWKV's trie)"
                                                             : "";
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: tokenizer.ggml.model \"%.*s\"%s is not supported (only \"gpt2\", "
                       "byte-level BPE, and \"llama\", sentencepiece BPE)",
                       path, (int)(model->str.len > 64 ? 64 : model->str.len), model->str.ptr,
                       what);
    }
    t->family = gpt2 ? FAMILY_BYTE_LEVEL : FAMILY_SPM;
    int rc = gguf_tokens(t, f, msg, msg_len);
    if (rc)
        return rc;
    char pre_name[80] = "default";
    if (gpt2) {
        const gguf_kv *pre = gguf_find_kv(f, "tokenizer.ggml.pre");
        if (pre && pre->type != GGUF_STRING)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tokenizer.ggml.pre is not a string",
                           path);
        if (pre) /* no pre: llama.cpp's default, as llama.cpp does */
            snprintf(pre_name, sizeof pre_name, "%.*s",
                     (int)(pre->str.len > 64 ? 64 : pre->str.len), pre->str.ptr);
        size_t k = 0;
        while (k < N_ELEMS(known_pre) && !(pre ? gguf_str_is(pre->str, known_pre[k].name)
                                               : strcmp(known_pre[k].name, "default") == 0))
            k++;
        if (k == N_ELEMS(known_pre))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: tokenizer.ggml.pre \"%s\" is not a pre-tokenizer we implement "
                           "(default, gpt-2, llama-bpe, qwen2, smollm, ...)",
                           path, pre_name);
        for (int i = 0; i < known_pre[k].n_steps; i++)
            t->steps[i] = known_pre[k].steps[i];
        t->n_steps = known_pre[k].n_steps;
        t->ignore_merges = known_pre[k].ignore_merges;
        t->nfc = known_pre[k].nfc;
        rc = gguf_merges(t, f, msg, msg_len);
    } else {
        /* llama.cpp's SPM session: "▁" before each text fragment unless
         * add_space_prefix is false, spaces as ▁, score-driven merges */
        bool space_prefix = true;
        rc = gguf_bool(t, f, "tokenizer.ggml.add_space_prefix", &space_prefix, msg, msg_len);
        t->score_merges = true;
        t->byte_fallback = true;
        t->replace_space = true;
        t->prefix = space_prefix ? PREFIX_EVERY : PREFIX_NONE;
        t->strip_space = space_prefix;
    }
    if (rc)
        return rc;

    size_t cap = 0;
    for (size_t i = 0; i < t->n_tokens; i++) {
        uint8_t type = t->type[i];
        if (type != TT_CONTROL && type != TT_USER && type != TT_UNKNOWN)
            continue;
        tok_added a = {.id = (int32_t)i, .len = t->text_len[i], .special = type != TT_USER};
        if (!add_added(t, &cap, &a, t->arena + t->text_off[i]))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    }
    if (llama)
        for (size_t i = 0; i < t->n_tokens && t->unk < 0; i++)
            if (t->type[i] == TT_UNKNOWN)
                t->unk = (int32_t)i;
    bool add_bos = llama; /* llama.cpp's defaults when the key is missing */
    if ((rc = gguf_token_id(t, f, "tokenizer.ggml.bos_token_id", &t->bos, msg, msg_len)) ||
        (rc = gguf_token_id(t, f, "tokenizer.ggml.eos_token_id", &t->eos, msg, msg_len)) ||
        (rc = gguf_token_id(t, f, "tokenizer.ggml.unknown_token_id", &t->unk, msg, msg_len)) ||
        (rc = gguf_bool(t, f, "tokenizer.ggml.add_bos_token", &add_bos, msg, msg_len)))
        return rc;
    t->adds_bos = add_bos && t->bos >= 0;
    if (!tok_finish(t, true))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    describe(t, pre_name);
    return QL_OK;
}

int tok_from_gguf(tok_tokenizer **out, const gguf_file *f, char *msg, size_t msg_len)
{
    if (out)
        *out = NULL;
    if (!out || !f)
        return ql_fail(msg, msg_len, QL_EINVAL, "tok_from_gguf: no output or no file");
    tok_tokenizer *t = tok_new(f->path ? f->path : "GGUF file");
    if (!t)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", f->path ? f->path : "GGUF");
    int rc = gguf_build(t, f, msg, msg_len);
    if (rc) {
        tok_free(t);
        return rc;
    }
    *out = t;
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

/*
 * tokenizer_internal.h - what the files of tokenizer/ share, and
 * nothing outside the folder includes (it is on no public include path).
 *
 * It offers the loaded tokenizer (struct tok_tokenizer: the token table,
 * the two hashes, the pre-tokenizer and SentencePiece settings), the
 * generated Unicode tables' declarations, and the functions one file of
 * the folder provides to the others. Who provides what, and may call whom
 * (no file calls back into one that calls it):
 *
 *   unicode_tables.c  the generated data (gen_unicode_tables.py); no code.
 *   unicode.c         UTF-8 with the raw-byte convention, class lookups,
 *                     NFC. Calls base/ only.
 *   pretokenize.c     the hand-written pre-tokenizer regexes and the names
 *                     they are known by. Calls unicode.c.
 *   tok_table.c       the tokenizer's lifetime, token table, hashes, merges,
 *                     decoded pieces and description. Calls unicode.c.
 *   bpe.c             tok_encode. Calls tok_table.c, pretokenize.c,
 *                     unicode.c.
 *   decode.c          tok_decode and the streaming decoder. Calls base/.
 *   tok_hf.c          tok_from_hf. Calls tok_table.c, pretokenize.c and
 *                     modelfile/.
 *   tok_gguf.c        tok_from_gguf. Calls tok_table.c, pretokenize.c and
 *                     modelfile/.
 */
#ifndef QL_TOKENIZER_INTERNAL_H
#define QL_TOKENIZER_INTERNAL_H

#include "tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

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

/* --- the generated Unicode tables (unicode_tables.c) --------------------- */

/* Class bits; gen_unicode_tables.py writes a static assertion that its
 * numbers are these. */
#define UC_LETTER 1  /* \p{L} */
#define UC_NUMBER 2  /* \p{N} */
#define UC_PUNCT  4  /* \p{P} */
#define UC_SPACE  8  /* \s (Oniguruma, = White_Space) */
#define UC_MARK   16 /* \p{M} */
#define UC_UPPER  32 /* \p{Lu} \p{Lt} (o200k's upper-case class; Lm, Lo have neither bit) */
#define UC_LOWER  64 /* \p{Ll} (o200k's lower-case class) */

typedef struct uc_range {
    uint32_t lo, hi;
    uint8_t value;
} uc_range;

typedef struct uc_fold {
    uint32_t cp;
    char folded;
} uc_fold;

/* How each table is defined: gen_unicode_tables.py's docstring. */
extern const char uc_unicode_version[];
extern const uc_range uc_class_ranges[]; /* UC_* bits of code points, sorted */
extern const size_t uc_class_ranges_len;
extern const uc_fold uc_casefold_ascii[]; /* >= U+0080 folding to one ASCII letter */
extern const size_t uc_casefold_ascii_len;
extern const uc_range uc_ccc_ranges[]; /* canonical combining class, non-zero */
extern const size_t uc_ccc_ranges_len;
extern const uint32_t uc_decomp[][3]; /* cp -> first[, second]; sorted by cp */
extern const size_t uc_decomp_len;
extern const uint32_t uc_comp[][3]; /* (first, second) -> composite; sorted */
extern const size_t uc_comp_len;

/* --- unicode.c ------------------------------------------------------------ */

/* Decode the character at s[0..n) (n >= 1) with ql_utf8_next: its byte
 * length, *cp the code point, or 1 with *cp = CP_RAW + s[0] when s does not
 * start a well-formed sequence. */
size_t tok_utf8_next(const uint8_t *s, size_t n, uint32_t *cp);
/* Encode cp (or a raw byte) at out (4 bytes of room); returns the length. */
size_t tok_utf8_put(uint32_t cp, uint8_t *out);
/* UC_* class bits of a code point; a raw byte has none. */
uint8_t uc_class(uint32_t cp);
/* The ASCII letter cp case-folds to (Oniguruma's (?i:) as Llama 3's
 * contractions use it), or 0. */
char uc_fold_ascii(uint32_t cp);

/* A growing array of code points (free v). */
typedef struct cp_buf {
    uint32_t *v;
    size_t n, cap;
} cp_buf;

bool uc_cp_push(cp_buf *b, uint32_t cp);
/* out = NFC(in) (out's old contents are dropped); false when out of memory. */
bool uc_nfc(const uint32_t *in, size_t n, cp_buf *out);

/* --- pretokenize.c -------------------------------------------------------- */

/* The pre-tokenizer steps: each splits every current piece with one regex
 * (or Digits rule), keeping matches and the text between them as pieces. */
typedef enum pre_step {
    STEP_GPT2,   /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    STEP_LLAMA3, /* (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|... */
    STEP_QWEN2,  /* the same with \p{N} one at a time */
    STEP_PUNCT,  /* [\p{P}\$\+<=>\^~\|]+ (llama.cpp's "default", first) */
    STEP_NUMBERS,        /* \p{N}+ (Digits without individual_digits; "default", third) */
    STEP_DIGIT,          /* \p{N} (Digits with individual_digits) */
    STEP_THREE_DIGITS,   /* [0-9][0-9][0-9] ("default", fourth) */
    STEP_FALCON_PUNCT,   /* [\p{P}\$\+<=>\^~\|`]+ (falcon, first) */
    STEP_LINE_BREAK,     /* [\r\n] (deepseek-llm and deepseek-coder, first) */
    STEP_SPACE_LETTERS,  /* \s?\p{L}+ (deepseek-coder) */
    STEP_SPACE_PUNCT,    /* \s?\p{P}+ (deepseek-coder) */
    STEP_CJK,            /* [一-龥ࠀ-一가-퟿]+ (the deepseek family) */
    STEP_DS_LETTERS,     /* \s?[A-Za-zµÀ-Ö...]+ (deepseek-llm: its cased-letter ranges) */
    STEP_DS_PUNCT,       /* \s?[!-/:-~！-／：-～‘-‟　-。]+ (deepseek-llm) */
    STEP_TRAILING_SPACE, /* \s+$ (deepseek-llm) */
    STEP_QWEN35, /* Qwen2's with [\p{L}\p{M}]+ for \p{L}+ and \p{M} out of the "other" run */
    STEP_LLAMA3_NUMBERS, /* Llama 3's with \p{N}+ (bloom, poro-chat) */
    STEP_O200K, /* [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+
                   (?i:'s|...)?|...: o200k's (GPT-4o, GPT-OSS) in tokenizers' reading */
    STEP_GPT4O, /* the same as llama.cpp's "gpt-4o" rewrites and runs it: a non-ASCII letter is
                   upper and lower case at once, a mark is no letter, contractions ASCII only */
} pre_step;

#define TOK_MAX_STEPS 8

/* A GGUF tokenizer.ggml.pre name (llama.cpp's llama-vocab.cpp) and the
 * steps llama.cpp runs for it. */
typedef struct tok_pre {
    const char *name;
    pre_step steps[TOK_MAX_STEPS];
    int n_steps;
    bool ignore_merges; /* a pre-token that is a whole token is taken as it is */
    bool add_bos;       /* llama.cpp's default for tokenizer.ggml.add_bos_token */
} tok_pre;

/*
 * One step's regex tried at code point i of a piece [from, n) (the piece is
 * the whole subject: lookaheads see its end as the end of the text), after
 * it was tried, and failed, at every position from `from` to i - 1 that no
 * match covered. Returns where the match ends, or i when nothing matches
 * there. cls[] holds the UC_* bits of each code point.
 */
size_t tok_match_step(pre_step step, const uint32_t *cp, const uint8_t *cls, size_t from, size_t i,
                      size_t n);
/* The step whose regex is exactly `regex` (as tokenizer.json spells it,
 * JSON-unescaped) into *step; false when it is none we implement. */
bool tok_step_for_regex(const char *regex, pre_step *step);
/* The GGUF pre-tokenizer named name[0..len), or NULL. */
const tok_pre *tok_pre_named(const char *name, size_t len);
/* The name of these steps: llama.cpp's name when they are one of its, else
 * the steps joined by '+' ("none" for no step). */
void tok_steps_name(const pre_step *steps, int n_steps, char *out, size_t len);

/* --- the loaded tokenizer (tok_table.c) ----------------------------------- */

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

/* Built by one loader (tok_hf.c, tok_gguf.c) through tok_table.c, then
 * read-only: bpe.c and decode.c only look. */
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
    /* llama.cpp's "gemma4": each run of newlines and each run of other
     * characters is merged apart ("[^\n]+|[\n]+"), and a run of newlines
     * that is a token is taken whole */
    bool line_runs;
    bool byte_fallback;
    bool fuse_unk;
    int32_t unk;
    int32_t byte_id[256]; /* <0xXX> */
    bool strip_space;     /* the decoder drops one leading space */

    int32_t bos, eos;
    bool adds_bos;
};

/* Grow *p (elements of `size` bytes, capacity *cap) to hold at least `need`;
 * false (nothing changed) when out of memory. */
static inline bool tok_grow(void **p, size_t *cap, size_t need, size_t size)
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

/* The text of token id (not NUL-terminated; borrowed from the arena, which
 * moves while a loader adds to it). */
static inline const char *tok_text(const tok_tokenizer *t, int32_t id, uint32_t *len)
{
    *len = t->text_len[id];
    return t->arena + t->text_off[id];
}

/* A new, empty tokenizer (bos, eos, unk -1) for the file `source`; NULL
 * when out of memory. Free with tok_free. */
tok_tokenizer *tok_new(const char *source);
/* The per-id arrays for n ids, zeroed; false when out of memory. */
bool tok_alloc_tokens(tok_tokenizer *t, size_t n);
/* Give id its text (copied into the arena) and type. */
bool tok_set_token(tok_tokenizer *t, int32_t id, const char *s, size_t n, uint8_t type);
/* Add an added token, its text s[0..a->len) copied (one with no text is left
 * out: it would match everywhere); *cap is t->added's capacity. */
bool tok_add_added(tok_tokenizer *t, size_t *cap, const tok_added *a, const char *s);

/* The text -> id hash, sized for n ids. */
bool tok_vocab_init(tok_tokenizer *t, size_t n);
/* The id whose text is s[0..n), or -1. */
int32_t tok_vocab_find(const tok_tokenizer *t, const char *s, size_t n);
/* Put id under its text; an id already there with the same text is
 * replaced when `replace` (llama.cpp's map: the last token of a text wins),
 * kept otherwise. */
void tok_vocab_insert(tok_tokenizer *t, int32_t id, bool replace);

/* The merge hash, sized for n merges. */
bool tok_merges_init(tok_tokenizer *t, size_t n);
/* The merge of tokens a and b, or NULL. */
const pair_slot *tok_merge_find(const tok_tokenizer *t, int32_t a, int32_t b);
/* Look up the two halves of merge `rank` (a[0..la), b[0..lb)) and their
 * concatenation and add the pair (a repeated pair keeps its first rank);
 * *buf (capacity *cap, the caller frees it) is scratch. QL_EFORMAT naming
 * path when a part is not in the vocabulary. */
int tok_add_merge(tok_tokenizer *t, const char *a, size_t la, const char *b, size_t lb,
                  uint32_t rank, char **buf, size_t *cap, const char *path, char *msg,
                  size_t msg_len);

/*
 * Everything encoding and decoding need beyond the table and the hashes:
 * the byte maps, each id's decoded piece, the added tokens indexed by first
 * byte. raw_added: added tokens decode as their text (llama.cpp) rather
 * than through the byte-level map (tokenizers). False when out of memory.
 */
bool tok_finish(tok_tokenizer *t, bool raw_added);
/* Fill t->describe; pre_name names the byte-level pre-tokenizer. */
void tok_write_description(tok_tokenizer *t, const char *pre_name);

#endif

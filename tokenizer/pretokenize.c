/*
 * pretokenize.c - the pre-tokenizer regexes of the models we run, written
 * out by hand, and the names they are known by.
 *
 * No regex library: each pre-tokenizer regex the supported models use is a
 * matcher over code points classified by the generated tables, and a
 * pre-tokenizer is recognised by its exact regex string (tokenizer.json) or
 * llama.cpp's name for it (GGUF tokenizer.ggml.pre). Anything else is
 * refused by the loaders, since a near miss would silently give other ids
 * than the model was trained on.
 *
 * It offers tok_match_step (one step's regex at one position) and the
 * tables from regex or name to steps; it owns those constant tables and
 * touches only its arguments. bpe.c runs the steps over a text.
 */
#include "internal/tokenizer_internal.h"

#include <stdio.h>
#include <string.h>

static const char *const step_names[] = {
    [STEP_GPT2] = "gpt2",
    [STEP_LLAMA3] = "llama3",
    [STEP_QWEN2] = "qwen2",
    [STEP_PUNCT] = "punct",
    [STEP_NUMBERS] = "numbers",
    [STEP_DIGIT] = "digits",
    [STEP_THREE_DIGITS] = "999",
    [STEP_FALCON_PUNCT] = "falcon-punct",
    [STEP_LINE_BREAK] = "line-break",
    [STEP_SPACE_LETTERS] = "space-letters",
    [STEP_SPACE_PUNCT] = "space-punct",
    [STEP_CJK] = "cjk",
    [STEP_DS_LETTERS] = "deepseek-letters",
    [STEP_DS_PUNCT] = "deepseek-punct",
    [STEP_TRAILING_SPACE] = "trailing-space",
    [STEP_QWEN35] = "qwen35",
    [STEP_LLAMA3_NUMBERS] = "llama3-numbers",
    [STEP_O200K] = "o200k",
    [STEP_GPT4O] = "gpt-4o",
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
    {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     STEP_O200K},
    {"[\\p{P}\\$\\+<=>\\^~\\|]+", STEP_PUNCT},
    {"\\p{N}+", STEP_NUMBERS},
    {"[0-9][0-9][0-9]", STEP_THREE_DIGITS},
};

/* GGUF tokenizer.ggml.pre names (llama.cpp's llama-vocab.cpp) whose regexes
 * are among ours, and the steps llama.cpp runs for them. A GGUF carries no
 * normalizer, and llama.cpp runs none: the Qwen2 family's tokenizer.json
 * has NFC, which Hugging Face tokenizers applies and llama.cpp does not
 * (decomposed "é", e + U+0301, is one token there and two here; llama.cpp's
 * ggml-vocab-qwen35.gguf.out pins the two). A GGUF gets llama.cpp's ids. */
#define PRE_GPT2       .steps = {STEP_GPT2}, .n_steps = 1
#define PRE_DIGIT_GPT2 .steps = {STEP_DIGIT, STEP_GPT2}, .n_steps = 2
#define PRE_LLAMA3     .steps = {STEP_LLAMA3}, .n_steps = 1, .ignore_merges = true, .add_bos = true
#define PRE_QWEN2      .steps = {STEP_QWEN2}, .n_steps = 1
static const tok_pre known_pre[] = {
    {.name = "default",
     .steps = {STEP_PUNCT, STEP_GPT2, STEP_NUMBERS, STEP_THREE_DIGITS},
     .n_steps = 4},
    /* GPT-2's regex alone */
    {.name = "gpt-2", PRE_GPT2},
    {.name = "phi-2", PRE_GPT2},
    {.name = "mpt", PRE_GPT2},
    {.name = "olmo", PRE_GPT2},
    {.name = "jais", PRE_GPT2},
    {.name = "trillion", PRE_GPT2},
    {.name = "granite-docling", PRE_GPT2},
    {.name = "exaone4", PRE_GPT2},
    {.name = "mellum", PRE_GPT2},
    {.name = "modern-bert", PRE_GPT2},
    {.name = "gigachat", PRE_GPT2},
    {.name = "a.x-4.0", PRE_GPT2},
    /* each digit alone, then GPT-2's */
    {.name = "smollm", PRE_DIGIT_GPT2},
    {.name = "starcoder", PRE_DIGIT_GPT2},
    {.name = "refact", PRE_DIGIT_GPT2},
    {.name = "command-r", PRE_DIGIT_GPT2},
    {.name = "codeshell", PRE_DIGIT_GPT2},
    {.name = "exaone", PRE_DIGIT_GPT2},
    {.name = "minerva-7b", PRE_DIGIT_GPT2},
    {.name = "mellum2", PRE_DIGIT_GPT2},
    /* Llama 3's; llama.cpp adds BOS by default and takes a pre-token that
     * is a whole token as it is (ignore_merges) for these */
    {.name = "llama3", PRE_LLAMA3},
    {.name = "llama-bpe", PRE_LLAMA3},
    {.name = "llama-v3", PRE_LLAMA3},
    {.name = "falcon3", PRE_LLAMA3},
    {.name = "falcon-h1", PRE_LLAMA3},
    {.name = "pixtral", PRE_LLAMA3},
    {.name = "midm-2.0", PRE_LLAMA3},
    {.name = "lfm2", PRE_LLAMA3},
    /* the same regex, without those two */
    {.name = "dbrx", .steps = {STEP_LLAMA3}, .n_steps = 1},
    {.name = "smaug-bpe", .steps = {STEP_LLAMA3}, .n_steps = 1},
    {.name = "bloom", .steps = {STEP_LLAMA3_NUMBERS}, .n_steps = 1},
    {.name = "poro-chat", .steps = {STEP_LLAMA3_NUMBERS}, .n_steps = 1},
    /* Qwen2's */
    {.name = "qwen2", PRE_QWEN2},
    {.name = "deepseek-r1-qwen", PRE_QWEN2},
    {.name = "kormo", PRE_QWEN2},
    {.name = "f2llmv2", PRE_QWEN2},
    {.name = "megrez", PRE_QWEN2},
    {.name = "stablelm2", .steps = {STEP_QWEN2}, .n_steps = 1},
    {.name = "hunyuan", .steps = {STEP_QWEN2}, .n_steps = 1},
    {.name = "solar-open", .steps = {STEP_QWEN2}, .n_steps = 1},
    {.name = "qwen35", .steps = {STEP_QWEN35}, .n_steps = 1},
    /* o200k's regex as llama.cpp rewrites it for std::regex (GPT-OSS, GPT-4o, Llama 4) */
    {.name = "gpt-4o", .steps = {STEP_GPT4O}, .n_steps = 1},
    {.name = "llama4", .steps = {STEP_GPT4O}, .n_steps = 1},
    {.name = "kanana2", .steps = {STEP_GPT4O}, .n_steps = 1},
    {.name = "talkie", .steps = {STEP_GPT4O}, .n_steps = 1},
    {.name = "falcon", .steps = {STEP_FALCON_PUNCT, STEP_GPT2, STEP_THREE_DIGITS}, .n_steps = 3},
    {.name = "deepseek-coder",
     .steps = {STEP_LINE_BREAK, STEP_SPACE_LETTERS, STEP_SPACE_PUNCT, STEP_CJK, STEP_DIGIT},
     .n_steps = 5},
    {.name = "deepseek-llm",
     .steps = {STEP_LINE_BREAK, STEP_DS_LETTERS, STEP_DS_PUNCT, STEP_TRAILING_SPACE, STEP_CJK,
               STEP_NUMBERS},
     .n_steps = 6},
};

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

/* \s*[\r\n]+|\s+(?!\S)|\s+ at i (cls[i] is a space): up to the last line
 * break of the whitespace run, else as match_space. */
static size_t match_space_newlines(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n)
{
    size_t e = run_of(cls, i, n, C_S), end = i;
    for (size_t k = i; k < e; k++)
        if (is_newline(cp[k]))
            end = k + 1;
    return end > i ? end : match_space(cls, i, n);
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

/* Llama 3 (max_digits 3), Qwen2 (1), bloom (0: no limit):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 * | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * and Qwen3.5's, where letters = [\p{L}\p{M}] in the second alternative and
 * in the class the fourth excludes (llama.cpp's unicode_regex_split_custom_qwen35). */
static size_t match_llama3(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n,
                           size_t max_digits, uint8_t letters)
{
    if (cp[i] == '\'' && i + 1 < n) {
        size_t m = match_contraction((uint32_t)uc_fold_ascii(cp[i + 1]),
                                     i + 2 < n ? (uint32_t)uc_fold_ascii(cp[i + 2]) : 0);
        if (m)
            return i + m;
    }
    if (cls[i] & letters)
        return run_of(cls, i, n, letters);
    if (!is_newline(cp[i]) && !(cls[i] & C_N) && i + 1 < n && (cls[i + 1] & letters))
        return run_of(cls, i + 1, n, letters);
    if (cls[i] & C_N) {
        size_t e = i;
        while (e < n && (max_digits == 0 || e - i < max_digits) && (cls[e] & C_N))
            e++;
        return e;
    }
    uint8_t not_other = C_S | C_N | letters;
    size_t j = cp[i] == ' ' && i + 1 < n && !(cls[i + 1] & not_other) ? i + 1 : i;
    if (!(cls[j] & not_other)) {
        size_t e = j;
        while (e < n && !(cls[e] & not_other))
            e++;
        while (e < n && is_newline(cp[e]))
            e++;
        return e;
    }
    if (cls[i] & C_S)
        return match_space_newlines(cp, cls, i, n);
    return i;
}

/*
 * o200k's regex (GPT-4o, GPT-OSS):
 *   [^\r\n\p{L}\p{N}]?U*W+C? | [^\r\n\p{L}\p{N}]?U+W*C? | \p{N}{1,3}
 *   | ?[^\s\p{L}\p{N}]+[\r\n/]* | \s*[\r\n]+ | \s+(?!\S) | \s+
 * with C the contractions (?i:'s|'t|'re|'ve|'m|'ll|'d). tokenizers reads U as
 * [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and W as [\p{Ll}\p{Lm}\p{Lo}\p{M}] (they overlap:
 * Lm, Lo and marks are both). llama.cpp's "gpt-4o" spells U as (?=\p{L})[^a-z], W as
 * (?=\p{L})[^A-Z] and C as '[sS]|..., and runs it over text where every non-ASCII
 * letter is one placeholder byte: such a letter is both U and W there, a mark is
 * neither, and only ASCII letters fold.
 */
static bool o200k_upper(uint32_t cp, uint8_t c, bool llama_cpp)
{
    if (llama_cpp)
        return (c & C_L) && !(cp >= 'a' && cp <= 'z');
    return (c & UC_MARK) || ((c & C_L) && !(c & UC_LOWER));
}

static bool o200k_lower(uint32_t cp, uint8_t c, bool llama_cpp)
{
    if (llama_cpp)
        return (c & C_L) && !(cp >= 'A' && cp <= 'Z');
    return (c & UC_MARK) || ((c & C_L) && !(c & UC_UPPER));
}

/* C? at i: where the optional contraction ends */
static size_t o200k_contraction(const uint32_t *cp, size_t i, size_t n, bool llama_cpp)
{
    if (i + 1 >= n || cp[i] != '\'')
        return i;
    uint32_t a = cp[i + 1], b = i + 2 < n ? cp[i + 2] : 0;
    if (llama_cpp) {
        a = a >= 'A' && a <= 'Z' ? a - 'A' + 'a' : a;
        b = b >= 'A' && b <= 'Z' ? b - 'A' + 'a' : b;
    } else {
        a = (uint32_t)uc_fold_ascii(a);
        b = b ? (uint32_t)uc_fold_ascii(b) : 0;
    }
    return i + match_contraction(a, b);
}

/* U*W+ at j, backtracking as a regex engine does: U* takes its whole run, and
 * gives back one character at a time until a W follows. Returns the end, or
 * j when there is no match. */
static size_t o200k_lower_word(const uint32_t *cp, const uint8_t *cls, size_t j, size_t n, bool lc)
{
    size_t u = j;
    while (u < n && o200k_upper(cp[u], cls[u], lc))
        u++;
    if (u < n && o200k_lower(cp[u], cls[u], lc)) {
        while (u < n && o200k_lower(cp[u], cls[u], lc))
            u++;
        return u;
    }
    /* the last W inside the U run; W+ stops right after it (nothing after it
     * up to u is W, and u is not) */
    for (size_t k = u; k > j; k--)
        if (o200k_lower(cp[k - 1], cls[k - 1], lc))
            return k;
    return j;
}

/* U+W* at j: the end, or j */
static size_t o200k_upper_word(const uint32_t *cp, const uint8_t *cls, size_t j, size_t n, bool lc)
{
    size_t e = j;
    while (e < n && o200k_upper(cp[e], cls[e], lc))
        e++;
    if (e == j)
        return j;
    while (e < n && o200k_lower(cp[e], cls[e], lc))
        e++;
    return e;
}

static size_t match_o200k(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n, bool lc)
{
    /* the optional [^\r\n\p{L}\p{N}] before a word: taken first, dropped when
     * the word cannot follow it */
    bool prefix = !is_newline(cp[i]) && !(cls[i] & (C_L | C_N)) && i + 1 < n;
    size_t (*const words[2])(const uint32_t *, const uint8_t *, size_t, size_t,
                             bool) = {o200k_lower_word, o200k_upper_word};
    for (int w = 0; w < 2; w++) {
        size_t e;
        if (prefix && (e = words[w](cp, cls, i + 1, n, lc)) > i + 1)
            return o200k_contraction(cp, e, n, lc);
        if ((e = words[w](cp, cls, i, n, lc)) > i)
            return o200k_contraction(cp, e, n, lc);
    }
    if (cls[i] & C_N) {
        size_t e = i;
        while (e < n && e - i < 3 && (cls[e] & C_N))
            e++;
        return e;
    }
    size_t j = cp[i] == ' ' && i + 1 < n && is_other(cls[i + 1]) ? i + 1 : i;
    if (is_other(cls[j])) {
        size_t e = run_of_other(cls, j, n);
        while (e < n && (is_newline(cp[e]) || cp[e] == '/'))
            e++;
        return e;
    }
    if (cls[i] & C_S)
        return match_space_newlines(cp, cls, i, n);
    return i;
}

/* [\p{P}\$\+<=>\^~\|]+, and falcon's [\p{P}\$\+<=>\^~\|`]+ */
static bool is_default_punct(uint32_t cp, uint8_t cls, bool backtick)
{
    return (cls & UC_PUNCT) || (cp < 0x80 && cp && strchr("$+<=>^~|", (int)cp)) ||
           (backtick && cp == '`');
}

/*
 * The deepseek regexes llama.cpp runs through std::regex (unicode.cpp's
 * unicode_regex_split), whose reading of them the matchers below follow:
 * a regex with \p{..} sees each non-ASCII code point as its category (so
 * \p{L} and \p{P} are the Unicode categories, \s is White_Space), one
 * without sees code points, but with every non-ASCII whitespace code point
 * turned into U+000B first: an explicit class never contains one (U+3000
 * in deepseek-llm's punctuation class matches as \s, not as the class).
 */
static bool in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp > r[mid][1])
            lo = mid + 1;
        else if (cp < r[mid][0])
            hi = mid;
        else
            return true;
    }
    return false;
}

/* [一-龥ࠀ-一가-퟿]: U+4E00..U+9FA5, U+0800..U+4E00, U+AC00..U+D7FF */
static bool is_deepseek_cjk(uint32_t cp, uint8_t cls)
{
    return !(cls & C_S) && ((cp >= 0x0800 && cp <= 0x9FA5) || (cp >= 0xAC00 && cp <= 0xD7FF));
}

/* deepseek-llm's letter class, as its regex lists it: the cased letters
 * (Lu, Ll, Lt) of a Unicode version, a few other letters among them */
static const uint32_t deepseek_letters[][2] = {
    {0x0041, 0x005A},   {0x0061, 0x007A},   {0x00B5, 0x00B5},   {0x00C0, 0x00D6},
    {0x00D8, 0x00F6},   {0x00F8, 0x01BA},   {0x01BC, 0x01BF},   {0x01C4, 0x0293},
    {0x0295, 0x02AF},   {0x0370, 0x0373},   {0x0376, 0x0377},   {0x037B, 0x037D},
    {0x037F, 0x037F},   {0x0386, 0x0386},   {0x0388, 0x038A},   {0x038C, 0x038C},
    {0x038E, 0x03A1},   {0x03A3, 0x03F5},   {0x03F7, 0x0481},   {0x048A, 0x052F},
    {0x0531, 0x0556},   {0x10A0, 0x10C5},   {0x13A0, 0x13F5},   {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA},   {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},   {0x1D6B, 0x1D77},
    {0x1D79, 0x1D9A},   {0x1E00, 0x1F15},   {0x1F18, 0x1F1D},   {0x1F20, 0x1F45},
    {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},   {0x1F59, 0x1F59},   {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},   {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},   {0x1FD0, 0x1FD3},
    {0x1FD6, 0x1FDB},   {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},   {0x1FF6, 0x1FFC},
    {0x2102, 0x2102},   {0x2107, 0x2107},   {0x210A, 0x2113},   {0x2115, 0x2115},
    {0x2119, 0x211D},   {0x2124, 0x2124},   {0x2126, 0x2126},   {0x2128, 0x2128},
    {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},   {0x213C, 0x213F},
    {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2184},   {0x2C00, 0x2C7B},
    {0x2C7E, 0x2CE4},   {0x2CEB, 0x2CEE},   {0x2CF2, 0x2CF3},   {0xA640, 0xA66D},
    {0xA680, 0xA69B},   {0xA722, 0xA76F},   {0xA771, 0xA787},   {0xA78B, 0xA78E},
    {0xAB70, 0xABBF},   {0xFB00, 0xFB06},   {0xFB13, 0xFB17},   {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A},   {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

/* deepseek-llm's punctuation class [!-/:-~！-／：-～‘-‟　-。] (ASCII
 * 0x21..0x2F and 0x3A..0x7E: letters are in it too) */
static const uint32_t deepseek_punct[][2] = {
    {0x0021, 0x002F}, {0x003A, 0x007E}, {0x2018, 0x201F},
    {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E},
};

static bool is_deepseek_letter(uint32_t cp, uint8_t cls)
{
    return !(cls & C_S) && in_ranges(deepseek_letters, N_ELEMS(deepseek_letters), cp);
}

static bool is_deepseek_punct(uint32_t cp, uint8_t cls)
{
    return !(cls & C_S) && in_ranges(deepseek_punct, N_ELEMS(deepseek_punct), cp);
}

/* \s?X+ where X is one of the classes above (none of which holds a
 * space): the space is taken only when X follows it */
static size_t match_space_then(bool (*is_x)(uint32_t, uint8_t), const uint32_t *cp,
                               const uint8_t *cls, size_t i, size_t n)
{
    size_t j = (cls[i] & C_S) && i + 1 < n && is_x(cp[i + 1], cls[i + 1]) ? i + 1 : i;
    if (!is_x(cp[j], cls[j]))
        return i;
    while (j < n && is_x(cp[j], cls[j]))
        j++;
    return j;
}

static bool is_letter(uint32_t cp, uint8_t cls)
{
    (void)cp;
    return cls & C_L;
}

static bool is_punct(uint32_t cp, uint8_t cls)
{
    (void)cp;
    return cls & UC_PUNCT;
}

/* \s+$: the whitespace that ends the piece. A space right after a position
 * that failed fails too (its run ends in the same place), which keeps a
 * long run that does not end the piece linear. */
static size_t match_trailing_space(const uint8_t *cls, size_t from, size_t i, size_t n)
{
    if (!(cls[i] & C_S) || (i > from && (cls[i - 1] & C_S)))
        return i;
    size_t e = run_of(cls, i, n, C_S);
    return e == n ? n : i;
}

size_t tok_match_step(pre_step step, const uint32_t *cp, const uint8_t *cls, size_t from, size_t i,
                      size_t n)
{
    switch (step) {
    case STEP_GPT2: return match_gpt2(cp, cls, i, n);
    case STEP_LLAMA3: return match_llama3(cp, cls, i, n, 3, C_L);
    case STEP_QWEN2: return match_llama3(cp, cls, i, n, 1, C_L);
    case STEP_QWEN35: return match_llama3(cp, cls, i, n, 1, C_L | UC_MARK);
    case STEP_LLAMA3_NUMBERS: return match_llama3(cp, cls, i, n, 0, C_L);
    case STEP_O200K: return match_o200k(cp, cls, i, n, false);
    case STEP_GPT4O: return match_o200k(cp, cls, i, n, true);
    case STEP_PUNCT:
    case STEP_FALCON_PUNCT: {
        size_t e = i;
        while (e < n && is_default_punct(cp[e], cls[e], step == STEP_FALCON_PUNCT))
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
    case STEP_LINE_BREAK: return is_newline(cp[i]) ? i + 1 : i;
    case STEP_SPACE_LETTERS: return match_space_then(is_letter, cp, cls, i, n);
    case STEP_SPACE_PUNCT: return match_space_then(is_punct, cp, cls, i, n);
    case STEP_DS_LETTERS: return match_space_then(is_deepseek_letter, cp, cls, i, n);
    case STEP_DS_PUNCT: return match_space_then(is_deepseek_punct, cp, cls, i, n);
    case STEP_CJK: {
        size_t e = i;
        while (e < n && is_deepseek_cjk(cp[e], cls[e]))
            e++;
        return e;
    }
    case STEP_TRAILING_SPACE: return match_trailing_space(cls, from, i, n);
    }
    return i;
}

/* --- the names steps are known by ------------------------------------------ */

bool tok_step_for_regex(const char *regex, pre_step *step)
{
    for (size_t i = 0; i < N_ELEMS(known_regexes); i++) {
        if (strcmp(regex, known_regexes[i].regex) == 0) {
            *step = known_regexes[i].step;
            return true;
        }
    }
    return false;
}

const tok_pre *tok_pre_named(const char *name, size_t len)
{
    for (size_t k = 0; k < N_ELEMS(known_pre); k++)
        if (strlen(known_pre[k].name) == len && memcmp(known_pre[k].name, name, len) == 0)
            return &known_pre[k];
    return NULL;
}

void tok_steps_name(const pre_step *steps, int n_steps, char *out, size_t len)
{
    for (size_t k = 0; k < N_ELEMS(known_pre); k++) {
        if (known_pre[k].n_steps != n_steps)
            continue;
        bool same = true;
        for (int i = 0; i < n_steps; i++)
            same = same && known_pre[k].steps[i] == steps[i];
        if (same) {
            snprintf(out, len, "%s", known_pre[k].name);
            return;
        }
    }
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < n_steps && at < len; i++)
        at += (size_t)snprintf(out + at, len - at, "%s%s", i ? "+" : "", step_names[steps[i]]);
    if (n_steps == 0)
        snprintf(out, len, "none");
}

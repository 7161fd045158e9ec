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
static const tok_pre known_pre[] = {
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
        size_t m = match_contraction((uint32_t)uc_fold_ascii(cp[i + 1]),
                                     i + 2 < n ? (uint32_t)uc_fold_ascii(cp[i + 2]) : 0);
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

size_t tok_match_step(pre_step step, const uint32_t *cp, const uint8_t *cls, size_t i, size_t n)
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

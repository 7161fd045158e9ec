/*
 * unicode.c - the Unicode the tokenizer needs, without ICU: UTF-8 with the
 * tokenizer's raw-byte convention, code point classes for the
 * pre-tokenizer regexes, case folding to ASCII, and NFC (Qwen2's
 * normalizer).
 *
 * Well-formed UTF-8 is base/'s ql_utf8_next (the one definition the server
 * shares); what this file adds is the convention that a byte that starts no
 * well-formed character is carried as CP_RAW + the byte, a "code point" of
 * no class that encodes back to itself, so untrusted text goes through
 * encoding losslessly. The lookups are binary searches over the generated
 * tables of unicode_tables.c.
 *
 * It owns no state; it touches only its arguments and those tables.
 */
#include "internal/tokenizer_internal.h"

#include "ql_base.h"

#include <stdlib.h>
#include <string.h>

/* --- UTF-8 and Unicode classes ------------------------------------------- */

size_t tok_utf8_next(const uint8_t *s, size_t n, uint32_t *cp)
{
    size_t len = ql_utf8_next(s, n, cp);
    if (len)
        return len;
    *cp = CP_RAW + s[0];
    return 1;
}

size_t tok_utf8_put(uint32_t cp, uint8_t *out)
{
    if (cp >= CP_RAW) {
        out[0] = (uint8_t)(cp - CP_RAW);
        return 1;
    }
    return ql_utf8_put(cp, out);
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

uint8_t uc_class(uint32_t cp)
{
    if (cp >= CP_RAW)
        return 0;
    return range_lookup(uc_class_ranges, uc_class_ranges_len, cp);
}

static uint8_t uc_ccc(uint32_t cp)
{
    if (cp < 0x300 || cp >= CP_RAW)
        return 0;
    return range_lookup(uc_ccc_ranges, uc_ccc_ranges_len, cp);
}

char uc_fold_ascii(uint32_t cp)
{
    if (cp >= 'A' && cp <= 'Z')
        return (char)(cp - 'A' + 'a');
    if (cp >= 'a' && cp <= 'z')
        return (char)cp;
    for (size_t i = 0; i < uc_casefold_ascii_len; i++)
        if (uc_casefold_ascii[i].cp == cp)
            return uc_casefold_ascii[i].folded;
    return 0;
}

/* --- NFC (Qwen2's normalizer) -------------------------------------------- */

bool uc_cp_push(cp_buf *b, uint32_t cp)
{
    if (!tok_grow((void **)&b->v, &b->cap, b->n + 1, sizeof *b->v))
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
    size_t lo = 0, hi = uc_decomp_len;
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
    size_t lo = 0, hi = uc_comp_len;
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
        if (!uc_cp_push(out, HANGUL_L + s / HANGUL_N_COUNT) ||
            !uc_cp_push(out, HANGUL_V + s % HANGUL_N_COUNT / HANGUL_T_COUNT))
            return false;
        return s % HANGUL_T_COUNT == 0 || uc_cp_push(out, HANGUL_T + s % HANGUL_T_COUNT);
    }
    const uint32_t *d = cp < CP_RAW ? decomp_find(cp) : NULL;
    if (!d)
        return uc_cp_push(out, cp);
    return decompose(d[1], out) && (d[2] == 0 || decompose(d[2], out));
}

/* Canonical ordering of one run of non-starters v[0, k): a stable sort by
 * combining class. Short runs (what text has) by insertion; long ones
 * (what a hostile client sends: thousands of marks on one letter) by a
 * counting sort over the 255 classes, so a run costs O(k), never O(k^2). */
static bool order_run(uint32_t *v, size_t k)
{
    if (k <= 32) {
        for (size_t i = 1; i < k; i++) {
            uint32_t x = v[i];
            uint8_t c = uc_ccc(x);
            size_t j = i;
            while (j > 0 && uc_ccc(v[j - 1]) > c) {
                v[j] = v[j - 1];
                j--;
            }
            v[j] = x;
        }
        return true;
    }
    uint32_t *tmp = malloc(k * sizeof *tmp);
    if (!tmp)
        return false;
    size_t at[257] = {0};
    for (size_t i = 0; i < k; i++)
        at[uc_ccc(v[i]) + 1]++;
    for (int c = 1; c < 257; c++)
        at[c] += at[c - 1];
    for (size_t i = 0; i < k; i++)
        tmp[at[uc_ccc(v[i])]++] = v[i];
    memcpy(v, tmp, k * sizeof *tmp);
    free(tmp);
    return true;
}

/* NFC: canonical decomposition, canonical ordering, canonical composition
 * (UAX #15, composition as its sample code does it). */
bool uc_nfc(const uint32_t *in, size_t n, cp_buf *out)
{
    out->n = 0;
    for (size_t i = 0; i < n; i++)
        if (!decompose(in[i], out))
            return false;
    uint32_t *v = out->v;
    for (size_t i = 0; i < out->n;) {
        if (uc_ccc(v[i]) == 0) {
            i++;
            continue;
        }
        size_t end = i + 1;
        while (end < out->n && uc_ccc(v[end]) != 0)
            end++;
        if (!order_run(v + i, end - i))
            return false;
        i = end;
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

/*
 * test_chat_templates.c - template/ renders the chat templates real
 * models ship (the .jinja files in tests/fixtures/chat_templates: Llama 3.1/3.2/3.3,
 * Qwen2.5, Qwen3, Mistral Nemo and Small 3.2, Gemma 2, Phi-3.5, the
 * DeepSeek-R1 distills, Hermes tool use, SmolLM2/3, Granite 3.3, GPT-OSS) byte for
 * byte as transformers' apply_chat_template does, for the conversations in
 * vectors.json (made by make_vectors.py through transformers' own
 * renderer): system and user turns, multi-turn, with and without the
 * generation prompt, tools with calls and replies, reasoning, awkward
 * content; where the template raises (raise_exception), the render fails
 * with QL_EINVAL and the template's own message; where jinja2 fails at run
 * time, it fails with QL_EINVAL. Templates that read the clock are checked
 * against strftime at test time. One test per template, so a failure names
 * the model; each prints every failing case with the first differing byte.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "modelfile.h"
#include "template.h"

#define VECTORS      QL_FIXTURES "/chat_templates/vectors.json"
#define TEMPLATE_DIR QL_FIXTURES "/chat_templates/"
/* vectors.json is about 520 KiB; the bound only refuses a runaway file */
#define MAX_VECTORS_BYTES  (16u << 20)
#define MAX_TEMPLATE_BYTES (1u << 20)

/* the templates this file tests, one Test each (kept equal to vectors.json's list below) */
static const char *const tested[] = {
    "llama_3_1",
    "llama_3_2",
    "qwen2_5",
    "qwen3",
    "qwen3_5", /* Qwen3.5-4B.jinja */
    "mistral_nemo",
    "mistral_small_3_2",
    "ministral_3_reasoning",
    "gemma_2",
    "gemma_4",
    "phi_3_5",
    "deepseek_r1_qwen",
    "deepseek_r1_llama",
    "hermes_3_tool_use",
    "smollm2",
    "smollm3",
    "granite_3_3",
    "gpt_oss",
};
#define N_TESTED (sizeof tested / sizeof tested[0])

static cJSON *load_vectors(void)
{
    cJSON *root = NULL;
    char msg[512];
    int rc = mf_read_json(VECTORS, MAX_VECTORS_BYTES, &root, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s", msg);
    cr_assert(cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(root, "cases")), "%s: no \"cases\"",
              VECTORS);
    cr_assert(cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(root, "templates")),
              "%s: no \"templates\"", VECTORS);
    return root;
}

/* The whole file (malloc'd, NUL-terminated; free()), its length in *len. */
static char *read_template(const char *file, size_t *len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s%s", TEMPLATE_DIR, file);
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    char *buf = malloc(MAX_TEMPLATE_BYTES + 1);
    cr_assert(buf);
    size_t n = fread(buf, 1, MAX_TEMPLATE_BYTES + 1, f);
    fclose(f);
    cr_assert(n <= MAX_TEMPLATE_BYTES, "%s is over %u bytes", path, MAX_TEMPLATE_BYTES);
    buf[n] = 0;
    *len = n;
    return buf;
}

/* s with every occurrence of from replaced by to (malloc'd; free()). */
static char *replace_all(const char *s, const char *from, const char *to)
{
    size_t nf = strlen(from), nt = strlen(to), count = 0;
    for (const char *p = s; nf && (p = strstr(p, from)); p += nf)
        count++;
    char *out = malloc(strlen(s) + count * (nt > nf ? nt - nf : 0) + 1), *w = out;
    cr_assert(out);
    for (const char *p = s, *hit; *p;) {
        if (nf && (hit = strstr(p, from))) {
            memcpy(w, p, (size_t)(hit - p));
            w += hit - p;
            memcpy(w, to, nt);
            w += nt;
            p = hit + nf;
        } else {
            size_t rest = strlen(p);
            memcpy(w, p, rest);
            w += rest;
            break;
        }
    }
    *w = 0;
    return out;
}

/*
 * The expected text with each fixed-clock text the generator recorded
 * replaced by what strftime_now gives now (strftime(3) on localtime(3), as
 * Python's datetime.now().strftime does), at `now` (malloc'd; free()).
 */
static char *expected_now(const cJSON *c, const char *expected, time_t now)
{
    const cJSON *clock = cJSON_GetObjectItemCaseSensitive(c, "clock");
    char *text = strdup(expected);
    cr_assert(text);
    const cJSON *call;
    cJSON_ArrayForEach (call, clock) {
        const char *fmt = mf_json_str(call, "format"), *fixed = mf_json_str(call, "text");
        cr_assert(fmt && fixed, "a clock entry without format or text");
        struct tm tm;
        char real[256];
        localtime_r(&now, &tm);
        cr_assert(strftime(real, sizeof real, fmt, &tm) > 0 || !*fmt, "strftime(\"%s\") failed",
                  fmt);
        char *next = replace_all(text, fixed, real);
        free(text);
        text = next;
    }
    return text;
}

/* bytes around offset `at` of s, escaped, into buf */
static void excerpt(char *buf, size_t len, const char *s, size_t s_len, size_t at)
{
    size_t from = at > 40 ? at - 40 : 0, to = at + 40 < s_len ? at + 40 : s_len, w = 0;
    for (size_t i = from; i < to && w + 8 < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (i == at)
            w += (size_t)snprintf(buf + w, len - w, "[>>]");
        if (ch == '\n')
            w += (size_t)snprintf(buf + w, len - w, "\\n");
        else if (ch == '\t')
            w += (size_t)snprintf(buf + w, len - w, "\\t");
        else if (ch < 0x20 || ch == 0x7f)
            w += (size_t)snprintf(buf + w, len - w, "\\x%02x", ch);
        else
            buf[w++] = (char)ch;
    }
    if (at >= s_len && w + 8 < len)
        w += (size_t)snprintf(buf + w, len - w, "[>>]<end>");
    buf[w < len ? w : len - 1] = 0;
}

static void report_mismatch(const char *name, const char *cs, const char *want, size_t want_len,
                            const char *got, size_t got_len)
{
    size_t at = 0;
    while (at < want_len && at < got_len && want[at] == got[at])
        at++;
    char e[512], g[512];
    excerpt(e, sizeof e, want, want_len, at);
    excerpt(g, sizeof g, got, got_len, at);
    cr_log_error(
        "%s / %s: differs at byte %zu (expected %zu bytes, got %zu)\n  expected: %s\n  got:  "
        "    %s",
        name, cs, at, want_len, got_len, e, g);
}

/* Render one case; true when it matches. Mismatches are logged, not asserted. */
static bool check_case(const char *name, const tpl_template *t, const cJSON *c)
{
    const char *cs = mf_json_str(c, "case");
    const cJSON *context = cJSON_GetObjectItemCaseSensitive(c, "context");
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(c, "error");
    const char *expected = mf_json_str(c, "expected");
    cr_assert(cs && cJSON_IsObject(context) && (expected || cJSON_IsObject(error)),
              "%s: a malformed case in %s", name, VECTORS);
    for (int attempt = 0;; attempt++) {
        char msg[1024] = "";
        char *out = NULL;
        size_t out_len = 0;
        time_t before = time(NULL);
        int rc = tpl_render(t, context, 0, &out, &out_len, msg, sizeof msg);
        time_t after = time(NULL);
        bool ok;
        if (error) {
            const char *kind = mf_json_str(error, "kind"), *want = mf_json_str(error, "message");
            bool is_raise = kind && strcmp(kind, "raise") == 0;
            /* a raise carries the template's words; any other failure must still say what went
             * wrong */
            ok = rc == QL_EINVAL && (is_raise ? want && strcmp(msg, want) == 0 : msg[0] != 0);
            if (!ok)
                cr_log_error("%s / %s: expected QL_EINVAL (%s: \"%s\"), got %s \"%s\"%s%.*s", name,
                             cs, kind ? kind : "?", want ? want : "", ql_err_name(rc), msg,
                             rc == QL_OK ? " with text: " : "", rc == QL_OK ? (int)out_len : 0,
                             rc == QL_OK && out ? out : "");
            free(out);
            return ok;
        }
        if (rc != QL_OK) {
            cr_log_error("%s / %s: render failed: %s: %s", name, cs, ql_err_name(rc), msg);
            free(out);
            return false;
        }
        char *want = expected_now(c, expected, before);
        if (cJSON_GetObjectItemCaseSensitive(c, "clock") && attempt == 0) {
            /* the clock's text changed during the render (midnight): once more */
            char *want_after = expected_now(c, expected, after);
            bool moved = strcmp(want, want_after) != 0;
            free(want_after);
            if (moved) {
                free(want);
                free(out);
                continue;
            }
        }
        size_t want_len = strlen(want);
        ok = out && out_len == want_len && memcmp(out, want, want_len) == 0;
        if (ok && out[out_len] != 0) {
            cr_log_error("%s / %s: the text is not NUL-terminated", name, cs);
            ok = false;
        }
        if (!ok && out)
            report_mismatch(name, cs, want, want_len, out, out_len);
        free(want);
        free(out);
        return ok;
    }
}

/* Compile the template named `name` in vectors.json and check every one of its cases. */
static void check_template(const char *name)
{
    cJSON *root = load_vectors();
    const cJSON *entry, *found = NULL;
    cJSON_ArrayForEach (entry, cJSON_GetObjectItemCaseSensitive(root, "templates")) {
        const char *n = mf_json_str(entry, "name");
        if (n && strcmp(n, name) == 0)
            found = entry;
    }
    cr_assert(found, "%s: no template \"%s\"", VECTORS, name);
    char file[256];
    const char *f = mf_json_str(found, "file");
    cr_assert(f && strlen(f) < sizeof file, "%s: template \"%s\" has no file", VECTORS, name);
    strcpy(file, f);
    size_t len;
    char *source = read_template(file, &len);
    tpl_template *t = NULL;
    char msg[1024] = "";
    int rc = tpl_compile(&t, source, len, msg, sizeof msg);
    free(source);
    cr_assert_eq(rc, QL_OK, "%s (%s) does not compile: %s: %s", name, file, ql_err_name(rc), msg);
    cr_assert(t);

    int cases = 0, failed = 0;
    const cJSON *c;
    cJSON_ArrayForEach (c, cJSON_GetObjectItemCaseSensitive(root, "cases")) {
        const char *n = mf_json_str(c, "template");
        if (!n || strcmp(n, name) != 0)
            continue;
        cases++;
        if (!check_case(name, t, c))
            failed++;
    }
    tpl_free(t);
    const cJSON *count = cJSON_GetObjectItemCaseSensitive(found, "cases");
    int listed = cJSON_IsNumber(count) ? count->valueint : -1;
    cJSON_Delete(root);
    /* a template with no cases would pass without testing anything */
    cr_assert(cases > 0 && cases == listed, "%s: %d cases found, %d listed", name, cases, listed);
    cr_assert_eq(failed, 0, "%s (%s): %d of %d cases differ from transformers (see the log above)",
                 name, file, failed, cases);
}

/*
 * Every template in vectors.json has its Test below and every .jinja in
 * the fixture folder has vectors, so a template added to either is tested.
 */
Test(chat_templates, every_fixture_template_is_tested)
{
    cJSON *root = load_vectors();
    const cJSON *entry;
    size_t listed = 0;
    cJSON_ArrayForEach (entry, cJSON_GetObjectItemCaseSensitive(root, "templates")) {
        const char *n = mf_json_str(entry, "name");
        bool known = false;
        for (size_t i = 0; n && i < N_TESTED; i++)
            known = known || strcmp(tested[i], n) == 0;
        cr_expect(known, "vectors.json's template \"%s\" has no Test in this file", n ? n : "?");
        listed++;
    }
    cr_expect_eq(listed, N_TESTED, "vectors.json lists %zu templates, this file tests %zu", listed,
                 N_TESTED);
    DIR *d = opendir(TEMPLATE_DIR);
    cr_assert(d, "cannot open %s", TEMPLATE_DIR);
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t n = strlen(de->d_name);
        if (n < 6 || strcmp(de->d_name + n - 6, ".jinja") != 0)
            continue;
        bool has = false;
        cJSON_ArrayForEach (entry, cJSON_GetObjectItemCaseSensitive(root, "templates")) {
            const char *f = mf_json_str(entry, "file");
            has = has || (f && strcmp(f, de->d_name) == 0);
        }
        cr_expect(has, "%s%s has no vectors in vectors.json", TEMPLATE_DIR, de->d_name);
    }
    closedir(d);
    cJSON_Delete(root);
}

#define TEMPLATE_TEST(name)                                                                        \
    Test(chat_templates, name)                                                                     \
    {                                                                                              \
        check_template(#name);                                                                     \
    }

TEMPLATE_TEST(llama_3_1)
TEMPLATE_TEST(llama_3_2)
TEMPLATE_TEST(qwen2_5)
TEMPLATE_TEST(qwen3)
TEMPLATE_TEST(qwen3_5)
TEMPLATE_TEST(mistral_nemo)
TEMPLATE_TEST(mistral_small_3_2)
TEMPLATE_TEST(ministral_3_reasoning)
TEMPLATE_TEST(gemma_2)
TEMPLATE_TEST(gemma_4)
TEMPLATE_TEST(phi_3_5)
TEMPLATE_TEST(deepseek_r1_qwen)
TEMPLATE_TEST(deepseek_r1_llama)
TEMPLATE_TEST(hermes_3_tool_use)
TEMPLATE_TEST(smollm2)
TEMPLATE_TEST(smollm3)
TEMPLATE_TEST(granite_3_3)
TEMPLATE_TEST(gpt_oss)

/*
 * test_tokenizer.c - every fixture tokenizer (byte-level BPE as GPT-2,
 * Llama 3, Qwen2 and SmolLM2 shape it, SentencePiece-style BPE as Llama 2
 * and Mistral do, each from tokenizer.json and from GGUF metadata) gives
 * the ids and decoded text Hugging Face tokenizers gave
 * (tests/fixtures/make_tokenizer_vectors.py), with special tokens parsed and
 * as plain text, BOS as the tokenizer's own metadata says, streaming decode
 * equal to the whole and valid UTF-8 chunk by chunk; the real SmolLM2 GGUF
 * (when it is on this machine) gives the real model's ids; a 150k-token
 * tokenizer.json loads and merges by rank, to the ids its construction
 * gives (its load time is logged, never asserted: speed is for
 * benchmarks); bad files are refused with a
 * message naming the file and the problem; invalid UTF-8 and invalid ids
 * never crash.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fixtures/smollm2_vectors.h"
#include "fixtures/tokenizer_vectors.h"
#include "gguf_writer.h"
#include "modelfile.h"
#include "test_util.h"
#include "tiny_model.h"
#include "tokenizer.h"

#define N_TOKENIZERS (sizeof tokv_tokenizers / sizeof tokv_tokenizers[0])

static char dir[512];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0], "no temporary directory");
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(tokenizer, .init = setup, .fini = teardown);

static double seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A fixture tokenizer: tokenizer.json (+ config) or a GGUF file (kept open
 * in *g; the caller closes it). */
static tok_tokenizer *load_fixture(const tokv_tokenizer *tv, gguf_file *g)
{
    char path[1024], cfg[1024], msg[512];
    tok_tokenizer *t = NULL;
    memset(g, 0, sizeof *g);
    if (tv->json_dir) {
        snprintf(path, sizeof path, "%s/tokenizers/%s/tokenizer.json", QL_FIXTURES, tv->json_dir);
        snprintf(cfg, sizeof cfg, "%s/tokenizers/%s/tokenizer_config.json", QL_FIXTURES,
                 tv->json_dir);
        cr_assert_eq(tok_from_hf(&t, path, cfg, msg, sizeof msg), QL_OK, "%s: %s", tv->name, msg);
    } else {
        snprintf(path, sizeof path, "%s/tokenizers/%s", QL_FIXTURES, tv->gguf);
        cr_assert_eq(gguf_open(g, path, msg, sizeof msg), QL_OK, "%s", msg);
        cr_assert_eq(tok_from_gguf(&t, g, msg, sizeof msg), QL_OK, "%s: %s", tv->name, msg);
    }
    return t;
}

static void unload(tok_tokenizer *t, gguf_file *g)
{
    tok_free(t);
    if (g->map)
        gguf_close(g);
}

static const char *ids_str(const int32_t *ids, size_t n, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = 0;
    for (size_t i = 0; i < n && at + 16 < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%d", i ? " " : "", (int)ids[i]);
    return buf;
}

/* Strict UTF-8 (Unicode's table of well-formed sequences), written apart
 * from the tokenizer's own decoder. */
static bool valid_utf8(const char *s, size_t n)
{
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint8_t b = p[i];
        size_t len = b < 0x80                 ? 1
                     : b >= 0xC2 && b <= 0xDF ? 2
                     : b >= 0xE0 && b <= 0xEF ? 3
                     : b >= 0xF0 && b <= 0xF4 ? 4
                                              : 0;
        if (len == 0 || i + len > n)
            return false;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b == 0xE0)
            lo = 0xA0;
        else if (b == 0xED)
            hi = 0x9F;
        else if (b == 0xF0)
            lo = 0x90;
        else if (b == 0xF4)
            hi = 0x8F;
        for (size_t k = 1; k < len; k++) {
            if (p[i + k] < (k == 1 ? lo : 0x80) || p[i + k] > (k == 1 ? hi : 0xBF))
                return false;
        }
        i += len;
    }
    return true;
}

static void expect_ids(const tok_tokenizer *t, const char *name, size_t k, const tokv_case *c,
                       bool add_bos, bool parse_special, const int32_t *want, size_t n_want)
{
    int32_t *ids = NULL;
    size_t n = 0;
    char msg[256], got_s[2048], want_s[2048];
    cr_assert_eq(
        tok_encode(t, c->text, c->text_len, add_bos, parse_special, &ids, &n, msg, sizeof msg),
        QL_OK, "%s case %zu: %s", name, k, msg);
    cr_assert(ids, "%s case %zu: no allocation for the ids", name, k);
    cr_expect(n == n_want && memcmp(ids, want, n * sizeof *ids) == 0,
              "%s case %zu \"%.*s\" (add_bos %d, parse_special %d):\n got  %s\n want %s", name, k,
              (int)c->text_len, c->text, add_bos, parse_special, ids_str(ids, n, got_s, 2048),
              ids_str(want, n_want, want_s, 2048));
    free(ids);
}

static void expect_decode(const tok_tokenizer *t, const char *name, size_t k, const int32_t *ids,
                          size_t n, bool skip, const char *want, size_t want_len)
{
    char *text = NULL, msg[256];
    size_t len = 0;
    cr_assert_eq(tok_decode(t, ids, n, skip, &text, &len, msg, sizeof msg), QL_OK,
                 "%s case %zu: %s", name, k, msg);
    cr_expect(len == want_len && memcmp(text, want, len) == 0 && text[len] == 0,
              "%s case %zu decode (skip_special %d):\n got  [%s]\n want [%.*s]", name, k, skip,
              text, (int)want_len, want);
    free(text);
}

/* Push the ids one at a time into a 64-byte buffer (what tokenizer.h promises
 * suffices): each chunk is valid UTF-8 by itself, and all of them with the
 * flush are the whole decode. */
static void expect_stream(const tok_tokenizer *t, const char *name, size_t k, const int32_t *ids,
                          size_t n, const char *want, size_t want_len)
{
    tok_stream s = {0};
    char out[64], *all = malloc(n * 64 + 64);
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        long got = tok_stream_push(t, &s, ids[i], out, sizeof out);
        cr_assert(got >= 0, "%s case %zu: push of id %d failed (%ld)", name, k, (int)ids[i], got);
        cr_expect(valid_utf8(out, (size_t)got), "%s case %zu: chunk %zu is not valid UTF-8", name,
                  k, i);
        memcpy(all + len, out, (size_t)got);
        len += (size_t)got;
    }
    long got = tok_stream_flush(t, &s, out, sizeof out);
    cr_assert(got >= 0);
    memcpy(all + len, out, (size_t)got);
    len += (size_t)got;
    cr_expect(len == want_len && memcmp(all, want, len) == 0,
              "%s case %zu: the stream gives [%.*s], the whole decode [%.*s]", name, k, (int)len,
              all, (int)want_len, want);
    free(all);
}

static size_t tokenizer_index[N_TOKENIZERS];

ParameterizedTestParameters(tokenizer, encodes_and_decodes_as_hugging_face)
{
    for (size_t i = 0; i < N_TOKENIZERS; i++)
        tokenizer_index[i] = i;
    return cr_make_param_array(size_t, tokenizer_index, N_TOKENIZERS);
}

ParameterizedTest(size_t *which, tokenizer, encodes_and_decodes_as_hugging_face)
{
    const tokv_tokenizer *tv = &tokv_tokenizers[*which];
    gguf_file g;
    tok_tokenizer *t = load_fixture(tv, &g);
    cr_expect_eq(tok_bos(t), tv->bos, "%s: bos", tv->name);
    cr_expect_eq(tok_eos(t), tv->eos, "%s: eos", tv->name);
    cr_expect_eq(tok_adds_bos(t), tv->adds_bos, "%s: adds_bos", tv->name);
    cr_expect_eq(tok_vocab_size(t), tv->vocab_size, "%s: vocab size", tv->name);
    const char *kind = strstr(tv->name, "spm") ? "sentencepiece BPE" : "byte-level BPE";
    cr_expect(strstr(tok_describe(t), kind), "%s: described as \"%s\"", tv->name, tok_describe(t));

    int32_t *with_bos = malloc(64 * 1024 * sizeof *with_bos);
    for (size_t k = 0; k < tv->n_cases; k++) {
        const tokv_case *c = &tv->cases[k];
        expect_ids(t, tv->name, k, c, false, true, c->ids, c->n_ids);
        expect_ids(t, tv->name, k, c, false, false, c->plain, c->n_plain);
        /* BOS: [bos] + ids exactly when the tokenizer's metadata adds it */
        size_t n_bos = 0;
        if (tv->adds_bos)
            with_bos[n_bos++] = tv->bos;
        memcpy(with_bos + n_bos, c->ids, c->n_ids * sizeof *with_bos);
        expect_ids(t, tv->name, k, c, true, true, with_bos, n_bos + c->n_ids);

        expect_decode(t, tv->name, k, c->ids, c->n_ids, false, c->decoded, c->decoded_len);
        expect_decode(t, tv->name, k, c->ids, c->n_ids, true, c->decoded_skip, c->decoded_skip_len);
        expect_decode(t, tv->name, k, c->plain, c->n_plain, false, c->decoded_plain,
                      c->decoded_plain_len);
        expect_stream(t, tv->name, k, c->ids, c->n_ids, c->decoded, c->decoded_len);
        expect_stream(t, tv->name, k, c->plain, c->n_plain, c->decoded_plain, c->decoded_plain_len);
    }
    free(with_bos);
    unload(t, &g);
}

/* --- the real model ------------------------------------------------------------ */

Test(tokenizer, real_smollm2_gguf_gives_the_models_ids)
{
    char path[1024];
    const char *model = getenv("QLSERVE_MODEL"), *cache = getenv("QLSERVE_CACHE");
    const char *home = getenv("HOME");
    if (model && *model)
        snprintf(path, sizeof path, "%s", model);
    else if (cache && *cache)
        snprintf(path, sizeof path, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", cache);
    else
        snprintf(path, sizeof path, "%s/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 home ? home : ".");
    if (access(path, R_OK) != 0)
        test_cannot_run("%s is not there: scripts/fetch-model.sh downloads it", path);

    gguf_file g;
    tok_tokenizer *t = NULL;
    char msg[512];
    cr_assert_eq(gguf_open(&g, path, msg, sizeof msg), QL_OK, "%s", msg);
    double t0 = seconds();
    cr_assert_eq(tok_from_gguf(&t, &g, msg, sizeof msg), QL_OK, "%s", msg);
    double load = seconds() - t0;
    cr_log_info("SmolLM2 tokenizer (49152 tokens, 48900 merges) loaded in %.1f ms", load * 1e3);
    cr_expect(load < 1.0, "loading the tokenizer took %.2f s", load);
    cr_expect_eq(tok_vocab_size(t), 49152u);
    cr_expect_eq(tok_bos(t), 1);
    cr_expect_eq(tok_eos(t), 2);
    cr_expect(!tok_adds_bos(t));
    for (size_t k = 0; k < SMOLLM2_N_CASES; k++) {
        const tokv_case *c = &smollm2_real_cases[k];
        expect_ids(t, "smollm2-real", k, c, false, true, c->ids, c->n_ids);
        expect_decode(t, "smollm2-real", k, c->ids, c->n_ids, false, c->decoded, c->decoded_len);
    }
    /* a piece longer than 64 bytes is refused, not cut, and goes through with room */
    tok_stream s = {0};
    char out[256];
    int32_t longest = -1;
    size_t longest_len = 0;
    for (int32_t id = 0; id < (int32_t)tok_vocab_size(t); id++) {
        char *text;
        size_t len;
        cr_assert_eq(tok_decode(t, &id, 1, false, &text, &len, msg, sizeof msg), QL_OK);
        if (len > longest_len && valid_utf8(text, len)) {
            longest = id;
            longest_len = len;
        }
        free(text);
    }
    cr_log_info("the longest SmolLM2 piece is %zu bytes (id %d)", longest_len, (int)longest);
    if (longest_len > 64) {
        cr_expect(tok_stream_push(t, &s, longest, out, 64) < 0);
        cr_expect_eq(s.n_pushed, 0u, "a refused push changes the stream");
    }
    cr_expect_eq(tok_stream_push(t, &s, longest, out, sizeof out), (long)longest_len);
    tok_free(t);
    gguf_close(&g);
}

/* --- a large vocabulary ---------------------------------------------------------- */

/* Speed is a benchmark's business, not a test's: the load time is logged,
 * and the test pins that a vocabulary this large loads and merges by rank. */
Test(tokenizer, a_150k_vocabulary_loads_and_merges)
{
    /* 256 byte tokens, every pair of them, then pairs with a third byte up
     * to 150000 tokens; a merge for each token past the bytes */
    enum { N_TOKENS = 150000 };
    char sym[256][4];
    for (int b = 0; b < 256; b++)
        tiny_byte_symbol(b, sym[b]);
    cJSON *root = cJSON_CreateObject();
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    int id = 0;
    for (int b = 0; b < 256; b++)
        cJSON_AddNumberToObject(vocab, sym[b], id++);
    char tok[2400], merge[2400]; /* GCC bounds each %s by all of sym[] */
    for (int a = 0; a < 256 && id < N_TOKENS; a++) {
        for (int b = 0; b < 256 && id < N_TOKENS; b++) {
            snprintf(tok, sizeof tok, "%s%s", sym[a], sym[b]);
            snprintf(merge, sizeof merge, "%s %s", sym[a], sym[b]);
            cJSON_AddNumberToObject(vocab, tok, id++);
            cJSON_AddItemToArray(merges, cJSON_CreateString(merge));
        }
    }
    for (int a = 0; id < N_TOKENS; a++) {
        for (int b = 0; b < 256 && id < N_TOKENS; b++) {
            snprintf(tok, sizeof tok, "%s%s%s", sym[a / 256], sym[a % 256], sym[b]);
            snprintf(merge, sizeof merge, "%s%s %s", sym[a / 256], sym[a % 256], sym[b]);
            cJSON_AddNumberToObject(vocab, tok, id++);
            cJSON_AddItemToArray(merges, cJSON_CreateString(merge));
        }
    }
    cJSON *pre = cJSON_AddObjectToObject(root, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "ByteLevel");
    cJSON_AddFalseToObject(pre, "add_prefix_space");
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
    free(text);

    tok_tokenizer *t = NULL;
    char msg[512];
    double t0 = seconds();
    cr_assert_eq(tok_from_hf(&t, path, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    double load = seconds() - t0;
    cr_log_info("a %d-token tokenizer.json loaded in %.1f ms", N_TOKENS, load * 1e3);
    cr_expect_eq(tok_vocab_size(t), (size_t)N_TOKENS);
    /* The ids follow from the construction: byte b is id b, the pair (a, b)
     * id 256 + 256a + b and rank 256a + b, the triple (pair p, byte b) id
     * 65792 + 256p + b. The pre-tokenizer splits "hi", " ox" and
     * "\x01\x02\x03"; "hi" is one pair; in " ox" the pair " o" ranks first
     * and no triple extends it; in "\x01\x02\x03" the pair (1, 2) = 258
     * ranks first and the triple (258, 3) follows. */
    const char *hello = "hi ox\x01\x02\x03";
    const int32_t want[] = {256 + 256 * 'h' + 'i', 256 + 256 * ' ' + 'o', 'x',
                            65792 + 256 * 258 + 3};
    int32_t *ids;
    size_t n;
    char *back;
    size_t len;
    cr_assert_eq(tok_encode(t, hello, strlen(hello), false, true, &ids, &n, msg, sizeof msg), 0);
    cr_assert_eq(n, sizeof want / sizeof *want, "%zu ids, the merges give %zu", n,
                 sizeof want / sizeof *want);
    for (size_t i = 0; i < n; i++)
        cr_expect_eq(ids[i], want[i], "id %zu is %d, the merges give %d", i, ids[i], want[i]);
    cr_assert_eq(tok_decode(t, ids, n, false, &back, &len, msg, sizeof msg), 0);
    cr_expect_str_eq(back, hello);
    free(ids);
    free(back);
    tok_free(t);
}

/* --- refusals ----------------------------------------------------------------- */

/* tokenizer.json text must be refused with code `rc` and a message that
 * holds the path and each of the words. */
static void expect_hf_refused(const char *text, int rc, const char *word1, const char *word2)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    test_write_bytes(path, text, strlen(text));
    tok_tokenizer *t = (tok_tokenizer *)&path; /* must come back NULL */
    cr_expect_eq(tok_from_hf(&t, path, NULL, msg, sizeof msg), rc, "%s", msg);
    cr_expect_null(t);
    cr_expect(strstr(msg, path), "the message names the file: %s", msg);
    cr_expect(!word1 || strstr(msg, word1), "the message names %s: %s", word1, msg);
    cr_expect(!word2 || strstr(msg, word2), "the message names %s: %s", word2, msg);
}

/* A fixture's tokenizer.json, parsed, for a test to break. */
static cJSON *fixture_json(const char *name)
{
    char path[1024];
    size_t len;
    snprintf(path, sizeof path, "%s/tokenizers/%s/tokenizer.json", QL_FIXTURES, name);
    char *text = test_read_file(path, &len);
    cr_assert(text, "cannot read %s", path);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cr_assert(root);
    return root;
}

static void expect_json_refused(cJSON *root, int rc, const char *word1, const char *word2)
{
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    expect_hf_refused(text, rc, word1, word2);
    free(text);
}

Test(tokenizer, truncated_or_non_json_files_are_refused)
{
    char path[1024], msg[512];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/tokenizers/gpt2/tokenizer.json", QL_FIXTURES);
    char *text = test_read_file(path, &len);
    cr_assert(text, "cannot read %s", path);
    text[len / 2] = 0;
    expect_hf_refused(text, QL_EFORMAT, "JSON", "truncated");
    free(text);
    expect_hf_refused("this is not JSON", QL_EFORMAT, "JSON", NULL);
    expect_hf_refused("[1, 2, 3]", QL_EFORMAT, "not a JSON object", NULL);
    expect_hf_refused("{\"version\": \"1.0\"}", QL_EFORMAT, "model", NULL);

    tok_tokenizer *t = NULL;
    snprintf(path, sizeof path, "%s/no/such/tokenizer.json", dir);
    cr_expect_eq(tok_from_hf(&t, path, NULL, msg, sizeof msg), QL_EIO);
    cr_expect(strstr(msg, path), "%s", msg);
}

Test(tokenizer, models_other_than_bpe_are_refused_by_name)
{
    expect_hf_refused("{\"model\": {\"type\": \"WordPiece\", \"unk_token\": \"[UNK]\", \"vocab\": "
                      "{\"[UNK]\": 0, \"a\": 1}}}",
                      QL_EINVAL, "WordPiece", NULL);
    expect_hf_refused("{\"model\": {\"type\": \"Unigram\", \"unk_id\": 0, \"vocab\": [[\"<unk>\", "
                      "0.0], [\"a\", -1.0]]}}",
                      QL_EINVAL, "Unigram", NULL);
    /* a BPE that is neither byte-level nor sentencepiece-style */
    expect_hf_refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
                      "\"pre_tokenizer\": {\"type\": \"Whitespace\"}}",
                      QL_EINVAL, "Whitespace", NULL);
}

Test(tokenizer, an_unknown_split_regex_is_refused_by_its_pattern)
{
    cJSON *root = fixture_json("llama3");
    cJSON *split = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "pre_tokenizer"), "pretokenizers"), 0);
    cJSON *pattern = cJSON_GetObjectItem(split, "pattern");
    cr_assert(pattern);
    cJSON_ReplaceItemInObject(pattern, "Regex", cJSON_CreateString("\\p{L}+|\\p{N}{1,4}|\\s+"));
    expect_json_refused(root, QL_EINVAL, "\\p{L}+|\\p{N}{1,4}|\\s+", "Split");

    root = fixture_json("gpt2");
    cJSON_ReplaceItemInObject(root, "pre_tokenizer",
                              cJSON_Parse("{\"type\": \"BertPreTokenizer\"}"));
    expect_json_refused(root, QL_EINVAL, "BertPreTokenizer", NULL);
}

Test(tokenizer, a_merge_of_a_token_not_in_the_vocabulary_is_refused)
{
    cJSON *root = fixture_json("gpt2");
    cJSON *merges = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "model"), "merges");
    cJSON_AddItemToArray(merges, cJSON_CreateString("nowhere_a h"));
    expect_json_refused(root, QL_EFORMAT, "nowhere_a", "merge");

    root = fixture_json("llama3"); /* merges as pairs */
    merges = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "model"), "merges");
    cJSON_AddItemToArray(merges, cJSON_Parse("[\"h\", \"nowhere_b\"]"));
    expect_json_refused(root, QL_EFORMAT, "nowhere_b", "merge");
}

Test(tokenizer, a_config_naming_a_missing_token_is_refused)
{
    char json[1024], cfg[1024], msg[512];
    snprintf(json, sizeof json, "%s/tokenizers/gpt2/tokenizer.json", QL_FIXTURES);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    const char *text = "{\"bos_token\": \"<|nowhere|>\", \"eos_token\": \"<|endoftext|>\"}";
    test_write_bytes(cfg, text, strlen(text));
    tok_tokenizer *t = NULL;
    cr_expect_eq(tok_from_hf(&t, json, cfg, msg, sizeof msg), QL_EFORMAT);
    cr_expect(strstr(msg, cfg) && strstr(msg, "<|nowhere|>"), "%s", msg);
}

Test(tokenizer, without_a_config_bos_comes_from_the_template)
{
    char json[1024], msg[512];
    snprintf(json, sizeof json, "%s/tokenizers/llama3/tokenizer.json", QL_FIXTURES);
    tok_tokenizer *t = NULL;
    cr_assert_eq(tok_from_hf(&t, json, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    cr_expect_eq(tok_bos(t), 945);
    cr_expect(tok_adds_bos(t));
    cr_expect_eq(tok_eos(t), -1);
    tok_free(t);
}

/* A GGUF holding only tokenizer metadata: the GPT-2 fixture's tokens and
 * merges under the given model and pre names. */
static void write_gguf(const char *path, const char *model, const char *pre)
{
    const char *tokens[] = {"a", "b", "ab", "\xc4\xa0", "<|end|>"};
    int32_t types[] = {1, 1, 1, 1, 3};
    const char *merges[] = {"a b"};
    gguf_writer *w = gguf_writer_new();
    char msg[512];
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "tokenizer.ggml.model", model);
    if (pre)
        gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    gguf_writer_set_str_array(w, "tokenizer.ggml.tokens", tokens, 5);
    gguf_writer_set_array(w, "tokenizer.ggml.token_type", GGUF_INT32, types, 5);
    gguf_writer_set_str_array(w, "tokenizer.ggml.merges", merges, 1);
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
}

static void expect_gguf_refused(const char *model, const char *pre, int rc, const char *word)
{
    char path[1024], msg[512];
    snprintf(path, sizeof path, "%s/tok.gguf", dir);
    write_gguf(path, model, pre);
    gguf_file g;
    cr_assert_eq(gguf_open(&g, path, msg, sizeof msg), QL_OK, "%s", msg);
    tok_tokenizer *t = NULL;
    cr_expect_eq(tok_from_gguf(&t, &g, msg, sizeof msg), rc, "%s", msg);
    cr_expect_null(t);
    cr_expect(strstr(msg, path) && strstr(msg, word), "the message names the file and %s: %s", word,
              msg);
    gguf_close(&g);
}

Test(tokenizer, gguf_vocabularies_we_do_not_run_are_refused_by_name)
{
    expect_gguf_refused("bert", NULL, QL_EINVAL, "\"bert\"");
    expect_gguf_refused("t5", NULL, QL_EINVAL, "\"t5\"");
    expect_gguf_refused("gpt2", "mystery-pre", QL_EINVAL, "\"mystery-pre\"");

    /* and the same file with names we know loads */
    char path[1024], msg[512];
    snprintf(path, sizeof path, "%s/tok.gguf", dir);
    write_gguf(path, "gpt2", "gpt-2");
    gguf_file g;
    cr_assert_eq(gguf_open(&g, path, msg, sizeof msg), QL_OK, "%s", msg);
    tok_tokenizer *t = NULL;
    cr_assert_eq(tok_from_gguf(&t, &g, msg, sizeof msg), QL_OK, "%s", msg);
    int32_t *ids;
    size_t n;
    cr_assert_eq(tok_encode(t, "ab a<|end|>", 11, false, true, &ids, &n, msg, sizeof msg), 0);
    int32_t want[] = {2, 3, 0, 4};
    cr_expect(n == 4 && memcmp(ids, want, sizeof want) == 0);
    free(ids);
    tok_free(t);
    gguf_close(&g);

    /* no tokenizer at all */
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_str(w, "general.architecture", "llama");
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
    cr_assert_eq(gguf_open(&g, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_expect_eq(tok_from_gguf(&t, &g, msg, sizeof msg), QL_ENOTFOUND);
    cr_expect(strstr(msg, "tokenizer.ggml.model"), "%s", msg);
    gguf_close(&g);
}

Test(tokenizer, invalid_ids_are_refused)
{
    gguf_file g;
    tok_tokenizer *t = load_fixture(&tokv_tokenizers[0], &g);
    int32_t bad[][2] = {{407, -1}, {407, (int32_t)tok_vocab_size(t)}, {INT32_MAX, 407}};
    char *text = (char *)"unchanged", msg[512];
    size_t len = 7;
    for (size_t i = 0; i < 3; i++) {
        cr_expect_eq(tok_decode(t, bad[i], 2, false, &text, &len, msg, sizeof msg), QL_EINVAL);
        cr_expect_null(text);
        cr_expect(strstr(msg, "tokenizer.json") && strstr(msg, "outside the vocabulary"), "%s",
                  msg);
    }
    tok_stream s = {0};
    char out[64];
    cr_expect_lt(tok_stream_push(t, &s, -1, out, sizeof out), 0);
    cr_expect_lt(tok_stream_push(t, &s, (int32_t)tok_vocab_size(t), out, sizeof out), 0);
    cr_expect_eq(s.n_pushed, 0u);
    /* a push that does not fit changes nothing and can be repeated */
    cr_expect_lt(tok_stream_push(t, &s, 626, out, 2), 0); /* " world" */
    cr_expect_eq(tok_stream_push(t, &s, 626, out, sizeof out), 6);
    cr_expect(memcmp(out, " world", 6) == 0);
    unload(t, &g);
}

Test(tokenizer, a_character_split_across_tokens_waits_for_its_end)
{
    /* SentencePiece byte tokens: "東" is <0xE6><0x9D><0xB1> when no piece
     * covers it; the stream holds the bytes until the character is whole */
    gguf_file g;
    tok_tokenizer *t = load_fixture(&tokv_tokenizers[8], &g);
    cr_assert_str_eq(tokv_tokenizers[8].name, "spm");
    int32_t bytes[] = {3 + 0xE6, 3 + 0x9D, 3 + 0xB1};
    tok_stream s = {0};
    char out[64];
    cr_expect_eq(tok_stream_push(t, &s, bytes[0], out, sizeof out), 0);
    cr_expect_eq(tok_stream_push(t, &s, bytes[1], out, sizeof out), 0);
    cr_expect_eq(tok_stream_push(t, &s, bytes[2], out, sizeof out), 3);
    cr_expect(memcmp(out, "\xe6\x9d\xb1", 3) == 0);
    /* a character that never ends becomes U+FFFD, one per byte token (as
     * tokenizers' ByteFallback decoder) */
    cr_expect_eq(tok_stream_push(t, &s, bytes[0], out, sizeof out), 0);
    cr_expect_eq(tok_stream_push(t, &s, bytes[1], out, sizeof out), 0);
    cr_expect_eq(tok_stream_flush(t, &s, out, sizeof out), 6);
    cr_expect(memcmp(out, "\xef\xbf\xbd\xef\xbf\xbd", 6) == 0);
    char *text;
    size_t len;
    cr_assert_eq(tok_decode(t, bytes, 2, false, &text, &len, out, sizeof out), 0);
    cr_expect_str_eq(text, "\xef\xbf\xbd\xef\xbf\xbd");
    free(text);
    unload(t, &g);
}

Test(tokenizer, invalid_utf8_encodes_without_crashing)
{
    static const char *const bad[] = {
        "\x80",       "\xbf\xbf",         "\xc0\xaf",          "\xc3",
        "a\xe6\x9d",  "\xed\xa0\x80",     "\xf4\x90\x80\x80",  "\xf0\x9f\x98",
        "\xff\xfe x", "\xe2\x96",         "<|endoftext\xff|>", "caf\xc3 \xa9",
        " \xcc\x81",  "\xe1\x84\x80\xcc",
    };
    uint64_t rng = 42;
    for (size_t k = 0; k < N_TOKENIZERS; k++) {
        gguf_file g;
        tok_tokenizer *t = load_fixture(&tokv_tokenizers[k], &g);
        for (size_t i = 0; i < sizeof bad / sizeof bad[0] + 200; i++) {
            char buf[64];
            const char *text = buf;
            size_t len;
            if (i < sizeof bad / sizeof bad[0]) {
                text = bad[i];
                len = strlen(text);
            } else { /* random bytes, half of them high */
                len = test_rand(&rng) % sizeof buf;
                for (size_t j = 0; j < len; j++) {
                    uint64_t r = test_rand(&rng);
                    buf[j] = (char)(r & 1 ? 0x80 | (r >> 8 & 0x7f) : 0x20 + (r >> 8) % 0x60);
                }
            }
            for (int special = 0; special < 2; special++) {
                int32_t *ids;
                size_t n;
                char msg[256], *back;
                size_t back_len;
                cr_assert_eq(tok_encode(t, text, len, true, special, &ids, &n, msg, sizeof msg),
                             QL_OK, "%s: %s", tokv_tokenizers[k].name, msg);
                for (size_t j = 0; j < n; j++)
                    cr_assert(ids[j] >= 0 && (size_t)ids[j] < tok_vocab_size(t));
                cr_assert_eq(tok_decode(t, ids, n, false, &back, &back_len, msg, sizeof msg), QL_OK,
                             "%s", msg);
                cr_expect(valid_utf8(back, back_len), "%s: decode gave invalid UTF-8",
                          tokv_tokenizers[k].name);
                free(back);
                free(ids);
            }
        }
        unload(t, &g);
    }
}

Test(tokenizer, byte_level_encoding_round_trips_any_valid_text)
{
    /* random text from letters, digits, spaces, punctuation, accents, CJK,
     * emoji: a byte-level tokenizer gives it back byte for byte */
    static const char *const parts[] = {
        "a",  "Z", "7", " ",    "  ", "\n", "\t",       "'s",   "'LL", ",",
        "!?", "é", "ß", "東京", "한", "😀",  "👍🏽", "1234", "½",   "\r\n",
        "ſ",  "Ω", "—", "(",    "$",  "<",  "|",        "_",    "ー",  "\xc2\xa0",
    };
    uint64_t rng = 7;
    for (size_t k = 0; k < N_TOKENIZERS; k++) {
        const tokv_tokenizer *tv = &tokv_tokenizers[k];
        if (strstr(tv->name, "spm") || strstr(tv->name, "qwen2"))
            continue; /* a ▁ prefix, NFC: not the identity */
        gguf_file g;
        tok_tokenizer *t = load_fixture(tv, &g);
        for (int i = 0; i < 200; i++) {
            char text[512];
            size_t len = 0;
            int n_parts = (int)(test_rand(&rng) % 24);
            for (int j = 0; j < n_parts; j++) {
                const char *p = parts[test_rand(&rng) % (sizeof parts / sizeof parts[0])];
                memcpy(text + len, p, strlen(p));
                len += strlen(p);
            }
            int32_t *ids;
            size_t n;
            char msg[256], *back;
            size_t back_len;
            cr_assert_eq(tok_encode(t, text, len, false, true, &ids, &n, msg, sizeof msg), 0);
            cr_assert_eq(tok_decode(t, ids, n, false, &back, &back_len, msg, sizeof msg), 0);
            cr_expect(back_len == len && memcmp(back, text, len) == 0,
                      "%s: [%.*s] came back as [%s]", tv->name, (int)len, text, back);
            free(back);
            free(ids);
        }
        unload(t, &g);
    }
}

/* Append cp as UTF-8 (2 bytes: U+0080..U+07FF only). */
static size_t put_2byte(char *at, uint32_t cp)
{
    at[0] = (char)(0xC0 | (cp >> 6));
    at[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* NFC's canonical ordering on hostile input: "a" then 30000 U+0301
 * (class 230) then 30000 U+0316 (class 220) is one run of 60000
 * non-starters to reorder. It must take linear time (an insertion sort
 * took seconds, a 1 MiB body minutes), and give what NFC gives: the same
 * ids as the text already in canonical order, "á" (a + the first U+0301
 * composed) + 30000 U+0316 + 29999 U+0301. */
Test(tokenizer, nfc_orders_a_long_run_of_marks_in_linear_time)
{
    char path[1024], cfg[1024], msg[512];
    snprintf(path, sizeof path, "%s/tokenizers/qwen2/tokenizer.json", QL_FIXTURES);
    snprintf(cfg, sizeof cfg, "%s/tokenizers/qwen2/tokenizer_config.json", QL_FIXTURES);
    tok_tokenizer *t;
    cr_assert_eq(tok_from_hf(&t, path, cfg, msg, sizeof msg), QL_OK, "%s", msg);
    enum { N = 30000 };
    char *hostile = malloc(1 + 4 * N), *canonical = malloc(2 + 4 * N);
    cr_assert(hostile && canonical);
    size_t h = 0, c = 0;
    hostile[h++] = 'a';
    for (int i = 0; i < N; i++)
        h += put_2byte(hostile + h, 0x301);
    for (int i = 0; i < N; i++)
        h += put_2byte(hostile + h, 0x316);
    c += put_2byte(canonical + c, 0xE1); /* á */
    for (int i = 0; i < N; i++)
        c += put_2byte(canonical + c, 0x316);
    for (int i = 0; i < N - 1; i++)
        c += put_2byte(canonical + c, 0x301);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int32_t *a, *b;
    size_t na, nb;
    cr_assert_eq(tok_encode(t, hostile, h, false, false, &a, &na, msg, sizeof msg), QL_OK, "%s",
                 msg);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    cr_assert_eq(tok_encode(t, canonical, c, false, false, &b, &nb, msg, sizeof msg), QL_OK, "%s",
                 msg);
    cr_assert_eq(na, nb, "%zu ids, canonical order gives %zu", na, nb);
    cr_assert_eq(memcmp(a, b, na * sizeof *a), 0, "the ids differ from canonical order's");
    cr_log_info("NFC of 60000 marks on one letter: %.3f s", s);
    cr_assert_lt(s, 1.0, "encoding took %.2f s", s);
    free(a);
    free(b);
    free(hostile);
    free(canonical);
    tok_free(t);
}

/* tok_from_hf_json (the in-memory form the fuzzer drives) builds the
 * tokenizer tok_from_hf builds from the same file, and refuses bad JSON
 * naming the source it was given. */
Test(tokenizer, tokenizer_json_from_memory_is_the_file_s_tokenizer)
{
    char path[1024], msg[512];
    snprintf(path, sizeof path, "%s/tokenizers/qwen2/tokenizer.json", QL_FIXTURES);
    FILE *f = fopen(path, "rb");
    cr_assert(f);
    char *json = malloc(1 << 20);
    size_t len = fread(json, 1, 1 << 20, f);
    fclose(f);
    tok_tokenizer *a, *b;
    cr_assert_eq(tok_from_hf(&a, path, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(tok_from_hf_json(&b, json, len, "mem.json", msg, sizeof msg), QL_OK, "%s", msg);
    static const char text[] = "Hello, world! caf\xc3\xa9 e\xcc\x81 2024 <|im_start|>x";
    int32_t *ia, *ib;
    size_t na, nb;
    cr_assert_eq(tok_encode(a, text, sizeof text - 1, true, true, &ia, &na, msg, sizeof msg), 0);
    cr_assert_eq(tok_encode(b, text, sizeof text - 1, true, true, &ib, &nb, msg, sizeof msg), 0);
    cr_assert(na == nb && memcmp(ia, ib, na * sizeof *ia) == 0, "%zu ids vs %zu", na, nb);
    cr_assert_eq(tok_vocab_size(a), tok_vocab_size(b));
    free(ia);
    free(ib);
    tok_free(a);
    tok_free(b);
    tok_tokenizer *t = (tok_tokenizer *)&t;
    cr_assert_eq(tok_from_hf_json(&t, json, len / 2, "mem.json", msg, sizeof msg), QL_EFORMAT);
    cr_assert_null(t);
    cr_assert(strstr(msg, "mem.json") && strstr(msg, "not valid JSON"), "%s", msg);
    cr_assert_eq(tok_from_hf_json(&t, "[1]", 3, "mem.json", msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "not a JSON object"), "%s", msg);
    free(json);
}

/*
 * Hostile text of 512 KiB, one class of character throughout, through
 * every pre-tokenizer step and normalizer we run: long runs of spaces
 * (GPT-2's \s+(?!\S), Llama 3's \s*[\r\n]+, deepseek's \s+$), digits,
 * punctuation ("default"'s first step), apostrophes (the contractions),
 * combining marks under NFC, invalid UTF-8, one enormous word for BPE to
 * merge (byte-level by rank, SentencePiece by rank and by score), and
 * prefixes of a special token. Each step is linear and BPE a heap over a
 * linked list (O(n log n)): measured at 1 and 4 MiB, each of these grows
 * 4 to 6 times (caches), and the slowest takes ~2 s a MiB in a release
 * build. A quadratic step would need ~10^11 operations here: the bound of
 * 20 s each (a sanitizer build on a loaded machine) fails it.
 */
Test(tokenizer, hostile_text_of_512_kib_encodes_in_n_log_n_time)
{
    static const struct {
        const char *file; /* under tests/fixtures/tokenizers/ */
        const char *unit, *head, *tail;
        bool special;
    } cases[] = {
        {"gpt2/tokenizer.json", " ", "", "x", false},
        {"gpt2/tokenizer.json", "hello", "", "", false},
        {"gpt2/tokenizer.json", "\xff", "", "", false},
        {"llama3/tokenizer.json", " \n", "", "x", false},
        {"llama3/tokenizer.json", "'", "", "", false},
        {"llama3/tokenizer.json", "7", "", "", false},
        {"llama3/tokenizer.json", "<|begin_of_tex", "", "", true},
        {"qwen2/tokenizer.json", "\xcc\x81\xcc\x96", "a", "", false},
        {"spm/tokenizer.json", "hello ", "", "", false},
        {"spm.gguf", "hello ", "", "", false},
        {"gpt2_default.gguf", "!", "", "", false},
        {"llama.cpp/ggml-vocab-deepseek-llm.gguf", " ", "", "x", false},
    };
    enum { SIZE = 512 << 10 };
    char *text = malloc(SIZE + 64);
    cr_assert(text);
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        char path[1024], msg[512];
        snprintf(path, sizeof path, "%s/tokenizers/%s", QL_FIXTURES, cases[k].file);
        tok_tokenizer *t = NULL;
        gguf_file g = {0};
        if (strstr(path, ".gguf")) {
            cr_assert_eq(gguf_open(&g, path, msg, sizeof msg), QL_OK, "%s", msg);
            cr_assert_eq(tok_from_gguf(&t, &g, msg, sizeof msg), QL_OK, "%s", msg);
        } else {
            cr_assert_eq(tok_from_hf(&t, path, NULL, msg, sizeof msg), QL_OK, "%s", msg);
        }
        size_t len = strlen(cases[k].head), ul = strlen(cases[k].unit);
        memcpy(text, cases[k].head, len);
        while (len + ul <= SIZE) {
            memcpy(text + len, cases[k].unit, ul);
            len += ul;
        }
        memcpy(text + len, cases[k].tail, strlen(cases[k].tail));
        len += strlen(cases[k].tail);
        int32_t *ids;
        size_t n;
        double t0 = seconds();
        cr_assert_eq(tok_encode(t, text, len, false, cases[k].special, &ids, &n, msg, sizeof msg),
                     QL_OK, "%s", msg);
        double took = seconds() - t0;
        cr_log_info("%s, \"%s\" x %zu: %zu ids in %.3f s", cases[k].file, cases[k].unit, len / ul,
                    n, took);
        cr_assert_lt(took, 20.0, "%s on \"%s\" repeated: %.1f s", cases[k].file, cases[k].unit,
                     took);
        free(ids);
        unload(t, &g);
    }
    free(text);
}

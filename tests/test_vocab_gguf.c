/*
 * test_vocab_gguf.c - the tokenizer-only load (eng_tokenizer_load) on
 * llama.cpp's own vocabulary-only GGUF files (models/ggml-vocab-*.gguf:
 * tokenizer metadata, no tensors), against llama.cpp's own expected ids
 * (the .gguf.inp / .gguf.out files beside them, which its
 * test-tokenizer-0 checks). Copied from llama.cpp as the llama-cpp-python
 * 0.3.36 sdist vendors it (vendor/llama.cpp/models/; MIT, see
 * tests/fixtures/tokenizers/llama.cpp/README.md).
 *
 * All but llama-spm and gpt-2 are cut down to the tokens and merges their
 * test texts can reach, ids renumbered and .out rewritten to match, by
 * tests/fixtures/make_llama_cpp_vocabs.py (which checks with llama.cpp
 * itself that the cut files give the rewritten ids); QL_VOCAB_DIR=<llama.cpp
 * models/ folder> runs the same cases on the original files.
 *
 * As test-tokenizer-0 reads them: the inputs are split at
 * "\n__ggml_vocab_test__\n", the outputs are one line of space-separated
 * ids per input, and each input is tokenized with add_special = false and
 * parse_special = false (no BOS; special-token strings are text).
 *
 * And GPT-OSS's o200k_harmony in both forms (see the tests below).
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "ql_base.h"
#include "test_util.h"
#include "tokenizer.h"

#define VOCAB_DIR   QL_FIXTURES "/tokenizers/llama.cpp"
#define GPT_OSS_DIR QL_FIXTURES "/tokenizers/gpt-oss"

static char *read_all(const char *path, size_t *len)
{
    char *buf = test_read_file(path, len);
    cr_assert(buf, "%s is missing", path);
    return buf;
}

/* Parse one line of ids ("" or " 474 287 29871") into ids; returns the count. */
static size_t parse_ids(const char *line, size_t len, int32_t *ids, size_t cap)
{
    size_t n = 0;
    const char *p = line, *end = line + len;
    while (p < end) {
        while (p < end && *p == ' ')
            p++;
        if (p >= end)
            break;
        char *stop;
        long v = strtol(p, &stop, 10);
        cr_assert(stop > p && n < cap, "bad id list '%.*s'", (int)len, line);
        ids[n++] = (int32_t)v;
        p = stop;
    }
    return n;
}

/* Tokenize each text of inp_path (add_special = false, parse_special as
 * given) and compare with the line of out_path beside it; every difference
 * is logged, then the test fails naming how many. round_trip: the ids also
 * decode to the text (a byte-level vocabulary loses nothing). */
static void check_cases(const tok_tokenizer *t, const char *name, const char *inp_path,
                        const char *out_path, bool parse_special, bool round_trip)
{
    size_t inp_len, out_len;
    char *inp = read_all(inp_path, &inp_len);
    char *out = read_all(out_path, &out_len);
    char msg[512];

    static const char sep[] = "\n__ggml_vocab_test__\n";
    const char *in_at = inp, *in_end = inp + inp_len, *out_at = out, *out_end = out + out_len;
    size_t cases = 0, failed = 0;
    int32_t want[512];
    while (in_at < in_end) {
        const char *next = strstr(in_at, sep);
        size_t text_len = next ? (size_t)(next - in_at) : (size_t)(in_end - in_at);
        const char *nl = memchr(out_at, '\n', (size_t)(out_end - out_at));
        cr_assert(out_at < out_end, "%s: more inputs than outputs", name);
        size_t line_len = nl ? (size_t)(nl - out_at) : (size_t)(out_end - out_at);
        size_t n_want = parse_ids(out_at, line_len, want, 512);

        int32_t *ids = NULL;
        size_t n = 0;
        int rc = tok_encode(t, in_at, text_len, false, parse_special, &ids, &n, msg, sizeof msg);
        cr_assert_eq(rc, 0, "%s case %zu: %s", name, cases, msg);
        if (n != n_want || memcmp(ids, want, n * sizeof *ids) != 0) {
            failed++;
            char got[4096];
            size_t at = 0;
            for (size_t i = 0; i < n && at < sizeof got - 16; i++)
                at += (size_t)snprintf(got + at, sizeof got - at, " %d", ids[i]);
            got[at] = 0;
            cr_log_error("%s case %zu '%.*s' (parse_special %d): got%s, want %.*s", name, cases,
                         (int)text_len, in_at, parse_special, got, (int)line_len, out_at);
        }
        char *back = NULL;
        size_t back_len = 0;
        if (round_trip) {
            rc = tok_decode(t, ids, n, false, &back, &back_len, msg, sizeof msg);
            cr_assert_eq(rc, 0, "%s case %zu: %s", name, cases, msg);
            cr_expect(back_len == text_len && memcmp(back, in_at, text_len) == 0,
                      "%s case %zu '%.*s' decodes to '%s'", name, cases, (int)text_len, in_at,
                      back);
        }
        free(back);
        free(ids);
        cases++;
        in_at = next ? next + strlen(sep) : in_end;
        out_at = nl ? nl + 1 : out_end;
    }
    cr_assert_gt(cases, 30, "%s: %zu cases read", name, cases);
    cr_assert_eq(failed, 0, "%s: %zu of %zu cases differ from %s", name, failed, cases, out_path);
    free(inp);
    free(out);
}

static void check_vocab(const char *name)
{
    char path[1024], inp[1100], out[1100], msg[512];
    const char *dir = getenv("QL_VOCAB_DIR") ? getenv("QL_VOCAB_DIR") : VOCAB_DIR;
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", dir, name);
    tok_tokenizer *t = NULL;
    int rc = eng_tokenizer_load(&t, path, msg, sizeof msg);
    cr_assert_eq(rc, 0, "%s: %s", path, msg);
    snprintf(inp, sizeof inp, "%s.inp", path);
    snprintf(out, sizeof out, "%s.out", path);
    check_cases(t, name, inp, out, false, false);
    tok_free(t);
}

/* names held in the parameter itself: Criterion runs each case in a new
 * process, where a pointer into the parent's memory means nothing */
typedef struct vocab_name {
    char name[32];
} vocab_name;

ParameterizedTestParameters(vocab_gguf, llama_cpp_vocab_gives_llama_cpp_ids)
{
    /* every llama.cpp vocabulary with test texts whose tokenizer model we
     * implement: not bert-bge (WordPiece) */
    static vocab_name names[] = {
        {"llama-spm"}, {"phi-3"},   {"gpt-2"},        {"llama-bpe"},
        {"qwen2"},     {"qwen35"},  {"deepseek-llm"}, {"deepseek-coder"},
        {"starcoder"}, {"refact"},  {"command-r"},    {"falcon"},
        {"mpt"},       {"gemma-4"},
    };
    return cr_make_param_array(vocab_name, names, sizeof names / sizeof *names);
}

ParameterizedTest(vocab_name *v, vocab_gguf, llama_cpp_vocab_gives_llama_cpp_ids)
{
    check_vocab(v->name);
}

/* Gemma 4's two rules beyond rank-ordered BPE, which the real vocabulary's
 * texts cannot tell apart (make_gemma4_edge_vocab.py): merges joining a
 * newline to another character never apply (each run of newlines is
 * merged apart), and a run of newlines that is a token no merge makes is
 * taken whole. The ids are llama.cpp's own. */
Test(vocab_gguf, gemma4_newline_runs_give_llama_cpp_ids)
{
    char msg[512];
    tok_tokenizer *t = NULL;
    const char *path = VOCAB_DIR "/gemma4-edges.gguf";
    cr_assert_eq(eng_tokenizer_load(&t, path, msg, sizeof msg), 0, "%s", msg);
    cr_expect_str_eq(tok_gguf_model(t), "gemma4");
    cr_expect(tok_adds_bos(t), "llama.cpp adds BOS for gemma4");
    check_cases(t, "gemma4-edges", VOCAB_DIR "/gemma4-edges.gguf.inp",
                VOCAB_DIR "/gemma4-edges.gguf.out", false, false);
    tok_free(t);
}

/*
 * GPT-OSS's o200k_harmony tokenizer (tests/fixtures/tokenizers/gpt-oss/, made by
 * make_harmony_tokenizer.py from the real o200k vocabulary, cut to its texts): the
 * tokenizer.json gives Hugging Face tokenizers' ids (real o200k_harmony ids: the
 * cut keeps them), the GGUF llama.cpp's converter writes gives llama.cpp's ids. The
 * two read o200k's regex differently (llama.cpp's rewrite takes any non-ASCII
 * letter as both cases and no mark as a letter), and each side is pinned to its
 * reference, with special tokens parsed and as text.
 */
static tok_tokenizer *load_gpt_oss(const char *path, const char *described_as)
{
    char msg[512];
    tok_tokenizer *t = NULL;
    cr_assert_eq(eng_tokenizer_load(&t, path, msg, sizeof msg), 0, "%s", msg);
    cr_expect(strstr(tok_describe(t), described_as), "%s: described as \"%s\"", path,
              tok_describe(t));
    cr_expect_eq(tok_bos(t), tok_token_id(t, "<|startoftext|>", 15), "%s: bos", path);
    cr_expect_eq(tok_eos(t), tok_token_id(t, "<|return|>", 10), "%s: eos", path);
    cr_expect_not(tok_adds_bos(t), "%s adds a BOS", path);
    cr_expect_str_eq(tok_gguf_pre(t), "gpt-4o");
    return t;
}

Test(vocab_gguf, gpt_oss_tokenizer_json_gives_tokenizers_ids)
{
    tok_tokenizer *t = load_gpt_oss(GPT_OSS_DIR, "o200k");
    /* o200k_harmony's own ids: the cut kept them */
    cr_expect_eq(tok_bos(t), 199998);
    cr_expect_eq(tok_eos(t), 200002);
    const char *inp = GPT_OSS_DIR "/tokenizer.json.inp";
    check_cases(t, "gpt-oss tokenizer.json", inp, GPT_OSS_DIR "/tokenizer.json.out", true, true);
    check_cases(t, "gpt-oss tokenizer.json", inp, GPT_OSS_DIR "/tokenizer.json.plain.out", false,
                true);
    tok_free(t);
}

Test(vocab_gguf, gpt_oss_gguf_gives_llama_cpp_ids)
{
    tok_tokenizer *t = load_gpt_oss(GPT_OSS_DIR "/ggml-vocab-gpt-oss.gguf", "gpt-4o");
    const char *inp = GPT_OSS_DIR "/tokenizer.json.inp", *out = GPT_OSS_DIR "/ggml-vocab-gpt-oss";
    char path[1024];
    snprintf(path, sizeof path, "%s.gguf.out", out);
    check_cases(t, "gpt-oss GGUF", inp, path, false, true);
    snprintf(path, sizeof path, "%s.gguf.special.out", out);
    check_cases(t, "gpt-oss GGUF", inp, path, true, true);
    /* llama.cpp's retyping: five harmony tokens are matched even as text */
    cr_expect_not(tok_is_special(t, tok_token_id(t, "<|end|>", 7)), "<|end|> is user-defined");
    cr_expect(tok_is_special(t, tok_token_id(t, "<|return|>", 10)), "<|return|> is control");
    tok_free(t);
}

Test(vocab_gguf, a_vocabulary_only_file_is_no_model)
{
    /* no tensors: the model loader refuses it, the tokenizer loader reads it */
    char path[1024], msg[512];
    snprintf(path, sizeof path, "%s/ggml-vocab-gpt-2.gguf", VOCAB_DIR);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_neq(eng_model_load(&m, &o, msg, sizeof msg), 0, "a vocabulary-only file loads");
    tok_tokenizer *t = NULL;
    cr_assert_eq(eng_tokenizer_load(&t, path, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(tok_vocab_size(t), 50257);
    tok_free(t);
}

Test(vocab_gguf, missing_and_non_tokenizer_paths_are_refused_by_name)
{
    char msg[512];
    tok_tokenizer *t = (tok_tokenizer *)&msg; /* set to NULL on error */
    cr_assert_neq(eng_tokenizer_load(&t, "/nonexistent/x.gguf", msg, sizeof msg), 0);
    cr_assert_null(t);
    cr_assert(strstr(msg, "/nonexistent/x.gguf"), "%s", msg);
    /* a folder without tokenizer.json */
    cr_assert_neq(eng_tokenizer_load(&t, VOCAB_DIR, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "tokenizer.json is missing"), "%s", msg);
    /* a file that is not GGUF */
    char path[1024];
    snprintf(path, sizeof path, "%s/ggml-vocab-gpt-2.gguf.inp", VOCAB_DIR);
    cr_assert_neq(eng_tokenizer_load(&t, path, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "ggml-vocab-gpt-2.gguf.inp"), "%s", msg);
}

Test(vocab_gguf, deepseek_llm_trailing_space_rule_stays_linear_on_long_runs)
{
    /* deepseek-llm's \s+$ fails at every space of a run that does not end
     * the piece; tried naively at each, a run of n costs n^2 / 2 steps
     * (2e10 here, many seconds); the rule skips a space after a failure */
    char path[1024], msg[512];
    snprintf(path, sizeof path, "%s/ggml-vocab-deepseek-llm.gguf", VOCAB_DIR);
    tok_tokenizer *t = NULL;
    cr_assert_eq(eng_tokenizer_load(&t, path, msg, sizeof msg), 0, "%s", msg);
    size_t n = 200000;
    char *text = malloc(n + 1);
    memset(text, ' ', n);
    text[n] = '1';
    int32_t *ids = NULL;
    size_t n_ids = 0;
    double t0 = ql_now_s();
    cr_assert_eq(tok_encode(t, text, n + 1, false, false, &ids, &n_ids, msg, sizeof msg), 0, "%s",
                 msg);
    double took = ql_now_s() - t0;
    cr_assert_gt(n_ids, 1);
    cr_assert_lt(took, 2.0, "%zu spaces and a digit took %.2f s", n, took);
    free(ids);
    free(text);
    tok_free(t);
}

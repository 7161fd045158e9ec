/*
 * tok_gguf.c - tok_from_gguf: a tokenizer from GGUF metadata
 * (tokenizer.ggml.*), model "gpt2" (byte-level BPE), "llama"
 * (SentencePiece-style BPE merged by score, as llama.cpp does it) or
 * "gemma4" (Gemma 4's SentencePiece-style BPE merged by rank).
 *
 * It follows llama.cpp: its token types (CONTROL is special, USER_DEFINED
 * an added token that is always matched), its pre-tokenizer names
 * (tokenizer.ggml.pre, with llama.cpp's "default" when absent), its
 * defaults for missing keys, added tokens decoding as their text, and no
 * normalizer (the Qwen2 family's tokenizer.json has NFC, which llama.cpp
 * skips: a GGUF gives llama.cpp's ids, pinned by tests/test_vocab_gguf.c).
 *
 * It owns nothing past the call: it reads the caller's gguf_file (whose
 * strings it copies) and builds a tokenizer (tok_table.c) that is the
 * caller's.
 */
#include "internal/tokenizer_internal.h"

#include <stdio.h>
#include <string.h>

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
    if (!tok_alloc_tokens(t, n) || !tok_vocab_init(t, n))
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
            !tok_set_token(t, (int32_t)i, toks->strs[i].ptr, (size_t)toks->strs[i].len,
                           (uint8_t)type))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
        tok_vocab_insert(t, (int32_t)i, true);
    }
    return QL_OK;
}

/* tokenizer.ggml.merges ("a b", split at the first space after the first
 * byte, as llama.cpp does), ranked by their order. */
static int gguf_merges(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, "tokenizer.ggml.merges");
    if (!kv)
        return ql_fail(
            msg, msg_len, QL_ENOTFOUND,
            "%s: no tokenizer.ggml.merges (a \"gpt2\" or \"gemma4\" tokenizer needs them)",
            t->source);
    if (kv->type != GGUF_ARRAY || kv->elem != GGUF_STRING || kv->n > UINT32_MAX)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: tokenizer.ggml.merges is not an array of strings", t->source);
    if (!tok_merges_init(t, (size_t)kv->n))
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
        rc = tok_add_merge(t, s.ptr, la, space + 1, (size_t)s.len - la - 1, (uint32_t)i, &buf, &cap,
                           t->source, msg, msg_len);
    }
    free(buf);
    return rc;
}

/* The tokenizer models of tokenizer.ggml.model we implement. */
typedef enum gguf_tok_model { MODEL_GPT2, MODEL_LLAMA, MODEL_GEMMA4 } gguf_tok_model;

/* tokenizer.ggml.model: "gpt2", "llama" or "gemma4" into *model (anything
 * else is refused, naming what it is when we know). */
static int gguf_model(const tok_tokenizer *t, const gguf_file *f, gguf_tok_model *out, char *msg,
                      size_t msg_len)
{
    const char *path = t->source;
    const gguf_kv *model = gguf_find_kv(f, "tokenizer.ggml.model");
    if (!model)
        return ql_fail(msg, msg_len, QL_ENOTFOUND,
                       "%s: no tokenizer.ggml.model: the file carries no tokenizer", path);
    if (model->type != GGUF_STRING)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tokenizer.ggml.model is not a string", path);
    static const struct {
        const char *name;
        gguf_tok_model model;
    } known[] = {{"gpt2", MODEL_GPT2}, {"llama", MODEL_LLAMA}, {"gemma4", MODEL_GEMMA4}};
    for (size_t k = 0; k < N_ELEMS(known); k++)
        if (gguf_str_is(model->str, known[k].name)) {
            *out = known[k].model;
            return QL_OK;
        }
    const char *what = gguf_str_is(model->str, "bert")   ? " (WordPiece)"
                       : gguf_str_is(model->str, "t5")   ? " (Unigram)"
                       : gguf_str_is(model->str, "rwkv") ? " (RWKV's trie)"
                                                         : "";
    return ql_fail(msg, msg_len, QL_EINVAL,
                   "%s: tokenizer.ggml.model \"%.*s\"%s is not supported (only \"gpt2\", "
                   "byte-level BPE, \"llama\" and \"gemma4\", sentencepiece BPE)",
                   path, (int)(model->str.len > 64 ? 64 : model->str.len), model->str.ptr, what);
}

/* A "gpt2" vocabulary's pre-tokenizer (tokenizer.ggml.pre, llama.cpp's
 * "default" when absent, as llama.cpp does; its name into pre_name, and
 * whether llama.cpp adds BOS for it by default into *add_bos) and merges. */
static int gguf_byte_level(tok_tokenizer *t, const gguf_file *f, char *pre_name,
                           size_t pre_name_len, bool *add_bos, char *msg, size_t msg_len)
{
    const char *path = t->source;
    const gguf_kv *pre = gguf_find_kv(f, "tokenizer.ggml.pre");
    if (pre && pre->type != GGUF_STRING)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tokenizer.ggml.pre is not a string", path);
    if (pre)
        snprintf(pre_name, pre_name_len, "%.*s", (int)(pre->str.len > 64 ? 64 : pre->str.len),
                 pre->str.ptr);
    const tok_pre *known = pre ? tok_pre_named(pre->str.ptr, (size_t)pre->str.len)
                               : tok_pre_named("default", strlen("default"));
    if (!known)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: tokenizer.ggml.pre \"%s\" is not a pre-tokenizer we implement "
                       "(default, gpt-2, llama-bpe, qwen2, smollm, ...)",
                       path, pre_name);
    for (int i = 0; i < known->n_steps; i++)
        t->steps[i] = known->steps[i];
    t->n_steps = known->n_steps;
    t->ignore_merges = known->ignore_merges;
    *add_bos = known->add_bos;
    return gguf_merges(t, f, msg, msg_len);
}

/* A "llama" vocabulary as llama.cpp's SPM session runs it: "▁" before each
 * text fragment unless add_space_prefix is false, spaces as ▁,
 * score-driven merges, byte fallback. */
static int gguf_sentencepiece(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    bool space_prefix = true;
    int rc = gguf_bool(t, f, "tokenizer.ggml.add_space_prefix", &space_prefix, msg, msg_len);
    t->score_merges = true;
    t->byte_fallback = true;
    t->replace_space = true;
    t->prefix = space_prefix ? PREFIX_EVERY : PREFIX_NONE;
    t->strip_space = space_prefix;
    return rc;
}

/* A "gemma4" vocabulary as llama.cpp's BPE session runs it for Gemma 4:
 * spaces as ▁ (escape_whitespaces), no ▁ in front, the merges by rank over
 * each run of newlines and each run of other characters (line_runs), a
 * character no token covers as its <0xXX> byte tokens. */
static int gguf_gemma4(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    t->byte_fallback = true;
    t->replace_space = true;
    t->line_runs = true;
    t->prefix = PREFIX_NONE;
    return gguf_merges(t, f, msg, msg_len);
}

/* The added tokens: every CONTROL, USER_DEFINED and UNKNOWN token, special
 * unless USER_DEFINED. */
static bool gguf_added(tok_tokenizer *t)
{
    size_t cap = 0;
    for (size_t i = 0; i < t->n_tokens; i++) {
        uint8_t type = t->type[i];
        if (type != TT_CONTROL && type != TT_USER && type != TT_UNKNOWN)
            continue;
        tok_added a = {.id = (int32_t)i, .len = t->text_len[i], .special = type != TT_USER};
        if (!tok_add_added(t, &cap, &a, t->arena + t->text_off[i]))
            return false;
    }
    return true;
}

static int32_t gguf_find(const tok_tokenizer *t, const char *text)
{
    return tok_vocab_find(t, text, strlen(text));
}

/* Harmony's tokens as llama.cpp's llama-vocab.cpp retypes them in any
 * vocabulary that has them: <|channel|>, <|message|>, <|start|> and
 * <|constrain|> become USER_DEFINED (its "quick hack for gpt-oss"), and so
 * does <|end|> when <|return|> and <|call|> (or Solar Open's <|calls|> and
 * <|flush|>) end generation beside it (its "workaround for o200k_harmony"
 * takes <|end|> out of the end-of-generation tokens). A USER_DEFINED token is
 * matched in a text even without parse_special, and decodes as its text with
 * skip_special. The last token of a text wins, as in its map. */
static void gguf_harmony_tokens(tok_tokenizer *t)
{
    static const char *const names[] = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"};
    for (size_t k = 0; k < N_ELEMS(names); k++) {
        int32_t id = gguf_find(t, names[k]);
        if (id >= 0)
            t->type[id] = TT_USER;
    }
    int32_t end = gguf_find(t, "<|end|>");
    bool call = gguf_find(t, "<|call|>") >= 0 || gguf_find(t, "<|calls|>") >= 0;
    bool ret = gguf_find(t, "<|return|>") >= 0, flush = gguf_find(t, "<|flush|>") >= 0;
    if (end >= 0 && call && (ret || flush))
        t->type[end] = TT_USER;
}

static int gguf_build(tok_tokenizer *t, const gguf_file *f, char *msg, size_t msg_len)
{
    const char *path = t->source;
    gguf_tok_model model = MODEL_GPT2;
    int rc = gguf_model(t, f, &model, msg, msg_len);
    if (rc)
        return rc;
    bool gpt2 = model == MODEL_GPT2;
    t->family = gpt2 ? FAMILY_BYTE_LEVEL : FAMILY_SPM;
    if ((rc = gguf_tokens(t, f, msg, msg_len)))
        return rc;
    char pre_name[80] = "default";
    bool add_bos = !gpt2; /* llama.cpp's defaults when the key is missing */
    if (model == MODEL_GEMMA4)
        rc = gguf_gemma4(t, f, msg, msg_len);
    else
        rc = gpt2 ? gguf_byte_level(t, f, pre_name, sizeof pre_name, &add_bos, msg, msg_len)
                  : gguf_sentencepiece(t, f, msg, msg_len);
    if (rc)
        return rc;
    gguf_harmony_tokens(t);
    if (!gguf_added(t))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    if (!gpt2)
        for (size_t i = 0; i < t->n_tokens && t->unk < 0; i++)
            if (t->type[i] == TT_UNKNOWN)
                t->unk = (int32_t)i;
    if ((rc = gguf_token_id(t, f, "tokenizer.ggml.bos_token_id", &t->bos, msg, msg_len)) ||
        (rc = gguf_token_id(t, f, "tokenizer.ggml.eos_token_id", &t->eos, msg, msg_len)) ||
        (rc = gguf_token_id(t, f, "tokenizer.ggml.unknown_token_id", &t->unk, msg, msg_len)) ||
        (rc = gguf_bool(t, f, "tokenizer.ggml.add_bos_token", &add_bos, msg, msg_len)))
        return rc;
    /* llama.cpp adds BOS for Gemma 4 whatever the file says (its
     * "workaround for Gemma 4"), as Gemma 4 needs it */
    add_bos = add_bos || model == MODEL_GEMMA4;
    t->adds_bos = add_bos && t->bos >= 0;
    if (!tok_finish(t, true))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    tok_write_description(t, pre_name);
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

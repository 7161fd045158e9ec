/*
 * tok_hf.c - tok_from_hf: a tokenizer from a Hugging Face tokenizer.json
 * (and tokenizer_config.json).
 *
 * It reads model (type BPE: vocab, merges, unk_token, byte_fallback,
 * fuse_unk, ignore_merges), added_tokens, the normalizer, pre_tokenizer,
 * decoder and post_processor, and the config's bos/eos tokens and
 * add_bos_token, and refuses, naming the file and the field, anything whose
 * encoding it could only approximate: a pre-tokenizer regex other than the
 * known ones (pretokenize.c), other normalizers, BPE dropout, subword
 * affixes. Knowingly different from tokenizers (no fixture shows it): added
 * tokens marked "normalized": true are matched in the raw text, as the
 * normalized: false ones are.
 *
 * It owns nothing past the call: the JSON is read through
 * modelfile/ (mf_read_json, or mf_parse_json for tok_from_hf_json's
 * text in memory; mf_json_*) and freed before it returns;
 * the tokenizer it builds (tok_table.c) is the caller's.
 */
#include "internal/tokenizer_internal.h"

#include <cjson/cJSON.h>
#include <string.h>

/* --- tokenizer.json ----------------------------------------------------------- */

/* v as a token id: an integer from 0 to TOK_MAX_ID - 1, else -1. */
static long hf_id(const cJSON *v)
{
    int64_t id;
    return mf_json_integer(v, 0, TOK_MAX_ID - 1, &id) ? (long)id : -1;
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

/* A ByteLevel pre-tokenizer: the byte map, GPT-2's regex unless use_regex
 * is false, the prefix space. */
static int hf_byte_level(tok_tokenizer *t, const cJSON *pre, hf_kind *k, const char *path,
                         char *msg, size_t msg_len)
{
    k->byte_level = true;
    if (mf_json_bool(pre, "add_prefix_space", false)) {
        if (t->n_steps)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "%s: a ByteLevel pre-tokenizer with add_prefix_space after "
                           "other steps is not supported",
                           path);
        t->prefix_space = true;
    }
    return mf_json_bool(pre, "use_regex", true) ? add_step(t, STEP_GPT2, path, msg, msg_len)
                                                : QL_OK;
}

/* A Split pre-tokenizer: one of the regexes we implement, Isolated. */
static int hf_split(tok_tokenizer *t, const cJSON *pre, const char *path, char *msg, size_t msg_len)
{
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(pre, "pattern");
    const char *regex = mf_json_str(pattern, "Regex"), *behavior = mf_json_str(pre, "behavior");
    if (!regex) {
        const char *str = mf_json_str(pattern, "String");
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: Split pre-tokenizer on the string \"%.100s\" is not supported "
                       "(only the regexes of GPT-2, Llama 3, Qwen2, o200k and llama.cpp's default)",
                       path, str ? str : "?");
    }
    if (!behavior || strcmp(behavior, "Isolated") != 0 || mf_json_bool(pre, "invert", false))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: Split pre-tokenizer with behavior %s%s is not supported (only "
                       "Isolated)",
                       path, behavior ? behavior : "(none)",
                       mf_json_bool(pre, "invert", false) ? ", inverted" : "");
    pre_step step;
    if (tok_step_for_regex(regex, &step))
        return add_step(t, step, path, msg, msg_len);
    return ql_fail(msg, msg_len, QL_EINVAL,
                   "%s: Split pre-tokenizer regex \"%.300s\" is not one we implement (only "
                   "those of GPT-2, Llama 3, Qwen2, o200k and llama.cpp's default)",
                   path, regex);
}

/* A Metaspace pre-tokenizer: spaces as ▁, where the ▁ prefix goes, a piece
 * per ▁-word unless split is false. */
static int hf_metaspace(tok_tokenizer *t, const cJSON *pre, hf_kind *k, const char *path, char *msg,
                        size_t msg_len)
{
    const char *rep = mf_json_str(pre, "replacement"), *scheme = mf_json_str(pre, "prepend_scheme");
    if (!rep || strcmp(rep, SPM_SPACE) != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: Metaspace pre-tokenizer with replacement \"%s\" is not supported "
                       "(only \"" SPM_SPACE "\")",
                       path, rep ? rep : "(none)");
    if (!scheme)
        t->prefix = mf_json_bool(pre, "add_prefix_space", true) ? PREFIX_ALWAYS : PREFIX_NONE;
    else if (strcmp(scheme, "always") == 0)
        t->prefix = PREFIX_ALWAYS;
    else if (strcmp(scheme, "first") == 0)
        t->prefix = PREFIX_FIRST;
    else if (strcmp(scheme, "never") == 0)
        t->prefix = PREFIX_NONE;
    else
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: Metaspace prepend_scheme \"%s\" is not known",
                       path, scheme);
    t->replace_space = true;
    t->spm_split = mf_json_bool(pre, "split", true);
    k->spm = true;
    return QL_OK;
}

static int hf_pre_tokenizer(tok_tokenizer *t, const cJSON *pre, hf_kind *k, const char *path,
                            char *msg, size_t msg_len)
{
    if (!pre || cJSON_IsNull(pre))
        return QL_OK;
    const char *type = mf_json_str(pre, "type");
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
    if (strcmp(type, "ByteLevel") == 0)
        return hf_byte_level(t, pre, k, path, msg, msg_len);
    if (strcmp(type, "Split") == 0)
        return hf_split(t, pre, path, msg, msg_len);
    if (strcmp(type, "Digits") == 0)
        return add_step(t,
                        mf_json_bool(pre, "individual_digits", false) ? STEP_DIGIT : STEP_NUMBERS,
                        path, msg, msg_len);
    if (strcmp(type, "Metaspace") == 0)
        return hf_metaspace(t, pre, k, path, msg, msg_len);
    return ql_fail(msg, msg_len, QL_EINVAL, "%s: pre-tokenizer %s is not supported", path, type);
}

static int hf_normalizer(tok_tokenizer *t, const cJSON *norm, hf_kind *k, const char *path,
                         char *msg, size_t msg_len)
{
    if (!norm || cJSON_IsNull(norm))
        return QL_OK;
    const char *type = mf_json_str(norm, "type");
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
        const char *what = mf_json_str(norm, "prepend");
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
        const char *from = mf_json_str(cJSON_GetObjectItemCaseSensitive(norm, "pattern"), "String");
        const char *to = mf_json_str(norm, "content");
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
    const char *type = mf_json_str(dec, "type");
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
        const char *content = mf_json_str(dec, "content");
        const cJSON *start = cJSON_GetObjectItemCaseSensitive(dec, "start");
        return content && strcmp(content, " ") == 0 && cJSON_IsNumber(start) &&
               start->valuedouble >= 1;
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *scheme = mf_json_str(dec, "prepend_scheme");
        return scheme ? strcmp(scheme, "never") != 0 : mf_json_bool(dec, "add_prefix_space", true);
    }
    return false;
}

/* The TemplateProcessing post-processor, alone or in a Sequence. */
static const cJSON *find_template(const cJSON *pp)
{
    const char *type = mf_json_str(pp, "type");
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
    return tok_vocab_find(t, s, n);
}

/* tokenizer_config.json's name for a token: a string or {"content": ...}. */
static const char *config_token(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsString(v))
        return v->valuestring;
    return cJSON_IsObject(v) ? mf_json_str(v, "content") : NULL;
}

/* model is a BPE (type "BPE", or untagged with merges, as files from before
 * tokenizers tagged the model), its vocab, merges and the added tokens have
 * their shapes, and it uses none of the BPE options we do not implement. */
static int hf_check_model(const cJSON *root, const cJSON *model, const char *path, char *msg,
                          size_t msg_len)
{
    const char *type = mf_json_str(model, "type");
    if (!type && cJSON_GetObjectItemCaseSensitive(model, "merges"))
        type = "BPE";
    if (!type || strcmp(type, "BPE") != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: model type %s is not supported (only BPE: byte-level or "
                       "sentencepiece-style)",
                       path, type ? type : "(none)");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(model, "vocab")))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: model.vocab is not an object", path);
    if (merges && !cJSON_IsArray(merges))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: model.merges is not an array", path);
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: added_tokens is not an array", path);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < N_ELEMS(affixes); i++) {
        const char *v = mf_json_str(model, affixes[i]);
        if (v && *v)
            return ql_fail(msg, msg_len, QL_EINVAL, "%s: BPE with %s \"%s\" is not supported", path,
                           affixes[i], v);
    }
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble != 0)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: BPE dropout %g is not supported (it makes encoding random)", path,
                       dropout->valuedouble);
    return QL_OK;
}

/* The id table: as many ids as the highest one the vocabulary or the added
 * tokens name, each vocabulary entry's text under its id. */
static int hf_vocab(tok_tokenizer *t, const cJSON *vocab, const cJSON *added, const char *path,
                    char *msg, size_t msg_len)
{
    const cJSON *it;
    long max_id = -1;
    size_t n_vocab = 0;
    cJSON_ArrayForEach (it, vocab) {
        long id = hf_id(it);
        if (id < 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: vocab entry \"%.100s\" has no id from 0 to %d", path, it->string,
                           TOK_MAX_ID - 1);
        max_id = id > max_id ? id : max_id;
        n_vocab++;
    }
    cJSON_ArrayForEach (it, added) {
        long id = hf_id(cJSON_GetObjectItemCaseSensitive(it, "id"));
        if (id < 0 || !mf_json_str(it, "content"))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: an added token without content or an id from 0 to %d", path,
                           TOK_MAX_ID - 1);
        max_id = id > max_id ? id : max_id;
    }
    if (max_id < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: the vocabulary is empty", path);
    if (!tok_alloc_tokens(t, (size_t)max_id + 1) || !tok_vocab_init(t, n_vocab))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    cJSON_ArrayForEach (it, vocab) {
        long id = hf_id(it);
        if (t->has_text[id])
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: id %ld is given to both \"%.*s\" and \"%.100s\"", path, id,
                           (int)t->text_len[id], t->arena + t->text_off[id], it->string);
        if (!tok_set_token(t, (int32_t)id, it->string, strlen(it->string), TT_NORMAL))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
        tok_vocab_insert(t, (int32_t)id, false);
    }
    return QL_OK;
}

/* The added tokens (hf_vocab checked their ids and content): an id the
 * vocabulary lacks gets the added text; every one is CONTROL when special,
 * USER otherwise. */
static int hf_added(tok_tokenizer *t, const cJSON *added, const char *path, char *msg,
                    size_t msg_len)
{
    const cJSON *it;
    size_t added_cap = 0;
    cJSON_ArrayForEach (it, added) {
        tok_added a = {0};
        const char *content = mf_json_str(it, "content");
        a.id = (int32_t)hf_id(cJSON_GetObjectItemCaseSensitive(it, "id"));
        a.len = (uint32_t)strlen(content);
        a.special = mf_json_bool(it, "special", false);
        a.lstrip = mf_json_bool(it, "lstrip", false);
        a.rstrip = mf_json_bool(it, "rstrip", false);
        a.single_word = mf_json_bool(it, "single_word", false);
        uint8_t type_of = a.special ? TT_CONTROL : TT_USER;
        bool ok = t->has_text[a.id] || tok_set_token(t, a.id, content, a.len, type_of);
        t->type[a.id] = type_of;
        if (!ok || !tok_add_added(t, &added_cap, &a, content))
            return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    }
    return QL_OK;
}

/* The two halves of a merge written "a b" (one space; tokenizers before
 * 0.20) or [a, b]; false when it is neither. */
static bool hf_merge_halves(const cJSON *it, const char **a, size_t *la, const char **b, size_t *lb)
{
    if (cJSON_IsString(it)) {
        const char *space = strchr(it->valuestring, ' ');
        if (!space || strchr(space + 1, ' '))
            return false;
        *a = it->valuestring;
        *la = (size_t)(space - *a);
        *b = space + 1;
        *lb = strlen(*b);
        return true;
    }
    if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
        cJSON_IsString(cJSON_GetArrayItem(it, 0)) && cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
        *a = cJSON_GetArrayItem(it, 0)->valuestring;
        *b = cJSON_GetArrayItem(it, 1)->valuestring;
        *la = strlen(*a);
        *lb = strlen(*b);
        return true;
    }
    return false;
}

/* model.merges, ranked by their order. */
static int hf_merges(tok_tokenizer *t, const cJSON *merges, const char *path, char *msg,
                     size_t msg_len)
{
    if (!tok_merges_init(t, (size_t)cJSON_GetArraySize(merges)))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    uint32_t rank = 0;
    char *buf = NULL;
    size_t buf_cap = 0;
    int rc = QL_OK;
    const cJSON *it;
    cJSON_ArrayForEach (it, merges) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (!hf_merge_halves(it, &a, &la, &b, &lb)) {
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: merge %u is neither \"a b\" (one space) nor [\"a\", \"b\"]", path,
                         rank);
            break;
        }
        rc = tok_add_merge(t, a, la, b, lb, rank++, &buf, &buf_cap, path, msg, msg_len);
        if (rc)
            break;
    }
    free(buf);
    return rc;
}

/* Which kind of BPE the normalizer, pre-tokenizer and model options make
 * this (byte-level or sentencepiece-style, never both), its decoder's
 * space stripping, its <unk>. */
static int hf_family(tok_tokenizer *t, const cJSON *root, const cJSON *model, const char *path,
                     char *msg, size_t msg_len)
{
    hf_kind k = {0};
    int rc = hf_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), &k, path, msg,
                           msg_len);
    if (!rc)
        rc = hf_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), &k, path,
                              msg, msg_len);
    if (rc)
        return rc;
    t->byte_fallback = mf_json_bool(model, "byte_fallback", false);
    t->fuse_unk = mf_json_bool(model, "fuse_unk", false);
    t->ignore_merges = mf_json_bool(model, "ignore_merges", false);
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
    const char *unk = mf_json_str(model, "unk_token");
    if (unk) {
        t->unk = tok_vocab_find(t, unk, strlen(unk));
        if (t->unk < 0)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: unk_token \"%.100s\" is not in the vocabulary", path, unk);
    }
    return QL_OK;
}

/* BOS and EOS: tokenizer_config.json names them; the post-processor's
 * template says whether BOS is added when the config does not. */
static int hf_bos_eos(tok_tokenizer *t, const cJSON *root, const cJSON *cfg, const char *path,
                      const char *cfg_path, char *msg, size_t msg_len)
{
    const cJSON *tmpl = find_template(cJSON_GetObjectItemCaseSensitive(root, "post_processor"));
    const cJSON *first = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(tmpl, "single"), 0);
    const char *tmpl_name =
        mf_json_str(cJSON_GetObjectItemCaseSensitive(first, "SpecialToken"), "id");
    int32_t tmpl_id = -1;
    if (tmpl_name) {
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(tmpl, "special_tokens"), tmpl_name);
        long id = hf_id(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(sp, "ids"), 0));
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
    return QL_OK;
}

static int hf_build(tok_tokenizer *t, const cJSON *root, const cJSON *cfg, const char *path,
                    const char *cfg_path, char *msg, size_t msg_len)
{
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: no \"model\" object", path);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    int rc = hf_check_model(root, model, path, msg, msg_len);
    if (!rc)
        rc = hf_vocab(t, cJSON_GetObjectItemCaseSensitive(model, "vocab"), added, path, msg,
                      msg_len);
    if (!rc)
        rc = hf_added(t, added, path, msg, msg_len);
    if (!rc)
        rc = hf_merges(t, cJSON_GetObjectItemCaseSensitive(model, "merges"), path, msg, msg_len);
    if (!rc)
        rc = hf_family(t, root, model, path, msg, msg_len);
    if (!rc)
        rc = hf_bos_eos(t, root, cfg, path, cfg_path, msg, msg_len);
    if (rc)
        return rc;
    if (!tok_finish(t, false))
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    char name[96] = "";
    if (t->family == FAMILY_BYTE_LEVEL)
        tok_steps_name(t->steps, t->n_steps, name, sizeof name);
    tok_write_description(t, name);
    return QL_OK;
}

/* The tokenizer from the parsed files (both trees are deleted here). */
static int hf_load(tok_tokenizer **out, cJSON *root, cJSON *cfg, const char *path,
                   const char *cfg_path, char *msg, size_t msg_len)
{
    tok_tokenizer *t = tok_new(path);
    int rc = t ? hf_build(t, root, cfg, path, cfg_path, msg, msg_len)
               : ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
    cJSON_Delete(root);
    cJSON_Delete(cfg);
    if (rc) {
        tok_free(t);
        return rc;
    }
    *out = t;
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
    int rc = mf_read_json(tokenizer_json, 0, &root, msg, msg_len);
    if (!rc && config_path)
        rc = mf_read_json(config_path, 0, &cfg, msg, msg_len);
    if (rc) {
        cJSON_Delete(root);
        return rc;
    }
    return hf_load(out, root, cfg, tokenizer_json, config_path, msg, msg_len);
}

int tok_from_hf_json(tok_tokenizer **out, const char *json, size_t len, const char *source,
                     char *msg, size_t msg_len)
{
    if (out)
        *out = NULL;
    if (!out || (!json && len) || !source)
        return ql_fail(msg, msg_len, QL_EINVAL, "tok_from_hf_json: no output, text or source");
    cJSON *root;
    int rc = mf_parse_json(json ? json : "", len, source, &root, msg, msg_len);
    if (rc)
        return rc;
    return hf_load(out, root, NULL, source, NULL, msg, msg_len);
}

/*
 * model.c - eng_model_load, the one way in: a folder goes to the Hugging
 * Face loader (load_hf.c), a file to the GGUF loader (load_gguf.c), both
 * with --quant and --dtype read first (loader.c); then the checks that
 * hold for every format, the chat templates (chat_template.c), and the
 * walks over a loaded model (each tensor, its bytes, eng_model_free).
 * eng_tokenizer_load is the other way in, for a model's tokenizer alone.
 *
 * Nothing here computes: the forward pass lives in engine/runtime/. A
 * model owns its tensors, its tokenizer and the mapped files they borrow
 * from; eng_model_free releases all of it.
 */
#include "internal/model_internal.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *eng_arch_name(eng_arch a)
{
    switch (a) {
    case ENG_ARCH_LLAMA: return "llama";
    case ENG_ARCH_MISTRAL: return "mistral";
    case ENG_ARCH_QWEN2: return "qwen2";
    case ENG_ARCH_QWEN3: return "qwen3";
    case ENG_ARCH_PHI3: return "phi3";
    case ENG_ARCH_GEMMA2: return "gemma2";
    case ENG_ARCH_GEMMA3: return "gemma3";
    case ENG_ARCH_QWEN2_MOE: return "qwen2moe";
    case ENG_ARCH_QWEN3_MOE: return "qwen3moe";
    case ENG_ARCH_MIXTRAL: return "mixtral";
    case ENG_ARCH_GPT_OSS: return "gpt-oss";
    case ENG_ARCH_SMOLLM3: return "smollm3";
    case ENG_ARCH_OLMO3: return "olmo3";
    case ENG_ARCH_MINISTRAL3: return "ministral3";
    case ENG_ARCH_GEMMA4: return "gemma4";
    case ENG_ARCH_QWEN3_5: return "qwen3_5";
    }
    return "unknown";
}

/* What the linear layers hold, for messages and /info. */
static void describe_quant(eng_model *m)
{
    const qtensor *w = &m->layers[0].wq;
    if (w->kind == QT_AFFINE && w->group_size == w->cols)
        snprintf(m->quant, sizeof m->quant, "int%d-channel", w->bits);
    else if (w->kind == QT_AFFINE)
        snprintf(m->quant, sizeof m->quant, "int%d-g%d", w->bits, w->group_size);
    else if (w->kind == QT_FP8) /* the block and the scales' stored dtype */
        snprintf(m->quant, sizeof m->quant, "fp8-b%dx%d-%s", w->block_rows, w->block_cols,
                 qt_scale_dtype_name(w->scale_dtype));
    else if (w->kind == QT_GPTQ) /* the zero convention, v1 (stored z - 1) or v2 */
        snprintf(m->quant, sizeof m->quant, "gptq-int%d-g%d-%s", w->bits, w->group_size,
                 w->gptq_zero_offset ? "v1" : "v2");
    else if (w->kind == QT_AWQ)
        snprintf(m->quant, sizeof m->quant, "awq-int%d-g%d", w->bits, w->group_size);
    else if (w->kind == QT_CT_INT) /* bits, the scale's block and dtype, zero points or none */
        snprintf(m->quant, sizeof m->quant, "ct-int%d-b%dx%d-%s-%s", w->bits, w->block_rows,
                 w->block_cols, qt_scale_dtype_name(w->scale_dtype),
                 w->block_zeros ? "asym" : "sym");
    else if (w->kind == QT_NF4 || w->kind == QT_FP4)
        snprintf(m->quant, sizeof m->quant, "%s%s-b%d", qt_kind_name(w->kind),
                 w->nested ? "-dq" : "", w->blocksize);
    else
        snprintf(m->quant, sizeof m->quant, "%s", qt_kind_name(w->kind));
}

/* id as one more token that ends an answer (eng_config.eog_token_ids),
 * unless it is the eos, already there, or past the room. */
static void add_end_token(eng_config *c, int32_t id)
{
    if (id < 0 || id == c->eos_token_id || c->n_eog >= ENG_MAX_EOG)
        return;
    for (int32_t i = 0; i < c->n_eog; i++)
        if (c->eog_token_ids[i] == id)
            return;
    c->eog_token_ids[c->n_eog++] = id;
}

/* Every id of j's eos_token_id (a number or a list). */
static void add_json_ends(eng_config *c, const cJSON *j)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "eos_token_id");
    const cJSON *e;
    double x;
    if (mf_json_number(v, &x) && x >= 0 && x < 1e9)
        add_end_token(c, (int32_t)x);
    if (!cJSON_IsArray(v))
        return;
    cJSON_ArrayForEach (e, v)
        if (mf_json_number(e, &x) && x >= 0 && x < 1e9)
            add_end_token(c, (int32_t)x);
}

/*
 * The tokens besides eos that end an answer, as transformers' generate
 * and llama.cpp stop on them: a folder's config.json and
 * generation_config.json eos_token_id lists (Qwen3's <|im_end|> and
 * <|endoftext|>; GPT-OSS's <|return|>, <|endoftext|>, <|call|>); a GGUF's
 * tokenizer.ggml.eot_token_id and eom_token_id; and in a harmony
 * vocabulary <|return|> and <|call|>, which llama.cpp ends GPT-OSS's
 * turns on. A generation_config.json that is not JSON is refused by name.
 */
static int load_end_tokens(const model_loader *L, char *msg, size_t msg_len)
{
    eng_config *c = &L->m->cfg;
    c->n_eog = 0;
    if (L->m->gguf) {
        const char *keys[] = {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
        for (size_t i = 0; i < 2; i++) {
            const gguf_kv *kv = gguf_find_kv(L->m->gguf, keys[i]);
            if (kv && kv->type != GGUF_ARRAY && kv->type != GGUF_STRING && kv->i >= 0 &&
                kv->i < c->vocab_size)
                add_end_token(c, (int32_t)kv->i);
        }
    } else {
        const char *files[] = {"config.json", "generation_config.json"};
        for (size_t i = 0; i < 2; i++) {
            char path[8192];
            snprintf(path, sizeof path, "%s/%s", L->dir, files[i]);
            struct stat sb;
            if (stat(path, &sb) != 0)
                continue;
            cJSON *j;
            int rc = mf_read_json(path, (size_t)16 << 20, &j, msg, msg_len);
            if (rc != QL_OK)
                return rc;
            add_json_ends(c, j);
            cJSON_Delete(j);
        }
    }
    int32_t ret = tok_token_id(L->m->tok, "<|return|>", 10);
    int32_t call = tok_token_id(L->m->tok, "<|call|>", 8);
    if (ret >= 0 && call >= 0) {
        add_end_token(c, ret);
        add_end_token(c, call);
    }
    return QL_OK;
}

/* The chat templates: --chat-template's file replaces both of the model's;
 * else the folder's or the GGUF's own. */
static int load_chat_templates(const model_loader *L, char *msg, size_t msg_len)
{
    eng_model *m = L->m;
    if (L->o->chat_template)
        return eng_chat_template_read_file(L->o->chat_template, &m->chat_template, msg, msg_len);
    if (m->gguf)
        return model_chat_templates_from_gguf(m->gguf, &m->chat_template,
                                              &m->chat_template_tool_use, msg, msg_len);
    return eng_chat_templates_from_folder(L->dir, &m->chat_template, &m->chat_template_tool_use,
                                          msg, msg_len);
}

int eng_model_load(eng_model *m, const eng_load_opts *o, char *msg, size_t msg_len)
{
    memset(m, 0, sizeof *m);
    model_loader L = {.o = o, .m = m};
    int rc = model_parse_opts(&L, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    struct stat sb;
    if (!o->path || stat(o->path, &sb) != 0)
        return ql_fail(msg, msg_len, QL_EIO, "%s: %s", o->path ? o->path : "(no model path)",
                       o->path ? strerror(errno) : "give --model");
    if (S_ISDIR(sb.st_mode)) {
        snprintf(L.dir, sizeof L.dir, "%s", o->path);
        rc = model_load_hf(&L, msg, msg_len);
    } else {
        rc = model_load_gguf(&L, msg, msg_len);
    }
    if (rc == QL_OK && tok_vocab_size(m->tok) > (size_t)m->cfg.vocab_size)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "%s: the tokenizer has %zu tokens but the model embeds only %d", o->path,
                     tok_vocab_size(m->tok), m->cfg.vocab_size);
    if (rc != QL_OK) {
        eng_model_free(m);
        return rc;
    }
    rc = load_chat_templates(&L, msg, msg_len);
    if (rc == QL_OK)
        rc = load_end_tokens(&L, msg, msg_len);
    if (rc != QL_OK) {
        eng_model_free(m);
        return rc;
    }
    describe_quant(m);
    return QL_OK;
}

int eng_tokenizer_load(tok_tokenizer **out, const char *path, char *msg, size_t msg_len)
{
    *out = NULL;
    struct stat sb;
    if (!path || stat(path, &sb) != 0)
        return ql_fail(msg, msg_len, QL_EIO, "%s: %s", path ? path : "(no model path)",
                       path ? strerror(errno) : "give --model");
    if (S_ISDIR(sb.st_mode))
        return model_folder_tokenizer(path, out, msg, msg_len);
    /* the metadata only: the tensor data stays unread in the mapping, and
     * a vocabulary-only file (no tensors, as llama.cpp's ggml-vocab-*.gguf)
     * is a GGUF like any other */
    gguf_file f;
    int rc = gguf_open(&f, path, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = tok_from_gguf(out, &f, msg, msg_len);
    gguf_close(&f);
    return rc;
}

void eng_model_each_tensor(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx)
{
    const qtensor *top[] = {&m->embed,        &m->norm,        &m->lm_head,
                            &m->g4.ple_embed, &m->g4.ple_proj, &m->g4.ple_norm};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++)
        if (top[i]->rows)
            fn(top[i], ctx);
    model_layers_each(m, fn, ctx);
    model_mtp_each(m, fn, ctx);
}

static void add_bytes(const qtensor *t, void *total)
{
    *(size_t *)total += qt_nbytes(t);
}

size_t eng_model_weight_bytes(const eng_model *m)
{
    size_t n = 0;
    eng_model_each_tensor(m, add_bytes, &n);
    return n;
}

void eng_model_free(eng_model *m)
{
    qt_free(&m->embed);
    qt_free(&m->norm);
    qt_free(&m->lm_head);
    qt_free(&m->g4.ple_embed);
    qt_free(&m->g4.ple_proj);
    qt_free(&m->g4.ple_norm);
    model_layers_free(m);
    free(m->layers);
    model_mtp_free(m);
    if (m->tok)
        tok_free(m->tok);
    for (size_t i = 0; i < m->n_shards; i++)
        st_close(&m->shards[i]);
    free(m->shards);
    if (m->gguf) {
        gguf_close(m->gguf);
        free(m->gguf);
    }
    free(m->chat_template);
    free(m->chat_template_tool_use);
    memset(m, 0, sizeof *m);
}

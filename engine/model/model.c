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
    else if (w->kind == QT_NF4 || w->kind == QT_FP4)
        snprintf(m->quant, sizeof m->quant, "%s%s-b%d", qt_kind_name(w->kind),
                 w->nested ? "-dq" : "", w->blocksize);
    else
        snprintf(m->quant, sizeof m->quant, "%s", qt_kind_name(w->kind));
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
    const qtensor *top[] = {&m->embed, &m->norm, &m->lm_head};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++)
        if (top[i]->rows)
            fn(top[i], ctx);
    model_layers_each(m, fn, ctx);
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
    model_layers_free(m);
    free(m->layers);
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

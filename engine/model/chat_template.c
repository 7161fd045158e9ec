/*
 * chat_template.c - where a model's chat templates come from: the source
 * text only (template/ compiles and renders it). It offers
 * eng_chat_template_read_file and eng_chat_templates_from_folder
 * (model.h) and model_chat_templates_from_gguf (model_internal.h).
 *
 * The places are the ones transformers and llama.cpp read, in their order:
 *   - a Hugging Face folder (a model's, or an adapter's): chat_template.jinja
 *     beside tokenizer_config.json wins over the config's "chat_template",
 *     as transformers' loader does (PreTrainedTokenizerBase._from_pretrained
 *     sets init_kwargs["chat_template"] from the file, "clobbering" the
 *     config's; tests/test_tokenization_common.py
 *     test_chat_template_file_priority pins it). Named templates then come
 *     from additional_chat_templates/<name>.jinja (CHAT_TEMPLATE_DIR), of
 *     which we keep "tool_use". Without the file, the config's
 *     "chat_template" is a string, or a list of {"name", "template"} of which
 *     "default" and "tool_use" are kept (transformers turns the list into a
 *     dict by name and picks "default", or "tool_use" when tools are given);
 *   - a GGUF file: tokenizer.chat_template, and tokenizer.chat_template.
 *     tool_use (llama.cpp's converter writes named templates as
 *     tokenizer.chat_template.<name>).
 *
 * Every template is checked the same way: at most
 * ENG_CHAT_TEMPLATE_MAX_BYTES, no NUL byte, well-formed UTF-8; refused by
 * the place it came from. The strings returned are the caller's (free()).
 * An adapter's folder is read with no symlink followed
 * (eng_chat_templates_at, mf_open_in). It touches only the files it is
 * pointed at.
 */
#include "internal/model_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* tokenizer_config.json carries every added token; a big vocabulary's is a
 * few MiB (Qwen2.5: 7 MiB with its template). Past this it is not one. */
#define TOKENIZER_CONFIG_MAX_BYTES ((size_t)64 << 20)

/* A template's text as the caller's string, after the checks every source
 * shares; where names the source ("x/chat_template.jinja",
 * "x/tokenizer_config.json: \"chat_template\"", "x.gguf: metadata ..."). */
static int keep_template(const char *where, const char *text, size_t len, char **out, char *msg,
                         size_t msg_len)
{
    *out = NULL;
    if (len > ENG_CHAT_TEMPLATE_MAX_BYTES)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the chat template is %zu bytes; more than %zu is not a chat template",
                       where, len, (size_t)ENG_CHAT_TEMPLATE_MAX_BYTES);
    if (memchr(text, 0, len))
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: the chat template holds a NUL byte at %zu",
                       where, (size_t)((const char *)memchr(text, 0, len) - text));
    long bad = ql_utf8_invalid_at((const uint8_t *)text, len);
    if (bad >= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the chat template is not valid UTF-8 (byte %ld)", where, bad);
    char *s = malloc(len + 1);
    if (!s)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", where);
    memcpy(s, text, len);
    s[len] = 0;
    *out = s;
    return QL_OK;
}

int eng_chat_template_read_file(const char *path, char **out, char *msg, size_t msg_len)
{
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return ql_fail(msg, msg_len, errno == ENOENT ? QL_ENOTFOUND : QL_EIO,
                       "chat template %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return ql_fail(msg, msg_len, QL_EINVAL, "chat template %s: not a file", path);
    char *buf;
    size_t len;
    int rc = mf_read_file(path, ENG_CHAT_TEMPLATE_MAX_BYTES, &buf, &len, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = keep_template(path, buf, len, out, msg, msg_len);
    free(buf);
    return rc;
}

/* tokenizer_config.json's "chat_template": a string, or a list of named
 * templates; null or absent: none. */
static int config_templates(const char *path, const cJSON *ct, char **tmpl, char **tool_use,
                            char *msg, size_t msg_len)
{
    char where[4400];
    if (!ct || cJSON_IsNull(ct))
        return QL_OK;
    if (cJSON_IsString(ct)) {
        snprintf(where, sizeof where, "%s: \"chat_template\"", path);
        return keep_template(where, ct->valuestring, strlen(ct->valuestring), tmpl, msg, msg_len);
    }
    if (!cJSON_IsArray(ct))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: \"chat_template\" is neither a string nor a list of {\"name\", "
                       "\"template\"}",
                       path);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach (e, ct) {
        const char *name = mf_json_str(e, "name"), *text = mf_json_str(e, "template");
        if (!name || !text)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: \"chat_template\"[%d] is not {\"name\": string, \"template\": "
                           "string}",
                           path, i);
        char **slot = strcmp(name, "default") == 0    ? tmpl
                      : strcmp(name, "tool_use") == 0 ? tool_use
                                                      : NULL;
        i++;
        if (!slot)
            continue; /* another named template (e.g. "rag"): not one we serve */
        if (*slot)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"chat_template\" names \"%s\" twice",
                           path, name);
        snprintf(where, sizeof where, "%s: \"chat_template\" \"%.16s\"", path, name);
        int rc = keep_template(where, text, strlen(text), slot, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    return QL_OK;
}

/* The template file rel of the folder dirfd (dir in messages), opened as
 * `how` says (mf_open_in); QL_ENOTFOUND when it is not there. */
static int template_in(int dirfd, const char *dir, const char *rel, int how, char **out, char *msg,
                       size_t msg_len)
{
    char *buf;
    size_t len;
    int rc =
        mf_read_in(dirfd, dir, rel, how, ENG_CHAT_TEMPLATE_MAX_BYTES, &buf, &len, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    char where[4400];
    snprintf(where, sizeof where, "%s/%s", dir, rel);
    rc = keep_template(where, buf, len, out, msg, msg_len);
    free(buf);
    return rc;
}

/* tokenizer_config.json's templates, when the folder has one. */
static int tokenizer_config_templates(int dirfd, const char *dir, int how, char **tmpl,
                                      char **tool_use, char *msg, size_t msg_len)
{
    char *text, where[4200];
    size_t len;
    int rc = mf_read_in(dirfd, dir, "tokenizer_config.json", how, TOKENIZER_CONFIG_MAX_BYTES, &text,
                        &len, msg, msg_len);
    if (rc != QL_OK)
        return rc == QL_ENOTFOUND ? QL_OK : rc;
    snprintf(where, sizeof where, "%s/tokenizer_config.json", dir);
    cJSON *j;
    rc = mf_parse_json(text, len, where, &j, msg, msg_len);
    free(text);
    if (rc != QL_OK)
        return rc;
    rc = config_templates(where, cJSON_GetObjectItemCaseSensitive(j, "chat_template"), tmpl,
                          tool_use, msg, msg_len);
    cJSON_Delete(j);
    return rc;
}

int eng_chat_templates_at(int dirfd, const char *dir, bool no_links, char **tmpl, char **tool_use,
                          char *msg, size_t msg_len)
{
    *tmpl = *tool_use = NULL;
    int how = no_links ? MF_NO_LINKS : 0;
    /* the file, when there, wins; named ones then come from
     * additional_chat_templates/ */
    int rc = template_in(dirfd, dir, "chat_template.jinja", how, tmpl, msg, msg_len);
    if (rc == QL_OK) {
        rc = template_in(dirfd, dir, "additional_chat_templates/tool_use.jinja", how, tool_use, msg,
                         msg_len);
        if (rc == QL_ENOTFOUND)
            rc = QL_OK;
    } else if (rc == QL_ENOTFOUND) {
        rc = tokenizer_config_templates(dirfd, dir, how, tmpl, tool_use, msg, msg_len);
    }
    if (rc != QL_OK) {
        free(*tmpl);
        free(*tool_use);
        *tmpl = *tool_use = NULL;
    } else if (msg && msg_len) {
        msg[0] = 0; /* a file that is not there said so on the way */
    }
    return rc;
}

int eng_chat_templates_from_folder(const char *dir, char **tmpl, char **tool_use, char *msg,
                                   size_t msg_len)
{
    *tmpl = *tool_use = NULL;
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0)
        return QL_OK; /* no folder (a GGUF file's path): no templates from one */
    int rc = eng_chat_templates_at(dirfd, dir, false, tmpl, tool_use, msg, msg_len);
    close(dirfd);
    return rc;
}

/* The string metadata at key into *out; absent: *out stays NULL. */
static int gguf_template(const gguf_file *f, const char *key, char **out, char *msg, size_t msg_len)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv)
        return QL_OK;
    char where[4200];
    snprintf(where, sizeof where, "%s: metadata %s", f->path, key);
    if (kv->type != GGUF_STRING)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s is not a string", where);
    if (kv->str.len > ENG_CHAT_TEMPLATE_MAX_BYTES)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: the chat template is %llu bytes; more than %zu is not a chat "
                       "template",
                       where, (unsigned long long)kv->str.len, (size_t)ENG_CHAT_TEMPLATE_MAX_BYTES);
    return keep_template(where, kv->str.ptr, (size_t)kv->str.len, out, msg, msg_len);
}

int model_chat_templates_from_gguf(const gguf_file *f, char **tmpl, char **tool_use, char *msg,
                                   size_t msg_len)
{
    *tmpl = *tool_use = NULL;
    int rc = gguf_template(f, "tokenizer.chat_template", tmpl, msg, msg_len);
    if (rc == QL_OK)
        rc = gguf_template(f, "tokenizer.chat_template.tool_use", tool_use, msg, msg_len);
    if (rc != QL_OK) {
        free(*tmpl);
        *tmpl = NULL;
    }
    return rc;
}

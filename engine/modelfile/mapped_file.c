/*
 * mapped_file.c - how engine/ reads files. Model files are read through one
 * read-only mapping, so weights can be used where they lie and the page
 * cache is shared between processes serving the same model; every reader
 * validates offsets against the mapped length before it dereferences
 * anything. The small JSON files beside them (config.json, tokenizer.json,
 * the shard index) are read whole and parsed by one function.
 *
 * It offers mf_map_file, mf_read_json and mf_path_base (modelfile.h). It
 * owns nothing once a call returns: the mapping and the cJSON tree are the
 * caller's to release (munmap, cJSON_Delete). It touches only the file it
 * is named.
 */
#include "modelfile.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int mf_map_file(const char *path, size_t min_len, const char *format, uint8_t **map, size_t *len,
                char *msg, size_t msg_len)
{
    *map = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return ql_fail(msg, msg_len, QL_EIO, "%s: not a regular file", path);
    }
    if ((uint64_t)sb.st_size < min_len) {
        close(fd);
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %lld bytes is too short for a %s header (truncated?)", path,
                       (long long)sb.st_size, format);
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot map: %s", path, strerror(errno));
    *map = m;
    *len = (size_t)sb.st_size;
    return QL_OK;
}

int mf_read_file(const char *path, size_t max_bytes, char **out, size_t *out_len, char *msg,
                 size_t msg_len)
{
    *out = NULL;
    *out_len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        /* room for the NUL too */
        if (len + 1 >= cap) {
            size_t grown = cap ? 2 * cap : 65536;
            char *b = grown > cap ? realloc(buf, grown) : NULL;
            if (!b) {
                fclose(f);
                free(buf);
                return ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory reading it", path);
            }
            buf = b;
            cap = grown;
        }
        /* one byte past the limit tells a too-long file without reading
         * the rest */
        size_t want = cap - 1 - len;
        if (max_bytes && want > max_bytes + 1 - len)
            want = max_bytes + 1 - len;
        size_t got = fread(buf + len, 1, want, f);
        len += got;
        if (got == 0)
            break;
        if (max_bytes && len > max_bytes) {
            fclose(f);
            free(buf);
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: larger than %zu bytes", path, max_bytes);
        }
    }
    bool failed = ferror(f);
    fclose(f);
    if (failed) {
        free(buf);
        return ql_fail(msg, msg_len, QL_EIO, "%s: read error", path);
    }
    buf[len] = 0;
    *out = buf;
    *out_len = len;
    return QL_OK;
}

int mf_parse_json(const char *text, size_t len, const char *source, cJSON **root, char *msg,
                  size_t msg_len)
{
    *root = cJSON_ParseWithLength(text, len);
    if (!*root) {
        const char *at = cJSON_GetErrorPtr();
        size_t where = at && at >= text && at <= text + len ? (size_t)(at - text) : len;
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: not valid JSON (it stops making sense at byte %zu of %zu%s)", source,
                       where, len, where + 8 >= len ? ", near its end: truncated?" : "");
    }
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: not a JSON object", source);
    }
    return QL_OK;
}

int mf_read_json(const char *path, size_t max_bytes, cJSON **root, char *msg, size_t msg_len)
{
    *root = NULL;
    char *buf;
    size_t len;
    int rc = mf_read_file(path, max_bytes, &buf, &len, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = mf_parse_json(buf, len, path, root, msg, msg_len);
    free(buf);
    return rc;
}

void mf_path_base(const char *path, char *out, size_t out_len)
{
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    size_t b = n;
    while (b > 0 && path[b - 1] != '/')
        b--;
    snprintf(out, out_len, "%.*s", (int)(n - b), path + b);
}

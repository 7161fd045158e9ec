/*
 * state.c - the registry's journal, so that loaded adapters and the merged
 * configuration survive a restart, and the one check of where an adapter
 * folder may be.
 *
 * The journal is a small JSON document (its format is in lora.h, beside
 * lora_journal). It is written whole after each change, never appended:
 * it holds a few lines per adapter, and a whole file that is swapped in
 * by rename(2) cannot be left half written by a crash or a full disk. The
 * sequence is the usual one for that: write a temporary file in the same
 * folder (rename is atomic only within one file system), fsync it so its
 * bytes are on disk before its name is, rename it over the journal, then
 * fsync the folder so the rename itself is.
 *
 * Reading trusts nothing: every field is checked for its type and range
 * and a bad one is named, since the file may have been edited by hand or
 * written by another version.
 *
 * Adapter folders are opened beneath the adapter directory with no
 * symlink followed (lora_open_dir), since uploaders may write there: a
 * link could lead anywhere the server may read, and a path checked and
 * then opened again could be swapped in between.
 *
 * It offers lora.h's lora_journal_*, lora_open_dir, lora_resolve_dir and lora_list_dir; it owns
 * nothing past a call (a read journal is the caller's); it touches only the files it is named.
 */
#include "lora.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "modelfile.h"

/* A journal larger than this is not one we wrote: each adapter takes a
 * line of a few hundred bytes, so 16 MiB is tens of thousands. */
#define JOURNAL_MAX_BYTES ((size_t)16 << 20)

void lora_journal_free(lora_journal *j)
{
    if (j) {
        free(j->adapters);
        memset(j, 0, sizeof *j);
    }
}

/* --- writing ------------------------------------------------------------------ */

static const char *into_name(qt_kind into)
{
    return ql_name_of(&ql_into_names, (int)lora_into_of(into));
}

/* The document for j (cJSON_Delete it), or NULL when out of memory. */
static cJSON *journal_json(const lora_journal *j)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *adapters = cJSON_AddArrayToObject(root, "adapters");
    cJSON *merged = cJSON_AddArrayToObject(root, "merged");
    bool ok = cJSON_AddNumberToObject(root, "version", LORA_JOURNAL_VERSION) && adapters && merged;
    for (size_t i = 0; ok && i < j->n_adapters; i++) {
        const lora_journal_adapter *a = &j->adapters[i];
        cJSON *o = cJSON_CreateObject();
        ok = o && cJSON_AddItemToArray(adapters, o) &&
             cJSON_AddStringToObject(o, "name", a->name) &&
             cJSON_AddStringToObject(o, "path", a->path) &&
             cJSON_AddNumberToObject(o, "scale", a->scale);
    }
    for (size_t i = 0; ok && i < j->n_merged; i++) {
        const lora_journal_merge *m = &j->merged[i];
        cJSON *o = cJSON_CreateObject();
        const char *into = into_name(m->into);
        ok = o && cJSON_AddItemToArray(merged, o) && cJSON_AddStringToObject(o, "name", m->name) &&
             cJSON_AddNumberToObject(o, "scale", m->scale) &&
             (into ? cJSON_AddStringToObject(o, "into", into) != NULL
                   : cJSON_AddNullToObject(o, "into") != NULL) &&
             cJSON_AddBoolToObject(o, "safe_merge", m->safe_merge);
    }
    if (!ok) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* The folder path is in ("." when it names none), into dir. */
static void folder_of(const char *path, char *dir, size_t dir_len)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, dir_len, ".");
    else if (slash == path)
        snprintf(dir, dir_len, "/");
    else
        snprintf(dir, dir_len, "%.*s", (int)(slash - path), path);
}

/* write(2) all of buf, through short writes and EINTR. */
static bool write_all(int fd, const char *buf, size_t len)
{
    while (len) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        buf += n;
        len -= (size_t)n;
    }
    return true;
}

int lora_journal_write(const char *path, const lora_journal *j, char *msg, size_t msg_len)
{
    cJSON *doc = journal_json(j);
    char *text = doc ? cJSON_Print(doc) : NULL;
    cJSON_Delete(doc);
    if (!text)
        return ql_fail(msg, msg_len, QL_ENOMEM, "state file %s: out of memory", path);
    char tmp[PATH_MAX + 16], dir[PATH_MAX];
    if (strlen(path) >= PATH_MAX) {
        free(text);
        return ql_fail(msg, msg_len, QL_EINVAL, "state file %.200s...: path too long", path);
    }
    snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
    folder_of(path, dir, sizeof dir);
    const char *failed = NULL;
    int err = 0;
    int fd = mkstemp(tmp);
    if (fd < 0) {
        failed = "create a temporary file in its folder";
        err = errno;
    } else {
        size_t len = strlen(text);
        if (!write_all(fd, text, len) || !write_all(fd, "\n", 1))
            failed = "write", err = errno;
        else if (fsync(fd) != 0)
            failed = "fsync", err = errno;
        if (close(fd) != 0 && !failed)
            failed = "close", err = errno;
        if (!failed && rename(tmp, path) != 0)
            failed = "rename the temporary file over it", err = errno;
        if (failed)
            unlink(tmp);
    }
    free(text);
    if (failed)
        return ql_fail(msg, msg_len, QL_EIO, "state file %s: cannot %s: %s", path, failed,
                       strerror(err ? err : EIO));
    /* the rename is durable once the folder is: without this a crash
     * could bring back the old journal (the new one's data is on disk,
     * its name may not be) */
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0) {
        err = errno;
        if (dfd >= 0)
            close(dfd);
        return ql_fail(msg, msg_len, QL_EIO,
                       "state file %s: written, but its folder %s cannot be "
                       "synced: %s",
                       path, dir, strerror(err));
    }
    close(dfd);
    return QL_OK;
}

/* --- reading ------------------------------------------------------------------ */

/* The string at key of entry `what` (a "adapters[2]"), at most cap - 1
 * bytes and not empty, into out. */
static int string_field(const char *path, const char *what, const cJSON *o, const char *key,
                        char *out, size_t cap, char *msg, size_t msg_len)
{
    const char *v = mf_json_str(o, key);
    if (!v || !*v || strlen(v) >= cap)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "state file %s: %s: \"%s\" must be a string of 1 to %zu bytes", path, what,
                       key, cap - 1);
    memcpy(out, v, strlen(v) + 1);
    return QL_OK;
}

/* The scale at key of entry `what`: a finite number a float holds. */
static int scale_field(const char *path, const char *what, const cJSON *o, float *out, char *msg,
                       size_t msg_len)
{
    double d;
    if (!mf_json_number(cJSON_GetObjectItemCaseSensitive(o, "scale"), &d) || fabs(d) > 1e6)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "state file %s: %s: \"scale\" must be a number between -1e6 and 1e6", path,
                       what);
    *out = (float)d;
    return QL_OK;
}

/* The array at key of root, or an error naming it. */
static int array_field(const char *path, const cJSON *root, const char *key, const cJSON **out,
                       char *msg, size_t msg_len)
{
    *out = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!cJSON_IsArray(*out))
        return ql_fail(msg, msg_len, QL_EFORMAT, "state file %s: \"%s\" must be an array", path,
                       key);
    return QL_OK;
}

/* Entry i of the array `list` ("adapters", "merged"): an object whose
 * "name" goes to name (at most cap - 1 bytes) and "scale" to scale; what
 * receives "adapters[2]", for the caller's messages. */
static int entry_fields(const char *path, const char *list, size_t i, const cJSON *o, char *what,
                        size_t what_len, char *name, size_t cap, float *scale, char *msg,
                        size_t msg_len)
{
    snprintf(what, what_len, "%s[%zu]", list, i);
    if (!cJSON_IsObject(o))
        return ql_fail(msg, msg_len, QL_EFORMAT, "state file %s: %s must be an object", path, what);
    int rc = string_field(path, what, o, "name", name, cap, msg, msg_len);
    return rc != QL_OK ? rc : scale_field(path, what, o, scale, msg, msg_len);
}

static int read_adapters(const char *path, const cJSON *list, lora_journal *j, char *msg,
                         size_t msg_len)
{
    size_t n = (size_t)cJSON_GetArraySize(list);
    j->adapters = calloc(n ? n : 1, sizeof *j->adapters);
    if (!j->adapters)
        return ql_fail(msg, msg_len, QL_ENOMEM, "state file %s: out of memory", path);
    const cJSON *o;
    int rc = QL_OK;
    cJSON_ArrayForEach (o, list) {
        lora_journal_adapter *a = &j->adapters[j->n_adapters];
        char what[48];
        if ((rc = entry_fields(path, "adapters", j->n_adapters, o, what, sizeof what, a->name,
                               sizeof a->name, &a->scale, msg, msg_len)) ||
            (rc = string_field(path, what, o, "path", a->path, sizeof a->path, msg, msg_len)))
            return rc;
        for (size_t i = 0; i < j->n_adapters; i++)
            if (strcmp(j->adapters[i].name, a->name) == 0)
                return ql_fail(msg, msg_len, QL_EFORMAT,
                               "state file %s: %s: adapter %s is named twice", path, what, a->name);
        j->n_adapters++;
    }
    return QL_OK;
}

static int read_merged(const char *path, const cJSON *list, lora_journal *j, char *msg,
                       size_t msg_len)
{
    if (cJSON_GetArraySize(list) > ENG_MAX_MERGED)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "state file %s: \"merged\" lists %d adapters; at most %d can be merged",
                       path, cJSON_GetArraySize(list), ENG_MAX_MERGED);
    const cJSON *o;
    int rc;
    cJSON_ArrayForEach (o, list) {
        lora_journal_merge *m = &j->merged[j->n_merged];
        char what[48];
        if ((rc = entry_fields(path, "merged", j->n_merged, o, what, sizeof what, m->name,
                               sizeof m->name, &m->scale, msg, msg_len)))
            return rc;
        const cJSON *into = cJSON_GetObjectItemCaseSensitive(o, "into");
        int choice = cJSON_IsString(into) ? ql_name_parse(&ql_into_names, into->valuestring) : -1;
        m->into = lora_into_kind(choice < 0 ? QL_INTO_OWN : (ql_into)choice);
        char words[64];
        if (choice < 0 && into && !cJSON_IsNull(into))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "state file %s: %s: \"into\" must be null or one of %s", path, what,
                           ql_name_list(&ql_into_names, words, sizeof words));
        const cJSON *safe = cJSON_GetObjectItemCaseSensitive(o, "safe_merge");
        if (safe && !cJSON_IsBool(safe))
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "state file %s: %s: \"safe_merge\" must be true or false", path, what);
        m->safe_merge = !safe || cJSON_IsTrue(safe);
        for (size_t i = 0; i < j->n_merged; i++)
            if (strcmp(j->merged[i].name, m->name) == 0)
                return ql_fail(msg, msg_len, QL_EFORMAT,
                               "state file %s: %s: adapter %s is merged twice", path, what,
                               m->name);
        j->n_merged++;
    }
    return QL_OK;
}

int lora_journal_read(const char *path, lora_journal *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "state file %s: does not exist", path);
    cJSON *root = NULL;
    int rc = mf_read_json(path, JOURNAL_MAX_BYTES, &root, msg, msg_len);
    if (rc != QL_OK) {
        /* mf_read_json names the file; say which file it is */
        char why[512];
        snprintf(why, sizeof why, "%s", msg);
        return ql_fail(msg, msg_len, rc, "state file %s", why);
    }
    int64_t version = 0;
    const cJSON *adapters = NULL, *merged = NULL;
    if (!cJSON_IsObject(root))
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "state file %s: must be a JSON object", path);
    else if (!mf_json_integer(cJSON_GetObjectItemCaseSensitive(root, "version"), 1, INT32_MAX,
                              &version))
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "state file %s: \"version\" must be a positive integer", path);
    else if (version != LORA_JOURNAL_VERSION)
        rc = ql_fail(msg, msg_len, QL_EFORMAT,
                     "state file %s: version %lld; this qlserve reads version %d", path,
                     (long long)version, LORA_JOURNAL_VERSION);
    if (rc == QL_OK)
        rc = array_field(path, root, "adapters", &adapters, msg, msg_len);
    if (rc == QL_OK)
        rc = array_field(path, root, "merged", &merged, msg, msg_len);
    if (rc == QL_OK)
        rc = read_adapters(path, adapters, out, msg, msg_len);
    if (rc == QL_OK)
        rc = read_merged(path, merged, out, msg, msg_len);
    cJSON_Delete(root);
    if (rc != QL_OK)
        lora_journal_free(out);
    return rc;
}

/* --- where adapter folders may be --------------------------------------------- */

/* path's components (a relative path), "." and empty ones left out, joined
 * by single slashes into out ("." when none is left); a ".." is refused. */
static int clean_relative(const char *path, const char *shown, char *out, size_t out_len, char *msg,
                          size_t msg_len)
{
    size_t k = 0;
    out[0] = 0;
    for (const char *p = path; *p;) {
        size_t n = strcspn(p, "/");
        if (n == 2 && p[0] == '.' && p[1] == '.')
            return ql_fail(msg, msg_len, QL_EINVAL, "path %s: \"..\" is not allowed", shown);
        if (n && !(n == 1 && p[0] == '.')) {
            if (k + n + 2 > out_len)
                return ql_fail(msg, msg_len, QL_EINVAL, "path %s is too long", shown);
            if (k)
                out[k++] = '/';
            memcpy(out + k, p, n);
            k += n;
            out[k] = 0;
        }
        p += n;
        while (*p == '/')
            p++;
    }
    if (!k)
        snprintf(out, out_len, ".");
    return QL_OK;
}

int lora_open_dir(const char *root, const char *path, int *fd, char *real, size_t real_len,
                  char *msg, size_t msg_len)
{
    *fd = -1;
    char real_root[PATH_MAX], rel[PATH_MAX];
    if (!realpath(root, real_root))
        return ql_fail(msg, msg_len, QL_EIO, "the adapter directory %s cannot be resolved: %s",
                       root, strerror(errno));
    size_t n = strlen(real_root);
    const char *inside = path;
    if (path[0] == '/') {
        if (strncmp(path, real_root, n) != 0 || (path[n] != '/' && path[n] != 0))
            return ql_fail(msg, msg_len, QL_EINVAL, "path %s is outside the adapter directory",
                           path);
        inside = path + n;
    }
    int rc = clean_relative(inside, path, rel, sizeof rel, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (real && (size_t)snprintf(real, real_len, "%s/%s", real_root, rel) >= real_len)
        return ql_fail(msg, msg_len, QL_EINVAL, "path %s: its resolved path is too long", path);
    if (real && strcmp(rel, ".") == 0)
        snprintf(real, real_len, "%s", real_root);
    /* the root is opened as it resolves now; below it, nothing is followed */
    int root_fd = open(real_root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root_fd < 0)
        return ql_fail(msg, msg_len, QL_EIO, "the adapter directory %s cannot be opened: %s", root,
                       strerror(errno));
    char why[1024];
    rc = mf_open_in(root_fd, real_root, rel, MF_FOLDER | MF_NO_LINKS, fd, why, sizeof why);
    close(root_fd);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "adapter path %s: %s", path, why);
    return QL_OK;
}

int lora_resolve_dir(const char *root, const char *path, char *out, size_t out_len, char *msg,
                     size_t msg_len)
{
    int fd;
    int rc = lora_open_dir(root, path, &fd, out, out_len, msg, msg_len);
    if (rc == QL_OK)
        close(fd);
    return rc;
}

int lora_list_dir(const char *root, char ***names, size_t *n, char *msg, size_t msg_len)
{
    *names = NULL;
    *n = 0;
    DIR *d = opendir(root);
    if (!d)
        return ql_fail(msg, msg_len, QL_EIO, "the adapter directory %s cannot be read: %s", root,
                       strerror(errno));
    size_t cap = 0;
    int rc = QL_OK;
    for (struct dirent *e; rc == QL_OK && (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        /* a folder inside root (no symlink) holding a PEFT config, as a
         * load would open them */
        int dir_fd, config_fd;
        if (lora_open_dir(root, e->d_name, &dir_fd, NULL, 0, NULL, 0) != QL_OK)
            continue;
        bool adapter = mf_open_in(dir_fd, e->d_name, "adapter_config.json", MF_NO_LINKS, &config_fd,
                                  NULL, 0) == QL_OK;
        close(dir_fd);
        if (!adapter)
            continue;
        close(config_fd);
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            char **grown = realloc(*names, cap * sizeof *grown);
            if (!grown) {
                rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
                break;
            }
            *names = grown;
        }
        if (!((*names)[*n] = strdup(e->d_name)))
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        else
            (*n)++;
    }
    closedir(d);
    if (rc != QL_OK) {
        for (size_t i = 0; i < *n; i++)
            free((*names)[i]);
        free(*names);
        *names = NULL;
        *n = 0;
    }
    return rc;
}

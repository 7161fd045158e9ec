/*
 * mapped_file.c - how engine/ reads files. Model files are read through one
 * read-only mapping, so weights can be used where they lie and the page
 * cache is shared between processes serving the same model; every reader
 * validates offsets against the mapped length before it dereferences
 * anything. The small JSON files beside them (config.json, tokenizer.json,
 * the shard index) are read whole and parsed by one function: once read,
 * nothing refers to the file again, so changing it on disk changes nothing.
 *
 * A mapping reads the file as it is now, not as it was at load. A model
 * file rewritten in place under a running server (`cp new.gguf
 * model.gguf`, `truncate`, a training job re-saving into the same folder)
 * would change the weights under the engine, and a read past a truncated
 * file's new end faults (SIGBUS) and kills the process. A file replaced
 * by rename (written elsewhere, `mv` over) is harmless: the mapping holds
 * the old inode. So while the guard runs (mf_guard_start: a server), each
 * mapping holds a Linux read lease on its file (F_SETLEASE F_RDLCK on the
 * read-only descriptor, kept open beside the mapping). When another
 * process opens the file for writing or truncates it, the kernel signals
 * the holder (LEASE_SIGNAL, set with F_SETSIG) and blocks that opener
 * until the lease is released or /proc/sys/fs/lease-break-time (45 s by
 * default) has passed. The handler only wakes the guard thread; the
 * thread copies the file (pread: a short read, never a fault) into fresh
 * anonymous memory and moves that memory onto the mapping's own address
 * (mremap MREMAP_FIXED), which the kernel does atomically under the
 * process's mmap lock: every pointer into the weights stays valid, and
 * engine threads reading meanwhile see the same bytes before and after.
 * Then it releases the lease and the writer goes on. The server keeps the
 * weights it loaded until it restarts, at the price of the model's size
 * in private memory instead of shared page cache; the writer waits for
 * the copy (1 GiB: 3.0 s on a busy 2-core VM). Reading every model into
 * memory at load instead would pay that memory always, twice the model's
 * size during the load (page cache and copy) and the time (1 GiB: 4.6 s
 * against 0.1 ms to map it, same VM), and lose the page cache shared
 * between servers; the guard pays only when a file is rewritten. Where no
 * lease can be had (a file of another user without CAP_LEASE, a
 * filesystem without leases such as NFS, a file already open for writing,
 * a system other than Linux) mf_map_file says so for the file and maps it
 * as before. Adapters need no guard: their files are read whole
 * (mf_read_in, then st_open_copy over the bytes).
 *
 * A folder whose files must not lead out of it (an adapter's, which
 * uploaders may write) is opened once, and its files beneath that
 * descriptor with no symlink followed (mf_open_in; why, below).
 *
 * It offers mf_map_file, mf_unmap_file, mf_guard_start, mf_guard_stop,
 * mf_read_file, mf_open_in, mf_read_in, mf_read_json and mf_path_base
 * (modelfile.h). It owns the guard (its thread, its pipe, the lease-break
 * handler, and each guarded mapping's descriptor); mappings, cJSON trees
 * and mf_open_in's descriptors are the caller's to release (mf_unmap_file,
 * cJSON_Delete, close). It touches only the files it is named, and the
 * process's LEASE_SIGNAL disposition once the guard runs.
 */
#define _GNU_SOURCE /* F_SETLEASE, F_SETSIG, mremap */
#include "modelfile.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* openat2(2) (Linux 5.6): glibc has no wrapper, so the raw call */
#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/openat2.h>)
#include <linux/openat2.h>
#include <sys/syscall.h>
#ifdef SYS_openat2
#define MF_OPENAT2 1
#endif
#endif
#endif
#ifndef MF_OPENAT2
#define MF_OPENAT2 0
#endif

#if defined(__linux__) && defined(F_SETLEASE) && defined(MREMAP_FIXED)
#define MF_LEASES 1
#else
#define MF_LEASES 0
#endif

/* --- the guard ---------------------------------------------------------- */

/* The lease-break signal: a real-time one, so breaks queue rather than
 * merge. Its default action (terminate) never applies: the handler is
 * installed before the first lease is taken and stays. glibc keeps the
 * signals below SIGRTMIN for itself; libuv and the rest of qlserve use no
 * real-time signal; +4 leaves room for a library that takes the first. */
#define LEASE_SIGNAL (SIGRTMIN + 4)

typedef struct guarded_map {
    uint8_t *map; /* the mapping's address, which never changes */
    size_t len;
    int fd;             /* read-only; holds the lease */
    struct stat loaded; /* the file as it was mapped */
    char *path;
    struct guarded_map *next;
} guarded_map;

static struct {
    pthread_mutex_t mu; /* guards running, stopping and maps; held while a
                         * mapping is made, detached or unmapped, so the
                         * thread never moves memory onto a freed range */
    bool running, stopping;
    guarded_map *maps;
    pthread_t thread;
} guard = {.mu = PTHREAD_MUTEX_INITIALIZER};

#if MF_LEASES
/* The pipe the handler wakes the thread through. Made by the first
 * mf_guard_start and kept for the process's life, so a late signal never
 * writes to a descriptor that has since been reused. */
static int guard_wake[2] = {-1, -1};
#endif

/* Take the lease on fd (path's descriptor); false, having said why on
 * stderr, where it cannot be had. */
static bool take_lease(int fd, const char *path)
{
#if MF_LEASES
    if (fcntl(fd, F_SETSIG, LEASE_SIGNAL) == 0 && fcntl(fd, F_SETLEASE, F_RDLCK) == 0)
        return true;
    int err = errno;
    fprintf(stderr,
            "qlserve: warning: model file %s: no read lease (%s, errno %d%s), so the server "
            "cannot notice the file being rewritten: while it runs, replace the file by rename "
            "(write the new one elsewhere, then mv it over), never in place (cp over it, "
            "truncate, re-saving to the same path), which changes its weights or crashes it\n",
            path, strerror(err), err, err == EAGAIN ? ": the file is open for writing" : "");
#else
    (void)fd;
    fprintf(stderr,
            "qlserve: warning: model file %s: no file leases on this system, so the server "
            "cannot notice the file being rewritten: while it runs, replace the file by rename "
            "(write the new one elsewhere, then mv it over), never in place\n",
            path);
#endif
    return false;
}

/* Release the lease fd holds (if any: a writer waiting goes on) and close it. */
static void release_lease(int fd)
{
#if MF_LEASES
    fcntl(fd, F_SETLEASE, F_UNLCK);
#endif
    close(fd);
}

/* Release g's lease and descriptor and free it; its mapping stays. */
static void drop_guard(guarded_map *g)
{
    release_lease(g->fd);
    free(g->path);
    free(g);
}

#if MF_LEASES
static void on_lease_break(int sig, siginfo_t *si, void *ctx)
{
    (void)sig, (void)si, (void)ctx;
    int saved = errno;
    char b = 1;
    /* a full pipe already holds a wake-up */
    ssize_t n = write(guard_wake[1], &b, 1);
    (void)n;
    errno = saved;
}

/* Up to len bytes of fd from offset 0 into out: fewer only when the file
 * has become shorter. */
static size_t read_whole(int fd, uint8_t *out, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, out + got, len - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    return got;
}

/* Whether the file's content may have changed between two fstats: its
 * size or its modification time (which a write or a truncation sets, and
 * a chmod or a new link does not). */
static bool same_content_state(const struct stat *a, const struct stat *b)
{
    return a->st_size == b->st_size && a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
           a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* g's lease is breaking: put a copy of its file under its mapping, at the
 * same address, then let the writer go on. Called with guard.mu held. */
static void detach(guarded_map *g)
{
    double t0 = ql_now_s();
    double mib = (double)g->len / (1 << 20);
    struct stat now;
    uint8_t *copy = mmap(NULL, g->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) {
        fprintf(stderr,
                "qlserve: error: model file %s is being rewritten, and %.1f MiB for a copy of "
                "it cannot be had (%s): the server now serves whatever the file holds and "
                "faults past its end; restart it\n",
                g->path, mib, strerror(errno));
        return;
    }
    size_t got = read_whole(g->fd, copy, g->len);
    /* the lease keeps writers out only for lease-break-time: a copy made
     * after it may hold some of the new bytes */
    bool intact = got == g->len && fstat(g->fd, &now) == 0 && same_content_state(&g->loaded, &now);
    mprotect(copy, g->len, PROT_READ);
    if (mremap(copy, g->len, g->len, MREMAP_MAYMOVE | MREMAP_FIXED, g->map) != g->map) {
        fprintf(stderr,
                "qlserve: error: model file %s is being rewritten, and its copy cannot be put "
                "in its place (%s): the server now serves whatever the file holds and faults "
                "past its end; restart it\n",
                g->path, strerror(errno));
        munmap(copy, g->len);
        return;
    }
    double took = ql_now_s() - t0;
    if (intact)
        fprintf(stderr,
                "qlserve: model file %s is being rewritten; the server keeps the weights it "
                "loaded (copied to memory, %.1f MiB in %.3f s); restart it to load the new "
                "file\n",
                g->path, mib, took);
    else
        fprintf(stderr,
                "qlserve: error: model file %s changed while the server copied it (%.1f MiB in "
                "%.3f s, longer than /proc/sys/fs/lease-break-time let the writer wait): the "
                "weights it serves may mix old and new bytes; restart it\n",
                g->path, mib, took);
}

/* The guard thread: on each wake-up, detach every mapping whose lease is
 * breaking (F_GETLEASE then answers the lease's target, F_UNLCK), and
 * release it. */
static void *guard_main(void *arg)
{
    (void)arg;
    for (;;) {
        char buf[64];
        if (read(guard_wake[0], buf, sizeof buf) < 0 && errno == EINTR)
            continue;
        pthread_mutex_lock(&guard.mu);
        if (guard.stopping) {
            pthread_mutex_unlock(&guard.mu);
            return NULL;
        }
        for (guarded_map **p = &guard.maps; *p;) {
            guarded_map *g = *p;
            if (fcntl(g->fd, F_GETLEASE) == F_RDLCK) {
                p = &g->next;
                continue;
            }
            detach(g);
            *p = g->next;
            drop_guard(g);
        }
        pthread_mutex_unlock(&guard.mu);
    }
}

/* The pipe and the handler, once per process. Called with guard.mu held. */
static int guard_install(char *msg, size_t msg_len)
{
    if (guard_wake[0] >= 0)
        return QL_OK;
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0 || fcntl(p[1], F_SETFL, O_NONBLOCK) != 0)
        return ql_fail(msg, msg_len, QL_EIO, "model file guard: cannot make a pipe: %s",
                       strerror(errno));
    guard_wake[0] = p[0];
    guard_wake[1] = p[1];
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_lease_break;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(LEASE_SIGNAL, &sa, NULL) != 0)
        return ql_fail(msg, msg_len, QL_EIO, "model file guard: cannot handle signal %d: %s",
                       LEASE_SIGNAL, strerror(errno));
    return QL_OK;
}
#endif

int mf_guard_start(char *msg, size_t msg_len)
{
    int rc = QL_OK;
    pthread_mutex_lock(&guard.mu);
#if MF_LEASES
    if (!guard.running) {
        rc = guard_install(msg, msg_len);
        if (rc == QL_OK && pthread_create(&guard.thread, NULL, guard_main, NULL) != 0)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "model file guard: cannot start its thread");
    }
#endif
    /* without leases, running only makes mf_map_file warn */
    if (rc == QL_OK)
        guard.running = true;
    pthread_mutex_unlock(&guard.mu);
    (void)msg, (void)msg_len;
    return rc;
}

void mf_guard_stop(void)
{
    pthread_mutex_lock(&guard.mu);
    bool running = guard.running;
    guard.stopping = true;
    pthread_mutex_unlock(&guard.mu);
    if (!running)
        return;
#if MF_LEASES
    char b = 0;
    ssize_t n = write(guard_wake[1], &b, 1);
    (void)n;
    pthread_join(guard.thread, NULL);
#endif
    pthread_mutex_lock(&guard.mu);
    while (guard.maps) {
        guarded_map *g = guard.maps;
        guard.maps = g->next;
        drop_guard(g);
    }
    guard.running = guard.stopping = false;
    pthread_mutex_unlock(&guard.mu);
}

/* --- mapping ------------------------------------------------------------ */

/* Check fd (path's) and map all of it; *sb receives what fstat said. */
static int map_fd(int fd, const char *path, size_t min_len, const char *format, uint8_t **map,
                  size_t *len, struct stat *sb, char *msg, size_t msg_len)
{
    if (fstat(fd, sb) != 0 || !S_ISREG(sb->st_mode))
        return ql_fail(msg, msg_len, QL_EIO, "%s: not a regular file", path);
    if ((uint64_t)sb->st_size < min_len)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %lld bytes is too short for a %s header (truncated?)", path,
                       (long long)sb->st_size, format);
    void *m = mmap(NULL, (size_t)sb->st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot map: %s", path, strerror(errno));
    *map = m;
    *len = (size_t)sb->st_size;
    return QL_OK;
}

int mf_map_file(const char *path, size_t min_len, const char *format, uint8_t **map, size_t *len,
                char *msg, size_t msg_len)
{
    *map = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot open: %s", path, strerror(errno));
    pthread_mutex_lock(&guard.mu);
    /* the lease before the size and the mapping, so that what is mapped
     * is what the lease protects */
    bool leased = guard.running && take_lease(fd, path);
    struct stat sb;
    int rc = map_fd(fd, path, min_len, format, map, len, &sb, msg, msg_len);
    guarded_map *g = NULL;
    if (rc == QL_OK && leased) {
        g = calloc(1, sizeof *g);
        if (g)
            g->path = strdup(path);
        if (!g || !g->path) {
            free(g);
            g = NULL;
            munmap(*map, *len);
            *map = NULL;
            *len = 0;
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: out of memory", path);
        }
    }
    if (g) {
        *g = (guarded_map){
            .map = *map, .len = *len, .fd = fd, .loaded = sb, .path = g->path, .next = guard.maps};
        guard.maps = g;
    } else if (leased) {
        release_lease(fd);
    } else {
        close(fd);
    }
    pthread_mutex_unlock(&guard.mu);
    return rc;
}

void mf_unmap_file(uint8_t *map, size_t len)
{
    if (!map)
        return;
    pthread_mutex_lock(&guard.mu);
    for (guarded_map **p = &guard.maps; *p; p = &(*p)->next)
        if ((*p)->map == map) {
            guarded_map *g = *p;
            *p = g->next;
            drop_guard(g);
            break;
        }
    munmap(map, len);
    pthread_mutex_unlock(&guard.mu);
}

/* --- reading whole files ------------------------------------------------ */

/* All of fd (path's, for messages) into a malloc'd, NUL-terminated buffer;
 * max_bytes > 0 refuses more, having read one byte past it. */
static int read_fd(int fd, const char *path, size_t max_bytes, char **out, size_t *out_len,
                   char *msg, size_t msg_len)
{
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        /* room for the NUL too */
        if (len + 1 >= cap) {
            size_t grown = cap ? 2 * cap : 65536;
            char *b = grown > cap ? realloc(buf, grown) : NULL;
            if (!b) {
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
        ssize_t got = read(fd, buf + len, want);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            int err = errno;
            free(buf);
            return ql_fail(msg, msg_len, QL_EIO, "%s: read error: %s", path, strerror(err));
        }
        if (got == 0)
            break;
        len += (size_t)got;
        if (max_bytes && len > max_bytes) {
            free(buf);
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: larger than %zu bytes", path, max_bytes);
        }
    }
    buf[len] = 0;
    *out = buf;
    *out_len = len;
    return QL_OK;
}

int mf_read_file(const char *path, size_t max_bytes, char **out, size_t *out_len, char *msg,
                 size_t msg_len)
{
    *out = NULL;
    *out_len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return ql_fail(msg, msg_len, QL_EIO, "%s: cannot open: %s", path, strerror(errno));
    int rc = read_fd(fd, path, max_bytes, out, out_len, msg, msg_len);
    close(fd);
    return rc;
}

/* --- a folder's files, opened beneath it --------------------------------- */

/*
 * Why adapters need this: a folder an uploader may write into (the adapter
 * directory) can hold a symlink named adapter_config.json that leads to
 * any file the server may read, and a check of a path followed by an open
 * of the same path can be beaten by swapping a component in between. So
 * the folder is opened once and everything in it is opened relative to
 * that descriptor, each component with no symlink followed: the kernel
 * resolves each name exactly once, at the open that returns the
 * descriptor the bytes are then read from, and there is no second lookup
 * to race. Hard links cannot be told from the file itself; making one
 * needs the right to read the file (fs.protected_hardlinks), so they lend
 * the uploader nothing.
 */

/* dir/rel's component ending at rel + end could not be opened (errno
 * err): say which and why. at is the folder it was looked up in. */
static int refuse_component(int at, const char *part, const char *dir, const char *rel, size_t end,
                            int err, char *msg, size_t msg_len)
{
    struct stat sb;
    bool link = fstatat(at, part, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(sb.st_mode);
    if (link)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s/%.*s is a symbolic link, which is not followed here (it could lead "
                       "outside %s)",
                       dir, (int)end, rel, dir);
    if (err == ENOENT)
        return ql_fail(msg, msg_len, QL_ENOTFOUND, "%s/%.*s: %s", dir, (int)end, rel,
                       strerror(err));
    if (err == ENOTDIR)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s/%.*s is not a folder", dir, (int)end, rel);
    if (err == EWOULDBLOCK) /* O_NONBLOCK met a lease being broken: mf_open_in waits */
        return ql_fail(msg, msg_len, QL_EBUSY, "%s/%.*s is leased", dir, (int)end, rel);
    return ql_fail(msg, msg_len, QL_EIO, "%s/%.*s cannot be opened: %s", dir, (int)end, rel,
                   strerror(err));
}

/* rel beneath dirfd a component at a time, each opened with O_NOFOLLOW
 * relative to the one before (flags for the last, O_DIRECTORY for the
 * rest): a symlink anywhere is refused, and each name is looked up once. */
static int walk_beneath(int dirfd, const char *dir, const char *rel, int flags, int *out, char *msg,
                        size_t msg_len)
{
    int at = dirfd; /* ours to close once it is not dirfd */
    for (const char *p = rel;;) {
        size_t n = strcspn(p, "/");
        const char *next = p + n;
        while (*next == '/')
            next++;
        bool last = !*next;
        char part[NAME_MAX + 1];
        if (n > NAME_MAX) {
            if (at != dirfd)
                close(at);
            return ql_fail(msg, msg_len, QL_EINVAL, "%s/%s: a name longer than %d bytes", dir, rel,
                           NAME_MAX);
        }
        memcpy(part, p, n);
        part[n] = 0;
        int fd = openat(at, part, (last ? flags : O_RDONLY | O_CLOEXEC | O_DIRECTORY) | O_NOFOLLOW);
        int rc = fd < 0 ? refuse_component(at, part, dir, rel, (size_t)(p - rel) + n, errno, msg,
                                           msg_len)
                        : QL_OK;
        if (at != dirfd)
            close(at);
        if (rc != QL_OK)
            return rc;
        at = fd;
        if (last)
            break;
        p = next;
    }
    *out = at;
    return QL_OK;
}

/* rel may be neither absolute, nor empty, nor hold a ".." component. */
static int check_beneath(const char *dir, const char *rel, char *msg, size_t msg_len)
{
    if (!rel[0] || rel[0] == '/')
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: \"%s\" is not a path inside it", dir, rel);
    for (const char *p = rel; *p;) {
        size_t n = strcspn(p, "/");
        if (n == 2 && p[0] == '.' && p[1] == '.')
            return ql_fail(msg, msg_len, QL_EINVAL, "%s/%s: \"..\" is not allowed", dir, rel);
        p += n;
        while (*p == '/')
            p++;
    }
    return QL_OK;
}

/* rel beneath dirfd with no symlink followed: openat2 where the kernel has
 * it (one call), else the walk; the walk also says why openat2 refused. */
static int open_beneath(int dirfd, const char *dir, const char *rel, int flags, int *out, char *msg,
                        size_t msg_len)
{
    int rc = check_beneath(dir, rel, msg, msg_len);
    if (rc != QL_OK)
        return rc;
#if MF_OPENAT2
    struct open_how how = {.flags = (uint64_t)(flags | O_NOFOLLOW),
                           .resolve =
                               RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    long fd = syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
    if (fd >= 0) {
        *out = (int)fd;
        return QL_OK;
    }
    /* a refusal (ELOOP for a link, ENOENT, ...), or no openat2 here (ENOSYS,
     * or EPERM from a container's seccomp filter): the walk is as safe, and
     * names the component */
#endif
    return walk_beneath(dirfd, dir, rel, flags, out, msg, msg_len);
}

/* rel beneath dirfd as mf_open_in says, with these open flags. */
static int open_in(int dirfd, const char *dir, const char *rel, int how, int flags, int *got,
                   char *msg, size_t msg_len)
{
    if (how & MF_NO_LINKS)
        return open_beneath(dirfd, dir, rel, flags, got, msg, msg_len);
    if ((*got = openat(dirfd, rel, flags)) >= 0)
        return QL_OK;
    int err = errno;
    return ql_fail(msg, msg_len,
                   err == ENOENT        ? QL_ENOTFOUND
                   : err == EWOULDBLOCK ? QL_EBUSY
                                        : QL_EIO,
                   "%s/%s cannot be opened: %s", dir, rel, strerror(err));
}

int mf_open_in(int dirfd, const char *dir, const char *rel, int how, int *fd, char *msg,
               size_t msg_len)
{
    *fd = -1;
    bool folder = how & MF_FOLDER;
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer; it is
     * refused below instead, and reading a regular file ignores the flag.
     * Its one other effect: a file whose lease is being broken answers
     * EWOULDBLOCK where an open would wait for the lease's holder, and only
     * a regular file holds a lease, so then the open is made again without
     * it, and waits as any open would (still with no link followed). */
    int flags = O_RDONLY | O_CLOEXEC | (folder ? O_DIRECTORY : 0);
    int got = -1;
    int rc = open_in(dirfd, dir, rel, how, flags | O_NONBLOCK, &got, msg, msg_len);
    if (rc == QL_EBUSY)
        rc = open_in(dirfd, dir, rel, how, flags, &got, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    struct stat sb;
    if (fstat(got, &sb) != 0 || (folder ? !S_ISDIR(sb.st_mode) : !S_ISREG(sb.st_mode))) {
        close(got);
        return ql_fail(msg, msg_len, QL_EINVAL, "%s/%s is not %s", dir, rel,
                       folder ? "a folder" : "a regular file");
    }
    *fd = got;
    return QL_OK;
}

int mf_read_in(int dirfd, const char *dir, const char *rel, int how, size_t max_bytes, char **out,
               size_t *out_len, char *msg, size_t msg_len)
{
    *out = NULL;
    *out_len = 0;
    int fd;
    int rc = mf_open_in(dirfd, dir, rel, how & ~MF_FOLDER, &fd, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    char path[4352];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    rc = read_fd(fd, path, max_bytes, out, out_len, msg, msg_len);
    close(fd);
    return rc;
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

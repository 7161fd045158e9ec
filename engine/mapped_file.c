/*
 * mapped_file.c - model files are read through one read-only mapping, so
 * weights can be used where they lie and the page cache is shared between
 * processes serving the same model. Every reader validates offsets against
 * the mapped length before it dereferences anything.
 */
#include "engine.h"
#include "engine_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int eng_map_file(const char *path, size_t min_len, const char *format, uint8_t **map, size_t *len,
                 char *msg, size_t msg_len)
{
    *map = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return qt_fail(msg, msg_len, ENG_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return qt_fail(msg, msg_len, ENG_EIO, "%s: not a regular file", path);
    }
    if ((uint64_t)sb.st_size < min_len) {
        close(fd);
        return qt_fail(msg, msg_len, ENG_EFORMAT,
                       "%s: %lld bytes is too short for a %s header (truncated?)", path,
                       (long long)sb.st_size, format);
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return qt_fail(msg, msg_len, ENG_EIO, "%s: cannot map: %s", path, strerror(errno));
    *map = m;
    *len = (size_t)sb.st_size;
    return ENG_OK;
}

/*
 * fuzz_input.h - the parsers under fuzzing read files (they map them), so
 * each input is written to one file per fuzzing process first.
 */
#ifndef QL_FUZZ_INPUT_H
#define QL_FUZZ_INPUT_H

#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

/* Write the input to /tmp/qlserve-fuzz-PID.SUFFIX; its path, or NULL. */
static inline const char *fuzz_input_file(const uint8_t *data, size_t size, const char *suffix)
{
    static char path[64];
    if (!path[0])
        snprintf(path, sizeof path, "/tmp/qlserve-fuzz-%d.%s", (int)getpid(), suffix);
    FILE *f = fopen(path, "wb");
    if (!f)
        return NULL;
    if (size)
        fwrite(data, 1, size, f);
    fclose(f);
    return path;
}

#endif

/*
 * gpu_test_util.h - what the GPU tests of tests/gpu share (header-only,
 * static functions; included by the test_cuda_*.c files only).
 */
#ifndef GPU_TEST_UTIL_H
#define GPU_TEST_UTIL_H

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* QL_GPU_EMULATED=1 (tests/gpu/emu/run.sh, the host emulator): the tests
 * skip their timing and their largest shapes, which take minutes there;
 * every kind, shape and edge case still runs. */
static inline bool emulated(void)
{
    const char *e = getenv("QL_GPU_EMULATED");
    return e && strcmp(e, "1") == 0;
}

#endif /* GPU_TEST_UTIL_H */

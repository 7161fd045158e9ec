/*
 * gpu_test_util.h - what the GPU tests of tests/gpu share (header-only,
 * static functions; included by the test_cuda_*.c files only).
 */
#ifndef GPU_TEST_UTIL_H
#define GPU_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* xorshift64*: the same inputs on every machine, no libc rand(). One
 * stream per test file; rng_seed restarts it. */
static inline uint64_t *rng_stream(void)
{
    static uint64_t state = 0x2545f4914f6cdd1dull;
    return &state;
}

static inline void rng_seed(uint64_t seed)
{
    *rng_stream() = seed * 0x9e3779b97f4a7c15ull + 1;
}

static inline double rng_uniform(void)
{
    uint64_t *s = rng_stream();
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (double)((*s * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

/* Box-Muller on two uniforms. */
static inline double rng_normal(void)
{
    double u1 = rng_uniform(), u2 = rng_uniform();
    return sqrt(-2.0 * log(u1 + 1e-300)) * cos(6.283185307179586 * u2);
}

/* QL_GPU_EMULATED=1 (tests/gpu/emu/run.sh, the host emulator): the tests
 * skip their timing and their largest shapes, which take minutes there;
 * every kind, shape and edge case still runs. */
static inline bool emulated(void)
{
    const char *e = getenv("QL_GPU_EMULATED");
    return e && strcmp(e, "1") == 0;
}

#endif /* GPU_TEST_UTIL_H */

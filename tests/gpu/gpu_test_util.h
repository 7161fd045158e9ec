/*
 * gpu_test_util.h - what the GPU tests of tests/gpu share (header-only,
 * static functions; included by the test_cuda_*.c files only).
 */
#ifndef GPU_TEST_UTIL_H
#define GPU_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"

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

/* Whether qt_quantize can write `kind`: the k-quants have no quantizer
 * yet, so their tensors are random super-blocks (gpu_random_kquant). */
static inline bool gpu_is_kquant(qt_kind kind)
{
    return kind == QT_Q4_K || kind == QT_Q5_K || kind == QT_Q6_K;
}

/* rows x cols (cols a multiple of 256) of random super-blocks of k-quant
 * `kind` into t, as a GGUF file holds them: random bytes (codes, packed
 * sub-block scales and minimums: every 6-bit and 8-bit pattern occurs),
 * then each block's f16 d (and Q4_K/Q5_K's dmin) set to a small value
 * from the stream, so every weight is finite and about a model's size
 * (tests/test_kquant.h does the same for the Criterion tests). Returns
 * qt_from_gguf_blocks' code, msg its sentence. */
static inline int gpu_random_kquant(qtensor *t, qt_kind kind, int64_t rows, int64_t cols, char *msg,
                                    size_t msg_len)
{
    memset(t, 0, sizeof *t);
    if (!gpu_is_kquant(kind) || cols % 256 != 0 || rows < 0) {
        snprintf(msg, msg_len, "gpu_random_kquant: %s %lld x %lld is not a k-quant shape",
                 qt_kind_name(kind), (long long)rows, (long long)cols);
        return QL_EINVAL;
    }
    const size_t bb = qt_traits_table[kind].block_bytes, nb = (size_t)(rows * cols / 256);
    uint8_t *b = malloc(nb * bb + 1);
    if (!b) {
        snprintf(msg, msg_len, "gpu_random_kquant: cannot allocate %zu bytes", nb * bb);
        return QL_ENOMEM;
    }
    for (size_t i = 0; i < nb * bb; i++)
        b[i] = (uint8_t)(rng_uniform() * 256.0);
    for (size_t i = 0; i < nb; i++) {
        uint8_t *blk = b + i * bb;
        const float dscale = kind == QT_Q6_K ? 2e-5f : 1e-4f;
        const uint16_t d = qt_f32_to_f16(dscale * (float)rng_normal());
        const uint16_t dmin = qt_f32_to_f16(1e-4f * fabsf((float)rng_normal()));
        const size_t at = kind == QT_Q6_K ? 208 : 0;
        blk[at] = (uint8_t)(d & 0xff);
        blk[at + 1] = (uint8_t)(d >> 8);
        if (kind != QT_Q6_K) {
            blk[2] = (uint8_t)(dmin & 0xff);
            blk[3] = (uint8_t)(dmin >> 8);
        }
    }
    const int rc = qt_from_gguf_blocks(t, kind, b, nb * bb, rows, cols, msg, msg_len);
    free(b);
    return rc;
}

/* qt_quantize of w (rows x cols) with p, or for a k-quant random
 * super-blocks (w unused): the weights a GPU test multiplies. */
static inline int gpu_make_weight(qtensor *t, const float *w, int64_t rows, int64_t cols,
                                  const qt_quant_params *p, char *msg, size_t msg_len)
{
    if (gpu_is_kquant(p->kind))
        return gpu_random_kquant(t, p->kind, rows, cols, msg, msg_len);
    memset(t, 0, sizeof *t);
    return qt_quantize(t, w, rows, cols, p, msg, msg_len);
}

#endif /* GPU_TEST_UTIL_H */

/*
 * test_kquant.h - random GGUF k-quant tensors for the tests: qt_quantize
 * cannot write Q4_K, Q5_K or Q6_K yet, so a test that needs one builds
 * random super-blocks, as a GGUF file would hold them.
 */
#ifndef QL_TEST_KQUANT_H
#define QL_TEST_KQUANT_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "qtensor.h"
#include "test_util.h"

/* rows x cols (cols a multiple of 256) of random super-blocks of a k-quant
 * kind into t: random bytes (codes, sub-block scales), then each block's
 * f16 d (and Q4_K/Q5_K's dmin) set to a small normal value, so every
 * weight is finite and about a model's size (|w| ~ 0.02). */
static inline void test_random_kquant(qtensor *t, qt_kind kind, int64_t rows, int64_t cols,
                                      uint64_t *rng)
{
    size_t bb = qt_traits_table[kind].block_bytes, nb = (size_t)(rows * cols / 256);
    uint8_t *b = malloc(nb * bb);
    cr_assert(b);
    for (size_t i = 0; i < nb * bb; i++)
        b[i] = (uint8_t)(test_rand(rng) >> 32);
    for (size_t i = 0; i < nb; i++) {
        uint8_t *blk = b + i * bb;
        float dscale = kind == QT_Q6_K ? 2e-5f : 1e-4f;
        uint16_t d = qt_f32_to_f16(dscale * test_normal(rng));
        uint16_t dmin = qt_f32_to_f16(1e-4f * fabsf(test_normal(rng)));
        size_t at = kind == QT_Q6_K ? 208 : 0;
        blk[at] = (uint8_t)(d & 0xff);
        blk[at + 1] = (uint8_t)(d >> 8);
        if (kind != QT_Q6_K) {
            blk[2] = (uint8_t)(dmin & 0xff);
            blk[3] = (uint8_t)(dmin >> 8);
        }
    }
    char msg[256];
    cr_assert_eq(qt_from_gguf_blocks(t, kind, b, nb * bb, rows, cols, msg, sizeof msg), QL_OK, "%s",
                 msg);
    free(b);
}

#endif

/*
 * test_kquant.h - random GGUF tensors of the kinds read in place only:
 * qt_quantize cannot write the k-quants (Q2_K ... Q6_K) or IQ4_NL, IQ4_XS
 * yet, so a test that needs one builds random blocks, as a GGUF file would
 * hold them.
 */
#ifndef QL_TEST_KQUANT_H
#define QL_TEST_KQUANT_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "qtensor.h"
#include "test_util.h"

/* Where a read-in-place kind keeps its f16 super-block scale d and, for
 * the kinds with minimums, its f16 dmin (-1: none), and the size of d
 * that keeps |w| about a model's (~0.02) given its largest sub-block
 * scale times code (Q6_K, IQ4_XS: ~4000; the others: ~50 to ~250). */
typedef struct test_kquant_layout {
    int d_at, dmin_at;
    float dscale;
} test_kquant_layout;

static inline test_kquant_layout test_kquant_layout_of(qt_kind kind)
{
    switch (kind) {
    case QT_Q4_K:
    case QT_Q5_K: return (test_kquant_layout){0, 2, 1e-4f};
    case QT_Q6_K: return (test_kquant_layout){208, -1, 2e-5f};
    case QT_Q2_K: return (test_kquant_layout){80, 82, 1e-4f};
    case QT_Q3_K: return (test_kquant_layout){108, -1, 1e-4f};
    case QT_IQ4_NL: return (test_kquant_layout){0, -1, 1e-4f};
    case QT_IQ4_XS: return (test_kquant_layout){0, -1, 2e-5f};
    default: cr_assert_fail("%s is not a read-in-place GGUF kind", qt_kind_name(kind));
    }
    return (test_kquant_layout){0, -1, 0.0f};
}

/* Whether kind is read in place only (a test makes its tensors here). */
static inline bool test_kquant_is_read_only(qt_kind kind)
{
    return kind == QT_Q4_K || kind == QT_Q5_K || kind == QT_Q6_K || kind == QT_Q2_K ||
           kind == QT_Q3_K || kind == QT_IQ4_NL || kind == QT_IQ4_XS;
}

/* rows x cols (cols a multiple of the kind's block: 256, or 32 for
 * IQ4_NL) of random blocks of a read-in-place kind into t: random bytes
 * (codes, sub-block scales), then each block's f16 d (and dmin) set to a
 * small normal value, so every weight is finite and about a model's size. */
static inline void test_random_kquant(qtensor *t, qt_kind kind, int64_t rows, int64_t cols,
                                      uint64_t *rng)
{
    test_kquant_layout lay = test_kquant_layout_of(kind);
    size_t bb = qt_traits_table[kind].block_bytes;
    size_t nb = (size_t)(rows * cols / qt_traits_table[kind].block_size);
    uint8_t *b = malloc(nb * bb);
    cr_assert(b);
    for (size_t i = 0; i < nb * bb; i++)
        b[i] = (uint8_t)(test_rand(rng) >> 32);
    for (size_t i = 0; i < nb; i++) {
        uint8_t *blk = b + i * bb;
        uint16_t d = qt_f32_to_f16(lay.dscale * test_normal(rng));
        uint16_t dmin = qt_f32_to_f16(1e-4f * fabsf(test_normal(rng)));
        blk[lay.d_at] = (uint8_t)(d & 0xff);
        blk[lay.d_at + 1] = (uint8_t)(d >> 8);
        if (lay.dmin_at >= 0) {
            blk[lay.dmin_at] = (uint8_t)(dmin & 0xff);
            blk[lay.dmin_at + 1] = (uint8_t)(dmin >> 8);
        }
    }
    char msg[256];
    cr_assert_eq(qt_from_gguf_blocks(t, kind, b, nb * bb, rows, cols, msg, sizeof msg), QL_OK, "%s",
                 msg);
    free(b);
}

#endif

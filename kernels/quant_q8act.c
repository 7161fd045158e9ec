/*
 * quant_q8act.c - the 8-bit activation path's scalar half: a batch of
 * activation rows quantized to int8 blocks of 256 or 32
 * (qt_acts_quantize_ref), and the reference products of the kinds that
 * have the path against them (qt_matmul_q8_k4_ref for Q4_K and Q5_K and
 * qt_matmul_q8_q6_k_ref against blocks of 256; qt_matmul_q8_b32_ref for
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 against blocks of 32), one
 * driver (ref_rows) walking each kind's blocks: integer sums in eight lanes
 * and qt_q8act_math.h's float lanes per block. The AVX2 and VNNI forms
 * (matmul_q8.inc) compute the same integers in the same lanes, so they
 * give these bits.
 *
 * It owns no state and calls down only into kernels/math/. traits.c holds
 * the rows that point here and chooses between this and the AVX2 form.
 */
#include "kernels_internal.h"
#include "qt_q8act_math.h"
#include "qt_quant_math.h"

#include <stdlib.h>

int qt_acts_alloc(qt_acts *x, const float *f32, int64_t batch, int64_t cols, int64_t block)
{
    *x = (qt_acts){f32, batch, cols, block, NULL, NULL, NULL, NULL, NULL};
    if (batch <= 0 || cols <= 0 || cols % block != 0 || batch > INT64_MAX / cols)
        return QL_EINVAL;
    size_t n = (size_t)(batch * cols);
    /* one allocation: the scales and d times sums first (aligned), then the
     * sums, then the codes */
    size_t d_bytes = n / (size_t)block * sizeof(float), s_bytes = n / 16 * sizeof(int16_t);
    uint8_t *mem = malloc(2 * d_bytes + s_bytes + n);
    if (!mem)
        return QL_ENOMEM;
    x->mem = mem;
    x->d = (float *)mem;
    x->dsum = (float *)(mem + d_bytes);
    x->bsum = (int16_t *)(mem + 2 * d_bytes);
    x->q = (int8_t *)(mem + 2 * d_bytes + s_bytes);
    return QL_OK;
}

void qt_acts_quantize_ref(qt_acts *a)
{
    int64_t nblk = a->batch * a->cols / a->block;
    for (int64_t k = 0; k < nblk; k++)
        qm_q8_quantize_block(a->x + k * a->block, (int)a->block, a->q + k * a->block,
                             a->bsum + k * a->block / 16, a->d + k, a->dsum + k);
}

/*
 * One weight block (blk) against the block of row b of x that starts at
 * element at (at = b * cols + k * block): its lanes added into lanes (and,
 * for Q4_1 and Q5_1, its minimum's term into *mins), as qt_q8act_math.h
 * lays them out. ref_rows walks the blocks.
 */
typedef void (*ref_block)(qt_kind kind, const uint8_t *blk, const qt_acts *x, int64_t at,
                          float lanes[8], float *mins);

/* Q4_K and Q5_K: per sub-block of 32 the codes times q, times its scale;
 * its minimum times its sum of q. */
static void k4_block(qt_kind kind, const uint8_t *blk, const qt_acts *x, int64_t at, float lanes[8],
                     float *mins)
{
    (void)mins;
    bool five = kind == QT_Q5_K;
    const int8_t *q = x->q + at;
    const int16_t *bs = x->bsum + at / 16;
    const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
    uint8_t sc[8], mn[8];
    qm_q8_k4_scales(blk + 4, sc, mn);
    int32_t isum[8] = {0}, msum[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t *c = qs + 32 * (j / 2);
        int shift = 4 * (j & 1);
        for (int i = 0; i < 32; i++) {
            int code = (c[i] >> shift) & 15;
            if (five)
                code |= ((qh[i] >> j) & 1) << 4;
            isum[i / 4] += sc[j] * code * q[32 * j + i];
        }
        msum[j] = mn[j] * (bs[2 * j] + bs[2 * j + 1]);
    }
    qm_q8_k4_lanes(lanes, x->d[at / QM_QK_K], qm_f16_le(blk), qm_f16_le(blk + 2), isum, msum);
}

/* Q6_K: per sub-block of 16 the signed codes times q, times its scale. */
static void q6_block(qt_kind kind, const uint8_t *blk, const qt_acts *x, int64_t at, float lanes[8],
                     float *mins)
{
    (void)kind, (void)mins;
    const int8_t *q = x->q + at;
    const int16_t *bs = x->bsum + at / 16;
    const int8_t *sc = (const int8_t *)blk + 192;
    int32_t v[8] = {0};
    for (int e = 0; e < QM_QK_K; e++) { /* element e: half, group kk, l < 32 */
        int half = e / 128, kk = (e % 128) / 32, l = e % 32;
        const uint8_t *ql = blk + 64 * half + (kk & 1 ? 32 : 0);
        int lo = kk < 2 ? ql[l] & 15 : ql[l] >> 4;
        int code = lo | ((blk[128 + 32 * half + l] >> 2 * kk) & 3) << 4;
        v[l / 4] += sc[e / 16] * code * q[e];
    }
    for (int n = 0; n < 8; n++)
        v[n] -= 32 * (sc[2 * n] * bs[2 * n] + sc[2 * n + 1] * bs[2 * n + 1]);
    qm_q8_lanes_fma(lanes, x->d[at / QM_QK_K] * qm_f16_le(blk + 208), v);
}

/* One block of 32 of a kind of blocks of 32 as integer codes c (signed;
 * Q4_1 and Q5_1 unsigned), its scale *dw and its minimum *m (Q4_1, Q5_1;
 * else 0): w = dw * c + m, as the kind's dequantization reads it. */
static void b32_codes(qt_kind kind, const uint8_t *blk, int c[32], float *dw, float *m)
{
    *m = 0.0f;
    for (int i = 0; i < 32; i++)
        switch (kind) {
        case QT_Q8_0: c[i] = (int8_t)blk[2 + i]; break;
        case QT_Q4_0: c[i] = qm_gguf_nibble(blk + 2, i) - 8; break;
        case QT_Q4_1: c[i] = qm_gguf_nibble(blk + 4, i); break;
        case QT_Q5_0: c[i] = qm_q5_code(blk + 2, blk + 6, i) - 16; break;
        case QT_Q5_1: c[i] = qm_q5_code(blk + 4, blk + 8, i); break;
        case QT_IQ4_NL: c[i] = qm_iq4nl_level(qm_gguf_nibble(blk + 2, i)); break;
        default: c[i] = qm_mxfp4_level(qm_gguf_nibble(blk + 1, i)); break; /* QT_MXFP4 */
        }
    *dw = kind == QT_MXFP4 ? qm_e8m0_half(blk[0]) : qm_f16_le(blk);
    if (kind == QT_Q4_1 || kind == QT_Q5_1)
        *m = qm_f16_le(blk + 2);
}

/* A kind of blocks of 32: the codes times q (lane n: elements 4n .. 4n +
 * 3), times dw * dx; the minimum times the x block's dsum (its d times its
 * sum of q) in one more fused multiply-add. */
static void b32_block(qt_kind kind, const uint8_t *blk, const qt_acts *x, int64_t at,
                      float lanes[8], float *mins)
{
    const int8_t *q = x->q + at;
    int c[32];
    float dw, m;
    b32_codes(kind, blk, c, &dw, &m);
    int32_t v[8] = {0};
    for (int i = 0; i < 32; i++)
        v[i / 4] += c[i] * q[i];
    qm_q8_lanes_fma(lanes, dw * x->d[at / 32], v);
    if (kind == QT_Q4_1 || kind == QT_Q5_1)
        *mins = fmaf(m, x->dsum[at / 32], *mins);
}

/* Rows [row0, row1) of t against every row of x, block by block; a row's
 * result is its lanes' sum, plus (the kinds of blocks of 32, as the vector
 * code adds them) its minimums' sum. */
static void ref_rows(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1,
                     ref_block block)
{
    int64_t n = qt_kind_geometry_table[t->kind].block_size, nblk = t->cols / n;
    size_t bb = qt_kind_geometry_table[t->kind].block_bytes;
    for (int64_t r = row0; r < row1; r++)
        for (int64_t b = 0; b < x->batch; b++) {
            float lanes[8] = {0}, mins = 0.0f;
            const uint8_t *blk = t->data + r * nblk * (int64_t)bb;
            for (int64_t k = 0; k < nblk; k++, blk += bb)
                block(t->kind, blk, x, b * t->cols + k * n, lanes, &mins);
            float sum = qm_q8_lanes_sum(lanes);
            y[b * t->rows + r] = n == 32 ? sum + mins : sum;
        }
}

void qt_matmul_q8_b32_ref(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1)
{
    ref_rows(t, x, y, row0, row1, b32_block);
}

void qt_matmul_q8_k4_ref(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1)
{
    ref_rows(t, x, y, row0, row1, k4_block);
}

void qt_matmul_q8_q6_k_ref(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1)
{
    ref_rows(t, x, y, row0, row1, q6_block);
}

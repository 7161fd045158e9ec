/*
 * quant_bnb4.c - NF4 and FP4 exactly as bitsandbytes lays them out, so the
 * packed bytes and absmax we write are the bytes bitsandbytes'
 * quantize_4bit writes, and a checkpoint moves between the two unchanged.
 *
 * The layout (bitsandbytes functional.quantize_4bit, CPU path):
 *   - blocks of `blocksize` consecutive elements of the flattened tensor;
 *     the last block may be short;
 *   - absmax per block = max |x|; every element is scaled into [-1, 1]
 *     (full blocks multiply by the f32 reciprocal of absmax, the short last
 *     block divides by it; both clamp absmax below at 1e-38 first, and the
 *     short block stores the clamped value) and clamped to [-1, 1];
 *   - the code is the bucket of the scaled value among the f32 midpoints of
 *     the sorted codebook, a value on a midpoint going to the lower code
 *     (torch.bucketize, right=False); for FP4, whose table is not sorted, the
 *     bucket maps back through the stable sort order;
 *   - two codes per byte, the even element in the high nibble; an odd
 *     element count pads with the code of 0.0.
 * Double quantization (compress_statistics=True): offset = mean(absmax) as
 * torch computes it in f32, then absmax - offset is quantized blockwise
 * (256) with the signed dynamic 8-bit map as the native CPU library rounds
 * it. The arithmetic of both is qt_quant_math.h's, shared with the CUDA
 * merge (kernels/cuda/qt_cuda_lora.cu).
 *
 * It offers the NF4/FP4 rows' quantizer and scalar dequantization (the
 * traits table in traits.c points at them), the quantizer's driver with the
 * full-block coder left open (qt_bnb4_quantize_with: quant_avx2.c hands it
 * its AVX2 coder, so the layout, the short block and double quant are
 * written once), qt_block_absmax (which
 * matmul_avx2.c calls too), qt_from_bnb4 (build from checkpoint parts) and
 * the codebooks. It owns those constant tables and no mutable state; it
 * calls down into qtensor.c only (names, shape check, qt_free) and touches
 * kernels/math/ (qt_math.h, qt_quant_math.h).
 */
#include "kernels_internal.h"
#include "qt_math.h"
#include "qt_quant_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* bitsandbytes get_4bit_type("nf4") and ("fp4"), as the f32 values
 * bitsandbytes stores (qt_quant_math.h says where they come from). */
const float qt_nf4_code[16] = QQ_NF4_CODE_INIT;
const float qt_fp4_code[16] = QQ_FP4_CODE_INIT;

/* bitsandbytes create_dynamic_map(signed=True, max_exponent_bits=7,
 * total_bits=8): the 8-bit map of nested absmax (Dettmers et al., "8-bit
 * Optimizers via Block-wise Quantization", 2022), as f32. */
const float qt_dynamic_map_signed[256] = {
#include "dynamic_map.inc"
};

static inline void put_nibble(uint8_t *codes, int64_t e, unsigned q)
{
    if (e & 1)
        codes[e >> 1] |= (uint8_t)q;
    else
        codes[e >> 1] |= (uint8_t)(q << 4);
}

/* The nested absmax, with the arithmetic of qt_quant_math.h
 * (qq_bnb4_double_quantize), which the CUDA merge runs too. */
static int double_quantize(qtensor *t, float *absmax, char *msg, size_t msg_len)
{
    int64_t nb = t->n_blocks;
    t->nested_blocksize = QQ_NESTED_BLOCKSIZE;
    t->n_nested_blocks = (nb + QQ_NESTED_BLOCKSIZE - 1) / QQ_NESTED_BLOCKSIZE;
    t->absmax_codes = calloc((size_t)nb, 1);
    t->nested_absmax = calloc((size_t)t->n_nested_blocks, sizeof(float));
    float *centered = malloc((size_t)nb * sizeof(float));
    uint8_t *lut = malloc(QQ_DYNAMIC_LUT_SIZE);
    if (!t->absmax_codes || !t->nested_absmax || !centered || !lut) {
        free(centered);
        free(lut);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate nested absmax for %lld blocks",
                       (long long)nb);
    }
    memcpy(t->nested_code, qt_dynamic_map_signed, sizeof t->nested_code);
    qq_bnb4_double_quantize(absmax, nb, t->nested_code, t->absmax_codes, t->nested_absmax,
                            &t->nested_offset, lut, centered);
    free(centered);
    free(lut);
    t->nested = true;
    return QL_OK;
}

/* One full block, scalar: its absmax and codes (the reference every other
 * block coder matches byte for byte). */
static float code_full_block_ref(const struct qq_buckets *cb, const float *x, int64_t bs,
                                 uint8_t *codes)
{
    float am = 0.0f;
    for (int64_t i = 0; i < bs; i++)
        am = qq_maxf(am, fabsf(x[i]));
    float recip = qq_bnb4_recip(am);
    for (int64_t i = 0; i < bs; i++)
        put_nibble(codes, i, qq_bnb4_code_full(cb, x[i], recip));
    return am;
}

int qt_bnb4_quantize_with(qtensor *t, const float *src, int64_t rows, int64_t cols,
                          const qt_quant_params *p, qt_bnb4_block_coder code_full_block, char *msg,
                          size_t msg_len)
{
    int64_t bs = p->blocksize ? p->blocksize : 64;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "blocksize %lld is not a power of two in [32, 4096]", (long long)bs);
    int64_t n = rows * cols;
    t->blocksize = (int32_t)bs;
    t->n_blocks = (n + bs - 1) / bs;
    t->data_bytes = (size_t)((n + 1) / 2);
    t->data = calloc(t->data_bytes, 1);
    float *absmax = calloc((size_t)t->n_blocks, sizeof(float));
    if (!t->data || !absmax) {
        free(absmax);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes of codes",
                       t->data_bytes);
    }
    memcpy(t->codebook, t->kind == QT_NF4 ? qt_nf4_code : qt_fp4_code, sizeof t->codebook);
    qq_buckets cb;
    qq_build_buckets(t->codebook, &cb);

    /* full blocks start at an even element (bs is even): whole bytes */
    int64_t full = n - n % bs;
    for (int64_t b0 = 0; b0 < full; b0 += bs)
        absmax[b0 / bs] = code_full_block(&cb, src + b0, bs, t->data + b0 / 2);
    if (full < n) {
        float am = 0.0f;
        for (int64_t i = full; i < n; i++)
            am = qq_maxf(am, fabsf(src[i]));
        am = qq_bnb4_short_absmax(am);
        absmax[full / bs] = am;
        for (int64_t i = full; i < n; i++)
            put_nibble(t->data, i, qq_bnb4_code_short(&cb, src[i], am));
    }
    if (n & 1)
        put_nibble(t->data, n, qq_bucket(&cb, 0.0f));

    if (!p->double_quant) {
        t->absmax = absmax;
        return QL_OK;
    }
    int rc = double_quantize(t, absmax, msg, msg_len);
    free(absmax);
    return rc;
}

int qt_bnb4_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len)
{
    return qt_bnb4_quantize_with(t, src, rows, cols, p, code_full_block_ref, msg, msg_len);
}

float qt_block_absmax(const qtensor *t, int64_t b)
{
    if (!t->nested)
        return t->absmax[b];
    return qm_nested_absmax(t->absmax_codes, t->nested_code, t->nested_absmax, t->nested_blocksize,
                            t->nested_offset, b);
}

void qt_bnb4_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    int64_t e0 = row0 * t->cols, e1 = (row0 + nrows) * t->cols;
    int64_t bs = t->blocksize;
    for (int64_t e = e0; e < e1;) {
        int64_t blk = e / bs;
        int64_t end = (blk + 1) * bs < e1 ? (blk + 1) * bs : e1;
        float am = qt_block_absmax(t, blk);
        for (; e < end; e++)
            out[e - e0] = qm_4bit_value(t->codebook, qm_nibble(t->data, e), am);
    }
}

static bool all_finite(const float *v, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return false;
    return true;
}

static void *copy_of(const void *src, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (p)
        memcpy(p, src, bytes);
    return p;
}

int qt_from_bnb4(qtensor *out, const qt_bnb4_parts *pp, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if (pp->kind != QT_NF4 && pp->kind != QT_FP4)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s is not a bitsandbytes 4-bit kind",
                       qt_kind_name(pp->kind));
    int rc = qt_check_shape(pp->rows, pp->cols, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int64_t bs = pp->blocksize, n = pp->rows * pp->cols;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "blocksize %lld is not a power of two in [32, 4096]", (long long)bs);
    if (!pp->codes || pp->codes_bytes != (size_t)((n + 1) / 2))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%zu bytes of packed codes for %lld elements; expected %lld",
                       pp->codes_bytes, (long long)n, (long long)((n + 1) / 2));
    int64_t nb = (n + bs - 1) / bs;
    if (pp->n_blocks != nb)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "absmax has %lld entries; %lld elements in blocks of %lld need %lld",
                       (long long)pp->n_blocks, (long long)n, (long long)bs, (long long)nb);
    if (!pp->codebook || !all_finite(pp->codebook, 16))
        return ql_fail(msg, msg_len, QL_EINVAL, "quant_map is missing or not finite");
    bool nested = pp->absmax_codes != NULL;
    if (!nested && (!pp->absmax || !all_finite(pp->absmax, nb)))
        return ql_fail(msg, msg_len, QL_EINVAL, "absmax is missing or not finite");
    if (nested) {
        int64_t nbs = pp->nested_blocksize;
        if (nbs <= 0 || !pp->nested_absmax || !pp->nested_code)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "nested absmax, nested quant_map or nested_blocksize missing");
        if (pp->n_nested_blocks != (nb + nbs - 1) / nbs)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "nested_absmax has %lld entries; %lld blocks in nested blocks of "
                           "%lld need %lld",
                           (long long)pp->n_nested_blocks, (long long)nb, (long long)nbs,
                           (long long)((nb + nbs - 1) / nbs));
        if (!all_finite(pp->nested_absmax, pp->n_nested_blocks) ||
            !all_finite(pp->nested_code, 256) || !isfinite(pp->nested_offset))
            return ql_fail(msg, msg_len, QL_EINVAL, "nested quant state is not finite");
    }
    out->kind = pp->kind;
    out->rows = pp->rows;
    out->cols = pp->cols;
    out->blocksize = (int32_t)bs;
    out->n_blocks = nb;
    memcpy(out->codebook, pp->codebook, sizeof out->codebook);
    out->data_bytes = pp->codes_bytes;
    out->data = copy_of(pp->codes, pp->codes_bytes);
    bool ok = out->data != NULL;
    if (!nested) {
        out->absmax = copy_of(pp->absmax, (size_t)nb * sizeof(float));
        ok = ok && out->absmax;
    } else {
        out->nested = true;
        out->nested_blocksize = pp->nested_blocksize;
        out->n_nested_blocks = pp->n_nested_blocks;
        out->nested_offset = pp->nested_offset;
        memcpy(out->nested_code, pp->nested_code, sizeof out->nested_code);
        out->absmax_codes = copy_of(pp->absmax_codes, (size_t)nb);
        out->nested_absmax =
            copy_of(pp->nested_absmax, (size_t)pp->n_nested_blocks * sizeof(float));
        ok = ok && out->absmax_codes && out->nested_absmax;
    }
    if (!ok) {
        qt_free(out);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate the 4-bit tensor");
    }
    return QL_OK;
}

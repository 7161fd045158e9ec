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
 * it; see torch_f32_sum and quantize_dynamic_blocks.
 */
#include "kernels_internal.h"
#include "qt_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* bitsandbytes get_4bit_type("nf4"): quantiles of N(0, 1) (QLoRA, Dettmers
 * et al. 2023, appendix E), as the f32 values bitsandbytes stores. */
const float qt_nf4_code[16] = {
    -0x1p+0f,        -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f,
    -0x1.23449ap-2f, -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0x0p+0f,
    0x1.45f5fep-4f,  0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c3497p-2f,   0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f,
};

/* bitsandbytes get_4bit_type("fp4"): a 1-2-1 sign/exponent/mantissa float
 * with bias 2, in bit-pattern order, divided by its largest value 12. Entry
 * 8 is +0.0 as get_4bit_type writes it (Python's -0 is the integer 0). */
const float qt_fp4_code[16] = {
    0.0f,          0.0625f / 12.0f, 8.0f / 12.0f,  12.0f / 12.0f,    4.0f / 12.0f,  6.0f / 12.0f,
    2.0f / 12.0f,  3.0f / 12.0f,    0.0f,          -0.0625f / 12.0f, -8.0f / 12.0f, -12.0f / 12.0f,
    -4.0f / 12.0f, -6.0f / 12.0f,   -2.0f / 12.0f, -3.0f / 12.0f,
};

/* bitsandbytes create_dynamic_map(signed=True, max_exponent_bits=7,
 * total_bits=8): the 8-bit map of nested absmax (Dettmers et al., "8-bit
 * Optimizers via Block-wise Quantization", 2022), as f32. */
const float qt_dynamic_map_signed[256] = {
#include "dynamic_map.inc"
};

/* Below this absmax bitsandbytes clamps before taking the reciprocal. */
#define BNB_ABSMAX_FLOOR 1e-38f

/* The sorted view of a 4-bit codebook that bucketing needs. */
typedef struct code_buckets {
    float bounds[15];  /* f32 midpoints of adjacent sorted codes */
    uint8_t order[16]; /* sorted position -> code */
} code_buckets;

static void build_buckets(const float *code, code_buckets *cb)
{
    /* stable insertion sort of the 16 codes by value; equal values (FP4's
     * +0 and -0) keep their table order, as torch.argsort did */
    for (int i = 0; i < 16; i++)
        cb->order[i] = (uint8_t)i;
    for (int i = 1; i < 16; i++) {
        uint8_t o = cb->order[i];
        int j = i - 1;
        while (j >= 0 && code[cb->order[j]] > code[o]) {
            cb->order[j + 1] = cb->order[j];
            j--;
        }
        cb->order[j + 1] = o;
    }
    for (int i = 0; i < 15; i++)
        cb->bounds[i] = (code[cb->order[i]] + code[cb->order[i + 1]]) / 2.0f;
}

/* torch.bucketize(s, bounds, right=False): the number of bounds below s. */
static inline unsigned bucket(const code_buckets *cb, float s)
{
    unsigned i = 0;
    while (i < 15 && cb->bounds[i] < s)
        i++;
    return cb->order[i];
}

static inline float clamp_unit(float s)
{
    return s < -1.0f ? -1.0f : (s > 1.0f ? 1.0f : s);
}

static inline void put_nibble(uint8_t *codes, int64_t e, unsigned q)
{
    if (e & 1)
        codes[e >> 1] |= (uint8_t)q;
    else
        codes[e >> 1] |= (uint8_t)(q << 4);
}

/*
 * The 8-bit blockwise quantization bitsandbytes' native CPU library applies
 * to nested absmax (cquantize_blockwise_cpu_fp32). It is not an exact
 * nearest-code search: the code comes from a 65536-entry table indexed by
 * the scaled value, built from the f32 midpoints of the map. Established
 * against the library over ~8.3 million values, see
 * tests/fixtures/make_bnb_vectors.py (finding b):
 *   lut[j]  = number of midpoints below (2j / 65535 - 1), each step in f32
 *   v       = clamp(x * (1 / absmax), -1, 1)
 *   j       = (int)fma((v + 1) * 0.5, 65535, 0.5)   (one fused step, truncated)
 * An all-zero block stores absmax 0 and codes 0.
 */
static void build_dynamic_lut(const float *map, uint8_t *lut)
{
    float mid[255];
    for (int i = 0; i < 255; i++)
        mid[i] = 0.5f * (map[i] + map[i + 1]);
    int k = 0;
    for (int j = 0; j < 65536; j++) {
        float v = (float)(2 * j) / 65535.0f - 1.0f;
        while (k < 255 && mid[k] < v)
            k++;
        lut[j] = (uint8_t)k;
    }
}

static void quantize_dynamic_blocks(const float *x, int64_t n, int64_t bs, const uint8_t *lut,
                                    uint8_t *out, float *absmax)
{
    for (int64_t b0 = 0, blk = 0; b0 < n; b0 += bs, blk++) {
        int64_t end = b0 + bs < n ? b0 + bs : n;
        float am = 0.0f;
        for (int64_t i = b0; i < end; i++)
            am = fmaxf(am, fabsf(x[i]));
        absmax[blk] = am;
        if (am == 0.0f) {
            memset(out + b0, 0, (size_t)(end - b0));
            continue;
        }
        float inv = 1.0f / am;
        for (int64_t i = b0; i < end; i++) {
            float v = clamp_unit(x[i] * inv);
            float t = (v + 1.0f) * 0.5f;
            int j = (int)fmaf(t, 65535.0f, 0.5f) & 0xffff;
            out[i] = lut[j];
        }
    }
}

/*
 * torch's f32 sum of a contiguous vector on an AVX2 (or default) CPU build,
 * one thread, whose order decides the last bit of bitsandbytes' nested
 * offset (tests/fixtures/make_bnb_vectors.py, finding c).
 *
 * cascade_rows is torch's multi_row_sum: m rows of `cols` lanes (row i,
 * lane c at x[i * stride + c * col_stride]) summed into four levels of
 * accumulators, each level folded into the next every 2^power rows.
 */
static void cascade_rows(const float *x, int64_t stride, int64_t m, int64_t cols,
                         int64_t col_stride, float *out_cols)
{
    enum { LEVELS = 4 };
    int64_t clog = m <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(m - 1));
    int64_t power = clog / LEVELS > 4 ? clog / LEVELS : 4;
    int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][4] = {{0}};
    int64_t i = 0;
    while (i + step <= m) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t c = 0; c < cols; c++)
                acc[0][c] += x[i * stride + c * col_stride];
        for (int l = 1; l < LEVELS; l++) {
            for (int64_t c = 0; c < cols; c++) {
                acc[l][c] += acc[l - 1][c];
                acc[l - 1][c] = 0.0f;
            }
            if ((i & (mask << (l * power))) != 0)
                break;
        }
    }
    for (; i < m; i++)
        for (int64_t c = 0; c < cols; c++)
            acc[0][c] += x[i * stride + c * col_stride];
    for (int l = 1; l < LEVELS; l++)
        for (int64_t c = 0; c < cols; c++)
            acc[0][c] += acc[l][c];
    for (int64_t c = 0; c < cols; c++)
        out_cols[c] = acc[0][c];
}

/* torch's row_sum: the m items as rows of 4, leftovers into the first
 * partial, then the partials in order. */
static float torch_row_sum(const float *x, int64_t stride, int64_t m)
{
    float part[4];
    int64_t m4 = m / 4;
    cascade_rows(x, 4 * stride, m4, 4, stride, part);
    for (int64_t i = 4 * m4; i < m; i++)
        part[0] += x[i * stride];
    return ((part[0] + part[1]) + part[2]) + part[3];
}

static float torch_f32_sum(const float *x, int64_t n)
{
    enum { W = 8 }; /* floats per AVX2 vector */
    if (n < W)
        return torch_row_sum(x, 1, n);
    int64_t nv = n / W;
    /* each of the 8 lanes runs row_sum over its own stream of nv values */
    float lanes[W];
    for (int l = 0; l < W; l++)
        lanes[l] = torch_row_sum(x + l, W, nv);
    float acc = 0.0f;
    for (int64_t k = nv * W; k < n; k++)
        acc += x[k];
    for (int l = 0; l < W; l++)
        acc += lanes[l];
    return acc;
}

static int double_quantize(qtensor *t, float *absmax, char *msg, size_t msg_len)
{
    int64_t nb = t->n_blocks;
    t->nested_blocksize = 256;
    t->n_nested_blocks = (nb + 255) / 256;
    t->absmax_codes = calloc((size_t)nb, 1);
    t->nested_absmax = calloc((size_t)t->n_nested_blocks, sizeof(float));
    float *centered = malloc((size_t)nb * sizeof(float));
    uint8_t *lut = malloc(65536);
    if (!t->absmax_codes || !t->nested_absmax || !centered || !lut) {
        free(centered);
        free(lut);
        return qt_fail(msg, msg_len, QT_ENOMEM, "cannot allocate nested absmax for %lld blocks",
                       (long long)nb);
    }
    /* torch's f32 mean: its cascade sum, divided in f32. Beyond 32768
     * blocks a multithreaded torch splits the sum by thread count, so
     * bit-equality with bitsandbytes holds for its one-thread result. */
    t->nested_offset = torch_f32_sum(absmax, nb) / (float)nb;
    for (int64_t b = 0; b < nb; b++)
        centered[b] = absmax[b] - t->nested_offset;
    memcpy(t->nested_code, qt_dynamic_map_signed, sizeof t->nested_code);
    build_dynamic_lut(t->nested_code, lut);
    quantize_dynamic_blocks(centered, nb, 256, lut, t->absmax_codes, t->nested_absmax);
    free(centered);
    free(lut);
    t->nested = true;
    return QT_OK;
}

int qt_bnb4_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len)
{
    int64_t bs = p->blocksize ? p->blocksize : 64;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return qt_fail(msg, msg_len, QT_EINVAL,
                       "blocksize %lld is not a power of two in [32, 4096]", (long long)bs);
    int64_t n = rows * cols;
    t->blocksize = (int32_t)bs;
    t->n_blocks = (n + bs - 1) / bs;
    t->data_bytes = (size_t)((n + 1) / 2);
    t->data = calloc(t->data_bytes, 1);
    float *absmax = calloc((size_t)t->n_blocks, sizeof(float));
    if (!t->data || !absmax) {
        free(absmax);
        return qt_fail(msg, msg_len, QT_ENOMEM, "cannot allocate %zu bytes of codes",
                       t->data_bytes);
    }
    memcpy(t->codebook, t->kind == QT_NF4 ? qt_nf4_code : qt_fp4_code, sizeof t->codebook);
    code_buckets cb;
    build_buckets(t->codebook, &cb);

    int64_t full = n - n % bs;
    for (int64_t b0 = 0; b0 < n; b0 += bs) {
        int64_t end = b0 + bs < n ? b0 + bs : n;
        float am = 0.0f;
        for (int64_t i = b0; i < end; i++)
            am = fmaxf(am, fabsf(src[i]));
        if (b0 < full) {
            absmax[b0 / bs] = am;
            float recip = 1.0f / fmaxf(am, BNB_ABSMAX_FLOOR);
            for (int64_t i = b0; i < end; i++)
                put_nibble(t->data, i, bucket(&cb, clamp_unit(src[i] * recip)));
        } else {
            am = fmaxf(am, BNB_ABSMAX_FLOOR);
            absmax[b0 / bs] = am;
            for (int64_t i = b0; i < end; i++)
                put_nibble(t->data, i, bucket(&cb, clamp_unit(src[i] / am)));
        }
    }
    if (n & 1)
        put_nibble(t->data, n, bucket(&cb, 0.0f));

    if (!p->double_quant) {
        t->absmax = absmax;
        return QT_OK;
    }
    int rc = double_quantize(t, absmax, msg, msg_len);
    free(absmax);
    return rc;
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
        return qt_fail(msg, msg_len, QT_EUNSUPPORTED, "%s is not a bitsandbytes 4-bit kind",
                       qt_kind_name(pp->kind));
    if (pp->rows <= 0 || pp->cols <= 0 || pp->rows > INT64_MAX / pp->cols)
        return qt_fail(msg, msg_len, QT_EINVAL, "shape [%lld, %lld] is not valid",
                       (long long)pp->rows, (long long)pp->cols);
    int64_t bs = pp->blocksize, n = pp->rows * pp->cols;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return qt_fail(msg, msg_len, QT_EINVAL,
                       "blocksize %lld is not a power of two in [32, 4096]", (long long)bs);
    if (!pp->codes || pp->codes_bytes != (size_t)((n + 1) / 2))
        return qt_fail(msg, msg_len, QT_EINVAL,
                       "%zu bytes of packed codes for %lld elements; expected %lld",
                       pp->codes_bytes, (long long)n, (long long)((n + 1) / 2));
    int64_t nb = (n + bs - 1) / bs;
    if (pp->n_blocks != nb)
        return qt_fail(msg, msg_len, QT_EINVAL,
                       "absmax has %lld entries; %lld elements in blocks of %lld need %lld",
                       (long long)pp->n_blocks, (long long)n, (long long)bs, (long long)nb);
    if (!pp->codebook || !all_finite(pp->codebook, 16))
        return qt_fail(msg, msg_len, QT_EINVAL, "quant_map is missing or not finite");
    bool nested = pp->absmax_codes != NULL;
    if (!nested && (!pp->absmax || !all_finite(pp->absmax, nb)))
        return qt_fail(msg, msg_len, QT_EINVAL, "absmax is missing or not finite");
    if (nested) {
        int64_t nbs = pp->nested_blocksize;
        if (nbs <= 0 || !pp->nested_absmax || !pp->nested_code)
            return qt_fail(msg, msg_len, QT_EINVAL,
                           "nested absmax, nested quant_map or nested_blocksize missing");
        if (pp->n_nested_blocks != (nb + nbs - 1) / nbs)
            return qt_fail(msg, msg_len, QT_EINVAL,
                           "nested_absmax has %lld entries; %lld blocks in nested blocks of "
                           "%lld need %lld",
                           (long long)pp->n_nested_blocks, (long long)nb, (long long)nbs,
                           (long long)((nb + nbs - 1) / nbs));
        if (!all_finite(pp->nested_absmax, pp->n_nested_blocks) ||
            !all_finite(pp->nested_code, 256) || !isfinite(pp->nested_offset))
            return qt_fail(msg, msg_len, QT_EINVAL, "nested quant state is not finite");
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
        return qt_fail(msg, msg_len, QT_ENOMEM, "cannot allocate the 4-bit tensor");
    }
    return QT_OK;
}

/*
 * merge.c - the LoRA merge for every quant kind of kernels/qtensor.h, and
 * the dispatch to it: one table indexed by kind, as the quant traits are,
 * whose row holds what differs by kind (which merge reads the quantizer's
 * parameters back from the weight). It also owns the cost arithmetic
 * (lora_cost_add). It touches only what it is given: it reads the pristine
 * weight and the adapters' A and B, and writes a new tensor.
 *
 * What does not differ by kind is not in the table: an unmerge serves the
 * pristine weight itself (the registry keeps it), and unmerged application
 * adds (x @ A^T) @ B^T after the base product whatever the base's kind
 * (engine/runtime's eng_lora_apply).
 *
 * A merge never edits a quantized weight in place. It dequantizes the
 * pristine copy to f32 (W), adds the parts' delta d, and quantizes W + d
 * again with qt_quantize, so the only rounding is one requantization from
 * the pristine weight, however many merges came before. What differs by
 * kind is only how the quantizer's parameters are read back from the
 * pristine tensor, so that the merged one has the same layout:
 *
 *   F32 F16 BF16    the same dtype, rounded to nearest even;
 *   NF4 FP4         the same blocksize and double-quant (nested) setting.
 *                   qt_quantize writes bitsandbytes' own codebook and nested
 *                   map (blocks of 256), so a weight holding any other
 *                   codebook, map or nested block size is refused rather
 *                   than silently given a different layout;
 *   AFFINE          the same bits, group size, code range [qmin, qmax] and
 *                   zero domain. Whether it was quantized symmetrically is
 *                   not stored, so it is read from the zero points (see
 *                   affine_params); torchao's eps, not stored either, is
 *                   taken from the configuration (1e-6 for int4
 *                   weight-only, FLT_EPSILON otherwise);
 *   Q4_0 Q4_1 Q8_0  the same block kind (blocks of 32 along the rows);
 *   Q5_0 Q5_1
 *   Q2_K Q3_K       the same k-quant (super-blocks of 256 along the rows),
 *   Q4_K Q5_K Q6_K  requantized by llama.cpp's reference quantizers, which
 *                   search each sub-block's scale and minimum afresh; that
 *                   search is not idempotent, so even a zero delta may move
 *                   some codes (relative_error +INFINITY, see below).
 *   IQ4_NL IQ4_XS   the same kind (blocks of 32; IQ4_XS's super-blocks of
 *                   256), requantized by llama.cpp's quantize_row_iq4_nl_ref
 *                   / _iq4_xs_ref, whose scale search is not idempotent
 *                   either.
 *   MXFP4           the same kind (blocks of 32), requantized by
 *                   quantize_row_mxfp4_ref's rule; unchanged values come
 *                   back exactly, but a block whose largest level is
 *                   below 8 (4.0 in E2M1) takes the next smaller scale
 *                   and doubled levels: the same values, other bytes.
 *   FP8             the same block (weight_block_size) and scale dtype (f32
 *                   or UE8M0), requantized by transformers' Fp8Quantize
 *                   rule, the scale recomputed per block; neither width is
 *                   idempotent at the last bit (an f32 scale recomputed
 *                   from 448 * scale can move by an ulp; a UE8M0 block whose
 *                   largest code is 224 takes the power of two below).
 *                   bf16 or f16 scales (compressed-tensors, fbgemm) are
 *                   recomputed as amax / 448 in their dtype.
 *   GPTQ AWQ CT_INT the weight's own layout (bits, groups or blocks, zero
 *                   convention, packing, scale dtype), round to nearest
 *                   over each group's or block's range.
 *
 * Numbers, and why:
 *   - the delta of one element is computed in double, parts in order, each
 *     part as s * sum_k B[r][k] * A[k][c] with k ascending and s = (double)
 *     part.scale * module->scale, then rounded once to f32. Double keeps the
 *     rank-r sum exact enough that the only rounding a user sees is the
 *     requantization's, and it lets a float64 reference (the tests) get the
 *     same f32 delta bit for bit; it costs little next to the requantization
 *     itself (a rank-16 delta is 16 multiply-adds per element);
 *   - the value quantized is W + d in f32 (one correctly rounded addition);
 *   - the cost is summed in double over that f32 d: dot = <Q - W, d>,
 *     delta_sq = |d|^2, err_sq = |Q - (W + d)|^2 with W + d exact in
 *     double, where Q = dequant(merged);
 *   - a zero delta (delta_sq == 0: scale 0, an untrained adapter whose B is
 *     zero) retains everything it asked for, so delta_retained is 1; its
 *     relative_error is 0 when requantizing gave W back bit for bit, and
 *     +INFINITY when it did not (requantization moved the weights while the
 *     adapter asked for nothing: no finite multiple of |d| describes that).
 *
 * Memory: two f32 buffers of rows * cols (d and W + d, which qt_quantize
 * needs whole), W and Q a block of rows at a time (decoded again where
 * needed: decoding a block costs less than storing and reading back a
 * whole tensor of f32), plus the parts' A and B in f32 (and in double on
 * the AVX2 path), freed before returning.
 *
 * Speed (a merge requantizes every targeted weight of the model): on a CPU
 * with AVX2 the delta is computed two rows at a time in registers, the
 * cost summed eight elements at a time, and qt_quantize takes the kind's
 * AVX2 quantizer where it has one; every fast path gives the scalar one's
 * bits (see delta_rows_avx2 and the cost's lanes), so a merge's bytes and
 * report do not depend on the CPU. QLSERVE_CPU_PATH=scalar takes the
 * scalar paths throughout.
 */
#include "lora.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* --- what a merge cost ------------------------------------------------- */

/* The ratios from the sums, with the zero-delta convention above. */
static void cost_ratios(lora_cost *c)
{
    if (c->delta_sq > 0.0) {
        c->delta_retained = c->dot / c->delta_sq;
        c->relative_error = sqrt(c->err_sq / c->delta_sq);
    } else {
        c->delta_retained = 1.0;
        c->relative_error = c->err_sq == 0.0 ? 0.0 : INFINITY;
    }
}

void lora_cost_add(lora_cost *a, const lora_cost *b)
{
    a->dot += b->dot;
    a->delta_sq += b->delta_sq;
    a->err_sq += b->err_sq;
    a->merged = a->merged || b->merged;
    cost_ratios(a);
}

/* --- the quantizer's parameters, read back from a pristine weight ------ */

/* Fill p so that qt_quantize gives a tensor of w's kind and layout. */
typedef int (*params_fn)(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len);

static int wrong_family(const qtensor *w, const char *family, char *msg, size_t msg_len)
{
    return ql_fail(msg, msg_len, QL_EINVAL, "a %s weight was given to the %s merge",
                   qt_kind_name(w->kind), family);
}

static bool is_dense(qt_kind k)
{
    return (unsigned)k < QT_KIND_COUNT && qt_traits_table[k].is_dense;
}

static int dense_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (!is_dense(w->kind))
        return wrong_family(w, "dense", msg, msg_len);
    p->kind = w->kind;
    return QL_OK;
}

static int bnb4_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (w->kind != QT_NF4 && w->kind != QT_FP4)
        return wrong_family(w, "bitsandbytes 4-bit", msg, msg_len);
    const float *code = w->kind == QT_NF4 ? qt_nf4_code : qt_fp4_code;
    if (memcmp(w->codebook, code, sizeof w->codebook) != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "this %s weight's quant_map is not bitsandbytes' %s codebook; requantizing "
                       "would change it (merge \"into\" int8 or bf16 instead)",
                       qt_kind_name(w->kind), qt_kind_name(w->kind));
    if (w->nested && (w->nested_blocksize != 256 ||
                      memcmp(w->nested_code, qt_dynamic_map_signed, sizeof w->nested_code) != 0))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "this %s weight's nested absmax is not in bitsandbytes' layout (the signed "
                       "dynamic map in blocks of 256, here %d); requantizing would change it "
                       "(merge \"into\" int8 or bf16 instead)",
                       qt_kind_name(w->kind), w->nested_blocksize);
    p->kind = w->kind;
    p->blocksize = w->blocksize;
    p->double_quant = w->nested;
    return QL_OK;
}

/*
 * Symmetric or not is not stored; it is read from the zero points. torchao's
 * symmetric mapping (kernels/quant_affine.c) always uses the integer domain
 * and puts every zero at the middle code floor((qmin + qmax + 1) / 2) (0 for
 * the signed ranges), while the asymmetric one puts zero where the group's
 * minimum lands, so that all groups share the middle code only by
 * coincidence. Hence: integer domain and every zero at the middle code means
 * symmetric; anything else is asymmetric, in the tensor's own zero domain.
 * With engine/model/model.c this reads int8 (symmetric, per channel) as
 * symmetric and int4 (asymmetric, float zero domain) as asymmetric.
 *
 * eps is not stored either. engine/model/model.c follows torchao: int4
 * weight-only (the float-zero-domain "tinygemm" layout) clamps scales at
 * 1e-6, int8 weight-only at FLT_EPSILON (torch.finfo(torch.float32).eps),
 * which qt_quantize uses when eps is 0.
 */
static int affine_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (w->kind != QT_AFFINE)
        return wrong_family(w, "affine", msg, msg_len);
    bool symmetric = w->zero_domain == QT_ZERO_INT;
    float middle = floorf((float)(w->qmax + w->qmin + 1) / 2.0f);
    int64_t n_groups = w->rows * w->groups_per_row;
    for (int64_t g = 0; symmetric && g < n_groups; g++)
        symmetric = w->zeros[g] == middle;
    p->kind = QT_AFFINE;
    p->bits = w->bits;
    p->group_size = w->group_size;
    p->symmetric = symmetric;
    p->zero_domain = w->zero_domain;
    p->qmin = w->qmin;
    p->qmax = w->qmax;
    p->eps = w->zero_domain == QT_ZERO_FLOAT ? 1e-6f : 0.0f;
    return QL_OK;
}

/* Every GGUF kind requantizes into itself with llama.cpp's quantizer for
 * it, byte for byte (Q4_0 ... Q5_1 and MXFP4: quant_gguf.c; the k-quants,
 * IQ4_NL and IQ4_XS: the reference ones of quant_kquant.c). The weight's columns are
 * whole blocks of its kind already, so the merged tensor has its layout. */
static int gguf_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (!qt_traits_table[w->kind].is_gguf)
        return wrong_family(w, "GGUF", msg, msg_len);
    p->kind = w->kind;
    return QL_OK;
}

/* FP8: requantized per block in the weight's own block and scale dtype
 * (f32 or UE8M0, as transformers' Fp8Quantize writes them; bf16 or f16 by
 * compressed-tensors' rule). */
static int fp8_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (w->kind != QT_FP8)
        return wrong_family(w, "fp8", msg, msg_len);
    p->kind = QT_FP8;
    p->block_rows = w->block_rows;
    p->block_cols = w->block_cols;
    p->scale_dtype = w->scale_dtype;
    return QL_OK;
}

/* GPTQ and AWQ: requantized per group into the weight's own layout (its
 * bits, g_idx with any act-order permutation, group count, zero
 * convention and packing), by round to nearest over each group's range. */
static int gptq_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (w->kind != QT_GPTQ && w->kind != QT_AWQ)
        return wrong_family(w, "gptq/awq", msg, msg_len);
    p->kind = w->kind;
    p->layout = w;
    return QL_OK;
}

/* compressed-tensors' integer weights: requantized per block into the
 * weight's own layout (bits, block, zero points or none, packing, scale
 * dtype) by compressed-tensors' min-max rule. */
static int ct_int_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (w->kind != QT_CT_INT)
        return wrong_family(w, "ct_int", msg, msg_len);
    p->kind = QT_CT_INT;
    p->layout = w;
    return QL_OK;
}

/* The wider kinds a merge may store into instead of the weight's own. */
static int into_params(qt_kind into, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (into == QT_AFFINE) {
        /* int8 per channel, symmetric, as engine/model/model.c's --quant int8 */
        p->kind = QT_AFFINE;
        p->bits = 8;
        p->symmetric = true;
        return QL_OK;
    }
    if (into == QT_BF16) {
        p->kind = QT_BF16;
        return QL_OK;
    }
    return ql_fail(msg, msg_len, QL_EINVAL,
                   "merged modules can be stored as the weight's own kind, int8 (affine) or "
                   "bf16, not as %s (kind %d)",
                   qt_kind_name(into), (int)into);
}

static const qt_kind into_kinds[] = {
    [QL_INTO_OWN] = QT_KIND_COUNT, [QL_INTO_INT8] = QT_AFFINE, [QL_INTO_BF16] = QT_BF16};

qt_kind lora_into_kind(ql_into into)
{
    return (unsigned)into < sizeof into_kinds / sizeof *into_kinds ? into_kinds[into]
                                                                   : QT_KIND_COUNT;
}

ql_into lora_into_of(qt_kind kind)
{
    for (size_t i = 0; i < sizeof into_kinds / sizeof *into_kinds; i++)
        if (into_kinds[i] == kind)
            return (ql_into)i;
    return QL_INTO_OWN;
}

/* --- the merge, the same for every kind but the parameters ------------- */

/* A part's A ([rank, cols]) and B ([rows, rank]) as f32, and its scale. */
typedef struct part_f32 {
    float *a, *b;
    double *a64, *b64;  /* A and B in double, for the AVX2 delta (NULL on the scalar path) */
    int64_t a64_stride; /* doubles from one row of a64 to the next */
    int64_t rank;
    double scale;
} part_f32;

static const char *adapter_name(const lora_part *part)
{
    return part->adapter ? part->adapter : "(unnamed adapter)";
}

/* Check part i against the weight and convert its A and B to f32. */
static int load_part(const qtensor *w, const lora_part *part, const char *module, bool fast,
                     part_f32 *pf, char *msg, size_t msg_len)
{
    const eng_lora_module *m = part->module;
    if (!m)
        return ql_fail(msg, msg_len, QL_EINVAL, "adapter %s, %s: no module given",
                       adapter_name(part), module);
    const qtensor *a = &m->a, *b = &m->b;
    if (!is_dense(a->kind) || !is_dense(b->kind))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "adapter %s, %s: A is %s and B is %s; only f32, f16 and bf16 are merged",
                       adapter_name(part), module, qt_kind_name(a->kind), qt_kind_name(b->kind));
    if (a->rows <= 0 || a->cols != w->cols || b->rows != w->rows || b->cols != a->rows)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "adapter %s, %s: A is [%lld, %lld] and B [%lld, %lld], which do not "
                       "make a delta for the [%lld, %lld] weight",
                       adapter_name(part), module, (long long)a->rows, (long long)a->cols,
                       (long long)b->rows, (long long)b->cols, (long long)w->rows,
                       (long long)w->cols);
    pf->rank = a->rows;
    pf->scale = (double)part->scale * (double)m->scale;
    pf->a = malloc((size_t)(a->rows * a->cols) * sizeof(float));
    pf->b = malloc((size_t)(b->rows * b->cols) * sizeof(float));
    if (!pf->a || !pf->b)
        return ql_fail(msg, msg_len, QL_ENOMEM, "adapter %s, %s: cannot allocate A and B in f32",
                       adapter_name(part), module);
    qt_dequantize_rows(a, 0, a->rows, pf->a);
    qt_dequantize_rows(b, 0, b->rows, pf->b);
    if (fast) {
        /* rows of A 64 bytes longer than a multiple of 4 KiB would make
         * them: the 16-column chunks of A's rows then fall in different L1
         * sets (1536 columns of double are 3 x 4 KiB, and all 16 rows of a
         * chunk would share one set) */
        pf->a64_stride = (a->cols + 3) / 4 * 4 + 8;
        size_t na = (size_t)(a->rows * pf->a64_stride), nb = (size_t)(b->rows * b->cols);
        pf->a64 = calloc(na, sizeof(double));
        pf->b64 = malloc(nb * sizeof(double));
        if (!pf->a64 || !pf->b64)
            return ql_fail(msg, msg_len, QL_ENOMEM,
                           "adapter %s, %s: cannot allocate A and B in double", adapter_name(part),
                           module);
        for (int64_t k = 0; k < a->rows; k++)
            for (int64_t c = 0; c < a->cols; c++)
                pf->a64[k * pf->a64_stride + c] = (double)pf->a[k * a->cols + c];
        for (size_t i = 0; i < nb; i++)
            pf->b64[i] = (double)pf->b[i];
    }
    return QL_OK;
}

/*
 * Row r of the delta in double: total[c] = sum over parts of
 * scale * sum_k B[r][k] * A[k][c], k ascending (the order the file's
 * comment promises; a float64 reference in that order gets the same bits).
 */
static void delta_row(const part_f32 *pf, size_t n_parts, int64_t r, int64_t cols, double *acc,
                      double *total)
{
    for (int64_t c = 0; c < cols; c++)
        total[c] = 0.0;
    for (size_t i = 0; i < n_parts; i++) {
        for (int64_t c = 0; c < cols; c++)
            acc[c] = 0.0;
        for (int64_t k = 0; k < pf[i].rank; k++) {
            double bk = (double)pf[i].b[r * pf[i].rank + k];
            const float *ak = pf[i].a + k * cols;
            for (int64_t c = 0; c < cols; c++)
                acc[c] += bk * (double)ak[c];
        }
        for (int64_t c = 0; c < cols; c++)
            total[c] += pf[i].scale * acc[c];
    }
}

/* Columns [c, c + 16) of rows r and r + 1 (r + 1 only when two): acc
 * over k in the four registers per row, then the parts' total. */
__attribute__((target("avx2,fma"))) static inline void delta_chunk_avx2(const part_f32 *pf,
                                                                        size_t n_parts, int64_t r,
                                                                        bool two, int64_t c,
                                                                        __m256d t[2][4])
{
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            t[h][j] = _mm256_setzero_pd();
    for (size_t i = 0; i < n_parts; i++) {
        const double *b0 = pf[i].b64 + r * pf[i].rank, *b1 = two ? b0 + pf[i].rank : b0;
        const double *a = pf[i].a64 + c;
        __m256d x0 = _mm256_setzero_pd(), x1 = x0, x2 = x0, x3 = x0;
        __m256d y0 = x0, y1 = x0, y2 = x0, y3 = x0;
        for (int64_t k = 0; k < pf[i].rank; k++, a += pf[i].a64_stride) {
            __m256d v0 = _mm256_loadu_pd(a), v1 = _mm256_loadu_pd(a + 4);
            __m256d v2 = _mm256_loadu_pd(a + 8), v3 = _mm256_loadu_pd(a + 12);
            __m256d p = _mm256_broadcast_sd(b0 + k), q = _mm256_broadcast_sd(b1 + k);
            x0 = _mm256_fmadd_pd(p, v0, x0);
            x1 = _mm256_fmadd_pd(p, v1, x1);
            x2 = _mm256_fmadd_pd(p, v2, x2);
            x3 = _mm256_fmadd_pd(p, v3, x3);
            y0 = _mm256_fmadd_pd(q, v0, y0);
            y1 = _mm256_fmadd_pd(q, v1, y1);
            y2 = _mm256_fmadd_pd(q, v2, y2);
            y3 = _mm256_fmadd_pd(q, v3, y3);
        }
        __m256d s = _mm256_set1_pd(pf[i].scale);
        t[0][0] = _mm256_add_pd(t[0][0], _mm256_mul_pd(s, x0));
        t[0][1] = _mm256_add_pd(t[0][1], _mm256_mul_pd(s, x1));
        t[0][2] = _mm256_add_pd(t[0][2], _mm256_mul_pd(s, x2));
        t[0][3] = _mm256_add_pd(t[0][3], _mm256_mul_pd(s, x3));
        t[1][0] = _mm256_add_pd(t[1][0], _mm256_mul_pd(s, y0));
        t[1][1] = _mm256_add_pd(t[1][1], _mm256_mul_pd(s, y1));
        t[1][2] = _mm256_add_pd(t[1][2], _mm256_mul_pd(s, y2));
        t[1][3] = _mm256_add_pd(t[1][3], _mm256_mul_pd(s, y3));
    }
}

/*
 * Rows [r0, r0 + nr) of the delta with AVX2, and of x = w + d (w, d and x
 * point at row r0); false when some x is not finite. 16 columns at a time
 * down the block's rows, two rows at a time in registers: both rows share
 * each load of A, and the chunk of A stays in L1 for the whole block. Bit
 * for bit the scalar delta_row's: every operation is the one delta_row
 * does, in its order, except that acc + B[r][k] * A[k][c] is one fused
 * multiply-add. That changes nothing: B and A are f32 values (f32, f16 or
 * bf16 stored), and the double product of two f32 values is exact (24 + 24
 * significant bits < 53, exponents far inside double's range), so rounding
 * the product first, as delta_row does, rounds nothing.
 */
__attribute__((target("avx2,fma"))) static bool delta_rows_avx2(const part_f32 *pf, size_t n_parts,
                                                                int64_t r0, int64_t nr,
                                                                int64_t cols, const float *w,
                                                                float *d, float *x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 bad = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        for (int64_t r = 0; r < nr; r += 2) {
            __m256d t[2][4];
            int64_t two = r + 1 < nr ? 2 : 1;
            delta_chunk_avx2(pf, n_parts, r0 + r, two == 2, c, t);
            for (int h = 0; h < two; h++) {
                int64_t o = (r + h) * cols + c;
                __m256 d0 = _mm256_set_m128(_mm256_cvtpd_ps(t[h][1]), _mm256_cvtpd_ps(t[h][0]));
                __m256 d1 = _mm256_set_m128(_mm256_cvtpd_ps(t[h][3]), _mm256_cvtpd_ps(t[h][2]));
                __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(w + o), d0);
                __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(w + o + 8), d1);
                _mm256_storeu_ps(d + o, d0);
                _mm256_storeu_ps(d + o + 8, d1);
                _mm256_storeu_ps(x + o, x0);
                _mm256_storeu_ps(x + o + 8, x1);
                /* |x| not below infinity: Inf, or NaN (unordered) */
                bad =
                    _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, x0), inf, _CMP_NLT_UQ));
                bad =
                    _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, x1), inf, _CMP_NLT_UQ));
            }
        }
    }
    bool finite = _mm256_movemask_ps(bad) == 0;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t cc = c; cc < cols; cc++) {
            double total = 0.0;
            for (size_t i = 0; i < n_parts; i++) {
                double acc = 0.0;
                for (int64_t k = 0; k < pf[i].rank; k++)
                    acc +=
                        pf[i].b64[(r0 + r) * pf[i].rank + k] * pf[i].a64[k * pf[i].a64_stride + cc];
                total += pf[i].scale * acc;
            }
            int64_t o = r * cols + cc;
            d[o] = (float)total;
            x[o] = w[o] + d[o];
            finite = finite && isfinite(x[o]);
        }
    return finite;
}

/*
 * The cost's three sums over n elements, q = dequant(merged): dot =
 * sum (q - w) * d, delta_sq = sum d * d, err_sq = sum (q - (w + d))^2, each
 * term in double as the file's comment says. Each sum is kept in 8 lanes,
 * element e in lane e % 8, and the lanes are added in order at the end, on
 * both paths (cost_lanes_ref, cost_lanes_avx2), so the AVX2 path reports the
 * scalar one's bits.
 */
#define COST_LANES 8

/* Elements per block of rows: W, Q and their part of d and x in L2. */
#define BLOCK_ELEMENTS 16384

static void cost_lanes_add(const double lane[3][COST_LANES], double sums[3])
{
    for (int s = 0; s < 3; s++) {
        sums[s] = 0.0;
        for (int l = 0; l < COST_LANES; l++)
            sums[s] += lane[s][l];
    }
}

/* Add elements [e0, n) of one block to the lanes (the block starts at
 * lane 0). */
static void cost_lanes_ref(const float *w, const float *d, const float *q, size_t e0, size_t n,
                           double lane[3][COST_LANES])
{
    for (size_t e = e0; e < n; e++) {
        double qv = q[e], wv = w[e], dv = d[e];
        double err = qv - (wv + dv);
        lane[0][e % COST_LANES] += (qv - wv) * dv;
        lane[1][e % COST_LANES] += dv * dv;
        lane[2][e % COST_LANES] += err * err;
    }
}

/* The same, 8 elements a step: lane l of the two registers is element
 * e + l, so every lane gets the terms cost_lanes_ref gives it, in order. */
__attribute__((target("avx2"))) static void cost_lanes_avx2(const float *w, const float *d,
                                                            const float *q, size_t n,
                                                            double lane[3][COST_LANES])
{
    __m256d dot[2], dsq[2], esq[2];
    for (int h = 0; h < 2; h++) { /* lanes 0-3, then 4-7 */
        dot[h] = _mm256_loadu_pd(lane[0] + 4 * h);
        dsq[h] = _mm256_loadu_pd(lane[1] + 4 * h);
        esq[h] = _mm256_loadu_pd(lane[2] + 4 * h);
    }
    size_t e = 0;
    for (; e + COST_LANES <= n; e += COST_LANES) {
        for (int h = 0; h < 2; h++) {
            __m256d qv = _mm256_cvtps_pd(_mm_loadu_ps(q + e + 4 * h));
            __m256d wv = _mm256_cvtps_pd(_mm_loadu_ps(w + e + 4 * h));
            __m256d dv = _mm256_cvtps_pd(_mm_loadu_ps(d + e + 4 * h));
            __m256d err = _mm256_sub_pd(qv, _mm256_add_pd(wv, dv));
            dot[h] = _mm256_add_pd(dot[h], _mm256_mul_pd(_mm256_sub_pd(qv, wv), dv));
            dsq[h] = _mm256_add_pd(dsq[h], _mm256_mul_pd(dv, dv));
            esq[h] = _mm256_add_pd(esq[h], _mm256_mul_pd(err, err));
        }
    }
    for (int h = 0; h < 2; h++) {
        _mm256_storeu_pd(lane[0] + 4 * h, dot[h]);
        _mm256_storeu_pd(lane[1] + 4 * h, dsq[h]);
        _mm256_storeu_pd(lane[2] + 4 * h, esq[h]);
    }
    cost_lanes_ref(w, d, q, e, n, lane);
}

/* The part that first made element (r, c) non-finite, adding the parts'
 * contributions to W in order (the last part when only their sum is);
 * NULL when W itself is not finite. */
static const lora_part *blame(const lora_part *parts, const part_f32 *pf, size_t n_parts, float w,
                              int64_t r, int64_t c, int64_t cols)
{
    if (!isfinite(w))
        return NULL;
    double sum = 0.0;
    for (size_t i = 0; i < n_parts; i++) {
        double ba = 0.0;
        for (int64_t k = 0; k < pf[i].rank; k++)
            ba += (double)pf[i].b[r * pf[i].rank + k] * (double)pf[i].a[k * cols + c];
        sum += pf[i].scale * ba;
        if (!isfinite(w + (float)sum))
            return &parts[i];
    }
    return n_parts ? &parts[n_parts - 1] : NULL;
}

static void free_parts(part_f32 *pf, size_t n)
{
    for (size_t i = 0; pf && i < n; i++) {
        free(pf[i].a);
        free(pf[i].b);
        free(pf[i].a64);
        free(pf[i].b64);
    }
    free(pf);
}

static int merge_with(params_fn own_params, const qtensor *pristine, const lora_part *parts,
                      size_t n_parts, const lora_merge_opts *o, const char *module, qtensor *merged,
                      lora_cost *cost, char *msg, size_t msg_len)
{
    if (merged)
        memset(merged, 0, sizeof *merged);
    if (cost)
        memset(cost, 0, sizeof *cost);
    if (!module)
        module = "(module)";
    if (!pristine || !merged || !cost || (n_parts && !parts))
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: merge needs a weight, parts and outputs",
                       module);
    if ((unsigned)pristine->kind >= QT_KIND_COUNT)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: quant kind %d has no LoRA merge", module,
                       (int)pristine->kind);
    if (pristine->rows <= 0 || pristine->cols <= 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: the weight's shape [%lld, %lld] is empty",
                       module, (long long)pristine->rows, (long long)pristine->cols);
    lora_merge_opts defaults = {.safe_merge = true, .into = QT_KIND_COUNT};
    if (!o)
        o = &defaults;

    qt_quant_params qp;
    memset(&qp, 0, sizeof qp);
    int rc = o->into == QT_KIND_COUNT ? own_params(pristine, &qp, msg, msg_len)
                                      : into_params(o->into, &qp, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    int64_t rows = pristine->rows, cols = pristine->cols;
    size_t n = (size_t)rows * (size_t)cols;
    /* rows in blocks of a multiple of 8 (the cost's lanes start each block
     * at lane 0) of about BLOCK_ELEMENTS, whose W and Q stay in cache */
    int64_t block_rows = (BLOCK_ELEMENTS / cols + 7) / 8 * 8;
    if (block_rows < 8)
        block_rows = 8;
    if (block_rows > rows)
        block_rows = rows;
    size_t nb = (size_t)block_rows * (size_t)cols;
    float *w = malloc(nb * sizeof *w);
    float *q = malloc(nb * sizeof *q);
    float *d = malloc(n * sizeof *d);
    float *x = malloc(n * sizeof *x);
    double *acc = malloc((size_t)cols * sizeof *acc);
    double *total = malloc((size_t)cols * sizeof *total);
    part_f32 *pf = calloc(n_parts ? n_parts : 1, sizeof *pf);
    if (!w || !q || !d || !x || !acc || !total || !pf) {
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: cannot allocate %zu floats to merge into",
                     module, 2 * n + 2 * nb);
        goto done;
    }
    /* the AVX2 paths where the kernels take theirs (QLSERVE_CPU_PATH=scalar
     * forces both to scalar): the same bits either way */
    bool fast = strcmp(qt_cpu_path(), "avx2") == 0;
    for (size_t i = 0; i < n_parts && rc == QL_OK; i++)
        rc = load_part(pristine, &parts[i], module, fast, &pf[i], msg, msg_len);
    if (rc != QL_OK)
        goto done;

    /* W + d, a block of rows at a time (AVX2: the whole block at once;
     * scalar: row by row); stop at the first non-finite value */
    for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
        int64_t r1 = r0 + block_rows < rows ? r0 + block_rows : rows;
        qt_dequantize_rows(pristine, r0, r1 - r0, w);
        for (int64_t r = r0; r < r1;) {
            int64_t nr = 1;
            bool finite = false;
            const float *wr = w + (r - r0) * cols;
            float *dr = d + r * cols, *xr = x + r * cols;
            if (fast) {
                nr = r1 - r;
                finite = delta_rows_avx2(pf, n_parts, r, nr, cols, wr, dr, xr);
            } else {
                delta_row(pf, n_parts, r, cols, acc, total);
                for (int64_t c = 0; c < cols; c++) {
                    dr[c] = (float)total[c];
                    xr[c] = wr[c] + dr[c];
                }
            }
            for (int64_t e = 0; o->safe_merge && !finite && e < nr * cols; e++) {
                if (isfinite(xr[e]))
                    continue;
                int64_t er = r + e / cols, c = e % cols;
                const lora_part *bad = blame(parts, pf, n_parts, wr[e], er, c, cols);
                if (bad)
                    rc = ql_fail(msg, msg_len, QL_ENONFINITE,
                                 "adapter %s, %s: the merged value at (row %lld, col %lld) is "
                                 "%g, not finite; nothing was merged",
                                 adapter_name(bad), module, (long long)er, (long long)c,
                                 (double)xr[e]);
                else
                    rc = ql_fail(msg, msg_len, QL_ENONFINITE,
                                 "%s: the pristine weight at (row %lld, col %lld) is %g, not "
                                 "finite; nothing was merged",
                                 module, (long long)er, (long long)c, (double)wr[e]);
                goto done;
            }
            r += nr;
        }
    }

    /* requantize; without safe merge qt_quantize still refuses NaN/Inf */
    char qmsg[256] = "";
    rc = qt_quantize(merged, x, rows, cols, &qp, qmsg, sizeof qmsg);
    if (rc != QL_OK) {
        rc = ql_fail(msg, msg_len, rc, "%s: %s", module, qmsg);
        goto done;
    }

    /* what requantizing cost, against the exact W + d: W dequantized again
     * rather than kept (a block of it is cheaper to decode than a whole
     * tensor of f32 is to store and read back) */
    double lane[3][COST_LANES] = {{0}};
    for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
        int64_t r1 = r0 + block_rows < rows ? r0 + block_rows : rows;
        size_t e0 = (size_t)r0 * (size_t)cols, ne = (size_t)(r1 - r0) * (size_t)cols;
        qt_dequantize_rows(pristine, r0, r1 - r0, w);
        qt_dequantize_rows(merged, r0, r1 - r0, q);
        if (fast)
            cost_lanes_avx2(w, d + e0, q, ne, lane);
        else
            cost_lanes_ref(w, d + e0, q, 0, ne, lane);
    }
    double sums[3];
    cost_lanes_add(lane, sums);
    cost->dot = sums[0];
    cost->delta_sq = sums[1];
    cost->err_sq = sums[2];
    cost->merged = true;
    cost_ratios(cost);

done:
    free(w);
    free(q);
    free(d);
    free(x);
    free(acc);
    free(total);
    free_parts(pf, n_parts);
    if (rc != QL_OK) {
        qt_free(merged);
        memset(cost, 0, sizeof *cost);
    }
    return rc;
}

/* One merge entry per family, so that the table says which reads what. */
#define MERGE_FAMILY(name, params)                                                                 \
    static int name(const qtensor *pristine, const lora_part *parts, size_t n_parts,               \
                    const lora_merge_opts *o, const char *module, qtensor *merged,                 \
                    lora_cost *cost, char *msg, size_t msg_len)                                    \
    {                                                                                              \
        return merge_with(params, pristine, parts, n_parts, o, module, merged, cost, msg,          \
                          msg_len);                                                                \
    }
MERGE_FAMILY(merge_dense, dense_params)
MERGE_FAMILY(merge_bnb4, bnb4_params)
MERGE_FAMILY(merge_affine, affine_params)
MERGE_FAMILY(merge_gguf, gguf_params)
MERGE_FAMILY(merge_fp8, fp8_params)
MERGE_FAMILY(merge_gptq, gptq_params)
MERGE_FAMILY(merge_ct_int, ct_int_params)

/* --- the table ---------------------------------------------------------- */

static const lora_ops ops_table[QT_KIND_COUNT] = {
    [QT_F32] = {.kind = "f32", .merge = merge_dense},
    [QT_F16] = {.kind = "f16", .merge = merge_dense},
    [QT_BF16] = {.kind = "bf16", .merge = merge_dense},
    [QT_NF4] = {.kind = "nf4", .merge = merge_bnb4},
    [QT_FP4] = {.kind = "fp4", .merge = merge_bnb4},
    [QT_AFFINE] = {.kind = "affine", .merge = merge_affine},
    [QT_Q4_0] = {.kind = "q4_0", .merge = merge_gguf},
    [QT_Q4_1] = {.kind = "q4_1", .merge = merge_gguf},
    [QT_Q8_0] = {.kind = "q8_0", .merge = merge_gguf},
    [QT_Q5_0] = {.kind = "q5_0", .merge = merge_gguf},
    [QT_Q5_1] = {.kind = "q5_1", .merge = merge_gguf},
    [QT_Q4_K] = {.kind = "q4_k", .merge = merge_gguf},
    [QT_Q5_K] = {.kind = "q5_k", .merge = merge_gguf},
    [QT_Q6_K] = {.kind = "q6_k", .merge = merge_gguf},
    [QT_Q2_K] = {.kind = "q2_k", .merge = merge_gguf},
    [QT_Q3_K] = {.kind = "q3_k", .merge = merge_gguf},
    [QT_IQ4_NL] = {.kind = "iq4_nl", .merge = merge_gguf},
    [QT_IQ4_XS] = {.kind = "iq4_xs", .merge = merge_gguf},
    [QT_MXFP4] = {.kind = "mxfp4", .merge = merge_gguf},
    [QT_FP8] = {.kind = "fp8", .merge = merge_fp8},
    [QT_GPTQ] = {.kind = "gptq", .merge = merge_gptq},
    [QT_AWQ] = {.kind = "awq", .merge = merge_gptq},
    [QT_CT_INT] = {.kind = "ct_int", .merge = merge_ct_int},
};

int lora_dispatch(const qtensor *w, const lora_ops **ops, char *msg, size_t msg_len)
{
    if (ops)
        *ops = NULL;
    if (!w || !ops)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "lora_dispatch needs a weight and a place for "
                       "its operations");
    if ((unsigned)w->kind >= QT_KIND_COUNT || !ops_table[w->kind].merge)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "quant kind %d (%s) has no LoRA operations: merge, unmerge and apply "
                       "exist for f32, f16, bf16, nf4, fp4, affine, q4_0, q4_1, q8_0, q5_0, q5_1, "
                       "q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4, fp8, gptq, awq and "
                       "ct_int",
                       (int)w->kind, qt_kind_name(w->kind));
    *ops = &ops_table[w->kind];
    return QL_OK;
}

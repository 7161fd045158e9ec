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
 * Memory: three f32 buffers of rows * cols (W, d, W + d, the last reused
 * for Q) plus the parts' A and B in f32, freed before returning.
 */
#include "lora.h"

#include <float.h>
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
 * it, byte for byte (Q4_0 ... Q5_1: quant_gguf.c; the k-quants, IQ4_NL and
 * IQ4_XS: the reference ones of quant_kquant.c). The weight's columns are
 * whole blocks of its kind already, so the merged tensor has its layout. */
static int gguf_params(const qtensor *w, qt_quant_params *p, char *msg, size_t msg_len)
{
    if (!qt_traits_table[w->kind].is_gguf)
        return wrong_family(w, "GGUF", msg, msg_len);
    p->kind = w->kind;
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

/* --- the merge, the same for every kind but the parameters ------------- */

/* A part's A ([rank, cols]) and B ([rows, rank]) as f32, and its scale. */
typedef struct part_f32 {
    float *a, *b;
    int64_t rank;
    double scale;
} part_f32;

static const char *adapter_name(const lora_part *part)
{
    return part->adapter ? part->adapter : "(unnamed adapter)";
}

/* Check part i against the weight and convert its A and B to f32. */
static int load_part(const qtensor *w, const lora_part *part, const char *module, part_f32 *pf,
                     char *msg, size_t msg_len)
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
    float *w = malloc(n * sizeof *w);
    float *d = malloc(n * sizeof *d);
    float *x = malloc(n * sizeof *x);
    double *acc = malloc((size_t)cols * sizeof *acc);
    double *total = malloc((size_t)cols * sizeof *total);
    part_f32 *pf = calloc(n_parts ? n_parts : 1, sizeof *pf);
    if (!w || !d || !x || !acc || !total || !pf) {
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "%s: cannot allocate %zu floats to merge into",
                     module, 3 * n);
        goto done;
    }
    for (size_t i = 0; i < n_parts && rc == QL_OK; i++)
        rc = load_part(pristine, &parts[i], module, &pf[i], msg, msg_len);
    if (rc != QL_OK)
        goto done;

    /* W + d, row by row, stopping at the first non-finite value */
    qt_dequantize_rows(pristine, 0, rows, w);
    for (int64_t r = 0; r < rows; r++) {
        delta_row(pf, n_parts, r, cols, acc, total);
        float *dr = d + r * cols, *xr = x + r * cols;
        const float *wr = w + r * cols;
        for (int64_t c = 0; c < cols; c++) {
            dr[c] = (float)total[c];
            xr[c] = wr[c] + dr[c];
        }
        if (!o->safe_merge)
            continue;
        for (int64_t c = 0; c < cols; c++) {
            if (isfinite(xr[c]))
                continue;
            const lora_part *bad = blame(parts, pf, n_parts, wr[c], r, c, cols);
            if (bad)
                rc = ql_fail(msg, msg_len, QL_ENONFINITE,
                             "adapter %s, %s: the merged value at (row %lld, col %lld) is %g, "
                             "not finite; nothing was merged",
                             adapter_name(bad), module, (long long)r, (long long)c, (double)xr[c]);
            else
                rc = ql_fail(msg, msg_len, QL_ENONFINITE,
                             "%s: the pristine weight at (row %lld, col %lld) is %g, not finite; "
                             "nothing was merged",
                             module, (long long)r, (long long)c, (double)wr[c]);
            goto done;
        }
    }

    /* requantize; without safe merge qt_quantize still refuses NaN/Inf */
    char qmsg[256] = "";
    rc = qt_quantize(merged, x, rows, cols, &qp, qmsg, sizeof qmsg);
    if (rc != QL_OK) {
        rc = ql_fail(msg, msg_len, rc, "%s: %s", module, qmsg);
        goto done;
    }

    /* what requantizing cost, against the exact W + d */
    qt_dequantize_rows(merged, 0, rows, x);
    double dot = 0.0, delta_sq = 0.0, err_sq = 0.0;
    for (size_t e = 0; e < n; e++) {
        double q = x[e], wv = w[e], dv = d[e];
        double err = q - (wv + dv);
        dot += (q - wv) * dv;
        delta_sq += dv * dv;
        err_sq += err * err;
    }
    cost->dot = dot;
    cost->delta_sq = delta_sq;
    cost->err_sq = err_sq;
    cost->merged = true;
    cost_ratios(cost);

done:
    free(w);
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
                       "q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl and iq4_xs",
                       (int)w->kind, qt_kind_name(w->kind));
    *ops = &ops_table[w->kind];
    return QL_OK;
}

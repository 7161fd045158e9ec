/*
 * qt_cuda_tensor.cu - weights resident on the device in their own quantized
 * layout (qt_cuda_tensor of qt_cuda_ops.h): upload, allocate alike,
 * download, release, and the row gather the embedding lookup runs.
 *
 * Why shaped so:
 *   - One struct for every kind, holding the qt_cuda.h view its kind takes
 *     (NF4/FP4, AFFINE, GGUF) or the dense values as they are, so the
 *     matrix kernels, the merge and the engine take one type. The per-kind
 *     uploads of qt_cuda.cu do the copying (Q4_0, Q4_1, Q8_0 blocks are
 *     split there into the qs / d / m layout, the other GGUF kinds stay
 *     whole); this file adds the dense kinds, the byte
 *     count, and an out-of-memory sentence that names the tensor, which is
 *     what an operator loading a model too large for the GPU needs to read.
 *   - A view's counts are exactly the sizes of its device arrays (the
 *     4-bit upload sends only the absmax blocks the elements use), so
 *     alloc_like and download can size everything from the view alone.
 *   - The gather computes every element with the same qt_math.h function
 *     the CPU's qt_dequantize_rows uses (and this file is built with
 *     --fmad=false), so an embedding row on the GPU is the CPU's bit for
 *     bit; tests/gpu/test_cuda_matmul.c requires it.
 *
 *   - What differs by kind comes from the kind's row of qt_cuda_kinds.c,
 *     handed in by the entry points there: the layout (which view, which
 *     arrays) and the gather (one kernel instantiation per kind).
 *
 * Ownership is stated in qt_cuda_ops.h.
 */
#include "qt_cuda_ops.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

#include "qt_cuda_blocks.h"
#include "qt_cuda_internal.h"
#include "qt_cuda_kinds.h"
#include "qt_math.h"

namespace
{

constexpr int kThreadsPerBlock = 256;

bool valid_shape(int64_t rows, int64_t cols)
{
    return rows >= 0 && cols >= 0 && (rows == 0 || cols <= INT64_MAX / rows);
}

/* ---- sizes --------------------------------------------------------------- */

/* The bytes of each device array of a tensor, from its view's counts. */
struct array_sizes {
    size_t codes;        /* dense values, 4-bit codes, AFFINE codes, GGUF qs */
    size_t absmax;       /* NF4/FP4 f32 absmax (not nested) */
    size_t absmax_codes; /* NF4/FP4 nested */
    size_t nested_absmax;
    size_t scales, zeros; /* AFFINE */
    size_t d, m;          /* GGUF */
    size_t total() const
    {
        return codes + absmax + absmax_codes + nested_absmax + scales + zeros + d + m;
    }
};

/* row: t.kind's row. */
array_sizes sizes_of(const qt_cuda_kind_ops &row, const qt_cuda_tensor &t)
{
    array_sizes s;
    memset(&s, 0, sizeof s);
    const int64_t n = t.rows * t.cols;
    if (n == 0)
        return s;
    const size_t nb = (size_t)t.gguf.n_blocks;
    switch (row.layout) {
    case QT_CUDA_LAYOUT_NONE: break;
    case QT_CUDA_LAYOUT_DENSE: s.codes = (size_t)n * row.block_bytes; break;
    case QT_CUDA_LAYOUT_BNB4:
        s.codes = (size_t)((n + 1) / 2);
        if (t.q4.nested) {
            s.absmax_codes = (size_t)t.q4.n_blocks;
            s.nested_absmax = (size_t)t.q4.n_nested_blocks * sizeof(float);
        } else {
            s.absmax = (size_t)t.q4.n_blocks * sizeof(float);
        }
        break;
    case QT_CUDA_LAYOUT_AFFINE:
        s.codes = (size_t)t.rows * (size_t)t.affine.row_stride;
        s.scales = (size_t)(t.rows * t.affine.groups_per_row) * sizeof(float);
        s.zeros = s.scales;
        break;
    case QT_CUDA_LAYOUT_GGUF_SPLIT:
        s.codes = nb * (size_t)qm_gguf_qs_bytes((int)row.block_bytes);
        s.d = nb * sizeof(uint16_t);
        s.m = row.has_m ? s.d : 0;
        break;
    case QT_CUDA_LAYOUT_GGUF_WHOLE: s.codes = nb * row.block_bytes; break;
    case QT_CUDA_LAYOUT_FP8:
    case QT_CUDA_LAYOUT_GPTQ: s.codes = qt_cuda_quantfmt_bytes(&row, &t); break;
    }
    return s;
}

/* What uploading host tensor t will take on the device (for the message
 * when it does not fit). */
size_t upload_bytes_of(const qt_cuda_kind_ops &row, const qtensor *t)
{
    qt_cuda_tensor d;
    memset(&d, 0, sizeof d);
    d.kind = t->kind;
    d.rows = t->rows;
    d.cols = t->cols;
    const int64_t n = t->rows * t->cols;
    if (row.layout == QT_CUDA_LAYOUT_BNB4 && t->blocksize > 0) {
        d.q4.nested = t->nested;
        d.q4.n_blocks = ceil_div(n, t->blocksize);
        d.q4.n_nested_blocks =
            t->nested && t->nested_blocksize > 0 ? ceil_div(d.q4.n_blocks, t->nested_blocksize) : 0;
    } else if (row.layout == QT_CUDA_LAYOUT_AFFINE) {
        d.affine.row_stride = t->row_stride;
        d.affine.groups_per_row = t->groups_per_row;
    } else if (row.is_gguf) {
        d.gguf.n_blocks = n / row.block_size;
    } else if (row.layout == QT_CUDA_LAYOUT_FP8) {
        d.fp8.scale_rows = t->scale_rows;
        d.fp8.scale_cols = t->scale_cols;
        d.fp8.e8m0 = t->scale_dtype == QT_SCALE_E8M0;
        d.fp8.scale_dtype = t->scale_dtype;
        d.fp8.ct_int = row.ct_int_codes;
        d.fp8.row_stride = (int64_t)t->row_stride;
        d.fp8.asymmetric = t->block_zeros != nullptr;
    } else if (row.layout == QT_CUDA_LAYOUT_GPTQ) {
        d.gptq.bits = t->bits;
        d.gptq.groups = t->gptq_groups;
    }
    return sizes_of(row, d).total();
}

/* ---- device memory ------------------------------------------------------- */

/* ---- the gather kernel --------------------------------------------------- */

/* Which element function a gather runs (with the kind, for GGUF). */
enum gather_class {
    kGatherF32,
    kGatherF16,
    kGatherBF16,
    kGather4bit,
    kGatherAffine,
    kGatherGgufSplit,
    kGatherGgufWhole
};

/*
 * out[i * cols + c] = element (ids[i], c) of w, one thread per output,
 * grid-stride over n * cols so consecutive threads write consecutive
 * floats. The 4-bit codebook and nested map go to shared memory first
 * (divergent lookups into the parameter space would serialise).
 */
template <gather_class kClass, qt_kind kKind>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_kernel(const __grid_constant__ qt_cuda_tensor w, const int32_t *__restrict__ ids,
                  int64_t n, float *__restrict__ out)
{
    __shared__ float codebook[kClass == kGather4bit ? 16 : 1];
    __shared__ float nested_code[kClass == kGather4bit ? 256 : 1];
    if (kClass == kGather4bit) {
        for (int i = threadIdx.x; i < 16; i += blockDim.x)
            codebook[i] = w.q4.codebook[i];
        if (w.q4.nested)
            for (int i = threadIdx.x; i < 256; i += blockDim.x)
                nested_code[i] = w.q4.nested_code[i];
        __syncthreads();
    }
    const int64_t cols = w.cols;
    const int64_t total = n * cols;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const float mid = kClass == kGatherAffine ? qm_affine_mid(w.affine.qmin, w.affine.qmax) : 0.0f;
    for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
        const int64_t i = o / cols;
        const int64_t c = o - i * cols;
        const int64_t r = (int64_t)ids[i];
        const int64_t e = r * cols + c;
        float v;
        if constexpr (kClass == kGatherF32) {
            v = static_cast<const float *>(w.dense)[e];
        } else if constexpr (kClass == kGatherF16) {
            v = qm_f16_to_f32(static_cast<const uint16_t *>(w.dense)[e]);
        } else if constexpr (kClass == kGatherBF16) {
            v = qm_bf16_to_f32(static_cast<const uint16_t *>(w.dense)[e]);
        } else if constexpr (kClass == kGather4bit) {
            const qt_cuda_4bit_view &q = w.q4;
            const int64_t b = e / q.blocksize;
            const float absmax =
                q.nested ? qm_nested_absmax(q.absmax_codes, nested_code, q.nested_absmax,
                                            q.nested_blocksize, q.nested_offset, b)
                         : q.absmax[b];
            v = qm_4bit_element(q.codes, codebook, absmax, e);
        } else if constexpr (kClass == kGatherAffine) {
            const qt_cuda_affine_view &a = w.affine;
            v = qm_affine_element(a.codes, a.row_stride, a.bits, a.qmin, a.float_zero, mid,
                                  a.group_size, a.groups_per_row, a.scales, a.zeros, r, c);
        } else if constexpr (kClass == kGatherGgufSplit) {
            const qt_cuda_gguf_view &g = w.gguf;
            v = qt_cuda_block<kKind>::element(g.qs, g.d, g.m, e);
        } else {
            v = qt_cuda_whole_element<kKind>(w.gguf.qs, e);
        }
        out[o] = v;
    }
}

template <gather_class kClass, qt_kind kKind>
int launch_gather(const qt_cuda_tensor *w, const int32_t *ids, int64_t n, float *out, void *stream)
{
    const unsigned blocks = grid_for(n * w->cols, kThreadsPerBlock);
    gather_kernel<kClass, kKind>
        <<<blocks, kThreadsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(*w, ids, n, out);
    return cudaGetLastError();
}

/* The device pointers the kind of row needs, all present (for a non-empty
 * tensor). */
bool has_arrays(const qt_cuda_kind_ops &row, const qt_cuda_tensor &t)
{
    switch (row.layout) {
    case QT_CUDA_LAYOUT_NONE: return false;
    case QT_CUDA_LAYOUT_DENSE: return t.dense != nullptr;
    case QT_CUDA_LAYOUT_BNB4:
        return t.q4.codes != nullptr &&
               (t.q4.nested ? t.q4.absmax_codes != nullptr && t.q4.nested_absmax != nullptr
                            : t.q4.absmax != nullptr);
    case QT_CUDA_LAYOUT_AFFINE: return t.affine.codes && t.affine.scales && t.affine.zeros;
    case QT_CUDA_LAYOUT_GGUF_SPLIT: return t.gguf.qs && t.gguf.d && (!row.has_m || t.gguf.m);
    case QT_CUDA_LAYOUT_GGUF_WHOLE: return t.gguf.qs != nullptr;
    case QT_CUDA_LAYOUT_FP8:
    case QT_CUDA_LAYOUT_GPTQ: return qt_cuda_quantfmt_has_arrays(&row, &t);
    }
    return false;
}

} // namespace

/* ---- the rows' gathers (qt_cuda_kinds.c) ---------------------------------- */

#define GATHER(k, CLASS, KIND)                                                                     \
    extern "C" int qt_cuda_gather_as_##k(const qt_cuda_tensor *w, const int32_t *ids, int64_t n,   \
                                         float *out, void *stream)                                 \
    {                                                                                              \
        return launch_gather<CLASS, KIND>(w, ids, n, out, stream);                                 \
    }
GATHER(f32, kGatherF32, QT_F32)
GATHER(f16, kGatherF16, QT_F16)
GATHER(bf16, kGatherBF16, QT_BF16)
GATHER(bnb4, kGather4bit, QT_NF4)
GATHER(affine, kGatherAffine, QT_AFFINE)
#define GGUF_GATHER(name, NAME, whole)                                                             \
    GATHER(name, whole ? kGatherGgufWhole : kGatherGgufSplit, QT_##NAME)
QT_CUDA_GGUF_KINDS(GGUF_GATHER)
#undef GGUF_GATHER
#undef GATHER

/* ---- public functions ---------------------------------------------------- */

extern "C" int qt_cuda_tensor_release(qt_cuda_tensor *d, char *msg, size_t msg_len)
{
    if (!d)
        return QL_OK;
    int rc = QL_OK;
    if (d->owned) {
        /* Each release keeps its own first failure; report the first. */
        int r1 = qt_cuda_4bit_release(&d->q4, msg, msg_len);
        int r2 = qt_cuda_affine_release(&d->affine, r1 == QL_OK ? msg : nullptr,
                                        r1 == QL_OK ? msg_len : 0);
        rc = r1 != QL_OK ? r1 : r2;
        int r3 =
            qt_cuda_gguf_release(&d->gguf, rc == QL_OK ? msg : nullptr, rc == QL_OK ? msg_len : 0);
        rc = rc != QL_OK ? rc : r3;
        rc = free_device(d->dense, "dense values", rc, msg, msg_len);
        rc = qt_cuda_quantfmt_release(d, rc, msg, msg_len);
    }
    memset(d, 0, sizeof *d);
    return rc;
}

extern "C" int qt_cuda_tensor_upload_with(const qt_cuda_kind_ops *row, const qtensor *t,
                                          qt_cuda_tensor *d, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_tensor_upload";
    if (!d) {
        say(msg, msg_len, "%s: the device tensor is NULL", where);
        return QL_EINVAL;
    }
    memset(d, 0, sizeof *d);
    if (!t) {
        say(msg, msg_len, "%s: the host tensor is NULL", where);
        return QL_EINVAL;
    }
    if ((unsigned)t->kind >= QT_KIND_COUNT || !valid_shape(t->rows, t->cols)) {
        say(msg, msg_len, "%s: kind %d, shape %lld x %lld is not a tensor", where, (int)t->kind,
            (long long)t->rows, (long long)t->cols);
        return QL_EINVAL;
    }
    if (!row || row->layout == QT_CUDA_LAYOUT_NONE) {
        say(msg, msg_len,
            "the CUDA backend cannot run %s yet (it runs f32, f16, bf16, nf4, fp4, affine, "
            "q4_0, q4_1, q8_0, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4, "
            "fp8, ct_int, gptq and awq; this kind runs on the CPU backend)",
            kind_name(t->kind));
        return QL_EUNSUPPORTED;
    }
    d->kind = t->kind;
    d->rows = t->rows;
    d->cols = t->cols;
    d->owned = true;
    const int64_t n = t->rows * t->cols;

    int rc = QL_OK;
    if (row->layout == QT_CUDA_LAYOUT_DENSE) {
        const size_t bytes = (size_t)n * row->block_bytes;
        if (n > 0 && (!t->data || t->data_bytes < bytes)) {
            say(msg, msg_len, "%s: %s tensor %lld x %lld holds %zu bytes, needs %zu", where,
                kind_name(t->kind), (long long)t->rows, (long long)t->cols,
                t->data ? t->data_bytes : (size_t)0, bytes);
            memset(d, 0, sizeof *d);
            return QL_EINVAL;
        }
        rc = device_alloc(&d->dense, bytes, "dense values", msg, msg_len);
        if (rc == QL_OK && bytes > 0) {
            cudaError_t st = cudaMemcpy(d->dense, t->data, bytes, cudaMemcpyHostToDevice);
            if (st != cudaSuccess)
                rc = cuda_failed(st, msg, msg_len, "cudaMemcpy(dense values, %zu bytes)", bytes);
        }
    } else if (row->layout == QT_CUDA_LAYOUT_BNB4) {
        rc = qt_cuda_4bit_upload(t, &d->q4, msg, msg_len);
    } else if (row->layout == QT_CUDA_LAYOUT_AFFINE) {
        rc = qt_cuda_affine_upload(t, &d->affine, msg, msg_len);
    } else if (row->layout == QT_CUDA_LAYOUT_FP8 || row->layout == QT_CUDA_LAYOUT_GPTQ) {
        rc = qt_cuda_quantfmt_upload(row, t, d, msg, msg_len);
    } else {
        rc = qt_cuda_gguf_upload_with(row, t, &d->gguf, msg, msg_len);
    }
    if (rc != QL_OK) {
        qt_cuda_tensor_release(d, nullptr, 0); /* msg keeps the first failure */
        if (rc == QL_ENOMEM && msg && msg_len > 0) {
            char inner[256];
            snprintf(inner, sizeof inner, "%s", msg);
            size_t free_b = 0, total_b = 0;
            if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess)
                (void)cudaGetLastError();
            say(msg, msg_len,
                "%s: not enough device memory for a %s tensor of %lld x %lld (%zu bytes; %zu of "
                "%zu bytes free): %s",
                where, kind_name(t->kind), (long long)t->rows, (long long)t->cols,
                upload_bytes_of(*row, t), free_b, total_b, inner);
        }
        return rc;
    }
    d->device_bytes = sizes_of(*row, *d).total();
    return QL_OK;
}

extern "C" int qt_cuda_tensor_alloc_like_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *t,
                                              qt_cuda_tensor *out, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_tensor_alloc_like";
    if (!out) {
        say(msg, msg_len, "%s: out is NULL", where);
        return QL_EINVAL;
    }
    memset(out, 0, sizeof *out);
    if (!t || !row || (unsigned)t->kind >= QT_KIND_COUNT || !valid_shape(t->rows, t->cols)) {
        say(msg, msg_len, "%s: the model tensor is NULL or not a tensor", where);
        return QL_EINVAL;
    }
    /* Layout parameters (codebooks, blocksize, groups, ...) come along;
     * then every device pointer is replaced by a fresh allocation. */
    *out = *t;
    out->owned = true;
    out->dense = nullptr;
    out->device_bytes = 0;
    out->q4.codes = nullptr;
    out->q4.absmax = nullptr;
    out->q4.absmax_codes = nullptr;
    out->q4.nested_absmax = nullptr;
    out->affine.codes = nullptr;
    out->affine.scales = nullptr;
    out->affine.zeros = nullptr;
    out->gguf.qs = nullptr;
    out->gguf.d = nullptr;
    out->gguf.m = nullptr;
    out->fp8.codes = nullptr;
    out->fp8.scales = nullptr;
    out->fp8.zeros = nullptr;
    out->gptq.qweight = nullptr;
    out->gptq.qzeros = nullptr;
    out->gptq.scales = nullptr;
    out->gptq.g_idx = nullptr;

    const array_sizes s = sizes_of(*row, *out);
    int rc = QL_OK;
    if (row->layout == QT_CUDA_LAYOUT_DENSE) {
        rc = device_alloc(&out->dense, s.codes, "dense values", msg, msg_len);
    } else if (row->layout == QT_CUDA_LAYOUT_FP8 || row->layout == QT_CUDA_LAYOUT_GPTQ) {
        rc = qt_cuda_quantfmt_alloc_like(row, out, msg, msg_len);
    } else if (row->layout == QT_CUDA_LAYOUT_BNB4) {
        uint8_t *codes = nullptr, *absmax_codes = nullptr;
        float *absmax = nullptr, *nested_absmax = nullptr;
        rc = device_alloc(&codes, s.codes, "codes", msg, msg_len);
        out->q4.codes = codes;
        if (rc == QL_OK)
            rc = device_alloc(&absmax, s.absmax, "absmax", msg, msg_len);
        out->q4.absmax = absmax;
        if (rc == QL_OK)
            rc = device_alloc(&absmax_codes, s.absmax_codes, "absmax_codes", msg, msg_len);
        out->q4.absmax_codes = absmax_codes;
        if (rc == QL_OK)
            rc = device_alloc(&nested_absmax, s.nested_absmax, "nested_absmax", msg, msg_len);
        out->q4.nested_absmax = nested_absmax;
    } else if (row->layout == QT_CUDA_LAYOUT_AFFINE) {
        uint8_t *codes = nullptr;
        float *scales = nullptr, *zeros = nullptr;
        rc = device_alloc(&codes, s.codes, "codes", msg, msg_len);
        out->affine.codes = codes;
        if (rc == QL_OK)
            rc = device_alloc(&scales, s.scales, "scales", msg, msg_len);
        out->affine.scales = scales;
        if (rc == QL_OK)
            rc = device_alloc(&zeros, s.zeros, "zeros", msg, msg_len);
        out->affine.zeros = zeros;
    } else {
        uint8_t *qs = nullptr;
        uint16_t *d = nullptr, *m = nullptr;
        rc = device_alloc(&qs, s.codes, "qs", msg, msg_len);
        out->gguf.qs = qs;
        if (rc == QL_OK)
            rc = device_alloc(&d, s.d, "d", msg, msg_len);
        out->gguf.d = d;
        if (rc == QL_OK)
            rc = device_alloc(&m, s.m, "m", msg, msg_len);
        out->gguf.m = m;
    }
    if (rc != QL_OK) {
        qt_cuda_tensor_release(out, nullptr, 0);
        if (rc == QL_ENOMEM && msg && msg_len > 0) {
            char inner[256];
            snprintf(inner, sizeof inner, "%s", msg);
            say(msg, msg_len,
                "%s: not enough device memory for a %s tensor of %lld x %lld (%zu bytes): %s",
                where, kind_name(t->kind), (long long)t->rows, (long long)t->cols, s.total(),
                inner);
        }
        return rc;
    }
    out->device_bytes = s.total();
    return QL_OK;
}

extern "C" int qt_cuda_tensor_download_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d,
                                            qtensor *t, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_tensor_download";
    if (!d || !t) {
        say(msg, msg_len, "%s: %s is NULL", where, !d ? "the device tensor" : "the host tensor");
        return QL_EINVAL;
    }
    if (d->kind != t->kind || d->rows != t->rows || d->cols != t->cols) {
        say(msg, msg_len, "%s: device %s %lld x %lld into host %s %lld x %lld", where,
            kind_name(d->kind), (long long)d->rows, (long long)d->cols, kind_name(t->kind),
            (long long)t->rows, (long long)t->cols);
        return QL_EINVAL;
    }
    const int64_t n = d->rows * d->cols;
    if (n == 0)
        return QL_OK;
    if (t->data_borrowed) {
        say(msg, msg_len,
            "%s: the host %s tensor's codes are borrowed (a mapped file) and cannot be written",
            where, kind_name(t->kind));
        return QL_EINVAL;
    }
    if (!row || !has_arrays(*row, *d)) {
        say(msg, msg_len, "%s: the device %s tensor %lld x %lld is missing an array", where,
            kind_name(d->kind), (long long)d->rows, (long long)d->cols);
        return QL_EINVAL;
    }
    if (row->layout == QT_CUDA_LAYOUT_FP8 || row->layout == QT_CUDA_LAYOUT_GPTQ)
        return qt_cuda_quantfmt_download(row, d, t, msg, msg_len);
    const array_sizes s = sizes_of(*row, *d);
    /* The first of the host arrays that is missing or too small. */
    const char *short_of = nullptr;
    if (!t->data ||
        t->data_bytes < (row->is_gguf ? (size_t)d->gguf.n_blocks * row->block_bytes : s.codes))
        short_of = "codes";
    if (row->layout == QT_CUDA_LAYOUT_BNB4) {
        const qt_cuda_4bit_view &v = d->q4;
        if (t->blocksize != v.blocksize || t->nested != v.nested ||
            (v.nested && t->nested_blocksize != v.nested_blocksize)) {
            say(msg, msg_len,
                "%s: host %s blocksize %d%s does not match the device's %d%s (nested block %d vs "
                "%d)",
                where, kind_name(d->kind), (int)t->blocksize, t->nested ? " nested" : "",
                (int)v.blocksize, v.nested ? " nested" : "", (int)t->nested_blocksize,
                (int)v.nested_blocksize);
            return QL_EINVAL;
        }
        if (t->n_blocks < v.n_blocks)
            short_of = "absmax blocks";
        else if (v.nested &&
                 (!t->absmax_codes || !t->nested_absmax || t->n_nested_blocks < v.n_nested_blocks))
            short_of = "nested absmax";
        else if (!v.nested && !t->absmax)
            short_of = "absmax";
    } else if (row->layout == QT_CUDA_LAYOUT_AFFINE) {
        const qt_cuda_affine_view &v = d->affine;
        if (t->bits != v.bits || t->group_size != v.group_size ||
            t->groups_per_row != v.groups_per_row || t->row_stride != v.row_stride ||
            t->qmin != v.qmin || t->qmax != v.qmax ||
            (t->zero_domain == QT_ZERO_FLOAT) != v.float_zero) {
            say(msg, msg_len,
                "%s: host affine layout (int%d, group %d, range [%d, %d], %s zero) does not "
                "match the device's (int%d, group %d, range [%d, %d], %s zero)",
                where, (int)t->bits, (int)t->group_size, (int)t->qmin, (int)t->qmax,
                t->zero_domain == QT_ZERO_FLOAT ? "float" : "int", (int)v.bits, (int)v.group_size,
                (int)v.qmin, (int)v.qmax, v.float_zero ? "float" : "int");
            return QL_EINVAL;
        }
        if (!t->scales || !t->zeros)
            short_of = "scales and zeros";
    }
    if (short_of) {
        say(msg, msg_len, "%s: the host %s tensor %lld x %lld has no room for its %s", where,
            kind_name(t->kind), (long long)t->rows, (long long)t->cols, short_of);
        return QL_EINVAL;
    }

    int rc = QL_OK;
    if (row->layout == QT_CUDA_LAYOUT_DENSE) {
        rc = copy_to_host(t->data, d->dense, s.codes, "dense values", msg, msg_len);
    } else if (row->layout == QT_CUDA_LAYOUT_BNB4) {
        const qt_cuda_4bit_view &v = d->q4;
        rc = copy_to_host(t->data, v.codes, s.codes, "codes", msg, msg_len);
        if (rc == QL_OK && v.nested) {
            rc = copy_to_host(t->absmax_codes, v.absmax_codes, s.absmax_codes, "absmax_codes", msg,
                              msg_len);
            if (rc == QL_OK)
                rc = copy_to_host(t->nested_absmax, v.nested_absmax, s.nested_absmax,
                                  "nested_absmax", msg, msg_len);
            t->nested_offset = v.nested_offset;
            memcpy(t->nested_code, v.nested_code, sizeof t->nested_code);
        } else if (rc == QL_OK) {
            rc = copy_to_host(t->absmax, v.absmax, s.absmax, "absmax", msg, msg_len);
        }
        memcpy(t->codebook, v.codebook, sizeof t->codebook);
    } else if (row->layout == QT_CUDA_LAYOUT_AFFINE) {
        const qt_cuda_affine_view &v = d->affine;
        rc = copy_to_host(t->data, v.codes, s.codes, "codes", msg, msg_len);
        if (rc == QL_OK)
            rc = copy_to_host(t->scales, v.scales, s.scales, "scales", msg, msg_len);
        if (rc == QL_OK)
            rc = copy_to_host(t->zeros, v.zeros, s.zeros, "zeros", msg, msg_len);
    } else if (row->layout != QT_CUDA_LAYOUT_GGUF_SPLIT) {
        rc = copy_to_host(t->data, d->gguf.qs, s.codes, "blocks", msg, msg_len);
    } else {
        /* Join qs / d / m back into ggml's blocks. */
        const qt_cuda_gguf_view &v = d->gguf;
        const size_t nb = (size_t)v.n_blocks;
        const int bb = (int)row->block_bytes;
        const size_t qsb = (size_t)qm_gguf_qs_bytes(bb);
        uint8_t *qs = static_cast<uint8_t *>(malloc(s.codes));
        uint16_t *dd = static_cast<uint16_t *>(malloc(nb * sizeof(uint16_t)));
        uint16_t *mm = static_cast<uint16_t *>(calloc(nb, sizeof(uint16_t)));
        if (!qs || !dd || !mm) {
            say(msg, msg_len, "%s: cannot allocate %zu host bytes to join %s blocks", where,
                s.codes + 2 * nb * sizeof(uint16_t), kind_name(d->kind));
            rc = QL_ENOMEM;
        }
        if (rc == QL_OK)
            rc = copy_to_host(qs, v.qs, s.codes, "qs", msg, msg_len);
        if (rc == QL_OK)
            rc = copy_to_host(dd, v.d, s.d, "d", msg, msg_len);
        if (rc == QL_OK)
            rc = copy_to_host(mm, v.m, s.m, "m", msg, msg_len);
        if (rc == QL_OK)
            for (size_t b = 0; b < nb; b++)
                qm_gguf_join_block(t->data + b * (size_t)bb, bb, qs + b * qsb, dd[b], mm[b]);
        free(qs);
        free(dd);
        free(mm);
    }
    return rc;
}

extern "C" int qt_cuda_gather_rows_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *w,
                                        const int32_t *ids, int64_t n, float *out, void *stream,
                                        char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_gather_rows";
    if (!w || n < 0) {
        say(msg, msg_len, "%s: %s", where, !w ? "the tensor is NULL" : "n is negative");
        return QL_EINVAL;
    }
    if ((unsigned)w->kind >= QT_KIND_COUNT || !valid_shape(w->rows, w->cols)) {
        say(msg, msg_len, "%s: kind %d, shape %lld x %lld is not a tensor", where, (int)w->kind,
            (long long)w->rows, (long long)w->cols);
        return QL_EINVAL;
    }
    if (n == 0 || w->cols == 0)
        return QL_OK;
    if (n > INT64_MAX / w->cols) {
        say(msg, msg_len, "%s: %lld rows of %lld overflow", where, (long long)n,
            (long long)w->cols);
        return QL_EINVAL;
    }
    if (!ids || !out || w->rows == 0 || !row || !row->gather || !has_arrays(*row, *w)) {
        say(msg, msg_len, "%s: a NULL device pointer (ids %p, out %p) or an empty %s tensor", where,
            (const void *)ids, (void *)out, kind_name(w->kind));
        return QL_EINVAL;
    }
    if (row->layout == QT_CUDA_LAYOUT_BNB4 &&
        (w->q4.blocksize <= 0 || (w->q4.nested && w->q4.nested_blocksize <= 0))) {
        say(msg, msg_len, "%s: %s blocksize %d / nested %d is not positive", where,
            kind_name(w->kind), (int)w->q4.blocksize, (int)w->q4.nested_blocksize);
        return QL_EINVAL;
    }
    if (row->layout == QT_CUDA_LAYOUT_AFFINE &&
        (w->affine.group_size <= 0 || (w->affine.bits != 4 && w->affine.bits != 8))) {
        say(msg, msg_len, "%s: affine int%d group %d is not a layout", where, (int)w->affine.bits,
            (int)w->affine.group_size);
        return QL_EINVAL;
    }
    (void)cudaGetLastError(); /* the launch is checked with cudaGetLastError */
    const cudaError_t st = static_cast<cudaError_t>(row->gather(w, ids, n, out, stream));
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "launching the %s row gather (%lld rows of %lld)",
                           kind_name(w->kind), (long long)n, (long long)w->cols);
    return QL_OK;
}

/*
 * qt_cuda_quantfmt.cu - the checkpoint formats FP8 (transformers'
 * finegrained FP8, block scales in f32 or UE8M0; compressed-tensors' and
 * fbgemm's, scales in f32, bf16 or f16), CT_INT (compressed-tensors' int4 /
 * int8, scales as stored, int8 zero points), GPTQ and AWQ (GEMM) on the
 * device: their arrays in a qt_cuda_tensor (upload, allocate alike,
 * download, release, for qt_cuda_tensor.cu), their dequantize (the GEMM's
 * route to cuBLASLt and a merge's W) and their row gather. Their matvec is
 * in qt_cuda_matmul.cu with the other kinds'.
 *
 * Why shaped so:
 *   - The device holds what the checkpoint holds, as the CPU does: FP8 codes
 *     and block scales in their stored width (a UE8M0 byte stays a byte),
 *     GPTQ/AWQ packed words, f16 scales, packed zeros and g_idx as they are;
 *     nothing is repacked or widened on upload, so a download gives the
 *     host's bytes back and the digest of what the device serves is the
 *     CPU's.
 *   - Every element is internal/qt_cuda_quantfmt.h's, the CPU rows'
 *     arithmetic, and this file is built with --fmad=false like the rest:
 *     the dequantized weight is the CPU's bit for bit.
 *   - Merges into these kinds requantize on the CPU (quant_fp8.c,
 *     quant_gptq.c; their rows in qt_cuda_kinds.c have no requantize), and
 *     the backend uploads the merged host tensor, so the served bytes are
 *     the CPU merge's.
 *
 * Errors and ownership as in qt_cuda_ops.h.
 */
#include "qt_cuda_ops.h"

#include <cstdint>
#include <cstring>

#include <cuda_runtime.h>

#include "qt_cuda_internal.h"
#include "qt_cuda_kinds.h"
#include "qt_cuda_quantfmt.h"

namespace
{

constexpr int kThreadsPerBlock = 256;

/* The bytes of each array of the FP8 / GPTQ views. */
struct quantfmt_sizes {
    size_t codes;  /* FP8 codes, GPTQ/AWQ qweight */
    size_t scales; /* FP8 block scales, GPTQ/AWQ f16 scales */
    size_t zeros;  /* GPTQ/AWQ qzeros */
    size_t g_idx;  /* GPTQ/AWQ g_idx */
    size_t total() const
    {
        return codes + scales + zeros + g_idx;
    }
};

/* The bytes of one scale of dtype d (qt_scale_dtype_size's, which the
 * device library does not link). */
size_t scale_bytes(qt_scale_dtype d)
{
    return d == QT_SCALE_E8M0 ? 1u : d == QT_SCALE_F32 ? sizeof(float) : sizeof(uint16_t);
}

/* FP8: rows * cols codes; CT_INT: rows * row_stride, and a zero byte per
 * scale when asymmetric. */
quantfmt_sizes fp8_sizes(const qt_cuda_fp8_view &v, int64_t rows, int64_t cols)
{
    quantfmt_sizes s = {};
    const size_t n = (size_t)(v.scale_rows * v.scale_cols);
    s.codes = v.ct_int ? (size_t)rows * (size_t)v.row_stride : (size_t)(rows * cols);
    s.scales = n * scale_bytes(v.scale_dtype);
    s.zeros = v.ct_int && v.asymmetric ? n : 0;
    return s;
}

quantfmt_sizes gptq_sizes(int64_t rows, int64_t cols, int32_t bits, int64_t groups)
{
    quantfmt_sizes s = {};
    s.codes = (size_t)(rows * cols * bits / 8);
    s.zeros = (size_t)(groups * rows * bits / 8);
    s.scales = (size_t)(groups * rows) * sizeof(uint16_t);
    s.g_idx = (size_t)cols * sizeof(int32_t);
    return s;
}

quantfmt_sizes sizes_of(const qt_cuda_kind_ops &row, const qt_cuda_tensor &d)
{
    if (row.layout == QT_CUDA_LAYOUT_FP8)
        return fp8_sizes(d.fp8, d.rows, d.cols);
    if (row.layout == QT_CUDA_LAYOUT_GPTQ)
        return gptq_sizes(d.rows, d.cols, d.gptq.bits, d.gptq.groups);
    return quantfmt_sizes{};
}

/* device_alloc of `bytes`, then a copy of src when there is one (NULL: an
 * uninitialised array, for alloc_like). */
template <typename T>
int upload_array(const T **dst, const void *src, size_t bytes, const char *what, char *msg,
                 size_t msg_len)
{
    T *p = nullptr;
    int rc = device_alloc(&p, bytes, what, msg, msg_len);
    *dst = p;
    if (rc == QL_OK && p && src) {
        cudaError_t st = cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
        if (st != cudaSuccess)
            return cuda_failed(st, msg, msg_len, "cudaMemcpy(%s, %zu bytes)", what, bytes);
    }
    return rc;
}

/* The arrays of d's view (its layout fields set), copied from host tensor
 * t's, or uninitialised when t is NULL. */
int view_arrays(const qt_cuda_kind_ops &row, qt_cuda_tensor *d, const qtensor *t, char *msg,
                size_t msg_len)
{
    const quantfmt_sizes s = sizes_of(row, *d);
    if (row.layout == QT_CUDA_LAYOUT_FP8) {
        qt_cuda_fp8_view &v = d->fp8;
        int rc = upload_array(&v.codes, t ? t->data : nullptr, s.codes, "fp8 codes", msg, msg_len);
        const uint8_t *scales = nullptr;
        if (rc == QL_OK)
            rc = upload_array(&scales, t ? t->block_scales : nullptr, s.scales, "fp8 block scales",
                              msg, msg_len);
        v.scales = scales;
        if (rc == QL_OK && s.zeros > 0)
            rc = upload_array(&v.zeros, t ? t->block_zeros : nullptr, s.zeros, "ct_int zeros", msg,
                              msg_len);
        return rc;
    }
    qt_cuda_gptq_view &v = d->gptq;
    int rc = upload_array(&v.qweight, t ? t->data : nullptr, s.codes, "qweight", msg, msg_len);
    if (rc == QL_OK)
        rc = upload_array(&v.qzeros, t ? t->gptq_qzeros : nullptr, s.zeros, "qzeros", msg, msg_len);
    if (rc == QL_OK)
        rc = upload_array(&v.scales, t ? t->gptq_scales : nullptr, s.scales, "f16 scales", msg,
                          msg_len);
    if (rc == QL_OK)
        rc = upload_array(&v.g_idx, t ? t->gptq_g_idx : nullptr, s.g_idx, "g_idx", msg, msg_len);
    return rc;
}

/* The FP8 or CT_INT host tensor's layout, checked: QL_OK or msg says what
 * is wrong. */
int check_fp8(const qt_cuda_kind_ops &row, const qtensor *t, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_tensor_upload";
    const bool ct = row.ct_int_codes;
    const bool dtype_ok = t->scale_dtype == QT_SCALE_F32 || t->scale_dtype == QT_SCALE_BF16 ||
                          t->scale_dtype == QT_SCALE_F16 ||
                          (!ct && t->scale_dtype == QT_SCALE_E8M0);
    if (t->block_rows < 1 || t->block_cols < 1 ||
        t->scale_rows != ceil_div(t->rows, t->block_rows) ||
        t->scale_cols != ceil_div(t->cols, t->block_cols) || !dtype_ok) {
        say(msg, msg_len,
            "%s: %s blocks %d x %d with a [%lld, %lld] scale grid (dtype %d) do not tile a "
            "%lld x %lld weight",
            where, kind_name(t->kind), (int)t->block_rows, (int)t->block_cols,
            (long long)t->scale_rows, (long long)t->scale_cols, (int)t->scale_dtype,
            (long long)t->rows, (long long)t->cols);
        return QL_EINVAL;
    }
    const bool bits_ok = t->ct_signed_codes ? t->bits == 8 : t->bits == 4 || t->bits == 8;
    const size_t stride =
        t->ct_signed_codes ? (size_t)t->cols : (size_t)((t->cols * t->bits + 31) / 32) * 4;
    if (ct && (!bits_ok || t->row_stride != stride)) {
        say(msg, msg_len,
            "%s: ct_int int%d with rows of %zu bytes is not a layout of a %lld-column "
            "weight",
            where, (int)t->bits, t->row_stride, (long long)t->cols);
        return QL_EINVAL;
    }
    const size_t codes = ct ? (size_t)t->rows * t->row_stride : (size_t)(t->rows * t->cols);
    if (t->rows * t->cols > 0 && (!t->data || t->data_bytes < codes || !t->block_scales)) {
        say(msg, msg_len, "%s: %s tensor %lld x %lld has no codes or block scales", where,
            kind_name(t->kind), (long long)t->rows, (long long)t->cols);
        return QL_EINVAL;
    }
    return QL_OK;
}

/* The GPTQ/AWQ host tensor's layout, checked (g_idx too: a device read
 * outside the groups would fault, not fail). */
int check_gptq(const qt_cuda_kind_ops &row, const qtensor *t, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_tensor_upload";
    const bool awq = row.awq_packing;
    const int32_t per = t->bits > 0 ? 32 / t->bits : 1;
    if ((t->bits != 4 && (t->bits != 8 || awq)) || t->rows % per != 0 || t->cols % per != 0 ||
        t->gptq_groups < 1 || (t->gptq_zero_offset != 0 && t->gptq_zero_offset != 1)) {
        say(msg, msg_len,
            "%s: %s int%d with %lld groups (zero offset %d) is not a layout of a %lld x %lld "
            "weight",
            where, kind_name(t->kind), (int)t->bits, (long long)t->gptq_groups,
            (int)t->gptq_zero_offset, (long long)t->rows, (long long)t->cols);
        return QL_EINVAL;
    }
    const quantfmt_sizes s = gptq_sizes(t->rows, t->cols, t->bits, t->gptq_groups);
    if (t->rows * t->cols > 0 && (!t->data || t->data_bytes < s.codes || !t->gptq_qzeros ||
                                  !t->gptq_scales || !t->gptq_g_idx)) {
        say(msg, msg_len, "%s: %s tensor %lld x %lld is missing qweight, qzeros, scales or g_idx",
            where, kind_name(t->kind), (long long)t->rows, (long long)t->cols);
        return QL_EINVAL;
    }
    for (int64_t c = 0; c < t->cols; c++)
        if (t->gptq_g_idx[c] < 0 || t->gptq_g_idx[c] >= t->gptq_groups) {
            say(msg, msg_len, "%s: %s g_idx[%lld] = %d is outside the %lld groups", where,
                kind_name(t->kind), (long long)c, (int)t->gptq_g_idx[c], (long long)t->gptq_groups);
            return QL_EINVAL;
        }
    return QL_OK;
}

/* ---- element kernels ------------------------------------------------------ */

__device__ __forceinline__ void put(float *out, int64_t i, float v)
{
    out[i] = v;
}

__device__ __forceinline__ void put(uint16_t *out, int64_t i, float v)
{
    out[i] = qm_f32_to_bf16(v);
}

/* Element (r, c) of the FP8 or GPTQ/AWQ view of t. */
template <qt_cuda_layout kLayout>
__device__ __forceinline__ float element_of(const qt_cuda_tensor &t, int64_t r, int64_t c)
{
    if constexpr (kLayout == QT_CUDA_LAYOUT_FP8)
        return qt_cuda_fp8_at(t.fp8, r, c);
    else
        return qt_cuda_gptq_at(t.gptq, r, c);
}

/* out[e] = element e of t, row-major, f32 or bf16; grid-stride. */
template <qt_cuda_layout kLayout, typename OutT>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_kernel(const __grid_constant__ qt_cuda_tensor t, OutT *__restrict__ out)
{
    const int64_t n = t.rows * t.cols;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride)
        put(out, e, element_of<kLayout>(t, e / t.cols, e % t.cols));
}

/* out[i * cols + c] = element (ids[i], c) of t, i < n; grid-stride. */
template <qt_cuda_layout kLayout>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_kernel(const __grid_constant__ qt_cuda_tensor t, const int32_t *__restrict__ ids,
                  int64_t n, float *__restrict__ out)
{
    const int64_t total = n * t.cols;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride)
        out[o] = element_of<kLayout>(t, (int64_t)ids[o / t.cols], o % t.cols);
}

template <qt_cuda_layout kLayout>
int dequantize(const qt_cuda_tensor *t, void *out, qt_cuda_out_dtype out_dtype, void *stream,
               char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_dequantize";
    const int64_t n = t->rows * t->cols;
    if (n == 0)
        return QL_OK;
    if (!out) {
        say(msg, msg_len, "%s: out is NULL", where);
        return QL_EINVAL;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for(n, kThreadsPerBlock);
    (void)cudaGetLastError();
    if (out_dtype == QT_CUDA_OUT_BF16)
        dequantize_kernel<kLayout, uint16_t>
            <<<grid, kThreadsPerBlock, 0, s>>>(*t, static_cast<uint16_t *>(out));
    else
        dequantize_kernel<kLayout, float>
            <<<grid, kThreadsPerBlock, 0, s>>>(*t, static_cast<float *>(out));
    cudaError_t st = cudaGetLastError();
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "launching the %s dequantize kernel (%lld elements)",
                           kind_name(t->kind), (long long)n);
    return QL_OK;
}

template <qt_cuda_layout kLayout>
int gather(const qt_cuda_tensor *w, const int32_t *ids, int64_t n, float *out, void *stream)
{
    const unsigned grid = grid_for(n * w->cols, kThreadsPerBlock);
    gather_kernel<kLayout>
        <<<grid, kThreadsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(*w, ids, n, out);
    return cudaGetLastError();
}

} // namespace

/* ---- the rows' operations (qt_cuda_kinds.c) -------------------------------- */

extern "C" int qt_cuda_dequantize_as_fp8(const qt_cuda_kind_ops *, const qt_cuda_tensor *t,
                                         void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                         char *msg, size_t msg_len)
{
    return dequantize<QT_CUDA_LAYOUT_FP8>(t, out, out_dtype, stream, msg, msg_len);
}

extern "C" int qt_cuda_dequantize_as_gptq(const qt_cuda_kind_ops *, const qt_cuda_tensor *t,
                                          void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                          char *msg, size_t msg_len)
{
    return dequantize<QT_CUDA_LAYOUT_GPTQ>(t, out, out_dtype, stream, msg, msg_len);
}

extern "C" int qt_cuda_gather_as_fp8(const qt_cuda_tensor *w, const int32_t *ids, int64_t n,
                                     float *out, void *stream)
{
    return gather<QT_CUDA_LAYOUT_FP8>(w, ids, n, out, stream);
}

extern "C" int qt_cuda_gather_as_gptq(const qt_cuda_tensor *w, const int32_t *ids, int64_t n,
                                      float *out, void *stream)
{
    return gather<QT_CUDA_LAYOUT_GPTQ>(w, ids, n, out, stream);
}

/* ---- the arrays, for qt_cuda_tensor.cu -------------------------------------- */

extern "C" int qt_cuda_quantfmt_upload(const qt_cuda_kind_ops *row, const qtensor *t,
                                       qt_cuda_tensor *d, char *msg, size_t msg_len)
{
    if (row->layout == QT_CUDA_LAYOUT_FP8) {
        int rc = check_fp8(*row, t, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        qt_cuda_fp8_view &v = d->fp8;
        v.rows = t->rows;
        v.cols = t->cols;
        v.block_rows = t->block_rows;
        v.block_cols = t->block_cols;
        v.scale_rows = t->scale_rows;
        v.scale_cols = t->scale_cols;
        v.e8m0 = t->scale_dtype == QT_SCALE_E8M0;
        v.scale_dtype = t->scale_dtype;
        v.ct_int = row->ct_int_codes;
        if (v.ct_int) {
            v.signed_codes = t->ct_signed_codes;
            v.bits = t->bits;
            v.row_stride = (int64_t)t->row_stride;
            v.asymmetric = t->block_zeros != nullptr;
        }
    } else {
        int rc = check_gptq(*row, t, msg, msg_len);
        if (rc != QL_OK)
            return rc;
        qt_cuda_gptq_view &v = d->gptq;
        v.kind = t->kind;
        v.awq = row->awq_packing;
        v.rows = t->rows;
        v.cols = t->cols;
        v.bits = t->bits;
        v.group_size = t->group_size;
        v.groups = t->gptq_groups;
        v.zero_offset = t->gptq_zero_offset;
    }
    return view_arrays(*row, d, t, msg, msg_len);
}

extern "C" int qt_cuda_quantfmt_release(qt_cuda_tensor *d, int rc, char *msg, size_t msg_len)
{
    rc = free_device(d->fp8.codes, "fp8 codes", rc, msg, msg_len);
    rc = free_device(d->fp8.scales, "fp8 block scales", rc, msg, msg_len);
    rc = free_device(d->fp8.zeros, "ct_int zeros", rc, msg, msg_len);
    rc = free_device(d->gptq.qweight, "qweight", rc, msg, msg_len);
    rc = free_device(d->gptq.qzeros, "qzeros", rc, msg, msg_len);
    rc = free_device(d->gptq.scales, "f16 scales", rc, msg, msg_len);
    rc = free_device(d->gptq.g_idx, "g_idx", rc, msg, msg_len);
    memset(&d->fp8, 0, sizeof d->fp8);
    memset(&d->gptq, 0, sizeof d->gptq);
    return rc;
}

extern "C" int qt_cuda_quantfmt_alloc_like(const qt_cuda_kind_ops *row, qt_cuda_tensor *out,
                                           char *msg, size_t msg_len)
{
    return view_arrays(*row, out, nullptr, msg, msg_len);
}

extern "C" int qt_cuda_quantfmt_download(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d,
                                         qtensor *h, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_tensor_download";
    const quantfmt_sizes s = sizes_of(*row, *d);
    if (row->layout == QT_CUDA_LAYOUT_FP8) {
        const qt_cuda_fp8_view &v = d->fp8;
        if (h->block_rows != v.block_rows || h->block_cols != v.block_cols ||
            h->scale_dtype != v.scale_dtype || !h->data || h->data_bytes < s.codes ||
            !h->block_scales || (s.zeros > 0 && !h->block_zeros) ||
            (v.ct_int && (h->bits != v.bits || h->ct_signed_codes != v.signed_codes))) {
            say(msg, msg_len,
                "%s: the host %s tensor (blocks %d x %d, scale dtype %d) does not match the "
                "device's (blocks %d x %d, scale dtype %d) or has no room",
                where, kind_name(h->kind), (int)h->block_rows, (int)h->block_cols,
                (int)h->scale_dtype, (int)v.block_rows, (int)v.block_cols, (int)v.scale_dtype);
            return QL_EINVAL;
        }
        int rc = copy_to_host(h->data, v.codes, s.codes, "fp8 codes", msg, msg_len);
        if (rc == QL_OK)
            rc =
                copy_to_host(h->block_scales, v.scales, s.scales, "fp8 block scales", msg, msg_len);
        if (rc == QL_OK && s.zeros > 0)
            rc = copy_to_host(h->block_zeros, v.zeros, s.zeros, "ct_int zeros", msg, msg_len);
        return rc;
    }
    const qt_cuda_gptq_view &v = d->gptq;
    if (h->bits != v.bits || h->gptq_groups != v.groups || h->gptq_zero_offset != v.zero_offset ||
        !h->data || h->data_bytes < s.codes || !h->gptq_qzeros || !h->gptq_scales ||
        !h->gptq_g_idx) {
        say(msg, msg_len,
            "%s: the host %s tensor (int%d, %lld groups, zero offset %d) does not match the "
            "device's (int%d, %lld groups, zero offset %d) or has no room",
            where, kind_name(h->kind), (int)h->bits, (long long)h->gptq_groups,
            (int)h->gptq_zero_offset, (int)v.bits, (long long)v.groups, (int)v.zero_offset);
        return QL_EINVAL;
    }
    int rc = copy_to_host(h->data, v.qweight, s.codes, "qweight", msg, msg_len);
    if (rc == QL_OK)
        rc = copy_to_host(h->gptq_qzeros, v.qzeros, s.zeros, "qzeros", msg, msg_len);
    if (rc == QL_OK)
        rc = copy_to_host(h->gptq_scales, v.scales, s.scales, "f16 scales", msg, msg_len);
    if (rc == QL_OK)
        rc = copy_to_host(h->gptq_g_idx, v.g_idx, s.g_idx, "g_idx", msg, msg_len);
    return rc;
}

extern "C" size_t qt_cuda_quantfmt_bytes(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d)
{
    return sizes_of(*row, *d).total();
}

extern "C" bool qt_cuda_quantfmt_has_arrays(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d)
{
    if (row->layout == QT_CUDA_LAYOUT_FP8)
        return d->fp8.codes && d->fp8.scales && (!d->fp8.asymmetric || d->fp8.zeros);
    return d->gptq.qweight && d->gptq.qzeros && d->gptq.scales && d->gptq.g_idx;
}

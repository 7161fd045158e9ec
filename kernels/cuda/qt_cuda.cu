/*
 * qt_cuda.cu - the first CUDA kernels of qlserve: device discovery, the
 * bitsandbytes NF4/FP4 dequantize kernel, the AFFINE and GGUF (Q4_0, Q4_1,
 * Q8_0, Q5_0, Q5_1, Q2_K ... Q6_K, IQ4_NL, IQ4_XS, MXFP4) dequantize kernels, with
 * the host plumbing around them.
 *
 * Why shaped so:
 *   - Bit-identical to the CPU reference. Every value is computed by the
 *     QL_HD helpers of kernels/math/qt_math.h (qm_nibble, qm_nested_absmax,
 *     qm_4bit_value, qm_f32_to_bf16), the very functions qt_dequantize_rows
 *     runs on the CPU. This file is built with --fmad=false: nvcc would
 *     otherwise fuse qm_nested_absmax's multiply and its separate add into
 *     one FMA, and the nested absmax would differ from the CPU's and from
 *     bitsandbytes' in the last bit.
 *   - Memory bound, so shaped for bandwidth: each thread takes 16 bytes of
 *     packed codes (one 16-byte load, 32 elements); the warp then writes its
 *     1024 outputs through a swizzled shared-memory buffer, so each store
 *     instruction covers 512 contiguous bytes (in f32 the output is 8x the
 *     input, so the stores are most of the traffic). bitsandbytes
 *     blocksizes are powers of two >= 32, so the 32 elements of a thread
 *     always share one absmax block: one absmax (or nested absmax) per
 *     thread, not per element. The codebook (and the
 *     256-entry nested map) sit in shared memory, where 16 distinct lookups
 *     per warp never conflict. A grid-stride loop covers tensors larger
 *     than the grid; the last, partial warp and unaligned pointers take a
 *     byte-by-byte path.
 *   - AFFINE and GGUF take one element per thread, grid-stride, and call
 *     qt_math.h's whole-element functions (qm_affine_element,
 *     qm_q4_0_split_element, ...) with the element's index, exactly as
 *     tests/test_qt_math.c does on the CPU; Q4_0, Q4_1 and Q8_0 live on the
 *     device in the split layout (qs, d, m arrays; see qt_cuda.h), which
 *     the upload makes from ggml's blocks on the host, the other GGUF kinds
 *     in ggml's whole blocks, read by qm_q5_0_block_value ...
 *     qm_iq4_xs_block_value (qt_cuda_whole_element); consecutive threads write
 *     consecutive outputs, so the stores coalesce. They are a correct first
 *     version, not yet shaped for bandwidth like the 4-bit kernel.
 *   - One kernel instantiation per GGUF kind (qt_cuda_block<K> of
 *     internal/qt_cuda_blocks.h); the row of qt_cuda_kinds.c names it
 *     (qt_cuda_dequantize_as_q4_0 ...), so nothing here chooses by the kind.
 *     The GGUF entry points of qt_cuda.h are in qt_cuda_kinds.c, which looks
 *     up the kind's row and hands it to the *_with functions here.
 *   - Never aborts. Each CUDA call's status is checked; a failure becomes a
 *     QT_E* code and a sentence naming the call and cudaGetErrorString's
 *     text, and what the call allocated is freed on the way out.
 *
 * Ownership is stated in qt_cuda.h, the public header of kernels/cuda/.
 */
#include "cuda/qt_cuda.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "qt_cuda_blocks.h"
#include "qt_cuda_internal.h"
#include "qt_cuda_kinds.h"
#include "qt_math.h"

/* Set by kernels/cuda/CMakeLists.txt from the architectures it compiles. */
#ifndef QT_CUDA_ARCHS
#define QT_CUDA_ARCHS "unknown"
#endif

namespace
{

/* One thread: 16 bytes of codes = 32 elements = one 16-byte load. */
constexpr int kThreadsPerBlock = 256;
constexpr int kBytesPerThread = 16;
constexpr int kElemsPerThread = 2 * kBytesPerThread;

/*
 * The geometry both the host tensor and the device view must satisfy: a
 * blocksize the kernel can take (a multiple of its 32-element chunk, which
 * every bitsandbytes blocksize is) and enough absmax entries for every
 * element. `where` names the tensor's origin in the message.
 */
int check_4bit_geometry(const char *where, qt_kind kind, int64_t n, int32_t blocksize,
                        int64_t n_blocks, bool nested, int32_t nested_blocksize,
                        int64_t n_nested_blocks, char *msg, size_t msg_len)
{
    if (kind != QT_NF4 && kind != QT_FP4) {
        say(msg, msg_len, "%s: kind %s is not one the CUDA 4-bit dequantize handles (nf4, fp4)",
            where, kind_name(kind));
        return QL_EUNSUPPORTED;
    }
    if (n < 0) {
        say(msg, msg_len, "%s: %s tensor has a negative element count %lld", where, kind_name(kind),
            (long long)n);
        return QL_EINVAL;
    }
    if (blocksize <= 0 || blocksize % kElemsPerThread != 0) {
        say(msg, msg_len,
            "%s: %s blocksize %d is not a positive multiple of %d (bitsandbytes uses "
            "powers of two from 32 to 4096)",
            where, kind_name(kind), (int)blocksize, kElemsPerThread);
        return QL_EINVAL;
    }
    if (n_blocks < ceil_div(n, blocksize)) {
        say(msg, msg_len, "%s: %s n_blocks %lld is less than ceil(%lld / %d)", where,
            kind_name(kind), (long long)n_blocks, (long long)n, (int)blocksize);
        return QL_EINVAL;
    }
    if (nested) {
        if (nested_blocksize <= 0) {
            say(msg, msg_len, "%s: %s nested_blocksize %d is not positive", where, kind_name(kind),
                (int)nested_blocksize);
            return QL_EINVAL;
        }
        if (n_nested_blocks < ceil_div(n_blocks, nested_blocksize)) {
            say(msg, msg_len, "%s: %s n_nested_blocks %lld is less than ceil(%lld / %d)", where,
                kind_name(kind), (long long)n_nested_blocks, (long long)n_blocks,
                (int)nested_blocksize);
            return QL_EINVAL;
        }
    }
    return QL_OK;
}

/* ---- the kernel -------------------------------------------------------- */

/* Full unrolling on the device, where it turns the 32-element arrays into
 * registers; the host compiler (which sees these __host__ __device__
 * functions too) would warn about the CUDA pragma. */
#ifdef __CUDA_ARCH__
#define QL_UNROLL _Pragma("unroll")
#else
#define QL_UNROLL
#endif

/* Read-only loads: through the non-coherent cache on the device, plain on
 * the host (where these functions run only in checks of their indexing). */
__host__ __device__ __forceinline__ void load_16_bytes(uint8_t (&dst)[kBytesPerThread],
                                                       const uint8_t *src)
{
#ifdef __CUDA_ARCH__
    const uint4 q = __ldg(reinterpret_cast<const uint4 *>(src));
    memcpy(dst, &q, sizeof dst);
#else
    memcpy(dst, src, sizeof dst);
#endif
}

template <typename T> __host__ __device__ __forceinline__ T load_readonly(const T *p)
{
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

/*
 * The 32 values of chunk `chunk` (elements [32 * chunk, 32 * chunk + 32);
 * values past n_elements are garbage the caller does not store). codebook
 * and nested_code are v's tables wherever the caller keeps them (shared
 * memory on the device). kVectorLoad: the chunk is whole and the codes
 * 16-byte aligned, so one 16-byte load reads it.
 */
template <bool kNested, bool kVectorLoad>
__host__ __device__ __forceinline__ void
chunk_values(const qt_cuda_4bit_view &v, const float *codebook, const float *nested_code,
             int64_t chunk, float (&vals)[kElemsPerThread])
{
    const int64_t e0 = chunk * kElemsPerThread;
    const int64_t byte0 = chunk * kBytesPerThread;

    uint8_t bytes[kBytesPerThread];
    if (kVectorLoad) {
        load_16_bytes(bytes, v.codes + byte0);
    } else {
        const int64_t n_bytes = (v.n_elements + 1) / 2;
        QL_UNROLL
        for (int j = 0; j < kBytesPerThread; j++)
            bytes[j] = byte0 + j < n_bytes ? load_readonly(v.codes + byte0 + j) : 0;
    }

    /* One absmax for the chunk: e0 and blocksize are multiples of 32. */
    const int64_t b = e0 / v.blocksize;
    const float absmax = kNested ? qm_nested_absmax(v.absmax_codes, nested_code, v.nested_absmax,
                                                    v.nested_blocksize, v.nested_offset, b)
                                 : load_readonly(v.absmax + b);

    QL_UNROLL
    for (int j = 0; j < kElemsPerThread; j++)
        vals[j] = qm_4bit_value(codebook, qm_nibble(bytes, j), absmax);
}

/* 32 output values as 16-byte words: 8 for f32, 4 for bf16. */
template <typename OutT> struct out_words {
    static constexpr int count = kElemsPerThread * (int)sizeof(OutT) / 16;
};

__host__ __device__ __forceinline__ uint32_t f32_as_u32(float f)
{
    return qm_f32_bits(f);
}

__host__ __device__ __forceinline__ void pack_words(const float (&v)[kElemsPerThread],
                                                    uint4 (&w)[out_words<float>::count])
{
    QL_UNROLL
    for (int k = 0; k < out_words<float>::count; k++)
        w[k] = make_uint4(f32_as_u32(v[4 * k]), f32_as_u32(v[4 * k + 1]), f32_as_u32(v[4 * k + 2]),
                          f32_as_u32(v[4 * k + 3]));
}

__host__ __device__ __forceinline__ void pack_words(const float (&v)[kElemsPerThread],
                                                    uint4 (&w)[out_words<uint16_t>::count])
{
    QL_UNROLL
    for (int k = 0; k < out_words<uint16_t>::count; k++) {
        uint32_t u[4];
        QL_UNROLL
        for (int i = 0; i < 4; i++) {
            /* little endian: the even element at the lower address */
            u[i] = (uint32_t)qm_f32_to_bf16(v[8 * k + 2 * i]) |
                   ((uint32_t)qm_f32_to_bf16(v[8 * k + 2 * i + 1]) << 16);
        }
        w[k] = make_uint4(u[0], u[1], u[2], u[3]);
    }
}

/* The first `count` of 32 values, one store each (tails, unaligned out). */
__host__ __device__ __forceinline__ void store_values(float *out, const float (&v)[kElemsPerThread],
                                                      int count)
{
    QL_UNROLL
    for (int j = 0; j < kElemsPerThread; j++)
        if (j < count)
            out[j] = v[j];
}

__host__ __device__ __forceinline__ void store_values(uint16_t *out,
                                                      const float (&v)[kElemsPerThread], int count)
{
    QL_UNROLL
    for (int j = 0; j < kElemsPerThread; j++)
        if (j < count)
            out[j] = qm_f32_to_bf16(v[j]);
}

/*
 * The slow path for one chunk: byte loads, one store per element, clipped
 * to n_elements. Used for the partial last warp of the tensor and for
 * pointers that are not 16-byte aligned.
 */
template <bool kNested, typename OutT>
__host__ __device__ __forceinline__ void
dequantize_chunk_scalar(const qt_cuda_4bit_view &v, const float *codebook, const float *nested_code,
                        OutT *out, int64_t chunk)
{
    const int64_t e0 = chunk * kElemsPerThread;
    const int64_t left = v.n_elements - e0;
    float vals[kElemsPerThread];
    chunk_values<kNested, false>(v, codebook, nested_code, chunk, vals);
    store_values(out + e0, vals, (int)(left < kElemsPerThread ? left : kElemsPerThread));
}

/*
 * Where in a warp's staging buffer lane `lane` puts its 16-byte word k of
 * `words` (8 for f32, 4 for bf16). Each lane writes its words, then the
 * warp reads the buffer back in output order, 32 consecutive words per
 * step, so every global store of the warp covers 512 contiguous bytes
 * (instead of 32 scattered 16-byte pieces, each in its own cache line). The
 * XOR swizzle keeps both phases free of bank conflicts: a 16-byte shared
 * access is served 8 lanes at a time, and those 8 lanes' words land in 8
 * distinct 16-byte bank groups whether they are 8 lanes writing word k or
 * 8 consecutive words being read back.
 */
__host__ __device__ __forceinline__ int stage_slot(int lane, int k, int words)
{
    return lane * words + (k ^ ((lane * words / 8) % words));
}

/*
 * One thread per 32-element chunk, grid-stride; a warp's 32 lanes take 32
 * consecutive chunks (1024 elements). The view is a __grid_constant__
 * argument: its codebooks are copied from the parameter space into shared
 * memory once per block. kAligned (codes and out 16-byte aligned): every
 * warp whose 1024 elements all exist loads 16 bytes per lane and stores
 * through the staging buffer; the rest goes through the scalar path.
 */
template <bool kNested, typename OutT, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_4bit_kernel(const __grid_constant__ qt_cuda_4bit_view v, OutT *__restrict__ out,
                           int64_t n_chunks)
{
    constexpr int kWords = out_words<OutT>::count;
    __shared__ float codebook[16];
    __shared__ float nested_code[kNested ? 256 : 1];
    __shared__ uint4 stage[kAligned ? kThreadsPerBlock * kWords : 1];

    for (int i = threadIdx.x; i < 16; i += blockDim.x)
        codebook[i] = v.codebook[i];
    if (kNested)
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            nested_code[i] = v.nested_code[i];
    __syncthreads();

    const int lane = (int)(threadIdx.x & 31u);
    uint4 *warp_stage = stage + (threadIdx.x & ~31u) * kWords;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x; /* a multiple of 32 */
    for (int64_t chunk = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; chunk < n_chunks;
         chunk += stride) {
        const int64_t warp_chunk0 = chunk - lane;
        /* Warp-uniform, and true only when all 32 lanes are in this
         * iteration, so __syncwarp() below sees the full warp. */
        const bool warp_whole = (warp_chunk0 + 32) * kElemsPerThread <= v.n_elements;
        if (kAligned && warp_whole) {
            float vals[kElemsPerThread];
            chunk_values<kNested, true>(v, codebook, nested_code, chunk, vals);
            uint4 words[kWords];
            pack_words(vals, words);
            QL_UNROLL
            for (int k = 0; k < kWords; k++)
                warp_stage[stage_slot(lane, k, kWords)] = words[k];
            __syncwarp();
            uint4 *dst = reinterpret_cast<uint4 *>(out + warp_chunk0 * kElemsPerThread);
            QL_UNROLL
            for (int k = 0; k < kWords; k++) {
                const int word = k * 32 + lane; /* in output order */
                dst[word] = warp_stage[stage_slot(word / kWords, word % kWords, kWords)];
            }
            __syncwarp(); /* the buffer is reused next iteration */
        } else {
            dequantize_chunk_scalar<kNested, OutT>(v, codebook, nested_code, out, chunk);
        }
    }
}

template <bool kNested, typename OutT, bool kAligned>
cudaError_t launch_dequantize(const qt_cuda_4bit_view &v, void *out, int64_t n_chunks,
                              cudaStream_t stream)
{
    const unsigned blocks = grid_for(n_chunks, kThreadsPerBlock);
    dequantize_4bit_kernel<kNested, OutT, kAligned>
        <<<blocks, kThreadsPerBlock, 0, stream>>>(v, static_cast<OutT *>(out), n_chunks);
    return cudaGetLastError();
}

template <bool kNested>
cudaError_t launch_for_output(const qt_cuda_4bit_view &v, void *out, qt_cuda_out_dtype dtype,
                              bool aligned, int64_t n_chunks, cudaStream_t stream)
{
    if (dtype == QT_CUDA_OUT_BF16)
        return aligned ? launch_dequantize<kNested, uint16_t, true>(v, out, n_chunks, stream)
                       : launch_dequantize<kNested, uint16_t, false>(v, out, n_chunks, stream);
    return aligned ? launch_dequantize<kNested, float, true>(v, out, n_chunks, stream)
                   : launch_dequantize<kNested, float, false>(v, out, n_chunks, stream);
}

/* ---- AFFINE and GGUF kernels ----------------------------------------- */

__host__ __device__ __forceinline__ void store_value(float *out, int64_t i, float v)
{
    out[i] = v;
}

__host__ __device__ __forceinline__ void store_value(uint16_t *out, int64_t i, float v)
{
    out[i] = qm_f32_to_bf16(v);
}

/* One thread per element of the row-major output. */
template <typename OutT>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_affine_kernel(const __grid_constant__ qt_cuda_affine_view v, OutT *__restrict__ out)
{
    const int64_t n = v.rows * v.cols;
    const float mid = qm_affine_mid(v.qmin, v.qmax);
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const int64_t r = e / v.cols;
        const int64_t c = e - r * v.cols;
        store_value(out, e,
                    qm_affine_element(v.codes, v.row_stride, v.bits, v.qmin, v.float_zero, mid,
                                      v.group_size, v.groups_per_row, v.scales, v.zeros, r, c));
    }
}

/* One thread per element of the split layout; element e is element e % 32
 * of block e / 32. */
template <qt_kind kKind, typename OutT>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_gguf_kernel(const uint8_t *__restrict__ qs, const uint16_t *__restrict__ d,
                           const uint16_t *__restrict__ m, OutT *__restrict__ out, int64_t n)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        store_value(out, e, qt_cuda_block<kKind>::element(qs, d, m, e));
    }
}

/* One thread per element of a kind kept in whole ggml blocks. */
template <qt_kind kKind, typename OutT>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_gguf_whole_kernel(const uint8_t *__restrict__ blocks, OutT *__restrict__ out,
                                 int64_t n)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride)
        store_value(out, e, qt_cuda_whole_element<kKind>(blocks, e));
}

template <typename OutT>
cudaError_t launch_affine(const qt_cuda_affine_view &v, void *out, cudaStream_t stream)
{
    dequantize_affine_kernel<OutT>
        <<<grid_for(v.rows * v.cols, kThreadsPerBlock), kThreadsPerBlock, 0, stream>>>(
            v, static_cast<OutT *>(out));
    return cudaGetLastError();
}

/* The dequantize kernel of GGUF kind kKind (split or whole, as its row
 * says), in f32 or bf16. */
template <qt_kind kKind, bool kWhole>
cudaError_t launch_gguf(const qt_cuda_gguf_view &v, void *out, qt_cuda_out_dtype out_dtype,
                        cudaStream_t stream)
{
    const unsigned blocks = grid_for(v.n_elements, kThreadsPerBlock);
    if constexpr (kWhole) {
        if (out_dtype == QT_CUDA_OUT_BF16)
            dequantize_gguf_whole_kernel<kKind, uint16_t><<<blocks, kThreadsPerBlock, 0, stream>>>(
                v.qs, static_cast<uint16_t *>(out), v.n_elements);
        else
            dequantize_gguf_whole_kernel<kKind, float><<<blocks, kThreadsPerBlock, 0, stream>>>(
                v.qs, static_cast<float *>(out), v.n_elements);
    } else {
        if (out_dtype == QT_CUDA_OUT_BF16)
            dequantize_gguf_kernel<kKind, uint16_t><<<blocks, kThreadsPerBlock, 0, stream>>>(
                v.qs, v.d, v.m, static_cast<uint16_t *>(out), v.n_elements);
        else
            dequantize_gguf_kernel<kKind, float><<<blocks, kThreadsPerBlock, 0, stream>>>(
                v.qs, v.d, v.m, static_cast<float *>(out), v.n_elements);
    }
    return cudaGetLastError();
}

typedef cudaError_t (*gguf_launcher)(const qt_cuda_gguf_view &v, void *out,
                                     qt_cuda_out_dtype out_dtype, cudaStream_t stream);

/* ---- AFFINE and GGUF geometry ------------------------------------------ */

/* What an AFFINE tensor or view must satisfy for the kernel to read only
 * what exists: bits 4 or 8, a code range, groups that tile each row, a row
 * stride that holds a row. `where` names the caller in the message. */
int check_affine_geometry(const char *where, int64_t rows, int64_t cols, int32_t bits, int32_t qmin,
                          int32_t qmax, int32_t group_size, int64_t groups_per_row,
                          uint64_t row_stride, char *msg, size_t msg_len)
{
    if (rows < 0 || cols < 0 || (rows > 0 && cols > INT64_MAX / rows)) {
        say(msg, msg_len, "%s: affine shape %lld x %lld is not valid", where, (long long)rows,
            (long long)cols);
        return QL_EINVAL;
    }
    if (bits != 4 && bits != 8) {
        say(msg, msg_len, "%s: affine bits %d: only 4 and 8", where, (int)bits);
        return QL_EINVAL;
    }
    if (qmin >= qmax) {
        say(msg, msg_len, "%s: affine range [%d, %d] is empty", where, (int)qmin, (int)qmax);
        return QL_EINVAL;
    }
    if (rows * cols == 0)
        return QL_OK;
    if (group_size <= 0 || cols % group_size != 0 || groups_per_row != cols / group_size) {
        say(msg, msg_len,
            "%s: affine group size %d and %lld groups per row do not tile %lld columns", where,
            (int)group_size, (long long)groups_per_row, (long long)cols);
        return QL_EINVAL;
    }
    const uint64_t need = bits == 8 ? (uint64_t)cols : (uint64_t)(cols + 1) / 2;
    if (row_stride < need) {
        say(msg, msg_len, "%s: affine row stride %llu bytes is less than the %llu a row needs",
            where, (unsigned long long)row_stride, (unsigned long long)need);
        return QL_EINVAL;
    }
    return QL_OK;
}

/* row is kind's row (NULL for no kind): the GGUF layouts only. */
int check_gguf_geometry(const char *where, const qt_cuda_kind_ops *row, qt_kind kind, int64_t n,
                        char *msg, size_t msg_len)
{
    if (!row ||
        (row->layout != QT_CUDA_LAYOUT_GGUF_SPLIT && row->layout != QT_CUDA_LAYOUT_GGUF_WHOLE)) {
        say(msg, msg_len,
            "%s: kind %s is not one the CUDA GGUF dequantize handles (q4_0, q4_1, q8_0, q5_0, "
            "q5_1, q4_k, q5_k, q6_k, q2_k, q3_k, iq4_nl, iq4_xs, mxfp4)",
            where, kind_name(kind));
        return QL_EUNSUPPORTED;
    }
    const int64_t per = row->block_size;
    if (n < 0 || n % per != 0) {
        say(msg, msg_len, "%s: %s element count %lld is not a multiple of the block of %lld", where,
            kind_name(kind), (long long)n, (long long)per);
        return QL_EINVAL;
    }
    return QL_OK;
}

int check_out_dtype(const char *where, qt_cuda_out_dtype out_dtype, char *msg, size_t msg_len)
{
    if (out_dtype != QT_CUDA_OUT_F32 && out_dtype != QT_CUDA_OUT_BF16) {
        say(msg, msg_len, "%s: output dtype %d is neither f32 nor bf16", where, (int)out_dtype);
        return QL_EINVAL;
    }
    return QL_OK;
}

/* ---- device memory ----------------------------------------------------- */

/* cudaMalloc + cudaMemcpy of `bytes` host bytes; *dev stays NULL on failure. */
int upload_bytes(void **dev, const void *host, size_t bytes, const char *what, char *msg,
                 size_t msg_len)
{
    *dev = nullptr;
    cudaError_t st = cudaMalloc(dev, bytes);
    if (st != cudaSuccess) {
        *dev = nullptr;
        return cuda_failed(st, msg, msg_len, "cudaMalloc(%s, %zu bytes)", what, bytes);
    }
    st = cudaMemcpy(*dev, host, bytes, cudaMemcpyHostToDevice);
    if (st != cudaSuccess) {
        int rc =
            cuda_failed(st, msg, msg_len, "cudaMemcpy(%s, %zu bytes, host to device)", what, bytes);
        rc = free_device(*dev, what, rc, msg, msg_len); /* keeps the copy's failure */
        *dev = nullptr;
        return rc;
    }
    return QL_OK;
}

/*
 * The host-to-host shape every kind shares: allocate n f32 on the device,
 * run dequantize_dev(dev_out) (which enqueues on the default stream),
 * synchronise, copy back, free. `what` names the kernel in messages. The
 * caller releases its view.
 */
template <typename DequantizeDev>
int dequantize_to_host(int64_t n, float *out, const char *what, DequantizeDev dequantize_dev,
                       char *msg, size_t msg_len)
{
    const size_t out_bytes = (size_t)n * sizeof(float);
    void *dev_out = nullptr;
    int rc = QL_OK;
    cudaError_t st = cudaMalloc(&dev_out, out_bytes);
    if (st != cudaSuccess) {
        dev_out = nullptr;
        rc = cuda_failed(st, msg, msg_len, "cudaMalloc(out, %zu bytes)", out_bytes);
    }
    if (rc == QL_OK)
        rc = dequantize_dev(dev_out);
    if (rc == QL_OK) {
        /* Synchronise first, so a fault in the kernel is named as such. */
        st = cudaStreamSynchronize(nullptr);
        if (st != cudaSuccess)
            rc = cuda_failed(st, msg, msg_len, "the %s dequantize kernel (%lld elements)", what,
                             (long long)n);
    }
    if (rc == QL_OK) {
        st = cudaMemcpy(out, dev_out, out_bytes, cudaMemcpyDeviceToHost);
        if (st != cudaSuccess)
            rc = cuda_failed(st, msg, msg_len, "cudaMemcpy(out, %zu bytes, device to host)",
                             out_bytes);
    }
    return free_device(dev_out, "out", rc, msg, msg_len);
}

/* ---- describe ---------------------------------------------------------- */

/* Whether the compiled list holds native code for compute capability
 * major.minor (SASS for sm_XY runs on sm_XZ, Z >= Y), only PTX that the
 * driver can JIT (compute_XY <= the device), or nothing usable. CMake's
 * "80;90" embeds both SASS and PTX for each. */
const char *code_path_for(int major, int minor)
{
    const int cc = major * 10 + minor;
    bool native = false, jit = false;
    for (const char *p = QT_CUDA_ARCHS; (p = strstr(p, "sm_")) != nullptr;) {
        p += 3;
        int arch = 0;
        while (*p >= '0' && *p <= '9')
            arch = arch * 10 + (*p++ - '0');
        if (arch / 10 == major && arch <= cc)
            native = true;
        if (arch <= cc)
            jit = true;
    }
    return native ? "native code" : jit ? "PTX, JIT-compiled by the driver" : "no compatible code";
}

void version_string(char *buf, size_t len, long v, long major_div, long minor_div)
{
    snprintf(buf, len, "%ld.%ld", v / major_div, (v % major_div) / minor_div);
}

} // namespace

/* ---- public functions -------------------------------------------------- */

extern "C" const char *qt_cuda_compiled_archs(void)
{
    return QT_CUDA_ARCHS;
}

extern "C" int qt_cuda_device_count(int *count, char *msg, size_t msg_len)
{
    if (!count) {
        say(msg, msg_len, "qt_cuda_device_count: count is NULL");
        return QL_EINVAL;
    }
    *count = 0;
    int n = 0;
    cudaError_t st = cudaGetDeviceCount(&n);
    if (st != cudaSuccess) {
        say(msg, msg_len, "%s", cudaGetErrorString(st));
        /* Leave no sticky "last error" behind for an unrelated later check. */
        (void)cudaGetLastError();
        return code_for_cuda_status(st);
    }
    if (n <= 0) {
        say(msg, msg_len, "%s", cudaGetErrorString(cudaErrorNoDevice));
        return QL_EUNSUPPORTED;
    }
    *count = n;
    return QL_OK;
}

extern "C" int qt_cuda_describe(char *buf, size_t len)
{
    if (!buf || len == 0)
        return QL_EINVAL;

    char runtime[32] = "unknown", driver[32] = "none", lt[32];
    int v = 0;
    if (cudaRuntimeGetVersion(&v) == cudaSuccess)
        version_string(runtime, sizeof runtime, v, 1000, 10);
    if (cudaDriverGetVersion(&v) == cudaSuccess && v > 0)
        version_string(driver, sizeof driver, v, 1000, 10);
    /* cublasLtGetVersion: major * 10000 + minor * 100 + patch. Calling it is
     * also what makes this library really need libcublasLt at link time. */
    const size_t ltv = cublasLtGetVersion();
    snprintf(lt, sizeof lt, "%zu.%zu.%zu", ltv / 10000, (ltv / 100) % 100, ltv % 100);

    char devices[512];
    int count = 0;
    char reason[160];
    int rc = qt_cuda_device_count(&count, reason, sizeof reason);
    if (rc != QL_OK) {
        snprintf(devices, sizeof devices, "no device: %s", reason);
    } else {
        cudaDeviceProp prop;
        cudaError_t st = cudaGetDeviceProperties(&prop, 0);
        if (st != cudaSuccess) {
            snprintf(devices, sizeof devices, "%d device(s), device 0 unreadable: %s", count,
                     cudaGetErrorString(st));
            (void)cudaGetLastError();
        } else {
            snprintf(devices, sizeof devices, "%d device(s), 0: %.256s, sm_%d%d, %.1f GiB, %s",
                     count, prop.name, prop.major, prop.minor,
                     (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0),
                     code_path_for(prop.major, prop.minor));
        }
    }
    snprintf(buf, len, "cuda: built for %s; runtime %s; driver %s; cublasLt %s; %s", QT_CUDA_ARCHS,
             runtime, driver, lt, devices);
    return QL_OK;
}

extern "C" int qt_cuda_4bit_release(qt_cuda_4bit_view *view, char *msg, size_t msg_len)
{
    if (!view)
        return QL_OK;
    int rc = QL_OK;
    rc = free_device(view->codes, "codes", rc, msg, msg_len);
    rc = free_device(view->absmax, "absmax", rc, msg, msg_len);
    rc = free_device(view->absmax_codes, "absmax_codes", rc, msg, msg_len);
    rc = free_device(view->nested_absmax, "nested_absmax", rc, msg, msg_len);
    memset(view, 0, sizeof *view);
    return rc;
}

extern "C" int qt_cuda_4bit_upload(const qtensor *t, qt_cuda_4bit_view *view, char *msg,
                                   size_t msg_len)
{
    if (!view) {
        say(msg, msg_len, "qt_cuda_4bit_upload: view is NULL");
        return QL_EINVAL;
    }
    memset(view, 0, sizeof *view);
    if (!t) {
        say(msg, msg_len, "qt_cuda_4bit_upload: tensor is NULL");
        return QL_EINVAL;
    }
    if (t->rows < 0 || t->cols < 0 || (t->rows > 0 && t->cols > INT64_MAX / t->rows)) {
        say(msg, msg_len, "qt_cuda_4bit_upload: shape %lld x %lld is not valid", (long long)t->rows,
            (long long)t->cols);
        return QL_EINVAL;
    }
    const int64_t n = t->rows * t->cols;
    int rc = check_4bit_geometry("qt_cuda_4bit_upload", t->kind, n, t->blocksize, t->n_blocks,
                                 t->nested, t->nested_blocksize, t->n_nested_blocks, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    const size_t code_bytes = (size_t)((n + 1) / 2);
    const char *missing = nullptr;
    if (n > 0 && !t->data)
        missing = "data";
    else if (n > 0 && t->nested && !t->absmax_codes)
        missing = "absmax_codes";
    else if (n > 0 && t->nested && !t->nested_absmax)
        missing = "nested_absmax";
    else if (n > 0 && !t->nested && !t->absmax)
        missing = "absmax";
    if (missing) {
        say(msg, msg_len, "qt_cuda_4bit_upload: %s tensor %lld x %lld has no %s",
            kind_name(t->kind), (long long)t->rows, (long long)t->cols, missing);
        return QL_EINVAL;
    }
    if (t->data_bytes < code_bytes) {
        say(msg, msg_len,
            "qt_cuda_4bit_upload: %s tensor %lld x %lld holds %zu code bytes, needs %zu",
            kind_name(t->kind), (long long)t->rows, (long long)t->cols, t->data_bytes, code_bytes);
        return QL_EINVAL;
    }

    /* The view counts what travels: only the blocks the elements use,
     * however many t carries (so a view's counts are its arrays' sizes). */
    const int64_t used_blocks = ceil_div(n, t->blocksize);
    view->kind = t->kind;
    view->n_elements = n;
    view->blocksize = t->blocksize;
    view->n_blocks = used_blocks;
    view->nested = t->nested;
    view->n_nested_blocks = t->nested ? ceil_div(used_blocks, t->nested_blocksize) : 0;
    view->nested_blocksize = t->nested ? t->nested_blocksize : 0;
    view->nested_offset = t->nested ? t->nested_offset : 0.0f;
    memcpy(view->codebook, t->codebook, sizeof view->codebook);
    if (t->nested)
        memcpy(view->nested_code, t->nested_code, sizeof view->nested_code);
    if (n == 0)
        return QL_OK; /* nothing to hold; the dequantize enqueues nothing */

    void *p = nullptr;
    rc = upload_bytes(&p, t->data, code_bytes, "codes", msg, msg_len);
    view->codes = static_cast<const uint8_t *>(p);
    if (rc == QL_OK && t->nested) {
        rc = upload_bytes(&p, t->absmax_codes, (size_t)used_blocks, "absmax_codes", msg, msg_len);
        view->absmax_codes = static_cast<const uint8_t *>(p);
        if (rc == QL_OK) {
            rc = upload_bytes(&p, t->nested_absmax, (size_t)view->n_nested_blocks * sizeof(float),
                              "nested_absmax", msg, msg_len);
            view->nested_absmax = static_cast<const float *>(p);
        }
    } else if (rc == QL_OK) {
        rc = upload_bytes(&p, t->absmax, (size_t)used_blocks * sizeof(float), "absmax", msg,
                          msg_len);
        view->absmax = static_cast<const float *>(p);
    }
    if (rc != QL_OK) {
        qt_cuda_4bit_release(view, nullptr, 0); /* msg keeps the first failure */
        return rc;
    }
    return QL_OK;
}

extern "C" int qt_cuda_dequantize_4bit_dev(const qt_cuda_4bit_view *view, void *out,
                                           qt_cuda_out_dtype out_dtype, void *stream, char *msg,
                                           size_t msg_len)
{
    if (!view) {
        say(msg, msg_len, "qt_cuda_dequantize_4bit_dev: view is NULL");
        return QL_EINVAL;
    }
    const qt_cuda_4bit_view &v = *view;
    int rc = check_4bit_geometry("qt_cuda_dequantize_4bit_dev", v.kind, v.n_elements, v.blocksize,
                                 v.n_blocks, v.nested, v.nested_blocksize, v.n_nested_blocks, msg,
                                 msg_len);
    if (rc != QL_OK)
        return rc;
    if (out_dtype != QT_CUDA_OUT_F32 && out_dtype != QT_CUDA_OUT_BF16) {
        say(msg, msg_len, "qt_cuda_dequantize_4bit_dev: output dtype %d is neither f32 nor bf16",
            (int)out_dtype);
        return QL_EINVAL;
    }
    if (v.n_elements == 0)
        return QL_OK;
    if (!out || !v.codes || (v.nested ? !v.absmax_codes || !v.nested_absmax : !v.absmax)) {
        say(msg, msg_len,
            "qt_cuda_dequantize_4bit_dev: a NULL device pointer (out %p, codes %p, absmax %p, "
            "absmax_codes %p, nested_absmax %p; nested %s)",
            out, (const void *)v.codes, (const void *)v.absmax, (const void *)v.absmax_codes,
            (const void *)v.nested_absmax, v.nested ? "yes" : "no");
        return QL_EINVAL;
    }

    const int64_t n_chunks = ceil_div(v.n_elements, kElemsPerThread);
    const bool vector_io = aligned(v.codes, 16) && aligned(out, 16);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    /* The launch is checked with cudaGetLastError, so clear what an earlier
     * call (already reported by its own return value) may have left. */
    (void)cudaGetLastError();
    cudaError_t st = v.nested ? launch_for_output<true>(v, out, out_dtype, vector_io, n_chunks, s)
                              : launch_for_output<false>(v, out, out_dtype, vector_io, n_chunks, s);
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "launching the %s dequantize kernel (%lld elements)",
                           kind_name(v.kind), (long long)v.n_elements);
    return QL_OK;
}

extern "C" int qt_cuda_dequantize_4bit(const qtensor *t, float *out, char *msg, size_t msg_len)
{
    if (!t || !out) {
        say(msg, msg_len, "qt_cuda_dequantize_4bit: %s is NULL", !t ? "tensor" : "out");
        return QL_EINVAL;
    }
    qt_cuda_4bit_view view;
    int rc = qt_cuda_4bit_upload(t, &view, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const int64_t n = view.n_elements;
    if (n == 0)
        return QL_OK;

    const size_t out_bytes = (size_t)n * sizeof(float);
    void *dev_out = nullptr;
    cudaError_t st = cudaMalloc(&dev_out, out_bytes);
    if (st != cudaSuccess) {
        dev_out = nullptr;
        rc = cuda_failed(st, msg, msg_len, "cudaMalloc(out, %zu bytes)", out_bytes);
    }
    if (rc == QL_OK)
        rc = qt_cuda_dequantize_4bit_dev(&view, dev_out, QT_CUDA_OUT_F32, nullptr, msg, msg_len);
    if (rc == QL_OK) {
        /* Synchronise first, so a fault in the kernel is named as such and
         * not blamed on the copy. */
        st = cudaStreamSynchronize(nullptr);
        if (st != cudaSuccess)
            rc = cuda_failed(st, msg, msg_len, "the %s dequantize kernel (%lld x %lld)",
                             kind_name(t->kind), (long long)t->rows, (long long)t->cols);
    }
    if (rc == QL_OK) {
        st = cudaMemcpy(out, dev_out, out_bytes, cudaMemcpyDeviceToHost);
        if (st != cudaSuccess)
            rc = cuda_failed(st, msg, msg_len, "cudaMemcpy(out, %zu bytes, device to host)",
                             out_bytes);
    }
    rc = free_device(dev_out, "out", rc, msg, msg_len);
    /* A release failure is reported only when nothing failed before it. */
    int rc_release =
        qt_cuda_4bit_release(&view, rc == QL_OK ? msg : nullptr, rc == QL_OK ? msg_len : 0);
    return rc != QL_OK ? rc : rc_release;
}

/* ---- AFFINE ------------------------------------------------------------- */

extern "C" int qt_cuda_affine_release(qt_cuda_affine_view *view, char *msg, size_t msg_len)
{
    if (!view)
        return QL_OK;
    int rc = QL_OK;
    rc = free_device(view->codes, "codes", rc, msg, msg_len);
    rc = free_device(view->scales, "scales", rc, msg, msg_len);
    rc = free_device(view->zeros, "zeros", rc, msg, msg_len);
    memset(view, 0, sizeof *view);
    return rc;
}

extern "C" int qt_cuda_affine_upload(const qtensor *t, qt_cuda_affine_view *view, char *msg,
                                     size_t msg_len)
{
    if (!view) {
        say(msg, msg_len, "qt_cuda_affine_upload: view is NULL");
        return QL_EINVAL;
    }
    memset(view, 0, sizeof *view);
    if (!t) {
        say(msg, msg_len, "qt_cuda_affine_upload: tensor is NULL");
        return QL_EINVAL;
    }
    if (t->kind != QT_AFFINE) {
        say(msg, msg_len,
            "qt_cuda_affine_upload: kind %s is not one the CUDA affine dequantize handles "
            "(affine)",
            kind_name(t->kind));
        return QL_EUNSUPPORTED;
    }
    int rc =
        check_affine_geometry("qt_cuda_affine_upload", t->rows, t->cols, t->bits, t->qmin, t->qmax,
                              t->group_size, t->groups_per_row, t->row_stride, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const int64_t n = t->rows * t->cols;
    const size_t code_bytes = (size_t)t->rows * t->row_stride;
    const size_t param_bytes = (size_t)(t->rows * t->groups_per_row) * sizeof(float);
    if (n > 0 && (!t->data || !t->scales || !t->zeros)) {
        say(msg, msg_len, "qt_cuda_affine_upload: affine tensor %lld x %lld has no %s",
            (long long)t->rows, (long long)t->cols,
            !t->data     ? "data"
            : !t->scales ? "scales"
                         : "zeros");
        return QL_EINVAL;
    }
    if (n > 0 && t->data_bytes < code_bytes) {
        say(msg, msg_len,
            "qt_cuda_affine_upload: affine tensor %lld x %lld holds %zu code bytes, needs %zu",
            (long long)t->rows, (long long)t->cols, t->data_bytes, code_bytes);
        return QL_EINVAL;
    }

    view->rows = t->rows;
    view->cols = t->cols;
    view->bits = t->bits;
    view->qmin = t->qmin;
    view->qmax = t->qmax;
    view->float_zero = t->zero_domain == QT_ZERO_FLOAT;
    view->group_size = t->group_size;
    view->groups_per_row = t->groups_per_row;
    view->row_stride = t->row_stride;
    if (n == 0)
        return QL_OK;

    void *p = nullptr;
    rc = upload_bytes(&p, t->data, code_bytes, "codes", msg, msg_len);
    view->codes = static_cast<const uint8_t *>(p);
    if (rc == QL_OK) {
        rc = upload_bytes(&p, t->scales, param_bytes, "scales", msg, msg_len);
        view->scales = static_cast<const float *>(p);
    }
    if (rc == QL_OK) {
        rc = upload_bytes(&p, t->zeros, param_bytes, "zeros", msg, msg_len);
        view->zeros = static_cast<const float *>(p);
    }
    if (rc != QL_OK) {
        qt_cuda_affine_release(view, nullptr, 0); /* msg keeps the first failure */
        return rc;
    }
    return QL_OK;
}

extern "C" int qt_cuda_dequantize_affine_dev(const qt_cuda_affine_view *view, void *out,
                                             qt_cuda_out_dtype out_dtype, void *stream, char *msg,
                                             size_t msg_len)
{
    static const char where[] = "qt_cuda_dequantize_affine_dev";
    if (!view) {
        say(msg, msg_len, "%s: view is NULL", where);
        return QL_EINVAL;
    }
    const qt_cuda_affine_view &v = *view;
    int rc = check_affine_geometry(where, v.rows, v.cols, v.bits, v.qmin, v.qmax, v.group_size,
                                   v.groups_per_row, v.row_stride, msg, msg_len);
    if (rc == QL_OK)
        rc = check_out_dtype(where, out_dtype, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const int64_t n = v.rows * v.cols;
    if (n == 0)
        return QL_OK;
    if (!out || !v.codes || !v.scales || !v.zeros) {
        say(msg, msg_len, "%s: a NULL device pointer (out %p, codes %p, scales %p, zeros %p)",
            where, out, (const void *)v.codes, (const void *)v.scales, (const void *)v.zeros);
        return QL_EINVAL;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError(); /* the launch is checked with cudaGetLastError */
    cudaError_t st = out_dtype == QT_CUDA_OUT_BF16 ? launch_affine<uint16_t>(v, out, s)
                                                   : launch_affine<float>(v, out, s);
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len,
                           "launching the affine int%d dequantize kernel (%lld elements)",
                           (int)v.bits, (long long)n);
    return QL_OK;
}

extern "C" int qt_cuda_dequantize_affine(const qtensor *t, float *out, char *msg, size_t msg_len)
{
    if (!t || !out) {
        say(msg, msg_len, "qt_cuda_dequantize_affine: %s is NULL", !t ? "tensor" : "out");
        return QL_EINVAL;
    }
    qt_cuda_affine_view view;
    int rc = qt_cuda_affine_upload(t, &view, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const int64_t n = view.rows * view.cols;
    if (n == 0)
        return QL_OK;
    rc = dequantize_to_host(
        n, out, "affine",
        [&](void *dev_out) {
            return qt_cuda_dequantize_affine_dev(&view, dev_out, QT_CUDA_OUT_F32, nullptr, msg,
                                                 msg_len);
        },
        msg, msg_len);
    /* A release failure is reported only when nothing failed before it. */
    int rc_release =
        qt_cuda_affine_release(&view, rc == QL_OK ? msg : nullptr, rc == QL_OK ? msg_len : 0);
    return rc != QL_OK ? rc : rc_release;
}

/* ---- GGUF ------------------------------------------------------------------ */

extern "C" int qt_cuda_gguf_release(qt_cuda_gguf_view *view, char *msg, size_t msg_len)
{
    if (!view)
        return QL_OK;
    int rc = QL_OK;
    rc = free_device(view->qs, "qs", rc, msg, msg_len);
    rc = free_device(view->d, "d", rc, msg, msg_len);
    rc = free_device(view->m, "m", rc, msg, msg_len);
    memset(view, 0, sizeof *view);
    return rc;
}

extern "C" int qt_cuda_gguf_upload_with(const qt_cuda_kind_ops *row, const qtensor *t,
                                        qt_cuda_gguf_view *view, char *msg, size_t msg_len)
{
    if (!view) {
        say(msg, msg_len, "qt_cuda_gguf_upload: view is NULL");
        return QL_EINVAL;
    }
    memset(view, 0, sizeof *view);
    if (!t) {
        say(msg, msg_len, "qt_cuda_gguf_upload: tensor is NULL");
        return QL_EINVAL;
    }
    if (t->rows < 0 || t->cols < 0 || (t->rows > 0 && t->cols > INT64_MAX / t->rows)) {
        say(msg, msg_len, "qt_cuda_gguf_upload: shape %lld x %lld is not valid", (long long)t->rows,
            (long long)t->cols);
        return QL_EINVAL;
    }
    const int64_t n = t->rows * t->cols;
    int rc = check_gguf_geometry("qt_cuda_gguf_upload", row, t->kind, n, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const int64_t per = row->block_size;
    if (n > 0 && t->cols % per != 0) {
        say(msg, msg_len,
            "qt_cuda_gguf_upload: %s tensor %lld x %lld: its rows are not whole blocks of %lld",
            kind_name(t->kind), (long long)t->rows, (long long)t->cols, (long long)per);
        return QL_EINVAL;
    }
    const size_t bytes = (size_t)(n / per) * row->block_bytes;
    if (n > 0 && (!t->data || t->data_bytes < bytes)) {
        say(msg, msg_len,
            "qt_cuda_gguf_upload: %s tensor %lld x %lld holds %zu block bytes, needs %zu",
            kind_name(t->kind), (long long)t->rows, (long long)t->cols,
            t->data ? t->data_bytes : (size_t)0, bytes);
        return QL_EINVAL;
    }
    view->kind = t->kind;
    view->n_elements = n;
    view->n_blocks = n / per;
    if (n == 0)
        return QL_OK;
    if (row->layout != QT_CUDA_LAYOUT_GGUF_SPLIT) {
        /* whole blocks: ggml's bytes as they are */
        void *blocks = nullptr;
        rc = upload_bytes(&blocks, t->data, bytes, "blocks", msg, msg_len);
        view->qs = static_cast<const uint8_t *>(blocks);
        if (rc != QL_OK)
            memset(view, 0, sizeof *view);
        return rc;
    }

    /* Split on the host (qm_gguf_split_block), then one copy per array. */
    const int block_bytes = (int)row->block_bytes;
    const size_t nb = (size_t)view->n_blocks;
    const size_t qs_bytes = nb * (size_t)qm_gguf_qs_bytes(block_bytes);
    const bool has_m = row->has_m;
    uint8_t *host_qs = static_cast<uint8_t *>(malloc(qs_bytes));
    uint16_t *host_d = static_cast<uint16_t *>(malloc(nb * sizeof(uint16_t)));
    uint16_t *host_m = static_cast<uint16_t *>(malloc(nb * sizeof(uint16_t)));
    if (!host_qs || !host_d || !host_m) {
        free(host_qs);
        free(host_d);
        free(host_m);
        memset(view, 0, sizeof *view);
        say(msg, msg_len, "qt_cuda_gguf_upload: cannot allocate %zu host bytes to split %s blocks",
            qs_bytes + 2 * nb * sizeof(uint16_t), kind_name(t->kind));
        return QL_ENOMEM;
    }
    const size_t qs_per_block = (size_t)qm_gguf_qs_bytes(block_bytes);
    for (size_t b = 0; b < nb; b++)
        qm_gguf_split_block(t->data + b * (size_t)block_bytes, block_bytes,
                            host_qs + b * qs_per_block, &host_d[b], &host_m[b]);
    void *p = nullptr;
    rc = upload_bytes(&p, host_qs, qs_bytes, "qs", msg, msg_len);
    view->qs = static_cast<const uint8_t *>(p);
    if (rc == QL_OK) {
        rc = upload_bytes(&p, host_d, nb * sizeof(uint16_t), "d", msg, msg_len);
        view->d = static_cast<const uint16_t *>(p);
    }
    if (rc == QL_OK && has_m) {
        rc = upload_bytes(&p, host_m, nb * sizeof(uint16_t), "m", msg, msg_len);
        view->m = static_cast<const uint16_t *>(p);
    }
    free(host_qs);
    free(host_d);
    free(host_m);
    if (rc != QL_OK) {
        qt_cuda_gguf_release(view, nullptr, 0); /* msg keeps the first failure */
        return rc;
    }
    return QL_OK;
}

/* qt_cuda_dequantize_gguf_dev's checks, then launch (the kind's kernel);
 * row is view->kind's. */
static int dequantize_gguf_checked(const qt_cuda_kind_ops *row, const qt_cuda_gguf_view *view,
                                   void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                   gguf_launcher launch, char *msg, size_t msg_len)
{
    static const char where[] = "qt_cuda_dequantize_gguf_dev";
    if (!view) {
        say(msg, msg_len, "%s: view is NULL", where);
        return QL_EINVAL;
    }
    const qt_cuda_gguf_view &v = *view;
    int rc = check_gguf_geometry(where, row, v.kind, v.n_elements, msg, msg_len);
    if (rc == QL_OK)
        rc = check_out_dtype(where, out_dtype, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (v.n_elements == 0)
        return QL_OK;
    if (v.n_blocks != v.n_elements / row->block_size) {
        say(msg, msg_len, "%s: %s view has %lld blocks for %lld elements (expected %lld)", where,
            kind_name(v.kind), (long long)v.n_blocks, (long long)v.n_elements,
            (long long)(v.n_elements / row->block_size));
        return QL_EINVAL;
    }
    if (!out || !v.qs || (row->layout == QT_CUDA_LAYOUT_GGUF_SPLIT && !v.d) ||
        (row->has_m && !v.m)) {
        say(msg, msg_len, "%s: a NULL device pointer (out %p, qs %p, d %p, m %p)", where, out,
            (const void *)v.qs, (const void *)v.d, (const void *)v.m);
        return QL_EINVAL;
    }
    if (!launch) {
        say(msg, msg_len, "%s: the CUDA backend has no dequantize kernel for %s", where,
            kind_name(v.kind));
        return QL_EUNSUPPORTED;
    }
    (void)cudaGetLastError(); /* the launch is checked with cudaGetLastError */
    cudaError_t st = launch(v, out, out_dtype, static_cast<cudaStream_t>(stream));
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "launching the %s dequantize kernel (%lld elements)",
                           kind_name(v.kind), (long long)v.n_elements);
    return QL_OK;
}

/* A GGUF kind's dequantize operation (its row's): the view of t. */
template <qt_kind kKind, bool kWhole>
static int dequantize_gguf_as(const qt_cuda_kind_ops *row, const qt_cuda_tensor *t, void *out,
                              qt_cuda_out_dtype out_dtype, void *stream, char *msg, size_t msg_len)
{
    return dequantize_gguf_checked(row, &t->gguf, out, out_dtype, stream,
                                   launch_gguf<kKind, kWhole>, msg, msg_len);
}

#define GGUF_DEQUANTIZE(name, NAME, whole)                                                         \
    extern "C" int qt_cuda_dequantize_as_##name(                                                   \
        const qt_cuda_kind_ops *row, const qt_cuda_tensor *t, void *out,                           \
        qt_cuda_out_dtype out_dtype, void *stream, char *msg, size_t msg_len)                      \
    {                                                                                              \
        return dequantize_gguf_as<QT_##NAME, whole>(row, t, out, out_dtype, stream, msg, msg_len); \
    }
QT_CUDA_GGUF_KINDS(GGUF_DEQUANTIZE)
#undef GGUF_DEQUANTIZE

/* The NF4/FP4 and AFFINE rows' dequantize: their views' entry points. */
extern "C" int qt_cuda_dequantize_as_bnb4(const qt_cuda_kind_ops *, const qt_cuda_tensor *t,
                                          void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                          char *msg, size_t msg_len)
{
    return qt_cuda_dequantize_4bit_dev(&t->q4, out, out_dtype, stream, msg, msg_len);
}

extern "C" int qt_cuda_dequantize_as_affine(const qt_cuda_kind_ops *, const qt_cuda_tensor *t,
                                            void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                            char *msg, size_t msg_len)
{
    return qt_cuda_dequantize_affine_dev(&t->affine, out, out_dtype, stream, msg, msg_len);
}

extern "C" int qt_cuda_dequantize_gguf_dev_with(const qt_cuda_kind_ops *row,
                                                const qt_cuda_gguf_view *view, void *out,
                                                qt_cuda_out_dtype out_dtype, void *stream,
                                                char *msg, size_t msg_len)
{
    if (!view || !row || !row->is_gguf || !row->dequantize)
        return dequantize_gguf_checked(row, view, out, out_dtype, stream, nullptr, msg, msg_len);
    /* the row's operation takes a device tensor: this view as one */
    qt_cuda_tensor t;
    memset(&t, 0, sizeof t);
    t.kind = view->kind;
    t.gguf = *view;
    return row->dequantize(row, &t, out, out_dtype, stream, msg, msg_len);
}

extern "C" int qt_cuda_dequantize_gguf_with(const qt_cuda_kind_ops *row, const qtensor *t,
                                            float *out, char *msg, size_t msg_len)
{
    if (!t || !out) {
        say(msg, msg_len, "qt_cuda_dequantize_gguf: %s is NULL", !t ? "tensor" : "out");
        return QL_EINVAL;
    }
    qt_cuda_gguf_view view;
    int rc = qt_cuda_gguf_upload_with(row, t, &view, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (view.n_elements == 0)
        return QL_OK;
    rc = dequantize_to_host(
        view.n_elements, out, kind_name(t->kind),
        [&](void *dev_out) {
            return qt_cuda_dequantize_gguf_dev_with(row, &view, dev_out, QT_CUDA_OUT_F32, nullptr,
                                                    msg, msg_len);
        },
        msg, msg_len);
    int rc_release =
        qt_cuda_gguf_release(&view, rc == QL_OK ? msg : nullptr, rc == QL_OK ? msg_len : 0);
    return rc != QL_OK ? rc : rc_release;
}

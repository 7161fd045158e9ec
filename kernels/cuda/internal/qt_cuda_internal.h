/*
 * qt_cuda_internal.h - the host helpers that every .cu file of kernels/cuda
 * shares: the sentence into the caller's message buffer (say), the QT_E*
 * code a CUDA status stands for and the "<call> failed: <sentence>
 * (<name>)" report of a failed call (cuda_failed), kind names and kind
 * classes, grid sizing for grid-stride kernels, alignment, and a cudaFree
 * that keeps the first failure.
 *
 * Why shaped so:
 *   - Only the .cu files of kernels/cuda include it; it is no interface of
 *     the folder (that is qt_cuda.h, qt_cuda_ops.h and qt_cuda_sample.h).
 *     Everything is static inline, so each .cu compiles its own copy, no
 *     symbol crosses the library, and a file that uses few of the helpers
 *     warns about none of the others.
 *   - One mapping of CUDA statuses to QT_E* codes, so every entry point of
 *     the backend names the same failure with the same code (the engine and
 *     the HTTP layer turn the codes into statuses).
 *   - No kernels, launches or __shared__ (the kind tests are __host__
 *     __device__, the rest host code): the host emulator of tests/gpu/emu
 *     includes it as it stands (cu2cpp.pl rewrites only the .cu files),
 *     against its own cuda_runtime.h.
 */
#ifndef QT_CUDA_INTERNAL_H
#define QT_CUDA_INTERNAL_H

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "qt_math.h"
#include "qt_quant_math.h"
#include "qtensor.h"

/* Grid-stride kernels launch at most this many blocks: enough to fill any
 * current GPU many times over; larger inputs loop rather than launch
 * millions of blocks that each redo their setup (shared codebooks). */
constexpr int64_t kMaxBlocks = 65536;

/* ---- messages and status codes ------------------------------------------ */

/* vsnprintf into msg, when there is one. */
static inline void vsay(char *msg, size_t msg_len, const char *fmt, va_list ap)
{
    if (!msg || msg_len == 0)
        return;
    vsnprintf(msg, msg_len, fmt, ap);
}

static inline void say(char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static inline void say(char *msg, size_t msg_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay(msg, msg_len, fmt, ap);
    va_end(ap);
}

/* The QT_E* code a CUDA status stands for: no device, driver or code for
 * this device is QL_EUNSUPPORTED (the backend cannot run here), running out
 * of memory QL_ENOMEM, anything else the device did QL_EDEVICE. */
static inline int code_for_cuda_status(cudaError_t st)
{
    switch (st) {
    case cudaSuccess: return QL_OK;
    case cudaErrorMemoryAllocation: return QL_ENOMEM;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer: return QL_EINVAL;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion: return QL_EUNSUPPORTED;
    default: return QL_EDEVICE;
    }
}

static inline int cuda_failed(cudaError_t st, char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Write "<what> failed: <sentence> (<name>)", what formatted from fmt, into
 * msg and return the matching code. */
static inline int cuda_failed(cudaError_t st, char *msg, size_t msg_len, const char *fmt, ...)
{
    char what[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    say(msg, msg_len, "%s failed: %s (%s)", what, cudaGetErrorString(st), cudaGetErrorName(st));
    /* Reported here, so not left behind as the thread's "last error" for
     * the next unrelated check (a sticky error stays whatever we do). */
    (void)cudaGetLastError();
    return code_for_cuda_status(st);
}

/* ---- kinds --------------------------------------------------------------- */

/* qt_kind_name lives in the CPU library; this copy keeps qlkernels_cuda
 * linkable on its own. */
static inline const char *kind_name(qt_kind kind)
{
    switch (kind) {
    case QT_F32: return "f32";
    case QT_F16: return "f16";
    case QT_BF16: return "bf16";
    case QT_NF4: return "nf4";
    case QT_FP4: return "fp4";
    case QT_AFFINE: return "affine";
    case QT_Q4_0: return "q4_0";
    case QT_Q4_1: return "q4_1";
    case QT_Q8_0: return "q8_0";
    case QT_Q5_0: return "q5_0";
    case QT_Q5_1: return "q5_1";
    case QT_Q4_K: return "q4_k";
    case QT_Q5_K: return "q5_k";
    case QT_Q6_K: return "q6_k";
    case QT_Q2_K: return "q2_k";
    case QT_Q3_K: return "q3_k";
    case QT_IQ4_NL: return "iq4_nl";
    case QT_IQ4_XS: return "iq4_xs";
    default: return "(not a kind)";
    }
}

static inline __host__ __device__ bool is_dense(qt_kind k)
{
    return k == QT_F32 || k == QT_F16 || k == QT_BF16;
}

/* bitsandbytes' blockwise 4-bit kinds. */
static inline __host__ __device__ bool is_4bit(qt_kind k)
{
    return k == QT_NF4 || k == QT_FP4;
}

/* Every llama.cpp block kind this backend runs. */
static inline __host__ __device__ bool is_gguf(qt_kind k)
{
    switch (k) {
    case QT_Q4_0:
    case QT_Q4_1:
    case QT_Q8_0:
    case QT_Q5_0:
    case QT_Q5_1:
    case QT_Q4_K:
    case QT_Q5_K:
    case QT_Q6_K:
    case QT_Q2_K:
    case QT_Q3_K:
    case QT_IQ4_NL:
    case QT_IQ4_XS: return true;
    default: return false;
    }
}

/* The GGUF kinds kept in the split layout (qs, d, m arrays; qt_cuda.h);
 * the others keep ggml's blocks whole. */
static inline __host__ __device__ bool gguf_split(qt_kind k)
{
    return k == QT_Q4_0 || k == QT_Q4_1 || k == QT_Q8_0;
}

/* The kinds this backend has kernels for: every kind of qtensor.h today
 * (a kind added there stays refused here by name until it has kernels). */
static inline bool cuda_runs_kind(qt_kind k)
{
    return is_dense(k) || is_4bit(k) || k == QT_AFFINE || is_gguf(k);
}

/* Bytes per block of a GGUF kind in ggml's layout, 0 for other kinds. */
static inline __host__ __device__ size_t gguf_block_bytes(qt_kind kind)
{
    switch (kind) {
    case QT_Q4_0: return QM_Q4_0_BYTES;
    case QT_Q4_1: return QM_Q4_1_BYTES;
    case QT_Q8_0: return QM_Q8_0_BYTES;
    case QT_Q5_0: return QM_Q5_0_BYTES;
    case QT_Q5_1: return QM_Q5_1_BYTES;
    case QT_Q4_K: return QM_Q4_K_BYTES;
    case QT_Q5_K: return QM_Q5_K_BYTES;
    case QT_Q6_K: return QM_Q6_K_BYTES;
    case QT_Q2_K: return QM_Q2_K_BYTES;
    case QT_Q3_K: return QM_Q3_K_BYTES;
    case QT_IQ4_NL: return QM_IQ4_NL_BYTES;
    case QT_IQ4_XS: return QM_IQ4_XS_BYTES;
    default: return 0;
    }
}

/* Elements per block of a GGUF kind: 32 for Q4_0 ... Q5_1 and IQ4_NL, 256
 * for the k-quants and IQ4_XS. */
static inline __host__ __device__ int64_t gguf_block_elems(qt_kind kind)
{
    switch (kind) {
    case QT_Q4_K:
    case QT_Q5_K:
    case QT_Q6_K:
    case QT_Q2_K:
    case QT_Q3_K:
    case QT_IQ4_XS: return QM_QK_K;
    default: return QM_GGUF_QK;
    }
}

/* Element j of one whole ggml block of a kind kept whole (not
 * gguf_split): the per-block functions of qt_math.h and qt_quant_math.h
 * that the CPU's qt_dequantize_rows runs, so the value is the CPU's bit
 * for bit. */
static inline __host__ __device__ float gguf_whole_block_value(qt_kind kind, const uint8_t *blk,
                                                               int j)
{
    switch (kind) {
    case QT_Q5_0: return qm_q5_0_block_value(blk, j);
    case QT_Q5_1: return qm_q5_1_block_value(blk, j);
    case QT_Q4_K: return qm_q4_k_block_value(blk, j);
    case QT_Q5_K: return qm_q5_k_block_value(blk, j);
    case QT_Q2_K: return qm_q2_k_block_value(blk, j);
    case QT_Q3_K: return qm_q3_k_block_value(blk, j);
    case QT_IQ4_NL: return qm_iq4_nl_block_value(blk, j);
    case QT_IQ4_XS: return qm_iq4_xs_block_value(blk, j);
    default: return qm_q6_k_block_value(blk, j);
    }
}

/* Element e of a row-major tensor of whole blocks of `kind`. */
static inline __host__ __device__ float gguf_whole_element(qt_kind kind, const uint8_t *blocks,
                                                           int64_t e)
{
    const int64_t per = gguf_block_elems(kind);
    return gguf_whole_block_value(kind, blocks + (e / per) * (int64_t)gguf_block_bytes(kind),
                                  (int)(e % per));
}

/* ---- grids and pointers -------------------------------------------------- */

static inline int64_t ceil_div(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* Blocks for a grid-stride kernel over n items, per_block to a block:
 * at least 1 (a launch of 0 blocks is an error), at most kMaxBlocks. */
static inline unsigned grid_for(int64_t n, int64_t per_block)
{
    const int64_t b = ceil_div(n, per_block);
    return (unsigned)(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

/* Whether p is a multiple of bytes (a power of two). */
static inline bool aligned(const void *p, size_t bytes)
{
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

/* ---- device memory ------------------------------------------------------- */

/* cudaFree that keeps the first failure: returns rc unchanged when it is
 * already an error, else the free's own status. `what` names the array in
 * the message. */
static inline int free_device(const void *p, const char *what, int rc, char *msg, size_t msg_len)
{
    if (!p)
        return rc;
    cudaError_t st = cudaFree(const_cast<void *>(p));
    if (st != cudaSuccess && rc == QL_OK)
        return cuda_failed(st, msg, msg_len, "cudaFree(%s)", what);
    return rc;
}

#endif /* QT_CUDA_INTERNAL_H */

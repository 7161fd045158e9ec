/*
 * qt_cuda_internal.h - the host helpers that every .cu file of kernels/cuda
 * shares: the sentence into the caller's message buffer (say), the QT_E*
 * code a CUDA status stands for and the "<call> failed: <sentence>
 * (<name>)" report of a failed call (cuda_failed), kind names, grid sizing for grid-stride kernels,
 * alignment, and a cudaFree that keeps the first failure.
 *
 * Why shaped so:
 *   - Only the .cu files of kernels/cuda include it; it is no interface of
 *     the folder (that is qt_cuda.h, qt_cuda_ops.h and qt_cuda_sample.h).
 *     Everything is static inline, so each .cu compiles its own copy, and a
 *     file that uses few of the helpers warns about none of the others;
 *     kind names come from the CPU's qt_kind_geometry_table (qtensor.c).
 *   - One mapping of CUDA statuses to QT_E* codes, so every entry point of
 *     the backend names the same failure with the same code (the engine and
 *     the HTTP layer turn the codes into statuses).
 *   - device_alloc and copy_to_host, shared by the files that hold tensors
 *     (qt_cuda_tensor.cu, qt_cuda_quantfmt.cu).
 *   - No kernels, launches or __shared__ (is_dense is __host__ __device__,
 *     the rest host code): the host emulator of tests/gpu/emu
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

#include "kernels_internal.h"
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

static inline int invalid(char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A bad argument: its sentence into msg, QL_EINVAL. */
static inline int invalid(char *msg, size_t msg_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay(msg, msg_len, fmt, ap);
    va_end(ap);
    return QL_EINVAL;
}

/* After a launch: QL_OK, or the launch error named by `what`. */
static inline int launched(char *msg, size_t msg_len, const char *what)
{
    cudaError_t st = cudaGetLastError();
    if (st == cudaSuccess)
        return QL_OK;
    return cuda_failed(st, msg, msg_len, "%s", what);
}

/* ---- kinds --------------------------------------------------------------- */

/* A kind's name for messages: the CPU's geometry table (kernels_internal.h,
 * the one data table of kernels/); what a kind does on the device is its
 * row in qt_cuda_kinds.c, handed to the code below by the entry points. */
static inline const char *kind_name(qt_kind kind)
{
    return (unsigned)kind < QT_KIND_COUNT ? qt_kind_geometry_table[kind].name : "(not a kind)";
}

/* The dtypes of LoRA factors (A, B): read element by element on the device
 * (qt_cuda_lora.cu's dense_at), where no host table is at hand. */
static inline __host__ __device__ bool is_dense(qt_kind k)
{
    return k == QT_F32 || k == QT_F16 || k == QT_BF16;
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

/* cudaMalloc of `bytes` (nothing when 0); *p stays NULL on failure. */
template <typename T>
static inline int device_alloc(T **p, size_t bytes, const char *what, char *msg, size_t len)
{
    *p = nullptr;
    if (bytes == 0)
        return QL_OK;
    void *q = nullptr;
    cudaError_t st = cudaMalloc(&q, bytes);
    if (st != cudaSuccess)
        return cuda_failed(st, msg, len, "cudaMalloc(%s, %zu bytes)", what, bytes);
    *p = static_cast<T *>(q);
    return QL_OK;
}

/* cudaMemcpy of `bytes` from the device to the host, `what` named on failure. */
static inline int copy_to_host(void *dst, const void *src, size_t bytes, const char *what,
                               char *msg, size_t msg_len)
{
    if (bytes == 0)
        return QL_OK;
    cudaError_t st = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    if (st != cudaSuccess)
        return cuda_failed(st, msg, msg_len, "cudaMemcpy(%s, %zu bytes, device to host)", what,
                           bytes);
    return QL_OK;
}

#endif /* QT_CUDA_INTERNAL_H */

/*
 * qt_cuda.h - the CUDA backend of kernels/: what a GPU build offers on top
 * of qtensor.h.
 *
 * This is the public header of kernels/cuda/. It offers:
 *   - qt_cuda_device_count, qt_cuda_describe: whether a usable device is
 *     there, and one line of what was built and found (for /info, logs and
 *     bug reports);
 *   - qt_cuda_4bit_upload / qt_cuda_4bit_release: a host NF4/FP4 qtensor's
 *     codes and quant state copied to device memory, described by a
 *     qt_cuda_4bit_view that the device kernels take;
 *   - qt_cuda_dequantize_4bit_dev: the dequantize kernel on device pointers,
 *     on the caller's stream, writing f32 or bf16;
 *   - qt_cuda_dequantize_4bit: the same from host memory to host memory,
 *     for tests and for tools that hold no device state;
 *   - the same four for AFFINE (torchao int4/int8 grids: qt_cuda_affine_*)
 *     and for the GGUF blocks Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, the k-quants
 *     Q2_K ... Q6_K, IQ4_NL, IQ4_XS and MXFP4 (qt_cuda_gguf_*), each with its own
 *     view;
 *   - the views of the checkpoint formats FP8, CT_INT, GPTQ and AWQ
 *     (qt_cuda_fp8_view, qt_cuda_gptq_view), which only qt_cuda_tensor
 *     (qt_cuda_ops.h) fills.
 *
 * Why shaped so: the per-element arithmetic lives in kernels/math/qt_math.h and
 * is compiled both for the CPU reference and for these kernels, so a CPU
 * test of qt_dequantize_rows pins the bits the GPU produces; the GPU test
 * (tests/gpu/test_cuda_dequant.c) requires them bit-identical. The header is
 * plain C (no CUDA types): a stream is a `void *` holding a cudaStream_t
 * (NULL for the legacy default stream), so C code and builds without CUDA
 * headers can include it.
 *
 * Errors: every function returns QL_OK or a negative code and, where it
 * takes one, writes a sentence into msg naming the CUDA call that failed and
 * cudaGetErrorString's text. Codes: QL_EINVAL (bad argument), QL_ENOMEM
 * (host or device allocation failed), QL_EUNSUPPORTED (a kind these kernels
 * do not handle; no device or no driver; no kernel image for this GPU), and
 * QL_EDEVICE for any other CUDA failure (a launch or a fault). Nothing
 * here aborts; on failure whatever a call allocated is freed.
 *
 * Threading: the functions use the calling thread's current device
 * (cudaSetDevice is the caller's business) and keep no global state.
 */
#ifndef QL_QT_CUDA_H
#define QL_QT_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "qtensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The element type the dequantize kernel writes. */
typedef enum qt_cuda_out_dtype {
    QT_CUDA_OUT_F32 = 0,
    QT_CUDA_OUT_BF16 = 1, /* round to nearest even, as qm_f32_to_bf16 */
} qt_cuda_out_dtype;

/*
 * An NF4/FP4 tensor as the device kernels see it. Pointers are device
 * pointers; the codebooks travel by value (they become kernel arguments, so
 * nothing needs uploading for them). Fields mean what they mean in qtensor.
 *
 * Ownership: a view filled by qt_cuda_4bit_upload owns its device pointers
 * (release them with qt_cuda_4bit_release); a view the caller fills from
 * its own device allocations borrows them and must not be released.
 */
typedef struct qt_cuda_4bit_view {
    qt_kind kind;                /* QT_NF4 or QT_FP4 (for messages) */
    int64_t n_elements;          /* rows * cols */
    int32_t blocksize;           /* elements per absmax block, a multiple of 32 */
    int64_t n_blocks;            /* ceil(n_elements / blocksize) */
    const uint8_t *codes;        /* ceil(n_elements / 2) bytes, bitsandbytes packing */
    const float *absmax;         /* n_blocks, when !nested */
    bool nested;                 /* double quantization of absmax */
    const uint8_t *absmax_codes; /* n_blocks, when nested */
    const float *nested_absmax;  /* n_nested_blocks, when nested */
    int64_t n_nested_blocks;
    int32_t nested_blocksize; /* 256 for bitsandbytes */
    float nested_offset;
    float codebook[16];
    float nested_code[256];
} qt_cuda_4bit_view;

/*
 * How many CUDA devices this process can use. On success *count >= 1 and
 * QL_OK. With no device, no driver, or a driver too old for this runtime,
 * *count = 0, msg holds cudaGetErrorString's sentence, and the result is
 * QL_EUNSUPPORTED; other failures give QL_EDEVICE. Never crashes for a
 * missing libcuda. msg may be NULL when msg_len is 0.
 */
int qt_cuda_device_count(int *count, char *msg, size_t msg_len);

/*
 * One line for humans: the GPU architectures compiled in, the CUDA runtime
 * and cuBLASLt versions, and device 0's name and compute capability (or why
 * there is no device). Writes at most len bytes including the NUL,
 * truncating. Returns QL_OK (a missing device is described, not an error),
 * or QL_EINVAL for a NULL or empty buffer.
 */
int qt_cuda_describe(char *buf, size_t len);

/* The architecture list this library was built for, e.g. "sm_80 sm_90". */
const char *qt_cuda_compiled_archs(void);

/*
 * Copy t's codes and quant state (t is NF4 or FP4, in host memory) into new
 * device allocations and fill *view. On failure *view is zeroed, nothing
 * stays allocated, and msg names the call. Other kinds give QL_EUNSUPPORTED
 * naming the kind. The copies are synchronous.
 */
int qt_cuda_4bit_upload(const qtensor *t, qt_cuda_4bit_view *view, char *msg, size_t msg_len);

/*
 * Free the device memory of a view made by qt_cuda_4bit_upload and zero it.
 * Safe on a zeroed view. Returns the first cudaFree failure, if any, with
 * msg saying which.
 */
int qt_cuda_4bit_release(qt_cuda_4bit_view *view, char *msg, size_t msg_len);

/*
 * Dequantize every element of *view into out (device memory, n_elements
 * values of out_dtype, row-major as the tensor), enqueued on `stream` (a
 * cudaStream_t; NULL for the default stream). Returns once the kernel is
 * enqueued: a launch error is reported here, a fault during the run shows
 * at the caller's next synchronisation. Reads of the codes use 16-byte
 * loads when `codes` and `out` are 16-byte aligned (cudaMalloc's always
 * are), byte loads otherwise. n_elements == 0 enqueues nothing.
 */
int qt_cuda_dequantize_4bit_dev(const qt_cuda_4bit_view *view, void *out,
                                qt_cuda_out_dtype out_dtype, void *stream, char *msg,
                                size_t msg_len);

/*
 * Host to host: dequantize the NF4/FP4 tensor t into out (rows * cols f32
 * in host memory) on the current device: upload, run
 * qt_cuda_dequantize_4bit_dev on the default stream, copy back, free. On
 * failure out may be partly written, the device holds nothing of this call,
 * and msg names the failing call. Other kinds give QL_EUNSUPPORTED naming
 * the kind.
 */
int qt_cuda_dequantize_4bit(const qtensor *t, float *out, char *msg, size_t msg_len);

/*
 * An AFFINE tensor as the device kernel sees it (fields as in qtensor).
 * Ownership as for qt_cuda_4bit_view: qt_cuda_affine_upload's views own
 * their device pointers; views the caller fills borrow them.
 */
typedef struct qt_cuda_affine_view {
    int64_t rows, cols;
    int32_t bits;           /* 4 or 8 */
    int32_t qmin, qmax;     /* the code range; codes are stored as q - qmin */
    bool float_zero;        /* QT_ZERO_FLOAT (w = (q - mid) * scale + zero) */
    int32_t group_size;     /* divides cols */
    int64_t groups_per_row; /* cols / group_size */
    uint64_t row_stride;    /* bytes per row of codes: cols, or ceil(cols / 2) for 4 bits */
    const uint8_t *codes;   /* rows * row_stride bytes */
    const float *scales;    /* rows * groups_per_row */
    const float *zeros;     /* rows * groups_per_row */
} qt_cuda_affine_view;

/* Upload an AFFINE qtensor's codes, scales and zeros; contract as
 * qt_cuda_4bit_upload (other kinds: QL_EUNSUPPORTED naming the kind). */
int qt_cuda_affine_upload(const qtensor *t, qt_cuda_affine_view *view, char *msg, size_t msg_len);

/* Free a view made by qt_cuda_affine_upload and zero it; as
 * qt_cuda_4bit_release. */
int qt_cuda_affine_release(qt_cuda_affine_view *view, char *msg, size_t msg_len);

/*
 * Dequantize every element of *view into out (device memory, rows * cols
 * values of out_dtype, row-major) on `stream`; contract as
 * qt_cuda_dequantize_4bit_dev (a launch error is reported here, a fault at
 * the caller's next synchronisation; an empty tensor enqueues nothing).
 */
int qt_cuda_dequantize_affine_dev(const qt_cuda_affine_view *view, void *out,
                                  qt_cuda_out_dtype out_dtype, void *stream, char *msg,
                                  size_t msg_len);

/* Host to host for an AFFINE tensor; contract as qt_cuda_dequantize_4bit. */
int qt_cuda_dequantize_affine(const qtensor *t, float *out, char *msg, size_t msg_len);

/*
 * A GGUF tensor as the device kernels see it: llama.cpp's blocks in
 * row-major order (element e is element e % B of block e / B, B = 32, or
 * 256 for the k-quants and IQ4_XS).
 *
 * Q4_0, Q4_1, Q8_0 are in the split layout (kernels/math/qt_math.h): each
 * block's parts in arrays of their own so that every block's codes start on
 * a 16-byte boundary and one 16-byte load reads them:
 *   qs  the blocks' qs bytes back to back, exactly as in ggml: 16 per block
 *       for Q4_0 and Q4_1 (byte j holds element j in its low nibble and
 *       element j + 16 in its high nibble), 32 for Q8_0 (signed);
 *   d   each block's scale, the f16 bits ggml stores;
 *   m   each block's min for Q4_1 (f16 bits), NULL for the other kinds.
 * Upload splits ggml's blocks into these, download joins them back, bit for
 * bit.
 *
 * Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 keep
 * ggml's blocks whole, byte for byte, in qs (22, 24, 84, 110, 144, 176, 210,
 * 18, 136, 17 bytes a block); d and m are NULL. Their scales sit inside the block
 * (Q5_0's f16 d first, Q6_K's last, the k-quants' packed sub-block
 * scales), so splitting would not align the codes of every kind, and whole
 * blocks are read by the very per-block functions the CPU runs
 * (qm_q5_0_block_value ... qm_iq4_xs_block_value).
 *
 * Ownership as for the other views.
 */
typedef struct qt_cuda_gguf_view {
    qt_kind kind;       /* QT_Q4_0 ... QT_IQ4_XS */
    int64_t n_elements; /* rows * cols, a multiple of the block */
    int64_t n_blocks;   /* n_elements / 32 (k-quants, IQ4_XS: / 256) */
    const uint8_t *qs;  /* split: n_blocks * 16 (Q4_0, Q4_1) or 32 (Q8_0) bytes; whole: blocks */
    const uint16_t *d;  /* split: n_blocks; whole: NULL */
    const uint16_t *m;  /* n_blocks for Q4_1, NULL otherwise */
} qt_cuda_gguf_view;

/* Upload a GGUF qtensor's blocks, split on the host into qs, d and m (see
 * qt_cuda_gguf_view); contract as qt_cuda_4bit_upload. */
int qt_cuda_gguf_upload(const qtensor *t, qt_cuda_gguf_view *view, char *msg, size_t msg_len);

/* Free a view made by qt_cuda_gguf_upload and zero it. */
int qt_cuda_gguf_release(qt_cuda_gguf_view *view, char *msg, size_t msg_len);

/* Dequantize every element of *view into out (device memory, n_elements
 * values of out_dtype) on `stream`; contract as qt_cuda_dequantize_4bit_dev. */
int qt_cuda_dequantize_gguf_dev(const qt_cuda_gguf_view *view, void *out,
                                qt_cuda_out_dtype out_dtype, void *stream, char *msg,
                                size_t msg_len);

/* Host to host for a GGUF tensor; contract as qt_cuda_dequantize_4bit. */
int qt_cuda_dequantize_gguf(const qtensor *t, float *out, char *msg, size_t msg_len);

/*
 * An FP8 tensor (transformers' finegrained FP8, compressed-tensors'
 * float-quantized, fbgemm's per-channel FP8) or a CT_INT tensor
 * (compressed-tensors' int4/int8) as the device kernels see it: the codes
 * row-major, and one scale per block over a scale_rows x scale_cols grid
 * kept in the dtype the checkpoint stored (f32, one UE8M0 byte, bf16 or
 * f16), copied byte for byte, never widened; CT_INT adds an int8 zero point
 * per block when asymmetric. Element (r, c) is
 * internal/qt_cuda_quantfmt.h's qt_cuda_fp8_at, the CPU's arithmetic.
 * Made by qt_cuda_tensor_upload (qt_cuda_quantfmt.cu); ownership as for
 * the other views.
 */
typedef struct qt_cuda_fp8_view {
    int64_t rows, cols;
    int32_t block_rows, block_cols; /* weight_block_size, or the ct strategy's block */
    int64_t scale_rows, scale_cols; /* ceil(rows / block_rows) x ceil(cols / block_cols) */
    bool e8m0;                      /* scales are UE8M0 bytes (scale_dtype == QT_SCALE_E8M0) */
    qt_scale_dtype scale_dtype;     /* f32, UE8M0; bf16/f16 round each value to it */
    /* CT_INT (ct_int): codes are integers, row_stride bytes a row: int8 as
     * is (signed_codes), or packed unsigned q + 2^(bits - 1), 4 or 8 bits,
     * the low nibble first */
    bool ct_int;
    bool signed_codes;
    int32_t bits;
    int64_t row_stride;
    const uint8_t *codes; /* FP8: rows * cols bytes; CT_INT: rows * row_stride */
    const void *scales;   /* scale_rows * scale_cols of scale_dtype */
    bool asymmetric;      /* CT_INT: zeros holds a zero point per scale */
    const int8_t *zeros;  /* CT_INT: one per scale when asymmetric, else NULL */
} qt_cuda_fp8_view;

/*
 * A GPTQ or AWQ (GEMM) tensor as the device kernels see it: the host's
 * arrays as the checkpoint stored them (qtensor.h), packed words, f16
 * scales and the g_idx of each input channel. GPTQ: qweight [cols * bits /
 * 32][rows] words, codes packed along the input dim; AWQ: qweight
 * [cols][rows / 8], packed along the output dim in AWQ's order. qzeros
 * [groups][ceil(rows * bits / 32)] packed along the output dim (AWQ's
 * order for AWQ). w = f32(scale) * (q - z), z = stored + zero_offset.
 */
typedef struct qt_cuda_gptq_view {
    qt_kind kind; /* QT_GPTQ or QT_AWQ (for messages) */
    bool awq;     /* AWQ's packing */
    int64_t rows, cols;
    int32_t bits;            /* 4 or 8 (AWQ: 4) */
    int32_t group_size;      /* for messages and downloads: g_idx says the group */
    int64_t groups;          /* rows of scales and qzeros */
    int32_t zero_offset;     /* 1: GPTQ v1 (stored zero = z - 1), 0: v2 and AWQ */
    const uint32_t *qweight; /* rows * cols * bits / 32 words */
    const uint32_t *qzeros;  /* groups * ceil(rows * bits / 32) words */
    const uint16_t *scales;  /* groups * rows f16 bits */
    const int32_t *g_idx;    /* cols */
} qt_cuda_gptq_view;

#ifdef __cplusplus
}
#endif

#endif

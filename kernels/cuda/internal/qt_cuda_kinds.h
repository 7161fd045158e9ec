/*
 * qt_cuda_kinds.h - the CUDA backend's table of quant kinds: what each
 * qt_kind is on the device (which layout holds it) and the operations that
 * differ by kind (its dequantize kernel, its matvec kernels, its row gather,
 * its requantize for a merge), one row per kind in qt_cuda_kinds.c. The
 * row is the dispatch, as qt_traits_table's is on the CPU: no file of
 * kernels/cuda chooses by a `switch` on the kind.
 *
 * Why shaped so:
 *   - Layering. The table file sits at the top of kernels/cuda: it holds the
 *     public entry points that take a kind (qt_cuda_matvec, qt_cuda_gemm,
 *     qt_cuda_merge, the tensor and GGUF functions), each of which looks up
 *     the row and hands it down to the implementation below (the *_with
 *     functions declared here). The .cu files below read the row they are
 *     handed and never the table, so no object file calls back up into the
 *     table file (tests/test_layout.c checks that).
 *   - The geometry (name, elements and bytes per block, dense, GGUF) is the
 *     CPU's own (kernels_internal.h's QT_GEOMETRY_* macros, the rows of
 *     qt_kind_geometry_table, the one data table of kernels/): the files
 *     below name any kind from that table (kind_name) and size blocks from
 *     the row they are handed.
 *   - A kernel compiled for one kind reads that kind's block functions at
 *     compile time from qt_cuda_block<K> (internal/qt_cuda_blocks.h): the
 *     device cannot read a host table, and a template keeps the arithmetic
 *     the very qt_math.h / qt_quant_math.h calls it was.
 *   - C, so that the table can use designated initializers (C++17 has no
 *     array designators); the operations are extern "C" functions.
 *
 * Only the files of kernels/cuda include it.
 */
#ifndef QT_CUDA_KINDS_H
#define QT_CUDA_KINDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels_internal.h"
#include "qt_cuda.h"
#include "qt_cuda_ops.h"
#include "qtensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which arrays hold a kind on the device: which view of qt_cuda_tensor is
 * filled (qt_cuda_ops.h). NONE: the device does not run the kind. */
typedef enum qt_cuda_layout {
    QT_CUDA_LAYOUT_NONE = 0,
    QT_CUDA_LAYOUT_DENSE,      /* `dense`, the kind's own element type */
    QT_CUDA_LAYOUT_BNB4,       /* `q4`: bitsandbytes' codes and absmax */
    QT_CUDA_LAYOUT_AFFINE,     /* `affine`: codes, scales, zeros */
    QT_CUDA_LAYOUT_GGUF_SPLIT, /* `gguf`: blocks split into qs / d / m */
    QT_CUDA_LAYOUT_GGUF_WHOLE, /* `gguf`: ggml's blocks as they are, in qs */
    QT_CUDA_LAYOUT_FP8,        /* `fp8`: E4M3 codes, block scales as stored */
    QT_CUDA_LAYOUT_GPTQ,       /* `gptq`: packed words, qzeros, f16 scales, g_idx */
} qt_cuda_layout;

struct qt_cuda_kind_ops;
struct qt_cuda_mv_weights; /* qt_cuda_matmul.cu: a weight as the matvec kernels read it */
struct qt_cuda_merge_job;  /* qt_cuda_lora.cu: a merge in progress */

/* Dequantize device tensor t into out (f32 or bf16 per out_dtype), checks
 * first: the route of the GEMM for batched rows (the cuBLASLt operand) and
 * the merge's W. QL_OK or a code with msg. */
typedef int (*qt_cuda_dequantize_fn)(const struct qt_cuda_kind_ops *row, const qt_cuda_tensor *t,
                                     void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                     char *msg, size_t msg_len);
/* Launch the fused (fused) or generic matvec for 1..32 rows of x
 * (QT_CUDA_MATVEC_MAX_BATCH): returns the launch's cudaError_t. */
typedef int (*qt_cuda_matvec_fn)(const struct qt_cuda_mv_weights *w, bool fused, const float *x,
                                 int batch, float *y, void *stream);
/* Launch the row gather out[i] = row ids[i] of w: returns the launch's
 * cudaError_t. */
typedef int (*qt_cuda_gather_fn)(const qt_cuda_tensor *w, const int32_t *ids, int64_t n, float *out,
                                 void *stream);
/* Requantize the merge's W + d into its output tensor (qt_cuda_lora.cu):
 * QL_OK or a code with the job's msg. */
typedef int (*qt_cuda_requantize_fn)(struct qt_cuda_merge_job *j);

/* One kind on the device. The first fields are the kind's geometry (the
 * CPU's); a kind with layout NONE has nothing else, and every entry point
 * refuses it by name. */
typedef struct qt_cuda_kind_ops {
    const char *name;
    int32_t block_size; /* elements per block (1 for dense and affine) */
    size_t block_bytes; /* bytes per block (per element for dense) */
    bool is_dense;
    bool is_gguf;
    qt_cuda_layout layout;
    bool has_m; /* GGUF_SPLIT: a per-block minimum array m (Q4_1) */
    /* BNB4: bitsandbytes' codebook of the kind, the one a merge
     * requantizes with (a weight with another cannot be merged) */
    const float *codebook;
    /* GPTQ layout: AWQ's packing (codes along the output dim, in AWQ's
     * interleaved order) instead of GPTQ's */
    bool awq_packing;
    /* FP8 layout: integer codes with zero points (compressed-tensors'
     * CT_INT) instead of E4M3 codes */
    bool ct_int_codes;
    qt_cuda_dequantize_fn dequantize;
    qt_cuda_matvec_fn matvec;
    qt_cuda_gather_fn gather;
    qt_cuda_requantize_fn requantize;
} qt_cuda_kind_ops;

/* The table, in qt_cuda_kinds.c; only that file reads it. */
extern const qt_cuda_kind_ops qt_cuda_kinds[QT_KIND_COUNT];

/* ---- the operations of the rows, one per kind (or per layout) ------------ */

/* Declares the four per-kind operations of kind `k` (f32, q4_0, ...). */
#define QT_CUDA_KIND_OPS(k)                                                                        \
    int qt_cuda_dequantize_as_##k(const struct qt_cuda_kind_ops *row, const qt_cuda_tensor *t,     \
                                  void *out, qt_cuda_out_dtype out_dtype, void *stream, char *msg, \
                                  size_t msg_len);                                                 \
    int qt_cuda_matvec_as_##k(const struct qt_cuda_mv_weights *w, bool fused, const float *x,      \
                              int batch, float *y, void *stream);                                  \
    int qt_cuda_gather_as_##k(const qt_cuda_tensor *w, const int32_t *ids, int64_t n, float *out,  \
                              void *stream);                                                       \
    int qt_cuda_requantize_as_##k(struct qt_cuda_merge_job *j);

/*
 * The GGUF kinds, X(name, NAME, whole): their operations are one template
 * instantiation each (qt_cuda_block<QT_NAME>), which every .cu file
 * defines from this list (whole: kept in ggml's blocks, else split).
 */
#define QT_CUDA_GGUF_KINDS(X)                                                                      \
    X(q4_0, Q4_0, false)                                                                           \
    X(q4_1, Q4_1, false)                                                                           \
    X(q8_0, Q8_0, false)                                                                           \
    X(q5_0, Q5_0, true)                                                                            \
    X(q5_1, Q5_1, true)                                                                            \
    X(q4_k, Q4_K, true)                                                                            \
    X(q5_k, Q5_K, true)                                                                            \
    X(q6_k, Q6_K, true)                                                                            \
    X(q2_k, Q2_K, true)                                                                            \
    X(q3_k, Q3_K, true)                                                                            \
    X(iq4_nl, IQ4_NL, true)                                                                        \
    X(iq4_xs, IQ4_XS, true)                                                                        \
    X(mxfp4, MXFP4, true)

QT_CUDA_KIND_OPS(f32)
QT_CUDA_KIND_OPS(f16)
QT_CUDA_KIND_OPS(bf16)
QT_CUDA_KIND_OPS(bnb4) /* NF4 and FP4: the codebook is the view's */
QT_CUDA_KIND_OPS(affine)
QT_CUDA_KIND_OPS(fp8)
QT_CUDA_KIND_OPS(gptq) /* GPTQ and AWQ: the view's kind says the packing */
#define QT_CUDA_GGUF_OPS(name, NAME, whole) QT_CUDA_KIND_OPS(name)
QT_CUDA_GGUF_KINDS(QT_CUDA_GGUF_OPS)
#undef QT_CUDA_GGUF_OPS

/* ---- the implementations the table's entry points hand their row to ------
 * row is the kind's row, or NULL for a value that is no qt_kind; each
 * refuses a kind whose row lacks what it needs, naming the kind. */

int qt_cuda_gguf_upload_with(const qt_cuda_kind_ops *row, const qtensor *t, qt_cuda_gguf_view *view,
                             char *msg, size_t msg_len);
int qt_cuda_dequantize_gguf_dev_with(const qt_cuda_kind_ops *row, const qt_cuda_gguf_view *view,
                                     void *out, qt_cuda_out_dtype out_dtype, void *stream,
                                     char *msg, size_t msg_len);
int qt_cuda_dequantize_gguf_with(const qt_cuda_kind_ops *row, const qtensor *t, float *out,
                                 char *msg, size_t msg_len);
int qt_cuda_tensor_upload_with(const qt_cuda_kind_ops *row, const qtensor *t, qt_cuda_tensor *d,
                               char *msg, size_t msg_len);
int qt_cuda_tensor_alloc_like_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *t,
                                   qt_cuda_tensor *out, char *msg, size_t msg_len);
int qt_cuda_tensor_download_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d, qtensor *t,
                                 char *msg, size_t msg_len);
int qt_cuda_gather_rows_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *w,
                             const int32_t *ids, int64_t n, float *out, void *stream, char *msg,
                             size_t msg_len);
int qt_cuda_matvec_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *w, const float *x,
                        int64_t batch, float *y, void *stream, char *msg, size_t msg_len);
int qt_cuda_gemm_with(const qt_cuda_kind_ops *row, qt_cuda_blas *b, const qt_cuda_tensor *w,
                      const float *x, int64_t batch, float *y, void *stream, char *msg,
                      size_t msg_len);
/* The FP8 and GPTQ/AWQ layouts' arrays (qt_cuda_quantfmt.cu), for
 * qt_cuda_tensor.cu: upload t's arrays into d's view (d's kind and shape
 * set; on failure the caller releases d), free them, allocate an
 * uninitialised copy of t's (out a copy of *t), copy them back into host
 * tensor h (checked against the view's layout), and their device bytes. */
int qt_cuda_quantfmt_upload(const qt_cuda_kind_ops *row, const qtensor *t, qt_cuda_tensor *d,
                            char *msg, size_t msg_len);
int qt_cuda_quantfmt_release(qt_cuda_tensor *d, int rc, char *msg, size_t msg_len);
int qt_cuda_quantfmt_alloc_like(const qt_cuda_kind_ops *row, qt_cuda_tensor *out, char *msg,
                                size_t msg_len);
int qt_cuda_quantfmt_download(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d, qtensor *h,
                              char *msg, size_t msg_len);
size_t qt_cuda_quantfmt_bytes(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d);
bool qt_cuda_quantfmt_has_arrays(const qt_cuda_kind_ops *row, const qt_cuda_tensor *d);

int qt_cuda_merge_with(const qt_cuda_kind_ops *row, const qt_cuda_tensor *pristine,
                       const qt_cuda_lora_term *terms, int32_t n_terms, qt_cuda_tensor *out,
                       qt_cuda_merge_report *report, void *stream, char *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif /* QT_CUDA_KINDS_H */

/*
 * qt_cuda_kinds.c - the top of kernels/cuda: the table of quant kinds on
 * the device (qt_cuda_kinds, one row per qt_kind, and the row is the
 * dispatch) and the public entry points that take a kind, each of which
 * looks up the kind's row and hands it to its implementation in the .cu
 * files below (qt_cuda_matvec, qt_cuda_gemm, qt_cuda_matmul,
 * qt_cuda_merge, qt_cuda_merge_requantizes, the qt_cuda_tensor functions
 * that depend on the layout, and the GGUF functions of qt_cuda.h).
 *
 * It owns the table. It calls down into qt_cuda.cu, qt_cuda_tensor.cu,
 * qt_cuda_matmul.cu and qt_cuda_lora.cu, and nothing calls back up into it
 * (tests/test_layout.c checks the object files).
 *
 * Adding a kind: its row here (geometry from kernels_internal.h, the
 * layout that holds it, its four operations), the operations' definitions
 * in the .cu files (one line each from the templates there), and for a
 * GGUF kind its qt_cuda_block<K> in internal/qt_cuda_blocks.h.
 */
#include "qt_cuda_kinds.h"

#include <stdio.h>

#include "qt_quant_math.h"

/* The four operations of kind k, by their names in qt_cuda_kinds.h. */
#define OPS(k)                                                                                     \
    .dequantize = qt_cuda_dequantize_as_##k, .matvec = qt_cuda_matvec_as_##k,                      \
    .gather = qt_cuda_gather_as_##k, .requantize = qt_cuda_requantize_as_##k

/* A kind the device reads but does not requantize into: three operations. */
#define READ_OPS(k)                                                                                \
    .dequantize = qt_cuda_dequantize_as_##k, .matvec = qt_cuda_matvec_as_##k,                      \
    .gather = qt_cuda_gather_as_##k

static const float nf4_code[16] = QQ_NF4_CODE_INIT;
static const float fp4_code[16] = QQ_FP4_CODE_INIT;

const qt_cuda_kind_ops qt_cuda_kinds[QT_KIND_COUNT] = {
    [QT_F32] = {QT_GEOMETRY_F32, .layout = QT_CUDA_LAYOUT_DENSE, OPS(f32)},
    [QT_F16] = {QT_GEOMETRY_F16, .layout = QT_CUDA_LAYOUT_DENSE, OPS(f16)},
    [QT_BF16] = {QT_GEOMETRY_BF16, .layout = QT_CUDA_LAYOUT_DENSE, OPS(bf16)},
    [QT_NF4] = {QT_GEOMETRY_NF4, .layout = QT_CUDA_LAYOUT_BNB4, .codebook = nf4_code, OPS(bnb4)},
    [QT_FP4] = {QT_GEOMETRY_FP4, .layout = QT_CUDA_LAYOUT_BNB4, .codebook = fp4_code, OPS(bnb4)},
    [QT_AFFINE] = {QT_GEOMETRY_AFFINE, .layout = QT_CUDA_LAYOUT_AFFINE, OPS(affine)},
    [QT_Q4_0] = {QT_GEOMETRY_Q4_0, .layout = QT_CUDA_LAYOUT_GGUF_SPLIT, OPS(q4_0)},
    [QT_Q4_1] = {QT_GEOMETRY_Q4_1, .layout = QT_CUDA_LAYOUT_GGUF_SPLIT, .has_m = true, OPS(q4_1)},
    [QT_Q8_0] = {QT_GEOMETRY_Q8_0, .layout = QT_CUDA_LAYOUT_GGUF_SPLIT, OPS(q8_0)},
    [QT_Q5_0] = {QT_GEOMETRY_Q5_0, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q5_0)},
    [QT_Q5_1] = {QT_GEOMETRY_Q5_1, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q5_1)},
    [QT_Q4_K] = {QT_GEOMETRY_Q4_K, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q4_k)},
    [QT_Q5_K] = {QT_GEOMETRY_Q5_K, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q5_k)},
    [QT_Q6_K] = {QT_GEOMETRY_Q6_K, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q6_k)},
    [QT_Q2_K] = {QT_GEOMETRY_Q2_K, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q2_k)},
    [QT_Q3_K] = {QT_GEOMETRY_Q3_K, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(q3_k)},
    [QT_IQ4_NL] = {QT_GEOMETRY_IQ4_NL, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(iq4_nl)},
    [QT_IQ4_XS] = {QT_GEOMETRY_IQ4_XS, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(iq4_xs)},
    [QT_MXFP4] = {QT_GEOMETRY_MXFP4, .layout = QT_CUDA_LAYOUT_GGUF_WHOLE, OPS(mxfp4)},
    /* the checkpoint formats: merges requantize on the CPU (quant_fp8.c,
     * quant_ct.c, quant_gptq.c), whose bytes the backend uploads, so no requantize */
    [QT_FP8] = {QT_GEOMETRY_FP8, .layout = QT_CUDA_LAYOUT_FP8, READ_OPS(fp8)},
    /* compressed-tensors' integers: FP8's block grid and view (quant_ct.c) */
    [QT_CT_INT] = {QT_GEOMETRY_CT_INT, .layout = QT_CUDA_LAYOUT_FP8, .ct_int_codes = true,
                   READ_OPS(fp8)},
    [QT_GPTQ] = {QT_GEOMETRY_GPTQ, .layout = QT_CUDA_LAYOUT_GPTQ, READ_OPS(gptq)},
    [QT_AWQ] = {QT_GEOMETRY_AWQ, .layout = QT_CUDA_LAYOUT_GPTQ, .awq_packing = true,
                READ_OPS(gptq)},
};

/* The row of kind k, NULL for a value that is no qt_kind (the
 * implementations refuse both that and a row without the operation). */
static const qt_cuda_kind_ops *row_of(qt_kind k)
{
    return (unsigned)k < QT_KIND_COUNT ? &qt_cuda_kinds[k] : NULL;
}

/* ---- qt_cuda.h: the GGUF kinds ------------------------------------------- */

int qt_cuda_gguf_upload(const qtensor *t, qt_cuda_gguf_view *view, char *msg, size_t msg_len)
{
    return qt_cuda_gguf_upload_with(t ? row_of(t->kind) : NULL, t, view, msg, msg_len);
}

int qt_cuda_dequantize_gguf_dev(const qt_cuda_gguf_view *view, void *out,
                                qt_cuda_out_dtype out_dtype, void *stream, char *msg,
                                size_t msg_len)
{
    return qt_cuda_dequantize_gguf_dev_with(view ? row_of(view->kind) : NULL, view, out, out_dtype,
                                            stream, msg, msg_len);
}

int qt_cuda_dequantize_gguf(const qtensor *t, float *out, char *msg, size_t msg_len)
{
    return qt_cuda_dequantize_gguf_with(t ? row_of(t->kind) : NULL, t, out, msg, msg_len);
}

/* ---- qt_cuda_ops.h: tensors ------------------------------------------------ */

int qt_cuda_tensor_upload(const qtensor *t, qt_cuda_tensor *d, char *msg, size_t msg_len)
{
    return qt_cuda_tensor_upload_with(t ? row_of(t->kind) : NULL, t, d, msg, msg_len);
}

int qt_cuda_tensor_alloc_like(const qt_cuda_tensor *t, qt_cuda_tensor *out, char *msg,
                              size_t msg_len)
{
    return qt_cuda_tensor_alloc_like_with(t ? row_of(t->kind) : NULL, t, out, msg, msg_len);
}

int qt_cuda_tensor_download(const qt_cuda_tensor *d, qtensor *t, char *msg, size_t msg_len)
{
    return qt_cuda_tensor_download_with(d ? row_of(d->kind) : NULL, d, t, msg, msg_len);
}

int qt_cuda_gather_rows(const qt_cuda_tensor *w, const int32_t *ids, int64_t n, float *out,
                        void *stream, char *msg, size_t msg_len)
{
    return qt_cuda_gather_rows_with(w ? row_of(w->kind) : NULL, w, ids, n, out, stream, msg,
                                    msg_len);
}

/* ---- qt_cuda_ops.h: matrix products ----------------------------------------- */

int qt_cuda_matvec(const qt_cuda_tensor *w, const float *x, int64_t batch, float *y, void *stream,
                   char *msg, size_t msg_len)
{
    return qt_cuda_matvec_with(w ? row_of(w->kind) : NULL, w, x, batch, y, stream, msg, msg_len);
}

int qt_cuda_gemm(qt_cuda_blas *b, const qt_cuda_tensor *w, const float *x, int64_t batch, float *y,
                 void *stream, char *msg, size_t msg_len)
{
    return qt_cuda_gemm_with(w ? row_of(w->kind) : NULL, b, w, x, batch, y, stream, msg, msg_len);
}

int qt_cuda_matmul(qt_cuda_blas *b, const qt_cuda_tensor *w, const float *x, int64_t batch,
                   float *y, void *stream, char *msg, size_t msg_len)
{
    if (batch <= QT_CUDA_MATVEC_MAX_BATCH)
        return qt_cuda_matvec(w, x, batch, y, stream, msg, msg_len);
    if (!b) {
        if (msg && msg_len > 0)
            snprintf(msg, msg_len,
                     "qt_cuda_matmul: batch %lld needs the cuBLASLt path, and no qt_cuda_blas was "
                     "given",
                     (long long)batch);
        return QL_EINVAL;
    }
    return qt_cuda_gemm(b, w, x, batch, y, stream, msg, msg_len);
}

/* ---- qt_cuda_ops.h: merge ------------------------------------------------------ */

int qt_cuda_merge(const qt_cuda_tensor *pristine, const qt_cuda_lora_term *terms, int32_t n_terms,
                  qt_cuda_tensor *out, qt_cuda_merge_report *report, void *stream, char *msg,
                  size_t msg_len)
{
    return qt_cuda_merge_with(pristine ? row_of(pristine->kind) : NULL, pristine, terms, n_terms,
                              out, report, stream, msg, msg_len);
}

bool qt_cuda_merge_requantizes(qt_kind kind)
{
    const qt_cuda_kind_ops *row = row_of(kind);
    return row && row->requantize; /* every kind it runs, each with the CPU's quantizer */
}

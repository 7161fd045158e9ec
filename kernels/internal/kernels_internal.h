/*
 * kernels_internal.h - what the files of kernels/ share among themselves and
 * nobody else includes: the per-kind entry points the traits table points
 * at, and a small helper for building tensors.
 */
#ifndef QL_KERNELS_INTERNAL_H
#define QL_KERNELS_INTERNAL_H

#include "qtensor.h"

/* Fill out (zeroed) with a copy of `bytes` bytes of src as its data. */
int qt_wrap_copy(qtensor *out, qt_kind kind, int64_t rows, int64_t cols, const void *src,
                 size_t bytes, char *msg, size_t msg_len);

/* Dense kinds (quant_dense.c) */
int qt_dense_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                      const qt_quant_params *p, char *msg, size_t msg_len);
void qt_dense_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
size_t qt_dense_elem_bytes(qt_kind kind);

/* NF4 and FP4, bitsandbytes layout (quant_bnb4.c) */
int qt_bnb4_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len);
void qt_bnb4_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);

/* AFFINE, torchao semantics (quant_affine.c) */
int qt_affine_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len);
void qt_affine_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);

/* GGUF Q4_0, Q4_1, Q8_0, llama.cpp layout (quant_gguf.c) */
int qt_gguf_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len);
void qt_gguf_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* Bytes per block of 32 elements for a GGUF kind. */
size_t qt_gguf_block_bytes(qt_kind kind);

/* The scalar reference matrix kernel, shared by every kind: dequantize a
 * row, then dot it with each row of x (qtensor.c). */
void qt_matmul_generic_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1);

/*
 * The AVX2+FMA entry points of the traits table, one per kind with a fast
 * path (matmul_avx2.c, built with -mavx2 -mfma -mf16c; qtensor.c calls them
 * only when the CPU reports those features). Same contracts as matmul_ref
 * and dequantize_rows; every dequantization gives the scalar one's bits.
 * NF4 and FP4 share one (the codebook is the tensor's); F32 has no fast
 * dequantization (its scalar one is a memcpy).
 */
void qt_matmul_f32_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1);
void qt_matmul_f16_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1);
void qt_matmul_bf16_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                         int64_t row1);
void qt_matmul_bnb4_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                         int64_t row1);
void qt_matmul_affine_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1);
void qt_matmul_q4_0_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                         int64_t row1);
void qt_matmul_q4_1_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                         int64_t row1);
void qt_matmul_q8_0_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                         int64_t row1);
void qt_dequantize_rows_f16_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_bf16_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_bnb4_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_affine_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q4_0_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q4_1_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q8_0_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* qt_attend's AVX2 path; head dimensions that are not a multiple of 8 take
 * the reference. */
void qt_attend_avx2(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                    int32_t d, float scale, float *max, float *sum, float *acc);

#endif

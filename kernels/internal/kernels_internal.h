/*
 * kernels_internal.h - what the files of kernels/ share among themselves and
 * nobody else includes. The files call one another in layers, never back up
 * (no cycle between files):
 *
 *   traits.c        the traits table and the entry points that dispatch
 *                   through it (qt_quantize, qt_matmul, qt_dequantize_rows,
 *                   their _ref forms, qt_attend, the CPU-path choice);
 *   quant_*.c,      each kind's quantizer and scalar dequantization, its
 *   matmul_avx2.c,  AVX2 kernels and quantizers, the scalar attention loop;
 *   quant_avx2.c,   they call down into qtensor.c, matmul_avx2.c calls
 *   attend_ref.c,   quant_bnb4.c (qt_block_absmax) and attend_ref.c,
 *   matmul_fp8_     quant_avx2.c calls quant_bnb4.c (qt_bnb4_quantize_with),
 *   avx2.c, ...     matmul_fp8_avx2.c and _avx512.c call quant_fp8.c (its
 *                   table, its walks) and matmul_fp8_avx2.c quant_ct.c
 *                   (CT_INT's rows), matmul_gptq_avx2.c and _avx512.c
 *                   quant_gptq.c (a row's groups, the scalar reference);
 *   delta_rule.c,   the gated delta rule's step (Gated DeltaNet), scalar
 *   delta_rule_     and AVX2: leaves, calling nothing of kernels/;
 *   avx2.c
 *   qtensor.c       the leaf: a qtensor's lifecycle, the kinds' names and
 *                   geometry (a plain table, no function pointers), the
 *                   shape check and the f16/bf16 conversions.
 *
 * Only traits.c reads qt_traits_table; every other file asks
 * qt_kind_geometry_table for what a kind is.
 */
#ifndef QL_KERNELS_INTERNAL_H
#define QL_KERNELS_INTERNAL_H

#include "qtensor.h"

/* --- the leaf (qtensor.c) ------------------------------------------------ */

/* What a kind is, without the functions that work on it: the same fields,
 * with the same meaning, as the first half of its qt_traits row. */
typedef struct qt_kind_geometry {
    const char *name;
    int32_t block_size;
    size_t block_bytes;
    bool is_dense;
    bool is_gguf;
} qt_kind_geometry;

/* Each kind's geometry as designated initializers, written once: both
 * qt_kind_geometry_table (qtensor.c) and qt_traits_table (traits.c) are
 * initialized from these, so the two cannot disagree. */
#define QT_GEOMETRY_F32    .name = "f32", .block_size = 1, .block_bytes = 4, .is_dense = true
#define QT_GEOMETRY_F16    .name = "f16", .block_size = 1, .block_bytes = 2, .is_dense = true
#define QT_GEOMETRY_BF16   .name = "bf16", .block_size = 1, .block_bytes = 2, .is_dense = true
#define QT_GEOMETRY_NF4    .name = "nf4", .block_size = 64, .block_bytes = 32
#define QT_GEOMETRY_FP4    .name = "fp4", .block_size = 64, .block_bytes = 32
#define QT_GEOMETRY_AFFINE .name = "affine", .block_size = 1, .block_bytes = 1
/* llama.cpp block_q4_0: f16 d, 16 bytes of nibbles */
#define QT_GEOMETRY_Q4_0 .name = "q4_0", .block_size = 32, .block_bytes = 18, .is_gguf = true
/* block_q4_1: f16 d, f16 m, 16 bytes of nibbles */
#define QT_GEOMETRY_Q4_1 .name = "q4_1", .block_size = 32, .block_bytes = 20, .is_gguf = true
/* block_q8_0: f16 d, 32 int8 */
#define QT_GEOMETRY_Q8_0 .name = "q8_0", .block_size = 32, .block_bytes = 34, .is_gguf = true
/* block_q5_0: f16 d, u8 qh[4], 16 bytes of nibbles */
#define QT_GEOMETRY_Q5_0 .name = "q5_0", .block_size = 32, .block_bytes = 22, .is_gguf = true
/* block_q5_1: f16 d, f16 m, u8 qh[4], 16 bytes of nibbles */
#define QT_GEOMETRY_Q5_1 .name = "q5_1", .block_size = 32, .block_bytes = 24, .is_gguf = true
/* the k-quants' super-blocks of QK_K = 256 (qt_math.h has the layouts);
 * named lowercase, as modelfile/gguf.c prints GGML's types */
#define QT_GEOMETRY_Q4_K .name = "q4_k", .block_size = 256, .block_bytes = 144, .is_gguf = true
#define QT_GEOMETRY_Q5_K .name = "q5_k", .block_size = 256, .block_bytes = 176, .is_gguf = true
#define QT_GEOMETRY_Q6_K .name = "q6_k", .block_size = 256, .block_bytes = 210, .is_gguf = true
/* the 2- and 3-bit k-quants and the non-linear 4-bit kinds
 * (qt_quant_math.h has their layouts) */
#define QT_GEOMETRY_Q2_K   .name = "q2_k", .block_size = 256, .block_bytes = 84, .is_gguf = true
#define QT_GEOMETRY_Q3_K   .name = "q3_k", .block_size = 256, .block_bytes = 110, .is_gguf = true
#define QT_GEOMETRY_IQ4_NL .name = "iq4_nl", .block_size = 32, .block_bytes = 18, .is_gguf = true
#define QT_GEOMETRY_IQ4_XS .name = "iq4_xs", .block_size = 256, .block_bytes = 136, .is_gguf = true
/* block_mxfp4: an E8M0 scale byte, 16 bytes of FP4 nibbles (qt_quant_math.h) */
#define QT_GEOMETRY_MXFP4 .name = "mxfp4", .block_size = 32, .block_bytes = 17, .is_gguf = true
/* transformers' finegrained FP8: one E4M3 byte per element, block scales
 * apart (block_size 1: the block grid is per tensor) */
#define QT_GEOMETRY_FP8 .name = "fp8", .block_size = 1, .block_bytes = 1
/* GPTQ: int32 words of 4- or 8-bit codes along the input dim, quant state
 * apart (block_size 1: bits and groups are per tensor) */
#define QT_GEOMETRY_GPTQ .name = "gptq", .block_size = 1, .block_bytes = 1
/* AWQ GEMM: the same state, codes packed along the output dim */
#define QT_GEOMETRY_AWQ .name = "awq", .block_size = 1, .block_bytes = 1
/* compressed-tensors' integer weights: 4- or 8-bit codes per row, block
 * scales and zeros apart */
#define QT_GEOMETRY_CT_INT .name = "ct_int", .block_size = 1, .block_bytes = 1

extern const qt_kind_geometry qt_kind_geometry_table[QT_KIND_COUNT];

/* Scale i of an array of scales in dtype d, any alignment, widened to
 * f32; qt_scale_put stores v there (rounded to a 16-bit dtype; f32 as it
 * is; not E8M0) and returns what was stored, widened. */
float qt_scale_at(const void *scales, qt_scale_dtype d, int64_t i);
float qt_scale_put(void *scales, qt_scale_dtype d, int64_t i, float v);
/* Round n products to a 16-bit scale dtype (bf16, f16) in place, as
 * compressed-tensors' product in the scale's dtype; f32 and E8M0 keep
 * the f32 product. */
void qt_round_to_scale_dtype(float *v, int64_t n, qt_scale_dtype d);

/* QL_OK when a rows x cols weight with a scale per block_rows x block_cols
 * block fits: the shape, a known scale dtype, the ceil grid scale_rows x
 * scale_cols, and every scale a finite positive number; else msg says
 * which, naming kind ("fp8", "ct_int"). */
int qt_check_block_scales(const char *kind, int64_t rows, int64_t cols, int32_t block_rows,
                          int32_t block_cols, int64_t scale_rows, int64_t scale_cols,
                          const void *scales, qt_scale_dtype d, char *msg, size_t msg_len);
/* Fill out (zeroed) with `bytes` of codes: borrowed in place when borrow
 * (the caller's mapping outlives the tensor), else copied (qt_wrap_copy). */
int qt_wrap_codes(qtensor *out, qt_kind kind, int64_t rows, int64_t cols, const void *codes,
                  size_t bytes, bool borrow, char *msg, size_t msg_len);

/* Fill out (zeroed) with a copy of `bytes` bytes of src as its data. */
int qt_wrap_copy(qtensor *out, qt_kind kind, int64_t rows, int64_t cols, const void *src,
                 size_t bytes, char *msg, size_t msg_len);

/* QL_OK when rows x cols is a shape a qtensor can hold (both positive, the
 * element count fits int64); else QL_EINVAL and msg names the shape. */
int qt_check_shape(int64_t rows, int64_t cols, char *msg, size_t msg_len);
/* NaN into y[b][r] for every b < batch and r in [row0, row1) (rows of t
 * apart): a product with no memory for its scratch says so where a caller
 * checking for finite results will see it, rather than crash. */
void qt_nan_rows(const qtensor *t, int64_t batch, float *y, int64_t row0, int64_t row1);

/* --- the kinds' implementations ------------------------------------------ */

/* Dense kinds (quant_dense.c) */
int qt_dense_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                      const qt_quant_params *p, char *msg, size_t msg_len);
void qt_dense_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
size_t qt_dense_elem_bytes(qt_kind kind);

/* NF4 and FP4, bitsandbytes layout (quant_bnb4.c) */
int qt_bnb4_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len);
void qt_bnb4_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
struct qq_buckets; /* qt_quant_math.h: the sorted codebook's midpoints */
/* Code one full block of bs elements of x (bs a power of two >= 32) into
 * bs / 2 zeroed bytes of codes and return its absmax, as bitsandbytes. */
typedef float (*qt_bnb4_block_coder)(const struct qq_buckets *cb, const float *x, int64_t bs,
                                     uint8_t *codes);
/* qt_bnb4_quantize with its full blocks coded by code_full_block (every
 * coder gives the scalar one's bytes); the short last block, the odd
 * element's pad and double quant are the scalar ones. */
int qt_bnb4_quantize_with(qtensor *t, const float *src, int64_t rows, int64_t cols,
                          const qt_quant_params *p, qt_bnb4_block_coder code_full_block, char *msg,
                          size_t msg_len);

/* AFFINE, torchao semantics (quant_affine.c) */
int qt_affine_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len);
void qt_affine_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);

/* FP8 E4M3 with block scales, transformers' finegrained FP8 (quant_fp8.c) */
int qt_fp8_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                    const qt_quant_params *p, char *msg, size_t msg_len);
void qt_fp8_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);

/* GPTQ and AWQ, read from checkpoints only (quant_gptq.c): the quantizer
 * refuses */
int qt_gptq_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len);
void qt_gptq_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_awq_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* compressed-tensors' integer weights (quant_ct.c): the quantizer only
 * requantizes into a loaded tensor's layout (a merge) */
int qt_ct_int_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len);
void qt_ct_int_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* CT_INT's scalar product: a dequantized row dotted in FP8's lane order. */
void qt_ct_int_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1);
/* Their scalar products: each output one chain acc = fma(x, w, acc) over
 * the columns in order (the order every SIMD entry keeps, lane by lane). */
void qt_gptq_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1);
void qt_awq_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                       int64_t row1);
/* Row r's scale (f16 widened) and zero (offset applied) of each group g,
 * into s[g * stride] and z[g * stride]. */
void qt_gptq_row_groups(const qtensor *t, int64_t r, float *s, int32_t *z, int64_t stride);
/* Their AVX2 and AVX-512 products (matmul_gptq_avx2.c, matmul_gptq_avx512.c,
 * one body in internal/matmul_gptq.inc): the scalar products' bits. */
void qt_matmul_gptq_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                         int64_t row1);
void qt_matmul_awq_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1);
void qt_matmul_gptq_avx512(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1);
void qt_matmul_awq_avx512(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1);
/* Every E4M3 byte's f32 value (made once, thread-safe), and block s's
 * scale of t widened to f32 (quant_fp8.c, for matmul_fp8_avx2.c). */
const float *qt_fp8_e4m3_table(void);
float qt_fp8_block_scale(const qtensor *t, int64_t s);
/* Decode n codes of one block: out[c] = table[codes[c]] * scale, every
 * decoder the same bits. qt_fp8_dequantize_rows_with walks rows and blocks
 * and hands each block to decode (the scalar and AVX2 rows differ only
 * there). */
typedef void (*qt_fp8_block_decoder)(const float *table, const uint8_t *codes, float scale,
                                     int64_t n, float *out);
void qt_fp8_dequantize_rows_with(const qtensor *t, int64_t row0, int64_t nrows, float *out,
                                 qt_fp8_block_decoder decode);
/* The lane-order products' one walk (quant_fp8.c), FP8's and CT_INT's:
 * each weight row of [row0, row1) dequantized once by rows (a kind's
 * dequantize_rows, one row at a time), then dotted with the rows of x, up
 * to `most` (at most QT_FP8_MOST_ROWS) at a time by dots (out[b] for x's
 * rows b < nb, `cols` apart); NaN in y where there is no memory.
 * qt_lanes_dots_ref is the scalar dots: one row of x at a time, summed in
 * the 32-lane order every SIMD dots keeps. */
#define QT_FP8_MOST_ROWS 8
typedef void (*qt_fp8_row_dots)(const float *w, const float *x, int64_t cols, int nb, float *out);
typedef void (*qt_rows_fn)(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_lanes_matmul_with(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1, qt_rows_fn rows, qt_fp8_row_dots dots, int most);
void qt_lanes_dots_ref(const float *w, const float *x, int64_t cols, int nb, float *out);
/* FP8's scalar product (quant_fp8.c): each output's sum in 32 lanes and
 * their fixed reduction, the order of its SIMD entries. */
void qt_fp8_matmul_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                       int64_t row1);
/* FP8's AVX2 and AVX-512 entries (matmul_fp8_avx2.c, matmul_fp8_avx512.c):
 * the scalar dequantization's and the scalar product's bits. */
void qt_dequantize_rows_fp8_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_matmul_fp8_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1);
void qt_matmul_fp8_avx512(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1);
/* CT_INT's product: its scalar rows, FP8's dots (matmul_fp8_avx2.c). */
void qt_matmul_ct_int_avx2(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1);

/* GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, the k-quants Q2_K ... Q6_K,
 * IQ4_NL, IQ4_XS and MXFP4, llama.cpp layout (quant_gguf.c).
 * qt_gguf_quantize writes the blocks of 32 with a closed-form rule (Q4_0
 * ... Q5_1, MXFP4); the k-quants and IQ4 quantize through
 * qt_kquant_quantize below. */
int qt_gguf_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                     const qt_quant_params *p, char *msg, size_t msg_len);
void qt_gguf_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* Bytes per block (of the kind's block_size elements) for a GGUF kind. */
size_t qt_gguf_block_bytes(qt_kind kind);
/* Quantizing into Q2_K ... Q6_K, IQ4_NL and IQ4_XS: llama.cpp's reference quantizers
 * (quant_kquant.c, arithmetic in kernels/math/qt_kquant_ref.h). */
int qt_kquant_quantize(qtensor *t, const float *src, int64_t rows, int64_t cols,
                       const qt_quant_params *p, char *msg, size_t msg_len);

/*
 * The AVX2+FMA entry points of the traits table, one per kind with a fast
 * path (matmul_avx2.c, built with -mavx2 -mfma -mf16c; traits.c calls them
 * only when the CPU reports those features). Same contracts as matmul_ref
 * and dequantize_rows; every dequantization gives the scalar one's bits.
 * NF4 and FP4 share one (the codebook is the tensor's); F32 has no fast
 * dequantization (its scalar one is a memcpy). The products come in two
 * kernel sets, _avx2 and _avx512 (matmul_avx512.c: the same bodies with
 * eight rows of x per pass, the same bits, taken where AVX-512 VL is).
 */
#define QT_MATMUL_ARGS                                                                             \
    const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0, int64_t row1
#define QT_MATMUL_ENTRIES(set)                                                                     \
    void qt_matmul_f32_##set(QT_MATMUL_ARGS);                                                      \
    void qt_matmul_f16_##set(QT_MATMUL_ARGS);                                                      \
    void qt_matmul_bf16_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_bnb4_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_affine_##set(QT_MATMUL_ARGS);                                                   \
    void qt_matmul_q4_0_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q4_1_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q8_0_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q5_0_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q5_1_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q4_k_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q5_k_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q6_k_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q2_k_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_q3_k_##set(QT_MATMUL_ARGS);                                                     \
    void qt_matmul_iq4_nl_##set(QT_MATMUL_ARGS);                                                   \
    void qt_matmul_iq4_xs_##set(QT_MATMUL_ARGS);                                                   \
    void qt_matmul_mxfp4_##set(QT_MATMUL_ARGS);
QT_MATMUL_ENTRIES(avx2)
QT_MATMUL_ENTRIES(avx512)

void qt_lora_down_avx2(const qtensor *a, const float *x, float s, float *t, int64_t r0, int64_t r1);
void qt_lora_up_avx2(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1);
void qt_dequantize_rows_f16_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_bf16_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_bnb4_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_affine_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q4_0_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q4_1_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q8_0_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q5_0_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q5_1_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q4_k_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q5_k_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q6_k_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q2_k_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_q3_k_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_iq4_nl_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_iq4_xs_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
void qt_dequantize_rows_mxfp4_avx2(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* The AVX2 quantizers (quant_avx2.c, built and reached as matmul_avx2.c
 * is); the scalar quantizer's bytes. */
int qt_bnb4_quantize_avx2(qtensor *t, const float *src, int64_t rows, int64_t cols,
                          const qt_quant_params *p, char *msg, size_t msg_len);
/* The gated delta rule's step eight value dims at a time (delta_rule_avx2.c),
 * the bits of qt_delta_rule_ref (delta_rule.c, declared in qtensor.h). */
void qt_delta_rule_avx2(float *S, int32_t dk, int32_t dv, const float *q, const float *k,
                        const float *v, float decay, float beta, float *out, float *mem);
/* qt_attend's AVX2 path; head dimensions that are not a multiple of 16 take
 * qt_attend_ref (attend_ref.c, declared in qtensor.h). */
void qt_attend_avx2(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                    int32_t d, float scale, float *max, float *sum, float *acc);
/* qt_kv_store's and qt_kv_load's F16C/AVX2 paths (F16 both ways, Q8_0
 * loads on 8-element boundaries); the rest take the _ref forms. */
void qt_kv_store_avx2(qt_kind kind, const float *x, int64_t n, void *row);
void qt_kv_load_avx2(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out);
void qt_kv_load_rows_avx2(qt_kind kind, const void *rows, size_t row_bytes, int64_t n_rows,
                          int64_t e0, int64_t n, float *out);
/* The same four and the LoRA products in zmm registers (matmul_avx512.c,
 * rows_vec.inc: the AVX2 entries' bits), taken where the AVX-512 products
 * are; shapes they do not cover take the AVX2 entries. */
void qt_attend_avx512(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                      int32_t d, float scale, float *max, float *sum, float *acc);
void qt_kv_store_avx512(qt_kind kind, const float *x, int64_t n, void *row);
void qt_kv_load_avx512(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out);
void qt_kv_load_rows_avx512(qt_kind kind, const void *rows, size_t row_bytes, int64_t n_rows,
                            int64_t e0, int64_t n, float *out);
void qt_lora_down_avx512(const qtensor *a, const float *x, float s, float *t, int64_t r0,
                         int64_t r1);
void qt_lora_up_avx512(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1);

/*
 * The 8-bit activation path (qt_set_activations(QL_ACTIVATIONS_Q8); the qt_acts
 * of qtensor.h; arithmetic in kernels/math/qt_q8act_math.h):
 * qt_acts_alloc gives a room for the 8-bit form of batch rows of cols in
 * blocks of block (256 or 32; cols a multiple of it: QL_EINVAL otherwise,
 * QL_ENOMEM without memory);
 * quant_q8act.c holds the scalar quantizer and products, matmul_q8_avx2.c
 * the AVX2 ones, the same bits.
 */
int qt_acts_alloc(qt_acts *x, const float *f32, int64_t batch, int64_t cols, int64_t block);
void qt_acts_quantize_ref(qt_acts *a);
void qt_acts_quantize_avx2(qt_acts *a);
void qt_matmul_q8_k4_ref(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1);
void qt_matmul_q8_q6_k_ref(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                           int64_t row1);
void qt_matmul_q8_q4_k_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q5_k_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q6_k_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
/* The kinds of blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4):
 * one scalar entry for all (the kind is the tensor's), and per kind the
 * AVX2 and VNNI ones. */
void qt_matmul_q8_b32_ref(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1);
void qt_matmul_q8_q8_0_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q8_0_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q4_0_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q4_0_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q4_1_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q4_1_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q5_0_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q5_0_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q5_1_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q5_1_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_iq4_nl_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                              int64_t row1);
void qt_matmul_q8_iq4_nl_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                              int64_t row1);
void qt_matmul_q8_mxfp4_avx2(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                             int64_t row1);
void qt_matmul_q8_mxfp4_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                             int64_t row1);
/* The same on AVX-512 VNNI (matmul_q8_vnni.c): the same bits. */
void qt_matmul_q8_q4_k_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q5_k_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);
void qt_matmul_q8_q6_k_vnni(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                            int64_t row1);

#endif

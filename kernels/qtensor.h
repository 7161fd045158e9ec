/*
 * qtensor.h - the quantization core: quantized tensors and one traits table
 * indexed by quant kind.
 *
 * This is the public header of kernels/. It offers:
 *   - qtensor: a 2-D weight (rows = output features, cols = input features)
 *     in one quant kind, owning its codes and its quant state;
 *   - qt_traits_table: one row per kind, and the row is the dispatch: its
 *     name, block geometry, quantizer, scalar dequantization and scalar
 *     reference matrix kernel y = x @ W^T, and the kind's own AVX2+FMA
 *     matrix kernel, dequantization and quantizer (NULL where the kind has
 *     none; a fast quantizer writes the scalar one's bytes);
 *   - qt_quantize, qt_matmul and qt_dequantize_rows: the row's AVX2 entry when this CPU
 *     has AVX2+FMA+F16C (detected once, at run time) and the entry is not
 *     NULL, else the row's scalar one; qt_matmul_ref, the scalar reference
 *     every fast path is tested against;
 *   - qt_attend, the attention inner loop over a paged cache's run, with
 *     the same run-time choice, and qt_kv_store/qt_kv_load, the KV cache's
 *     f32, f16 and q8_0 rows.
 *
 * It owns nothing global but the CPU-path choice (qt_set_force_scalar);
 * it touches only base/ (the error space).
 *
 * Its files call one another in layers, never back up: traits.c (the table
 * and the entry points that dispatch through it) on top; each kind's
 * quant_*.c, matmul_avx2.c, quant_avx2.c and attend_ref.c below it; qtensor.c (a
 * qtensor's lifecycle, the kinds' names) the leaf. kernels/internal/
 * kernels_internal.h draws the map.
 *
 * Layouts, each compatible with its origin bit for bit:
 *   NF4, FP4    bitsandbytes quantize_4bit: blocks of `blocksize` elements over
 *               the flattened row-major tensor, absmax per block, two codes
 *               per byte, first element in the high nibble; optional double
 *               quantization of absmax (bitsandbytes compress_statistics).
 *   AFFINE      torchao AffineQuantizedTensor semantics: w = (q - zero) * scale
 *               (integer zero domain) or w = (q - mid) * scale + zero (float
 *               zero domain), groups along the input dimension. Codes are
 *               stored unsigned (q - qmin); 4-bit codes pack two per byte,
 *               first element in the high nibble, each row starting on a byte.
 *   Q4_0 Q4_1 Q8_0  llama.cpp's GGUF blocks of 32, byte for byte.
 *   Q5_0 Q5_1       llama.cpp's 5-bit blocks of 32, byte for byte.
 *   Q4_K Q5_K Q6_K  llama.cpp's k-quant super-blocks of 256, byte for byte;
 *                   quantized by llama.cpp's reference quantizers
 *                   (quantize_row_q4_K_ref ...), byte for byte.
 *   Q2_K Q3_K       llama.cpp's 2- and 3-bit k-quant super-blocks of 256
 *                   (sub-blocks of 16 with 4-bit or 6-bit scales); quantized
 *                   by llama.cpp's reference quantizers too.
 *   IQ4_NL IQ4_XS   llama.cpp's non-linear 4-bit blocks: IQ4_NL blocks of 32
 *                   (one f16 scale, each nibble an index into 16 fixed
 *                   levels), IQ4_XS super-blocks of 256 (eight sub-blocks of
 *                   32 with 6-bit scales, the same levels); read in place
 *                   only. llama-quantize writes IQ4_NL where an IQ4_XS
 *                   tensor's rows cannot hold 256-blocks (576-wide rows).
 *   MXFP4           llama.cpp's block_mxfp4 (GGUF type 39, OCP microscaling
 *                   FP4): blocks of 32 FP4 E2M1 codes (Q4_0's nibble
 *                   order) after one E8M0 scale byte, 17 bytes; read in
 *                   place, quantized by quantize_row_mxfp4_ref's rule byte
 *                   for byte. GPT-OSS's Hugging Face `_blocks` / `_scales`
 *                   pairs become such blocks through qt_from_mxfp4_hf.
 *   FP8             transformers' finegrained FP8 (quant_method "fp8", the
 *                   layout of DeepSeek's and Qwen3-*-FP8's releases): one
 *                   E4M3FN byte per element, row-major, and a
 *                   `weight_scale_inv` per block_rows x block_cols block
 *                   (weight_block_size) over a ceil(rows / block_rows) x
 *                   ceil(cols / block_cols) grid, stored as the checkpoint
 *                   stored it: f32 (scale_fmt "float") or one UE8M0 byte
 *                   (scale_fmt "ue8m0", safetensors F8_E8M0). w = f32(code)
 *                   * f32(scale), one f32 multiply, as transformers'
 *                   Fp8Dequantize; read in place from the mapped file.
 *                   The same kind holds fbgemm's per-channel FP8 (a 1 x cols
 *                   block, f32 scales) and compressed-tensors'
 *                   float-quantized FP8 (channel, tensor or block scales in
 *                   f32, bf16 or f16; with a 16-bit scale the product is
 *                   rounded to its dtype, as compressed-tensors computes).
 *   CT_INT          compressed-tensors' integer weights (llm-compressor's
 *                   pack-quantized and naive-quantized formats): a row's
 *                   codes either packed densely into little-endian int32
 *                   words, code c at bit c * bits of the row (q + 2^(bits -
 *                   1), unsigned: pack_to_int32), or one signed int8 each
 *                   (naive); a scale (f32, bf16 or f16, kept) and an
 *                   optional int8 zero point per block of FP8's grid (a
 *                   group is a 1 x group block, a channel 1 x cols, the
 *                   tensor rows x cols). w = (q - z) * s computed in the
 *                   scale's dtype, as compressed-tensors' dequantize:
 *                   f32(q - z) * f32(s) rounded to a 16-bit scale's dtype.
 *   F32 F16 BF16    dense row-major.
 *
 * Quant state (absmax, scales, zero points, codebooks, nested statistics) is
 * owned by its quantizer and keeps its own dtype: qt_cast_dense converts the
 * dense kinds only and refuses every quantized one.
 *
 * Errors: functions return QL_OK (0) or a negative QL_E* code
 * (base/ql_base.h), and write a sentence naming the field and the value into
 * the caller's buffer.
 */
#ifndef QL_QTENSOR_H
#define QL_QTENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ql_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum qt_kind {
    QT_F32 = 0,
    QT_F16,
    QT_BF16,
    QT_NF4,
    QT_FP4,
    QT_AFFINE,
    QT_Q4_0,
    QT_Q4_1,
    QT_Q8_0,
    QT_Q5_0,
    QT_Q5_1,
    QT_Q4_K,
    QT_Q5_K,
    QT_Q6_K,
    QT_Q2_K,
    QT_Q3_K,
    QT_IQ4_NL,
    QT_IQ4_XS,
    QT_MXFP4,
    QT_FP8,
    QT_GPTQ,
    QT_AWQ,
    QT_CT_INT,
    QT_KIND_COUNT
} qt_kind;

/* How the zero point of an AFFINE tensor is expressed (torchao ZeroPointDomain). */
typedef enum qt_zero_domain {
    QT_ZERO_INT = 0, /* w = (q - zero) * scale, zero an integer in [qmin, qmax] */
    QT_ZERO_FLOAT,   /* w = (q - mid) * scale + zero, mid = (qmin + qmax + 1) / 2 */
} qt_zero_domain;

/* The dtype an FP8 or CT_INT tensor's block scales are stored in (and
 * stay in). With a 16-bit scale the product code * scale is rounded to that
 * dtype, as compressed-tensors computes it in the scale's dtype. */
typedef enum qt_scale_dtype {
    QT_SCALE_F32 = 0, /* float32, transformers' scale_fmt "float" */
    QT_SCALE_E8M0,    /* one UE8M0 byte, 2^(e - 127): scale_fmt "ue8m0" */
    QT_SCALE_BF16,    /* bfloat16 (compressed-tensors, the model's dtype) */
    QT_SCALE_F16,     /* IEEE half */
} qt_scale_dtype;

/* What quantizing asks for. Zero-initialise, then set kind and what applies. */
typedef struct qt_quant_params {
    qt_kind kind;
    /* NF4, FP4: elements per absmax block, a power of two in [32, 4096];
     * 0 means 64 (bitsandbytes' default). */
    int32_t blocksize;
    /* NF4, FP4: quantize absmax again (bitsandbytes compress_statistics). */
    bool double_quant;
    /* AFFINE: 4 or 8. */
    int32_t bits;
    /* AFFINE: elements per group along a row; 0 means one group per row
     * (per channel). Must divide cols. */
    int32_t group_size;
    /* AFFINE: symmetric (zero at the middle code, scale from max |w|) or
     * asymmetric (scale from max - min). */
    bool symmetric;
    /* AFFINE, asymmetric only: where the zero point lives. Symmetric mapping
     * always uses the integer domain. */
    qt_zero_domain zero_domain;
    /* AFFINE: the integer range of the codes. Both 0 means the default:
     * [-2^(b-1), 2^(b-1) - 1] when symmetric, [0, 2^b - 1] when asymmetric
     * (torchao's int8 asymmetric uses the signed range: set it here). */
    int32_t qmin, qmax;
    /* AFFINE: the smallest scale allowed (torchao's eps); 0 means FLT_EPSILON,
     * as torchao's int8 weight-only uses; its int4 weight-only uses 1e-6. */
    float eps;
    /* FP8: the block (weight_block_size); 0 means 128 (transformers'
     * default); and the scales' dtype. */
    int32_t block_rows, block_cols;
    qt_scale_dtype scale_dtype;
    /* GPTQ, AWQ, CT_INT: the loaded tensor whose layout (bits, g_idx, groups, zero
     * convention, packing) a merge requantizes into; borrowed for the call.
     * Without it these kinds are refused (qlserve reads them, it does not
     * quantize a float model to them). */
    const struct qtensor *layout;
} qt_quant_params;

/*
 * A quantized (or dense) 2-D tensor. 1-D tensors are one row. Every pointer
 * is owned by the qtensor and freed by qt_free. Fields that do not apply to
 * the kind are zero.
 */
typedef struct qtensor {
    qt_kind kind;
    int64_t rows, cols;

    uint8_t *data; /* codes, blocks or dense values */
    size_t data_bytes;
    bool data_borrowed; /* data points into memory someone else owns (a
                           mapped model file) and outlives the tensor;
                           qt_free leaves it alone */

    /* NF4, FP4 */
    int32_t blocksize;
    int64_t n_blocks;      /* ceil(rows * cols / blocksize) */
    float codebook[16];    /* the 4-bit code (bitsandbytes quant_map) */
    float *absmax;         /* n_blocks, when !nested */
    bool nested;           /* double quantization */
    uint8_t *absmax_codes; /* n_blocks codes into nested_code, when nested */
    float *nested_absmax;  /* n_nested_blocks */
    int64_t n_nested_blocks;
    int32_t nested_blocksize; /* 256, as bitsandbytes */
    float nested_offset;      /* the mean of absmax subtracted before */
    float nested_code[256];   /* the signed dynamic 8-bit map */

    /* AFFINE */
    int32_t bits;
    int32_t group_size;     /* elements per group; == cols when per channel */
    int64_t groups_per_row; /* cols / group_size */
    int32_t qmin, qmax;
    qt_zero_domain zero_domain;
    float *scales;     /* rows * groups_per_row */
    float *zeros;      /* rows * groups_per_row; integer valued in the int domain */
    size_t row_stride; /* bytes per row of codes */

    /* FP8: codes in data (rows * cols E4M3 bytes), one scale per block of
     * block_rows x block_cols over a scale_rows x scale_cols grid */
    int32_t block_rows, block_cols;
    int64_t scale_rows, scale_cols;
    qt_scale_dtype scale_dtype;
    void *block_scales; /* scale_rows * scale_cols f32 or UE8M0 bytes, owned */

    /* GPTQ: qweight in data ([cols * bits / 32, rows] little-endian int32
     * words, codes packed along the input dim); bits and group_size above.
     * AWQ (GEMM) shares the fields: qweight [cols, rows / 8] and qzeros
     * packed along the output dim in AWQ's order, g_idx c / group_size */
    uint32_t *gptq_qzeros; /* [gptq_groups, ceil(rows * bits / 32)] words, owned */
    uint16_t *gptq_scales; /* [gptq_groups, rows] f16, owned, never widened */
    int32_t *gptq_g_idx;   /* cols: the group of each input channel, owned */
    int64_t gptq_groups;
    int32_t gptq_zero_offset; /* 1: v1 (stored zero = z - 1), 0: gptq_v2 */

    /* CT_INT: codes in data, row_stride bytes per row, bits above; the
     * scales on FP8's block grid (block_rows ... block_scales) */
    int8_t *block_zeros;  /* one zero point per block, owned; NULL: symmetric */
    bool ct_signed_codes; /* naive-quantized int8 bytes; else pack-quantized */
} qtensor;

/*
 * A batch of activation rows prepared for products with weights of one
 * kind (qt_acts_prepare): x itself, and under QL_ACTIVATIONS_Q8, where the kind has
 * the 8-bit path, x quantized to int8 per block of the kind's (q, with the
 * blocks' scales d and the sums of each 16 codes bsum), made once and read
 * by every product and thread that multiplies the same x.
 */
typedef struct qt_acts {
    const float *x; /* batch rows of cols (the caller's, not owned) */
    int64_t batch, cols;
    int64_t block; /* activations per scale: 256 (k-quants) or 32 */
    int8_t *q;     /* batch * cols codes, row after row; NULL: f32 only */
    float *d;      /* batch * cols / block */
    int16_t *bsum; /* batch * cols / 16 */
    float *dsum;   /* each block's d times its sum of codes, batch * cols / block */
    void *mem;     /* what qt_acts_release frees; NULL in a view */
} qt_acts;

/* The row of the traits table for one kind: what the kind is, and the
 * functions that work on it. traits.c holds the rows; the kind's file
 * (quant_*.c) and matmul_avx2.c hold the functions. */
typedef struct qt_traits {
    const char *name;   /* "nf4", "q4_0", "bf16", ... */
    int32_t block_size; /* elements per block; the default for NF4/FP4, whose
                           blocksize is per tensor; group 1 for dense kinds */
    size_t block_bytes; /* bytes of codes per block (NF4/FP4: default block;
                           AFFINE: per element rounded up, see qtensor) */
    bool is_dense;      /* F32, F16, BF16: plain floats, no quant state */
    bool is_gguf;       /* Q4_0 ... IQ4_XS, MXFP4: llama.cpp blocks of block_size */

    /* Quantize rows*cols floats into t (already zeroed; t->kind set). On
     * error t holds nothing and msg says what was wrong. */
    int (*quantize)(qtensor *t, const float *src, int64_t rows, int64_t cols,
                    const qt_quant_params *p, char *msg, size_t msg_len);
    /* Dequantize rows [row0, row0 + nrows) into out (nrows * cols floats). */
    void (*dequantize_rows)(const qtensor *t, int64_t row0, int64_t nrows, float *out);
    /* Scalar reference: y[b][r] = sum_c x[b][c] * W[r][c] for r in [row0,
     * row1), b in [0, batch). x is batch * cols, y is batch * t->rows.
     * Every kind's is the same (dequantize a row through dequantize_rows,
     * then dot), kept per row so a kind may bring its own. */
    void (*matmul_ref)(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                       int64_t row1);
    /* The kind's AVX2+FMA paths (matmul_avx2.c), NULL where it has none
     * and qt_matmul / qt_dequantize_rows take the scalar entries above;
     * same contracts. The fast dequantization gives the same bits as
     * dequantize_rows. */
    void (*matmul_avx2)(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                        int64_t row1);
    /* The same product compiled for AVX-512 VL (matmul_avx512.c): eight rows of
     * x per pass, the AVX2 entry's bits; NULL where the kind has none. */
    void (*matmul_avx512)(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                          int64_t row1);
    void (*dequantize_rows_avx2)(const qtensor *t, int64_t row0, int64_t nrows, float *out);
    /* The kind's AVX2 quantizer (quant_avx2.c), NULL where it has none;
     * the same contract and the same bytes as quantize. */
    int (*quantize_avx2)(qtensor *t, const float *src, int64_t rows, int64_t cols,
                         const qt_quant_params *p, char *msg, size_t msg_len);
    /* The product against 8-bit activations (QL_ACTIVATIONS_Q8), scalar and AVX2;
     * NULL where the kind keeps f32 activations. */
    void (*matmul_q8)(const qtensor *t, const qt_acts *x, float *y, int64_t row0, int64_t row1);
    void (*matmul_q8_avx2)(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                           int64_t row1);
    void (*matmul_q8_vnni)(const qtensor *t, const qt_acts *x, float *y, int64_t row0,
                           int64_t row1);
} qt_traits;

extern const qt_traits qt_traits_table[QT_KIND_COUNT];

/* The kind named `name` ("nf4", "fp4", "affine", "q4_0", "f16", ...), or -1. */
int qt_kind_from_name(const char *name);
const char *qt_kind_name(qt_kind kind);

/*
 * Quantize a rows x cols row-major f32 matrix into *out (which this call
 * initialises; free it with qt_free). Refuses NaN/Inf with the first bad
 * index, a blocksize or group size that does not fit, and shapes a kind
 * cannot hold (GGUF kinds need cols % 32 == 0, the k-quants Q2_K ... Q6_K
 * and IQ4_XS cols % 256 == 0).
 */
int qt_quantize(qtensor *out, const float *src, int64_t rows, int64_t cols,
                const qt_quant_params *p, char *msg, size_t msg_len);

/* Dequantize rows [row0, row0 + nrows) of t into out (nrows * cols floats),
 * fastest path on this CPU; every path gives the same bits. */
void qt_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out);
/* The same through the kind's scalar reference. */
void qt_dequantize_rows_ref(const qtensor *t, int64_t row0, int64_t nrows, float *out);

/* y = x @ W^T for rows [row0, row1) of W, fastest path on this CPU. */
void qt_matmul(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
               int64_t row1);
/* The same through the scalar reference. */
void qt_matmul_ref(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
                   int64_t row1);

/*
 * Attention of one query row q[0..d) over n cached positions whose keys
 * and values lie at k + i * stride and v + i * stride (i < n), scores
 * scaled by scale: the running softmax (*max, *sum, as om_online in
 * ops_math.h) and the weighted sum of values acc[0..d) carry over from
 * call to call, so a caller walks a paged cache one block's run at a
 * time. qt_attend takes the fastest path on this CPU; qt_attend_ref is
 * the scalar arithmetic.
 */
void qt_attend(const float *q, const float *k, const float *v, int64_t stride, int32_t n, int32_t d,
               float scale, float *max, float *sum, float *acc);
void qt_attend_ref(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                   int32_t d, float scale, float *max, float *sum, float *acc);

/*
 * One token through one value head of the gated delta rule (Gated
 * DeltaNet, engine/model/hybrid.h): the state S [dk][dv] times decay, mem
 * = beta (v - S^T k), S += k mem^T, out = S^T q (mem [dv] is the caller's
 * scratch, left holding beta's correction). qt_delta_rule takes the
 * fastest path on this CPU, the same bits as qt_delta_rule_ref.
 */
void qt_delta_rule(float *S, int32_t dk, int32_t dv, const float *q, const float *k, const float *v,
                   float decay, float beta, float *out, float *mem);
void qt_delta_rule_ref(float *S, int32_t dk, int32_t dv, const float *q, const float *k,
                       const float *v, float decay, float beta, float *out, float *mem);

/*
 * The two products of an unmerged LoRA module stored in bf16 (A [rank, in],
 * B [out, rank], both QT_BF16), for one activation row at a time, so that a
 * row's bits never depend on the rows beside it:
 *   qt_lora_down: t[r] = s * (A[r] . x)  for rank rows r in [r0, r1);
 *   qt_lora_up:   y[o] = y[o] + B[o] . t  for outputs o in [o0, o1).
 * Each dot product accumulates in f32 in eight lanes (element i into lane
 * i % 8, a product then a sum, never fused, zero-padded to a multiple of
 * eight elements) and then sums its lanes as ((l0 + l1) + (l2 + l3)) +
 * ((l4 + l5) + (l6 + l7)). The AVX2 path (bf16 widened by a 16-bit shift,
 * eight rows at a time, lanes summed by horizontal adds), the AVX-512 one
 * (two rows' lanes to a zmm, sixteen rows at a time) and the _ref give
 * the same bits; tests/test_lora_bf16.c holds them to it.
 */
void qt_lora_down(const qtensor *a, const float *x, float s, float *t, int64_t r0, int64_t r1);
void qt_lora_up(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1);
/* Rows qt_lora_down and qt_lora_up take per pass here (16 on the AVX-512
 * path, 8 otherwise): a caller splitting a rank into pieces splits on
 * multiples of it, so that no pass is cut short. A row's bits do not
 * depend on it. */
int64_t qt_lora_rows_per_pass(void);
void qt_lora_down_ref(const qtensor *a, const float *x, float s, float *t, int64_t r0, int64_t r1);
void qt_lora_up_ref(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1);

/*
 * KV cache rows: n values (a row of K or V, kv_dim long) stored in kind
 * QT_F32, QT_F16 (IEEE half, round to nearest even) or QT_Q8_0 (llama.cpp's
 * block_q8_0 { f16 d; i8 qs[32]; } one after another, n a multiple of 32).
 * qt_kv_row_bytes: the bytes of such a row (0 for another kind, or for
 * Q8_0 when n is not a multiple of 32). qt_kv_store writes x[0..n) into row;
 * qt_kv_load reads elements e0..e0+n of row (for Q8_0 inside one row of
 * blocks, any e0) into out as f32. The fast forms (F16C, AVX2, AVX-512) agree with
 * the _ref ones bit for bit.
 */
size_t qt_kv_row_bytes(qt_kind kind, int64_t n);
void qt_kv_store(qt_kind kind, const float *x, int64_t n, void *row);
void qt_kv_store_ref(qt_kind kind, const float *x, int64_t n, void *row);
void qt_kv_load(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out);
void qt_kv_load_ref(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out);
/* qt_kv_load of n_rows rows, row_bytes apart from rows, into out (n floats
 * a row, one after another): the same bits, one dispatch for a KV block's
 * run rather than one per position (attention converts a head's slice of
 * every position it reads). */
void qt_kv_load_rows(qt_kind kind, const void *rows, size_t row_bytes, int64_t n_rows, int64_t e0,
                     int64_t n, float *out);
void qt_kv_load_rows_ref(qt_kind kind, const void *rows, size_t row_bytes, int64_t n_rows,
                         int64_t e0, int64_t n, float *out);

/*
 * Activations (base's ql_activations, its words in ql_activations_names):
 * QL_ACTIVATIONS_F32 (the default) multiplies every weight by f32
 * activations; QL_ACTIVATIONS_Q8 first quantizes each activation row to
 * int8 per block (one f32 scale each; 256 for Q4_K, Q5_K, Q6_K as
 * llama.cpp's q8_K, 32 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 as
 * its q8_0) and multiplies in integers, as llama.cpp does: faster, and no
 * longer the float64 reference's answer (README, "8-bit activations").
 * Other kinds keep f32. Process-wide, set once at start (qlserve serve
 * --activations); every path (scalar, AVX2, AVX-512 VNNI) gives the same
 * bits, batched or alone.
 */
void qt_set_activations(ql_activations a);
ql_activations qt_get_activations(void);
/* The 8-bit product through the scalar reference, whatever the setting
 * (false: the kind or shape has no such path, or no memory). */
bool qt_matmul_q8_ref(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
                      int64_t row1);
/* Prepare x (batch rows of w->cols) for products with w's kind; without
 * memory for the 8-bit form it keeps f32 (same answers as qt_matmul, never
 * an error). Release what it made with qt_acts_release. */
void qt_acts_prepare(qt_acts *a, const qtensor *w, const float *x, int64_t batch);
void qt_acts_release(qt_acts *a);
/* Rows [first, first + n) of a, as a view (nothing to release). */
qt_acts qt_acts_rows(const qt_acts *a, int64_t first, int64_t n);
/* qt_matmul with prepared activations: the same bits as qt_matmul(w, a->x,
 * a->batch, ...) under the same setting. */
void qt_matmul_acts(const qtensor *w, const qt_acts *a, float *y, int64_t row0, int64_t row1);

/* Which products the 8-bit path takes here: "avx512vnni", "avx2" or
 * "scalar"; qt_set_no_vnni(true) keeps it to AVX2 (tests, benchmarks). */
const char *qt_q8_path(void);
void qt_set_no_vnni(bool off);

/* Which products f32 activations take here: "avx512" (AVX-512 VL: eight
 * rows of x per pass, the AVX2 products' bits), "avx2" or "scalar";
 * qt_set_no_avx512(true) keeps them to AVX2 (tests, benchmarks). */
const char *qt_f32_path(void);
void qt_set_no_avx512(bool off);
/* Which paths qt_attend, qt_kv_store/qt_kv_load and the LoRA products take
 * here: "avx512" (zmm registers, the AVX2 paths' bits), "avx2" or
 * "scalar", by the same switch as the f32 products (qt_set_no_avx512). */
const char *qt_rows_path(void);

/* Which fast path qt_matmul takes on this machine: "avx2" or "scalar". */
const char *qt_cpu_path(void);
/* Force the scalar reference everywhere (for tests and benchmarks). */
void qt_set_force_scalar(bool force);

/*
 * Wrap existing dense values: copies rows*cols elements of kind (F32, F16,
 * BF16) from src into a new qtensor.
 */
int qt_from_dense(qtensor *out, qt_kind kind, const void *src, int64_t rows, int64_t cols,
                  char *msg, size_t msg_len);

/*
 * Change the float dtype of a dense tensor in place (F32 <-> F16 <-> BF16,
 * round to nearest even). Quantized kinds are refused with QL_EUNSUPPORTED:
 * their quant state belongs to the quantizer and never changes dtype.
 */
int qt_cast_dense(qtensor *t, qt_kind to, char *msg, size_t msg_len);

/*
 * Wrap llama.cpp block bytes (as a GGUF file stores them) of a GGUF kind
 * (Q4_0 ... IQ4_XS, MXFP4) into a new qtensor, copying them; cols must be a
 * multiple of the kind's block (32, or 256 for the k-quants and IQ4_XS) and bytes
 * exactly rows * cols / block_size blocks.
 */
int qt_from_gguf_blocks(qtensor *out, qt_kind kind, const void *blocks, size_t bytes, int64_t rows,
                        int64_t cols, char *msg, size_t msg_len);

/*
 * One rows x cols MXFP4 matrix from a Hugging Face checkpoint's pair (GPT-OSS
 * stores each expert weight as `<name>_blocks`, uint8 [..., rows, cols / 32,
 * 16], and `<name>_scales`, uint8 E8M0 [..., rows, cols / 32]): blocks and
 * scales point at one matrix's slab of each (for a 3-D expert tensor, expert
 * e's: blocks + e * rows * cols / 2, scales + e * rows * cols / 32), borrowed
 * for the call. *out becomes a new QT_MXFP4 qtensor (free it with qt_free)
 * in ggml's block layout: per block of 32 its scale byte, unchanged (both
 * sides read it as 2^(s - 127) times the E2M1 value), then 16 code bytes.
 * The nibbles are reordered: transformers' convert_moe_packed_tensors reads
 * byte j of a block as element 2j (low nibble) and 2j + 1 (high nibble),
 * ggml as element j (low) and j + 16 (high). cols must be a positive
 * multiple of 32, else QL_EINVAL naming the shape.
 */
int qt_from_mxfp4_hf(qtensor *out, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                     int64_t cols, char *msg, size_t msg_len);

/* The parts of a bitsandbytes 4-bit tensor as a checkpoint stores them.
 * Every pointer is borrowed for the call; qt_from_bnb4 copies. */
typedef struct qt_bnb4_parts {
    qt_kind kind; /* QT_NF4 or QT_FP4 */
    int64_t rows, cols;
    int32_t blocksize;
    const uint8_t *codes; /* packed, ceil(rows * cols / 2) bytes */
    size_t codes_bytes;
    const float *codebook;       /* 16 (quant_map) */
    int64_t n_blocks;            /* entries of absmax / absmax_codes */
    const float *absmax;         /* f32 per block, when not nested */
    const uint8_t *absmax_codes; /* per block, when nested */
    const float *nested_absmax;  /* when nested */
    int64_t n_nested_blocks;
    int32_t nested_blocksize;
    float nested_offset;
    const float *nested_code; /* 256, when nested */
} qt_bnb4_parts;

/*
 * Build an NF4/FP4 qtensor from checkpoint parts after checking that every
 * count agrees with the shape and block sizes and that all quant state is
 * finite; msg names the part that does not fit.
 */
int qt_from_bnb4(qtensor *out, const qt_bnb4_parts *parts, char *msg, size_t msg_len);

/* The parts of a finegrained FP8 tensor as a checkpoint stores them,
 * borrowed for the call. qt_from_fp8 keeps codes borrowed when
 * borrow_codes (the caller's mapping outlives the tensor) and copies the
 * scales. The grid must be ceil(rows / block_rows) x ceil(cols /
 * block_cols); msg names what does not fit. */
typedef struct qt_fp8_parts {
    int64_t rows, cols;
    int32_t block_rows, block_cols;
    const uint8_t *codes; /* rows * cols E4M3FN bytes */
    bool borrow_codes;
    qt_scale_dtype scale_dtype;
    const void *scales; /* scale_rows * scale_cols of scale_dtype, any alignment */
    int64_t scale_rows, scale_cols;
} qt_fp8_parts;

int qt_from_fp8(qtensor *out, const qt_fp8_parts *parts, char *msg, size_t msg_len);

/* The parts of a GPTQ linear as a checkpoint stores them (optimum /
 * auto-gptq / gptqmodel), borrowed for the call: qweight [cols * bits / 32,
 * rows], qzeros [groups, rows * bits / 32], scales f16 [groups, rows],
 * g_idx [cols] (NULL: channel c is in group c / group_size), all any
 * alignment. qt_from_gptq keeps qweight borrowed when borrow_codes and
 * copies the rest; msg names the part that does not fit. */
typedef struct qt_gptq_parts {
    int64_t rows, cols; /* out_features, in_features */
    int32_t bits;       /* 4 or 8 */
    int32_t group_size; /* -1: one group over the whole input */
    bool v2;            /* checkpoint_format gptq_v2: zeros stored as is */
    bool awq;           /* AWQ GEMM instead (QT_AWQ): qweight [cols, rows * bits
                           / 32] and qzeros packed along the output dim in
                           AWQ's order, zeros as stored, g_idx NULL */
    const uint8_t *qweight;
    bool borrow_codes;
    const uint8_t *qzeros;
    const uint8_t *scales;
    const uint8_t *g_idx;
    int64_t groups; /* rows of qzeros and scales */
} qt_gptq_parts;

int qt_from_gptq(qtensor *out, const qt_gptq_parts *parts, char *msg, size_t msg_len);

/* The parts of a compressed-tensors integer weight as a checkpoint
 * stores them, borrowed for the call: codes (pack-quantized weight_packed,
 * int32 [rows, ceil(cols * bits / 32)], or naive int8 [rows, cols]), the
 * scales on the block grid (scale_rows x scale_cols entries, any
 * alignment), and the zero points (NULL: symmetric), one signed int8 per
 * block, or packed (zeros_packed: int32 [ceil(scale_rows * bits / 32),
 * scale_cols], pack_to_int32 along the output dim). qt_from_ct_int keeps
 * the codes borrowed when borrow_codes, copies the scales as stored and
 * unpacks the zeros to int8 (their zp_dtype); msg names what does not
 * fit. */
typedef struct qt_ct_int_parts {
    int64_t rows, cols;
    int32_t bits; /* 4 or 8 (pack-quantized), 8 (naive) */
    bool packed;  /* pack-quantized; else naive int8 */
    int32_t block_rows, block_cols;
    const uint8_t *codes;
    bool borrow_codes;
    qt_scale_dtype scale_dtype; /* f32, bf16 or f16 */
    const void *scales;
    int64_t scale_rows, scale_cols;
    const uint8_t *zeros;
    bool zeros_packed;
} qt_ct_int_parts;

int qt_from_ct_int(qtensor *out, const qt_ct_int_parts *parts, char *msg, size_t msg_len);

/* "f32", "e8m0", "bf16" or "f16" (what `qlserve inspect` prints), and the bytes of one scale. */
const char *qt_scale_dtype_name(qt_scale_dtype d);
size_t qt_scale_dtype_size(qt_scale_dtype d);

/* The absmax an NF4/FP4 tensor dequantizes block b with (double
 * quantization undone). */
float qt_block_absmax(const qtensor *t, int64_t b);

/* A deep copy (data copied even when borrowed); free with qt_free. */
int qt_clone(qtensor *out, const qtensor *src);

/* Free everything t owns (not borrowed data) and zero it. Safe on a
 * zeroed qtensor. */
void qt_free(qtensor *t);

/* Bytes the tensor occupies, codes plus quant state. */
size_t qt_nbytes(const qtensor *t);

/* The bitsandbytes codebooks and the signed dynamic map (nested absmax). */
extern const float qt_nf4_code[16];
extern const float qt_fp4_code[16];
extern const float qt_dynamic_map_signed[256];

/* IEEE half and bfloat16 conversions, round to nearest even, NaN kept. */
float qt_f16_to_f32(uint16_t h);
uint16_t qt_f32_to_f16(float f);
float qt_bf16_to_f32(uint16_t b);
uint16_t qt_f32_to_bf16(float f);

#ifdef __cplusplus
}
#endif

#endif

/*
 * qt_cuda_ops.h - the device kernels the CUDA backend of the engine runs a
 * forward step with (engine/runtime/backend_cuda.c's row of operations,
 * which engine/runtime/walk.c walks), beyond qt_cuda.h's dequantize:
 *   - qt_cuda_tensor: any weight resident on the device in its own layout
 *     (upload, allocate alike, download, release), and row gathers from it
 *     (the embedding lookup);                          qt_cuda_tensor.cu
 *   - matrix products: fused dequantize-and-multiply for small batches,
 *     dequantize to a scratch and cuBLASLt for large ones;
 *                                                      qt_cuda_matmul.cu
 *   - the pointwise and row operations of a decoder layer (RMSNorm, RoPE,
 *     SwiGLU, residual, bias), the paged KV cache writes, attention over the
 *     block tables, and greedy token choice;           qt_cuda_ops.cu
 *   - LoRA: the grouped low-rank products of unmerged adapters (segments of
 *     rows per adapter, as Punica's SGMV), and merge on the device
 *     (dequantize, add the scaled B @ A, finite check, requantize into the
 *     same layout);                                    qt_cuda_lora.cu
 *   - Qwen3.5's hybrid layers: Gated DeltaNet (conv, delta rule over the
 *     recurrent states, gated norm);                   qt_cuda_linear.cu
 *
 * The functions that take a kind (matrix products, tensors, gather,
 * merge) are defined in qt_cuda_kinds.c, which looks up the kind's row in
 * its table and hands it to the file named above.
 *
 * Conventions (all functions):
 *   - Plain C, no CUDA types: device pointers are ordinary pointers, a
 *     stream is a `void *` holding a cudaStream_t (NULL: legacy default).
 *   - Activations are f32, row-major: a matrix of `rows` rows of `n` floats.
 *   - Kernels are enqueued on the stream; a function returns once they are
 *     enqueued. A launch error is reported by the function, a fault during
 *     the run at the caller's next synchronisation.
 *   - Returns QL_OK or a negative qtensor.h code with a sentence in msg
 *     naming the call or argument that failed (msg may be NULL when msg_len
 *     is 0): QL_EINVAL for a bad argument or shape, QL_ENOMEM when device
 *     memory runs out (cudaErrorMemoryAllocation), QL_EUNSUPPORTED for a
 *     kind a kernel does not handle, QL_EDEVICE for any other CUDA failure.
 *     Nothing aborts; on failure what the call allocated is freed.
 *   - The per-element arithmetic lives in QL_HD functions (kernels/math/qt_math.h
 *     for the quant kinds, kernels/math/ops_math.h for the layer operations,
 *     kernels/qt_quant_math.h for quantizing) that the CPU code and the CPU
 *     tests run too.
 */
#ifndef QL_QT_CUDA_OPS_H
#define QL_QT_CUDA_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "qt_cuda.h"
#include "qtensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- tensors on the device (qt_cuda_tensor.cu) ---------------------------- */

/*
 * A weight on the device in its quantized layout; the view that matches
 * `kind` is filled, the others are zero. Dense kinds (F32, F16, BF16) keep
 * their own element type in `dense`. Q4_0, Q4_1 and Q8_0 blocks are split
 * on upload into the view's qs / d / m arrays (same bits, 16-byte aligned
 * codes), download joins them back; the other GGUF kinds keep ggml's
 * blocks whole in qs (qt_cuda.h's qt_cuda_gguf_view). `owned` says whether release frees the device
 * memory.
 */
typedef struct qt_cuda_tensor {
    qt_kind kind;
    int64_t rows, cols;
    qt_cuda_4bit_view q4;       /* NF4, FP4 */
    qt_cuda_affine_view affine; /* AFFINE */
    qt_cuda_gguf_view gguf;     /* Q4_0 ... IQ4_XS */
    qt_cuda_fp8_view fp8;       /* FP8 */
    qt_cuda_gptq_view gptq;     /* GPTQ, AWQ */
    void *dense;                /* F32, F16, BF16: rows * cols elements */
    size_t device_bytes;        /* device memory the tensor holds */
    bool owned;
} qt_cuda_tensor;

/* Copy host tensor t (any kind) to new device memory. On failure *d is
 * zeroed and nothing stays allocated; an out-of-memory names the tensor's
 * shape, kind and the bytes asked for. */
int qt_cuda_tensor_upload(const qtensor *t, qt_cuda_tensor *d, char *msg, size_t msg_len);

/* Allocate a device tensor with t's kind, shape and layout parameters
 * (blocksize, nesting, bits, groups, codebooks, ...) and uninitialised
 * codes and state: what a merge writes its result into. */
int qt_cuda_tensor_alloc_like(const qt_cuda_tensor *t, qt_cuda_tensor *out, char *msg,
                              size_t msg_len);

/* Copy a device tensor back into host tensor t, which has the same kind,
 * shape and layout and owns its arrays (qt_alloc'd): codes and quant state
 * overwritten. Synchronous. */
int qt_cuda_tensor_download(const qt_cuda_tensor *d, qtensor *t, char *msg, size_t msg_len);

/* Free an owned tensor's device memory and zero *d; a borrowed one is only
 * zeroed. Safe on a zeroed tensor. */
int qt_cuda_tensor_release(qt_cuda_tensor *d, char *msg, size_t msg_len);

/* out[i][0, cols) = row ids[i] of w as f32, i < n; ids is a device array.
 * Ids are not checked on the device (the caller checks them). */
int qt_cuda_gather_rows(const qt_cuda_tensor *w, const int32_t *ids, int64_t n, float *out,
                        void *stream, char *msg, size_t msg_len);

/* ---- matrix products (qt_cuda_matmul.cu) ----------------------------------- */

/* The most activation rows the fused kernels take in one pass: they read
 * each weight byte once for all of them (a decode step of up to 32
 * sequences; qt_cuda_matmul.cu says why 32). */
#define QT_CUDA_MATVEC_MAX_BATCH 32

/*
 * y[b][0, w.rows) = x[b][0, w.cols) @ w^T for b < batch <= 32, fused: each
 * weight byte is read once, with 16-byte loads where the layout is aligned
 * (cols a multiple of 32), dequantized in registers with qt_math.h, and
 * multiplied in f32. Every kind of qtensor.h.
 */
int qt_cuda_matvec(const qt_cuda_tensor *w, const float *x, int64_t batch, float *y, void *stream,
                   char *msg, size_t msg_len);

/* What the cuBLASLt path multiplies in (accumulation is f32 either way). */
typedef enum qt_cuda_gemm_type {
    QT_CUDA_GEMM_F32 = 0, /* weights dequantized to f32, x as is: closest to the CPU */
    QT_CUDA_GEMM_BF16,    /* weights to bf16, x rounded to bf16: tensor cores */
} qt_cuda_gemm_type;

/* The state of the large-batch path: a cuBLASLt handle, its workspace, and
 * scratch for one dequantized weight and one converted activation. One
 * scratch: use a qt_cuda_blas from one stream (and one thread) at a time. */
typedef struct qt_cuda_blas qt_cuda_blas;

/* For weights of up to max_weight_elements and activations of up to
 * max_rows x max_cols. */
int qt_cuda_blas_new(qt_cuda_blas **out, int64_t max_weight_elements, int64_t max_rows,
                     int64_t max_cols, qt_cuda_gemm_type type, char *msg, size_t msg_len);
void qt_cuda_blas_free(qt_cuda_blas *b);

/* y = x @ w^T for any batch within the limits given at qt_cuda_blas_new:
 * dequantize w into the scratch, then one cuBLASLt matmul. */
int qt_cuda_gemm(qt_cuda_blas *b, const qt_cuda_tensor *w, const float *x, int64_t batch, float *y,
                 void *stream, char *msg, size_t msg_len);

/* y = x @ w^T, choosing: qt_cuda_matvec for batch <= 32, qt_cuda_gemm above. */
int qt_cuda_matmul(qt_cuda_blas *b, const qt_cuda_tensor *w, const float *x, int64_t batch,
                   float *y, void *stream, char *msg, size_t msg_len);

/* ---- layer operations, paged attention, token choice (qt_cuda_ops.cu) ------ */

/* out[r] = x[r] / rms(x[r]) * weight for r < rows, n wide; the sum of
 * squares in f64, as the CPU backend (out may be x). */
int qt_cuda_rmsnorm(float *out, const float *x, const float *weight, int64_t rows, int64_t n,
                    float eps, void *stream, char *msg, size_t msg_len);

/* Rotate each row's n_heads heads of head_dim by the row's cos/sin table
 * ([rows][head_dim / 2], computed by the caller): pairs (i, i + d/2), or
 * (2i, 2i + 1) when interleaved. In place. */
int qt_cuda_rope(float *vec, const float *cos_tab, const float *sin_tab, int64_t rows,
                 int32_t n_heads, int32_t head_dim, bool interleaved, void *stream, char *msg,
                 size_t msg_len);

/* qt_cuda_rope with partial rotary (Phi-4-mini, Qwen3.5): only each head's
 * leading rot_dims rotate, pairs (i, i + rot_dims/2) or (2i, 2i + 1), the
 * tables [rows][rot_dims / 2]; the rest passes through (forward.c's rope). */
int qt_cuda_rope_partial(float *vec, const float *cos_tab, const float *sin_tab, int64_t rows,
                         int32_t n_heads, int32_t head_dim, int32_t rot_dims, bool interleaved,
                         void *stream, char *msg, size_t msg_len);

/* gate[i] = silu(gate[i]) * up[i], i < n. */
int qt_cuda_swiglu(float *gate, const float *up, int64_t n, void *stream, char *msg,
                   size_t msg_len);

/* gate[i] = om_swiglu_oai(gate[i], up[i], alpha, limit), i < n (GPT-OSS's
 * clamped SwiGLU: gate clamped above, up both ways, at limit; 0: none). */
int qt_cuda_swiglu_oai(float *gate, const float *up, int64_t n, float alpha, float limit,
                       void *stream, char *msg, size_t msg_len);

/* gate[i] = gelu_tanh(gate[i]) * up[i], i < n (Gemma's GeGLU, ops_math.h's
 * om_geglu). */
int qt_cuda_geglu(float *gate, const float *up, int64_t n, void *stream, char *msg, size_t msg_len);

/* gate[r * n + i] = gelu_tanh(gate[r * n + i]) * up[r * up_stride + i],
 * r < rows, i < n: Gemma 4's per-layer input gate times the layer's slice
 * of each row's per-layer inputs (up_stride >= n). */
int qt_cuda_geglu_strided(float *gate, const float *up, int64_t rows, int64_t n, int64_t up_stride,
                          void *stream, char *msg, size_t msg_len);

/* x[i] *= s, i < n (Gemma's embedding scale). */
int qt_cuda_scale(float *x, float s, int64_t n, void *stream, char *msg, size_t msg_len);

/* x[i] = tanh(x[i] / cap) * cap, i < n (Gemma 2's logit soft-cap, om_softcap). */
int qt_cuda_softcap(float *x, float cap, int64_t n, void *stream, char *msg, size_t msg_len);

/* x[i] += t[i], i < n. */
int qt_cuda_add(float *x, const float *t, int64_t n, void *stream, char *msg, size_t msg_len);

/* y[r][i] += bias[i] for r < rows, i < n. */
int qt_cuda_add_bias(float *y, const float *bias, int64_t rows, int64_t n, void *stream, char *msg,
                     size_t msg_len);

/* dst[r] = src[idx[r] / div] for r < rows, rows of n floats (a mixture of
 * experts gathering the rows routed to one expert: idx holds row * top_k +
 * choice, div is top_k). idx is a device array; its values are not
 * checked on the device. */
int qt_cuda_gather_f32(float *dst, const float *src, const int32_t *idx, int32_t div, int64_t rows,
                       int64_t n, void *stream, char *msg, size_t msg_len);

/* dst[idx[r] / div] += w[r] * src[r] for r < rows, rows of n floats
 * (om_weighted_add: the product rounded, then the sum; idx NULL: dst[r]).
 * The rows idx names must be distinct within one call; calls on one
 * stream add in their order, so a caller that adds experts in ascending
 * order gets the CPU's sum bit for bit. idx and w are device arrays. */
int qt_cuda_scatter_add_weighted(float *dst, const float *src, const int32_t *idx, int32_t div,
                                 const float *w, int64_t rows, int64_t n, void *stream, char *msg,
                                 size_t msg_len);

/*
 * The paged KV cache on the device, laid out as the CPU backend's
 * (engine/kv_cache_internal.h): block b holds, for every layer l and for K
 * (v = 0) then V (v = 1), block_tokens slots of kv_dim floats, at
 *   arena + b * block_floats + ((l * 2 + v) * block_tokens + slot) * kv_dim.
 * A step's rows find their blocks through:
 *   row_seq[r]   which sequence of the step row r belongs to,
 *   row_pos[r]   the row's position in its sequence,
 *   bt_offset[s] where sequence s's block table starts in block_tables,
 *   block_tables the tables of the step's sequences back to back; position
 *                p of sequence s is in block block_tables[bt_offset[s] +
 *                p / block_tokens], slot p % block_tokens.
 * All of these are device arrays.
 */
typedef struct qt_cuda_kv {
    float *arena;
    int32_t block_tokens;
    int32_t n_layers;
    int64_t kv_dim; /* n_kv_heads * head_dim */
    size_t block_floats;
} qt_cuda_kv;

typedef struct qt_cuda_step_rows {
    int64_t rows;
    const int32_t *row_seq, *row_pos, *bt_offset, *block_tables;
} qt_cuda_step_rows;

/* Write each row's k and v ([rows][kv_dim]) into its slot of layer l. */
int qt_cuda_kv_write(const qt_cuda_kv *kv, int32_t layer, const qt_cuda_step_rows *sr,
                     const float *k, const float *v, void *stream, char *msg, size_t msg_len);

/*
 * Causal grouped-query attention over the paged cache for every (row, head):
 * out[r][h] = softmax(q[r][h] . K[p] / sqrt(head_dim)) . V[p] over positions
 * p from max(0, pos - window + 1) (window 0: from 0) to the row's own
 * position, K and V of kv head h / (n_heads / n_kv_heads), read through the
 * block tables. q and out are [rows][n_heads * head_dim]. One kernel serves
 * decode (one row per sequence) and prefill (a chunk of rows, each seeing
 * the rows before it, already written with qt_cuda_kv_write). head_dim <= 512
 * (Gemma 4's full layers; past 256 a lane holds 16 elements, two heads a
 * block).
 * The online-softmax arithmetic is ops_math.h's, as the CPU backend's; the
 * sums run in another order, so results agree with the CPU within rounding
 * (tests/gpu/test_cuda_ops.c: 1e-4 absolute on values in [-1, 1]), not bit
 * for bit. When rows x kv heads are too few to fill the GPU (decode of a
 * few sequences) the positions are split over several blocks and merged
 * (FlashDecoding), with scratch from a stream-ordered memory pool the
 * library keeps per device; the split count follows the step's row count,
 * so a row's last bits may differ between batch compositions.
 */
int qt_cuda_attention(const qt_cuda_kv *kv, int32_t layer, const qt_cuda_step_rows *sr,
                      const float *q, float *out, int32_t n_heads, int32_t n_kv_heads,
                      int32_t head_dim, int32_t sliding_window, void *stream, char *msg,
                      size_t msg_len);
/* The same with the score scale given (Gemma: query_pre_attn_scalar^-1/2,
 * where qt_cuda_attention takes 1/sqrt(head_dim)), and, softcap > 0, every
 * score soft-capped (om_softcap) before the softmax (Gemma 2), and, sinks
 * not NULL (device, [n_heads]), head h's softmax with one more term
 * e^sinks[h] in its denominator that takes no value (GPT-OSS; ops_math.h's
 * om_online_sink, applied once the positions are merged, as the CPU). */
int qt_cuda_attention_ex(const qt_cuda_kv *kv, int32_t layer, const qt_cuda_step_rows *sr,
                         const float *q, float *out, int32_t n_heads, int32_t n_kv_heads,
                         int32_t head_dim, int32_t sliding_window, float scale, float softcap,
                         const float *sinks, void *stream, char *msg, size_t msg_len);

/* tokens[r] = the argmax of logits[r][0, vocab), the lowest id on ties, as
 * the CPU sampler's greedy choice (ops_math.h's om_greedy_better): NaN ranks
 * below every number, -inf included, so a row of only NaN and -inf gives
 * its first -inf, and a row of only NaN gives 0. tokens is a device array
 * of rows entries. */
int qt_cuda_argmax(const float *logits, int64_t rows, int64_t vocab, int32_t *tokens, void *stream,
                   char *msg, size_t msg_len);

/* ---- LoRA on the device (qt_cuda_lora.cu) ---------------------------------- */

/*
 * One run of rows applying one adapter module (SGMV's segment): rows
 * [row0, row0 + rows) of x and y get
 *   y[r] += ((x[r] @ A^T) * scale) @ B^T,
 * A [rank][in] and B [out][rank] dense on the device in a_kind / b_kind
 * (F32, F16 or BF16), scale the product of the user's and the module's
 * (in f32, as eng_lora_apply forms it). The arithmetic of a row never
 * depends on the other rows or segments, and the down product is rounded
 * to f32 and scaled before the up product, as the CPU backend's
 * eng_lora_apply; the sums themselves run in f32 in the kernels' own order
 * (the CPU's matmul has its own), so a row agrees with the CPU to rounding,
 * not bit for bit. A segment the kernels cannot apply (rank outside
 * [1, max_rank], a kind other than F32/F16/BF16, negative rows) fills its
 * rows of y with NaN rather than being skipped silently: the segments are
 * on the device and only the kernels read them.
 */
typedef struct qt_cuda_lora_segment {
    int64_t row0, rows;
    const void *a, *b;
    qt_kind a_kind, b_kind;
    int32_t rank;
    float scale;
} qt_cuda_lora_segment;

/*
 * Apply n_segs segments (a device array segs; segments never overlap in
 * rows) to x ([*][in]) and y ([*][out]) in one pass of two kernels: the
 * down products into t (device scratch of total_rows * max_rank floats,
 * where total_rows covers every segment's rows: row0 + rows <= total_rows;
 * row r's down product is t[r * max_rank, r * max_rank + rank)) and the up
 * products added into y. max_rank bounds every segment's rank (<= 256).
 * n_segs <= 65535; 0 enqueues nothing. Rows of y outside every segment are
 * not touched.
 */
int qt_cuda_sgmv(const float *x, int64_t in, float *y, int64_t out,
                 const qt_cuda_lora_segment *segs, int32_t n_segs, int32_t max_rank,
                 int64_t total_rows, float *t, void *stream, char *msg, size_t msg_len);

/*
 * One adapter term of a merge: W += s * B @ A (A [rank][cols], B
 * [rows][rank], dense on the device, F32/F16/BF16), with
 * s = (double)scale * (double)module_scale formed in double, as
 * adapters/merge.c forms it from lora_part.scale and the module's scale:
 * the f32 product of the two would round differently. A caller holding one
 * combined scale passes module_scale 1.
 */
typedef struct qt_cuda_lora_term {
    const void *a, *b;
    qt_kind a_kind, b_kind;
    int32_t rank;
    float scale;        /* the user's (lora_part.scale) */
    float module_scale; /* the module's (eng_lora_module.scale: alpha / r) */
} qt_cuda_lora_term;

/* What a merge cost, the sums engine/model/model.h's eng_merge_cost carries
 * (so the caller can sum modules with lora_cost_add), with merge.c's definitions:
 * d the f32 delta, W the pristine and Q the merged tensor dequantized, the
 * sums in double. The sums run in a fixed order on the device (the same on
 * every run) but not the CPU's sequential one, so they agree with the
 * CPU's to ~1e-12 relative, not bit for bit. */
typedef struct qt_cuda_merge_report {
    double dot;            /* <Q - W, d> */
    double delta_sq;       /* |d|^2 */
    double err_sq;         /* |Q - (W + d)|^2, W + d exact in double */
    double delta_retained; /* dot / delta_sq; 1 when delta_sq == 0 */
    double relative_error; /* sqrt(err_sq / delta_sq); when delta_sq == 0, 0 if
                              err_sq == 0, else +inf */
} qt_cuda_merge_report;

/*
 * Merge on the device, adapters/merge.c's merge of the same weight and
 * terms byte for byte: dequantize `pristine` to f32 (W), compute the delta
 * d per element in double (terms in order, each s * sum_k B[r][k] * A[k][c]
 * with k ascending, rounded once to f32), refuse a non-finite W + d
 * (QL_ENONFINITE naming the first row and column in row-major order and the
 * term that made it so, or the pristine weight when W itself is not finite;
 * *out is then left zeroed), and requantize W + d into *out, a new tensor in
 * pristine's kind and layout (qt_cuda_tensor_alloc_like) with the CPU
 * quantizers' arithmetic (kernels/qt_quant_math.h): NF4/FP4 with the same
 * blocksize (double quantization of absmax on the host, as the CPU does it),
 * AFFINE with the same bits, groups, range and zero domain (symmetric read
 * from the zero points and eps from the zero domain, as merge.c's
 * affine_params), GGUF per block, dense round to nearest even. The pristine
 * tensor is never written, so unmerging is releasing *out. The terms array
 * is host memory; their A and B device memory. report may be NULL (the
 * cost is then not computed). NF4/FP4 weights whose codebook, nested map or
 * nested blocksize are not bitsandbytes' are refused with QL_EUNSUPPORTED,
 * as on the CPU. The k-quants (Q2_K ... Q6_K) and IQ4_NL, IQ4_XS have no
 * requantizer on the device (nor on the CPU): their merge is refused with QL_EUNSUPPORTED naming
 * the kind (qt_cuda_merge_requantizes says so beforehand). Synchronises the stream before returning
 * (the finite check needs it). Scratch: three f32 buffers of rows * cols, freed before returning.
 */
int qt_cuda_merge(const qt_cuda_tensor *pristine, const qt_cuda_lora_term *terms, int32_t n_terms,
                  qt_cuda_tensor *out, qt_cuda_merge_report *report, void *stream, char *msg,
                  size_t msg_len);

/* Whether qt_cuda_merge can requantize a merge into `kind` itself: every
 * kind the backend runs except the k-quants and IQ4_NL, IQ4_XS, which a
 * caller either serves
 * from a host merged copy of the same kind (the CPU's bytes) or refuses. */
bool qt_cuda_merge_requantizes(qt_kind kind);

/* ---- Qwen3.5's hybrid layers (qt_cuda_linear.cu) ---------------------------
 * Gated DeltaNet's arithmetic is engine/model/hybrid.h's; each value is
 * computed in the CPU backend's order (engine/runtime/linear_cpu.c), so the
 * two differ where expf and log1pf do only. */

/* One linear-attention layer as the kernels read it; every pointer device
 * memory. A sequence's recurrent state (eng_linear_seq_state floats) holds
 * every linear layer's part, layer_off floats in: the conv's last
 * conv_kernel - 1 inputs [conv_kernel - 1][conv_dim], then each value
 * head's k x v state. */
typedef struct qt_cuda_delta_layer {
    int32_t n_k_heads, n_v_heads, k_head_dim, v_head_dim, conv_kernel;
    bool v_tiled;                 /* value head h reads key head h % n_k_heads (a GGUF's order),
                                   * else h / (n_v_heads / n_k_heads) */
    float eps;                    /* the gated RMSNorm's */
    const float *conv;            /* [conv_dim][conv_kernel]: the depthwise taps */
    const float *neg_a, *dt_bias; /* [n_v_heads]: -exp(A_log), dt_bias */
    const float *norm;            /* [v_head_dim]: the gated norm's weight */
    float *states;                /* the pool: state_floats per slot */
    int64_t state_floats, layer_off;
} qt_cuda_delta_layer;

/* The step's sequences: first (device, [n_seqs + 1]) each one's first row
 * and then rows; slot (device, [n_seqs]) its recurrent state's slot. */
typedef struct qt_cuda_delta_seqs {
    int32_t n_seqs;
    int64_t rows;
    const int32_t *first, *slot;
} qt_cuda_delta_seqs;

/*
 * A linear layer's Gated DeltaNet for the step's rows, after its
 * projections: beta and decay ([rows][n_v_heads]) hold in_proj_b's and
 * in_proj_a's outputs and are overwritten with sigmoid(b) and the log
 * decay; qkv ([rows][conv_dim], in_proj_qkv's) is overwritten with the
 * conv's output, q and k normalized; z ([rows][n_v_heads * v_head_dim],
 * in_proj_z's) gates the norm; out gets the gated norm's output, as wide
 * as z. Each sequence's window and states are carried on in place, its
 * rows in order. v_head_dim at most 512, conv_kernel at most 16.
 */
int qt_cuda_delta_net(const qt_cuda_delta_layer *ly, const qt_cuda_delta_seqs *sq, float *beta,
                      float *decay, float *qkv, const float *z, float *out, void *stream, char *msg,
                      size_t msg_len);

/* src's n rows of 2 d (Qwen3.5's q_proj: a head's query, then its gate)
 * into q's and gate's n rows of d (qt_cuda_ops.cu, as the next). */
int qt_cuda_split_gate(const float *src, float *q, float *gate, int64_t n, int32_t d, void *stream,
                       char *msg, size_t msg_len);

/* x[i] *= sigmoid(gate[i]), i < n (Qwen3.5's attention output gate). */
int qt_cuda_gate_sigmoid(float *x, const float *gate, int64_t n, void *stream, char *msg,
                         size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif

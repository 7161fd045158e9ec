/*
 * matmul_avx512.c - the f32-activation products of internal/matmul_f32.inc
 * compiled for AVX-512 VL (entries qt_matmul_<kind>_avx512): the same
 * 256-bit arithmetic per row as matmul_avx2.c's, so the same bits, but with
 * AVX-512's 32 vector registers a pass holds eight rows of x, not four, so
 * each weight block is decoded once per eight rows, and every kind takes
 * two weight rows per pass, each x vector loaded once for both (NF4/FP4
 * only in chunks of at most four rows of x) (bench_quant --shapes
 * default-model, Q4_1 at batch 32: 52 -> 65 GFLOP/s, 0.44 -> 0.55 of the
 * FMA roof). From four rows of x on, the GGUF blocks of 32 and Q4_K/Q5_K
 * take their two weight rows in the halves of 512-bit registers, x loaded
 * into both (rows_gguf_pair512, rows_k4_pair512): lane for lane the same
 * operations, so still the same bits, in half the instructions; on a core
 * with two 512-bit FMA units (an Intel Xeon host, 2026-12-07: bench_quant
 * --shapes default-model, one thread, batch 8) Q4_1 47-49 -> 59 GFLOP/s,
 * Q8_0 60-62 -> 73-81, Q4_K 32 -> 37; the default model's prefill 368 ->
 * 445 tokens/s (bench_decode, 2 threads). Also internal/rows_vec.inc at sixteen lanes (entries
 * qt_attend_avx512, qt_lora_down_avx512, qt_lora_up_avx512, qt_kv_store_avx512, qt_kv_load_avx512):
 * full 512-bit vectors there, the AVX2 entries' bits. Taken where CPUID reports AVX-512 F and VL
 * and the OS saves their state (traits.c).
 */
#include "avx2_shared.h"
#include "kernels_internal.h"
#include "ops_math.h"
#include "qt_math.h"
#include "qt_quant_math.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE   static inline __attribute__((always_inline))
#define XCHUNK          8 /* rows of x per pass: 2 accumulators each + temporaries fit 32 ymm */
#define F32_ENTRY(name) name##_avx512

#include "matmul_f32.inc"

/* qt_attend, the LoRA products and the KV cache's conversions in zmm
 * registers, sixteen lanes a vector (rows_vec.inc: the AVX2 entries' bits);
 * shapes they do not cover take the AVX2 entries. */
#define ROWS_LANES          16
#define ROWS_ENTRY(name)    name##_avx512
#define ROWS_NARROWER(name) name##_avx2

#include "rows_vec.inc"

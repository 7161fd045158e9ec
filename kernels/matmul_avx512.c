/*
 * matmul_avx512.c - the f32-activation products of internal/matmul_f32.inc
 * compiled for AVX-512 VL (entries qt_matmul_<kind>_avx512): the same
 * 256-bit arithmetic per row as matmul_avx2.c's, so the same bits, but with
 * AVX-512's 32 vector registers a pass holds eight rows of x, not four, so
 * each weight block is decoded once per eight rows (on the default model's
 * Q4_1 products at batch 32, one thread: 49 -> 122 GFLOP/s). Taken where
 * CPUID reports AVX-512 F and VL and the OS saves their state (traits.c).
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

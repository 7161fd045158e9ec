/*
 * traits.c - the top of kernels/: the traits table and the public entry
 * points that dispatch through it. It offers qt_traits_table (one row per
 * kind, and the row is the dispatch), qt_quantize (the checks every kind
 * shares, then the row's quantizer), qt_dequantize_rows and qt_matmul with
 * their _ref forms, qt_attend, qt_kv_store and qt_kv_load (the KV cache's
 * rows), and the run-time choice among a row's AVX-512, AVX2 and scalar entries (CPUID
 * once; QLSERVE_CPU_PATH=scalar or qt_set_force_scalar forces scalar, QLSERVE_CPU_PATH=avx2
 * keeps to AVX2 where AVX-512 is present: benchmarks compare the two on one binary).
 *
 * It owns the table and the CPU-path choice (set once, then read by every
 * entry point). It calls down into every other file of kernels/ (the
 * kinds' quant_*.c, matmul_avx2.c, matmul_avx512.c, matmul_fp8_*.c,
 * matmul_gptq_*.c, matmul_q8_*.c, quant_avx2.c, attend_ref.c, qtensor.c)
 * and nothing
 * calls back up into it; it touches base/ and kernels/math/.
 *
 * The table is the one place that knows every kind: adding a kind means a
 * row here, its geometry in kernels_internal.h, and one file beside this
 * one (and, for a fast path, its entries in matmul_avx2.c).
 */
#include "kernels_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static void matmul_generic_ref(const qtensor *t, const float *x, int64_t batch, float *y,
                               int64_t row0, int64_t row1);
static bool use_avx2(void);

const qt_traits qt_traits_table[QT_KIND_COUNT] = {
    [QT_F32] =
        {
            QT_GEOMETRY_F32,
            .quantize = qt_dense_quantize,
            .dequantize_rows = qt_dense_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_f32_avx2,
            .matmul_avx512 = qt_matmul_f32_avx512,
        },
    [QT_F16] =
        {
            QT_GEOMETRY_F16,
            .quantize = qt_dense_quantize,
            .dequantize_rows = qt_dense_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_f16_avx2,
            .matmul_avx512 = qt_matmul_f16_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_f16_avx2,
        },
    [QT_BF16] =
        {
            QT_GEOMETRY_BF16,
            .quantize = qt_dense_quantize,
            .dequantize_rows = qt_dense_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_bf16_avx2,
            .matmul_avx512 = qt_matmul_bf16_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_bf16_avx2,
        },
    [QT_NF4] =
        {
            QT_GEOMETRY_NF4,
            .quantize = qt_bnb4_quantize,
            .dequantize_rows = qt_bnb4_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_bnb4_avx2,
            .matmul_avx512 = qt_matmul_bnb4_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_bnb4_avx2,
            .quantize_avx2 = qt_bnb4_quantize_avx2,
        },
    [QT_FP4] =
        {
            QT_GEOMETRY_FP4,
            .quantize = qt_bnb4_quantize,
            .dequantize_rows = qt_bnb4_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_bnb4_avx2,
            .matmul_avx512 = qt_matmul_bnb4_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_bnb4_avx2,
            .quantize_avx2 = qt_bnb4_quantize_avx2,
        },
    [QT_AFFINE] =
        {
            QT_GEOMETRY_AFFINE,
            .quantize = qt_affine_quantize,
            .dequantize_rows = qt_affine_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_affine_avx2,
            .matmul_avx512 = qt_matmul_affine_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_affine_avx2,
        },
    [QT_Q4_0] =
        {
            QT_GEOMETRY_Q4_0,
            .quantize = qt_gguf_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q4_0_avx2,
            .matmul_avx512 = qt_matmul_q4_0_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q4_0_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q4_0_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q4_0_avx2,
        },
    [QT_Q4_1] =
        {
            QT_GEOMETRY_Q4_1,
            .quantize = qt_gguf_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q4_1_avx2,
            .matmul_avx512 = qt_matmul_q4_1_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q4_1_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q4_1_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q4_1_avx2,
        },
    [QT_Q8_0] =
        {
            QT_GEOMETRY_Q8_0,
            .quantize = qt_gguf_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q8_0_avx2,
            .matmul_avx512 = qt_matmul_q8_0_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q8_0_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q8_0_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q8_0_avx2,
        },
    [QT_Q5_0] =
        {
            QT_GEOMETRY_Q5_0,
            .quantize = qt_gguf_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q5_0_avx2,
            .matmul_avx512 = qt_matmul_q5_0_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q5_0_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q5_0_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q5_0_avx2,
        },
    [QT_Q5_1] =
        {
            QT_GEOMETRY_Q5_1,
            .quantize = qt_gguf_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q5_1_avx2,
            .matmul_avx512 = qt_matmul_q5_1_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q5_1_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q5_1_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q5_1_avx2,
        },
    [QT_Q4_K] =
        {
            QT_GEOMETRY_Q4_K,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q4_k_avx2,
            .matmul_avx512 = qt_matmul_q4_k_avx512,
            .matmul_q8 = qt_matmul_q8_k4_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q4_k_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q4_k_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q4_k_avx2,
        },
    [QT_Q5_K] =
        {
            QT_GEOMETRY_Q5_K,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q5_k_avx2,
            .matmul_avx512 = qt_matmul_q5_k_avx512,
            .matmul_q8 = qt_matmul_q8_k4_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q5_k_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q5_k_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q5_k_avx2,
        },
    [QT_Q6_K] =
        {
            QT_GEOMETRY_Q6_K,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q6_k_avx2,
            .matmul_avx512 = qt_matmul_q6_k_avx512,
            .matmul_q8 = qt_matmul_q8_q6_k_ref,
            .matmul_q8_avx2 = qt_matmul_q8_q6_k_avx2,
            .matmul_q8_vnni = qt_matmul_q8_q6_k_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_q6_k_avx2,
        },
    [QT_Q2_K] =
        {
            QT_GEOMETRY_Q2_K,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q2_k_avx2,
            .matmul_avx512 = qt_matmul_q2_k_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_q2_k_avx2,
        },
    [QT_Q3_K] =
        {
            QT_GEOMETRY_Q3_K,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_q3_k_avx2,
            .matmul_avx512 = qt_matmul_q3_k_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_q3_k_avx2,
        },
    [QT_IQ4_NL] =
        {
            QT_GEOMETRY_IQ4_NL,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_iq4_nl_avx2,
            .matmul_avx512 = qt_matmul_iq4_nl_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_iq4_nl_avx2,
            .matmul_q8_vnni = qt_matmul_q8_iq4_nl_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_iq4_nl_avx2,
        },
    [QT_IQ4_XS] =
        {
            QT_GEOMETRY_IQ4_XS,
            .quantize = qt_kquant_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_iq4_xs_avx2,
            .matmul_avx512 = qt_matmul_iq4_xs_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_iq4_xs_avx2,
        },
    [QT_MXFP4] =
        {
            QT_GEOMETRY_MXFP4,
            .quantize = qt_gguf_quantize,
            .dequantize_rows = qt_gguf_dequantize_rows,
            .matmul_ref = matmul_generic_ref,
            .matmul_avx2 = qt_matmul_mxfp4_avx2,
            .matmul_avx512 = qt_matmul_mxfp4_avx512,
            .matmul_q8 = qt_matmul_q8_b32_ref,
            .matmul_q8_avx2 = qt_matmul_q8_mxfp4_avx2,
            .matmul_q8_vnni = qt_matmul_q8_mxfp4_vnni,
            .dequantize_rows_avx2 = qt_dequantize_rows_mxfp4_avx2,
        },
    [QT_FP8] =
        {
            QT_GEOMETRY_FP8,
            .quantize = qt_fp8_quantize,
            .dequantize_rows = qt_fp8_dequantize_rows,
            .matmul_ref = qt_fp8_matmul_ref,
            .matmul_avx2 = qt_matmul_fp8_avx2,
            .matmul_avx512 = qt_matmul_fp8_avx512,
            .dequantize_rows_avx2 = qt_dequantize_rows_fp8_avx2,
        },
    [QT_GPTQ] =
        {
            QT_GEOMETRY_GPTQ,
            .quantize = qt_gptq_quantize,
            .dequantize_rows = qt_gptq_dequantize_rows,
            .matmul_ref = qt_gptq_matmul_ref,
            .matmul_avx2 = qt_matmul_gptq_avx2,
            .matmul_avx512 = qt_matmul_gptq_avx512,
        },
    [QT_AWQ] =
        {
            QT_GEOMETRY_AWQ,
            .quantize = qt_gptq_quantize,
            .dequantize_rows = qt_awq_dequantize_rows,
            .matmul_ref = qt_awq_matmul_ref,
            .matmul_avx2 = qt_matmul_awq_avx2,
            .matmul_avx512 = qt_matmul_awq_avx512,
        },
    [QT_CT_INT] =
        {
            QT_GEOMETRY_CT_INT,
            .quantize = qt_ct_int_quantize,
            .dequantize_rows = qt_ct_int_dequantize_rows,
            .matmul_ref = qt_ct_int_matmul_ref,
            .matmul_avx2 = qt_matmul_ct_int_avx2,
        },
};

/* The first NaN or Inf in src, or -1. Chunks of 1024 are first checked
 * whole, a loop without an exit that the compiler vectorizes (x - x is 0
 * for a finite x, NaN for Inf and NaN): a merge quantizes ~100M values. */
static int64_t first_non_finite(const float *src, int64_t n)
{
    for (int64_t c0 = 0; c0 < n; c0 += 1024) {
        int64_t c1 = c0 + 1024 < n ? c0 + 1024 : n;
        int bad = 0;
        for (int64_t i = c0; i < c1; i++)
            bad |= !(src[i] - src[i] == 0.0f);
        if (!bad)
            continue;
        for (int64_t i = c0; i < c1; i++)
            if (!isfinite(src[i]))
                return i;
    }
    return -1;
}

int qt_quantize(qtensor *out, const float *src, int64_t rows, int64_t cols,
                const qt_quant_params *p, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if (!p || (unsigned)p->kind >= QT_KIND_COUNT)
        return ql_fail(msg, msg_len, QL_EINVAL, "unknown quant kind %d", p ? (int)p->kind : -1);
    if (rows <= 0 || cols <= 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "shape [%lld, %lld] is empty", (long long)rows,
                       (long long)cols);
    if (rows > INT64_MAX / cols)
        return ql_fail(msg, msg_len, QL_EINVAL, "shape [%lld, %lld] overflows", (long long)rows,
                       (long long)cols);
    int64_t bad = first_non_finite(src, rows * cols);
    if (bad >= 0)
        return ql_fail(msg, msg_len, QL_ENONFINITE,
                       "value %g at index %lld (row %lld, col %lld) is not finite",
                       (double)src[bad], (long long)bad, (long long)(bad / cols),
                       (long long)(bad % cols));
    out->kind = p->kind;
    out->rows = rows;
    out->cols = cols;
    const qt_traits *tr = &qt_traits_table[p->kind];
    int rc = use_avx2() && tr->quantize_avx2
                 ? tr->quantize_avx2(out, src, rows, cols, p, msg, msg_len)
                 : tr->quantize(out, src, rows, cols, p, msg, msg_len);
    if (rc != QL_OK)
        qt_free(out);
    return rc;
}

void qt_dequantize_rows_ref(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    qt_traits_table[t->kind].dequantize_rows(t, row0, nrows, out);
}

/* The scalar reference matrix kernel every row holds: dequantize one row of
 * W through the row's scalar dequantization, then dot it with each row of
 * x. It is here, beside the table, because it dispatches through it. */
static void matmul_generic_ref(const qtensor *t, const float *x, int64_t batch, float *y,
                               int64_t row0, int64_t row1)
{
    int64_t cols = t->cols;
    float *w = malloc((size_t)cols * sizeof *w);
    if (!w) {
        qt_nan_rows(t, batch, y, row0, row1);
        return;
    }
    for (int64_t r = row0; r < row1; r++) {
        qt_dequantize_rows_ref(t, r, 1, w);
        for (int64_t b = 0; b < batch; b++) {
            const float *xb = x + b * cols;
            float acc = 0.0f;
            for (int64_t c = 0; c < cols; c++)
                acc += xb[c] * w[c];
            y[b * t->rows + r] = acc;
        }
    }
    free(w);
}

/* --- CPU path selection ------------------------------------------------- */

static bool force_scalar, no_vnni, no_avx512;
static bool have_avx2, have_avx512, have_vnni;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* AVX2, FMA and F16C from CPUID, and the OS saving the AVX registers
 * (OSXSAVE + XCR0), as the Intel SDM says to check before using them. */
static bool cpu_has_avx2_fma_f16c(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return false;
    bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28),
         f16c = c & (1u << 29);
    if (!(fma && osxsave && avx && f16c))
        return false;
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 0x6) != 0x6) /* XMM and YMM state */
        return false;
    if (__get_cpuid_max(0, NULL) < 7)
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    return b & (1u << 5);
}

/* AVX512F and AVX512VL from CPUID leaf 7 (and AVX512_VNNI when vnni is
 * asked), and the OS saving the opmask and ZMM state (XCR0 bits 5-7)
 * beside the YMM state. */
static bool cpu_has_avx512(bool vnni)
{
    unsigned a, b, c, d;
    if (!cpu_has_avx2_fma_f16c())
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    bool f = b & (1u << 16), vl = b & (1u << 31), has_vnni = c & (1u << 11);
    if (!(f && vl && (has_vnni || !vnni)))
        return false;
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    return (xcr0_lo & 0xe6) == 0xe6;
}
#else
static bool cpu_has_avx2_fma_f16c(void)
{
    return false;
}
static bool cpu_has_avx512(bool vnni)
{
    (void)vnni;
    return false;
}
#endif

static void detect_cpu(void)
{
    have_avx2 = cpu_has_avx2_fma_f16c();
    have_avx512 = cpu_has_avx512(false);
    have_vnni = cpu_has_avx512(true);
    const char *env = getenv("QLSERVE_CPU_PATH");
    if (env && strcmp(env, "scalar") == 0)
        force_scalar = true;
    if (env && strcmp(env, "avx2") == 0)
        no_avx512 = no_vnni = true;
}

/* Whether the rows' AVX2 entries are taken (the CPU has them, none forced off). */
static bool use_avx2(void)
{
    pthread_once(&cpu_once, detect_cpu);
    return have_avx2 && !force_scalar;
}

const char *qt_cpu_path(void)
{
    pthread_once(&cpu_once, detect_cpu);
    return (have_avx2 && !force_scalar) ? "avx2" : "scalar";
}

/* Whether the f32 products take their AVX-512 entries (given AVX2). */
static bool use_avx512(void)
{
    pthread_once(&cpu_once, detect_cpu);
    return have_avx512 && !no_avx512;
}

const char *qt_f32_path(void)
{
    if (!use_avx2())
        return "scalar";
    return use_avx512() ? "avx512" : "avx2";
}

const char *qt_rows_path(void)
{
    return qt_f32_path();
}

void qt_set_no_avx512(bool off)
{
    pthread_once(&cpu_once, detect_cpu);
    no_avx512 = off;
}

/* Whether the 8-bit products take their AVX-512 VNNI entries (given AVX2). */
static bool use_vnni(void)
{
    pthread_once(&cpu_once, detect_cpu);
    return have_vnni && !no_vnni;
}

const char *qt_q8_path(void)
{
    if (!use_avx2())
        return "scalar";
    return use_vnni() ? "avx512vnni" : "avx2";
}

void qt_set_no_vnni(bool off)
{
    pthread_once(&cpu_once, detect_cpu);
    no_vnni = off;
}

void qt_set_force_scalar(bool force)
{
    pthread_once(&cpu_once, detect_cpu);
    force_scalar = force;
}

/* --- activations ---------------------------------------------------------------- */

static ql_activations activations = QL_ACTIVATIONS_F32;

void qt_set_activations(ql_activations a)
{
    activations = a;
}

ql_activations qt_get_activations(void)
{
    return activations;
}

/* Whether the 8-bit path's AVX2 quantizer (and AVX2 or VNNI products) are taken. */
static bool q8_fast(const qt_traits *tr)
{
    return use_avx2() && tr->matmul_q8_avx2;
}

/* The 8-bit form of x for w's kind into a: fast (AVX2) or scalar, the
 * same bits. False where the kind or its width has no 8-bit path or there
 * is no memory; a then holds x alone. */
static bool acts_quantize(qt_acts *a, const qtensor *w, const float *x, int64_t batch, bool fast)
{
    const qt_traits *tr = &qt_traits_table[w->kind];
    if (!tr->matmul_q8 || qt_acts_alloc(a, x, batch, w->cols, tr->block_size) != QL_OK)
        return false;
    if (fast)
        qt_acts_quantize_avx2(a);
    else
        qt_acts_quantize_ref(a);
    return true;
}

void qt_acts_prepare(qt_acts *a, const qtensor *w, const float *x, int64_t batch)
{
    *a = (qt_acts){x, batch, w->cols, 0, NULL, NULL, NULL, NULL, NULL};
    if (activations == QL_ACTIVATIONS_Q8)
        acts_quantize(a, w, x, batch, q8_fast(&qt_traits_table[w->kind]));
}

void qt_acts_release(qt_acts *a)
{
    free(a->mem);
    *a = (qt_acts){0};
}

qt_acts qt_acts_rows(const qt_acts *a, int64_t first, int64_t n)
{
    qt_acts v = {a->x + first * a->cols, n, a->cols, a->block, NULL, NULL, NULL, NULL, NULL};
    if (a->q) {
        v.q = a->q + first * a->cols;
        v.d = a->d + first * a->cols / a->block;
        v.bsum = a->bsum + first * a->cols / 16;
        v.dsum = a->dsum + first * a->cols / a->block;
    }
    return v;
}

void qt_matmul_acts(const qtensor *w, const qt_acts *a, float *y, int64_t row0, int64_t row1)
{
    const qt_traits *tr = &qt_traits_table[w->kind];
    if (a->q && tr->matmul_q8 && a->cols == w->cols && a->block == tr->block_size) {
        if (q8_fast(tr) && use_vnni() && tr->matmul_q8_vnni)
            tr->matmul_q8_vnni(w, a, y, row0, row1);
        else if (q8_fast(tr))
            tr->matmul_q8_avx2(w, a, y, row0, row1);
        else
            tr->matmul_q8(w, a, y, row0, row1);
        return;
    }
    qt_matmul(w, a->x, a->batch, y, row0, row1);
}

bool qt_matmul_q8_ref(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
                      int64_t row1)
{
    qt_acts a;
    if (!acts_quantize(&a, w, x, batch, false))
        return false;
    qt_traits_table[w->kind].matmul_q8(w, &a, y, row0, row1);
    qt_acts_release(&a);
    return true;
}

void qt_matmul(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
               int64_t row1)
{
    pthread_once(&cpu_once, detect_cpu);
    const qt_traits *tr = &qt_traits_table[w->kind];
    if (activations == QL_ACTIVATIONS_Q8 && tr->matmul_q8) {
        qt_acts a;
        if (acts_quantize(&a, w, x, batch, q8_fast(tr))) {
            qt_matmul_acts(w, &a, y, row0, row1);
            qt_acts_release(&a);
            return;
        }
    }
    if (have_avx2 && !force_scalar && tr->matmul_avx512 && use_avx512())
        tr->matmul_avx512(w, x, batch, y, row0, row1);
    else if (have_avx2 && !force_scalar && tr->matmul_avx2)
        tr->matmul_avx2(w, x, batch, y, row0, row1);
    else
        tr->matmul_ref(w, x, batch, y, row0, row1);
}

void qt_attend(const float *q, const float *k, const float *v, int64_t stride, int32_t n, int32_t d,
               float scale, float *max, float *sum, float *acc)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar && use_avx512())
        qt_attend_avx512(q, k, v, stride, n, d, scale, max, sum, acc);
    else if (have_avx2 && !force_scalar)
        qt_attend_avx2(q, k, v, stride, n, d, scale, max, sum, acc);
    else
        qt_attend_ref(q, k, v, stride, n, d, scale, max, sum, acc);
}

void qt_delta_rule(float *S, int32_t dk, int32_t dv, const float *q, const float *k, const float *v,
                   float decay, float beta, float *out, float *mem)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar)
        qt_delta_rule_avx2(S, dk, dv, q, k, v, decay, beta, out, mem);
    else
        qt_delta_rule_ref(S, dk, dv, q, k, v, decay, beta, out, mem);
}

void qt_lora_down(const qtensor *a, const float *x, float s, float *t, int64_t r0, int64_t r1)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar && use_avx512())
        qt_lora_down_avx512(a, x, s, t, r0, r1);
    else if (have_avx2 && !force_scalar)
        qt_lora_down_avx2(a, x, s, t, r0, r1);
    else
        qt_lora_down_ref(a, x, s, t, r0, r1);
}

int64_t qt_lora_rows_per_pass(void)
{
    return use_avx2() && use_avx512() ? 16 : 8;
}

void qt_lora_up(const qtensor *b, const float *t, float *y, int64_t o0, int64_t o1)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar && use_avx512())
        qt_lora_up_avx512(b, t, y, o0, o1);
    else if (have_avx2 && !force_scalar)
        qt_lora_up_avx2(b, t, y, o0, o1);
    else
        qt_lora_up_ref(b, t, y, o0, o1);
}

void qt_kv_store(qt_kind kind, const float *x, int64_t n, void *row)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar && use_avx512())
        qt_kv_store_avx512(kind, x, n, row);
    else if (have_avx2 && !force_scalar)
        qt_kv_store_avx2(kind, x, n, row);
    else
        qt_kv_store_ref(kind, x, n, row);
}

void qt_kv_load(qt_kind kind, const void *row, int64_t e0, int64_t n, float *out)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar && use_avx512())
        qt_kv_load_avx512(kind, row, e0, n, out);
    else if (have_avx2 && !force_scalar)
        qt_kv_load_avx2(kind, row, e0, n, out);
    else
        qt_kv_load_ref(kind, row, e0, n, out);
}

void qt_kv_load_rows(qt_kind kind, const void *rows, size_t row_bytes, int64_t n_rows, int64_t e0,
                     int64_t n, float *out)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar && use_avx512())
        qt_kv_load_rows_avx512(kind, rows, row_bytes, n_rows, e0, n, out);
    else if (have_avx2 && !force_scalar)
        qt_kv_load_rows_avx2(kind, rows, row_bytes, n_rows, e0, n, out);
    else
        qt_kv_load_rows_ref(kind, rows, row_bytes, n_rows, e0, n, out);
}

void qt_dequantize_rows(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    pthread_once(&cpu_once, detect_cpu);
    const qt_traits *tr = &qt_traits_table[t->kind];
    if (have_avx2 && !force_scalar && tr->dequantize_rows_avx2)
        tr->dequantize_rows_avx2(t, row0, nrows, out);
    else
        tr->dequantize_rows(t, row0, nrows, out);
}

void qt_matmul_ref(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
                   int64_t row1)
{
    qt_traits_table[w->kind].matmul_ref(w, x, batch, y, row0, row1);
}

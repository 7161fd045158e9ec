/*
 * qtensor.c - the traits table, and the kind-independent parts of a qtensor:
 * validation before quantizing, ownership (free, clone), the dense-only cast
 * rule, the scalar reference matrix kernel and attention loop, and the
 * run-time choice between a row's AVX2 entry and its scalar one (CPUID
 * once; QLSERVE_CPU_PATH=scalar or qt_set_force_scalar forces scalar).
 *
 * The table is the one place that knows every kind, and each row is that
 * kind's dispatch: adding a kind means adding one row here and one file
 * beside this one (and, for a fast path, its entry in matmul_avx2.c).
 */
#include "kernels_internal.h"
#include "ops_math.h"
#include "qt_math.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const qt_traits qt_traits_table[QT_KIND_COUNT] = {
    [QT_F32] = {.name = "f32",
                .block_size = 1,
                .block_bytes = 4,
                .is_dense = true,
                .quantize = qt_dense_quantize,
                .dequantize_rows = qt_dense_dequantize_rows,
                .matmul_ref = qt_matmul_generic_ref,
                .matmul_avx2 = qt_matmul_f32_avx2},
    [QT_F16] = {.name = "f16",
                .block_size = 1,
                .block_bytes = 2,
                .is_dense = true,
                .quantize = qt_dense_quantize,
                .dequantize_rows = qt_dense_dequantize_rows,
                .matmul_ref = qt_matmul_generic_ref,
                .matmul_avx2 = qt_matmul_f16_avx2,
                .dequantize_rows_avx2 = qt_dequantize_rows_f16_avx2},
    [QT_BF16] = {.name = "bf16",
                 .block_size = 1,
                 .block_bytes = 2,
                 .is_dense = true,
                 .quantize = qt_dense_quantize,
                 .dequantize_rows = qt_dense_dequantize_rows,
                 .matmul_ref = qt_matmul_generic_ref,
                 .matmul_avx2 = qt_matmul_bf16_avx2,
                 .dequantize_rows_avx2 = qt_dequantize_rows_bf16_avx2},
    [QT_NF4] = {.name = "nf4",
                .block_size = 64,
                .block_bytes = 32,
                .quantize = qt_bnb4_quantize,
                .dequantize_rows = qt_bnb4_dequantize_rows,
                .matmul_ref = qt_matmul_generic_ref,
                .matmul_avx2 = qt_matmul_bnb4_avx2,
                .dequantize_rows_avx2 = qt_dequantize_rows_bnb4_avx2},
    [QT_FP4] = {.name = "fp4",
                .block_size = 64,
                .block_bytes = 32,
                .quantize = qt_bnb4_quantize,
                .dequantize_rows = qt_bnb4_dequantize_rows,
                .matmul_ref = qt_matmul_generic_ref,
                .matmul_avx2 = qt_matmul_bnb4_avx2,
                .dequantize_rows_avx2 = qt_dequantize_rows_bnb4_avx2},
    [QT_AFFINE] = {.name = "affine",
                   .block_size = 1,
                   .block_bytes = 1,
                   .quantize = qt_affine_quantize,
                   .dequantize_rows = qt_affine_dequantize_rows,
                   .matmul_ref = qt_matmul_generic_ref,
                   .matmul_avx2 = qt_matmul_affine_avx2,
                   .dequantize_rows_avx2 = qt_dequantize_rows_affine_avx2},
    /* llama.cpp block_q4_0: f16 d, 16 bytes of nibbles */
    [QT_Q4_0] = {.name = "q4_0",
                 .block_size = 32,
                 .block_bytes = 18,
                 .is_gguf = true,
                 .quantize = qt_gguf_quantize,
                 .dequantize_rows = qt_gguf_dequantize_rows,
                 .matmul_ref = qt_matmul_generic_ref,
                 .matmul_avx2 = qt_matmul_q4_0_avx2,
                 .dequantize_rows_avx2 = qt_dequantize_rows_q4_0_avx2},
    /* block_q4_1: f16 d, f16 m, 16 bytes of nibbles */
    [QT_Q4_1] = {.name = "q4_1",
                 .block_size = 32,
                 .block_bytes = 20,
                 .is_gguf = true,
                 .quantize = qt_gguf_quantize,
                 .dequantize_rows = qt_gguf_dequantize_rows,
                 .matmul_ref = qt_matmul_generic_ref,
                 .matmul_avx2 = qt_matmul_q4_1_avx2,
                 .dequantize_rows_avx2 = qt_dequantize_rows_q4_1_avx2},
    /* block_q8_0: f16 d, 32 int8 */
    [QT_Q8_0] = {.name = "q8_0",
                 .block_size = 32,
                 .block_bytes = 34,
                 .is_gguf = true,
                 .quantize = qt_gguf_quantize,
                 .dequantize_rows = qt_gguf_dequantize_rows,
                 .matmul_ref = qt_matmul_generic_ref,
                 .matmul_avx2 = qt_matmul_q8_0_avx2,
                 .dequantize_rows_avx2 = qt_dequantize_rows_q8_0_avx2},
};

int qt_kind_from_name(const char *name)
{
    if (!name)
        return -1;
    for (int k = 0; k < QT_KIND_COUNT; k++)
        if (strcmp(qt_traits_table[k].name, name) == 0)
            return k;
    return -1;
}

const char *qt_kind_name(qt_kind kind)
{
    if ((unsigned)kind >= QT_KIND_COUNT)
        return "unknown";
    return qt_traits_table[kind].name;
}

float qt_f16_to_f32(uint16_t h)
{
    return qm_f16_to_f32(h);
}
uint16_t qt_f32_to_f16(float f)
{
    return qm_f32_to_f16(f);
}
float qt_bf16_to_f32(uint16_t b)
{
    return qm_bf16_to_f32(b);
}
uint16_t qt_f32_to_bf16(float f)
{
    return qm_f32_to_bf16(f);
}

/* The first NaN or Inf in src, or -1. */
static int64_t first_non_finite(const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(src[i]))
            return i;
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
    int rc = qt_traits_table[p->kind].quantize(out, src, rows, cols, p, msg, msg_len);
    if (rc != QL_OK)
        qt_free(out);
    return rc;
}

void qt_dequantize_rows_ref(const qtensor *t, int64_t row0, int64_t nrows, float *out)
{
    qt_traits_table[t->kind].dequantize_rows(t, row0, nrows, out);
}

void qt_matmul_generic_ref(const qtensor *t, const float *x, int64_t batch, float *y, int64_t row0,
                           int64_t row1)
{
    int64_t cols = t->cols;
    float *w = malloc((size_t)cols * sizeof *w);
    if (!w) {
        /* no memory for one row: report it in the output, where a caller
         * checking for finite results will see it, rather than crash */
        for (int64_t b = 0; b < batch; b++)
            for (int64_t r = row0; r < row1; r++)
                y[b * t->rows + r] = NAN;
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

static bool force_scalar;
static bool have_avx2;
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
#else
static bool cpu_has_avx2_fma_f16c(void)
{
    return false;
}
#endif

static void detect_cpu(void)
{
    have_avx2 = cpu_has_avx2_fma_f16c();
    const char *env = getenv("QLSERVE_CPU_PATH");
    if (env && strcmp(env, "scalar") == 0)
        force_scalar = true;
}

const char *qt_cpu_path(void)
{
    pthread_once(&cpu_once, detect_cpu);
    return (have_avx2 && !force_scalar) ? "avx2" : "scalar";
}

void qt_set_force_scalar(bool force)
{
    pthread_once(&cpu_once, detect_cpu);
    force_scalar = force;
}

void qt_matmul(const qtensor *w, const float *x, int64_t batch, float *y, int64_t row0,
               int64_t row1)
{
    pthread_once(&cpu_once, detect_cpu);
    const qt_traits *tr = &qt_traits_table[w->kind];
    if (have_avx2 && !force_scalar && tr->matmul_avx2)
        tr->matmul_avx2(w, x, batch, y, row0, row1);
    else
        tr->matmul_ref(w, x, batch, y, row0, row1);
}

void qt_attend(const float *q, const float *k, const float *v, int64_t stride, int32_t n, int32_t d,
               float scale, float *max, float *sum, float *acc)
{
    pthread_once(&cpu_once, detect_cpu);
    if (have_avx2 && !force_scalar)
        qt_attend_avx2(q, k, v, stride, n, d, scale, max, sum, acc);
    else
        qt_attend_ref(q, k, v, stride, n, d, scale, max, sum, acc);
}

void qt_attend_ref(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                   int32_t d, float scale, float *max, float *sum, float *acc)
{
    om_online sm = {*max, *sum};
    for (int32_t i = 0; i < n; i++, k += stride, v += stride) {
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        int32_t t = 0;
        for (; t + 4 <= d; t += 4) {
            a0 += q[t] * k[t];
            a1 += q[t + 1] * k[t + 1];
            a2 += q[t + 2] * k[t + 2];
            a3 += q[t + 3] * k[t + 3];
        }
        for (; t < d; t++)
            a0 += q[t] * k[t];
        float score = ((a0 + a1) + (a2 + a3)) * scale, f;
        if (om_online_raise(&sm, score, &f)) /* rescale what was summed under the old max */
            for (int32_t u = 0; u < d; u++)
                acc[u] *= f;
        float w = om_online_weight(&sm, score);
        for (int32_t u = 0; u < d; u++)
            acc[u] = om_online_acc(acc[u], w, v[u]);
    }
    *max = sm.max;
    *sum = sm.sum;
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

/* --- ownership ---------------------------------------------------------- */

void qt_free(qtensor *t)
{
    if (!t)
        return;
    if (!t->data_borrowed)
        free(t->data);
    free(t->absmax);
    free(t->absmax_codes);
    free(t->nested_absmax);
    free(t->scales);
    free(t->zeros);
    memset(t, 0, sizeof *t);
}

static int dup_array(void **dst, const void *src, size_t bytes)
{
    *dst = NULL;
    if (!src)
        return QL_OK;
    *dst = malloc(bytes ? bytes : 1);
    if (!*dst)
        return QL_ENOMEM;
    memcpy(*dst, src, bytes);
    return QL_OK;
}

int qt_clone(qtensor *out, const qtensor *src)
{
    *out = *src;
    out->data = NULL;
    out->data_borrowed = false;
    out->absmax = NULL;
    out->absmax_codes = NULL;
    out->nested_absmax = NULL;
    out->scales = NULL;
    out->zeros = NULL;
    size_t nq = (size_t)(src->rows * src->groups_per_row) * sizeof(float);
    int rc = dup_array((void **)&out->data, src->data, src->data_bytes);
    if (rc == QL_OK)
        rc = dup_array((void **)&out->absmax, src->absmax, (size_t)src->n_blocks * sizeof(float));
    if (rc == QL_OK)
        rc = dup_array((void **)&out->absmax_codes, src->absmax_codes, (size_t)src->n_blocks);
    if (rc == QL_OK)
        rc = dup_array((void **)&out->nested_absmax, src->nested_absmax,
                       (size_t)src->n_nested_blocks * sizeof(float));
    if (rc == QL_OK)
        rc = dup_array((void **)&out->scales, src->scales, nq);
    if (rc == QL_OK)
        rc = dup_array((void **)&out->zeros, src->zeros, nq);
    if (rc != QL_OK)
        qt_free(out);
    return rc;
}

size_t qt_nbytes(const qtensor *t)
{
    size_t n = t->data_bytes;
    if (t->absmax)
        n += (size_t)t->n_blocks * sizeof(float);
    if (t->absmax_codes)
        n += (size_t)t->n_blocks + (size_t)t->n_nested_blocks * sizeof(float);
    if (t->scales)
        n += 2 * (size_t)(t->rows * t->groups_per_row) * sizeof(float);
    return n;
}

/* --- dense values in, dense dtype changes -------------------------------- */

int qt_from_dense(qtensor *out, qt_kind kind, const void *src, int64_t rows, int64_t cols,
                  char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    if ((unsigned)kind >= QT_KIND_COUNT || !qt_traits_table[kind].is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "kind %s is not a dense kind",
                       qt_kind_name(kind));
    if (rows <= 0 || cols <= 0 || rows > INT64_MAX / cols)
        return ql_fail(msg, msg_len, QL_EINVAL, "shape [%lld, %lld] is not valid", (long long)rows,
                       (long long)cols);
    size_t bytes = (size_t)(rows * cols) * qt_dense_elem_bytes(kind);
    return qt_wrap_copy(out, kind, rows, cols, src, bytes, msg, msg_len);
}

int qt_wrap_copy(qtensor *out, qt_kind kind, int64_t rows, int64_t cols, const void *src,
                 size_t bytes, char *msg, size_t msg_len)
{
    out->data = malloc(bytes ? bytes : 1);
    if (!out->data)
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes", bytes);
    memcpy(out->data, src, bytes);
    out->kind = kind;
    out->rows = rows;
    out->cols = cols;
    out->data_bytes = bytes;
    return QL_OK;
}

int qt_cast_dense(qtensor *t, qt_kind to, char *msg, size_t msg_len)
{
    if ((unsigned)t->kind >= QT_KIND_COUNT || !qt_traits_table[t->kind].is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "a %s tensor keeps its quantizer's dtypes; only dense kinds are cast",
                       qt_kind_name(t->kind));
    if ((unsigned)to >= QT_KIND_COUNT || !qt_traits_table[to].is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "cannot cast to %s: not a dense kind",
                       qt_kind_name(to));
    if (to == t->kind)
        return QL_OK;
    int64_t n = t->rows * t->cols;
    size_t bytes = (size_t)n * qt_dense_elem_bytes(to);
    uint8_t *data = malloc(bytes);
    float *row = malloc((size_t)t->cols * sizeof *row);
    if (!data || !row) {
        free(data);
        free(row);
        return ql_fail(msg, msg_len, QL_ENOMEM, "cannot allocate %zu bytes", bytes);
    }
    for (int64_t r = 0; r < t->rows; r++) {
        qt_dense_dequantize_rows(t, r, 1, row);
        for (int64_t c = 0; c < t->cols; c++) {
            int64_t i = r * t->cols + c;
            if (to == QT_F32)
                ((float *)data)[i] = row[c];
            else if (to == QT_F16)
                ((uint16_t *)data)[i] = qm_f32_to_f16(row[c]);
            else
                ((uint16_t *)data)[i] = qm_f32_to_bf16(row[c]);
        }
    }
    free(row);
    if (!t->data_borrowed)
        free(t->data);
    t->data = data;
    t->data_borrowed = false;
    t->data_bytes = bytes;
    t->kind = to;
    return QL_OK;
}

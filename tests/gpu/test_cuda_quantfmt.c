/*
 * test_cuda_quantfmt.c - the checkpoint formats FP8 (block scales in f32, in
 * UE8M0, and per channel / per block in bf16 and f16, whose values round to
 * the scale's dtype), CT_INT (compressed-tensors' int4 packed and int8
 * packed or naive, scales in f32, bf16 or f16, with and without zero
 * points), GPTQ (v1 4-bit with act-order, v2 8-bit, one group) and AWQ on
 * the CUDA backend, against the CPU's scalar reference
 * (qt_dequantize_rows_ref):
 *   - dequantization bit for bit: the row gather (every row), and the
 *     cuBLASLt path's dequantize read back through a product with the
 *     identity (y = I W^T is W^T exactly: one product by 1 and zeros per
 *     sum; only a zero's sign is lost), in f32 and in bf16 (the CPU's value
 *     rounded by qm_f32_to_bf16);
 *   - the matvec for batches 1..8 on both its kernels (FP8's fused 16-code
 *     chunks where block_cols % 16 == 0 and cols % 32 == 0, the generic one
 *     otherwise and for 16-bit scales, CT_INT, GPTQ/AWQ) within
 *     test_cuda_matmul's bound,
 *     |y - y64| <= 8 * FLT_EPSILON * sqrt(cols) * sum |x| |W|;
 *   - a download gives back the uploaded bytes (codes, scales in their own
 *     width, qzeros, CT_INT's zero points, g_idx);
 *   - the engine: the tiny FP8 (both scale widths), GPTQ (v1, v2), AWQ,
 *     compressed-tensors (int4 group asymmetric, int8 channel, int8 tensor
 *     naive, FP8 channel and block) and fbgemm FP8 fixtures of
 *     tests/fixtures (test_fp8, test_gptq, test_ctensors) give, on the CUDA
 *     backend, the CPU backend's greedy ids, which are the float64
 *     reference's, serve the CPU's bytes (equal digests), and a 16-token
 *     prefill (cuBLASLt's route) gives the CPU's logits within 1e-3.
 *
 * Plain C, no Criterion (the GPU machine has none): `PASS name` or `FAIL
 * name: detail` per check; exit 0 when all passed, 1 when one failed, 77
 * when there is no usable device. Seconds under the emulator.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

/* the references' digests and logits are test_fp8's, test_gptq's and
 * test_ctensors'; here only their prompts and greedy ids are read */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-const-variable"
#include "fixtures/ctensors_reference.h"
#include "fixtures/fp8_reference.h"
#include "fixtures/gptq_reference.h"
#pragma GCC diagnostic pop
#include "gpu_test_util.h"
#include "model.h"
#include "qt_cuda.h"
#include "qt_cuda_ops.h"
#include "qtensor.h"
#include "runtime.h"

#define MSG_LEN 512

static int passes, failures;

static void report(bool ok, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void report(bool ok, const char *name, const char *fmt, ...)
{
    char detail[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    printf(ok ? "PASS %s  %s\n" : "FAIL %s: %s\n", name, detail);
    fflush(stdout);
    if (ok)
        passes++;
    else
        failures++;
}

/* ---- the tensors: random parts through the loaders' own constructors ------ */

/* n random scales near `mid` in sd's width (f32, bf16, f16) into out. */
static void random_scales(void *out, int64_t n, qt_scale_dtype sd, double mid)
{
    for (int64_t i = 0; i < n; i++) {
        float v = (float)((0.5 + rng_uniform()) * mid);
        if (sd == QT_SCALE_BF16)
            ((uint16_t *)out)[i] = qt_f32_to_bf16(v);
        else if (sd == QT_SCALE_F16)
            ((uint16_t *)out)[i] = qt_f32_to_f16(v);
        else
            ((float *)out)[i] = v;
    }
}

/* rows x cols E4M3 codes (every byte but the two NaNs) with a random block
 * scale grid in sd's width. */
static int make_fp8(qtensor *t, int64_t rows, int64_t cols, int32_t br, int32_t bc,
                    qt_scale_dtype sd, char *msg)
{
    int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
    uint8_t *codes = malloc((size_t)(rows * cols));
    float *sf = malloc((size_t)(sr * sc) * sizeof *sf);
    uint8_t *se = malloc((size_t)(sr * sc));
    for (int64_t i = 0; i < rows * cols; i++) {
        uint8_t b = (uint8_t)(rng_uniform() * 256.0);
        codes[i] = (b & 0x7Fu) == 0x7Fu ? (uint8_t)(b - 1) : b;
    }
    random_scales(sf, sr * sc, sd == QT_SCALE_E8M0 ? QT_SCALE_F32 : sd, 1.0 / 448.0);
    for (int64_t i = 0; i < sr * sc; i++)
        se[i] = (uint8_t)(118 + (int)(rng_uniform() * 4.0)); /* 2^-9 .. 2^-6 */
    qt_fp8_parts p = {.rows = rows,
                      .cols = cols,
                      .block_rows = br,
                      .block_cols = bc,
                      .codes = codes,
                      .scale_dtype = sd,
                      .scales = sd == QT_SCALE_E8M0 ? (const void *)se : (const void *)sf,
                      .scale_rows = sr,
                      .scale_cols = sc};
    int rc = qt_from_fp8(t, &p, msg, MSG_LEN);
    free(codes);
    free(sf);
    free(se);
    return rc;
}

/* A CT_INT tensor of random codes: packed (4 or 8 bits) or naive int8,
 * scales in sd's width on a br x bc block grid, int8 zero points in the
 * codes' range when asym. */
static int make_ct(qtensor *t, int64_t rows, int64_t cols, int32_t bits, bool packed, int32_t br,
                   int32_t bc, qt_scale_dtype sd, bool asym, char *msg)
{
    int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
    size_t stride = packed ? (size_t)((cols * bits + 31) / 32) * 4 : (size_t)cols;
    uint8_t *codes = malloc(stride * (size_t)rows), *zeros = malloc((size_t)(sr * sc));
    float *scales = malloc((size_t)(sr * sc) * sizeof *scales);
    for (size_t i = 0; i < stride * (size_t)rows; i++)
        codes[i] = (uint8_t)(rng_uniform() * 256.0);
    for (int64_t i = 0; i < sr * sc; i++)
        zeros[i] =
            (uint8_t)(int8_t)((int)(rng_uniform() * (double)(1 << bits)) - (1 << (bits - 1)));
    random_scales(scales, sr * sc, sd, 0.01);
    qt_ct_int_parts p = {.rows = rows,
                         .cols = cols,
                         .bits = bits,
                         .packed = packed,
                         .block_rows = br,
                         .block_cols = bc,
                         .codes = codes,
                         .scale_dtype = sd,
                         .scales = scales,
                         .scale_rows = sr,
                         .scale_cols = sc,
                         .zeros = asym ? zeros : NULL};
    int rc = qt_from_ct_int(t, &p, msg, MSG_LEN);
    free(codes);
    free(zeros);
    free(scales);
    return rc;
}

/* A GPTQ (awq false) or AWQ tensor of random words, zeros and f16 scales;
 * act_order: g_idx a random group per channel (each group used). */
static int make_gptq(qtensor *t, int64_t rows, int64_t cols, int32_t bits, int32_t group, bool v2,
                     bool awq, bool act_order, char *msg)
{
    int64_t groups = group == -1 ? 1 : (cols + group - 1) / group;
    size_t qbytes = (size_t)(rows * cols * bits / 8), zbytes = (size_t)(groups * rows * bits / 8);
    uint8_t *qw = malloc(qbytes), *qz = malloc(zbytes);
    uint16_t *sc = malloc((size_t)(groups * rows) * 2);
    int32_t *gi = malloc((size_t)cols * 4);
    for (size_t i = 0; i < qbytes; i++)
        qw[i] = (uint8_t)(rng_uniform() * 256.0);
    for (size_t i = 0; i < zbytes; i++)
        qz[i] = (uint8_t)(rng_uniform() * 256.0);
    for (int64_t i = 0; i < groups * rows; i++)
        sc[i] = qt_f32_to_f16((float)(0.001 + 0.01 * rng_uniform()));
    for (int64_t c = 0; c < cols; c++)
        gi[c] = c < groups ? (int32_t)c : (int32_t)(rng_uniform() * (double)groups);
    qt_gptq_parts p = {.rows = rows,
                       .cols = cols,
                       .bits = bits,
                       .group_size = group,
                       .v2 = v2,
                       .awq = awq,
                       .qweight = qw,
                       .qzeros = qz,
                       .scales = (const uint8_t *)sc,
                       .g_idx = act_order ? (const uint8_t *)gi : NULL,
                       .groups = groups};
    int rc = qt_from_gptq(t, &p, msg, MSG_LEN);
    free(qw);
    free(qz);
    free(sc);
    free(gi);
    return rc;
}

typedef struct quant_case {
    const char *name;
    qtensor t;
} quant_case;

/* ---- dequantization, bit for bit -------------------------------------------- */

/* The first element where got's bits differ from want's, or -1. */
static int64_t first_difference(const float *got, const float *want, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof got[i]) != 0)
            return i;
    return -1;
}

/* Every row through qt_cuda_gather_rows against qt_dequantize_rows_ref. */
static void gather_bit_exact(const char *name, const qt_cuda_tensor *d, const float *ref)
{
    char msg[MSG_LEN] = "";
    const int64_t rows = d->rows, cols = d->cols, n = rows * cols;
    int32_t *ids = malloc((size_t)rows * sizeof *ids), *d_ids = NULL;
    float *got = malloc((size_t)n * sizeof *got), *d_out = NULL;
    for (int64_t r = 0; r < rows; r++)
        ids[r] = (int32_t)(rows - 1 - r); /* reversed: the ids are honoured */
    int rc = cudaMalloc((void **)&d_ids, (size_t)rows * sizeof *ids) == cudaSuccess &&
                     cudaMalloc((void **)&d_out, (size_t)n * sizeof *got) == cudaSuccess &&
                     cudaMemcpy(d_ids, ids, (size_t)rows * sizeof *ids, cudaMemcpyHostToDevice) ==
                         cudaSuccess
                 ? QL_OK
                 : QL_EDEVICE;
    if (rc == QL_OK)
        rc = qt_cuda_gather_rows(d, d_ids, rows, d_out, NULL, msg, sizeof msg);
    if (rc == QL_OK &&
        cudaMemcpy(got, d_out, (size_t)n * sizeof *got, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = QL_EDEVICE;
    int64_t bad = -1;
    for (int64_t r = 0; rc == QL_OK && bad < 0 && r < rows; r++) {
        int64_t e = first_difference(got + r * cols, ref + (rows - 1 - r) * cols, cols);
        bad = e < 0 ? -1 : (rows - 1 - r) * cols + e;
    }
    char what[160];
    snprintf(what, sizeof what, "gather_bit_exact_%s", name);
    if (rc != QL_OK)
        report(false, what, "rc %d: %s", rc, msg);
    else
        report(bad < 0, what, "%lld elements, first difference at %lld (-1: none)", (long long)n,
               (long long)bad);
    cudaFree(d_ids);
    cudaFree(d_out);
    free(ids);
    free(got);
}

/* The GEMM's dequantize (f32, then bf16) read back as I W^T. */
static void gemm_dequantize_bit_exact(const char *name, const qt_cuda_tensor *d, const float *ref)
{
    const int64_t rows = d->rows, cols = d->cols, n = rows * cols;
    float *eye = calloc((size_t)(cols * cols), sizeof *eye);
    float *got = malloc((size_t)n * sizeof *got), *d_x = NULL, *d_y = NULL;
    for (int64_t i = 0; i < cols; i++)
        eye[i * cols + i] = 1.0f;
    bool alloc_ok = cudaMalloc((void **)&d_x, (size_t)(cols * cols) * sizeof *eye) == cudaSuccess &&
                    cudaMalloc((void **)&d_y, (size_t)n * sizeof *got) == cudaSuccess &&
                    cudaMemcpy(d_x, eye, (size_t)(cols * cols) * sizeof *eye,
                               cudaMemcpyHostToDevice) == cudaSuccess;
    for (int mode = 0; mode < 2; mode++) {
        char msg[MSG_LEN] = "", what[160];
        snprintf(what, sizeof what, "gemm_dequantize_bit_exact_%s_%s", name, mode ? "bf16" : "f32");
        qt_cuda_blas *b = NULL;
        int rc = alloc_ok ? qt_cuda_blas_new(&b, n, cols, cols,
                                             mode ? QT_CUDA_GEMM_BF16 : QT_CUDA_GEMM_F32, msg,
                                             sizeof msg)
                          : QL_EDEVICE;
        if (rc == QL_OK)
            rc = qt_cuda_gemm(b, d, d_x, cols, d_y, NULL, msg, sizeof msg);
        if (rc == QL_OK &&
            (cudaDeviceSynchronize() != cudaSuccess ||
             cudaMemcpy(got, d_y, (size_t)n * sizeof *got, cudaMemcpyDeviceToHost) != cudaSuccess))
            rc = QL_EDEVICE;
        qt_cuda_blas_free(b);
        int64_t bad = -1;
        /* y[c][r] = W[r][c] (as bf16 in the bf16 mode) */
        for (int64_t e = 0; rc == QL_OK && bad < 0 && e < n; e++) {
            int64_t r = e / cols, c = e % cols;
            float want = mode ? qt_bf16_to_f32(qt_f32_to_bf16(ref[e])) : ref[e];
            /* a zero's sign does not survive the sum (0 * w + ... + 1 * -0);
             * the gather above pins it */
            const float g = got[c * rows + r];
            if (want == 0.0f ? g != 0.0f : memcmp(&g, &want, sizeof want) != 0)
                bad = e;
        }
        if (rc != QL_OK)
            report(false, what, "rc %d: %s", rc, msg);
        else
            report(bad < 0, what, "%lld elements, first difference at %lld (-1: none)",
                   (long long)n, (long long)bad);
    }
    cudaFree(d_x);
    cudaFree(d_y);
    free(eye);
    free(got);
}

/* ---- the matvec --------------------------------------------------------------- */

static void matvec_within_bound(const char *name, const qt_cuda_tensor *d, const float *ref)
{
    const int64_t rows = d->rows, cols = d->cols, B = QT_CUDA_MATVEC_MAX_BATCH;
    float *x = malloc((size_t)(B * cols) * sizeof *x), *y = malloc((size_t)(B * rows) * sizeof *y);
    float *d_x = NULL, *d_y = NULL;
    for (int64_t i = 0; i < B * cols; i++)
        x[i] = (float)rng_normal();
    char msg[MSG_LEN] = "", what[160];
    snprintf(what, sizeof what, "matvec_within_bound_%s", name);
    /* x at d_x (16-byte aligned: the fused kernels where the layout allows)
     * and at d_x + 1 (the generic kernel) */
    int rc = cudaMalloc((void **)&d_x, (size_t)(B * cols + 1) * sizeof *x) == cudaSuccess &&
                     cudaMalloc((void **)&d_y, (size_t)(B * rows) * sizeof *y) == cudaSuccess
                 ? QL_OK
                 : QL_EDEVICE;
    double worst = 0.0;
    int64_t checked = 0;
    for (int64_t pass = 0; rc == QL_OK && pass < 2 * B; pass++) {
        const int64_t batch = pass % B + 1, offset = pass / B;
        if (batch == 1 && cudaMemcpy(d_x + offset, x, (size_t)(B * cols) * sizeof *x,
                                     cudaMemcpyHostToDevice) != cudaSuccess)
            rc = QL_EDEVICE;
        if (rc == QL_OK)
            rc = qt_cuda_matvec(d, d_x + offset, batch, d_y, NULL, msg, sizeof msg);
        if (rc == QL_OK && (cudaDeviceSynchronize() != cudaSuccess ||
                            cudaMemcpy(y, d_y, (size_t)(batch * rows) * sizeof *y,
                                       cudaMemcpyDeviceToHost) != cudaSuccess))
            rc = QL_EDEVICE;
        for (int64_t bi = 0; rc == QL_OK && bi < batch; bi++)
            for (int64_t r = 0; r < rows; r++) {
                double y64 = 0.0, a = 0.0;
                for (int64_t c = 0; c < cols; c++) {
                    y64 += (double)x[bi * cols + c] * (double)ref[r * cols + c];
                    a += fabs((double)x[bi * cols + c] * (double)ref[r * cols + c]);
                }
                double bound = 8.0 * FLT_EPSILON * sqrt((double)cols) * a + 1e-30;
                double err = fabs((double)y[bi * rows + r] - y64) / bound;
                worst = !(err <= worst) ? (isnan(err) ? INFINITY : err) : worst;
                checked++;
            }
    }
    if (rc != QL_OK)
        report(false, what, "rc %d: %s", rc, msg);
    else
        report(worst <= 1.0, what,
               "batches 1..%lld, x aligned and not, %lld outputs, worst err/bound %.3f",
               (long long)B, (long long)checked, worst);
    cudaFree(d_x);
    cudaFree(d_y);
    free(x);
    free(y);
}

/* ---- download ------------------------------------------------------------------ */

static bool same_bytes(const void *a, const void *b, size_t n)
{
    return n == 0 || (a && b && memcmp(a, b, n) == 0);
}

static void download_round_trip(const char *name, const qt_cuda_tensor *d, const qtensor *t)
{
    char msg[MSG_LEN] = "", what[160];
    snprintf(what, sizeof what, "download_gives_back_the_bytes_%s", name);
    qtensor back;
    int rc = qt_clone(&back, t);
    if (rc == QL_OK) { /* scribble, so a copy that does not happen shows */
        memset(back.data, 0x5A, back.data_bytes);
        if (back.block_scales)
            memset(back.block_scales, 0x5A,
                   (size_t)(t->scale_rows * t->scale_cols) * qt_scale_dtype_size(t->scale_dtype));
        if (back.block_zeros)
            memset(back.block_zeros, 0x5A, (size_t)(t->scale_rows * t->scale_cols));
        if (back.gptq_qzeros)
            memset(back.gptq_qzeros, 0x5A, (size_t)(t->gptq_groups * t->rows * t->bits / 8));
        rc = qt_cuda_tensor_download(d, &back, msg, sizeof msg);
    }
    bool ok = rc == QL_OK && same_bytes(back.data, t->data, t->data_bytes);
    if (t->kind == QT_FP8 || t->kind == QT_CT_INT)
        ok = ok && back.scale_dtype == t->scale_dtype &&
             same_bytes(back.block_scales, t->block_scales,
                        (size_t)(t->scale_rows * t->scale_cols) *
                            qt_scale_dtype_size(t->scale_dtype)) &&
             same_bytes(back.block_zeros, t->block_zeros,
                        t->block_zeros ? (size_t)(t->scale_rows * t->scale_cols) : 0);
    else
        ok = ok &&
             same_bytes(back.gptq_qzeros, t->gptq_qzeros,
                        (size_t)(t->gptq_groups * t->rows * t->bits / 8)) &&
             same_bytes(back.gptq_scales, t->gptq_scales, (size_t)(t->gptq_groups * t->rows) * 2) &&
             same_bytes(back.gptq_g_idx, t->gptq_g_idx, (size_t)t->cols * 4);
    report(ok, what, "%s",
           rc == QL_OK ? (ok ? "codes and quant state equal" : "bytes differ") : msg);
    if (rc == QL_OK || back.data)
        qt_free(&back);
}

/* Every check of one tensor. */
static void tensor_checks(const char *name, const qtensor *t)
{
    char msg[MSG_LEN] = "";
    const int64_t n = t->rows * t->cols;
    float *ref = malloc((size_t)n * sizeof *ref);
    qt_dequantize_rows_ref(t, 0, t->rows, ref);
    qt_cuda_tensor d;
    int rc = qt_cuda_tensor_upload(t, &d, msg, sizeof msg);
    if (rc != QL_OK) {
        char what[160];
        snprintf(what, sizeof what, "upload_%s", name);
        report(false, what, "rc %d: %s", rc, msg);
    } else {
        gather_bit_exact(name, &d, ref);
        gemm_dequantize_bit_exact(name, &d, ref);
        matvec_within_bound(name, &d, ref);
        download_round_trip(name, &d, t);
        qt_cuda_tensor_release(&d, NULL, 0);
    }
    free(ref);
}

static void kernels(void)
{
    /* merges into these kinds requantize on the CPU (quant_fp8.c,
     * quant_ct.c, quant_gptq.c) and the backend uploads the merged bytes */
    report(!qt_cuda_merge_requantizes(QT_FP8) && !qt_cuda_merge_requantizes(QT_CT_INT) &&
               !qt_cuda_merge_requantizes(QT_GPTQ) && !qt_cuda_merge_requantizes(QT_AWQ),
           "merges_into_checkpoint_formats_requantize_on_the_cpu", "fp8, ct_int, gptq, awq");
    struct {
        const char *name;
        int64_t rows, cols;
        int32_t br, bc;
        qt_scale_dtype sd;
    } fp8[] = {
        {"fp8_f32_16x32_fused", 48, 96, 16, 32, QT_SCALE_F32},
        {"fp8_e8m0_16x32_fused", 48, 96, 16, 32, QT_SCALE_E8M0},
        {"fp8_f32_partial_blocks", 37, 70, 16, 32, QT_SCALE_F32}, /* the grid's last blocks cut */
        {"fp8_e8m0_8x8_generic", 24, 64, 8, 8, QT_SCALE_E8M0},    /* blocks narrower than a chunk */
        {"fp8_f32_128x128", 40, 160, 128, 128, QT_SCALE_F32},
        {"fp8_bf16_channel", 48, 96, 1, 96, QT_SCALE_BF16}, /* compressed-tensors' FP8_DYNAMIC */
        {"fp8_f16_partial_blocks", 37, 70, 16, 32, QT_SCALE_F16},
    };
    char msg[MSG_LEN];
    for (size_t i = 0; i < sizeof fp8 / sizeof fp8[0]; i++) {
        qtensor t;
        int rc = make_fp8(&t, fp8[i].rows, fp8[i].cols, fp8[i].br, fp8[i].bc, fp8[i].sd, msg);
        if (rc != QL_OK) {
            report(false, fp8[i].name, "qt_from_fp8: %s", msg);
            continue;
        }
        tensor_checks(fp8[i].name, &t);
        qt_free(&t);
    }
    struct {
        const char *name;
        int64_t rows, cols;
        int32_t bits;
        bool packed;
        int32_t br, bc;
        qt_scale_dtype sd;
        bool asym;
    } ct[] = {
        {"ct_int4_group32_asym_bf16", 40, 96, 4, true, 1, 32, QT_SCALE_BF16, true},
        {"ct_int8_channel_sym_f16", 36, 64, 8, true, 1, 64, QT_SCALE_F16, false},
        {"ct_int8_naive_tensor_asym_f32", 24, 48, 8, false, 24, 48, QT_SCALE_F32, true},
        {"ct_int4_partial_blocks_f16", 37, 70, 4, true, 16, 32, QT_SCALE_F16, true},
        {"ct_int8_naive_group_sym_bf16", 20, 40, 8, false, 1, 16, QT_SCALE_BF16, false},
    };
    for (size_t i = 0; i < sizeof ct / sizeof ct[0]; i++) {
        qtensor t;
        int rc = make_ct(&t, ct[i].rows, ct[i].cols, ct[i].bits, ct[i].packed, ct[i].br, ct[i].bc,
                         ct[i].sd, ct[i].asym, msg);
        if (rc != QL_OK) {
            report(false, ct[i].name, "qt_from_ct_int: %s", msg);
            continue;
        }
        tensor_checks(ct[i].name, &t);
        qt_free(&t);
    }
    struct {
        const char *name;
        int64_t rows, cols;
        int32_t bits, group;
        bool v2, awq, act_order;
    } gq[] = {
        {"gptq_v1_int4_act_order", 40, 96, 4, 32, false, false, true},
        {"gptq_v2_int8", 36, 64, 8, 16, true, false, false},
        {"gptq_v1_int4_one_group", 24, 48, 4, -1, false, false, false},
        {"awq_int4", 40, 96, 4, 32, false, true, false},
    };
    for (size_t i = 0; i < sizeof gq / sizeof gq[0]; i++) {
        qtensor t;
        int rc = make_gptq(&t, gq[i].rows, gq[i].cols, gq[i].bits, gq[i].group, gq[i].v2, gq[i].awq,
                           gq[i].act_order, msg);
        if (rc != QL_OK) {
            report(false, gq[i].name, "qt_from_gptq: %s", msg);
            continue;
        }
        tensor_checks(gq[i].name, &t);
        qt_free(&t);
    }
}

/* ---- the engine: the fixtures' greedy ids on both backends ------------------ */

/* n greedy ids after the prompt on backend device dev, each the argmax
 * (lowest id on ties) of the step's logits; last (when not NULL) the last
 * step's logits; *digest (when not NULL) the backend's digest of the
 * weights it serves (on CUDA: downloaded from the device). */
static int greedy_ids(const eng_model *m, eng_device dev, const int *prompt, int32_t n_prompt,
                      int32_t *ids, int32_t n, float *last, uint64_t *digest, char *msg,
                      size_t msg_len)
{
    eng_backend_opts o = {.device = dev,
                          .max_tokens = 64,
                          .max_seqs = 1,
                          .kv_bytes = (size_t)4 << 20,
                          .block_tokens = 16};
    eng_backend *b = NULL;
    int rc = eng_backend_new(&b, m, &o, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_seq_kv kv;
    memset(&kv, 0, sizeof kv);
    const int32_t V = m->cfg.vocab_size;
    float *logits = malloc((size_t)V * sizeof *logits);
    int32_t tokens[64], token_out = -1;
    for (int32_t i = 0; i < n_prompt; i++)
        tokens[i] = prompt[i];
    rc = eng_kv_reserve(eng_backend_kv(b), &kv, n_prompt + n + 1);
    int32_t pos = 0, fed = n_prompt;
    for (int32_t k = 0; rc == QL_OK && k < n; k++) {
        eng_step_seq s = {.kv = &kv, .tokens = tokens + pos, .n_tokens = fed, .pos = pos};
        rc = eng_backend_forward(b, &s, 1, logits, &token_out, msg, msg_len);
        int32_t best = 0;
        for (int32_t v = 1; rc == QL_OK && v < V; v++)
            best = logits[v] > logits[best] ? v : best;
        ids[k] = best;
        pos += fed;
        tokens[pos] = best;
        fed = 1;
    }
    if (rc == QL_OK && last)
        memcpy(last, logits, (size_t)V * sizeof *logits);
    if (rc == QL_OK && digest)
        rc = eng_backend_digest(b, NULL, digest, msg, msg_len);
    eng_kv_release(eng_backend_kv(b), &kv);
    eng_backend_free(b);
    free(logits);
    return rc;
}

/* A prefill of more than 8 tokens (the cuBLASLt route on the device): the
 * last row's logits within test_cuda_engine's bound, 1e-3 of the largest
 * |logit|, and the same argmax. */
static void prefill_logits(const eng_model *m, const char *folder, const int *tokens,
                           int32_t n_tokens)
{
    char name[128], msg[MSG_LEN] = "";
    snprintf(name, sizeof name, "prefill_logits_match_cpu_%s", folder);
    const int32_t V = m->cfg.vocab_size;
    float *cpu = malloc((size_t)V * sizeof *cpu), *gpu = malloc((size_t)V * sizeof *gpu);
    int32_t id_cpu = -1, id_gpu = -1;
    int rc =
        greedy_ids(m, ENG_DEVICE_CPU, tokens, n_tokens, &id_cpu, 1, cpu, NULL, msg, sizeof msg);
    if (rc == QL_OK)
        rc = greedy_ids(m, ENG_DEVICE_CUDA, tokens, n_tokens, &id_gpu, 1, gpu, NULL, msg,
                        sizeof msg);
    double scale = 1.0, worst = 0.0;
    for (int32_t v = 0; rc == QL_OK && v < V; v++)
        scale = fabs(cpu[v]) > scale ? fabs(cpu[v]) : scale;
    for (int32_t v = 0; rc == QL_OK && v < V; v++) {
        double d = fabs((double)gpu[v] - (double)cpu[v]) / scale;
        worst = !(d <= worst) ? (isnan(d) ? INFINITY : d) : worst;
    }
    if (rc != QL_OK)
        report(false, name, "%s", msg);
    else
        report(worst <= 1e-3 && id_cpu == id_gpu, name,
               "%d tokens: worst relative logit difference %.3g (bound 1e-3), next id %d on the "
               "device, %d on the CPU",
               (int)n_tokens, worst, (int)id_gpu, (int)id_cpu);
    free(cpu);
    free(gpu);
}

static void engine_fixture(const char *folder, const int *want, const int *prompt, int32_t n_prompt,
                           int32_t n, const int *tokens, int32_t n_tokens)
{
    char name[128], msg[MSG_LEN] = "", dir[64];
    snprintf(name, sizeof name, "greedy_ids_match_cpu_%s", folder);
    eng_model m;
    eng_load_opts lo = {.path = dir};
    int rc = gpu_fixture_folder(folder, dir, sizeof dir);
    if (rc == QL_OK)
        rc = eng_model_load(&m, &lo, msg, sizeof msg);
    else
        snprintf(msg, sizeof msg, "cannot make a scratch folder for %s", folder);
    if (rc != QL_OK) {
        report(false, name, "%s", msg);
        gpu_fixture_folder_remove(dir);
        return;
    }
    int32_t cpu[32], gpu[32];
    uint64_t cpu_digest = 0, gpu_digest = 0;
    rc = greedy_ids(&m, ENG_DEVICE_CPU, prompt, n_prompt, cpu, n, NULL, &cpu_digest, msg,
                    sizeof msg);
    if (rc == QL_OK)
        rc = greedy_ids(&m, ENG_DEVICE_CUDA, prompt, n_prompt, gpu, n, NULL, &gpu_digest, msg,
                        sizeof msg);
    int32_t first_cpu = -1, first_ref = -1;
    for (int32_t k = n - 1; rc == QL_OK && k >= 0; k--) {
        first_cpu = gpu[k] != cpu[k] ? k : first_cpu;
        first_ref = gpu[k] != want[k] ? k : first_ref;
    }
    if (rc != QL_OK)
        report(false, name, "%s", msg);
    else
        report(first_cpu < 0 && first_ref < 0 && gpu_digest == cpu_digest, name,
               "%d ids; first difference from the CPU at %d, from the float64 reference at %d "
               "(-1: none); digest of the served weights %016llx on the device, %016llx on the "
               "CPU",
               (int)n, (int)first_cpu, (int)first_ref, (unsigned long long)gpu_digest,
               (unsigned long long)cpu_digest);
    prefill_logits(&m, folder, tokens, n_tokens);
    eng_model_free(&m);
    gpu_fixture_folder_remove(dir);
}

static void engine(void)
{
    const int32_t np = (int32_t)(sizeof FP8_PROMPT / sizeof FP8_PROMPT[0]);
    engine_fixture("fp8_tiny_float", FP8_FLOAT_GREEDY, FP8_PROMPT, np, FP8_N_GREEDY, FP8_TOKENS,
                   FP8_N_TOKENS);
    engine_fixture("fp8_tiny_ue8m0", FP8_UE8M0_GREEDY, FP8_PROMPT, np, FP8_N_GREEDY, FP8_TOKENS,
                   FP8_N_TOKENS);
    const int32_t gp = (int32_t)(sizeof GPTQ_PROMPT / sizeof GPTQ_PROMPT[0]);
    engine_fixture("gptq_tiny_v1", GPTQ_V1_GREEDY, GPTQ_PROMPT, gp, GPTQ_N_GREEDY, GPTQ_TOKENS,
                   GPTQ_N_TOKENS);
    engine_fixture("gptq_tiny_v2", GPTQ_V2_GREEDY, GPTQ_PROMPT, gp, GPTQ_N_GREEDY, GPTQ_TOKENS,
                   GPTQ_N_TOKENS);
    engine_fixture("awq_tiny", GPTQ_AWQ_GREEDY, GPTQ_PROMPT, gp, GPTQ_N_GREEDY, GPTQ_TOKENS,
                   GPTQ_N_TOKENS);
    static const struct {
        const char *folder;
        const int *greedy;
    } ct[] = {
        {"ct_int4_group_asym", CT_INT4_GROUP_ASYM_GREEDY},
        {"ct_int8_channel_sym", CT_INT8_CHANNEL_SYM_GREEDY},
        {"ct_int8_tensor_naive", CT_INT8_TENSOR_NAIVE_GREEDY},
        {"ct_fp8_channel", CT_FP8_CHANNEL_GREEDY},
        {"ct_fp8_block", CT_FP8_BLOCK_GREEDY},
        {"fbgemm_fp8_tiny", CT_FBGEMM_GREEDY},
    };
    const int32_t cp = (int32_t)(sizeof CT_PROMPT / sizeof CT_PROMPT[0]);
    for (size_t i = 0; i < sizeof ct / sizeof ct[0]; i++)
        engine_fixture(ct[i].folder, ct[i].greedy, CT_PROMPT, cp, CT_N_GREEDY, CT_TOKENS,
                       CT_N_TOKENS);
}

int main(void)
{
    char msg[MSG_LEN];
    int count = 0;
    if (qt_cuda_device_count(&count, msg, sizeof msg) != QL_OK || count < 1) {
        printf("SKIP no usable CUDA device: %s\n", msg);
        return 77;
    }
    rng_seed(34);
    kernels();
    engine();
    printf("%d passed, %d failed\n", passes, failures);
    return failures ? 1 : 0;
}

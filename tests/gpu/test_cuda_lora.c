/*
 * test_cuda_lora.c - LoRA on the device (kernels/cuda/qt_cuda_lora.cu): the
 * SGMV products of unmerged adapters against the CPU backend's
 * eng_lora_apply and a float64 reference, and the device merge against the
 * CPU merge of adapters/merge.c, byte for byte, for every quant kind.
 *
 * Why shaped so: this runs only on a machine with a GPU (tests/gpu/run.sh),
 * whose time is short, so it is a plain C program that prints one line per
 * case (`PASS name` or `FAIL name: what, where`) and says in the failure
 * which array, which index and which values differ, so one run finds a bug.
 *   - SGMV: segments of different adapters, ranks 8, 16 and 64, A and B in
 *     f32, f16 and bf16, scales, 0 to 17 rows, and rows in no segment; the
 *     scratch t poisoned with NaN and untouched rows checked bit for bit.
 *     The sums run in f32 in another order than the CPU's, so results are
 *     held to a bound from a float64 reference (1e-4 of the sum of the
 *     magnitudes of the terms: f32 over ~1000 products is ~1e-5 at worst);
 *     an indexing bug is off by O(1). A segment run alone gives the same
 *     bits as in the batch (no row depends on another), and a segment the
 *     kernels cannot apply turns its rows into NaN.
 *   - merge: the device-merged tensor downloaded over a poisoned copy must
 *     equal the CPU merge in every byte (codes, absmax, nested state,
 *     scales, zeros, GGUF blocks, dense values) for nf4, nf4 with double
 *     quantization, fp4, int4 g64 asymmetric and symmetric, int8, int8
 *     asymmetric, q4_0, q4_1, q8_0, bf16, f16, f32 and some odd shapes
 *     (short last block, odd element count, odd columns), with two terms and
 *     with none; the cost figures to 1e-9 relative (the device sums in
 *     another order); releasing the merged tensor leaves the pristine
 *     device tensor's download equal to the host original; a NaN in B is
 *     refused with QL_ENONFINITE naming the CPU's row and column, leaving
 *     no device memory behind; 4096x4096 and 11008x4096 NF4 merges are
 *     timed (`timing merge ...` lines).
 *
 * Exit status: 0 all passed; 1 a case failed; 77 no usable CUDA device.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, mkdtemp (test_util.h) */

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_test_util.h"
#include "lora.h"
#include "model.h"
#include "qt_cuda_ops.h"
#include "qtensor.h"
#include "runtime.h"
#include "test_util.h"

static int failures;

static void pass(const char *name)
{
    printf("PASS %s\n", name);
    fflush(stdout);
}

static void fail(const char *name, const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    printf("FAIL %s: %s\n", name, what);
    fflush(stdout);
    failures++;
}

/* A CUDA runtime call the test itself makes; on failure the case fails. */
static bool cuda_ok(const char *name, cudaError_t st, const char *what)
{
    if (st == cudaSuccess)
        return true;
    fail(name, "%s: %s", what, cudaGetErrorString(st));
    (void)cudaGetLastError();
    return false;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static float *normal_values(uint64_t *seed, int64_t n, double sd)
{
    float *v = malloc((size_t)n * sizeof *v);
    if (!v) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)(test_normal(seed) * sd);
    return v;
}

/* A dense rows x cols tensor of kind (F32, F16, BF16) with N(0, sd) values. */
static void dense_tensor(qtensor *t, qt_kind kind, int64_t rows, int64_t cols, double sd,
                         uint64_t *seed)
{
    float *v = normal_values(seed, rows * cols, sd);
    qt_quant_params p = {.kind = kind};
    char msg[256];
    if (qt_quantize(t, v, rows, cols, &p, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "dense_tensor: %s\n", msg);
        exit(1);
    }
    free(v);
}

/* An adapter module and its A and B on the device. */
typedef struct test_module {
    eng_lora_module m;
    qt_cuda_tensor a, b;
} test_module;

static bool module_new(test_module *tm, const char *name, int32_t rank, int64_t out, int64_t in,
                       qt_kind a_kind, qt_kind b_kind, float module_scale, uint64_t seed)
{
    memset(tm, 0, sizeof *tm);
    uint64_t s = seed;
    dense_tensor(&tm->m.a, a_kind, rank, in, 0.05, &s);
    dense_tensor(&tm->m.b, b_kind, out, rank, 0.05, &s);
    tm->m.scale = module_scale;
    char msg[512];
    if (qt_cuda_tensor_upload(&tm->m.a, &tm->a, msg, sizeof msg) != QL_OK ||
        qt_cuda_tensor_upload(&tm->m.b, &tm->b, msg, sizeof msg) != QL_OK) {
        fail(name, "uploading A or B: %s", msg);
        return false;
    }
    return true;
}

static void module_free(test_module *tm)
{
    qt_cuda_tensor_release(&tm->a, NULL, 0);
    qt_cuda_tensor_release(&tm->b, NULL, 0);
    qt_free(&tm->m.a);
    qt_free(&tm->m.b);
}

/* ======================= SGMV ============================================ */

/* y0[r] + ((x[r] @ A^T) * s) @ B^T in double, and the bound the f32 device
 * result must keep to: 1e-4 of the magnitudes summed, plus a floor. */
static void sgmv_reference(const eng_lora_module *m, float s, const float *xr, int64_t in,
                           const float *y0r, int64_t out, double *ref, double *bound)
{
    int64_t rank = m->a.rows;
    float *a = malloc((size_t)(rank * in) * sizeof *a);
    float *b = malloc((size_t)(out * rank) * sizeof *b);
    double *t = malloc((size_t)rank * sizeof *t), *tmag = malloc((size_t)rank * sizeof *tmag);
    qt_dequantize_rows(&m->a, 0, rank, a);
    qt_dequantize_rows(&m->b, 0, out, b);
    for (int64_t j = 0; j < rank; j++) {
        double acc = 0.0, mag = 0.0;
        for (int64_t c = 0; c < in; c++) {
            acc += (double)xr[c] * (double)a[j * in + c];
            mag += fabs((double)xr[c] * (double)a[j * in + c]);
        }
        t[j] = acc * (double)s;
        tmag[j] = mag * fabs((double)s);
    }
    for (int64_t o = 0; o < out; o++) {
        double acc = 0.0, mag = fabs((double)y0r[o]);
        for (int64_t j = 0; j < rank; j++) {
            acc += t[j] * (double)b[o * rank + j];
            mag += tmag[j] * fabs((double)b[o * rank + j]);
        }
        ref[o] = (double)y0r[o] + acc;
        bound[o] = 1e-4 * mag + 1e-7;
    }
    free(a);
    free(b);
    free(t);
    free(tmag);
}

typedef struct sgmv_setup {
    int64_t in, out, total_rows;
    int32_t max_rank;
    float *x, *y0;       /* host */
    float *dx, *dy, *dt; /* device */
    qt_cuda_lora_segment *dsegs;
} sgmv_setup;

static bool sgmv_setup_new(sgmv_setup *su, const char *name, int64_t in, int64_t out,
                           int64_t total_rows, int32_t max_rank, int32_t max_segs, uint64_t seed)
{
    memset(su, 0, sizeof *su);
    su->in = in;
    su->out = out;
    su->total_rows = total_rows;
    su->max_rank = max_rank;
    uint64_t s = seed;
    su->x = normal_values(&s, total_rows * in, 1.0);
    su->y0 = normal_values(&s, total_rows * out, 0.5);
    return cuda_ok(name, cudaMalloc((void **)&su->dx, (size_t)(total_rows * in) * sizeof(float)),
                   "cudaMalloc x") &&
           cuda_ok(name, cudaMalloc((void **)&su->dy, (size_t)(total_rows * out) * sizeof(float)),
                   "cudaMalloc y") &&
           cuda_ok(name,
                   cudaMalloc((void **)&su->dt, (size_t)(total_rows * max_rank) * sizeof(float)),
                   "cudaMalloc t") &&
           cuda_ok(name,
                   cudaMalloc((void **)&su->dsegs, (size_t)max_segs * sizeof(qt_cuda_lora_segment)),
                   "cudaMalloc segs") &&
           cuda_ok(name,
                   cudaMemcpy(su->dx, su->x, (size_t)(total_rows * in) * sizeof(float),
                              cudaMemcpyHostToDevice),
                   "copy x");
}

static void sgmv_setup_free(sgmv_setup *su)
{
    cudaFree(su->dx);
    cudaFree(su->dy);
    cudaFree(su->dt);
    cudaFree(su->dsegs);
    free(su->x);
    free(su->y0);
}

/* y = y0, t = NaN, the segments uploaded, one qt_cuda_sgmv, y back. */
static bool sgmv_run(sgmv_setup *su, const char *name, const qt_cuda_lora_segment *segs,
                     int32_t n_segs, float *y)
{
    size_t ybytes = (size_t)(su->total_rows * su->out) * sizeof(float);
    if (!cuda_ok(name, cudaMemcpy(su->dy, su->y0, ybytes, cudaMemcpyHostToDevice), "copy y0") ||
        !cuda_ok(name,
                 cudaMemset(su->dt, 0xff, (size_t)(su->total_rows * su->max_rank) * sizeof(float)),
                 "poison t") ||
        !cuda_ok(name,
                 cudaMemcpy(su->dsegs, segs, (size_t)n_segs * sizeof *segs, cudaMemcpyHostToDevice),
                 "copy segments"))
        return false;
    char msg[512] = "";
    int rc = qt_cuda_sgmv(su->dx, su->in, su->dy, su->out, su->dsegs, n_segs, su->max_rank,
                          su->total_rows, su->dt, NULL, msg, sizeof msg);
    if (rc != QL_OK) {
        fail(name, "qt_cuda_sgmv returned %d: %s", rc, msg);
        return false;
    }
    return cuda_ok(name, cudaDeviceSynchronize(), "running qt_cuda_sgmv") &&
           cuda_ok(name, cudaMemcpy(y, su->dy, ybytes, cudaMemcpyDeviceToHost), "copy y back");
}

/* The segments' rows against the float64 reference and eng_lora_apply. */
static bool sgmv_check_rows(const sgmv_setup *su, const char *name, const float *y,
                            const qt_cuda_lora_segment *segs, const test_module *const *mods,
                            const float *user_scales, int32_t n_segs)
{
    int64_t in = su->in, out = su->out;
    double *ref = malloc((size_t)out * sizeof *ref), *bound = malloc((size_t)out * sizeof *bound);
    float *cpu_y = malloc((size_t)(su->total_rows * out) * sizeof *cpu_y);
    float *cpu_t = malloc((size_t)(su->total_rows * su->max_rank) * sizeof *cpu_t);
    float *cpu_u = malloc((size_t)(su->total_rows * out) * sizeof *cpu_u);
    bool ok = ref && bound && cpu_y && cpu_t && cpu_u;
    for (int32_t s = 0; ok && s < n_segs; s++) {
        const qt_cuda_lora_segment *sg = &segs[s];
        const eng_lora_module *m = &mods[s]->m;
        if (sg->rows == 0)
            continue;
        /* the CPU backend on the same rows */
        memcpy(cpu_y, su->y0 + sg->row0 * out, (size_t)(sg->rows * out) * sizeof(float));
        eng_lora_apply(NULL, m, user_scales[s], su->x + sg->row0 * in, sg->rows, cpu_y, cpu_t,
                       cpu_u);
        for (int64_t i = 0; ok && i < sg->rows; i++) {
            int64_t r = sg->row0 + i;
            sgmv_reference(m, sg->scale, su->x + r * in, in, su->y0 + r * out, out, ref, bound);
            for (int64_t o = 0; o < out; o++) {
                double dev = y[r * out + o], cpu = cpu_y[i * out + o];
                if (!(fabs(dev - ref[o]) <= bound[o])) {
                    fail(name,
                         "segment %d (rank %d), row %lld, output %lld: device %.9g, float64 "
                         "reference %.9g (bound %.3g), CPU eng_lora_apply %.9g",
                         (int)s, (int)sg->rank, (long long)r, (long long)o, dev, ref[o], bound[o],
                         cpu);
                    ok = false;
                    break;
                }
                if (!(fabs(cpu - ref[o]) <= bound[o])) {
                    fail(name,
                         "the CPU itself is off at segment %d row %lld output %lld: %.9g vs %.9g",
                         (int)s, (long long)r, (long long)o, cpu, ref[o]);
                    ok = false;
                    break;
                }
            }
        }
    }
    if (!(ref && bound && cpu_y && cpu_t && cpu_u))
        fail(name, "out of host memory");
    free(ref);
    free(bound);
    free(cpu_y);
    free(cpu_t);
    free(cpu_u);
    return ok;
}

/* Rows in no segment keep y0's bits. */
static bool sgmv_check_untouched(const sgmv_setup *su, const char *name, const float *y,
                                 const qt_cuda_lora_segment *segs, int32_t n_segs)
{
    for (int64_t r = 0; r < su->total_rows; r++) {
        bool covered = false;
        for (int32_t s = 0; s < n_segs; s++)
            covered = covered || (r >= segs[s].row0 && r < segs[s].row0 + segs[s].rows);
        if (covered)
            continue;
        if (memcmp(y + r * su->out, su->y0 + r * su->out, (size_t)su->out * sizeof(float)) != 0) {
            fail(name, "row %lld is in no segment but its y changed", (long long)r);
            return false;
        }
    }
    return true;
}

static void test_sgmv(void)
{
    const char *name = "sgmv_segments_of_mixed_adapters_ranks_and_dtypes";
    enum { N_MODS = 4, N_SEGS = 7 };
    const int64_t in = 1000, out = 700, total_rows = 33; /* 1000: not a multiple of 128 */
    test_module mods[N_MODS];
    struct {
        int32_t rank;
        qt_kind a, b;
        float module_scale;
    } spec[N_MODS] = {
        {8, QT_F32, QT_F32, 2.0f},
        {16, QT_F16, QT_BF16, 0.5f},
        {64, QT_BF16, QT_F16, 0.25f},
        {16, QT_F32, QT_BF16, 1.0f},
    };
    bool ok = true;
    memset(mods, 0, sizeof mods);
    for (int i = 0; i < N_MODS; i++)
        ok = ok && module_new(&mods[i], name, spec[i].rank, out, in, spec[i].a, spec[i].b,
                              spec[i].module_scale, 100 + (uint64_t)i);
    sgmv_setup su;
    ok = ok && sgmv_setup_new(&su, name, in, out, total_rows, 64, N_SEGS + 1, 7);
    if (!ok) {
        for (int i = 0; i < N_MODS; i++)
            module_free(&mods[i]);
        return;
    }
    /* rows: [0,1) m0; [1,4) m1; row 4 none; [5,22) m2; [22,22) m3 empty;
     * [22,30) m3; [30,31) m0 at another scale; rows 31, 32 none */
    const int mod_of[N_SEGS] = {0, 1, 2, 3, 3, 0, 1};
    const int64_t row0[N_SEGS] = {0, 1, 5, 22, 22, 30, 31};
    const int64_t nrows[N_SEGS] = {1, 3, 17, 0, 8, 1, 0};
    const float user[N_SEGS] = {1.0f, 0.75f, 1.5f, 1.0f, -0.6f, 0.3f, 1.0f};
    qt_cuda_lora_segment segs[N_SEGS];
    const test_module *seg_mods[N_SEGS];
    for (int s = 0; s < N_SEGS; s++) {
        const test_module *m = &mods[mod_of[s]];
        segs[s] = (qt_cuda_lora_segment){
            .row0 = row0[s],
            .rows = nrows[s],
            .a = m->a.dense,
            .b = m->b.dense,
            .a_kind = m->m.a.kind,
            .b_kind = m->m.b.kind,
            .rank = (int32_t)m->m.a.rows,
            .scale = user[s] * m->m.scale, /* f32, as eng_lora_apply forms it */
        };
        seg_mods[s] = m;
    }
    float *y = malloc((size_t)(total_rows * out) * sizeof *y);
    float *y1 = malloc((size_t)(total_rows * out) * sizeof *y1);
    if (sgmv_run(&su, name, segs, N_SEGS, y) &&
        sgmv_check_rows(&su, name, y, segs, seg_mods, user, N_SEGS) &&
        sgmv_check_untouched(&su, name, y, segs, N_SEGS))
        pass(name);

    /* each segment alone: the same bits as in the batch */
    const char *alone = "sgmv_segment_alone_gives_the_batch_bits";
    bool same = true;
    for (int s = 0; same && s < N_SEGS; s++) {
        if (!sgmv_run(&su, alone, &segs[s], 1, y1)) {
            same = false;
            break;
        }
        for (int64_t i = 0; i < segs[s].rows; i++) {
            int64_t r = segs[s].row0 + i;
            if (memcmp(y1 + r * out, y + r * out, (size_t)out * sizeof(float)) != 0) {
                fail(alone, "segment %d row %lld differs run alone", s, (long long)r);
                same = false;
                break;
            }
        }
    }
    if (same)
        pass(alone);

    /* a segment the kernels cannot apply: its rows become NaN, the others
     * are applied as usual */
    const char *bad = "sgmv_bad_segment_poisons_its_rows";
    qt_cuda_lora_segment bsegs[2] = {segs[1], segs[2]};
    bsegs[0].rank = 65; /* > max_rank 64 */
    if (sgmv_run(&su, bad, bsegs, 2, y1)) {
        bool nan_ok = true;
        for (int64_t i = 0; nan_ok && i < bsegs[0].rows; i++)
            for (int64_t o = 0; nan_ok && o < out; o++)
                if (!isnan(y1[(bsegs[0].row0 + i) * out + o])) {
                    fail(bad, "row %lld output %lld is %g, not NaN", (long long)(bsegs[0].row0 + i),
                         (long long)o, (double)y1[(bsegs[0].row0 + i) * out + o]);
                    nan_ok = false;
                }
        for (int64_t i = 0; nan_ok && i < bsegs[1].rows; i++) {
            int64_t r = bsegs[1].row0 + i;
            if (memcmp(y1 + r * out, y + r * out, (size_t)out * sizeof(float)) != 0) {
                fail(bad, "the good segment's row %lld differs", (long long)r);
                nan_ok = false;
            }
        }
        if (nan_ok)
            pass(bad);
    }
    free(y);
    free(y1);
    sgmv_setup_free(&su);
    for (int i = 0; i < N_MODS; i++)
        module_free(&mods[i]);
}

/* A model-sized one: in 4096, out 11008, rank 16, bf16, 8 rows + 1 row. */
static void test_sgmv_large(void)
{
    const char *name = "sgmv_4096_to_11008_rank_16";
    const int64_t in = 4096, out = 11008, total_rows = 9;
    test_module m[2];
    memset(m, 0, sizeof m);
    if (!module_new(&m[0], name, 16, out, in, QT_BF16, QT_BF16, 2.0f, 900) ||
        !module_new(&m[1], name, 64, out, in, QT_F16, QT_F16, 0.5f, 901)) {
        module_free(&m[0]);
        module_free(&m[1]);
        return;
    }
    sgmv_setup su;
    if (sgmv_setup_new(&su, name, in, out, total_rows, 64, 2, 11)) {
        qt_cuda_lora_segment segs[2];
        const test_module *seg_mods[2] = {&m[0], &m[1]};
        float user[2] = {1.0f, 0.8f};
        for (int s = 0; s < 2; s++)
            segs[s] = (qt_cuda_lora_segment){.row0 = s ? 8 : 0,
                                             .rows = s ? 1 : 8,
                                             .a = m[s].a.dense,
                                             .b = m[s].b.dense,
                                             .a_kind = m[s].m.a.kind,
                                             .b_kind = m[s].m.b.kind,
                                             .rank = (int32_t)m[s].m.a.rows,
                                             .scale = user[s] * m[s].m.scale};
        float *y = malloc((size_t)(total_rows * out) * sizeof *y);
        if (sgmv_run(&su, name, segs, 2, y) &&
            sgmv_check_rows(&su, name, y, segs, seg_mods, user, 2))
            pass(name);
        free(y);
    }
    sgmv_setup_free(&su);
    module_free(&m[0]);
    module_free(&m[1]);
}

/* ======================= merge =========================================== */

typedef struct merge_case {
    const char *name;
    qt_quant_params p;
    int64_t rows, cols;
} merge_case;

static const merge_case merge_cases[] = {
    {"nf4", {.kind = QT_NF4, .blocksize = 64}, 256, 512},
    {"nf4-dq", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}, 256, 512},
    {"nf4-b4096-short", {.kind = QT_NF4, .blocksize = 4096}, 63, 96},
    {"nf4-odd-count", {.kind = QT_NF4, .blocksize = 64}, 33, 35},
    {"nf4-dq-5-nested-blocks", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}, 300, 256},
    {"fp4", {.kind = QT_FP4, .blocksize = 128}, 256, 512},
    {"fp4-dq", {.kind = QT_FP4, .blocksize = 64, .double_quant = true}, 128, 256},
    /* engine/model/loader.c's --quant int4: torchao int4 weight-only */
    {"int4-g64-asym",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 64, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f},
     256,
     512},
    {"int4-g64-sym", {.kind = QT_AFFINE, .bits = 4, .group_size = 64, .symmetric = true}, 256, 512},
    /* engine/model/loader.c's --quant int8: torchao int8 weight-only, per channel */
    {"int8", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, 256, 512},
    {"int8-asym-int-g32",
     {.kind = QT_AFFINE,
      .bits = 8,
      .group_size = 32,
      .zero_domain = QT_ZERO_INT,
      .qmin = -128,
      .qmax = 127},
     128,
     256},
    {"int4-channel-odd-cols",
     {.kind = QT_AFFINE, .bits = 4, .zero_domain = QT_ZERO_FLOAT, .eps = 1e-6f},
     17,
     35},
    {"q4_0", {.kind = QT_Q4_0}, 256, 512},
    {"q4_1", {.kind = QT_Q4_1}, 256, 512},
    {"q8_0", {.kind = QT_Q8_0}, 256, 512},
    /* whole ggml blocks on the device (22 and 24 bytes) */
    {"q5_0", {.kind = QT_Q5_0}, 256, 512},
    {"q5_1", {.kind = QT_Q5_1}, 37, 96},
    /* the k-quants, requantized by llama.cpp's reference quantizers: a
     * thread per 256-block, slow under the emulator, so few blocks */
    {"q4_k", {.kind = QT_Q4_K}, 4, 512},
    {"q5_k", {.kind = QT_Q5_K}, 4, 512},
    {"q6_k", {.kind = QT_Q6_K}, 4, 512},
    {"q2_k", {.kind = QT_Q2_K}, 3, 256},
    {"q3_k", {.kind = QT_Q3_K}, 3, 256},
    /* IQ4_NL (blocks of 32) and IQ4_XS (256), the same way */
    {"iq4_nl", {.kind = QT_IQ4_NL}, 4, 256},
    {"iq4_xs", {.kind = QT_IQ4_XS}, 4, 256},
    /* MXFP4 (blocks of 32, quantize_row_mxfp4_ref's rule) */
    {"mxfp4", {.kind = QT_MXFP4}, 4, 256},
    {"bf16", {.kind = QT_BF16}, 256, 512},
    {"f16", {.kind = QT_F16}, 256, 512},
    {"f32", {.kind = QT_F32}, 256, 512},
};
#define N_MERGE_CASES (sizeof merge_cases / sizeof *merge_cases)

/* The first byte where two arrays differ, or -1. */
static int64_t first_diff(const void *a, const void *b, size_t n)
{
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return (int64_t)i;
    return -1;
}

static bool same_array(const char *name, const char *what, const void *dev, const void *cpu,
                       size_t n, size_t elem)
{
    int64_t i = first_diff(dev, cpu, n);
    if (i < 0)
        return true;
    const uint8_t *d = dev, *c = cpu;
    if (elem == 4) {
        float fd, fc;
        memcpy(&fd, d + (i / 4) * 4, 4);
        memcpy(&fc, c + (i / 4) * 4, 4);
        fail(name, "%s differ at element %lld of %zu: device %a, CPU %a", what, (long long)(i / 4),
             n / 4, (double)fd, (double)fc);
    } else {
        fail(name, "%s differ at byte %lld of %zu: device 0x%02x, CPU 0x%02x", what, (long long)i,
             n, d[i], c[i]);
    }
    return false;
}

/* Every byte of a host tensor of t's layout: t's codes and quant state. */
static bool same_tensor(const char *name, const qtensor *dev, const qtensor *cpu)
{
    if (!same_array(name, "codes", dev->data, cpu->data, cpu->data_bytes,
                    cpu->kind == QT_F32 ? 4 : 1))
        return false;
    if (cpu->kind == QT_NF4 || cpu->kind == QT_FP4) {
        if (!cpu->nested)
            return same_array(name, "absmax", dev->absmax, cpu->absmax,
                              (size_t)cpu->n_blocks * sizeof(float), 4);
        return same_array(name, "nested offset", &dev->nested_offset, &cpu->nested_offset,
                          sizeof(float), 4) &&
               same_array(name, "absmax codes", dev->absmax_codes, cpu->absmax_codes,
                          (size_t)cpu->n_blocks, 1) &&
               same_array(name, "nested absmax", dev->nested_absmax, cpu->nested_absmax,
                          (size_t)cpu->n_nested_blocks * sizeof(float), 4) &&
               same_array(name, "nested code", dev->nested_code, cpu->nested_code,
                          sizeof cpu->nested_code, 4) &&
               same_array(name, "codebook", dev->codebook, cpu->codebook, sizeof cpu->codebook, 4);
    }
    if (cpu->kind == QT_AFFINE) {
        size_t ng = (size_t)(cpu->rows * cpu->groups_per_row) * sizeof(float);
        return same_array(name, "scales", dev->scales, cpu->scales, ng, 4) &&
               same_array(name, "zeros", dev->zeros, cpu->zeros, ng, 4);
    }
    return true;
}

/* A host tensor laid out as t, every array filled with 0xa5, to download
 * into: a byte the device never wrote cannot match. */
static bool poisoned_like(const char *name, const qtensor *t, qtensor *out)
{
    if (qt_clone(out, t) != QL_OK) {
        fail(name, "qt_clone failed");
        return false;
    }
    memset(out->data, 0xa5, out->data_bytes);
    if (out->absmax)
        memset(out->absmax, 0xa5, (size_t)out->n_blocks * sizeof(float));
    if (out->absmax_codes)
        memset(out->absmax_codes, 0xa5, (size_t)out->n_blocks);
    if (out->nested_absmax)
        memset(out->nested_absmax, 0xa5, (size_t)out->n_nested_blocks * sizeof(float));
    if (out->nested) {
        memset(&out->nested_offset, 0xa5, sizeof out->nested_offset);
        memset(out->nested_code, 0xa5, sizeof out->nested_code);
    }
    if (out->scales)
        memset(out->scales, 0xa5, (size_t)(out->rows * out->groups_per_row) * sizeof(float));
    if (out->zeros)
        memset(out->zeros, 0xa5, (size_t)(out->rows * out->groups_per_row) * sizeof(float));
    return true;
}

static bool close_to(double dev, double cpu)
{
    if (isinf(cpu) || isinf(dev))
        return dev == cpu;
    return fabs(dev - cpu) <= 1e-9 * fabs(cpu) + 1e-300;
}

static bool same_cost(const char *name, const qt_cuda_merge_report *r, const lora_cost *c)
{
    struct {
        const char *what;
        double dev, cpu;
    } f[5] = {
        {"dot", r->dot, c->dot},
        {"delta_sq", r->delta_sq, c->delta_sq},
        {"err_sq", r->err_sq, c->err_sq},
        {"delta_retained", r->delta_retained, c->delta_retained},
        {"relative_error", r->relative_error, c->relative_error},
    };
    for (int i = 0; i < 5; i++) {
        if (!close_to(f[i].dev, f[i].cpu)) {
            fail(name, "report %s: device %.17g, CPU %.17g", f[i].what, f[i].dev, f[i].cpu);
            return false;
        }
    }
    return true;
}

/* The terms of a merge, for both sides. */
typedef struct merge_terms {
    int n;
    test_module mods[3];
    lora_part parts[3];
    qt_cuda_lora_term terms[3];
} merge_terms;

static bool merge_terms_new(merge_terms *mt, const char *name, int n, int64_t rows, int64_t cols,
                            uint64_t seed)
{
    memset(mt, 0, sizeof *mt);
    static const struct {
        int32_t rank;
        qt_kind a, b;
        float module_scale, user;
    } spec[3] = {
        {16, QT_F16, QT_BF16, 2.0f, 0.7f},
        {8, QT_F32, QT_F32, 0.5f, 1.3f},
        {4, QT_BF16, QT_F16, 0.3f, 0.0f}, /* scale 0: contributes +0.0 */
    };
    for (int i = 0; i < n; i++) {
        if (!module_new(&mt->mods[i], name, spec[i].rank, rows, cols, spec[i].a, spec[i].b,
                        spec[i].module_scale, seed + (uint64_t)i)) {
            mt->n = i + 1;
            return false;
        }
        mt->parts[i] =
            (lora_part){.adapter = "test", .module = &mt->mods[i].m, .scale = spec[i].user};
        mt->terms[i] = (qt_cuda_lora_term){.a = mt->mods[i].a.dense,
                                           .b = mt->mods[i].b.dense,
                                           .a_kind = spec[i].a,
                                           .b_kind = spec[i].b,
                                           .rank = spec[i].rank,
                                           .scale = spec[i].user,
                                           .module_scale = spec[i].module_scale};
    }
    mt->n = n;
    return true;
}

static void merge_terms_free(merge_terms *mt)
{
    for (int i = 0; i < mt->n; i++)
        module_free(&mt->mods[i]);
}

/*
 * CPU merge and device merge of the same pristine tensor and terms; the
 * downloaded device result compared byte for byte, the report to 1e-9.
 * With `unmerge`, releasing the merged tensor must leave the pristine
 * device tensor's download equal to the host original. Returns the device
 * merge's milliseconds (or -1 on failure).
 */
static double merge_and_compare(const char *name, const qtensor *pristine, merge_terms *mt,
                                bool unmerge)
{
    char msg[512] = "";
    const lora_ops *ops = NULL;
    if (lora_dispatch(pristine, &ops, msg, sizeof msg) != QL_OK) {
        fail(name, "lora_dispatch: %s", msg);
        return -1;
    }
    qtensor cpu_merged;
    lora_cost cost;
    int rc = ops->merge(pristine, mt->parts, (size_t)mt->n, NULL, "test", &cpu_merged, &cost, msg,
                        sizeof msg);
    if (rc != QL_OK) {
        fail(name, "the CPU merge failed (%d): %s", rc, msg);
        return -1;
    }
    double ms = -1;
    qt_cuda_tensor dp, dout;
    memset(&dout, 0, sizeof dout);
    rc = qt_cuda_tensor_upload(pristine, &dp, msg, sizeof msg);
    if (rc != QL_OK) {
        fail(name, "upload: %s", msg);
        qt_free(&cpu_merged);
        return -1;
    }
    qt_cuda_merge_report rep;
    double t0 = now_ms();
    rc = qt_cuda_merge(&dp, mt->terms, mt->n, &dout, &rep, NULL, msg, sizeof msg);
    double t1 = now_ms();
    qtensor got;
    memset(&got, 0, sizeof got);
    if (rc != QL_OK) {
        fail(name, "qt_cuda_merge returned %d: %s", rc, msg);
    } else if (poisoned_like(name, &cpu_merged, &got)) {
        rc = qt_cuda_tensor_download(&dout, &got, msg, sizeof msg);
        if (rc != QL_OK)
            fail(name, "download of the merged tensor: %s", msg);
        else if (same_tensor(name, &got, &cpu_merged) && same_cost(name, &rep, &cost))
            ms = t1 - t0;
    }
    qt_free(&got);
    if (qt_cuda_tensor_release(&dout, msg, sizeof msg) != QL_OK) {
        fail(name, "releasing the merged tensor: %s", msg);
        ms = -1;
    }
    if (unmerge && ms >= 0) {
        /* unmerging is releasing the merged tensor: the pristine one is
         * as uploaded */
        char uname[200];
        const char *what = strchr(name, ' '); /* the kind and shape in the merge's name */
        snprintf(uname, sizeof uname, "unmerge_leaves_pristine_bit_for_bit%s", what ? what : "");
        qtensor back;
        if (poisoned_like(uname, pristine, &back)) {
            rc = qt_cuda_tensor_download(&dp, &back, msg, sizeof msg);
            if (rc != QL_OK)
                fail(uname, "download of the pristine tensor: %s", msg);
            else if (same_tensor(uname, &back, pristine))
                pass(uname);
            qt_free(&back);
        }
    }
    qt_cuda_tensor_release(&dp, NULL, 0);
    qt_free(&cpu_merged);
    return ms;
}

static bool quantize_weight(const char *name, const qt_quant_params *p, int64_t rows, int64_t cols,
                            uint64_t seed, qtensor *w)
{
    uint64_t s = seed;
    float *v = normal_values(&s, rows * cols, 0.02);
    char msg[256];
    int rc = qt_quantize(w, v, rows, cols, p, msg, sizeof msg);
    free(v);
    if (rc != QL_OK)
        fail(name, "qt_quantize: %s", msg);
    return rc == QL_OK;
}

static void test_merge_kinds(void)
{
    for (size_t k = 0; k < N_MERGE_CASES; k++) {
        const merge_case *mc = &merge_cases[k];
        qtensor w;
        if (!quantize_weight(mc->name, &mc->p, mc->rows, mc->cols, 1000 + k, &w))
            continue;
        for (int n_terms = 3; n_terms >= 0; n_terms -= 3) {
            char name[160];
            snprintf(name, sizeof name, "merge_byte_identical_to_cpu %s %lldx%lld %d terms",
                     mc->name, (long long)mc->rows, (long long)mc->cols, n_terms);
            merge_terms mt;
            if (merge_terms_new(&mt, name, n_terms, mc->rows, mc->cols, 50 + k) &&
                merge_and_compare(name, &w, &mt, n_terms > 0) >= 0)
                pass(name);
            merge_terms_free(&mt);
        }
        qt_free(&w);
    }
}

/* A NaN in B: refused like the CPU, naming its first element; nothing
 * allocated stays. A pristine weight that is not finite: named as such. */
static void test_merge_refuses_nonfinite(void)
{
    const char *name = "merge_refuses_nan_in_b_and_leaks_nothing";
    qt_quant_params p = {.kind = QT_NF4, .blocksize = 64};
    qtensor w;
    merge_terms mt;
    if (!quantize_weight(name, &p, 256, 512, 77, &w))
        return;
    if (!merge_terms_new(&mt, name, 2, 256, 512, 78)) {
        merge_terms_free(&mt);
        qt_free(&w);
        return;
    }
    /* B of the second term (f32, [256][8]): row 5, k 3 */
    float nan = NAN;
    ((float *)mt.mods[1].m.b.data)[5 * 8 + 3] = nan;
    char msg[512] = "", cpu_msg[512] = "";
    bool ok = cuda_ok(name,
                      cudaMemcpy((float *)mt.mods[1].b.dense + 5 * 8 + 3, &nan, sizeof nan,
                                 cudaMemcpyHostToDevice),
                      "poisoning B");
    const lora_ops *ops = NULL;
    qtensor cpu_merged;
    lora_cost cost;
    int cpu_rc = QL_OK;
    if (ok && lora_dispatch(&w, &ops, msg, sizeof msg) == QL_OK)
        cpu_rc =
            ops->merge(&w, mt.parts, 2, NULL, "test", &cpu_merged, &cost, cpu_msg, sizeof cpu_msg);
    if (ok && cpu_rc != QL_ENONFINITE) {
        fail(name, "the CPU merge gave %d, not QL_ENONFINITE", cpu_rc);
        ok = false;
    }
    qt_cuda_tensor dp;
    memset(&dp, 0, sizeof dp);
    if (ok && qt_cuda_tensor_upload(&w, &dp, msg, sizeof msg) != QL_OK) {
        fail(name, "upload: %s", msg);
        ok = false;
    }
    size_t free0 = 0, free1 = 0, total = 0;
    ok = ok && cuda_ok(name, cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
    for (int rep_i = 0; ok && rep_i < 3; rep_i++) {
        qt_cuda_tensor out;
        memset(&out, 0x5a, sizeof out);
        qt_cuda_merge_report rep;
        int rc = qt_cuda_merge(&dp, mt.terms, 2, &out, &rep, NULL, msg, sizeof msg);
        qt_cuda_tensor zero;
        memset(&zero, 0, sizeof zero);
        if (rc != QL_ENONFINITE) {
            fail(name, "qt_cuda_merge gave %d (%s), not QL_ENONFINITE", rc, msg);
            ok = false;
        } else if (!strstr(msg, "(row 5, col 0)") || !strstr(cpu_msg, "(row 5, col 0)") ||
                   !strstr(msg, "term 1")) {
            fail(name, "messages should name (row 5, col 0) and term 1: device \"%s\", CPU \"%s\"",
                 msg, cpu_msg);
            ok = false;
        } else if (memcmp(&out, &zero, sizeof out) != 0) {
            fail(name, "the refused merge left *out not zeroed");
            ok = false;
        }
    }
    ok = ok && cuda_ok(name, cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
    if (ok && free1 + (2u << 20) < free0) {
        fail(name, "device memory free went from %zu to %zu bytes over 3 refused merges", free0,
             free1);
        ok = false;
    }
    if (ok)
        pass(name);
    qt_cuda_tensor_release(&dp, NULL, 0);
    merge_terms_free(&mt);
    qt_free(&w);

    /* the pristine weight itself not finite (f32 from raw values) */
    const char *name2 = "merge_names_a_nonfinite_pristine_weight";
    float *v = calloc(64 * 96, sizeof *v);
    v[2 * 96 + 7] = INFINITY;
    qtensor pw;
    qt_cuda_tensor dpw;
    if (qt_from_dense(&pw, QT_F32, v, 64, 96, msg, sizeof msg) != QL_OK) {
        fail(name2, "qt_from_dense: %s", msg);
    } else {
        if (qt_cuda_tensor_upload(&pw, &dpw, msg, sizeof msg) != QL_OK) {
            fail(name2, "upload: %s", msg);
        } else {
            qt_cuda_tensor out;
            int rc = qt_cuda_merge(&dpw, NULL, 0, &out, NULL, NULL, msg, sizeof msg);
            if (rc != QL_ENONFINITE || !strstr(msg, "pristine weight at (row 2, col 7)"))
                fail(name2, "got %d: \"%s\"", rc, msg);
            else
                pass(name2);
            qt_cuda_tensor_release(&dpw, NULL, 0);
        }
        qt_free(&pw);
    }
    free(v);
}

/* NF4 4096x4096 and 11008x4096 at rank 16: compared with the CPU, timed. */
static void test_merge_timing(void)
{
    static const struct {
        const char *kind;
        qt_quant_params p;
        int64_t rows, cols;
    } big[] = {
        {"nf4", {.kind = QT_NF4, .blocksize = 64}, 4096, 4096},
        {"nf4", {.kind = QT_NF4, .blocksize = 64}, 11008, 4096},
        {"nf4-dq", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}, 4096, 4096},
    };
    for (size_t i = 0; i < sizeof big / sizeof *big; i++) {
        char name[160];
        snprintf(name, sizeof name, "merge_byte_identical_to_cpu %s %lldx%lld rank 16", big[i].kind,
                 (long long)big[i].rows, (long long)big[i].cols);
        qtensor w;
        if (!quantize_weight(name, &big[i].p, big[i].rows, big[i].cols, 4242 + i, &w))
            continue;
        merge_terms mt;
        if (merge_terms_new(&mt, name, 1, big[i].rows, big[i].cols, 4343 + i)) {
            double ms = merge_and_compare(name, &w, &mt, false);
            if (ms >= 0) {
                pass(name);
                printf("timing merge %s %lldx%lld rank 16: %.2f ms\n", big[i].kind,
                       (long long)big[i].rows, (long long)big[i].cols, ms);
            }
        }
        merge_terms_free(&mt);
        qt_free(&w);
    }
}

/* Every GGUF kind now has a requantizer on the CPU to match (llama.cpp's
 * reference quantizers, the k-quants and IQ4 included), so the device
 * merges into each one's own kind: qt_cuda_merge_requantizes says so for
 * every GGUF kind and for every kind test_merge_kinds merges. */
static void test_merge_requantizes_every_gguf_kind(void)
{
    const char *name = "merge_requantizes_every_gguf_kind";
    bool all = true;
    for (int k = 0; k < QT_KIND_COUNT; k++)
        if (qt_traits_table[k].is_gguf && !qt_cuda_merge_requantizes((qt_kind)k)) {
            fail(name, "%s says no", qt_kind_name((qt_kind)k));
            all = false;
        }
    if (all)
        pass(name);
    all = true;
    for (size_t k = 0; k < N_MERGE_CASES; k++)
        all = all && qt_cuda_merge_requantizes(merge_cases[k].p.kind);
    if (all)
        pass("merge_requantizes_every_merged_kind");
    else
        fail("merge_requantizes_every_merged_kind", "a kind test_merge_kinds merges says no");
}

int main(void)
{
    int count = 0;
    char msg[512] = "";
    if (qt_cuda_device_count(&count, msg, sizeof msg) != QL_OK || count < 1) {
        printf("SKIP test_cuda_lora: no usable CUDA device (%s)\n", msg);
        return 77;
    }
    char desc[512];
    qt_cuda_describe(desc, sizeof desc);
    printf("# %s\n", desc);
    double t0 = now_ms();
    test_sgmv();
    test_sgmv_large();
    test_merge_kinds();
    test_merge_refuses_nonfinite();
    test_merge_requantizes_every_gguf_kind();
    if (!emulated())
        test_merge_timing();
    printf("# %d failure(s), %.1f s\n", failures, (now_ms() - t0) / 1e3);
    return failures ? 1 : 0;
}

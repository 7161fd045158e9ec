/*
 * test_cuda_matmul.c - the CUDA matrix products (fused matvec, cuBLASLt
 * gemm in f32 and bf16), the row gather, and device tensors (upload,
 * download, alloc_like) against the CPU, for every kind of qtensor.h.
 *
 * Why shaped so: like test_cuda_dequant, a plain C program run by
 * tests/gpu/run.sh on a GPU machine, one line per case so a remote log
 * reads on its own. The weights are quantized on the CPU (qt_quantize; the
 * kinds read in place only, which have no quantizer yet, are random
 * blocks) and
 * their dequantized values W (qt_dequantize_rows, exact f32) are the
 * truth the products are measured against, so quantization error never
 * enters a comparison:
 *   - y64 = x @ W^T summed in f64, and A = sum |x| |W| per output (the
 *     scale rounding errors are proportional to, whatever cancels);
 *   - f32 paths (matvec, gemm F32): |y - y64| <= k * FLT_EPSILON *
 *     sqrt(cols) * A, k = 8 for the matvec, 16 for the gemm. Summing n
 *     products in f32 makes an error of about eps * sqrt(n) * A when the
 *     roundings are independent (the worst case n * eps * A never happens
 *     with random data); the factor leaves room for the order of summation.
 *     A missing or wrongly scaled 32-element chunk changes y by about
 *     sqrt(32) / cols * A, 20x more than the bound at 4096 columns;
 *   - the matvec also against the CPU's qt_matmul (f32), with twice the
 *     bound (both sides round), at batches 1..8 (the warp-per-rows
 *     kernels) and 9..32 (the tile kernel: each bucket's smallest and
 *     largest batch on every shape, all of 1..32 on 77 x 96);
 *   - gemm BF16: against y64 of bf16-rounded x and W (what the tensor cores
 *     multiply; their products are exact in f32) with k = 32, and against
 *     the true y64 with 1e-2 * A (bf16 keeps 8 bits: each product is off by
 *     at most about 2^-8 of itself).
 * Outputs are poisoned with NaN (0xFF bytes) before each run and a guard
 * after the end is checked, so an element not written, or written past the
 * end, fails. The gather must equal qt_dequantize_rows bit for bit, and a
 * download must give back the uploaded bytes exactly.
 *
 * Exit status: 0 all passed; 1 a case failed; 77 no usable CUDA device.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_test_util.h"
#include "qt_cuda_ops.h"
#include "qtensor.h"

#define MSG_LEN 512
#define GUARD   16 /* floats after each output that must stay NaN */

static int passes, failures;

static void report(const char *name, int ok, const char *detail)
{
    if (ok)
        printf("PASS %s%s%s\n", name, detail[0] ? "  " : "", detail);
    else
        printf("FAIL %s: %s\n", name, detail);
    fflush(stdout);
    if (ok)
        passes++;
    else
        failures++;
}

/* ---- inputs --------------------------------------------------------------- */

/* Weights like a trained layer: normal, rare outliers, some exact zeros,
 * and one all-zero row (zero absmax / scales). */
static float *random_weights(int64_t rows, int64_t cols)
{
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    if (!w)
        return NULL;
    for (int64_t i = 0; i < rows * cols; i++) {
        double scale = rng_uniform() < 0.002 ? 1.0 : 0.05;
        w[i] = rng_uniform() < 0.01 ? 0.0f : (float)(rng_normal() * scale);
    }
    if (rows > 2)
        memset(w + cols, 0, (size_t)cols * sizeof *w);
    return w;
}

/* ---- the kinds and shapes -------------------------------------------------- */

typedef struct wkind {
    const char *name;
    qt_quant_params p;
    int any_cols; /* takes a column count that is not a multiple of 32 */
} wkind;

static const wkind kinds[] = {
    {"f32", {.kind = QT_F32}, 1},
    {"f16", {.kind = QT_F16}, 1},
    {"bf16", {.kind = QT_BF16}, 1},
    {"nf4", {.kind = QT_NF4, .blocksize = 64}, 1},
    {"nf4-dq", {.kind = QT_NF4, .blocksize = 64, .double_quant = true}, 1},
    {"fp4", {.kind = QT_FP4, .blocksize = 64}, 1},
    {"fp4-dq-bs4096", {.kind = QT_FP4, .blocksize = 4096, .double_quant = true}, 1},
    {"int4-fzero-g32",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 32, .zero_domain = QT_ZERO_FLOAT},
     0},
    {"int4-izero-g64",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 64, .zero_domain = QT_ZERO_INT},
     0},
    {"int4-sym-g128", {.kind = QT_AFFINE, .bits = 4, .group_size = 128, .symmetric = true}, 0},
    /* a group that splits a 32-value chunk: the generic kernel */
    {"int4-fzero-g16",
     {.kind = QT_AFFINE, .bits = 4, .group_size = 16, .zero_domain = QT_ZERO_FLOAT},
     0},
    {"int8-sym-perchannel", {.kind = QT_AFFINE, .bits = 8, .symmetric = true}, 1},
    {"int8-asym-signed-perchannel",
     {.kind = QT_AFFINE, .bits = 8, .zero_domain = QT_ZERO_INT, .qmin = -128, .qmax = 127},
     1},
    {"int8-fzero-g32",
     {.kind = QT_AFFINE, .bits = 8, .group_size = 32, .zero_domain = QT_ZERO_FLOAT},
     0},
    {"q4_0", {.kind = QT_Q4_0}, 0},
    {"q4_1", {.kind = QT_Q4_1}, 0},
    {"q8_0", {.kind = QT_Q8_0}, 0},
    /* kept in whole ggml blocks on the device: the piece kernel */
    {"q5_0", {.kind = QT_Q5_0}, 0},
    {"q5_1", {.kind = QT_Q5_1}, 0},
    {"mxfp4", {.kind = QT_MXFP4}, 0},
    /* random blocks (read in place only: no quantizer yet); shapes whose
     * columns are whole blocks (256; IQ4_NL 32) only */
    {"q4_k", {.kind = QT_Q4_K}, 0},
    {"q5_k", {.kind = QT_Q5_K}, 0},
    {"q6_k", {.kind = QT_Q6_K}, 0},
    {"q2_k", {.kind = QT_Q2_K}, 0},
    {"q3_k", {.kind = QT_Q3_K}, 0},
    {"iq4_nl", {.kind = QT_IQ4_NL}, 0},
    {"iq4_xs", {.kind = QT_IQ4_XS}, 0},
};
#define N_KINDS (sizeof kinds / sizeof kinds[0])

/* Shapes, and the batches each runs (the f64 references cost rows * cols
 * * batch on the CPU, so the largest batches go with the smaller shapes).
 * 576 and 1536 x 576 are SmolLM2's; 77 x 96 is ragged in rows; 64 x 4096
 * has long rows; 37 x 45 and 33 x 100 have columns that are not a multiple
 * of 32 (the generic kernel) for the kinds that allow them; 37 x 512 is a
 * second shape of whole 256-blocks for the kinds read in place. */
typedef struct shape {
    int64_t rows, cols;
    int gemm_batches[4];
    int n_gemm;
    int ragged;
} shape;

static const shape shapes[] = {
    {576, 576, {9, 17, 64, 300}, 4, 0},
    {1536, 576, {9, 64}, 2, 0},
    {77, 96, {9, 17, 64, 300}, 4, 0},
    {64, 4096, {9, 17}, 2, 0},
    {37, 45, {9, 300}, 2, 1},
    {33, 100, {17}, 1, 1},
    {37, 512, {9}, 1, 0},
};
#define N_SHAPES (sizeof shapes / sizeof shapes[0])

/* The matvec's batches: the warp-per-rows kernels (1..8) and the tile
 * kernel's (9..32), the smallest and largest of each of its batch sizes
 * (16, 24, 32); every batch from 1 to 32 on the shape of all_batches_on. */
static const int matvec_batches[] = {1, 2, 3, 8, 9, 16, 17, 24, 25, 32};
#define N_MATVEC     10
#define MATVEC_MAX   QT_CUDA_MATVEC_MAX_BATCH
#define MATMUL_ON    32 /* run through qt_cuda_matmul, which must take the matvec */
#define UNALIGNED_ON 19 /* above 8: the generic kernel in passes of 8 rows */
static const shape *all_batches_on = &shapes[2];

/* ---- device helpers -------------------------------------------------------- */

static int dev_alloc(void **p, size_t bytes)
{
    *p = NULL;
    return cudaMalloc(p, bytes) == cudaSuccess ? 0 : -1;
}

/* NaN in every byte pattern: 0xFFFFFFFF. */
static int poison(void *p, size_t bytes)
{
    return cudaMemset(p, 0xff, bytes) == cudaSuccess ? 0 : -1;
}

static int is_poison(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u == 0xffffffffu;
}

static uint16_t bf16_round(float f)
{
    return qt_f32_to_bf16(f);
}

/* ---- references ------------------------------------------------------------ */

typedef struct refs {
    int64_t batch, rows, cols;
    double *y64, *abs64;     /* [batch][rows] */
    double *y64bf, *abs64bf; /* bf16-rounded x and W */
} refs;

static void free_refs(refs *r)
{
    free(r->y64);
    free(r->abs64);
    free(r->y64bf);
    free(r->abs64bf);
    memset(r, 0, sizeof *r);
}

static int make_refs(refs *r, const float *w, const float *x, int64_t batch, int64_t rows,
                     int64_t cols, int with_bf16)
{
    memset(r, 0, sizeof *r);
    r->batch = batch;
    r->rows = rows;
    r->cols = cols;
    size_t n = (size_t)(batch * rows);
    r->y64 = malloc(n * sizeof(double));
    r->abs64 = malloc(n * sizeof(double));
    if (with_bf16) {
        r->y64bf = malloc(n * sizeof(double));
        r->abs64bf = malloc(n * sizeof(double));
    }
    if (!r->y64 || !r->abs64 || (with_bf16 && (!r->y64bf || !r->abs64bf)))
        return -1;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t o = 0; o < rows; o++) {
            const float *xb = x + b * cols, *wr = w + o * cols;
            double s = 0, a = 0;
            for (int64_t c = 0; c < cols; c++) {
                double p = (double)xb[c] * (double)wr[c];
                s += p;
                a += fabs(p);
            }
            r->y64[b * rows + o] = s;
            r->abs64[b * rows + o] = a;
        }
    if (!with_bf16)
        return 0;
    float *xbf = malloc((size_t)(batch * cols) * sizeof *xbf);
    float *wbf = malloc((size_t)(rows * cols) * sizeof *wbf);
    if (!xbf || !wbf) {
        free(xbf);
        free(wbf);
        return -1;
    }
    for (int64_t i = 0; i < batch * cols; i++)
        xbf[i] = qt_bf16_to_f32(bf16_round(x[i]));
    for (int64_t i = 0; i < rows * cols; i++)
        wbf[i] = qt_bf16_to_f32(bf16_round(w[i]));
    for (int64_t b = 0; b < batch; b++)
        for (int64_t o = 0; o < rows; o++) {
            const float *xb = xbf + b * cols, *wr = wbf + o * cols;
            double s = 0, a = 0;
            for (int64_t c = 0; c < cols; c++) {
                double p = (double)xb[c] * (double)wr[c];
                s += p;
                a += fabs(p);
            }
            r->y64bf[b * rows + o] = s;
            r->abs64bf[b * rows + o] = a;
        }
    free(xbf);
    free(wbf);
    return 0;
}

/*
 * Check got [batch][rows] (+ GUARD poisoned floats) against want within
 * k * A per element (k_bound * A[i] + 1e-30). Returns 0 or -1 with detail;
 * *worst gets the largest error / bound seen.
 */
static int check_output(const float *got, int64_t batch, int64_t rows, const double *want,
                        const double *a, double k_bound, const char *against, double *worst,
                        char *detail, size_t detail_len)
{
    const int64_t n = batch * rows;
    for (int64_t i = 0; i < n; i++) {
        const double bound = k_bound * a[i] + 1e-30;
        const double err = fabs((double)got[i] - want[i]);
        if (!(err <= bound)) { /* NaN fails too */
            snprintf(detail, detail_len,
                     "b=%lld row %lld: got %.9g, %s %.9g, |err| %.3g > bound %.3g (sum|xw| %.4g)",
                     (long long)(i / rows), (long long)(i % rows), (double)got[i], against, want[i],
                     err, bound, a[i]);
            return -1;
        }
        if (err / bound > *worst)
            *worst = err / bound;
    }
    for (int64_t i = n; i < n + GUARD; i++)
        if (!is_poison(got[i])) {
            snprintf(detail, detail_len, "wrote past the end: element %lld of the guard",
                     (long long)(i - n));
            return -1;
        }
    return 0;
}

/* ---- one weight: every check ---------------------------------------------- */

typedef struct ctx {
    qt_cuda_blas *blas_f32, *blas_bf16;
    float *x_dev;  /* max batch x max cols, 16-byte aligned */
    float *x_unal; /* the same + 1 float: not 16-byte aligned */
    float *y_dev;  /* max batch x max rows + GUARD */
    int32_t *ids_dev;
    float *y_host;
} ctx;

#define MAX_BATCH 300
#define MAX_ROWS  1536
#define MAX_COLS  4096

static void name_of(char *buf, size_t len, const char *op, const wkind *k, const shape *s)
{
    snprintf(buf, len, "%s %s %lldx%lld", op, k->name, (long long)s->rows, (long long)s->cols);
}

/* Run matvec (or gemm) into the poisoned y_dev and copy y back. */
static int run_product(ctx *c, const char *op, const qt_cuda_tensor *d, const float *x_dev,
                       int64_t batch, char *detail, size_t detail_len)
{
    char msg[MSG_LEN] = "";
    const size_t y_bytes = (size_t)(batch * d->rows + GUARD) * sizeof(float);
    if (poison(c->y_dev, y_bytes) != 0) {
        snprintf(detail, detail_len, "cudaMemset poison failed");
        return -1;
    }
    int rc;
    if (!strcmp(op, "matvec"))
        rc = qt_cuda_matvec(d, x_dev, batch, c->y_dev, NULL, msg, sizeof msg);
    else if (!strcmp(op, "matmul"))
        rc = qt_cuda_matmul(c->blas_f32, d, x_dev, batch, c->y_dev, NULL, msg, sizeof msg);
    else
        rc = qt_cuda_gemm(!strcmp(op, "gemm-bf16") ? c->blas_bf16 : c->blas_f32, d, x_dev, batch,
                          c->y_dev, NULL, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, detail_len, "b=%lld: %s (%s)", (long long)batch, msg, ql_strerror(rc));
        return -1;
    }
    cudaError_t st = cudaDeviceSynchronize();
    if (st != cudaSuccess) {
        snprintf(detail, detail_len, "b=%lld: kernel failed: %s", (long long)batch,
                 cudaGetErrorString(st));
        return -1;
    }
    if (cudaMemcpy(c->y_host, c->y_dev, y_bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        snprintf(detail, detail_len, "cudaMemcpy of y failed");
        return -1;
    }
    return 0;
}

static void check_products(ctx *c, const wkind *k, const shape *s, const qtensor *t,
                           const qt_cuda_tensor *d, const float *x, const refs *r)
{
    char name[160], detail[MSG_LEN + 256] = "";
    const int64_t rows = s->rows, cols = s->cols;
    const double sq = sqrt((double)cols);

    /* matvec: batches 1..32 against f64 and the CPU's qt_matmul */
    float *y_cpu = malloc((size_t)(MATVEC_MAX * rows) * sizeof *y_cpu);
    double *y_cpu64 = malloc((size_t)(MATVEC_MAX * rows) * sizeof *y_cpu64);
    double worst = 0, worst_cpu = 0;
    int ok = y_cpu && y_cpu64;
    if (ok) {
        qt_matmul(t, x, MATVEC_MAX, y_cpu, 0, rows);
        for (int64_t i = 0; i < MATVEC_MAX * rows; i++)
            y_cpu64[i] = y_cpu[i];
    } else {
        snprintf(detail, sizeof detail, "host allocation failed");
    }
    const int every = s == all_batches_on;
    const int n_runs = every ? MATVEC_MAX : N_MATVEC;
    for (int bi = 0; ok && bi < n_runs; bi++) {
        const int64_t batch = every ? bi + 1 : matvec_batches[bi];
        const char *op = batch == MATMUL_ON ? "matmul" : "matvec";
        if (run_product(c, op, d, c->x_dev, batch, detail, sizeof detail) != 0 ||
            check_output(c->y_host, batch, rows, r->y64, r->abs64, 8.0 * FLT_EPSILON * sq, "f64",
                         &worst, detail, sizeof detail) != 0 ||
            check_output(c->y_host, batch, rows, y_cpu64, r->abs64, 16.0 * FLT_EPSILON * sq,
                         "cpu qt_matmul", &worst_cpu, detail, sizeof detail) != 0) {
            char tmp[MSG_LEN + 256];
            snprintf(tmp, sizeof tmp, "b=%lld %s", (long long)batch, detail);
            snprintf(detail, sizeof detail, "%s", tmp);
            ok = 0;
        }
    }
    name_of(name, sizeof name, "matvec", k, s);
    if (ok)
        snprintf(detail, sizeof detail, "b=%s worst err/bound %.3f (f64), %.3f (cpu)",
                 every ? "1..32" : "1,2,3,8,9,16,17,24,25,32", worst, worst_cpu);
    report(name, ok, detail);

    /* matvec with x not 16-byte aligned: the generic kernel, batch 3, and
     * batch 19 in passes of 8 rows */
    worst = 0;
    detail[0] = '\0';
    ok = 1;
    for (int64_t batch = 3; ok && batch <= UNALIGNED_ON; batch += UNALIGNED_ON - 3)
        ok = run_product(c, "matvec", d, c->x_unal, batch, detail, sizeof detail) == 0 &&
             check_output(c->y_host, batch, rows, r->y64, r->abs64, 8.0 * FLT_EPSILON * sq, "f64",
                          &worst, detail, sizeof detail) == 0;
    name_of(name, sizeof name, "matvec-unaligned-x", k, s);
    if (ok)
        snprintf(detail, sizeof detail, "b=3,%d worst err/bound %.3f", UNALIGNED_ON, worst);
    report(name, ok, detail);
    free(y_cpu);
    free(y_cpu64);

    /* gemm, F32 and BF16 modes; qt_cuda_matmul takes the gemm above 32 */
    for (int mode = 0; mode < 2; mode++) {
        const char *op = mode ? "gemm-bf16" : "gemm-f32";
        double worst_a = 0, worst_b = 0;
        ok = 1;
        detail[0] = '\0';
        char batches[64] = "";
        for (int gi = 0; ok && gi < s->n_gemm; gi++) {
            const int64_t batch = s->gemm_batches[gi];
            snprintf(batches + strlen(batches), sizeof batches - strlen(batches), "%s%lld",
                     gi ? "," : "", (long long)batch);
            const char *run_op = !mode && batch > MATVEC_MAX ? "matmul" : op;
            if (run_product(c, run_op, d, c->x_dev, batch, detail, sizeof detail) != 0) {
                ok = 0;
                break;
            }
            int bad;
            if (!mode)
                bad = check_output(c->y_host, batch, rows, r->y64, r->abs64,
                                   16.0 * FLT_EPSILON * sq, "f64", &worst_a, detail, sizeof detail);
            else
                bad = check_output(c->y_host, batch, rows, r->y64bf, r->abs64bf,
                                   32.0 * FLT_EPSILON * sq, "f64 of bf16 x and W", &worst_a, detail,
                                   sizeof detail) ||
                      check_output(c->y_host, batch, rows, r->y64, r->abs64, 1e-2, "f64", &worst_b,
                                   detail, sizeof detail);
            if (bad) {
                char tmp[MSG_LEN + 256];
                snprintf(tmp, sizeof tmp, "b=%lld %s", (long long)batch, detail);
                snprintf(detail, sizeof detail, "%s", tmp);
                ok = 0;
            }
        }
        name_of(name, sizeof name, op, k, s);
        if (ok)
            snprintf(detail, sizeof detail, "b=%s worst err/bound %.3f%s", batches, worst_a,
                     mode ? " (vs bf16 inputs)" : "");
        report(name, ok, detail);
    }
}

/* Rows ids of t through qt_cuda_gather_rows equal qt_dequantize_rows. */
static void check_gather(ctx *c, const wkind *k, const shape *s, const qtensor *t,
                         const qt_cuda_tensor *d, const float *w)
{
    char name[160], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    const int64_t rows = s->rows, cols = s->cols;
    const int32_t ids[6] = {(int32_t)(rows - 1), 0, (int32_t)(rows / 2), 0, (int32_t)(5 % rows),
                            (int32_t)(rows - 2)};
    const int64_t n = 6;
    int ok = 0;
    (void)t;
    name_of(name, sizeof name, "gather", k, s);
    const size_t bytes = (size_t)(n * cols + GUARD) * sizeof(float);
    if (cudaMemcpy(c->ids_dev, ids, sizeof ids, cudaMemcpyHostToDevice) != cudaSuccess ||
        poison(c->y_dev, bytes) != 0) {
        snprintf(detail, sizeof detail, "cudaMemcpy / poison failed");
        goto done;
    }
    int rc = qt_cuda_gather_rows(d, c->ids_dev, n, c->y_dev, NULL, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "%s (%s)", msg, ql_strerror(rc));
        goto done;
    }
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(c->y_host, c->y_dev, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        snprintf(detail, sizeof detail, "the gather kernel or the copy back failed");
        goto done;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t col = 0; col < cols; col++) {
            float want = w[(int64_t)ids[i] * cols + col], got = c->y_host[i * cols + col];
            if (memcmp(&want, &got, sizeof want) != 0) {
                snprintf(detail, sizeof detail, "id %d col %lld: gpu %a, cpu %a", ids[i],
                         (long long)col, (double)got, (double)want);
                goto done;
            }
        }
    for (int64_t i = n * cols; i < n * cols + GUARD; i++)
        if (!is_poison(c->y_host[i])) {
            snprintf(detail, sizeof detail, "wrote past the end");
            goto done;
        }
    ok = 1;
done:
    report(name, ok, detail);
}

static int same_array(const void *a, const void *b, size_t bytes)
{
    if (bytes == 0)
        return 1;
    if (!a || !b)
        return 0;
    return memcmp(a, b, bytes) == 0;
}

/* Download into a clone whose arrays are scrambled: every byte comes back;
 * alloc_like makes a tensor of the same layout and size. */
static void check_round_trip(const wkind *k, const shape *s, const qtensor *t,
                             const qt_cuda_tensor *d)
{
    char name[160], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    name_of(name, sizeof name, "download round trip", k, s);
    qtensor back;
    int ok = 0;
    if (qt_clone(&back, t) != QL_OK) {
        snprintf(detail, sizeof detail, "qt_clone failed");
        report(name, 0, detail);
        return;
    }
    const size_t nq = (size_t)(t->rows * t->groups_per_row) * sizeof(float);
    memset(back.data, 0x5a, back.data_bytes);
    if (back.absmax)
        memset(back.absmax, 0x5a, (size_t)back.n_blocks * sizeof(float));
    if (back.absmax_codes)
        memset(back.absmax_codes, 0x5a, (size_t)back.n_blocks);
    if (back.nested_absmax)
        memset(back.nested_absmax, 0x5a, (size_t)back.n_nested_blocks * sizeof(float));
    if (back.scales)
        memset(back.scales, 0x5a, nq);
    if (back.zeros)
        memset(back.zeros, 0x5a, nq);
    back.nested_offset = -1.0f;
    memset(back.codebook, 0, sizeof back.codebook);
    memset(back.nested_code, 0, sizeof back.nested_code);
    int rc = qt_cuda_tensor_download(d, &back, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "qt_cuda_tensor_download: %s (%s)", msg, ql_strerror(rc));
        goto done;
    }
    const char *differs = NULL;
    if (!same_array(back.data, t->data, t->data_bytes))
        differs = "codes";
    else if (t->absmax && !same_array(back.absmax, t->absmax, (size_t)t->n_blocks * sizeof(float)))
        differs = "absmax";
    else if (t->absmax_codes &&
             !same_array(back.absmax_codes, t->absmax_codes, (size_t)t->n_blocks))
        differs = "absmax_codes";
    else if (t->nested_absmax && !same_array(back.nested_absmax, t->nested_absmax,
                                             (size_t)t->n_nested_blocks * sizeof(float)))
        differs = "nested_absmax";
    else if (t->scales && !same_array(back.scales, t->scales, nq))
        differs = "scales";
    else if (t->zeros && !same_array(back.zeros, t->zeros, nq))
        differs = "zeros";
    else if (memcmp(&back.nested_offset, &t->nested_offset, sizeof(float)) != 0 && t->nested)
        differs = "nested_offset";
    else if ((t->kind == QT_NF4 || t->kind == QT_FP4) &&
             memcmp(back.codebook, t->codebook, sizeof t->codebook) != 0)
        differs = "codebook";
    else if (t->nested && memcmp(back.nested_code, t->nested_code, sizeof t->nested_code) != 0)
        differs = "nested_code";
    if (differs) {
        snprintf(detail, sizeof detail, "the downloaded %s differ from the uploaded", differs);
        goto done;
    }

    qt_cuda_tensor like;
    rc = qt_cuda_tensor_alloc_like(d, &like, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "qt_cuda_tensor_alloc_like: %s (%s)", msg, ql_strerror(rc));
        goto done;
    }
    if (like.device_bytes != d->device_bytes || like.kind != d->kind || like.rows != d->rows ||
        like.cols != d->cols || !like.owned) {
        snprintf(detail, sizeof detail, "alloc_like: %zu bytes vs %zu, or kind/shape differ",
                 like.device_bytes, d->device_bytes);
        qt_cuda_tensor_release(&like, NULL, 0);
        goto done;
    }
    rc = qt_cuda_tensor_release(&like, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "release of alloc_like: %s", msg);
        goto done;
    }
    snprintf(detail, sizeof detail, "%zu device bytes", d->device_bytes);
    ok = 1;
done:
    report(name, ok, detail);
    qt_free(&back);
}

static void check_weight(ctx *c, const wkind *k, const shape *s, uint64_t sd)
{
    char name[160], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    const int64_t rows = s->rows, cols = s->cols;
    int64_t max_batch = MATVEC_MAX;
    for (int i = 0; i < s->n_gemm; i++)
        if (s->gemm_batches[i] > max_batch)
            max_batch = s->gemm_batches[i];
    rng_seed(sd);
    float *w0 = random_weights(rows, cols);
    float *x = malloc((size_t)(max_batch * cols) * sizeof *x);
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    qtensor t;
    memset(&t, 0, sizeof t);
    qt_cuda_tensor d;
    memset(&d, 0, sizeof d);
    refs r;
    memset(&r, 0, sizeof r);
    name_of(name, sizeof name, "upload", k, s);
    if (!w0 || !x || !w) {
        report(name, 0, "host allocation failed");
        goto done;
    }
    for (int64_t i = 0; i < max_batch * cols; i++)
        x[i] = (float)rng_normal();
    int rc = gpu_make_weight(&t, w0, rows, cols, &k->p, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "%s: %s",
                 gpu_read_in_place(k->p.kind) ? "gpu_random_blocks" : "qt_quantize", msg);
        report(name, 0, detail);
        goto done;
    }
    qt_dequantize_rows(&t, 0, rows, w);
    rc = qt_cuda_tensor_upload(&t, &d, msg, sizeof msg);
    if (rc != QL_OK || d.device_bytes == 0) {
        snprintf(detail, sizeof detail, "qt_cuda_tensor_upload: %s (%s), %zu bytes", msg,
                 ql_strerror(rc), d.device_bytes);
        report(name, 0, detail);
        goto done;
    }
    if (make_refs(&r, w, x, max_batch, rows, cols, 1) != 0) {
        report(name, 0, "host allocation of the references failed");
        goto done;
    }
    if (cudaMemcpy(c->x_dev, x, (size_t)(max_batch * cols) * sizeof *x, cudaMemcpyHostToDevice) !=
            cudaSuccess ||
        cudaMemcpy(c->x_unal, x, (size_t)(UNALIGNED_ON * cols) * sizeof *x,
                   cudaMemcpyHostToDevice) != cudaSuccess) {
        report(name, 0, "cudaMemcpy of x failed");
        goto done;
    }
    check_products(c, k, s, &t, &d, x, &r);
    check_gather(c, k, s, &t, &d, w);
    check_round_trip(k, s, &t, &d);
done:
    rc = qt_cuda_tensor_release(&d, msg, sizeof msg);
    if (rc != QL_OK)
        report("release", 0, msg);
    free_refs(&r);
    qt_free(&t);
    free(w0);
    free(w);
    free(x);
}

/* ---- refusals and out of memory -------------------------------------------- */

static void check_refusals(ctx *c)
{
    char msg[MSG_LEN] = "", detail[MSG_LEN + 128];
    size_t free_before = 0, free_after = 0, total = 0;

    /* 2^40 f32 weight elements: 4 TiB of scratch. */
    cudaMemGetInfo(&free_before, &total);
    qt_cuda_blas *b = (qt_cuda_blas *)(uintptr_t)1; /* must come back NULL */
    int rc = qt_cuda_blas_new(&b, (int64_t)1 << 40, 64, 4096, QT_CUDA_GEMM_F32, msg, sizeof msg);
    cudaMemGetInfo(&free_after, &total);
    snprintf(detail, sizeof detail, "rc %d: %s; free before %zu after %zu", rc, msg, free_before,
             free_after);
    report("blas_new of an absurd size is QL_ENOMEM with a sentence",
           rc == QL_ENOMEM && b == NULL && strstr(msg, "device memory") != NULL, detail);
    report("blas_new out of memory leaks nothing", free_after + (1u << 20) >= free_before, detail);
    (void)cudaGetLastError();

    /* A 2^20 x 2^20 f32 tensor: 4 TiB; the host bytes are never read. */
    static float dummy[4];
    qtensor t;
    memset(&t, 0, sizeof t);
    t.kind = QT_F32;
    t.rows = 1 << 20;
    t.cols = 1 << 20;
    t.data = (uint8_t *)dummy;
    t.data_bytes = (size_t)1 << 42;
    qt_cuda_tensor d;
    msg[0] = '\0';
    rc = qt_cuda_tensor_upload(&t, &d, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("upload out of memory names kind, shape and bytes",
           rc == QL_ENOMEM && strstr(msg, "f32") && strstr(msg, "1048576 x 1048576") &&
               strstr(msg, "bytes") && d.dense == NULL,
           detail);
    (void)cudaGetLastError();

    /* matvec above 32 rows of x is refused; matmul without blas too */
    qt_cuda_tensor w;
    memset(&w, 0, sizeof w);
    w.kind = QT_F32;
    w.rows = 4;
    w.cols = 4;
    w.dense = c->x_dev;
    msg[0] = '\0';
    rc = qt_cuda_matvec(&w, c->x_dev, MATVEC_MAX + 1, c->y_dev, NULL, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("matvec refuses batch 33", rc == QL_EINVAL && msg[0], detail);
    msg[0] = '\0';
    rc = qt_cuda_matmul(NULL, &w, c->x_dev, MATVEC_MAX + 1, c->y_dev, NULL, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("matmul of batch 33 without blas is refused", rc == QL_EINVAL && msg[0], detail);
}

/* ---- timing ------------------------------------------------------------------ */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void time_matvec(const wkind *k, int64_t rows, int64_t cols)
{
    char name[160], msg[MSG_LEN] = "";
    snprintf(name, sizeof name, "timing %s %lldx%lld", k->name, (long long)rows, (long long)cols);
    rng_seed((uint64_t)rows * 31 + (uint64_t)cols);
    const int64_t n = rows * cols;
    float *w0 = malloc((size_t)n * sizeof *w0);
    if (!w0) {
        report(name, 0, "host allocation failed");
        return;
    }
    for (int64_t i = 0; i < n; i++) /* uniform: enough for timing, fast to make */
        w0[i] = (float)(rng_uniform() - 0.5) * 0.1f;
    qtensor t;
    qt_cuda_tensor d;
    memset(&d, 0, sizeof d);
    int rc = gpu_make_weight(&t, w0, rows, cols, &k->p, msg, sizeof msg);
    free(w0);
    if (rc != QL_OK || qt_cuda_tensor_upload(&t, &d, msg, sizeof msg) != QL_OK) {
        report(name, 0, msg);
        qt_free(&t);
        return;
    }
    qt_free(&t);
    float *x_dev = NULL, *y_dev = NULL;
    cudaEvent_t ev[2];
    if (dev_alloc((void **)&x_dev, (size_t)(MATVEC_MAX * cols) * sizeof(float)) != 0 ||
        dev_alloc((void **)&y_dev, (size_t)(MATVEC_MAX * rows) * sizeof(float)) != 0 ||
        cudaMemset(x_dev, 0, (size_t)(MATVEC_MAX * cols) * sizeof(float)) != cudaSuccess ||
        cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess) {
        report(name, 0, "device allocation failed");
        goto out;
    }
    const int batches[4] = {1, 8, 16, 32}; /* the decode steps: 16 and 32 take the tile kernel */
    for (int bi = 0; bi < 4; bi++) {
        const int batch = batches[bi];
        float ms[20];
        int ok = 1;
        for (int i = 0; i < 3 && ok; i++)
            ok = qt_cuda_matvec(&d, x_dev, batch, y_dev, NULL, msg, sizeof msg) == QL_OK;
        for (int i = 0; i < 20 && ok; i++) {
            cudaEventRecord(ev[0], NULL);
            ok = qt_cuda_matvec(&d, x_dev, batch, y_dev, NULL, msg, sizeof msg) == QL_OK;
            cudaEventRecord(ev[1], NULL);
            ok = ok && cudaEventSynchronize(ev[1]) == cudaSuccess &&
                 cudaEventElapsedTime(&ms[i], ev[0], ev[1]) == cudaSuccess;
        }
        if (!ok) {
            report(name, 0, msg[0] ? msg : "timing failed");
            break;
        }
        qsort(ms, 20, sizeof ms[0], cmp_float);
        const double med_s = 0.5 * (ms[9] + ms[10]) * 1e-3;
        const double bytes = (double)d.device_bytes + 4.0 * (double)batch * (double)(rows + cols);
        printf("timing matvec %s %lldx%lld b=%d: %.1f us, %.0f GB/s\n", k->name, (long long)rows,
               (long long)cols, batch, med_s * 1e6, bytes / med_s / 1e9);
        printf("{\"bench\": \"cuda_matvec\", \"kind\": \"%s\", \"rows\": %lld, \"cols\": %lld, "
               "\"batch\": %d, \"median_us\": %.2f, \"weight_bytes\": %zu, \"gbs\": %.1f}\n",
               k->name, (long long)rows, (long long)cols, batch, med_s * 1e6, d.device_bytes,
               bytes / med_s / 1e9);
    }
    cudaEventDestroy(ev[0]);
    cudaEventDestroy(ev[1]);
out:
    cudaFree(x_dev);
    cudaFree(y_dev);
    qt_cuda_tensor_release(&d, NULL, 0);
    fflush(stdout);
}

int main(void)
{
    char line[1024], msg[MSG_LEN] = "";
    qt_cuda_describe(line, sizeof line);
    printf("%s\n", line);
    int count = 0;
    if (qt_cuda_device_count(&count, msg, sizeof msg) != QL_OK) {
        printf("SKIP: no usable CUDA device: %s\n", msg);
        return 77;
    }

    ctx c;
    memset(&c, 0, sizeof c);
    float *x_unal_base = NULL;
    int rc = qt_cuda_blas_new(&c.blas_f32, (int64_t)MAX_ROWS * MAX_COLS, MAX_BATCH, MAX_COLS,
                              QT_CUDA_GEMM_F32, msg, sizeof msg);
    if (rc == QL_OK)
        rc = qt_cuda_blas_new(&c.blas_bf16, (int64_t)MAX_ROWS * MAX_COLS, MAX_BATCH, MAX_COLS,
                              QT_CUDA_GEMM_BF16, msg, sizeof msg);
    if (rc != QL_OK) {
        printf("FAIL qt_cuda_blas_new: %s\n", msg);
        return 1;
    }
    const size_t x_bytes = (size_t)MAX_BATCH * MAX_COLS * sizeof(float);
    const size_t y_bytes = ((size_t)MAX_BATCH * MAX_COLS + GUARD) * sizeof(float);
    c.y_host = malloc(y_bytes);
    if (!c.y_host || dev_alloc((void **)&c.x_dev, x_bytes) != 0 ||
        dev_alloc((void **)&x_unal_base, x_bytes + 16) != 0 ||
        dev_alloc((void **)&c.y_dev, y_bytes) != 0 ||
        dev_alloc((void **)&c.ids_dev, 64 * sizeof(int32_t)) != 0) {
        printf("FAIL allocating the test buffers\n");
        return 1;
    }
    c.x_unal = x_unal_base + 1;

    uint64_t sd = 1;
    for (size_t si = 0; si < N_SHAPES; si++)
        for (size_t ki = 0; ki < N_KINDS; ki++) {
            const shape *s = &shapes[si];
            const wkind *k = &kinds[ki];
            if (s->ragged && !k->any_cols)
                continue;
            if (k->p.kind == QT_AFFINE && k->p.group_size > 0 && s->cols % k->p.group_size != 0)
                continue;
            if (gpu_read_in_place(k->p.kind) &&
                s->cols % qt_traits_table[k->p.kind].block_size != 0)
                continue;
            /* emulated: the kinds kept in whole blocks (Q5_0, Q5_1 and
             * the read-in-place ones) skip the two largest shapes; their
             * piece kernel runs the same code on the smaller ones */
            const bool whole =
                gpu_read_in_place(k->p.kind) || k->p.kind == QT_Q5_0 || k->p.kind == QT_Q5_1;
            if (emulated() && whole && s->rows * s->cols > 300000)
                continue;
            check_weight(&c, k, s, sd++);
        }

    check_refusals(&c);

    if (!emulated()) {
        const wkind *timed[] = {
            &kinds[3], &kinds[4],  &kinds[14], &kinds[16], &kinds[9],
            &kinds[2], &kinds[17], &kinds[19], &kinds[21]}; /* ... q5_0, q4_k, q6_k */
        for (size_t i = 0; i < sizeof timed / sizeof timed[0]; i++)
            time_matvec(timed[i], 4096, 4096);
        time_matvec(&kinds[3], 11008, 4096);
        time_matvec(&kinds[14], 11008, 4096);
    }

    qt_cuda_blas_free(c.blas_f32);
    qt_cuda_blas_free(c.blas_bf16);
    cudaFree(c.x_dev);
    cudaFree(x_unal_base);
    cudaFree(c.y_dev);
    cudaFree(c.ids_dev);
    free(c.y_host);
    printf("%s: %d passed, %d failed\n", failures ? "FAIL" : "PASS", passes, failures);
    return failures ? 1 : 0;
}

/*
 * test_cuda_dequant.c - the CUDA dequantize kernels (NF4/FP4, AFFINE, GGUF
 * Q4_0/Q4_1/Q8_0/Q5_0/Q5_1, Q2_K ... Q6_K, IQ4_NL, IQ4_XS, MXFP4) against the CPU
 * reference, bit
 * for bit, on a real GPU; the GGUF split layout (qs, d, m arrays) the upload
 * makes of Q4_0/Q4_1/Q8_0 blocks, and the whole blocks the other kinds keep.
 *
 * Why shaped so: this runs only on a machine with a GPU (tests/gpu/run.sh),
 * so it is a plain C program with a main() rather than a Criterion suite,
 * and it prints one line per case so a remote log reads on its own. The CPU
 * side is the reference: qt_quantize makes the tensor (random blocks for
 * the kinds read in place only, which have no quantizer yet),
 * qt_dequantize_rows
 * gives the expected floats, and the GPU output (poisoned with NaN before,
 * so an element the kernel forgets to write cannot pass) must equal them in
 * every bit. Both sides run kernels/math/qt_math.h, so any difference is a bug in
 * the indexing, the packing or the build flags (FMA contraction), never
 * "rounding".
 *
 * Exit status: 0 all passed; 1 a case failed; 77 no usable CUDA device (a
 * skip in the automake/CTest convention; run.sh treats it as a failure,
 * since it runs where a GPU is expected).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/qt_cuda.h"
#include "cuda/qt_cuda_ops.h"
#include "gpu_test_util.h"
#include "qtensor.h"

#define MSG_LEN 512

static int failures;

/* ---- inputs ------------------------------------------------------------- */

/* Weights shaped like a trained layer: normal, a few outliers, some exact
 * zeros, and one all-zero absmax block (absmax 0 is a path of its own). */
static float *random_weights(int64_t n, uint64_t seed)
{
    float *w = malloc((size_t)n * sizeof *w);
    if (!w)
        return NULL;
    rng_seed(seed);
    for (int64_t i = 0; i < n; i++) {
        double g = rng_normal();
        double scale = rng_uniform() < 0.001 ? 8.0 : 0.02;
        w[i] = rng_uniform() < 0.01 ? 0.0f : (float)(g * scale);
    }
    for (int64_t i = 0; i < n && i < 64; i++)
        w[i] = 0.0f;
    return w;
}

static float *nan_filled(int64_t n, int64_t extra)
{
    float *p = malloc((size_t)(n + extra) * sizeof *p);
    if (p)
        for (int64_t i = 0; i < n + extra; i++)
            p[i] = nanf("");
    return p;
}

/* ---- comparisons --------------------------------------------------------- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Index of the first element whose bits differ, or -1. */
static int64_t first_difference_f32(const float *want, const float *got, int64_t n)
{
    if (memcmp(want, got, (size_t)n * sizeof *want) == 0)
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (f32_bits(want[i]) != f32_bits(got[i]))
            return i;
    return -1;
}

static void report(const char *name, int ok, const char *detail)
{
    printf("%-44s %s%s%s\n", name, ok ? "ok" : "FAIL", detail[0] ? "  " : "", detail);
    fflush(stdout);
    if (!ok)
        failures++;
}

/* ---- the cases ----------------------------------------------------------- */

/* A tensor to make: kind and shape, plus what applies to the kind (NF4/FP4:
 * blocksize and nesting; AFFINE: bits, group size, zero domain, symmetry;
 * GGUF kinds: nothing). */
typedef struct dequant_case {
    qt_kind kind;
    int32_t blocksize;
    bool nested;
    int64_t rows, cols;
    int32_t bits, group_size;
    qt_zero_domain zero_domain;
    bool symmetric;
} dequant_case;

static bool is_4bit(qt_kind kind)
{
    return kind == QT_NF4 || kind == QT_FP4;
}

static void case_name(char *buf, size_t len, const char *what, const dequant_case *c)
{
    if (is_4bit(c->kind))
        snprintf(buf, len, "%s %s%s bs%d %lldx%lld", what, qt_kind_name(c->kind),
                 c->nested ? "-dq" : "", (int)c->blocksize, (long long)c->rows, (long long)c->cols);
    else if (c->kind == QT_AFFINE)
        snprintf(buf, len, "%s int%d %s g%d %lldx%lld", what, (int)c->bits,
                 c->symmetric                      ? "sym"
                 : c->zero_domain == QT_ZERO_FLOAT ? "fzero"
                                                   : "izero",
                 (int)c->group_size, (long long)c->rows, (long long)c->cols);
    else
        snprintf(buf, len, "%s %s %lldx%lld", what, qt_kind_name(c->kind), (long long)c->rows,
                 (long long)c->cols);
}

static qt_quant_params case_params(const dequant_case *c)
{
    qt_quant_params p = {0};
    p.kind = c->kind;
    p.blocksize = c->blocksize;
    p.double_quant = c->nested;
    p.bits = c->bits;
    p.group_size = c->group_size;
    p.zero_domain = c->zero_domain;
    p.symmetric = c->symmetric;
    return p;
}

/* ---- one interface over the three kernel families ------------------------ */

/* A tensor on the device, whichever view its kind takes. */
typedef struct dev_tensor {
    qt_kind kind;
    qt_cuda_4bit_view bnb4;
    qt_cuda_affine_view affine;
    qt_cuda_gguf_view gguf;
} dev_tensor;

static int dev_upload(const qtensor *t, dev_tensor *d, char *msg, size_t msg_len)
{
    memset(d, 0, sizeof *d);
    d->kind = t->kind;
    if (is_4bit(t->kind))
        return qt_cuda_4bit_upload(t, &d->bnb4, msg, msg_len);
    if (t->kind == QT_AFFINE)
        return qt_cuda_affine_upload(t, &d->affine, msg, msg_len);
    return qt_cuda_gguf_upload(t, &d->gguf, msg, msg_len);
}

static int dev_dequantize(const dev_tensor *d, void *out, qt_cuda_out_dtype dtype, char *msg,
                          size_t msg_len)
{
    if (is_4bit(d->kind))
        return qt_cuda_dequantize_4bit_dev(&d->bnb4, out, dtype, NULL, msg, msg_len);
    if (d->kind == QT_AFFINE)
        return qt_cuda_dequantize_affine_dev(&d->affine, out, dtype, NULL, msg, msg_len);
    return qt_cuda_dequantize_gguf_dev(&d->gguf, out, dtype, NULL, msg, msg_len);
}

/* Safe on a zeroed or half-uploaded dev_tensor. */
static void dev_release(dev_tensor *d)
{
    qt_cuda_4bit_release(&d->bnb4, NULL, 0);
    qt_cuda_affine_release(&d->affine, NULL, 0);
    qt_cuda_gguf_release(&d->gguf, NULL, 0);
}

/* The host-to-host entry point for t's kind, and its name for messages. */
static int host_dequantize(const qtensor *t, float *out, char *msg, size_t msg_len, const char **fn)
{
    if (is_4bit(t->kind)) {
        *fn = "qt_cuda_dequantize_4bit";
        return qt_cuda_dequantize_4bit(t, out, msg, msg_len);
    }
    if (t->kind == QT_AFFINE) {
        *fn = "qt_cuda_dequantize_affine";
        return qt_cuda_dequantize_affine(t, out, msg, msg_len);
    }
    *fn = "qt_cuda_dequantize_gguf";
    return qt_cuda_dequantize_gguf(t, out, msg, msg_len);
}

static int quantize_case(const dequant_case *c, uint64_t seed, qtensor *t, float **want,
                         char *detail, size_t detail_len)
{
    const int64_t n = c->rows * c->cols;
    char msg[MSG_LEN] = "";
    float *w = random_weights(n, seed); /* seeds the stream the k-quant blocks come from */
    *want = nan_filled(n, 0);
    if (!w || !*want) {
        snprintf(detail, detail_len, "host allocation of %lld floats failed", (long long)n);
        free(w);
        return -1;
    }
    qt_quant_params p = case_params(c);
    int rc = gpu_make_weight(t, w, c->rows, c->cols, &p, msg, sizeof msg);
    free(w);
    if (rc != QL_OK) {
        snprintf(detail, detail_len, "%s: %s (%s)",
                 gpu_read_in_place(c->kind) ? "gpu_random_blocks" : "qt_quantize", msg,
                 ql_strerror(rc));
        return -1;
    }
    qt_dequantize_rows(t, 0, c->rows, *want);
    return 0;
}

/* GPU host-to-host dequantize equals the CPU reference in every bit. */
static void check_host_variant(const dequant_case *c, uint64_t seed)
{
    char name[128], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    case_name(name, sizeof name, "dequantize", c);
    const int64_t n = c->rows * c->cols;
    qtensor t;
    float *want = NULL, *got = NULL;
    if (quantize_case(c, seed, &t, &want, detail, sizeof detail) != 0) {
        report(name, 0, detail);
        free(want);
        return;
    }
    got = nan_filled(n, 0);
    const char *fn = "host allocation";
    int rc = got ? host_dequantize(&t, got, msg, sizeof msg, &fn) : QL_ENOMEM;
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "%s: %s (%d)", fn, msg, rc);
        report(name, 0, detail);
    } else {
        int64_t i = first_difference_f32(want, got, n);
        if (i >= 0)
            snprintf(detail, sizeof detail, "element %lld: cpu %a (0x%08x) gpu %a (0x%08x)",
                     (long long)i, want[i], f32_bits(want[i]), got[i], f32_bits(got[i]));
        report(name, i < 0, detail);
    }
    free(got);
    free(want);
    qt_free(&t);
}

/*
 * The device variant's other paths: bf16 output (against qt_f32_to_bf16 of
 * the reference), and an output pointer 4 bytes off 16-byte alignment, which
 * must take the byte-load, scalar-store path and still write every element
 * and nothing beyond.
 */
static void check_device_variant(const dequant_case *c, uint64_t seed)
{
    char name[128], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    const int64_t n = c->rows * c->cols;
    qtensor t;
    float *want = NULL;
    dev_tensor view;
    memset(&view, 0, sizeof view);
    void *dev = NULL;
    float *got = NULL;
    uint16_t *got_bf16 = NULL;
    int ok = 0;

    case_name(name, sizeof name, "dev bf16 + unaligned f32", c);
    if (quantize_case(c, seed, &t, &want, detail, sizeof detail) != 0)
        goto done;
    int rc = dev_upload(&t, &view, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "upload: %s", msg);
        goto done;
    }
    /* f32 at offset 1 float (4 bytes) plus 4 guard floats after the end */
    const size_t bytes = (size_t)(n + 8) * sizeof(float);
    got = nan_filled(n, 8);
    got_bf16 = malloc((size_t)n * sizeof *got_bf16);
    if (!got || !got_bf16 || cudaMalloc(&dev, bytes) != cudaSuccess) {
        snprintf(detail, sizeof detail, "allocating %zu bytes failed", bytes);
        goto done;
    }
    if (cudaMemcpy(dev, got, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        snprintf(detail, sizeof detail, "cudaMemcpy of the NaN poison failed");
        goto done;
    }
    rc = dev_dequantize(&view, (float *)dev + 1, QT_CUDA_OUT_F32, msg, sizeof msg);
    if (rc == QL_OK && cudaMemcpy(got, dev, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = QL_EDEVICE, snprintf(msg, sizeof msg, "cudaMemcpy back failed");
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "unaligned f32: %s (%d)", msg, rc);
        goto done;
    }
    int64_t i = first_difference_f32(want, got + 1, n);
    if (i >= 0) {
        snprintf(detail, sizeof detail, "unaligned f32 element %lld: cpu 0x%08x gpu 0x%08x",
                 (long long)i, f32_bits(want[i]), f32_bits(got[i + 1]));
        goto done;
    }
    if (!isnan(got[0]) || !isnan(got[n + 1])) {
        snprintf(detail, sizeof detail, "unaligned f32: wrote outside [out, out + n)");
        goto done;
    }

    rc = dev_dequantize(&view, dev, QT_CUDA_OUT_BF16, msg, sizeof msg);
    if (rc == QL_OK && cudaMemcpy(got_bf16, dev, (size_t)n * sizeof *got_bf16,
                                  cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = QL_EDEVICE, snprintf(msg, sizeof msg, "cudaMemcpy back failed");
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "bf16: %s (%d)", msg, rc);
        goto done;
    }
    for (i = 0; i < n; i++)
        if (got_bf16[i] != qt_f32_to_bf16(want[i])) {
            snprintf(detail, sizeof detail, "bf16 element %lld: cpu 0x%04x gpu 0x%04x",
                     (long long)i, qt_f32_to_bf16(want[i]), got_bf16[i]);
            goto done;
        }
    ok = 1;
done:
    report(name, ok, detail);
    if (dev)
        cudaFree(dev);
    dev_release(&view);
    free(got);
    free(got_bf16);
    free(want);
    qt_free(&t);
}

/*
 * The GGUF split layout on the device: qs holds each block's ggml qs bytes
 * back to back, d (and m for Q4_1 only) each block's f16 bits, exactly what
 * qm_gguf_split_block makes of the host blocks; m is NULL for Q4_0, Q8_0.
 */
static void check_gguf_split_layout(qt_kind kind, uint64_t seed)
{
    char name[128], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    const dequant_case c = {.kind = kind, .rows = 37, .cols = 96};
    snprintf(name, sizeof name, "split layout %s 37x96", qt_kind_name(kind));
    qtensor t;
    float *want = NULL;
    qt_cuda_gguf_view v;
    memset(&v, 0, sizeof v);
    uint8_t *qs = NULL, *want_qs = NULL;
    uint16_t *d = NULL, *m = NULL, *want_d = NULL, *want_m = NULL;
    int ok = 0;
    if (quantize_case(&c, seed, &t, &want, detail, sizeof detail) != 0)
        goto done;
    int rc = qt_cuda_gguf_upload(&t, &v, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "upload: %s (%d)", msg, rc);
        goto done;
    }
    const int bb = (int)qt_traits_table[kind].block_bytes;
    const int qsb = kind == QT_Q8_0 ? 32 : 16;
    const int64_t nb = t.rows * t.cols / 32;
    if (v.n_blocks != nb || v.n_elements != t.rows * t.cols || v.kind != kind ||
        (kind == QT_Q4_1) != (v.m != NULL)) {
        snprintf(detail, sizeof detail, "view: n_blocks %lld (want %lld), m %p",
                 (long long)v.n_blocks, (long long)nb, (const void *)v.m);
        goto done;
    }
    qs = malloc((size_t)(nb * qsb));
    want_qs = malloc((size_t)(nb * qsb));
    d = calloc((size_t)nb, 2);
    m = calloc((size_t)nb, 2);
    want_d = calloc((size_t)nb, 2);
    want_m = calloc((size_t)nb, 2);
    if (!qs || !want_qs || !d || !m || !want_d || !want_m) {
        snprintf(detail, sizeof detail, "host allocation failed");
        goto done;
    }
    for (int64_t b = 0; b < nb; b++) {
        /* ggml's block: f16 d, (f16 m), qs */
        const uint8_t *blk = t.data + b * bb;
        want_d[b] = (uint16_t)(blk[0] | (blk[1] << 8));
        if (kind == QT_Q4_1)
            want_m[b] = (uint16_t)(blk[2] | (blk[3] << 8));
        memcpy(want_qs + b * qsb, blk + bb - qsb, (size_t)qsb);
    }
    if (cudaMemcpy(qs, v.qs, (size_t)(nb * qsb), cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(d, v.d, (size_t)nb * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
        (v.m && cudaMemcpy(m, v.m, (size_t)nb * 2, cudaMemcpyDeviceToHost) != cudaSuccess)) {
        snprintf(detail, sizeof detail, "cudaMemcpy of the view's arrays failed");
        goto done;
    }
    if (memcmp(qs, want_qs, (size_t)(nb * qsb)) != 0 || memcmp(d, want_d, (size_t)nb * 2) != 0 ||
        memcmp(m, want_m, (size_t)nb * 2) != 0) {
        snprintf(detail, sizeof detail, "device qs/d/m differ from ggml's block parts");
        goto done;
    }
    if (((uintptr_t)v.qs & 15u) != 0) {
        snprintf(detail, sizeof detail, "qs %p is not 16-byte aligned", (const void *)v.qs);
        goto done;
    }
    ok = 1;
done:
    report(name, ok, detail);
    qt_cuda_gguf_release(&v, NULL, 0);
    free(qs);
    free(want_qs);
    free(d);
    free(m);
    free(want_d);
    free(want_m);
    free(want);
    qt_free(&t);
}

/*
 * The whole-block layout of Q5_0, Q5_1 and the k-quants on the device: qs
 * holds ggml's blocks byte for byte, d and m are NULL, and a download
 * through qt_cuda_tensor gives the same bytes back.
 */
static void check_gguf_whole_layout(qt_kind kind, int64_t rows, int64_t cols, uint64_t seed)
{
    char name[128], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    const dequant_case c = {.kind = kind, .rows = rows, .cols = cols};
    snprintf(name, sizeof name, "whole-block layout %s %lldx%lld", qt_kind_name(kind),
             (long long)rows, (long long)cols);
    qtensor t, back;
    memset(&back, 0, sizeof back);
    float *want = NULL;
    qt_cuda_gguf_view v;
    memset(&v, 0, sizeof v);
    qt_cuda_tensor dt;
    memset(&dt, 0, sizeof dt);
    uint8_t *blocks = NULL;
    int ok = 0;
    if (quantize_case(&c, seed, &t, &want, detail, sizeof detail) != 0)
        goto done;
    int rc = qt_cuda_gguf_upload(&t, &v, msg, sizeof msg);
    if (rc != QL_OK) {
        snprintf(detail, sizeof detail, "upload: %s (%d)", msg, rc);
        goto done;
    }
    const size_t per = (size_t)qt_traits_table[kind].block_size;
    const size_t nb = (size_t)(rows * cols) / per, bytes = nb * qt_traits_table[kind].block_bytes;
    if (v.n_blocks != (int64_t)nb || v.n_elements != rows * cols || v.kind != kind || v.d || v.m ||
        !v.qs) {
        snprintf(detail, sizeof detail, "view: n_blocks %lld (want %zu), d %p, m %p",
                 (long long)v.n_blocks, nb, (const void *)v.d, (const void *)v.m);
        goto done;
    }
    blocks = malloc(bytes);
    if (!blocks || cudaMemcpy(blocks, v.qs, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        snprintf(detail, sizeof detail, "copying %zu bytes of blocks back failed", bytes);
        goto done;
    }
    if (memcmp(blocks, t.data, bytes) != 0) {
        snprintf(detail, sizeof detail, "device blocks differ from ggml's");
        goto done;
    }
    rc = qt_cuda_tensor_upload(&t, &dt, msg, sizeof msg);
    if (rc == QL_OK && dt.device_bytes != bytes) {
        snprintf(detail, sizeof detail, "qt_cuda_tensor holds %zu bytes, want %zu", dt.device_bytes,
                 bytes);
        goto done;
    }
    if (rc == QL_OK)
        rc = qt_clone(&back, &t);
    if (rc == QL_OK) {
        memset(back.data, 0xa5, bytes);
        rc = qt_cuda_tensor_download(&dt, &back, msg, sizeof msg);
    }
    if (rc != QL_OK || memcmp(back.data, t.data, bytes) != 0) {
        snprintf(detail, sizeof detail, "tensor upload/download: %s (%d)%s", msg, rc,
                 rc == QL_OK ? ", bytes differ" : "");
        goto done;
    }
    ok = 1;
done:
    report(name, ok, detail);
    qt_cuda_gguf_release(&v, NULL, 0);
    qt_cuda_tensor_release(&dt, NULL, 0);
    free(blocks);
    free(want);
    qt_free(&back);
    qt_free(&t);
}

/* Refusals: a kind the kernel does not take is named; an allocation the
 * device cannot hold is QL_ENOMEM naming cudaMalloc, and leaks nothing. */
static void check_refusals(void)
{
    char msg[MSG_LEN] = "", detail[MSG_LEN + 128] = "";
    float out[4];
    qtensor t;

    memset(&t, 0, sizeof t);
    t.kind = QT_AFFINE;
    t.rows = 2;
    t.cols = 2;
    int rc = qt_cuda_dequantize_4bit(&t, out, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("refuses affine by name", rc == QL_EUNSUPPORTED && strstr(msg, "affine") != NULL,
           detail);

    /* Each family names the kind it was handed and does not take. */
    t.kind = QT_NF4;
    msg[0] = '\0';
    rc = qt_cuda_dequantize_affine(&t, out, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("affine refuses nf4 by name", rc == QL_EUNSUPPORTED && strstr(msg, "nf4") != NULL,
           detail);
    t.kind = QT_AFFINE;
    msg[0] = '\0';
    rc = qt_cuda_dequantize_gguf(&t, out, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("gguf refuses affine by name", rc == QL_EUNSUPPORTED && strstr(msg, "affine") != NULL,
           detail);

    /* A k-quant whose rows are not whole super-blocks (8 x 32: 256
     * elements, one block's worth, but no row holds a block) is refused
     * by name before any device memory is taken. */
    static uint8_t kblock[144]; /* one Q4_K super-block */
    memset(&t, 0, sizeof t);
    t.kind = QT_Q4_K;
    t.rows = 8;
    t.cols = 32;
    t.data = kblock;
    t.data_bytes = sizeof kblock;
    qt_cuda_gguf_view kv;
    msg[0] = '\0';
    rc = qt_cuda_gguf_upload(&t, &kv, msg, sizeof msg);
    snprintf(detail, sizeof detail, "rc %d: %s", rc, msg);
    report("gguf upload refuses q4_k rows of 32 by name",
           rc == QL_EINVAL && strstr(msg, "q4_k") != NULL && strstr(msg, "256") != NULL &&
               kv.qs == NULL,
           detail);

    /* 2^20 x 2^20 elements: 512 GiB of codes, more than any device holds.
     * The host pointers are never read, since cudaMalloc fails first. */
    static uint8_t dummy_codes[16];
    static float dummy_absmax[1];
    size_t free_before = 0, free_after = 0, total = 0;
    cudaMemGetInfo(&free_before, &total);
    memset(&t, 0, sizeof t);
    t.kind = QT_NF4;
    t.rows = 1 << 20;
    t.cols = 1 << 20;
    t.data = dummy_codes;
    t.data_bytes = (size_t)1 << 39;
    t.blocksize = 64;
    t.n_blocks = ((int64_t)1 << 40) / 64;
    t.absmax = dummy_absmax;
    msg[0] = '\0';
    rc = qt_cuda_dequantize_4bit(&t, out, msg, sizeof msg);
    cudaMemGetInfo(&free_after, &total);
    snprintf(detail, sizeof detail, "rc %d: %s; free before %zu after %zu", rc, msg, free_before,
             free_after);
    report("out of device memory is QL_ENOMEM", rc == QL_ENOMEM && strstr(msg, "cudaMalloc"),
           detail);
    report("out of device memory leaks nothing", free_after >= free_before, detail);
    /* The failed allocation must not poison the next call. */
    (void)cudaGetLastError();
}

/* ---- timing -------------------------------------------------------------- */

/* Average milliseconds of one dequantize of view into dev_out. */
static float time_dequantize(const dev_tensor *view, void *dev_out, qt_cuda_out_dtype dtype,
                             int iters, char *msg, size_t msg_len)
{
    cudaEvent_t start, stop;
    if (cudaEventCreate(&start) != cudaSuccess)
        return -1.0f;
    if (cudaEventCreate(&stop) != cudaSuccess) {
        cudaEventDestroy(start);
        return -1.0f;
    }
    float ms = -1.0f;
    for (int i = 0; i < 3; i++) /* warm up: clocks, caches, lazy module load */
        if (dev_dequantize(view, dev_out, dtype, msg, msg_len) != QL_OK)
            goto out;
    cudaEventRecord(start, NULL);
    for (int i = 0; i < iters; i++)
        if (dev_dequantize(view, dev_out, dtype, msg, msg_len) != QL_OK)
            goto out;
    cudaEventRecord(stop, NULL);
    if (cudaEventSynchronize(stop) == cudaSuccess &&
        cudaEventElapsedTime(&ms, start, stop) == cudaSuccess)
        ms /= (float)iters;
    else
        ms = -1.0f;
out:
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms;
}

static void time_large(const dequant_case *c, uint64_t seed)
{
    char name[128], detail[MSG_LEN + 128] = "", msg[MSG_LEN] = "";
    case_name(name, sizeof name, "timing", c);
    const int64_t n = c->rows * c->cols;
    qtensor t;
    memset(&t, 0, sizeof t);
    float *w = random_weights(n, seed);
    qt_quant_params p = case_params(c);
    if (!w || qt_quantize(&t, w, c->rows, c->cols, &p, msg, sizeof msg) != QL_OK) {
        snprintf(detail, sizeof detail, "quantize: %s", msg);
        report(name, 0, detail);
        free(w);
        return;
    }
    free(w);
    dev_tensor view;
    void *dev_out = NULL;
    if (dev_upload(&t, &view, msg, sizeof msg) != QL_OK ||
        cudaMalloc(&dev_out, (size_t)n * sizeof(float)) != cudaSuccess) {
        snprintf(detail, sizeof detail, "upload: %s", msg);
        report(name, 0, detail);
        dev_release(&view);
        qt_free(&t);
        return;
    }
    /* Packed input: the codes (GGUF: whole blocks, halves included); state:
     * absmax (NF4/FP4) or scales and zeros (AFFINE). */
    double code_bytes = (double)t.data_bytes, state_bytes = 0.0;
    if (is_4bit(t.kind)) {
        code_bytes = (double)((n + 1) / 2);
        state_bytes = t.nested ? (double)t.n_blocks + 4.0 * (double)t.n_nested_blocks
                               : 4.0 * (double)t.n_blocks;
    } else if (t.kind == QT_AFFINE) {
        state_bytes = 8.0 * (double)(t.rows * t.groups_per_row);
    }
    const int iters = 50;
    const qt_cuda_out_dtype dtypes[2] = {QT_CUDA_OUT_F32, QT_CUDA_OUT_BF16};
    const char *dtype_names[2] = {"f32", "bf16"};
    const double out_size[2] = {4.0, 2.0};
    for (int d = 0; d < 2; d++) {
        float ms = time_dequantize(&view, dev_out, dtypes[d], iters, msg, sizeof msg);
        if (ms <= 0.0f) {
            snprintf(detail, sizeof detail, "%s: timing failed: %s", dtype_names[d], msg);
            report(name, 0, detail);
            continue;
        }
        const double s = ms * 1e-3;
        const double in_gbs = code_bytes / s / 1e9;
        const double all_gbs = (code_bytes + state_bytes + out_size[d] * (double)n) / s / 1e9;
        printf("timing %s-> %s: %.4f ms, packed input %.1f GB/s, all traffic %.1f GB/s\n",
               name + strlen("timing "), dtype_names[d], ms, in_gbs, all_gbs);
        printf("{\"bench\": \"%s\", \"kind\": \"%s\", \"nested\": %s, "
               "\"blocksize\": %d, \"bits\": %d, \"group_size\": %d, \"rows\": %lld, "
               "\"cols\": %lld, \"out\": \"%s\", \"iters\": %d, \"ms\": %.5f, "
               "\"packed_input_gbs\": %.2f, \"total_traffic_gbs\": %.2f}\n",
               is_4bit(c->kind) ? "cuda_dequant_4bit" : "cuda_dequant", qt_kind_name(c->kind),
               c->nested ? "true" : "false", (int)c->blocksize, (int)c->bits, (int)c->group_size,
               (long long)c->rows, (long long)c->cols, dtype_names[d], iters, ms, in_gbs, all_gbs);
    }
    cudaFree(dev_out);
    dev_release(&view);
    qt_free(&t);
}

int main(void)
{
    char line[1024], msg[MSG_LEN] = "";
    qt_cuda_describe(line, sizeof line);
    printf("%s\n", line);

    int count = 0;
    int rc = qt_cuda_device_count(&count, msg, sizeof msg);
    if (rc != QL_OK) {
        printf("SKIP: no usable CUDA device: %s\n", msg);
        return 77;
    }

    const qt_kind kinds[2] = {QT_NF4, QT_FP4};
    const bool nesting[2] = {false, true};
    /* blocksize 64 is bitsandbytes' default, 4096 its largest, 32 its
     * smallest; 37x45 is odd-sized (a half-filled last byte, a partial last
     * block and a partial last 32-element chunk); 1x1 is one element. */
    const struct {
        int32_t blocksize;
        int64_t rows, cols;
    } shapes[] = {
        {64, 256, 512}, {4096, 96, 1000}, {64, 37, 45},     {4096, 37, 45},
        {32, 37, 45},   {64, 1, 1},       {64, 4096, 4096},
    };
    uint64_t seed = 1;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int k = 0; k < 2; k++)
            for (int d = 0; d < 2; d++) {
                if (emulated() && shapes[s].rows * shapes[s].cols >= 4096 * 4096) {
                    seed++;
                    continue;
                }
                dequant_case c = {.kind = kinds[k],
                                  .blocksize = shapes[s].blocksize,
                                  .nested = nesting[d],
                                  .rows = shapes[s].rows,
                                  .cols = shapes[s].cols};
                check_host_variant(&c, seed++);
            }

    /* AFFINE: torchao's int4 weight-only (float zero, groups), integer zero
     * with groups, symmetric int4, int8 per channel; 37x45 with group 9 has
     * odd rows (each row starts on a byte, a half-used last nibble). GGUF:
     * the three kinds, one block, odd row counts, and a 4096x4096 layer. */
    const dequant_case affine_gguf_cases[] = {
        {.kind = QT_AFFINE,
         .rows = 256,
         .cols = 512,
         .bits = 4,
         .group_size = 128,
         .zero_domain = QT_ZERO_FLOAT},
        {.kind = QT_AFFINE,
         .rows = 37,
         .cols = 45,
         .bits = 4,
         .group_size = 9,
         .zero_domain = QT_ZERO_FLOAT},
        {.kind = QT_AFFINE,
         .rows = 256,
         .cols = 512,
         .bits = 4,
         .group_size = 32,
         .zero_domain = QT_ZERO_INT},
        {.kind = QT_AFFINE,
         .rows = 37,
         .cols = 45,
         .bits = 4,
         .group_size = 15,
         .zero_domain = QT_ZERO_INT},
        {.kind = QT_AFFINE,
         .rows = 96,
         .cols = 1000,
         .bits = 4,
         .group_size = 8,
         .symmetric = true},
        {.kind = QT_AFFINE, .rows = 256, .cols = 512, .bits = 8, .symmetric = true},
        {.kind = QT_AFFINE, .rows = 37, .cols = 45, .bits = 8, .symmetric = true},
        {.kind = QT_AFFINE,
         .rows = 4096,
         .cols = 4096,
         .bits = 4,
         .group_size = 128,
         .zero_domain = QT_ZERO_FLOAT},
        {.kind = QT_Q4_0, .rows = 256, .cols = 512},
        {.kind = QT_Q4_1, .rows = 256, .cols = 512},
        {.kind = QT_Q8_0, .rows = 256, .cols = 512},
        {.kind = QT_Q4_0, .rows = 37, .cols = 96},
        {.kind = QT_Q4_1, .rows = 37, .cols = 96},
        {.kind = QT_Q8_0, .rows = 37, .cols = 96},
        {.kind = QT_Q4_0, .rows = 1, .cols = 32},
        {.kind = QT_Q4_0, .rows = 4096, .cols = 4096},
        {.kind = QT_Q8_0, .rows = 4096, .cols = 4096},
        /* the kinds kept in whole ggml blocks: odd block sizes (22, 24,
         * 210 bytes), one block, odd row counts */
        {.kind = QT_Q5_0, .rows = 256, .cols = 512},
        {.kind = QT_Q5_1, .rows = 256, .cols = 512},
        {.kind = QT_Q5_0, .rows = 37, .cols = 96},
        {.kind = QT_Q5_1, .rows = 37, .cols = 96},
        {.kind = QT_Q5_0, .rows = 1, .cols = 32},
        {.kind = QT_Q4_K, .rows = 96, .cols = 512},
        {.kind = QT_Q5_K, .rows = 96, .cols = 512},
        {.kind = QT_Q6_K, .rows = 96, .cols = 512},
        {.kind = QT_Q4_K, .rows = 37, .cols = 768},
        {.kind = QT_Q5_K, .rows = 37, .cols = 768},
        {.kind = QT_Q6_K, .rows = 37, .cols = 768},
        {.kind = QT_Q6_K, .rows = 1, .cols = 256},
        {.kind = QT_Q4_K, .rows = 4096, .cols = 4096},
        {.kind = QT_Q6_K, .rows = 4096, .cols = 4096},
        {.kind = QT_Q2_K, .rows = 96, .cols = 512},
        {.kind = QT_Q3_K, .rows = 96, .cols = 512},
        {.kind = QT_IQ4_XS, .rows = 96, .cols = 512},
        {.kind = QT_IQ4_NL, .rows = 256, .cols = 512},
        {.kind = QT_Q2_K, .rows = 37, .cols = 768},
        {.kind = QT_Q3_K, .rows = 37, .cols = 768},
        {.kind = QT_IQ4_XS, .rows = 37, .cols = 768},
        {.kind = QT_IQ4_NL, .rows = 37, .cols = 96},
        {.kind = QT_IQ4_NL, .rows = 1, .cols = 32},
        /* MXFP4: 17-byte blocks, a scale byte first */
        {.kind = QT_MXFP4, .rows = 256, .cols = 512},
        {.kind = QT_MXFP4, .rows = 37, .cols = 96},
        {.kind = QT_MXFP4, .rows = 1, .cols = 32},
    };
    for (size_t i = 0; i < sizeof affine_gguf_cases / sizeof affine_gguf_cases[0]; i++)
        if (!emulated() || affine_gguf_cases[i].rows * affine_gguf_cases[i].cols < 4096 * 4096)
            check_host_variant(&affine_gguf_cases[i], seed++);
        else
            seed++;

    const dequant_case dev_cases[] = {
        {.kind = QT_NF4, .blocksize = 64, .nested = true, .rows = 37, .cols = 45},
        {.kind = QT_FP4, .blocksize = 64, .rows = 37, .cols = 45},
        {.kind = QT_NF4, .blocksize = 64, .nested = true, .rows = 4096, .cols = 4096},
        {.kind = QT_AFFINE,
         .rows = 37,
         .cols = 45,
         .bits = 4,
         .group_size = 9,
         .zero_domain = QT_ZERO_FLOAT},
        {.kind = QT_AFFINE, .rows = 37, .cols = 45, .bits = 8, .symmetric = true},
        {.kind = QT_Q4_0, .rows = 37, .cols = 96},
        {.kind = QT_Q4_1, .rows = 37, .cols = 96},
        {.kind = QT_Q8_0, .rows = 37, .cols = 96},
        {.kind = QT_Q5_0, .rows = 37, .cols = 96},
        {.kind = QT_Q5_1, .rows = 37, .cols = 96},
        {.kind = QT_Q4_K, .rows = 37, .cols = 256},
        {.kind = QT_Q5_K, .rows = 37, .cols = 256},
        {.kind = QT_Q6_K, .rows = 37, .cols = 256},
        {.kind = QT_Q2_K, .rows = 37, .cols = 256},
        {.kind = QT_Q3_K, .rows = 37, .cols = 256},
        {.kind = QT_IQ4_NL, .rows = 37, .cols = 96},
        {.kind = QT_IQ4_XS, .rows = 37, .cols = 256},
        {.kind = QT_MXFP4, .rows = 37, .cols = 96},
    };
    for (size_t i = 0; i < sizeof dev_cases / sizeof dev_cases[0]; i++)
        if (!emulated() || dev_cases[i].rows * dev_cases[i].cols < 4096 * 4096)
            check_device_variant(&dev_cases[i], seed++);
        else
            seed++;

    check_gguf_split_layout(QT_Q4_0, seed++);
    check_gguf_split_layout(QT_Q4_1, seed++);
    check_gguf_split_layout(QT_Q8_0, seed++);
    check_gguf_whole_layout(QT_Q5_0, 37, 96, seed++);
    check_gguf_whole_layout(QT_Q5_1, 37, 96, seed++);
    check_gguf_whole_layout(QT_Q4_K, 5, 512, seed++);
    check_gguf_whole_layout(QT_Q5_K, 5, 512, seed++);
    check_gguf_whole_layout(QT_Q6_K, 5, 512, seed++);
    check_gguf_whole_layout(QT_Q2_K, 5, 512, seed++);
    check_gguf_whole_layout(QT_Q3_K, 5, 512, seed++);
    check_gguf_whole_layout(QT_IQ4_NL, 37, 96, seed++);
    check_gguf_whole_layout(QT_IQ4_XS, 5, 512, seed++);
    check_gguf_whole_layout(QT_MXFP4, 37, 96, seed++);

    check_refusals();

    const dequant_case timed[] = {
        {.kind = QT_NF4, .blocksize = 64, .nested = true, .rows = 4096, .cols = 4096},
        {.kind = QT_NF4, .blocksize = 64, .rows = 4096, .cols = 4096},
        {.kind = QT_AFFINE,
         .rows = 4096,
         .cols = 4096,
         .bits = 4,
         .group_size = 128,
         .zero_domain = QT_ZERO_FLOAT},
        {.kind = QT_AFFINE, .rows = 4096, .cols = 4096, .bits = 8, .symmetric = true},
        {.kind = QT_Q4_0, .rows = 4096, .cols = 4096},
        {.kind = QT_Q8_0, .rows = 4096, .cols = 4096},
        {.kind = QT_Q4_K, .rows = 4096, .cols = 4096},
        {.kind = QT_Q6_K, .rows = 4096, .cols = 4096},
    };
    for (size_t i = 0; i < sizeof timed / sizeof timed[0]; i++)
        if (!emulated())
            time_large(&timed[i], seed++);

    printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}

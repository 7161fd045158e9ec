/*
 * gpu_test_util.h - what the GPU tests of tests/gpu share (header-only,
 * static functions; included by the test_cuda_*.c files only).
 */
#ifndef GPU_TEST_UTIL_H
#define GPU_TEST_UTIL_H

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qtensor.h"

#include <unistd.h>

/* xorshift64*: the same inputs on every machine, no libc rand(). One
 * stream per test file; rng_seed restarts it. */
static inline uint64_t *rng_stream(void)
{
    static uint64_t state = 0x2545f4914f6cdd1dull;
    return &state;
}

static inline void rng_seed(uint64_t seed)
{
    *rng_stream() = seed * 0x9e3779b97f4a7c15ull + 1;
}

static inline double rng_uniform(void)
{
    uint64_t *s = rng_stream();
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (double)((*s * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

/* Box-Muller on two uniforms. */
static inline double rng_normal(void)
{
    double u1 = rng_uniform(), u2 = rng_uniform();
    return sqrt(-2.0 * log(u1 + 1e-300)) * cos(6.283185307179586 * u2);
}

/* A test file's verdicts so far: [0] passed, [1] failed (one translation
 * unit, one count). */
static inline int *gpu_verdicts(void)
{
    static int counts[2];
    return counts;
}

static inline void gpu_report(bool ok, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* `PASS name`, or `FAIL name: detail` with detail from fmt; counted. */
static inline void gpu_report(bool ok, const char *name, const char *fmt, ...)
{
    gpu_verdicts()[ok ? 0 : 1]++;
    if (ok) {
        printf("PASS %s\n", name);
        return;
    }
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    printf("FAIL %s: %s\n", name, detail);
}

/* The closing line, and the exit status: 1 when a check failed, else 0. */
static inline int gpu_summary(void)
{
    printf("%d passed, %d failed\n", gpu_verdicts()[0], gpu_verdicts()[1]);
    return gpu_verdicts()[1] ? 1 : 0;
}

/* The largest |a[i] - b[i]| over n; infinity where either is NaN (a
 * `d > worst` loop would pass it). */
static inline double gpu_worst_abs(const float *a, const float *b, size_t n)
{
    double w = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= w))
            w = isnan(d) ? INFINITY : d;
    }
    return w;
}

/* QL_GPU_EMULATED=1 (tests/gpu/emu/run.sh, the host emulator): the tests
 * skip their timing and their largest shapes, which take minutes there;
 * every kind, shape and edge case still runs. */
static inline bool emulated(void)
{
    const char *e = getenv("QL_GPU_EMULATED");
    return e && strcmp(e, "1") == 0;
}

/* The GGUF kinds read in place only (the k-quants, IQ4_NL, IQ4_XS):
 * qt_quantize cannot write them, so their tensors are random blocks
 * (gpu_random_blocks). */
static inline bool gpu_read_in_place(qt_kind kind)
{
    return kind == QT_Q4_K || kind == QT_Q5_K || kind == QT_Q6_K || kind == QT_Q2_K ||
           kind == QT_Q3_K || kind == QT_IQ4_NL || kind == QT_IQ4_XS;
}

/*
 * rows x cols (cols a multiple of the kind's block: 256, or 32 for IQ4_NL)
 * of random blocks of a read-in-place kind into t, as a GGUF file holds
 * them: random bytes (codes, packed sub-block scales and minimums: every
 * bit pattern occurs), then each block's f16 d (and dmin, where the kind
 * has one) set to a small value from the stream, so every weight is finite
 * and about a model's size (~0.02; tests/test_kquant.h does the same for
 * the Criterion tests, with the same offsets and sizes of d). Returns
 * qt_from_gguf_blocks' code, msg its sentence.
 */
static inline int gpu_random_blocks(qtensor *t, qt_kind kind, int64_t rows, int64_t cols, char *msg,
                                    size_t msg_len)
{
    memset(t, 0, sizeof *t);
    int d_at = 0, dmin_at = -1; /* byte offsets of the f16 d and dmin */
    float dscale = 1e-4f;       /* d's size: |w| ~ d * (largest scale * code) */
    switch (kind) {
    case QT_Q4_K:
    case QT_Q5_K: dmin_at = 2; break;
    case QT_Q6_K: d_at = 208, dscale = 2e-5f; break;
    case QT_Q2_K: d_at = 80, dmin_at = 82; break;
    case QT_Q3_K: d_at = 108; break;
    case QT_IQ4_NL: break;
    case QT_IQ4_XS: dscale = 2e-5f; break;
    default:
        snprintf(msg, msg_len, "gpu_random_blocks: %s is not read in place", qt_kind_name(kind));
        return QL_EINVAL;
    }
    const int64_t per = qt_traits_table[kind].block_size;
    if (rows < 0 || cols % per != 0) {
        snprintf(msg, msg_len, "gpu_random_blocks: %s %lld x %lld: rows are not whole blocks",
                 qt_kind_name(kind), (long long)rows, (long long)cols);
        return QL_EINVAL;
    }
    const size_t bb = qt_traits_table[kind].block_bytes, nb = (size_t)(rows * cols / per);
    uint8_t *b = malloc(nb * bb + 1);
    if (!b) {
        snprintf(msg, msg_len, "gpu_random_blocks: cannot allocate %zu bytes", nb * bb);
        return QL_ENOMEM;
    }
    for (size_t i = 0; i < nb * bb; i++)
        b[i] = (uint8_t)(rng_uniform() * 256.0);
    for (size_t i = 0; i < nb; i++) {
        uint8_t *blk = b + i * bb;
        const uint16_t d = qt_f32_to_f16(dscale * (float)rng_normal());
        const uint16_t dmin = qt_f32_to_f16(1e-4f * fabsf((float)rng_normal()));
        blk[d_at] = (uint8_t)(d & 0xff);
        blk[d_at + 1] = (uint8_t)(d >> 8);
        if (dmin_at >= 0) {
            blk[dmin_at] = (uint8_t)(dmin & 0xff);
            blk[dmin_at + 1] = (uint8_t)(dmin >> 8);
        }
    }
    const int rc = qt_from_gguf_blocks(t, kind, b, nb * bb, rows, cols, msg, msg_len);
    free(b);
    return rc;
}

/* qt_quantize of w (rows x cols) with p, or for a read-in-place kind
 * random blocks (w unused): the weights a GPU test multiplies. */
static inline int gpu_make_weight(qtensor *t, const float *w, int64_t rows, int64_t cols,
                                  const qt_quant_params *p, char *msg, size_t msg_len)
{
    if (gpu_read_in_place(p->kind))
        return gpu_random_blocks(t, p->kind, rows, cols, msg, msg_len);
    memset(t, 0, sizeof *t);
    return qt_quantize(t, w, rows, cols, p, msg, msg_len);
}

/*
 * A fixture folder of tests/fixtures (config.json and model.safetensors, as
 * transformers saved them) linked into a new scratch folder beside a
 * two-token byte-level tokenizer.json (the GPU tests feed ids), for
 * eng_model_load. dir gets the folder's path (len >= 32). Returns QL_OK,
 * or QL_EIO when a file cannot be made; remove the folder with
 * gpu_fixture_folder_remove either way.
 */
static inline int gpu_fixture_folder(const char *folder, char *dir, size_t len)
{
    static const char *const files[] = {"config.json", "model.safetensors", "tokenizer.json"};
    char from[1024], to[1100];
    snprintf(dir, len, "/tmp/ql-gpu-fixture-XXXXXX");
    if (!mkdtemp(dir)) {
        dir[0] = '\0';
        return QL_EIO;
    }
    int rc = QL_OK;
    for (int i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/%s/%s", QL_FIXTURES, folder, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        if (symlink(from, to) != 0)
            rc = QL_EIO;
    }
    snprintf(to, sizeof to, "%s/%s", dir, files[2]);
    FILE *f = fopen(to, "w");
    if (!f)
        return QL_EIO;
    fputs("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []},"
          " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}}",
          f);
    fclose(f);
    return rc;
}

/* Remove what gpu_fixture_folder made (an empty dir: nothing). */
static inline void gpu_fixture_folder_remove(const char *dir)
{
    static const char *const files[] = {"config.json", "model.safetensors", "tokenizer.json"};
    char to[1100];
    if (!dir[0])
        return;
    for (int i = 0; i < 3; i++) {
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        unlink(to);
    }
    rmdir(dir);
}

#endif /* GPU_TEST_UTIL_H */

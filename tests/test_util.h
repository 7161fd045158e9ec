/*
 * test_util.h - small helpers the tests share: a reproducible generator,
 * bit-exact float comparison, the one tolerance comparison (test_diff, and
 * test_max_abs_err / test_worst_row_l2 over it), temporary paths, writing
 * and copying files, sleeping, and test_cannot_run (a loud skip, a failure
 * under QL_REQUIRE_ALL=1).
 */
#ifndef QL_TEST_UTIL_H
#define QL_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static inline void test_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* splitmix64: the same stream on every machine */
static inline uint64_t test_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline double test_uniform(uint64_t *s)
{
    return (double)(test_rand(s) >> 11) * 0x1.0p-53;
}

static inline float test_normal(uint64_t *s)
{
    double u1 = test_uniform(s), u2 = test_uniform(s);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static inline bool same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/*
 * The one comparison of values against a reference within a tolerance
 * (logits, dequantized weights, merged deltas): every pair is fed to
 * test_diff_add, and test_diff_abs / test_diff_rel give the largest error,
 * or +inf when any value of either side was NaN or infinite, or nothing was
 * compared, so `cr_assert(test_diff_abs(&d) <= tol)` fails on all of them
 * (a `d > worst ? d : worst` or fmax loop lets NaN pass). Relative is to
 * the reference's largest magnitude (a norm, not per element); test_diff_l2
 * is the relative L2 error ||got - want|| / ||want|| (the forward-pass
 * tests' measure), +inf on the same pairs.
 */
typedef struct test_diff {
    double max_abs; /* over the finite pairs */
    double max_ref; /* the largest |reference| */
    double sq_err;  /* sum of (got - want)^2 over the finite pairs */
    double sq_ref;  /* sum of want^2 over the finite pairs */
    size_t n;       /* pairs fed */
    size_t bad;     /* pairs with a NaN or an infinity on either side */
    size_t worst;   /* index of the largest error (the first bad pair when bad) */
} test_diff;

static inline void test_diff_add(test_diff *d, double got, double want)
{
    size_t i = d->n++;
    if (!isfinite(got) || !isfinite(want)) {
        if (d->bad++ == 0)
            d->worst = i;
        return;
    }
    double e = fabs(got - want);
    if (e > d->max_abs) {
        d->max_abs = e;
        if (d->bad == 0)
            d->worst = i;
    }
    if (fabs(want) > d->max_ref)
        d->max_ref = fabs(want);
    d->sq_err += e * e;
    d->sq_ref += want * want;
}

static inline double test_diff_abs(const test_diff *d)
{
    return d->bad || d->n == 0 ? INFINITY : d->max_abs;
}

static inline double test_diff_rel(const test_diff *d)
{
    if (d->bad || d->n == 0)
        return INFINITY;
    return d->max_ref > 0 ? d->max_abs / d->max_ref : d->max_abs;
}

static inline double test_diff_l2(const test_diff *d)
{
    if (d->bad || d->n == 0)
        return INFINITY;
    return d->sq_ref > 0 ? sqrt(d->sq_err / d->sq_ref) : sqrt(d->sq_err);
}

static inline test_diff test_diff_f32(const float *got, const float *want, size_t n)
{
    test_diff d = {0};
    for (size_t i = 0; i < n; i++)
        test_diff_add(&d, got[i], want[i]);
    return d;
}

static inline test_diff test_diff_f64(const float *got, const double *want, size_t n)
{
    test_diff d = {0};
    for (size_t i = 0; i < n; i++)
        test_diff_add(&d, got[i], want[i]);
    return d;
}

/* The largest |got - want| over n values: test_diff_abs of test_diff_f64,
 * so +inf when any value of either side is NaN or infinite (the forward
 * tests' "worst logit error" against float64 reference logits). */
static inline double test_max_abs_err(const float *got, const double *want, size_t n)
{
    test_diff d = test_diff_f64(got, want, n);
    return test_diff_abs(&d);
}

/* The largest of test_diff_l2 over `rows` rows of `cols` values each (a
 * relative error per position, the worst position's): +inf when any value
 * is NaN or infinite. */
static inline double test_worst_row_l2(const float *got, const double *want, size_t rows,
                                       size_t cols)
{
    double worst = 0;
    for (size_t r = 0; r < rows; r++) {
        test_diff d = test_diff_f64(got + r * cols, want + r * cols, cols);
        double e = test_diff_l2(&d);
        if (!(e <= worst)) /* a NaN can never be an answer here, but would be kept */
            worst = e;
    }
    return worst;
}

/* The n floats of a widened to double (malloc'd; the caller frees), to
 * use one run's logits as another's reference. */
static inline double *test_widen(const float *a, size_t n)
{
    double *out = malloc(n * sizeof *out);
    for (size_t i = 0; out && i < n; i++)
        out[i] = a[i];
    return out;
}

/* Whether CI asked that every test run (QL_REQUIRE_ALL=1, set by .ci/run). */
static inline bool test_require_all(void)
{
    const char *v = getenv("QL_REQUIRE_ALL");
    return v && strcmp(v, "1") == 0;
}

/*
 * A test that cannot run here (its model or tool is absent): said loudly
 * on stderr and skipped, or, under QL_REQUIRE_ALL=1, failed with the same
 * words, so CI never counts a skip as a pass. Only for what a machine may
 * lack; a test left out of a build on purpose is not compiled there.
 */
#define test_cannot_run(...)                                                                       \
    do {                                                                                           \
        fprintf(stderr, "NOT RUN (%s:%d): ", __FILE__, __LINE__);                                  \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fputc('\n', stderr);                                                                       \
        if (test_require_all())                                                                    \
            cr_assert_fail("QL_REQUIRE_ALL=1 and this test cannot run: " __VA_ARGS__);             \
        cr_skip_test(__VA_ARGS__);                                                                 \
    } while (0)

/* A fresh directory under $TMPDIR (or /tmp); the caller removes it. */
static inline void test_tmpdir(char *buf, size_t len)
{
    const char *base = getenv("TMPDIR");
    snprintf(buf, len, "%s/qlserve-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(buf))
        buf[0] = 0;
}

/* Copy the file `from` to `to`; false when either cannot be opened or a
 * read or write fails (tests assert it: cr_assert(test_copy_file(...))). */
static inline bool test_copy_file(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    bool ok = in && out;
    char buf[8192];
    for (size_t n; ok && (n = fread(buf, 1, sizeof buf, in)) > 0;)
        ok = fwrite(buf, 1, n, out) == n;
    ok = ok && !ferror(in);
    if (in)
        fclose(in);
    if (out && fclose(out) != 0)
        ok = false;
    return ok;
}

/* Write len bytes of data to path (made or replaced); false when it
 * cannot be opened or a write fails. */
static inline bool test_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return false;
    bool ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok;
}

/* A file's whole contents, NUL-terminated (malloc'd; the caller frees),
 * its length in *len when len is not NULL; NULL when it cannot be read. */
static inline char *test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    char *text = n >= 0 && fseek(f, 0, SEEK_SET) == 0 ? malloc((size_t)n + 1) : NULL;
    if (text && fread(text, 1, (size_t)n, f) != (size_t)n) {
        free(text);
        text = NULL;
    }
    fclose(f);
    if (text) {
        text[n] = 0;
        if (len)
            *len = (size_t)n;
    }
    return text;
}

/* The asserting forms, for Criterion tests (bench/ includes this header
 * without Criterion and uses only the functions): text or len bytes into
 * path (made or replaced), a file copied. */
#define test_write_text(path, text)                                                                \
    cr_assert(test_write_file(path, text, strlen(text)), "cannot write %s", path)
#define test_write_bytes(path, data, len)                                                          \
    cr_assert(test_write_file(path, data, len), "cannot write %s", path)
#define copy_file(from, to) cr_assert(test_copy_file(from, to), "cannot copy %s to %s", from, to)

static inline void test_rmtree(const char *dir)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

/* The default real model, when scripts/fetch-model.sh has put it in place:
 * $QLSERVE_MODEL, else $QLSERVE_CACHE/models/..., else
 * ~/.cache/qlserve/models/... (the script's own cache); whether it is
 * readable. Tests that want it skip, naming the script, when it is not;
 * the benchmarks (bench/bench_server.h) default to it. */
static inline bool test_default_model_path(char *buf, size_t len)
{
    const char *env = getenv("QLSERVE_MODEL");
    const char *cache = getenv("QLSERVE_CACHE");
    const char *home = getenv("HOME");
    if (env && *env)
        snprintf(buf, len, "%s", env);
    else if (cache && *cache)
        snprintf(buf, len, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", cache);
    else
        snprintf(buf, len, "%s/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 home ? home : "/root");
    return access(buf, R_OK) == 0;
}

#endif

/*
 * test_util.h - small helpers the tests share: a reproducible generator,
 * bit-exact float comparison, temporary paths, sleeping.
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

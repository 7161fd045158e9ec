/*
 * test_safetensors.c - the safetensors reader refuses every truncated or
 * corrupt file with a message naming the file and the tensor, never reading
 * past the end (run under AddressSanitizer in CI); the writer round-trips.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "modelfile.h"
#include "test_util.h"

static char dir[512];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0], "no temporary directory");
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(safetensors, .init = setup, .fini = teardown);

/* path's whole contents (the caller frees), its length in *n. */
static uint8_t *read_bytes(const char *path, size_t *n)
{
    uint8_t *p = (uint8_t *)test_read_file(path, n);
    cr_assert(p, "cannot open %s", path);
    return p;
}

/* A file made of a literal JSON header and `data_len` bytes of data. */
static void write_raw(const char *path, const char *json, size_t data_len)
{
    size_t hl = strlen(json);
    uint8_t *buf = calloc(8 + hl + data_len + 1, 1);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, json, hl);
    test_write_bytes(path, buf, 8 + hl + data_len);
    free(buf);
}

static void make_sample(const char *path)
{
    st_writer *w = st_writer_new();
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    int64_t c[1] = {42};
    int64_t sa[2] = {2, 3}, sb[1] = {4}, sc[1] = {1};
    char msg[256];
    cr_assert_eq(st_writer_add(w, "a.weight", ST_F32, 2, sa, a, sizeof a, true, msg, 256), 0);
    cr_assert_eq(st_writer_add(w, "b.norm", ST_BF16, 1, sb, b, sizeof b, true, msg, 256), 0);
    cr_assert_eq(st_writer_add(w, "c.steps", ST_I64, 1, sc, c, sizeof c, true, msg, 256), 0);
    cr_assert_eq(st_writer_set_metadata(w, "format", "pt"), 0);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
}

Test(safetensors, writer_output_reads_back)
{
    char path[600];
    snprintf(path, sizeof path, "%s/s.safetensors", dir);
    make_sample(path);
    st_file f;
    char msg[256];
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(f.n_tensors, 3u);
    const st_tensor *a = st_find(&f, "a.weight");
    cr_assert(a);
    cr_assert_eq(a->dtype, ST_F32);
    cr_assert_eq(a->ndim, 2);
    cr_assert_eq(a->shape[0], 2);
    cr_assert_eq(a->shape[1], 3);
    float av[6];
    memcpy(av, a->data, sizeof av);
    cr_assert_eq(av[5], 6.0f);
    cr_assert_eq(st_find(&f, "c.steps")->dtype, ST_I64);
    cr_assert_eq(f.n_meta, 1u);
    cr_assert_str_eq(f.meta_keys[0], "format");
    cr_assert_str_eq(f.meta_values[0], "pt");
    cr_assert_null(st_find(&f, "missing"));
    /* data starts 8-byte aligned, as the format's own writer does it */
    uint64_t hl = 0;
    memcpy(&hl, f.map, 8);
    cr_assert_eq(hl % 8, 0u);
    st_close(&f);
}

Test(safetensors, every_truncation_is_refused)
{
    char path[600], cut[600];
    snprintf(path, sizeof path, "%s/s.safetensors", dir);
    snprintf(cut, sizeof cut, "%s/cut.safetensors", dir);
    make_sample(path);
    size_t n;
    uint8_t *bytes = read_bytes(path, &n);
    for (size_t len = 0; len < n; len++) {
        test_write_bytes(cut, bytes, len);
        st_file f;
        char msg[512] = "";
        int rc = st_open(&f, cut, msg, sizeof msg);
        cr_assert_neq(rc, 0, "a file cut to %zu of %zu bytes was accepted", len, n);
        cr_assert(strstr(msg, cut), "message does not name the file: %s", msg);
    }
    free(bytes);
}

Test(safetensors, corrupt_headers_are_refused_by_name)
{
    char path[600];
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    struct {
        const char *json;
        size_t data;
        const char *expect;
    } cases[] = {
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8, "'t'"},
        {"{\"t\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "F33"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "3 F32 elements"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "shape[0]"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "data_offsets"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"u\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         16, "overlap"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
         16, "twice"},
        {"{\"t\": [1, 2]}", 0, "not an object"},
        {"[1, 2]", 0, "'{'"},
        {"{\"t\":", 0, "JSON"},
        {"{\"__metadata__\":{\"k\":3}}", 0, "__metadata__"},
        {"{\"__metadata__\":{\"k\":\"a\"},\"__metadata__\":{\"k\":\"b\"}}", 0,
         "__metadata__ appears twice"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_raw(path, cases[i].json, cases[i].data);
        st_file f;
        char msg[512] = "";
        cr_assert_neq(st_open(&f, path, msg, sizeof msg), 0, "case %zu accepted", i);
        cr_assert(strstr(msg, cases[i].expect), "case %zu: '%s' lacks '%s'", i, msg,
                  cases[i].expect);
        cr_assert(strstr(msg, path), "case %zu: no file name: %s", i, msg);
    }
}

Test(safetensors, header_length_past_the_end_or_huge_is_refused)
{
    char path[600];
    snprintf(path, sizeof path, "%s/len.safetensors", dir);
    uint8_t buf[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    test_write_bytes(path, buf, 10);
    st_file f;
    char msg[512];
    cr_assert_neq(st_open(&f, path, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "100 MB"), "%s", msg);
    uint8_t buf2[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    test_write_bytes(path, buf2, 10);
    cr_assert_neq(st_open(&f, path, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "past the end"), "%s", msg);
    cr_assert_neq(st_open(&f, "/nonexistent/x.safetensors", msg, sizeof msg), 0);
    cr_assert(strstr(msg, "/nonexistent/x.safetensors"), "%s", msg);
}

Test(safetensors, random_corruption_never_crashes, .timeout = 60)
{
    char path[600], bad[600];
    snprintf(path, sizeof path, "%s/s.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/fuzz.safetensors", dir);
    make_sample(path);
    size_t n;
    uint8_t *bytes = read_bytes(path, &n);
    uint8_t *copy = malloc(n);
    uint64_t rng = 4242;
    for (int i = 0; i < 3000; i++) {
        memcpy(copy, bytes, n);
        int flips = 1 + (int)(test_rand(&rng) % 4);
        for (int k = 0; k < flips; k++)
            copy[test_rand(&rng) % n] = (uint8_t)test_rand(&rng);
        test_write_bytes(bad, copy, n);
        st_file f;
        char msg[512];
        if (st_open(&f, bad, msg, sizeof msg) == 0) {
            /* accepted: every tensor must then lie inside the mapping */
            for (size_t t = 0; t < f.n_tensors; t++) {
                const st_tensor *ten = &f.tensors[t];
                cr_assert(ten->data >= f.map && ten->data + ten->nbytes <= f.map + f.map_len);
            }
            st_close(&f);
        }
    }
    free(copy);
    free(bytes);
}

Test(safetensors, writer_refuses_duplicates_and_wrong_sizes)
{
    st_writer *w = st_writer_new();
    float a[4] = {0};
    int64_t s[1] = {4};
    char msg[256];
    cr_assert_eq(st_writer_add(w, "a", ST_F32, 1, s, a, 16, false, msg, sizeof msg), 0);
    cr_assert_neq(st_writer_add(w, "a", ST_F32, 1, s, a, 16, false, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "'a'"), "%s", msg);
    cr_assert_neq(st_writer_add(w, "b", ST_F32, 1, s, a, 12, false, msg, sizeof msg), 0);
    char path[600];
    snprintf(path, sizeof path, "%s/no/such/dir/out.safetensors", dir);
    cr_assert_neq(st_writer_write(w, path, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "out.safetensors"), "%s", msg);
    st_writer_free(w);
}

/* A header of n one-byte U8 tensors "t000000".. with their data; when
 * dup_last, the last entry repeats the first one's name (at its own bytes). */
static void write_many(const char *path, size_t n, bool dup_last)
{
    size_t cap = n * 80 + 16, at = 0;
    char *json = malloc(cap);
    json[at++] = '{';
    for (size_t i = 0; i < n; i++)
        at += (size_t)snprintf(json + at, cap - at,
                               "%s\"t%06zu\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%zu,"
                               "%zu]}",
                               i ? "," : "", dup_last && i == n - 1 ? (size_t)0 : i, i, i + 1);
    json[at++] = '}';
    json[at] = 0;
    write_raw(path, json, n);
    free(json);
}

/* The duplicate-name check sorts the names: 200,000 of them are checked in
 * well under a second (the pairwise check it replaced took minutes), and
 * st_find finds each by binary search. */
Test(safetensors, a_header_of_200000_names_opens_quickly)
{
    char path[600], msg[512] = "";
    snprintf(path, sizeof path, "%s/many.safetensors", dir);
    enum { N = 200000 };
    write_many(path, N, false);
    st_file f;
    double t0 = ql_now_s();
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    double took = ql_now_s() - t0;
    cr_assert_eq(f.n_tensors, N);
    /* generous for a sanitizer build on a loaded machine; n^2 / 2 = 2e10
     * name comparisons cannot finish in it */
    cr_assert_lt(took, 15.0, "st_open of %d names took %.1f s", N, took);
    for (size_t i = 0; i < N; i += 997) {
        char name[32];
        snprintf(name, sizeof name, "t%06zu", i);
        const st_tensor *t = st_find(&f, name);
        cr_assert(t && strcmp(t->name, name) == 0 && t->data == f.map + (f.map_len - N) + i, "%s",
                  name);
    }
    cr_assert_not_null(st_find(&f, "t199999"));
    cr_assert_null(st_find(&f, "t200000"));
    cr_assert_null(st_find(&f, ""));
    st_close(&f);
}

Test(safetensors, a_duplicate_name_far_apart_is_refused_by_name)
{
    char path[600], msg[512] = "";
    snprintf(path, sizeof path, "%s/dup.safetensors", dir);
    write_many(path, 200000, true);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "tensor 't000000' appears twice"), "%s", msg);
    cr_assert(strstr(msg, path), "%s", msg);
}

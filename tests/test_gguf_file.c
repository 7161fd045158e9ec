/*
 * test_gguf_file.c - the GGUF reader refuses every truncated or corrupt file
 * with a message naming the file and the key or tensor, never reading past
 * the end (run under AddressSanitizer in CI); the writer round-trips every
 * metadata type; the six runnable tensor kinds are read in place and
 * dequantize to what was written; a file made by the reference writer
 * (gguf-py, tests/fixtures/tiny_ref.gguf) reads as gguf-py wrote it.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures/gguf_kquant_vectors.h"
#include "fixtures/mxfp4_vectors.h"
#include "gguf_writer.h"
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

TestSuite(gguf_file, .init = setup, .fini = teardown);

/* path's whole contents (the caller frees), its length in *n. */
static uint8_t *read_bytes(const char *path, size_t *n)
{
    uint8_t *p = (uint8_t *)test_read_file(path, n);
    cr_assert(p, "cannot open %s", path);
    return p;
}

/* --- hand-built files, for what the writer will not produce -------------- */

typedef struct raw {
    uint8_t p[8192];
    size_t len;
} raw;

static void raw_put(raw *r, const void *s, size_t n)
{
    cr_assert(r->len + n <= sizeof r->p);
    memcpy(r->p + r->len, s, n);
    r->len += n;
}

static void raw_le(raw *r, uint64_t v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)(v >> (8 * i));
        raw_put(r, &b, 1);
    }
}

static void raw_str(raw *r, const char *s)
{
    raw_le(r, strlen(s), 8);
    raw_put(r, s, strlen(s));
}

static void raw_header(raw *r, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    r->len = 0;
    raw_put(r, "GGUF", 4);
    raw_le(r, version, 4);
    raw_le(r, n_tensors, 8);
    raw_le(r, n_kv, 8);
}

static void raw_tensor(raw *r, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                       uint64_t offset)
{
    raw_str(r, name);
    raw_le(r, n_dims, 4);
    for (uint32_t d = 0; d < n_dims; d++)
        raw_le(r, ne[d], 8);
    raw_le(r, type, 4);
    raw_le(r, offset, 8);
}

static void raw_pad(raw *r, size_t align)
{
    while (r->len % align)
        raw_le(r, 0, 1);
}

static void raw_zeros(raw *r, size_t n)
{
    for (size_t i = 0; i < n; i++)
        raw_le(r, 0, 1);
}

/* Write r to path, open it, and check it is refused with a message that
 * names the file and holds `what` (and `also`, when not NULL). */
static void expect_refused(const char *path, const raw *r, const char *what, const char *also)
{
    test_write_bytes(path, r->p, r->len);
    gguf_file f;
    char msg[512] = "";
    int rc = gguf_open(&f, path, msg, sizeof msg);
    cr_assert_neq(rc, QL_OK, "accepted; expected a refusal about '%s'", what);
    cr_assert_eq(rc, QL_EFORMAT, "code %d for '%s': %s", rc, what, msg);
    cr_assert(strstr(msg, path), "message does not name the file: %s", msg);
    cr_assert(strstr(msg, what), "message lacks '%s': %s", what, msg);
    cr_assert(!also || strstr(msg, also), "message lacks '%s': %s", also ? also : "", msg);
    cr_assert_null(f.map, "a refused file stays mapped");
}

/* --- a sample written by our writer -------------------------------------- */

#define ROWS 4
#define COLS 64

static float sample_input(int k, int i)
{
    uint64_t s = (uint64_t)(k * 1000 + i) * 2654435761u;
    return test_normal(&s);
}

/* The six runnable kinds, each ROWS x COLS, quantized with qt_quantize
 * (GGUF kinds) or converted (dense); q[k] is what was written. */
static const struct {
    const char *name;
    qt_kind kind;
    uint32_t ggml;
} runnable[] = {
    {"w.f32", QT_F32, GGML_TYPE_F32},    {"w.f16", QT_F16, GGML_TYPE_F16},
    {"w.bf16", QT_BF16, GGML_TYPE_BF16}, {"w.q4_0", QT_Q4_0, GGML_TYPE_Q4_0},
    {"w.q4_1", QT_Q4_1, GGML_TYPE_Q4_1}, {"w.q8_0", QT_Q8_0, GGML_TYPE_Q8_0},
};
#define N_RUNNABLE (sizeof runnable / sizeof *runnable)

static void make_runnable(qtensor *q)
{
    float in[ROWS * COLS];
    char msg[256];
    for (size_t k = 0; k < N_RUNNABLE; k++) {
        for (int i = 0; i < ROWS * COLS; i++)
            in[i] = sample_input((int)k, i);
        qt_quant_params p = {.kind = runnable[k].kind};
        cr_assert_eq(qt_quantize(&q[k], in, ROWS, COLS, &p, msg, sizeof msg), QL_OK, "%s", msg);
    }
}

static const uint8_t u8s[] = {0, 7, 255};
static const int8_t i8s[] = {-128, 0, 127};
static const uint16_t u16s[] = {0, 65535};
static const int16_t i16s[] = {-32768, 5, 32767};
static const uint32_t u32s[] = {1, 4000000000u};
static const int32_t i32s[] = {-2147483647 - 1, 1, 2147483647};
static const float f32s[] = {0.5f, -1.25f, 3.0e38f};
static const bool bools[] = {true, false, true, true};
static const uint64_t u64s[] = {0, 18446744073709551615ull};
static const int64_t i64s[] = {-9000000000000000000ll, 42};
static const double f64s[] = {1.0e300, -0.125};
static const char *const strs[] = {"<s>", "", "\xe2\x96\x81the", "\xc3\xbc"};

/* A file with metadata of every type the writer sets, the six runnable
 * kinds, an iq2_xxs and a tq1_0 tensor (types qlserve does not run), a 3-D
 * tensor, and a last tensor of 32 bytes so the file ends where that tensor
 * does (no padding after it). */
static void make_sample(const char *path, const qtensor *q)
{
    gguf_writer *w = gguf_writer_new();
    cr_assert(w);
    cr_assert_eq(gguf_writer_set_str(w, "general.architecture", "llama"), QL_OK);
    cr_assert_eq(gguf_writer_set_u32(w, "test.u32", 4000000000u), QL_OK);
    cr_assert_eq(gguf_writer_set_i32(w, "test.i32", -7), QL_OK);
    cr_assert_eq(gguf_writer_set_f32(w, "test.f32", 0.1f), QL_OK);
    cr_assert_eq(gguf_writer_set_bool(w, "test.bool", true), QL_OK);
    cr_assert_eq(gguf_writer_set_bool(w, "test.false", false), QL_OK);
    cr_assert_eq(gguf_writer_set_str(w, "test.str", "h\xc3\xa9llo"), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.u8", GGUF_UINT8, u8s, 3), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.i8", GGUF_INT8, i8s, 3), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.u16", GGUF_UINT16, u16s, 2), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.i16", GGUF_INT16, i16s, 3), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.u32", GGUF_UINT32, u32s, 2), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.i32", GGUF_INT32, i32s, 3), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.f32", GGUF_FLOAT32, f32s, 3), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.bool", GGUF_BOOL, bools, 4), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.u64", GGUF_UINT64, u64s, 2), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.i64", GGUF_INT64, i64s, 2), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.f64", GGUF_FLOAT64, f64s, 2), QL_OK);
    cr_assert_eq(gguf_writer_set_array(w, "arr.empty", GGUF_INT32, NULL, 0), QL_OK);
    cr_assert_eq(gguf_writer_set_str_array(w, "arr.str", strs, 4), QL_OK);
    cr_assert_eq(gguf_writer_set_str_array(w, "arr.nostr", NULL, 0), QL_OK);
    int64_t ne[4] = {COLS, ROWS};
    for (size_t k = 0; k < N_RUNNABLE; k++)
        cr_assert_eq(gguf_writer_add_tensor(w, runnable[k].name, runnable[k].ggml, 2, ne, q[k].data,
                                            q[k].data_bytes),
                     QL_OK, "%s", runnable[k].name);
    uint8_t other[2 * 66];
    for (size_t j = 0; j < sizeof other; j++)
        other[j] = (uint8_t)(j * 7);
    int64_t ne_k[2] = {256, 2};
    /* GGML 16 (iq2_xxs, 66 bytes per 256) and 34 (tq1_0, 54 bytes per 256) */
    cr_assert_eq(gguf_writer_add_tensor(w, "w.iq2_xxs", 16, 2, ne_k, other, 2 * 66), QL_OK);
    cr_assert_eq(gguf_writer_add_tensor(w, "w.tq1_0", 34, 2, ne_k, other, 2 * 54), QL_OK);
    float cube[32 * 2 * 3];
    for (int i = 0; i < 32 * 2 * 3; i++)
        cube[i] = (float)i - 50.0f;
    int64_t ne3[3] = {32, 2, 3};
    cr_assert_eq(gguf_writer_add_tensor(w, "w.3d", GGML_TYPE_F32, 3, ne3, cube, sizeof cube),
                 QL_OK);
    float last[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t ne_last[1] = {8};
    cr_assert_eq(gguf_writer_add_tensor(w, "last", GGML_TYPE_F32, 1, ne_last, last, sizeof last),
                 QL_OK);
    char msg[256];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), QL_OK, "%s", msg);
    gguf_writer_free(w);
}

static void sample_path(char *path, size_t len, const char *name)
{
    snprintf(path, len, "%s/%s", dir, name);
}

static const gguf_kv *kv_of(const gguf_file *f, const char *key, gguf_type type, gguf_type elem,
                            uint64_t n)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    cr_assert(kv, "key %s missing", key);
    cr_assert_eq(kv->type, type, "%s: type %d", key, kv->type);
    cr_assert_eq(kv->elem, elem, "%s: elem %d", key, kv->elem);
    cr_assert_eq(kv->n, n, "%s: n %llu", key, (unsigned long long)kv->n);
    return kv;
}

static bool str_is(gguf_str s, const char *want)
{
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

Test(gguf_file, writer_round_trips_every_metadata_type)
{
    char path[600];
    sample_path(path, sizeof path, "s.gguf");
    qtensor q[N_RUNNABLE];
    make_runnable(q);
    make_sample(path, q);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.version, 3u);
    cr_assert_eq(f.alignment, 32u);
    cr_assert_eq(f.data_offset % 32, 0u);
    cr_assert_eq(f.n_kv, 21u);

    /* keys keep the order they were set in */
    cr_assert_str_eq(f.kvs[0].key, "general.architecture");
    cr_assert(str_is(kv_of(&f, "general.architecture", GGUF_STRING, GGUF_STRING, 1)->str, "llama"));
    const gguf_kv *kv = kv_of(&f, "test.u32", GGUF_UINT32, GGUF_UINT32, 1);
    cr_assert_eq(kv->u, 4000000000u);
    cr_assert_eq(kv->i, 4000000000);
    kv = kv_of(&f, "test.i32", GGUF_INT32, GGUF_INT32, 1);
    cr_assert_eq(kv->i, -7);
    cr_assert_eq(kv->u, 0u, "a negative value has no unsigned form");
    cr_assert(same_bits((float)kv_of(&f, "test.f32", GGUF_FLOAT32, GGUF_FLOAT32, 1)->f, 0.1f));
    cr_assert_eq(kv_of(&f, "test.bool", GGUF_BOOL, GGUF_BOOL, 1)->u, 1u);
    cr_assert_eq(kv_of(&f, "test.false", GGUF_BOOL, GGUF_BOOL, 1)->u, 0u);
    cr_assert(str_is(kv_of(&f, "test.str", GGUF_STRING, GGUF_STRING, 1)->str, "h\xc3\xa9llo"));

    /* numeric arrays: packed little-endian at data, byte for byte */
    struct {
        const char *key;
        gguf_type elem;
        const void *want;
        size_t n, size;
    } arrays[] = {
        {"arr.u8", GGUF_UINT8, u8s, 3, 1},     {"arr.i8", GGUF_INT8, i8s, 3, 1},
        {"arr.u16", GGUF_UINT16, u16s, 2, 2},  {"arr.i16", GGUF_INT16, i16s, 3, 2},
        {"arr.u32", GGUF_UINT32, u32s, 2, 4},  {"arr.i32", GGUF_INT32, i32s, 3, 4},
        {"arr.f32", GGUF_FLOAT32, f32s, 3, 4}, {"arr.bool", GGUF_BOOL, bools, 4, 1},
        {"arr.u64", GGUF_UINT64, u64s, 2, 8},  {"arr.i64", GGUF_INT64, i64s, 2, 8},
        {"arr.f64", GGUF_FLOAT64, f64s, 2, 8},
    };
    for (size_t a = 0; a < sizeof arrays / sizeof *arrays; a++) {
        kv = kv_of(&f, arrays[a].key, GGUF_ARRAY, arrays[a].elem, arrays[a].n);
        cr_assert(kv->data, "%s: no data", arrays[a].key);
        cr_assert(kv->data >= f.map && kv->data + arrays[a].n * arrays[a].size <= f.map + f.map_len,
                  "%s: data outside the mapping", arrays[a].key);
        cr_assert_eq(memcmp(kv->data, arrays[a].want, arrays[a].n * arrays[a].size), 0,
                     "%s: elements differ", arrays[a].key);
    }
    kv_of(&f, "arr.empty", GGUF_ARRAY, GGUF_INT32, 0);
    kv = kv_of(&f, "arr.str", GGUF_ARRAY, GGUF_STRING, 4);
    for (int i = 0; i < 4; i++)
        cr_assert(str_is(kv->strs[i], strs[i]), "arr.str[%d]", i);
    kv_of(&f, "arr.nostr", GGUF_ARRAY, GGUF_STRING, 0);
    cr_assert_null(gguf_find_kv(&f, "missing"));
    cr_assert_null(gguf_find_tensor(&f, "missing"));
    gguf_close(&f);
    for (size_t k = 0; k < N_RUNNABLE; k++)
        qt_free(&q[k]);
}

Test(gguf_file, every_scalar_type_reads_back_converted)
{
    /* the writer sets u32/i32/f32/bool/str scalars only; the other eight
     * value types come from a hand-built file */
    char path[600];
    sample_path(path, sizeof path, "scalars.gguf");
    raw r;
    raw_header(&r, 2, 0, 9);
    raw_str(&r, "u8");
    raw_le(&r, GGUF_UINT8, 4);
    raw_le(&r, 250, 1);
    raw_str(&r, "i8");
    raw_le(&r, GGUF_INT8, 4);
    raw_le(&r, 0x80, 1);
    raw_str(&r, "u16");
    raw_le(&r, GGUF_UINT16, 4);
    raw_le(&r, 65000, 2);
    raw_str(&r, "i16");
    raw_le(&r, GGUF_INT16, 4);
    raw_le(&r, 0xfffe, 2);
    raw_str(&r, "u64");
    raw_le(&r, GGUF_UINT64, 4);
    raw_le(&r, 0xfffffffffffffff0ull, 8);
    raw_str(&r, "i64");
    raw_le(&r, GGUF_INT64, 4);
    raw_le(&r, (uint64_t)-5, 8);
    raw_str(&r, "f64");
    raw_le(&r, GGUF_FLOAT64, 4);
    double d = -1.0 / 3.0;
    uint64_t bits;
    memcpy(&bits, &d, 8);
    raw_le(&r, bits, 8);
    raw_str(&r, "u64small");
    raw_le(&r, GGUF_UINT64, 4);
    raw_le(&r, 12345, 8);
    raw_str(&r, "i8pos");
    raw_le(&r, GGUF_INT8, 4);
    raw_le(&r, 100, 1);
    test_write_bytes(path, r.p, r.len);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.version, 2u, "version 2 is read too");
    cr_assert_eq(f.n_tensors, 0u);
    const gguf_kv *kv = kv_of(&f, "u8", GGUF_UINT8, GGUF_UINT8, 1);
    cr_assert(kv->u == 250 && kv->i == 250 && kv->f == 250.0);
    kv = kv_of(&f, "i8", GGUF_INT8, GGUF_INT8, 1);
    cr_assert(kv->i == -128 && kv->u == 0 && kv->f == -128.0);
    kv = kv_of(&f, "u16", GGUF_UINT16, GGUF_UINT16, 1);
    cr_assert(kv->u == 65000 && kv->i == 65000);
    kv = kv_of(&f, "i16", GGUF_INT16, GGUF_INT16, 1);
    cr_assert(kv->i == -2 && kv->u == 0);
    kv = kv_of(&f, "u64", GGUF_UINT64, GGUF_UINT64, 1);
    cr_assert_eq(kv->u, 0xfffffffffffffff0ull);
    cr_assert_eq(kv->i, 0, "a u64 past INT64_MAX has no signed form");
    kv = kv_of(&f, "i64", GGUF_INT64, GGUF_INT64, 1);
    cr_assert(kv->i == -5 && kv->u == 0);
    cr_assert_eq(kv_of(&f, "f64", GGUF_FLOAT64, GGUF_FLOAT64, 1)->f, -1.0 / 3.0);
    kv = kv_of(&f, "u64small", GGUF_UINT64, GGUF_UINT64, 1);
    cr_assert(kv->u == 12345 && kv->i == 12345);
    kv = kv_of(&f, "i8pos", GGUF_INT8, GGUF_INT8, 1);
    cr_assert(kv->i == 100 && kv->u == 100);
    gguf_close(&f);
}

Test(gguf_file, runnable_kinds_are_read_in_place_and_dequantize_as_written)
{
    char path[600];
    sample_path(path, sizeof path, "s.gguf");
    qtensor q[N_RUNNABLE];
    make_runnable(q);
    make_sample(path, q);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.n_tensors, N_RUNNABLE + 4);
    for (size_t k = 0; k < N_RUNNABLE; k++) {
        const gguf_tensor *t = gguf_find_tensor(&f, runnable[k].name);
        cr_assert(t, "%s missing", runnable[k].name);
        cr_assert_eq(t->ggml_type, runnable[k].ggml);
        cr_assert_eq(t->n_dims, 2);
        cr_assert(t->ne[0] == COLS && t->ne[1] == ROWS && t->ne[2] == 1 && t->ne[3] == 1);
        cr_assert_eq(t->offset % 32, 0u);
        cr_assert_eq(t->nbytes, q[k].data_bytes);
        qtensor g;
        cr_assert_eq(gguf_tensor_qtensor(&f, t, &g, msg, sizeof msg), QL_OK, "%s", msg);
        cr_assert_eq(g.kind, runnable[k].kind);
        cr_assert(g.rows == ROWS && g.cols == COLS);
        cr_assert(g.data_borrowed, "%s: copied instead of borrowed", runnable[k].name);
        cr_assert_eq(g.data, t->data, "%s: not the mapped bytes", runnable[k].name);
        cr_assert(g.data >= f.map && g.data + g.data_bytes <= f.map + f.map_len);
        cr_assert_eq(g.data_bytes, q[k].data_bytes);
        cr_assert_eq(g.row_stride, q[k].row_stride, "%s: row stride", runnable[k].name);
        cr_assert_eq(memcmp(g.data, q[k].data, g.data_bytes), 0);
        if (qt_traits_table[g.kind].is_gguf) {
            /* the same fields qt_from_gguf_blocks gives, but borrowed */
            qtensor c;
            cr_assert_eq(
                qt_from_gguf_blocks(&c, g.kind, t->data, t->nbytes, ROWS, COLS, msg, sizeof msg),
                QL_OK, "%s", msg);
            cr_assert(c.rows == g.rows && c.cols == g.cols && c.row_stride == g.row_stride &&
                      c.data_bytes == g.data_bytes);
            qt_free(&c);
        }
        float want[ROWS * COLS], got[ROWS * COLS];
        qt_dequantize_rows_ref(&q[k], 0, ROWS, want);
        qt_dequantize_rows(&g, 0, ROWS, got);
        for (int i = 0; i < ROWS * COLS; i++)
            cr_assert(same_bits(got[i], want[i]), "%s: value %d: %a vs %a", runnable[k].name, i,
                      (double)got[i], (double)want[i]);
        /* and a row range alone, through the row stride */
        qt_dequantize_rows(&g, 2, 1, got);
        for (int i = 0; i < COLS; i++)
            cr_assert(same_bits(got[i], want[2 * COLS + i]), "%s: row 2", runnable[k].name);
        if (runnable[k].kind == QT_F32)
            for (int i = 0; i < ROWS * COLS; i++)
                cr_assert(same_bits(want[i], sample_input((int)k, i)), "f32 value %d", i);
        qt_free(&g);
        cr_assert_eq(memcmp(t->data, q[k].data, t->nbytes), 0, "qt_free touched mapped data");
    }
    /* a 3-D tensor: rows = ne[1] * ne[2] */
    const gguf_tensor *t = gguf_find_tensor(&f, "w.3d");
    cr_assert(t && t->n_dims == 3 && t->ne[2] == 3 && t->ne[3] == 1);
    qtensor g;
    cr_assert_eq(gguf_tensor_qtensor(&f, t, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert(g.rows == 6 && g.cols == 32 && g.kind == QT_F32);
    float cube[6 * 32];
    qt_dequantize_rows(&g, 0, 6, cube);
    for (int i = 0; i < 6 * 32; i++)
        cr_assert_eq(cube[i], (float)i - 50.0f);
    qt_free(&g);
    gguf_close(&f);
    for (size_t k = 0; k < N_RUNNABLE; k++)
        qt_free(&q[k]);
}

Test(gguf_file, unsupported_type_is_accepted_by_open_and_refused_by_name)
{
    char path[600];
    sample_path(path, sizeof path, "s.gguf");
    qtensor q[N_RUNNABLE];
    make_runnable(q);
    make_sample(path, q);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    const struct {
        const char *tensor, *type;
        uint32_t ggml;
        size_t bytes;
    } other[] = {{"w.iq2_xxs", "iq2_xxs", 16, 2 * 66}, {"w.tq1_0", "tq1_0", 34, 2 * 54}};
    for (size_t i = 0; i < 2; i++) {
        const gguf_tensor *t = gguf_find_tensor(&f, other[i].tensor);
        cr_assert(t);
        cr_assert_eq(t->ggml_type, other[i].ggml);
        cr_assert_eq(t->nbytes, other[i].bytes, "%s: bytes per block of 256", other[i].type);
        qtensor g;
        char quoted[64];
        snprintf(quoted, sizeof quoted, "'%s'", other[i].tensor);
        cr_assert_eq(gguf_tensor_qtensor(&f, t, &g, msg, sizeof msg), QL_EUNSUPPORTED);
        cr_assert(strstr(msg, other[i].type) && strstr(msg, quoted) && strstr(msg, path) &&
                      strstr(msg, "cannot run"),
                  "%s", msg);
        /* the message lists what does run, the later kinds among them */
        cr_assert(strstr(msg, "q2_k, q3_k") && strstr(msg, "iq4_xs and mxfp4"), "%s", msg);
        cr_assert_null(g.data);
    }
    gguf_close(&f);
    for (size_t k = 0; k < N_RUNNABLE; k++)
        qt_free(&q[k]);
}

/* blocks (a rows x cols tensor of GGML type ggml) written as the one
 * tensor of a GGUF file at path: it is read in place (borrowed from the
 * mapping) as kind and dequantizes to want, bit for bit. */
static void check_read_in_place(const char *path, const char *name, uint32_t ggml, qt_kind kind,
                                const uint8_t *blocks, size_t bytes, int64_t rows, int64_t cols,
                                const float *want)
{
    gguf_writer *w = gguf_writer_new();
    cr_assert(w);
    cr_assert_eq(gguf_writer_set_str(w, "general.architecture", "llama"), QL_OK);
    int64_t ne[2] = {cols, rows};
    cr_assert_eq(gguf_writer_add_tensor(w, "blk.0.ffn_down.weight", ggml, 2, ne, blocks, bytes),
                 QL_OK, "%s", name);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), QL_OK, "%s", msg);
    gguf_writer_free(w);
    gguf_file f;
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s: %s", name, msg);
    qtensor g;
    cr_assert_eq(gguf_tensor_qtensor(&f, &f.tensors[0], &g, msg, sizeof msg), QL_OK, "%s: %s", name,
                 msg);
    cr_assert(g.kind == kind && g.rows == rows && g.cols == cols && g.data_borrowed &&
                  g.data == f.tensors[0].data,
              "%s: borrowed in place", name);
    float *got = malloc((size_t)(rows * cols) * sizeof *got);
    qt_dequantize_rows(&g, 0, rows, got);
    for (long i = 0; i < rows * cols; i++)
        cr_assert(same_bits(got[i], want[i]), "%s value %ld: %a vs %a", name, i, (double)got[i],
                  (double)want[i]);
    free(got);
    qt_free(&g);
    gguf_close(&f);
}

/* Q2_K, Q3_K, IQ4_NL and IQ4_XS tensors (the known-answer vectors' blocks)
 * written to a GGUF file are read in place as their kinds and dequantize
 * to the vectors' values, bit for bit. */
Test(gguf_file, later_kquant_and_iq4_tensors_are_read_in_place)
{
    const struct {
        const char *type;
        uint32_t ggml;
        qt_kind kind;
    } later[] = {{"q2_k", GGML_TYPE_Q2_K, QT_Q2_K},
                 {"q3_k", GGML_TYPE_Q3_K, QT_Q3_K},
                 {"iq4_nl", GGML_TYPE_IQ4_NL, QT_IQ4_NL},
                 {"iq4_xs", GGML_TYPE_IQ4_XS, QT_IQ4_XS}};
    char path[600];
    sample_path(path, sizeof path, "later.gguf");
    int seen = 0;
    for (size_t c = 0; c < sizeof gkqv_cases / sizeof *gkqv_cases; c++) {
        const gkqv_case *k = &gkqv_cases[c];
        size_t which = 0;
        while (which < 4 && strcmp(later[which].type, k->type) != 0)
            which++;
        if (which == 4)
            continue;
        check_read_in_place(path, k->name, later[which].ggml, later[which].kind, k->blocks,
                            (size_t)k->blocks_len, k->rows, k->cols, k->dequant);
        seen++;
    }
    cr_assert_geq(seen, 8, "every later type's vectors");
}

/* An MXFP4 tensor (GGML type 39) in a GGUF file is read in place as
 * QT_MXFP4 and dequantizes to gguf-py's values, bit for bit. */
Test(gguf_file, mxfp4_tensors_are_read_in_place)
{
    char path[600];
    sample_path(path, sizeof path, "mxfp4.gguf");
    size_t n_cases = sizeof mxv_deq_cases / sizeof *mxv_deq_cases;
    for (size_t c = 0; c < n_cases; c++) {
        const mxv_deq_case *k = &mxv_deq_cases[c];
        check_read_in_place(path, k->name, GGML_TYPE_MXFP4, QT_MXFP4, k->blocks,
                            (size_t)(k->rows * k->cols / 32 * 17), k->rows, k->cols, k->values);
    }
    cr_assert_geq(n_cases, 2);
}

Test(gguf_file, ggml_type_names_and_sizes_follow_ggml)
{
    struct {
        uint32_t type;
        const char *name;
        int64_t ne0;
        size_t bytes; /* of one row of ne0 elements */
    } types[] = {
        {0, "f32", 1, 4},         {1, "f16", 1, 2},         {2, "q4_0", 32, 18},
        {3, "q4_1", 32, 20},      {6, "q5_0", 32, 22},      {7, "q5_1", 32, 24},
        {8, "q8_0", 32, 34},      {9, "q8_1", 32, 36},      {10, "q2_k", 256, 84},
        {11, "q3_k", 256, 110},   {12, "q4_k", 256, 144},   {13, "q5_k", 256, 176},
        {14, "q6_k", 256, 210},   {15, "q8_k", 256, 292},   {16, "iq2_xxs", 256, 66},
        {17, "iq2_xs", 256, 74},  {18, "iq3_xxs", 256, 98}, {19, "iq1_s", 256, 50},
        {20, "iq4_nl", 32, 18},   {21, "iq3_s", 256, 110},  {22, "iq2_s", 256, 82},
        {23, "iq4_xs", 256, 136}, {24, "i8", 1, 1},         {25, "i16", 1, 2},
        {26, "i32", 1, 4},        {27, "i64", 1, 8},        {28, "f64", 1, 8},
        {29, "iq1_m", 256, 56},   {30, "bf16", 1, 2},       {34, "tq1_0", 256, 54},
        {35, "tq2_0", 256, 66},   {39, "mxfp4", 32, 17},    {40, "nvfp4", 64, 36},
        {41, "q1_0", 128, 18},
    };
    char path[600];
    sample_path(path, sizeof path, "types.gguf");
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        cr_assert_str_eq(gguf_ggml_type_name(types[i].type), types[i].name);
        /* one tensor of 3 rows: gguf_open computes its size from the geometry */
        raw r;
        raw_header(&r, 3, 1, 0);
        uint64_t ne[2] = {(uint64_t)types[i].ne0 * 2, 3};
        raw_tensor(&r, "t", 2, ne, types[i].type, 0);
        raw_pad(&r, 32);
        raw_zeros(&r, types[i].bytes * 2 * 3);
        test_write_bytes(path, r.p, r.len);
        gguf_file f;
        char msg[512];
        cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s: %s", types[i].name, msg);
        cr_assert_eq(f.tensors[0].nbytes, types[i].bytes * 6, "%s", types[i].name);
        gguf_close(&f);
        /* one byte short is refused */
        test_write_bytes(path, r.p, r.len - 1);
        cr_assert_neq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", types[i].name);
        /* ne[0] off the block is refused */
        if (types[i].ne0 > 1) {
            ne[0] = (uint64_t)types[i].ne0 + 1;
            raw_header(&r, 3, 1, 0);
            raw_tensor(&r, "t", 2, ne, types[i].type, 0);
            raw_pad(&r, 32);
            raw_zeros(&r, types[i].bytes * 8);
            expect_refused(path, &r, "not a multiple", types[i].name);
        }
    }
    cr_assert_str_eq(gguf_ggml_type_name(99), "type 99");
    cr_assert_str_eq(gguf_ggml_type_name(31), "q4_0_4_4");
}

Test(gguf_file, unknown_and_removed_tensor_types_are_refused_by_number)
{
    char path[600];
    sample_path(path, sizeof path, "t.gguf");
    raw r;
    uint64_t ne[1] = {32};
    uint32_t bad[] = {4, 5, 31, 33, 36, 38, 42, 99, 0xffffffffu};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        raw_header(&r, 3, 1, 0);
        raw_tensor(&r, "blk.0.weird", 1, ne, bad[i], 0);
        raw_pad(&r, 32);
        raw_zeros(&r, 256);
        char num[24];
        snprintf(num, sizeof num, "type %u", bad[i]);
        expect_refused(path, &r, num, "'blk.0.weird'");
    }
}

Test(gguf_file, every_truncation_is_refused)
{
    char path[600], cut[600];
    sample_path(path, sizeof path, "s.gguf");
    sample_path(cut, sizeof cut, "cut.gguf");
    qtensor q[N_RUNNABLE];
    make_runnable(q);
    make_sample(path, q);
    size_t n;
    uint8_t *bytes = read_bytes(path, &n);
    /* the sample ends with its last tensor's bytes: every prefix lacks something */
    gguf_file f;
    char msg[512] = "";
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    const gguf_tensor *last = gguf_find_tensor(&f, "last");
    cr_assert_eq(f.data_offset + last->offset + last->nbytes, n);
    gguf_close(&f);
    for (size_t len = 0; len < n; len++) {
        test_write_bytes(cut, bytes, len);
        msg[0] = '\0';
        int rc = gguf_open(&f, cut, msg, sizeof msg);
        cr_assert_neq(rc, QL_OK, "a file cut to %zu of %zu bytes was accepted", len, n);
        cr_assert(strstr(msg, cut), "message does not name the file: %s", msg);
        cr_assert_null(f.map);
    }
    free(bytes);
    for (size_t k = 0; k < N_RUNNABLE; k++)
        qt_free(&q[k]);
}

Test(gguf_file, missing_padding_after_the_last_tensor_is_accepted)
{
    /* llama.cpp's model loader reads such files; only tensor bytes must be there */
    char path[600];
    sample_path(path, sizeof path, "p.gguf");
    gguf_writer *w = gguf_writer_new();
    float v[3] = {1, 2, 3};
    int64_t ne[1] = {3};
    cr_assert_eq(gguf_writer_add_tensor(w, "v", GGML_TYPE_F32, 1, ne, v, sizeof v), QL_OK);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), QL_OK, "%s", msg);
    gguf_writer_free(w);
    size_t n;
    uint8_t *bytes = read_bytes(path, &n);
    cr_assert_eq(n % 32, 0u, "the writer pads the last tensor, as ggml does");
    test_write_bytes(path, bytes, n - 20);
    gguf_file f;
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    gguf_close(&f);
    test_write_bytes(path, bytes, n - 21);
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "'v'") && strstr(msg, "past the end"), "%s", msg);
    free(bytes);
}

Test(gguf_file, huge_counts_are_refused_before_allocating)
{
    char path[600];
    sample_path(path, sizeof path, "huge.gguf");
    raw r;
    raw_header(&r, 3, 1ull << 40, 0);
    raw_zeros(&r, 64);
    expect_refused(path, &r, "1099511627776 tensors", NULL);
    raw_header(&r, 3, 0, 1ull << 40);
    raw_zeros(&r, 64);
    expect_refused(path, &r, "1099511627776 metadata entries", NULL);
    raw_header(&r, 3, UINT64_MAX, UINT64_MAX);
    expect_refused(path, &r, "metadata entries", NULL);
    /* an array claiming 2^40 elements */
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "tokenizer.ggml.tokens");
    raw_le(&r, GGUF_ARRAY, 4);
    raw_le(&r, GGUF_STRING, 4);
    raw_le(&r, 1ull << 40, 8);
    raw_zeros(&r, 64);
    expect_refused(path, &r, "1099511627776 strings", "'tokenizer.ggml.tokens'");
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "scores");
    raw_le(&r, GGUF_ARRAY, 4);
    raw_le(&r, GGUF_FLOAT32, 4);
    raw_le(&r, UINT64_MAX / 2, 8);
    raw_zeros(&r, 64);
    expect_refused(path, &r, "float32 values", "'scores'");
}

Test(gguf_file, string_lengths_past_the_end_are_refused)
{
    char path[600];
    sample_path(path, sizeof path, "str.gguf");
    raw r;
    /* a key */
    raw_header(&r, 3, 0, 1);
    raw_le(&r, 1000, 8);
    raw_put(&r, "abc", 3);
    raw_zeros(&r, 16);
    expect_refused(path, &r, "string length 1000", "entry 0's key");
    /* a string value */
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "general.name");
    raw_le(&r, GGUF_STRING, 4);
    raw_le(&r, UINT64_MAX, 8);
    raw_put(&r, "abc", 3);
    expect_refused(path, &r, "string length 18446744073709551615", "'general.name'");
    /* the third string of an array */
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "tokenizer.ggml.tokens");
    raw_le(&r, GGUF_ARRAY, 4);
    raw_le(&r, GGUF_STRING, 4);
    raw_le(&r, 3, 8);
    raw_str(&r, "a");
    raw_str(&r, "b");
    raw_le(&r, 9, 8);
    raw_put(&r, "c", 1);
    expect_refused(path, &r, "string 2 of 3", "'tokenizer.ggml.tokens'");
    /* a tensor name */
    raw_header(&r, 3, 1, 0);
    raw_le(&r, 77, 8);
    raw_zeros(&r, 40);
    expect_refused(path, &r, "string length 77", "tensor info 0");
}

Test(gguf_file, tensor_offsets_must_be_aligned_inside_and_apart)
{
    char path[600];
    sample_path(path, sizeof path, "off.gguf");
    raw r;
    uint64_t ne[2] = {8, 2}; /* f32: 64 bytes */
    /* past the end */
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "output.weight", 2, ne, GGML_TYPE_F32, 64);
    raw_pad(&r, 32);
    raw_zeros(&r, 100);
    expect_refused(path, &r, "'output.weight'", "past the end");
    /* an offset near 2^64 must not wrap around */
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "output.weight", 2, ne, GGML_TYPE_F32, UINT64_MAX - 31);
    raw_pad(&r, 32);
    raw_zeros(&r, 100);
    expect_refused(path, &r, "'output.weight'", "past the end");
    /* misaligned */
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "output.weight", 2, ne, GGML_TYPE_F32, 4);
    raw_pad(&r, 32);
    raw_zeros(&r, 128);
    expect_refused(path, &r, "offset 4 is not a multiple of the alignment 32", "'output.weight'");
    /* overlapping */
    raw_header(&r, 3, 2, 0);
    raw_tensor(&r, "a", 2, ne, GGML_TYPE_F32, 0);
    raw_tensor(&r, "b", 2, ne, GGML_TYPE_F32, 32);
    raw_pad(&r, 32);
    raw_zeros(&r, 128);
    expect_refused(path, &r, "overlap", "'a'");
    /* duplicate names */
    raw_header(&r, 3, 2, 0);
    raw_tensor(&r, "blk.0.attn_q.weight", 2, ne, GGML_TYPE_F32, 0);
    raw_tensor(&r, "blk.0.attn_q.weight", 2, ne, GGML_TYPE_F32, 64);
    raw_pad(&r, 32);
    raw_zeros(&r, 128);
    expect_refused(path, &r, "'blk.0.attn_q.weight' appears twice", NULL);
    /* apart and out of order is fine */
    raw_header(&r, 3, 2, 0);
    raw_tensor(&r, "a", 2, ne, GGML_TYPE_F32, 64);
    raw_tensor(&r, "b", 2, ne, GGML_TYPE_F32, 0);
    raw_pad(&r, 32);
    raw_zeros(&r, 128);
    test_write_bytes(path, r.p, r.len);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(gguf_find_tensor(&f, "a")->data, f.map + f.data_offset + 64);
    gguf_close(&f);
}

Test(gguf_file, bad_shapes_are_refused)
{
    char path[600];
    sample_path(path, sizeof path, "shape.gguf");
    raw r;
    uint64_t ne5[5] = {32, 1, 1, 1, 1};
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "t5", 5, ne5, GGML_TYPE_F32, 0);
    raw_zeros(&r, 256);
    expect_refused(path, &r, "5 dimensions", "'t5'");
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "t0", 0, ne5, GGML_TYPE_F32, 0);
    raw_zeros(&r, 256);
    expect_refused(path, &r, "0 dimensions", "'t0'");
    uint64_t zero[2] = {32, 0};
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "empty", 2, zero, GGML_TYPE_F32, 0);
    raw_zeros(&r, 256);
    expect_refused(path, &r, "ne[1] = 0", "'empty'");
    uint64_t neg[2] = {32, 1ull << 63};
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "neg", 2, neg, GGML_TYPE_F32, 0);
    raw_zeros(&r, 256);
    expect_refused(path, &r, "ne[1] = 9223372036854775808", "'neg'");
    uint64_t big[4] = {1ull << 20, 1ull << 20, 1ull << 20, 1ull << 20};
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "big", 4, big, GGML_TYPE_F32, 0);
    raw_zeros(&r, 256);
    expect_refused(path, &r, "overflows", "'big'");
    /* the element count fits, the byte count does not */
    uint64_t wide[2] = {1ull << 32, 1ull << 30};
    raw_header(&r, 3, 1, 0);
    raw_tensor(&r, "wide", 2, wide, 27 /* i64 */, 0);
    raw_zeros(&r, 256);
    expect_refused(path, &r, "overflows", "'wide'");
}

Test(gguf_file, bad_metadata_is_refused_by_key)
{
    char path[600];
    sample_path(path, sizeof path, "kv.gguf");
    raw r;
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "general.weird");
    raw_le(&r, 13, 4);
    raw_zeros(&r, 16);
    expect_refused(path, &r, "value type 13", "'general.weird'");
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "nested");
    raw_le(&r, GGUF_ARRAY, 4);
    raw_le(&r, GGUF_ARRAY, 4);
    raw_le(&r, 1, 8);
    raw_zeros(&r, 16);
    expect_refused(path, &r, "arrays of arrays", "'nested'");
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "elem");
    raw_le(&r, GGUF_ARRAY, 4);
    raw_le(&r, 200, 4);
    raw_le(&r, 1, 8);
    raw_zeros(&r, 16);
    expect_refused(path, &r, "element type 200", "'elem'");
    raw_header(&r, 3, 0, 2);
    raw_str(&r, "general.name");
    raw_le(&r, GGUF_STRING, 4);
    raw_str(&r, "a");
    raw_str(&r, "general.name");
    raw_le(&r, GGUF_STRING, 4);
    raw_str(&r, "b");
    expect_refused(path, &r, "'general.name' appears twice", NULL);
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "flag");
    raw_le(&r, GGUF_BOOL, 4);
    raw_le(&r, 2, 1);
    expect_refused(path, &r, "bool value 2", "'flag'");
    raw_header(&r, 3, 0, 1);
    raw_le(&r, 3, 8);
    raw_put(&r, "a\0b", 3);
    raw_le(&r, GGUF_UINT8, 4);
    raw_le(&r, 1, 1);
    expect_refused(path, &r, "NUL byte", "metadata key");
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "u32");
    raw_le(&r, GGUF_UINT32, 4);
    raw_le(&r, 1, 2);
    expect_refused(path, &r, "uint32 value runs past the end", "'u32'");
    /* general.alignment */
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "general.alignment");
    raw_le(&r, GGUF_UINT32, 4);
    raw_le(&r, 48, 4);
    expect_refused(path, &r, "48 is not a power of two", "general.alignment");
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "general.alignment");
    raw_le(&r, GGUF_UINT32, 4);
    raw_le(&r, 0, 4);
    expect_refused(path, &r, "0 is not a power of two", "general.alignment");
    raw_header(&r, 3, 0, 1);
    raw_str(&r, "general.alignment");
    raw_le(&r, GGUF_UINT64, 4);
    raw_le(&r, 32, 8);
    expect_refused(path, &r, "is a uint64, not a uint32", "general.alignment");
}

Test(gguf_file, bad_magic_and_versions_are_refused)
{
    char path[600];
    sample_path(path, sizeof path, "v.gguf");
    raw r;
    raw_header(&r, 3, 0, 0);
    memcpy(r.p, "GGML", 4);
    expect_refused(path, &r, "bad magic 'GGML'", NULL);
    raw_header(&r, 1, 0, 0);
    expect_refused(path, &r, "version 1", NULL);
    raw_header(&r, 4, 0, 0);
    expect_refused(path, &r, "version 4 is not supported", NULL);
    raw_header(&r, 3u << 24, 0, 0);
    expect_refused(path, &r, "big-endian", NULL);
    raw_header(&r, 3, 0, 0);
    r.len = 3;
    expect_refused(path, &r, "too short", NULL);
    raw_header(&r, 3, 0, 0);
    r.len = 20;
    expect_refused(path, &r, "too short", NULL);
    /* the smallest valid file: a header and nothing else */
    raw_header(&r, 3, 0, 0);
    test_write_bytes(path, r.p, r.len);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert(f.n_kv == 0 && f.n_tensors == 0 && f.alignment == 32);
    gguf_close(&f);
    cr_assert_eq(gguf_open(&f, "/nonexistent/x.gguf", msg, sizeof msg), QL_EIO);
    cr_assert(strstr(msg, "/nonexistent/x.gguf"), "%s", msg);
    cr_assert_eq(gguf_open(&f, dir, msg, sizeof msg), QL_EIO, "a directory is not a file");
}

Test(gguf_file, writer_honours_general_alignment_and_refuses_bad_tensors)
{
    char path[600];
    sample_path(path, sizeof path, "a.gguf");
    gguf_writer *w = gguf_writer_new();
    cr_assert_eq(gguf_writer_set_u32(w, "general.alignment", 64), QL_OK);
    float v[40] = {0};
    int64_t ne[1] = {40};
    cr_assert_eq(gguf_writer_add_tensor(w, "a", GGML_TYPE_F32, 1, ne, v, sizeof v), QL_OK);
    cr_assert_eq(gguf_writer_add_tensor(w, "b", GGML_TYPE_F32, 1, ne, v, sizeof v), QL_OK);
    /* refusals: duplicate name, wrong byte count, unknown or removed type,
     * ne[0] off the block, bad rank, bad dimension */
    cr_assert_eq(gguf_writer_add_tensor(w, "a", GGML_TYPE_F32, 1, ne, v, sizeof v), QL_EINVAL);
    cr_assert_eq(gguf_writer_add_tensor(w, "c", GGML_TYPE_F32, 1, ne, v, sizeof v - 4), QL_EINVAL);
    cr_assert_eq(gguf_writer_add_tensor(w, "c", 99, 1, ne, v, sizeof v), QL_EINVAL);
    cr_assert_eq(gguf_writer_add_tensor(w, "c", 4, 1, ne, v, sizeof v), QL_EINVAL);
    cr_assert_eq(gguf_writer_add_tensor(w, "c", GGML_TYPE_Q8_0, 1, ne, v, 34), QL_EINVAL);
    cr_assert_eq(gguf_writer_add_tensor(w, "c", GGML_TYPE_F32, 5, ne, v, sizeof v), QL_EINVAL);
    int64_t zero[1] = {0};
    cr_assert_eq(gguf_writer_add_tensor(w, "c", GGML_TYPE_F32, 1, zero, v, 0), QL_EINVAL);
    cr_assert_eq(gguf_writer_set_array(w, "s", GGUF_STRING, v, 1), QL_EINVAL);
    cr_assert_eq(gguf_writer_set_array(w, "s", GGUF_ARRAY, v, 1), QL_EINVAL);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), QL_OK, "%s", msg);
    gguf_file f;
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.alignment, 64u);
    cr_assert_eq(f.data_offset % 64, 0u);
    cr_assert_eq(gguf_find_tensor(&f, "b")->offset, 192u, "160 bytes padded to 64");
    gguf_close(&f);
    /* a key set twice keeps its place and takes the last value */
    cr_assert_eq(gguf_writer_set_u32(w, "general.alignment", 48), QL_OK);
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "general.alignment") && strstr(msg, path), "%s", msg);
    cr_assert_eq(gguf_writer_set_u32(w, "general.alignment", 16), QL_OK);
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.n_kv, 1u);
    cr_assert_eq(f.alignment, 16u);
    gguf_close(&f);
    gguf_writer_free(w);
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    cr_assert_neq(access(tmp, F_OK), 0, "the temporary file is left behind");
    cr_assert_neq(gguf_writer_write(w = gguf_writer_new(), "/nonexistent/x.gguf", msg, sizeof msg),
                  QL_OK);
    cr_assert(strstr(msg, "/nonexistent/x.gguf"), "%s", msg);
    gguf_writer_free(w);
}

Test(gguf_file, misaligned_dense_data_is_refused_not_misread)
{
    /* general.alignment = 1 is legal, but an f32 tensor at an odd address
     * cannot be handed to the kernels in place */
    char path[600];
    sample_path(path, sizeof path, "a1.gguf");
    raw r;
    raw_header(&r, 3, 2, 1);
    raw_str(&r, "general.alignment");
    raw_le(&r, GGUF_UINT32, 4);
    raw_le(&r, 1, 4);
    uint64_t ne[1] = {32};
    raw_tensor(&r, "q", 1, ne, GGML_TYPE_Q8_0, 0);
    raw_tensor(&r, "odd", 1, ne, GGML_TYPE_F32, 34);
    raw_zeros(&r, 34 + 128 + 8);
    test_write_bytes(path, r.p, r.len);
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.alignment, 1u);
    qtensor g;
    const gguf_tensor *odd = gguf_find_tensor(&f, "odd");
    if ((uintptr_t)odd->data % 4 != 0) {
        cr_assert_eq(gguf_tensor_qtensor(&f, odd, &g, msg, sizeof msg), QL_EFORMAT);
        cr_assert(strstr(msg, "'odd'") && strstr(msg, "boundary"), "%s", msg);
    }
    /* block kinds read bytes and are fine anywhere */
    cr_assert_eq(gguf_tensor_qtensor(&f, gguf_find_tensor(&f, "q"), &g, msg, sizeof msg), QL_OK,
                 "%s", msg);
    gguf_close(&f);
}

/* --- the reference writer's file ------------------------------------------ */

/* The values make_gguf_file.py writes: exact in f16 and bf16. */
static float ref_value(int i, int k)
{
    return (float)(((i * 37 + k * 11) % 101) - 50) / 16.0f;
}

Test(gguf_file, reference_file_reads_as_gguf_py_wrote_it)
{
    const char *path = QL_FIXTURES "/tiny_ref.gguf";
    gguf_file f;
    char msg[512];
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(f.version, 3u);
    cr_assert_eq(f.n_kv, 21u);
    cr_assert_eq(f.n_tensors, 8u);
    cr_assert(str_is(kv_of(&f, "general.architecture", GGUF_STRING, GGUF_STRING, 1)->str, "llama"));
    cr_assert_eq(kv_of(&f, "test.u8", GGUF_UINT8, GGUF_UINT8, 1)->u, 200u);
    cr_assert_eq(kv_of(&f, "test.i8", GGUF_INT8, GGUF_INT8, 1)->i, -100);
    cr_assert_eq(kv_of(&f, "test.u16", GGUF_UINT16, GGUF_UINT16, 1)->u, 60000u);
    cr_assert_eq(kv_of(&f, "test.i16", GGUF_INT16, GGUF_INT16, 1)->i, -30000);
    cr_assert_eq(kv_of(&f, "test.u32", GGUF_UINT32, GGUF_UINT32, 1)->u, 4000000000u);
    cr_assert_eq(kv_of(&f, "test.i32", GGUF_INT32, GGUF_INT32, 1)->i, -2000000000);
    cr_assert_eq(kv_of(&f, "test.f32", GGUF_FLOAT32, GGUF_FLOAT32, 1)->f, 0.15625);
    cr_assert_eq(kv_of(&f, "test.bool", GGUF_BOOL, GGUF_BOOL, 1)->u, 1u);
    cr_assert(str_is(kv_of(&f, "test.str", GGUF_STRING, GGUF_STRING, 1)->str,
                     "h\xc3\xa9llo w\xc3\xb6rld"));
    cr_assert_eq(kv_of(&f, "test.u64", GGUF_UINT64, GGUF_UINT64, 1)->u, 18000000000000000000ull);
    cr_assert_eq(kv_of(&f, "test.i64", GGUF_INT64, GGUF_INT64, 1)->i, -9000000000000000000ll);
    cr_assert_eq(kv_of(&f, "test.f64", GGUF_FLOAT64, GGUF_FLOAT64, 1)->f, 2.718281828459045);
    const gguf_kv *kv = kv_of(&f, "test.arr.str", GGUF_ARRAY, GGUF_STRING, 4);
    cr_assert(str_is(kv->strs[0], "<s>") && str_is(kv->strs[1], "") &&
              str_is(kv->strs[2], "\xe2\x96\x81the") && str_is(kv->strs[3], "\xc3\xbc"));
    static const int32_t ri32[] = {1, -2, 3, -2147483647 - 1};
    static const float rf32[] = {0.5f, -1.25f, 3.0e38f};
    static const uint8_t ru8[] = {0, 1, 255}, rbool[] = {1, 0, 1};
    static const uint64_t ru64[] = {0, 18446744073709551615ull};
    static const double rf64[] = {1.0e300, -0.125};
    static const int16_t ri16[] = {-32768, 32767};
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.i32", GGUF_ARRAY, GGUF_INT32, 4)->data, ri32, 16), 0);
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.f32", GGUF_ARRAY, GGUF_FLOAT32, 3)->data, rf32, 12), 0);
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.u8", GGUF_ARRAY, GGUF_UINT8, 3)->data, ru8, 3), 0);
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.bool", GGUF_ARRAY, GGUF_BOOL, 3)->data, rbool, 3), 0);
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.u64", GGUF_ARRAY, GGUF_UINT64, 2)->data, ru64, 16), 0);
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.f64", GGUF_ARRAY, GGUF_FLOAT64, 2)->data, rf64, 16), 0);
    cr_assert_eq(memcmp(kv_of(&f, "test.arr.i16", GGUF_ARRAY, GGUF_INT16, 2)->data, ri16, 4), 0);

    /* tensors: name, kind, shape, and k = the ref_value stream it was made from */
    struct {
        const char *name;
        qt_kind kind;
        int64_t rows, cols;
        int k;
    } ts[] = {
        {"t.f32", QT_F32, 3, 64, 0},   {"t.f16", QT_F16, 2, 32, 1},   {"t.bf16", QT_BF16, 2, 32, 2},
        {"t.q4_0", QT_Q4_0, 4, 64, 3}, {"t.q4_1", QT_Q4_1, 4, 64, 4}, {"t.q8_0", QT_Q8_0, 4, 64, 5},
        {"t.3d", QT_F32, 6, 32, 6},
    };
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) {
        const gguf_tensor *t = gguf_find_tensor(&f, ts[i].name);
        cr_assert(t, "%s missing", ts[i].name);
        qtensor g;
        cr_assert_eq(gguf_tensor_qtensor(&f, t, &g, msg, sizeof msg), QL_OK, "%s", msg);
        cr_assert(g.kind == ts[i].kind && g.rows == ts[i].rows && g.cols == ts[i].cols, "%s",
                  ts[i].name);
        int64_t n = g.rows * g.cols;
        float *in = malloc((size_t)n * sizeof *in), *got = malloc((size_t)n * sizeof *got);
        for (int64_t j = 0; j < n; j++)
            in[j] = ref_value((int)j, ts[i].k);
        /* gguf-py's blocks are the bytes our quantizer makes from the same values */
        qt_quant_params p = {.kind = ts[i].kind};
        qtensor ours;
        cr_assert_eq(qt_quantize(&ours, in, g.rows, g.cols, &p, msg, sizeof msg), QL_OK, "%s", msg);
        cr_assert_eq(ours.data_bytes, g.data_bytes, "%s", ts[i].name);
        cr_assert_eq(memcmp(ours.data, g.data, g.data_bytes), 0, "%s: bytes differ", ts[i].name);
        qt_dequantize_rows(&g, 0, g.rows, got);
        if (qt_traits_table[g.kind].is_dense)
            for (int64_t j = 0; j < n; j++)
                cr_assert(same_bits(got[j], in[j]), "%s: value %lld", ts[i].name, (long long)j);
        qt_free(&ours);
        qt_free(&g);
        free(in);
        free(got);
    }
    const gguf_tensor *t = gguf_find_tensor(&f, "t.q4_k");
    cr_assert(t && t->ggml_type == 12 && t->ne[0] == 256 && t->ne[1] == 1 && t->nbytes == 144);
    for (int j = 0; j < 144; j++)
        cr_assert_eq(t->data[j], (uint8_t)((j * 7) & 0xff));
    /* gguf-py wrote it as Q4_K; it is read in place and dequantizes as
     * gguf-py does (tests/fixtures/gguf_kquant_vectors.h's tiny_ref case) */
    qtensor g;
    cr_assert_eq(gguf_tensor_qtensor(&f, t, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert(g.kind == QT_Q4_K && g.rows == 1 && g.cols == 256 && g.data_borrowed);
    const gkqv_case *tiny = NULL;
    for (size_t i = 0; i < sizeof gkqv_cases / sizeof *gkqv_cases; i++)
        if (strcmp(gkqv_cases[i].name, "q4_k_tiny_ref_1x256") == 0)
            tiny = &gkqv_cases[i];
    cr_assert(tiny && memcmp(tiny->blocks, t->data, 144) == 0);
    float got[256];
    qt_dequantize_rows(&g, 0, 1, got);
    for (int j = 0; j < 256; j++)
        cr_assert(same_bits(got[j], tiny->dequant[j]), "t.q4_k value %d: %a vs %a", j,
                  (double)got[j], (double)tiny->dequant[j]);
    qt_free(&g);
    gguf_close(&f);
}

Test(gguf_file, random_corruption_never_crashes, .timeout = 60)
{
    char path[600], bad[600];
    sample_path(path, sizeof path, "s.gguf");
    sample_path(bad, sizeof bad, "fuzz.gguf");
    qtensor q[N_RUNNABLE];
    make_runnable(q);
    make_sample(path, q);
    size_t n;
    uint8_t *bytes = read_bytes(path, &n);
    uint8_t *copy = malloc(n);
    uint64_t rng = 4242;
    gguf_file f0;
    char msg[512];
    cr_assert_eq(gguf_open(&f0, path, msg, sizeof msg), QL_OK, "%s", msg);
    size_t header_end = f0.data_offset;
    gguf_close(&f0);
    int accepted = 0;
    for (int i = 0; i < 3000; i++) {
        memcpy(copy, bytes, n);
        int flips = 1 + (int)(test_rand(&rng) % 4);
        /* aim at the header and infos, where the parser lives */
        for (int k = 0; k < flips; k++)
            copy[test_rand(&rng) % header_end] = (uint8_t)test_rand(&rng);
        test_write_bytes(bad, copy, n);
        gguf_file f;
        if (gguf_open(&f, bad, msg, sizeof msg) != QL_OK) {
            cr_assert(strstr(msg, bad), "no file name: %s", msg);
            continue;
        }
        accepted++;
        for (uint64_t t = 0; t < f.n_tensors; t++) {
            const gguf_tensor *gt = &f.tensors[t];
            cr_assert(gt->data >= f.map && gt->data + gt->nbytes <= f.map + f.map_len);
            qtensor g;
            if (gguf_tensor_qtensor(&f, gt, &g, msg, sizeof msg) != QL_OK)
                continue;
            float *out = malloc((size_t)g.cols * sizeof *out);
            qt_dequantize_rows(&g, g.rows - 1, 1, out);
            free(out);
            qt_free(&g);
        }
        gguf_close(&f);
    }
    cr_assert(accepted > 0, "no corruption was ever accepted: the test does not test much");
    free(copy);
    free(bytes);
    for (size_t k = 0; k < N_RUNNABLE; k++)
        qt_free(&q[k]);
}

/* A GGUF of n F32 tensors "t000000".. of 8 elements each, one after the
 * other; when dup_last, the last one repeats the first one's name. Too big
 * for a raw (8 KiB), so written straight to the file. */
static void write_many_tensors(const char *path, size_t n, bool dup_last)
{
    size_t info = 8 + 7 + 4 + 8 + 4 + 8, data = n * 32;
    size_t cap = 24 + n * info + 32 + data, at = 0;
    uint8_t *p = calloc(cap, 1);
    cr_assert(p);
#define PUT_LE(v, k)                                                                               \
    do {                                                                                           \
        for (size_t b_ = 0; b_ < (k); b_++)                                                        \
            p[at++] = (uint8_t)((uint64_t)(v) >> (8 * b_));                                        \
    } while (0)
    memcpy(p, "GGUF", 4);
    at = 4;
    PUT_LE(3, 4);
    PUT_LE(n, 8);
    PUT_LE(0, 8);
    for (size_t i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%06zu", dup_last && i == n - 1 ? (size_t)0 : i);
        PUT_LE(7, 8);
        memcpy(p + at, name, 7);
        at += 7;
        PUT_LE(1, 4);
        PUT_LE(8, 8);
        PUT_LE(GGML_TYPE_F32, 4);
        PUT_LE(i * 32, 8);
    }
#undef PUT_LE
    at = (at + 31) / 32 * 32 + data;
    test_write_bytes(path, p, at);
    free(p);
}

/* Names are checked for duplicates by sorting them, and gguf_find_tensor
 * searches the sorted names: 200,000 tensors open and are all found in
 * well under the time n^2 name comparisons take (2e10), and a duplicate
 * far from its twin is still refused by name. */
Test(gguf_file, a_file_of_200000_tensors_opens_and_finds_quickly)
{
    char path[600], msg[512] = "";
    sample_path(path, sizeof path, "many.gguf");
    enum { N = 200000 };
    write_many_tensors(path, N, false);
    gguf_file f;
    double t0 = ql_now_s();
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_OK, "%s", msg);
    for (size_t i = 0; i < N; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%06zu", i);
        const gguf_tensor *t = gguf_find_tensor(&f, name);
        cr_assert(t && t->data == f.map + f.data_offset + i * 32, "%s", name);
    }
    double took = ql_now_s() - t0;
    cr_assert_null(gguf_find_tensor(&f, "t200000"));
    cr_assert_null(gguf_find_tensor(&f, ""));
    cr_log_info("gguf_open + %d lookups: %.2f s", N, took);
    cr_assert_lt(took, 15.0, "opening and looking up %d tensors took %.1f s", N, took);
    gguf_close(&f);

    write_many_tensors(path, N, true);
    msg[0] = 0;
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "tensor 't000000' appears twice") && strstr(msg, path), "%s", msg);
}

/*
 * test_bnb4.c - NF4 and FP4 against bitsandbytes, bit for bit.
 *
 * tests/fixtures/bnb_vectors.h holds what bitsandbytes 0.50.2 itself
 * produced (quantize_4bit / dequantize_4bit on the CPU, with and without
 * compress_statistics) for inputs chosen to hit every rounding decision:
 * zero blocks, ragged and odd sizes, values on code midpoints, tiny values,
 * blocksizes 32 to 4096, more than 256 blocks under double quantization.
 * tests/fixtures/bnb_*.safetensors are Linear4bit weights as bitsandbytes
 * serializes them. The scripts beside them regenerate all of it.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "modelfile.h"
#include "qtensor.h"
#include "test_util.h"

#include "fixtures/bnb_vectors.h"

/* Equal bits, except that +0.0 and -0.0 are one value: bitsandbytes' native
 * FP4 dequantization has -0.0 for code 8 where its Python tables have +0.0. */
static bool same_value_bits(float a, float b)
{
    return same_bits(a, b) || (a == 0.0f && b == 0.0f);
}

Test(bnb4, codebooks_and_dynamic_map_are_bitsandbytes_tables)
{
    for (int i = 0; i < 16; i++) {
        cr_assert(same_bits(qt_nf4_code[i], bnbv_nf4_code[i]), "nf4[%d] %a vs %a", i,
                  (double)qt_nf4_code[i], (double)bnbv_nf4_code[i]);
        cr_assert(same_bits(qt_fp4_code[i], bnbv_fp4_code[i]), "fp4[%d] %a vs %a", i,
                  (double)qt_fp4_code[i], (double)bnbv_fp4_code[i]);
    }
    for (int i = 0; i < 256; i++)
        cr_assert(same_bits(qt_dynamic_map_signed[i], bnbv_dynamic_map[i]), "map[%d]", i);
}

/* Both quantizers, the scalar one and the AVX2 one where the CPU has it
 * (each Criterion test runs in its own process, so forcing is local). */
Test(bnb4, quantize_matches_bitsandbytes_bit_for_bit)
{
    for (size_t c = 0; c < 2 * BNBV_N_CASES; c++) {
        qt_set_force_scalar(c >= BNBV_N_CASES);
        const bnbv_case *k = &bnbv_cases[c % BNBV_N_CASES];
        qt_quant_params p = {.kind = strcmp(k->quant_type, "nf4") == 0 ? QT_NF4 : QT_FP4,
                             .blocksize = k->blocksize,
                             .double_quant = k->nested != 0};
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), QL_OK,
                     "%s: %s", k->name, msg);
        cr_assert_eq((long)t.data_bytes, k->packed_len, "%s: packed length", k->name);
        for (long i = 0; i < k->packed_len; i++)
            cr_assert_eq(t.data[i], k->packed[i], "%s: packed byte %ld: %02x vs %02x", k->name, i,
                         t.data[i], k->packed[i]);
        cr_assert_eq(t.n_blocks, k->n_blocks, "%s: blocks", k->name);
        if (!k->nested) {
            for (long b = 0; b < k->n_blocks; b++)
                cr_assert(same_bits(t.absmax[b], k->absmax[b]), "%s: absmax %ld: %a vs %a", k->name,
                          b, (double)t.absmax[b], (double)k->absmax[b]);
        } else {
            cr_assert(same_bits(t.nested_offset, k->nested_offset), "%s: offset %a vs %a", k->name,
                      (double)t.nested_offset, (double)k->nested_offset);
            cr_assert_eq(t.n_nested_blocks, k->n_nested, "%s: nested blocks", k->name);
            for (long b = 0; b < k->n_nested; b++)
                cr_assert(same_bits(t.nested_absmax[b], k->nested_absmax[b]),
                          "%s: nested absmax %ld", k->name, b);
            for (long b = 0; b < k->n_blocks; b++)
                cr_assert_eq(t.absmax_codes[b], k->absmax_codes[b], "%s: absmax code %ld: %d vs %d",
                             k->name, b, t.absmax_codes[b], k->absmax_codes[b]);
        }
        qt_free(&t);
    }
}

/* The AVX2 quantizer against the scalar one on inputs a fixture cannot
 * hold: large tensors of every NF4/FP4 blocksize, values exactly on the
 * codebook's midpoints (scaled by a power of two, so they stay on them),
 * signed zeros, all-zero blocks and a ragged tail. */
Test(bnb4, avx2_quantizer_writes_the_scalar_bytes)
{
    if (strcmp(qt_cpu_path(), "avx2") != 0)
        test_cannot_run("no AVX2 on this CPU: the scalar quantizer is the only one");
    const int64_t rows = 37, cols = 1000; /* 37000: no blocksize divides it */
    float *x = malloc((size_t)(rows * cols) * sizeof *x);
    uint64_t seed = 12345;
    for (int kind = 0; kind < 2; kind++) {
        const float *code = kind ? qt_fp4_code : qt_nf4_code;
        for (int64_t i = 0; i < rows * cols; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            uint32_t r = (uint32_t)(seed >> 33);
            int a = (int)(r % 16), b = (int)((r >> 4) % 16);
            switch ((r >> 8) % 4) {
            case 0: /* a midpoint between two codes, times 2^-3 */
                x[i] = (code[a] + code[b]) / 2.0f * 0.125f;
                break;
            case 1: x[i] = (r >> 12) % 2 ? -0.0f : 0.0f; break;
            default: x[i] = ((float)(r >> 10) / 4194304.0f - 0.5f) * 0.25f;
            }
        }
        for (int64_t i = 512; i < 1024; i++) /* whole zero blocks */
            x[i] = 0.0f;
        for (int bs = 32; bs <= 4096; bs *= 2) {
            for (int nested = 0; nested < 2; nested++) {
                qt_quant_params p = {
                    .kind = kind ? QT_FP4 : QT_NF4, .blocksize = bs, .double_quant = nested};
                qtensor fast, ref;
                char msg[256];
                qt_set_force_scalar(false);
                cr_assert_eq(qt_quantize(&fast, x, rows, cols, &p, msg, sizeof msg), QL_OK, "%s",
                             msg);
                qt_set_force_scalar(true);
                cr_assert_eq(qt_quantize(&ref, x, rows, cols, &p, msg, sizeof msg), QL_OK, "%s",
                             msg);
                cr_assert_eq(memcmp(fast.data, ref.data, ref.data_bytes), 0,
                             "%s, blocksize %d: codes differ", qt_kind_name(p.kind), bs);
                if (nested)
                    cr_assert_eq(memcmp(fast.absmax_codes, ref.absmax_codes, (size_t)ref.n_blocks),
                                 0, "blocksize %d: nested absmax codes differ", bs);
                else
                    cr_assert_eq(
                        memcmp(fast.absmax, ref.absmax, (size_t)ref.n_blocks * sizeof(float)), 0,
                        "blocksize %d: absmax differs", bs);
                qt_free(&fast);
                qt_free(&ref);
            }
        }
    }
    qt_set_force_scalar(false);
    free(x);
}

Test(bnb4, dequantize_matches_bitsandbytes_bit_for_bit)
{
    for (size_t c = 0; c < BNBV_N_CASES; c++) {
        const bnbv_case *k = &bnbv_cases[c];
        /* from bitsandbytes' own bytes, not from our quantizer */
        qt_bnb4_parts parts = {
            .kind = strcmp(k->quant_type, "nf4") == 0 ? QT_NF4 : QT_FP4,
            .rows = k->rows,
            .cols = k->cols,
            .blocksize = k->blocksize,
            .codes = k->packed,
            .codes_bytes = (size_t)k->packed_len,
            .codebook = strcmp(k->quant_type, "nf4") == 0 ? bnbv_nf4_code : bnbv_fp4_code,
            .n_blocks = k->n_blocks,
            .absmax = k->absmax,
            .absmax_codes = k->absmax_codes,
            .nested_absmax = k->nested_absmax,
            .n_nested_blocks = k->n_nested,
            .nested_blocksize = 256,
            .nested_offset = k->nested_offset,
            .nested_code = bnbv_dynamic_map,
        };
        qtensor t;
        char msg[256];
        cr_assert_eq(qt_from_bnb4(&t, &parts, msg, sizeof msg), QL_OK, "%s: %s", k->name, msg);
        long n = k->rows * k->cols;
        float *ref = malloc((size_t)n * sizeof *ref), *fast = malloc((size_t)n * sizeof *fast);
        qt_dequantize_rows_ref(&t, 0, k->rows, ref);
        qt_dequantize_rows(&t, 0, k->rows, fast);
        for (long i = 0; i < n; i++) {
            cr_assert(same_value_bits(ref[i], k->dequant[i]), "%s: value %ld: %a vs %a", k->name, i,
                      (double)ref[i], (double)k->dequant[i]);
            cr_assert(same_bits(fast[i], ref[i]), "%s: fast path value %ld", k->name, i);
        }
        free(ref);
        free(fast);
        qt_free(&t);
    }
}

/* A Linear4bit weight saved by bitsandbytes loads here without
 * dequantizing, and dequantizes to what bitsandbytes computed. */
static void check_checkpoint(const char *file, qt_kind kind, bool nested, const char *dtype,
                             long rows, long cols, int blocksize)
{
    char path[512], msg[512];
    snprintf(path, sizeof path, "%s/%s", QL_FIXTURES, file);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    cr_assert(bnb_is_quantized(&f, "layer.weight"));
    qtensor t;
    char dt[16];
    cr_assert_eq(bnb_read(&f, "layer.weight", &t, dt, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(t.kind, kind);
    cr_assert_eq(t.nested, nested);
    cr_assert_str_eq(dt, dtype);
    cr_assert_eq(t.rows, rows);
    cr_assert_eq(t.cols, cols);
    cr_assert_eq(t.blocksize, blocksize);
    const st_tensor *want = st_find(&f, "layer.weight_dequant");
    const st_tensor *input = st_find(&f, "layer.weight_input");
    cr_assert(want && input && want->dtype == ST_F32 && want->numel == rows * cols);
    float *got = malloc((size_t)(rows * cols) * sizeof *got);
    float *exp = malloc((size_t)(rows * cols) * sizeof *exp);
    memcpy(exp, want->data, want->nbytes);
    qt_dequantize_rows(&t, 0, rows, got);
    /* bitsandbytes dequantizes to the quant state's dtype, rounding the f32
     * product to nearest even */
    bool bf16 = strcmp(dtype, "bfloat16") == 0;
    for (long i = 0; i < rows * cols; i++) {
        float g = bf16 ? qt_bf16_to_f32(qt_f32_to_bf16(got[i])) : got[i];
        cr_assert(same_value_bits(g, exp[i]), "%s value %ld: %a vs %a", file, i, (double)g,
                  (double)exp[i]);
    }

    /* and quantizing the original weight here gives bitsandbytes' bytes */
    float *in = malloc(input->nbytes);
    memcpy(in, input->data, input->nbytes);
    qt_quant_params p = {.kind = kind, .blocksize = blocksize, .double_quant = nested};
    qtensor mine;
    cr_assert_eq(qt_quantize(&mine, in, rows, cols, &p, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(mine.data_bytes, t.data_bytes);
    cr_assert_eq(memcmp(mine.data, t.data, t.data_bytes), 0, "%s: codes differ", file);
    if (nested) {
        cr_assert_eq(memcmp(mine.absmax_codes, t.absmax_codes, (size_t)t.n_blocks), 0);
        cr_assert(same_bits(mine.nested_offset, t.nested_offset));
    } else {
        cr_assert_eq(memcmp(mine.absmax, t.absmax, (size_t)t.n_blocks * 4), 0);
    }
    qt_free(&mine);
    free(in);
    free(got);
    free(exp);
    qt_free(&t);
    st_close(&f);
}

Test(bnb4, bitsandbytes_checkpoints_load_in_place)
{
    check_checkpoint("bnb_nf4_dq.safetensors", QT_NF4, true, "bfloat16", 48, 80, 64);
    check_checkpoint("bnb_fp4.safetensors", QT_FP4, false, "float32", 24, 50, 32);
}

/* A checkpoint whose parts disagree with its quant state is refused with
 * the tensor's name, whatever part is wrong. */
Test(bnb4, inconsistent_checkpoints_are_refused_by_name)
{
    char dir[512], path[600], msg[512];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    float w[8 * 64];
    uint64_t rng = 3;
    for (int i = 0; i < 8 * 64; i++)
        w[i] = test_normal(&rng);
    qt_quant_params p = {.kind = QT_NF4, .blocksize = 64, .double_quant = true};
    qtensor t;
    cr_assert_eq(qt_quantize(&t, w, 8, 64, &p, msg, sizeof msg), 0);

    enum { SHORT_ABSMAX, NAN_NESTED, BAD_JSON, WRONG_SHAPE, MISSING_MAP, N_CORRUPTIONS };
    const char *expect[N_CORRUPTIONS] = {"absmax has 7 entries", "not finite", "JSON",
                                         "bytes of packed codes", ".quant_map' is missing"};
    for (int c = 0; c < N_CORRUPTIONS; c++) {
        st_writer *wr = st_writer_new();
        int64_t packed_shape[2] = {256, 1}, nb[1] = {c == SHORT_ABSMAX ? 7 : 8}, n16[1] = {16},
                nn[1] = {1}, n256[1] = {256};
        st_writer_add(wr, "m.weight", ST_U8, 2, packed_shape, t.data, 256, true, msg, 512);
        st_writer_add(wr, "m.weight.absmax", ST_U8, 1, nb, t.absmax_codes, (size_t)nb[0], true, msg,
                      512);
        if (c != MISSING_MAP)
            st_writer_add(wr, "m.weight.quant_map", ST_F32, 1, n16, t.codebook, 64, true, msg, 512);
        float nested = c == NAN_NESTED ? NAN : t.nested_absmax[0];
        st_writer_add(wr, "m.weight.nested_absmax", ST_F32, 1, nn, &nested, 4, true, msg, 512);
        st_writer_add(wr, "m.weight.nested_quant_map", ST_F32, 1, n256, t.nested_code, 1024, true,
                      msg, 512);
        const char *json =
            c == BAD_JSON ? "{\"quant_type\": \"nf4\", \"blocksize\": 64"
            : c == WRONG_SHAPE
                ? "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", "
                  "\"shape\": [8, 80], \"nested_blocksize\": 256, \"nested_offset\": 0.5, "
                  "\"nested_dtype\": \"float32\"}"
                : "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", "
                  "\"shape\": [8, 64], \"nested_blocksize\": 256, \"nested_offset\": 0.5, "
                  "\"nested_dtype\": \"float32\"}";
        int64_t jl[1] = {(int64_t)strlen(json)};
        st_writer_add(wr, "m.weight.quant_state.bitsandbytes__nf4", ST_U8, 1, jl, json,
                      strlen(json), true, msg, 512);
        cr_assert_eq(st_writer_write(wr, path, msg, sizeof msg), 0, "%s", msg);
        st_writer_free(wr);

        st_file f;
        cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
        qtensor got;
        msg[0] = 0;
        cr_assert_neq(bnb_read(&f, "m.weight", &got, NULL, msg, sizeof msg), 0,
                      "corruption %d accepted", c);
        cr_assert(strstr(msg, "m.weight") && strstr(msg, "bad.safetensors"), "corruption %d: %s", c,
                  msg);
        cr_assert(strstr(msg, expect[c]), "corruption %d: '%s' lacks '%s'", c, msg, expect[c]);
        st_close(&f);
    }
    qt_free(&t);
    test_rmtree(dir);
}

/* The serialization round-trips through a file, and the JSON is the text
 * Python's json.dumps writes for bitsandbytes' quant state. */
Test(bnb4, serialization_round_trips)
{
    char dir[512], path[600], msg[512];
    test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/rt.safetensors", dir);
    const bnbv_case *k = &bnbv_cases[0];
    for (size_t c = 0; c < BNBV_N_CASES; c++)
        if (bnbv_cases[c].nested)
            k = &bnbv_cases[c];
    qt_quant_params p = {.kind = strcmp(k->quant_type, "nf4") == 0 ? QT_NF4 : QT_FP4,
                         .blocksize = k->blocksize,
                         .double_quant = true};
    qtensor t, back;
    cr_assert_eq(qt_quantize(&t, k->input, k->rows, k->cols, &p, msg, sizeof msg), 0);
    st_writer *w = st_writer_new();
    cr_assert_eq(bnb_write(w, "x.weight", &t, "float16", msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    char dt[16];
    cr_assert_eq(bnb_read(&f, "x.weight", &back, dt, msg, sizeof msg), 0, "%s", msg);
    cr_assert_str_eq(dt, "float16");
    cr_assert_eq(memcmp(back.data, t.data, t.data_bytes), 0);
    cr_assert_eq(memcmp(back.absmax_codes, t.absmax_codes, (size_t)t.n_blocks), 0);
    cr_assert(same_bits(back.nested_offset, t.nested_offset));
    char key[128];
    snprintf(key, sizeof key, "x.weight.quant_state.bitsandbytes__%s", k->quant_type);
    const st_tensor *qs = st_find(&f, key);
    cr_assert(qs);
    char json[512] = {0}, want[512];
    memcpy(json, qs->data, qs->nbytes);
    /* the offset as Python's repr writes the double of an f32 */
    char off[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(off, sizeof off, "%.*g", prec, (double)t.nested_offset);
        if (strtod(off, NULL) == (double)t.nested_offset)
            break;
    }
    if (!strpbrk(off, ".en"))
        strcat(off, ".0");
    snprintf(want, sizeof want,
             "{\"quant_type\": \"%s\", \"blocksize\": %d, \"dtype\": \"float16\", \"shape\": "
             "[%ld, %ld], \"nested_blocksize\": 256, \"nested_offset\": %s, \"nested_dtype\": "
             "\"float32\"}",
             k->quant_type, k->blocksize, k->rows, k->cols, off);
    cr_assert_str_eq(json, want);
    st_close(&f);
    qt_free(&t);
    qt_free(&back);
    test_rmtree(dir);
}

/*
 * test_rope_freqs.c - Llama 3.x GGUF files: rope_freqs.weight, llama.cpp's
 * per-pair frequency factors, applied as ggml's rope applies them (pair i's
 * frequency divided by factor i).
 *
 *   - a tiny llama GGUF with arbitrary factors gives the float64 reference
 *     forward's logits with those factors (ref_forward.h), and not the
 *     logits without them;
 *   - a GGUF made from a tiny Hugging Face folder with rope_scaling llama3,
 *     its factors computed as llama.cpp's convert_hf_to_gguf.py computes
 *     them (LlamaModel.generate_extra_tensors, in float32 as torch does),
 *     gives the folder's own logits;
 *   - a rope_freqs tensor of the wrong type, length or values, and a
 *     rope.dimension_count that rotates part of each head, are refused by
 *     name.
 *
 * Tolerance: as test_forward.c (1e-5 relative over a position's logits):
 * the engine computes in f32, the reference in double; the converter's
 * float32 factors differ from the double curve by ~1e-7 relative, which
 * moves an angle of at most 24 radians by ~3e-6, far under the tolerance,
 * while leaving the factors out moves the logits by > 1e-3.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lora_fixture.h"
#include "model.h"
#include "modelfile.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"

#include "ref_forward.h"
#include "run_prompt.h"

static char dir[512], hf_dir[600];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(hf_dir, sizeof hf_dir, "%s/hf", dir);
    cr_assert_eq(mkdir(hf_dir, 0700), 0);
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(rope_freqs, .init = setup, .fini = teardown, .timeout = 60);

enum { N_TOKENS = 24 };
static const int32_t tokens[N_TOKENS] = {259, 84, 104, 101, 256, 258, 32,  99,  97,  33, 10, 65,
                                         66,  67, 257, 32,  116, 104, 101, 109, 101, 46, 32, 72};

/* The tiny Hugging Face model (f32), its config.json patched with extra
 * members (NULL: as written), loaded. */
static void load_hf(eng_model *m, const char *extra)
{
    tiny_spec s = tiny_default();
    s.dtype = ST_F32;
    tiny_write_hf(hf_dir, &s);
    if (extra) {
        char path[700];
        snprintf(path, sizeof path, "%s/config.json", hf_dir);
        FILE *f = fopen(path, "rb");
        cr_assert(f);
        char buf[4096];
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        char *brace = strrchr(buf, '}');
        cr_assert(brace);
        snprintf(brace, sizeof buf - (size_t)(brace - buf), ", %s}", extra);
        test_write_text(path, buf);
    }
    char msg[512];
    eng_load_opts o = {.path = hf_dir};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s", msg);
}

/* Write the model as a llama GGUF with rope_freqs.weight of ggml type
 * `type` holding n factors (n 0: no tensor) to dir/name; path receives it. */
static void write_gguf(const eng_model *hf, const char *name, const float *factors, int64_t n,
                       uint32_t type, char *path, size_t len)
{
    gguf_writer *w = lora_fix_llama_gguf(hf, "tiny");
    if (n) {
        uint16_t half[ENG_MAX_ROPE_FREQ_FACTORS];
        for (int64_t i = 0; i < n; i++)
            half[i] = qm_f32_to_f16(factors[i]);
        bool f16 = type == GGML_TYPE_F16;
        cr_assert_eq(gguf_writer_add_tensor(w, "rope_freqs.weight", type, 1, &n,
                                            f16 ? (const void *)half : (const void *)factors,
                                            (size_t)n * (f16 ? 2 : 4)),
                     0);
    }
    snprintf(path, len, "%s/%s", dir, name);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
}

static void load_gguf(eng_model *m, const char *path)
{
    char msg[512];
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(m, &o, msg, sizeof msg), 0, "%s: %s", path, msg);
}

/* The logits of every position, fed one token at a time (the caller
 * frees). */
static float *run_logits(const eng_model *m)
{
    prompt_run r = {.tokens = tokens, .n_tokens = N_TOKENS, .prefill = 1};
    return run_prompt(m, &r);
}

Test(rope_freqs, gguf_factors_give_the_reference_forward_with_those_factors)
{
    eng_model hf, gg;
    load_hf(&hf, NULL);
    /* head dim 16: 8 pairs; factors above and below 1, none of them 1, so
     * each pair's rotation changes */
    const float factors[8] = {1.25f, 0.5f, 2.0f, 3.0f, 0.75f, 8.0f, 5.5f, 32.0f};
    char path[700];
    write_gguf(&hf, "factors.gguf", factors, 8, GGML_TYPE_F32, path, sizeof path);
    load_gguf(&gg, path);
    cr_assert_eq(gg.cfg.n_rope_freq_factors, 8);
    cr_assert_eq(memcmp(gg.cfg.rope_freq_factors, factors, sizeof factors), 0,
                 "the file's factors, bit for bit");
    cr_assert_eq(gg.cfg.rope_scaling, ENG_ROPE_NONE);

    int64_t V = gg.cfg.vocab_size;
    size_t nl = (size_t)N_TOKENS * (size_t)V;
    float *logits = run_logits(&gg);
    double *ref = malloc(nl * sizeof *ref);
    ref_model R;
    ref_load(&R, &gg);
    ref_forward(&R, tokens, N_TOKENS, ref);
    double err = test_worst_row_l2(logits, ref, N_TOKENS, (size_t)V);
    cr_assert_lt(err, FWD_REL_TOL, "GGUF with factors vs the reference with them: %g", err);

    /* the same weights without the factors (the HF model) are far away */
    float *plain = run_logits(&hf);
    double effect = test_worst_row_l2(plain, ref, N_TOKENS, (size_t)V);
    cr_log_info("factors: error %.3g, without them %.3g", err, effect);
    cr_assert_gt(effect, 1e-3, "the factors move the logits (%g), far past the tolerance", effect);
    free(plain);
    ref_free(&R);
    free(ref);
    free(logits);
    eng_model_free(&gg);
    eng_model_free(&hf);
}

/*
 * convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type
 * llama3, in float32 as torch computes it: freqs = 1 / base ** (arange(0,
 * dim, 2) / dim); for each, wavelen = 2 pi / freq; factor 1 below the high
 * wavelength, `factor` above the low one, else 1 / ((1 - smooth) / factor
 * + smooth) with smooth = (old_context_len / wavelen - low) / (high - low).
 */
static void converter_llama3_factors(double base, int dim, float factor, float low, float high,
                                     float old_context_len, float *out)
{
    /* Python floats (double) beside float32 tensors */
    double low_wavelen = (double)old_context_len / low,
           high_wavelen = (double)old_context_len / high;
    for (int i = 0; 2 * i < dim; i++) {
        float exponent = (float)(2 * i) / (float)dim;
        float freq = 1.0f / powf((float)base, exponent);
        float wavelen = (float)(2.0 * M_PI) / freq;
        if (wavelen < high_wavelen) {
            out[i] = 1.0f;
        } else if (wavelen > low_wavelen) {
            out[i] = factor;
        } else {
            float smooth = (old_context_len / wavelen - low) / (high - low);
            out[i] = 1.0f / ((1.0f - smooth) / factor + smooth);
        }
    }
}

Test(rope_freqs, gguf_converted_from_llama3_scaling_gives_the_folder_logits)
{
    /* original context 64 puts the tiny model's 8 wavelengths (6.3 to 2e4)
     * in all three llama3 bands, as test_forward.c's llama3 case */
    eng_model hf, gg, unscaled;
    load_hf(&hf, "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                 "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                 "\"original_max_position_embeddings\": 64}");
    cr_assert_eq(hf.cfg.rope_scaling, ENG_ROPE_LLAMA3);
    float factors[8];
    converter_llama3_factors(hf.cfg.rope_theta, hf.cfg.head_dim, 8.0f, 1.0f, 4.0f, 64.0f, factors);
    int kept = 0, divided = 0, blended = 0;
    for (int i = 0; i < 8; i++) {
        kept += factors[i] == 1.0f;
        divided += factors[i] == 8.0f;
        blended += factors[i] > 1.0f && factors[i] < 8.0f;
    }
    cr_assert(kept && divided && blended, "all three bands: %d kept, %d blended, %d divided", kept,
              blended, divided);
    char path[700], plain_path[700];
    write_gguf(&hf, "llama3.gguf", factors, 8, GGML_TYPE_F32, path, sizeof path);
    write_gguf(&hf, "plain.gguf", NULL, 0, 0, plain_path, sizeof plain_path);
    load_gguf(&gg, path);
    load_gguf(&unscaled, plain_path);
    cr_assert_eq(gg.cfg.rope_scaling, ENG_ROPE_NONE, "the converter writes no scaling type");
    cr_assert_eq(gg.cfg.n_rope_freq_factors, 8);

    int64_t V = hf.cfg.vocab_size;
    size_t nl = (size_t)N_TOKENS * (size_t)V;
    float *want = run_logits(&hf), *got = run_logits(&gg);
    double *ref = test_widen(want, nl);
    double err = test_worst_row_l2(got, ref, N_TOKENS, (size_t)V);
    cr_assert_lt(err, FWD_REL_TOL, "GGUF with the converter's factors vs the folder: %g", err);
    free(got);
    got = run_logits(&unscaled);
    double effect = test_worst_row_l2(got, ref, N_TOKENS, (size_t)V);
    cr_log_info("llama3 factors: error %.3g, without them %.3g", err, effect);
    cr_assert_gt(effect, 1e-3, "without rope_freqs the GGUF is far from the folder (%g)", effect);
    free(ref);
    free(want);
    free(got);
    eng_model_free(&unscaled);
    eng_model_free(&gg);
    eng_model_free(&hf);
}

/* Loading path fails with a message holding each of the needles. */
static void assert_refused(const char *path, const char *needle1, const char *needle2)
{
    eng_model m;
    char msg[512] = "";
    eng_load_opts o = {.path = path};
    int rc = eng_model_load(&m, &o, msg, sizeof msg);
    cr_assert_neq(rc, 0, "%s loads", path);
    cr_assert(strstr(msg, needle1) && strstr(msg, needle2), "%s: %s", path, msg);
}

Test(rope_freqs, bad_factors_and_partial_rotation_are_refused_by_name)
{
    eng_model hf;
    load_hf(&hf, NULL);
    float ok[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    char path[700];
    write_gguf(&hf, "f16.gguf", ok, 8, GGML_TYPE_F16, path, sizeof path);
    assert_refused(path, "rope_freqs.weight", "f16");
    write_gguf(&hf, "short.gguf", ok, 4, GGML_TYPE_F32, path, sizeof path);
    assert_refused(path, "rope_freqs.weight", "head_dim / 2 = 8");
    write_gguf(&hf, "long.gguf", ok, 9, GGML_TYPE_F32, path, sizeof path);
    assert_refused(path, "rope_freqs.weight", "9 long");
    float zero[8] = {1, 2, 3, 0, 5, 6, 7, 8};
    write_gguf(&hf, "zero.gguf", zero, 8, GGML_TYPE_F32, path, sizeof path);
    assert_refused(path, "rope_freqs.weight[3] = 0", "positive");
    float nan[8] = {1, 2, 3, 4, 5, 6, 7, NAN};
    write_gguf(&hf, "nan.gguf", nan, 8, GGML_TYPE_F32, path, sizeof path);
    assert_refused(path, "rope_freqs.weight[7]", "positive");

    gguf_writer *w = lora_fix_llama_gguf(&hf, "tiny");
    gguf_writer_set_u32(w, "llama.rope.dimension_count", 8);
    snprintf(path, sizeof path, "%s/partial.gguf", dir);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
    assert_refused(path, "llama.rope.dimension_count = 8", "whole heads");
    eng_model_free(&hf);
}

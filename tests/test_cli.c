/*
 * test_cli.c - `qlserve quantize` and `qlserve inspect` end to end, on real
 * safetensors files made here: the quantized file holds the bitsandbytes
 * serialization of exactly what qt_quantize produces, other tensors are
 * copied byte for byte, and bad input (NaN, truncated file, bad flags, an
 * already quantized file without --allow-requantize) exits non-zero with a
 * message naming the problem.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "lora_fixture.h"
#include "model.h"
#include "modelfile.h"
#include "qt_math.h"
#include "run_prompt.h"
#include "runtime.h"
#include "test_util.h"
#include "tiny_model.h"
#include "tokenizer.h"

static char dir[512];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(cli, .init = setup, .fini = teardown);

/* Run the binary with args; stdout+stderr into *out (caller frees). */
static int run(const char *args, char **out)
{
    char cmd[4096], log[600];
    snprintf(log, sizeof log, "%s/out.txt", dir);
    snprintf(cmd, sizeof cmd, "%s %s > '%s' 2>&1", QL_BINARY, args, log);
    int st = system(cmd);
    *out = test_read_file(log, NULL);
    cr_assert(*out, "cannot read %s", log);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#define ROWS 16
#define COLS 80

static float weight[ROWS * COLS];

/* A small model-like file: an f32 and a bf16 linear weight, a 1-D norm and
 * an integer tensor. */
static void make_model(const char *path, bool poison)
{
    uint64_t rng = 31337;
    for (int i = 0; i < ROWS * COLS; i++)
        weight[i] = 0.05f * test_normal(&rng);
    if (poison)
        weight[3 * COLS + 5] = NAN;
    uint16_t wb[8 * 64];
    for (int i = 0; i < 8 * 64; i++)
        wb[i] = qm_f32_to_bf16(0.1f * test_normal(&rng));
    float norm[COLS];
    for (int i = 0; i < COLS; i++)
        norm[i] = 1.0f + 0.01f * (float)i;
    int64_t pos[3] = {7, 8, 9};
    st_writer *w = st_writer_new();
    char msg[256];
    int64_t s1[2] = {ROWS, COLS}, s2[2] = {8, 64}, s3[1] = {COLS}, s4[1] = {3};
    cr_assert_eq(st_writer_add(w, "model.layers.0.mlp.down_proj.weight", ST_F32, 2, s1, weight,
                               sizeof weight, true, msg, 256),
                 0);
    cr_assert_eq(st_writer_add(w, "model.layers.0.self_attn.q_proj.weight", ST_BF16, 2, s2, wb,
                               sizeof wb, true, msg, 256),
                 0);
    cr_assert_eq(
        st_writer_add(w, "model.norm.weight", ST_F32, 1, s3, norm, sizeof norm, true, msg, 256), 0);
    cr_assert_eq(st_writer_add(w, "position_ids", ST_I64, 1, s4, pos, sizeof pos, true, msg, 256),
                 0);
    cr_assert_eq(st_writer_set_metadata(w, "format", "pt"), 0);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
}

Test(cli, quantize_writes_the_bitsandbytes_serialization)
{
    char in[600], outp[600], args[2000];
    snprintf(in, sizeof in, "%s/model.safetensors", dir);
    snprintf(outp, sizeof outp, "%s/model-nf4.safetensors", dir);
    make_model(in, false);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind nf4 --double-quant", in,
             outp);
    char *out;
    int rc = run(args, &out);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, out);
    cr_assert(strstr(out, "2 tensors quantized to nf4, 2 copied"), "%s", out);
    free(out);

    st_file f;
    char msg[512];
    cr_assert_eq(st_open(&f, outp, msg, sizeof msg), 0, "%s", msg);
    const char *base = "model.layers.0.mlp.down_proj.weight";
    cr_assert(bnb_is_quantized(&f, base));
    /* the parts transformers expects, with its dtypes */
    char key[256];
    snprintf(key, sizeof key, "%s.absmax", base);
    cr_assert_eq(st_find(&f, key)->dtype, ST_U8);
    snprintf(key, sizeof key, "%s.nested_absmax", base);
    cr_assert_eq(st_find(&f, key)->dtype, ST_F32);
    snprintf(key, sizeof key, "%s.quant_state.bitsandbytes__nf4", base);
    const st_tensor *qs = st_find(&f, key);
    cr_assert(qs);
    char json[512] = {0};
    memcpy(json, qs->data, qs->nbytes < 511 ? qs->nbytes : 511);
    cr_assert(strstr(json, "\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", "
                           "\"shape\": [16, 80], \"nested_blocksize\": 256"),
              "%s", json);
    const st_tensor *packed = st_find(&f, base);
    cr_assert_eq(packed->ndim, 2);
    cr_assert_eq(packed->shape[0], ROWS * COLS / 2);
    cr_assert_eq(packed->shape[1], 1);

    /* exactly what the quantization core produces */
    qtensor got, want;
    char dtype[16];
    cr_assert_eq(bnb_read(&f, base, &got, dtype, msg, sizeof msg), 0, "%s", msg);
    cr_assert_str_eq(dtype, "float32");
    qt_quant_params p = {.kind = QT_NF4, .blocksize = 64, .double_quant = true};
    cr_assert_eq(qt_quantize(&want, weight, ROWS, COLS, &p, msg, sizeof msg), 0);
    cr_assert_eq(got.data_bytes, want.data_bytes);
    cr_assert_eq(memcmp(got.data, want.data, got.data_bytes), 0);
    cr_assert_eq(memcmp(got.absmax_codes, want.absmax_codes, (size_t)got.n_blocks), 0);
    cr_assert(same_bits(got.nested_offset, want.nested_offset));
    float a[ROWS * COLS], b[ROWS * COLS];
    qt_dequantize_rows(&got, 0, ROWS, a);
    qt_dequantize_rows(&want, 0, ROWS, b);
    cr_assert_eq(memcmp(a, b, sizeof a), 0);
    qt_free(&got);
    qt_free(&want);

    /* the bf16 weight records its dtype */
    cr_assert_eq(
        bnb_read(&f, "model.layers.0.self_attn.q_proj.weight", &got, dtype, msg, sizeof msg), 0,
        "%s", msg);
    cr_assert_str_eq(dtype, "bfloat16");
    qt_free(&got);

    /* 1-D and integer tensors and the metadata copied as they were */
    const st_tensor *norm = st_find(&f, "model.norm.weight");
    cr_assert(norm && norm->dtype == ST_F32 && norm->numel == COLS);
    float nv[COLS];
    memcpy(nv, norm->data, sizeof nv);
    cr_assert_eq(nv[10], 1.0f + 0.01f * 10.0f);
    cr_assert_eq(st_find(&f, "position_ids")->dtype, ST_I64);
    cr_assert_eq(f.n_meta, 1u);
    st_close(&f);

    /* inspect describes it */
    snprintf(args, sizeof args, "inspect '%s'", outp);
    rc = run(args, &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "model.layers.0.mlp.down_proj.weight: nf4 [16, 80] blocksize 64, "
                          "dtype float32, double-quant (nested blocksize 256"),
              "%s", out);
    cr_assert(strstr(out, "model.norm.weight: F32 [80]"), "%s", out);
    cr_assert(strstr(out, "metadata format = pt"), "%s", out);
    cr_assert_null(strstr(out, ".absmax:"), "parts listed as tensors: %s", out);
    free(out);
}

Test(cli, fp4_with_a_blocksize)
{
    char in[600], outp[600], args[2000];
    snprintf(in, sizeof in, "%s/model.safetensors", dir);
    snprintf(outp, sizeof outp, "%s/model-fp4.safetensors", dir);
    make_model(in, false);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind fp4 --blocksize=128", in,
             outp);
    char *out;
    cr_assert_eq(run(args, &out), 0, "%s", out);
    free(out);
    snprintf(args, sizeof args, "inspect '%s'", outp);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "fp4 [16, 80] blocksize 128, dtype float32, 10 blocks"), "%s", out);
    free(out);
}

Test(cli, nan_weight_is_refused_with_tensor_and_index)
{
    char in[600], outp[600], args[2000];
    snprintf(in, sizeof in, "%s/nan.safetensors", dir);
    snprintf(outp, sizeof outp, "%s/out.safetensors", dir);
    make_model(in, true);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind nf4", in, outp);
    char *out;
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "model.layers.0.mlp.down_proj.weight") &&
                  strstr(out, "index 245 (row 3, col 5)"),
              "%s", out);
    free(out);
    cr_assert_neq(access(outp, F_OK), 0, "a refused quantize left an output file");
}

Test(cli, truncated_and_quantized_inputs_are_refused)
{
    char in[600], cut[600], outp[600], args[2000];
    snprintf(in, sizeof in, "%s/model.safetensors", dir);
    snprintf(cut, sizeof cut, "%s/cut.safetensors", dir);
    snprintf(outp, sizeof outp, "%s/out.safetensors", dir);
    make_model(in, false);
    snprintf(args, sizeof args, "head -c 3000 '%s' > '%s'", in, cut);
    cr_assert_eq(system(args), 0);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind nf4", cut, outp);
    char *out;
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "cut.safetensors") && strstr(out, "truncated"), "%s", out);
    free(out);
    snprintf(args, sizeof args, "inspect '%s'", cut);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    free(out);

    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind nf4", in, outp);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    free(out);
    char again[600];
    snprintf(again, sizeof again, "%s/again.safetensors", dir);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind nf4", outp, again);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "already quantized"), "%s", out);
    free(out);
}

Test(cli, bad_flags_exit_2_and_name_the_flag)
{
    char *out;
    cr_assert_eq(run("quantize --in a --out b --kind nf4 --bogus 3", &out), 2);
    cr_assert(strstr(out, "--bogus"), "%s", out);
    free(out);
    cr_assert_eq(run("quantize --in a --out b --kind nf4 --blocksize 12x", &out), 2);
    cr_assert(strstr(out, "--blocksize 12x"), "%s", out);
    free(out);
    cr_assert_eq(run("quantize --in a --kind nf4", &out), 2);
    cr_assert(strstr(out, "required"), "%s", out);
    free(out);
    cr_assert_eq(run("quantize --in a --out b --kind q4_0", &out), 1);
    cr_assert(strstr(out, "--kind q4_0"), "%s", out);
    free(out);
    cr_assert_eq(run("quantize --in a --out b --kind nf4 --blocksize 100", &out), 1);
    cr_assert(strstr(out, "--blocksize 100"), "%s", out);
    free(out);
    cr_assert_eq(run("frobnicate", &out), 2);
    cr_assert(strstr(out, "unknown command 'frobnicate'"), "%s", out);
    free(out);
    cr_assert_eq(run("quantize --help", &out), 0);
    cr_assert(strstr(out, "--double-quant"), "%s", out);
    free(out);
}

Test(cli, version_reports_kernels_and_libraries)
{
    char *out;
    cr_assert_eq(run("version", &out), 0);
    cr_assert(strstr(out, "cpu kernels: "), "%s", out);
    cr_assert(strstr(out, "libuv 1."), "%s", out);
    cr_assert(strstr(out, "\ncuda: "), "%s", out);
    free(out);
}

/* The default tiny model as a Hugging Face folder at <dir>/tiny. */
static tiny_spec write_tiny_model(char *model, size_t len)
{
    snprintf(model, len, "%s/tiny", dir);
    cr_assert_eq(mkdir(model, 0700), 0);
    tiny_spec s = tiny_default();
    tiny_write_hf(model, &s);
    return s;
}

Test(cli, inspect_and_tokenize_a_hugging_face_folder)
{
    char model[600], args[2000];
    write_tiny_model(model, sizeof model);
    char *out;
    snprintf(args, sizeof args, "inspect '%s' --quant nf4-dq", model);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "safetensors model, architecture llama"), "%s", out);
    cr_assert(strstr(out, "layers 2, hidden 64, heads 4 (kv 2, head dim 16), ffn 96, vocab 260"),
              "%s", out);
    cr_assert(strstr(out, "linear layers nf4-dq-b64"), "%s", out);
    cr_assert(strstr(out, "tokenizer byte-level BPE"), "%s", out);
    free(out);

    snprintf(args, sizeof args, "tokenize --model '%s' ' the theme'", model);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    /* the tiny tokenizer merges " the" into id 258 */
    cr_assert(strstr(out, "   258  ' the'"), "%s", out);
    cr_assert(strstr(out, "tokens"), "%s", out);
    free(out);

    snprintf(args, sizeof args, "inspect '%s' --quant q7", model);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "--quant q7"), "%s", out);
    free(out);
}

/* A vocabulary-only GGUF: the tiny tokenizer's metadata and no tensors, as
 * llama.cpp's models/ggml-vocab-*.gguf are. */
static void write_vocab_gguf(const char *path)
{
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "general.name", "tiny vocabulary");
    tiny_gguf_tokenizer(w);
    char msg[512];
    cr_assert_eq(gguf_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    gguf_writer_free(w);
}

Test(cli, tokenize_reads_a_vocabulary_only_gguf_with_and_without_special_tokens)
{
    char path[600], args[2000], msg[512];
    snprintf(path, sizeof path, "%s/vocab.gguf", dir);
    write_vocab_gguf(path);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_neq(eng_model_load(&m, &o, msg, sizeof msg), 0, "no weights: not a model");

    /* " the" is merged into 258; <|endoftext|> is the control token 259,
     * or 13 bytes of text with --no-special (the GPT-2 pre-tokenizer cuts
     * it into "<|", "endoftext", "|>", which no merge joins) */
    char *out;
    snprintf(args, sizeof args, "tokenize --model '%s' --json ' the<|endoftext|>x'", path);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert_str_eq(out, "{\"ids\": [258, 259, 120]}\n");
    free(out);
    snprintf(args, sizeof args, "tokenize --model '%s' --json --no-special ' the<|endoftext|>x'",
             path);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert_str_eq(out, "{\"ids\": [258, 60, 124, 101, 110, 100, 111, 102, 116, 101, 120, 116, "
                          "124, 62, 120]}\n");
    free(out);
    /* the table, as before, from the same file */
    snprintf(args, sizeof args, "tokenize --model '%s' '<|endoftext|>'", path);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert_str_eq(out, "   259  '<|endoftext|>'\n1 tokens\n");
    free(out);
    /* BOS (259 here) only when asked; the tiny tokenizer's metadata says no */
    snprintf(args, sizeof args, "tokenize --model '%s' --json --add-bos ' the'", path);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert_str_eq(out, "{\"ids\": [258]}\n");
    free(out);
    /* "--" ends the options: a text that starts with dashes is tokenized */
    snprintf(args, sizeof args, "tokenize --model '%s' --json -- '--x'", path);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert_str_eq(out, "{\"ids\": [45, 45, 120]}\n");
    free(out);
}

Test(cli, tokenize_a_folder_reads_its_tokenizer_json_alone)
{
    /* the tiny folder's tokenizer.json with no weights beside it */
    char model[600], args[2000];
    snprintf(model, sizeof model, "%s/tok", dir);
    cr_assert_eq(mkdir(model, 0700), 0);
    char path[700];
    snprintf(path, sizeof path, "%s/tokenizer.json", model);
    tiny_write_tokenizer_json(path);
    char *out;
    snprintf(args, sizeof args, "tokenize --model '%s' --json 'the theme<|endoftext|>'", model);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert_str_eq(out, "{\"ids\": [116, 257, 258, 109, 101, 259]}\n");
    free(out);
    /* a folder without tokenizer.json, and flags tokenize does not take */
    snprintf(args, sizeof args, "tokenize --model '%s' x", dir);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "tokenizer.json is missing"), "%s", out);
    free(out);
    snprintf(args, sizeof args, "tokenize --model '%s' --quant nf4 x", model);
    cr_assert_neq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "unknown flag '--quant'"), "%s", out);
    free(out);
}

Test(cli, inspect_a_gguf_model)
{
    char path[600], args[2000];
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    tiny_spec s = tiny_default();
    tiny_write_gguf(path, &s, QT_Q8_0);
    char *out;
    snprintf(args, sizeof args, "inspect '%s'", path);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "GGUF v3") && strstr(out, "q8_0 x"), "%s", out);
    cr_assert(strstr(out, "gguf model, architecture llama"), "%s", out);
    cr_assert(strstr(out, "adjacent pairs"), "%s", out);
    cr_assert(strstr(out, "linear layers q8_0"), "%s", out);
    free(out);
}

Test(cli, generate_prints_a_completion_and_its_speed)
{
    char model[600], args[2000];
    write_tiny_model(model, sizeof model);
    char *out;
    snprintf(args, sizeof args,
             "generate --model '%s' --quant q4_0 --prompt 'the theme' --max-new-tokens 5 "
             "--threads 2",
             model);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "--quant q4_0"), "%s", out);
    free(out);
    snprintf(args, sizeof args,
             "generate --model '%s' --quant nf4 --prompt 'the theme' --max-new-tokens 5 "
             "--threads 2 --seed 3 --temperature 0.7",
             model);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "prompt ") && strstr(out, "generated 5 tokens") &&
                  strstr(out, "tok/s decode; finish length"),
              "%s", out);
    free(out);
    /* bad input: each refused with the reason, exit 1 or 2 */
    struct {
        const char *flags;
        int code;
        const char *expect;
    } bad[] = {
        {"--prompt ''", 1, "the prompt is empty"},
        {"--prompt x --max-new-tokens 0", 1, "max_new_tokens 0"},
        {"--prompt x --temperature -1", 1, "temperature"},
        {"--prompt x --top-p 1.5", 1, "top_p"},
        {"--prompt x --temperature warm", 2, "--temperature warm"},
        {"--prompt \"$(printf '\\377\\376')\"", 1, "not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(args, sizeof args, "generate --model '%s' --threads 1 %s", model, bad[i].flags);
        int rc = run(args, &out);
        cr_assert_eq(rc, bad[i].code, "%s: exit %d: %s", bad[i].flags, rc, out);
        cr_assert(strstr(out, bad[i].expect), "%s: '%s' lacks '%s'", bad[i].flags, out,
                  bad[i].expect);
        free(out);
    }
}

/* --speculative ngram and draft (the model as its own draft) draft and say
 * what they took, with the same completion, and so does mtp on the tiny
 * Qwen3.5 with its MTP layer; mtp on a model without MTP layers, and
 * --draft-model without --speculative draft, are refused by name. */
Test(cli, generate_speculative_ngram_draft_and_mtp_without_its_layers)
{
    char model[600], args[2000];
    write_tiny_model(model, sizeof model);
    char *plain, *out;
    const char *common = "--prompt 'a b c a b c a b' --max-new-tokens 24 --threads 2";
    snprintf(args, sizeof args, "generate --model '%s' %s", model, common);
    cr_assert_eq(run(args, &plain), 0, "%s", plain);
    snprintf(args, sizeof args, "generate --model '%s' %s --speculative ngram --draft-max 3", model,
             common);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "speculative ngram: "), "%s", out);
    /* the completion comes before the speed line, which differs */
    size_t n = (size_t)(strstr(plain, "prompt ") - plain);
    cr_assert(strncmp(out, plain, n) == 0, "'%s' against '%s'", out, plain);
    free(out);
    snprintf(args, sizeof args, "generate --model '%s' %s --speculative draft --draft-model '%s'",
             model, common, model);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "speculative draft: "), "%s", out);
    cr_assert(strncmp(out, plain, n) == 0, "'%s' against '%s'", out, plain);
    free(out);
    free(plain);
    /* the tiny model has no MTP layers: refused at the engine's start, naming them */
    snprintf(args, sizeof args, "generate --model '%s' %s --speculative mtp", model, common);
    int rc = run(args, &out);
    cr_assert_neq(rc, 0, "exit %d: %s", rc, out);
    cr_assert(strstr(out, "has no MTP layers (mtp.* tensors)"), "%s", out);
    free(out);
    char mtp[600];
    snprintf(mtp, sizeof mtp, "%s/mtp", dir);
    cr_assert_eq(mkdir(mtp, 0755), 0);
    tiny_fixture_folder("qwen35_mtp_tiny", mtp);
    snprintf(args, sizeof args, "generate --model '%s' %s", mtp, common);
    cr_assert_eq(run(args, &plain), 0, "%s", plain);
    snprintf(args, sizeof args, "generate --model '%s' %s --speculative mtp", mtp, common);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "speculative mtp: "), "%s", out);
    /* after the log line that says what the hybrid model's drafts keep */
    char *completion = strndup(plain, (size_t)(strstr(plain, "prompt ") - plain));
    cr_assert(strstr(out, completion), "'%s' against '%s'", out, plain);
    free(completion);
    free(out);
    free(plain);
    snprintf(args, sizeof args, "generate --model '%s' %s --draft-model '%s'", model, common,
             model);
    rc = run(args, &out);
    cr_assert_eq(rc, 2, "exit %d: %s", rc, out);
    cr_assert(strstr(out, "--draft-model") && strstr(out, "--speculative draft"), "%s", out);
    free(out);
}

/* --device: cpu runs and says so; cuda runs on a GPU or is refused with the
 * reason (no device, or a build without CUDA); anything else is a usage
 * error naming the value. */
Test(cli, generate_device_choice)
{
    char model[600], args[2000];
    write_tiny_model(model, sizeof model);
    char *out;
    const char *common = "--prompt 'the theme' --max-new-tokens 3 --threads 2";
    snprintf(args, sizeof args, "generate --model '%s' %s --device cpu", model, common);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "finish length; on cpu (2 threads)"), "%s", out);
    free(out);
    snprintf(args, sizeof args, "generate --model '%s' %s --device auto", model, common);
    cr_assert_eq(run(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "; on cpu (") || strstr(out, "; on cuda ("), "%s", out);
    free(out);
    snprintf(args, sizeof args, "generate --model '%s' %s --device cuda", model, common);
    int rc = run(args, &out);
    if (rc == 0)
        cr_assert(strstr(out, "; on cuda ("), "%s", out);
    else
        cr_assert(rc == 1 && strstr(out, "device cuda: "), "exit %d: %s", rc, out);
    free(out);
    snprintf(args, sizeof args, "generate --model '%s' %s --device gpu", model, common);
    cr_assert_eq(run(args, &out), 2, "%s", out);
    cr_assert(strstr(out, "--device gpu: one of cpu, cuda, auto"), "%s", out);
    free(out);
}

/* generate on the tiny model (CPU) with each of flags[0, n) (a flag and its
 * value, or ""): each runs and its end line holds want[i]; then with bad
 * (a flag and a value not among its words): exit 2 and a message holding
 * expect. */
static void check_generate_choice(const char *model, int n, const char *const *flags,
                                  const char *const *want, const char *bad, const char *expect)
{
    char args[2000];
    char *out;
    const char *common = "--prompt 'the theme' --max-new-tokens 3 --threads 2 --device cpu";
    for (int i = 0; i < n; i++) {
        snprintf(args, sizeof args, "generate --model '%s' %s %s", model, common, flags[i]);
        cr_assert_eq(run(args, &out), 0, "%s: %s", flags[i], out);
        cr_assert(strstr(out, want[i]), "%s: %s", flags[i], out);
        free(out);
    }
    snprintf(args, sizeof args, "generate --model '%s' %s %s", model, common, bad);
    cr_assert_eq(run(args, &out), 2, "%s", out);
    cr_assert(strstr(out, expect), "%s", out);
    free(out);
}

/* --kv-dtype: each value runs and the end line names it (the default f16
 * on the CPU); anything else is a usage error naming the value. */
Test(cli, generate_kv_dtype_choice)
{
    char model[600];
    write_tiny_model(model, sizeof model);
    check_generate_choice(
        model, 4, (const char *[]){"", "--kv-dtype f32", "--kv-dtype f16", "--kv-dtype q8_0"},
        (const char *[]){"; KV f16\n", "; KV f32\n", "; KV f16\n", "; KV q8_0\n"},
        "--kv-dtype bf16", "--kv-dtype bf16: one of f32, f16, q8_0");
}

/* --activations: f32 (the default) and q8 run and the end line names the
 * one the run computed with (q8 on the CPU; the CUDA backend keeps f32 and
 * says so); anything else is a usage error naming the flag and the value,
 * on generate and on serve alike, before any model is read. */
Test(cli, activations_choice)
{
    char model[600], args[2000];
    write_tiny_model(model, sizeof model);
    check_generate_choice(
        model, 3, (const char *[]){"", "--activations f32", "--activations q8"},
        (const char *[]){"; activations f32; KV", "; activations f32; KV", "; activations q8; KV"},
        "--activations q4", "--activations q4: one of f32, q8");
    char *out;
    snprintf(args, sizeof args, "serve --model '%s' --port 0 --activations int8", model);
    cr_assert_eq(run(args, &out), 2, "%s", out);
    cr_assert(strstr(out, "--activations int8: one of f32, q8"), "%s", out);
    free(out);
}

Test(cli, generate_with_an_adapter_unmerged_and_merged)
{
    char model[600], adapter[600], args[2400];
    tiny_spec s = write_tiny_model(model, sizeof model);
    snprintf(adapter, sizeof adapter, "%s/adapter", dir);
    lora_fix_spec ls = lora_fix_default();
    ls.std = 0.2f;
    lora_fix_write_tiny(adapter, NULL, &s, &ls);
    char *base, *unmerged, *merged, *out;
    snprintf(args, sizeof args,
             "generate --model '%s' --quant nf4 --prompt 'the theme' --max-new-tokens 8 "
             "--threads 2",
             model);
    cr_assert_eq(run(args, &base), 0, "%s", base);
    snprintf(args, sizeof args,
             "generate --model '%s' --quant nf4 --prompt 'the theme' --max-new-tokens 8 "
             "--threads 2 --adapter '%s'",
             model, adapter);
    cr_assert_eq(run(args, &unmerged), 0, "%s", unmerged);
    cr_assert(strstr(unmerged, "rank 8, alpha 16, 14 modules"), "%s", unmerged);
    cr_assert(!strstr(unmerged, "merge:"), "%s", unmerged);
    snprintf(args, sizeof args,
             "generate --model '%s' --quant nf4 --prompt 'the theme' --max-new-tokens 8 "
             "--threads 2 --adapter '%s' --adapter-scale 0.5 --merge --into int8",
             model, adapter);
    cr_assert_eq(run(args, &merged), 0, "%s", merged);
    cr_assert(strstr(merged, "merge: layer 1 down_proj affine"), "%s", merged);
    cr_assert(strstr(merged, "into 14 modules (affine): delta_retained"), "%s", merged);
    /* the completion: base's first line, the line after the adapter's
     * description otherwise; the adapter changes it */
    const char *completion = strchr(unmerged, '\n');
    cr_assert(completion);
    cr_assert(strncmp(base, completion + 1, strcspn(base, "\n") + 1) != 0,
              "the adapter left the completion as it was: %s / %s", base, unmerged);
    free(base);
    free(unmerged);
    free(merged);
    /* refusals: a missing folder, --merge without --adapter, --into without --merge */
    struct {
        const char *flags;
        int code;
        const char *expect;
    } bad[] = {
        {"--adapter /nonexistent/adapter", 1, "/nonexistent/adapter"},
        {"--merge", 2, "need --adapter"},
        {"--adapter x --into int8", 2, "--into applies to --merge"},
        {"--adapter x --merge --into q4_0", 2, "--into q4_0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(args, sizeof args, "generate --model '%s' --prompt x --threads 1 %s", model,
                 bad[i].flags);
        int rc = run(args, &out);
        cr_assert_eq(rc, bad[i].code, "%s: exit %d: %s", bad[i].flags, rc, out);
        cr_assert(strstr(out, bad[i].expect), "%s: '%s' lacks '%s'", bad[i].flags, out,
                  bad[i].expect);
        free(out);
    }
}

/* --- quantize to a GGUF kind ------------------------------------------------ */

/* The tiny llama as an f32 GGUF whose linears are 256 wide but ffn_down,
 * whose 320 columns are not whole super-blocks of 256. */
static tiny_spec write_f32_gguf(const char *path)
{
    tiny_spec s = tiny_default();
    s.hidden = 256;
    s.inter = 320;
    tiny_write_gguf(path, &s, QT_F32);
    return s;
}

static const gguf_tensor *find(const gguf_file *f, const char *name)
{
    const gguf_tensor *t = gguf_find_tensor(f, name);
    cr_assert_not_null(t, "%s: no tensor %s", f->path, name);
    return t;
}

Test(cli, quantize_gguf_writes_each_kind_with_llama_quantize_fallbacks_and_it_runs)
{
    char in[600], outp[600], args[2000];
    snprintf(in, sizeof in, "%s/f32.gguf", dir);
    write_f32_gguf(in);
    const struct {
        const char *kind;
        uint32_t type, fallback, file_type;
    } kinds[] = {
        {"q2_k", GGML_TYPE_Q2_K, GGML_TYPE_Q4_0, 10},
        {"q3_k", GGML_TYPE_Q3_K, GGML_TYPE_Q4_0, 11},
        {"q4_k", GGML_TYPE_Q4_K, GGML_TYPE_Q5_0, 14},
        {"q5_k", GGML_TYPE_Q5_K, GGML_TYPE_Q5_1, 16},
        {"q6_k", GGML_TYPE_Q6_K, GGML_TYPE_Q8_0, 18},
        {"q8_0", GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 7},
        {"mxfp4", GGML_TYPE_MXFP4, GGML_TYPE_MXFP4, 38},
    };
    gguf_file src;
    char msg[512];
    cr_assert_eq(gguf_open(&src, in, msg, sizeof msg), 0, "%s", msg);
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        snprintf(outp, sizeof outp, "%s/%s.gguf", dir, kinds[k].kind);
        snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind %s", in, outp,
                 kinds[k].kind);
        char *out;
        cr_assert_eq(run(args, &out), 0, "%s", out);
        /* 320 is whole blocks of 32 */
        bool fall = kinds[k].type != GGML_TYPE_Q8_0 && kinds[k].type != GGML_TYPE_MXFP4;
        char want[128];
        snprintf(want, sizeof want, "16 tensors quantized to %s, 0 fell back, 5 copied",
                 kinds[k].kind);
        if (fall) {
            snprintf(want, sizeof want, "14 tensors quantized to %s, 2 fell back, 5 copied",
                     kinds[k].kind);
            cr_assert(strstr(out, "blk.1.ffn_down.weight: f32 [320, 256] -> ") &&
                          strstr(out, "320 columns are not a multiple of the"),
                      "%s", out);
        }
        cr_assert(strstr(out, want), "%s: %s", want, out);
        free(out);

        gguf_file f;
        cr_assert_eq(gguf_open(&f, outp, msg, sizeof msg), 0, "%s", msg);
        cr_assert_eq(f.n_tensors, src.n_tensors);
        cr_assert_eq(find(&f, "token_embd.weight")->ggml_type, kinds[k].type);
        cr_assert_eq(find(&f, "output.weight")->ggml_type, kinds[k].type);
        cr_assert_eq(find(&f, "blk.0.attn_q.weight")->ggml_type, kinds[k].type);
        cr_assert_eq(find(&f, "blk.0.ffn_down.weight")->ggml_type,
                     fall ? kinds[k].fallback : kinds[k].type);
        cr_assert_eq(find(&f, "blk.0.attn_norm.weight")->ggml_type, GGML_TYPE_F32);
        cr_assert_eq(find(&f, "output_norm.weight")->ggml_type, GGML_TYPE_F32);
        const gguf_kv *ft = gguf_find_kv(&f, "general.file_type");
        cr_assert(ft && ft->u == kinds[k].file_type, "%s: general.file_type", kinds[k].kind);
        const gguf_kv *qv = gguf_find_kv(&f, "general.quantization_version");
        cr_assert(qv && qv->u == 2);
        const gguf_kv *toks = gguf_find_kv(&f, "tokenizer.ggml.tokens");
        cr_assert(toks && toks->n == 260 && toks->strs[259].len == 13 &&
                  memcmp(toks->strs[259].ptr, "<|endoftext|>", 13) == 0);
        cr_assert_eq(f.n_kv, src.n_kv + 2, "the metadata, general.file_type and the version");

        /* every quantized tensor holds qt_quantize's bytes of the f32 input,
         * and the norms are copied byte for byte */
        for (uint64_t i = 0; i < f.n_tensors; i++) {
            const gguf_tensor *t = &f.tensors[i], *s = find(&src, t->name);
            if (t->ggml_type == GGML_TYPE_F32) {
                cr_assert(t->nbytes == s->nbytes && memcmp(t->data, s->data, s->nbytes) == 0, "%s",
                          t->name);
                continue;
            }
            qtensor got, want_q, in_q;
            cr_assert_eq(gguf_tensor_qtensor(&f, t, &got, msg, sizeof msg), 0, "%s", msg);
            cr_assert_eq(gguf_tensor_qtensor(&src, s, &in_q, msg, sizeof msg), 0, "%s", msg);
            qt_quant_params p = {.kind = got.kind};
            cr_assert_eq(qt_quantize(&want_q, (const float *)(const void *)in_q.data, in_q.rows,
                                     in_q.cols, &p, msg, sizeof msg),
                         0, "%s", msg);
            cr_assert(got.data_bytes == want_q.data_bytes &&
                          memcmp(got.data, want_q.data, got.data_bytes) == 0,
                      "%s %s: not qt_quantize's bytes", kinds[k].kind, t->name);
            qt_free(&want_q);
            qt_free(&got);
            qt_free(&in_q);
        }
        gguf_close(&f);

        snprintf(args, sizeof args,
                 "generate --model '%s' --prompt 'the theme' --max-new-tokens 4 --threads 2", outp);
        cr_assert_eq(run(args, &out), 0, "%s", out);
        cr_assert(strstr(out, "generated 4 tokens"), "%s: %s", kinds[k].kind, out);
        free(out);
    }
    gguf_close(&src);
}

Test(cli, quantize_gguf_refuses_quantized_and_non_gguf_inputs)
{
    char in[600], outp[600], args[2000];
    char *out;
    snprintf(in, sizeof in, "%s/q8.gguf", dir);
    snprintf(outp, sizeof outp, "%s/out.gguf", dir);
    tiny_spec s = tiny_default();
    tiny_write_gguf(in, &s, QT_Q8_0);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind q4_k", in, outp);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "tensor 'output.weight' is already q8_0"), "%s", out);
    cr_assert(strstr(out, "or --allow-requantize"), "%s", out);
    free(out);
    cr_assert_neq(access(outp, F_OK), 0, "a refused quantize left an output file");

    snprintf(in, sizeof in, "%s/model.safetensors", dir);
    make_model(in, false);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind q6_k", in, outp);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "is not a GGUF file: --kind q6_k reads a GGUF file"), "%s", out);
    free(out);
    cr_assert_neq(access(outp, F_OK), 0);
}

/* --allow-requantize: a quantized GGUF's weights are dequantized and quantized again, every
 * such tensor holding exactly qt_quantize's bytes of its dequantized rows, and the file runs;
 * the flag is refused by name where nothing quantized can come in (safetensors, fp8). */
Test(cli, quantize_gguf_allow_requantize_quantizes_the_dequantized_weights)
{
    char in[600], outp[600], args[2000], msg[512];
    char *out;
    snprintf(in, sizeof in, "%s/q8.gguf", dir);
    snprintf(outp, sizeof outp, "%s/requantized.gguf", dir);
    tiny_spec s = tiny_default();
    tiny_write_gguf(in, &s, QT_Q8_0);
    gguf_file src;
    cr_assert_eq(gguf_open(&src, in, msg, sizeof msg), 0, "%s", msg);
    static const char *const kinds[] = {"q4_k", "q8_0"};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind %s --allow-requantize",
                 in, outp, kinds[k]);
        cr_assert_eq(run(args, &out), 0, "%s", out);
        free(out);
        gguf_file f;
        cr_assert_eq(gguf_open(&f, outp, msg, sizeof msg), 0, "%s", msg);
        int requantized = 0;
        for (uint64_t i = 0; i < f.n_tensors; i++) {
            const gguf_tensor *t = &f.tensors[i], *st = find(&src, t->name);
            qtensor got, in_q, want;
            cr_assert_eq(gguf_tensor_qtensor(&src, st, &in_q, msg, sizeof msg), 0, "%s", msg);
            bool dense = qt_traits_table[in_q.kind].is_dense;
            if (dense && t->ggml_type == st->ggml_type) { /* a norm: copied */
                cr_assert(t->nbytes == st->nbytes && memcmp(t->data, st->data, st->nbytes) == 0,
                          "%s %s: a copied tensor changed", kinds[k], t->name);
                qt_free(&in_q);
                continue;
            }
            cr_assert_eq(gguf_tensor_qtensor(&f, t, &got, msg, sizeof msg), 0, "%s", msg);
            float *v = malloc((size_t)(in_q.rows * in_q.cols) * sizeof *v);
            qt_dequantize_rows(&in_q, 0, in_q.rows, v);
            qt_quant_params p = {.kind = got.kind};
            cr_assert_eq(qt_quantize(&want, v, in_q.rows, in_q.cols, &p, msg, sizeof msg), 0, "%s",
                         msg);
            cr_assert(got.data_bytes == want.data_bytes &&
                          memcmp(got.data, want.data, got.data_bytes) == 0,
                      "%s %s: not qt_quantize's bytes of the dequantized rows", kinds[k], t->name);
            requantized += !dense;
            free(v);
            qt_free(&want);
            qt_free(&got);
            qt_free(&in_q);
        }
        cr_assert_gt(requantized, 0, "%s: no weight was requantized", kinds[k]);
        gguf_close(&f);
        snprintf(args, sizeof args,
                 "generate --model '%s' --prompt 'the theme' --max-new-tokens 4 --threads 2", outp);
        cr_assert_eq(run(args, &out), 0, "%s", out);
        cr_assert(strstr(out, "generated 4 tokens"), "%s: %s", kinds[k], out);
        free(out);
    }
    gguf_close(&src);

    snprintf(in, sizeof in, "%s/model.safetensors", dir);
    make_model(in, false);
    snprintf(outp, sizeof outp, "%s/out.safetensors", dir);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind nf4 --allow-requantize", in,
             outp);
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "--allow-requantize is for a GGUF file in with a GGUF --kind, not nf4"),
              "%s", out);
    free(out);
    cr_assert_neq(access(outp, F_OK), 0, "a refused quantize left an output file");
}

/* --- quantize a Hugging Face folder to GGUF -------------------------------- */

/* Every position's logits of a short prompt through m (caller frees). */
static float *prompt_logits(eng_model *m, const int32_t *ids, int n)
{
    prompt_run r = {.tokens = ids, .n_tokens = n};
    return run_prompt(m, &r);
}

/* Both tokenizers give the same ids for each text, special tokens parsed. */
static void assert_same_ids(const tok_tokenizer *a, const tok_tokenizer *b, const char *what)
{
    static const char *const texts[] = {
        "Hello world! The theme of the thesis, then.",
        "  leading spaces and\ttabs\n\nnew lines 12345 67 8",
        "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80 emoji",
        "don't I'LL we've <|endoftext|> <|im_start|>user\nhi<|im_end|><|eot_id|></s>",
        "x",
    };
    char msg[512];
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        int32_t *ia, *ib;
        size_t na, nb;
        cr_assert_eq(tok_encode(a, texts[i], strlen(texts[i]), true, true, &ia, &na, msg, 512), 0,
                     "%s", msg);
        cr_assert_eq(tok_encode(b, texts[i], strlen(texts[i]), true, true, &ib, &nb, msg, 512), 0,
                     "%s", msg);
        cr_assert_eq(na, nb, "%s: text %zu: %zu ids from the folder, %zu from the GGUF", what, i,
                     na, nb);
        for (size_t k = 0; k < na; k++)
            cr_assert_eq(ia[k], ib[k], "%s: text %zu, id %zu: %d vs %d", what, i, k, ia[k], ib[k]);
        free(ia);
        free(ib);
    }
}

/* The folder's model and the GGUF's: the same tokenizer ids, the same
 * sizes, and logits within tol of the folder's (relative to its largest). */
static double compare_models(const char *folder, const char *gguf, const char *what)
{
    char msg[1024];
    eng_model a, b;
    eng_load_opts oa = {.path = folder}, ob = {.path = gguf};
    cr_assert_eq(eng_model_load(&a, &oa, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(eng_model_load(&b, &ob, msg, sizeof msg), 0, "%s: %s", what, msg);
    cr_assert_eq(a.cfg.arch, b.cfg.arch, "%s", what);
    cr_assert_eq(a.cfg.vocab_size, b.cfg.vocab_size, "%s", what);
    cr_assert_eq(a.cfg.head_dim, b.cfg.head_dim, "%s", what);
    cr_assert_eq(a.cfg.n_kv_heads, b.cfg.n_kv_heads, "%s", what);
    assert_same_ids(a.tok, b.tok, what);
    int32_t ids[8] = {1, 17, 200, 5, 258, 99, 3, 42};
    float *la = prompt_logits(&a, ids, 8), *lb = prompt_logits(&b, ids, 8);
    /* test_diff_rel: +inf when any logit of either is NaN or infinite */
    test_diff d = test_diff_f32(lb, la, (size_t)8 * (size_t)a.cfg.vocab_size);
    free(la);
    free(lb);
    eng_model_free(&a);
    eng_model_free(&b);
    return test_diff_rel(&d);
}

/* blk.0.attn_q.weight of the GGUF is, byte for byte, qt_quantize of the
 * folder's q_proj rows permuted as llama.cpp's converter permutes them
 * (head by head, the two rotary halves interleaved into adjacent rows). */
static void assert_permuted_q_bytes(const char *folder, const char *gguf, qt_kind kind, int heads)
{
    char path[1024], msg[512];
    const st_tensor *t = NULL;
    st_file shards[2];
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/model-%05d-of-00002.safetensors", folder, i + 1);
        cr_assert_eq(st_open(&shards[i], path, msg, sizeof msg), 0, "%s", msg);
        if (!t && st_find(&shards[i], "model.layers.0.self_attn.q_proj.weight"))
            t = st_find(&shards[i], "model.layers.0.self_attn.q_proj.weight");
    }
    cr_assert(t);
    qtensor src, q;
    cr_assert_eq(st_tensor_qtensor(st_find(&shards[0], t->name) ? &shards[0] : &shards[1], t, &src,
                                   msg, sizeof msg),
                 0, "%s", msg);
    int64_t rows = src.rows, cols = src.cols, per = rows / heads;
    float *v = malloc((size_t)(rows * cols) * sizeof *v), *row = malloc((size_t)cols * sizeof *row);
    for (int64_t r = 0; r < rows; r++) {
        int64_t h = r / per, i = r % per / 2, j = r % 2;
        qt_dequantize_rows(&src, h * per + j * (per / 2) + i, 1, row);
        memcpy(v + r * cols, row, (size_t)cols * sizeof *row);
    }
    qt_quant_params p = {.kind = kind};
    cr_assert_eq(qt_quantize(&q, v, rows, cols, &p, msg, sizeof msg), 0, "%s", msg);
    gguf_file f;
    cr_assert_eq(gguf_open(&f, gguf, msg, sizeof msg), 0, "%s", msg);
    const gguf_tensor *g = gguf_find_tensor(&f, "blk.0.attn_q.weight");
    cr_assert(g && g->nbytes == q.data_bytes && memcmp(g->data, q.data, q.data_bytes) == 0,
              "%s: blk.0.attn_q.weight is not the permuted rows quantized", gguf);
    gguf_close(&f);
    qt_free(&q);
    qt_free(&src);
    free(v);
    free(row);
    st_close(&shards[0]);
    st_close(&shards[1]);
}

Test(cli, quantize_a_hugging_face_folder_to_gguf_as_llama_cpp_converts_it)
{
    /* llama (sharded, permuted q/k), qwen2 (biases, tied embeddings), and the
     * qwen3 fixture (q/k norms, head_dim given) */
    char folder[600], outp[700], args[2000], from[1024], to[1024];
    tiny_spec llama = tiny_default();
    llama.hidden = 256, llama.inter = 512, llama.shards = 2;
    tiny_spec qwen2 = tiny_default();
    qwen2.arch = "Qwen2ForCausalLM", qwen2.tie = true, qwen2.dtype = ST_F32;
    const struct {
        const char *name;
        const tiny_spec *spec;
    } models[] = {{"llama", &llama}, {"qwen2", &qwen2}, {"qwen3", NULL}};
    /* worst relative logit error allowed for each kind: f32 is the same
     * arithmetic (the permuted rows run as interleaved rotary pairs); the
     * others are bounded by what 8 and 4.5 bits keep */
    const struct {
        const char *kind;
        double tol;
    } kinds[] = {{"f32", 1e-5}, {"q8_0", 0.02}, {"q4_k", 0.3}};
    for (size_t mi = 0; mi < 3; mi++) {
        snprintf(folder, sizeof folder, "%s/%s", dir, models[mi].name);
        cr_assert_eq(mkdir(folder, 0755), 0);
        if (models[mi].spec) {
            tiny_write_hf(folder, models[mi].spec);
        } else {
            const char *files[] = {"config.json", "model.safetensors"};
            for (size_t i = 0; i < 2; i++) {
                snprintf(from, sizeof from, "%s/qwen3_tiny/%s", QL_FIXTURES, files[i]);
                snprintf(to, sizeof to, "%s/%s", folder, files[i]);
                cr_assert(test_copy_file(from, to));
            }
            snprintf(to, sizeof to, "%s/tokenizer.json", folder);
            tiny_write_tokenizer_json(to);
        }
        for (size_t k = 0; k < 3; k++) {
            snprintf(outp, sizeof outp, "%s/%s-%s.gguf", dir, models[mi].name, kinds[k].kind);
            snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind %s", folder, outp,
                     kinds[k].kind);
            char *out;
            cr_assert_eq(run(args, &out), 0, "%s", out);
            cr_assert(strstr(out, "wrote "), "%s", out);
            free(out);
            double err = compare_models(folder, outp, outp);
            cr_log_info("%s %s: worst relative logit error %.3g", models[mi].name, kinds[k].kind,
                        err);
            cr_assert_leq(err, kinds[k].tol, "%s %s: %.3g", models[mi].name, kinds[k].kind, err);
            if (mi == 0 && k > 0)
                assert_permuted_q_bytes(folder, outp, k == 1 ? QT_Q8_0 : QT_Q4_K, llama.heads);
        }
    }
}

/* The real tokenizers of tests/fixtures/tokenizers (Llama 3's, Qwen2's,
 * SmolLM2's byte-level BPE; a SentencePiece-style BPE with byte fallback)
 * in a folder quantized to q8_0: the GGUF's tokenizer gives the folder's
 * ids (llama.cpp's too: checked by hand, see README). */
Test(cli, quantize_a_folder_carries_its_real_tokenizer_into_the_gguf)
{
    const char *const names[] = {"llama3", "qwen2", "smollm2", "spm"};
    char folder[600], outp[700], args[2000], from[1024], to[1024], msg[512];
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(from, sizeof from, "%s/tokenizers/%s", QL_FIXTURES, names[i]);
        tok_tokenizer *t;
        cr_assert_eq(eng_tokenizer_load(&t, from, msg, sizeof msg), 0, "%s", msg);
        tiny_spec s = tiny_default();
        s.vocab = (int)tok_vocab_size(t);
        s.arch = strcmp(names[i], "qwen2") == 0 ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
        tok_free(t);
        snprintf(folder, sizeof folder, "%s/%s", dir, names[i]);
        cr_assert_eq(mkdir(folder, 0755), 0);
        tiny_write_hf(folder, &s);
        const char *files[] = {"tokenizer.json", "tokenizer_config.json"};
        for (size_t k = 0; k < 2; k++) {
            snprintf(from, sizeof from, "%s/tokenizers/%s/%s", QL_FIXTURES, names[i], files[k]);
            snprintf(to, sizeof to, "%s/%s", folder, files[k]);
            cr_assert(test_copy_file(from, to));
        }
        snprintf(outp, sizeof outp, "%s/%s.gguf", dir, names[i]);
        snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind q8_0", folder, outp);
        char *out;
        cr_assert_eq(run(args, &out), 0, "%s", out);
        free(out);
        gguf_file f;
        cr_assert_eq(gguf_open(&f, outp, msg, sizeof msg), 0, "%s", msg);
        const gguf_kv *model = gguf_find_kv(&f, "tokenizer.ggml.model");
        const char *want = strcmp(names[i], "spm") == 0 ? "llama" : "gpt2";
        cr_assert(model && model->str.len == strlen(want) &&
                      memcmp(model->str.ptr, want, model->str.len) == 0,
                  "%s", names[i]);
        cr_assert(gguf_find_kv(&f, strcmp(want, "llama") ? "tokenizer.ggml.merges"
                                                         : "tokenizer.ggml.scores"),
                  "%s", names[i]);
        gguf_close(&f);
        double err = compare_models(folder, outp, names[i]);
        cr_assert_leq(err, 0.02, "%s: %.3g", names[i], err);
    }
}

Test(cli, quantize_a_folder_refuses_other_architectures_by_name)
{
    char folder[600], outp[700], args[2000], path[700];
    snprintf(folder, sizeof folder, "%s/phi", dir);
    cr_assert_eq(mkdir(folder, 0755), 0);
    tiny_spec s = tiny_default();
    tiny_write_hf(folder, &s);
    snprintf(path, sizeof path, "%s/config.json", folder);
    test_write_text(path, "{\"architectures\": [\"Phi3ForCausalLM\"], \"vocab_size\": 260}");
    snprintf(outp, sizeof outp, "%s/out.gguf", dir);
    snprintf(args, sizeof args, "quantize --in '%s' --out '%s' --kind q4_k", folder, outp);
    char *out;
    cr_assert_eq(run(args, &out), 1, "%s", out);
    cr_assert(strstr(out, "architecture Phi3ForCausalLM is not one quantize converts") &&
                  strstr(out, "Qwen3ForCausalLM"),
              "%s", out);
    free(out);
    cr_assert_neq(access(outp, F_OK), 0, "a refused quantize left an output file");
}

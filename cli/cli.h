/*
 * cli.h - the qlserve binary's one header (cli/). It offers two layers:
 *
 *   - the jobs (eng_quantize_file, eng_inspect, eng_generate,
 *     eng_generate_on, eng_tokenize): plain functions on paths, options and
 *     streams, which the subcommands run and the tests call directly. They
 *     own what they load for the length of the call and write only to the
 *     streams and files they are given;
 *   - the subcommands (cli_quantize, cli_inspect, cli_tokenize, cli_generate,
 *     cli_serve, cli_version): one per file, each taking its argv (argv[0]
 *     the subcommand's name), parsing its flags with config/ and running its
 *     job. main.c dispatches to them from one table.
 *
 * Exit status of every subcommand: 0 done, 1 the job failed (the message on
 * stderr names the file, tensor and problem), 2 a usage error.
 * cli/ may use server/, adapters/, engine/ (and the kernels beneath it) and
 * config/; nothing below it includes this header.
 */
#ifndef QL_CLI_H
#define QL_CLI_H

#include "config.h"
#include "scheduler.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* --- the jobs behind the command line ------------------------------------ */

typedef struct eng_quantize_opts {
    const char *in_path;
    const char *out_path;
    const char *kind;  /* "nf4", "fp4" (safetensors), "q2_k" ... "q6_k",
                          "q8_0", "f32" (a GGUF file or a Hugging Face
                          folder in, GGUF out) or "fp8" (a folder in, a
                          finegrained FP8 folder out) */
    int32_t blocksize; /* 0: 64 */
    bool double_quant;
    const char *block;     /* fp8: "RxC" (NULL: 128x128) */
    const char *scale_fmt; /* fp8: "float" or "ue8m0" (NULL: float) */
    bool allow_requantize; /* a GGUF file in: quantized weights are dequantized and
                              quantized again instead of refused */
} eng_quantize_opts;

/*
 * Quantize every 2-D float tensor of a safetensors file to NF4/FP4 and
 * write the bitsandbytes serialization; copy every other tensor and the
 * metadata unchanged. A file that already holds bitsandbytes quant state is
 * refused. With a GGUF kind, requantize a GGUF file's f32/f16/bf16 weights
 * into that kind (with llama-quantize's fallbacks) and copy the rest and
 * the metadata; an already quantized weight is refused, or with
 * allow_requantize dequantized and quantized again. A Hugging Face
 * folder with a GGUF kind is converted first (cli_quantize_hf). One line per
 * tensor goes to log (may be NULL).
 */
int eng_quantize_file(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len);

/* What a GGUF --kind writes (quantize.c's table): the kind, its fallback
 * for a weight whose columns do not fit its blocks, general.file_type. */
typedef struct cli_gguf_target {
    const char *name;
    qt_kind kind, fallback;
    uint32_t file_type;
} cli_gguf_target;
/* What GGUF tensor t (name, n_dims, ne read) becomes under g: its kind, or
 * QT_KIND_COUNT when llama-quantize would leave it as it is. */
qt_kind cli_gguf_plan(const cli_gguf_target *g, const gguf_tensor *t, bool *fell_back);
uint32_t cli_ggml_type_of(qt_kind k); /* the GGML type number of a GGUF kind */
/* src's rows (row_of[r] is the source of output row r; NULL: in order)
 * quantized into kind and streamed to o a bounded chunk at a time; what
 * names the tensor in messages. */
int cli_gguf_write_rows(const qtensor *src, const int64_t *row_of, qt_kind kind, const char *what,
                        gguf_out *o, char *msg, size_t msg_len);
/* A safetensors tensor's values as f32 (caller frees; NULL when out of
 * memory), for F32, F16 and BF16. */
float *cli_st_to_f32(const st_tensor *t);
/* A Hugging Face folder of float weights written as transformers'
 * finegrained FP8 (quantize_fp8.c): o->block, o->scale_fmt. */
int cli_quantize_fp8(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len);
/* Whether path is a directory (a Hugging Face folder). */
bool cli_is_folder(const char *path);
/* A Hugging Face folder (quantize_hf.c) converted as llama.cpp's
 * convert_hf_to_gguf.py does and written quantized under g. */
int cli_quantize_hf(const eng_quantize_opts *o, const cli_gguf_target *g, FILE *log, char *msg,
                    size_t msg_len);

/*
 * Print what a file or folder holds. A .safetensors file: each
 * bitsandbytes-quantized weight as one entry (kind, shape, blocksize,
 * nesting, dtype, bytes), every other tensor with its dtype and shape, and
 * the metadata. A model (a Hugging Face folder or a GGUF file): it is
 * loaded with `load` (path taken from `path`) and its architecture, sizes,
 * tensor kinds, bytes and tokenizer are printed.
 */
int eng_inspect(const char *path, const eng_load_opts *load, FILE *out, char *msg, size_t msg_len);

/* What `qlserve generate` asks for. */
typedef struct eng_generate_opts {
    const char *prompt;
    int32_t max_new_tokens;
    eng_sampling sampling;
    const char *stop;              /* one stop string, or NULL */
    int threads;                   /* 0: all cores */
    eng_device device;             /* where to run (auto: CUDA when present) */
    size_t kv_bytes;               /* 0: the engine's default */
    qt_kind kv_dtype;              /* the KV cache's values (zero: f32) */
    const eng_lora_term *adapters; /* the configuration wanted (eng_request) */
    size_t n_adapters;
    eng_spec_opts spec; /* speculative decoding (zero: off) */
} eng_generate_opts;

/*
 * Load the model, run the prompt through the engine, stream the completion
 * to out as it comes, then write one line to info: prompt tokens,
 * generated tokens, prefill and decode tokens per second, finish reason.
 */
int eng_generate(const eng_load_opts *load, const eng_generate_opts *g, FILE *out, FILE *info,
                 char *msg, size_t msg_len);
/* The same on an engine already running (threads and kv_bytes unused). */
int eng_generate_on(eng_engine *e, const eng_generate_opts *g, FILE *out, FILE *info, char *msg,
                    size_t msg_len);

/* What eng_tokenize does. */
typedef struct eng_tokenize_opts {
    const char *model; /* a Hugging Face folder or a GGUF file: only its tokenizer is read */
    const char *text;
    bool add_bos;       /* prepend BOS when the tokenizer's metadata asks */
    bool parse_special; /* special-token strings in text become their ids */
    bool json;          /* one line {"ids": [...]} instead of ids and pieces */
} eng_tokenize_opts;

/* Load the model's tokenizer alone (eng_tokenizer_load: no weights) and
 * print the ids of o->text: each with its piece and a count, or as JSON. */
int eng_tokenize(const eng_tokenize_opts *o, FILE *out, char *msg, size_t msg_len);

/* --- the subcommands main.c dispatches to --------------------------------- */

/* `qlserve quantize`, `inspect`, `tokenize`, `generate` (with --adapter:
 * load it, merge it when --merge asks, report), `serve`: argv[0] is the
 * subcommand's name, the flags follow. Output to stdout, diagnostics to
 * stderr, the exit status above. */
int cli_quantize(int argc, char **argv);
int cli_inspect(int argc, char **argv);
int cli_tokenize(int argc, char **argv);
int cli_generate(int argc, char **argv);
int cli_serve(int argc, char **argv);

/* `qlserve version`: the build's version (the caller passes it: QL_VERSION
 * is defined for the binary's target only), the CPU kernel path, the
 * libraries' versions and the CUDA backend, to stdout. Returns 0. */
int cli_version(const char *version);

/* --- shared by the subcommand files --------------------------------------- */

/* The tensor-name mark of bitsandbytes quant state: a tensor named
 * `W.quant_state.bitsandbytes__nf4` says W is quantized. */
#define CLI_BNB_QUANT_STATE ".quant_state.bitsandbytes__"

/* A config/ parse that did not give QL_OK: --help (QL_EHELP) prints sub's
 * usage to stdout and gives 0; anything else prints msg and the usage to
 * stderr and gives 2. */
int cli_usage_failure(const char *sub, int rc, const char *msg);

/* The model flags as the engine's load options (borrowing m's strings). */
eng_load_opts cli_load_opts(const cfg_model *m);

#endif

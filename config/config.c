/*
 * config.c - a small table-driven flag parser: each subcommand lists its
 * flags once (name, kind, where the value goes, help text), and both the
 * parser and the usage text are made from that list, so they cannot drift.
 * Accepts `--flag value` and `--flag=value`.
 */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

typedef enum { OPT_STRING, OPT_INT, OPT_BOOL, OPT_FLOAT, OPT_U64 } opt_type;

typedef struct opt {
    const char *name; /* without the leading -- */
    opt_type type;
    void *dest;
    const char *help;
} opt;

static int usage_error(char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int usage_error(char *msg, size_t msg_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, msg_len, fmt, ap);
    va_end(ap);
    return CFG_EUSAGE;
}

static int set_value(const opt *o, const char *value, char *msg, size_t msg_len)
{
    if (o->type == OPT_STRING) {
        *(const char **)o->dest = value;
        return CFG_OK;
    }
    char *end;
    errno = 0;
    if (o->type == OPT_FLOAT) {
        double d = strtod(value, &end);
        if (errno || end == value || *end || !isfinite(d))
            return usage_error(msg, msg_len, "--%s %s: not a number", o->name, value);
        *(float *)o->dest = (float)d;
        return CFG_OK;
    }
    if (o->type == OPT_U64) {
        unsigned long long u = strtoull(value, &end, 10);
        if (errno || end == value || *end || value[0] == '-')
            return usage_error(msg, msg_len, "--%s %s: not a non-negative integer", o->name, value);
        *(uint64_t *)o->dest = (uint64_t)u;
        return CFG_OK;
    }
    long v = strtol(value, &end, 10);
    if (errno || end == value || *end || v < INT32_MIN || v > INT32_MAX)
        return usage_error(msg, msg_len, "--%s %s: not an integer", o->name, value);
    *(int32_t *)o->dest = (int32_t)v;
    return CFG_OK;
}

/* Parse argv[1..argc) against opts; positional arguments go to *positional
 * (at most one allowed when positional is not NULL). */
static int parse(int argc, char **argv, const opt *opts, size_t n_opts, const char **positional,
                 char *msg, size_t msg_len)
{
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0)
            return CFG_HELP;
        if (strncmp(arg, "--", 2) != 0) {
            if (!positional || *positional)
                return usage_error(msg, msg_len, "%s: unexpected argument '%s'", argv[0], arg);
            *positional = arg;
            continue;
        }
        const char *name = arg + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const opt *o = NULL;
        for (size_t k = 0; k < n_opts; k++)
            if (strlen(opts[k].name) == len && strncmp(opts[k].name, name, len) == 0)
                o = &opts[k];
        if (!o)
            return usage_error(msg, msg_len, "%s: unknown flag '%s'", argv[0], arg);
        if (o->type == OPT_BOOL) {
            if (eq)
                return usage_error(msg, msg_len, "--%s takes no value", o->name);
            *(bool *)o->dest = true;
            continue;
        }
        const char *value = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!value)
            return usage_error(msg, msg_len, "--%s needs a value", o->name);
        int rc = set_value(o, value, msg, msg_len);
        if (rc != CFG_OK)
            return rc;
    }
    return CFG_OK;
}

#define QUANTIZE_OPTS(q)                                                                           \
    {                                                                                              \
        {"in", OPT_STRING, &(q)->in_path, "IN.safetensors: the tensors to quantize"},              \
            {"out", OPT_STRING, &(q)->out_path, "OUT.safetensors: where to write"},                \
            {"kind", OPT_STRING, &(q)->kind, "nf4 | fp4"},                                         \
            {"blocksize", OPT_INT, &(q)->blocksize, "N: elements per absmax block (default 64)"},  \
            {"double-quant", OPT_BOOL, &(q)->double_quant,                                         \
             "quantize absmax again (bitsandbytes compress_statistics)"},                          \
    }

int cfg_parse_quantize(int argc, char **argv, cfg_quantize *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    out->blocksize = 64;
    const opt opts[] = QUANTIZE_OPTS(out);
    int rc = parse(argc, argv, opts, sizeof opts / sizeof *opts, NULL, msg, msg_len);
    if (rc != CFG_OK)
        return rc;
    if (!out->in_path || !out->out_path || !out->kind)
        return usage_error(msg, msg_len, "quantize: --in, --out and --kind are required");
    return CFG_OK;
}

#define MODEL_OPTS(m)                                                                              \
    {"quant", OPT_STRING, &(m)->quant,                                                             \
     "none | nf4 | nf4-dq | fp4 | int4 | int8: quantize on load"},                                 \
        {"blocksize", OPT_INT, &(m)->blocksize, "N: nf4/fp4 absmax block (default 64)"},           \
        {"group-size", OPT_INT, &(m)->group_size,                                                  \
         "N: int4/int8 group (default 128 for int4, per channel for int8)"},                       \
        {"quantize-lm-head", OPT_BOOL, &(m)->quantize_lm_head, "quantize lm_head too"},            \
    {                                                                                              \
        "dtype", OPT_STRING, &(m)->dtype, "f32 | bf16 | f16: dtype of dense parameters"            \
    }

int cfg_parse_inspect(int argc, char **argv, cfg_inspect *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    const opt opts[] = {MODEL_OPTS(&out->model)};
    int rc = parse(argc, argv, opts, sizeof opts / sizeof *opts, &out->path, msg, msg_len);
    if (rc != CFG_OK)
        return rc;
    if (!out->path)
        return usage_error(msg, msg_len, "inspect: which file? (qlserve inspect FILE)");
    out->model.path = out->path;
    return CFG_OK;
}

int cfg_parse_tokenize(int argc, char **argv, cfg_tokenize *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    const opt opts[] = {
        {"model", OPT_STRING, &out->model.path, "PATH: a Hugging Face folder or a .gguf file"},
        {"add-bos", OPT_BOOL, &out->add_bos, "prepend BOS when the model's metadata asks"},
        MODEL_OPTS(&out->model)};
    int rc = parse(argc, argv, opts, sizeof opts / sizeof *opts, &out->text, msg, msg_len);
    if (rc != CFG_OK)
        return rc;
    if (!out->model.path || !out->text)
        return usage_error(msg, msg_len, "tokenize: qlserve tokenize --model PATH TEXT");
    return CFG_OK;
}

#define GENERATE_OPTS(g)                                                                           \
    {"model", OPT_STRING, &(g)->model.path, "PATH: a Hugging Face folder or a .gguf file"},        \
        {"prompt", OPT_STRING, &(g)->prompt, "TEXT: the prompt (as is: no chat template)"},        \
        {"max-new-tokens", OPT_INT, &(g)->max_new_tokens, "N: tokens to generate (default 128)"},  \
        {"temperature", OPT_FLOAT, &(g)->temperature, "T: 0 is greedy (default)"},                 \
        {"top-k", OPT_INT, &(g)->top_k, "K: sample among the K likeliest (0: off)"},               \
        {"top-p", OPT_FLOAT, &(g)->top_p, "P: nucleus sampling, in (0, 1] (1: off)"},              \
        {"repetition-penalty", OPT_FLOAT, &(g)->repetition_penalty, "R: > 0 (1: off)"},            \
        {"seed", OPT_U64, &(g)->seed, "N: the same seed gives the same text"},                     \
        {"stop", OPT_STRING, &(g)->stop, "STRING: end generation there (not printed)"},            \
        {"threads", OPT_INT, &(g)->threads, "N: kernel threads (default: all cores)"},             \
        {"kv-mib", OPT_INT, &(g)->kv_mib, "N: KV cache size in MiB (default 256)"},                \
        {"adapter", OPT_STRING, &(g)->adapter, "DIR: a PEFT LoRA adapter folder to apply"},        \
        {"adapter-scale", OPT_FLOAT, &(g)->adapter_scale, "S: the adapter's scale (default 1)"},   \
        {"merge", OPT_BOOL, &(g)->merge,                                                           \
         "merge the adapter into the weights and print the merge report (default: unmerged)"},     \
        {"into", OPT_STRING, &(g)->into,                                                           \
         "int8|bf16: store merged modules in a wider kind (default: the weight's own)"},           \
        MODEL_OPTS(&(g)->model)

int cfg_parse_generate(int argc, char **argv, cfg_generate *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    out->max_new_tokens = 128;
    out->top_p = 1.0f;
    out->repetition_penalty = 1.0f;
    out->adapter_scale = 1.0f;
    const opt opts[] = {GENERATE_OPTS(out)};
    int rc = parse(argc, argv, opts, sizeof opts / sizeof *opts, NULL, msg, msg_len);
    if (rc != CFG_OK)
        return rc;
    if (!out->model.path || !out->prompt)
        return usage_error(msg, msg_len, "generate: --model and --prompt are required");
    if (out->threads < 0 || out->kv_mib < 0)
        return usage_error(msg, msg_len, "generate: --threads and --kv-mib cannot be negative");
    if ((out->merge || out->into || out->adapter_scale != 1.0f) && !out->adapter)
        return usage_error(msg, msg_len,
                           "generate: --merge, --into and --adapter-scale need --adapter DIR");
    if (out->into && !out->merge)
        return usage_error(msg, msg_len, "generate: --into applies to --merge");
    if (out->into && strcmp(out->into, "int8") != 0 && strcmp(out->into, "bf16") != 0)
        return usage_error(msg, msg_len, "generate: --into %s: one of int8, bf16", out->into);
    return CFG_OK;
}

static void print_opts(FILE *out, const opt *opts, size_t n)
{
    for (size_t i = 0; i < n; i++)
        fprintf(out, "  --%-14s %s\n", opts[i].name, opts[i].help);
}

void cfg_print_usage(FILE *out, const char *sub)
{
    if (sub && strcmp(sub, "quantize") == 0) {
        cfg_quantize q;
        const opt opts[] = QUANTIZE_OPTS(&q);
        fprintf(out, "usage: qlserve quantize --in IN.safetensors --out OUT.safetensors "
                     "--kind nf4|fp4 [--blocksize N] [--double-quant]\n"
                     "Quantizes every 2-D float tensor and writes the bitsandbytes "
                     "serialization; other tensors are copied.\n");
        print_opts(out, opts, sizeof opts / sizeof *opts);
        return;
    }
    if (sub && strcmp(sub, "inspect") == 0) {
        cfg_model m;
        const opt opts[] = {MODEL_OPTS(&m)};
        fprintf(out, "usage: qlserve inspect FILE|MODEL [model flags]\n"
                     "A .safetensors file: its quantized weights with their quant state, other "
                     "tensors, metadata.\nA model (Hugging Face folder or .gguf): architecture, "
                     "sizes, tensor kinds, tokenizer, as loaded with the flags.\n");
        print_opts(out, opts, sizeof opts / sizeof *opts);
        return;
    }
    if (sub && strcmp(sub, "generate") == 0) {
        cfg_generate g;
        const opt opts[] = {GENERATE_OPTS(&g)};
        fprintf(out, "usage: qlserve generate --model PATH --prompt TEXT [flags]\n"
                     "Prints the completion as it is generated, then a line with the token "
                     "counts and speeds.\n");
        print_opts(out, opts, sizeof opts / sizeof *opts);
        return;
    }
    if (sub && strcmp(sub, "tokenize") == 0) {
        cfg_tokenize t;
        const opt opts[] = {
            {"model", OPT_STRING, &t.model.path, "PATH: a Hugging Face folder or a .gguf file"},
            {"add-bos", OPT_BOOL, &t.add_bos, "prepend BOS when the model's metadata asks"}};
        fprintf(out, "usage: qlserve tokenize --model PATH [--add-bos] TEXT\n"
                     "Prints the token ids and pieces of TEXT.\n");
        print_opts(out, opts, sizeof opts / sizeof *opts);
        return;
    }
    fprintf(out, "usage: qlserve COMMAND [FLAGS]\n"
                 "commands:\n"
                 "  quantize   quantize a safetensors file to NF4/FP4 (bitsandbytes layout)\n"
                 "  inspect    print what a safetensors file or a model holds\n"
                 "  generate   complete a prompt with a model\n"
                 "  tokenize   print the token ids of a text under a model's tokenizer\n"
                 "  version    version, CPU kernel path and CUDA backend\n"
                 "qlserve COMMAND --help for a command's flags.\n");
}

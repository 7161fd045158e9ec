/*
 * config.c - a small table-driven flag parser: each subcommand lists its
 * flags once, one row per flag (name, type, where the value goes, help
 * text, default, the range of a number, the words of a choice), and the
 * parser, the defaults, the checks and the usage text all walk that one
 * table, so they cannot drift. Accepts `--flag value` and `--flag=value`.
 */
#include "config.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* QL_KV_MIB_DEFAULT as text, for a help string */
#define TEXT_OF_(x)            #x
#define TEXT_OF(x)             TEXT_OF_(x)
#define QL_KV_MIB_DEFAULT_TEXT TEXT_OF(QL_KV_MIB_DEFAULT)

typedef enum { OPT_STRING, OPT_INT, OPT_BOOL, OPT_FLOAT, OPT_U64, OPT_I64 } opt_type;

/* A flag's default, in the field of its type (a string's NULL: unset). */
typedef struct opt_default {
    const char *s;
    int64_t i; /* OPT_INT, OPT_I64, OPT_U64 */
    double f;
    bool b;
} opt_default;

/* One flag. */
typedef struct opt {
    const char *name; /* without the leading -- */
    opt_type type;
    size_t offset; /* where its value goes in the subcommand's struct */
    const char *help;
    opt_default def; /* what it holds when nothing sets it */
    /* an integer that must fall in [min, max]: serve checks these
     * (validate_serve); the other subcommands check what they need */
    bool ranged;
    int64_t min, max;
    /* a string that must be one of these words (base/ql_names.c, the table
     * the module acting on it parses with), listed before the help text;
     * NULL: any string */
    const ql_names *words;
} opt;

/* A row's start: every row names these four (designated, so a row may add
 * any of the rest). */
#define FLAG(flag, kind, at, text) .name = (flag), .type = (kind), .offset = (at), .help = (text)
#define RANGE(lo, hi)              .ranged = true, .min = (lo), .max = (hi)

/* The value of o in the struct at base. */
static void *value_at(void *base, const opt *o)
{
    return (char *)base + o->offset;
}

/* Every row's default into the struct at base. */
static void apply_defaults(const opt *opts, size_t n, void *base)
{
    for (size_t k = 0; k < n; k++) {
        void *v = value_at(base, &opts[k]);
        switch (opts[k].type) {
        case OPT_STRING: *(const char **)v = opts[k].def.s; break;
        case OPT_INT: *(int32_t *)v = (int32_t)opts[k].def.i; break;
        case OPT_I64: *(int64_t *)v = opts[k].def.i; break;
        case OPT_U64: *(uint64_t *)v = (uint64_t)opts[k].def.i; break;
        case OPT_BOOL: *(bool *)v = opts[k].def.b; break;
        case OPT_FLOAT: *(float *)v = (float)opts[k].def.f; break;
        }
    }
}

/* The bytes o's value takes. */
static size_t value_size(const opt *o)
{
    switch (o->type) {
    case OPT_STRING: return sizeof(const char *);
    case OPT_BOOL: return sizeof(bool);
    case OPT_FLOAT: return sizeof(float);
    case OPT_INT: return sizeof(int32_t);
    default: return sizeof(int64_t);
    }
}

/* o's help text as the usage prints it: the words of a choice first,
 * "cpu | cuda | auto: where to run". */
static const char *help_text(const opt *o, char *buf, size_t len)
{
    if (!o->words)
        return o->help;
    size_t at = 0;
    buf[0] = 0;
    for (size_t i = 0; i < o->words->n && at < len; i++) {
        int n = snprintf(buf + at, len - at, "%s%s", i ? " | " : "", o->words->rows[i].word);
        at += n > 0 ? (size_t)n : 0;
    }
    if (at < len)
        snprintf(buf + at, len - at, ": %s", o->help);
    return buf;
}

static int usage_error(char *msg, size_t msg_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int usage_error(char *msg, size_t msg_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, msg_len, fmt, ap);
    va_end(ap);
    return QL_EUSAGE;
}

/* Store value (a string from argv or the environment) into o's value in
 * the struct at base. where says where the value came from and ends with
 * what separates it from the value ("--port " or "QLSERVE_PORT="), so a
 * message reads "--port x: ...". Strings are borrowed: value must outlive
 * the destination. */
static int set_value(const opt *o, void *base, const char *where, const char *value, char *msg,
                     size_t msg_len)
{
    void *dest = value_at(base, o);
    if (o->type == OPT_STRING) {
        *(const char **)dest = value;
        return QL_OK;
    }
    if (o->type == OPT_BOOL) {
        /* only the environment gives a boolean a value; a flag is just there */
        static const char *const yes[] = {"1", "true", "yes", "on"};
        static const char *const no[] = {"0", "false", "no", "off"};
        for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) {
            if (strcmp(value, yes[i]) == 0 || strcmp(value, no[i]) == 0) {
                *(bool *)dest = strcmp(value, yes[i]) == 0;
                return QL_OK;
            }
        }
        return usage_error(msg, msg_len, "%s%s: not a boolean (true or false, 1 or 0)", where,
                           value);
    }
    char *end;
    errno = 0;
    if (o->type == OPT_FLOAT) {
        double d = strtod(value, &end);
        if (errno || end == value || *end || !isfinite(d))
            return usage_error(msg, msg_len, "%s%s: not a number", where, value);
        *(float *)dest = (float)d;
        return QL_OK;
    }
    if (o->type == OPT_U64) {
        unsigned long long u = strtoull(value, &end, 10);
        if (errno || end == value || *end || value[0] == '-')
            return usage_error(msg, msg_len, "%s%s: not a non-negative integer", where, value);
        *(uint64_t *)dest = (uint64_t)u;
        return QL_OK;
    }
    long long v = strtoll(value, &end, 10);
    if (o->type == OPT_I64) {
        if (errno || end == value || *end)
            return usage_error(msg, msg_len, "%s%s: not an integer", where, value);
        *(int64_t *)dest = (int64_t)v;
        return QL_OK;
    }
    if (errno || end == value || *end || v < INT32_MIN || v > INT32_MAX)
        return usage_error(msg, msg_len, "%s%s: not an integer", where, value);
    *(int32_t *)dest = (int32_t)v;
    return QL_OK;
}

/* Parse argv[1..argc) against opts into the struct at base; positional
 * arguments go to *positional (at most one allowed when positional is not
 * NULL), and every argument after a "--" is one. When seen is not NULL, seen[k] is set for each
 * opts[k] the command line gives. */
static int parse(int argc, char **argv, const opt *opts, size_t n_opts, void *base,
                 const char **positional, bool *seen, char *msg, size_t msg_len)
{
    bool options_ended = false;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        /* "--" ends the options (POSIX's utility guideline 10): what follows
         * is positional even when it starts with "-", so `tokenize -- --x`
         * tokenizes "--x" */
        if (!options_ended && strcmp(arg, "--") == 0) {
            options_ended = true;
            continue;
        }
        if (!options_ended && (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0))
            return QL_EHELP;
        if (options_ended || strncmp(arg, "--", 2) != 0) {
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
        if (seen)
            seen[o - opts] = true;
        if (o->type == OPT_BOOL) {
            if (eq)
                return usage_error(msg, msg_len, "--%s takes no value", o->name);
            *(bool *)value_at(base, o) = true;
            continue;
        }
        const char *value = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!value)
            return usage_error(msg, msg_len, "--%s needs a value", o->name);
        char where[96];
        snprintf(where, sizeof where, "--%s ", o->name);
        int rc = set_value(o, base, where, value, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    return QL_OK;
}

/* The rows every subcommand that loads a model shares, for its struct T
 * whose cfg_model is the field m. */
#define MODEL_OPTS(T, m)                                                                           \
    {FLAG("quant", OPT_STRING, offsetof(T, m.quant),                                               \
          "none | nf4 | nf4-dq | fp4 | int4 | int8: quantize on load")},                           \
        {FLAG("blocksize", OPT_INT, offsetof(T, m.blocksize),                                      \
              "N: nf4/fp4 absmax block (default 64)"),                                             \
         RANGE(0, 1 << 20)},                                                                       \
        {FLAG("group-size", OPT_INT, offsetof(T, m.group_size),                                    \
              "N: int4/int8 group (default 128 for int4, per channel for int8)"),                  \
         RANGE(0, 1 << 20)},                                                                       \
        {FLAG("quantize-lm-head", OPT_BOOL, offsetof(T, m.quantize_lm_head),                       \
              "quantize lm_head too")},                                                            \
    {                                                                                              \
        FLAG("dtype", OPT_STRING, offsetof(T, m.dtype),                                            \
             "f32 | bf16 | f16: dtype of dense parameters")                                        \
    }

/* serve's and generate's: a chat template file over the model's own. */
#define CHAT_TEMPLATE_OPT(T, m)                                                                    \
    {                                                                                              \
        FLAG("chat-template", OPT_STRING, offsetof(T, m.chat_template),                            \
             "FILE: a Jinja chat template replacing the model's (unset: the model's own)")         \
    }

/* serve's and generate's: what an unmerged adapter's A and B are kept in. */
#define ADAPTER_DTYPE_OPT(T, field)                                                                \
    {                                                                                              \
        FLAG("adapter-dtype", OPT_STRING, offsetof(T, field),                                      \
             "unmerged adapters kept in bf16 (f32 and f16 rounded at load) or as stored, never "   \
             "rounded (default bf16)"),                                                            \
            .def.s = "bf16", .words = &ql_adapter_dtype_names                                      \
    }

/* serve's and generate's: what the CPU's K-quant products multiply by
 * (kernels/qtensor.h, qt_set_activations). */
#define ACTIVATIONS_OPT(T, field)                                                                  \
    {                                                                                              \
        FLAG("activations", OPT_STRING, offsetof(T, field),                                        \
             "what the CPU's quantized products multiply: f32 (default: greedy text equal to "     \
             "the float64 reference is qlserve's promise) or q8, int8 per block as llama.cpp "     \
             "computes (faster on GGUF kinds, no longer the reference's answer; CPU only: the "    \
             "CUDA backend keeps f32 and says so)"),                                               \
            .def.s = "f32", .words = &ql_activations_names                                         \
    }

/* serve's and generate's speculative decoding (engine/scheduler/speculative.h);
 * the ranges are the engine's (eng_spec_opts_resolve), 0 its defaults. */
#define SPEC_OPTS(T, field)                                                                        \
    {FLAG("speculative", OPT_STRING, offsetof(T, field.speculative),                               \
          "draft tokens and verify them in the same batched step: ngram looks the answer's last "  \
          "tokens up in the prompt and answer (greedy answers unchanged, sampled ones keep the "   \
          "model's distribution); draft runs --draft-model's greedy guesses; mtp drafts with the " \
          "model's own MTP layers (Qwen3.5's mtp.*, on the CPU)"),                                 \
     .def.s = "off", .words = &ql_speculative_names},                                              \
        {FLAG("draft-model", OPT_STRING, offsetof(T, field.draft_model),                           \
              "PATH: --speculative draft's model (a Hugging Face folder or a .gguf file, loaded "  \
              "as --model is): smaller, with the same vocabulary, run on the CPU")},               \
        {FLAG("draft-kv-mib", OPT_INT, offsetof(T, field.draft_kv_mib),                            \
              "N: the draft model's own KV cache in MiB (0: as many positions as the model's)"),   \
         RANGE(0, 1 << 20)},                                                                       \
        {FLAG("draft-max", OPT_INT, offsetof(T, field.draft_max),                                  \
              "N: most tokens a sequence drafts per step, 1..16 (0: 16 for ngram, else 4; a "      \
              "request may ask fewer)"),                                                           \
         RANGE(0, 16)},                                                                            \
        {FLAG("draft-fixed", OPT_BOOL, offsetof(T, field.draft_fixed),                             \
              "draft --draft-max tokens every step wherever a sequence can (as vLLM's "            \
              "num_speculative_tokens), not the length acceptance and cost choose")},              \
        {FLAG("ngram-min", OPT_INT, offsetof(T, field.ngram_min),                                  \
              "N: the shortest suffix the n-gram drafter matches (0: 1)"),                         \
         RANGE(0, 64)},                                                                            \
        {FLAG("ngram-max", OPT_INT, offsetof(T, field.ngram_max),                                  \
              "N: the longest suffix it tries first (0: 3)"),                                      \
         RANGE(0, 64)},                                                                            \
        {FLAG("ngram-memory", OPT_INT, offsetof(T, field.ngram_memory),                            \
              "N: tokens of earlier answers the n-gram drafter also drafts from (0: 65536, "       \
              "2.25 MiB; -1: none)"),                                                              \
         RANGE(-1, 1 << 24)},                                                                      \
    {                                                                                              \
        FLAG("spec-max-batch", OPT_INT, offsetof(T, field.max_batch),                              \
             "N: no sequence speculates in a step decoding more than N (0: 4)"),                   \
            RANGE(0, 65536)                                                                        \
    }

#define N_OPTS(opts) (sizeof opts / sizeof *opts)

static const opt quantize_opts[] = {
    {FLAG("in", OPT_STRING, offsetof(cfg_quantize, in_path),
          "IN.safetensors | IN.gguf | DIR (Hugging Face): what to quantize")},
    {FLAG("out", OPT_STRING, offsetof(cfg_quantize, out_path),
          "OUT.safetensors | OUT.gguf: where to write")},
    {FLAG("kind", OPT_STRING, offsetof(cfg_quantize, kind),
          "nf4 | fp4 (safetensors) | q2_k | q3_k | q4_k | q5_k | q6_k | q8_0 | f32 (GGUF) | "
          "fp8 (a finegrained FP8 folder)")},
    {FLAG("blocksize", OPT_INT, offsetof(cfg_quantize, blocksize),
          "N: elements per absmax block (default 64)"),
     .def.i = 64},
    {FLAG("double-quant", OPT_BOOL, offsetof(cfg_quantize, double_quant),
          "quantize absmax again (bitsandbytes compress_statistics)")},
    {FLAG("block", OPT_STRING, offsetof(cfg_quantize, block),
          "ROWSxCOLS: fp8's weight_block_size (default 128x128)")},
    {FLAG("scale-fmt", OPT_STRING, offsetof(cfg_quantize, scale_fmt),
          "float | ue8m0: fp8's block scales as f32 (default) or one F8_E8M0 byte")},
    {FLAG("allow-requantize", OPT_BOOL, offsetof(cfg_quantize, allow_requantize),
          "a GGUF kind: quantize weights that are already quantized again (from their "
          "dequantized values; precision is lost)")},
};

int cfg_parse_quantize(int argc, char **argv, cfg_quantize *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    apply_defaults(quantize_opts, N_OPTS(quantize_opts), out);
    int rc = parse(argc, argv, quantize_opts, N_OPTS(quantize_opts), out, NULL, NULL, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (!out->in_path || !out->out_path || !out->kind)
        return usage_error(msg, msg_len, "quantize: --in, --out and --kind are required");
    return QL_OK;
}

static const opt inspect_opts[] = {MODEL_OPTS(cfg_inspect, model)};

int cfg_parse_inspect(int argc, char **argv, cfg_inspect *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    apply_defaults(inspect_opts, N_OPTS(inspect_opts), out);
    int rc =
        parse(argc, argv, inspect_opts, N_OPTS(inspect_opts), out, &out->path, NULL, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    if (!out->path)
        return usage_error(msg, msg_len, "inspect: which file? (qlserve inspect FILE)");
    out->model.path = out->path;
    return QL_OK;
}

static const opt tokenize_opts[] = {
    {FLAG("model", OPT_STRING, offsetof(cfg_tokenize, model),
          "PATH: a Hugging Face folder or a .gguf file (a vocabulary-only one too); only its "
          "tokenizer is read")},
    {FLAG("add-bos", OPT_BOOL, offsetof(cfg_tokenize, add_bos),
          "prepend BOS when the model's metadata asks")},
    {FLAG("no-special", OPT_BOOL, offsetof(cfg_tokenize, no_special),
          "special-token strings in TEXT are plain text (llama.cpp's parse_special = false)")},
    {FLAG("json", OPT_BOOL, offsetof(cfg_tokenize, json),
          "print {\"ids\": [...]} instead of ids and pieces")},
};

int cfg_parse_tokenize(int argc, char **argv, cfg_tokenize *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    apply_defaults(tokenize_opts, N_OPTS(tokenize_opts), out);
    int rc = parse(argc, argv, tokenize_opts, N_OPTS(tokenize_opts), out, &out->text, NULL, msg,
                   msg_len);
    if (rc != QL_OK)
        return rc;
    if (!out->model || !out->text)
        return usage_error(msg, msg_len, "tokenize: qlserve tokenize --model PATH [--] TEXT");
    return QL_OK;
}

static const opt generate_opts[] = {
    {FLAG("model", OPT_STRING, offsetof(cfg_generate, model.path),
          "PATH: a Hugging Face folder or a .gguf file")},
    {FLAG("prompt", OPT_STRING, offsetof(cfg_generate, prompt),
          "TEXT: the prompt (as is: no chat template)")},
    {FLAG("max-new-tokens", OPT_INT, offsetof(cfg_generate, max_new_tokens),
          "N: tokens to generate (default 128)"),
     .def.i = 128},
    {FLAG("temperature", OPT_FLOAT, offsetof(cfg_generate, temperature),
          "T: 0 is greedy (default)")},
    {FLAG("top-k", OPT_INT, offsetof(cfg_generate, top_k),
          "K: sample among the K likeliest (0: off)")},
    {FLAG("top-p", OPT_FLOAT, offsetof(cfg_generate, top_p),
          "P: nucleus sampling, in (0, 1] (1: off)"),
     .def.f = 1},
    {FLAG("repetition-penalty", OPT_FLOAT, offsetof(cfg_generate, repetition_penalty),
          "R: > 0 (1: off)"),
     .def.f = 1},
    {FLAG("seed", OPT_U64, offsetof(cfg_generate, seed), "N: the same seed gives the same text")},
    {FLAG("stop", OPT_STRING, offsetof(cfg_generate, stop),
          "STRING: end generation there (not printed)")},
    {FLAG("threads", OPT_INT, offsetof(cfg_generate, threads),
          "N: kernel threads (default: all cores)")},
    {FLAG("device", OPT_STRING, offsetof(cfg_generate, device), "where to run (default auto)"),
     .def.s = "auto", .words = &ql_device_names},
    /* 0: the engine's default, QL_KV_MIB_DEFAULT */
    {FLAG("kv-mib", OPT_INT, offsetof(cfg_generate, kv_mib),
          "N: KV cache size in MiB (default " QL_KV_MIB_DEFAULT_TEXT ")")},
    {FLAG("kv-dtype", OPT_STRING, offsetof(cfg_generate, kv_dtype),
          "the KV cache's values (default f16 on the CPU, f32 on CUDA)"),
     .words = &ql_kv_dtype_names},
    {FLAG("adapter", OPT_STRING, offsetof(cfg_generate, adapter),
          "DIR: a PEFT LoRA adapter folder to apply")},
    {FLAG("adapter-scale", OPT_FLOAT, offsetof(cfg_generate, adapter_scale),
          "S: the adapter's scale (default 1)"),
     .def.f = 1},
    {FLAG("merge", OPT_BOOL, offsetof(cfg_generate, merge),
          "merge the adapter into the weights and print the merge report (default: unmerged)")},
    {FLAG("into", OPT_STRING, offsetof(cfg_generate, into),
          "store merged modules in a wider kind (default: the weight's own)"),
     .words = &ql_into_names},
    ADAPTER_DTYPE_OPT(cfg_generate, adapter_dtype),
    ACTIVATIONS_OPT(cfg_generate, activations),
    SPEC_OPTS(cfg_generate, spec),
    CHAT_TEMPLATE_OPT(cfg_generate, model),
    MODEL_OPTS(cfg_generate, model),
};

/* Each string flag with words that is set holds one of them; else a usage
 * error "generate: --device gpu: one of cpu, cuda, auto". */
static int check_words(const char *command, const opt *opts, size_t n, void *base, char *msg,
                       size_t msg_len)
{
    for (size_t k = 0; k < n; k++) {
        const char *v = opts[k].words ? *(const char **)value_at(base, &opts[k]) : NULL;
        char list[64];
        if (v && ql_name_parse(opts[k].words, v) < 0)
            return usage_error(msg, msg_len, "%s: --%s %s: one of %s", command, opts[k].name, v,
                               ql_name_list(opts[k].words, list, sizeof list));
    }
    return QL_OK;
}

int cfg_parse_generate(int argc, char **argv, cfg_generate *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    apply_defaults(generate_opts, N_OPTS(generate_opts), out);
    int rc = parse(argc, argv, generate_opts, N_OPTS(generate_opts), out, NULL, NULL, msg, msg_len);
    if (rc != QL_OK)
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
    return check_words("generate", generate_opts, N_OPTS(generate_opts), out, msg, msg_len);
}

/*
 * qlserve serve. Its settings come in four layers, later winning: defaults,
 * the JSON config file, flags, the environment (QLSERVE_<FLAG>). Flags are
 * parsed first into a layer of their own (they name the config file, and
 * --help must work whatever the file holds), then the file is applied to the
 * result, then the flags the command line gave, then the environment; every
 * value remembers which layer set it, so a check at the end can name the
 * flag, file key or variable that holds the bad value.
 */

typedef enum { SRC_DEFAULT, SRC_FILE, SRC_FLAG, SRC_ENV } value_source;

/* The settings one layer can give: cfg_serve plus the token file, which is
 * read only once the layers have decided which file it is. */
typedef struct serve_layer {
    cfg_serve s;
    const char *token_file;
    const char *api_key_file;
} serve_layer;

#define SERVE(field) offsetof(serve_layer, field)

/*
 * serve's flags, one row each with its default and range. The upper
 * bounds are not hardware limits; they catch a slip of unit (bytes given
 * where MiB are meant) or a stray digit before it becomes a huge
 * allocation or an overflow. The usage prints each default from its row.
 */
static const opt serve_opts[] = {
    {FLAG("model", OPT_STRING, SERVE(s.model.path), "PATH: a Hugging Face folder or a .gguf file")},
    MODEL_OPTS(serve_layer, s.model),
    CHAT_TEMPLATE_OPT(serve_layer, s.model),
    {FLAG("host", OPT_STRING, SERVE(s.host), "ADDR: the address to listen on"),
     .def.s = "127.0.0.1"},
    {FLAG("port", OPT_INT, SERVE(s.port), "N: the TCP port (0: pick a free one)"), .def.i = 8080,
     RANGE(0, 65535)},
    {FLAG("adapter-dir", OPT_STRING, SERVE(s.adapter_dir),
          "DIR: the only folder adapters load from (unset: no adapter loading)")},
    {FLAG("no-lazy-adapters", OPT_BOOL, SERVE(s.no_lazy_adapters),
          "a request naming an adapter that is not loaded gets 404 (default: loaded from the "
          "folder of that name in --adapter-dir on first use)")},
    {FLAG("state-dir", OPT_STRING, SERVE(s.state_dir),
          "DIR: the server's own files: the journal, a generated admin token (default: "
          "$XDG_STATE_HOME/qlserve or ~/.local/state/qlserve)")},
    {FLAG("state-file", OPT_STRING, SERVE(s.state_file),
          "FILE: the journal of loaded adapters and merges, replayed at start (default: "
          "state.json in --state-dir; none: off)")},
    {FLAG("admin-token-file", OPT_STRING, SERVE(token_file),
          "FILE: its first line is the admin bearer token (unset: on a loopback --host, admin "
          "from loopback JSON requests a web page cannot make; else one is generated into "
          "--state-dir)")},
    {FLAG("allowed-hosts", OPT_STRING, SERVE(s.allowed_hosts),
          "HOST[:PORT],...: Host headers accepted besides localhost, 127.x.x.x and [::1] "
          "(a reverse proxy's or tunnel's name), or * (unset: those only, while --host is "
          "loopback)")},
    {FLAG("api-key-file", OPT_STRING, SERVE(api_key_file),
          "FILE: its first line is the API bearer key (unset: no key asked)")},
    {FLAG("cors-allow-origin", OPT_STRING, SERVE(s.cors_allow_origin),
          "ORIGIN,...: browser origins allowed (CORS), or * (unset: none)")},
    {FLAG("config", OPT_STRING, SERVE(s.config_path), "FILE: the JSON config file")},
    {FLAG("served-model-name", OPT_STRING, SERVE(s.served_model_name),
          "NAME: the model's id in /v1/models and /info (unset: from the model)")},
    {FLAG("threads", OPT_INT, SERVE(s.threads), "N: kernel threads (0: all cores)"),
     RANGE(0, 4096)},
    {FLAG("device", OPT_STRING, SERVE(s.device),
          "where to run (auto: CUDA when a device is present)"),
     .def.s = "auto", .words = &ql_device_names},
    {FLAG("kv-mib", OPT_INT, SERVE(s.kv_mib), "N: KV cache size in MiB"),
     .def.i = QL_KV_MIB_DEFAULT, RANGE(1, 1 << 24)},
    {FLAG("kv-dtype", OPT_STRING, SERVE(s.kv_dtype),
          "the KV cache's values (default f16 on the CPU, f32 on CUDA; f16 halves f32's bytes)"),
     .words = &ql_kv_dtype_names},
    ACTIVATIONS_OPT(serve_layer, s.activations),
    SPEC_OPTS(serve_layer, s.spec),
    {FLAG("max-running", OPT_INT, SERVE(s.max_running), "N: sequences decoding together"),
     .def.i = 64, RANGE(1, 65536)},
    /* the step budget (engine/scheduler/step_budget.c): the prompt tokens a
     * step carries while sequences decode in it */
    {FLAG("step-budget-ms", OPT_INT, SERVE(s.step_budget_ms),
          "MS: the time a step that carries decode tokens aims at with the prompt tokens beside "
          "them (0: twice the measured cost of a step decoding every running sequence)"),
     RANGE(0, 600000)},
    {FLAG("max-prefill-per-step", OPT_INT, SERVE(s.max_prefill_per_step),
          "N: prompt tokens a step with decode tokens carries, instead of the time rule (0: from "
          "--step-budget-ms; 256, a step's whole room: no budget)"),
     RANGE(0, 1 << 20)},
    {FLAG("min-prefill-per-step", OPT_INT, SERVE(s.min_prefill_per_step),
          "N: the budget's floor: prompt tokens a step with decode tokens may always carry"),
     .def.i = 16, RANGE(1, 1 << 20)},
    {FLAG("no-prefix-cache", OPT_BOOL, SERVE(s.no_prefix_cache),
          "keep no prompt's KV blocks for later requests (default: kept while the KV cache has "
          "room, and reused by any prompt that begins the same under the same adapters)")},
    {FLAG("max-queued", OPT_INT, SERVE(s.max_queued),
          "N: requests waiting for a slot; more get 503"),
     .def.i = 256, RANGE(0, 1 << 20)},
    {FLAG("max-new-tokens", OPT_INT, SERVE(s.max_new_tokens),
          "N: the largest max_new_tokens a request may ask for"),
     .def.i = 4096, RANGE(1, 1 << 24)},
    /* 1 GiB: a thousand ordinary requests (a few hundred KiB each with
     * their answers), or 17 of the largest the bounds allow (64 choices of
     * 4096 tokens with 20 logprobs each, about 60 MB), where 256 of those
     * queued would otherwise hold 15 GB */
    {FLAG("max-held-bytes", OPT_I64, SERVE(s.max_held_bytes),
          "N: bytes the accepted, unanswered requests may hold in all; past it 503 (0: no limit)"),
     .def.i = (int64_t)1 << 30, RANGE(0, (int64_t)1 << 40)},
    {FLAG("max-context", OPT_INT, SERVE(s.max_context),
          "N: prompt plus new tokens (0: the model's context length)"),
     RANGE(0, 1 << 24)},
    {FLAG("max-connections", OPT_INT, SERVE(s.max_connections), "N: connections open at once"),
     .def.i = 256, RANGE(1, 1 << 20)},
    {FLAG("max-body-bytes", OPT_I64, SERVE(s.max_body_bytes),
          "N: the largest request body; larger gets 413"),
     .def.i = 1 << 20, RANGE(1024, 1 << 30)},
    {FLAG("max-header-bytes", OPT_INT, SERVE(s.max_header_bytes),
          "N: the largest request line plus headers"),
     .def.i = 16 << 10, RANGE(1024, 1 << 20)},
    {FLAG("request-timeout-ms", OPT_INT, SERVE(s.request_timeout_ms),
          "MS: time to receive a whole request; slower gets 408"),
     .def.i = 30000, RANGE(1, 86400000)}, /* a day */
    {FLAG("keepalive-timeout-ms", OPT_INT, SERVE(s.keepalive_timeout_ms),
          "MS: how long an idle keep-alive connection stays open"),
     .def.i = 60000, RANGE(1, 86400000)},
    /* a client connects to send a request: 10 s is far beyond any
     * handshake's round trips, and short beside the keep-alive minute an
     * idle new connection otherwise holds a slot for */
    {FLAG("first-byte-timeout-ms", OPT_INT, SERVE(s.first_byte_timeout_ms),
          "MS: a new connection's time to begin its first request (at most the keep-alive's)"),
     .def.i = 10000, RANGE(1, 86400000)},
    /* a quarter of --max-connections' 256: one address cannot take every
     * slot, and a browser (6 per host) or a client library's pool of tens
     * stays well under it; behind a proxy every client is the proxy's
     * address (docs/operations.md) */
    {FLAG("max-connections-per-peer", OPT_INT, SERVE(s.max_connections_per_peer),
          "N: connections open at once from one IP address; more get 503 (0: no cap)"),
     .def.i = 64, RANGE(0, 1 << 20)},
    {FLAG("grace-ms", OPT_INT, SERVE(s.grace_ms),
          "MS: after SIGTERM, time for running requests to finish (0: cancel them)"),
     .def.i = 30000, RANGE(0, 86400000)},
    {FLAG("adapter-budget-mib", OPT_I64, SERVE(s.adapter_budget_mib),
          "N: memory for loaded adapters, least recently used evicted (0: no limit)"),
     RANGE(0, 1 << 30)},
    ADAPTER_DTYPE_OPT(serve_layer, s.adapter_dtype),
    {FLAG("merge-threads", OPT_INT, SERVE(s.merge_threads), "N: threads merging an adapter"),
     .def.i = 1, RANGE(1, 4096)},
};

enum { N_SERVE_OPTS = N_OPTS(serve_opts) };

/* Strings cfg_serve owns (copies from the config file and the environment),
 * a list hung on cfg_serve.owned_. */
typedef struct owned_string {
    struct owned_string *next;
    char text[];
} owned_string;

static const char *keep_string(cfg_serve *s, const char *text, size_t len)
{
    owned_string *o = malloc(sizeof *o + len + 1);
    if (!o)
        return NULL;
    memcpy(o->text, text, len);
    o->text[len] = 0;
    o->next = s->owned_;
    s->owned_ = o;
    return o->text;
}

void cfg_serve_free(cfg_serve *c)
{
    if (!c)
        return;
    for (owned_string *o = c->owned_, *next; o; o = next) {
        next = o->next;
        free(o);
    }
    c->owned_ = NULL;
}

/* The state of one cfg_parse_serve call, for the helpers below. */
typedef struct serve_parse {
    const opt *opts; /* serve_opts */
    size_t n_opts;
    serve_layer *layer;    /* the values: the layers merged so far */
    value_source *src;     /* src[k]: which layer set opts[k] */
    const char **file_key; /* file_key[k]: the key as written in the file */
    const char *file_path;
    cfg_serve *result; /* owns the copied strings */
    char *msg;
    size_t msg_len;
} serve_parse;

static size_t find_opt(const opt *opts, size_t n, const char *name)
{
    for (size_t k = 0; k < n; k++)
        if (strcmp(opts[k].name, name) == 0)
            return k;
    return n;
}

/* "max-body-bytes" -> "QLSERVE_MAX_BODY_BYTES" */
static void env_name(const char *flag, char *buf, size_t len)
{
    snprintf(buf, len, "QLSERVE_%s", flag);
    for (char *c = buf + strlen("QLSERVE_"); *c; c++)
        *c = *c == '-' ? '_' : (char)toupper((unsigned char)*c);
}

/* o's value in the struct at base, as text. */
static void format_value(const opt *o, void *base, bool quote_strings, char *buf, size_t len)
{
    const void *dest = value_at(base, o);
    switch (o->type) {
    case OPT_STRING: {
        const char *v = *(const char *const *)dest;
        snprintf(buf, len, quote_strings || (v && !*v) ? "\"%s\"" : "%s", v ? v : "(unset)");
        break;
    }
    case OPT_INT: snprintf(buf, len, "%d", (int)*(const int32_t *)dest); break;
    case OPT_I64: snprintf(buf, len, "%lld", (long long)*(const int64_t *)dest); break;
    case OPT_U64: snprintf(buf, len, "%llu", (unsigned long long)*(const uint64_t *)dest); break;
    case OPT_BOOL: snprintf(buf, len, "%s", *(const bool *)dest ? "true" : "false"); break;
    case OPT_FLOAT: snprintf(buf, len, "%g", (double)*(const float *)dest); break;
    }
}

/* Where opts[k]'s value came from, with the value: "--port 70000",
 * "QLSERVE_PORT=70000" or "config file c.json: \"port\": 70000". */
static void describe(const serve_parse *p, size_t k, char *buf, size_t len)
{
    const opt *o = &p->opts[k];
    char value[512], env[96];
    format_value(o, p->layer, p->src[k] == SRC_FILE, value, sizeof value);
    switch (p->src[k]) {
    case SRC_FILE:
        snprintf(buf, len, "config file %s: \"%s\": %s", p->file_path, p->file_key[k], value);
        break;
    case SRC_ENV:
        env_name(o->name, env, sizeof env);
        snprintf(buf, len, "%s=%s", env, value);
        break;
    case SRC_FLAG: snprintf(buf, len, "--%s %s", o->name, value); break;
    case SRC_DEFAULT: snprintf(buf, len, "--%s %s (the default)", o->name, value); break;
    }
}

/* The whole of a small file, NUL-terminated; NULL with errno set (EFBIG when
 * longer than max). The caller frees. */
static char *read_small_file(const char *path, size_t max, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = malloc(max + 1);
    size_t n = buf ? fread(buf, 1, max + 1, f) : 0;
    int err = !buf ? ENOMEM : ferror(f) ? (errno ? errno : EIO) : n > max ? EFBIG : 0;
    fclose(f);
    if (err) {
        free(buf);
        errno = err;
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static const char *json_type_name(const cJSON *item)
{
    if (cJSON_IsString(item))
        return "a string";
    if (cJSON_IsNumber(item))
        return "a number";
    if (cJSON_IsBool(item))
        return "a boolean";
    if (cJSON_IsNull(item))
        return "null";
    if (cJSON_IsArray(item))
        return "an array";
    return "an object";
}

/* One "key": value of the config file into opts[k]. */
static int apply_file_value(serve_parse *p, size_t k, const cJSON *item)
{
    const opt *o = &p->opts[k];
    void *dest = value_at(p->layer, o);
    static const char *const expected[] = {[OPT_STRING] = "a string",
                                           [OPT_INT] = "an integer",
                                           [OPT_BOOL] = "true or false",
                                           [OPT_FLOAT] = "a number",
                                           [OPT_U64] = "a non-negative integer",
                                           [OPT_I64] = "an integer"};
    bool ok;
    switch (o->type) {
    case OPT_STRING: ok = cJSON_IsString(item); break;
    case OPT_BOOL: ok = cJSON_IsBool(item); break;
    default: ok = cJSON_IsNumber(item); break;
    }
    double d = item->valuedouble;
    if (ok && o->type != OPT_STRING && o->type != OPT_BOOL && o->type != OPT_FLOAT)
        ok = d == floor(d) && (o->type != OPT_U64 || d >= 0);
    if (!ok) {
        char got[64];
        if (cJSON_IsNumber(item))
            snprintf(got, sizeof got, "the number %.17g", d);
        else
            snprintf(got, sizeof got, "%s", json_type_name(item));
        bool nested = cJSON_IsArray(item) || cJSON_IsObject(item);
        return usage_error(p->msg, p->msg_len, "config file %s: \"%s\" must be %s, not %s%s",
                           p->file_path, item->string, expected[o->type], got,
                           nested ? " (nested values are not allowed)" : "");
    }
    /* limits of each type, written out as doubles: 2^31 and 2^63 */
    bool in_range = true;
    switch (o->type) {
    case OPT_STRING: {
        const char *v = keep_string(p->result, item->valuestring, strlen(item->valuestring));
        if (!v)
            return usage_error(p->msg, p->msg_len, "serve: out of memory");
        *(const char **)dest = v;
        break;
    }
    case OPT_BOOL: *(bool *)dest = cJSON_IsTrue(item); break;
    case OPT_FLOAT:
        in_range = fabs(d) <= 3.4028234663852886e38;
        *(float *)dest = in_range ? (float)d : 0;
        break;
    case OPT_INT:
        in_range = d >= -2147483648.0 && d < 2147483648.0;
        *(int32_t *)dest = in_range ? (int32_t)d : 0;
        break;
    case OPT_I64:
        in_range = d >= -9223372036854775808.0 && d < 9223372036854775808.0;
        *(int64_t *)dest = in_range ? (int64_t)d : 0;
        break;
    case OPT_U64:
        in_range = d < 18446744073709551616.0;
        *(uint64_t *)dest = in_range ? (uint64_t)d : 0;
        break;
    }
    if (!in_range)
        return usage_error(p->msg, p->msg_len, "config file %s: \"%s\": %.17g: out of range",
                           p->file_path, item->string, d);
    return QL_OK;
}

/* Apply the config file at p->file_path; where says where its name came from
 * ("--config c.json"). The parsed tree goes to *tree (the file_key strings
 * point into it); the caller deletes it. */
static int apply_config_file(serve_parse *p, const char *where, cJSON **tree)
{
    size_t len;
    /* a config file is a few hundred bytes; a megabyte is something else */
    char *text = read_small_file(p->file_path, 1 << 20, &len);
    if (!text)
        return usage_error(p->msg, p->msg_len, "%s: cannot read: %s", where,
                           errno == EFBIG ? "larger than 1 MiB" : strerror(errno));
    const char *end = NULL;
    cJSON *root = strlen(text) == len ? cJSON_ParseWithOpts(text, &end, true) : NULL;
    if (!root) {
        int line = 1, col = 1;
        for (const char *c = text; end && c < end && *c; c++, col++)
            if (*c == '\n')
                line++, col = 0;
        free(text);
        if (!end)
            return usage_error(p->msg, p->msg_len, "config file %s: holds a NUL byte: not JSON",
                               p->file_path);
        return usage_error(p->msg, p->msg_len,
                           "config file %s: not valid JSON (line %d, column %d)", p->file_path,
                           line, col);
    }
    free(text);
    *tree = root;
    if (!cJSON_IsObject(root))
        return usage_error(p->msg, p->msg_len,
                           "config file %s: must be a JSON object of \"flag\": value, not %s",
                           p->file_path, json_type_name(root));
    const cJSON *item;
    cJSON_ArrayForEach (item, root) {
        /* "max_body_bytes" and "max-body-bytes" both name --max-body-bytes */
        char name[64];
        snprintf(name, sizeof name, "%s", item->string);
        for (char *c = name; *c; c++)
            if (*c == '_')
                *c = '-';
        if (strcmp(name, "admin-token") == 0 || strcmp(name, "api-key") == 0) {
            bool admin = name[1] == 'd';
            return usage_error(p->msg, p->msg_len,
                               "config file %s: \"%s\" is refused: a secret does not belong in a "
                               "config file; put the %s in a file named by \"%s\", or in %s",
                               p->file_path, item->string, admin ? "token" : "key",
                               admin ? "admin-token-file" : "api-key-file",
                               admin ? "QLSERVE_ADMIN_TOKEN" : "QLSERVE_API_KEY");
        }
        if (strcmp(name, "config") == 0)
            return usage_error(p->msg, p->msg_len,
                               "config file %s: \"%s\": a config file cannot name another",
                               p->file_path, item->string);
        size_t k =
            strlen(item->string) < sizeof name - 1 ? find_opt(p->opts, p->n_opts, name) : p->n_opts;
        if (k == p->n_opts)
            return usage_error(p->msg, p->msg_len,
                               "config file %s: unknown key \"%.80s\" (keys are the flags of "
                               "qlserve serve --help)",
                               p->file_path, item->string);
        if (p->src[k] == SRC_FILE)
            return usage_error(p->msg, p->msg_len, "config file %s: \"%s\" and \"%s\" both set %s",
                               p->file_path, p->file_key[k], item->string, p->opts[k].name);
        int rc = apply_file_value(p, k, item);
        if (rc != QL_OK)
            return rc;
        p->src[k] = SRC_FILE;
        p->file_key[k] = item->string;
    }
    return QL_OK;
}

/* Every QLSERVE_<FLAG> that is set, over what the file and flags gave. */
static int apply_environment(serve_parse *p)
{
    for (size_t k = 0; k < p->n_opts; k++) {
        if (strcmp(p->opts[k].name, "config") == 0)
            continue; /* read before the file */
        char env[96], where[100];
        env_name(p->opts[k].name, env, sizeof env);
        const char *v = getenv(env);
        if (!v)
            continue;
        /* copied: the environment may change after we return */
        const char *copy = keep_string(p->result, v, strlen(v));
        if (!copy)
            return usage_error(p->msg, p->msg_len, "serve: out of memory");
        snprintf(where, sizeof where, "%s=", env);
        int rc = set_value(&p->opts[k], p->layer, where, copy, p->msg, p->msg_len);
        if (rc != QL_OK)
            return rc;
        p->src[k] = SRC_ENV;
    }
    return QL_OK;
}

/* A secret the server compares a request's bearer token against: the admin
 * token or the API key. Each comes from its environment variable, else the
 * first line of the file its flag names; neither is a flag or a config key,
 * so it shows in no process list and no config file. */
typedef struct secret_source {
    const char *what;      /* "admin token", "API key": for messages */
    const char *file_flag; /* "admin-token-file" */
    const char *env;       /* "QLSERVE_ADMIN_TOKEN" */
    size_t max_len;        /* CFG_SECRET_MAX: what the server can compare */
} secret_source;

static const secret_source admin_token_source = {"admin token", "admin-token-file",
                                                 "QLSERVE_ADMIN_TOKEN", CFG_SECRET_MAX};
static const secret_source api_key_source = {"API key", "api-key-file", "QLSERVE_API_KEY",
                                             CFG_SECRET_MAX};

/* A token travels as "Authorization: Bearer TOKEN": it cannot hold spaces or
 * control characters. Trailing whitespace (the file's newline) is dropped. */
static const char *keep_token(serve_parse *p, const secret_source *src, const char *where,
                              const char *text, size_t len)
{
    while (len && (text[len - 1] == ' ' || (text[len - 1] >= '\t' && text[len - 1] <= '\r')))
        len--;
    if (len == 0) {
        usage_error(p->msg, p->msg_len, "%s: the %s is empty", where, src->what);
        return NULL;
    }
    if (len > src->max_len) {
        usage_error(p->msg, p->msg_len, "%s: the %s is %zu bytes; at most %zu are accepted", where,
                    src->what, len, src->max_len);
        return NULL;
    }
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c <= ' ' || c == 0x7f) {
            usage_error(p->msg, p->msg_len,
                        "%s: the %s holds a space or control character, which an "
                        "Authorization header cannot carry",
                        where, src->what);
            return NULL;
        }
    }
    const char *t = keep_string(p->result, text, len);
    if (!t)
        usage_error(p->msg, p->msg_len, "serve: out of memory");
    return t;
}

/* The secret src describes into *out: its environment variable, else the
 * first line of file (NULL: none given). Messages never show the secret. */
static int resolve_secret(serve_parse *p, const secret_source *src, const char *file,
                          const char **out)
{
    size_t k = find_opt(p->opts, p->n_opts, src->file_flag);
    const char *env = getenv(src->env);
    if (env) {
        if (p->src[k] == SRC_ENV)
            return usage_error(p->msg, p->msg_len, "%s and %s_FILE are both set; set one", src->env,
                               src->env);
        /* the environment wins over a file from the config file or a flag */
        *out = keep_token(p, src, src->env, env, strlen(env));
        return *out ? QL_OK : QL_EUSAGE;
    }
    if (!file)
        return QL_OK;
    char where[1024];
    describe(p, k, where, sizeof where);
    size_t len;
    /* a token is a line; 64 KiB is surely some other file */
    char *text = read_small_file(file, 64 << 10, &len);
    if (!text)
        return usage_error(p->msg, p->msg_len, "%s: cannot read the %s: %s", where, src->what,
                           errno == EFBIG ? "larger than 64 KiB" : strerror(errno));
    if (len == 0) {
        free(text);
        return usage_error(p->msg, p->msg_len,
                           "%s: the file is empty; its first line must be the %s", where,
                           src->what);
    }
    const char *nl = memchr(text, '\n', len);
    *out = keep_token(p, src, where, text, nl ? (size_t)(nl - text) : len);
    free(text);
    return *out ? QL_OK : QL_EUSAGE;
}

/* Both secrets; an API key that is also the admin token would make every
 * API client an admin, so that is refused. */
static int resolve_secrets(serve_parse *p, const serve_layer *l)
{
    cfg_serve *r = p->result;
    int rc = resolve_secret(p, &admin_token_source, l->token_file, &r->admin_token);
    if (rc == QL_OK)
        rc = resolve_secret(p, &api_key_source, l->api_key_file, &r->api_key);
    if (rc == QL_OK && r->admin_token && r->api_key && strcmp(r->admin_token, r->api_key) == 0)
        rc = usage_error(p->msg, p->msg_len,
                         "serve: the API key and the admin token are the same; every API client "
                         "would be an admin: give them different values");
    return rc;
}

/* Each comma-separated entry of the list flag `name` (spaces around an
 * entry trimmed) passes ok_entry, or a usage error naming the flag, the
 * entry and what each must be (`must`). */
static int validate_list(serve_parse *p, const char *name, const char *list,
                         bool (*ok_entry)(const char *e, size_t len), const char *must)
{
    if (!list)
        return QL_OK;
    size_t len;
    for (const char *at = list, *e; ql_list_next(&at, &e, &len);) {
        if (!ok_entry(e, len)) {
            char where[1024];
            describe(p, find_opt(p->opts, p->n_opts, name), where, sizeof where);
            return usage_error(p->msg, p->msg_len, "%s: \"%.*s\" is not %s", where,
                               (int)(len > 260 ? 260 : len), e, must);
        }
    }
    return QL_OK;
}

/* A --cors-allow-origin entry: "*" or an origin as a browser sends it in
 * its Origin header, scheme://host[:port] (RFC 6454 6.1): no path, not even
 * a trailing '/', or it would never match. "null" (what sandboxed pages and
 * file:// send) is refused: any page can be null. */
static bool cors_origin_entry(const char *o, size_t len)
{
    const char *end = o + len;
    const char *host = len > 8 && strncmp(o, "https://", 8) == 0  ? o + 8
                       : len > 7 && strncmp(o, "http://", 7) == 0 ? o + 7
                                                                  : NULL;
    bool ok = ((len == 1 && *o == '*') || (host && host < end)) && len <= 253;
    for (const char *c = host; ok && c && c < end; c++)
        ok = *c != '/' && *c != ' ' && *c != '*';
    return ok;
}

/* An --allowed-hosts entry: "*" or a Host header's value as a client sends
 * it, name[:port] or [v6]:port, without scheme or path (a URL pasted there
 * would never match, silently); at most a 253-byte DNS name and ":65535". */
static bool allowed_host_entry(const char *h, size_t len)
{
    bool ok = len > 0 && len <= 260;
    for (size_t i = 0; ok && !(len == 1 && h[0] == '*') && i < len; i++)
        ok = isalnum((unsigned char)h[i]) || strchr("-.:[]_", h[i]);
    return ok;
}

/* Every value within its row's range; every string that is set non-empty
 * and free of control characters, and one of its row's words when it has
 * them. */
static int validate_serve(serve_parse *p)
{
    char where[1024];
    for (size_t k = 0; k < p->n_opts; k++) {
        const opt *o = &p->opts[k];
        if (!o->ranged)
            continue;
        const void *at = value_at(p->layer, o);
        int64_t v = o->type == OPT_I64 ? *(const int64_t *)at : *(const int32_t *)at;
        if (v < o->min || v > o->max) {
            describe(p, k, where, sizeof where);
            return usage_error(p->msg, p->msg_len, "%s: out of range (%lld to %lld)", where,
                               (long long)o->min, (long long)o->max);
        }
    }
    for (size_t k = 0; k < p->n_opts; k++) {
        const char *v =
            p->opts[k].type == OPT_STRING ? *(const char **)value_at(p->layer, &p->opts[k]) : NULL;
        if (!v)
            continue;
        bool control = false;
        for (const char *c = v; *c; c++)
            control |= (unsigned char)*c < ' ' || *c == 0x7f;
        if (!*v || control) {
            describe(p, k, where, sizeof where);
            return usage_error(p->msg, p->msg_len, "%s: %s", where,
                               *v ? "holds a control character" : "must not be empty");
        }
    }
    if (!p->result->model.path)
        return usage_error(p->msg, p->msg_len,
                           "serve: no model: give --model PATH (or \"model\" in the config file, "
                           "or QLSERVE_MODEL)");
    for (size_t k = 0; k < p->n_opts; k++) {
        const opt *o = &p->opts[k];
        const char *v = o->words ? *(const char **)value_at(p->layer, o) : NULL;
        char list[64];
        if (v && ql_name_parse(o->words, v) < 0) {
            describe(p, k, where, sizeof where);
            return usage_error(p->msg, p->msg_len, "%s: one of %s", where,
                               ql_name_list(o->words, list, sizeof list));
        }
    }
    const char *host = p->result->host;
    if (strcspn(host, " \t") != strlen(host) || strlen(host) > 253) {
        describe(p, find_opt(p->opts, p->n_opts, "host"), where, sizeof where);
        return usage_error(p->msg, p->msg_len, "%s: not a host name or address", where);
    }
    return QL_OK;
}

int cfg_parse_serve(int argc, char **argv, cfg_serve *out, char *msg, size_t msg_len)
{
    const opt *opts = serve_opts;
    enum { N = N_SERVE_OPTS };
    serve_layer fin, flags;
    memset(&fin, 0, sizeof fin);
    memset(&flags, 0, sizeof flags);
    apply_defaults(opts, N, &fin);
    bool seen[N] = {0};
    value_source src[N] = {0};
    const char *file_key[N] = {0};
    memset(out, 0, sizeof *out);

    /* the command line first: --help wins over any error in the file */
    int rc = parse(argc, argv, opts, N, &flags, NULL, seen, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    serve_parse p = {.opts = opts,
                     .n_opts = N,
                     .layer = &fin,
                     .src = src,
                     .file_key = file_key,
                     .result = &fin.s,
                     .msg = msg,
                     .msg_len = msg_len};
    cJSON *tree = NULL;
    char where[1024];
    size_t k_config = find_opt(opts, N, "config");
    const char *config_env = getenv("QLSERVE_CONFIG");
    if (config_env) {
        fin.s.config_path = keep_string(&fin.s, config_env, strlen(config_env));
        src[k_config] = SRC_ENV;
        if (!fin.s.config_path) {
            rc = usage_error(msg, msg_len, "serve: out of memory");
            goto fail;
        }
    } else if (seen[k_config]) {
        fin.s.config_path = flags.s.config_path;
        src[k_config] = SRC_FLAG;
    }
    if (fin.s.config_path) {
        p.file_path = fin.s.config_path;
        describe(&p, k_config, where, sizeof where);
        if ((rc = apply_config_file(&p, where, &tree)) != QL_OK)
            goto fail;
    }

    /* the flags the command line gave, over the file */
    for (size_t k = 0; k < N; k++) {
        if (!seen[k] || k == k_config)
            continue;
        memcpy(value_at(&fin, &opts[k]), value_at(&flags, &opts[k]), value_size(&opts[k]));
        src[k] = SRC_FLAG;
    }

    if ((rc = apply_environment(&p)) != QL_OK || (rc = resolve_secrets(&p, &fin)) != QL_OK ||
        (rc = validate_serve(&p)) != QL_OK ||
        (rc = validate_list(&p, "cors-allow-origin", fin.s.cors_allow_origin, cors_origin_entry,
                            "an origin: each is * or scheme://host[:port] (no path, no trailing "
                            "/)")) != QL_OK ||
        (rc = validate_list(&p, "allowed-hosts", fin.s.allowed_hosts, allowed_host_entry,
                            "a Host header's value: each is * or name[:port] (no scheme, no "
                            "path)")) != QL_OK)
        goto fail;
    cJSON_Delete(tree);
    *out = fin.s;
    return QL_OK;

fail:
    cJSON_Delete(tree);
    cfg_serve_free(&fin.s);
    return rc;
}

/* serve's flags, each with its default and its config file and environment
 * forms. The defaults are printed from the rows, so they cannot drift from
 * what the parser sets; a help text that states its own default (the model
 * flags, whose 0 means "the kind's default") is left to say it. */
static void print_serve_usage(FILE *out)
{
    serve_layer d;
    memset(&d, 0, sizeof d);
    apply_defaults(serve_opts, N_SERVE_OPTS, &d);
    const opt *opts = serve_opts;
    fprintf(out,
            "usage: qlserve serve --model PATH [flags]\n"
            "Serves the HTTP API: /generate and /generate_stream (TGI-shaped), /v1/completions\n"
            "and /v1/models (OpenAI-shaped), /admin/adapters, /health, /info and /metrics.\n"
            "\n"
            "Every flag can also be set in a JSON config file (--config FILE) as\n"
            "{\"max-body-bytes\": 1048576} (or \"max_body_bytes\"), and by an environment\n"
            "variable, QLSERVE_MAX_BODY_BYTES=1048576. Later wins: the defaults, then the\n"
            "config file, then flags, then the environment. Paths are relative to the working\n"
            "directory. The admin token and the API key are never flags or config keys: put\n"
            "each in a file (--admin-token-file, --api-key-file) or in QLSERVE_ADMIN_TOKEN,\n"
            "QLSERVE_API_KEY. With an API key every route but /health, GET / and the console's\n"
            "files (/console, /console.js, /console.css) wants\n"
            "\"Authorization: Bearer KEY\"; the admin routes want the admin token instead.\n"
            "\n");
    for (size_t k = 0; k < N_SERVE_OPTS; k++) {
        const opt *o = &opts[k];
        char def[64] = "", env[96], help[512];
        if (!strstr(o->help, "default") &&
            (o->type != OPT_STRING || *(const char **)value_at(&d, o)) && o->type != OPT_BOOL) {
            format_value(o, &d, false, def, sizeof def);
            memmove(def + 10, def, strlen(def) + 1);
            memcpy(def, " (default ", 10);
            strcat(def, ")");
        }
        env_name(o->name, env, sizeof env);
        fprintf(out, "  --%-21s %s%s\n", o->name, help_text(o, help, sizeof help), def);
        if (strcmp(o->name, "config") == 0)
            fprintf(out, "  %-23s env %s (not a config file key)\n", "", env);
        else if (o->type == OPT_BOOL)
            fprintf(out, "  %-23s config \"%s\": true, env %s=1\n", "", o->name, env);
        else
            fprintf(out, "  %-23s config \"%s\", env %s\n", "", o->name, env);
    }
    fprintf(out,
            "  %-23s env QLSERVE_ADMIN_TOKEN: the admin token itself (not a flag, "
            "not a config key)\n"
            "  %-23s env QLSERVE_API_KEY: the API key itself (not a flag, not a config key)\n",
            "", "");
}

static void print_opts(FILE *out, const opt *opts, size_t n)
{
    char help[512];
    for (size_t i = 0; i < n; i++)
        fprintf(out, "  --%-14s %s\n", opts[i].name, help_text(&opts[i], help, sizeof help));
}

void cfg_print_usage(FILE *out, const char *sub)
{
    if (sub && strcmp(sub, "quantize") == 0) {
        fprintf(out, "usage: qlserve quantize --in IN.safetensors --out OUT.safetensors "
                     "--kind nf4|fp4 [--blocksize N] [--double-quant]\n"
                     "       qlserve quantize --in IN.gguf --out OUT.gguf --kind "
                     "q2_k|q3_k|q4_k|q5_k|q6_k|q8_0|f32 [--allow-requantize]\n"
                     "       qlserve quantize --in DIR --out OUT.gguf --kind "
                     "q2_k|q3_k|q4_k|q5_k|q6_k|q8_0|f32\n"
                     "       qlserve quantize --in DIR --out OUTDIR --kind fp8 "
                     "[--block 128x128] [--scale-fmt float|ue8m0]\n"
                     "Quantizes every 2-D float tensor and writes the bitsandbytes "
                     "serialization; other tensors are copied.\n"
                     "A GGUF kind requantizes a GGUF file's f32/f16/bf16 weights as "
                     "llama-quantize does (one type for all, its fallbacks for columns\n"
                     "that are not whole blocks) and copies the metadata and other "
                     "tensors;\n"
                     "with --allow-requantize, quantized weights too (dequantized first).\n"
                     "fp8 writes transformers' finegrained FP8 folder (E4M3 linears with a "
                     "weight_scale_inv per block).\n");
        print_opts(out, quantize_opts, N_OPTS(quantize_opts));
        return;
    }
    if (sub && strcmp(sub, "inspect") == 0) {
        fprintf(out, "usage: qlserve inspect FILE|MODEL [model flags]\n"
                     "A .safetensors file: its quantized weights with their quant state, other "
                     "tensors, metadata.\nA model (Hugging Face folder or .gguf): architecture, "
                     "sizes, tensor kinds, tokenizer, as loaded with the flags.\n");
        print_opts(out, inspect_opts, N_OPTS(inspect_opts));
        return;
    }
    if (sub && strcmp(sub, "generate") == 0) {
        fprintf(out, "usage: qlserve generate --model PATH --prompt TEXT [flags]\n"
                     "Prints the completion as it is generated, then a line with the token "
                     "counts and speeds.\n");
        print_opts(out, generate_opts, N_OPTS(generate_opts));
        return;
    }
    if (sub && strcmp(sub, "serve") == 0) {
        print_serve_usage(out);
        return;
    }
    if (sub && strcmp(sub, "tokenize") == 0) {
        fprintf(out, "usage: qlserve tokenize --model PATH [--add-bos] [--no-special] [--json] "
                     "TEXT\n"
                     "Prints the token ids and pieces of TEXT (special-token strings in it "
                     "become their ids unless --no-special), reading only the tokenizer.\n");
        print_opts(out, tokenize_opts, N_OPTS(tokenize_opts));
        return;
    }
    fprintf(out,
            "usage: qlserve COMMAND [FLAGS]\n"
            "commands:\n"
            "  serve      serve generation with hot LoRA adapters over HTTP\n"
            "  quantize   a safetensors file to NF4/FP4 (bitsandbytes), a GGUF file to q2_k..q8_0\n"
            "  inspect    print what a safetensors file or a model holds\n"
            "  generate   complete a prompt with a model\n"
            "  tokenize   print the token ids of a text under a model's tokenizer\n"
            "  version    version, CPU kernel path and CUDA backend\n"
            "qlserve COMMAND --help for a command's flags.\n");
}

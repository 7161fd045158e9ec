/*
 * config.h - the public header of config/: command-line flags for each
 * `qlserve` subcommand, parsed and checked for form (a number is a number, a
 * required flag is present, an unknown flag is an error naming it). What a
 * value means (a quant kind, a path that must exist) is checked by the
 * module that uses it.
 *
 * Strings in the parsed structs point into argv and live as long as it.
 */
#ifndef QL_CONFIG_H
#define QL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { CFG_OK = 0, CFG_EUSAGE = -200, CFG_HELP = -201 /* --help was asked for */ };

typedef struct cfg_quantize {
    const char *in_path;  /* --in, required */
    const char *out_path; /* --out, required */
    const char *kind;     /* --kind, required: nf4 or fp4 */
    int32_t blocksize;    /* --blocksize, default 64 */
    bool double_quant;    /* --double-quant */
} cfg_quantize;

/* How to load a model: shared by every subcommand that loads one. */
typedef struct cfg_model {
    const char *path;      /* --model (inspect takes it as its argument) */
    const char *quant;     /* --quant none|nf4|nf4-dq|fp4|int4|int8 */
    int32_t blocksize;     /* --blocksize for nf4/fp4 (0: 64) */
    int32_t group_size;    /* --group-size for int4/int8 (0: kind's default) */
    bool quantize_lm_head; /* --quantize-lm-head */
    const char *dtype;     /* --dtype f32|bf16|f16 for dense parameters */
} cfg_model;

typedef struct cfg_inspect {
    const char *path; /* the one positional argument */
    cfg_model model;  /* used when path is a model */
} cfg_inspect;

typedef struct cfg_tokenize {
    cfg_model model;  /* --model is required */
    const char *text; /* the one positional argument */
    bool add_bos;     /* --add-bos: prepend BOS when the model wants it */
} cfg_tokenize;

typedef struct cfg_generate {
    cfg_model model;          /* --model is required */
    const char *prompt;       /* --prompt, required */
    int32_t max_new_tokens;   /* --max-new-tokens, default 128 */
    float temperature;        /* --temperature, default 0: greedy */
    int32_t top_k;            /* --top-k, default 0: off */
    float top_p;              /* --top-p, default 1: off */
    float repetition_penalty; /* --repetition-penalty, default 1: off */
    uint64_t seed;            /* --seed, default 0 */
    const char *stop;         /* --stop STRING */
    int32_t threads;          /* --threads, default 0: all cores */
    int32_t kv_mib;           /* --kv-mib, default 0: the engine's default */
    const char *adapter;      /* --adapter DIR: a PEFT LoRA adapter folder */
    float adapter_scale;      /* --adapter-scale, default 1 */
    bool merge;               /* --merge: merge it into the weights (else unmerged) */
    const char *into;         /* --into int8|bf16: what merged modules are stored in */
} cfg_generate;

/* argv[0] is the subcommand's name. On CFG_EUSAGE msg says what is wrong. */
int cfg_parse_quantize(int argc, char **argv, cfg_quantize *out, char *msg, size_t msg_len);
int cfg_parse_inspect(int argc, char **argv, cfg_inspect *out, char *msg, size_t msg_len);
int cfg_parse_tokenize(int argc, char **argv, cfg_tokenize *out, char *msg, size_t msg_len);
int cfg_parse_generate(int argc, char **argv, cfg_generate *out, char *msg, size_t msg_len);

/* The usage text of the whole command, or of one subcommand. */
void cfg_print_usage(FILE *out, const char *subcommand);

#endif

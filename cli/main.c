/*
 * main.c - the qlserve binary: looks argv[1] up in the table of subcommands
 * and hands that row the rest of the command line (argv[0] the subcommand's
 * name). Each subcommand lives in its own file behind cli.h; the usage text,
 * the list of commands included, is config/'s (cfg_print_usage), so the
 * list is written once. Exit status: 0 done, 1 the job failed, 2 a usage
 * error (an unknown command included).
 *
 * main.c owns nothing but the table, and includes only cli.h.
 */
#include "cli.h"

#include <string.h>

/* QL_VERSION is defined for this target only, so version is handed it here. */
static int run_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return cli_version(QL_VERSION);
}

/* help [COMMAND]: the list of commands, or COMMAND's flags, to stdout. */
static int run_help(int argc, char **argv)
{
    cfg_print_usage(stdout, argc > 1 ? argv[1] : NULL);
    return 0;
}

static const struct subcommand {
    const char *name;
    int (*run)(int argc, char **argv);
} subcommands[] = {
    {"serve", cli_serve},       /* serve generation with hot LoRA adapters over HTTP */
    {"quantize", cli_quantize}, /* safetensors to NF4/FP4, or GGUF to q2_k ... q6_k, q8_0 */
    {"inspect", cli_inspect},   /* what a safetensors file or a model holds */
    {"generate", cli_generate}, /* complete a prompt with a model */
    {"tokenize", cli_tokenize}, /* the token ids of a text under a model's tokenizer */
    {"version", run_version},   /* version, CPU kernel path and CUDA backend */
    {"--version", run_version}, {"help", run_help}, {"--help", run_help}, {"-h", run_help},
};

int main(int argc, char **argv)
{
    if (argc < 2) {
        cfg_print_usage(stderr, NULL);
        return 2;
    }
    for (size_t i = 0; i < sizeof subcommands / sizeof *subcommands; i++)
        if (strcmp(argv[1], subcommands[i].name) == 0)
            return subcommands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "qlserve: unknown command '%s'\n", argv[1]);
    cfg_print_usage(stderr, NULL);
    return 2;
}

/*
 * flags.c - what every subcommand shares in turning its flags into a job:
 * the usage-error exit (cli_usage_failure) and the model flags as the
 * engine's load options (cli_load_opts). Owns nothing; touches only stdout
 * and stderr.
 */
#include "cli.h"

int cli_usage_failure(const char *sub, int rc, const char *msg)
{
    if (rc == QL_EHELP) {
        cfg_print_usage(stdout, sub);
        return 0;
    }
    fprintf(stderr, "qlserve: %s\n", msg);
    cfg_print_usage(stderr, sub);
    return 2;
}

eng_load_opts cli_load_opts(const cfg_model *m)
{
    return (eng_load_opts){.path = m->path,
                           .quant = m->quant,
                           .blocksize = m->blocksize,
                           .group_size = m->group_size,
                           .quantize_lm_head = m->quantize_lm_head,
                           .dtype = m->dtype,
                           .chat_template = m->chat_template};
}

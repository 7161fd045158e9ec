/*
 * fuzz_config.c - libFuzzer target for the config file of `qlserve serve`
 * (config/config.c: --config FILE, a JSON object of "flag": value). The
 * input is the file; cfg_parse_serve reads it under the defaults and over
 * no flags or environment (QLSERVE_* are cleared once at start). Whatever
 * the bytes, it must refuse with a usage error that says why, or give a
 * configuration that cfg_serve_free frees, with no fault or leak: a value
 * of the wrong type, out of range, a nested value, a duplicate key under
 * its two spellings, a NUL byte, a secret in the file.
 *
 * A file naming token or key files (admin-token-file, api-key-file) makes
 * the parser read them; the fuzzer runs with stdin from /dev/null
 * (scripts/test.sh) so naming /dev/stdin cannot block it.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seeds in tests/fuzz/corpus_config/.
 */
#include "config.h"
#include "fuzz_input.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

extern char **environ;

static void clear_qlserve_env(void)
{
    for (bool again = true; again;) {
        again = false;
        for (char **e = environ; *e; e++) {
            if (strncmp(*e, "QLSERVE_", 8) == 0) {
                char name[256];
                snprintf(name, sizeof name, "%.*s", (int)strcspn(*e, "="), *e);
                unsetenv(name);
                again = true;
                break;
            }
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool cleared;
    if (!cleared) {
        clear_qlserve_env();
        cleared = true;
    }
    const char *path = fuzz_input_file(data, size, "json");
    if (!path)
        return 0;
    char *argv[] = {"serve", "--config", (char *)path, NULL};
    cfg_serve c;
    char msg[2048] = "";
    int rc = cfg_parse_serve(3, argv, &c, msg, sizeof msg);
    if (rc != QL_OK) {
        if (!msg[0])
            abort(); /* a refusal says why */
        return 0;
    }
    if (!c.config_path || strcmp(c.config_path, path) != 0)
        abort(); /* the file it read is the one named */
    cfg_serve_free(&c);
    return 0;
}

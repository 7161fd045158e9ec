/*
 * fuzz_adapter_config.c - libFuzzer target for adapter_config.json as
 * adapters/peft.c reads it: peft_type, r, lora_alpha, target_modules as a
 * list or as a Python regex (translated to POSIX and compiled, bounded by
 * PATTERN_MAX_BYTES and PATTERN_MAX_REPEATS), exclude_modules,
 * layers_to_transform / layers_pattern, rank_pattern / alpha_pattern
 * (each key a regex), the refused fields.
 *
 * The input is the config's text, put in a folder beside a copy of a fixed
 * adapter_model.safetensors (tests/fixtures/peft/patterns, a real PEFT
 * adapter) and loaded with lora_load for the tiny Llama of
 * tests/fixtures/peft/base, loaded once: so a config also goes through
 * planning which modules it targets against a real model's module names
 * (every pattern is run by regexec) and through matching the file's keys.
 * Whatever the bytes, lora_load must refuse with a message (and no adapter)
 * or load one, within libFuzzer's -timeout and -rss_limit_mb: a pattern
 * that makes regcomp or regexec blow up is a finding.
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seeds in tests/fuzz/corpus_adapter_config/ and the
 * fixtures' own adapter_config.json files.
 */
#include "lora.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static eng_model model;
static char folder[128];

static void set_up(void)
{
    char msg[1024];
    eng_load_opts o = {.path = QL_FIXTURES "/peft/base"};
    if (eng_model_load(&model, &o, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "fuzz_adapter_config: %s\n", msg);
        abort();
    }
    snprintf(folder, sizeof folder, "/tmp/qlserve-fuzz-%d-adapter", (int)getpid());
    mkdir(folder, 0700);
    /* a copy, not a symlink: the loader reads no file through a link */
    char copy[256], *bytes;
    size_t len;
    snprintf(copy, sizeof copy, "%s/adapter_model.safetensors", folder);
    if (mf_read_file(QL_FIXTURES "/peft/patterns/adapter_model.safetensors", 0, &bytes, &len, msg,
                     sizeof msg) != QL_OK) {
        fprintf(stderr, "fuzz_adapter_config: %s\n", msg);
        abort();
    }
    FILE *f = fopen(copy, "wb");
    if (!f || fwrite(bytes, 1, len, f) != len || fclose(f) != 0)
        abort();
    free(bytes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!folder[0])
        set_up();
    char path[256];
    snprintf(path, sizeof path, "%s/adapter_config.json", folder);
    FILE *f = fopen(path, "wb");
    if (!f)
        return 0;
    if (size)
        fwrite(data, 1, size, f);
    fclose(f);

    eng_lora *l = NULL;
    lora_meta meta;
    char msg[1024] = "";
    int rc = lora_load(&l, &meta, folder, "fuzz", &model, msg, sizeof msg);
    if (rc != QL_OK) {
        if (l || !msg[0])
            abort(); /* a refusal leaves no adapter and says why */
        return 0;
    }
    if (!l || meta.n_modules <= 0)
        abort(); /* a loaded adapter has modules */
    eng_lora_unref(l);
    return 0;
}

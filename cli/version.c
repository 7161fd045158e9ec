/*
 * version.c - `qlserve version`: what this build is made of, for a bug
 * report: the version, the CPU kernel path the kernels chose on this
 * machine, the versions of libuv, llhttp and cJSON, and the CUDA backend
 * (eng_cuda_describe, so cli/ never reaches into kernels/cuda). Owns
 * nothing; writes only to stdout.
 */
#include "cli.h"
#include "qtensor.h"
#include "runtime.h"

#include <cjson/cJSON.h>
#include <llhttp.h>
#include <uv.h>

int cli_version(const char *version)
{
    printf("qlserve %s\n", version);
    printf("cpu kernels: %s\n", qt_cpu_path());
    printf("libuv %s, llhttp %d.%d.%d, cJSON %s\n", uv_version_string(), LLHTTP_VERSION_MAJOR,
           LLHTTP_VERSION_MINOR, LLHTTP_VERSION_PATCH, cJSON_Version());
    char cuda[512];
    eng_cuda_describe(cuda, sizeof cuda);
    printf("%s\n", cuda);
    return 0;
}

/*
 * main.c - the qlserve binary: reads the subcommand, hands its flags to
 * config/, and runs the job. Exit status: 0 done, 1 the job failed (the
 * message names the file, tensor and problem), 2 a usage error.
 *
 * `qlserve serve` runs the HTTP server (server.h); the other commands are
 * one-shot jobs.
 */
#include "cli.h"
#include "config.h"
#include "lora.h"
#include "server.h"

#include <cjson/cJSON.h>
#include <llhttp.h>
#include <stdio.h>
#include <string.h>
#include <uv.h>

static int usage_failure(const char *sub, int rc, const char *msg)
{
    if (rc == QL_EHELP) {
        cfg_print_usage(stdout, sub);
        return 0;
    }
    fprintf(stderr, "qlserve: %s\n", msg);
    cfg_print_usage(stderr, sub);
    return 2;
}

static int run_quantize(int argc, char **argv)
{
    char msg[1024];
    cfg_quantize c;
    int rc = cfg_parse_quantize(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return usage_failure("quantize", rc, msg);
    eng_quantize_opts o = {.in_path = c.in_path,
                           .out_path = c.out_path,
                           .kind = c.kind,
                           .blocksize = c.blocksize,
                           .double_quant = c.double_quant};
    rc = eng_quantize_file(&o, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve quantize: %s\n", msg);
        return 1;
    }
    return 0;
}

static eng_load_opts load_opts(const cfg_model *m)
{
    return (eng_load_opts){.path = m->path,
                           .quant = m->quant,
                           .blocksize = m->blocksize,
                           .group_size = m->group_size,
                           .quantize_lm_head = m->quantize_lm_head,
                           .dtype = m->dtype};
}

static int run_tokenize(int argc, char **argv)
{
    char msg[1024];
    cfg_tokenize c;
    int rc = cfg_parse_tokenize(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return usage_failure("tokenize", rc, msg);
    eng_load_opts load = load_opts(&c.model);
    rc = eng_tokenize(&load, c.text, c.add_bos, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve tokenize: %s\n", msg);
        return 1;
    }
    return 0;
}

/* The merge report, one line per module and the whole, to f. */
static void print_merge_report(FILE *f, const lora_report *rep)
{
    for (size_t i = 0; i < rep->n_modules; i++) {
        const struct lora_module_cost *mc = &rep->modules[i];
        fprintf(f, "merge: layer %d %-9s %-6s delta_retained %.4f relative_error %.4f\n", mc->layer,
                eng_proj_name(mc->proj), qt_kind_name(mc->kind), mc->cost.delta_retained,
                mc->cost.relative_error);
    }
    fprintf(f,
            "merge: %s x%g into %zu modules (%s): delta_retained %.4f, relative_error %.4f, "
            "%.3f s, weights version %llu digest %016llx\n",
            rep->adapter, (double)rep->scale, rep->n_modules,
            rep->into == QT_KIND_COUNT ? "each weight's own kind" : qt_kind_name(rep->into),
            rep->overall.delta_retained, rep->overall.relative_error, rep->seconds,
            (unsigned long long)rep->version, (unsigned long long)rep->digest);
}

/* generate with --adapter: the model, an engine, a registry holding the
 * adapter (merged when asked), and one request wanting it. */
static int generate_with_adapter(const cfg_generate *c, const eng_load_opts *load,
                                 const eng_generate_opts *g, char *msg, size_t msg_len)
{
    eng_model m;
    int rc = eng_model_load(&m, load, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_engine_opts eo = {
        .threads = c->threads, .device = g->device, .kv_bytes = (size_t)c->kv_mib << 20};
    eng_engine *e = NULL;
    lora_registry *reg = NULL;
    eng_lora *lora = NULL;
    lora_meta meta;
    rc = eng_engine_start(&e, &m, &eo, msg, msg_len);
    if (rc == QL_OK) {
        lora_registry_opts ro = {0};
        rc = lora_registry_new(&reg, e, &m, &ro, msg, msg_len);
    }
    if (rc == QL_OK)
        rc = lora_registry_load(reg, "adapter", c->adapter, 1.0f, &meta, msg, msg_len);
    if (rc == QL_OK) {
        fprintf(stderr, "adapter %s: rank %d, alpha %g, %d modules (%s)\n", c->adapter, meta.r,
                (double)meta.alpha, meta.n_modules, meta.targets);
        if (meta.warning[0])
            fprintf(stderr, "adapter %s: warning: %s\n", c->adapter, meta.warning);
    }
    if (rc == QL_OK && c->merge) {
        lora_merge_opts mo = {.safe_merge = true, .into = QT_KIND_COUNT};
        if (c->into)
            mo.into = strcmp(c->into, "int8") == 0 ? QT_AFFINE : QT_BF16;
        lora_report rep;
        rc = lora_registry_merge(reg, "adapter", c->adapter_scale, &mo, &rep, msg, msg_len);
        if (rc == QL_OK) {
            print_merge_report(stderr, &rep);
            lora_report_free(&rep);
        }
    }
    if (rc == QL_OK)
        rc = lora_registry_get(reg, "adapter", &lora, msg, msg_len);
    if (rc == QL_OK) {
        eng_lora_term want = {lora, c->adapter_scale};
        eng_generate_opts go = *g;
        go.adapters = &want;
        go.n_adapters = 1;
        rc = eng_generate_on(e, &go, stdout, stderr, msg, msg_len);
    }
    eng_lora_unref(lora);
    eng_engine_stop(e); /* before the registry: no sequence holds an adapter after */
    lora_registry_free(reg);
    eng_model_free(&m);
    return rc;
}

static int run_generate(int argc, char **argv)
{
    char msg[1024];
    cfg_generate c;
    int rc = cfg_parse_generate(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return usage_failure("generate", rc, msg);
    eng_load_opts load = load_opts(&c.model);
    eng_generate_opts g = {
        .prompt = c.prompt,
        .max_new_tokens = c.max_new_tokens,
        .sampling = {.temperature = c.temperature,
                     .top_k = c.top_k,
                     .top_p = c.top_p,
                     .repetition_penalty = c.repetition_penalty,
                     .seed = c.seed},
        .stop = c.stop,
        .threads = c.threads,
        .kv_bytes = (size_t)c.kv_mib << 20,
    };
    if (eng_device_parse(c.device, &g.device, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "qlserve generate: %s\n", msg);
        return 2;
    }
    if (c.adapter)
        rc = generate_with_adapter(&c, &load, &g, msg, sizeof msg);
    else
        rc = eng_generate(&load, &g, stdout, stderr, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve generate: %s\n", msg);
        return 1;
    }
    return 0;
}

static int run_inspect(int argc, char **argv)
{
    char msg[1024];
    cfg_inspect c;
    int rc = cfg_parse_inspect(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return usage_failure("inspect", rc, msg);
    eng_load_opts load = load_opts(&c.model);
    rc = eng_inspect(c.path, &load, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve inspect: %s\n", msg);
        return 1;
    }
    return 0;
}

static int run_serve(int argc, char **argv)
{
    char msg[1024];
    cfg_serve c;
    int rc = cfg_parse_serve(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return usage_failure("serve", rc, msg);
    rc = srv_serve(&c);
    cfg_serve_free(&c);
    return rc;
}

static int run_version(void)
{
    printf("qlserve %s\n", QL_VERSION);
    printf("cpu kernels: %s\n", qt_cpu_path());
    printf("libuv %s, llhttp %d.%d.%d, cJSON %s\n", uv_version_string(), LLHTTP_VERSION_MAJOR,
           LLHTTP_VERSION_MINOR, LLHTTP_VERSION_PATCH, cJSON_Version());
    char cuda[512];
    eng_cuda_describe(cuda, sizeof cuda);
    printf("%s\n", cuda);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        cfg_print_usage(stderr, NULL);
        return 2;
    }
    const char *sub = argv[1];
    if (strcmp(sub, "quantize") == 0)
        return run_quantize(argc - 1, argv + 1);
    if (strcmp(sub, "inspect") == 0)
        return run_inspect(argc - 1, argv + 1);
    if (strcmp(sub, "tokenize") == 0)
        return run_tokenize(argc - 1, argv + 1);
    if (strcmp(sub, "generate") == 0)
        return run_generate(argc - 1, argv + 1);
    if (strcmp(sub, "serve") == 0)
        return run_serve(argc - 1, argv + 1);
    if (strcmp(sub, "version") == 0 || strcmp(sub, "--version") == 0)
        return run_version();
    if (strcmp(sub, "help") == 0 || strcmp(sub, "--help") == 0 || strcmp(sub, "-h") == 0) {
        cfg_print_usage(stdout, argc > 2 ? argv[2] : NULL);
        return 0;
    }
    fprintf(stderr, "qlserve: unknown command '%s'\n", sub);
    cfg_print_usage(stderr, NULL);
    return 2;
}

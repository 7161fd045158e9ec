/*
 * test_config.c - the configuration of `qlserve serve`: its defaults, the
 * order in which the config file, flags and environment override each other,
 * the admin token (from a file, trailing newline dropped, or the
 * environment; never from the config file), and that every refusal names the
 * flag, file key or variable that holds the bad value, and the value.
 *
 * Each Criterion test runs in a process of its own, so the environment set
 * here stays in the test; setup clears every QLSERVE_ variable first, so a
 * CI machine's QLSERVE_MODEL cannot leak into these.
 */
#include <criterion/criterion.h>
#include <ctype.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "test_util.h"

extern char **environ;

static char dir[512], msg[2048];

static void clear_qlserve_env(void)
{
    for (;;) {
        char name[256] = "";
        for (char **e = environ; *e; e++) {
            if (strncmp(*e, "QLSERVE_", 8) == 0) {
                size_t n = strcspn(*e, "=");
                snprintf(name, sizeof name, "%.*s", (int)n, *e);
                break;
            }
        }
        if (!name[0])
            return;
        unsetenv(name);
    }
}

static void setup(void)
{
    clear_qlserve_env();
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    msg[0] = 0;
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(config, .init = setup, .fini = teardown);

/* dir/name holding text; its path goes to path */
static const char *write_file(const char *name, const char *text, char *path, size_t len)
{
    snprintf(path, len, "%s/%s", dir, name);
    test_write_text(path, text);
    return path;
}

/* cfg_parse_serve over a NULL-terminated argv */
static int parse_args(cfg_serve *out, char **args)
{
    int argc = 0;
    while (args[argc])
        argc++;
    return cfg_parse_serve(argc, args, out, msg, sizeof msg);
}

#define PARSE(out, ...) parse_args((out), (char *[]){"serve", __VA_ARGS__, NULL})

#define ASSERT_MSG_HAS(s) cr_assert(strstr(msg, (s)), "message \"%s\" lacks \"%s\"", msg, (s))

Test(config, defaults)
{
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.model.path, "m");
    cr_assert_null(c.model.quant);
    cr_assert_str_eq(c.host, "127.0.0.1");
    cr_assert_eq(c.port, 8080);
    cr_assert_null(c.adapter_dir);
    cr_assert_null(c.admin_token);
    cr_assert_null(c.config_path);
    cr_assert_null(c.served_model_name);
    cr_assert_eq(c.threads, 0);
    cr_assert_eq(c.kv_mib, 256);
    cr_assert_eq(c.max_running, 64);
    /* the step budget: automatic, from the measured time, with a floor of 16 */
    cr_assert_eq(c.step_budget_ms, 0);
    cr_assert_eq(c.max_prefill_per_step, 0);
    cr_assert_eq(c.min_prefill_per_step, 16);
    cr_assert_eq(c.max_queued, 256);
    cr_assert_eq(c.max_new_tokens, 4096);
    cr_assert_eq(c.max_context, 0);
    cr_assert_eq(c.max_connections, 256);
    cr_assert_eq(c.max_body_bytes, 1 << 20);
    cr_assert_eq(c.max_header_bytes, 16 << 10);
    cr_assert_eq(c.request_timeout_ms, 30000);
    cr_assert_eq(c.keepalive_timeout_ms, 60000);
    cr_assert_eq(c.grace_ms, 30000);
    cr_assert_eq(c.adapter_budget_mib, 0);
    cr_assert_eq(c.merge_threads, 1);
    cr_assert_str_eq(c.device, "auto");
    cfg_serve_free(&c);
}

Test(config, every_flag_sets_its_field)
{
    cfg_serve c;
    cr_assert_eq(
        PARSE(&c, "--model", "m", "--quant", "nf4", "--blocksize", "128", "--group-size", "32",
              "--quantize-lm-head", "--dtype", "bf16", "--host", "0.0.0.0", "--port=0",
              "--adapter-dir", "/a", "--served-model-name", "tiny", "--threads", "3", "--kv-mib",
              "64", "--max-running", "8", "--max-queued", "0", "--max-new-tokens", "100",
              "--max-context", "2048", "--max-connections", "9", "--max-body-bytes", "1073741824",
              "--max-header-bytes", "1024", "--request-timeout-ms", "5", "--keepalive-timeout-ms",
              "6", "--grace-ms", "0", "--adapter-budget-mib", "512", "--merge-threads", "4",
              "--device", "cpu", "--step-budget-ms", "120", "--max-prefill-per-step", "48",
              "--min-prefill-per-step", "8", "--draft-max", "6", "--draft-fixed", "--ngram-min",
              "2", "--ngram-max", "5", "--ngram-memory", "-1", "--spec-max-batch", "3"),
        QL_OK, "%s", msg);
    cr_assert_eq(c.spec.draft_max, 6);
    cr_assert(c.spec.draft_fixed);
    cr_assert_eq(c.spec.ngram_min, 2);
    cr_assert_eq(c.spec.ngram_max, 5);
    cr_assert_eq(c.spec.ngram_memory, -1);
    cr_assert_eq(c.spec.max_batch, 3);
    cr_assert_str_eq(c.model.quant, "nf4");
    cr_assert_eq(c.model.blocksize, 128);
    cr_assert_eq(c.model.group_size, 32);
    cr_assert(c.model.quantize_lm_head);
    cr_assert_str_eq(c.model.dtype, "bf16");
    cr_assert_str_eq(c.host, "0.0.0.0");
    cr_assert_eq(c.port, 0);
    cr_assert_str_eq(c.adapter_dir, "/a");
    cr_assert_str_eq(c.served_model_name, "tiny");
    cr_assert_eq(c.threads, 3);
    cr_assert_eq(c.kv_mib, 64);
    cr_assert_eq(c.max_running, 8);
    cr_assert_eq(c.step_budget_ms, 120);
    cr_assert_eq(c.max_prefill_per_step, 48);
    cr_assert_eq(c.min_prefill_per_step, 8);
    cr_assert_eq(c.max_queued, 0);
    cr_assert_eq(c.max_new_tokens, 100);
    cr_assert_eq(c.max_context, 2048);
    cr_assert_eq(c.max_connections, 9);
    cr_assert_eq(c.max_body_bytes, 1073741824);
    cr_assert_eq(c.max_header_bytes, 1024);
    cr_assert_eq(c.request_timeout_ms, 5);
    cr_assert_eq(c.keepalive_timeout_ms, 6);
    cr_assert_eq(c.grace_ms, 0);
    cr_assert_eq(c.adapter_budget_mib, 512);
    cr_assert_eq(c.merge_threads, 4);
    cr_assert_str_eq(c.device, "cpu");
    cfg_serve_free(&c);
}

Test(config, device_from_each_layer_and_refused_by_name)
{
    cfg_serve c;
    char path[1024];
    cr_assert_eq(PARSE(&c, "--model", "m", "--device", "cuda"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.device, "cuda");
    cfg_serve_free(&c);
    cr_assert_eq(PARSE(&c, "--model", "m", "--device", "gpu"), QL_EUSAGE);
    ASSERT_MSG_HAS("--device gpu");
    ASSERT_MSG_HAS("cpu, cuda, auto");
    write_file("c.json", "{\"device\": \"tpu\"}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"device\"");
    ASSERT_MSG_HAS("tpu");
    setenv("QLSERVE_DEVICE", "cpu", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.device, "cpu");
    cfg_serve_free(&c);
}

/* A word flag of serve and generate (--adapter-dtype, --activations): its
 * default on both; a good word from the flag; a bad one refused naming the
 * flag, the value and the words (list), from the command line and from the
 * config file; the environment's good word over the file's bad one. The
 * value is read at serve_at in cfg_serve and generate_at in cfg_generate. */
static void check_word_flag(const char *flag, size_t serve_at, size_t generate_at, const char *def,
                            const char *good, const char *bad, const char *list)
{
    cfg_serve c;
    char path[1024], dashed[64], text[256], env[64];
    snprintf(dashed, sizeof dashed, "--%s", flag);
#define SERVE_VALUE (*(const char **)((char *)&c + serve_at))
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_OK, "%s", msg);
    cr_assert_str_eq(SERVE_VALUE, def);
    cfg_serve_free(&c);
    cr_assert_eq(PARSE(&c, "--model", "m", dashed, (char *)good), QL_OK, "%s", msg);
    cr_assert_str_eq(SERVE_VALUE, good);
    cfg_serve_free(&c);
    cr_assert_eq(PARSE(&c, "--model", "m", dashed, (char *)bad), QL_EUSAGE);
    snprintf(text, sizeof text, "%s %s", dashed, bad);
    ASSERT_MSG_HAS(text);
    ASSERT_MSG_HAS(list);
    snprintf(text, sizeof text, "{\"%s\": \"%s\"}", flag, bad);
    write_file("c.json", text, path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    snprintf(text, sizeof text, "\"%s\"", flag);
    ASSERT_MSG_HAS(text);
    ASSERT_MSG_HAS(bad);
    snprintf(env, sizeof env, "QLSERVE_%s", flag);
    for (char *e = env; *e; e++)
        *e = *e == '-' ? '_' : (char)toupper((unsigned char)*e);
    setenv(env, good, 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(SERVE_VALUE, good);
    cfg_serve_free(&c);
    unsetenv(env);
#undef SERVE_VALUE

    cfg_generate g;
    char *args[] = {"generate", "--model", "m", "--prompt", "p", dashed, (char *)bad};
    cr_assert_eq(cfg_parse_generate(7, args, &g, msg, sizeof msg), QL_EUSAGE);
    snprintf(text, sizeof text, "%s %s", dashed, bad);
    ASSERT_MSG_HAS(text);
    cr_assert_eq(cfg_parse_generate(5, args, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(*(const char **)((char *)&g + generate_at), def);
}

Test(config, adapter_dtype_defaults_to_bf16_from_each_layer_and_refused_by_name)
{
    check_word_flag("adapter-dtype", offsetof(cfg_serve, adapter_dtype),
                    offsetof(cfg_generate, adapter_dtype), "bf16", "f32", "f16", "bf16, f32");
}

Test(config, activations_default_to_f32_from_each_layer_and_refused_by_name)
{
    check_word_flag("activations", offsetof(cfg_serve, activations),
                    offsetof(cfg_generate, activations), "f32", "q8", "q8_0", "f32, q8");
}

Test(config, speculative_defaults_to_off_from_each_layer_and_refused_by_name)
{
    check_word_flag("speculative", offsetof(cfg_serve, spec.speculative),
                    offsetof(cfg_generate, spec.speculative), "off", "ngram", "eagle",
                    "off, ngram, draft, mtp");
}

Test(config, draft_model_and_its_kv_cache_from_each_layer)
{
    char path[600];
    write_file("d.json", "{\"draft_model\": \"/m/small\", \"draft_kv_mib\": 32}", path,
               sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.spec.draft_model, "/m/small");
    cr_assert_eq(c.spec.draft_kv_mib, 32);
    cfg_serve_free(&c);
    cr_assert_eq(PARSE(&c, "--model", "m", "--draft-model", "/m/flag", "--config", path), QL_OK,
                 "%s", msg);
    cr_assert_str_eq(c.spec.draft_model, "/m/flag");
    cfg_serve_free(&c);
    setenv("QLSERVE_DRAFT_MODEL", "/m/env", 1);
    setenv("QLSERVE_DRAFT_KV_MIB", "8", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--draft-model", "/m/flag", "--config", path), QL_OK,
                 "%s", msg);
    cr_assert_str_eq(c.spec.draft_model, "/m/env");
    cr_assert_eq(c.spec.draft_kv_mib, 8);
    cfg_serve_free(&c);
    unsetenv("QLSERVE_DRAFT_MODEL");
    unsetenv("QLSERVE_DRAFT_KV_MIB");
    cr_assert_eq(PARSE(&c, "--model", "m", "--draft-kv-mib", "-1"), QL_EUSAGE);
    cr_assert(strstr(msg, "draft-kv-mib"), "%s", msg);
}

Test(config, file_then_flags_then_environment)
{
    char path[600];
    write_file("c.json", "{\"port\": 1111, \"host\": \"10.0.0.1\", \"max_body_bytes\": 2048}", path,
               sizeof path);
    cfg_serve c;

    /* the file alone */
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_eq(c.port, 1111);
    cr_assert_str_eq(c.host, "10.0.0.1");
    cr_assert_eq(c.max_body_bytes, 2048);
    cr_assert_str_eq(c.config_path, path);
    cfg_serve_free(&c);

    /* a flag over the file, for that field only */
    cr_assert_eq(PARSE(&c, "--port", "2222", "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_eq(c.port, 2222);
    cr_assert_str_eq(c.host, "10.0.0.1");
    cfg_serve_free(&c);

    /* the environment over both */
    setenv("QLSERVE_PORT", "3333", 1);
    setenv("QLSERVE_MAX_BODY_BYTES", "4096", 1);
    cr_assert_eq(PARSE(&c, "--port", "2222", "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_eq(c.port, 3333);
    cr_assert_eq(c.max_body_bytes, 4096);
    cr_assert_str_eq(c.host, "10.0.0.1");
    cfg_serve_free(&c);
}

Test(config, strings_outlive_the_file_and_the_environment)
{
    char path[600];
    write_file("c.json", "{\"adapter-dir\": \"/srv/adapters\"}", path, sizeof path);
    setenv("QLSERVE_SERVED_MODEL_NAME", "alpha", 1);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    remove(path);
    setenv("QLSERVE_SERVED_MODEL_NAME", "omega", 1);
    cr_assert_str_eq(c.adapter_dir, "/srv/adapters");
    cr_assert_str_eq(c.served_model_name, "alpha");
    cfg_serve_free(&c);
    cr_assert_null(c.owned_);
}

Test(config, config_file_from_the_environment)
{
    char path[600];
    write_file("c.json", "{\"model\": \"from-file\", \"kv-mib\": 32, \"quantize_lm_head\": true}",
               path, sizeof path);
    setenv("QLSERVE_CONFIG", path, 1);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--threads", "2"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.model.path, "from-file");
    cr_assert_eq(c.kv_mib, 32);
    cr_assert(c.model.quantize_lm_head);
    cr_assert_str_eq(c.config_path, path);
    cfg_serve_free(&c);
}

Test(config, boolean_from_the_environment_overrides_the_flag)
{
    cfg_serve c;
    setenv("QLSERVE_QUANTIZE_LM_HEAD", "false", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--quantize-lm-head"), QL_OK, "%s", msg);
    cr_assert(!c.model.quantize_lm_head);
    cfg_serve_free(&c);
    setenv("QLSERVE_QUANTIZE_LM_HEAD", "maybe", 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_QUANTIZE_LM_HEAD=maybe");
}

Test(config, bad_port_named_in_the_flag)
{
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--port", "70000"), QL_EUSAGE);
    ASSERT_MSG_HAS("--port 70000");
    ASSERT_MSG_HAS("65535");
    cr_assert_eq(PARSE(&c, "--model", "m", "--port", "80x"), QL_EUSAGE);
    ASSERT_MSG_HAS("--port 80x: not an integer");
}

Test(config, bad_port_named_in_the_file)
{
    char path[600], want[700];
    write_file("c.json", "{\"port\": 70000}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    snprintf(want, sizeof want, "config file %s: \"port\": 70000", path);
    ASSERT_MSG_HAS(want);
    ASSERT_MSG_HAS("65535");
}

Test(config, bad_port_named_in_the_environment)
{
    cfg_serve c;
    setenv("QLSERVE_PORT", "-1", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--port", "80"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_PORT=-1");
    setenv("QLSERVE_PORT", "eighty", 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_PORT=eighty: not an integer");
}

Test(config, a_bad_file_value_overridden_is_still_refused_only_if_kept)
{
    /* range is checked on the final value: a flag can fix a file's value */
    char path[600];
    write_file("c.json", "{\"port\": 70000}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path, "--port", "81"), QL_OK, "%s", msg);
    cr_assert_eq(c.port, 81);
    cfg_serve_free(&c);
}

Test(config, ranges_refused)
{
    static const struct {
        const char *flag, *value, *want;
    } cases[] = {
        {"--max-body-bytes", "1023", "--max-body-bytes 1023: out of range"},
        {"--max-body-bytes", "2147483648", "--max-body-bytes 2147483648: out of range"},
        {"--max-header-bytes", "2097152", "--max-header-bytes 2097152: out of range"},
        {"--request-timeout-ms", "0", "--request-timeout-ms 0: out of range"},
        {"--keepalive-timeout-ms", "0", "--keepalive-timeout-ms 0: out of range"},
        {"--grace-ms", "-1", "--grace-ms -1: out of range"},
        {"--kv-mib", "0", "--kv-mib 0: out of range"},
        {"--max-running", "0", "--max-running 0: out of range"},
        {"--step-budget-ms", "-1", "--step-budget-ms -1: out of range"},
        {"--max-prefill-per-step", "-1", "--max-prefill-per-step -1: out of range"},
        {"--min-prefill-per-step", "0", "--min-prefill-per-step 0: out of range"},
        {"--max-new-tokens", "0", "--max-new-tokens 0: out of range"},
        {"--max-connections", "0", "--max-connections 0: out of range"},
        {"--threads", "-2", "--threads -2: out of range"},
        {"--merge-threads", "0", "--merge-threads 0: out of range"},
        {"--adapter-budget-mib", "-5", "--adapter-budget-mib -5: out of range"},
        {"--host", "", "--host \"\": must not be empty"},
        {"--host", "a b", "--host a b: not a host name"},
        {"--adapter-dir", "", "--adapter-dir \"\": must not be empty"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        cfg_serve c;
        char *args[] = {"serve", "--model", "m", (char *)cases[i].flag, (char *)cases[i].value};
        cr_assert_eq(cfg_parse_serve(5, args, &c, msg, sizeof msg), QL_EUSAGE, "%s %s",
                     cases[i].flag, cases[i].value);
        ASSERT_MSG_HAS(cases[i].want);
    }
}

Test(config, model_required)
{
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--port", "1"), QL_EUSAGE);
    ASSERT_MSG_HAS("--model");
    ASSERT_MSG_HAS("QLSERVE_MODEL");
}

Test(config, unknown_key_refused)
{
    char path[600], want[700];
    write_file("c.json", "{\"port\": 1, \"prot\": 2}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    snprintf(want, sizeof want, "config file %s: unknown key \"prot\"", path);
    ASSERT_MSG_HAS(want);
}

Test(config, wrong_type_refused)
{
    char path[600], want[700];
    write_file("c.json", "{\"port\": \"8080\"}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    snprintf(want, sizeof want, "config file %s: \"port\" must be an integer, not a string", path);
    ASSERT_MSG_HAS(want);

    write_file("c.json", "{\"max_running\": 2.5}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"max_running\" must be an integer, not the number 2.5");

    write_file("c.json", "{\"host\": 5}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"host\" must be a string, not the number 5");

    write_file("c.json", "{\"quantize-lm-head\": 1}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"quantize-lm-head\" must be true or false, not the number 1");

    write_file("c.json", "{\"port\": 1e12}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"port\": 1000000000000: out of range");
}

Test(config, nested_value_refused)
{
    char path[600];
    write_file("c.json", "{\"host\": {\"name\": \"x\"}}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"host\" must be a string, not an object (nested values are not allowed)");
    ASSERT_MSG_HAS(path);
    write_file("c.json", "{\"port\": [1]}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("not an array (nested values are not allowed)");
}

Test(config, file_must_be_a_json_object)
{
    char path[600];
    cfg_serve c;
    write_file("c.json", "{\"port\": 1,\n \"host\" \"x\"}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("not valid JSON (line 2");
    write_file("c.json", "[1, 2]", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("must be a JSON object");
    write_file("c.json", "{\"port\": 1, \"port\": 2}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("both set port");
    write_file("c.json", "{\"max-body-bytes\": 2048, \"max_body_bytes\": 4096}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("both set max-body-bytes");
    write_file("c.json", "{\"config\": \"other.json\"}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("cannot name another");
}

Test(config, missing_config_file_named)
{
    char path[600];
    snprintf(path, sizeof path, "%s/nope.json", dir);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("--config");
    ASSERT_MSG_HAS(path);
    ASSERT_MSG_HAS("No such file");
    setenv("QLSERVE_CONFIG", path, 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_CONFIG=");
}

Test(config, admin_token_in_the_file_refused)
{
    char path[600];
    write_file("c.json", "{\"admin_token\": \"hunter2\"}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"admin_token\" is refused");
    ASSERT_MSG_HAS("secret");
    ASSERT_MSG_HAS("admin-token-file");
    cr_assert_null(strstr(msg, "hunter2"), "the message shows the secret: %s", msg);
}

Test(config, token_file_trailing_newline_stripped)
{
    char path[600];
    cfg_serve c;
    write_file("token", "s3cret-token\n", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.admin_token, "s3cret-token");
    cfg_serve_free(&c);

    /* CRLF and trailing blanks; only the first line counts */
    write_file("token", "abc123 \t\r\nsecond line\n", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.admin_token, "abc123");
    cfg_serve_free(&c);
}

Test(config, token_file_from_the_config_file)
{
    char token[600], path[600], json[1400];
    write_file("token", "from-config-file", token, sizeof token);
    snprintf(json, sizeof json, "{\"admin_token_file\": \"%s\"}", token);
    write_file("c.json", json, path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.admin_token, "from-config-file");
    cfg_serve_free(&c);
}

Test(config, missing_token_file_refused)
{
    char path[600];
    snprintf(path, sizeof path, "%s/no-token", dir);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS("--admin-token-file");
    ASSERT_MSG_HAS(path);
    ASSERT_MSG_HAS("No such file");
}

/* An admin token the server could never match (a request's Authorization
 * header holds "Bearer " and CFG_SECRET_MAX bytes) is refused at start,
 * naming the file and the length; CFG_SECRET_MAX bytes are fine. */
Test(config, admin_token_longer_than_the_header_takes_refused)
{
    char path[600], token[602];
    memset(token, 't', 600);
    token[600] = '\n';
    token[601] = 0;
    write_file("token", token, path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS("--admin-token-file");
    ASSERT_MSG_HAS(path);
    ASSERT_MSG_HAS("600 bytes");
    ASSERT_MSG_HAS("at most 256");
    cr_assert_null(strstr(msg, "tttt"), "the message shows the token: %s", msg);
    token[CFG_SECRET_MAX] = 0;
    write_file("token", token, path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_OK, "%s", msg);
    cr_assert_eq(strlen(c.admin_token), CFG_SECRET_MAX);
    cfg_serve_free(&c);
    token[CFG_SECRET_MAX] = 't';
    token[CFG_SECRET_MAX + 1] = 0;
    setenv("QLSERVE_ADMIN_TOKEN", token, 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_ADMIN_TOKEN: the admin token is 257 bytes");
    unsetenv("QLSERVE_ADMIN_TOKEN");
}

/* --allowed-hosts takes Host values (name, name:port, [v6]:port, *), not
 * URLs; --state-dir is a path like any other. */
Test(config, allowed_hosts_and_state_dir)
{
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_OK, "%s", msg);
    cr_assert_null(c.allowed_hosts);
    cr_assert_null(c.state_dir);
    cfg_serve_free(&c);
    cr_assert_eq(PARSE(&c, "--model", "m", "--allowed-hosts",
                       "proxy.example, localhost:9000,[::1]:80", "--state-dir", "/var/lib/qlserve"),
                 QL_OK, "%s", msg);
    cr_assert_str_eq(c.allowed_hosts, "proxy.example, localhost:9000,[::1]:80");
    cr_assert_str_eq(c.state_dir, "/var/lib/qlserve");
    cfg_serve_free(&c);
    char bad[][32] = {"http://proxy.example", "proxy.example/v1", "a,,b", "*.example"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_eq(PARSE(&c, "--model", "m", "--allowed-hosts", bad[i]), QL_EUSAGE, "%s", bad[i]);
        ASSERT_MSG_HAS("--allowed-hosts");
        ASSERT_MSG_HAS("not a Host header's value");
    }
}

Test(config, empty_token_file_refused)
{
    char path[600];
    cfg_serve c;
    write_file("token", "", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS(path);
    ASSERT_MSG_HAS("empty");
    write_file("token", "\n\nlater\n", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS("empty");
}

Test(config, token_with_a_space_refused_without_showing_it)
{
    char path[600];
    cfg_serve c;
    write_file("token", "open sesame\n", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS("space or control character");
    cr_assert_null(strstr(msg, "sesame"), "the message shows the secret: %s", msg);
}

Test(config, token_from_the_environment)
{
    char path[600];
    write_file("token", "from-file\n", path, sizeof path);
    setenv("QLSERVE_ADMIN_TOKEN", "from-env", 1);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token-file", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.admin_token, "from-env");
    cfg_serve_free(&c);

    setenv("QLSERVE_ADMIN_TOKEN", "", 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_ADMIN_TOKEN: the admin token is empty");

    setenv("QLSERVE_ADMIN_TOKEN", "x", 1);
    setenv("QLSERVE_ADMIN_TOKEN_FILE", path, 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("both set");
}

Test(config, help_wins_over_a_broken_config_file)
{
    char path[600];
    write_file("c.json", "{not json", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--config", path, "--help"), QL_EHELP);
}

Test(config, unknown_flag_named)
{
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--admin-token", "x"), QL_EUSAGE);
    ASSERT_MSG_HAS("unknown flag '--admin-token'");
}

static char *usage_of(const char *sub)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert(f);
    cfg_print_usage(f, sub);
    fclose(f);
    return text;
}

Test(config, help_lists_every_flag_with_its_forms)
{
    static const char *const flags[] = {"model",
                                        "quant",
                                        "blocksize",
                                        "group-size",
                                        "quantize-lm-head",
                                        "dtype",
                                        "host",
                                        "port",
                                        "adapter-dir",
                                        "admin-token-file",
                                        "config",
                                        "served-model-name",
                                        "threads",
                                        "kv-mib",
                                        "max-running",
                                        "max-queued",
                                        "max-new-tokens",
                                        "max-held-bytes",
                                        "max-context",
                                        "max-connections",
                                        "max-body-bytes",
                                        "max-header-bytes",
                                        "request-timeout-ms",
                                        "keepalive-timeout-ms",
                                        "grace-ms",
                                        "adapter-budget-mib",
                                        "adapter-dtype",
                                        "activations",
                                        "merge-threads"};
    char *text = usage_of("serve");
    for (size_t i = 0; i < sizeof flags / sizeof *flags; i++) {
        char want[128], env[128];
        snprintf(want, sizeof want, "--%s ", flags[i]);
        cr_assert(strstr(text, want), "no %s in:\n%s", want, text);
        snprintf(env, sizeof env, "QLSERVE_%s", flags[i]);
        for (char *c = env; *c; c++)
            *c = *c == '-' ? '_' : (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
        cr_assert(strstr(text, env), "no %s in:\n%s", env, text);
        if (strcmp(flags[i], "config") != 0) {
            snprintf(want, sizeof want, "config \"%s\"", flags[i]);
            cr_assert(strstr(text, want), "no %s in:\n%s", want, text);
        }
    }
    cr_assert(strstr(text, "QLSERVE_ADMIN_TOKEN:"));
    cr_assert(strstr(text, "(default 8080)"));
    cr_assert(strstr(text, "(default 127.0.0.1)"));
    cr_assert(strstr(text, "(default 1048576)"));
    free(text);

    text = usage_of(NULL);
    cr_assert(strstr(text, "  serve "), "%s", text);
    free(text);
}

Test(config, free_leaves_a_hand_built_struct_alone)
{
    cfg_serve c = {.host = "127.0.0.1", .port = 0};
    cfg_serve_free(&c);
    cfg_serve_free(NULL);
    cr_assert_str_eq(c.host, "127.0.0.1");
}

/* --- the API key and CORS ------------------------------------------------------------ */

Test(config, api_key_from_its_file_the_config_file_or_the_environment)
{
    char key[600], path[600], json[1400];
    cfg_serve c;
    write_file("key", "sk-from-file \r\nsecond line\n", key, sizeof key);
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", key), QL_OK, "%s", msg);
    cr_assert_str_eq(c.api_key, "sk-from-file");
    cr_assert_null(c.admin_token);
    cfg_serve_free(&c);

    snprintf(json, sizeof json, "{\"api_key_file\": \"%s\"}", key);
    write_file("c.json", json, path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.api_key, "sk-from-file");
    cfg_serve_free(&c);

    setenv("QLSERVE_API_KEY", "sk-from-env", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", key), QL_OK, "%s", msg);
    cr_assert_str_eq(c.api_key, "sk-from-env");
    cfg_serve_free(&c);
    unsetenv("QLSERVE_API_KEY");

    setenv("QLSERVE_API_KEY_FILE", key, 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.api_key, "sk-from-file");
    cfg_serve_free(&c);
    setenv("QLSERVE_API_KEY", "x", 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_API_KEY and QLSERVE_API_KEY_FILE are both set");
}

Test(config, bad_api_key_files_refused_by_name_without_showing_the_key)
{
    char path[600];
    cfg_serve c;
    static const struct {
        const char *text, *needle;
    } bad[] = {
        {"", "the file is empty; its first line must be the API key"},
        {"\nsk-on-line-two\n", "the API key is empty"},
        {"sk-bad\x07key\n", "the API key holds a space or control character"},
        {"sk bad key\n", "the API key holds a space or control character"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_file("key", bad[i].text, path, sizeof path);
        cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", path), QL_EUSAGE, "%zu", i);
        ASSERT_MSG_HAS("--api-key-file");
        ASSERT_MSG_HAS(path);
        ASSERT_MSG_HAS(bad[i].needle);
        cr_assert_null(strstr(msg, "sk-"), "the message shows the key: %s", msg);
    }
    snprintf(path, sizeof path, "%s/no-key", dir);
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS(path);
    ASSERT_MSG_HAS("cannot read the API key: No such file");

    /* one byte over CFG_SECRET_MAX; exactly CFG_SECRET_MAX is fine */
    char key[CFG_SECRET_MAX + 2];
    memset(key, 'k', sizeof key);
    key[CFG_SECRET_MAX + 1] = 0;
    write_file("key", key, path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS("at most 256");
    key[CFG_SECRET_MAX] = 0;
    write_file("key", key, path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", path), QL_OK, "%s", msg);
    cr_assert_eq(strlen(c.api_key), CFG_SECRET_MAX);
    cfg_serve_free(&c);

    setenv("QLSERVE_API_KEY", "", 1);
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("QLSERVE_API_KEY: the API key is empty");
}

Test(config, api_key_in_the_config_file_refused)
{
    char path[600];
    write_file("c.json", "{\"api-key\": \"sk-hunter2\"}", path, sizeof path);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS("\"api-key\" is refused");
    ASSERT_MSG_HAS("api-key-file");
    ASSERT_MSG_HAS("QLSERVE_API_KEY");
    cr_assert_null(strstr(msg, "hunter2"), "the message shows the secret: %s", msg);
}

Test(config, an_api_key_equal_to_the_admin_token_refused)
{
    char path[600];
    write_file("key", "same-secret\n", path, sizeof path);
    setenv("QLSERVE_ADMIN_TOKEN", "same-secret", 1);
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", path), QL_EUSAGE);
    ASSERT_MSG_HAS("the API key and the admin token are the same");
    cr_assert_null(strstr(msg, "same-secret"), "%s", msg);
    setenv("QLSERVE_ADMIN_TOKEN", "other-secret", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--api-key-file", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.api_key, "same-secret");
    cr_assert_str_eq(c.admin_token, "other-secret");
    cfg_serve_free(&c);
}

Test(config, cors_origins_from_every_layer_and_checked)
{
    char path[600];
    cfg_serve c;
    cr_assert_eq(PARSE(&c, "--model", "m"), QL_OK, "%s", msg);
    cr_assert_null(c.cors_allow_origin);
    cfg_serve_free(&c);
    cr_assert_eq(PARSE(&c, "--model", "m", "--cors-allow-origin",
                       "https://a.example, http://localhost:5173,*"),
                 QL_OK, "%s", msg);
    cr_assert_str_eq(c.cors_allow_origin, "https://a.example, http://localhost:5173,*");
    cfg_serve_free(&c);
    write_file("c.json", "{\"cors_allow_origin\": \"https://from-file.example\"}", path,
               sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.cors_allow_origin, "https://from-file.example");
    cfg_serve_free(&c);
    setenv("QLSERVE_CORS_ALLOW_ORIGIN", "*", 1);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_OK, "%s", msg);
    cr_assert_str_eq(c.cors_allow_origin, "*");
    cfg_serve_free(&c);
    unsetenv("QLSERVE_CORS_ALLOW_ORIGIN");

    static char *bad[] = {"https://a.example/",
                          "https://a.example/app",
                          "null",
                          "a.example",
                          "https://",
                          "ftp://a",
                          "https://a.example,",
                          ",https://a.example",
                          "https://*.a"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_eq(PARSE(&c, "--model", "m", "--cors-allow-origin", bad[i]), QL_EUSAGE, "%s",
                     bad[i]);
        ASSERT_MSG_HAS("--cors-allow-origin");
        ASSERT_MSG_HAS("is not an origin");
    }
    write_file("c.json", "{\"cors-allow-origin\": \"https://x.example/\"}", path, sizeof path);
    cr_assert_eq(PARSE(&c, "--model", "m", "--config", path), QL_EUSAGE);
    ASSERT_MSG_HAS(path);
    ASSERT_MSG_HAS("\"https://x.example/\" is not an origin");
}

Test(config, help_names_the_api_key_and_cors_forms)
{
    char *text = usage_of("serve");
    static const char *const wanted[] = {
        "--api-key-file ",      "config \"api-key-file\"", "QLSERVE_API_KEY_FILE",
        "env QLSERVE_API_KEY:", "--cors-allow-origin ",    "QLSERVE_CORS_ALLOW_ORIGIN"};
    for (size_t i = 0; i < sizeof wanted / sizeof *wanted; i++)
        cr_assert(strstr(text, wanted[i]), "no %s in:\n%s", wanted[i], text);
    free(text);
}

/* cfg_parse_tokenize over a NULL-terminated argv */
static int parse_tokenize(cfg_tokenize *out, char **args)
{
    int argc = 0;
    while (args[argc])
        argc++;
    return cfg_parse_tokenize(argc, args, out, msg, sizeof msg);
}

#define PARSE_TOKENIZE(out, ...) parse_tokenize((out), (char *[]){"tokenize", __VA_ARGS__, NULL})

/* "--" ends the options: a text that starts with "-" (or is "--help")
 * after it is the text, flags before it still count, and one "--" more is
 * text too; without it such a text is an unknown flag, as before. */
Test(config, tokenize_takes_double_dash_as_the_end_of_options)
{
    cfg_tokenize c;
    cr_assert_eq(PARSE_TOKENIZE(&c, "--model", "m", "--json", "--", "--x y"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.text, "--x y");
    cr_assert_str_eq(c.model, "m");
    cr_assert(c.json);
    cr_assert_eq(PARSE_TOKENIZE(&c, "--model", "m", "--", "--help"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.text, "--help");
    cr_assert_eq(PARSE_TOKENIZE(&c, "--model", "m", "--", "--"), QL_OK, "%s", msg);
    cr_assert_str_eq(c.text, "--");
    cr_assert_eq(PARSE_TOKENIZE(&c, "--", "-h", "--model", "m"), QL_EUSAGE);
    ASSERT_MSG_HAS("unexpected argument '--model'");
    cr_assert_eq(PARSE_TOKENIZE(&c, "--model", "m", "--x"), QL_EUSAGE);
    ASSERT_MSG_HAS("unknown flag '--x'");
    cr_assert_eq(PARSE_TOKENIZE(&c, "--model", "m", "--"), QL_EUSAGE);
    ASSERT_MSG_HAS("[--] TEXT");
}

/*
 * test_chat_source.c - where a loaded model's chat templates come from:
 * tokenizer_config.json (a string, a list of named templates),
 * chat_template.jinja beside it (which wins, as in transformers),
 * additional_chat_templates/tool_use.jinja, GGUF metadata, the
 * --chat-template override, an adapter folder's own template, and the
 * refusals (too large, not UTF-8, a NUL byte, a wrong type).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];
static char model_dir[600];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(model_dir, sizeof model_dir, "%s/model", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
    tiny_spec s = tiny_default();
    tiny_write_hf(model_dir, &s);
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(chat_source, .init = setup, .fini = teardown);

/* Write text (len bytes) to folder/name. */
static void write_bytes(const char *folder, const char *name, const char *text, size_t len)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", folder, name);
    test_write_bytes(path, text, len);
}

static void write_text(const char *folder, const char *name, const char *text)
{
    write_bytes(folder, name, text, strlen(text));
}

static int load(eng_model *m, const char *path, const char *override, char *msg, size_t msg_len)
{
    eng_load_opts o = {.path = path, .chat_template = override};
    return eng_model_load(m, &o, msg, msg_len);
}

static void load_ok(eng_model *m, const char *path, const char *override)
{
    char msg[1024];
    int rc = load(m, path, override, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s", msg);
}

Test(chat_source, a_folder_without_a_template_has_none)
{
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_null(m.chat_template);
    cr_assert_null(m.chat_template_tool_use);
    eng_model_free(&m);
}

Test(chat_source, tokenizer_config_string_is_the_template)
{
    write_text(model_dir, "tokenizer_config.json",
               "{\"bos_token\": null, \"chat_template\": \"{% for m in messages %}{{ "
               "m['content'] }}\\n{% endfor %}\"}");
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_str_eq(m.chat_template, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}");
    cr_assert_null(m.chat_template_tool_use);
    eng_model_free(&m);
}

Test(chat_source, tokenizer_config_null_template_is_none)
{
    write_text(model_dir, "tokenizer_config.json", "{\"chat_template\": null}");
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_null(m.chat_template);
    eng_model_free(&m);
}

Test(chat_source, named_templates_give_default_and_tool_use)
{
    /* the list form transformers saves when a tokenizer has several (Hermes,
     * Command R): "default" serves, "tool_use" is kept, others ignored */
    write_text(model_dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"rag\", \"template\": \"R\"}, {\"name\": "
               "\"tool_use\", \"template\": \"T{{ tools }}\"}, {\"name\": \"default\", "
               "\"template\": \"D\\u00e9\"}]}");
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_str_eq(m.chat_template, "D\xc3\xa9");
    cr_assert_str_eq(m.chat_template_tool_use, "T{{ tools }}");
    eng_model_free(&m);
}

Test(chat_source, named_templates_without_default_have_no_default)
{
    write_text(model_dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}");
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_null(m.chat_template);
    cr_assert_str_eq(m.chat_template_tool_use, "T");
    eng_model_free(&m);
}

Test(chat_source, chat_template_jinja_wins_over_the_config)
{
    /* transformers' test_chat_template_file_priority: the file clobbers the
     * config's template, named ones included */
    write_text(model_dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"default\", \"template\": \"config\"}, "
               "{\"name\": \"tool_use\", \"template\": \"config tools\"}]}");
    write_text(model_dir, "chat_template.jinja", "{{ bos_token }}file\n");
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_str_eq(m.chat_template, "{{ bos_token }}file\n");
    cr_assert_null(m.chat_template_tool_use);
    eng_model_free(&m);
}

Test(chat_source, chat_template_jinja_alone_and_additional_templates)
{
    write_text(model_dir, "chat_template.jinja", "J");
    char extra[700];
    snprintf(extra, sizeof extra, "%s/additional_chat_templates", model_dir);
    cr_assert_eq(mkdir(extra, 0700), 0);
    write_text(extra, "tool_use.jinja", "JT");
    write_text(extra, "rag.jinja", "JR");
    eng_model m;
    load_ok(&m, model_dir, NULL);
    cr_assert_str_eq(m.chat_template, "J");
    cr_assert_str_eq(m.chat_template_tool_use, "JT");
    eng_model_free(&m);
}

Test(chat_source, override_replaces_the_models_templates)
{
    write_text(model_dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"default\", \"template\": \"config\"}, "
               "{\"name\": \"tool_use\", \"template\": \"config tools\"}]}");
    write_text(dir, "mine.jinja", "mine {{ messages }}");
    char path[700];
    snprintf(path, sizeof path, "%s/mine.jinja", dir);
    eng_model m;
    load_ok(&m, model_dir, path);
    cr_assert_str_eq(m.chat_template, "mine {{ messages }}");
    cr_assert_null(m.chat_template_tool_use);
    eng_model_free(&m);
}

Test(chat_source, override_file_missing_is_refused_by_name)
{
    char path[700], msg[1024];
    snprintf(path, sizeof path, "%s/nope.jinja", dir);
    eng_model m;
    cr_assert_eq(load(&m, model_dir, path, msg, sizeof msg), QL_ENOTFOUND);
    cr_assert(strstr(msg, "nope.jinja"), "%s", msg);
    cr_assert_null(m.chat_template);
}

Test(chat_source, a_template_over_one_mib_is_refused)
{
    size_t n = ENG_CHAT_TEMPLATE_MAX_BYTES + 1;
    char *big = malloc(n);
    cr_assert(big);
    memset(big, 'x', n);
    write_bytes(model_dir, "chat_template.jinja", big, n);
    char msg[1024];
    eng_model m;
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "chat_template.jinja") && strstr(msg, "1048576"), "%s", msg);
    /* exactly the limit is taken */
    write_bytes(model_dir, "chat_template.jinja", big, n - 1);
    load_ok(&m, model_dir, NULL);
    cr_assert_eq(strlen(m.chat_template), n - 1);
    eng_model_free(&m);
    /* and the same limit in tokenizer_config.json */
    remove(strcat(strcpy(big, model_dir), "/chat_template.jinja"));
    char *json = malloc(n + 64);
    cr_assert(json);
    int head = snprintf(json, 64, "{\"chat_template\": \"");
    memset(json + head, 'y', n);
    strcpy(json + head + n, "\"}");
    write_text(model_dir, "tokenizer_config.json", json);
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "tokenizer_config.json: \"chat_template\"") && strstr(msg, "1048577"),
              "%s", msg);
    free(json);
    free(big);
}

Test(chat_source, bad_templates_are_refused_by_what_is_wrong)
{
    char msg[1024];
    eng_model m;
    write_bytes(model_dir, "chat_template.jinja", "ab\0c", 4);
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "NUL byte at 2"), "%s", msg);
    write_bytes(model_dir, "chat_template.jinja", "ok\xff", 3);
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "not valid UTF-8 (byte 2)"), "%s", msg);
    remove(strcat(strcpy(msg, model_dir), "/chat_template.jinja"));
    write_text(model_dir, "tokenizer_config.json", "{\"chat_template\": 7}");
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "neither a string nor a list"), "%s", msg);
    write_text(model_dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"default\"}]}");
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "\"chat_template\"[0]"), "%s", msg);
    write_text(model_dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"default\", \"template\": \"a\"}, {\"name\": "
               "\"default\", \"template\": \"b\"}]}");
    cr_assert_eq(load(&m, model_dir, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "names \"default\" twice"), "%s", msg);
}

Test(chat_source, gguf_metadata_templates)
{
    char path[700];
    snprintf(path, sizeof path, "%s/t.gguf", dir);
    tiny_spec s = tiny_default();
    const char *meta[] = {"tokenizer.chat_template", "G{{ messages[0].content }}",
                          "tokenizer.chat_template.tool_use", "GT", NULL};
    tiny_write_gguf_meta(path, &s, QT_F32, meta);
    eng_model m;
    load_ok(&m, path, NULL);
    cr_assert_str_eq(m.chat_template, "G{{ messages[0].content }}");
    cr_assert_str_eq(m.chat_template_tool_use, "GT");
    eng_model_free(&m);
    /* the override wins over the GGUF's too */
    write_text(dir, "o.jinja", "O");
    char over[700];
    snprintf(over, sizeof over, "%s/o.jinja", dir);
    load_ok(&m, path, over);
    cr_assert_str_eq(m.chat_template, "O");
    cr_assert_null(m.chat_template_tool_use);
    eng_model_free(&m);
    /* and a GGUF without one has none */
    tiny_write_gguf(path, &s, QT_F32);
    load_ok(&m, path, NULL);
    cr_assert_null(m.chat_template);
    eng_model_free(&m);
}

Test(chat_source, gguf_template_not_utf8_is_refused_by_key)
{
    char path[700], msg[1024];
    snprintf(path, sizeof path, "%s/t.gguf", dir);
    tiny_spec s = tiny_default();
    const char *meta[] = {"tokenizer.chat_template.tool_use", "\xc3(", NULL};
    tiny_write_gguf_meta(path, &s, QT_F32, meta);
    eng_model m;
    cr_assert_eq(load(&m, path, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "metadata tokenizer.chat_template.tool_use") &&
                  strstr(msg, "not valid UTF-8"),
              "%s", msg);
}

Test(chat_source, gguf_template_over_one_mib_is_refused)
{
    char path[700], msg[1024];
    snprintf(path, sizeof path, "%s/t.gguf", dir);
    size_t n = ENG_CHAT_TEMPLATE_MAX_BYTES + 1;
    char *big = malloc(n + 1);
    cr_assert(big);
    memset(big, 'g', n);
    big[n] = 0;
    tiny_spec s = tiny_default();
    const char *meta[] = {"tokenizer.chat_template", big, NULL};
    tiny_write_gguf_meta(path, &s, QT_F32, meta);
    free(big);
    eng_model m;
    cr_assert_eq(load(&m, path, NULL, msg, sizeof msg), QL_EFORMAT);
    cr_assert(strstr(msg, "metadata tokenizer.chat_template") && strstr(msg, "1048577"), "%s", msg);
}

/* An adapter folder for the tiny model at model_dir (loaded into *m). */
static void write_adapter(const eng_model *m, const char *adir)
{
    cr_assert_eq(mkdir(adir, 0700), 0);
    lora_fix_spec s = lora_fix_default();
    lora_fix_write(adir, &m->cfg, &s);
}

Test(chat_source, adapter_carries_its_own_template)
{
    eng_model m;
    write_text(model_dir, "tokenizer_config.json", "{\"chat_template\": \"base\"}");
    load_ok(&m, model_dir, NULL);
    char adir[700], msg[1024];
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    write_adapter(&m, adir);
    eng_lora *plain, *tuned;
    cr_assert_eq(lora_load(&plain, NULL, adir, "plain", &m, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_null(plain->chat_template);
    /* what PEFT's save_pretrained leaves when training changed the tokenizer */
    write_text(adir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"default\", \"template\": \"tuned\"}, "
               "{\"name\": \"tool_use\", \"template\": \"tuned tools\"}]}");
    cr_assert_eq(lora_load(&tuned, NULL, adir, "tuned", &m, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(tuned->chat_template, "tuned");
    cr_assert_str_eq(tuned->chat_template_tool_use, "tuned tools");
    cr_assert_gt(tuned->bytes, plain->bytes);
    /* transformers 5 writes chat_template.jinja; it wins there too */
    write_text(adir, "chat_template.jinja", "jinja");
    eng_lora *j;
    cr_assert_eq(lora_load(&j, NULL, adir, "j", &m, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(j->chat_template, "jinja");
    cr_assert_null(j->chat_template_tool_use);
    /* the model's own is untouched */
    cr_assert_str_eq(m.chat_template, "base");
    eng_lora_unref(plain);
    eng_lora_unref(tuned);
    eng_lora_unref(j);
    eng_model_free(&m);
}

Test(chat_source, adapter_with_a_bad_template_is_refused)
{
    eng_model m;
    load_ok(&m, model_dir, NULL);
    char adir[700], msg[1024];
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    write_adapter(&m, adir);
    write_bytes(adir, "chat_template.jinja", "\x80", 1);
    eng_lora *l = (eng_lora *)1;
    cr_assert_eq(lora_load(&l, NULL, adir, "bad", &m, msg, sizeof msg), QL_EFORMAT);
    cr_assert_null(l);
    cr_assert(strstr(msg, "adapter/chat_template.jinja"), "%s", msg);
    eng_model_free(&m);
}

Test(chat_source, read_file_refuses_a_folder_and_reads_exactly)
{
    char *t, msg[1024];
    cr_assert_neq(eng_chat_template_read_file(dir, &t, msg, sizeof msg), QL_OK);
    cr_assert_null(t);
    write_text(dir, "x.jinja", "{%- if x -%}\r\n\tok{%- endif %}");
    char path[700];
    snprintf(path, sizeof path, "%s/x.jinja", dir);
    cr_assert_eq(eng_chat_template_read_file(path, &t, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(t, "{%- if x -%}\r\n\tok{%- endif %}");
    free(t);
}

/* --- the --chat-template flag: serve (flag, config file key, environment),
 *     generate, and the help text ------------------------------------------ */

Test(chat_source, serve_takes_chat_template_from_flag_file_and_env)
{
    char *argv[] = {"serve", "--model", "/m", "--chat-template", "/flag.jinja"};
    cfg_serve c;
    char msg[1024];
    cr_assert_eq(cfg_parse_serve(5, argv, &c, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(c.model.chat_template, "/flag.jinja");
    cfg_serve_free(&c);

    char cfg_path[700];
    snprintf(cfg_path, sizeof cfg_path, "%s/c.json", dir);
    write_text(dir, "c.json", "{\"model\": \"/m\", \"chat_template\": \"/file.jinja\"}");
    char *argv2[] = {"serve", "--config", cfg_path};
    cr_assert_eq(cfg_parse_serve(3, argv2, &c, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(c.model.chat_template, "/file.jinja");
    cfg_serve_free(&c);

    setenv("QLSERVE_CHAT_TEMPLATE", "/env.jinja", 1);
    cr_assert_eq(cfg_parse_serve(5, argv, &c, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(c.model.chat_template, "/env.jinja");
    cfg_serve_free(&c);
    setenv("QLSERVE_CHAT_TEMPLATE", "", 1);
    cr_assert_eq(cfg_parse_serve(5, argv, &c, msg, sizeof msg), QL_EUSAGE);
    cr_assert(strstr(msg, "QLSERVE_CHAT_TEMPLATE") && strstr(msg, "must not be empty"), "%s", msg);
    unsetenv("QLSERVE_CHAT_TEMPLATE");

    char *argv3[] = {"serve", "--model", "/m"};
    cr_assert_eq(cfg_parse_serve(3, argv3, &c, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_null(c.model.chat_template);
    cfg_serve_free(&c);
}

Test(chat_source, generate_takes_chat_template_and_tokenize_does_not)
{
    char *argv[] = {"generate", "--model", "/m", "--prompt", "hi", "--chat-template", "/t.jinja"};
    cfg_generate g;
    char msg[1024];
    cr_assert_eq(cfg_parse_generate(7, argv, &g, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_str_eq(g.model.chat_template, "/t.jinja");
    char *argv2[] = {"tokenize", "--model", "/m", "--chat-template", "/t.jinja", "hi"};
    cfg_tokenize t;
    cr_assert_eq(cfg_parse_tokenize(6, argv2, &t, msg, sizeof msg), QL_EUSAGE);
    cr_assert(strstr(msg, "--chat-template"), "%s", msg);
}

/* cfg_print_usage(sub)'s text, as a string (the caller frees). */
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

Test(chat_source, help_lists_chat_template_for_serve_and_generate)
{
    char *serve = usage_of("serve"), *gen = usage_of("generate");
    cr_assert(strstr(serve, "--chat-template"), "%s", serve);
    cr_assert(strstr(serve, "QLSERVE_CHAT_TEMPLATE"), "%s", serve);
    cr_assert(strstr(gen, "--chat-template"), "%s", gen);
    free(serve);
    free(gen);
}

/* `qlserve inspect MODEL` says whether the model has a template, and how
 * long it is. */
static char *run_inspect(const char *path)
{
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "%s inspect %s 2>&1", QL_BINARY, path);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    static char out[8192];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    cr_assert_eq(pclose(p), 0, "%s", out);
    return out;
}

Test(chat_source, inspect_prints_the_template_and_its_length)
{
    cr_assert(strstr(run_inspect(model_dir), "chat template: none"));
    write_text(model_dir, "chat_template.jinja", "0123456789");
    const char *out = run_inspect(model_dir);
    cr_assert(strstr(out, "chat template: yes, 10 bytes\n"), "%s", out);
    char extra[700];
    snprintf(extra, sizeof extra, "%s/additional_chat_templates", model_dir);
    cr_assert_eq(mkdir(extra, 0700), 0);
    write_text(extra, "tool_use.jinja", "x");
    out = run_inspect(model_dir);
    cr_assert(strstr(out, "chat template: yes, 10 bytes; a tool_use template too"), "%s", out);
}

Test(chat_source, generate_loads_the_chat_template_flag)
{
    /* the flag reaches the loader: a missing file stops generate, naming it */
    char cmd[1600];
    snprintf(cmd, sizeof cmd,
             "%s generate --model %s --prompt hi --max-new-tokens 1 --chat-template %s/nope.jinja "
             "2>&1",
             QL_BINARY, model_dir, dir);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    char out[4096];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    cr_assert_neq(pclose(p), 0, "%s", out);
    cr_assert(strstr(out, "nope.jinja"), "%s", out);
    /* and a file that is there is taken */
    write_text(dir, "ok.jinja", "T");
    snprintf(cmd, sizeof cmd,
             "%s generate --model %s --prompt hi --max-new-tokens 1 --chat-template %s/ok.jinja "
             ">/dev/null 2>&1",
             QL_BINARY, model_dir, dir);
    cr_assert_eq(system(cmd), 0);
}

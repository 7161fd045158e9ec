/*
 * tiny_server.h - the tiny random model (tiny_model.h: byte-level
 * tokenizer, 260 tokens, <|endoftext|> 259) served by the real binary for
 * a test suite: a chat template that joins the messages' contents, a free
 * port, 2 threads, 16 MiB of KV cache (tests/server_process.h runs it).
 * ts_setup and ts_teardown (a clean stop) are a TestSuite's .init and
 * .fini (ts_start_with starts one with flags of its own); ts_ok and ts_refused the two checks every
 * such test makes.
 */
#ifndef QL_TEST_TINY_SERVER_H
#define QL_TEST_TINY_SERVER_H

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "http_client.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char ts_dir[512];
static char ts_model_dir[600];
static char ts_log_path[600];

/* The tiny model of spec served with chat_template as its
 * chat_template.jinja, patch (NULL: none) run on its folder before the
 * server starts, and the flags extra (NULL-ended; NULL: none) after the
 * usual ones. */
static inline void ts_start_spec(const char *chat_template, const tiny_spec *spec,
                                 void (*patch)(const char *model_dir), const char *const *extra)
{
    test_tmpdir(ts_dir, sizeof ts_dir);
    cr_assert(ts_dir[0]);
    snprintf(ts_model_dir, sizeof ts_model_dir, "%s/tiny", ts_dir);
    snprintf(ts_log_path, sizeof ts_log_path, "%s/server.log", ts_dir);
    cr_assert_eq(mkdir(ts_model_dir, 0700), 0);
    tiny_write_hf(ts_model_dir, spec);
    if (patch)
        patch(ts_model_dir);
    char path[700];
    snprintf(path, sizeof path, "%s/chat_template.jinja", ts_model_dir);
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    fputs(chat_template, f);
    fclose(f);
    const char *argv[32] = {QL_BINARY, "serve",     "--model", ts_model_dir, "--port",
                            "0",       "--threads", "2",       "--kv-mib",   "16"};
    size_t n = 10;
    for (size_t i = 0; extra && extra[i] && n < 31; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    sp_spawn(argv, ts_log_path);
    sp_wait_ready();
}

/* The tiny model served with chat_template as its chat_template.jinja,
 * and the flags extra (NULL-ended; NULL: none) after the usual ones. */
static inline void ts_start_with(const char *chat_template, const char *const *extra)
{
    tiny_spec spec = tiny_default();
    ts_start_spec(chat_template, &spec, NULL, extra);
}

static inline void ts_start(const char *chat_template)
{
    ts_start_with(chat_template, NULL);
}

/* The chat template ts_setup serves: the messages' contents joined. */
#define TS_JOIN_TEMPLATE "{% for m in messages %}{{ m['content'] }}{% endfor %}"

static inline void ts_setup(void)
{
    ts_start(TS_JOIN_TEMPLATE);
}

/* The end of each test: SIGTERM drains the server, which must exit 0 with
 * no sanitizer report in its log (a leak in a build with QL_SANITIZE
 * shows there); a test that failed before leaves it killed. */
static inline void ts_teardown(void)
{
    if (sp.pid > 0)
        sp_stop_cleanly();
    test_rmtree(ts_dir);
}

/* POST body to path; the parsed 200 answer (the caller's to cJSON_Delete). */
static inline cJSON *ts_ok(const char *path, const char *body)
{
    int status;
    char *text = sp_answer(path, body, &status);
    cr_assert_eq(status, 200, "%s -> %d %s", body, status, text);
    cJSON *j = sp_json(text);
    free(text);
    return j;
}

/* POST body to path: a 400 whose message holds needle. */
static inline void ts_refused(const char *path, const char *body, const char *needle)
{
    int got;
    char *text = sp_answer(path, body, &got);
    cr_assert_eq(got, 400, "%s -> %d %s", body, got, text);
    cJSON *j = sp_json(text);
    const char *message = sp_str_at(cJSON_GetObjectItem(j, "error"), "message");
    cr_assert(strstr(message, needle), "%s -> %s (wanted \"%s\")", body, message, needle);
    cJSON_Delete(j);
    free(text);
}

/* A stream's events' data, in order (chat's unnamed events, and the
 * named ones of Anthropic's and OpenAI's newer APIs; [DONE] left out). */
typedef struct ts_events {
    int n;
    cJSON *data[512];
} ts_events;

/* POST body to path, a stream: its events, read to its end. */
static inline void ts_events_of(const char *path, const char *body, ts_events *ev)
{
    hc_response r = sp_post(path, body);
    cr_assert_eq(r.status, 200, "%s -> %d %s", body, r.status, r.body);
    ev->n = 0;
    for (char *at = r.body; at && *at;) {
        char *end = strstr(at, "\n\n");
        cr_assert(end, "an event without its blank line: %s", at);
        *end = 0;
        char *data = strncmp(at, "data: ", 6) == 0 ? at : strstr(at, "\ndata: ") + 1;
        if (strcmp(data + 6, "[DONE]") != 0) {
            cr_assert_lt(ev->n, 512);
            ev->data[ev->n++] = sp_json(data + 6);
        }
        at = end + 2;
    }
    hc_response_free(&r);
}

static inline void ts_events_free(ts_events *ev)
{
    for (int i = 0; i < ev->n; i++)
        cJSON_Delete(ev->data[i]);
}

#endif

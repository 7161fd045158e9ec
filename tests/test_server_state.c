/*
 * test_server_state.c - the adapter registry's state survives a restart:
 * the real binary on the tiny model (tests/tiny_model.h) with an adapter
 * folder, stopped with SIGTERM and started again on the same state file
 * (--state-file, by default state.json under the server's state
 * directory, never the adapter folder; sp_spawn points it into the test's
 * own folder).
 *
 * Pinned: after a restart /admin/adapters lists the same adapters with the
 * same scales, /admin/state shows the same weights_digest and merged list,
 * and a greedy /generate gives the same text, for the merged adapter, the
 * other one and the base; the journal is valid JSON naming what is loaded
 * and merged after every change; an adapter whose folder is gone is
 * reported by name (log and /admin/state's restore_errors) and the rest
 * come back; a state file that does not parse is reported and kept aside
 * as FILE.bad; a journal that cannot be written leaves the change standing,
 * says so in state_file_error and is written at the next change; an
 * explicit state file in a folder that is not there stops the server at
 * start, an unusable default only warns; --state-file none writes nothing.
 */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "http_client.h"
#include "lora_fixture.h"
#include "server.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512], model_dir[600], adapter_dir[600], log_path[600], default_state[700];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(model_dir, sizeof model_dir, "%s/tiny", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapters", dir);
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    char state_dir[660];
    sp_state_dir(log_path, state_dir, sizeof state_dir);
    snprintf(default_state, sizeof default_state, "%s/state.json", state_dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
    cr_assert_eq(mkdir(adapter_dir, 0700), 0);
    tiny_spec spec = tiny_default();
    tiny_write_hf(model_dir, &spec);
}

static void teardown(void)
{
    sp_kill();
    test_rmtree(dir);
}

TestSuite(server_state, .init = setup, .fini = teardown, .timeout = 240);

/* Start the binary on the tiny model with the adapter folder and `extra`
 * (NULL-ended, may be NULL); the log starts afresh. */
static void start(const char *const *extra)
{
    const char *argv[32] = {QL_BINARY,  "serve", "--model",       model_dir,
                            "--port",   "0",     "--threads",     "2",
                            "--kv-mib", "16",    "--adapter-dir", adapter_dir};
    size_t n = 12;
    for (size_t i = 0; extra && extra[i] && n < 31; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    unlink(log_path);
    sp_spawn(argv, log_path);
    sp_wait_ready();
}

/* An adapter folder `name` under the adapter folder. */
static void write_adapter(const char *name, uint64_t seed)
{
    lora_fix_spec s = lora_fix_default();
    s.seed = seed;
    s.std = 0.2f; /* enough to change this model's greedy answers */
    lora_fix_write_tiny(adapter_dir, name, NULL, &s);
}

/* method path (body may be NULL): the answer, which must have `status`
 * (the caller's to cJSON_Delete). */
static cJSON *call(const char *method, const char *path, const char *body, int status)
{
    hc_response r;
    cr_assert(hc_request(sp.port, method, path, NULL, body, &r), "%s %s: no response", method,
              path);
    cr_assert_eq(r.status, status, "%s %s -> %d %s", method, path, r.status, r.body);
    cJSON *j = sp_json(r.body);
    hc_response_free(&r);
    return j;
}

static void load(const char *name, const char *path, double scale)
{
    char body[800];
    snprintf(body, sizeof body, "{\"name\": \"%s\", \"path\": \"%s\", \"scale\": %g}", name, path,
             scale);
    cJSON_Delete(call("POST", "/admin/adapters", body, 201));
}

/* The journal at path, which must be valid JSON with version 1 (the
 * caller's to cJSON_Delete). */
static cJSON *journal(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "no state file %s", path);
    char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    cJSON *j = cJSON_Parse(text);
    cr_assert(j, "state file %s is not JSON: %s", path, text);
    cr_assert_eq(sp_num_at(j, "version"), 1);
    return j;
}

/* The names of the journal's "adapters" or "merged", comma-joined. */
static void journal_names(const cJSON *j, const char *list, char *out, size_t len)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(j, list), *e;
    cr_assert(cJSON_IsArray(arr), "\"%s\"", list);
    out[0] = 0;
    cJSON_ArrayForEach (e, arr)
        snprintf(out + strlen(out), len - strlen(out), "%s%s", out[0] ? "," : "",
                 sp_str_at(e, "name"));
}

/* The journal at path lists `adapters` and `merged` (comma-joined names). */
static void journal_holds(const char *path, const char *adapters, const char *merged)
{
    cJSON *j = journal(path);
    char names[512];
    journal_names(j, "adapters", names, sizeof names);
    cr_assert_str_eq(names, adapters);
    journal_names(j, "merged", names, sizeof names);
    cr_assert_str_eq(names, merged);
    cJSON_Delete(j);
}

/* A greedy /generate's text (adapter NULL: the base), into out. */
static void greedy(const char *adapter, char *out, size_t len)
{
    char body[400];
    snprintf(body, sizeof body,
             "{\"inputs\": \"Hello there\", \"parameters\": {\"max_new_tokens\": 12, "
             "\"do_sample\": false%s%s%s}}",
             adapter ? ", \"adapter_id\": \"" : "", adapter ? adapter : "", adapter ? "\"" : "");
    cJSON *j = call("POST", "/generate", body, 200);
    snprintf(out, len, "%s", sp_str_at(j, "generated_text"));
    cJSON_Delete(j);
}

/* What a restart must keep, as text: each adapter's name, scale, merged
 * and merged scale, bytes and rank, in order; the weights' digest and the
 * merged list. */
static void snapshot(char *out, size_t len)
{
    cJSON *list = call("GET", "/admin/adapters", NULL, 200);
    const cJSON *e;
    out[0] = 0;
    cJSON_ArrayForEach (e, cJSON_GetObjectItemCaseSensitive(list, "adapters")) {
        const cJSON *ms = cJSON_GetObjectItemCaseSensitive(e, "merged_scale");
        snprintf(out + strlen(out), len - strlen(out),
                 "%s scale %g merged %d at %g bytes %g r %g; ", sp_str_at(e, "name"),
                 sp_num_at(e, "scale"), cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "merged")),
                 cJSON_IsNumber(ms) ? ms->valuedouble : 0.0, sp_num_at(e, "bytes"),
                 sp_num_at(e, "rank"));
    }
    cJSON_Delete(list);
    cJSON *st = call("GET", "/admin/state", NULL, 200);
    snprintf(out + strlen(out), len - strlen(out), "digest %s merged",
             sp_str_at(st, "weights_digest"));
    cJSON_ArrayForEach (e, cJSON_GetObjectItemCaseSensitive(st, "merged"))
        snprintf(out + strlen(out), len - strlen(out), " %s@%g", sp_str_at(e, "name"),
                 sp_num_at(e, "scale"));
    cJSON_Delete(st);
}

/* /admin/state's restore_errors (the caller's to cJSON_Delete, with the
 * state it came in: *state). */
static const cJSON *restore_errors(cJSON **state)
{
    *state = call("GET", "/admin/state", NULL, 200);
    const cJSON *errs = cJSON_GetObjectItemCaseSensitive(*state, "restore_errors");
    cr_assert(cJSON_IsArray(errs));
    return errs;
}

static bool exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

Test(server_state, a_restart_brings_back_the_adapters_the_merges_and_the_same_answers)
{
    write_adapter("a", 11);
    write_adapter("b", 12);
    start(NULL);
    char base[256], text_a[256], text_b[256];
    greedy(NULL, base, sizeof base);
    cr_assert(!exists(default_state), "nothing changed yet: nothing written");
    load("a", "a", 0.75);
    journal_holds(default_state, "a", "");
    load("b", "b", 1.0);
    journal_holds(default_state, "a,b", "");
    cJSON_Delete(call("POST", "/admin/adapters/b/merge", "{\"scale\": 0.5}", 200));
    journal_holds(default_state, "a,b", "b");
    cJSON_Delete(call("POST", "/admin/adapters/a/merge", "{\"into\": \"int8\"}", 200));
    journal_holds(default_state, "a,b", "b,a");
    cJSON_Delete(call("POST", "/admin/adapters/b/unmerge", NULL, 200));
    journal_holds(default_state, "a,b", "a");
    /* the journal holds the resolved path and the default scale */
    cJSON *j = journal(default_state);
    const cJSON *a0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "adapters"), 0);
    char real[PATH_MAX];
    cr_assert(realpath(adapter_dir, real));
    strcat(real, "/a");
    cr_assert_str_eq(sp_str_at(a0, "path"), real);
    cr_assert_eq(sp_num_at(a0, "scale"), 0.75);
    const cJSON *m0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "merged"), 0);
    cr_assert_str_eq(sp_str_at(m0, "into"), "int8");
    cJSON_Delete(j);
    /* the base while a is merged carries a's modules' int8 rounding: the
     * answer to compare is this configuration's */
    char merged_base[256];
    greedy("a", text_a, sizeof text_a);
    greedy("b", text_b, sizeof text_b);
    greedy(NULL, merged_base, sizeof merged_base);
    cr_assert_str_neq(text_a, base, "the adapter changes the answer (else nothing is pinned)");
    char before[2048];
    snapshot(before, sizeof before);
    sp_stop_cleanly();

    start(NULL);
    char after[2048], again[256];
    snapshot(after, sizeof after);
    cr_assert_str_eq(after, before);
    greedy("a", again, sizeof again);
    cr_assert_str_eq(again, text_a, "the merged adapter's answer");
    greedy("b", again, sizeof again);
    cr_assert_str_eq(again, text_b);
    greedy(NULL, again, sizeof again);
    cr_assert_str_eq(again, merged_base);
    cJSON *st;
    cr_assert_eq(cJSON_GetArraySize(restore_errors(&st)), 0);
    cr_assert_str_eq(sp_str_at(st, "state_file"), default_state);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(st, "state_file_error")));
    cJSON_Delete(st);
    char *log = sp_read_log();
    cr_assert(strstr(log, "2 adapters loaded, 1 merged"), "%s", log);
    free(log);
    /* and the journal keeps following: an unload */
    cJSON_Delete(call("DELETE", "/admin/adapters/b", NULL, 200));
    journal_holds(default_state, "a", "a");
    sp_stop_cleanly();
}

Test(server_state, an_adapter_that_is_gone_is_reported_by_name_and_the_rest_come_back)
{
    write_adapter("a", 11);
    write_adapter("b", 12);
    start(NULL);
    cJSON *st = call("GET", "/admin/state", NULL, 200);
    char base_digest[32];
    snprintf(base_digest, sizeof base_digest, "%s", sp_str_at(st, "weights_digest"));
    cJSON_Delete(st);
    load("a", "a", 1.0);
    load("b", "b", 0.5);
    cJSON_Delete(call("POST", "/admin/adapters/a/merge", NULL, 200));
    sp_stop_cleanly();
    char gone[700];
    snprintf(gone, sizeof gone, "%s/a", adapter_dir);
    test_rmtree(gone);

    start(NULL);
    cJSON *list = call("GET", "/admin/adapters", NULL, 200);
    const cJSON *adapters = cJSON_GetObjectItemCaseSensitive(list, "adapters");
    cr_assert_eq(cJSON_GetArraySize(adapters), 1);
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(adapters, 0), "name"), "b");
    cr_assert_eq(sp_num_at(cJSON_GetArrayItem(adapters, 0), "scale"), 0.5);
    cJSON_Delete(list);
    const cJSON *errs = restore_errors(&st);
    cr_assert_eq(cJSON_GetArraySize(errs), 2, "a's load and a's merge");
    const cJSON *e0 = cJSON_GetArrayItem(errs, 0), *e1 = cJSON_GetArrayItem(errs, 1);
    cr_assert_str_eq(sp_str_at(e0, "name"), "a");
    cr_assert(strstr(sp_str_at(e0, "path"), "/adapters/a"), "%s", sp_str_at(e0, "path"));
    cr_assert(strstr(sp_str_at(e0, "error"), "No such file"), "%s", sp_str_at(e0, "error"));
    cr_assert_str_eq(sp_str_at(e1, "name"), "a");
    cr_assert(strstr(sp_str_at(e1, "error"), "merge skipped"), "%s", sp_str_at(e1, "error"));
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(st, "merged")), 0);
    cr_assert_str_eq(sp_str_at(st, "weights_digest"), base_digest, "nothing merged");
    cJSON_Delete(st);
    char *log = sp_read_log();
    cr_assert(strstr(log, "adapter a ("), "the log names it: %s", log);
    free(log);
    sp_stop_cleanly();
}

Test(server_state, a_state_file_that_does_not_parse_is_reported_and_kept_aside)
{
    char path[700], aside[720];
    snprintf(path, sizeof path, "%s/state.json", dir);
    snprintf(aside, sizeof aside, "%s.bad", path);
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    fputs("{\"version\": 1, \"adapters\": [{\"name\": \"a\"", f);
    fclose(f);
    write_adapter("a", 11);
    const char *extra[] = {"--state-file", path, NULL};
    start(extra);
    cJSON *st;
    const cJSON *errs = restore_errors(&st);
    cr_assert_eq(cJSON_GetArraySize(errs), 1);
    const cJSON *e = cJSON_GetArrayItem(errs, 0);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(e, "name")), "the file itself");
    cr_assert_str_eq(sp_str_at(e, "path"), path);
    cr_assert(strstr(sp_str_at(e, "error"), "not valid JSON"), "%s", sp_str_at(e, "error"));
    cr_assert(strstr(sp_str_at(e, "error"), aside), "%s", sp_str_at(e, "error"));
    cr_assert_eq(sp_num_at(st, "adapters_loaded"), 0);
    cJSON_Delete(st);
    char *log = sp_read_log();
    cr_assert(strstr(log, "not valid JSON") && strstr(log, path), "%s", log);
    free(log);
    cr_assert(!exists(path) && exists(aside));
    /* the next change writes a new journal; the bad one stays as it was */
    load("a", "a", 1.0);
    journal_holds(path, "a", "");
    f = fopen(aside, "rb");
    cr_assert(f);
    char text[256];
    text[fread(text, 1, sizeof text - 1, f)] = 0;
    fclose(f);
    cr_assert_str_eq(text, "{\"version\": 1, \"adapters\": [{\"name\": \"a\"");
    sp_stop_cleanly();
}

Test(server_state, a_journal_that_cannot_be_written_leaves_the_change_and_is_written_later)
{
    char path[700], inside[720];
    snprintf(path, sizeof path, "%s/state.json", dir);
    snprintf(inside, sizeof inside, "%s/x", path);
    write_adapter("a", 11);
    write_adapter("b", 12);
    const char *extra[] = {"--state-file", path, NULL};
    start(extra);
    /* a folder (not empty) where the journal goes: rename cannot replace it */
    cr_assert_eq(mkdir(path, 0700), 0);
    cr_assert_eq(mkdir(inside, 0700), 0);
    load("a", "a", 1.0);
    cJSON *st = call("GET", "/admin/state", NULL, 200);
    cr_assert_eq(sp_num_at(st, "adapters_loaded"), 1, "the load stands");
    const char *err = sp_str_at(st, "state_file_error");
    cr_assert(strstr(err, path) && strstr(err, "rename"), "%s", err);
    cJSON_Delete(st);
    test_rmtree(path);
    load("b", "b", 1.0);
    journal_holds(path, "a,b", "");
    st = call("GET", "/admin/state", NULL, 200);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(st, "state_file_error")));
    cJSON_Delete(st);
    sp_stop_cleanly();
}

Test(server_state, an_explicit_state_file_that_cannot_be_written_stops_the_server)
{
    char path[700];
    snprintf(path, sizeof path, "%s/no-such-folder/state.json", dir);
    const char *argv[] = {QL_BINARY,       "serve",     "--model",      model_dir, "--port", "0",
                          "--adapter-dir", adapter_dir, "--state-file", path,      NULL};
    sp_spawn(argv, log_path);
    int st = 0;
    cr_assert_eq(waitpid(sp.pid, &st, 0), sp.pid);
    sp.pid = -1;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0);
    char *log = sp_read_log();
    cr_assert(strstr(log, "--state-file") && strstr(log, path), "%s", log);
    cr_assert_null(strstr(log, "listening"), "%s", log);
    free(log);
}

Test(server_state, an_unusable_default_warns_and_none_writes_nothing)
{
    /* a file where the default state directory's parent should be: the
     * default state file cannot be made, which only warns */
    char xdg[700];
    snprintf(xdg, sizeof xdg, "%s/xdg-state", dir);
    FILE *f = fopen(xdg, "wb");
    cr_assert(f);
    fclose(f);
    start(NULL);
    char *log = sp_read_log();
    cr_assert(strstr(log, "warning: state file") && strstr(log, "xdg-state"), "%s", log);
    free(log);
    cJSON *st = call("GET", "/admin/state", NULL, 200);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(st, "state_file")));
    cJSON_Delete(st);
    sp_stop_cleanly();
    unlink(xdg);

    write_adapter("a", 11);
    const char *extra[] = {"--state-file", "none", NULL};
    start(extra);
    load("a", "a", 1.0);
    cr_assert(!exists(default_state));
    log = sp_read_log();
    cr_assert_null(strstr(log, "warning: state file"), "%s", log);
    free(log);
    sp_stop_cleanly();
}

/* --- the journal is no trusted input --------------------------------------------- */

/* A journal an uploader could have written: an adapter that is fine (a),
 * one whose name would end a /metrics line and forge a series, and a merge
 * of a at a scale no admin request may ask, without safe_merge. */
static void write_forged_journal(const char *path)
{
    FILE *f = fopen(path, "wb");
    cr_assert(f, "cannot write %s", path);
    fputs("{\"version\": 1, \"adapters\": ["
          "{\"name\": \"a\", \"path\": \"a\", \"scale\": 1},"
          "{\"name\": \"\\\"} 1\\nforged_metric 31337\\n#\", \"path\": \"b\", \"scale\": 1},"
          "{\"name\": \"c\", \"path\": \"c\\nforged_line\", \"scale\": 1}],"
          " \"merged\": [{\"name\": \"a\", \"scale\": 1000000, \"into\": null,"
          " \"safe_merge\": false}]}\n",
          f);
    fclose(f);
}

/* GET /metrics' text (the caller's to free). */
static char *metrics_text(void)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/metrics", NULL, NULL, &r));
    cr_assert_eq(r.status, 200);
    char *text = strdup(r.body);
    hc_response_free(&r);
    return text;
}

/* The old default place, the adapter folder, is one an uploader can write:
 * a journal there is not the server's and is never replayed; the server's
 * own goes to its state directory. */
Test(server_state, a_journal_in_the_adapter_folder_is_not_replayed)
{
    write_adapter("a", 11);
    write_adapter("b", 12);
    char planted[700];
    snprintf(planted, sizeof planted, "%s/.qlserve-state.json", adapter_dir);
    write_forged_journal(planted);
    start(NULL);
    cJSON *list = call("GET", "/admin/adapters", NULL, 200);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(list, "adapters")), 0,
                 "the planted journal was replayed");
    cJSON_Delete(list);
    char *text = metrics_text();
    cr_assert_null(strstr(text, "forged_metric"), "%s", text);
    free(text);
    text = sp_read_log();
    cr_assert(strstr(text, ".qlserve-state.json is not read"), "no warning: %s", text);
    free(text);
    load("a", "a", 1.0);
    journal_holds(default_state, "a", "");
    struct stat sb;
    cr_assert_eq(stat(default_state, &sb), 0);
    cr_assert_eq(sb.st_mode & 0777, 0600, "the journal is the server's alone: %o", sb.st_mode);
    sp_stop_cleanly();
}

/* A journal's names and scales pass the admin API's own checks on replay:
 * the forged name and the merge at 1e6 are refused by name with the reason
 * (log and /admin/state), the valid adapter comes back and serves, and
 * /metrics holds no forged series. */
Test(server_state, forged_names_and_scales_in_a_journal_are_refused_on_replay)
{
    write_adapter("a", 11);
    write_adapter("b", 12);
    char path[700];
    snprintf(path, sizeof path, "%s/state.json", dir);
    write_forged_journal(path);
    const char *extra[] = {"--state-file", path, NULL};
    start(extra);
    cJSON *st;
    const cJSON *errs = restore_errors(&st);
    cr_assert_eq(cJSON_GetArraySize(errs), 3, "the forged name, the forged path and the merge");
    const cJSON *e0 = cJSON_GetArrayItem(errs, 0), *e1 = cJSON_GetArrayItem(errs, 2);
    const cJSON *e_path = cJSON_GetArrayItem(errs, 1);
    cr_assert_str_eq(sp_str_at(e_path, "name"), "c");
    cr_assert_null(strchr(sp_str_at(e_path, "path"), '\n'), "%s", sp_str_at(e_path, "path"));
    cr_assert(strstr(sp_str_at(e0, "error"), "not a name the admin API takes"), "%s",
              sp_str_at(e0, "error"));
    cr_assert(strstr(sp_str_at(e0, "error"), "\\x0aforged_metric"), "the name shown escaped: %s",
              sp_str_at(e0, "error"));
    cr_assert_str_eq(sp_str_at(e1, "name"), "a");
    cr_assert(strstr(sp_str_at(e1, "error"), "scale 1e+06"), "%s", sp_str_at(e1, "error"));
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(st, "merged")), 0);
    cJSON_Delete(st);
    cJSON *list = call("GET", "/admin/adapters", NULL, 200);
    const cJSON *adapters = cJSON_GetObjectItemCaseSensitive(list, "adapters");
    cr_assert_eq(cJSON_GetArraySize(adapters), 1);
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(adapters, 0), "name"), "a");
    cJSON_Delete(list);
    char answer[256];
    greedy("a", answer, sizeof answer); /* still serving what was valid */
    char *text = metrics_text();
    cr_assert_null(strstr(text, "forged_metric"), "%s", text);
    free(text);
    char *log = sp_read_log();
    cr_assert(strstr(log, "not a name the admin API takes"), "%s", log);
    cr_assert_null(strstr(log, "\nforged_metric"), "the log holds the name raw: %s", log);
    cr_assert_null(strstr(log, "\nforged_line"), "the log holds the path raw: %s", log);
    free(log);
    sp_stop_cleanly();
}

/* Every label value /metrics prints goes through one escape: backslash,
 * double quote and newline (Prometheus' text format), and nothing else. */
Test(metrics, label_values_escape_backslash_quote_and_newline)
{
    char out[64];
    cr_assert_eq(srv_prom_label_escape(out, sizeof out, "a\"} 1\nb\\c"), 12);
    cr_assert_str_eq(out, "a\\\"} 1\\nb\\\\c");
    cr_assert_eq(srv_prom_label_escape(out, sizeof out, "plain-name_1.0"), 14);
    cr_assert_str_eq(out, "plain-name_1.0");
    /* cut short, never in the middle of an escape; the whole length told */
    cr_assert_eq(srv_prom_label_escape(out, 3, "a\"b"), 4);
    cr_assert_str_eq(out, "a");
    cr_assert_eq(srv_prom_label_escape(NULL, 0, "\n\n"), 4);
}

/*
 * admin.c - the admin routes: list, load (POST /admin/adapters, the path
 * under --adapter-dir), unload, merge into and unmerge from the base
 * weights, the weights' state (version, digest, what is merged), and the
 * engine's step gate (pause after N steps, resume, and what it holds).
 *
 * Offers srv_admin_gate, which every path under /admin/ passes first: the
 * bearer token, compared in constant time, or, with no token configured,
 * a loopback client; then a loaded model. Offers the route handlers
 * srv_admin_*. Loading reads files and merging rewrites weights, so both
 * run on libuv's thread pool (bridge.c's srv_work_start) and answer from
 * the loop; a client that has gone meanwhile is nobody's to answer.
 * Touches the adapter registry (adapters/lora.h), the metrics' merge
 * counters, request.c's helpers and http.c's error response.
 */
#include "internal/server_internal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* --- who may ---------------------------------------------------------------------- */

/* The registry is there once the model has loaded. */
static bool model_ready(srv_conn *c)
{
    if (!c->s->serving || !c->s->registry) {
        srv_fail(c, 503, "the model is still loading");
        return false;
    }
    return true;
}

/* Equal, in time that depends on the lengths only. */
static bool same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned diff = (unsigned)(la ^ lb);
    for (size_t i = 0; i < la; i++)
        diff |= (unsigned char)a[i] ^ (unsigned char)b[i % (lb ? lb : 1)];
    return diff == 0;
}

/* The bearer token, or a loopback client when none is configured. */
static bool admin_allowed(srv_conn *c)
{
    const char *token = c->s->cfg->admin_token;
    if (!token) {
        if (!c->loopback) {
            srv_fail(
                c, 403,
                "admin routes answer only to loopback clients when no admin token is configured");
            return false;
        }
        return true;
    }
    const char *h = c->req.authorization;
    if (c->req.auth_too_long || strncasecmp(h, "Bearer ", 7) != 0 || !same_secret(h + 7, token)) {
        srv_respond_error(c, 401, "unauthorized", "a valid admin bearer token is required",
                          "WWW-Authenticate: Bearer\r\n");
        return false;
    }
    return true;
}

bool srv_admin_gate(srv_conn *c)
{
    return admin_allowed(c) && model_ready(c);
}

/* --- answers ---------------------------------------------------------------------- */

/* A lora_info as JSON. */
static cJSON *info_json(const lora_info *in)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", in->name);
    cJSON_AddStringToObject(o, "path", in->path);
    cJSON_AddNumberToObject(o, "rank", in->meta.r);
    cJSON_AddNumberToObject(o, "alpha", in->meta.alpha);
    cJSON_AddBoolToObject(o, "use_rslora", in->meta.use_rslora);
    cJSON_AddStringToObject(o, "targets", in->meta.targets);
    cJSON_AddNumberToObject(o, "modules", in->meta.n_modules);
    cJSON_AddStringToObject(o, "base_model", in->meta.base_model);
    cJSON_AddNumberToObject(o, "bytes", (double)in->bytes);
    cJSON_AddNumberToObject(o, "scale", in->scale);
    cJSON_AddBoolToObject(o, "merged", in->merged);
    if (in->merged)
        cJSON_AddNumberToObject(o, "merged_scale", in->merged_scale);
    cJSON_AddNumberToObject(o, "requests", (double)in->requests);
    if (in->last_merge.delta_sq > 0) {
        cJSON *lm = cJSON_AddObjectToObject(o, "last_merge");
        cJSON_AddNumberToObject(lm, "delta_retained", in->last_merge.delta_retained);
        cJSON_AddNumberToObject(lm, "relative_error", in->last_merge.relative_error);
        cJSON_AddNumberToObject(lm, "seconds", in->last_merge_seconds);
    }
    if (in->meta.warning[0])
        cJSON_AddStringToObject(o, "warning", in->meta.warning);
    return o;
}

void srv_admin_list(srv_conn *c, const char *name)
{
    (void)name;
    cJSON *root = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(root, "adapters");
    lora_info *list = NULL;
    size_t n = 0;
    if (lora_registry_list(c->s->registry, &list, &n) == QL_OK)
        for (size_t i = 0; i < n; i++)
            cJSON_AddItemToArray(arr, info_json(&list[i]));
    free(list);
    srv_respond_cjson(c, 200, root);
}

static cJSON *report_json(const lora_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "adapter", r->adapter);
    cJSON_AddNumberToObject(o, "version", (double)r->version);
    char digest[20];
    snprintf(digest, sizeof digest, "%016llx", (unsigned long long)r->digest);
    cJSON_AddStringToObject(o, "weights_digest", digest);
    cJSON_AddNumberToObject(o, "seconds", r->seconds);
    cJSON_AddNumberToObject(o, "modules_requantized", (double)r->n_modules);
    if (r->n_modules) {
        cJSON_AddNumberToObject(o, "delta_retained", r->overall.delta_retained);
        cJSON_AddNumberToObject(o, "relative_error", r->overall.relative_error);
        cJSON *mods = cJSON_AddArrayToObject(o, "modules");
        for (size_t i = 0; i < r->n_modules; i++) {
            const struct lora_module_cost *mc = &r->modules[i];
            cJSON *m = cJSON_CreateObject();
            char name[96];
            snprintf(name, sizeof name, "model.layers.%d.%s.%s", mc->layer,
                     eng_proj_parent(mc->proj), eng_proj_name(mc->proj));
            cJSON_AddStringToObject(m, "module", name);
            cJSON_AddStringToObject(m, "kind", qt_kind_name(mc->kind));
            cJSON_AddNumberToObject(m, "delta_retained", mc->cost.delta_retained);
            cJSON_AddNumberToObject(m, "relative_error", mc->cost.relative_error);
            cJSON_AddItemToArray(mods, m);
        }
    }
    return o;
}

/* --- loading, merging and unmerging: work off the loop ---------------------------- */

/* Resolve a client's adapter path under the adapter directory root:
 * relative, no "..", and (symlinks followed) still inside it
 * (lora_resolve_dir, the check the state file's replay makes too), into
 * out. On a pool thread: realpath waits on the file system, which may be a
 * network volume. False with the answer's status and sentence in w. */
static bool resolve_adapter_path(srv_work *w, const char *root, const char *path, char *out,
                                 size_t out_len)
{
    int rc = lora_resolve_dir(root, path, out, out_len, w->msg, sizeof w->msg);
    /* the root itself not resolving is the server's fault, not the client's */
    w->status = rc == QL_OK ? 0 : rc == QL_EIO ? 500 : srv_status_of(rc);
    return rc == QL_OK;
    return true;
}

/* w->path is the client's until resolved here. */
static void run_load(srv_work *w)
{
    char resolved[PATH_MAX];
    if (!resolve_adapter_path(w, w->s->cfg->adapter_dir, w->path, resolved, sizeof resolved)) {
        w->rc = QL_EINVAL;
        return;
    }
    snprintf(w->path, sizeof w->path, "%s", resolved);
    w->rc = lora_registry_load(w->s->registry, w->name, w->path, w->scale, &w->meta, w->msg,
                               sizeof w->msg);
}

static void done_load(srv_work *w)
{
    srv_conn *c = w->conn;
    if (!c)
        return;
    if (w->rc != QL_OK) {
        srv_fail(c, w->status ? w->status : srv_status_of(w->rc), "%s", w->msg);
        return;
    }
    /* the registry's own listing of it (bytes, requests) */
    lora_info *list = NULL, in = {0};
    size_t n = 0;
    snprintf(in.name, sizeof in.name, "%.127s", w->name);
    in.meta = w->meta;
    in.scale = w->scale;
    if (lora_registry_list(w->s->registry, &list, &n) == QL_OK)
        for (size_t i = 0; i < n; i++)
            if (strcmp(list[i].name, w->name) == 0)
                in = list[i];
    free(list);
    srv_respond_cjson(c, 201, info_json(&in));
}

static void run_merge(srv_work *w)
{
    lora_merge_opts o = {.safe_merge = w->safe_merge, .into = w->into};
    w->rc = lora_registry_merge(w->s->registry, w->name, w->scale, &o, &w->report, w->msg,
                                sizeof w->msg);
    w->has_report = w->rc == QL_OK;
}

static void run_unmerge(srv_work *w)
{
    w->rc = lora_registry_unmerge(w->s->registry, w->name, &w->report, w->msg, sizeof w->msg);
    w->has_report = w->rc == QL_OK;
}

static void done_merge(srv_work *w)
{
    srv_server *s = w->s;
    if (w->rc == QL_OK && w->run == run_merge)
        s->metrics.merges++;
    else if (w->rc == QL_OK)
        s->metrics.unmerges++;
    else
        s->metrics.merge_failures++;
    if (!w->conn)
        return;
    if (w->rc != QL_OK)
        srv_fail(w->conn, srv_status_of(w->rc), "%s", w->msg);
    else
        srv_respond_cjson(w->conn, 200, report_json(&w->report));
}

static srv_work *new_work(srv_conn *c, const char *name)
{
    srv_work *w = calloc(1, sizeof *w);
    if (!w) {
        srv_fail(c, 503, "out of memory");
        return NULL;
    }
    w->s = c->s;
    w->conn = c;
    snprintf(w->name, sizeof w->name, "%s", name);
    return w;
}

static void start_work(srv_conn *c, srv_work *w)
{
    c->work = w;
    if (srv_work_start(w) != 0) {
        c->work = NULL;
        free(w);
        srv_fail(c, 503, "cannot start the work");
    }
}

static bool valid_name(srv_conn *c, const char *name)
{
    if (!srv_is_adapter_name(name)) {
        srv_fail(c, 400, "\"name\" %.160s: 1 to 127 letters, digits, '-', '_' and '.'", name);
        return false;
    }
    return true;
}

void srv_admin_load(srv_conn *c, const char *name_in_path)
{
    (void)name_in_path;
    cJSON *root = srv_body_object(c);
    if (!root)
        return;
    static const char *const fields[] = {"name", "path", "scale", NULL};
    const char *name = NULL, *path = NULL;
    double scale = 1.0;
    bool ok = srv_only_known(c, root, "the body", fields) &&
              srv_get_string(c, root, "name", &name) && srv_get_string(c, root, "path", &path) &&
              srv_get_number(c, root, "scale", -100.0, 100.0, &scale, NULL);
    if (ok && (!name || !path)) {
        srv_fail(c, 400, "\"name\" and \"path\" are required");
        ok = false;
    }
    ok = ok && valid_name(c, name);
    if (ok && strcmp(name, c->s->model_id) == 0) {
        srv_fail(c, 409, "%s is the base model's name", name);
        ok = false;
    }
    if (ok && !c->s->cfg->adapter_dir) {
        srv_fail(c, 403, "adapter loading is off: start the server with --adapter-dir DIR");
        ok = false;
    }
    if (ok && strlen(path) >= sizeof((srv_work *)0)->path) {
        srv_fail(c, 400, "path is %zu bytes, longer than any path", strlen(path));
        ok = false;
    }
    srv_work *w = ok ? new_work(c, name) : NULL;
    if (w)
        snprintf(w->path, sizeof w->path, "%s", path); /* resolved by run_load */
    cJSON_Delete(root);
    if (!w)
        return;
    w->scale = (float)scale;
    w->run = run_load;
    w->done = done_load;
    start_work(c, w);
}

/* POST .../merge and .../unmerge: the same body checks, the merge's fields
 * only when merging. */
static void merge_or_unmerge(srv_conn *c, const char *name, bool merge)
{
    cJSON *root = c->req.body_len ? srv_body_object(c) : cJSON_CreateObject();
    if (!root)
        return;
    static const char *const fields[] = {"scale", "safe_merge", "into", NULL};
    static const char *const none[] = {NULL};
    /* the adapter's default scale unless the body names one (an unknown
     * adapter is refused by the merge itself) */
    eng_lora_term known = {NULL, 1.0f};
    lora_registry_want(c->s->registry, name, &known, NULL, 0);
    eng_lora_unref(known.lora);
    double scale = known.scale;
    bool safe = true;
    const char *into = NULL;
    bool ok = srv_only_known(c, root, "the body", merge ? fields : none) &&
              srv_get_number(c, root, "scale", -100.0, 100.0, &scale, NULL) &&
              srv_get_bool(c, root, "safe_merge", &safe) && srv_get_string(c, root, "into", &into);
    qt_kind kind = QT_KIND_COUNT;
    if (ok && into) {
        if (strcmp(into, "int8") == 0) {
            kind = QT_AFFINE;
        } else if (strcmp(into, "bf16") == 0) {
            kind = QT_BF16;
        } else {
            srv_fail(c, 400, "\"into\" %s: one of int8, bf16 (or absent: the weight's own kind)",
                     into);
            ok = false;
        }
    }
    cJSON_Delete(root);
    srv_work *w = ok ? new_work(c, name) : NULL;
    if (!w)
        return;
    w->scale = (float)scale;
    w->safe_merge = safe;
    w->into = kind;
    w->run = merge ? run_merge : run_unmerge;
    w->done = done_merge;
    start_work(c, w);
}

void srv_admin_merge(srv_conn *c, const char *name)
{
    merge_or_unmerge(c, name, true);
}

void srv_admin_unmerge(srv_conn *c, const char *name)
{
    merge_or_unmerge(c, name, false);
}

/* Unloading waits for a merge in progress (the merged configuration must
 * hold still), which takes seconds: off the loop. */
static void run_unload(srv_work *w)
{
    w->rc = lora_registry_unload(w->s->registry, w->name, w->msg, sizeof w->msg);
}

static void done_unload(srv_work *w)
{
    if (!w->conn)
        return;
    if (w->rc != QL_OK) {
        srv_fail(w->conn, srv_status_of(w->rc), "%s", w->msg);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "unloaded", w->name);
    srv_respond_cjson(w->conn, 200, root);
}

void srv_admin_unload(srv_conn *c, const char *name)
{
    srv_work *w = new_work(c, name);
    if (!w)
        return;
    w->run = run_unload;
    w->done = done_unload;
    start_work(c, w);
}

void srv_admin_state(srv_conn *c, const char *name)
{
    (void)name;
    lora_state st;
    lora_registry_state(c->s->registry, &st);
    cJSON *root = cJSON_CreateObject();
    srv_add_weights_identity(root, &st);
    cJSON_AddNumberToObject(root, "adapters_loaded", (double)st.n_loaded);
    cJSON_AddNumberToObject(root, "adapter_bytes", (double)st.bytes);
    cJSON_AddNumberToObject(root, "merges", (double)st.merges);
    cJSON_AddNumberToObject(root, "unmerges", (double)st.unmerges);
    /* the journal: where it is, whether its last write failed, and what
     * its replay at start could not bring back */
    if (st.state_file[0])
        cJSON_AddStringToObject(root, "state_file", st.state_file);
    else
        cJSON_AddNullToObject(root, "state_file");
    if (st.state_file_error[0])
        cJSON_AddStringToObject(root, "state_file_error", st.state_file_error);
    else
        cJSON_AddNullToObject(root, "state_file_error");
    cJSON *errors = cJSON_AddArrayToObject(root, "restore_errors");
    lora_restore_error *errs = NULL;
    size_t n_errs = 0;
    lora_registry_restore_errors(c->s->registry, &errs, &n_errs);
    for (size_t i = 0; i < n_errs; i++) {
        cJSON *e = cJSON_CreateObject();
        if (errs[i].name[0])
            cJSON_AddStringToObject(e, "name", errs[i].name);
        else
            cJSON_AddNullToObject(e, "name");
        cJSON_AddStringToObject(e, "path", errs[i].path);
        cJSON_AddStringToObject(e, "error", errs[i].error);
        cJSON_AddItemToArray(errors, e);
    }
    free(errs);
    srv_respond_cjson(c, 200, root);
}

/* --- the engine's step gate ------------------------------------------------------- */

/* GET /admin/engine: the gate (paused, and the steps it still lets run),
 * whether the engine has settled there, and what runs and waits. */
void srv_admin_engine(srv_conn *c, const char *name)
{
    (void)name;
    eng_engine_stats st;
    eng_engine_stats_get(c->s->engine, &st);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddBoolToObject(root, "paused", st.gate_steps >= 0);
    if (st.gate_steps >= 0)
        cJSON_AddNumberToObject(root, "steps_left", (double)st.gate_steps);
    else
        cJSON_AddNullToObject(root, "steps_left");
    cJSON_AddBoolToObject(root, "settled", st.settled);
    cJSON_AddNumberToObject(root, "steps", (double)st.steps);
    cJSON_AddNumberToObject(root, "running", st.running);
    cJSON_AddNumberToObject(root, "waiting", st.waiting);
    cJSON_AddNumberToObject(root, "tokens_generated", (double)st.tokens_generated);
    srv_respond_cjson(c, 200, root);
}

/* POST /admin/engine/pause, body empty or {"after_steps": N} (0 when
 * absent): the engine runs N more steps, then holds between two steps;
 * requests are still taken in, admitted and cancelled, streams stay open.
 * What an operator uses to hold generation (SGLang's pause_generation),
 * and how the tests hold a request running or waiting without timing. */
void srv_admin_pause(srv_conn *c, const char *name)
{
    int64_t steps = 0;
    if (c->req.body_len > 0) {
        cJSON *root = srv_body_object(c);
        if (!root)
            return;
        static const char *const fields[] = {"after_steps", NULL};
        bool ok = srv_only_known(c, root, "the body", fields) &&
                  srv_get_int(c, root, "after_steps", 0, 1e15, &steps, NULL);
        cJSON_Delete(root);
        if (!ok)
            return;
    }
    eng_engine_gate(c->s->engine, steps);
    srv_admin_engine(c, name);
}

/* POST /admin/engine/resume: every step runs again. */
void srv_admin_resume(srv_conn *c, const char *name)
{
    eng_engine_gate(c->s->engine, -1);
    srv_admin_engine(c, name);
}

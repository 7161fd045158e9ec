/*
 * admin.c - the admin routes: list, load (POST /admin/adapters, the path
 * under --adapter-dir), unload, merge into and unmerge from the base
 * weights, the weights' state (version, digest, what is merged), and the
 * engine's step gate (pause after N steps, resume, and what it holds).
 *
 * Offers srv_admin_gate, which every path under /admin/ passes first: the
 * bearer token in force, compared in constant time, or, with none, a
 * loopback client whose request no web page can have made (the trust
 * rules below); then a loaded model. Offers the Host rule routes.c applies
 * to every route (srv_admin_host_allowed). Offers the route handlers
 * srv_admin_*. Loading reads files and merging rewrites weights, so both
 * run on libuv's thread pool (pool_job.c's srv_pool_begin) and answer from
 * the loop; a client that has gone meanwhile is nobody's to answer.
 * Touches the adapter registry (adapters/lora.h), the metrics' merge
 * counters, request.c's helpers and http.c's error response.
 */
#include "internal/admin.h"
#include "internal/http.h"
#include "internal/pool_job.h"
#include "internal/request.h"
#include "internal/routes.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* --- who may: the Host, the token, a request no web page can make ------------------ */

/*
 * The trust rules. A web page the local user opens can send a "simple"
 * cross-site request to 127.0.0.1 (POST with a text/plain, form or no
 * body, no preflight), and through DNS rebinding can even read the answers
 * of a loopback server under its own name (Host: evil.example:PORT). So a
 * loopback peer alone proves nothing. Without an admin token the admin
 * routes answer a request only when it comes from loopback with a loopback
 * (or --allowed-hosts) Host and no Origin but this server's own, and, when
 * it changes state, with a JSON Content-Type, which no page can send
 * cross-site without a CORS preflight (a DELETE is always preflighted, so
 * it is spared the Content-Type). With a token
 * (--admin-token-file, or generated at start when --host is not loopback)
 * the bearer token alone decides: a page cannot know it. The Host rule
 * also guards every other route while it applies (srv_admin_host_rule_applies).
 */

/* The loopback names a Host header may carry for this machine's server
 * without --allowed-hosts: localhost, a 127.x.x.x literal, [::1]. A DNS
 * rebinding page's Host is its own DNS name, never one of these. */
static bool loopback_name(const char *name, size_t len)
{
    char text[INET6_ADDRSTRLEN + 2];
    if (len == 9 && strncasecmp(name, "localhost", 9) == 0)
        return true;
    if (len == 0 || len >= sizeof text)
        return false;
    memcpy(text, name, len);
    text[len] = 0;
    if (text[0] == '[' && text[len - 1] == ']') {
        text[len - 1] = 0;
        return srv_admin_is_loopback_address(text + 1);
    }
    return strchr(text, ':') == NULL && srv_admin_is_loopback_address(text);
}

bool srv_admin_is_loopback_address(const char *addr)
{
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, addr, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    return inet_pton(AF_INET6, addr, &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
}

/* Host's name (a DNS name, an IPv4 literal or a bracketed IPv6 one) and
 * its port (-1: none); false when it is no Host value at all. */
static bool split_host(const char *host, size_t *name_len, long *port)
{
    const char *colon = host[0] == '[' ? strchr(host, ']') : strrchr(host, ':');
    if (host[0] == '[') {
        if (!colon)
            return false;
        colon = colon[1] == ':' ? colon + 1 : colon[1] ? NULL : colon + 1;
        if (!colon)
            return false;
    }
    *name_len = colon ? (size_t)(colon - host) : strlen(host);
    *port = -1;
    if (!colon || !*colon)
        return *name_len > 0;
    char *end;
    *port = strtol(colon + 1, &end, 10);
    return *name_len > 0 && colon[1] >= '0' && colon[1] <= '9' && !*end && *port <= 65535;
}

/* Whether host (whole, name[:port]) or its name is in --allowed-hosts: an
 * entry with a port matches that Host exactly, one without matches the
 * name with any port, "*" anything. */
static bool listed_host(const char *list, const char *host, size_t name_len)
{
    size_t len;
    for (const char *at = list, *e; ql_list_next(&at, &e, &len);) {
        char entry[272];
        size_t entry_name;
        long entry_port;
        if (len == 0 || len >= sizeof entry)
            continue;
        memcpy(entry, e, len);
        entry[len] = 0;
        if (strcmp(entry, "*") == 0)
            return true;
        if (!split_host(entry, &entry_name, &entry_port))
            continue;
        if (entry_port >= 0 ? strcasecmp(entry, host) == 0
                            : entry_name == name_len && strncasecmp(entry, host, name_len) == 0)
            return true;
    }
    return false;
}

bool srv_admin_host_rule_applies(const srv_server *s)
{
    return !srv_admin_token(s) || srv_admin_is_loopback_address(s->cfg->host) ||
           s->cfg->allowed_hosts;
}

bool srv_admin_host_allowed(srv_conn *c)
{
    const srv_server *s = c->s;
    const char *host = c->req.host;
    if (!host[0] && !c->req.host_too_long)
        return true; /* no browser omits Host: an HTTP/1.0 probe or a raw socket */
    size_t name_len = 0;
    long port = -1;
    bool parsed = !c->req.host_too_long && split_host(host, &name_len, &port);
    if (parsed && loopback_name(host, name_len) && (port < 0 || !s->port || port == s->port))
        return true;
    if (parsed && listed_host(s->cfg->allowed_hosts, host, name_len))
        return true;
    srv_req_fail(c, 403,
                 "Host %.200s%s is not this server's: it answers localhost, 127.0.0.1 or [::1] "
                 "with port %d%s%s (a web page reaches a loopback server under its own name by DNS "
                 "rebinding); a reverse proxy or tunnel that sends another Host must be listed in "
                 "--allowed-hosts",
                 host, c->req.host_too_long ? "..." : "", s->port,
                 s->cfg->allowed_hosts ? ", or one of --allowed-hosts " : "",
                 s->cfg->allowed_hosts ? s->cfg->allowed_hosts : "");
    return false;
}

const char *srv_admin_token(const srv_server *s)
{
    if (s->cfg->admin_token)
        return s->cfg->admin_token;
    return s->generated_token[0] ? s->generated_token : NULL;
}

/* The registry is there once the model has loaded. */
static bool model_ready(srv_conn *c)
{
    if (!c->s->serving || !c->s->registry) {
        srv_req_fail(c, 503, "the model is still loading");
        return false;
    }
    return true;
}

/* Whether Origin, when there is one, is this server's own: the scheme and
 * the Host the request was sent to (the Host rule has passed). "null"
 * (sandboxed pages, file://) is nobody's own. */
static bool same_origin(const srv_conn *c)
{
    const char *o = c->req.origin;
    if (!o[0] && !c->req.cors_too_long)
        return true;
    const char *rest = strncasecmp(o, "http://", 7) == 0    ? o + 7
                       : strncasecmp(o, "https://", 8) == 0 ? o + 8
                                                            : NULL;
    return !c->req.cors_too_long && rest && c->req.host[0] && strcasecmp(rest, c->req.host) == 0;
}

/* Content-Type application/json, parameters (charset) allowed. */
static bool json_content_type(const srv_conn *c)
{
    const char *t = c->req.content_type + strspn(c->req.content_type, " \t");
    size_t n = strlen("application/json");
    return !c->req.content_type_too_long && strncasecmp(t, "application/json", n) == 0 &&
           (t[n] == 0 || t[n] == ';' || t[n] == ' ' || t[n] == '\t');
}

/* Without a token: a loopback peer (the Host rule has passed in
 * srv_route), no foreign Origin (a page's cross-origin read, which
 * --cors-allow-origin * would let it see, is refused too), and for a
 * request that changes state, but for DELETE, a JSON Content-Type. Each
 * refusal names its reason. */
static bool tokenless_allowed(srv_conn *c)
{
    if (!c->loopback) {
        srv_req_fail(
            c, 403,
            "admin routes answer only to loopback clients when no admin token is configured");
        return false;
    }
    if (!same_origin(c)) {
        srv_req_fail(c, 403,
                     "Origin %.200s is not this server's: without an admin token the admin routes "
                     "refuse requests from web pages (configure --admin-token-file for a browser "
                     "client)",
                     c->req.origin);
        return false;
    }
    uint8_t m = c->req.method;
    bool changes = m != HTTP_GET && m != HTTP_HEAD && m != HTTP_DELETE;
    if (changes && !json_content_type(c)) {
        srv_req_fail(
            c, 403,
            "Content-Type %.100s: without an admin token an admin request that changes "
            "state must be sent as Content-Type: application/json, which no web page can "
            "send cross-site unasked (curl: -H 'Content-Type: application/json' or --json)",
            c->req.content_type[0] ? c->req.content_type : "(none)");
        return false;
    }
    return true;
}

/* The bearer token in force, or the tokenless rules. */
static bool admin_allowed(srv_conn *c)
{
    const char *token = srv_admin_token(c->s);
    if (!token)
        return tokenless_allowed(c);
    const char *h = c->req.authorization;
    if (c->req.auth_too_long || strncasecmp(h, "Bearer ", 7) != 0 ||
        !srv_secret_equal(h + 7, strlen(h + 7), token)) {
        srv_http_respond_error(c, 401, "unauthorized", "a valid admin bearer token is required",
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
    if (in->last_used > 0) /* absent until a request asks for it */
        cJSON_AddNumberToObject(o, "last_used", (double)in->last_used);
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
    srv_req_respond_cjson(c, 200, root);
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
            char name[96], path[64];
            snprintf(name, sizeof name, "model.layers.%d.%s", mc->layer,
                     eng_proj_path(mc->proj, path, sizeof path));
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

/* What an adapter's load, merge, unmerge or unload works on: its
 * srv_pool_job's data, freed (with its report) by done_admin once answer
 * has run on the loop. */
typedef struct admin_job admin_job;
struct admin_job {
    char name[160];
    char path[4096]; /* load: the client's, until run_load resolves it */
    float scale;
    bool safe_merge; /* merge */
    qt_kind into;    /* merge: QT_KIND_COUNT for the weight's own kind */
    bool has_report;
    lora_report report; /* merge, unmerge */
    lora_meta meta;     /* load */
    /* on the loop: answer w's client (w->conn, NULL when it has gone) */
    void (*answer)(srv_pool_job *w, admin_job *j);
};

/* Resolve a client's adapter path under the adapter directory root:
 * relative, no "..", and (symlinks followed) still inside it
 * (lora_resolve_dir, the check the state file's replay makes too), into
 * out. On a pool thread: realpath waits on the file system, which may be a
 * network volume. False with the answer's status and sentence in w. */
static bool resolve_adapter_path(srv_pool_job *w, const char *root, const char *path, char *out,
                                 size_t out_len)
{
    int rc = lora_resolve_dir(root, path, out, out_len, w->msg, sizeof w->msg);
    /* the root itself not resolving is the server's fault, not the client's */
    w->status = rc == QL_OK ? 0 : rc == QL_EIO ? 500 : srv_req_status_of(rc);
    return rc == QL_OK;
    return true;
}

/* j->path is the client's until resolved here. */
static void run_load(srv_pool_job *w)
{
    admin_job *j = w->data;
    char resolved[PATH_MAX];
    if (!resolve_adapter_path(w, w->s->cfg->adapter_dir, j->path, resolved, sizeof resolved)) {
        w->rc = QL_EINVAL;
        return;
    }
    snprintf(j->path, sizeof j->path, "%s", resolved);
    w->rc = lora_registry_load(w->s->registry, j->name, j->path, j->scale, &j->meta, w->msg,
                               sizeof w->msg);
}

static void answer_load(srv_pool_job *w, admin_job *j)
{
    srv_conn *c = w->conn;
    if (!c)
        return;
    if (w->rc != QL_OK) {
        srv_req_fail(c, w->status ? w->status : srv_req_status_of(w->rc), "%s", w->msg);
        return;
    }
    /* the registry's own listing of it (bytes, requests) */
    lora_info *list = NULL, in = {0};
    size_t n = 0;
    snprintf(in.name, sizeof in.name, "%.127s", j->name);
    in.meta = j->meta;
    in.scale = j->scale;
    if (lora_registry_list(w->s->registry, &list, &n) == QL_OK)
        for (size_t i = 0; i < n; i++)
            if (strcmp(list[i].name, j->name) == 0)
                in = list[i];
    free(list);
    srv_req_respond_cjson(c, 201, info_json(&in));
}

static void run_merge(srv_pool_job *w)
{
    admin_job *j = w->data;
    lora_merge_opts o = {.safe_merge = j->safe_merge, .into = j->into};
    w->rc = lora_registry_merge(w->s->registry, j->name, j->scale, &o, &j->report, w->msg,
                                sizeof w->msg);
    j->has_report = w->rc == QL_OK;
}

static void run_unmerge(srv_pool_job *w)
{
    admin_job *j = w->data;
    w->rc = lora_registry_unmerge(w->s->registry, j->name, &j->report, w->msg, sizeof w->msg);
    j->has_report = w->rc == QL_OK;
}

static void answer_merge(srv_pool_job *w, admin_job *j)
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
        srv_req_fail(w->conn, srv_req_status_of(w->rc), "%s", w->msg);
    else
        srv_req_respond_cjson(w->conn, 200, report_json(&j->report));
}

/* A job for name (503 answered and NULL when memory is short). */
static admin_job *new_job(srv_conn *c, const char *name)
{
    admin_job *j = calloc(1, sizeof *j);
    if (!j) {
        srv_req_fail(c, 503, "out of memory");
        return NULL;
    }
    snprintf(j->name, sizeof j->name, "%s", name);
    return j;
}

/* The pool job's done: answer, then free what the job owned. */
static void done_admin(srv_pool_job *w)
{
    admin_job *j = w->data;
    j->answer(w, j);
    if (j->has_report)
        lora_report_free(&j->report);
    free(j);
    /* a load, merge or unload frees model-sized temporaries (the adapter
     * file read in, the quantizer's blocks) on a pool thread's arena:
     * their pages handed back (see weights.c's eng_weights_unref) */
    srv_http_trim_soon(w->s);
}

/* Run j on the pool for c and answer with answer; j is the job's from
 * here on (freed at once when the job cannot start, after the 503). */
static void start_job(srv_conn *c, admin_job *j, void (*run)(srv_pool_job *w),
                      void (*answer)(srv_pool_job *w, admin_job *j))
{
    j->answer = answer;
    if (srv_pool_begin(c, j, run, done_admin) != 0)
        free(j);
}

static bool valid_name(srv_conn *c, const char *name)
{
    if (!srv_req_is_adapter_name(name)) {
        srv_req_fail(c, 400, "\"name\" %.160s: 1 to 127 letters, digits, '-', '_' and '.'", name);
        return false;
    }
    return true;
}

void srv_admin_load(srv_conn *c, const char *name_in_path)
{
    (void)name_in_path;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    static const char *const fields[] = {"name", "path", "scale", NULL};
    const char *name = NULL, *path = NULL;
    double scale = 1.0;
    bool ok = srv_req_only_known(c, root, "the body", fields) &&
              srv_req_get_string(c, root, "name", &name) &&
              srv_req_get_string(c, root, "path", &path) &&
              srv_req_get_number(c, root, "scale", -LORA_SCALE_MAX, LORA_SCALE_MAX, &scale, NULL);
    if (ok && (!name || !path)) {
        srv_req_fail(c, 400, "\"name\" and \"path\" are required");
        ok = false;
    }
    ok = ok && valid_name(c, name);
    if (ok && strcmp(name, c->s->model_id) == 0) {
        srv_req_fail(c, 409, "%s is the base model's name", name);
        ok = false;
    }
    if (ok && !c->s->cfg->adapter_dir) {
        srv_req_fail(c, 403, "adapter loading is off: start the server with --adapter-dir DIR");
        ok = false;
    }
    if (ok && strlen(path) >= sizeof((admin_job *)0)->path) {
        srv_req_fail(c, 400, "path is %zu bytes, longer than any path", strlen(path));
        ok = false;
    }
    admin_job *j = ok ? new_job(c, name) : NULL;
    if (j)
        snprintf(j->path, sizeof j->path, "%s", path); /* resolved by run_load */
    cJSON_Delete(root);
    if (!j)
        return;
    j->scale = (float)scale;
    start_job(c, j, run_load, answer_load);
}

/* POST .../merge and .../unmerge: the same body checks, the merge's fields
 * only when merging. */
static void merge_or_unmerge(srv_conn *c, const char *name, bool merge)
{
    cJSON *root = c->req.body_len ? srv_req_body_object(c) : cJSON_CreateObject();
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
    bool ok = srv_req_only_known(c, root, "the body", merge ? fields : none) &&
              srv_req_get_number(c, root, "scale", -LORA_SCALE_MAX, LORA_SCALE_MAX, &scale, NULL) &&
              srv_req_get_bool(c, root, "safe_merge", &safe) &&
              srv_req_get_string(c, root, "into", &into);
    int choice = into ? ql_name_parse(&ql_into_names, into) : QL_INTO_OWN;
    if (ok && choice < 0) {
        char list[64];
        srv_req_fail(c, 400, "\"into\" %s: one of %s (or absent: the weight's own kind)", into,
                     ql_name_list(&ql_into_names, list, sizeof list));
        ok = false;
    }
    qt_kind kind = lora_into_kind(choice < 0 ? QL_INTO_OWN : (ql_into)choice);
    cJSON_Delete(root);
    admin_job *j = ok ? new_job(c, name) : NULL;
    if (!j)
        return;
    j->scale = (float)scale;
    j->safe_merge = safe;
    j->into = kind;
    start_job(c, j, merge ? run_merge : run_unmerge, answer_merge);
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
static void run_unload(srv_pool_job *w)
{
    admin_job *j = w->data;
    w->rc = lora_registry_unload(w->s->registry, j->name, w->msg, sizeof w->msg);
}

static void answer_unload(srv_pool_job *w, admin_job *j)
{
    if (!w->conn)
        return;
    if (w->rc != QL_OK) {
        srv_req_fail(w->conn, srv_req_status_of(w->rc), "%s", w->msg);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "unloaded", j->name);
    srv_req_respond_cjson(w->conn, 200, root);
}

void srv_admin_unload(srv_conn *c, const char *name)
{
    admin_job *j = new_job(c, name);
    if (j)
        start_job(c, j, run_unload, answer_unload);
}

void srv_admin_state(srv_conn *c, const char *name)
{
    (void)name;
    lora_state st;
    lora_registry_state(c->s->registry, &st);
    cJSON *root = cJSON_CreateObject();
    srv_req_add_weights_identity(root, &st);
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
    srv_req_respond_cjson(c, 200, root);
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
    srv_req_respond_cjson(c, 200, root);
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
        cJSON *root = srv_req_body_object(c);
        if (!root)
            return;
        static const char *const fields[] = {"after_steps", NULL};
        bool ok = srv_req_only_known(c, root, "the body", fields) &&
                  srv_req_get_int(c, root, "after_steps", 0, 1e15, &steps, NULL);
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

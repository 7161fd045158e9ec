/*
 * routes.c - the route table and what every route shares.
 *
 * Offers: srv_route (one table of {method, path, handler}; a path is
 * exact or holds one {name} segment), and to the API files (api_tgi.c,
 * api_openai.c, admin.c) the request helpers: the JSON body and its field
 * readers, errors, the one table from error codes to HTTP statuses, and
 * srv_generate, the submit every generation route ends in. Bodies are
 * checked field by field before anything is submitted: a wrong type or an
 * unknown field is a 400 naming the field; an unknown adapter is a 404.
 * Every path under /admin/, a route or not, first passes the admin gate
 * (admin.c).
 *
 * Every error is {"error": {"type", "message"}} with the status the
 * engine's or registry's code maps to (status_table).
 *
 * Touches: http.c's responses, serve.c's srv_gen_submit, the adapter
 * registry's lora_registry_want, metrics.c's text for GET /metrics.
 */
#include "internal/server_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* --- errors and answers -------------------------------------------------------- */

/* The HTTP status each error code of base/ql_base.h stands for: the one
 * table. A code not listed is the client's mistake (400). */
static const struct {
    int code;
    int status;
} status_table[] = {
    {QL_ENOTFOUND, 404}, {QL_ECONFLICT, 409}, {QL_EBUSY, 503},  {QL_ENONFINITE, 422},
    {QL_EFORMAT, 422},   {QL_EIO, 422},       {QL_ENOMEM, 503}, {QL_EDEVICE, 500},
};

int srv_status_of(int rc)
{
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].code == rc)
            return status_table[i].status;
    return 400;
}

static const char *type_of(int status)
{
    switch (status) {
    case 401: return "unauthorized";
    case 403: return "forbidden";
    case 404: return "not_found";
    case 409: return "conflict";
    case 413: return "invalid_request";
    case 422: return "unprocessable";
    case 503: return "overloaded";
    default: return status >= 500 ? "internal" : "invalid_request";
    }
}

void srv_fail(srv_conn *c, int status, const char *fmt, ...)
{
    char m[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    srv_respond_error(c, status, type_of(status), m, status == 503 ? "Retry-After: 1\r\n" : NULL);
}

void srv_respond_cjson(srv_conn *c, int status, cJSON *root)
{
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text) {
        srv_fail(c, 500, "out of memory");
        return;
    }
    srv_respond_json(c, status, text);
    free(text);
}

void srv_stream_cjson(srv_conn *c, cJSON *o)
{
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (text) {
        srv_stream_event(c, text, strlen(text));
        free(text);
    }
}

void srv_respond_generation(srv_conn *c, cJSON *o, eng_finish why)
{
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (why == ENG_FINISH_ERROR || !text)
        srv_respond_error(c, 500, "internal",
                          text ? "the engine failed this request" : "out of memory", NULL);
    else
        srv_respond_json(c, 200, text);
    free(text);
}

cJSON *srv_body_object(srv_conn *c)
{
    if (!c->req.body || c->req.body_len == 0) {
        srv_fail(c, 400, "the request needs a JSON object body");
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(c->req.body, c->req.body_len, &end, false);
    if (!root) {
        long at = end ? (long)(end - c->req.body) : 0;
        srv_fail(c, 400, "the body is not valid JSON (parsing stopped at byte %ld)", at);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        srv_fail(c, 400, "the body must be a JSON object");
        return NULL;
    }
    return root;
}

bool srv_only_known(srv_conn *c, const cJSON *obj, const char *where, const char *const *allowed)
{
    const cJSON *it;
    cJSON_ArrayForEach (it, obj) {
        bool ok = false;
        for (const char *const *a = allowed; *a && !ok; a++)
            ok = strcmp(it->string, *a) == 0;
        if (!ok) {
            srv_fail(c, 400, "%s: unknown field \"%s\"", where, it->string);
            return false;
        }
    }
    return true;
}

bool srv_is_null(const cJSON *v)
{
    return !v || cJSON_IsNull(v);
}

bool srv_get_number(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                    double *out, bool *present)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (present)
        *present = !srv_is_null(v);
    if (srv_is_null(v))
        return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) {
        srv_fail(c, 400, "\"%s\" must be a number", name);
        return false;
    }
    if (v->valuedouble < lo || v->valuedouble > hi) {
        srv_fail(c, 400, "\"%s\" is %g; it must be in [%g, %g]", name, v->valuedouble, lo, hi);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

bool srv_get_int(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                 int64_t *out, bool *present)
{
    double d = 0;
    bool have = false;
    if (!srv_get_number(c, obj, name, lo, hi, &d, &have))
        return false;
    if (present)
        *present = have;
    if (have) {
        if (d != floor(d)) {
            srv_fail(c, 400, "\"%s\" must be an integer, not %g", name, d);
            return false;
        }
        *out = (int64_t)d;
    }
    return true;
}

bool srv_get_bool(srv_conn *c, const cJSON *obj, const char *name, bool *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (srv_is_null(v))
        return true;
    if (!cJSON_IsBool(v)) {
        srv_fail(c, 400, "\"%s\" must be true or false", name);
        return false;
    }
    *out = cJSON_IsTrue(v);
    return true;
}

bool srv_get_string(srv_conn *c, const cJSON *obj, const char *name, const char **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (srv_is_null(v))
        return true;
    if (!cJSON_IsString(v)) {
        srv_fail(c, 400, "\"%s\" must be a string", name);
        return false;
    }
    *out = v->valuestring;
    return true;
}

/* --- generation ------------------------------------------------------------------ */

bool srv_get_stops(srv_conn *c, const cJSON *obj, const char *name, srv_ask *a)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (srv_is_null(v))
        return true;
    if (cJSON_IsString(v)) {
        a->stops[a->n_stops++] = v->valuestring;
        return true;
    }
    if (!cJSON_IsArray(v)) {
        srv_fail(c, 400, "\"%s\" must be a string or an array of strings", name);
        return false;
    }
    const cJSON *it;
    cJSON_ArrayForEach (it, v) {
        if (!cJSON_IsString(it) || !it->valuestring[0]) {
            srv_fail(c, 400, "\"%s\" must hold non-empty strings", name);
            return false;
        }
        if (a->n_stops == SRV_MAX_STOPS) {
            srv_fail(c, 400, "\"%s\": at most %d stop strings", name, SRV_MAX_STOPS);
            return false;
        }
        a->stops[a->n_stops++] = it->valuestring;
    }
    return true;
}

bool srv_get_sampling(srv_conn *c, const cJSON *p, srv_ask *a, bool greedy_default)
{
    double temperature = greedy_default ? 0.0 : 1.0, top_p = 1.0, penalty = 1.0;
    int64_t top_k = 0, seed = 0;
    bool has_t = false, has_seed = false, has_k = false, has_p = false;
    if (!srv_get_number(c, p, "temperature", 0.0, 100.0, &temperature, &has_t) ||
        !srv_get_number(c, p, "top_p", 0.0, 1.0, &top_p, &has_p) ||
        !srv_get_int(c, p, "top_k", 0, 1 << 24, &top_k, &has_k) ||
        !srv_get_number(c, p, "repetition_penalty", 0.0, 100.0, &penalty, NULL) ||
        !srv_get_int(c, p, "seed", 0, 9007199254740991.0, &seed, &has_seed))
        return false;
    if (greedy_default) {
        /* TGI: do_sample, or any sampling parameter, turns sampling on */
        bool do_sample = false;
        if (!srv_get_bool(c, p, "do_sample", &do_sample))
            return false;
        if (!do_sample && !has_t && !has_k && !has_p)
            temperature = 0.0;
        else if (!has_t)
            temperature = 1.0;
    }
    if (has_p && top_p == 0.0) {
        srv_fail(c, 400, "\"top_p\" must be in (0, 1]");
        return false;
    }
    a->sampling.temperature = (float)temperature;
    a->sampling.top_p = (float)top_p;
    a->sampling.top_k = (int32_t)top_k;
    a->sampling.repetition_penalty = (float)penalty;
    a->sampling.seed = has_seed ? (uint64_t)seed : (uint64_t)time(NULL) ^ (uint64_t)c->serial;
    return true;
}

/* The server's own limit on new tokens; the context length (prompt plus
 * new tokens) is checked by the engine at submit, which counts the
 * prompt's tokens once. */
static bool check_limits(srv_conn *c, const srv_ask *a)
{
    const cfg_serve *cfg = c->s->cfg;
    if (a->max_new_tokens > cfg->max_new_tokens) {
        srv_fail(c, 400, "max new tokens %lld is over the server's limit of %d",
                 (long long)a->max_new_tokens, cfg->max_new_tokens);
        return false;
    }
    return true;
}

static bool ready(srv_conn *c)
{
    if (c->s->draining) {
        srv_fail(c, 503, "the server is shutting down");
        return false;
    }
    if (!c->s->serving) {
        srv_fail(c, 503, "the model is still loading");
        return false;
    }
    return true;
}

void srv_generate(srv_conn *c, const srv_ask *a, const srv_shape *shape)
{
    if (!ready(c))
        return;
    /* the adapter and its default scale, when the request gives none */
    eng_lora_term term = {NULL, 1.0f};
    char msg[1024];
    if (a->adapter && a->adapter[0]) {
        if (!c->s->registry ||
            lora_registry_want(c->s->registry, a->adapter, &term, msg, sizeof msg) != QL_OK) {
            eng_lora_unref(term.lora);
            srv_fail(c, 404, "%s %s%s", shape->adapter_noun, a->adapter, shape->adapter_unknown);
            return;
        }
    }
    eng_lora *lora = term.lora;
    if (a->has_scale)
        term.scale = (float)a->adapter_scale;
    if (!check_limits(c, a)) {
        eng_lora_unref(lora);
        return;
    }
    srv_gen *g = calloc(1, sizeof *g);
    if (!g) {
        eng_lora_unref(lora);
        srv_fail(c, 503, "out of memory");
        return;
    }
    g->s = c->s;
    g->conn = c;
    g->shape = shape;
    g->details = a->details;
    g->include_usage = a->include_usage;
    g->return_full_text = a->return_full_text;
    g->seed = a->sampling.seed;
    g->sampled = a->sampling.temperature > 0;
    snprintf(g->model_id, sizeof g->model_id, "%s", lora ? lora->name : c->s->model_id);
    if (a->return_full_text)
        g->prompt = strdup(a->prompt);
    eng_request r = {.prompt = a->prompt,
                     .prompt_len = strlen(a->prompt),
                     .max_new_tokens = (int32_t)a->max_new_tokens,
                     .sampling = a->sampling,
                     .stop = a->stops,
                     .n_stop = a->n_stops,
                     .adapters = lora ? &term : NULL,
                     .n_adapters = lora ? 1 : 0};
    int rc = srv_gen_submit(g, &r, msg, sizeof msg);
    eng_lora_unref(lora); /* the engine took its own reference */
    if (rc != QL_OK) {
        free(g->prompt);
        free(g);
        srv_fail(c, srv_status_of(rc), "%s", msg);
        return;
    }
    c->gen = g;
    if (shape->stream)
        srv_stream_begin(c);
}

/* --- the server's own routes ------------------------------------------------------ */

static void health(srv_conn *c, const char *name)
{
    (void)name;
    srv_server *s = c->s;
    if (s->serving && !s->draining)
        srv_respond_json(c, 200, "{\"status\":\"ok\"}");
    else
        srv_fail(c, 503, s->draining ? "shutting down" : "the model is still loading");
}

static void metrics(srv_conn *c, const char *name)
{
    (void)name;
    size_t len = 0;
    char *text = srv_metrics_render(c->s, &len);
    if (!text) {
        srv_fail(c, 500, "out of memory");
        return;
    }
    srv_respond(c, 200, "text/plain; version=0.0.4", text, len, NULL);
    free(text);
}

/* --- the table ------------------------------------------------------------------------ */

/* Every route. A path with rows, none for the request's method, is a 405
 * that lists their methods in this order; a path with none is a 404. */
static const struct {
    uint8_t method;   /* llhttp_method_t */
    const char *path; /* exact, or with one {name} segment */
    srv_handler *handler;
} routes[] = {
    {HTTP_POST, "/generate", srv_tgi_generate},
    {HTTP_POST, "/generate_stream", srv_tgi_generate_stream},
    {HTTP_GET, "/info", srv_tgi_info},
    {HTTP_POST, "/v1/completions", srv_oai_completions},
    {HTTP_GET, "/v1/models", srv_oai_models},
    {HTTP_GET, "/health", health},
    {HTTP_GET, "/metrics", metrics},
    {HTTP_GET, "/admin/state", srv_admin_state},
    {HTTP_GET, "/admin/adapters", srv_admin_list},
    {HTTP_POST, "/admin/adapters", srv_admin_load},
    {HTTP_DELETE, "/admin/adapters/{name}", srv_admin_unload},
    {HTTP_POST, "/admin/adapters/{name}/merge", srv_admin_merge},
    {HTTP_POST, "/admin/adapters/{name}/unmerge", srv_admin_unmerge},
};

/* Whether path is pattern's; a {name} matches 1 to name_cap - 1 bytes
 * without '/', copied to name. */
static bool path_matches(const char *pattern, const char *path, char *name, size_t name_cap)
{
    const char *hole = strstr(pattern, "{name}");
    if (!hole)
        return strcmp(pattern, path) == 0;
    size_t before = (size_t)(hole - pattern);
    if (strncmp(path, pattern, before) != 0)
        return false;
    const char *rest = path + before;
    size_t n = strcspn(rest, "/");
    if (n == 0 || n >= name_cap || strcmp(rest + n, hole + strlen("{name}")) != 0)
        return false;
    memcpy(name, rest, n);
    name[n] = 0;
    return true;
}

void srv_route(srv_conn *c)
{
    /* the path, without the query string */
    char path[512];
    size_t n = c->req.url ? strcspn(c->req.url, "?") : 0;
    if (n == 0 || n >= sizeof path) {
        srv_fail(c, n ? 414 : 400, "the request target is missing or too long");
        return;
    }
    memcpy(path, c->req.url, n);
    path[n] = 0;
    if (strncmp(path, "/admin/", 7) == 0 && !srv_admin_gate(c))
        return;
    char name[160];        /* a {name}: one longer is no route (a srv_work holds 159) */
    char allowed[64] = ""; /* the methods path has, for the 405 */
    int n_allowed = 0;
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        bool has_name = strstr(routes[i].path, "{name}") != NULL;
        if (!path_matches(routes[i].path, path, name, sizeof name))
            continue;
        if (routes[i].method == c->req.method) {
            routes[i].handler(c, has_name ? name : NULL);
            return;
        }
        size_t at = strlen(allowed);
        snprintf(allowed + at, sizeof allowed - at, "%s%s", n_allowed ? " or " : "",
                 llhttp_method_name((llhttp_method_t)routes[i].method));
        n_allowed++;
    }
    if (n_allowed == 0)
        srv_fail(c, 404, "no route %s", path);
    else
        srv_fail(c, 405, "%s: %s%s", path, allowed, n_allowed == 1 ? " only" : "");
}

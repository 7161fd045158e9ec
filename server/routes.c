/*
 * routes.c - the route table: one table of {method, path, handler}, a
 * path exact or holding one {name} segment; a path with rows but none for
 * the method is a 405, a path with none a 404. Every path under /admin/, a
 * route or not, first passes the admin gate (admin.c).
 *
 * Offers srv_route (internal/server_internal.h), which serve.c sets as
 * the hooks' on_request; owns the table and the server's own routes,
 * GET /health and GET /metrics. Touches the handlers of api_tgi.c,
 * api_openai.c and admin.c, request.c's errors, http.c's responses and
 * metrics.c's text. Nothing in server/ but serve.c calls here.
 */
#include "internal/server_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    {HTTP_GET, "/", health}, /* TGI answers GET / as /health */
    {HTTP_POST, "/", srv_tgi_compat},
    {HTTP_POST, "/generate", srv_tgi_generate},
    {HTTP_POST, "/generate_stream", srv_tgi_generate_stream},
    {HTTP_GET, "/info", srv_tgi_info},
    {HTTP_POST, "/tokenize", srv_tgi_tokenize},
    {HTTP_POST, "/v1/completions", srv_oai_completions},
    {HTTP_POST, "/v1/chat/completions", srv_oai_chat},
    {HTTP_POST, "/chat_tokenize", srv_chat_tokenize},
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
